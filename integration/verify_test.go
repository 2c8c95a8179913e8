package integration

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/shm/ring"
)

func TestFirewallRejectStaysRejected(t *testing.T) {
	e := newEnv(t, 2, "")
	if err := e.rig.Firewall("tcp dport 5210 reject with tcp reset"); err != nil {
		t.Fatal(err)
	}
	e.listen(2, 5210)
	_, err := e.dial(1, fmt.Sprintf("%s:5210", e.rig.Guests[1].Addr))
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial through a rejecting firewall = %v, want ECONNREFUSED as without Shunt", err)
	}
	if fl := e.flows(); len(fl) != 0 {
		t.Fatalf("a rejected connection has flows: %+v", fl)
	}
}

func TestPolicyDeniedStaysOnTCP(t *testing.T) {
	e := newEnv(t, 2, `rule "no-5211" {
  action = "tcp"
  ports  = ["5211"]
}`)
	c, s := e.pair(1, 2, 5211)
	if p := settled(t, c); p.Fast || p.Reason != "policy" {
		t.Fatalf("client path %s, want tcp(policy)", p)
	}
	if p := settled(t, s); p.Fast || p.Reason != "policy" {
		t.Fatalf("server path %s, want tcp(policy)", p)
	}
	roundTrip(t, c, s)
	if got := e.counter("shunt_fallbacks_total{reason=policy}"); got < 1 {
		t.Fatalf("policy fallbacks counted %v, want at least 1", got)
	}
	// Its record stays on TCP (a reload could move it), with no rings.
	if fl := e.flows(); len(fl) != 1 || fl[0].Path != "tcp" || fl[0].Reason != "policy" || fl[0].Ring != 0 {
		t.Fatalf("a policy-denied connection: %+v, want one record on TCP (policy) without rings", fl)
	}
}

func roundTrip(t *testing.T, c, s net.Conn) {
	t.Helper()
	go func() { c.Write([]byte("ping")) }()
	b := make([]byte, 4)
	if _, err := io.ReadFull(s, b); err != nil || string(b) != "ping" {
		t.Fatalf("server read %q, %v", b, err)
	}
	s.Write([]byte("pong"))
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "pong" {
		t.Fatalf("client read %q, %v", b, err)
	}
}

// rawSession speaks the control protocol on a guest's socket directly.
func rawSession(t *testing.T, path string) net.Conn {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := proto.Write(c, &proto.Msg{Type: proto.Hello, PID: 1, Formats: 1 << ring.FormatVersion}); err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if m, _, err := proto.Read(c, nil); err != nil || m.Type != proto.Welcome {
		t.Fatalf("welcome: %+v, %v", m, err)
	}
	return c
}

// TestForeignTupleRefused: guest 3 claims the tuple of a connection between
// guests 1 and 2; hostd refuses it and counts it, and the real flow is not
// disturbed.
func TestForeignTupleRefused(t *testing.T) {
	e := newEnv(t, 3, "")
	c, _ := e.pair(1, 2, 5212)
	if !fastSoon(t, c) {
		t.Fatalf("path %s, want fast", c.Path())
	}
	raw := rawSession(t, e.control(e.rig.Guests[2]))
	local := c.LocalAddr().(*net.TCPAddr).AddrPort()
	remote := c.RemoteAddr().(*net.TCPAddr).AddrPort()
	for _, role := range []proto.Role{proto.Active, proto.Passive} {
		l, r := local, remote
		if role == proto.Passive {
			l, r = remote, local
		}
		if err := proto.Write(raw, &proto.Msg{Type: proto.Open, ReqID: 7, Role: role, Local: unmap(l), Remote: unmap(r)}); err != nil {
			t.Fatal(err)
		}
		m, _, err := proto.Read(raw, nil)
		if err != nil || m.Type != proto.TCP || m.Reason != proto.ReasonNotOwner {
			t.Fatalf("foreign OPEN (%d) answered %+v, %v; want TCP(not-owner)", role, m, err)
		}
	}
	if got := e.counter("shunt_fallbacks_total{reason=not-owner}"); got != 2 {
		t.Fatalf("not-owner fallbacks %v, want 2", got)
	}
	if fl := e.flows(); len(fl) != 1 || fl[0].State != "ready" {
		t.Fatalf("the real flow was disturbed: %+v", fl)
	}
}

