/* Waiting on sets: poll, ppoll, select, pselect, and the machinery epoll
 * shares (epoll.c).
 *
 * A wait checks the rings (and, every KERNEL_EVERY turns, the kernel)
 * while it spins; then it arms: publishes "waiting" in the wait word of
 * every ring of interest, re-checks, and blocks in the kernel call with
 * its thread's eventfd added. The thread's helper has sleeper threads wait
 * on the armed words with futex_waitv; a peer that writes a ring finds its
 * word set and wakes it, and the sleeper writes the eventfd:
 *
 *   waiting thread                 sleeper 0 .. k-1 (one per 127 words)
 *   arm_set(words, 1)
 *   re-check rings
 *   block_start  ----------------> futex_waitv(cancel, words[i*127 ...])
 *   ppoll/epoll_pwait(fds + efd)        | a peer wakes a word
 *        <------------------------ write(efd)
 *   block_stop: cancel = 1, wake ---> return, idle
 *   arm_set(words, 0)
 *
 * futex_waitv takes at most FUTEX_WAITV_MAX (128) words, one of them the
 * cancel word, so a set of any size gets as many sleepers as it needs, up
 * to SLEEPERS_MAX per waiting thread. Past that (more than 2032 armed
 * rings), without futex_waitv (Linux < 5.16), or short of memory or
 * threads, the rings nobody sleeps on are re-checked every RECHECK_MS: a
 * slower path, never a missed wake-up. In VM mode the words sit in a BAR,
 * where no futex works: one sleeper waits on the kick count instead
 * (shunt.h, kicks). */
#include "preload.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>

#define SLEEPER_WORDS (SHUNT_WAITV_MAX - 1) /* ring words per sleeper; the other is its cancel word */
#define SLEEPERS_MAX  16                    /* per waiting thread: 2032 rings wake it at once */
#define RECHECK_MS    1                     /* past that: how often the other rings are re-checked */
#define SLEEPER_STACK (256 << 10)           /* a sleeper makes one system call at a time (glibc adds static TLS) */
#define KERNEL_EVERY  16                    /* while spinning, the kernel fds are asked every this many turns */
#define POLL_STACK    64                    /* pollfds on the stack; larger sets are allocated */

struct helper;

struct sleeper {
	struct helper *h;
	pthread_t th;
	int n;                             /* words in w, set by the waiting thread before it asks */
	int asked;                         /* guarded by h->mu: sleep now */
	struct shunt_waitv w[SHUNT_WAITV_MAX]; /* w[0] is h->cancel */
};

/* helper is a waiting thread's set of sleepers and its eventfd; only that
 * thread starts and stops them, and the thread's exit frees them. */
struct helper {
	int efd;
	unsigned id;     /* this process's helpers are numbered from 1: epoll.c remembers which sets hold efd by it */
	int ok;          /* efd made; a helper that failed is kept so it is not retried */
	uint32_t cancel; /* every sleeper's first word: 1 ends the sleep */
	pthread_mutex_t mu;
	pthread_cond_t cv; /* asked, busy and quit changed */
	int busy;          /* sleepers asked and not back yet */
	int quit;          /* the waiting thread exited */
	int n;             /* sleepers started */
	struct sleeper *s[SLEEPERS_MAX];
};

static __thread struct helper *me;
static pthread_key_t me_key; /* runs helper_free at thread exit, if me_key_ok */
static int me_key_ok;
static pthread_once_t me_once = PTHREAD_ONCE_INIT;
static int waitv_broken; /* futex_waitv is missing or failed: every wait is sliced */
static unsigned helper_ids; /* atomic: the last helper's id */

