package broker

import (
	"fmt"
	"net/netip"
	"slices"
	"sync/atomic"

	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// Guest is a guest the broker knows: from the configuration or from
// libvirt. Its fields are set before it is registered (New, AddGuest) and
// not changed after; only its addresses may change (SetAddrs).
type Guest struct {
	Name    string
	ID      uint32
	Group   *Group
	CTMark  uint32 // the operator's mark, outside Options.MarkMask; 0: not checked
	Mark    uint32 // hostd's mark id in Options.MarkMask, as its connections carry it (hostd/mark); 0: none
	Ifindex int    // host-side interface, for the eBPF witness; 0: none
	Source  string // where it was declared: "config", "libvirt" or "runtime" (hostd guest add)
	// SharedRegion guests (VMs, whose ivshmem BAR takes no descriptor)
	// have their flows with each other in the group's region. The others
	// get a region per peer (see Broker.UsePairRegions).
	SharedRegion bool
	// PairVM is a SharedRegion guest (a VM) of a trust group with pair
	// regions for VMs (vm_regions = "pair"): its flows with other PairVM
	// guests live in a region of the pair's own, plugged into both VMs
	// (Broker.UseHotplug), and it has no region 0.
	PairVM bool
	// Relay is the relay's guest for a trust group (AddRelay): it owns no
	// address, and its connections are charged to their local guests.
	Relay bool
	// Vsock: a VM whose library carries its flows' stretches over vsock
	// (stretch.go); `hostd flows` says so.
	Vsock bool
	// VsockKept: its vsock device outlives hostd (a hybrid vsock's, the
	// hypervisor's own, or shunt-vsockd's): a SIGKILLed hostd's
	// stretches may return to the rings (adoptstretch.go). QEMU's
	// vhost-user device, served by hostd, does not.
	VsockKept bool

	addrs     atomic.Pointer[Addrs] // what it owns; swapped whole
	migrating bool                  // between MigrateOut and MigrateIn: no READY; guarded by the broker's mutex
	ctl       usage                 // what it holds of the control plane (limits.go)
}

// Addrs is what a guest owns: the prefixes routed to it (single addresses
// are full-length prefixes), except the host's own addresses on its link.
type Addrs struct {
	Prefixes []netip.Prefix
	Except   []netip.Addr
}

// SetAddrs replaces the addresses the guest owns. Safe for concurrent use.
// Once the guest is registered, use Broker.SetAddrs, which refuses
// addresses another guest owns.
func (g *Guest) SetAddrs(a Addrs) { g.addrs.Store(&a) }

// Overlap returns a prefix that both a and o own, if there is one: two
// overlapping prefixes share the longer one, which counts unless it is a
// single address that either side excepts.
func (a *Addrs) Overlap(o *Addrs) (netip.Prefix, bool) {
	if a == nil || o == nil {
		return netip.Prefix{}, false
	}
	for _, p := range a.Prefixes {
		for _, q := range o.Prefixes {
			if !p.Overlaps(q) {
				continue
			}
			both := p
			if q.Bits() > p.Bits() {
				both = q
			}
			if both.IsSingleIP() && (slices.Contains(a.Except, both.Addr()) || slices.Contains(o.Except, both.Addr())) {
				continue
			}
			return both, true
		}
	}
	return netip.Prefix{}, false
}

// CheckOverlaps refuses guests that own an address in common: hostd could
// not tell whose a connection from it is. The error names both guests and
// the prefix.
func CheckOverlaps(gs []*Guest) error {
	for i, g := range gs {
		for _, o := range gs[:i] {
			if err := overlapError(g, g.addrs.Load(), o); err != nil {
				return err
			}
		}
	}
	return nil
}

func overlapError(g *Guest, a *Addrs, o *Guest) error {
	if p, ok := a.Overlap(o.addrs.Load()); ok {
		return fmt.Errorf("guest %s and guest %s both own %s: give each guest its own addresses (routes to its interface, or addresses)", g.Name, o.Name, p)
	}
	return nil
}

// SetAddrs replaces the addresses registered guest g owns, unless another
// guest owns one of them.
func (b *Broker) SetAddrs(g *Guest, a Addrs) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, o := range b.guests {
		if o == g {
			continue
		}
		if err := overlapError(g, &a, o); err != nil {
			return err
		}
	}
	g.SetAddrs(a)
	return nil
}

