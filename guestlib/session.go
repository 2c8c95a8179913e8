package guestlib

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// Limits of the control channel. A full queue means hostd has not read for
// a while: KICKs are dropped (a sleeper's wait is bounded anyway), other
// messages fail and their connection stays on TCP, and CLOSEs are parked in
// the Client and written as soon as the queue drains, so none is lost.
const (
	ctlQueue       = 256                    // messages waiting for the writer
	ctlWriteTime   = 5 * time.Second        // a write hostd does not take in this long ends the session
	dialTimeout    = 2 * time.Second        // connecting to the control socket
	helloTries     = 25                     // HELLOs before giving up (5 s)
	helloWait      = 200 * time.Millisecond // for WELCOME after each HELLO
	portPingPeriod = 500 * time.Millisecond // see keepalive
)

// errQueueFull is why a control message could not be queued.
var errQueueFull = errors.New("control queue full: hostd is not reading")

// session is one connection of the control channel. Its writer goroutine is
// the only one that writes conn; everything else queues through Client.send.
// Its reader goroutine (Client.readLoop) dispatches what hostd says. Ending
// a session (end) closes conn, which stops both.
type session struct {
	conn  net.Conn
	rd    io.Reader      // conn, or on a Unix socket an fdReader over it
	fds   *fdReader      // nil unless conn is a Unix socket
	out   chan proto.Msg // single messages, bounded (ctlQueue)
	flush chan struct{}  // parked work waits in the Client (see Client.parkedLocked)
	done  chan struct{}  // closed by end
	once  sync.Once

	// announce is what hostd must learn before anything else on this
	// session: listeners and held flows (after a hostd restart). Guarded
	// by the Client's mu; taken by the writer.
	announce []proto.Msg
}

func newSession(conn net.Conn) *session {
	s := &session{conn: conn, rd: conn, out: make(chan proto.Msg, ctlQueue), flush: make(chan struct{}, 1), done: make(chan struct{})}
	if uc, ok := conn.(*net.UnixConn); ok {
		s.fds = &fdReader{c: uc, oob: make([]byte, unix.CmsgSpace(4*maxFDs))}
		s.rd = s.fds
	}
	return s
}

// maxFDs bounds the descriptors a session keeps waiting for their REGION
// messages: hostd sends one per REGION, right with it; more are closed.
const maxFDs = 16

// fdReader reads a Unix socket with recvmsg, keeping the descriptors that
// come with the bytes (SCM_RIGHTS) in arrival order: hostd attaches a
// region's descriptor to the first byte of its REGION frame, so the
// descriptor is read with that frame. Only the session's reader uses it.
type fdReader struct {
	c   *net.UnixConn
	oob []byte
	fds []int
}

func (r *fdReader) Read(p []byte) (int, error) {
	n, oobn, _, _, err := r.c.ReadMsgUnix(p, r.oob)
	if oobn > 0 {
		cmsgs, _ := unix.ParseSocketControlMessage(r.oob[:oobn])
		for i := range cmsgs {
			fds, _ := unix.ParseUnixRights(&cmsgs[i])
			for _, fd := range fds {
				if len(r.fds) >= maxFDs {
					unix.Close(fd)
					continue
				}
				r.fds = append(r.fds, fd)
			}
		}
	}
	return n, err
}

// take returns the oldest descriptor received, or -1.
func (r *fdReader) take() int {
	if len(r.fds) == 0 {
		return -1
	}
	fd := r.fds[0]
	r.fds = r.fds[1:]
	return fd
}

// close closes the descriptors no REGION claimed.
func (r *fdReader) close() {
	for _, fd := range r.fds {
		unix.Close(fd)
	}
	r.fds = nil
}

// poke tells the writer that parked work is waiting.
func (s *session) poke() {
	select {
	case s.flush <- struct{}{}:
	default:
	}
}

// end closes the session once; both its goroutines return.
func (s *session) end() {
	s.once.Do(func() {
		close(s.done)
		s.conn.Close()
	})
}

// writeLoop writes parked work first (announcements, CLOSEs), then queued
// messages, until the session ends or a write fails.
func (c *Client) writeLoop(s *session) {
	defer c.wg.Done()
	defer s.end()
	for {
		var batch []proto.Msg
		select {
		case <-s.flush:
			batch = c.parked(s)
		default:
			select {
			case <-s.flush:
				batch = c.parked(s)
			case m := <-s.out:
				batch = append(batch, m)
			case <-s.done:
				return
			}
		}
		for i := range batch {
			_ = s.conn.SetWriteDeadline(time.Now().Add(ctlWriteTime))
			if err := proto.Write(s.conn, &batch[i]); err != nil {
				c.logf("shunt: control channel write: %v", err)
				return
			}
		}
	}
}