static void *sleeper_loop(void *arg)
{
	struct sleeper *sl = arg;
	struct helper *h = sl->h;
	pthread_mutex_lock(&h->mu);
	for (;;) {
		while (!sl->asked && !h->quit)
			pthread_cond_wait(&h->cv, &h->mu);
		if (!sl->asked)
			break; /* quit */
		pthread_mutex_unlock(&h->mu);
		struct timespec until, *up = NULL;
		if (shunt_kicks_enabled()) { /* kicks can be lost: wake at least this often */
			clock_gettime(CLOCK_MONOTONIC, &until);
			until.tv_nsec += SHUNT_KICK_MAX_SLEEP_NS;
			until.tv_sec += until.tv_nsec / 1000000000;
			until.tv_nsec %= 1000000000;
			up = &until;
		}
		if (shunt_futex_waitv(sl->w, sl->n, up) < 0 && errno != EAGAIN &&
		    errno != ETIMEDOUT && errno != EINTR && !__atomic_exchange_n(&waitv_broken, 1, __ATOMIC_SEQ_CST))
			plog("shunt: futex_waitv: %s; waits on sets re-check every %d ms", strerror(errno), RECHECK_MS);
		if (!__atomic_load_n(&h->cancel, __ATOMIC_SEQ_CST)) {
			uint64_t one = 1;
			ssize_t r = real_write(h->efd, &one, sizeof one); /* fails only when the count is full: awake anyway */
			(void)r;
		}
		pthread_mutex_lock(&h->mu);
		sl->asked = 0;
		if (--h->busy == 0)
			pthread_cond_broadcast(&h->cv);
	}
	pthread_mutex_unlock(&h->mu);
	return NULL;
}

static void helper_free(void *arg)
{
	struct helper *h = arg;
	pthread_mutex_lock(&h->mu);
	h->quit = 1;
	pthread_cond_broadcast(&h->cv);
	pthread_mutex_unlock(&h->mu);
	for (int i = 0; i < h->n; i++) {
		pthread_join(h->s[i]->th, NULL);
		free(h->s[i]);
	}
	if (h->efd >= 0)
		real_close(h->efd);
	pthread_cond_destroy(&h->cv);
	pthread_mutex_destroy(&h->mu);
	free(h);
}

static void make_key(void)
{
	me_key_ok = pthread_key_create(&me_key, helper_free) == 0;
	if (!me_key_ok)
		plog("shunt: no thread key: helpers of exited threads are not freed");
}

struct helper *helper(void)
{
	if (me)
		return me->ok && !__atomic_load_n(&waitv_broken, __ATOMIC_RELAXED) ? me : NULL;
	pthread_once(&me_once, make_key);
	me = calloc(1, sizeof *me);
	if (!me)
		return NULL;
	pthread_mutex_init(&me->mu, NULL);
	pthread_cond_init(&me->cv, NULL);
	me->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	me->ok = me->efd >= 0;
	me->id = __atomic_add_fetch(&helper_ids, 1, __ATOMIC_RELAXED);
	if (me_key_ok)
		pthread_setspecific(me_key, me);
	return helper();
}

int helper_efd(struct helper *h) { return h->efd; }

unsigned helper_id(struct helper *h) { return h->id; }

int wake_efd(unsigned *id)
{
	if (!me)
		helper();
	*id = me ? me->id : 0;
	return me && me->ok ? me->efd : -1;
}

/* grow starts sleepers until h has want of them (or cannot start more). */
static int grow(struct helper *h, int want)
{
	while (h->n < want) {
		struct sleeper *sl = calloc(1, sizeof *sl);
		if (!sl)
			break;
		sl->h = h;
		int err = shunt_thread_start(&sl->th, SLEEPER_STACK, sleeper_loop, sl);
		if (err) {
			static int told;
			if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
				plog("shunt: cannot start a sleeper thread: %s; waits on sets re-check every %d ms", strerror(err), RECHECK_MS);
			free(sl);
			break;
		}
		h->s[h->n++] = sl;
	}
	return h->n < want ? h->n : want;
}

static int64_t sliced(int64_t ns)
{
	const int64_t slice = (int64_t)RECHECK_MS * 1000000;
	return ns < 0 || ns > slice ? slice : ns;
}

