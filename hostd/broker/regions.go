package broker

import (
	"fmt"
	"os"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// Region is shared memory that flows live in: a trust group's region
// (ID 0: region 0 of each of its SharedRegion guests, which map it by path),
// or the region of one pair of guests (an ID hostd assigns, unique while
// hostd's state lives): process guests get it as a file descriptor, never
// by path; two PairVM guests as a device plugged into both VMs (Hotplug),
// which they find by the region header naming it. Only hostd's Pool
// decides what is in it.
type Region struct {
	ID    uint32
	Pool  *region.Pool
	Group *Group
	File  *os.File // a pair region's file, to hand to its guests; nil for a group region
	A, B  *Guest   // a pair region's guests, A with the lower id; nil for a group region

	vm *vmPlug // a VM pair region's hot-plug state; nil for others. Guarded by the broker's mutex

	flows  int         // live flows in it; guarded by the broker's mutex
	linger *time.Timer // drops it once it has had no flow for a while; guarded by the broker's mutex

	// Revocation (revoke.go), guarded by the broker's mutex: retired, it
	// takes no new flow and is dropped once its flows are freed or the
	// grace is over.
	retired bool
	grace   *time.Timer
	dropped bool
}

// Name is how logs and listings name the region.
func (r *Region) Name() string {
	if r.ID == 0 {
		return r.Group.Name
	}
	return fmt.Sprintf("%s/p%d", r.Group.Name, r.ID)
}

// PairRegions makes and drops the regions of guest pairs: hostd/agent keeps
// them as files in a root-only directory (region.Files).
type PairRegions interface {
	// Make creates an empty region for guests a and b (a.ID < b.ID, or
	// a == b) that guests will know as id.
	Make(id uint32, a, b *Guest) (*region.Pool, *os.File, error)
	// Drop unmaps and deletes r once no flow uses it.
	Drop(r *Region)
}

// FileSender is a Session that can pass a file descriptor with a message
// (SCM_RIGHTS on a Unix socket): what a process guest needs to get a pair
// region. SendFile queues m with a duplicate of f; the caller keeps f.
type FileSender interface {
	SendFile(m proto.Msg, f *os.File)
}

// regionState is the broker's part of the region model; guarded by the
// broker's mutex.
type regionState struct {
	pairs  PairRegions // nil: every flow lives in its group's region
	nextID uint32
	byPair map[[2]uint32]*Region       // pair regions by their guests' ids
	byID   map[uint32]*Region          // pair regions by id
	held   map[Session]map[*Region]int // flow sides each session holds in each pair region
	usage  map[*Guest]*quotaUse        // what the flows each guest opened take
	// VM pair regions dropped and still being unplugged (unplugLocked):
	// their devices may still be in the VMs.
	unplugging map[*Region]bool
}

// quotaUse is what the flows a guest opened (as side A) hold.
type quotaUse struct {
	ringBytes int64
	flows     int
	atQuota   bool // logged once until it is under its quota again
}

// UsePairRegions makes the broker give each pair of process guests (guests
// without SharedRegion) a region of its own, made by p; call it before the
// broker serves. Without it every flow lives in its trust group's region.
// Ids are handed out above those adopted (AdoptPair).
func (b *Broker) UsePairRegions(p PairRegions) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rgLocked().pairs = p
}

func (b *Broker) rgLocked() *regionState {
	if b.rg.byPair == nil {
		b.rg.byPair = map[[2]uint32]*Region{}
		b.rg.byID = map[uint32]*Region{}
		b.rg.held = map[Session]map[*Region]int{}
		b.rg.usage = map[*Guest]*quotaUse{}
		b.rg.unplugging = map[*Region]bool{}
	}
	return &b.rg
}

// zeroLocked returns group g's region as a Region (ID 0).
func (b *Broker) zeroLocked(g *Group) *Region {
	if g.zero == nil {
		g.zero = &Region{ID: 0, Pool: g.Pool, Group: g}
	}
	return g.zero
}

// usesGroupRegion reports whether g's flows live in its trust group's
// region, which WELCOME names to it as region 0.
func (b *Broker) usesGroupRegion(g *Guest) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.rgLocked().pairs == nil || g.SharedRegion && !b.pairVMLocked(g)
}

// pairVMLocked reports whether g, a VM, gets pair regions by hot-plug and
// so has no region 0.
func (b *Broker) pairVMLocked(g *Guest) bool {
	return g.PairVM && b.hotplug != nil && b.rgLocked().pairs != nil
}

