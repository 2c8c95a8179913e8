/* SPSC byte ring, format v1: see shunt.h and shm/ring/doc.go. Memory
 * ordering: __atomic builtins with sequentially consistent order, the same
 * as Go's sync/atomic, so the Dekker-style waiting protocol holds across
 * the two languages. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BATCH (32u << 10)
#define SC __ATOMIC_SEQ_CST

static inline uint64_t *w64(const struct shunt_ring *r, int off) { return (uint64_t *)(r->hdr + off); }
static inline uint32_t *w32(const struct shunt_ring *r, int off) { return (uint32_t *)(r->hdr + off); }

static int valid_cap(uint64_t c) { return c >= SHUNT_RING_MIN && c <= SHUNT_RING_MAX && (c & (c - 1)) == 0; }

static int attach(struct shunt_ring *r, void *mem, size_t len, uint64_t want)
{
	memset(r, 0, sizeof *r);
	if (len < SHUNT_RING_HEADER || ((uintptr_t)mem % 64) != 0)
		return SHUNT_ECORRUPT;
	r->hdr = mem;
	if (__atomic_load_n(w32(r, SHUNT_OFF_MAGIC), SC) != SHUNT_RING_MAGIC)
		return SHUNT_ECORRUPT;
	uint64_t c = __atomic_load_n(w64(r, SHUNT_OFF_CAPACITY), SC);
	if (!valid_cap(c) || len - SHUNT_RING_HEADER < c || (want && c != want))
		return SHUNT_ECORRUPT;
	r->cap = c; /* read once; a later rewrite by the peer changes nothing */
	r->mask = c - 1;
	r->data = r->hdr + SHUNT_RING_HEADER;
	return 0;
}

int shunt_ring_writer(struct shunt_ring *w, void *mem, size_t len, uint64_t want)
{
	int err = attach(w, mem, len, want);
	if (err)
		return err;
	w->own = __atomic_load_n(w64(w, SHUNT_OFF_TAIL), SC);
	w->msgs = __atomic_load_n(w64(w, SHUNT_OFF_WMSGS), SC);
	w->peer = __atomic_load_n(w64(w, SHUNT_OFF_HEAD), SC);
	if (w->peer > w->own || w->own - w->peer > w->cap)
		return SHUNT_ECORRUPT;
	return 0;
}

int shunt_ring_reader(struct shunt_ring *r, void *mem, size_t len, uint64_t want)
{
	int err = attach(r, mem, len, want);
	if (err)
		return err;
	r->own = __atomic_load_n(w64(r, SHUNT_OFF_HEAD), SC);
	r->msgs = __atomic_load_n(w64(r, SHUNT_OFF_RMSGS), SC);
	r->peer = __atomic_load_n(w64(r, SHUNT_OFF_TAIL), SC);
	if (r->own > r->peer || r->peer - r->own > r->cap)
		return SHUNT_ECORRUPT;
	return 0;
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts)
{
	/* Not FUTEX_PRIVATE: the word is shared with another process. */
	return op == FUTEX_WAKE ? shunt_futex_wake(addr, (int)val) : shunt_futex_wait(addr, val, ts);
}

void (*shunt_remote_wake)(struct shunt_ring *r);
uint32_t (*shunt_remote_seq)(void);
int (*shunt_remote_sleep)(uint32_t seq, int64_t max_ns);

/* wake: the waker's half of the protocol (shm/wait Policy.Wake). r is the
 * ring whose flag it is, for the remote hook. Every sleeper on the flag
 * wakes: several threads of the peer may sleep on one ring end (two
 * readers, or a reader and a poll helper), and a woken one that finds
 * nothing goes back to sleep. */
static void wake(struct shunt_ring *r, uint32_t *flag)
{
	uint32_t one = 1;
	if (__atomic_load_n(flag, SC) != 0 &&
	    __atomic_compare_exchange_n(flag, &one, 0, 0, SC, SC)) {
		if (shunt_remote_wake && !r->local)
			shunt_remote_wake(r);
		else
			futex(flag, FUTEX_WAKE, INT32_MAX, NULL);
	}
}

