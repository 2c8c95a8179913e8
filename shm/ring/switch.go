package ring

import "errors"

// Path switching (ring format 2; docs/region.md, "Switching"). A
// connection's stream, in each direction, lives on TCP and on a ring in
// turns. Each ring carries one stretch of it: the writer announces the
// stream offset of the ring's first byte before writing it (Start) and
// marks the ring's end (Leave) before its next byte goes over TCP; the
// reader reads TCP up to the start, the ring up to its end, then TCP
// again. The reader marks the ring attached before the writer may start,
// so no byte is written to a ring that its reader cannot read, and left
// once it has drained it, so hostd (told by each end) can free it.
//
// The marks are in the ring's header, stored in stream order with the
// data (a flag after the value it guards, the tail after the flag), so a
// reader that sees ring bytes also sees the start, and a reader that sees
// the leave flag with the ring drained has every byte of the stretch.

// ErrLeft means the writer has left this ring: a reader has drained it and
// goes on over TCP at Start+Written; a writer that left writes no more.
var ErrLeft = errors.New("shunt ring: the stream went back to TCP")

// ReaderAttached reports whether the reader has attached (Reader.Attach):
// only then may the writer Start.
func (w *Writer) ReaderAttached() bool { return w.r.rflags.Load()&FlagReaderAttached != 0 }

// ReaderLeft reports whether the reader has left the ring for good.
func (w *Writer) ReaderLeft() bool { return w.r.rflags.Load()&FlagReaderLeft != 0 }

// Start announces that the ring's first byte is byte off of the stream.
// It must come before the first write, once.
func (w *Writer) Start(off uint64) {
	w.r.start.Store(off)
	w.r.wflags.Or(FlagStarted)
	_ = w.policy.Wake(w.r.rwait)
}

// Leave marks the end of the ring's stretch: the next byte of the stream
// goes over TCP, at Start plus the bytes written here. Later writes fail
// with ErrLeft. It wakes the reader, which drains the ring and follows.
func (w *Writer) Leave() error {
	if w.left {
		return nil
	}
	w.left = true
	w.r.wflags.Or(FlagLeft)
	return w.policy.Wake(w.r.rwait)
}

// Left reports whether Leave was called on this end.
func (w *Writer) Left() bool { return w.left }

// Written is the bytes this end has written to the ring.
func (w *Writer) Written() uint64 { return w.tail }

// Attach tells the writer that this end reads the ring: it may start.
func (rd *Reader) Attach() { rd.r.rflags.Or(FlagReaderAttached) }

// Started returns the stream offset of the ring's first byte once the
// writer has started (ok), as the writer wrote it: the caller checks it
// against its own count of the stream.
func (rd *Reader) Started() (off uint64, ok bool) {
	if rd.r.wflags.Load()&FlagStarted == 0 {
		return 0, false
	}
	return rd.r.start.Load(), true
}

// WriterLeft reports whether the writer has marked the ring's end. The
// ring may still hold bytes: TryRead returns ErrLeft once they are read.
func (rd *Reader) WriterLeft() bool { return rd.r.wflags.Load()&FlagLeft != 0 }

// WriterState is Started and WriterLeft from one load of the writer's
// flags. A reader that decides "never started, so nothing comes" must use
// it: with two loads, a writer that starts, writes and leaves between
// them (a stalled vCPU) looks as if it left without starting, and its
// bytes are skipped.
func (rd *Reader) WriterState() (start uint64, started, left bool) {
	f := rd.r.wflags.Load()
	if f&FlagStarted != 0 {
		start = rd.r.start.Load()
	}
	return start, f&FlagStarted != 0, f&FlagLeft != 0
}

// Consumed is the bytes this end has read from the ring.
func (rd *Reader) Consumed() uint64 { return rd.head }

// Leave marks that this end reads the ring no more, and wakes the writer:
// after the ring is drained and the writer left, or when hostd says the
// writer's process is gone.
func (rd *Reader) Leave() error {
	_ = rd.flush()
	rd.r.rflags.Or(FlagReaderLeft)
	return rd.policy.Wake(rd.r.wwait)
}
