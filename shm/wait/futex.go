package wait

import (
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/sys"
)

// Futex is the Signal for processes (and goroutines) that share a mapping:
// a shared (not process-private) futex on the flag word itself, so the
// kernel matches waiter and waker by the page, whichever process they are in.
// The zero value is ready to use and safe for concurrent use.
type Futex struct{}

func (Futex) Wait(flag *atomic.Uint32, val uint32, timeout time.Duration) error {
	return sys.FutexWait(flag, val, timeout)
}

func (Futex) Wake(flag *atomic.Uint32) error {
	_, err := sys.FutexWake(flag, 1)
	return err
}
