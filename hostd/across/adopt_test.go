package across

import (
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// adopted is a relay pair region a killed hostd left on h1 (the world's
// host, restarted): g1 is side A of one relayed connection (10.0.0.1:port
// to h0's guest), the dead relay (an earlier run's id) side B. g1 started
// its write ring at 1000 and wrote 300 bytes, of which the relay freed
// 100; the relay started g1's read ring at 5000 and wrote 200 bytes.
type adopted struct {
	w     *world
	ready proto.Msg // g1's side of the pair, as a REATTACH names it
	mem   []byte
}

const adoptedRegion = 40

func (w *world) adoptRelayPair(port uint16, grace time.Duration) *adopted {
	t := w.t
	t.Helper()
	reg, f := shmtest.Region(t, region.Geometry{Size: 4 << 20, Slots: 8})
	pool := region.NewPool(reg, nil)
	src := netip.AddrPortFrom(netip.MustParseAddr("10.0.0.1"), port)
	idx, e, err := pool.Alloc(region.Request{OwnerA: w.g1.ID, OwnerB: broker.RelayIDBase + 7, Capacity: orphanCap,
		Src: src, Dst: netip.MustParseAddrPort(peerGuest + ":80")})
	if err != nil {
		t.Fatal(err)
	}
	a := &adopted{w: w, mem: reg.Mem(), ready: proto.Msg{Type: proto.Ready, ReqID: 77, RegionID: adoptedRegion, Slot: uint32(idx), Gen: e.Gen, Side: proto.SideA,
		RingAB: uint64(e.RingAB), RingBA: uint64(e.RingBA), Capacity: uint32(e.Capacity)}}
	o := &orphanRig{mem: a.mem, m: proto.Msg{Capacity: a.ready.Capacity, RingAB: a.ready.RingAB, RingBA: a.ready.RingBA, Side: proto.SideB}}
	o.stream(t)
	peerOf := func(addr netip.Addr) (string, bool) {
		return "h0", netip.MustParsePrefix("10.9.0.0/16").Contains(addr)
	}
	var n int
	var ok bool
	m := region.Meta{Kind: region.KindPair, ID: adoptedRegion, GuestA: w.g1.ID, GuestB: broker.RelayIDBase + 7}
	w.loop(func() { n, ok = w.r.AdoptOrphans(m, pool, f, peerOf, grace) })
	if !ok || n != 1 {
		t.Fatalf("AdoptOrphans: %d flows, %v; want 1, true", n, ok)
	}
	return a
}

// reattach is g1's REATTACH of its side.
func (a *adopted) reattach() {
	a.w.b.Reattach(a.w.s1, proto.Msg{Type: proto.Reattach, ReqID: a.ready.ReqID, RegionID: a.ready.RegionID, Slot: a.ready.Slot, Gen: a.ready.Gen, Side: proto.SideA})
}

// stop is h0's stop for the connection (its id 900, flow 3), naming it by
// its tuple; h1's id for it is one h0 learned from the dead hostd.
func (a *adopted) stop(h *hostile, port uint16, at uint64, never bool) {
	h.across(peers.Across{Op: opStop, ID: 900, Peer: 12345, Flow: 3, At: at, Never: never, Reason: proto.ReasonPeerUnreachable.String(),
		Claim: &peers.Claim{Src: netip.MustParseAddrPort(peerGuest + ":80"), Dst: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.1"), port), Group: "t"}})
}

// readLeft reports whether g1's read ring is marked left.
func (a *adopted) readLeft() bool {
	size := uint64(ring.Size(int(a.ready.Capacity)))
	rg, err := ring.Attach(a.mem[a.ready.RingBA:a.ready.RingBA+size], int(a.ready.Capacity))
	if err != nil {
		a.w.t.Fatal(err)
	}
	return rg.Stats().Left
}

// resume is g1's RESUME.
func (a *adopted) resume(d time.Duration) proto.Msg {
	m := a.w.s1.next(a.w.t, proto.Resume, d)
	if m.ReqID != a.ready.ReqID || m.Slot != a.ready.Slot || m.RegionID != adoptedRegion {
		a.w.t.Fatalf("RESUME %+v names another flow than %+v", m, a.ready)
	}
	return m
}

// TestAdoptOrphanResumes: the restarted host matches the peer's stop to
// the adopted stretch by its tuple, answers with where the dead relay's
// ring ended, and its guest resumes where the peer's ring ended; its read
// ring is marked left; its LEFT frees the slot.
func TestAdoptOrphanResumes(t *testing.T) {
	for _, tc := range []struct {
		name      string
		at        uint64
		never     bool
		early     bool // the stop comes before g1's REATTACH
		want      uint64
		wantReset bool
	}{
		{name: "mid-stretch", at: 1150, want: 1150},
		{name: "at-the-freed-bytes", at: 1100, want: 1100},
		{name: "at-its-end", at: 1300, want: 1300},
		{name: "stop-before-reattach", at: 1200, early: true, want: 1200},
		{name: "freed-offset", at: 1050, wantReset: true},
		{name: "past-its-end", at: 1301, wantReset: true},
		{name: "never-but-freed", never: true, wantReset: true}, // the peer's ring never started, yet the relay freed bytes
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			a := w.adoptRelayPair(9000, time.Minute)
			h := w.dial()
			if !tc.early {
				a.reattach()
			}
			a.stop(h, 9000, tc.at, tc.never)
			ans := h.next(opStop, 5*time.Second)
			if ans.Peer != 900 || ans.Flow != 3 || ans.Gone || ans.Never || ans.At != 5200 || ans.ID == 0 {
				t.Fatalf("h1's answer %+v, want peer 900, flow 3, at 5200", ans)
			}
			if tc.early {
				a.reattach()
			}
			m := a.resume(5 * time.Second)
			switch {
			case tc.wantReset && m.Offset != proto.ResumeReset:
				t.Fatalf("RESUME at %d, want ResumeReset", m.Offset)
			case !tc.wantReset && m.Offset != tc.want:
				t.Fatalf("RESUME at %d, want %d", m.Offset, tc.want)
			}
			if !a.readLeft() {
				t.Fatal("g1's read ring is not marked left")
			}
			// The same stop again (the peer's channel came up once more,
			// and its stop went out again): answered the same.
			a.stop(h, 9000, tc.at, tc.never)
			if again := h.next(opStop, 5*time.Second); again.ID != ans.ID || again.Peer != ans.Peer || again.Flow != ans.Flow || again.At != ans.At || again.Gone != ans.Gone {
				t.Fatalf("h1's answer to a repeated stop %+v, want %+v", again, ans)
			}
			w.left(a.ready)
			w.b.CloseConn(w.s1, proto.Msg{Type: proto.Close, ReqID: a.ready.ReqID})
			h.across(peers.Across{Op: opClose, ID: 900, Peer: ans.ID})
			w.settled(h)
		})
	}
}

// TestAdoptOrphanRefuses: a stop is matched only if it comes from the
// peer whose prefixes hold the connection's other end and names the same
// trust group; without the peer's stop the guest is reset after
// ResumeTimeout; broken rings make both ends reset.
func TestAdoptOrphanRefuses(t *testing.T) {
	t.Run("other-peer-or-group", func(t *testing.T) {
		w := newWorld(t)
		a := w.adoptRelayPair(9001, time.Minute)
		a.reattach()
		h := w.dial()
		other := w.dialAs("a0", "10.10.1.2")
		a.stop(other, 9001, 1150, false) // a0 speaks for h0's connection
		if ans := other.next(opStop, 5*time.Second); !ans.Gone {
			t.Fatalf("h1 answered a0's stop for h0's connection with %+v, want gone", ans)
		}
		h.across(peers.Across{Op: opStop, ID: 900, Flow: 3, At: 1150, Claim: &peers.Claim{Src: netip.MustParseAddrPort(peerGuest + ":80"),
			Dst: netip.MustParseAddrPort("10.0.0.1:9001"), Group: "other"}})
		if ans := h.next(opStop, 5*time.Second); !ans.Gone {
			t.Fatalf("h1 answered a stop of another group with %+v, want gone", ans)
		}
		a.stop(h, 9001, 1150, false)
		if ans := h.next(opStop, 5*time.Second); ans.Gone || ans.At != 5200 {
			t.Fatalf("h1's answer %+v, want at 5200", ans)
		}
		if m := a.resume(5 * time.Second); m.Offset != 1150 {
			t.Fatalf("RESUME at %d, want 1150", m.Offset)
		}
	})
	t.Run("no-stop", func(t *testing.T) {
		w := newWorld(t)
		w.loop(func() { w.r.opts.ResumeTimeout = 1500 * time.Millisecond })
		a := w.adoptRelayPair(9002, time.Minute)
		a.reattach()
		if m := a.resume(10 * time.Second); m.Offset != proto.ResumeReset {
			t.Fatalf("RESUME at %d without the peer's stop, want ResumeReset", m.Offset)
		}
		if !a.readLeft() {
			t.Fatal("g1's read ring is not marked left")
		}
	})
	t.Run("no-reattach", func(t *testing.T) {
		// The guest never reattaches: gone after its grace, and once the
		// peer's stop did not come either, h1 keeps nothing of it.
		w := newWorld(t)
		w.loop(func() { w.r.opts.ResumeTimeout = 1500 * time.Millisecond })
		w.adoptRelayPair(9004, 200*time.Millisecond)
		w.settledWithin(10 * time.Second)
	})
	t.Run("broken-rings", func(t *testing.T) {
		w := newWorld(t)
		reg, f := shmtest.Region(t, region.Geometry{Size: 4 << 20, Slots: 8})
		pool := region.NewPool(reg, nil)
		idx, e, err := pool.Alloc(region.Request{OwnerA: w.g1.ID, OwnerB: broker.RelayIDBase + 3, Capacity: orphanCap,
			Src: netip.MustParseAddrPort("10.0.0.1:9003"), Dst: netip.MustParseAddrPort(peerGuest + ":80")})
		if err != nil {
			t.Fatal(err)
		}
		// The guest's ring: its head past its tail (the guest wrote it).
		rg, err := ring.Attach(reg.Mem()[e.RingAB:e.RingAB+int64(ring.Size(orphanCap))], orphanCap)
		if err != nil {
			t.Fatal(err)
		}
		wr, _ := ring.NewWriter(rg, &wait.Policy{})
		wr.Start(10)
		if _, err := wr.Write(make([]byte, 64)); err != nil {
			t.Fatal(err)
		}
		o := &orphanRig{mem: reg.Mem(), m: proto.Msg{RingAB: uint64(e.RingAB)}}
		binary.LittleEndian.PutUint64(o.hdr(false)[ring.OffHead:], 1<<40)
		peerOf := func(netip.Addr) (string, bool) { return "h0", true }
		var ok bool
		w.loop(func() {
			_, ok = w.r.AdoptOrphans(region.Meta{Kind: region.KindPair, ID: adoptedRegion, GuestA: w.g1.ID, GuestB: broker.RelayIDBase + 3}, pool, f, peerOf, time.Minute)
		})
		if !ok {
			t.Fatal("not adopted")
		}
		w.b.Reattach(w.s1, proto.Msg{Type: proto.Reattach, ReqID: 5, RegionID: adoptedRegion, Slot: uint32(idx), Gen: e.Gen, Side: proto.SideA})
		h := w.dial()
		h.across(peers.Across{Op: opStop, ID: 900, Flow: 3, At: 11, Claim: &peers.Claim{Src: netip.MustParseAddrPort(peerGuest + ":80"),
			Dst: netip.MustParseAddrPort("10.0.0.1:9003"), Group: "t"}})
		if ans := h.next(opStop, 5*time.Second); !ans.Gone || ans.Peer != 900 {
			t.Fatalf("h1's answer for a broken stretch %+v, want gone", ans)
		}
		if m := w.s1.next(t, proto.Resume, 5*time.Second); m.Offset != proto.ResumeReset {
			t.Fatalf("RESUME at %d for a broken stretch, want ResumeReset", m.Offset)
		}
	})
}

// TestAdoptOrphanNotAdopted: a relay pair region is adopted only with one
// guest a relay and the other a live guest, live slots whose tuples join
// that guest to one peer's prefixes; otherwise AdoptOrphans keeps nothing
// (the caller drops the region, its connections reset as before).
func TestAdoptOrphanNotAdopted(t *testing.T) {
	w := newWorld(t)
	peerOf := func(addr netip.Addr) (string, bool) {
		switch {
		case netip.MustParsePrefix("10.9.0.0/16").Contains(addr):
			return "h0", true
		case netip.MustParsePrefix("10.10.0.0/16").Contains(addr):
			return "a0", true
		}
		return "", false
	}
	relay := uint32(broker.RelayIDBase + 9)
	for _, tc := range []struct {
		name   string
		a, b   uint32
		tuples [][2]string // live slots: src, dst
	}{
		{"no-live-flow", w.g1.ID, relay, nil},
		{"two-relays", relay, relay + 1, [][2]string{{"10.0.0.1:1", peerGuest + ":80"}}},
		{"unknown-guest", 77, relay, [][2]string{{"10.0.0.1:1", peerGuest + ":80"}}},
		{"not-the-guests-tuple", w.g1.ID, relay, [][2]string{{"10.0.0.9:1", peerGuest + ":80"}}},
		{"no-peers-prefix", w.g1.ID, relay, [][2]string{{"10.0.0.1:1", "10.200.0.1:80"}}},
		{"two-peers", w.g1.ID, relay, [][2]string{{"10.0.0.1:1", peerGuest + ":80"}, {"10.0.0.1:2", "10.10.1.2:80"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg, f := shmtest.Region(t, region.Geometry{Size: 4 << 20, Slots: 8})
			pool := region.NewPool(reg, nil)
			for _, tu := range tc.tuples {
				if _, _, err := pool.Alloc(region.Request{OwnerA: tc.a, OwnerB: tc.b, Capacity: orphanCap,
					Src: netip.MustParseAddrPort(tu[0]), Dst: netip.MustParseAddrPort(tu[1])}); err != nil {
					t.Fatal(err)
				}
			}
			var n int
			var ok bool
			w.loop(func() {
				n, ok = w.r.AdoptOrphans(region.Meta{Kind: region.KindPair, ID: 50, GuestA: tc.a, GuestB: tc.b}, pool, f, peerOf, time.Minute)
			})
			if ok || n != 0 {
				t.Fatalf("AdoptOrphans = %d, %v; want 0, false", n, ok)
			}
			if c := w.b.Counts(); c.Flows != 0 || c.Conns != 0 {
				t.Fatalf("the broker keeps %d flows, %d records of a region not adopted", c.Flows, c.Conns)
			}
		})
	}
}

// settledWithin waits until h1 keeps no record, ring pair or cross-host
// connection.
func (w *world) settledWithin(d time.Duration) {
	w.t.Helper()
	for deadline := time.Now().Add(d); ; time.Sleep(20 * time.Millisecond) {
		var conns int
		w.loop(func() { conns = len(w.r.conns) })
		c := w.b.Counts()
		if c.Conns == 0 && c.Flows == 0 && conns == 0 {
			return
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("h1 still keeps %d records, %d ring pairs, %d cross-host connections %s on", c.Conns, c.Flows, conns, d)
		}
	}
}
