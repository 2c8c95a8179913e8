package relay

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
)

// conns makes n connected TCP pairs on loopback, in the same order on
// both sides.
func conns(t testing.TB, n int) ([]net.Conn, []net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var a, b []net.Conn
	for range n {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		s, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		a, b = append(a, c), append(b, s)
	}
	return a, b
}

func links(t *testing.T, n int, o LinkOptions) (*Link, *Link) {
	ca, cb := conns(t, n)
	la, lb := NewLink(ca, o), NewLink(cb, o)
	t.Cleanup(func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() })
	return la, lb
}

func seeded(seed uint64, n int) []byte {
	b := make([]byte, n)
	rng := rand.New(rand.NewPCG(seed, ^seed))
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// deadline fails t if done is not closed within d.
func deadline(t *testing.T, d time.Duration, what string, done <-chan struct{}, state func() string) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s: not within %s; %s", what, d, state())
	}
}

func (f *Flow) state() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return fmt.Sprintf("flow %d: sent %d acked %d recvd %d consumed %d", f.id, f.sent, f.acked, f.recvd, f.consumed)
}

// TestLinkStreamsBothWays: 16 flows over 3 connections each carry a
// seeded 1 MiB stream both ways, written in odd-sized pieces; every byte
// arrives in order (checksums), and each sender's Acked ends at the full
// length: the receiver took it all.
func TestLinkStreamsBothWays(t *testing.T) {
	la, lb := links(t, 3, LinkOptions{Window: 256 << 10})
	streamsBothWays(t, la, lb, 16, 1<<20)
}

// streamsBothWays carries a seeded stream of size bytes each way on each
// of flows flows between la and lb, checksummed, and waits for every
// sender's Acked to reach the end.
func streamsBothWays(t *testing.T, la, lb Carrier, flows uint32, size int) {
	var wg sync.WaitGroup
	errs := make(chan error, 4*flows)
	var all []*Flow
	for id := range flows {
		fa, err := la.Open(id)
		if err != nil {
			t.Fatal(err)
		}
		fb, err := lb.Open(id)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, fa, fb)
		for i, pair := range [][2]*Flow{{fa, fb}, {fb, fa}} {
			data := seeded(uint64(id)*2+uint64(i), size)
			wg.Add(2)
			go func() {
				defer wg.Done()
				for off := 0; off < size; {
					n := min(size-off, 1+int(rand.Uint32N(300<<10)))
					if _, err := pair[0].Write(data[off : off+n]); err != nil {
						errs <- err
						return
					}
					off += n
				}
				pair[0].Left()
			}()
			go func() {
				defer wg.Done()
				got, err := io.ReadAll(pair[1])
				if err != nil {
					errs <- err
					return
				}
				if sha256.Sum256(got) != sha256.Sum256(data) {
					errs <- errors.New("checksum differs")
				}
			}()
		}
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	deadline(t, 60*time.Second, "16 flows both ways", done, func() string {
		var s string
		for _, f := range all {
			s += f.state() + "; "
		}
		return s
	})
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for _, f := range all {
		waitAcked(t, f, uint64(size))
	}
}

func waitAcked(t *testing.T, f *Flow, want uint64) {
	t.Helper()
	for end := time.Now().Add(5 * time.Second); f.Acked() != want; time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("acked %d, want %d (%s)", f.Acked(), want, f.state())
		}
	}
}

// TestLinkNoHeadOfLineBlocking: two flows share one connection; the first
// one's reader never reads. Its writer stops at its window, and the other
// flow carries 32 MiB meanwhile.
func TestLinkNoHeadOfLineBlocking(t *testing.T) {
	const window = 128 << 10
	la, lb := links(t, 1, LinkOptions{Window: window})
	noHeadOfLineBlocking(t, la, lb, window)
}

func noHeadOfLineBlocking(t *testing.T, la, lb Carrier, window uint64) {
	slowA, _ := la.Open(1)
	_, _ = lb.Open(1) // opened, never read
	fastA, _ := la.Open(2)
	fastB, _ := lb.Open(2)
	go slowA.Write(make([]byte, 8<<20))
	data := seeded(7, 32<<20)
	go func() { fastA.Write(data); fastA.Left() }()
	done := make(chan struct{})
	var got []byte
	var err error
	go func() { got, err = io.ReadAll(fastB); close(done) }()
	deadline(t, 30*time.Second, "the fast flow beside a stalled one", done, func() string { return slowA.state() + "; " + fastB.state() })
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("fast flow: %d bytes, %v", len(got), err)
	}
	slowA.mu.Lock()
	sent, acked := slowA.sent, slowA.acked
	slowA.mu.Unlock()
	if sent != window || acked != 0 {
		t.Fatalf("stalled flow sent %d acked %d, want exactly its window %d and nothing acked", sent, acked, window)
	}
	// The stalled writer's wait is counted; both flows' bytes are.
	if st := la.Stats(); st.Stalled <= 0 || st.BytesOut != window+32<<20 || st.Frames < st.Writes || st.Writes == 0 {
		t.Fatalf("sender's stats %+v", st)
	}
	if st := lb.Stats(); st.BytesIn != window+32<<20 {
		t.Fatalf("receiver's stats %+v", st)
	}
}

