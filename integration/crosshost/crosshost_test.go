//go:build linux

package crosshost_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/hostd/peers/peertest"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/testenv"
)

var hostdBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "shunt-crosshost-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	hostdBin = filepath.Join(dir, "hostd")
	if out, err := exec.Command("go", "build", "-o", hostdBin, "../../cmd/hostd").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build hostd: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// pairEnv is a fabric of two hosts, each with its own hostd, peered.
type pairEnv struct {
	t         testing.TB
	f         *nsrig.Fabric
	hosts     [2]*stack.Stack // nil: no hostd on that host
	extras    [2]string
	ca        *peertest.CA
	cert, key [2]string

	echoMu sync.Mutex // echoOn's connections, for a failure's report (echoes)
	echoed []*echoConn
}

// echoConn is one connection an echo server (echoOn) served, and how its
// copy ended.
type echoConn struct {
	c    net.Conn
	host int
	done atomic.Bool
	err  error // io.Copy's, once done
}

// peering is host k's (0-based) peering and peer blocks: it listens on
// its fabric address and allows the other host the given prefixes.
func peering(f *nsrig.Fabric, ca *peertest.CA, cert, key [2]string, k int, allow []string) string {
	o := 1 - k
	return fmt.Sprintf(`peering {
  listen      = "%s"
  certificate = %q
  key         = %q
  ca          = %q
  interval    = "200ms"
}
peer "h%d" {
  address  = "%s"
  prefixes = ["%s"]
}
`, net.JoinHostPort(f.Addrs[k].String(), "7470"), cert[k], key[k], ca.Path, o+1,
		net.JoinHostPort(f.Addrs[o].String(), "7470"), strings.Join(allow, `", "`))
}

// newPair builds the fabric and starts a hostd on each host k with
// run[k]; allow[k] is what host k's config allows the other host to
// announce. Everything is removed when the test ends; on failure the
// hostds' logs are shown.
func newPair(t testing.TB, guests int, allow [2][]string, run [2]bool) *pairEnv {
	return newPairNetns(t, guests, allow, run, false)
}

// newPairNetns is newPair; with netns, each guest's network namespace is
// in hostd.hcl (netns), so that servers whose workers drop privileges
// reach hostd (docs/preload.md), while the test process's own guest
// clients do not (they are outside the namespaces).
func newPairNetns(t testing.TB, guests int, allow [2][]string, run [2]bool, netns bool) *pairEnv {
	t.Helper()
	return newPairWith(t, guests, allow, run, netns, [2]string{})
}

