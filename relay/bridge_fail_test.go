package relay

import (
	"encoding/binary"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

// waitFor polls cond (a look at both ends' counters) until it holds, and
// fails t with x's state after d.
func waitFor(t *testing.T, x *bridged, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(d); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("%s: not within %s; %s", what, d, x.state())
		}
	}
}

// resendable checks one direction after a cut: the receiving guest got
// exactly the stream's bytes [S, X) (X from its bridge's Stop), and the
// writer's ring, read straight from the region, still holds every byte
// from X to its tail W: its head never passed X, so the writer can resend
// [X, W) on TCP. It never saw its ring marked reader-left. It returns W.
func resendable(t *testing.T, name string, s *bstream, e End, p *pair, ba bool) uint64 {
	t.Helper()
	if s.rErr != nil || !s.started || s.gotS != s.start {
		t.Fatalf("%s: the reader ended with %v, started %v at %d; want the ring left after its stretch from %d", name, s.rErr, s.started, s.gotS, s.start)
	}
	if !e.Started || e.Start != s.start || e.X < s.start {
		t.Fatalf("%s: end %+v, want started at %d", name, e, s.start)
	}
	n := e.X - s.start
	if uint64(len(s.got)) != n || firstDiff(s.got, s.data) != len(s.got) {
		t.Fatalf("%s: the reader got %d bytes (first difference at %d), want exactly [S, X) = %d bytes of the stream", name, len(s.got), firstDiff(s.got, s.data), n)
	}
	r := p.ab
	if ba {
		r = p.ba
	}
	st := r.Stats()
	if st.Read > n || st.Written < n || st.Written != uint64(s.wrote) || st.ReaderLeft {
		t.Fatalf("%s: the writer's ring %+v (the guest wrote %d): want head <= X-S = %d <= tail, never reader-left", name, st, s.wrote, n)
	}
	for i := n; i < st.Written; i++ {
		if got := p.byteAt(ba, i); got != s.data[i] {
			t.Fatalf("%s: the writer's ring holds %#x at stream byte S+%d, the stream has %#x: [X, W) = [%d, %d) is not resendable", name, got, i, s.data[i], n, st.Written)
		}
	}
	return st.Written
}

// TestBridgeLinkCut: both streams run, the link's connections are cut
// under them. Both bridges stop by themselves with the link's error;
// Stop on each returns X; the receiving guest's ring held exactly [S, X)
// of the stream (it drains to the left mark Stop set and sees no more);
// the sending guest's ring still holds [X, W), for the writer to resend.
func TestBridgeLinkCut(t *testing.T) {
	const size = 64 << 20
	x := newBridged(t, 64<<10, 256<<10, 11)
	a := &bstream{start: 4096, data: seeded(11, size)}
	b := &bstream{start: 1 << 40, data: seeded(12, size)}
	var stop atomic.Bool
	// b's reader stops at 2 MiB until both bridges stopped: a's bytes
	// back up, so some are surely in flight (in a's ring, not in b's) at
	// the cut, and stay so.
	cut := make(chan struct{})
	var uncut sync.Once
	var paused atomic.Bool
	pause := func(n int) {
		if n >= 2<<20 {
			paused.Store(true)
			<-cut
		}
	}
	wait := x.start(a, b, false, &stop, pause)
	defer func() { uncut.Do(func() { close(cut) }); stop.Store(true); x.wakeGuests(); wait() }()
	// b's ring must be full before the cut: until then the bytes in a's
	// ring may all still move into it (a slow writer, under load, leaves
	// nothing behind); once it is full, what a's ring holds beyond it
	// stays in flight.
	waitFor(t, x, 30*time.Second, "2 MiB each way before the cut, b's ring full and a's bytes backed up", func() bool {
		in := x.h2.ab.Stats()
		return paused.Load() && in.Written-in.Read == uint64(x.h2.ab.Capacity()) &&
			x.h1.ba.Stats().Written >= 2<<20 && x.h1.ab.Stats().Written > in.Written
	})
	for _, c := range x.ca {
		c.Close()
	}
	for _, br := range []*Bridge{x.b1, x.b2} {
		within(t, x, 10*time.Second, "the bridges' stop after the cut", func() { <-br.Done() })
		if err := br.Err(); err == nil || errors.Is(err, ErrGuest) || errors.Is(err, ErrEnded) {
			t.Fatalf("bridge stopped with %v, want the link's error", err)
		}
	}
	var e1, e2 End
	within(t, x, 5*time.Second, "Stop", func() { e1, e2 = x.b1.Stop(proto.ReasonPeerUnreachable), x.b2.Stop(proto.ReasonPeerUnreachable) })
	// The readers drain to the left mark Stop set (the ring is final: stop
	// does not cut their drain short); the writers wait for room until
	// told to stop (RESUME would tell them).
	uncut.Do(func() { close(cut) })
	stop.Store(true)
	x.wakeGuests()
	within(t, x, 10*time.Second, "the guests' ends", wait)
	wa := resendable(t, "a -> b", a, e2, x.h1, false)
	wb := resendable(t, "b -> a", b, e1, x.h2, true)
	t.Logf("a -> b: X-S %d, W-S %d; b -> a: X-S %d, W-S %d", e2.X-a.start, wa, e1.X-b.start, wb)
	if wa == e2.X-a.start {
		t.Fatalf("a's bytes were not in flight at the cut (W = X): the test shows nothing")
	}
}

