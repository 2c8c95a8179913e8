package broker

import (
	"fmt"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
)

// vsock stretches (docs/vsock.md, "The data path over vsock"). A VM
// without a Shunt ivshmem device is a guest with a pair region per peer
// like a process guest, but it cannot map it: its library carries each
// flow's stretch over an AF_VSOCK stream, and hostd's vsock room bridges
// the stream to the VM's side of the flow's rings. The broker's part is
// only this: hand the room the rings of a flow the VM is an end of, and
// keep the VM's side of the slot until the room's bridge let go of it, so
// that a slot is never reused under a bridge still writing its rings.
//
// A hold is per side: between two such VMs each VM's room bridges its own
// VM's stretch onto the flow's rings (A's bytes: A's ring in the VM, its
// stream, A's room bridge, the flow's ring, B's room bridge, B's stream,
// B's ring in the VM), each bridge freeing a byte only once the next hop
// holds it, so the flow's rings are the meeting point of two ordinary
// ring peers and every rule of a ring holds there unchanged.

// The bytes a stretch's bridge still carries live outside the region's
// rings (in the VM's memory, the stream, the bridge), so an end's going
// is not final there as it is on a region's rings: a reader told
// DOWN(peer-gone) leaves its ring once it is empty, and the bridge may
// still be writing into it. So while a stretch holds a flow, an end that
// is done (CLOSE, LEFT, its session or guest gone) is told to the room
// (Held.Gone or Held.PeerGone), whose bridge carries that end's last
// bytes to the other and stops; the surviving end gets its DOWN(peer-gone)
// only at the release, when its ring holds every byte and the bridge's
// leave mark. This is what the cross-host relay does for a guest that
// goes (hostd/across, Room.down).

// Held is a VM's side of a flow, held by its vsock stretch's bridge until
// Release (hostd/vsockhost.Held, field for field).
type Held struct {
	// Writes is the ring the VM writes, Reads the ring it reads.
	Writes, Reads *ring.Ring
	// Gone is closed once the VM's end is done, PeerGone once the other
	// end is.
	Gone, PeerGone <-chan struct{}
	// Release gives the side back once the bridge stopped.
	Release func()
	// Stop delivers a downgrade's reason when the connection leaves the
	// rings by RESUME (stretchResumeLocked): the room stops the bridge at
	// once (with Pair: its out-direction at once, its in-direction once
	// it carried the other VM's stretch: stretchPairResumeLocked).
	Stop <-chan proto.Reason
	// Pair: the other end is a vsock VM too, its side held by its own
	// room's bridge.
	Pair bool
	// Stopped tells the broker where the bridge's stretch ended, once it
	// stopped, whatever the reason (before Release): started and x are
	// the ring the VM writes (Writes) as the bridge wrote it, outLeft
	// whether the VM's writer's LEFT reached it (its stretch is whole),
	// inLeft whether the other end's stretch reached the VM's ring whole.
	// A Release without it means no bridge ran (nothing crossed).
	Stopped func(started bool, x uint64, outLeft, inLeft bool)
}

// stretchHold is a flow side held by a stretch's bridge.
type stretchHold struct {
	side     uint32 // region.SideA or SideB
	pending  bool   // the side was released meanwhile: release it at the end
	gone     chan struct{}
	peerGone chan struct{}
	stop     chan proto.Reason // Held.Stop: the downgrade's reason, once (stretchResumeLocked)
	stopSent bool
}

// sideIdx is side's index in a Flow's holds and ends.
func sideIdx(side uint32) int {
	if side == region.SideB {
		return 1
	}
	return 0
}

// heldLocked reports whether a stretch's bridge holds either side of f.
func heldLocked(f *Flow) bool { return f.holds[0] != nil || f.holds[1] != nil }

