package vhost_test

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/vhost"
	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// TestQEMUAcceptsAttachment starts a real QEMU (TCG, paused before the
// guest runs) with the generated arguments: QEMU must map the region file
// and connect the control port to our socket, as hostd would see it.
func TestQEMUAcceptsAttachment(t *testing.T) {
	testenv.NeedTool(t, "qemu-system-x86_64", "qemu-system-x86")
	dir := t.TempDir()
	path := filepath.Join(dir, "region")
	r, err := region.Create(path, region.Geometry{Size: 1 << 20, Slots: 8}, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	sock := filepath.Join(dir, "vm1.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	a := vhost.Attachment{
		Region:  ivshmem.Device{ID: "shunt0", Path: path, Size: 1 << 20},
		Control: vserial.Port{ID: "shunt0", Socket: sock},
	}
	args, err := a.QEMUArgs()
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmd := exec.Command("qemu-system-x86_64", append([]string{"-machine", "pc,accel=tcg", "-m", "64", "-nodefaults",
		"-display", "none", "-monitor", "none", "-serial", "none", "-S"}, args...)...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	select {
	case c := <-accepted:
		c.Close()
	case <-time.After(20 * time.Second):
		t.Fatalf("QEMU did not connect its control port to %s in 20s:\n%s", sock, out.String())
	}
	// The chardev connects while QEMU builds the machine; the region is
	// mapped by then or shortly after.
	deadline := time.Now().Add(10 * time.Second)
	for {
		maps, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/maps")
		if err != nil {
			t.Fatalf("QEMU exited: %v\n%s", err, out.String())
		}
		if strings.Contains(string(maps), path) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("QEMU did not map the region file %s:\n%s", path, out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
