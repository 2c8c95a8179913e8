package guestlib

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/nettest"
	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// Path switching (issue 11) against guesttest's automatic hostd, which
// moves connections between the rings and TCP when told, and against the
// scripted one for the exact cases (a TCP over-read, a peer gone).

// flipper toggles the automatic hostd between fast and TCP at random
// moments (TCP for 0 to max, fast for 5 ms to 5 ms + 3 max) until stop
// is called, and ends on fast.
func flipper(t *testing.T, a *guesttest.Auto, seed uint64, max time.Duration) (stop func() int) {
	t.Helper()
	done := make(chan struct{})
	var flips atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(seed, 1))
		fast := true
		timer := time.NewTimer(0)
		defer timer.Stop()
		for {
			select {
			case <-done:
				a.SetFast(true)
				return
			case <-timer.C:
			}
			fast = !fast
			a.SetFast(fast)
			flips.Add(1)
			d := time.Duration(rng.Int64N(int64(max)))
			if fast { // long enough for READY to reach both ends on 2 busy CPUs
				d = 3*d + 5*time.Millisecond
			}
			timer.Reset(d)
		}
	}()
	return func() int { close(done); wg.Wait(); return int(flips.Load()) }
}

// stream writes seeded random bytes to w in random sizes (mostly small,
// some up to 256 KiB) for d, and on until w has written on both paths
// (at most 20 s: the switches depend on the scheduler), then half-closes;
// it returns the count and the CRC.
func stream(w *Conn, seed uint64, d time.Duration) (int, uint32, error) {
	rng := rand.New(rand.NewPCG(seed, 2))
	src := rand.NewChaCha8([32]byte{byte(seed)})
	buf := make([]byte, 256<<10)
	var sum uint32
	total := 0
	start := time.Now()
	for i := 0; ; i++ {
		if i%256 == 0 && time.Since(start) > d {
			if st := w.Stats(); st.RingSent > 0 && st.TCPSent > 0 || time.Since(start) > 20*time.Second {
				break
			}
		}
		n := 1 + rng.IntN(64)
		if rng.IntN(8) == 0 {
			n = 1 + rng.IntN(len(buf))
		}
		_, _ = src.Read(buf[:n])
		sum = crc32.Update(sum, crc32.IEEETable, buf[:n])
		if _, err := w.Write(buf[:n]); err != nil {
			return total, sum, fmt.Errorf("write at %d: %w", total, err)
		}
		total += n
	}
	return total, sum, w.CloseWrite()
}

// drain reads r to EOF in random sizes and returns the byte count and CRC.
func drain(r *Conn, seed uint64) (int, uint32, error) {
	rng := rand.New(rand.NewPCG(seed, 3))
	buf := make([]byte, 128<<10)
	var sum uint32
	total := 0
	for {
		n, err := r.Read(buf[:1+rng.IntN(len(buf))])
		sum = crc32.Update(sum, crc32.IEEETable, buf[:n])
		total += n
		if err == io.EOF {
			return total, sum, nil
		}
		if err != nil {
			return total, sum, err
		}
	}
}

type streamResult struct {
	n   int
	sum uint32
	err error
}

