package ring

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/shuntnet/shunt/shm/wait"
)

// Records: a mode of the same ring for callers that poll, in the C core's
// format (guestlib/c/records.c, shunt.h "records"; docs/region.md), so a Go
// end and a C end can share one ring. A record is a 16-byte header, then
// pad bytes, then the payload:
//
//	off  type  field  written by the writer
//	0    u32   len    payload bytes
//	4    u8    kind   RecKindData or RecKindPad
//	5    u8    tag    the caller's
//	6    u16   pad    bytes between the header and the payload
//	8    u64   stamp  epoch + record number, stored last
//
// in native byte order (both ends share the host). Every record starts on
// a RecLine boundary and never wraps: a PAD fills the rest of the ring when
// the next record does not fit. So a small record is one cache line, and
// the reader, which polls the stamp at its head instead of the tail (which
// lives on another line), receives header and payload with one line
// transfer. No index is published per record: the tail and the head (and
// the counts beside them) are stored once per stride, an eighth of the
// ring, so a one-line record is the only line either end writes. A writer
// short of room stores recWantsRoom in the ring's "writer waiting" word
// and looks again; a reader that sees it publishes its head at once.
// hostd's byte counters lag by less than a stride. Before a record's stamp it
// zeroes the stamp field of the line after the record if that line may
// hold other bytes (a payload of an earlier lap), so the reader polling
// there never finds the stamp it waits for in old bytes.
//
// Record ends poll; they never sleep (the C ends do not either, and their
// index stores are release stores, not the sequentially consistent ones
// the sleepers' Dekker protocol needs). They do wake a peer that sleeps on
// the ring's "waiting" word, as C's do.
const (
	RecLine       = 64   // records start on lines of this size
	RecHeaderSize = 16   // C: sizeof(struct shunt_rec)
	RecAlignFrom  = 1024 // payloads from this size on are padded (RecPadding)

	RecKindData = 1 // a record in a ring is DATA or PAD
	RecKindPad  = 2 // fills the ring's end; the reader skips it

	// recWantsRoom in the "writer waiting" word is a record writer's
	// request for the reader's head: not 1, which a sleeper stores, so
	// the reader answers it without a futex wake (C: WANTS_ROOM).
	recWantsRoom = 2

	recOffLen   = 0
	recOffKind  = 4
	recOffTag   = 5
	recOffPad   = 6
	recOffStamp = 8
)

var (
	// ErrRingFull means a record does not fit now: wait for the reader
	// (RecWriter.Wait) and reserve again.
	ErrRingFull = errors.New("shunt ring: no room for the record now")
	// ErrRecTooLarge means a record would take more than half the ring;
	// such a record could wait for the whole ring to drain, so it is refused.
	ErrRecTooLarge = errors.New("shunt ring: record larger than half the ring")
)

// RecPadding returns the pad that makes a payload of n bytes, which starts
// with a caller's header of hdr bytes, have that header end on a line, so
// the bulk of the payload lands aligned (unaligned destinations make the
// string copies several times slower on the target machines). Payloads
// under RecAlignFrom get no pad and so share the header's line. C:
// shunt_rec_pad.
func RecPadding(hdr, n int) int {
	if n < RecAlignFrom {
		return 0
	}
	return (RecLine - (RecHeaderSize+hdr)%RecLine) % RecLine
}

// RecSpan returns the ring bytes of a record whose pad plus payload is n
// bytes: header included, rounded up to whole lines. C: shunt_rec_span.
func RecSpan(n int) int { return (RecHeaderSize + n + RecLine - 1) &^ (RecLine - 1) }

// spinWait is how record ends wait: spin, and yield the CPU after 500 ns
// (shm/wait's rule, so two spinners on two vCPUs do not starve each
// other); never sleep, see above. Its Wake is the futex wake of a peer
// that sleeps on the ring anyway.
var spinWait = &wait.Policy{Mode: wait.Spin}

