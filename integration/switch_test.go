package integration

import (
	"context"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/integration/stack"
)

// Path switching (issue 11) with the real hostd: Go ends in two namespace
// guests, seeded random streams both ways while the policy flips, two
// processes that connect to each other at once, and hostd killed and
// restarted under a live stream. Every test has a deadline and, on
// failure, prints both ends' counters and hostd's connection records.

// settle waits until conn is on the rings (fast) or hostd has answered
// with TCP (!fast), within bound.
func settle(t *testing.T, conn *guestlib.Conn, fast bool, bound time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	p := conn.WaitPath(ctx)
	if fast {
		eventually(t, bound, "the fast path ("+conn.Path().String()+")", func() bool { return conn.Path().Fast })
	} else if p.Fast {
		t.Fatalf("path %s, want tcp", p)
	}
}

// state is both ends' counters and hostd's records, for failure messages.
func (e *env) state(a, b *guestlib.Conn) string {
	fl, err := e.Conns()
	return fmt.Sprintf("  end 1: %+v\n  end 2: %+v\n  hostd flows (%v): %+v", a.Stats(), b.Stats(), err, fl)
}

// streamFor writes seeded random bytes in random sizes (mostly small,
// some up to 256 KiB) to w for d, and on while until (if set) says so
// about w's counters (at most 20 s), then half-closes; it returns the
// count and CRC.
func streamFor(w *guestlib.Conn, seed uint64, d time.Duration, until func(guestlib.Stats) bool) (int, uint32, error) {
	rng := rand.New(rand.NewPCG(seed, 2))
	src := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)})
	buf := make([]byte, 256<<10)
	var sum uint32
	total := 0
	start := time.Now()
	for i := 0; ; i++ {
		if i%256 == 0 && time.Since(start) > d {
			if until == nil || until(w.Stats()) || time.Since(start) > 20*time.Second {
				break
			}
		}
		n := 1 + rng.IntN(512)
		if rng.IntN(8) == 0 {
			n = 1 + rng.IntN(len(buf))
		}
		_, _ = src.Read(buf[:n])
		sum = crc32.Update(sum, crc32.IEEETable, buf[:n])
		if _, err := w.Write(buf[:n]); err != nil {
			return total, sum, fmt.Errorf("write at byte %d: %w", total, err)
		}
		total += n
	}
	return total, sum, w.CloseWrite()
}

// drainAll reads r to EOF in random sizes; it returns the count and CRC.
func drainAll(r *guestlib.Conn, seed uint64) (int, uint32, error) {
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
			return total, sum, fmt.Errorf("read at byte %d: %w", total, err)
		}
	}
}

// bothWays streams between a and b in both directions for d, with during
// running meanwhile (it returns when stop closes), and checks that every
// byte arrived once and that the bytes each path carried add up. It
// returns the writers' counters.
func (e *env) bothWays(t *testing.T, a, b *guestlib.Conn, seed uint64, d time.Duration, until func(guestlib.Stats) bool, during func(stop <-chan struct{})) [2]guestlib.Stats {
	t.Helper()
	type res struct {
		n   int
		sum uint32
		err error
	}
	var sent, got [2]res
	var wg sync.WaitGroup
	for i, p := range [][2]*guestlib.Conn{{a, b}, {b, a}} {
		wg.Add(2)
		go func() {
			defer wg.Done()
			n, sum, err := streamFor(p[0], seed+uint64(i), d, until)
			sent[i] = res{n, sum, err}
		}()
		go func() {
			defer wg.Done()
			n, sum, err := drainAll(p[1], seed+uint64(i))
			got[i] = res{n, sum, err}
		}()
	}
	stop := make(chan struct{})
	var dw sync.WaitGroup
	if during != nil {
		dw.Add(1)
		go func() { defer dw.Done(); during(stop) }()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d + 80*time.Second):
		t.Errorf("streams not done %v after their end\n%s", 60*time.Second, e.state(a, b))
		a.Close()
		b.Close()
		<-done
	}
	close(stop)
	dw.Wait()
	var out [2]guestlib.Stats
	for i, p := range [][2]*guestlib.Conn{{a, b}, {b, a}} {
		if sent[i].err != nil || got[i].err != nil || got[i].n != sent[i].n || got[i].sum != sent[i].sum {
			t.Errorf("direction %d: sent %d bytes crc %08x (%v), received %d crc %08x (%v)\n%s",
				i, sent[i].n, sent[i].sum, sent[i].err, got[i].n, got[i].sum, got[i].err, e.state(a, b))
		}
		w, r := p[0].Stats(), p[1].Stats()
		if n := uint64(sent[i].n); w.RingSent+w.TCPSent != n || r.RingReceived+r.TCPReceived != n || w.RingSent != r.RingReceived {
			t.Errorf("direction %d: the paths' byte counts do not add up to %d\n%s", i, n, e.state(a, b))
		}
		out[i] = w
	}
	return out
}

