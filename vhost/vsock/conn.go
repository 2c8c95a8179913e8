package vsock

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"
)

type connState int

const (
	connecting  connState = iota // the host's REQUEST is out
	established                  // RESPONSE sent or received
	gone                         // reset, or both ends shut down: forgotten by the device
)

// What a connection still has to send besides data.
const (
	wantResponse = 1 << iota
	wantRequest
	wantCredit
)

// lingerTimeout bounds how long a closed connection waits for the guest to
// take its last bytes and answer its SHUTDOWN with RST.
const lingerTimeout = 10 * time.Second

// Conn is one vsock stream between the host and the guest. It is a
// net.Conn; CloseWrite half-closes it.
type Conn struct {
	d     *Device
	k     key
	state connState
	want  int
	// receive side: what the guest sent and the host has not read
	in           ringBuf
	fwdCnt       uint32 // bytes the host has read (credit the guest sees)
	lastFwdSent  uint32
	peerShutSend bool // the guest sends no more: EOF after in
	peerShutRecv bool // the guest takes no more: Write fails
	readClosed   bool
	writeClosed  bool // CloseWrite or Close: SHUTDOWN after out
	closed       bool
	shutSent     uint32
	out          ringBuf // written, not yet in the guest's rx buffers
	txCnt        uint32
	peerBufAlloc uint32
	peerFwdCnt   uint32
	err          error // reset: returned by Write, and by Read after in
	inReady      bool
	changed      chan struct{} // closed and replaced at every change
	rdl, wdl     time.Time
	established  chan struct{} // Dial waits on it
	linger       *time.Timer
}

// credit is how many bytes the guest can take now.
func (c *Conn) credit() uint32 {
	inFlight := c.txCnt - c.peerFwdCnt
	if inFlight > c.peerBufAlloc {
		return 0
	}
	return c.peerBufAlloc - inFlight
}

// sendable reports whether c has a packet to send now.
func (c *Conn) sendable() bool {
	if c.state == gone {
		return false
	}
	if c.want != 0 {
		return c.want&^wantResponse != 0 || c.state == established
	}
	if c.state != established {
		return false
	}
	return (c.out.len() > 0 && c.credit() > 0) || c.pendingShutdown() != 0
}

// pendingShutdown is the SHUTDOWN flags c still owes once out is sent.
func (c *Conn) pendingShutdown() uint32 {
	if c.out.len() > 0 || !c.writeClosed {
		return 0
	}
	f := uint32(ShutdownSend)
	if c.closed {
		f |= ShutdownRcv
	}
	return f &^ c.shutSent
}

// next builds c's next packet, with at most max payload bytes.
func (c *Conn) next(max int) (Hdr, []byte) {
	d := c.d
	c.lastFwdSent = c.fwdCnt
	switch {
	case c.want&wantRequest != 0:
		c.want &^= wantRequest
		return d.hdr(c, OpRequest), nil
	case c.want&wantResponse != 0:
		c.want &^= wantResponse
		return d.hdr(c, OpResponse), nil
	case c.out.len() > 0 && c.credit() > 0:
		c.want &^= wantCredit
		// A view into out: pump copies it into the guest's buffer
		// before anything else touches out.
		p := c.out.peek(min(max, int(c.credit())))
		n := len(p)
		c.out.skip(n)
		c.txCnt += uint32(n)
		c.wake()
		return d.hdr(c, OpRW), p
	case c.pendingShutdown() != 0:
		h := d.hdr(c, OpShutdown)
		h.Flags = c.pendingShutdown()
		c.shutSent |= h.Flags
		return h, nil
	default: // wantCredit
		c.want &^= wantCredit
		return d.hdr(c, OpCreditUpdate), nil
	}
}

