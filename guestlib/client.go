package guestlib

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/wait"
	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// Options configure a Client. The zero value reads the environment, and
// inside a VM finds the control port and the region on its own.
type Options struct {
	// Control is the control socket, or a virtio-serial port's character
	// device. "" = $SHUNT_CONTROL, else /run/shunt/guest.sock if it
	// exists, else the first of the VM's control ports that no other
	// process holds (docs/vm.md, "Discovery").
	Control string
	// Region is the region file to map instead of the one hostd names.
	// "" = $SHUNT_REGION, else on a control port the ivshmem BAR, else
	// what hostd says.
	Region  string
	Wait    *wait.Policy // nil = $SHUNT_WAIT or adaptive
	Disable bool         // always plain TCP ($SHUNT_DISABLE=1)
	// Logf, if set, receives a line per path change of a connection,
	// with the reason (shunt-run -v uses it).
	Logf func(format string, args ...any)
	// Kick makes ends wake their peers through hostd (KICK) instead of
	// futexes: for VMs, whose peers are in other guest kernels. It is set
	// on its own once the control channel is a virtio-serial port.
	Kick bool
	// OpenDelay is how long a new connection stays on TCP before it is
	// offered to hostd at all: a connection closed sooner (an HTTP/1.0
	// request, an RPC per connection) costs hostd nothing and the program
	// nothing, as flow offload in a router waits for a flow to prove
	// itself. 0 = $SHUNT_OPEN_DELAY_MS, else DefaultOpenDelay; negative:
	// offer at once. It is the least delay: the Client doubles it while
	// the connections it offers end soon after (up to 200 ms) and halves
	// it again as they live long (delay.go).
	OpenDelay time.Duration
	// Vsock carries the flows whose region this process cannot map over
	// vsock stretches to the host (docs/vsock.md): a VM without a Shunt
	// ivshmem device whose hostd.hcl entry has a vsock block. Also
	// $SHUNT_VSOCK=1. Off by default: experimental (docs/vsock.md).
	Vsock bool
}

// DefaultOpenDelay is OpenDelay's default: well under the 50 ms in which
// two processes that connect to each other at once reach the rings, well
// over the life of a short connection on this kind of host (~0.1 ms).
const DefaultOpenDelay = 5 * time.Millisecond

// defaultControl is the control socket of a process guest (shunt-run).
const defaultControl = "/run/shunt/guest.sock"

// withEnv fills in the environment's settings. discover is true when
// neither o nor the environment names the control channel (SHUNT_CONTROL
// unset, as the C core's rule is): then a VM's ports are looked for
// whenever nothing is at the default socket.
func (o Options) withEnv() (_ Options, discover bool, _ error) {
	env, set := os.LookupEnv("SHUNT_CONTROL")
	if o.Control == "" {
		o.Control, discover = env, !set
	}
	if o.Control == "" {
		o.Control = defaultControl
	}
	if o.Region == "" {
		o.Region = os.Getenv("SHUNT_REGION")
	}
	if o.Wait == nil {
		o.Wait = &wait.Policy{Mode: wait.Adaptive}
		if s := os.Getenv("SHUNT_WAIT"); s != "" {
			m, err := wait.ParseMode(s)
			if err != nil {
				return o, false, fmt.Errorf("SHUNT_WAIT: %w", err)
			}
			o.Wait.Mode = m
		}
	}
	if os.Getenv("SHUNT_DISABLE") == "1" {
		o.Disable = true
	}
	if o.OpenDelay == 0 {
		o.OpenDelay = DefaultOpenDelay
		if s := os.Getenv("SHUNT_OPEN_DELAY_MS"); s != "" {
			ms, err := strconv.Atoi(s)
			if err != nil {
				return o, false, fmt.Errorf("SHUNT_OPEN_DELAY_MS: %w", err)
			}
			o.OpenDelay = time.Duration(ms) * time.Millisecond
			if ms == 0 {
				o.OpenDelay = -1 // at once
			}
		}
	}
	return o, discover, nil
}

// retryEvery is how often a Listen tries a missing hostd again; a Dial or
// Accept never waits for hostd (the background reconnect offers its
// connections when hostd answers).
const retryEvery = time.Second

