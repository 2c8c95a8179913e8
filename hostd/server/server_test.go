package server_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/ctrack/cttest"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/hostd/server"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// formats is what a version-3 guest library's HELLO offers: the switching
// ring format.
const formats = 1 << ring.FormatVersion

// wait bounds every read a test makes on a control socket.
const wait = 5 * time.Second

// world is a real control server over a real broker, a fake conntrack table
// and a region in ordinary memory: two guests of one trust group, each with
// a control socket in a temporary directory.
type world struct {
	srv    *server.Server
	b      *broker.Broker
	ct     *cttest.Table
	m      *metrics.Set
	logs   *logBuf
	g1, g2 *broker.Guest
	socks  map[*broker.Guest]string
}

func newWorld(t *testing.T) *world {
	t.Helper()
	return newWorldOpts(t, server.Options{}, broker.Options{})
}

// newWorldOpts is newWorld with server options, and broker limits.
func newWorldOpts(t *testing.T, sopts server.Options, bopts broker.Options) *world {
	t.Helper()
	// Registered first, so it runs last: after the server and the broker
	// closed, none of their goroutines may be left.
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })

	r, _ := shmtest.Region(t, region.Geometry{Size: 8 << 20, Slots: 8})
	pool := region.NewPool(r, nil)
	grp := &broker.Group{Name: "t", Region: "/dev/shm/shunt-test", Pool: pool}
	mk := func(name string, id uint32, addr string) *broker.Guest {
		g := &broker.Guest{Name: name, ID: id, Group: grp}
		g.SetAddrs(broker.Addrs{Prefixes: []netip.Prefix{netip.PrefixFrom(netip.MustParseAddr(addr), 32)}})
		return g
	}
	w := &world{ct: &cttest.Table{}, m: metrics.New(), logs: &logBuf{},
		g1: mk("g1", 1, "10.0.0.1"), g2: mk("g2", 2, "10.0.0.2")}
	log := hclog.New(&hclog.LoggerOptions{Output: w.logs, Level: hclog.Debug})
	tab, err := policy.Compile(policy.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	w.b = broker.New(log.Named("broker"), w.ct, w.m, tab, []*broker.Guest{w.g1, w.g2},
		broker.Options{PairingTimeout: wait, LookupTimeout: 10 * time.Millisecond, Limits: bopts.Limits})
	dir := t.TempDir()
	w.socks = map[*broker.Guest]string{w.g1: filepath.Join(dir, "g1.sock"), w.g2: filepath.Join(dir, "g2.sock")}
	w.srv, err = server.Listen(log.Named("control"), w.b, w.m, sopts, []server.Endpoint{
		{Guest: w.g1, Path: w.socks[w.g1]}, {Guest: w.g2, Path: w.socks[w.g2]},
	})
	if err != nil {
		w.b.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		w.srv.Close()
		w.b.Close()
	})
	return w
}

// malformed is hostd's count of channels closed for malformed input.
func (w *world) malformed(t *testing.T) float64 {
	t.Helper()
	mfs, err := w.m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "shunt_control_malformed_total" {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("no shunt_control_malformed_total metric")
	return 0
}

// listening is what the broker says guest g listens on.
func (w *world) listening(g *broker.Guest) []string {
	for _, gi := range w.b.Guests() {
		if gi.Name == g.Name {
			return gi.Listening
		}
	}
	return nil
}

// guest is one control session, spoken to as a guest would.
type guest struct {
	t   *testing.T
	c   net.Conn
	buf []byte
}

// dial connects to g's control socket; every read and write on it has a
// deadline.
func (w *world) dial(t *testing.T, g *broker.Guest) *guest {
	t.Helper()
	c, err := net.DialTimeout("unix", w.socks[g], wait)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.SetDeadline(time.Now().Add(wait)); err != nil {
		t.Fatal(err)
	}
	return &guest{t: t, c: c}
}

// hello dials g and says HELLO; it returns the session after its WELCOME.
func (w *world) hello(t *testing.T, g *broker.Guest) *guest {
	t.Helper()
	s := w.dial(t, g)
	s.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: formats})
	if m := s.next(); m.Type != proto.Welcome || m.GuestID != g.ID || m.Region != g.Group.Region ||
		m.RegionSize != uint64(g.Group.Pool.Region().Layout().Size) {
		t.Fatalf("after HELLO got %+v, want WELCOME for guest %d of region %s", m, g.ID, g.Group.Region)
	}
	return s
}

