package preflight

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/region"
)

// healthy returns probes of a host where everything works; DialUnix is the
// real one, since the tests put real sockets in temporary directories.
func healthy() Probes {
	return Probes{
		Euid:        os.Geteuid,
		Conntrack:   func(string) error { return nil },
		Sysctl:      func(string, string) (string, error) { return "1", nil },
		LookPath:    func(f string) (string, error) { return "/usr/sbin/" + f, nil },
		Command:     func(context.Context, string, ...string) ([]byte, error) { return []byte("ct mark set 0x00000001"), nil },
		Witness:     func() error { return nil },
		Nftables:    func(string) (int, error) { return -1, nil },
		Interface:   func(string, string) error { return nil },
		Statfs:      func(string) (FS, error) { return FS{Dev: 1, Avail: 1 << 40, Size: 1 << 40, Tmpfs: true}, nil },
		Writable:    func(string) error { return nil },
		LookupGroup: func(string) error { return nil },
		RDMA:        func() ([]relay.RDMADevice, error) { return nil, nil },
		DialUnix:    Host().DialUnix,
		DialPacket:  Host().DialPacket,
		Libvirt:     func(context.Context, string, string) error { return nil },
		Listen:      func(string) error { return nil },
	}
}

// testConfig is a configuration whose paths are all under dir.
type testConfig struct {
	dir     string
	top     []string // extra top-level lines
	groups  []string // trust_group blocks; default: group "a", 1MiB
	guests  []string // guest blocks; default: g1 in group a
	metrics string
}

func newConfig(t *testing.T) *testConfig {
	d := t.TempDir()
	return &testConfig{dir: d, metrics: `""`}
}

func (c *testConfig) group(name, size, extra string) string {
	return fmt.Sprintf("trust_group %q {\n  region = %q\n  region_size = %q\n  %s\n}\n", name, c.path("shm/shunt-"+name), size, extra)
}

func (c *testConfig) path(rel string) string { return filepath.Join(c.dir, rel) }

