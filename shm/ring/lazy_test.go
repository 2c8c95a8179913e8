package ring_test

import (
	"testing"
	"time"

	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// TestLazyHead: TryRead publishes the head once it crossed a stride (an
// eighth of the ring), when it read all it knew of or finds the ring
// empty, and when the reader leaves; not after every read.
func TestLazyHead(t *testing.T) {
	const c = ring.MinCapacity // stride 512
	_, w, rd := hostile(t, c)
	mustWrite(t, w, seq(c, 0))
	read := func(n int) {
		t.Helper()
		if k, err := rd.TryRead(make([]byte, n)); k != n || err != nil {
			t.Fatalf("TryRead(%d) = %d, %v", n, k, err)
		}
	}
	published := func(want uint64) {
		t.Helper()
		if got := rd.Stats().Read; got != want {
			t.Fatalf("published head %d, want %d (consumed %d)", got, want, rd.Consumed())
		}
	}
	read(100)
	published(0)
	read(500) // 600: into the second stride
	published(600)
	read(10)
	published(600)
	read(c - 610) // to the end of the data area: a stride crossed
	published(c)
	mustWrite(t, w, seq(40, 0))
	read(20)
	published(c)
	read(20) // all it knows of: a reader that stops here must not hold the head back
	published(c + 40)
	if k, err := rd.TryRead(make([]byte, 1)); k != 0 || err != nil {
		t.Fatalf("TryRead of an empty ring = %d, %v", k, err)
	}
	published(c + 40)
	mustWrite(t, w, seq(40, 0))
	read(20)
	published(c + 40)
	if err := rd.Leave(); err != nil {
		t.Fatal(err)
	}
	published(c + 60)
}

// TestLazyHeadWakesSleepingWriter: a writer asleep for space is woken by
// the reader's next read, however small, and not only once a stride was
// consumed: the reader publishes whenever the writer's waiting word is
// set. (Without that check this test's Write stays asleep.)
func TestLazyHeadWakesSleepingWriter(t *testing.T) {
	for _, mode := range []wait.Mode{wait.Block, wait.Adaptive} {
		t.Run(mode.String(), func(t *testing.T) {
			p := &wait.Policy{Mode: mode, SpinFor: time.Microsecond}
			r, w, rd := shmtest.Pipe(t, ring.MinCapacity, p)
			mustWrite(t, w, seq(ring.MinCapacity, 0))
			done := make(chan error, 1)
			go func() {
				_, err := w.Write(seq(10, 0))
				done <- err
			}()
			_, ww := r.Waiters()
			waitSet(t, ww, "writer")
			if k, err := rd.TryRead(make([]byte, 10)); k != 10 || err != nil {
				t.Fatalf("TryRead = %d, %v", k, err)
			}
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("the writer slept on after the reader freed 10 bytes (published head %d, consumed %d)",
					rd.Stats().Read, rd.Consumed())
			}
		})
	}
}
