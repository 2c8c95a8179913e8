package region

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"net/netip"
	"sync"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// Pool allocates and frees flows in one region. It is hostd's side of the
// directory, and its truth is private: each slot's state, generation, ring
// offsets, capacity, owners and released bits, and the heap bitmap, live in
// the Pool's own memory. The Pool writes the shared directory so that guests
// can check a READY against it, but it never reads the directory (or the
// header) back to decide anything: a guest that scribbles on the mapping
// changes only what guests see, never what hostd allocates, frees or resets.
//
// With a Shadow (Persist, AdoptShadow), every change of a slot is also
// written to a root-only file, so that a restarted hostd can adopt the live
// flows without trusting the region.
//
// Rings are sized per flow (a power of two chosen by policy) and carved
// first-fit from the heap in whole chunks; see docs/region.md for why this
// beats fixed per-slot rings. A Pool is safe for concurrent use.
//
// Every access to the region's memory is fault-safe (touchLocked): a guest
// that truncates the region file makes the memory fault, and the Pool then
// counts the region dead (Dead) and goes on keeping its own record, so
// hostd can still free, list and drop the region's flows.
type Pool struct {
	r    *Region
	wake wait.Policy // wakes ring ends on revoke

	mu     sync.Mutex
	slots  []Entry  // hostd's record of every slot (State Free when unused)
	chunks []uint64 // heap chunk bitmap, derived from slots
	used   int      // live slots
	gen    uint64   // the last generation handed out, in any slot
	shadow *Shadow  // nil: not persisted
	closed bool
	dead   bool // the region's memory faulted: it is no longer touched
}

// touchLocked runs fn, which writes or reads the region's memory, unless
// the region is dead; a fault in it (the file was truncated under the
// mapping) makes the region dead. It reports whether fn ran to its end.
func (p *Pool) touchLocked(fn func()) bool {
	if p.dead {
		return false
	}
	if err := fault.Do(fn); err != nil {
		p.dead = true
		return false
	}
	return true
}

// Dead reports whether the region's memory faulted under hostd (a guest
// or hostd truncated its file): its flows cannot go on, and the region
// takes no new flow.
func (p *Pool) Dead() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dead
}

// Request describes a flow to allocate.
type Request struct {
	OwnerA, OwnerB uint32         // guest ids: A connects, B accepts
	Src, Dst       netip.AddrPort // the tuple as A sees it
	Capacity       int            // bytes per direction, a power of two
	Created        int64          // unix nanoseconds, for listings
}

// NewPool returns an empty pool over region r: every slot is free, and the
// directory is rewritten to say so (whatever it held is not trusted). sig
// wakes ring ends on revocation (nil: futex). The pool persists nothing
// until Persist.
func NewPool(r *Region, sig wait.Signal) *Pool {
	p := &Pool{r: r, wake: wait.Policy{Signal: sig}, slots: make([]Entry, r.layout.Slots)}
	p.chunks = make([]uint64, (p.heapChunks()+63)/64)
	for i := range p.slots {
		p.publishLocked(i)
	}
	return p
}

// heapChunks is how many chunks the heap has.
func (p *Pool) heapChunks() int { return int(p.r.layout.HeapSize / ChunkSize) }

// Persist writes the pool's whole table to sh and from then on every change
// of a slot. sh must have been made for this region's geometry.
func (p *Pool) Persist(sh *Shadow) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if sh.Slots() != len(p.slots) {
		return fmt.Errorf("shadow %s has %d slots, region %d", sh.Name(), sh.Slots(), len(p.slots))
	}
	if err := sh.putAll(p.slots); err != nil {
		return err
	}
	p.shadow = sh
	return nil
}

