package server

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
)

// A shared socket serves many guests on one path: hostd's container
// socket, which a CDI spec mounts into every container that asks for it
// (docs/containers.md). Who a connection is comes not from the path but
// from the connecting process: Resolve names its guest (by its network
// namespace), and only guests admitted (Admit) are served.

// Resolver names the guest of the process at the other end of c, or says
// why it has none.
type Resolver func(c net.Conn) (*broker.Guest, error)

// AddShared serves a shared socket at path (mode 0666: any process may
// connect, and Resolve decides who it is), replacing a stale socket there.
func (s *Server) AddShared(path string, resolve Resolver) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("container socket dir: %w", err)
	}
	if st, err := os.Lstat(path); err == nil && st.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("%s exists and is not a socket: remove it or choose another container_socket", path)
	}
	_ = os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("container socket: %w", err)
	}
	if err := os.Chmod(path, 0o666); err != nil {
		l.Close()
		return fmt.Errorf("container socket: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		l.Close()
		return errors.New("container socket: server closed")
	}
	ln := &listener{Listener: l, path: path, done: make(chan struct{})}
	s.listeners[nil] = append(s.listeners[nil], ln)
	s.wg.Add(1)
	go s.acceptShared(ln, resolve)
	return nil
}

// Admit lets the shared sockets serve guest g; Remove ends that.
func (s *Server) Admit(g *broker.Guest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.admitted == nil {
		s.admitted = map[*broker.Guest]bool{}
	}
	s.admitted[g] = true
}

// acceptShared serves shared socket l until it is closed. A connection
// whose process is no admitted guest's gets ERROR(not-owner) and is
// closed; one of a guest over its session rate gets ERROR(control-limit):
// the loop never waits for one guest, so no container delays another.
func (s *Server) acceptShared(l *listener, resolve Resolver) {
	defer s.wg.Done()
	var delay time.Duration
	for {
		c, ok := s.acceptOne(l, "(container socket)", &delay)
		if !ok {
			return
		}
		if c == nil {
			continue
		}
		g, err := resolve(c)
		if err != nil {
			s.m.ClosedSession.WithLabelValues(proto.ReasonNotGuest.String()).Inc()
			if ok, more := s.quiet(nil, "not-guest"); ok {
				s.log.Warn("refused a process on the container socket", "error", err, "more", more)
			}
			s.refuseAfterHello(c, "hostd refused this process on the container socket: "+err.Error())
			continue
		}
		if s.take(g) != 0 {
			s.refuseWith(c, proto.ReasonControlLimit, fmt.Sprintf("guest %s opens control sessions faster than limits.sessions_per_second: wait and connect again", g.Name))
			continue
		}
		if !s.start(c, g, func() bool { return s.admitted[g] }) {
			select {
			case <-l.done:
				return
			default: // g went meanwhile: c is closed, go on
			}
		}
	}
}

// start serves c as a session of guest g, unless the server closed or
// current (called under the lock) says g went (then it reports false),
// or g is at its session limit (c is refused).
func (s *Server) start(c net.Conn, g *broker.Guest, current func() bool) bool {
	s.mu.Lock()
	if s.closed || !current() {
		s.mu.Unlock()
		c.Close()
		return false
	}
	if n := s.perGuest[g]; n >= s.opts.SessionsPerGuest {
		s.mu.Unlock()
		s.refuse(c, g, n)
		return true
	}
	s.startLocked(c, g)
	return true
}

// refuseWith answers a connection with ERROR(r, text) and closes it; the
// write goes to a fresh socket's empty buffer and is bounded by refuseWrite.
func (s *Server) refuseWith(c net.Conn, r proto.Reason, text string) {
	if b, err := (&proto.Msg{Type: proto.Error, Reason: r, Text: text}).Append(nil); err == nil {
		_ = c.SetWriteDeadline(time.Now().Add(refuseWrite))
		_, _ = c.Write(b)
	}
	c.Close()
}

// AddNetns serves guest g on the abstract socket proto.NetnsControl inside
// its network namespace nsPath, as Add does for a guest with a netns: the
// libraries try it when their socket path fails, so a run-time guest's
// processes reach hostd with no socket mounted, and after a chroot.
func (s *Server) AddNetns(g *broker.Guest, nsPath string) error {
	al, err := listenIn(nsPath)
	if err != nil {
		return fmt.Errorf("control socket in guest %s's network namespace: %w", g.Name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		al.Close()
		return fmt.Errorf("control socket for guest %s: server closed", g.Name)
	}
	ln := &listener{Listener: al, nsPath: nsPath, done: make(chan struct{})}
	s.listeners[g] = append(s.listeners[g], ln)
	s.wg.Add(1)
	go s.accept(ln, g)
	return nil
}

// AddListener serves guest g's control channel on l, a listener made
// elsewhere whose every connection can only be g's: a VM's vsock control
// port (hostd/vsockhost.Room.ListenControl), on hostd's own device or a
// hypervisor's hybrid vsock socket. The server owns l from now on and
// closes it with the guest's other sockets.
func (s *Server) AddListener(g *broker.Guest, l net.Listener) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		l.Close()
		return fmt.Errorf("vsock control for guest %s: server closed", g.Name)
	}
	ln := &listener{Listener: l, done: make(chan struct{})}
	s.listeners[g] = append(s.listeners[g], ln)
	s.wg.Add(1)
	go s.accept(ln, g)
	return nil
}
