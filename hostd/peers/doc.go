// Package peers is hostd's channel to the hostds of other hosts (issue 23,
// docs/crosshost.md): one `peer` block per remote hostd in hostd.hcl, a
// mutual-TLS connection to each, and the guest addresses each side
// announces.
//
// A peer is known by the name on its certificate (a DNS name of its
// subject alternative names), checked against the configured CA; an
// unknown name, a certificate of another CA or one that names another
// peer is refused. Of each pair of peers, the one whose name sorts first
// dials, retrying with back-off while the other is down or refuses; the
// other accepts. Each side announces the whole set of its guests'
// addresses (with their trust groups' names) when the channel comes up and
// whenever it changes: an address absent from the new set is withdrawn.
// The receiver keeps only the addresses inside the prefixes its own
// configuration allows that peer, and refuses the others with a reason it
// logs, counts and sends back.
//
// The broker asks one question of this room (Room.Route): which peer, if
// any, may speak for an address, and whether it is reachable. A
// connection to an address inside a peer's prefixes while that peer is
// down stays on TCP with reason peer-unreachable. Pairing across hosts
// and the relay that carries paired flows are not built yet
// (docs/crosshost.md).
//
// Files: config.go (the configuration and TLS), room.go (the Room:
// start, reload, announcements, Route, listings), link.go (one peer
// channel: dial or accept, the session, back-off), wire.go (the messages,
// bounded), metrics.go.
package peers
