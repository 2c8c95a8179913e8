package integration

import (
	"bytes"
	"context"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/testenv"
)

// IPv6 and dual-stack: every rig guest has an IPv6 address (fd00:77:i::2)
// as well as its IPv4 one. A connection between guests over IPv6 takes
// the fast path as an IPv4 one does; a server on [::] that accepts an
// IPv4 client sees it as ::ffff:a.b.c.d, which the libraries and hostd
// name by its IPv4 conntrack tuple; a policy rule on IPv6 prefixes decides
// IPv6 flows.

// listenNet listens in guest i on network and addr through guestlib; the
// listener is closed when the test ends.
func (e *env) listenNet(i int, network, addr string) *guestlib.Listener {
	e.t.Helper()
	var l *guestlib.Listener
	err := nsrig.In(e.rig.Guests[i-1].NSPath(), func() (err error) {
		lc := guestlib.ListenConfig{Client: e.Clients[i-1]}
		l, err = lc.Listen(context.Background(), network, addr)
		return err
	})
	if err != nil {
		e.t.Fatalf("listen %s %s in g%d: %v", network, addr, i, err)
	}
	e.t.Cleanup(func() { l.Close() })
	return l
}

// dialNet dials addr on network from guest a to listener l and returns
// both ends, closed when the test ends.
func (e *env) dialNet(a int, l *guestlib.Listener, network, addr string) (client, server *guestlib.Conn) {
	e.t.Helper()
	acc := make(chan *guestlib.Conn, 1)
	go func() {
		c, err := l.AcceptShunt()
		if err != nil {
			e.t.Errorf("accept: %v", err)
		}
		acc <- c
	}()
	var c *guestlib.Conn
	err := nsrig.In(e.rig.Guests[a-1].NSPath(), func() (err error) {
		d := guestlib.Dialer{Client: e.Clients[a-1]}
		c, err = d.DialContext(context.Background(), network, addr)
		return err
	})
	if err != nil {
		e.t.Fatalf("dial %s %s from g%d: %v", network, addr, a, err)
	}
	var s *guestlib.Conn
	select {
	case s = <-acc:
	case <-time.After(30 * time.Second):
		c.Close()
		l.Close() // ends the Accept
		e.t.Fatalf("no accept of %s %s from g%d within 30 s; hostd flows: %s", network, addr, a, e.flowsJSON())
	}
	if s == nil {
		e.t.FailNow()
	}
	e.t.Cleanup(func() { c.Close(); s.Close() })
	return c, s
}

// swapSeeded sends n seeded bytes each way between a and b and checks them.
func swapSeeded(t *testing.T, a, b *guestlib.Conn, n int) {
	t.Helper()
	for _, dir := range []struct {
		w, r *guestlib.Conn
		seed byte
	}{{a, b, 1}, {b, a, 2}} {
		src := make([]byte, n)
		rand.NewChaCha8([32]byte{dir.seed}).Read(src)
		errc := make(chan error, 1)
		go func() { _, err := dir.w.Write(src); errc <- err }()
		got := make([]byte, n)
		dir.r.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.ReadFull(dir.r, got); err != nil {
			t.Fatalf("read: %v", err)
		}
		dir.r.SetReadDeadline(time.Time{})
		if err := <-errc; err != nil {
			t.Fatalf("write: %v", err)
		}
		if !bytes.Equal(got, src) {
			t.Fatalf("received bytes differ: crc %08x, want %08x", crc32.ChecksumIEEE(got), crc32.ChecksumIEEE(src))
		}
	}
}

// flowFrom returns hostd's record of the connection whose active end is
// local (as guestlib names it), failing the test if there is none.
func (e *env) flowFrom(local netip.AddrPort) broker.FlowInfo {
	e.t.Helper()
	fl := e.flows()
	for _, f := range fl {
		if f.Src == local.String() {
			return f
		}
	}
	e.t.Fatalf("hostd lists no connection from %s: %+v", local, fl)
	return broker.FlowInfo{}
}

// localAP is c's local address.
func localAP(c net.Conn) netip.AddrPort { return c.LocalAddr().(*net.TCPAddr).AddrPort() }

