package across

import (
	"fmt"
	"net/netip"
	"os"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// Resuming the stretches of a SIGKILLed hostd (docs/crosshost.md,
// "A SIGKILLed hostd"). The dead hostd's relay left, in each pair region
// it shared with a local guest, ring pairs that guest still uses: the
// ring the relay wrote says where this host's side ended (orphan.go). The
// new hostd's room adopts such a region with its own relay session for
// the peer and group in the dead one's place (broker.AdoptRelayPair), so
// the guest's REATTACH finds its flow, and keeps each flow as a stretch
// that stopped and waits for the peer's end:
//
//	peer host                          this host (restarted)
//	  stop(its id, flow, At, tuple) -->  matched by tuple, group, peer
//	                               <--   stop(this id, flow, the orphan's Out)
//	  guest: RESUME(Out)                 guest: RESUME(At), or ResumeReset
//	                                     (its ring does not hold At)
//
// The peer resends its pending stops whenever its channel comes up, so
// the first stop after the restart is its. A peer that never answers
// within ResumeTimeout, a broken ring (the guest's memory: every read
// under the fault guard and checked), or a guest that does not reattach
// ends the connection with a reset, as before: never a wrong byte, never
// a wait without a bound.

// orphan is the room's state of an adopted stretch.
type orphan struct {
	bad    bool          // its rings are not a valid stretch: reset, and the peer's stop is answered gone
	answer *peers.Across // the stop this host answered the peer's with (sent again for a repeat)
}

// AdoptOrphans takes a pair region an earlier hostd left whose one guest
// was that run's relay session (broker.IsRelayID). peerOf names the peer
// whose configured prefixes hold an address (hostd.hcl's peer blocks: the
// peer's announcements are not in yet). It reports how many stretches it
// adopted, or false if it keeps nothing: the caller drops the region.
// Call it before Start; the guests' REATTACHes have grace, as in
// broker.Adopt.
func (r *Room) AdoptOrphans(m region.Meta, pool *region.Pool, f *os.File, peerOf func(netip.Addr) (string, bool), grace time.Duration) (int, bool) {
	live := pool.Live()
	if len(live) == 0 {
		return 0, false // a graceful stop's: every connection left it
	}
	local := m.GuestA
	if broker.IsRelayID(local) {
		local = m.GuestB
	}
	g := r.b.GuestByID(local)
	if g == nil || g.Group == nil || g.Relay || broker.IsRelayID(local) {
		r.log.Warn("relay pair region not adopted: its guest is gone or not a guest", "region", m.ID, "guest", local)
		return 0, false
	}
	peer, err := orphanPeer(live, g, peerOf)
	if err != nil {
		r.log.Warn("relay pair region not adopted", "region", m.ID, "error", err)
		return 0, false
	}
	s, err := r.session(peer, g)
	if err != nil {
		r.log.Warn("relay pair region not adopted: no relay session", "region", m.ID, "error", err)
		return 0, false
	}
	flows, ok := r.b.AdoptRelayPair(m, pool, f, s, s.newReq, grace)
	if !ok {
		return 0, false
	}
	// The relay session maps the region as the broker handed it
	// (SendFile, queued): take the flows after that.
	r.post(func() {
		for _, a := range flows {
			r.adoptOrphan(s, g, m.ID, a, peerOf)
		}
	})
	r.log.Info("adopted relayed connections of an earlier hostd", "region", m.ID, "peer", peer, "flows", len(flows))
	return len(flows), true
}

// orphanPeer is the one peer whose configured prefixes hold the other
// end of every live slot of a relay pair region of guest g.
func orphanPeer(live []region.Slot, g *broker.Guest, peerOf func(netip.Addr) (string, bool)) (string, error) {
	peer := ""
	for _, s := range live {
		_, remote, ok := orphanEnds(s, g)
		if !ok {
			return "", fmt.Errorf("slot %d: %s %s is not between guest %s and another host", s.Index, s.Src, s.Dst, g.Name)
		}
		p, ok := peerOf(remote.Addr())
		switch {
		case !ok:
			return "", fmt.Errorf("slot %d: no peer's prefixes hold %s", s.Index, remote)
		case peer != "" && p != peer:
			return "", fmt.Errorf("slot %d: %s is peer %s's, the region's others %s's", s.Index, remote, p, peer)
		}
		peer = p
	}
	return peer, nil
}

// orphanEnds splits a slot's tuple (its conntrack original direction)
// into guest g's end and the other host's.
func orphanEnds(s region.Slot, g *broker.Guest) (local, remote netip.AddrPort, ok bool) {
	src, dst := s.Src.Addr().Unmap(), s.Dst.Addr().Unmap()
	switch {
	case g.Owns(src) && !g.Owns(dst):
		return s.Src, s.Dst, true
	case g.Owns(dst) && !g.Owns(src):
		return s.Dst, s.Src, true
	}
	return netip.AddrPort{}, netip.AddrPort{}, false
}

// adoptOrphan makes the room's record of one adopted stretch: a paired
// connection whose stretch stopped (peer-unreachable) where the ring the
// dead relay wrote ended, waiting for the peer's stop.
func (r *Room) adoptOrphan(s *session, g *broker.Guest, regionID uint32, a broker.AdoptedRelay, peerOf func(netip.Addr) (string, bool)) {
	local, remote, _ := orphanEnds(a.Slot, g)
	wire := ctrack.Tuple{Src: local, Dst: remote}.Unmap()
	if old := r.byWire[wire]; old != nil {
		r.forget(old)
	}
	r.nextID++
	now := time.Now()
	x := &xconn{id: r.nextID, peer: s.peer, wire: wire, active: a.Slot.Src == local, guest: g, at: now,
		offered: true, theirs: true, confirmed: true, paired: true, s: s, req: a.Req, orphan: &orphan{}}
	r.conns[x.id], r.byWire[wire] = x, x
	s.conns[x.req] = x
	e := a.Slot.Entry
	ready := proto.Msg{Type: proto.Ready, ReqID: a.Req, RegionID: regionID, Slot: uint32(a.Slot.Index), Gen: e.Gen, Side: a.Side,
		RingAB: uint64(e.RingAB), RingBA: uint64(e.RingBA), Capacity: uint32(e.Capacity)}
	x.st = &stretch{ready: ready, readyAt: now, stoppedAt: now, down: proto.ReasonPeerUnreachable, orphan: true}
	end, err := readOrphan(s.regionMem(regionID), ready)
	if err != nil {
		r.log.Warn("an adopted relayed connection's rings are broken: it is reset", "conn", x, "error", err)
		x.orphan.bad = true
		return
	}
	x.st.ours, x.st.never = end.Out, !end.Out.Started
	r.log.Debug("adopted a relayed connection", "conn", x, "peer", x.peer, "started", end.Out.Started, "x", end.Out.X)
}

// orphanStop takes a peer's stop that names a connection by its tuple
// (Claim) if it is an adopted stretch's: it reports whether it did.
func (r *Room) orphanStop(peer string, m peers.Across) bool {
	if m.Claim == nil || m.ID == 0 {
		return false
	}
	x := r.byWire[ctrack.Tuple{Src: m.Claim.Dst, Dst: m.Claim.Src}.Unmap()]
	if x == nil || x.orphan == nil || x.peer != peer || x.guest.Group == nil || x.guest.Group.Name != m.Claim.Group {
		return false
	}
	o := x.orphan
	if o.answer != nil {
		if m.ID == x.peerID && m.Flow == o.answer.Flow {
			r.send(peer, *o.answer) // the peer's stop again: ours may have been lost with its channel
			return true
		}
		return false
	}
	st := x.st
	if st == nil || !st.orphan || st.theirs != nil {
		return false
	}
	x.peerID, st.flow = m.ID, m.Flow
	theirs := &peerEnd{at: m.At, never: m.Never, reset: m.Gone}
	if o.bad {
		theirs.reset = true
	} else if !theirs.reset {
		// Where the guest resends from must be in its ring still: read it
		// again (the guest wrote on since the adoption).
		end, err := readOrphan(x.s.regionMem(st.ready.RegionID), st.ready)
		at := m.At
		if m.Never {
			at = end.InStart // it resends its whole stretch
		}
		if err != nil || !end.holds(at) {
			r.log.Warn("an adopted relayed connection cannot resume where the peer's ring ended: it is reset", "conn", x, "at", m.At, "never", m.Never, "error", err)
			theirs.reset = true
		}
	}
	ans := peers.Across{Op: opStop, ID: x.id, Peer: m.ID, Flow: m.Flow, Reason: st.down.String()}
	switch {
	case o.bad:
		ans.Gone = true
	case st.never:
		ans.Never = true
	default:
		ans.At = st.ours.X
	}
	o.answer = &ans
	st.sent = r.send(peer, ans)
	st.theirs = theirs
	r.finish(x)
	return true
}

// orphanReady reports whether an adopted stretch may finish: its guest
// reattached (RESUME reaches it), or it waited ResumeTimeout for that.
// The record then leaves the rings as a downgrade would have (its DOWN to
// the relay session finds the stretch stopped), so that the ring pair,
// once freed, is retried like any other stretch moved off the relay.
func (r *Room) orphanReady(x *xconn) bool {
	if !r.b.AcrossAttached(x.s, x.req) && time.Since(x.st.stoppedAt) < r.opts.ResumeTimeout {
		return false // sweep tries again
	}
	r.b.DowngradeAcross(x.s, x.req, proto.ReasonPeerUnreachable)
	return true
}
