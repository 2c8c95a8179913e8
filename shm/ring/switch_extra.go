package ring

import (
	"os"
	"time"
)

// Waits for a caller that drives its own loop over TryRead and TryWrite
// (guestlib's switching Conn): unlike Read and Write they return on
// Interrupt and when stop says so, so that a DOWN, a shutdown, a close or
// a new deadline from another goroutine reaches a blocked call at once.
// The deadline is the caller's (the end's own, SetDeadline, is not used).
// stop must be cheap (an atomic load): the spinning phase calls it often.

type readerCond struct {
	rd   *Reader
	stop func() bool
}

// Ready is Reader.Ready plus the writer's start and the caller's stop.
func (c readerCond) Ready() bool {
	return c.rd.Ready() || c.rd.r.wflags.Load()&FlagStarted != 0 || c.stop()
}

// Wait blocks until a TryRead or Started may answer differently (bytes,
// FIN, the writer's start or leave, a reset, Close), Interrupt, stop(),
// or the deadline (zero: none) passes: then os.ErrDeadlineExceeded. It
// consumes nothing; the caller re-checks. For the owner of the Reader, or
// a goroutine the owner lent it to: one waiter at a time, since the
// wake-up word is shared.
func (rd *Reader) Wait(stop func() bool, deadline time.Time) error {
	if err := rd.flush(); err != nil {
		return err
	}
	rd.intrSeen = rd.intr.Load()
	if !deadline.IsZero() && !time.Now().Before(deadline) {
		return os.ErrDeadlineExceeded
	}
	return rd.policy.Wait(readerCond{rd, stop}, rd.flag, deadline)
}

type writerCond struct {
	w    *Writer
	stop func() bool
}

// Ready is Writer.Ready plus the caller's stop.
func (c writerCond) Ready() bool { return c.w.Ready() || c.stop() }

// Wait blocks until a TryWrite may make progress or fail (free space, a
// mark of the reader, reset, Close), Interrupt, stop(), or the deadline
// (zero: none; then os.ErrDeadlineExceeded). For the Writer's owner.
func (w *Writer) Wait(stop func() bool, deadline time.Time) error {
	w.intrSeen = w.intr.Load()
	if !deadline.IsZero() && !time.Now().Before(deadline) {
		return os.ErrDeadlineExceeded
	}
	return w.policy.Wait(writerCond{w, stop}, w.flag, deadline)
}

// ReadWaiter is the wait of a reader on a started ring (it reads the
// ring, not TCP): Reader.Wait without the start, which it has seen, so
// that it spins and then sleeps like Read; stop is bound once, so that a
// wait allocates nothing (the data path waits once per empty ring).
type ReadWaiter struct{ c readerCond }

// NewWaiter binds stop (see Wait) to rd.
func (rd *Reader) NewWaiter(stop func() bool) *ReadWaiter {
	return &ReadWaiter{readerCond{rd, stop}}
}

// Ready implements wait.Cond: bytes, FIN, the writer's leave, a reset,
// Close, Interrupt or stop. (The start flag stays set once the writer
// started: counting it, a wait on a started ring returned at once, and
// the data path polled the writer's line without pause or end.)
func (w *ReadWaiter) Ready() bool { return w.c.rd.Ready() || w.c.stop() }

// Wait is Reader.Wait(stop, deadline).
func (w *ReadWaiter) Wait(deadline time.Time) error {
	rd := w.c.rd
	if err := rd.flush(); err != nil {
		return err
	}
	rd.intrSeen = rd.intr.Load()
	if !deadline.IsZero() && !time.Now().Before(deadline) {
		return os.ErrDeadlineExceeded
	}
	return rd.policy.Wait(w, rd.flag, deadline)
}

// WriteWaiter is Writer.Wait with its stop condition bound once.
type WriteWaiter struct{ c writerCond }

// NewWaiter binds stop (see Wait) to w.
func (w *Writer) NewWaiter(stop func() bool) *WriteWaiter {
	return &WriteWaiter{writerCond{w, stop}}
}

// Ready implements wait.Cond.
func (ww *WriteWaiter) Ready() bool { return ww.c.Ready() }

// Wait is Writer.Wait(stop, deadline).
func (ww *WriteWaiter) Wait(deadline time.Time) error {
	w := ww.c.w
	w.intrSeen = w.intr.Load()
	if !deadline.IsZero() && !time.Now().Before(deadline) {
		return os.ErrDeadlineExceeded
	}
	return w.policy.Wait(ww, w.flag, deadline)
}
