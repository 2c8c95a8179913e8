// Package wait decides how a ring end waits for its peer: spin, block, or the
// competitive mix of both.
//
// A wake-up through the kernel costs about 100 times a cache-line handoff on
// the machines Shunt targets (20-35 us against 35-230 ns), so a waiter that
// blocks at once loses most of the shared-memory advantage, and a waiter that
// only spins burns a core while the peer is idle. Adaptive mode spins for
// about the cost of one block-and-wake and then blocks: the classic
// 2-competitive rule, which keeps latency near busy polling when the peer
// answers quickly and idle CPU near zero when it does not.
//
// Blocking is lost-wake-up free by construction. The waiter publishes
// "waiting" (flag = 1) in shared memory, re-checks its condition, and only
// then sleeps on the flag; a waker publishes its progress, and if it then
// sees flag == 1 it swaps it to 0 and wakes. Because both sides store before
// they load (sequentially consistent atomics), at least one sees the other.
//
// How the sleep happens is a Signal: a futex on the flag word for processes
// that share the mapping (Futex), an eventfd handed out by hostd, or a kick
// relayed by hostd over a VM's control channel. A Hub is a Signal for a
// program with many waiting ends (the relay): their sleeps share one
// goroutine, asleep in futex_waitv on all their words, so that they do not
// each hold a P of the Go scheduler (docs/relay-waits.md).
package wait
