// Package server runs hostd's control channels: one Unix socket per guest
// (as one virtio-serial port per VM), so a guest's identity is the socket it
// connected to, never something it claims. Each connection is a session;
// several processes of one guest (MPI ranks in one container) each have one.
//
// A session must start with HELLO and gets WELCOME (again for a repeated
// HELLO). A malformed message, or
// one that only hostd may send, gets ERROR and the session is closed and
// logged; other sessions and guests are unaffected.
package server

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/internal/proto"
)

// Endpoint is one guest's control socket.
type Endpoint struct {
	Guest *broker.Guest
	Path  string
}

// Server owns the control sockets and their sessions. Endpoints can come
// and go while it runs (libvirt domains starting and stopping). Close stops
// accepting, closes every session and waits for their goroutines.
type Server struct {
	log hclog.Logger
	b   *broker.Broker
	m   *metrics.Set
	wg  sync.WaitGroup

	mu        sync.Mutex
	listeners map[*broker.Guest][]*listener // a VM has one per control port
	sessions  map[*session]bool
	closed    bool
}

type listener struct {
	net.Listener
	path string
}

// Listen starts a server with the given endpoints (see Add).
func Listen(log hclog.Logger, b *broker.Broker, m *metrics.Set, eps []Endpoint) (*Server, error) {
	s := &Server{log: log, b: b, m: m, listeners: map[*broker.Guest][]*listener{}, sessions: map[*session]bool{}}
	for _, ep := range eps {
		if err := s.Add(ep); err != nil {
			s.Close()
			return nil, err
		}
	}
	return s, nil
}

// Add creates an endpoint's socket (replacing a stale one) with mode 0600
// and starts accepting on it. A guest may have several endpoints.
func (s *Server) Add(ep Endpoint) error {
	if err := os.MkdirAll(filepath.Dir(ep.Path), 0o755); err != nil {
		return fmt.Errorf("control socket dir for %s: %w", ep.Guest.Name, err)
	}
	_ = os.Remove(ep.Path)
	l, err := net.Listen("unix", ep.Path)
	if err != nil {
		return fmt.Errorf("control socket for guest %s: %w", ep.Guest.Name, err)
	}
	if err := os.Chmod(ep.Path, 0o600); err != nil {
		l.Close()
		return fmt.Errorf("control socket for guest %s: %w", ep.Guest.Name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		l.Close()
		return fmt.Errorf("control socket for guest %s: server closed", ep.Guest.Name)
	}
	s.listeners[ep.Guest] = append(s.listeners[ep.Guest], &listener{Listener: l, path: ep.Path})
	s.wg.Add(1)
	go s.accept(l, ep.Guest)
	return nil
}

// Remove stops serving guest g: its socket is closed and removed and its
// sessions are closed (which detaches them from the broker).
func (s *Server) Remove(g *broker.Guest) {
	s.mu.Lock()
	ls := s.listeners[g]
	delete(s.listeners, g)
	var ss []*session
	for x := range s.sessions {
		if x.g == g {
			ss = append(ss, x)
		}
	}
	s.mu.Unlock()
	for _, l := range ls {
		l.Close()
		_ = os.Remove(l.path)
	}
	for _, x := range ss {
		x.shutdown()
	}
}

func (s *Server) accept(l net.Listener, g *broker.Guest) {
	defer s.wg.Done()
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		ss := &session{srv: s, c: c, g: g, out: make(chan proto.Msg, 256), done: make(chan struct{})}
		s.mu.Lock()
		if s.closed || !slices.ContainsFunc(s.listeners[g], func(x *listener) bool { return x.Listener == l }) {
			s.mu.Unlock() // closed, or the guest was removed meanwhile
			c.Close()
			return
		}
		s.sessions[ss] = true
		s.mu.Unlock()
		s.wg.Add(2)
		go ss.writeLoop()
		go ss.readLoop()
	}
}

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
		l.Close()
	}
	for _, x := range ss {
		x.shutdown()
	}
	s.wg.Wait()
}

// session is one guest connection. It implements broker.Session.
type session struct {
	srv  *Server
	c    net.Conn
	g    *broker.Guest
	out  chan proto.Msg
	once sync.Once
	done chan struct{}
}

func (ss *session) Guest() *broker.Guest { return ss.g }

// Send queues m; a guest that lets 256 messages pile up is disconnected.
func (ss *session) Send(m proto.Msg) {
	select {
	case ss.out <- m:
	case <-ss.done:
	default:
		ss.srv.log.Warn("guest is not reading its control channel; closing it", "guest", ss.g.Name)
		ss.shutdown()
	}
}

func (ss *session) shutdown() {
	ss.once.Do(func() {
		close(ss.done)
		ss.c.Close()
	})
}

func (ss *session) writeLoop() {
	defer ss.srv.wg.Done()
	buf := make([]byte, 0, 512)
	for {
		select {
		case <-ss.done:
			return
		case m := <-ss.out:
			var err error
			if buf, err = m.Append(buf[:0]); err == nil {
				_, err = ss.c.Write(buf)
			}
			if err != nil {
				ss.shutdown()
				return
			}
		}
	}
}

