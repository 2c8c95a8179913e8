package relay

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
)

// LinkOptions tune a link.
type LinkOptions struct {
	// Window is each flow's credit window: the bytes a sender may have
	// sent beyond what the receiver's consumer took; 0 = 1 MiB.
	Window int
	// MaxEarly bounds the credits kept for flows not opened yet here (the
	// peer opened first); beyond, the link ends. 0 = 4096.
	MaxEarly int
}

// Link carries flows between this host's relay and a peer host's, over a
// few TCP connections (or any reliable, ordered streams). Safe for
// concurrent use.
type Link struct {
	window   uint64
	maxEarly int
	conns    []*lconn
	done     chan struct{}
	wg       sync.WaitGroup
	dropped  atomic.Uint64 // frames for flows not open here
	stats    linkStats

	mu    sync.Mutex
	flows map[uint32]*Flow
	early map[uint32]uint64 // CREDIT for flows the peer opened first
	err   error
}

// lconn is one connection of a link and its queue of frames to send.
type lconn struct {
	c    net.Conn
	mu   sync.Mutex
	q    []frame
	wake chan struct{}
}

// NewLink runs a link over conns, which both sides must list in the same
// order (a flow uses conns[id % len(conns)] on both). The link owns them.
func NewLink(conns []net.Conn, o LinkOptions) *Link {
	if o.Window <= 0 {
		o.Window = 1 << 20
	}
	if o.MaxEarly <= 0 {
		o.MaxEarly = 4096
	}
	l := &Link{window: uint64(o.Window), maxEarly: o.MaxEarly, done: make(chan struct{}),
		flows: map[uint32]*Flow{}, early: map[uint32]uint64{}}
	for _, c := range conns {
		lc := &lconn{c: c, wake: make(chan struct{}, 1)}
		l.conns = append(l.conns, lc)
		l.wg.Add(2)
		go l.writer(lc)
		go l.reader(lc)
	}
	return l
}

// Err is why the link ended; nil while it runs.
func (l *Link) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// linkStats are the link's counters (Stats), updated without its lock.
type linkStats struct {
	bytesOut, bytesIn, frames, writes atomic.Uint64
	stalled                           atomic.Int64 // ns writers waited for credit, over all flows
}

// Stats are a link's counters, for metrics per link.
type Stats struct {
	BytesOut, BytesIn uint64        // flow bytes (payloads) sent and received
	Frames            uint64        // frames sent
	Writes            uint64        // vectored writes that sent them (Frames/Writes: the batching)
	Stalled           time.Duration // time writers waited for credit, summed over flows (a wait counts once it ends)
}

// Stats returns the link's counters so far.
func (l *Link) Stats() Stats {
	return Stats{BytesOut: l.stats.bytesOut.Load(), BytesIn: l.stats.bytesIn.Load(), Frames: l.stats.frames.Load(),
		Writes: l.stats.writes.Load(), Stalled: time.Duration(l.stats.stalled.Load())}
}

// Dropped counts frames that named a flow not open here (a late frame of
// a closed flow, or a peer's mistake); they are ignored.
func (l *Link) Dropped() uint64 { return l.dropped.Load() }

// Close ends the link: every flow fails with err (nil: "link closed").
func (l *Link) Close() { l.fail(errors.New("relay link: closed")) }

func (l *Link) fail(err error) {
	l.mu.Lock()
	if l.err != nil {
		l.mu.Unlock()
		return
	}
	l.err = err
	close(l.done)
	flows := make([]*Flow, 0, len(l.flows))
	for _, f := range l.flows {
		flows = append(flows, f)
	}
	l.mu.Unlock()
	for _, c := range l.conns {
		c.c.Close()
	}
	for _, f := range flows {
		f.mu.Lock()
		if f.err == nil {
			f.err = err
		}
		f.cond.Broadcast()
		f.mu.Unlock()
	}
}