func unmap(a netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(a.Addr().Unmap(), a.Port()) }

// TestDNATPairs: guest 1 connects to a service address that the host DNATs
// to guest 2; the two sides see different tuples and still pair.
func TestDNATPairs(t *testing.T) {
	e := newEnv(t, 2, "")
	if err := e.rig.Firewall("", fmt.Sprintf("ip daddr 10.77.200.1 tcp dport 80 dnat ip to %s:8080", e.rig.Guests[1].Addr)); err != nil {
		t.Fatal(err)
	}
	l := e.listen(2, 8080)
	acc := make(chan net.Conn, 1)
	go func() { s, _ := l.AcceptShunt(); acc <- s }()
	c, err := e.dial(1, "10.77.200.1:80")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := <-acc
	defer s.Close()
	if !fastSoon(t, c) {
		t.Fatalf("client path through DNAT %s, want fast", c.Path())
	}
	roundTrip(t, c, s)
	fl := e.flows()
	if len(fl) != 1 || fl[0].Dst != "10.77.200.1:80" || fl[0].GuestB != "g2" {
		t.Fatalf("flows %+v; want one to the service address, accepted by g2", fl)
	}
}

// TestMalformedControlMessage: garbage on one guest's channel closes that
// channel with ERROR and a logged, counted reason; other guests go on.
func TestMalformedControlMessage(t *testing.T) {
	e := newEnv(t, 3, "")
	raw := rawSession(t, e.control(e.rig.Guests[2]))
	raw.Write([]byte{1, 99, 0, 0, 0, 0, 0, 0})
	m, _, err := proto.Read(raw, nil)
	if err != nil || m.Type != proto.Error || m.Reason != proto.ReasonMalformed {
		t.Fatalf("after garbage: %+v, %v; want ERROR(malformed)", m, err)
	}
	if _, _, err := proto.Read(raw, nil); !errors.Is(err, io.EOF) {
		t.Fatalf("channel still open after ERROR: %v", err)
	}
	if got := e.counter("shunt_control_malformed_total"); got != 1 {
		t.Fatalf("malformed counter %v, want 1", got)
	}
	// A READY sent by a guest is a protocol violation too.
	raw2 := rawSession(t, e.control(e.rig.Guests[2]))
	proto.Write(raw2, &proto.Msg{Type: proto.Ready, Side: proto.SideA})
	if m, _, err := proto.Read(raw2, nil); err != nil || m.Type != proto.Error {
		t.Fatalf("after a guest-sent READY: %+v, %v; want ERROR", m, err)
	}
	c, _ := e.pair(1, 2, 5213)
	if !fastSoon(t, c) {
		t.Fatalf("other guests lost the fast path: %s", c.Path())
	}
}

