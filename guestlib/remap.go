package guestlib

import (
	"strings"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/vhost/ivshmem"
)

// remapRegionZero maps region 0 again when the mapping no longer holds
// the region WELCOME names (no valid header, or another generation): a VM's ivshmem device was unplugged and
// plugged back (a live migration: docs/vm.md), so the old mapping shows
// dead memory, and the new device may be disabled or elsewhere. The BAR
// is found (and enabled) again. The old mapping is kept, not unmapped:
// connections left its rings before the unplug (hostd's DOWN(migrating)),
// but the library counts no users of region 0. It runs on the session's
// reader, before the WELCOME's announcements (OPEN again) go out, so every
// READY after them finds the new mapping.
func (c *Client) remapRegionZero(welcome proto.Msg) {
	c.mu.Lock()
	old := c.region
	c.mu.Unlock()
	if old == nil || welcome.RegionSize == 0 || intact(old, welcome) {
		return
	}
	path := c.opts.Region
	if path == "" || strings.HasPrefix(path, c.vm.sysfs+"/") {
		bar, err := ivshmem.Find(c.vm.sysfs)
		if err != nil {
			c.logf("shunt: region 0 changed and its device is not found again: %v; connections stay on TCP", err)
			return
		}
		path = bar
	}
	r, err := region.Open(path)
	if err != nil {
		c.logf("shunt: region 0 changed and cannot be mapped again: %v; connections stay on TCP", err)
		return
	}
	c.mu.Lock()
	c.region = r
	c.mu.Unlock()
	c.logf("shunt: region 0 mapped again (%s, generation %d): its device was plugged back", path, r.Generation())
}

// intact reports whether r still shows the region of welcome: a valid
// header of the same size and generation (an unplugged BAR reads as zeros
// or ones).
func intact(r *region.Region, welcome proto.Msg) bool {
	l, err := region.DecodeHeader(r.Mem(), int64(len(r.Mem())))
	return err == nil && uint64(l.Size) == welcome.RegionSize && r.Generation() == welcome.Gen
}