// Wait waits for the link's goroutines after it ended.
func (l *Link) Wait() { l.wg.Wait() }

func (l *Link) send(c *lconn, f frame) {
	c.mu.Lock()
	c.q = append(c.q, f)
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// writer sends c's queued frames: all that are queued at once, in one
// vectored write, so small frames are batched and large ones go whole.
func (l *Link) writer(c *lconn) {
	defer l.wg.Done()
	for {
		select {
		case <-l.done:
			return
		case <-c.wake:
		}
		c.mu.Lock()
		q := c.q
		c.q = nil
		c.mu.Unlock()
		if len(q) == 0 {
			continue
		}
		bufs := make(net.Buffers, 0, 2*len(q))
		hdrs := make([]byte, 0, headerSize*len(q))
		for _, f := range q {
			hdrs = f.header(hdrs)
			bufs = append(bufs, hdrs[len(hdrs)-headerSize:])
			if len(f.data) > 0 {
				bufs = append(bufs, f.data)
			}
		}
		l.stats.frames.Add(uint64(len(q)))
		l.stats.writes.Add(1)
		if _, err := bufs.WriteTo(c.c); err != nil {
			l.fail(fmt.Errorf("relay link: write: %w", err))
			return
		}
	}
}

// reader takes c's frames. It never blocks on a flow's consumer: a flow's
// bytes are buffered (at most its window, which the sender may not
// exceed), so one slow reader stalls no other flow.
func (l *Link) reader(c *lconn) {
	defer l.wg.Done()
	scratch := make([]byte, MaxPayload)
	for {
		fr, err := readFrame(c.c, scratch)
		if err == nil {
			err = l.take(fr)
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = fmt.Errorf("relay link: the peer closed a connection: %w", err)
			}
			l.fail(err)
			return
		}
	}
}

// take applies one frame from the peer, checked as untrusted input.
func (l *Link) take(fr frame) error {
	l.mu.Lock()
	f := l.flows[fr.flow]
	if f == nil {
		if fr.typ == fCredit {
			if _, ok := l.early[fr.flow]; !ok && len(l.early) >= l.maxEarly {
				l.mu.Unlock()
				return fmt.Errorf("%w: credit for over %d flows not open here", ErrProtocol, l.maxEarly)
			}
			l.early[fr.flow] = fr.arg
		} else {
			l.dropped.Add(1)
		}
		l.mu.Unlock()
		return nil
	}
	l.mu.Unlock()
	f.mu.Lock()
	defer f.mu.Unlock()
	defer f.cond.Broadcast()
	switch fr.typ {
	case fData:
		n := uint64(len(fr.data))
		switch {
		case f.left || f.down:
			return fmt.Errorf("%w: flow %d: bytes after its end", ErrProtocol, f.id)
		case fr.arg != f.recvd:
			return fmt.Errorf("%w: flow %d: bytes at offset %d, expected %d", ErrProtocol, f.id, fr.arg, f.recvd)
		case f.recvd+n > f.granted+l.window:
			return fmt.Errorf("%w: flow %d: bytes up to %d beyond the credit %d", ErrProtocol, f.id, f.recvd+n, f.granted+l.window)
		}
		f.buf.put(fr.data)
		f.buffered += n
		f.recvd += n
		l.stats.bytesIn.Add(n)
	case fCredit:
		if fr.arg < f.acked || fr.arg > f.sent {
			return fmt.Errorf("%w: flow %d: credit for offset %d, acked %d, sent %d", ErrProtocol, f.id, fr.arg, f.acked, f.sent)
		}
		f.acked, f.peerOpen = fr.arg, true
	case fDown:
		f.down, f.reason = true, proto.Reason(fr.arg)
	case fLeft:
		if fr.arg != f.recvd {
			return fmt.Errorf("%w: flow %d: LEFT at %d, received %d", ErrProtocol, f.id, fr.arg, f.recvd)
		}
		f.left = true
	}
	return nil
}

