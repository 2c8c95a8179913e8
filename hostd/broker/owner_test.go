package broker_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// origin is a fake witness: every SYN came in by interface in.
type origin struct{ in int }

func (o origin) Origin(src, dst netip.AddrPort) (int, error) { return o.in, nil }

// TestSpoofedClaimRefusedInBothOrders: the active side's proof of origin
// (hostd's mark, the witness) is checked whichever OPEN comes first; the
// claimant controls that order, and a passive OPEN that came first must
// not let a connection from another interface through.
func TestSpoofedClaimRefusedInBothOrders(t *testing.T) {
	for _, proof := range []string{"mark", "witness"} {
		for _, activeFirst := range []bool{true, false} {
			opts := broker.Options{MarkMask: 0xffff0000}
			if proof == "witness" {
				opts = broker.Options{Witness: origin{in: 8}}
			}
			w := newWorldOpts(t, policy.Spec{}, opts)
			w.g1.Mark, w.g1.Ifindex = 0x10000, 7 // before any OPEN
			sa, sb := w.sessions()
			ta := ctrack.Tuple{Src: ap("10.0.0.1:4000"), Dst: ap("10.0.0.2:80")}
			tb := ta.Reverse()
			w.ct.Add(ta, tb, 0x20005) // another guest's id: it came in by another interface
			if activeFirst {
				w.b.Open(sa, open(proto.Active, ta, 1))
				w.b.Open(sb, open(proto.Passive, tb, 2))
			} else {
				w.b.Open(sb, open(proto.Passive, tb, 2))
				w.b.Open(sa, open(proto.Active, ta, 1))
			}
			ma, mb := sa.next(t), sb.next(t)
			if ma.Type != proto.TCP || ma.Reason != proto.ReasonNotOwner || mb.Type != proto.TCP {
				t.Fatalf("%s, active first %v: got %+v and %+v; want TCP(not-owner) for the claimant and TCP for its peer", proof, activeFirst, ma, mb)
			}
			if fl := w.b.Flows(); len(fl) != 0 {
				t.Fatalf("%s, active first %v: flows %+v", proof, activeFirst, fl)
			}
		}
	}
}

// TestAddGuestRefusesOverlap: a guest that appears while hostd runs (a
// libvirt domain) and claims an address another guest owns is refused,
// with both guests and the prefix named; the others keep theirs.
func TestAddGuestRefusesOverlap(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	mk := func(name string, id uint32, a broker.Addrs) *broker.Guest {
		g := &broker.Guest{Name: name, ID: id, Group: w.g1.Group}
		g.SetAddrs(a)
		return g
	}
	thief := mk("thief", 9, broker.Addrs{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}})
	err := w.b.AddGuest(thief)
	if err == nil || !strings.Contains(err.Error(), "guest thief and guest g1 both own 10.0.0.1/32") {
		t.Fatalf("AddGuest of an overlapping guest: %v", err)
	}
	// The same subnet without the others' addresses is fine.
	ok := mk("ok", 9, broker.Addrs{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")},
		Except: []netip.Addr{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("10.0.0.3")}})
	if err := w.b.AddGuest(ok); err != nil {
		t.Fatal(err)
	}
	// A registered guest cannot take another's address later either.
	err = w.b.SetAddrs(ok, broker.Addrs{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.2/32")}})
	if err == nil || !strings.Contains(err.Error(), "guest ok and guest g2 both own 10.0.0.2/32") {
		t.Fatalf("SetAddrs onto another guest's address: %v", err)
	}
	if !w.g2.Owns(netip.MustParseAddr("10.0.0.2")) || ok.Owns(netip.MustParseAddr("10.0.0.2")) {
		t.Fatal("a refused SetAddrs changed who owns what")
	}
	if err := broker.CheckOverlaps([]*broker.Guest{w.g1, w.g2, thief}); err == nil || !strings.Contains(err.Error(), "guest thief and guest g1 both own 10.0.0.1/32") {
		t.Fatalf("CheckOverlaps: %v", err)
	}
	if err := broker.CheckOverlaps([]*broker.Guest{w.g1, w.g2, w.g3}); err != nil {
		t.Fatal(err)
	}
}
