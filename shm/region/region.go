package region

import (
	"encoding/binary"
	"fmt"
	"os"
	"sync/atomic"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/shm/ring"
)

// Region is a mapped, validated region. Its methods are safe for concurrent
// use; the directory is written only through a Pool.
type Region struct {
	mem    []byte
	layout Layout
	unmap  func() error
	closed atomic.Bool
}

// Format writes a fresh header and an empty directory into mem.
func Format(mem []byte, g Geometry) (*Region, error) {
	l, err := LayoutFor(g)
	if err != nil {
		return nil, err
	}
	if int64(len(mem)) < g.Size || !aligned(mem) {
		return nil, fmt.Errorf("format region: %d bytes mapped, geometry needs %d, %d-byte aligned", len(mem), g.Size, alignment)
	}
	clear(mem[:l.HeapOff])
	EncodeHeader(mem, l, 1)
	return &Region{mem: mem[:g.Size:g.Size], layout: l}, nil
}

// Attach validates the header in mem and returns the region over it.
func Attach(mem []byte) (*Region, error) {
	if !aligned(mem) {
		return nil, fmt.Errorf("attach region: window not %d-byte aligned", alignment)
	}
	l, err := DecodeHeader(mem, int64(len(mem)))
	if err != nil {
		return nil, err
	}
	return &Region{mem: mem[:l.Size:l.Size], layout: l}, nil
}

// Create creates (or truncates) the file at path with mode perm, sizes it,
// maps it and formats it. Close unmaps it; the file stays for guests. For
// tests and tools: hostd makes its regions with Files, which never follows
// a symlink or takes over a file that exists.
func Create(path string, g Geometry, perm os.FileMode) (*Region, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, perm)
	if err != nil {
		return nil, fmt.Errorf("create region %s: %w", path, err)
	}
	defer f.Close()
	if err := f.Truncate(g.Size); err != nil {
		return nil, fmt.Errorf("size region %s: %w", path, err)
	}
	return mapAnd(f, g.Size, func(mem []byte) (*Region, error) { return Format(mem, g) })
}

// CreateFile formats the region over an open file (a memfd, say) that is
// already at least g.Size bytes. The caller keeps ownership of f.
func CreateFile(f *os.File, g Geometry) (*Region, error) {
	return mapAnd(f, g.Size, func(mem []byte) (*Region, error) { return Format(mem, g) })
}

// Open maps an existing region file (a /dev/shm file, or an ivshmem BAR's
// resource2 file in a VM) and validates its header.
func Open(path string) (*Region, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("open region %s: %w", path, err)
	}
	defer f.Close()
	return OpenFile(f)
}

// OpenFile maps the region in f and validates its header. The caller keeps
// ownership of f; the mapping stays valid after f is closed.
func OpenFile(f *os.File) (*Region, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("stat region %s: %w", f.Name(), err)
	}
	if st.Size() < MinSize {
		return nil, fmt.Errorf("region %s: %d bytes is too small to be a region: %w", f.Name(), st.Size(), ErrCorrupt)
	}
	return mapAnd(f, st.Size(), Attach)
}

func mapAnd(f *os.File, size int64, fn func([]byte) (*Region, error)) (*Region, error) {
	mem, err := sys.Map(f, int(size))
	if err != nil {
		return nil, err
	}
	// A file another process truncated under the mapping faults: an
	// error, never SIGBUS.
	var r *Region
	if ferr := fault.Do(func() { r, err = fn(mem) }); ferr != nil {
		err = ferr
	}
	if err != nil {
		_ = sys.Unmap(mem)
		return nil, fmt.Errorf("region %s: %w", f.Name(), err)
	}
	r.unmap = func() error { return sys.Unmap(mem) }
	return r, nil
}

// Close unmaps the region if this package mapped it. Rings attached from it
// must not be used afterwards. Idempotent.
func (r *Region) Close() error {
	if r.unmap == nil || !r.closed.CompareAndSwap(false, true) {
		return nil
	}
	return r.unmap()
}