// newPairWith is newPairNetns with more configuration for each host's
// hostd.hcl (guest blocks for VMs).
func newPairWith(t testing.TB, guests int, allow [2][]string, run [2]bool, netns bool, extra [2]string) *pairEnv {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	name := fmt.Sprintf("x%d", os.Getpid()%10000)
	f, err := nsrig.NewFabric(name, 2, guests)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Create(); err != nil {
		t.Fatalf("create fabric: %v", err)
	}
	e := &pairEnv{t: t, f: f}
	t.Cleanup(func() {
		for k, s := range e.hosts {
			if s == nil {
				continue
			}
			if t.Failed() {
				t.Logf("h%d hostd log:\n%s", k+1, tail(s.Log(), 60))
			}
			s.Close()
		}
		if err := f.Destroy(); err != nil {
			t.Errorf("destroy fabric: %v", err)
		}
	})
	ca, err := peertest.NewCA(t.TempDir(), "ca")
	if err != nil {
		t.Fatal(err)
	}
	var cert, key [2]string
	for k := range 2 {
		if cert[k], key[k], err = ca.Issue(fmt.Sprintf("h%d", k+1)); err != nil {
			t.Fatal(err)
		}
	}
	e.ca, e.cert, e.key = ca, cert, key
	for k := range 2 {
		e.extras[k] = peering(f, ca, cert, key, k, allow[k]) + extra[k]
		if !run[k] {
			continue
		}
		s, err := stack.Start(stack.Options{Rig: f.Hosts[k], HostdBin: hostdBin, Dir: t.TempDir(), Extra: e.extras[k], Logf: t.Logf, Netns: netns})
		if err != nil {
			t.Fatalf("start h%d: %v", k+1, err)
		}
		e.hosts[k] = s
	}
	return e
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// peersOf is host k's `hostd peers`.
func (e *pairEnv) peersOf(k int) []peers.Info {
	var ps []peers.Info
	if s := e.hosts[k]; s != nil && s.Hostd != nil {
		if err := admin.Call(s.Admin, admin.Request{Cmd: admin.CmdPeers}, &ps); err != nil {
			e.t.Logf("h%d peers: %v", k+1, err)
		}
	}
	return ps
}

func (e *pairEnv) counter(k int, key string) float64 {
	var cs map[string]float64
	if err := admin.Call(e.hosts[k].Admin, admin.Request{Cmd: admin.CmdCounters}, &cs); err != nil {
		e.t.Fatalf("h%d counters: %v", k+1, err)
	}
	return cs[key]
}

// within waits up to d for cond; then fails with both hosts' peers.
func (e *pairEnv) within(d time.Duration, what string, cond func() bool) {
	e.t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			e.t.Fatalf("%s: not within %s; h1 peers %+v; h2 peers %+v", what, d, e.peersOf(0), e.peersOf(1))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func state(ps []peers.Info) string {
	if len(ps) != 1 {
		return fmt.Sprintf("%d peers", len(ps))
	}
	return ps[0].State
}

// roundTrip sends n seeded bytes over c and checks the checksum of what
// comes back, within 20 s.
func roundTrip(t *testing.T, c net.Conn, seed uint64, n int) {
	t.Helper()
	buf := make([]byte, n)
	rng := rand.New(rand.NewPCG(seed, seed))
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	c.SetDeadline(time.Now().Add(20 * time.Second))
	go c.Write(buf)
	got := make([]byte, n)
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatalf("echo of %d bytes: %v", n, err)
	}
	if sha256.Sum256(got) != sha256.Sum256(buf) || !bytes.Equal(got, buf) {
		t.Fatalf("echo of %d bytes: checksum differs", n)
	}
}

// TestAcrossHostsPeers: two hostds on two hosts peer over the fabric with
// mutual TLS; each accepts only the prefixes its config allows the other
// (h2 allows h1 only g1's /24: g2's prefixes are refused with
// forbidden-prefix); with h2's hostd down, a guestlib connection from
// h1's guest to h2's guest, either way, stays on TCP with reason
// peer-unreachable and its seeded bytes cross intact; h1 redials with
// back-off and the channel comes back when h2's hostd does; a SIGHUP
// with a wider prefix list on h2 accepts what it refused.
func TestAcrossHostsPeers(t *testing.T) {
	e := newPair(t, 2, [2][]string{{"10.78.0.0/16", "fd00:78::/32"}, {"10.77.1.0/24"}}, [2]bool{true, true})
	step := 10 * time.Second
	e.within(step, "both channels up", func() bool { return state(e.peersOf(0)) == peers.StateUp && state(e.peersOf(1)) == peers.StateUp })
	e.within(step, "h2 accepts h1/g1 and refuses h1/g2", func() bool {
		p := e.peersOf(1)
		if len(p) != 1 || p[0].Announced < 1 {
			return false
		}
		for q, why := range p[0].Refused {
			if strings.HasPrefix(q, "10.77.2.") && why == peers.RefusedForbidden {
				return true
			}
		}
		return false
	})
	e.within(step, "h1 learns of the refusal", func() bool { p := e.peersOf(0); return len(p) == 1 && len(p[0].TheyRefuse) > 0 })
	if p := e.peersOf(0)[0]; p.Announced < 2 || len(p.Refused) != 0 || p.Link == "" || p.BytesIn == 0 {
		t.Errorf("h1's view of h2 (all of h2's guests allowed): %+v", p)
	}

	g1, g2 := e.f.Hosts[0].Guests[0], e.f.Hosts[1].Guests[0]
	g2.Echo(t, netip.AddrPortFrom(g2.Addr, 7001))
	e.hosts[1].StopHostd()
	e.within(step, "h1 sees h2 down", func() bool { return state(e.peersOf(0)) != peers.StateUp })
	ctx, cancel := context.WithTimeout(context.Background(), step)
	defer cancel()
	c, err := e.hosts[0].Dial(ctx, 1, g2.Addr.String()+":7001")
	if err != nil {
		t.Fatalf("dial h2/g1 from h1/g1: %v", err)
	}
	defer c.Close()
	roundTrip(t, c, 1, 1<<20)
	e.within(step, "the active side's TCP(peer-unreachable)", func() bool {
		return e.counter(0, "shunt_fallbacks_total{reason=peer-unreachable}") >= 1
	})

	// The passive side: h2/g1's kernel client to h1/g1's guestlib listener.
	ln, err := e.hosts[0].Listen(1, 7002)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			io.Copy(c, c)
			c.Close()
		}
	}()
	kc := g2.Dial(t, netip.AddrPortFrom(g1.Addr, 7002))
	defer kc.Close()
	roundTrip(t, kc, 2, 1<<20)
	e.within(step, "the passive side's TCP(peer-unreachable)", func() bool {
		return e.counter(0, "shunt_fallbacks_total{reason=peer-unreachable}") >= 2
	})

	if err := e.hosts[1].StartHostd(); err != nil {
		t.Fatal(err)
	}
	e.within(step, "h1 redials h2 once it is back", func() bool {
		p := e.peersOf(0)
		return state(p) == peers.StateUp && p[0].Reconnects == 2
	})

	e.hosts[1].SetExtra(strings.Replace(e.extras[1], `"10.77.1.0/24"`, `"10.77.0.0/16"`, 1))
	if err := e.hosts[1].WriteConfig(""); err != nil {
		t.Fatal(err)
	}
	e.hosts[1].Hostd.Process.Signal(syscall.SIGHUP)
	e.within(step, "after SIGHUP h2 accepts h1/g2", func() bool {
		p := e.peersOf(1)
		if len(p) != 1 || state(p) != peers.StateUp {
			return false
		}
		for q := range p[0].Refused {
			if strings.HasPrefix(q, "10.77.") {
				return false
			}
		}
		return p[0].Announced >= 2
	})
}