// Client is a guest process's session with hostd, shared by its Dialers and
// Listeners. It is safe for concurrent use. It owns the control channel:
// one writer goroutine per session writes every control message (see
// session), one reader dispatches hostd's answers, and Conns talk to it
// only through its methods. It reconnects on its own when hostd restarts;
// Close ends the session and waits for its goroutines.
type Client struct {
	opts     Options
	discover bool   // Control is the default: look for a VM's ports when nothing is there
	vm       vmRoot // where a VM's ports and BAR are looked for
	// kick is set once, for Options.Kick or when a control port opens (VM
	// mode): from then on ends wake their peers by KICK.
	kick atomic.Pointer[kickSignal]
	// busyLogged: the log has said that every port is busy, since the
	// last session (one line, not one a retry).
	busyLogged atomic.Bool
	// vsockCtl: the control channel is over vsock, so the flows go over
	// vsock stretches (a VM without virtio-serial has no region either).
	vsockCtl atomic.Bool

	// loopback lets package tests ask hostd about loopback connections,
	// which real guests never do.
	loopback bool

	opens opener     // the delayed OPENs
	delay *openDelay // how long they wait now (delay.go)

	mu         sync.Mutex
	sess       *session // nil while disconnected
	connecting chan struct{}
	region     *region.Region      // region 0, mapped on first connect if WELCOME names one, kept for the client's life
	regions    map[uint32]*mapping // the others, by id: pair regions that came by REGION
	guestID    uint32
	nextReq    uint32
	conns      map[uint32]*Conn // every connection offered to hostd, by request id, until Close
	pongs      map[uint64]chan struct{}
	nonce      uint64
	flows      map[flowKey]*Conn // connections holding rings, by flow (REVOKE, KICK, DOWN after REATTACH)
	listens    map[netip.AddrPort]int
	closes     []proto.Msg // CLOSEs and LEFTs to write when the queue has room or once reconnected
	lastTry    time.Time
	lastErr    error
	said       string // the last failure to reach hostd that was logged: each kind is said once
	retrying   bool   // a reconnect goroutine runs
	connected  bool   // a session was installed once (later ones are reconnects)
	closed     bool
	reconnects int
	done       chan struct{}
	wg         sync.WaitGroup
}

// flowKey names a flow: its region, slot and generation.
type flowKey struct {
	region uint32
	slot   uint32
	gen    uint64
}

func keyOf(m proto.Msg) flowKey { return flowKey{m.RegionID, m.Slot, m.Gen} }

// NewClient returns a client; it connects to hostd lazily, on first use.
func NewClient(opts Options) (*Client, error) {
	o, discover, err := opts.withEnv()
	if err != nil {
		return nil, err
	}
	c := &Client{
		opts: o, discover: discover, vm: hostRoot,
		conns: map[uint32]*Conn{}, pongs: map[uint64]chan struct{}{}, flows: map[flowKey]*Conn{}, regions: map[uint32]*mapping{},
		listens: map[netip.AddrPort]int{}, done: make(chan struct{}), delay: newOpenDelay(o.OpenDelay),
	}
	if o.Kick {
		c.enableKicks()
	}
	return c, nil
}

