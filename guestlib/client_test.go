package guestlib

import (
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
)

// These tests run the library against guesttest's scripted hostd: no root,
// no conntrack. Connections are on loopback, which real guests never offer
// to hostd; the tests' clients do (Client.loopback).

// TestMain fails the package if a test leaves a goroutine behind: a
// Client's session goroutines must end with Close.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newClient(t *testing.T, h *guesttest.Hostd, o Options) *Client {
	t.Helper()
	o.Control = h.Control
	o.Region = h.Region
	c, err := NewClient(o)
	if err != nil {
		t.Fatal(err)
	}
	c.loopback = true
	t.Cleanup(func() { c.Close() })
	return c
}

// async runs f in a goroutine; the result arrives on the channel.
func async[T any](f func() T) <-chan T {
	ch := make(chan T, 1)
	go func() { ch <- f() }()
	return ch
}

func await[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(guesttest.Wait):
		t.Fatalf("%s: no result within %v", what, guesttest.Wait)
	}
	var zero T
	return zero
}

// listen starts a guestlib listener on loopback, answering the session's
// HELLO, LISTEN and PING as hostd would.
func listen(t *testing.T, c *Client, h *guesttest.Hostd) (*Listener, *guesttest.Session) {
	t.Helper()
	return listenAfter(t, c, func() *guesttest.Session { return h.Greet(t) })
}

// listenAfter starts a guestlib listener on loopback; greet answers the
// session's HELLO, and LISTEN and PING are answered as hostd would.
func listenAfter(t *testing.T, c *Client, greet func() *guesttest.Session) (*Listener, *guesttest.Session) {
	t.Helper()
	type res struct {
		l   *Listener
		err error
	}
	ch := async(func() res {
		l, err := (&ListenConfig{Client: c}).Listen(context.Background(), "tcp4", "127.0.0.1:0")
		return res{l, err}
	})
	s := greet()
	s.Expect(t, proto.Listen)
	ping := s.Expect(t, proto.Ping)
	s.Send(t, proto.Msg{Type: proto.Pong, Nonce: ping.Nonce})
	r := await(t, ch, "Listen")
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() { r.l.Close() })
	return r.l, s
}

// accepted dials l with plain TCP and returns the server's Conn and the
// passive OPEN it sent.
func accepted(t *testing.T, l *Listener, s *guesttest.Session) (*Conn, net.Conn, proto.Msg) {
	t.Helper()
	peer, err := net.Dial("tcp4", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.Close() })
	conn, err := l.AcceptShunt()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	open := s.Expect(t, proto.Open)
	if open.Role != proto.Passive || open.Local != conn.local {
		t.Fatalf("OPEN = %+v, want passive for %s", open, conn.local)
	}
	return conn, peer, open
}

// fakeActive is the OPEN a peer guest would send for the same connection.
func fakeActive(passive proto.Msg) proto.Msg {
	return proto.Msg{Type: proto.Open, Role: proto.Active, Local: passive.Remote, Remote: passive.Local, ReqID: 99}
}

// verdict pairs the accepted open with a peer's and sends the passive
// side's READY (the verdict for it).
func verdict(t *testing.T, h *guesttest.Hostd, s *guesttest.Session, open proto.Msg) guesttest.Flow {
	t.Helper()
	f := h.Pair(t, fakeActive(open), open)
	s.Send(t, f.B)
	return f
}

// waitFor polls cond (internal state has no event to wait on) for at most
// guesttest.Wait.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(guesttest.Wait)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", guesttest.Wait, what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestHelloRetries(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	done := async(c.ensure)
	s := h.Accept(t)
	s.Expect(t, proto.Hello) // lost, as on a virtio-serial port whose host end just opened
	s.Expect(t, proto.Hello)
	s.Welcome(t)
	if err := await(t, done, "ensure"); err != nil {
		t.Fatalf("ensure after a retried HELLO: %v", err)
	}
}

