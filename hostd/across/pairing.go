package across

import (
	"fmt"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/internal/proto"
)

// The messages of the room (peers.Across.Op).
const (
	opHalf     = "half"     // ID, Claim: the sender verified its guest's half; check it against yours
	opOK       = "ok"       // ID, Peer: the claim Peer holds here
	opRefused  = "refused"  // ID, Peer, Reason: it does not
	opUp       = "up"       // ID, Peer: the sender's relay end got READY (wants a stretch)
	opGo       = "go"       // ID, Peer, Flow: the dialer names the stretch's link flow
	opStop     = "stop"     // ID, Peer, Flow, At, Reason: the sender's bridge stopped; its out ring ended at At ("never": never started, "unknown": no such stretch)
	opClose    = "close"    // ID, Peer: the sender forgot the connection
	opAttached = "attached" // ID, Peer, Flow: the sender's guest attached its read ring of the stretch
	opLink     = "link"     // Token: the dialer's token for a new relay link
	opLinkPort = "linkport" // Port: where to dial it
)

// xconn is the room's state of one connection across hosts.
type xconn struct {
	id, peerID uint64
	peer       string
	key        ctrack.Tuple // the broker's name for it
	wire       ctrack.Tuple // as between the hosts; Src is the local guest
	active     bool
	guest      *broker.Guest
	at         time.Time

	offered   bool // this host verified its half (always, once it exists)
	theirs    bool // this host verified the peer's claim
	confirmed bool // the peer verified this host's claim
	paired    bool

	s   *session // the relay end, once paired
	req uint32
	st  *stretch // the current or last stretch on the rings
	rdy bool     // the relay end has a READY no stretch took yet
	up  bool     // the peer's relay end wants a stretch too
	// retryAt: a stretch given up for a timeout is tried again then
	// (sweep), backing off with retries; a started stretch resets them.
	retryAt time.Time
	retries int

	closing bool // the guest end is done: the relay's end closes once no stretch is in progress
	gone    bool // the peer forgot the connection: likewise

	checking  bool      // a check of the peer's claim is in flight
	checkedAt time.Time // when the last one started

	orphan *orphan // adopted from a killed hostd's relay (adopt.go); nil: made by this run
}

func (x *xconn) String() string {
	return fmt.Sprintf("x%d(%s %s)", x.id, x.wire.Src, x.wire.Dst)
}

// offer takes a verified local half: claim it from the peer.
func (r *Room) offer(o broker.Offer) {
	if old := r.byWire[o.Wire]; old != nil {
		r.forget(old) // an older connection of the same tuple
	}
	r.nextID++
	x := &xconn{id: r.nextID, peer: o.Peer, key: o.Key, wire: o.Wire, active: o.Active, guest: o.Guest, at: time.Now(), offered: true}
	r.conns[x.id], r.byWire[x.wire] = x, x
	if !r.claim(x) {
		r.b.RefuseAcross(x.key, proto.ReasonPeerUnreachable)
		r.forget(x)
		return
	}
	if k := (pendKey{x.peer, x.wire}); r.pending[k].peer != "" {
		c := r.pending[k]
		r.unpend(k)
		r.check(x, c)
	}
}

// claim sends the peer this host's half of x; false if its channel is down.
func (r *Room) claim(x *xconn) bool {
	grp := ""
	if x.guest.Group != nil {
		grp = x.guest.Group.Name
	}
	return r.send(x.peer, peers.Across{Op: opHalf, ID: x.id, Claim: &peers.Claim{Src: x.wire.Src, Dst: x.wire.Dst, Active: x.active, Group: grp}})
}

// half takes a peer's claim: checked now if this host's half is here,
// kept for it otherwise (until twice the pairing timeout).
func (r *Room) half(peer string, m peers.Across) {
	if m.Claim == nil {
		return
	}
	wire := ctrack.Tuple{Src: m.Claim.Dst, Dst: m.Claim.Src}.Unmap()
	c := claim{peer: peer, id: m.ID, c: *m.Claim, at: time.Now()}
	if rt, ok := r.peers.Route(m.Claim.Src.Addr()); !ok || rt.Peer != peer {
		return // not an address it announced: VerifyClaim would refuse it (not-owner)
	}
	x := r.byWire[wire]
	if x != nil && x.peer == peer && (x.checking || x.paired && time.Since(x.checkedAt) < recheck) {
		return // one check at a time; a paired one's again only after a while
	}
	if x != nil && x.peer == peer && x.paired {
		// The peer claims a connection this host paired already: its
		// hostd restarted and its guest OPENed again. Check the claim as
		// any, and claim this host's half again, so the peer can pair.
		x.confirmed = false
		r.check(x, c)
		r.claim(x)
		return
	}
	if x == nil || x.peer != peer {
		k := pendKey{peer, wire}
		if _, ok := r.pending[k]; ok || r.npending[peer] < maxPending {
			if !ok {
				r.npending[peer]++
			}
			r.pending[k] = c
		}
		return
	}
	r.check(x, c)
}

