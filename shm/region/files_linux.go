package region

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/shm/wait"
)

// ErrNotOurs means a region file exists that hostd did not create (no
// shadow names it, or it is another file than the one its shadow names), or
// that another user could have made or changed: hostd refuses to adopt it.
var ErrNotOurs = errors.New("shunt region: not a region file that hostd created")

// Files keeps region files and their shadows where other local users cannot
// reach them. Region files are created with O_CREAT|O_EXCL|O_NOFOLLOW (never
// through a symlink, never over another user's file) and reopened with
// O_NOFOLLOW and checked with fstat (a regular file, owned by hostd's user,
// one link, no access for others); each has a shadow, <StateDir>/<name>.state,
// that records the file's device and inode: a region file that no shadow
// names is not adopted. A Files is safe for concurrent use if its callers
// do not create or remove one name concurrently.
type Files struct {
	StateDir string
}

// OpenFiles makes (or checks) the state directory: see SecureDir.
func OpenFiles(stateDir string) (*Files, error) {
	if err := SecureDir(stateDir); err != nil {
		return nil, err
	}
	return &Files{StateDir: stateDir}, nil
}

// SecureDir makes dir, mode 0700, with its missing parents (0755), and
// checks it: a directory and not a symlink, owned by this process's user;
// a mode that lets others in is tightened to 0700. A directory another user
// owns is an error that says to remove it.
func SecureDir(dir string) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return fmt.Errorf("make %s: %w", filepath.Dir(dir), err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("make %s: %w", dir, err)
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("directory %s: %w: it must be a directory that hostd made (not a symlink); remove it: rm %s", dir, err, dir)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("stat %s: %w", dir, err)
	}
	if me := uint32(os.Geteuid()); st.Uid != me {
		return fmt.Errorf("directory %s is owned by uid %d, not hostd's uid %d: that user could replace the region files in it; remove it (rm -r %s) and hostd makes it again", dir, st.Uid, me, dir)
	}
	if st.Mode&0o077 != 0 {
		if err := unix.Fchmod(fd, 0o700); err != nil {
			return fmt.Errorf("chmod 0700 %s: %w", dir, err)
		}
	}
	return nil
}

// statePath is the shadow of region name.
func (fl *Files) statePath(name string) string { return filepath.Join(fl.StateDir, name+".state") }

// Access says who may map a region file besides hostd: Gid >= 0 gives it to
// that group, mode 0660 (QEMUs that libvirt runs as an unprivileged user);
// otherwise the file is 0600.
type Access struct{ Gid int }

// NoGroup is the Access of a file only hostd's user may open.
var NoGroup = Access{Gid: -1}

func (a Access) perm() uint32 {
	if a.Gid >= 0 {
		return 0o660
	}
	return 0o600
}

// Create creates the region file path, which must not exist, with geometry g
// and access a; formats and maps it; and records it in a fresh shadow
// <StateDir>/<name>.state with meta m (a stale shadow of that name is
// replaced). It returns the region's pool, which persists to the shadow,
// and the open file (to hand to guests; the caller closes it).
func (fl *Files) Create(path, name string, m Meta, g Geometry, a Access, sig wait.Signal) (_ *Pool, _ *os.File, err error) {
	if _, err := LayoutFor(g); err != nil {
		return nil, nil, err
	}
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if errors.Is(err, unix.EEXIST) {
		return nil, nil, fmt.Errorf("create region %s: %w: something else made it first; if no guest uses it, rm %s: %w", path, err, path, ErrNotOurs)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("create region %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer func() {
		if err != nil {
			f.Close()
			_ = os.Remove(path)
		}
	}()
	if a.Gid >= 0 {
		if err := f.Chown(-1, a.Gid); err != nil {
			return nil, nil, fmt.Errorf("give region %s to gid %d: %w", path, a.Gid, err)
		}
	}
	if err := f.Chmod(os.FileMode(a.perm())); err != nil { // the umask may have narrowed it
		return nil, nil, fmt.Errorf("chmod region %s: %w", path, err)
	}
	if err := f.Truncate(g.Size); err != nil {
		return nil, nil, fmt.Errorf("size region %s: %w", path, err)
	}
	p, err := fl.format(f, name, m, g, sig)
	if err != nil {
		return nil, nil, err
	}
	return p, f, nil
}

// format records the identity of the new region file f (sized to g) in
// m, formats and maps it, names it (a pair region), and makes its shadow
// name: the pool it returns persists to it.
func (fl *Files) format(f *os.File, name string, m Meta, g Geometry, sig wait.Signal) (*Pool, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("stat region %s: %w", f.Name(), err)
	}
	m.Dev, m.Ino, m.Generation = st.Dev, st.Ino, 1
	r, err := mapAnd(f, g.Size, func(mem []byte) (*Region, error) { return Format(mem, g) })
	if err != nil {
		return nil, err
	}
	if m.Kind == KindPair {
		r.SetName(m.ID, m.GuestA, m.GuestB)
	}
	p, err := fl.record(name, m, g, r, sig)
	if err != nil {
		r.Close()
		return nil, err
	}
	return p, nil
}

