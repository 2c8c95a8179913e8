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
	"github.com/shuntnet/shunt/shm/ring"
)

// These tests run the library against guesttest's scripted hostd: no root,
// no conntrack. Connections are on loopback, which real guests never offer
// to hostd; the tests' clients do (Client.loopback).

// TestMain fails the package if a test leaves a goroutine behind: a
// Client's session goroutines must end with Close.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newClient(t testing.TB, h *guesttest.Hostd, o Options) *Client {
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

func await[T any](t testing.TB, ch <-chan T, what string) T {
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
// passive OPEN it sent (the accept itself waits for nothing).
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
// side's READY.
func verdict(t *testing.T, h *guesttest.Hostd, s *guesttest.Session, open proto.Msg) guesttest.Flow {
	t.Helper()
	f := h.Pair(t, fakeActive(open), open)
	s.Send(t, f.B)
	return f
}

// waitFor polls cond (internal state has no event to wait on) for at most
// guesttest.Wait.
func waitFor(t testing.TB, what string, cond func() bool) {
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
	if m := s.Expect(t, proto.Hello); m.Formats != 1<<ring.FormatVersion|proto.CapResume {
		t.Fatalf("HELLO formats %#x, want %#x (format 2 and CapResume)", m.Formats, 1<<ring.FormatVersion|proto.CapResume)
	}
	s.Welcome(t)
	if err := await(t, done, "ensure"); err != nil {
		t.Fatalf("ensure after a retried HELLO: %v", err)
	}
}

// Without hostd, a Dial is the kernel's connect and nothing more: on TCP
// at once, reason no-hostd.
func TestNoHostdIsTCPAndCheap(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	c.opts.Control = h.Control + ".missing"
	if err := c.ensure(); !errors.Is(err, errNoHostd) {
		t.Fatalf("ensure without hostd = %v, want errNoHostd", err)
	}
	ln := tcpListener(t)
	start := time.Now()
	conn, err := (&Dialer{Client: c}).Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if p := conn.Path(); p.String() != "tcp(no-hostd)" || time.Since(start) > time.Second {
		t.Fatalf("path %s after %v: want tcp(no-hostd) at once", p, time.Since(start))
	}
}

// Dial returns on TCP before hostd answers: the OPEN goes out with a
// request id, with no INTENT before it, and nothing waits for the answer.
func TestDialDoesNotWait(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	done := async(c.ensure)
	s := h.Greet(t)
	await(t, done, "ensure")
	ln := tcpListener(t)
	conn, err := (&Dialer{Client: c}).Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if p := conn.Path(); p.String() != "tcp(pending)" {
		t.Fatalf("path %s, want tcp(pending)", p)
	}
	open := s.Expect(t, proto.Open)
	if open.ReqID == 0 || open.ReqID != conn.req || open.Role != proto.Active || open.Local != conn.local {
		t.Fatalf("OPEN %+v, want active, request %d, local %s", open, conn.req, conn.local)
	}
	s.Send(t, proto.Msg{Type: proto.TCP, ReqID: open.ReqID, Reason: proto.ReasonPolicy})
	if p := conn.WaitPath(ctxWait(t)); p.String() != "tcp(policy)" {
		t.Fatalf("path after TCP(policy) = %s", p)
	}
}

// A passive Conn closed before hostd answered: CLOSE names its request,
// and a READY that comes after is given back with CLOSE for its rings.
func TestReadyAfterCloseIsGivenBack(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	conn.Close()
	if cl := s.Expect(t, proto.Close); cl.ReqID != open.ReqID || cl.Slot != 0 || cl.Gen != 0 {
		t.Fatalf("CLOSE = %+v, want request %d without rings", cl, open.ReqID)
	}
	f := verdict(t, h, s, open)
	cl := s.Expect(t, proto.Close)
	if cl.Slot != f.B.Slot || cl.Gen != f.B.Gen || cl.Side != proto.SideB {
		t.Fatalf("CLOSE = %+v, want slot %d gen %d side B", cl, f.B.Slot, f.B.Gen)
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

// A second READY while the first rings are held is given back with LEFT:
// the connection lives on.
func TestReadyWhileHeldIsLeft(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	verdict(t, h, s, open)
	f2 := verdict(t, h, s, open)
	if m := s.Expect(t, proto.Left); m.Slot != f2.B.Slot || m.Gen != f2.B.Gen || m.ReqID != open.ReqID {
		t.Fatalf("LEFT = %+v, want %d.%d", m, f2.B.Slot, f2.B.Gen)
	}
	if !conn.Path().Fast {
		t.Fatalf("path %s, want shunt", conn.Path())
	}
}

// A read deadline set before READY bounds a Read that then waits on the
// rings.
func TestReadDeadlineAcrossReady(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	if err := conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	verdict(t, h, s, open)
	waitFor(t, "READY", func() bool { return conn.Path().Fast })
	read := async(func() error { _, err := conn.Read(make([]byte, 8)); return err })
	if err := await(t, read, "Read past its deadline"); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read = %v, want a deadline error", err)
	}
}

// The same for a write deadline: nobody reads, and Write must give up.
func TestWriteDeadlineAcrossReady(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	if err := conn.SetWriteDeadline(time.Now().Add(100 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	verdict(t, h, s, open)
	write := async(func() error { _, err := conn.Write(make([]byte, 16<<20)); return err })
	if err := await(t, write, "Write past its deadline"); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Write = %v, want a deadline error", err)
	}
}

// After hostd comes back, a new session learns the listeners and the
// connections before anything else: REATTACH for one on rings, OPEN with
// the same request id for one on TCP.
func TestReannounceAfterReconnect(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	f := verdict(t, h, s, open)
	waitFor(t, "READY", func() bool { return conn.Path().Fast })
	conn2, _, open2 := accepted(t, l, s)
	s.Close() // hostd went away
	s2 := h.Greet(t)
	got := map[proto.Type]proto.Msg{}
	for range 3 {
		m := s2.Next(t)
		got[m.Type] = m
	}
	if m, ok := got[proto.Listen]; !ok || m.Local != l.addr {
		t.Fatalf("re-announced %v, want LISTEN %s", got, l.addr)
	}
	if m, ok := got[proto.Reattach]; !ok || m.Slot != f.B.Slot || m.Gen != f.B.Gen || m.Side != proto.SideB || m.ReqID != open.ReqID {
		t.Fatalf("re-announced %v, want REATTACH of %d.%d side B", got, f.B.Slot, f.B.Gen)
	}
	if m, ok := got[proto.Open]; !ok || m.ReqID != open2.ReqID || m.Local != conn2.local || m.Role != proto.Passive {
		t.Fatalf("re-announced %v, want OPEN of request %d", got, open2.ReqID)
	}
	if c.Reconnects() != 1 {
		t.Fatalf("reconnects = %d, want 1", c.Reconnects())
	}
	if !conn.Path().Fast {
		t.Fatalf("path %s after the reconnect, want shunt (flows keep their path)", conn.Path())
	}
	// The new hostd DOWNs the adopted flow, by the flow alone (request
	// id 0): the connection leaves it and says LEFT with its request id.
	down := guesttest.Down(f.B, proto.ReasonPeerGone)
	down.ReqID = 0
	s2.Send(t, down)
	if m := s2.Expect(t, proto.Left); m.Slot != f.B.Slot || m.ReqID != open.ReqID {
		t.Fatalf("LEFT %+v, want %d.%d of request %d", m, f.B.Slot, f.B.Gen, open.ReqID)
	}
}

// A CLOSE made while hostd is away is delivered to the next hostd.
func TestCloseWhileDisconnectedIsDelivered(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, open := accepted(t, l, s)
	f := verdict(t, h, s, open)
	waitFor(t, "READY", func() bool { return conn.Path().Fast })
	s.Close()
	waitFor(t, "the client to notice hostd went away", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.sess == nil
	})
	conn.Close() // parked until the next hostd
	s2 := h.Greet(t)
	s2.Expect(t, proto.Listen)
	if cl := s2.Expect(t, proto.Close); cl.Slot != f.B.Slot || cl.Gen != f.B.Gen || cl.ReqID != open.ReqID {
		t.Fatalf("CLOSE = %+v, want %d.%d of request %d", cl, f.B.Slot, f.B.Gen, open.ReqID)
	}
}

// A malformed frame from hostd ends the session: connections keep their
// path (TCP, now for no-hostd) and the client reconnects.
func TestMalformedFromHostd(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	l, s := listen(t, c, h)
	conn, _, _ := accepted(t, l, s)
	s.Raw(t, []byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0})
	waitFor(t, "tcp(no-hostd)", func() bool { return conn.Path().String() == "tcp(no-hostd)" })
	s2 := h.Greet(t)
	s2.Expect(t, proto.Listen)
}

// An older hostd (a version-2 WELCOME) keeps connections on TCP with
// reason version, and the client tries again later.
func TestOlderHostdIsVersion(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
	done := async(c.ensure)
	s := h.Accept(t)
	s.Expect(t, proto.Hello)
	s.Send(t, proto.Msg{Version: 2, Type: proto.Welcome, GuestID: 1})
	if err := await(t, done, "ensure"); !errors.Is(err, proto.ErrVersion) {
		t.Fatalf("ensure = %v, want ErrVersion", err)
	}
	conn, err := (&Dialer{Client: c}).Dial("tcp4", tcpListener(t).Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if p := conn.Path(); p.String() != "tcp(version)" {
		t.Fatalf("path %s, want tcp(version)", p)
	}
	s2 := h.Greet(t) // tried again in the background
	if m := s2.Expect(t, proto.Open); m.ReqID != conn.req {
		t.Fatalf("OPEN %+v, want request %d", m, conn.req)
	}
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
// at once.
func TestDeafHostdBlocksNothing(t *testing.T) {
	h := guesttest.Start(t)
	c := newClient(t, h, Options{})
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
	conn, err := (&Dialer{Client: c}).Dial("tcp4", tcpListener(t).Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	conn.Close()
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

// tcpListener is a plain kernel listener that accepts and holds
// connections until the test ends.
func tcpListener(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var held []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		for _, c := range held {
			c.Close()
		}
	})
	return ln
}

func ctxWait(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), guesttest.Wait)
	t.Cleanup(cancel)
	return ctx
}
