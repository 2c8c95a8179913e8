//go:build linux

package server_test

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/server"
	"github.com/shuntnet/shunt/internal/nsexec"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestPeerInOwnNamespace: a connection from this process is in this
// process's namespace, and in no other.
func TestPeerInOwnNamespace(t *testing.T) {
	own, err := server.NetnsOf("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("unix", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := server.PeerIn(a, own); err != nil {
		t.Errorf("own namespace: %v", err)
	}
	other := own
	other.Ino++
	if err := server.PeerIn(a, other); err == nil || !strings.Contains(err.Error(), "another network namespace") {
		t.Errorf("another namespace: got %v, want a refusal", err)
	}
}

// peerHelper, when set, makes this test binary a guest's process: it
// becomes nobody (after a chroot into an empty directory, in mode
// "chroot"), says HELLO on the control socket (its path, then the
// abstract socket in its namespace, as the libraries do) and prints what
// hostd answered.
const peerHelper = "SHUNT_TEST_PEER_HELPER"

func TestPeerHelper(t *testing.T) {
	arg := os.Getenv(peerHelper)
	if arg == "" {
		t.Skip("a helper process of TestControlSocketNetns")
	}
	mode, path, _ := strings.Cut(arg, ":")
	if mode == "chroot" {
		dir, err := os.MkdirTemp("", "peer-chroot")
		if err != nil {
			t.Fatal(err)
		}
		defer os.Remove(dir)
		if err := syscall.Chroot(dir); err != nil {
			t.Fatal(err)
		}
	}
	if err := syscall.Setgid(65534); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Setuid(65534); err != nil {
		t.Fatal(err)
	}
	c, err := net.DialTimeout("unix", path, wait)
	how := "path"
	if err != nil {
		how = "abstract"
		if c, err = net.DialTimeout("unix", "@"+proto.NetnsControl, wait); err != nil {
			fmt.Printf("RESULT no channel: %v\n", err)
			return
		}
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(wait))
	if err := proto.Write(c, &proto.Msg{Type: proto.Hello, PID: uint32(os.Getpid()), Formats: formats}); err != nil {
		fmt.Printf("RESULT hello: %v\n", err)
		return
	}
	m, _, err := proto.Read(c, nil)
	if err != nil {
		fmt.Printf("RESULT read: %v\n", err)
		return
	}
	fmt.Printf("RESULT %s %s %s\n", how, m.Type, m.Reason)
}

// TestControlSocketNetns: a guest with a network namespace gets a socket
// of mode 0666, and hostd admits a connection by the namespace of the
// process that made it: one of the guest's processes as nobody, by the
// path and after a chroot (by the abstract socket in its namespace), but
// not this process, which is outside, even as root and by the path.
func TestControlSocketNetns(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "ip", "iproute2")
	ns := fmt.Sprintf("shunt-peer-%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	nsPath := "/run/netns/" + ns

	w := newWorld(t)
	dir, err := os.MkdirTemp("", "shunt-peer") // in /tmp: nobody must reach the socket
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "g1-ns.sock")
	if err := w.srv.Add(server.Endpoint{Guest: w.g1, Path: sock, Netns: nsPath}); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o666 {
		t.Errorf("socket mode %v, want 0666 (every process of the guest may connect; hostd checks the namespace)", fi.Mode().Perm())
	}

	// This process is outside the guest's namespace: refused, and told why.
	s := &guest{t: t}
	if s.c, err = net.DialTimeout("unix", sock, wait); err != nil {
		t.Fatal(err)
	}
	defer s.c.Close()
	_ = s.c.SetDeadline(time.Now().Add(wait))
	s.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: formats})
	if m := s.next(); m.Type != proto.Error || m.Reason != proto.ReasonNotGuest || !strings.Contains(m.Text, "another network namespace") {
		t.Errorf("outsider: got %s (%s: %q), want ERROR(not-guest) saying why", m.Type, m.Reason, m.Text)
	}
	if n := w.counter(t, "shunt_control_closed_total", "not-guest"); n != 1 {
		t.Errorf("shunt_control_closed_total{reason=not-guest} = %v, want 1", n)
	}

	for _, tc := range []struct{ mode, want string }{
		{"path", "RESULT path WELCOME"},
		{"chroot", "RESULT abstract WELCOME"},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestPeerHelper$", "-test.v")
		cmd.Env = append(os.Environ(), peerHelper+"="+tc.mode+":"+sock)
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := nsexec.In(nsPath, cmd.Start); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err = <-done:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			err = <-done
		}
		if !strings.Contains(out.String(), tc.want) {
			t.Errorf("guest's process as nobody (%s): %v\n%s\nwant %q", tc.mode, err, out.String(), tc.want)
		}
	}
}