func TestNoHostdIsTCPAndCheap(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	c.opts.Control = h.Control + ".missing"
	if err := c.ensure(); !errors.Is(err, errNoHostd) {
		t.Fatalf("ensure without hostd = %v, want errNoHostd", err)
	}
	start := time.Now()
	if err := c.ensure(); !errors.Is(err, errNoHostd) || time.Since(start) > time.Second {
		t.Fatalf("second ensure = %v after %v: want errNoHostd at once", err, time.Since(start))
	}
}

// A passive Conn closed before its verdict gives the READY back: hostd
// gets CLOSE, so the slot and rings are freed (they leaked before).
func TestReadyAfterCloseIsGivenBack(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	conn.Close()
	f := verdict(t, h, s, open)
	cl := s.Expect(t, proto.Close)
	if cl.Slot != f.B.Slot || cl.Gen != f.B.Gen || cl.Side != proto.SideB {
		t.Fatalf("CLOSE = %+v, want slot %d gen %d side B", cl, f.B.Slot, f.B.Gen)
	}
}

// A Dial that gave up waiting gives a late READY back.
func TestLateReadyAfterDialTimeout(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{VerdictTimeout: 100 * time.Millisecond})
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type res struct {
		c   *Conn
		err error
	}
	dial := async(func() res {
		conn, err := (&Dialer{Client: c}).DialContext(context.Background(), "tcp4", ln.Addr().String())
		return res{conn, err}
	})
	s := h.Greet(t)
	s.Expect(t, proto.Intent)
	open := s.Expect(t, proto.Open)
	r := await(t, dial, "Dial")
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.c.Close()
	if p := r.c.Path(); p.String() != "tcp(timeout)" {
		t.Fatalf("path = %s, want tcp(timeout)", p)
	}
	f := h.Pair(t, open, proto.Msg{ReqID: 1})
	s.Send(t, f.A)
	if cl := s.Expect(t, proto.Close); cl.Slot != f.A.Slot || cl.Gen != f.A.Gen || cl.Side != proto.SideA {
		t.Fatalf("CLOSE = %+v, want slot %d gen %d side A", cl, f.A.Slot, f.A.Gen)
	}
}

func TestUnmatchedReadyIsGivenBack(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	done := async(c.ensure)
	s := h.Greet(t)
	await(t, done, "ensure")
	f := h.Pair(t, proto.Msg{ReqID: 7}, proto.Msg{ReqID: 8})
	s.Send(t, f.A)
	if cl := s.Expect(t, proto.Close); cl.Slot != f.A.Slot || cl.Gen != f.A.Gen {
		t.Fatalf("CLOSE = %+v, want slot %d gen %d", cl, f.A.Slot, f.A.Gen)
	}
}

// A read deadline set before the verdict bounds the Read that then waits
// on the rings (it only reached the TCP socket before).
func TestReadDeadlineBeforeVerdict(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	if err := conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	verdict(t, h, s, open)
	if p := conn.Path(); !p.Fast {
		t.Fatalf("path = %s, want shunt", p)
	}
	read := async(func() error { _, err := conn.Read(make([]byte, 8)); return err })
	if err := await(t, read, "Read past its deadline"); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read = %v, want a deadline error", err)
	}
}

// The same for a write deadline: the ring fills and Write must give up.
func TestWriteDeadlineBeforeVerdict(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	if err := conn.SetWriteDeadline(time.Now().Add(100 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	verdict(t, h, s, open)
	write := async(func() error { _, err := conn.Write(make([]byte, 1<<20)); return err })
	if err := await(t, write, "Write past its deadline"); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Write = %v, want a deadline error", err)
	}
}

// A deadline that passes while the verdict is awaited ends the wait.
func TestDeadlineWhileAwaitingVerdict(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, _ := accepted(t, l, s)
	_ = conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	read := async(func() error { _, err := conn.Read(make([]byte, 8)); return err })
	if err := await(t, read, "Read"); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read = %v, want a deadline error", err)
	}
}

// An accepted Conn whose verdict never comes settles on TCP after the
// verdict timeout instead of waiting for ever.
func TestPassiveVerdictTimeout(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{VerdictTimeout: 100 * time.Millisecond})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	if p := await(t, async(conn.Path), "Path"); p.String() != "tcp(timeout)" {
		t.Fatalf("path = %s, want tcp(timeout)", p)
	}
	verdict(t, h, s, open)
	s.Expect(t, proto.Close)
}

