package broker

import (
	"errors"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// ConntrackDestroyed revokes the flow whose connection's conntrack entry
// was destroyed (conntrack -D, timeout, flush).
func (b *Broker) ConntrackDestroyed(e ctrack.Entry) {
	b.mu.Lock()
	defer b.mu.Unlock()
	// A tuple can be reused by a new connection while the old entry is
	// still around (TIME_WAIT); its late DESTROY must not revoke the new
	// flow, so entry ids must match when both are known.
	if f := b.byKey[e.Reply]; f != nil && (f.CTID == 0 || e.ID == 0 || f.CTID == e.ID) {
		b.revokeLocked(f, proto.ReasonConntrackGone)
	}
}

// Resync checks every live flow's conntrack entry and revokes the flows
// whose entry is gone: after lost events (ENOBUFS) and after adoption.
// Lookups run without the lock.
func (b *Broker) Resync() {
	b.mu.Lock()
	type check struct {
		f    *Flow
		orig ctrack.Tuple
	}
	var checks []check
	for _, f := range b.flows {
		if f.Revoked == proto.ReasonNone {
			checks = append(checks, check{f, f.Orig})
		}
	}
	b.mu.Unlock()
	for _, c := range checks {
		e, err := b.ct.Lookup(c.orig)
		b.mu.Lock()
		switch {
		case errors.Is(err, ctrack.ErrNotFound):
			b.revokeLocked(c.f, proto.ReasonConntrackGone)
		case err != nil:
			b.log.Warn("conntrack resync lookup failed", "flow", c.f.Name(), "error", err)
		case c.f.Key != e.Reply || c.f.CTID != e.ID:
			if c.f.Key != (ctrack.Tuple{}) && b.byKey[c.f.Key] == c.f {
				delete(b.byKey, c.f.Key)
			}
			c.f.Key, c.f.CTID = e.Reply, e.ID
			b.byKey[e.Reply] = c.f
		}
		b.mu.Unlock()
	}
}

// SetPolicy installs a new policy table and revokes the live flows that it
// no longer allows on the fast path.
func (b *Broker) SetPolicy(t *policy.Table) (revoked int) {
	b.policy.Store(t)
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, f := range b.flows {
		if f.Revoked != proto.ReasonNone {
			continue
		}
		to := f.Key.Src // the accepting guest's real address
		if !to.IsValid() {
			to = f.Orig.Dst // adopted, not yet resynced
		}
		if !t.Decide(policy.Flow{From: f.Orig.Src, To: to}).FastPath {
			b.revokeLocked(f, proto.ReasonPolicyReload)
			revoked++
		}
	}
	return revoked
}

// Revoke revokes a flow by name (an operator's command).
func (b *Broker) Revoke(name string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, f := range b.flows {
		if f.Name() == name {
			b.revokeLocked(f, proto.ReasonAdmin)
			return true
		}
	}
	return false
}

// Adopt rebuilds the flows of group g from its region's pool after a hostd
// restart (the pool was adopted from hostd's shadow of the region, never
// from the directory guests can write). The flows keep running; their
// guests have grace to reconnect and REATTACH, after which any side still
// missing counts as gone. Pair regions are adopted with AdoptPair before,
// and their flows get the same grace.
func (b *Broker) Adopt(g *Group, grace time.Duration) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if g.Pool != nil {
		b.adoptLocked(b.zeroLocked(g))
	}
	n := 0
	for _, f := range b.flows {
		if f.Group == g && f.adopted {
			n++
		}
	}
	if n > 0 {
		b.wg.Add(1)
		time.AfterFunc(grace, func() {
			defer b.wg.Done()
			b.graceOver(g)
		})
	}
	return n
}

