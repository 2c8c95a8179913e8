package broker_test

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/ctrack/cttest"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// vmGroupConfig is two VMs of one trust group with hostd's defaults (no
// region_size, guest_ring_bytes or guest_flows) and a rule giving the
// MPI ports larger rings, as docs/mpi.md shows.
const vmGroupConfig = `
trust_group "vms" {
}
guest "g1" {
  id            = 1
  group         = "vms"
  control       = "/run/shunt/g1.sock"
  addresses     = ["10.0.0.1"]
  shared_region = true
}
guest "g2" {
  id            = 2
  group         = "vms"
  control       = "/run/shunt/g2.sock"
  addresses     = ["10.0.0.2"]
  shared_region = true
}
policy {
  rule "mpi" {
    action    = "fastpath"
    ports     = ["7800-7899"]
    ring_size = "%s"
  }
}
`

// TestRingFloorMPIJob: the leases of a 4-rank MPI job (2 ranks in each of
// two VMs: each rank connects one lease to each rank of the other VM, 4
// flows opened by each guest) in one trust group's region, with hostd's
// default region size and quota, all get rings when a rule asks for
// rings larger than those defaults hold: the flows that find no room for
// the rule's ring (the guest's quarter of the region, or the region
// itself) take the policy's default ring instead of TCP (guest-quota,
// no-space). With 16 MiB rings the region, not the quota, is what runs
// out first for the second VM. Before, each VM's second lease got
// TCP(guest-quota).
func TestRingFloorMPIJob(t *testing.T) {
	for _, ring := range []int{4 << 20, 16 << 20} {
		t.Run(fmt.Sprintf("%dMiB", ring>>20), func(t *testing.T) {
			c, err := config.Parse("hostd.hcl", []byte(fmt.Sprintf(vmGroupConfig, fmt.Sprintf("%dMiB", ring>>20))))
			if err != nil {
				t.Fatal(err)
			}
			cg := c.Groups[0]
			r, _ := shmtest.Region(t, cg.Geometry)
			grp := &broker.Group{Name: cg.Name, Region: "mem", Pool: region.NewPool(r, nil),
				Quota: broker.Quota{RingBytes: cg.Quota.RingBytes, Flows: cg.Quota.Flows}}
			var guests []*broker.Guest
			for _, g := range c.Guests {
				gu := &broker.Guest{Name: g.Name, ID: g.ID, Group: grp, SharedRegion: true}
				gu.SetAddrs(broker.Addrs{Prefixes: []netip.Prefix{netip.PrefixFrom(g.Addresses[0], 32)}})
				guests = append(guests, gu)
			}
			tab, err := policy.Compile(c.Policy)
			if err != nil {
				t.Fatal(err)
			}
			ct, m := &cttest.Table{}, metrics.New()
			b := broker.New(hclog.NewNullLogger(), ct, m, tab, guests, broker.Options{})
			t.Cleanup(b.Close)
			s := []*session{newSession(guests[0]), newSession(guests[1])}
			for i, a := range []string{"10.0.0.1", "10.0.0.2"} {
				b.Attach(s[i])
				for _, port := range []int{7800, 7801} { // two ranks' listeners
					b.Listen(s[i], netip.AddrPortFrom(netip.MustParseAddr(a), uint16(port)), true)
				}
			}
			req, sizes := uint32(1), map[int]int{}
			for from := range 2 {
				to := 1 - from
				for rank := range 2 {
					for peer := range 2 {
						src := fmt.Sprintf("10.0.0.%d:%d", from+1, 40000+rank*10+peer)
						dst := fmt.Sprintf("10.0.0.%d:%d", to+1, 7800+peer)
						ta := ctrack.Tuple{Src: ap(src), Dst: ap(dst)}
						ct.Add(ta, ta.Reverse(), 0)
						b.Open(s[from], open(proto.Active, ta, req))
						b.Open(s[to], open(proto.Passive, ta.Reverse(), req+1))
						req += 2
						ma, mb := s[from].next(t), s[to].next(t)
						if ma.Type != proto.Ready || mb.Type != proto.Ready {
							t.Fatalf("lease %s -> %s (guest %d's lease %d): %v(%s) / %v(%s), want READY: quota %+v, region %d bytes; counts so far %v",
								src, dst, from+1, rank*2+peer+1, ma.Type, ma.Reason, mb.Type, mb.Reason, grp.Quota, cg.Geometry.Size, sizes)
						}
						sizes[int(ma.Capacity)]++
					}
				}
			}
			if sizes[ring] == 0 || sizes[ring]+sizes[policy.DefaultRingSize] != 8 {
				t.Fatalf("ring sizes given %v: want the rule's %d for the first and the default %d for the rest", sizes, ring, policy.DefaultRingSize)
			}
			if got := counter(t, &world{m: m}, "floor"); int(got) != sizes[policy.DefaultRingSize] {
				t.Fatalf("shunt_ring_floor_total %v, want %d", got, sizes[policy.DefaultRingSize])
			}
			t.Logf("ring sizes: %v (quota %d bytes a guest, region %d)", sizes, grp.Quota.RingBytes, cg.Geometry.Size)
		})
	}
}
