//go:build linux

package crosshost_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
)

// relayPair is two peered hosts with one guest each, both hostds running,
// each allowing the other all of its guests' prefixes, channels up and
// announcements accepted.
func relayPair(t testing.TB) *pairEnv { return relayPairNetns(t, false) }

// relayPairNetns is relayPair, with the guests' namespaces in hostd.hcl
// if netns (for programs that drop privileges; not for in-process clients).
func relayPairNetns(t testing.TB, netns bool) *pairEnv {
	e := newPairNetns(t, 1, [2][]string{{"10.78.0.0/16", "fd00:78::/32"}, {"10.77.0.0/16", "fd00:77::/32"}}, [2]bool{true, true}, netns)
	e.within(10*time.Second, "both channels up, both announcements accepted", func() bool {
		a, b := e.peersOf(0), e.peersOf(1)
		return state(a) == peers.StateUp && state(b) == peers.StateUp && a[0].Announced >= 1 && b[0].Announced >= 1
	})
	return e
}

// echoOn serves an echo on host k's guest (guestlib, port) until the test ends.
func (e *pairEnv) echoOn(k, port int) {
	ln, err := e.hosts[k].Listen(1, port)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			ec := &echoConn{c: c, host: k + 1}
			e.echoMu.Lock()
			e.echoed = append(e.echoed, ec)
			e.echoMu.Unlock()
			go func() {
				_, ec.err = io.Copy(c, c)
				ec.done.Store(true)
				c.Close()
			}()
		}
	}()
}

// connOn is host k's record of the connection on port, or its flows.
func (e *pairEnv) connOn(k, port int) (broker.FlowInfo, bool) {
	f, ok, err := e.hosts[k].ConnOn(port)
	if err != nil {
		e.t.Logf("h%d flows: %v", k+1, err)
	}
	return f, ok
}

// libraries is both guest libraries' side of a failed stream: the
// client's counters (c) and each echo connection's, with how its copy
// ended, so that a failure says which end held what.
func (e *pairEnv) libraries(c net.Conn) string {
	type stats interface{ Stats() guestlib.Stats }
	var b strings.Builder
	if s, ok := c.(stats); ok {
		fmt.Fprintf(&b, "client %s: %+v\n", c.LocalAddr(), s.Stats())
	}
	e.echoMu.Lock()
	defer e.echoMu.Unlock()
	for _, ec := range e.echoed {
		fmt.Fprintf(&b, "h%d echo %s (done %v, %v)", ec.host, ec.c.RemoteAddr(), ec.done.Load(), func() error {
			if ec.done.Load() {
				return ec.err
			}
			return nil
		}())
		if s, ok := ec.c.(stats); ok {
			fmt.Fprintf(&b, ": %+v", s.Stats())
		}
		b.WriteByte('\n')
	}
	return b.String()
}

func (e *pairEnv) flows() string {
	var b strings.Builder
	for k := range 2 {
		fl, err := e.hosts[k].Conns()
		fmt.Fprintf(&b, "h%d flows (%v):", k+1, err)
		for _, f := range fl {
			fmt.Fprintf(&b, "\n  %s %s %s->%s %s via=%q reason=%s switches=%d ab=%d ba=%d", f.Conn, f.Name, f.Src, f.Dst, f.Path, f.Via, f.Reason, f.Switches, f.RingsAB, f.RingsBA)
		}
		b.WriteString("\n")
		for _, p := range e.peersOf(k) {
			fmt.Fprintf(&b, "h%d peer %s: state %s relay %+v\n", k+1, p.Name, p.State, p.Relay)
		}
		fmt.Fprintf(&b, "h%d hostd log (tail):\n%s\n", k+1, tail(e.hosts[k].Log(), 25))
	}
	return b.String()
}

// relayed waits until both hosts have the connection on port on the
// rings through the relay.
func (e *pairEnv) relayed(port int, d time.Duration) {
	e.t.Helper()
	e.relayedNudged(e.t, port, d, nil)
}

// relayedNudged is relayed for test t, calling nudge (if set) every
// half second meanwhile: an idle connection shows no packets past either
// host's filter, which its return to the rings waits for.
func (e *pairEnv) relayedNudged(t testing.TB, port int, d time.Duration, nudge func()) {
	t.Helper()
	deadline := time.Now().Add(d)
	for last := time.Now(); ; time.Sleep(50 * time.Millisecond) {
		a, okA := e.connOn(0, port)
		b, okB := e.connOn(1, port)
		if okA && okB && a.Path == "rings" && b.Path == "rings" && a.Via == "relay h2" && b.Via == "relay h1" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the connection on port %d is not on the relay within %s\n%s", port, d, e.flows())
		}
		if nudge != nil && time.Since(last) > 500*time.Millisecond {
			nudge()
			last = time.Now()
		}
	}
}

