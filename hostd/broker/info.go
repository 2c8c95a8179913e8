package broker

import (
	"sort"
	"time"

	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
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

// Flows lists live flows with their ring counters, by name.
func (b *Broker) Flows() []FlowInfo {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]FlowInfo, 0, len(b.flows))
	for _, f := range b.flows {
		fi := FlowInfo{
			Name: f.Name(), Group: f.Group.Name, GuestA: f.GuestA.Name, GuestB: f.GuestB.Name,
			Src: f.Orig.Src.String(), Dst: f.Orig.Dst.String(), State: "ready", Rule: f.Rule,
			Ring: f.Capacity, Created: f.Created,
		}
		if f.Revoked != proto.ReasonNone {
			fi.State, fi.Reason = "revoked", f.Revoked.String()
		}
		if f.sessA != nil {
			fi.Attached += "a"
		}
		if f.sessB != nil {
			fi.Attached += "b"
		}
		if ab, ba, err := f.Group.Pool.Region().Rings(f.id.slot, f.Gen); err == nil {
			fi.BytesAB, fi.BytesBA = read(ab), read(ba)
		}
		out = append(out, fi)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func read(r *ring.Ring) uint64 { return r.Stats().Read }

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

// Guests lists the known guests: configured ones, then those that libvirt
// brought, in the order they came.
func (b *Broker) Guests() []GuestInfo {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []GuestInfo
	for _, g := range b.guests {
		gi := GuestInfo{Name: g.Name, ID: g.ID, Group: g.Group.Name, Source: g.Source, Flows: b.flowsOfLocked(g)}
		for _, p := range g.Prefixes() {
			gi.Addresses = append(gi.Addresses, p.String())
		}
		for s, st := range b.sessions {
			if s.Guest() == g {
				gi.Sessions++
				for a := range st.listens {
					gi.Listening = append(gi.Listening, a.String())
				}
			}
		}
		sort.Strings(gi.Listening)
		out = append(out, gi)
	}
	return out
}
