package guestlib

import (
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/shm/ring"
)

// The reader (docs/DESIGN.md, "Reader algorithm"): roff is the stream
// offset of the next byte for the application. On TCP with a ring
// attached, it reads TCP up to exactly the ring's start once the writer
// has announced it, then the ring until the writer left it (ErrLeft),
// then TCP again. A TCP read made before the start was known can return
// bytes past it (the writer moved to the ring, left it and wrote TCP
// again meanwhile): those are stashed and come after the ring's stretch.

// errAgain tells the read loop to look at the paths again.
var errAgain = errors.New("again")

// Read implements net.Conn.
func (c *Conn) Read(p []byte) (_ int, err error) {
	defer c.caught(fault.Arm(), "read", &err)
	c.readMu.Lock()
	defer c.readMu.Unlock()
	if len(p) == 0 {
		return 0, nil
	}
	for {
		if c.closed.Load() {
			return 0, c.opErr("read", net.ErrClosed)
		}
		if c.rst.Load() {
			return 0, c.resetErr("read", errBrokenStream)
		}
		if c.rshut.Load() {
			return 0, io.EOF
		}
		if expired(c.readDeadline()) {
			return 0, c.opErr("read", os.ErrDeadlineExceeded)
		}
		if len(c.back) > 0 {
			return c.readBackLocked(p), nil
		}
		c.readerFlowLocked()
		var n int
		var err error
		if c.rOnRing {
			n, err = c.readRingLocked(func(rd *ring.Reader) (int, error) { return rd.TryRead(p) })
			c.roff += uint64(n)
			c.st.ringRecv.Add(uint64(n))
		} else {
			n, err = c.readTCPLocked(p)
		}
		if err == errAgain {
			continue
		}
		return n, c.resetErr("read", err)
	}
}

// readerFlowLocked picks up the current flow if this direction has not
// left it yet.
func (c *Conn) readerFlowLocked() {
	if c.rf == nil {
		if f := c.cur.Load(); f != nil && !f.rLeft.Load() {
			c.rf = f
		}
	}
}

// readRingLocked reads rf's ring with try (TryRead or TryPeek, which
// return the bytes they handed out), waiting while it is empty. It leaves
// the ring once drained after the writer's leave, or with the writer's
// process gone, and returns errAgain then.
func (c *Conn) readRingLocked(try func(*ring.Reader) (int, error)) (int, error) {
	f := c.rf
	for {
		gone := f.peerGone.Load()
		n, err := try(f.rd)
		switch {
		case n > 0:
			return n, nil
		case errors.Is(err, ring.ErrLeft):
			c.leaveReadLocked()
			return 0, errAgain
		case err == io.EOF:
			return 0, io.EOF // a ring FIN (older writers): the stream ends here
		case err != nil:
			return 0, c.opErr("read", err)
		case gone:
			c.leaveReadLocked()
			return 0, errAgain
		}
		if c.closed.Load() {
			return 0, c.opErr("read", net.ErrClosed)
		}
		if c.rshut.Load() {
			return 0, io.EOF
		}
		err = f.rwait.Wait(c.readDeadline())
		if err != nil {
			return 0, c.opErr("read", err)
		}
	}
}

// leaveReadLocked marks the read ring left and goes on over TCP.
func (c *Conn) leaveReadLocked() {
	f := c.rf
	_ = f.rd.Leave()
	c.rf, c.rOnRing, c.zcPeek = nil, false, false
	c.st.rOnRing.Store(false)
	c.st.rToTCP.Add(1)
	f.rLeft.Store(true)
	c.maybeLeft(f)
}

// toRingLocked moves the reader to rf's ring: the TCP stream is at its
// start.
func (c *Conn) toRingLocked() {
	c.rOnRing = true
	c.st.rOnRing.Store(true)
	c.st.rToRing.Add(1)
}

