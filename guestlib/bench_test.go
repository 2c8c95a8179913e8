package guestlib

import (
	"fmt"
	"io"
	"testing"
)

// BenchmarkConnCall: the library's own cost per Write and per Read on
// the rings, with nothing to wait for: one goroutine writes size bytes
// and reads them back through a connection of two Clients of this
// process (guesttest's hostd). Cross-process figures, against C and the
// kernel: BenchmarkGuestSizes (make bench-sizes).
func BenchmarkConnCall(b *testing.B) {
	for _, size := range []int{64, 1 << 10, 8 << 10, 32 << 10} {
		b.Run(fmt.Sprint(size), func(b *testing.B) {
			p := newPair(b)
			c, s := p.conns(b)
			defer c.Close()
			defer s.Close()
			waitFor(b, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
			buf := make([]byte, size)
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(s, buf); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/2, "ns/call")
		})
	}
}
