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
}

func newPair(t *testing.T) *pair {
	t.Helper()
	h := guesttest.Start(t)
	h.Auto(t)
	p := &pair{dialer: newClient(t, h, Options{}), listener: newClient(t, h, Options{})}
	l, err := (&ListenConfig{Client: p.listener}).Listen(context.Background(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	p.l = l
	return p
}

// conns returns both ends of a new connection, without asking for their
// path: the accepted end is usually still waiting for its verdict.
func (p *pair) conns(t *testing.T) (c1, c2 *Conn) {
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

// TestConnConformanceUndecided runs x/net/nettest's net.Conn suite on
// connections whose accepted end has not been asked for its path, so the
// suite's deadlines and closes meet an undecided Conn.
func TestConnConformanceUndecided(t *testing.T) {
	p := newPair(t)
	nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
		c, s := p.conns(t)
		return s, c, func() { c.Close(); s.Close() }, nil
	})
	c, s := p.conns(t)
	defer c.Close()
	defer s.Close()
	if !c.Path().Fast || !s.Path().Fast {
		t.Fatalf("paths %s / %s, want the fast path (the suite above must have run on it)", c.Path(), s.Path())
	}
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
	if !c.Path().Fast {
		t.Fatalf("client path %s, want shunt", c.Path())
	}
	if s := await(t, conns, "Accept"); !s.Path().Fast {
		t.Fatalf("server path %s, want shunt", s.Path())
	}
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
