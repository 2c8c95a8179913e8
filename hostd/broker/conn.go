package broker

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// Path is where a connection's bytes go.
type Path uint8

const (
	PathTCP     Path = iota // on kernel TCP, for Conn.reason
	PathRings               // on its ring pair
	PathLeaving             // DOWN sent; its ring pair is freed once both ends left it
)

func (p Path) String() string {
	switch p {
	case PathRings:
		return "rings"
	case PathLeaving:
		return "leaving"
	}
	return "tcp"
}

// Switcher is implemented by sessions that know what their guest library
// speaks. Switching reports whether it speaks protocol version 3 with a
// ring format hostd shares (path switching); a session that does not gets
// TCP(version) for every OPEN. Sessions without the method switch.
type Switcher interface {
	Switching() bool
}

// Resumer is implemented by sessions that know whether their guest
// library handles RESUME (it announced proto.CapResume in HELLO): only
// such a guest may be offered a cross-host (relayed) connection on its
// rings (docs/crosshost.md). A session without the method does not.
type Resumer interface {
	Resumes() bool
}

func switching(s Session) bool {
	sw, ok := s.(Switcher)
	return !ok || sw.Switching()
}

// end is one end of a connection: its guest, its session (nil once it
// closed or is gone) and the request id that names the connection there
// (unknown for a flow adopted after a restart: REATTACH names none).
type end struct {
	g    *Guest
	sess Session
	req  uint32
	done bool // closed or gone: its side counts as left
}

// Conn is hostd's record of one paired connection (both OPENs verified
// against the same conntrack entry), kept until both ends closed or are
// gone, so that hostd can move it between the rings and TCP any number of
// times. Its fields are guarded by the broker's mutex.
//
//	tcp(reason) --upgrade--> rings --DOWN--> leaving --both LEFT--> tcp(reason)
//
// It never gets READY while a ring pair of it is not freed.
type Conn struct {
	id       uint64
	key      ctrack.Tuple // conntrack reply tuple; zero for an adopted one until Resync
	ctid     uint32       // conntrack entry id (0: unknown)
	orig     ctrack.Tuple // A's view
	a, b     end
	path     Path
	reason   proto.Reason // why it is on TCP or leaving
	flow     *Flow        // its ring pair while on the rings or leaving them
	switches int
	rule     string // the policy rule that last decided it (rings, or tcp(policy))
	created  time.Time
	ringAB   uint64 // bytes its freed ring pairs carried, per direction
	ringBA   uint64 //
	// bogusCounts: a ring count its guests wrote was implausible and
	// dropped (ringAB/BA are guest-reported: info.go).
	bogusCounts bool
	fw          *fwWait    // it waits on TCP for proof of passage (firewall.go)
	pf          leaseProof // its proof of passage past the firewall
	fwRegion    *Region    // the pair region an epoch moved it off; it lingers while c waits (firewall.go)
	indexed     bool       // in Broker.conns
	noReqs      bool       // adopted after a restart: its ends' request ids are unknown until they OPEN again
	retryFreed  bool       // its ring pair's free retries the rings whatever its reason (rejoinLocked)
}

// Name names the record in listings and for `hostd downgrade`.
func (c *Conn) Name() string { return fmt.Sprintf("c%d", c.id) }

func (c *Conn) end(side uint32) *end {
	if side == region.SideA {
		return &c.a
	}
	return &c.b
}

// live reports whether both ends have a session that can switch.
func (c *Conn) live() bool {
	return c.a.sess != nil && c.b.sess != nil && switching(c.a.sess) && switching(c.b.sess)
}

// newConnLocked records the connection that a and p (verified, same
// entry) are the two ends of. A record still indexed under the same key
// is an older connection's whose tuple was reused: it keeps living for
// its ends, but conntrack events no longer reach it.
func (b *Broker) newConnLocked(a, p *half) *Conn {
	b.nextConn++
	c := &Conn{id: b.nextConn, key: a.entry.Reply, ctid: a.entry.ID, orig: a.entry.Orig,
		a: end{g: a.sess.Guest(), sess: a.sess, req: a.req}, b: end{g: p.sess.Guest(), sess: p.sess, req: p.req},
		created: time.Now(), reason: proto.ReasonNone}
	b.addConnLocked(c)
	return c
}

