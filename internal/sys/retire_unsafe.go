//go:build linux

package sys

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Retire replaces a shared mapping by private anonymous memory at the same
// addresses, instead of unmapping it: code that still holds a view of it
// (a ring end racing with Close) then reads zeros and writes harmlessly,
// never faults, and the shared file's pages are released. The address
// range stays reserved for the life of the process.
func Retire(mem []byte) error {
	if len(mem) == 0 {
		return nil
	}
	_, err := unix.MmapPtr(-1, 0, unsafe.Pointer(&mem[0]), uintptr(len(mem)),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED)
	if err != nil {
		return fmt.Errorf("retire mapping: %w", err)
	}
	return nil
}
