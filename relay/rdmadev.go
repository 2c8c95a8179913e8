package relay

import (
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// RDMADevice is an RDMA device as sysfs shows it (/sys/class/infiniband),
// for `hostd check`-style reports and for picking the link's port. It
// needs no library: a host without rdma-core shows its devices (or none).
type RDMADevice struct {
	Name  string
	Ports []RDMAPort
}

// RDMAPort is one port of a device.
type RDMAPort struct {
	Num       int
	State     string // "ACTIVE", "DOWN", ...
	LinkLayer string // "Ethernet" (RoCE) or "InfiniBand"
	GIDs      []RDMAGID
}

// RDMAGID is one non-zero entry of a port's GID table.
type RDMAGID struct {
	Index  int
	GID    netip.Addr
	Type   string // "RoCE v2", "IB/RoCE v1"
	Netdev string // the network interface it belongs to (RoCE)
}

// RDMADevices lists the devices under root ("" = /sys/class/infiniband);
// none (and no error) when the directory is missing.
func RDMADevices(root string) ([]RDMADevice, error) {
	if root == "" {
		root = "/sys/class/infiniband"
	}
	ents, err := os.ReadDir(root)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var devs []RDMADevice
	for _, e := range ents {
		d := RDMADevice{Name: e.Name()}
		ports, _ := os.ReadDir(filepath.Join(root, e.Name(), "ports"))
		for _, p := range ports {
			num, err := strconv.Atoi(p.Name())
			if err != nil {
				continue
			}
			dir := filepath.Join(root, e.Name(), "ports", p.Name())
			port := RDMAPort{Num: num, State: sysword(filepath.Join(dir, "state")), LinkLayer: sysword(filepath.Join(dir, "link_layer"))}
			if i := strings.IndexByte(port.State, ' '); i >= 0 { // "4: ACTIVE"
				port.State = port.State[i+1:]
			}
			gids, _ := os.ReadDir(filepath.Join(dir, "gids"))
			for _, g := range gids {
				idx, err := strconv.Atoi(g.Name())
				if err != nil {
					continue
				}
				a, ok := parseGID(sysword(filepath.Join(dir, "gids", g.Name())))
				if !ok || a.IsUnspecified() {
					continue
				}
				port.GIDs = append(port.GIDs, RDMAGID{Index: idx, GID: a,
					Type:   sysword(filepath.Join(dir, "gid_attrs", "types", g.Name())),
					Netdev: sysword(filepath.Join(dir, "gid_attrs", "ndevs", g.Name()))})
			}
			sort.Slice(port.GIDs, func(i, j int) bool { return port.GIDs[i].Index < port.GIDs[j].Index })
			d.Ports = append(d.Ports, port)
		}
		sort.Slice(d.Ports, func(i, j int) bool { return d.Ports[i].Num < d.Ports[j].Num })
		devs = append(devs, d)
	}
	return devs, nil
}

// sysword is a sysfs file's first line ("" if unreadable: an unused GID
// entry's attributes cannot be read).
func sysword(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	s, _, _ := strings.Cut(string(b), "\n")
	return strings.TrimSpace(s)
}

// parseGID reads sysfs's "fe80:0000:...:0001" (eight groups).
func parseGID(s string) (netip.Addr, bool) {
	a, err := netip.ParseAddr(s)
	return a, err == nil && a.Is6()
}

// PickRDMA picks the device (named, or the first with one), port and GID
// index an RDMA link uses: an active port; on RoCE a RoCE v2 GID of an
// IPv4 address first (routable, what rxe and most fabrics use), then any
// RoCE v2 GID, then the first; on InfiniBand, GID 0.
func PickRDMA(devs []RDMADevice, name string) (dev string, port, gid int, ok bool) {
	for _, d := range devs {
		if name != "" && d.Name != name {
			continue
		}
		for _, p := range d.Ports {
			if p.State != "ACTIVE" || len(p.GIDs) == 0 {
				continue
			}
			if p.LinkLayer == "InfiniBand" {
				return d.Name, p.Num, 0, true
			}
			best, score := p.GIDs[0].Index, 0
			for _, g := range p.GIDs {
				s := 0
				if g.Type == "RoCE v2" {
					s = 1
					if g.GID.Is4In6() {
						s = 2
					}
				}
				if s > score {
					best, score = g.Index, s
				}
			}
			return d.Name, p.Num, best, true
		}
	}
	return "", 0, 0, false
}
