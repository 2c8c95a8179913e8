//go:build linux

// Package doorbell is an ivshmem-doorbell server (QEMU
// docs/specs/ivshmem-spec.rst, "server protocol"), so hostd can serve
// doorbell devices itself (Debian ships no ivshmem-server) and receive
// guest-to-host doorbells as eventfds.
//
// On a Unix stream socket, each message is one little-endian int64 with at
// most one fd (SCM_RIGHTS), one sendmsg each. To a new client:
//
//	0                      protocol version
//	id                     the client's own peer id
//	-1        + shm fd     the shared memory
//	peer id   + eventfd    for every existing peer, once per vector
//	own id    + eventfd    the client's own vectors
//
// Later, to every client: a peer id with an eventfd when a peer joins (once
// per vector), without one when it leaves. QEMU reads the greeting
// synchronously while it realizes the device, so the server answers at
// once. hostd is peer 0: a guest that rings peer 0's vector v makes
// HostEvent(v) readable.
package doorbell

import (
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Server serves one doorbell device's peers. It is safe for concurrent use;
// Close stops it and closes every eventfd it made.
type Server struct {
	l       *net.UnixListener
	shm     *os.File
	vectors int
	host    []*os.File // peer 0's eventfds

	mu     sync.Mutex
	peers  map[int64]*peer
	nextID int64
	wg     sync.WaitGroup
}

type peer struct {
	id     int64
	conn   *net.UnixConn
	events []*os.File
}

// Listen serves the shm file on a Unix socket at path with the given
// number of interrupt vectors per peer. The caller keeps shm open until
// Close.
func Listen(path string, shm *os.File, vectors int) (*Server, error) {
	if vectors < 1 || vectors > 64 {
		return nil, fmt.Errorf("doorbell vectors %d: want 1 to 64", vectors)
	}
	os.Remove(path)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("doorbell socket: %w", err)
	}
	s := &Server{l: l, shm: shm, vectors: vectors, peers: map[int64]*peer{}, nextID: 1}
	if s.host, err = eventfds(vectors); err != nil {
		l.Close()
		return nil, err
	}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

func eventfds(n int) ([]*os.File, error) {
	var out []*os.File
	for i := 0; i < n; i++ {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		if err != nil {
			for _, f := range out {
				f.Close()
			}
			return nil, fmt.Errorf("eventfd: %w", err)
		}
		out = append(out, os.NewFile(uintptr(fd), "doorbell-eventfd"))
	}
	return out, nil
}

// HostEvent is the eventfd that becomes readable when a guest rings
// vector v of peer 0 (hostd).
func (s *Server) HostEvent(v int) *os.File { return s.host[v] }

func send(c *net.UnixConn, v int64, f *os.File) error {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(v))
	var oob []byte
	if f != nil {
		oob = unix.UnixRights(int(f.Fd()))
	}
	_, _, err := c.WriteMsgUnix(b[:], oob, nil)
	return err
}

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.l.AcceptUnix()
		if err != nil {
			return
		}
		if err := s.join(c); err != nil {
			c.Close()
		}
	}
}

// join greets a new peer and announces it to the others.
func (s *Server) join(c *net.UnixConn) error {
	events, err := eventfds(s.vectors)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	p := &peer{id: s.nextID, conn: c, events: events}
	s.nextID++
	steps := []func() error{
		func() error { return send(c, 0, nil) },
		func() error { return send(c, p.id, nil) },
		func() error { return send(c, -1, s.shm) },
	}
	for _, ev := range s.host {
		steps = append(steps, func() error { return send(c, 0, ev) })
	}
	for _, o := range s.peers {
		for _, ev := range o.events {
			steps = append(steps, func() error { return send(c, o.id, ev) })
		}
	}
	for _, ev := range events {
		steps = append(steps, func() error { return send(c, p.id, ev) })
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return fmt.Errorf("greet doorbell peer %d: %w", p.id, err)
		}
	}
	for _, o := range s.peers {
		for _, ev := range events {
			_ = send(o.conn, p.id, ev)
		}
	}
	s.peers[p.id] = p
	s.wg.Add(1)
	go s.watch(p)
	return nil
}

// watch waits for a peer to go and tells the others.
func (s *Server) watch(p *peer) {
	defer s.wg.Done()
	buf := make([]byte, 8)
	for {
		if _, err := p.conn.Read(buf); err != nil {
			break
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.peers, p.id)
	for _, o := range s.peers {
		_ = send(o.conn, p.id, nil)
	}
	for _, ev := range p.events {
		ev.Close()
	}
	p.conn.Close()
}

// Peers returns the ids of connected peers.
func (s *Server) Peers() []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ids []int64
	for id := range s.peers {
		ids = append(ids, id)
	}
	return ids
}

// Close stops accepting, disconnects every peer and waits.
func (s *Server) Close() error {
	s.l.Close()
	s.mu.Lock()
	for _, p := range s.peers {
		p.conn.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	for _, f := range s.host {
		f.Close()
	}
	return nil
}
