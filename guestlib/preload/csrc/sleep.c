/* A blocking call's sleep on a kernel socket and futex words at once
 * (path.c: a reader on TCP whose ring may start any moment).
 *
 * The calling thread sleeps in futex_waitv on the words, so the kernel
 * decides what a signal does, as it does for a blocking recv: an untimed
 * sleep goes on after a handler with SA_RESTART and fails with EINTR after
 * one without. The thread's watcher (one per calling thread, made on first
 * use) polls the socket meanwhile and wakes the caller's own word when the
 * socket is ready:
 *
 *   caller                         watcher
 *   words = 1 (armed)
 *   ask -------------------------> ppoll(socket, cancel eventfd)
 *   futex_waitv(words, own word)        | socket ready
 *        <------------------------ own word = 0, FUTEX_WAKE
 *   cancel (eventfd), wait until it is idle
 *
 * In VM mode a ring's word sits in a BAR, where no futex works: the sleep
 * takes the kick count instead (shunt.h, kicks) and is bounded by
 * SHUNT_KICK_MAX_SLEEP_NS, as every kick sleep is. Without futex_waitv
 * (Linux < 5.16) the sleep is sliced (1 ms) and a signal ends it with
 * EINTR. */
#include "preload.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>


#define WATCHER_STACK (128 << 10)
#define WORDS_MAX     8 /* the caller's words, plus its own */

struct watcher {
	pthread_t th;
	int efd;           /* cancel */
	uint32_t word;     /* the caller's own word: 0 when the socket is ready */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int fd;
	short events;
	struct arm *a;     /* timed: the words the watcher sleeps on too (through its helper) */
	int asked, busy, quit;
};

static __thread struct watcher *wt;
static pthread_key_t wt_key;
static int wt_key_ok;
static pthread_once_t wt_once = PTHREAD_ONCE_INIT;

static void *watch_loop(void *arg)
{
	struct watcher *w = arg;
	pthread_mutex_lock(&w->mu);
	for (;;) {
		while (!w->asked && !w->quit)
			pthread_cond_wait(&w->cv, &w->mu);
		if (w->quit)
			break;
		w->asked = 0;
		struct pollfd p[3] = {{.fd = w->fd, .events = w->events}, {.fd = w->efd, .events = POLLIN}};
		struct arm *a = w->a;
		pthread_mutex_unlock(&w->mu);
		struct helper *h = a ? helper() : NULL;
		int n = 2;
		if (h)
			p[n++] = (struct pollfd){.fd = helper_efd(h), .events = POLLIN};
		int64_t ns = a ? block_start(h, a, -1) : -1;
		struct timespec ts = {ns / 1000000000, ns % 1000000000};
		int r = real_ppoll(p, n, ns < 0 ? NULL : &ts, NULL);
		if (a)
			block_stop(h);
		if ((r > 0 && (p[0].revents || (n > 2 && p[2].revents))) || (a && r == 0)) {
			__atomic_store_n(&w->word, 0, __ATOMIC_SEQ_CST);
			shunt_futex_wake(&w->word, INT_MAX);
		}
		pthread_mutex_lock(&w->mu);
		w->busy = 0;
		pthread_cond_broadcast(&w->cv);
	}
	pthread_mutex_unlock(&w->mu);
	return NULL;
}

static void watcher_free(void *arg)
{
	struct watcher *w = arg;
	pthread_mutex_lock(&w->mu);
	w->quit = 1;
	pthread_cond_broadcast(&w->cv);
	pthread_mutex_unlock(&w->mu);
	pthread_join(w->th, NULL);
	real_close(w->efd);
	free(w);
}

static void make_key(void) { wt_key_ok = pthread_key_create(&wt_key, watcher_free) == 0; }