// RecWriter writes records into a ring in place. It is for one goroutine
// at a time (single producer), and not to be mixed with a Writer on the
// same ring.
type RecWriter struct {
	r     *Ring
	epoch uint64
	next  uint64 // number of the next record
	tail  uint64 // private; published to r.tail once per stride
	shown uint64 // the tail last published
	head  uint64 // last validated head of the reader
	msgs  uint64
	off   int // data offset of the open reservation's header; -1: none
	pad   int // its pad
	room  int // its payload bytes

	// dirty has a bit per line of the data area: set when the line's
	// stamp field may hold bytes other than a stamp of this writer's
	// (payload, pad, whatever was there before it started), which seal
	// must zero before a record ends there. Small records leave no bits
	// set, so a stream of them never zeroes a line: the zeroing store,
	// ordered before the stamp, would cost a second line transfer per
	// message. C's writer zeroes the next line every time; the reader
	// cannot tell the difference.
	dirty []uint64
}

// NewRecEpoch returns a random epoch for a ring's records, by the MPI
// transport's rule: bit 32 set, bit 63 clear.
func NewRecEpoch() uint64 { return (rand.Uint64() | 1<<32) &^ (1 << 63) }

// checkEpoch refuses epochs whose stamps could be 0 within 2^63 records:
// 0 is what a cleared line holds.
func checkEpoch(e uint64) error {
	if e == 0 || e>>63 != 0 {
		return fmt.Errorf("record epoch %#x: want 1 to 2^63-1 (NewRecEpoch)", e)
	}
	return nil
}

// NewRecWriter takes the producing end of r for records stamped from
// epoch, a random number that both ends agree on (NewRecEpoch; the MPI
// transport sends it in its SWITCH mark); the first record is number 0.
// The tail must be on a line boundary.
func NewRecWriter(r *Ring, epoch uint64) (*RecWriter, error) {
	if err := checkEpoch(epoch); err != nil {
		return nil, err
	}
	w := &RecWriter{r: r, epoch: epoch, off: -1}
	w.dirty = make([]uint64, (len(r.data)/RecLine+63)/64)
	for i := range w.dirty {
		w.dirty[i] = ^uint64(0)
	}
	w.tail = r.tail.Load()
	w.shown = w.tail
	w.msgs = r.wmsgs.Load()
	w.head = r.head.Load()
	if w.head > w.tail || w.tail-w.head > uint64(len(r.data)) || w.tail%RecLine != 0 {
		return nil, fmt.Errorf("record writer: head %d, tail %d: %w", w.head, w.tail, ErrCorrupt)
	}
	return w, nil
}

// Reserve returns room for a record of n payload bytes, in place, padded
// by RecPadding(0, n). It fails with ErrRingFull when the record does not
// fit now, ErrRecTooLarge, ErrReset, ErrPeerClosed or ErrCorrupt. At most
// one reservation is open; Commit or Cancel ends it, a later Reserve
// replaces it.
func (w *RecWriter) Reserve(n int) ([]byte, error) { return w.ReservePadded(RecPadding(0, n), n) }

// ReservePadded is Reserve with the caller's pad, e.g. RecPadding(hdr, m)
// for a payload that starts with a header of its own.
func (w *RecWriter) ReservePadded(pad, n int) ([]byte, error) {
	w.off = -1
	if err := w.check(); err != nil {
		return nil, err
	}
	c := len(w.r.data)
	if pad < 0 || pad > 0xffff || n < 0 {
		return nil, ErrBadCommit
	}
	if n > c {
		return nil, ErrRecTooLarge
	}
	span := RecSpan(pad + n)
	if span > c/2 {
		return nil, ErrRecTooLarge
	}
	off := int(w.tail & w.r.mask)
	toEnd := c - off
	need := span
	if span > toEnd {
		need += toEnd
	}
	if err := w.fits(need); err != nil {
		return nil, err
	}
	if span > toEnd {
		// PAD to the end, published at once so the head never passes the tail.
		w.header(off, toEnd-RecHeaderSize, 0, RecKindPad, 0)
		w.tail += uint64(toEnd)
		w.mark(off, RecLine) // the rest of a PAD is not written
		w.seal(off, 0)
		if err := w.publish(); err != nil {
			return nil, err
		}
		off = 0
	}
	w.off, w.pad, w.room = off, pad, n
	p := off + RecHeaderSize + pad
	return w.r.data[p : p+n : p+n], nil
}

