package guestlib

import (
	"context"
	"fmt"
	"net"
	"net/netip"

	"github.com/shuntnet/shunt/internal/proto"
)

// Listener accepts TCP connections that take the fast path when hostd
// allows. It implements net.Listener.
type Listener struct {
	tcp    *net.TCPListener
	client *Client
	addr   netip.AddrPort
}

// ListenConfig listens with a chosen Client (nil: DefaultClient).
type ListenConfig struct {
	Client *Client
	Net    net.ListenConfig
}

// Listen listens on addr with the default client.
func Listen(network, addr string) (*Listener, error) {
	var lc ListenConfig
	return lc.Listen(context.Background(), network, addr)
}

// Listen listens on addr and registers the listener with hostd (if
// reachable), so that connections to it can get the fast path.
func (lc *ListenConfig) Listen(ctx context.Context, network, addr string) (*Listener, error) {
	c := lc.Client
	if c == nil {
		var err error
		if c, err = DefaultClient(); err != nil {
			return nil, err
		}
	}
	nl, err := lc.Net.Listen(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	tl, ok := nl.(*net.TCPListener)
	if !ok {
		nl.Close()
		return nil, fmt.Errorf("shunt: listen %s: only tcp is supported", network)
	}
	ap := tl.Addr().(*net.TCPAddr).AddrPort()
	// [::] (dual-stack) stays [::]: hostd takes it for both families.
	l := &Listener{tcp: tl, client: c, addr: proto.Unmap(ap)}
	if !c.opts.Disable {
		c.listen(l.addr)
	}
	return l, nil
}

// Accept implements net.Listener. It returns at once, on TCP; the
// connection is offered to hostd in the background (see Dialer).
func (l *Listener) Accept() (net.Conn, error) { return l.AcceptShunt() }

// AcceptShunt is Accept returning the concrete type.
func (l *Listener) AcceptShunt() (*Conn, error) {
	tc, err := l.tcp.AcceptTCP()
	if err != nil {
		return nil, err
	}
	conn := newConn(l.client, tc, proto.Passive)
	conn.announce()
	return conn, nil
}

// Close implements net.Listener and unregisters it from hostd.
func (l *Listener) Close() error {
	c := l.client
	if c.opts.Disable {
		return l.tcp.Close()
	}
	c.unlisten(l.addr)
	return l.tcp.Close()
}

// Addr implements net.Listener.
func (l *Listener) Addr() net.Addr { return l.tcp.Addr() }
