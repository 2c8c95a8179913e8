package server_test

import (
	"net"
	"net/netip"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// memPairs makes pair regions over memfds.
type memPairs struct{ t *testing.T }

func (p memPairs) Make(id uint32, a, b *broker.Guest) (*region.Pool, *os.File, error) {
	r, f := shmtest.Region(p.t, region.Geometry{Size: 4 << 20, Slots: 8})
	return region.NewPool(r, nil), f, nil
}

func (memPairs) Drop(*broker.Region) {}

// readWithFD reads one message from s, and the descriptor that came with
// it (-1 if none).
func (s *guest) readWithFD() (proto.Msg, int) {
	s.t.Helper()
	uc := s.c.(*net.UnixConn)
	fd := -1
	oob := make([]byte, unix.CmsgSpace(4*4))
	read := func(b []byte) {
		for len(b) > 0 {
			n, oobn, _, _, err := uc.ReadMsgUnix(b, oob)
			if err != nil {
				s.t.Fatalf("read: %v", err)
			}
			cms, _ := unix.ParseSocketControlMessage(oob[:oobn])
			for i := range cms {
				fds, _ := unix.ParseUnixRights(&cms[i])
				for _, x := range fds {
					if fd >= 0 {
						s.t.Fatalf("more than one descriptor with one message")
					}
					fd = x
				}
			}
			b = b[n:]
		}
	}
	h := make([]byte, proto.HeaderSize)
	read(h)
	typ, n, err := proto.ParseHeader(h)
	if err != nil {
		s.t.Fatal(err)
	}
	p := make([]byte, n)
	read(p)
	m, err := proto.DecodePayload(typ, p)
	if err != nil {
		s.t.Fatal(err)
	}
	return m, fd
}

// TestRegionWithDescriptor: with pair regions on, a process guest's
// WELCOME names no region; its first READY comes after a REGION that
// carries the region's descriptor (SCM_RIGHTS), and the region mapped from
// that descriptor holds the flow the READY names.
func TestRegionWithDescriptor(t *testing.T) {
	w := newWorld(t)
	w.b.UsePairRegions(memPairs{t})
	// The pair region is unmapped by a cleanup registered when it is made,
	// which runs before the world's: end the sessions while it is mapped.
	defer func() {
		w.srv.Close()
		w.b.Close()
	}()
	hello := func(g *broker.Guest) *guest {
		s := w.dial(t, g)
		s.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: formats})
		if m := s.next(); m.Type != proto.Welcome || m.Region != "" || m.RegionSize != 0 {
			t.Fatalf("WELCOME %+v, want one naming no region", m)
		}
		return s
	}
	s1, s2 := hello(w.g1), hello(w.g2)
	s2.send(proto.Msg{Type: proto.Listen, Local: netip.MustParseAddrPort("10.0.0.2:80")})
	s2.ping(1)
	a := ctrack.Tuple{Src: netip.MustParseAddrPort("10.0.0.1:4000"), Dst: netip.MustParseAddrPort("10.0.0.2:80")}
	w.ct.Add(a, a.Reverse(), 0)
	s1.send(proto.Msg{Type: proto.Intent, Local: a.Src, Remote: a.Dst},
		proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Active, Local: a.Src, Remote: a.Dst})
	s2.send(proto.Msg{Type: proto.Open, ReqID: 2, Role: proto.Passive, Local: a.Dst, Remote: a.Src})
	for _, s := range []*guest{s1, s2} {
		m, fd := s.readWithFD()
		if m.Type != proto.RegionMsg || m.RegionID == 0 || fd < 0 {
			t.Fatalf("got %+v with descriptor %d, want REGION with one", m, fd)
		}
		f := os.NewFile(uintptr(fd), "region")
		r, err := region.OpenFile(f)
		f.Close()
		if err != nil {
			t.Fatalf("map the region's descriptor: %v", err)
		}
		defer r.Close()
		ready, extra := s.readWithFD()
		if ready.Type != proto.Ready || ready.RegionID != m.RegionID || extra >= 0 {
			t.Fatalf("then %+v (descriptor %d), want READY in region %d", ready, extra, m.RegionID)
		}
		if e, err := r.Entry(int(ready.Slot)); err != nil || e.Gen != ready.Gen || e.Capacity != int(ready.Capacity) {
			t.Fatalf("the region has %+v, %v; READY says slot %d gen %d", e, err, ready.Slot, ready.Gen)
		}
	}
}