// both runs a seeded stream each way between a and b for d and checks
// what arrived; on failure it shows both ends' counters.
func both(t *testing.T, a, b *Conn, seed uint64, d time.Duration) {
	t.Helper()
	var wg sync.WaitGroup
	sent := make([]streamResult, 2)
	got := make([]streamResult, 2)
	for i, p := range [][2]*Conn{{a, b}, {b, a}} {
		wg.Add(2)
		go func() {
			defer wg.Done()
			n, sum, err := stream(p[0], seed+uint64(i), d)
			sent[i] = streamResult{n, sum, err}
		}()
		go func() {
			defer wg.Done()
			n, sum, err := drain(p[1], seed+uint64(i)+10)
			got[i] = streamResult{n, sum, err}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		a.Close()
		b.Close()
		<-done
		t.Errorf("streams not done in 60 s\n%s", ends(a, b))
	}
	for i := range 2 {
		if sent[i].err != nil || got[i].err != nil || got[i].n != sent[i].n || got[i].sum != sent[i].sum {
			t.Errorf("direction %d: sent %d crc %08x (%v), received %d crc %08x (%v)\n%s", i, sent[i].n, sent[i].sum, sent[i].err, got[i].n, got[i].sum, got[i].err, ends(a, b))
		}
	}
	for i, p := range [][2]*Conn{{a, b}, {b, a}} {
		w, r := p[0].Stats(), p[1].Stats()
		total := uint64(sent[i].n)
		if w.RingSent+w.TCPSent != total || r.RingReceived+r.TCPReceived != total || w.RingSent != r.RingReceived {
			t.Errorf("direction %d: byte counts do not add up to %d\n%s", i, total, ends(a, b))
		}
		if w.RingSent == 0 || w.TCPSent == 0 {
			t.Errorf("direction %d did not use both paths\n%s", i, ends(a, b))
		}
	}
}

// ends prints both ends' state for a failure message.
func ends(a, b *Conn) string {
	return fmt.Sprintf("  end 1: %+v\n  end 2: %+v", a.Stats(), b.Stats())
}

// TestSwitchRandomStreams: seeded random streams both ways, small and
// large writes, concurrent Read and Write on each end, half-close at the
// end, while hostd moves the connection between the rings and TCP every
// few milliseconds: every byte arrives once, in order, and the bytes
// counted on each path add up.
func TestSwitchRandomStreams(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			p := newPair(t)
			c, s := p.conns(t)
			defer c.Close()
			defer s.Close()
			stop := flipper(t, p.auto, seed, 3*time.Millisecond)
			both(t, c, s, seed*100, 500*time.Millisecond)
			flips := stop()
			st := c.Stats()
			t.Logf("%d flips; client %+v; hostd %+v", flips, st, p.auto.Stats())
			if st.Readies < 2 || st.Downs < 1 {
				t.Errorf("the connection did not switch (readies %d, downs %d)", st.Readies, st.Downs)
			}
		})
	}
}

// TestSwitchDownLeftReady: DOWN moves both directions to TCP, both ends
// send LEFT, and the next READY moves them back to the rings.
func TestSwitchDownLeftReady(t *testing.T) {
	p := newPair(t)
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	ping := func() {
		t.Helper()
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 4)
		if _, err := io.ReadFull(s, b); err != nil || string(b) != "ping" {
			t.Fatalf("read %q, %v\n%s", b, err, ends(c, s))
		}
	}
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
	ping()
	if st := c.Stats(); !st.WriteOnRing || st.RingSent != 4 {
		t.Fatalf("after READY: %+v, want the writer on the ring", st)
	}
	p.auto.SetFast(false)
	waitFor(t, "LEFT from both ends (the rings freed)", func() bool { return p.auto.Held() == 0 })
	if c.Path().Fast || s.Path().Fast || c.Path().Reason != "policy-reload" {
		t.Fatalf("paths %s / %s, want tcp(policy-reload)", c.Path(), s.Path())
	}
	ping()
	if st := c.Stats(); st.WriteOnRing || st.TCPSent != 4 {
		t.Fatalf("after DOWN: %+v, want 4 bytes on TCP", st)
	}
	p.auto.SetFast(true)
	waitFor(t, "the fast path again", func() bool { return c.Path().Fast && s.Path().Fast })
	ping()
	if st := c.Stats(); st.RingSent != 8 || st.WriteToRing != 2 || st.WriteToTCP != 1 {
		t.Fatalf("after READY again: %+v, want 8 ring bytes and 3 moves", st)
	}
}

// TestConnConformanceFlipping runs nettest's suite while hostd flips the
// connections between the paths.
func TestConnConformanceFlipping(t *testing.T) {
	p := newPair(t)
	stop := flipper(t, p.auto, 7, 2*time.Millisecond)
	defer stop()
	nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
		c, s := p.conns(t)
		return c, s, func() { c.Close(); s.Close() }, nil
	})
}

// scripted is a Conn accepted under the scripted hostd, given rings, and
// the peer's side of them: its kernel socket and ring ends as hostd maps
// them (the peer is side A: it writes ring AB, which the Conn reads).
type scripted struct {
	conn *Conn
	peer net.Conn
	s    *guesttest.Session
	f    guesttest.Flow
	pw   *ring.Writer
	pr   *ring.Reader
	// The rings themselves (AB: the peer writes; BA: the Conn writes).
	ab, ba *ring.Ring
	h      *guesttest.Hostd
	open   proto.Msg // the Conn's OPEN, for another READY
}

