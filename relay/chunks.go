package relay

import "sync"

// chunkSize is the unit of a flow's receive buffer.
const chunkSize = 64 << 10

var chunkPool = sync.Pool{New: func() any { b := make([]byte, chunkSize); return &b }}

// chunks is a flow's received bytes not yet read: pooled buffers of
// chunkSize filled in order. Payloads are packed, so what a flow holds is
// bounded by its bytes (at most a window plus two chunks), never by how
// many frames the peer cut them into. Not safe for concurrent use (the
// flow's mutex guards it).
type chunks struct {
	q    []*[]byte
	r, w int // read offset in q[0], write offset in the last
}

// put appends b.
func (c *chunks) put(b []byte) {
	for len(b) > 0 {
		if len(c.q) == 0 || c.w == chunkSize {
			c.q = append(c.q, chunkPool.Get().(*[]byte))
			c.w = 0
		}
		n := copy((*c.q[len(c.q)-1])[c.w:], b)
		c.w += n
		b = b[n:]
	}
}

// take moves up to len(p) bytes into p and returns how many.
func (c *chunks) take(p []byte) int {
	n := 0
	for n < len(p) && len(c.q) > 0 {
		end := chunkSize
		if len(c.q) == 1 {
			end = c.w
		}
		m := copy(p[n:], (*c.q[0])[c.r:end])
		n += m
		c.r += m
		if c.r < end {
			break
		}
		if len(c.q) == 1 { // drained: reuse it from the start
			c.r, c.w = 0, 0
			break
		}
		chunkPool.Put(c.q[0])
		c.q[0] = nil
		c.q = c.q[1:]
		c.r = 0
	}
	return n
}

// free gives the buffers back.
func (c *chunks) free() {
	for _, b := range c.q {
		chunkPool.Put(b)
	}
	*c = chunks{}
}
