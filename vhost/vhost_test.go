//go:build linux

package vhost_test

import (
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/vhost"
	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/vhosttest"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// TestQEMUAcceptsAttachment starts a real QEMU (TCG, paused before the
// guest runs) with the generated arguments: QEMU must map the region file
// and connect the control port to our socket, as hostd would see it.
func TestQEMUAcceptsAttachment(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "region")
	r, err := region.Create(path, region.Geometry{Size: 1 << 20, Slots: 8}, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	sock := filepath.Join(dir, "vm1.sock")
	port := vserial.Port{ID: "shunt0", Socket: sock, Ports: 3}
	accepted := make(chan string, port.Count())
	for i := range port.Count() {
		l, err := net.Listen("unix", vserial.SocketOf(sock, i))
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		go func() {
			if c, err := l.Accept(); err == nil {
				c.Close()
				accepted <- l.Addr().String()
			}
		}()
	}
	args, err := vhost.Attachment{
		Region:  ivshmem.Device{ID: "shunt0", Path: path, Size: 1 << 20},
		Control: port,
	}.QEMUArgs()
	if err != nil {
		t.Fatal(err)
	}
	cmd, out := vhosttest.QEMU(t, args...)
	for range port.Count() {
		select {
		case <-accepted:
		case <-time.After(20 * time.Second):
			t.Fatalf("QEMU did not connect all %d control ports in 20s:\n%s", port.Count(), out.String())
		}
	}
	vhosttest.WaitMapped(t, cmd, out, path)
}
