package preflight

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// checkSpace: a region file is sparse; a guest that touches a page the
// file system has no room for gets SIGBUS. So the free space of each file
// system must cover the part of its regions not yet allocated.
func checkSpace(_ context.Context, e *env) {
	type need struct {
		fs    FS
		dir   string
		bytes int64
		parts []string
	}
	byDev := map[uint64]*need{}
	var order []*need
	for _, g := range e.cfg.Groups {
		dir, err := existingDir(filepath.Dir(g.Region))
		if err != nil {
			continue // checkRegions says what is wrong with the path
		}
		fs, err := e.p.Statfs(dir)
		if err != nil {
			e.problem(fmt.Sprintf("trust group %s: %v", g.Name, err), "run as root, or choose another region path")
			continue
		}
		b := g.Geometry.Size
		if fi, err := os.Lstat(g.Region); err == nil && fi.Mode().IsRegular() {
			b = max(0, b-allocated(fi))
		}
		n := byDev[fs.Dev]
		if n == nil {
			n = &need{fs: fs, dir: dir}
			byDev[fs.Dev] = n
			order = append(order, n)
		}
		n.bytes += b
		n.parts = append(n.parts, g.Name+" "+size(b))
	}
	for _, n := range order {
		what := fmt.Sprintf("%s: the regions need %s more (%s)", n.dir, size(n.bytes), strings.Join(n.parts, ", "))
		if n.bytes <= n.fs.Avail {
			e.ok("%s; %s free of %s", what, size(n.fs.Avail), size(n.fs.Size))
			continue
		}
		fix := "lower region_size, move regions to another file system, or free space on this one"
		if n.fs.Tmpfs {
			grow := n.fs.Size + n.bytes - n.fs.Avail
			fix += fmt.Sprintf("; to grow the tmpfs: mount -o remount,size=%dM %s", (grow+1<<20-1)>>20, mountPoint(n.dir))
		}
		e.problem(fmt.Sprintf("%s, only %s free of %s: a guest touching a page beyond that gets SIGBUS", what, size(n.fs.Avail), size(n.fs.Size)), fix)
	}
}

// checkRegions checks hostd's state and pair-region directories, each
// trust group's region path and, if the file exists, that hostd can adopt
// it safely.
func checkRegions(_ context.Context, e *env) {
	for _, d := range []struct{ what, path string }{{"state_dir", e.cfg.StateDir}, {"region_dir", e.cfg.RegionDir}} {
		e.ownDir(d.what, d.path)
	}
	byPath := map[string]string{}
	for _, g := range e.cfg.Groups {
		what := "trust group " + g.Name + ": region"
		if other, ok := byPath[filepath.Clean(g.Region)]; ok {
			e.problem(fmt.Sprintf("%s %s is also trust group %s's: guests of the two groups would share memory", what, g.Region, other),
				"give each trust group its own region")
			continue
		}
		byPath[filepath.Clean(g.Region)] = g.Name
		bad := false
		if g.RegionGroup != "" {
			if err := e.p.LookupGroup(g.RegionGroup); err != nil {
				bad = true
				e.problem(fmt.Sprintf("trust group %s: region_group %s: %v: hostd would fail to give it the region", g.Name, g.RegionGroup, err),
					"fix region_group (libvirt's QEMUs on Debian run in group kvm), or create the group: groupadd "+g.RegionGroup)
			}
		}
		bad = e.dirs(what, g.Region) || bad
		state, fileBad := e.regionFile(what, g)
		if !bad && !fileBad && state != "" {
			e.ok("%s %s %s", what, g.Region, state)
		}
	}
}

