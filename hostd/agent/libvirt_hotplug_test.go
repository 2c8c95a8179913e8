package agent

import (
	"context"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/hostd/virt/virttest"
	"github.com/shuntnet/shunt/shm/region"
)

// pairRegion is a VM pair region of guests a and b whose file is path
// (not created: the hotplugs only name it; the descriptor is /dev/null's),
// 1 MiB.
func pairRegion(t *testing.T, path string, a, b *broker.Guest) *broker.Region {
	t.Helper()
	g := region.Geometry{Size: 1 << 20, Slots: 16}
	r, err := region.Format(make([]byte, g.Size), g)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := syscall.Open(os.DevNull, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), path)
	t.Cleanup(func() { f.Close() })
	return &broker.Region{ID: 1, Pool: region.NewPool(r, nil), File: f, A: a, B: b}
}

// TestVMHotplugDispatch: libvirt domains are plugged through libvirt,
// guests of hostd.hcl through QMP; a guest without a way is an error, not
// a plug into the wrong VM.
func TestVMHotplugDispatch(t *testing.T) {
	lv := virttest.New("lv1", "lv2")
	h := &vmHotplug{lv: &lvHotplug{log: hclog.NewNullLogger(), p: lv.Plugger()}}
	g1 := &broker.Guest{Name: "lv1", ID: 1, Source: sourceLibvirt, PairVM: true}
	g2 := &broker.Guest{Name: "lv2", ID: 2, Source: sourceLibvirt, PairVM: true}
	r := pairRegion(t, "/dev/shm/"+virt.PairShmem(1, 2, 1), g1, g2)
	for _, g := range []*broker.Guest{g1, g2} {
		if err := h.Plug(context.Background(), g, r); err != nil {
			t.Fatal(err)
		}
		if d := lv.Devices(g.Name); len(d) != 1 || d[0].Name != virt.PairShmem(1, 2, 1) || d[0].Size != 1<<20 || !strings.HasPrefix(d[0].Alias, "ua-") {
			t.Fatalf("%s's devices %+v: want the pair's <shmem>, 1 MiB, a user alias", g.Name, d)
		}
	}
	if err := h.Unplug(context.Background(), g1, r); err != nil || len(lv.Devices("lv1")) != 0 || len(lv.Devices("lv2")) != 1 {
		t.Fatalf("unplug from lv1: %v; lv1 has %+v, lv2 %+v; want lv1's device gone only", err, lv.Devices("lv1"), lv.Devices("lv2"))
	}
	cfg := &broker.Guest{Name: "vm1", ID: 3, Source: "config", PairVM: true}
	if err := h.Plug(context.Background(), cfg, r); err == nil || !strings.Contains(err.Error(), "no way to plug") {
		t.Fatalf("plug into a configured VM without QMP: %v, want an error", err)
	}
	// A domain that stopped takes its device with it: not an error.
	lv.Stop("lv2")
	if err := h.Unplug(context.Background(), g2, r); err != nil {
		t.Fatalf("unplug from a stopped domain: %v", err)
	}
}

