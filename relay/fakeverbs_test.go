package relay

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// fakeVerbs is an in-process RC queue pair for the RDMA link's tests: a
// Write copies into the peer's ring and completes on both ends, as a NIC
// would; a write with no receive posted at the peer errors both queue
// pairs (an RNR failure). Tests also drive one end by hand (hostile).
type fakeVerbs struct {
	me         Endpoint
	send, recv []byte
	credit     [2]uint64
	peer       *fakeVerbs

	mu     sync.Mutex
	cq     []Completion
	note   chan struct{}
	posted int
	broken bool
	closed atomic.Bool
	hold   atomic.Bool // WriteCredit never completes (a release stays in flight)
	gone   atomic.Bool // the device's removal has begun (Gone)
}

func (f *fakeVerbs) Gone() error {
	if f.gone.Load() {
		return errors.New("fake: device removed")
	}
	return nil
}

var fakeQPN atomic.Uint32

func newFakeVerbs(size, depth uint32) *fakeVerbs {
	return &fakeVerbs{me: Endpoint{QPN: fakeQPN.Add(1), MTU: 5, Size: size, Depth: depth},
		send: make([]byte, size), recv: make([]byte, size), note: make(chan struct{}, 1)}
}

// fakePair is two fake queue pairs joined.
func fakePair(size, depth uint32) (*fakeVerbs, *fakeVerbs) {
	a, b := newFakeVerbs(size, depth), newFakeVerbs(size, depth)
	a.peer, b.peer = b, a
	return a, b
}

func (f *fakeVerbs) Local() Endpoint          { return f.me }
func (f *fakeVerbs) Connect(p Endpoint) error { return nil }
func (f *fakeVerbs) Send() []byte             { return f.send }
func (f *fakeVerbs) Recv() []byte             { return f.recv }
func (f *fakeVerbs) Credit() *[2]uint64       { return &f.credit }

func (f *fakeVerbs) deliver(c Completion) {
	f.mu.Lock()
	f.cq = append(f.cq, c)
	f.mu.Unlock()
	select {
	case f.note <- struct{}{}:
	default:
	}
}

// fail puts the queue pair in error: what is posted completes in error.
func (f *fakeVerbs) fail() {
	f.mu.Lock()
	f.broken = true
	f.mu.Unlock()
	f.deliver(Completion{Op: OpRecv, Status: 5, Detail: "flush error"})
}

func (f *fakeVerbs) Write(off, n int) error {
	if off < 0 || n <= 0 || off+n > len(f.send) {
		return errors.New("fake: write outside the send buffer")
	}
	f.mu.Lock()
	broken := f.broken
	f.mu.Unlock()
	if broken {
		f.deliver(Completion{Op: OpWrite, Status: 5, Detail: "flush error"})
		return nil
	}
	p := f.peer
	p.mu.Lock()
	if p.posted == 0 || p.broken {
		p.mu.Unlock()
		f.deliver(Completion{Op: OpWrite, Status: 13, Detail: "RNR retry exceeded"})
		p.fail()
		return nil
	}
	p.posted--
	copy(p.recv[off:off+n], f.send[off:off+n])
	p.mu.Unlock()
	p.deliver(Completion{Op: OpRecv, Imm: uint32(n)})
	f.deliver(Completion{Op: OpWrite})
	return nil
}

func (f *fakeVerbs) WriteCredit(bytes, batches uint64) error {
	atomic.StoreUint64(&f.peer.credit[0], bytes)
	atomic.StoreUint64(&f.peer.credit[1], batches)
	if !f.hold.Load() {
		f.deliver(Completion{Op: OpCredit})
	}
	return nil
}

func (f *fakeVerbs) PostRecv(k int) error {
	f.mu.Lock()
	f.posted += k
	f.mu.Unlock()
	return nil
}

func (f *fakeVerbs) Poll(cs []Completion) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := copy(cs, f.cq)
	f.cq = f.cq[n:]
	return n, nil
}

func (f *fakeVerbs) Sleep(d time.Duration) error {
	select {
	case <-f.note:
	case <-time.After(d):
	}
	return nil
}

func (f *fakeVerbs) Close() error {
	f.closed.Store(true)
	return nil
}