// regionFile checks an existing region file: hostd maps it read-write as
// root and gives its guests what is in it, so it must be hostd's own. It
// returns the file's state for an OK finding, "" if it reported a warning
// about the file instead, and whether it reported a problem.
func (e *env) regionFile(what string, g config.Group) (state string, bad bool) {
	path := g.Region
	geo := fmt.Sprintf("%s, %d slots", size(g.Geometry.Size), g.Geometry.Slots)
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return "does not exist yet: hostd creates it (" + geo + ")", false
	case err != nil:
		e.problem(fmt.Sprintf("%s %s: %v", what, path, err), "run as root")
		return "", true
	case fi.Mode()&os.ModeSymlink != 0:
		target, _ := os.Readlink(path)
		e.problem(fmt.Sprintf("%s %s is a symlink to %s: hostd would map, or truncate, whatever it points at", what, path, target),
			"rm "+path+" (hostd creates the region itself), or set region to the real path")
		return "", true
	case !fi.Mode().IsRegular():
		e.problem(fmt.Sprintf("%s %s is a %s, not a regular file", what, path, kind(fi)), "remove it, or choose another region path")
		return "", true
	}
	if uid, me := owner(fi), e.p.Euid(); uid != me {
		bad = true
		e.problem(fmt.Sprintf("%s %s is owned by uid %d, not %s: that user can read and change the flows of trust group %s", what, path, uid, userName(me), g.Name),
			fmt.Sprintf("stop the group's guests and rm %s (hostd recreates it), or chown %s %s", path, strings.TrimPrefix(userName(me), "uid "), path))
	}
	// With a region_group, hostd makes the file 0660 at start; without,
	// it keeps the mode it finds.
	if perm := fi.Mode().Perm(); g.RegionGroup == "" && perm&0o007 != 0 {
		bad = true
		e.problem(fmt.Sprintf("%s %s has mode %04o: every local user can read or write the flows of trust group %s", what, path, perm, g.Name), "chmod 0600 "+path)
	} else if g.RegionGroup == "" && perm&0o070 != 0 {
		e.warn(fmt.Sprintf("%s %s has mode %04o: its group (gid %d) can read or write the flows, but region_group is not set", what, path, perm, group(fi)),
			"chmod 0600 "+path+", or set region_group")
	}
	// hostd adopts only a file it created: its record in state_dir names it.
	rec := filepath.Join(e.cfg.StateDir, g.StateName()+".state")
	if _, err := os.Lstat(rec); errors.Is(err, os.ErrNotExist) {
		e.problem(fmt.Sprintf("%s %s exists, but hostd has no record of creating it (no %s): another user may have made it, or an older hostd; hostd would refuse to adopt it", what, path, rec),
			"stop the guests that map it (libvirt domains: virsh shutdown) and rm "+path+"; hostd creates it afresh")
		return "", true
	}
	l, err := readHeader(path, fi.Size())
	switch {
	case err != nil:
		e.warn(fmt.Sprintf("%s %s is not a Shunt region (%v): hostd rewrites its header from its record %s", what, path, err, rec),
			"nothing to do if no guest wrote there; a guest that did may lose its flows")
		return "", bad
	case l.Geometry != g.Geometry:
		e.problem(fmt.Sprintf("%s %s holds a region of %s, %d slots, but the configuration says %s: hostd would refuse to start", what, path, size(l.Size), l.Slots, geo),
			fmt.Sprintf("stop the guests using it and rm %s to resize; or keep it: region_size = %q, slots = %d", path, hclSize(l.Size), l.Slots))
		return "", true
	}
	return "exists (" + geo + "): hostd adopts it and its live flows", bad
}

// ownDir checks a directory that hostd makes for itself (mode 0700): if it
// exists it must be a directory, not a symlink, owned by hostd's user.
func (e *env) ownDir(what, dir string) {
	fi, err := os.Lstat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist): // hostd makes it
	case err != nil:
		e.problem(fmt.Sprintf("%s %s: %v", what, dir, err), "run as root")
	case fi.Mode()&os.ModeSymlink != 0 || !fi.IsDir():
		e.problem(fmt.Sprintf("%s %s is a %s, not a directory of hostd's own: hostd would refuse to start", what, dir, kind(fi)), "rm "+dir+" (hostd makes it, mode 0700)")
	case owner(fi) != e.p.Euid():
		e.problem(fmt.Sprintf("%s %s is owned by uid %d, not %s: that user could replace the region files or hostd's record of them; hostd would refuse to start", what, dir, owner(fi), userName(e.p.Euid())),
			"rm -r "+dir+" (hostd makes it, mode 0700)")
	}
}

func readHeader(path string, n int64) (region.Layout, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return region.Layout{}, err
	}
	defer f.Close()
	b := make([]byte, region.HeaderSize)
	if _, err := io.ReadFull(f, b); err != nil {
		return region.Layout{}, fmt.Errorf("read header: %w", err)
	}
	return region.DecodeHeader(b, n)
}

