package guestlib

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/shm/ring"
)

// The writer (docs/DESIGN.md, "Writer algorithm"): sent is the stream
// offset of the next byte. At each step, under writeMu: on TCP with a
// ring whose reader attached, Start(sent) and write the ring; on a ring
// after DOWN (or with its reader gone, or at shutdown), Leave and write
// TCP. Kernel sends go in chunks, so a long Write moves to a ring (or
// leaves one) between chunks, and CloseWrite and Close never wait on a
// kernel send (they find writeMu taken and let the kernel end it).

// tcpChunk bounds one kernel send of a Write.
const tcpChunk = 64 << 10

// errSwitched tells the write loop that the path changed.
var errSwitched = errors.New("switched")

// Write implements net.Conn.
func (c *Conn) Write(p []byte) (_ int, err error) {
	defer c.caught(fault.Arm(), "write", &err)
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	n, err := c.writeLocked(p)
	return n, c.resetErr("write", err)
}

func (c *Conn) writeLocked(p []byte) (int, error) {
	if expired(c.writeDeadline()) {
		return 0, c.opErr("write", os.ErrDeadlineExceeded)
	}
	done := 0
	for {
		if err := c.writable(); err != nil {
			return done, err
		}
		c.writerSyncLocked()
		if c.resending.Load() {
			if err := c.flushResendLocked(); err != nil {
				return done, err
			}
			continue
		}
		if done == len(p) {
			return done, nil
		}
		if c.wOnRing.Load() {
			n, err := c.writeRingLocked(func(w *ring.Writer) (int, error) { return w.TryWrite(p[done:]) })
			done += n
			c.ringSent(n)
			if err != nil && err != errSwitched {
				return done, err
			}
			continue
		}
		n, err := c.tcp.Write(p[done:min(len(p), done+tcpChunk)])
		done += n
		c.sent += uint64(n)
		c.st.tcpSent.Add(uint64(n))
		if err != nil {
			return done, err
		}
	}
}

// writable returns the error that stops a write: Close or CloseWrite. The
// ring is left first (writerSyncLocked does on wshut).
func (c *Conn) writable() error {
	switch {
	case c.closed.Load():
		c.writerSyncLocked()
		return c.opErr("write", net.ErrClosed)
	case c.rst.Load():
		c.writerSyncLocked()
		return c.opErr("write", os.NewSyscallError("write", syscall.ECONNRESET))
	case c.wshut.Load():
		c.writerSyncLocked()
		return c.opErr("write", errShut)
	}
	return nil
}

// writerSyncLocked moves the writer between TCP and its ring as the flow
// says, before the next byte.
func (c *Conn) writerSyncLocked() {
	if c.wf == nil {
		if f := c.cur.Load(); f != nil && !f.wLeft.Load() {
			c.wf = f
		}
	}
	f := c.wf
	if f == nil || c.zcResv {
		return // a reservation is committed to the ring it came from first
	}
	if !c.wOnRing.Load() && !f.wSync.CompareAndSwap(wsFree, wsBusy) {
		c.wf = nil // left aside at a DOWN while this writer sent on TCP
		return
	}
	if f.down.Load() || c.wshut.Load() || f.w.ReaderLeft() || f.w.IsReset() {
		c.leaveWriteLocked()
		return
	}
	if !c.wOnRing.Load() && f.w.ReaderAttached() && !c.resending.Load() {
		c.wstart, c.wtail0 = c.sent, f.w.Written()
		f.w.Start(c.sent)
		c.wOnRing.Store(true)
		c.st.wToRing.Add(1)
	}
	if !c.wOnRing.Load() {
		f.wSync.Store(wsFree) // its kernel sends may block: the leaver may leave for it
	}
}

// leaveWriteLocked marks the end of the write ring's stretch: the next
// byte goes over TCP.
func (c *Conn) leaveWriteLocked() {
	f := c.wf
	_ = f.w.Leave()
	started := c.wOnRing.Load()
	if started {
		c.st.wToTCP.Add(1)
	}
	if f.resumed.Load() {
		c.resumeWriteLocked(f, started) // before LEFT: the ring's bytes are still ours
	}
	c.wf = nil
	c.wOnRing.Store(false)
	f.wLeft.Store(true)
	c.maybeLeft(f)
}

// writeRingLocked writes wf's ring with try (TryWrite or TryReserve),
// waiting while it is full. It returns errSwitched when the writer must
// look at its path again (DOWN, the reader gone, shutdown, Close).
func (c *Conn) writeRingLocked(try func(*ring.Writer) (int, error)) (int, error) {
	f := c.wf
	for {
		n, err := try(f.w)
		if n > 0 {
			return n, nil
		}
		switch {
		case errors.Is(err, ring.ErrLeft):
			return 0, errSwitched
		case errors.Is(err, ring.ErrPeerClosed):
			if f.w.ReaderLeft() {
				return 0, errSwitched // writerSyncLocked leaves
			}
			return 0, c.opErr("write", err)
		case err != nil:
			return 0, c.opErr("write", err)
		}
		if f.down.Load() || c.wshut.Load() {
			return 0, errSwitched
		}
		if err := f.wwait.Wait(c.writeDeadline()); err != nil {
			return 0, c.opErr("write", err)
		}
	}
}

