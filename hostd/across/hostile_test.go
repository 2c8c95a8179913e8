package across

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// The hostile peer's tests; the harness is harness_test.go.

// TestHostilePeerPairs: the harness itself: a connection pairs with the
// hostile peer as with a real one, and ends cleanly when g1 closes it.
func TestHostilePeerPairs(t *testing.T) {
	w := newWorld(t)
	h := w.dial()
	_, ready := w.paired(h, 4000, 77)
	w.b.CloseConn(w.s1, proto.Msg{Type: proto.Close, ReqID: ready.ReqID})
	w.settled(h)
}

// TestHostilePeerClose: a peer that says it forgot a connection ("close")
// while this host has it paired, on its rings or leaving them. The room
// must not just forget it: g1 still holds a ring pair (charged to its
// quota) that only RESUME lets it leave, and the record's relay end must
// close, or the record and its ring pair stay for good.
func TestHostilePeerClose(t *testing.T) {
	w := newWorld(t)
	h := w.dial()
	for i, at := range []string{"ready", "bridging", "stopped"} {
		id, ready := w.paired(h, uint16(4000+i), uint64(77+i))
		if at != "ready" {
			// h0 names the stretch's flow and opens it: h1's bridge runs.
			h.across(peers.Across{Op: opGo, ID: uint64(77 + i), Peer: id, Flow: uint32(5 + i)})
			if _, err := h.link.Open(uint32(5 + i)); err != nil {
				t.Fatal(err)
			}
			w.bridging(id)
		}
		if at == "stopped" {
			// h1 moves it to TCP: its relay end sends stop and waits for
			// h0's, which never comes; h0 says close instead.
			w.downgrade(id)
			if st := h.next(opStop, 5*time.Second); st.Peer != uint64(77+i) || st.Flow != uint32(5+i) {
				t.Fatalf("h1's stop %+v", st)
			}
		}
		h.across(peers.Across{Op: opClose, ID: uint64(77 + i), Peer: id})
		m := w.s1.next(t, proto.Resume, 5*time.Second)
		t.Logf("%s: g1 got RESUME at %#x (%v)", at, m.Offset, m.Reason)
		w.done(h, ready)
	}
}

// TestUnstartedStretchMarksLeft: a stretch that stops before its bridge
// ran (no flow named yet, or the flow never opened) must still mark the
// ring g1 reads left before g1 gets RESUME, as a bridge's Stop does:
// nothing else ever will, and g1's reader keeps the ring pair (and, at
// the kernel's EOF, waits for the relay) until it sees the mark.
func TestUnstartedStretchMarksLeft(t *testing.T) {
	w := newWorld(t)
	h := w.dial()
	for i, how := range []string{"no flow", "flow never opened"} {
		id, ready := w.paired(h, uint16(4100+i), uint64(90+i))
		if how == "flow never opened" {
			// h0 names the flow but never opens it on its link; h1
			// moves the connection to TCP meanwhile.
			h.across(peers.Across{Op: opGo, ID: uint64(90 + i), Peer: id, Flow: 9})
			w.loop(func() {})
			w.downgrade(id)
			if st := h.next(opStop, 5*time.Second); !st.Never {
				t.Fatalf("%s: h1's stop %+v, want never", how, st)
			}
			h.across(peers.Across{Op: opStop, ID: uint64(90 + i), Peer: id, Flow: 9, Never: true})
		} else {
			w.downgrade(id)
		}
		m := w.s1.next(t, proto.Resume, 5*time.Second)
		rd, err := ring.NewReader(w.readRing(ready), &wait.Policy{})
		if err != nil {
			t.Fatal(err)
		}
		if !rd.WriterLeft() {
			t.Fatalf("%s: g1 got RESUME(%#x) but the ring it reads is not marked left", how, m.Offset)
		}
		w.done(h, ready)
	}
}

// TestHostilePeerLinkOffers: a peer that floods this host with relay link
// offers (each a fresh token) may make it drop its own link to that peer,
// nothing more: before, each offer kept a goroutine and a pending token
// for 10 s, so a flood grew this hostd's memory without bound. At most
// one offer per peer is pending; a peer this host dials makes none.
func TestHostilePeerLinkOffers(t *testing.T) {
	w := newWorld(t)
	h := w.dial()
	before := runtime.NumGoroutine()
	const n = 2000
	for range n {
		tok := make([]byte, relay.TokenSize)
		_, _ = rand.Read(tok)
		h.across(peers.Across{Op: opLink, Token: tok})
	}
	for range n {
		h.next(opLinkPort, 10*time.Second)
	}
	w.loop(func() {})
	time.Sleep(100 * time.Millisecond) // cancelled waits return
	if g := runtime.NumGoroutine(); g > before+50 {
		t.Fatalf("%d link offers left %d more goroutines", n, g-before)
	}
	// The last offer still stands: h0 can make its link with it.
	lk := h.makeLink(nil)
	defer lk.Close()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var up bool
		w.loop(func() { up = w.r.link("h0").l != nil })
		if up {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("h1 took no link with the last offer's token within 5 s")
		}
	}
}

