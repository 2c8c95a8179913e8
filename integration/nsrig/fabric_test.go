//go:build linux

package nsrig_test

import (
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestFabricTwoHosts: a guest of host 1 reaches a guest of host 2 by
// kernel TCP over the fabric, over IPv4 and IPv6; each host's own
// conntrack table holds the connection (the hosts are separate
// namespaces); a DROP in host 2's forward chain stops it; a link cut
// stops it; and Destroy leaves nothing behind.
func TestFabricTwoHosts(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	testenv.NeedTool(t, "conntrack", "conntrack")
	f, err := nsrig.NewFabric("fabt", 2, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Create(); err != nil {
		t.Fatalf("create: %v", err)
	}
	defer func() {
		if err := f.Destroy(); err != nil {
			t.Errorf("destroy: %v", err)
		}
		for _, r := range f.Hosts {
			if _, err := os.Stat(r.HostNSPath()); err == nil {
				t.Errorf("namespace %s left behind", r.HostNS)
			}
		}
	}()
	g1, g2 := f.Hosts[0].Guests[0], f.Hosts[1].Guests[0]
	if g1.Addr == g2.Addr {
		t.Fatalf("both hosts' guests have %s", g1.Addr)
	}
	for _, a := range []netip.Addr{g2.Addr, g2.Addr6} {
		g2.Echo(t, netip.AddrPortFrom(a, 7001))
	}
	echo := func(addr string) error {
		var c net.Conn
		if err := nsrig.In(g1.NSPath(), func() (err error) {
			c, err = net.DialTimeout("tcp", net.JoinHostPort(addr, "7001"), 3*time.Second)
			return err
		}); err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write([]byte("across")); err != nil {
			return err
		}
		b := make([]byte, 6)
		_, err := io.ReadFull(c, b)
		return err
	}
	for _, a := range []string{g2.Addr.String(), g2.Addr6.String()} {
		if err := echo(a); err != nil {
			t.Fatalf("h1/g1 to h2/g1 at %s: %v", a, err)
		}
	}
	for _, r := range f.Hosts {
		out, err := nsrig.Run(r.HostNSPath(), "conntrack", "-L", "-p", "tcp", "--dport", "7001")
		if err != nil || !strings.Contains(out, "src="+g1.Addr.String()) {
			t.Errorf("host %s's conntrack has no entry of the connection: %q, %v", r.Name, out, err)
		}
	}
	if err := f.Hosts[1].Firewall("ip daddr " + g2.Addr.String() + " tcp dport 7001 drop"); err != nil {
		t.Fatal(err)
	}
	if err := echo(g2.Addr.String()); err == nil {
		t.Fatal("a DROP in host 2's forward chain did not stop a new connection")
	}
	if err := f.Hosts[1].Firewall(""); err != nil {
		t.Fatal(err)
	}
	if err := f.SetLink(false); err != nil {
		t.Fatal(err)
	}
	if err := echo(g2.Addr.String()); err == nil {
		t.Fatal("the fabric is down and a connection still crossed")
	}
	if err := f.SetLink(true); err != nil {
		t.Fatal(err)
	}
	if err := echo(g2.Addr.String()); err != nil {
		t.Fatalf("after the link came back: %v", err)
	}
	for _, target := range []string{"h1", "h2", "h1/g1", "h2/g1"} {
		if _, err := f.Find(target); err != nil {
			t.Errorf("find %s: %v", target, err)
		}
	}
	if _, err := f.Find("h3/g1"); err == nil {
		t.Error("find h3/g1 succeeded")
	}
}
