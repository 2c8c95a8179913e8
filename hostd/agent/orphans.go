package agent

import (
	"net/netip"
	"os"
	"slices"

	"github.com/shuntnet/shunt/hostd/across"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/shm/region"
)

// orphanRegion is a pair region an earlier hostd left whose other guest
// was its relay session: a killed hostd's relayed connections, which the
// cross-host room adopts (hostd/across, adopt.go; docs/crosshost.md,
// "A SIGKILLed hostd"). keep hands it to the pair regions' owner, drop
// removes it as a region not adopted.
type orphanRegion struct {
	m          region.Meta
	pool       *region.Pool
	f          *os.File
	keep, drop func()
}

// orphaned reports whether m is a relay pair region: one guest a relay
// session of some run, the other not.
func (a *Agent) orphaned(m region.Meta) bool {
	return broker.IsRelayID(m.GuestA) != broker.IsRelayID(m.GuestB)
}

// adoptOrphans hands the relay pair regions to room x, with the peer
// blocks' prefixes to name each one's peer; what it does not adopt is
// dropped, then or by dropOrphans. The broker's records of the adopted
// flows get their conntrack entries looked up (Resync), as adopted local
// flows did.
func (a *Agent) adoptOrphans(x *across.Room, pc *peers.Config) {
	if len(a.orphans) == 0 {
		return
	}
	peerOf := func(addr netip.Addr) (string, bool) {
		addr = addr.Unmap()
		for _, p := range pc.Peers {
			if slices.ContainsFunc(p.Prefixes, func(q netip.Prefix) bool { return q.Contains(addr) }) {
				return p.Name, true
			}
		}
		return "", false
	}
	for _, o := range a.orphans {
		if _, ok := x.AdoptOrphans(o.m, o.pool, o.f, peerOf, a.cfg.ReattachGrace); ok {
			o.keep()
		} else {
			o.drop()
		}
	}
	a.orphans = nil
	a.b.Resync()
}

// dropOrphans drops the relay pair regions no room adopted (no peering).
func (a *Agent) dropOrphans() {
	for _, o := range a.orphans {
		a.log.Warn("relay pair region not adopted: no peering block; its connections are lost", "region", o.m.ID)
		o.drop()
	}
	a.orphans = nil
}
