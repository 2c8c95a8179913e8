package vserial_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/vhost/vserial"
)

func TestArgsAndXML(t *testing.T) {
	p := vserial.Port{ID: "shunt0", Socket: "/run/shunt/vm1.sock"}
	args, err := p.QEMUArgs()
	if err != nil {
		t.Fatal(err)
	}
	want := "-chardev socket,id=chr-shunt0,path=/run/shunt/vm1.sock,reconnect=1 -device virtio-serial-pci,id=vser-shunt0 -device virtserialport,bus=vser-shunt0.0,chardev=chr-shunt0,name=org.shunt.ctl"
	if got := strings.Join(args, " "); got != want {
		t.Fatalf("QEMU args\n got %s\nwant %s", got, want)
	}
	x, err := p.LibvirtXML()
	if err != nil || !strings.Contains(x, "path='/run/shunt/vm1.sock'") || !strings.Contains(x, "name='org.shunt.ctl'") {
		t.Fatalf("libvirt XML %v:\n%s", err, x)
	}
	if _, err := (vserial.Port{ID: "x", Socket: "relative.sock"}).QEMUArgs(); err == nil {
		t.Error("a relative socket path was accepted")
	}
}

func TestFindByName(t *testing.T) {
	sysfs, dev := t.TempDir(), t.TempDir()
	for port, name := range map[string]string{"vport0p1": "org.qemu.guest_agent.0", "vport1p1": vserial.Name} {
		dir := filepath.Join(sysfs, "class/virtio-ports", port)
		os.MkdirAll(dir, 0o755)
		os.WriteFile(filepath.Join(dir, "name"), []byte(name+"\n"), 0o644)
	}
	got, err := vserial.Find(sysfs, dev)
	if err != nil || got != filepath.Join(dev, "vport1p1") {
		t.Fatalf("Find = %s, %v; want %s", got, err, filepath.Join(dev, "vport1p1"))
	}
	// With udev, the named link wins.
	os.MkdirAll(filepath.Join(dev, "virtio-ports"), 0o755)
	os.WriteFile(filepath.Join(dev, "virtio-ports", vserial.Name), nil, 0o600)
	if got, _ := vserial.Find(sysfs, dev); got != filepath.Join(dev, "virtio-ports", vserial.Name) {
		t.Fatalf("Find with udev = %s", got)
	}
	if _, err := vserial.Find(t.TempDir(), t.TempDir()); !errors.Is(err, vserial.ErrNotFound) {
		t.Fatalf("Find without the port = %v", err)
	}
}
