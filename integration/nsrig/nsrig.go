//go:build linux

package nsrig

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/nsexec"
)

// Guest is one guest namespace.
type Guest struct {
	Index     int
	Name      string     // g1, g2, ...
	NS        string     // netns name
	Addr      netip.Addr // the guest's IPv4 address
	HostAddr  netip.Addr // the host side of its veth (IPv4)
	Addr6     netip.Addr // the guest's IPv6 address (ULA, fd00:77:i::2/64)
	HostAddr6 netip.Addr // the host side of its veth (IPv6)
	HostIf    string     // the host side interface name
}

// v6 is address host of guest i's link, fd00:NN:i::/64 with NN the
// rig's subnet (77, or 78 for a fabric's second host; i in hex: g10's is
// fd00:77:a::/64), a unique local address (RFC 4193) never routed off the
// rig.
func v6(subnet byte, i int, host byte) netip.Addr {
	return netip.AddrFrom16([16]byte{0xfd, 0x00, 0x00, v6Group(subnet), byte(i >> 8), byte(i), 15: host})
}

// v6Group is the IPv6 group that reads as the IPv4 subnet does: 0x77 for
// 77 (fd00:77::), 0x78 for 78.
func v6Group(subnet byte) byte { return 0x77 + (subnet - 77) }

// NSPath is the guest namespace's bind-mount path.
func (g *Guest) NSPath() string { return filepath.Join(runDir, g.NS) }

// Rig is a created rig.
type Rig struct {
	Name   string
	HostNS string // netns name of the host
	Guests []*Guest
	// Subnet is the second octet of the guests' IPv4 addresses (10.77.i.2;
	// a fabric's second host has 78) and the second group of their IPv6
	// ones (fd00:77:i::2).
	Subnet byte
}

// HostNSPath is the host namespace's bind-mount path.
func (r *Rig) HostNSPath() string { return filepath.Join(runDir, r.HostNS) }

// New describes a rig with n guests; Create makes it.
func New(name string, n int) (*Rig, error) { return newRig(name, n, 77) }

// newRig describes a rig whose guests are in 10.SUBNET.0.0/16 and
// fd00:SUBNET::/32.
func newRig(name string, n int, subnet byte) (*Rig, error) {
	if len(name) == 0 || len(name) > 8 || strings.ContainsAny(name, " /") {
		return nil, fmt.Errorf("rig name %q: want 1 to 8 characters, no spaces or slashes", name)
	}
	if n < 1 || n > 200 {
		return nil, fmt.Errorf("rig guests %d: want 1 to 200", n)
	}
	r := &Rig{Name: name, HostNS: "shunt-" + name + "-host", Subnet: subnet}
	for i := 1; i <= n; i++ {
		r.Guests = append(r.Guests, &Guest{
			Index: i, Name: fmt.Sprintf("g%d", i), NS: fmt.Sprintf("shunt-%s-g%d", name, i),
			Addr:      netip.AddrFrom4([4]byte{10, subnet, byte(i), 2}),
			HostAddr:  netip.AddrFrom4([4]byte{10, subnet, byte(i), 1}),
			Addr6:     v6(subnet, i, 2),
			HostAddr6: v6(subnet, i, 1),
			HostIf:    fmt.Sprintf("sh-%s-%d", name, i),
		})
	}
	return r, nil
}

// Create builds the rig, removing leftovers of a rig with the same name
// first. On failure it removes what it made.
func (r *Rig) Create() (err error) {
	if os.Geteuid() != 0 {
		return errors.New("the namespace rig needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN): run as root")
	}
	_ = r.Destroy()
	defer func() {
		if err != nil {
			_ = r.Destroy()
		}
	}()
	host, err := newNamed(r.HostNS)
	if err != nil {
		return err
	}
	defer host.Close()
	hh, err := netlink.NewHandleAt(host)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", r.HostNS, err)
	}
	defer hh.Close()
	if err := linkUp(hh, "lo"); err != nil {
		return err
	}
	if err := r.In(r.HostNSPath(), func() error {
		return sysctls(map[string]string{
			"net/ipv4/ip_forward":                "1",
			"net/ipv6/conf/all/forwarding":       "1",
			"net/ipv6/conf/default/disable_ipv6": "0",
			"net/ipv6/conf/default/accept_dad":   "0",
		})
	}); err != nil {
		return fmt.Errorf("enable forwarding in %s: %w", r.HostNS, err)
	}
	for _, g := range r.Guests {
		if err := r.addGuest(hh, host, g); err != nil {
			return fmt.Errorf("guest %s: %w", g.Name, err)
		}
	}
	return r.Firewall("")
}

