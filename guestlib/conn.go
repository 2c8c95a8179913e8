package guestlib

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

// Path says how a connection's bytes move.
type Path struct {
	Fast   bool   // true: shared-memory rings; false: the kernel's TCP
	Reason string // why not fast ("policy", "no-hostd", ...); "" when fast
}

func (p Path) String() string {
	if p.Fast {
		return "shunt"
	}
	return "tcp(" + p.Reason + ")"
}

// Conn is a TCP connection whose bytes may take the fast path. It implements
// net.Conn (and CloseWrite/CloseRead like *net.TCPConn); as net.Conn
// requires, it is safe for concurrent use, with one Read and one Write at a
// time each.
//
// Its path is decided once: by hostd's verdict (offer, called from the
// Client's reader), or by a local reason (loopback, disabled, no hostd,
// the verdict timeout, Close before the verdict). Calls made before the
// verdict wait for it, bounded by their deadline and the verdict timeout.
type Conn struct {
	tcp    *net.TCPConn
	client *Client
	local  netip.AddrPort
	remote netip.AddrPort
	req    uint32    // the OPEN's ReqID while a verdict is pending; guarded by client.mu
	waitTo time.Time // the verdict is given up after this

	vmu     sync.Mutex    // serializes deciding the path
	verdict chan struct{} // closed once path is decided
	path    Path

	// Fast path, set before verdict is closed.
	side proto.Side
	key  flowKey  // region, slot, generation
	reg  *mapping // the region of its rings: held until Close
	w    *ring.Writer
	rd   *ring.Reader

	readMu, writeMu sync.Mutex
	closeOnce       sync.Once
	revoked         chan struct{} // closed on revocation
	revokeOnce      sync.Once

	// deadlineMu orders deadline changes with the verdict: a deadline set
	// before the rings exist is carried over to them (see decideFast).
	deadlineMu      sync.Mutex
	readDL, writeDL time.Time

	zcRead, zcWrite []byte // TCP-path emulation of the zero-copy API
}

func newConn(c *Client, tcp *net.TCPConn) *Conn {
	return &Conn{
		tcp: tcp, client: c, verdict: make(chan struct{}), revoked: make(chan struct{}),
		local:  tcp.LocalAddr().(*net.TCPAddr).AddrPort(),
		remote: tcp.RemoteAddr().(*net.TCPAddr).AddrPort(),
		waitTo: time.Now().Add(c.opts.VerdictTimeout),
	}
}

// decided reports whether the path is decided.
func (c *Conn) decided() bool {
	select {
	case <-c.verdict:
		return true
	default:
		return false
	}
}

// decide records a TCP path for a local reason, unless the path is
// decided already.
func (c *Conn) decide(reason string) {
	c.vmu.Lock()
	defer c.vmu.Unlock()
	if !c.decided() {
		c.decideLocked(Path{Reason: reason})
	}
}

// decideLocked records the path; the caller holds vmu and has checked that
// it is not decided yet.
func (c *Conn) decideLocked(p Path) {
	c.path = p
	close(c.verdict)
	c.client.logf("shunt: %s -> %s: %s", c.local, c.remote, p)
}

// offer is hostd's verdict for this connection. It reports whether the
// connection took it; a READY it does not take (decided already, or rings
// that do not check out) is given back by the caller (Client.deliverTo).
func (c *Conn) offer(m proto.Msg) bool {
	c.vmu.Lock()
	defer c.vmu.Unlock()
	if c.decided() {
		return false
	}
	if m.Type != proto.Ready {
		c.decideLocked(Path{Reason: m.Reason.String()})
		return true
	}
	if err := c.attach(m); err != nil {
		c.client.logf("shunt: READY for %s did not check out: %v", c.remote, err)
		c.decideLocked(Path{Reason: proto.ReasonInternal.String()})
		return false
	}
	c.deadlineMu.Lock()
	c.rd.SetDeadline(c.readDL)
	c.w.SetDeadline(c.writeDL)
	c.decideLocked(Path{Fast: true})
	c.deadlineMu.Unlock()
	return true
}

// resolve waits for the verdict until the deadline (an error) or the
// verdict timeout (TCP, reason timeout).
func (c *Conn) resolve(deadline time.Time) error {
	select {
	case <-c.verdict:
		return nil
	default:
	}
	giveUp := time.NewTimer(time.Until(c.waitTo))
	defer giveUp.Stop()
	var dl <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		dl = t.C
	}
	select {
	case <-c.verdict:
	case <-giveUp.C:
		c.client.forget(c)
		c.decide(proto.ReasonTimeout.String())
	case <-dl:
		return os.ErrDeadlineExceeded
	}
	return nil
}

