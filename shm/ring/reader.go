package ring

import (
	"io"
	"os"
	"time"

	"github.com/shuntnet/shunt/shm/wait"
)

var errDeadline = os.ErrDeadlineExceeded

// Reader is the consuming end of a ring. It is for one goroutine at a time
// (single consumer); SetDeadline, Interrupt and Close may be called from any
// goroutine.
type Reader struct {
	end
	head   uint64 // private copy; published to r.head (see consume)
	shown  uint64 // the head last published
	tail   uint64 // last validated tail of the writer
	msgs   uint64
	peeked int  // bytes handed out by the last Peek
	sink   byte // see Ready
}

// NewReader takes the consuming end of r. The head and tail are read once
// and checked; afterwards the Reader never re-reads its own head.
func NewReader(r *Ring, p *wait.Policy) (*Reader, error) {
	rd := &Reader{end: end{r: r, policy: p, flag: r.rwait}}
	rd.head = r.head.Load()
	rd.shown = rd.head
	rd.msgs = r.rmsgs.Load()
	rd.tail = r.tail.Load()
	if rd.head > rd.tail || rd.tail-rd.head > uint64(len(r.data)) {
		return nil, ErrCorrupt
	}
	return rd, nil
}

// avail returns the readable bytes, refreshing the writer's tail (one
// shared load) only when the cached view has fewer than want. It validates
// the tail: monotonic, never more than capacity ahead of the head.
func (rd *Reader) avail(want int) (int, error) {
	if a := rd.tail - rd.head; a >= uint64(max(want, 1)) {
		return int(a), nil
	}
	t := rd.r.tail.Load()
	if t < rd.tail || t-rd.head > uint64(len(rd.r.data)) {
		return 0, ErrCorrupt
	}
	rd.tail = t
	return int(t - rd.head), nil
}

// empty returns the error for an empty ring: reset, EOF after FIN, ErrLeft
// after the writer left, local close, or nil when data may still come. The
// flags are loaded before the tail (the writer stores them the other way
// round), so a FIN or a leave seen with an unchanged tail really is the end.
func (rd *Reader) empty() (int, error) {
	fl := rd.r.wflags.Load()
	a, err := rd.avail(1)
	if err != nil || a > 0 {
		return a, err
	}
	switch {
	case fl&FlagFIN != 0:
		return 0, io.EOF
	case fl&FlagLeft != 0:
		return 0, ErrLeft
	}
	return 0, nil
}

// drained is empty for TryRead and TryPeek: a reader that finds the ring
// empty (the writer may be waiting for its space, or has finished)
// publishes what it consumed first.
func (rd *Reader) drained() (int, error) {
	a, err := rd.empty()
	if a == 0 && err != ErrCorrupt {
		if ferr := rd.flush(); err == nil {
			err = ferr
		}
	}
	return a, err
}

// TryRead copies up to len(p) bytes out of the ring without blocking. It
// returns 0, nil when the ring is empty and the writer may still write,
// io.EOF after FIN once drained, ErrReset once the flow was reset (unread
// data is discarded, as a TCP reset does). Space is returned to the writer
// in batches of at most Batch bytes, so it can refill while we copy, and
// published lazily (see consume).
func (rd *Reader) TryRead(p []byte) (int, error) {
	if rd.closed.Load() {
		return 0, ErrClosed
	}
	if rd.r.reset.Load() != 0 {
		return 0, ErrReset
	}
	a, err := rd.avail(len(p))
	if err != nil {
		return 0, err
	}
	if a == 0 {
		if a, err = rd.drained(); a == 0 || err != nil {
			return 0, err
		}
	}
	done := 0
	for done < len(p) && a > 0 {
		n := min(a, len(p)-done, Batch)
		off := int(rd.head & rd.r.mask)
		c := copy(p[done:done+n], rd.r.data[off:])
		copy(p[done+c:done+n], rd.r.data)
		done += n
		if err := rd.consume(n, true); err != nil {
			return done, err
		}
		if a, err = rd.avail(len(p) - done); err != nil {
			return done, err
		}
	}
	return done, nil
}

// consume returns n bytes of space to the writer. Lazily (lazy), the head
// is published only once it moved into another stride (an eighth of the
// ring) since it was last published, or when the writer asks for room by
// sleeping (its waiting word is set), or when this read took all the
// reader knows of (the head reached its cached tail: a reader that then
// stops reading, as a program that read its request does, would otherwise
// hold the head back for good, and hostd's byte counters with it): each
// publication is a store to a
// line the writer polls while it waits for space, and publishing after
// every small read made a writer ahead of its reader take that line back
// at every read, then write a read's worth and wait again. Every wait of this reader publishes first (flush), so a reader
// that has drained the ring never holds back space; what a reader that
// stops reading mid-ring holds back is less than a stride, as if the ring
// were an eighth smaller. A writer that decides to sleep stores its word
// before it looks at the head, and flush stores the head before it looks
// at the word, so one of the two sees the other (no lost wake-up).
func (rd *Reader) consume(n int, lazy bool) error {
	rd.head += uint64(n)
	rd.msgs++
	if lazy && rd.head != rd.tail && !crossed(rd.r, rd.head, rd.shown) && rd.r.wwait.Load() == 0 {
		return nil
	}
	return rd.showHead()
}