// stream sends n seeded bytes over c in pieces while reading the echo,
// and checks what came back; it fails after d with both hosts' flows.
// During it, during() runs (path changes); its bytes are checked whole.
func (e *pairEnv) stream(c net.Conn, seed uint64, n int, d time.Duration, during func(progress *atomic.Int64)) {
	e.t.Helper()
	var got atomic.Int64
	done := make(chan error, 2)
	c.SetDeadline(time.Now().Add(d))
	go func() {
		rng := rand.New(rand.NewPCG(seed, 7))
		buf := make([]byte, 64<<10)
		for sent := 0; sent < n; {
			k := min(len(buf), n-sent)
			for i := range k {
				buf[i] = byte(rng.Uint32())
			}
			if _, err := c.Write(buf[:k]); err != nil {
				done <- fmt.Errorf("write at %d: %w", sent, err)
				return
			}
			sent += k
		}
		done <- nil
	}()
	go func() {
		rng := rand.New(rand.NewPCG(seed, 7))
		buf, want := make([]byte, 48<<10), make([]byte, 48<<10)
		for int(got.Load()) < n {
			k, err := c.Read(buf)
			for i := range k {
				want[i] = byte(rng.Uint32())
			}
			if !bytes.Equal(buf[:k], want[:k]) {
				done <- fmt.Errorf("the bytes echoed at %d differ from those sent", got.Load())
				return
			}
			if got.Add(int64(k)); err != nil {
				done <- fmt.Errorf("read at %d: %w", got.Load(), err)
				return
			}
		}
		done <- nil
	}()
	if during != nil {
		during(&got)
	}
	for range 2 {
		if err := <-done; err != nil {
			e.t.Fatalf("stream of %d bytes (%d back): %v\n%s\n%s", n, got.Load(), err, e.flows(), e.libraries(c))
		}
	}
}

