package relay

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Zero copy, sending side (docs/rdma.md, "Zero copy of guests' rings").
//
// A relay registers each guest region it maps on its RDMA link for the
// local NIC to read (Register: no remote key, so the peer gains nothing).
// A bridge whose region is registered sends its guest's ring bytes by
// reference (Flow.writeFrom): the frame's payload aliases the ring, and
// the link's writer puts it in the batch as a scatter entry of the
// region's registration, so the NIC reads it straight from the guest's
// ring: no CPU copy into a payload buffer or the send buffer.
//
// Lifetime: a frame by reference holds a count on its Region and on its
// bridge's flow (zcFlow) from the moment it is queued until its write
// completes (or the link is finished: its queue pair destroyed). The
// ring bytes it names stay put that long: the bridge frees them only once
// the peer acknowledged them, and after Bridge.Stop, Bridge.Released
// closes only once the flow's count is 0: the ring may be reused after
// that (Stop itself never waits for the NIC: hostd's relay calls it on its
// event loop). Region.Deregister waits for the region's count before the
// registration goes, which hostd does before it unmaps the region. Both
// waits are bounded: after zcWait in which the link completed no write,
// the link is ended, which destroys its queue pair and so ends every read
// of the NIC.

// zcMin is the smallest payload sent by reference: below it a copy costs
// less than a scatter entry (and keeps small frames of many flows in one
// contiguous run of the batch).
const zcMin = 4 << 10

// zcWait bounds the waits for a region's or a flow's frames by reference
// to be written while the link completes no write: a writer that cannot
// write (the peer withholds ring credit) ends the link after this. The
// default of RDMAOptions.ZeroCopyWait; a variable for tests.
var zcWait = 5 * time.Second

// ErrNoGather: the link's verbs cannot register memory for gathers, or
// gather too few entries (Register).
var ErrNoGather = errors.New("relay rdma: the device cannot gather from registered guest memory")

// errZCStuck ends a link whose frames by reference were not written
// within zcWait of a wait for them.
var errZCStuck = errors.New("relay rdma: frames from a guest's ring not written in time (the peer withholds credit?)")

// refs counts outstanding frames by reference; wait returns when they are
// done.
type refs struct {
	n  atomic.Int64
	ch chan struct{} // a token when n drops to 0
}

func newRefs() refs { return refs{ch: make(chan struct{}, 1)} }

func (r *refs) done() {
	if r.n.Add(-1) == 0 {
		select {
		case r.ch <- struct{}{}:
		default:
		}
	}
}

// wait waits until no frame is outstanding, or finished is closed (the
// link's queue pair is gone: nothing reads any more). It gives up (false)
// once d passed without progress (a count of the link's completed
// writes that did not move): a link that writes slowly is waited for, a
// stuck one is not.
func (r *refs) wait(finished <-chan struct{}, d time.Duration, progress func() uint64) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	last := progress()
	for r.n.Load() > 0 {
		select {
		case <-r.ch:
		case <-finished:
			return true
		case <-t.C:
			if p := progress(); p != last {
				last = p
				t.Reset(d)
				continue
			}
			return false
		}
	}
	return true
}

// Region is a guest memory region registered on an RDMA link for its NIC
// to read (RDMALink.Register). Safe for concurrent use.
type Region struct {
	l    *RDMALink
	mem  []byte
	key  uint32
	refs refs

	mu      sync.Mutex
	closing bool // Deregister began: no new frame refers to it
	once    sync.Once
}

// Register registers mem, a guest region the relay maps, on the link for
// its NIC to read (no remote access). The caller keeps mem mapped until
// Deregister returned (or the link is finished, Finished): the link then
// deregisters what is left itself, before it frees its queue pair.
func (l *RDMALink) Register(mem []byte) (*Region, error) {
	g, ok := l.v.(Gather)
	if !ok || g.MaxSGE() < 3 {
		return nil, ErrNoGather
	}
	if len(mem) == 0 {
		return nil, errors.New("relay rdma: register an empty region")
	}
	l.regMu.Lock()
	defer l.regMu.Unlock()
	if l.regsClosed {
		return nil, fmt.Errorf("relay rdma: register: %w", l.errOrClosed())
	}
	key, err := g.Register(mem)
	if err != nil {
		return nil, fmt.Errorf("relay rdma: register a guest region of %d bytes: %w", len(mem), err)
	}
	r := &Region{l: l, mem: mem, key: key, refs: newRefs()}
	l.regs[r] = struct{}{}
	return r, nil
}

