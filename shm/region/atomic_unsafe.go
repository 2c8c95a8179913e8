package region

import (
	"sync/atomic"
	"unsafe"
)

// Atomic views of header and slot words. Offsets are format constants and
// the region's base is page-aligned (mmap) or checked by the caller.

func word64(b []byte, off int) *atomic.Uint64 {
	w := b[off : off+8 : off+8]
	return (*atomic.Uint64)(unsafe.Pointer(&w[0]))
}

func word32(b []byte, off int) *atomic.Uint32 {
	w := b[off : off+4 : off+4]
	return (*atomic.Uint32)(unsafe.Pointer(&w[0]))
}

func (r *Region) word64(off int) *atomic.Uint64 { return word64(r.mem, off) }

// alignment is what the region's base must have: the ring headers inside
// lay out their cache lines relative to it.
const alignment = 128

func aligned(mem []byte) bool {
	return len(mem) > 0 && uintptr(unsafe.Pointer(&mem[0]))%alignment == 0
}
