// Package guesttest is a scripted, in-process hostd (protocol version 3) for guestlib's package
// tests (in the spirit of wireguard-go's bindtest): a control socket in a
// temporary directory, a region in an ordinary temporary file with hostd's
// allocator over it, and sessions a test reads from and answers by hand.
// It needs no root, no conntrack and no second process.
//
// A test accepts each session the library opens, checks what the library
// says (Next, Expect) and answers (Send, Welcome, Pair, Down), or lets
// Auto serve the sessions as a hostd that pairs connections and moves
// them between the rings and TCP when told (auto.go). Every read has a
// deadline, so a library that stays silent fails the test instead of
// hanging it. Hostd and Session are for one test goroutine at a time.
package guesttest

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
)

// Wait bounds every wait of the fake for something the library should do.
const Wait = 5 * time.Second

// Hostd is the fake. Close (registered with t.Cleanup) closes the socket
// and every accepted session.
type Hostd struct {
	Control string       // the control socket path, for guestlib.Options.Control
	Region  string       // the region file, named in WELCOME
	Pool    *region.Pool // allocates READYs
	// Capacity is the ring capacity per direction of the pairs Auto
	// allocates (0: 64 KiB); set it before the first connection.
	Capacity int
	ln       *net.UnixListener
	conns    chan net.Conn
	mu       sync.Mutex
	open     []*Session // closed by Close
	region   *region.Region
	guestID  uint32
}

// Start listens on a fresh control socket and creates a small region.
func Start(t testing.TB) *Hostd {
	t.Helper()
	dir := t.TempDir()
	h := &Hostd{Control: filepath.Join(dir, "ctl.sock"), Region: filepath.Join(dir, "region"), conns: make(chan net.Conn, 16)}
	r, err := region.Create(h.Region, region.Geometry{Size: 4 << 20, Slots: 16}, 0o600)
	if err != nil {
		t.Fatalf("guesttest: create region: %v", err)
	}
	h.region = r
	h.Pool = region.NewPool(r, nil)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: h.Control, Net: "unix"})
	if err != nil {
		t.Fatalf("guesttest: listen: %v", err)
	}
	h.ln = ln
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(h.conns)
				return
			}
			h.conns <- c
		}
	}()
	t.Cleanup(h.Close)
	return h
}

// Close stops the fake: the socket goes away and every session is closed.
func (h *Hostd) Close() {
	h.ln.Close()
	h.mu.Lock()
	for _, s := range h.open {
		s.Close()
	}
	h.mu.Unlock()
	h.region.Close()
}

// Accept returns the next session the library opens, failing the test
// after Wait.
func (h *Hostd) Accept(t testing.TB) *Session {
	t.Helper()
	select {
	case c, ok := <-h.conns:
		if !ok {
			t.Fatal("guesttest: listener closed")
		}
		return h.track(c)
	case <-time.After(Wait):
		t.Fatalf("guesttest: no session within %v", Wait)
	}
	return nil
}

func (h *Hostd) track(c net.Conn) *Session {
	s := &Session{h: h, conn: c}
	h.mu.Lock()
	h.open = append(h.open, s)
	h.mu.Unlock()
	return s
}

// Greet accepts the next session and answers its HELLO.
func (h *Hostd) Greet(t testing.TB) *Session {
	t.Helper()
	s := h.Accept(t)
	s.Expect(t, proto.Hello)
	s.Welcome(t)
	return s
}

// Session is one control connection as hostd sees it.
type Session struct {
	h    *Hostd
	conn net.Conn
	buf  []byte
	// Pongs, when set, makes Next answer PING itself and skip it (the
	// library's Listen waits for one).
	Pongs bool
}

// Close closes the session, as a hostd that goes away would.
func (s *Session) Close() { s.conn.Close() }

// Next returns the next message the library sends, failing after Wait.
func (s *Session) Next(t testing.TB) proto.Msg {
	t.Helper()
	m, err := s.read(Wait)
	if err != nil {
		t.Fatalf("guesttest: read from the library: %v", err)
	}
	return m
}

// Read returns the next message the library sends, or the error after d
// (for tests that show their own state when it does not come).
func (s *Session) Read(d time.Duration) (proto.Msg, error) { return s.read(d) }

func (s *Session) read(d time.Duration) (proto.Msg, error) {
	for {
		_ = s.conn.SetReadDeadline(time.Now().Add(d))
		m, b, err := proto.Read(s.conn, s.buf)
		s.buf = b
		if err != nil {
			return m, err
		}
		if s.Pongs && m.Type == proto.Ping {
			if err := proto.Write(s.conn, &proto.Msg{Type: proto.Pong, Nonce: m.Nonce}); err != nil {
				return m, err
			}
			continue
		}
		return m, nil
	}
}

// Expect returns the next message, which must be of type want.
func (s *Session) Expect(t testing.TB, want proto.Type) proto.Msg {
	t.Helper()
	m := s.Next(t)
	if m.Type != want {
		t.Fatalf("guesttest: the library sent %s (%+v), want %s", m.Type, m, want)
	}
	return m
}

// Silent checks that the library sends nothing for d.
func (s *Session) Silent(t testing.TB, d time.Duration) {
	t.Helper()
	m, err := s.read(d)
	if err == nil {
		t.Fatalf("guesttest: the library sent %s (%+v), want nothing", m.Type, m)
	}
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("guesttest: read: %v", err)
	}
}

// Send writes m to the library.
func (s *Session) Send(t testing.TB, m proto.Msg) {
	t.Helper()
	_ = s.conn.SetWriteDeadline(time.Now().Add(Wait))
	if err := proto.Write(s.conn, &m); err != nil {
		t.Fatalf("guesttest: write %s: %v", m.Type, err)
	}
}

