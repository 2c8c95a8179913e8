package agent

import (
	"errors"
	"fmt"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/server"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// migrateLeaveBound bounds how long migrate-out waits for the guest's
// connections to leave the rings, and migrateUnplugBound how long it
// then waits for its VM pair regions to be unplugged (the guests' ACPI
// ejects); the admin request's own deadline is admin.Deadline.
const (
	migrateLeaveBound  = 8 * time.Second
	migrateUnplugBound = 15 * time.Second
)

// migrateOut answers CmdMigrateOut: the guest's connections move to TCP
// and stay there; it waits (bounded) until none holds a ring pair, and
// says how many still do if the bound passed. A VM with pair regions
// then loses them at once: hostd unplugs them from both VMs of each pair
// and waits (bounded) until they are out, since QEMU does not migrate a
// VM with an ivshmem device (docs/vm.md, "Live migration").
func (a *Agent) migrateOut(r admin.Request) (admin.MigrateReply, error) {
	g, err := a.migrating(r.Guest)
	if err != nil {
		return admin.MigrateReply{}, err
	}
	a.mig.Lock()
	defer a.mig.Unlock()
	start := time.Now()
	rep := admin.MigrateReply{Guest: g.Name, Moved: a.b.MigrateOut(g)}
	for deadline := start.Add(migrateLeaveBound); ; {
		if rep.Held = a.b.RingsHeld(g); rep.Held == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if rep.Held == 0 && g.PairVM {
		a.dropVMRegions(g, &rep)
	}
	rep.Took = time.Since(start).Round(time.Microsecond).String()
	a.log.Info("guest migrating out", "guest", g.Name, "to_tcp", rep.Moved, "rings_still_held", rep.Held,
		"pair_regions_unplugged", rep.Unplugged, "pair_regions_still_plugged", rep.Plugged, "took", rep.Took)
	return rep, nil
}

// dropVMRegions unplugs migrating VM g's pair regions (broker.DropVMRegions)
// and waits, bounded, until none is left in its VM; rep says how many
// went and how many are left.
func (a *Agent) dropVMRegions(g *broker.Guest, rep *admin.MigrateReply) {
	for deadline := time.Now().Add(migrateUnplugBound); ; {
		dropped, left := a.b.DropVMRegions(g)
		rep.Unplugged += dropped
		if rep.Plugged = left; left == 0 || time.Now().After(deadline) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// migrateIn answers CmdMigrateIn: hostd serves the guest's new control
// socket, marks its new interface and plugs its pair regions through its
// new QMP socket (each if given), then lets its connections take the
// rings again (a pair of VMs gets a fresh pair region, plugged on
// demand). Only configured guests are re-pointed so; a libvirt domain
// that arrives here is registered by the watcher.
func (a *Agent) migrateIn(r admin.Request) (admin.MigrateReply, error) {
	g, err := a.migrating(r.Guest)
	if err != nil {
		return admin.MigrateReply{}, err
	}
	a.mig.Lock()
	defer a.mig.Unlock()
	if r.Control != "" || r.Interface != "" || r.QMP != "" {
		gc := a.configGuest(g.Name)
		if gc == nil || g.Source != "config" {
			return admin.MigrateReply{}, fmt.Errorf("guest %s comes from %s: only configured guests are re-pointed by migrate-in", g.Name, g.Source)
		}
		if r.Interface != "" {
			if err := a.remark(g, r.Interface); err != nil {
				return admin.MigrateReply{}, err
			}
		}
		if r.QMP != "" {
			if a.hot == nil || gc.QMP == "" {
				return admin.MigrateReply{}, fmt.Errorf("guest %s has no qmp socket in hostd.hcl: hostd plugs nothing into its VM", g.Name)
			}
			a.hot.setSocket(g, r.QMP)
		}
		if r.Control != "" {
			if err := a.repoint(g, r.Control, gc.Ports); err != nil {
				return admin.MigrateReply{}, err
			}
		}
	}
	rep := admin.MigrateReply{Guest: g.Name, Moved: a.b.MigrateIn(g)}
	a.log.Info("guest migrated in", "guest", g.Name, "control", r.Control, "interface", r.Interface, "qmp", r.QMP, "to_rings", rep.Moved)
	return rep, nil
}

// migrating returns the registered guest called name.
func (a *Agent) migrating(name string) (*broker.Guest, error) {
	if name == "" {
		return nil, errors.New("name the guest (see hostd guests)")
	}
	g := a.b.GuestNamed(name)
	if g == nil {
		return nil, fmt.Errorf("no guest named %q (see hostd guests)", name)
	}
	return g, nil
}

func (a *Agent) configGuest(name string) *config.Guest {
	for i := range a.cfg.Guests {
		if a.cfg.Guests[i].Name == name {
			return &a.cfg.Guests[i]
		}
	}
	return nil
}

// remark moves g's mark rule to interface ifname. g keeps its mark id
// (the connections it has carry it in their conntrack entries), which
// the marker gives back to a guest that returns at once.
func (a *Agent) remark(g *broker.Guest, ifname string) error {
	switch {
	case a.witness != nil && g.Ifindex != 0:
		return fmt.Errorf("guest %s: the eBPF witness watches its old interface; moving it to %s is not supported yet", g.Name, ifname)
	case a.marks == nil || g.Mark == 0:
		return nil
	}
	a.marks.Remove(g.Name)
	e, err := a.marks.Add(g.Name, g.ID, ifname)
	if err != nil {
		return fmt.Errorf("mark guest %s's new interface: %w", g.Name, err)
	}
	if e.Value != g.Mark {
		a.marks.Remove(g.Name)
		return fmt.Errorf("guest %s got mark %#x on %s, not its own %#x: its connections could not be claimed", g.Name, e.Value, ifname, g.Mark)
	}
	return nil
}

// repoint makes hostd serve g on the control sockets at control (ports of
// them) instead of its old ones; the old sessions close, so the guest's
// connections keep their records and are OPENed again on the new ones.
func (a *Agent) repoint(g *broker.Guest, control string, ports int) error {
	if a.srv == nil {
		return errors.New("hostd's control server is not running")
	}
	a.srv.Remove(g) // every listener of g's, its vsock control port's too
	for i := range max(ports, 1) {
		if err := a.srv.Add(server.Endpoint{Guest: g, Path: vserial.SocketOf(control, i)}); err != nil {
			return fmt.Errorf("serve guest %s on %s: %w", g.Name, control, err)
		}
	}
	if err := a.serveVsockControlOf(g); err != nil {
		return fmt.Errorf("serve guest %s on its vsock: %w", g.Name, err)
	}
	return nil
}
