package integration

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/shm/ring"
)

// Attacks on the proof of a connection's origin (docs/SECURITY.md,
// "ownership"). hostd accepts a guest's claim to a connection only if the
// guest owns its source address and the connection came in by the guest's
// own interface: hostd's nftables table stamps each guest's new
// connections with its mark id (on by default), the eBPF witness records
// each SYN's interface (opt-in).
//
// The rig: guests 1 and 2 are honest guestlib clients that move
// checksummed data over a fast-path flow throughout. Guest 3 is hostile.
// It also reaches the host by a second link, which is guest "x"'s
// interface (shx-RIG; a second VM of the same tenant, a second NIC, or a
// neighbour on a shared link): guest 3 routes to guest 2 through it, with
// its own source address, and the replies come back by its own interface.
// So its connections are established, and it owns their source address,
// but they did not come in by its interface.

// ownWitness turns the witness on alone, so that a test shows what it
// proves by itself. (For hostd before ownership existed: "witness = true".)
const ownWitness = "ownership = \"witness\"\n"

// ownRig is a test's rig: the stack and guest x's interface.
type ownRig struct {
	*env
	xIf string
	ct  *ctrack.Netlink
}

// newOwnEnv starts the rig; top is more top-level configuration and
// guestCfg more lines per guest block.
func newOwnEnv(t *testing.T, top string, guestCfg map[int]string) *ownRig {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	testenv.NeedTool(t, "ip", "iproute2")
	rigSeq++
	name := fmt.Sprintf("o%d%d", os.Getpid()%1000, rigSeq)
	dir := t.TempDir()
	xIf := "shx-" + name
	extra := fmt.Sprintf("%sguest \"x\" {\n  id = 9\n  group = \"t\"\n  control = %q\n  interface = %q\n}\n", top, filepath.Join(dir, "x.sock"), xIf)
	s, err := stack.Start(stack.Options{
		Name: name, Guests: 3, HostdBin: hostdBin, Dir: dir, Extra: extra, GuestConfig: guestCfg, Logf: t.Logf,
		Setup: func(r *nsrig.Rig) error { return secondLink(r, xIf) },
	})
	if err != nil {
		t.Fatalf("start stack: %v", err)
	}
	e := &env{Stack: s, t: t, rig: s.Rig, lns: map[[2]int]*guestlib.Listener{}}
	w := &ownRig{env: e, xIf: xIf}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("hostd log:\n%s", s.Log())
		}
		if w.ct != nil {
			w.ct.Close()
		}
		for _, l := range e.lns {
			l.Close()
		}
		if err := s.Close(); err != nil {
			t.Errorf("close stack: %v", err)
		}
	})
	if w.ct, err = ctrack.Dial(s.Rig.HostNSPath()); err != nil {
		t.Fatal(err)
	}
	return w
}

