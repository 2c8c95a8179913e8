package broker_test

import (
	"testing"

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