// TestLinkAckedIsConsumed: the sender's Acked follows what the receiver's
// consumer took, never more.
func TestLinkAckedIsConsumed(t *testing.T) {
	la, lb := links(t, 2, LinkOptions{Window: 64 << 10})
	fa, _ := la.Open(5)
	fb, _ := lb.Open(5)
	go fa.Write(make([]byte, 40<<10))
	buf := make([]byte, 10<<10)
	var took uint64
	for took < 30<<10 {
		n, err := fb.Read(buf[:min(len(buf), int(30<<10-took))])
		if err != nil {
			t.Fatal(err)
		}
		took += uint64(n)
		if a := fa.Acked(); a > took {
			t.Fatalf("acked %d while the receiver took %d", a, took)
		}
	}
	// Drained for now or a quarter window taken: the credit goes out.
	time.Sleep(50 * time.Millisecond)
	if a := fa.Acked(); a > took || a < took-16<<10 {
		t.Fatalf("acked %d, took %d", a, took)
	}
}

// TestLinkDownAndLeftInOrder: DOWN and LEFT reach the peer after the
// bytes written before them, with DOWN's reason.
func TestLinkDownAndLeftInOrder(t *testing.T) {
	la, lb := links(t, 2, LinkOptions{})
	downAndLeftInOrder(t, la, lb)
}

func downAndLeftInOrder(t *testing.T, la, lb Carrier) {
	fa, _ := la.Open(1)
	fb, _ := lb.Open(1)
	fa.Write(seeded(1, 1000))
	fa.Down(proto.ReasonFirewall)
	got, err := io.ReadAll(fb)
	var down ErrDown
	if len(got) != 1000 || !errors.As(err, &down) || down.Reason != proto.ReasonFirewall {
		t.Fatalf("read %d bytes then %v, want 1000 then DOWN(firewall)", len(got), err)
	}
	ga, _ := la.Open(2)
	gb, _ := lb.Open(2)
	ga.Write(seeded(2, 5000))
	ga.Left()
	if got, err := io.ReadAll(gb); len(got) != 5000 || err != nil {
		t.Fatalf("read %d bytes then %v, want 5000 then EOF", len(got), err)
	}
}

// TestLinkAttached: a flow's ATTACHED reaches the peer's flow
// (PeerAttached), in order with the bytes before it, once however often
// it is sent; the sender's own PeerAttached stays open.
func TestLinkAttached(t *testing.T) {
	la, lb := links(t, 1, LinkOptions{})
	fa, _ := la.Open(0)
	fb, _ := lb.Open(0)
	fa.Write(seeded(1, 1000))
	fa.Attached()
	fa.Attached()
	select {
	case <-fb.PeerAttached():
	case <-time.After(10 * time.Second):
		t.Fatalf("no ATTACHED: %s", fb.state())
	}
	fb.mu.Lock()
	recvd := fb.recvd
	fb.mu.Unlock()
	if recvd != 1000 {
		t.Fatalf("ATTACHED came with %d bytes received, want the 1000 sent before it", recvd)
	}
	fa.Write(seeded(2, 10))
	fa.Left()
	if got, err := io.ReadAll(fb); len(got) != 1010 || err != nil {
		t.Fatalf("read %d bytes then %v, want 1010 then EOF", len(got), err)
	}
	select {
	case <-fa.PeerAttached():
		t.Fatal("the sender's own flow took its ATTACHED")
	default:
	}
	if la.Err() != nil || lb.Err() != nil {
		t.Fatalf("link errors: %v, %v", la.Err(), lb.Err())
	}
}

// TestLinkAttachedEarly: an ATTACHED that comes after the peer's open
// but before this side opened the flow is kept with the open (a VM's
// stretch whose goroutine was descheduled between its Hello and its
// Open lost it, and its writer stayed on TCP: TestVsockHybrid).
func TestLinkAttachedEarly(t *testing.T) {
	la, lb := links(t, 1, LinkOptions{})
	fa, _ := la.Open(0)
	fa.Attached()
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		lb.mu.Lock()
		e := lb.early[0]
		lb.mu.Unlock()
		if e.attached {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("the early open has no ATTACHED: %+v, dropped %d", e, lb.Dropped())
		}
	}
	fb, _ := lb.Open(0)
	select {
	case <-fb.PeerAttached():
	default:
		t.Fatal("the flow opened after the peer's ATTACHED does not have it")
	}
}

