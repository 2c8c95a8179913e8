package broker

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
)

// Hotplug attaches pair regions to VMs: a VM gets memory at run time only
// as a device plugged into it (an ivshmem-plain device on the region's
// file, hostd/agent over QMP). The broker calls it without its mutex, from
// goroutines it owns; Plug and Unplug of one region run one after the
// other. Implementations must be safe for concurrent use.
type Hotplug interface {
	// Plug makes region r a device of guest g's VM (r.File is the
	// region's file, r.DeviceID the device's id), and returns once the
	// hypervisor added it; the guest finds it on its own (by the region
	// header, docs/vm.md, "Pair regions").
	Plug(ctx context.Context, g *Guest, r *Region) error
	// Unplug takes r's device out of g's VM and returns once the
	// hypervisor let go of it; a VM that is gone, or has no such device,
	// is not an error.
	Unplug(ctx context.Context, g *Guest, r *Region) error
}

// UseHotplug gives the broker the way to plug pair regions into VMs: the
// flows between two PairVM guests then live in a region of that pair's,
// plugged into both VMs when its first flow needs it and unplugged when
// its last flow is gone (after PairRegionLinger). Call it before the
// broker serves, with UsePairRegions.
func (b *Broker) UseHotplug(h Hotplug) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.hotplug = h
}

// plugTimeout bounds one region's plug or unplug in both VMs (the guest's
// ACPI eject included).
const plugTimeout = 20 * time.Second

// reasonPlugging marks a connection on TCP whose pair region is being
// plugged into its VMs: READY follows when it is. It is the broker's own
// and never sent (tellTCP drops it); listings say "region-plug".
const reasonPlugging = proto.Reason(0xffff)

// reasonName is how listings and logs name a connection's reason.
func reasonName(r proto.Reason) string {
	switch r {
	case reasonPlugging:
		return "region-plug"
	case reasonRetired:
		return "region-retired"
	}
	return r.String()
}

// vmPlug is a VM pair region's hot-plug state; guarded by the broker's
// mutex.
type vmPlug struct {
	plugged bool           // the device is in both VMs: READY may name the region
	waiting map[*Conn]bool // connections on TCP until it is
	took    time.Duration  // how long the plug took (both VMs, in parallel)
	epoch   string         // the plugging hostd's, for DeviceID
}

// plugEpoch tells this hostd's devices from an earlier one's.
var plugEpoch = strconv.FormatInt(time.Now().Unix()%(1<<30), 36)

// DeviceID is the id of a VM pair region's device in its VMs ("" for any
// other region): "shunt-pID-EPOCH", unique among a VM's devices, since a
// pair has one region at a time, region ids are not reused while hostd
// runs, and EPOCH is this hostd's (a device an earlier hostd left keeps
// its own id; Hotplug finds a region's devices by its file).
func (r *Region) DeviceID() string {
	if r.vm == nil {
		return ""
	}
	return fmt.Sprintf("shunt-p%d-%s", r.ID, r.vm.epoch)
}

// vms are the VMs r is plugged into: its pair's two, or one (a pair of a
// guest with itself).
func (r *Region) vms() []*Guest {
	if r.A == r.B {
		return []*Guest{r.A}
	}
	return []*Guest{r.A, r.B}
}

// inItsVMs runs op (Hotplug's Plug or Unplug) for r in each of its VMs,
// in parallel, and returns their errors joined.
func inItsVMs(ctx context.Context, r *Region, op func(context.Context, *Guest, *Region) error) error {
	vms := r.vms()
	errs := make(chan error, len(vms))
	for _, g := range vms {
		go func() { errs <- op(ctx, g, r) }()
	}
	var err error
	for range vms {
		err = errors.Join(err, <-errs)
	}
	return err
}

// plugLocked starts plugging new VM pair region r into its two VMs; once
// both have it, the connections waiting for it get READY.
func (b *Broker) plugLocked(r *Region) {
	r.vm = &vmPlug{waiting: map[*Conn]bool{}, epoch: plugEpoch}
	h := b.hotplug
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), plugTimeout)
		defer cancel()
		go func() {
			select {
			case <-b.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		start := time.Now()
		err := inItsVMs(ctx, r, h.Plug)
		took := time.Since(start)
		b.mu.Lock()
		defer b.mu.Unlock()
		if b.closed {
			return
		}
		b.pluggedLocked(r, took, err)
	}()
}

// pluggedLocked ends r's plug: the waiting connections get READY (or, if
// it failed, TCP(internal), and the region goes).
func (b *Broker) pluggedLocked(r *Region, took time.Duration, err error) {
	waiting := r.vm.waiting
	r.vm.waiting = map[*Conn]bool{}
	if err != nil {
		b.log.Error("cannot plug a pair region into its VMs: their connections stay on TCP (internal)", "region", r.Name(),
			"a", r.A.Name, "b", r.B.Name, "took", took, "error", err)
		for c := range waiting {
			if b.records[c] && c.flow == nil && c.reason == reasonPlugging {
				b.setPathLocked(c, PathTCP, proto.ReasonInternal)
				b.tellTCPLocked(c, proto.ReasonInternal)
			}
		}
		b.dropRegionLocked(r) // unplugs what was plugged
		return
	}
	r.vm.plugged, r.vm.took = true, took
	b.m.Plug.WithLabelValues("plug").Observe(took.Seconds())
	b.log.Info("pair region plugged into its VMs", "region", r.Name(), "device", r.DeviceID(), "a", r.A.Name, "b", r.B.Name,
		"took", took.Round(time.Microsecond), "waiting", len(waiting))
	for c := range waiting {
		if !b.records[c] || c.flow != nil || c.reason != reasonPlugging {
			continue
		}
		if reason := b.upgradeLocked(c, time.Now()); reason != proto.ReasonNone {
			b.tellTCPLocked(c, reason)
		}
	}
	if r.flows == 0 {
		b.idleLocked(r) // nobody waited any more: it goes after its linger
	}
}

// tellTCPLocked tells both ends of c that it stays on TCP for reason.
func (b *Broker) tellTCPLocked(c *Conn, reason proto.Reason) {
	count := true
	for _, e := range []*end{&c.a, &c.b} {
		if e.sess != nil && !e.done {
			b.tellTCP(e.sess, e.req, reason, count)
			count = false
		}
	}
}

// unplugLocked takes dropped VM pair region r out of its VMs, then lets
// its file go (PairRegions.Drop). The guests were told UNREGION first.
func (b *Broker) unplugLocked(r *Region) {
	rg := b.rgLocked()
	h, pairs := b.hotplug, rg.pairs
	rg.unplugging[r] = true
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), plugTimeout)
		defer cancel()
		start := time.Now()
		if err := inItsVMs(ctx, r, h.Unplug); err != nil {
			b.log.Warn("cannot unplug a pair region from its VMs", "region", r.Name(), "device", r.DeviceID(), "error", err)
		} else {
			b.m.Plug.WithLabelValues("unplug").Observe(time.Since(start).Seconds())
			b.log.Info("pair region unplugged from its VMs", "region", r.Name(), "device", r.DeviceID(), "took", time.Since(start).Round(time.Microsecond))
		}
		if pairs != nil {
			pairs.Drop(r)
		}
		b.mu.Lock()
		delete(rg.unplugging, r)
		b.mu.Unlock()
	}()
}
