package config

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/gohcl"
	"github.com/hashicorp/hcl/v2/hclparse"
	"github.com/hashicorp/hcl/v2/hclsyntax"

	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// Config is hostd's configuration after validation.
type Config struct {
	Path           string
	LogLevel       string
	LogFormat      string // "text" or "json"
	AdminSocket    string
	MetricsAddress string // host:port, or unix:/path for a Unix socket; "" disables the metrics listener
	ConntrackNetns string // path of a netns whose conntrack table to use; "" = hostd's own
	PairingTimeout time.Duration
	ReattachGrace  time.Duration
	ShutdownGrace  time.Duration // how long a stopping hostd waits for the guests to leave the rings
	WatchRuleset   bool          // watch the firewall's ruleset and move connections to TCP on a change
	ProofMaxAge    time.Duration // how long a connection may use the rings without its lease showing packets past the filter
	Witness        bool          // eBPF witness of SYN origin on guest interfaces (Ownership witness or both)
	Ownership      string        // how a guest proves a connection is its own: an Ownership* value
	CTMarkMask     uint32        // the bits of the conntrack mark hostd sets (hostd/mark)
	StateDir       string        // root-only: hostd's shadow of every region (region.Files)
	RegionDir      string        // root-only: the regions of guest pairs
	// ContainerSocket is the control socket of the guests added at run
	// time without one of their own (containers, docs/containers.md):
	// one path for all of them, each process known by its network
	// namespace. "": none.
	ContainerSocket string
	// VsockdSocket is shunt-vsockd's control socket: the QEMU VMs' vsock
	// devices are then served by that process, which outlives hostd
	// (hostd/vsockd, docs/vsock.md "hostd restarts"); "": hostd serves
	// them itself.
	VsockdSocket string
	// PairRegionLinger is how long a pair region outlives its last flow
	// (0: the broker's default; negative: not at all).
	PairRegionLinger time.Duration
	// RevokeGrace is how long the flows of a retired pair region have
	// to leave it before hostd takes its memory away (0: the broker's
	// default).
	RevokeGrace time.Duration
	Limits      Limits   // what one guest may hold of the control plane
	Libvirt     *Libvirt // nil: no libvirt integration
	Groups      []Group
	Guests      []Guest
	Policy      policy.Spec
	Peering     *peers.Config // nil: no peering block (hostd/peers, docs/crosshost.md)
}

// Limits bound what one guest may hold of hostd's control plane, so that
// no guest can starve the others (docs/config.md, "limits").
type Limits struct {
	SessionsPerGuest     int           // control sessions at once, over all its sockets
	SessionsPerSecond    int           // new sessions a second hostd accepts from it
	ListensPerSession    int           // LISTENs one session holds
	ListensPerGuest      int           // LISTENs all its sessions hold
	PendingOpensPerGuest int           // OPENs being verified or waiting for their peer
	OpensPerSecond       int           // OPENs a second (after a burst of as many)
	Keepalive            time.Duration // hostd PINGs a session quiet this long
	Silence              time.Duration // and closes one quiet this long
}

// DefaultLimits are the limits without a limits block: roomy for an MPI
// job's all-to-all wire-up from a busy guest, small against a flood.
var DefaultLimits = Limits{
	SessionsPerGuest: 256, SessionsPerSecond: 100, ListensPerSession: 1024, ListensPerGuest: 4096,
	PendingOpensPerGuest: 4096, OpensPerSecond: 5000,
	Keepalive: 2 * time.Second, Silence: 10 * time.Second,
}

// Libvirt is where hostd finds libvirtd, whose running Shunt domains it
// registers as guests (hostd/virt).
type Libvirt struct {
	Socket string
	URI    string
}

// Group is a trust group: the guests that share one region.
type Group struct {
	Name     string
	Region   string // file path, usually under /dev/shm
	Geometry region.Geometry
	// RegionGroup, if set, owns the region file, which is then mode 0660:
	// for QEMUs that libvirt runs as an unprivileged user (Debian:
	// libvirt-qemu in group kvm).
	RegionGroup string
	// PairGeometry is the geometry of each region of two of the group's
	// process guests (files in RegionDir, handed over as descriptors).
	PairGeometry region.Geometry
	// Quota bounds what the flows one guest opens may take, over all the
	// regions it is in.
	Quota Quota
	// VMRegions is where the flows between the group's VMs (shared_region
	// guests) live: VMRegionsGroup, the group region, or VMRegionsPair, a
	// region per VM pair, hot-plugged into both VMs when the pair's first
	// flow needs it (the guests need a QMP socket).
	VMRegions string
}

// Values of a trust group's vm_regions.
const (
	VMRegionsGroup = "group" // the default: the group's VMs share its region and are one principal
	VMRegionsPair  = "pair"  // a region per VM pair, plugged into the two VMs (ivshmem hotplug)
)