// readerTryLeaveLocked leaves the read ring if nothing more can come from
// it, without blocking (for DOWN, the leaver and Close). Bytes the ring
// still holds once its writer left are copied out first (drainLocked):
// hostd may take the ring's memory away soon after a DOWN (a revocation),
// and a reader that does not read for a while must lose nothing.
func (c *Conn) readerTryLeaveLocked() {
	c.readerFlowLocked()
	f := c.rf
	if f == nil || c.zcPeek {
		return
	}
	if c.rst.Load() {
		c.leaveReadLocked() // reset by RESUME: nothing more is read
		return
	}
	gone := f.peerGone.Load() // before the flags: a gone peer starts no more
	start, started, left := f.rd.WriterState()
	if !started {
		if left || gone {
			c.leaveReadLocked()
		}
		return
	}
	if !c.rOnRing {
		if start != c.roff {
			// TCP bytes before the ring's start are still due (or the
			// start lies behind: the Read reports the broken stream).
			if left || gone {
				c.holdAheadLocked(f, start)
			}
			return
		}
		c.toRingLocked()
	}
	gone = gone || f.peerGone.Load()
	b, err := f.rd.Buffered()
	if err != nil {
		return
	}
	if b > 0 && !((gone || f.rd.WriterLeft()) && c.drainLocked(f)) {
		return
	}
	if _, err := f.rd.TryRead(nil); gone || errors.Is(err, ring.ErrLeft) {
		c.leaveReadLocked()
	}
}

// drainLocked copies what rf's ring holds, its writer gone or left, to
// the front of the stash, where the reader finds it before any later TCP
// byte: the stretch's last bytes now live in the library's memory. It
// reports whether the ring is empty now.
func (c *Conn) drainLocked(f *flow) bool {
	if got := readOut(f.rd); len(got) > 0 { // counted as ring bytes when read (Stats)
		c.stash = append(got, c.stash...)
		c.stashRing += len(got)
	}
	b, err := f.rd.Buffered()
	return err == nil && b == 0
}

// readOut reads all that rd holds now into memory of its own.
func readOut(rd *ring.Reader) []byte {
	var got []byte
	buf := make([]byte, 64<<10)
	for {
		n, err := rd.TryRead(buf)
		got = append(got, buf[:n]...)
		if n == 0 || err != nil {
			return got
		}
	}
}

// holdAheadLocked copies the whole stretch of rf's ring, which started
// at start past roff and whose writer left it (or is gone), out to
// c.ahead, and leaves the ring; it reports whether it did. The TCP bytes
// before start are still due: after a DOWN for a firewall that now drops
// them they come only with TCP's retransmissions, once the rule goes,
// which may take many seconds. The ring must not wait for them: hostd
// takes a retired region's memory back after its grace (a reader of it
// then fails), and the connection comes back to the rings only once
// this end left them. One stretch at a time (at most a ring's capacity
// of memory, whatever the peer does): while one is held, the next
// READY's read ring is attached only once the TCP stream reached it
// (flow.attachLater), so an honest writer cannot start a second stretch
// meanwhile; one that starts it unattached keeps its ring until then.
func (c *Conn) holdAheadLocked(f *flow, start uint64) bool {
	if c.ahead != nil || start <= c.roff {
		return false
	}
	if got := readOut(f.rd); len(got) > 0 {
		c.ahead, c.aheadAt = got, start
		c.fmu.Lock()
		c.aheadHeld.Store(true)
		c.fmu.Unlock()
	}
	c.leaveReadLocked()
	return true
}

// aheadDueLocked moves the stretch held ahead to the front of the stash
// once the TCP stream reached its start, and reports whether it did.
// Otherwise it returns how many TCP bytes may be read before it (0: none
// is held).
func (c *Conn) aheadDueLocked() (moved bool, limit uint64) {
	if c.ahead == nil {
		return false, 0
	}
	if c.roff < c.aheadAt {
		return false, c.aheadAt - c.roff
	}
	c.stash = append(c.ahead, c.stash...) // counted as ring bytes when read
	c.stashRing += len(c.ahead)
	c.ahead = nil
	c.fmu.Lock()
	c.aheadHeld.Store(false)
	if f := c.cur.Load(); f != nil && f.attachLater {
		f.attachLater = false
		if !f.down.Load() && !f.rLeft.Load() {
			f.rd.Attach() // the peer's writer may start it now
		}
	}
	c.fmu.Unlock()
	return true, 0
}

