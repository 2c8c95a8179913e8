package broker_test

import (
	"sync/atomic"
	"testing"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/ring"
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
	// A hold per side: B's writes ring is A's reads ring.
	hb, err := w.b.Stretch(w.g2.ID, rb.RegionID, rb.Slot, rb.Gen)
	if err != nil {
		t.Fatalf("the other side's stretch: %v", err)
	}
	if !sameRing(hb.Writes, h.Reads) || !sameRing(hb.Reads, h.Writes) {
		t.Fatal("B's rings are not A's the other way round")
	}
	hb.Release()
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

// rsession is a test session whose library handles RESUME.
type rsession struct{ *fileSession }

func (rsession) Resumes() bool { return true }

// resumePair is stretchPair with libraries that handle RESUME and g1 a
// VM that carries its flows over vsock stretches (A's end).
func resumePair(t *testing.T) (w *world, sa, sb rsession, ra, rb proto.Msg) {
	t.Helper()
	return resumeStretchPair(t, false)
}

// resumeStretchPair pairs g1:4000 (A, a vsock VM) with g2:80 (B, a vsock
// VM too if bothVsock) in a pair region, both libraries handling RESUME,
// and returns both READYs.
func resumeStretchPair(t *testing.T, bothVsock bool) (w *world, sa, sb rsession, ra, rb proto.Msg) {
	t.Helper()
	w = newWorldOpts(t, policy.Spec{RingSize: "64KiB"}, broker.Options{PairRegionLinger: -1})
	w.g1.SharedRegion, w.g2.SharedRegion = false, false
	w.g1.Vsock, w.g2.Vsock = true, bothVsock
	w.b.UsePairRegions(&fakePairs{t: t})
	sa, sb = rsession{newFileSession(w.g1)}, rsession{newFileSession(w.g2)}
	w.b.Attach(sa)
	w.b.Attach(sb)
	w.b.Listen(sb, ap("10.0.0.2:80"), true)
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.next(t)
	ra = sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.next(t)
	rb = sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	return w, sa, sb, ra, rb
}

func ended(r proto.Msg, side proto.Side, off uint64) proto.Msg {
	return proto.Msg{Type: proto.Ended, ReqID: r.ReqID, RegionID: r.RegionID, Slot: r.Slot, Gen: r.Gen, Side: side, Offset: off}
}

// TestStretchResume: a downgrade of a flow whose VM end carries it over a
// vsock stretch stops the room's bridge (Held.Stop) and sends no DOWN;
// the VM gets RESUME at the offset where the bridge stopped writing the
// ring the VM writes, and the other end RESUME at the offset the VM's
// ENDED says its read ring ended. Before, both got DOWN while the
// bridges went on carrying bytes past the downgrade.
func TestStretchResume(t *testing.T) {
	w, sa, sb, ra, rb := resumePair(t)
	h, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen)
	if err != nil {
		t.Fatal(err)
	}
	if !w.b.Downgrade(w.record(t).Name) {
		t.Fatal("no connection downgraded")
	}
	select {
	case r := <-h.Stop:
		if r != proto.ReasonAdmin {
			t.Fatalf("stop reason %s, want admin", r)
		}
	default:
		t.Fatal("the room was not asked to stop the bridge")
	}
	sa.none(t)
	sb.none(t)
	h.Stopped(true, 1<<20+5, false, false)
	sa.expect(t, proto.Resume, proto.ReasonAdmin, 1)
	sb.none(t)
	// ENDED from the wrong guest, or for the other side: ignored.
	w.b.StretchEnded(sb, ended(rb, proto.SideB, 9))
	w.b.StretchEnded(sa, ended(ra, proto.SideB, 9))
	sb.none(t)
	w.b.StretchEnded(sa, ended(ra, proto.SideA, 3<<20+1))
	if m := sb.expect(t, proto.Resume, proto.ReasonAdmin, 2); m.Offset != 3<<20+1 {
		t.Fatalf("other end's RESUME at %d, want the VM's ENDED %d", m.Offset, 3<<20+1)
	}
	w.b.StretchEnded(sa, ended(ra, proto.SideA, 7)) // a second ENDED does nothing
	sb.none(t)
	w.b.Left(sa, proto.Msg{Type: proto.Left, ReqID: 1, RegionID: ra.RegionID, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideA})
	w.b.Left(sb, proto.Msg{Type: proto.Left, ReqID: 2, RegionID: rb.RegionID, Slot: rb.Slot, Gen: rb.Gen, Side: proto.SideB})
	h.Release()
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Path != "tcp" {
		t.Fatalf("records %+v, want one on tcp", fl)
	}
}

