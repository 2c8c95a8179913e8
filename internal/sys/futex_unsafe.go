//go:build linux

package sys

import (
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Futex operations without FUTEX_PRIVATE_FLAG: the word lives in a shared
// mapping and the waker may be another process.
const (
	futexWait = 0
	futexWake = 1
)

// FutexWait blocks while *word == val, until FutexWake on the same word (in
// any process mapping it), the timeout (<= 0 means none), or a signal. It
// returns nil on a wake, a changed value, a timeout or an interruption: the
// caller always re-checks its condition.
func FutexWait(word *atomic.Uint32, val uint32, timeout time.Duration) error {
	var tsp unsafe.Pointer
	var ts unix.Timespec
	if timeout > 0 {
		ts = unix.NsecToTimespec(int64(timeout))
		tsp = unsafe.Pointer(&ts)
	}
	_, _, e := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(word)), futexWait, uintptr(val), uintptr(tsp), 0, 0)
	switch e {
	case 0, unix.EAGAIN, unix.EINTR, unix.ETIMEDOUT:
		return nil
	default:
		return fmt.Errorf("futex wait: %w", e)
	}
}

// FutexWake wakes up to n waiters blocked on word and returns how many woke.
func FutexWake(word *atomic.Uint32, n int) (int, error) {
	r, _, e := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(word)), futexWake, uintptr(n), 0, 0, 0)
	if e != 0 {
		return 0, fmt.Errorf("futex wake: %w", e)
	}
	return int(r), nil
}
