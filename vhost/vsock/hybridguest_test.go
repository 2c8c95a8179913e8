package vsock_test

import (
	"bytes"
	"io"
	"net"
	"os"
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

// TestHybridGuestSymlink: a forward goes only to a socket of the
// daemon's user at path_P itself: a symlink planted there (to another
// VM's path_1021, which would let this VM reach hostd as that one) and
// another user's socket are refused with RST.
func TestHybridGuestSymlink(t *testing.T) {
	f := newFake(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "a.vsock")
	h, err := vsock.ServeHybridGuest(f.dev, path, 1021, 1022)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	// b.vsock_1021 is a real listener (VM B's, hostd's); a.vsock_1021
	// points at it.
	lb, err := net.Listen("unix", filepath.Join(dir, "b.vsock_1021"))
	if err != nil {
		t.Fatal(err)
	}
	defer lb.Close()
	if err := os.Symlink(filepath.Join(dir, "b.vsock_1021"), path+"_1021"); err != nil {
		t.Fatal(err)
	}
	f.sendPkt(hdr(vsock.OpRequest, 40001, 1021), nil)
	if h, _ := f.expect(vsock.OpRst); h.SrcPort != 1021 {
		t.Fatalf("port 1021 through a symlink: %v, want RST", h)
	}
	if os.Geteuid() != 0 {
		t.Log("another user's socket not tried: needs root to chown (run as root)")
		return
	}
	l2, err := net.Listen("unix", path+"_1022")
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if err := os.Chown(path+"_1022", 65534, 65534); err != nil {
		t.Fatal(err)
	}
	f.sendPkt(hdr(vsock.OpRequest, 40002, 1022), nil)
	if h, _ := f.expect(vsock.OpRst); h.SrcPort != 1022 {
		t.Fatalf("port 1022 to uid 65534's socket: %v, want RST", h)
	}
}