/* free space, refreshing the reader's head when the cache has less than want. */
static int64_t space(struct shunt_ring *w, uint64_t want)
{
	uint64_t f = w->cap - (w->own - w->peer);
	if (f >= (want ? want : 1))
		return (int64_t)f;
	uint64_t h = __atomic_load_n(w64(w, SHUNT_OFF_HEAD), SC);
	if (h < w->peer || h > w->own)
		return SHUNT_ECORRUPT;
	w->peer = h;
	return (int64_t)(w->cap - (w->own - h));
}

/* gone reports whether r's region was truncated under it (fault.c): its
 * flows fail as reset. */
static inline int gone(const struct shunt_ring *r) { return shunt_fault_dead(r->hdr); }

static ssize_t shunt_ring_write1(struct shunt_ring *w, const void *buf, size_t n);
static ssize_t shunt_ring_read1(struct shunt_ring *r, void *buf, size_t n);

ssize_t shunt_ring_write(struct shunt_ring *w, const void *buf, size_t n)
{
	ssize_t got = shunt_ring_write1(w, buf, n);
	/* Bytes written while the region died went to zeros: an error. */
	return gone(w) ? SHUNT_ERESET : got;
}

static ssize_t shunt_ring_write1(struct shunt_ring *w, const void *buf, size_t n)
{
	if (__atomic_load_n(w32(w, SHUNT_OFF_RESET), SC) || gone(w))
		return SHUNT_ERESET;
	if (w->left)
		return SHUNT_ELEFT;
	if (w->fin || (__atomic_load_n(w32(w, SHUNT_OFF_RFLAGS), SC) & (SHUNT_RF_CLOSED | SHUNT_RF_LEFT)))
		return SHUNT_EPIPE;
	const uint8_t *p = buf;
	size_t done = 0;
	while (done < n) {
		int64_t f = space(w, n - done);
		if (f < 0)
			return done ? (ssize_t)done : f;
		if (f == 0)
			break;
		size_t k = n - done;
		if (k > (size_t)f)
			k = f;
		if (k > BATCH)
			k = BATCH;
		size_t off = w->own & w->mask, first = w->cap - off;
		if (first > k)
			first = k;
		memcpy(w->data + off, p + done, first);
		memcpy(w->data, p + done + first, k - first);
		done += k;
		w->own += k;
		w->msgs++;
		__atomic_store_n(w64(w, SHUNT_OFF_TAIL), w->own, SC);
		__atomic_store_n(w64(w, SHUNT_OFF_WMSGS), w->msgs, SC);
		wake(w, w32(w, SHUNT_OFF_RWAIT));
	}
	return done ? (ssize_t)done : (n ? SHUNT_EAGAIN : 0);
}

/* readable bytes, refreshing the writer's tail when the cache has less than want. */
static int64_t avail(struct shunt_ring *r, uint64_t want)
{
	uint64_t a = r->peer - r->own;
	if (a >= (want ? want : 1))
		return (int64_t)a;
	uint64_t t = __atomic_load_n(w64(r, SHUNT_OFF_TAIL), SC);
	if (t < r->peer || t - r->own > r->cap)
		return SHUNT_ECORRUPT;
	r->peer = t;
	return (int64_t)(t - r->own);
}

ssize_t shunt_ring_read(struct shunt_ring *r, void *buf, size_t n)
{
	ssize_t got = shunt_ring_read1(r, buf, n);
	return gone(r) ? SHUNT_ERESET : got;
}