// adoptLocked rebuilds the flows of region r from its pool: a slot whose
// owners are not guests of r (its group's, or its pair) is revoked and
// freed. It returns how many flows it adopted.
func (b *Broker) adoptLocked(r *Region) int {
	n := 0
	for _, s := range r.Pool.Live() {
		ga, gb := b.guestByID(s.OwnerA), b.guestByID(s.OwnerB)
		ok := ga != nil && gb != nil && ga.Group == r.Group && gb.Group == r.Group
		if r.ID != 0 {
			ok = ok && (ga == r.A || ga == r.B) && (gb == r.A || gb == r.B)
		}
		if !ok {
			b.log.Warn("adopted slot names guests that are not the region's; freeing it", "region", r.Name(), "slot", s.Index)
			_ = r.Pool.Revoke(s.Index, s.Gen, uint32(proto.ReasonInternal))
			_ = r.Pool.Free(s.Index, s.Gen)
			continue
		}
		f := &Flow{
			id: flowID{r.Group.Name, r.ID, s.Index}, Gen: s.Gen, Group: r.Group, Region: r, GuestA: ga, GuestB: gb,
			Orig: ctrack.Tuple{Src: s.Src, Dst: s.Dst}, Capacity: s.Capacity,
			Created: time.Unix(0, s.Created), Rule: "adopted", adopted: true,
			released: s.Released,
		}
		if s.State == region.Revoked {
			f.Revoked = proto.Reason(s.Reason)
			b.m.Flows.WithLabelValues("revoked", "direct").Inc()
		} else {
			b.m.Flows.WithLabelValues("ready", "direct").Inc()
		}
		b.flows[f.id] = f
		b.flowAddedLocked(f)
		n++
	}
	return n
}

// graceOver treats adopted sides that did not reattach as gone.
func (b *Broker) graceOver(g *Group) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	for _, f := range b.flows {
		if f.Group != g || !f.adopted {
			continue
		}
		f.adopted = false
		if f.sessA == nil && f.released&region.SideA == 0 {
			b.goneLocked(f, region.SideA)
		}
		if f.sessB == nil && f.released&region.SideB == 0 {
			b.goneLocked(f, region.SideB)
		}
	}
}

// Reattach handles a REATTACH: after a hostd restart a guest says it still
// holds side m.Side of flow (m.Slot, m.Gen). The session must belong to the
// guest that owns that side. An unknown flow is answered with REVOKE so the
// guest drops it.
func (b *Broker) Reattach(s Session, m proto.Msg) {
	b.mu.Lock()
	defer b.mu.Unlock()
	g := s.Guest()
	f := b.flowLocked(g, m)
	ok := f != nil && (m.Side == proto.SideA && f.GuestA == g && f.released&region.SideA == 0 ||
		m.Side == proto.SideB && f.GuestB == g && f.released&region.SideB == 0)
	if !ok {
		s.Send(proto.Msg{Type: proto.Revoke, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Reason: proto.ReasonPeerGone})
		return
	}
	// The guest kept its mapping of the region across the restart: no
	// REGION again, but from now on its session holds the region.
	sess := &f.sessB
	if m.Side == proto.SideA {
		sess = &f.sessA
	}
	if *sess != s {
		b.unholdLocked(*sess, f.Region)
		*sess = s
		b.holdLocked(s, f.Region, false)
	}
	if f.Revoked != proto.ReasonNone {
		s.Send(proto.Msg{Type: proto.Revoke, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Reason: f.Revoked})
	}
	b.log.Info("flow reattached", "flow", f.Name(), "guest", g.Name, "side", m.Side)
}

// Kick relays a KICK from one side of a flow to the other: a guest whose
// peer is in another VM cannot wake it through shared memory, so it asks
// hostd. Only a side of the flow may kick it.
func (b *Broker) Kick(s Session, m proto.Msg) {
	b.mu.Lock()
	defer b.mu.Unlock()
	f := b.flowLocked(s.Guest(), m)
	if f == nil {
		return
	}
	var to Session
	switch s {
	case f.sessA:
		to = f.sessB
	case f.sessB:
		to = f.sessA
	}
	if to != nil {
		to.Send(proto.Msg{Type: proto.Kick, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Side: m.Side})
	}
}
