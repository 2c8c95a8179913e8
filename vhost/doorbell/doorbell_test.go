//go:build linux

package doorbell_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/vhost/doorbell"
)

// TestQEMUJoins: two real QEMUs with ivshmem-doorbell devices connect to
// the server; each must accept the greeting (QEMU exits on a malformed
// one), map the shared memory, and be listed as a peer; when one goes, the
// server forgets it.
func TestQEMUJoins(t *testing.T) {
	testenv.NeedTool(t, "qemu-system-x86_64", "qemu-system-x86")
	dir := t.TempDir()
	shm, err := os.Create(filepath.Join(dir, "region"))
	if err != nil {
		t.Fatal(err)
	}
	defer shm.Close()
	shm.Truncate(1 << 20)
	sock := filepath.Join(dir, "doorbell.sock")
	s, err := doorbell.Listen(sock, shm, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	start := func() (*exec.Cmd, *bytes.Buffer) {
		var out bytes.Buffer
		cmd := exec.Command("qemu-system-x86_64", "-machine", "pc,accel=tcg", "-m", "64", "-nodefaults",
			"-display", "none", "-monitor", "none", "-serial", "none", "-S",
			"-chardev", "socket,id=db,path="+sock, "-device", "ivshmem-doorbell,chardev=db,vectors=2")
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd, &out
	}
	waitPeers := func(n int) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for len(s.Peers()) != n {
			if time.Now().After(deadline) {
				t.Fatalf("server lists %d peers, want %d", len(s.Peers()), n)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	q1, out1 := start()
	waitPeers(1)
	q2, out2 := start()
	waitPeers(2)
	for _, q := range []struct {
		cmd *exec.Cmd
		out *bytes.Buffer
	}{{q1, out1}, {q2, out2}} {
		deadline := time.Now().Add(10 * time.Second)
		for {
			maps, err := os.ReadFile("/proc/" + strconv.Itoa(q.cmd.Process.Pid) + "/maps")
			if err != nil {
				t.Fatalf("QEMU exited after the greeting: %v\n%s", err, q.out.String())
			}
			if strings.Contains(string(maps), shm.Name()) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("QEMU did not map the shared memory:\n%s", q.out.String())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	q1.Process.Kill()
	q1.Wait()
	waitPeers(1)
}