static ssize_t shunt_ring_read1(struct shunt_ring *r, void *buf, size_t n)
{
	if (__atomic_load_n(w32(r, SHUNT_OFF_RESET), SC) || gone(r))
		return SHUNT_ERESET;
	int64_t a = avail(r, n);
	if (a < 0)
		return a;
	if (a == 0) {
		/* The flags are loaded before the tail (the writer stores them
		 * the other way round), so FIN or leave with no new data really
		 * is the end. */
		uint32_t fl = __atomic_load_n(w32(r, SHUNT_OFF_WFLAGS), SC);
		if ((a = avail(r, 1)) < 0)
			return a;
		if (a == 0)
			return fl & SHUNT_WF_FIN ? 0 : fl & SHUNT_WF_LEFT ? SHUNT_ELEFT : SHUNT_EAGAIN;
	}
	uint8_t *p = buf;
	size_t done = 0;
	while (done < n && a > 0) {
		size_t k = n - done;
		if (k > (uint64_t)a)
			k = a;
		if (k > BATCH)
			k = BATCH;
		size_t off = r->own & r->mask, first = r->cap - off;
		if (first > k)
			first = k;
		memcpy(p + done, r->data + off, first);
		memcpy(p + done + first, r->data, k - first);
		done += k;
		r->own += k;
		r->msgs++;
		__atomic_store_n(w64(r, SHUNT_OFF_HEAD), r->own, SC);
		__atomic_store_n(w64(r, SHUNT_OFF_RMSGS), r->msgs, SC);
		wake(r, w32(r, SHUNT_OFF_WWAIT));
		if ((a = avail(r, n - done)) < 0)
			return done;
	}
	return done;
}

ssize_t shunt_ring_peek(struct shunt_ring *r, void *buf, size_t n)
{
	if (__atomic_load_n(w32(r, SHUNT_OFF_RESET), SC) || gone(r))
		return SHUNT_ERESET;
	uint32_t fl = __atomic_load_n(w32(r, SHUNT_OFF_WFLAGS), SC);
	int64_t a = avail(r, n);
	if (a < 0)
		return a;
	if (a == 0)
		return fl & SHUNT_WF_FIN ? 0 : fl & SHUNT_WF_LEFT ? SHUNT_ELEFT : SHUNT_EAGAIN;
	size_t k = n < (uint64_t)a ? n : (size_t)a;
	size_t off = r->own & r->mask, first = r->cap - off;
	if (first > k)
		first = k;
	memcpy(buf, r->data + off, first);
	memcpy((uint8_t *)buf + first, r->data, k - first);
	return k;
}

ssize_t shunt_ring_buffered(struct shunt_ring *r)
{
	if (__atomic_load_n(w32(r, SHUNT_OFF_RESET), SC))
		return SHUNT_ERESET;
	return avail(r, r->cap);
}

int shunt_ring_close_write(struct shunt_ring *w)
{
	if (w->fin)
		return 0;
	w->fin = 1;
	__atomic_fetch_or(w32(w, SHUNT_OFF_WFLAGS), 1, SC);
	wake(w, w32(w, SHUNT_OFF_RWAIT));
	return 0;
}

void shunt_ring_abort(struct shunt_ring *r)
{
	__atomic_store_n(w32(r, SHUNT_OFF_RESET), 1, SC);
	for (int off = SHUNT_OFF_RWAIT; off <= SHUNT_OFF_WWAIT; off += SHUNT_OFF_WWAIT - SHUNT_OFF_RWAIT) {
		__atomic_store_n(w32(r, off), 1, SC); /* wake skips flags that say nobody sleeps */
		wake(r, w32(r, off));
	}
}

int shunt_ring_close_read(struct shunt_ring *r)
{
	__atomic_fetch_or(w32(r, SHUNT_OFF_RFLAGS), 1, SC);
	wake(r, w32(r, SHUNT_OFF_WWAIT));
	return 0;
}

/* ---- path switching (shunt.h; Go: shm/ring/switch.go) ---- */

void shunt_ring_start(struct shunt_ring *w, uint64_t off)
{
	__atomic_store_n(w64(w, SHUNT_OFF_START), off, SC);
	__atomic_fetch_or(w32(w, SHUNT_OFF_WFLAGS), SHUNT_WF_STARTED, SC);
	wake(w, w32(w, SHUNT_OFF_RWAIT));
}