static struct watcher *watcher(void)
{
	if (wt)
		return wt->efd >= 0 ? wt : NULL;
	pthread_once(&wt_once, make_key);
	struct watcher *w = calloc(1, sizeof *w);
	if (!w)
		return NULL;
	pthread_mutex_init(&w->mu, NULL);
	pthread_cond_init(&w->cv, NULL);
	w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	wt = w;
	if (w->efd < 0)
		return NULL;
	if (shunt_thread_start(&w->th, WATCHER_STACK, watch_loop, w)) {
		real_close(w->efd);
		w->efd = -1;
		return NULL;
	}
	if (wt_key_ok)
		pthread_setspecific(wt_key, w);
	return w;
}

/* The child has no watcher thread: forget the forking thread's. */
void sleep_after_fork(void)
{
	if (wt && wt->efd >= 0)
		real_close(wt->efd);
	wt = NULL;
	if (wt_key_ok)
		pthread_setspecific(wt_key, NULL);
}

int conn_sleep(int fd, short events, struct arm *a, int64_t timeout_ns)
{
	struct watcher *w = watcher();
	int kicks = shunt_kicks_enabled();
	if (kicks && (timeout_ns < 0 || timeout_ns > SHUNT_KICK_MAX_SLEEP_NS))
		timeout_ns = SHUNT_KICK_MAX_SLEEP_NS; /* a kick can be lost */
	if (!w || a->n + 1 > WORDS_MAX) { /* sliced: a kernel poll of 1 ms at a time */
		struct pollfd p = {.fd = fd, .events = events};
		int ms = timeout_ns < 0 || timeout_ns > 1000000 ? 1 : (int)((timeout_ns + 999999) / 1000000);
		return real_poll(&p, 1, ms) < 0 && errno == EINTR ? EINTR : 0;
	}
	/* Timed (SO_RCVTIMEO): a signal must end the sleep whatever the
	 * handler, as it ends the kernel's recv; a timed FUTEX_WAIT does that
	 * (futex_waitv would go on after SA_RESTART), but takes one word: the
	 * caller sleeps on its own, and the watcher sleeps on the others too. */
	int timed = timeout_ns >= 0 && !kicks;
	struct shunt_waitv v[WORDS_MAX];
	int n = 0;
	__atomic_store_n(&w->word, 1, __ATOMIC_SEQ_CST);
	v[n++] = shunt_waitv_word(&w->word, 1);
	if (kicks)
		v[n++] = shunt_waitv_word(shunt_kick_word(), a->seq);
	for (int i = 0; i < a->n && !kicks; i++)
		v[n++] = shunt_waitv_word(a->flag[i], 1);
	pthread_mutex_lock(&w->mu);
	w->fd = fd;
	w->events = events;
	w->a = timed ? a : NULL;
	w->asked = w->busy = 1;
	pthread_cond_broadcast(&w->cv);
	pthread_mutex_unlock(&w->mu);
	struct timespec until, *up = NULL;
	if (timeout_ns >= 0) {
		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_sec += timeout_ns / 1000000000;
		until.tv_nsec += timeout_ns % 1000000000;
		if (until.tv_nsec >= 1000000000) {
			until.tv_sec++;
			until.tv_nsec -= 1000000000;
		}
		up = &until;
	}
	int err = 0;
	long r;
	if (timed) {
		struct timespec rel = {timeout_ns / 1000000000, timeout_ns % 1000000000};
		r = shunt_futex_wait(&w->word, 1, &rel);
	} else {
		r = shunt_futex_waitv(v, n, up);
	}
	if (r < 0 && errno == EINTR) {
		err = EINTR;
	} else if (r < 0 && errno == ENOSYS) { /* Linux < 5.16: sliced */
		struct pollfd p = {.fd = fd, .events = events};
		if (real_poll(&p, 1, 1) < 0 && errno == EINTR)
			err = EINTR;
	}
	uint64_t one = 1;
	ssize_t k = real_write(w->efd, &one, sizeof one); /* cancel the watcher's poll */
	(void)k;
	pthread_mutex_lock(&w->mu);
	while (w->busy)
		pthread_cond_wait(&w->cv, &w->mu);
	pthread_mutex_unlock(&w->mu);
	uint64_t v8;
	while (real_read(w->efd, &v8, sizeof v8) == sizeof v8)
		;
	return err;
}
