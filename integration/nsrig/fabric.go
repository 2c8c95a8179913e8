//go:build linux

package nsrig

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Fabric is two hosts, each a rig of its own (its own host namespace, so
// its own conntrack table, nftables ruleset and hostd, and its own guests),
// joined by a veth pair between the two host namespaces: the fabric.
//
//	host h1 (netns shunt-<name>1-host)             host h2 (netns shunt-<name>2-host)
//	  guests 10.77.i.2, fd00:77:i::2                 guests 10.78.i.2, fd00:78:i::2
//	  fab-<name> 10.99.0.1/24, fd00:99::1  <-veth->  fab-<name> 10.99.0.2/24, fd00:99::2
//	  10.78.0.0/16, fd00:78::/32 via h2              10.77.0.0/16, fd00:77::/32 via h1
//
// A guest of h1 reaches a guest of h2 by plain routing: through h1's
// forward chain and conntrack, the fabric, then h2's. Nothing is NATed.
type Fabric struct {
	Name   string
	Hosts  []*Rig         // h1, h2
	Addrs  []netip.Addr   // each host's IPv4 address on the fabric
	Addrs6 []netip.Addr   // and its IPv6 one
	If     string         // the fabric veth's name, the same in both hosts
	subnet []netip.Prefix // each host's guests, IPv4 and IPv6 (two per host)
}

// NewFabric describes a fabric of hosts hosts (2: the only shape built)
// with guests guests each; Create makes it. name has 1 to 7 characters:
// host k's rig is named name+k.
func NewFabric(name string, hosts, guests int) (*Fabric, error) {
	if hosts != 2 {
		return nil, fmt.Errorf("fabric of %d hosts: only 2 are built (one veth between two host namespaces)", hosts)
	}
	if len(name) == 0 || len(name) > 7 || strings.ContainsAny(name, " /") {
		return nil, fmt.Errorf("fabric name %q: want 1 to 7 characters, no spaces or slashes", name)
	}
	f := &Fabric{Name: name, If: "fab-" + name}
	for k := 1; k <= hosts; k++ {
		subnet := byte(76 + k)
		r, err := newRig(fmt.Sprintf("%s%d", name, k), guests, subnet)
		if err != nil {
			return nil, err
		}
		f.Hosts = append(f.Hosts, r)
		f.Addrs = append(f.Addrs, netip.AddrFrom4([4]byte{10, 99, 0, byte(k)}))
		f.Addrs6 = append(f.Addrs6, netip.AddrFrom16([16]byte{0xfd, 0x00, 0x00, 0x99, 15: byte(k)}))
		f.subnet = append(f.subnet,
			netip.PrefixFrom(netip.AddrFrom4([4]byte{10, subnet, 0, 0}), 16),
			netip.PrefixFrom(netip.AddrFrom16([16]byte{0xfd, 0x00, 0x00, v6Group(subnet)}), 32))
	}
	return f, nil
}

// Prefixes are host k's (0-based) guest prefixes, IPv4 and IPv6: what it
// may announce to its peer.
func (f *Fabric) Prefixes(k int) []netip.Prefix { return f.subnet[2*k : 2*k+2] }

// Create builds both hosts and the fabric between them, removing leftovers
// first. On failure it removes what it made.
func (f *Fabric) Create() (err error) {
	_ = f.Destroy()
	defer func() {
		if err != nil {
			_ = f.Destroy()
		}
	}()
	for _, r := range f.Hosts {
		if err := r.Create(); err != nil {
			return fmt.Errorf("host %s: %w", r.Name, err)
		}
	}
	return f.link()
}

// link joins the two host namespaces by the fabric veth, with addresses
// and routes to the other host's guests.
func (f *Fabric) link() error {
	var hs [2]netns.NsHandle
	var nh [2]*netlink.Handle
	for k, r := range f.Hosts {
		h, err := netns.GetFromPath(r.HostNSPath())
		if err != nil {
			return fmt.Errorf("netns %s: %w", r.HostNS, err)
		}
		defer h.Close()
		hs[k] = h
		if nh[k], err = netlink.NewHandleAt(h); err != nil {
			return fmt.Errorf("netlink in %s: %w", r.HostNS, err)
		}
		defer nh[k].Close()
	}
	veth := &netlink.Veth{
		LinkAttrs: netlink.LinkAttrs{Name: f.If, Namespace: netlink.NsFd(hs[0])},
		PeerName:  f.If, PeerNamespace: netlink.NsFd(hs[1]),
	}
	if err := nh[0].LinkAdd(veth); err != nil {
		return fmt.Errorf("fabric veth %s: %w", f.If, err)
	}
	for k := range f.Hosts {
		for _, a := range []netip.Addr{f.Addrs[k], f.Addrs6[k]} {
			if err := addAddr(nh[k], f.If, a); err != nil {
				return err
			}
		}
		if err := linkUp(nh[k], f.If); err != nil {
			return err
		}
		// A link cut (SetLink) must not lose the IPv6 addresses.
		if err := In(f.Hosts[k].HostNSPath(), func() error {
			return sysctls(map[string]string{"net/ipv6/conf/" + f.If + "/keep_addr_on_down": "1"})
		}); err != nil {
			return fmt.Errorf("keep_addr_on_down on %s: %w", f.If, err)
		}
	}
	return f.routes(nh)
}

// routes (re)makes each host's routes to the other's guests (a link set
// down loses them).
func (f *Fabric) routes(nh [2]*netlink.Handle) error {
	for k := range f.Hosts {
		o := 1 - k
		for i, p := range f.Prefixes(o) {
			gw := f.Addrs[o]
			rt := &netlink.Route{Dst: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}}
			if i == 1 {
				gw, rt.Family = f.Addrs6[o], netlink.FAMILY_V6
			}
			rt.Gw = gw.AsSlice()
			if err := nh[k].RouteReplace(rt); err != nil {
				return fmt.Errorf("route to %s via %s in %s: %w", p, gw, f.Hosts[k].HostNS, err)
			}
		}
	}
	return nil
}