// TestMetricsEndpoint: hostd serves Prometheus metrics, including the
// per-flow byte counters read from the rings.
func TestMetricsEndpoint(t *testing.T) {
	testenv.NeedRoot(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	s, err := stack.Start(stack.Options{Name: fmt.Sprintf("m%d", os.Getpid()%1000), Guests: 2, HostdBin: hostdBin, Dir: t.TempDir(), Metrics: addr})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	e := &env{Stack: s, t: t, rig: s.Rig, lns: map[[2]int]*guestlib.Listener{}}
	c, srv := e.pair(1, 2, 5400)
	if !fastSoon(t, c, srv) {
		t.Fatalf("paths %s / %s, want fast", c.Path(), srv.Path())
	}
	roundTrip(t, c, srv)
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	// The flow is named by its pair region (group/pN/slot.gen).
	if !regexp.MustCompile(`shunt_flow_bytes\{direction="ab",flow="t/p\d+/\d+\.\d+"\} 4\n`).Match(body) {
		t.Errorf("metrics lack shunt_flow_bytes{direction=\"ab\",flow=...} 4:\n%s", body)
	}
	for _, want := range []string{
		`shunt_flows{mode="direct",state="ready"} 1`,
		`shunt_fallbacks_total{reason="policy"} 0`,
		`shunt_flow_setup_seconds_count 1`,
		`shunt_guest_sessions{guest="g1"} 1`,
		`shunt_connections{path="rings"} 1`,
		`shunt_switches_total{reason="none",to="rings"} 1`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// TestHelloAgainStartsOver: a HELLO after a guest has acted on its channel
// is a new guest behind the same channel (a VM rebooted in place), so what
// the old one set up goes; retried HELLOs before it acts change nothing.
func TestHelloAgainStartsOver(t *testing.T) {
	e := newEnv(t, 1, "")
	raw := rawSession(t, e.control(e.rig.Guests[0]))
	listening := func() []string {
		var gs []broker.GuestInfo
		if err := admin.Call(e.Admin, admin.Request{Cmd: "guests"}, &gs); err != nil {
			t.Fatal(err)
		}
		return gs[0].Listening
	}
	hello := func() {
		t.Helper()
		proto.Write(raw, &proto.Msg{Type: proto.Hello, PID: 2, Formats: 1 << ring.FormatVersion})
		if m, _, err := proto.Read(raw, nil); err != nil || m.Type != proto.Welcome {
			t.Fatalf("welcome: %+v, %v", m, err)
		}
	}
	hello() // a retried HELLO before acting: nothing to drop
	proto.Write(raw, &proto.Msg{Type: proto.Listen, Local: netip.MustParseAddrPort("0.0.0.0:7100")})
	proto.Write(raw, &proto.Msg{Type: proto.Ping, Nonce: 1})
	if m, _, err := proto.Read(raw, nil); err != nil || m.Type != proto.Pong {
		t.Fatalf("pong: %+v, %v", m, err)
	}
	if got := listening(); len(got) != 1 {
		t.Fatalf("listening %v after LISTEN, want one", got)
	}
	hello()
	if got := listening(); len(got) != 0 {
		t.Fatalf("listening %v after a new HELLO, want none", got)
	}
}

// TestSimultaneousConnectsPair: two guests connect to each other's
// listeners at the same moment (both connect() before either accept(), as
// Open MPI's wire-up does): nothing waits for hostd, and both connections
// get the fast path.
func TestSimultaneousConnectsPair(t *testing.T) {
	e := newEnv(t, 2, "")
	ls := map[int]*guestlib.Listener{1: e.listen(1, 5501), 2: e.listen(2, 5502)}
	type res struct {
		from int
		c    *guestlib.Conn
		err  error
	}
	dials := make(chan res, 2)
	start := time.Now()
	for _, d := range []struct{ from, to int }{{1, 2}, {2, 1}} {
		go func() {
			c, err := e.dial(d.from, fmt.Sprintf("%s:%d", e.rig.Guests[d.to-1].Addr, 5500+d.to))
			dials <- res{d.from, c, err}
		}()
	}
	dialed := map[int]*guestlib.Conn{}
	for range 2 {
		r := <-dials
		if r.err != nil {
			t.Fatalf("dial from g%d: %v", r.from, r.err)
		}
		dialed[r.from] = r.c
		t.Cleanup(func() { r.c.Close() })
	}
	accepted := map[int]*guestlib.Conn{}
	for to, l := range ls {
		s, err := l.AcceptShunt()
		if err != nil {
			t.Fatal(err)
		}
		accepted[to] = s
		t.Cleanup(func() { s.Close() })
	}
	if !fastSoon(t, dialed[1], dialed[2], accepted[1], accepted[2]) {
		t.Fatalf("paths %s %s %s %s, want all fast", dialed[1].Path(), dialed[2].Path(), accepted[1].Path(), accepted[2].Path())
	}
	t.Logf("both connections on the fast path %s after the connects began", time.Since(start))
	roundTrip(t, dialed[1], accepted[2])
	roundTrip(t, dialed[2], accepted[1])
}
