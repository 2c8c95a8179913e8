package ring

import "errors"

// ErrNotHeld means Unfreed was asked for bytes the ring no longer holds:
// freed by the reader already, or past what was written.
var ErrNotHeld = errors.New("shunt ring: bytes not held")

// Unfreed returns a copy of the ring's bytes from byte index from (bytes
// written before it, counted like Written) up to the tail, which the
// reader must not have freed yet: a writer that left its ring resends
// them on TCP when hostd says the other end got only up to from (RESUME,
// relayed flows; docs/protocol.md). The reader's head is read afresh and
// checked (monotonic, never past the tail). It fails with ErrNotHeld when
// from lies before the head or past the tail.
func (w *Writer) Unfreed(from uint64) ([]byte, error) {
	h := w.r.head.Load()
	if h < w.head || h > w.tail {
		return nil, ErrCorrupt
	}
	w.head = h
	if from < h || from > w.tail {
		return nil, ErrNotHeld
	}
	out := make([]byte, w.tail-from) // at most the capacity: tail-head is
	k := copy(out, w.r.data[from&w.r.mask:])
	copy(out[k:], w.r.data)
	return out, nil
}

// Freed is the reader's head as this writer last read it: the bytes the
// reader has freed, at least.
func (w *Writer) Freed() uint64 { return w.head }