// record makes the fresh shadow of region r, named name, and returns its
// pool, which persists to it.
func (fl *Files) record(name string, m Meta, g Geometry, r *Region, sig wait.Signal) (*Pool, error) {
	sp := fl.statePath(name)
	_ = os.Remove(sp)
	sf, err := os.OpenFile(sp, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create region state %s: %w", sp, err)
	}
	sh, err := newShadow(sf, m, g)
	if err != nil {
		sf.Close()
		_ = os.Remove(sp)
		return nil, err
	}
	p := NewPool(r, sig)
	if err := p.Persist(sh); err != nil {
		sh.Close()
		_ = os.Remove(sp)
		return nil, err
	}
	return p, nil
}

// Adopt reopens region file path, which hostd created with Create under the
// same name, after a restart. The file must be the one its shadow names
// (device and inode), a regular file owned by hostd's user with one link and
// no access for others (for its group only with a.Gid, whose group it is
// given again); otherwise Adopt fails with ErrNotOurs and says what to
// remove. A missing file is os.ErrNotExist (the caller creates it). The
// region header is rewritten from the shadow with the next generation, and
// the pool is adopted from the shadow (AdoptShadow; problems lists dropped
// slots). It returns the pool, the shadow's meta and the open file.
func (fl *Files) Adopt(path, name string, a Access, sig wait.Signal) (_ *Pool, _ Meta, _ *os.File, problems []error, err error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	switch {
	case errors.Is(err, unix.ENOENT):
		return nil, Meta{}, nil, nil, fmt.Errorf("region %s: %w", path, os.ErrNotExist)
	case errors.Is(err, unix.ELOOP):
		return nil, Meta{}, nil, nil, fmt.Errorf("region %s is a symlink: hostd never follows one (it would map, or truncate, what it points at); remove it: rm %s: %w", path, path, ErrNotOurs)
	case err != nil:
		return nil, Meta{}, nil, nil, fmt.Errorf("open region %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, Meta{}, nil, nil, fmt.Errorf("stat region %s: %w", path, err)
	}
	if err := checkOwned(path, &st, a); err != nil {
		return nil, Meta{}, nil, nil, err
	}
	sp := fl.statePath(name)
	sf, err := os.OpenFile(sp, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, Meta{}, nil, nil, fmt.Errorf("region %s exists, but hostd has no record of creating it (no %s): another user may have made it, or an older hostd; if no guest uses it, remove it (rm %s) and hostd creates it afresh: %w", path, sp, path, ErrNotOurs)
	}
	if err != nil {
		return nil, Meta{}, nil, nil, fmt.Errorf("open region state %s: %w", sp, err)
	}
	sh, err := loadShadowChecked(sf)
	if err != nil {
		sf.Close()
		return nil, Meta{}, nil, nil, fmt.Errorf("%w: remove both %s and %s (their flows are lost) and start hostd again", err, path, sp)
	}
	defer func() {
		if err != nil {
			sh.Close()
		}
	}()
	m, g := sh.Meta(), sh.Geometry()
	if m.Dev != st.Dev || m.Ino != st.Ino {
		return nil, Meta{}, nil, nil, fmt.Errorf("region %s is not the file hostd created (inode %d, its state %s says %d): something replaced it; if no guest uses it, rm %s %s: %w", path, st.Ino, sp, m.Ino, path, sp, ErrNotOurs)
	}
	if st.Size < g.Size {
		return nil, Meta{}, nil, nil, fmt.Errorf("region %s is %d bytes, its state says %d: it was truncated; rm %s %s (its flows are lost): %w", path, st.Size, g.Size, path, sp, ErrCorrupt)
	}
	if a.Gid >= 0 && int(st.Gid) != a.Gid {
		if err := f.Chown(-1, a.Gid); err != nil {
			return nil, Meta{}, nil, nil, fmt.Errorf("give region %s to gid %d: %w", path, a.Gid, err)
		}
	}
	if err := f.Chmod(os.FileMode(a.perm())); err != nil {
		return nil, Meta{}, nil, nil, fmt.Errorf("chmod region %s: %w", path, err)
	}
	p, problems, err := adoptMapped(f, sh, sig)
	if err != nil {
		return nil, Meta{}, nil, nil, err
	}
	return p, sh.Meta(), f, problems, nil
}

// adoptMapped maps the region file f that shadow sh names, rewrites its
// header from the shadow with the next generation, and adopts its pool.
func adoptMapped(f *os.File, sh *Shadow, sig wait.Signal) (*Pool, []error, error) {
	m, g := sh.Meta(), sh.Geometry()
	gen := m.Generation + 1
	r, err := mapAnd(f, g.Size, func(mem []byte) (*Region, error) { return rewriteHeader(mem, g, gen) })
	if err != nil {
		return nil, nil, err
	}
	if err := sh.SetGeneration(gen); err != nil {
		r.Close()
		return nil, nil, err
	}
	if m.Kind == KindPair {
		r.SetName(m.ID, m.GuestA, m.GuestB)
	}
	p, problems, err := AdoptShadow(r, sh, sig)
	if err != nil {
		r.Close()
		return nil, nil, err
	}
	return p, problems, nil
}

// loadShadowChecked checks the shadow file sf (hostd's own, but checked
// anyway) and reads it.
func loadShadowChecked(sf *os.File) (*Shadow, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(sf.Fd()), &st); err != nil {
		return nil, fmt.Errorf("stat region state %s: %w", sf.Name(), err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Uid != uint32(os.Geteuid()) || st.Mode&0o077 != 0 {
		return nil, fmt.Errorf("region state %s is not a file only hostd can read (mode %04o, uid %d): %w", sf.Name(), st.Mode&0o7777, st.Uid, ErrNotOurs)
	}
	return loadShadow(sf, st.Size)
}

// checkOwned checks an open region file's status: what hostd could have
// made, that no other user can have written.
func checkOwned(path string, st *unix.Stat_t, a Access) error {
	me := uint32(os.Geteuid())
	perm := st.Mode & 0o7777
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return fmt.Errorf("region %s is not a regular file (mode %#o); remove it: rm %s: %w", path, st.Mode, path, ErrNotOurs)
	case st.Uid != me:
		return fmt.Errorf("region %s is owned by uid %d, not hostd's uid %d: another user made it and could read or change the flows in it; stop what uses it and rm %s (hostd creates the region itself): %w", path, st.Uid, me, path, ErrNotOurs)
	case st.Nlink != 1:
		return fmt.Errorf("region %s has %d links: another name reaches the same memory; rm %s and its other names: %w", path, st.Nlink, path, ErrNotOurs)
	case perm&0o007 != 0 || perm&0o7000 != 0:
		return fmt.Errorf("region %s has mode %04o: other users could have opened it; stop what uses it and rm %s: %w", path, perm, path, ErrNotOurs)
	case perm&0o070 != 0 && (a.Gid < 0 || int(st.Gid) != a.Gid):
		return fmt.Errorf("region %s has mode %04o for gid %d, which is not its region_group: that group could have changed it; stop what uses it and rm %s: %w", path, perm, st.Gid, path, ErrNotOurs)
	}
	return nil
}

// Remove deletes region file path and its shadow. Mappings of the file stay
// valid until unmapped.
func (fl *Files) Remove(path, name string) error {
	err := os.Remove(path)
	if errors.Is(err, fs.ErrNotExist) {
		err = nil
	}
	if err2 := os.Remove(fl.statePath(name)); err2 != nil && !errors.Is(err2, fs.ErrNotExist) && err == nil {
		err = err2
	}
	return err
}

// Names returns the names of the shadows in the state directory that begin
// with prefix.
func (fl *Files) Names(prefix string) ([]string, error) {
	ents, err := os.ReadDir(fl.StateDir)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", fl.StateDir, err)
	}
	var out []string
	for _, e := range ents {
		n, ok := strings.CutSuffix(e.Name(), ".state")
		if ok && strings.HasPrefix(n, prefix) && e.Type().IsRegular() {
			out = append(out, n)
		}
	}
	return out, nil
}

// rewriteHeader writes the header of geometry g with generation gen over
// mem, whatever it held (a guest may have written it), and returns the
// region.
func rewriteHeader(mem []byte, g Geometry, gen uint64) (*Region, error) {
	l, err := LayoutFor(g)
	if err != nil {
		return nil, err
	}
	if int64(len(mem)) < g.Size || !aligned(mem) {
		return nil, fmt.Errorf("adopt region: %d bytes mapped, geometry needs %d", len(mem), g.Size)
	}
	EncodeHeader(mem, l, gen)
	return &Region{mem: mem[:g.Size:g.Size], layout: l}, nil
}
