package peers_test

import (
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/hostd/peers/peertest"
)

// ca wraps peertest.CA for tests that fail on its errors.
type ca struct {
	t *testing.T
	*peertest.CA
	path string
}

func newCA(t *testing.T, name string) *ca {
	t.Helper()
	c, err := peertest.NewCA(t.TempDir(), name)
	if err != nil {
		t.Fatal(err)
	}
	return &ca{t: t, CA: c, path: c.Path}
}

func (c *ca) issue(name string) (string, string) {
	cert, key, err := c.Issue(name)
	if err != nil {
		c.t.Fatal(err)
	}
	return cert, key
}

func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

var (
	h1Guests = netip.MustParsePrefix("10.77.0.0/16")
	h2Guests = netip.MustParsePrefix("10.78.0.0/16")
)

type host struct {
	verify func(string, peers.Claim) string
	cfg    peers.Config
	reg    *prometheus.Registry
	r      *peers.Room
}

// pair configures h1 and h2 for each other (h1 dials: its name sorts
// first) with certificates of one CA.
func pair(t *testing.T, c *ca) (*host, *host) {
	a1, a2 := freeAddr(t), freeAddr(t)
	c1, k1 := c.issue("h1")
	c2, k2 := c.issue("h2")
	h1 := &host{cfg: peers.Config{Listen: a1, Certificate: c1, Key: k1, CA: c.path, Interval: 100 * time.Millisecond,
		Peers: []peers.Peer{{Name: "h2", Address: a2, Prefixes: []netip.Prefix{h2Guests}}}}}
	h2 := &host{cfg: peers.Config{Listen: a2, Certificate: c2, Key: k2, CA: c.path, Interval: 100 * time.Millisecond,
		Peers: []peers.Peer{{Name: "h1", Address: a1, Prefixes: []netip.Prefix{h1Guests}}}}}
	return h1, h2
}