// After hostd comes back, a new session learns the listeners and flows
// before anything else.
func TestReannounceAfterReconnect(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	f := verdict(t, h, s, open)
	if !conn.Path().Fast {
		t.Fatalf("path = %s, want shunt", conn.Path())
	}
	s.Close() // hostd went away
	s2 := h.Greet(t)
	got := map[proto.Type]proto.Msg{}
	for range 2 {
		m := s2.Next(t)
		got[m.Type] = m
	}
	if m, ok := got[proto.Listen]; !ok || m.Local != l.addr {
		t.Fatalf("re-announced %v, want LISTEN %s", got, l.addr)
	}
	if m, ok := got[proto.Reattach]; !ok || m.Slot != f.B.Slot || m.Gen != f.B.Gen || m.Side != proto.SideB {
		t.Fatalf("re-announced %v, want REATTACH of %d.%d side B", got, f.B.Slot, f.B.Gen)
	}
	if c.Reconnects() != 1 {
		t.Fatalf("reconnects = %d, want 1", c.Reconnects())
	}
}

// A CLOSE made while hostd is away is delivered to the next hostd.
func TestCloseWhileDisconnectedIsDelivered(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	f := verdict(t, h, s, open)
	conn.Path()
	s.Close()
	waitFor(t, "the client to notice hostd went away", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.sess == nil
	})
	conn.Close() // parked until the next hostd
	s2 := h.Greet(t)
	s2.Expect(t, proto.Listen)
	if cl := s2.Expect(t, proto.Close); cl.Slot != f.B.Slot || cl.Gen != f.B.Gen {
		t.Fatalf("CLOSE = %+v, want %d.%d", cl, f.B.Slot, f.B.Gen)
	}
}

// A malformed frame from hostd ends the session: pending verdicts fall to
// TCP (no-hostd) and the client reconnects.
func TestMalformedFromHostd(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, _ := accepted(t, l, s)
	s.Raw(t, []byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0})
	if p := await(t, async(conn.Path), "Path"); p.String() != "tcp(no-hostd)" {
		t.Fatalf("path = %s, want tcp(no-hostd)", p)
	}
	s2 := h.Greet(t)
	s2.Expect(t, proto.Listen)
}

// ERROR no-hostd on a live channel (a new hostd behind a VM's port) makes
// the client say HELLO again on the same channel and re-announce.
func TestRehelloOnSameChannel(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	_, s := listen(t, c, h)
	s.Send(t, proto.Msg{Type: proto.Error, Reason: proto.ReasonNoHostd, Text: "hostd restarted"})
	s.Expect(t, proto.Hello)
	s.Welcome(t)
	s.Expect(t, proto.Listen)
}

// A hostd that stops reading cannot block the library: sends fail or park
// at once, and connections fall back to TCP after their timeout.
func TestDeafHostdBlocksNothing(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{VerdictTimeout: 200 * time.Millisecond})
	done := async(c.ensure)
	h.Greet(t) // and then never read again
	await(t, done, "ensure")
	sent := async(func() error {
		for i := range 100000 {
			if err := c.send(proto.Msg{Type: proto.Kick, Slot: uint32(i)}); errors.Is(err, errQueueFull) {
				return nil
			}
		}
		return errors.New("the queue never filled")
	})
	if err := await(t, sent, "flooding the queue"); err != nil {
		t.Fatal(err)
	}
}

func TestPathStrings(t *testing.T) {
	for _, tc := range []struct {
		p    Path
		want string
	}{{Path{Fast: true}, "shunt"}, {Path{Reason: "policy"}, "tcp(policy)"}} {
		if got := tc.p.String(); got != tc.want {
			t.Errorf("%+v: got %q, want %q", tc.p, got, tc.want)
		}
	}
	if !strings.Contains(errQueueFull.Error(), "hostd") {
		t.Errorf("errQueueFull should name hostd: %v", errQueueFull)
	}
}