// showHead publishes the head and the count, and wakes the writer if it
// sleeps. As in Writer.publish, the count's store is plain and the head's
// is the one fence before the load of the writer's waiting word.
func (rd *Reader) showHead() error {
	rd.shown = rd.head
	storeRel(rd.r.rmsgs, rd.msgs)
	rd.r.head.Store(rd.head)
	return rd.policy.Wake(rd.r.wwait)
}

// flush publishes what this reader consumed and has not published yet:
// before every wait, and before it tells the writer it stops reading.
func (rd *Reader) flush() error {
	if rd.shown == rd.head {
		return nil
	}
	return rd.showHead()
}

// Read copies at least one byte into p, blocking while the ring is empty.
// It returns io.EOF after FIN, ErrReset on reset, os.ErrDeadlineExceeded at
// the deadline.
func (rd *Reader) Read(p []byte) (int, error) {
	if rd.expired() {
		return 0, errDeadline
	}
	for {
		n, err := rd.TryRead(p)
		if n > 0 || err != nil || len(p) == 0 {
			return n, err
		}
		if err := rd.waitData(); err != nil {
			return 0, err
		}
	}
}

// TryPeek returns up to n (and at most Batch) contiguous readable bytes in
// place, without
// blocking (empty when nothing is readable; io.EOF after FIN). The bytes stay
// in the ring until Release. The slice aliases shared memory: the peer cannot
// legally write there before Release, but a hostile one could, so callers
// validate what they parse from it.
func (rd *Reader) TryPeek(n int) ([]byte, error) {
	rd.peeked = 0
	if rd.closed.Load() {
		return nil, ErrClosed
	}
	if rd.r.reset.Load() != 0 {
		return nil, ErrReset
	}
	a, err := rd.avail(n)
	if err != nil {
		return nil, err
	}
	if a == 0 {
		if a, err = rd.drained(); a == 0 || err != nil {
			return nil, err
		}
	}
	off := int(rd.head & rd.r.mask)
	n = min(n, a, len(rd.r.data)-off, Batch)
	rd.peeked = n
	return rd.r.data[off : off+n : off+n], nil
}

// Peek is TryPeek that blocks until at least one byte is readable.
func (rd *Reader) Peek(n int) ([]byte, error) {
	if rd.expired() {
		return nil, errDeadline
	}
	for {
		b, err := rd.TryPeek(n)
		if err != nil || len(b) > 0 || n <= 0 {
			return b, err
		}
		if err := rd.waitData(); err != nil {
			return nil, err
		}
	}
}

// Release gives the first n peeked bytes back to the writer.
func (rd *Reader) Release(n int) error {
	if n < 0 || n > rd.peeked {
		return ErrBadCommit
	}
	rd.peeked = 0
	if n == 0 {
		return nil
	}
	return rd.consume(n, true)
}

// Buffered returns how many bytes are readable now (FIONREAD).
func (rd *Reader) Buffered() (int, error) { return rd.avail(len(rd.r.data)) }

// Ready reports whether a blocked reader should wake up (wait.Cond).
//
// It also loads the data byte at the head: while spinning, that keeps the
// next data line's fetch in flight together with the tail's, so when the
// tail moves the data is usually already here (two cache-line transfers
// overlap instead of following each other).
func (rd *Reader) Ready() bool {
	touch(rd.r.data, rd.head&rd.r.mask, &rd.sink)
	return rd.r.tail.Load() != rd.tail || rd.interrupted() || rd.closed.Load() ||
		rd.r.reset.Load() != 0 || rd.r.wflags.Load()&(FlagFIN|FlagLeft) != 0
}

func (rd *Reader) waitData() error {
	if err := rd.flush(); err != nil {
		return err
	}
	rd.intrSeen = rd.intr.Load()
	for {
		if err := rd.policy.Wait(rd, rd.flag, rd.deadlineTime()); err != nil {
			return err
		}
		if rd.r.reset.Load() != 0 || rd.closed.Load() {
			return nil // the caller's Try* reports it
		}
		if a, err := rd.empty(); err != nil || a > 0 {
			return nil
		}
		if !rd.interrupted() {
			continue
		}
		rd.intrSeen = rd.intr.Load()
		if dl := rd.deadlineTime(); !dl.IsZero() && !time.Now().Before(dl) {
			return errDeadline
		}
	}
}

// CloseRead tells the writer that nobody will read: its writes fail with
// ErrPeerClosed from now on.
func (rd *Reader) CloseRead() error {
	_ = rd.flush()
	rd.r.rflags.Store(rd.r.rflags.Load() | FlagReaderClosed)
	return rd.policy.Wake(rd.r.wwait)
}

// Close stops this end: pending and later calls fail with ErrClosed. Safe to
// call from any goroutine. It does not tell the writer (use CloseRead).
func (rd *Reader) Close() error {
	if rd.closed.CompareAndSwap(false, true) {
		rd.interrupt()
	}
	return nil
}

// Interrupt wakes a blocked call so that it re-checks its state.
func (rd *Reader) Interrupt() { rd.interrupt() }

// Stats returns this ring's counters.
func (rd *Reader) Stats() Stats { return rd.r.Stats() }

// touch loads b[i] into *sink. The load races with the writer by design
// (it only warms the cache; the bytes are read again after the tail says
// they are there), so the race detector is told to ignore it.
//
//go:norace
func touch(b []byte, i uint64, sink *byte) { *sink += b[i] }
