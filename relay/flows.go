package relay

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/wait"
)

// mux is the flow engine every link shares, whatever carries its frames
// (TCP connections in link.go, RDMA writes in rdma.go): the flows, their
// credits and marks, and the checks of what the peer sends. A transport
// gives it route (which queue a flow's frames go to, so that they stay in
// order) and teardown (close the transport when the link ends), and feeds
// it the peer's frames through take.
type mux struct {
	window   uint64
	maxEarly int
	done     chan struct{}
	wg       sync.WaitGroup
	dropped  atomic.Uint64 // frames for flows not open here
	stats    linkStats

	route func(id uint32) func(frame) // the queue of flow id's frames
	// holdFor, if set, gives flow id's queue without a wake-up of the
	// transport's writer, and a flush that writes it from the caller
	// (link.go); else frames go through route.
	holdFor  func(id uint32) (hold func(frame), flush func())
	teardown func() // closes the transport, once

	mu    sync.Mutex
	hub   *wait.Hub // the waits of the link's bridges (waitPolicy), started by the first; closed at the link's end
	flows map[uint32]*Flow
	early map[uint32]earlyOpen // flows the peer opened first (its CREDIT 0)
	err   error
}

func (m *mux) init(window, maxEarly int) {
	if window <= 0 {
		window = 1 << 20
	}
	if maxEarly <= 0 {
		maxEarly = 4096
	}
	m.window, m.maxEarly = uint64(window), maxEarly
	m.done = make(chan struct{})
	m.flows, m.early = map[uint32]*Flow{}, map[uint32]earlyOpen{}
}

// Err is why the link ended; nil while it runs.
func (m *mux) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.err
}

// linkStats are the link's counters (Stats), updated without its lock.
type linkStats struct {
	bytesOut, bytesIn, frames, writes atomic.Uint64
	gathered, gatherWrites            atomic.Uint64 // RDMA: payload bytes gathered from guests' rings, and the writes that did
	stalled                           atomic.Int64  // ns writers waited for credit, over all flows
}

// Stats are a link's counters, for metrics per link.
type Stats struct {
	BytesOut, BytesIn uint64        // flow bytes (payloads) sent and received
	Frames            uint64        // frames sent
	Writes            uint64        // transport writes that sent them (Frames/Writes: the batching)
	Stalled           time.Duration // time writers waited for credit, summed over flows (a wait counts once it ends)
	// Gathered is the payload bytes the RDMA link's NIC read straight
	// from guests' rings by scatter entry (zero copy, sending side), in
	// GatherWrites writes; 0 on the TCP link.
	Gathered, GatherWrites uint64
}

// Stats returns the link's counters so far.
func (m *mux) Stats() Stats {
	return Stats{BytesOut: m.stats.bytesOut.Load(), BytesIn: m.stats.bytesIn.Load(), Frames: m.stats.frames.Load(),
		Writes: m.stats.writes.Load(), Stalled: time.Duration(m.stats.stalled.Load()),
		Gathered: m.stats.gathered.Load(), GatherWrites: m.stats.gatherWrites.Load()}
}

// Dropped counts frames that named a flow not open here (a late frame of
// a closed flow, or a peer's mistake); they are ignored.
func (m *mux) Dropped() uint64 { return m.dropped.Load() }

// Close ends the link: every flow fails with "link closed".
func (m *mux) Close() { m.fail(errors.New("relay link: closed")) }

// Wait waits for the link's goroutines after it ended.
func (m *mux) Wait() { m.wg.Wait() }

func (m *mux) fail(err error) {
	m.mu.Lock()
	if m.err != nil {
		m.mu.Unlock()
		return
	}
	m.err = err
	close(m.done)
	flows := make([]*Flow, 0, len(m.flows))
	for _, f := range m.flows {
		flows = append(flows, f)
	}
	hub := m.hub
	m.mu.Unlock()
	m.teardown()
	if hub != nil {
		hub.Close() // waits after this sleep in futexes of their own
	}
	for _, f := range flows {
		f.mu.Lock()
		if f.err == nil {
			f.err = err
		}
		f.cond.Broadcast()
		if f.notify != nil {
			f.notify()
		}
		f.mu.Unlock()
	}
}

// waitPolicy is how the link's bridges wait for their guests when their
// caller chose no Policy: adaptive, then asleep in the link's Hub, one
// goroutine for all of them (shm/wait.Hub: a goroutine asleep in a futex
// would hold a P of the Go scheduler, and every bridge has one waiting).
// Once the link ended, a plain futex.
func (m *mux) waitPolicy() *wait.Policy {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil {
		return &wait.Policy{}
	}
	if m.hub == nil {
		m.hub = wait.NewHub()
	}
	return &wait.Policy{Signal: m.hub}
}

