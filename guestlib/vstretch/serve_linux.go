package vstretch

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// StretchDrain bounds how long OpDrain waits for the bridge to carry the
// write ring's last bytes and its LEFT (the Go library's Close waits as
// long: guestlib/stretch.go).
const StretchDrain = 10 * time.Second

// StretchEnd bounds how long a stretch whose process said OpBye may take
// to carry its rings' last bytes before it is closed.
const StretchEnd = time.Minute

// helloWait bounds how long a connection may take to send its OpOpen.
const helloWait = 5 * time.Second

// ServeOptions configure Serve.
type ServeOptions struct {
	// Dial opens a stream to the host for one stretch; nil: an AF_VSOCK
	// stream to CID 2, port relay.VsockPort.
	Dial func() (net.Conn, error)
	// Wait is how the bridges wait for the rings (nil: adaptive).
	Wait *wait.Policy
	// MaxCapacity bounds a ring's capacity (0: 16 MiB); MaxStretches
	// the stretches open at once (0: 1024, the host device's bound).
	MaxCapacity, MaxStretches int
	Logf                      func(format string, args ...any)
}

// Serve serves the daemon protocol (wire.go) on l until l fails or is
// closed: each connection is one stretch, bridged by this process. On
// return, stretches still open go on until their processes end them.
// Safe to call once per listener.
func Serve(l *net.UnixListener, o ServeOptions) error {
	if o.Dial == nil {
		o.Dial = func() (net.Conn, error) { return Dial(relay.VsockPort) }
	}
	if o.MaxCapacity == 0 {
		o.MaxCapacity = 16 << 20
	}
	if o.MaxStretches == 0 {
		o.MaxStretches = 1024
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	slots := make(chan struct{}, o.MaxStretches)
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			return err
		}
		select {
		case slots <- struct{}{}:
			go func() {
				defer func() { <-slots }()
				serveConn(c, &o)
			}()
		default:
			reply(c, Reply{Op: OpOpen, Status: 1, Text: fmt.Sprintf("%d stretches open already", o.MaxStretches)}, -1)
			c.Close()
		}
	}
}

// reply sends r, with fd (>= 0) as SCM_RIGHTS.
func reply(c *net.UnixConn, r Reply, fd int) error {
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	c.SetWriteDeadline(time.Now().Add(helloWait))
	_, _, err := c.WriteMsgUnix(r.Encode(), oob, nil)
	return err
}

