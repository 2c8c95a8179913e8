package broker

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
)

// witnessSaw says every SYN came in by interface in, or fails with err.
type witnessSaw struct {
	in  int
	err error
}

func (w witnessSaw) Origin(src, dst netip.AddrPort) (int, error) { return w.in, w.err }

// TestClaim: the one check of a guest's claim to a connection, before the
// lookup (e nil) and against the entry, for each side.
func TestClaim(t *testing.T) {
	ap := netip.MustParseAddrPort
	orig := ctrack.Tuple{Src: ap("10.0.0.1:4000"), Dst: ap("10.0.0.2:80")} // as A sees it
	entry := ctrack.Entry{Orig: orig, Reply: orig.Reverse(), TCPState: ctrack.StateEstablished, Assured: true, Mark: 5}
	guest := func(addr string, mark uint32, ifindex int) *Guest {
		g := &Guest{Name: addr, CTMark: mark, Ifindex: ifindex}
		g.SetAddrs(Addrs{Prefixes: []netip.Prefix{netip.MustParsePrefix(addr)}, Except: []netip.Addr{netip.MustParseAddr("10.0.0.254")}})
		return g
	}
	a, b := guest("10.0.0.1/32", 0, 0), guest("10.0.0.2/32", 0, 0)
	tests := []struct {
		name    string
		g       *Guest
		role    proto.Role
		t       ctrack.Tuple
		e       *ctrack.Entry
		witness *witnessSaw
		want    proto.Reason
	}{
		{"addresses only", a, proto.Active, orig, nil, nil, proto.ReasonNone},
		{"loopback source", guest("127.0.0.0/8", 0, 0), proto.Active, ctrack.Tuple{Src: ap("127.0.0.1:4000"), Dst: ap("10.0.0.2:80")}, nil, nil, proto.ReasonLoopback},
		{"loopback destination", a, proto.Active, ctrack.Tuple{Src: ap("10.0.0.1:4000"), Dst: ap("[::1]:80")}, nil, nil, proto.ReasonLoopback},
		{"loopback with an entry", a, proto.Active, ctrack.Tuple{Src: ap("10.0.0.1:4000"), Dst: ap("127.0.0.1:80")}, &entry, nil, proto.ReasonLoopback},
		{"source not owned", b, proto.Active, orig, nil, nil, proto.ReasonNotOwner},
		{"source excepted", guest("10.0.0.0/24", 0, 0), proto.Active, ctrack.Tuple{Src: ap("10.0.0.254:4000"), Dst: ap("10.0.0.2:80")}, nil, nil, proto.ReasonNotOwner},
		{"active, original direction", a, proto.Active, orig, &entry, nil, proto.ReasonNone},
		{"active, IPv4-mapped source", a, proto.Active, ctrack.Tuple{Src: ap("[::ffff:10.0.0.1]:4000"), Dst: orig.Dst}, nil, nil, proto.ReasonNone},
		{"active claims the reply direction", b, proto.Active, orig.Reverse(), &entry, nil, proto.ReasonNotOwner},
		{"passive, reply direction", b, proto.Passive, orig.Reverse(), &entry, nil, proto.ReasonNone},
		{"passive claims the original direction", a, proto.Passive, orig, &entry, nil, proto.ReasonNotOwner},
		{"active, its ct_mark", guest("10.0.0.1/32", 5, 0), proto.Active, orig, &entry, nil, proto.ReasonNone},
		{"active, another ct_mark", guest("10.0.0.1/32", 6, 0), proto.Active, orig, &entry, nil, proto.ReasonNotOwner},
		{"passive, ct_mark not checked", guest("10.0.0.2/32", 6, 0), proto.Passive, orig.Reverse(), &entry, nil, proto.ReasonNone},
		{"witness saw its interface", guest("10.0.0.1/32", 0, 7), proto.Active, orig, &entry, &witnessSaw{in: 7}, proto.ReasonNone},
		{"witness saw another interface", guest("10.0.0.1/32", 0, 7), proto.Active, orig, &entry, &witnessSaw{in: 8}, proto.ReasonNotOwner},
		{"witness saw nothing", guest("10.0.0.1/32", 0, 7), proto.Active, orig, &entry, &witnessSaw{err: errors.New("no SYN recorded")}, proto.ReasonNotOwner},
		{"witness, guest without interface", a, proto.Active, orig, &entry, &witnessSaw{in: 8}, proto.ReasonNone},
		{"witness, passive not checked", guest("10.0.0.2/32", 0, 7), proto.Passive, orig.Reverse(), &entry, &witnessSaw{in: 8}, proto.ReasonNone},
		{"witness, addresses only", guest("10.0.0.1/32", 0, 7), proto.Active, orig, nil, &witnessSaw{in: 8}, proto.ReasonNone},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			br := &Broker{log: hclog.NewNullLogger()}
			if tt.witness != nil {
				br.opts.Witness = *tt.witness
			}
			if got := br.claim(tt.g, tt.role, tt.t, tt.e); got != tt.want {
				t.Fatalf("claim(%s, role %d, %s) = %s, want %s", tt.g.Name, tt.role, tt.t, got, tt.want)
			}
		})
	}
}