// Stretch holds the side of flow (regionID, slot, gen) that guest id is,
// for the vsock room's bridge: Writes is the ring that guest writes,
// Reads the ring it reads (hostd's own mapping and record, nothing the
// guest wrote). Release, called once the bridge stopped, gives the side
// back; until then a LEFT or the guest's going does not free the slot,
// and the other end is told DOWN(peer-gone) only then (once no side is
// held). It fails if guest id is not an end of that flow in a pair
// region, or its side of the flow has had a stretch already.
func (b *Broker) Stretch(id, regionID, slot uint32, gen uint64) (Held, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	g := b.guestByID(id)
	if g == nil || regionID == 0 {
		return Held{}, fmt.Errorf("guest %d: no pair region %d", id, regionID)
	}
	r := b.regionOfLocked(g, regionID)
	if r == nil || r.vm != nil {
		return Held{}, fmt.Errorf("guest %s: region %d is not one of its pair regions", g.Name, regionID)
	}
	f := b.flows[flowID{r.Group.Name, r.ID, int(slot)}]
	switch {
	case f == nil || f.Gen != gen || f.Region != r:
		return Held{}, fmt.Errorf("guest %s: no flow %d/%d.%d", g.Name, regionID, slot, gen)
	case f.resume != nil:
		// A RESUME told (or will tell) the VM that no bridge wrote its
		// rings beyond what hostd knows: a late stream must not start one.
		return Held{}, fmt.Errorf("flow %s is leaving its rings by RESUME", f.Name())
	}
	side := uint32(region.SideA)
	if f.GuestB == g && f.GuestA != g {
		side = region.SideB
	}
	if f.released&side != 0 {
		return Held{}, fmt.Errorf("flow %s: guest %s left it", f.Name(), g.Name)
	}
	if f.stretched&side != 0 {
		// Once per side: a second stream, even after the first's release,
		// would write rings whose end RESUME and the release settled.
		return Held{}, fmt.Errorf("flow %s: guest %s's side has had a stretch already", f.Name(), g.Name)
	}
	i := sideIdx(side)
	ab, ba, err := r.Pool.Region().Rings(int(slot), gen)
	if err != nil {
		return Held{}, err
	}
	writes, reads := ab, ba
	if side == region.SideB {
		writes, reads = ba, ab
	}
	h := &stretchHold{side: side, gone: make(chan struct{}), peerGone: make(chan struct{}), stop: make(chan proto.Reason, 1)}
	if f.released&otherSide(side) != 0 {
		close(h.peerGone) // the other end was done before the stretch came
	}
	f.holds[i] = h
	f.stretched |= side
	stopped := func(started bool, x uint64, outLeft, inLeft bool) {
		b.mu.Lock()
		defer b.mu.Unlock()
		if f.holds[i] != h || f.ends[i] != nil {
			return
		}
		f.ends[i] = &stretchEnd{started: started, x: x, outLeft: outLeft, inLeft: inLeft}
		if f.resume == nil && !outLeft && vsockPair(f) {
			b.pairBrokenLocked(f, side)
		}
		b.stretchStoppedLocked(f, side)
	}
	release := func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		if f.holds[i] != h {
			return
		}
		f.holds[i] = nil
		if f.resume != nil && f.ends[i] == nil {
			// The room let go without saying where the bridge stopped:
			// its stream ended before a bridge ran (the VM closed it
			// right after its Hello, or the room closed), so no bridge
			// wrote the ring. The downgrade's RESUME waited for this.
			f.ends[i] = &stretchEnd{noBridge: true}
			if f.resume.pair {
				b.markUnstartedLocked(f, side) // the other room's drain ends at once
			}
			b.stretchStoppedLocked(f, side)
		}
		if f.stretchDown && !heldLocked(f) {
			f.stretchDown = false
			b.downAtReleaseLocked(f)
		}
		if h.pending {
			b.releaseLocked(f, side)
		}
	}
	return Held{Writes: writes, Reads: reads, Gone: h.gone, PeerGone: h.peerGone, Release: release, Stop: h.stop, Pair: vsockPair(f), Stopped: stopped}, nil
}

// stretchHeldLocked reports whether side of f is held by a stretch's
// bridge, and if so marks it to be released when the bridge stops.
func stretchHeldLocked(f *Flow, side uint32) bool {
	h := f.holds[sideIdx(side)]
	if h == nil {
		return false
	}
	h.pending = true
	return true
}

