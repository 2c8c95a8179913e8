package vsockd

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/hostd/vsockhost"
	"github.com/shuntnet/shunt/vhost/vsock"
)

// maxDevices bounds the devices one daemon serves (each a socket, a
// room and a forwarder).
const maxDevices = 4096

// eventBuffer bounds the frontend events and answers waiting for a slow
// controller; a controller that lets it fill is dropped (it dials again
// and asks afresh).
const eventBuffer = 1024

// writeWait bounds one message's write to the controller.
const writeWait = 5 * time.Second

// Daemon serves the devices hostd names and outlives hostd. Its methods
// are safe for concurrent use.
type Daemon struct {
	log hclog.Logger
	l   *net.UnixListener
	wg  sync.WaitGroup

	mu     sync.Mutex
	devs   map[uint32]*served     // by guest id
	ctl    *controller            // the hostd connected now, or nil
	conns  map[*net.UnixConn]bool // every control connection open, for Close
	closed bool
}

// served is one device: its room (hostd/vsockhost, one device each) and
// the forwarder of the guest's connections to hostd's ports.
type served struct {
	dev       Device
	room      *vsockhost.Room
	fwd       *vsock.Hybrid
	connected bool // its QEMU is served; guarded by the daemon's mu
}

// controller is a connected hostd: out is what its writer sends.
type controller struct {
	c    *net.UnixConn
	out  chan Msg
	free chan struct{} // closed once it no longer holds the slot
}

// Listen listens on the control socket at path (mode 0600; a stale
// socket is replaced, anything else there is an error) and serves
// hostd until Close.
func Listen(log hclog.Logger, path string) (*Daemon, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("%s exists and is not a socket: remove it or choose another path", path)
		}
		if c, err := net.Dial("unixpacket", path); err == nil {
			c.Close()
			return nil, fmt.Errorf("%s: another shunt-vsockd answers there", path)
		}
		os.Remove(path)
	}
	old := unix.Umask(0o177) // the socket is born 0600: no window at a wider mode
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	unix.Umask(old)
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(true)
	d := &Daemon{log: log, l: l, devs: map[uint32]*served{}, conns: map[*net.UnixConn]bool{}}
	d.wg.Add(1)
	go d.accept()
	return d, nil
}

// Close stops serving hostd and closes every device: each VM loses its
// vsock until it restarts (QEMU 7.2 does not reconnect).
func (d *Daemon) Close() {
	d.l.Close()
	d.mu.Lock()
	d.closed = true
	devs := d.devs
	d.devs = map[uint32]*served{}
	for c := range d.conns {
		c.Close()
	}
	d.mu.Unlock()
	d.wg.Wait()
	for _, s := range devs {
		s.close()
	}
}

func (s *served) close() {
	s.fwd.Close()
	s.room.Close()
}

// accept serves one hostd at a time.
func (d *Daemon) accept() {
	defer d.wg.Done()
	for {
		c, err := d.l.AcceptUnix()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				d.log.Error("control socket failed", "error", err)
			}
			return
		}
		if err := sameUser(c); err != nil {
			d.log.Warn("a control connection refused", "error", err)
			_ = write(c, Msg{Op: OpError, Error: err.Error()})
			c.Close()
			continue
		}
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			d.control(c)
		}()
	}
}

// helloWait bounds a new connection's hello. A connection counts as the
// controller only once it said hello: a probe that connects and goes
// (another shunt-vsockd checking the socket is live) holds nothing.
const helloWait = 5 * time.Second

// takeoverWait bounds how long a new hostd waits for the connection of
// the one before it to end (a dead process's EOF is read at once).
const takeoverWait = time.Second

