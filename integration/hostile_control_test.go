package integration

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

// Attacks on hostd's control plane (docs/SECURITY.md, "control plane"):
// guest 1 is hostile and speaks the protocol itself on its own control
// socket (its identity), while guests 2 and 3 are honest guestlib clients
// that move checksummed data over a fast-path flow and keep making new
// connections. Each test asserts that the attack fails (a limit holds, a
// deadline closes the attacker's session, a flood is merged) and that the
// honest guests lose nothing: their data arrives intact on the fast path,
// their sessions stay (no reconnect), and hostd keeps serving them.

// TestHostileSessionFlood: a guest opens far more control sessions than
// its limit, and (with hostd short of descriptors) until hostd's accept
// fails with EMFILE. Sessions over the limit get ERROR(control-limit);
// the accept loop never gives up; other guests keep their flows and
// sessions, and the flooding guest's socket accepts again once the flood
// ends.
func TestHostileSessionFlood(t *testing.T) {
	t.Run("limit", func(t *testing.T) {
		e := newCtlEnv(t, 3, "limits {\n  sessions_per_guest = 8\n}\n", 0)
		stop := e.ctlSteady(t, 2, 3, 5301)
		sock := e.control(e.rig.Guests[0])
		var held []*ctlRogue
		defer func() {
			for _, r := range held {
				r.c.Close()
			}
		}()
		refused := 0
		for range 200 {
			r, err := dialCtlRogue(sock)
			if err != nil {
				t.Fatalf("dial %d: %v", len(held), err)
			}
			held = append(held, r)
			// A refused session may be closed before HELLO is written;
			// its ERROR is there to read all the same.
			_ = r.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: 1 << ring.FormatVersion})
			m, err := r.next(5 * time.Second)
			switch {
			case err == nil && m.Type == proto.Welcome:
			case err == nil && m.Type == proto.Error && m.Reason == proto.ReasonControlLimit:
				refused++
			default:
				t.Fatalf("session %d: %+v, %v; want WELCOME or ERROR(control-limit)", len(held), m, err)
			}
		}
		if refused != 200-8 {
			t.Errorf("%d sessions refused, want %d (200 over a limit of 8)", refused, 200-8)
		}
		for range 5 {
			e.ctlRoundTrip(t, 2, 3, 5302)
		}
		if g, _ := e.ctlGuestInfo(t, 1); g.Sessions > 8 {
			t.Errorf("the flooding guest has %d sessions, over its limit of 8", g.Sessions)
		}
		if cs := e.ctlCounters(t); cs["shunt_control_limited_total{kind=sessions}"] != 200-8 {
			t.Errorf("limited sessions %v, want %d", cs["shunt_control_limited_total{kind=sessions}"], 200-8)
		}
		for _, r := range held {
			r.c.Close()
		}
		held = nil
		eventually(t, 10*time.Second, "a new session of the flooding guest", func() bool {
			r, err := dialCtlRogue(sock)
			if err != nil {
				return false
			}
			defer r.c.Close()
			return r.hello() == nil
		})
		stop()
		e.ctlNoReconnects(t, 2, 3)
	})
	t.Run("emfile", func(t *testing.T) {
		const nofile = 200
		e := newCtlEnv(t, 3, "limits {\n  sessions_per_guest = 100000\n  sessions_per_second = 100000\n}\n", nofile)
		stop := e.ctlSteady(t, 2, 3, 5311)
		e.ctlRoundTrip(t, 2, 3, 5312) // both honest guests have a session now
		sock := e.control(e.rig.Guests[0])
		var held []*ctlRogue
		defer func() {
			for _, r := range held {
				r.c.Close()
			}
		}()
		// hostd's descriptors, counted in /proc (prlimit execs hostd, so
		// the pid is hostd's).
		fds := func() int {
			ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", e.Hostd.Process.Pid))
			return len(ents)
		}
		for len(held) < 1000 && fds() < nofile-1 {
			r, err := dialCtlRogue(sock)
			if err != nil {
				break // the backlog is full too
			}
			held = append(held, r)
		}
		eventually(t, 10*time.Second, "hostd out of descriptors", func() bool { return fds() >= nofile-1 })
		for range 20 { // these wait in the backlog: hostd's accept fails with EMFILE
			if r, err := dialCtlRogue(sock); err == nil {
				held = append(held, r)
			}
		}
		eventually(t, 10*time.Second, "hostd logs the failed accept", func() bool {
			return strings.Contains(e.Log(), "accept on a control socket failed")
		})
		t.Logf("%d sessions held when hostd ran out of descriptors", len(held))
		// hostd has no descriptor to spare: the honest guests' sessions
		// and flows go on.
		for range 3 {
			e.ctlRoundTrip(t, 2, 3, 5312)
		}
		for _, r := range held {
			r.c.Close()
		}
		held = nil
		eventually(t, 20*time.Second, "the flooded socket accepts again", func() bool {
			r, err := dialCtlRogue(sock)
			if err != nil {
				return false
			}
			defer r.c.Close()
			return r.hello() == nil
		})
		if cs := e.ctlCounters(t); cs["shunt_control_accept_errors_total"] == 0 {
			t.Errorf("no accept errors counted")
		}
		e.ctlRoundTrip(t, 2, 3, 5312)
		stop()
		e.ctlNoReconnects(t, 2, 3)
	})
}

