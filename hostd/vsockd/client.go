package vsockd

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/vsockhost"
)

// answerWait bounds how long the client waits for one answer.
const answerWait = 5 * time.Second

// redial is how often the client dials a daemon it lost.
const redial = time.Second

// Client is hostd's end: it names the devices hostd wants, keeps the
// daemon's word on which are served, and dials again when it loses the
// daemon (until Close). Safe for concurrent use.
type Client struct {
	path string
	log  hclog.Logger
	devs []Device
	want map[uint32]bool

	reqMu sync.Mutex // one request at a time

	mu      sync.Mutex
	conn    *net.UnixConn   // nil while disconnected
	ready   *net.UnixConn   // conn, once its devices were named
	answers chan Msg        // the connection's answers, from its reader
	served  map[uint32]bool // the daemon's last word, by guest id
	pid     int             // the daemon's, once connected
	lost    chan struct{}   // closed when conn is lost
	stop    chan struct{}
	wg      sync.WaitGroup
}

// Start connects to the daemon at path and names devs to it, waiting at
// most ctx for the first connection; whatever that gives, it keeps the
// connection, or keeps dialing, until Close. The error says why the
// first connection failed (the devices are then not served until it
// succeeds); the client is returned with it, dialing, and must be
// closed all the same. Only bad devices return no client.
func Start(ctx context.Context, log hclog.Logger, path string, devs []Device) (*Client, error) {
	c := &Client{path: path, log: log, devs: devs, want: map[uint32]bool{}, served: map[uint32]bool{}, stop: make(chan struct{})}
	for _, d := range devs {
		if err := d.Check(); err != nil {
			return nil, err
		}
		c.want[d.ID] = true
	}
	err := c.connect(ctx)
	c.wg.Add(1)
	go c.keep()
	return c, err
}

// Close stops dialing and closes the connection; the daemon's devices
// go on.
func (c *Client) Close() {
	close(c.stop)
	c.mu.Lock()
	if c.conn != nil {
		c.conn.Close()
	}
	c.mu.Unlock()
	c.wg.Wait()
}

// Served reports whether the daemon last said the guest's QEMU is
// served; false while the daemon is not connected.
func (c *Client) Served(guest uint32) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conn != nil && c.served[guest]
}

// PID is the connected daemon's process id; 0 while disconnected.
func (c *Client) PID() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		return 0
	}
	return c.pid
}

// Stats asks the daemon for its devices' counters; nil if it does not
// answer.
func (c *Client) Stats() []vsockhost.Stat {
	ctx, cancel := context.WithTimeout(context.Background(), answerWait)
	defer cancel()
	c.reqMu.Lock()
	defer c.reqMu.Unlock()
	var out []vsockhost.Stat
	err := c.request(ctx, Msg{Op: OpList}, func(m Msg) (bool, error) {
		switch m.Op {
		case OpStat:
			out = append(out, *m.Stat)
			return false, nil
		case OpEnd:
			return true, nil
		}
		return false, fmt.Errorf("%w: %s in a list", ErrProto, m.Op)
	})
	if err != nil {
		c.log.Debug("shunt-vsockd's counters", "error", err)
		return nil
	}
	return out
}

// keep dials again whenever the connection is lost.
func (c *Client) keep() {
	defer c.wg.Done()
	var seen chan struct{} // a connection already waited for
	for {
		c.mu.Lock()
		lost := c.lost
		c.mu.Unlock()
		if lost != nil && lost != seen {
			seen = lost
			select {
			case <-lost:
			case <-c.stop:
				return
			}
		}
		t := time.NewTimer(redial)
		select {
		case <-c.stop:
			t.Stop()
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), answerWait)
		err := c.connect(ctx)
		cancel()
		if err != nil {
			c.log.Debug("shunt-vsockd", "error", err)
		}
	}
}