// SetLink sets the fabric veth down or up on both hosts (a link cut); up
// also puts back the routes that down took away.
func (f *Fabric) SetLink(up bool) error {
	var nh [2]*netlink.Handle
	for k, r := range f.Hosts {
		h, err := netlink.NewHandleAt(mustNS(r.HostNSPath()))
		if err != nil {
			return fmt.Errorf("netlink in %s: %w", r.HostNS, err)
		}
		defer h.Close()
		nh[k] = h
		l, err := h.LinkByName(f.If)
		if err != nil {
			return fmt.Errorf("link %s in %s: %w", f.If, r.HostNS, err)
		}
		set := h.LinkSetDown
		if up {
			set = h.LinkSetUp
		}
		if err := set(l); err != nil {
			return fmt.Errorf("set %s in %s: %w", f.If, r.HostNS, err)
		}
	}
	if !up {
		return nil
	}
	return f.routes(nh)
}

// mustNS opens the namespace at path; an invalid handle (the error shows
// at its first use) if it cannot.
func mustNS(path string) netns.NsHandle {
	h, err := netns.GetFromPath(path)
	if err != nil {
		return netns.None()
	}
	return h
}

// Find returns the namespace path of a target named as shunt-rig exec
// names it: "h1" or "h2" for a host, "h1/g2" for a guest of a host.
func (f *Fabric) Find(target string) (string, error) {
	host, guest, _ := strings.Cut(target, "/")
	for k, r := range f.Hosts {
		if host != fmt.Sprintf("h%d", k+1) {
			continue
		}
		if guest == "" {
			return r.HostNSPath(), nil
		}
		for _, g := range r.Guests {
			if g.Name == guest {
				return g.NSPath(), nil
			}
		}
	}
	return "", fmt.Errorf("no %q in fabric %s: want h1, h2, or a guest of one such as h1/g1", target, f.Name)
}

// Destroy removes both hosts (the fabric veth goes with their
// namespaces). Removing a fabric that does not exist is not an error.
func (f *Fabric) Destroy() error {
	var errs []error
	for _, r := range f.Hosts {
		errs = append(errs, r.Destroy())
	}
	return errors.Join(errs...)
}
