package broker_test

import (
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// adoptedStretch stands for a hostd SIGKILLed under a vsock VM's stretch
// (A, g1) to a process guest (B, g2): the dead room's bridge had written
// the ring toward B from start to x (x 0: it never started it); a new
// broker adopts the pair region with grace and both ends' new sessions
// attach (neither reattached yet), o saying how.
func adoptedStretch(t *testing.T, start, x uint64, grace time.Duration, o adoptOpts) (b2 *broker.Broker, na, nb rsession, ra proto.Msg, ab *ring.Ring) {
	t.Helper()
	pairs := &fakePairs{t: t}
	w := newWorldOpts(t, policy.Spec{RingSize: "64KiB"}, broker.Options{PairRegionLinger: -1})
	w.g1.SharedRegion, w.g2.SharedRegion = false, false
	w.g1.Vsock, w.g2.Vsock = true, o.pair
	w.g1.VsockKept = o.kept
	w.b.UsePairRegions(pairs)
	sa, sb := rsession{newFileSession(w.g1)}, rsession{newFileSession(w.g2)}
	w.b.Attach(sa)
	w.b.Attach(sb)
	w.b.Listen(sb, ap("10.0.0.2:80"), true)
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.next(t)
	ra = sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	pool := pairs.pools[ra.RegionID]
	ab, _, err := pool.Region().Rings(int(ra.Slot), ra.Gen)
	if err != nil {
		t.Fatal(err)
	}
	if x != 0 { // the room's bridge, writing the VM's bytes into the flow's ring
		rw, err := ring.NewWriter(ab, &wait.Policy{})
		if err != nil {
			t.Fatal(err)
		}
		rw.Start(start)
		if _, err := rw.Write(make([]byte, x-start)); err != nil {
			t.Fatal(err)
		}
	}
	if o.broken {
		ab.Reset(1)
	}
	w.b.Close() // hostd killed: the region stays as it was
	b2 = broker.New(hclog.NewNullLogger(), w.ct, metrics.New(), mustCompile(t, policy.Spec{RingSize: "64KiB"}), []*broker.Guest{w.g1, w.g2, w.g3},
		broker.Options{PairingTimeout: 100 * time.Millisecond, LookupTimeout: 10 * time.Millisecond, PairRegionLinger: -1})
	t.Cleanup(b2.Close)
	b2.UsePairRegions(pairs)
	if n, ok := b2.AdoptPair(region.Meta{ID: ra.RegionID, GuestA: w.g1.ID, GuestB: w.g2.ID}, pool, nil); !ok || n != 1 {
		t.Fatalf("adopted %d flows (%v), want 1", n, ok)
	}
	b2.Adopt(w.g1.Group, grace)
	na, nb = rsession{newFileSession(w.g1)}, rsession{newFileSession(w.g2)}
	b2.Attach(na)
	b2.Attach(nb)
	return b2, na, nb, ra, ab
}

// adoptOpts: broken resets the ring toward B before the kill; kept makes
// the VM's device one that outlives hostd (a hybrid vsock's); pair makes
// B a vsock VM too.
type adoptOpts struct{ broken, kept, pair bool }

func reattach(r proto.Msg, side proto.Side, req uint32) proto.Msg {
	return proto.Msg{Type: proto.Reattach, ReqID: req, RegionID: r.RegionID, Slot: r.Slot, Gen: r.Gen, Side: side}
}

// TestAdoptedStretchResumes: after a SIGKILLed hostd, the adopted flow of
// a vsock VM's stretch leaves its rings by RESUME, never DOWN (its room's
// bridge is dead: a reader waiting for its leave mark would wait
// forever). Once both ends reattached (in either order), the VM gets
// RESUME(where the dead bridge stopped writing the ring toward the
// other end), that ring is marked left there, and the other end gets
// RESUME(the VM's ENDED). A ring never started: RESUME(all).
func TestAdoptedStretchResumes(t *testing.T) {
	for _, tc := range []struct {
		name     string
		start, x uint64
		vmFirst  bool
	}{
		{"mid-stream", 1 << 20, 1<<20 + 5000, true}, {"other-first", 77, 9000, false}, {"never-started", 0, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b2, na, nb, ra, ab := adoptedStretch(t, tc.start, tc.x, time.Minute, adoptOpts{})
			first, second := func() { b2.Reattach(na, reattach(ra, proto.SideA, 1)) }, func() { b2.Reattach(nb, reattach(ra, proto.SideB, 2)) }
			if !tc.vmFirst {
				first, second = second, first
			}
			first()
			na.none(t)
			nb.none(t)
			if ab.Stats().Left {
				t.Fatal("the ring toward the other end was marked left before both ends reattached")
			}
			second()
			want := uint64(proto.ResumeAll)
			if tc.x != 0 {
				want = tc.x
			}
			if m := na.expect(t, proto.Resume, proto.ReasonShutdown, 1); m.Offset != want {
				t.Fatalf("the VM's RESUME at %d, want %d", m.Offset, want)
			}
			if !ab.Stats().Left {
				t.Fatal("the ring toward the other end was not marked left at the VM's RESUME")
			}
			nb.none(t)
			b2.StretchEnded(na, ended(ra, proto.SideA, 4242))
			if m := nb.expect(t, proto.Resume, proto.ReasonShutdown, 2); m.Offset != 4242 {
				t.Fatalf("the other end's RESUME at %d, want the VM's ENDED 4242", m.Offset)
			}
			b2.Left(na, proto.Msg{Type: proto.Left, ReqID: 1, RegionID: ra.RegionID, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideA})
			b2.Left(nb, proto.Msg{Type: proto.Left, ReqID: 2, RegionID: ra.RegionID, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideB})
			if fl := b2.Flows(); len(fl) != 1 || fl[0].Path != "tcp" || fl[0].Reason != proto.ReasonShutdown.String() {
				t.Fatalf("records %+v, want one on tcp (shutdown)", fl)
			}
		})
	}
}