// Open opens flow id on this side; the peer opens the same id (the
// pairing across hosts gives both relays the id). Nothing is sent on it
// until the peer opened it too and granted its first credit.
func (l *Link) Open(id uint32) (*Flow, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return nil, l.err
	}
	if l.flows[id] != nil {
		return nil, fmt.Errorf("relay link: flow %d is open", id)
	}
	f := &Flow{l: l, id: id, c: l.conns[int(id)%len(l.conns)]}
	f.cond = sync.NewCond(&f.mu)
	if a, ok := l.early[id]; ok {
		if a != 0 {
			return nil, fmt.Errorf("%w: flow %d: credit for offset %d before anything was sent", ErrProtocol, id, a)
		}
		f.peerOpen = true
		delete(l.early, id)
	}
	l.flows[id] = f
	l.send(f.c, frame{typ: fCredit, flow: id, arg: 0})
	return f, nil
}

// ErrDown is what a flow's Read returns once the peer sent DOWN and every
// byte before it was read.
type ErrDown struct{ Reason proto.Reason }

func (e ErrDown) Error() string { return "relay flow: down (" + e.Reason.String() + ")" }

// Flow is one direction pair of a connection on a link.
type Flow struct {
	l    *Link
	id   uint32
	c    *lconn
	mu   sync.Mutex
	cond *sync.Cond

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
}

// Write sends p, waiting for credit: only this flow waits. It returns
// early with the link's error (the bytes not acknowledged are the
// caller's to resend on TCP, from Acked).
func (f *Flow) Write(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	done := 0
	for done < len(p) {
		if f.err == nil && !f.closed && (!f.peerOpen || f.sent >= f.acked+f.l.window) {
			since := time.Now()
			for f.err == nil && !f.closed && (!f.peerOpen || f.sent >= f.acked+f.l.window) {
				f.cond.Wait()
			}
			f.l.stats.stalled.Add(int64(time.Since(since)))
		}
		if f.err != nil {
			return done, f.err
		}
		if f.closed {
			return done, errClosed
		}
		n := min(uint64(len(p)-done), f.acked+f.l.window-f.sent, MaxPayload)
		chunk := append([]byte(nil), p[done:done+int(n)]...)
		f.l.send(f.c, frame{typ: fData, flow: f.id, arg: f.sent, data: chunk})
		f.sent += n
		done += int(n)
		f.l.stats.bytesOut.Add(n)
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
	for f.buffered == 0 && !f.down && !f.left && f.err == nil && !f.closed {
		f.cond.Wait()
	}
	if f.buffered == 0 {
		switch {
		case f.closed:
			return 0, errClosed
		case f.down:
			return 0, ErrDown{Reason: f.reason}
		case f.left:
			return 0, io.EOF
		}
		return 0, f.err
	}
	n := f.buf.take(p)
	f.buffered -= uint64(n)
	f.consumed += uint64(n)
	if f.consumed-f.granted >= f.l.window/4 || f.buffered == 0 {
		f.granted = f.consumed
		f.l.send(f.c, frame{typ: fCredit, flow: f.id, arg: f.consumed})
	}
	return n, nil
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
	f.l.send(f.c, frame{typ: fDown, flow: f.id, arg: uint64(reason)})
}

// Left tells the peer that this direction ended at the bytes written so
// far (LEFT with the final offset).
func (f *Flow) Left() {
	f.mu.Lock()
	at := f.sent
	f.mu.Unlock()
	f.l.send(f.c, frame{typ: fLeft, flow: f.id, arg: at})
}

// Close forgets the flow here; frames for it that still come are dropped.
func (f *Flow) Close() {
	f.l.mu.Lock()
	if f.l.flows[f.id] == f {
		delete(f.l.flows, f.id)
	}
	f.l.mu.Unlock()
	f.mu.Lock()
	f.closed = true
	f.buf.free()
	f.buffered = 0
	f.cond.Broadcast()
	f.mu.Unlock()
}
