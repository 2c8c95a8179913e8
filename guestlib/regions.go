package guestlib

import (
	"fmt"
	"os"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
)

// mapping is a region that hostd handed over as a descriptor (REGION). It
// stays mapped while a Conn uses its rings, and goes once hostd said
// UNREGION and no Conn uses it any more. Its fields are guarded by the
// Client's mu.
type mapping struct {
	id       uint32
	r        *region.Region
	dev, ino uint64 // the file, to tell a new region with a reused id apart
	bar      string // in a VM, the BAR of the device plugged for it ("" for a descriptor)
	refs     int    // Conns attached to its rings
	done     bool   // UNREGION came (or another region took its id)
}

// rings returns the ring pair of a READY, checked against its region's
// directory, and the region's mapping, which it holds for the caller
// (releaseRegion gives it back; nil for region 0, which stays mapped).
func (c *Client) rings(m proto.Msg) (out, in *ring.Ring, mp *mapping, err error) {
	c.mu.Lock()
	reg := c.region
	if m.RegionID != 0 {
		reg = nil
		if mp = c.regions[m.RegionID]; mp != nil && !mp.done {
			reg = mp.r
			mp.refs++
		}
	}
	c.mu.Unlock()
	if reg == nil {
		return nil, nil, nil, fmt.Errorf("region %d is not mapped", m.RegionID)
	}
	ab, ba, err := reg.Rings(int(m.Slot), m.Gen)
	if err == nil && ab.Capacity() != int(m.Capacity) {
		err = ring.ErrCorrupt
	}
	if err != nil {
		c.releaseRegion(mp)
		return nil, nil, nil, err
	}
	if m.Side == proto.SideB {
		ab, ba = ba, ab
	}
	return ab, ba, mp, nil
}

// regionGiven maps a region hostd handed over (REGION with descriptor fd,
// which it takes). A region already mapped under that id is kept if it is
// the same file; another file under a reused id (a restarted hostd that
// lost track) replaces it, and the old one goes once no Conn uses it.
func (c *Client) regionGiven(m proto.Msg, fd int) {
	if fd < 0 {
		c.logf("shunt: REGION %d came without its descriptor; its flows stay on TCP", m.RegionID)
		return
	}
	f := os.NewFile(uintptr(fd), fmt.Sprintf("region %d", m.RegionID))
	defer f.Close() // the mapping stays
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		c.logf("shunt: REGION %d: %v", m.RegionID, err)
		return
	}
	c.mu.Lock()
	old := c.regions[m.RegionID]
	if old != nil && old.dev == uint64(st.Dev) && old.ino == uint64(st.Ino) {
		old.done = false
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	if m.RegionID == 0 {
		c.logf("shunt: REGION 0 is WELCOME's: ignored")
		return
	}
	r, err := region.OpenFile(f)
	if err != nil {
		c.logf("shunt: REGION %d: %v; its flows stay on TCP", m.RegionID, err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old = c.regions[m.RegionID]; old != nil {
		old.done = true
		c.unmapLocked(old)
	}
	c.regions[m.RegionID] = &mapping{id: m.RegionID, r: r, dev: uint64(st.Dev), ino: uint64(st.Ino)}
}

// regionTaken is UNREGION: no flow of this client uses the region any
// more as far as hostd knows; it is unmapped once no Conn does.
func (c *Client) regionTaken(id uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if mp := c.regions[id]; mp != nil {
		mp.done = true
		c.unmapLocked(mp)
	}
}

// releaseRegion gives back a Conn's hold on a mapping.
func (c *Client) releaseRegion(mp *mapping) {
	if mp == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	mp.refs--
	c.unmapLocked(mp)
}

// unmapLocked unmaps mp if it is done and unused.
func (c *Client) unmapLocked(mp *mapping) {
	if !mp.done || mp.refs > 0 || mp.r == nil {
		return
	}
	if c.regions[mp.id] == mp {
		delete(c.regions, mp.id)
	}
	// Retired, not unmapped: a Conn call racing with its Close may still
	// touch its ring views, and must not fault.
	mp.r.Retire()
	mp.r = nil
}

// Regions reports the ids of the regions that came by REGION and are
// mapped now (for tests and diagnostics).
func (c *Client) Regions() []uint32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	var ids []uint32
	for id, mp := range c.regions {
		if mp.r != nil {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}
