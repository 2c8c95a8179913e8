package broker_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/ctrack/cttest"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// session is a fake control session that records what hostd sends. It
// speaks version 3 unless v2 is set.
type session struct {
	g   *broker.Guest
	got chan proto.Msg
	v2  bool
}

func newSession(g *broker.Guest) *session { return &session{g: g, got: make(chan proto.Msg, 64)} }

func (s *session) Guest() *broker.Guest { return s.g }
func (s *session) Send(m proto.Msg)     { s.got <- m }
func (s *session) Switching() bool      { return !s.v2 }

func (s *session) next(t *testing.T) proto.Msg {
	t.Helper()
	select {
	case m := <-s.got:
		return m
	case <-time.After(5 * time.Second):
		t.Fatal("no message from the broker within 5s")
		return proto.Msg{}
	}
}

func (s *session) none(t *testing.T) {
	t.Helper()
	select {
	case m := <-s.got:
		t.Fatalf("unexpected message %+v", m)
	case <-time.After(20 * time.Millisecond):
	}
}

type world struct {
	b          *broker.Broker
	ct         *cttest.Table
	g1, g2, g3 *broker.Guest
	m          *metrics.Set
	handshake  uint32 // the mark new entries get: both proof bits when the broker has them
}

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

func newWorld(t *testing.T, spec policy.Spec) *world { return newWorldOpts(t, spec, broker.Options{}) }

// newWorldOpts is newWorld with broker options; timeouts default short.
func newWorldOpts(t *testing.T, spec policy.Spec, opts broker.Options) *world {
	r, _ := shmtest.Region(t, region.Geometry{Size: 8 << 20, Slots: 8})
	pool := region.NewPool(r, nil)
	grp := &broker.Group{Name: "t", Region: "mem", Pool: pool}
	other := &broker.Group{Name: "u", Region: "mem2", Pool: pool}
	mk := func(name string, id uint32, g *broker.Group, addr string) *broker.Guest {
		gu := &broker.Guest{Name: name, ID: id, Group: g}
		a := netip.MustParseAddr(addr)
		gu.SetAddrs(broker.Addrs{Prefixes: []netip.Prefix{netip.PrefixFrom(a, 32)}})
		return gu
	}
	w := &world{ct: &cttest.Table{}, m: metrics.New(),
		g1: mk("g1", 1, grp, "10.0.0.1"), g2: mk("g2", 2, grp, "10.0.0.2"), g3: mk("g3", 3, other, "10.0.0.3")}
	tab, err := policy.Compile(spec)
	if err != nil {
		t.Fatal(err)
	}
	opts.PairingTimeout, opts.LookupTimeout = 100*time.Millisecond, 10*time.Millisecond
	w.b = broker.New(hclog.NewNullLogger(), w.ct, w.m, tab, []*broker.Guest{w.g1, w.g2, w.g3}, opts)
	t.Cleanup(w.b.Close)
	if opts.ProofOrig != 0 {
		// The handshake passed the filter: new entries carry both bits.
		w.handshake = opts.ProofOrig | opts.ProofReply
		w.b.Start()
		w.cleared(t)
	}
	return w
}

// cleared waits until the broker's firewall epoch cleared every entry's
// proof bits.
func (w *world) cleared(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, ok := w.b.FirewallEpoch(); ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the firewall epoch's clear did not complete within 5s")
		}
	}
}

// conn sets up a conntrack entry from a (src) to b (dst) and returns the
// tuples as each side sees them.
func (w *world) conn(src, dst string) (ctrack.Tuple, ctrack.Tuple) {
	a := ctrack.Tuple{Src: ap(src), Dst: ap(dst)}
	w.ct.Add(a, a.Reverse(), w.handshake)
	return a, a.Reverse()
}

// sessions attaches a session for g1 and g2, with g2 listening on port 80.
func (w *world) sessions() (sa, sb *session) {
	sa, sb = newSession(w.g1), newSession(w.g2)
	w.b.Attach(sa)
	w.b.Attach(sb)
	w.b.Listen(sb, ap("10.0.0.2:80"), true)
	return sa, sb
}

