package broker_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// TestMigration: MigrateOut sends DOWN(migrating) to both ends of the
// migrating guest's connection; after both LEFT it stays on TCP, and
// nothing (a policy reload included) gives it READY. The guest's session
// ends (its VM moved to another QEMU) and a new session OPENs the
// connection again with a new request id: the record takes it (no waiting
// for the peer, whose session never ended), and once MigrateIn came, both
// ends get READY on a fresh ring pair: the new session under its new
// request id, the peer under its old one.
func TestMigration(t *testing.T) {
	for _, tc := range []struct {
		name      string
		active    bool // the migrating guest is the connecting side
		inEarlier bool // MigrateIn before the new session's OPEN
	}{
		{"active-open-then-in", true, false},
		{"active-in-then-open", true, true},
		{"passive-open-then-in", false, false},
		{"passive-in-then-open", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, policy.Spec{})
			sa, sb := w.sessions()
			w.b.Listen(sa, ap("10.0.0.1:81"), true)
			// g1 connects to g2:80 (g1 is A), g2 to g1:81 (g1 is B)
			var mig, peer *session
			var g *broker.Guest
			var migReq, peerReq uint32
			var migRole proto.Role
			var tuple = w.connect(sa, sb, "4000", 1)
			mig, peer, g, migReq, peerReq, migRole = sa, sb, w.g1, 1, 2, proto.Active
			if !tc.active {
				ta, tb := w.conn("10.0.0.2:5000", "10.0.0.1:81")
				sa.expect(t, proto.Ready, proto.ReasonNone, 1)
				sb.expect(t, proto.Ready, proto.ReasonNone, 2)
				w.b.Downgrade("c1") // only the second connection stays on the rings
				w.left(sa, sa.expect(t, proto.Down, proto.ReasonAdmin, 1), proto.SideA)
				w.left(sb, sb.expect(t, proto.Down, proto.ReasonAdmin, 2), proto.SideB)
				w.b.Open(sb, open(proto.Active, ta, 11))
				w.b.Open(sa, open(proto.Passive, tb, 12))
				tuple, migReq, peerReq, migRole = tb, 12, 11, proto.Passive
			}
			rm := mig.expect(t, proto.Ready, proto.ReasonNone, migReq)
			rp := peer.expect(t, proto.Ready, proto.ReasonNone, peerReq)
			if n := w.b.MigrateOut(g); n != 1 {
				t.Fatalf("MigrateOut moved %d connections, want 1", n)
			}
			w.left(mig, mig.expect(t, proto.Down, proto.ReasonMigrating, migReq), rm.Side)
			w.left(peer, peer.expect(t, proto.Down, proto.ReasonMigrating, peerReq), rp.Side)
			if held := w.b.RingsHeld(g); held != 0 {
				t.Fatalf("%d ring pairs held after both LEFT, want 0", held)
			}
			w.b.SetPolicy(mustCompile(t, policy.Spec{}))
			mig.none(t)
			peer.none(t)

			// The VM moved: its old session ends, a new one comes.
			w.b.Detach(mig)
			peer.none(t)
			moved := newSession(g)
			w.b.Attach(moved)
			if !tc.active {
				w.b.Listen(moved, ap("10.0.0.1:81"), true)
			}
			if tc.inEarlier {
				if n := w.b.MigrateIn(g); n != 0 {
					t.Fatalf("MigrateIn moved %d connections before the new session's OPEN, want 0", n)
				}
			}
			w.b.Open(moved, open(migRole, tuple, 100))
			if !tc.inEarlier {
				moved.expect(t, proto.TCP, proto.ReasonMigrating, 100)
				peer.none(t)
				if n := w.b.MigrateIn(g); n != 1 {
					t.Fatalf("MigrateIn moved %d connections, want 1", n)
				}
			}
			r1 := moved.expect(t, proto.Ready, proto.ReasonNone, 100)
			r2 := peer.expect(t, proto.Ready, proto.ReasonNone, peerReq)
			if r1.Gen != r2.Gen || r1.Gen == rm.Gen || r1.Side != rm.Side {
				t.Fatalf("READY %+v and %+v after the migration: want one fresh ring pair (not gen %d), same sides as before", r1, r2, rm.Gen)
			}
			var rec broker.FlowInfo
			for _, f := range w.b.Flows() {
				if f.Path == "rings" {
					rec = f
				}
			}
			if rec.Switches != 3 {
				t.Fatalf("record %+v: want on the rings, 3 switches", rec)
			}
		})
	}
}

