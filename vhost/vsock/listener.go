package vsock

import (
	"context"
	"fmt"
	"net"
	"syscall"
)

// AnyPort is the port of a Listener that takes the guest's connections to
// every port without a listener of its own (VMADDR_PORT_ANY).
const AnyPort = 0xffffffff

// Listener takes the guest's connections to one host port (CID 2).
type Listener struct {
	d       *Device
	port    uint32
	filter  func(port uint32) bool
	backlog []*Conn
	closed  bool
	changed chan struct{}
}

// Listen takes the guest's connections to host port.
func (d *Device) Listen(port uint32) (*Listener, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if port == AnyPort {
		return nil, fmt.Errorf("vsock: port %d is AnyPort: use ListenAny", port)
	}
	if d.listeners[port] != nil {
		return nil, fmt.Errorf("vsock cid %d: host port %d: %w", d.cid, port, syscall.EADDRINUSE)
	}
	l := &Listener{d: d, port: port, changed: make(chan struct{})}
	d.listeners[port] = l
	return l, nil
}

// ListenAny takes the guest's connections to every host port that has no
// Listener of its own and for which accept says yes (the others are
// refused with RST). accept runs with the device's lock held: it must not
// block or call the device.
func (d *Device) ListenAny(accept func(port uint32) bool) (*Listener, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.any != nil {
		return nil, fmt.Errorf("vsock cid %d: a ListenAny listener exists: %w", d.cid, syscall.EADDRINUSE)
	}
	l := &Listener{d: d, port: AnyPort, filter: accept, changed: make(chan struct{})}
	d.any = l
	return l, nil
}

func (l *Listener) accepts(port uint32) bool {
	return !l.closed && (l.filter == nil || l.filter(port))
}

func (l *Listener) wake() {
	close(l.changed)
	l.changed = make(chan struct{})
}

// Accept waits for the guest's next connection.
func (l *Listener) Accept() (net.Conn, error) { return l.AcceptContext(context.Background()) }

// AcceptContext is Accept until ctx ends.
func (l *Listener) AcceptContext(ctx context.Context) (*Conn, error) {
	d := l.d
	d.mu.Lock()
	defer d.mu.Unlock()
	for {
		if l.closed {
			return nil, &net.OpError{Op: "accept", Net: "vsock", Addr: l.Addr(), Err: net.ErrClosed}
		}
		if len(l.backlog) > 0 {
			c := l.backlog[0]
			l.backlog = l.backlog[1:]
			d.stats.Accepted.Add(1)
			return c, nil
		}
		ch := l.changed
		d.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			d.mu.Lock()
			return nil, &net.OpError{Op: "accept", Net: "vsock", Addr: l.Addr(), Err: ctx.Err()}
		}
		d.mu.Lock()
	}
}

// Close stops listening; connections not accepted yet are reset.
func (l *Listener) Close() error {
	d := l.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	if d.any == l {
		d.any = nil
	} else if d.listeners[l.port] == l {
		delete(d.listeners, l.port)
	}
	for _, c := range l.backlog {
		c.finish(syscall.ECONNABORTED)
	}
	l.backlog = nil
	d.pump()
	l.wake()
	return nil
}

// Addr is the host's address of the listener.
func (l *Listener) Addr() net.Addr { return &Addr{CID: HostCID, Port: l.port} }

// Dial connects to the guest's listener on port: REQUEST, and RESPONSE or
// RST (ECONNREFUSED), until ctx ends.
func (d *Device) Dial(ctx context.Context, port uint32) (*Conn, error) {
	d.mu.Lock()
	if d.sess == nil {
		d.mu.Unlock()
		return nil, fmt.Errorf("vsock cid %d: dial port %d: no front-end attached", d.cid, port)
	}
	if len(d.conns) >= MaxConns {
		d.mu.Unlock()
		return nil, fmt.Errorf("vsock cid %d: dial port %d: %d connections", d.cid, port, MaxConns)
	}
	local := d.freePort(port)
	c := d.newConn(key{local, port}, Hdr{})
	c.established = make(chan struct{})
	c.want = wantRequest
	d.markReady(c)
	d.pump()
	est := c.established
	d.mu.Unlock()
	select {
	case <-est:
	case <-ctx.Done():
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	switch c.state {
	case established:
		d.stats.Dialed.Add(1)
		return c, nil
	case connecting:
		c.finish(ctx.Err())
		d.pump()
		return nil, c.opErr("dial", ctx.Err())
	}
	return nil, c.opErr("dial", c.err)
}

// freePort picks a host port for a connection to guest port: ephemeral
// ports from 32768 on, skipping those in use.
func (d *Device) freePort(guest uint32) uint32 {
	for {
		p := d.nextPort
		if d.nextPort++; d.nextPort == AnyPort {
			d.nextPort = 1 << 15
		}
		if d.conns[key{p, guest}] == nil && d.listeners[p] == nil {
			return p
		}
	}
}
