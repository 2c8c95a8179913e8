package guestlib

import (
	"io"
	"sync"

	"github.com/shuntnet/shunt/shm/ring"
)

// io.Copy with a Conn on either side (io.WriterTo, io.ReaderFrom). A
// Conn as the source hands the destination the ring's bytes in place
// (ReadBuffer, ReleaseRead), so they are copied once, by the
// destination's Write, instead of into a user buffer first; on TCP it
// reads into the Conn's own buffer. Both follow the path switching of
// Read and Write: the stream offsets, the deadlines and the fallbacks are
// theirs.

// copyChunk is the most WriteTo hands the destination at once, and what
// ReadFrom reads at once: a ring's publication batch.
const copyChunk = ring.Batch

// WriteTo implements io.WriterTo: it writes the stream to w until EOF
// (then it returns nil, as io.Copy does) or an error of either side. On
// a ring, w.Write gets the ring's bytes in place (no user buffer) and
// bytes w did not take stay in the ring; the read deadline holds as for
// Read. Like Read, it is one reader at a time.
func (c *Conn) WriteTo(w io.Writer) (int64, error) {
	var total int64
	for {
		b, err := c.ReadBuffer(copyChunk)
		if len(b) > 0 {
			n, werr := c.handOut(w, b)
			total += int64(n)
			if rerr := c.ReleaseRead(n); werr == nil {
				werr = rerr
			}
			if werr == nil && n < len(b) {
				werr = io.ErrShortWrite
			}
			if werr != nil {
				return total, werr
			}
		}
		switch {
		case err == io.EOF:
			return total, nil
		case err != nil:
			return total, err
		}
	}
}

// handOut is w.Write(b), b being a ring's bytes in place or the Conn's
// TCP buffer; the one place where a caller's code reads ring memory (a
// fault guard for a peer's truncation of the region belongs here).
func (c *Conn) handOut(w io.Writer, b []byte) (int, error) {
	n, err := w.Write(b)
	if n < 0 || n > len(b) {
		n, err = 0, io.ErrShortWrite // a broken Writer releases nothing
	}
	return n, err
}

// copyBufs are ReadFrom's buffers: one per ReadFrom under way, none
// allocated per call in the steady state.
var copyBufs = sync.Pool{New: func() any { b := make([]byte, copyChunk); return &b }}

// ReadFrom implements io.ReaderFrom: it writes what r yields until r's
// EOF (then it returns nil) or an error. r is read into a pooled buffer
// and written like Write (one copy, as io.Copy makes, with nothing
// allocated per call); not into reserved ring space, because a ring
// reservation held across a Read of r that blocks would keep the
// direction on the ring after DOWN, and CloseWrite and Close could not
// end it. A source that is itself a Conn implements io.WriterTo, which
// io.Copy prefers: its ring bytes go straight into this Conn's Write.
func (c *Conn) ReadFrom(r io.Reader) (int64, error) {
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	var total int64
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			k, werr := c.Write(buf[:n])
			total += int64(k)
			if werr != nil {
				return total, werr
			}
		}
		switch {
		case rerr == io.EOF:
			return total, nil
		case rerr != nil:
			return total, rerr
		}
	}
}