// TestMigrationOtherGuestsUntouched: MigrateOut moves only the migrating
// guest's connections, and a new connection of it stays on TCP
// (migrating) until MigrateIn.
func TestMigrationOtherGuestsUntouched(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	s3 := newSession(w.g3)
	w.b.Attach(s3)
	w.paired(t, sa, sb, "4000")
	if n := w.b.MigrateOut(w.g3); n != 0 {
		t.Fatalf("MigrateOut(g3) moved %d connections, want 0", n)
	}
	sa.none(t)
	sb.none(t)
	w.b.MigrateOut(w.g1)
	sa.expect(t, proto.Down, proto.ReasonMigrating, 1)
	sb.expect(t, proto.Down, proto.ReasonMigrating, 2)
	w.connect(sa, sb, "4001", 5)
	sa.expect(t, proto.TCP, proto.ReasonMigrating, 5)
	sb.expect(t, proto.TCP, proto.ReasonMigrating, 6)
}

// TestMigrationCalledOff: MigrateIn before the ends left the rings (a
// migration given up): once both LEFT, the connection returns to the
// rings on a fresh ring pair, and the guest listing says whether it is
// migrating.
func TestMigrationCalledOff(t *testing.T) {
	w := newWorld(t, policy.Spec{})
	sa, sb := w.sessions()
	ra, _ := w.paired(t, sa, sb, "4000")
	w.b.MigrateOut(w.g2)
	if gs := w.b.Guests(); !gs[1].Migrating || gs[0].Migrating {
		t.Fatalf("guests %+v: want only g2 migrating", gs)
	}
	da := sa.expect(t, proto.Down, proto.ReasonMigrating, 1)
	db := sb.expect(t, proto.Down, proto.ReasonMigrating, 2)
	if n := w.b.MigrateIn(w.g2); n != 0 {
		t.Fatalf("MigrateIn moved %d connections still leaving, want 0", n)
	}
	w.left(sa, da, proto.SideA)
	w.left(sb, db, proto.SideB)
	if r := sa.expect(t, proto.Ready, proto.ReasonNone, 1); r.Gen == ra.Gen {
		t.Fatalf("READY %+v: want a fresh ring pair", r)
	}
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	if gs := w.b.Guests(); gs[1].Migrating {
		t.Fatalf("guests %+v: g2 still migrating", gs)
	}
}

