package integration

import (
	"net"
	"net/netip"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/testenv"
)

// The firewall keeps its authority over time (issue 20; docs/SECURITY.md,
// "Proof of passage"). Each test adds a DROP rule of the operator's
// (nftables, priority -5 in forward: before the rig's established-accept
// rule) and checks, with the rule's own counters, that the rule saw the
// lease's packets while no byte crossed the rings.

// dropBoth drops port's TCP packets both ways (dropRules).
func (e *env) dropBoth(t *testing.T, port int) { e.dropRules(t, port, true, true) }

// dropped is how many packets the drop rules dropped.
func (e *env) dropped(t *testing.T) int {
	t.Helper()
	out := e.hostCmd("nft", "list table inet shunt_test_fw")
	n := 0
	for _, m := range regexp.MustCompile(`counter packets (\d+)`).FindAllStringSubmatch(out, -1) {
		v, _ := strconv.Atoi(m[1])
		n += v
	}
	return n
}

// holdsTCP checks, for d, that the connection to port stays on TCP with
// reason firewall and that its streams move no byte.
func (e *env) holdsTCP(t *testing.T, port int, d time.Duration, ss ...*stream) {
	t.Helper()
	before := make([]int64, len(ss))
	for i, s := range ss {
		before[i] = s.got.Load()
	}
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if r, ok := e.connOn(port); !ok || r.Path != "tcp" || r.Reason != "firewall" {
			t.Fatalf("while the filter drops the lease: record %+v (found %v), want on TCP (firewall)\nflows: %+v", r, ok, e.flows())
		}
	}
	for i, s := range ss {
		if got := s.got.Load(); got != before[i] {
			t.Fatalf("stream %d: %d bytes arrived past a rule that drops the connection", i, got-before[i])
		}
	}
}

// dropRules adds a table whose rules drop port's TCP packets in the given
// directions (to the server: dport; from it: sport), with counters, and
// removes it when the test ends.
func (e *env) dropRules(t *testing.T, port int, toServer, fromServer bool) {
	t.Helper()
	p := strconv.Itoa(port)
	e.hostCmd("nft", "add table inet shunt_test_fw")
	t.Cleanup(func() { nsrig.Run(e.rig.HostNSPath(), "nft", "delete table inet shunt_test_fw") })
	e.hostCmd("nft", "add chain inet shunt_test_fw fw { type filter hook forward priority -5 ; }")
	if toServer {
		e.hostCmd("nft", "add rule inet shunt_test_fw fw tcp dport "+p+" counter drop")
	}
	if fromServer {
		e.hostCmd("nft", "add rule inet shunt_test_fw fw tcp sport "+p+" counter drop")
	}
}

// TestFirewallDrop: the operator drops a live connection's packets, both
// ways or one way, while both ends write, or while they are idle and write
// only afterwards. Conntrack counts the dropped packets (its hooks run
// before the filter), which used to send the connection back to the
// rings within a second once they rose both ways (finding 2); now it
// stays on TCP, no byte crosses, the rule's counters show it dropped the
// lease's packets, and the connection returns to the rings soon after the
// rule goes.
func TestFirewallDrop(t *testing.T) {
	for i, tc := range []struct {
		name                 string
		toServer, fromServer bool
		idle                 bool // the ends write only after the rule came
	}{
		{"both-ways", true, true, false},
		{"to-server", true, false, false},
		{"from-server", false, true, false},
		{"idle-then-send", true, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 2, "")
			port := 5260 + i
			c, s := e.pair(1, 2, port)
			if !fastSoon(t, c, s) {
				t.Fatalf("paths %s / %s, want fast", c.Path(), s.Path())
			}
			var ab, ba *stream
			if !tc.idle {
				ab, ba = both(t, c, s, uint64(port))
				progress(4<<20, ab, ba)
			}
			e.dropRules(t, port, tc.toServer, tc.fromServer)
			onTCP(t, "both ends on TCP after the ruleset changed", c, s)
			if tc.idle {
				ab, ba = both(t, c, s, uint64(port))
			}
			time.Sleep(500 * time.Millisecond) // what was in flight
			e.holdsTCP(t, port, 3*time.Second, ab, ba)
			if n := e.dropped(t); n == 0 {
				t.Fatal("the drop rules dropped no packet: the test proves nothing")
			}
			e.hostCmd("nft", "delete table inet shunt_test_fw")
			backOnRings(t, c, s, ab, ba)
		})
	}
}

