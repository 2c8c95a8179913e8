package broker

import (
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// Live migration of a VM guest (docs/vm.md, "Live migration"):
//
//	MigrateOut(g): every connection of g on the rings gets DOWN(migrating);
//	               none of g's connections gets READY from now on
//	... the VM's ivshmem device is unplugged, the VM moves to another QEMU,
//	    the device is plugged again there, hostd serves g's new control
//	    socket; g's library reconnects and OPENs its connections on TCP
//	    again (same request ids): rejoinLocked gives each record the new
//	    session ...
//	DropVMRegions(g): once RingsHeld(g) is 0, g's VM pair regions go
//	               at once (UNREGION, unplugged from both VMs, the file
//	               dropped), not after their linger: the VM may not
//	               migrate with a device of Shunt's
//	...
//	MigrateIn(g):  g's connections may take the rings again; those whose
//	               both ends have a session move now, the others when
//	               their end's OPEN comes. A pair of VMs gets a fresh
//	               pair region then, plugged as for a first connection
//	               (into the destination QEMU: Hotplug follows the VM).

// GuestNamed returns the registered guest called name, or nil.
func (b *Broker) GuestNamed(name string) *Guest {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, g := range b.guests {
		if g.Name == name {
			return g
		}
	}
	return nil
}

// MigrateOut moves every connection of g on the rings to TCP
// (DOWN(migrating)) and keeps all of g's connections off the rings until
// MigrateIn. It returns how many connections moved; they leave the rings
// as the ends answer (LEFT), which RingsHeld counts.
func (b *Broker) MigrateOut(g *Guest) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	g.migrating = true
	n := 0
	for c := range b.records {
		if (c.a.g == g || c.b.g == g) && b.downgradeLocked(c, proto.ReasonMigrating) {
			n++
		}
	}
	b.log.Info("guest migrating: its connections are kept on TCP", "guest", g.Name, "to_tcp", n)
	return n
}

// RingsHeld returns how many ring pairs g's connections still hold (after
// MigrateOut, until both ends left them): at 0 its region may be unplugged.
func (b *Broker) RingsHeld(g *Guest) (held int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for c := range b.records {
		if (c.a.g == g || c.b.g == g) && c.flow != nil {
			held++
		}
	}
	return held
}

// DropVMRegions drops migrating guest g's VM pair regions that no flow
// uses any more (call it after MigrateOut, once RingsHeld(g) is 0): both
// guests of each get UNREGION, its device goes from both VMs
// (Hotplug.Unplug), then its file, without waiting for PairRegionLinger.
// A region still being plugged goes once its plug ended (call again). It
// returns how many it dropped now, and how many of g's VM pair regions
// are left, there or still being unplugged: at 0 g's VM holds no device
// of Shunt's and may migrate.
func (b *Broker) DropVMRegions(g *Guest) (dropped, left int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	rg := b.rgLocked()
	for _, r := range rg.byID {
		if r.vm == nil || r.A != g && r.B != g {
			continue
		}
		if !r.vm.plugged || r.flows > 0 {
			left++
			continue
		}
		if r.linger != nil {
			r.linger.Stop()
			r.linger = nil
		}
		b.log.Info("pair region dropped: its guest migrates", "region", r.Name(), "guest", g.Name, "a", r.A.Name, "b", r.B.Name)
		b.dropRegionLocked(r)
		dropped++
	}
	for r := range rg.unplugging {
		if r.A == g || r.B == g {
			left++
		}
	}
	return dropped, left
}

// MigrateIn ends g's migration: its connections may take the rings again.
// Those whose ends both have a session move now; it returns how many.
func (b *Broker) MigrateIn(g *Guest) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	g.migrating = false
	n := 0
	for c := range b.records {
		if (c.a.g == g || c.b.g == g) && c.path == PathTCP && c.flow == nil && c.live() &&
			b.upgradeLocked(c, time.Now()) == proto.ReasonNone {
			n++
		}
	}
	b.log.Info("guest migrated in", "guest", g.Name, "to_rings", n)
	return n
}

// rejoinLocked handles an OPEN of session s (request req, its end side)
// for the connection of record c, whose end on that side has no session
// any more (its session ended: a VM's control port reconnected after a
// migration, say; or hostd restarted and adopted the flow, and this end
// OPENs instead of REATTACHing it) while the other end still has one: the
// record takes the new session, and the connection moves to the rings if
// it may (else s is told TCP(reason)). It reports whether the OPEN was
// handled so; otherwise it pairs as usual.
func (b *Broker) rejoinLocked(c *Conn, s Session, req uint32, side uint32) bool {
	if !b.mayRejoinLocked(c, s, side) {
		return false
	}
	e, st, f := c.end(side), b.sessions[s], c.flow
	adoptedUnheld := f != nil && f.adopted && f.released&side == 0 && f.sessionOf(side) == nil
	if adoptedUnheld {
		// After a restart this end OPENs its connection instead of
		// REATTACHing the adopted ring pair: it no longer holds it
		// (it left it while no hostd ran). The other end leaves it
		// too, before this end has a session (no DOWN for a ring pair
		// it does not hold), and once the pair is freed the
		// connection tries the rings again (peer-gone alone would
		// keep it on TCP).
		if b.downgradeLocked(c, proto.ReasonPeerGone) {
			c.retryFreed = true
		}
	}
	e.sess, e.req, e.done = s, req, false
	st.conns[req] = c
	c.noReqs = false // both ends named their requests now
	b.log.Debug("connection rejoined by a new session", "conn", c.Name(), "guest", e.g.Name)
	if adoptedUnheld {
		b.releaseLocked(f, side) // may free the rings: connFlowFreedLocked retries them
		if c.flow == nil && c.path == PathTCP {
			b.tellTCP(s, req, c.reason, false)
		}
		return true
	}
	if c.flow != nil {
		return true // its old rings are not freed yet: READY comes after both LEFTs
	}
	if reason := b.upgradeLocked(c, time.Now()); reason != proto.ReasonNone {
		b.tellTCP(s, req, reason, false)
	}
	return true
}

// mayRejoinLocked reports whether session s may take the end of c on
// side (rejoinLocked).
func (b *Broker) mayRejoinLocked(c *Conn, s Session, side uint32) bool {
	e, o := c.end(side), c.end(otherSide(side))
	if e.g != s.Guest() || e.sess != nil || o.sess == nil || c.noReqs && o.req == 0 {
		return false
	}
	return b.sessions[s] != nil
}

// rejoinWaitingLocked lets the other end's OPEN, if it waits for its peer,
// take its end of c: after a restart it may have come before this end's
// REATTACH of the adopted ring pair, and the peer it waits for never OPENs.
func (b *Broker) rejoinWaitingLocked(c *Conn, side uint32) {
	h := b.waiting[c.key]
	if h == nil || c.ctid == 0 || h.entry.ID != c.ctid {
		return
	}
	hs := uint32(region.SideB)
	if h.role == proto.Active {
		hs = region.SideA
	}
	if hs == side || !b.mayRejoinLocked(c, h.sess, hs) {
		return
	}
	b.unwaitLocked(h)
	b.rejoinLocked(c, h.sess, h.req, hs)
}

func otherSide(side uint32) uint32 {
	if side == region.SideA {
		return region.SideB
	}
	return region.SideA
}
