package broker

import (
	"errors"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// ConntrackDestroyed moves the connection whose conntrack entry was
// destroyed (conntrack -D, timeout, flush) to TCP (conntrack-gone): the
// kernel and the firewall decide what becomes of it. It stays on TCP.
func (b *Broker) ConntrackDestroyed(e ctrack.Entry) {
	// A tuple can be reused by a new connection while the old entry is
	// still around (TIME_WAIT); its late DESTROY must not touch the new
	// connection, so entry ids must match when both are known.
	b.mu.Lock()
	c := b.conns[e.Reply]
	b.mu.Unlock()
	if c == nil || c.ctid != 0 && e.ID != 0 && c.ctid != e.ID {
		return
	}
	// Ids alone do not tell them apart: the kernel kills the old entry at
	// the new SYN and may make the new one in the very memory it freed,
	// which gives it the same id (an id hashes the entry's address and
	// tuple). An entry reported destroyed is gone from the table, so one
	// the table still has on the tuple is a newer connection's (the
	// lookup runs without the broker's lock). Whatever its id: with
	// tuples reused within milliseconds the record may already be an
	// older connection's than the entry (TestServerRedisTupleReuse moved
	// 7 of 2,000 when only the same id was ignored). The cost: a live
	// flow whose entry an operator deleted keeps the rings if a packet
	// made the entry again before this lookup (the firewall let that
	// packet through).
	if cur, err := b.ct.Lookup(e.Orig); err == nil {
		b.log.Debug("conntrack DESTROY of an older entry on a reused tuple: ignored", "tuple", e.Orig, "id", e.ID, "current_state", cur.TCPState)
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.conns[e.Reply] != c {
		return
	}
	b.goneFromConntrackLocked(c)
}

// goneFromConntrackLocked: c's entry is gone; any later entry with its
// tuple is another connection's.
func (b *Broker) goneFromConntrackLocked(c *Conn) {
	if !b.downgradeLocked(c, proto.ReasonConntrackGone) && c.path == PathTCP {
		c.reason = proto.ReasonConntrackGone
	}
	c.fw = nil
	if c.indexed && b.conns[c.key] == c {
		delete(b.conns, c.key)
	}
	c.indexed = false
}

// Resync checks the conntrack entry of every connection on the rings and
// moves those whose entry is gone to TCP: after lost events (ENOBUFS) and
// after adoption (which learns the entries' keys here). Lookups run
// without the lock.
func (b *Broker) Resync() {
	b.mu.Lock()
	type check struct {
		c    *Conn
		orig ctrack.Tuple
	}
	var checks []check
	for c := range b.records {
		if c.path == PathRings {
			checks = append(checks, check{c, c.orig})
		}
	}
	b.mu.Unlock()
	for _, k := range checks {
		e, err := b.ct.Lookup(k.orig)
		b.mu.Lock()
		c := k.c
		switch {
		case !b.records[c]:
		case errors.Is(err, ctrack.ErrNotFound):
			b.goneFromConntrackLocked(c)
		case err != nil:
			b.log.Warn("conntrack resync lookup failed", "conn", c.Name(), "error", err)
		case c.key != e.Reply || c.ctid != e.ID:
			if c.indexed && b.conns[c.key] == c {
				delete(b.conns, c.key)
			}
			c.key, c.ctid = e.Reply, e.ID
			if f := c.flow; f != nil {
				f.Key, f.CTID = e.Reply, e.ID
			}
			if old := b.conns[e.Reply]; old != nil && old != c {
				old.indexed = false
			}
			b.conns[e.Reply], c.indexed = c, true
		}
		b.mu.Unlock()
	}
}

// SetPolicy installs a new policy table: the connections on the rings that
// it no longer allows there move to TCP (policy-reload), and those on TCP
// for a reason a reload may change (policy, limits, quota, space, an
// operator's downgrade, a ruleset change whose counters cannot be read)
// move to the rings if it allows them now.
func (b *Broker) SetPolicy(t *policy.Table) (down, up int) {
	b.policy.Store(t)
	b.mu.Lock()
	defer b.mu.Unlock()
	for c := range b.records {
		switch {
		case c.path == PathRings:
			if !t.Decide(policy.Flow{From: c.orig.Src, To: c.to()}).FastPath {
				b.downgradeLocked(c, proto.ReasonPolicyReload)
				down++
			}
		case c.path == PathTCP && retryOnReload[c.reason] && c.flow == nil:
			if c.live() && b.upgradeLocked(c, time.Now()) == proto.ReasonNone {
				up++
			}
		}
	}
	return down, up
}

// Downgrade moves a connection to TCP by its name (as `hostd flows` lists
// it: the record's, or its ring pair's), for an operator (reason admin).
// It stays on TCP until the next policy reload. It reports whether there
// was such a connection on the rings.
func (b *Broker) Downgrade(name string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for c := range b.records {
		if c.Name() == name || c.flow != nil && c.flow.Name() == name {
			return b.downgradeLocked(c, proto.ReasonAdmin)
		}
	}
	return false
}

// Shutdown is a graceful stop: every connection on the rings moves to TCP
// (DOWN(shutdown)) and no new READY goes out; it waits up to wait for the
// ends' LEFTs and reports how many ring pairs are still held then (they
// stay in the regions and the next hostd adopts them). Close follows.
func (b *Broker) Shutdown(wait time.Duration) (held int) {
	b.mu.Lock()
	b.shutting = true
	for c := range b.records {
		b.downgradeLocked(c, proto.ReasonShutdown)
	}
	b.mu.Unlock()
	deadline := time.Now().Add(wait)
	for {
		b.mu.Lock()
		held = 0
		for _, f := range b.flows {
			if f.conn != nil && f.conn.path == PathLeaving {
				held++
			}
		}
		b.mu.Unlock()
		if held == 0 || time.Now().After(deadline) {
			return held
		}
		time.Sleep(10 * time.Millisecond)
	}
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
		b.adoptLocked(b.zeroLocked(g), b.guestByID)
	}
	n := 0
	for _, f := range b.flows {
		if f.Group == g && f.adopted {
			n++
		}
	}
	if n > 0 {
		b.wg.Add(1)
		go func() {
			defer b.wg.Done()
			t := time.NewTimer(grace)
			defer t.Stop()
			select {
			case <-t.C:
				b.graceOver(g)
			case <-b.stop: // Close does not wait out the grace
			}
		}()
	}
	return n
}

// adoptLocked rebuilds the flows of region r from its pool: a slot whose
// owners are not guests of r (its group's, or its pair) is revoked and
// freed. It returns how many flows it adopted.
func (b *Broker) adoptLocked(r *Region, byID func(uint32) *Guest) int {
	n := 0
	for _, s := range r.Pool.Live() {
		ga, gb := byID(s.OwnerA), byID(s.OwnerB)
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
		// Its connection record: no request ids (REATTACH names none) and
		// no key until Resync looks the entry up.
		b.nextConn++
		c := &Conn{id: b.nextConn, orig: f.Orig, a: end{g: ga}, b: end{g: gb}, flow: f, rule: f.Rule,
			created: f.Created, path: PathRings, noReqs: true}
		f.conn, f.state = c, "ready"
		if s.State == region.Revoked {
			f.Revoked = proto.Reason(s.Reason)
			c.path, c.reason, f.state = PathLeaving, f.Revoked, "leaving"
		}
		c.a.done = s.Released&region.SideA != 0
		c.b.done = s.Released&region.SideB != 0
		b.m.Flows.WithLabelValues(f.state, "direct").Inc()
		b.addConnLocked(c)
		b.flows[f.id] = f
		b.flowAddedLocked(f)
		if vm := vsockSide(f); (vm != 0 || vsockPair(f)) && c.path == PathRings {
			b.adoptStretchLocked(c, f, vm) // its room's bridge died with the last hostd
		}
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
	b.adoptGraceOverLocked(func(f *Flow) bool { return f.Group == g })
}

// adoptGraceOverLocked treats the adopted sides of the flows that match and
// did not reattach as gone.
func (b *Broker) adoptGraceOverLocked(match func(*Flow) bool) {
	for _, f := range b.flows {
		if !f.adopted || !match(f) {
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
// guest that owns that side. An unknown flow is answered with DOWN
// (version 3; REVOKE to version 2) so the guest leaves it.
func (b *Broker) Reattach(s Session, m proto.Msg) {
	b.mu.Lock()
	defer b.mu.Unlock()
	g := s.Guest()
	f := b.flowLocked(g, m)
	side := b.flowSideLocked(f, s, m)
	if side == 0 {
		t := proto.Down
		if !switching(s) {
			t = proto.Revoke
		}
		s.Send(proto.Msg{Type: t, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Reason: proto.ReasonPeerGone})
		return
	}
	// The guest kept its mapping of the region across the restart: no
	// REGION again, but from now on its session holds the region.
	sess := &f.sessB
	if side == region.SideA {
		sess = &f.sessA
	}
	if *sess != s {
		b.unholdLocked(*sess, f.Region)
		*sess = s
		b.holdLocked(s, f.Region, false)
	}
	if c := f.conn; c != nil {
		e := c.end(side)
		e.sess, e.done = s, false
		if m.ReqID != 0 { // v3: the request id names the connection from now on (an adopted flow had none)
			e.req = m.ReqID
			if st := b.sessions[s]; st != nil {
				st.conns[m.ReqID] = c
			}
			if c.a.req != 0 && c.b.req != 0 {
				c.noReqs = false // both ends named their requests: it may return to the rings
			}
		}
		if r := f.resume; r != nil && r.adopted {
			b.adoptedReattachedLocked(c, f) // a vsock VM's stretch: RESUME, not DOWN (adoptstretch.go)
		} else if c.path == PathLeaving { // DOWN again: the one before may have been lost with hostd
			if switching(s) {
				s.Send(proto.Msg{Type: proto.Down, ReqID: e.req, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Reason: c.reason})
			} else if f.Revoked != proto.ReasonNone {
				s.Send(proto.Msg{Type: proto.Revoke, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Reason: f.Revoked})
			}
		}
		b.rejoinWaitingLocked(c, side)
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
