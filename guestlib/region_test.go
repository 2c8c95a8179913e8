package guestlib

import (
	"io"
	"slices"
	"testing"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// processClient is a client as a process guest has it: no region override,
// and a hostd that names no region 0 in WELCOME (listenBare answers).
func processClient(t *testing.T, h *guesttest.Hostd) *Client {
	t.Helper()
	c, err := NewClient(Options{Control: h.Control})
	if err != nil {
		t.Fatal(err)
	}
	c.loopback = true
	t.Cleanup(func() { c.Close() })
	return c
}

// listenBare is listen, with a WELCOME that names no region.
func listenBare(t *testing.T, c *Client, h *guesttest.Hostd) (*Listener, *guesttest.Session) {
	t.Helper()
	return listenAfter(t, c, func() *guesttest.Session {
		s := h.Accept(t)
		s.Expect(t, proto.Hello)
		s.WelcomeNoRegion(t)
		return s
	})
}

// TestRegionByDescriptor: a process guest maps a region that hostd hands
// over as a descriptor (REGION), takes a READY in it, moves bytes through
// its rings, names the region in CLOSE, and unmaps it on UNREGION.
func TestRegionByDescriptor(t *testing.T) {
	h := guesttest.Start(t)
	c := processClient(t, h)
	l, s := listenBare(t, c, h)
	conn, _, open := accepted(t, l, s)
	reg := h.NewRegion(t, 5)
	s.SendRegion(t, reg)
	f := h.PairIn(t, reg, fakeActive(open), open)
	s.Send(t, f.B)
	waitFor(t, "the fast path", func() bool { return conn.Path().Fast })
	if ids := c.Regions(); !slices.Equal(ids, []uint32{5}) {
		t.Fatalf("mapped regions %v, want [5]", ids)
	}
	// The peer's side, through hostd's own mapping of the region.
	ab, ba, err := reg.Pool.Region().Rings(int(f.A.Slot), f.A.Gen)
	if err != nil {
		t.Fatal(err)
	}
	pw, _ := ring.NewWriter(ab, &wait.Policy{})
	pr, _ := ring.NewReader(ba, &wait.Policy{})
	pr.Attach()
	waitFor(t, "the Conn's reader to attach", pw.ReaderAttached)
	pw.Start(0)
	if _, err := pw.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("read %q, %v", buf, err)
	}
	if _, err := conn.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(pr, buf); err != nil || string(buf) != "pong" {
		t.Fatalf("peer read %q, %v", buf, err)
	}
	// UNREGION while the Conn uses the region: it stays mapped.
	s.Send(t, proto.Msg{Type: proto.Unregion, RegionID: 5})
	s.Send(t, proto.Msg{Type: proto.Ping, Nonce: 1})
	s.Expect(t, proto.Pong)
	if ids := c.Regions(); !slices.Equal(ids, []uint32{5}) {
		t.Fatalf("mapped regions %v after UNREGION with a live flow, want [5]", ids)
	}
	conn.Close()
	cl := s.Expect(t, proto.Close)
	if cl.RegionID != 5 || cl.Slot != f.B.Slot || cl.Gen != f.B.Gen || cl.Side != proto.SideB {
		t.Fatalf("CLOSE = %+v, want region 5 slot %d gen %d side B", cl, f.B.Slot, f.B.Gen)
	}
	if ids := c.Regions(); len(ids) != 0 {
		t.Fatalf("mapped regions %v after UNREGION and Close, want none", ids)
	}
}

// TestRegionUnregionThenAgain: UNREGION with no flow unmaps at once; a
// later REGION with the same id maps it again, and REATTACH after a
// reconnect names the region.
func TestRegionUnregionThenAgain(t *testing.T) {
	h := guesttest.Start(t)
	c := processClient(t, h)
	l, s := listenBare(t, c, h)
	reg := h.NewRegion(t, 9)
	s.SendRegion(t, reg)
	sync := func() {
		t.Helper()
		s.Send(t, proto.Msg{Type: proto.Ping, Nonce: 2})
		s.Expect(t, proto.Pong)
	}
	sync()
	if ids := c.Regions(); !slices.Equal(ids, []uint32{9}) {
		t.Fatalf("mapped %v, want [9]", ids)
	}
	s.Send(t, proto.Msg{Type: proto.Unregion, RegionID: 9})
	sync()
	if ids := c.Regions(); len(ids) != 0 {
		t.Fatalf("mapped %v after UNREGION, want none", ids)
	}
	s.SendRegion(t, reg)
	conn, _, open := accepted(t, l, s)
	f := h.PairIn(t, reg, fakeActive(open), open)
	s.Send(t, f.B)
	waitFor(t, "the fast path", func() bool { return conn.Path().Fast })
	s.Close() // hostd restarts; the guest keeps its mapping
	s2 := h.Accept(t)
	s2.Expect(t, proto.Hello)
	s2.WelcomeNoRegion(t)
	got := map[proto.Type]proto.Msg{}
	for range 2 {
		m := s2.Next(t)
		got[m.Type] = m
	}
	if m := got[proto.Reattach]; m.RegionID != 9 || m.Slot != f.B.Slot || m.Gen != f.B.Gen {
		t.Fatalf("re-announced %v, want REATTACH of region 9 slot %d gen %d", got, f.B.Slot, f.B.Gen)
	}
	if ids := c.Regions(); !slices.Equal(ids, []uint32{9}) {
		t.Fatalf("mapped %v after reconnect, want [9]", ids)
	}
}

// TestReadyInUnknownRegion: a READY naming a region the guest was not
// given stays on TCP and is given back (LEFT: the connection lives on),
// region and all.
func TestReadyInUnknownRegion(t *testing.T) {
	h := guesttest.Start(t)
	c := processClient(t, h)
	l, s := listenBare(t, c, h)
	conn, _, open := accepted(t, l, s)
	reg := h.NewRegion(t, 3) // never sent
	f := h.PairIn(t, reg, fakeActive(open), open)
	s.Send(t, f.B)
	if cl := s.Expect(t, proto.Left); cl.RegionID != 3 || cl.Slot != f.B.Slot || cl.Gen != f.B.Gen || cl.ReqID != open.ReqID {
		t.Fatalf("LEFT = %+v, want region 3 slot %d gen %d", cl, f.B.Slot, f.B.Gen)
	}
	if p := conn.Path(); p.Fast {
		t.Fatalf("path = %s, want tcp", p)
	}
	// REGION without a descriptor (as over a non-socket channel) maps nothing.
	s.Send(t, proto.Msg{Type: proto.RegionMsg, RegionID: 4, RegionSize: 1 << 20})
	s.Send(t, proto.Msg{Type: proto.Ping, Nonce: 3})
	s.Expect(t, proto.Pong)
	if ids := c.Regions(); len(ids) != 0 {
		t.Fatalf("mapped %v, want none", ids)
	}
}
