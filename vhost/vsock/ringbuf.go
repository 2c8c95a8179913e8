package vsock

import "github.com/shuntnet/shunt/vhost/virtq"

// ringBuf is a connection's receive or send buffer: max bytes, allocated
// at the first data, filled from and emptied into the guest's buffers
// and the host's with no allocation per packet.
type ringBuf struct {
	max  int
	b    []byte
	r, n int // read position, bytes held
}

func (q *ringBuf) len() int { return q.n }

// room is how many more bytes fit.
func (q *ringBuf) room() int { return q.max - q.n }

// fill copies n bytes from segs, skip bytes in; the caller has checked
// that they fit (n <= room).
func (q *ringBuf) fill(segs [][]byte, skip, n int) {
	if q.b == nil {
		q.b = make([]byte, q.max)
	}
	w := (q.r + q.n) % len(q.b)
	first := min(n, len(q.b)-w)
	virtq.Gather(q.b[w:w+first], segs, skip)
	if first < n {
		virtq.Gather(q.b[:n-first], segs, skip+first)
	}
	q.n += n
}

// read copies out what p holds room for.
func (q *ringBuf) read(p []byte) int {
	k := 0
	for k < len(p) && q.n > 0 {
		c := copy(p[k:], q.b[q.r:min(q.r+q.n, len(q.b))])
		k += c
		q.r = (q.r + c) % len(q.b)
		q.n -= c
	}
	if q.n == 0 {
		q.r = 0
	}
	return k
}

// peek returns up to n of the first bytes held, contiguous (so fewer at
// the wrap), valid until the next change; skip consumes them.
func (q *ringBuf) peek(n int) []byte { return q.b[q.r:min(q.r+q.n, q.r+n, len(q.b))] }

func (q *ringBuf) skip(n int) {
	q.r = (q.r + n) % len(q.b)
	if q.n -= n; q.n == 0 {
		q.r = 0
	}
}

// drop forgets what is held and the memory.
func (q *ringBuf) drop() { *q = ringBuf{max: q.max} }
