//go:build linux

package vsockhost_test

import (
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/vsockhost"
	"github.com/shuntnet/shunt/vhost/vhosttest"
)

// TestRoom: a real QEMU (paused, TCG) connects to the room's socket and
// negotiates the device; a second front-end is turned away while it is
// served; each device is handed out only by its own guest's id; QEMU's
// exit frees the device for the next one; Close removes the socket.
func TestRoom(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "vm1.vsock")
	if err := os.WriteFile(sock, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := vsockhost.Start(hclog.NewNullLogger(), []vsockhost.Spec{{Guest: "vm1", ID: 7, Socket: sock, CID: 3}}); err == nil {
		t.Fatal("a regular file at the socket's path was replaced")
	}
	os.Remove(sock)
	r, err := vsockhost.Start(hclog.NewNullLogger(), []vsockhost.Spec{{Guest: "vm1", ID: 7, Socket: sock, CID: 3}, {Guest: "vm2", ID: 8, Socket: filepath.Join(dir, "vm2.vsock"), CID: 4}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if st, err := os.Stat(sock); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket: %v %v", st, err)
	}
	if d := r.Device(7); d == nil || d.CID() != 3 {
		t.Fatalf("guest 7's device: %v", d)
	}
	if d := r.Device(8); d == nil || d.CID() != 4 {
		t.Fatalf("guest 8's device: %v", d)
	}
	if r.Device(9) != nil {
		t.Fatal("a device for a guest that has none")
	}
	cmd, out := vhosttest.QEMU(t, "-object", "memory-backend-memfd,id=mem,size=64M,share=on", "-numa", "node,memdev=mem",
		"-chardev", "socket,id=vs,path="+sock, "-device", "vhost-user-vsock-pci,chardev=vs")
	stat := func() vsockhost.Stat {
		for _, s := range r.Stats() {
			if s.Guest == "vm1" {
				return s
			}
		}
		t.Fatal("no stat for vm1")
		return vsockhost.Stat{}
	}
	waitFor(t, "QEMU served", out.String, func() bool { s := stat(); return s.Connected && s.Sessions == 1 })
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil || os.IsTimeout(err) {
		t.Fatalf("a second front-end was not turned away: %d %v", n, err)
	}
	c.Close()
	waitFor(t, "second front-end counted", out.String, func() bool { return stat().Refused == 1 })
	cmd.Process.Kill()
	cmd.Wait()
	waitFor(t, "QEMU gone", out.String, func() bool { return !stat().Connected })
	r.Close()
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Fatalf("socket left behind: %v", err)
	}
}

// waitFor polls cond for up to 30 s (a way out, not a timing claim) and
// fails with what and QEMU's output.
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
