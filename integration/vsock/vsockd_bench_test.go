//go:build linux

package vsock_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// BenchmarkVsockdHop: what shunt-vsockd's extra hop costs (the guest's
// stretch forwarded through the daemon's Unix socket to hostd's bridge,
// one more copy each way) against hostd serving the device itself. Each
// round boots the VM of TestVsockProcessGuest once each way, interleaved
// (hostd, then shunt-vsockd), and times the exchange of 16 MiB each way
// at once at the process guest, from when the connection is on the rings
// (both ends said so) to both directions' end; MB/s is both directions'
// bytes over that time. Medians of 5 rounds. TCG, so the guest's CPU
// bounds it. Not in CI: run as root with
//
//	go test -run '^$' -bench BenchmarkVsockdHop -benchtime 1x ./integration/vsock
func BenchmarkVsockdHop(b *testing.B) {
	const rounds, n = 5, 16 << 20
	got := map[bool][]float64{}
	for r := 0; r < 2*rounds; r++ {
		daemon := r%2 == 1
		// A sub-benchmark each: its VM, hostd and daemon end with it.
		b.Run(fmt.Sprintf("round%d/vsockd=%v", r/2, daemon), func(b *testing.B) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			v := startVsockVMHow(b, ctx, vmHow{vsockd: daemon}, fmt.Sprintf("gdial:%d:%d:7", procPort, n))
			v.onRings(v.r.ctx)
			start := time.Now()
			host := exchange(v.r.ctx, v.c, 107, n)
			d := time.Since(start)
			if host.err != nil || host.n != n {
				v.fail("exchange: %d bytes, %v", host.n, host.err)
			}
			if st := v.c.(interface{ Stats() guestlib.Stats }).Stats(); st.RingReceived < n/2 || st.RingSent < n/2 {
				v.fail("the rings carried less than half the stream: %+v", st)
			}
			mbps := 2 * n / d.Seconds() / 1e6
			got[daemon] = append(got[daemon], mbps)
			b.ReportMetric(mbps, "MB/s")
		})
	}
	if len(got[false]) != rounds || len(got[true]) != rounds {
		b.Fatalf("rounds done: hostd %d, shunt-vsockd %d", len(got[false]), len(got[true]))
	}
	med := func(v []float64) float64 { v = append([]float64(nil), v...); sort.Float64s(v); return v[len(v)/2] }
	show := func(v []float64) string { return strings.Trim(fmt.Sprintf("%.1f", v), "[]") }
	h, d := med(got[false]), med(got[true])
	b.Logf("MB/s both ways: hostd's device %.1f (median of %s), shunt-vsockd's %.1f (median of %s), vsockd/hostd %.2fx", h, show(got[false]), d, show(got[true]), d/h)
}