// Prefixes returns the prefixes the guest owns.
func (g *Guest) Prefixes() []netip.Prefix {
	if a := g.addrs.Load(); a != nil {
		return a.Prefixes
	}
	return nil
}

// Owns reports whether a is one of the guest's addresses.
func (g *Guest) Owns(a netip.Addr) bool {
	as := g.addrs.Load()
	if as == nil {
		return false
	}
	a = a.Unmap()
	for _, x := range as.Except {
		if x == a {
			return false
		}
	}
	for _, p := range as.Prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// Group is a trust group and its region. It is not changed after New,
// except zero, which the broker sets under its mutex.
type Group struct {
	Name   string
	Region string       // path of the group region, for WELCOME
	Pool   *region.Pool // the group region: region 0 of its SharedRegion guests
	Quota  Quota        // each guest's share of ring memory

	zero *Region
}

// AddGuest registers a guest that appeared while hostd runs (a libvirt
// domain that started). Its name and ID must be new, and it must own no
// address another guest owns.
func (b *Broker) AddGuest(g *Guest) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, o := range b.guests {
		if o.Name == g.Name || o.ID == g.ID {
			return fmt.Errorf("guest %s (id %d) clashes with guest %s (id %d)", g.Name, g.ID, o.Name, o.ID)
		}
		if err := overlapError(g, g.addrs.Load(), o); err != nil {
			return err
		}
	}
	b.guests = append(b.guests, g)
	return nil
}

// RemoveGuest forgets a guest that went away (its domain stopped): its
// connections' other ends move to TCP (DOWN(peer-gone)), its side of each
// ring pair counting as left, so the rings go back to the pool once the
// peers left them. Its sessions are
// the control server's to close.
func (b *Broker) RemoveGuest(g *Guest) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, o := range b.guests {
		if o == g {
			b.guests = append(b.guests[:i:i], b.guests[i+1:]...)
			break
		}
	}
	for c := range b.records {
		if c.a.g == g {
			b.endDoneLocked(c, region.SideA, proto.ReasonPeerGone)
		}
		if c.b.g == g {
			b.endDoneLocked(c, region.SideB, proto.ReasonPeerGone)
		}
	}
	for _, f := range b.flows {
		if f.GuestA == g && f.released&region.SideA == 0 {
			b.goneLocked(f, region.SideA)
		}
		if f.GuestB == g && f.released&region.SideB == 0 {
			b.goneLocked(f, region.SideB)
		}
	}
	b.dropPairsOfLocked(g)
}

// dropPairsOfLocked takes the pair regions of g, a guest that went, out
// of use: no new flow goes into them, and each goes at once when its last
// flow is freed (not after a linger: a guest that comes back, or another
// with its id, gets a new region, never one a gone process may still map).
func (b *Broker) dropPairsOfLocked(g *Guest) {
	rg := b.rgLocked()
	for _, r := range rg.byID {
		if r.A != g && r.B != g {
			continue
		}
		key, _, _ := pairKey(r.A, r.B)
		if rg.byPair[key] == r {
			delete(rg.byPair, key)
		}
		if r.flows == 0 {
			if r.linger != nil {
				r.linger.Stop()
				r.linger = nil
			}
			b.dropRegionLocked(r)
		}
	}
}

func (b *Broker) guestByAddr(a netip.Addr) *Guest {
	for _, g := range b.guests {
		if g.Owns(a) {
			return g
		}
	}
	return nil
}

func (b *Broker) guestByID(id uint32) *Guest {
	for _, g := range b.guests {
		if g.ID == id {
			return g
		}
	}
	return nil
}