// receive handles a packet of c's from the guest.
func (c *Conn) receive(h Hdr, segs [][]byte) {
	d := c.d
	c.peerBufAlloc, c.peerFwdCnt = h.BufAlloc, h.FwdCnt
	defer c.wake()
	switch h.Op {
	case OpResponse:
		if c.state != connecting {
			d.violation(h, "RESPONSE on an established connection")
			return
		}
		c.state = established
		close(c.established)
	case OpRW:
		if c.state != established || c.peerShutSend {
			d.violation(h, "data before RESPONSE or after SHUTDOWN(send)")
			return
		}
		if c.in.len()+int(h.Len) > RecvBuf {
			d.violation(h, fmt.Sprintf("data beyond the credit (%d buffered, %d more, buf_alloc %d)", c.in.len(), h.Len, RecvBuf))
			return
		}
		d.stats.RxBytes.Add(uint64(h.Len))
		if c.readClosed {
			c.fwdCnt += h.Len // nobody reads: consumed at once
			c.want |= wantCredit
			break
		}
		c.in.fill(segs, HdrSize, int(h.Len))
	case OpCreditUpdate:
	case OpCreditRequest:
		c.want |= wantCredit
	case OpShutdown:
		c.peerShutSend = c.peerShutSend || h.Flags&ShutdownSend != 0
		c.peerShutRecv = c.peerShutRecv || h.Flags&ShutdownRcv != 0
		if c.peerShutSend && c.peerShutRecv {
			// The guest closed: answer RST, as its close waits for
			// one, and forget the ports; what it sent stays readable.
			c.out.drop()
			c.finish(nil)
		}
	case OpRst:
		if c.state == connecting {
			c.finish(syscall.ECONNREFUSED)
		} else {
			c.peerShutSend, c.peerShutRecv = true, true
			c.finish(syscall.ECONNRESET)
		}
	case OpRequest:
		d.violation(h, "REQUEST on an open connection")
	default:
		d.violation(h, fmt.Sprintf("unknown op %d", h.Op))
	}
	d.markReady(c)
}

// finish ends c: an RST goes to the guest unless err says the guest reset
// it, and the device forgets it. Writes fail with err (EPIPE for nil).
func (c *Conn) finish(err error) {
	if c.state == gone {
		return
	}
	if err == nil {
		err = syscall.EPIPE
	}
	if c.err == nil {
		c.err = err
	}
	if c.state == connecting {
		close(c.established)
	}
	c.state = gone
	c.want = 0
	if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, ErrGone) {
		c.d.queueRst(c.d.hdr(c, OpRst))
	}
	if c.linger != nil {
		c.linger.Stop()
	}
	c.d.remove(c)
	c.wake()
}

// abort resets c for a protocol violation: RST, and reads and writes fail.
func (c *Conn) abort(err error) {
	c.in.drop()
	c.out.drop()
	c.peerShutSend = true
	c.err = err
	c.finish(err)
}

// reset is abort without an RST (the guest is gone).
func (c *Conn) reset(err error) {
	c.peerShutSend = true
	if c.err == nil {
		c.err = err
	}
	c.finish(err)
}

func (c *Conn) wake() {
	close(c.changed)
	c.changed = make(chan struct{})
}

// wait waits, with the device's lock held (and released meanwhile), for a
// change or the deadline.
func (c *Conn) wait(deadline time.Time) error {
	ch := c.changed
	var timeout <-chan time.Time
	if !deadline.IsZero() {
		dt := time.Until(deadline)
		if dt <= 0 {
			return os.ErrDeadlineExceeded
		}
		t := time.NewTimer(dt)
		defer t.Stop()
		timeout = t.C
	}
	c.d.mu.Unlock()
	defer c.d.mu.Lock()
	select {
	case <-ch:
		return nil
	case <-timeout:
		return os.ErrDeadlineExceeded
	}
}

