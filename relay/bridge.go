package relay

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// A Bridge is the relay's side of one ring pair in a region it shares
// with a local guest (docs/crosshost.md, "The bridge"; the contract is
// notes/relayed-flows.md): it reads the ring the guest writes and sends
// its bytes on a link Flow (the in-direction, bridge_in.go), and writes
// what the Flow brings into the ring the guest reads (the out-direction,
// bridge_out.go). The guest sees an ordinary ring peer: the same marks,
// offsets and wake-ups as a local guest's library.
//
// On the link, each direction's stream is the ring writer's start S as 8
// bytes (little endian), then the ring's bytes; a LEFT after them says
// the guest's writer left the ring (a LEFT before S: it never started).
//
// Nothing is lost: the in-direction frees a byte of the guest's ring (its
// head) only once the peer acknowledged it (Flow.Acked, which the peer's
// out-direction grants only as it writes bytes into its guest's ring), so
// every byte from the other side's end X on is still in this guest's ring
// when the flow leaves the link, and its writer resends [X, W) on TCP. A
// Bridge never marks the guest's write ring reader-left, which would make
// the writer leave at W on its own and lose [X, W).
//
// Guest memory is untrusted: every index, flag and start read from it is
// checked (ring's checks, and start < MaxStart), and a fault on it (a
// truncated region) is caught; a violation stops the bridge with an error
// (ErrGuest), never a panic or an access outside the rings.
type Bridge struct {
	flow   *Flow
	in     *ring.Ring // the guest writes, the bridge reads
	out    *ring.Ring // the bridge writes, the guest reads
	rd     *ring.Reader
	w      *ring.Writer
	policy *wait.Policy
	poll   time.Duration

	stopping atomic.Bool   // halt was called: every loop ends
	outHalt  atomic.Bool   // StopOut was called: the out-direction ends
	outLeft  atomic.Bool   // the out-direction ended normally: the peer's LEFT marked the ring left after its last byte
	inLeft   atomic.Bool   // the in-direction ended normally: the guest's writer left, every byte acknowledged
	halted   chan struct{} // closed by halt
	events   atomic.Uint64 // bumped by the Flow's notify when the in-direction must look
	ackedTo  atomic.Uint64 // the Flow's Acked, as notify last saw it
	freedTo  atomic.Uint64 // the link offset the in-direction freed up to (8 + ring bytes)
	freeAt   uint64        // acknowledged bytes not freed that wake the in-direction: a quarter ring
	evCh     chan struct{} // one token per notify, for waits on the link alone
	linkBad  atomic.Bool   // the Flow saw the peer's DOWN or the link's end
	wg       sync.WaitGroup
	done     chan struct{} // closed once both directions returned
	released chan struct{} // closed after Stop once no write reads the rings (Released)
	inDone   chan struct{} // closed once the in-direction returned
	outDone  chan struct{} // closed once the out-direction returned
	release  chan struct{} // closed by ReleaseIn (HoldIn)
	relOnce  sync.Once
	attached func()
	st       bridgeStats
	zc       *zcFlow // the in-direction sends by reference from its registered region (nil: it copies)

	mu       sync.Mutex
	err      error // why it stopped by itself (first error)
	downSent bool
	halt1    sync.Once
	stop1    sync.Once
	stopOut1 sync.Once
	end      End

	// out-direction's end, written by its goroutine, read by Stop after it
	// returned
	outStarted bool
	outStart   uint64
	outWritten uint64
}

