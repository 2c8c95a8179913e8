package ivshmem_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/vhost/ivshmem"
)

func TestArgsAndXML(t *testing.T) {
	d := ivshmem.Device{ID: "shunt0", Path: "/dev/shm/shunt-tenant", Size: 64 << 20}
	args, err := d.QEMUArgs()
	if err != nil {
		t.Fatal(err)
	}
	want := "-object memory-backend-file,id=mem-shunt0,share=on,mem-path=/dev/shm/shunt-tenant,size=67108864 -device ivshmem-plain,id=shunt0,memdev=mem-shunt0"
	if got := strings.Join(args, " "); got != want {
		t.Fatalf("QEMU args\n got %s\nwant %s", got, want)
	}
	x, err := d.LibvirtXML()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(x, "<shmem name='shunt-tenant'>") || !strings.Contains(x, "<size unit='M'>64</size>") || !strings.Contains(x, "ivshmem-plain") {
		t.Fatalf("libvirt XML:\n%s", x)
	}
}

func TestRejects(t *testing.T) {
	for name, d := range map[string]ivshmem.Device{
		"size not a power of two": {ID: "a", Path: "/dev/shm/x", Size: 3 << 20},
		"size too small":          {ID: "a", Path: "/dev/shm/x", Size: 64 << 10},
		"relative path":           {ID: "a", Path: "x", Size: 1 << 20},
		"comma in path":           {ID: "a", Path: "/dev/shm/x,y", Size: 1 << 20},
		"bad id":                  {ID: "a=b", Path: "/dev/shm/x", Size: 1 << 20},
	} {
		if _, err := d.QEMUArgs(); err == nil {
			t.Errorf("%s: QEMUArgs accepted %+v", name, d)
		}
	}
	if _, err := (ivshmem.Device{ID: "a", Path: "/tmp/x", Size: 1 << 20}).LibvirtXML(); err == nil {
		t.Error("LibvirtXML accepted a region outside /dev/shm")
	}
}

// fakeDev makes a PCI device directory in a fake sysfs.
func fakeDev(t *testing.T, sysfs, addr, vendor, device string, bar bool) string {
	dir := filepath.Join(sysfs, "bus/pci/devices", addr)
	os.MkdirAll(dir, 0o755)
	os.WriteFile(filepath.Join(dir, "vendor"), []byte(vendor+"\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "device"), []byte(device+"\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "enable"), []byte("0\n"), 0o644)
	if bar {
		os.WriteFile(filepath.Join(dir, "resource2"), nil, 0o600)
	}
	return dir
}

func TestFindByIDsNotAddress(t *testing.T) {
	sysfs := t.TempDir()
	fakeDev(t, sysfs, "0000:00:02.0", "0x1af4", "0x1000", true) // virtio-net: same vendor, other device
	dir := fakeDev(t, sysfs, "0000:00:05.0", "0x1af4", "0x1110", true)
	bar, err := ivshmem.Find(sysfs)
	if err != nil {
		t.Fatal(err)
	}
	if bar != filepath.Join(dir, "resource2") {
		t.Fatalf("Find = %s, want the ivshmem device's resource2", bar)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "enable")); string(b) != "1" {
		t.Fatalf("the device was not enabled: enable = %q", b)
	}
}

// A device enabled already is left alone: writing "1" again needs root
// and counts one more enable.
func TestFindEnabledAlready(t *testing.T) {
	sysfs := t.TempDir()
	dir := fakeDev(t, sysfs, "0000:00:05.0", "0x1af4", "0x1110", true)
	os.WriteFile(filepath.Join(dir, "enable"), []byte("1\n"), 0o644)
	if _, err := ivshmem.Find(sysfs); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "enable")); string(b) != "1\n" {
		t.Fatalf("enable = %q: written again", b)
	}
}

// The first matching device in address order, and an error that says
// what failed when it has no BAR.
func TestFindFirstAndNoBAR(t *testing.T) {
	sysfs := t.TempDir()
	first := fakeDev(t, sysfs, "0000:00:04.0", "0x1af4", "0x1110", true)
	fakeDev(t, sysfs, "0000:00:06.0", "0x1af4", "0x1110", true)
	if bar, err := ivshmem.Find(sysfs); err != nil || bar != filepath.Join(first, "resource2") {
		t.Fatalf("Find = %s, %v; want %s", bar, err, filepath.Join(first, "resource2"))
	}
	sysfs = t.TempDir()
	fakeDev(t, sysfs, "0000:00:05.0", "0x1af4", "0x1110", false)
	if _, err := ivshmem.Find(sysfs); err == nil || errors.Is(err, ivshmem.ErrNotFound) || !strings.Contains(err.Error(), "BAR2") {
		t.Fatalf("Find without resource2 = %v, want an error naming BAR2", err)
	}
}

func TestFindNone(t *testing.T) {
	sysfs := t.TempDir()
	fakeDev(t, sysfs, "0000:00:02.0", "0x8086", "0x1110", true)
	if _, err := ivshmem.Find(sysfs); !errors.Is(err, ivshmem.ErrNotFound) {
		t.Fatalf("Find without ivshmem = %v, want ErrNotFound", err)
	}
}

// List returns every ivshmem device (a VM with pair regions has one per
// peer), in address order; BAR enables one and names its resource2.
func TestListAndBAR(t *testing.T) {
	sysfs := t.TempDir()
	b := fakeDev(t, sysfs, "0000:00:06.0", "0x1af4", "0x1110", true)
	fakeDev(t, sysfs, "0000:00:02.0", "0x1af4", "0x1000", true)
	a := fakeDev(t, sysfs, "0000:00:05.0", "0x1af4", "0x1110", true)
	devs, err := ivshmem.List(sysfs)
	if err != nil || len(devs) != 2 || devs[0] != a || devs[1] != b {
		t.Fatalf("List = %v, %v; want [%s %s]", devs, err, a, b)
	}
	bar, err := ivshmem.BAR(devs[1])
	if err != nil || bar != filepath.Join(b, "resource2") {
		t.Fatalf("BAR = %s, %v", bar, err)
	}
	if e, _ := os.ReadFile(filepath.Join(b, "enable")); string(e) != "1" {
		t.Fatalf("BAR did not enable the device: enable = %q", e)
	}
}
