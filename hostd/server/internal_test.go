package server

import (
	"fmt"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

// emfileListener fails its first n Accepts with EMFILE, as a process out
// of descriptors does, then blocks until closed; it records when each
// Accept was called.
type emfileListener struct {
	n      int
	mu     sync.Mutex
	calls  []time.Time
	closed chan struct{}
	once   sync.Once
	more   chan struct{} // signalled at the first Accept after the errors
}

func (l *emfileListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	l.calls = append(l.calls, time.Now())
	k := len(l.calls)
	l.mu.Unlock()
	if k <= l.n {
		return nil, &net.OpError{Op: "accept", Net: "unix", Err: syscall.EMFILE}
	}
	if k == l.n+1 {
		close(l.more)
	}
	<-l.closed
	return nil, net.ErrClosed
}

func (l *emfileListener) Close() error   { l.once.Do(func() { close(l.closed) }); return nil }
func (l *emfileListener) Addr() net.Addr { return &net.UnixAddr{Name: "emfile", Net: "unix"} }

// TestAcceptRetries: Accept errors do not end the accept loop; they are
// counted and retried with a growing backoff, and closing the listener
// ends the loop even while it backs off.
func TestAcceptRetries(t *testing.T) {
	m := metrics.New()
	s := &Server{log: hclog.NewNullLogger(), m: m, opts: Options{}.withDefaults(),
		listeners: map[*broker.Guest][]*listener{}, sessions: map[*session]bool{}, perGuest: map[*broker.Guest]int{}}
	fl := &emfileListener{n: 5, closed: make(chan struct{}), more: make(chan struct{})}
	l := &listener{Listener: fl, path: "emfile", done: make(chan struct{})}
	g := &broker.Guest{Name: "g"}
	s.listeners[g] = []*listener{l}
	s.wg.Add(1)
	go s.accept(l, g)
	select {
	case <-fl.more:
	case <-time.After(10 * time.Second):
		t.Fatal("the accept loop did not come back after 5 EMFILEs")
	}
	if got := metricValue(t, m, "shunt_control_accept_errors_total", ""); got != 5 {
		t.Fatalf("accept errors %v, want 5", got)
	}
	fl.mu.Lock()
	for i := 1; i < len(fl.calls); i++ {
		if gap, least := fl.calls[i].Sub(fl.calls[i-1]), acceptBackoffMin<<(i-1); gap < least {
			t.Errorf("retry %d came after %s, want at least %s (doubling backoff)", i, gap, least)
		}
	}
	fl.mu.Unlock()
	l.close()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the accept loop did not end when its listener closed")
	}
}

// TestAcceptBackoffEndsOnClose: a loop backing off (at its longest) ends
// at once when its listener is closed.
func TestAcceptBackoffEndsOnClose(t *testing.T) {
	m := metrics.New()
	s := &Server{log: hclog.NewNullLogger(), m: m, opts: Options{}.withDefaults(),
		listeners: map[*broker.Guest][]*listener{}, sessions: map[*session]bool{}, perGuest: map[*broker.Guest]int{}}
	fl := &emfileListener{n: 1 << 30, closed: make(chan struct{}), more: make(chan struct{})}
	l := &listener{Listener: fl, path: "emfile", done: make(chan struct{})}
	g := &broker.Guest{Name: "g"}
	s.wg.Add(1)
	go s.accept(l, g)
	for deadline := time.Now().Add(10 * time.Second); metricValue(t, m, "shunt_control_accept_errors_total", "") < 3; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no 3 accept errors within 10s")
		}
	}
	start := time.Now()
	l.close()
	s.wg.Wait()
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Fatalf("the loop took %s to end after close, want at once", took)
	}
}

// TestLastWordsBounded: the ERROR that ends a session for malformed input
// goes to a guest that does not read; the write gives up after Silence
// and the session ends, without waiting for the guest.
func TestLastWordsBounded(t *testing.T) {
	m := metrics.New()
	s := &Server{log: hclog.NewNullLogger(), m: m, opts: Options{Silence: 100 * time.Millisecond}.withDefaults()}
	c, peer := net.Pipe() // synchronous: every write waits for a read that never comes
	defer peer.Close()
	ss := newSession(s, c, &broker.Guest{Name: "g"})
	s.wg.Add(1)
	go ss.writeLoop()
	done := make(chan struct{})
	go func() {
		ss.fail(fmt.Errorf("bad frame: %w", proto.ErrMalformed))
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("fail waited more than 5s on a guest that does not read")
	}
	s.wg.Wait()
	if got := metricValue(t, m, "shunt_control_closed_total", "not-reading"); got != 1 {
		t.Fatalf("closed not-reading %v, want 1", got)
	}
}

// metricValue is a counter's value, by name and (optionally) label value.
func metricValue(t *testing.T, m *metrics.Set, name, label string) float64 {
	t.Helper()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, x := range mf.GetMetric() {
			if label == "" || len(x.GetLabel()) > 0 && x.GetLabel()[0].GetValue() == label {
				return x.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no metric %s{%s}", name, label)
	return 0
}

// TestLearnCapResume: HELLO's proto.CapResume is a capability, not a ring
// format: it never reaches WELCOME's choice, it is recorded (Resumes) only
// for a version-3 library that switches, and a HELLO of capability bits
// only shares no format. Unknown bits are ignored, as an older hostd
// ignores CapResume.
func TestLearnCapResume(t *testing.T) {
	const f = 1 << ring.FormatVersion
	for _, tc := range []struct {
		name    string
		hello   proto.Msg
		formats uint32
		resumes bool
	}{
		{"format only", proto.Msg{Type: proto.Hello, Formats: f}, f, false},
		{"format and resume", proto.Msg{Type: proto.Hello, Formats: f | proto.CapResume}, f, true},
		{"resume only", proto.Msg{Type: proto.Hello, Formats: proto.CapResume}, 0, false},
		{"unknown bits", proto.Msg{Type: proto.Hello, Formats: f | 1<<20 | 1<<30}, f, false},
		{"all bits", proto.Msg{Type: proto.Hello, Formats: ^uint32(0)}, f, true},
		{"version 2", proto.Msg{Version: 2, Type: proto.Hello}, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ss := &session{}
			if got := ss.learn(tc.hello); got != tc.formats {
				t.Errorf("WELCOME formats %#x, want %#x", got, tc.formats)
			}
			if got := ss.Resumes(); got != tc.resumes {
				t.Errorf("Resumes() = %v, want %v", got, tc.resumes)
			}
		})
	}
	var _ broker.Resumer = (*session)(nil)
}