func (c *Conn) opErr(op string, err error) error {
	return &net.OpError{Op: op, Net: "vsock", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

// Read reads what the guest sent; io.EOF after the guest's SHUTDOWN(send)
// or close.
func (c *Conn) Read(p []byte) (int, error) {
	d := c.d
	d.mu.Lock()
	defer d.mu.Unlock()
	for {
		switch {
		case c.closed || c.readClosed:
			return 0, c.opErr("read", net.ErrClosed)
		case c.in.len() > 0 && len(p) > 0:
			n := c.in.read(p)
			c.fwdCnt += uint32(n)
			// Tell the guest once half the buffer is free again (every
			// packet carries fwd_cnt; this is for a guest waiting).
			if c.state == established && c.fwdCnt-c.lastFwdSent >= RecvBuf/2 {
				c.want |= wantCredit
				d.markReady(c)
				d.pump()
			}
			return n, nil
		case c.peerShutSend:
			if c.err != nil && !errors.Is(c.err, syscall.ECONNRESET) && !errors.Is(c.err, syscall.EPIPE) {
				return 0, c.opErr("read", c.err)
			}
			return 0, io.EOF
		}
		if err := c.wait(c.rdl); err != nil {
			return 0, c.opErr("read", err)
		}
	}
}

// Write queues p for the guest (at most SendBuf ahead), waiting for room.
func (c *Conn) Write(p []byte) (int, error) {
	d := c.d
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for n < len(p) {
		switch {
		case c.closed || c.writeClosed:
			return n, c.opErr("write", net.ErrClosed)
		case c.err != nil:
			return n, c.opErr("write", c.err)
		case c.peerShutRecv:
			return n, c.opErr("write", syscall.EPIPE)
		}
		if room := c.out.room(); room > 0 {
			k := min(room, len(p)-n)
			c.out.fill([][]byte{p[n : n+k]}, 0, k)
			n += k
			d.markReady(c)
			d.pump()
			continue
		}
		if err := c.wait(c.wdl); err != nil {
			return n, c.opErr("write", err)
		}
	}
	return n, nil
}

// CloseWrite sends SHUTDOWN(send) after what was written.
func (c *Conn) CloseWrite() error {
	d := c.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if c.closed {
		return c.opErr("close", net.ErrClosed)
	}
	c.writeClosed = true
	d.markReady(c)
	d.pump()
	c.wake()
	return nil
}

// Close sends what was written, then SHUTDOWN(send and receive); the
// device forgets the connection when the guest answers RST, or after
// lingerTimeout with an RST of its own.
func (c *Conn) Close() error {
	d := c.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if c.closed {
		return c.opErr("close", net.ErrClosed)
	}
	c.closed, c.writeClosed, c.readClosed = true, true, true
	c.fwdCnt += uint32(c.in.len())
	c.in.drop()
	if c.state == gone {
		c.wake()
		return nil
	}
	if c.state == connecting {
		c.finish(net.ErrClosed)
		return nil
	}
	d.markReady(c)
	d.pump()
	c.linger = time.AfterFunc(lingerTimeout, func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		c.finish(os.ErrDeadlineExceeded)
		d.pump()
	})
	c.wake()
	return nil
}

// LocalAddr is the host's end (CID 2), RemoteAddr the guest's.
func (c *Conn) LocalAddr() net.Addr  { return &Addr{CID: HostCID, Port: c.k.host} }
func (c *Conn) RemoteAddr() net.Addr { return &Addr{CID: c.d.cid, Port: c.k.guest} }

// SetDeadline sets both deadlines.
func (c *Conn) SetDeadline(t time.Time) error { return c.setDeadline(t, true, true) }

// SetReadDeadline sets the read deadline.
func (c *Conn) SetReadDeadline(t time.Time) error { return c.setDeadline(t, true, false) }

// SetWriteDeadline sets the write deadline.
func (c *Conn) SetWriteDeadline(t time.Time) error { return c.setDeadline(t, false, true) }

// setDeadline sets the deadlines and wakes the waiters to see them.
func (c *Conn) setDeadline(t time.Time, read, write bool) error {
	c.d.mu.Lock()
	defer c.d.mu.Unlock()
	if read {
		c.rdl = t
	}
	if write {
		c.wdl = t
	}
	c.wake()
	return nil
}

// Addr is a vsock address.
type Addr struct {
	CID  uint64
	Port uint32
}

func (a *Addr) Network() string { return "vsock" }
func (a *Addr) String() string  { return fmt.Sprintf("%d:%d", a.CID, a.Port) }
