package broker

import (
	"time"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/wait"
)

// Switching back between two vsock VMs (docs/vsock.md, "VM to VM"). Each
// VM's room bridges its own stretch onto the flow's ring pair, and each
// bridge frees a byte only once the next hop holds it: when the rooms
// stop, a byte of A's may be in A's ring, its stream, ring AB or B's
// stream, and only the part still in A's ring can A resend. So the
// downgrade is a two-step, stop then RESUME:
//
//	downgrade ──Stop──▶ room A: out-direction stopped, AB left at Xa;
//	                    in-direction carries BA to its mark (Xb) into A's ring
//	          ──Stop──▶ room B: the same the other way
//	          ◀─Stopped(Xa, B's stretch whole in A's ring)── room A
//	          ◀─Stopped(Xb, A's stretch whole in B's ring)── room B
//	RESUME(Xa) ──▶ VM A      RESUME(Xb) ──▶ VM B
//
// Each VM's RESUME waits until the other VM's ring is known to end at
// its X: the other room carried ring AB to the leave mark A's room set,
// and its VM's bridge acknowledged every byte (it acknowledges a byte
// only once its ring holds it). That is what an ENDED would say, known
// before either RESUME; the VMs' ENDEDs (sent as after any RESUME) are
// not needed. A's ring holds [Xa, W) (its bridge freed only what room A
// wrote), so A resends exactly what B's ring does not hold. Every wait
// is bounded: a room whose VM takes nothing for goneDrain stops its
// drain, and its stretch is not whole, so the other VM's connection is
// reset (RESUME(reset)), as is both VMs' if the rooms have not both
// answered within stretchResumeWait.
//
// A VM's reader may see its ring end (the leave mark its room carried
// there) and send LEFT before its room's Stopped reaches the broker: a
// race between the VM's control port and the room. That VM left its
// rings; it did not go (its lease goes on), so the other VM still gets
// RESUME at its exact X, as if the LEFT had come after. Only a VM gone
// (CLOSE, its session) before its RESUME makes the other's answer
// depend on whether the gone VM's stretch ended whole (issue 25: a LEFT
// was taken for a going, and a btl/shunt job ended on RESUME(reset)).

// vsockVM reports whether g carries its flows over vsock stretches: a VM
// with a vsock block and no group region.
func vsockVM(g *Guest) bool { return g.Vsock && !g.SharedRegion }

// vsockDownLocked: g carries its flows over vsock and its device has no
// front-end now (Options.VsockServed). A hybrid device is the
// hypervisor's own, which hostd cannot see: VsockServed says it is
// served (vsockhost.Room.Served); shunt-vsockd's is as the daemon says.
func (b *Broker) vsockDownLocked(g *Guest) bool {
	return vsockVM(g) && b.opts.VsockServed != nil && !b.opts.VsockServed(g.ID)
}

// vsockPair reports whether both ends of f are such VMs.
func vsockPair(f *Flow) bool { return vsockVM(f.GuestA) && vsockVM(f.GuestB) }

// bridgedPair reports whether c's flow f is between two vsock VMs whose
// libraries both handle RESUME: its READYs carry the Relayed bit, as a
// relay's pairs do (docs/vsock.md, "VM to VM"). Each VM's rings are
// written by bridges that copy bytes (its stretch, its room), never a
// record ring parsed in place, and the pair leaves by RESUME (above), so
// both ends take it by the relayed rules: btl/shunt's byte stream with
// the stretch named by its start (guestlib/mpi/csrc/relayed.c), a
// kernel EOF held while the read ring has not started. Between a VM and
// a process guest the pair is not marked: the process guest's end of a
// vsock flow is told DOWN(peer-gone) when the VM goes, which a relayed
// end takes for a reset (docs/mpi.md, "Between vsock VMs").
func bridgedPair(c *Conn, f *Flow) bool {
	return vsockPair(f) && c.a.sess != nil && c.b.sess != nil && resumes(c.a.sess) && resumes(c.b.sess)
}

var sides = [2]uint32{region.SideA, region.SideB}

// stretchPairResumeLocked starts moving c off f, a flow between two vsock
// VMs, by the two-step above, and reports whether it did (both libraries
// handle RESUME; otherwise DOWN, the bridges draining).
func (b *Broker) stretchPairResumeLocked(c *Conn, f *Flow, reason proto.Reason) bool {
	for _, side := range sides {
		if e := c.end(side); e.sess == nil || !resumes(e.sess) {
			return false
		}
	}
	r := &stretchResume{pair: true, reason: reason}
	f.resume = r
	for _, side := range sides {
		i := sideIdx(side)
		if h := f.holds[i]; h != nil {
			if !h.stopSent {
				h.stopSent = true
				h.stop <- reason
			}
			continue
		}
		if f.ends[i] != nil {
			continue
		}
		// No bridge holds this side, none ran on it (a room that ran one
		// said where it stopped), and none will (a late Hello is refused
		// now): nothing of this VM's went into the flow's ring, nor the
		// other's into its VM. Its ring is marked left unstarted, so that
		// the other room's drain ends at once (a LEFT before a start)
		// instead of at its bound.
		f.ends[i] = &stretchEnd{noBridge: true}
		b.markUnstartedLocked(f, side)
	}
	r.wait = stretchResumeWait
	r.timer = time.AfterFunc(r.wait, func() { b.stretchResumeTimeout(f, r) })
	b.pairDecideLocked(c, f)
	return true
}