func (s *guest) send(ms ...proto.Msg) {
	s.t.Helper()
	var b []byte
	for _, m := range ms {
		var err error
		if b, err = m.Append(b); err != nil {
			s.t.Fatal(err)
		}
	}
	s.raw(b)
}

func (s *guest) raw(b []byte) {
	s.t.Helper()
	if _, err := s.c.Write(b); err != nil {
		s.t.Fatalf("write: %v", err)
	}
}

func (s *guest) next() proto.Msg {
	s.t.Helper()
	m, buf, err := proto.Read(s.c, s.buf)
	s.buf = buf
	if err != nil {
		s.t.Fatalf("read: %v", err)
	}
	return m
}

// expect reads the next message and checks its type (and reason, if set).
func (s *guest) expect(typ proto.Type, reason proto.Reason) proto.Msg {
	s.t.Helper()
	m := s.next()
	if m.Type != typ || (reason != proto.ReasonNone && m.Reason != reason) {
		s.t.Fatalf("got %+v, want %s (reason %s)", m, typ, reason)
	}
	return m
}

// ping checks that the session is served: PING gets its PONG.
func (s *guest) ping(nonce uint64) {
	s.t.Helper()
	s.send(proto.Msg{Type: proto.Ping, Nonce: nonce})
	if m := s.next(); m.Type != proto.Pong || m.Nonce != nonce {
		s.t.Fatalf("after PING %d got %+v, want PONG %d", nonce, m, nonce)
	}
}

// closed checks that hostd closed the channel: the next read ends it (EOF,
// or a reset when hostd left some of our bytes unread).
func (s *guest) closed() {
	s.t.Helper()
	m, _, err := proto.Read(s.c, nil)
	if !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		s.t.Fatalf("read after ERROR: %+v, %v; want the channel closed", m, err)
	}
}

// logBuf collects the logs; hclog writes from the server's goroutines.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func frame(t *testing.T, m proto.Msg) []byte {
	t.Helper()
	b, err := m.Append(nil)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestBeforeHello: what a session says before HELLO. A guest message (a VM
// still talking to the hostd before this one) gets ERROR(no-hostd) and the
// channel stays, so the guest can say HELLO; anything else gets
// ERROR(malformed) and the channel closes. Other sessions are unaffected.
func TestBeforeHello(t *testing.T) {
	t.Run("guest message", func(t *testing.T) {
		w := newWorld(t)
		other := w.hello(t, w.g2)
		s := w.dial(t, w.g1)
		s.send(proto.Msg{Type: proto.Ping, Nonce: 1})
		s.expect(proto.Error, proto.ReasonNoHostd)
		s.send(proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Active,
			Local: netip.MustParseAddrPort("10.0.0.1:4000"), Remote: netip.MustParseAddrPort("10.0.0.2:80")})
		s.expect(proto.Error, proto.ReasonNoHostd)
		s.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: formats})
		s.expect(proto.Welcome, proto.ReasonNone)
		s.ping(2)
		other.ping(3)
		if got := w.malformed(t); got != 0 {
			t.Fatalf("malformed count %v, want 0", got)
		}
	})
	for _, m := range []proto.Msg{
		{Type: proto.Welcome, GuestID: 1, Region: "x"},
		{Type: proto.Ready, Side: proto.SideA},
		{Type: proto.Error, Reason: proto.ReasonMalformed},
	} {
		t.Run(m.Type.String(), func(t *testing.T) {
			w := newWorld(t)
			other := w.hello(t, w.g2)
			sibling := w.hello(t, w.g1)
			s := w.dial(t, w.g1)
			s.send(m)
			if e := s.expect(proto.Error, proto.ReasonMalformed); !strings.Contains(e.Text, "want HELLO") {
				t.Errorf("ERROR text %q, want it to say HELLO is expected", e.Text)
			}
			s.closed()
			if got := w.malformed(t); got != 1 {
				t.Errorf("malformed count %v, want 1", got)
			}
			other.ping(1)
			sibling.ping(2)
		})
	}
}