// Commit publishes the first n bytes of the reserved payload as a record
// of kind (RecKindData: a ring holds no other) with the caller's tag.
func (w *RecWriter) Commit(n int, kind, tag uint8) error {
	if w.off < 0 || n < 0 || n > w.room || kind != RecKindData {
		return ErrBadCommit
	}
	off := w.off
	w.off = -1
	w.header(off, n, w.pad, kind, tag)
	span := RecSpan(w.pad + n)
	w.tail += uint64(span)
	w.mark(off, span)
	w.seal(off, w.pad+n)
	return w.publish()
}

// Cancel drops the open reservation, if any; nothing was published.
func (w *RecWriter) Cancel() { w.off = -1 }

// check returns the error that stops any record: reset, or reader gone.
func (w *RecWriter) check() error {
	if w.r.reset.Load() != 0 {
		return ErrReset
	}
	if w.r.rflags.Load()&FlagReaderClosed != 0 {
		return ErrPeerClosed
	}
	return nil
}

// fits returns nil if need bytes are free, refreshing the reader's head
// (one shared load) only when the cached view is short.
func (w *RecWriter) fits(need int) error {
	c := uint64(len(w.r.data))
	if c-(w.tail-w.head) >= uint64(need) {
		return nil
	}
	if err := w.refresh(); err != nil {
		return err
	}
	if c-(w.tail-w.head) >= uint64(need) {
		return nil
	}
	// Ask the reader for its head (it publishes it once per stride
	// otherwise), then look again: a head published before the request
	// was seen is found here.
	if w.shown != w.tail {
		w.showTail()
	}
	w.r.wwait.Store(recWantsRoom)
	if err := w.refresh(); err != nil {
		return err
	}
	if c-(w.tail-w.head) < uint64(need) {
		return ErrRingFull
	}
	return nil
}

// refresh loads the reader's head: it may only grow, and never past what
// this end wrote.
func (w *RecWriter) refresh() error {
	h := w.r.head.Load()
	if h < w.head || h > w.tail {
		return ErrCorrupt
	}
	w.head = h
	return nil
}

func (w *RecWriter) header(off, n, pad int, kind, tag uint8) {
	h := w.r.data[off : off+RecHeaderSize : off+RecHeaderSize]
	binary.NativeEndian.PutUint32(h[recOffLen:], uint32(n))
	h[recOffKind] = kind
	h[recOffTag] = tag
	binary.NativeEndian.PutUint16(h[recOffPad:], uint16(pad))
}

// mark records what a record written at off over span bytes left in its
// lines: a stamp in the first, payload in the others.
func (w *RecWriter) mark(off, span int) {
	i := off / RecLine
	w.dirty[i/64] &^= 1 << (i % 64)
	for j := i + 1; j < i+span/RecLine; j++ {
		w.dirty[j/64] |= 1 << (j % 64)
	}
}