func newScripted(t *testing.T) *scripted {
	t.Helper()
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, peer, open := accepted(t, l, s)
	f := verdict(t, h, s, open)
	waitFor(t, "READY", func() bool { return conn.Path().Fast })
	ab, ba, err := h.Pool.Region().Rings(int(f.A.Slot), f.A.Gen)
	if err != nil {
		t.Fatal(err)
	}
	pw, _ := ring.NewWriter(ab, &wait.Policy{})
	pr, _ := ring.NewReader(ba, &wait.Policy{})
	waitFor(t, "the Conn's reader to attach", pw.ReaderAttached)
	return &scripted{conn: conn, peer: peer, s: s, f: f, pw: pw, pr: pr, ab: ab, ba: ba, h: h, open: open}
}

// TestSwitchStash forces the rare TCP over-read: the Conn's kernel read
// starts before the ring's start is known, and meanwhile the peer moves
// to the ring, leaves it and writes TCP again. The bytes past the start
// wait in the stash until the ring's stretch is read.
func TestSwitchStash(t *testing.T) {
	sc := newScripted(t)
	if _, err := sc.peer.Write([]byte("AAAA")); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	testHookTCPRead = func(c *Conn) {
		once.Do(func() {
			sc.pw.Start(4)
			if _, err := sc.pw.Write([]byte("BBBB")); err != nil {
				t.Error(err)
			}
			_ = sc.pw.Leave()
			if _, err := sc.peer.Write([]byte("CCCC")); err != nil {
				t.Error(err)
			}
			waitFor(t, "8 bytes in the kernel", func() bool { return inKernel(c) >= 8 })
		})
	}
	defer func() { testHookTCPRead = nil }()
	b := make([]byte, 64)
	n, err := sc.conn.Read(b)
	if err != nil || string(b[:n]) != "AAAA" {
		t.Fatalf("first read %q, %v; want AAAA (only up to the ring's start)", b[:n], err)
	}
	if len(sc.conn.stash) != 4 {
		t.Fatalf("stash %q, want CCCC: the over-read did not happen", sc.conn.stash)
	}
	sc.peer.Close()
	rest, err := io.ReadAll(sc.conn)
	if err != nil || string(rest) != "BBBBCCCC" {
		t.Fatalf("then %q, %v; want BBBBCCCC, EOF", rest, err)
	}
	if st := sc.conn.Stats(); st.TCPReceived != 8 || st.RingReceived != 4 || st.ReadToRing != 1 || st.ReadToTCP != 1 {
		t.Fatalf("stats %+v, want 8 TCP and 4 ring bytes", st)
	}
}

// inKernel returns the bytes waiting in c's socket (FIONREAD).
func inKernel(c *Conn) int {
	rc, err := c.tcp.SyscallConn()
	if err != nil {
		return 0
	}
	n := 0
	_ = rc.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.TIOCINQ) })
	return n
}

// TestSwitchPeerGone: DOWN(peer-gone) while the peer's writer is on the
// ring and never leaves it: the reader drains the ring, leaves without
// waiting, and reads what the kernel reports (here FIN: EOF). Both
// directions left, so LEFT follows.
func TestSwitchPeerGone(t *testing.T) {
	sc := newScripted(t)
	sc.pw.Start(0)
	if _, err := sc.pw.Write([]byte("last words")); err != nil {
		t.Fatal(err)
	}
	got := async(func() string { b, _ := io.ReadAll(sc.conn); return string(b) })
	sc.peer.Close() // the peer's process died: the kernel closes its socket
	sc.s.Send(t, guesttest.Down(sc.f.B, proto.ReasonPeerGone))
	if s := await(t, got, "ReadAll"); s != "last words" {
		t.Fatalf("read %q, want the ring's bytes then EOF", s)
	}
	if m := sc.s.Expect(t, proto.Left); m.Slot != sc.f.B.Slot || m.Gen != sc.f.B.Gen || m.ReqID != sc.f.B.ReqID {
		t.Fatalf("LEFT %+v, want %d.%d", m, sc.f.B.Slot, sc.f.B.Gen)
	}
	if p := sc.conn.Path(); p.String() != "tcp(peer-gone)" {
		t.Fatalf("path %s, want tcp(peer-gone)", p)
	}
}