// TestAcrossHostsRelay: a guestlib connection from h1's guest to h2's
// guest goes onto the rings through both hosts' relays (`hostd flows`
// shows it via "relay PEER" on both hosts, and its rings carried bytes);
// seeded bytes echo intact both ways; then policy flips on each host
// move it to TCP and back mid-stream, and a fabric cut mid-stream stops
// it and it resumes, all with no byte lost or duplicated.
func TestAcrossHostsRelay(t *testing.T) {
	e := relayPair(t)
	g2 := e.f.Hosts[1].Guests[0]
	e.echoOn(1, 7100)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := e.hosts[0].Dial(ctx, 1, netip.AddrPortFrom(g2.Addr, 7100).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	roundTrip(t, c, 1, 1<<20)
	e.relayed(7100, 10*time.Second)
	e.stream(c, 2, 16<<20, 30*time.Second, nil)
	if a, _ := e.connOn(0, 7100); a.RingsAB == 0 || a.RingsBA == 0 {
		t.Fatalf("the relayed rings carried nothing: %+v\n%s", a, e.flows())
	}
	// hostd is built without -tags rdma: neither host offers RDMA, and
	// both agreed on the TCP link (relay.NegotiateRDMA, docs/rdma.md).
	for k := range 2 {
		if p := e.peersOf(k); len(p) != 1 || p[0].Relay == nil || p[0].Relay.Link != "up (tcp)" {
			var rl any = p
			if len(p) == 1 && p[0].Relay != nil {
				rl = *p[0].Relay
			}
			t.Fatalf("h%d's relay link: %+v, want up (tcp)", k+1, rl)
		}
	}

	t.Run("policy", func(t *testing.T) {
		e.stream(c, 3, 48<<20, 60*time.Second, func(got *atomic.Int64) {
			for i := range 4 {
				k := i % 2
				if _, err := e.hosts[k].SetPolicy(stack.PolicyTCP); err != nil {
					t.Error(err)
				}
				time.Sleep(300 * time.Millisecond)
				if _, err := e.hosts[k].SetPolicy(""); err != nil {
					t.Error(err)
				}
				time.Sleep(300 * time.Millisecond)
			}
		})
		e.relayed(7100, 10*time.Second)
	})

	t.Run("linkcut", func(t *testing.T) {
		e.stream(c, 4, 48<<20, 60*time.Second, func(got *atomic.Int64) {
			for got.Load() < 4<<20 {
				time.Sleep(10 * time.Millisecond)
			}
			if err := e.f.SetLink(false); err != nil {
				t.Error(err)
			}
			time.Sleep(2 * time.Second)
			if err := e.f.SetLink(true); err != nil {
				t.Error(err)
			}
		})
		e.relayed(7100, 20*time.Second)
	})

	t.Run("drop", func(t *testing.T) {
		// A DROP of the guests' port in either host's forward chain stops
		// the connection as it stops kernel TCP; removed, it goes on.
		for k := range 2 {
			g := e.f.Hosts[1].Guests[0]
			e.stream(c, uint64(5+k), 32<<20, 60*time.Second, func(got *atomic.Int64) {
				for got.Load() < 4<<20 {
					time.Sleep(10 * time.Millisecond)
				}
				// First in the forward path, before the rig's "established
				// accept": an operator's DROP that stops a live connection.
				rule := fmt.Sprintf("add table inet xdrop; add chain inet xdrop guard { type filter hook forward priority -10; }; add rule inet xdrop guard ip daddr %s tcp dport 7100 drop", g.Addr)
				if out, err := nsrig.Run(e.f.Hosts[k].HostNSPath(), "nft", rule); err != nil {
					t.Errorf("%v: %s", err, out)
				}
				deadline := time.Now().Add(15 * time.Second)
				for {
					f, _ := e.connOn(k, 7100)
					before := got.Load()
					time.Sleep(1500 * time.Millisecond)
					if f.Path == "tcp" && got.Load() == before {
						break // off the relay, and nothing crosses
					}
					if time.Now().After(deadline) {
						t.Errorf("h%d: bytes still cross %s after a DROP in its forward chain\n%s", k+1, time.Since(deadline.Add(-15*time.Second)), e.flows())
						break
					}
				}
				if out, err := nsrig.Run(e.f.Hosts[k].HostNSPath(), "nft", "delete table inet xdrop"); err != nil {
					t.Errorf("%v: %s", err, out)
				}
			})
			// The stream may have ended on TCP before either host saw
			// packets past its filter again: small echoes meanwhile, as a
			// live application's traffic.
			seed := uint64(50 + 10*k)
			e.relayedNudged(t, 7100, 60*time.Second, func() { seed++; roundTrip(t, c, seed, 512) })
		}
	})
}

// TestAcrossHostsHostdKilled: SIGKILL of each host's hostd in turn (and
// with it that host's relay) mid-stream, then a new hostd. The new hostd
// adopts the relay pair region the dead one left, the surviving host's
// stop names the connection by its tuple, and both guests resume on TCP
// at exact offsets (docs/crosshost.md, "A SIGKILLed hostd"): the seeded
// stream echoed both ways comes through whole, with no error at either
// end, and the connection returns to the relay.
func TestAcrossHostsHostdKilled(t *testing.T) {
	e := relayPair(t)
	g2 := e.f.Hosts[1].Guests[0]
	e.echoOn(1, 7200)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := e.hosts[0].Dial(ctx, 1, netip.AddrPortFrom(g2.Addr, 7200).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	roundTrip(t, c, 1, 1<<20)
	e.relayed(7200, 10*time.Second)

	for i, k := range []int{1, 0} { // h2's hostd, then h1's
		e.stream(c, uint64(2+i), 128<<20, 90*time.Second, func(got *atomic.Int64) {
			deadline := time.Now().Add(30 * time.Second)
			for got.Load() < 8<<20 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			at := got.Load()
			e.hosts[k].KillHostd()
			if at >= 128<<20 {
				t.Errorf("the stream had ended before h%d's hostd was killed", k+1)
			}
			t.Logf("h%d's hostd killed %d MiB into the stream", k+1, at>>20)
			time.Sleep(500 * time.Millisecond)
			if err := e.hosts[k].StartHostd(); err != nil {
				t.Error(err)
			}
		})
		e.within(20*time.Second, "both channels up again", func() bool {
			return state(e.peersOf(0)) == peers.StateUp && state(e.peersOf(1)) == peers.StateUp
		})
		// Back on the relay: the restarted host's record of the
		// connection is the adopted one.
		seed := uint64(40 + 10*i)
		e.relayedNudged(t, 7200, 60*time.Second, func() { seed++; roundTrip(t, c, seed, 512) })
	}
	e.stream(c, 4, 8<<20, 30*time.Second, nil)

	// A new connection goes onto the relay too (its own deadline: the
	// first one's passed during the kills).
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	c2, err := e.hosts[0].Dial(ctx2, 1, netip.AddrPortFrom(g2.Addr, 7200).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	roundTrip(t, c2, 5, 1<<20)
	e.relayed(7200, 20*time.Second)
}

// TestAcrossHostsHostdRestart: h2's hostd stopped gracefully (SIGTERM)
// mid-stream and started again: its relayed connection resumes on TCP
// with no byte lost (the stretch's stop is exchanged before hostd
// exits), and goes back onto the relay once the new hostd pairs it again
// (its guest's library re-announces the connection; h1 claims it anew).
func TestAcrossHostsHostdRestart(t *testing.T) {
	e := relayPair(t)
	g2 := e.f.Hosts[1].Guests[0]
	e.echoOn(1, 7500)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := e.hosts[0].Dial(ctx, 1, netip.AddrPortFrom(g2.Addr, 7500).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	roundTrip(t, c, 1, 1<<20)
	e.relayed(7500, 10*time.Second)
	e.stream(c, 2, 48<<20, 60*time.Second, func(got *atomic.Int64) {
		for got.Load() < 4<<20 {
			time.Sleep(10 * time.Millisecond)
		}
		e.hosts[1].StopHostd()
		time.Sleep(time.Second)
		if err := e.hosts[1].StartHostd(); err != nil {
			t.Error(err)
		}
	})
	e.relayed(7500, 30*time.Second)
	e.stream(c, 3, 8<<20, 30*time.Second, nil)
}
