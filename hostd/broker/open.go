package broker

import (
	"errors"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// remembered is a verdict kept for a connection, so that its late side
// gets the same one.
type remembered struct {
	reason proto.Reason
	until  time.Time
}

// half is one side's OPEN, verified, waiting for the other side.
type half struct {
	sess  Session
	req   uint32
	role  proto.Role
	entry ctrack.Entry
	at    time.Time
	timer *time.Timer

	onTimeout proto.Reason // the verdict if the other side does not come
}

// Intent records that s's guest is about to connect with tuple t. Intents
// are only hints (a passive side waits for a peer that announced itself);
// they grant nothing.
func (b *Broker) Intent(s Session, t ctrack.Tuple) {
	if !s.Guest().Owns(t.Src.Addr()) {
		b.log.Debug("intent for an address the guest does not own; ignored", "guest", s.Guest().Name, "tuple", t)
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	for k, exp := range b.intents {
		if now.After(exp) {
			delete(b.intents, k)
		}
	}
	b.intents[t] = now.Add(b.opts.PairingTimeout + b.opts.LookupTimeout + 10*time.Second)
}

// Open handles an OPEN: it verifies the claim (one conntrack lookup, on the
// caller's goroutine, so a session's messages stay in order) and then either
// answers, pairs, or leaves the side waiting for its peer; the verdict goes
// out on s.
func (b *Broker) Open(s Session, m proto.Msg) {
	b.m.Opens.WithLabelValues(map[proto.Role]string{proto.Active: "active", proto.Passive: "passive"}[m.Role]).Inc()
	b.open(s, m)
}

func (b *Broker) open(s Session, m proto.Msg) {
	at := time.Now()
	b.log.Trace("open", "guest", s.Guest().Name, "role", m.Role, "local", m.Local, "remote", m.Remote)
	t := ctrack.Tuple{Src: m.Local, Dst: m.Remote}
	e, reason := b.verify(s.Guest(), m.Role, t)
	if reason != proto.ReasonNone {
		b.log.Debug("open refused", "guest", s.Guest().Name, "role", m.Role, "tuple", t, "reason", reason)
		b.fallback(s, m.ReqID, reason)
		return
	}
	h := &half{sess: s, req: m.ReqID, role: m.Role, entry: e, at: at}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	key := e.Reply
	if r, ok := b.remembered[key]; ok && time.Now().Before(r.until) {
		b.fallbackLocked(s, m.ReqID, r.reason)
		return
	}
	other := b.waiting[key]
	if other != nil && other.role == m.Role {
		// A second OPEN of the same side for one connection: refuse it.
		b.fallbackLocked(s, m.ReqID, proto.ReasonNotOwner)
		return
	}
	wait, onTimeout := b.opts.PairingTimeout, proto.ReasonTimeout
	if m.Role == proto.Passive && other == nil {
		if _, ok := b.intents[e.Orig]; !ok {
			og := b.guestByAddr(e.Orig.Src.Addr())
			if og == nil || !b.hasSessionLocked(og) {
				// An ordinary client: TCP at once. Remember it, so a late
				// OPEN of the other side gets the same verdict.
				b.log.Debug("passive open without intent", "guest", s.Guest().Name, "orig", e.Orig)
				b.fallbackLocked(s, m.ReqID, proto.ReasonNoIntent)
				b.rememberLocked(key, proto.ReasonNoIntent)
				return
			}
			// The connecting side is a Shunt guest whose INTENT may still be
			// queued behind us (its session is served by another goroutine):
			// wait briefly for it instead of the full pairing timeout.
			wait, onTimeout = b.opts.IntentGrace, proto.ReasonNoIntent
		}
	}
	if m.Role == proto.Active {
		if reason := b.checkActiveLocked(s.Guest(), e); reason != proto.ReasonNone {
			b.fallbackLocked(s, m.ReqID, reason)
			if other != nil {
				b.dropWaitingLocked(key, other, reason)
			} else {
				b.rememberLocked(key, reason)
			}
			return
		}
		delete(b.intents, e.Orig)
	}
	if other == nil {
		h.onTimeout = onTimeout
		h.timer = time.AfterFunc(wait, func() { b.timeout(key, h) })
		b.waiting[key] = h
		b.log.Trace("open verified; waiting for the other side", "guest", s.Guest().Name, "took", time.Since(at))
		return
	}
	other.timer.Stop()
	delete(b.waiting, key)
	a, p := h, other
	if m.Role == proto.Passive {
		a, p = other, h
	}
	start := a.at
	if p.at.Before(start) {
		start = p.at
	}
	b.pairLocked(a, p, start)
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
	e, reason := b.lookup(t)
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
//   - for the active side: e's mark is g's ct_mark, if g has one, and the
//     witness, if on, saw the connection's SYN come in by g's interface.
//
// With e nil it checks only the addresses, so that a claim that cannot hold
// costs no conntrack lookup.
func (b *Broker) claim(g *Guest, role proto.Role, t ctrack.Tuple, e *ctrack.Entry) proto.Reason {
	switch {
	case t.Src.Addr().IsLoopback() || t.Dst.Addr().IsLoopback():
		return proto.ReasonLoopback
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
	if g.CTMark != 0 && e.Mark != g.CTMark {
		return proto.ReasonNotOwner
	}
	if b.opts.Witness != nil && g.Ifindex != 0 {
		if in, err := b.opts.Witness.Origin(t.Src, t.Dst); err != nil || in != g.Ifindex {
			b.log.Warn("the connection's SYN did not come in by the claiming guest's interface", "guest", g.Name, "tuple", t, "ifindex", in, "error", err)
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
		// A's reply tuple is unknown before a lookup; find a waiting
		// passive side whose entry has t as its original direction.
		for _, w := range b.waiting {
			if w.role == proto.Passive && w.entry.Orig == t {
				h = w
				break
			}
		}
	}
	if h == nil || h.role == role {
		return ctrack.Entry{}, false
	}
	return h.entry, true
}

// lookup finds t's conntrack entry, retrying with backoff until the entry
// is ESTABLISHED and assured (the handshake's last ACK may still be on its
// way) or LookupTimeout has passed.
func (b *Broker) lookup(t ctrack.Tuple) (ctrack.Entry, proto.Reason) {
	deadline := time.Now().Add(b.opts.LookupTimeout)
	for delay, tries := 100*time.Microsecond, 1; ; delay, tries = min(2*delay, 10*time.Millisecond), tries+1 {
		e, err := b.ct.Lookup(t)
		if err == nil && e.Established() {
			if tries > 1 {
				b.log.Debug("conntrack entry established after retries", "tuple", t, "tries", tries, "state", e.TCPState)
			}
			return e, proto.ReasonNone
		}
		if time.Now().After(deadline) {
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
// same group, listening, and policy allows the flow.
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
	v := b.policy.Load().Decide(policy.Flow{From: e.Orig.Src, To: e.Reply.Src})
	if !v.FastPath {
		return v.Reason
	}
	limit := b.policy.Load().MaxFlowsPerGuest()
	if b.flowsOfLocked(g) >= limit || b.flowsOfLocked(peer) >= limit {
		return proto.ReasonGuestLimit
	}
	return proto.ReasonNone
}

// pairLocked allocates the ring pair for a verified active and passive side
// and tells both.
func (b *Broker) pairLocked(a, p *half, start time.Time) {
	ga, gp := a.sess.Guest(), p.sess.Guest()
	if gp.CTMark != 0 && p.entry.Mark != ga.CTMark && ga.CTMark != 0 {
		b.failPairLocked(a, p, proto.ReasonNotOwner)
		return
	}
	v := b.policy.Load().Decide(policy.Flow{From: a.entry.Orig.Src, To: a.entry.Reply.Src})
	slot, e, err := ga.Group.Pool.Alloc(region.Request{
		OwnerA: ga.ID, OwnerB: gp.ID, Src: a.entry.Orig.Src, Dst: a.entry.Orig.Dst,
		Capacity: v.RingSize, Created: time.Now().UnixNano(),
	})
	if err != nil {
		reason := proto.ReasonInternal
		if errors.Is(err, region.ErrFull) {
			reason = proto.ReasonNoSpace
		}
		b.log.Warn("cannot allocate a ring pair", "group", ga.Group.Name, "error", err)
		b.failPairLocked(a, p, reason)
		return
	}
	f := &Flow{
		id: flowID{ga.Group.Name, slot}, Gen: e.Gen, Group: ga.Group, GuestA: ga, GuestB: gp,
		sessA: a.sess, sessB: p.sess, Orig: a.entry.Orig, Key: a.entry.Reply, CTID: a.entry.ID,
		Capacity: e.Capacity, Created: time.Now(), Rule: v.Rule,
	}
	b.flows[f.id] = f
	b.byKey[f.Key] = f
	ready := proto.Msg{Type: proto.Ready, Slot: uint32(slot), Gen: e.Gen, Capacity: uint32(e.Capacity),
		RingAB: uint64(e.RingAB), RingBA: uint64(e.RingBA)}
	ready.ReqID, ready.Side = a.req, proto.SideA
	a.sess.Send(ready)
	ready.ReqID, ready.Side = p.req, proto.SideB
	p.sess.Send(ready)
	b.m.Setup.Observe(time.Since(start).Seconds())
	b.m.Flows.WithLabelValues("ready", "direct").Inc()
	b.log.Info("fast path", "flow", f.Name(), "a", ga.Name, "b", gp.Name, "tuple", f.Orig, "ring", e.Capacity, "rule", v.Rule, "setup", time.Since(start))
}

func (b *Broker) failPairLocked(a, p *half, reason proto.Reason) {
	b.fallbackLocked(a.sess, a.req, reason)
	b.fallbackLocked(p.sess, p.req, reason)
	b.rememberLocked(a.entry.Reply, reason)
}

func (b *Broker) timeout(key ctrack.Tuple, h *half) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || b.waiting[key] != h {
		return
	}
	b.dropWaitingLocked(key, h, h.onTimeout)
}

func (b *Broker) dropWaitingLocked(key ctrack.Tuple, h *half, reason proto.Reason) {
	h.timer.Stop()
	delete(b.waiting, key)
	b.fallbackLocked(h.sess, h.req, reason)
	b.rememberLocked(key, reason)
}

func (b *Broker) rememberLocked(key ctrack.Tuple, reason proto.Reason) {
	now := time.Now()
	for k, r := range b.remembered {
		if now.After(r.until) {
			delete(b.remembered, k)
		}
	}
	b.remembered[key] = remembered{reason, now.Add(b.opts.RememberFor)}
}

func (b *Broker) fallback(s Session, req uint32, reason proto.Reason) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.fallbackLocked(s, req, reason)
}

func (b *Broker) fallbackLocked(s Session, req uint32, reason proto.Reason) {
	b.m.Fallbacks.WithLabelValues(reason.String()).Inc()
	s.Send(proto.Msg{Type: proto.TCP, ReqID: req, Reason: reason})
}