// TestSwitchDeadlines: deadlines hold on whichever path is active, across
// the switch: a Read blocked on TCP wakes when the ring starts; a Read on
// the ring times out at its deadline; a deadline moved while a Read
// blocks is obeyed; after DOWN, TCP again.
func TestSwitchDeadlines(t *testing.T) {
	sc := newScripted(t)
	conn := sc.conn
	_ = conn.SetReadDeadline(time.Now().Add(guesttest.Wait))
	read := async(func() string {
		b := make([]byte, 8)
		n, err := conn.Read(b)
		if err != nil {
			return err.Error()
		}
		return string(b[:n])
	})
	sc.pw.Start(0) // while the Read blocks in the kernel
	if _, err := sc.pw.Write([]byte("ring")); err != nil {
		t.Fatal(err)
	}
	if s := await(t, read, "Read"); s != "ring" {
		t.Fatalf("read %q, want ring (the watcher wakes the kernel read)", s)
	}
	_ = conn.SetReadDeadline(time.Now().Add(time.Hour))
	timed := async(func() error { _, err := conn.Read(make([]byte, 8)); return err })
	_ = conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond)) // moved while it blocks
	if err := await(t, timed, "Read on the ring"); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read = %v, want a deadline error", err)
	}
	_ = conn.SetReadDeadline(time.Time{})
	sc.s.Send(t, guesttest.Down(sc.f.B, proto.ReasonPolicyReload))
	_ = sc.pw.Leave()
	if _, err := sc.peer.Write([]byte("tcp!")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 8)
	if n, err := io.ReadAtLeast(conn, b, 4); err != nil || string(b[:n]) != "tcp!" {
		t.Fatalf("after DOWN read %q, %v", b[:n], err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := conn.Read(b); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read on TCP = %v, want a deadline error", err)
	}
}

// TestSwitchHalfCloseOnRing: CloseWrite on the ring leaves it before the
// kernel's FIN: the peer reads the ring's bytes, then EOF on TCP.
func TestSwitchHalfCloseOnRing(t *testing.T) {
	sc := newScripted(t)
	sc.pr.Attach()
	if _, err := sc.conn.Write([]byte("bye")); err != nil {
		t.Fatal(err)
	}
	if err := sc.conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 8)
	n, err := sc.pr.TryRead(b)
	if err != nil || string(b[:n]) != "bye" {
		t.Fatalf("peer's ring read %q, %v", b[:n], err)
	}
	if _, err := sc.pr.TryRead(b); !errors.Is(err, ring.ErrLeft) {
		t.Fatalf("drained ring: %v, want ErrLeft", err)
	}
	if start, ok := sc.pr.Started(); !ok || start != 0 {
		t.Fatalf("start %d %v, want 0", start, ok)
	}
	_ = sc.peer.SetReadDeadline(time.Now().Add(guesttest.Wait))
	if n, err := sc.peer.Read(b); n != 0 || err != io.EOF {
		t.Fatalf("peer's TCP read %d, %v: want EOF", n, err)
	}
}

// TestTCPThenReady: hostd first says TCP(policy), then READY: the
// connection moves to the rings without either end asking again.
func TestTCPThenReady(t *testing.T) {
	p := newPair(t)
	p.auto.SetFast(false)
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	if pa := c.WaitPath(ctxWait(t)); pa.String() != "tcp(policy)" {
		t.Fatalf("path %s, want tcp(policy)", pa)
	}
	p.auto.SetFast(true)
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
	if _, err := c.Write([]byte("hi")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 2)
	if _, err := io.ReadFull(s, b); err != nil || string(b) != "hi" || c.Stats().RingSent != 2 {
		t.Fatalf("read %q, %v\n%s", b, err, ends(c, s))
	}
}

// TestCloseReadOnRing: after CloseRead, a Read on the ring returns EOF.
func TestCloseReadOnRing(t *testing.T) {
	sc := newScripted(t)
	sc.pw.Start(0)
	read := async(func() error { _, err := sc.conn.Read(make([]byte, 4)); return err })
	waitFor(t, "the reader on the ring", func() bool { return sc.conn.Stats().ReadOnRing })
	if err := sc.conn.CloseRead(); err != nil {
		t.Fatal(err)
	}
	if err := await(t, read, "Read"); err != io.EOF {
		t.Fatalf("Read after CloseRead = %v, want EOF", err)
	}
}

