package preflight

import (
	"context"
	"fmt"

	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// fewConns is below how many concurrent fast-path connections per guest
// the quotas finding is a warning, for a group of process guests (pair
// regions): a server with more clients at once sees the rest stay on TCP
// (guest-quota, no-space).
const fewConns = 16

// checkQuotas says, for each trust group, how many concurrent fast-path
// connections of the policy's ring_size each guest may hold, and which of
// the limits binds: its quota of ring memory and of flows, the policy's
// max_flows_per_guest, and what one pair region (one peer) holds.
func checkQuotas(_ context.Context, e *env) {
	ring := policy.DefaultRingSize
	if e.cfg.Policy.RingSize != "" {
		ring, _ = policy.ParseRingSize(e.cfg.Policy.RingSize) // loading checked it
	}
	maxFlows := 1024
	if tab, err := policy.Compile(e.cfg.Policy); err == nil {
		maxFlows = tab.MaxFlowsPerGuest()
	}
	pair := region.PairSize(ring)
	for _, g := range e.cfg.Groups {
		n, by := quotaConns(g, pair, maxFlows)
		what := fmt.Sprintf("trust group %s: each guest may hold %d concurrent fast-path connections of ring_size %s (bound by %s; guest_ring_bytes %s, guest_flows %d, max_flows_per_guest %d, pair_region_size %s); beyond, they stay on TCP (guest-quota, no-space); a rule's larger ring_size is given where there is room, this one where there is not",
			g.Name, n, size(int64(ring)), by, size(g.Quota.RingBytes), g.Quota.Flows, maxFlows, size(g.PairGeometry.Size))
		if e.cfg.SharesRegion(g.Name) {
			e.ok("%s; VMs share the group region, and by default each guest may take a quarter of it", what)
			continue
		}
		if n < fewConns {
			e.warn(what, fmt.Sprintf("raise guest_ring_bytes, guest_flows or pair_region_size in trust_group %q (or lower ring_size), so that servers with many clients keep them on the rings", g.Name))
			continue
		}
		e.ok("%s", what)
	}
}

// quotaConns is how many flows of pair bytes each guest of g may hold with
// one peer, and the limit that binds.
func quotaConns(g config.Group, pair int64, maxFlows int) (int, string) {
	n, by := int(g.Quota.RingBytes/pair), "guest_ring_bytes"
	if g.Quota.Flows < n {
		n, by = g.Quota.Flows, "guest_flows"
	}
	if maxFlows < n {
		n, by = maxFlows, "max_flows_per_guest"
	}
	if l, err := region.LayoutFor(g.PairGeometry); err == nil {
		if k := min(int(l.HeapSize/pair), g.PairGeometry.Slots); k < n {
			n, by = k, "pair_region_size (per peer)"
		}
	}
	return n, by
}
