package guestlib

import (
	"context"
	"fmt"
	"net"

	"github.com/shuntnet/shunt/internal/proto"
)

// Dialer dials TCP connections that take the fast path when hostd allows.
// The zero value uses DefaultClient. Safe for concurrent use.
type Dialer struct {
	Client *Client    // nil: DefaultClient
	Net    net.Dialer // the kernel dial, used as it is
}

// Dial connects to addr on network "tcp", "tcp4" or "tcp6".
func Dial(network, addr string) (*Conn, error) {
	var d Dialer
	return d.DialContext(context.Background(), network, addr)
}

// DialContext is Dial with a context bounding the connect.
func DialContext(ctx context.Context, network, addr string) (*Conn, error) {
	var d Dialer
	return d.DialContext(ctx, network, addr)
}

// Dial is DialContext without a context.
func (d *Dialer) Dial(network, addr string) (*Conn, error) {
	return d.DialContext(context.Background(), network, addr)
}

func (d *Dialer) client() (*Client, error) {
	if d.Client != nil {
		return d.Client, nil
	}
	return DefaultClient()
}

// DialContext connects to addr with the kernel's connect() and returns at
// once, on TCP: nothing is bound first and nothing waits for hostd. The
// connection is offered to hostd in the background (OPEN), and its bytes
// move to the rings when hostd answers READY. Loopback connections are
// never offered.
func (d *Dialer) DialContext(ctx context.Context, network, addr string) (*Conn, error) {
	switch network {
	case "tcp", "tcp4", "tcp6":
	default:
		return nil, fmt.Errorf("shunt: dial %s: only tcp is supported", network)
	}
	c, cerr := d.client()
	nc, err := d.Net.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	if cerr != nil {
		c = nil // TCP, reason internal
	}
	conn := newConn(c, nc.(*net.TCPConn), proto.Active)
	conn.announce()
	return conn, nil
}