int64_t block_start(struct helper *h, struct arm *a, int64_t ns)
{
	if (!h)
		return sliced(ns);
	int kicks = shunt_kicks_enabled();
	int need = kicks ? 1 : (a->n + SLEEPER_WORDS - 1) / SLEEPER_WORDS;
	int have = grow(h, need < SLEEPERS_MAX ? need : SLEEPERS_MAX);
	__atomic_store_n(&h->cancel, 0, __ATOMIC_SEQ_CST);
	for (int i = 0; i < have; i++) {
		struct sleeper *sl = h->s[i];
		sl->w[0] = shunt_waitv_word(&h->cancel, 0);
		if (kicks) { /* the words sit in a BAR: sleep on the kick count instead */
			sl->w[1] = shunt_waitv_word(shunt_kick_word(), a->seq);
			sl->n = 2;
			for (int j = 0; j < a->nlocal; j++)
				sl->w[sl->n++] = shunt_waitv_word(a->local[j], 1);
			continue;
		}
		int first = i * SLEEPER_WORDS, k = a->n - first < SLEEPER_WORDS ? a->n - first : SLEEPER_WORDS;
		for (int j = 0; j < k; j++)
			sl->w[j + 1] = shunt_waitv_word(a->flag[first + j], 1);
		sl->n = k + 1;
	}
	pthread_mutex_lock(&h->mu);
	for (int i = 0; i < have; i++)
		h->s[i]->asked = 1;
	h->busy = have;
	pthread_cond_broadcast(&h->cv);
	pthread_mutex_unlock(&h->mu);
	return have == need && !a->short_of_memory ? ns : sliced(ns);
}

void block_stop(struct helper *h)
{
	if (!h)
		return;
	__atomic_store_n(&h->cancel, 1, __ATOMIC_SEQ_CST);
	shunt_futex_wake(&h->cancel, INT_MAX);
	pthread_mutex_lock(&h->mu);
	while (h->busy)
		pthread_cond_wait(&h->cv, &h->mu);
	pthread_mutex_unlock(&h->mu);
	uint64_t v;
	while (real_read(h->efd, &v, sizeof v) == sizeof v)
		;
}

/* wait_after_fork forgets the forking thread's helper in the child: its
 * sleepers did not come along. */
void wait_after_fork(void)
{
	if (me && me->efd >= 0)
		real_close(me->efd);
	me = NULL;
	if (me_key_ok)
		pthread_setspecific(me_key, NULL);
}

/* ---- arms ---- */

void arm_init(struct arm *a)
{
	a->flag = a->inline_flags;
	a->n = 0;
	a->cap = sizeof a->inline_flags / sizeof *a->inline_flags;
	a->short_of_memory = 0;
	a->seq = 0;
	a->nlocal = 0;
}

void arm_word(struct arm *a, uint32_t *w)
{
	if (a->n == a->cap) {
		uint32_t **more = malloc(2 * a->cap * sizeof *more);
		if (!more) { /* this word is not armed: block_start slices the wait */
			a->short_of_memory = 1;
			return;
		}
		memcpy(more, a->flag, a->n * sizeof *more);
		if (a->flag != a->inline_flags)
			free(a->flag);
		a->flag = more;
		a->cap *= 2;
	}
	a->flag[a->n++] = w;
}

/* arm_add arms what may change a connection's readiness for a reader
 * (reader) or a writer besides its kernel socket: its event word (READY,
 * DOWN, close) and its ring's wait word. */
void arm_flow(struct arm *a, struct flow *f)
{
	if (!__atomic_load_n(&f->ev_armed, __ATOMIC_RELAXED))
		__atomic_store_n(&f->ev_armed, 1, __ATOMIC_SEQ_CST);
	__atomic_thread_fence(__ATOMIC_SEQ_CST); /* before the caller's check (flow_wake) */
	arm_word(a, &f->ev);
}

void arm_add(struct arm *a, struct flow *f, int reader)
{
	arm_flow(a, f);
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (!rg)
		return;
	struct shunt_ring *r = reader ? &rg->sf.r : &rg->sf.w;
	arm_word(a, shunt_ring_wait_word(r, reader));
	if (r->local && a->nlocal < LOCAL_MAX)
		a->local[a->nlocal++] = shunt_ring_wait_word(r, reader);
}

