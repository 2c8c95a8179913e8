package guestlib

import (
	"errors"
	"os"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/proto"
)

// RESUME (relayed flows; docs/protocol.md, "RESUME"): hostd's DOWN for a
// flow whose rings the local relay shares, with the stream offset from
// which this end's writer resends on TCP. The relay frees a byte of the
// write ring only once the other host's ring holds it, so the bytes from
// that offset to the end of the ring's stretch are still in the ring:
// the writer copies them out when it leaves (before LEFT lets hostd free
// the ring) and sends them on TCP before any new byte. ResumeReset, or an
// offset outside what the ring holds, resets the connection instead.

// resume is hostd's RESUME for the flow k: the resume offset is recorded
// for the writer, then it is a DOWN. It reports whether k was this Conn's
// current flow.
func (c *Conn) resume(k flowKey, r proto.Reason, off uint64) bool {
	c.fmu.Lock()
	f := c.cur.Load()
	ok := f != nil && f.key == k
	if ok && !f.down.Load() {
		f.resumeAt.Store(off)
		f.resumed.Store(true) // before down: the writer reads it once it sees down
	}
	c.fmu.Unlock()
	if !ok {
		return false
	}
	if off == proto.ResumeReset {
		// Before a stretch's stop marks the read ring left: the reader
		// would otherwise go on to TCP at that mark and could take the
		// peer's FIN for a clean end before the reset.
		c.client.logf("shunt: %s -> %s: RESUME %d/%d.%d(%s): where the other host's ring ended is unknown: connection reset", c.local, c.remote, k.region, k.slot, k.gen, r)
		c.abort()
	}
	if f.stretch != nil {
		c.stretchEnded(f, r)
	}
	c.down(k, r)
	if c.resending.Load() {
		c.startLeaver() // it flushes the resend if the application does not write
	}
	return true
}

// resumeWriteLocked runs as the writer leaves f's ring after RESUME:
// started says whether it had started the ring (at c.wstart; the stream
// offset c.sent is the stretch's end W). It copies the ring's bytes from
// the resume offset to W into c.resend, or resets the connection when
// the offset is not one the ring holds.
func (c *Conn) resumeWriteLocked(f *flow, started bool) {
	off := f.resumeAt.Load()
	if off == proto.ResumeReset {
		c.abort()
		return
	}
	if !started {
		return // nothing of the stream went into the ring
	}
	start, end := c.wstart, c.sent
	if off == proto.ResumeAll {
		off = start
	}
	var b []byte
	err := errOffset
	if off >= start && off <= end {
		b, err = f.w.Unfreed(c.wtail0 + (off - start))
	}
	if err != nil {
		c.client.logf("shunt: %s -> %s: RESUME %d/%d.%d at offset %d: the ring's stretch is [%d, %d), %d bytes freed (%v): connection reset",
			c.local, c.remote, f.key.region, f.key.slot, f.key.gen, off, start, end, f.w.Freed()-c.wtail0, err)
		c.abort()
		return
	}
	if len(b) > 0 {
		c.resend = append(c.resend, b...)
		c.resending.Store(true)
		c.st.resent.Add(uint64(len(b)))
	}
}

// closeResendWait bounds how long Close sends a pending resend: a close
// must not hang on a peer that reads nothing.
const closeResendWait = 5 * time.Second

// errOffset: a RESUME offset outside the ring's stretch.
var errOffset = errors.New("offset outside the stretch")

// flushResendLocked sends the bytes RESUME left to resend on TCP; they
// come before any new byte. The write deadline keeps the rest for the
// next try; any other kernel error drops them: the stream is broken and
// the next write reports it.
func (c *Conn) flushResendLocked() error {
	for len(c.resend) > 0 {
		n, err := c.tcp.Write(c.resend[:min(len(c.resend), tcpChunk)])
		c.resend = c.resend[n:]
		c.st.tcpSent.Add(uint64(n))
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		if err != nil {
			c.resend = nil
			c.resending.Store(false)
			return c.resetErr("write", err)
		}
	}
	c.resend = nil
	c.resending.Store(false)
	return nil
}

// flushIdle flushes a pending resend if no Write holds the writer now (a
// Write flushes it itself). It reports whether none is pending any more.
func (c *Conn) flushIdle() bool {
	if !c.resending.Load() {
		return true
	}
	if !c.writeMu.TryLock() {
		return false
	}
	defer c.writeMu.Unlock()
	c.guarded("resend", func() { _ = c.flushResendLocked() })
	return !c.resending.Load()
}

// abort resets the connection after RESUME(ResumeReset) or an invalid
// offset: the kernel socket is disconnected (connect to AF_UNSPEC, which
// sends the peer a RST and keeps the descriptor until Close), then reads
// and writes fail with ECONNRESET (in that order: a program that sees the
// error and closes must not send a FIN first).
func (c *Conn) abort() {
	c.rstOnce.Do(c.abortOnce)
}

func (c *Conn) abortOnce() {
	if rc, err := c.tcp.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) { _ = disconnect(int(fd)) })
	}
	c.rst.Store(true)
	if f := c.cur.Load(); f != nil {
		f.rd.Interrupt()
		f.w.Interrupt()
	}
	c.pokeRead()
}

// disconnect connects fd to AF_UNSPEC: Linux resets an established TCP
// connection (RST to the peer, ECONNRESET to blocked calls).
func disconnect(fd int) error {
	sa := unix.RawSockaddr{Family: unix.AF_UNSPEC}
	_, _, e := unix.Syscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa)), unsafe.Sizeof(sa))
	if e != 0 {
		return e
	}
	return nil
}

// resetErr is err, or ECONNRESET once the connection was reset by RESUME
// (whatever the disconnected socket reported).
func (c *Conn) resetErr(op string, err error) error {
	if err == nil || !c.rst.Load() || c.closed.Load() || errors.Is(err, os.ErrDeadlineExceeded) {
		return err
	}
	return c.opErr(op, os.NewSyscallError(op, syscall.ECONNRESET))
}
