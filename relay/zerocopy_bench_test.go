package relay

import (
	"io"
	"syscall"
	"testing"
	"time"
)

// cpuTime is the process's user and system time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkZeroCopySend: a relay sending 256 KiB spans of a registered
// region over fake RDMA links, copied (Flow.Write: into a payload buffer,
// then into the send buffer) or by scatter entry (writeFrom: neither).
// The fake NIC's own memcpy into the peer's ring and the receiver's
// copies are the same in both, so the difference is the sending relay's
// CPU per byte: reported as cpu-ns/KiB (the whole process's CPU time,
// both links and the reader, per KiB sent). Not a NIC's speed (rxe copies anyway; docs/rdma.md).
func BenchmarkZeroCopySend(b *testing.B) {
	const span = 256 << 10
	for _, zc := range []bool{false, true} {
		name := "copy"
		if zc {
			name = "sge"
		}
		b.Run(name, func(b *testing.B) {
			la, lb, _, _ := rdmaLinks(b, 8<<20, 64, RDMAOptions{Window: 4 << 20})
			mem := seeded(9, 4<<20)
			reg, err := la.Register(mem)
			if err != nil {
				b.Fatal(err)
			}
			fa, _ := la.Open(1)
			fb, _ := lb.Open(1)
			z := newZCFlow(fa, reg)
			done := make(chan error, 1)
			go func() {
				_, err := io.CopyN(io.Discard, fb, int64(b.N)*span)
				done <- err
			}()
			b.SetBytes(span)
			b.ResetTimer()
			cpu0 := cpuTime()
			for i := range b.N {
				p := mem[(i*span)%len(mem):][:span]
				if zc {
					_, err = fa.writeFrom(p, z)
				} else {
					_, err = fa.Write(p)
				}
				if err != nil {
					b.Fatal(err)
				}
			}
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N*span/1024), "cpu-ns/KiB")
			if g := la.Stats().Gathered; zc != (g > 0) {
				b.Fatalf("gathered %d bytes (zero copy %v)", g, zc)
			}
		})
	}
}
