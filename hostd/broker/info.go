package broker

import (
	"net/netip"
	"sort"
	"strings"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// FlowInfo describes a connection record for the admin API (`hostd
// flows`): its ends, its path, and its current ring pair if it has one.
type FlowInfo struct {
	Name     string `json:"name"` // its ring pair's name while it has one, else Conn
	Conn     string `json:"conn"` // the record's name
	Group    string `json:"group"`
	GuestA   string `json:"guest_a"`
	GuestB   string `json:"guest_b"`
	Src      string `json:"src"`
	Dst      string `json:"dst"`
	Path     string `json:"path"`          // rings, leaving, tcp
	Via      string `json:"via,omitempty"` // "relay PEER": the other end is a peer host's guest, through the relay
	State    string `json:"state"`         // ready (on the rings), leaving, tcp
	Reason   string `json:"reason,omitempty"`
	Switches int    `json:"switches"`
	Rule     string `json:"rule"`
	Ring     int    `json:"ring_bytes"` // capacity of its ring pair, 0 without one
	// The ring byte counts are guest-reported: the ends write a ring's
	// indices, so these are what they claim, never hostd's measurement
	// (LeaseAB/BA, from conntrack, are), and a count no ring could have
	// carried since the flow began is dropped (Counters says so).
	BytesAB  uint64    `json:"bytes_ab"`           // read from its current ring AB (guest-reported)
	BytesBA  uint64    `json:"bytes_ba"`           // read from its current ring BA (guest-reported)
	RingsAB  uint64    `json:"rings_written_ab"`   // written to all its rings AB, for display (guest-reported)
	RingsBA  uint64    `json:"rings_written_ba"`   // written to all its rings BA (guest-reported)
	Counters string    `json:"ring_counters"`      // "guest-reported", or with "implausible ... dropped"
	LeaseAB  uint64    `json:"lease_bytes_ab"`     // conntrack accounting, original direction (0 without)
	LeaseBA  uint64    `json:"lease_bytes_ba"`     // conntrack accounting, reply direction
	Created  time.Time `json:"created"`            //
	Attached string    `json:"attached"`           // which ends have a session: "ab", "a", "b", ""
	Waiting  bool      `json:"firewall,omitempty"` // waiting for its lease after a ruleset change
}

// flowCopy is what a listing needs of a record, copied under the broker's
// lock (small, no formatting), so that the lock is held for one pass over
// the records and everything else (names, ring counters, conntrack
// counters, sorting, JSON) happens after it is released.
type flowCopy struct {
	conn           string
	id             flowID
	gen            uint64
	hasFlow        bool
	group          *Group
	pool           *region.Pool
	guestA, guestB *Guest
	orig           ctrack.Tuple
	path           Path
	reason         proto.Reason
	switches       int
	rule           string
	capacity       int
	created        time.Time
	a, b           bool // attached ends
	ringAB, ringBA uint64
	fw             bool
	flowCreated    time.Time // its ring pair's
	bogus          bool      // a guest-reported counter was implausible
}

// Flows lists the connection records, by name, with ring counters. It
// holds the broker's lock only to copy the records.
func (b *Broker) Flows() []FlowInfo { return b.flowList(false) }

// FlowsWithLease is Flows with each connection's lease counters (one
// conntrack lookup per connection, without the lock).
func (b *Broker) FlowsWithLease() []FlowInfo { return b.flowList(true) }

func (b *Broker) flowList(lease bool) []FlowInfo {
	b.mu.Lock()
	cs := make([]flowCopy, 0, len(b.records))
	for c := range b.records {
		fc := flowCopy{conn: c.Name(), guestA: c.a.g, guestB: c.b.g, group: c.a.g.Group, orig: c.orig, path: c.path,
			reason: c.reason, switches: c.switches, rule: c.rule, created: c.created,
			a: c.a.sess != nil, b: c.b.sess != nil, ringAB: c.ringAB, ringBA: c.ringBA, fw: c.fw != nil, bogus: c.bogusCounts}
		if f := c.flow; f != nil {
			fc.hasFlow, fc.id, fc.gen, fc.pool, fc.capacity, fc.flowCreated = true, f.id, f.Gen, f.Region.Pool, f.Capacity, f.Created
		}
		cs = append(cs, fc)
	}
	b.mu.Unlock()
	out := make([]FlowInfo, 0, len(cs))
	for _, c := range cs {
		fi := FlowInfo{
			Name: c.conn, Conn: c.conn, Group: c.group.Name, GuestA: c.guestA.Name, GuestB: c.guestB.Name,
			Src: c.orig.Src.String(), Dst: c.orig.Dst.String(), Path: c.path.String(), State: c.path.String(),
			Switches: c.switches, Rule: c.rule, Ring: c.capacity, Created: c.created,
			RingsAB: c.ringAB, RingsBA: c.ringBA, Waiting: c.fw,
		}
		if c.path == PathRings {
			fi.State = "ready"
		}
		fi.Via = via(c.guestA, c.guestB)
		if c.reason != proto.ReasonNone {
			fi.Reason = reasonName(c.reason)
		}
		if c.a {
			fi.Attached += "a"
		}
		if c.b {
			fi.Attached += "b"
		}
		if c.hasFlow {
			f := Flow{id: c.id, Gen: c.gen}
			fi.Name = f.Name()
			// The generation check in Stats keeps a slot freed and reused
			// since the copy from being read as this flow.
			if ab, ba, err := c.pool.Stats(c.id.slot, c.gen); err == nil {
				var ok [4]bool
				fi.BytesAB, ok[0] = plausible(ab.Read, c.flowCreated)
				fi.BytesBA, ok[1] = plausible(ba.Read, c.flowCreated)
				var w uint64
				w, ok[2] = plausible(ab.Written, c.flowCreated)
				fi.RingsAB += w
				w, ok[3] = plausible(ba.Written, c.flowCreated)
				fi.RingsBA += w
				if ok != [4]bool{true, true, true, true} {
					c.bogus = true
				}
			}
		}
		fi.Counters = "guest-reported"
		if c.bogus {
			fi.Counters = "guest-reported; implausible values dropped"
		}
		if lease {
			if e, err := b.ct.Lookup(c.orig); err == nil {
				fi.LeaseAB, fi.LeaseBA = e.BytesOrig, e.BytesReply
			}
		}
		out = append(out, fi)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// FlowStats feeds the metrics collector: the connections on ring pairs.
func (b *Broker) FlowStats() []metrics.FlowStat {
	var out []metrics.FlowStat
	for _, f := range b.Flows() {
		if f.Ring == 0 {
			continue
		}
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
	Migrating bool     `json:"migrating,omitempty"` // between hostd migrate-out and migrate-in
}

// guestCopy is what a listing needs of a guest, copied under the lock.
type guestCopy struct {
	g        *Guest
	sessions int
	flows    int
	listens  []netip.AddrPort
	moving   bool
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
		c := guestCopy{g: g, sessions: g.ctl.sessions, flows: flows[g], listens: make([]netip.AddrPort, 0, len(g.ctl.listens)), moving: g.migrating}
		for a := range g.ctl.listens {
			c.listens = append(c.listens, a)
		}
		cs = append(cs, c)
	}
	b.mu.Unlock()
	out := make([]GuestInfo, 0, len(cs))
	for _, c := range cs {
		g := c.g
		gi := GuestInfo{Name: g.Name, ID: g.ID, Group: g.Group.Name, Source: g.Source, Sessions: c.sessions, Flows: c.flows, Migrating: c.moving}
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
	Guests, Sessions, Flows, Conns int
}

// Counts returns how many guests, sessions, ring pairs and connection
// records the broker has, in
// O(1) under its lock.
func (b *Broker) Counts() Counts {
	b.mu.Lock()
	defer b.mu.Unlock()
	return Counts{Guests: len(b.guests), Sessions: len(b.sessions), Flows: len(b.flows), Conns: len(b.records)}
}

// maxRingRate is more bytes per second than any ring can carry (several
// times memory bandwidth): only a count a guest made up goes past it.
const maxRingRate = 1 << 36

// plausible returns n, a ring counter (which its guests write: docs/SECURITY.md),
// if one ring could have carried n bytes since since; otherwise 0 and
// false. A listing shows ring counters as guest-reported, bounded by
// this, never as hostd's measurement.
func plausible(n uint64, since time.Time) (uint64, bool) {
	secs := uint64(min(max(time.Since(since), 0)/time.Second, 1<<26)) + 1
	if n > secs*maxRingRate {
		return 0, false
	}
	return n, true
}

// via names the relay a connection across hosts goes through: its relay
// end's guest is named relay/PEER/GROUP (hostd/across).
func via(a, b *Guest) string {
	for _, g := range []*Guest{a, b} {
		if g != nil && g.Relay {
			peer, _, _ := strings.Cut(strings.TrimPrefix(g.Name, "relay/"), "/")
			return "relay " + peer
		}
	}
	for _, g := range []*Guest{a, b} {
		if g != nil && g.Vsock {
			return "vsock"
		}
	}
	return ""
}