// earlyOpen is a flow the peer opened before this side did: when its
// CREDIT 0 came, and whether its ATTACHED came too.
type earlyOpen struct {
	at       time.Time
	attached bool
}

// earlyFor is how long a peer's open of a flow not opened here is kept
// when the table is full: longer than any wait for the other side's open.
const earlyFor = time.Minute

// expireEarlyLocked forgets the peer's opens older than before.
func (m *mux) expireEarlyLocked(before time.Time) {
	for id, e := range m.early {
		if e.at.Before(before) {
			delete(m.early, id)
		}
	}
}

// take applies one frame from the peer, checked as untrusted input.
func (m *mux) take(fr frame) error {
	m.mu.Lock()
	f := m.flows[fr.flow]
	if f == nil {
		switch {
		case fr.typ == fCredit && fr.arg == 0:
			// The peer opened a flow this side has not (yet): keep it
			// for Open, a while. Entries of flows never opened here (a
			// refused stretch) age out rather than pile up.
			if _, ok := m.early[fr.flow]; !ok && len(m.early) >= m.maxEarly {
				m.expireEarlyLocked(time.Now().Add(-earlyFor))
			}
			if _, ok := m.early[fr.flow]; !ok && len(m.early) >= m.maxEarly {
				m.mu.Unlock()
				return fmt.Errorf("%w: credit for over %d flows not open here", ErrProtocol, m.maxEarly)
			}
			e := m.early[fr.flow]
			e.at = time.Now()
			m.early[fr.flow] = e
		case fr.typ == fAttached && fr.arg == 0 && m.early[fr.flow] != (earlyOpen{}):
			// The peer's ATTACHED after its open, before this side's
			// Open (a VM's stretch: its goroutine descheduled between
			// the Hello and the Open): kept with the open, as bounded.
			e := m.early[fr.flow]
			e.attached = true
			m.early[fr.flow] = e
		default:
			// A late frame of a flow closed here (a CREDIT past 0 can only
			// be one: a flow is credited only after it was opened here).
			m.dropped.Add(1)
		}
		m.mu.Unlock()
		return nil
	}
	m.mu.Unlock()
	f.mu.Lock()
	defer f.mu.Unlock()
	if fr.typ == fData {
		return m.takeData(f, fr)
	}
	defer f.cond.Broadcast()
	if f.notify != nil {
		defer f.notify()
	}
	switch fr.typ {
	case fCredit:
		if fr.arg < f.acked || fr.arg > f.sent {
			return fmt.Errorf("%w: flow %d: credit for offset %d, acked %d, sent %d", ErrProtocol, f.id, fr.arg, f.acked, f.sent)
		}
		f.acked, f.peerOpen = fr.arg, true
	case fDown:
		f.down, f.reason = true, proto.Reason(fr.arg)
	case fAttached:
		if fr.arg != 0 {
			return fmt.Errorf("%w: flow %d: ATTACHED with %d", ErrProtocol, f.id, fr.arg)
		}
		if !f.peerAttached { // again: nothing new
			f.peerAttached = true
			close(f.attached)
		}
	case fLeft:
		if fr.arg != f.recvd {
			return fmt.Errorf("%w: flow %d: LEFT at %d, received %d", ErrProtocol, f.id, fr.arg, f.recvd)
		}
		f.left = true
	default:
		return fmt.Errorf("%w: frame type %d for flow %d", ErrProtocol, fr.typ, fr.flow)
	}
	return nil
}

// takeData applies a DATA frame to f (locked). When f's consumer waits
// for bytes and has a sink (a Bridge's out-direction, parked), the bytes
// go straight into it from here, the transport's reader: no hand-off to
// the consumer's goroutine and no copy through the flow's buffer, and
// the consumer is not woken. What the sink does not take (its ring is
// full) is buffered for the consumer, which is woken for it.
func (m *mux) takeData(f *Flow, fr frame) error {
	n := uint64(len(fr.data))
	switch {
	case f.left || f.down:
		return fmt.Errorf("%w: flow %d: bytes after its end", ErrProtocol, f.id)
	case fr.arg != f.recvd:
		return fmt.Errorf("%w: flow %d: bytes at offset %d, expected %d", ErrProtocol, f.id, fr.arg, f.recvd)
	case f.recvd+n > f.granted+m.window:
		return fmt.Errorf("%w: flow %d: bytes up to %d beyond the credit %d", ErrProtocol, f.id, f.recvd+n, f.granted+m.window)
	}
	f.recvd += n
	m.stats.bytesIn.Add(n)
	p := fr.data
	if f.parked && f.buffered == 0 && !f.closed {
		k := f.sink(p)
		p = p[k:]
		f.consumed += uint64(k)
	}
	if len(p) > 0 {
		f.buf.put(p)
		f.buffered += uint64(len(p))
		f.cond.Broadcast()
	}
	f.grantLocked()
	return nil
}