// TestHostileControlFloods: a guest floods LISTENs, INTENTs (kept nowhere)
// and OPENs (for tuples with no conntrack entry, and for real connections
// to a peer that never accepts, which wait) from several sessions at once. Its limits
// hold and are counted, `hostd guests` answers, and the honest guests'
// connections keep getting the fast path meanwhile.
func TestHostileControlFloods(t *testing.T) {
	e := newCtlEnv(t, 3, `limits {
  listens_per_session     = 32
  listens_per_guest       = 64
  pending_opens_per_guest = 16
}
`, 0)
	stop := e.ctlSteady(t, 2, 3, 5321)
	g1, g2 := e.rig.Guests[0], e.rig.Guests[1]
	sock := e.control(g1)

	// Real connections from guest 1 to an honest listener in guest 2 that
	// never accepts: their OPENs wait for a passive side that never comes.
	e.listen(2, 5329)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	var tuples []proto.Msg
	for i := range 40 {
		local := netip.AddrPortFrom(g1.Addr, uint16(41000+i))
		remote := netip.AddrPortFrom(g2.Addr, 5329)
		var c net.Conn
		err := nsrig.In(g1.NSPath(), func() error {
			var err error
			d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(local), Timeout: 5 * time.Second}
			c, err = d.Dial("tcp4", remote.String())
			return err
		})
		if err != nil {
			t.Fatalf("kernel connection %d: %v", i, err)
		}
		conns = append(conns, c)
		tuples = append(tuples, proto.Msg{Type: proto.Intent, Local: local, Remote: remote},
			proto.Msg{Type: proto.Open, ReqID: uint32(i + 1), Role: proto.Active, Local: local, Remote: remote})
	}

	var wg sync.WaitGroup
	var failed atomic.Value
	attack := func(name string, msgs func(i int) proto.Msg, n int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := dialCtlRogue(sock)
			if err != nil {
				failed.Store(fmt.Sprintf("%s: %v", name, err))
				return
			}
			defer r.c.Close()
			if err := r.hello(); err != nil {
				failed.Store(fmt.Sprintf("%s: %v", name, err))
				return
			}
			go r.drain()
			var b []byte
			for i := range n {
				m := msgs(i)
				b, _ = m.Append(b)
				if len(b) > 32<<10 || i == n-1 {
					_ = r.c.SetWriteDeadline(time.Now().Add(20 * time.Second))
					if _, err := r.c.Write(b); err != nil {
						failed.Store(fmt.Sprintf("%s: hostd closed the flooding session: %v", name, err))
						return
					}
					b = b[:0]
				}
			}
		}()
	}
	const n = 20000
	attack("listen", func(i int) proto.Msg {
		return proto.Msg{Type: proto.Listen, Local: netip.AddrPortFrom(g1.Addr, uint16(1+i%60000))}
	}, n)
	attack("intent", func(i int) proto.Msg {
		return proto.Msg{Type: proto.Intent, Local: netip.AddrPortFrom(g1.Addr, uint16(1+i%60000)), Remote: netip.AddrPortFrom(g2.Addr, 80)}
	}, n)
	attack("open", func(i int) proto.Msg {
		return proto.Msg{Type: proto.Open, ReqID: uint32(i), Role: proto.Active,
			Local: netip.AddrPortFrom(g1.Addr, uint16(1+i%60000)), Remote: netip.AddrPortFrom(g2.Addr, 80)}
	}, n)

	// The waiting OPENs, on their own session, and their verdicts.
	pend, err := dialCtlRogue(sock)
	if err != nil || pend.hello() != nil {
		t.Fatalf("pending-OPEN session: %v", err)
	}
	defer pend.c.Close()
	if err := pend.send(tuples...); err != nil {
		t.Fatal(err)
	}
	limited := 0
	for range 24 {
		m, err := pend.verdict(10 * time.Second)
		if err != nil {
			t.Fatalf("pending-OPEN verdicts: %v", err)
		}
		if m.Type != proto.TCP || m.Reason != proto.ReasonControlLimit {
			t.Fatalf("pending-OPEN verdict %+v, want TCP(control-limit) for those over 16 at once", m)
		}
		limited++
	}

	// Meanwhile the honest guests are served.
	var trips []time.Duration
	for range 10 {
		trips = append(trips, e.ctlRoundTrip(t, 2, 3, 5322))
	}
	info, took := e.ctlGuestInfo(t, 1)
	t.Logf("honest round trips during the floods: %v; hostd guests answered in %s", trips, took)
	wg.Wait()
	if f := failed.Load(); f != nil {
		t.Fatal(f)
	}
	if len(info.Listening) > 64 {
		t.Errorf("the flooding guest holds %d LISTENs, over its limit of 64", len(info.Listening))
	}
	for i := range 3 {
		e.ctlRoundTrip(t, 2, 3, 5323+i)
	}
	cs := e.ctlCounters(t)
	for kind, least := range map[string]float64{"listens": n - 64, "opens": 24} {
		if got := cs["shunt_control_limited_total{kind="+kind+"}"]; got < least {
			t.Errorf("limited %s %v, want at least %v", kind, got, least)
		}
	}
	if cs["shunt_fallbacks_total{reason=control-limit}"] < 24 {
		t.Errorf("fallbacks control-limit %v, want at least 24", cs["shunt_fallbacks_total{reason=control-limit}"])
	}
	stop()
	e.ctlNoReconnects(t, 2, 3)
}