// TestAcrossHostsClaims: h2's hostd verifies claims sent by h1 (played by
// the test: a peers.Room with h1's certificate, in h1's host namespace)
// against its own conntrack. A claim for a real connection holds, either
// way round; a forged one (a tuple h2's conntrack has not seen), one for
// an address h1 did not announce, and one of another trust group's name
// are refused with their reasons, counted by h2.
func TestAcrossHostsClaims(t *testing.T) {
	e := newPair(t, 2, [2][]string{nil, {"10.77.0.0/16"}}, [2]bool{false, true})
	h1ns := e.f.Hosts[0].HostNSPath()
	room, err := peers.Start(peers.Config{Certificate: e.cert[0], Key: e.key[0], CA: e.ca.Path, Interval: 200 * time.Millisecond,
		Peers: []peers.Peer{{Name: "h2", Address: net.JoinHostPort(e.f.Addrs[1].String(), "7470"), Prefixes: []netip.Prefix{netip.MustParsePrefix("10.78.0.0/16")}}}},
		peers.Options{In: func(fn func() error) error { return nsrig.In(h1ns, fn) }})
	if err != nil {
		t.Fatal(err)
	}
	defer room.Close()
	g1, g2 := e.f.Hosts[0].Guests[0], e.f.Hosts[1].Guests[0]
	room.Announce([]peers.Announced{{Prefix: netip.PrefixFrom(g1.Addr, 32), Group: "t"}}) // g1 only
	step := 10 * time.Second
	e.within(step, "h2 accepts the test's h1", func() bool { p := e.peersOf(1); return state(p) == peers.StateUp && p[0].Announced == 1 })

	g2.Echo(t, netip.AddrPortFrom(g2.Addr, 7001))
	c := g1.Dial(t, netip.AddrPortFrom(g2.Addr, 7001))
	defer c.Close()
	roundTrip(t, c, 3, 64<<10) // ESTABLISHED in both hosts' conntrack
	local := netip.MustParseAddrPort(c.LocalAddr().String())
	g1.Echo(t, netip.AddrPortFrom(g1.Addr, 7002))
	back := g2.Dial(t, netip.AddrPortFrom(g1.Addr, 7002))
	defer back.Close()
	roundTrip(t, back, 4, 64<<10)
	remote := netip.MustParseAddrPort(back.LocalAddr().String())

	ap := func(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }
	g2srv := ap(g2.Addr, 7001)
	for _, cl := range []struct {
		name  string
		claim peers.Claim
		want  string
	}{
		{"h1/g1 connected to h2/g1", peers.Claim{Src: local, Dst: g2srv, Active: true, Group: "t"}, "none"},
		{"h2/g1 connected to h1/g1", peers.Claim{Src: ap(g1.Addr, 7002), Dst: remote, Active: false, Group: "t"}, "none"},
		{"forged: a tuple h2 has not seen", peers.Claim{Src: ap(g1.Addr, local.Port()+1), Dst: g2srv, Active: true, Group: "t"}, "no-conntrack"},
		{"the wrong direction", peers.Claim{Src: local, Dst: g2srv, Active: false, Group: "t"}, "not-owner"},
		{"an address h1 did not announce", peers.Claim{Src: ap(e.f.Hosts[0].Guests[1].Addr, local.Port()), Dst: g2srv, Active: true, Group: "t"}, "not-owner"},
		{"another trust group's name", peers.Claim{Src: local, Dst: g2srv, Active: true, Group: "other"}, "cross-group"},
	} {
		v, err := room.Claim("h2", cl.claim, step)
		if err != nil || v != cl.want {
			t.Errorf("%s: verdict %q, %v; want %q", cl.name, v, err, cl.want)
		}
	}
	if n := e.counter(1, "shunt_peer_refused_total{peer=h1,reason=claim-no-conntrack}"); n != 1 {
		t.Errorf("h2 counted %v forged claims, want 1", n)
	}
}