// Open opens flow id on this side; the peer opens the same id (the
// pairing across hosts gives both relays the id). Nothing is sent on it
// until the peer opened it too and granted its first credit.
func (m *mux) Open(id uint32) (*Flow, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil {
		return nil, m.err
	}
	if m.flows[id] != nil {
		return nil, fmt.Errorf("relay link: flow %d is open", id)
	}
	f := &Flow{m: m, id: id, send: m.route(id)}
	f.hold, f.flush = f.send, func() {}
	if m.holdFor != nil {
		f.hold, f.flush = m.holdFor(id)
	}
	f.cond = sync.NewCond(&f.mu)
	f.attached = make(chan struct{})
	if e, ok := m.early[id]; ok {
		f.peerOpen = true
		if e.attached {
			f.peerAttached = true
			close(f.attached)
		}
		delete(m.early, id)
	}
	m.flows[id] = f
	f.send(frame{typ: fCredit, flow: id, arg: 0})
	return f, nil
}

// ErrDown is what a flow's Read returns once the peer sent DOWN and every
// byte before it was read.
type ErrDown struct{ Reason proto.Reason }

func (e ErrDown) Error() string { return "relay flow: down (" + e.Reason.String() + ")" }

// Flow is one direction pair of a connection on a link.
type Flow struct {
	m     *mux
	id    uint32
	send  func(frame) // queues a frame on the flow's ordered path
	hold  func(frame) // queues it for flush: Write's DATA
	flush func()      // writes that path's queue from the caller, if the transport can
	mu    sync.Mutex
	cond  *sync.Cond

	// sending
	sent     uint64 // next offset to send
	acked    uint64 // the peer's consumer took up to here
	peerOpen bool   // the peer opened the flow (its first CREDIT came)
	// receiving
	buf      chunks
	buffered uint64
	recvd    uint64 // next offset expected
	consumed uint64 // this side's consumer took up to here
	granted  uint64 // the consumed offset last sent as CREDIT
	down     bool
	reason   proto.Reason
	left     bool
	err      error // the link's end
	closed   bool
	// notify, if set (a Bridge, setNotify), is called under mu whenever
	// the peer acknowledged more, sent DOWN or LEFT, or the link ended,
	// so that a waiter that does not wait on cond learns of it. It must
	// not block or take mu.
	notify func()
	// sink, if set (a Bridge's out-direction, setSink), takes bytes from
	// the transport's reader while parked (its consumer waits for bytes
	// and the buffer is empty): under mu, without blocking; it returns
	// how many it took (takeData).
	sink   func([]byte) int
	parked bool
	// readStop: the consumer (a Bridge's out-direction) stopped for good
	// (Bridge.StopOut); what still comes stays buffered, unacknowledged.
	readStop bool
	// the peer's ATTACHED came (PeerAttached): attached is closed then
	peerAttached bool
	attached     chan struct{}
}

// Write sends p, waiting for credit: only this flow waits. It returns
// early with the link's error (the bytes not acknowledged are the
// caller's to resend on TCP, from Acked).
//
// The frames are queued in order under the flow's lock and then written
// from the calling goroutine once it let go of the lock (the transport's
// flush), unless another goroutine is writing the connection already and
// takes them along.
func (f *Flow) Write(p []byte) (int, error) {
	f.mu.Lock()
	n, err := f.writeLocked(p, nil, 0)
	f.mu.Unlock()
	f.flush()
	return n, err
}

// writeLocked queues p in frames within the flow's window. With z, p lies
// at off in z's registered region and its frames go by reference (the
// NIC reads them from the guest's ring: zerocopy.go), each one z can
// still take; otherwise, and for the rest, they are copied.
func (f *Flow) writeLocked(p []byte, z *zcFlow, off uint64) (int, error) {
	window := f.m.window
	done := 0
	for done < len(p) {
		if f.err == nil && !f.closed && (!f.peerOpen || f.sent >= f.acked+window) {
			// What this call queued goes out before it waits.
			f.mu.Unlock()
			f.flush()
			f.mu.Lock()
			since := time.Now()
			for f.err == nil && !f.closed && (!f.peerOpen || f.sent >= f.acked+window) {
				f.cond.Wait()
			}
			f.m.stats.stalled.Add(int64(time.Since(since)))
		}
		if f.err != nil {
			return done, f.err
		}
		if f.closed {
			return done, errClosed
		}
		n := min(uint64(len(p)-done), f.acked+window-f.sent, MaxPayload)
		fr := frame{typ: fData, flow: f.id, arg: f.sent}
		if z != nil && z.take() {
			fr.data, fr.zc, fr.zoff = p[done:done+int(n)], z, off+uint64(done)
		} else {
			fr.data, fr.pool = payload(p[done : done+int(n)])
		}
		f.hold(fr)
		f.sent += n
		done += int(n)
		f.m.stats.bytesOut.Add(n)
	}
	return done, nil
}

