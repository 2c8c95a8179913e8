package broker_test

import (
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// fakePairs makes pair regions over memfds and records what it did.
type fakePairs struct {
	t       *testing.T
	mu      sync.Mutex
	made    []uint32
	dropped []uint32
	pools   map[uint32]*region.Pool
}

func (p *fakePairs) Make(id uint32, a, b *broker.Guest) (*region.Pool, *os.File, error) {
	r, f := shmtest.Region(p.t, region.Geometry{Size: 4 << 20, Slots: 8})
	pool := region.NewPool(r, nil)
	p.mu.Lock()
	p.made = append(p.made, id)
	if p.pools == nil {
		p.pools = map[uint32]*region.Pool{}
	}
	p.pools[id] = pool
	p.mu.Unlock()
	return pool, f, nil
}

func (p *fakePairs) Drop(r *broker.Region) {
	p.mu.Lock()
	p.dropped = append(p.dropped, r.ID)
	p.mu.Unlock()
}

// mem is region id's memory, as a guest maps it.
func (p *fakePairs) mem(id uint32) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pools[id].Region().Mem()
}

func (p *fakePairs) counts() (made, dropped int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.made), len(p.dropped)
}

// fileSession is a session that can take descriptors, as a process
// guest's Unix socket can.
type fileSession struct {
	*session
	files chan *os.File
}

func newFileSession(g *broker.Guest) *fileSession {
	return &fileSession{session: newSession(g), files: make(chan *os.File, 16)}
}

func (s *fileSession) SendFile(m proto.Msg, f *os.File) {
	s.files <- f
	s.Send(m)
}

// pairWorld is a world of two process guests whose pair regions go with
// their last flow (no lingering), unless opts say otherwise.
func pairWorld(t *testing.T, spec policy.Spec, opts ...broker.Options) (*world, *fakePairs, *fileSession, *fileSession) {
	o := broker.Options{PairRegionLinger: -1}
	if len(opts) > 0 {
		o = opts[0]
	}
	w := newWorldOpts(t, spec, o)
	w.g1.SharedRegion, w.g2.SharedRegion = false, false
	p := &fakePairs{t: t}
	w.b.UsePairRegions(p)
	sa, sb := newFileSession(w.g1), newFileSession(w.g2)
	w.b.Attach(sa)
	w.b.Attach(sb)
	w.b.Listen(sb, ap("10.0.0.2:80"), true)
	return w, p, sa, sb
}

// TestPairRegionLingers: a pair region outlives its last flow for a
// while, so the next connection of the pair reuses it (no new REGION, no
// new mapping: short connections one after another stay cheap); once it
// has had no flow for the linger time, both get UNREGION and it is dropped.
func TestPairRegionLingers(t *testing.T) {
	w, p, sa, sb := pairWorld(t, policy.Spec{RingSize: "64KiB"}, broker.Options{PairRegionLinger: 200 * time.Millisecond})
	var id uint32
	flow := func(port string, req uint32, first bool) []proto.Msg {
		ta, tb := w.conn("10.0.0.1:"+port, "10.0.0.2:80")
		w.b.Open(sa, open(proto.Active, ta, req))
		w.b.Open(sb, open(proto.Passive, tb, req+1))
		var readies []proto.Msg
		for _, s := range []*fileSession{sa, sb} {
			m := s.next(t)
			if first {
				if m.Type != proto.RegionMsg {
					t.Fatalf("first flow: %+v, want REGION", m)
				}
				<-s.files
				id = m.RegionID
				m = s.next(t)
			}
			if m.Type != proto.Ready || m.RegionID != id {
				t.Fatalf("%+v, want READY in region %d (and no REGION after the first)", m, id)
			}
			readies = append(readies, m)
		}
		return readies
	}
	closeBoth := func(r []proto.Msg) {
		w.b.CloseConn(sa, proto.Msg{Type: proto.Close, ReqID: r[0].ReqID, RegionID: id, Slot: r[0].Slot, Gen: r[0].Gen, Side: proto.SideA})
		if m := sb.next(t); m.Type != proto.Down || m.Reason != proto.ReasonPeerGone {
			t.Fatalf("after A's CLOSE, B got %+v, want DOWN(peer-gone)", m)
		}
		w.b.CloseConn(sb, proto.Msg{Type: proto.Close, ReqID: r[1].ReqID, RegionID: id, Slot: r[1].Slot, Gen: r[1].Gen, Side: proto.SideB})
	}
	closeBoth(flow("4000", 1, true))
	for i := range 3 {
		closeBoth(flow(fmt.Sprint(4001+i), uint32(10+2*i), false))
	}
	if made, dropped := p.counts(); made != 1 || dropped != 0 {
		t.Fatalf("made %d, dropped %d regions while the pair kept connecting; want 1 and 0", made, dropped)
	}
	for _, s := range []*fileSession{sa, sb} {
		if m := s.next(t); m.Type != proto.Unregion || m.RegionID != id {
			t.Fatalf("after the linger: %+v, want UNREGION %d", m, id)
		}
	}
	if made, dropped := p.counts(); made != 1 || dropped != 1 {
		t.Fatalf("made %d, dropped %d regions; want 1 and 1", made, dropped)
	}
}

