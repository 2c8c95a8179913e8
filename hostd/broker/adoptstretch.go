package broker

import (
	"errors"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/wait"
)

// A vsock VM's stretch after a SIGKILLed hostd (docs/vsock.md, "hostd
// restarts"). The room's bridge died with its hostd, and so did the VM's
// vsock stream, but no byte did: a bridge frees a byte in the previous
// hop only once the next hop holds it. What the VM wrote and the room had
// not yet put into the flow's ring is still in the VM's write ring; what
// the room wrote is in the flow's ring toward the other end, in the pair
// region, which this hostd adopted; what the other end wrote and the VM
// had not acknowledged is still in the other end's ring. So the adopted
// flow leaves its rings by RESUME as a downgrade's would (stretch.go),
// with the room's part read from the region: X, where the dead bridge
// stopped writing the ring toward the other end (its start + tail), is
// the VM's RESUME; the VM's ENDED says where its read ring ended, the
// other end's RESUME. The ring toward the other end is marked left at X
// first, as the bridge's stop would have. Both RESUMEs wait until both
// ends reattached; an end that does not within the grace is gone
// (stretchResumeVMDoneLocked), and a VM that does not answer within
// stretchResumeWait resets the connection, so nothing waits unbounded.
//
// On QEMU the connection then stays on TCP (reason shutdown, not
// retried): the VM's vhost-user device died with hostd and QEMU 7.2 does
// not reconnect it. A hybrid vsock's device is the hypervisor's
// (Guest.VsockKept): the reason is firewall, as for any adopted flow, and
// the connection returns to the rings once the pair is freed. Between two vsock VMs (both sides held by rooms that died) this is
// not built: both ends are reset at their REATTACH, never left hanging.

// adoptStretchLocked makes adopted flow f, whose side vm is a vsock VM's,
// leave its rings by RESUME once both ends reattached (see above).
func (b *Broker) adoptStretchLocked(c *Conn, f *Flow, vm uint32) {
	reason := proto.ReasonShutdown // not retried: QEMU's device died with hostd
	if vm != 0 && f.guest(vm).VsockKept {
		// A hybrid device outlives hostd: the connection returns to the
		// rings (a fresh ring pair, a fresh stretch) once this pair is
		// freed and the firewall's lease check passed, as for any
		// adopted flow.
		reason = proto.ReasonFirewall
	}
	b.leaveRingsLocked(c, reason) // no session yet: it sends nothing
	r := &stretchResume{vm: vm, reason: reason, adopted: true}
	f.resume = r
	f.stretched |= vm
	var err error
	e := &stretchEnd{}
	switch {
	case vsockPair(f):
		r.broken, r.vm = true, region.SideA
		b.log.Warn("adopted a flow between two vsock VMs whose rooms died with the last hostd: not resumable, both ends are reset at their REATTACH", "flow", f.Name())
		return
	case f.released != 0:
		err = errAdoptedReleased
	default:
		e.started, e.x, e.outLeft, err = b.adoptedEndLocked(f, vm)
	}
	if err != nil {
		r.broken = true
		b.log.Warn("adopted a vsock VM's stretch that cannot resume at a known offset: its connection is reset at its REATTACH", "flow", f.Name(), "error", err)
		return
	}
	f.ends[sideIdx(vm)] = e
	then := "it stays on TCP: the VM's vhost-user device died with the last hostd (until the VM restarts)"
	if reason == proto.ReasonFirewall {
		then = "it returns to the rings after: the VM's device outlives hostd"
	}
	b.log.Info("adopted a vsock VM's stretch: its room died with the last hostd; both ends resume on TCP once reattached", "flow", f.Name(), "started", e.started, "x", e.x, "vm_left", e.outLeft, "then", then)
}

// errAdoptedReleased: an end had left the flow before hostd died, so the
// dead bridge may have been draining it; where that stream ended is not
// known.
var errAdoptedReleased = errors.New("an end had left the flow before hostd died")

// adoptedEndLocked reads where the dead room's bridge stopped writing the
// ring the VM's bytes go into (hostd's own mapping; the marks are the
// guests' to write, so checked, under the fault guard).
func (b *Broker) adoptedEndLocked(f *Flow, vm uint32) (started bool, x uint64, left bool, err error) {
	ab, ba, err := f.Region.Pool.Region().Rings(f.id.slot, f.Gen)
	if err != nil {
		return false, 0, false, err
	}
	out := ab
	if vm == region.SideB {
		out = ba
	}
	var bad error
	err = fault.Do(func() {
		s := out.Stats()
		left = s.Left
		started, _, x, bad = relay.RingEnd(s, uint64(f.Capacity))
	})
	if err == nil {
		err = bad
	}
	return started, x, left, err
}

// adoptedReattachedLocked goes on with adopted flow f's RESUME once both
// ends reattached: the ring toward the other end is marked left where
// the dead bridge stopped, and the VM gets RESUME(X); a flow that cannot
// resume resets both ends. An end that went before (adoptedEndGoneLocked)
// leaves the other one reset (or, if the VM's whole stream had reached
// the ring, told DOWN(peer-gone)) once it reattached.
func (b *Broker) adoptedReattachedLocked(c *Conn, f *Flow) {
	r := f.resume
	vmSess, otherSess := c.end(r.vm).sess, c.end(otherSide(r.vm)).sess
	switch {
	case r.vmGone:
		if !r.done && otherSess != nil {
			b.vmGoneResumeLocked(c, f)
		}
		return
	case r.otherGone:
		if !r.vmTold && vmSess != nil {
			r.vmTold, r.done = true, true
			b.sendResumeLocked(c, f, r.vm, proto.ResumeReset)
			b.log.Info("the other end of an adopted vsock stretch went before it resumed: the VM's connection is reset", "flow", f.Name())
		}
		return
	case r.vmTold || vmSess == nil || otherSess == nil:
		return
	}
	if r.broken || !resumes(vmSess) || !resumes(otherSess) {
		r.vmTold, r.done = true, true
		for _, side := range []uint32{region.SideA, region.SideB} {
			b.sendResumeLocked(c, f, side, proto.ResumeReset)
		}
		b.log.Info("an adopted vsock stretch's connection is reset", "flow", f.Name())
		return
	}
	ab, ba, err := f.Region.Pool.Region().Rings(f.id.slot, f.Gen)
	if err == nil {
		out := ab
		if r.vm == region.SideB {
			out = ba
		}
		err = fault.Do(func() { out.MarkLeft(&wait.Policy{}) })
	}
	if err != nil {
		r.broken = true
		b.adoptedReattachedLocked(c, f)
		return
	}
	off := proto.ResumeAll
	if e := f.ends[sideIdx(r.vm)]; e != nil && e.started {
		off = e.x
	}
	b.log.Info("resuming an adopted vsock stretch on TCP: the VM resends from where its dead room's bridge stopped", "flow", f.Name(), "offset", off)
	b.resumeVMLocked(c, f)
}

// adoptedEndGoneLocked: the end on side of adopted flow f went (it did not
// reattach within its grace, or closed) before the VM's RESUME.
func (b *Broker) adoptedEndGoneLocked(f *Flow, side uint32) {
	r := f.resume
	if side == r.vm {
		r.vmGone = true
	} else {
		r.otherGone = true
	}
	if c := f.conn; c != nil && c.flow == f {
		b.adoptedReattachedLocked(c, f)
	}
}

// guest is the guest on side of f.
func (f *Flow) guest(side uint32) *Guest {
	if side == region.SideB {
		return f.GuestB
	}
	return f.GuestA
}