// stretchEndDoneLocked tells f's stretches, if any, that the end of side
// is done: each bridge carries that end's last bytes towards the other
// (its own VM's into the flow's ring, the other's out of it), then stops
// (hostd/vsockhost).
func stretchEndDoneLocked(f *Flow, side uint32) {
	for _, h := range f.holds {
		if h == nil {
			continue
		}
		c := h.peerGone
		if side == h.side {
			c = h.gone
		}
		select {
		case <-c:
		default:
			close(c)
		}
	}
}

// deferPeerGoneLocked reports whether a DOWN(reason) to an end of f must
// wait for f's stretches' release (see above), and if so records it.
func deferPeerGoneLocked(f *Flow, reason proto.Reason) bool {
	if !heldLocked(f) || reason != proto.ReasonPeerGone {
		return false
	}
	f.stretchDown = true
	return true
}

// downAtReleaseLocked sends the DOWN(peer-gone) that waited for f's
// stretch's release to each end of f's connection still on its rings.
func (b *Broker) downAtReleaseLocked(f *Flow) {
	c := f.conn
	if c == nil || c.flow != f {
		return
	}
	down := proto.Msg{Type: proto.Down, RegionID: f.Region.ID, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: proto.ReasonPeerGone}
	for _, side := range []uint32{region.SideA, region.SideB} {
		e := c.end(side)
		if e.sess == nil || f.released&side != 0 || !switching(e.sess) {
			continue
		}
		if o := c.end(otherSide(side)); o.sess != nil && isRelay(o.sess) {
			continue
		}
		down.ReqID = e.req
		e.sess.Send(down)
	}
}

// Switching back by RESUME (docs/vsock.md, "Switching back"). A VM's
// stretch carries bytes outside the region (the VM's own rings, the
// stream, the bridges), so a downgrade cannot leave it as a region's
// rings are left, where every written byte is in the ring its reader
// drains: the bridges would have to run on, past the permission's end,
// until the readers drained. Instead, as across hosts (hostd/across),
// the downgrade stops both bridges, and each receiving side says where
// the ring it wrote ended:
//
//	downgrade ──Stop──▶ room: bridge stopped, Writes left at Xv
//	          ◀─Stopped(Xv)──
//	RESUME(Xv) ─────────────▶ VM: stops its bridge, R left at Xp
//	          ◀────────ENDED(Xp)
//	RESUME(Xp) ─────────────▶ other end
//
// Each writer then resends on TCP what the other's ring does not hold,
// from its own ring (a bridge frees a byte only once the other bridge put
// it into its ring). The VM's ENDED is untrusted: an offset its peer's
// ring does not hold resets that connection only (the peer's library
// checks it), and a VM that does not answer within stretchResumeWait, or
// goes before it answers while its own stream was cut short, resets its
// connection. Used when both ends' libraries handle RESUME; others leave
// as before (DOWN, the bridges draining).

// stretchResumeWait bounds how long the other end waits for the VM's
// ENDED before its connection is reset. A var for tests.
var stretchResumeWait = 30 * time.Second

// stretchEnd is where a flow's stretch bridge stopped (Held.Stopped).
type stretchEnd struct {
	started bool
	x       uint64
	outLeft bool
	inLeft  bool
	// noBridge: no bridge ran on the side (released without Stopped, or
	// no stretch came): its VM's ring got nothing.
	noBridge bool
}

// stretchResume is a flow leaving its rings by RESUME across its stretch.
type stretchResume struct {
	vm     uint32 // the VM's side; 0 between two VMs (pair)
	pair   bool   // both ends are vsock VMs (stretchPairResumeLocked)
	gone   uint32 // pair: the sides whose end went before its RESUME
	left   uint32 // pair: the sides whose end LEFT its rings before its RESUME (not gone: its lease goes on)
	reason proto.Reason
	vmTold bool // the VM got its RESUME (or is gone)
	vmGone bool // the VM's end went before its ENDED
	done   bool // the other end got its RESUME (or DOWN)
	timer  *time.Timer
	wait   time.Duration // stretchResumeWait when the timer started (a test may change the var meanwhile)
	// adopted: a flow adopted after a SIGKILLed hostd, its room's bridge
	// dead with it (adoptstretch.go); its RESUMEs wait for both ends'
	// REATTACH. broken: it cannot resume at a known offset (both reset).
	adopted, broken bool
	otherGone       bool // adopted: the other end went before the VM's RESUME
}

