//go:build linux

package witness_test

import (
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/shuntnet/shunt/hostd/witness"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestRecordsSYNOrigin: the program, attached to the host side of a
// guest's veth, records the SYN of a connection the guest opens, with that
// interface; an unrelated tuple is not there.
func TestRecordsSYNOrigin(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	r, err := nsrig.New("wit", 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatal(err)
	}
	defer r.Destroy()
	w, err := witness.Load()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	g := r.Guests[0]
	var ifindex int
	err = nsrig.In(r.HostNSPath(), func() error {
		l, err := netlink.LinkByName(g.HostIf)
		if err != nil {
			return err
		}
		ifindex = l.Attrs().Index
		return w.Attach(ifindex)
	})
	if err != nil {
		t.Fatal(err)
	}
	src := netip.AddrPortFrom(g.Addr, 40123)
	dst := netip.AddrPortFrom(g.HostAddr, 9) // nothing listens: the SYN is what counts
	nsrig.In(g.NSPath(), func() error {
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(src), Timeout: time.Second}
		c, err := d.Dial("tcp4", dst.String())
		if err == nil {
			c.Close()
		}
		return nil
	})
	got, err := w.Origin(src, dst)
	if err != nil || got != ifindex {
		t.Fatalf("Origin(%s -> %s) = %d, %v; want ifindex %d", src, dst, got, err, ifindex)
	}
	if _, err := w.Origin(netip.MustParseAddrPort("10.9.9.9:1"), dst); !errors.Is(err, witness.ErrNoSYN) {
		t.Fatalf("Origin of an unseen tuple = %v, want ErrNoSYN", err)
	}
}