// reannouncedLocked: both ends OPENed a connection hostd has a record of
// (same entry, same guests): after a hostd restart, the ends of a flow it
// adopted (whose record has no request ids), or ends whose sessions
// reconnected. The record takes the new sessions and request ids; on TCP,
// it moves to the rings if it may.
func (b *Broker) reannouncedLocked(c *Conn, a, p *half) {
	for _, x := range []struct {
		e *end
		h *half
	}{{&c.a, a}, {&c.b, p}} {
		if st := b.sessions[x.e.sess]; st != nil && !c.noReqs && st.conns[x.e.req] == c {
			delete(st.conns, x.e.req)
		}
		x.e.sess, x.e.req, x.e.done = x.h.sess, x.h.req, false
		if st := b.sessions[x.h.sess]; st != nil {
			st.conns[x.h.req] = c
		}
	}
	c.noReqs = false
	if c.flow != nil {
		return // its rings are not freed yet: READY comes after both LEFTs
	}
	if reason := b.upgradeLocked(c, time.Now()); reason != proto.ReasonNone {
		b.tellTCP(a.sess, a.req, reason, false)
		b.tellTCP(p.sess, p.req, reason, false)
	}
}

// addConnLocked indexes c by its key and by its ends' requests, and counts it.
func (b *Broker) addConnLocked(c *Conn) {
	if c.key != (ctrack.Tuple{}) {
		if old := b.conns[c.key]; old != nil && old != c {
			old.indexed = false
		}
		b.conns[c.key], c.indexed = c, true
	}
	b.records[c] = true
	for _, e := range []*end{&c.a, &c.b} {
		if st := b.sessions[e.sess]; st != nil && !c.noReqs {
			st.conns[e.req] = c
		}
	}
	b.m.Conns.WithLabelValues(c.path.String()).Inc()
}

// forgetLocked drops c: both ends closed or are gone and its rings are freed.
func (b *Broker) forgetLocked(c *Conn) {
	if !b.records[c] {
		return
	}
	delete(b.records, c)
	if c.indexed && b.conns[c.key] == c {
		delete(b.conns, c.key)
	}
	b.m.Conns.WithLabelValues(c.path.String()).Dec()
}

func (b *Broker) setPathLocked(c *Conn, p Path, reason proto.Reason) {
	if b.records[c] && c.path != p {
		b.m.Conns.WithLabelValues(c.path.String()).Dec()
		b.m.Conns.WithLabelValues(p.String()).Inc()
	}
	c.path, c.reason = p, reason
}

// upgradeLocked gives c a fresh ring pair and sends READY to both ends, if
// everything allows it now: both ends switch, no ring pair of it is left,
// no firewall wait, policy, limits, quota, region space. Otherwise c stays
// on TCP with the reason, which it returns; the caller tells the ends if
// it must (at setup).
func (b *Broker) upgradeLocked(c *Conn, start time.Time) proto.Reason {
	reason := b.mayUpgradeLocked(c)
	if reason != proto.ReasonNone {
		b.setPathLocked(c, PathTCP, reason)
		return reason
	}
	was := c.reason
	if was == reasonPlugging {
		was = proto.ReasonNone // a first switch, after the region's plug
	}
	ga, gb := c.a.g, c.b.g
	v := b.policy.Load().Decide(policy.Flow{From: c.orig.Src, To: c.to()})
	r, reason := b.regionForLocked(ga, gb)
	if reason == reasonPlugging {
		// READY follows once the region is in both VMs (pluggedLocked);
		// the connection runs on TCP meanwhile.
		r.vm.waiting[c] = true
		b.setPathLocked(c, PathTCP, reason)
		return reason
	}
	if reason == proto.ReasonNone && (!canHand(c.a.sess, r) || !canHand(c.b.sess, r)) {
		b.log.Warn("a session cannot take a region's descriptor", "a", ga.Name, "b", gb.Name)
		reason = proto.ReasonInternal
	}
	if reason != proto.ReasonNone {
		if r != nil && r.flows == 0 && r.ID != 0 {
			b.dropRegionLocked(r)
		}
		b.setPathLocked(c, PathTCP, reason)
		return reason
	}
	slot, e, err := b.allocRingsLocked(r, c, ga, gb, v)
	if err != nil {
		reason := proto.ReasonNoSpace
		if !errors.Is(err, region.ErrFull) {
			reason = proto.ReasonInternal
		}
		b.log.Warn("cannot allocate a ring pair", "region", r.Name(), "error", err)
		if r.flows == 0 && r.ID != 0 {
			b.dropRegionLocked(r)
		}
		b.setPathLocked(c, PathTCP, reason)
		return reason
	}
	f := &Flow{
		id: flowID{r.Group.Name, r.ID, slot}, Gen: e.Gen, Group: r.Group, Region: r, GuestA: ga, GuestB: gb,
		sessA: c.a.sess, sessB: c.b.sess, Orig: c.orig, Key: c.key, CTID: c.ctid,
		Capacity: e.Capacity, Created: time.Now(), Rule: v.Rule, conn: c, state: "ready",
	}
	b.flows[f.id] = f
	b.flowAddedLocked(f)
	b.holdLocked(c.a.sess, r, true)
	b.holdLocked(c.b.sess, r, true)
	c.flow, c.rule = f, v.Rule
	b.setPathLocked(c, PathRings, proto.ReasonNone)
	if b.proofOn() { // the sweep clears its bits at once, then wants them back (firewall.go)
		c.pf.clearedAt, c.pf.sweptAt = time.Time{}, time.Time{}
		b.pollLocked()
	}
	ready := proto.Msg{Type: proto.Ready, RegionID: r.ID, Slot: uint32(slot), Gen: e.Gen, Capacity: uint32(e.Capacity),
		RingAB: uint64(e.RingAB), RingBA: uint64(e.RingBA)}
	bridged := bridgedPair(c, f) // both ends' bridges copy bytes, as a relay's (stretchpair.go)
	ready.ReqID, ready.Side, ready.Relayed = c.a.req, proto.SideA, isRelay(c.b.sess) || bridged
	c.a.sess.Send(ready)
	ready.ReqID, ready.Side, ready.Relayed = c.b.req, proto.SideB, isRelay(c.a.sess) || bridged
	c.b.sess.Send(ready)
	b.m.Flows.WithLabelValues("ready", "direct").Inc()
	b.switchedLocked(c, "rings", was)
	if c.switches == 1 {
		b.m.Setup.Observe(time.Since(start).Seconds())
		b.log.Debug("fast path", "conn", c.Name(), "flow", f.Name(), "a", ga.Name, "b", gb.Name, "tuple", c.orig, "ring", e.Capacity, "rule", v.Rule, "setup", time.Since(start))
	}
	return proto.ReasonNone
}

