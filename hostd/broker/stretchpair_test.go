package broker_test

import (
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// resumeVsockPair opens a connection between two vsock VMs whose
// libraries handle RESUME (g1 A, g2 B) and returns both READYs.
func resumeVsockPair(t *testing.T) (w *world, sa, sb rsession, ra, rb proto.Msg) {
	t.Helper()
	return resumeStretchPair(t, true)
}

// hold is guest g's stretch of r's flow.
func hold(t *testing.T, w *world, g *broker.Guest, r proto.Msg) broker.Held {
	t.Helper()
	h, err := w.b.Stretch(g.ID, r.RegionID, r.Slot, r.Gen)
	if err != nil {
		t.Fatal(err)
	}
	if !h.Pair {
		t.Fatal("a hold between two vsock VMs is not marked Pair")
	}
	return h
}

func stopAsked(t *testing.T, h broker.Held) {
	t.Helper()
	select {
	case r := <-h.Stop:
		if r != proto.ReasonAdmin {
			t.Fatalf("stop reason %s, want admin", r)
		}
	default:
		t.Fatal("the room was not asked to stop its bridge")
	}
}

func resumeAt(t *testing.T, s rsession, req uint32, want uint64) {
	t.Helper()
	if m := s.expect(t, proto.Resume, proto.ReasonAdmin, req); m.Offset != want {
		t.Fatalf("%s: RESUME at %d, want %d", s.g.Name, m.Offset, want)
	}
}

// TestStretchPairRelayed: a flow between two vsock VMs whose libraries
// handle RESUME is marked relayed at both ends (their rings are written
// by bridges that copy bytes: btl/shunt parses them as a relay's), and
// only such a flow: a vsock VM and a process guest, or two VMs whose
// libraries do not handle RESUME (they leave by DOWN), get no mark.
func TestStretchPairRelayed(t *testing.T) {
	_, _, _, ra, rb := resumeVsockPair(t)
	if !ra.Relayed || !rb.Relayed {
		t.Errorf("two vsock VMs: READY relayed A %v B %v, want both", ra.Relayed, rb.Relayed)
	}
	_, _, _, ra, rb = resumeStretchPair(t, false)
	if ra.Relayed || rb.Relayed {
		t.Errorf("a vsock VM and a process guest: READY relayed %v %v, want neither", ra.Relayed, rb.Relayed)
	}
	_, _, _, ra, rb, ha, hb := vsockPair(t)
	ha.Release()
	hb.Release()
	if ra.Relayed || rb.Relayed {
		t.Errorf("two vsock VMs without RESUME: READY relayed %v %v, want neither", ra.Relayed, rb.Relayed)
	}
}

// TestStretchPairResume: a downgrade between two vsock VMs is a two-step.
// Both rooms are asked to stop; no VM hears anything until both said
// where their bridges stopped (each room's out-direction at its X, its
// in-direction drained into its VM's ring); then each VM gets RESUME at
// its own X, which the other VM's ring is known to end at. A room whose
// drain was cut (its VM took nothing for the bound) leaves the other
// VM's offset unknown: that VM's connection is reset. The VMs' ENDEDs
// change nothing. Without this, a downgrade between two VMs was a DOWN
// with the bridges running on.
func TestStretchPairResume(t *testing.T) {
	for _, tc := range []struct {
		name             string
		aDrained, bDrain bool // each room carried the other VM's stretch whole
		wantA, wantB     uint64
	}{
		{"both-drained", true, true, 1000, 2000},
		{"b-cut", true, false, proto.ResumeReset, 2000},
		{"both-cut", false, false, proto.ResumeReset, proto.ResumeReset},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, sa, sb, ra, rb := resumeVsockPair(t)
			ha, hb := hold(t, w, w.g1, ra), hold(t, w, w.g2, rb)
			w.b.Downgrade(w.record(t).Name)
			stopAsked(t, ha)
			stopAsked(t, hb)
			sa.none(t)
			sb.none(t)
			ha.Stopped(true, 1000, false, tc.aDrained)
			sa.none(t) // B's ring is not known to end at A's X yet
			sb.none(t)
			hb.Stopped(true, 2000, false, tc.bDrain)
			resumeAt(t, sa, 1, tc.wantA)
			resumeAt(t, sb, 2, tc.wantB)
			w.b.StretchEnded(sa, ended(ra, proto.SideA, 7))
			w.b.StretchEnded(sb, ended(rb, proto.SideB, 9))
			sa.none(t)
			sb.none(t)
			if _, err := w.b.Stretch(w.g1.ID, ra.RegionID, ra.Slot, ra.Gen); err == nil {
				t.Fatal("a stretch after the downgrade")
			}
			w.left(sa.session, ra, proto.SideA)
			w.left(sb.session, rb, proto.SideB)
			ha.Release()
			hb.Release()
			if fl := w.b.Flows(); len(fl) != 1 || fl[0].Path != "tcp" {
				t.Fatalf("records %+v, want one on tcp", fl)
			}
		})
	}
}

