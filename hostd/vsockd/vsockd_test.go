//go:build linux

package vsockd_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"

	"github.com/shuntnet/shunt/hostd/vsockd"
	"github.com/shuntnet/shunt/vhost/vhosttest"
)

// TestDaemonOutlivesClient: hostd names a device, a real QEMU (paused,
// TCG) connects to it and the client hears so; the client goes (hostd
// killed) and a new one names the same device: the daemon keeps it, its
// QEMU still served by the same session; a device hostd no longer names
// is forgotten; QEMU's exit is heard; a daemon that restarts is dialed
// again. (A second controller replaces the first: TestNewestHello.)
func TestDaemonOutlivesClient(t *testing.T) {
	// Registered first, so it runs last: once the daemon and the client
	// closed (and QEMU is gone), none of their goroutines may be left.
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
	dir := t.TempDir()
	ctlPath := filepath.Join(dir, "vsockd.sock")
	d, err := vsockd.Listen(hclog.NewNullLogger(), ctlPath)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { d.Close() }()
	if st, err := os.Stat(ctlPath); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("control socket: %v %v", st, err)
	}
	if _, err := vsockd.Listen(hclog.NewNullLogger(), ctlPath); err == nil {
		t.Fatal("a second daemon took the socket of a running one")
	}
	vm1 := vsockd.Device{Guest: "vm1", ID: 7, Socket: filepath.Join(dir, "vm1.vsock"), CID: 3}
	vm2 := vsockd.Device{Guest: "vm2", ID: 8, Socket: filepath.Join(dir, "vm2.vsock"), CID: 4}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := vsockd.Start(ctx, hclog.NewNullLogger(), ctlPath, []vsockd.Device{vm1, vm2})
	if err != nil {
		t.Fatal(err)
	}
	if c.PID() != os.Getpid() || c.Served(7) {
		t.Fatalf("pid %d served %v: want this process's pid, no QEMU yet", c.PID(), c.Served(7))
	}
	if st, err := os.Stat(vm1.Socket); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("device socket: %v %v", st, err)
	}
	cmd, out := vhosttest.QEMU(t, "-object", "memory-backend-memfd,id=mem,size=64M,share=on", "-numa", "node,memdev=mem",
		"-chardev", "socket,id=vs,path="+vm1.Socket, "-device", "vhost-user-vsock-pci,chardev=vs")
	waitFor(t, "the client hears QEMU served", out.String, func() bool { return c.Served(7) })
	stat := func(c *vsockd.Client, guest string) (s struct {
		ok, conn bool
		sessions uint64
	}) {
		for _, st := range c.Stats() {
			if st.Guest == guest {
				s.ok, s.conn, s.sessions = true, st.Connected, st.Sessions
			}
		}
		return s
	}
	if s := stat(c, "vm1"); !s.ok || !s.conn || s.sessions != 1 {
		t.Fatalf("vm1's stat %+v: want connected, one session", s)
	}

	// hostd goes; the next one names vm1 alone: vm1 kept and served,
	// vm2 forgotten.
	c.Close()
	c, err = vsockd.Start(ctx, hclog.NewNullLogger(), ctlPath, []vsockd.Device{vm1})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { c.Close() }()
	if !c.Served(7) {
		t.Fatal("the device of a running QEMU is not served after the client's restart")
	}
	if s := stat(c, "vm1"); !s.conn || s.sessions != 1 {
		t.Fatalf("vm1 after the client's restart %+v: want the same session", s)
	}
	if s := stat(c, "vm2"); s.ok {
		t.Fatal("vm2, no longer named, still served")
	}
	if _, err := os.Lstat(vm2.Socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("vm2's socket left behind: %v", err)
	}
	cmd.Process.Kill()
	cmd.Wait()
	waitFor(t, "the client hears QEMU gone", out.String, func() bool { return !c.Served(7) })

	// The daemon restarts: the client dials it again and names vm1.
	d.Close()
	waitFor(t, "the client sees the daemon gone", out.String, func() bool { return c.PID() == 0 })
	if d, err = vsockd.Listen(hclog.NewNullLogger(), ctlPath); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the client dials the new daemon", out.String, func() bool { return c.PID() != 0 })
	waitFor(t, "vm1's device made again", out.String, func() bool { _, err := os.Stat(vm1.Socket); return err == nil })
}

// TestControlPeer: the daemon answers nothing to a connection whose
// first message is no hello, nor to a bad message.
func TestControlPeer(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
	ctlPath := filepath.Join(t.TempDir(), "vsockd.sock")
	d, err := vsockd.Listen(hclog.NewNullLogger(), ctlPath)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for _, first := range []string{`{"op":"list"}`, `{"op":"hello","version":0}`, `{"op":"hello","version":1,"x":1}`, `not json`} {
		c, err := net.Dial("unixpacket", ctlPath)
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte(first))
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, err := c.Read(make([]byte, 4096))
		if n != 0 || err == nil || os.IsTimeout(err) {
			t.Errorf("%s: got %d bytes, %v: want the connection closed", first, n, err)
		}
		c.Close()
	}
}

// waitFor polls cond for up to 30 s (a way out, not a timing claim).
func waitFor(t *testing.T, what string, out func() string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30 s; QEMU said:\n%s", what, out())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
