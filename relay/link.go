package relay

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
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
// concurrent use. Its flows, credits and checks are the shared engine
// (flows.go); this file is the transport.
type Link struct {
	mux
	conns []*lconn
}

// lconn is one connection of a link and its queue of frames to send.
// Whoever finds the connection idle writes the queue: a bridge's
// in-direction writes its own frames at once (Flow.Write calls flush),
// with no hand-off to another goroutine on the path of every message,
// and frames queued meanwhile (other flows', the readers' credits) go
// out with them in the same vectored write. That write never blocks: what
// the socket does not take at once goes to the connection's writer
// goroutine, which writes it and the rest of the queue, blocking as
// needed; so a bridge never waits for the socket (its Stop returns within
// a wake-up even on a stuck link). The link's readers never write (a
// reader blocked on a full socket while the peer's reader is blocked the
// same way would stop both hosts): their frames go to the writer
// goroutine, unless a write in progress takes them along.
type lconn struct {
	c    net.Conn
	raw  syscall.RawConn // nil: no non-blocking writes (flush leaves the queue to the writer goroutine)
	l    *Link
	wake chan struct{}

	mu      sync.Mutex
	q       []frame
	writing bool // a goroutine owns the writing (the fields below)
	handoff bool // flush left pend to the writer goroutine

	spare []frame // the last written queue, reused
	bufs  net.Buffers
	hdrs  []byte
	pend  net.Buffers // what a non-blocking write left
	pendQ []frame     // its frames, released once written
}

// NewLink runs a link over conns, which both sides must list in the same
// order (a flow uses conns[id % len(conns)] on both). The link owns them.
func NewLink(conns []net.Conn, o LinkOptions) *Link {
	l := &Link{}
	l.init(o.Window, o.MaxEarly)
	l.route = func(id uint32) func(frame) {
		return l.conns[int(id)%len(l.conns)].queue
	}
	l.holdFor = func(id uint32) (func(frame), func()) {
		c := l.conns[int(id)%len(l.conns)]
		return c.hold, c.flush
	}
	l.teardown = func() {
		for _, c := range l.conns {
			c.c.Close()
		}
	}
	for _, c := range conns {
		lc := &lconn{c: c, l: l, wake: make(chan struct{}, 1)}
		if sc, ok := c.(syscall.Conn); ok {
			lc.raw, _ = sc.SyscallConn()
		}
		l.conns = append(l.conns, lc)
	}
	for _, lc := range l.conns {
		l.wg.Add(2)
		go l.writer(lc)
		go l.reader(lc)
	}
	return l
}

