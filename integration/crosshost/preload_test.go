//go:build linux

package crosshost_test

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/edgegen"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestAcrossHostsPreload: the C library across hosts. h2's guest runs the
// edge suite's stream server under the preload library (as shunt-run
// does); h1's guest connects with the Go library. Both send a seeded
// stream and check the other's byte for byte (the server with every
// write and read call, from two threads) while the connection is on the
// relay, while policy flips on each host move it to TCP and back (each a
// RESUME to both libraries: docs/crosshost.md, "Resuming on TCP"), and
// across a fabric cut. Every byte arrives once, in order, on both ends.
//
// It was opt-in while three races of the relayed path made it fail about
// one run in four (a closed guest's stretch that never stopped, a READY
// for a stretch the peer refused whose read ring nobody marked left, and
// a write ring attached before the far reader was); all three are fixed
// (docs/crosshost.md), and it runs in make test.
func TestAcrossHostsPreload(t *testing.T) {
	testenv.NeedTool(t, "make", "make")
	testenv.NeedTool(t, "gcc", "gcc")
	bin := t.TempDir()
	lib, edge := filepath.Join(bin, "libshunt-preload.so"), filepath.Join(bin, "shunt-edge")
	cmd := exec.Command("make", "-s", "-C", "../..", "BIN="+bin, lib, edge)
	cmd.Env = append(os.Environ(), "MAKEFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the preload library and the edge suite: %v\n%s", err, out)
	}
	e := relayPair(t)
	g2 := e.f.Hosts[1].Guests[0]
	const port = 7300
	var srvOut syncOut
	srv := exec.Command(edge, "server", g2.Addr.String(), fmt.Sprint(port))
	srv.Env = append(os.Environ(), "LD_PRELOAD="+lib, "SHUNT_CONTROL="+e.hosts[1].Control(g2), "SHUNT_VERBOSE=1", "SHUNT_STATS=1")
	srv.Stdout, srv.Stderr = &srvOut, &srvOut
	if err := nsrig.Start(g2.NSPath(), srv); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.Process.Kill()
		srv.Wait()
		if t.Failed() {
			t.Logf("C server (tail):\n%s", tail(srvOut.String(), 40))
		}
	})
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf(format+"\nC server (tail):\n%s\n%s", append(args, tail(srvOut.String(), 30), e.flows())...)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var c interface {
		Write([]byte) (int, error)
		Read([]byte) (int, error)
		CloseWrite() error
		Close() error
		SetDeadline(time.Time) error
	}
	var err error
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if c, err = e.hosts[0].Dial(ctx, 1, netip.AddrPortFrom(g2.Addr, port).String()); err == nil {
			break
		}
		if time.Now().After(deadline) {
			fail("dial the C server: %v", err)
		}
	}
	defer c.Close()
	// Paced (both directions, by this end's writes and reads), so that
	// the stream outlasts the flips and the cut: about 16 s. It ends on
	// TCP: the half-closes that end it on a relayed stretch lost the last
	// bytes or hung in 3 runs of 4 (a C end; docs/crosshost.md, "Resuming
	// on TCP"), which is the relays' end-of-stream, not RESUME.
	const seed, size, rate = 41, 256 << 20, 16 << 20 // bytes/s
	pace := func(start time.Time, n int) {
		if ahead := time.Duration(float64(n)/rate*float64(time.Second)) - time.Since(start); ahead > 0 {
			time.Sleep(ahead)
		}
	}
	c.SetDeadline(time.Now().Add(150 * time.Second))
	if _, err := fmt.Fprintf(c, "stream %d %d\n", seed, size); err != nil {
		fail("%v", err)
	}
	var got atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, 2)
	wg.Add(2)
	go func() { // this end's stream (edge_switch.c's direction 0), then FIN
		defer wg.Done()
		g, buf, t0 := edgegen.New(seed, 0), make([]byte, 64<<10), time.Now()
		for sent := 0; sent < size; pace(t0, sent) {
			k := min(len(buf), size-sent)
			g.Fill(buf[:k])
			if _, err := c.Write(buf[:k]); err != nil {
				errs[0] = fmt.Errorf("write at %d: %w", sent, err)
				return
			}
			sent += k
		}
		errs[0] = c.CloseWrite()
	}()
	go func() { // the server's stream (direction 1), checked, then EOF
		defer wg.Done()
		g, buf, want, t0 := edgegen.New(seed, 1), make([]byte, 48<<10), make([]byte, 48<<10), time.Now()
		for {
			pace(t0, int(got.Load()))
			k, err := c.Read(buf)
			g.Fill(want[:k])
			if !bytes.Equal(buf[:k], want[:k]) {
				i := 0
				for buf[i] == want[i] {
					i++
				}
				errs[1] = fmt.Errorf("a wrong byte at %d", got.Load()+int64(i))
				return
			}
			got.Add(int64(k))
			if err != nil {
				if got.Load() != size {
					errs[1] = fmt.Errorf("read at %d: %w", got.Load(), err)
				}
				return
			}
		}
	}()
	waitGot := func(n int64) {
		for deadline := time.Now().Add(30 * time.Second); got.Load() < n; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				fail("the server's stream stalled at %d bytes", got.Load())
			}
		}
	}
	waitGot(2 << 20)
	e.relayed(port, 10*time.Second)
	for i := range 4 { // policy flips, alternating hosts
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
	e.relayed(port, 10*time.Second)
	waitGot(got.Load() + 4<<20)
	if err := e.f.SetLink(false); err != nil { // a fabric cut
		t.Error(err)
	}
	time.Sleep(2 * time.Second)
	if err := e.f.SetLink(true); err != nil {
		t.Error(err)
	}
	if n := got.Load(); n >= size {
		fail("the stream ended before the cut did (%d bytes): it tested nothing; raise size or lower rate", n)
	}
	e.relayed(port, 20*time.Second)
	waitGot(got.Load() + 4<<20)
	for _, k := range []int{1, 0} { // the end on TCP (see above), on both hosts
		if _, err := e.hosts[k].SetPolicy(stack.PolicyTCP); err != nil {
			t.Error(err)
		}
	}
	e.within(10*time.Second, "the connection on TCP for its end", func() bool {
		a, _ := e.connOn(0, port)
		b, _ := e.connOn(1, port)
		return a.Path == "tcp" && b.Path == "tcp"
	})
	if n := got.Load(); n >= size {
		fail("the stream ended before it was moved to TCP (%d bytes): raise size or lower rate", n)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(120 * time.Second):
		c.Close()
		<-done
		fail("the streams did not end within 120 s (%d bytes of the server's)", got.Load())
	}
	if errs[0] != nil || errs[1] != nil {
		fail("this end: %v; %v", errs[0], errs[1])
	}
	for deadline := time.Now().Add(20 * time.Second); !strings.Contains(srvOut.String(), "stream-server"); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			fail("no verdict from the C server")
		}
	}
	if !strings.Contains(srvOut.String(), "PASS stream-server") {
		fail("the C server's verdict")
	}
	t.Logf("C server: %s", strings.TrimSpace(tail(srvOut.String(), 2)))
}

// syncOut is a process's output, read while it runs.
type syncOut struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncOut) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncOut) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
