package region

import (
	"fmt"
	"math/bits"
	"net/netip"
	"sync"

	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// Pool allocates and frees flows in one region. It is hostd's side of the
// directory: the only writer. A Pool is safe for concurrent use.
//
// Rings are sized per flow (a power of two chosen by policy) and carved
// first-fit from the heap in whole chunks; see docs/region.md for why this
// beats fixed per-slot rings.
type Pool struct {
	r    *Region
	wake wait.Policy // wakes ring ends on revoke

	mu     sync.Mutex
	chunks []uint64 // heap chunk bitmap, derived from the directory
	used   int      // live slots
}

// Request describes a flow to allocate.
type Request struct {
	OwnerA, OwnerB uint32         // guest ids: A connects, B accepts
	Src, Dst       netip.AddrPort // the tuple as A sees it
	Capacity       int            // bytes per direction, a power of two
	Created        int64          // unix nanoseconds, for listings
}

// Adopt builds the pool of region r from its directory: every live slot's
// ring pair is marked used. A slot that does not validate, or overlaps one
// already adopted, cannot be trusted: it is revoked and freed, and reported
// in problems (one error per slot) for the caller to log. sig wakes ring
// ends on revocation (nil: futex).
func Adopt(r *Region, sig wait.Signal) (p *Pool, problems []error) {
	p = &Pool{r: r, wake: wait.Policy{Signal: sig}}
	n := int(r.layout.HeapSize / ChunkSize)
	p.chunks = make([]uint64, (n+63)/64)
	for i := range r.layout.Slots {
		e, err := r.Entry(i)
		if err == nil && e.State == Reserved {
			err = fmt.Errorf("left half-written by a previous hostd")
		}
		if err == nil && e.State == Free {
			continue
		}
		if err == nil {
			s, end := p.chunkRange(e)
			if !p.rangeFree(s, end) {
				err = fmt.Errorf("ring pair overlaps another flow")
			} else {
				p.mark(s, end, true)
				p.used++
				continue
			}
		}
		problems = append(problems, fmt.Errorf("slot %d dropped: %w", i, err))
		p.dropLocked(i)
	}
	return p, problems
}

// dropLocked marks slot i free without touching any heap range.
func (p *Pool) dropLocked(i int) {
	b := p.r.slot(i)
	word32(b, soState).Store(uint32(Free))
}

func (p *Pool) chunkRange(e Entry) (start, end int) {
	s, en := e.Span()
	return int((s - p.r.layout.HeapOff) / ChunkSize), int((en - p.r.layout.HeapOff) / ChunkSize)
}

func (p *Pool) rangeFree(start, end int) bool {
	for c := start; c < end; c++ {
		if p.chunks[c/64]&(1<<(c%64)) != 0 {
			return false
		}
	}
	return true
}

func (p *Pool) mark(start, end int, used bool) {
	for c := start; c < end; c++ {
		if used {
			p.chunks[c/64] |= 1 << (c % 64)
		} else {
			p.chunks[c/64] &^= 1 << (c % 64)
		}
	}
}

// firstFit finds n free chunks in a row. A plain scan: allocation is on the
// control path and a 64 MiB heap has 16 Ki chunks.
func (p *Pool) firstFit(n int) (int, bool) {
	total := int(p.r.layout.HeapSize / ChunkSize)
	run := 0
	for c := range total {
		if p.chunks[c/64]&(1<<(c%64)) != 0 {
			run = 0
			continue
		}
		if run++; run == n {
			return c - n + 1, true
		}
	}
	return 0, false
}

// Alloc allocates a slot and a ring pair for req, formats both rings and
// publishes the slot as Ready with a new generation.
func (p *Pool) Alloc(req Request) (slot int, e Entry, err error) {
	c := req.Capacity
	if c < ring.MinCapacity || c > ring.MaxCapacity || bits.OnesCount(uint(c)) != 1 {
		return 0, Entry{}, fmt.Errorf("ring capacity %d: want a power of two in [%d, %d]", c, ring.MinCapacity, ring.MaxCapacity)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	slot = -1
	for i := range p.r.layout.Slots {
		if State(word32(p.r.slot(i), soState).Load()) == Free {
			slot = i
			break
		}
	}
	if slot < 0 {
		return 0, Entry{}, fmt.Errorf("all %d directory slots in use: %w", p.r.layout.Slots, ErrFull)
	}
	chunks := int(PairSize(c) / ChunkSize)
	first, ok := p.firstFit(chunks)
	if !ok {
		return 0, Entry{}, fmt.Errorf("no %d contiguous bytes left in the heap for two %d-byte rings: %w", PairSize(c), c, ErrFull)
	}
	b := p.r.slot(slot)
	word32(b, soState).Store(uint32(Reserved))
	off := p.r.layout.HeapOff + int64(first)*ChunkSize
	e = Entry{
		State: Ready, OwnerA: req.OwnerA, OwnerB: req.OwnerB,
		RingAB: off, RingBA: off + int64(ring.Size(c)), Capacity: c,
		Src: req.Src, Dst: req.Dst, Created: req.Created,
	}
	for _, ro := range []int64{e.RingAB, e.RingBA} {
		if err := ring.Format(p.r.mem[ro:ro+int64(ring.Size(c))], c); err != nil {
			word32(b, soState).Store(uint32(Free))
			return 0, Entry{}, fmt.Errorf("format ring at %d: %w", ro, err)
		}
	}
	EncodeEntry(b, e)
	e.Gen = word64(b, soGen).Add(1)
	word32(b, soState).Store(uint32(Ready))
	p.mark(first, first+chunks, true)
	p.used++
	return slot, e, nil
}

// entryLocked reads slot i and checks that it holds generation gen.
func (p *Pool) entryLocked(i int, gen uint64) (Entry, error) {
	e, err := p.r.Entry(i)
	if err != nil {
		return e, err
	}
	if e.Gen != gen || (e.State != Ready && e.State != Revoked) {
		return e, fmt.Errorf("slot %d: generation %d state %s, want generation %d: %w", i, e.Gen, e.State, gen, ErrStale)
	}
	return e, nil
}

// Revoke resets both rings of the flow in slot i (generation gen), marks it
// Revoked with reason, and wakes all four ring waiters, so both ends fail
// pending and later operations with ring.ErrReset.
func (p *Pool) Revoke(i int, gen uint64, reason uint32) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, err := p.entryLocked(i, gen)
	if err != nil {
		return err
	}
	b := p.r.slot(i)
	word32(b, soReason).Store(reason)
	word32(b, soState).Store(uint32(Revoked))
	ab, ba, err := p.r.ringsOf(e)
	if err != nil {
		return err // rings corrupt: the ends will see that on their own
	}
	// Both reset flags before any wake-up, so an end woken by one finds the
	// other reset too (it may close the other ring otherwise).
	ab.Reset(reason)
	ba.Reset(reason)
	ab.Abort(reason, &p.wake)
	ba.Abort(reason, &p.wake)
	return nil
}

// Release records that one side (SideA or SideB) let go of the flow. When
// both sides have, the slot and its ring pair are freed and Release reports
// freed = true. Releasing twice is harmless.
func (p *Pool) Release(i int, gen uint64, side uint32) (freed bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, err := p.entryLocked(i, gen)
	if err != nil {
		return false, err
	}
	e.Released |= side & (SideA | SideB)
	b := p.r.slot(i)
	word32(b, soReleased).Store(e.Released)
	if e.Released != SideA|SideB {
		return false, nil
	}
	p.freeLocked(i, e)
	return true, nil
}

// Free frees the flow in slot i at once, whatever its ends did: for ends
// that are gone (guest crashed or disconnected). Revoke it first if an end
// may still be attached.
func (p *Pool) Free(i int, gen uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, err := p.entryLocked(i, gen)
	if err != nil {
		return err
	}
	p.freeLocked(i, e)
	return nil
}

func (p *Pool) freeLocked(i int, e Entry) {
	word32(p.r.slot(i), soState).Store(uint32(Free))
	s, end := p.chunkRange(e)
	p.mark(s, end, false)
	p.used--
}

// Slot is a live directory entry with its index.
type Slot struct {
	Index int
	Entry
}

// Live returns the slots that hold flows (Ready or Revoked), in slot order.
func (p *Pool) Live() []Slot {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Slot
	for i := range p.r.layout.Slots {
		if e, err := p.r.Entry(i); err == nil && (e.State == Ready || e.State == Revoked) {
			out = append(out, Slot{i, e})
		}
	}
	return out
}

// Usage returns the live flows and the heap bytes their rings take.
func (p *Pool) Usage() (flows int, heapBytes int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var n int
	for _, w := range p.chunks {
		n += bits.OnesCount64(w)
	}
	return p.used, int64(n) * ChunkSize
}

// Region returns the pool's region.
func (p *Pool) Region() *Region { return p.r }