// RegionZero is what WELCOME tells guest g of its region 0: the trust
// group's region file and the region, or "" and nil if g has none (a
// process guest gets a region per peer, by descriptor).
func (b *Broker) RegionZero(g *Guest) (path string, r *region.Region) {
	if !b.usesGroupRegion(g) || g.Group.Pool == nil {
		return "", nil
	}
	return g.Group.Region, g.Group.Pool.Region()
}

func pairKey(a, b *Guest) ([2]uint32, *Guest, *Guest) {
	if b.ID < a.ID {
		a, b = b, a
	}
	return [2]uint32{a.ID, b.ID}, a, b
}

// regionForLocked returns the region a flow from ga to gb lives in: their
// pair region (made now if they have none) or, for SharedRegion guests,
// the group region. A SharedRegion guest and a process guest share no
// region: that flow stays on TCP.
func (b *Broker) regionForLocked(ga, gb *Guest) (*Region, proto.Reason) {
	rg := b.rgLocked()
	if ga.Relay != gb.Relay && (ga.SharedRegion || gb.SharedRegion) {
		return b.relayVMRegionLocked(ga, gb)
	}
	vmPair := ga.SharedRegion && gb.SharedRegion && b.pairVMLocked(ga) && b.pairVMLocked(gb)
	if rg.pairs == nil || ga.SharedRegion && gb.SharedRegion && !b.pairVMLocked(ga) && !b.pairVMLocked(gb) {
		if ga.Group.Pool == nil {
			return nil, proto.ReasonInternal
		}
		return b.zeroLocked(ga.Group), proto.ReasonNone
	}
	if ga.SharedRegion != gb.SharedRegion || ga.SharedRegion && !vmPair {
		b.log.Debug("one side maps only its group region (shared_region), the other only pair regions: stays on TCP", "a", ga.Name, "b", gb.Name)
		return nil, proto.ReasonCrossGroup
	}
	key, lo, hi := pairKey(ga, gb)
	if r := rg.byPair[key]; r != nil && b.regionGoneLocked(r) {
		b.log.Warn("a pair region's memory is gone (a guest truncated it): retired, the pair gets a fresh one", "region", r.Name())
		b.revokeMemoryLocked(r, reasonRetired)
	}
	if r := rg.byPair[key]; r != nil {
		if r.vm != nil && !r.vm.plugged {
			return r, reasonPlugging
		}
		return r, proto.ReasonNone
	}
	id := rg.nextID + 1
	for rg.byID[id] != nil || id == 0 {
		id++
	}
	pool, f, err := rg.pairs.Make(id, lo, hi)
	if err != nil {
		b.log.Error("cannot make the region of a guest pair", "a", lo.Name, "b", hi.Name, "error", err)
		return nil, proto.ReasonInternal
	}
	rg.nextID = id
	r := &Region{ID: id, Pool: pool, Group: ga.Group, File: f, A: lo, B: hi}
	rg.byPair[key], rg.byID[id] = r, r
	b.log.Debug("pair region made", "region", r.Name(), "a", lo.Name, "b", hi.Name)
	if vmPair {
		b.plugLocked(r)
		return r, reasonPlugging
	}
	return r, proto.ReasonNone
}

// relayVMRegionLocked is regionForLocked for a VM's connection across
// hosts (one of ga, gb is the relay's guest, the other a VM): the VM's
// group region, which the VM maps as its BAR and the relay, in hostd's
// process, through hostd's own mapping. No process guest and no other
// group maps it; the group's other VMs do, as for their flows with each
// other (one principal: docs/SECURITY.md). A VM with pair regions has no
// group region, and a region of its own with the relay is not built: TCP.
func (b *Broker) relayVMRegionLocked(ga, gb *Guest) (*Region, proto.Reason) {
	vm := ga
	if ga.Relay {
		vm = gb
	}
	switch {
	case !vm.SharedRegion || b.pairVMLocked(vm):
		return nil, proto.ReasonCrossGroup
	case vm.Group.Pool == nil:
		return nil, proto.ReasonInternal
	}
	return b.zeroLocked(vm.Group), proto.ReasonNone
}

// regionOfLocked resolves the region id a guest's message names: 0 is its
// group region (if it maps it; the relay's guest does: VMs' connections
// across hosts live there), others a pair region it is one of.
func (b *Broker) regionOfLocked(g *Guest, id uint32) *Region {
	rg := b.rgLocked()
	if id == 0 {
		if (rg.pairs != nil && !g.Relay && (!g.SharedRegion || b.pairVMLocked(g))) || g.Group.Pool == nil {
			return nil
		}
		return b.zeroLocked(g.Group)
	}
	r := rg.byID[id]
	if r == nil || (r.A != g && r.B != g) {
		return nil
	}
	return r
}