// secondLink joins guest 3 to the host by a second veth, xIf, and routes
// guest 3's packets for guest 2 through it; reverse-path filtering is off
// where the route is asymmetric.
func secondLink(r *nsrig.Rig, xIf string) error {
	g2, g3 := r.Guests[1], r.Guests[2]
	if err := r.AddLink(g3, xIf, "eth1", netip.MustParseAddr("10.77.250.1"), netip.MustParseAddr("10.77.250.2")); err != nil {
		return err
	}
	off := func(ns string, ifs ...string) error {
		return nsrig.In(ns, func() error {
			for _, i := range append([]string{"all", "default"}, ifs...) {
				if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+i+"/rp_filter", []byte("0"), 0o644); err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := off(r.HostNSPath(), xIf); err != nil {
		return err
	}
	if err := off(g3.NSPath(), "eth0", "eth1"); err != nil {
		return err
	}
	_, err := nsrig.Run(g3.NSPath(), "ip", "route", "add", g2.Addr.String()+"/32", "via", "10.77.250.1", "dev", "eth1", "src", g3.Addr.String())
	return err
}

// ownSteady moves checksummed data from guest a to guest b over a
// fast-path flow until the returned stop is called; stop checks that all
// of it arrived intact and that the flow stayed on the fast path.
func (w *ownRig) ownSteady(t *testing.T, a, b, port int) (stop func()) {
	t.Helper()
	_, stop = w.steady(t, a, b, port, 0)
	return stop
}

// ownHonest checks that a new connection between honest guests still
// gets the fast path, and moves a byte each way.
func (w *ownRig) ownHonest(t *testing.T, port int) {
	t.Helper()
	c, s := w.pair(1, 2, port)
	if !fastSoon(t, c, s) {
		t.Fatalf("a new honest connection: paths %s and %s, want the fast path", c.Path(), s.Path())
	}
	ownRoundTrip(t, c, s)
}

func ownRoundTrip(t *testing.T, c, s net.Conn) {
	t.Helper()
	go c.Write([]byte("ping"))
	b := make([]byte, 4)
	if _, err := io.ReadFull(s, b); err != nil || string(b) != "ping" {
		t.Fatalf("server read %q, %v", b, err)
	}
	go s.Write([]byte("pong"))
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "pong" {
		t.Fatalf("client read %q, %v", b, err)
	}
}

// onlyHonestFlows checks that hostd's flows are the honest guests' only.
func (w *ownRig) onlyHonestFlows(t *testing.T, n int) {
	t.Helper()
	fl := w.flows()
	for _, f := range fl {
		if f.GuestA != "g1" || f.GuestB != "g2" {
			t.Fatalf("a flow that is not the honest guests': %+v", f)
		}
	}
	if len(fl) != n {
		t.Fatalf("%d flows, want the honest guests' %d: %+v", len(fl), n, fl)
	}
}

// ownRogue is the hostile guest's own control session on guest 3's socket:
// the raw protocol, so it chooses what to claim and when.
type ownRogue struct {
	t   *testing.T
	c   net.Conn
	buf []byte
}

func (w *ownRig) rogue(t *testing.T) *ownRogue {
	t.Helper()
	c, err := net.DialTimeout("unix", w.Control(w.rig.Guests[2]), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	r := &ownRogue{t: t, c: c}
	r.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: 1 << ring.FormatVersion})
	if m := r.next(); m.Type != proto.Welcome {
		t.Fatalf("answer to HELLO: %+v", m)
	}
	return r
}

func (r *ownRogue) send(m proto.Msg) {
	r.t.Helper()
	_ = r.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if err := proto.Write(r.c, &m); err != nil {
		r.t.Fatal(err)
	}
}

func (r *ownRogue) next() proto.Msg {
	r.t.Helper()
	_ = r.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	m, buf, err := proto.Read(r.c, r.buf)
	r.buf = buf
	if err != nil {
		r.t.Fatalf("hostile session: %v", err)
	}
	return m
}

// verdict waits for the answer to OPEN req (READY or TCP), skipping the
// rest (PINGs, REGIONs).
func (r *ownRogue) verdict(req uint32) proto.Msg {
	r.t.Helper()
	for {
		m := r.next()
		if (m.Type == proto.Ready || m.Type == proto.TCP) && m.ReqID == req {
			return m
		}
		if m.Type == proto.Ping {
			r.send(proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
		}
	}
}

// kernelDial connects from guest g with a plain socket from src.
func kernelDial(t *testing.T, g *nsrig.Guest, src, dst netip.AddrPort) net.Conn {
	t.Helper()
	var c net.Conn
	err := nsrig.In(g.NSPath(), func() (err error) {
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(src), Timeout: 5 * time.Second}
		c, err = d.Dial("tcp4", dst.String())
		return err
	})
	if err != nil {
		t.Fatalf("connect %s -> %s: %v", src, dst, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// acceptOne accepts one connection on l in the background.
func acceptOne(l *guestlib.Listener) <-chan *guestlib.Conn {
	ch := make(chan *guestlib.Conn, 1)
	go func() {
		s, err := l.AcceptShunt()
		if err != nil {
			close(ch)
			return
		}
		ch <- s
	}()
	return ch
}

func accepted(t *testing.T, ch <-chan *guestlib.Conn) *guestlib.Conn {
	t.Helper()
	select {
	case s, ok := <-ch:
		if !ok {
			t.Fatal("accept failed")
		}
		t.Cleanup(func() { s.Close() })
		return s
	case <-time.After(10 * time.Second):
		t.Fatal("no accept within 10s")
		return nil
	}
}

// markOf is the conntrack mark of the connection c (as its client sees it).
// markOf is the conntrack mark of c's connection without hostd's proof
// bits (the two highest of its field, which its proof chains set as the
// connection's packets pass the filter).
func (w *ownRig) markOf(t *testing.T, c net.Conn) uint32 {
	t.Helper()
	tu := ctrack.Tuple{Src: unmap(c.LocalAddr().(*net.TCPAddr).AddrPort()), Dst: unmap(c.RemoteAddr().(*net.TCPAddr).AddrPort())}
	e, err := w.ct.Lookup(tu)
	if err != nil {
		t.Fatalf("conntrack entry of %s: %v", tu, err)
	}
	return e.Mark &^ mark.Field{Mask: mark.DefaultMask}.Proof()
}

// TestOwnershipMarksByDefault: with the default configuration hostd
// installs its own nftables table, one rule per guest interface; a guest's
// connection carries its id in the high bits of the conntrack mark and
// gets the fast path; the mark follows a guest whose veth is replaced (a
// container restarted: same name, new interface); hostd stopping removes
// the table, and starting puts it back.
func TestOwnershipMarksByDefault(t *testing.T) {
	e := newEnv(t, 2, "")
	table := func() string {
		out, err := nsrig.Run(e.rig.HostNSPath(), "nft", "list", "table", "inet", "shunt_hostd")
		if err != nil {
			return "" // no such table
		}
		return out
	}
	out := table()
	for _, g := range e.rig.Guests {
		if n := strings.Count(out, fmt.Sprintf("iifname %q ct state new", g.HostIf)); n != 2 {
			t.Fatalf("hostd's table has %d rules for %s, want 2 (forward and input):\n%s", n, g.HostIf, out)
		}
		if !strings.Contains(out, fmt.Sprintf("comment \"shunt guest %s\"", g.Name)) {
			t.Fatalf("no rule names guest %s:\n%s", g.Name, out)
		}
	}
	ct, err := ctrack.Dial(e.rig.HostNSPath())
	if err != nil {
		t.Fatal(err)
	}
	defer ct.Close()
	w := &ownRig{env: e, ct: ct}
	check := func(port int) {
		t.Helper()
		c, s := e.pair(1, 2, port)
		if !fastSoon(t, c, s) {
			t.Fatalf("paths %s and %s, want the fast path", c.Path(), s.Path())
		}
		ownRoundTrip(t, c, s)
		if m := w.markOf(t, c); m != 0x10000 {
			t.Fatalf("g1's connection has ct mark %#x, want g1's id 1 in the high 16 bits (0x10000)", m)
		}
	}
	check(5601)
	if err := e.rig.Relink(e.rig.Guests[0]); err != nil {
		t.Fatal(err)
	}
	check(5602)
	e.StopHostd()
	if out := table(); out != "" {
		t.Fatalf("hostd's table is still there after hostd stopped:\n%s", out)
	}
	e.startHostd()
	if out := table(); !strings.Contains(out, "shunt guest g1") {
		t.Fatalf("hostd's table is not back after a restart:\n%s", out)
	}
}

// TestHostileOwnerSpoofedInterface: guest 3 connects to guest 2 through
// guest x's interface, from its own address, with guestlib. Its claim
// fails (TCP, not-owner, counted): the connection carries x's mark id,
// not guest 3's. The connection still works on TCP, and the honest guests
// keep their fast path and their data.
func TestHostileOwnerSpoofedInterface(t *testing.T) {
	w := newOwnEnv(t, "", nil)
	stop := w.ownSteady(t, 1, 2, 5611)
	acc := acceptOne(w.listen(2, 5612))
	c, err := w.dial(3, netip.AddrPortFrom(w.rig.Guests[1].Addr, 5612).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := accepted(t, acc)
	if p := settled(t, c); p.Fast || p.Reason != "not-owner" {
		t.Fatalf("the hostile guest's path %s, want tcp(not-owner)", p)
	}
	if p := settled(t, s); p.Fast {
		t.Fatalf("its peer's path %s, want TCP", p)
	}
	ownRoundTrip(t, c, s)
	if m := w.markOf(t, c); m != 0x90000 {
		t.Fatalf("the hostile connection has ct mark %#x, want x's id 9 (0x90000): it came in by x's interface", m)
	}
	if got := w.counter("shunt_fallbacks_total{reason=not-owner}"); got < 1 {
		t.Fatalf("not-owner fallbacks %v, want at least 1", got)
	}
	w.onlyHonestFlows(t, 1)
	stop()
	w.ownHonest(t, 5613)
}

// TestHostileOwnerPassiveFirst: the hostile guest chooses the order of the
// OPENs. It announces and makes a connection through x's interface, waits
// until guest 2's passive OPEN is waiting at hostd (so hostd has the
// conntrack entry already), and only then claims the active side: the
// claim is checked against that entry all the same and refused.
func TestHostileOwnerPassiveFirst(t *testing.T) {
	w := newOwnEnv(t, "", nil)
	stop := w.ownSteady(t, 1, 2, 5621)
	g2, g3 := w.rig.Guests[1], w.rig.Guests[2]
	acc := acceptOne(w.listen(2, 5622))
	r := w.rogue(t)
	src, dst := netip.AddrPortFrom(g3.Addr, 41622), netip.AddrPortFrom(g2.Addr, 5622)
	r.send(proto.Msg{Type: proto.Intent, Local: src, Remote: dst})
	passive := w.counter("shunt_opens_total{role=passive}")
	kc := kernelDial(t, g3, src, dst)
	eventually(t, 5*time.Second, "guest 2's passive OPEN", func() bool {
		return w.counter("shunt_opens_total{role=passive}") > passive
	})
	r.send(proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Active, Local: src, Remote: dst})
	if m := r.verdict(1); m.Type != proto.TCP || m.Reason != proto.ReasonNotOwner {
		t.Fatalf("the hostile active claim after a waiting passive side: %+v; want TCP(not-owner)", m)
	}
	s := accepted(t, acc)
	if p := settled(t, s); p.Fast {
		t.Fatalf("guest 2's side of the hostile connection: %s, want TCP", p)
	}
	ownRoundTrip(t, kc, s)
	w.onlyHonestFlows(t, 1)
	stop()
	w.ownHonest(t, 5623)
}

// TestHostileOwnerLaterSYN: with the witness alone (no marks), the hostile
// guest's connection came in by x's interface, so the witness recorded
// x's; the guest then sends a SYN with the same tuple through its own
// interface to overwrite that record before it claims. The first SYN
// wins: the record stays x's, the later SYN is counted as a conflict, and
// the claim is refused.
func TestHostileOwnerLaterSYN(t *testing.T) {
	w := newOwnEnv(t, ownWitness, nil)
	stop := w.ownSteady(t, 1, 2, 5631)
	g2, g3 := w.rig.Guests[1], w.rig.Guests[2]
	acc := acceptOne(w.listen(2, 5632))
	r := w.rogue(t)
	src, dst := netip.AddrPortFrom(g3.Addr, 41632), netip.AddrPortFrom(g2.Addr, 5632)
	r.send(proto.Msg{Type: proto.Intent, Local: src, Remote: dst})
	kc := kernelDial(t, g3, src, dst)
	conflicts := w.counter("shunt_witness_syns_total{result=conflict}")
	if err := nsrig.SendTCP(g3.NSPath(), "eth0", src, dst, 0x02, 12345); err != nil {
		t.Fatal(err)
	}
	// Wait until the witness has seen the later SYN (bounded: a hostd
	// without this counter gets the claim after the bound).
	deadline := time.Now().Add(2 * time.Second)
	for w.counter("shunt_witness_syns_total{result=conflict}") <= conflicts && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	r.send(proto.Msg{Type: proto.Open, ReqID: 1, Role: proto.Active, Local: src, Remote: dst})
	if m := r.verdict(1); m.Type != proto.TCP || m.Reason != proto.ReasonNotOwner {
		t.Fatalf("the hostile claim after its later SYN: %+v; want TCP(not-owner)", m)
	}
	if got := w.counter("shunt_witness_syns_total{result=conflict}"); got != conflicts+1 {
		t.Fatalf("witness conflicts %v, want %v", got, conflicts+1)
	}
	s := accepted(t, acc)
	if p := settled(t, s); p.Fast {
		t.Fatalf("guest 2's side of the hostile connection: %s, want TCP", p)
	}
	ownRoundTrip(t, kc, s)
	w.onlyHonestFlows(t, 1)
	stop()
	w.ownHonest(t, 5633)
}

// TestHostileOwnerOverlapRefused: a configuration that gives guest 3 an
// address of guest 1's (routed to guest 1's interface) is refused: a
// second hostd with it does not start, names both guests and the address,
// and leaves the running hostd's table and flows alone.
func TestHostileOwnerOverlapRefused(t *testing.T) {
	w := newOwnEnv(t, "", nil)
	stop := w.ownSteady(t, 1, 2, 5641)
	before, _ := nsrig.Run(w.rig.HostNSPath(), "nft", "list", "table", "inet", "shunt_hostd")
	src, err := os.ReadFile(w.Config)
	if err != nil {
		t.Fatal(err)
	}
	g1, g3 := w.rig.Guests[0], w.rig.Guests[2]
	dir := t.TempDir()
	cfg := string(src)
	// Its own sockets, region and directories; the same host and guests.
	for _, p := range []string{w.Dir + "/", w.RegionPath()} {
		cfg = strings.ReplaceAll(cfg, p, filepath.Join(dir, "x")+"-")
	}
	g3Block := fmt.Sprintf("interface = %q", g3.HostIf)
	if !strings.Contains(cfg, g3Block) {
		t.Fatalf("no %s in the config:\n%s", g3Block, cfg)
	}
	cfg = strings.Replace(cfg, g3Block, g3Block+fmt.Sprintf("\n  addresses = [%q]", g1.Addr), 1)
	bad := filepath.Join(dir, "bad.hcl")
	if err := os.WriteFile(bad, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, hostdBin, "agent", "-config", bad).CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("hostd with an overlapping guest did not stop within 10s (it started):\n%s", out)
	}
	want := fmt.Sprintf("guest g3 and guest g1 both own %s/32", g1.Addr)
	if err == nil || !strings.Contains(string(out), want) {
		t.Fatalf("hostd with an overlapping guest: %v; want an error naming %q:\n%s", err, want, out)
	}
	after, _ := nsrig.Run(w.rig.HostNSPath(), "nft", "list", "table", "inet", "shunt_hostd")
	if rules := func(s string) int { return strings.Count(s, "ct mark set") }; rules(after) != rules(before) || rules(after) == 0 {
		t.Fatalf("the running hostd's table changed:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	stop()
	w.ownHonest(t, 5642)
}

// TestHostileOwnerOperatorMark: the operator's firewall sets its own bits
// of the conntrack mark (here the whole mark, before hostd's chains run),
// and guest 1 keeps the old ct_mark setting that checks them. hostd's
// marking keeps the operator's bits, adds guest 1's id in its own, and
// both checks hold: the honest guests keep the fast path.
func TestHostileOwnerOperatorMark(t *testing.T) {
	w := newOwnEnv(t, "", map[int]string{1: "ct_mark = 5"})
	if err := w.rig.Firewall(fmt.Sprintf("ct state new iifname %q ct mark set 0x5", w.rig.Guests[0].HostIf)); err != nil {
		t.Fatal(err)
	}
	stop := w.ownSteady(t, 1, 2, 5651)
	c, s := w.pair(1, 2, 5652)
	if !fastSoon(t, c, s) {
		t.Fatalf("paths %s and %s, want the fast path", c.Path(), s.Path())
	}
	ownRoundTrip(t, c, s)
	if m := w.markOf(t, c); m != 0x10005 {
		t.Fatalf("guest 1's connection has ct mark %#x, want 0x10005: the operator's 0x5 and guest 1's id 1 in hostd's bits", m)
	}
	stop()
}