// BridgeOptions tune a bridge.
type BridgeOptions struct {
	// Policy is how the bridge waits for its guest (spin, then a sleep on
	// the ring's waiting words, as the guest libraries do); nil: adaptive,
	// then asleep in the link's wait.Hub (one goroutine sleeps for all
	// the link's bridges, none holds a P of the Go scheduler asleep). A VM
	// guest's bridge passes the VM's Signal.
	Policy *wait.Policy
	// Poll bounds the wait between looks at a mark the guest sets without
	// a wake-up (its reader's attach); 0: 10 ms.
	Poll time.Duration
	// HoldIn keeps the guest's write ring unattached until ReleaseIn: the
	// relay attaches it only once the other host's guest attached the
	// ring this one's bytes go into, so that no byte enters a ring that
	// no reader can read end to end (a C reader blocked in the kernel
	// attaches only once it is back: a byte sent by ring then would never
	// wake it).
	HoldIn bool
	// Region, if set, is the guest's region registered on the Flow's
	// RDMA link (RDMALink.Register): the in-direction then sends the
	// ring's bytes by reference, and the NIC reads them from the ring
	// (zero copy, docs/rdma.md). A Region of another link is ignored.
	Region *Region
	// Attached, if set, is called once (on a goroutine of the bridge)
	// when the guest's reader has attached the ring the bridge writes:
	// the other host's bridge may then attach its guest's write ring
	// (ReleaseIn there).
	Attached func()
}

// MaxStart bounds a stretch's start (read from the guest, or sent by the
// peer relay): far beyond any stream, and far from the RESUME sentinels
// near 2^64, so that X = start + bytes never overflows.
const MaxStart = 1 << 62

var (
	// ErrGuest marks a bridge stopped by its guest's memory: an index,
	// flag or start that breaks the ring's rules (ring.ErrCorrupt), a
	// truncated region (fault.ErrFault), a ring reset (ring.ErrReset),
	// the guest's reader gone from the ring the bridge writes. The
	// wrapped error says which.
	ErrGuest = errors.New("relay bridge: guest")
	// ErrPeerStart: the peer relay sent a start of MaxStart or more.
	ErrPeerStart = fmt.Errorf("%w: start out of range", ErrProtocol)
	// ErrEnded: both directions left their rings (the guests' writers
	// left, the bridge relayed it): nothing more to carry.
	ErrEnded = errors.New("relay bridge: both directions left the rings")
	// errHalted ends a direction's loop at Stop.
	errHalted = errors.New("relay bridge: stopped")
	// errOutHalted ends the out-direction at StopOut.
	errOutHalted = errors.New("relay bridge: out-direction stopped")
)

// End is where the out-direction's stretch ended, for the other host's
// RESUME: Started false means the ring never started (ResumeAll there).
type End struct {
	Started bool
	Start   uint64 // S, the stream offset of the ring's first byte
	X       uint64 // S + the bytes the bridge wrote into the ring
}

// BridgeStats are a bridge's counters, for hostd's metrics.
type BridgeStats struct {
	BytesIn  uint64 // read from the guest's write ring, sent on the link
	Freed    uint64 // of those, acknowledged by the peer and freed in the guest's ring
	BytesOut uint64 // received on the link, written into the guest's read ring
	// The in-direction waited for the peer: a send without link credit,
	// or the guest's ring full of bytes not yet acknowledged (the other
	// host's guest reads slowly): how often, and for how long.
	InStalls  uint64
	InStalled time.Duration
	// The out-direction found the guest's read ring full (this guest
	// reads slowly): how often, and for how long it waited for room.
	OutStalls  uint64
	OutStalled time.Duration
}

type bridgeStats struct {
	bytesIn, freed, bytesOut, inStalls, outStalls atomic.Uint64
	inStalled, outStalled                         atomic.Int64
}

