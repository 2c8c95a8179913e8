package guesttest

import (
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/shuntnet/shunt/internal/proto"
)

// Port makes a stand-in for a VM's virtio-serial control port: a
// pseudo-terminal in raw mode, a character device as a port is. It returns
// the terminal's path, for the library to open as its port; the fake's
// end is a session that Accept (or Auto) returns in its turn. Unlike a
// port, a terminal drops nothing before both ends are open, and several
// processes may open it at once (no EBUSY). Both ends close with the test.
func (h *Hostd) Port(t testing.TB) string {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err == nil && !ptySupported {
		m.Close()
		err = errors.New("pseudo-terminal ports need Linux")
	}
	if err != nil {
		t.Skipf("guesttest: no pseudo-terminal to stand in for a port (needs Linux, with devpts on /dev/pts): %v", err)
	}
	var n int
	raw, err := m.SyscallConn() // not Fd(): that would make the master blocking, and deadlines useless
	if err == nil {
		err = raw.Control(func(fd uintptr) { n, err = ptyRaw(int(fd)) })
	}
	if err != nil {
		m.Close()
		t.Fatalf("guesttest: pseudo-terminal: %v", err)
	}
	path := fmt.Sprintf("/dev/pts/%d", n)
	// Hold the terminal's end open too, so that the master never reads
	// EIO for a terminal nobody holds between the library's opens.
	held, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		m.Close()
		t.Fatalf("guesttest: open %s: %v", path, err)
	}
	t.Cleanup(func() { held.Close(); m.Close() })
	h.conns <- ptyConn{m}
	return path
}

// ptyConn is a pseudo-terminal's master as a session's connection.
type ptyConn struct{ *os.File }

func (ptyConn) LocalAddr() net.Addr  { return ptyAddr{} }
func (ptyConn) RemoteAddr() net.Addr { return ptyAddr{} }

type ptyAddr struct{}

func (ptyAddr) Network() string { return "pty" }
func (ptyAddr) String() string  { return "guesttest port" }

// WelcomeVM answers a HELLO as hostd answers a VM: WELCOME names the
// region by its path on the host, which the guest cannot open; a guest
// must map its ivshmem BAR instead.
func (s *Session) WelcomeVM(t testing.TB) {
	t.Helper()
	s.h.guestID++
	m := s.h.welcome()
	m.Region = "/dev/shm/guesttest-host-only"
	s.Send(t, m)
}

// kickLocked relays a KICK to the session holding the side it names, as
// hostd does.
func (a *Auto) kickLocked(m proto.Msg) {
	for _, c := range a.conns {
		f := c.flow
		if f == nil || f.A.RegionID != m.RegionID || f.A.Slot != m.Slot || f.A.Gen != m.Gen {
			continue
		}
		i := 0
		if m.Side == proto.SideB {
			i = 1
		}
		c.end[i].s.write(proto.Msg{Type: proto.Kick, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Side: m.Side})
		return
	}
}