// seal finishes the record at off, whose pad and payload the caller wrote
// (written bytes), which ends at w.tail: if the line at
// w.tail is dirty and the reader is done with it, it zeroes the line's
// stamp field, so the reader polling there never finds the stamp it waits
// for in old bytes; then it stores the record's stamp, last. The reader is
// not done with the line when it holds an unread record (the ring is
// full), whose stamp is older than any the reader will look for there.
// The stamp's store is a release store for a small record (under
// RecAlignFrom: no copy of that size uses non-temporal stores), and a
// sequentially consistent one for a larger record, which on amd64 also
// orders the non-temporal stores of a large copy before it.
func (w *RecWriter) seal(off, written int) {
	at := int(w.tail & w.r.mask)
	i := at / RecLine
	if w.dirty[i/64]&(1<<(i%64)) != 0 {
		c := uint64(len(w.r.data))
		if w.tail+RecHeaderSize <= w.head+c || (w.refresh() == nil && w.tail+RecHeaderSize <= w.head+c) {
			// A plain store: the reader loads this stamp only after
			// the one below, which orders it.
			binary.NativeEndian.PutUint64(w.r.data[at+recOffStamp:at+recOffStamp+8], 0)
			w.dirty[i/64] &^= 1 << (i % 64)
		}
	}
	stamp := word64(w.r.data, off+recOffStamp)
	if written < RecAlignFrom {
		storeRel(stamp, w.epoch+w.next)
	} else {
		stamp.Store(w.epoch + w.next)
	}
	w.next++
}

// crossed reports whether an index moved into another stride (an eighth
// of the ring) since it was last published.
func crossed(r *Ring, now, shown uint64) bool { return now^shown >= uint64(len(r.data))>>3 }

// publish ends a record: the tail once per stride, and a wake for a reader
// that sleeps on the ring (a load of a line no record end writes).
func (w *RecWriter) publish() error {
	w.msgs++
	if crossed(w.r, w.tail, w.shown) {
		w.showTail()
	}
	return spinWait.Wake(w.r.rwait)
}

// showTail stores the tail after the records so far, and the count.
func (w *RecWriter) showTail() {
	w.shown = w.tail
	storeRel(w.r.tail, w.tail)
	storeRel(w.r.wmsgs, w.msgs)
}

// Ready reports whether a Wait should end: the reader consumed since the
// last full Reserve, or the ring was reset or its reader closed (wait.Cond).
func (w *RecWriter) Ready() bool {
	return w.r.head.Load() != w.head || w.check() != nil
}

// Wait spins until Ready, yielding the CPU after 500 ns; it returns nil, or
// os.ErrDeadlineExceeded at the deadline (zero: none). It never sleeps.
func (w *RecWriter) Wait(deadline time.Time) error { return spinWait.Wait(w, w.r.wwait, deadline) }

// Records returns how many records (PADs included) were written and the
// bytes they took: what the MPI transport's DOWN carries, so the reader
// can drain exactly that far after a reset.
func (w *RecWriter) Records() (n, bytes uint64) { return w.next, w.tail }

// Rec is a record as the reader sees it. Payload aliases the ring until
// Consume; a hostile peer could rewrite it meanwhile, so callers validate
// what they parse from it.
type Rec struct {
	Kind, Tag uint8
	Payload   []byte
}

// RecReader reads records from a ring in place. It is for one goroutine at
// a time (single consumer), and not to be mixed with a Reader on the same
// ring.
type RecReader struct {
	r     *Ring
	epoch uint64
	next  uint64 // number of the record expected at head
	head  uint64 // private; published to r.head once per stride, or when asked
	shown uint64 // the head last published
	msgs  uint64
	span  uint64 // of the record Poll returned; 0: none
}

// NewRecReader takes the consuming end of r for records stamped from
// epoch (see NewRecWriter). The head must be on a line boundary.
func NewRecReader(r *Ring, epoch uint64) (*RecReader, error) {
	if err := checkEpoch(epoch); err != nil {
		return nil, err
	}
	rd := &RecReader{r: r, epoch: epoch}
	rd.head = r.head.Load()
	rd.shown = rd.head
	rd.msgs = r.rmsgs.Load()
	t := r.tail.Load()
	if rd.head > t || t-rd.head > uint64(len(r.data)) || rd.head%RecLine != 0 {
		return nil, fmt.Errorf("record reader: head %d, tail %d: %w", rd.head, t, ErrCorrupt)
	}
	return rd, nil
}