func (ss *session) readLoop() {
	defer ss.srv.wg.Done()
	log := ss.srv.log.With("guest", ss.g.Name)
	defer func() {
		ss.shutdown()
		ss.srv.mu.Lock()
		delete(ss.srv.sessions, ss)
		closing := ss.srv.closed
		ss.srv.mu.Unlock()
		if !closing {
			ss.srv.b.Detach(ss)
		}
		ss.srv.m.Sessions.WithLabelValues(ss.g.Name).Dec()
	}()
	ss.srv.m.Sessions.WithLabelValues(ss.g.Name).Inc()
	var buf []byte
	m, buf, err := proto.Read(ss.c, buf)
	// A VM's port stays open across a hostd restart, so its guest may
	// still be talking to the hostd before: a guest message other than
	// HELLO tells us so (a keepalive PING, or an OPEN). Answer ERROR so it
	// says HELLO again, and keep the channel; what it asked is dropped.
	for err == nil && m.Type != proto.Hello && fromGuest[m.Type] {
		log.Debug("guest talks before HELLO (hostd restarted?); asking for HELLO", "type", m.Type)
		b, _ := (&proto.Msg{Type: proto.Error, Reason: proto.ReasonNoHostd, Text: "say HELLO: hostd restarted"}).Append(nil)
		if _, err = ss.c.Write(b); err == nil {
			m, buf, err = proto.Read(ss.c, buf)
		}
	}
	if err != nil || m.Type != proto.Hello {
		ss.malformed(log, err, m.Type)
		return
	}
	ss.srv.b.Attach(ss)
	g := ss.g.Group
	st := g.Pool.Region()
	welcome := proto.Msg{Type: proto.Welcome, GuestID: ss.g.ID, Gen: st.Generation(), RegionSize: uint64(st.Layout().Size), Region: g.Region}
	ss.Send(welcome)
	log.Debug("guest connected", "pid", m.PID)
	// spoke: the guest has acted since WELCOME (anything but HELLO and
	// the keepalive PING/PONG). Every retried HELLO of one guest comes
	// before it acts, since it acts only once WELCOME arrived.
	spoke := false
	for {
		m, buf, err = proto.Read(ss.c, buf)
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
				log.Debug("guest disconnected")
				return
			}
			ss.malformed(log, err, 0)
			return
		}
		switch m.Type {
		case proto.Listen, proto.Unlisten:
			ss.srv.b.Listen(ss, m.Local, m.Type == proto.Listen)
		case proto.Intent:
			ss.srv.b.Intent(ss, ctrack.Tuple{Src: m.Local, Dst: m.Remote})
		case proto.Open:
			ss.srv.b.Open(ss, m)
		case proto.Close:
			ss.srv.b.CloseFlow(ss, m)
		case proto.Reattach:
			ss.srv.b.Reattach(ss, m)
		case proto.Hello:
			// A VM repeats HELLO until answered (its port drops data
			// until both ends are open), so a late one may arrive; it
			// comes before anything else the guest says. A HELLO after
			// other messages is a new guest on the same channel: the VM
			// rebooted in place (QEMU, and so the channel, stayed) or
			// its program restarted. The old one's flows and listeners
			// are gone with it.
			if spoke {
				log.Info("guest started again on its channel (VM reboot?); its flows are revoked", "pid", m.PID)
				ss.srv.b.Detach(ss)
				ss.srv.b.Attach(ss)
				spoke = false
			}
			ss.Send(welcome)
			continue
		case proto.Ping:
			ss.Send(proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
		case proto.Kick:
			ss.srv.b.Kick(ss, m)
		case proto.Pong:
		default:
			ss.malformed(log, fmt.Errorf("%s is not a guest message: %w", m.Type, proto.ErrMalformed), m.Type)
			return
		}
		if m.Type != proto.Ping && m.Type != proto.Pong {
			spoke = true
		}
	}
}

// fromGuest is what a guest may send.
var fromGuest = map[proto.Type]bool{
	proto.Hello: true, proto.Listen: true, proto.Unlisten: true, proto.Intent: true, proto.Open: true,
	proto.Close: true, proto.Reattach: true, proto.Ping: true, proto.Pong: true, proto.Kick: true,
}

// malformed logs why the session is closed, counts it, and tells the guest.
func (ss *session) malformed(log hclog.Logger, err error, t proto.Type) {
	if err == nil {
		err = fmt.Errorf("first message is %s, want HELLO: %w", t, proto.ErrMalformed)
	}
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
		return
	}
	log.Warn("closing control channel: malformed message", "error", err)
	ss.srv.m.Malformed.Inc()
	b, _ := (&proto.Msg{Type: proto.Error, Reason: proto.ReasonMalformed, Text: err.Error()}).Append(nil)
	_, _ = ss.c.Write(b)
}