// TestFirewallRestartUnderDrop: with the rule in place and the connection
// on TCP, hostd restarts; the libraries announce the connection again and
// the new hostd must not give it the rings (finding 4: it used to answer
// READY). A rule added while hostd is down holds too: the adopted flow
// leaves the rings at start.
func TestFirewallRestartUnderDrop(t *testing.T) {
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5252)
	if !fastSoon(t, c, s) {
		t.Fatalf("paths %s / %s, want fast", c.Path(), s.Path())
	}
	ab, ba := both(t, c, s, 81)
	progress(2<<20, ab, ba)

	// A rule added while hostd is down.
	e.killHostd()
	e.dropBoth(t, 5252)
	e.startHostd()
	onTCP(t, "both ends on TCP after hostd came back", c, s)
	eventually(t, 10*time.Second, "the record on TCP (firewall) after the restart", func() bool {
		r, ok := e.connOn(5252)
		return ok && r.Path == "tcp" && r.Reason == "firewall"
	})
	time.Sleep(500 * time.Millisecond)
	e.holdsTCP(t, 5252, 2*time.Second, ab, ba)

	// A restart while the rule holds: the libraries re-OPEN.
	e.killHostd()
	e.startHostd()
	eventually(t, 10*time.Second, "the connection announced again to the new hostd", func() bool {
		r, ok := e.connOn(5252)
		return ok && r.Attached == "ab"
	})
	e.holdsTCP(t, 5252, 2*time.Second, ab, ba)
	if n := e.dropped(t); n == 0 {
		t.Fatal("the drop rules dropped no packet: the test proves nothing")
	}
	e.hostCmd("nft", "delete table inet shunt_test_fw")
	backOnRings(t, c, s, ab, ba)
}

// backOnRings checks, once what cut a connection is gone, that its
// streams go on (TCP retransmits), that it returns to the rings, and that
// every byte of both streams arrives intact.
func backOnRings(t *testing.T, c, s *guestlib.Conn, ab, ba *stream) {
	t.Helper()
	progress(2<<20, ab, ba)
	if !fastSoon(t, c, s) {
		t.Fatalf("after the cut healed: %s / %s, want fast again", c.Path(), s.Path())
	}
	progress(2<<20, ab, ba)
	ab.finish()
	ba.finish()
}

// verdictFor waits for hostd's answer to OPEN req on r: READY or TCP,
// skipping the rest (REGION, PING).
func (r *rgRogue) verdictFor(t *testing.T, req uint32) proto.Msg {
	t.Helper()
	for {
		m := r.next(t)
		if (m.Type == proto.Ready || m.Type == proto.TCP) && m.ReqID == req {
			return m
		}
	}
}

// quiet checks that r gets no READY within d.
func (r *rgRogue) quiet(t *testing.T, d time.Duration, what string) {
	t.Helper()
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		_ = r.SetReadDeadline(end)
		m, buf, err := proto.Read(r, r.buf)
		r.buf = buf
		if err != nil {
			return // the deadline: nothing came
		}
		switch m.Type {
		case proto.Ping:
			r.send(t, proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
		case proto.Ready:
			t.Fatalf("%s: hostd sent READY %+v while the filter drops the lease", what, m)
		}
	}
}