// maxSocketPath is the longest Unix socket path: sun_path less its NUL.
const maxSocketPath = 107

// checkSockets checks the admin socket and every guest control socket:
// hostd creates each directory it needs, removes what is at the path and
// binds a socket there.
func checkSockets(ctx context.Context, e *env) {
	type sock struct {
		what, path string
		admin      bool
	}
	socks := []sock{{what: "admin_socket", path: e.cfg.AdminSocket, admin: true}}
	for _, g := range e.cfg.Guests {
		for i := range g.Ports {
			if g.Control == "" {
				break // a vsock VM's control channel is on vsock only
			}
			socks = append(socks, sock{what: "guest " + g.Name + ": control socket", path: vserial.SocketOf(g.Control, i)})
		}
		switch {
		case g.Vsock == nil:
		case g.Vsock.Hybrid != "":
			// hostd's listeners for the hypervisor (hostd/vsockhost)
			for _, port := range []uint32{proto.VsockControlPort, relay.VsockPort} {
				socks = append(socks, sock{what: "guest " + g.Name + ": hybrid vsock listener", path: fmt.Sprintf("%s_%d", g.Vsock.Hybrid, port)})
			}
		case e.cfg.VsockdSocket != "":
			// The device's socket is shunt-vsockd's; hostd listens next
			// to it for what the daemon forwards (hostd/vsockd).
			for _, port := range []uint32{proto.VsockControlPort, relay.VsockPort} {
				socks = append(socks, sock{what: "guest " + g.Name + ": listener for shunt-vsockd", path: fmt.Sprintf("%s_%d", g.Vsock.Socket, port)})
			}
		default:
			socks = append(socks, sock{what: "guest " + g.Name + ": vsock socket", path: g.Vsock.Socket})
		}
	}
	byPath := map[string]string{}
	good := 0
	for _, s := range socks {
		if other, ok := byPath[filepath.Clean(s.path)]; ok {
			e.problem(fmt.Sprintf("%s %s is also %s", s.what, s.path, other), "give each socket its own path")
			continue
		}
		byPath[filepath.Clean(s.path)] = s.what
		bad := false
		if len(s.path) > maxSocketPath {
			bad = true
			e.problem(fmt.Sprintf("%s %s is %d bytes long: a Unix socket path has at most %d", s.what, s.path, len(s.path), maxSocketPath), "use a shorter path")
		}
		bad = e.dirs(s.what, s.path) || bad
		fi, err := os.Lstat(s.path)
		switch {
		case errors.Is(err, os.ErrNotExist):
		case err != nil:
			bad = true
			e.problem(fmt.Sprintf("%s %s: %v", s.what, s.path, err), "run as root")
		case fi.Mode()&os.ModeSocket != 0:
			dctx, cancel := context.WithTimeout(ctx, probeTimeout)
			err := e.p.DialUnix(dctx, s.path)
			cancel()
			switch {
			case err == nil && s.admin:
				bad = true
				e.running = s.path
				e.problem(fmt.Sprintf("a hostd already answers on %s: a second one would take over its sockets and regions", s.path),
					"stop it first (systemctl stop shunt-hostd), or give this configuration its own admin_socket, regions and control sockets")
			case err == nil:
				bad = true
				e.problem(fmt.Sprintf("%s %s: a process listens on it (a running hostd?), and hostd would replace it", s.what, s.path), "stop that process first")
			case errors.Is(err, syscall.ECONNREFUSED):
				// stale: hostd replaces it
			default:
				e.warn(fmt.Sprintf("%s %s: cannot tell whether it is stale: %v", s.what, s.path, err), "run as root")
			}
		case fi.IsDir():
			bad = true
			e.problem(fmt.Sprintf("%s %s is a directory", s.what, s.path), "remove it, or choose another path")
		default:
			e.warn(fmt.Sprintf("%s %s is a %s, not a socket: hostd removes it at start", s.what, s.path, kind(fi)), "move it away if it is needed")
		}
		if !bad {
			good++
		}
	}
	if good > 0 {
		e.ok("%d of %d socket paths are free or stale, in directories hostd can write", good, len(socks))
	}
}

