package broker

import (
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
)

// Connections across hosts (docs/crosshost.md). The broker verifies this
// host's half of such a connection exactly as a local one's, then offers
// it to the cross-host room (hostd/across), which claims it from the peer
// host. Once both hosts verified their halves, the room plays the other
// side's OPEN with one of its relay sessions (PairAcross): from then on
// the connection is a record like any other, with the relay as its other
// end, so policy, proof of passage, quotas, regions and downgrades apply
// unchanged. Two things differ: the relay's readiness gates upgrades
// (Gate), and the guest end gets RESUME from the room instead of DOWN
// (the other host must first say where its ring ended).

// Across is the cross-host room as the broker sees it.
type Across interface {
	Remote
	// Offer hands the room a verified half whose other end is a peer's
	// guest. It runs under the broker's lock: it must not block or call
	// the broker. The room answers later with PairAcross or RefuseAcross.
	Offer(o Offer)
}

// Offer is a verified local half of a connection across hosts.
type Offer struct {
	Peer   string
	Key    ctrack.Tuple // the broker's name for it (the entry's reply tuple)
	Wire   ctrack.Tuple // the connection as between the hosts; Src is this host's guest
	Active bool         // this host's guest connected
	Guest  *Guest
}

// Relay is implemented by the relay's sessions: the other end of
// connections across hosts. Their guest ends get RESUME (ResumeAcross),
// never DOWN.
type Relay interface {
	Session
	Relays()
}

func isRelay(s Session) bool {
	_, ok := s.(Relay)
	return ok
}

// Gate is implemented by sessions that can be unable to take a ring pair
// for a while (a relay whose link to the peer host is down): upgrades of
// their connections wait, with the reason.
type Gate interface {
	Gate() proto.Reason
}

func gated(ss ...Session) proto.Reason {
	for _, s := range ss {
		if g, ok := s.(Gate); ok {
			if r := g.Gate(); r != proto.ReasonNone {
				return r
			}
		}
	}
	return proto.ReasonNone
}

// acrossLocked says whether the connection of entry e, verified for
// session s in role, goes to a peer host (peer) and, if it cannot be
// offered, why it stays on TCP (a guest library without RESUME, a VM).
func (b *Broker) acrossLocked(s Session, e ctrack.Entry, role proto.Role) (peer string, reason proto.Reason, ok bool) {
	x, isAcross := b.opts.Remote.(Across)
	if !isAcross {
		return "", proto.ReasonNone, false
	}
	other := e.Reply.Src.Addr()
	if role == proto.Passive {
		other = e.Orig.Src.Addr()
	}
	if b.guestByAddr(other) != nil {
		return "", proto.ReasonNone, false
	}
	peer, up, ok := x.Route(other)
	if !ok || !up {
		return "", proto.ReasonNone, false
	}
	g := s.Guest()
	if r, ok := s.(Resumer); !ok || !r.Resumes() {
		return peer, proto.ReasonVersion, true
	}
	if g.Vsock && !g.SharedRegion {
		// A VM that carries its flows over vsock stretches: the relay's
		// RESUME would stop only the VM library's bridge, not the
		// room's, and the bytes between lost (docs/vsock.md).
		return peer, proto.ReasonVsockPair, true
	}
	if g.Group == nil || g.SharedRegion && b.pairVMLocked(g) {
		// A VM of a group with pair regions: a region of its own with the
		// relay, plugged into it alone, is not built (docs/crosshost.md).
		return peer, proto.ReasonCrossGroup, true
	}
	return peer, proto.ReasonNone, true
}

// offerLocked makes h wait for the peer host's half, and offers it.
func (b *Broker) offerLocked(h *half, peer string, st *sessionState) {
	h.onTimeout = proto.ReasonTimeout
	h.timer = time.AfterFunc(b.opts.PairingTimeout, func() { b.timeout(h) })
	b.waiting[h.key] = h
	if h.role == proto.Passive {
		b.waitingP[h.entry.Orig] = h
	}
	st.halves[h] = true
	wire := ctrack.Tuple{Src: h.entry.Reply.Dst, Dst: h.entry.Reply.Src}
	if h.role == proto.Passive {
		wire = ctrack.Tuple{Src: h.entry.Orig.Dst, Dst: h.entry.Orig.Src}
	}
	b.opts.Remote.(Across).Offer(Offer{Peer: peer, Key: h.key, Wire: wire, Active: h.role == proto.Active, Guest: h.sess.Guest()})
}