func (h *host) start(t *testing.T, local ...string) {
	t.Helper()
	h.reg = prometheus.NewRegistry()
	var err error
	h.r, err = peers.Start(h.cfg, peers.Options{Registerer: h.reg, Verify: h.verify, Local: func(q netip.Prefix) bool {
		for _, l := range local {
			if q.Contains(netip.MustParseAddr(l)) {
				return true
			}
		}
		return false
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.r.Close)
}

func announced(addrs ...string) []peers.Announced {
	var out []peers.Announced
	for _, a := range addrs {
		if !strings.Contains(a, "/") {
			a += "/32"
		}
		q := netip.MustParsePrefix(a)
		out = append(out, peers.Announced{Prefix: q, Group: "t"})
	}
	return out
}

// eventually waits up to 5 s for cond, then fails with what state says.
func eventually(t *testing.T, what string, cond func() bool, state func() any) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 5s; state: %+v", what, state())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func route(r *peers.Room, a string) (peers.Route, bool) { return r.Route(netip.MustParseAddr(a)) }

// TestPeersAnnounceRefuseWithdraw: h1 announces its guests; h2 accepts
// those inside the prefixes its config allows h1 and refuses the others
// (outside them, or one of h2's own guests), counts and logs them, and
// tells h1; a withdrawn address stops routing at once.
func TestPeersAnnounceRefuseWithdraw(t *testing.T) {
	h1, h2 := pair(t, newCA(t, "ca"))
	h2.start(t, "10.77.9.9") // 10.77.9.9 is h2's own guest's
	h1.start(t)
	// 10.0.0.0/8 holds h1's prefix but is wider: refused as well.
	h1.r.Announce(announced("10.77.1.2", "10.77.2.2", "10.1.2.3", "10.77.9.9", "10.0.0.0/8"))
	eventually(t, "h2 routes h1's guest", func() bool { r, ok := route(h2.r, "10.77.1.2"); return ok && r.Up && r.Peer == "h1" && r.Group == "t" },
		func() any { return h2.r.List() })
	if _, ok := route(h2.r, "10.1.2.3"); ok {
		t.Error("h2 routes 10.1.2.3 to h1, outside the prefixes it allows h1")
	}
	if r, ok := route(h2.r, "10.77.9.9"); ok {
		t.Errorf("h2 routes its own guest's address to %+v", r)
	}
	info := h2.r.List()[0]
	if info.State != peers.StateUp || info.Announced != 2 || info.Refused["10.1.2.3/32"] != peers.RefusedForbidden || info.Refused["10.0.0.0/8"] != peers.RefusedForbidden || info.Refused["10.77.9.9/32"] != peers.RefusedLocal {
		t.Errorf("h2's view of h1: %+v", info)
	}
	if got := counter(h2.reg, "shunt_peer_refused_total", "h1", peers.RefusedForbidden); got != 2 {
		t.Errorf("refused forbidden-prefix counted %v, want 2", got)
	}
	eventually(t, "h1 learns of the refusals", func() bool { return len(h1.r.List()[0].TheyRefuse) == 3 }, func() any { return h1.r.List() })

	h1.r.Announce(announced("10.77.2.2"))
	eventually(t, "the withdrawal", func() bool { _, ok := route(h2.r, "10.77.1.2"); return !ok }, func() any { return h2.r.List() })
	if _, ok := route(h2.r, "10.77.2.2"); !ok {
		t.Error("the address still announced no longer routes")
	}
	if l := h1.r.List()[0]; l.BytesOut == 0 || l.BytesIn == 0 || l.Link == "" || !l.Dials {
		t.Errorf("h1's view of h2: %+v", l)
	}
}

// counter is the value of counter name with exactly these label values
// (0 if there is none).
func counter(reg *prometheus.Registry, name string, labels ...string) float64 {
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			var got []string
			for _, l := range m.GetLabel() {
				got = append(got, l.GetValue())
			}
			if strings.Join(got, ",") == strings.Join(labels, ",") {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// TestPeersDownUnreachableRetry: while h2 is down, h1 routes h2's prefixes
// as unreachable (peer-unreachable) and retries with back-off; once h2 is
// back the channel comes up by itself and h2's announcement routes.
func TestPeersDownUnreachableRetry(t *testing.T) {
	h1, h2 := pair(t, newCA(t, "ca"))
	h1.start(t)
	if r, ok := route(h1.r, "10.78.1.2"); !ok || r.Up || r.Peer != "h2" {
		t.Fatalf("h2 down: route %+v %v, want h2, not up", r, ok)
	}
	time.Sleep(500 * time.Millisecond) // several dials fail
	if l := h1.r.List()[0]; l.State == peers.StateUp || l.Error == "" {
		t.Fatalf("h2 down: h1's view %+v", l)
	}
	h2.start(t)
	h2.r.Announce(announced("10.78.1.2"))
	eventually(t, "the channel comes up and h2's guest routes", func() bool { r, ok := route(h1.r, "10.78.1.2"); return ok && r.Up },
		func() any { return h1.r.List() })
	h2.r.Close()
	eventually(t, "h2 gone: unreachable again", func() bool { r, ok := route(h1.r, "10.78.1.2"); return ok && !r.Up },
		func() any { return h1.r.List() })
	h2.start(t)
	h2.r.Announce(announced("10.78.1.2"))
	eventually(t, "back again", func() bool { r, ok := route(h1.r, "10.78.1.2"); return ok && r.Up }, func() any { return h1.r.List() })
	if l := h1.r.List()[0]; l.Reconnects != 2 {
		t.Errorf("h1 counts %d channels to h2, want 2", l.Reconnects)
	}
}

// TestPeersWrongCertificate: a peer with a certificate of another CA is
// refused by both sides, with the reason; nothing it announces routes.
func TestPeersWrongCertificate(t *testing.T) {
	good := newCA(t, "ca")
	h1, h2 := pair(t, good)
	evil := newCA(t, "evil")
	h2.cfg.Certificate, h2.cfg.Key = evil.issue("h2")
	h2.start(t)
	h1.start(t)
	h2.r.Announce(announced("10.78.1.2"))
	eventually(t, "h1 refuses h2's certificate", func() bool { return h1.r.List()[0].State == peers.StateRefused },
		func() any { return h1.r.List() })
	if r, _ := route(h1.r, "10.78.1.2"); r.Up {
		t.Error("a peer with a wrong certificate is routed as up")
	}
	if !strings.Contains(h1.r.List()[0].Error, "unknown authority") {
		t.Errorf("h1's error %q, want the unknown authority", h1.r.List()[0].Error)
	}

	eventually(t, "h2 (the acceptor) counts a refused handshake", func() bool { return counter(h2.reg, "shunt_peer_refused_total", "?", "tls") > 0 },
		func() any { return h2.r.List() })
}

// TestPeersUnknownName: a certificate of the right CA for a name nobody
// configured is refused by the acceptor (unknown-peer), and nothing its
// holder announces routes.
func TestPeersUnknownName(t *testing.T) {
	good := newCA(t, "ca")
	h1, h2 := pair(t, good)
	h2.start(t)
	h3 := &host{cfg: h1.cfg}
	h3.cfg.Listen = ""
	h3.cfg.Certificate, h3.cfg.Key = good.issue("h0") // sorts first: it dials
	h3.cfg.Peers = []peers.Peer{{Name: "h2", Address: h2.cfg.Listen, Prefixes: []netip.Prefix{h2Guests}}}
	h3.start(t)
	h3.r.Announce(announced("10.77.1.2"))
	eventually(t, "h2 refuses h0", func() bool { return counter(h2.reg, "shunt_peer_refused_total", "?", "unknown-peer") > 0 },
		func() any { return []any{h2.r.List(), h3.r.List()} })
	if r, _ := route(h2.r, "10.77.1.2"); r.Up || r.Peer != "h1" {
		t.Errorf("h2 routes an address announced by an unconfigured peer: %+v (want h1's, down)", r)
	}
}

// TestPeersReload: a reload that narrows a peer's prefixes restarts its
// channel, and the addresses now outside them are refused; a reload that
// removes the peer drops its routes.
func TestPeersReload(t *testing.T) {
	h1, h2 := pair(t, newCA(t, "ca"))
	h2.start(t)
	h1.start(t)
	h1.r.Announce(announced("10.77.1.2", "10.77.2.2"))
	eventually(t, "both route", func() bool { _, a := route(h2.r, "10.77.1.2"); _, b := route(h2.r, "10.77.2.2"); return a && b },
		func() any { return h2.r.List() })
	cfg := h2.cfg
	cfg.Peers = []peers.Peer{{Name: "h1", Address: h1.cfg.Listen, Prefixes: []netip.Prefix{netip.MustParsePrefix("10.77.1.0/24")}}}
	if err := h2.r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	eventually(t, "10.77.2.2 refused after the reload", func() bool {
		l := h2.r.List()
		return len(l) == 1 && l[0].Refused["10.77.2.2/32"] == peers.RefusedForbidden
	}, func() any { return h2.r.List() })
	if r, ok := route(h2.r, "10.77.1.2"); !ok || !r.Up {
		t.Errorf("10.77.1.2 after the reload: %+v %v", r, ok)
	}
	cfg.Peers = nil
	if err := h2.r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if l := h2.r.List(); len(l) != 0 {
		t.Errorf("peers after removing h1: %+v", l)
	}
	if _, ok := route(h2.r, "10.77.1.2"); ok {
		t.Error("a removed peer's address still routes")
	}
}

func TestConfigCheck(t *testing.T) {
	bad := peers.Config{Peers: []peers.Peer{{Name: "a"}, {Name: "a", Address: "x:1", Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.1/8")}}}}
	err := bad.Check()
	for _, want := range []string{"certificate, key and ca", "unique", "address is required", "no prefixes", "masked prefix"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Check: %v, want %q", err, want)
		}
	}
}

// TestPeersClaims: a claim goes to the peer, whose verifier decides, and
// its verdict comes back by id; a refusal is counted by its reason; a
// claim to a peer without a channel fails at once.
func TestPeersClaims(t *testing.T) {
	h1, h2 := pair(t, newCA(t, "ca"))
	var got []string
	h2.verify = func(peer string, c peers.Claim) string {
		got = append(got, peer)
		if c.Src.Port() == 4000 && c.Active && c.Group == "t" {
			return "none"
		}
		return "no-conntrack"
	}
	h1.start(t)
	if _, err := h1.r.Claim("h2", peers.Claim{}, time.Second); !errors.Is(err, peers.ErrNoChannel) {
		t.Fatalf("a claim to a peer that is down: %v", err)
	}
	h2.start(t)
	eventually(t, "up", func() bool { return h1.r.List()[0].State == peers.StateUp }, func() any { return h1.r.List() })
	c := peers.Claim{Src: netip.MustParseAddrPort("10.77.1.2:4000"), Dst: netip.MustParseAddrPort("10.78.1.2:80"), Active: true, Group: "t"}
	if v, err := h1.r.Claim("h2", c, 5*time.Second); err != nil || v != "none" {
		t.Fatalf("a good claim: %q, %v", v, err)
	}
	c.Src = netip.MustParseAddrPort("10.77.1.2:4001")
	if v, err := h1.r.Claim("h2", c, 5*time.Second); err != nil || v != "no-conntrack" {
		t.Fatalf("a forged claim: %q, %v", v, err)
	}
	if n := counter(h2.reg, "shunt_peer_refused_total", "h1", "claim-no-conntrack"); n != 1 || len(got) != 2 || got[0] != "h1" {
		t.Fatalf("refused claims counted %v; verifier saw %v", n, got)
	}
}

// TestPeersHandshakeBound: strangers who connect and never handshake hold
// at most 64 places; the others are closed at once and counted (busy), and
// once the strangers go a peer comes up.
func TestPeersHandshakeBound(t *testing.T) {
	h1, h2 := pair(t, newCA(t, "ca"))
	h2.start(t)
	var idle []net.Conn
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	for range 80 {
		c, err := net.Dial("tcp", h2.cfg.Listen)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	eventually(t, "strangers beyond 64 refused", func() bool { return counter(h2.reg, "shunt_peer_refused_total", "?", "busy") >= 16 },
		func() any { return counter(h2.reg, "shunt_peer_refused_total", "?", "busy") })
	for _, c := range idle {
		c.Close()
	}
	idle = nil
	h1.start(t)
	eventually(t, "h1 up once the strangers left", func() bool { return h2.r.List()[0].State == peers.StateUp }, func() any { return h2.r.List() })
}
