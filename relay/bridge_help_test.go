package relay

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// pair is one host's ring pair, in a memfd region formatted by
// region.Pool as hostd formats a pair's rings.
type pair struct {
	reg    *region.Region
	file   *os.File
	e      region.Entry
	ab, ba *ring.Ring
}

func newPair(t testing.TB, capacity int) *pair {
	t.Helper()
	reg, f := shmtest.Region(t, region.Geometry{Size: int64(4*capacity + 1<<20), Slots: 4})
	pool := region.NewPool(reg, nil)
	slot, e, err := pool.Alloc(region.Request{OwnerA: 1, OwnerB: 2, Capacity: capacity})
	if err != nil {
		t.Fatal(err)
	}
	ab, ba, err := reg.Rings(slot, e.Gen)
	if err != nil {
		t.Fatal(err)
	}
	return &pair{reg: reg, file: f, e: e, ab: ab, ba: ba}
}

// header is the raw header of ring AB (ba: BA), for a hostile guest.
func (p *pair) header(ba bool) []byte {
	off := p.e.RingAB
	if ba {
		off = p.e.RingBA
	}
	return p.reg.Mem()[off : off+ring.HeaderSize]
}

// byteAt is the byte of stream index i (ring bytes counted from 0) that
// ring AB (ba: BA) holds at i's place.
func (p *pair) byteAt(ba bool, i uint64) byte {
	off := p.e.RingAB
	if ba {
		off = p.e.RingBA
	}
	return p.reg.Mem()[off+ring.HeaderSize+int64(i&uint64(p.e.Capacity-1))]
}

// bridged is the test's two hosts: guest a on h1 (the connecting end A:
// it writes ring AB and reads BA) and guest b on h2 (B: it writes BA and
// reads AB), each host's bridge on its side of one Flow of a link over
// loopback TCP.
type bridged struct {
	la, lb Carrier
	ca, cb []net.Conn
	h1, h2 *pair
	b1, b2 *Bridge
}

var testPolicy = &wait.Policy{}

func newBridged(t testing.TB, capacity, window int, id uint32) *bridged {
	t.Helper()
	ca, cb := conns(t, 2)
	la, lb := NewLink(ca, LinkOptions{Window: window}), NewLink(cb, LinkOptions{Window: window})
	t.Cleanup(func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() })
	return onLinks(t, la, lb, ca, cb, capacity, id)
}

func onLinks(t testing.TB, la, lb *Link, ca, cb []net.Conn, capacity int, id uint32) *bridged {
	t.Helper()
	return onPairs(t, la, lb, ca, cb, newPair(t, capacity), newPair(t, capacity), id, BridgeOptions{}, BridgeOptions{})
}

// onPairs bridges h1 and h2 over flow id of la and lb, with each host's
// options (nil Policy: the link's Hub, as hostd's bridges).
func onPairs(t testing.TB, la, lb Carrier, ca, cb []net.Conn, h1, h2 *pair, id uint32, o1, o2 BridgeOptions) *bridged {
	t.Helper()
	fa, err := la.Open(id)
	if err != nil {
		t.Fatal(err)
	}
	fb, err := lb.Open(id)
	if err != nil {
		t.Fatal(err)
	}
	x := &bridged{la: la, lb: lb, ca: ca, cb: cb, h1: h1, h2: h2}
	x.b1 = NewBridge(x.h1.ab, x.h1.ba, fa, o1)
	x.b2 = NewBridge(x.h2.ba, x.h2.ab, fb, o2)
	t.Cleanup(func() { x.b1.Stop(proto.ReasonShutdown); x.b2.Stop(proto.ReasonShutdown) })
	return x
}

