package relay

import (
	"io"
	"testing"
)

// The link's cost against the kernel TCP it runs on, over loopback: one
// flow streaming 64 KiB writes, and an 8-byte ping-pong. Run as in
// docs/crosshost.md ("The link's cost"), interleaved. rdma-fake is the
// RDMA link over fake verbs whose "NIC" is a memcpy in the writer's
// goroutine and a channel: the link's own software cost (docs/rdma.md).

func BenchmarkStream64KiB(b *testing.B) {
	b.Run("tcp", onTCP(stream))
	b.Run("link", func(b *testing.B) {
		fa, fb, done := linkFlow(b)
		defer done()
		stream(b, fa, fb)
	})
	b.Run("rdma-fake", func(b *testing.B) {
		fa, fb, done := rdmaFlow(b)
		defer done()
		stream(b, fa, fb)
	})
}

func BenchmarkPingPong8B(b *testing.B) {
	b.Run("tcp", onTCP(pingPong))
	b.Run("link", func(b *testing.B) {
		fa, fb, done := linkFlow(b)
		defer done()
		pingPong(b, fa, fb)
	})
	b.Run("rdma-fake", func(b *testing.B) {
		fa, fb, done := rdmaFlow(b)
		defer done()
		pingPong(b, fa, fb)
	})
}

// rdmaFlow is flow 1 of two RDMA links over fake verbs (4 MiB rings).
func rdmaFlow(b *testing.B) (*Flow, *Flow, func()) {
	va, vb := fakePair(4<<20, 128)
	va.PostRecv(128)
	vb.PostRecv(128)
	la, lb := NewRDMALink(va, RDMAOptions{}), NewRDMALink(vb, RDMAOptions{})
	fa, _ := la.Open(1)
	fb, _ := lb.Open(1)
	return fa, fb, func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() }
}

// onTCP runs bench over one kernel TCP connection on loopback: the
// baseline of the link's and the bridge's benchmarks.
func onTCP(bench func(b *testing.B, a, c io.ReadWriter)) func(*testing.B) {
	return func(b *testing.B) {
		ca, cb := conns(b, 1)
		defer ca[0].Close()
		defer cb[0].Close()
		bench(b, ca[0], cb[0])
	}
}

// linkFlow is flow 1 of two links over two loopback connections.
func linkFlow(b *testing.B) (*Flow, *Flow, func()) {
	ca, cb := conns(b, 2)
	la, lb := NewLink(ca, LinkOptions{}), NewLink(cb, LinkOptions{})
	fa, _ := la.Open(1)
	fb, _ := lb.Open(1)
	return fa, fb, func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() }
}

func stream(b *testing.B, w, r io.ReadWriter) {
	buf := make([]byte, 64<<10)
	b.SetBytes(int64(len(buf)))
	done := make(chan struct{})
	go func() {
		rb := make([]byte, 64<<10)
		for n := int64(0); n < int64(b.N)*int64(len(buf)); {
			m, err := r.Read(rb)
			if err != nil {
				break
			}
			n += int64(m)
		}
		close(done)
	}()
	b.ResetTimer()
	for range b.N {
		if _, err := w.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	<-done
}

func pingPong(b *testing.B, a, c io.ReadWriter) {
	go func() {
		p := make([]byte, 8)
		for {
			if _, err := io.ReadFull(c, p); err != nil {
				return
			}
			if _, err := c.Write(p); err != nil {
				return
			}
		}
	}()
	p := make([]byte, 8)
	b.ResetTimer()
	for range b.N {
		if _, err := a.Write(p); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(a, p); err != nil {
			b.Fatal(err)
		}
	}
}