// TestStretchResumeNoBridge: a downgrade before the VM's stretch was
// bridged: nothing crossed, both get RESUME(all), and a Hello that comes
// after is refused (a bridge must not write rings both ends left).
func TestStretchResumeNoBridge(t *testing.T) {
	w, sa, sb, ra, _ := resumePair(t)
	w.b.Downgrade(w.record(t).Name)
	if m := sa.expect(t, proto.Resume, proto.ReasonAdmin, 1); m.Offset != proto.ResumeAll {
		t.Fatalf("VM's RESUME at %d, want all", m.Offset)
	}
	if m := sb.expect(t, proto.Resume, proto.ReasonAdmin, 2); m.Offset != proto.ResumeAll {
		t.Fatalf("other end's RESUME at %d, want all", m.Offset)
	}
	if _, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen); err == nil {
		t.Fatal("a stretch was bridged after the downgrade's RESUME")
	}
}

// TestStretchResumeVMGone: the VM's end goes before its ENDED. If its
// writer's stretch reached the ring whole (its LEFT came through the
// bridge), the other end leaves as after any peer's going; otherwise
// where its stream ended is unknown, and the other end's connection is
// reset, not read short with a clean EOF.
func TestStretchResumeVMGone(t *testing.T) {
	for _, tc := range []struct {
		name    string
		outLeft bool
		before  bool // the VM goes before the bridge stopped
	}{
		{"cut", false, false}, {"whole", true, false}, {"cut-before-stop", false, true}, {"whole-before-stop", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, sa, sb, ra, _ := resumePair(t)
			h, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen)
			if err != nil {
				t.Fatal(err)
			}
			w.b.Downgrade(w.record(t).Name)
			<-h.Stop
			if !tc.before {
				h.Stopped(true, 100, tc.outLeft, false)
				sa.expect(t, proto.Resume, proto.ReasonAdmin, 1)
			}
			w.b.Detach(sa)
			if tc.before {
				sb.none(t)
				h.Stopped(true, 100, tc.outLeft, false)
			}
			if tc.outLeft {
				sb.expect(t, proto.Down, proto.ReasonPeerGone, 2)
			} else if m := sb.expect(t, proto.Resume, proto.ReasonAdmin, 2); m.Offset != proto.ResumeReset {
				t.Fatalf("other end's RESUME at %d, want reset", m.Offset)
			}
			h.Release()
			sb.none(t)
		})
	}
}

// TestStretchResumeOldLibrary: an end whose library does not handle
// RESUME keeps the drain of before: DOWN to both, the bridge runs on.
func TestStretchResumeOldLibrary(t *testing.T) {
	w, sa, sb, ra, rb := stretchPair(t)
	w.g1.Vsock = true
	h, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen)
	if err != nil {
		t.Fatal(err)
	}
	w.b.Downgrade(w.record(t).Name)
	sa.expect(t, proto.Down, proto.ReasonAdmin, ra.ReqID)
	sb.expect(t, proto.Down, proto.ReasonAdmin, rb.ReqID)
	select {
	case <-h.Stop:
		t.Fatal("the bridge was stopped for ends that cannot resume")
	default:
	}
	h.Release()
}

// sameRing reports whether a and b are views of one ring.
func sameRing(a, b *ring.Ring) bool {
	ar, _ := a.Waiters()
	br, _ := b.Waiters()
	return ar == br
}