// TestBridgeStopBeforeStart: Stop before anything started marks the out
// ring left without a start and says so; a second Stop says the same.
func TestBridgeStopBeforeStart(t *testing.T) {
	x := newBridged(t, 16<<10, 64<<10, 13)
	var e End
	within(t, x, 5*time.Second, "Stop", func() { e = x.b1.Stop(proto.ReasonAdmin) })
	if e.Started {
		t.Fatalf("end %+v, want never started", e)
	}
	if st := x.h1.ba.Stats(); !st.Left || st.Started {
		t.Fatalf("out ring %+v, want left, not started", st)
	}
	if st := x.h1.ab.Stats(); st.ReaderLeft || !st.ReaderAttached {
		t.Fatalf("in ring %+v, want attached, never reader-left", st)
	}
	within(t, x, 5*time.Second, "the peer's stop at DOWN", func() { <-x.b2.Done() })
	if err := x.b2.Err(); !errors.Is(err, ErrDown{Reason: proto.ReasonAdmin}) {
		t.Fatalf("peer bridge stopped with %v, want DOWN(admin)", err)
	}
	if e2 := x.b1.Stop(proto.ReasonAdmin); e2 != e {
		t.Fatalf("second Stop %+v, want %+v", e2, e)
	}
}

// startWriter is guest a's writer, started legitimately at 0 with n
// bytes written.
func startWriter(t *testing.T, x *bridged, n int) *ring.Writer {
	w, err := ring.NewWriter(x.h1.ab, testPolicy)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, x, 5*time.Second, "the bridge's attach", w.ReaderAttached)
	w.Start(0)
	if m, err := w.TryWrite(make([]byte, n)); m != n || err != nil {
		t.Fatalf("write %d: %d, %v", n, m, err)
	}
	waitFor(t, x, 5*time.Second, "the bytes' way to the link", func() bool { return x.b1.Stats().BytesIn == uint64(n) })
	return w
}

// wakeIn wakes h1's bridge if it sleeps on a's write ring (a hostile
// guest need not; the bridge would look within a second anyway).
func wakeIn(x *bridged) {
	rw, _ := x.h1.ab.Waiters()
	rw.Store(1)
	_ = testPolicy.Wake(rw)
}

// wakeOut wakes h1's bridge if it waits for room in a's read ring.
func wakeOut(x *bridged) {
	_, ww := x.h1.ba.Waiters()
	ww.Store(1)
	_ = testPolicy.Wake(ww)
}

