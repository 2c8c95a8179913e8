package config_test

import (
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/shm/region"
)

// TestRegionDefaults: the state and pair-region directories, the pair
// regions' geometry and the quota default sensibly: a quarter of the group
// region's bytes and slots per guest, but room for 32 connections of the
// policy's ring_size at least (a server with many clients; issue 21).
func TestRegionDefaults(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte(good))
	if err != nil {
		t.Fatal(err)
	}
	g := c.Groups[0]
	if c.StateDir != "/run/shunt/state" || c.RegionDir != "/run/shunt/regions" {
		t.Fatalf("state_dir %q region_dir %q", c.StateDir, c.RegionDir)
	}
	if g.PairGeometry != (region.Geometry{Size: config.DefaultPairRegionSize, Slots: config.DefaultPairSlots}) {
		t.Fatalf("pair geometry %+v", g.PairGeometry)
	}
	if want := (config.Quota{RingBytes: 32 * region.PairSize(256<<10), Flows: 32}); g.Quota != want {
		t.Fatalf("quota %+v, want %+v (32 flows of 256 KiB rings: more than a quarter of 16 MiB and 64 slots)", g.Quota, want)
	}
	if l, _ := region.LayoutFor(g.PairGeometry); l.HeapSize/region.PairSize(1<<20) < 32 {
		t.Fatalf("a default pair region holds %d flows of 1 MiB rings, want 32", l.HeapSize/region.PairSize(1<<20))
	}
	if c.Guests[0].SharedRegion {
		t.Fatal("a guest shares the group region by default; want pair regions")
	}
	if g.StateName() != "group-tenant" || (config.Group{Name: "a/b c"}).StateName() != "group-a%2Fb%20c" {
		t.Fatalf("state names %q %q", g.StateName(), (config.Group{Name: "a/b c"}).StateName())
	}
}

// TestQuotaChecked: quotas and pair regions too small for one flow of a
// ring size the policy can pick, or guest_flows above max_flows_per_guest,
// are errors at load that say what to change.
func TestQuotaChecked(t *testing.T) {
	set := func(group, policy string) string {
		s := strings.Replace(good, "  slots       = 64\n", "  slots       = 64\n"+group, 1)
		return strings.Replace(s, `  ring_size = "256KiB"`, `  ring_size = "256KiB"`+"\n"+policy, 1)
	}
	for _, tc := range []struct {
		name, src, want string
	}{
		{"quota below a rule's ring", set(`  guest_ring_bytes = "1MiB"`+"\n", `  rule "big" {
    action    = "fastpath"
    ports     = ["5201"]
    ring_size = "1MiB"
  }`), "guest_ring_bytes 1048576 is less than one flow of ring_size 1048576"},
		{"flows above the limit", set("  guest_flows = 100\n", "  max_flows_per_guest = 50"), "guest_flows 100 is more than the policy's max_flows_per_guest 50"},
		{"pair region too small", set(`  pair_region_size = "1MiB"`+"\n", `  rule "big" {
    action    = "fastpath"
    ring_size = "1MiB"
  }`), "pair_region_size 1048576 holds no flow of ring_size 1048576"},
		{"bad size", set(`  guest_ring_bytes = "lots"`+"\n", ""), "guest_ring_bytes"},
		{"relative state_dir", strings.Replace(good, "log_level", "state_dir = \"state\"\nlog_level", 1), `state_dir "state"`},
		{"one dir for both", strings.Replace(good, "log_level", "state_dir = \"/run/x\"\nregion_dir = \"/run/x/\"\nlog_level", 1), "one directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := config.Parse("hostd.hcl", []byte(tc.src))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one with %q", err, tc.want)
			}
		})
	}
	// Explicit values within bounds hold; a lower max_flows_per_guest
	// lowers the default guest_flows.
	c, err := config.Parse("hostd.hcl", []byte(set("  guest_ring_bytes = \"64MiB\"\n  shared_region_unused = 0\n", "")))
	if err == nil {
		t.Fatalf("an unknown attribute was accepted: %+v", c)
	}
	c, err = config.Parse("hostd.hcl", []byte(set("  guest_ring_bytes = \"64MiB\"\n  pair_slots = 8\n", "  max_flows_per_guest = 3")))
	if err != nil {
		t.Fatal(err)
	}
	if q := c.Groups[0].Quota; q.RingBytes != 64<<20 || q.Flows != 3 || c.Groups[0].PairGeometry.Slots != 8 {
		t.Fatalf("quota %+v pair %+v", q, c.Groups[0].PairGeometry)
	}
	src := strings.Replace(good, `  ct_mark   = 2`, "  ct_mark   = 2\n  shared_region = true", 1)
	if c, err = config.Parse("hostd.hcl", []byte(src)); err != nil || !c.Guests[1].SharedRegion {
		t.Fatalf("shared_region: %v, %+v", err, c)
	}
}
