package broker_test

import (
	"net/netip"
	"testing"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// fakeRemote speaks for 10.9.0.0/16, up or not.
type fakeRemote struct{ up bool }

func (f *fakeRemote) Route(a netip.Addr) (string, bool, bool) {
	if netip.MustParsePrefix("10.9.0.0/16").Contains(a) {
		return "h2", f.up, true
	}
	return "", false, false
}

// TestRemotePeerUnreachable: a connection to or from a guest of a peer
// host whose hostd is down stays on TCP with peer-unreachable, on either
// side; with the peer up (pairing across hosts not built yet), or with an
// address no peer speaks for, the reasons are those of any non-guest end.
func TestRemotePeerUnreachable(t *testing.T) {
	for _, c := range []struct {
		remote        broker.Remote
		to            string
		active, passv proto.Reason
	}{
		{&fakeRemote{up: false}, "10.9.1.2", proto.ReasonPeerUnreachable, proto.ReasonPeerUnreachable},
		{&fakeRemote{up: true}, "10.9.1.2", proto.ReasonNotLocal, proto.ReasonNoIntent},
		{&fakeRemote{up: false}, "10.8.1.2", proto.ReasonNotLocal, proto.ReasonNoIntent},
		{nil, "10.9.1.2", proto.ReasonNotLocal, proto.ReasonNoIntent},
	} {
		w := newWorldOpts(t, policy.Spec{}, broker.Options{Remote: c.remote})
		sa, sb := w.sessions()
		ta, _ := w.conn("10.0.0.1:4000", c.to+":80")
		w.b.Open(sa, open(proto.Active, ta, 1))
		if m := sa.next(t); m.Type != proto.TCP || m.Reason != c.active {
			t.Errorf("%+v: active OPEN to %s got %+v, want TCP(%v)", c.remote, c.to, m, c.active)
		}
		_, tb := w.conn(c.to+":5000", "10.0.0.2:80")
		w.b.Open(sb, open(proto.Passive, tb, 2))
		if m := sb.next(t); m.Type != proto.TCP || m.Reason != c.passv {
			t.Errorf("%+v: passive OPEN from %s got %+v, want TCP(%v)", c.remote, c.to, m, c.passv)
		}
	}
}

// TestVerifyClaim: a peer's claim holds only for an ESTABLISHED conntrack
// entry of exactly its tuple, in the direction it says, from an address
// that peer announced, to a local guest of the group of the same name;
// each other claim is refused with its reason.
func TestVerifyClaim(t *testing.T) {
	w := newWorldOpts(t, policy.Spec{}, broker.Options{Remote: &fakeRemote{up: true}})
	in, _ := w.conn("10.9.1.2:4000", "10.0.0.2:80")  // the peer's guest connected to g2
	out, _ := w.conn("10.0.0.1:5000", "10.9.1.2:80") // g1 connected to the peer's guest
	other, _ := w.conn("10.9.1.2:4001", "10.0.0.3:80")
	tp := func(s, d string) ctrack.Tuple { return ctrack.Tuple{Src: ap(s), Dst: ap(d)} }
	for _, c := range []struct {
		name   string
		peer   string
		group  string
		t      ctrack.Tuple
		active bool
		want   proto.Reason
	}{
		{"its guest connected", "h2", "t", in, true, proto.ReasonNone},
		{"its guest accepted", "h2", "t", out.Reverse(), false, proto.ReasonNone},
		{"forged: no conntrack entry", "h2", "t", tp("10.9.1.2:4999", "10.0.0.2:80"), true, proto.ReasonNoConntrack},
		{"the wrong direction", "h2", "t", in, false, proto.ReasonNotOwner},
		{"another peer's address", "h3", "t", in, true, proto.ReasonNotOwner},
		{"an address no peer announced", "h2", "t", tp("10.8.1.2:4000", "10.0.0.2:80"), true, proto.ReasonNotOwner},
		{"another trust group", "h2", "t", other, true, proto.ReasonCrossGroup},
		{"a group of another name", "h2", "u", in, true, proto.ReasonCrossGroup},
	} {
		if got := w.b.VerifyClaim(c.peer, c.group, c.t, c.active); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
	w.ct.Add(tp("10.9.1.2:4002", "10.0.0.9:80"), tp("10.0.0.9:80", "10.9.1.2:4002"), 0)
	if got := w.b.VerifyClaim("h2", "t", tp("10.9.1.2:4002", "10.0.0.9:80"), true); got != proto.ReasonNotLocal {
		t.Errorf("to an address no local guest owns: %v, want not-local", got)
	}
	down := newWorldOpts(t, policy.Spec{}, broker.Options{Remote: &fakeRemote{up: false}})
	in2, _ := down.conn("10.9.1.2:4000", "10.0.0.2:80")
	if got := down.b.VerifyClaim("h2", "t", in2, true); got != proto.ReasonNotOwner {
		t.Errorf("from a peer that is not up: %v, want not-owner", got)
	}
}
