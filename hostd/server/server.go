package server

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
)

// Endpoint is one guest's control socket.
type Endpoint struct {
	Guest *broker.Guest
	Path  string
	// Gid, if not zero, is a group that may connect too: the socket is
	// then hostd's user's and this group's, mode 0660. It is for a VM's
	// QEMU that runs unprivileged (libvirt's libvirt-qemu:kvm), which
	// connects to the socket: its trust group's region_group, whose
	// members map the group's region anyway. Zero: mode 0600, hostd's
	// user only.
	Gid int
	// Netns, if set, is the guest's network namespace (a process or
	// container guest: /run/netns/NAME, /proc/PID/ns/net). The guest is
	// then the principal, not a uid: the socket is mode 0666 and every
	// connection is checked to come from a process in that namespace
	// (PeerIn), and hostd also serves the guest on the abstract socket
	// proto.NetnsControl inside the namespace, which its processes reach
	// after a chroot too. Not with Gid.
	Netns string
}

// Options bound what one guest may hold of the control server and how
// long a session may stay quiet. Zero fields take the defaults of
// hostd.hcl's limits block (docs/config.md).
type Options struct {
	// SessionsPerGuest bounds a guest's sessions at once, over all its
	// sockets, before HELLO too; a session beyond it gets
	// ERROR(control-limit) and is closed. Default 256.
	SessionsPerGuest int
	// SessionRate bounds how many new sessions a second hostd accepts
	// from a guest (a burst of as many is allowed); beyond, its
	// connections wait in the socket's backlog. Default 100.
	SessionRate int
	// Keepalive: hostd PINGs a session whose guest said nothing this long
	// (after WELCOME). Default 2 s.
	Keepalive time.Duration
	// Silence: a session whose guest said nothing this long, or whose
	// HELLO or any frame took this long to arrive, or that did not take a
	// write for this long, is closed. Default 10 s.
	Silence time.Duration
}

func (o Options) withDefaults() Options {
	if o.SessionsPerGuest <= 0 {
		o.SessionsPerGuest = 256
	}
	if o.SessionRate <= 0 {
		o.SessionRate = 100
	}
	if o.Keepalive <= 0 {
		o.Keepalive = 2 * time.Second
	}
	if o.Silence <= 0 {
		o.Silence = max(10*time.Second, 2*o.Keepalive)
	}
	return o
}

// Accept errors (EMFILE when the process is out of descriptors, ...) are
// retried after a backoff that starts at acceptBackoffMin and doubles up
// to acceptBackoffMax; a successful accept resets it.
const (
	acceptBackoffMin = 5 * time.Millisecond
	acceptBackoffMax = time.Second
)

// Server owns the control sockets and their sessions. Endpoints can come
// and go while it runs (libvirt domains starting and stopping). It is safe
// for concurrent use. Close stops accepting, closes every session and waits
// for their goroutines.
type Server struct {
	log  hclog.Logger
	b    *broker.Broker
	m    *metrics.Set
	opts Options
	wg   sync.WaitGroup

	mu        sync.Mutex
	listeners map[*broker.Guest][]*listener // a VM has one per control port; nil: the container socket (AddShared)
	sessions  map[*session]bool
	perGuest  map[*broker.Guest]int // sessions of each guest, before HELLO too
	logged    map[logKey]*logState  // see quiet
	buckets   map[*broker.Guest]*bucket
	admitted  map[*broker.Guest]bool // served on the container socket (Admit)
	closed    bool
}

// bucket paces a guest's new sessions (Options.SessionRate): a token
// bucket of SessionRate tokens, refilled at SessionRate a second.
type bucket struct {
	tokens float64
	last   time.Time
}

// pace waits until guest g may have another session, or l closes (then
// it reports false). A guest that connects faster than SessionRate only
// fills its own socket's backlog: hostd spends no more on it.
func (s *Server) pace(l *listener, g *broker.Guest) bool {
	for {
		wait := s.take(g)
		if wait == 0 {
			return true
		}
		t := time.NewTimer(wait)
		select {
		case <-l.done:
			t.Stop()
			return false
		case <-t.C:
		}
	}
}

