package broker_test

import (
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// expect reads s's next message and checks its type, reason (if not none)
// and request id.
func (s *session) expect(t *testing.T, typ proto.Type, reason proto.Reason, req uint32) proto.Msg {
	t.Helper()
	m := s.next(t)
	if m.Type != typ || (reason != proto.ReasonNone && m.Reason != reason) || m.ReqID != req {
		t.Fatalf("got %+v, want %s(%s) for request %d", m, typ, reason, req)
	}
	return m
}

// left sends LEFT for side of the flow r (a READY or DOWN) from s.
func (w *world) left(s *session, r proto.Msg, side proto.Side) {
	w.b.Left(s, proto.Msg{Type: proto.Left, ReqID: r.ReqID, RegionID: r.RegionID, Slot: r.Slot, Gen: r.Gen, Side: side})
}

// record returns the one connection record.
func (w *world) record(t *testing.T) broker.FlowInfo {
	t.Helper()
	fl := w.b.Flows()
	if len(fl) != 1 {
		t.Fatalf("records %+v, want one", fl)
	}
	return fl[0]
}

// paired connects g1:port to g2:80 with requests 1 (A) and 2 (B) and
// returns both READYs.
func (w *world) paired(t *testing.T, sa, sb *session, port string) (ra, rb proto.Msg) {
	t.Helper()
	w.connect(sa, sb, port, 1)
	return sa.expect(t, proto.Ready, proto.ReasonNone, 1), sb.expect(t, proto.Ready, proto.ReasonNone, 2)
}

// counter reads shunt_<name> (a counter or gauge) with the given label
// values, in the labels' alphabetical order (reason before to).
func counter(t *testing.T, w *world, name string, labels ...string) float64 {
	t.Helper()
	full := map[string]string{"fallbacks": "shunt_fallbacks_total", "switches": "shunt_switches_total", "conns": "shunt_connections", "floor": "shunt_ring_floor_total"}[name]
	mfs, err := w.m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != full {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for i, l := range m.GetLabel() {
				if i >= len(labels) || l.GetValue() != labels[i] {
					continue next
				}
			}
			if m.Counter != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
		return 0
	}
	t.Fatalf("no metric %s", full)
	return 0
}

// TestSimultaneousConnects: two guests connect to each other's listeners
// at once, all four OPENs sent right after connect and accept, in any
// order: both connections pair.
func TestSimultaneousConnects(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	w.b.Listen(sa, ap("10.0.0.1:81"), true)
	t1a, t1b := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	t2a, t2b := w.conn("10.0.0.2:5000", "10.0.0.1:81")
	w.b.Open(sa, open(proto.Active, t1a, 1))
	w.b.Open(sb, open(proto.Active, t2a, 11))
	w.b.Open(sa, open(proto.Passive, t2b, 2))
	w.b.Open(sb, open(proto.Passive, t1b, 12))
	got := map[uint32]proto.Msg{}
	for range 2 {
		for _, s := range []*session{sa, sb} {
			m := s.next(t)
			if m.Type != proto.Ready {
				t.Fatalf("got %+v, want READY", m)
			}
			got[m.ReqID] = m
		}
	}
	for _, req := range []uint32{1, 2, 11, 12} {
		if _, ok := got[req]; !ok {
			t.Fatalf("no READY for request %d: %+v", req, got)
		}
	}
	if got[1].Slot != got[12].Slot || got[11].Slot != got[2].Slot || got[1].Slot == got[2].Slot {
		t.Fatalf("READYs %+v: want two flows, 1 with 12 and 11 with 2", got)
	}
}

// TestPolicyFlip: a reload to tcp sends DOWN(policy-reload) to both ends;
// a reload back to fastpath before they left changes nothing until both
// LEFT (never READY while the rings are not freed), then READY again on a
// fresh ring pair, with the same request ids. Switches are counted.
func TestPolicyFlip(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ra, _ := w.paired(t, sa, sb, "4000")
	tcp, fast := mustCompile(t, policy.Spec{Default: "tcp"}), mustCompile(t, policy.Spec{})
	if down, up := w.b.SetPolicy(tcp); down != 1 || up != 0 {
		t.Fatalf("SetPolicy(tcp) moved %d down, %d up; want 1, 0", down, up)
	}
	da := sa.expect(t, proto.Down, proto.ReasonPolicyReload, 1)
	db := sb.expect(t, proto.Down, proto.ReasonPolicyReload, 2)
	if da.Slot != ra.Slot || da.Gen != ra.Gen || db.Gen != ra.Gen {
		t.Fatalf("DOWN %+v, %+v: want the flow of %+v", da, db, ra)
	}
	if r := w.record(t); r.Path != "leaving" || r.Reason != "policy-reload" {
		t.Fatalf("record %+v, want leaving (policy-reload)", r)
	}
	w.b.SetPolicy(fast)
	w.left(sa, da, proto.SideA)
	sa.none(t)
	sb.none(t)
	w.left(sb, db, proto.SideB)
	ra2 := sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	rb2 := sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	if ra2.Gen == ra.Gen || ra2.Gen != rb2.Gen || ra2.Side != proto.SideA || rb2.Side != proto.SideB {
		t.Fatalf("READY again %+v, %+v: want a fresh ring pair (not gen %d)", ra2, rb2, ra.Gen)
	}
	if r := w.record(t); r.Path != "rings" || r.Switches != 3 {
		t.Fatalf("record %+v, want on the rings after 3 switches", r)
	}
	if n := counter(t, w, "switches", "policy-reload", "tcp"); n != 1 {
		t.Fatalf("switches to tcp (policy-reload) %v, want 1", n)
	}
	if n := counter(t, w, "switches", "policy-reload", "rings"); n != 1 {
		t.Fatalf("switches to rings after policy-reload %v, want 1", n)
	}
	if n := counter(t, w, "conns", "rings"); n != 1 {
		t.Fatalf("connections on rings %v, want 1", n)
	}
}

// TestPolicyReloadUpgradesTCP: a connection kept on TCP by policy moves to
// the rings when a reload allows it; the fallback was counted once.
func TestPolicyReloadUpgradesTCP(t *testing.T) {
	w := newWorld(t, policy.Spec{Default: "tcp"})
	sa, sb := w.sessions()
	w.connect(sa, sb, "4000", 1)
	sa.expect(t, proto.TCP, proto.ReasonPolicy, 1)
	sb.expect(t, proto.TCP, proto.ReasonPolicy, 2)
	if n := counter(t, w, "fallbacks", "policy"); n != 1 {
		t.Fatalf("fallbacks{policy} %v, want 1 (once per connection)", n)
	}
	if r := w.record(t); r.Path != "tcp" || r.Reason != "policy" {
		t.Fatalf("record %+v, want tcp (policy)", r)
	}
	if _, up := w.b.SetPolicy(mustCompile(t, policy.Spec{})); up != 1 {
		t.Fatalf("SetPolicy(fastpath) moved %d up, want 1", up)
	}
	sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
}

// TestFallbackCountedOnce: a connection refused at pairing, or whose
// waiting side timed out (the late side getting the remembered verdict),
// counts one fallback, not one per end.
func TestFallbackCountedOnce(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sb.expect(t, proto.TCP, proto.ReasonTimeout, 2)
	w.b.Open(sa, open(proto.Active, ta, 1))
	sa.expect(t, proto.TCP, proto.ReasonTimeout, 1)
	if n := counter(t, w, "fallbacks", "timeout"); n != 1 {
		t.Fatalf("fallbacks{timeout} %v, want 1", n)
	}
	w.b.Listen(sb, ap("10.0.0.2:80"), false)
	w.connect(sa, sb, "4001", 3)
	sa.expect(t, proto.TCP, proto.ReasonNoListener, 3)
	if n := counter(t, w, "fallbacks", "no-listener"); n != 1 {
		t.Fatalf("fallbacks{no-listener} %v, want 1", n)
	}
}

// TestVersion2Session: a version-2 library's OPEN gets TCP(version), and
// so does its waiting peer's, at once.
func TestVersion2Session(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	sa.v2 = true
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sb.none(t)
	start := time.Now()
	w.b.Open(sa, open(proto.Active, ta, 1))
	sa.expect(t, proto.TCP, proto.ReasonVersion, 1)
	sb.expect(t, proto.TCP, proto.ReasonVersion, 2)
	if d := time.Since(start); d > 50*time.Millisecond {
		t.Fatalf("the peer learnt after %v, want at once", d)
	}
	if n := counter(t, w, "fallbacks", "version"); n != 1 {
		t.Fatalf("fallbacks{version} %v, want 1", n)
	}
	// The other order: the version-2 side first, its peer gets the
	// remembered verdict.
	ta, tb = w.conn("10.0.0.1:4001", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 3))
	sa.expect(t, proto.TCP, proto.ReasonVersion, 3)
	w.b.Open(sb, open(proto.Passive, tb, 4))
	sb.expect(t, proto.TCP, proto.ReasonVersion, 4)
}

