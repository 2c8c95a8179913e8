//go:build linux

package mark_test

import (
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/integration/nsrig"
)

// TestProofSpoofedByPeer shows what the proof bits prove: that a packet
// with the connection's tuple passed the filter, not by which port it
// came. The operator cuts g1 off (iifname of g1's port: drop). g2, g1's
// peer, knows the connection's sequence numbers from its own socket and
// sends, from its own port, a packet that claims to be g1's; the host
// (no strict reverse-path filter) forwards it back to g2, past the rule,
// and it sets the original direction's bit. g2's own packets set the
// reply bit: both bits, while every packet g1 sends is dropped.
func TestProofSpoofedByPeer(t *testing.T) {
	r, ct, f := proofRig(t, "prs")
	g1, g2 := r.Guests[0], r.Guests[1]
	var l net.Listener
	if err := nsrig.In(g2.NSPath(), func() (err error) {
		l, err = net.Listen("tcp4", netip.AddrPortFrom(g2.Addr, 0).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c := g1.Dial(t, l.Addr().(*net.TCPAddr).AddrPort())
	defer c.Close()
	_ = l.(*net.TCPListener).SetDeadline(time.Now().Add(5 * time.Second))
	s, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := c.Write([]byte{1}); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(s, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // g2's ACK
	src, dst := c.LocalAddr().(*net.TCPAddr).AddrPort(), c.RemoteAddr().(*net.TCPAddr).AddrPort()
	tu := ctrack.Tuple{Src: src, Dst: dst}

	// The operator cuts g1 off by its port.
	for _, args := range [][]string{{"add", "table", "inet", "op_cut"},
		{"add", "chain", "inet", "op_cut", "fw", "{ type filter hook forward priority -5 ; }"},
		{"add", "rule", "inet", "op_cut", "fw", "iifname", g1.HostIf, "counter", "drop"}} {
		if _, err := nsrig.Run(r.HostNSPath(), "nft", args...); err != nil {
			t.Fatal(err)
		}
	}
	if err := ct.ClearMark(tu, f.Proof()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte{2}); err != nil { // g1's byte: dropped
		t.Fatal(err)
	}
	if _, err := s.Write([]byte{3}); err != nil { // g2's own byte: passes; g1's ACK does not
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if e, _ := ct.Lookup(tu); e.Mark&f.Proof() != f.PassReply() {
		t.Fatalf("with g1 cut off: proof bits %#x, want only the reply's %#x", e.Mark&f.Proof(), f.PassReply())
	}

	// g2: its socket's next expected and next sent sequence numbers.
	rcvNxt, sndNxt := repairSeqs(t, s)
	var hostMAC, myMAC net.HardwareAddr
	if err := nsrig.In(r.HostNSPath(), func() error {
		i, err := net.InterfaceByName(g2.HostIf)
		if err == nil {
			hostMAC = i.HardwareAddr
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if err := nsrig.In(g2.NSPath(), func() error {
		i, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		myMAC = i.HardwareAddr
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		frame := forgedACK(hostMAC, myMAC, src, dst, rcvNxt, sndNxt)
		return unix.Sendto(fd, frame, 0, &unix.SockaddrLinklayer{Ifindex: i.Index, Halen: 6, Protocol: htons(unix.ETH_P_IP)})
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	e, err := ct.Lookup(tu)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("g1 cut off by its port; proof bits after g2 forged one of g1's packets: %#x (both: %#x)", e.Mark&f.Proof(), f.Proof())
	if !f.Passed(e.Mark) {
		t.Fatalf("proof bits %#x: the forged packet did not prove passage (update docs/SECURITY.md)", e.Mark&f.Proof())
	}
}

// repairSeqs reads a connected socket's next expected and next sent
// sequence numbers (TCP_REPAIR: CAP_NET_ADMIN).
func repairSeqs(t *testing.T, c net.Conn) (rcvNxt, sndNxt uint32) {
	t.Helper()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	_ = raw.Control(func(fd uintptr) {
		get := func(q int) uint32 {
			if serr == nil {
				serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_REPAIR_QUEUE, q)
			}
			v, err := unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_QUEUE_SEQ)
			if serr == nil {
				serr = err
			}
			return uint32(v)
		}
		if serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_REPAIR, 1); serr != nil {
			return
		}
		rcvNxt, sndNxt = get(1), get(2)                                                             // TCP_RECV_QUEUE, TCP_SEND_QUEUE
		if err := unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_REPAIR, -1); serr == nil { // TCP_REPAIR_OFF_NO_WP
			serr = err
		}
	})
	if serr != nil {
		t.Fatalf("TCP_REPAIR: %v", serr)
	}
	return rcvNxt, sndNxt
}

// forgedACK is an Ethernet frame of an IPv4 TCP ACK from src to dst.
func forgedACK(dstMAC, srcMAC net.HardwareAddr, src, dst netip.AddrPort, seq, ack uint32) []byte {
	b := make([]byte, 14+20+20)
	copy(b, dstMAC)
	copy(b[6:], srcMAC)
	binary.BigEndian.PutUint16(b[12:], unix.ETH_P_IP)
	ip := b[14:34]
	ip[0], ip[8], ip[9] = 0x45, 64, unix.IPPROTO_TCP
	binary.BigEndian.PutUint16(ip[2:], 40)
	s4, d4 := src.Addr().As4(), dst.Addr().As4()
	copy(ip[12:], s4[:])
	copy(ip[16:], d4[:])
	binary.BigEndian.PutUint16(ip[10:], csum(ip, 0))
	tcp := b[34:]
	binary.BigEndian.PutUint16(tcp[0:], src.Port())
	binary.BigEndian.PutUint16(tcp[2:], dst.Port())
	binary.BigEndian.PutUint32(tcp[4:], seq)
	binary.BigEndian.PutUint32(tcp[8:], ack)
	tcp[12], tcp[13] = 5<<4, 0x10 // ACK
	binary.BigEndian.PutUint16(tcp[14:], 1024)
	pseudo := uint32(0)
	for i := 0; i < 4; i += 2 {
		pseudo += uint32(binary.BigEndian.Uint16(s4[i:])) + uint32(binary.BigEndian.Uint16(d4[i:]))
	}
	pseudo += unix.IPPROTO_TCP + 20
	binary.BigEndian.PutUint16(tcp[16:], csum(tcp, pseudo))
	return b
}

func csum(b []byte, sum uint32) uint16 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }
