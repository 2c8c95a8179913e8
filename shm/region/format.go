package region

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/shuntnet/shunt/shm/ring"
)

// Header layout (offsets in bytes). Written once by hostd at Format, except
// Generation, which hostd bumps each time it adopts the region.
const (
	HeaderSize = 4096
	SlotSize   = 128
	ChunkSize  = 4096
	Version    = 1

	offMagic      = 0  // [8]byte "SHUNTRG\x00"
	offVersion    = 8  // u32
	offHeaderSize = 12 // u32
	offSize       = 16 // u64 region bytes
	offSlots      = 24 // u32 directory slots
	offSlotSize   = 28 // u32
	offDir        = 32 // u64 directory offset
	offHeap       = 40 // u64 heap offset
	offHeapSize   = 48 // u64 heap bytes
	offChunk      = 56 // u32 allocation unit
	offGeneration = 64 // u64, atomic: bumped by hostd on each adoption
	offRegionID   = 72 // u32: the id guests know a pair region by (0: a group region)
	offGuestA     = 76 // u32: a pair region's guests, A the lower id (0: a group region)
	offGuestB     = 80 // u32

	// MaxSlots bounds the directory so that a hostile header cannot make a
	// reader allocate or scan without limit.
	MaxSlots = 1 << 16
	// MinSize is the smallest useful region: header, one page of
	// directory, and one minimum ring pair.
	MinSize = 64 << 10
)

var magic = [8]byte{'S', 'H', 'U', 'N', 'T', 'R', 'G', 0}

var (
	// ErrCorrupt means the region's header or directory is inconsistent.
	ErrCorrupt = errors.New("shunt region: corrupt")
	// ErrFull means no slot or no heap space is left for a new flow.
	ErrFull = errors.New("shunt region: no space for another flow")
	// ErrStale means a slot no longer holds the flow (generation) asked for.
	ErrStale = errors.New("shunt region: flow slot was reused or freed")
)

// Geometry is what a region's creator chooses.
type Geometry struct {
	Size  int64 // total bytes; a multiple of ChunkSize (a power of two for ivshmem)
	Slots int   // flow directory entries
}

// Layout is a validated header: the geometry plus where things are.
type Layout struct {
	Geometry
	DirOff   int64
	HeapOff  int64
	HeapSize int64
}

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }

// LayoutFor computes the layout of a region with geometry g.
func LayoutFor(g Geometry) (Layout, error) {
	if g.Slots < 1 || g.Slots > MaxSlots {
		return Layout{}, fmt.Errorf("region slots %d: want 1 to %d", g.Slots, MaxSlots)
	}
	if g.Size < MinSize || g.Size%ChunkSize != 0 {
		return Layout{}, fmt.Errorf("region size %d: want a multiple of %d, at least %d", g.Size, ChunkSize, MinSize)
	}
	l := Layout{Geometry: g, DirOff: HeaderSize}
	l.HeapOff = l.DirOff + roundUp(int64(g.Slots)*SlotSize, ChunkSize)
	l.HeapSize = g.Size - l.HeapOff
	if l.HeapSize < 2*ChunkSize {
		return Layout{}, fmt.Errorf("region size %d leaves no heap after %d slots", g.Size, g.Slots)
	}
	return l, nil
}

// EncodeHeader writes the header for l into b (at least HeaderSize bytes),
// with the given generation.
func EncodeHeader(b []byte, l Layout, gen uint64) {
	clear(b[:HeaderSize])
	le := binary.LittleEndian
	copy(b[offMagic:], magic[:])
	le.PutUint32(b[offVersion:], Version)
	le.PutUint32(b[offHeaderSize:], HeaderSize)
	le.PutUint64(b[offSize:], uint64(l.Size))
	le.PutUint32(b[offSlots:], uint32(l.Slots))
	le.PutUint32(b[offSlotSize:], SlotSize)
	le.PutUint64(b[offDir:], uint64(l.DirOff))
	le.PutUint64(b[offHeap:], uint64(l.HeapOff))
	le.PutUint64(b[offHeapSize:], uint64(l.HeapSize))
	le.PutUint32(b[offChunk:], ChunkSize)
	le.PutUint64(b[offGeneration:], gen)
}

