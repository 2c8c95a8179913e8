//go:build linux

package nsrig

import (
	"net"
	"net/netip"
	"testing"
	"time"
)

// Listen accepts TCP connections on the guest's address (and drops them)
// until the test ends, and returns the address it listens on.
func (g *Guest) Listen(t testing.TB) netip.AddrPort {
	t.Helper()
	var l net.Listener
	err := In(g.NSPath(), func() (err error) {
		l, err = net.Listen("tcp4", g.Addr.String()+":0")
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
			c.Close()
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
		c, err = net.DialTimeout("tcp4", to.String(), 5*time.Second)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}
