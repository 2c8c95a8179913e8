package broker

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// Session is one control channel of a guest. Send must not block: it queues
// the message, and drops the session if the guest does not keep up.
type Session interface {
	Send(m proto.Msg)
	Guest() *Guest
}

// Guest is a configured guest.
type Guest struct {
	Name    string
	ID      uint32
	Group   *Group
	CTMark  uint32 // 0: not checked
	Ifindex int    // host-side interface, for the eBPF witness; 0: none
	Source  string // where it was declared: "config" or "libvirt"

	addrs atomic.Pointer[Addrs] // what it owns; swapped whole
}

// Addrs is what a guest owns: the prefixes routed to it (single addresses
// are full-length prefixes), except the host's own addresses on its link.
type Addrs struct {
	Prefixes []netip.Prefix
	Except   []netip.Addr
}

// SetAddrs replaces the addresses the guest owns. Safe for concurrent use.
func (g *Guest) SetAddrs(a Addrs) { g.addrs.Store(&a) }

// Prefixes returns the prefixes the guest owns.
func (g *Guest) Prefixes() []netip.Prefix {
	if a := g.addrs.Load(); a != nil {
		return a.Prefixes
	}
	return nil
}

// Owns reports whether a is one of the guest's addresses.
func (g *Guest) Owns(a netip.Addr) bool {
	as := g.addrs.Load()
	if as == nil {
		return false
	}
	a = a.Unmap()
	for _, x := range as.Except {
		if x == a {
			return false
		}
	}
	for _, p := range as.Prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// Group is a trust group and its region.
type Group struct {
	Name   string
	Region string // path, for WELCOME
	Pool   *region.Pool
}

// Options tune the broker.
type Options struct {
	PairingTimeout time.Duration // how long one side waits for the other
	LookupTimeout  time.Duration // how long to wait for conntrack to show ESTABLISHED
	RememberFor    time.Duration // how long a timeout verdict is remembered
	// IntentGrace is how long a passive side waits for a local guest's
	// INTENT that may be in flight; 0 = 50ms.
	IntentGrace time.Duration
	// Witness, if set, must have seen the connection's SYN enter through
	// the active guest's own interface (hostd/witness).
	Witness interface {
		Origin(src, dst netip.AddrPort) (int, error)
	}
}

// Broker is the flow broker. It is safe for concurrent use; Close stops its
// timers and goroutines and waits for them.
type Broker struct {
	log    hclog.Logger
	ct     ctrack.Tracker
	m      *metrics.Set
	opts   Options
	policy atomic.Pointer[policy.Table]
	wg     sync.WaitGroup

	mu         sync.Mutex
	closed     bool
	guests     []*Guest
	sessions   map[Session]*sessionState
	intents    map[ctrack.Tuple]time.Time  // A's view -> expiry
	waiting    map[ctrack.Tuple]*half      // by conntrack reply tuple
	remembered map[ctrack.Tuple]remembered // by conntrack reply tuple
	flows      map[flowID]*Flow            // live flows
	byKey      map[ctrack.Tuple]*Flow      // by conntrack reply tuple
}

type sessionState struct {
	listens map[netip.AddrPort]bool
}

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

type flowID struct {
	group string
	slot  int
}

// Flow is a live flow. Its fields are guarded by the broker's mutex.
type Flow struct {
	id       flowID
	Gen      uint64
	Group    *Group
	GuestA   *Guest
	GuestB   *Guest
	sessA    Session // nil when that side released it or is gone
	sessB    Session
	released uint32       // region.SideA | region.SideB
	Orig     ctrack.Tuple // A's view
	Key      ctrack.Tuple // conntrack reply tuple; zero until known (after adoption)
	CTID     uint32       // the conntrack entry's id, to tell it from a later entry with the same tuple
	Capacity int
	Created  time.Time
	Rule     string
	Revoked  proto.Reason // ReasonNone while live
	adopted  bool         // rebuilt from the region after a hostd restart
}

// New returns a broker over the given guests, conntrack and policy.
func New(log hclog.Logger, ct ctrack.Tracker, m *metrics.Set, pol *policy.Table, guests []*Guest, opts Options) *Broker {
	if opts.PairingTimeout <= 0 {
		opts.PairingTimeout = 2 * time.Second
	}
	if opts.LookupTimeout <= 0 {
		opts.LookupTimeout = 200 * time.Millisecond
	}
	if opts.IntentGrace <= 0 {
		opts.IntentGrace = 50 * time.Millisecond
	}
	if opts.RememberFor <= 0 {
		opts.RememberFor = 30 * time.Second
	}
	b := &Broker{
		log: log, ct: ct, m: m, opts: opts, guests: guests,
		sessions: map[Session]*sessionState{}, intents: map[ctrack.Tuple]time.Time{},
		waiting: map[ctrack.Tuple]*half{}, remembered: map[ctrack.Tuple]remembered{},
		flows: map[flowID]*Flow{}, byKey: map[ctrack.Tuple]*Flow{},
	}
	b.policy.Store(pol)
	return b
}

// Close stops the broker without revoking anything: flows keep running while
// hostd is away, and the next hostd adopts them. It waits for pending work.
func (b *Broker) Close() {
	b.mu.Lock()
	b.closed = true
	for _, h := range b.waiting {
		h.timer.Stop()
	}
	b.mu.Unlock()
	b.wg.Wait()
}

// AddGuest registers a guest that appeared while hostd runs (a libvirt
// domain that started). Its name and ID must be new.
func (b *Broker) AddGuest(g *Guest) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, o := range b.guests {
		if o.Name == g.Name || o.ID == g.ID {
			return fmt.Errorf("guest %s (id %d) clashes with guest %s (id %d)", g.Name, g.ID, o.Name, o.ID)
		}
	}
	b.guests = append(b.guests, g)
	return nil
}