var errClosed = errors.New("relay flow: closed")

// Read takes the bytes the peer sent, in order. Once they are all read it
// returns ErrDown after the peer's DOWN, io.EOF after its LEFT, or the
// link's error. Taking bytes grants the peer credit (acknowledges them):
// a CREDIT goes out once a quarter window was taken, or when the buffer
// runs dry.
func (f *Flow) Read(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, err := f.readLocked(p)
	f.grantLocked()
	return n, err
}

// readLocked takes bytes as Read does, without acknowledging them: a
// consumer that acknowledges only once the bytes are where Acked promises
// (a Bridge: in its guest's ring) calls grant after.
func (f *Flow) readLocked(p []byte) (int, error) {
	if err := f.waitBytesLocked(); err != nil {
		return 0, err
	}
	n := f.buf.take(p)
	f.buffered -= uint64(n)
	f.consumed += uint64(n)
	return n, nil
}

// peerLeft reports whether the peer's LEFT came: an io.EOF from Read is
// then the peer's writer leaving, not the link's end.
func (f *Flow) peerLeft() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.left
}

// waitBytesLocked waits until bytes are buffered (nil), or returns why
// none will come: the flow's close, the peer's DOWN or LEFT (io.EOF), the
// link's end.
func (f *Flow) waitBytesLocked() error {
	for f.buffered == 0 && !f.down && !f.left && f.err == nil && !f.closed && !f.readStop {
		f.cond.Wait()
	}
	if f.readStop {
		return errOutHalted // Bridge.StopOut: this consumer takes no more
	}
	if f.buffered > 0 {
		return nil
	}
	switch {
	case f.closed:
		return errClosed
	case f.left: // before down: a LEFT queued with a DOWN is still the writer's end
		return io.EOF
	case f.down:
		return ErrDown{Reason: f.reason}
	}
	return f.err
}

// grantLocked sends CREDIT for what was taken, once a quarter window was,
// or when the buffer ran dry.
func (f *Flow) grantLocked() {
	if f.consumed > f.granted && (f.consumed-f.granted >= f.m.window/4 || f.buffered == 0) {
		f.granted = f.consumed
		f.send(frame{typ: fCredit, flow: f.id, arg: f.consumed})
	}
}

// Acked is the offset up to which the peer's consumer took this flow's
// bytes: what the sender may free, and where it resends from on TCP if
// the link ends.
func (f *Flow) Acked() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.acked
}

// Down tells the peer that this direction leaves the link for a reason
// (proto.Reason), after the bytes already written.
func (f *Flow) Down(reason proto.Reason) {
	f.send(frame{typ: fDown, flow: f.id, arg: uint64(reason)})
}

// Left tells the peer that this direction ended at the bytes written so
// far (LEFT with the final offset).
func (f *Flow) Left() {
	f.mu.Lock()
	at := f.sent
	f.mu.Unlock()
	f.send(frame{typ: fLeft, flow: f.id, arg: at})
}

// Attached tells the peer that the reader of the ring this flow's bytes
// go into attached it (ATTACHED): hostd's room tells a vsock stretch's VM
// end so, whose bridge attaches its guest's write ring only then
// (docs/vsock.md, "Attached end to end"). Only for a peer that asked
// (HelloHold): an older one ends the link on it.
func (f *Flow) Attached() {
	f.send(frame{typ: fAttached, flow: f.id})
}

// PeerAttached is closed once the peer's ATTACHED came (Attached).
func (f *Flow) PeerAttached() <-chan struct{} { return f.attached }

// Close forgets the flow here; frames for it that still come are dropped.
func (f *Flow) Close() {
	f.m.mu.Lock()
	if f.m.flows[f.id] == f {
		delete(f.m.flows, f.id)
	}
	f.m.mu.Unlock()
	f.mu.Lock()
	f.closed = true
	f.buf.free()
	f.buffered = 0
	f.cond.Broadcast()
	f.mu.Unlock()
}
