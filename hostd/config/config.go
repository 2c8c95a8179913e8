package config

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/gohcl"
	"github.com/hashicorp/hcl/v2/hclparse"
	"github.com/hashicorp/hcl/v2/hclsyntax"

	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// Config is hostd's configuration after validation.
type Config struct {
	Path           string
	LogLevel       string
	LogFormat      string // "text" or "json"
	AdminSocket    string
	MetricsAddress string // "" disables the metrics listener
	ConntrackNetns string // path of a netns whose conntrack table to use; "" = hostd's own
	PairingTimeout time.Duration
	ReattachGrace  time.Duration
	Witness        bool     // eBPF witness of SYN origin on guest interfaces
	Libvirt        *Libvirt // nil: no libvirt integration
	Groups         []Group
	Guests         []Guest
	Policy         policy.Spec
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
}

type file struct {
	LogLevel       string        `hcl:"log_level,optional"`
	LogFormat      string        `hcl:"log_format,optional"`
	AdminSocket    string        `hcl:"admin_socket,optional"`
	MetricsAddress *string       `hcl:"metrics_address,optional"`
	ConntrackNetns string        `hcl:"conntrack_netns,optional"`
	PairingTimeout string        `hcl:"pairing_timeout,optional"`
	ReattachGrace  string        `hcl:"reattach_grace,optional"`
	Witness        bool          `hcl:"witness,optional"`
	Libvirt        *libvirtBlock `hcl:"libvirt,block"`
	Groups         []groupBlock  `hcl:"trust_group,block"`
	Guests         []guestBlock  `hcl:"guest,block"`
	Policy         *policy.Spec  `hcl:"policy,block"`
	PolicyFile     string        `hcl:"policy_file,optional"`
}

type libvirtBlock struct {
	Socket string `hcl:"socket,optional"`
	URI    string `hcl:"uri,optional"`
}

type groupBlock struct {
	Name       string `hcl:"name,label"`
	Region     string `hcl:"region,optional"`
	RegionSize string `hcl:"region_size,optional"`
	Slots      int    `hcl:"slots,optional"`
	Owner      string `hcl:"region_group,optional"`
}

type guestBlock struct {
	Name      string   `hcl:"name,label"`
	ID        int      `hcl:"id"`
	Group     string   `hcl:"group"`
	Control   string   `hcl:"control"`
	Ports     int      `hcl:"control_ports,optional"`
	Addresses []string `hcl:"addresses,optional"`
	Interface string   `hcl:"interface,optional"`
	CTMark    int      `hcl:"ct_mark,optional"`
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
		ConntrackNetns: raw.ConntrackNetns, Witness: raw.Witness,
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
		if _, err := region.LayoutFor(grp.Geometry); err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
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
		if other, ok := socks[g.Control]; ok {
			return nil, fmt.Errorf("%s: control socket %s is already guest %q's", where, g.Control, other)
		}
		socks[g.Control] = g.Name
		if g.Ports < 0 || g.Ports > 30 {
			return nil, fmt.Errorf("%s: control_ports %d: want 1 to 30", where, g.Ports)
		}
		gu := Guest{Name: g.Name, ID: uint32(g.ID), Group: g.Group, Control: g.Control, Ports: max(g.Ports, 1), Interface: g.Interface, CTMark: uint32(g.CTMark)}
		for _, s := range g.Addresses {
			a, err := netip.ParseAddr(s)
			if err != nil {
				return nil, fmt.Errorf("%s: address %q: %w", where, s, err)
			}
			gu.Addresses = append(gu.Addresses, a)
		}
		if len(gu.Addresses) == 0 && gu.Interface == "" {
			return nil, fmt.Errorf("%s: give addresses, or an interface to learn them from", where)
		}
		c.Guests = append(c.Guests, gu)
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
	if _, err := policy.Compile(c.Policy); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return c, nil
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