// TestMigrationDropsVMRegions: a VM pair region (lingering an hour once
// idle) of a migrating VM goes at once once its connection left the
// rings: DropVMRegions leaves it alone while a flow uses it, then both
// VMs get UNREGION, the device goes from both, and the region counts as
// left until both unplugs ended and its file is dropped. After the move
// (a new session of the VM, MigrateIn) the pair gets a fresh region,
// plugged into both VMs again, and READY in it.
func TestMigrationDropsVMRegions(t *testing.T) {
	h := &fakeHotplug{hold: make(chan struct{})}
	w, p, sa, sb := vmPairWorldOpts(t, h, broker.Options{PairRegionLinger: time.Hour})
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	var ready [2]proto.Msg
	for i, s := range []*session{sa, sb} {
		s.expectType(t, proto.RegionMsg)
		ready[i] = s.expect(t, proto.Ready, proto.ReasonNone, uint32(i+1))
	}
	old := ready[0].RegionID
	if n := w.b.MigrateOut(w.g1); n != 1 {
		t.Fatalf("MigrateOut moved %d connections, want 1", n)
	}
	if dropped, left := w.b.DropVMRegions(w.g1); dropped != 0 || left != 1 {
		t.Fatalf("DropVMRegions with the flow still on its rings: dropped %d, left %d; want 0 and 1", dropped, left)
	}
	w.left(sa, sa.expect(t, proto.Down, proto.ReasonMigrating, 1), proto.SideA)
	w.left(sb, sb.expect(t, proto.Down, proto.ReasonMigrating, 2), proto.SideB)
	if dropped, left := w.b.DropVMRegions(w.g1); dropped != 1 || left != 1 {
		t.Fatalf("DropVMRegions after both LEFT: dropped %d, left %d (unplugging); want 1 and 1", dropped, left)
	}
	for _, s := range []*session{sa, sb} {
		if m := s.next(t); m.Type != proto.Unregion || m.RegionID != old {
			t.Fatalf("%s got %+v, want UNREGION of region %d", s.g.Name, m, old)
		}
	}
	got := map[string]bool{}
	for range 2 {
		select {
		case g := <-h.unplugCh:
			got[g] = true
		case <-time.After(5 * time.Second):
			t.Fatalf("unplugged from %v within 5 s, want both VMs", got)
		}
	}
	if !got["g1"] || !got["g2"] {
		t.Fatalf("unplugged from %v, want g1 and g2", got)
	}
	if _, left := w.b.DropVMRegions(w.g1); left != 1 {
		t.Fatalf("%d regions left while the unplugs run, want 1", left)
	}
	close(h.hold)
	for deadline := time.Now().Add(5 * time.Second); ; {
		_, left := w.b.DropVMRegions(w.g1)
		if _, dropped := p.counts(); left == 0 && dropped == 1 {
			break
		}
		if time.Now().After(deadline) {
			_, dropped := p.counts()
			t.Fatalf("after the unplugs: %d regions left, %d files dropped; want 0 and 1", left, dropped)
		}
		time.Sleep(5 * time.Millisecond)
	}

	// The VM moved: a new session OPENs the connection again; MigrateIn
	// plugs a fresh region into both VMs.
	w.b.Detach(sa)
	moved := newSession(w.g1)
	w.b.Attach(moved)
	w.b.Open(moved, open(proto.Active, ta, 100))
	moved.expect(t, proto.TCP, proto.ReasonMigrating, 100)
	if n := w.b.MigrateIn(w.g1); n != 0 {
		t.Fatalf("MigrateIn: %d connections on the rings at once, want 0 (their region is being plugged)", n)
	}
	for i, s := range []*session{moved, sb} {
		if m := s.expectType(t, proto.RegionMsg); m.RegionID == old {
			t.Fatalf("%s got REGION %+v: want a fresh region, not %d", s.g.Name, m, old)
		}
		if r := s.expect(t, proto.Ready, proto.ReasonNone, []uint32{100, 2}[i]); r.RegionID == old {
			t.Fatalf("%s got READY %+v in the old region", s.g.Name, r)
		}
	}
	h.mu.Lock()
	plugs := h.plugs
	h.mu.Unlock()
	if len(plugs) != 4 {
		t.Fatalf("plugs %v: want two per region", plugs)
	}
	for _, p := range plugs[2:] {
		dev := p[strings.Index(p, "/"):]
		if slices.ContainsFunc(plugs[:2], func(q string) bool { return strings.HasSuffix(q, dev) }) {
			t.Fatalf("plugs %v: the fresh region's device has the old one's id", plugs)
		}
	}
}

// expectType returns s's next message, which must be of type typ.
func (s *session) expectType(t *testing.T, typ proto.Type) proto.Msg {
	t.Helper()
	m := s.next(t)
	if m.Type != typ {
		t.Fatalf("%s got %+v, want %s", s.g.Name, m, typ)
	}
	return m
}
