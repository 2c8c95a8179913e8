package guestlib

import (
	"bytes"
	"errors"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
)

// onlyReader hides a reader's WriterTo, so io.Copy uses the
// destination's ReadFrom.
type onlyReader struct{ io.Reader }

// pacedReader pauses for a moment every 256 KiB, so that a copy spans
// many of the flipper's path switches however fast the machine is (the
// whole 32 MiB once fitted in one ring stretch, and the test saw only
// one path).
type pacedReader struct {
	r    io.Reader
	left int
}

func (p *pacedReader) Read(b []byte) (int, error) {
	if p.left <= 0 {
		time.Sleep(500 * time.Microsecond)
		p.left = 256 << 10
	}
	n, err := p.r.Read(b[:min(len(b), p.left)])
	p.left -= n
	return n, err
}

// crcWriter checksums what it is given, in pieces of at most max bytes
// per Write when max > 0 (a short write then, with errShort); with stopAt
// > 0 it fails with errStop once it has had that many bytes.
type crcWriter struct {
	n      int
	sum    uint32
	max    int
	stopAt int
}

var errShort, errStop = errors.New("short"), errors.New("stop")

func (w *crcWriter) Write(p []byte) (int, error) {
	var err error
	if w.max > 0 && len(p) > w.max {
		p, err = p[:w.max], errShort
	}
	w.sum = crc32.Update(w.sum, crc32.IEEETable, p)
	w.n += len(p)
	if err == nil && w.stopAt > 0 && w.n >= w.stopAt {
		err = errStop
	}
	return len(p), err
}

// TestCopyFlipping: io.Copy on both ends (ReadFrom from a plain reader
// on the writer, WriteTo into a checksumming writer on the reader) while
// hostd moves the connection between the rings and TCP: every byte
// once, in order, over both paths.
func TestCopyFlipping(t *testing.T) {
	p := newPair(t)
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	stop := flipper(t, p.auto, 11, 2*time.Millisecond)
	const total = 32 << 20
	want := make([]byte, total)
	_, _ = rand.NewChaCha8([32]byte{11}).Read(want)
	errc := make(chan error, 1)
	go func() {
		n, err := io.Copy(c, onlyReader{&pacedReader{r: bytes.NewReader(want)}})
		if err == nil && n != total {
			err = io.ErrShortWrite
		}
		if err == nil {
			err = c.CloseWrite()
		}
		errc <- err
	}()
	var w crcWriter
	n, err := io.Copy(&w, s)
	flips := stop()
	if err != nil || n != total || w.n != total {
		t.Fatalf("io.Copy from the Conn = %d, %v (writer got %d), want %d\n%s", n, err, w.n, total, ends(c, s))
	}
	if err := <-errc; err != nil {
		t.Fatalf("io.Copy into the Conn: %v", err)
	}
	if w.sum != crc32.ChecksumIEEE(want) {
		t.Fatalf("the bytes differ\n%s", ends(c, s))
	}
	if st := s.Stats(); st.RingReceived == 0 || st.TCPReceived == 0 {
		t.Fatalf("the copy did not use both paths\n%s", ends(c, s))
	}
	t.Logf("%d flips\n%s", flips, ends(c, s))
}

// TestWriteToShortWriter: bytes the destination did not take stay in
// the ring, at their offset, for the next read.
func TestWriteToShortWriter(t *testing.T) {
	p := newPair(t)
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
	msg := []byte("0123456789abcdef")
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the bytes on the ring", func() bool { return c.Stats().RingSent == uint64(len(msg)) })
	w := &crcWriter{max: 10}
	if n, err := s.WriteTo(w); n != 10 || err != errShort {
		t.Fatalf("WriteTo = %d, %v; want 10, %v", n, err, errShort)
	}
	rest := make([]byte, 6)
	if _, err := io.ReadFull(s, rest); err != nil || string(rest) != "abcdef" {
		t.Fatalf("read after the short write: %q, %v; want \"abcdef\"", rest, err)
	}
}

