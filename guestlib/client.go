package guestlib

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/wait"
)

// Options configure a Client. The zero value reads the environment.
type Options struct {
	Control string       // control socket; "" = $SHUNT_CONTROL or /run/shunt/guest.sock
	Region  string       // region file override; "" = $SHUNT_REGION or what hostd says
	Wait    *wait.Policy // nil = $SHUNT_WAIT or adaptive
	Disable bool         // always plain TCP ($SHUNT_DISABLE=1)
	// VerdictTimeout bounds how long Dial waits for hostd's verdict; it
	// should exceed hostd's pairing timeout. 0 = 5s.
	VerdictTimeout time.Duration
	// Logf, if set, receives one line per connection saying which path it
	// took and why (shunt-run -v uses it).
	Logf func(format string, args ...any)
	// Kick makes ends wake their peers through hostd (KICK) instead of
	// futexes: for VMs, whose peers are in other guest kernels. It is set
	// on its own when Control is a virtio-serial port.
	Kick bool
}

func (o Options) withEnv() (Options, error) {
	if o.Control == "" {
		o.Control = os.Getenv("SHUNT_CONTROL")
	}
	if o.Control == "" {
		o.Control = "/run/shunt/guest.sock"
	}
	if o.Region == "" {
		o.Region = os.Getenv("SHUNT_REGION")
	}
	if o.Wait == nil {
		o.Wait = &wait.Policy{Mode: wait.Adaptive}
		if s := os.Getenv("SHUNT_WAIT"); s != "" {
			m, err := wait.ParseMode(s)
			if err != nil {
				return o, fmt.Errorf("SHUNT_WAIT: %w", err)
			}
			o.Wait.Mode = m
		}
	}
	if os.Getenv("SHUNT_DISABLE") == "1" {
		o.Disable = true
	}
	if o.VerdictTimeout <= 0 {
		o.VerdictTimeout = 5 * time.Second
	}
	return o, nil
}

// Client is a guest process's session with hostd, shared by its Dialers and
// Listeners. It is safe for concurrent use. It reconnects on its own when
// hostd restarts; Close ends the session.
type Client struct {
	opts Options

	mu         sync.Mutex
	conn       net.Conn // nil while disconnected
	region     *region.Region
	guestID    uint32
	nextReq    uint32
	pending    map[uint32]chan proto.Msg
	pongs      map[uint64]chan struct{}
	nonce      uint64
	flows      map[flowKey]*Conn
	listens    map[netip.AddrPort]int
	routes     map[netip.Addr]route // source address cache (see source)
	closes     []proto.Msg          // CLOSEs to send once reconnected
	lastTry    time.Time
	lastErr    error
	closed     bool
	reconnects int
	done       chan struct{}
	wg         sync.WaitGroup
	kick       *kickSignal // nil unless Options.Kick
}

type flowKey struct {
	slot uint32
	gen  uint64
}

// NewClient returns a client; it connects to hostd lazily, on first use.
func NewClient(opts Options) (*Client, error) {
	o, err := opts.withEnv()
	if err != nil {
		return nil, err
	}
	c := &Client{
		opts: o, pending: map[uint32]chan proto.Msg{}, pongs: map[uint64]chan struct{}{}, flows: map[flowKey]*Conn{},
		listens: map[netip.AddrPort]int{}, routes: map[netip.Addr]route{}, done: make(chan struct{}),
	}
	if st, err := os.Stat(o.Control); err == nil && st.Mode()&os.ModeCharDevice != 0 {
		c.opts.Kick = true
	}
	if c.opts.Kick {
		c.kick = newKickSignal(c)
		w := *c.opts.Wait
		w.Signal = c.kick
		c.opts.Wait = &w
	}
	return c, nil
}

var (
	defaultOnce   sync.Once
	defaultClient *Client
	defaultErr    error
)

// DefaultClient is the process-wide client configured from the environment.
func DefaultClient() (*Client, error) {
	defaultOnce.Do(func() { defaultClient, defaultErr = NewClient(Options{}) })
	return defaultClient, defaultErr
}

// errNoHostd is why a connection stays on TCP when hostd cannot be reached.
var errNoHostd = errors.New("hostd unreachable")

// ensure connects if not connected; it tries at most once a second so that
// a missing hostd costs a Dial nothing but a check.
func (c *Client) ensure() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return net.ErrClosed
	}
	if c.conn != nil {
		return nil
	}
	if time.Since(c.lastTry) < time.Second {
		return fmt.Errorf("%w: %w", errNoHostd, c.lastErr)
	}
	c.lastTry = time.Now()
	c.lastErr = c.connectLocked()
	if c.lastErr != nil {
		return fmt.Errorf("%w: %w", errNoHostd, c.lastErr)
	}
	return nil
}