// take takes one of guest g's session tokens and returns 0, or returns
// how long until it has one.
func (s *Server) take(g *broker.Guest) time.Duration {
	rate := float64(s.opts.SessionRate)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.buckets == nil {
		s.buckets = map[*broker.Guest]*bucket{}
	}
	b := s.buckets[g]
	now := time.Now()
	if b == nil {
		b = &bucket{tokens: rate, last: now}
		s.buckets[g] = b
	}
	b.tokens = min(rate, b.tokens+now.Sub(b.last).Seconds()*rate)
	b.last = now
	if b.tokens >= 1 {
		b.tokens--
		return 0
	}
	return max(time.Duration((1-b.tokens)/rate*float64(time.Second)), time.Nanosecond)
}

// A guest's sessions can fail in the same way thousands of times a second
// (a flood of malformed reconnects): quiet logs the first at once, and
// then at most one a minute per guest and kind, with how many there were.
type logKey struct {
	g    *broker.Guest
	what string
}

type logState struct {
	last time.Time
	more int
}

const quietEvery = time.Minute

// quiet reports whether to log a failure of kind what of guest g, and how
// many went unlogged before it.
func (s *Server) quiet(g *broker.Guest, what string) (bool, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.logged == nil {
		s.logged = map[logKey]*logState{}
	}
	k := logKey{g, what}
	st := s.logged[k]
	now := time.Now()
	switch {
	case st == nil:
		s.logged[k] = &logState{last: now}
		return true, 0
	case now.Sub(st.last) < quietEvery:
		st.more++
		return false, 0
	}
	more := st.more
	st.last, st.more = now, 0
	return true, more
}

type listener struct {
	net.Listener
	path   string // "" for the abstract socket in the guest's namespace
	netns  *Netns // if set, each connection's process must be in it (PeerIn)
	nsPath string
	once   sync.Once
	done   chan struct{} // closed when the listener is closed (Remove, Close)
}

func (l *listener) close() {
	l.once.Do(func() {
		close(l.done)
		l.Listener.Close()
	})
}

// Listen starts a server with the given endpoints (see Add). The server
// owns the sockets it creates and removes them in Remove; it uses b and m
// but does not close them. On error, what was started is closed again.
func Listen(log hclog.Logger, b *broker.Broker, m *metrics.Set, opts Options, eps []Endpoint) (*Server, error) {
	s := &Server{log: log, b: b, m: m, opts: opts.withDefaults(),
		listeners: map[*broker.Guest][]*listener{}, sessions: map[*session]bool{}, perGuest: map[*broker.Guest]int{}}
	for _, ep := range eps {
		if err := s.Add(ep); err != nil {
			s.Close()
			return nil, err
		}
	}
	return s, nil
}

// Add creates an endpoint's socket (replacing a stale one) with mode 0600,
// or 0660 for its group (Endpoint.Gid), or 0666 with each connection
// checked for the guest's namespace (Endpoint.Netns, which also opens the
// abstract socket in the namespace), and starts accepting on it. A guest
// may have several endpoints.
func (s *Server) Add(ep Endpoint) error {
	var ns *Netns
	if ep.Netns != "" {
		if ep.Gid != 0 {
			return fmt.Errorf("control socket for guest %s: a group and a network namespace: give one", ep.Guest.Name)
		}
		n, err := NetnsOf(ep.Netns)
		if err != nil {
			return fmt.Errorf("control socket for guest %s: %w", ep.Guest.Name, err)
		}
		ns = &n
	}
	if err := os.MkdirAll(filepath.Dir(ep.Path), 0o755); err != nil {
		return fmt.Errorf("control socket dir for %s: %w", ep.Guest.Name, err)
	}
	_ = os.Remove(ep.Path)
	l, err := net.Listen("unix", ep.Path)
	if err != nil {
		return fmt.Errorf("control socket for guest %s: %w", ep.Guest.Name, err)
	}
	if err := socketAccess(ep); err != nil {
		l.Close()
		return fmt.Errorf("control socket for guest %s: %w", ep.Guest.Name, err)
	}
	lns := []*listener{{Listener: l, path: ep.Path, netns: ns, done: make(chan struct{})}}
	if ns != nil && !s.servesNetns(ep.Guest) {
		// Best effort: a guest whose namespace already has the name
		// (another hostd, or its own process) keeps its path.
		if al, err := listenIn(ep.Netns); err != nil {
			s.log.Warn("no control socket inside the guest's network namespace: its processes need the path (not after a chroot)", "guest", ep.Guest.Name, "netns", ep.Netns, "error", err)
		} else {
			lns = append(lns, &listener{Listener: al, nsPath: ep.Netns, done: make(chan struct{})})
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		for _, ln := range lns {
			ln.Listener.Close()
		}
		return fmt.Errorf("control socket for guest %s: server closed", ep.Guest.Name)
	}
	for _, ln := range lns {
		s.listeners[ep.Guest] = append(s.listeners[ep.Guest], ln)
		s.wg.Add(1)
		go s.accept(ln, ep.Guest)
	}
	return nil
}

// servesNetns reports whether guest g has its abstract socket already
// (a guest with several endpoints gets one).
func (s *Server) servesNetns(g *broker.Guest) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.ContainsFunc(s.listeners[g], func(l *listener) bool { return l.nsPath != "" })
}

