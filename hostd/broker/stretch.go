package broker

import (
	"fmt"

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
}

// stretchHold is a flow side held by a stretch's bridge.
type stretchHold struct {
	side     uint32 // region.SideA or SideB
	pending  bool   // the side was released meanwhile: release it at the end
	gone     chan struct{}
	peerGone chan struct{}
	down     bool // a DOWN(peer-gone) waits for the release (downAtRelease)
}

// Stretch holds the side of flow (regionID, slot, gen) that guest id is,
// for the vsock room's bridge: Writes is the ring that guest writes,
// Reads the ring it reads (hostd's own mapping and record, nothing the
// guest wrote). Release, called once the bridge stopped, gives the side
// back; until then a LEFT or the guest's going does not free the slot,
// and the other end is told DOWN(peer-gone) only then. It fails if guest
// id is not an end of that flow in a pair region, or the flow has a
// stretch already.
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
	case f.stretch != nil:
		return Held{}, fmt.Errorf("flow %s has a stretch already", f.Name())
	}
	side := uint32(region.SideA)
	if f.GuestB == g && f.GuestA != g {
		side = region.SideB
	}
	if f.released&side != 0 {
		return Held{}, fmt.Errorf("flow %s: guest %s left it", f.Name(), g.Name)
	}
	ab, ba, err := r.Pool.Region().Rings(int(slot), gen)
	if err != nil {
		return Held{}, err
	}
	writes, reads := ab, ba
	if side == region.SideB {
		writes, reads = ba, ab
	}
	h := &stretchHold{side: side, gone: make(chan struct{}), peerGone: make(chan struct{})}
	if f.released&otherSide(side) != 0 {
		close(h.peerGone) // the other end was done before the stretch came
	}
	f.stretch = h
	release := func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		if f.stretch != h {
			return
		}
		f.stretch = nil
		if h.down {
			b.downAtReleaseLocked(f)
		}
		if h.pending {
			b.releaseLocked(f, side)
		}
	}
	return Held{Writes: writes, Reads: reads, Gone: h.gone, PeerGone: h.peerGone, Release: release}, nil
}

// stretchHeldLocked reports whether side of f is held by a stretch's
// bridge, and if so marks it to be released when the bridge stops.
func stretchHeldLocked(f *Flow, side uint32) bool {
	if f.stretch == nil || f.stretch.side != side {
		return false
	}
	f.stretch.pending = true
	return true
}

// stretchEndDoneLocked tells f's stretch, if any, that the end of side
// is done: its bridge carries that end's last bytes to the other, then
// stops (hostd/vsockhost).
func stretchEndDoneLocked(f *Flow, side uint32) {
	h := f.stretch
	if h == nil {
		return
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

// deferPeerGoneLocked reports whether a DOWN(reason) to an end of f must
// wait for f's stretch's release (see above), and if so records it.
func deferPeerGoneLocked(f *Flow, reason proto.Reason) bool {
	if f.stretch == nil || reason != proto.ReasonPeerGone {
		return false
	}
	f.stretch.down = true
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
