//go:build linux

package nsrig

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// AddLink joins guest g to the host by one more veth pair: hostIf in the
// host namespace with hostAddr/24, ifname in the guest's with guestAddr/24,
// both up. Tests use it to send a guest's packets in by an interface that
// is not the guest's own (a second NIC, or another guest's path).
func (r *Rig) AddLink(g *Guest, hostIf, ifname string, hostAddr, guestAddr netip.Addr) error {
	host, gns, err := r.namespaces(g)
	if err != nil {
		return err
	}
	defer host.Close()
	defer gns.Close()
	hh, err := netlink.NewHandleAt(host)
	if err != nil {
		return err
	}
	defer hh.Close()
	gh, err := netlink.NewHandleAt(gns)
	if err != nil {
		return err
	}
	defer gh.Close()
	veth := &netlink.Veth{
		LinkAttrs: netlink.LinkAttrs{Name: hostIf, Namespace: netlink.NsFd(host)},
		PeerName:  ifname, PeerNamespace: netlink.NsFd(gns),
	}
	if err := hh.LinkAdd(veth); err != nil {
		return fmt.Errorf("veth %s: %w", hostIf, err)
	}
	if err := addAddr(hh, hostIf, hostAddr); err != nil {
		return err
	}
	if err := addAddr(gh, ifname, guestAddr); err != nil {
		return err
	}
	if err := linkUp(hh, hostIf); err != nil {
		return err
	}
	return linkUp(gh, ifname)
}

// SendTCP sends one hand-made IPv4 TCP segment from inside the namespace
// at nsPath, with any source address, out of interface dev ("": as routed):
// flags are TCP flag bits (0x02 SYN, 0x10 ACK), seq its sequence number.
// The checksum is right, so conntrack takes the segment as valid. For
// tests of spoofing.
func SendTCP(nsPath, dev string, src, dst netip.AddrPort, flags uint8, seq uint32) error {
	if !src.Addr().Is4() || !dst.Addr().Is4() {
		return fmt.Errorf("SendTCP: IPv4 only (%s -> %s)", src, dst)
	}
	pkt := tcpSegment(src, dst, flags, seq)
	return In(nsPath, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
		if err != nil {
			return fmt.Errorf("raw socket: %w", err)
		}
		defer unix.Close(fd)
		if dev != "" {
			if err := unix.BindToDevice(fd, dev); err != nil {
				return fmt.Errorf("raw socket on %s: %w", dev, err)
			}
		}
		to := &unix.SockaddrInet4{Addr: dst.Addr().As4()}
		if err := unix.Sendto(fd, pkt, 0, to); err != nil {
			return fmt.Errorf("send raw segment %s -> %s: %w", src, dst, err)
		}
		return nil
	})
}

// tcpSegment is an IPv4 header (20 bytes) and a TCP header (20 bytes).
func tcpSegment(src, dst netip.AddrPort, flags uint8, seq uint32) []byte {
	b := make([]byte, 40)
	s, d := src.Addr().As4(), dst.Addr().As4()
	b[0], b[8], b[9] = 0x45, 64, unix.IPPROTO_TCP
	binary.BigEndian.PutUint16(b[2:], 40)
	copy(b[12:], s[:])
	copy(b[16:], d[:])
	binary.BigEndian.PutUint16(b[10:], checksum(b[:20], 0))
	t := b[20:]
	binary.BigEndian.PutUint16(t[0:], src.Port())
	binary.BigEndian.PutUint16(t[2:], dst.Port())
	binary.BigEndian.PutUint32(t[4:], seq)
	t[12], t[13] = 5<<4, flags
	binary.BigEndian.PutUint16(t[14:], 64240)
	// The pseudo header: source, destination, protocol, TCP length.
	pseudo := uint32(unix.IPPROTO_TCP) + 20
	for i := 0; i < 4; i += 2 {
		pseudo += uint32(binary.BigEndian.Uint16(s[i:])) + uint32(binary.BigEndian.Uint16(d[i:]))
	}
	binary.BigEndian.PutUint16(t[16:], checksum(t, pseudo))
	return b
}

func checksum(b []byte, sum uint32) uint16 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

func netnsAt(path string) (netns.NsHandle, error) {
	h, err := netns.GetFromPath(path)
	if err != nil {
		return 0, fmt.Errorf("open netns %s: %w", path, err)
	}
	return h, nil
}

// namespaces opens the host's namespace and guest g's: the caller closes
// both.
func (r *Rig) namespaces(g *Guest) (host, gns netns.NsHandle, err error) {
	if host, err = netnsAt(r.HostNSPath()); err != nil {
		return 0, 0, err
	}
	if gns, err = netnsAt(g.NSPath()); err != nil {
		host.Close()
		return 0, 0, err
	}
	return host, gns, nil
}

// Relink replaces guest g's veth pair with a new one of the same names,
// addresses and routes, as a container restarted with a new veth has: the
// host-side interface keeps its name and gets a new index.
func (r *Rig) Relink(g *Guest) error {
	host, gns, err := r.namespaces(g)
	if err != nil {
		return err
	}
	defer host.Close()
	defer gns.Close()
	hh, err := netlink.NewHandleAt(host)
	if err != nil {
		return err
	}
	defer hh.Close()
	old, err := hh.LinkByName(g.HostIf)
	if err != nil {
		return fmt.Errorf("link %s: %w", g.HostIf, err)
	}
	if err := hh.LinkDel(old); err != nil {
		return fmt.Errorf("delete %s: %w", g.HostIf, err)
	}
	return r.linkGuest(hh, host, gns, g)
}