// markUnstartedLocked marks the ring side of f writes left, never started.
func (b *Broker) markUnstartedLocked(f *Flow, side uint32) {
	ab, ba, err := f.Region.Pool.Region().Rings(f.id.slot, f.Gen)
	if err != nil {
		return
	}
	w := ab
	if side == region.SideB {
		w = ba
	}
	_ = fault.Do(func() { w.MarkLeft(&wait.Policy{}) })
}

// pairDecideLocked sends each VM of f its RESUME once both rooms said
// where their bridges stopped (see above).
func (b *Broker) pairDecideLocked(c *Conn, f *Flow) {
	r := f.resume
	if r.done || f.ends[0] == nil || f.ends[1] == nil {
		return
	}
	r.done = true
	if r.timer != nil {
		r.timer.Stop()
	}
	left := func(side uint32) bool { return r.left&side != 0 }
	live := func(side uint32) bool {
		return !left(side) && r.gone&side == 0 && c.end(side).sess != nil && f.released&side == 0
	}
	for _, s := range sides {
		if !live(s) {
			continue
		}
		o := otherSide(s)
		es, eo := f.ends[sideIdx(s)], f.ends[sideIdx(o)]
		if left(o) {
			// The other VM LEFT its rings before its RESUME: its reader
			// read its ring to the leave mark its room wrote there, its
			// end goes on on its lease (btl/shunt does so on a lease it
			// only reads). s resends from where that ring ended, as if
			// the other had had its RESUME; only if the other's own
			// stretch started and is not whole in s's ring are bytes
			// lost (the other, having left, resends none of it).
			if eo.started && !(eo.outLeft && es.inLeft) {
				b.log.Info("a vsock VM left its rings before its RESUME while its own stretch had not reached the other VM whole: its bytes past the stop cannot be resent, the other VM's connection is reset",
					"flow", f.Name(), "stopped_at", eo.x)
				b.sendResumeLocked(c, f, s, proto.ResumeReset)
				continue
			}
			b.log.Debug("a vsock VM left its rings before its room said where its bridge stopped: the other VM resumes at its exact offset", "flow", f.Name())
		} else if !live(o) {
			// The other VM went before its RESUME: s reads its ring to
			// the other's leave mark, whole only if the other's writer's
			// LEFT reached the flow's ring and s's room carried it.
			if eo.outLeft && es.inLeft {
				e := c.end(s)
				e.sess.Send(proto.Msg{Type: proto.Down, ReqID: e.req, RegionID: f.Region.ID, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: proto.ReasonPeerGone})
			} else {
				b.log.Info("a vsock VM's end went before its stretch ended whole: the other VM's connection is reset", "flow", f.Name())
				b.sendResumeLocked(c, f, s, proto.ResumeReset)
			}
			continue
		}
		off := proto.ResumeAll
		switch {
		case !es.started:
			// Nothing of s's went into the flow's ring.
		case eo.noBridge:
			// The other VM's ring got nothing: s resends all it wrote, if
			// its ring still holds it (its library resets otherwise).
		case !eo.inLeft:
			// The other room's drain was cut: where the other VM's ring
			// ended is unknown.
			off = proto.ResumeReset
			b.log.Info("a vsock VM's room did not carry the other VM's stretch whole into its ring: the connection is reset", "flow", f.Name())
		case es.started:
			off = es.x
		}
		b.sendResumeLocked(c, f, s, off)
	}
}

// pairEndDoneLocked: the end of side went, or LEFT its rings (Left marks
// r.left first), while f leaves by the two-step. It reports true: the
// two-step tells the other VM (pairDecideLocked).
func (b *Broker) pairEndDoneLocked(f *Flow, side uint32) bool {
	r := f.resume
	if r.done {
		return true
	}
	if r.left&side == 0 {
		r.gone |= side // a LEFT end that closes afterwards stays left
	}
	if c := f.conn; c != nil && c.flow == f {
		b.pairDecideLocked(c, f)
	}
	return true
}

// pairTimeoutLocked resets both VMs' connection: the rooms did not both
// say where their bridges stopped within stretchResumeWait.
func (b *Broker) pairTimeoutLocked(f *Flow) {
	r := f.resume
	r.done = true
	c := f.conn
	if c == nil || c.flow != f {
		return
	}
	b.log.Info("the vsock rooms of two VMs did not stop their bridges in time: the connection is reset", "flow", f.Name(), "waited", r.wait)
	for _, s := range sides {
		if (r.gone|r.left)&s == 0 {
			b.sendResumeLocked(c, f, s, proto.ResumeReset)
		}
	}
}

// pairBrokenLocked: the bridge on side of f stopped, outside a downgrade,
// without its VM's writer's LEFT in the flow's ring (the VM's program
// killed, its stream broken, a drain of its last bytes cut). Its room
// reset that ring, as for a process guest, whose reader then fails with
// ECONNRESET; but the other VM reads a ring of its own, in its memory,
// which no room can reset, and would take the bytes that crossed and its
// peer's FIN for a clean end. So its library is told: RESUME(reset), and
// its program reads ECONNRESET. Not when the other end is done already
// (its room's drain after that is no break of this side).
func (b *Broker) pairBrokenLocked(f *Flow, side uint32) {
	c := f.conn
	if c == nil || c.flow != f {
		return
	}
	o := otherSide(side)
	e := c.end(o)
	if e.sess == nil || f.released&o != 0 || !resumes(e.sess) {
		return
	}
	if h := f.holds[sideIdx(o)]; h != nil && h.pending {
		return
	}
	b.log.Info("a vsock VM's stretch broke before its writer's end: the other VM's connection is reset", "flow", f.Name())
	e.sess.Send(proto.Msg{Type: proto.Resume, ReqID: e.req, RegionID: f.Region.ID, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: proto.ReasonPeerGone, Offset: proto.ResumeReset})
}