ssize_t shunt_ring_unfreed(struct shunt_ring *w, uint64_t from, void *buf, size_t n)
{
	uint64_t h = __atomic_load_n(w64(w, SHUNT_OFF_HEAD), SC);
	if (h < w->peer || h > w->own)
		return SHUNT_ECORRUPT;
	w->peer = h;
	if (from < h || from > w->own || w->own - from > n)
		return SHUNT_EINVAL;
	size_t k = w->own - from, off = from & w->mask, first = w->cap - off;
	if (first > k)
		first = k;
	memcpy(buf, w->data + off, first);
	memcpy((uint8_t *)buf + first, w->data, k - first);
	return gone(w) ? SHUNT_ERESET : (ssize_t)k;
}

void shunt_ring_leave(struct shunt_ring *w)
{
	if (w->left)
		return;
	w->left = 1;
	__atomic_fetch_or(w32(w, SHUNT_OFF_WFLAGS), SHUNT_WF_LEFT, SC);
	wake(w, w32(w, SHUNT_OFF_RWAIT));
}

int shunt_ring_reader_attached(const struct shunt_ring *w)
{
	return (__atomic_load_n(w32(w, SHUNT_OFF_RFLAGS), SC) & SHUNT_RF_ATTACHED) != 0;
}

int shunt_ring_reader_left(const struct shunt_ring *w)
{
	return (__atomic_load_n(w32(w, SHUNT_OFF_RFLAGS), SC) & SHUNT_RF_LEFT) != 0;
}

void shunt_ring_attach_reader(struct shunt_ring *r)
{
	__atomic_fetch_or(w32(r, SHUNT_OFF_RFLAGS), SHUNT_RF_ATTACHED, SC);
}

int shunt_ring_started(const struct shunt_ring *r, uint64_t *off)
{
	if (!(__atomic_load_n(w32(r, SHUNT_OFF_WFLAGS), SC) & SHUNT_WF_STARTED))
		return 0;
	*off = __atomic_load_n(w64(r, SHUNT_OFF_START), SC);
	return 1;
}

int shunt_ring_writer_left(const struct shunt_ring *r)
{
	return (__atomic_load_n(w32(r, SHUNT_OFF_WFLAGS), SC) & SHUNT_WF_LEFT) != 0;
}

void shunt_ring_leave_read(struct shunt_ring *r)
{
	__atomic_fetch_or(w32(r, SHUNT_OFF_RFLAGS), SHUNT_RF_LEFT, SC);
	wake(r, w32(r, SHUNT_OFF_WWAIT));
}

int shunt_ring_ready(struct shunt_ring *r, int reader)
{
	if (__atomic_load_n(&r->stop, SC) || __atomic_load_n(w32(r, SHUNT_OFF_RESET), SC) || gone(r))
		return 1;
	/* own may be moving: another thread of this process that reads (or
	 * writes) this end while a sleeper asks. A stale value only makes the
	 * sleeper's caller try once more. */
	uint64_t own = __atomic_load_n(&r->own, __ATOMIC_RELAXED);
	if (reader)
		return __atomic_load_n(w64(r, SHUNT_OFF_TAIL), SC) != own ||
		       (__atomic_load_n(w32(r, SHUNT_OFF_WFLAGS), SC) & (SHUNT_WF_FIN | SHUNT_WF_LEFT));
	if (__atomic_load_n(w32(r, SHUNT_OFF_RFLAGS), SC) & (SHUNT_RF_CLOSED | SHUNT_RF_LEFT))
		return 1;
	return r->cap - (own - __atomic_load_n(w64(r, SHUNT_OFF_HEAD), SC)) > 0;
}

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void shunt_spin_yield(int64_t spun_ns)
{
	if (spun_ns >= SHUNT_YIELD_AFTER_NS)
		shunt_sys(SYS_sched_yield, 0, 0, 0, 0, 0, 0);
}