// TestCloseReadReadBuffer: after CloseRead, ReadBuffer returns EOF, as
// Read does, on TCP and on the ring (on TCP it spun until Close).
func TestCloseReadReadBuffer(t *testing.T) {
	for _, ring := range []bool{false, true} {
		sc := newScripted(t)
		if ring {
			sc.pw.Start(0)
		}
		if err := sc.conn.CloseRead(); err != nil {
			t.Fatal(err)
		}
		got := async(func() error { _, err := sc.conn.ReadBuffer(64); return err })
		if err := await(t, got, "ReadBuffer"); err != io.EOF {
			t.Fatalf("ReadBuffer after CloseRead (ring started %v) = %v, want EOF", ring, err)
		}
	}
}

// TestRingNoAllocs: once both directions are on the rings, a Write and a
// Read of bytes that are there allocate nothing.
func TestRingNoAllocs(t *testing.T) {
	p := newPair(t)
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
	b := make([]byte, 8)
	step := func() {
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(s, b); err != nil {
			t.Fatal(err)
		}
	}
	step()
	if st := c.Stats(); !st.WriteOnRing || !s.Stats().ReadOnRing {
		t.Fatalf("not on the rings: %s", ends(c, s))
	}
	if a := testing.AllocsPerRun(1000, step); a != 0 {
		t.Fatalf("%v allocations per 8-byte write and read on the rings, want 0", a)
	}
}

// TestZeroCopyFlipping: WriteBuffer/CommitWrite and ReadBuffer/
// ReleaseRead follow the active path while hostd flips it: in place on a
// ring, through an internal buffer on TCP, every byte once and in order.
func TestZeroCopyFlipping(t *testing.T) {
	p := newPair(t)
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	stop := flipper(t, p.auto, 9, 2*time.Millisecond)
	defer stop()
	const total = 8 << 20
	src := rand.NewChaCha8([32]byte{9})
	want := make([]byte, total)
	_, _ = src.Read(want)
	errc := make(chan error, 1)
	go func() {
		rng := rand.New(rand.NewPCG(9, 9))
		for off := 0; off < total; {
			b, err := c.WriteBuffer(min(1+rng.IntN(64<<10), total-off))
			if err != nil {
				errc <- err
				return
			}
			n := copy(b, want[off:])
			if err := c.CommitWrite(n); err != nil {
				errc <- err
				return
			}
			off += n
		}
		errc <- c.CloseWrite()
	}()
	got := make([]byte, 0, total)
	for {
		b, err := s.ReadBuffer(1 + len(got)%(32<<10))
		got = append(got, b...)
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("ReadBuffer after %d bytes: %v\n%s", len(got), err, ends(c, s))
		}
		if err := s.ReleaseRead(len(b)); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-errc; err != nil {
		t.Fatalf("writer: %v", err)
	}
	if crc32.ChecksumIEEE(got) != crc32.ChecksumIEEE(want) || len(got) != total {
		t.Fatalf("received %d bytes, want %d equal bytes\n%s", len(got), total, ends(c, s))
	}
	t.Logf("%s", ends(c, s))
}

// TestSwitchDownMidWrite: DOWN while a Write blocks on a full ring: the
// Write leaves the ring at its next step and finishes on TCP; a
// half-close then follows the last byte. The peer reads the ring's
// stretch, then TCP, then EOF: every byte once, in order.
func TestSwitchDownMidWrite(t *testing.T) {
	sc := newScripted(t)
	sc.pr.Attach()
	want := make([]byte, 100<<10) // more than the 64 KiB ring
	_, _ = rand.NewChaCha8([32]byte{4}).Read(want)
	wrote := async(func() error {
		if _, err := sc.conn.Write(want); err != nil {
			return err
		}
		return sc.conn.CloseWrite()
	})
	waitFor(t, "the ring full", func() bool { return sc.conn.Stats().RingSent == 64<<10 })
	sc.s.Send(t, guesttest.Down(sc.f.B, proto.ReasonPolicyReload))
	if err := await(t, wrote, "Write and CloseWrite"); err != nil {
		t.Fatalf("%v\n%+v", err, sc.conn.Stats())
	}
	got := make([]byte, 0, len(want))
	b := make([]byte, 32<<10)
	for {
		n, err := sc.pr.TryRead(b)
		got = append(got, b[:n]...)
		if errors.Is(err, ring.ErrLeft) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	_ = sc.peer.SetReadDeadline(time.Now().Add(guesttest.Wait))
	rest, err := io.ReadAll(sc.peer)
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, rest...)
	if crc32.ChecksumIEEE(got) != crc32.ChecksumIEEE(want) || len(got) != len(want) {
		t.Fatalf("peer got %d bytes (ring %d), want %d equal bytes", len(got), len(got)-len(rest), len(want))
	}
	if st := sc.conn.Stats(); st.RingSent != 64<<10 || st.TCPSent != uint64(len(want)-64<<10) {
		t.Fatalf("stats %+v", st)
	}
}

