package ring_test

import (
	"testing"

	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// TestNoAllocs: the data path allocates nothing, in any API.
func TestNoAllocs(t *testing.T) {
	for _, mode := range []wait.Mode{wait.Spin, wait.Adaptive, wait.Block} {
		t.Run(mode.String(), func(t *testing.T) {
			_, w, rd := shmtest.Pipe(t, 64<<10, &wait.Policy{Mode: mode})
			msg := make([]byte, 1500)
			buf := make([]byte, 1500)
			tests := []struct {
				name string
				fn   func()
			}{
				{"Write+Read", func() { w.Write(msg); rd.Read(buf) }},
				{"TryWrite+TryRead", func() { w.TryWrite(msg); rd.TryRead(buf) }},
				{"Reserve+Commit+Peek+Release", func() {
					b, _ := w.Reserve(len(msg))
					copy(b, msg)
					w.Commit(len(b))
					p, _ := rd.Peek(len(b))
					rd.Release(len(p))
				}},
				{"Stats", func() { _ = w.Stats() }},
			}
			for _, tt := range tests {
				if a := testing.AllocsPerRun(1000, tt.fn); a != 0 {
					t.Errorf("%s: %v allocations per run, want 0", tt.name, a)
				}
			}
		})
	}
}
