package agent

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/server"
	"github.com/shuntnet/shunt/hostd/virt"
)

// registry is the agent as the libvirt watcher's virt.Registry: a running
// Shunt domain becomes a guest with its own control socket; a stopped one
// is removed, and the peers of its connections move to TCP.
type registry Agent

// Register adds domain d as a guest.
func (r *registry) Register(d virt.Domain) error {
	a := (*Agent)(r)
	grp, pair, err := a.groupOf(d)
	if err != nil {
		return err
	}
	gid, err := a.controlGid(grp.Name)
	if err != nil {
		return fmt.Errorf("domain %s: %w", d.Name, err)
	}
	// A VM: it maps its group region, or (pair) gets its pair regions
	// plugged in as <shmem> devices (lvHotplug).
	g := &broker.Guest{Name: d.Name, ID: d.ID, Group: grp, CTMark: d.CTMark, Source: sourceLibvirt, SharedRegion: true, PairVM: pair}
	addrs, err := guestAddrs(a.cfg.ConntrackNetns, config.Guest{Name: d.Name, Addresses: d.Addresses, Interface: d.Tap})
	if err != nil {
		return err
	}
	if len(addrs.Prefixes) == 0 {
		return fmt.Errorf("domain %s owns no addresses: name them in its Shunt metadata (<shunt:address>) or route them to its tap", d.Name)
	}
	g.SetAddrs(addrs)
	if a.witness != nil && d.Tap != "" {
		if g.Ifindex, err = attachWitness(a.witness, a.cfg.ConntrackNetns, d.Tap); err != nil {
			return fmt.Errorf("domain %s: %w", d.Name, err)
		}
	}
	// The mark id belongs to the guest: a domain restarted or migrated
	// here comes back with a new tap and gets its id on it.
	if err := a.markGuest(g, d.Tap); err != nil {
		a.detachWitness(g)
		return fmt.Errorf("domain %s: %w", d.Name, err)
	}
	if err := a.b.AddGuest(g); err != nil {
		a.detachWitness(g)
		a.unmarkGuest(g)
		return fmt.Errorf("domain %s: %w", d.Name, err)
	}
	a.vmu.Lock()
	defer a.vmu.Unlock()
	for _, path := range d.Controls {
		ep := server.Endpoint{Guest: g, Path: path, Gid: gid}
		if a.srv == nil {
			a.vpending = append(a.vpending, ep)
		} else if err := a.srv.Add(ep); err != nil {
			a.srv.Remove(g)
			a.b.RemoveGuest(g)
			a.detachWitness(g)
			a.unmarkGuest(g)
			return err
		}
	}
	a.vguests[d.Name] = g
	return nil
}

// Unregister removes domain d's guest: its control socket goes, its
// sessions close and the peers of its connections move to TCP (DOWN(peer-gone)).
func (r *registry) Unregister(d virt.Domain) {
	a := (*Agent)(r)
	a.vmu.Lock()
	g := a.vguests[d.Name]
	delete(a.vguests, d.Name)
	a.vpending = slices.DeleteFunc(a.vpending, func(ep server.Endpoint) bool { return ep.Guest == g })
	srv := a.srv
	a.vmu.Unlock()
	if g == nil {
		return
	}
	if srv != nil {
		srv.Remove(g)
	}
	a.b.RemoveGuest(g)
	a.detachWitness(g)
	a.unmarkGuest(g)
}

func (a *Agent) detachWitness(g *broker.Guest) {
	if a.witness != nil && g.Ifindex != 0 {
		a.witness.Detach(g.Ifindex)
	}
}

// controlGid is the group that may connect to the control sockets of the
// VMs of trust group name: its region_group, whose members (QEMUs that
// run unprivileged, as libvirt's libvirt-qemu:kvm) map its region; 0 for
// none (the sockets are root's only).
func (a *Agent) controlGid(name string) (int, error) {
	for _, g := range a.cfg.Groups {
		if g.Name != name {
			continue
		}
		acc, err := regionAccess(g)
		if err != nil || acc.Gid < 0 {
			return 0, err
		}
		return acc.Gid, nil
	}
	return 0, nil
}

// groupOf finds d's trust group: the one whose region backs one of d's
// shmem devices (metadata naming a group must agree with it), or, for a
// domain with no shmem device, the one its metadata names, which must
// have vm_regions = "pair": pair reports that d gets pair regions
// plugged in (docs/vm.md, "Pair regions").
func (a *Agent) groupOf(d virt.Domain) (_ *broker.Group, pair bool, _ error) {
	var regions []string
	for _, g := range a.cfg.Groups {
		regions = append(regions, g.Region)
		for _, s := range d.Shmem {
			if g.Region != "/dev/shm/"+s {
				continue
			}
			if d.Group != "" && d.Group != g.Name {
				return nil, false, fmt.Errorf("domain %s: metadata says trust group %q, but its shmem %q is group %q's region", d.Name, d.Group, s, g.Name)
			}
			return a.groups[g.Name], false, nil
		}
	}
	if len(d.Shmem) > 0 {
		return nil, false, fmt.Errorf("domain %s: none of its shmem devices (%s) is a trust group's region (%s): name the <shmem> after the region file in /dev/shm",
			d.Name, strings.Join(d.Shmem, ", "), strings.Join(regions, ", "))
	}
	for _, g := range a.cfg.Groups {
		if g.Name != d.Group {
			continue
		}
		if g.VMRegions != config.VMRegionsPair {
			return nil, false, fmt.Errorf("domain %s has no <shmem> device, and its trust group %s has vm_regions = %q: give the domain <shmem name='%s'> (the group region), or the group vm_regions = \"pair\"",
				d.Name, g.Name, g.VMRegions, filepath.Base(g.Region))
		}
		if a.lvhot == nil {
			return nil, false, fmt.Errorf("domain %s: trust group %s has pair regions, but hostd has no way to plug them into libvirt domains", d.Name, g.Name)
		}
		return a.groups[g.Name], true, nil
	}
	return nil, false, fmt.Errorf("domain %s: its Shunt metadata names trust group %q, which hostd.hcl does not define", d.Name, d.Group)
}