// mayUpgradeLocked is what upgradeLocked checks before touching a region.
func (b *Broker) mayUpgradeLocked(c *Conn) proto.Reason {
	ga, gb := c.a.g, c.b.g
	switch {
	case b.shutting:
		return proto.ReasonShutdown
	case c.flow != nil:
		return c.reason // never READY while a ring pair of it is not freed
	case c.a.g.migrating || c.b.g.migrating:
		return proto.ReasonMigrating
	case c.a.sess == nil || c.b.sess == nil:
		return proto.ReasonPeerGone
	case c.noReqs:
		// adopted after a restart: READY needs the request ids that only
		// the ends' OPENs bring (reannouncedLocked)
		if c.reason != proto.ReasonNone {
			return c.reason
		}
		return proto.ReasonInternal
	case !switching(c.a.sess) || !switching(c.b.sess):
		return proto.ReasonVersion
	case b.vsockDownLocked(ga) || b.vsockDownLocked(gb):
		return proto.ReasonVsockDown
	case c.fw != nil:
		return proto.ReasonFirewall
	case !b.provenLocked(c, time.Now()):
		b.waitProofLocked(c)
		return proto.ReasonFirewall
	}
	if r := gated(c.a.sess, c.b.sess); r != proto.ReasonNone {
		return r // a relay whose link is down (across.go)
	}
	v := b.policy.Load().Decide(policy.Flow{From: c.orig.Src, To: c.to()})
	if !v.FastPath {
		c.rule = v.Rule // `hostd flows` names the rule that keeps it on TCP
		return v.Reason
	}
	limit := b.policy.Load().MaxFlowsPerGuest()
	if !ga.Relay && b.flowsOfLocked(ga) >= limit || !gb.Relay && b.flowsOfLocked(gb) >= limit {
		return proto.ReasonGuestLimit
	}
	// The quota is the connecting guest's: what it opens is what it is
	// charged for, so no guest can use up another's by connecting to it.
	// (The smallest ring the verdict allows: ringsize.go.) A connection
	// from a peer host's guest is charged to the local one.
	charged := ga
	if ga.Relay {
		charged = gb
	}
	if b.overQuotaLocked(charged, ringFloor(v)) {
		return proto.ReasonGuestQuota
	}
	return proto.ReasonNone
}

// to is the accepting guest's real address (the entry's reply source).
func (c *Conn) to() netip.AddrPort {
	if c.key.Src.IsValid() {
		return c.key.Src
	}
	return c.orig.Dst // adopted, not yet resynced
}

