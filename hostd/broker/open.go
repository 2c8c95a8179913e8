package broker

import (
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
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
	ep    uint64 // the proof epoch its lookup began in (firewall.go)
	timer *time.Timer

	onTimeout proto.Reason // the verdict if the other side does not come
	told      bool         // TCP(onTimeout) was sent already: the timeout only counts it
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
		b.tellTCP(s, m.ReqID, proto.ReasonControlLimit, true)
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
	ep := b.lookupEpoch()
	e, reason := b.verify(s.Guest(), m.Role, t)
	if reason != proto.ReasonNone {
		b.log.Debug("open refused", "guest", s.Guest().Name, "role", m.Role, "tuple", t, "reason", reason)
		b.tellTCP(s, m.ReqID, reason, true)
		return false
	}
	key := e.Reply
	h := &half{sess: s, req: m.ReqID, role: m.Role, entry: e, key: key, at: at, ep: ep}
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
		b.sawLocked(c, e, ep, at)
		if b.rejoinLocked(c, s, m.ReqID, side) {
			return false
		}
	}
	now := time.Now()
	if r, ok := b.remembered.get(key, now); ok {
		b.tellTCP(s, m.ReqID, r, false) // counted when it was decided
		return false
	}
	other := b.waiting[key]
	if other != nil && other.role == m.Role {
		// A second OPEN of the same side for one connection: refuse it.
		b.tellTCP(s, m.ReqID, proto.ReasonNotOwner, true)
		return false
	}
	if !switching(s) {
		// A version-2 library (or one without a common ring format): on
		// TCP, and its peer's OPEN learns it at once.
		b.refuseLocked(h, other, proto.ReasonVersion)
		return false
	}
	if peer, reason, ok := b.acrossLocked(s, e, m.Role); ok {
		if reason != proto.ReasonNone {
			b.log.Debug("a connection to a peer host's guest stays on TCP", "guest", s.Guest().Name, "peer", peer, "reason", reason)
			b.refuseLocked(h, other, reason)
			return false
		}
		b.offerLocked(h, peer, st) // across.go
		return true
	}
	told, onTimeout := false, proto.ReasonTimeout
	if m.Role == proto.Passive && other == nil {
		og := b.guestByAddr(e.Orig.Src.Addr())
		if og == nil {
			// An ordinary client: TCP at once. Remember it, so a late
			// OPEN of the other side gets the same verdict.
			b.log.Trace("passive open from a client that is no guest", "guest", s.Guest().Name, "orig", e.Orig)
			b.refuseLocked(h, nil, b.remoteReasonLocked(e.Orig.Src.Addr(), proto.ReasonNoIntent))
			return false
		}
		if !b.hasSessionLocked(og) {
			// A guest without a session: most likely a program not
			// under Shunt, so TCP at once; but a fresh process's
			// session may still be on its way, so the OPEN waits for
			// its peer all the same (READY may follow TCP).
			b.tellTCP(s, m.ReqID, proto.ReasonNoIntent, false)
			told, onTimeout = true, proto.ReasonNoIntent
		}
	}
	if m.Role == proto.Active {
		switch reason := b.checkActiveLocked(s.Guest(), e); {
		case reason == proto.ReasonNoListener && other == nil:
			// Most likely a server not under Shunt: TCP at once; but
			// its LISTEN may still be on its way on another session,
			// so the OPEN waits for its peer all the same.
			b.tellTCP(s, m.ReqID, reason, false)
			told, onTimeout = true, reason
		case reason != proto.ReasonNone:
			b.refuseLocked(h, other, reason)
			return false
		}
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
		b.tellTCP(s, m.ReqID, proto.ReasonNoListener, true)
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

// pairLocked records the connection of a verified active and passive
// side and moves it to the rings if it may: READY to both, or TCP(reason)
// to both, counted once.
func (b *Broker) pairLocked(a, p *half, start time.Time) {
	if b.origin(a.sess.Guest(), p.entry) != proto.ReasonNone { // the passive side's entry, too, came in by A's interface
		b.failPairLocked(a, p, proto.ReasonNotOwner)
		return
	}
	// Proof of passage from the OPENs' lookups, if both began in the
	// current epoch (a side may have reused the other's entry).
	ep := a.ep
	if p.ep != ep {
		ep = 0
	}
	if c := b.conns[a.entry.Reply]; c != nil && c.ctid == a.entry.ID && c.a.g == a.sess.Guest() && c.b.g == p.sess.Guest() {
		b.sawLocked(c, a.entry, ep, start)
		b.reannouncedLocked(c, a, p)
		return
	}
	c := b.newConnLocked(a, p)
	b.sawLocked(c, a.entry, ep, start)
	if reason := b.upgradeLocked(c, start); reason != proto.ReasonNone {
		b.tellTCP(a.sess, a.req, reason, true)
		b.tellTCP(p.sess, p.req, reason, false)
	}
}
