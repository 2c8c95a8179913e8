/* Kicks: waking across VMs through hostd (shunt.h, docs/vm.md). No futex
 * works on a PCI BAR, and none would reach another VM: a waker whose peer
 * sleeps sends KICK on the flow's session, hostd relays it to the peer's
 * session, and the peer's reader bumps the count here. */
#define _GNU_SOURCE
#include "internal.h"

#include <linux/futex.h>

#define SC __ATOMIC_SEQ_CST

/* The count: bumped by session readers, read and slept on by any thread.
 * A futex word shared by the whole process (not FUTEX_PRIVATE, because
 * futex_waitv callers give no private flag). */
static uint32_t kick_seq;
static int enabled;

static void remote_wake(struct shunt_ring *r)
{
	const struct shunt_flow *f = r->owner;
	if (f && f->session) {
		struct shunt_msg k = {.type = SHUNT_KICK, .slot = f->slot, .gen = f->gen, .side = f->side};
		shunt_session_send(f->session, &k);
	}
}

uint32_t shunt_kick_seq(void) { return __atomic_load_n(&kick_seq, SC); }

uint32_t *shunt_kick_word(void) { return &kick_seq; }

void shunt_kick_sleep(uint32_t seq, int64_t max_ns)
{
	int64_t d = max_ns >= 0 && max_ns < SHUNT_KICK_MAX_SLEEP_NS ? max_ns : SHUNT_KICK_MAX_SLEEP_NS;
	struct timespec ts = {d / 1000000000, d % 1000000000};
	syscall(SYS_futex, &kick_seq, FUTEX_WAIT, seq, &ts, NULL, 0);
}

void shunt_kicked(void)
{
	__atomic_add_fetch(&kick_seq, 1, SC);
	syscall(SYS_futex, &kick_seq, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

void shunt_kicks_enable(void)
{
	shunt_remote_wake = remote_wake;
	shunt_remote_seq = shunt_kick_seq;
	shunt_remote_sleep = shunt_kick_sleep;
	__atomic_store_n(&enabled, 1, SC);
}

int shunt_kicks_enabled(void) { return __atomic_load_n(&enabled, SC); }
