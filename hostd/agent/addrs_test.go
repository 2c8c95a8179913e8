//go:build linux

package agent

import (
	"net/netip"
	"testing"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestGuestAddrsDualStack: a guest with an interface owns the subnets
// routed to it in both families (the rig's 10.77.1.0/24 and
// fd00:77:1::/64), never the link-local one, and not the host's own
// addresses on it; configured addresses come on top.
func TestGuestAddrsDualStack(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	r, err := nsrig.New("agaddr", 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatal(err)
	}
	defer r.Destroy()
	g1, g2 := r.Guests[0], r.Guests[1]
	gc := config.Guest{Name: "g1", Interface: g1.HostIf, Addresses: []netip.Addr{netip.MustParseAddr("10.99.0.1")}}
	as, err := guestAddrs(r.HostNSPath(), gc)
	if err != nil {
		t.Fatal(err)
	}
	g := &broker.Guest{Name: "g1"}
	g.SetAddrs(as)
	for _, tc := range []struct {
		addr string
		owns bool
	}{
		{g1.Addr.String(), true},
		{g1.Addr6.String(), true},
		{"fd00:77:1::99", true},
		{"10.99.0.1", true},
		{g1.HostAddr.String(), false},
		{g1.HostAddr6.String(), false},
		{g2.Addr.String(), false},
		{g2.Addr6.String(), false},
		{"fe80::1", false},
	} {
		if got := g.Owns(netip.MustParseAddr(tc.addr)); got != tc.owns {
			t.Errorf("owns %s = %v, want %v (prefixes %v, except %v)", tc.addr, got, tc.owns, as.Prefixes, as.Except)
		}
	}
}