// TestMalformed: a frame that breaks the protocol, or a message only hostd
// may send, gets ERROR(malformed); the channel closes, the reason is logged
// and counted, and the guest's other sessions and other guests go on.
func TestMalformed(t *testing.T) {
	ping := frame(t, proto.Msg{Type: proto.Ping, Nonce: 1})
	for _, tc := range []struct {
		name  string
		frame []byte
	}{
		{"payload over the limit", []byte{proto.Version, byte(proto.Ping), 0, 0, 0x01, 0x10, 0, 0}},
		{"payload shorter than its type", append([]byte{proto.Version, byte(proto.Ping), 0, 0, 4, 0, 0, 0}, 1, 2, 3, 4)},
		{"payload longer than its type", append([]byte{proto.Version, byte(proto.Ping), 0, 0, 9, 0, 0, 0}, append(ping[proto.HeaderSize:], 0)...)},
		{"unknown type", []byte{proto.Version, 99, 0, 0, 0, 0, 0, 0}},
		{"type zero", []byte{proto.Version, 0, 0, 0, 0, 0, 0, 0}},
		{"version", append([]byte{proto.MinVersion - 1}, ping[1:]...)},
		{"reserved bytes", append([]byte{proto.Version, byte(proto.Ping), 1, 0}, ping[4:]...)},
		{"bad role", frame(t, proto.Msg{Type: proto.Open, Role: 3})},
		{"WELCOME from a guest", frame(t, proto.Msg{Type: proto.Welcome, Region: "x"})},
		{"READY from a guest", frame(t, proto.Msg{Type: proto.Ready, Side: proto.SideA})},
		{"TCP from a guest", frame(t, proto.Msg{Type: proto.TCP})},
		{"RELEASE from a guest", frame(t, proto.Msg{Type: proto.Release})},
		{"REVOKE from a guest", frame(t, proto.Msg{Type: proto.Revoke})},
		{"ERROR from a guest", frame(t, proto.Msg{Type: proto.Error})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			other := w.hello(t, w.g2)
			sibling := w.hello(t, w.g1)
			s := w.hello(t, w.g1)
			s.raw(tc.frame)
			s.expect(proto.Error, proto.ReasonMalformed)
			s.closed()
			if got := w.malformed(t); got != 1 {
				t.Errorf("malformed count %v, want 1", got)
			}
			if logs := w.logs.String(); !strings.Contains(logs, "malformed") || !strings.Contains(logs, "guest=g1") {
				t.Errorf("no log of the malformed message from g1 in:\n%s", logs)
			}
			other.ping(2)
			sibling.ping(3)
		})
	}
}

// TestErrorComesLast: the ERROR that ends a session comes after the
// replies to what the guest said before the bad frame, in order.
func TestErrorComesLast(t *testing.T) {
	w := newWorld(t)
	s := w.dial(t, w.g1)
	var b []byte
	b = append(b, frame(t, proto.Msg{Type: proto.Hello, PID: 1, Formats: formats})...)
	for i := range 8 {
		b = append(b, frame(t, proto.Msg{Type: proto.Ping, Nonce: uint64(i)})...)
	}
	b = append(b, proto.Version, 99, 0, 0, 0, 0, 0, 0)
	s.raw(b)
	s.expect(proto.Welcome, proto.ReasonNone)
	for i := range 8 {
		if m := s.next(); m.Type != proto.Pong || m.Nonce != uint64(i) {
			t.Fatalf("reply %d: got %+v, want PONG %d", i, m, i)
		}
	}
	s.expect(proto.Error, proto.ReasonMalformed)
	s.closed()
}

// TestListenThenPing: a session is served in order, so when the PONG for a
// PING sent after LISTEN arrives, the listener is in effect; PONGs come in
// the order of their PINGs.
func TestListenThenPing(t *testing.T) {
	w := newWorld(t)
	s := w.hello(t, w.g2)
	addr := netip.MustParseAddrPort("10.0.0.2:80")
	s.send(proto.Msg{Type: proto.Listen, Local: addr}, proto.Msg{Type: proto.Ping, Nonce: 7})
	if m := s.next(); m.Type != proto.Pong || m.Nonce != 7 {
		t.Fatalf("got %+v, want PONG 7", m)
	}
	if got := w.listening(w.g2); len(got) != 1 || got[0] != addr.String() {
		t.Fatalf("listening %v at PONG, want [%s]", got, addr)
	}
	s.send(proto.Msg{Type: proto.Unlisten, Local: addr}, proto.Msg{Type: proto.Ping, Nonce: 8})
	s.expect(proto.Pong, proto.ReasonNone)
	if got := w.listening(w.g2); len(got) != 0 {
		t.Fatalf("listening %v after UNLISTEN, want none", got)
	}
	var pings []proto.Msg
	for i := range 50 {
		pings = append(pings, proto.Msg{Type: proto.Ping, Nonce: uint64(100 + i)})
	}
	s.send(pings...)
	for i := range 50 {
		if m := s.next(); m.Type != proto.Pong || m.Nonce != uint64(100+i) {
			t.Fatalf("reply %d: got %+v, want PONG %d", i, m, 100+i)
		}
	}
}