// AdoptShadow rebuilds the pool of region r from its shadow sh after a
// hostd restart, and persists to sh from then on. The shadow is hostd's own
// file, but it is checked as the directory once was: a record that does not
// validate, or whose rings overlap a record already adopted, is dropped
// (freed) and reported in problems. The directory is then rewritten from the
// adopted records, whatever a guest wrote into it while hostd was away; the
// rings of adopted flows are left alone (their ends still use them).
func AdoptShadow(r *Region, sh *Shadow, sig wait.Signal) (p *Pool, problems []error, err error) {
	if sh.Slots() != r.layout.Slots {
		return nil, nil, fmt.Errorf("shadow %s has %d slots, region %d: %w", sh.Name(), sh.Slots(), r.layout.Slots, ErrCorrupt)
	}
	recs, err := sh.records()
	if err != nil {
		return nil, nil, err
	}
	p = &Pool{r: r, wake: wait.Policy{Signal: sig}, slots: make([]Entry, r.layout.Slots)}
	p.chunks = make([]uint64, (p.heapChunks()+63)/64)
	problems = p.load(recs)
	for i := range p.slots {
		p.publishLocked(i)
	}
	if err := p.Persist(sh); err != nil {
		return nil, problems, err
	}
	return p, problems, nil
}

// load fills a new pool's table from shadow records (one per slot), which
// it checks as it would guest input: a record that does not validate, or
// whose rings overlap one loaded before, is dropped and reported.
func (p *Pool) load(recs []byte) (problems []error) {
	for i := range p.slots {
		b := recs[i*SlotSize : (i+1)*SlotSize]
		st, gen := State(le32(b[soState:])), le64(b[soGen:])
		p.gen = max(p.gen, gen) // generations are never handed out twice
		e, derr := DecodeEntry(b, st, gen, p.r.layout)
		switch {
		case derr == nil && e.State == Free:
			p.slots[i] = Entry{State: Free, Gen: gen}
			continue
		case derr == nil && e.State == Reserved:
			derr = errors.New("left half-allocated by a previous hostd")
		case derr == nil:
			s, end := p.chunkRange(e)
			if !p.rangeFree(s, end) {
				derr = errors.New("ring pair overlaps another flow")
				break
			}
			p.mark(s, end, true)
			p.used++
			p.slots[i] = e
			continue
		}
		problems = append(problems, fmt.Errorf("slot %d dropped: %w", i, derr))
		p.slots[i] = Entry{State: Free, Gen: gen}
	}
	return problems
}

// publishLocked writes hostd's record of slot i into the shared directory,
// like a seqlock: state Reserved first, then the fields, the generation,
// and the state last.
func (p *Pool) publishLocked(i int) {
	p.touchLocked(func() {
		b := p.r.slot(i)
		e := p.slots[i]
		word32(b, soState).Store(uint32(Reserved))
		if e.State == Free {
			clear(b[soReason:])
			word64(b, soGen).Store(e.Gen)
			word32(b, soState).Store(uint32(Free))
			return
		}
		EncodeEntry(b, e)
		word64(b, soGen).Store(e.Gen)
		word32(b, soState).Store(uint32(e.State))
	})
}

