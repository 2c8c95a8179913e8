package agent

import (
	"fmt"
	"strings"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/hostd/vsockhost"
)

// Status is the `hostd status` reply.
type Status struct {
	Uptime   string       `json:"uptime"`
	Guests   int          `json:"guests"`
	Sessions int          `json:"sessions"`
	Flows    int          `json:"flows"`       // ring pairs
	Conns    int          `json:"connections"` // connection records
	Groups   []string     `json:"groups"`
	Libvirt  *virt.Status `json:"libvirt,omitempty"`
	// Vsock: the VMs' vhost-user-vsock devices (hostd/vsockhost).
	Vsock []vsockhost.Stat `json:"vsock,omitempty"`
}

// handle answers an admin request; the admin server may call it from
// several goroutines at once.
func (a *Agent) handle(r admin.Request) (any, error) {
	switch r.Cmd {
	case admin.CmdGuests:
		return a.b.Guests(), nil
	case admin.CmdFlows:
		return a.b.FlowsWithLease(), nil
	case admin.CmdStatus:
		return a.status(), nil
	case admin.CmdCounters:
		return a.counters()
	case admin.CmdReload:
		n, err := a.Reload()
		return map[string]int{"revoked": n, "downgraded": n}, err
	case admin.CmdDowngrade, admin.CmdRevoke:
		if !a.b.Downgrade(r.Flow) {
			return nil, fmt.Errorf("no connection on the rings named %q (see hostd flows)", r.Flow)
		}
		return map[string]string{"revoked": r.Flow, "downgraded": r.Flow}, nil
	case admin.CmdMigrateOut:
		return a.migrateOut(r)
	case admin.CmdMigrateIn:
		return a.migrateIn(r)
	case admin.CmdPeers:
		if a.peers == nil {
			return []peers.Info{}, nil
		}
		ps := a.peers.List()
		if a.across != nil {
			rs := a.across.Relays()
			for i := range ps {
				if rl, ok := rs[ps[i].Name]; ok {
					link := rl.Link
					if rl.Transport != "" { // "up (tcp)", "up (rdma)"; Why says why it is TCP
						link += " (" + rl.Transport + ")"
					}
					ps[i].Flows, ps[i].Relay = rl.Flows, &peers.RelayInfo{Link: link, Conns: rl.Conns,
						BytesOut: rl.BytesOut, BytesIn: rl.BytesIn, Stalled: rl.Stalled, Links: rl.Reconnect, Why: rl.Why, Gathered: rl.Gathered}
				}
			}
		}
		return ps, nil
	case admin.CmdGuestAdd:
		if r.Spec == nil {
			return nil, fmt.Errorf("guest-add: no spec")
		}
		return a.addRuntime(*r.Spec)
	case admin.CmdGuestRemove:
		return a.removeRuntime(r.Guest)
	case admin.CmdGuestList:
		return a.listRuntime(), nil
	}
	return nil, fmt.Errorf("unknown command %q (known: %s)", r.Cmd, strings.Join(admin.Commands, ", "))
}

// status is cheap whatever the guests hold: counts, not listings.
func (a *Agent) status() Status {
	n := a.b.Counts()
	st := Status{Uptime: time.Since(a.started).Round(time.Second).String(), Guests: n.Guests, Sessions: n.Sessions, Flows: n.Flows, Conns: n.Conns}
	if a.virt != nil {
		vs := a.virt.Status()
		st.Libvirt = &vs
	}
	st.Vsock = a.vsock.Stats()
	for _, g := range a.cfg.Groups {
		st.Groups = append(st.Groups, g.Name)
	}
	return st
}

// counters returns Shunt's own counters and gauges as "name{label=value}"
// keys, for the CLI and the tests.
func (a *Agent) counters() (map[string]float64, error) {
	mfs, err := a.m.Registry.Gather()
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), "shunt_") {
			continue
		}
		for _, m := range mf.GetMetric() {
			key := mf.GetName()
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			if len(labels) > 0 {
				key += "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[key] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[key] = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[key+"_count"] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out, nil
}
