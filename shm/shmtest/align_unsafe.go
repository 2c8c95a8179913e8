package shmtest

import "unsafe"

// Aligned returns n zeroed bytes starting on a 4 KiB boundary, as an mmap
// would give.
func Aligned(n int) []byte {
	const a = 4096
	b := make([]byte, n+a)
	off := (a - int(uintptr(unsafe.Pointer(&b[0]))%a)) % a
	return b[off : off+n : off+n]
}