// RemoveGuest forgets a guest that went away (its domain stopped): its
// flows are revoked and released on its side, so the peers see ECONNRESET
// and the rings go back to the pool once the peers close. Its sessions are
// the control server's to close.
func (b *Broker) RemoveGuest(g *Guest) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, o := range b.guests {
		if o == g {
			b.guests = append(b.guests[:i:i], b.guests[i+1:]...)
			break
		}
	}
	for _, f := range b.flows {
		if f.GuestA == g && f.released&region.SideA == 0 {
			b.goneLocked(f, region.SideA)
		}
		if f.GuestB == g && f.released&region.SideB == 0 {
			b.goneLocked(f, region.SideB)
		}
	}
}

func (b *Broker) guestByAddr(a netip.Addr) *Guest {
	for _, g := range b.guests {
		if g.Owns(a) {
			return g
		}
	}
	return nil
}

// Attach registers a new session of a guest.
func (b *Broker) Attach(s Session) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.sessions[s] = &sessionState{listens: map[netip.AddrPort]bool{}}
}

// Detach removes a session whose guest went away: its listeners and waiting
// opens go, and its flows are revoked (the peer sees ECONNRESET) and
// released on its side. A no-op once the broker is closed (hostd stopping
// is not the guest going away).
func (b *Broker) Detach(s Session) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	delete(b.sessions, s)
	for k, h := range b.waiting {
		if h.sess == s {
			h.timer.Stop()
			delete(b.waiting, k)
		}
	}
	for _, f := range b.flows {
		if f.sessA == s {
			b.goneLocked(f, region.SideA)
		}
		if f.sessB == s {
			b.goneLocked(f, region.SideB)
		}
	}
}

// goneLocked handles one side of f disappearing without a CLOSE.
func (b *Broker) goneLocked(f *Flow, side uint32) {
	b.revokeLocked(f, proto.ReasonPeerGone)
	b.releaseLocked(f, side)
}

// Listen records that s accepts connections on addr (the unspecified
// address means all of the guest's addresses).
func (b *Broker) Listen(s Session, addr netip.AddrPort, on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if st := b.sessions[s]; st != nil {
		if on {
			st.listens[addr] = true
		} else {
			delete(st.listens, addr)
		}
	}
}

