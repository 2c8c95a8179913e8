package relay

import (
	"crypto/sha256"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
)

// bstream is one direction of a bridged test: a guest writes data from
// start into its write ring, the other host's guest reads its read ring.
type bstream struct {
	start   uint64
	data    []byte
	wrote   int
	wErr    error
	gotS    uint64
	started bool
	got     []byte
	rErr    error
}

// run carries a's stream (h1 AB -> link -> h2 AB) and b's (h2 BA -> link
// -> h1 BA) at once; pauseB slows b's reader. It returns when all four
// guest ends returned, or fails t after d.
func (x *bridged) run(t *testing.T, d time.Duration, a, b *bstream, leave bool, stop *atomic.Bool, pauseB func(int)) {
	t.Helper()
	within(t, x, d, "both streams", x.start(a, b, leave, stop, pauseB))
}

// start starts the four guest ends of run and returns the wait for them.
func (x *bridged) start(a, b *bstream, leave bool, stop *atomic.Bool, pauseB func(int)) func() {
	var wg sync.WaitGroup
	wg.Add(4)
	go func() { defer wg.Done(); a.wrote, a.wErr = guestWrite(x.h1.ab, a.start, a.data, leave, stop) }()
	go func() { defer wg.Done(); b.wrote, b.wErr = guestWrite(x.h2.ba, b.start, b.data, leave, stop) }()
	go func() { defer wg.Done(); a.gotS, a.started, a.got, a.rErr = guestRead(x.h2.ab, stop, pauseB) }()
	go func() { defer wg.Done(); b.gotS, b.started, b.got, b.rErr = guestRead(x.h1.ba, stop, nil) }()
	return wg.Wait
}

