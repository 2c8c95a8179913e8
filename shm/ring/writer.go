package ring

import (
	"time"

	"github.com/shuntnet/shunt/shm/wait"
)

// Writer is the producing end of a ring. It is for one goroutine at a time
// (single producer); SetDeadline, Interrupt and Close may be called from any
// goroutine.
type Writer struct {
	end
	tail     uint64 // private copy; published to r.tail
	head     uint64 // last validated head of the reader
	msgs     uint64
	reserved int  // bytes handed out by the last Reserve
	fin      bool // CloseWrite was called
	left     bool // Leave was called
}

// NewWriter takes the producing end of r. The tail and head are read once
// and checked; afterwards the Writer never re-reads its own tail.
func NewWriter(r *Ring, p *wait.Policy) (*Writer, error) {
	w := &Writer{end: end{r: r, policy: p, flag: r.wwait}}
	w.tail = r.tail.Load()
	w.msgs = r.wmsgs.Load()
	w.head = r.head.Load()
	if w.head > w.tail || w.tail-w.head > uint64(len(r.data)) {
		return nil, ErrCorrupt
	}
	return w, nil
}

// free returns the free bytes, refreshing the reader's head (one shared
// load) only when the cached view has fewer than want. It validates the
// head: monotonic, never past the tail.
func (w *Writer) free(want int) (int, error) {
	c := uint64(len(w.r.data))
	if f := c - (w.tail - w.head); f >= uint64(max(want, 1)) {
		return int(f), nil
	}
	h := w.r.head.Load()
	if h < w.head || h > w.tail {
		return 0, ErrCorrupt
	}
	w.head = h
	return int(c - (w.tail - h)), nil
}

// check returns the error that stops any write: reset, reader gone, local
// close or shutdown.
func (w *Writer) check() error {
	switch {
	case w.r.reset.Load() != 0:
		return ErrReset
	case w.left:
		return ErrLeft
	case w.closed.Load() || w.fin:
		return ErrClosed
	case w.r.rflags.Load()&(FlagReaderClosed|FlagReaderLeft) != 0:
		return ErrPeerClosed
	}
	return nil
}

// TryWrite copies as much of p as fits and publishes it, without blocking.
// It returns 0, nil when the ring is full. Large writes are published in
// batches of at most Batch bytes, so the reader starts copying while the
// writer is still filling (the two copies overlap instead of taking turns).
func (w *Writer) TryWrite(p []byte) (int, error) {
	if err := w.check(); err != nil {
		return 0, err
	}
	done := 0
	for done < len(p) {
		f, err := w.free(len(p) - done)
		if err != nil || f == 0 {
			return done, err
		}
		n := min(f, len(p)-done, Batch)
		off := int(w.tail & w.r.mask)
		c := copy(w.r.data[off:], p[done:done+n])
		copy(w.r.data, p[done+c:done+n])
		done += n
		if err := w.publish(n); err != nil {
			return done, err
		}
	}
	return done, nil
}

// publish makes n more bytes visible to the reader and wakes it if it
// sleeps. The count is a plain (release) store and the tail a sequentially
// consistent one, which drains the store buffer before the load of the
// reader's waiting word (the reader stores that word before it looks at the
// tail: one of the two sees the other). One fence per publication, not
// two; the count is informational (Stats) and may run ahead of the tail.
func (w *Writer) publish(n int) error {
	w.tail += uint64(n)
	w.msgs++
	storeRel(w.r.wmsgs, w.msgs)
	w.r.tail.Store(w.tail)
	return w.policy.Wake(w.r.rwait)
}

// Write copies all of p into the ring, blocking while it is full. It
// returns early with the count so far on reset, reader close, local close or
// the deadline (os.ErrDeadlineExceeded).
func (w *Writer) Write(p []byte) (int, error) {
	if w.expired() {
		return 0, errDeadline
	}
	done := 0
	for {
		n, err := w.TryWrite(p[done:])
		done += n
		if err != nil || done == len(p) {
			return done, err
		}
		if n == 0 {
			if err := w.waitSpace(); err != nil {
				return done, err
			}
		}
	}
}

// TryReserve returns up to n (and at most Batch) contiguous free bytes to
// fill in place, without blocking (an empty slice when full). The space becomes visible to the
// reader at Commit. A later Reserve replaces an uncommitted one.
func (w *Writer) TryReserve(n int) ([]byte, error) {
	w.reserved = 0
	if err := w.check(); err != nil {
		return nil, err
	}
	f, err := w.free(n)
	if err != nil || f == 0 {
		return nil, err
	}
	off := int(w.tail & w.r.mask)
	n = min(n, f, len(w.r.data)-off, Batch)
	w.reserved = n
	return w.r.data[off : off+n : off+n], nil
}

// Reserve is TryReserve that blocks until at least one byte is free.
func (w *Writer) Reserve(n int) ([]byte, error) {
	if w.expired() {
		return nil, errDeadline
	}
	for {
		b, err := w.TryReserve(n)
		if err != nil || len(b) > 0 || n <= 0 {
			return b, err
		}
		if err := w.waitSpace(); err != nil {
			return nil, err
		}
	}
}

// Commit publishes the first n bytes of the last reservation.
func (w *Writer) Commit(n int) error {
	if n < 0 || n > w.reserved {
		return ErrBadCommit
	}
	w.reserved = 0
	if n == 0 {
		return nil
	}
	return w.publish(n)
}

// Ready reports whether a blocked writer should wake up (wait.Cond).
func (w *Writer) Ready() bool {
	if w.interrupted() || w.check() != nil {
		return true
	}
	return w.r.head.Load() != w.head
}

func (w *Writer) waitSpace() error {
	w.intrSeen = w.intr.Load()
	for {
		if err := w.policy.Wait(w, w.flag, w.deadlineTime()); err != nil {
			return err
		}
		if err := w.check(); err != nil {
			return err
		}
		if f, err := w.free(1); err != nil || f > 0 {
			return err
		}
		if !w.interrupted() {
			continue
		}
		// Interrupted: the deadline may have changed; re-evaluate it.
		w.intrSeen = w.intr.Load()
		if dl := w.deadlineTime(); !dl.IsZero() && !time.Now().Before(dl) {
			return errDeadline
		}
	}
}

// CloseWrite publishes FIN: the reader gets EOF after draining. Further
// writes fail with ErrClosed.
func (w *Writer) CloseWrite() error {
	if w.fin {
		return nil
	}
	w.fin = true
	w.r.wflags.Store(w.r.wflags.Load() | FlagFIN)
	return w.policy.Wake(w.r.rwait)
}

// Close stops this end: pending and later calls fail with ErrClosed. It does
// not publish FIN (use CloseWrite) and is safe to call from any goroutine.
func (w *Writer) Close() error {
	if w.closed.CompareAndSwap(false, true) {
		w.interrupt()
	}
	return nil
}

// Interrupt wakes a blocked call so that it re-checks its state.
func (w *Writer) Interrupt() { w.interrupt() }

// Stats returns this ring's counters.
func (w *Writer) Stats() Stats { return w.r.Stats() }

// IsReset reports whether this ring was reset.
func (w *Writer) IsReset() bool { return w.r.IsReset() }
