package ring

import (
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/shm/wait"
)

// end is what a Writer and a Reader share: the waiting policy, the deadline
// and the local interrupt, all settable from other goroutines (net.Conn
// allows SetDeadline and Close while a Read or Write is blocked).
type end struct {
	r      *Ring
	policy *wait.Policy
	flag   *atomic.Uint32 // this end's "waiting" word in the header

	deadline atomic.Int64  // unix nanoseconds; 0 = none
	intr     atomic.Uint32 // bumped to interrupt a blocked call
	closed   atomic.Bool
	intrSeen uint32 // intr at the start of the current wait (owner only)
}

// SetDeadline sets the deadline for blocking calls (zero: none) and wakes a
// blocked call so it sees the new deadline. Safe to call concurrently.
func (e *end) SetDeadline(t time.Time) {
	var ns int64
	if !t.IsZero() {
		ns = t.UnixNano()
	}
	e.deadline.Store(ns)
	e.interrupt()
}

// interrupt wakes a blocked call. The ring's memory may be gone (its
// region truncated): the wake is then skipped, and the call finds out at
// its next look (wait.Policy sleeps at most a second at a time).
//
// The wake costs a system call only when this end sleeps: a sleeper
// stores its waiting word (1) before it looks at intr one last time, and
// the increment below (a locked add, a full fence) comes before the load
// of that word in Wake, so either the sleeper sees the increment and does
// not sleep, or Wake sees the word and wakes it. A call that spins sees
// the increment itself. (It used to store 1 first, so every SetDeadline
// and every Close made a futex wake with nobody asleep: a system call per
// request for a server that sets deadlines.)
func (e *end) interrupt() {
	defer fault.Catch(fault.Arm(), nil)
	e.intr.Add(1)
	_ = e.policy.Wake(e.flag)
}

func (e *end) deadlineTime() time.Time {
	if ns := e.deadline.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// interrupted reports whether someone interrupted the current wait.
func (e *end) interrupted() bool { return e.intr.Load() != e.intrSeen }

// expired reports whether a deadline is set and has passed: net.Conn
// semantics fail a call at once then, even if it could make progress.
func (e *end) expired() bool {
	ns := e.deadline.Load()
	return ns != 0 && time.Now().UnixNano() >= ns
}
