/* The safety net, and io_uring.
 *
 * A fast-path flow's kernel socket carries no bytes: both ends move them
 * through the rings. Bytes that arrive there were written past the library
 * (a raw syscall, an io_uring submission, a glibc-internal write), and the
 * reader would wait for them in the ring forever. So one thread per
 * process watches the kernel sockets of its flows (an epoll set, each
 * socket EPOLLONESHOT for input): when one becomes readable with bytes, the
 * flow is reset, and its reads and writes, on both ends, fail with
 * ECONNRESET instead of hanging. A socket that becomes readable at EOF
 * (the peer closed its kernel socket) needs nothing more. The watcher
 * sleeps in the kernel; a new flow costs one epoll_ctl.
 *
 * io_uring moves bytes where no preload library sees them. A process that
 * sets it up (io_uring_setup through syscall(), or liburing's setup
 * functions) keeps its new connections on TCP; flows it already had are
 * covered by the watcher above. */
#include "preload.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <string.h>
#include <sys/syscall.h>

#ifndef SYS_io_uring_setup
#define SYS_io_uring_setup 425
#endif

int uring_seen;

static pthread_mutex_t guard_mu = PTHREAD_MUTEX_INITIALIZER;
static int guard_ep = -1; /* under guard_mu; -2: cannot be made, no watcher */

static void trip(int fd)
{
	struct flow *f = flow_get(fd);
	if (!f)
		return;
	char c;
	ssize_t k = real_recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
	if (k > 0 && f->owner == my_pid && !__atomic_load_n((uint32_t *)(f->sf.r.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST)) {
		/* plog, not only -v: this is a program's bug, worth a line */
		plog("shunt: fd %d: bytes arrived on the TCP socket of a fast-path flow: the program wrote past the library "
		     "(raw syscall?); flow reset (ECONNRESET)", fd);
		__atomic_store_n((uint32_t *)(f->sf.w.hdr + SHUNT_OFF_RESET), 1, __ATOMIC_SEQ_CST);
		__atomic_store_n((uint32_t *)(f->sf.r.hdr + SHUNT_OFF_RESET), 1, __ATOMIC_SEQ_CST);
		shunt_ring_abort(&f->sf.w);
		shunt_ring_abort(&f->sf.r);
	}
	flow_put(f);
}

static void *watch(void *arg)
{
	int ep = (int)(intptr_t)arg;
	struct epoll_event ev[16];
	for (;;) {
		int n = real_epoll_wait(ep, ev, 16, -1);
		if (n < 0 && errno != EINTR)
			return NULL; /* the set was closed (fork child) */
		for (int i = 0; i < n; i++)
			trip(ev[i].data.fd);
	}
}

void guard(int fd)
{
	pthread_mutex_lock(&guard_mu);
	if (guard_ep == -1) {
		guard_ep = real_epoll_create1(EPOLL_CLOEXEC);
		pthread_t th;
		pthread_attr_t at;
		pthread_attr_init(&at);
		pthread_attr_setstacksize(&at, 64 << 10);
		pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
		sigset_t all, old;
		sigfillset(&all);
		pthread_sigmask(SIG_SETMASK, &all, &old); /* the watcher takes no signals */
		if (guard_ep < 0 || pthread_create(&th, &at, watch, (void *)(intptr_t)guard_ep)) {
			plog("shunt: cannot start the watcher of fast-path flows' TCP sockets: %s", strerror(errno));
			if (guard_ep >= 0)
				real_close(guard_ep);
			guard_ep = -2;
		}
		pthread_sigmask(SIG_SETMASK, &old, NULL);
		pthread_attr_destroy(&at);
	}
	if (guard_ep >= 0) {
		struct epoll_event ev = {.events = EPOLLIN | EPOLLONESHOT, .data.fd = fd};
		real_epoll_ctl(guard_ep, EPOLL_CTL_ADD, fd, &ev);
	}
	pthread_mutex_unlock(&guard_mu);
}

/* The watcher did not come along; the set is the parent's. */
void guard_after_fork(void)
{
	pthread_mutex_init(&guard_mu, NULL);
	if (guard_ep >= 0)
		real_close(guard_ep);
	guard_ep = -1;
}

/* ---- io_uring ---- */

static void uring(const char *how)
{
	if (!__atomic_exchange_n(&uring_seen, 1, __ATOMIC_SEQ_CST))
		plog("shunt: the process set up io_uring (%s): new connections stay on TCP", how);
}

/* syscall is interposed only to see io_uring_setup; every call goes on to
 * libc's with its six argument registers, as syscall(2) takes them. */
INTERPOSE long syscall(long nr, ...)
{
	REAL_READY();
	static long (*real)(long, ...);
	long (*r)(long, ...) = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
	if (!r) {
		r = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
		__atomic_store_n(&real, r, __ATOMIC_RELEASE);
	}
	va_list ap;
	va_start(ap, nr);
	long a[6];
	for (int i = 0; i < 6; i++)
		a[i] = va_arg(ap, long);
	va_end(ap);
	if (nr == SYS_io_uring_setup)
		uring("syscall");
	return r(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
}

/* liburing's setup functions (it makes the system call itself). */
#define URING(name, params, args)                                              \
	INTERPOSE int name params                                              \
	{                                                                      \
		REAL_READY();                                                  \
		static int(*real) params;                                      \
		if (!real)                                                     \
			real = (int(*) params)dlsym(RTLD_NEXT, #name);         \
		uring(#name);                                                  \
		return real ? real args : -ENOSYS;                             \
	}
struct io_uring;
struct io_uring_params;
URING(io_uring_queue_init, (unsigned entries, struct io_uring *ring, unsigned flags), (entries, ring, flags))
URING(io_uring_queue_init_params, (unsigned entries, struct io_uring *ring, struct io_uring_params *p), (entries, ring, p))
URING(io_uring_setup, (unsigned entries, struct io_uring_params *p), (entries, p))