// connectLocked dials hostd, does HELLO/WELCOME, maps the region on first
// connect, re-announces listeners and held flows, and starts the reader.
func (c *Client) connectLocked() error {
	conn, err := dialControl(c.opts.Control)
	if err != nil {
		return fmt.Errorf("control %s: %w", c.opts.Control, err)
	}
	m, err := hello(conn)
	if err != nil {
		conn.Close()
		return err
	}
	if c.region == nil {
		path := c.opts.Region
		if path == "" {
			path = m.Region
		}
		r, err := region.Open(path)
		if err != nil {
			conn.Close()
			return fmt.Errorf("map the region: %w", err)
		}
		c.region = r
	}
	c.guestID = m.GuestID
	// Re-announce what this process holds (after a hostd restart).
	msgs := c.announcementsLocked()
	for i := range msgs {
		if err := proto.Write(conn, &msgs[i]); err != nil {
			conn.Close()
			return fmt.Errorf("re-announce: %w", err)
		}
	}
	c.conn = conn
	c.wg.Add(1)
	go c.readLoop(conn)
	if _, ok := conn.(portConn); ok {
		c.wg.Add(1)
		go c.keepalive(conn)
	}
	return nil
}

// dialControl opens the control channel: a Unix socket (process guests)
// or a virtio-serial port's character device (VMs).
func dialControl(path string) (net.Conn, error) {
	if st, err := os.Stat(path); err == nil && st.Mode()&os.ModeCharDevice != 0 {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			return nil, err
		}
		return portConn{f}, nil
	}
	return net.DialTimeout("unix", path, 2*time.Second)
}

// hello says HELLO until hostd answers WELCOME: a virtio-serial port drops
// what is written before both ends are open, so the first HELLO may be
// lost; a Unix socket answers the first one.
func hello(conn net.Conn) (proto.Msg, error) {
	for try := 0; try < 25; try++ {
		if err := proto.Write(conn, &proto.Msg{Type: proto.Hello, PID: uint32(os.Getpid())}); err != nil {
			return proto.Msg{}, fmt.Errorf("hello: %w", err)
		}
		_ = conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		m, _, err := proto.Read(conn, nil)
		// A VM's port may still hold what hostd sent to the guest's
		// previous boot (QEMU keeps the channel across a reboot in
		// place): PONG, REVOKED, KICK... Everything before WELCOME is
		// that, and is skipped.
		for err == nil && stale(m) {
			m, _, err = proto.Read(conn, nil)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		_ = conn.SetReadDeadline(time.Time{})
		if err != nil || m.Type != proto.Welcome {
			if err == nil {
				err = fmt.Errorf("hostd answered HELLO with %s", m.Type)
			}
			return m, fmt.Errorf("welcome: %w", err)
		}
		return m, nil
	}
	return proto.Msg{}, errors.New("welcome: no answer to HELLO in 5s")
}

// stale reports whether m, read before WELCOME, is left over from an
// earlier session on the same channel.
func stale(m proto.Msg) bool {
	switch m.Type {
	case proto.Welcome:
		return false
	case proto.Error:
		return m.Reason == proto.ReasonNoHostd
	}
	return true
}

// portConn is a character device used as the control connection.
type portConn struct{ *os.File }

func (portConn) LocalAddr() net.Addr  { return portAddr{} }
func (portConn) RemoteAddr() net.Addr { return portAddr{} }

type portAddr struct{}

func (portAddr) Network() string { return "virtio-serial" }
func (portAddr) String() string  { return "org.shunt.ctl" }

// readLoop dispatches hostd's messages until the channel fails, then fails
// pending requests over to TCP and reconnects in the background.
func (c *Client) readLoop(conn net.Conn) {
	defer c.wg.Done()
	var buf []byte
	for {
		m, b, err := proto.Read(conn, buf)
		buf = b
		if err != nil {
			break
		}
		switch m.Type {
		case proto.Ready, proto.TCP:
			c.mu.Lock()
			ch := c.pending[m.ReqID]
			delete(c.pending, m.ReqID)
			c.mu.Unlock()
			if ch != nil {
				ch <- m
			}
		case proto.Revoke:
			c.mu.Lock()
			fc := c.flows[flowKey{m.Slot, m.Gen}]
			c.mu.Unlock()
			if fc != nil {
				fc.revoke(m.Reason)
			}
		case proto.Ping:
			c.send(proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
		case proto.Kick:
			if c.kick != nil {
				c.kick.kicked(flowKey{m.Slot, m.Gen})
			}
		case proto.Pong:
			c.mu.Lock()
			ch := c.pongs[m.Nonce]
			delete(c.pongs, m.Nonce)
			c.mu.Unlock()
			if ch != nil {
				close(ch)
			}
		case proto.Error:
			if m.Reason == proto.ReasonNoHostd { // a restarted hostd behind a VM port
				c.rehello(conn)
				continue
			}
			c.logf("shunt: hostd closed the control channel: %s (%s)", m.Text, m.Reason)
		case proto.Welcome:
			c.welcomed(conn)
		}
	}
	conn.Close()
	c.mu.Lock()
	if c.conn == conn {
		c.conn = nil
	}
	for id, ch := range c.pending {
		ch <- proto.Msg{Type: proto.TCP, ReqID: id, Reason: proto.ReasonNoHostd}
		delete(c.pending, id)
	}
	closed := c.closed
	c.mu.Unlock()
	if !closed {
		c.wg.Add(1)
		go c.reconnect()
	}
}

// keepalive runs on a VM's port, which stays open when hostd restarts (QEMU
// reconnects its end): a PING every 500 ms makes a new hostd answer ERROR,
// and the client says HELLO again.
func (c *Client) keepalive(conn net.Conn) {
	defer c.wg.Done()
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-c.done:
			return
		case <-t.C:
			c.mu.Lock()
			if c.conn != conn {
				c.mu.Unlock()
				return
			}
			c.nonce++
			_ = proto.Write(conn, &proto.Msg{Type: proto.Ping, Nonce: c.nonce})
			c.mu.Unlock()
		}
	}
}

