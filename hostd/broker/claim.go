package broker

import (
	"errors"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
)

// The claim check: whether a guest may claim a connection, against its
// conntrack entry (verify, claim, origin, lookup), and the checks of an
// active side that need its peer (checkActiveLocked).

// verify checks one side's claim, without the lock. It reuses the entry
// that the other side's verified OPEN already fetched when the claim is
// exactly that entry's other direction (one conntrack lookup per connection
// instead of two); otherwise, or if the claim does not hold on that entry,
// it looks the tuple up.
func (b *Broker) verify(g *Guest, role proto.Role, t ctrack.Tuple) (ctrack.Entry, proto.Reason) {
	if reason := b.claim(g, role, t, nil); reason != proto.ReasonNone {
		return ctrack.Entry{}, reason
	}
	if e, ok := b.otherSide(role, t); ok && b.claim(g, role, t, &e) == proto.ReasonNone {
		return e, proto.ReasonNone
	}
	e, reason := b.lookup(t, role == proto.Active)
	if reason != proto.ReasonNone {
		return e, reason
	}
	return e, b.claim(g, role, t, &e)
}

// claim is the one check that guest g may claim tuple t, the connection as
// g sees it from role's end, given e, the connection's conntrack entry,
// whether looked up for this claim or reused from the other side's OPEN:
//
//   - neither end is a loopback address, and g owns t's source address;
//   - t is e's original direction (active) or its reply direction (passive);
//   - for the active side: the connection came in by g's own interface:
//     e's mark carries g's mark id (hostd/mark), the rest of e's mark is
//     g's ct_mark if it has one, and the witness, if on, saw the
//     connection's first SYN come in by g's interface (origin).
//
// With e nil it checks only the addresses, so that a claim that cannot hold
// costs no conntrack lookup. The same check runs on an entry reused from
// the other side's OPEN, so the order of the two OPENs changes nothing.
func (b *Broker) claim(g *Guest, role proto.Role, t ctrack.Tuple, e *ctrack.Entry) proto.Reason {
	switch {
	case t.Src.Addr().IsLoopback() || t.Dst.Addr().IsLoopback():
		return proto.ReasonLoopback
	case t.Src.Addr().Unmap().Is4() != t.Dst.Addr().Unmap().Is4():
		// No connection has one IPv4 and one IPv6 end: not worth a
		// conntrack query, which would only fail.
		return proto.ReasonNoConntrack
	case !g.Owns(t.Src.Addr()):
		return proto.ReasonNotOwner
	case e == nil:
		return proto.ReasonNone
	}
	mine := e.Orig
	if role == proto.Passive {
		mine = e.Reply
	}
	if mine != t {
		return proto.ReasonNotOwner
	}
	if role != proto.Active {
		return proto.ReasonNone
	}
	return b.origin(g, *e)
}

// origin checks that connection e came in by g's own interface, by the
// proofs g has: its mark id, its ct_mark, the witness. A guest without an
// interface has none of them, and its claims rest on its addresses alone.
// A refusal is counted by the caller (not-owner) and logged at debug only,
// since any guest can cause them.
func (b *Broker) origin(g *Guest, e ctrack.Entry) proto.Reason {
	mask := b.opts.MarkMask
	if g.Mark != 0 && e.Mark&mask != g.Mark {
		b.log.Debug("the connection does not carry the claiming guest's mark: it came in by another interface", "guest", g.Name, "tuple", e.Orig, "mark", e.Mark, "want", g.Mark, "mask", mask)
		return proto.ReasonNotOwner
	}
	if g.CTMark != 0 && e.Mark&^(mask|b.opts.ProofOrig|b.opts.ProofReply) != g.CTMark {
		b.log.Debug("the connection does not carry the claiming guest's ct_mark", "guest", g.Name, "tuple", e.Orig, "mark", e.Mark, "want", g.CTMark)
		return proto.ReasonNotOwner
	}
	if b.opts.Witness != nil && g.Ifindex != 0 {
		if in, err := b.opts.Witness.Origin(e.Orig.Src, e.Orig.Dst); err != nil || in != g.Ifindex {
			b.log.Debug("the connection's SYN did not come in by the claiming guest's interface", "guest", g.Name, "tuple", e.Orig, "ifindex", in, "error", err)
			return proto.ReasonNotOwner
		}
	}
	return proto.ReasonNone
}

// otherSide returns the entry of the other side's verified OPEN that waits
// for the side claiming t in role, if there is one.
func (b *Broker) otherSide(role proto.Role, t ctrack.Tuple) (ctrack.Entry, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var h *half
	switch role {
	case proto.Passive:
		h = b.waiting[t] // B's view is the reply tuple itself
	case proto.Active:
		// A's reply tuple is unknown before a lookup; a waiting passive
		// side is also indexed by its entry's original direction.
		h = b.waitingP[t]
	}
	if h == nil || h.role == role {
		return ctrack.Entry{}, false
	}
	return h.entry, true
}

// lookup finds t's conntrack entry. Only an active side retries, with
// backoff until the entry is ESTABLISHED and assured or LookupTimeout has
// passed: its connect() returned at the SYN-ACK, and the handshake's last
// ACK may still be on its way. Everything else costs one lookup: a passive
// side's accept() returned after that ACK passed conntrack, and a missing
// entry does not appear later (it was made by the SYN), so neither is
// retried. The retries run on the guest's own session, and its OPEN rate
// and pending-OPEN limits bound them.
func (b *Broker) lookup(t ctrack.Tuple, retry bool) (ctrack.Entry, proto.Reason) {
	deadline := time.Now().Add(b.opts.LookupTimeout)
	for delay, tries := 100*time.Microsecond, 1; ; delay, tries = min(2*delay, 10*time.Millisecond), tries+1 {
		e, err := b.ct.Lookup(t)
		if err == nil && e.Established() {
			if tries > 1 {
				b.log.Debug("conntrack entry established after retries", "tuple", t, "tries", tries, "state", e.TCPState)
			}
			return e, proto.ReasonNone
		}
		// Retry only a handshake that may still complete: a connection
		// already closing (a short one, closed before its OPEN was
		// served) is answered at once, so it never holds up the rest of
		// its guest's session.
		if !retry || errors.Is(err, ctrack.ErrNotFound) || (err == nil && !e.Opening()) || time.Now().After(deadline) {
			switch {
			case errors.Is(err, ctrack.ErrNotFound):
				return e, proto.ReasonNoConntrack
			case err != nil:
				b.log.Warn("conntrack lookup failed", "tuple", t, "error", err)
				return e, proto.ReasonInternal
			}
			return e, proto.ReasonNotEstablished
		}
		time.Sleep(delay)
	}
}

// checkActiveLocked runs the checks that need the peer: it is local, in the
// same group, and listening. Policy, limits and quota are the connection
// record's (mayUpgradeLocked): they change while it lives.
func (b *Broker) checkActiveLocked(g *Guest, e ctrack.Entry) proto.Reason {
	peer := b.guestByAddr(e.Reply.Src.Addr())
	switch {
	case peer == nil:
		return b.remoteReasonLocked(e.Reply.Src.Addr(), proto.ReasonNotLocal)
	case peer.Group != g.Group:
		return proto.ReasonCrossGroup
	case !b.listeningLocked(peer, e.Reply.Src):
		return proto.ReasonNoListener
	}
	return proto.ReasonNone
}