// downgradeLocked moves c from the rings to TCP: DOWN to both ends (for
// reason), which each answer with LEFT once they left the rings; the ring
// pair is freed when both left, closed or are gone. It reports whether c
// was on the rings.
func (b *Broker) downgradeLocked(c *Conn, reason proto.Reason) bool {
	f := b.leaveRingsLocked(c, reason)
	if f == nil {
		return false
	}
	if revokesMemory[reason] {
		b.revokeMemoryLocked(f.Region, reason)
	}
	return true
}

// leaveRingsLocked is downgradeLocked without taking the memory away: the
// ring pair it moves c off, or nil if c was not on the rings.
func (b *Broker) leaveRingsLocked(c *Conn, reason proto.Reason) *Flow {
	if c.path != PathRings {
		return nil
	}
	f := c.flow
	b.setPathLocked(c, PathLeaving, reason)
	b.switchedLocked(c, "tcp", reason)
	b.m.Flows.WithLabelValues(f.state, "direct").Dec()
	f.state = "leaving"
	b.m.Flows.WithLabelValues(f.state, "direct").Inc()
	if b.stretchResumeLocked(c, f, reason) {
		return f // RESUME to both ends, once the bridges stopped (stretch.go)
	}
	down := proto.Msg{Type: proto.Down, RegionID: f.Region.ID, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: reason}
	legacy := false
	for _, side := range []uint32{region.SideA, region.SideB} {
		e := c.end(side)
		if e.sess == nil || f.released&side != 0 {
			continue
		}
		if !switching(e.sess) {
			legacy = true // a flow adopted from an older hostd: reset, as then
			continue
		}
		if o := c.end(otherSide(side)); o.sess != nil && isRelay(o.sess) {
			continue // its relay sends RESUME once the peer host said where (across.go)
		}
		if deferPeerGoneLocked(f, reason) {
			continue // at the vsock stretch's release (stretch.go)
		}
		down.ReqID = e.req
		e.sess.Send(down)
	}
	if legacy {
		b.revokeLocked(f, reason)
	}
	return f
}

// flowFreedLocked is called when c's ring pair was freed: c is on TCP now,
// and goes back to the rings at once if what moved it away is over.
func (b *Broker) connFlowFreedLocked(c *Conn, f *Flow) {
	if c.flow != f {
		return
	}
	c.flow = nil
	if c.path != PathTCP {
		b.setPathLocked(c, PathTCP, c.reason)
	}
	if c.a.done && c.b.done {
		b.forgetLocked(c)
		return
	}
	if retryAfterFree[c.reason] || c.retryFreed {
		c.retryFreed = false
		b.upgradeLocked(c, time.Now())
	}
}

// retryAfterFree are the reasons that may be over by the time a ring pair
// is freed (a policy flipped back, the firewall's lease check passed, the
// migrating guest arrived before its connection left the rings).
var retryAfterFree = map[proto.Reason]bool{proto.ReasonPolicyReload: true, proto.ReasonPeerUnreachable: true, proto.ReasonPolicy: true, proto.ReasonFirewall: true, proto.ReasonMigrating: true, reasonRetired: true}

// retryOnReload are the reasons a policy reload retries a connection on
// TCP for; the others (gone, version, conntrack-gone, ...) do not change
// with policy. An operator's downgrade (admin) lasts until the next reload.
var retryOnReload = map[proto.Reason]bool{
	proto.ReasonPolicyReload: true, proto.ReasonPolicy: true, proto.ReasonGuestLimit: true, proto.ReasonGuestQuota: true,
	proto.ReasonNoSpace: true, proto.ReasonFirewall: true, proto.ReasonAdmin: true, proto.ReasonInternal: true,
}

