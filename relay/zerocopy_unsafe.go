package relay

import "unsafe"

// offsetIn says where p lies in mem, if it lies wholly within it: the
// check that turns a slice of a guest's ring (its place and length come
// from indices in guest memory) into a scatter entry of mem's
// registration.
func offsetIn(mem, p []byte) (uint64, bool) {
	if len(mem) == 0 || len(p) == 0 {
		return 0, false
	}
	base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	at := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	if at < base || at-base > uintptr(len(mem)) || uintptr(len(p)) > uintptr(len(mem))-(at-base) {
		return 0, false
	}
	return uint64(at - base), true
}
