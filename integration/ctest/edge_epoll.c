/* edge_epoll.c: Apache's event MPM pattern (issue 21). A listener thread
 * sleeps in its own epoll set, which holds only kernel fds (a pipe, as
 * APR's wakeup pipe); a worker thread adds a fast-path connection to that
 * set while the listener sleeps, with an application pointer as its data.
 * The listener must wake for the connection's ring data and get back the
 * program's data, never the library's tag (APR crashed on
 * 0x53484e5400000009, the tag plus fd 9). Then the listener takes the
 * connection out (EPOLL_CTL_DEL) and the worker reads, as in Apache; every
 * round adds it again, level or EPOLLONESHOT, with or without EPOLLOUT,
 * through epoll_wait, epoll_pwait and epoll_pwait2, and every second round
 * closes it and connects again (the fd number is reused). In the last two
 * rounds the listener sleeps in an outer set that holds its set (nesting).
 * A dup of the set (a set the library does not know) never shows the tag
 * either.
 *
 *   edge client IP PORT apacheevent   (against "edge server": its "cmd" mode)
 */
#include "edge.h"

#include <sys/syscall.h>

#define ROUNDS   8
#define NESTED   6    /* from this round on, the listener sleeps in an outer set */
#define WAIT_MS  3000 /* a wait that sees nothing by then failed */
#define PIPE_TAG 0x7069706500000000ull /* the program's data for the wakeup pipe */
#define CONN_TAG 0x636f6e6e00000000ull /* the program's data for the connection, plus the round */
#define SET_TAG  0x7365740000000000ull /* the program's data for the inner set in the outer */

struct apache {
	int ep, outer, pipe[2];
	sem_t asleep, woke, added;
	int round, fail;
	char why[200];
	unsigned long long bad;
};

static int wait_round(struct apache *a, struct epoll_event *ev, int max, int round)
{
	if (round >= NESTED) { /* the outer set, then the inner one without waiting */
		int n = epoll_wait(a->outer, ev, max, WAIT_MS);
		if (n <= 0)
			return n;
		if (n != 1 || ev[0].data.u64 != SET_TAG)
			return n; /* reported as bad data below */
		return epoll_wait(a->ep, ev, max, 0);
	}
	if (round % 3 == 0)
		return epoll_wait(a->ep, ev, max, WAIT_MS);
	if (round % 3 == 1)
		return epoll_pwait(a->ep, ev, max, WAIT_MS, NULL);
	struct timespec ts = {WAIT_MS / 1000, 0};
	return epoll_pwait2(a->ep, ev, max, &ts, NULL);
}

/* The listener: one wait per round, until it sees the connection readable. */
static void *listener(void *arg)
{
	struct apache *a = arg;
	for (int round = 0; round < ROUNDS; round++) {
		sem_post(&a->asleep); /* about to sleep: the worker adds meanwhile */
		int got_in = 0;
		struct timespec t0, t1;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		while (!got_in) {
			struct epoll_event ev[8];
			int n = wait_round(a, ev, 8, round);
			clock_gettime(CLOCK_MONOTONIC, &t1);
			for (int i = 0; i < n; i++) {
				unsigned long long d = ev[i].data.u64;
				if (d == PIPE_TAG) {
					char c;
					read(a->pipe[0], &c, 1);
				} else if (d == (CONN_TAG | (unsigned)round)) {
					got_in |= (ev[i].events & EPOLLIN) != 0;
				} else {
					a->bad = d;
					snprintf(a->why, sizeof a->why, "round %d: epoll returned data %#llx, not the program's", round, d);
					a->fail = 1;
				}
			}
			if (a->fail)
				break;
			if (n < 0 && errno != EINTR) {
				snprintf(a->why, sizeof a->why, "round %d: epoll_wait: %s", round, strerror(errno));
				a->fail = 1;
				break;
			}
			if ((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000 > WAIT_MS) {
				snprintf(a->why, sizeof a->why,
					 "round %d: the listener's wait did not wake for the connection added while it slept (%d ms)", round,
					 WAIT_MS);
				a->fail = 1;
				break;
			}
		}
		sem_post(&a->woke);
		if (a->fail)
			return NULL;
		sem_wait(&a->added); /* the worker's next round */
	}
	return NULL;
}

int apache_event(const char *ip, int port, const char *t)
{
	alarm(60);
	struct apache a = {.ep = epoll_create1(EPOLL_CLOEXEC), .outer = epoll_create1(EPOLL_CLOEXEC)};
	if (a.ep < 0 || a.outer < 0 || pipe(a.pipe))
		return fail(t, "epoll_create1 or pipe");
	struct epoll_event oe = {.events = EPOLLIN, .data.u64 = SET_TAG};
	if (epoll_ctl(a.outer, EPOLL_CTL_ADD, a.ep, &oe))
		return fail(t, "epoll_ctl: the set into the outer set");
	sem_init(&a.asleep, 0, 0);
	sem_init(&a.woke, 0, 0);
	sem_init(&a.added, 0, 0);
	struct epoll_event pe = {.events = EPOLLIN, .data.u64 = PIPE_TAG};
	epoll_ctl(a.ep, EPOLL_CTL_ADD, a.pipe[0], &pe);
	pthread_t th;
	pthread_create(&th, NULL, listener, &a);
	int c = -1, fds_seen[ROUNDS / 2], nconn = 0;
	for (int round = 0; round < ROUNDS; round++) {
		if (c < 0) {
			c = dial(ip, port, 0);
			if (c < 0 || write(c, "cmd\n", 4) != 4)
				return fail(t, "connect");
			fds_seen[nconn++] = c;
		}
		sem_wait(&a.asleep);
		usleep(20000); /* the listener is asleep in the kernel by now */
		uint32_t evs = EPOLLIN | (round % 2 ? 0 : EPOLLOUT) | (round % 4 == 3 ? EPOLLONESHOT : 0);
		struct epoll_event ce = {.events = evs, .data.u64 = CONN_TAG | (unsigned)round};
		if (epoll_ctl(a.ep, EPOLL_CTL_ADD, c, &ce))
			return fail(t, "epoll_ctl ADD from the worker");
		if (round == 1) { /* a dup of the set: unknown to the library, the kernel's events only */
			int d = dup(a.ep);
			struct epoll_event dv[4];
			int n = epoll_wait(d, dv, 4, 0);
			for (int i = 0; i < n; i++)
				if (dv[i].data.u64 != (CONN_TAG | 1u) && dv[i].data.u64 != PIPE_TAG)
					return printf("FAIL %s: a dup of the set returned data %#llx\n", t,
						      (unsigned long long)dv[i].data.u64), 1;
			close(d);
		}
		usleep(20000);
		if (write(c, "x", 1) != 1) /* the server answers "x", through the ring */
			return fail(t, "write");
		sem_wait(&a.woke);
		if (a.fail) {
			printf("FAIL %s: %s\n", t, a.why);
			return 1;
		}
		epoll_ctl(a.ep, EPOLL_CTL_DEL, c, NULL); /* as Apache: out of the set while a worker serves it */
		char b;
		if (read(c, &b, 1) != 1 || b != 'x')
			return fail(t, "the worker's read after the listener's wake");
		if (round % 2) {
			close(c);
			c = -1;
		}
		sem_post(&a.added);
	}
	pthread_join(th, NULL);
	if (a.fail)
		return printf("FAIL %s: %s\n", t, a.why), 1;
	printf("PASS %s (%d connections, fds", t, nconn);
	for (int i = 0; i < nconn; i++)
		printf(" %d", fds_seen[i]);
	printf(")\n");
	return 0;
}
