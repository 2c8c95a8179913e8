package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/vhost/virtq"
)

// Backend is a virtio device served over vhost-user.
type Backend interface {
	// Locker guards the device and the Session's rings and memory: the
	// session takes it for every change, and calls the methods below
	// with it held.
	sync.Locker
	// Features are the device's own virtio feature bits; the session adds
	// VIRTIO_F_VERSION_1, VIRTIO_RING_F_INDIRECT_DESC and
	// VHOST_USER_F_PROTOCOL_FEATURES.
	Features() uint64
	// Config is the device's config space (GET_CONFIG reads it).
	Config() []byte
	// Queues is how many virtqueues the device has.
	Queues() int
	// Attach: a front-end connected; the session serves until Detach.
	Attach(s *Session)
	// Kick: queue q may have new buffers (a kick, or it became ready).
	Kick(q int)
	// Detach: the front-end is gone; every ring and the memory are gone
	// when it returns.
	Detach(s *Session)
}

// Session is one front-end connection. Its methods must be called with
// the Backend's lock held.
type Session struct {
	b        Backend
	conn     *net.UnixConn
	log      func(format string, args ...any)
	features uint64 // acked
	protocol uint64 // acked protocol features
	mem      *virtq.Memory
	maps     [][]byte
	rings    []*vring
	wg       sync.WaitGroup
}

// vring is one queue's description from the front-end.
type vring struct {
	num       int
	addr      *vringAddr
	base      uint16
	enabled   bool
	kick, cal *os.File
	errfd     *os.File
	q         *virtq.Queue
}