// connect makes a conntrack entry from g1's port to g2:80 and sends both
// OPENs (no INTENT: protocol 3 has none); it returns g1's tuple.
func (w *world) connect(sa, sb *session, port string, req uint32) ctrack.Tuple {
	ta, tb := w.conn("10.0.0.1:"+port, "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, req))
	w.b.Open(sb, open(proto.Passive, tb, req+1))
	return ta
}

func open(role proto.Role, t ctrack.Tuple, req uint32) proto.Msg {
	return proto.Msg{Type: proto.Open, ReqID: req, Role: role, Local: t.Src, Remote: t.Dst}
}

func TestPairBothOrders(t *testing.T) {
	for _, activeFirst := range []bool{true, false} {
		w := newWorld(t, policy.Spec{})
		sa, sb := w.sessions()
		ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
		if activeFirst {
			w.b.Open(sa, open(proto.Active, ta, 1))
			w.b.Open(sb, open(proto.Passive, tb, 2))
		} else {
			w.b.Open(sb, open(proto.Passive, tb, 2))
			w.b.Open(sa, open(proto.Active, ta, 1))
		}
		ma, mb := sa.next(t), sb.next(t)
		if ma.Type != proto.Ready || mb.Type != proto.Ready || ma.Slot != mb.Slot || ma.Gen != mb.Gen ||
			ma.Side != proto.SideA || mb.Side != proto.SideB || ma.ReqID != 1 || mb.ReqID != 2 {
			t.Fatalf("active first %v: got %+v and %+v; want READY for both, sides A and B, same slot", activeFirst, ma, mb)
		}
		if fl := w.b.Flows(); len(fl) != 1 || fl[0].GuestA != "g1" || fl[0].GuestB != "g2" {
			t.Fatalf("flows %+v", fl)
		}
	}
}

func TestVerdicts(t *testing.T) {
	tests := []struct {
		name   string
		spec   policy.Spec
		prep   func(w *world, sa, sb *session) (ctrack.Tuple, ctrack.Tuple)
		wantA  proto.Reason
		wantB  proto.Reason
		noOpen bool // the active side does not send OPEN
	}{
		{"policy", policy.Spec{Default: "tcp"}, nil, proto.ReasonPolicy, proto.ReasonPolicy, false},
		{"no listener", policy.Spec{}, func(w *world, sa, sb *session) (ctrack.Tuple, ctrack.Tuple) {
			w.b.Listen(sb, ap("10.0.0.2:80"), false)
			return w.conn("10.0.0.1:4000", "10.0.0.2:80")
		}, proto.ReasonNoListener, proto.ReasonNoListener, false},
		{"not owner", policy.Spec{}, func(w *world, sa, sb *session) (ctrack.Tuple, ctrack.Tuple) {
			a, _ := w.conn("10.0.0.9:4000", "10.0.0.2:80")
			return a, ctrack.Tuple{}
		}, proto.ReasonNotOwner, 0, false},
		{"no conntrack", policy.Spec{}, func(w *world, sa, sb *session) (ctrack.Tuple, ctrack.Tuple) {
			return ctrack.Tuple{Src: ap("10.0.0.1:4000"), Dst: ap("10.0.0.2:80")}, ctrack.Tuple{}
		}, proto.ReasonNoConntrack, 0, false},
		{"loopback", policy.Spec{}, func(w *world, sa, sb *session) (ctrack.Tuple, ctrack.Tuple) {
			return ctrack.Tuple{Src: ap("127.0.0.1:4000"), Dst: ap("127.0.0.1:80")}, ctrack.Tuple{}
		}, proto.ReasonLoopback, 0, false},
		{"not local", policy.Spec{}, func(w *world, sa, sb *session) (ctrack.Tuple, ctrack.Tuple) {
			a, _ := w.conn("10.0.0.1:4000", "192.0.2.1:80")
			return a, ctrack.Tuple{}
		}, proto.ReasonNotLocal, 0, false},
		{"timeout", policy.Spec{}, func(w *world, sa, sb *session) (ctrack.Tuple, ctrack.Tuple) {
			a, _ := w.conn("10.0.0.1:4000", "10.0.0.2:80")
			return a, ctrack.Tuple{}
		}, proto.ReasonTimeout, 0, false},
		{"passive without intent from a non-guest", policy.Spec{}, func(w *world, sa, sb *session) (ctrack.Tuple, ctrack.Tuple) {
			a := ctrack.Tuple{Src: ap("192.0.2.7:5000"), Dst: ap("10.0.0.2:80")}
			w.ct.Add(a, a.Reverse(), 0)
			return ctrack.Tuple{}, a.Reverse()
		}, 0, proto.ReasonNoIntent, true},
		{"cross group", policy.Spec{}, func(w *world, sa, sb *session) (ctrack.Tuple, ctrack.Tuple) {
			a, _ := w.conn("10.0.0.1:4000", "10.0.0.3:80")
			return a, ctrack.Tuple{}
		}, proto.ReasonCrossGroup, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := newWorld(t, tt.spec)
			sa, sb := w.sessions()
			var ta, tb ctrack.Tuple
			if tt.prep != nil {
				ta, tb = tt.prep(w, sa, sb)
			} else {
				ta, tb = w.conn("10.0.0.1:4000", "10.0.0.2:80")
			}
			if !tt.noOpen {
				w.b.Open(sa, open(proto.Active, ta, 1))
			}
			if tb.Src.IsValid() {
				w.b.Open(sb, open(proto.Passive, tb, 2))
			}
			if tt.wantA != 0 {
				if m := sa.next(t); m.Type != proto.TCP || m.Reason != tt.wantA {
					t.Fatalf("active side got %+v, want TCP(%s)", m, tt.wantA)
				}
			}
			if tt.wantB != 0 {
				if m := sb.next(t); m.Type != proto.TCP || m.Reason != tt.wantB {
					t.Fatalf("passive side got %+v, want TCP(%s)", m, tt.wantB)
				}
			}
			for _, f := range w.b.Flows() {
				if f.Path != "tcp" || f.Ring != 0 {
					t.Fatalf("a refused connection has rings: %+v", f)
				}
			}
		})
	}
}