// maxPending bounds each peer's claims kept waiting for this host's half.
// They are kept apart by peer: a peer can neither fill another's room
// nor replace another's claim of the same connection.
const maxPending = 4096

// pendKey names a claim kept for this host's half: its peer and the
// connection as between the hosts (Src: this host's guest).
type pendKey struct {
	peer string
	wire ctrack.Tuple
}

func (r *Room) unpend(k pendKey) {
	if _, ok := r.pending[k]; !ok {
		return
	}
	delete(r.pending, k)
	if r.npending[k.peer]--; r.npending[k.peer] <= 0 {
		delete(r.npending, k.peer)
	}
}

// recheck is how often a peer's claim of a connection this host paired
// already is checked again (a restarted peer claims it anew): a peer that
// repeats claims must not cost a conntrack lookup and the broker's lock
// per message.
const recheck = time.Second

// check verifies the peer's claim c for x (a conntrack lookup: off the
// event loop) and answers it.
func (r *Room) check(x *xconn, c claim) {
	x.peerID = c.id
	x.checking, x.checkedAt = true, time.Now()
	go func() {
		reason := r.b.VerifyClaim(c.peer, c.c.Group, ctrack.Tuple{Src: c.c.Src, Dst: c.c.Dst}, c.c.Active)
		r.post(func() { r.checked(x, reason) })
	}()
}

func (r *Room) checked(x *xconn, reason proto.Reason) {
	x.checking = false
	if r.conns[x.id] != x {
		return
	}
	if reason != proto.ReasonNone {
		r.log.Info("refused a peer host's half of a connection", "conn", x, "peer", x.peer, "reason", reason)
		r.send(x.peer, peers.Across{Op: opRefused, ID: x.id, Peer: x.peerID, Reason: reason.String()})
		r.b.RefuseAcross(x.key, reason)
		r.forget(x)
		return
	}
	x.theirs = true
	r.send(x.peer, peers.Across{Op: opOK, ID: x.id, Peer: x.peerID})
	r.tryPair(x)
}

// verdict takes the peer's answer to this host's claim.
func (r *Room) verdict(peer string, m peers.Across) {
	x := r.mine(peer, m)
	if x == nil {
		return
	}
	if m.Op == opRefused {
		reason := reasonNamed(m.Reason)
		r.log.Info("a peer host refused this host's half of a connection", "conn", x, "peer", peer, "reason", reason)
		r.b.RefuseAcross(x.key, reason)
		r.forget(x)
		return
	}
	x.peerID, x.confirmed = m.ID, true
	r.tryPair(x)
}

// tryPair makes the pair once both hosts verified both halves.
func (r *Room) tryPair(x *xconn) {
	if x.paired && x.theirs && x.confirmed {
		r.b.RetryAcrossConn(x.s, x.req) // paired again with a restarted peer
		return
	}
	if x.paired || !x.offered || !x.theirs || !x.confirmed {
		return
	}
	s, err := r.session(x.peer, x.guest)
	if err != nil {
		r.log.Warn("no relay session for a connection across hosts", "conn", x, "error", err)
		r.b.RefuseAcross(x.key, proto.ReasonInternal)
		r.send(x.peer, peers.Across{Op: opClose, ID: x.id, Peer: x.peerID})
		r.forget(x)
		return
	}
	x.s, x.req, x.paired = s, s.newReq(), true
	s.conns[x.req] = x
	if !r.b.PairAcross(x.key, s, x.req) {
		r.log.Debug("the local half of a connection across hosts stopped waiting", "conn", x)
		r.send(x.peer, peers.Across{Op: opClose, ID: x.id, Peer: x.peerID})
		r.forget(x)
		return
	}
	r.log.Debug("paired across hosts", "conn", x, "peer", x.peer, "peer_id", x.peerID)
}

// forget drops x. A stretch still on the rings is the broker's to end
// first (its record's end sends DOWN to the relay session). Its bridge's
// Stop does not wait for the NIC (Released), and need not here: forget
// sends no LEFT, so the ring pair's slot stays the relay's until its
// session ends or the region goes, and the region's Deregister waits for
// the writes that still read it before hostd unmaps it.
func (r *Room) forget(x *xconn) {
	if r.conns[x.id] != x {
		return
	}
	delete(r.conns, x.id)
	if r.byWire[x.wire] == x {
		delete(r.byWire, x.wire)
	}
	if x.s != nil && x.s.conns[x.req] == x {
		delete(x.s.conns, x.req)
	}
	if x.st != nil && x.st.br != nil {
		x.st.br.Stop(proto.ReasonPeerGone)
	}
}