// socketAccess gives ep's new socket its owner and mode: 0600, or its
// group (first, so that the mode never applies to another group) and
// 0660, or 0666 for a guest with a network namespace, whose connections
// are checked one by one (PeerIn) instead. Until then the socket has the
// umask's mode, which lets no one else connect (connect needs write
// permission).
func socketAccess(ep Endpoint) error {
	if ep.Netns != "" {
		return os.Chmod(ep.Path, 0o666)
	}
	if ep.Gid == 0 {
		return os.Chmod(ep.Path, 0o600)
	}
	if err := os.Lchown(ep.Path, -1, ep.Gid); err != nil {
		return err
	}
	return os.Chmod(ep.Path, 0o660)
}

// Remove stops serving guest g: its socket is closed and removed and its
// sessions are closed (which detaches them from the broker).
func (s *Server) Remove(g *broker.Guest) {
	s.mu.Lock()
	ls := s.listeners[g]
	delete(s.listeners, g)
	delete(s.admitted, g) // before the sessions are listed: no new one starts after
	var ss []*session
	for x := range s.sessions {
		if x.g == g {
			ss = append(ss, x)
		}
	}
	s.mu.Unlock()
	for _, l := range ls {
		l.close()
		if l.path != "" {
			_ = os.Remove(l.path)
		}
	}
	s.mu.Lock()
	for k := range s.logged {
		if k.g == g {
			delete(s.logged, k)
		}
	}
	delete(s.buckets, g)
	s.mu.Unlock()
	for _, x := range ss {
		x.shutdown()
	}
}

// accept serves one control socket until it is closed. It never gives up
// on an error: running out of descriptors (EMFILE, a guest's session flood
// can cause it) is retried with backoff, counted and logged, so other
// guests' sockets and this one recover once descriptors are free again.
func (s *Server) accept(l *listener, g *broker.Guest) {
	defer s.wg.Done()
	var delay time.Duration
	for {
		if !s.pace(l, g) {
			return
		}
		c, ok := s.acceptOne(l, g.Name, &delay)
		if !ok {
			return
		}
		if c == nil {
			continue
		}
		s.mu.Lock()
		if s.closed || !slices.Contains(s.listeners[g], l) {
			s.mu.Unlock() // closed, or the guest was removed meanwhile
			c.Close()
			return
		}
		if n := s.perGuest[g]; n >= s.opts.SessionsPerGuest {
			s.mu.Unlock()
			s.refuse(c, g, n)
			continue
		}
		if l.netns != nil {
			s.mu.Unlock()
			if err := PeerIn(c, *l.netns); err != nil {
				s.refuseStranger(c, g, err)
				continue
			}
			s.mu.Lock()
			if s.closed || !slices.Contains(s.listeners[g], l) {
				s.mu.Unlock()
				c.Close()
				return
			}
			if n := s.perGuest[g]; n >= s.opts.SessionsPerGuest {
				s.mu.Unlock()
				s.refuse(c, g, n)
				continue
			}
		}
		s.startLocked(c, g)
	}
}

