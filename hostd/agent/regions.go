package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/shm/region"
)

// openGroups makes hostd's state and region directories (root-only), and
// opens each trust group's region: adopted from hostd's shadow of it if
// hostd made it, created if it does not exist, refused (hostd does not
// start) if something else is at its path.
func (a *Agent) openGroups() error {
	files, err := region.OpenFiles(a.cfg.StateDir)
	if err != nil {
		return fmt.Errorf("state_dir: %w", err)
	}
	if err := region.SecureDir(a.cfg.RegionDir); err != nil {
		return fmt.Errorf("region_dir: %w", err)
	}
	a.files = files
	a.pairs = &pairRegions{log: a.log.Named("regions"), files: files, dir: a.cfg.RegionDir, geo: map[string]region.Geometry{},
		access: map[string]region.Access{}, live: map[*region.Pool]*os.File{}, sealed: map[*region.Pool]string{}}
	a.groups = map[string]*broker.Group{}
	for _, g := range a.cfg.Groups {
		acc, err := regionAccess(g)
		if err != nil {
			return err
		}
		pool, adopted, err := openGroupRegion(a.log, files, g, acc)
		if err != nil {
			return fmt.Errorf("trust group %s: %w", g.Name, err)
		}
		a.pools = append(a.pools, pool)
		a.pairs.geo[g.Name] = g.PairGeometry
		a.pairs.access[g.Name] = acc
		a.groups[g.Name] = &broker.Group{Name: g.Name, Region: g.Region, Pool: pool,
			Quota: broker.Quota{RingBytes: g.Quota.RingBytes, Flows: g.Quota.Flows}}
		a.log.Info("region ready", "group", g.Name, "path", g.Region, "size", g.Geometry.Size, "adopted", adopted,
			"generation", pool.Region().Generation())
	}
	return nil
}

// openGroupRegion adopts a group's region file if hostd made it (its shadow
// says so) and it has the configured geometry, or creates it if it does not
// exist.
func openGroupRegion(log hclog.Logger, files *region.Files, g config.Group, acc region.Access) (*region.Pool, bool, error) {
	name := g.StateName()
	pool, _, f, problems, err := files.Adopt(g.Region, name, acc, nil)
	switch {
	case err == nil:
		f.Close() // guests open a group region by path
		if geo := pool.Region().Layout().Geometry; geo != g.Geometry {
			pool.Close()
			return nil, false, fmt.Errorf("region %s has geometry %+v, the configuration says %+v: stop the guests using it and remove it (rm %s) to resize; its flows are lost",
				g.Region, geo, g.Geometry, g.Region)
		}
		for _, p := range problems {
			log.Warn("region slot dropped", "group", g.Name, "problem", p)
		}
		return pool, true, nil
	case !errors.Is(err, os.ErrNotExist):
		return nil, false, err
	}
	pool, f, err = files.Create(g.Region, name, region.Meta{Kind: region.KindGroup}, g.Geometry, acc, nil)
	if err != nil {
		return nil, false, err
	}
	f.Close()
	return pool, false, nil
}

// regionAccess is who may map group g's region besides hostd: its
// region_group, if set.
func regionAccess(g config.Group) (region.Access, error) {
	if g.RegionGroup == "" {
		return region.NoGroup, nil
	}
	grp, err := user.LookupGroup(g.RegionGroup)
	if err != nil {
		return region.Access{}, fmt.Errorf("trust group %s: region_group: %w", g.Name, err)
	}
	gid, err := strconv.Atoi(grp.Gid)
	if err != nil {
		return region.Access{}, fmt.Errorf("trust group %s: region_group %s has gid %q", g.Name, g.RegionGroup, grp.Gid)
	}
	return region.Access{Gid: gid}, nil
}

