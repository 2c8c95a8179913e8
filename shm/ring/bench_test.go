package ring_test

import (
	"testing"

	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// BenchmarkInProcessPingPong: both ends are goroutines of one process (as
// when a Go program talks to itself through guestlib), for comparison with
// the cross-process figures of shm.BenchmarkPingPong.
func BenchmarkInProcessPingPong(b *testing.B) {
	for _, mode := range []wait.Mode{wait.Spin, wait.Adaptive} {
		b.Run(mode.String(), func(b *testing.B) {
			p := &wait.Policy{Mode: mode}
			_, w1, r1 := shmtest.Pipe(b, 64<<10, p)
			_, w2, r2 := shmtest.Pipe(b, 64<<10, p)
			go func() {
				buf := make([]byte, 8)
				for {
					if _, err := r1.Read(buf); err != nil {
						return
					}
					w2.Write(buf)
				}
			}()
			msg := make([]byte, 8)
			for b.Loop() {
				w1.Write(msg)
				r2.Read(msg)
			}
			w1.CloseWrite()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/2, "ns/oneway")
		})
	}
}