// TestSwitchDownWhileTCPSendBlocks: READY comes while a Write is blocked
// in a kernel send (the peer reads nothing: its window is shut, or a
// firewall drops the connection), so the writer never starts its ring.
// DOWN must still get LEFT to hostd at once: hostd takes a retired
// region back after its grace, and a reader of it then fails. The Write
// then ends on TCP with every byte in order.
func TestSwitchDownWhileTCPSendBlocks(t *testing.T) {
	sc := newScripted(t)
	want := make([]byte, 64<<20) // more than the kernel buffers of a loopback pair
	_, _ = rand.NewChaCha8([32]byte{5}).Read(want)
	wrote := async(func() error { _, err := sc.conn.Write(want); return err })
	stuck := time.Now()
	for last := sc.conn.Stats().TCPSent; time.Since(stuck) < 300*time.Millisecond; time.Sleep(10 * time.Millisecond) {
		if n := sc.conn.Stats().TCPSent; n != last || n == 0 {
			last, stuck = n, time.Now() // still moving: the kernel's buffers are not full yet
		}
	}
	sc.pr.Attach() // the peer's reader attaches: a writer not blocked would start the ring now
	sc.s.Send(t, guesttest.Down(sc.f.B, proto.ReasonFirewall))
	_ = sc.pw.Leave() // the peer's writer leaves too (it never started)
	m, err := sc.s.Read(guesttest.Wait)
	if err != nil || m.Type != proto.Left || m.Slot != sc.f.B.Slot || m.Gen != sc.f.B.Gen {
		t.Fatalf("after DOWN, with a Write blocked in a kernel send: %+v, %v; want LEFT %d.%d\n%+v", m, err, sc.f.B.Slot, sc.f.B.Gen, sc.conn.Stats())
	}
	got := async(func() []byte {
		b := make([]byte, len(want))
		_ = sc.peer.SetReadDeadline(time.Now().Add(guesttest.Wait))
		n, _ := io.ReadFull(sc.peer, b)
		return b[:n]
	})
	if b := await(t, got, "the peer's read"); crc32.ChecksumIEEE(b) != crc32.ChecksumIEEE(want) || len(b) != len(want) {
		t.Fatalf("peer got %d bytes, want %d equal bytes", len(b), len(want))
	}
	if err := await(t, wrote, "Write"); err != nil {
		t.Fatal(err)
	}
	if st := sc.conn.Stats(); st.RingSent != 0 || st.TCPSent != uint64(len(want)) || st.WriteToRing != 0 {
		t.Fatalf("stats %+v, want every byte on TCP", st)
	}
}

// ringPastDueBytes: the peer sent "AAAA" on TCP and started its ring at
// offset 8 with "RRRR" in it, TCP bytes 4 to 8 still due (a firewall
// drops them and their retransmissions); the Conn read "AAAA" (only up
// to the ring's start), and a ReadFull of n more bytes is under way.
func ringPastDueBytes(t *testing.T, n int) (*scripted, <-chan []byte) {
	t.Helper()
	sc := newScripted(t)
	if _, err := sc.peer.Write([]byte("AAAA")); err != nil {
		t.Fatal(err)
	}
	sc.pw.Start(8)
	if _, err := sc.pw.Write([]byte("RRRR")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 64)
	if k, err := sc.conn.Read(b); err != nil || string(b[:k]) != "AAAA" {
		t.Fatalf("first read %q, %v; want AAAA (only up to the ring's start)", b[:k], err)
	}
	return sc, async(func() []byte {
		b := make([]byte, n)
		k, _ := io.ReadFull(sc.conn, b)
		return b[:k]
	})
}

