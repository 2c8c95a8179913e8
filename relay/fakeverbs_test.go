package relay

import (
	"errors"
	"fmt"
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

	// Registrations for local reads (Gather): a WriteSG gathers from
	// them, checked as a NIC checks an lkey and its bounds.
	maxSGE    int
	regs      map[uint32][]byte
	nextKey   uint32
	gathered  map[uint32]uint64 // bytes gathered per key
	reading   map[uint32]int    // writes posted, not completed, per key they gather from
	violation []string          // a registration removed while a write still read it
	holdW     bool              // writes are not carried out until releaseWrites
	held      []func()
}

func (f *fakeVerbs) MaxSGE() int { return f.maxSGE }

func (f *fakeVerbs) Register(mem []byte) (uint32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextKey++
	f.regs[f.nextKey] = mem
	return f.nextKey, nil
}

func (f *fakeVerbs) Deregister(key uint32) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.regs[key]; !ok {
		return errors.New("fake: not registered")
	}
	if f.reading[key] > 0 {
		f.violation = append(f.violation, fmt.Sprintf("key %d deregistered with %d writes reading it", key, f.reading[key]))
	}
	delete(f.regs, key)
	return nil
}

// holdWrites keeps posted writes from being carried out (their bytes
// read, their completions) until releaseWrites.
func (f *fakeVerbs) holdWrites() {
	f.mu.Lock()
	f.holdW = true
	f.mu.Unlock()
}

// releaseWrites carries out the held writes in order; writes posted
// meanwhile queue behind them (a NIC carries out a queue pair's writes
// in order).
func (f *fakeVerbs) releaseWrites() {
	for {
		f.mu.Lock()
		if len(f.held) == 0 {
			f.holdW = false
			f.mu.Unlock()
			return
		}
		fn := f.held[0]
		f.held = f.held[1:]
		f.mu.Unlock()
		fn()
	}
}

func (f *fakeVerbs) heldWrites() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.held)
}

func (f *fakeVerbs) gatheredFrom(key uint32) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.gathered[key]
}

// WriteSG checks every entry as a NIC checks an lkey (registered, within
// its bounds): a bad one completes in error (local protection) and
// breaks the queue pair. The bytes are read when the write is carried
// out (now, or at releaseWrites), as a NIC reads them.
func (f *fakeVerbs) WriteSG(off, n int, sg []SGE) error {
	if off < 0 || n <= 0 || off+n > len(f.send) || len(sg) > f.maxSGE {
		return errors.New("fake: write outside the ring or too many entries")
	}
	f.mu.Lock()
	total := 0
	keys := map[uint32]bool{}
	for _, e := range sg {
		mem := f.send
		if e.Key != 0 {
			mem = f.regs[e.Key]
		}
		if mem == nil || e.Off > uint64(len(mem)) || uint64(e.Len) > uint64(len(mem))-e.Off {
			f.mu.Unlock()
			f.deliver(Completion{Op: OpWrite, Status: 4, Detail: "local protection error"})
			f.fail()
			return nil
		}
		total += int(e.Len)
		if e.Key != 0 {
			keys[e.Key] = true
		}
	}
	if total != n {
		f.mu.Unlock()
		return errors.New("fake: entries do not add up to the write")
	}
	for k := range keys {
		f.reading[k]++
	}
	sg = append([]SGE(nil), sg...)
	carry := func() {
		// What each entry names, as the NIC finds it now.
		f.mu.Lock()
		srcs := make([][]byte, len(sg))
		for i, e := range sg {
			mem := f.send
			if e.Key != 0 {
				mem = f.regs[e.Key]
				f.gathered[e.Key] += uint64(e.Len)
			}
			if mem == nil {
				f.violation = append(f.violation, fmt.Sprintf("key %d read after its deregistration", e.Key))
				srcs[i] = make([]byte, e.Len)
				continue
			}
			srcs[i] = mem[e.Off : e.Off+uint64(e.Len)]
		}
		for k := range keys {
			f.reading[k]--
		}
		f.mu.Unlock()
		f.land(off, n, func(dst []byte) {
			for _, b := range srcs {
				dst = dst[copy(dst, b):]
			}
		})
	}
	if f.holdW {
		f.held = append(f.held, carry)
		f.mu.Unlock()
		return nil
	}
	f.mu.Unlock()
	carry()
	return nil
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
		send: make([]byte, size), recv: make([]byte, size), note: make(chan struct{}, 1),
		maxSGE: 16, regs: map[uint32][]byte{}, gathered: map[uint32]uint64{}, reading: map[uint32]int{}}
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
	fill := func(dst []byte) { copy(dst, f.send[off:off+n]) }
	f.mu.Lock()
	if f.holdW {
		f.held = append(f.held, func() { f.land(off, n, fill) })
		f.mu.Unlock()
		return nil
	}
	f.mu.Unlock()
	f.land(off, n, fill)
	return nil
}

// land carries out a write of n bytes to off of the peer's ring, which
// fill writes (reading the source as the NIC does, now): the peer's
// receive completes, then this end's write.
func (f *fakeVerbs) land(off, n int, fill func(dst []byte)) {
	f.mu.Lock()
	broken := f.broken
	f.mu.Unlock()
	if broken {
		f.deliver(Completion{Op: OpWrite, Status: 5, Detail: "flush error"})
		return
	}
	p := f.peer
	p.mu.Lock()
	if p.posted == 0 || p.broken {
		p.mu.Unlock()
		f.deliver(Completion{Op: OpWrite, Status: 13, Detail: "RNR retry exceeded"})
		p.fail()
		return
	}
	p.posted--
	fill(p.recv[off : off+n])
	p.mu.Unlock()
	p.deliver(Completion{Op: OpRecv, Imm: uint32(n)})
	f.deliver(Completion{Op: OpWrite})
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
