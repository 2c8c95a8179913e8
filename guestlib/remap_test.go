package guestlib

import (
	"path/filepath"
	"testing"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// TestRemapRegionZero: a WELCOME after a VM's ivshmem device was
// unplugged and plugged back (its old mapping reads as zeros) maps region
// 0 again; a WELCOME for the region still mapped changes nothing.
func TestRemapRegionZero(t *testing.T) {
	dir := t.TempDir()
	g := region.Geometry{Size: 4 << 20, Slots: 4}
	old, err := region.Create(filepath.Join(dir, "old"), g, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	plugged, err := region.Create(filepath.Join(dir, "bar"), g, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer plugged.Close()
	c, err := NewClient(Options{Control: filepath.Join(dir, "none.sock"), Region: filepath.Join(dir, "bar")})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.region = old
	welcome := proto.Msg{Type: proto.Welcome, RegionSize: uint64(old.Layout().Size), Gen: old.Generation()}

	c.remapRegionZero(welcome)
	if c.region != old {
		t.Fatal("region 0 mapped again while its mapping is intact")
	}
	clear(old.Mem()) // the device went: its BAR reads as zeros
	c.remapRegionZero(welcome)
	if c.region == old || c.region == nil {
		t.Fatal("region 0 not mapped again after its device went")
	}
	if !intact(c.region, welcome) {
		t.Fatal("the new mapping does not show the region WELCOME names")
	}
	c.region.Close()
}
