package ring

import (
	"sync/atomic"
	"unsafe"
)

// The header's atomic words live in shared memory; these casts are the only
// place the package turns bytes into typed words. Offsets are constants
// inside the header, and Attach checked the header's length and alignment.

func word64(mem []byte, off int) *atomic.Uint64 {
	b := mem[off : off+8 : off+8]
	return (*atomic.Uint64)(unsafe.Pointer(&b[0]))
}

func word32(mem []byte, off int) *atomic.Uint32 {
	b := mem[off : off+4 : off+4]
	return (*atomic.Uint32)(unsafe.Pointer(&b[0]))
}

// aligned reports whether mem starts on a cache-line boundary.
func aligned(mem []byte) bool {
	return len(mem) > 0 && uintptr(unsafe.Pointer(&mem[0]))%lineSize == 0
}
