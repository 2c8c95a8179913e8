package relaytest

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/relay"
)

// Verbs is one end of an in-process RC queue pair (Pair), implementing
// relay.Verbs and relay.Gather: a write copies into the peer's ring and
// completes on both ends, as a NIC would; registrations are checked as a
// NIC checks a local key and its bounds. HoldWrites keeps posted writes
// in the "NIC" (not carried out, no completion) until ReleaseWrites. Safe
// for concurrent use.
type Verbs struct {
	me         relay.Endpoint
	send, recv []byte
	credit     [2]uint64
	peer       *Verbs
	note       chan struct{}

	mu        sync.Mutex
	cq        []relay.Completion
	posted    int
	broken    bool
	regs      map[uint32][]byte
	nextKey   uint32
	reading   int            // posted writes that gather from a registration, not carried out
	readKey   map[uint32]int // the same, per key they gather from
	violation []string       // a registration removed or read while a write still needed it
	hold      bool           // writes wait in held until ReleaseWrites
	held      []func()
	closed    atomic.Bool
}

var qpn atomic.Uint32

// Pair gives the two ends of a queue pair with rings of size bytes and
// depth batches (relay.MinRing, relay.MinDepth at least).
func Pair(size, depth uint32) (*Verbs, *Verbs) {
	a, b := newVerbs(size, depth), newVerbs(size, depth)
	a.peer, b.peer = b, a
	return a, b
}

func newVerbs(size, depth uint32) *Verbs {
	return &Verbs{me: relay.Endpoint{QPN: qpn.Add(1), MTU: 5, Size: size, Depth: depth},
		send: make([]byte, size), recv: make([]byte, size), note: make(chan struct{}, 1), regs: map[uint32][]byte{}, readKey: map[uint32]int{}}
}

// HoldWrites keeps this end's writes from being carried out (their bytes
// read, their completions) until ReleaseWrites.
func (v *Verbs) HoldWrites() {
	v.mu.Lock()
	v.hold = true
	v.mu.Unlock()
}

// ReleaseWrites carries out the held writes in order, and the later ones
// at once. Safe to call more than once.
func (v *Verbs) ReleaseWrites() {
	for {
		v.mu.Lock()
		if len(v.held) == 0 {
			v.hold = false
			v.mu.Unlock()
			return
		}
		fn := v.held[0]
		v.held = v.held[1:]
		v.mu.Unlock()
		fn()
	}
}

// Held is how many writes wait in the "NIC"; Reading how many of them
// gather from registered (guest) memory.
func (v *Verbs) Held() (held, reading int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.held), v.reading
}

// Violations are the registrations removed while a posted write still
// gathered from them.
func (v *Verbs) Violations() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]string(nil), v.violation...)
}

// Closed reports whether the link closed this end (its queue pair freed).
func (v *Verbs) Closed() bool { return v.closed.Load() }

func (v *Verbs) Local() relay.Endpoint        { return v.me }
func (v *Verbs) Connect(relay.Endpoint) error { return nil }
func (v *Verbs) Send() []byte                 { return v.send }
func (v *Verbs) Recv() []byte                 { return v.recv }
func (v *Verbs) Credit() *[2]uint64           { return &v.credit }
func (v *Verbs) MaxSGE() int                  { return 16 }

func (v *Verbs) Close() error {
	v.closed.Store(true)
	return nil
}

func (v *Verbs) Register(mem []byte) (uint32, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.nextKey++
	v.regs[v.nextKey] = mem
	return v.nextKey, nil
}

func (v *Verbs) Deregister(key uint32) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, ok := v.regs[key]; !ok {
		return errors.New("fake verbs: not registered")
	}
	if v.readKey[key] > 0 {
		v.violation = append(v.violation, fmt.Sprintf("key %d deregistered with %d writes reading it", key, v.readKey[key]))
	}
	delete(v.regs, key)
	return nil
}

func (v *Verbs) Write(off, n int) error {
	if off < 0 || n <= 0 || off+n > len(v.send) {
		return errors.New("fake verbs: write outside the send buffer")
	}
	return v.WriteSG(off, n, []relay.SGE{{Off: uint64(off), Len: uint32(n)}})
}

