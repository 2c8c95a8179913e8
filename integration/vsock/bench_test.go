//go:build linux

package vsock_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sort"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/nsexec"
	"github.com/shuntnet/shunt/internal/testenv"
)

// BenchmarkVsockVM compares, in one TCG guest, its vsock stream to the
// host through this back-end with its kernel TCP to the host over
// virtio-net (a tap in a namespace of its own), in interleaved rounds:
// 8 B ping-pong (mean one-way) and a 64 MiB stream guest to host. Not in
// CI (go test runs no benchmarks): run as root with
//
//	go test -run '^$' -bench BenchmarkVsockVM -benchtime 1x ./integration/vsock
//
// The guest does no hashing here; the host discards what it reads.
func BenchmarkVsockVM(b *testing.B) {
	testenv.NeedRoot(b)
	const rounds, pongs, stream = 5, 2000, 64 << 20
	ns := fmt.Sprintf("shunt-vsock-bench-%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		b.Fatalf("ip netns add: %v %s", err, out)
	}
	defer exec.Command("ip", "netns", "del", ns).Run()
	nsPath := "/run/netns/" + ns
	var phases []string
	for i := 0; i < rounds; i++ {
		phases = append(phases, fmt.Sprintf("vpong:%d:%d:0", 6000+i, pongs), fmt.Sprintf("tpong:%d:%d:0", 7000+i, pongs),
			fmt.Sprintf("vstream:%d:%d:0", 6100+i, stream), fmt.Sprintf("tstream:%d:%d:0", 7100+i, stream))
	}
	for i := 0; i < b.N; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		r := bootNet(b, ctx, "", nsPath, phases...)
		ctx = r.ctx // ends when QEMU does
		lat := map[string][]float64{}
		bw := map[string][]float64{}
		for i := 0; i < rounds; i++ {
			for _, m := range []string{"vpong", "tpong", "vstream", "tstream"} {
				port := map[string]int{"vpong": 6000, "tpong": 7000, "vstream": 6100, "tstream": 7100}[m] + i
				c, err := r.accept(ctx, m[0] == 'v', nsPath, port)
				if err != nil {
					b.Fatalf("%s round %d: %v\n%s", m, i, err, r.state())
				}
				start := time.Now()
				var ru0, ru1 syscall.Rusage
				syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
				if m[1:] == "pong" {
					msg := make([]byte, 8)
					for k := 0; k < pongs; k++ {
						if _, err := c.Write(msg); err != nil {
							b.Fatal(err)
						}
						if _, err := io.ReadFull(c, msg); err != nil {
							b.Fatal(err)
						}
					}
					lat[m] = append(lat[m], float64(time.Since(start).Microseconds())/float64(2*pongs))
				} else {
					n, err := io.Copy(io.Discard, c)
					if err != nil || n != stream {
						b.Fatalf("%s: %d bytes, %v", m, n, err)
					}
					bw[m] = append(bw[m], float64(n)/time.Since(start).Seconds()/1e6)
				}
				c.Close()
				syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
				cpu := time.Duration(ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano())
				b.Logf("%s round %d: wall %v, this process's CPU %v", m, i, time.Since(start), cpu)
			}
		}
		cancel()
		med := func(v []float64) float64 { sort.Float64s(v); return v[len(v)/2] }
		b.Logf("one-way 8 B (us): vsock %v, virtio-net TCP %v", lat["vpong"], lat["tpong"])
		b.Logf("64 MiB stream (MB/s): vsock %v, virtio-net TCP %v", bw["vstream"], bw["tstream"])
		b.ReportMetric(med(lat["vpong"]), "vsock-us/op-oneway")
		b.ReportMetric(med(lat["tpong"]), "tcp-us/op-oneway")
		b.ReportMetric(med(bw["vstream"]), "vsock-MB/s")
		b.ReportMetric(med(bw["tstream"]), "tcp-MB/s")
	}
}

// accept takes the guest's next connection on port: vsock through the
// device, TCP on a listener in the namespace.
func (r *rig) accept(ctx context.Context, vsock bool, nsPath string, port int) (net.Conn, error) {
	if vsock {
		l, err := r.dev.Listen(uint32(port))
		if err != nil {
			return nil, err
		}
		defer l.Close()
		return l.AcceptContext(ctx)
	}
	var l net.Listener
	err := nsexec.In(nsPath, func() (err error) {
		l, err = net.Listen("tcp", fmt.Sprintf("10.0.0.1:%d", port))
		return err
	})
	if err != nil {
		return nil, err
	}
	defer l.Close()
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	return l.Accept()
}