// canHand reports whether session s can be given region r: a group region
// it has by WELCOME, a VM pair region is plugged into its VM; a process
// pair region takes a descriptor.
func canHand(s Session, r *Region) bool {
	if r.ID == 0 || r.vm != nil {
		return true
	}
	_, ok := s.(FileSender)
	return ok
}

// holdLocked counts one more flow side of session s in region r. The first
// one hands s the region (REGION with its descriptor) unless told that s
// has it already (a REATTACH after a hostd restart: the guest kept its
// mapping). The session writes in order, so the REGION comes before the
// READY that needs it.
func (b *Broker) holdLocked(s Session, r *Region, give bool) {
	if r.ID == 0 || s == nil {
		return
	}
	rg := b.rgLocked()
	h := rg.held[s]
	if h == nil {
		h = map[*Region]int{}
		rg.held[s] = h
	}
	if _, has := h[r]; !has && give {
		m := proto.Msg{Type: proto.RegionMsg, RegionID: r.ID, RegionSize: uint64(r.Pool.Region().Layout().Size)}
		if g := s.Guest(); r.vm != nil || g != nil && g.Vsock {
			// No descriptor: the region is a device plugged into the
			// VM, whose header names it (docs/vm.md, "Pair regions"),
			// or the VM carries its flows over vsock stretches and maps
			// no region (a vsock control channel cannot carry one).
			s.Send(m)
		} else {
			s.(FileSender).SendFile(m, r.File)
		}
	}
	h[r]++
}

// unholdLocked counts one flow side less of session s in region r. The
// session keeps the region while it lingers (dropRegionLocked sends the
// UNREGION); without lingering, a session still attached gets UNREGION
// when none of its flows is left in it.
func (b *Broker) unholdLocked(s Session, r *Region) {
	if r.ID == 0 || s == nil {
		return
	}
	rg := b.rgLocked()
	h := rg.held[s]
	if h[r] == 0 {
		return
	}
	if h[r]--; h[r] > 0 || b.linger() > 0 {
		return
	}
	delete(h, r)
	if len(h) == 0 {
		delete(rg.held, s)
	}
	if b.sessions[s] != nil {
		s.Send(proto.Msg{Type: proto.Unregion, RegionID: r.ID})
	}
}

// flowAddedLocked counts a new (or adopted) flow against its region and
// its opener's quota.
func (b *Broker) flowAddedLocked(f *Flow) {
	if t := f.Region.linger; t != nil {
		t.Stop()
		f.Region.linger = nil
	}
	f.Region.flows++
	u := b.useLocked(f.GuestA)
	u.flows++
	u.ringBytes += region.PairSize(f.Capacity)
}

// flowFreedLocked uncounts a freed flow; a pair region that no flow uses
// any more is dropped (unmapped and deleted: a guest still mapping it sees
// only its own rings, which are reset).
func (b *Broker) flowFreedLocked(f *Flow) {
	u := b.useLocked(f.GuestA)
	u.flows--
	u.ringBytes -= region.PairSize(f.Capacity)
	r := f.Region
	if r.flows--; r.flows > 0 || r.ID == 0 {
		return
	}
	if r.retired {
		b.dropRetiredLocked(r) // no linger: its memory goes now
		return
	}
	b.idleLocked(r)
}

// idleLocked drops pair region r, which no flow uses, after its linger.
func (b *Broker) idleLocked(r *Region) {
	d := b.linger()
	if key, _, _ := pairKey(r.A, r.B); d <= 0 || b.rgLocked().byPair[key] != r { // or one of its guests went (dropPairsOfLocked)
		b.dropRegionLocked(r)
		return
	}
	var t *time.Timer
	t = time.AfterFunc(d, func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		if r.linger == t && r.flows == 0 && !b.closed {
			r.linger = nil
			if b.heldByEpochLocked(r) {
				b.idleLocked(r) // linger again (firewall.go)
				return
			}
			b.dropRegionLocked(r)
		}
	})
	r.linger = t
}

// linger is how long a pair region outlives its last flow (<= 0: not at all).
func (b *Broker) linger() time.Duration {
	if d := b.opts.PairRegionLinger; d != 0 {
		return d
	}
	return DefaultPairRegionLinger
}

