//go:build amd64 && !race

package ring

import (
	"sync/atomic"
	"unsafe"
)

// storeRel stores v in w with release order: on amd64 every store is a
// release store, so a plain MOV does, where atomic.Uint64.Store is an
// XCHG, a full fence that waits for the store buffer to drain (a record
// end's index stores need no more than release: records.go). The Go
// compiler keeps stores in program order. Race builds use atomic.Store.
func storeRel(w *atomic.Uint64, v uint64) {
	*(*uint64)(unsafe.Pointer(w)) = v
}
