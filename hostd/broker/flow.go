package broker

import (
	"fmt"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// flowID names a flow while it lives: its region (the group's, or a pair
// region's id) and slot; the generation, hostd's own and never handed out
// twice in a region, tells a slot's flows apart over time.
type flowID struct {
	group  string
	region uint32
	slot   int
}

// Flow is a live flow. Its fields are guarded by the broker's mutex.
type Flow struct {
	id       flowID
	Gen      uint64
	Group    *Group
	Region   *Region // where its rings are
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
	Revoked  proto.Reason // reset (version 2 only); ReasonNone otherwise
	adopted  bool         // rebuilt from the region after a hostd restart
	conn     *Conn        // the connection it carries
	state    string       // for the shunt_flows gauge: ready, leaving
	// holds are the vsock stretches' bridges holding a side, by side
	// (stretch.go: A's at 0, B's at 1; both when both ends are vsock
	// VMs); stretched the sides a bridge ever held; ends where each
	// side's bridge stopped; stretchDown: a DOWN(peer-gone) waits for the
	// last hold's release; resume its leave by RESUME.
	holds       [2]*stretchHold
	stretched   uint32
	ends        [2]*stretchEnd
	stretchDown bool
	resume      *stretchResume
}

// Name is the flow's name in logs, listings and metrics: group/slot.gen in
// a group region, group/pID/slot.gen in pair region ID.
func (f *Flow) Name() string {
	if f.id.region == 0 {
		return fmt.Sprintf("%s/%d.%d", f.id.group, f.id.slot, f.Gen)
	}
	return fmt.Sprintf("%s/p%d/%d.%d", f.id.group, f.id.region, f.id.slot, f.Gen)
}

// flowsOfLocked counts g's flows, on either side.
func (b *Broker) flowsOfLocked(g *Guest) int {
	n := 0
	for _, f := range b.flows {
		if f.GuestA == g || f.GuestB == g {
			n++
		}
	}
	return n
}

// flowLocked finds the flow that guest g names in a message (region, slot,
// generation); nil if it is gone or is in a region g is not in.
func (b *Broker) flowLocked(g *Guest, m proto.Msg) *Flow {
	r := b.regionOfLocked(g, m.RegionID)
	if r == nil {
		return nil
	}
	f := b.flows[flowID{r.Group.Name, r.ID, int(m.Slot)}]
	if f == nil || f.Gen != m.Gen || f.Region != r {
		return nil
	}
	return f
}

// releaseLocked gives up side of f: the region frees the slot once both
// sides released it, and f's connection record learns it is on TCP. The
// side's session no longer holds f's region; when it holds none of its
// flows there, it gets UNREGION.
func (b *Broker) releaseLocked(f *Flow, side uint32) {
	if f.released&side == 0 {
		stretchEndDoneLocked(f, side)
		b.stretchResumeVMDoneLocked(f, side)
	}
	if f.released&side != 0 || stretchHeldLocked(f, side) {
		return
	}
	if side == region.SideA {
		b.unholdLocked(f.sessA, f.Region)
		f.sessA = nil
	} else {
		b.unholdLocked(f.sessB, f.Region)
		f.sessB = nil
	}
	if f.released|side == region.SideA|region.SideB {
		// Last side: what the rings carried, for listings (the
		// counters go with the slot).
		if ab, ba, err := f.Region.Pool.Stats(f.id.slot, f.Gen); err == nil && f.conn != nil {
			// Guest-reported (info.go): bounded, and marked when cut.
			wab, okA := plausible(ab.Written, f.Created)
			wba, okB := plausible(ba.Written, f.Created)
			f.conn.ringAB += wab
			f.conn.ringBA += wba
			f.conn.bogusCounts = f.conn.bogusCounts || !okA || !okB
		}
	}
	f.released |= side
	freed, err := f.Region.Pool.Release(f.id.slot, f.Gen, side)
	if err != nil {
		b.log.Warn("release failed; freeing the slot", "flow", f.Name(), "error", err)
		_ = f.Region.Pool.Free(f.id.slot, f.Gen)
		freed = true
	}
	if f.Region.Pool.Dead() {
		// hostd faulted on it: a guest truncated the region.
		defer b.revokeMemoryLocked(f.Region, reasonRetired)
	}
	if !freed {
		return
	}
	delete(b.flows, f.id)
	b.flowFreedLocked(f)
	b.m.Flows.WithLabelValues(f.state, "direct").Dec()
	b.log.Debug("flow freed", "flow", f.Name())
	if f.conn != nil {
		b.connFlowFreedLocked(f.conn, f)
	}
}

// revokeLocked resets a live flow's rings and sends REVOKE to its ends:
// only for flows of version-2 libraries adopted from an older hostd (a
// version-3 flow is downgraded, never reset).
func (b *Broker) revokeLocked(f *Flow, reason proto.Reason) {
	if f.Revoked != proto.ReasonNone {
		return
	}
	f.Revoked = reason
	b.m.Revokes.WithLabelValues(reason.String()).Inc()
	if err := f.Region.Pool.Revoke(f.id.slot, f.Gen, uint32(reason)); err != nil {
		b.log.Warn("revoke in region failed", "flow", f.Name(), "error", err)
	}
	msg := proto.Msg{Type: proto.Revoke, RegionID: f.Region.ID, Slot: uint32(f.id.slot), Gen: f.Gen, Reason: reason}
	for _, s := range []Session{f.sessA, f.sessB} {
		if s != nil && !switching(s) {
			s.Send(msg)
		}
	}
	b.log.Info("flow of a version-2 library revoked", "flow", f.Name(), "reason", reason)
}

// sessionOf is the session that holds side of f (nil: none, as for an
// adopted side not yet reattached).
func (f *Flow) sessionOf(side uint32) Session {
	if side == region.SideA {
		return f.sessA
	}
	return f.sessB
}

// goneLocked handles one side of f disappearing without a CLOSE: its
// connection moves to TCP (DOWN(peer-gone) to the survivor) and the gone
// side counts as left.
func (b *Broker) goneLocked(f *Flow, side uint32) {
	if c := f.conn; c != nil {
		b.endDoneLocked(c, side, proto.ReasonPeerGone)
		return
	}
	b.releaseLocked(f, side)
}
