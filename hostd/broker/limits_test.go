package broker_test

import (
	"context"
	"fmt"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// limited is the broker's count of requests refused for limits of kind.
func (w *world) limited(t *testing.T, kind string) float64 {
	t.Helper()
	mfs, err := w.m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "shunt_control_limited_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == kind {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no shunt_control_limited_total{kind=%q}", kind)
	return 0
}

func (w *world) listening(g *broker.Guest) []string {
	for _, gi := range w.b.Guests() {
		if gi.Name == g.Name {
			return gi.Listening
		}
	}
	return nil
}

// TestListenLimits: LISTENs beyond a session's or a guest's limit are
// ignored and counted; connections to them stay on TCP (no-listener); an
// UNLISTEN, or the session going, makes room again.
func TestListenLimits(t *testing.T) {
	w := newWorldOpts(t, policy.Spec{}, broker.Options{Limits: broker.Limits{ListensPerSession: 2, ListensPerGuest: 3}})
	sa, sb := newSession(w.g1), newSession(w.g2)
	sb2 := newSession(w.g2)
	for _, s := range []*session{sa, sb, sb2} {
		w.b.Attach(s)
	}
	for _, p := range []string{"80", "81", "82"} { // 82: over the session's limit
		w.b.Listen(sb, ap("10.0.0.2:"+p), true)
	}
	w.b.Listen(sb, ap("10.0.0.2:80"), true)  // again: no change, not counted
	for _, p := range []string{"83", "84"} { // 84: over the guest's limit
		w.b.Listen(sb2, ap("10.0.0.2:"+p), true)
	}
	if got := w.listening(w.g2); fmt.Sprint(got) != "[10.0.0.2:80 10.0.0.2:81 10.0.0.2:83]" {
		t.Fatalf("listening %v, want 80, 81 and 83", got)
	}
	if got := w.limited(t, "listens"); got != 2 {
		t.Fatalf("limited listens %v, want 2", got)
	}
	w.connect(sa, sb, "4000", 1) // to :80, kept
	if ma, mb := sa.next(t), sb.next(t); ma.Type != proto.Ready || mb.Type != proto.Ready {
		t.Fatalf("to a kept listener: %+v, %+v; want READY", ma, mb)
	}
	ta, tb := w.conn("10.0.0.1:4001", "10.0.0.2:84")
	w.b.Open(sa, open(proto.Active, ta, 3))
	w.b.Open(sb2, open(proto.Passive, tb, 4))
	for _, s := range []*session{sa, sb2} {
		if m := s.next(t); m.Type != proto.TCP || m.Reason != proto.ReasonNoListener {
			t.Fatalf("to a refused listener: %+v, want TCP(no-listener)", m)
		}
	}
	w.b.Listen(sb, ap("10.0.0.2:81"), false)
	w.b.Listen(sb2, ap("10.0.0.2:84"), true)
	w.b.Detach(sb2)
	w.b.Listen(sb, ap("10.0.0.2:85"), true)
	if got := w.listening(w.g2); fmt.Sprint(got) != "[10.0.0.2:80 10.0.0.2:85]" {
		t.Fatalf("listening %v after UNLISTEN and a detach, want 80 and 85", got)
	}
}

