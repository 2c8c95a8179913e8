// Package across pairs connections across hosts and carries them through
// the relay (issue 23, docs/crosshost.md). It is a room of its own
// between three others: the broker (which verifies this host's half of a
// connection and keeps its record), the peers channel (hostd/peers: the
// mutual-TLS channel to each peer hostd, which carries this room's
// messages) and the relay (relay/: the link between hosts and the bridge
// that is a guest's ring peer).
//
// For one connection between a local guest and a peer's guest:
//
//  1. The broker verifies the local half as for a local connection and
//     offers it (broker.Across.Offer). The room claims it from the peer
//     ("half"); the peer checks the claim against its own conntrack
//     (broker.VerifyClaim) and answers "ok" or "refused". Each host pairs
//     once it has verified the other's claim and the other verified its
//     own: each operator's firewall, policy and ownership checks decide
//     that operator's side.
//  2. The broker makes the record with this room's relay session for the
//     peer and the guest's trust group as the other end, and sends READY
//     to both ends when it may. The relay session answers "up"; the host
//     that dials the peer names a link flow for the stretch ("go"), and
//     both start a relay.Bridge on their ring pair. The bridge attaches
//     the guest's write ring only once both relays opened the flow, so no
//     guest byte goes into a ring nobody carries.
//  3. A downgrade on either host (policy, firewall, the link, the peer
//     gone) stops both bridges. Each host's bridge says where the ring it
//     wrote ended; the hosts exchange that ("stop"), and each sends its
//     guest RESUME(the other's end): the guest's writer resends what the
//     other guest's ring does not hold on TCP. Nothing is lost or
//     duplicated. A bridge that sent from its guest's ring by reference
//     (zero copy over RDMA) holds RESUME and the relay's LEFT of the
//     pair until the NIC wrote those bytes (relay.Bridge.Released,
//     waited for off the event loop, which never waits for the NIC).
//
// Files: room.go (the room, its event loop, the peers' callbacks),
// pairing.go (claims), session.go (the relay sessions the broker sees),
// stretch.go (bridges, stops, RESUME), link.go (the relay link to each
// peer), orphan.go and adopt.go (the stretches of a SIGKILLed hostd's
// relay: adopted, matched to the peer's stop, resumed).
package across