// enableKicks puts the client in VM mode for good: flows attached from
// now on sleep and wake through KICK.
func (c *Client) enableKicks() {
	if c.kick.Load() == nil {
		c.kick.CompareAndSwap(nil, newKickSignal(c, *c.opts.Wait))
	}
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

// errNotGuest: hostd refused the session, the process not being in the
// guest's network namespace (ERROR(not-guest), hostd/server.PeerIn).
var errNotGuest = errors.New("not in the guest's network namespace")

// ensure connects if not connected, at most once per retryEvery. The dial
// and HELLO run outside the mutex; callers arriving meanwhile wait for
// that attempt instead of starting their own.
func (c *Client) ensure() error {
	c.mu.Lock()
	for {
		if c.closed {
			c.mu.Unlock()
			return net.ErrClosed
		}
		if c.sess != nil {
			c.mu.Unlock()
			return nil
		}
		if c.connecting == nil {
			break
		}
		ch := c.connecting
		c.mu.Unlock()
		<-ch // bounded by the dial and HELLO timeouts
		c.mu.Lock()
		if c.sess == nil {
			err := c.lastErr
			c.mu.Unlock()
			return fmt.Errorf("%w: %w", errNoHostd, err)
		}
	}
	if time.Since(c.lastTry) < retryEvery {
		err := c.lastErr
		c.mu.Unlock()
		return fmt.Errorf("%w: %w", errNoHostd, err)
	}
	c.lastTry = time.Now()
	err := c.connectUnlocked()
	c.mu.Unlock()
	if err != nil {
		return fmt.Errorf("%w: %w", errNoHostd, err)
	}
	return nil
}

// connectUnlocked is called and returns with mu held, but releases it
// while it dials and says HELLO; it installs the session under mu.
func (c *Client) connectUnlocked() error {
	done := make(chan struct{})
	c.connecting = done
	regionPath, mapped := c.opts.Region, c.region != nil
	c.mu.Unlock()

	conn, welcome, r, err := c.handshake(regionPath, mapped)
	if err == nil && mapped {
		c.remapRegionZero(welcome) // a VM's device plugged back (remap.go)
	}

	c.mu.Lock()
	c.connecting = nil
	defer close(done)
	if err == nil && c.closed {
		err = net.ErrClosed
	}
	c.lastErr = err
	if err != nil && err.Error() != c.said && !errors.Is(err, vserial.ErrAllBusy) && !errors.Is(err, net.ErrClosed) { // handshake said busy ports
		c.said = err.Error()
		reason := c.downReasonLocked()
		c.logf("shunt: cannot reach hostd: %v: connections stay on TCP (%s); a process or container guest with netns in hostd.hcl may connect whatever its user or root directory (docs/preload.md, \"Privileges and chroot\")", err, reason)
	} else if err == nil {
		c.said = ""
	}
	if err != nil {
		if conn != nil {
			conn.Close()
		}
		if r != nil {
			r.Close()
		}
		return err
	}
	if r != nil {
		c.region = r
	}
	if c.connected {
		c.reconnects++
	}
	c.connected = true
	c.install(conn, welcome)
	return nil
}

// handshake dials hostd, says HELLO and maps the region if not yet mapped.
// It takes no lock.
func (c *Client) handshake(regionPath string, mapped bool) (net.Conn, proto.Msg, *region.Region, error) {
	conn, err := c.dialControl()
	if errors.Is(err, vserial.ErrAllBusy) && c.busyLogged.CompareAndSwap(false, true) {
		c.logf("shunt: %v; connections stay on TCP (%s) until a port is free", err, proto.ReasonControlLimit)
	}
	if err != nil {
		return nil, proto.Msg{}, nil, err
	}
	c.busyLogged.Store(false)
	m, err := hello(conn)
	if err != nil {
		return conn, m, nil, err
	}
	port, onPort := conn.(portConn)
	if onPort {
		c.enableKicks()
		c.logf("shunt: control port %s", port.Name())
	}
	if _, ok := conn.(vsockConn); ok {
		c.vsockCtl.Store(true) // its flows go over vsock stretches (stretches)
		c.logf("shunt: control over vsock (port %#x)", proto.VsockControlPort)
	}
	if mapped {
		return conn, m, nil, nil
	}
	if regionPath == "" && onPort && m.RegionSize != 0 {
		// The region is the ivshmem device's BAR: the path in WELCOME
		// is the host's. (A WELCOME without region 0 is a VM with pair
		// regions, which come as devices of their own: bar.go.)
		bar, err := ivshmem.Find(c.vm.sysfs)
		if err != nil && !errors.Is(err, ivshmem.ErrNotFound) {
			return conn, m, nil, fmt.Errorf("map the region: %w", err)
		}
		regionPath = bar
	}
	if regionPath == "" {
		regionPath = m.Region
	}
	if regionPath == "" {
		return conn, m, nil, nil // no region 0: regions come by REGION
	}
	r, err := region.Open(regionPath)
	if err != nil {
		return conn, m, nil, fmt.Errorf("map the region: %w", err)
	}
	return conn, m, r, nil
}

// install makes conn the client's session: it queues what a new hostd must
// learn from this process ahead of anything else, and starts the session's
// goroutines. The caller holds mu.
func (c *Client) install(conn net.Conn, welcome proto.Msg) {
	s := newSession(conn)
	c.guestID = welcome.GuestID
	s.announce = c.announcementsLocked()
	s.poke()
	c.sess = s
	c.wg.Add(2)
	go c.writeLoop(s)
	go c.readLoop(s)
	if s.onPort() || s.onVsock() {
		c.wg.Add(1)
		go c.keepalive(s)
	}
}

// welcomed handles a WELCOME after the first (a new hostd behind a VM's
// port): it gets this process's listeners, flows and undelivered CLOSEs.
func (c *Client) welcomed(s *session) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sess != s {
		return
	}
	s.announce = append(s.announce, c.announcementsLocked()...)
	s.poke()
	c.reconnects++
}

// announcementsLocked is what a new hostd must learn from this process:
// its listeners, the CLOSEs and LEFTs it could not deliver, REATTACH for
// each connection holding rings and OPEN again, with the same request id,
// for each on TCP (so the new hostd can pair and upgrade it).
func (c *Client) announcementsLocked() []proto.Msg {
	var msgs []proto.Msg
	for a := range c.listens {
		msgs = append(msgs, proto.Msg{Type: proto.Listen, Local: a})
	}
	msgs = append(msgs, c.closes...)
	c.closes = nil
	for _, conn := range c.conns {
		if f := conn.cur.Load(); f != nil {
			k := f.key
			msgs = append(msgs, proto.Msg{Type: proto.Reattach, ReqID: conn.req, RegionID: k.region, Slot: k.slot, Gen: k.gen, Side: f.side, Local: conn.local, Remote: conn.remote})
			continue
		}
		msgs = append(msgs, conn.openMsg())
	}
	return msgs
}