// pair sets up a fast-path flow from g1 (a, port 4000) to g2 (p, port 80)
// and returns READY as each side got it.
func (w *world) pair(t *testing.T, a, p *guest) (ra, rp proto.Msg) {
	t.Helper()
	ta := ctrack.Tuple{Src: netip.MustParseAddrPort("10.0.0.1:4000"), Dst: netip.MustParseAddrPort("10.0.0.2:80")}
	p.send(proto.Msg{Type: proto.Listen, Local: netip.AddrPortFrom(netip.IPv4Unspecified(), 80)})
	p.ping(1)
	w.ct.Add(ta, ta.Reverse(), 0)
	a.send(proto.Msg{Type: proto.Open, ReqID: 10, Role: proto.Active, Local: ta.Src, Remote: ta.Dst})
	p.send(proto.Msg{Type: proto.Open, ReqID: 20, Role: proto.Passive, Local: ta.Dst, Remote: ta.Src})
	ra, rp = a.expect(proto.Ready, proto.ReasonNone), p.expect(proto.Ready, proto.ReasonNone)
	if ra.ReqID != 10 || rp.ReqID != 20 || ra.Side != proto.SideA || rp.Side != proto.SideB ||
		ra.Slot != rp.Slot || ra.Gen != rp.Gen || ra.RingAB != rp.RingAB || ra.RingBA != rp.RingBA {
		t.Fatalf("READY %+v and %+v: want requests 10 and 20, sides A and B, one flow", ra, rp)
	}
	return ra, rp
}

// TestOpenPair: OPENs of both ends of a connection between two guests get
// READY on both sessions; KICK is relayed to the peer; a CLOSE from one end
// sends DOWN(peer-gone) to the other, whose CLOSE frees the flow and ends
// the connection record.
func TestOpenPair(t *testing.T) {
	w := newWorld(t)
	a, p := w.hello(t, w.g1), w.hello(t, w.g2)
	ra, _ := w.pair(t, a, p)
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].GuestA != "g1" || fl[0].GuestB != "g2" || fl[0].Attached != "ab" || fl[0].Path != "rings" {
		t.Fatalf("flows %+v, want one from g1 to g2 on the rings with both sides attached", fl)
	}
	a.send(proto.Msg{Type: proto.Kick, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideB})
	if m := p.expect(proto.Kick, proto.ReasonNone); m.Slot != ra.Slot || m.Gen != ra.Gen || m.Side != proto.SideB {
		t.Fatalf("relayed KICK %+v, want slot %d gen %d side B", m, ra.Slot, ra.Gen)
	}
	a.send(proto.Msg{Type: proto.Close, ReqID: 10, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideA})
	if m := p.expect(proto.Down, proto.ReasonPeerGone); m.ReqID != 20 || m.Slot != ra.Slot || m.Gen != ra.Gen {
		t.Fatalf("DOWN %+v, want request 20 of slot %d gen %d", m, ra.Slot, ra.Gen)
	}
	p.send(proto.Msg{Type: proto.Close, ReqID: 20, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideB})
	p.ping(3)
	if fl := w.b.Flows(); len(fl) != 0 {
		t.Fatalf("flows %+v after both CLOSEs, want none", fl)
	}
}

