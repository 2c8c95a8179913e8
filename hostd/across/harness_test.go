package across

import (
	"bufio"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/ctrack/cttest"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/hostd/peers/peertest"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// A hostile peer hostd, for the room's tests: this host (h1) runs a real
// broker, peers channel and cross-host room; the peer ("h0", so that it
// dials h1 and names the stretches' flows) is a raw TLS client that
// writes whatever channel messages a test wants.

// world is h1: its broker, with guest g1 (10.0.0.1, group t), and room.
type world struct {
	t     *testing.T
	ct    *cttest.Table
	pairs *pairs
	b     *broker.Broker
	g1    *broker.Guest
	s1    *gsession
	r     *Room
	p     *peers.Room
	ca    *peertest.CA
	addr  string       // h1's channel
	h2ln  net.Listener // h2's channel, which h1 dials
	// h0RDMA, if set, is what h0 offers for its relay link to h1 (its
	// end of a fake queue pair): with h1's Options.RDMA, the link is RDMA.
	h0RDMA func() (relay.Verbs, error)
}

// gsession is g1's session: a library that handles RESUME.
type gsession struct {
	g   *broker.Guest
	got chan proto.Msg
}

func (s *gsession) Guest() *broker.Guest { return s.g }
func (s *gsession) Send(m proto.Msg) {
	select {
	case s.got <- m:
	default: // a test that floods does not read them all
	}
}
func (s *gsession) Switching() bool { return true }
func (s *gsession) Resumes() bool   { return true }

// SendFile: g1 maps its pair regions from pairs' pools (the same memory).
func (s *gsession) SendFile(m proto.Msg, f *os.File) { s.Send(m) }

// pairs makes pair regions over memfds, as hostd/agent does over files:
// the relay session maps them (SendFile) and its bridges use them.
type pairs struct {
	t     *testing.T
	size  int64 // of a pair region; 0: 4 MiB (one pair of 1 MiB rings)
	mu    sync.Mutex
	pools map[uint32]*region.Pool
}

func (p *pairs) Make(id uint32, a, b *broker.Guest) (*region.Pool, *os.File, error) {
	size := p.size
	if size == 0 {
		size = 4 << 20
	}
	r, f := shmtest.Region(p.t, region.Geometry{Size: size, Slots: 8})
	pool := region.NewPool(r, nil)
	p.mu.Lock()
	p.pools[id] = pool
	p.mu.Unlock()
	return pool, f, nil
}

func (p *pairs) Drop(r *broker.Region) {}

// ring is g1's view of one ring of ready's pair: ab says which.
func (w *world) ring(ready proto.Msg, ab bool) *ring.Ring {
	w.t.Helper()
	w.pairs.mu.Lock()
	pool := w.pairs.pools[ready.RegionID]
	w.pairs.mu.Unlock()
	if pool == nil {
		w.t.Fatalf("no pair region %d", ready.RegionID)
	}
	off := ready.RingBA
	if ab {
		off = ready.RingAB
	}
	size := uint64(ring.Size(int(ready.Capacity)))
	rg, err := ring.Attach(pool.Region().Mem()[off:off+size], int(ready.Capacity))
	if err != nil {
		w.t.Fatal(err)
	}
	return rg
}

// readRing is the ring g1 reads (the relay writes).
func (w *world) readRing(ready proto.Msg) *ring.Ring { return w.ring(ready, ready.Side == proto.SideB) }

// next is the next message to g1 of type typ (others are skipped).
func (s *gsession) next(t *testing.T, typ proto.Type, d time.Duration) proto.Msg {
	t.Helper()
	tm := time.After(d)
	for {
		select {
		case m := <-s.got:
			if m.Type == typ {
				return m
			}
		case <-tm:
			t.Fatalf("g1 got no %v within %s", typ, d)
		}
	}
}

const peerGuest = "10.9.1.2"

func newWorld(t *testing.T) *world { t.Helper(); return newWorldWith(t, nil) }

// newWorldWith is newWorld with h1's room options changed by opt.
func newWorldWith(t *testing.T, opt func(*Options)) *world {
	t.Helper()
	rg, _ := shmtest.Region(t, region.Geometry{Size: 8 << 20, Slots: 8})
	grp := &broker.Group{Name: "t", Region: "mem", Pool: region.NewPool(rg, nil)}
	g1 := &broker.Guest{Name: "g1", ID: 1, Group: grp}
	g1.SetAddrs(broker.Addrs{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.1/32")}})
	tab, err := policy.Compile(policy.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	w := &world{t: t, ct: &cttest.Table{}, g1: g1}
	w.b = broker.New(hclog.NewNullLogger(), w.ct, metrics.New(), tab, []*broker.Guest{g1},
		broker.Options{PairingTimeout: 2 * time.Second, LookupTimeout: 100 * time.Millisecond})
	t.Cleanup(w.b.Close)
	w.pairs = &pairs{t: t, pools: map[uint32]*region.Pool{}}
	w.b.UsePairRegions(w.pairs)
	w.s1 = &gsession{g: g1, got: make(chan proto.Msg, 4096)}
	w.b.Attach(w.s1)

	if w.ca, err = peertest.NewCA(t.TempDir(), "ca"); err != nil {
		t.Fatal(err)
	}
	cert, key, err := w.ca.Issue("h1")
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	w.addr = ln.Addr().String()
	ln.Close()
	// h2 sorts after h1: h1 dials it (acceptAs), here.
	if w.h2ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}

	o := peers.Options{Verify: func(string, peers.Claim) string { return "not-local" }, Local: w.b.LocalOverlaps} // as hostd/agent wires them
	ro := Options{PairingTimeout: 2 * time.Second}
	if opt != nil {
		opt(&ro)
	}
	w.r = New(w.b, ro)
	w.r.Callbacks(&o)
	w.p, err = peers.Start(peers.Config{Listen: w.addr, Certificate: cert, Key: key, CA: w.ca.Path, Interval: time.Second, // a channel silent 3 s is down: the floods load a busy machine
		Peers: []peers.Peer{{Name: "h0", Address: "127.0.0.1:1", Prefixes: []netip.Prefix{netip.MustParsePrefix("10.9.0.0/16")}},
			{Name: "a0", Address: "127.0.0.1:1", Prefixes: []netip.Prefix{netip.MustParsePrefix("10.10.0.0/16")}},
			{Name: "h2", Address: w.h2ln.Addr().String(), Prefixes: []netip.Prefix{netip.MustParsePrefix("10.11.0.0/16")}}}}, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.p.Close)
	t.Cleanup(func() { w.h2ln.Close() }) // first: h1's dial of h2 ends at once
	if err := w.r.Start(w.p, "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.r.Close)
	w.b.UseRemote(w.r)
	return w
}

// loop runs fn on the room's event loop and waits for it.
func (w *world) loop(fn func()) {
	w.t.Helper()
	done := make(chan struct{})
	w.r.post(func() { fn(); close(done) })
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		w.t.Fatal("the room's event loop did not run a function within 10 s")
	}
}

// hostile is the peer h0's end of its channel to h1.
type hostile struct {
	t     *testing.T
	c     *tls.Conn
	br    *bufio.Reader
	got   chan peers.Across
	link  relay.Carrier
	syncs uint64
	stop  atomic.Bool // the reader stops reading
}

// wire is the channel's message (peers' msg), as the hostile peer writes it.
type wire struct {
	Type    string            `json:"type"`
	Version int               `json:"version,omitempty"`
	Addrs   []peers.Announced `json:"addrs,omitempty"`
	Nonce   uint64            `json:"nonce,omitempty"`
	Across  *peers.Across     `json:"across,omitempty"`
}

// dial connects h0 to h1 and announces the peer guest's address.
func (w *world) dial() *hostile { return w.dialAs("h0", peerGuest) }

// dialAs connects peer name (which sorts before h1) to h1; it announces
// guest.
func (w *world) dialAs(name, guest string) *hostile {
	t := w.t
	t.Helper()
	kp, pool := w.creds(name)
	c, err := tls.Dial("tcp", w.addr, &tls.Config{Certificates: []tls.Certificate{kp}, RootCAs: pool, ServerName: "h1", MinVersion: tls.VersionTLS13})
	if err != nil {
		t.Fatal(err)
	}
	h := &hostile{t: t, c: c, br: bufio.NewReaderSize(c, 1<<20), got: make(chan peers.Across, 1<<16)}
	t.Cleanup(func() { c.Close() })
	h.write(wire{Type: "hello", Version: 1})
	h.write(wire{Type: "announce", Addrs: []peers.Announced{{Prefix: netip.MustParsePrefix(guest + "/32"), Group: "t"}}})
	go h.read()
	// The relay link: h0 dials it (its name sorts first).
	h.link = h.makeLink(w.h0RDMA)
	t.Cleanup(h.link.Close)
	deadline := time.Now().Add(5 * time.Second)
	for {
		var up bool
		w.loop(func() { up = w.r.link(name).l != nil })
		if rt, ok := w.p.Route(netip.MustParseAddr(guest)); ok && rt.Up && up {
			return h
		}
		if time.Now().After(deadline) {
			t.Fatal("h1 did not accept h0's channel, announcement and relay link within 5 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// creds are a peer's certificate (named name) and the CA's pool.
func (w *world) creds(name string) (tls.Certificate, *x509.CertPool) {
	t := w.t
	t.Helper()
	cert, key, err := w.ca.Issue(name)
	if err != nil {
		t.Fatal(err)
	}
	kp, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pem, err := os.ReadFile(w.ca.Path)
	if err != nil {
		t.Fatal(err)
	}
	pool.AppendCertsFromPEM(pem)
	return kp, pool
}

// acceptAs takes h1's channel to h2 (which h1 dials) and announces
// guest; it makes no relay link (h1 offers one: the test answers it).
func (w *world) acceptAs(guest string) *hostile {
	t := w.t
	t.Helper()
	kp, pool := w.creds("h2")
	raw, err := w.h2ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	c := tls.Server(raw, &tls.Config{Certificates: []tls.Certificate{kp}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13})
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := c.Handshake(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Time{})
	h := &hostile{t: t, c: c, br: bufio.NewReaderSize(c, 1<<20), got: make(chan peers.Across, 1<<16)}
	t.Cleanup(func() { c.Close() })
	h.write(wire{Type: "hello", Version: 1})
	h.write(wire{Type: "announce", Addrs: []peers.Announced{{Prefix: netip.MustParsePrefix(guest + "/32"), Group: "t"}}})
	go h.read()
	return h
}

func (h *hostile) write(m wire) {
	b, _ := json.Marshal(m)
	if _, err := h.c.Write(append(b, '\n')); err != nil && !errors.Is(err, net.ErrClosed) {
		h.t.Errorf("h0 write: %v", err)
	}
}

func (h *hostile) across(m peers.Across) { h.write(wire{Type: "across", Across: &m}) }

// stopReading makes h's reader stop reading the channel.
func (h *hostile) stopReading() { h.stop.Store(true) }

// read answers pings and passes the room's messages to got.
func (h *hostile) read() {
	for {
		for h.stop.Load() {
			time.Sleep(100 * time.Millisecond)
		}
		line, err := h.br.ReadSlice('\n')
		if err != nil {
			close(h.got)
			return
		}
		var m wire
		if json.Unmarshal(line, &m) != nil {
			continue
		}
		switch m.Type {
		case "ping":
			h.write(wire{Type: "pong", Nonce: m.Nonce})
		case "across":
			select {
			case h.got <- *m.Across:
			default:
			}
		}
	}
}

// sync waits until h1 took every message h sent so far: a "go" for no
// connection is answered with a "stop".
func (h *hostile) sync() {
	h.t.Helper()
	h.syncs++
	h.across(peers.Across{Op: opGo, ID: 1<<50 + h.syncs, Peer: 1 << 50, Flow: 1})
	for {
		if m := h.next(opStop, 20*time.Second); m.Peer == 1<<50+h.syncs {
			return
		}
	}
}

// next is the room's next message of op.
func (h *hostile) next(op string, d time.Duration) peers.Across {
	h.t.Helper()
	tm := time.After(d)
	for {
		select {
		case m, ok := <-h.got:
			if !ok {
				h.t.Fatalf("h1 closed the channel while h0 waited for %q", op)
			}
			if m.Op == op {
				return m
			}
		case <-tm:
			h.t.Fatalf("h0 got no %q within %s", op, d)
		}
	}
}

// paired makes g1's connection 10.0.0.1:port -> the peer's guest:80 and
// pairs it with h0 (both halves verified): g1 gets READY. It returns h1's
// id for it and g1's READY.
func (w *world) paired(h *hostile, port uint16, peerID uint64) (uint64, proto.Msg) {
	t := w.t
	t.Helper()
	a := ctrack.Tuple{Src: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.1"), port), Dst: netip.MustParseAddrPort(peerGuest + ":80")}
	w.ct.Add(a, a.Reverse(), 0)
	w.b.Open(w.s1, proto.Msg{Type: proto.Open, ReqID: uint32(port), Role: proto.Active, Local: a.Src, Remote: a.Dst})
	half := h.next(opHalf, 5*time.Second)
	if half.Claim == nil || half.Claim.Src != a.Src || half.Claim.Dst != a.Dst {
		t.Fatalf("h1's claim %+v, want %v", half.Claim, a)
	}
	h.across(peers.Across{Op: opHalf, ID: peerID, Claim: &peers.Claim{Src: a.Dst, Dst: a.Src, Group: "t"}})
	h.across(peers.Across{Op: opOK, ID: peerID, Peer: half.ID})
	if ok := h.next(opOK, 5*time.Second); ok.Peer != peerID {
		t.Fatalf("h1's verdict %+v", ok)
	}
	ready := w.s1.next(t, proto.Ready, 5*time.Second)
	if up := h.next(opUp, 5*time.Second); up.ID != half.ID {
		t.Fatalf("h1's up %+v, want id %d", up, half.ID)
	}
	return half.ID, ready
}

// makeLink offers h1 a relay link (h dials) and makes it: RDMA if open
// is set and h1 offers RDMA too, else TCP.
func (h *hostile) makeLink(open func() (relay.Verbs, error)) relay.Carrier {
	h.t.Helper()
	tok := make([]byte, relay.TokenSize)
	_, _ = rand.Read(tok)
	h.across(peers.Across{Op: opLink, Token: tok})
	port := h.next(opLinkPort, 5*time.Second).Port
	conns, err := relay.DialLink(func() (net.Conn, error) {
		return net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port))))
	}, tok, 2)
	if err != nil {
		h.t.Fatal(err)
	}
	if open == nil {
		return tcpLink(h.t, conns)
	}
	lk, err := relay.NegotiateRDMA(conns[0], open, relay.RDMAOptions{})
	if err != nil {
		h.t.Fatalf("h0's RDMA link: %v", err)
	}
	for _, c := range conns[1:] {
		c.Close()
	}
	return lk
}

// tcpLink makes a TCP relay link on a link's connections, as a relay
// that offers no RDMA does.
func tcpLink(t *testing.T, conns []net.Conn) *relay.Link {
	t.Helper()
	if _, err := relay.NegotiateRDMA(conns[0], nil, relay.RDMAOptions{}); !errors.Is(err, relay.ErrUseTCP) {
		t.Fatalf("the link's negotiation: %v", err)
	}
	return relay.NewLink(conns, relay.LinkOptions{})
}

// settled waits until h1 keeps nothing of the connections: no record,
// no ring pair, no cross-host state.
func (w *world) settled(h *hostile) {
	w.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var conns, pending int
		w.loop(func() { conns, pending = len(w.r.conns), len(w.r.pending) })
		c := w.b.Counts()
		if c.Conns == 0 && c.Flows == 0 && conns == 0 {
			return
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("h1 still keeps %d records, %d ring pairs, %d cross-host connections (%d pending claims) 5 s on\n%+v", c.Conns, c.Flows, conns, pending, w.b.Flows())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// bridging waits until h1's bridge of connection id runs.
func (w *world) bridging(id uint64) {
	w.t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var on bool
		w.loop(func() { x := w.r.conns[id]; on = x != nil && x.st != nil && x.st.br != nil })
		if on {
			return
		}
		if time.Now().After(deadline) {
			w.t.Fatal("h1's bridge did not start within 5 s")
		}
	}
}

// downgrade moves h1's connection id to TCP, as an operator would.
func (w *world) downgrade(id uint64) {
	var s *session
	var req uint32
	w.loop(func() { x := w.r.conns[id]; s, req = x.s, x.req })
	w.b.DowngradeAcross(s, req, proto.ReasonAdmin)
}

// done: g1 leaves ready's ring pair and closes its connection; then h1
// must keep nothing of it.
func (w *world) done(h *hostile, ready proto.Msg) {
	w.t.Helper()
	w.left(ready)
	w.b.CloseConn(w.s1, proto.Msg{Type: proto.Close, ReqID: ready.ReqID})
	w.settled(h)
}

// left is g1's LEFT of ready's ring pair (after DOWN or RESUME).
func (w *world) left(ready proto.Msg) {
	w.b.Left(w.s1, proto.Msg{Type: proto.Left, ReqID: ready.ReqID, RegionID: ready.RegionID, Slot: ready.Slot, Gen: ready.Gen, Side: ready.Side})
}