// Raw writes bytes as they are, for malformed frames.
func (s *Session) Raw(t testing.TB, b []byte) {
	t.Helper()
	_ = s.conn.SetWriteDeadline(time.Now().Add(Wait))
	if _, err := s.conn.Write(b); err != nil {
		t.Fatalf("guesttest: write: %v", err)
	}
}

// Welcome answers a HELLO, naming the fake's region.
func (s *Session) Welcome(t testing.TB) {
	t.Helper()
	s.h.guestID++
	s.Send(t, s.h.welcome())
}

// welcome is the fake's WELCOME: its region and ring format 2.
func (h *Hostd) welcome() proto.Msg {
	return proto.Msg{Type: proto.Welcome, GuestID: h.guestID, Region: h.Region, RegionSize: uint64(len(h.region.Mem())), Formats: 1 << ring.FormatVersion}
}

// WelcomeNoRegion answers a HELLO as hostd answers a process guest: no
// region 0 (its regions come by REGION).
func (s *Session) WelcomeNoRegion(t testing.TB) {
	t.Helper()
	s.h.guestID++
	s.Send(t, proto.Msg{Type: proto.Welcome, GuestID: s.h.guestID, Formats: 1 << ring.FormatVersion})
}

// Region is a region that the fake hands over by descriptor, as hostd
// hands a pair region to its two guests: a memfd, with hostd's pool over
// it. It is closed with the test.
type Region struct {
	ID   uint32
	File *os.File
	Pool *region.Pool
}

// NewRegion makes a small region that guests will know as id.
func (h *Hostd) NewRegion(t testing.TB, id uint32) *Region {
	t.Helper()
	g := region.Geometry{Size: 1 << 20, Slots: 8}
	f, err := sys.Memfd("guesttest-region", g.Size)
	if err != nil {
		t.Fatalf("guesttest: memfd: %v", err)
	}
	r, err := region.CreateFile(f, g)
	if err != nil {
		f.Close()
		t.Fatalf("guesttest: region: %v", err)
	}
	t.Cleanup(func() { r.Close(); f.Close() })
	return &Region{ID: id, File: f, Pool: region.NewPool(r, nil)}
}

// SendRegion sends REGION for r with r's descriptor (SCM_RIGHTS on the
// frame's first byte, as hostd sends it).
func (s *Session) SendRegion(t testing.TB, r *Region) {
	t.Helper()
	m := proto.Msg{Type: proto.RegionMsg, RegionID: r.ID, RegionSize: uint64(len(r.Pool.Region().Mem()))}
	b, err := m.Append(nil)
	if err != nil {
		t.Fatal(err)
	}
	uc, ok := s.conn.(*net.UnixConn)
	if !ok {
		t.Fatalf("guesttest: session is a %T, not a Unix socket", s.conn)
	}
	_ = uc.SetWriteDeadline(time.Now().Add(Wait))
	if _, _, err := uc.WriteMsgUnix(b, syscall.UnixRights(int(r.File.Fd())), nil); err != nil {
		t.Fatalf("guesttest: write REGION: %v", err)
	}
}

// PairIn is Pair in region r: the READYs name r.
func (h *Hostd) PairIn(t testing.TB, r *Region, active, passive proto.Msg) Flow {
	t.Helper()
	return pairIn(t, r.Pool, r.ID, active, passive)
}

// Flow is a ring pair allocated by Pair: the READY each side gets.
type Flow struct{ A, B proto.Msg }

// Down is the DOWN that leaves the flow of READY r, for r's end.
func Down(r proto.Msg, reason proto.Reason) proto.Msg {
	return proto.Msg{Type: proto.Down, ReqID: r.ReqID, RegionID: r.RegionID, Slot: r.Slot, Gen: r.Gen, Reason: reason}
}

// Pair allocates a ring pair for an active OPEN and a passive OPEN and
// returns the READYs for both, without sending them.
func (h *Hostd) Pair(t testing.TB, active, passive proto.Msg) Flow {
	t.Helper()
	return pairIn(t, h.Pool, 0, active, passive)
}

func pairIn(t testing.TB, pool *region.Pool, id uint32, active, passive proto.Msg) Flow {
	t.Helper()
	f, err := alloc(pool, id, 0, active, passive)
	if err != nil {
		t.Fatalf("guesttest: allocate: %v", err)
	}
	return f
}

// alloc allocates a ring pair of capacity bytes per direction (0: 64 KiB)
// in pool for one connection's active and passive OPEN and returns the
// READY each side gets.
func alloc(pool *region.Pool, id uint32, capacity int, active, passive proto.Msg) (Flow, error) {
	if capacity == 0 {
		capacity = 64 << 10
	}
	slot, e, err := pool.Alloc(region.Request{OwnerA: 1, OwnerB: 2, Src: active.Local, Dst: active.Remote, Capacity: capacity})
	if err != nil {
		return Flow{}, err
	}
	r := proto.Msg{Type: proto.Ready, RegionID: id, Slot: uint32(slot), Gen: e.Gen, Capacity: uint32(e.Capacity), RingAB: uint64(e.RingAB), RingBA: uint64(e.RingBA)}
	a, b := r, r
	a.ReqID, a.Side = active.ReqID, proto.SideA
	b.ReqID, b.Side = passive.ReqID, proto.SideB
	return Flow{a, b}, nil
}

// SameConn reports whether an active and a passive OPEN describe one
// connection.
func SameConn(active, passive proto.Msg) bool {
	return unmap(active.Local) == unmap(passive.Remote) && unmap(active.Remote) == unmap(passive.Local)
}

func unmap(a netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(a.Addr().Unmap(), a.Port()) }