// DecodeHeader validates the header in b against a mapping of mapped bytes
// and returns the layout. Every field must agree with the layout that its
// geometry implies, so a header cannot point anywhere the format would not.
func DecodeHeader(b []byte, mapped int64) (Layout, error) {
	if len(b) < HeaderSize {
		return Layout{}, fmt.Errorf("region header: %d bytes, want %d: %w", len(b), HeaderSize, ErrCorrupt)
	}
	le := binary.LittleEndian
	if [8]byte(b[offMagic:offMagic+8]) != magic {
		return Layout{}, fmt.Errorf("region header: bad magic %q (not a Shunt region?): %w", b[offMagic:offMagic+8], ErrCorrupt)
	}
	if v := le.Uint32(b[offVersion:]); v != Version {
		return Layout{}, fmt.Errorf("region header: version %d, this build reads %d: %w", v, Version, ErrCorrupt)
	}
	size := le.Uint64(b[offSize:])
	slots := le.Uint32(b[offSlots:])
	if size > uint64(mapped) {
		return Layout{}, fmt.Errorf("region header: size %d exceeds the %d mapped bytes: %w", size, mapped, ErrCorrupt)
	}
	l, err := LayoutFor(Geometry{Size: int64(size), Slots: int(slots)})
	if err != nil {
		return Layout{}, fmt.Errorf("region header: %w: %w", err, ErrCorrupt)
	}
	if le.Uint32(b[offHeaderSize:]) != HeaderSize || le.Uint32(b[offSlotSize:]) != SlotSize ||
		le.Uint32(b[offChunk:]) != ChunkSize || le.Uint64(b[offDir:]) != uint64(l.DirOff) ||
		le.Uint64(b[offHeap:]) != uint64(l.HeapOff) || le.Uint64(b[offHeapSize:]) != uint64(l.HeapSize) {
		return Layout{}, fmt.Errorf("region header: geometry fields disagree with size %d and %d slots: %w", size, slots, ErrCorrupt)
	}
	return l, nil
}

// State is a directory slot's state.
type State uint32

const (
	Free     State = iota // unused; the heap range is unowned
	Reserved              // hostd is writing the slot; readers ignore it
	Ready                 // the flow is live
	Revoked               // hostd revoked it; rings are reset; waits for release
	numStates
)

func (s State) String() string {
	switch s {
	case Free:
		return "free"
	case Reserved:
		return "reserved"
	case Ready:
		return "ready"
	case Revoked:
		return "revoked"
	}
	return fmt.Sprintf("state(%d)", uint32(s))
}

// Slot layout (offsets within a 128-byte directory entry). hostd writes all
// of it; state and generation are atomic and bracket the rest (seqlock).
const (
	soState    = 0  // u32 State, atomic
	soReason   = 4  // u32 reason code of a revocation
	soGen      = 8  // u64 generation, atomic, bumped on each allocation
	soOwnerA   = 16 // u32 guest id of the active (connecting) end; writes ring AB
	soOwnerB   = 20 // u32 guest id of the passive (accepting) end; writes ring BA
	soRingAB   = 24 // u64 region offset of the A->B ring
	soRingBA   = 32 // u64 region offset of the B->A ring
	soCapacity = 40 // u64 data bytes of each ring
	soReleased = 48 // u32 bit 0: A released, bit 1: B released
	soSrc      = 56 // [16]byte A's address (IPv4 as mapped IPv6)
	soDst      = 72 // [16]byte the address A connected to
	soSrcPort  = 88 // u16
	soDstPort  = 90 // u16
	soCreated  = 96 // u64 unix nanoseconds
)

// Sides of a flow, as bits in Entry.Released.
const (
	SideA = 1 << iota // the active, connecting end
	SideB             // the passive, accepting end
)

// Entry is a decoded directory slot.
type Entry struct {
	State    State
	Reason   uint32
	Gen      uint64
	OwnerA   uint32
	OwnerB   uint32
	RingAB   int64
	RingBA   int64
	Capacity int
	Released uint32
	Src, Dst netip.AddrPort // the tuple as A sees it
	Created  int64          // unix nanoseconds
}