// TestHostilePeerFlood: a peer's messages queue for the event loop; a
// peer that sends faster than the loop takes them (or while it is busy)
// must be held back on its own channel, not queued without bound.
func TestHostilePeerFlood(t *testing.T) {
	w := newWorld(t)
	h := w.dial()
	hold := make(chan struct{})
	w.r.post(func() { <-hold }) // the loop is busy
	const n = 20000
	go func() {
		for i := range n {
			h.across(peers.Across{Op: opUp, ID: uint64(i), Peer: uint64(1 << 40)})
		}
	}()
	time.Sleep(time.Second)
	w.r.qmu.Lock()
	queued := len(w.r.q)
	w.r.qmu.Unlock()
	close(hold)
	if queued > 2*1024 {
		t.Fatalf("%d of a peer's messages queued for a busy event loop", queued)
	}
	// Held back, not dropped: once the loop runs, the channel goes on.
	tok := make([]byte, relay.TokenSize)
	_, _ = rand.Read(tok)
	h.across(peers.Across{Op: opLink, Token: tok})
	h.next(opLinkPort, 20*time.Second)
}

// TestHostilePeerClaims: a peer's claims kept for this host's half are
// its own: another peer can neither fill their room (a flood of claims)
// nor replace one (a claim of the same connection in another peer's
// name); a connection whose peer claimed it first still pairs.
func TestHostilePeerClaims(t *testing.T) {
	w := newWorld(t)
	h := w.dial()
	a0 := w.dialAs("a0", "10.10.1.2")
	g1 := netip.MustParseAddrPort("10.0.0.1:4200")
	guest := netip.MustParseAddrPort(peerGuest + ":80")
	// a0 floods claims of its own guest's ports, then claims h0's.
	for i := range 20000 {
		a0.across(peers.Across{Op: opHalf, ID: uint64(i + 1), Claim: &peers.Claim{Src: netip.AddrPortFrom(netip.MustParseAddr("10.10.1.2"), uint16(i)), Dst: g1, Group: "t"}})
	}
	a0.sync()
	// h0 claims its connection before g1's OPEN; then a0 claims it too.
	h.across(peers.Across{Op: opHalf, ID: 500, Claim: &peers.Claim{Src: guest, Dst: g1, Group: "t"}})
	h.sync()
	a0.across(peers.Across{Op: opHalf, ID: 501, Claim: &peers.Claim{Src: guest, Dst: g1, Group: "t"}})
	a0.sync()
	a := ctrack.Tuple{Src: g1, Dst: guest}
	w.ct.Add(a, a.Reverse(), 0)
	w.b.Open(w.s1, proto.Msg{Type: proto.Open, ReqID: 42, Role: proto.Active, Local: a.Src, Remote: a.Dst})
	half := h.next(opHalf, 5*time.Second)
	if ok := h.next(opOK, 5*time.Second); ok.Peer != 500 {
		t.Fatalf("h1's verdict on h0's early claim: %+v", ok)
	}
	h.across(peers.Across{Op: opOK, ID: 500, Peer: half.ID})
	w.s1.next(t, proto.Ready, 5*time.Second)
	var n int
	w.loop(func() { n = len(w.r.pending) })
	if n > maxPending {
		t.Fatalf("%d claims pending", n)
	}
}