func (c *testConfig) write(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "admin_socket = %q\nmetrics_address = %s\n", c.path("run/admin.sock"), c.metrics)
	fmt.Fprintf(&b, "state_dir = %q\nregion_dir = %q\n", c.path("run/state"), c.path("run/regions"))
	for _, l := range c.top {
		b.WriteString(l + "\n")
	}
	groups, guests := c.groups, c.guests
	if groups == nil {
		groups = []string{c.group("a", "1MiB", "")}
	}
	if guests == nil {
		guests = []string{fmt.Sprintf("guest \"g1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  addresses = [\"10.0.0.1\"]\n}\n", c.path("run/g1.sock"))}
	}
	b.WriteString(strings.Join(groups, "") + strings.Join(guests, ""))
	p := c.path("hostd.hcl")
	if err := os.WriteFile(p, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func run(t *testing.T, c *testConfig, p Probes) []Finding {
	t.Helper()
	fs := Run(context.Background(), c.write(t), p)
	var buf bytes.Buffer
	WriteText(&buf, fs)
	t.Logf("hostd check:\n%s", buf.String())
	return fs
}

// want fails t unless fs has a finding of check with severity s whose
// What contains what and whose Fix contains fix.
func want(t *testing.T, fs []Finding, check string, s Severity, what, fix string) {
	t.Helper()
	for _, f := range fs {
		if f.Check == check && f.Severity == s && strings.Contains(f.What, what) && strings.Contains(f.Fix, fix) {
			return
		}
	}
	t.Errorf("want a %s from check %s with what ~ %q and fix ~ %q; got:\n%s", s, check, what, fix, dump(fs))
}

// only fails t if fs has a warning or problem other than those of the
// checks named (and privileges, which warns when the test is not root).
func only(t *testing.T, fs []Finding, checks ...string) {
	t.Helper()
	for _, f := range fs {
		if f.Severity == OK || f.Check == "privileges" || contains(checks, f.Check) {
			continue
		}
		t.Errorf("unexpected %s from %s: %s (fix: %s)", f.Severity, f.Check, f.What, f.Fix)
	}
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

func dump(fs []Finding) string {
	var b bytes.Buffer
	WriteText(&b, fs)
	return b.String()
}

func TestHealthyHost(t *testing.T) {
	c := newConfig(t)
	c.top = []string{"witness = true", "libvirt {}"}
	c.guests = []string{fmt.Sprintf("guest \"g1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  control_ports = 2\n  interface = \"tap1\"\n  ct_mark = 7\n}\n", c.path("run/g1.sock"))}
	fs := run(t, c, healthy())
	only(t, fs)
	for _, check := range []string{"config", "conntrack", "nftables", "witness", "interfaces", "space", "regions", "sockets", "libvirt", "metrics"} {
		want(t, fs, check, OK, "", "")
	}
	want(t, fs, "sockets", OK, "3 of 3 socket paths", "")
	want(t, fs, "space", OK, "need 1 MiB more (a 1 MiB)", "")
}

func TestBadConfig(t *testing.T) {
	c := newConfig(t)
	c.top = []string{`pairing_timout = "3s"`}
	fs := run(t, c, healthy())
	if len(fs) != 1 {
		t.Fatalf("a bad config should stop the checks: got %d findings", len(fs))
	}
	want(t, fs, "config", Problem, `An argument named "pairing_timout" is not expected here`, "edit "+c.path("hostd.hcl"))

	fs = Run(context.Background(), c.path("missing.hcl"), healthy())
	want(t, fs, "config", Problem, "no such file", "edit")
}

func TestConntrack(t *testing.T) {
	for _, tc := range []struct {
		name      string
		dial      error
		events    string
		eventsErr error
		what, fix string
	}{
		{"ctnetlink missing", errors.New("netlink receive: protocol not supported"), "1", nil, "conntrack netlink does not answer", "modprobe nf_conntrack nf_conntrack_netlink"},
		{"not root", syscall.EPERM, "1", nil, "operation not permitted", "run as root: ctnetlink needs CAP_NET_ADMIN"},
		{"events off", nil, "0", nil, eventsSysctl + " = 0: hostd gets no destroy events", "sysctl -w net.netfilter.nf_conntrack_events=1"},
		{"events sysctl missing", nil, "", os.ErrNotExist, eventsSysctl + " does not exist", "modprobe nf_conntrack nf_conntrack_netlink"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := healthy()
			p.Conntrack = func(string) error { return tc.dial }
			p.Sysctl = func(_, name string) (string, error) {
				if name == acctSysctl || name == tstampSysctl {
					return "1", nil
				}
				if name != eventsSysctl {
					t.Errorf("sysctl %s, want %s", name, eventsSysctl)
				}
				return tc.events, tc.eventsErr
			}
			fs := run(t, newConfig(t), p)
			want(t, fs, "conntrack", Problem, tc.what, tc.fix)
			only(t, fs, "conntrack")
		})
	}
	t.Run("netns missing", func(t *testing.T) {
		c := newConfig(t)
		ns := c.path("netns/nope")
		c.top = []string{fmt.Sprintf("conntrack_netns = %q", ns)}
		c.guests = []string{fmt.Sprintf("guest \"g1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  interface = \"tap1\"\n}\n", c.path("run/g1.sock"))}
		fs := run(t, c, healthy())
		want(t, fs, "conntrack", Problem, "conntrack_netns "+ns+": stat "+ns+": no such file", "ip netns add")
		only(t, fs, "conntrack")
		if p, _ := Count(fs); p != 1 {
			t.Errorf("a missing netns should be reported once, got %d problems", p)
		}
	})
	t.Run("events auto", func(t *testing.T) {
		p := healthy()
		p.Sysctl = func(string, string) (string, error) { return "2", nil }
		fs := run(t, newConfig(t), p)
		want(t, fs, "conntrack", OK, eventsSysctl+" = 2", "")
		only(t, fs)
	})
}

func TestNftables(t *testing.T) {
	marked := func(c *testConfig) {
		c.guests = []string{fmt.Sprintf("guest \"g1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  interface = \"vnet0\"\n  ct_mark = 1\n}\n", c.path("run/g1.sock"))}
	}
	t.Run("nft missing", func(t *testing.T) {
		c := newConfig(t)
		marked(c)
		p := healthy()
		p.LookPath = func(f string) (string, error) { return "", &os.PathError{Op: "lookpath", Path: f, Err: os.ErrNotExist} }
		fs := run(t, c, p)
		want(t, fs, "nftables", Warning, "guest g1 (ct_mark 1) needs a firewall rule", "apt-get install nftables")
		want(t, fs, "nftables", Warning, "nft is not installed", `iifname "vnet0" ct mark set 1`)
		only(t, fs, "nftables")
	})
	t.Run("no rule sets a mark", func(t *testing.T) {
		c := newConfig(t)
		marked(c)
		p := healthy()
		p.Command = func(_ context.Context, name string, args ...string) ([]byte, error) {
			if got := strings.Join(args, " "); got != "list ruleset" {
				t.Errorf("ran %s %s, want nft list ruleset", name, got)
			}
			return []byte("table inet filter {\n}\n"), nil
		}
		fs := run(t, c, p)
		want(t, fs, "nftables", Warning, "no nftables rule sets a ct mark", "ct mark set 1")
	})
	t.Run("no ct_mark, no nft needed", func(t *testing.T) {
		p := healthy()
		p.LookPath = func(string) (string, error) { return "", os.ErrNotExist }
		fs := run(t, newConfig(t), p)
		want(t, fs, "nftables", OK, "hostd can install its nftables table inet shunt_hostd", "")
		want(t, fs, "nftables", OK, "g1 has no interface, so its claims rest on its addresses alone", "")
		only(t, fs)
	})
}

// TestOwnershipMarks: with the default ownership hostd's own table must
// install (a problem if not: hostd would not start); a running hostd's
// table is reported; turning the proof off is a warning.
func TestOwnershipMarks(t *testing.T) {
	withIf := func(c *testConfig) {
		c.guests = []string{fmt.Sprintf("guest \"g1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  interface = \"vnet0\"\n}\n", c.path("run/g1.sock"))}
	}
	t.Run("marks", func(t *testing.T) {
		c := newConfig(t)
		withIf(c)
		fs := run(t, c, healthy())
		want(t, fs, "nftables", OK, "it marks the new connections of g1 (vnet0), in ct mark bits 0xffff0000", "")
		only(t, fs)
	})
	t.Run("running", func(t *testing.T) {
		c := newConfig(t)
		withIf(c)
		p := healthy()
		p.Nftables = func(string) (int, error) { return 1, nil }
		want(t, run(t, c, p), "nftables", OK, "it is installed, with 1 guest rules: a hostd runs here", "")
	})
	t.Run("cannot install", func(t *testing.T) {
		c := newConfig(t)
		withIf(c)
		p := healthy()
		p.Nftables = func(string) (int, error) { return 0, fmt.Errorf("install a table like hostd's: %w", os.ErrPermission) }
		fs := run(t, c, p)
		want(t, fs, "nftables", Problem, "hostd cannot install its nftables table inet shunt_hostd", "run as root")
		only(t, fs, "nftables")
	})
	t.Run("addresses only", func(t *testing.T) {
		c := newConfig(t)
		withIf(c)
		c.top = []string{`ownership = "addresses"`}
		p := healthy()
		p.Nftables = func(string) (int, error) {
			t.Error("probed nftables with ownership = addresses")
			return -1, nil
		}
		fs := run(t, c, p)
		want(t, fs, "nftables", Warning, "hostd does not prove where a connection came from", "remove the ownership line")
		only(t, fs, "nftables")
	})
}

func TestWitness(t *testing.T) {
	p := healthy()
	p.Witness = func() error { return errors.New("witness map: operation not permitted") }
	c := newConfig(t)
	fs := run(t, c, p)
	want(t, fs, "witness", OK, "the eBPF witness is off", "") // not probed when off
	only(t, fs)

	for _, top := range []string{"witness = true", `ownership = "witness"`, `ownership = "both"`} {
		c.top = []string{top}
		fs = run(t, c, p)
		want(t, fs, "witness", Problem, "the eBPF witness cannot load: witness map: operation not permitted", `ownership = "mark"`)
	}
}

func TestMissingInterface(t *testing.T) {
	c := newConfig(t)
	c.guests = []string{fmt.Sprintf("guest \"g1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  interface = \"vnet9\"\n}\n", c.path("run/g1.sock"))}
	p := healthy()
	p.Interface = func(_, name string) error { return fmt.Errorf("Link not found") }
	fs := run(t, c, p)
	want(t, fs, "interfaces", Problem, "guest g1: interface vnet9: Link not found", "give the guest addresses instead")
	only(t, fs, "interfaces")
}

func TestRegionsExceedFreeSpace(t *testing.T) {
	c := newConfig(t)
	c.groups = []string{c.group("a", "64MiB", ""), c.group("b", "64MiB", "")}
	p := healthy()
	p.Statfs = func(string) (FS, error) { return FS{Dev: 7, Avail: 100 << 20, Size: 128 << 20, Tmpfs: true}, nil }
	fs := run(t, c, p)
	// Each region fits alone; the two together do not.
	want(t, fs, "space", Problem, "the regions need 128 MiB more (a 64 MiB, b 64 MiB), only 100 MiB free of 128 MiB", "mount -o remount,size=156M")
	only(t, fs, "space")

	// An existing region's allocated blocks are already spent.
	a := c.path("shm/shunt-a")
	if err := os.MkdirAll(filepath.Dir(a), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(a, make([]byte, 40<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	fs = run(t, c, p)
	want(t, fs, "space", OK, "the regions need 88 MiB more (a 24 MiB, b 64 MiB); 100 MiB free", "")
}

func TestRegionSymlink(t *testing.T) {
	c := newConfig(t)
	shm := c.path("shm")
	os.MkdirAll(shm, 0o755)
	if err := os.Symlink("/etc/shadow", filepath.Join(shm, "shunt-a")); err != nil {
		t.Fatal(err)
	}
	fs := run(t, c, healthy())
	want(t, fs, "regions", Problem, "region "+filepath.Join(shm, "shunt-a")+" is a symlink to /etc/shadow", "rm "+filepath.Join(shm, "shunt-a"))
	only(t, fs, "regions")
}

func TestRegionFile(t *testing.T) {
	// put puts a region (or junk) at group a's path with the given mode,
	// as hostd made it: with its record in state_dir.
	put := func(t *testing.T, c *testConfig, g region.Geometry, junk bool, mode os.FileMode) {
		p := c.path("shm/shunt-a")
		os.MkdirAll(filepath.Dir(p), 0o755)
		files, err := region.OpenFiles(c.path("run/state"))
		if err != nil {
			t.Fatal(err)
		}
		pool, f, err := files.Create(p, "group-a", region.Meta{Kind: region.KindGroup}, g, region.NoGroup, nil)
		if err != nil {
			t.Fatal(err)
		}
		pool.Close()
		f.Close()
		if junk {
			if err := os.WriteFile(p, []byte("not a region"), mode); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
	}
	configured := region.Geometry{Size: 1 << 20, Slots: 256}
	t.Run("adoptable", func(t *testing.T) {
		c := newConfig(t)
		put(t, c, configured, false, 0o600)
		fs := run(t, c, healthy())
		want(t, fs, "regions", OK, "exists (1 MiB, 256 slots): hostd adopts it", "")
		only(t, fs)
	})
	t.Run("other geometry", func(t *testing.T) {
		c := newConfig(t)
		put(t, c, region.Geometry{Size: 2 << 20, Slots: 64}, false, 0o600)
		fs := run(t, c, healthy())
		want(t, fs, "regions", Problem, "holds a region of 2 MiB, 64 slots, but the configuration says 1 MiB, 256 slots", `region_size = "2MiB", slots = 64`)
		only(t, fs, "regions")
	})
	t.Run("not a region", func(t *testing.T) {
		c := newConfig(t)
		put(t, c, configured, true, 0o600)
		fs := run(t, c, healthy())
		want(t, fs, "regions", Warning, "is not a Shunt region", "a guest that did may lose its flows")
		only(t, fs, "regions")
		for _, f := range fs {
			if f.Check == "regions" && f.Severity == OK {
				t.Errorf("an OK finding next to the warning: %q", f.What)
			}
		}
	})
	t.Run("not created by hostd", func(t *testing.T) {
		c := newConfig(t)
		p := c.path("shm/shunt-a")
		os.MkdirAll(filepath.Dir(p), 0o755)
		r, err := region.Create(p, configured, 0o600) // a region, but hostd has no record of it
		if err != nil {
			t.Fatal(err)
		}
		r.Close()
		fs := run(t, c, healthy())
		want(t, fs, "regions", Problem, "hostd has no record of creating it", "rm "+p)
		only(t, fs, "regions")
	})
	t.Run("state_dir of another user", func(t *testing.T) {
		c := newConfig(t)
		if err := os.MkdirAll(c.path("run/state"), 0o700); err != nil {
			t.Fatal(err)
		}
		p := healthy()
		hostd := os.Geteuid() + 1
		p.Euid = func() int { return hostd }
		fs := run(t, c, p)
		want(t, fs, "regions", Problem, "state_dir "+c.path("run/state")+" is owned by uid", "rm -r "+c.path("run/state"))
	})
	t.Run("world-readable", func(t *testing.T) {
		c := newConfig(t)
		put(t, c, configured, false, 0o644)
		fs := run(t, c, healthy())
		want(t, fs, "regions", Problem, "has mode 0644: every local user can read", "chmod 0600 "+c.path("shm/shunt-a"))
	})
	t.Run("group-readable without region_group", func(t *testing.T) {
		c := newConfig(t)
		put(t, c, configured, false, 0o640)
		fs := run(t, c, healthy())
		want(t, fs, "regions", Warning, "has mode 0640", "set region_group")
		only(t, fs, "regions")
	})
	t.Run("another owner", func(t *testing.T) {
		c := newConfig(t)
		put(t, c, configured, false, 0o600)
		p := healthy()
		hostd := os.Geteuid() + 1 // as if hostd ran as another user than the file's owner
		p.Euid = func() int { return hostd }
		fs := run(t, c, p)
		want(t, fs, "regions", Problem, fmt.Sprintf("is owned by uid %d, not uid %d", os.Geteuid(), hostd), "rm "+c.path("shm/shunt-a"))
	})
	t.Run("missing region_group", func(t *testing.T) {
		c := newConfig(t)
		c.groups = []string{c.group("a", "1MiB", `region_group = "nosuchgroup"`)}
		p := healthy()
		p.LookupGroup = func(name string) error { return fmt.Errorf("group: unknown group %s", name) }
		fs := run(t, c, p)
		want(t, fs, "regions", Problem, "region_group nosuchgroup: group: unknown group nosuchgroup", "groupadd nosuchgroup")
	})
	t.Run("two groups, one file", func(t *testing.T) {
		c := newConfig(t)
		b := strings.Replace(c.group("b", "1MiB", ""), "shunt-b", "shunt-a", 1)
		c.groups = []string{c.group("a", "1MiB", ""), b}
		fs := run(t, c, healthy())
		want(t, fs, "regions", Problem, "is also trust group a's", "its own region")
	})
}

func TestWorldWritableDir(t *testing.T) {
	c := newConfig(t)
	dir := c.path("run")
	os.Mkdir(dir, 0o755)
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	fs := Run(context.Background(), c.write(t), healthy())
	want(t, fs, "sockets", Problem, dir+" is world-writable without the sticky bit", "chmod o-w "+dir)
	only(t, fs, "sockets")

	// With the sticky bit (like /tmp, /dev/shm) only the owner may replace a file.
	if err := os.Chmod(dir, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	fs = Run(context.Background(), c.write(t), healthy())
	only(t, fs)
}

func TestReadOnlyDir(t *testing.T) {
	c := newConfig(t)
	p := healthy()
	// As under ProtectSystem=strict: the directory exists but is read-only.
	p.Writable = func(dir string) error {
		if dir == c.dir {
			return &os.PathError{Op: "access", Path: dir, Err: syscall.EROFS}
		}
		return nil
	}
	fs := run(t, c, p)
	want(t, fs, "sockets", Problem, "hostd cannot create "+c.path("run")+" in "+c.dir, "ReadWritePaths=")
	want(t, fs, "regions", Problem, "hostd cannot create "+c.path("shm")+" in "+c.dir, "ReadWritePaths=")
}

func TestSockets(t *testing.T) {
	listen := func(t *testing.T, path string) *net.UnixListener {
		os.MkdirAll(filepath.Dir(path), 0o755)
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		return l
	}
	t.Run("a hostd answers", func(t *testing.T) {
		c := newConfig(t)
		listen(t, c.path("run/admin.sock"))
		fs := run(t, c, healthy())
		want(t, fs, "sockets", Problem, "a hostd already answers on "+c.path("run/admin.sock"), "systemctl stop shunt-hostd")
		only(t, fs, "sockets")
	})
	t.Run("stale", func(t *testing.T) {
		c := newConfig(t)
		l := listen(t, c.path("run/admin.sock"))
		l.SetUnlinkOnClose(false)
		l.Close()
		fs := run(t, c, healthy())
		want(t, fs, "sockets", OK, "2 of 2 socket paths are free or stale", "")
		only(t, fs)
	})
	t.Run("directory in the way", func(t *testing.T) {
		c := newConfig(t)
		os.MkdirAll(c.path("run/g1.sock/x"), 0o755)
		fs := run(t, c, healthy())
		want(t, fs, "sockets", Problem, "guest g1: control socket "+c.path("run/g1.sock")+" is a directory", "remove it")
	})
	t.Run("too long", func(t *testing.T) {
		c := newConfig(t)
		long := c.path(strings.Repeat("d", 110) + "/g1.sock")
		c.guests = []string{fmt.Sprintf("guest \"g1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  addresses = [\"10.0.0.1\"]\n}\n", long)}
		fs := run(t, c, healthy())
		want(t, fs, "sockets", Problem, "a Unix socket path has at most 107", "shorter path")
	})
	t.Run("control port collides", func(t *testing.T) {
		c := newConfig(t)
		c.guests = []string{
			fmt.Sprintf("guest \"g1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  control_ports = 2\n  addresses = [\"10.0.0.1\"]\n}\n", c.path("run/g1.sock")),
			fmt.Sprintf("guest \"g2\" {\n  id = 2\n  group = \"a\"\n  control = %q\n  addresses = [\"10.0.0.2\"]\n}\n", c.path("run/g1.sock.1")),
		}
		fs := run(t, c, healthy())
		want(t, fs, "sockets", Problem, "guest g2: control socket "+c.path("run/g1.sock.1")+" is also guest g1: control socket", "its own path")
	})
}

// TestLibvirtUnreachable dials a real socket path with nothing behind it.
func TestLibvirtUnreachable(t *testing.T) {
	c := newConfig(t)
	sock := c.path("libvirt-sock")
	c.top = []string{fmt.Sprintf("libvirt {\n  socket = %q\n}", sock)}
	p := healthy()
	p.Libvirt = Host().Libvirt
	fs := run(t, c, p)
	want(t, fs, "libvirt", Warning, sock, "systemctl start libvirtd")
	want(t, fs, "libvirt", Warning, "hostd starts anyway", "")
	only(t, fs, "libvirt")
}

func TestMetrics(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	p := healthy()
	p.Listen = Host().Listen
	c := newConfig(t)
	c.metrics = fmt.Sprintf("%q", l.Addr())
	fs := run(t, c, p)
	_, port, _ := net.SplitHostPort(l.Addr().String())
	want(t, fs, "metrics", Problem, "metrics_address "+l.Addr().String()+" cannot be bound", "ss -ltnp 'sport = :"+port+"'")
	only(t, fs, "metrics")

	c.metrics = `"0.0.0.0:0"`
	fs = run(t, c, p)
	want(t, fs, "metrics", Warning, "reachable from beyond this host", "127.0.0.1")
	want(t, fs, "metrics", OK, "can be bound", "")

	c.metrics = `"9469"`
	fs = run(t, c, p)
	want(t, fs, "metrics", Problem, `metrics_address "9469": address 9469: missing port in address`, "host:port")

	sock := c.path("run/metrics.sock")
	c.metrics = fmt.Sprintf("%q", "unix:"+sock)
	fs = run(t, c, p)
	want(t, fs, "metrics", OK, "a Unix socket of mode 0600", "")
	if err := os.MkdirAll(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(sock, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	fs = run(t, c, p)
	want(t, fs, "metrics", Problem, "exists and is not a socket", "remove it")
}

func TestReport(t *testing.T) {
	fs := []Finding{
		{Severity: OK, Check: "config", What: "hostd.hcl: fine"},
		{Severity: Problem, Check: "conntrack", What: "events off", Fix: "sysctl -w net.netfilter.nf_conntrack_events=1"},
		{Severity: Warning, Check: "libvirt", What: "libvirtd away", Fix: "systemctl start libvirtd"},
		{Severity: Problem, Check: "space", What: "no room", Fix: "lower region_size"},
		{Severity: Problem, Check: "metrics", What: "port taken", Fix: "change metrics_address"},
	}
	var b bytes.Buffer
	if err := WriteText(&b, fs); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
	if len(lines) != len(fs)+1 {
		t.Fatalf("want %d lines, got %d:\n%s", len(fs)+1, len(lines), b.String())
	}
	if got, want := lines[len(lines)-1], "3 problems, 1 warning"; got != want {
		t.Errorf("summary: want %q, got %q", want, got)
	}
	col := strings.Index(lines[0], fs[0].Check)
	for i, l := range lines[:len(fs)] {
		if got := strings.Index(l, fs[i].Check); got != col {
			t.Errorf("check column at %d, want %d: %q", got, col, l)
		}
		if strings.HasSuffix(l, " ") {
			t.Errorf("trailing space: %q", l)
		}
	}
	if !strings.Contains(lines[1], "fix: sysctl -w") {
		t.Errorf("problem line lacks its fix: %q", lines[1])
	}

	b.Reset()
	if err := WriteJSON(&b, "hostd.hcl", fs); err != nil {
		t.Fatal(err)
	}
	var r Report
	if err := json.Unmarshal(b.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r.Problems != 3 || r.Warnings != 1 || r.Config != "hostd.hcl" || len(r.Findings) != len(fs) || r.Findings[1] != fs[1] {
		t.Errorf("JSON round trip: got %+v", r)
	}
	if !strings.Contains(b.String(), `"severity": "problem"`) {
		t.Errorf("JSON severity not by name:\n%s", b.String())
	}
	for n, want := range map[int]string{0: "0 problems, 0 warnings", 1: "1 problem, 1 warning"} {
		var fs []Finding
		for range n {
			fs = append(fs, Finding{Severity: Problem}, Finding{Severity: Warning})
		}
		if got := Summary(fs); got != want {
			t.Errorf("Summary of %d each: want %q, got %q", n, want, got)
		}
	}
}

// TestQMP: the qmp sockets of a pair-region group's VMs: a missing one
// warns (the VM is not running yet), a file that is not a socket is a
// problem, and a QEMU that answers QMP is ok.
func TestQMP(t *testing.T) {
	c := newConfig(t)
	c.groups = []string{c.group("a", "1MiB", "vm_regions = \"pair\"")}
	answering := c.path("run/vm3.qmp")
	if err := os.MkdirAll(filepath.Dir(answering), 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", answering)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() { // a QEMU's QMP: greeting, then {"return":{}} to each command
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				fmt.Fprintln(conn, `{"QMP": {"version": {}, "capabilities": []}}`)
				sc := bufio.NewScanner(conn)
				for sc.Scan() {
					fmt.Fprintln(conn, `{"return": {}}`)
				}
			}()
		}
	}()
	notSocket := c.path("run/vm2.qmp")
	if err := os.WriteFile(notSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for i, q := range []string{c.path("run/vm1.qmp"), notSocket, answering} {
		c.guests = append(c.guests, fmt.Sprintf("guest \"vm%d\" {\n  id = %d\n  group = \"a\"\n  control = %q\n  addresses = [\"10.0.0.%d\"]\n  shared_region = true\n  qmp = %q\n}\n",
			i+1, i+1, c.path(fmt.Sprintf("run/vm%d.sock", i+1)), i+1, q))
	}
	fs := run(t, c, healthy())
	want(t, fs, "qmp", Warning, "guest vm1: qmp", "-qmp unix:")
	want(t, fs, "qmp", Problem, "guest vm2: qmp "+notSocket+" is not a socket", "QMP socket")
	want(t, fs, "qmp", OK, "guest vm3: QEMU answers QMP", "")
}

// TestLibvirtPairRegions: a pair-region group with libvirt says how its
// domains get their regions; without region_group it warns that an
// unprivileged QEMU could not open them.
func TestLibvirtPairRegions(t *testing.T) {
	c := newConfig(t)
	c.top = []string{"libvirt {}"}
	c.groups = []string{c.group("a", "1MiB", "region_group = \"root\"\n  vm_regions = \"pair\""), c.group("b", "1MiB", "vm_regions = \"pair\"")}
	fs := run(t, c, healthy())
	want(t, fs, "libvirt", OK, "/dev/shm/shunt-pair-A-B-pID (root:root 0660", "")
	want(t, fs, "libvirt", Warning, "trust group b has pair regions for VMs, but no region_group", "region_group = \"kvm\"")
	only(t, fs, "libvirt")
}

// TestQuotas: hostd check says how many concurrent fast-path connections
// each guest may hold and which limit binds: 32 with the defaults (issue
// 21: the default rig allowed 7), a warning with a small quota.
func TestQuotas(t *testing.T) {
	c := newConfig(t)
	fs := run(t, c, healthy())
	want(t, fs, "quotas", OK, "trust group a: each guest may hold 32 concurrent fast-path connections of ring_size 1 MiB (bound by guest_ring_bytes", "")
	c.groups = []string{c.group("a", "64MiB", `guest_ring_bytes = "16MiB"`)}
	fs = run(t, c, healthy())
	want(t, fs, "quotas", Warning, "each guest may hold 7 concurrent fast-path connections of ring_size 1 MiB (bound by guest_ring_bytes", "raise guest_ring_bytes")
}

// TestNetns: a process guest's netns is checked (a missing one is a
// problem: hostd would not start), and one without is told what it
// means for servers that drop privileges.
func TestNetns(t *testing.T) {
	c := newConfig(t)
	fs := run(t, c, healthy())
	want(t, fs, "netns", OK, "guest g1: no netns: its control socket is root's (0600)", "")
	c.guests = []string{fmt.Sprintf("guest \"g1\" {\n  id = 1\n  group = \"a\"\n  control = %q\n  addresses = [\"10.0.0.1\"]\n  netns = %q\n}\n", c.path("run/g1.sock"), c.path("missing-ns"))}
	fs = run(t, c, healthy())
	want(t, fs, "netns", Problem, "netns "+c.path("missing-ns")+" is not a network namespace file", "ip netns add")
}
