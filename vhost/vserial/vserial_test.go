package vserial_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
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

// fakePorts makes a fake sysfs with a virtio-ports entry per port (entry
// name -> port name) and returns it with an empty fake /dev.
func fakePorts(t *testing.T, ports map[string]string) (sysfs, dev string) {
	t.Helper()
	sysfs, dev = t.TempDir(), t.TempDir()
	for port, name := range ports {
		dir := filepath.Join(sysfs, "class/virtio-ports", port)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "name"), []byte(name+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return sysfs, dev
}

// udevLink makes dev/virtio-ports/name.
func udevLink(t *testing.T, dev, name string) string {
	t.Helper()
	p := filepath.Join(dev, "virtio-ports", name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// The discovery rules (docs/vm.md, "Discovery"), one case each.
func TestFindAll(t *testing.T) {
	t.Run("by name under sysfs, in port order", func(t *testing.T) {
		sysfs, dev := fakePorts(t, map[string]string{"vport1p3": "org.shunt.ctl.2", "vport1p1": vserial.Name, "vport1p2": "org.shunt.ctl.1", "vport0p1": "org.qemu.guest_agent.0"})
		got, err := vserial.FindAll(sysfs, dev)
		want := []string{filepath.Join(dev, "vport1p1"), filepath.Join(dev, "vport1p2"), filepath.Join(dev, "vport1p3")}
		if err != nil || strings.Join(got, " ") != strings.Join(want, " ") {
			t.Fatalf("FindAll = %v, %v; want %v", got, err, want)
		}
	})
	t.Run("index order, not name order", func(t *testing.T) {
		sysfs, dev := fakePorts(t, map[string]string{"vport1p1": "org.shunt.ctl.10", "vport1p2": "org.shunt.ctl.9", "vport1p3": "org.shunt.ctl.1"})
		got, _ := vserial.FindAll(sysfs, dev)
		want := []string{filepath.Join(dev, "vport1p3"), filepath.Join(dev, "vport1p2"), filepath.Join(dev, "vport1p1")}
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Fatalf("FindAll = %v; want %v", got, want)
		}
	})
	t.Run("a udev link wins", func(t *testing.T) {
		sysfs, dev := fakePorts(t, map[string]string{"vport1p1": vserial.Name, "vport1p2": "org.shunt.ctl.1"})
		link := udevLink(t, dev, "org.shunt.ctl.1")
		got, _ := vserial.FindAll(sysfs, dev)
		want := []string{filepath.Join(dev, "vport1p1"), link}
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Fatalf("FindAll = %v; want %v", got, want)
		}
	})
	t.Run("udev links without sysfs", func(t *testing.T) {
		dev := t.TempDir()
		l0, l1 := udevLink(t, dev, vserial.Name), udevLink(t, dev, "org.shunt.ctl.1")
		udevLink(t, dev, "org.shunt.ctl.01")
		udevLink(t, dev, "org.qemu.guest_agent.0")
		got, err := vserial.FindAll(t.TempDir(), dev)
		if err != nil || strings.Join(got, " ") != l0+" "+l1 {
			t.Fatalf("FindAll = %v, %v; want [%s %s]", got, err, l0, l1)
		}
	})
	t.Run("a dangling udev link is not a port", func(t *testing.T) {
		dev := t.TempDir()
		os.MkdirAll(filepath.Join(dev, "virtio-ports"), 0o755)
		os.Symlink("../vport9p9", filepath.Join(dev, "virtio-ports", vserial.Name))
		if got, err := vserial.FindAll(t.TempDir(), dev); !errors.Is(err, vserial.ErrNotFound) {
			t.Fatalf("FindAll = %v, %v; want ErrNotFound", got, err)
		}
	})
	t.Run("other names and unreadable entries are skipped", func(t *testing.T) {
		sysfs, dev := fakePorts(t, map[string]string{"vport0p1": "org.shunt.ctlx", "vport0p2": "org.shunt.ctl.0", "vport0p3": "org.shunt.ctl.x", "vport0p4": vserial.Name})
		os.MkdirAll(filepath.Join(sysfs, "class/virtio-ports", "vport0p5"), 0o755) // no name file
		got, err := vserial.FindAll(sysfs, dev)
		if err != nil || len(got) != 1 || got[0] != filepath.Join(dev, "vport0p4") {
			t.Fatalf("FindAll = %v, %v; want only vport0p4", got, err)
		}
	})
	t.Run("none", func(t *testing.T) {
		sysfs, dev := fakePorts(t, map[string]string{"vport0p1": "org.qemu.guest_agent.0"})
		if got, err := vserial.FindAll(sysfs, dev); !errors.Is(err, vserial.ErrNotFound) {
			t.Fatalf("FindAll = %v, %v; want ErrNotFound", got, err)
		}
	})
}

// Open takes the first port no other process holds: busy ports (EBUSY)
// are skipped, any other failure ends the search.
func TestOpen(t *testing.T) {
	dir := t.TempDir()
	var ports []string
	for _, n := range []string{"p0", "p1", "p2"} {
		p := filepath.Join(dir, n)
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		ports = append(ports, p)
	}
	open := func(t *testing.T, fail map[string]error) (*os.File, error) {
		vserial.SetOpenPort(t, func(path string) (*os.File, error) {
			if err := fail[path]; err != nil {
				return nil, &os.PathError{Op: "open", Path: path, Err: err}
			}
			return os.OpenFile(path, os.O_RDWR, 0)
		})
		return vserial.Open(ports)
	}
	for _, tc := range []struct {
		name    string
		fail    map[string]error
		want    string // the port opened
		wantErr error
	}{
		{"the first", nil, ports[0], nil},
		{"busy ones skipped", map[string]error{ports[0]: syscall.EBUSY, ports[1]: syscall.EBUSY}, ports[2], nil},
		{"all busy", map[string]error{ports[0]: syscall.EBUSY, ports[1]: syscall.EBUSY, ports[2]: syscall.EBUSY}, "", vserial.ErrAllBusy},
		{"another error ends the search", map[string]error{ports[0]: syscall.EBUSY, ports[1]: syscall.EACCES}, "", syscall.EACCES},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := open(t, tc.fail)
			if f != nil {
				defer f.Close()
			}
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || f != nil {
					t.Fatalf("Open = %v, %v; want %v", f, err, tc.wantErr)
				}
				return
			}
			if err != nil || f.Name() != tc.want {
				t.Fatalf("Open = %v, %v; want %s", f, err, tc.want)
			}
		})
	}
	if _, err := vserial.Open(nil); !errors.Is(err, vserial.ErrNotFound) {
		t.Errorf("Open(nil) = %v, want ErrNotFound", err)
	}
}