// pairRegions keeps the regions of guest pairs, each with its shadow in
// state_dir: the broker's PairRegions. Two process guests get theirs as a
// sealed memfd (region.Files.CreateSealed; shadow sealed-pair-A-B-pID, A
// the lower guest id, ID the region's), which has no path, cannot grow,
// and is truncated to nothing when dropped. Two VMs get theirs as a file
// region_dir/pair-A-B-pID, a device QEMU plugs in; region_dir is
// root-only, so no guest can open it by path. The region of a pair with a libvirt domain in it
// is /dev/shm/shunt-pair-A-B-pID instead (virt.PairShmem; state name
// shmpair-A-B-pID), since libvirt backs a <shmem> device only with
// /dev/shm/<name>: created by hostd as a group region is (O_EXCL,
// O_NOFOLLOW, root, the group's region_group, 0660), so that a QEMU
// libvirt runs unprivileged can open it.
type pairRegions struct {
	log    hclog.Logger
	files  *region.Files
	dir    string
	geo    map[string]region.Geometry // by trust group
	access map[string]region.Access   // by trust group: its region_group

	mu     sync.Mutex
	live   map[*region.Pool]*os.File // made or adopted, not dropped: closed (kept) when hostd stops
	sealed map[*region.Pool]string   // the live sealed ones, by state name
	dying  map[*os.File]*time.Timer  // dropped sealed ones, until truncateLater truncates them
}

// truncateDelay is how long a dropped sealed region keeps its memory after
// its guests were told UNREGION (the broker sends it right after Drop):
// honest libraries let it go at UNREGION (their mapping turns into
// private zeros), so only a mapping a guest kept against hostd's word
// faults when it is truncated.
const truncateDelay = time.Second

// truncateLater truncates dropped sealed region f to nothing after
// truncateDelay, and closes it: every mapping a guest kept faults from
// then on (the libraries fail its flows cleanly), so no two guests can go
// on exchanging bytes through it once hostd let it go (docs/region.md,
// "Revocation"). Sealed against growth, it can never hold anything again.
func (p *pairRegions) truncateLater(name string, f *os.File) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dying == nil {
		p.dying = map[*os.File]*time.Timer{}
	}
	p.dying[f] = time.AfterFunc(truncateDelay, func() {
		p.mu.Lock()
		_, mine := p.dying[f]
		delete(p.dying, f)
		p.mu.Unlock()
		if mine {
			p.truncate(name, f)
		}
	})
}

func (p *pairRegions) truncate(name string, f *os.File) {
	if err := f.Truncate(0); err != nil {
		p.log.Error("cannot take a pair region's memory back", "region", name, "error", err)
	}
	f.Close()
}

// pairName is the file name of region id of guests a and b (a the lower
// id): each region of a pair has its own, so that dropping a pair's old
// region (after its unplug) can never remove the file of the next one,
// made meanwhile, which a VM's QEMU opens by path.
func pairName(a, b, id uint32) string { return fmt.Sprintf("pair-%d-%d-p%d", a, b, id) }

// shmPairPrefix begins the state names of pair regions in /dev/shm.
const shmPairPrefix = "shm"

// sealedPrefix begins the state names of process guests' (sealed) pair
// regions.
const sealedPrefix = "sealed-"

// sealed reports whether the pair region of a and b is a sealed memfd:
// process guests, which get it as a descriptor.
func sealed(a, b *broker.Guest) bool { return !a.SharedRegion && !b.SharedRegion }

// place returns where region id of guests a and b (a.ID <= b.ID) lives:
// its path, state name and who besides hostd may open it.
func (p *pairRegions) place(a, b *broker.Guest, id uint32) (path, name string, acc region.Access) {
	if a.Source == sourceLibvirt || b.Source == sourceLibvirt {
		shm := virt.PairShmem(a.ID, b.ID, id)
		return filepath.Join(shmDir, shm), shmPairPrefix + strings.TrimPrefix(shm, "shunt-"), p.access[a.Group.Name]
	}
	name = pairName(a.ID, b.ID, id)
	return filepath.Join(p.dir, name), name, region.NoGroup
}