// PairSize returns the heap bytes a ring pair of the given capacity takes,
// rounded up to whole chunks.
func PairSize(capacity int) int64 {
	return roundUp(2*int64(ring.Size(capacity)), ChunkSize)
}

// EncodeEntry writes e's fields except state and generation into slot b.
func EncodeEntry(b []byte, e Entry) {
	le := binary.LittleEndian
	le.PutUint32(b[soReason:], e.Reason)
	le.PutUint32(b[soOwnerA:], e.OwnerA)
	le.PutUint32(b[soOwnerB:], e.OwnerB)
	le.PutUint64(b[soRingAB:], uint64(e.RingAB))
	le.PutUint64(b[soRingBA:], uint64(e.RingBA))
	le.PutUint64(b[soCapacity:], uint64(e.Capacity))
	le.PutUint32(b[soReleased:], e.Released)
	src, dst := e.Src.Addr().As16(), e.Dst.Addr().As16()
	copy(b[soSrc:soSrc+16], src[:])
	copy(b[soDst:soDst+16], dst[:])
	le.PutUint16(b[soSrcPort:], e.Src.Port())
	le.PutUint16(b[soDstPort:], e.Dst.Port())
	le.PutUint64(b[soCreated:], uint64(e.Created))
}

// DecodeEntry decodes slot b with the given state and generation, and
// validates it against layout l: a live entry's rings must lie inside the
// heap, chunk-aligned, not overlap each other, and have a valid capacity.
// A Free or Reserved entry is returned with only State and Gen set.
func DecodeEntry(b []byte, state State, gen uint64, l Layout) (Entry, error) {
	e := Entry{State: state, Gen: gen}
	if state >= numStates {
		return e, fmt.Errorf("slot state %d: %w", uint32(state), ErrCorrupt)
	}
	if state == Free || state == Reserved {
		return e, nil
	}
	le := binary.LittleEndian
	e.Reason = le.Uint32(b[soReason:])
	e.OwnerA = le.Uint32(b[soOwnerA:])
	e.OwnerB = le.Uint32(b[soOwnerB:])
	ab, ba, c := le.Uint64(b[soRingAB:]), le.Uint64(b[soRingBA:]), le.Uint64(b[soCapacity:])
	e.Released = le.Uint32(b[soReleased:])
	src := netip.AddrFrom16([16]byte(b[soSrc : soSrc+16])).Unmap()
	dst := netip.AddrFrom16([16]byte(b[soDst : soDst+16])).Unmap()
	e.Src = netip.AddrPortFrom(src, le.Uint16(b[soSrcPort:]))
	e.Dst = netip.AddrPortFrom(dst, le.Uint16(b[soDstPort:]))
	e.Created = int64(le.Uint64(b[soCreated:]))
	if c < ring.MinCapacity || c > ring.MaxCapacity || c&(c-1) != 0 {
		return e, fmt.Errorf("slot capacity %d: %w", c, ErrCorrupt)
	}
	e.Capacity = int(c)
	heapEnd := uint64(l.HeapOff + l.HeapSize)
	if ab < uint64(l.HeapOff) || ab%ChunkSize != 0 || ab > heapEnd || heapEnd-ab < uint64(PairSize(int(c))) {
		return e, fmt.Errorf("slot ring pair at %d (capacity %d) outside the heap [%d, %d): %w", ab, c, l.HeapOff, heapEnd, ErrCorrupt)
	}
	if ba != ab+uint64(ring.Size(int(c))) {
		return e, fmt.Errorf("slot rings at %d and %d are not one pair: %w", ab, ba, ErrCorrupt)
	}
	if e.Released&^(SideA|SideB) != 0 {
		return e, fmt.Errorf("slot released bits %#x: %w", e.Released, ErrCorrupt)
	}
	e.RingAB, e.RingBA = int64(ab), int64(ba)
	return e, nil
}

// Span returns the region range [start, end) of the entry's ring pair: the
// AB ring, then the BA ring right after it, rounded up to whole chunks.
func (e Entry) Span() (start, end int64) {
	return e.RingAB, e.RingAB + PairSize(e.Capacity)
}
