package ring_test

import (
	"bytes"
	"errors"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var adaptive = &wait.Policy{Mode: wait.Adaptive}

func seq(n int, start byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = start + byte(i)
	}
	return b
}

func mustWrite(t *testing.T, w *ring.Writer, p []byte) {
	t.Helper()
	n, err := w.TryWrite(p)
	if err != nil || n != len(p) {
		t.Fatalf("TryWrite(%d bytes) = %d, %v; want %d, nil", len(p), n, err, len(p))
	}
}

func mustRead(t *testing.T, rd *ring.Reader, want []byte) {
	t.Helper()
	got := make([]byte, len(want))
	n, err := rd.TryRead(got)
	if err != nil || n != len(want) || !bytes.Equal(got, want) {
		t.Fatalf("TryRead = %d, %v, %x; want %d, nil, %x", n, err, got[:n], len(want), want)
	}
}

func TestEmpty(t *testing.T) {
	_, _, rd := shmtest.Pipe(t, ring.MinCapacity, adaptive)
	n, err := rd.TryRead(make([]byte, 10))
	if n != 0 || err != nil {
		t.Fatalf("TryRead on empty = %d, %v; want 0, nil", n, err)
	}
	if b, err := rd.TryPeek(10); len(b) != 0 || err != nil {
		t.Fatalf("TryPeek on empty = %d bytes, %v; want 0, nil", len(b), err)
	}
}

func TestZeroLength(t *testing.T) {
	_, w, rd := shmtest.Pipe(t, ring.MinCapacity, adaptive)
	if n, err := w.TryWrite(nil); n != 0 || err != nil {
		t.Fatalf("TryWrite(nil) = %d, %v", n, err)
	}
	if n, err := w.Write(nil); n != 0 || err != nil {
		t.Fatalf("Write(nil) = %d, %v", n, err)
	}
	if st := w.Stats(); st.MsgsWritten != 0 {
		t.Fatalf("zero-length write published a message: %+v", st)
	}
	mustWrite(t, w, []byte("x"))
	if n, err := rd.Read(nil); n != 0 || err != nil {
		t.Fatalf("Read(nil) = %d, %v; want 0, nil (and no consumption)", n, err)
	}
	mustRead(t, rd, []byte("x"))
}

func TestExactFillAndFull(t *testing.T) {
	const c = ring.MinCapacity
	_, w, rd := shmtest.Pipe(t, c, adaptive)
	mustWrite(t, w, seq(c, 1))
	if n, err := w.TryWrite([]byte{9}); n != 0 || err != nil {
		t.Fatalf("TryWrite on full = %d, %v; want 0, nil", n, err)
	}
	if b, err := w.TryReserve(1); len(b) != 0 || err != nil {
		t.Fatalf("TryReserve on full = %d bytes, %v", len(b), err)
	}
	mustRead(t, rd, seq(c, 1))
	mustWrite(t, w, seq(c, 7)) // fills again, from offset 0
	mustRead(t, rd, seq(c, 7))
}

func TestPartialWriteWhenNearlyFull(t *testing.T) {
	const c = ring.MinCapacity
	_, w, _ := shmtest.Pipe(t, c, adaptive)
	mustWrite(t, w, seq(c-10, 0))
	n, err := w.TryWrite(seq(100, 0))
	if n != 10 || err != nil {
		t.Fatalf("TryWrite into 10 free bytes = %d, %v; want 10, nil", n, err)
	}
}

func TestWrapAround(t *testing.T) {
	const c = ring.MinCapacity
	_, w, rd := shmtest.Pipe(t, c, adaptive)
	mustWrite(t, w, seq(c-100, 0))
	mustRead(t, rd, seq(c-100, 0))
	// The next 300 bytes straddle the end of the data area.
	mustWrite(t, w, seq(300, 50))
	mustRead(t, rd, seq(300, 50))

	// Zero-copy: reservations and peeks stop at the end of the area.
	mustWrite(t, w, seq(c-250, 0))
	mustRead(t, rd, seq(c-250, 0)) // head and tail now 50 before the end
	b, err := w.TryReserve(200)
	if err != nil || len(b) != 50 {
		t.Fatalf("TryReserve across the end = %d bytes, %v; want 50", len(b), err)
	}
	copy(b, seq(50, 3))
	if err := w.Commit(50); err != nil {
		t.Fatal(err)
	}
	b, _ = w.TryReserve(200)
	if len(b) != 200 {
		t.Fatalf("TryReserve after wrap = %d bytes, want 200", len(b))
	}
	copy(b, seq(200, 53))
	if err := w.Commit(200); err != nil {
		t.Fatal(err)
	}
	p, err := rd.TryPeek(1000)
	if err != nil || !bytes.Equal(p, seq(50, 3)) {
		t.Fatalf("TryPeek before the end = %x, %v", p, err)
	}
	if err := rd.Release(50); err != nil {
		t.Fatal(err)
	}
	mustRead(t, rd, seq(200, 53))
}