// vsockSide returns the side of f whose guest carries its flows over
// vsock stretches (a VM with a vsock block and no group region), or 0,
// also when both are (vsockPair: stretchpair.go).
func vsockSide(f *Flow) uint32 {
	a, b := vsockVM(f.GuestA), vsockVM(f.GuestB)
	switch {
	case a && !b:
		return region.SideA
	case b && !a:
		return region.SideB
	}
	return 0
}

func resumes(s Session) bool {
	r, ok := s.(Resumer)
	return ok && r.Resumes()
}

// stretchResumeLocked starts moving c off f by RESUME (see above) and
// reports whether it did; otherwise the caller sends DOWN as for any
// flow. Not for peer-gone (an end is done: the drain above), nor when an
// end's library does not handle RESUME.
func (b *Broker) stretchResumeLocked(c *Conn, f *Flow, reason proto.Reason) bool {
	if reason == proto.ReasonPeerGone || f.resume != nil || f.released != 0 {
		return false
	}
	vm := vsockSide(f)
	if vm == 0 {
		return vsockPair(f) && b.stretchPairResumeLocked(c, f, reason)
	}
	ev, eo := c.end(vm), c.end(otherSide(vm))
	if ev.sess == nil || eo.sess == nil || !resumes(ev.sess) || !resumes(eo.sess) {
		return false
	}
	f.resume = &stretchResume{vm: vm, reason: reason}
	if h := f.holds[sideIdx(vm)]; h != nil {
		if !h.stopSent {
			h.stopSent = true
			h.stop <- reason
		}
		return true // the VM's RESUME at Stopped
	}
	b.resumeVMLocked(c, f)
	return true
}

// resumeVMLocked sends the VM's end its RESUME, once the bridge's end is
// known (or no bridge holds the flow): its writer resends from where the
// bridge stopped writing Writes, everything if no bridge wrote it.
func (b *Broker) resumeVMLocked(c *Conn, f *Flow) {
	r := f.resume
	if r.vmTold {
		return
	}
	r.vmTold = true
	if f.stretched&r.vm == 0 {
		// No bridge ever held the flow (a late Hello is refused now):
		// nothing crossed either way, and neither ring started.
		b.sendResumeLocked(c, f, r.vm, proto.ResumeAll)
		b.resumeOtherLocked(c, f, proto.ResumeAll)
		return
	}
	off := proto.ResumeAll
	if e := f.ends[sideIdx(r.vm)]; e != nil && e.started {
		off = e.x
	}
	if r.vmGone || c.end(r.vm).sess == nil || f.released&r.vm != 0 {
		b.vmGoneResumeLocked(c, f)
		return
	}
	b.sendResumeLocked(c, f, r.vm, off)
	r.wait = stretchResumeWait
	r.timer = time.AfterFunc(r.wait, func() { b.stretchResumeTimeout(f, r) })
}

// sendResumeLocked sends RESUME(off) to the end of c on side, if it is
// still on f.
func (b *Broker) sendResumeLocked(c *Conn, f *Flow, side uint32, off uint64) {
	e := c.end(side)
	if e.sess == nil || f.released&side != 0 {
		return
	}
	e.sess.Send(proto.Msg{Type: proto.Resume, ReqID: e.req, RegionID: f.Region.ID, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: f.resume.reason, Offset: off})
}

// resumeOtherLocked sends the other end (not the VM) its RESUME, once.
func (b *Broker) resumeOtherLocked(c *Conn, f *Flow, off uint64) {
	r := f.resume
	if r.done {
		return
	}
	r.done = true
	if r.timer != nil {
		r.timer.Stop()
	}
	b.sendResumeLocked(c, f, otherSide(r.vm), off)
}