// TestIPv6GuestToGuest: a guestlib connection from g1 to g2 over IPv6
// (tcp6, both ends on their fd00:77 addresses) reaches the fast path on
// both ends and moves seeded bytes both ways, all on the rings; hostd
// lists it under its IPv6 tuple.
func TestIPv6GuestToGuest(t *testing.T) {
	e := newEnv(t, 2, "")
	g2 := e.rig.Guests[1]
	l := e.listenNet(2, "tcp6", fmt.Sprintf("[%s]:5601", g2.Addr6))
	c, s := e.dialNet(1, l, "tcp6", fmt.Sprintf("[%s]:5601", g2.Addr6))
	settle(t, c, true, 5*time.Second)
	settle(t, s, true, 5*time.Second)
	const n = 4 << 20
	swapSeeded(t, c, s, n)
	if st := c.Stats(); st.RingSent != n || st.TCPSent != 0 || st.RingReceived != n {
		t.Fatalf("client %+v, want all %d bytes each way on the rings", st, n)
	}
	f := e.flowFrom(localAP(c))
	if f.GuestA != "g1" || f.GuestB != "g2" || f.Path != "rings" || f.Dst != "["+g2.Addr6.String()+"]:5601" {
		t.Fatalf("hostd flow %+v; want g1 -> g2 [%s]:5601 on the rings", f, g2.Addr6)
	}
}

// TestIPv6DualStackServer: a server on [::] (network "tcp", dual-stack)
// accepts an IPv4 client and an IPv6 client, both on the fast path. The
// server's kernel names the IPv4 client ::ffff:10.77.1.2; its OPEN must
// match the IPv4 conntrack entry that the client's OPEN names.
func TestIPv6DualStackServer(t *testing.T) {
	e := newEnv(t, 2, "")
	g1, g2 := e.rig.Guests[0], e.rig.Guests[1]
	l := e.listenNet(2, "tcp", "[::]:5602")
	for _, tc := range []struct {
		name, network string
		to, from      netip.Addr
	}{
		{"ipv4-client", "tcp4", g2.Addr, g1.Addr},
		{"ipv6-client", "tcp6", g2.Addr6, g1.Addr6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, s := e.dialNet(1, l, tc.network, netip.AddrPortFrom(tc.to, 5602).String())
			// The server's AF_INET6 socket names an IPv4 client
			// ::ffff:a.b.c.d: the case this test is about.
			ra := s.RemoteAddr().(*net.TCPAddr).AddrPort().Addr()
			if ra.Unmap() != tc.from || tc.from.Is4() != ra.Is4In6() {
				t.Fatalf("server sees the client as %s, want %s (IPv4-mapped for an IPv4 client)", ra, tc.from)
			}
			settle(t, c, true, 5*time.Second)
			settle(t, s, true, 5*time.Second)
			swapSeeded(t, c, s, 1<<20)
			if st := s.Stats(); st.RingSent != 1<<20 || st.TCPSent != 0 {
				t.Fatalf("server %+v, want all bytes on the ring", st)
			}
			f := e.flowFrom(localAP(c))
			if f.Path != "rings" || f.Dst != netip.AddrPortFrom(tc.to, 5602).String() {
				t.Fatalf("hostd flow %+v; want one to %s on the rings", f, netip.AddrPortFrom(tc.to, 5602))
			}
		})
	}
}

// TestIPv6PolicyTCP: a rule on IPv6 prefixes with action tcp keeps IPv6
// flows to g2 on TCP (reason policy) while IPv4 flows between the same
// guests, which it does not match, take the fast path; a reload that
// drops the rule moves the IPv6 flow to the rings.
func TestIPv6PolicyTCP(t *testing.T) {
	const rule = `rule "v6-on-tcp" {
  action = "tcp"
  from   = ["fd00:77::/32"]
  to     = ["fd00:77:2::/64"]
  ports  = ["5603"]
}`
	e := newEnv(t, 2, rule)
	g2 := e.rig.Guests[1]
	l := e.listenNet(2, "tcp", "[::]:5603")
	c6, s6 := e.dialNet(1, l, "tcp6", fmt.Sprintf("[%s]:5603", g2.Addr6))
	c4, s4 := e.dialNet(1, l, "tcp4", fmt.Sprintf("%s:5603", g2.Addr))
	settle(t, c4, true, 5*time.Second)
	settle(t, s4, true, 5*time.Second)
	for _, c := range []*guestlib.Conn{c6, s6} {
		if p := settled(t, c); p.Fast || p.Reason != "policy" {
			t.Fatalf("IPv6 end: path %s, want tcp (policy)", p)
		}
	}
	swapSeeded(t, c6, s6, 256<<10)
	if st := c6.Stats(); st.RingSent != 0 || st.TCPSent != 256<<10 {
		t.Fatalf("IPv6 client %+v, want every byte on TCP", st)
	}
	if f := e.flowFrom(localAP(c6)); f.Path != "tcp" || f.Reason != "policy" || f.Rule != "v6-on-tcp" {
		t.Fatalf("hostd flow %+v; want tcp (policy) by rule v6-on-tcp", f)
	}
	// Without the rule, the IPv6 connection moves to the rings.
	if _, err := e.SetPolicy(""); err != nil {
		t.Fatal(err)
	}
	settle(t, c6, true, 5*time.Second)
	settle(t, s6, true, 5*time.Second)
	swapSeeded(t, c6, s6, 256<<10)
	if st := c6.Stats(); st.RingSent == 0 {
		t.Fatalf("IPv6 client %+v, want bytes on the rings after the reload", st)
	}
}