// TestPairRegionHandedOver: two process guests get a region of their own,
// handed to each as REGION with a descriptor before the first READY in it;
// the next flow reuses it without REGION; when the last flow is freed both
// get UNREGION and the region is dropped.
func TestPairRegionHandedOver(t *testing.T) {
	w, p, sa, sb := pairWorld(t, policy.Spec{RingSize: "64KiB"})
	open2 := func(port string, req uint32) {
		ta, tb := w.conn("10.0.0.1:"+port, "10.0.0.2:80")
		w.b.Open(sa, open(proto.Active, ta, req))
		w.b.Open(sb, open(proto.Passive, tb, req+1))
	}
	open2("4000", 1)
	var id uint32
	var readies []proto.Msg
	for _, s := range []*fileSession{sa, sb} {
		m := s.next(t)
		if m.Type != proto.RegionMsg || m.RegionID == 0 || m.RegionSize != 4<<20 {
			t.Fatalf("first message %+v, want REGION of a pair region", m)
		}
		select {
		case f := <-s.files:
			if f == nil {
				t.Fatal("REGION without a file")
			}
		default:
			t.Fatal("REGION sent without SendFile")
		}
		id = m.RegionID
		r := s.next(t)
		if r.Type != proto.Ready || r.RegionID != id {
			t.Fatalf("then %+v, want READY in region %d", r, id)
		}
		readies = append(readies, r)
	}
	open2("4001", 3)
	var second proto.Msg
	for _, s := range []*fileSession{sa, sb} {
		m := s.next(t)
		if m.Type != proto.Ready || m.RegionID != id {
			t.Fatalf("second flow: %+v, want READY in region %d without REGION", m, id)
		}
		second = m
	}
	if fl := w.b.Flows(); len(fl) != 2 || fl[0].Name[:4] != "t/p1" {
		t.Fatalf("flows %+v, want two in pair region 1", fl)
	}
	// A CLOSE naming region 0 (the group region) is not this flow.
	w.b.CloseConn(sa, proto.Msg{Type: proto.Close, RegionID: 0, Slot: readies[0].Slot, Gen: readies[0].Gen, Side: proto.SideA})
	if fl := w.b.Flows(); len(fl) != 2 || fl[0].Attached != "ab" || fl[1].Attached != "ab" {
		t.Fatalf("a CLOSE in region 0 released a flow of the pair region: %+v", fl)
	}
	closeAll := func(s *fileSession, side proto.Side) {
		for _, r := range []proto.Msg{readies[0], second} {
			w.b.CloseConn(s, proto.Msg{Type: proto.Close, RegionID: id, Slot: r.Slot, Gen: r.Gen, Side: side})
		}
	}
	closeAll(sa, proto.SideA)
	if m := sa.next(t); m.Type != proto.Unregion || m.RegionID != id {
		t.Fatalf("after A's last CLOSE: %+v, want UNREGION %d", m, id)
	}
	for range 2 {
		if m := sb.next(t); m.Type != proto.Down || m.Reason != proto.ReasonPeerGone {
			t.Fatalf("after A's CLOSEs, B got %+v, want DOWN(peer-gone)", m)
		}
	}
	sb.none(t)
	if _, dropped := p.counts(); dropped != 0 {
		t.Fatal("region dropped while B still holds flows in it")
	}
	closeAll(sb, proto.SideB)
	if m := sb.next(t); m.Type != proto.Unregion || m.RegionID != id {
		t.Fatalf("after B's last CLOSE: %+v, want UNREGION %d", m, id)
	}
	if made, dropped := p.counts(); made != 1 || dropped != 1 {
		t.Fatalf("made %d, dropped %d regions; want 1 and 1", made, dropped)
	}
	// A new flow makes a new region, handed over again.
	open2("4002", 5)
	for _, s := range []*fileSession{sa, sb} {
		if m := s.next(t); m.Type != proto.RegionMsg || m.RegionID == id {
			t.Fatalf("after the drop: %+v, want REGION of a new region", m)
		}
		<-s.files
		s.next(t)
	}
}