// connect dials, says hello, names the devices and forgets the daemon's
// others.
func (c *Client) connect(ctx context.Context) (err error) {
	var dl net.Dialer
	nc, err := dl.DialContext(ctx, "unixpacket", c.path)
	if err != nil {
		return fmt.Errorf("dial shunt-vsockd at %s: %w (is it running? systemctl enable --now shunt-vsockd)", c.path, err)
	}
	conn := nc.(*net.UnixConn)
	answers, lost := make(chan Msg, eventBuffer), make(chan struct{})
	c.reqMu.Lock()
	defer c.reqMu.Unlock()
	c.mu.Lock()
	select {
	case <-c.stop:
		c.mu.Unlock()
		conn.Close()
		return errors.New("closed")
	default:
	}
	c.conn, c.answers, c.lost, c.served, c.pid = conn, answers, lost, map[uint32]bool{}, 0
	c.mu.Unlock()
	defer func() {
		if err != nil {
			conn.Close()
		}
	}()
	c.wg.Add(1)
	go c.reader(conn, answers, lost)
	if err := c.request(ctx, Msg{Op: OpHello, Version: Version}, func(m Msg) (bool, error) {
		if m.Op != OpHello || m.Version != Version {
			return false, fmt.Errorf("%w: %s (version %d) for hello", ErrProto, m.Op, m.Version)
		}
		c.mu.Lock()
		c.pid = m.PID
		c.mu.Unlock()
		return true, nil
	}); err != nil {
		return err
	}
	for i := range c.devs {
		dev := c.devs[i]
		if err := c.request(ctx, Msg{Op: OpDevice, Device: &dev}, func(m Msg) (bool, error) {
			if m.Op != OpDevice || m.ID != dev.ID {
				return false, fmt.Errorf("%w: %s (id %d) for guest %s's device", ErrProto, m.Op, m.ID, dev.Guest)
			}
			c.mu.Lock()
			c.served[dev.ID] = m.Connected
			c.mu.Unlock()
			c.log.Info("shunt-vsockd serves the device", "guest", dev.Guest, "kept", m.Kept, "qemu_connected", m.Connected)
			return true, nil
		}); err != nil {
			return err
		}
	}
	var stale []uint32
	if err := c.request(ctx, Msg{Op: OpList}, func(m Msg) (bool, error) {
		switch m.Op {
		case OpStat:
			if !c.want[m.ID] {
				stale = append(stale, m.ID)
			}
			return false, nil
		case OpEnd:
			return true, nil
		}
		return false, fmt.Errorf("%w: %s in a list", ErrProto, m.Op)
	}); err != nil {
		return err
	}
	for _, id := range stale {
		c.log.Info("shunt-vsockd's device of a guest hostd no longer has: forgotten", "id", id)
		if err := c.request(ctx, Msg{Op: OpForget, ID: id}, func(m Msg) (bool, error) { return m.Op == OpEnd, nil }); err != nil {
			return err
		}
	}
	c.mu.Lock()
	c.ready = conn
	c.mu.Unlock()
	return nil
}

// request sends m and hands each answer to take until it says done (or
// fails). Under reqMu.
func (c *Client) request(ctx context.Context, m Msg, take func(Msg) (done bool, err error)) error {
	c.mu.Lock()
	conn, answers, lost := c.conn, c.answers, c.lost
	c.mu.Unlock()
	if conn == nil {
		return errors.New("shunt-vsockd not connected")
	}
	fail := func(err error) error {
		conn.Close() // the reader ends, the connection is lost, keep dials again
		return err
	}
	_ = conn.SetWriteDeadline(time.Now().Add(answerWait))
	if err := write(conn, m); err != nil {
		return fail(fmt.Errorf("shunt-vsockd: send %s: %w", m.Op, err))
	}
	for {
		select {
		case a := <-answers:
			if a.Op == OpError {
				if m.Op == OpDevice {
					// One device refused is that VM's alone.
					c.log.Error("shunt-vsockd refused a device", "guest", m.Device.Guest, "error", a.Error)
					return nil
				}
				return fail(fmt.Errorf("shunt-vsockd: %s: %s", m.Op, a.Error))
			}
			done, err := take(a)
			if err != nil {
				return fail(err)
			}
			if done {
				return nil
			}
		case <-lost:
			return errors.New("shunt-vsockd: connection lost")
		case <-ctx.Done():
			return fail(fmt.Errorf("shunt-vsockd: no answer to %s: %w", m.Op, ctx.Err()))
		}
	}
}

// reader takes conn's messages: frontend events into served, answers to
// the request waiting for them. A bad message, or a request's answers
// piling up unread, ends the connection.
func (c *Client) reader(conn *net.UnixConn, answers chan Msg, lost chan struct{}) {
	defer c.wg.Done()
	var err error
	for {
		var m Msg
		if m, err = read(conn); err != nil {
			break
		}
		if m.Op == OpFrontend {
			c.mu.Lock()
			if c.want[m.ID] {
				c.served[m.ID] = m.Connected
			}
			c.mu.Unlock()
			c.log.Info("shunt-vsockd: a device's QEMU", "id", m.ID, "connected", m.Connected)
			continue
		}
		select {
		case answers <- m:
		default:
			err = fmt.Errorf("%w: answers nobody asked for", ErrProto)
		}
		if err != nil {
			break
		}
	}
	conn.Close()
	c.mu.Lock()
	if c.conn == conn {
		c.conn = nil
	}
	wasReady := c.ready == conn
	if wasReady {
		c.ready = nil
	}
	c.mu.Unlock()
	close(lost)
	select {
	case <-c.stop:
	default:
		if wasReady {
			c.log.Warn("lost shunt-vsockd; its VMs' vsock counts as down until it answers again (dialing every second)", "socket", c.path, "error", err)
		}
	}
}