// leaveReadForCloseLocked leaves the read ring at Close, so that the
// peer's writer moves to TCP (where the kernel answers it), and reports
// whether the ring held bytes nobody will read (then Close resets the
// connection, as the kernel does for unread data).
func (c *Conn) leaveReadForCloseLocked() bool {
	c.readerFlowLocked()
	f := c.rf
	if f == nil {
		return len(c.stash) > 0 || c.ahead != nil || len(c.back) > 0
	}
	b, _ := f.rd.Buffered()
	c.leaveReadLocked()
	return b > 0 || len(c.stash) > 0 || c.ahead != nil || len(c.back) > 0
}

// readTCPLocked reads the TCP stream: the stash first, then the socket,
// never past a known ring start.
func (c *Conn) readTCPLocked(p []byte) (int, error) {
	moved, aheadLimit := c.aheadDueLocked()
	if moved {
		return 0, errAgain
	}
	f := c.rf
	limit := len(p)
	limited := false
	if aheadLimit > 0 {
		limit = int(min(uint64(limit), aheadLimit))
		limited = true
	}
	if f != nil {
		gone := f.peerGone.Load() // before the flags, as in readerTryLeaveLocked
		if start, ok, left := f.rd.WriterState(); ok {
			switch {
			case start == c.roff:
				c.toRingLocked()
				return 0, errAgain
			case start < c.roff || c.ahead != nil && start < c.aheadAt+uint64(len(c.ahead)):
				return 0, c.opErr("read", errBrokenStream) // behind what was read, or inside the stretch held ahead
			case (left || gone) && c.holdAheadLocked(f, start):
				return 0, errAgain
			}
			limit = int(min(uint64(limit), start-c.roff))
			limited = true
		} else if left || gone {
			c.leaveReadLocked() // it never started: nothing comes from it
			return 0, errAgain
		}
	}
	if len(c.stash) > 0 {
		n := copy(p[:limit], c.stash)
		c.stash = c.stash[n:]
		if len(c.stash) == 0 {
			c.stash = nil
		}
		if r := min(n, c.stashRing); r > 0 { // drained from a ring: its bytes
			c.stashRing -= r
			c.roff += uint64(r)
			c.st.ringRecv.Add(uint64(r))
			return r + c.gotTCP(n-r), nil
		}
		return c.gotTCP(n), nil
	}
	if c.tcpErr != nil {
		if limited {
			return 0, c.opErr("read", errBrokenStream)
		}
		return 0, c.tcpErr
	}
	q := p[:limit]
	n, err := c.tcpRead(q, f, limited)
	if err == errAgain {
		return 0, errAgain
	}
	if !limited {
		// A ring may have started while the kernel read blocked (also
		// one attached meanwhile): bytes past its start are the TCP
		// bytes after its stretch.
		c.readerFlowLocked()
		if f = c.rf; f != nil {
			if start, ok := f.rd.Started(); ok {
				if start < c.roff {
					return 0, c.opErr("read", errBrokenStream)
				}
				if keep := start - c.roff; uint64(n) > keep {
					c.stash = append([]byte(nil), q[keep:n]...)
					n = int(keep)
				}
				if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
					c.tcpErr, err = err, nil // reported after the ring's stretch
				}
				if n == 0 && err == nil {
					return 0, errAgain
				}
			} else if err != nil && f.relayed && c.relayedEOFLocked(f) {
				c.tcpErr = err // reported after the ring's stretch, if it started
				return c.gotTCP(n), nil
			}
		}
	}
	if n == 0 && err == nil {
		return 0, errAgain
	}
	if err == io.EOF && c.ahead != nil {
		err = errBrokenStream // the stream ended before a stretch held ahead
	}
	return c.gotTCP(n), err
}

func (c *Conn) gotTCP(n int) int {
	c.roff += uint64(n)
	c.st.tcpRecv.Add(uint64(n))
	return n
}

// testHookTCPRead, set by package tests, runs before a kernel read.
var testHookTCPRead func(*Conn)

// aLongTimeAgo is a read deadline that wakes a blocked kernel read.
var aLongTimeAgo = time.Unix(1, 0)