// TestBridgeHostileGuest: guest a breaks its rings in one way each; its
// bridge stops with ErrGuest naming the cause, its peer bridge with the
// DOWN it sent, and nothing else suffers: another flow on the same link
// carries 2 MiB each way to the end, checksummed, and the link stays up.
func TestBridgeHostileGuest(t *testing.T) {
	const c = 32 << 10
	tests := []struct {
		name  string
		harm  func(t *testing.T, x *bridged)
		cause error
		down  proto.Reason
	}{
		{"tail beyond capacity", func(t *testing.T, x *bridged) {
			startWriter(t, x, 1000)
			put64(x.h1.header(false), ring.OffTail, 3*c)
			wakeIn(x)
		}, ring.ErrCorrupt, proto.ReasonMalformed},
		{"tail moves back", func(t *testing.T, x *bridged) {
			startWriter(t, x, 1000)
			put64(x.h1.header(false), ring.OffTail, 500)
			wakeIn(x)
		}, ring.ErrCorrupt, proto.ReasonMalformed},
		{"bytes before a start", func(t *testing.T, x *bridged) {
			put64(x.h1.header(false), ring.OffTail, 100)
			wakeIn(x)
		}, ring.ErrCorrupt, proto.ReasonMalformed},
		{"start out of range", func(t *testing.T, x *bridged) {
			h := x.h1.header(false)
			put64(h, ring.OffStart, 1<<63)
			put32(h, ring.OffWFlags, ring.FlagStarted)
			wakeIn(x)
		}, ring.ErrCorrupt, proto.ReasonMalformed},
		{"read ring's head past its tail", func(t *testing.T, x *bridged) {
			bWrites(t, x)
			waitFor(t, x, 5*time.Second, "b's bytes in a's ring", func() bool { return x.h1.ba.Stats().Written > 0 })
			put64(x.h1.header(true), ring.OffHead, x.h1.ba.Stats().Written+5)
			wakeOut(x)
		}, ring.ErrCorrupt, proto.ReasonMalformed},
		{"read ring's head moves back", func(t *testing.T, x *bridged) {
			bWrites(t, x)
			waitFor(t, x, 5*time.Second, "b's bytes in a's ring", func() bool { return x.h1.ba.Stats().Written >= c })
			h := x.h1.header(true)
			put64(h, ring.OffHead, c) // read all, then "unread" them: the bridge must see the head it cached shrink
			wakeOut(x)
			waitFor(t, x, 5*time.Second, "the bridge's refill", func() bool { return x.h1.ba.Stats().Written > c })
			put64(h, ring.OffHead, 1)
			wakeOut(x)
		}, ring.ErrCorrupt, proto.ReasonMalformed},
		{"ring reset by the guest", func(t *testing.T, x *bridged) {
			startWriter(t, x, 10)
			x.h1.ab.Abort(7, testPolicy)
		}, ring.ErrReset, proto.ReasonPeerGone},
		{"region truncated", func(t *testing.T, x *bridged) {
			bWrites(t, x)
			waitFor(t, x, 5*time.Second, "b's bytes in a's ring", func() bool { return x.h1.ba.Stats().Written > 0 })
			if err := x.h1.file.Truncate(0); err != nil {
				t.Fatal(err)
			}
			// a reads, as far as the bridge knows: its next write faults.
		}, fault.ErrFault, proto.ReasonMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ca, cb := conns(t, 2)
			la, lb := NewLink(ca, LinkOptions{Window: 128 << 10}), NewLink(cb, LinkOptions{Window: 128 << 10})
			t.Cleanup(func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() })
			x := onLinks(t, la, lb, ca, cb, c, 21)
			y := onLinks(t, la, lb, ca, cb, c, 22) // the bystander
			ya := &bstream{start: 1, data: seeded(21, 2<<20)}
			yb := &bstream{start: 2, data: seeded(22, 2<<20)}
			var stop atomic.Bool
			t.Cleanup(func() { stop.Store(true); y.wakeGuests() })
			ywait := y.start(ya, yb, true, &stop, nil)
			attachA(x)
			tt.harm(t, x)
			within(t, x, 10*time.Second, "the hostile guest's bridge's stop", func() { <-x.b1.Done() })
			if err := x.b1.Err(); !errors.Is(err, ErrGuest) || !errors.Is(err, tt.cause) {
				t.Fatalf("bridge stopped with %v, want ErrGuest and %v", err, tt.cause)
			}
			within(t, x, 10*time.Second, "the peer bridge's stop", func() { <-x.b2.Done() })
			if err := x.b2.Err(); !errors.Is(err, ErrDown{Reason: tt.down}) {
				t.Fatalf("peer bridge stopped with %v, want DOWN(%s)", err, tt.down)
			}
			within(t, x, 5*time.Second, "Stop", func() { x.b1.Stop(proto.ReasonMalformed); x.b2.Stop(proto.ReasonMalformed) })
			within(t, y, 30*time.Second, "the bystander's streams", ywait)
			ya.check(t, "bystander a -> b")
			yb.check(t, "bystander b -> a")
			if la.Err() != nil || lb.Err() != nil {
				t.Fatalf("the link ended: %v / %v", la.Err(), lb.Err())
			}
		})
	}
}

// attachA marks a's read ring reader-attached, as a's library does at
// READY (a reads nothing in these tests).
func attachA(x *bridged) {
	_ = fault.Do(func() {
		rd, err := ring.NewReader(x.h1.ba, testPolicy)
		if err == nil {
			rd.Attach()
		}
	})
}

// bWrites makes guest b write 1 MiB into its write ring, started at 0,
// until the test ends.
func bWrites(t *testing.T, x *bridged) {
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = guestWrite(x.h2.ba, 0, make([]byte, 1<<20), false, &stop)
	}()
	t.Cleanup(func() { stop.Store(true); x.wakeGuests(); <-done })
}

