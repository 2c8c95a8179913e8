package peers

import "github.com/prometheus/client_golang/prometheus"

// metricSet is the room's metrics, per peer.
type metricSet struct {
	up         *prometheus.GaugeVec   // peer: 1 while its channel is up
	reconnects *prometheus.CounterVec // peer: channels that came up
	bytes      *prometheus.CounterVec // peer, dir: bytes on its channel (TLS included)
	refused    *prometheus.CounterVec // peer, reason: refused channels and announced addresses
	announced  *prometheus.GaugeVec   // peer: its addresses this host accepted
	rtt        *prometheus.GaugeVec   // peer: the last ping's round trip
}

func newMetrics(reg prometheus.Registerer) *metricSet {
	m := &metricSet{
		up:         prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "shunt_peer_up", Help: "1 while the channel to the peer hostd is up."}, []string{"peer"}),
		reconnects: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shunt_peer_connects_total", Help: "Channels to the peer that came up."}, []string{"peer"}),
		bytes:      prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shunt_peer_bytes_total", Help: "Bytes on the channel to the peer, TLS included."}, []string{"peer", "dir"}),
		refused:    prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shunt_peer_refused_total", Help: "Refused peer channels (tls, unknown-peer, busy) and announced addresses (forbidden-prefix, local-address, announced-by-another-peer)."}, []string{"peer", "reason"}),
		announced:  prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "shunt_peer_addresses", Help: "Guest addresses the peer announced and this host accepted."}, []string{"peer"}),
		rtt:        prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "shunt_peer_rtt_seconds", Help: "Round trip of the last ping on the peer's channel."}, []string{"peer"}),
	}
	if reg != nil {
		reg.MustRegister(m.up, m.reconnects, m.bytes, m.refused, m.announced, m.rtt)
	}
	return m
}

// forget drops a removed peer's series.
func (m *metricSet) forget(peer string) {
	for _, v := range []interface{ DeletePartialMatch(prometheus.Labels) int }{m.up, m.reconnects, m.bytes, m.refused, m.announced, m.rtt} {
		v.DeletePartialMatch(prometheus.Labels{"peer": peer})
	}
}