// Make implements broker.PairRegions.
func (p *pairRegions) Make(id uint32, a, b *broker.Guest) (*region.Pool, *os.File, error) {
	m := region.Meta{Kind: region.KindPair, ID: id, GuestA: a.ID, GuestB: b.ID}
	if sealed(a, b) {
		name := sealedPrefix + pairName(a.ID, b.ID, id)
		pool, f, err := p.files.CreateSealed(name, m, p.geo[a.Group.Name], nil)
		if err == nil {
			p.keepSealed(pool, f, name)
		}
		return pool, f, err
	}
	path, name, acc := p.place(a, b, id)
	pool, f, err := p.files.Create(path, name, m, p.geo[a.Group.Name], acc, nil)
	if errors.Is(err, region.ErrNotOurs) {
		// Left in hostd's own directory by a hostd that died between
		// making the file and recording it: nobody else can write there.
		// In /dev/shm, a name hostd keeps for itself (virt.PairShmem):
		// left the same way, or made by another user first. Removing
		// the name takes nothing from whoever has it open, and hostd
		// uses only a file it creates (O_EXCL): a second squat fails.
		p.log.Warn("removing a stale pair region", "path", path)
		_ = p.files.Remove(path, name)
		pool, f, err = p.files.Create(path, name, m, p.geo[a.Group.Name], acc, nil)
	}
	if err == nil {
		p.keep(pool, f)
	}
	return pool, f, err
}

func (p *pairRegions) keep(pool *region.Pool, f *os.File) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.live[pool] = f
}

// keepSealed keeps a sealed region, whose state is called name.
func (p *pairRegions) keepSealed(pool *region.Pool, f *os.File, name string) {
	p.keep(pool, f)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sealed[pool] = name
}

// close unmaps every pair region and closes its file, leaving the files
// and shadows for the next hostd.
func (p *pairRegions) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pool, f := range p.live {
		pool.Close()
		f.Close()
	}
	for f, t := range p.dying { // dropped: their memory goes now
		t.Stop()
		p.truncate(f.Name(), f)
	}
	p.dying = nil
	p.live = map[*region.Pool]*os.File{}
	p.sealed = map[*region.Pool]string{}
}

// Drop implements broker.PairRegions.
func (p *pairRegions) Drop(r *broker.Region) {
	p.mu.Lock()
	delete(p.live, r.Pool)
	sname, sealed := p.sealed[r.Pool]
	delete(p.sealed, r.Pool)
	p.mu.Unlock()
	r.Pool.Close()
	if sealed {
		p.truncateLater(r.Name(), r.File)
		if err := p.files.RemoveState(sname); err != nil {
			p.log.Warn("cannot remove a pair region's state", "region", r.Name(), "error", err)
		}
		return
	}
	path, name, _ := p.place(r.A, r.B, r.ID)
	if r.File != nil {
		r.File.Close()
	}
	if err := p.files.Remove(path, name); err != nil {
		p.log.Warn("cannot remove a pair region", "region", r.Name(), "error", err)
	}
}

// adoptPairs reopens the pair regions an earlier hostd left (those its
// shadows name) and hands their flows to the broker; a region that cannot
// be adopted, or has no live flow, is removed, as is any file in
// region_dir that no shadow names. Run it once the libvirt domains are
// registered: a libvirt pair's region (in /dev/shm) is opened for its
// group's region_group.
func (a *Agent) adoptPairs() {
	names, err := a.files.Names("pair-")
	if err == nil {
		var shm []string
		shm, err = a.files.Names(shmPairPrefix + "pair-")
		names = append(names, shm...)
	}
	if err != nil {
		a.log.Warn("cannot list pair regions to adopt", "error", err)
		return
	}
	a.adoptSealed()
	known := map[string]bool{}
	for _, name := range names {
		known[name] = true
		path, acc := filepath.Join(a.cfg.RegionDir, name), region.NoGroup
		if pair, ok := strings.CutPrefix(name, shmPairPrefix); ok {
			path, acc = filepath.Join(shmDir, "shunt-"+pair), a.shmPairAccess(pair)
		}
		pool, m, f, problems, err := a.files.Adopt(path, name, acc, nil)
		if err != nil {
			a.log.Warn("pair region not adopted; removing it (its flows are lost)", "path", path, "error", err)
			_ = a.files.Remove(path, name)
			continue
		}
		for _, p := range problems {
			a.log.Warn("region slot dropped", "path", path, "problem", p)
		}
		drop := func() {
			a.unplugStale(m, path)
			pool.Close()
			f.Close()
			_ = a.files.Remove(path, name)
		}
		if a.orphaned(m) {
			// A killed hostd's relay was its other guest: the cross-host
			// room adopts it once it exists (orphans.go).
			a.orphans = append(a.orphans, orphanRegion{m: m, pool: pool, f: f, keep: func() { a.pairs.keep(pool, f) }, drop: drop})
			continue
		}
		n, ok := a.b.AdoptPair(m, pool, f)
		if !ok {
			drop()
			continue
		}
		a.pairs.keep(pool, f)
		a.log.Info("adopted live flows from a pair region", "path", path, "region", m.ID, "flows", n)
	}
	ents, err := os.ReadDir(a.cfg.RegionDir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if !known[e.Name()] {
			a.log.Warn("removing a file in region_dir that hostd has no record of", "path", filepath.Join(a.cfg.RegionDir, e.Name()))
			_ = os.Remove(filepath.Join(a.cfg.RegionDir, e.Name()))
		}
	}
}