// TestLibvirtPlugReplacesStale: a device of an earlier region of the pair
// (another id, or the same one from an earlier hostd) left in the domain
// goes before the new one comes, so the guest finds only the new one;
// other devices stay; a region file outside /dev/shm cannot back a
// <shmem>.
func TestLibvirtPlugReplacesStale(t *testing.T) {
	lv := virttest.New("lv1")
	h := &lvHotplug{log: hclog.NewNullLogger(), p: lv.Plugger()}
	g := &broker.Guest{Name: "lv1", ID: 1, Source: sourceLibvirt, PairVM: true}
	for _, s := range []virt.Shmem{{Name: virt.PairShmem(1, 1, 9), Alias: "ua-shunt-p9-old", Size: 1 << 20}, {Name: virt.PairShmem(1, 2, 1), Alias: "ua-other-pair", Size: 1 << 20}} {
		if err := lv.Plugger().Attach(context.Background(), "lv1", s); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.Plug(context.Background(), g, pairRegion(t, "/dev/shm/"+virt.PairShmem(1, 1, 1), g, g)); err != nil {
		t.Fatal(err)
	}
	d := lv.Devices("lv1")
	if len(d) != 2 || d[0].Alias != "ua-other-pair" || d[1].Name != virt.PairShmem(1, 1, 1) {
		t.Fatalf("lv1's devices %+v: want the other pair's and the new one", d)
	}
	calls := lv.CallLog()
	if len(calls) != 4 || !strings.HasPrefix(calls[2], "detach lv1 ua-shunt-p9-old") || !strings.HasPrefix(calls[3], "attach lv1") {
		t.Fatalf("calls %q: want the old device detached, then the new one attached", calls)
	}
	err := h.Plug(context.Background(), g, pairRegion(t, "/run/shunt/regions/pair-1-2", g, g))
	if err == nil || !strings.Contains(err.Error(), "/dev/shm") {
		t.Fatalf("plug of a region outside /dev/shm: %v, want an error naming /dev/shm", err)
	}
}

// TestPairRegionPlace: a pair with a libvirt domain in it has its region
// in /dev/shm under hostd's reserved name, for the group's region_group;
// other pairs keep region_dir, root only.
func TestPairRegionPlace(t *testing.T) {
	grp := &broker.Group{Name: "p"}
	p := &pairRegions{dir: "/run/shunt/regions", access: map[string]region.Access{"p": {Gid: 107}}}
	lv1 := &broker.Guest{Name: "lv1", ID: 3, Group: grp, Source: sourceLibvirt}
	lv2 := &broker.Guest{Name: "lv2", ID: 7, Group: grp, Source: sourceLibvirt}
	vm := &broker.Guest{Name: "vm", ID: 9, Group: grp, Source: "config"}
	for _, tc := range []struct {
		a, b       *broker.Guest
		path, name string
		gid        int
	}{
		{lv1, lv2, "/dev/shm/shunt-pair-3-7-p5", "shmpair-3-7-p5", 107},
		{lv2, vm, "/dev/shm/shunt-pair-7-9-p5", "shmpair-7-9-p5", 107},
		{vm, vm, "/run/shunt/regions/pair-9-9-p5", "pair-9-9-p5", -1},
	} {
		path, name, acc := p.place(tc.a, tc.b, 5)
		if path != tc.path || name != tc.name || acc.Gid != tc.gid {
			t.Errorf("place(%s, %s) = %s, %s, gid %d; want %s, %s, gid %d", tc.a.Name, tc.b.Name, path, name, acc.Gid, tc.path, tc.name, tc.gid)
		}
	}
}

// TestGroupOfPairDomain: a domain without a <shmem> joins the trust group
// its metadata names if that group has pair regions, and gets them; one
// naming a group-region group or no known group is refused with the fix.
func TestGroupOfPairDomain(t *testing.T) {
	a := &Agent{cfg: &config.Config{Groups: []config.Group{
		{Name: "t", Region: "/dev/shm/shunt-t", VMRegions: config.VMRegionsGroup},
		{Name: "p", Region: "/dev/shm/shunt-p", VMRegions: config.VMRegionsPair},
	}}, groups: map[string]*broker.Group{"t": {Name: "t"}, "p": {Name: "p"}}, lvhot: &lvHotplug{}}
	for _, tc := range []struct {
		name  string
		d     virt.Domain
		group string
		pair  bool
		err   string
	}{
		{"group region", virt.Domain{Name: "d", Shmem: []string{"shunt-t"}}, "t", false, ""},
		{"group region in a pair group", virt.Domain{Name: "d", Shmem: []string{"shunt-p"}}, "p", false, ""},
		{"pair regions", virt.Domain{Name: "d", Group: "p"}, "p", true, ""},
		{"no shmem, group regions", virt.Domain{Name: "d", Group: "t"}, "", false, "<shmem name='shunt-t'>"},
		{"unknown group", virt.Domain{Name: "d", Group: "x"}, "", false, "does not define"},
		{"foreign shmem", virt.Domain{Name: "d", Shmem: []string{"other"}}, "", false, "name the <shmem> after the region file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, pair, err := a.groupOf(tc.d)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil || g.Name != tc.group || pair != tc.pair {
				t.Fatalf("got %v, pair %v, %v; want group %s, pair %v", g, pair, err, tc.group, tc.pair)
			}
		})
	}
	a.lvhot = nil
	if _, _, err := a.groupOf(virt.Domain{Name: "d", Group: "p"}); err == nil {
		t.Fatal("a pair domain without a libvirt hotplug: want an error")
	}
}

// TestShmPairAccess: a libvirt pair region is adopted for the
// region_group of its libvirt guest's group, whichever of the pair it is.
func TestShmPairAccess(t *testing.T) {
	grp := &broker.Group{Name: "p"}
	a := &Agent{pairs: &pairRegions{access: map[string]region.Access{"p": {Gid: 107}}},
		vguests: map[string]*broker.Guest{"lv": {Name: "lv", ID: 7, Group: grp, Source: sourceLibvirt}}}
	for _, tc := range []struct {
		pair string
		gid  int
	}{{"pair-7-9-p1", 107}, {"pair-3-7-p2", 107}, {"pair-3-9-p1", -1}, {"junk", -1}} {
		if got := a.shmPairAccess(tc.pair); got.Gid != tc.gid {
			t.Errorf("shmPairAccess(%q) = gid %d, want %d", tc.pair, got.Gid, tc.gid)
		}
	}
}