// FuzzBridgeHostileRings: a guest writes anything into its two ring
// headers (tail, head, start, flags, reset, the waiting words), at any
// point of a stream coming from the other side, while its own writer
// streams. Whatever it writes: no panic and no access outside the rings
// (the fuzzer would crash), the bridge stops (or keeps going) and Stop
// returns within its bound, the out-direction's end is never past what
// the peer sent, and the link, shared with other guests, stays up.
func FuzzBridgeHostileRings(f *testing.F) {
	f.Add([]byte{0, 0, 0xff, 0xff, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{1, 3, 2, 0, 0, 0, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{1, 6, 2, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0})
	f.Add([]byte{0, 2, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 3, 6, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{0, 4, 1, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 5, 9, 0, 0, 0, 0, 0, 0, 0})
	fields := []int{ring.OffTail, ring.OffHead, ring.OffWFlags, ring.OffRFlags, ring.OffReset, ring.OffRWait, ring.OffWWait, ring.OffStart}
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 200 {
			return
		}
		const c = 16 << 10
		x := newBridged(t, c, 64<<10, 31)
		var stop atomic.Bool
		done := make(chan struct{}, 2)
		var bSent atomic.Int64
		go func() { // b streams to a; a's library attached its read ring
			n, _ := guestWrite(x.h2.ba, 0, make([]byte, 256<<10), false, &stop)
			bSent.Store(int64(n))
			done <- struct{}{}
		}()
		go func() { // a's writer streams to b, as long as its ring lets it
			_ = fault.Do(func() { _, _ = guestWrite(x.h1.ab, 0, make([]byte, 256<<10), false, &stop) })
			done <- struct{}{}
		}()
		attachA(x)
		for len(ops) >= 10 {
			ba, field, v := ops[0]&1 == 1, fields[int(ops[1])%len(fields)], binary.LittleEndian.Uint64(ops[2:10])
			ops = ops[10:]
			h := x.h1.header(ba)
			if wide(field) {
				put64(h, field, v)
			} else {
				put32(h, field, uint32(v))
			}
			wakeIn(x)
			wakeOut(x)
			time.Sleep(100 * time.Microsecond)
		}
		time.Sleep(2 * time.Millisecond)
		var e End
		within(t, x, 5*time.Second, "Stop", func() { e = x.b1.Stop(proto.ReasonMalformed) })
		stop.Store(true)
		x.wakeGuests()
		within(t, x, 5*time.Second, "the guests' ends", func() { <-done; <-done })
		if e.Started && e.X-e.Start > uint64(bSent.Load()) {
			t.Fatalf("end %+v: more than the %d bytes b sent", e, bSent.Load())
		}
		if err := x.b1.Err(); err != nil && !errors.Is(err, ErrGuest) && !errors.As(err, new(ErrDown)) {
			t.Fatalf("bridge stopped with %v: want ErrGuest or nothing", err)
		}
		if x.la.Err() != nil || x.lb.Err() != nil {
			t.Fatalf("the link ended: %v / %v", x.la.Err(), x.lb.Err())
		}
	})
}

// wide reports whether the header word at off is 64 bits wide.
func wide(off int) bool {
	return off == ring.OffTail || off == ring.OffHead || off == ring.OffStart
}

// TestBridgeStopMidStream: Stop while the guest's bytes stream out: the
// DOWN goes after the last DATA of the flow (DATA after it would end the
// link, every flow on it), the peer bridge stops with that DOWN, and the
// link stays up for the next flow. 20 flows in turn on one link.
func TestBridgeStopMidStream(t *testing.T) {
	ca, cb := conns(t, 1)
	la, lb := NewLink(ca, LinkOptions{Window: 8 << 20}), NewLink(cb, LinkOptions{Window: 8 << 20})
	t.Cleanup(func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() })
	data := seeded(1, 64<<20)
	for i := range uint32(20) {
		x := onLinks(t, la, lb, ca, cb, 1<<20, 100+i)
		var stop atomic.Bool
		a := &bstream{start: 0, data: data}
		b := &bstream{start: 0, data: data}
		wait := x.start(a, b, false, &stop, nil)
		waitFor(t, x, 10*time.Second, "bytes on their way", func() bool { return x.b1.Stats().BytesIn > 100<<10 })
		within(t, x, 5*time.Second, "Stop", func() { x.b1.Stop(proto.ReasonPolicy) })
		within(t, x, 5*time.Second, "the peer bridge's stop", func() { <-x.b2.Done() })
		if err := x.b2.Err(); !errors.Is(err, ErrDown{Reason: proto.ReasonPolicy}) {
			t.Fatalf("flow %d: the peer bridge stopped with %v, want DOWN(policy)", 100+i, err)
		}
		x.b2.Stop(proto.ReasonPolicy)
		stop.Store(true)
		x.wakeGuests()
		within(t, x, 5*time.Second, "the guests' ends", wait)
		if la.Err() != nil || lb.Err() != nil {
			t.Fatalf("flow %d: the link ended: %v / %v", 100+i, la.Err(), lb.Err())
		}
	}
}
