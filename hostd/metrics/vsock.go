package metrics

import "github.com/prometheus/client_golang/prometheus"

// VsockStat is one VM's vhost-user-vsock device, for the vsock collector.
type VsockStat struct {
	Guest                             string
	Connected                         bool
	Sessions, RefusedFrontends        uint64
	Conns                             int64
	Accepted, Dialed, Refused, Resets uint64
	BadPackets, QueueBroken           uint64
	RxBytes, TxBytes                  uint64
}

// vsockCollector exports the devices' state and counters, read at scrape
// time through fn.
type vsockCollector struct {
	fn                                func() []VsockStat
	connected, sessions, frontRefused *prometheus.Desc
	conns, accepted, dialed, refused  *prometheus.Desc
	resets, bad, broken, bytes        *prometheus.Desc
}

// NewVsock registers the collector of the vsock devices (hostd/vsockhost).
func (s *Set) NewVsock(fn func() []VsockStat) {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, append([]string{"guest"}, labels...), nil)
	}
	s.Registry.MustRegister(&vsockCollector{fn: fn,
		connected:    d("shunt_vsock_frontend_connected", "1 while the VM's QEMU is connected to its vhost-user-vsock device."),
		sessions:     d("shunt_vsock_frontends_total", "vhost-user front-ends (QEMUs) the device served since hostd started."),
		frontRefused: d("shunt_vsock_frontends_refused_total", "Front-ends turned away while another was served."),
		conns:        d("shunt_vsock_connections", "The VM's vsock connections open now."),
		accepted:     d("shunt_vsock_accepted_total", "The VM's vsock connections accepted by a host listener."),
		dialed:       d("shunt_vsock_dialed_total", "Host connections the VM accepted."),
		refused:      d("shunt_vsock_refused_total", "The VM's connection requests answered with RST (no listener, limits)."),
		resets:       d("shunt_vsock_resets_total", "The VM's vsock connections reset for breaking the protocol (credit, length)."),
		bad:          d("shunt_vsock_bad_packets_total", "Packets from the VM dropped: bad header, CID or length."),
		broken:       d("shunt_vsock_queue_broken_total", "Virtqueues stopped for a driver's error (a chain out of memory, a loop)."),
		bytes:        d("shunt_vsock_bytes_total", "Payload bytes through the device, by direction (rx: from the VM).", "direction"),
	})
}

func (c *vsockCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.connected, c.sessions, c.frontRefused, c.conns, c.accepted, c.dialed, c.refused, c.resets, c.bad, c.broken, c.bytes} {
		ch <- d
	}
}

func (c *vsockCollector) Collect(ch chan<- prometheus.Metric) {
	g := prometheus.GaugeValue
	k := prometheus.CounterValue
	for _, s := range c.fn() {
		conn := 0.0
		if s.Connected {
			conn = 1
		}
		ch <- prometheus.MustNewConstMetric(c.connected, g, conn, s.Guest)
		ch <- prometheus.MustNewConstMetric(c.sessions, k, float64(s.Sessions), s.Guest)
		ch <- prometheus.MustNewConstMetric(c.frontRefused, k, float64(s.RefusedFrontends), s.Guest)
		ch <- prometheus.MustNewConstMetric(c.conns, g, float64(s.Conns), s.Guest)
		ch <- prometheus.MustNewConstMetric(c.accepted, k, float64(s.Accepted), s.Guest)
		ch <- prometheus.MustNewConstMetric(c.dialed, k, float64(s.Dialed), s.Guest)
		ch <- prometheus.MustNewConstMetric(c.refused, k, float64(s.Refused), s.Guest)
		ch <- prometheus.MustNewConstMetric(c.resets, k, float64(s.Resets), s.Guest)
		ch <- prometheus.MustNewConstMetric(c.bad, k, float64(s.BadPackets), s.Guest)
		ch <- prometheus.MustNewConstMetric(c.broken, k, float64(s.QueueBroken), s.Guest)
		ch <- prometheus.MustNewConstMetric(c.bytes, k, float64(s.RxBytes), s.Guest, "rx")
		ch <- prometheus.MustNewConstMetric(c.bytes, k, float64(s.TxBytes), s.Guest, "tx")
	}
}