// serveConn is one stretch's life: OpOpen, then OpDrain and OpStop as the
// library asks, until OpBye (a clean end) or any other end (a break).
//
// The stream to the host opens (and the Hello goes) only once the
// library's reader attached R: hostd's bridge attaches the other end's
// write ring as soon as it has the Hello, and that writer then moves to
// the ring; a C reader asleep in a blocking kernel recv at READY attaches
// R only once it is back, which nothing would bring about then (the
// writer sends no more TCP), so the other end's writer must not move
// before (the cross-host relays' "attached end to end", docs/crosshost.md).
// Until then the library's writer stays on TCP too (nothing attached W).
func serveConn(c *net.UnixConn, o *ServeOptions) {
	defer c.Close()
	buf := make([]byte, ReqSize+1)
	c.SetReadDeadline(time.Now().Add(helloWait))
	n, err := c.Read(buf)
	req, derr := DecodeReq(buf[:max(n, 0)])
	if err != nil || derr != nil || req.Op != OpOpen {
		reply(c, Reply{Op: OpOpen, Status: 1, Text: "the first request must be an open"}, -1)
		return
	}
	c.SetReadDeadline(time.Time{})
	pr, err := prepare(req, o)
	if err != nil {
		o.Logf("shunt-vstretchd: stretch %d/%d.%d: %v", req.Region, req.Slot, req.Gen, err)
		reply(c, Reply{Op: OpOpen, Status: 1, Text: err.Error()}, -1)
		return
	}
	err = reply(c, Reply{Op: OpOpen, Span: uint64(pr.span), Size: uint64(2 * pr.span)}, pr.fd)
	unix.Close(pr.fd)
	if err != nil {
		pr.free()
		return
	}
	name := fmt.Sprintf("%d/%d.%d", req.Region, req.Slot, req.Gen)
	o.Logf("shunt-vstretchd: stretch %s: rings of %d bytes given; the stream opens once they are attached", name, req.Capacity)

	// The library's requests, read on a goroutine of their own.
	type got struct {
		r   Req
		err error
	}
	reqs, done := make(chan got, 1), make(chan struct{})
	defer close(done)
	go func() {
		b := make([]byte, ReqSize+1)
		for {
			n, err := c.Read(b)
			r, derr := DecodeReq(b[:max(n, 0)])
			if err == nil && derr == nil && r.Op == OpOpen {
				derr = errors.New("a second open")
			}
			select {
			case reqs <- got{r, errors.Join(err, derr)}:
			case <-done:
				return
			}
			if err != nil || derr != nil || r.Op == OpBye {
				return
			}
		}
	}()

	var s *Stretch
	stopped := false // a STOP came before the stream opened: it never does
	poll := time.Millisecond
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		var tick <-chan time.Time
		if s == nil && !stopped {
			tick = timer.C
		}
		select {
		case <-tick:
			if !pr.attached() {
				poll = min(2*poll, 10*time.Millisecond)
				timer.Reset(poll)
				continue
			}
			if s, err = pr.open(req, o); err != nil {
				o.Logf("shunt-vstretchd: stretch %s: %v; its rings stay unbridged (the connection goes on by TCP)", name, err)
				stopped = true
				continue
			}
			o.Logf("shunt-vstretchd: stretch %s open", name)
		case g := <-reqs:
			if g.err != nil {
				// The process died, exec closed the socket, or it spoke
				// garbage: its rings' bytes are no longer vouched for.
				if s == nil {
					pr.free()
					return
				}
				o.Logf("shunt-vstretchd: stretch %s: its process went without closing it (%v): a break, %+v", name, g.err, s.Stats())
				s.Abort()
				return
			}
			switch r := g.r; r.Op {
			case OpDrain:
				if s == nil { // no reader ever attached W: its writer never moved
					reply(c, Reply{Op: OpDrain, Flag: 1, Text: "never bridged"}, -1)
					continue
				}
				deadline := time.Now().Add(StretchDrain)
				var flag uint8
				select {
				case <-s.InDone():
					if s.Flushed(deadline) {
						flag = 1
					}
				case <-time.After(StretchDrain):
				}
				reply(c, Reply{Op: OpDrain, Flag: flag, Text: fmt.Sprintf("%+v %v", s.Stats(), s.Err())}, -1)
			case OpStop:
				if s == nil { // nothing crossed: RESUME(all) at both ends
					// R's writer (the bridge that never came) leaves
					// unstarted, so the library's reader leaves R at
					// once, as a stopped bridge marks it (without this
					// its LEFT never came, and hostd waited out its
					// grace).
					stopped = true
					if w, err := ring.NewWriter(pr.r, &wait.Policy{}); err == nil {
						w.Leave()
					}
					reply(c, Reply{Op: OpStop, Text: "never bridged"}, -1)
					continue
				}
				e := s.Stop(proto.Reason(r.Reason))
				var started uint8
				if e.Started {
					started = 1
				}
				reply(c, Reply{Op: OpStop, Flag: started, X: e.X, Text: fmt.Sprintf("%+v", s.Stats())}, -1)
			case OpBye:
				if s == nil {
					pr.free()
					return
				}
				select {
				case <-s.Done():
				case <-time.After(StretchEnd):
				}
				s.Close()
				o.Logf("shunt-vstretchd: stretch %s closed: %+v %v", name, s.Stats(), s.Err())
				return
			}
		}
	}
}

// pending is a stretch's ring pair, given to the library, before its
// stream opens.
type pending struct {
	mem  []byte
	fd   int // the memfd, until the reply took it
	span int
	r    *ring.Ring // R, to see the library's reader attach
	free func()
}

func (p *pending) attached() bool { return p.r.Stats().ReaderAttached }

// prepare makes the ring pair in a memfd, formatted.
func prepare(req Req, o *ServeOptions) (*pending, error) {
	capacity := int(req.Capacity)
	if capacity < ring.MinCapacity || capacity > o.MaxCapacity || capacity&(capacity-1) != 0 {
		return nil, fmt.Errorf("ring capacity %d: want a power of two in [%d, %d]", capacity, ring.MinCapacity, o.MaxCapacity)
	}
	span := RingSpan(capacity)
	fd, err := unix.MemfdCreate("shunt-stretch", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(2*span)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("memfd: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, 2*span, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("map the rings: %w", err)
	}
	var once sync.Once
	p := &pending{mem: mem, fd: fd, span: span, free: func() { once.Do(func() { unix.Munmap(mem) }) }}
	if err = FormatRings(mem, capacity); err == nil {
		p.r, err = ring.Attach(mem[span:], capacity)
	}
	if err != nil {
		p.free()
		unix.Close(fd)
		return nil, err
	}
	return p, nil
}

// open dials the host and opens the stretch on p's rings; on failure
// this process's mapping is let go (the library keeps its own).
func (p *pending) open(req Req, o *ServeOptions) (*Stretch, error) {
	conn, err := o.Dial()
	if err != nil {
		return nil, fmt.Errorf("is the VM's vsock device up (vhost-user-vsock served by hostd)? %w", err)
	}
	return openOn(conn, relay.Hello{Region: req.Region, Slot: req.Slot, Gen: req.Gen}, int(req.Capacity), o.Wait, p.mem, p.free)
}
