// Package metrics defines hostd's Prometheus metrics. The broker updates the
// counters as it decides; flow byte counters are read from the rings at
// scrape time by a collector (they live in shared memory, not in hostd).
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/shuntnet/shunt/internal/proto"
)

// Set holds hostd's metrics. Safe for concurrent use.
type Set struct {
	Registry  *prometheus.Registry
	Fallbacks *prometheus.CounterVec   // reason; once per connection
	Switches  *prometheus.CounterVec   // to (rings, tcp), reason
	Conns     *prometheus.GaugeVec     // path (rings, leaving, tcp): hostd's connection records
	Revokes   *prometheus.CounterVec   // reason
	Opens     *prometheus.CounterVec   // role
	Flows     *prometheus.GaugeVec     // state, mode
	Setup     prometheus.Histogram     // seconds from the first OPEN of a pair to READY
	Plug      *prometheus.HistogramVec // op (plug, unplug): seconds to hot-plug a VM pair region into both VMs, or out
	Malformed prometheus.Counter       // control channels closed for malformed input
	Sessions  *prometheus.GaugeVec     // guest
	RingFloor prometheus.Counter       // flows given the policy's default ring: their rule's found no room

	// The control plane's defences (hostd/server, hostd/broker).
	Limited       *prometheus.CounterVec // kind: a guest's request over a limit
	AcceptErrors  prometheus.Counter     // failed accepts on control sockets, retried
	ClosedSession *prometheus.CounterVec // reason: sessions hostd closed (silent, not-reading, not-guest)
	KicksMerged   prometheus.Counter     // KICKs merged into one already queued

	// The firewall's authority (hostd/broker/firewall.go).
	ProofEpochs prometheus.Counter // ruleset epochs begun (changes seen, and hostd's start)
	ProofStale  prometheus.Counter // connections moved off the rings for no passage past the filter
}

// The kinds of Limited, one per limit in hostd.hcl's limits block.
const (
	LimitSessions = "sessions"
	LimitListens  = "listens"
	LimitOpens    = "opens"
	LimitOpenRate = "open-rate"
)

// New creates the metrics and registers them, with Go and process metrics,
// in a fresh registry.
func New() *Set {
	s := &Set{
		Registry: prometheus.NewRegistry(),
		Fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shunt_fallbacks_total", Help: "Connections kept on TCP at setup, by reason (once per connection).",
		}, []string{"reason"}),
		Switches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shunt_switches_total", Help: "Path switches of connections: to=rings (READY; reason: why it was on TCP before) or to=tcp (DOWN; reason: why).",
		}, []string{"to", "reason"}),
		Conns: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "shunt_connections", Help: "Connections hostd keeps a record of, by path (rings, leaving, tcp).",
		}, []string{"path"}),
		Revokes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shunt_revocations_total", Help: "Fast-path flows revoked, by reason.",
		}, []string{"reason"}),
		Opens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shunt_opens_total", Help: "OPEN requests from guests, by role.",
		}, []string{"role"}),
		Flows: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "shunt_flows", Help: "Fast-path flows by state and waiting mode.",
		}, []string{"state", "mode"}),
		Setup: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "shunt_flow_setup_seconds", Help: "Time from the first OPEN of a pair to READY.",
			Buckets: prometheus.ExponentialBuckets(20e-6, 2, 16),
		}),
		Plug: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "shunt_region_plug_seconds", Help: "Time to hot-plug a VM pair region into both its VMs (op plug: QMP, until QEMU added the devices) or out of them (op unplug: until QEMU let go, the guests' ejects included).",
			Buckets: prometheus.ExponentialBuckets(1e-3, 2, 15),
		}, []string{"op"}),
		Malformed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shunt_control_malformed_total", Help: "Control channels closed for malformed messages.",
		}),
		RingFloor: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shunt_ring_floor_total", Help: "Flows given the policy's default ring_size because their rule's larger ring_size found no room (the opening guest's quota, or its region), instead of staying on TCP.",
		}),
		Sessions: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "shunt_guest_sessions", Help: "Connected control sessions per guest.",
		}, []string{"guest"}),
		Limited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shunt_control_limited_total", Help: "Guest requests refused or dropped for a per-guest limit, by kind (sessions, listens, intents, opens, open-rate).",
		}, []string{"kind"}),
		AcceptErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shunt_control_accept_errors_total", Help: "Failed accepts on control sockets (EMFILE...), retried with backoff.",
		}),
		ClosedSession: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shunt_control_closed_total", Help: "Control sessions hostd closed, by reason (silent: no answer to keepalive; not-reading: its writes timed out or its queue filled; not-guest: the connecting process was not in the guest's network namespace).",
		}, []string{"reason"}),
		KicksMerged: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shunt_control_kicks_merged_total", Help: "Relayed KICKs merged into one already waiting for the same flow side.",
		}),
		ProofEpochs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shunt_firewall_epochs_total", Help: "Firewall epochs begun: ruleset changes seen, and hostd's start. Each clears every connection's proof of passage.",
		}),
		ProofStale: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shunt_firewall_stale_total", Help: "Connections moved from the rings to TCP because their lease showed no packets past the firewall both ways within proof_max_age (a drop that sent no ruleset event: dynamic set, link down, tc, route).",
		}),
	}
	s.Registry.MustRegister(s.Fallbacks, s.Switches, s.Conns, s.Revokes, s.Opens, s.Flows, s.Setup, s.Plug, s.Malformed, s.Sessions, s.RingFloor,
		s.Limited, s.AcceptErrors, s.ClosedSession, s.KicksMerged, s.ProofEpochs, s.ProofStale,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	for _, r := range proto.Reasons() {
		s.Fallbacks.WithLabelValues(r.String())
	}
	for _, p := range []string{"rings", "leaving", "tcp"} {
		s.Conns.WithLabelValues(p)
	}
	for _, k := range []string{LimitSessions, LimitListens, LimitOpens, LimitOpenRate} {
		s.Limited.WithLabelValues(k)
	}
	for _, r := range []string{"silent", "not-reading", "not-guest"} {
		s.ClosedSession.WithLabelValues(r)
	}
	return s
}