// state is both hosts' state, for a failed deadline.
func (x *bridged) state() string {
	var s string
	_ = fault.Do(func() {
		s = fmt.Sprintf("h1 bridge: err %v %+v; h2 bridge: err %v %+v; "+
			"h1 AB (a writes) %+v; h1 BA (a reads) %+v; h2 BA (b writes) %+v; h2 AB (b reads) %+v; link errs %v / %v",
			x.b1.Err(), x.b1.Stats(), x.b2.Err(), x.b2.Stats(),
			x.h1.ab.Stats(), x.h1.ba.Stats(), x.h2.ba.Stats(), x.h2.ab.Stats(), x.la.Err(), x.lb.Err())
	})
	return s
}

// guestWrite is a guest's writer as the libraries write: it starts the
// ring at start once its reader attached, writes data in seeded pieces
// (waiting while the ring is full), and leaves the ring after its last
// byte if leave (with nil data: leaves without starting). stop ends it early (the ring is not left then). It
// returns the bytes written.
func guestWrite(r *ring.Ring, start uint64, data []byte, leave bool, stop *atomic.Bool) (int, error) {
	w, err := ring.NewWriter(r, testPolicy)
	if err != nil {
		return 0, err
	}
	if data == nil && leave { // a writer that leaves without starting
		return 0, w.Leave()
	}
	for !w.ReaderAttached() {
		if stop.Load() {
			return 0, errStopped
		}
		time.Sleep(100 * time.Microsecond) // the libraries look at each write
	}
	w.Start(start)
	ww := w.NewWaiter(stop.Load)
	rng := seeded(start, 64)
	done := 0
	for i := 0; done < len(data); i++ {
		piece := min(len(data)-done, 1+int(rng[i%64])*400)
		n, err := w.TryWrite(data[done : done+piece])
		done += n
		if err != nil {
			return done, err
		}
		if n == 0 {
			if stop.Load() {
				return done, errStopped
			}
			if err := ww.Wait(time.Time{}); err != nil {
				return done, err
			}
		}
	}
	if leave {
		return done, w.Leave()
	}
	return done, nil
}

var errStopped = errors.New("test: stopped")

// guestRead is a guest's reader: it attaches, waits for the writer's
// start (or its leave without one), and reads until the writer left and
// the ring is drained, or stop. pause, if set, is called with the bytes
// read so far after each read (a slow reader sleeps in it).
func guestRead(r *ring.Ring, stop *atomic.Bool, pause func(int)) (start uint64, started bool, got []byte, err error) {
	rd, err := ring.NewReader(r, testPolicy)
	if err != nil {
		return 0, false, nil, err
	}
	rd.Attach()
	for {
		if start, started = rd.Started(); started {
			break
		}
		if rd.WriterLeft() {
			return 0, false, nil, nil
		}
		if stop.Load() {
			return 0, false, nil, errStopped
		}
		if err := rd.Wait(stop.Load, time.Time{}); err != nil {
			return 0, false, nil, err
		}
	}
	rw := rd.NewWaiter(stop.Load)
	buf := make([]byte, 48<<10)
	for {
		n, err := rd.TryRead(buf)
		got = append(got, buf[:n]...)
		if errors.Is(err, ring.ErrLeft) {
			return start, true, got, nil
		}
		if err != nil {
			return start, true, got, err
		}
		if n > 0 {
			if pause != nil {
				pause(len(got))
			}
			continue
		}
		if stop.Load() {
			return start, true, got, errStopped
		}
		if err := rw.Wait(time.Time{}); err != nil {
			return start, true, got, err
		}
	}
}

// wakeGuests wakes the test's guest ends wherever they sleep, so that
// they see their stop at once (not at their next look, within a second).
func (x *bridged) wakeGuests() {
	for _, r := range []*ring.Ring{x.h1.ab, x.h1.ba, x.h2.ab, x.h2.ba} {
		_ = fault.Do(func() { // a region may be gone (truncated)
			rw, ww := r.Waiters()
			for _, f := range []*atomic.Uint32{rw, ww} {
				f.Store(1)
				_ = testPolicy.Wake(f)
			}
		})
	}
}

// within runs fn and fails t with x's state if it does not return in d.
func within(t *testing.T, x *bridged, d time.Duration, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	deadline(t, d, what, done, x.state)
}