// check compares what the reader got with what the writer wrote, by
// checksum.
func (s *bstream) check(t *testing.T, name string) {
	t.Helper()
	if s.wErr != nil || s.rErr != nil {
		t.Fatalf("%s: writer: %v; reader: %v", name, s.wErr, s.rErr)
	}
	if !s.started || s.gotS != s.start {
		t.Fatalf("%s: the reader saw start %d (started %v), want %d", name, s.gotS, s.started, s.start)
	}
	if len(s.got) != len(s.data) || sha256.Sum256(s.got) != sha256.Sum256(s.data) {
		t.Fatalf("%s: got %d bytes, want %d; checksums differ or first difference at %d", name, len(s.got), len(s.data), firstDiff(s.got, s.data))
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// TestBridgeStreamsBothWays: a seeded 8 MiB stream each way, from guest
// ring through bridge, link and bridge to the other guest's ring, through
// 64 KiB rings and a 256 KiB link window: every byte arrives once, in
// order (checksums), at the writer's start; both writers' leaves reach
// the readers, so the bridges end by themselves (ErrEnded), each guest's
// write ring freed to its tail and never marked reader-left; Stop gives
// X = S + bytes. All along, a sampler checks the rule that loses nothing:
// a writer's ring is freed (head) only up to what the other host's ring
// holds (its tail).
func TestBridgeStreamsBothWays(t *testing.T) {
	const size = 8 << 20
	x := newBridged(t, 64<<10, 256<<10, 7)
	a := &bstream{start: 1000, data: seeded(1, size)}
	b := &bstream{start: 77777, data: seeded(2, size)}
	var stop, sampled atomic.Bool
	var violation atomic.Value
	samplerDone := make(chan struct{})
	go func() {
		defer close(samplerDone)
		for !sampled.Load() {
			for _, c := range []struct {
				name     string
				from, to func() uint64
			}{
				{"a", func() uint64 { return x.h1.ab.Stats().Read }, func() uint64 { return x.h2.ab.Stats().Written }},
				{"b", func() uint64 { return x.h2.ba.Stats().Read }, func() uint64 { return x.h1.ba.Stats().Written }},
			} {
				if h, tl := c.from(), c.to(); h > tl { // head first: the tail only grows
					violation.Store(c.name + ": the writer's ring was freed past what the other ring holds")
				}
			}
			time.Sleep(50 * time.Microsecond)
		}
	}()
	x.run(t, 60*time.Second, a, b, true, &stop, nil)
	sampled.Store(true)
	<-samplerDone
	if v := violation.Load(); v != nil {
		t.Fatal(v)
	}
	a.check(t, "a -> b")
	b.check(t, "b -> a")
	for _, br := range []*Bridge{x.b1, x.b2} {
		within(t, x, 10*time.Second, "the bridges' end", func() { <-br.Done() })
		if !errors.Is(br.Err(), ErrEnded) {
			t.Fatalf("bridge stopped with %v, want ErrEnded", br.Err())
		}
	}
	for name, r := range map[string]*pair{"h1 AB": x.h1, "h2 BA": x.h2} {
		ring := r.ab
		if name == "h2 BA" {
			ring = r.ba
		}
		st := ring.Stats()
		if st.Read != st.Written || st.Written != size || st.ReaderLeft || !st.ReaderAttached {
			t.Fatalf("%s (a guest's write ring) at the end: %+v: want all %d bytes freed, attached, never reader-left", name, st, size)
		}
	}
	e1, e2 := x.b1.Stop(proto.ReasonShutdown), x.b2.Stop(proto.ReasonShutdown)
	if want := (End{Started: true, Start: b.start, X: b.start + size}); e1 != want {
		t.Fatalf("h1's end %+v, want %+v", e1, want)
	}
	if want := (End{Started: true, Start: a.start, X: a.start + size}); e2 != want {
		t.Fatalf("h2's end %+v, want %+v", e2, want)
	}
	if e := x.b1.Stop(proto.ReasonShutdown); e != e1 {
		t.Fatalf("a second Stop gave %+v, want %+v", e, e1)
	}
	s1, s2 := x.b1.Stats(), x.b2.Stats()
	if s1.BytesIn != size || s1.Freed != size || s1.BytesOut != size || s2.BytesIn != size || s2.BytesOut != size {
		t.Fatalf("counters: h1 %+v, h2 %+v", s1, s2)
	}
}

// TestBridgeNeverStarted: a guest whose writer leaves its ring without
// starting it (it wrote nothing on the ring): the other host's bridge
// marks its guest's read ring left without a start, and Stop says the
// stretch never started; the other way carries its bytes.
func TestBridgeNeverStarted(t *testing.T) {
	x := newBridged(t, 16<<10, 64<<10, 3)
	a := &bstream{start: 5, data: nil}
	b := &bstream{start: 9, data: seeded(3, 300<<10)}
	var stop atomic.Bool
	x.run(t, 30*time.Second, a, b, true, &stop, nil)
	b.check(t, "b -> a")
	if a.rErr != nil || a.started || len(a.got) != 0 {
		t.Fatalf("a's reader: started %v, %d bytes, %v; want the ring left without a start", a.started, len(a.got), a.rErr)
	}
}

// TestBridgeStall: b's reader stops for 300 ms twice mid-bstream. a's
// bytes back up: b's read ring fills (the out-direction waits: a stall),
// the link's credit runs out (a stall on h1's side), a's ring fills and
// its writer waits; then all goes on, and nothing is lost or repeated.
func TestBridgeStall(t *testing.T) {
	const size = 4 << 20
	x := newBridged(t, 32<<10, 128<<10, 9)
	a := &bstream{start: 0, data: seeded(4, size)}
	b := &bstream{start: 3, data: seeded(5, 1<<20)}
	var stop atomic.Bool
	paused := 0
	pause := func(n int) {
		if (paused == 0 && n >= 1<<20) || (paused == 1 && n >= 3<<20) {
			paused++
			time.Sleep(300 * time.Millisecond) // the slow reader, not a synchronisation
		}
	}
	x.run(t, 60*time.Second, a, b, true, &stop, pause)
	a.check(t, "a -> b")
	b.check(t, "b -> a")
	if s := x.b2.Stats(); s.OutStalls == 0 || s.OutStalled < 200*time.Millisecond {
		t.Fatalf("h2's bridge did not wait for b's ring: %+v", s)
	}
	if s := x.b1.Stats(); s.InStalls == 0 || s.InStalled < 200*time.Millisecond {
		t.Fatalf("h1's bridge did not wait for the link's credit: %+v", s)
	}
}

// TestBridgeAcksOnlyWhatTheRingHolds: the out-direction takes bytes from
// the Flow without acknowledging them (readHeld) and acknowledges once
// they are in its ring (grant): until then the sender's Acked does not
// cover them. (Read acknowledged as it took them, so the sending ring was
// freed, for an instant, past what the receiving ring held: the sampler of
// TestBridgeStreamsBothWays saw it under -race.)
func TestBridgeAcksOnlyWhatTheRingHolds(t *testing.T) {
	la, lb := links(t, 1, LinkOptions{Window: 64 << 10})
	fa, _ := la.Open(1)
	fb, _ := lb.Open(1)
	if _, err := fa.Write(make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2000)
	got := 0
	for got < 1000 {
		n, err := fb.readHeld(buf)
		if err != nil {
			t.Fatal(err)
		}
		got += n
	}
	fb.mu.Lock()
	granted := fb.granted
	fb.mu.Unlock()
	if granted != 0 {
		t.Fatalf("readHeld acknowledged %d bytes, want none before grant", granted)
	}
	fb.grant()
	waitAcked(t, fa, 1000)
}