func (l *RDMALink) errOrClosed() error {
	if err := l.Err(); err != nil {
		return err
	}
	return errors.New("link closed")
}

// Link is the link r is registered on.
func (r *Region) Link() *RDMALink { return r.l }

// Deregister ends the registration once no posted or queued write gathers
// from it: frames by reference drain first (bounded: past zcWait the link
// ends, which ends the NIC's reads). New frames are copied from the
// moment it is called. After it returns the caller may unmap the region.
// Safe to call more than once. A link that finished meanwhile has
// deregistered it itself (deregisterAll).
func (r *Region) Deregister() {
	r.mu.Lock()
	r.closing = true
	r.mu.Unlock()
	l := r.l
	if !r.refs.wait(l.finished, l.zcWait, l.written.Load) {
		l.fail(errZCStuck)
		<-l.finished
	}
	r.once.Do(func() {
		l.regMu.Lock()
		defer l.regMu.Unlock()
		if _, ok := l.regs[r]; ok && !l.regsClosed {
			delete(l.regs, r)
			_ = l.v.(Gather).Deregister(r.key)
		}
	})
}

// deregisterAll ends every registration left, after the link's goroutines
// returned and before its queue pair is freed (finish).
func (l *RDMALink) deregisterAll() {
	l.regMu.Lock()
	defer l.regMu.Unlock()
	l.regsClosed = true
	if g, ok := l.v.(Gather); ok {
		for r := range l.regs {
			_ = g.Deregister(r.key)
		}
	}
	clear(l.regs)
}

// Finished is closed once the link ended and its queue pair and
// registrations are freed: the NIC reads no guest memory any more.
func (l *RDMALink) Finished() <-chan struct{} { return l.finished }

// zcFlow is a bridge's flow sending by reference from one region: the
// count of its frames by reference not yet written.
type zcFlow struct {
	r    *Region
	refs refs
}

// newZCFlow gives f a zero-copy sender from r, or nil if r is not on f's
// link.
func newZCFlow(f *Flow, r *Region) *zcFlow {
	if r == nil || &r.l.mux != f.m {
		return nil
	}
	return &zcFlow{r: r, refs: newRefs()}
}

// wait waits until the flow's frames by reference are written (or the
// link finished): then their ring bytes may be reused. Past zcWait it
// ends the link and waits for its end.
func (z *zcFlow) wait() {
	if z == nil {
		return
	}
	if !z.refs.wait(z.r.l.finished, z.r.l.zcWait, z.r.l.written.Load) {
		z.r.l.fail(errZCStuck)
		<-z.r.l.finished
	}
}

// writeFrom is Write for a bridge whose ring lies in a registered region:
// payloads of at least zcMin bytes go by reference (the frame aliases p,
// which the caller keeps intact until the peer acknowledged it, and
// until z.wait), after a check that p lies within the registration
// (the ring's place and indices come from guest memory: offsetIn). Else,
// or once the region's deregistration began, it copies as Write.
func (f *Flow) writeFrom(p []byte, z *zcFlow) (int, error) {
	if len(p) < zcMin {
		return f.Write(p)
	}
	off, ok := offsetIn(z.r.mem, p)
	if !ok {
		return f.Write(p)
	}
	f.mu.Lock()
	n, err := f.writeLocked(p, z, off)
	f.mu.Unlock()
	f.flush()
	return n, err
}

// take counts one frame by reference on z and its region, unless the
// region's deregistration began (then the frame is copied).
func (z *zcFlow) take() bool {
	r := z.r
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closing {
		return false
	}
	r.refs.n.Add(1)
	z.refs.n.Add(1)
	return true
}

// written: a frame by reference was written (its write completed).
func (z *zcFlow) written() {
	z.r.refs.done()
	z.refs.done()
}
