package guestlib

import (
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"golang.org/x/net/nettest"

	"github.com/shuntnet/shunt/guestlib/guesttest"
)

// pair is a dialing and a listening client on one automatic fake hostd.
type pair struct {
	dialer, listener *Client
	l                *Listener
	auto             *guesttest.Auto
}

func newPair(t testing.TB) *pair {
	t.Helper()
	return newPairCapacity(t, 0)
}

// newPairCapacity is newPair with rings of capacity bytes (0: guesttest's).
func newPairCapacity(t testing.TB, capacity int) *pair {
	t.Helper()
	h := guesttest.Start(t)
	h.Capacity = capacity
	p := &pair{auto: h.Auto(t)}
	p.dialer, p.listener = newClient(t, h, Options{}), newClient(t, h, Options{})
	l, err := (&ListenConfig{Client: p.listener}).Listen(context.Background(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	p.l = l
	return p
}

// conns returns both ends of a new connection, as Dial and Accept return
// them: on TCP, with READY on its way.
func (p *pair) conns(t testing.TB) (c1, c2 *Conn) {
	t.Helper()
	acc := async(func() *Conn {
		s, err := p.l.AcceptShunt()
		if err != nil {
			t.Errorf("accept: %v", err)
		}
		return s
	})
	c, err := (&Dialer{Client: p.dialer}).DialContext(context.Background(), "tcp4", p.l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	return c, await(t, acc, "Accept")
}

// TestConnConformance runs x/net/nettest's net.Conn suite on connections
// that start on TCP and move to the rings while the suite runs, so its
// deadlines and closes meet both paths and the switch.
func TestConnConformance(t *testing.T) {
	p := newPair(t)
	nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
		c, s := p.conns(t)
		return s, c, func() { c.Close(); s.Close() }, nil
	})
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
}

// TestHTTPReadHeaderTimeout: net/http sets its header deadline before the
// first Read of an accepted connection, which is then still waiting for
// its verdict. On the fast path the deadline must still hold: a client
// that sends nothing is cut off.
func TestHTTPReadHeaderTimeout(t *testing.T) {
	p := newPair(t)
	srv := &http.Server{ReadHeaderTimeout: 100 * time.Millisecond, Handler: http.NotFoundHandler()}
	conns := make(chan *Conn, 1)
	go srv.Serve(listenerFunc{p.l, conns})
	defer srv.Close()
	c, err := (&Dialer{Client: p.dialer}).DialContext(context.Background(), "tcp4", p.l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := await(t, conns, "Accept")
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
	_ = c.SetReadDeadline(time.Now().Add(guesttest.Wait))
	// The server gives up on the header and closes: EOF, or a 408 first.
	b, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("read after the server's header timeout: %v (got %q)", err, b)
	}
}

// listenerFunc hands each accepted Conn to the test as well.
type listenerFunc struct {
	*Listener
	conns chan<- *Conn
}

func (l listenerFunc) Accept() (net.Conn, error) {
	c, err := l.AcceptShunt()
	if err == nil {
		select {
		case l.conns <- c:
		default:
		}
	}
	return c, err
}