// dirs checks the directories above path, where hostd creates a file or a
// socket (making missing directories, 0755): the nearest one that exists
// must be a directory hostd can write in, and none from there up may let
// another user replace what hostd puts below. It reports whether it found
// a problem.
func (e *env) dirs(what, path string) (bad bool) {
	if !filepath.IsAbs(path) {
		e.warn(fmt.Sprintf("%s %s is relative: to hostd's working directory, / under systemd", what, path), "use an absolute path")
	}
	dir := filepath.Dir(path)
	base, err := existingDir(dir)
	if err != nil {
		e.problem(fmt.Sprintf("%s %s: %v", what, path, err), "remove it, or choose another path")
		return true
	}
	if err := e.p.Writable(base); err != nil {
		bad = true
		act, fix := "create "+path+" in", "run as root, or chown root "+base
		if base != dir {
			act = "create " + dir + " in"
		}
		if errors.Is(err, syscall.EROFS) {
			fix = "under systemd, add the directory to ReadWritePaths= in shunt-hostd.service; or use a path under /run/shunt or /dev/shm"
		}
		e.problem(fmt.Sprintf("%s %s: hostd cannot %s %s: %v", what, path, act, base, err), fix)
	}
	if real, err := filepath.EvalSymlinks(base); err == nil {
		base = real
	}
	me := e.p.Euid()
	for d := base; ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			break
		}
		if fi.Mode().Perm()&0o002 != 0 && fi.Mode()&os.ModeSticky == 0 {
			bad = true
			if e.once("world-writable " + d) {
				e.problem(fmt.Sprintf("%s is world-writable without the sticky bit: any user can replace what hostd puts there (%s %s)", d, what, path),
					"chmod o-w "+d+" (or chmod +t "+d+")")
			}
		}
		if uid := owner(fi); uid != 0 && uid != me && e.once("owner "+d) {
			e.warn(fmt.Sprintf("%s is owned by uid %d, who can replace what hostd puts there (%s %s)", d, uid, what, path), "chown root "+d)
		}
		if d == filepath.Dir(d) {
			break
		}
	}
	return bad
}

// existingDir returns dir or its nearest ancestor that exists, which must
// be a directory.
func existingDir(dir string) (string, error) {
	for {
		fi, err := os.Stat(dir)
		switch {
		case err == nil && fi.IsDir():
			return dir, nil
		case err == nil:
			return "", fmt.Errorf("%s is not a directory", dir)
		case !errors.Is(err, os.ErrNotExist):
			return "", err
		case dir == filepath.Dir(dir):
			return "", err
		}
		dir = filepath.Dir(dir)
	}
}

// mountPoint returns the top directory of dir's file system.
func mountPoint(dir string) string {
	for {
		up := filepath.Dir(dir)
		a, errA := os.Stat(dir)
		b, errB := os.Stat(up)
		if up == dir || errA != nil || errB != nil || stat(a).Dev != stat(b).Dev {
			return dir
		}
		dir = up
	}
}

func stat(fi os.FileInfo) *syscall.Stat_t {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st
	}
	return &syscall.Stat_t{}
}

func owner(fi os.FileInfo) int       { return int(stat(fi).Uid) }
func group(fi os.FileInfo) int       { return int(stat(fi).Gid) }
func allocated(fi os.FileInfo) int64 { return int64(stat(fi).Blocks) * 512 }

func userName(uid int) string {
	if uid == 0 {
		return "root"
	}
	return fmt.Sprintf("uid %d", uid)
}

// kind names a file's type.
func kind(fi os.FileInfo) string {
	m := fi.Mode()
	switch {
	case m.IsDir():
		return "directory"
	case m&os.ModeSymlink != 0:
		return "symlink"
	case m&os.ModeSocket != 0:
		return "socket"
	case m&os.ModeNamedPipe != 0:
		return "named pipe"
	case m&os.ModeDevice != 0:
		return "device"
	case m.IsRegular():
		return "regular file"
	}
	return "special file"
}

// hclSize writes n as the configuration would: "64MiB".
func hclSize(n int64) string {
	for _, u := range []struct {
		unit string
		n    int64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n%u.n == 0 {
			return fmt.Sprintf("%d%s", n/u.n, u.unit)
		}
	}
	return fmt.Sprint(n)
}
