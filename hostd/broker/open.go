package broker

import (
	"errors"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// half is one side's OPEN, verified, waiting for the other side. While it
// waits it counts as one of its guest's pending OPENs.
type half struct {
	sess  Session
	req   uint32
	role  proto.Role
	entry ctrack.Entry
	key   ctrack.Tuple // entry.Reply: where it waits in Broker.waiting
	at    time.Time
	timer *time.Timer

	onTimeout proto.Reason // the verdict if the other side does not come
	told      bool         // TCP(onTimeout) was sent already: the timeout only counts it
}

// intentLife is how long an INTENT is kept: the connect it announces may
// take a while (SYN retries) before its OPEN comes.
func (b *Broker) intentLife() time.Duration {
	return b.opts.PairingTimeout + b.opts.LookupTimeout + 10*time.Second
}

// Intent records that s's guest is about to connect with tuple t: only
// version-2 libraries send it, and it grants and changes nothing (a
// version-2 OPEN gets TCP(version)); it is kept, within its limit, so
// that such libraries keep working. Each guest keeps at most
// IntentsPerGuest: beyond, its oldest is dropped (that connection's OPENs
// then go as without an INTENT). Expiry pops the guest's own queue, in
// time order: no INTENT scans the others.
func (b *Broker) Intent(s Session, t ctrack.Tuple) {
	g := s.Guest()
	if !g.Owns(t.Src.Addr()) {
		b.log.Debug("intent for an address the guest does not own; ignored", "guest", g.Name, "tuple", t)
		return
	}
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	q := &g.ctl.intents
	q.expire(now)
	if _, ok := q.items[t]; !ok && q.len() >= b.opts.Limits.IntentsPerGuest {
		q.dropOldest()
		b.Limited(g, metrics.LimitIntents, b.opts.Limits.IntentsPerGuest)
	}
	q.put(t, struct{}{}, now.Add(b.intentLife()))
}

// Open handles an OPEN: it verifies the claim (one conntrack lookup, on the
// caller's goroutine, so a session's messages stay in order) and then either
// answers, pairs, or leaves the side waiting for its peer; the verdict goes
// out on s. Nothing waits for it: the connection is on TCP meanwhile. An
// OPEN beyond the guest's PendingOpensPerGuest gets TCP(control-limit) at
// once, before any lookup.
func (b *Broker) Open(s Session, m proto.Msg) {
	role := "passive"
	if m.Role == proto.Active {
		role = "active"
	}
	b.m.Opens.WithLabelValues(role).Inc()
	g := s.Guest()
	if !b.admitOpen(g) {
		b.fallback(s, m.ReqID, proto.ReasonControlLimit, true)
		return
	}
	if !b.open(s, m) {
		g.ctl.pending.Add(-1)
	}
}

// open handles an admitted OPEN. It reports whether the OPEN waits for
// its peer, and so still counts as pending (unwaitLocked ends that).
func (b *Broker) open(s Session, m proto.Msg) (waits bool) {
	at := time.Now()
	b.log.Trace("open", "guest", s.Guest().Name, "role", m.Role, "local", m.Local, "remote", m.Remote)
	// An IPv4 connection by its IPv4 tuple, however the guest's socket
	// named it (proto.Decode already gives this form).
	t := ctrack.Tuple{Src: m.Local, Dst: m.Remote}.Unmap()
	e, reason := b.verify(s.Guest(), m.Role, t)
	if reason != proto.ReasonNone {
		b.log.Debug("open refused", "guest", s.Guest().Name, "role", m.Role, "tuple", t, "reason", reason)
		b.fallback(s, m.ReqID, reason, true)
		return false
	}
	key := e.Reply
	h := &half{sess: s, req: m.ReqID, role: m.Role, entry: e, key: key, at: at}
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.sessions[s]
	if b.closed || st == nil { // hostd stopping, or the session went meanwhile
		return false
	}
	if c := b.conns[key]; c != nil && c.ctid == e.ID {
		side := uint32(region.SideB)
		if m.Role == proto.Active {
			side = region.SideA
		}
		if b.rejoinLocked(c, s, m.ReqID, side) {
			return false
		}
	}
	now := time.Now()
	if r, ok := b.remembered.get(key, now); ok {
		b.fallbackLocked(s, m.ReqID, r, false) // counted when it was decided
		return false
	}
	other := b.waiting[key]
	if other != nil && other.role == m.Role {
		// A second OPEN of the same side for one connection: refuse it.
		b.fallbackLocked(s, m.ReqID, proto.ReasonNotOwner, true)
		return false
	}
	if !switching(s) {
		// A version-2 library (or one without a common ring format): on
		// TCP, and its peer's OPEN learns it at once.
		b.refuseLocked(h, other, proto.ReasonVersion)
		return false
	}
	told, onTimeout := false, proto.ReasonTimeout
	if m.Role == proto.Passive && other == nil {
		og := b.guestByAddr(e.Orig.Src.Addr())
		if og == nil {
			// An ordinary client: TCP at once. Remember it, so a late
			// OPEN of the other side gets the same verdict.
			b.log.Trace("passive open from a client that is no guest", "guest", s.Guest().Name, "orig", e.Orig)
			b.refuseLocked(h, nil, proto.ReasonNoIntent)
			return false
		}
		if !b.hasSessionLocked(og) {
			// A guest without a session: most likely a program not
			// under Shunt, so TCP at once; but a fresh process's
			// session may still be on its way, so the OPEN waits for
			// its peer all the same (READY may follow TCP).
			b.fallbackLocked(s, m.ReqID, proto.ReasonNoIntent, false)
			told, onTimeout = true, proto.ReasonNoIntent
		}
	}
	if m.Role == proto.Active {
		switch reason := b.checkActiveLocked(s.Guest(), e); {
		case reason == proto.ReasonNoListener && other == nil:
			// Most likely a server not under Shunt: TCP at once; but
			// its LISTEN may still be on its way on another session,
			// so the OPEN waits for its peer all the same.
			b.fallbackLocked(s, m.ReqID, reason, false)
			told, onTimeout = true, reason
		case reason != proto.ReasonNone:
			b.refuseLocked(h, other, reason)
			return false
		}
		s.Guest().ctl.intents.remove(e.Orig)
	}
	if other == nil {
		h.onTimeout, h.told = onTimeout, told
		h.timer = time.AfterFunc(b.opts.PairingTimeout, func() { b.timeout(h) })
		b.waiting[key] = h
		if h.role == proto.Passive {
			b.waitingP[e.Orig] = h
		}
		st.halves[h] = true
		b.log.Trace("open verified; waiting for the other side", "guest", s.Guest().Name, "took", time.Since(at))
		return true
	}
	b.unwaitLocked(other)
	if other.told && other.onTimeout == proto.ReasonNoListener && !b.listeningLocked(s.Guest(), e.Reply.Src) {
		// The active side waited for a LISTEN (on another session, it
		// may come late: after a hostd restart); the passive side's
		// LISTEN comes before its OPEN on its session, or not at all.
		b.fallbackLocked(s, m.ReqID, proto.ReasonNoListener, true)
		b.rememberLocked(key, proto.ReasonNoListener)
		return false
	}
	a, p := h, other
	if m.Role == proto.Passive {
		a, p = other, h
	}
	start := a.at
	if p.at.Before(start) {
		start = p.at
	}
	b.pairLocked(a, p, start)
	return false
}

// refuseLocked answers h's OPEN with TCP(reason), and the other side's if
// it waits; otherwise the verdict is remembered for it. The connection's
// fallback is counted once.
func (b *Broker) refuseLocked(h, other *half, reason proto.Reason) {
	b.fallbackLocked(h.sess, h.req, reason, true)
	if other != nil {
		b.unwaitLocked(other)
		b.fallbackLocked(other.sess, other.req, reason, false)
	}
	b.rememberLocked(h.key, reason)
}

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
	if g.CTMark != 0 && e.Mark&^mask != g.CTMark {
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
		return proto.ReasonNotLocal
	case peer.Group != g.Group:
		return proto.ReasonCrossGroup
	case !b.listeningLocked(peer, e.Reply.Src):
		return proto.ReasonNoListener
	}
	return proto.ReasonNone
}