// Flushed waits until every frame queued so far on the link's
// connections was handed to the kernel (or the link ended), at most until
// deadline; it reports whether it was. A vsock stretch's end calls it
// before its program may exit: the LEFT after the last byte is queued,
// and a process that exits with it unwritten ends its stream without it,
// which the host must take as a break (a reset), not as the writer's end.
func (l *Link) Flushed(deadline time.Time) bool {
	for {
		idle := true
		for _, c := range l.conns {
			c.mu.Lock()
			if c.writing || len(c.q) > 0 || len(c.pend) > 0 {
				idle = false
			}
			c.mu.Unlock()
		}
		select {
		case <-l.done:
			return idle
		default:
		}
		if idle {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// queue adds f to the connection's queue; it never blocks. Unless a
// write is in progress (which takes f along), the writer goroutine is
// woken.
func (c *lconn) queue(f frame) {
	c.mu.Lock()
	c.q = append(c.q, f)
	busy := c.writing
	c.mu.Unlock()
	if !busy {
		c.kick()
	}
}

// hold adds f to the queue without waking the writer goroutine: the
// caller flushes after it.
func (c *lconn) hold(f frame) {
	c.mu.Lock()
	c.q = append(c.q, f)
	c.mu.Unlock()
}

func (c *lconn) kick() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// flush writes the queue from the calling goroutine, without blocking,
// unless another one owns the writing (it takes the queue along). What
// the socket does not take goes to the writer goroutine.
func (c *lconn) flush() {
	c.mu.Lock()
	if c.writing || len(c.q) == 0 {
		c.mu.Unlock()
		return
	}
	if c.raw == nil {
		c.mu.Unlock()
		c.kick()
		return
	}
	c.writing = true
	for len(c.q) > 0 {
		q := c.q
		c.q = c.spare[:0]
		c.mu.Unlock()
		c.build(q)
		err := c.tryWrite()
		c.mu.Lock()
		if err != nil {
			c.writing = false
			c.mu.Unlock()
			c.l.fail(fmt.Errorf("relay link: write: %w", err))
			return
		}
		if len(c.pend) > 0 {
			c.pendQ, c.handoff = q, true // writing stays set: the writer goroutine owns it now
			c.mu.Unlock()
			c.kick()
			return
		}
		c.sent(q)
	}
	c.writing = false
	c.mu.Unlock()
}

// build lays q out in c.pend: each frame's header, then its payload.
func (c *lconn) build(q []frame) {
	c.bufs = c.bufs[:0]
	c.hdrs = c.hdrs[:0]
	for _, f := range q {
		c.hdrs = f.header(c.hdrs)
	}
	for i, f := range q {
		c.bufs = append(c.bufs, c.hdrs[i*headerSize:(i+1)*headerSize])
		if len(f.data) > 0 {
			c.bufs = append(c.bufs, f.data)
		}
	}
	c.pend = c.bufs
	c.l.stats.frames.Add(uint64(len(q)))
	c.l.stats.writes.Add(1)
}

// tryWrite writes what it can of c.pend in one non-blocking writev and
// leaves the rest in c.pend.
func (c *lconn) tryWrite() error {
	var n int
	var werr error
	err := c.raw.Write(func(fd uintptr) bool {
		iov := [][]byte(c.pend)
		if len(iov) > 1024 { // IOV_MAX
			iov = iov[:1024]
		}
		n, werr = unix.Writev(int(fd), iov)
		return true // never wait for room: the writer goroutine does
	})
	if err == nil && werr != nil && !errors.Is(werr, unix.EAGAIN) && !errors.Is(werr, unix.EINTR) {
		err = werr
	}
	for n > 0 && len(c.pend) > 0 {
		k := min(n, len(c.pend[0]))
		c.pend[0] = c.pend[0][k:]
		n -= k
		if len(c.pend[0]) == 0 {
			c.pend = c.pend[1:]
		}
	}
	return err
}

// sent gives q's payload buffers back and keeps q's array for reuse
// (c.mu held, by the owner of the writing).
func (c *lconn) sent(q []frame) {
	for i := range q {
		q[i].release()
	}
	clear(q)
	c.spare = q[:0]
}

// writer writes what was queued while nobody else was writing (the
// readers' credits, frames of senders that do not flush), and what a
// flush left, blocking as the socket needs.
func (l *Link) writer(c *lconn) {
	defer l.wg.Done()
	for {
		select {
		case <-l.done:
			return
		case <-c.wake:
		}
		c.mu.Lock()
		switch {
		case c.handoff:
			c.handoff = false
		case c.writing:
			c.mu.Unlock()
			continue
		default:
			c.writing = true
			if len(c.q) == 0 {
				c.writing = false
				c.mu.Unlock()
				continue
			}
			c.pendQ, c.q = c.q, c.spare[:0]
			c.mu.Unlock()
			c.build(c.pendQ)
			c.mu.Lock()
		}
		// The writing is this goroutine's: c.pend, then the queue.
		for {
			pend, q := c.pend, c.pendQ
			c.mu.Unlock()
			_, err := pend.WriteTo(c.c)
			c.mu.Lock()
			c.pend, c.pendQ = nil, nil
			if err != nil {
				c.writing = false
				c.mu.Unlock()
				l.fail(fmt.Errorf("relay link: write: %w", err))
				return
			}
			c.sent(q)
			if len(c.q) == 0 {
				break
			}
			c.pendQ, c.q = c.q, c.spare[:0]
			c.mu.Unlock()
			c.build(c.pendQ)
			c.mu.Lock()
		}
		c.writing = false
		c.mu.Unlock()
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