// TestAdoptedStretchEndGone: an end that does not reattach within its
// grace leaves the other one reset (RESUME(reset)), whichever reattached;
// nothing waits for it. A VM that reattaches but never says ENDED resets
// the other end after the RESUME's bound (TestStretchResumeTimeout's).
func TestAdoptedStretchEndGone(t *testing.T) {
	t.Run("vm-gone", func(t *testing.T) {
		b2, _, nb, ra, _ := adoptedStretch(t, 10, 500, 50*time.Millisecond, adoptOpts{})
		b2.Reattach(nb, reattach(ra, proto.SideB, 2))
		if m := nb.expect(t, proto.Resume, proto.ReasonShutdown, 2); m.Offset != proto.ResumeReset {
			t.Fatalf("the other end's RESUME at %d, want reset", m.Offset)
		}
	})
	t.Run("other-gone", func(t *testing.T) {
		b2, na, _, ra, _ := adoptedStretch(t, 10, 500, 50*time.Millisecond, adoptOpts{})
		b2.Reattach(na, reattach(ra, proto.SideA, 1))
		if m := na.expect(t, proto.Resume, proto.ReasonShutdown, 1); m.Offset != proto.ResumeReset {
			t.Fatalf("the VM's RESUME at %d, want reset", m.Offset)
		}
	})
}

// TestAdoptedStretchBroken: a ring toward the other end that does not
// say where the dead bridge stopped (reset), or a flow between two vsock
// VMs (both rooms died: not built), resets both ends at their REATTACH;
// nobody is told an offset hostd does not know, and nobody waits.
func TestAdoptedStretchBroken(t *testing.T) {
	for _, o := range []adoptOpts{{broken: true}, {pair: true}} {
		t.Run(map[bool]string{false: "reset-ring", true: "two-vsock-vms"}[o.pair], func(t *testing.T) {
			b2, na, nb, ra, _ := adoptedStretch(t, 10, 500, time.Minute, o)
			b2.Reattach(na, reattach(ra, proto.SideA, 1))
			b2.Reattach(nb, reattach(ra, proto.SideB, 2))
			for i, s := range []rsession{na, nb} {
				if m := s.expect(t, proto.Resume, proto.ReasonNone, uint32(i+1)); m.Offset != proto.ResumeReset {
					t.Fatalf("end %d's RESUME at %d, want reset", i+1, m.Offset)
				}
			}
			b2.StretchEnded(na, ended(ra, proto.SideA, 4242)) // too late: nothing more
			nb.none(t)
		})
	}
}

// TestAdoptedStretchKeptDevice: a VM whose vsock device outlives hostd (a
// hybrid vsock's) resumes with reason firewall, which is retried once the
// adopted pair is freed (back to the rings, as any adopted flow); QEMU's
// (TestAdoptedStretchResumes) with shutdown, which is not.
func TestAdoptedStretchKeptDevice(t *testing.T) {
	b2, na, nb, ra, _ := adoptedStretch(t, 10, 500, time.Minute, adoptOpts{kept: true})
	b2.Reattach(na, reattach(ra, proto.SideA, 1))
	b2.Reattach(nb, reattach(ra, proto.SideB, 2))
	if m := na.expect(t, proto.Resume, proto.ReasonFirewall, 1); m.Offset != 500 {
		t.Fatalf("the VM's RESUME at %d, want 500", m.Offset)
	}
}
