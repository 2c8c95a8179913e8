package guestlib

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
)

// Dialer dials TCP connections that take the fast path when hostd allows.
// The zero value uses DefaultClient. Safe for concurrent use.
type Dialer struct {
	Client *Client    // nil: DefaultClient
	Net    net.Dialer // the kernel dial; Control and LocalAddr are used by guestlib
}

// Dial connects to addr on network "tcp", "tcp4" or "tcp6".
func Dial(network, addr string) (*Conn, error) {
	var d Dialer
	return d.DialContext(context.Background(), network, addr)
}

// DialContext is Dial with a context bounding the connect and the verdict.
func DialContext(ctx context.Context, network, addr string) (*Conn, error) {
	var d Dialer
	return d.DialContext(ctx, network, addr)
}

func (d *Dialer) client() (*Client, error) {
	if d.Client != nil {
		return d.Client, nil
	}
	return DefaultClient()
}

// DialContext connects to addr. The kernel connect() decides whether the
// connection exists at all; hostd then decides whether its bytes take the
// fast path. Loopback connections never ask hostd.
func (d *Dialer) DialContext(ctx context.Context, network, addr string) (*Conn, error) {
	switch network {
	case "tcp", "tcp4", "tcp6":
	default:
		return nil, fmt.Errorf("shunt: dial %s: only tcp is supported", network)
	}
	c, cerr := d.client()
	raddr, err := net.ResolveTCPAddr(network, addr)
	if err != nil {
		return nil, err
	}
	remote := raddr.AddrPort()
	remote = netip.AddrPortFrom(remote.Addr().Unmap(), remote.Port())
	reason := ""
	switch {
	case cerr != nil:
		reason = proto.ReasonInternal.String()
	case c.opts.Disable:
		reason = proto.ReasonDisabled.String()
	case remote.Addr().IsLoopback() && !c.loopback:
		reason = proto.ReasonLoopback.String()
	default:
		if err := c.ensure(); err != nil {
			reason = proto.ReasonNoHostd.String()
		}
	}
	if reason != "" {
		tcp, err := d.Net.DialContext(ctx, network, raddr.String())
		if err != nil {
			return nil, err
		}
		conn := newConn(c, tcp.(*net.TCPConn))
		conn.decide(reason)
		return conn, nil
	}
	return d.dialFast(ctx, c, network, raddr, remote)
}

// dialFast binds the socket before connect to learn its tuple, announces
// INTENT, connects, sends OPEN and waits for the verdict.
func (d *Dialer) dialFast(ctx context.Context, c *Client, network string, raddr *net.TCPAddr, remote netip.AddrPort) (*Conn, error) {
	src, err := c.source(remote.Addr())
	if err != nil {
		return nil, fmt.Errorf("shunt: route to %s: %w", remote, err)
	}
	nd := d.Net
	user := nd.ControlContext
	nd.ControlContext = func(ctx context.Context, nw, address string, rc syscall.RawConn) error {
		if user != nil {
			if err := user(ctx, nw, address, rc); err != nil {
				return err
			}
		}
		var local netip.AddrPort
		var serr error
		err := rc.Control(func(fd uintptr) { local, serr = bindEphemeral(int(fd), src) })
		if err == nil {
			err = serr
		}
		if err != nil {
			return fmt.Errorf("shunt: bind before connect: %w", err)
		}
		_ = c.send(proto.Msg{Type: proto.Intent, Local: local, Remote: remote})
		return nil
	}
	nc, err := nd.DialContext(ctx, network, raddr.String())
	if err != nil {
		return nil, err
	}
	conn := newConn(c, nc.(*net.TCPConn))
	if err := c.request(conn, proto.Msg{Type: proto.Open, Role: proto.Active, Local: conn.local, Remote: conn.remote}); err != nil {
		conn.decide(proto.ReasonNoHostd.String())
		return conn, nil
	}
	timer := time.NewTimer(time.Until(conn.waitTo))
	defer timer.Stop()
	select {
	case <-conn.verdict:
	case <-timer.C:
		c.forget(conn)
		conn.decide(proto.ReasonTimeout.String())
	case <-ctx.Done():
		conn.Close()
		return nil, ctx.Err()
	}
	return conn, nil
}

// source returns the source address the kernel uses towards dst, cached
// for a few seconds (asking costs a socket, tens of microseconds).
func (c *Client) source(dst netip.Addr) (netip.Addr, error) {
	c.mu.Lock()
	r, ok := c.routes[dst]
	c.mu.Unlock()
	if ok && time.Since(r.at) < 5*time.Second {
		return r.src, nil
	}
	// A connected UDP socket sends nothing but learns the route.
	u, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(dst, 9)))
	if err != nil {
		return netip.Addr{}, err
	}
	defer u.Close()
	src := u.LocalAddr().(*net.UDPAddr).AddrPort().Addr().Unmap()
	c.mu.Lock()
	c.routes[dst] = route{src, time.Now()}
	c.mu.Unlock()
	return src, nil
}

type route struct {
	src netip.Addr
	at  time.Time
}

// bindEphemeral binds fd to src with an ephemeral port and returns it.
func bindEphemeral(fd int, src netip.Addr) (netip.AddrPort, error) {
	var sa syscall.Sockaddr
	if src.Is4() {
		sa = &syscall.SockaddrInet4{Addr: src.As4()}
	} else {
		sa = &syscall.SockaddrInet6{Addr: src.As16()}
	}
	if err := syscall.Bind(fd, sa); err != nil {
		return netip.AddrPort{}, err
	}
	got, err := syscall.Getsockname(fd)
	if err != nil {
		return netip.AddrPort{}, err
	}
	switch a := got.(type) {
	case *syscall.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)), nil
	case *syscall.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr).Unmap(), uint16(a.Port)), nil
	}
	return netip.AddrPort{}, errors.New("unexpected socket address family")
}