// listeningLocked reports whether any session of g listens on addr.
func (b *Broker) listeningLocked(g *Guest, addr netip.AddrPort) bool {
	any4 := netip.AddrPortFrom(netip.IPv4Unspecified(), addr.Port())
	any6 := netip.AddrPortFrom(netip.IPv6Unspecified(), addr.Port())
	for s, st := range b.sessions {
		if s.Guest() == g && (st.listens[addr] || st.listens[any4] || st.listens[any6]) {
			return true
		}
	}
	return false
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
	e, reason := b.verifyOrReuse(s.Guest(), m.Role, t)
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

// verifyOrReuse verifies a claim, reusing the entry that the other side's
// verified OPEN already fetched when the claim is exactly that entry's other
// direction (one conntrack lookup per connection instead of two).
func (b *Broker) verifyOrReuse(g *Guest, role proto.Role, t ctrack.Tuple) (ctrack.Entry, proto.Reason) {
	if g.Owns(t.Src.Addr()) && !t.Src.Addr().IsLoopback() {
		b.mu.Lock()
		var key ctrack.Tuple
		if role == proto.Passive {
			key = t // B's view is the reply tuple itself
		}
		if role == proto.Active {
			// A's reply tuple is unknown before a lookup; find a waiting
			// passive side whose entry has t as its original direction.
			for k, h := range b.waiting {
				if h.role == proto.Passive && h.entry.Orig == t {
					key = k
					break
				}
			}
		}
		h := b.waiting[key]
		b.mu.Unlock()
		if h != nil && h.role != role {
			e := h.entry
			mine := e.Orig
			if role == proto.Passive {
				mine = e.Reply
			}
			if mine == t && (role != proto.Active || g.CTMark == 0 || e.Mark == g.CTMark) {
				return e, proto.ReasonNone
			}
		}
	}
	return b.verify(g, role, t)
}

// verify checks one side's claim against conntrack, without the lock.
func (b *Broker) verify(g *Guest, role proto.Role, t ctrack.Tuple) (ctrack.Entry, proto.Reason) {
	if t.Dst.Addr().IsLoopback() || t.Src.Addr().IsLoopback() {
		return ctrack.Entry{}, proto.ReasonLoopback
	}
	if !g.Owns(t.Src.Addr()) {
		return ctrack.Entry{}, proto.ReasonNotOwner
	}
	var e ctrack.Entry
	var err error
	deadline := time.Now().Add(b.opts.LookupTimeout)
	for delay, tries := 100*time.Microsecond, 1; ; delay, tries = min(2*delay, 10*time.Millisecond), tries+1 {
		e, err = b.ct.Lookup(t)
		if err == nil && e.Established() {
			if tries > 1 {
				b.log.Debug("conntrack entry established after retries", "tuple", t, "tries", tries, "state", e.TCPState)
			}
			break
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
	mine := e.Orig
	if role == proto.Passive {
		mine = e.Reply
	}
	if mine != t {
		return e, proto.ReasonNotOwner
	}
	if role == proto.Active && g.CTMark != 0 && e.Mark != g.CTMark {
		return e, proto.ReasonNotOwner
	}
	if role == proto.Active && b.opts.Witness != nil && g.Ifindex != 0 {
		if in, err := b.opts.Witness.Origin(t.Src, t.Dst); err != nil || in != g.Ifindex {
			b.log.Warn("the connection's SYN did not come in by the claiming guest's interface", "guest", g.Name, "tuple", t, "ifindex", in, "error", err)
			return e, proto.ReasonNotOwner
		}
	}
	return e, proto.ReasonNone
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

func (b *Broker) flowsOfLocked(g *Guest) int {
	n := 0
	for _, f := range b.flows {
		if f.GuestA == g || f.GuestB == g {
			n++
		}
	}
	return n
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

func (b *Broker) hasSessionLocked(g *Guest) bool {
	for s := range b.sessions {
		if s.Guest() == g {
			return true
		}
	}
	return false
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

// Close handles a CLOSE: side of flow (slot, gen) is done with it.
func (b *Broker) CloseFlow(s Session, m proto.Msg) {
	b.mu.Lock()
	defer b.mu.Unlock()
	f := b.flowLocked(s.Guest().Group, int(m.Slot), m.Gen)
	if f == nil {
		return
	}
	switch {
	case m.Side == proto.SideA && f.GuestA == s.Guest():
		b.releaseLocked(f, region.SideA)
	case m.Side == proto.SideB && f.GuestB == s.Guest():
		b.releaseLocked(f, region.SideB)
	}
}

func (b *Broker) flowLocked(g *Group, slot int, gen uint64) *Flow {
	f := b.flows[flowID{g.Name, slot}]
	if f == nil || f.Gen != gen {
		return nil
	}
	return f
}

func (b *Broker) releaseLocked(f *Flow, side uint32) {
	if side == region.SideA {
		f.sessA = nil
	} else {
		f.sessB = nil
	}
	f.released |= side
	freed, err := f.Group.Pool.Release(f.id.slot, f.Gen, side)
	if err != nil {
		b.log.Warn("release failed; freeing the slot", "flow", f.Name(), "error", err)
		_ = f.Group.Pool.Free(f.id.slot, f.Gen)
		freed = true
	}
	if !freed {
		return
	}
	delete(b.flows, f.id)
	if b.byKey[f.Key] == f {
		delete(b.byKey, f.Key)
	}
	state := "ready"
	if f.Revoked != proto.ReasonNone {
		state = "revoked"
	}
	b.m.Flows.WithLabelValues(state, "direct").Dec()
	b.log.Debug("flow freed", "flow", f.Name())
}

// revokeLocked revokes a live flow and tells both sides.
func (b *Broker) revokeLocked(f *Flow, reason proto.Reason) {
	if f.Revoked != proto.ReasonNone {
		return
	}
	f.Revoked = reason
	// Count first: the ring reset below wakes the ends at once, and what
	// they (or an operator) see next should already be in the metrics.
	b.m.Revokes.WithLabelValues(reason.String()).Inc()
	b.m.Flows.WithLabelValues("ready", "direct").Dec()
	b.m.Flows.WithLabelValues("revoked", "direct").Inc()
	if err := f.Group.Pool.Revoke(f.id.slot, f.Gen, uint32(reason)); err != nil {
		b.log.Warn("revoke in region failed", "flow", f.Name(), "error", err)
	}
	msg := proto.Msg{Type: proto.Revoke, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: reason}
	for _, s := range []Session{f.sessA, f.sessB} {
		if s != nil {
			s.Send(msg)
		}
	}
	b.log.Info("flow revoked", "flow", f.Name(), "reason", reason)
}

// Name is the flow's name in logs, listings and metrics: group/slot.gen.
func (f *Flow) Name() string { return fmt.Sprintf("%s/%d.%d", f.id.group, f.id.slot, f.Gen) }
