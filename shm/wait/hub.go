package wait

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/sys"
)

// A Hub is a Signal for a program with many ring ends, such as a relay:
// instead of one futex sleep per waiting goroutine, one goroutine sleeps
// on every waiting word at once (futex_waitv) and hands each wait that
// ended back to its goroutine through a channel.
//
// Why: a goroutine asleep in a system call holds its P (the Go
// scheduler's right to run Go code) until the runtime's monitor takes it
// back, 20 us or more later, and only if other work is waiting by then.
// With two Ps and two goroutines asleep in futexes, a goroutine made
// runnable meanwhile (the link's reader, the next bridge) waits that long
// for a P. A goroutine blocked on a channel holds none: with a Hub only
// its one goroutine sleeps in the kernel, whatever the number of waits.
//
// The wake-up protocol is the Policy's (flag 1: "sleeping"; a waker swaps
// it to 0, then wakes): the Hub's futex_waitv sleeps while each word is
// still 1, and a waker's FutexWake on the word reaches it, in whatever
// process the waker is (the words are shared futexes, as Futex's). A
// guest's library needs no change.
//
// A wait that finds no other asleep through the Hub sleeps in a futex of
// its own (solo): one sleeper holds one P either way, and its waker then
// wakes it directly, not the Hub's goroutine and then it (a hand-off more
// on the path of every message of a relay with one busy flow: 1.25x the
// time of an 8 B one-way message across hosts, docs/crosshost.md). So with waits
// overlapping, at most two sleepers hold a P: the solo one and the Hub's
// goroutine.
//
// Each Wait tells the Hub's goroutine (a word of its own in the same
// futex_waitv), which then sleeps on the new set; a wait that ends
// costs the Hub's goroutine a look at every word it holds (at most
// sys.FutexWaitvMax-1; waits beyond that, and every wait after Close,
// sleep in a futex of their own, as Futex does).
//
// A Hub is safe for concurrent use. NewHub starts its goroutine; Close
// stops it, ends every wait in progress (their callers re-check their
// condition), and waits for it.
type Hub struct {
	// ctl is the Hub goroutine's own word: bumped by every Wait (and
	// Close) so that its futex_waitv returns and takes the new set.
	ctl    atomic.Uint32
	asleep atomic.Bool // the Hub's goroutine is in (or about to enter) futex_waitv on ctl's value
	done   chan struct{}

	mu     sync.Mutex
	waits  []*hubWait     // the waits to sleep on, at most hubMax
	solo   *atomic.Uint32 // the word of the one wait asleep in a futex of its own (the Hub held none), or nil
	closed bool
}

// hubMax is the most waits the Hub sleeps on at once: futex_waitv's
// bound, less the Hub's own word.
const hubMax = sys.FutexWaitvMax - 1

// A hubWait is one Wait in progress: while *flag == val, until deadline
// (zero: none). The Hub sends on ch once, as it drops the wait from its
// set; the waiting goroutine then owns it again (hubWaits are pooled).
type hubWait struct {
	flag     *atomic.Uint32
	val      uint32
	deadline time.Time
	ch       chan struct{}
}

var hubWaits = sync.Pool{New: func() any { return &hubWait{ch: make(chan struct{}, 1)} }}

// NewHub starts a Hub's goroutine; Close stops it.
func NewHub() *Hub {
	h := &Hub{done: make(chan struct{})}
	go h.run()
	return h
}

// Wait sleeps while *flag == val, until Wake(flag) (or any FutexWake on
// flag), the timeout (<= 0: none) or Close, without holding a P.
func (h *Hub) Wait(flag *atomic.Uint32, val uint32, timeout time.Duration) error {
	w := hubWaits.Get().(*hubWait)
	w.flag, w.val, w.deadline = flag, val, time.Time{}
	if timeout > 0 {
		w.deadline = time.Now().Add(timeout)
	}
	h.mu.Lock()
	if h.closed || len(h.waits) >= hubMax || (h.solo == nil && len(h.waits) == 0) {
		solo := !h.closed && h.solo == nil && len(h.waits) == 0
		if solo {
			h.solo = flag
		}
		h.mu.Unlock()
		w.flag = nil
		hubWaits.Put(w)
		err := sys.FutexWait(flag, val, timeout)
		if solo {
			h.mu.Lock()
			h.solo = nil
			h.mu.Unlock()
		}
		return err
	}
	h.waits = append(h.waits, w)
	h.mu.Unlock()
	h.poke()
	<-w.ch
	w.flag = nil
	hubWaits.Put(w)
	return nil
}

