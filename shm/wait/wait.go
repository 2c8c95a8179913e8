package wait

import (
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/sys"
)

// Mode selects how a waiter waits.
type Mode uint8

const (
	// Adaptive spins for Policy.SpinFor, then blocks.
	Adaptive Mode = iota
	// Spin never blocks: lowest latency, one busy core per waiting end.
	Spin
	// Block sleeps at once: lowest CPU, a kernel wake-up per message.
	Block
)

// DefaultSpin is the adaptive spin budget: about the cost of one
// block-and-wake across vCPUs on the target machines (20-35 us measured).
const DefaultSpin = 25 * time.Microsecond

func (m Mode) String() string {
	switch m {
	case Adaptive:
		return "adaptive"
	case Spin:
		return "spin"
	case Block:
		return "block"
	}
	return fmt.Sprintf("mode(%d)", uint8(m))
}

// ParseMode parses "adaptive", "spin" or "block".
func ParseMode(s string) (Mode, error) {
	for _, m := range []Mode{Adaptive, Spin, Block} {
		if s == m.String() {
			return m, nil
		}
	}
	return 0, fmt.Errorf("unknown wait mode %q: want adaptive, spin or block", s)
}

// A Signal puts a waiter to sleep on a flag word in shared memory and wakes
// it. Implementations must be safe for concurrent use.
type Signal interface {
	// Wait sleeps while *flag == val, until Wake(flag), the timeout (<= 0:
	// none) or a spurious return; callers re-check their condition.
	Wait(flag *atomic.Uint32, val uint32, timeout time.Duration) error
	// Wake wakes the waiter sleeping on flag, if any.
	Wake(flag *atomic.Uint32) error
}

// A Cond is what a waiter waits for. Ready must be cheap and must return true
// for every reason to stop waiting (data, space, reset, close, interrupt);
// the caller sorts out which one it was.
type Cond interface {
	Ready() bool
}

// Policy is a waiting strategy. A Policy is immutable once in use and safe
// for concurrent use by any number of waiters.
type Policy struct {
	Mode    Mode
	SpinFor time.Duration // adaptive spin budget; 0 means DefaultSpin
	Signal  Signal        // how to sleep and wake; nil means Futex
}

// checkEvery is how many spins pass between clock reads (a vDSO clock read
// costs about as much as 20 cache hits).
const checkEvery = 64

// yieldAfter is how long a waiter spins before it also yields the CPU at
// every clock check. The kernel often wakes a sleeping peer on the waker's
// vCPU; a waiter that only spins there keeps its peer off the CPU for the
// whole budget, and with a budget near the wake-up cost both ends settle
// into paying it on every message. Yielding lets a co-located peer run at
// once; with nothing else runnable it costs one system call.
const yieldAfter = 500 * time.Nanosecond

// goschedAfter is how long a waiter spins before it gives the goroutine's
// P to the program's runnable goroutines (runtime.Gosched), once per wait:
// the one that will answer (net/http's handler, a Transport's loop) may be
// waiting for it. Once per wait: it lets every goroutine runnable then go
// first, and each further one would cost a trip through the scheduler.
// Not at the first yield (500 ns), as it was: Gosched wakes an idle P's
// thread (runtime.wakep, a futex wake) that then spins looking for work on
// the other CPU, and a stream's ends wait a few microseconds for each
// other's next batch, so each of those waits cost a system call and a
// second busy thread, taken from the peer process on a 2-vCPU guest (Go's
// streams ran at 0.55x of C's; issue 26). A wait that lasts longer than
// goschedAfter is not a batch's gap.
const goschedAfter = 5 * time.Microsecond

// Wait returns nil once c is ready, or os.ErrDeadlineExceeded when the
// deadline (zero: none) passes first. flag is the waiter's "waiting" word in
// shared memory, which wakers swap from 1 to 0 before they call Wake.
func (p *Policy) Wait(c Cond, flag *atomic.Uint32, deadline time.Time) error {
	if c.Ready() {
		return nil
	}
	if p.Mode != Block {
		spin := p.SpinFor
		if spin <= 0 {
			spin = DefaultSpin
		}
		start := time.Now()
		gave := false
		for i := 1; ; i++ {
			if c.Ready() {
				return nil
			}
			pause()
			if i%checkEvery != 0 {
				continue
			}
			now := time.Now()
			if !deadline.IsZero() && !now.Before(deadline) {
				return os.ErrDeadlineExceeded
			}
			spun := now.Sub(start)
			if p.Mode == Adaptive && spun >= spin {
				break
			}
			if spun >= yieldAfter {
				if !gave && spun >= goschedAfter {
					runtime.Gosched()
					gave = true
				}
				sys.Yield()
			}
		}
	}
	return p.block(c, flag, deadline)
}

// maxSleep bounds one sleep: a waiter looks at its ring at least this
// often. A ring whose memory is gone (its region truncated) can never be
// woken through, since no futex on it can be reached any more; the
// waiter's next look faults and its caller fails the call
// (internal/fault).
const maxSleep = time.Second

func (p *Policy) block(c Cond, flag *atomic.Uint32, deadline time.Time) error {
	for {
		flag.Store(1)
		if c.Ready() {
			flag.Store(0)
			return nil
		}
		timeout := maxSleep
		if !deadline.IsZero() {
			timeout = min(time.Until(deadline), maxSleep)
			if timeout <= 0 {
				flag.Store(0)
				return os.ErrDeadlineExceeded
			}
		}
		if err := p.signal().Wait(flag, 1, timeout); err != nil {
			flag.Store(0)
			return err
		}
	}
}

// Wake wakes the waiter on flag if it published that it sleeps. It is the
// waker's half of the protocol and costs one load when nobody waits.
func (p *Policy) Wake(flag *atomic.Uint32) error {
	if flag.Load() == 0 || !flag.CompareAndSwap(1, 0) {
		return nil
	}
	return p.signal().Wake(flag)
}

func (p *Policy) signal() Signal {
	if p.Signal == nil {
		return Futex{}
	}
	return p.Signal
}

// Sleeper is the Signal for an end whose peer cannot wake it directly: a
// peer in another VM (a futex in one guest kernel is invisible to another,
// and a PCI BAR mapping cannot hold a futex at all). It sleeps at most Max
// per wait (0 means 1 ms) and its Wake does nothing; hostd-relayed kicks
// will replace it. The zero value is ready to use.
type Sleeper struct{ Max time.Duration }

func (s Sleeper) Wait(flag *atomic.Uint32, val uint32, timeout time.Duration) error {
	d := s.Max
	if d <= 0 {
		d = time.Millisecond
	}
	if timeout > 0 && timeout < d {
		d = timeout
	}
	time.Sleep(d)
	return nil
}

func (Sleeper) Wake(*atomic.Uint32) error { return nil }