// TestPeerGone: a guest that goes away: its peer gets DOWN(peer-gone), the
// gone side counts as left; the survivor's LEFT frees the ring pair and
// its CLOSE ends the record. No READY again: one end is gone.
func TestPeerGone(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	w.paired(t, sa, sb, "4000")
	w.b.Detach(sa)
	d := sb.expect(t, proto.Down, proto.ReasonPeerGone, 2)
	if r := w.record(t); r.Path != "leaving" || r.Attached != "b" {
		t.Fatalf("record %+v, want leaving, held by b", r)
	}
	w.left(sb, d, proto.SideB)
	if r := w.record(t); r.Path != "tcp" || r.Ring != 0 {
		t.Fatalf("record %+v, want on TCP without rings", r)
	}
	sb.none(t)
	w.b.CloseConn(sb, proto.Msg{Type: proto.Close, ReqID: 2, Side: proto.SideB})
	if fl := w.b.Flows(); len(fl) != 0 {
		t.Fatalf("records %+v after the survivor's CLOSE, want none", fl)
	}
}

// TestPeerGoneWhileLeaving: an end goes away after DOWN, before its LEFT:
// it never writes the leave mark the survivor's reader waits for, so the
// survivor gets DOWN(peer-gone) too, and drains and leaves without it.
func TestPeerGoneWhileLeaving(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	w.paired(t, sa, sb, "4000")
	r := w.record(t)
	if !w.b.Downgrade(r.Name) {
		t.Fatal("Downgrade found nothing")
	}
	sa.expect(t, proto.Down, proto.ReasonAdmin, 1)
	sb.expect(t, proto.Down, proto.ReasonAdmin, 2)
	w.b.Detach(sa)
	d := sb.expect(t, proto.Down, proto.ReasonPeerGone, 2)
	w.left(sb, d, proto.SideB)
	if r := w.record(t); r.Path != "tcp" || r.Ring != 0 {
		t.Fatalf("record %+v, want on TCP without rings", r)
	}
}

