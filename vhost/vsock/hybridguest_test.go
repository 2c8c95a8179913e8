package vsock_test

import (
	"bytes"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/shuntnet/shunt/vhost/vsock"
)

// TestHybridGuestPorts: ServeHybridGuest carries the guest's connection
// to a listed port to the Unix socket path_<port>, and refuses (RST) a
// listed port with no socket there and a port not listed even with one.
func TestHybridGuestPorts(t *testing.T) {
	f := newFake(t)
	path := filepath.Join(t.TempDir(), "vm.vsock")
	h, err := vsock.ServeHybridGuest(f.dev, path, 1021, 1022)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	for _, port := range []string{"_1021", "_5000"} {
		l, err := net.Listen("unix", path+port)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		if port == "_1021" {
			got := make(chan []byte, 1)
			go func() {
				c, err := l.Accept()
				if err != nil {
					got <- nil
					return
				}
				defer c.Close()
				c.SetReadDeadline(time.Now().Add(10 * time.Second))
				b, _ := io.ReadAll(c)
				got <- b
			}()
			defer func() {
				if b := <-got; !bytes.Equal(b, []byte("hello hostd")) {
					t.Errorf("path_1021 read %q, want the guest's bytes", b)
				}
			}()
		}
	}
	for _, port := range []uint32{1022, 5000} {
		f.sendPkt(hdr(vsock.OpRequest, 40000+port, port), nil)
		if h, _ := f.expect(vsock.OpRst); h.SrcPort != port {
			t.Fatalf("port %d: RST %v", port, h)
		}
	}
	g := &guestStream{f: f, gport: 40001, hport: 1021}
	f.sendPkt(g.hdr(vsock.OpRequest), nil)
	g.handle(f.expect(vsock.OpResponse))
	g.send([]byte("hello hostd"))
	f.sendPkt(func() vsock.Hdr { h := g.hdr(vsock.OpShutdown); h.Flags = vsock.ShutdownSend; return h }(), nil)
	for deadline := time.Now().Add(10 * time.Second); g.shut&vsock.ShutdownSend == 0 && time.Now().Before(deadline); {
		g.pump(10 * time.Millisecond)
	}
}
