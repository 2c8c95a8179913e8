package ring

import (
	"io"

	"github.com/shuntnet/shunt/shm/wait"
)

// A reader that sends bytes on before it may free them: the relay
// (relay.Bridge) reads a guest's write ring, sends the bytes to another
// host, and frees them only once that host's ring holds them, so that a
// cut link loses nothing (docs/crosshost.md). It reads ahead of its head
// with TryPeekAt and gives bytes back with Free; the checks on the
// writer's tail are those of TryRead.

// TryPeekAt returns up to n contiguous readable bytes that begin skip
// bytes past the head, in place and without consuming any. It returns an
// empty slice when no byte past skip is readable yet, ErrLeft once the
// writer left and every byte up to its tail lies before skip (io.EOF
// after FIN), ErrReset, ErrCorrupt for a tail that breaks the rules, and
// ErrBadCommit for a skip past the readable bytes. The slice aliases
// shared memory that the writer may not change until Free (a hostile one
// can: callers copy before they trust it).
func (rd *Reader) TryPeekAt(skip uint64, n int) ([]byte, error) {
	if rd.closed.Load() {
		return nil, ErrClosed
	}
	if rd.r.reset.Load() != 0 {
		return nil, ErrReset
	}
	c := uint64(len(rd.r.data))
	if skip > c {
		return nil, ErrBadCommit
	}
	a, err := rd.avail(int(skip) + 1)
	if err != nil {
		return nil, err
	}
	if uint64(a) <= skip {
		if uint64(a) < skip {
			return nil, ErrBadCommit
		}
		// The flags before a fresh tail (see empty): a leave seen with no
		// byte past skip really is the end.
		fl := rd.r.wflags.Load()
		if a, err = rd.avail(int(skip) + 1); err != nil {
			return nil, err
		}
		if uint64(a) == skip {
			switch {
			case fl&FlagFIN != 0:
				return nil, io.EOF
			case fl&FlagLeft != 0:
				return nil, ErrLeft
			}
			return nil, nil
		}
	}
	off := (rd.head + skip) & rd.r.mask
	m := min(uint64(max(n, 0)), uint64(a)-skip, c-off)
	return rd.r.data[off : off+m : off+m], nil
}

// Free gives the first n readable bytes back to the writer without
// copying them (they were read with TryPeekAt), and wakes it if it
// sleeps. n may not pass the tail this reader has seen (ErrBadCommit).
// Free publishes at once (not lazily, as TryRead does): the relay frees
// as acknowledgements arrive and then waits for the link, not the ring.
func (rd *Reader) Free(n uint64) error {
	if n > rd.tail-rd.head {
		return ErrBadCommit
	}
	if n == 0 {
		return nil
	}
	return rd.consume(int(n), false)
}

// MarkLeft sets the writer's left flag (no byte follows the tail) and
// wakes the reader, for a third party that ends a writer's stretch
// without a Writer: the relay, whose Writer could not be made because the
// guest broke the ring's indices, still tells the guest's reader that
// nothing more comes on this ring.
func (r *Ring) MarkLeft(p *wait.Policy) {
	r.wflags.Or(FlagLeft)
	_ = p.Wake(r.rwait)
}