// vmRoot is where a VM's control ports and ivshmem BAR are looked for:
// the guest's /sys and /dev, or a test's fake trees, and how a port is
// opened (vserial.Open; a test's stand-in can answer EBUSY).
type vmRoot struct {
	sysfs, dev string
	open       func(ports []string) (*os.File, error)
}

var hostRoot = vmRoot{sysfs: "/sys", dev: "/dev", open: vserial.Open}

// dialControl opens the control channel (docs/vm.md, "Discovery"), as the
// C core's channel_open does:
//
//   - Control, if it is a character device: a virtio-serial port (VMs);
//   - else, when discovering (no Control, no $SHUNT_CONTROL) and nothing
//     is at Control (the default socket), the first of the VM's control
//     ports that no other process holds (vserial.FindAll, vserial.Open):
//     vserial.ErrAllBusy if every one is held, and the socket is not
//     tried if the VM has ports;
//   - else the Unix socket at Control (process guests), and if that
//     fails (no permission, not there after a chroot, no hostd behind
//     it), the abstract socket proto.NetnsControl that hostd serves
//     inside a guest's network namespace; the error is the path's.
func (c *Client) dialControl() (net.Conn, error) {
	path := c.opts.Control
	if path == VsockControl {
		return dialVsockControl()
	}
	st, err := os.Stat(path)
	if err == nil && st.Mode()&os.ModeCharDevice != 0 {
		return c.openPort([]string{path})
	}
	if err != nil && c.discover {
		if ports, err := vserial.FindAll(c.vm.sysfs, c.vm.dev); err == nil {
			return c.openPort(ports)
		}
		if _, err := os.Stat(c.vm.dev + "/vsock"); err == nil {
			// A VM with vsock and no control port (Firecracker has
			// no virtio-serial): hostd serves its control channel on
			// vsock. No hostd there: a reset at once.
			if vc, err := dialVsockControl(); err == nil {
				return vc, nil
			}
		}
	}
	conn, err := net.DialTimeout("unix", path, dialTimeout)
	if err != nil {
		if ac, aerr := net.DialTimeout("unix", "@"+proto.NetnsControl, dialTimeout); aerr == nil {
			return ac, nil
		}
		return nil, fmt.Errorf("control %s: %w (and hostd serves no guest in this network namespace)", path, err)
	}
	return conn, nil
}

// openPort opens the first of ports that is free, as a control channel.
func (c *Client) openPort(ports []string) (net.Conn, error) {
	f, err := c.vm.open(ports)
	if err != nil {
		return nil, err
	}
	return portConn{f}, nil
}

