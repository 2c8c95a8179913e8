package server_test

import (
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/server"
	"github.com/shuntnet/shunt/internal/proto"
)

// counter is a metric's value, by name and (optionally) one label value.
func (w *world) counter(t *testing.T, name, label string) float64 {
	t.Helper()
	mfs, err := w.m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label == "" || len(m.GetLabel()) > 0 && m.GetLabel()[0].GetValue() == label {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no metric %s{%s}", name, label)
	return 0
}

// until polls cond every 5 ms until it holds, for at most wait.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, wait)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSessionLimit: a guest's sessions beyond SessionsPerGuest (before
// HELLO too) get ERROR(control-limit) and are closed, counted; its other
// sessions and other guests are served; closing one makes room.
func TestSessionLimit(t *testing.T) {
	w := newWorldOpts(t, server.Options{SessionsPerGuest: 2}, broker.Options{})
	other := w.hello(t, w.g2)
	s1 := w.hello(t, w.g1)
	s2 := w.dial(t, w.g1) // never says HELLO: counts all the same
	for i := range 3 {
		s := w.dial(t, w.g1)
		e := s.expect(proto.Error, proto.ReasonControlLimit)
		if !strings.Contains(e.Text, "sessions_per_guest") {
			t.Fatalf("ERROR text %q, want it to name the limit", e.Text)
		}
		s.closed()
		if got := w.counter(t, "shunt_control_limited_total", "sessions"); got != float64(i+1) {
			t.Fatalf("limited sessions %v, want %d", got, i+1)
		}
	}
	s1.ping(1)
	other.ping(2)
	s2.c.Close()
	until(t, "a session over the limit accepted after one closed", func() bool {
		s := w.dial(t, w.g1)
		defer s.c.Close()
		_, _ = s.c.Write(frame(t, proto.Msg{Type: proto.Hello, PID: 1, Formats: formats})) // a refused one may be closed already
		m, _, err := proto.Read(s.c, nil)
		return err == nil && m.Type == proto.Welcome
	})
}

// TestKeepalive: hostd PINGs a quiet session; a guest that answers stays
// for many silence bounds, one that does not is closed after Silence,
// counted, and detached from the broker (its flows go); other sessions are
// served throughout.
func TestKeepalive(t *testing.T) {
	const keepalive, silence = 20 * time.Millisecond, 300 * time.Millisecond
	w := newWorldOpts(t, server.Options{Keepalive: keepalive, Silence: silence}, broker.Options{})
	answers, mute := w.hello(t, w.g1), w.hello(t, w.g1)
	done := make(chan int, 1)
	go func() {
		n := 0
		// Sent even when next fails (t.Fatalf ends this goroutine), so
		// the test never waits on it for ever.
		defer func() { done <- n }()
		for start := time.Now(); time.Since(start) < 3*silence; n++ {
			m := answers.next()
			if m.Type != proto.Ping {
				t.Errorf("an answering guest got %+v, want only keepalive PINGs", m)
				break
			}
			answers.send(proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
		}
	}()
	pings := 0
	for {
		m, _, err := proto.Read(mute.c, nil)
		if err != nil {
			break // closed: EOF
		}
		if m.Type != proto.Ping {
			t.Fatalf("a mute guest got %+v, want only PINGs before the close", m)
		}
		pings++
	}
	if pings < 2 {
		t.Fatalf("the mute guest got %d PINGs before the close, want several", pings)
	}
	if n := <-done; n < 5 {
		t.Fatalf("the answering guest answered %d PINGs in %s, want several", n, 3*silence)
	}
	answers.ping(1)
	w.hello(t, w.g2).ping(2)
	if got := w.counter(t, "shunt_control_closed_total", "silent"); got != 1 {
		t.Fatalf("closed silent %v, want 1", got)
	}
	until(t, "the silent session detached", func() bool { return w.b.Counts().Sessions == 2 })
}

// TestReadDeadlines: a session that says no HELLO, or that stops in the
// middle of a frame, is closed after Silence; others are served.
func TestReadDeadlines(t *testing.T) {
	w := newWorldOpts(t, server.Options{Keepalive: 50 * time.Millisecond, Silence: 200 * time.Millisecond}, broker.Options{})
	noHello := w.dial(t, w.g1)
	half := w.hello(t, w.g1)
	half.raw(frame(t, proto.Msg{Type: proto.Ping, Nonce: 1})[:5])
	noHello.closed()
	for {
		m, _, err := proto.Read(half.c, nil)
		if err != nil {
			break
		}
		if m.Type != proto.Ping {
			t.Fatalf("got %+v before the close, want only keepalive PINGs", m)
		}
	}
	if got := w.counter(t, "shunt_control_closed_total", "silent"); got != 2 {
		t.Fatalf("closed silent %v, want 2", got)
	}
	w.hello(t, w.g2).ping(2)
	if got := w.malformed(t); got != 0 {
		t.Fatalf("malformed %v, want 0: silence is not malformed", got)
	}
}

// TestNotReading: a guest that writes but never reads (before HELLO, and
// after) loses its session only: hostd never waits on it.
func TestNotReading(t *testing.T) {
	for _, hello := range []bool{false, true} {
		w := newWorldOpts(t, server.Options{Silence: 300 * time.Millisecond}, broker.Options{})
		var s *guest
		if hello {
			s = w.hello(t, w.g1)
		} else {
			s = w.dial(t, w.g1)
		}
		ping := frame(t, proto.Msg{Type: proto.Ping, Nonce: 1})
		flood := []byte(strings.Repeat(string(ping), 512))
		_ = s.c.SetWriteDeadline(time.Now().Add(wait))
		for {
			if _, err := s.c.Write(flood); err != nil {
				break // hostd closed it
			}
		}
		w.hello(t, w.g2).ping(2)
		if got := w.counter(t, "shunt_control_closed_total", "not-reading"); got != 1 {
			t.Fatalf("after HELLO %v: closed not-reading %v, want 1", hello, got)
		}
	}
}

// TestKickFlood: a flow's peer that floods KICKs at a guest that does not
// read meanwhile cannot fill its queue: the KICKs for one flow side merge
// into one, the victim's session stays, its flow stays ready.
func TestKickFlood(t *testing.T) {
	w := newWorld(t)
	a, p := w.hello(t, w.g1), w.hello(t, w.g2)
	ra, _ := w.pair(t, a, p)
	kick := frame(t, proto.Msg{Type: proto.Kick, Slot: ra.Slot, Gen: ra.Gen, Side: proto.SideB})
	flood := []byte(strings.Repeat(string(kick), 1000))
	for range 20 { // 20,000 KICKs, while p reads nothing
		a.raw(flood)
	}
	a.ping(1) // a's session is served in order: every KICK was relayed
	p.send(proto.Msg{Type: proto.Ping, Nonce: 2})
	kicks := 0
	for {
		m := p.next()
		if m.Type == proto.Pong {
			break
		}
		if m.Type != proto.Kick || m.Slot != ra.Slot {
			t.Fatalf("victim got %+v, want KICKs for slot %d and its PONG", m, ra.Slot)
		}
		kicks++
	}
	// (One KICK may still follow the PONG: the writer takes the KICK lane
	// and the queue in either order.)
	if merged := w.counter(t, "shunt_control_kicks_merged_total", ""); merged == 0 || kicks+int(merged) > 20000 || kicks+int(merged) < 19999 {
		t.Fatalf("victim got %d KICKs and %v were merged, want some merged and 20000 in all", kicks, merged)
	}
	if fl := w.b.Flows(); len(fl) != 1 || fl[0].State != "ready" || fl[0].Attached != "ab" {
		t.Fatalf("flows %+v after the flood, want the flow ready with both sides", fl)
	}
	if got := w.counter(t, "shunt_control_closed_total", "not-reading"); got != 0 {
		t.Fatalf("closed not-reading %v, want 0", got)
	}
}

// TestSessionRate: a guest's new sessions beyond SessionRate a second wait
// in its socket's backlog (hostd spends nothing on them meanwhile); they
// are all served in the end, and another guest's are not held up.
func TestSessionRate(t *testing.T) {
	const rate, n = 20, 40
	w := newWorldOpts(t, server.Options{SessionRate: rate}, broker.Options{})
	start := time.Now()
	var ss []*guest
	for range n {
		s := w.dial(t, w.g1)
		s.send(proto.Msg{Type: proto.Hello, PID: 1, Formats: formats})
		ss = append(ss, s)
	}
	w.hello(t, w.g2).ping(1) // served while the first guest's wait
	for _, s := range ss {
		s.expect(proto.Welcome, proto.ReasonNone)
	}
	// rate sessions come at once, the rest at rate a second.
	if took, least := time.Since(start), time.Duration(n-rate)*time.Second/rate; took < least*9/10 {
		t.Errorf("%d sessions served in %s, want at least %s at %d a second", n, took, least, rate)
	}
}