// pokeRead wakes a Read blocked in the kernel, if one is: READY attached
// a ring, the ring started, or Close.
func (c *Conn) pokeRead() {
	c.dlMu.Lock()
	defer c.dlMu.Unlock()
	if c.readingTCP && !c.poked {
		c.poked = true
		_ = c.tcp.SetReadDeadline(aLongTimeAgo)
	}
}

// tcpRead reads the kernel socket. With f's ring attached and its start
// unknown, a watcher waits on the ring meanwhile and wakes the read when
// the writer starts (or leaves it unstarted, or is gone). A wake that is
// not the application's deadline returns n == 0 and no error.
func (c *Conn) tcpRead(q []byte, f *flow, limited bool) (int, error) {
	c.dlMu.Lock()
	c.readingTCP = true
	c.dlMu.Unlock()
	// READY installs the flow, and Close sets closed, before they poke:
	// seen here, or the kernel read below is poked.
	if nf := c.cur.Load(); c.closed.Load() || c.rshut.Load() || f == nil && nf != nil && !nf.rLeft.Load() {
		c.endTCPRead()
		return 0, errAgain
	}
	var stop atomic.Bool
	var done chan struct{}
	switch {
	case testHookTCPRead != nil:
		testHookTCPRead(c) // a test makes the over-read happen, with no watcher
	case f != nil && !limited:
		done = make(chan struct{})
		go c.watch(f, &stop, done)
	}
	n, err := c.tcp.Read(q)
	if done != nil {
		stop.Store(true)
		f.rd.Interrupt()
		<-done
	}
	poked, dl := c.endTCPRead()
	if poked && err != nil && errors.Is(err, os.ErrDeadlineExceeded) && !expired(dl) {
		err = nil
	}
	return n, err
}

// endTCPRead ends a kernel read: a poke's past deadline gives way to the
// application's again. It reports whether the read was poked.
func (c *Conn) endTCPRead() (poked bool, dl time.Time) {
	c.dlMu.Lock()
	defer c.dlMu.Unlock()
	c.readingTCP = false
	poked, c.poked = c.poked, false
	if poked {
		_ = c.tcp.SetReadDeadline(c.readDL)
	}
	return poked, c.readDL
}

// watch waits on f's read ring while the Read it serves blocks in the
// kernel; the Read lends it the ring's Reader for that time. It pokes the
// Read when the ring starts, when its writer left it unstarted or is
// gone; it returns when stop is set (the Read came back) or after a poke.
func (c *Conn) watch(f *flow, stop *atomic.Bool, done chan<- struct{}) {
	defer close(done)
	quit := func() bool { return stop.Load() || f.peerGone.Load() || c.closed.Load() }
	if fault.Do(func() {
		for !stop.Load() {
			if _, ok := f.rd.Started(); ok || f.rd.WriterLeft() || f.peerGone.Load() || c.closed.Load() {
				c.pokeRead()
				return
			}
			_ = f.rd.Wait(quit, time.Time{})
		}
	}) != nil {
		c.pokeRead() // the Read finds the memory gone itself
	}
}

// relayedEOFWait bounds how long a relayed flow's reader holds a kernel
// EOF or error for its ring: the relays end every stretch by marking the
// ring left (the peer host's stop), within their resume timeout.
const relayedEOFWait = 65 * time.Second

// relayedEOFLocked: the kernel reported the peer's FIN or RST while f's
// read ring, which the relay writes, has neither started nor been left.
// The other guest wrote its last bytes into its ring before it closed,
// but they cross the relays, which are slower than the kernel's FIN: so
// the reader waits (the application's deadline and relayedEOFWait
// bound it) until the ring starts or is left. It reports whether the
// ring started (its stretch comes before the EOF).
func (c *Conn) relayedEOFLocked(f *flow) bool {
	dl := time.Now().Add(relayedEOFWait)
	if app := c.readDeadline(); !app.IsZero() && app.Before(dl) {
		dl = app
	}
	ready := func() bool {
		_, ok := f.rd.Started()
		return ok || f.rd.WriterLeft() || f.peerGone.Load() || c.closed.Load() || c.rst.Load()
	}
	if fault.Do(func() {
		for !ready() && f.rd.Wait(ready, dl) == nil {
		}
	}) != nil {
		return false
	}
	_, ok := f.rd.Started()
	return ok
}