void shunt_ring_stop(struct shunt_ring *r, int reader)
{
	__atomic_store_n(&r->stop, 1, SC);
	/* Dekker with the sleeper: it publishes its flag and then reads stop;
	 * this stores stop and then reads the flag. Either it sees stop, or
	 * the flag is cleared here before its futex sleep, which then returns
	 * at once. The flag is this end's own (the peer never sleeps on it). */
	uint32_t *flag = shunt_ring_wait_word(r, reader);
	if (__atomic_exchange_n(flag, 0, SC))
		futex(flag, FUTEX_WAKE, INT32_MAX, NULL);
	if (shunt_remote_sleep) /* VM mode: the sleepers (and the preload library's set sleepers) sleep on the kick count */
		shunt_kicked();
}

/* sleep is one futex sleep on flag while it holds 1, or the remote sleep:
 * 0 after a wake-up or a time-out (the caller re-checks), SHUNT_EINTR when
 * a signal handler ran and the wait must not go on. Untimed (timeout_ns <
 * 0), FUTEX_WAIT is restarted by the kernel itself when the handler has
 * SA_RESTART, and fails with EINTR when it has not. Timed, FUTEX_WAIT
 * fails with EINTR after any handler: as a socket with SO_RCVTIMEO or
 * SO_SNDTIMEO, whose calls are not restarted (signal(7)). */
static int sleep_on(const struct shunt_ring *r, uint32_t *flag, uint32_t seq, int64_t timeout_ns)
{
	if (shunt_remote_sleep && !r->local)
		return shunt_remote_sleep(seq, timeout_ns);
	struct timespec ts = {timeout_ns / 1000000000, timeout_ns % 1000000000};
	if (futex(flag, FUTEX_WAIT, 1, timeout_ns < 0 ? NULL : &ts) < 0 && errno == EINTR)
		return SHUNT_EINTR;
	return 0;
}

int shunt_ring_wait(struct shunt_ring *r, int reader, int64_t spin_ns, int64_t timeout_ns)
{
	int64_t start = now_ns();
	for (unsigned i = 1;; i++) {
		if (shunt_ring_ready(r, reader))
			return 0;
		if (i % 64)
			continue;
		int64_t el = now_ns() - start;
		if (timeout_ns >= 0 && el >= timeout_ns)
			return SHUNT_EAGAIN;
		if (el >= spin_ns)
			break;
		shunt_spin_yield(el);
#if defined(__x86_64__)
		__builtin_ia32_pause();
#endif
	}
	/* Several threads of this process may sleep here on one end (two
	 * readers of a connection): none clears the flag on its way out, since
	 * another may still sleep on it; the waker clears it. A flag left set
	 * (found ready just after setting it, time-out, signal) costs the
	 * waker one needless wake-up. After a wake-up the ring is checked
	 * before the flag is set again, so a woken sleeper leaves it clear. */
	uint32_t *flag = shunt_ring_wait_word(r, reader);
	for (;;) {
		uint32_t seq = shunt_remote_seq ? shunt_remote_seq() : 0;
		__atomic_store_n(flag, 1, SC);
		if (shunt_ring_ready(r, reader))
			return 0;
		int64_t left = -1;
		if (timeout_ns >= 0 && (left = timeout_ns - (now_ns() - start)) <= 0)
			return SHUNT_EAGAIN;
		__atomic_add_fetch(&r->sleepers, 1, SC);
		int err = sleep_on(r, flag, seq, left);
		/* A waker that wakes one sleeper only (the Go library's) may have
		 * woken this one while others of this process still sleep on the
		 * flag, which it has cleared: pass the wake-up on. */
		if (__atomic_sub_fetch(&r->sleepers, 1, SC) > 0 && (!shunt_remote_sleep || r->local))
			futex(flag, FUTEX_WAKE, INT32_MAX, NULL);
		if (err)
			return err;
		if (shunt_ring_ready(r, reader))
			return 0;
	}
}