// StateName is the name of the group's region in hostd's state directory
// (region.Files): "group-" and the group's name, with any byte that is not
// a letter, digit, '.', '_' or '-' written as %XX.
func (g Group) StateName() string {
	var b strings.Builder
	b.WriteString("group-")
	for i := 0; i < len(g.Name); i++ {
		c := g.Name[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// Quota is a per-guest share of ring memory: the flows a guest opens (as
// the connecting side) may hold at most RingBytes of ring pairs (both
// directions and their headers, in whole chunks) and Flows slots, over all
// the regions it is in. Beyond, its connections get TCP(guest-quota).
type Quota struct {
	RingBytes int64
	Flows     int
}

// Guest is one guest (a VM or a process guest) and its control channel.
type Guest struct {
	Name      string
	ID        uint32
	Group     string
	Control   string       // Unix socket path hostd listens on for this guest
	Ports     int          // control sockets: Control, Control.1, ... (one per VM port)
	Addresses []netip.Addr // addresses the guest owns
	Interface string       // host-side interface; its addresses' peers are learned with netlink
	CTMark    uint32       // if non-zero, conntrack entries from this guest carry this mark
	// SharedRegion puts the guest's flows with the group's other
	// SharedRegion guests in the trust group's region (region 0), which it
	// maps by path: for VMs, whose ivshmem BAR can take no descriptor.
	// Otherwise (process guests) each peer pair gets its own region.
	SharedRegion bool
	// QMP is the QMP socket of the guest's QEMU (bare QEMU, -qmp
	// unix:PATH,server=on,wait=off): how hostd hot-plugs pair regions
	// into a VM of a group with vm_regions = "pair".
	QMP string
	// Netns is a process or container guest's network namespace
	// (/run/netns/NAME): every process in it may use the guest's control
	// channel, whatever its uid, after a chroot too (hostd/server,
	// Endpoint.Netns). "": only hostd's user (root) may.
	Netns string
	// Vsock is the VM's vhost-user-vsock device that hostd serves
	// (vsock.go, docs/vsock.md); nil: none.
	Vsock *Vsock
}

type file struct {
	LogLevel       string        `hcl:"log_level,optional"`
	LogFormat      string        `hcl:"log_format,optional"`
	AdminSocket    string        `hcl:"admin_socket,optional"`
	MetricsAddress *string       `hcl:"metrics_address,optional"`
	ConntrackNetns string        `hcl:"conntrack_netns,optional"`
	PairingTimeout string        `hcl:"pairing_timeout,optional"`
	ReattachGrace  string        `hcl:"reattach_grace,optional"`
	ShutdownGrace  string        `hcl:"shutdown_grace,optional"`
	WatchRuleset   *bool         `hcl:"watch_ruleset,optional"`
	ProofMaxAge    string        `hcl:"proof_max_age,optional"`
	Witness        bool          `hcl:"witness,optional"`
	Ownership      string        `hcl:"ownership,optional"`
	CTMarkMask     string        `hcl:"ct_mark_mask,optional"`
	StateDir       string        `hcl:"state_dir,optional"`
	RegionDir      string        `hcl:"region_dir,optional"`
	ContainerSock  string        `hcl:"container_socket,optional"`
	VsockdSocket   string        `hcl:"vsockd_socket,optional"`
	PairLinger     string        `hcl:"pair_region_linger,optional"`
	RevokeGrace    string        `hcl:"revoke_grace,optional"`
	Libvirt        *libvirtBlock `hcl:"libvirt,block"`
	Limits         *limitsBlock  `hcl:"limits,block"`
	Groups         []groupBlock  `hcl:"trust_group,block"`
	Guests         []guestBlock  `hcl:"guest,block"`
	Policy         *policy.Spec  `hcl:"policy,block"`
	PolicyFile     string        `hcl:"policy_file,optional"`
	Peering        *peeringBlock `hcl:"peering,block"`
	Peers          []peerBlock   `hcl:"peer,block"`
}

type libvirtBlock struct {
	Socket string `hcl:"socket,optional"`
	URI    string `hcl:"uri,optional"`
}

type limitsBlock struct {
	SessionsPerGuest  *int `hcl:"sessions_per_guest,optional"`
	SessionsPerSecond *int `hcl:"sessions_per_second,optional"`
	ListensPerSession *int `hcl:"listens_per_session,optional"`
	ListensPerGuest   *int `hcl:"listens_per_guest,optional"`
	// IntentsPerGuest is accepted and ignored: INTENT keeps nothing since
	// protocol 3, and older hostd.hcl files still load.
	IntentsPerGuest      *int   `hcl:"intents_per_guest,optional"`
	PendingOpensPerGuest *int   `hcl:"pending_opens_per_guest,optional"`
	OpensPerSecond       *int   `hcl:"opens_per_second,optional"`
	Keepalive            string `hcl:"keepalive,optional"`
	Silence              string `hcl:"silence,optional"`
}

type groupBlock struct {
	Name       string `hcl:"name,label"`
	Region     string `hcl:"region,optional"`
	RegionSize string `hcl:"region_size,optional"`
	Slots      int    `hcl:"slots,optional"`
	Owner      string `hcl:"region_group,optional"`
	PairSize   string `hcl:"pair_region_size,optional"`
	PairSlots  int    `hcl:"pair_slots,optional"`
	RingBytes  string `hcl:"guest_ring_bytes,optional"`
	Flows      int    `hcl:"guest_flows,optional"`
	VMRegions  string `hcl:"vm_regions,optional"`
}

type guestBlock struct {
	Name      string   `hcl:"name,label"`
	ID        int      `hcl:"id"`
	Group     string   `hcl:"group"`
	Control   string   `hcl:"control,optional"`
	Ports     int      `hcl:"control_ports,optional"`
	Addresses []string `hcl:"addresses,optional"`
	Interface string   `hcl:"interface,optional"`
	CTMark    int      `hcl:"ct_mark,optional"`
	// SharedRegion: see Guest.
	SharedRegion bool        `hcl:"shared_region,optional"`
	QMP          string      `hcl:"qmp,optional"`
	Netns        string      `hcl:"netns,optional"`
	Vsock        *vsockBlock `hcl:"vsock,block"`
}

// Load reads and validates the configuration at path.
func Load(path string) (*Config, error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	return Parse(path, src)
}

// Parse parses and validates configuration source; name is used in errors.
func Parse(name string, src []byte) (*Config, error) {
	p := hclparse.NewParser()
	f, diags := p.ParseHCL(src, name)
	if diags.HasErrors() {
		return nil, diagError(diags)
	}
	var raw file
	if diags := gohcl.DecodeBody(f.Body, nil, &raw); diags.HasErrors() {
		return nil, diagError(diags)
	}
	c := &Config{
		Path: name, LogLevel: or(raw.LogLevel, "info"), LogFormat: or(raw.LogFormat, "text"),
		AdminSocket: or(raw.AdminSocket, "/run/shunt/admin.sock"), MetricsAddress: "127.0.0.1:9469",
		ConntrackNetns: raw.ConntrackNetns,
	}
	if raw.MetricsAddress != nil {
		c.MetricsAddress = *raw.MetricsAddress
	}
	at := func(what string) string { return fmt.Sprintf("%s: %s", name, what) }
	var err error
	switch c.LogLevel {
	case "trace", "debug", "info", "warn", "error":
	default:
		return nil, fmt.Errorf("%s", at(fmt.Sprintf("log_level %q: want trace, debug, info, warn or error", c.LogLevel)))
	}
	if c.LogFormat != "text" && c.LogFormat != "json" {
		return nil, fmt.Errorf("%s", at(fmt.Sprintf("log_format %q: want \"text\" or \"json\"", c.LogFormat)))
	}
	if c.PairingTimeout, err = duration(raw.PairingTimeout, 2*time.Second); err != nil {
		return nil, fmt.Errorf("%s", at("pairing_timeout: "+err.Error()))
	}
	if c.ReattachGrace, err = duration(raw.ReattachGrace, 5*time.Second); err != nil {
		return nil, fmt.Errorf("%s", at("reattach_grace: "+err.Error()))
	}
	if c.ShutdownGrace, err = duration(raw.ShutdownGrace, 2*time.Second); err != nil {
		return nil, fmt.Errorf("%s", at("shutdown_grace: "+err.Error()))
	}
	c.WatchRuleset = raw.WatchRuleset == nil || *raw.WatchRuleset
	if c.ProofMaxAge, err = duration(raw.ProofMaxAge, 35*time.Second); err != nil || c.ProofMaxAge < time.Second {
		return nil, fmt.Errorf("%s", at(fmt.Sprintf("proof_max_age %q: want a duration of at least 1s, such as \"35s\" (a little over two TCP keepalive intervals of the guest libraries)", raw.ProofMaxAge)))
	}
	if err := c.ownership(raw); err != nil {
		return nil, fmt.Errorf("%s", at(err.Error()))
	}
	if c.Limits, err = limits(raw.Limits); err != nil {
		return nil, fmt.Errorf("%s", at("limits: "+err.Error()))
	}
	if err := checkMetricsAddress(c.MetricsAddress); err != nil {
		return nil, fmt.Errorf("%s", at("metrics_address: "+err.Error()))
	}
	c.StateDir, c.RegionDir = or(raw.StateDir, "/run/shunt/state"), or(raw.RegionDir, "/run/shunt/regions")
	for _, d := range []struct{ name, path string }{{"state_dir", c.StateDir}, {"region_dir", c.RegionDir}} {
		if !filepath.IsAbs(d.path) || filepath.Clean(d.path) == "/" {
			return nil, fmt.Errorf("%s", at(fmt.Sprintf("%s %q: want an absolute path of a directory of hostd's own", d.name, d.path)))
		}
	}
	if err := c.checkContainerSocket(raw.ContainerSock); err != nil {
		return nil, fmt.Errorf("%s", at(err.Error()))
	}
	if raw.PairLinger == "0s" || raw.PairLinger == "0" {
		c.PairRegionLinger = -1 // none
	} else if c.PairRegionLinger, err = duration(raw.PairLinger, 0); err != nil {
		return nil, fmt.Errorf("%s", at("pair_region_linger: "+err.Error()))
	}
	if c.RevokeGrace, err = duration(raw.RevokeGrace, 0); err != nil || c.RevokeGrace > time.Minute {
		return nil, fmt.Errorf("%s", at(fmt.Sprintf("revoke_grace %q: want a duration up to 1m", raw.RevokeGrace)))
	}
	if filepath.Clean(c.StateDir) == filepath.Clean(c.RegionDir) {
		return nil, fmt.Errorf("%s", at("state_dir and region_dir are one directory: give each its own"))
	}
	lines := blockLines(f.Body)
	groups := map[string]bool{}
	for _, g := range raw.Groups {
		where := at(fmt.Sprintf("trust_group %q (line %d)", g.Name, lines["trust_group."+g.Name]))
		if groups[g.Name] {
			return nil, fmt.Errorf("%s: defined twice", where)
		}
		groups[g.Name] = true
		size, err := policy.ParseSize(or(g.RegionSize, "64MiB"))
		if err != nil {
			return nil, fmt.Errorf("%s: region_size: %w", where, err)
		}
		grp := Group{Name: g.Name, Region: or(g.Region, "/dev/shm/shunt-"+g.Name),
			Geometry: region.Geometry{Size: size, Slots: g.Slots}, RegionGroup: g.Owner}
		if grp.Geometry.Slots == 0 {
			grp.Geometry.Slots = 256
		}
		// hostd's own name for the pair regions of libvirt domains
		// (hostd/virt.PairShmem), which it creates and removes there.
		if filepath.Dir(grp.Region) == "/dev/shm" && strings.HasPrefix(filepath.Base(grp.Region), "shunt-pair-") {
			return nil, fmt.Errorf("%s: region %s: /dev/shm/shunt-pair-* are hostd's names for libvirt domains' pair regions: give the group another region", where, grp.Region)
		}
		if _, err := region.LayoutFor(grp.Geometry); err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if err := pairAndQuota(&grp, g); err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		switch grp.VMRegions = or(g.VMRegions, VMRegionsGroup); grp.VMRegions {
		case VMRegionsGroup:
		case VMRegionsPair:
			// An ivshmem BAR is a power of two of at least 1 MiB.
			if sz := grp.PairGeometry.Size; sz < 1<<20 || sz&(sz-1) != 0 {
				return nil, fmt.Errorf("%s: pair_region_size %d: with vm_regions = \"pair\" pair regions are ivshmem BARs: want a power of two of at least 1MiB", where, sz)
			}
		default:
			return nil, fmt.Errorf("%s: vm_regions %q: want \"group\" or \"pair\"", where, g.VMRegions)
		}
		c.Groups = append(c.Groups, grp)
	}
	if l := raw.Libvirt; l != nil {
		c.Libvirt = &Libvirt{Socket: or(l.Socket, "/run/libvirt/libvirt-sock"), URI: or(l.URI, "qemu:///system")}
		if !filepath.IsAbs(c.Libvirt.Socket) {
			return nil, fmt.Errorf("%s", at(fmt.Sprintf("libvirt socket %q: want an absolute path", c.Libvirt.Socket)))
		}
		if !strings.Contains(c.Libvirt.URI, "://") {
			return nil, fmt.Errorf("%s", at(fmt.Sprintf("libvirt uri %q: want a URI such as qemu:///system", c.Libvirt.URI)))
		}
	}
	ids, socks := map[int]string{}, map[string]string{}
	ifaces, owners := map[string]string{}, map[netip.Addr]string{}
	for _, g := range raw.Guests {
		where := at(fmt.Sprintf("guest %q (line %d)", g.Name, lines["guest."+g.Name]))
		if !groups[g.Group] {
			return nil, fmt.Errorf("%s: trust group %q is not defined", where, g.Group)
		}
		if g.ID <= 0 || g.ID > 1<<31 {
			return nil, fmt.Errorf("%s: id %d: want a positive number", where, g.ID)
		}
		if other, ok := ids[g.ID]; ok {
			return nil, fmt.Errorf("%s: id %d is already guest %q's", where, g.ID, other)
		}
		ids[g.ID] = g.Name
		if other, ok := socks[g.Control]; ok && g.Control != "" {
			return nil, fmt.Errorf("%s: control socket %s is already guest %q's", where, g.Control, other)
		}
		socks[g.Control] = g.Name
		if g.Ports < 0 || g.Ports > 30 {
			return nil, fmt.Errorf("%s: control_ports %d: want 1 to 30", where, g.Ports)
		}
		if g.Ports > c.Limits.SessionsPerGuest {
			return nil, fmt.Errorf("%s: control_ports %d is more than limits.sessions_per_guest %d: raise the limit", where, g.Ports, c.Limits.SessionsPerGuest)
		}
		gu := Guest{Name: g.Name, ID: uint32(g.ID), Group: g.Group, Control: g.Control, Ports: max(g.Ports, 1), Interface: g.Interface, CTMark: uint32(g.CTMark),
			SharedRegion: g.SharedRegion, QMP: g.QMP, Netns: g.Netns}
		if gu.Netns != "" && (!filepath.IsAbs(gu.Netns) || gu.SharedRegion) {
			return nil, fmt.Errorf("%s: netns %q: want the absolute path of a process or container guest's network namespace (/run/netns/NAME), not for a VM (shared_region)", where, gu.Netns)
		}
		if err := checkQMP(gu, c.group(g.Group)); err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		for _, s := range g.Addresses {
			a, err := netip.ParseAddr(s)
			if err != nil {
				return nil, fmt.Errorf("%s: address %q: %w", where, s, err)
			}
			a = a.Unmap()
			if other, ok := owners[a]; ok && other != g.Name {
				return nil, fmt.Errorf("%s: address %s is already guest %q's: two guests cannot own one address (hostd could not tell whose a connection is)", where, a, other)
			}
			owners[a] = g.Name
			gu.Addresses = append(gu.Addresses, a)
		}
		if len(gu.Addresses) == 0 && gu.Interface == "" {
			return nil, fmt.Errorf("%s: give addresses, or an interface to learn them from", where)
		}
		if gu.Interface != "" {
			if other, ok := ifaces[gu.Interface]; ok {
				return nil, fmt.Errorf("%s: interface %s is already guest %q's: a connection that comes in by it can be only one guest's", where, gu.Interface, other)
			}
			ifaces[gu.Interface] = g.Name
		}
		if err := c.checkCTMark(g.CTMark); err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if gu.Vsock, err = vsockOf(g.Vsock, gu, c.Guests); err != nil {
			return nil, fmt.Errorf("%s: vsock: %w", where, err)
		}
		if gu.Control == "" && gu.Vsock == nil {
			return nil, fmt.Errorf("%s: control: want the guest's control socket (a VM's virtio-serial socket); only a VM with a vsock block may go without, its control channel then on vsock", where)
		}
		c.Guests = append(c.Guests, gu)
	}
	if err := c.checkVsockd(raw.VsockdSocket); err != nil {
		return nil, fmt.Errorf("%s", at(err.Error()))
	}
	switch {
	case raw.Policy != nil && raw.PolicyFile != "":
		return nil, fmt.Errorf("%s", at("give a policy block or policy_file, not both"))
	case raw.Policy != nil:
		c.Policy = *raw.Policy
		for i := range c.Policy.Rules {
			c.Policy.Rules[i].Line = lines["rule."+c.Policy.Rules[i].Name]
		}
	case raw.PolicyFile != "":
		if c.Policy, err = LoadPolicy(raw.PolicyFile); err != nil {
			return nil, err
		}
	}
	tab, err := policy.Compile(c.Policy)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	for i := range c.Groups {
		g := &c.Groups[i]
		if err := checkQuota(g, c.Policy, tab, c.SharesRegion(g.Name)); err != nil {
			return nil, fmt.Errorf("%s", at(fmt.Sprintf("trust_group %q (line %d): %v", g.Name, lines["trust_group."+g.Name], err)))
		}
	}
	if c.Peering, err = peering(raw.Peering, raw.Peers); err != nil {
		return nil, fmt.Errorf("%s", at(err.Error()))
	}
	return c, nil
}

// checkContainerSocket sets c.ContainerSocket from sock: an absolute
// path in a directory of its own, since the CDI device mounts that
// directory into containers whole (docs/containers.md): never the admin
// socket's or the metrics socket's directory.
func (c *Config) checkContainerSocket(sock string) error {
	if c.ContainerSocket = sock; sock == "" {
		return nil
	}
	if !filepath.IsAbs(sock) {
		return fmt.Errorf("container_socket %q: want an absolute path", sock)
	}
	dir := filepath.Dir(filepath.Clean(sock))
	for _, other := range []struct{ name, path string }{{"admin_socket", c.AdminSocket}, {"metrics_address", MetricsUnix(c.MetricsAddress)}} {
		if other.path != "" && filepath.Dir(filepath.Clean(other.path)) == dir {
			return fmt.Errorf("container_socket %s is in the directory of %s (%s), which containers would then see: give it a directory of its own, such as /run/shunt/container/control.sock", sock, other.name, other.path)
		}
	}
	if dir == "/" || dir == "/run" {
		return fmt.Errorf("container_socket %s: give it a directory of its own, such as /run/shunt/container/control.sock", sock)
	}
	return nil
}

// group returns the trust group called name (nil if there is none).
func (c *Config) group(name string) *Group {
	for i := range c.Groups {
		if c.Groups[i].Name == name {
			return &c.Groups[i]
		}
	}
	return nil
}

// SharesRegion reports whether guests of trust group name may share its
// region: it has a shared_region guest (a VM), or libvirt may add VMs to
// any group. There the default quota is a quarter of the region, so that
// one guest cannot take the others' room.
func (c *Config) SharesRegion(name string) bool {
	return c.Libvirt != nil || slices.ContainsFunc(c.Guests, func(g Guest) bool { return g.Group == name && g.SharedRegion })
}

// checkQMP checks a guest's qmp against its group's vm_regions: a VM
// (shared_region) of a vm_regions = "pair" group needs one, since hostd
// hot-plugs its pair regions through it; qmp means nothing elsewhere.
func checkQMP(g Guest, grp *Group) error {
	pair := grp != nil && grp.VMRegions == VMRegionsPair
	switch {
	case g.QMP != "" && !filepath.IsAbs(g.QMP):
		return fmt.Errorf("qmp %q: want the absolute path of the QEMU's QMP socket", g.QMP)
	case g.QMP != "" && (!g.SharedRegion || !pair):
		return fmt.Errorf("qmp is for VMs (shared_region = true) of a trust group with vm_regions = \"pair\": remove it, or set those")
	case g.SharedRegion && pair && g.QMP == "":
		return fmt.Errorf("trust group %s has vm_regions = \"pair\": give this VM its QEMU's QMP socket (qmp = \"/run/shunt/NAME.qmp\", QEMU -qmp unix:PATH,server=on,wait=off), through which hostd hot-plugs its pair regions", g.Group)
	}
	return nil
}

// Defaults of a trust group's pair regions: room for DefaultConnsPerGuest
// flows of the default ring_size (1 MiB each way) in one pair region
// (tmpfs allocates its pages only as rings are touched); a power of two,
// as a VM pair region's BAR must be.
const (
	DefaultPairRegionSize = 128 << 20
	DefaultPairSlots      = 256
)

// DefaultConnsPerGuest is how many concurrent fast-path connections of the
// policy's ring_size the default quota and pair regions leave each guest:
// a server with 32 clients at once (ab -c 16 and pgbench -c 8 with room to
// spare) keeps them all on the rings.
const DefaultConnsPerGuest = 32

// DefaultFloorFlows is how many flows of the policy's default ring_size
// the default quota leaves a guest beside one flow of the largest ring a
// rule gives: with the 4 MiB rule docs/mpi.md shows, the four leases a
// guest opens in a 4-rank MPI job (2 ranks a guest) all get rings, the
// first of the rule's size.
const DefaultFloorFlows = 3

// pairAndQuota reads a trust group's pair region geometry and the quota as
// given (0: the default, which checkQuota fills in once the policy is
// known).
func pairAndQuota(grp *Group, g groupBlock) error {
	size, err := policy.ParseSize(or(g.PairSize, "128MiB"))
	if err != nil {
		return fmt.Errorf("pair_region_size: %w", err)
	}
	grp.PairGeometry = region.Geometry{Size: size, Slots: g.PairSlots}
	if g.PairSlots == 0 {
		grp.PairGeometry.Slots = DefaultPairSlots
	}
	if _, err := region.LayoutFor(grp.PairGeometry); err != nil {
		return fmt.Errorf("pair regions: %w", err)
	}
	if g.RingBytes != "" {
		if grp.Quota.RingBytes, err = policy.ParseSize(g.RingBytes); err != nil {
			return fmt.Errorf("guest_ring_bytes: %w", err)
		}
		if grp.Quota.RingBytes <= 0 {
			return fmt.Errorf("guest_ring_bytes %q: want a size, e.g. \"16MiB\"", g.RingBytes)
		}
	}
	if g.Flows < 0 {
		return fmt.Errorf("guest_flows %d: want 1 or more", g.Flows)
	}
	grp.Quota.Flows = g.Flows
	return nil
}

// checkQuota fills in the defaults of a trust group's quota and checks it,
// and the pair regions, against the policy: one flow of every ring_size the
// policy can choose must fit a guest's quota and a pair region, and
// guest_flows above max_flows_per_guest would never bind. The default quota
// is a quarter of the group region's bytes and slots (but at least one
// flow of the largest ring), so that one guest leaves most of the region
// to the others. A group whose guests share no region (process and
// container guests only: shared false) has its flows in pair regions of
// their own; its default leaves each guest room for DefaultConnsPerGuest
// flows of the policy's ring_size at least.
func checkQuota(g *Group, spec policy.Spec, tab *policy.Table, shared bool) error {
	rings := []int{policy.DefaultRingSize}
	if spec.RingSize != "" {
		rings[0], _ = policy.ParseRingSize(spec.RingSize) // Compile checked it
	}
	conns, flows := DefaultConnsPerGuest*region.PairSize(rings[0]), DefaultConnsPerGuest
	if shared {
		conns, flows = 0, 0
	}
	for _, r := range spec.Rules {
		if r.RingSize != "" {
			n, _ := policy.ParseRingSize(r.RingSize)
			rings = append(rings, n)
		}
	}
	largest := slices.Max(rings)
	pair := region.PairSize(largest)
	if g.Quota.RingBytes == 0 {
		// One flow of the largest ring leaves room for DefaultFloorFlows
		// of the default: a flow whose rule's ring finds no room takes
		// the default ring (hostd/broker/ringsize.go).
		g.Quota.RingBytes = max(g.Geometry.Size/4, pair+DefaultFloorFlows*region.PairSize(rings[0]), conns)
	}
	if g.Quota.RingBytes < pair {
		return fmt.Errorf("guest_ring_bytes %d is less than one flow of ring_size %d takes (%d bytes: two rings and their headers): raise it, or lower ring_size", g.Quota.RingBytes, largest, pair)
	}
	maxFlows := tab.MaxFlowsPerGuest()
	if g.Quota.Flows == 0 {
		g.Quota.Flows = max(1, min(max(g.Geometry.Slots/4, flows), maxFlows))
	}
	if g.Quota.Flows > maxFlows {
		return fmt.Errorf("guest_flows %d is more than the policy's max_flows_per_guest %d, which binds first: lower it", g.Quota.Flows, maxFlows)
	}
	if l, _ := region.LayoutFor(g.PairGeometry); l.HeapSize < pair {
		return fmt.Errorf("pair_region_size %d holds no flow of ring_size %d (%d bytes): raise it, or lower ring_size", g.PairGeometry.Size, largest, pair)
	}
	return nil
}

// Ways a guest proves that a connection is its own, beyond owning its
// source address (docs/config.md, "ownership").
const (
	OwnershipMark      = "mark"      // hostd's nftables table marks each guest's new connections (hostd/mark)
	OwnershipWitness   = "witness"   // the eBPF witness records each SYN's interface (hostd/witness)
	OwnershipBoth      = "both"      // both must agree
	OwnershipAddresses = "addresses" // the source address alone: proof turned off
)

// Marks reports whether hostd marks the guests' connections.
func (c *Config) Marks() bool { return c.Ownership == OwnershipMark || c.Ownership == OwnershipBoth }

// ownership reads ownership, the old witness switch and ct_mark_mask.
func (c *Config) ownership(raw file) error {
	c.Ownership = raw.Ownership
	switch {
	case raw.Witness && c.Ownership != "":
		return fmt.Errorf("witness = true is the old spelling of ownership = %q: give ownership only", OwnershipBoth)
	case raw.Witness:
		c.Ownership = OwnershipBoth
	case c.Ownership == "":
		c.Ownership = OwnershipMark
	}
	switch c.Ownership {
	case OwnershipMark, OwnershipWitness, OwnershipBoth, OwnershipAddresses:
	default:
		return fmt.Errorf("ownership %q: want %q (hostd marks each guest's connections; the default), %q (eBPF), %q or %q (the source address alone)",
			c.Ownership, OwnershipMark, OwnershipWitness, OwnershipBoth, OwnershipAddresses)
	}
	c.Witness = c.Ownership == OwnershipWitness || c.Ownership == OwnershipBoth
	c.CTMarkMask = mark.DefaultMask
	if raw.CTMarkMask != "" {
		m, err := mark.ParseMask(raw.CTMarkMask)
		if err != nil {
			return fmt.Errorf("ct_mark_mask: %w", err)
		}
		c.CTMarkMask = m
	}
	return nil
}

// checkCTMark checks a guest's ct_mark, the mark an operator's rule sets on
// its connections: checked as before, outside the bits hostd sets.
func (c *Config) checkCTMark(m int) error {
	switch {
	case m < 0 || m > 1<<32-1:
		return fmt.Errorf("ct_mark %d: want 0 to 4294967295", m)
	case c.Marks() && uint32(m)&c.CTMarkMask != 0:
		return fmt.Errorf("ct_mark %#x uses bits of ct_mark_mask %#08x, which hostd now sets itself (it marks each guest's connections at ingress): drop ct_mark and the rule that sets it, or move ct_mark_mask to other bits", m, c.CTMarkMask)
	}
	return nil
}

// LoadPolicy reads a policy file: the body of a policy block.
func LoadPolicy(path string) (policy.Spec, error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return policy.Spec{}, fmt.Errorf("read policy: %w", err)
	}
	f, diags := hclparse.NewParser().ParseHCL(src, path)
	if diags.HasErrors() {
		return policy.Spec{}, diagError(diags)
	}
	var s policy.Spec
	if diags := gohcl.DecodeBody(f.Body, nil, &s); diags.HasErrors() {
		return policy.Spec{}, diagError(diags)
	}
	lines := blockLines(f.Body)
	for i := range s.Rules {
		s.Rules[i].Line = lines["rule."+s.Rules[i].Name]
	}
	if _, err := policy.Compile(s); err != nil {
		return policy.Spec{}, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

// blockLines maps "type.label" of every block (nested too) to its line.
func blockLines(b hcl.Body) map[string]int {
	out := map[string]int{}
	var walk func(*hclsyntax.Body)
	walk = func(body *hclsyntax.Body) {
		for _, blk := range body.Blocks {
			if len(blk.Labels) > 0 {
				out[blk.Type+"."+blk.Labels[0]] = blk.DefRange().Start.Line
			}
			walk(blk.Body)
		}
	}
	if sb, ok := b.(*hclsyntax.Body); ok {
		walk(sb)
	}
	return out
}

func diagError(diags hcl.Diagnostics) error {
	var errs []error
	for _, d := range diags {
		if d.Severity != hcl.DiagError {
			continue
		}
		pos := ""
		if d.Subject != nil {
			pos = fmt.Sprintf("%s:%d,%d: ", d.Subject.Filename, d.Subject.Start.Line, d.Subject.Start.Column)
		}
		errs = append(errs, fmt.Errorf("%s%s; %s", pos, d.Summary, d.Detail))
	}
	return errors.Join(errs...)
}

// limits applies a limits block over DefaultLimits and checks it.
func limits(l *limitsBlock) (Limits, error) {
	out := DefaultLimits
	if l == nil {
		return out, nil
	}
	for _, n := range []struct {
		name string
		v    *int
		to   *int
	}{
		{"sessions_per_guest", l.SessionsPerGuest, &out.SessionsPerGuest},
		{"sessions_per_second", l.SessionsPerSecond, &out.SessionsPerSecond},
		{"listens_per_session", l.ListensPerSession, &out.ListensPerSession},
		{"listens_per_guest", l.ListensPerGuest, &out.ListensPerGuest},
		{"pending_opens_per_guest", l.PendingOpensPerGuest, &out.PendingOpensPerGuest},
		{"opens_per_second", l.OpensPerSecond, &out.OpensPerSecond},
	} {
		if n.v == nil {
			continue
		}
		if *n.v < 1 || *n.v > 1<<20 {
			return out, fmt.Errorf("%s %d: want 1 to %d", n.name, *n.v, 1<<20)
		}
		*n.to = *n.v
	}
	var err error
	if out.Keepalive, err = duration(l.Keepalive, out.Keepalive); err != nil {
		return out, fmt.Errorf("keepalive: %w", err)
	}
	if out.Silence, err = duration(l.Silence, out.Silence); err != nil {
		return out, fmt.Errorf("silence: %w", err)
	}
	if out.Silence < 2*out.Keepalive {
		return out, fmt.Errorf("silence %s is less than twice keepalive %s: a guest would get at most one PING to answer before it is closed", out.Silence, out.Keepalive)
	}
	return out, nil
}

// MetricsUnix is the socket path of a "unix:/path" metrics address, or "".
func MetricsUnix(addr string) string {
	if p, ok := strings.CutPrefix(addr, "unix:"); ok {
		return p
	}
	return ""
}

func checkMetricsAddress(addr string) error {
	switch {
	case addr == "":
		return nil
	case strings.HasPrefix(addr, "unix:"):
		if p := MetricsUnix(addr); !filepath.IsAbs(p) {
			return fmt.Errorf("%q: want unix: and an absolute path, e.g. \"unix:/run/shunt/metrics.sock\"", addr)
		}
		return nil
	}
	return nil // host:port is checked when it is bound (and by hostd check)
}

func or(s, dflt string) string {
	if s == "" {
		return dflt
	}
	return s
}

func duration(s string, dflt time.Duration) (time.Duration, error) {
	if s == "" {
		return dflt, nil
	}
	d, err := time.ParseDuration(s)
	if err == nil && d <= 0 {
		err = fmt.Errorf("%q: want a positive duration", s)
	}
	return d, err
}