// NewBridge starts a bridge between the ring pair (in, out) and f: in is
// the ring the guest writes, out the ring it reads, both attached by the
// caller from its own record of the flow (hostd's region.Pool, not the
// guest-writable directory). The Bridge owns f from now on (Stop closes
// it); the caller keeps the rings' memory mapped until Released is closed.
// With a Region the NIC may read the guest's ring for a while after Stop:
// the ring pair's memory may be reused only once Released is closed.
// Rings whose indices do not check out give a bridge stopped at once with
// ErrGuest (Stop still marks the out ring left).
func NewBridge(in, out *ring.Ring, f *Flow, o BridgeOptions) *Bridge {
	b := &Bridge{flow: f, in: in, out: out, policy: o.Policy, poll: o.Poll,
		halted: make(chan struct{}), released: make(chan struct{}), evCh: make(chan struct{}, 1), done: make(chan struct{}), inDone: make(chan struct{}), outDone: make(chan struct{}),
		release: make(chan struct{}), attached: o.Attached, zc: newZCFlow(f, o.Region)}
	if !o.HoldIn {
		b.ReleaseIn()
	}
	if b.policy == nil {
		b.policy = f.m.waitPolicy()
	}
	if b.poll <= 0 {
		b.poll = 10 * time.Millisecond
	}
	err := fault.Do(func() {
		var err error
		if b.rd, err = ring.NewReader(in, b.policy); err != nil {
			b.rd = nil
			b.fail(fmt.Errorf("%w: its write ring: %w", ErrGuest, err))
			return
		}
		if b.w, err = ring.NewWriter(out, b.policy); err != nil {
			b.w = nil
			b.fail(fmt.Errorf("%w: its read ring: %w", ErrGuest, err))
		}
	})
	if err != nil {
		b.fail(fmt.Errorf("%w: %w", ErrGuest, err))
	}
	if b.rd == nil || b.w == nil {
		close(b.inDone)
		close(b.outDone)
		close(b.done)
		return b
	}
	b.freeAt = uint64(in.Capacity() / 4)
	f.setNotify(b.notify)
	b.wg.Add(2)
	var ended atomic.Int32
	end := func() {
		if ended.Add(1) == 2 {
			b.fail(ErrEnded)
		}
	}
	go func() {
		defer b.wg.Done()
		defer close(b.inDone)
		if err := b.runIn(); err != nil {
			b.fail(err)
		} else {
			b.inLeft.Store(true)
			end()
		}
	}()
	go func() {
		defer b.wg.Done()
		defer close(b.outDone)
		if err := b.runOut(); errors.Is(err, errOutHalted) {
			// StopOut: the in-direction goes on
		} else if err != nil {
			b.fail(err)
		} else {
			b.outLeft.Store(true)
			end()
		}
	}()
	go func() { b.wg.Wait(); close(b.done) }()
	return b
}

// Done is closed once both directions have returned: the bridge stopped
// by itself (Err says why) or Stop was called.
func (b *Bridge) Done() <-chan struct{} { return b.done }

// ReleaseIn lets the in-direction attach the guest's write ring (HoldIn):
// the other host's guest attached its read ring. Safe to call more than
// once.
func (b *Bridge) ReleaseIn() { b.relOnce.Do(func() { close(b.release) }) }

// InDone is closed once the in-direction returned: the guest's writer
// left its ring and every byte of it was acknowledged (or the bridge
// stopped). A relay whose guest closed waits for it before Stop, so the
// guest's last bytes reach the other host's ring.
func (b *Bridge) InDone() <-chan struct{} { return b.inDone }

// OutDone is closed once the out-direction returned: the peer's LEFT came
// after its last byte and the guest's read ring holds them all, marked
// left (or the guest's reader left it, or the bridge stopped). hostd's
// vsock room, whose VM's end is gone, waits for it before Stop, so the
// VM's last bytes reach the other guest's ring.
func (b *Bridge) OutDone() <-chan struct{} { return b.outDone }

// OutLeft reports whether the out-direction ended normally: the peer's
// writer left its ring and the guest's read ring holds its whole stretch,
// marked left (or the guest's reader closed it). False while it runs, and
// after a stop or an error that came first.
func (b *Bridge) OutLeft() bool { return b.outLeft.Load() }

// InLeft reports whether the in-direction ended normally: the guest's
// writer left its ring and the peer acknowledged every byte of it (its
// ring holds them all). False while it runs, and after a stop or an
// error that came first.
func (b *Bridge) InLeft() bool { return b.inLeft.Load() }