// parked hands the writer of s the work parked for it: announcements and
// CLOSEs that did not fit the queue.
func (c *Client) parked(s *session) []proto.Msg {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sess != s {
		return nil
	}
	batch := append(s.announce, c.closes...)
	s.announce, c.closes = nil, nil
	return batch
}

// lost is the end of session s: connections keep their paths (nothing
// waits for hostd) and, unless the client is closed, it reconnects in the
// background.
func (c *Client) lost(s *session) {
	c.mu.Lock()
	if c.sess != s {
		c.mu.Unlock()
		return
	}
	c.sess = nil
	c.retryLocked()
	c.mu.Unlock()
	c.tellNoHostd()
}

// retryLocked starts the reconnect goroutine unless it runs, the client
// is closed or connected.
func (c *Client) retryLocked() {
	if c.retrying || c.closed || c.sess != nil {
		return
	}
	c.retrying = true
	delay := time.Duration(0) // the first try of a fresh client: at once
	if c.connected || c.lastErr != nil {
		delay = 20 * time.Millisecond
	}
	c.wg.Add(1)
	go c.reconnect(delay)
}

// reconnect retries hostd with backoff (20 ms to 1 s) until it answers,
// Close, or nothing is left to announce (no connection, no listener).
func (c *Client) reconnect(delay time.Duration) {
	defer c.wg.Done()
	t := time.NewTimer(delay)
	defer t.Stop()
	for {
		select {
		case <-c.done:
			c.mu.Lock()
			c.retrying = false
			c.mu.Unlock()
			return
		case <-t.C:
		}
		c.mu.Lock()
		if c.closed || c.sess != nil || len(c.conns) == 0 && len(c.listens) == 0 && len(c.closes) == 0 {
			c.retrying = false
			c.mu.Unlock()
			return
		}
		failed := false
		if c.connecting == nil { // else a Listen is trying: look again later
			c.lastTry = time.Now()
			if err := c.connectUnlocked(); err == nil {
				c.retrying = false
				c.mu.Unlock()
				return
			}
			failed = true
		}
		c.mu.Unlock()
		if failed {
			c.tellNoHostd()
		}
		delay = min(max(2*delay, 20*time.Millisecond), time.Second)
		t.Reset(delay)
	}
}

// send queues m for hostd without blocking. A CLOSE or LEFT is never
// lost: when disconnected or when the queue is full it is parked and
// written later. A KICK that does not fit is dropped (sleepers wake on
// their own bound).
func (c *Client) send(m proto.Msg) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sendLocked(m)
}

func (c *Client) sendLocked(m proto.Msg) error {
	s := c.sess
	keep := m.Type == proto.Close || m.Type == proto.Left || m.Type == proto.Ended
	if s == nil {
		if keep {
			c.closes = append(c.closes, m)
		}
		return errNoHostd
	}
	select {
	case s.out <- m:
		return nil
	default:
	}
	if keep {
		c.closes = append(c.closes, m)
		s.poke()
		return nil
	}
	return errQueueFull
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
	t := time.NewTimer(timeout)
	defer t.Stop()
	if err == nil {
		select {
		case <-ch:
			return nil
		case <-t.C:
			err = errNoHostd
		}
	}
	c.mu.Lock()
	delete(c.pongs, n)
	c.mu.Unlock()
	return err
}

func (c *Client) ponged(nonce uint64) {
	c.mu.Lock()
	ch := c.pongs[nonce]
	delete(c.pongs, nonce)
	c.mu.Unlock()
	if ch != nil {
		close(ch)
	}
}

// listen announces a listening address (counted: several Listeners may
// share one; hostd keeps a set) and waits until hostd has it, so a peer's
// connection cannot overtake it. A session opened here announces it with
// the rest.
func (c *Client) listen(a netip.AddrPort) {
	c.mu.Lock()
	c.listens[a]++
	first, live := c.listens[a] == 1, c.sess != nil
	if first && live {
		_ = c.sendLocked(proto.Msg{Type: proto.Listen, Local: a})
	}
	c.mu.Unlock()
	if !live && c.ensure() != nil {
		c.mu.Lock()
		c.retryLocked() // announced when hostd answers
		c.mu.Unlock()
		return
	}
	if first {
		_ = c.sync(time.Second)
	}
}

// unlisten drops one announcement of a; the last one tells hostd.
func (c *Client) unlisten(a netip.AddrPort) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.listens[a]--; c.listens[a] <= 0 {
		delete(c.listens, a)
		_ = c.sendLocked(proto.Msg{Type: proto.Unlisten, Local: a})
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

// Close ends the session with hostd and waits for its goroutines.
// Fast-path connections already open keep working; new ones use TCP.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	close(c.done)
	s := c.sess
	c.mu.Unlock()
	c.opens.end()
	if s != nil {
		s.end()
	}
	c.wg.Wait()
	return nil
}