// Waiting is how many waits are asleep through the Hub now, its
// goroutine's and a solo one (for tests and metrics).
func (h *Hub) Waiting() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := len(h.waits)
	if h.solo != nil {
		n++
	}
	return n
}

// Wake wakes the waiter sleeping on flag: the Hub's goroutine, or a
// futex sleeper (another process's, or a wait beyond hubMax).
func (h *Hub) Wake(flag *atomic.Uint32) error {
	_, err := sys.FutexWake(flag, 1)
	return err
}

// Close ends every wait in progress and stops the Hub's goroutine, and
// waits for it. Waits after Close sleep in a futex of their own.
// Idempotent.
func (h *Hub) Close() error {
	h.mu.Lock()
	h.closed = true
	solo := h.solo
	h.mu.Unlock()
	if solo != nil {
		_, _ = sys.FutexWake(solo, 1) // a spurious return: its caller looks again
	}
	h.poke()
	<-h.done
	return nil
}

// poke makes the Hub's goroutine look at its set again: the bump of ctl
// makes a futex_waitv about to start return at once, and the wake ends
// one in progress. Both are sequentially consistent: if poke sees asleep
// false, the goroutine's store of it comes later, after its load of ctl
// too, so its futex_waitv finds ctl changed.
func (h *Hub) poke() {
	h.ctl.Add(1)
	if h.asleep.Load() {
		_, _ = sys.FutexWake(&h.ctl, 1)
	}
}

// run is the Hub's goroutine: it ends the waits whose word changed or
// whose deadline passed, then sleeps on the rest and on ctl.
func (h *Hub) run() {
	defer close(h.done)
	vs := make([]sys.FutexWaitv, 0, sys.FutexWaitvMax)
	all := false // a word was not mapped: end every wait (each looks for itself)
	for {
		gen := h.ctl.Load()
		now := time.Now()
		next := now.Add(maxSleep)
		ended := 0
		h.mu.Lock()
		if h.closed {
			for _, w := range h.waits {
				w.ch <- struct{}{}
			}
			h.waits = nil
			h.mu.Unlock()
			return
		}
		keep := h.waits[:0]
		for _, w := range h.waits {
			if all || h.changed(w) || (!w.deadline.IsZero() && !now.Before(w.deadline)) {
				w.ch <- struct{}{} // never blocks: one send per wait, into a buffer of one
				ended++
				continue
			}
			if !w.deadline.IsZero() && w.deadline.Before(next) {
				next = w.deadline
			}
			keep = append(keep, w)
		}
		clear(h.waits[len(keep):])
		h.waits = keep
		vs = vs[:1]
		vs[0].Set(&h.ctl, gen)
		for _, w := range h.waits {
			vs = append(vs, sys.FutexWaitv{})
			vs[len(vs)-1].Set(w.flag, w.val)
		}
		h.mu.Unlock()
		all = false
		if ended > 0 {
			// The goroutines just readied sit on this P's queue: let
			// them run now rather than after the sleep below, which
			// keeps the P until the runtime takes it back.
			runtime.Gosched()
			continue
		}
		h.asleep.Store(true)
		err := sys.FutexWaits(vs, next)
		h.asleep.Store(false)
		switch {
		case errors.Is(err, sys.ErrFutexFault):
			all = true // a word gone: let every waiter look, and fail on it
		case err != nil:
			// No futex_waitv (a kernel before 5.16): end the waits, and
			// let every later one sleep in a futex of its own.
			h.mu.Lock()
			h.closed = true
			h.mu.Unlock()
		}
	}
}

// changed says whether w's word no longer holds its value (a fault: its
// memory is gone, which its waiter finds out by its own look).
func (h *Hub) changed(w *hubWait) bool {
	c := true
	_ = fault.Do(func() { c = w.flag.Load() != w.val })
	return c
}