// rehello says HELLO again on the same channel (a new hostd behind it).
func (c *Client) rehello(conn net.Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == conn {
		_ = proto.Write(conn, &proto.Msg{Type: proto.Hello, PID: uint32(os.Getpid())})
	}
}

// welcomed handles a WELCOME after the first: the new hostd gets this
// process's listeners, flows and undelivered CLOSEs again.
func (c *Client) welcomed(conn net.Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != conn {
		return
	}
	for _, m := range c.announcementsLocked() {
		_ = proto.Write(conn, &m)
	}
	c.reconnects++
}

// announcementsLocked is what a new hostd must learn from this process.
func (c *Client) announcementsLocked() []proto.Msg {
	var msgs []proto.Msg
	for a := range c.listens {
		msgs = append(msgs, proto.Msg{Type: proto.Listen, Local: a})
	}
	for k, fc := range c.flows {
		msgs = append(msgs, proto.Msg{Type: proto.Reattach, Slot: k.slot, Gen: k.gen, Side: fc.side, Local: fc.local, Remote: fc.remote})
	}
	msgs = append(msgs, c.closes...)
	c.closes = nil
	return msgs
}

// reconnect retries hostd with backoff until it answers or Close.
func (c *Client) reconnect() {
	defer c.wg.Done()
	delay := 20 * time.Millisecond
	for {
		select {
		case <-c.done:
			return
		case <-time.After(delay):
		}
		c.mu.Lock()
		if c.closed || c.conn != nil {
			c.mu.Unlock()
			return
		}
		err := c.connectLocked()
		if err == nil {
			c.reconnects++
		}
		c.mu.Unlock()
		if err == nil {
			return
		}
		delay = min(2*delay, time.Second)
	}
}

// send writes m if connected; CLOSE is queued for the next connection
// otherwise, so hostd learns of it after a restart.
func (c *Client) send(m proto.Msg) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sendLocked(m)
}

func (c *Client) sendLocked(m proto.Msg) error {
	if c.conn == nil {
		if m.Type == proto.Close {
			c.closes = append(c.closes, m)
		}
		return errNoHostd
	}
	return proto.Write(c.conn, &m)
}

// sync waits until hostd has processed everything sent so far on this
// session (a PING answered by a PONG; a session is served in order), so that
// a LISTEN is in effect before a peer's connection can reach hostd through
// another session.
func (c *Client) sync(timeout time.Duration) error {
	c.mu.Lock()
	c.nonce++
	n := c.nonce
	ch := make(chan struct{})
	c.pongs[n] = ch
	err := c.sendLocked(proto.Msg{Type: proto.Ping, Nonce: n})
	c.mu.Unlock()
	if err != nil {
		return err
	}
	select {
	case <-ch:
		return nil
	case <-time.After(timeout):
		c.mu.Lock()
		delete(c.pongs, n)
		c.mu.Unlock()
		return errNoHostd
	}
}

// request sends an OPEN and returns the channel its verdict arrives on.
func (c *Client) request(m proto.Msg) (chan proto.Msg, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.nextReq++
	m.ReqID = c.nextReq
	ch := make(chan proto.Msg, 1)
	c.pending[m.ReqID] = ch
	if err := c.sendLocked(m); err != nil {
		delete(c.pending, m.ReqID)
		return nil, err
	}
	return ch, nil
}

func (c *Client) forget(ch chan proto.Msg) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, x := range c.pending {
		if x == ch {
			delete(c.pending, id)
		}
	}
}

func (c *Client) logf(format string, args ...any) {
	if c.opts.Logf != nil {
		c.opts.Logf(format, args...)
	}
}

// Reconnects reports how many times the client reconnected to hostd.
func (c *Client) Reconnects() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reconnects
}

// Close ends the session with hostd. Fast-path connections already open
// keep working; new ones use TCP.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	close(c.done)
	if c.conn != nil {
		c.conn.Close()
	}
	c.mu.Unlock()
	c.wg.Wait()
	return nil
}