// vmGoneResumeLocked answers the other end when the VM's end went (CLOSE,
// LEFT, its session) before its ENDED, once the bridge's end is known. If
// the VM's writer's stretch reached the ring whole (its LEFT came through
// the bridge), the other end goes on as after any peer's going:
// DOWN(peer-gone), its reader reads the ring to the VM's leave and then
// the kernel's FIN. Otherwise where the VM's stream ended is unknown, and
// the connection is reset rather than read short with a clean EOF.
func (b *Broker) vmGoneResumeLocked(c *Conn, f *Flow) {
	r := f.resume
	if r.done {
		return
	}
	if e := f.ends[sideIdx(r.vm)]; e != nil && e.outLeft || f.stretched&r.vm == 0 {
		r.done = true
		if r.timer != nil {
			r.timer.Stop()
		}
		other := otherSide(r.vm)
		if e := c.end(other); e.sess != nil && f.released&other == 0 {
			e.sess.Send(proto.Msg{Type: proto.Down, ReqID: e.req, RegionID: f.Region.ID, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: proto.ReasonPeerGone})
		}
		return
	}
	b.log.Info("a vsock VM's end went before saying where its stretch ended: its connection is reset", "flow", f.Name())
	b.resumeOtherLocked(c, f, proto.ResumeReset)
}

// stretchResumeVMDoneLocked: the VM's end of f is done (released, closed
// or gone) while f leaves by RESUME. It reports whether that is so (the
// caller then tells the other end nothing itself).
func (b *Broker) stretchResumeVMDoneLocked(f *Flow, side uint32) bool {
	r := f.resume
	if r != nil && r.pair {
		return b.pairEndDoneLocked(f, side)
	}
	if r != nil && r.adopted && !r.vmTold {
		b.adoptedEndGoneLocked(f, side)
		return true
	}
	if r == nil || r.done || side != r.vm {
		return r != nil && side == r.vm
	}
	r.vmGone = true
	if c := f.conn; c != nil && c.flow == f && (r.vmTold || r.adopted) {
		b.vmGoneResumeLocked(c, f)
	}
	return true
}

// StretchEnded handles the VM's ENDED: the ring its stretch's bridge
// wrote (the ring it reads) ended at m.Offset. The other end gets
// RESUME(m.Offset), which its library checks against its own ring.
func (b *Broker) StretchEnded(s Session, m proto.Msg) {
	b.mu.Lock()
	defer b.mu.Unlock()
	f := b.flowLocked(s.Guest(), m)
	side := b.flowSideLocked(f, s, m)
	if side == 0 || f.resume == nil || f.resume.vm != side || !f.resume.vmTold {
		return
	}
	if c := f.conn; c != nil && c.flow == f {
		b.resumeOtherLocked(c, f, m.Offset)
	}
}

// stretchResumeTimeout resets the connection whose VM did not say where
// its stretch ended within stretchResumeWait.
func (b *Broker) stretchResumeTimeout(f *Flow, r *stretchResume) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if f.resume != r || r.done {
		return
	}
	if r.pair {
		b.pairTimeoutLocked(f)
		return
	}
	if c := f.conn; c != nil && c.flow == f {
		b.log.Info("a vsock VM did not say where its stretch ended: its connection is reset", "flow", f.Name(), "waited", r.wait)
		b.resumeOtherLocked(c, f, proto.ResumeReset)
	}
}

// stretchStoppedLocked: the bridge on side of f stopped (or let go
// without a bridge). A RESUME that waited for it goes on.
func (b *Broker) stretchStoppedLocked(f *Flow, side uint32) {
	c := f.conn
	if c == nil || c.flow != f || f.resume == nil {
		return
	}
	switch {
	case f.resume.pair:
		b.pairDecideLocked(c, f)
	case f.resume.vm == side:
		b.resumeVMLocked(c, f)
	}
}