// TestFirewallColludingRaw: two colluding guests speak the control
// protocol themselves (internal/proto) over real kernel connections.
// With the operator's rule dropping their connection both ways they try
// what used to reopen the rings: LEFT, then a TCP byte each way (dropped,
// but counted by conntrack before the filter); and an OPEN sent after the
// rule for a connection made before it (a late OPEN). hostd answers
// neither with READY, while the rule's counters show the bytes dropped.
func TestFirewallColludingRaw(t *testing.T) {
	e := newEnv(t, 2, "")
	g1, g2 := e.rig.Guests[0], e.rig.Guests[1]
	r1, err := rgDial(e.control(g1))
	if err != nil {
		t.Fatal(err)
	}
	defer r1.Close()
	r2, err := rgDial(e.control(g2))
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	r1.hello(t)
	r2.hello(t)
	const port = 5253
	var l net.Listener
	if err := nsrig.In(g2.NSPath(), func() (err error) {
		l, err = net.Listen("tcp4", netip.AddrPortFrom(g2.Addr, port).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	r2.send(t, proto.Msg{Type: proto.Listen, Local: netip.AddrPortFrom(g2.Addr, port)})
	dst := netip.AddrPortFrom(g2.Addr, port)
	connect := func(sport uint16) (c, s net.Conn) {
		c = kernelDial(t, g1, netip.AddrPortFrom(g1.Addr, sport), dst)
		_ = l.(*net.TCPListener).SetDeadline(time.Now().Add(5 * time.Second))
		s, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return c, s
	}
	open := func(req uint32, c net.Conn) {
		src := c.LocalAddr().(*net.TCPAddr).AddrPort()
		r1.send(t, proto.Msg{Type: proto.Open, ReqID: req, Role: proto.Active, Local: src, Remote: dst})
		r2.send(t, proto.Msg{Type: proto.Open, ReqID: req, Role: proto.Passive, Local: dst, Remote: src})
	}
	c1, s1 := connect(41253)
	c2, _ := connect(41254) // made before the rule, announced after it
	open(1, c1)
	if m := r1.verdictFor(t, 1); m.Type != proto.Ready {
		t.Fatalf("first connection before any rule: %+v, want READY", m)
	}
	if m := r2.verdictFor(t, 1); m.Type != proto.Ready {
		t.Fatalf("first connection before any rule, passive side: %+v, want READY", m)
	}

	e.dropBoth(t, port)
	for _, r := range []*rgRogue{r1, r2} {
		var down proto.Msg
		for down = r.next(t); down.Type != proto.Down; down = r.next(t) {
		}
		if down.Reason != proto.ReasonFirewall {
			t.Fatalf("DOWN %+v, want reason firewall", down)
		}
		side := proto.SideA
		if r == r2 {
			side = proto.SideB
		}
		r.send(t, proto.Msg{Type: proto.Left, ReqID: down.ReqID, RegionID: down.RegionID, Slot: down.Slot, Gen: down.Gen, Side: side})
	}
	// One TCP byte each way: dropped by the rule, counted by conntrack.
	if _, err := c1.Write([]byte{1}); err != nil {
		t.Fatal(err)
	}
	if _, err := s1.Write([]byte{2}); err != nil {
		t.Fatal(err)
	}
	open(2, c2)
	if m := r1.verdictFor(t, 2); m.Type != proto.TCP || m.Reason != proto.ReasonFirewall {
		t.Fatalf("late OPEN after the rule: %+v, want TCP(firewall)", m)
	}
	r1.quiet(t, 3*time.Second, "LEFT and a byte each way, and a late OPEN")
	r2.quiet(t, 100*time.Millisecond, "the passive side")
	if n := e.dropped(t); n < 2 {
		t.Fatalf("the drop rules dropped %d packets: want at least the two bytes", n)
	}
}

// staleEnv is a stack whose proof_max_age is short, so that drops that
// send no ruleset event are seen within seconds. (With it shorter than the
// libraries' 15 s keepalive, an idle or ring-only lease also drops to TCP
// at each sweep and returns on its next packets: fine for a test, not for
// a deployment.)
func staleEnv(t *testing.T) *env {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	return startEnv(t, "f", stack.Options{Guests: 2, HostdBin: hostdBin, Extra: "proof_max_age = \"2s\"\n"})
}

// staleStops streams both ways on a connection, cuts its packets with
// cut (no ruleset event), and checks that the sweep moves it to TCP
// within 1.5 x proof_max_age and some slack, that no byte then crosses,
// and that it returns to the rings after heal.
func staleStops(t *testing.T, e *env, port int, cut, heal func()) {
	t.Helper()
	c, s := e.pair(1, 2, port)
	// The streams start at once: a connection made while an epoch's clear
	// runs may lose its handshake's bits, and proves itself by its bytes.
	ab, ba := both(t, c, s, uint64(port))
	if !fastSoon(t, c, s) {
		t.Fatalf("paths %s / %s, want fast", c.Path(), s.Path())
	}
	progress(2<<20, ab, ba)
	events := e.counter("shunt_firewall_epochs_total")
	cut()
	eventually(t, 10*time.Second, "the record on TCP (firewall) after the cut", func() bool {
		r, ok := e.connOn(port)
		return ok && r.Path == "tcp" && r.Reason == "firewall"
	})
	time.Sleep(500 * time.Millisecond) // what was in flight
	e.holdsTCP(t, port, 3*time.Second, ab, ba)
	if got := e.counter("shunt_firewall_epochs_total"); got != events {
		t.Fatalf("firewall epochs %v -> %v: the cut sent a ruleset event, so this test does not show the sweep", events, got)
	}
	if e.counter("shunt_firewall_stale_total") < 1 {
		t.Fatal("shunt_firewall_stale_total did not count the connection")
	}
	heal()
	backOnRings(t, c, s, ab, ba)
}

// epochsSettled waits until hostd has taken in the ruleset events of the
// test's own setup (its epoch counter still for a second), so that
// staleStops' "no epoch from the cut" is not about them.
func (e *env) epochsSettled(t *testing.T) {
	t.Helper()
	last, still := e.counter("shunt_firewall_epochs_total"), time.Now()
	eventually(t, 15*time.Second, "hostd's firewall epochs settled after the test's nft setup", func() bool {
		time.Sleep(100 * time.Millisecond)
		if n := e.counter("shunt_firewall_epochs_total"); n != last {
			last, still = n, time.Now()
		}
		return time.Since(still) >= time.Second
	})
}

// TestFirewallLinkDown: the guest's host-side interface goes down (no
// nftables event): its connection leaves the rings within the sweep's
// bound, moves nothing while the link is down, and returns once it is up.
func TestFirewallLinkDown(t *testing.T) {
	e := staleEnv(t)
	hostIf := e.rig.Guests[1].HostIf
	staleStops(t, e, 5254,
		func() { e.hostCmd("ip", "link", "set", hostIf, "down") },
		func() { e.hostCmd("ip", "link", "set", hostIf, "up") })
}

// TestFirewallDynamicSet: a fail2ban-style rule fills a set from the
// packet path (a packet to a trap port adds its source), and the set
// drops that source: the elements added by packets send no ruleset event,
// so only the sweep sees the drop.
func TestFirewallDynamicSet(t *testing.T) {
	e := staleEnv(t)
	g1, g2 := e.rig.Guests[0], e.rig.Guests[1]
	e.hostCmd("nft", "add table inet shunt_test_ban")
	t.Cleanup(func() { nsrig.Run(e.rig.HostNSPath(), "nft", "delete table inet shunt_test_ban") })
	e.hostCmd("nft", "add set inet shunt_test_ban banned { type ipv4_addr; flags dynamic; }")
	e.hostCmd("nft", "add chain inet shunt_test_ban fw { type filter hook forward priority -5 ; }")
	e.hostCmd("nft", "add rule inet shunt_test_ban fw tcp dport 9 add @banned { ip saddr } drop")
	// Both ways: with only its source banned, g1 still takes in what g2
	// sends (a window's worth, unacknowledged), so bytes would cross.
	e.hostCmd("nft", "add rule inet shunt_test_ban fw ip saddr @banned drop")
	e.hostCmd("nft", "add rule inet shunt_test_ban fw ip daddr @banned drop")
	e.epochsSettled(t)
	staleStops(t, e, 5255,
		func() {
			// A packet to the trap port: its SYN adds g1 to the set.
			_ = nsrig.In(g1.NSPath(), func() error {
				c, err := net.DialTimeout("tcp4", netip.AddrPortFrom(g2.Addr, 9).String(), 200*time.Millisecond)
				if err == nil {
					c.Close()
				}
				return nil
			})
			if out := e.hostCmd("nft", "list set inet shunt_test_ban banned"); !regexp.MustCompile(regexp.QuoteMeta(g1.Addr.String())).MatchString(out) {
				t.Fatalf("the trap did not ban %s:\n%s", g1.Addr, out)
			}
		},
		func() { e.hostCmd("nft", "delete element inet shunt_test_ban banned { "+g1.Addr.String()+" }") })
}