// TestPassiveWaitsWithoutIntent: the passive OPEN arrives first, with no
// INTENT (protocol 3 has none); its client is a guest with a session, so
// it waits for the active OPEN and pairs.
func TestPassiveWaitsWithoutIntent(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sb.none(t)
	w.b.Open(sa, open(proto.Active, ta, 1))
	if ma, mb := sa.next(t), sb.next(t); ma.Type != proto.Ready || mb.Type != proto.Ready {
		t.Fatalf("got %+v and %+v, want READY for both", ma, mb)
	}
}

// TestConntrackGoneDowngrades: a conntrack DESTROY moves the connection to
// TCP (DOWN(conntrack-gone) to both ends), never a stale entry's; the ring
// pair is freed when both sides released it (LEFT, CLOSE or gone).
func TestConntrackGoneDowngrades(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	ready := sa.next(t)
	sb.next(t)
	e, _ := w.ct.Lookup(ta)
	stale := e
	stale.ID++ // a DESTROY of an older entry with the same tuple
	w.b.ConntrackDestroyed(stale)
	sa.none(t)
	w.ct.Delete(e.ID) // the kernel reports an entry destroyed once it is out of the table
	w.b.ConntrackDestroyed(e)
	for i, s := range []*session{sa, sb} {
		if m := s.next(t); m.Type != proto.Down || m.Reason != proto.ReasonConntrackGone || m.Slot != ready.Slot || m.ReqID != uint32(i+1) {
			t.Fatalf("got %+v, want DOWN(conntrack-gone) for request %d", m, i+1)
		}
	}
	w.b.Left(sa, proto.Msg{Type: proto.Left, ReqID: 1, Slot: ready.Slot, Gen: ready.Gen, Side: proto.SideA})
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Ring == 0 {
		t.Fatal("ring pair freed after one side left it")
	}
	// A LEFT for the other side from the wrong guest is ignored.
	w.b.Left(sa, proto.Msg{Type: proto.Left, ReqID: 1, Slot: ready.Slot, Gen: ready.Gen, Side: proto.SideB})
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Ring == 0 {
		t.Fatal("a guest released its peer's side")
	}
	w.b.Detach(sb) // the passive guest goes away: its side counts as left
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Ring != 0 || fl[0].Path != "tcp" || fl[0].Reason != "conntrack-gone" {
		t.Fatalf("after both sides left: %+v, want the record on TCP (conntrack-gone) without rings", fl)
	}
	w.b.CloseConn(sa, proto.Msg{Type: proto.Close, ReqID: 1, Side: proto.SideA})
	if fl := w.b.Flows(); len(fl) != 0 {
		t.Fatalf("record kept after both ends closed or went: %+v", fl)
	}
	sa.none(t) // and no READY: its entry is gone
}

func TestGuestLimit(t *testing.T) {
	w := newWorld(t, policy.Spec{MaxFlowsPerGuest: 1})
	sa, sb := w.sessions()
	for i, port := range []string{"4000", "4001"} {
		w.connect(sa, sb, port, uint32(2*i))
		ma, mb := sa.next(t), sb.next(t)
		want := proto.Ready
		if i == 1 {
			want = proto.TCP
		}
		if ma.Type != want || mb.Type != want {
			t.Fatalf("flow %d: got %+v and %+v, want %s", i, ma, mb, want)
		}
		if i == 1 && ma.Reason != proto.ReasonGuestLimit {
			t.Fatalf("second flow reason %s, want guest-limit", ma.Reason)
		}
	}
}

// fakeWitness says every SYN came in by interface in.
type fakeWitness struct{ in int }

func (f fakeWitness) Origin(src, dst netip.AddrPort) (int, error) { return f.in, nil }

// TestWitness: with the eBPF witness on, a claim holds only if the SYN came
// in by the claiming guest's own interface, whichever side OPENs first (the
// active side may reuse the entry the passive side's OPEN fetched).
func TestWitness(t *testing.T) {
	for _, tc := range []struct {
		seen         int
		passiveFirst bool
		want         proto.Type
	}{{7, false, proto.Ready}, {8, false, proto.TCP}, {7, true, proto.Ready}, {8, true, proto.TCP}} {
		w := newWorldOpts(t, policy.Spec{}, broker.Options{Witness: fakeWitness{tc.seen}})
		w.g1.Ifindex = 7
		sa, sb := w.sessions()
		ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
		if tc.passiveFirst {
			w.b.Open(sb, open(proto.Passive, tb, 2))
			w.b.Open(sa, open(proto.Active, ta, 1))
		} else {
			w.b.Open(sa, open(proto.Active, ta, 1))
			w.b.Open(sb, open(proto.Passive, tb, 2))
		}
		if m := sa.next(t); m.Type != tc.want || (tc.want == proto.TCP && m.Reason != proto.ReasonNotOwner) {
			t.Fatalf("SYN seen on ifindex %d, passive first %v: active side got %+v, want %s", tc.seen, tc.passiveFirst, m, tc.want)
		}
	}
}
