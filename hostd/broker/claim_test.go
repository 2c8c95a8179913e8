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