// Retire ends the region like Close, but leaves private anonymous memory
// at its addresses instead of unmapping them (sys.Retire): for a guest
// whose ring views may still be touched by a call racing with Close.
func (r *Region) Retire() error {
	if r.unmap == nil || !r.closed.CompareAndSwap(false, true) {
		return nil
	}
	return sys.Retire(r.mem)
}

// Layout returns the validated layout.
func (r *Region) Layout() Layout { return r.layout }

// Mem returns the whole mapped window (for tests and tools).
func (r *Region) Mem() []byte { return r.mem }

// Generation returns the header's generation (bumped by each hostd that
// adopts the region).
func (r *Region) Generation() uint64 { return r.word64(offGeneration).Load() }

// SetName writes into the header the id a pair region's guests know it
// by and its two guests (a, the lower id, then b): a VM, which gets a pair
// region as a hot-plugged ivshmem device and not as a descriptor, finds
// the device by them (docs/region.md, "Header"). hostd writes them once,
// after Format or an adoption, before any guest is told of the region; a
// group region keeps zeros.
func (r *Region) SetName(id, a, b uint32) {
	_ = fault.Do(func() {
		le := binary.LittleEndian
		le.PutUint32(r.mem[offRegionID:], id)
		le.PutUint32(r.mem[offGuestA:], a)
		le.PutUint32(r.mem[offGuestB:], b)
	})
}

// Name returns what SetName wrote: the pair region's id and guests, or
// zeros (a group region). Guests can write the header, so a name is a
// claim to check (the ids READY and REGION give), not a proof.
func (r *Region) Name() (id, a, b uint32) {
	le := binary.LittleEndian
	return le.Uint32(r.mem[offRegionID:]), le.Uint32(r.mem[offGuestA:]), le.Uint32(r.mem[offGuestB:])
}

// BumpGeneration increments the header generation; hostd calls it when it
// adopts the region, so guests can tell that hostd restarted.
func (r *Region) BumpGeneration() uint64 { return r.word64(offGeneration).Add(1) }

func (r *Region) slot(i int) []byte {
	off := r.layout.DirOff + int64(i)*SlotSize
	return r.mem[off : off+SlotSize : off+SlotSize]
}

// Entry reads slot i consistently (seqlock) and validates it. A slot that
// keeps changing under the reader returns ErrStale.
func (r *Region) Entry(i int) (Entry, error) {
	if i < 0 || i >= r.layout.Slots {
		return Entry{}, fmt.Errorf("slot %d of %d: %w", i, r.layout.Slots, ErrCorrupt)
	}
	b := r.slot(i)
	var copyBuf [SlotSize]byte
	for try := 0; try < 8; try++ {
		st, gen := word32(b, soState).Load(), word64(b, soGen).Load()
		copy(copyBuf[:], b)
		if word32(b, soState).Load() == st && word64(b, soGen).Load() == gen {
			return DecodeEntry(copyBuf[:], State(st), gen, r.layout)
		}
	}
	return Entry{}, fmt.Errorf("slot %d keeps changing: %w", i, ErrStale)
}

// Rings attaches the two rings of slot i, which must hold generation gen in
// state Ready (or Revoked: a revoked flow's ends still see the reset).
func (r *Region) Rings(i int, gen uint64) (ab, ba *ring.Ring, err error) {
	e, err := r.Entry(i)
	if err != nil {
		return nil, nil, err
	}
	if e.Gen != gen || (e.State != Ready && e.State != Revoked) {
		return nil, nil, fmt.Errorf("slot %d: generation %d state %s, want generation %d: %w", i, e.Gen, e.State, gen, ErrStale)
	}
	return r.ringsOf(e)
}

func (r *Region) ringsOf(e Entry) (ab, ba *ring.Ring, err error) {
	rs := int64(ring.Size(e.Capacity))
	if ab, err = ring.Attach(r.mem[e.RingAB:e.RingAB+rs:e.RingAB+rs], e.Capacity); err != nil {
		return nil, nil, err
	}
	if ba, err = ring.Attach(r.mem[e.RingBA:e.RingBA+rs:e.RingBA+rs], e.Capacity); err != nil {
		return nil, nil, err
	}
	return ab, ba, nil
}