// TestClaimMarks: with hostd's marks, the active side's claim holds only
// if the entry's mark carries the guest's id in hostd's bits, and the
// operator's ct_mark, if the guest has one, in the others.
func TestClaimMarks(t *testing.T) {
	ap := netip.MustParseAddrPort
	orig := ctrack.Tuple{Src: ap("10.0.0.1:4000"), Dst: ap("10.0.0.2:80")}
	const mask = 0xffff0000
	tests := []struct {
		name         string
		role         proto.Role
		mark, ctMark uint32 // the guest's
		entryMark    uint32
		mask         uint32
		want         proto.Reason
	}{
		{"its id", proto.Active, 0x50000, 0, 0x50000, mask, proto.ReasonNone},
		{"its id and the operator's bits", proto.Active, 0x50000, 0, 0x50007, mask, proto.ReasonNone},
		{"another guest's id", proto.Active, 0x50000, 0, 0x60000, mask, proto.ReasonNotOwner},
		{"no id: came in by an interface that is no guest's", proto.Active, 0x50000, 0, 0x7, mask, proto.ReasonNotOwner},
		{"guest without an interface: addresses alone", proto.Active, 0, 0, 0x60000, mask, proto.ReasonNone},
		{"passive: not checked", proto.Passive, 0x50000, 0, 0x60000, mask, proto.ReasonNone},
		{"its id and its ct_mark", proto.Active, 0x50000, 7, 0x50007, mask, proto.ReasonNone},
		{"its id, another ct_mark", proto.Active, 0x50000, 6, 0x50007, mask, proto.ReasonNotOwner},
		{"ct_mark alone, hostd not marking: the whole mark", proto.Active, 0, 0x50007, 0x50007, 0, proto.ReasonNone},
		{"ct_mark alone, hostd not marking, other bits", proto.Active, 0, 7, 0x50007, 0, proto.ReasonNotOwner},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := &Guest{Name: "a", Mark: tt.mark, CTMark: tt.ctMark}
			src := orig.Src
			if tt.role == proto.Passive {
				src = orig.Dst
			}
			g.SetAddrs(Addrs{Prefixes: []netip.Prefix{netip.PrefixFrom(src.Addr(), 32)}})
			e := ctrack.Entry{Orig: orig, Reply: orig.Reverse(), TCPState: ctrack.StateEstablished, Assured: true, Mark: tt.entryMark}
			br := &Broker{log: hclog.NewNullLogger()}
			br.opts.MarkMask = tt.mask
			claimed := orig
			if tt.role == proto.Passive {
				claimed = orig.Reverse()
			}
			if got := br.claim(g, tt.role, claimed, &e); got != tt.want {
				t.Fatalf("claim with guest mark %#x ct_mark %#x, entry mark %#x, mask %#x = %s, want %s", tt.mark, tt.ctMark, tt.entryMark, tt.mask, got, tt.want)
			}
		})
	}
}

// TestAddrsOverlap: two guests overlap where a prefix of one meets a
// prefix of the other, unless the meeting is one address that either
// excepts (the host's own address on a guest's link).
func TestAddrsOverlap(t *testing.T) {
	pfx := netip.MustParsePrefix
	addr := netip.MustParseAddr
	for _, tt := range []struct {
		name string
		a, b Addrs
		want string // "" = none
	}{
		{"disjoint", Addrs{Prefixes: []netip.Prefix{pfx("10.0.1.0/24")}}, Addrs{Prefixes: []netip.Prefix{pfx("10.0.2.0/24")}}, ""},
		{"same address", Addrs{Prefixes: []netip.Prefix{pfx("10.0.1.2/32")}}, Addrs{Prefixes: []netip.Prefix{pfx("10.0.1.2/32")}}, "10.0.1.2/32"},
		{"address in a subnet", Addrs{Prefixes: []netip.Prefix{pfx("10.0.1.0/24")}}, Addrs{Prefixes: []netip.Prefix{pfx("10.0.2.0/24"), pfx("10.0.1.9/32")}}, "10.0.1.9/32"},
		{"subnet in a subnet", Addrs{Prefixes: []netip.Prefix{pfx("10.0.1.128/25")}}, Addrs{Prefixes: []netip.Prefix{pfx("10.0.0.0/16")}}, "10.0.1.128/25"},
		{"the host's address, excepted", Addrs{Prefixes: []netip.Prefix{pfx("10.0.1.0/24")}, Except: []netip.Addr{addr("10.0.1.1")}}, Addrs{Prefixes: []netip.Prefix{pfx("10.0.1.1/32")}}, ""},
		{"IPv6", Addrs{Prefixes: []netip.Prefix{pfx("fd00::/64")}}, Addrs{Prefixes: []netip.Prefix{pfx("fd00::2/128")}}, "fd00::2/128"},
		{"IPv4 and IPv6", Addrs{Prefixes: []netip.Prefix{pfx("10.0.0.0/8")}}, Addrs{Prefixes: []netip.Prefix{pfx("::/0")}}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			for _, order := range [][2]*Addrs{{&tt.a, &tt.b}, {&tt.b, &tt.a}} {
				p, ok := order[0].Overlap(order[1])
				if got := map[bool]string{true: p.String()}[ok]; got != tt.want {
					t.Fatalf("overlap = %q, want %q", got, tt.want)
				}
			}
		})
	}
}