// attach maps the rings of a READY; the caller holds vmu.
func (c *Conn) attach(m proto.Msg) error {
	out, in, reg, err := c.client.rings(m)
	if err != nil {
		return err
	}
	p := c.client.opts.Wait
	if c.w, err = ring.NewWriter(out, p); err != nil {
		c.client.releaseRegion(reg)
		return err
	}
	if c.rd, err = ring.NewReader(in, p); err != nil {
		c.client.releaseRegion(reg)
		return err
	}
	c.reg = reg
	c.side, c.key = m.Side, keyOf(m)
	if k := c.client.kick; k != nil {
		peer := proto.SideB
		if m.Side == proto.SideB {
			peer = proto.SideA
		}
		or, ow := out.Waiters() // our writer ring: the peer reads it
		ir, iw := in.Waiters()  // our reader ring: the peer writes it
		k.track(c.key, peer, or, ow, ir, iw)
	}
	c.client.register(c.key, c)
	// Keep the lease alive and noticed: keepalive on the idle TCP socket.
	_ = c.tcp.SetKeepAlive(true)
	_ = c.tcp.SetKeepAlivePeriod(15 * time.Second)
	return nil
}

// Path returns how this connection's bytes move, waiting for hostd's verdict
// if it is not in yet.
func (c *Conn) Path() Path {
	_ = c.resolve(time.Time{})
	return c.path
}

func (c *Conn) fast() bool { return c.path.Fast }

// opErr wraps a ring error the way the net package reports socket errors,
// so callers can match ECONNRESET, EPIPE, timeouts and net.ErrClosed.
func (c *Conn) opErr(op string, err error) error {
	switch {
	case err == nil || err == io.EOF:
		return err
	case errors.Is(err, ring.ErrReset):
		err = os.NewSyscallError(op, syscall.ECONNRESET)
	case errors.Is(err, ring.ErrPeerClosed):
		err = os.NewSyscallError(op, syscall.EPIPE)
	case errors.Is(err, ring.ErrClosed):
		err = net.ErrClosed
	}
	return &net.OpError{Op: op, Net: "tcp", Source: net.TCPAddrFromAddrPort(c.local), Addr: net.TCPAddrFromAddrPort(c.remote), Err: err}
}

func (c *Conn) deadlines() (r, w time.Time) {
	c.deadlineMu.Lock()
	defer c.deadlineMu.Unlock()
	return c.readDL, c.writeDL
}

// Read implements net.Conn.
func (c *Conn) Read(p []byte) (int, error) {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	dl, _ := c.deadlines()
	if err := c.resolve(dl); err != nil {
		return 0, c.opErr("read", err)
	}
	if !c.fast() {
		return c.tcp.Read(p)
	}
	n, err := c.rd.Read(p)
	if err == io.EOF && c.w.IsReset() {
		// hostd resets both rings one after the other; a peer that saw the
		// first may already have closed the second with FIN. A revoked flow
		// ends with ECONNRESET, never a clean EOF.
		err = ring.ErrReset
	}
	return n, c.opErr("read", err)
}

// Write implements net.Conn.
func (c *Conn) Write(p []byte) (int, error) {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	_, dl := c.deadlines()
	if err := c.resolve(dl); err != nil {
		return 0, c.opErr("write", err)
	}
	if !c.fast() {
		return c.tcp.Write(p)
	}
	n, err := c.w.Write(p)
	return n, c.opErr("write", err)
}

// CloseWrite shuts down the writing side: the peer reads EOF after the data.
func (c *Conn) CloseWrite() error {
	if err := c.resolve(time.Time{}); err != nil {
		return err
	}
	if !c.fast() {
		return c.tcp.CloseWrite()
	}
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	return c.opErr("close", c.w.CloseWrite())
}

// CloseRead shuts down the reading side: the peer's writes fail with EPIPE.
func (c *Conn) CloseRead() error {
	if err := c.resolve(time.Time{}); err != nil {
		return err
	}
	if !c.fast() {
		return c.tcp.CloseRead()
	}
	return c.opErr("close", c.rd.CloseRead())
}

