package broker

import (
	"net/netip"

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
