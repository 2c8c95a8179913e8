package agent

import (
	"context"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/hostd/vsockd"
	"github.com/shuntnet/shunt/hostd/vsockhost"
	"github.com/shuntnet/shunt/relay"
)

// vsockdWait bounds hostd's first talk with shunt-vsockd at start.
const vsockdWait = 5 * time.Second

// startVsock serves the vhost-user-vsock devices of the configured VMs
// that have a vsock block (hostd/vsockhost), takes their flows' stretches
// (a VM without the group region: its library carries its flows over
// vsock, the room bridges them to their rings), and exports their
// metrics. Before the control channels: a VM's QEMU waits for its
// device's socket at start.
func (a *Agent) startVsock() error {
	var specs []vsockhost.Spec
	var devs []vsockd.Device // shunt-vsockd's, with vsockd_socket
	for _, g := range a.cfg.Guests {
		switch {
		case g.Vsock == nil:
		case a.cfg.VsockdSocket != "" && g.Vsock.Hybrid == "":
			// shunt-vsockd serves the device and forwards the guest's
			// connections to hostd's ports to <socket>_<port>, as a
			// hybrid vsock does.
			specs = append(specs, vsockhost.Spec{Guest: g.Name, ID: g.ID, CID: g.Vsock.CID, Hybrid: g.Vsock.Socket, Daemon: true})
			devs = append(devs, vsockd.Device{Guest: g.Name, ID: g.ID, Socket: g.Vsock.Socket, CID: g.Vsock.CID})
		default:
			specs = append(specs, vsockhost.Spec{Guest: g.Name, ID: g.ID, Socket: g.Vsock.Socket, CID: g.Vsock.CID, Hybrid: g.Vsock.Hybrid})
		}
	}
	if len(specs) == 0 {
		return nil
	}
	var err error
	if a.vsock, err = vsockhost.Start(a.log.Named("vsock"), specs); err != nil {
		return err
	}
	if len(devs) > 0 {
		// Before any guest connects: whether each device is served
		// (broker.Options.VsockServed) is the daemon's word, asked here
		// once, then kept up to date by its events.
		ctx, cancel := context.WithTimeout(context.Background(), vsockdWait)
		a.vsockd, err = vsockd.Start(ctx, a.log.Named("vsockd"), a.cfg.VsockdSocket, devs)
		cancel()
		if a.vsockd == nil {
			return err
		}
		if err != nil {
			a.log.Warn("shunt-vsockd does not answer: its VMs' flows stay on TCP (vsock-down) until it does", "error", err)
		}
		a.vsock.UseDaemon(a.vsockd)
	}
	for _, g := range a.cfg.Guests {
		if g.Vsock != nil && !g.SharedRegion {
			if err := a.vsock.ServeStretches(g.ID, brokerFlows{a.b}, nil); err != nil {
				return err
			}
		}
	}
	a.m.NewVsock(func() []metrics.VsockStat {
		var out []metrics.VsockStat
		for _, s := range a.vsock.Stats() {
			out = append(out, metrics.VsockStat{Guest: s.Guest, Connected: s.Connected, Sessions: s.Sessions, RefusedFrontends: s.Refused,
				Conns: s.Conns, Accepted: s.Accepted, Dialed: s.Dialed, Refused: s.RefusedConn, Resets: s.Resets,
				BadPackets: s.BadPackets, QueueBroken: s.QueueBroken, RxBytes: s.RxBytes, TxBytes: s.TxBytes})
		}
		return out
	})
	return nil
}

// serveVsockControl serves each vsock VM's control channel on its vsock
// too (proto.VsockControlPort), as a session of that guest: the only
// control channel of a VM whose hypervisor has no virtio-serial
// (Firecracker), and the library's fallback where it finds no port.
func (a *Agent) serveVsockControl() error {
	for _, g := range a.guests {
		if err := a.serveVsockControlOf(g); err != nil {
			return err
		}
	}
	return nil
}

// serveVsockControlOf serves g's control channel on its vsock, if it has
// a vsock device (at start, and again after repoint removed g's sockets).
func (a *Agent) serveVsockControlOf(g *broker.Guest) error {
	if !a.vsock.Has(g.ID) {
		return nil
	}
	l, err := a.vsock.ListenControl(g.ID)
	if err != nil {
		return err
	}
	return a.srv.AddListener(g, l)
}

// brokerFlows is the broker as the vsock room's record of the flows.
type brokerFlows struct{ b *broker.Broker }

func (f brokerFlows) Stretch(guest uint32, h relay.Hello) (vsockhost.Held, error) {
	held, err := f.b.Stretch(guest, h.Region, h.Slot, h.Gen)
	return vsockhost.Held(held), err
}