// Close implements net.Conn. On the fast path it sends FIN on the ring,
// releases the flow to hostd, and closes the kernel socket (the lease).
func (c *Conn) Close() error {
	var err error
	c.closeOnce.Do(func() {
		c.decide("closed")
		c.client.forget(c) // a verdict still on its way is given back
		if c.fast() {
			// Wake blocked calls first, then publish FIN under the write
			// lock (the Write they were in has returned by then).
			c.w.Close()
			c.rd.Close()
			c.writeMu.Lock()
			select {
			case <-c.revoked:
				// A revoked flow ends like a reset connection.
				_ = c.tcp.SetLinger(0)
			default:
				if !c.w.IsReset() && !c.rd.Stats().Reset {
					_ = c.w.CloseWrite()
				}
			}
			c.writeMu.Unlock()
			_ = c.rd.CloseRead()
			// A Read still copying out of the ring (woken above) finishes
			// before the region may be unmapped.
			c.readMu.Lock()
			c.client.unregister(c.key, c.side, c.reg)
			c.readMu.Unlock()
		}
		err = c.tcp.Close()
	})
	return err
}

// revoke is hostd's REVOKE: make sure both rings are reset (hostd already
// did, unless the region is gone) and wake this end's blocked calls.
func (c *Conn) revoke(reason proto.Reason) {
	c.revokeOnce.Do(func() {
		close(c.revoked)
		c.client.logf("shunt: %s -> %s revoked: %s", c.local, c.remote, reason)
		if c.fast() {
			c.w.Interrupt()
			c.rd.Interrupt()
		}
	})
}

// LocalAddr implements net.Conn.
func (c *Conn) LocalAddr() net.Addr { return c.tcp.LocalAddr() }

// RemoteAddr implements net.Conn.
func (c *Conn) RemoteAddr() net.Addr { return c.tcp.RemoteAddr() }

// SetDeadline implements net.Conn.
func (c *Conn) SetDeadline(t time.Time) error {
	c.SetReadDeadline(t)
	return c.SetWriteDeadline(t)
}

// SetReadDeadline implements net.Conn. Set before the verdict, it bounds
// the wait for it and carries over to the rings.
func (c *Conn) SetReadDeadline(t time.Time) error {
	c.deadlineMu.Lock()
	defer c.deadlineMu.Unlock()
	c.readDL = t
	if c.decided() && c.fast() {
		c.rd.SetDeadline(t)
		return nil
	}
	return c.tcp.SetReadDeadline(t)
}

// SetWriteDeadline implements net.Conn, like SetReadDeadline.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.deadlineMu.Lock()
	defer c.deadlineMu.Unlock()
	c.writeDL = t
	if c.decided() && c.fast() {
		c.w.SetDeadline(t)
		return nil
	}
	return c.tcp.SetWriteDeadline(t)
}

// ReadBuffer returns up to max readable bytes in place (zero copy), blocking
// until at least one is readable; ReleaseRead(n) consumes them. On the TCP
// path it reads into an internal buffer, so callers need not care.
func (c *Conn) ReadBuffer(max int) ([]byte, error) {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	dl, _ := c.deadlines()
	if err := c.resolve(dl); err != nil {
		return nil, c.opErr("read", err)
	}
	if !c.fast() {
		if cap(c.zcRead) < max {
			c.zcRead = make([]byte, max)
		}
		n, err := c.tcp.Read(c.zcRead[:max])
		c.zcRead = c.zcRead[:n]
		return c.zcRead, err
	}
	b, err := c.rd.Peek(max)
	return b, c.opErr("read", err)
}

// ReleaseRead consumes n bytes returned by ReadBuffer.
func (c *Conn) ReleaseRead(n int) error {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	if !c.fast() {
		return nil
	}
	return c.opErr("read", c.rd.Release(n))
}

// WriteBuffer returns up to max bytes of ring space to fill in place (zero
// copy), blocking until some is free; CommitWrite(n) sends them.
func (c *Conn) WriteBuffer(max int) ([]byte, error) {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	_, dl := c.deadlines()
	if err := c.resolve(dl); err != nil {
		return nil, c.opErr("write", err)
	}
	if !c.fast() {
		if cap(c.zcWrite) < max {
			c.zcWrite = make([]byte, max)
		}
		c.zcWrite = c.zcWrite[:max]
		return c.zcWrite, nil
	}
	b, err := c.w.Reserve(max)
	return b, c.opErr("write", err)
}

// CommitWrite sends the first n bytes of the last WriteBuffer.
func (c *Conn) CommitWrite(n int) error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if !c.fast() {
		_, err := c.tcp.Write(c.zcWrite[:n])
		return err
	}
	return c.opErr("write", c.w.Commit(n))
}
