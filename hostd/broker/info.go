package broker

import (
	"net/netip"
	"sort"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// FlowInfo describes a live flow for the admin API and metrics.
type FlowInfo struct {
	Name     string    `json:"name"`
	Group    string    `json:"group"`
	GuestA   string    `json:"guest_a"`
	GuestB   string    `json:"guest_b"`
	Src      string    `json:"src"`
	Dst      string    `json:"dst"`
	State    string    `json:"state"`
	Reason   string    `json:"reason,omitempty"`
	Rule     string    `json:"rule"`
	Ring     int       `json:"ring_bytes"`
	BytesAB  uint64    `json:"bytes_ab"`
	BytesBA  uint64    `json:"bytes_ba"`
	Created  time.Time `json:"created"`
	Attached string    `json:"attached"` // which sides have a session: "ab", "a", "b", ""
}

// flowCopy is what a listing needs of a flow, copied under the broker's
// lock (small, no formatting), so that the lock is held for one pass over
// the flows and everything else (names, ring counters, sorting, JSON)
// happens after it is released.
type flowCopy struct {
	id             flowID
	gen            uint64
	group          *Group
	pool           *region.Pool
	guestA, guestB *Guest
	orig           ctrack.Tuple
	revoked        proto.Reason
	rule           string
	capacity       int
	created        time.Time
	a, b           bool // attached sides
}

// Flows lists live flows with their ring counters, by name. It holds the
// broker's lock only to copy the flows.
func (b *Broker) Flows() []FlowInfo {
	b.mu.Lock()
	cs := make([]flowCopy, 0, len(b.flows))
	for _, f := range b.flows {
		cs = append(cs, flowCopy{id: f.id, gen: f.Gen, group: f.Group, pool: f.Region.Pool, guestA: f.GuestA, guestB: f.GuestB,
			orig: f.Orig, revoked: f.Revoked, rule: f.Rule, capacity: f.Capacity, created: f.Created,
			a: f.sessA != nil, b: f.sessB != nil})
	}
	b.mu.Unlock()
	out := make([]FlowInfo, 0, len(cs))
	for _, c := range cs {
		f := Flow{id: c.id, Gen: c.gen}
		fi := FlowInfo{
			Name: f.Name(), Group: c.group.Name, GuestA: c.guestA.Name, GuestB: c.guestB.Name,
			Src: c.orig.Src.String(), Dst: c.orig.Dst.String(), State: "ready", Rule: c.rule,
			Ring: c.capacity, Created: c.created,
		}
		if c.revoked != proto.ReasonNone {
			fi.State, fi.Reason = "revoked", c.revoked.String()
		}
		if c.a {
			fi.Attached += "a"
		}
		if c.b {
			fi.Attached += "b"
		}
		// The generation check in Rings keeps a slot freed and reused
		// since the copy from being read as this flow.
		if ab, ba, err := c.pool.Stats(c.id.slot, c.gen); err == nil {
			fi.BytesAB, fi.BytesBA = ab.Read, ba.Read
		}
		out = append(out, fi)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// FlowStats feeds the metrics collector.
func (b *Broker) FlowStats() []metrics.FlowStat {
	var out []metrics.FlowStat
	for _, f := range b.Flows() {
		out = append(out, metrics.FlowStat{Flow: f.Name, GuestA: f.GuestA, GuestB: f.GuestB, BytesAB: f.BytesAB, BytesBA: f.BytesBA})
	}
	return out
}

// GuestInfo describes a configured guest.
type GuestInfo struct {
	Name      string   `json:"name"`
	ID        uint32   `json:"id"`
	Group     string   `json:"group"`
	Source    string   `json:"source"`
	Addresses []string `json:"addresses"`
	Sessions  int      `json:"sessions"`
	Listening []string `json:"listening"`
	Flows     int      `json:"flows"`
}

// guestCopy is what a listing needs of a guest, copied under the lock.
type guestCopy struct {
	g        *Guest
	sessions int
	flows    int
	listens  []netip.AddrPort
}

// Guests lists the known guests: configured ones, then those that libvirt
// brought, in the order they came. It holds the broker's lock only to copy
// the counts and listening addresses (one pass over guests, flows and
// listeners, no formatting): however many LISTENs a guest holds, the lock
// is not held for the listing's formatting and sorting.
func (b *Broker) Guests() []GuestInfo {
	b.mu.Lock()
	flows := make(map[*Guest]int, len(b.guests))
	for _, f := range b.flows {
		flows[f.GuestA]++
		if f.GuestB != f.GuestA {
			flows[f.GuestB]++
		}
	}
	cs := make([]guestCopy, 0, len(b.guests))
	for _, g := range b.guests {
		c := guestCopy{g: g, sessions: g.ctl.sessions, flows: flows[g], listens: make([]netip.AddrPort, 0, len(g.ctl.listens))}
		for a := range g.ctl.listens {
			c.listens = append(c.listens, a)
		}
		cs = append(cs, c)
	}
	b.mu.Unlock()
	out := make([]GuestInfo, 0, len(cs))
	for _, c := range cs {
		g := c.g
		gi := GuestInfo{Name: g.Name, ID: g.ID, Group: g.Group.Name, Source: g.Source, Sessions: c.sessions, Flows: c.flows}
		for _, p := range g.Prefixes() {
			gi.Addresses = append(gi.Addresses, p.String())
		}
		for _, a := range c.listens {
			gi.Listening = append(gi.Listening, a.String())
		}
		sort.Strings(gi.Listening)
		out = append(out, gi)
	}
	return out
}

// Counts is a summary for `hostd status`.
type Counts struct {
	Guests, Sessions, Flows int
}

// Counts returns how many guests, sessions and flows the broker has, in
// O(1) under its lock.
func (b *Broker) Counts() Counts {
	b.mu.Lock()
	defer b.mu.Unlock()
	return Counts{Guests: len(b.guests), Sessions: len(b.sessions), Flows: len(b.flows)}
}
