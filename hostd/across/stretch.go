package across

import (
	"errors"
	"time"

	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// stretch is one stay of a connection on the rings: a READY to both ends
// on each host, one link flow, one bridge per host.
type stretch struct {
	ready        proto.Msg // the relay end's READY (its ring pair)
	flow         uint32    // the link flow; 0 until named
	l            *plink
	lf           *relay.Flow
	br           *relay.Bridge
	starting     bool // waiting for the peer to open the flow
	stoppedAt    time.Time
	down         proto.Reason // why it stopped
	ours         relay.End    // where this host's out ring ended
	never        bool         // this host never started its bridge
	theirs       *peerEnd     // what the peer said of its ring; nil: not yet
	sent         bool         // ours reached the peer
	draining     bool         // its guest closed: waiting for the bridge to carry its last bytes
	drained      bool         // ... and that wait is over: the stretch stops
	peerAttached bool         // the other host's guest attached its read ring (the bridge may attach ours)
	readyAt      time.Time    // the relay end's READY: a stretch not named within readyWait is given up
	orphan       bool         // adopted from a killed hostd's relay (adopt.go): finishes once its guest reattached
	releasing    bool         // finish waits for the stopped bridge's release (its ring still read by the NIC)
}

// peerEnd is the peer's "stop": where the ring its bridge wrote ended.
type peerEnd struct {
	at    uint64
	never bool // its ring never started: the local writer resends all
	reset bool // the peer does not know the stretch: reset
}

// flowWait bounds how long a bridge waits for the peer to open the
// stretch's link flow.
const flowWait = 10 * time.Second

// readyWait bounds how long a READY waits for the peer's end to be ready
// too (its own rules may keep it on TCP): then the stretch is given up
// with reason timeout, and the peer's next READY ("up") tries again.
const readyWait = 3 * time.Second

// closeDrain bounds how long a closed guest's last bytes may take to
// reach the other host's ring before the stretch stops anyway.
const closeDrain = 5 * time.Second

// ready: the broker gave the relay end a ring pair. Tell the peer, and
// start the stretch if this host names flows and the peer wants one too.
func (r *Room) ready(x *xconn, m proto.Msg) {
	x.st = &stretch{ready: m, readyAt: time.Now()}
	x.rdy = true
	r.send(x.peer, peers.Across{Op: opUp, ID: x.id, Peer: x.peerID})
	r.maybeGo(x)
}

// up: the peer's relay end got READY. If this host's end is on TCP
// (the peer had moved it there, or this host did and may not any more),
// the broker tries the rings again.
func (r *Room) up(peer string, m peers.Across) {
	x := r.mine(peer, m)
	if x == nil {
		return
	}
	x.up = true
	if x.paired && x.st == nil && !x.rdy {
		r.b.RetryAcrossConn(x.s, x.req)
	}
	r.maybeGo(x)
}

// maybeGo names the stretch's link flow (on the host that dials).
func (r *Room) maybeGo(x *xconn) {
	if !x.rdy || !x.up || !r.peers.Dials(x.peer) {
		return
	}
	l := r.link(x.peer)
	if l.l == nil {
		return // the link's return retries (RetryAcross)
	}
	id := l.newFlow()
	if !r.send(x.peer, peers.Across{Op: opGo, ID: x.id, Peer: x.peerID, Flow: id}) {
		return
	}
	r.startStretch(x, l, id)
}

// goStretch: the dialing peer named the stretch's flow.
func (r *Room) goStretch(peer string, m peers.Across) {
	x := r.mine(peer, m)
	l := r.link(peer)
	if x == nil || !x.rdy || l.l == nil || m.Flow == 0 {
		// Nothing of this host's rings was touched: the peer ends its
		// side and resends all it wrote.
		r.send(peer, peers.Across{Op: opStop, Peer: m.ID, Flow: m.Flow, Never: true, Reason: proto.ReasonTimeout.String()})
		if l.l != nil && m.Flow != 0 && l.flows[m.Flow] == nil {
			// Take the peer's open of the flow off the link's table.
			if f, err := l.l.Open(m.Flow); err == nil {
				f.Close()
			}
		}
		return
	}
	x.up = true
	r.startStretch(x, l, m.Flow)
}

// startStretch opens the link flow and starts the bridge once the peer
// opened it too.
func (r *Room) startStretch(x *xconn, l *plink, id uint32) {
	st := x.st
	x.rdy, x.up = false, false
	x.retryAt, x.retries = time.Time{}, 0
	st.flow, st.l = id, l
	lf, err := l.l.Open(id)
	if err != nil {
		r.log.Warn("cannot open a relay link flow", "conn", x, "flow", id, "error", err)
		r.b.DowngradeAcross(x.s, x.req, proto.ReasonPeerUnreachable)
		return
	}
	l.flows[id] = x
	st.lf, st.starting = lf, true
	go func() {
		ok := lf.WaitOpen(flowWait)
		r.post(func() { r.flowOpen(x, st, ok) })
	}()
}

// flowOpen starts the bridge on the stretch's ring pair.
func (r *Room) flowOpen(x *xconn, st *stretch, ok bool) {
	st.starting = false
	if x.st != st || st.stoppedAt != (time.Time{}) {
		return // stopped meanwhile (down): it never started
	}
	if !ok {
		r.b.DowngradeAcross(x.s, x.req, proto.ReasonPeerUnreachable)
		return
	}
	in, out, err := r.rings(x.s, st.ready)
	if err != nil {
		r.log.Warn("cannot attach a relayed connection's rings", "conn", x, "error", err)
		r.b.DowngradeAcross(x.s, x.req, proto.ReasonInternal)
		return
	}
	// The guest's write ring is attached only once the other host's guest
	// attached the ring its bytes go into (HoldIn; "attached" below).
	flow := st.flow
	var vw *vmWake
	var policy *wait.Policy
	if x.guest != nil && x.guest.SharedRegion {
		vw, policy = r.vmWake(x.s, st.ready, in, out)
	}
	st.br = relay.NewBridge(in, out, st.lf, relay.BridgeOptions{Policy: policy, HoldIn: true, Region: st.region(x.s), Attached: func() {
		r.post(func() {
			if x.st == st {
				r.send(x.peer, peers.Across{Op: opAttached, ID: x.id, Peer: x.peerID, Flow: flow})
			}
		})
	}})
	if st.peerAttached {
		st.br.ReleaseIn()
	}
	br := st.br
	go func() {
		<-br.Done()
		if vw != nil {
			x.s.kicks.remove(kickKeyOf(st.ready), vw)
			vw.close()
		}
		r.post(func() { r.bridgeDone(x, st) })
	}()
	r.log.Debug("relayed connection on the rings", "conn", x, "flow", st.flow, "vm", vw != nil)
}

// region is the registration of the stretch's pair region on its link,
// for the bridge to send by reference (zerocopy.go), or nil.
func (st *stretch) region(s *session) *relay.Region {
	if st.l == nil || st.l.l == nil {
		return nil
	}
	return s.region(st.ready.RegionID, st.l.l)
}

// vmWake makes the Signal of a VM guest's bridge on (in, out), the ring
// pair of READY m, and registers it for the guest's KICKs.
func (r *Room) vmWake(s *session, m proto.Msg, in, out *ring.Ring) (*vmWake, *wait.Policy) {
	k := proto.Msg{Type: proto.Kick, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Side: m.Side}
	vw := newVMWake(in, out, func() { r.b.Kick(s, k) })
	s.kicks.add(kickKeyOf(m), vw)
	return vw, &wait.Policy{Mode: wait.Adaptive, Signal: vw}
}

// rings attaches the relay's side of a READY's ring pair: it reads the
// ring its guest writes and writes the other. The offsets and capacity
// are the broker's own record (READY), not the guest-writable directory.
func (r *Room) rings(s *session, m proto.Msg) (in, out *ring.Ring, err error) {
	return ringPair(s.regionMem(m.RegionID), m)
}

// bridgeDone: a bridge stopped by itself (its link, the peer's DOWN,
// its guest's rings, both directions left): the connection leaves the
// rings on both hosts.
func (r *Room) bridgeDone(x *xconn, st *stretch) {
	if x.st != st || st.stoppedAt != (time.Time{}) {
		return
	}
	// Stopped by its link's end: take the link down first (linkDown
	// moves this connection to TCP with the link's others). Else the
	// broker, seeing the relay still up, would pair the connection again
	// on the dead link before the link's watcher says it ended, and it
	// would leave the rings a second time once the next link is up.
	if l := st.l; l != nil && l.l != nil && l.l.Err() != nil && l.flows[st.flow] == x {
		r.linkDown(l, l.l)
		return
	}
	reason := proto.ReasonPeerUnreachable
	err := st.br.Err()
	switch d, ok := err.(relay.ErrDown); {
	case errors.Is(err, relay.ErrEnded):
		// The connection's end, not a fault: both guests' writers left
		// their rings after their last bytes, which the rings carried.
		// It leaves the rings as a closed local connection does, with
		// peer-gone (peer-unreachable would have the broker try the
		// rings again once the pair is freed, for a closing connection).
		r.log.Debug("a relayed connection ended: both guests' writers left the rings", "conn", x)
		reason = proto.ReasonPeerGone
	case ok:
		r.log.Debug("a relay bridge stopped", "conn", x, "error", err)
		reason = d.Reason
	case err != nil:
		r.log.Debug("a relay bridge stopped", "conn", x, "error", err)
	}
	r.b.DowngradeAcross(x.s, x.req, reason)
}

// down: the broker moves the connection to TCP (the relay end got DOWN).
// The bridge stops; the peer learns where this host's ring ended; once
// this host learns the same of the peer's, its guest gets RESUME.
func (r *Room) down(x *xconn, reason proto.Reason) {
	st := x.st
	x.rdy = false
	if st == nil || st.stoppedAt != (time.Time{}) || st.draining {
		return
	}
	if (x.closing || reason == proto.ReasonPeerGone && !x.gone && !stopped(st.br)) && st.br != nil && !st.drained {
		// The guest closed (or its end is gone: DOWN(peer-gone) may come
		// before the broker's CLOSE): its writer left its ring after its
		// last byte. Carry those bytes to the other host's ring first;
		// stopping now would drop them, and the other guest, whose
		// reader then takes the kernel's EOF, would see a stream cut
		// short without an error.
		st.draining = true
		br := st.br
		go func() {
			select {
			case <-br.InDone():
			case <-time.After(closeDrain):
			}
			r.post(func() { st.draining, st.drained = false, true; r.down(x, reason) })
		}()
		return
	}
	st.stoppedAt, st.down = time.Now(), reason
	switch {
	case st.br != nil:
		st.ours = st.br.Stop(reason)
	case st.flow != 0:
		st.never = true
		if st.lf != nil {
			st.lf.Down(reason)
		}
	default:
		// No flow was named: neither host touched its rings.
		st.never = true
		st.theirs = &peerEnd{never: true}
		r.finish(x)
		return
	}
	r.sendStop(x)
	if st.theirs != nil {
		r.finish(x)
	}
}

// stopped reports whether br stopped by itself (nil: no bridge).
func stopped(br *relay.Bridge) bool {
	if br == nil {
		return true
	}
	select {
	case <-br.Done():
		return true
	default:
		return false
	}
}

// sendStop tells the peer where this host's ring of the stretch ended.
func (r *Room) sendStop(x *xconn) {
	st := x.st
	grp := ""
	if x.guest != nil && x.guest.Group != nil {
		grp = x.guest.Group.Name
	}
	// The tuple lets a peer whose hostd was killed match the stop to the
	// stretch its relay left (adopt.go); older peers ignore it.
	m := peers.Across{Op: opStop, ID: x.id, Peer: x.peerID, Flow: st.flow, Reason: st.down.String(),
		Claim: &peers.Claim{Src: x.wire.Src, Dst: x.wire.Dst, Active: x.active, Group: grp}}
	if st.never || !st.ours.Started {
		m.Never = true
	} else {
		m.At = st.ours.X
	}
	st.sent = r.send(x.peer, m)
}

// stopped: the peer's bridge of a stretch stopped.
func (r *Room) stopped(peer string, m peers.Across) {
	if r.orphanStop(peer, m) {
		return
	}
	x := r.mine(peer, m)
	if x == nil || x.st == nil || x.st.flow != m.Flow {
		if !m.Gone && !m.Never && m.ID != 0 {
			// A stretch this host does not know (it restarted): the
			// peer cannot learn where its guest's bytes ended.
			r.send(peer, peers.Across{Op: opStop, Peer: m.ID, Flow: m.Flow, Gone: true})
		}
		return
	}
	st := x.st
	if m.ID != 0 {
		x.peerID = m.ID // a restarted peer's new id (adopt.go)
	}
	st.theirs = &peerEnd{at: m.At, never: m.Never, reset: m.Gone}
	if st.stoppedAt == (time.Time{}) {
		reason := reasonNamed(m.Reason)
		if m.Reason == "" || m.Gone {
			reason = proto.ReasonPeerUnreachable
		}
		if reason == proto.ReasonTimeout {
			r.retryLater(x, time.Now()) // the peer gave the stretch up before it began
		}
		r.b.DowngradeAcross(x.s, x.req, reason) // down follows, then finish
		return
	}
	r.finish(x)
}

// finish ends a stopped stretch once both hosts' ends are known and its
// bridge is released (no write of the NIC reads its ring any more): the
// guest resumes on TCP where the peer's ring ended, and the relay end
// leaves the ring pair, which frees its slot once the guest left too.
func (r *Room) finish(x *xconn) {
	st := x.st
	if st.orphan && !r.orphanReady(x) {
		return // its guest has not reattached: RESUME would not reach it
	}
	if !r.released(x, st) {
		return // the NIC may still read the guest's ring: finish comes again once it does not
	}
	at := st.theirs.at
	how := "at"
	switch {
	case st.theirs.reset:
		at, how = proto.ResumeReset, "reset"
	case st.theirs.never:
		at, how = proto.ResumeAll, "all"
	}
	r.m.resumes.WithLabelValues(x.peer, how).Inc()
	if st.br == nil {
		r.markLeft(x, st)
	}
	r.b.ResumeAcross(x.s, x.req, at)
	if st.lf != nil {
		st.lf.Close()
	}
	if st.l != nil && st.l.flows[st.flow] == x {
		delete(st.l.flows, st.flow)
	}
	m := st.ready
	r.b.Left(x.s, proto.Msg{Type: proto.Left, ReqID: m.ReqID, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Side: m.Side})
	x.st = nil
	if x.up && x.paired && !x.rdy && !x.gone && !x.closing {
		// The peer's end said "up" while this stretch was still ending
		// (up retries only a connection with no stretch): without this,
		// a READY that timed out just before the peer's came never
		// returned to the rings. Once per "up".
		x.up = false
		r.b.RetryAcrossConn(x.s, x.req)
	}
	r.maybeClose(x)
}

// released reports whether nothing reads st's ring pair any more, so
// that its guest may resume elsewhere and its slot be freed (and given to
// another connection). A stopped bridge that sent from the ring by
// reference (zero copy, RDMA) is released once the NIC wrote those
// frames (relay.Bridge.Released, bounded); until then the stretch waits,
// off the event loop: the loop never waits for the NIC, and finish runs
// again once the bridge is released. A stretch without a bridge is.
func (r *Room) released(x *xconn, st *stretch) bool {
	if st.br == nil {
		return true
	}
	rel := st.br.Released()
	select {
	case <-rel:
		return true
	default:
	}
	if !st.releasing {
		st.releasing = true
		go func() {
			<-rel
			r.post(func() {
				if x.st == st && r.conns[x.id] == x {
					r.finish(x)
				}
			})
		}()
	}
	return false
}

// peerClosed: the peer forgot the connection (its guest end is done, or
// its half stopped waiting). An unpaired one goes to TCP. A paired one
// must not just be forgotten: its guest holds a ring pair that only
// RESUME lets it leave, and the broker's record ends only once its relay
// end closes. So its stretch stops (the peer will never say where its
// ring ended: the guest's connection is reset, unless no flow was named
// and neither host touched its rings) and then the relay end closes.
func (r *Room) peerClosed(x *xconn) {
	if !x.paired {
		r.b.RefuseAcross(x.key, proto.ReasonPeerGone)
		r.forget(x)
		return
	}
	x.gone = true
	st := x.st
	switch {
	case st == nil:
		r.maybeClose(x)
	case st.stoppedAt == (time.Time{}):
		if st.flow != 0 && st.theirs == nil {
			st.theirs = &peerEnd{reset: true}
		}
		r.b.DowngradeAcross(x.s, x.req, proto.ReasonPeerGone) // down follows, then finish
	case st.theirs == nil:
		st.theirs = &peerEnd{reset: true}
		r.finish(x)
	}
}

// markLeft marks the ring the relay end writes (its guest reads) left,
// as a bridge's Stop does, for a stretch whose bridge never ran: the
// guest's reader leaves that ring, and so LEFTs the pair, only once it
// sees the mark (or, at the kernel's EOF, waits for it).
func (r *Room) markLeft(x *xconn, st *stretch) {
	_, out, err := r.rings(x.s, st.ready)
	if err != nil {
		return // no mapping of its region: nothing to mark
	}
	_ = fault.Do(func() { out.MarkLeft(&wait.Policy{}) })
}

// maybeClose ends the relay's end of a connection whose guest end is
// done, or that the peer forgot, once no stretch is in progress.
func (r *Room) maybeClose(x *xconn) {
	if !x.closing && !x.gone || x.st != nil {
		return
	}
	r.b.CloseConn(x.s, proto.Msg{Type: proto.Close, ReqID: x.req})
	if !x.gone {
		r.send(x.peer, peers.Across{Op: opClose, ID: x.id, Peer: x.peerID})
	}
	r.forget(x)
}

// attached: the other host's guest attached the ring this host's guest's
// bytes go into; this host's bridge may attach its guest's write ring.
func (r *Room) attached(peer string, m peers.Across) {
	x := r.mine(peer, m)
	if x == nil || x.st == nil || x.st.flow != m.Flow {
		return
	}
	x.st.peerAttached = true
	if x.st.br != nil {
		x.st.br.ReleaseIn()
	}
}