// setLocked makes e hostd's record of slot i: in the shadow first (so a
// restart never adopts less than guests may have seen), then in memory and
// the directory.
func (p *Pool) setLocked(i int, e Entry) error {
	if p.shadow != nil {
		if err := p.shadow.put(i, e); err != nil {
			return err
		}
	}
	p.slots[i] = e
	p.publishLocked(i)
	return nil
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
	run := 0
	for c := range p.heapChunks() {
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
// publishes the slot as Ready with a generation that no slot of this region
// had before.
func (p *Pool) Alloc(req Request) (slot int, e Entry, err error) {
	c := req.Capacity
	if c < ring.MinCapacity || c > ring.MaxCapacity || bits.OnesCount(uint(c)) != 1 {
		return 0, Entry{}, fmt.Errorf("ring capacity %d: want a power of two in [%d, %d]", c, ring.MinCapacity, ring.MaxCapacity)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, Entry{}, fmt.Errorf("region closed: %w", ErrStale)
	}
	if p.dead {
		return 0, Entry{}, fmt.Errorf("region memory gone (its file was truncated): %w", fault.ErrFault)
	}
	slot = -1
	for i := range p.slots {
		if p.slots[i].State == Free {
			slot = i
			break
		}
	}
	if slot < 0 {
		return 0, Entry{}, fmt.Errorf("all %d directory slots in use: %w", len(p.slots), ErrFull)
	}
	if p.gen == math.MaxUint64 { // only a corrupt shadow gets here: never wrap
		return 0, Entry{}, fmt.Errorf("generations used up (recreate the region): %w", ErrFull)
	}
	chunks := int(PairSize(c) / ChunkSize)
	first, ok := p.firstFit(chunks)
	if !ok {
		return 0, Entry{}, fmt.Errorf("no %d contiguous bytes left in the heap for two %d-byte rings: %w", PairSize(c), c, ErrFull)
	}
	off := p.r.layout.HeapOff + int64(first)*ChunkSize
	e = Entry{
		State: Ready, Gen: p.gen + 1, OwnerA: req.OwnerA, OwnerB: req.OwnerB,
		RingAB: off, RingBA: off + int64(ring.Size(c)), Capacity: c,
		Src: req.Src, Dst: req.Dst, Created: req.Created,
	}
	// Guests see the slot as Reserved while the rings are formatted.
	var ferr error
	if !p.touchLocked(func() {
		word32(p.r.slot(slot), soState).Store(uint32(Reserved))
		for _, ro := range []int64{e.RingAB, e.RingBA} {
			if ferr = ring.Format(p.r.mem[ro:ro+int64(ring.Size(c))], c); ferr != nil {
				ferr = fmt.Errorf("format ring at %d: %w", ro, ferr)
				return
			}
		}
	}) {
		return 0, Entry{}, fmt.Errorf("format rings: region memory gone (its file was truncated): %w", fault.ErrFault)
	}
	if ferr != nil {
		p.publishLocked(slot)
		return 0, Entry{}, ferr
	}
	if err := p.setLocked(slot, e); err != nil {
		p.publishLocked(slot)
		return 0, Entry{}, fmt.Errorf("record flow: %w", err)
	}
	p.gen = e.Gen
	p.mark(first, first+chunks, true)
	p.used++
	return slot, e, nil
}

// entryLocked returns hostd's record of slot i if it holds generation gen.
func (p *Pool) entryLocked(i int, gen uint64) (Entry, error) {
	if p.closed {
		return Entry{}, fmt.Errorf("slot %d: region closed: %w", i, ErrStale)
	}
	if i < 0 || i >= len(p.slots) {
		return Entry{}, fmt.Errorf("slot %d of %d: %w", i, len(p.slots), ErrStale)
	}
	e := p.slots[i]
	if e.Gen != gen || (e.State != Ready && e.State != Revoked) {
		return e, fmt.Errorf("slot %d: generation %d state %s, want generation %d: %w", i, e.Gen, e.State, gen, ErrStale)
	}
	return e, nil
}

// Entry returns hostd's record of slot i, which must hold generation gen.
func (p *Pool) Entry(i int, gen uint64) (Entry, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.entryLocked(i, gen)
}

// Revoke resets both rings of the flow in slot i (generation gen), marks it
// Revoked with reason, and wakes all four ring waiters, so both ends fail
// pending and later operations with ring.ErrReset. The rings are found
// from hostd's record; a ring header that a guest scribbled on is restored
// first (magic and capacity), so the reset reaches ends that attached to it.
func (p *Pool) Revoke(i int, gen uint64, reason uint32) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, err := p.entryLocked(i, gen)
	if err != nil {
		return err
	}
	e.State, e.Reason = Revoked, reason
	if err := p.setLocked(i, e); err != nil {
		return err
	}
	p.touchLocked(func() {
		ab, ba := p.forceRingsLocked(e)
		// Both reset flags before any wake-up, so an end woken by one
		// finds the other reset too (it may close the other ring
		// otherwise).
		ab.Reset(reason)
		ba.Reset(reason)
		ab.Abort(reason, &p.wake)
		ba.Abort(reason, &p.wake)
	})
	return nil
}

// forceRingsLocked attaches the two rings of hostd's record e, restoring
// each ring's magic and capacity if they no longer match (the ends read
// them once, at attach, so this moves nothing under them).
func (p *Pool) forceRingsLocked(e Entry) (ab, ba *ring.Ring) {
	rs := int64(ring.Size(e.Capacity))
	attach := func(off int64) *ring.Ring {
		mem := p.r.mem[off : off+rs : off+rs]
		if r, err := ring.Attach(mem, e.Capacity); err == nil {
			return r
		}
		word64(mem, ring.OffCapacity).Store(uint64(e.Capacity))
		word32(mem, ring.OffMagic).Store(ring.Magic)
		r, err := ring.Attach(mem, e.Capacity)
		if err != nil {
			panic(fmt.Sprintf("region: ring at %d does not attach after restoring its header: %v", off, err))
		}
		return r
	}
	return attach(e.RingAB), attach(e.RingBA)
}

// Stats reads the counters of the two rings of the flow in slot i
// (generation gen), found from hostd's record: for listings and metrics. A
// ring whose header a guest corrupted is reported as an error. It holds the
// pool's lock, so Close cannot unmap the region under it.
func (p *Pool) Stats(i int, gen uint64) (ab, ba ring.Stats, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, err := p.entryLocked(i, gen)
	if err != nil {
		return ab, ba, err
	}
	if !p.touchLocked(func() {
		var rab, rba *ring.Ring
		if rab, rba, err = p.r.ringsOf(e); err == nil {
			ab, ba = rab.Stats(), rba.Stats()
		}
	}) {
		return ring.Stats{}, ring.Stats{}, fmt.Errorf("slot %d: region memory gone: %w", i, fault.ErrFault)
	}
	return ab, ba, err
}

// Close closes the shadow, if any, and unmaps the region; the pool answers
// ErrStale from then on. Idempotent.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	var err error
	if p.shadow != nil {
		err = p.shadow.Close()
	}
	if err2 := p.r.Close(); err == nil {
		err = err2
	}
	return err
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
	if e.Released != SideA|SideB {
		// Only the released word changes: it is stored alone, so that an
		// end checking its READY meanwhile never sees the slot Reserved.
		if p.shadow != nil {
			if err := p.shadow.put(i, e); err != nil {
				return false, err
			}
		}
		p.slots[i] = e
		p.touchLocked(func() { word32(p.r.slot(i), soReleased).Store(e.Released) })
		return false, nil
	}
	return true, p.freeLocked(i, e)
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
	return p.freeLocked(i, e)
}

// freeLocked frees slot i, whose record is e. The slot keeps its
// generation (in memory and in the shadow), so a restarted hostd never
// hands out a generation again.
func (p *Pool) freeLocked(i int, e Entry) error {
	err := p.setLocked(i, Entry{State: Free, Gen: e.Gen})
	if err != nil {
		// Free in memory anyway: the shadow only lags (a restart would
		// adopt the flow and find no one reattaching).
		p.slots[i] = Entry{State: Free, Gen: e.Gen}
		p.publishLocked(i)
	}
	s, end := p.chunkRange(e)
	p.mark(s, end, false)
	p.used--
	return err
}

// Slot is a live slot with its index.
type Slot struct {
	Index int
	Entry
}

// Live returns hostd's records of the slots that hold flows (Ready or
// Revoked), in slot order.
func (p *Pool) Live() []Slot {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Slot
	for i, e := range p.slots {
		if e.State == Ready || e.State == Revoked {
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

// Shadow returns the pool's shadow, or nil.
func (p *Pool) Shadow() *Shadow {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.shadow
}
