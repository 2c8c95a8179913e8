//go:build linux

package vsock_test

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkVsockVMToVM compares, between the two TCG VMs of
// TestVsockVMToVM (vhost-user-vsock served by hostd, no ivshmem), a
// connection on Shunt's fast path over vsock (each VM's stretch, its
// room's bridge, the flow's rings) with the kernel's TCP between the same
// VMs over virtio-net (through the host's routing), in 5 interleaved
// rounds (Shunt, then TCP): setup (dial, and for Shunt until the
// connection is on the rings), 2000 ping-pongs of 8 B (mean one-way) and
// a 32 MiB stream in 64 KiB writes, timed in VM A. Not in CI (go test
// runs no benchmarks): run as root with
//
//	go test -run '^$' -bench BenchmarkVsockVMToVM -benchtime 1x ./integration/vsock
func BenchmarkVsockVMToVM(b *testing.B) {
	const rounds, mib = 5, 32
	for i := 0; i < b.N; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		p := startVMPairWith(b, ctx, fmt.Sprintf("bserve:%d:%d:0", vm2vmPort, rounds),
			fmt.Sprintf("bclient:%d:%d:%d", vm2vmPort, rounds, mib))
		m := map[string]map[string][]float64{"shunt": {}, "tcp": {}}
		for r := 0; r < 2*rounds; r++ {
			prefix := fmt.Sprintf("SHUNT-VSOCK BENCH round=%d mode=%s ", r/2, []string{"shunt", "tcp"}[r%2])
			line, err := p.a.v.WaitAny(p.a.ctx, 0, prefix, "SHUNT-VSOCK ERROR")
			if err != nil || !strings.HasPrefix(line, prefix) {
				p.fail("benchmark: %q %v", line, err)
			}
			b.Logf("%s", line)
			f := fields(line)
			for _, k := range []string{"setup_us", "oneway_us", "mbps"} {
				v, _ := strconv.ParseFloat(f[k], 64)
				m[f["mode"]][k] = append(m[f["mode"]][k], v)
			}
			if f["mode"] == "shunt" && (f["ring"] == "0" || f["ring"] == "") {
				p.fail("a Shunt stream moved nothing on the rings: %q", line)
			}
		}
		cancel()
		med := func(v []float64) float64 { v = append([]float64(nil), v...); sort.Float64s(v); return v[len(v)/2] }
		for _, k := range []string{"setup_us", "oneway_us", "mbps"} {
			s, t := med(m["shunt"][k]), med(m["tcp"][k])
			b.Logf("%s: Shunt over vsock %v (median %.1f), virtio-net TCP %v (median %.1f), Shunt/TCP %.2fx", k, m["shunt"][k], s, m["tcp"][k], t, s/t)
		}
		b.ReportMetric(med(m["shunt"]["oneway_us"]), "shunt-us-oneway")
		b.ReportMetric(med(m["tcp"]["oneway_us"]), "tcp-us-oneway")
		b.ReportMetric(med(m["shunt"]["mbps"]), "shunt-MB/s")
		b.ReportMetric(med(m["tcp"]["mbps"]), "tcp-MB/s")
		b.ReportMetric(med(m["shunt"]["setup_us"]), "shunt-setup-us")
		b.ReportMetric(med(m["tcp"]["setup_us"]), "tcp-setup-us")
	}
}