// PairAcross makes the connection whose local half waits under key, with
// relay (request req there) as its other end: both hosts verified their
// halves. It reports false if the half no longer waits (timed out,
// closed, its guest gone).
func (b *Broker) PairAcross(key ctrack.Tuple, relay Relay, req uint32) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	h := b.waiting[key]
	if h == nil || b.closed || b.sessions[relay] == nil {
		return false
	}
	b.unwaitLocked(h)
	role := proto.Active
	if h.role == proto.Active {
		role = proto.Passive
	}
	p := &half{sess: relay, req: req, role: role, entry: h.entry, key: key, at: h.at, ep: h.ep}
	a, ps := h, p
	if h.role == proto.Passive {
		a, ps = p, h
	}
	b.pairLocked(a, ps, h.at)
	return true
}

// RefuseAcross answers the local half waiting under key with TCP(reason):
// the peer host refused its half, or could not be asked.
func (b *Broker) RefuseAcross(key ctrack.Tuple, reason proto.Reason) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if h := b.waiting[key]; h != nil {
		b.dropWaitingLocked(h, reason)
	}
}

// relayConnLocked finds the connection whose relay end is (relay, req),
// and the side the relay is.
func (b *Broker) relayConnLocked(relay Session, req uint32) (*Conn, uint32) {
	st := b.sessions[relay]
	if st == nil {
		return nil, 0
	}
	c := st.conns[req]
	if c == nil {
		return nil, 0
	}
	return c, c.sideOf(relay, req)
}

// DowngradeAcross moves the connection whose relay end is (relay, req) to
// TCP for reason (the peer host downgraded it, its link went down): the
// relay gets DOWN, and the guest RESUME once the hosts agreed where.
func (b *Broker) DowngradeAcross(relay Session, req uint32, reason proto.Reason) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if c, side := b.relayConnLocked(relay, req); side != 0 {
		b.downgradeLocked(c, reason)
	}
}

// ResumeAcross sends RESUME(offset) to the guest end of the connection
// whose relay end is (relay, req), if that end is still on the ring pair
// it is leaving.
func (b *Broker) ResumeAcross(relay Session, req uint32, offset uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	c, side := b.relayConnLocked(relay, req)
	if side == 0 || c.flow == nil {
		return
	}
	other := otherSide(side)
	e, f := c.end(other), c.flow
	if e.sess == nil || f.released&other != 0 {
		return
	}
	reason := c.reason
	if reason == proto.ReasonNone {
		reason = proto.ReasonPeerGone
	}
	e.sess.Send(proto.Msg{Type: proto.Resume, ReqID: e.req, RegionID: f.Region.ID, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: reason, Offset: offset})
}

// RetryAcross tries to move the connections of a relay session back to
// the rings (its link to the peer host is up again).
func (b *Broker) RetryAcross(relay Session) {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.sessions[relay]
	if st == nil {
		return
	}
	for _, c := range st.conns {
		b.retryAcrossLocked(c)
	}
}

// retryAcrossLocked moves c back to the rings if it is on TCP with no ring
// pair left and both ends live, and everything allows it now.
func (b *Broker) retryAcrossLocked(c *Conn) {
	if c.path == PathTCP && c.flow == nil && !c.a.done && !c.b.done {
		b.upgradeLocked(c, time.Now())
	}
}

// AddRelay registers the relay's session for a trust group: a guest of
// the group that owns no address (Guest.Relay), whose pair regions with
// the group's guests hold their connections across hosts.
func (b *Broker) AddRelay(g *Guest, s Relay) error {
	g.Relay, g.Source = true, "relay"
	g.SetAddrs(Addrs{})
	if err := b.AddGuest(g); err != nil {
		return err
	}
	b.Attach(s)
	return nil
}

// RetryAcrossConn tries to move the connection whose relay end is
// (relay, req) back to the rings (the peer host did).
func (b *Broker) RetryAcrossConn(relay Session, req uint32) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if c, side := b.relayConnLocked(relay, req); side != 0 {
		b.retryAcrossLocked(c)
	}
}