// ringSent counts n bytes written to the ring.
func (c *Conn) ringSent(n int) {
	c.sent += uint64(n)
	c.st.ringSent.Add(uint64(n))
}

// ReadBuffer returns up to max readable bytes (zero copy on a ring: in
// place, until ReleaseRead(n) consumes them), blocking until at least one
// is readable. On TCP it reads into an internal buffer, consumed at once:
// callers need not care which path is active. Until ReleaseRead the ring
// is lent out: a DOWN cannot move the reader off it, and if the caller
// holds the bytes longer than hostd's revoke grace (a call that blocks
// meanwhile) the region is taken back and the connection fails. So
// release before any call that may block; WriteTo copies for this reason.
func (c *Conn) ReadBuffer(max int) (_ []byte, err error) {
	defer c.caught(fault.Arm(), "read", &err)
	c.readMu.Lock()
	defer c.readMu.Unlock()
	if max <= 0 {
		return nil, nil
	}
	for {
		if c.closed.Load() {
			return nil, c.opErr("read", net.ErrClosed)
		}
		if c.rst.Load() {
			return nil, c.resetErr("read", errBrokenStream)
		}
		if c.rshut.Load() { // as Read: after CloseRead the TCP read answers errAgain, on which this loop would spin
			return nil, io.EOF
		}
		if expired(c.readDeadline()) {
			return nil, c.opErr("read", os.ErrDeadlineExceeded)
		}
		if len(c.back) > 0 {
			if cap(c.zcRead) < max {
				c.zcRead = make([]byte, max)
			}
			return c.zcRead[:c.readBackLocked(c.zcRead[:max])], nil
		}
		c.readerFlowLocked()
		if c.rOnRing {
			var b []byte
			_, err := c.readRingLocked(func(rd *ring.Reader) (int, error) {
				var err error
				b, err = rd.TryPeek(max)
				return len(b), err
			})
			if err == errAgain {
				continue
			}
			c.zcPeek = len(b) > 0
			return b, err
		}
		if cap(c.zcRead) < max {
			c.zcRead = make([]byte, max)
		}
		n, err := c.readTCPLocked(c.zcRead[:max])
		if err == errAgain {
			continue
		}
		return c.zcRead[:n], err
	}
}

// ReleaseRead consumes n bytes returned by ReadBuffer (on TCP they were
// consumed already).
func (c *Conn) ReleaseRead(n int) (err error) {
	defer c.caught(fault.Arm(), "read", &err)
	c.readMu.Lock()
	defer c.readMu.Unlock()
	if !c.zcPeek || c.rf == nil {
		return nil
	}
	c.zcPeek = false
	if err := c.rf.rd.Release(n); err != nil {
		return c.opErr("read", err)
	}
	c.roff += uint64(n)
	c.st.ringRecv.Add(uint64(n))
	return nil
}

// WriteBuffer returns up to max bytes to fill in place (ring space when
// the writer is on a ring: zero copy), blocking until some is free;
// CommitWrite(n) sends them.
func (c *Conn) WriteBuffer(max int) (_ []byte, err error) {
	defer c.caught(fault.Arm(), "write", &err)
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if expired(c.writeDeadline()) {
		return nil, c.opErr("write", os.ErrDeadlineExceeded)
	}
	for {
		if err := c.writable(); err != nil {
			return nil, err
		}
		c.writerSyncLocked()
		if c.resending.Load() {
			if err := c.flushResendLocked(); err != nil {
				return nil, err
			}
			continue
		}
		if !c.wOnRing.Load() || max <= 0 {
			break
		}
		var b []byte
		_, err := c.writeRingLocked(func(w *ring.Writer) (int, error) {
			var err error
			b, err = w.TryReserve(max)
			return len(b), err
		})
		if err == errSwitched {
			continue
		}
		c.zcResv = err == nil && len(b) > 0
		return b, err
	}
	if cap(c.zcWrite) < max {
		c.zcWrite = make([]byte, max)
	}
	c.zcWrite = c.zcWrite[:max]
	return c.zcWrite, nil
}

// CommitWrite sends the first n bytes of the last WriteBuffer.
func (c *Conn) CommitWrite(n int) (err error) {
	defer c.caught(fault.Arm(), "write", &err)
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if c.zcResv && c.wf != nil {
		c.zcResv = false
		if err := c.wf.w.Commit(n); err != nil {
			return c.opErr("write", err)
		}
		c.ringSent(n)
		c.writerSyncLocked() // a DOWN during the reservation leaves now
		return nil
	}
	if n < 0 || n > len(c.zcWrite) {
		return c.opErr("write", ring.ErrBadCommit)
	}
	_, err = c.writeLocked(c.zcWrite[:n])
	return err
}
