package server

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/metrics"
)

// Endpoint is one guest's control socket.
type Endpoint struct {
	Guest *broker.Guest
	Path  string
}

// Server owns the control sockets and their sessions. Endpoints can come
// and go while it runs (libvirt domains starting and stopping). It is safe
// for concurrent use. Close stops accepting, closes every session and waits
// for their goroutines.
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

// Listen starts a server with the given endpoints (see Add). The server
// owns the sockets it creates and removes them in Remove; it uses b and m
// but does not close them. On error, what was started is closed again.
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
		ss := newSession(s, c, g)
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
