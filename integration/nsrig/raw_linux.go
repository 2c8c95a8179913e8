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
// host namespace with hostAddr, ifname in the guest's with guestAddr (/24
// for IPv4, /64 for IPv6), both up. Tests use it to send a guest's packets in by an interface that
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

// SendTCP sends one hand-made TCP segment (IPv4 or IPv6, as src and dst
// are: IPv4-mapped addresses go in an IPv6 header) from inside the namespace at nsPath, with any source address, out
// of interface dev ("": as routed): flags are TCP flag bits (0x02 SYN,
// 0x10 ACK), seq its sequence number. The checksum is right, so
// conntrack takes the segment as valid. For tests of spoofing.
func SendTCP(nsPath, dev string, src, dst netip.AddrPort, flags uint8, seq uint32) error {
	if src.Addr().Is4() != dst.Addr().Is4() {
		return fmt.Errorf("SendTCP: one IPv4 and one IPv6 address (%s -> %s)", src, dst)
	}
	var (
		family int
		pkt    []byte
		to     unix.Sockaddr
	)
	if dst.Addr().Is4() {
		family, pkt, to = unix.AF_INET, tcpSegment(src, dst, flags, seq), &unix.SockaddrInet4{Addr: dst.Addr().As4()}
	} else {
		// IPPROTO_RAW on an AF_INET6 socket takes the IPv6 header from
		// the caller (IPV6_HDRINCL, Linux 4.5 and later).
		family, pkt, to = unix.AF_INET6, tcpSegment6(src, dst, flags, seq), &unix.SockaddrInet6{Addr: dst.Addr().As16()}
	}
	return In(nsPath, func() error {
		fd, err := unix.Socket(family, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
		if err != nil {
			return fmt.Errorf("raw socket: %w", err)
		}
		defer unix.Close(fd)
		if dev != "" {
			if err := unix.BindToDevice(fd, dev); err != nil {
				return fmt.Errorf("raw socket on %s: %w", dev, err)
			}
		}
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
	tcpHeader(b[20:], src, dst, flags, seq, pseudoSum(s[:], d[:]))
	return b
}

// tcpSegment6 is an IPv6 header (40 bytes) and a TCP header (20 bytes).
func tcpSegment6(src, dst netip.AddrPort, flags uint8, seq uint32) []byte {
	b := make([]byte, 60)
	s, d := src.Addr().As16(), dst.Addr().As16()
	b[0] = 0x60
	binary.BigEndian.PutUint16(b[4:], 20) // payload length
	b[6], b[7] = unix.IPPROTO_TCP, 64     // next header, hop limit
	copy(b[8:], s[:])
	copy(b[24:], d[:])
	tcpHeader(b[40:], src, dst, flags, seq, pseudoSum(s[:], d[:]))
	return b
}

// pseudoSum is the checksum's sum over the pseudo header of a 20-byte TCP
// header: source, destination, protocol, TCP length (RFC 793, RFC 8200).
func pseudoSum(s, d []byte) uint32 {
	sum := uint32(unix.IPPROTO_TCP) + 20
	for i := 0; i+1 < len(s); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(s[i:])) + uint32(binary.BigEndian.Uint16(d[i:]))
	}
	return sum
}

// tcpHeader fills t (20 bytes) with a TCP header and its checksum.
func tcpHeader(t []byte, src, dst netip.AddrPort, flags uint8, seq uint32, pseudo uint32) {
	binary.BigEndian.PutUint16(t[0:], src.Port())
	binary.BigEndian.PutUint16(t[2:], dst.Port())
	binary.BigEndian.PutUint32(t[4:], seq)
	t[12], t[13] = 5<<4, flags
	binary.BigEndian.PutUint16(t[14:], 64240)
	binary.BigEndian.PutUint16(t[16:], checksum(t, pseudo))
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
