package integration

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/shm/ring"
)

// newCtlEnv is newEnv with more hostd configuration (a limits block)
// and, with nofile > 0, hostd run under that descriptor limit (prlimit).
func newCtlEnv(t testing.TB, n int, extra string, nofile int) *env {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	bin := hostdBin
	if nofile > 0 {
		testenv.NeedTool(t, "prlimit", "util-linux")
		bin = filepath.Join(t.TempDir(), "hostd-nofile")
		script := fmt.Sprintf("#!/bin/sh\nexec prlimit --nofile=%d:%d %s \"$@\"\n", nofile, nofile, hostdBin)
		if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	e := startEnv(t, "c", stack.Options{Guests: n, HostdBin: bin, Extra: extra})
	t.Cleanup(func() { // runs before startEnv's: listeners first, then the stack
		for _, l := range e.lns {
			l.Close()
		}
	})
	return e
}

// ctlRogue is a hostile guest's control session: raw protocol on a guest's
// socket. Its methods return errors rather than failing the test, since
// hostd closing it is often the point.
type ctlRogue struct {
	c   net.Conn
	buf []byte
}

func dialCtlRogue(sock string) (*ctlRogue, error) {
	c, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		return nil, err
	}
	return &ctlRogue{c: c}, nil
}

func (r *ctlRogue) send(ms ...proto.Msg) error {
	var b []byte
	for _, m := range ms {
		var err error
		if b, err = m.Append(b); err != nil {
			return err
		}
	}
	_ = r.c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	_, err := r.c.Write(b)
	return err
}

// next reads one message, waiting at most d.
func (r *ctlRogue) next(d time.Duration) (proto.Msg, error) {
	_ = r.c.SetReadDeadline(time.Now().Add(d))
	m, buf, err := proto.Read(r.c, r.buf)
	r.buf = buf
	return m, err
}

// verdict reads the answer to an OPEN (READY or TCP), skipping the REGION
// and UNREGION messages that come with pair regions.
func (r *ctlRogue) verdict(d time.Duration) (proto.Msg, error) {
	for {
		m, err := r.next(d)
		if err != nil || m.Type != proto.RegionMsg && m.Type != proto.Unregion {
			return m, err
		}
	}
}

// hello says HELLO and waits for WELCOME.
func (r *ctlRogue) hello() error {
	if err := r.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: 1 << ring.FormatVersion}); err != nil {
		return err
	}
	m, err := r.next(5 * time.Second)
	if err == nil && m.Type != proto.Welcome {
		err = fmt.Errorf("answer to HELLO: %+v", m)
	}
	return err
}

// drain reads and drops everything hostd says until the session ends.
func (r *ctlRogue) drain() {
	for {
		if _, err := r.next(time.Hour); err != nil {
			return
		}
	}
}

// ctlFrames is n copies of m's frame in one buffer.
func ctlFrames(t testing.TB, m proto.Msg, n int) []byte {
	t.Helper()
	f, err := m.Append(nil)
	if err != nil {
		t.Fatal(err)
	}
	return []byte(strings.Repeat(string(f), n))
}

// ctlSteady moves checksummed data from guest a to guest b over one fast-path
// flow, at a modest rate, until the returned stop is called; stop checks
// that all of it arrived intact and that the flow stayed on the fast path.
func (e *env) ctlSteady(t testing.TB, a, b, port int) (stop func()) {
	t.Helper()
	_, stop = e.steady(t, a, b, port, 0)
	return stop
}

// ctlRoundTrip makes one new connection from guest a to guest b's listener
// on port, moves one byte each way, and checks both ends took the fast
// path; it returns how long connect+accept+first byte took.
func (e *env) ctlRoundTrip(t testing.TB, a, b, port int) time.Duration {
	t.Helper()
	d, err := e.ctlTryRoundTrip(a, b, port)
	if err != nil {
		t.Fatalf("honest round trip %d->%d: %v", a, b, err)
	}
	return d
}

func (e *env) ctlTryRoundTrip(a, b, port int) (time.Duration, error) {
	l := e.lns[[2]int{b, port}]
	if l == nil {
		var err error
		if l, err = e.Listen(b, port); err != nil {
			return 0, err
		}
		e.lns[[2]int{b, port}] = l
	}
	acc := make(chan *guestlib.Conn, 1)
	aerr := make(chan error, 1)
	start := time.Now()
	go func() {
		s, err := l.AcceptShunt()
		if err != nil {
			aerr <- err
			return
		}
		acc <- s
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := e.Dial(ctx, a, netip.AddrPortFrom(e.rig.Guests[b-1].Addr, uint16(port)).String())
	if err != nil {
		return 0, fmt.Errorf("dial: %w", err)
	}
	defer c.Close()
	var s *guestlib.Conn
	select {
	case s = <-acc:
	case err := <-aerr:
		return 0, fmt.Errorf("accept: %w", err)
	case <-time.After(10 * time.Second):
		return 0, errors.New("no accept in 10s")
	}
	defer s.Close()
	one := []byte{7}
	if _, err := c.Write(one); err != nil {
		return 0, err
	}
	if _, err := io.ReadFull(s, one); err != nil {
		return 0, err
	}
	d := time.Since(start)
	if _, err := s.Write(one); err != nil {
		return 0, err
	}
	if _, err := io.ReadFull(c, one); err != nil {
		return 0, err
	}
	if !fastSoon(e.t, c, s) {
		return 0, fmt.Errorf("paths %s and %s, want the fast path", c.Path(), s.Path())
	}
	return d, nil
}

// ctlCounters is hostd's counters.
func (e *env) ctlCounters(t testing.TB) map[string]float64 {
	t.Helper()
	var cs map[string]float64
	if err := admin.Call(e.Admin, admin.Request{Cmd: "counters"}, &cs); err != nil {
		t.Fatalf("hostd counters: %v", err)
	}
	return cs
}

// ctlGuestInfo is what `hostd guests` says of guest i, and how long it took.
func (e *env) ctlGuestInfo(t testing.TB, i int) (broker.GuestInfo, time.Duration) {
	t.Helper()
	start := time.Now()
	var gs []broker.GuestInfo
	if err := admin.Call(e.Admin, admin.Request{Cmd: "guests"}, &gs); err != nil {
		t.Fatalf("hostd guests: %v", err)
	}
	took := time.Since(start)
	for _, g := range gs {
		if g.Name == e.rig.Guests[i-1].Name {
			return g, took
		}
	}
	t.Fatalf("hostd guests: no %s in %+v", e.rig.Guests[i-1].Name, gs)
	return broker.GuestInfo{}, 0
}

// ctlNoReconnects checks that the honest guests' sessions were never lost.
func (e *env) ctlNoReconnects(t testing.TB, guests ...int) {
	t.Helper()
	for _, i := range guests {
		if n := e.Clients[i-1].Reconnects(); n != 0 {
			t.Errorf("honest guest %d reconnected %d times: hostd closed its session", i, n)
		}
	}
}