// endDoneLocked handles an end of c that closed (CLOSE) or is gone
// (session ended, guest removed, not reattached): its side of the ring
// pair counts as left, and the other end, if still on the rings, gets
// DOWN(reason). c is forgotten once both ends are done and its rings freed.
func (b *Broker) endDoneLocked(c *Conn, side uint32, reason proto.Reason) {
	e := c.end(side)
	if e.done {
		return
	}
	if st := b.sessions[e.sess]; st != nil && !c.noReqs && st.conns[e.req] == c {
		delete(st.conns, e.req)
	}
	e.sess, e.done = nil, true
	if o := c.end(otherSide(side)); o.sess != nil && isRelay(o.sess) {
		// The relay's end closes too, after carrying what the guest wrote
		// before it left its ring (its DOWN follows: across.go).
		o.sess.Send(proto.Msg{Type: proto.Close, ReqID: o.req})
	}
	if f := c.flow; f != nil {
		if b.stretchResumeVMDoneLocked(f, side) {
			// Leaving by RESUME: the other end learns at the VM's ENDED,
			// or now, where the VM's stream ended (stretch.go).
		} else if !b.downgradeLocked(c, reason) && c.path == PathLeaving && reason == proto.ReasonPeerGone {
			// Already leaving: the survivor's reader waits for this end's
			// leave mark, which a gone end never writes. DOWN(peer-gone)
			// tells it to drain what the ring holds and go on over TCP.
			b.tellPeerGoneLocked(c, f, side)
		}
		if f.released&side == 0 {
			b.releaseLocked(f, side) // may free it, and forget c
		}
	}
	if c.flow == nil && c.a.done && c.b.done {
		b.forgetLocked(c)
	}
}

// tellPeerGoneLocked sends DOWN(peer-gone) to the end of c other than
// side, if it is still on f's rings.
func (b *Broker) tellPeerGoneLocked(c *Conn, f *Flow, side uint32) {
	other := uint32(region.SideA)
	if side == region.SideA {
		other = region.SideB
	}
	e := c.end(other)
	if e.sess == nil || f.released&other != 0 || !switching(e.sess) || isRelay(c.end(side).sess) || deferPeerGoneLocked(f, proto.ReasonPeerGone) {
		return
	}
	e.sess.Send(proto.Msg{Type: proto.Down, ReqID: e.req, RegionID: f.Region.ID, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: proto.ReasonPeerGone})
}

// sideOf returns which end of c session s is, by request id, or 0.
func (c *Conn) sideOf(s Session, req uint32) uint32 {
	switch {
	case c.a.sess == s && c.a.req == req:
		return region.SideA
	case c.b.sess == s && c.b.req == req:
		return region.SideB
	}
	return 0
}

// Left handles a LEFT: an end left both rings of its ring pair, whose
// side is then released; the pair is freed when both left. A LEFT while
// hostd has not asked for it (the end met an error on its rings) moves
// the connection to TCP as for a peer that went away.
func (b *Broker) Left(s Session, m proto.Msg) {
	b.mu.Lock()
	defer b.mu.Unlock()
	f := b.flowLocked(s.Guest(), m)
	side := b.flowSideLocked(f, s, m)
	if side == 0 {
		return
	}
	c := f.conn
	if r := f.resume; r != nil && r.pair && !r.done {
		r.left |= side // it left its rings, its end goes on: stretchpair.go
	}
	b.releaseLocked(f, side)
	if c != nil && c.flow == f {
		b.downgradeLocked(c, proto.ReasonPeerGone) // the other end, if it is still on the rings
	}
}

// flowSideLocked returns the side of f that s may speak for in m (its
// session holds it, or its guest owns it and m names it), or 0.
func (b *Broker) flowSideLocked(f *Flow, s Session, m proto.Msg) uint32 {
	if f == nil {
		return 0
	}
	g := s.Guest()
	switch {
	case m.Side == proto.SideA && f.GuestA == g && f.released&region.SideA == 0:
		return region.SideA
	case m.Side == proto.SideB && f.GuestB == g && f.released&region.SideB == 0:
		return region.SideB
	}
	return 0
}

// CloseConn handles a CLOSE: the connection's last descriptor at that end
// closed. A version-3 CLOSE names the connection by request id; one that
// names only a ring pair (version 2, or a flow adopted after a restart)
// is matched by the pair. A CLOSE for an OPEN still waiting for its peer
// ends the wait.
func (b *Broker) CloseConn(s Session, m proto.Msg) {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.sessions[s]
	if st == nil {
		return
	}
	if switching(s) {
		for h := range st.halves {
			if h.req == m.ReqID {
				b.unwaitLocked(h)
				b.rememberLocked(h.key, proto.ReasonPeerGone)
				return
			}
		}
		if c := st.conns[m.ReqID]; c != nil {
			if side := c.sideOf(s, m.ReqID); side != 0 {
				b.endDoneLocked(c, side, proto.ReasonPeerGone)
			}
			return
		}
	}
	f := b.flowLocked(s.Guest(), m)
	side := b.flowSideLocked(f, s, m)
	switch {
	case side == 0:
	case f.conn != nil:
		b.endDoneLocked(f.conn, side, proto.ReasonPeerGone)
	default:
		b.releaseLocked(f, side)
	}
}
