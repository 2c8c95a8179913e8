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
	case remote.Addr().IsLoopback():
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
		conn.decide(Path{Reason: reason})
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
	ch, err := c.request(proto.Msg{Type: proto.Open, Role: proto.Active, Local: conn.local, Remote: conn.remote})
	if err != nil {
		conn.decide(Path{Reason: proto.ReasonNoHostd.String()})
		return conn, nil
	}
	timer := time.NewTimer(c.opts.VerdictTimeout)
	defer timer.Stop()
	select {
	case m := <-ch:
		conn.apply(m)
	case <-timer.C:
		c.forget(ch)
		conn.decide(Path{Reason: proto.ReasonTimeout.String()})
	case <-ctx.Done():
		c.forget(ch)
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
	l := &Listener{tcp: tl, client: c, addr: netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())}
	if !c.opts.Disable {
		c.mu.Lock()
		c.listens[l.addr]++
		c.mu.Unlock()
		if c.ensure() == nil && c.send(proto.Msg{Type: proto.Listen, Local: l.addr}) == nil {
			_ = c.sync(time.Second)
		}
	}
	return l, nil
}

// Accept implements net.Listener. It returns at once; hostd's verdict is
// awaited by the connection's first Read, Write or Path.
func (l *Listener) Accept() (net.Conn, error) { return l.AcceptShunt() }

// AcceptShunt is Accept returning the concrete type.
func (l *Listener) AcceptShunt() (*Conn, error) {
	tc, err := l.tcp.AcceptTCP()
	if err != nil {
		return nil, err
	}
	conn := newConn(l.client, tc)
	c := l.client
	switch {
	case c.opts.Disable:
		conn.decide(Path{Reason: proto.ReasonDisabled.String()})
	case conn.remote.Addr().Unmap().IsLoopback():
		conn.decide(Path{Reason: proto.ReasonLoopback.String()})
	default:
		ch, err := c.request(proto.Msg{Type: proto.Open, Role: proto.Passive, Local: conn.local, Remote: conn.remote})
		if err != nil {
			conn.decide(Path{Reason: proto.ReasonNoHostd.String()})
		} else {
			conn.wait = ch
		}
	}
	return conn, nil
}

// Close implements net.Listener and unregisters it from hostd.
func (l *Listener) Close() error {
	c := l.client
	if c.opts.Disable {
		return l.tcp.Close()
	}
	c.mu.Lock()
	if c.listens[l.addr]--; c.listens[l.addr] <= 0 {
		delete(c.listens, l.addr)
		_ = c.sendLocked(proto.Msg{Type: proto.Unlisten, Local: l.addr})
	}
	c.mu.Unlock()
	return l.tcp.Close()
}

// Addr implements net.Listener.
func (l *Listener) Addr() net.Addr { return l.tcp.Addr() }