// TestPendingOpenLimit: an OPEN beyond the guest's pending limit gets
// TCP(control-limit) at once, without a lookup; a verdict (here the
// pairing timeout) or the session going gives the room back.
func TestPendingOpenLimit(t *testing.T) {
	ct := &countingTracker{}
	w := newWorldOpts(t, policy.Spec{}, broker.Options{Limits: broker.Limits{PendingOpensPerGuest: 2}})
	ct.Tracker = w.ct
	w.b = broker.New(nopLog, ct, w.m, mustCompile(t, policy.Spec{}), []*broker.Guest{w.g1, w.g2},
		broker.Options{PairingTimeout: 200 * time.Millisecond, LookupTimeout: 10 * time.Millisecond,
			Limits: broker.Limits{PendingOpensPerGuest: 2}})
	t.Cleanup(w.b.Close)
	sa, sb := w.sessions()
	var ta [3]ctrack.Tuple
	for i := range ta {
		ta[i], _ = w.conn(fmt.Sprintf("10.0.0.1:%d", 4000+i), "10.0.0.2:80")
	}
	w.b.Open(sa, open(proto.Active, ta[0], 1))
	w.b.Open(sa, open(proto.Active, ta[1], 2))
	before := ct.n.Load()
	w.b.Open(sa, open(proto.Active, ta[2], 3))
	if m := sa.next(t); m.Type != proto.TCP || m.Reason != proto.ReasonControlLimit || m.ReqID != 3 {
		t.Fatalf("third pending OPEN got %+v, want TCP(control-limit) for request 3", m)
	}
	if n := ct.n.Load() - before; n != 0 {
		t.Fatalf("a refused OPEN cost %d conntrack lookups, want 0", n)
	}
	if got := w.limited(t, "opens"); got != 1 {
		t.Fatalf("limited opens %v, want 1", got)
	}
	for range 2 {
		if m := sa.next(t); m.Type != proto.TCP || m.Reason != proto.ReasonTimeout {
			t.Fatalf("waiting OPEN got %+v, want TCP(timeout)", m)
		}
	}
	ta2, _ := w.conn("10.0.0.1:5000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta2, 4))
	sa2 := newSession(w.g1)
	w.b.Attach(sa2)
	ta3, _ := w.conn("10.0.0.1:5001", "10.0.0.2:80")
	w.b.Open(sa2, open(proto.Active, ta3, 5))
	sa.none(t) // both admitted: they wait for their peers
	sa2.none(t)
	w.b.Detach(sa) // its waiting OPEN goes, and with it its count
	ta4, tb4 := w.conn("10.0.0.1:5002", "10.0.0.2:80")
	w.b.Open(sa2, open(proto.Active, ta4, 6))
	w.b.Open(sb, open(proto.Passive, tb4, 7))
	if m := sb.next(t); m.Type != proto.Ready {
		t.Fatalf("after the detach, an OPEN got %+v, want READY", m)
	}
}

var nopLog = hclog.NewNullLogger()

// countingTracker counts lookups; with notYet set it reports every entry
// as not yet ESTABLISHED.
type countingTracker struct {
	ctrack.Tracker
	n       atomic.Int64
	notYet  bool
	closing bool // the connection closed before its OPEN was served (TIME_WAIT)
}

func (c *countingTracker) Lookup(t ctrack.Tuple) (ctrack.Entry, error) {
	c.n.Add(1)
	e, err := c.Tracker.Lookup(t)
	if c.notYet {
		e.Assured = false
	}
	if c.closing {
		e.TCPState = 7 // TIME_WAIT
	}
	return e, err
}

func (c *countingTracker) Destroyed(ctx context.Context, fn func(ctrack.Entry)) error {
	return c.Tracker.Destroyed(ctx, fn)
}

// TestLookupCost: an OPEN whose tuple has no conntrack entry costs one
// lookup, INTENT or not, either role; an entry that is not yet ESTABLISHED
// is retried (within LookupTimeout) only for an active side, and only
// while it may still become ESTABLISHED: a closing one costs one lookup
// (a short connection, closed before its OPEN was served, must not hold
// up its guest's session for LookupTimeout).
func TestLookupCost(t *testing.T) {
	for _, tc := range []struct {
		name      string
		role      proto.Role
		intent    bool
		entry     bool
		notYet    bool
		closing   bool
		want      proto.Reason
		lookupsGT int64 // more than this many lookups
		lookupsLE int64 // at most this many
	}{
		{"active, no entry, no intent", proto.Active, false, false, false, false, proto.ReasonNoConntrack, 0, 1},
		{"active, no entry, intent", proto.Active, true, false, false, false, proto.ReasonNoConntrack, 0, 1},
		{"passive, no entry", proto.Passive, false, false, false, false, proto.ReasonNoConntrack, 0, 1},
		{"active, not established, no intent", proto.Active, false, true, true, false, proto.ReasonNotEstablished, 1, 1000},
		{"passive, not established", proto.Passive, false, true, true, false, proto.ReasonNotEstablished, 0, 1},
		{"active, not established, intent", proto.Active, true, true, true, false, proto.ReasonNotEstablished, 1, 1000},
		{"active, closing", proto.Active, false, true, false, true, proto.ReasonNotEstablished, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, policy.Spec{})
			ct := &countingTracker{Tracker: w.ct, notYet: tc.notYet, closing: tc.closing}
			b := broker.New(nopLog, ct, w.m, mustCompile(t, policy.Spec{}), []*broker.Guest{w.g1, w.g2},
				broker.Options{PairingTimeout: 100 * time.Millisecond, LookupTimeout: 20 * time.Millisecond})
			t.Cleanup(b.Close)
			sa, sb := newSession(w.g1), newSession(w.g2)
			b.Attach(sa)
			b.Attach(sb)
			ta := ctrack.Tuple{Src: ap("10.0.0.1:4000"), Dst: ap("10.0.0.2:80")}
			if tc.entry {
				w.ct.Add(ta, ta.Reverse(), 0)
			}
			s, tu := sa, ta
			if tc.role == proto.Passive {
				s, tu = sb, ta.Reverse()
			}
			if tc.intent {
			}
			b.Open(s, open(tc.role, tu, 1))
			if m := s.next(t); m.Type != proto.TCP || m.Reason != tc.want {
				t.Fatalf("got %+v, want TCP(%s)", m, tc.want)
			}
			if n := ct.n.Load(); n <= tc.lookupsGT || n > tc.lookupsLE {
				t.Fatalf("%d conntrack lookups, want more than %d and at most %d", n, tc.lookupsGT, tc.lookupsLE)
			}
		})
	}
}

