package preflight

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/config"
)

// TestVsock: a VM with a vsock block is checked against QEMU's devices
// and its socket with the others; the restart caveat is always said.
func TestVsock(t *testing.T) {
	c := newConfig(t)
	c.guests = []string{fmt.Sprintf("guest \"vm1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  addresses = [\"10.0.0.1\"]\n  vsock {\n    socket = %q\n    cid = 3\n  }\n}\n",
		c.path("run/vm1.sock"), c.path("run/vm1.vsock"))}
	p := healthy()
	p.Command = func(_ context.Context, name string, args ...string) ([]byte, error) {
		if name == "qemu-system-x86_64" {
			return []byte("name \"vhost-user-vsock-pci\", bus PCI\n"), nil
		}
		return []byte("ct mark set 0x00000001"), nil
	}
	fs := run(t, c, p)
	want(t, fs, "vsock", Warning, "vm1 (cid 3)", "docs/vsock.md")
	want(t, fs, "sockets", OK, "3 of 3 socket paths", "")
	only(t, fs, "vsock")
	p.Command = func(context.Context, string, ...string) ([]byte, error) {
		return []byte("name \"virtio-net-pci\"\n"), nil
	}
	fs = run(t, c, p)
	want(t, fs, "vsock", Problem, "no vhost-user-vsock-pci", "QEMU 7.0")
}

// TestVsockHybridChecks: two Firecracker VMs (hybrid vsock, no control
// socket) are a valid configuration: no control socket at "" is checked
// (it was, and two such VMs were "control socket  is also guest fc1's"),
// and hostd's listeners for the hypervisor are checked with the other
// sockets.
func TestVsockHybridChecks(t *testing.T) {
	c := newConfig(t)
	for i, n := range []string{"fc1", "fc2"} {
		c.guests = append(c.guests, fmt.Sprintf("guest %q {\n  id = %d\n  group = \"a\"\n  addresses = [\"10.0.0.%d\"]\n  vsock {\n    hybrid = %q\n  }\n}\n", n, i+1, i+1, c.path("run/"+n+".vsock")))
	}
	p := healthy()
	p.Command = func(_ context.Context, name string, args ...string) ([]byte, error) {
		return []byte("ct mark set 0x00000001"), nil
	}
	fs := run(t, c, p)
	want(t, fs, "sockets", OK, "5 of 5 socket paths", "")
	want(t, fs, "vsock", OK, "hybrid vsock", "")
}

// TestVsockdChecks: with vsockd_socket, the device socket is
// shunt-vsockd's (not checked as hostd's), hostd's listeners next to it
// are; a daemon that does not answer is a warning with its fix, one that
// answers is said to keep the devices across hostd restarts.
func TestVsockdChecks(t *testing.T) {
	c := newConfig(t)
	ctl := c.path("run/vsockd.sock")
	c.top = []string{fmt.Sprintf("vsockd_socket = %q", ctl)}
	c.guests = []string{fmt.Sprintf("guest \"vm1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  addresses = [\"10.0.0.1\"]\n  vsock {\n    socket = %q\n    cid = 3\n  }\n}\n",
		c.path("run/vm1.sock"), c.path("run/vm1.vsock"))}
	p := healthy()
	p.Command = func(_ context.Context, name string, args ...string) ([]byte, error) {
		if name == "qemu-system-x86_64" {
			return []byte("name \"vhost-user-vsock-pci\", bus PCI\n"), nil
		}
		return []byte("ct mark set 0x00000001"), nil
	}
	fs := run(t, c, p)
	want(t, fs, "sockets", OK, "4 of 4 socket paths", "")
	want(t, fs, "vsock", Warning, "shunt-vsockd does not answer", "systemctl enable --now shunt-vsockd")
	// The test's device socket is outside /run/shunt, which the unit's
	// sandbox leaves the daemon alone.
	want(t, fs, "vsock", Warning, "vm1 ("+c.path("run/vm1.vsock")+") are outside /run/shunt", "ReadWritePaths=/run/shunt /your/dir")
	if err := os.MkdirAll(filepath.Dir(ctl), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unixpacket", ctl)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	fs = run(t, c, p)
	want(t, fs, "vsock", OK, "a hostd restart keeps them", "")
	only(t, fs, "vsock")
}

// TestVsockdPaths: with vsockd_socket, a QEMU device socket outside
// /run/shunt (the unit's only writable directory) is warned about, one
// inside is not, nor a hybrid socket (the hypervisor's).
func TestVsockdPaths(t *testing.T) {
	cfg := &config.Config{VsockdSocket: "/run/shunt/vsockd.sock", Guests: []config.Guest{
		{Name: "in", Vsock: &config.Vsock{Socket: "/run/shunt/in.vsock", CID: 3}},
		{Name: "out", Vsock: &config.Vsock{Socket: "/run/shuntx/out.vsock", CID: 4}},
		{Name: "fc", Vsock: &config.Vsock{Hybrid: "/srv/fc.vsock"}},
	}}
	e := &env{cfg: cfg, check: "vsock"}
	checkVsockdPaths(e)
	if len(e.out) != 1 || !strings.Contains(e.out[0].What, "of out (/run/shuntx/out.vsock) are") {
		t.Fatalf("got %+v, want one warning naming out alone", e.out)
	}
	e.out = nil
	cfg.Guests = cfg.Guests[:1]
	if checkVsockdPaths(e); len(e.out) != 0 {
		t.Fatalf("got %+v for a socket under /run/shunt, want nothing", e.out)
	}
}