// vsockPair opens a connection between two VMs that both carry their
// flows over vsock stretches (g1 A, g2 B) and holds both sides.
func vsockPair(t *testing.T) (w *world, sa, sb *fileSession, ra, rb proto.Msg, ha, hb broker.Held) {
	t.Helper()
	w, _, sa, sb = pairWorld(t, policy.Spec{RingSize: "64KiB"})
	w.g1.Vsock, w.g2.Vsock = true, true
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.next(t)
	ra = sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.next(t)
	rb = sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	var err error
	if ha, err = w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen); err != nil {
		t.Fatalf("A's stretch: %v", err)
	}
	if hb, err = w.b.Stretch(w.g2.ID, rb.RegionID, rb.Slot, rb.Gen); err != nil {
		t.Fatalf("B's stretch: %v", err)
	}
	if !sameRing(ha.Writes, hb.Reads) || !sameRing(ha.Reads, hb.Writes) {
		t.Fatal("the two holds are not on one ring pair the other way round")
	}
	return w, sa, sb, ra, rb, ha, hb
}

// TestStretchVsockPair: a connection between two vsock VMs goes on the
// rings (it stayed on TCP, vsock-pair, while the broker held one stretch
// per flow); each VM's room holds its own side, once. An end that is done
// is told to both rooms (its own as Gone, the other's as PeerGone), and
// the survivor gets DOWN(peer-gone) only once both bridges let go: either
// may still carry the gone end's last bytes (A's room into the flow's
// ring, B's room out of it).
func TestStretchVsockPair(t *testing.T) {
	for _, tc := range []struct {
		name      string
		firstOut  bool // the gone end's room releases first
		goneIsVM1 bool
	}{{"a-gone", true, true}, {"a-gone-b-first", false, true}, {"b-gone", true, false}} {
		t.Run(tc.name, func(t *testing.T) {
			w, sa, sb, ra, rb, ha, hb := vsockPair(t)
			for _, g := range []*broker.Guest{w.g1, w.g2} {
				r := ra
				if g == w.g2 {
					r = rb
				}
				if h, err := w.b.Stretch(g.ID, r.RegionID, r.Slot, r.Gen); err == nil {
					h.Release()
					t.Fatalf("%s: a second stretch of its side", g.Name)
				}
			}
			gone, survivor, hg, hs, r, side, want := sa, sb, ha, hb, ra, proto.SideA, rb.ReqID
			if !tc.goneIsVM1 {
				gone, survivor, hg, hs, r, side, want = sb, sa, hb, ha, rb, proto.SideB, ra.ReqID
			}
			w.b.CloseConn(gone, proto.Msg{Type: proto.Close, ReqID: r.ReqID, RegionID: r.RegionID, Slot: r.Slot, Gen: r.Gen, Side: side})
			for name, c := range map[string]<-chan struct{}{"gone end's Gone": hg.Gone, "survivor's PeerGone": hs.PeerGone} {
				select {
				case <-c:
				default:
					t.Fatalf("%s not closed", name)
				}
			}
			for name, c := range map[string]<-chan struct{}{"gone end's PeerGone": hg.PeerGone, "survivor's Gone": hs.Gone} {
				select {
				case <-c:
					t.Fatalf("%s closed", name)
				default:
				}
			}
			first, second := hg, hs
			if !tc.firstOut {
				first, second = hs, hg
			}
			first.Release()
			survivor.none(t) // the other bridge may still carry bytes
			if fl := w.b.Flows(); len(fl) != 1 {
				t.Fatalf("flows %+v: freed under a bridge", fl)
			}
			second.Release()
			survivor.expect(t, proto.Down, proto.ReasonPeerGone, want)
			survivor.none(t)
		})
	}
}

// TestStretchVsockPairDowngrade: between two vsock VMs whose libraries do
// not handle RESUME a downgrade is a DOWN to both, the bridges draining
// (with RESUME: TestStretchPairResume): no bridge is stopped, and the
// flow is freed only once both VMs left and both rooms let go.
func TestStretchVsockPairDowngrade(t *testing.T) {
	w, sa, sb, ra, rb, ha, hb := vsockPair(t)
	w.b.Downgrade(w.record(t).Name)
	sa.expect(t, proto.Down, proto.ReasonAdmin, ra.ReqID)
	sb.expect(t, proto.Down, proto.ReasonAdmin, rb.ReqID)
	for _, h := range []broker.Held{ha, hb} {
		select {
		case <-h.Stop:
			t.Fatal("a bridge was stopped")
		default:
		}
	}
	w.left(sa.session, ra, proto.SideA)
	w.left(sb.session, rb, proto.SideB)
	ha.Release()
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Path != "leaving" {
		t.Fatalf("records %+v, want one leaving: B's side is held", fl)
	}
	hb.Release()
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Path != "tcp" {
		t.Fatalf("records %+v, want one on tcp", fl)
	}
	sa.expect(t, proto.Unregion, proto.ReasonNone, 0) // the pair region's last flow
	sb.expect(t, proto.Unregion, proto.ReasonNone, 0)
}