func (b *Broker) dropRegionLocked(r *Region) {
	if r.dropped {
		return
	}
	r.dropped = true
	rg := b.rgLocked()
	key, _, _ := pairKey(r.A, r.B)
	if rg.byPair[key] == r {
		delete(rg.byPair, key)
	}
	delete(rg.byID, r.ID)
	if r.vm != nil {
		// A VM pair region: UNREGION first (the guest lets go of its
		// mapping), then the device goes from both VMs, then the file.
		defer b.unplugLocked(r)
	} else if rg.pairs != nil {
		rg.pairs.Drop(r) // before UNREGION: a guest told may look for it gone
	}
	for s, h := range rg.held {
		if _, has := h[r]; has {
			delete(h, r)
			if b.sessions[s] != nil {
				s.Send(proto.Msg{Type: proto.Unregion, RegionID: r.ID})
			}
		}
		if len(h) == 0 {
			delete(rg.held, s)
		}
	}
	b.log.Debug("pair region dropped", "region", r.Name())
}

func (b *Broker) useLocked(g *Guest) *quotaUse {
	rg := b.rgLocked()
	u := rg.usage[g]
	if u == nil {
		u = &quotaUse{}
		rg.usage[g] = u
	}
	return u
}

// overQuotaLocked reports whether a new flow of capacity bytes per
// direction, opened by g, would take g over its group's quota; the first
// refusal of a run is logged.
func (b *Broker) overQuotaLocked(g *Guest, capacity int) bool {
	q, u := g.Group.Quota, b.useLocked(g)
	over := !b.fitsQuotaLocked(g, capacity)
	switch {
	case over && !u.atQuota:
		u.atQuota = true
		b.log.Warn("guest at its quota: its new connections stay on TCP (guest-quota)", "guest", g.Name,
			"flows", u.flows, "quota_flows", q.Flows, "ring_bytes", u.ringBytes, "quota_ring_bytes", q.RingBytes)
	case !over && u.atQuota:
		u.atQuota = false
	}
	return over
}

// Quota is a guest's share of ring memory (hostd.hcl's guest_ring_bytes
// and guest_flows): what the flows it opens may hold over all its regions.
// Zero fields do not limit.
type Quota struct {
	RingBytes int64
	Flows     int
}

// AdoptPair rebuilds, after a hostd restart, the flows of a pair region
// that hostd/agent reopened from its state (region.Files.Adopt): m is what
// its shadow says. It reports false, and keeps nothing, if the region's
// guests are no longer a pair of process guests of one group or it holds
// no live flow: the caller drops it then. The flows' guests have grace to
// reattach, as in Adopt.
func (b *Broker) AdoptPair(m region.Meta, pool *region.Pool, f *os.File) (n int, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.adoptPairLocked(m, pool, f, b.guestByID)
	if r == nil {
		return 0, false
	}
	return r.flows, true
}

// adoptPairLocked is AdoptPair with byID naming the region's guests: the
// region, or nil if it keeps nothing.
func (b *Broker) adoptPairLocked(m region.Meta, pool *region.Pool, f *os.File, byID func(uint32) *Guest) *Region {
	rg := b.rgLocked()
	ga, gb := byID(m.GuestA), byID(m.GuestB)
	switch {
	case rg.pairs == nil || m.ID == 0 || rg.byID[m.ID] != nil:
		b.log.Warn("pair region not adopted: pair regions are off, or its id is taken", "region", m.ID)
		return nil
	case ga == nil || gb == nil || ga.Group != gb.Group || ga.SharedRegion != gb.SharedRegion ||
		ga.SharedRegion && (!b.pairVMLocked(ga) || !b.pairVMLocked(gb)):
		b.log.Warn("pair region not adopted: its guests are gone, in two groups, or use the group region now", "region", m.ID, "guest_a", m.GuestA, "guest_b", m.GuestB)
		return nil
	}
	key, lo, hi := pairKey(ga, gb)
	if rg.byPair[key] != nil {
		b.log.Warn("pair region not adopted: the pair has another", "region", m.ID)
		return nil
	}
	r := &Region{ID: m.ID, Pool: pool, Group: ga.Group, File: f, A: lo, B: hi}
	if ga.SharedRegion {
		// A VM pair region: the earlier hostd plugged it into both VMs,
		// where it still is.
		r.vm = &vmPlug{plugged: true, waiting: map[*Conn]bool{}, epoch: "adopted"}
	}
	if b.adoptLocked(r, byID) == 0 {
		return nil
	}
	rg.byPair[key], rg.byID[m.ID] = r, r
	rg.nextID = max(rg.nextID, m.ID)
	return r
}