// TestAcrossHostsLinkCut: the peer channel follows the fabric. A link cut
// (the fabric veth down) takes it down on both sides, and connections to
// the other host's guests get peer-unreachable; with the link back, h1
// redials and both sides are up again. A DROP of the channel's port in
// h2's input chain does the same, and removing it brings the channel back.
func TestAcrossHostsLinkCut(t *testing.T) {
	e := newPair(t, 1, [2][]string{{"10.78.0.0/16"}, {"10.77.0.0/16"}}, [2]bool{true, true})
	step := 10 * time.Second
	bothUp := func() bool { return state(e.peersOf(0)) == peers.StateUp && state(e.peersOf(1)) == peers.StateUp }
	bothDown := func() bool { return state(e.peersOf(0)) != peers.StateUp && state(e.peersOf(1)) != peers.StateUp }
	e.within(step, "both up", bothUp)
	if err := e.f.SetLink(false); err != nil {
		t.Fatal(err)
	}
	e.within(step, "both down after the cut", bothDown)
	g2 := e.f.Hosts[1].Guests[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	c, err := e.hosts[0].Dial(ctx, 1, g2.Addr.String()+":7001") // the kernel cannot route it: no connection
	cancel()
	if err == nil {
		c.Close()
		t.Fatal("a connection crossed a cut fabric")
	}
	if err := e.f.SetLink(true); err != nil {
		t.Fatal(err)
	}
	e.within(step, "both up again", bothUp)

	// The channel's port dropped on h2 (the operator's filter on the
	// host's own input): the channel dies of silence and is redialed in
	// vain; the guests' own traffic still crosses.
	if _, err := nsrig.Run(e.f.Hosts[1].HostNSPath(), "nft", "add table inet xh; add chain inet xh in { type filter hook input priority 0; }; add rule inet xh in tcp dport 7470 drop"); err != nil {
		t.Fatal(err)
	}
	e.within(step, "both down with the port dropped", bothDown)
	g2.Echo(t, netip.AddrPortFrom(g2.Addr, 7001))
	ctx, cancel = context.WithTimeout(context.Background(), step)
	defer cancel()
	c, err = e.hosts[0].Dial(ctx, 1, g2.Addr.String()+":7001")
	if err != nil {
		t.Fatalf("dial h2/g1: %v", err)
	}
	defer c.Close()
	roundTrip(t, c, 5, 256<<10)
	e.within(step, "TCP(peer-unreachable)", func() bool { return e.counter(0, "shunt_fallbacks_total{reason=peer-unreachable}") >= 1 })
	if _, err := nsrig.Run(e.f.Hosts[1].HostNSPath(), "nft", "delete table inet xh"); err != nil {
		t.Fatal(err)
	}
	e.within(step, "both up once the port passes", bothUp)
}
