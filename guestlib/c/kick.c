/* Kicks: waking across VMs through hostd (shunt.h, docs/vm.md). No futex
 * works on a PCI BAR, and none would reach another VM: a waker whose peer
 * sleeps sends KICK on the flow's session, hostd relays it to the peer's
 * session, and the peer's reader bumps the count here. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
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
		struct shunt_msg k = {.type = SHUNT_KICK, .region_id = f->region_id, .slot = f->slot, .gen = f->gen, .side = f->side};
		shunt_session_send(f->session, &k);
	}
}

uint32_t shunt_kick_seq(void) { return __atomic_load_n(&kick_seq, SC); }

uint32_t *shunt_kick_word(void) { return &kick_seq; }

/* Every sleep here is bounded (a kick can be lost), yet an untimed wait
 * must go on after a signal handler with SA_RESTART, as a socket call
 * does. A timed FUTEX_WAIT fails with EINTR after any handler; futex_waitv,
 * whose time-out is absolute, is restarted by the kernel when the handler
 * has SA_RESTART. So untimed waits sleep with futex_waitv, and timed ones
 * (SO_RCVTIMEO, SO_SNDTIMEO: never restarted) with FUTEX_WAIT. Without
 * futex_waitv (Linux < 5.16) a signal ends the sleep early and the wait
 * goes on, as it always did. */
int shunt_kick_sleep(uint32_t seq, int64_t max_ns)
{
	int64_t d = max_ns >= 0 && max_ns < SHUNT_KICK_MAX_SLEEP_NS ? max_ns : SHUNT_KICK_MAX_SLEEP_NS;
	if (max_ns < 0 && shunt_have_waitv()) {
		struct timespec until;
		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_nsec += d;
		until.tv_sec += until.tv_nsec / 1000000000;
		until.tv_nsec %= 1000000000;
		struct shunt_waitv w = shunt_waitv_word(&kick_seq, seq);
		if (shunt_futex_waitv(&w, 1, &until) >= 0)
			return 0;
		if (errno != ENOSYS)
			return errno == EINTR ? SHUNT_EINTR : 0;
	}
	struct timespec ts = {d / 1000000000, d % 1000000000};
	if (shunt_futex_wait(&kick_seq, seq, &ts) < 0 && errno == EINTR && max_ns >= 0)
		return SHUNT_EINTR;
	return 0;
}

void shunt_kicked(void)
{
	__atomic_add_fetch(&kick_seq, 1, SC);
	shunt_futex_wake(&kick_seq, INT32_MAX);
}

void shunt_kicks_enable(void)
{
	shunt_remote_wake = remote_wake;
	shunt_remote_seq = shunt_kick_seq;
	shunt_remote_sleep = shunt_kick_sleep;
	__atomic_store_n(&enabled, 1, SC);
}

int shunt_kicks_enabled(void) { return __atomic_load_n(&enabled, SC); }

void shunt_kick_local(void) { shunt_kicked(); }
