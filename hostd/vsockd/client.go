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

// connectWait bounds a redial's whole exchange with n devices: hello,
// list, forgets, one device each (a device made takes a socket and a
// room; one kept, a round trip).
func connectWait(n int) time.Duration { return answerWait + time.Duration(n)*10*time.Millisecond }

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
	version int             // the protocol version spoken, once connected
	ousted  bool            // a newer hostd took the daemon over: no redial
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
		c.mu.Lock()
		ousted := c.ousted
		c.mu.Unlock()
		if ousted {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), connectWait(len(c.devs)))
		err := c.connect(ctx)
		cancel()
		if err != nil {
			c.log.Debug("shunt-vsockd", "error", err)
		}
	}
}

// connect dials, says hello, forgets the daemon's devices hostd no
// longer has (first, so that a device whose guest now has another's
// socket or CID is not refused for the stale one's), then names hostd's.
// A device is stale when no device hostd names has its socket or its
// id: one that kept either is renamed or changed by its device request,
// where the daemon refuses to close one whose QEMU is connected.
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
		if m.Op != OpHello || m.Version < MinVersion || m.Version > Version {
			return false, fmt.Errorf("%w: %s (version %d) for hello, want %d to %d (upgrade shunt-vsockd when its VMs can restart)", ErrProto, m.Op, m.Version, MinVersion, Version)
		}
		c.mu.Lock()
		c.pid, c.version = m.PID, m.Version
		c.mu.Unlock()
		return true, nil
	}); err != nil {
		return err
	}
	sockets := map[string]bool{}
	for _, d := range c.devs {
		sockets[d.Socket] = true
	}
	type dev struct {
		id    uint32
		guest string
	}
	var stale []dev
	if err := c.request(ctx, Msg{Op: OpList}, func(m Msg) (bool, error) {
		switch m.Op {
		case OpStat:
			if !c.want[m.ID] && !sockets[m.Stat.Socket] {
				stale = append(stale, dev{m.ID, m.Stat.Guest})
			}
			return false, nil
		case OpEnd:
			return true, nil
		}
		return false, fmt.Errorf("%w: %s in a list", ErrProto, m.Op)
	}); err != nil {
		return err
	}
	for _, s := range stale {
		c.log.Info("shunt-vsockd's device of a guest hostd no longer has: forgotten", "guest", s.guest, "id", s.id)
		if err := c.request(ctx, Msg{Op: OpForget, ID: s.id}, func(m Msg) (bool, error) { return m.Op == OpEnd, nil }); err != nil {
			return err
		}
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
	c.mu.Lock()
	c.ready = conn
	c.mu.Unlock()
	return nil
}

// request sends m and hands each answer to take until it says done (or
// fails), each answer within answerWait. Under reqMu.
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
	t := time.NewTimer(answerWait)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			return fail(fmt.Errorf("shunt-vsockd: no answer to %s within %v", m.Op, answerWait))
		case a := <-answers:
			t.Reset(answerWait)
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
// the request waiting for them (a list streams through answers, each
// taken within answerWait). A bad message, answers nobody takes, or a
// bye (a newer hostd took the daemon over: this one stops dialing) ends
// the connection.
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
		if m.Op == OpBye {
			c.mu.Lock()
			c.ousted = true
			c.mu.Unlock()
			c.log.Error("another hostd took shunt-vsockd over: this one no longer names its devices, nor dials it again (is a second hostd running?)", "daemon_said", m.Error)
			err = errors.New(m.Error)
			break
		}
		t := time.NewTimer(answerWait)
		select {
		case answers <- m:
		case <-t.C:
			err = fmt.Errorf("%w: answers nobody takes", ErrProto)
		case <-c.stop:
			err = net.ErrClosed
		}
		t.Stop()
		if err != nil {
			break
		}
	}
	conn.Close()
	c.mu.Lock()
	if c.conn == conn {
		c.conn = nil
	}
	wasReady := c.ready == conn && !c.ousted
	if c.ready == conn {
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