func (r *Rig) addGuest(hh *netlink.Handle, host netns.NsHandle, g *Guest) error {
	gns, err := newNamed(g.NS)
	if err != nil {
		return err
	}
	defer gns.Close()
	// IPv6 on, and no duplicate address detection on the links made
	// later (their link-local addresses too): an address still tentative
	// cannot be bound or used, and the rig's addresses are unique by
	// construction.
	if err := In(g.NSPath(), func() error {
		return sysctls(map[string]string{"net/ipv6/conf/default/disable_ipv6": "0", "net/ipv6/conf/default/accept_dad": "0"})
	}); err != nil {
		return fmt.Errorf("IPv6 settings in %s: %w", g.NS, err)
	}
	return r.linkGuest(hh, host, gns, g)
}

// sysctls writes each /proc/sys/ key in the calling thread's network
// namespace.
func sysctls(kv map[string]string) error {
	for k, v := range kv {
		if err := os.WriteFile("/proc/sys/"+k, []byte(v), 0o644); err != nil {
			if errors.Is(err, os.ErrNotExist) && strings.HasPrefix(k, "net/ipv6/") {
				return fmt.Errorf("%w: the rig's guests are dual-stack; boot without ipv6.disable=1", err)
			}
			return err
		}
	}
	return nil
}

// linkGuest joins guest namespace gns to the host by g's veth pair, with
// its addresses and the guest's default route.
func (r *Rig) linkGuest(hh *netlink.Handle, host, gns netns.NsHandle, g *Guest) error {
	gh, err := netlink.NewHandleAt(gns)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", g.NS, err)
	}
	defer gh.Close()
	veth := &netlink.Veth{
		LinkAttrs: netlink.LinkAttrs{Name: g.HostIf, Namespace: netlink.NsFd(host)},
		PeerName:  "eth0", PeerNamespace: netlink.NsFd(gns),
	}
	// Create in the host namespace directly, the peer in the guest's.
	if err := hh.LinkAdd(veth); err != nil {
		return fmt.Errorf("veth %s: %w", g.HostIf, err)
	}
	for _, a := range []struct {
		h      *netlink.Handle
		ifname string
		addr   netip.Addr
	}{{hh, g.HostIf, g.HostAddr}, {hh, g.HostIf, g.HostAddr6}, {gh, "eth0", g.Addr}, {gh, "eth0", g.Addr6}} {
		if err := addAddr(a.h, a.ifname, a.addr); err != nil {
			return err
		}
	}
	for _, name := range []string{"lo", "eth0"} {
		if err := linkUp(gh, name); err != nil {
			return err
		}
	}
	if err := linkUp(hh, g.HostIf); err != nil {
		return err
	}
	eth0, err := gh.LinkByName("eth0")
	if err != nil {
		return err
	}
	for _, gw := range []netip.Addr{g.HostAddr, g.HostAddr6} {
		rt := &netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: net.IP(gw.AsSlice())}
		if gw.Is6() {
			rt.Family = netlink.FAMILY_V6
			rt.Dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
		}
		if err := gh.RouteAdd(rt); err != nil {
			return fmt.Errorf("default route via %s in %s: %w", gw, g.NS, err)
		}
	}
	return nil
}

// addAddr puts a on interface ifname: an IPv4 address as a /24, an IPv6
// one as a /64 without duplicate address detection (nodad: usable at
// once, not tentative).
func addAddr(h *netlink.Handle, ifname string, a netip.Addr) error {
	l, err := h.LinkByName(ifname)
	if err != nil {
		return fmt.Errorf("link %s: %w", ifname, err)
	}
	ipn := &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(24, 32)}
	var flags int
	if a.Is6() {
		ipn.Mask, flags = net.CIDRMask(64, 128), unix.IFA_F_NODAD
	}
	if err := h.AddrAdd(l, &netlink.Addr{IPNet: ipn, Flags: flags}); err != nil {
		return fmt.Errorf("address %s on %s: %w", a, ifname, err)
	}
	return nil
}

func linkUp(h *netlink.Handle, ifname string) error {
	l, err := h.LinkByName(ifname)
	if err != nil {
		return fmt.Errorf("link %s: %w", ifname, err)
	}
	if err := h.LinkSetUp(l); err != nil {
		return fmt.Errorf("set %s up: %w", ifname, err)
	}
	return nil
}

