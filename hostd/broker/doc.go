// Package broker is hostd's flow broker: it decides, for each TCP connection
// between two guests, whether the pair gets a shared-memory ring pair, and
// takes the ring pair away again when the connection's permission goes.
//
// Lifecycle of one flow (A connects to B):
//
//	A: INTENT(A's tuple)      recorded, no reply
//	A: connect()              kernel: firewall, NAT, conntrack
//	A: OPEN(active)  --+
//	B: OPEN(passive) --+--> verify each side against conntrack (the entry
//	                        exists, is ESTABLISHED and assured, the tuple's
//	                        source is the claiming guest's), then pair the two
//	                        by the entry's reply tuple, which both sides share
//	                        even through DNAT and SNAT; ask policy; allocate
//	                        a ring pair in the pair's region (VMs: the
//	                        trust group's), handing a new one to both
//	hostd: READY to both, or TCP(reason) to both
//	...data on the rings; TCP stays open as the lease...
//	conntrack DESTROY, policy reload, guest gone -> REVOKE to both; the ring
//	pair is freed once both sides released it (CLOSE) or are gone.
//
// A passive OPEN with no intent from a peer that is not a connected Shunt
// guest is an ordinary client: TCP at once, no wait. If the peer is a
// connected guest, its INTENT may still be queued on its own session, so the
// passive side waits a short grace (50 ms) before settling on TCP.
// A side whose peer never shows gets TCP(timeout) after the pairing timeout,
// and the verdict is remembered for the tuple so the late side gets it too.
//
// The broker trusts nothing a guest says: its identity is the session it
// speaks on, and every tuple is checked against the kernel's conntrack. One
// function, claim, decides whether a guest may claim a connection, whether
// the entry was looked up for that OPEN or reused from the other side's.
//
// Files: broker.go (the Broker, New, Close), guest.go (guests, their
// addresses and sessions: Attach, Detach, Listen), open.go (INTENT and OPEN:
// verify, claim, pair, timeouts and fallbacks), flow.go (live flows: CLOSE,
// release, revoke), lifecycle.go (what ends or rebuilds flows: conntrack
// events, resync, policy reload, adoption after a restart, REATTACH, KICK),
// info.go (listings for the admin API and metrics), regions.go (where flows
// live: the group region of SharedRegion guests, a region per pair of
// process guests handed over by descriptor; per-guest quotas), limits.go
// (per-guest limits on LISTENs, INTENTs and OPENs, and ttlQueue, the
// time-ordered queue that INTENTs and remembered verdicts expire from;
// listings copy under the lock and format after it).
package broker
