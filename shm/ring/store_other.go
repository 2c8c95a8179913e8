//go:build !amd64 || race

package ring

import "sync/atomic"

// storeRel stores v in w with (at least) release order: store_amd64.go.
func storeRel(w *atomic.Uint64, v uint64) { w.Store(v) }
