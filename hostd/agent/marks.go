package agent

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/mark"
)

// startMarks installs hostd's nftables table (hostd/mark): its proof
// chains, which show that a connection's packets pass the operator's
// filter (unless watch_ruleset is off), and, unless ownership says hostd
// does not mark, one rule per configured guest that gives its new
// connections its mark id; the broker then checks each guest's mark id
// in the configured bits of the conntrack mark. It runs once the guests
// are known to be valid (no overlap), so that a hostd that cannot start
// leaves the table of one that runs alone.
func (a *Agent) startMarks() error {
	a.ownershipMetrics()
	if !a.cfg.Marks() {
		a.log.Warn("hostd does not mark guests' connections (ownership = \"" + a.cfg.Ownership + "\"): a guest's claim to a connection rests on its source address" +
			map[bool]string{true: " and the eBPF witness", false: " alone"}[a.cfg.Witness])
	}
	if !a.cfg.Marks() && !a.cfg.WatchRuleset {
		a.log.Warn("watch_ruleset = false: a firewall change does not move connections off the rings, and nothing checks that their packets still pass the filter")
		return nil
	}
	m, err := mark.Open(mark.Options{Netns: a.cfg.ConntrackNetns, Mask: a.cfg.CTMarkMask, Log: a.log.Named("mark")})
	if err != nil {
		return err
	}
	a.marks = m
	if !a.cfg.Marks() {
		return nil
	}
	ifname := map[string]string{}
	for _, gc := range a.cfg.Guests {
		ifname[gc.Name] = gc.Interface
	}
	for _, r := range a.rt.byName { // restored run-time guests
		ifname[r.spec.Name] = r.spec.Interface
	}
	for _, g := range a.guests {
		if err := a.markGuest(g, ifname[g.Name]); err != nil {
			return err
		}
	}
	return nil
}

// markGuest gives g its mark id on its interface, before g is registered.
// A guest without an interface has no proof of origin but its addresses.
func (a *Agent) markGuest(g *broker.Guest, ifname string) error {
	switch {
	case a.marks == nil || a.cfg != nil && !a.cfg.Marks():
		return nil
	case g.CTMark&a.marks.Field().Mask != 0:
		return fmt.Errorf("guest %s: ct_mark %#x uses bits of ct_mark_mask %#08x, which hostd sets itself: drop the ct-mark, or move ct_mark_mask", g.Name, g.CTMark, a.marks.Field().Mask)
	case ifname == "":
		a.log.Info("guest has no interface: hostd cannot mark its connections, and its claims rest on its addresses alone", "guest", g.Name)
		return nil
	}
	e, err := a.marks.Add(g.Name, g.ID, ifname)
	if err != nil {
		return err
	}
	g.Mark = e.Value
	return nil
}

// unmarkGuest takes away the rule of g, a guest that went or was refused.
func (a *Agent) unmarkGuest(g *broker.Guest) {
	if a.marks != nil && g.Mark != 0 {
		a.marks.Remove(g.Name)
	}
}

// markMask is what the broker compares guests' mark ids in: 0 when hostd
// does not mark (then a ct_mark is the whole mark, as before).
func (a *Agent) markMask() uint32 {
	if a.marks == nil || !a.cfg.Marks() {
		return 0
	}
	return a.marks.Field().IDMask()
}

// proofBits are the conntrack mark bits of hostd's proof chains, for the
// broker: none without the ruleset watch.
func (a *Agent) proofBits() (orig, reply uint32) {
	if a.marks == nil || !a.cfg.WatchRuleset {
		return 0, 0
	}
	f := a.marks.Field()
	return f.PassOrig(), f.PassReply()
}

// ownershipMetrics exports what the proofs of origin count: the guests
// hostd marks, the times its table had to be put back, and the witness's
// SYN records.
func (a *Agent) ownershipMetrics() {
	reg := a.m.Registry
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "shunt_ownership_marked_guests",
			Help: "Guests whose new connections hostd's nftables table marks."},
			func() float64 {
				if a.marks == nil {
					return 0
				}
				return float64(len(a.marks.Entries()))
			}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "shunt_ownership_table_reinstalls_total",
			Help: "Times hostd found its nftables table changed or removed by someone else and put it back."},
			func() float64 {
				if a.marks == nil {
					return 0
				}
				return float64(a.marks.Reinstalls())
			}),
	)
	if a.witness == nil {
		return
	}
	for _, r := range []struct {
		result string
		get    func() uint64
	}{
		{"recorded", func() uint64 { return a.witness.Stats().Recorded }},
		{"conflict", func() uint64 { return a.witness.Stats().Conflicts }},
		{"full", func() uint64 { return a.witness.Stats().Full }},
		{"over-quota", func() uint64 { return a.witness.Stats().OverQuota }},
	} {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "shunt_witness_syns_total",
			Help:        "SYNs the eBPF witness saw, by what it did: recorded a new tuple, ignored a later SYN from another interface (conflict), refused a new tuple (full, over-quota).",
			ConstLabels: prometheus.Labels{"result": r.result}},
			func() float64 { return float64(r.get()) }))
	}
}