// adoptSealed finds the sealed pair regions an earlier hostd left (those
// its shadows name) in the guests that still map them, and hands their
// flows to the broker; a shadow whose region cannot be adopted (no
// process holds it any more, it was shrunk, its guests are gone, or it
// has no live flow) is removed, and the region, if found, truncated.
func (a *Agent) adoptSealed() {
	names, err := a.files.Names(sealedPrefix + "pair-")
	if err != nil {
		a.log.Warn("cannot list pair regions to adopt", "error", err)
		return
	}
	for _, name := range names {
		pool, m, f, problems, err := a.files.AdoptSealed(name, nil)
		if err != nil {
			a.log.Warn("pair region not adopted (its flows are lost)", "region", name, "error", err)
			_ = a.files.RemoveState(name)
			continue
		}
		for _, p := range problems {
			a.log.Warn("region slot dropped", "region", name, "problem", p)
		}
		drop := func() {
			pool.Close()
			_ = f.Truncate(0)
			f.Close()
			_ = a.files.RemoveState(name)
		}
		if a.orphaned(m) {
			a.orphans = append(a.orphans, orphanRegion{m: m, pool: pool, f: f, keep: func() { a.pairs.keepSealed(pool, f, name) }, drop: drop})
			continue
		}
		n, ok := a.b.AdoptPair(m, pool, f)
		if !ok {
			drop()
			continue
		}
		a.pairs.keepSealed(pool, f, name)
		a.log.Info("adopted live flows from a pair region", "region", name, "flows", n)
	}
}

// shmPairAccess is who may open the libvirt pair region named pair
// ("pair-A-B-pID"): the region_group of the trust group of A or B,
// whichever is a registered libvirt domain (if neither, the region is
// not adopted anyway).
func (a *Agent) shmPairAccess(pair string) region.Access {
	var ga, gb uint32
	if _, err := fmt.Sscanf(pair, "pair-%d-%d-", &ga, &gb); err != nil {
		return region.NoGroup
	}
	a.vmu.Lock()
	defer a.vmu.Unlock()
	for _, g := range a.vguests {
		if g.ID == ga || g.ID == gb {
			return a.pairs.access[g.Group.Name]
		}
	}
	return region.NoGroup
}

// unplugStale takes the devices of a VM pair region that is not adopted
// (no live flow) out of its VMs, in the background: an earlier hostd
// plugged them (docs/vm.md, "Pair regions").
func (a *Agent) unplugStale(m region.Meta, path string) {
	if a.hot == nil && a.lvhot == nil {
		return
	}
	h := &vmHotplug{qmp: a.hot, lv: a.lvhot}
	a.vmu.Lock()
	guests := slices.Collect(maps.Values(a.vguests))
	a.vmu.Unlock()
	for _, g := range append(guests, a.guests...) {
		if g.PairVM && (g.ID == m.GuestA || g.ID == m.GuestB) {
			a.wg.Add(1)
			go func() {
				defer a.wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				if err := h.unplugFile(ctx, g, path); err != nil {
					a.log.Warn("cannot unplug a stale pair region from its VM", "guest", g.Name, "path", path, "error", err)
				}
			}()
		}
	}
}