// pairLocked records the connection of a verified active and passive
// side and moves it to the rings if it may: READY to both, or TCP(reason)
// to both, counted once.
func (b *Broker) pairLocked(a, p *half, start time.Time) {
	if b.origin(a.sess.Guest(), p.entry) != proto.ReasonNone { // the passive side's entry, too, came in by A's interface
		b.failPairLocked(a, p, proto.ReasonNotOwner)
		return
	}
	if c := b.conns[a.entry.Reply]; c != nil && c.ctid == a.entry.ID && c.a.g == a.sess.Guest() && c.b.g == p.sess.Guest() {
		b.reannouncedLocked(c, a, p)
		return
	}
	c := b.newConnLocked(a, p)
	if reason := b.upgradeLocked(c, start); reason != proto.ReasonNone {
		b.fallbackLocked(a.sess, a.req, reason, true)
		b.fallbackLocked(p.sess, p.req, reason, false)
	}
}

func (b *Broker) failPairLocked(a, p *half, reason proto.Reason) {
	b.fallbackLocked(a.sess, a.req, reason, true)
	b.fallbackLocked(p.sess, p.req, reason, false)
	b.rememberLocked(a.entry.Reply, reason)
}

// timeout fires when h waited its bound (a runtime timer: the pairing
// timeouts are a time-ordered queue that nothing scans).
func (b *Broker) timeout(h *half) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || b.waiting[h.key] != h {
		return
	}
	b.dropWaitingLocked(h, h.onTimeout)
}

