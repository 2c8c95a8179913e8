package agent

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/virt"
)

// shmDir is where libvirt finds a <shmem> device's memory: /dev/shm/<name>.
const shmDir = "/dev/shm"

// sourceLibvirt is the Source of the guests the libvirt watcher registers.
const sourceLibvirt = "libvirt"

// vmHotplug is the broker's Hotplug for every VM: libvirt's attach-device
// for libvirt domains, QMP for the VMs of hostd.hcl (their qmp sockets).
// Safe for concurrent use.
type vmHotplug struct {
	qmp *qmpHotplug // nil if no guest in hostd.hcl has a qmp socket
	lv  *lvHotplug  // nil without a libvirt block or a group with vm_regions = "pair"
}

// pluggers are what plugs a region into one VM, and finds its devices by
// the region's file.
type plugger interface {
	broker.Hotplug
	unplugFile(ctx context.Context, g *broker.Guest, path string) error
}

func (h *vmHotplug) pick(g *broker.Guest) (plugger, error) {
	switch {
	case g.Source == sourceLibvirt && h.lv != nil:
		return h.lv, nil
	case g.Source != sourceLibvirt && h.qmp != nil:
		return h.qmp, nil
	}
	return nil, fmt.Errorf("guest %s (%s) has no way to plug a region into its VM", g.Name, g.Source)
}

// Plug implements broker.Hotplug.
func (h *vmHotplug) Plug(ctx context.Context, g *broker.Guest, r *broker.Region) error {
	p, err := h.pick(g)
	if err != nil {
		return err
	}
	return p.Plug(ctx, g, r)
}

// Unplug implements broker.Hotplug.
func (h *vmHotplug) Unplug(ctx context.Context, g *broker.Guest, r *broker.Region) error {
	p, err := h.pick(g)
	if err != nil {
		return err
	}
	return p.Unplug(ctx, g, r)
}

// unplugFile takes g's devices backed by the file at path out of its VM,
// if it runs.
func (h *vmHotplug) unplugFile(ctx context.Context, g *broker.Guest, path string) error {
	p, err := h.pick(g)
	if err != nil {
		return err
	}
	return p.unplugFile(ctx, g, path)
}

// lvHotplug plugs VM pair regions into libvirt domains (the guest's name
// is its domain's) as <shmem> devices: DomainAttachDeviceFlags with
// VIR_DOMAIN_AFFECT_LIVE, an ivshmem-plain device on /dev/shm/<name>
// (share=on) with the user alias ua-<DeviceID>, in a slot libvirt
// chooses; out again by alias (DomainDetachDeviceAlias), waiting until
// the live XML no longer lists it. The region file must be in /dev/shm
// (pairRegions puts a libvirt pair's there). Safe for concurrent use.
type lvHotplug struct {
	log hclog.Logger
	p   *virt.Plugger
}

// shmemName is the <shmem> name of a region file: its name in /dev/shm.
func shmemName(path string) (string, error) {
	if filepath.Dir(path) != shmDir {
		return "", fmt.Errorf("region %s is not in %s: libvirt backs a <shmem> device only with /dev/shm/<name>", path, shmDir)
	}
	return filepath.Base(path), nil
}

// Plug implements broker.Hotplug.
func (h *lvHotplug) Plug(ctx context.Context, g *broker.Guest, r *broker.Region) error {
	name, err := shmemName(r.File.Name())
	if err != nil {
		return err
	}
	// A device of the pair still in the domain is an earlier region's,
	// left by a hostd that stopped before it unplugged it (its header
	// may name the id the new one gets), or one being unplugged now: it
	// goes first, so the guest finds only the new one.
	pair := virt.PairOf(r.A.ID, r.B.ID)
	if n, err := h.p.Detach(ctx, g.Name, func(s string) bool { return strings.HasPrefix(s, pair) }); err != nil {
		return fmt.Errorf("unplug the earlier regions of pair %s from %s: %w", pair, g.Name, err)
	} else if n > 0 {
		h.log.Info("unplugged an earlier region of the pair before plugging its new one", "domain", g.Name, "devices", n)
	}
	s := virt.Shmem{Name: name, Alias: virt.UserAlias(r.DeviceID()), Size: r.Pool.Region().Layout().Size}
	start := time.Now()
	if err := h.p.Attach(ctx, g.Name, s); err != nil {
		return fmt.Errorf("plug %s into %s: %w", s.Alias, g.Name, err)
	}
	h.log.Debug("region plugged", "domain", g.Name, "shmem", name, "alias", s.Alias, "size", s.Size, "took", time.Since(start))
	return nil
}

// Unplug implements broker.Hotplug. A domain that is not running, or has
// no such device, is fine.
func (h *lvHotplug) Unplug(ctx context.Context, g *broker.Guest, r *broker.Region) error {
	return h.unplugFile(ctx, g, r.File.Name())
}

// unplugFile takes every <shmem> device backed by path out of g's domain,
// found by name (and detached by alias), so that a device an earlier
// hostd plugged (adopted, or left behind) goes too.
func (h *lvHotplug) unplugFile(ctx context.Context, g *broker.Guest, path string) error {
	name, err := shmemName(path)
	if err != nil {
		return err
	}
	start := time.Now()
	n, err := h.p.Detach(ctx, g.Name, func(s string) bool { return s == name })
	if err != nil {
		return fmt.Errorf("unplug <shmem name='%s'> from %s: %w", name, g.Name, err)
	}
	if n > 0 {
		h.log.Debug("region unplugged", "domain", g.Name, "shmem", name, "devices", n, "took", time.Since(start))
	}
	return nil
}
