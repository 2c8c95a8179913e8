package guestlib

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/vhost/ivshmem"
)

// A VM of a trust group with pair regions (hostd.hcl vm_regions = "pair")
// gets no region 0: hostd plugs each pair region into both VMs as an
// ivshmem device and then sends REGION without a descriptor, and READY
// after it. The library finds the device whose region header names that
// region id and this guest (region.Region.Name), maps its BAR, and
// forgets it at UNREGION, after which hostd unplugs it (docs/vm.md, "Pair
// regions").
const (
	barWait   = 10 * time.Second       // how long a plugged device may take to show up in the guest
	barRescan = 500 * time.Millisecond // then the PCI buses are rescanned, once
	barPoll   = 10 * time.Millisecond
)

// regionOnBar maps the region of a REGION that came without a descriptor
// on a VM's port: the ivshmem device plugged for it. It runs on the
// session's reader, so the READY that follows finds the mapping; it waits
// for the guest kernel to find the device (ACPI or PCIe hotplug), at most
// barWait, and rescans the PCI buses once if it takes long.
func (c *Client) regionOnBar(m proto.Msg) {
	c.mu.Lock()
	gid := c.guestID
	if old := c.regions[m.RegionID]; old != nil && old.r != nil && names(old.r, m, gid) {
		old.done = false
		c.mu.Unlock()
		return
	}
	taken := map[string]bool{}
	for _, mp := range c.regions {
		if mp.r != nil && mp.bar != "" {
			taken[mp.bar] = true
		}
	}
	c.mu.Unlock()
	start := time.Now()
	rescanned := false
	wait := barWait
	if c.stretches() {
		// A VM that carries flows over vsock (docs/vsock.md) has no
		// device plugged for a pair region: hostd hot-plugs only for
		// VMs of a group with pair regions, which have no stretches.
		// Waiting would hold the READY behind it for barWait.
		wait, rescanned = 0, true
	}
	for {
		r, bar, st := findBar(c.vm.sysfs, m, gid, taken)
		if r != nil {
			c.mu.Lock()
			if old := c.regions[m.RegionID]; old != nil {
				old.done = true
				c.unmapLocked(old)
			}
			c.regions[m.RegionID] = &mapping{id: m.RegionID, r: r, dev: uint64(st.Dev), ino: uint64(st.Ino), bar: bar}
			c.mu.Unlock()
			c.logf("shunt: region %d mapped from %s (found %v after REGION)", m.RegionID, bar, time.Since(start).Round(time.Millisecond))
			return
		}
		if !rescanned && time.Since(start) > barRescan {
			rescanned = true
			if err := ivshmem.Rescan(c.vm.sysfs); err != nil {
				c.logf("shunt: region %d: %v", m.RegionID, err)
			}
		}
		if wait == 0 {
			c.logf("shunt: REGION %d: no ivshmem device names it; its flows go over vsock", m.RegionID)
			return
		}
		if time.Since(start) > wait {
			c.logf("shunt: REGION %d: no ivshmem device names it after %v; its flows stay on TCP", m.RegionID, wait)
			return
		}
		time.Sleep(barPoll)
	}
}

// findBar returns the mapped BAR of the ivshmem device whose region header
// names region m.RegionID of this guest (gid one of its pair) with the
// size REGION says, skipping BARs mapped already; nil if none does (yet).
func findBar(sysfs string, m proto.Msg, gid uint32, taken map[string]bool) (*region.Region, string, unix.Stat_t) {
	var st unix.Stat_t
	devs, _ := ivshmem.List(sysfs)
	for _, dev := range devs {
		bar, err := ivshmem.BAR(dev)
		if err != nil || taken[bar] {
			continue
		}
		r, err := region.Open(bar)
		if err != nil {
			continue // not enabled yet, or another region's header not written yet
		}
		if names(r, m, gid) && unix.Stat(bar, &st) == nil {
			return r, bar, st
		}
		r.Close()
	}
	return nil, "", st
}

// names reports whether r's header names the region of REGION m, of a
// pair that guest gid is in.
func names(r *region.Region, m proto.Msg, gid uint32) bool {
	id, a, b := r.Name()
	return id == m.RegionID && id != 0 && (a == gid || b == gid) && uint64(r.Layout().Size) == m.RegionSize
}

// onPort reports whether s is a VM's virtio-serial port.
func (s *session) onPort() bool {
	_, ok := s.conn.(portConn)
	return ok
}

// onVsock reports whether s is a VM's control channel over vsock.
func (s *session) onVsock() bool {
	_, ok := s.conn.(vsockConn)
	return ok
}
