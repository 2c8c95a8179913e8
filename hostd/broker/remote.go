package broker

import (
	"net/netip"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
)

// Remote is the one interface between the broker and the peer channel to
// other hosts' hostds (hostd/peers, docs/crosshost.md). The broker asks it
// only about addresses no local guest owns.
type Remote interface {
	// Route says whether a peer hostd speaks for addr (ok), which one,
	// and whether it is reachable now. It must not block, and must not
	// call back into the broker (it runs under the broker's lock).
	Route(addr netip.Addr) (peer string, up bool, ok bool)
}

// remoteReasonLocked is the verdict for a connection whose other end, at
// addr, is no local guest: peer-unreachable if a peer host speaks for it
// and is down; otherwise not-local. Pairing across hosts is not built
// yet, so a reachable peer's guest is not-local too.
func (b *Broker) remoteReasonLocked(addr netip.Addr, otherwise proto.Reason) proto.Reason {
	if b.opts.Remote == nil {
		return otherwise
	}
	if peer, up, ok := b.opts.Remote.Route(addr); ok && !up {
		b.log.Debug("the other end is a guest of a peer host that is unreachable", "addr", addr, "peer", peer)
		return proto.ReasonPeerUnreachable
	}
	return otherwise
}

// UseRemote sets the peer channel the broker asks about addresses no
// local guest owns (Options.Remote, for a channel started after the
// broker).
func (b *Broker) UseRemote(r Remote) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.opts.Remote = r
}

// LocalPrefix is a prefix a local guest owns, with its trust group's name:
// what this host announces to its peers.
type LocalPrefix struct {
	Prefix netip.Prefix
	Group  string
}

// LocalPrefixes lists the prefixes the local guests own (configured,
// libvirt and runtime guests alike).
func (b *Broker) LocalPrefixes() []LocalPrefix {
	b.mu.Lock()
	gs := append([]*Guest(nil), b.guests...)
	b.mu.Unlock()
	var out []LocalPrefix
	for _, g := range gs {
		grp := ""
		if g.Group != nil {
			grp = g.Group.Name
		}
		for _, p := range g.Prefixes() {
			out = append(out, LocalPrefix{Prefix: p.Masked(), Group: grp})
		}
	}
	return out
}

// LocalOverlaps reports whether p overlaps a prefix a local guest owns: a
// peer may never announce such a prefix.
func (b *Broker) LocalOverlaps(p netip.Prefix) bool {
	for _, lp := range b.LocalPrefixes() {
		if lp.Prefix.Overlaps(p) {
			return true
		}
	}
	return false
}

// VerifyClaim checks a peer host's claim of a connection, this host's half
// of it exactly as for a local connection's other side (docs/crosshost.md):
// t is the connection as between the two hosts, t.Src the claiming
// peer's guest; active says that guest connected. The claim holds only if
//
//   - the peer announced t.Src (and this host accepted it): a peer never
//     speaks for an address it did not announce (not-owner);
//   - this host's conntrack has an ESTABLISHED entry of exactly t, in the
//     direction the claim says (no-conntrack, not-established, not-owner):
//     a peer can never make this host pair a connection its conntrack has
//     not seen;
//   - the other end, after this host's NAT, is a local guest (not-local),
//     of the trust group of the same name (cross-group).
//
// A peer's masquerading (SNAT to its host's address) fails the first
// check: its guests' addresses must cross between the hosts. The lookup
// runs without the broker's lock. Pairing across hosts is not built yet:
// a claim that holds pairs nothing.
func (b *Broker) VerifyClaim(peer, group string, t ctrack.Tuple, active bool) proto.Reason {
	t = t.Unmap()
	b.mu.Lock()
	r := b.opts.Remote
	b.mu.Unlock()
	if r == nil {
		return proto.ReasonNotLocal
	}
	if by, up, ok := r.Route(t.Src.Addr()); !ok || !up || by != peer {
		return proto.ReasonNotOwner
	}
	e, reason := b.lookup(t, false)
	if reason != proto.ReasonNone {
		return reason
	}
	local := e.Orig.Src // the peer's guest accepted: this host's guest connected
	if active {
		local = e.Reply.Src
	}
	switch {
	case active && e.Orig != t, !active && e.Reply != t:
		return proto.ReasonNotOwner
	}
	b.mu.Lock()
	g := b.guestByAddr(local.Addr())
	b.mu.Unlock()
	switch {
	case g == nil:
		return proto.ReasonNotLocal
	case g.Group == nil || g.Group.Name != group:
		return proto.ReasonCrossGroup
	}
	return proto.ReasonNone
}