// TestGuestsListing: the listing counts sessions, flows and listeners per
// guest from one copy under the lock.
func TestGuestsListing(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	sb2 := newSession(w.g2)
	w.b.Attach(sb2)
	w.b.Listen(sb2, ap("10.0.0.2:80"), true) // the same address on two sessions: listed once
	w.b.Listen(sb2, netip.AddrPortFrom(netip.IPv4Unspecified(), 81), true)
	w.connect(sa, sb, "4000", 1)
	sa.next(t)
	sb.next(t)
	gs := w.b.Guests()
	if len(gs) != 3 {
		t.Fatalf("guests %+v, want 3", gs)
	}
	if g := gs[1]; g.Name != "g2" || g.Sessions != 2 || g.Flows != 1 || fmt.Sprint(g.Listening) != "[0.0.0.0:81 10.0.0.2:80]" {
		t.Fatalf("g2 listed as %+v, want 2 sessions, 1 flow, listening on 0.0.0.0:81 and 10.0.0.2:80", g)
	}
	if g := gs[0]; g.Sessions != 1 || g.Flows != 1 || len(g.Listening) != 0 {
		t.Fatalf("g1 listed as %+v, want 1 session, 1 flow, no listeners", g)
	}
	if n := w.b.Counts(); n != (broker.Counts{Guests: 3, Sessions: 3, Flows: 1, Conns: 1}) {
		t.Fatalf("counts %+v, want 3 guests, 3 sessions, 1 flow", n)
	}
}

func mustCompile(t *testing.T, s policy.Spec) *policy.Table {
	t.Helper()
	tab, err := policy.Compile(s)
	if err != nil {
		t.Fatal(err)
	}
	return tab
}

// TestOpenRate: OPENs beyond OpensPerSecond (after a burst of as many)
// get TCP(control-limit) at once, without a lookup.
func TestOpenRate(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	ct := &countingTracker{Tracker: w.ct}
	b := broker.New(nopLog, ct, w.m, mustCompile(t, policy.Spec{}), []*broker.Guest{w.g1, w.g2},
		broker.Options{PairingTimeout: 100 * time.Millisecond, LookupTimeout: 10 * time.Millisecond, Limits: broker.Limits{OpensPerSecond: 10}})
	t.Cleanup(b.Close)
	sa := &session{g: w.g1, got: make(chan proto.Msg, 64)}
	b.Attach(sa)
	refused := 0
	for i := range 30 {
		b.Open(sa, open(proto.Active, ctrack.Tuple{Src: ap(fmt.Sprintf("10.0.0.1:%d", 4000+i)), Dst: ap("10.0.0.2:80")}, uint32(i)))
		if m := sa.next(t); m.Reason == proto.ReasonControlLimit {
			refused++
		}
	}
	// 10 at once, and maybe one more refilled meanwhile.
	if refused < 19 || refused > 20 || ct.n.Load() != int64(30-refused) {
		t.Fatalf("%d of 30 OPENs refused after %d lookups; want 20 (or 19) refused, and a lookup for each other one", refused, ct.n.Load())
	}
	if got := w.limited(t, "open-rate"); got != float64(refused) {
		t.Fatalf("limited open-rate %v, want %d", got, refused)
	}
}
