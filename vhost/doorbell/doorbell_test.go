//go:build linux

package doorbell_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/shuntnet/shunt/vhost/doorbell"
	"github.com/shuntnet/shunt/vhost/vhosttest"
)

// TestQEMUJoins: two real QEMUs with ivshmem-doorbell devices connect to
// the server; each must accept the greeting (QEMU exits on a malformed
// one), map the shared memory, and be listed as a peer; when one goes, the
// server forgets it.
func TestQEMUJoins(t *testing.T) {
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
		return vhosttest.QEMU(t, "-chardev", "socket,id=db,path="+sock, "-device", "ivshmem-doorbell,chardev=db,vectors=2")
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
	vhosttest.WaitMapped(t, q1, out1, shm.Name())
	vhosttest.WaitMapped(t, q2, out2, shm.Name())
	q1.Process.Kill()
	q1.Wait()
	waitPeers(1)
}