void arm_set(struct arm *a, uint32_t v)
{
	if (v)
		a->seq = shunt_kick_seq();
	for (int i = 0; i < a->n; i++)
		__atomic_store_n(a->flag[i], v, __ATOMIC_SEQ_CST);
}

void arm_free(struct arm *a)
{
	if (a->flag != a->inline_flags)
		free(a->flag);
	arm_init(a);
}

/* ---- poll and select ---- */

/* conn_kernel_events: what to ask the kernel socket of a connection for
 * interest ev: input while the reader is on TCP, output while the writer
 * is (a writer on the ring finds the idle kernel socket always writable). */
short conn_kernel_events(struct flow *f, short ev)
{
	short k = 0;
	if ((ev & (POLLIN | POLLRDHUP)) && !__atomic_load_n(&f->rring, __ATOMIC_RELAXED))
		k |= ev & (POLLIN | POLLRDHUP | POLLPRI);
	if ((ev & POLLOUT) && !__atomic_load_n(&f->wring, __ATOMIC_RELAXED))
		k |= POLLOUT;
	return k;
}

/* fast_events: a connection's readiness for interest ev, following its
 * paths, including a switch the next call would make. kev is the kernel
 * socket's revents for conn_kernel_events (-1: ask it now). The reader's
 * and writer's state is read without their locks: a stale view only makes
 * the caller look again. */
/* held: f's reader holds a kernel EOF for rg's relayed ring, which has
 * neither started nor been left (path.c, relay_holds): nothing to read. */
static int held(struct flow *f, struct rings *rg)
{
	uint64_t start;
	int64_t until = __atomic_load_n(&f->rhold, __ATOMIC_RELAXED);
	return until && rg && rg->bridged && !__atomic_load_n(&f->slen, __ATOMIC_RELAXED) && !shunt_ring_started(&rg->sf.r, &start) &&
	       !shunt_ring_writer_left(&rg->sf.r) && !__atomic_load_n(&rg->peer_gone, __ATOMIC_SEQ_CST) && now_ns() < until;
}