// TestAnnounceWhileGuestsOpen: a peer's announcements are checked
// against the local guests' prefixes (the broker's lock) while the
// broker asks the peers channel for routes under its own lock (an OPEN
// to an address no local guest owns). Neither may wait for the other
// while holding its lock: the two together must not deadlock hostd.
func TestAnnounceWhileGuestsOpen(t *testing.T) {
	w := newWorld(t)
	h := w.dial()
	var big []peers.Announced
	for i := range 4096 {
		big = append(big, peers.Announced{Prefix: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 9, byte(i >> 8), byte(i)}), 32), Group: "t"})
	}
	line, _ := json.Marshal(wire{Type: "announce", Addrs: big})
	line = append(line, '\n')
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := h.c.Write(line); err != nil {
				return
			}
		}
	}()
	defer func() { close(stop); h.c.Close(); <-stopped }()
	end := time.Now().Add(3 * time.Second)
	for i := 0; time.Now().Before(end); i++ {
		a := ctrack.Tuple{Src: netip.AddrPortFrom(netip.MustParseAddr("10.0.0.1"), uint16(10000+i%50000)), Dst: netip.MustParseAddrPort("10.8.1.2:80")}
		w.ct.Add(a, a.Reverse(), 0)
		done := make(chan struct{})
		go func() {
			w.b.Open(w.s1, proto.Msg{Type: proto.Open, ReqID: uint32(100000 + i), Role: proto.Active, Local: a.Src, Remote: a.Dst})
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			// A deadlocked broker and channel cannot be cleaned up: say
			// so with every goroutine's stack and end the test binary.
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			fmt.Fprintf(os.Stderr, "--- FAIL: %s: an OPEN did not return within 5 s while a peer announced: the broker and the peers channel deadlocked\n%s", t.Name(), buf)
			os.Exit(1)
		}
	}
}

// TestHostilePeerLinkPorts: a peer that this host dials answers its link
// offer with many "linkport"s. Only the first may be dialed: before, each
// one made a link (two connections, their goroutines), and all but the
// last were never closed.
func TestHostilePeerLinkPorts(t *testing.T) {
	w := newWorld(t)
	h := w.acceptAs("10.11.1.2")
	offer := h.next(opLink, 10*time.Second)
	if len(offer.Token) != relay.TokenSize {
		t.Fatalf("h1's link offer %+v", offer)
	}
	rl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer rl.Close()
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := rl.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	}()
	port := uint16(rl.Addr().(*net.TCPAddr).Port)
	for range 20 {
		h.across(peers.Across{Op: opLinkPort, Port: port})
	}
	time.Sleep(time.Second)
	mu.Lock()
	n := len(conns)
	mu.Unlock()
	if n != 2 {
		t.Fatalf("20 linkports made h1 dial %d connections, want one link's 2", n)
	}
}

// TestHostilePeerStopsReading: a peer that stops reading its channel
// while making this host answer it (a flood of "go" for no connection,
// each answered with a "stop") must not stall the room for the other
// peers: this host's writes to it wait (up to 3 intervals) on a writer
// of that channel's own, never on the room's event loop.
func TestHostilePeerStopsReading(t *testing.T) {
	w := newWorld(t)
	h := w.dial()
	a0 := w.dialAs("a0", "10.10.1.2")
	h.stopReading()
	go func() {
		for i := range 200000 {
			if h.c.SetWriteDeadline(time.Now().Add(5*time.Second)) != nil {
				return
			}
			b, _ := json.Marshal(wire{Type: "across", Across: &peers.Across{Op: opGo, ID: uint64(i + 1), Peer: 1 << 50, Flow: 1}})
			if _, err := h.c.Write(append(b, '\n')); err != nil {
				return
			}
		}
	}()
	time.Sleep(2 * time.Second) // h1's writes to h0 fill the socket buffers and wait
	for range 5 {
		start := time.Now()
		a0.sync()
		if d := time.Since(start); d > 1500*time.Millisecond { // before: 3-8 s
			t.Fatalf("a0's message took %s to be answered while h0 did not read", d)
		}
	}
}

// TestHostilePeerClaimFlood: a peer that repeats its claim of a
// connection (paired or not) must not make this host look it up in
// conntrack (and take the broker's lock) at its message rate: one check
// at a time per connection, and a paired one's again at most once a
// second (a restarted peer's).
func TestHostilePeerClaimFlood(t *testing.T) {
	w := newWorld(t)
	h := w.dial()
	_, ready := w.paired(h, 4300, 60)
	before := w.ct.Lookups()
	claim := &peers.Claim{Src: netip.MustParseAddrPort(peerGuest + ":80"), Dst: netip.MustParseAddrPort("10.0.0.1:4300"), Group: "t"}
	for range 2000 {
		h.across(peers.Across{Op: opHalf, ID: 60, Claim: claim})
	}
	h.sync()
	if n := w.ct.Lookups() - before; n > 10 {
		t.Fatalf("2000 repeated claims of a paired connection cost %d conntrack lookups", n)
	}
	w.done(h, ready)
}