// TestSwitchPolicyFlip: the policy flips between fastpath and tcp every
// few milliseconds (a reload each time) while seeded random streams run
// both ways: every byte arrives once and in order, no call fails, and
// both paths carried bytes in both directions.
func TestSwitchPolicyFlip(t *testing.T) {
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5400)
	settle(t, c, true, 5*time.Second)
	flips := 0
	bothPaths := func(st guestlib.Stats) bool { return st.RingSent > 0 && st.TCPSent > 0 && st.WriteToRing >= 2 }
	st := e.bothWays(t, c, s, 11, 2*time.Second, bothPaths, func(stop <-chan struct{}) {
		rng := rand.New(rand.NewPCG(5, 5))
		policies := []string{stack.PolicyTCP, ""}
		for i := 0; ; i++ {
			select {
			case <-stop:
				if _, err := e.SetPolicy(""); err != nil {
					t.Errorf("reload: %v", err)
				}
				return
			case <-time.After(time.Duration(2+rng.IntN(8)) * time.Millisecond):
			}
			if _, err := e.SetPolicy(policies[i%2]); err != nil {
				t.Errorf("reload: %v", err)
				return
			}
			flips++
		}
	})
	t.Logf("%d flips; writers: %+v / %+v", flips, st[0], st[1])
	for i, w := range st {
		if w.RingSent == 0 || w.TCPSent == 0 || w.WriteToRing < 2 {
			t.Errorf("direction %d did not move between the paths: %+v\n%s", i, w, e.state(c, s))
		}
	}
}

// TestSimultaneousConnect: two processes connect to each other's listener
// before either accepts (as Open MPI's TCP BTL does): nothing waits on the
// other's accept, and all four ends reach the fast path (the issue asks
// for 50 ms; the assertion is on the path within a generous bound, and the
// time is logged).
func TestSimultaneousConnect(t *testing.T) {
	e := newEnv(t, 2, "")
	l1, l2 := e.listen(1, 5410), e.listen(2, 5411)
	start := time.Now()
	type dialed struct {
		c   *guestlib.Conn
		err error
	}
	d1, d2 := make(chan dialed, 1), make(chan dialed, 1)
	go func() {
		c, err := e.dial(1, fmt.Sprintf("%s:5411", e.rig.Guests[1].Addr))
		d1 <- dialed{c, err}
	}()
	go func() {
		c, err := e.dial(2, fmt.Sprintf("%s:5410", e.rig.Guests[0].Addr))
		d2 <- dialed{c, err}
	}()
	var conns []*guestlib.Conn
	for _, d := range []chan dialed{d1, d2} {
		select {
		case r := <-d:
			if r.err != nil {
				t.Fatalf("dial: %v", r.err)
			}
			conns = append(conns, r.c)
		case <-time.After(10 * time.Second):
			t.Fatal("connect waited for the peer's accept")
		}
	}
	connected := time.Since(start)
	for _, l := range []*guestlib.Listener{l1, l2} {
		a, err := l.AcceptShunt()
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, a)
	}
	for _, c := range conns {
		t.Cleanup(func() { c.Close() })
	}
	for _, c := range conns {
		settle(t, c, true, 5*time.Second)
	}
	t.Logf("both connected in %v; all four ends on the rings %v after the first connect", connected, time.Since(start))
	// And the bytes take them: one round trip each way on each connection.
	for i, p := range [][2]*guestlib.Conn{{conns[0], conns[3]}, {conns[1], conns[2]}} {
		if _, err := p[0].Write([]byte("hi")); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 2)
		if _, err := io.ReadFull(p[1], b); err != nil || string(b) != "hi" {
			t.Fatalf("connection %d: read %q, %v\n%s", i, b, err, e.state(p[0], p[1]))
		}
		if st := p[0].Stats(); st.RingSent != 2 {
			t.Fatalf("connection %d: %+v, want the bytes on the ring", i, st)
		}
	}
}

// TestSwitchHostdRestart: hostd is SIGKILLed and started again while
// streams run both ways: no call fails, every byte arrives, and the
// library reconnects on its own.
func TestSwitchHostdRestart(t *testing.T) {
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5420)
	settle(t, c, true, 5*time.Second)
	settle(t, s, true, 5*time.Second)
	e.bothWays(t, c, s, 21, 2*time.Second, nil, func(stop <-chan struct{}) {
		select {
		case <-stop:
			return
		case <-time.After(500 * time.Millisecond):
		}
		e.KillHostd()
		select {
		case <-stop:
		case <-time.After(200 * time.Millisecond):
		}
		if err := e.StartHostd(); err != nil {
			t.Errorf("restart hostd: %v", err)
		}
	})
	eventually(t, 10*time.Second, "both clients reconnected", func() bool {
		return e.Clients[0].Reconnects() > 0 && e.Clients[1].Reconnects() > 0
	})
}

// TestSwitchAfterHostdRestart: connections that a restarted hostd adopted
// (REATTACH) still move: a policy flip sends them to TCP and back to the
// rings, and the bytes follow.
func TestSwitchAfterHostdRestart(t *testing.T) {
	e := newEnv(t, 2, "")
	c, s := e.pair(1, 2, 5430)
	settle(t, c, true, 5*time.Second)
	settle(t, s, true, 5*time.Second)
	e.KillHostd()
	if err := e.StartHostd(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "both clients reconnected", func() bool {
		return e.Clients[0].Reconnects() > 0 && e.Clients[1].Reconnects() > 0
	})
	ping := func(what string) guestlib.Stats {
		t.Helper()
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		b := make([]byte, 4)
		_ = s.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(s, b); err != nil || string(b) != "ping" {
			t.Fatalf("%s: read %q, %v\n%s", what, b, err, e.state(c, s))
		}
		return c.Stats()
	}
	ping("after the restart")
	if _, err := e.SetPolicy(stack.PolicyTCP); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "both ends on TCP", func() bool { return !c.Path().Fast && !s.Path().Fast })
	before := ping("on TCP")
	if _, err := e.SetPolicy(""); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "both ends on the rings again", func() bool { return c.Path().Fast && s.Path().Fast })
	eventually(t, 10*time.Second, "the writer on the ring again", func() bool {
		st := ping("back on the rings")
		return st.RingSent > before.RingSent
	})
}