// sessionState is what the broker keeps per session.
type sessionState struct {
	listens map[netip.AddrPort]bool
	halves  map[*half]bool   // its OPENs waiting for their peer
	conns   map[uint32]*Conn // its ends of connection records, by request id
}

// Attach registers a new session of a guest.
func (b *Broker) Attach(s Session) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.sessions[s] != nil {
		return
	}
	b.sessions[s] = &sessionState{listens: map[netip.AddrPort]bool{}, halves: map[*half]bool{}, conns: map[uint32]*Conn{}}
	s.Guest().ctl.sessions++
}

// Detach removes a session whose guest went away: its listeners and waiting
// opens go, and its connections' other ends move to TCP (DOWN(peer-gone):
// they drain the rings, then read what the kernel reports), its side of
// each ring pair counting as left. A no-op once the broker is closed (hostd stopping
// is not the guest going away).
func (b *Broker) Detach(s Session) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	st := b.sessions[s]
	if st == nil {
		return
	}
	delete(b.sessions, s)
	g := s.Guest()
	g.ctl.sessions--
	for a := range st.listens {
		b.unlistenLocked(g, st, a)
	}
	for h := range st.halves {
		b.unwaitLocked(h)
	}
	for _, c := range st.conns {
		if side := c.sideOf(s, c.a.req); side == region.SideA {
			b.endDoneLocked(c, side, proto.ReasonPeerGone)
		}
		if side := c.sideOf(s, c.b.req); side == region.SideB {
			b.endDoneLocked(c, side, proto.ReasonPeerGone)
		}
	}
	for _, f := range b.flows { // reattached adopted flows (no request id)
		if f.sessA == s {
			b.goneLocked(f, region.SideA)
		}
		if f.sessB == s {
			b.goneLocked(f, region.SideB)
		}
	}
	delete(b.rgLocked().held, s) // regions it kept while they linger
}

// Listen records that s accepts connections on addr (the unspecified
// address means all of the guest's addresses). A LISTEN over the session's
// or the guest's limit is ignored and counted: connections to it stay on
// TCP (no-listener), as if the guest had not announced it. An IPv4
// address in IPv4-mapped form is taken as the IPv4 one.
func (b *Broker) Listen(s Session, addr netip.AddrPort, on bool) {
	addr = netip.AddrPortFrom(addr.Addr().Unmap().WithZone(""), addr.Port())
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.sessions[s]
	if st == nil {
		return
	}
	g := s.Guest()
	switch {
	case !on:
		if st.listens[addr] {
			b.unlistenLocked(g, st, addr)
		}
	case st.listens[addr]:
	case len(st.listens) >= b.opts.Limits.ListensPerSession:
		b.Limited(g, metrics.LimitListens, b.opts.Limits.ListensPerSession)
	case g.ctl.nlistens >= b.opts.Limits.ListensPerGuest:
		b.Limited(g, metrics.LimitListens, b.opts.Limits.ListensPerGuest)
	default:
		st.listens[addr] = true
		if g.ctl.listens == nil {
			g.ctl.listens = map[netip.AddrPort]int{}
		}
		g.ctl.listens[addr]++
		g.ctl.nlistens++
	}
}

func (b *Broker) unlistenLocked(g *Guest, st *sessionState, addr netip.AddrPort) {
	delete(st.listens, addr)
	g.ctl.nlistens--
	if g.ctl.listens[addr]--; g.ctl.listens[addr] <= 0 {
		delete(g.ctl.listens, addr)
	}
}

// listeningLocked reports whether any session of g listens on addr.
func (b *Broker) listeningLocked(g *Guest, addr netip.AddrPort) bool {
	l := g.ctl.listens
	return l[addr] > 0 || l[netip.AddrPortFrom(netip.IPv4Unspecified(), addr.Port())] > 0 ||
		l[netip.AddrPortFrom(netip.IPv6Unspecified(), addr.Port())] > 0
}

func (b *Broker) hasSessionLocked(g *Guest) bool { return g.ctl.sessions > 0 }