// TestCloseOnTCP: CLOSE of a connection on TCP ends its record once both
// ends closed; a CLOSE of an OPEN still waiting ends the wait.
func TestCloseOnTCP(t *testing.T) {
	w := newWorld(t, policy.Spec{Default: "tcp"})
	sa, sb := w.sessions()
	w.connect(sa, sb, "4000", 1)
	sa.expect(t, proto.TCP, proto.ReasonPolicy, 1)
	sb.expect(t, proto.TCP, proto.ReasonPolicy, 2)
	w.b.CloseConn(sa, proto.Msg{Type: proto.Close, ReqID: 1, Side: proto.SideA})
	if r := w.record(t); r.Attached != "b" {
		t.Fatalf("record %+v, want held by b only", r)
	}
	w.b.CloseConn(sb, proto.Msg{Type: proto.Close, ReqID: 2, Side: proto.SideB})
	if fl := w.b.Flows(); len(fl) != 0 {
		t.Fatalf("records %+v, want none", fl)
	}
	_, tb := w.conn("10.0.0.1:4001", "10.0.0.2:80")
	w.b.Open(sb, open(proto.Passive, tb, 4))
	w.b.CloseConn(sb, proto.Msg{Type: proto.Close, ReqID: 4, Side: proto.SideB})
	sb.none(t)
	time.Sleep(150 * time.Millisecond) // past the pairing timeout: no verdict for a closed OPEN
	sb.none(t)
}

