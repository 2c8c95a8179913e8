//go:build linux

package agent

import (
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/witness"
	"github.com/shuntnet/shunt/internal/nsexec"
)

// guestAddrs returns what a guest owns: its configured addresses, plus the
// subnets routed to its interface (learned with netlink in the conntrack
// namespace), except the host's own addresses on that interface.
func guestAddrs(nsPath string, gc config.Guest) (broker.Addrs, error) {
	var out broker.Addrs
	for _, a := range gc.Addresses {
		out.Prefixes = append(out.Prefixes, netip.PrefixFrom(a, a.BitLen()))
	}
	if gc.Interface == "" {
		return out, nil
	}
	h, err := netlinkHandle(nsPath)
	if err != nil {
		return out, err
	}
	defer h.Close()
	link, err := h.LinkByName(gc.Interface)
	if err != nil {
		return out, fmt.Errorf("guest %s: interface %s: %w", gc.Name, gc.Interface, err)
	}
	routes, err := h.RouteList(link, netlink.FAMILY_ALL)
	if err != nil {
		return out, fmt.Errorf("guest %s: routes of %s: %w", gc.Name, gc.Interface, err)
	}
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		if p, ok := netip.AddrFromSlice(r.Dst.IP); ok {
			ones, _ := r.Dst.Mask.Size()
			pfx := netip.PrefixFrom(p.Unmap(), ones).Masked()
			if !pfx.Addr().IsLinkLocalUnicast() {
				out.Prefixes = append(out.Prefixes, pfx)
			}
		}
	}
	addrs, err := h.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		return out, fmt.Errorf("guest %s: addresses of %s: %w", gc.Name, gc.Interface, err)
	}
	for _, ad := range addrs {
		if a, ok := netip.AddrFromSlice(ad.IP); ok {
			out.Except = append(out.Except, a.Unmap())
		}
	}
	return out, nil
}

// netlinkHandle is a route netlink handle in nsPath ("" = this one). Route
// only: a handle of every family also opens an XFRM socket, which needs
// xfrm_user, and where modules do not load on demand (a VM host without
// modprobe, TestRDMAHostd) hostd failed to start with "protocol not
// supported".
func netlinkHandle(nsPath string) (*netlink.Handle, error) {
	if nsPath == "" {
		return netlink.NewHandle(unix.NETLINK_ROUTE)
	}
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", nsPath, err)
	}
	defer ns.Close()
	return netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
}

// attachWitness puts the eBPF witness on a guest's host-side interface (in
// the conntrack namespace) and returns the interface's index.
func attachWitness(w *witness.Witness, nsPath, ifname string) (int, error) {
	var idx int
	attach := func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return fmt.Errorf("interface %s: %w", ifname, err)
		}
		idx = l.Attrs().Index
		return w.Attach(idx)
	}
	var err error
	if nsPath == "" {
		err = attach()
	} else {
		err = nsexec.In(nsPath, attach)
	}
	return idx, err
}
