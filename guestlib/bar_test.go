package guestlib

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// TestRegionOnBar: in a VM with pair regions, a REGION without a
// descriptor maps the ivshmem device whose region header names that
// region and this guest (not another pair's device, not a group region's,
// nor one of another size); UNREGION forgets it.
func TestRegionOnBar(t *testing.T) {
	sysfs, dir := t.TempDir(), t.TempDir()
	g := region.Geometry{Size: 1 << 20, Slots: 4}
	dev := func(slot string, id, a, b uint32) string {
		t.Helper()
		r, err := region.Create(filepath.Join(dir, slot), g, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		r.SetName(id, a, b)
		r.Close()
		pci := filepath.Join(sysfs, "bus/pci/devices", slot)
		if err := os.MkdirAll(pci, 0o755); err != nil {
			t.Fatal(err)
		}
		for f, body := range map[string]string{"vendor": "0x1af4\n", "device": "0x1110\n", "enable": "0\n"} {
			if err := os.WriteFile(filepath.Join(pci, f), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Symlink(filepath.Join(dir, slot), filepath.Join(pci, "resource2")); err != nil {
			t.Fatal(err)
		}
		return filepath.Join(pci, "resource2")
	}
	dev("0000:00:03.0", 0, 0, 0)     // a group region's device
	dev("0000:00:04.0", 3, 101, 102) // another pair's, with the same id (a guest may claim anything)
	want := dev("0000:00:05.0", 3, 101, 103)

	c, err := NewClient(Options{Control: filepath.Join(dir, "none.sock")})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.vm = vmRoot{sysfs: sysfs}
	c.guestID = 103
	m := proto.Msg{Type: proto.RegionMsg, RegionID: 3, RegionSize: uint64(g.Size)}
	c.regionOnBar(m)
	c.mu.Lock()
	mp := c.regions[3]
	c.mu.Unlock()
	if mp == nil || mp.r == nil || mp.bar != want {
		t.Fatalf("region 3 mapped from %+v, want %s", mp, want)
	}
	if ids := c.Regions(); len(ids) != 1 || ids[0] != 3 {
		t.Fatalf("Regions() = %v, want [3]", ids)
	}
	c.regionOnBar(m) // again: kept
	c.mu.Lock()
	same := c.regions[3] == mp
	c.mu.Unlock()
	if !same {
		t.Fatal("a second REGION for a region mapped and intact mapped it again")
	}
	c.regionTaken(3)
	if ids := c.Regions(); len(ids) != 0 {
		t.Fatalf("after UNREGION Regions() = %v, want none", ids)
	}
}