// TestConntrackTupleReuse: a connection's tuple reused by a new one (as
// with tcp_tw_reuse) while the old entry's DESTROY is still on its way:
// that DESTROY does not touch the new connection; the new entry's does.
func TestConntrackTupleReuse(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	old, _ := w.ct.Lookup(ta)
	// The old connection closes; the kernel replaces its entry with the
	// new connection's, same tuple, new id.
	w.b.CloseConn(sa, proto.Msg{Type: proto.Close, ReqID: 1, Side: proto.SideA})
	sb.expect(t, proto.Down, proto.ReasonPeerGone, 2)
	w.b.CloseConn(sb, proto.Msg{Type: proto.Close, ReqID: 2, Side: proto.SideB})
	w.ct.Delete(old.ID)
	w.ct.Add(ta, ta.Reverse(), 0)
	w.b.Open(sa, open(proto.Active, ta, 3))
	w.b.Open(sb, open(proto.Passive, ta.Reverse(), 4))
	sa.expect(t, proto.Ready, proto.ReasonNone, 3)
	sb.expect(t, proto.Ready, proto.ReasonNone, 4)
	w.b.ConntrackDestroyed(old) // late
	sa.none(t)
	sb.none(t)
	if r := w.record(t); r.Path != "rings" {
		t.Fatalf("new connection %+v, want it untouched on the rings", r)
	}
	cur, _ := w.ct.Lookup(ta)
	w.ct.Delete(cur.ID)
	w.b.ConntrackDestroyed(cur)
	sa.expect(t, proto.Down, proto.ReasonConntrackGone, 3)
	sb.expect(t, proto.Down, proto.ReasonConntrackGone, 4)
}

// TestConntrackTupleReuseSameID: the kernel made the new connection's
// entry in the memory of the old one it killed at the new SYN, so both
// have one id, and the old entry's DESTROY comes after the new connection
// paired (integration's TestServerRedisTupleReuse saw it): the new entry
// is still in the table, so the DESTROY is not its, and the connection
// stays on the rings.
func TestConntrackTupleReuseSameID(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	cur, _ := w.ct.Lookup(ta)
	old := cur // the old entry: the same tuple and id, gone before the new one was made
	w.b.ConntrackDestroyed(old)
	sa.none(t)
	sb.none(t)
	if r := w.record(t); r.Path != "rings" {
		t.Fatalf("connection %+v after an older entry's DESTROY with its id, want it untouched on the rings", r)
	}
}

// TestConntrackReuseWhileOldRecordLives: the old connection's record is
// still there (its ends did not CLOSE yet) when the tuple is reused: the
// new connection pairs, and the old entry's DESTROY touches neither.
func TestConntrackReuseWhileOldRecordLives(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	old, _ := w.ct.Lookup(ta)
	w.ct.Delete(old.ID)
	w.ct.Add(ta, ta.Reverse(), 0)
	w.b.Open(sa, open(proto.Active, ta, 3))
	w.b.Open(sb, open(proto.Passive, ta.Reverse(), 4))
	sa.expect(t, proto.Ready, proto.ReasonNone, 3)
	sb.expect(t, proto.Ready, proto.ReasonNone, 4)
	w.b.ConntrackDestroyed(old)
	sa.none(t)
	sb.none(t)
}

