package broker_test

import (
	"net/netip"
	"testing"

	"github.com/shuntnet/shunt/hostd/broker"
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