// TestStretchResumeReleaseWithoutStopped: the room lets go of a stretch
// without saying where its bridge stopped (the VM closed its stream right
// after its Hello, or the room closed before a bridge ran): a downgrade's
// RESUME waited for a Stopped that never came, with no deadline. The
// release now counts as "no bridge wrote the ring": RESUME(all) to the VM.
func TestStretchResumeReleaseWithoutStopped(t *testing.T) {
	w, sa, sb, ra, _ := resumePair(t)
	h, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen)
	if err != nil {
		t.Fatal(err)
	}
	w.b.Downgrade(w.record(t).Name)
	<-h.Stop
	sa.none(t)
	h.Release()
	if m := sa.expect(t, proto.Resume, proto.ReasonAdmin, 1); m.Offset != proto.ResumeAll {
		t.Fatalf("VM's RESUME at %d, want all", m.Offset)
	}
	sb.none(t) // the other end waits for the VM's ENDED, as after any RESUME
}

// TestStretchOnce: a flow's side gets one stretch in its life: a second
// Hello after the first stretch was released is refused (its bridge
// would write rings whose end the first one's release settled).
func TestStretchOnce(t *testing.T) {
	w, _, _, ra, _ := stretchPair(t)
	h, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen)
	if err != nil {
		t.Fatal(err)
	}
	h.Release()
	if h2, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen); err == nil {
		h2.Release()
		t.Fatal("a second stretch of the flow after the first was released")
	}
}

// TestStretchRegionNoDescriptor: the VM that carries its flows over vsock
// stretches gets REGION without a descriptor (it maps no region, and its
// control channel may be vsock, which cannot carry one: hostd closed such
// a session at every READY); the process guest gets its descriptor.
func TestStretchRegionNoDescriptor(t *testing.T) {
	_, sa, sb, _, _ := resumePair(t)
	if len(sa.files) != 0 || len(sb.files) != 1 {
		t.Fatalf("descriptors sent: %d to the vsock VM (want 0), %d to the process guest (want 1)", len(sa.files), len(sb.files))
	}
}

// TestStretchVsockDown: a vsock VM whose device has no front-end (QEMU's
// died with an earlier hostd and does not reconnect) gets no READY: both
// ends stay on TCP, saying vsock-down, instead of the VM's library
// waiting out a vsock connect to a device nobody serves. Once served
// (a hybrid device, the hypervisor's own, always counts as served;
// shunt-vsockd's once the daemon says so) it gets READY.
func TestStretchVsockDown(t *testing.T) {
	var served atomic.Bool
	w, _, sa, sb := pairWorld(t, policy.Spec{RingSize: "64KiB"}, broker.Options{PairRegionLinger: -1,
		VsockServed: func(id uint32) bool { return served.Load() }})
	w.g1.Vsock = true
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.expect(t, proto.TCP, proto.ReasonVsockDown, 1)
	sb.expect(t, proto.TCP, proto.ReasonVsockDown, 2)

	w.g1.VsockKept = true // a hybrid device or shunt-vsockd's, which outlive hostd: still as served says
	ta, tb = w.conn("10.0.0.1:4002", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 5))
	w.b.Open(sb, open(proto.Passive, tb, 6))
	sa.expect(t, proto.TCP, proto.ReasonVsockDown, 5)
	sb.expect(t, proto.TCP, proto.ReasonVsockDown, 6)
	served.Store(true)
	ta, tb = w.conn("10.0.0.1:4001", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 3))
	w.b.Open(sb, open(proto.Passive, tb, 4))
	for _, s := range []*fileSession{sa, sb} {
		if m := s.next(t); m.Type != proto.RegionMsg {
			t.Fatalf("%+v, want REGION", m)
		}
	}
	<-sb.files // a vsock VM's REGION goes without a descriptor
	sa.expect(t, proto.Ready, proto.ReasonNone, 3)
	sb.expect(t, proto.Ready, proto.ReasonNone, 4)
}