// acceptOne accepts the next connection on l, or returns nil after an
// error it waited a backoff for (delay carries it from call to call, as
// accept says), or reports false once l is closed.
func (s *Server) acceptOne(l *listener, who string, delay *time.Duration) (net.Conn, bool) {
	c, err := l.Accept()
	if err == nil {
		if *delay != 0 {
			s.log.Info("accepting on the control socket again", "guest", who)
			*delay = 0
		}
		return c, true
	}
	select {
	case <-l.done:
		return nil, false
	default:
	}
	if errors.Is(err, net.ErrClosed) {
		return nil, false
	}
	s.m.AcceptErrors.Inc()
	if *delay == 0 {
		s.log.Warn("accept on a control socket failed; retrying with backoff (counted in shunt_control_accept_errors_total)", "guest", who, "error", err)
	}
	*delay = min(max(2**delay, acceptBackoffMin), acceptBackoffMax)
	t := time.NewTimer(*delay)
	select {
	case <-l.done:
		t.Stop()
		return nil, false
	case <-t.C:
	}
	return nil, true
}

// startLocked serves c as a session of guest g; s.mu is held, and
// released.
func (s *Server) startLocked(c net.Conn, g *broker.Guest) {
	s.perGuest[g]++
	ss := newSession(s, c, g)
	s.sessions[ss] = true
	s.mu.Unlock()
	s.wg.Add(2)
	go ss.writeLoop()
	go ss.readLoop()
}

// refuseWrite bounds the one write to a session refused at accept: a
// fresh socket takes it at once, so this only guards the accept loop.
const refuseWrite = 100 * time.Millisecond

// refuse answers a session over the guest's limit with ERROR(control-limit)
// and closes it, on the accept loop (the write goes to a fresh socket's
// empty buffer and is bounded by refuseWrite).
func (s *Server) refuse(c net.Conn, g *broker.Guest, n int) {
	s.b.Limited(g, metrics.LimitSessions, s.opts.SessionsPerGuest)
	s.refuseWith(c, proto.ReasonControlLimit, fmt.Sprintf("guest %s has %d control sessions, its limit (limits.sessions_per_guest): close one and connect again", g.Name, n))
}

// refuseStranger answers a connection from a process outside guest g's
// network namespace with ERROR(not-guest), saying why and what to do, and
// closes it. The answer follows the process's HELLO (or strangerWait
// without one), so that the HELLO never meets a closed socket and the
// process reads the reason; it runs on a goroutine of its own, since the
// accept loop waits for no guest. Logged once a minute per guest,
// counted always.
func (s *Server) refuseStranger(c net.Conn, g *broker.Guest, why error) {
	s.m.ClosedSession.WithLabelValues(proto.ReasonNotGuest.String()).Inc()
	if ok, more := s.quiet(g, "not-guest"); ok {
		s.log.Warn("refused a control connection from a process outside the guest's network namespace", "guest", g.Name, "error", why, "more", more)
	}
	s.refuseAfterHello(c, fmt.Sprintf("hostd refused this process on guest %s's control socket: %v; run it inside the guest's network namespace, or use the control socket of the guest it is in", g.Name, why))
}

// refuseAfterHello answers ERROR(not-guest, text) once the process said
// HELLO (or after strangerWait), on a goroutine of its own, and closes c.
func (s *Server) refuseAfterHello(c net.Conn, text string) {
	b, err := (&proto.Msg{Type: proto.Error, Reason: proto.ReasonNotGuest, Text: text}).Append(nil)
	if err != nil {
		c.Close()
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(strangerWait))
		_, _, _ = proto.Read(c, nil)
		_ = c.SetWriteDeadline(time.Now().Add(refuseWrite))
		_, _ = c.Write(b)
	}()
}

// strangerWait bounds how long a refused process has to say HELLO.
const strangerWait = time.Second

// Close stops the server. Sessions are closed without detaching them from
// the broker: hostd going away is not the guest going away.
func (s *Server) Close() {
	s.mu.Lock()
	s.closed = true
	var ls []*listener
	for _, gl := range s.listeners {
		ls = append(ls, gl...)
	}
	var ss []*session
	for x := range s.sessions {
		ss = append(ss, x)
	}
	s.mu.Unlock()
	for _, l := range ls {
		l.close()
	}
	for _, x := range ss {
		x.shutdown()
	}
	s.wg.Wait()
}