// StopOut stops the out-direction alone: no byte more goes into the
// guest's read ring, which is marked left where the bytes written end
// (the End it returns); what the peer still sends stays in the Flow,
// unacknowledged, so the peer's ring still holds it. The in-direction
// goes on. hostd's vsock room stops so between two VMs' stretches, then
// drains the in-direction before Stop (docs/vsock.md, "VM to VM"). It
// returns within a wake-up; safe to call more than once, and before or
// after Stop (the same End).
func (b *Bridge) StopOut() End {
	b.stopOut1.Do(func() {
		f := b.flow
		f.mu.Lock()
		b.outHalt.Store(true)
		f.readStop = true
		f.parked = false // the link's reader delivers no more into the ring
		f.cond.Broadcast()
		f.mu.Unlock()
		_ = fault.Do(func() {
			if b.w != nil {
				b.w.Interrupt()
			}
		})
		<-b.outDone
		_ = fault.Do(func() {
			if b.w != nil {
				_ = b.w.Leave()
			} else {
				b.out.MarkLeft(b.policy)
			}
		})
	})
	e := End{Started: b.outStarted}
	if e.Started {
		e.Start, e.X = b.outStart, b.outStart+b.outWritten
	}
	return e
}

// Err is why the bridge stopped by itself: the link's error, the peer's
// DOWN (ErrDown), a LEFT-less end of the link, ErrGuest (the guest broke
// its rings), ErrEnded (both directions left normally); nil while it runs
// or if Stop came first.
func (b *Bridge) Err() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.err
}

// Stats returns the bridge's counters so far. Safe for concurrent use.
func (b *Bridge) Stats() BridgeStats {
	return BridgeStats{BytesIn: b.st.bytesIn.Load(), Freed: b.st.freed.Load(), BytesOut: b.st.bytesOut.Load(),
		InStalls: b.st.inStalls.Load(), InStalled: time.Duration(b.st.inStalled.Load()),
		OutStalls: b.st.outStalls.Load(), OutStalled: time.Duration(b.st.outStalled.Load())}
}

// Stop stops both directions, tells the peer DOWN(reason) (unless the
// bridge already told it, or the link is gone), marks the out ring left
// (started or not), and returns the out-direction's end. It waits for the
// directions' goroutines, which every wait lets go at once (the Flow's
// close, the rings' interrupts), so it returns within a wake-up: never
// for the NIC. Safe to call more than once and from any goroutine: later
// calls return the same End. The caller may reuse the rings' memory once
// Released is closed.
func (b *Bridge) Stop(reason proto.Reason) End {
	b.stop1.Do(func() {
		b.halt()
		b.down(reason)
		<-b.done
		_ = fault.Do(func() {
			if b.w != nil {
				_ = b.w.Leave()
			} else {
				b.out.MarkLeft(b.policy)
			}
		})
		e := End{Started: b.outStarted}
		if e.Started {
			e.Start, e.X = b.outStart, b.outStart+b.outWritten
		}
		b.mu.Lock()
		b.end = e
		b.mu.Unlock()
		b.releaseRings()
	})
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.end
}

// Released is closed after Stop once nothing reads the rings' memory for
// this bridge any more: at Stop's return for a bridge that copies; with a
// Region, once the in-direction's frames by reference were written, since
// the NIC reads their bytes from the guest's ring until then (bounded:
// after RDMAOptions.ZeroCopyWait without a completed write the link ends,
// which ends the NIC's reads, and Released closes once it finished). The
// ring pair's memory must not be reused (the guest resumed elsewhere,
// the slot freed, another connection in it) before.
func (b *Bridge) Released() <-chan struct{} { return b.released }

// releaseRings closes released once the in-direction's frames by reference
// are written: at once if none is outstanding (the in-direction returned,
// so no new one comes), else on a goroutine of the bridge's, so that Stop
// never waits for the NIC (hostd's relay calls it on its event loop).
func (b *Bridge) releaseRings() {
	if b.zc == nil || b.zc.refs.n.Load() == 0 {
		close(b.released)
		return
	}
	go func() {
		b.zc.wait()
		close(b.released)
	}()
}