// TestPairRegionNotReachableByOthers: a guest that is not one of the pair
// cannot name the pair's region: its CLOSE and KICK do nothing and its
// REATTACH is answered with DOWN (leave what you think you hold).
func TestPairRegionNotReachableByOthers(t *testing.T) {
	w, _, sa, sb := pairWorld(t, policy.Spec{})
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.next(t)
	r := sa.next(t)
	sb.next(t)
	sb.next(t)
	w.g3.Group = w.g1.Group // even a guest of the same group
	s3 := newFileSession(w.g3)
	w.b.Attach(s3)
	m := proto.Msg{RegionID: r.RegionID, Slot: r.Slot, Gen: r.Gen, Side: proto.SideA}
	m.Type = proto.Close
	w.b.CloseConn(s3, m)
	m.Type = proto.Kick
	w.b.Kick(s3, m)
	m.Type = proto.Reattach
	w.b.Reattach(s3, m)
	if got := s3.next(t); got.Type != proto.Down {
		t.Fatalf("REATTACH by an outsider: %+v, want DOWN", got)
	}
	sa.none(t)
	sb.none(t)
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].State != "ready" || fl[0].Attached != "ab" {
		t.Fatalf("flows %+v, want the pair's flow untouched", fl)
	}
}

// TestSharedAndProcessGuestStayOnTCP: a SharedRegion guest (a VM) and a
// process guest share no region: their flow stays on TCP.
func TestSharedAndProcessGuestStayOnTCP(t *testing.T) {
	w, _, sa, sb := pairWorld(t, policy.Spec{})
	w.g2.SharedRegion = true
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	for _, s := range []*fileSession{sa, sb} {
		if m := s.next(t); m.Type != proto.TCP || m.Reason != proto.ReasonCrossGroup {
			t.Fatalf("got %+v, want TCP(cross-group)", m)
		}
	}
}

// TestQuotaChargesTheOpener: a guest at its quota gets TCP(guest-quota) for
// the connections it opens, and the guest it connected to keeps the fast
// path for its own; freeing a flow gives the quota back.
func TestQuotaChargesTheOpener(t *testing.T) {
	w, _, sa, sb := pairWorld(t, policy.Spec{RingSize: "64KiB"})
	w.g1.Group.Quota = broker.Quota{Flows: 2, RingBytes: 1 << 30}
	w.b.Listen(sa, ap("10.0.0.1:80"), true)
	drain := func(s *fileSession) proto.Msg {
		for {
			m := s.next(t)
			if m.Type == proto.RegionMsg {
				<-s.files
				continue
			}
			return m
		}
	}
	var keep []proto.Msg
	for i, port := range []string{"4000", "4001", "4002"} {
		ta, tb := w.conn("10.0.0.1:"+port, "10.0.0.2:80")
		w.b.Open(sa, open(proto.Active, ta, uint32(10+2*i)))
		w.b.Open(sb, open(proto.Passive, tb, uint32(11+2*i)))
		ma, mb := drain(sa), drain(sb)
		want := proto.Ready
		if i == 2 {
			want = proto.TCP
		}
		if ma.Type != want || mb.Type != want || (want == proto.TCP && (ma.Reason != proto.ReasonGuestQuota || mb.Reason != proto.ReasonGuestQuota)) {
			t.Fatalf("connection %d from g1: %+v / %+v, want %s (guest-quota at the third)", i, ma, mb, want)
		}
		if want == proto.Ready {
			keep = append(keep, ma)
		}
	}
	// g2 connecting to g1 is charged to g2: still fast.
	ta, tb := w.conn("10.0.0.2:5000", "10.0.0.1:80")
	w.b.Open(sb, open(proto.Active, ta, 30))
	w.b.Open(sa, open(proto.Passive, tb, 31))
	if mb, ma := drain(sb), drain(sa); mb.Type != proto.Ready || ma.Type != proto.Ready {
		t.Fatalf("g2 to g1 with g1 at its quota: %+v / %+v, want READY", mb, ma)
	}
	// One of g1's flows freed: g1 may open again.
	w.b.CloseConn(sa, proto.Msg{Type: proto.Close, RegionID: keep[0].RegionID, Slot: keep[0].Slot, Gen: keep[0].Gen, Side: proto.SideA})
	w.b.CloseConn(sb, proto.Msg{Type: proto.Close, RegionID: keep[0].RegionID, Slot: keep[0].Slot, Gen: keep[0].Gen, Side: proto.SideB})
	ta, tb = w.conn("10.0.0.1:4003", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 40))
	w.b.Open(sb, open(proto.Passive, tb, 41))
	if ma := drain(sa); ma.Type != proto.Ready {
		t.Fatalf("after a flow was freed: %+v, want READY", ma)
	}
}
