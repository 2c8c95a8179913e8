package broker

import (
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// Memory that cannot outlive its permission (docs/region.md,
// "Revocation"). A DOWN is advisory: two colluding guests can ignore it
// and keep exchanging bytes through the rings they map. So when a flow
// loses its permission (policy, firewall, conntrack), its pair region is
// retired: it takes no new flow (the pair's next one gets a fresh
// region), its other flows are moved to TCP (and back to the rings, in a
// fresh region, once their ring pairs are freed), and once every flow in
// it was freed (both ends LEFT or closed) or RevokeGrace passed,
// whichever is first, hostd drops it: a process pair's memfd is
// truncated to nothing (every mapping of it faults; the libraries fail
// over cleanly, internal/fault and guestlib/c/fault.c), a VM pair's
// device is unplugged from both VMs. A group region is one principal
// and is never retired.

// DefaultRevokeGrace is Options.RevokeGrace's default: how long the ends
// of a retired region's flows have to leave its rings before hostd takes
// the memory away. The Go and preload libraries leave within milliseconds
// of DOWN (a reader keeps what its ring held); an Open MPI rank leaves at
// its next call into MPI, so the default leaves room for a compute phase.
const DefaultRevokeGrace = 30 * time.Second

// reasonRetired marks a connection moved to TCP because its pair region
// was retired (another flow in it lost its permission, or a guest
// truncated it): it goes back to the rings, in a fresh region, once its
// ring pair is freed. The broker's own: DOWN says shutdown ("hostd gave
// up the flow's region"); listings say "region-retired".
const reasonRetired = proto.Reason(0xfffe)

// revokesMemory are the downgrade reasons that mean the flow may no
// longer use shared memory at all: its region is retired.
var revokesMemory = map[proto.Reason]bool{
	proto.ReasonPolicy: true, proto.ReasonPolicyReload: true,
	proto.ReasonFirewall: true, proto.ReasonConntrackGone: true,
}

func (b *Broker) revokeGrace() time.Duration {
	if d := b.opts.RevokeGrace; d > 0 {
		return d
	}
	return DefaultRevokeGrace
}

// revokeMemoryLocked retires pair region r for reason (see above); the
// firewall, policy and conntrack code reach it through downgradeLocked.
// Idempotent; a group region is left alone.
func (b *Broker) revokeMemoryLocked(r *Region, reason proto.Reason) {
	if r == nil || r.ID == 0 || r.retired {
		return
	}
	r.retired = true
	rg := b.rgLocked()
	if key, _, _ := pairKey(r.A, r.B); rg.byPair[key] == r {
		delete(rg.byPair, key) // the pair's next flow gets a fresh region
	}
	if r.linger != nil {
		r.linger.Stop()
		r.linger = nil
	}
	moved := 0
	for _, f := range b.flows {
		if f.Region != r || f.conn == nil || f.conn.path != PathRings {
			continue
		}
		if b.downgradeLocked(f.conn, proto.ReasonShutdown) {
			f.conn.reason = reasonRetired
			moved++
		}
	}
	b.log.Info("pair region retired: its memory is taken back once its flows left it, or after the grace", "region", r.Name(),
		"reason", reasonName(reason), "flows", r.flows, "moved", moved, "grace", b.revokeGrace())
	if r.flows == 0 {
		b.dropRetiredLocked(r)
		return
	}
	var t *time.Timer
	t = time.AfterFunc(b.revokeGrace(), func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		if r.grace == t && !b.closed {
			r.grace = nil
			b.graceOverLocked(r)
		}
	})
	r.grace = t
}

// graceOverLocked frees every flow still in retired region r, whatever
// its ends did, which drops r.
func (b *Broker) graceOverLocked(r *Region) {
	var left []*Flow
	for _, f := range b.flows {
		if f.Region == r {
			left = append(left, f)
		}
	}
	if len(left) > 0 {
		b.log.Warn("grace over: the flows still in a retired region lose it", "region", r.Name(), "flows", len(left))
	}
	for _, f := range left {
		for _, side := range []uint32{region.SideA, region.SideB} {
			if f.released&side == 0 {
				b.releaseLocked(f, side) // the last one frees f; the last flow drops r
			}
		}
	}
	if r.flows <= 0 {
		b.dropRetiredLocked(r)
	}
}

// dropRetiredLocked drops retired region r at once (no linger).
func (b *Broker) dropRetiredLocked(r *Region) {
	if r.grace != nil {
		r.grace.Stop()
		r.grace = nil
	}
	b.dropRegionLocked(r)
}

// regionGoneLocked reports whether pair region r's memory is gone: hostd
// faulted on it, or (a process pair's memfd) a guest shrank it. A region
// in that state is retired: its flows cannot go on.
func (b *Broker) regionGoneLocked(r *Region) bool {
	if r.ID == 0 || r.retired {
		return false
	}
	if r.Pool.Dead() {
		return true
	}
	if r.vm != nil || r.File == nil {
		return false
	}
	st, err := r.File.Stat()
	return err == nil && st.Size() < r.Pool.Region().Layout().Size
}
