/* What changes an fd's identity past the usual calls (issue 21), and
 * children that share this process's memory.
 *
 * syscall(): libuv (Node.js) closes sockets with syscall(SYS_close), and a
 * program may dup2 or close_range the same way. The library must see each
 * of them as the libc call, or it keeps a closed fd's connection, and the
 * next socket that gets the number is taken for the old one (a new
 * connection answered nothing). So the interposed syscall() hands
 * SYS_close, SYS_dup, SYS_dup2, SYS_dup3, SYS_fcntl and SYS_close_range to
 * the library's own wrappers, and notes SYS_io_uring_setup (guard.c).
 * Inline syscall instructions (and Go binaries) stay out of reach.
 *
 * close_range and closefrom (glibc 2.34) make the close_range system call
 * inside libc, which no preload sees: each fd of the range the library
 * knows is forgotten first, as close() does (CPython's subprocess closes
 * the child's fds so).
 *
 * vfork: its child runs in the parent's memory until it execs, so its
 * dup2 onto 0 and 1 (CPython's subprocess) once marked the parent's
 * stdio as connections, and the parent later failed with ENOTSOCK on its
 * own stdout. vfork is fork here (POSIX allows it: the child only may not
 * rely on sharing memory), so the child is an ordinary fork child with
 * the fork rules (docs/preload.md). clone() with CLONE_VM (and not
 * CLONE_THREAD) is a spawn: the young connections are let go first, as
 * before posix_spawn (fork.c), since its child may dup any fd. Any child
 * that shares memory (clone(CLONE_VM) through libc or not; glibc's
 * posix_spawn, whose child makes its calls inside libc anyway) is
 * recognized by its pid (vm_child): its close, dup and fcntl go straight
 * to libc and change nothing of the parent's. */
#include "preload.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <sys/syscall.h>

#ifndef SYS_io_uring_setup
#define SYS_io_uring_setup 425
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

int vm_child(void)
{
	pid_t me = __atomic_load_n(&my_pid, __ATOMIC_RELAXED);
	return me && getpid() != me;
}

static long (*real_syscall)(long, ...);
static int (*real_close_range)(unsigned, unsigned, int);
static void (*real_closefrom)(int);
static int (*real_clone)(int (*)(void *), void *, int, void *, ...);

static void resolve_raw(void)
{
	__atomic_store_n(&real_syscall, (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall"), __ATOMIC_RELEASE);
	__atomic_store_n(&real_close_range, (int (*)(unsigned, unsigned, int))dlsym(RTLD_NEXT, "close_range"), __ATOMIC_RELEASE);
	__atomic_store_n(&real_closefrom, (void (*)(int))dlsym(RTLD_NEXT, "closefrom"), __ATOMIC_RELEASE);
	__atomic_store_n(&real_clone, (int (*)(int (*)(void *), void *, int, void *, ...))dlsym(RTLD_NEXT, "clone"), __ATOMIC_RELEASE);
}

static pthread_once_t raw_once = PTHREAD_ONCE_INIT;

/* forget_range forgets every fd in [first, last] the library knows, before
 * their kernel close. */
static void forget_range(unsigned first, unsigned last)
{
	if (vm_child())
		return;
	unsigned top = last < FD_MAX - 1 ? last : FD_MAX - 1;
	for (unsigned fd = first; fd <= top; fd++)
		if (__atomic_load_n(&kind[fd], __ATOMIC_ACQUIRE) != FD_NONE || flow_of((int)fd) || ep_maybe_set((int)fd))
			forget((int)fd);
	if (last >= FD_MAX) {
		int high[64], n;
		unsigned from = first > FD_MAX ? first : FD_MAX;
		do { /* sets at high fd numbers (rare): a batch at a time */
			n = ep_high_in(from, last, high, 64);
			for (int i = 0; i < n; i++)
				forget(high[i]);
		} while (n == 64);
	}
}

static int close_range_raw(unsigned first, unsigned last, int flags)
{
	return (int)real_syscall(SYS_close_range, first, last, flags);
}

INTERPOSE int close_range(unsigned first, unsigned last, int flags)
{
	REAL_READY();
	pthread_once(&raw_once, resolve_raw);
	if (!(flags & CLOSE_RANGE_CLOEXEC) && first <= last)
		forget_range(first, last);
	return real_close_range ? real_close_range(first, last, flags) : close_range_raw(first, last, flags);
}

INTERPOSE void closefrom(int lowfd)
{
	REAL_READY();
	pthread_once(&raw_once, resolve_raw);
	if (lowfd < 0)
		lowfd = 0;
	forget_range((unsigned)lowfd, UINT_MAX);
	if (real_closefrom) {
		real_closefrom(lowfd);
		return;
	}
	for (int fd = lowfd; fd < FD_MAX; fd++) /* no closefrom in this libc */
		real_close(fd);
}

/* syscall: the calls above by number, as libc's wrappers do them; every
 * other one goes on to libc's with its six argument registers, as
 * syscall(2) takes them. */
INTERPOSE long syscall(long nr, ...)
{
	REAL_READY();
	pthread_once(&raw_once, resolve_raw);
	va_list ap;
	va_start(ap, nr);
	long a[6];
	for (int i = 0; i < 6; i++)
		a[i] = va_arg(ap, long);
	va_end(ap);
	switch (nr) {
	case SYS_close:
		return close((int)a[0]);
	case SYS_dup:
		return dup((int)a[0]);
	case SYS_dup2:
		return dup2((int)a[0], (int)a[1]);
	case SYS_dup3:
		return dup3((int)a[0], (int)a[1], (int)a[2]);
	case SYS_fcntl:
		return fcntl((int)a[0], (int)a[1], a[2]);
	case SYS_close_range:
		if (!((unsigned)a[2] & CLOSE_RANGE_CLOEXEC) && (unsigned)a[0] <= (unsigned)a[1])
			forget_range((unsigned)a[0], (unsigned)a[1]);
		break;
	case SYS_io_uring_setup:
		uring("syscall");
		break;
	}
	return real_syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
}

/* vfork is fork (see above). Called from the library, fork runs the
 * atfork handlers (fork.c) in both processes. */
INTERPOSE pid_t vfork(void)
{
	REAL_READY();
	return fork();
}

/* clone through libc: with CLONE_VM (not a thread), a spawn. The optional
 * arguments are passed on as clone(2)'s wrapper reads them (only when
 * flags ask for them). */
INTERPOSE int clone(int (*fn)(void *), void *stack, int flags, void *arg, ...)
{
	REAL_READY();
	pthread_once(&raw_once, resolve_raw);
	va_list ap;
	va_start(ap, arg);
	void *ptid = va_arg(ap, void *), *tls = va_arg(ap, void *), *ctid = va_arg(ap, void *);
	va_end(ap);
	if ((flags & CLONE_VM) && !(flags & CLONE_THREAD) && !vm_child())
		spawn_letgo(1);
	return real_clone(fn, stack, flags, arg, ptid, tls, ctid);
}
