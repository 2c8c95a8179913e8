package region

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/shm/wait"
)

// A sealed region is a process guests' pair region: a memfd, never a file
// with a path, sealed so that nobody can grow it or change its seals
// (sys.Sealed). A guest that holds its descriptor can still shrink it,
// which only makes the pair's own mappings fault: hostd and the libraries
// touch region memory fault-safely (internal/fault), and hostd shrinks it
// to 0 itself to take the memory back from both guests (Revoke a region:
// docs/region.md, "Revocation"). Its shadow is <StateDir>/<name>.state as
// for a file; a restarted hostd finds the memfd again through the guests
// that still map it (AdoptSealed).

// memfdName is the name a sealed region's memfd has (what /proc shows as
// "/memfd:NAME (deleted)").
func memfdName(name string) string { return "shunt-" + name }

// CreateSealed creates the sealed region name with geometry g, formats
// and maps it, and records it in a fresh shadow with meta m. It returns
// the region's pool and the memfd (to hand to guests; the caller closes
// it, and Truncate's it to take the memory back).
func (fl *Files) CreateSealed(name string, m Meta, g Geometry, sig wait.Signal) (_ *Pool, _ *os.File, err error) {
	if _, err := LayoutFor(g); err != nil {
		return nil, nil, err
	}
	f, err := sys.SealedMemfd(memfdName(name), g.Size)
	if err != nil {
		return nil, nil, fmt.Errorf("create region %s: %w", name, err)
	}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	p, err := fl.format(f, name, m, g, sig)
	if err != nil {
		return nil, nil, err
	}
	return p, f, nil
}

// AdoptSealed finds the sealed region its shadow name names after a hostd
// restart, among the descriptors and mappings of the processes that still
// hold it (guests: /proc/PID/fd, /proc/PID/map_files; root only), by its
// device and inode, which no guest can choose. It must still carry the
// seals and the size hostd gave it. The header is rewritten and the pool
// adopted as in Adopt. A region no process holds any more is
// os.ErrNotExist: its flows are gone with their guests.
func (fl *Files) AdoptSealed(name string, sig wait.Signal) (_ *Pool, _ Meta, _ *os.File, problems []error, err error) {
	sp := fl.statePath(name)
	sf, err := os.OpenFile(sp, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, Meta{}, nil, nil, fmt.Errorf("open region state %s: %w", sp, err)
	}
	sh, err := loadShadowChecked(sf)
	if err != nil {
		sf.Close()
		return nil, Meta{}, nil, nil, err
	}
	defer func() {
		if err != nil {
			sh.Close()
		}
	}()
	m, g := sh.Meta(), sh.Geometry()
	f, err := findMemfd(memfdName(name), m.Dev, m.Ino)
	if err != nil {
		return nil, Meta{}, nil, nil, fmt.Errorf("region %s: %w", name, err)
	}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	seals, err := sys.Seals(f)
	if err != nil {
		return nil, Meta{}, nil, nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, Meta{}, nil, nil, fmt.Errorf("stat region %s: %w", name, err)
	}
	switch {
	case seals&sys.Sealed != sys.Sealed:
		return nil, Meta{}, nil, nil, fmt.Errorf("region %s has seals %#x, not hostd's %#x: %w", name, seals, sys.Sealed, ErrNotOurs)
	case st.Size < g.Size:
		return nil, Meta{}, nil, nil, fmt.Errorf("region %s is %d bytes, its state says %d: it was truncated (its flows are lost): %w", name, st.Size, g.Size, ErrCorrupt)
	}
	p, problems, err := adoptMapped(f, sh, sig)
	if err != nil {
		return nil, Meta{}, nil, nil, err
	}
	return p, m, f, problems, nil
}

// RemoveState deletes the shadow of region name (a sealed region has no
// file to remove).
func (fl *Files) RemoveState(name string) error {
	if err := os.Remove(fl.statePath(name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// findMemfd opens the memfd called name with device dev and inode ino
// that some process holds as a descriptor or a mapping.
func findMemfd(name string, dev, ino uint64) (*os.File, error) {
	want := "/memfd:" + name + " (deleted)"
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	for _, p := range procs {
		if _, err := strconv.Atoi(p.Name()); err != nil {
			continue
		}
		for _, sub := range []string{"fd", "map_files"} {
			dir := filepath.Join("/proc", p.Name(), sub)
			ents, err := os.ReadDir(dir)
			if err != nil {
				continue
			}
			for _, e := range ents {
				path := filepath.Join(dir, e.Name())
				if t, err := os.Readlink(path); err != nil || t != want {
					continue
				}
				f, err := os.OpenFile(path, os.O_RDWR|syscall.O_CLOEXEC, 0)
				if err != nil {
					continue
				}
				var st unix.Stat_t
				if unix.Fstat(int(f.Fd()), &st) == nil && st.Dev == dev && st.Ino == ino {
					return f, nil
				}
				f.Close()
			}
		}
	}
	return nil, fmt.Errorf("no process holds it any more: %w", os.ErrNotExist)
}