// TestLinkCut: a connection cut mid-stream ends the link on both sides;
// no side claims more than happened: the sender's Acked is at most what
// the receiver took, which is at most what was sent.
func TestLinkCut(t *testing.T) {
	ca, cb := conns(t, 2)
	la, lb := NewLink(ca, LinkOptions{Window: 64 << 10}), NewLink(cb, LinkOptions{Window: 64 << 10})
	defer func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() }()
	fa, _ := la.Open(0)
	fb, _ := lb.Open(0)
	cutMidStream(t, fa, fb, func() { ca[0].Close() }, func() {}) // the flow's connection
	if la.Err() == nil || lb.Err() == nil {
		t.Fatalf("link errors after the cut: %v, %v", la.Err(), lb.Err())
	}
}

// cutMidStream streams from fa to fb, calls cut once fb took 1 MiB,
// wants fa's writer to return with an error, calls after, reads what fb
// still gives, and checks that no side claims more than happened:
// acked <= taken <= sent.
func cutMidStream(t *testing.T, fa, fb *Flow, cut, after func()) {
	t.Helper()
	werr := make(chan error, 1)
	go func() { _, err := fa.Write(make([]byte, 64<<20)); werr <- err }()
	var took uint64
	buf := make([]byte, 32<<10)
	for took < 1<<20 {
		n, err := fb.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		took += uint64(n)
	}
	cut()
	select {
	case err := <-werr:
		if err == nil {
			t.Fatal("write finished across a cut link")
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("writer still blocked 10s after the cut: %s", fa.state())
	}
	after()
	for {
		n, err := fb.Read(buf)
		took += uint64(n)
		if err != nil {
			break
		}
	}
	fa.mu.Lock()
	sent, acked := fa.sent, fa.acked
	fa.mu.Unlock()
	if acked > took || took > sent {
		t.Fatalf("acked %d, taken %d, sent %d: want acked <= taken <= sent", acked, took, sent)
	}
}

// TestLinkHostilePeer: a peer relay that sends bytes without or beyond
// credit, out of order, after LEFT, or malformed frames, or credit for
// too many flows, ends the link with ErrProtocol; frames for a flow not
// open here are dropped and counted.
func TestLinkHostilePeer(t *testing.T) {
	data := func(flow uint32, off uint64, n int) frame {
		return frame{typ: fData, flow: flow, arg: off, data: make([]byte, n)}
	}
	for name, c := range map[string]struct {
		frames []frame
		raw    []byte
	}{
		"over a window":  {frames: []frame{data(1, 0, 4097)}},
		"beyond credit":  {frames: []frame{{typ: fCredit, flow: 1}, data(1, 0, 4096), data(1, 4096, 1)}},
		"out of order":   {frames: []frame{{typ: fCredit, flow: 1}, data(1, 10, 10)}},
		"after left":     {frames: []frame{{typ: fCredit, flow: 1}, {typ: fLeft, flow: 1}, data(1, 0, 1)}},
		"left elsewhere": {frames: []frame{{typ: fLeft, flow: 1, arg: 5}}},
		"credit > sent":  {frames: []frame{{typ: fCredit, flow: 1, arg: 1}}},
		"attached + arg": {frames: []frame{{typ: fAttached, flow: 1, arg: 1}}},
		"attached + len": {raw: []byte{5, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0}},
		"bad type":       {raw: []byte{9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
		"reserved":       {raw: []byte{1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
		"oversized":      {raw: []byte{1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}},
		"early credits":  {frames: []frame{{typ: fCredit, flow: 100}, {typ: fCredit, flow: 101}, {typ: fCredit, flow: 102}}},
	} {
		t.Run(name, func(t *testing.T) {
			ca, cb := conns(t, 1)
			l := NewLink(ca, LinkOptions{Window: 4096, MaxEarly: 2})
			defer func() { l.Close(); l.Wait(); cb[0].Close() }()
			if _, err := l.Open(1); err != nil { // its CREDIT(0) grants the peer one window
				t.Fatal(err)
			}
			var b []byte
			for _, fr := range c.frames {
				b = fr.header(b)
				b = append(b, fr.data...)
			}
			b = append(b, c.raw...)
			go io.Copy(io.Discard, cb[0])
			cb[0].Write(b)
			for end := time.Now().Add(5 * time.Second); l.Err() == nil; time.Sleep(time.Millisecond) {
				if time.Now().After(end) {
					t.Fatal("the link took it")
				}
			}
			if !errors.Is(l.Err(), ErrProtocol) {
				t.Fatalf("link error %v, want a protocol error", l.Err())
			}
		})
	}
	ca, cb := conns(t, 1)
	l := NewLink(ca, LinkOptions{})
	defer func() { l.Close(); l.Wait(); cb[0].Close() }()
	fr := data(42, 0, 3)
	cb[0].Write(append(fr.header(nil), fr.data...))
	for end := time.Now().Add(5 * time.Second); l.Dropped() != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("dropped %d, err %v", l.Dropped(), l.Err())
		}
	}
	if l.Err() != nil {
		t.Fatalf("a frame for a flow not open here ended the link: %v", l.Err())
	}
}

// FuzzReadFrame: any bytes give a frame within bounds or an error, never
// a panic or a payload over MaxPayload.
func FuzzReadFrame(f *testing.F) {
	fr := frame{typ: fData, flow: 1, arg: 2, data: []byte("abc")}
	f.Add(append(fr.header(nil), fr.data...))
	f.Add([]byte{2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		fr, err := readFrame(bytes.NewReader(b), make([]byte, MaxPayload))
		if err == nil && (len(fr.data) > MaxPayload || fr.typ < fData || fr.typ > fLeft) {
			t.Fatalf("accepted %+v", fr)
		}
	})
}

// TestLinkTinyFramesBounded: a peer that cuts a window into 1-byte frames
// costs the receiver no more memory than the bytes (packed chunks), and
// every byte reads back in order.
func TestLinkTinyFramesBounded(t *testing.T) {
	const window = 64 << 10
	ca, cb := conns(t, 1)
	l := NewLink(ca, LinkOptions{Window: window})
	defer func() { l.Close(); l.Wait(); cb[0].Close() }()
	f, err := l.Open(1)
	if err != nil {
		t.Fatal(err)
	}
	go io.Copy(io.Discard, cb[0])
	want := seeded(9, window)
	var b []byte
	for i := range want {
		fr := frame{typ: fData, flow: 1, arg: uint64(i), data: want[i : i+1]}
		b = append(fr.header(b), fr.data...)
	}
	if _, err := cb[0].Write(b); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		f.mu.Lock()
		recvd, nq := f.recvd, len(f.buf.q)
		f.mu.Unlock()
		if recvd == window {
			if nq > window/chunkSize+1 {
				t.Fatalf("%d one-byte frames held in %d chunks of %d", window, nq, chunkSize)
			}
			break
		}
		if time.Now().After(end) {
			t.Fatalf("received %d of %d; link error %v", recvd, window, l.Err())
		}
	}
	got := make([]byte, window)
	if _, err := io.ReadFull(f, got); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back: %v, equal %v", err, bytes.Equal(got, want))
	}
}

// TestLinkChurnKeepsNoEarlyCredits: flows opened, used and closed on
// both sides many more times than MaxEarly, with the late credits of
// closed flows in flight, and peers' opens of flows never opened here:
// the link stays up (before, each late credit stayed in the table of
// early opens and the link ended at MaxEarly of them).
func TestLinkChurnKeepsNoEarlyCredits(t *testing.T) {
	a, b := links(t, 2, LinkOptions{MaxEarly: 64})
	for id := uint32(1); id <= 300; id++ {
		fa, err := a.Open(id)
		if err != nil {
			t.Fatalf("flow %d: %v (link: %v)", id, err, a.Err())
		}
		fb, err := b.Open(id)
		if err != nil {
			t.Fatalf("flow %d: %v (link: %v)", id, err, b.Err())
		}
		if _, err := fb.Write([]byte{byte(id)}); err != nil {
			t.Fatalf("flow %d: write: %v", id, err)
		}
		fb.Close()
		got := make([]byte, 1)
		if _, err := io.ReadFull(fa, got); err != nil || got[0] != byte(id) {
			t.Fatalf("flow %d: read %v, %v", id, got, err)
		}
		fa.Close()
	}
	// Opens the other side never matches (refused stretches) are fewer
	// than MaxEarly at a time here; the table ages them out when full.
	for id := uint32(1000); id < 1040; id++ {
		f, err := b.Open(id)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	time.Sleep(100 * time.Millisecond)
	if err := a.Err(); err != nil {
		t.Fatalf("the link ended: %v", err)
	}
	if err := b.Err(); err != nil {
		t.Fatalf("the link ended: %v", err)
	}
}
