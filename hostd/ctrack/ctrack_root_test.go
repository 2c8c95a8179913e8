//go:build linux

package ctrack_test

import (
	"context"
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// hold listens on a in guest g and keeps every connection it accepts open
// until the test ends.
func hold(t *testing.T, g *nsrig.Guest, a netip.Addr) netip.AddrPort {
	t.Helper()
	var l net.Listener
	network := "tcp4"
	if a.Is6() {
		network = "tcp6"
	}
	if err := nsrig.In(g.NSPath(), func() (err error) {
		l, err = net.Listen(network, netip.AddrPortFrom(a, 0).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	return l.Addr().(*net.TCPAddr).AddrPort()
}

// established looks tu up until its entry is ESTABLISHED and assured.
func established(t *testing.T, ct ctrack.Tracker, tu ctrack.Tuple) ctrack.Entry {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		e, err := ct.Lookup(tu)
		if err == nil && e.Established() {
			return e
		}
		if time.Now().After(deadline) {
			t.Fatalf("lookup %s: %+v, %v; want an established entry within 5s", tu, e, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestLookupAndDestroyDualStack: in a rig's host namespace, the kernel
// Tracker finds an IPv6 connection's entry by either direction, an IPv4
// one by its tuple in IPv4 or IPv4-mapped form (always reported in IPv4
// form), and reports the IPv6 entry's destruction.
func TestLookupAndDestroyDualStack(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	testenv.NeedTool(t, "conntrack", "conntrack")
	r, err := nsrig.New("ct6", 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Destroy() })
	ct, err := ctrack.Dial(r.HostNSPath())
	if err != nil {
		t.Fatal(err)
	}
	defer ct.Close()
	g1, g2 := r.Guests[0], r.Guests[1]

	c6 := g1.Dial(t, hold(t, g2, g2.Addr6))
	defer c6.Close()
	t6 := ctrack.Tuple{Src: c6.LocalAddr().(*net.TCPAddr).AddrPort(), Dst: c6.RemoteAddr().(*net.TCPAddr).AddrPort()}
	e6 := established(t, ct, t6)
	if e6.Orig != t6 || e6.Reply != t6.Reverse() {
		t.Fatalf("IPv6 entry %s / %s, want %s / %s", e6.Orig, e6.Reply, t6, t6.Reverse())
	}
	if e, err := ct.Lookup(t6.Reverse()); err != nil || e.ID != e6.ID {
		t.Fatalf("lookup by the reply direction: %+v, %v; want entry %d", e, err, e6.ID)
	}

	c4 := g1.Dial(t, hold(t, g2, g2.Addr))
	defer c4.Close()
	t4 := ctrack.Tuple{Src: c4.LocalAddr().(*net.TCPAddr).AddrPort(), Dst: c4.RemoteAddr().(*net.TCPAddr).AddrPort()}
	mapped := ctrack.Tuple{
		Src: netip.AddrPortFrom(netip.AddrFrom16(t4.Src.Addr().As16()), t4.Src.Port()),
		Dst: netip.AddrPortFrom(netip.AddrFrom16(t4.Dst.Addr().As16()), t4.Dst.Port()),
	}
	e4 := established(t, ct, t4)
	if e, err := ct.Lookup(mapped.Reverse()); err != nil || e.ID != e4.ID || e.Orig != t4 {
		t.Fatalf("lookup %s (IPv4-mapped): %+v, %v; want entry %d with orig %s", mapped.Reverse(), e, err, e4.ID, t4)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	got := make(chan ctrack.Entry, 16)
	done := make(chan error, 1)
	go func() { done <- ct.Destroyed(ctx, func(e ctrack.Entry) { got <- e }) }()
	// The subscription is in place once an event arrives: until one does,
	// a byte on the connection makes its entry again (conntrack picks up
	// a connection mid-stream) and it is deleted again.
	deadline := time.After(5 * time.Second)
	for {
		if _, err := c6.Write([]byte{1}); err != nil {
			t.Fatal(err)
		}
		if _, err := ct.Lookup(t6); err == nil {
			nsrig.Run(r.HostNSPath(), "conntrack", "-D", "-f", "ipv6", "-p", "tcp",
				"--orig-src", t6.Src.Addr().String(), "--sport", strconv.Itoa(int(t6.Src.Port())))
		}
		select {
		case e := <-got:
			if e.Orig != t6 || e.Reply != t6.Reverse() {
				t.Fatalf("destroyed %+v, want the entry of %s", e, t6)
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			return
		case <-deadline:
			t.Fatal("no destroy event for the IPv6 entry within 5s")
		case <-time.After(50 * time.Millisecond):
		}
	}
}