// TestStretchPairResumeVMGone: a VM's end goes before the two-step told
// it anything. The survivor reads its ring to the gone VM's leave mark:
// whole (DOWN(peer-gone), as after any peer's going) only if the gone
// VM's writer's LEFT reached the flow's ring and the survivor's room
// carried it; otherwise its connection is reset.
func TestStretchPairResumeVMGone(t *testing.T) {
	for _, tc := range []struct {
		name          string
		outLeft, inLe bool
		wantDown      bool
	}{{"whole", true, true, true}, {"cut", false, true, false}, {"not-carried", true, false, false}} {
		t.Run(tc.name, func(t *testing.T) {
			w, sa, sb, ra, rb := resumeVsockPair(t)
			ha, hb := hold(t, w, w.g1, ra), hold(t, w, w.g2, rb)
			w.b.Downgrade(w.record(t).Name)
			stopAsked(t, ha)
			stopAsked(t, hb)
			w.b.Detach(sa)
			sb.none(t)
			ha.Stopped(true, 1000, tc.outLeft, true)
			hb.Stopped(true, 2000, false, tc.inLe)
			if tc.wantDown {
				sb.expect(t, proto.Down, proto.ReasonPeerGone, 2)
			} else {
				resumeAt(t, sb, 2, proto.ResumeReset)
			}
			ha.Release()
			hb.Release()
			sb.none(t)
		})
	}
}

// TestStretchPairResumeTimeout: a room that never says where its bridge
// stopped (its drain is bounded, so only a stuck room): both VMs'
// connection is reset after stretchResumeWait, not left waiting.
func TestStretchPairResumeTimeout(t *testing.T) {
	defer broker.SetStretchResumeWait(100 * time.Millisecond)()
	w, sa, sb, ra, rb := resumeVsockPair(t)
	ha, hb := hold(t, w, w.g1, ra), hold(t, w, w.g2, rb)
	w.b.Downgrade(w.record(t).Name)
	stopAsked(t, ha)
	stopAsked(t, hb)
	ha.Stopped(true, 1000, false, true)
	resumeAt(t, sa, 1, proto.ResumeReset)
	resumeAt(t, sb, 2, proto.ResumeReset)
	hb.Stopped(true, 2000, false, true) // too late: nothing more
	sa.none(t)
	sb.none(t)
	ha.Release()
	hb.Release()
}

// TestStretchPairResumeOneBridged: only A's stretch was bridged when the
// downgrade came. B's ring got nothing and B's bytes never left B: B's
// write ring (A's read ring on the flow) is marked left unstarted, so
// A's room's drain ends at once, and both resend everything (A's library
// resets if its ring no longer holds its start). B's late Hello is
// refused. A release without Stopped (no bridge ran) counts too.
func TestStretchPairResumeOneBridged(t *testing.T) {
	for _, released := range []bool{false, true} {
		name := "stopped"
		if released {
			name = "released-without-stopped"
		}
		t.Run(name, func(t *testing.T) {
			w, sa, sb, ra, rb := resumeVsockPair(t)
			ha := hold(t, w, w.g1, ra)
			w.b.Downgrade(w.record(t).Name)
			stopAsked(t, ha)
			if _, err := w.b.Stretch(w.g2.ID, rb.RegionID, rb.Slot, rb.Gen); err == nil {
				t.Fatal("B's late stretch was taken")
			}
			rd, err := ring.NewReader(ha.Reads, &wait.Policy{})
			if err != nil {
				t.Fatal(err)
			}
			if _, started := rd.Started(); started || !rd.WriterLeft() {
				t.Fatalf("B's write ring: started %v, left %v; want left unstarted", started, rd.WriterLeft())
			}
			sa.none(t)
			sb.none(t)
			if released {
				ha.Release()
			} else {
				ha.Stopped(true, 1000, false, true)
			}
			resumeAt(t, sa, 1, proto.ResumeAll)
			resumeAt(t, sb, 2, proto.ResumeAll)
			ha.Release()
		})
	}
}