// TestDownLeft: LEFT from both ends frees the ring pair; the connection
// record stays (on TCP) until both CLOSE.
func TestDownLeft(t *testing.T) {
	w := newWorld(t)
	a, p := w.hello(t, w.g1), w.hello(t, w.g2)
	ra, _ := w.pair(t, a, p)
	name := w.b.Flows()[0].Conn
	if !w.b.Downgrade(name) {
		t.Fatalf("Downgrade(%s) found nothing", name)
	}
	da, dp := a.expect(proto.Down, proto.ReasonAdmin), p.expect(proto.Down, proto.ReasonAdmin)
	if da.ReqID != 10 || dp.ReqID != 20 || da.Slot != ra.Slot || dp.Gen != ra.Gen {
		t.Fatalf("DOWN %+v and %+v, want requests 10 and 20 of the flow", da, dp)
	}
	a.send(proto.Msg{Type: proto.Left, ReqID: 10, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideA})
	a.ping(4)
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Path != "leaving" {
		t.Fatalf("flows %+v after one LEFT, want one leaving", fl)
	}
	p.send(proto.Msg{Type: proto.Left, ReqID: 20, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideB})
	p.ping(5)
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Path != "tcp" || fl[0].Reason != "admin" || fl[0].Ring != 0 {
		t.Fatalf("flows %+v after both LEFTs, want the connection on TCP (admin), without rings", fl)
	}
	a.send(proto.Msg{Type: proto.Close, ReqID: 10, Side: proto.SideA})
	p.send(proto.Msg{Type: proto.Close, ReqID: 20, Side: proto.SideB})
	a.ping(6)
	p.ping(7)
	if fl := w.b.Flows(); len(fl) != 0 {
		t.Fatalf("flows %+v after both CLOSEs, want none", fl)
	}
}

// TestVersions: a version-2 library is answered in version 2 and every
// OPEN of it gets TCP(version), as does a version-3 one that shares no
// ring format with hostd (its WELCOME says formats 0); the peer of either
// gets TCP(version) at once.
func TestVersions(t *testing.T) {
	for _, tc := range []struct {
		name    string
		hello   proto.Msg
		version uint8
	}{
		{"version 2", proto.Msg{Version: 2, Type: proto.Hello, PID: 1}, 2},
		{"no common format", proto.Msg{Type: proto.Hello, PID: 1, Formats: 1 << 1}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			a := w.dial(t, w.g1)
			a.send(tc.hello)
			if m := a.next(); m.Type != proto.Welcome || m.Version != tc.version || m.Formats != 0 {
				t.Fatalf("WELCOME %+v, want version %d, formats 0", m, tc.version)
			}
			p := w.hello(t, w.g2)
			ta := ctrack.Tuple{Src: netip.MustParseAddrPort("10.0.0.1:4000"), Dst: netip.MustParseAddrPort("10.0.0.2:80")}
			p.send(proto.Msg{Type: proto.Listen, Local: netip.AddrPortFrom(netip.IPv4Unspecified(), 80)})
			p.ping(1)
			w.ct.Add(ta, ta.Reverse(), 0)
			p.send(proto.Msg{Type: proto.Open, ReqID: 20, Role: proto.Passive, Local: ta.Dst, Remote: ta.Src})
			p.ping(2) // it waits for its peer
			a.send(proto.Msg{Version: tc.hello.Version, Type: proto.Open, ReqID: 10, Role: proto.Active, Local: ta.Src, Remote: ta.Dst})
			if m := a.expect(proto.TCP, proto.ReasonVersion); m.ReqID != 10 || m.Version != tc.version {
				t.Fatalf("TCP %+v, want request 10 in version %d", m, tc.version)
			}
			if m := p.expect(proto.TCP, proto.ReasonVersion); m.ReqID != 20 {
				t.Fatalf("peer's TCP %+v, want request 20", m)
			}
			a.send(proto.Msg{Version: tc.hello.Version, Type: proto.Ping, Nonce: 3})
			if m := a.next(); m.Type != proto.Pong || m.Version != tc.version {
				t.Fatalf("PONG %+v, want version %d", m, tc.version)
			}
		})
	}
}

