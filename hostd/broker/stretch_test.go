package broker_test

import (
	"testing"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// stretchPair opens a connection between g1 (A) and g2 (B) of a pair
// world and returns both ends' READY.
func stretchPair(t *testing.T) (w *world, sa, sb *fileSession, ra, rb proto.Msg) {
	t.Helper()
	w, _, sa, sb = pairWorld(t, policy.Spec{RingSize: "64KiB"})
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.next(t)
	ra = sa.next(t)
	sb.next(t)
	rb = sb.next(t)
	return w, sa, sb, ra, rb
}

// TestStretch: the vsock room gets a flow's rings only for a guest that is
// an end of it (never another guest of the group), only for its live
// generation, and only once; the side it holds is not freed by its LEFT
// until the room releases it, so the slot is not reused under a bridge.
func TestStretch(t *testing.T) {
	w, sa, sb, r, rb := stretchPair(t)
	if r.Type != proto.Ready {
		t.Fatalf("%+v, want READY", r)
	}
	if _, err := w.b.Stretch(w.g3.ID, r.RegionID, r.Slot, r.Gen); err == nil {
		t.Fatal("a guest that is no end of the flow got its rings")
	}
	if _, err := w.b.Stretch(w.g1.ID, r.RegionID, r.Slot, r.Gen+1); err == nil {
		t.Fatal("another generation of the slot was given out")
	}
	if _, err := w.b.Stretch(w.g1.ID, r.RegionID+1, r.Slot, r.Gen); err == nil {
		t.Fatal("a region that is not the guest's was given out")
	}
	h, err := w.b.Stretch(w.g1.ID, r.RegionID, r.Slot, r.Gen)
	if err != nil {
		t.Fatal(err)
	}
	if h.Writes == h.Reads || h.Writes == nil {
		t.Fatalf("rings %p %p", h.Writes, h.Reads)
	}
	if _, err := w.b.Stretch(w.g1.ID, r.RegionID, r.Slot, r.Gen); err == nil {
		t.Fatal("a second stretch of one flow")
	}
	// B's writes ring is A's reads ring.
	if hb, err := w.b.Stretch(w.g2.ID, rb.RegionID, rb.Slot, rb.Gen); err == nil {
		if hb.Writes != h.Reads || hb.Reads != h.Writes {
			t.Fatal("B's rings are not A's the other way round")
		}
		hb.Release()
	}
	// Both sides leave; A's side is held by the stretch: the flow stays.
	w.b.CloseConn(sa, proto.Msg{Type: proto.Close, ReqID: r.ReqID, RegionID: r.RegionID, Slot: r.Slot, Gen: r.Gen, Side: proto.SideA})
	w.b.CloseConn(sb, proto.Msg{Type: proto.Close, ReqID: rb.ReqID, RegionID: rb.RegionID, Slot: rb.Slot, Gen: rb.Gen, Side: proto.SideB})
	if fl := w.b.Flows(); len(fl) != 1 {
		t.Fatalf("flows %+v: the held side was freed under the stretch", fl)
	}
	h.Release()
	if fl := w.b.Flows(); len(fl) != 0 {
		t.Fatalf("flows %+v after the stretch's release, want none", fl)
	}
}

// TestStretchPeerGoneAtRelease: while a vsock stretch holds the VM's side
// of a flow, an end that is done (LEFT, CLOSE, its session gone) is told
// to the room (Held.Gone for the VM's end, Held.PeerGone for the other),
// and the surviving end gets its DOWN(peer-gone) only at the stretch's
// release. A DOWN(peer-gone) makes a reader leave its ring once empty:
// sent while the room's bridge still carried the VM's last bytes, it cut
// the survivor's stream short with a clean EOF (TestVsockProcessGuest,
// one run in three).
func TestStretchPeerGoneAtRelease(t *testing.T) {
	for _, tc := range []struct {
		name string
		vm   bool // the VM's end (A, held by the stretch) is the one done
		done func(w *world, s *fileSession, r proto.Msg, side proto.Side)
	}{
		{"vm-left", true, func(w *world, s *fileSession, r proto.Msg, side proto.Side) { w.left(s.session, r, side) }},
		{"vm-close", true, func(w *world, s *fileSession, r proto.Msg, side proto.Side) {
			w.b.CloseConn(s, proto.Msg{Type: proto.Close, ReqID: r.ReqID, RegionID: r.RegionID, Slot: r.Slot, Gen: r.Gen, Side: side})
		}},
		{"vm-detach", true, func(w *world, s *fileSession, r proto.Msg, side proto.Side) { w.b.Detach(s) }},
		{"peer-left", false, func(w *world, s *fileSession, r proto.Msg, side proto.Side) { w.left(s.session, r, side) }},
		{"peer-close", false, func(w *world, s *fileSession, r proto.Msg, side proto.Side) {
			w.b.CloseConn(s, proto.Msg{Type: proto.Close, ReqID: r.ReqID, RegionID: r.RegionID, Slot: r.Slot, Gen: r.Gen, Side: side})
		}},
		{"peer-detach", false, func(w *world, s *fileSession, r proto.Msg, side proto.Side) { w.b.Detach(s) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, sa, sb, ra, rb := stretchPair(t)
			h, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen)
			if err != nil {
				t.Fatal(err)
			}
			gone, survivor := sa, sb
			r, side, told, untold := ra, proto.SideA, h.Gone, h.PeerGone
			if !tc.vm {
				gone, survivor = sb, sa
				r, side, told, untold = rb, proto.SideB, h.PeerGone, h.Gone
			}
			tc.done(w, gone, r, side)
			select {
			case <-told:
			default:
				t.Fatal("the room was not told that the end is done")
			}
			select {
			case <-untold:
				t.Fatal("the room was told the wrong end is done")
			default:
			}
			survivor.none(t) // no DOWN while the bridge may still carry the gone end's bytes
			if fl := w.b.Flows(); len(fl) != 1 {
				t.Fatalf("flows %+v: the held flow was freed under the stretch", fl)
			}
			h.Release()
			want := rb.ReqID
			if !tc.vm {
				want = ra.ReqID
			}
			survivor.expect(t, proto.Down, proto.ReasonPeerGone, want)
			survivor.none(t)
			h.Release() // a second release does nothing
			survivor.none(t)
		})
	}
}

// TestStretchAfterPeerGone: a stretch that comes after the other end was
// done learns it at once (Held.PeerGone closed).
func TestStretchAfterPeerGone(t *testing.T) {
	w, sa, sb, ra, rb := stretchPair(t)
	w.left(sb.session, rb, proto.SideB)
	sa.expect(t, proto.Down, proto.ReasonPeerGone, ra.ReqID) // no stretch yet: at once
	h, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.PeerGone:
	default:
		t.Fatal("the stretch was not told that the other end is done")
	}
	h.Release()
}