// TestStretchPairBroken: outside a downgrade, a VM's room says its bridge
// stopped without the VM's writer's LEFT in the flow's ring (the VM's
// program killed, its stream broken): the other VM, which reads a ring
// of its own that no room can reset, gets RESUME(reset) (its program
// reads ECONNRESET, not a clean end of a stream cut short), whether or
// not the broker learnt first that the broken VM's end is gone. A stretch
// that ended whole, or the survivor's room stopping after the other end
// was done, resets nobody.
func TestStretchPairBroken(t *testing.T) {
	for _, tc := range []struct {
		name      string
		detach    bool // A's session ends before its room's report
		outLeft   bool
		wantReset bool
	}{{"killed", false, false, true}, {"killed-after-detach", true, false, true}, {"whole", true, true, false}} {
		t.Run(tc.name, func(t *testing.T) {
			w, sa, sb, ra, rb := resumeVsockPair(t)
			ha, hb := hold(t, w, w.g1, ra), hold(t, w, w.g2, rb)
			if tc.detach {
				w.b.Detach(sa)
				// B's room drains A's last bytes and stops: B's own
				// writer never left, which is no break of A's side.
				hb.Stopped(true, 200, false, tc.outLeft)
				sb.none(t)
			}
			ha.Stopped(true, 100, tc.outLeft, false)
			if tc.wantReset {
				if m := sb.expect(t, proto.Resume, proto.ReasonPeerGone, 2); m.Offset != proto.ResumeReset {
					t.Fatalf("B's RESUME at %d, want reset", m.Offset)
				}
			}
			sb.none(t)
			ha.Release()
			hb.Release()
			if tc.detach && !tc.wantReset {
				sb.expect(t, proto.Down, proto.ReasonPeerGone, 2)
			}
		})
	}
}

// TestStretchPairResumeReaderLeft: the CI failure of TestVsockMPIFlips
// (issue 25). Two flows between two vsock VMs share a pair region; the
// first loses its permission, so the region is retired and the second
// leaves its rings too (shutdown), by the two-step. On the second only A
// wrote (btl/shunt writes only the rings of the lease it opened): A's
// room stops its stretch at X, B's room carries it into B's ring to its
// leave mark, and B's library, reading that mark, sends LEFT before its
// room said where its bridge stopped. B left its rings; it did not go:
// A gets RESUME at X, as if B's LEFT had come after (before the fix,
// RESUME(reset), and the BTL ended the job). Bytes are lost only if B's
// own stretch had started and was not whole in A's ring: B, having left,
// resends nothing, and A's connection is reset.
func TestStretchPairResumeReaderLeft(t *testing.T) {
	for _, tc := range []struct {
		name       string
		leftFirst  bool // B's LEFT before its room's report (the CI run)
		bStarted   bool // B's own stretch started (at 2000)
		bOutLeft   bool // ... and its writer's LEFT reached the flow's ring
		wantA      uint64
		wantBAfter bool // B gets its RESUME (it had not left yet)
	}{
		{"left-first-unstarted", true, false, false, 1000, false},
		{"left-after-report", false, false, false, 1000, true},
		{"left-first-own-whole", true, true, true, 1000, false},
		{"left-first-own-cut", true, true, false, proto.ResumeReset, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, sa, sb, _, _ := resumeVsockPair(t)
			ta, tb := w.conn("10.0.0.1:4001", "10.0.0.2:80")
			w.b.Open(sa, open(proto.Active, ta, 3))
			w.b.Open(sb, open(proto.Passive, tb, 4))
			ra, rb := readyIn(t, sa.fileSession), readyIn(t, sb.fileSession)
			ha, hb := hold(t, w, w.g1, ra), hold(t, w, w.g2, rb)
			e, _ := w.ct.Lookup(ctrackTuple("4000"))
			w.ct.Delete(e.ID)
			w.b.ConntrackDestroyed(e) // flow 1: no bridge, ResumeAll at once
			sa.expect(t, proto.Resume, proto.ReasonConntrackGone, 1)
			sb.expect(t, proto.Resume, proto.ReasonConntrackGone, 2)
			for _, h := range []broker.Held{ha, hb} {
				if r := <-h.Stop; r != proto.ReasonShutdown {
					t.Fatalf("flow 2's stop reason %s, want shutdown (its region retired)", r)
				}
			}
			ha.Stopped(true, 1000, false, true)
			if tc.leftFirst {
				w.left(sb.session, rb, proto.SideB)
			}
			sa.none(t)
			hb.Stopped(tc.bStarted, 2000, tc.bOutLeft, true)
			if m := sa.expect(t, proto.Resume, proto.ReasonShutdown, 3); m.Offset != tc.wantA {
				t.Fatalf("A's RESUME at %d, want %d", m.Offset, tc.wantA)
			}
			if tc.wantBAfter {
				sb.expect(t, proto.Resume, proto.ReasonShutdown, 4)
				w.left(sb.session, rb, proto.SideB)
			}
			sb.none(t)
			w.left(sa.session, ra, proto.SideA)
			ha.Release()
			hb.Release()
			// Freed: the connection goes back to the rings, in a fresh
			// region (the retired one takes no flow), and nothing else.
			for _, s := range []rsession{sa, sb} {
				m := s.next(t)
				if m.Type == proto.RegionMsg {
					m = s.next(t) // a vsock VM's REGION comes without its descriptor
				}
				if m.Type != proto.Ready || m.RegionID == ra.RegionID || m.ReqID != ra.ReqID && m.ReqID != rb.ReqID {
					t.Fatalf("%s: READY again %+v, want request %d or %d in a fresh region", s.g.Name, m, ra.ReqID, rb.ReqID)
				}
				s.none(t)
			}
		})
	}
}