// TestIPv6PreloadIperf3: unmodified iperf3 under shunt-run, its server
// on [::] (its default: one AF_INET6 socket, not IPv6-only), a client
// over IPv6 (-6) and then one over IPv4 (-4, which the server's kernel
// names ::ffff:10.77.1.2). Both of each run's connections (control and
// data) take the fast path on both ends: the library's "shunt (slot"
// lines on each side, flows in hostd; and iperf3 reports its bytes.
func TestIPv6PreloadIperf3(t *testing.T) {
	e := newEnv(t, 2, "")
	g2 := e.rig.Guests[1]
	srv := &lockedBuffer{} // iperf3 writes it while the test reads it
	cmd := e.guestCmd(2, "iperf3", "-s", "-p", "5611")
	cmd.Stdout, cmd.Stderr = srv, srv
	if err := nsrig.Start(g2.NSPath(), cmd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	e.waitListening(2, 5611)
	for i, tc := range []struct{ family, to string }{{"-6", g2.Addr6.String()}, {"-4", g2.Addr.String()}} {
		var out string
		flows := e.ringsMoved(func() {
			out = e.run(1, e.guestCmd(1, "iperf3", tc.family, "-c", tc.to, "-p", "5611", "-t", "1", "-J"))
		})
		res, err := parseIperf3(out)
		if err != nil || res.Bytes == 0 {
			t.Fatalf("iperf3 %s result: %v\n%s", tc.family, err, out)
		}
		if fastLines(out) < 2 || flows < 2 {
			t.Fatalf("iperf3 %s to %s: %d connections on the fast path, hostd moved %d flows onto the rings; want the control and data connections\n%s",
				tc.family, tc.to, fastLines(out), flows, out)
		}
		// The server's end of each run's connections too.
		eventually(t, 5*time.Second, "the server's fast-path lines", func() bool { return fastLines(srv.String()) >= 2*(i+1) })
		t.Logf("iperf3 %s: %.1f Gbit/s over the fast path", tc.family, res.BitsPerSecond/1e9)
	}
}

// TestIPv6Ownership: with the eBPF witness as the proof of origin (alone,
// and with hostd's marks), IPv6 connections between guests and an IPv4
// client of a [::] server take the fast path: the witness records IPv6
// SYNs, and finds an IPv4 tuple however the socket API named it.
func TestIPv6Ownership(t *testing.T) {
	for _, own := range []string{"witness", "both"} {
		t.Run(own, func(t *testing.T) {
			testenv.NeedRoot(t)
			testenv.NeedTool(t, "nft", "nftables")
			e := startEnv(t, "o", stack.Options{Guests: 2, HostdBin: hostdBin, Extra: fmt.Sprintf("ownership = %q\n", own)})
			g2 := e.rig.Guests[1]
			l := e.listenNet(2, "tcp", "[::]:5604")
			for _, to := range []netip.Addr{g2.Addr6, g2.Addr} {
				c, s := e.dialNet(1, l, "tcp", netip.AddrPortFrom(to, 5604).String())
				settle(t, c, true, 5*time.Second)
				settle(t, s, true, 5*time.Second)
				swapSeeded(t, c, s, 64<<10)
			}
		})
	}
}
