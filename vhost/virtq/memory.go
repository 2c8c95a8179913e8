package virtq

import (
	"errors"
	"fmt"
	"sort"
)

// Region is one piece of guest memory as the front-end described it
// (vhost-user SET_MEM_TABLE, "memory region description"): its guest
// physical address, the front-end's own virtual address of it (which
// SET_VRING_ADDR uses), and the bytes, mapped by us.
type Region struct {
	GPA uint64 // guest_addr
	VA  uint64 // user_addr
	Mem []byte
}

// Memory is the guest memory a device may touch: exactly the regions the
// front-end handed over, nothing around them.
type Memory struct {
	regions []Region // sorted by GPA
}

// ErrRange is an address or length outside the regions.
var ErrRange = errors.New("outside guest memory")

// NewMemory checks that the regions neither wrap nor overlap (in guest
// physical or front-end virtual addresses) and returns them as Memory.
func NewMemory(regions []Region) (*Memory, error) {
	rs := append([]Region(nil), regions...)
	for _, r := range rs {
		n := uint64(len(r.Mem))
		if n == 0 || r.GPA+n < r.GPA || r.VA+n < r.VA {
			return nil, fmt.Errorf("memory region gpa %#x va %#x size %#x: empty or wraps", r.GPA, r.VA, n)
		}
	}
	for _, by := range []func(Region) uint64{func(r Region) uint64 { return r.GPA }, func(r Region) uint64 { return r.VA }} {
		sort.Slice(rs, func(i, j int) bool { return by(rs[i]) < by(rs[j]) })
		for i := 1; i < len(rs); i++ {
			if by(rs[i-1])+uint64(len(rs[i-1].Mem)) > by(rs[i]) {
				return nil, fmt.Errorf("memory regions at %#x and %#x overlap", by(rs[i-1]), by(rs[i]))
			}
		}
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i].GPA < rs[j].GPA })
	return &Memory{regions: rs}, nil
}

// Slice returns the n bytes at guest physical address gpa. They must lie in
// one region: a buffer that spans two regions is refused (Linux guests
// never make one; the regions QEMU sends are split at holes).
func (m *Memory) Slice(gpa, n uint64) ([]byte, error) {
	return m.find(gpa, n, func(r Region) uint64 { return r.GPA })
}

// SliceVA is Slice by the front-end's virtual address (vring addresses).
func (m *Memory) SliceVA(va, n uint64) ([]byte, error) {
	return m.find(va, n, func(r Region) uint64 { return r.VA })
}

func (m *Memory) find(a, n uint64, base func(Region) uint64) ([]byte, error) {
	if m == nil {
		return nil, fmt.Errorf("address %#x: no memory table", a)
	}
	for _, r := range m.regions {
		b, size := base(r), uint64(len(r.Mem))
		if a >= b && a-b < size && n <= size-(a-b) {
			off := a - b
			return r.Mem[off : off+n : off+n], nil
		}
	}
	return nil, fmt.Errorf("%#x+%#x: %w", a, n, ErrRange)
}
