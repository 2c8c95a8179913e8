package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
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
		live: map[*region.Pool]*os.File{}}
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

// pairRegions keeps the regions of guest pairs as files region_dir/pair-A-B
// (A the lower guest id), each with its shadow in state_dir: the broker's
// PairRegions. Both directories are root-only, so no guest can open a pair
// region by path; its two guests get it as a descriptor.
type pairRegions struct {
	log   hclog.Logger
	files *region.Files
	dir   string
	geo   map[string]region.Geometry // by trust group

	mu   sync.Mutex
	live map[*region.Pool]*os.File // made or adopted, not dropped: closed (kept) when hostd stops
}

func pairName(a, b uint32) string { return fmt.Sprintf("pair-%d-%d", a, b) }

// Make implements broker.PairRegions.
func (p *pairRegions) Make(id uint32, a, b *broker.Guest) (*region.Pool, *os.File, error) {
	name := pairName(a.ID, b.ID)
	path := filepath.Join(p.dir, name)
	m := region.Meta{Kind: region.KindPair, ID: id, GuestA: a.ID, GuestB: b.ID}
	pool, f, err := p.files.Create(path, name, m, p.geo[a.Group.Name], region.NoGroup, nil)
	if errors.Is(err, region.ErrNotOurs) {
		// Left in hostd's own directory by a hostd that died between
		// making the file and recording it: nobody else can write there.
		p.log.Warn("removing a stale pair region", "path", path)
		_ = p.files.Remove(path, name)
		pool, f, err = p.files.Create(path, name, m, p.geo[a.Group.Name], region.NoGroup, nil)
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

// close unmaps every pair region and closes its file, leaving the files
// and shadows for the next hostd.
func (p *pairRegions) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pool, f := range p.live {
		pool.Close()
		f.Close()
	}
	p.live = map[*region.Pool]*os.File{}
}

// Drop implements broker.PairRegions.
func (p *pairRegions) Drop(r *broker.Region) {
	name := pairName(r.A.ID, r.B.ID)
	p.mu.Lock()
	delete(p.live, r.Pool)
	p.mu.Unlock()
	r.Pool.Close()
	if r.File != nil {
		r.File.Close()
	}
	if err := p.files.Remove(filepath.Join(p.dir, name), name); err != nil {
		p.log.Warn("cannot remove a pair region", "region", r.Name(), "error", err)
	}
}

// adoptPairs reopens the pair regions an earlier hostd left (those its
// shadows name) and hands their flows to the broker; a region that cannot
// be adopted, or has no live flow, is removed, as is any file in
// region_dir that no shadow names.
func (a *Agent) adoptPairs() {
	names, err := a.files.Names("pair-")
	if err != nil {
		a.log.Warn("cannot list pair regions to adopt", "error", err)
		return
	}
	known := map[string]bool{}
	for _, name := range names {
		known[name] = true
		path := filepath.Join(a.cfg.RegionDir, name)
		pool, m, f, problems, err := a.files.Adopt(path, name, region.NoGroup, nil)
		if err != nil {
			a.log.Warn("pair region not adopted; removing it (its flows are lost)", "path", path, "error", err)
			_ = a.files.Remove(path, name)
			continue
		}
		for _, p := range problems {
			a.log.Warn("region slot dropped", "path", path, "problem", p)
		}
		n, ok := a.b.AdoptPair(m, pool, f)
		if !ok {
			a.unplugStale(m, path)
			pool.Close()
			f.Close()
			_ = a.files.Remove(path, name)
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

// unplugStale takes the devices of a VM pair region that is not adopted
// (no live flow) out of its VMs, in the background: an earlier hostd
// plugged them (docs/vm.md, "Pair regions").
func (a *Agent) unplugStale(m region.Meta, path string) {
	if a.hot == nil {
		return
	}
	for _, g := range a.guests {
		if g.PairVM && (g.ID == m.GuestA || g.ID == m.GuestB) {
			a.wg.Add(1)
			go func() {
				defer a.wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				if err := a.hot.unplugFile(ctx, g, path); err != nil {
					a.log.Warn("cannot unplug a stale pair region from its VM", "guest", g.Name, "path", path, "error", err)
				}
			}()
		}
	}
}
