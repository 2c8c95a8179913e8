package broker

import (
	"errors"
	"time"

	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// Ring sizes per flow. A rule may give bulk flows larger rings than the
// policy's default (ring_size in a rule). hostd's default quotas and
// regions are sized for the default ring, not for every rule's: a VM's
// quarter of a 64 MiB group region holds one flow of 4 MiB rings and
// seven of 1 MiB. So a flow whose rule's ring finds no room (the opening
// guest's quota, or space in its region) takes the verdict's floor, the
// policy's default ring_size, instead of staying on TCP (guest-quota,
// no-space): a job of many connections (an MPI job's leases) then gets
// rings for every direction, the first ones the rule's size.

// ringSizesLocked returns the ring sizes to try for a flow of verdict v
// opened by g, largest first: v's ring if g's quota has room for it, then
// v's floor (mayUpgradeLocked checked that the floor fits the quota).
func (b *Broker) ringSizesLocked(g *Guest, v policy.Verdict) []int {
	floor := ringFloor(v)
	if floor == v.RingSize {
		return []int{floor}
	}
	if !b.fitsQuotaLocked(g, v.RingSize) {
		return []int{floor}
	}
	return []int{v.RingSize, floor}
}

// ringFloor is the smallest ring a flow of verdict v may take.
func ringFloor(v policy.Verdict) int {
	if v.Floor <= 0 || v.Floor > v.RingSize {
		return v.RingSize
	}
	return v.Floor
}

// fitsQuotaLocked reports whether a new flow of capacity bytes per
// direction, opened by g, stays within its group's quota.
func (b *Broker) fitsQuotaLocked(g *Guest, capacity int) bool {
	q, u := g.Group.Quota, b.useLocked(g)
	return !(q.Flows > 0 && u.flows+1 > q.Flows || q.RingBytes > 0 && u.ringBytes+region.PairSize(capacity) > q.RingBytes)
}

// allocRingsLocked allocates a ring pair in r for a flow between ga and gb
// of verdict v: the largest of ringSizesLocked's sizes that fits.
func (b *Broker) allocRingsLocked(r *Region, c *Conn, ga, gb *Guest, v policy.Verdict) (int, region.Entry, error) {
	var (
		slot int
		e    region.Entry
		err  error
	)
	sizes := b.ringSizesLocked(ga, v)
	for _, capacity := range sizes {
		slot, e, err = r.Pool.Alloc(region.Request{
			OwnerA: ga.ID, OwnerB: gb.ID, Src: c.orig.Src, Dst: c.orig.Dst,
			Capacity: capacity, Created: time.Now().UnixNano(),
		})
		if err == nil || !errors.Is(err, region.ErrFull) {
			break
		}
	}
	if err == nil && e.Capacity < v.RingSize {
		b.m.RingFloor.Inc()
		b.log.Debug("a rule's ring finds no room: the flow takes the default ring", "rule", v.Rule, "want", v.RingSize, "ring", e.Capacity, "guest", ga.Name, "region", r.Name())
	}
	return slot, e, err
}
