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
	if err != nil || !strings.Contains(x, "path='/run/shunt/vm1.sock'") || !strings.Contains(x, "name='org.shunt.ctl'") || !strings.Contains(x, "relabel='no'") {
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

func TestSeveralPorts(t *testing.T) {
	p := vserial.Port{ID: "s", Socket: "/run/shunt/vm1.sock", Ports: 2}
	args, err := p.QEMUArgs()
	if err != nil {
		t.Fatal(err)
	}
	want := "-chardev socket,id=chr-s,path=/run/shunt/vm1.sock,reconnect=1 -chardev socket,id=chr-s-1,path=/run/shunt/vm1.sock.1,reconnect=1 " +
		"-device virtio-serial-pci,id=vser-s -device virtserialport,bus=vser-s.0,chardev=chr-s,name=org.shunt.ctl " +
		"-device virtserialport,bus=vser-s.0,chardev=chr-s-1,name=org.shunt.ctl.1"
	if got := strings.Join(args, " "); got != want {
		t.Fatalf("QEMU args\n got %s\nwant %s", got, want)
	}
	x, _ := p.LibvirtXML()
	if strings.Count(x, "<channel ") != 2 || !strings.Contains(x, "path='/run/shunt/vm1.sock.1'") || !strings.Contains(x, "name='org.shunt.ctl.1'") {
		t.Fatalf("libvirt XML:\n%s", x)
	}
	for name, want := range map[string]int{"org.shunt.ctl": 0, "org.shunt.ctl.1": 1, "org.shunt.ctl.12": 12} {
		if i, ok := vserial.IndexOf(name); !ok || i != want {
			t.Errorf("IndexOf(%q) = %d, %v", name, i, ok)
		}
	}
	for _, name := range []string{"org.shunt.ctl.0", "org.shunt.ctl.01", "org.shunt.ctl.x", "org.shunt.ctlx", "org.qemu.guest_agent.0"} {
		if _, ok := vserial.IndexOf(name); ok {
			t.Errorf("IndexOf(%q) accepted", name)
		}
	}
	if _, err := (vserial.Port{ID: "s", Socket: "/x", Ports: 31}).QEMUArgs(); err == nil {
		t.Error("31 ports accepted")
	}
}

func TestFindAllInPortOrder(t *testing.T) {
	sysfs, dev := t.TempDir(), t.TempDir()
	for port, name := range map[string]string{"vport1p3": "org.shunt.ctl.2", "vport1p1": vserial.Name, "vport1p2": "org.shunt.ctl.1", "vport0p1": "org.qemu.guest_agent.0"} {
		dir := filepath.Join(sysfs, "class/virtio-ports", port)
		os.MkdirAll(dir, 0o755)
		os.WriteFile(filepath.Join(dir, "name"), []byte(name+"\n"), 0o644)
	}
	got, err := vserial.FindAll(sysfs, dev)
	want := []string{filepath.Join(dev, "vport1p1"), filepath.Join(dev, "vport1p2"), filepath.Join(dev, "vport1p3")}
	if err != nil || strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("FindAll = %v, %v; want %v", got, err, want)
	}
	if _, err := vserial.FindAll(t.TempDir(), t.TempDir()); !errors.Is(err, vserial.ErrNotFound) {
		t.Fatalf("FindAll without ports = %v", err)
	}
}
