package across

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Relay is what `hostd peers` shows of the relay to one peer.
type Relay struct {
	Link      string `json:"link"`         // up, or down
	Transport string `json:"transport"`    // the link's, while up: tcp or rdma
	Why       string `json:"why"`          // why it is TCP (docs/rdma.md); hostd peers and the log say it
	Flows     int    `json:"flows"`        // connections on the rings through the relay now
	Conns     int    `json:"conns"`        // connections across hosts hostd keeps a record of
	BytesOut  uint64 `json:"bytes_out"`    // flow bytes sent on the link (this link's life)
	BytesIn   uint64 `json:"bytes_in"`     // received
	Stalled   string `json:"stalled"`      // time senders waited for the peer's credit
	Reconnect uint64 `json:"reconnects"`   // links made
	Gathered  uint64 `json:"gathered_out"` // of BytesOut, read by the RDMA NIC straight from guests' rings (zero copy)
}

// Relays describes the relay to each peer. It asks the event loop, and
// gives up after a second (the listing then lacks the relay's part).
func (r *Room) Relays() map[string]Relay {
	ch := make(chan map[string]Relay, 1)
	r.post(func() { ch <- r.relays() })
	select {
	case m := <-ch:
		return m
	case <-time.After(time.Second):
		return nil
	}
}

func (r *Room) relays() map[string]Relay {
	out := map[string]Relay{}
	for peer, l := range r.links {
		rl := Relay{Link: "down", Reconnect: l.made}
		if l.l != nil {
			st := l.l.Stats()
			rl.Link, rl.BytesOut, rl.BytesIn, rl.Stalled, rl.Gathered = "up", st.BytesOut, st.BytesIn, st.Stalled.String(), st.Gathered
			rl.Transport, rl.Why = l.transport, l.why
		}
		out[peer] = rl
	}
	for _, x := range r.conns {
		if !x.paired {
			continue
		}
		rl := out[x.peer]
		rl.Conns++
		if x.st != nil && x.st.br != nil && x.st.stoppedAt == (time.Time{}) {
			rl.Flows++
		}
		out[x.peer] = rl
	}
	return out
}

// metricSet is the relay's metrics, per peer: refreshed each second.
type metricSet struct {
	flows     *prometheus.GaugeVec
	bytes     *prometheus.CounterVec
	stalled   *prometheus.CounterVec
	links     *prometheus.CounterVec
	resumes   *prometheus.CounterVec
	gathered  *prometheus.CounterVec
	lastBytes map[string][2]uint64
	lastGath  map[string]uint64
	lastStall map[string]time.Duration
}

func newMetrics(reg prometheus.Registerer) *metricSet {
	m := &metricSet{
		flows: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "shunt_relay_flows",
			Help: "Connections across hosts on the rings through the relay, per peer."}, []string{"peer"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shunt_relay_bytes_total",
			Help: "Flow bytes the relay link carried, per peer and direction (out, in)."}, []string{"peer", "dir"}),
		stalled: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shunt_relay_stalled_seconds_total",
			Help: "Time the relay's senders waited for the peer's credit (its guests read slowly), per peer."}, []string{"peer"}),
		links: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shunt_relay_links_total",
			Help: "Relay links made to a peer (a reconnect makes one more)."}, []string{"peer"}),
		resumes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shunt_relay_resumes_total",
			Help: "Relayed stretches ended, by how the guest resumed on TCP (at: an exact offset; all: nothing had crossed; reset: the peer never said)."}, []string{"peer", "how"}),
		gathered: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shunt_relay_gathered_bytes_total",
			Help: "Of the flow bytes sent on the relay's RDMA link, those its NIC read straight from guests' rings by scatter entry (zero copy), per peer."}, []string{"peer"}),
		lastBytes: map[string][2]uint64{}, lastStall: map[string]time.Duration{}, lastGath: map[string]uint64{},
	}
	if reg != nil {
		reg.MustRegister(m.flows, m.bytes, m.stalled, m.links, m.resumes, m.gathered)
	}
	return m
}

// refresh brings the metrics up to date (the event loop, each second).
func (r *Room) refresh() {
	for peer, rl := range r.relays() {
		r.m.flows.WithLabelValues(peer).Set(float64(rl.Flows))
	}
	for peer, l := range r.links {
		if l.l == nil {
			continue
		}
		st := l.l.Stats()
		last := r.m.lastBytes[peer]
		if st.BytesOut >= last[0] && st.BytesIn >= last[1] {
			r.m.bytes.WithLabelValues(peer, "out").Add(float64(st.BytesOut - last[0]))
			r.m.bytes.WithLabelValues(peer, "in").Add(float64(st.BytesIn - last[1]))
		}
		r.m.lastBytes[peer] = [2]uint64{st.BytesOut, st.BytesIn}
		if d := st.Stalled - r.m.lastStall[peer]; d > 0 {
			r.m.stalled.WithLabelValues(peer).Add(d.Seconds())
		}
		r.m.lastStall[peer] = st.Stalled
		if g := r.m.lastGath[peer]; st.Gathered > g {
			r.m.gathered.WithLabelValues(peer).Add(float64(st.Gathered - g))
		}
		r.m.lastGath[peer] = st.Gathered
	}
}