short fast_events(struct flow *f, int fd, short ev, short kev)
{
	if (kev < 0) {
		struct pollfd p = {.fd = fd, .events = conn_kernel_events(f, ev)};
		kev = real_poll(&p, 1, 0) == 1 ? p.revents : 0;
	}
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	short r = kev & (POLLERR | POLLHUP | POLLNVAL);
	uint64_t start;
	if (ev & POLLIN) {
		int rring = __atomic_load_n(&f->rring, __ATOMIC_RELAXED);
		int started = rg && !rring && shunt_ring_started(&rg->sf.r, &start);
		size_t ahead = __atomic_load_n(&f->alen, __ATOMIC_ACQUIRE);
		if (__atomic_load_n(&f->rd_shut, __ATOMIC_RELAXED) || __atomic_load_n(&f->closed, __ATOMIC_RELAXED))
			r |= POLLIN;
		else if (rring && rg)
			r |= shunt_ring_ready(&rg->sf.r, 1) || __atomic_load_n(&rg->peer_gone, __ATOMIC_SEQ_CST) ? POLLIN : 0;
		else if (started && __atomic_load_n(&f->roff, __ATOMIC_RELAXED) == start)
			r |= shunt_ring_ready(&rg->sf.r, 1) ? POLLIN : 0; /* the next read moves to the ring */
		else if (held(f, rg))
			; /* a relayed ring's reader holds the kernel's EOF for the ring (path.c) */
		else if (__atomic_load_n(&f->slen, __ATOMIC_RELAXED) || __atomic_load_n(&f->seof, __ATOMIC_RELAXED))
			r |= POLLIN;
		else if (ahead && __atomic_load_n(&f->roff, __ATOMIC_RELAXED) == __atomic_load_n(&f->ahead_at, __ATOMIC_RELAXED))
			r |= POLLIN; /* the stretch held ahead is due (path.c) */
		else
			r |= kev & POLLIN; /* with a stretch held ahead: TCP bytes before it */
		/* The peer's FIN counts once its ring's bytes are read. */
		if (!rring && !started && !held(f, rg) && !ahead)
			r |= kev & ev & POLLRDHUP;
	}
	if (ev & POLLOUT) {
		if (__atomic_load_n(&f->wring, __ATOMIC_RELAXED) && rg)
			r |= shunt_ring_ready(&rg->sf.w, 0) || __atomic_load_n(&rg->down, __ATOMIC_SEQ_CST) ? POLLOUT : 0;
		else
			r |= kev & POLLOUT;
	}
	if (rg && __atomic_load_n((uint32_t *)(rg->sf.r.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST))
		r |= POLLIN | POLLOUT | POLLERR | POLLHUP; /* a broken ring: the next call says ECONNRESET */
	return r & (ev | POLLERR | POLLHUP | POLLNVAL);
}

int remaining_ms(int64_t deadline)
{
	if (deadline < 0)
		return -1;
	int64_t left = deadline - now_ns();
	return left <= 0 ? 0 : (int)((left + 999999) / 1000000);
}

/* do_poll is poll(2) over a set that may contain connections: their
 * kernel sockets are asked for what their TCP paths need, and their rings
 * and event words are armed (arm_add). */
static int do_poll(struct pollfd *p, nfds_t n, int64_t timeout_ns, const sigset_t *mask)
{
	int fast = 0, pend = 0;
	for (nfds_t i = 0; i < n; i++) {
		settle(p[i].fd);
		fast += flow_of(p[i].fd) != NULL;
		pend += pending(p[i].fd);
	}
	if (!fast && !pend) {
		struct timespec ts = {timeout_ns / 1000000000, timeout_ns % 1000000000};
		return real_ppoll(p, n, timeout_ns < 0 ? NULL : &ts, mask);
	}
	struct pollfd stack[POLL_STACK], *kp = n + 1 <= POLL_STACK ? stack : malloc((n + 1) * sizeof *kp);
	if (!kp)
		return errno = ENOMEM, -1;
	int64_t start = now_ns(), deadline = timeout_ns < 0 ? -1 : start + timeout_ns;
	int result, ask_kernel = 1;
	for (unsigned turn = 0;; turn++) {
		int ready = 0;
		for (nfds_t i = 0; i < n; i++) {
			if (pend)
				settle(p[i].fd);
			struct flow *f = flow_of(p[i].fd);
			kp[i] = p[i];
			kp[i].revents = 0;
			if (f)
				kp[i].events = conn_kernel_events(f, p[i].events);
			else if (pending(p[i].fd))
				kp[i].events |= POLLOUT; /* wake when the connect ends, to settle it */
		}
		int k = 0, asked = ask_kernel || turn % KERNEL_EVERY == 0;
		if (asked)
			k = real_poll(kp, n, 0);
		ask_kernel = 0;
		for (nfds_t i = 0; i < n; i++) {
			struct flow *f = flow_of(p[i].fd);
			if (f)
				p[i].revents = fast_events(f, p[i].fd, p[i].events, asked ? kp[i].revents : 0);
			else
				p[i].revents = kp[i].revents & (p[i].events | POLLERR | POLLHUP | POLLNVAL);
			ready += p[i].revents != 0;
		}
		if (ready || k < 0) {
			result = k < 0 ? k : ready;
			break;
		}
		int64_t now = now_ns();
		if (deadline >= 0 && now >= deadline) {
			result = 0;
			break;
		}
		if (now - start < spin_ns) {
			shunt_spin_yield(now - start);
			continue;
		}
		/* Block: publish "waiting" in every fast ring, re-check, sleep. */
		struct arm a;
		arm_init(&a);
		for (nfds_t i = 0; i < n; i++) {
			struct flow *f = flow_of(p[i].fd);
			if (f && (p[i].events & POLLIN))
				arm_add(&a, f, 1);
			if (f && (p[i].events & POLLOUT))
				arm_add(&a, f, 0);
		}
		arm_set(&a, 1);
		int again = 0, r = 0;
		for (nfds_t i = 0; i < n && !again; i++) {
			struct flow *f = flow_of(p[i].fd);
			if (f) {
				kp[i].events = conn_kernel_events(f, p[i].events);
				again = fast_events(f, p[i].fd, p[i].events, 0) != 0;
			}
		}
		if (!again) {
			struct helper *h = helper();
			nfds_t kn = n;
			if (h)
				kp[kn++] = (struct pollfd){.fd = helper_efd(h), .events = POLLIN};
			int64_t left = block_start(h, &a, deadline < 0 ? -1 : deadline - now_ns());
			struct timespec ts = {left / 1000000000, left % 1000000000};
			r = real_ppoll(kp, kn, left < 0 ? NULL : &ts, mask);
			int saved = errno;
			block_stop(h); /* it drains the eventfd: errno is EAGAIN after */
			errno = saved;
			ask_kernel = 1;
		}
		int e = errno;
		arm_set(&a, 0);
		arm_free(&a);
		errno = e;
		if (r < 0) { /* a signal (the kernel poll would say EINTR too) */
			result = -1;
			break;
		}
	}
	if (kp != stack) {
		int e = errno;
		free(kp);
		errno = e;
	}
	return result;
}

INTERPOSE int poll(struct pollfd *p, nfds_t n, int timeout)
{
	REAL_READY();
	return do_poll(p, n, timeout < 0 ? -1 : (int64_t)timeout * 1000000, NULL);
}

INTERPOSE int ppoll(struct pollfd *p, nfds_t n, const struct timespec *ts, const sigset_t *mask)
{
	REAL_READY();
	return do_poll(p, n, ts ? (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec : -1, mask);
}

static int do_select(int nfds, fd_set *r, fd_set *w, fd_set *e, int64_t timeout_ns, const sigset_t *mask)
{
	struct pollfd p[FD_SETSIZE]; /* select takes no fd >= FD_SETSIZE (fd_set is that big) */
	int n = 0;
	for (int fd = 0; fd < nfds && fd < FD_SETSIZE; fd++) {
		short ev = (r && FD_ISSET(fd, r) ? POLLIN : 0) | (w && FD_ISSET(fd, w) ? POLLOUT : 0) |
			   (e && FD_ISSET(fd, e) ? POLLPRI : 0);
		if (ev)
			p[n++] = (struct pollfd){.fd = fd, .events = ev};
	}
	int k = do_poll(p, n, timeout_ns, mask);
	if (k < 0)
		return k;
	if (r)
		FD_ZERO(r);
	if (w)
		FD_ZERO(w);
	if (e)
		FD_ZERO(e);
	int count = 0;
	for (int i = 0; i < n; i++) {
		short re = p[i].revents;
		if (r && (re & (POLLIN | POLLHUP | POLLERR)) && (p[i].events & POLLIN))
			FD_SET(p[i].fd, r), count++;
		if (w && (re & (POLLOUT | POLLERR)) && (p[i].events & POLLOUT))
			FD_SET(p[i].fd, w), count++;
		if (e && (re & POLLPRI))
			FD_SET(p[i].fd, e), count++;
	}
	return count;
}

INTERPOSE int select(int nfds, fd_set *r, fd_set *w, fd_set *e, struct timeval *tv)
{
	REAL_READY();
	int64_t t = tv ? (int64_t)tv->tv_sec * 1000000000 + tv->tv_usec * 1000 : -1;
	return do_select(nfds, r, w, e, t, NULL);
}

INTERPOSE int pselect(int nfds, fd_set *r, fd_set *w, fd_set *e, const struct timespec *ts, const sigset_t *mask)
{
	REAL_READY();
	return do_select(nfds, r, w, e, ts ? (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec : -1, mask);
}