// Poll returns the record at the head if it has arrived, skipping PADs,
// without blocking; ok is false when none has. It does not consume it: Poll
// again returns the same record until Consume. Once the ring is reset, the
// records written before are still returned, then ErrReset (a caller that
// knows the writer's final count, as the MPI transport does, can go on
// polling to that count). ErrCorrupt means the ring holds an impossible
// record; nothing outside the ring was read.
func (rd *RecReader) Poll() (rec Rec, ok bool, err error) {
	c := uint64(len(rd.r.data))
	// At most twice round: a PAD moves the head to offset 0, where a PAD
	// is corrupt.
	for {
		off := rd.head & rd.r.mask
		if word64(rd.r.data, int(off)+recOffStamp).Load() != rd.epoch+rd.next {
			if rd.r.reset.Load() != 0 {
				return Rec{}, false, ErrReset
			}
			if rd.shown != rd.head && rd.r.wwait.Load() != 0 {
				return Rec{}, false, rd.showHead()
			}
			return Rec{}, false, nil
		}
		h := rd.r.data[off : off+RecHeaderSize : off+RecHeaderSize]
		n := uint64(binary.NativeEndian.Uint32(h[recOffLen:]))
		pad := uint64(binary.NativeEndian.Uint16(h[recOffPad:]))
		if n+pad > c {
			return Rec{}, false, ErrCorrupt
		}
		span := uint64(RecSpan(int(n + pad)))
		if off+span > c {
			return Rec{}, false, ErrCorrupt
		}
		switch h[recOffKind] {
		case RecKindData:
			rd.span = span
			p := off + RecHeaderSize + pad
			return Rec{Kind: RecKindData, Tag: h[recOffTag], Payload: rd.r.data[p : p+n : p+n]}, true, nil
		case RecKindPad:
			if off == 0 || off+span != c {
				return Rec{}, false, ErrCorrupt
			}
			rd.span = span
			if err := rd.Consume(); err != nil {
				return Rec{}, false, err
			}
		default:
			return Rec{}, false, ErrCorrupt
		}
	}
}

// Consume gives the record Poll returned back to the writer.
func (rd *RecReader) Consume() error {
	if rd.span == 0 {
		return ErrBadCommit
	}
	rd.head += rd.span
	rd.span = 0
	rd.next++
	rd.msgs++
	if crossed(rd.r, rd.head, rd.shown) || rd.r.wwait.Load() != 0 {
		return rd.showHead()
	}
	return nil
}

// showHead stores the head after the records consumed, and the count, then
// clears a writer's request for room, or wakes a writer asleep.
func (rd *RecReader) showHead() error {
	rd.shown = rd.head
	storeRel(rd.r.head, rd.head)
	storeRel(rd.r.rmsgs, rd.msgs)
	if rd.r.wwait.CompareAndSwap(recWantsRoom, 0) {
		return nil
	}
	return spinWait.Wake(rd.r.wwait)
}

// Ready reports whether a Wait should end: the next record's stamp is at
// the head, or the ring was reset (wait.Cond).
func (rd *RecReader) Ready() bool {
	off := int(rd.head&rd.r.mask) + recOffStamp
	return word64(rd.r.data, off).Load() == rd.epoch+rd.next || rd.r.reset.Load() != 0
}

// Wait spins until Ready, yielding the CPU after 500 ns; it returns nil, or
// os.ErrDeadlineExceeded at the deadline (zero: none). It never sleeps.
// It may end at a PAD, after which Poll finds nothing yet: poll in a loop.
func (rd *RecReader) Wait(deadline time.Time) error {
	return spinWait.Wait(rd, rd.r.rwait, deadline)
}

// Records returns how many records (PADs included) were consumed and the
// bytes they took.
func (rd *RecReader) Records() (n, bytes uint64) { return rd.next, rd.head }