// NewLibvirt exports the libvirt watcher's state, read at scrape time:
// whether hostd is connected to libvirtd, how many domains it registered,
// and how many times it reconciled with libvirtd.
func (s *Set) NewLibvirt(connected func() bool, domains func() int, syncs func() uint64) {
	s.Registry.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "shunt_libvirt_connected", Help: "1 while hostd is connected to libvirtd.",
		}, func() float64 {
			if connected() {
				return 1
			}
			return 0
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "shunt_libvirt_domains", Help: "libvirt domains registered as guests.",
		}, func() float64 { return float64(domains()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "shunt_libvirt_syncs_total", Help: "Reconciliations with libvirtd's running domains.",
		}, func() float64 { return float64(syncs()) }),
	)
}

// FlowStat is one flow's counters for the byte collector.
type FlowStat struct {
	Flow, GuestA, GuestB string
	BytesAB, BytesBA     uint64
}

// FlowBytes exports per-flow and per-guest byte counters, read from the
// rings at scrape time through fn.
type FlowBytes struct {
	Fn      func() []FlowStat
	perFlow *prometheus.Desc
	perGst  *prometheus.Desc
}

// NewFlowBytes registers a FlowBytes collector on s.
func (s *Set) NewFlowBytes(fn func() []FlowStat) {
	s.Registry.MustRegister(&FlowBytes{
		Fn:      fn,
		perFlow: prometheus.NewDesc("shunt_flow_bytes", "Guest-reported: bytes a live flow's ring counters say it moved, by direction. The guests write those counters; hostd drops a count no ring could have carried since the flow began, but does not measure them.", []string{"flow", "direction"}, nil),
		perGst:  prometheus.NewDesc("shunt_guest_bytes_sent", "Guest-reported: bytes sent by a guest over its live flows (the sum of its shunt_flow_bytes).", []string{"guest"}, nil),
	})
}

func (c *FlowBytes) Describe(ch chan<- *prometheus.Desc) { ch <- c.perFlow; ch <- c.perGst }

func (c *FlowBytes) Collect(ch chan<- prometheus.Metric) {
	byGuest := map[string]uint64{}
	for _, f := range c.Fn() {
		ch <- prometheus.MustNewConstMetric(c.perFlow, prometheus.GaugeValue, float64(f.BytesAB), f.Flow, "ab")
		ch <- prometheus.MustNewConstMetric(c.perFlow, prometheus.GaugeValue, float64(f.BytesBA), f.Flow, "ba")
		byGuest[f.GuestA] += f.BytesAB
		byGuest[f.GuestB] += f.BytesBA
	}
	for g, n := range byGuest {
		ch <- prometheus.MustNewConstMetric(c.perGst, prometheus.GaugeValue, float64(n), g)
	}
}