// Serve serves one front-end on c until it disconnects or breaks the
// protocol, and closes c. log gets one line per refused message.
func Serve(c *net.UnixConn, b Backend, log func(format string, args ...any)) error {
	s := &Session{b: b, conn: c, log: log, rings: make([]*vring, b.Queues())}
	for i := range s.rings {
		s.rings[i] = &vring{}
	}
	b.Lock()
	b.Attach(s)
	b.Unlock()
	defer func() {
		b.Lock()
		b.Detach(s)
		s.reset()
		b.Unlock()
		c.Close()
		s.wg.Wait()
	}()
	for {
		m, err := readMsg(c)
		if err != nil {
			if errors.Is(err, net.ErrClosed) || errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		reply, err := s.handle(m)
		m.closeFDs()
		if err != nil {
			s.log("vhost-user request %d refused: %v", m.req, err)
		}
		switch {
		case reply != nil:
			if werr := writeReply(c, m, reply); werr != nil {
				return werr
			}
		case m.flags&flagNeedReply != 0 && s.protocol&ProtocolReplyAck != 0:
			ack := uint64(0)
			if err != nil {
				ack = 1
			}
			if werr := writeReply(c, m, u64(ack)); werr != nil {
				return werr
			}
		case err != nil && replies(m.req):
			// The front-end waits for an answer we cannot give.
			return err
		}
	}
}

// replies reports whether a request always has a reply.
func replies(req uint32) bool {
	switch req {
	case reqGetFeatures, reqGetProtocolFeatures, reqGetVringBase, reqGetQueueNum, reqGetConfig:
		return true
	}
	return false
}

func (s *Session) offered() uint64 {
	return s.b.Features() | FeatureVersion1 | FeatureIndirectDesc | FeatureProtocolFeatures
}

// handle applies one message under the backend's lock; a non-nil reply is
// sent as the answer.
func (s *Session) handle(m *msg) ([]byte, error) {
	s.b.Lock()
	defer s.b.Unlock()
	switch m.req {
	case reqGetFeatures:
		return u64(s.offered()), nil
	case reqSetFeatures:
		f, err := m.u64()
		if err != nil {
			return nil, err
		}
		if f&^s.offered() != 0 {
			return nil, fmt.Errorf("SET_FEATURES %#x: not offered: %#x", f, f&^s.offered())
		}
		s.features = f
		s.invalidate(-1)
		return nil, nil
	case reqGetProtocolFeatures:
		return u64(ProtocolReplyAck | ProtocolConfig), nil
	case reqSetProtocolFeatures:
		f, err := m.u64()
		if err != nil {
			return nil, err
		}
		s.protocol = f & (ProtocolReplyAck | ProtocolConfig)
		return nil, nil
	case reqGetQueueNum:
		return u64(uint64(len(s.rings))), nil
	case reqSetOwner:
		return nil, nil
	case reqResetOwner, reqResetDevice:
		s.reset()
		return nil, nil
	case reqSetMemTable:
		return nil, s.setMemTable(m)
	case reqGetConfig:
		return s.getConfig(m)
	case reqSetConfig:
		return nil, errors.New("the config space is read-only")
	case reqSetVringNum, reqSetVringBase, reqGetVringBase, reqSetVringEnable:
		return s.vringState(m)
	case reqSetVringAddr:
		a, err := m.vringAddr()
		if err != nil {
			return nil, err
		}
		r, err := s.ring(a.index)
		if err != nil {
			return nil, err
		}
		s.invalidate(int(a.index))
		r.addr = &a
		s.ready(int(a.index))
		return nil, nil
	case reqSetVringKick, reqSetVringCall, reqSetVringErr:
		return nil, s.vringFD(m)
	}
	return nil, fmt.Errorf("request %d is not supported", m.req)
}

func (s *Session) ring(i uint32) (*vring, error) {
	if int(i) >= len(s.rings) {
		return nil, fmt.Errorf("vring %d: the device has %d", i, len(s.rings))
	}
	return s.rings[i], nil
}

func (s *Session) vringState(m *msg) ([]byte, error) {
	i, num, err := m.vringState()
	if err != nil {
		return nil, err
	}
	r, err := s.ring(i)
	if err != nil {
		return nil, err
	}
	switch m.req {
	case reqSetVringNum:
		if num < 1 || num > virtq.MaxSize || num&(num-1) != 0 {
			return nil, fmt.Errorf("SET_VRING_NUM %d: want a power of 2 up to %d", num, virtq.MaxSize)
		}
		s.invalidate(int(i))
		r.num = int(num)
	case reqSetVringBase:
		if num > 0xffff {
			return nil, fmt.Errorf("SET_VRING_BASE %d: a split ring's index is 16 bits", num)
		}
		s.invalidate(int(i))
		r.base = uint16(num)
	case reqGetVringBase:
		// The ring stops (vhost-user.rst, "Starting and stopping rings").
		s.invalidate(int(i))
		if r.kick != nil {
			r.kick.Close()
			r.kick = nil
		}
		st := make([]byte, 8)
		binary.LittleEndian.PutUint32(st, i)
		binary.LittleEndian.PutUint32(st[4:], uint32(r.base))
		return st, nil
	case reqSetVringEnable:
		r.enabled = num == 1
		if !r.enabled {
			s.invalidate(int(i))
		}
		s.ready(int(i))
	}
	return nil, nil
}

func (s *Session) vringFD(m *msg) error {
	v, err := m.u64()
	if err != nil {
		return err
	}
	i := uint32(v & 0xff)
	r, err := s.ring(i)
	if err != nil {
		return err
	}
	var f *os.File
	if v&vringFDInvalid == 0 {
		fd := m.takeFD()
		if fd < 0 {
			return fmt.Errorf("request %d for vring %d came without its fd", m.req, i)
		}
		if m.req == reqSetVringKick {
			// A non-blocking fd makes a pollable File: Close wakes
			// the goroutine reading it.
			if err := unix.SetNonblock(fd, true); err != nil {
				unix.Close(fd)
				return err
			}
		}
		f = os.NewFile(uintptr(fd), "vring eventfd")
	} else if m.req == reqSetVringKick {
		return fmt.Errorf("vring %d: polling without a kick fd is not supported", i)
	}
	switch m.req {
	case reqSetVringKick:
		if r.kick != nil {
			r.kick.Close()
		}
		s.invalidate(int(i))
		r.kick = f
		s.wg.Add(1)
		go s.kicks(int(i), r.kick)
		s.ready(int(i))
	case reqSetVringCall:
		if r.cal != nil {
			r.cal.Close()
		}
		r.cal = f
	case reqSetVringErr:
		if r.errfd != nil {
			r.errfd.Close()
		}
		r.errfd = f
	}
	return nil
}

// kicks reads ring i's kick eventfd and tells the backend, until the fd
// is closed (replaced, ring stopped, session over).
func (s *Session) kicks(i int, f *os.File) {
	defer s.wg.Done()
	buf := make([]byte, 8)
	for {
		if _, err := f.Read(buf); err != nil {
			return
		}
		s.b.Lock()
		if s.rings[i].kick == f {
			s.ready(i)
		}
		s.b.Unlock()
	}
}

// ready builds ring i's queue once everything is known, and kicks the
// backend: the driver may have made buffers available before.
func (s *Session) ready(i int) {
	r := s.rings[i]
	if r.q == nil {
		if r.addr == nil || r.num == 0 || r.kick == nil || s.mem == nil {
			return
		}
		if s.features&FeatureProtocolFeatures != 0 && !r.enabled {
			return
		}
		q, err := s.newQueue(r)
		if err != nil {
			s.log("vring %d: %v", i, err)
			return
		}
		r.q = q
	}
	s.b.Kick(i)
}

func (s *Session) newQueue(r *vring) (*virtq.Queue, error) {
	d, a, u := virtq.Sizes(r.num)
	desc, err := s.mem.SliceVA(r.addr.desc, uint64(d))
	if err != nil {
		return nil, fmt.Errorf("descriptor table: %w", err)
	}
	avail, err := s.mem.SliceVA(r.addr.avail, uint64(a))
	if err != nil {
		return nil, fmt.Errorf("available ring: %w", err)
	}
	used, err := s.mem.SliceVA(r.addr.used, uint64(u))
	if err != nil {
		return nil, fmt.Errorf("used ring: %w", err)
	}
	return virtq.New(s.mem, r.num, desc, avail, used, r.base, s.features&FeatureIndirectDesc != 0)
}

// invalidate drops ring i's queue (all rings for -1), keeping its place.
func (s *Session) invalidate(i int) {
	for j, r := range s.rings {
		if (i < 0 || i == j) && r.q != nil {
			r.base = r.q.LastAvail()
			r.q = nil
		}
	}
}

// reset forgets the rings and unmaps the memory.
func (s *Session) reset() {
	for i, r := range s.rings {
		for _, f := range []*os.File{r.kick, r.cal, r.errfd} {
			if f != nil {
				f.Close()
			}
		}
		s.rings[i] = &vring{}
	}
	s.unmap()
}

// Queue returns queue i while it runs, else nil.
func (s *Session) Queue(i int) *virtq.Queue {
	if i < 0 || i >= len(s.rings) {
		return nil
	}
	return s.rings[i].q
}

// Notify signals queue i's call eventfd, unless the driver asked for no
// interrupts.
func (s *Session) Notify(i int) {
	r := s.rings[i]
	if r.cal == nil || (r.q != nil && !r.q.Interrupts()) {
		return
	}
	signal(r.cal)
}

// Broken stops queue i for good (until the front-end sets it up again),
// logs why, and signals its error eventfd.
func (s *Session) Broken(i int, err error) {
	r := s.rings[i]
	s.log("vring %d stopped: %v", i, err)
	if r.errfd != nil {
		signal(r.errfd)
	}
}

func signal(f *os.File) {
	_, _ = f.Write(u64(1))
}

func (s *Session) getConfig(m *msg) ([]byte, error) {
	if len(m.payload) < 12 {
		return nil, fmt.Errorf("GET_CONFIG: payload of %d bytes", len(m.payload))
	}
	off, size := binary.LittleEndian.Uint32(m.payload), binary.LittleEndian.Uint32(m.payload[4:])
	if off > maxConfig || size > maxConfig-off || int(size) != len(m.payload)-12 {
		return nil, fmt.Errorf("GET_CONFIG: offset %d size %d in a payload of %d", off, size, len(m.payload))
	}
	out := append([]byte(nil), m.payload...)
	cfg := s.b.Config()
	if int(off) < len(cfg) {
		copy(out[12:], cfg[off:])
	}
	return out, nil
}
