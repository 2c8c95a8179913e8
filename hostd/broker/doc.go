// Package broker is hostd's flow broker: it decides, for each TCP connection
// between two guests, whether it goes over a shared-memory ring pair or
// over TCP, and moves it between the two as often as its permission
// changes. Policy only chooses between the rings and TCP; it never ends a
// connection.
//
// Lifecycle of one connection (A connects to B):
//
//	A: connect()              kernel: firewall, NAT, conntrack; on TCP at once
//	A: OPEN(active)  --+
//	B: OPEN(passive) --+--> verify each side against conntrack (the entry
//	                        exists, is ESTABLISHED and assured, the tuple's
//	                        source is the claiming guest's), then pair the two
//	                        by the entry's reply tuple, which both sides share
//	                        even through DNAT and SNAT: a connection record
//	                        (Conn) for its whole life
//	hostd: READY to both (policy, limits, quota allow; a ring pair in the
//	       pair's region, VMs: the trust group's), or TCP(reason) to both
//	...bytes on the rings; TCP stays open as the lease...
//	policy reload, conntrack DESTROY, a ruleset change, an operator, the
//	peer gone, hostd stopping -> DOWN(reason) to both; each answers LEFT
//	once it left the rings; the ring pair is freed when both left (or
//	closed, or are gone), and the record is on TCP
//	the reason goes away -> a fresh ring pair, READY to both again
//	CLOSE from both (or gone) -> the record is forgotten
//
// A passive OPEN whose client is no guest is an ordinary client: TCP at
// once. One from a guest waits for the active OPEN up to the pairing
// timeout (no INTENT: both OPENs go right after connect and accept, so
// simultaneous connects pair); if that guest has no session yet, TCP goes
// at once and the wait goes on all the same. A side whose peer never shows
// gets TCP(timeout), remembered for the tuple so the late side gets it too.
// A session of a version-2 library (or without a common ring format) gets
// TCP(version) for every OPEN, and so does its peer.
//
// The broker trusts nothing a guest says: its identity is the session it
// speaks on, and every tuple is checked against the kernel's conntrack. One
// function, claim, decides whether a guest may claim a connection, whether
// the entry was looked up for that OPEN or reused from the other side's.
//
// Files: broker.go (the Broker, New, Close), guest.go (guests, their
// addresses and sessions: Attach, Detach, Listen), open.go (the OPEN
// path: admit, wait for the other side, pair), claim.go (the claim check:
// verify, claim, origin, the conntrack lookup, the active side's peer
// checks), verdicts.go (TCP(reason) to one side or both, timeouts,
// remembered verdicts), conn.go (connection
// records: upgrade, downgrade, LEFT, CLOSE), flow.go (ring pairs: release;
// the version-2 reset), lifecycle.go (what moves connections: conntrack
// events, resync, policy reload, an operator, shutdown, adoption after a
// restart, REATTACH, KICK), firewall.go (the ruleset watch's downgrades
// and the lease-counter poller), notes.go (rate-limited logs of fallbacks
// and switches), info.go (listings for the admin API and metrics),
// regions.go (where flows live: the group region of SharedRegion guests, a
// region per pair of process guests handed over by descriptor, or of
// PairVM guests plugged into both VMs; per-guest quotas), hotplug.go (a
// VM pair region's plug before its first READY and unplug after its last
// flow, through Hotplug), limits.go (per-guest limits on LISTENs and OPENs, and
// ttlQueue, the time-ordered queue that remembered verdicts expire from;
// listings copy under the lock and format after it). INTENT, which only
// version-2 libraries send, is accepted by the control server and kept
// nowhere.
package broker