func TestCommitBeyondReservation(t *testing.T) {
	_, w, rd := shmtest.Pipe(t, ring.MinCapacity, adaptive)
	b, _ := w.TryReserve(10)
	if err := w.Commit(len(b) + 1); !errors.Is(err, ring.ErrBadCommit) {
		t.Fatalf("Commit beyond reservation = %v, want ErrBadCommit", err)
	}
	if err := rd.Release(1); !errors.Is(err, ring.ErrBadCommit) {
		t.Fatalf("Release without peek = %v, want ErrBadCommit", err)
	}
}

func TestFINAfterData(t *testing.T) {
	_, w, rd := shmtest.Pipe(t, ring.MinCapacity, adaptive)
	mustWrite(t, w, []byte("last words"))
	if err := w.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := w.TryWrite([]byte("more")); !errors.Is(err, ring.ErrClosed) {
		t.Fatalf("write after CloseWrite = %v, want ErrClosed", err)
	}
	mustRead(t, rd, []byte("last words"))
	for range 2 {
		if n, err := rd.Read(make([]byte, 8)); n != 0 || err != io.EOF {
			t.Fatalf("Read after drain = %d, %v; want 0, EOF", n, err)
		}
	}
}

func TestReaderClosedFailsWriter(t *testing.T) {
	_, w, rd := shmtest.Pipe(t, ring.MinCapacity, adaptive)
	if err := rd.CloseRead(); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("x")); !errors.Is(err, ring.ErrPeerClosed) {
		t.Fatalf("write after CloseRead = %v, want ErrPeerClosed", err)
	}
}

func TestResetDiscardsAndFails(t *testing.T) {
	r := shmtest.Ring(t, ring.MinCapacity)
	w, _ := ring.NewWriter(r, adaptive)
	rd, _ := ring.NewReader(r, adaptive)
	mustWrite(t, w, []byte("unread"))
	r.Reset(7)
	if _, err := rd.TryRead(make([]byte, 10)); !errors.Is(err, ring.ErrReset) {
		t.Fatalf("read after reset = %v, want ErrReset", err)
	}
	if _, err := w.TryWrite([]byte("x")); !errors.Is(err, ring.ErrReset) {
		t.Fatalf("write after reset = %v, want ErrReset", err)
	}
	if st := r.Stats(); !st.Reset || st.Reason != 7 {
		t.Fatalf("stats after reset = %+v, want Reset with reason 7", st)
	}
}