// TestAdminDowngrade: an operator's downgrade (by the record's or the ring
// pair's name) lasts until the next policy reload.
func TestAdminDowngrade(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	w.paired(t, sa, sb, "4000")
	r := w.record(t)
	if !strings.HasPrefix(r.Conn, "c") || r.Name == r.Conn {
		t.Fatalf("record %+v: want a record name and its ring pair's", r)
	}
	if !w.b.Downgrade(r.Name) || w.b.Downgrade(r.Conn) {
		t.Fatal("Downgrade: want the first to move it and the second to find it no longer on the rings")
	}
	w.left(sa, sa.expect(t, proto.Down, proto.ReasonAdmin, 1), proto.SideA)
	w.left(sb, sb.expect(t, proto.Down, proto.ReasonAdmin, 2), proto.SideB)
	sa.none(t)
	w.b.SetPolicy(mustCompile(t, policy.Spec{}))
	sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
}

// TestShutdown: a graceful stop sends DOWN(shutdown) to both ends and
// waits for their LEFTs; no READY goes out meanwhile.
func TestShutdown(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	w.paired(t, sa, sb, "4000")
	held := make(chan int, 1)
	go func() { held <- w.b.Shutdown(5 * time.Second) }()
	da := sa.expect(t, proto.Down, proto.ReasonShutdown, 1)
	db := sb.expect(t, proto.Down, proto.ReasonShutdown, 2)
	w.connect(sa, sb, "4001", 3)
	sa.expect(t, proto.TCP, proto.ReasonShutdown, 3)
	sb.expect(t, proto.TCP, proto.ReasonShutdown, 4)
	w.left(sa, da, proto.SideA)
	w.left(sb, db, proto.SideB)
	select {
	case n := <-held:
		if n != 0 {
			t.Fatalf("Shutdown: %d ring pairs still held, want 0", n)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Shutdown did not return after both LEFTs")
	}
	sa.none(t)
}

// TestShutdownBounded: an end that never leaves does not hold hostd's
// stop past its bound; the ring pair stays (the next hostd adopts it).
func TestShutdownBounded(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	w.paired(t, sa, sb, "4000")
	start := time.Now()
	if n := w.b.Shutdown(50 * time.Millisecond); n != 1 {
		t.Fatalf("Shutdown: %d ring pairs held, want 1", n)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("Shutdown took %v", d)
	}
}

// TestUnsolicitedLeft: an end that left its rings by itself (an error on
// them) moves the connection to TCP: the other end gets DOWN.
func TestUnsolicitedLeft(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ra, _ := w.paired(t, sa, sb, "4000")
	w.left(sa, ra, proto.SideA)
	sb.expect(t, proto.Down, proto.ReasonPeerGone, 2)
	sa.none(t)
}

var _ ctrack.Tracker = (*countingTracker)(nil)

// restartedWorld pairs one connection on the rings (ta, its READY ra),
// then stands for a hostd restart: the broker is closed and a new one
// (b2) adopts the flow from the region and looks its entry up again;
// both guests' new sessions (na, nb) attach, nb listening.
func restartedWorld(t *testing.T) (b2 *broker.Broker, na, nb *session, ta ctrack.Tuple, ra proto.Msg) {
	t.Helper()
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ta = w.connect(sa, sb, "4000", 1)
	ra = sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	w.b.Close() // hostd killed: nothing changes in the region
	b2 = broker.New(nopLog, w.ct, metrics.New(), mustCompile(t, policy.Spec{}), []*broker.Guest{w.g1, w.g2, w.g3},
		broker.Options{PairingTimeout: 100 * time.Millisecond, LookupTimeout: 10 * time.Millisecond})
	t.Cleanup(b2.Close)
	if n := b2.Adopt(w.g1.Group, time.Minute); n != 1 {
		t.Fatalf("adopted %d flows, want 1", n)
	}
	b2.Resync()
	na, nb = newSession(w.g1), newSession(w.g2)
	b2.Attach(na)
	b2.Attach(nb)
	b2.Listen(nb, ap("10.0.0.2:80"), true)
	return b2, na, nb, ta, ra
}

// TestRestartAdoptsThenReannounced: after a hostd restart the flows are
// adopted from the region; the ends REATTACH, and a downgrade reaches them
// by ring pair (request id 0: REATTACH names none). Once they left, their
// OPENs again (same request ids, as the libraries re-announce connections
// on TCP) bring the record its request ids, and it goes back to the rings.
func TestRestartAdoptsThenReannounced(t *testing.T) {
	b2, na, nb, ta, ra := restartedWorld(t)
	re := proto.Msg{Type: proto.Reattach, RegionID: ra.RegionID, Slot: ra.Slot, Gen: ra.Gen, Local: ta.Src, Remote: ta.Dst}
	re.Side = proto.SideA
	b2.Reattach(na, re)
	re.Side = proto.SideB
	b2.Reattach(nb, re)
	na.none(t)
	b2.SetPolicy(mustCompile(t, policy.Spec{Default: "tcp"}))
	da := na.expect(t, proto.Down, proto.ReasonPolicyReload, 0)
	db := nb.expect(t, proto.Down, proto.ReasonPolicyReload, 0)
	if da.Slot != ra.Slot || da.Gen != ra.Gen {
		t.Fatalf("DOWN %+v, want the adopted flow %+v", da, ra)
	}
	b2.SetPolicy(mustCompile(t, policy.Spec{}))
	b2.Left(na, proto.Msg{Type: proto.Left, RegionID: da.RegionID, Slot: da.Slot, Gen: da.Gen, Side: proto.SideA})
	b2.Left(nb, proto.Msg{Type: proto.Left, RegionID: db.RegionID, Slot: db.Slot, Gen: db.Gen, Side: proto.SideB})
	na.none(t) // no request ids: no READY
	b2.Open(na, open(proto.Active, ta, 1))
	b2.Open(nb, open(proto.Passive, ta.Reverse(), 2))
	na.expect(t, proto.Ready, proto.ReasonNone, 1)
	nb.expect(t, proto.Ready, proto.ReasonNone, 2)
	if fl := b2.Flows(); len(fl) != 1 || fl[0].Path != "rings" {
		t.Fatalf("records %+v, want the one connection on the rings", fl)
	}
}

// TestRestartOneEndReopens: after a hostd restart one end REATTACHes its
// adopted ring pair while the other, which left it while no hostd ran,
// OPENs the connection again on TCP: the record takes that OPEN (no
// pairing that waits for an OPEN the first end never sends), the adopted
// pair is freed once the first end left it, and the connection returns to
// the rings. (CI saw btl/shunt's lease stay on TCP after a restart: the
// reader had seen the writer leave before it reconnected.)
func TestRestartOneEndReopens(t *testing.T) {
	b2, na, nb, ta, ra := restartedWorld(t)
	b2.Reattach(na, proto.Msg{Type: proto.Reattach, ReqID: 1, RegionID: ra.RegionID, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideA, Local: ta.Src, Remote: ta.Dst})
	b2.SetPolicy(mustCompile(t, policy.Spec{Default: "tcp"})) // as hostd's start moves adopted flows off until proven
	da := na.expect(t, proto.Down, proto.ReasonPolicyReload, 1)
	b2.Open(nb, open(proto.Passive, ta.Reverse(), 2))
	time.Sleep(200 * time.Millisecond) // past the pairing timeout
	nb.none(t)
	b2.SetPolicy(mustCompile(t, policy.Spec{}))
	b2.Left(na, proto.Msg{Type: proto.Left, RegionID: da.RegionID, Slot: da.Slot, Gen: da.Gen, Side: proto.SideA})
	na.expect(t, proto.Ready, proto.ReasonNone, 1)
	nb.expect(t, proto.Ready, proto.ReasonNone, 2)
	if fl := b2.Flows(); len(fl) != 1 || fl[0].Path != "rings" {
		t.Fatalf("records %+v, want the one connection on the rings", fl)
	}
}

// TestRestartOneEndReopensOnRings: as TestRestartOneEndReopens, with the
// adopted pair still on the rings when the OPEN comes (a hostd whose start
// did not move adopted flows off: no ruleset watch): the end that
// REATTACHed is told to leave, and the freed pair returns to the rings.
func TestRestartOneEndReopensOnRings(t *testing.T) {
	b2, na, nb, ta, ra := restartedWorld(t)
	b2.Reattach(na, proto.Msg{Type: proto.Reattach, ReqID: 1, RegionID: ra.RegionID, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideA, Local: ta.Src, Remote: ta.Dst})
	na.none(t)
	b2.Open(nb, open(proto.Passive, ta.Reverse(), 2))
	da := na.expect(t, proto.Down, proto.ReasonPeerGone, 1)
	nb.none(t)
	b2.Left(na, proto.Msg{Type: proto.Left, RegionID: da.RegionID, Slot: da.Slot, Gen: da.Gen, Side: proto.SideA})
	na.expect(t, proto.Ready, proto.ReasonNone, 1)
	nb.expect(t, proto.Ready, proto.ReasonNone, 2)
}

// TestRestartOneEndReopensFirst: as TestRestartOneEndReopens, but the
// end that left the adopted rings OPENs before the other REATTACHes: its
// waiting OPEN takes its end of the record at the REATTACH.
func TestRestartOneEndReopensFirst(t *testing.T) {
	b2, na, nb, ta, ra := restartedWorld(t)
	b2.SetPolicy(mustCompile(t, policy.Spec{Default: "tcp"})) // as hostd's start moves adopted flows off until proven
	b2.Open(nb, open(proto.Passive, ta.Reverse(), 2))
	b2.Reattach(na, proto.Msg{Type: proto.Reattach, ReqID: 1, RegionID: ra.RegionID, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideA, Local: ta.Src, Remote: ta.Dst})
	da := na.expect(t, proto.Down, proto.ReasonPolicyReload, 1)
	time.Sleep(200 * time.Millisecond) // past the pairing timeout
	nb.none(t)
	b2.SetPolicy(mustCompile(t, policy.Spec{}))
	b2.Left(na, proto.Msg{Type: proto.Left, RegionID: da.RegionID, Slot: da.Slot, Gen: da.Gen, Side: proto.SideA})
	na.expect(t, proto.Ready, proto.ReasonNone, 1)
	nb.expect(t, proto.Ready, proto.ReasonNone, 2)
}

// TestPassiveBeforeClientSession: the client guest has no session yet (a
// fresh process's session may still be on its way): the passive OPEN gets
// TCP(no-intent) at once, but still waits for its peer, and pairs if the
// active OPEN comes; else its fallback is counted once, at the timeout.
func TestPassiveBeforeClientSession(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sb := newSession(w.g2)
	w.b.Attach(sb)
	w.b.Listen(sb, ap("10.0.0.2:80"), true)
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sb.expect(t, proto.TCP, proto.ReasonNoIntent, 2)
	sa := newSession(w.g1)
	w.b.Attach(sa)
	w.b.Open(sa, open(proto.Active, ta, 1))
	sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	if n := counter(t, w, "fallbacks", "no-intent"); n != 0 {
		t.Fatalf("fallbacks{no-intent} %v for a connection that paired, want 0", n)
	}
	w.b.Detach(sa)
	_, tb2 := w.conn("10.0.0.1:4001", "10.0.0.2:80")
	w.b.Open(sb, open(proto.Passive, tb2, 4))
	sb.next(t) // DOWN(peer-gone) of the first connection
	sb.expect(t, proto.TCP, proto.ReasonNoIntent, 4)
	time.Sleep(150 * time.Millisecond) // the pairing timeout: counted, not sent again
	sb.none(t)
	if n := counter(t, w, "fallbacks", "no-intent"); n != 1 {
		t.Fatalf("fallbacks{no-intent} %v, want 1", n)
	}
}

// TestListenAfterActiveOpen: after a hostd restart the client's session
// may re-announce its connection before the server's session re-sent its
// LISTEN: the active OPEN gets TCP(no-listener) at once but waits, and the
// connection pairs when the server's LISTEN and OPEN come.
func TestListenAfterActiveOpen(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := newSession(w.g1), newSession(w.g2)
	w.b.Attach(sa)
	w.b.Attach(sb)
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	sa.expect(t, proto.TCP, proto.ReasonNoListener, 1)
	w.b.Listen(sb, ap("10.0.0.2:80"), true)
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
}