// control serves one connection: its hello, then, if no other hostd is
// connected, its requests until it goes.
func (d *Daemon) control(c *net.UnixConn) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		c.Close()
		return
	}
	d.conns[c] = true
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		delete(d.conns, c)
		d.mu.Unlock()
		c.Close()
	}()
	_ = c.SetReadDeadline(time.Now().Add(helloWait))
	m, err := read(c)
	if err != nil {
		if !errors.Is(err, io.EOF) {
			d.log.Warn("a control connection without a hello", "error", err)
		}
		return
	}
	if m.Op != OpHello {
		d.log.Warn("a control connection refused", "error", fmt.Errorf("%w: %s before hello", ErrProto, m.Op))
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	ctl := &controller{c: c, out: make(chan Msg, eventBuffer), free: make(chan struct{})}
	d.mu.Lock()
	if old := d.ctl; old != nil && !d.closed {
		// A restarted hostd may come before its dead predecessor's EOF
		// was read here: it waits for that a little.
		d.mu.Unlock()
		select {
		case <-old.free:
		case <-time.After(takeoverWait):
		}
		d.mu.Lock()
	}
	if d.closed || d.ctl != nil {
		d.mu.Unlock()
		d.log.Warn("a second control connection refused: one hostd at a time")
		_ = write(c, Msg{Op: OpError, Error: "another hostd is connected"})
		return
	}
	d.ctl = ctl
	d.sendLocked(ctl, Msg{Op: OpHello, Version: Version, PID: os.Getpid()})
	d.mu.Unlock()
	d.log.Info("hostd connected")
	done := make(chan struct{})
	go func() {
		defer close(done)
		d.writer(ctl)
	}()
	err = d.serve(ctl)
	d.mu.Lock()
	d.ctl = nil
	close(ctl.free)
	d.mu.Unlock()
	close(ctl.out)
	c.Close()
	<-done
	if !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.EOF) { // serve ends only with an error
		d.log.Warn("hostd's control connection ended", "error", err)
	} else {
		d.log.Info("hostd disconnected; the devices go on")
	}
}

// sameUser: only the daemon's own user (root) controls it; the socket's
// mode says so too, this holds if the mode is ever widened.
func sameUser(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return err
	}
	if cerr != nil {
		return cerr
	}
	if int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("uid %d (pid %d) is not shunt-vsockd's user (%d)", cred.Uid, cred.Pid, os.Geteuid())
	}
	return nil
}

// writer sends ctl's messages until out closes; a failed write drops the
// controller.
func (d *Daemon) writer(ctl *controller) {
	for m := range ctl.out {
		_ = ctl.c.SetWriteDeadline(time.Now().Add(writeWait))
		if err := write(ctl.c, m); err != nil {
			ctl.c.Close()
			for range ctl.out { // until serve ends and closes it
			}
			return
		}
	}
}

// sendLocked queues m for ctl; a controller whose queue is full is
// dropped (its reads fail, serve ends). Under d.mu.
func (d *Daemon) sendLocked(ctl *controller, m Msg) {
	if ctl == nil {
		return
	}
	select {
	case ctl.out <- m:
	default:
		d.log.Warn("hostd does not read its control connection: dropped")
		ctl.c.Close()
	}
}

// serve answers ctl's requests until it goes.
func (d *Daemon) serve(ctl *controller) error {
	for {
		m, err := read(ctl.c)
		if err != nil {
			return err
		}
		switch m.Op {
		case OpDevice:
			if m.Device == nil {
				return fmt.Errorf("%w: device without a device", ErrProto)
			}
			d.device(ctl, *m.Device)
		case OpList:
			d.list(ctl)
		case OpForget:
			d.forget(ctl, m.ID)
		default:
			return fmt.Errorf("%w: %s from hostd", ErrProto, m.Op)
		}
	}
}