func (b *Broker) dropWaitingLocked(h *half, reason proto.Reason) {
	b.unwaitLocked(h)
	if h.told && reason == h.onTimeout {
		b.m.Fallbacks.WithLabelValues(reason.String()).Inc()
		b.note("fallback", reason, "guest", h.sess.Guest().Name)
	} else {
		b.fallbackLocked(h.sess, h.req, reason, true)
	}
	b.rememberLocked(h.key, reason)
}

// unwaitLocked takes h out of the waiting OPENs: its timer stops and it no
// longer counts as its guest's pending OPEN. It is a no-op for an h that
// no longer waits.
func (b *Broker) unwaitLocked(h *half) {
	if b.waiting[h.key] != h {
		return
	}
	h.timer.Stop()
	delete(b.waiting, h.key)
	if b.waitingP[h.entry.Orig] == h {
		delete(b.waitingP, h.entry.Orig)
	}
	if st := b.sessions[h.sess]; st != nil {
		delete(st.halves, h)
	}
	h.sess.Guest().ctl.pending.Add(-1)
}

// rememberLocked keeps reason as the verdict for the connection whose
// conntrack reply tuple is key, for RememberFor. Every verdict lives as
// long, so the queue is in expiry order and expiring pops its front.
func (b *Broker) rememberLocked(key ctrack.Tuple, reason proto.Reason) {
	now := time.Now()
	b.remembered.expire(now)
	b.remembered.put(key, reason, now.Add(b.opts.RememberFor))
}

// fallback answers TCP(reason); it needs no lock (Send is safe for
// concurrent use), so refusals never wait for the broker.
func (b *Broker) fallback(s Session, req uint32, reason proto.Reason, count bool) {
	b.fallbackLocked(s, req, reason, count)
}

// fallbackLocked tells s that its connection req stays on TCP. count says
// whether this is the connection's one count and log line (each
// connection's fallback is counted once, not once per end).
func (b *Broker) fallbackLocked(s Session, req uint32, reason proto.Reason, count bool) {
	if reason == reasonPlugging {
		return // not an answer: READY follows (hotplug.go)
	}
	if count {
		b.m.Fallbacks.WithLabelValues(reason.String()).Inc()
		b.note("fallback", reason, "guest", s.Guest().Name)
	}
	s.Send(proto.Msg{Type: proto.TCP, ReqID: req, Reason: reason})
}
