//go:build linux

package sys

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// FutexWaitvMax is the most words one FutexWaitv call sleeps on (the
// kernel's FUTEX_WAITV_MAX).
const FutexWaitvMax = 128

// sysFutexWaitv is futex_waitv(2)'s number, the same on every
// architecture (Linux 5.16 and later).
const sysFutexWaitv = 449

// futex2Size32 is FUTEX2_SIZE_U32: a 32-bit word, without
// FUTEX2_PRIVATE (the word is shared with other processes, as
// FutexWait's).
const futex2Size32 = 0x02

// A FutexWaitv is one word of a FutexWaitv call: struct futex_waitv of
// include/uapi/linux/futex.h (24 bytes: val u64, uaddr u64, flags u32,
// a reserved u32).
type FutexWaitv struct {
	val      uint64
	uaddr    uint64
	flags    uint32
	reserved uint32
}

// Set makes v wait while *word == val. The caller keeps word's memory
// mapped until the FutexWaitv call that uses v returned.
func (v *FutexWaitv) Set(word *atomic.Uint32, val uint32) {
	*v = FutexWaitv{val: uint64(val), uaddr: uint64(uintptr(unsafe.Pointer(word))), flags: futex2Size32}
}

// ErrFutexFault is FutexWaitv's EFAULT: one of the words is not mapped
// any more (a truncated region); the caller finds out which by looking.
var ErrFutexFault = errors.New("futex_waitv: a word is not mapped")

// FutexWaits sleeps while every word of vs holds its value, until a
// FutexWake on any of them (in any process mapping it, as FutexWait),
// the deadline (zero: none) or a signal. It returns nil on a wake, a
// changed value, the deadline or an interruption (the caller re-checks
// every word), ErrFutexFault for a word no longer mapped.
func FutexWaits(vs []FutexWaitv, deadline time.Time) error {
	if len(vs) == 0 || len(vs) > FutexWaitvMax {
		return fmt.Errorf("futex_waitv: %d words, want 1 to %d", len(vs), FutexWaitvMax)
	}
	var tsp unsafe.Pointer
	var ts unix.Timespec
	if !deadline.IsZero() {
		// futex_waitv's timeout is absolute, on CLOCK_MONOTONIC; Go's
		// monotonic reading is not exported, so take the kernel's now
		// and add what is left.
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
			return fmt.Errorf("futex_waitv: clock: %w", err)
		}
		ts = unix.NsecToTimespec(ts.Nano() + int64(max(time.Until(deadline), 0)))
		tsp = unsafe.Pointer(&ts)
	}
	_, _, e := unix.Syscall6(sysFutexWaitv, uintptr(unsafe.Pointer(&vs[0])), uintptr(len(vs)), 0,
		uintptr(tsp), uintptr(unix.CLOCK_MONOTONIC), 0)
	switch e {
	case 0, unix.EAGAIN, unix.EINTR, unix.ETIMEDOUT:
		return nil
	case unix.EFAULT:
		return ErrFutexFault
	default:
		return fmt.Errorf("futex_waitv: %w", e)
	}
}