// TestSwitchDownWhileTCPReadBlocks: the peer's writer started its ring
// past TCP bytes that have not arrived (a firewall drops them, and its
// retransmissions with them), and a Read waits in the kernel for them.
// DOWN comes and the writer leaves: the ring's stretch must be copied
// out and LEFT sent at once, not when TCP delivers, since hostd takes a
// retired region back after its grace. Every byte then comes in order.
func TestSwitchDownWhileTCPReadBlocks(t *testing.T) {
	sc, rest := ringPastDueBytes(t, 12)
	waitFor(t, "the Read to block in the kernel", func() bool {
		sc.conn.dlMu.Lock()
		defer sc.conn.dlMu.Unlock()
		return sc.conn.readingTCP
	})
	_ = sc.pw.Leave()
	sc.s.Send(t, guesttest.Down(sc.f.B, proto.ReasonFirewall))
	m, err := sc.s.Read(guesttest.Wait)
	if err != nil || m.Type != proto.Left || m.Slot != sc.f.B.Slot || m.Gen != sc.f.B.Gen {
		t.Fatalf("after DOWN, with a Read blocked for TCP bytes before the ring's start: %+v, %v; want LEFT %d.%d\n%+v", m, err, sc.f.B.Slot, sc.f.B.Gen, sc.conn.Stats())
	}
	if _, err := sc.peer.Write([]byte("BBBBCCCC")); err != nil { // the retransmission, then new TCP bytes
		t.Fatal(err)
	}
	if got := await(t, rest, "the Read"); string(got) != "BBBBRRRRCCCC" {
		t.Fatalf("read %q, want BBBBRRRRCCCC", got)
	}
	if st := sc.conn.Stats(); st.TCPReceived != 12 || st.RingReceived != 4 {
		t.Fatalf("stats %+v, want 12 TCP and 4 ring bytes", st)
	}
}

// TestSwitchDrainCounted: at a DOWN the leaver drains what an idle
// reader's ring holds into the stash; those bytes came through the ring
// and Stats counts them so when the program reads them (the writer's
// RingSent and the reader's RingReceived must agree).
func TestSwitchDrainCounted(t *testing.T) {
	sc := newScripted(t)
	sc.pw.Start(0)
	if _, err := sc.pw.Write([]byte("ring bytes")); err != nil {
		t.Fatal(err)
	}
	_ = sc.pw.Leave()
	sc.s.Send(t, guesttest.Down(sc.f.B, proto.ReasonPolicyReload))
	if m := sc.s.Expect(t, proto.Left); m.Slot != sc.f.B.Slot || m.Gen != sc.f.B.Gen {
		t.Fatalf("LEFT %+v, want %d.%d", m, sc.f.B.Slot, sc.f.B.Gen)
	}
	if _, err := sc.peer.Write([]byte("+tcp")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 14)
	if _, err := io.ReadFull(sc.conn, b); err != nil || string(b) != "ring bytes+tcp" {
		t.Fatalf("read %q, %v", b, err)
	}
	if st := sc.conn.Stats(); st.RingReceived != 10 || st.TCPReceived != 4 {
		t.Fatalf("stats %+v, want 10 ring bytes (drained at the DOWN) and 4 TCP bytes", st)
	}
}

// TestCloseWriteDuringRingWrite: CloseWrite while a Write blocks on a
// full ring: the Write returns (EPIPE, as after shutdown), the ring is
// left before the kernel's FIN, and the peer reads what the ring holds,
// then EOF.
func TestCloseWriteDuringRingWrite(t *testing.T) {
	sc := newScripted(t)
	sc.pr.Attach()
	wrote := async(func() error { _, err := sc.conn.Write(make([]byte, 100<<10)); return err })
	waitFor(t, "the ring full", func() bool { return sc.conn.Stats().RingSent == 64<<10 })
	if err := sc.conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if err := await(t, wrote, "Write"); !errors.Is(err, syscall.EPIPE) {
		t.Fatalf("Write = %v, want EPIPE", err)
	}
	n := 0
	b := make([]byte, 32<<10)
	for {
		m, err := sc.pr.TryRead(b)
		n += m
		if errors.Is(err, ring.ErrLeft) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	_ = sc.peer.SetReadDeadline(time.Now().Add(guesttest.Wait))
	if rest, err := io.ReadAll(sc.peer); n != 64<<10 || len(rest) != 0 || err != nil {
		t.Fatalf("peer read %d ring bytes, then %d TCP bytes (%v); want 65536, then EOF", n, len(rest), err)
	}
}