// device makes dev, or keeps the one the guest has if it is the same;
// one that differs (a new socket or CID) is closed and made afresh.
func (d *Daemon) device(ctl *controller, dev Device) {
	d.mu.Lock()
	old := d.devs[dev.ID]
	if old != nil && old.dev == dev {
		d.sendLocked(ctl, Msg{Op: OpDevice, ID: dev.ID, Kept: true, Connected: old.connected})
		d.mu.Unlock()
		return
	}
	var clash string
	for id, s := range d.devs {
		if id != dev.ID && (s.dev.CID == dev.CID || s.dev.Socket == dev.Socket) {
			clash = s.dev.Guest
		}
	}
	if clash == "" && old == nil && len(d.devs) >= maxDevices {
		clash = fmt.Sprintf("(%d devices already)", maxDevices)
	}
	if clash != "" {
		d.sendLocked(ctl, Msg{Op: OpError, Error: fmt.Sprintf("guest %s: its socket or cid is guest %s's", dev.Guest, clash)})
		d.mu.Unlock()
		return
	}
	delete(d.devs, dev.ID)
	d.mu.Unlock()
	if old != nil {
		d.log.Warn("device changed: the old one closed (its VM loses vsock until it restarts)", "guest", dev.Guest, "old", fmt.Sprintf("%+v", old.dev), "new", fmt.Sprintf("%+v", dev))
		old.close()
	}
	s, err := d.start(dev)
	d.mu.Lock()
	defer d.mu.Unlock()
	if err != nil {
		d.sendLocked(ctl, Msg{Op: OpError, Error: err.Error()})
		return
	}
	if d.closed {
		go s.close()
		d.sendLocked(ctl, Msg{Op: OpError, Error: "shutting down"})
		return
	}
	d.devs[dev.ID] = s
	d.sendLocked(ctl, Msg{Op: OpDevice, ID: dev.ID, Connected: s.connected})
}

// start makes a device, its socket and its forwarder.
func (d *Daemon) start(dev Device) (*served, error) {
	s := &served{dev: dev}
	spec := vsockhost.Spec{Guest: dev.Guest, ID: dev.ID, Socket: dev.Socket, CID: dev.CID,
		Frontend: func(connected bool) {
			d.mu.Lock()
			defer d.mu.Unlock()
			s.connected = connected
			d.sendLocked(d.ctl, Msg{Op: OpFrontend, ID: dev.ID, Connected: connected})
		}}
	room, err := vsockhost.Start(d.log.Named("vsock"), []vsockhost.Spec{spec})
	if err != nil {
		return nil, err
	}
	s.room = room
	if s.fwd, err = vsock.ServeHybridGuest(room.Device(dev.ID), dev.Socket, Ports...); err != nil {
		room.Close()
		return nil, fmt.Errorf("guest %s: forward to hostd: %w", dev.Guest, err)
	}
	d.log.Info("device made", "guest", dev.Guest, "cid", dev.CID, "socket", dev.Socket)
	return s, nil
}

// list answers every device's Stat, then end.
func (d *Daemon) list(ctl *controller) {
	d.mu.Lock()
	ss := make([]*served, 0, len(d.devs))
	for _, s := range d.devs {
		ss = append(ss, s)
	}
	d.mu.Unlock()
	sort.Slice(ss, func(i, j int) bool { return ss[i].dev.ID < ss[j].dev.ID })
	var stats []vsockhost.Stat
	for _, s := range ss {
		stats = append(stats, s.room.Stats()...)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := range stats {
		d.sendLocked(ctl, Msg{Op: OpStat, ID: ss[i].dev.ID, Stat: &stats[i]})
	}
	d.sendLocked(ctl, Msg{Op: OpEnd})
}

// forget closes the guest's device, if any.
func (d *Daemon) forget(ctl *controller, id uint32) {
	d.mu.Lock()
	s := d.devs[id]
	delete(d.devs, id)
	d.mu.Unlock()
	if s != nil {
		d.log.Info("device forgotten: hostd no longer has its guest", "guest", s.dev.Guest)
		s.close()
	}
	d.mu.Lock()
	d.sendLocked(ctl, Msg{Op: OpEnd})
	d.mu.Unlock()
}