// fail records err as why the bridge stopped (the first one wins), tells
// the peer when the cause is this side's guest, and halts.
func (b *Bridge) fail(err error) {
	b.mu.Lock()
	if b.err == nil && !b.stopping.Load() {
		b.err = err
	}
	b.mu.Unlock()
	b.halt()
	switch {
	case errors.Is(err, ring.ErrReset) || errors.Is(err, ring.ErrPeerClosed):
		b.down(proto.ReasonPeerGone) // the guest reset or closed its end
	case errors.Is(err, ErrGuest):
		b.down(proto.ReasonMalformed)
	}
}

// down sends DOWN(reason) to the peer, once, after halt: the Flow is
// closed, so no DATA of the in-direction can follow it (the peer's link
// would end on bytes after a flow's end, for every flow on it).
func (b *Bridge) down(reason proto.Reason) {
	b.mu.Lock()
	send := !b.downSent
	b.downSent = true
	b.mu.Unlock()
	if send {
		b.flow.Down(reason)
	}
}

// halt makes both directions return: the Flow's close ends its Read and
// Write, the rings' interrupts and the stopping flag end the ring waits.
func (b *Bridge) halt() {
	b.halt1.Do(func() {
		b.stopping.Store(true)
		close(b.halted)
		b.flow.Close()
		_ = fault.Do(func() {
			if b.rd != nil {
				b.rd.Interrupt()
			}
			if b.w != nil {
				b.w.Interrupt()
			}
		})
	})
}

// notify is the Flow's hook (under the Flow's lock): the peer
// acknowledged more, sent DOWN or LEFT, or the link ended. For a DOWN or
// the link's end it wakes both directions. An acknowledgement wakes the
// in-direction (which frees the bytes in the guest's ring) only once a
// quarter of the ring waits to be freed, or the guest's writer waits for
// room: otherwise the in-direction frees them at its next look at the
// ring, and a message's acknowledgement costs no wake-up (in a ping-pong,
// one per message on each host). The in-direction's wait also ends on a
// waiting writer with bytes acknowledged (inStop), for a writer that
// began to wait just after this look.
func (b *Bridge) notify() {
	f := b.flow
	bad := f.err != nil || f.down
	if bad {
		b.linkBad.Store(true)
	}
	b.ackedTo.Store(f.acked)
	select {
	case b.evCh <- struct{}{}:
	default:
	}
	_ = fault.Do(func() {
		rw, ww := b.in.Waiters()
		if !bad && f.acked < b.freedTo.Load()+b.freeAt && ww.Load() == 0 {
			return
		}
		b.events.Add(1)
		_ = b.policy.Wake(rw)
		if bad {
			_, oww := b.out.Waiters()
			_ = b.policy.Wake(oww)
		}
	})
}

// linkEnd is the Flow's reason to stop once linkBad was seen: the link's
// error or the peer's DOWN.
func (b *Bridge) linkEnd() error {
	f := b.flow
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.err != nil:
		return f.err
	case f.down:
		return ErrDown{Reason: f.reason}
	}
	return nil
}

// setNotify sets the Flow's hook (see Flow.notify).
func (f *Flow) setNotify(fn func()) {
	f.mu.Lock()
	f.notify = fn
	f.mu.Unlock()
}

// readHeld is Read without the acknowledgement: the out-direction grants
// (grant) only after the bytes are in its guest's ring, so that the peer's
// Acked never covers a byte the ring does not hold yet.
func (f *Flow) readHeld(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.readLocked(p)
}

// grant acknowledges what readHeld took (see grantLocked).
func (f *Flow) grant() {
	f.mu.Lock()
	f.grantLocked()
	f.mu.Unlock()
}

// credit is what the Flow may send now without waiting.
func (f *Flow) credit() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.peerOpen || f.sent >= f.acked+f.m.window {
		return 0
	}
	return f.acked + f.m.window - f.sent
}