// newNamed creates a named network namespace without leaving the calling
// thread in it.
func newNamed(name string) (netns.NsHandle, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return 0, fmt.Errorf("current netns: %w", err)
	}
	defer orig.Close()
	if err := shareRunDir(); err != nil {
		return 0, err
	}
	ns, err := netns.NewNamed(name)
	if err != nil {
		return 0, fmt.Errorf("create netns %s: %w", name, err)
	}
	if err := netns.Set(orig); err != nil {
		ns.Close()
		return 0, fmt.Errorf("return from netns %s: %w", name, err)
	}
	return ns, nil
}

// runDir is where named namespaces are bound, by nsrig and by iproute2.
const runDir = "/run/netns"

// shareRunDir makes runDir a shared mount point before the first namespace
// is bound there, as iproute2's `ip netns add` does. Otherwise the first
// `ip netns add` after nsrig bind-mounts runDir over itself and hides
// nsrig's namespaces beneath it, and deleting them fails with EBUSY. With
// it, either tool can list and delete the other's namespaces.
func shareRunDir() error {
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", runDir, err)
	}
	made := false
	for {
		err := unix.Mount("", runDir, "none", unix.MS_SHARED|unix.MS_REC, "")
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EINVAL) || made {
			return fmt.Errorf("make %s a shared mount: %w", runDir, err)
		}
		// Not a mount point yet: make it one, then share it.
		if err := unix.Mount(runDir, runDir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s onto itself: %w", runDir, err)
		}
		made = true
	}
}

// In runs fn on an OS thread that is inside the namespace at nsPath.
// Sockets fn creates stay in that namespace after fn returns, and processes
// it starts are born there.
func (r *Rig) In(nsPath string, fn func() error) error { return In(nsPath, fn) }

// In runs fn on an OS thread inside the namespace at nsPath (see
// internal/nsexec).
func In(nsPath string, fn func() error) error { return nsexec.In(nsPath, fn) }

// Start starts cmd inside the namespace at nsPath (use it instead of
// cmd.Start).
func Start(nsPath string, cmd *exec.Cmd) error {
	return In(nsPath, cmd.Start)
}

// Run runs a command in the namespace and returns its combined output.
func Run(nsPath string, name string, args ...string) (string, error) {
	var out bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := Start(nsPath, cmd); err != nil {
		return "", err
	}
	err := cmd.Wait()
	if err != nil {
		err = fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.String(), err
}

// Firewall replaces the rig's nftables table (the operator's firewall; it
// leaves hostd's own table alone). extra goes into the forward chain after
// the rule every rig has: established flows pass. nat goes into a nat
// prerouting chain (DNAT rules). The rig stamps no conntrack marks: hostd
// marks each guest's new connections itself (hostd/mark).
func (r *Rig) Firewall(extra string, nat ...string) error {
	var b strings.Builder
	b.WriteString("table inet shunt_rig\ndelete table inet shunt_rig\ntable inet shunt_rig {\n")
	b.WriteString("  chain forward {\n    type filter hook forward priority 0; policy accept;\n")
	b.WriteString("    ct state established,related accept\n")
	if extra != "" {
		b.WriteString("    " + extra + "\n")
	}
	b.WriteString("  }\n  chain prerouting {\n    type nat hook prerouting priority -100; policy accept;\n")
	for _, n := range nat {
		b.WriteString("    " + n + "\n")
	}
	b.WriteString("  }\n}\n")
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(b.String())
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := Start(r.HostNSPath(), cmd); err != nil {
		return fmt.Errorf("nft: %w (is nftables installed? apt-get install nftables)", err)
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("nft ruleset: %w: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

// Destroy removes the rig's namespaces (and with them their veths, rules
// and conntrack tables). Removing a rig that does not exist is not an error.
func (r *Rig) Destroy() error {
	var errs []error
	for _, name := range append([]string{r.HostNS}, r.nsNames()...) {
		if _, err := os.Stat(filepath.Join(runDir, name)); err != nil {
			continue
		}
		if err := netns.DeleteNamed(name); err != nil {
			errs = append(errs, fmt.Errorf("delete netns %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

func (r *Rig) nsNames() []string {
	var out []string
	for _, g := range r.Guests {
		out = append(out, g.NS)
	}
	return out
}
