package broker_test

import (
	"encoding/binary"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/ring"
)

// connectPair is world.connect for the file sessions of pairWorld.
func connectPair(w *world, sa, sb *fileSession, port string, req uint32) {
	ta, tb := w.conn("10.0.0.1:"+port, "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, req))
	w.b.Open(sb, open(proto.Passive, tb, req+1))
}

func ctrackTuple(port string) ctrack.Tuple {
	return ctrack.Tuple{Src: ap("10.0.0.1:" + port), Dst: ap("10.0.0.2:80")}
}

// readyIn reads the REGION (if any) and the READY that s gets next, and
// returns the READY.
func readyIn(t *testing.T, s *fileSession) proto.Msg {
	t.Helper()
	m := s.next(t)
	if m.Type == proto.RegionMsg {
		<-s.files
		m = s.next(t)
	}
	if m.Type != proto.Ready {
		t.Fatalf("got %+v, want READY", m)
	}
	return m
}

// TestRegionRevokedOnConntrackGone: two flows of a pair share its region.
// One loses its conntrack entry: its region is retired. The other flow is
// moved off it too (DOWN(shutdown)); once both have left, the region is
// dropped at once (no linger: its memory is taken back), and the flow
// that may still use the rings gets them again, in a fresh region.
func TestRegionRevokedOnConntrackGone(t *testing.T) {
	w, p, sa, sb := pairWorld(t, policy.Spec{RingSize: "64KiB"}, broker.Options{PairRegionLinger: time.Hour, RevokeGrace: time.Hour})
	connectPair(w, sa, sb, "4000", 1)
	ta := ctrackTuple("4000")
	ra1, rb1 := readyIn(t, sa), readyIn(t, sb)
	connectPair(w, sa, sb, "4001", 3)
	ra2, rb2 := readyIn(t, sa), readyIn(t, sb)
	e, _ := w.ct.Lookup(ta)
	w.ct.Delete(e.ID)
	w.b.ConntrackDestroyed(e)
	downs := map[uint32]proto.Reason{}
	for _, s := range []*fileSession{sa, sb} {
		for range 2 {
			m := s.next(t)
			if m.Type != proto.Down {
				t.Fatalf("got %+v, want DOWN", m)
			}
			downs[m.ReqID] = m.Reason
		}
	}
	if downs[1] != proto.ReasonConntrackGone || downs[2] != proto.ReasonConntrackGone || downs[3] != proto.ReasonShutdown || downs[4] != proto.ReasonShutdown {
		t.Fatalf("DOWNs %v: want conntrack-gone for the revoked flow, shutdown (region retired) for the other", downs)
	}
	w.b.Left(sa, proto.Msg{Type: proto.Left, ReqID: ra1.ReqID, RegionID: ra1.RegionID, Slot: ra1.Slot, Gen: ra1.Gen, Side: proto.SideA})
	w.b.Left(sb, proto.Msg{Type: proto.Left, ReqID: rb1.ReqID, RegionID: rb1.RegionID, Slot: rb1.Slot, Gen: rb1.Gen, Side: proto.SideB})
	w.b.Left(sa, proto.Msg{Type: proto.Left, ReqID: ra2.ReqID, RegionID: ra2.RegionID, Slot: ra2.Slot, Gen: ra2.Gen, Side: proto.SideA})
	if _, dropped := p.counts(); dropped != 0 {
		t.Fatal("region dropped while a flow was still in it")
	}
	w.b.Left(sb, proto.Msg{Type: proto.Left, ReqID: rb2.ReqID, RegionID: rb2.RegionID, Slot: rb2.Slot, Gen: rb2.Gen, Side: proto.SideB})
	if made, dropped := p.counts(); dropped != 1 || made != 2 {
		t.Fatalf("made %d, dropped %d regions; want the retired one dropped at once (not after the hour's linger) and a fresh one made", made, dropped)
	}
	var again []proto.Msg
	for _, s := range []*fileSession{sa, sb} {
		for {
			m := s.next(t)
			if m.Type == proto.Ready {
				again = append(again, m)
				break
			}
			if m.Type == proto.RegionMsg {
				<-s.files
			}
		}
	}
	if again[0].RegionID == ra1.RegionID || again[0].ReqID != 3 {
		t.Fatalf("the permitted flow's READY again: %+v, want request 3 in a fresh region (not %d)", again[0], ra1.RegionID)
	}
}

// TestRegionRevokeGrace: colluding ends never LEFT after the revocation;
// when the grace is over hostd frees their flows and drops the region
// anyway (its memory goes), and the record is on TCP.
func TestRegionRevokeGrace(t *testing.T) {
	w, p, sa, sb := pairWorld(t, policy.Spec{RingSize: "64KiB"}, broker.Options{PairRegionLinger: time.Hour, RevokeGrace: 100 * time.Millisecond})
	connectPair(w, sa, sb, "4000", 1)
	ta := ctrackTuple("4000")
	readyIn(t, sa)
	readyIn(t, sb)
	e, _ := w.ct.Lookup(ta)
	w.ct.Delete(e.ID)
	w.b.ConntrackDestroyed(e)
	start := time.Now()
	for {
		if _, dropped := p.counts(); dropped == 1 {
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Fatal("region not dropped 5s after the revocation, with a 100ms grace")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Ring != 0 || fl[0].Path != "tcp" {
		t.Fatalf("after the grace: %+v, want the record on TCP without rings", fl)
	}
}

// TestRingCountersGuestReported: a guest writes 2^62 into its ring's
// tail. The listing does not show it as bytes moved: ring counters are
// labelled guest-reported, and one no ring could have carried is dropped
// (before: 2^62 in `hostd flows` and shunt_flow_bytes).
func TestRingCountersGuestReported(t *testing.T) {
	w, p, sa, sb := pairWorld(t, policy.Spec{RingSize: "64KiB"})
	connectPair(w, sa, sb, "4000", 1)
	ra := readyIn(t, sa)
	readyIn(t, sb)
	fl := w.b.Flows()
	if len(fl) != 1 || fl[0].Counters != "guest-reported" {
		t.Fatalf("listing %+v, want ring counters labelled guest-reported", fl)
	}
	mem := p.mem(ra.RegionID)
	binary.LittleEndian.PutUint64(mem[ra.RingAB+ring.OffTail:], 1<<62)
	binary.LittleEndian.PutUint64(mem[ra.RingAB+ring.OffHead:], 1<<62)
	fl = w.b.Flows()
	if fl[0].RingsAB >= 1<<62 || fl[0].BytesAB >= 1<<62 || !strings.Contains(fl[0].Counters, "implausible") {
		t.Fatalf("listing after a guest wrote 2^62: %+v; want the count dropped and said so", fl[0])
	}
	for _, st := range w.b.FlowStats() {
		if st.BytesAB >= 1<<62 {
			t.Fatalf("metrics show %d bytes", st.BytesAB)
		}
	}
}

// TestRegionRevokedAfterEpochWithoutProof: a ruleset change moves a
// pair's flow off the rings but does not retire its region at once (most
// changes concern other traffic). Colluding ends that never LEFT, and
// whose lease shows no passage within the revoke grace, lose the memory
// then; a flow whose lease passed keeps the region and returns to the
// rings in it.
func TestRegionRevokedAfterEpochWithoutProof(t *testing.T) {
	for _, proven := range []bool{false, true} {
		w, p, sa, sb := pairWorld(t, policy.Spec{RingSize: "64KiB"}, broker.Options{PairRegionLinger: time.Hour,
			RevokeGrace: 150 * time.Millisecond, FirewallPoll: 5 * time.Millisecond, ProofOrig: passOrig, ProofReply: passReply})
		connectPair(w, sa, sb, "4000", 1)
		readyIn(t, sa)
		readyIn(t, sb)
		e, _ := w.ct.Lookup(ctrackTuple("4000"))
		w.b.RulesetChanged()
		w.cleared(t)
		if _, dropped := p.counts(); dropped != 0 {
			t.Fatalf("proven %v: the region was dropped at the ruleset change itself", proven)
		}
		if proven {
			w.ct.Pass(e.ID, passOrig|passReply)
		}
		time.Sleep(400 * time.Millisecond) // the grace, and polls
		_, dropped := p.counts()
		if proven && dropped != 0 {
			t.Fatalf("a flow whose lease passed lost its region (%d dropped)", dropped)
		}
		if !proven {
			for start := time.Now(); dropped != 1; _, dropped = p.counts() {
				if time.Since(start) > 5*time.Second {
					t.Fatalf("no passage and no LEFT: region not dropped 5s after the change (grace 150ms), %d dropped", dropped)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
	}
}