func TestResetDuringBlockedRead(t *testing.T) {
	for _, mode := range []wait.Mode{wait.Spin, wait.Block, wait.Adaptive} {
		t.Run(mode.String(), func(t *testing.T) {
			r := shmtest.Ring(t, ring.MinCapacity)
			p := &wait.Policy{Mode: mode}
			rd, _ := ring.NewReader(r, p)
			done := make(chan error, 1)
			go func() {
				_, err := rd.Read(make([]byte, 10))
				done <- err
			}()
			waitFlagOrSpin(t, r, mode)
			r.Abort(1, p)
			select {
			case err := <-done:
				if !errors.Is(err, ring.ErrReset) {
					t.Fatalf("blocked Read after reset = %v, want ErrReset", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("blocked Read did not return within 5s of the reset")
			}
		})
	}
}

// waitFlagOrSpin waits until the reader has published "waiting" (block,
// adaptive) so the test exercises the sleeping path, with a bound.
func waitFlagOrSpin(t *testing.T, r *ring.Ring, mode wait.Mode) {
	t.Helper()
	if mode == wait.Spin {
		return
	}
	rw, _ := r.Waiters()
	waitSet(t, rw, "reader")
}

// waitSet waits, with a bound, until the waiting word of one end (who)
// says that it sleeps or is about to.
func waitSet(t *testing.T, word *atomic.Uint32, who string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for word.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the %s never published that it waits", who)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

func TestDeadlines(t *testing.T) {
	for _, mode := range []wait.Mode{wait.Spin, wait.Block, wait.Adaptive} {
		t.Run(mode.String(), func(t *testing.T) {
			p := &wait.Policy{Mode: mode}
			r, w, rd := shmtest.Pipe(t, ring.MinCapacity, p)
			rd.SetDeadline(time.Now().Add(20 * time.Millisecond))
			if _, err := rd.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("Read past deadline = %v, want ErrDeadlineExceeded", err)
			}
			// A deadline moved into the past wakes a blocked call.
			rd.SetDeadline(time.Time{})
			done := make(chan error, 1)
			go func() { _, err := rd.Read(make([]byte, 1)); done <- err }()
			if mode != wait.Spin {
				waitFlagOrSpin(t, r, mode)
			}
			rd.SetDeadline(time.Now().Add(-time.Second))
			select {
			case err := <-done:
				if !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("Read after deadline moved back = %v", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("moving the deadline did not wake the blocked Read")
			}
			// Writer side: fill, then a full ring times out.
			mustWrite(t, w, seq(ring.MinCapacity, 0))
			w.SetDeadline(time.Now().Add(10 * time.Millisecond))
			if n, err := w.Write([]byte("x")); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("Write on full ring past deadline = %d, %v", n, err)
			}
		})
	}
}

func TestCloseWakesBlockedRead(t *testing.T) {
	r, _, rd := shmtest.Pipe(t, ring.MinCapacity, &wait.Policy{Mode: wait.Block})
	done := make(chan error, 1)
	go func() { _, err := rd.Read(make([]byte, 1)); done <- err }()
	waitFlagOrSpin(t, r, wait.Block)
	rd.Close()
	select {
	case err := <-done:
		if !errors.Is(err, ring.ErrClosed) {
			t.Fatalf("Read after Close = %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not wake the blocked Read")
	}
}

// TestRandomStream moves seeded random-sized writes and reads through a
// small ring in two goroutines and compares checksums, for every wait mode
// and both APIs.
func TestRandomStream(t *testing.T) {
	total := 64 << 20
	if testing.Short() {
		total = 4 << 20
	}
	for _, mode := range []wait.Mode{wait.Spin, wait.Block, wait.Adaptive} {
		for _, zc := range []bool{false, true} {
			name := mode.String() + map[bool]string{false: "/copy", true: "/zerocopy"}[zc]
			t.Run(name, func(t *testing.T) {
				n := total
				if mode == wait.Block {
					n /= 8
				}
				p := &wait.Policy{Mode: mode}
				_, w, rd := shmtest.Pipe(t, 16<<10, p)
				seed := uint64(time.Now().UnixNano())
				t.Logf("seed %d", seed)
				var wg sync.WaitGroup
				var sent uint32
				var werr error
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(seed, 1))
					buf := make([]byte, 40000)
					for left := n; left > 0; {
						k := min(left, 1+rng.IntN(len(buf)))
						for i := range buf[:k] {
							buf[i] = byte(rng.Uint32())
						}
						sent = crc32.Update(sent, crc32.IEEETable, buf[:k])
						if zc {
							for off := 0; off < k; {
								b, err := w.Reserve(k - off)
								if err != nil {
									werr = err
									return
								}
								copy(b, buf[off:])
								w.Commit(len(b))
								off += len(b)
							}
						} else if _, err := w.Write(buf[:k]); err != nil {
							werr = err
							return
						}
						left -= k
					}
					werr = w.CloseWrite()
				}()
				rng := rand.New(rand.NewPCG(seed, 2))
				var got uint32
				var recvd int
				buf := make([]byte, 40000)
				for {
					var k int
					var err error
					if zc {
						var b []byte
						b, err = rd.Peek(1 + rng.IntN(len(buf)))
						got = crc32.Update(got, crc32.IEEETable, b)
						k = len(b)
						if err == nil {
							err = rd.Release(k)
						}
					} else {
						k, err = rd.Read(buf[:1+rng.IntN(len(buf))])
						got = crc32.Update(got, crc32.IEEETable, buf[:k])
					}
					recvd += k
					if err == io.EOF {
						break
					}
					if err != nil {
						t.Fatalf("read after %d bytes: %v", recvd, err)
					}
				}
				wg.Wait()
				if werr != nil {
					t.Fatalf("writer: %v", werr)
				}
				if recvd != n || got != sent {
					t.Fatalf("received %d bytes crc %08x; want %d crc %08x", recvd, got, n, sent)
				}
				st := w.Stats()
				if st.Written != uint64(n) || st.Read != uint64(n) || !st.FIN {
					t.Fatalf("counters %+v; want %d written and read, FIN", st, n)
				}
			})
		}
	}
}

// TestWriterState: the writer's start and leave as one snapshot, so a
// reader never takes a writer that started, wrote and left for one that
// left without starting (guestlib's "nothing comes from this ring").
func TestWriterState(t *testing.T) {
	for _, starts := range []bool{false, true} {
		_, w, rd := shmtest.Pipe(t, ring.MinCapacity, adaptive)
		if off, started, left := rd.WriterState(); started || left || off != 0 {
			t.Fatalf("fresh ring: WriterState = %d, %v, %v; want 0, false, false", off, started, left)
		}
		if starts {
			w.Start(77)
			mustWrite(t, w, seq(5, 1))
		}
		if err := w.Leave(); err != nil {
			t.Fatal(err)
		}
		off, started, left := rd.WriterState()
		if started != starts || !left || (starts && off != 77) {
			t.Fatalf("after start=%v and leave: WriterState = %d, %v, %v", starts, off, started, left)
		}
	}
}