// TestHelloAgain: a HELLO retried before the guest acted changes nothing;
// a HELLO after it acted is a new guest behind the same channel (a VM
// rebooted in place): its connections' peers get DOWN(peer-gone) and its
// side counts as left, its listeners go, and it gets WELCOME again.
func TestHelloAgain(t *testing.T) {
	w := newWorld(t)
	a, p := w.hello(t, w.g1), w.hello(t, w.g2)
	a.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: formats}) // retried before acting
	a.expect(proto.Welcome, proto.ReasonNone)
	a.send(proto.Msg{Type: proto.Listen, Local: netip.MustParseAddrPort("10.0.0.1:81")})
	a.ping(5)
	a.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: formats}) // after LISTEN only
	a.expect(proto.Welcome, proto.ReasonNone)
	if got := w.listening(w.g1); len(got) != 0 {
		t.Fatalf("listening %v after HELLO again, want none", got)
	}

	ra, _ := w.pair(t, a, p)
	a.send(proto.Msg{Type: proto.Hello, PID: 2, Formats: formats})
	a.expect(proto.Welcome, proto.ReasonNone)
	if m := p.expect(proto.Down, proto.ReasonPeerGone); m.Slot != ra.Slot || m.Gen != ra.Gen || m.ReqID != 20 {
		t.Fatalf("peer's DOWN %+v, want request 20, slot %d gen %d", m, ra.Slot, ra.Gen)
	}
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Path != "leaving" || fl[0].Attached != "b" {
		t.Fatalf("flows %+v, want the connection leaving the rings, held by the peer only", fl)
	}
	if got := w.listening(w.g2); len(got) != 1 {
		t.Fatalf("the peer's listeners %v went too", got)
	}
	p.send(proto.Msg{Type: proto.Left, ReqID: 20, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideB})
	p.send(proto.Msg{Type: proto.Close, ReqID: 20, Side: proto.SideB})
	p.ping(6)
	if fl := w.b.Flows(); len(fl) != 0 {
		t.Fatalf("flows %+v after the peer's LEFT and CLOSE, want none", fl)
	}
	a.ping(7) // the new guest is served
}

// TestGuestGone: a guest closing its channel is the guest going away: the
// peer of each of its connections gets DOWN(peer-gone), and its side of
// the rings counts as left.
func TestGuestGone(t *testing.T) {
	w := newWorld(t)
	a, p := w.hello(t, w.g1), w.hello(t, w.g2)
	ra, _ := w.pair(t, a, p)
	a.c.Close()
	if m := p.expect(proto.Down, proto.ReasonPeerGone); m.Slot != ra.Slot || m.ReqID != 20 {
		t.Fatalf("DOWN %+v, want request 20 of slot %d", m, ra.Slot)
	}
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].Attached != "b" {
		t.Fatalf("flows %+v, want the flow held by the peer only", fl)
	}
}

// TestCloseKeepsFlows: hostd stopping is not the guests going away: Close
// ends every session without revoking their flows.
func TestCloseKeepsFlows(t *testing.T) {
	w := newWorld(t)
	a, p := w.hello(t, w.g1), w.hello(t, w.g2)
	w.pair(t, a, p)
	w.b.Close() // as the agent does: the broker first
	w.srv.Close()
	a.closed()
	p.closed()
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].State != "ready" {
		t.Fatalf("flows %+v after Close, want the flow still ready", fl)
	}
}

// TestRemove: removing a guest closes its socket and sessions; the other
// guest is unaffected.
func TestRemove(t *testing.T) {
	w := newWorld(t)
	a, p := w.hello(t, w.g1), w.hello(t, w.g2)
	w.srv.Remove(w.g1)
	a.closed()
	if _, err := net.DialTimeout("unix", w.socks[w.g1], wait); err == nil {
		t.Fatal("the removed guest's socket still accepts")
	}
	p.ping(1)
}

// TestResetIsNotMalformed: a guest that dies with replies unread resets
// its channel; that is the guest going away, not a malformed message.
func TestResetIsNotMalformed(t *testing.T) {
	w := newWorld(t)
	a, p := w.hello(t, w.g1), w.hello(t, w.g2)
	w.pair(t, a, p)
	a.send(proto.Msg{Type: proto.Ping, Nonce: 9})
	a.unread(proto.HeaderSize + 8) // the PONG waits in a's socket
	a.c.Close()
	p.expect(proto.Down, proto.ReasonPeerGone)
	if got := w.malformed(t); got != 0 {
		t.Errorf("malformed count %v after a reset, want 0", got)
	}
	if logs := w.logs.String(); strings.Contains(logs, "malformed") {
		t.Errorf("a reset was logged as malformed:\n%s", logs)
	}
}

// unread waits, within the socket's deadline, until n bytes wait unread.
func (s *guest) unread(n int) {
	s.t.Helper()
	rc, err := s.c.(*net.UnixConn).SyscallConn()
	if err != nil {
		s.t.Fatal(err)
	}
	b := make([]byte, n)
	var got int
	var perr error
	err = rc.Read(func(fd uintptr) bool {
		got, _, perr = syscall.Recvfrom(int(fd), b, syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return !(errors.Is(perr, syscall.EAGAIN) || perr == nil && got < n)
	})
	if err != nil || perr != nil {
		s.t.Fatalf("peek: %v, %v", err, perr)
	}
}
