//go:build linux

package nsrig

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"
)

// Listen accepts TCP connections on the guest's IPv4 address (and drops
// them) until the test ends, and returns the address it listens on.
func (g *Guest) Listen(t testing.TB) netip.AddrPort { return g.ListenOn(t, g.Addr) }

// ListenOn is Listen on address a (the guest's Addr6, or an unspecified
// address).
func (g *Guest) ListenOn(t testing.TB, a netip.Addr) netip.AddrPort {
	t.Helper()
	return g.serve(t, netip.AddrPortFrom(a, 0), func(c net.Conn) { c.Close() })
}

// Echo is a plain TCP echo server (no Shunt) on at, until the test ends;
// it returns the address it listens on.
func (g *Guest) Echo(t testing.TB, at netip.AddrPort) netip.AddrPort {
	t.Helper()
	return g.serve(t, at, func(c net.Conn) { io.Copy(c, c); c.Close() })
}

// serve listens on at inside the guest and hands each connection to
// handle, on a goroutine of its own, until the test ends.
func (g *Guest) serve(t testing.TB, at netip.AddrPort, handle func(net.Conn)) netip.AddrPort {
	t.Helper()
	var l net.Listener
	err := In(g.NSPath(), func() (err error) {
		l, err = net.Listen(network(at.Addr()), at.String())
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go handle(c)
		}
	}()
	return l.Addr().(*net.TCPAddr).AddrPort()
}

// Dial connects from inside the guest to to; the caller closes the
// connection.
func (g *Guest) Dial(t testing.TB, to netip.AddrPort) net.Conn {
	t.Helper()
	var c net.Conn
	err := In(g.NSPath(), func() (err error) {
		c, err = net.DialTimeout(network(to.Addr()), to.String(), 5*time.Second)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// network is "tcp4" for an IPv4 address, "tcp6" for an IPv6 one.
func network(a netip.Addr) string {
	if a.Is4() {
		return "tcp4"
	}
	return "tcp6"
}
