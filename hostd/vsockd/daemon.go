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

// eventBuffer bounds the frontend events waiting for a slow controller;
// a controller that lets it fill is dropped (it dials again and asks
// afresh).
const eventBuffer = 1024

// answerSlots bounds the answers queued for the controller: an answer
// waits for a slot (the writer frees one per message written, each write
// bounded by writeWait), so a list of every device streams at the pace
// hostd reads it and never crowds out the events' room.
const answerSlots = 64

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
	c     *net.UnixConn
	out   chan queued   // eventBuffer events and answerSlots answers
	slots chan struct{} // one per answer queued, freed by the writer
	free  chan struct{} // closed once it no longer holds the slot
	// dropped: the controller was dropped (logged once); under d.mu.
	dropped bool
}

// queued is a message for the writer; answer says it holds a slot.
type queued struct {
	m      Msg
	answer bool
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
// vsock until it restarts (QEMU 7.2 does not reconnect). It waits for
// every goroutine of the daemon's.
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

// accept serves the control connections.
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
// the one it replaces to end once closed (its writer's write is cut
// short by the close; its request in hand, at most a device's start).
const takeoverWait = writeWait

// byeWait bounds the goodbye written to a controller being replaced: a
// hung hostd may not read it.
const byeWait = 500 * time.Millisecond

// control serves one connection: its hello, then its requests until it
// goes. The newest hello wins: a hostd that says hello replaces the
// controller connected before it (a restarted hostd may come before its
// dead predecessor's EOF was read, and a hung one must not keep the
// devices from the next for ever); only root reaches the socket.
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
	ctl := &controller{c: c, out: make(chan queued, eventBuffer+answerSlots), slots: make(chan struct{}, answerSlots), free: make(chan struct{})}
	d.mu.Lock()
	for d.ctl != nil && !d.closed {
		old := d.ctl
		d.mu.Unlock()
		d.log.Warn("a new hostd said hello: the previous one's control connection closed")
		_ = old.c.SetWriteDeadline(time.Now().Add(byeWait))
		_ = write(old.c, Msg{Op: OpBye, Error: "another hostd took over shunt-vsockd"})
		old.c.Close()
		select {
		case <-old.free:
		case <-time.After(takeoverWait):
			d.log.Error("the previous hostd's control connection did not end: the new one refused")
			_ = write(c, Msg{Op: OpError, Error: "the previous hostd's connection did not end; try again"})
			return
		}
		d.mu.Lock()
	}
	if d.closed {
		d.mu.Unlock()
		_ = write(c, Msg{Op: OpError, Error: "shutting down"})
		return
	}
	d.ctl = ctl
	d.mu.Unlock()
	d.log.Info("hostd connected", "version", m.Version)
	done := make(chan struct{})
	go func() {
		defer close(done)
		d.writer(ctl)
	}()
	d.answer(ctl, Msg{Op: OpHello, Version: min(m.Version, Version), PID: os.Getpid()})
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

// writer sends ctl's messages until out closes, freeing an answer's slot
// once it is written; a failed write drops the controller (it goes on
// taking messages, so nobody waits on a slot, until serve ends).
func (d *Daemon) writer(ctl *controller) {
	failed := false
	for q := range ctl.out {
		if !failed {
			_ = ctl.c.SetWriteDeadline(time.Now().Add(writeWait))
			if err := write(ctl.c, q.m); err != nil {
				failed = true
				ctl.c.Close()
			}
		}
		if q.answer {
			<-ctl.slots
		}
	}
}

// answer queues an answer for ctl, waiting for a slot: at most
// answerSlots writes, each bounded by writeWait. Not under d.mu; only
// serve's goroutine answers.
func (d *Daemon) answer(ctl *controller, m Msg) {
	d.reserve(ctl)
	d.mu.Lock()
	d.answerLocked(ctl, m)
	d.mu.Unlock()
}

// reserve takes an answer's slot, for answerLocked.
func (d *Daemon) reserve(ctl *controller) { ctl.slots <- struct{}{} }

// answerLocked queues an answer whose slot was reserved: it never
// blocks (out has room for every slot beside eventBuffer events), and,
// queued under d.mu, it keeps its order with the frontend events.
func (d *Daemon) answerLocked(ctl *controller, m Msg) {
	ctl.out <- queued{m: m, answer: true}
}

// eventLocked queues an event for ctl (nil: no controller); one whose
// queue is full is dropped (its reads fail, serve ends), logged once.
// Under d.mu.
func (d *Daemon) eventLocked(ctl *controller, m Msg) {
	if ctl == nil || ctl.dropped {
		return
	}
	select {
	case ctl.out <- queued{m: m}:
	default:
		ctl.dropped = true
		d.log.Warn("hostd does not read its control connection: dropped", "events_queued", eventBuffer)
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

// list answers every device's Stat, then end, each as a slot frees: a
// list of maxDevices streams at hostd's pace.
func (d *Daemon) list(ctl *controller) {
	type entry struct {
		s   *served
		dev Device
	}
	d.mu.Lock()
	es := make([]entry, 0, len(d.devs))
	for _, s := range d.devs {
		es = append(es, entry{s, s.dev})
	}
	d.mu.Unlock()
	sort.Slice(es, func(i, j int) bool { return es[i].dev.ID < es[j].dev.ID })
	for _, e := range es {
		for _, st := range e.s.room.Stats() {
			st.Guest = e.dev.Guest // the room keeps the name it was made with
			d.answer(ctl, Msg{Op: OpStat, ID: e.dev.ID, Stat: &st})
		}
	}
	d.answer(ctl, Msg{Op: OpEnd})
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
	d.answer(ctl, Msg{Op: OpEnd})
}