// hello says HELLO until hostd answers WELCOME: a virtio-serial port drops
// what is written before both ends are open, so the first HELLO may be
// lost; a Unix socket answers the first one. It runs before the session's
// goroutines start, so it reads and writes conn itself.
func hello(conn net.Conn) (proto.Msg, error) {
	defer conn.SetDeadline(time.Time{})
	for try := 0; try < helloTries; try++ {
		_ = conn.SetWriteDeadline(time.Now().Add(ctlWriteTime))
		if err := proto.Write(conn, helloMsg()); err != nil {
			return proto.Msg{}, fmt.Errorf("hello: %w", err)
		}
		_ = conn.SetReadDeadline(time.Now().Add(helloWait))
		m, _, err := proto.Read(conn, nil)
		// A VM's port may still hold what hostd sent to the guest's
		// previous boot (QEMU keeps the channel across a reboot in
		// place): PONG, REVOKED, KICK... Everything before WELCOME is
		// that, and is skipped.
		for err == nil && stale(m) {
			m, _, err = proto.Read(conn, nil)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		if err != nil {
			return m, fmt.Errorf("welcome: %w", err)
		}
		if m.Version != 0 {
			// An older hostd: every connection stays on TCP (version);
			// the session is tried again later, with the usual backoff.
			return m, fmt.Errorf("welcome: hostd speaks protocol version %d, this library %d: %w", m.Version, proto.Version, proto.ErrVersion)
		}
		if m.Type == proto.Error && m.Reason == proto.ReasonNotGuest {
			return m, fmt.Errorf("welcome: %s: %w", m.Text, errNotGuest)
		}
		if m.Type != proto.Welcome {
			return m, fmt.Errorf("welcome: hostd answered HELLO with %s (%s: %s)", m.Type, m.Reason, m.Text)
		}
		return m, nil
	}
	return proto.Msg{}, fmt.Errorf("welcome: no answer to %d HELLOs in %v", helloTries, helloTries*helloWait)
}

// helloMsg is this library's HELLO: its pid, the ring format it reads
// and writes (format 2: switching), and CapResume (it handles RESUME).
func helloMsg() *proto.Msg {
	return &proto.Msg{Type: proto.Hello, PID: uint32(os.Getpid()), Formats: 1<<ring.FormatVersion | proto.CapResume}
}

// stale reports whether m, read before WELCOME, is left over from an
// earlier session on the same channel.
func stale(m proto.Msg) bool {
	switch m.Type {
	case proto.Welcome:
		return false
	case proto.Error:
		return m.Reason == proto.ReasonNoHostd
	}
	return true
}

// VsockControl, as Options.Control or $SHUNT_CONTROL, takes the control
// channel over vsock (the host's port proto.VsockControlPort).
const VsockControl = "vsock"

// vsockConn is a control channel over vsock (docs/vsock.md, "The control
// channel"). As on a port, a session there gets keepalives (a hostd whose
// vhost-user device died with it sends no reset), and its flows go over
// vsock stretches: such a VM has no region to map.
type vsockConn struct{ net.Conn }

func dialVsockControl() (net.Conn, error) {
	vc, err := vstretch.Dial(proto.VsockControlPort)
	if err != nil {
		return nil, fmt.Errorf("control over vsock: %w", err)
	}
	return vsockConn{vc}, nil
}

// portConn is a character device used as the control connection.
type portConn struct{ *os.File }

func (portConn) LocalAddr() net.Addr  { return portAddr{} }
func (portConn) RemoteAddr() net.Addr { return portAddr{} }

type portAddr struct{}

func (portAddr) Network() string { return "virtio-serial" }
func (portAddr) String() string  { return "org.shunt.ctl" }

// readLoop dispatches hostd's messages until the session ends, then
// reconnects in the background (connections keep their paths).
func (c *Client) readLoop(s *session) {
	defer c.wg.Done()
	var buf []byte
	for {
		m, b, err := proto.Read(s.rd, buf)
		buf = b
		if err != nil {
			break
		}
		if m.Version != 0 { // an older hostd took over the channel (a VM's port)
			c.logf("shunt: hostd sent a version %d %s: its connections stay on TCP", m.Version, m.Type)
			break
		}
		c.dispatch(s, m)
	}
	s.end()
	if s.fds != nil {
		s.fds.close()
	}
	c.lost(s)
}

// dispatch handles one message from hostd.
func (c *Client) dispatch(s *session, m proto.Msg) {
	switch m.Type {
	case proto.Ready:
		c.ready(m)
	case proto.TCP:
		c.tcp(m)
	case proto.Down, proto.Revoke:
		c.downed(m)
	case proto.Resume:
		c.resumed(m)
	case proto.Ping:
		_ = c.send(proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
	case proto.Kick:
		if k := c.kick.Load(); k != nil {
			k.kicked(keyOf(m))
		}
	case proto.Pong:
		c.ponged(m.Nonce)
	case proto.Error:
		if m.Reason == proto.ReasonNoHostd { // a restarted hostd behind a VM port
			_ = c.send(*helloMsg())
			return
		}
		c.logf("shunt: hostd closed the control channel: %s (%s)", m.Text, m.Reason)
	case proto.Welcome:
		c.remapRegionZero(m)
		c.welcomed(s)
	case proto.RegionMsg:
		fd := -1
		if s.fds != nil {
			fd = s.fds.take()
		}
		if fd < 0 && (s.onPort() || s.onVsock()) {
			c.regionOnBar(m) // a VM pair region: a device plugged for it
			return
		}
		c.regionGiven(m, fd)
	case proto.Unregion:
		c.regionTaken(m.RegionID)
	}
}

// keepalive runs on a VM's port, which stays open when hostd restarts (QEMU
// reconnects its end): a PING every portPingPeriod makes a new hostd answer
// ERROR, and the client says HELLO again.
func (c *Client) keepalive(s *session) {
	defer c.wg.Done()
	t := time.NewTicker(portPingPeriod)
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
			c.mu.Lock()
			c.nonce++
			n := c.nonce
			c.mu.Unlock()
			_ = c.send(proto.Msg{Type: proto.Ping, Nonce: n})
		}
	}
}
