package relay

import (
	"sync/atomic"
	"unsafe"
)

// A hostile guest's stores into a ring header: atomic, as the words are
// (so that the race detector sees a guest, not a data race of the test).

func put64(mem []byte, off int, v uint64) {
	b := mem[off : off+8 : off+8]
	(*atomic.Uint64)(unsafe.Pointer(&b[0])).Store(v)
}

func put32(mem []byte, off int, v uint32) {
	b := mem[off : off+4 : off+4]
	(*atomic.Uint32)(unsafe.Pointer(&b[0])).Store(v)
}
