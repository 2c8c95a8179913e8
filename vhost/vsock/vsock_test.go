//go:build linux

package vsock_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/shuntnet/shunt/vhost/vsock"
)

// guestStream is the guest's end of one stream in the fake driver: it
// sends within the host's credit and tells the host what it consumed.
type guestStream struct {
	f                  *fake
	gport, hport       uint32
	hostBuf, hostFwd   uint32
	txCnt, fwd, fwdOld uint32
	got                bytes.Buffer
	shut               uint32 // SHUTDOWN flags the host sent
}

func (g *guestStream) hdr(op uint16) vsock.Hdr {
	h := hdr(op, g.gport, g.hport)
	h.FwdCnt = g.fwd
	return h
}

// handle takes one packet from the host.
func (g *guestStream) handle(h vsock.Hdr, p []byte) {
	g.f.t.Helper()
	if h.SrcCID != vsock.HostCID || h.DstCID != guestCID || h.SrcPort != g.hport || h.DstPort != g.gport {
		g.f.t.Fatalf("packet %v for another stream", h)
	}
	g.hostBuf, g.hostFwd = h.BufAlloc, h.FwdCnt
	switch h.Op {
	case vsock.OpRW:
		g.got.Write(p)
		g.fwd += uint32(len(p))
		if g.fwd-g.fwdOld >= 16<<10 {
			g.fwdOld = g.fwd
			g.f.sendPkt(g.hdr(vsock.OpCreditUpdate), nil)
		}
	case vsock.OpShutdown:
		g.shut |= h.Flags
	case vsock.OpCreditUpdate, vsock.OpResponse:
	default:
		g.f.t.Fatalf("unexpected %v", h)
	}
}

// pump handles packets until none comes for d.
func (g *guestStream) pump(d time.Duration) bool {
	h, p, ok := g.f.recv(d)
	if ok {
		g.handle(h, p)
	}
	return ok
}

// send sends data within the host's credit, handling what comes meanwhile.
func (g *guestStream) send(data []byte) {
	g.f.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for len(data) > 0 {
		credit := g.hostBuf - (g.txCnt - g.hostFwd)
		if credit == 0 {
			if time.Now().After(deadline) {
				g.f.t.Fatalf("no credit from the host for 20 s")
			}
			g.pump(10 * time.Millisecond)
			continue
		}
		n := min(len(data), 4096, int(credit))
		g.f.sendPkt(g.hdr(vsock.OpRW), data[:n])
		g.txCnt += uint32(n)
		data = data[n:]
		for g.pump(0) {
		}
	}
}

func random(n int, seed uint64) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// TestGuestConnects: the guest connects to a host Listener, both send
// more than a receive buffer's worth (so credit updates must flow), both
// half-close, the guest closes and gets its RST.
func TestGuestConnects(t *testing.T) {
	f := newFake(t)
	l, err := f.dev.Listen(1234)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	g := &guestStream{f: f, gport: 40000, hport: 1234}
	f.sendPkt(g.hdr(vsock.OpRequest), nil)
	g.handle(f.expect(vsock.OpResponse))
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	up, down := random(3*vsock.RecvBuf+123, 1), random(2*vsock.RecvBuf+77, 2)
	read := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(c)
		read <- b
	}()
	wrote := make(chan error, 1)
	go func() {
		_, err := c.Write(down)
		if err == nil {
			err = c.(*vsock.Conn).CloseWrite()
		}
		wrote <- err
	}()
	g.send(up)
	f.sendPkt(func() vsock.Hdr { h := g.hdr(vsock.OpShutdown); h.Flags = vsock.ShutdownSend; return h }(), nil)
	deadline := time.Now().Add(20 * time.Second)
	for g.shut&vsock.ShutdownSend == 0 && time.Now().Before(deadline) {
		g.pump(10 * time.Millisecond)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(g.got.Bytes(), down) {
		t.Fatalf("the guest got %d bytes, want %d equal ones", g.got.Len(), len(down))
	}
	select {
	case b := <-read:
		if !bytes.Equal(b, up) {
			t.Fatalf("the host read %d bytes, want %d equal ones", len(b), len(up))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the host's read did not end with EOF")
	}
	f.sendPkt(func() vsock.Hdr { h := g.hdr(vsock.OpShutdown); h.Flags = 3; return h }(), nil)
	f.expect(vsock.OpRst)
	if n := f.dev.Stats().Conns.Load(); n != 0 {
		t.Fatalf("%d connections after the guest closed", n)
	}
	c.Close()
}

// TestRefused: a REQUEST to a port nobody listens on gets RST.
func TestRefused(t *testing.T) {
	f := newFake(t)
	f.sendPkt(hdr(vsock.OpRequest, 40001, 999), nil)
	h, _ := f.expect(vsock.OpRst)
	if h.DstPort != 40001 || h.SrcPort != 999 {
		t.Fatalf("RST %v", h)
	}
}

// TestHostDials: the host connects to the guest's listener, sends, and
// the guest's RST ends it: the host reads EOF, writes fail.
func TestHostDials(t *testing.T) {
	f := newFake(t)
	type res struct {
		c   *vsock.Conn
		err error
	}
	dialed := make(chan res, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := f.dev.Dial(ctx, 77)
		dialed <- res{c, err}
	}()
	h, _ := f.expect(vsock.OpRequest)
	if h.DstPort != 77 || h.DstCID != guestCID {
		t.Fatalf("REQUEST %v", h)
	}
	g := &guestStream{f: f, gport: 77, hport: h.SrcPort, hostBuf: h.BufAlloc}
	f.sendPkt(g.hdr(vsock.OpResponse), nil)
	r := <-dialed
	if r.err != nil {
		t.Fatal(r.err)
	}
	if _, err := r.c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	g.handle(f.expect(vsock.OpRW))
	if g.got.String() != "hello" {
		t.Fatalf("guest got %q", g.got.String())
	}
	f.sendPkt(g.hdr(vsock.OpRst), nil)
	r.c.SetDeadline(time.Now().Add(5 * time.Second))
	if n, err := r.c.Read(make([]byte, 10)); n != 0 || err != io.EOF {
		t.Fatalf("read after RST: %d %v", n, err)
	}
	if _, err := r.c.Write([]byte("x")); err == nil {
		t.Fatal("write after the guest's RST succeeded")
	}

	// A guest that answers with RST refuses the connection.
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := f.dev.Dial(ctx, 78)
		dialed <- res{c, err}
	}()
	h, _ = f.expect(vsock.OpRequest)
	f.sendPkt(hdr(vsock.OpRst, 78, h.SrcPort), nil)
	if r := <-dialed; r.err == nil {
		t.Fatal("Dial succeeded against an RST")
	}
}

// TestDeadlines: with no rx buffers the host's Write waits, and its
// deadline ends the wait.
func TestDeadlines(t *testing.T) {
	f := newFake(t)
	c := f.connected(5, 1)
	c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read: %v", err)
	}
	// The guest advertised 64 KiB: the host can queue that plus SendBuf.
	c.SetWriteDeadline(time.Now().Add(200 * time.Millisecond))
	if n, err := c.Write(make([]byte, 1<<20)); !errors.Is(err, os.ErrDeadlineExceeded) || n > vsock.SendBuf+64<<10 {
		t.Fatalf("write: %d %v", n, err)
	}
}
