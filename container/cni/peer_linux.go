package cni

import (
	"fmt"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// HostPeer finds the host end of the container's interface ifname in the
// namespace at nsPath: the veth peer in the plugin's own namespace (the
// host's, as the runtime runs it). bridged reports that the end is a
// bridge port: then packets reach the host's IP layer by the bridge, not
// by it, and hostd cannot mark the container's connections by it.
func HostPeer(nsPath, ifname string) (string, bool, error) {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return "", false, fmt.Errorf("open netns %s: %w", nsPath, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return "", false, err
	}
	defer h.Close()
	l, err := h.LinkByName(ifname)
	if err != nil {
		return "", false, fmt.Errorf("%s in %s: %w", ifname, nsPath, err)
	}
	if l.Type() != "veth" || l.Attrs().ParentIndex == 0 {
		return "", false, fmt.Errorf("%s is a %s, not a veth: name no interface (\"interface\": \"none\")", ifname, l.Type())
	}
	peer, err := netlink.LinkByIndex(l.Attrs().ParentIndex)
	if err != nil {
		return "", false, fmt.Errorf("the host end of %s (ifindex %d): %w", ifname, l.Attrs().ParentIndex, err)
	}
	return peer.Attrs().Name, peer.Attrs().MasterIndex != 0, nil
}
