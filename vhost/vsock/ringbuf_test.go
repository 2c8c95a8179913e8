package vsock

import (
	"bytes"
	"math/rand/v2"
	"testing"
)

// TestRingBuf: random fills (from split segments) and reads of random
// sizes give back the bytes in order, across the wrap.
func TestRingBuf(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	q := ringBuf{max: RecvBuf}
	var want bytes.Buffer
	next := byte(0)
	for i := 0; i < 20000; i++ {
		if r.IntN(2) == 0 {
			n := r.IntN(min(9000, RecvBuf-q.len()) + 1)
			src := make([]byte, HdrSize+n)
			for j := range src[HdrSize:] {
				src[HdrSize+j] = next
				next++
			}
			cut := r.IntN(len(src) + 1)
			q.fill([][]byte{src[:cut], src[cut:]}, HdrSize, n)
			want.Write(src[HdrSize:])
		} else {
			p := make([]byte, r.IntN(12000))
			k := q.read(p)
			if w := want.Next(k); !bytes.Equal(p[:k], w) || (k < len(p) && want.Len() > 0) {
				t.Fatalf("step %d: read %d bytes, not the next ones (held %d)", i, k, q.len())
			}
		}
		if q.len() != want.Len() {
			t.Fatalf("step %d: holds %d, want %d", i, q.len(), want.Len())
		}
	}
}
