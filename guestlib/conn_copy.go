package guestlib

import (
	"io"
	"sync"

	"github.com/shuntnet/shunt/shm/ring"
)

// io.Copy with a Conn on either side (io.WriterTo, io.ReaderFrom). Both
// go through a pooled buffer of their own, as io.Copy's own loop does,
// and follow the path switching of Read and Write: the stream offsets,
// the deadlines and the fallbacks are theirs. Neither hands ring memory
// to the other side's code: a call into it may block for good (a kernel
// send that a firewall stalls, a slow consumer), and a ring lent to it
// could not be left at DOWN (see WriteTo).

// copyChunk is the most WriteTo hands the destination at once, and what
// ReadFrom reads at once: a ring's publication batch.
const copyChunk = ring.Batch

// WriteTo implements io.WriterTo: it writes the stream to w until EOF
// (then it returns nil, as io.Copy does) or an error of either side. It
// reads into a pooled buffer, never handing w the ring's bytes in place:
// a w.Write that blocks would hold the read ring past a DOWN (its reader
// cannot leave a ring whose memory w still reads), hostd takes a retired
// region back after its grace, and the connection then failed ("ring
// memory gone": an echo server's io.Copy(c, c) whose kernel send a
// firewall stalled, TestWriteToDownWhileDestinationBlocks). Bytes w did
// not take are returned first by the next read (Read, ReadBuffer or
// WriteTo). The read deadline holds as for Read. Like Read, it is one
// reader at a time.
func (c *Conn) WriteTo(w io.Writer) (int64, error) {
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	var total int64
	for {
		k, err := c.Read(buf)
		if k > 0 {
			n, werr := c.handOut(w, buf[:k])
			total += int64(n)
			if n < k {
				c.unread(buf[n:k])
				if werr == nil {
					werr = io.ErrShortWrite
				}
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

// handOut is w.Write(b); a Writer that reports more than it was given
// took nothing.
func (c *Conn) handOut(w io.Writer, b []byte) (int, error) {
	n, err := w.Write(b)
	if n < 0 || n > len(b) {
		n, err = 0, io.ErrShortWrite // a broken Writer releases nothing
	}
	return n, err
}

// unread puts b back before the stream's next byte: the last bytes a
// read returned that WriteTo's destination did not take. At most what
// that read returned, so the bytes put back never exceed a chunk.
func (c *Conn) unread(b []byte) {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	c.back = append(append(make([]byte, 0, len(b)+len(c.back)), b...), c.back...)
}

// readBackLocked returns bytes put back (unread) into p; they were
// counted when first read.
func (c *Conn) readBackLocked(p []byte) int {
	n := copy(p, c.back)
	if c.back = c.back[n:]; len(c.back) == 0 {
		c.back = nil
	}
	return n
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
// end it. (A source that is itself a Conn implements io.WriterTo, which
// io.Copy prefers.)
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
