package broker_test

import (
	"net/netip"
	"testing"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// mapped is a in IPv4-mapped IPv6 form, as an AF_INET6 socket names an
// IPv4 peer.
func mapped(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(netip.AddrFrom16(a.Addr().As16()), a.Port())
}

// TestDualStackServerPairs: a server on [::] names its IPv4 client's
// connection in IPv4-mapped form (its LISTEN is [::], its OPEN
// ::ffff:10.0.0.2 <- ::ffff:10.0.0.1); the client's AF_INET socket names
// it in IPv4 form. Both are the one IPv4 conntrack entry: they pair.
func TestDualStackServerPairs(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := newSession(w.g1), newSession(w.g2)
	w.b.Attach(sa)
	w.b.Attach(sb)
	w.b.Listen(sb, netip.AddrPortFrom(netip.IPv6Unspecified(), 80), true)
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, ctrack.Tuple{Src: mapped(tb.Src), Dst: mapped(tb.Dst)}, 2))
	ma, mb := sa.next(t), sb.next(t)
	if ma.Type != proto.Ready || mb.Type != proto.Ready || ma.Slot != mb.Slot {
		t.Fatalf("got %+v and %+v; want READY for both, one slot", ma, mb)
	}
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Src != "10.0.0.1:4000" || fl[0].Dst != "10.0.0.2:80" {
		t.Fatalf("flows %+v; want one, named by its IPv4 tuple", fl)
	}
}

// TestIPv6Pairs: guests that own IPv6 addresses pair an IPv6 connection,
// and a policy rule on IPv6 prefixes keeps it on TCP.
func TestIPv6Pairs(t *testing.T) {
	for _, tc := range []struct {
		name    string
		spec    policy.Spec
		verdict proto.Type
	}{
		{"fastpath", policy.Spec{}, proto.Ready},
		{"v6 rule tcp", policy.Spec{Rules: []policy.RuleSpec{{Name: "v6", Action: "tcp", To: []string{"fd00::/16"}}}}, proto.TCP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, tc.spec)
			for i, g := range []*broker.Guest{w.g1, w.g2} {
				a := netip.AddrFrom16([16]byte{0xfd, 0, 0, 0x77, 0, byte(i + 1), 15: 2})
				g.SetAddrs(broker.Addrs{Prefixes: []netip.Prefix{netip.PrefixFrom(a, 64).Masked()}})
			}
			sa, sb := newSession(w.g1), newSession(w.g2)
			w.b.Attach(sa)
			w.b.Attach(sb)
			w.b.Listen(sb, ap("[fd00:77:2::2]:80"), true)
			ta, tb := w.conn("[fd00:77:1::2]:4000", "[fd00:77:2::2]:80")
			w.b.Open(sa, open(proto.Active, ta, 1))
			w.b.Open(sb, open(proto.Passive, tb, 2))
			ma, mb := sa.next(t), sb.next(t)
			if ma.Type != tc.verdict || mb.Type != tc.verdict {
				t.Fatalf("got %+v and %+v; want %s for both", ma, mb, tc.verdict)
			}
			if tc.verdict == proto.TCP && (ma.Reason != proto.ReasonPolicy || mb.Reason != proto.ReasonPolicy) {
				t.Fatalf("reasons %s and %s, want policy", ma.Reason, mb.Reason)
			}
			fl := w.b.Flows()
			if len(fl) != 1 || fl[0].Src != "[fd00:77:1::2]:4000" || fl[0].Dst != "[fd00:77:2::2]:80" {
				t.Fatalf("flows %+v; want one, named by its IPv6 tuple", fl)
			}
			if tc.verdict == proto.TCP && fl[0].Rule != "v6" {
				t.Fatalf("flow %+v: want rule v6 named", fl[0])
			}
		})
	}
}

// TestMixedFamilyTuple: an OPEN whose tuple has one IPv4 and one IPv6 end
// names no connection: it is answered TCP(no-conntrack) without a single
// conntrack query, so a hostile guest cannot keep hostd retrying malformed
// queries and logging them.
func TestMixedFamilyTuple(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa := newSession(w.g1)
	w.b.Attach(sa)
	w.b.Open(sa, open(proto.Active, ctrack.Tuple{Src: ap("10.0.0.1:4000"), Dst: ap("[fd00:77:2::2]:80")}, 1))
	if m := sa.next(t); m.Type != proto.TCP || m.Reason != proto.ReasonNoConntrack {
		t.Fatalf("got %+v; want TCP(no-conntrack)", m)
	}
	if n := w.ct.Lookups(); n != 0 {
		t.Fatalf("hostd asked conntrack %d times for a tuple no connection can have", n)
	}
}