// TestHostileKickFlood: a guest with a fast-path flow to a victim floods
// KICKs for it. hostd merges them per flow side: the victim's session
// stays (before, its queue filled and hostd closed it, revoking all of
// its flows), and its other flow goes on.
func TestHostileKickFlood(t *testing.T) {
	e := newCtlEnv(t, 3, "", 0)
	stop := e.ctlSteady(t, 3, 2, 5331) // the victim, guest 2, receives
	g1, g2 := e.rig.Guests[0], e.rig.Guests[1]
	l := e.listen(2, 5332)
	acc := make(chan *guestlib.Conn, 1)
	go func() {
		c, err := l.AcceptShunt()
		if err != nil {
			t.Errorf("victim's accept: %v", err)
		}
		acc <- c
	}()
	r, err := dialCtlRogue(e.control(g1))
	if err != nil || r.hello() != nil {
		t.Fatalf("attacker's session: %v", err)
	}
	defer r.c.Close()
	local, remote := netip.AddrPortFrom(g1.Addr, 42001), netip.AddrPortFrom(g2.Addr, 5332)
	if err := r.send(proto.Msg{Type: proto.Intent, Local: local, Remote: remote}); err != nil {
		t.Fatal(err)
	}
	var kc net.Conn
	if err := nsrig.In(g1.NSPath(), func() error {
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(local), Timeout: 5 * time.Second}
		var err error
		kc, err = d.Dial("tcp4", remote.String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	if err := r.send(proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Active, Local: local, Remote: remote}); err != nil {
		t.Fatal(err)
	}
	ready, err := r.verdict(10 * time.Second)
	if err != nil || ready.Type != proto.Ready {
		t.Fatalf("attacker's OPEN: %+v, %v; want READY", ready, err)
	}
	victim := <-acc
	if victim == nil || !fastSoon(t, victim) {
		t.Fatalf("the victim's end of the attacker's flow is not on the fast path")
	}
	defer victim.Close()
	go r.drain()
	kick := ctlFrames(t, proto.Msg{Type: proto.Kick, RegionID: ready.RegionID, Slot: ready.Slot, Gen: ready.Gen, Side: proto.SideB}, 4096)
	for range 50 { // 204,800 KICKs, as fast as hostd takes them
		_ = r.c.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if _, err := r.c.Write(kick); err != nil {
			t.Fatalf("flood: %v", err)
		}
	}
	e.ctlRoundTrip(t, 3, 2, 5333)
	stop()
	e.ctlNoReconnects(t, 2, 3)
	cs := e.ctlCounters(t)
	if cs["shunt_control_closed_total{reason=not-reading}"] != 0 {
		t.Errorf("hostd closed %v sessions as not reading", cs["shunt_control_closed_total{reason=not-reading}"])
	}
	if cs["shunt_control_kicks_merged_total"] == 0 {
		t.Errorf("no KICK merged: the flood did not reach hostd")
	}
	var fl []broker.FlowInfo
	if err := admin.Call(e.Admin, admin.Request{Cmd: "flows"}, &fl); err != nil {
		t.Fatal(err)
	}
	for _, f := range fl {
		if f.State != "ready" {
			t.Errorf("flow %+v not ready after the flood", f)
		}
	}
}

// TestHostileNoRead: sessions that write but never read lose only
// themselves, before HELLO and after, and one that ends with a malformed
// frame, whose ERROR hostd then cannot deliver. A flood fills the
// session's queue; a trickle (400 PINGs, one a millisecond, then nothing:
// the writer keeps up until the socket holds 278 replies) fills only the
// socket, which used to block hostd's writer, and so the session, forever:
// the write deadline closes it now. The same guest's honest session is
// served throughout.
func TestHostileNoRead(t *testing.T) {
	e := newCtlEnv(t, 3, "limits {\n  keepalive = \"200ms\"\n  silence = \"1s\"\n}\n", 0)
	stop := e.ctlSteady(t, 2, 3, 5341)
	e.ctlRoundTrip(t, 1, 2, 5342) // guest 1's honest client has a session
	g1 := e.rig.Guests[0]
	sock := e.control(g1)
	sessions := "shunt_guest_sessions{guest=" + g1.Name + "}"
	if n := e.ctlCounters(t)[sessions]; n != 1 {
		t.Fatalf("guest 1 has %v sessions before the attack, want its honest one", n)
	}
	bad := []byte{proto.Version, 99, 0, 0, 0, 0, 0, 0}
	for _, pings := range []int{400, 200 * 4096} { // a trickle, one a millisecond; a flood
		var held []*ctlRogue
		for i := range 3 {
			r, err := dialCtlRogue(sock)
			if err != nil {
				t.Fatal(err)
			}
			defer r.c.Close()
			held = append(held, r)
			if i > 0 && r.hello() != nil {
				t.Fatal("no WELCOME")
			}
			go func() {
				n, pace := 4096, time.Duration(0)
				if pings < n {
					n, pace = 1, time.Millisecond
				}
				b := ctlFrames(t, proto.Msg{Type: proto.Ping, Nonce: 1}, n)
				for sent := 0; sent < pings; sent += n {
					_ = r.c.SetWriteDeadline(time.Now().Add(20 * time.Second))
					if _, err := r.c.Write(b); err != nil {
						return // closed by hostd: the point
					}
					time.Sleep(pace)
				}
				if i == 2 {
					_, _ = r.c.Write(bad)
				}
			}()
		}
		eventually(t, 10*time.Second, fmt.Sprintf("hostd closes the 3 sessions that sent %d PINGs and read nothing", pings), func() bool {
			return e.ctlCounters(t)[sessions] == 1
		})
		for _, r := range held {
			r.c.Close()
		}
		e.ctlRoundTrip(t, 1, 2, 5342)
		e.ctlRoundTrip(t, 2, 3, 5343)
	}
	stop()
	e.ctlNoReconnects(t, 1, 2, 3)
}

// TestHostileSilent: a session that says HELLO and then nothing (not even
// an answer to the keepalive), and one that never says HELLO, are closed
// after the silence bound; honest guests, idle on their control sessions
// (Go clients, and a C program under the preload library), answer the
// keepalive and keep theirs.
func TestHostileSilent(t *testing.T) {
	e := newCtlEnv(t, 3, "limits {\n  keepalive = \"200ms\"\n  silence = \"1s\"\n}\n", 0)
	needPreload(t)
	stop := e.ctlSteady(t, 2, 3, 5351)
	e.ctlRoundTrip(t, 1, 3, 5352)
	srv := e.start(3, e.guestCmd(3, "iperf3", "-s", "-p", "5353", "-B", e.rig.Guests[2].Addr.String()))
	e.waitListening(3, 5353)
	sock := e.control(e.rig.Guests[0])
	for _, hello := range []bool{true, false, true} {
		r, err := dialCtlRogue(sock)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if hello && r.hello() != nil {
			t.Fatal("no WELCOME")
		}
		for {
			m, err := r.next(10 * time.Second)
			if err != nil {
				if errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("a silent session (HELLO %v) was not closed in 10s", hello)
				}
				break
			}
			if m.Type != proto.Ping {
				t.Fatalf("a silent session got %+v, want only keepalive PINGs", m)
			}
		}
		t.Logf("silent session (HELLO %v) closed after %s", hello, time.Since(start).Round(time.Millisecond))
		r.c.Close()
	}
	// The honest guests were idle on their sessions for three silence
	// bounds and more: only the attackers were closed.
	if got := e.ctlCounters(t)["shunt_control_closed_total{reason=silent}"]; got != 3 {
		t.Errorf("closed silent %v, want 3 (the attackers only)", got)
	}
	out := e.run(2, e.guestCmd(2, "iperf3", "-c", e.rig.Guests[2].Addr.String(), "-p", "5353", "-t", "1"))
	if fastLines(out) == 0 {
		t.Errorf("iperf3 against the idle C server did not take the fast path:\n%s\nserver:\n%s", out, srv.String())
	}
	if strings.Contains(srv.String(), "lost hostd") {
		t.Errorf("the idle C server lost its session:\n%s", srv.String())
	}
	e.ctlRoundTrip(t, 1, 3, 5352)
	stop()
	e.ctlNoReconnects(t, 1, 2, 3)
}

// ctlListen is env.listen for a benchmark.
func (e *env) ctlListen(t testing.TB, i, port int) *guestlib.Listener {
	t.Helper()
	l, err := e.Listen(i, port)
	if err != nil {
		t.Fatalf("listen in g%d: %v", i, err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}