// TestWriteToDeadline: WriteTo waiting on a ring ends at the read
// deadline, as Read does.
func TestWriteToDeadline(t *testing.T) {
	p := newPair(t)
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := s.SetReadDeadline(time.Now().Add(100 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	var w crcWriter
	done := async(func() error { _, err := s.WriteTo(&w); return err })
	if err := await(t, done, "WriteTo"); !errors.Is(err, os.ErrDeadlineExceeded) || w.n != 1 {
		t.Fatalf("WriteTo = %v after %d bytes, want the deadline after 1\n%s", err, w.n, ends(c, s))
	}
	if !s.Stats().ReadOnRing {
		t.Fatalf("the reader left the ring\n%s", ends(c, s))
	}
}

// TestRingNoAllocsSizes: on the rings, Write, Read, ReadFrom and WriteTo
// of 1 to 64 KiB allocate nothing per call.
func TestRingNoAllocsSizes(t *testing.T) {
	p := newPair(t)
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
	for _, size := range []int{1 << 10, 8 << 10, 32 << 10} {
		out, in := make([]byte, size), make([]byte, size)
		src := bytes.NewReader(out)
		w := &crcWriter{}
		steps := map[string]func(){
			"Write+Read": func() {
				if _, err := c.Write(out); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(s, in); err != nil {
					t.Fatal(err)
				}
			},
			"ReadFrom+WriteTo": func() {
				src.Reset(out)
				if _, err := c.ReadFrom(src); err != nil {
					t.Fatal(err)
				}
				// WriteTo stops once w has had the size bytes
				// the ring holds.
				w.n, w.stopAt = 0, size
				for w.n < size {
					if _, err := s.WriteTo(w); err != nil && err != errStop {
						t.Fatal(err)
					}
				}
			},
		}
		for name, step := range steps {
			step()
			if st := c.Stats(); !st.WriteOnRing || !s.Stats().ReadOnRing {
				t.Fatalf("not on the rings: %s", ends(c, s))
			}
			if a := testing.AllocsPerRun(200, step); a != 0 {
				t.Errorf("%s of %d bytes on the rings: %v allocations, want 0", name, size, a)
			}
		}
	}
}

// blockedWriter is a destination whose first Write blocks until release
// is closed, as a kernel send does while a firewall drops the peer's
// ACKs; it records what each Write was handed.
type blockedWriter struct {
	entered chan []byte // the first Write's bytes, as handed
	release chan struct{}
	got     bytes.Buffer
}

func (w *blockedWriter) Write(p []byte) (int, error) {
	if w.entered != nil {
		w.entered <- p
		w.entered = nil
		<-w.release
	}
	return w.got.Write(p)
}

// TestWriteToDownWhileDestinationBlocks: io.Copy from a Conn on a ring
// into a destination whose Write blocks (an echo server's own kernel
// send, stalled by a firewall that drops the peer's ACKs), and DOWN
// comes meanwhile. The read ring must still be left and LEFT sent at
// once: hostd takes a retired region back after its grace, and a reader
// that still held the ring then failed ("ring memory gone": h2's echo
// in TestAcrossHostsRelay/drop). So the destination must not hold ring
// memory; the bytes then come whole and in order.
func TestWriteToDownWhileDestinationBlocks(t *testing.T) {
	sc := newScripted(t)
	sc.pw.Start(0)
	if _, err := sc.pw.Write([]byte("ring bytes")); err != nil {
		t.Fatal(err)
	}
	w := &blockedWriter{entered: make(chan []byte, 1), release: make(chan struct{})}
	copied := async(func() error { _, err := sc.conn.WriteTo(w); return err })
	b := await(t, w.entered, "the destination's Write")
	_ = sc.pw.Leave()
	sc.s.Send(t, guesttest.Down(sc.f.B, proto.ReasonFirewall))
	m, err := sc.s.Read(guesttest.Wait)
	if err != nil || m.Type != proto.Left || m.Slot != sc.f.B.Slot || m.Gen != sc.f.B.Gen {
		close(w.release)
		t.Fatalf("after DOWN, with WriteTo's destination blocked: %+v, %v; want LEFT %d.%d\n%+v", m, err, sc.f.B.Slot, sc.f.B.Gen, sc.conn.Stats())
	}
	mem := sc.conn.client.region.Mem()
	lo, hi := uintptr(unsafe.Pointer(unsafe.SliceData(mem))), uintptr(unsafe.Pointer(unsafe.SliceData(mem)))+uintptr(len(mem))
	if p := uintptr(unsafe.Pointer(unsafe.SliceData(b))); p >= lo && p < hi {
		t.Errorf("the destination holds the ring's memory after LEFT (%#x in the region [%#x, %#x))", p, lo, hi)
	}
	close(w.release)
	if _, err := sc.peer.Write([]byte("+tcp")); err != nil {
		t.Fatal(err)
	}
	sc.peer.Close()
	if err := await(t, copied, "WriteTo"); err != nil || w.got.String() != "ring bytes+tcp" {
		t.Fatalf("WriteTo = %v, destination got %q; want nil, \"ring bytes+tcp\"", err, w.got.String())
	}
	if st := sc.conn.Stats(); st.RingReceived != 10 || st.TCPReceived != 4 {
		t.Fatalf("stats %+v, want 10 ring and 4 TCP bytes", st)
	}
}