// WriteSG checks every entry (registered, within bounds: else a local
// protection error breaks the queue pair); the bytes are read when the
// write is carried out, now or at ReleaseWrites, as a NIC reads them.
func (v *Verbs) WriteSG(off, n int, sg []relay.SGE) error {
	if off < 0 || n <= 0 || off+n > len(v.send) || len(sg) > v.MaxSGE() {
		return errors.New("fake verbs: write outside the ring or too many entries")
	}
	v.mu.Lock()
	total, guest := 0, false
	for _, e := range sg {
		mem := v.send
		if e.Key != 0 {
			mem, guest = v.regs[e.Key], true
		}
		if mem == nil || e.Off > uint64(len(mem)) || uint64(e.Len) > uint64(len(mem))-e.Off {
			v.mu.Unlock()
			v.deliver(relay.Completion{Op: relay.OpWrite, Status: 4, Detail: "local protection error"})
			v.fail()
			return nil
		}
		total += int(e.Len)
	}
	if total != n {
		v.mu.Unlock()
		return errors.New("fake verbs: entries do not add up to the write")
	}
	if guest {
		v.reading++
	}
	for _, e := range sg {
		if e.Key != 0 {
			v.readKey[e.Key]++
		}
	}
	sg = append([]relay.SGE(nil), sg...)
	carry := func() {
		v.mu.Lock()
		srcs := make([][]byte, len(sg))
		for i, e := range sg {
			mem := v.send
			if e.Key != 0 {
				mem = v.regs[e.Key]
			}
			if mem == nil {
				v.violation = append(v.violation, fmt.Sprintf("key %d read after its deregistration", e.Key))
				srcs[i] = make([]byte, e.Len)
				continue
			}
			srcs[i] = mem[e.Off : e.Off+uint64(e.Len)]
		}
		if guest {
			v.reading--
		}
		for _, e := range sg {
			if e.Key != 0 {
				v.readKey[e.Key]--
			}
		}
		v.mu.Unlock()
		v.land(off, n, srcs)
	}
	if v.hold {
		v.held = append(v.held, carry)
		v.mu.Unlock()
		return nil
	}
	v.mu.Unlock()
	carry()
	return nil
}

// land carries out a write of n bytes, srcs in order, to off of the
// peer's ring: the peer's receive completes, then this end's write.
func (v *Verbs) land(off, n int, srcs [][]byte) {
	v.mu.Lock()
	broken := v.broken
	v.mu.Unlock()
	if broken || v.closed.Load() {
		v.deliver(relay.Completion{Op: relay.OpWrite, Status: 5, Detail: "flush error"})
		return
	}
	p := v.peer
	p.mu.Lock()
	if p.posted == 0 || p.broken {
		p.mu.Unlock()
		v.deliver(relay.Completion{Op: relay.OpWrite, Status: 13, Detail: "RNR retry exceeded"})
		p.fail()
		return
	}
	p.posted--
	dst := p.recv[off : off+n]
	for _, b := range srcs {
		dst = dst[copy(dst, b):]
	}
	p.mu.Unlock()
	p.deliver(relay.Completion{Op: relay.OpRecv, Imm: uint32(n)})
	v.deliver(relay.Completion{Op: relay.OpWrite})
}

func (v *Verbs) deliver(c relay.Completion) {
	v.mu.Lock()
	v.cq = append(v.cq, c)
	v.mu.Unlock()
	select {
	case v.note <- struct{}{}:
	default:
	}
}

// fail puts the queue pair in error.
func (v *Verbs) fail() {
	v.mu.Lock()
	v.broken = true
	v.mu.Unlock()
	v.deliver(relay.Completion{Op: relay.OpRecv, Status: 5, Detail: "flush error"})
}

func (v *Verbs) WriteCredit(bytes, batches uint64) error {
	atomic.StoreUint64(&v.peer.credit[0], bytes)
	atomic.StoreUint64(&v.peer.credit[1], batches)
	v.deliver(relay.Completion{Op: relay.OpCredit})
	return nil
}

func (v *Verbs) PostRecv(k int) error {
	v.mu.Lock()
	v.posted += k
	v.mu.Unlock()
	return nil
}

func (v *Verbs) Poll(cs []relay.Completion) (int, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	n := copy(cs, v.cq)
	v.cq = v.cq[n:]
	return n, nil
}

func (v *Verbs) Sleep(d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-v.note:
	case <-t.C:
	}
	return nil
}

var (
	_ relay.Verbs  = (*Verbs)(nil)
	_ relay.Gather = (*Verbs)(nil)
)
