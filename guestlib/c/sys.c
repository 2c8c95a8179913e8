/* The core's system-call layer (sys.h): the syscall instruction itself,
 * and the futex helpers. No libc wrapper that a preload library
 * interposes is called here. */
#include "sys.h"

#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>

#if defined(__x86_64__)
static inline long raw6(long n, long a, long b, long c, long d, long e, long f)
{
	register long r10 __asm__("r10") = d, r8 __asm__("r8") = e, r9 __asm__("r9") = f;
	long ret;
	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
			 : "rcx", "r11", "memory");
	return ret;
}
#elif defined(__aarch64__)
static inline long raw6(long n, long a, long b, long c, long d, long e, long f)
{
	register long x8 __asm__("x8") = n, x0 __asm__("x0") = a, x1 __asm__("x1") = b, x2 __asm__("x2") = c,
						  x3 __asm__("x3") = d, x4 __asm__("x4") = e, x5 __asm__("x5") = f;
	__asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory", "cc");
	return x0;
}
#else
#error "sys.c: the syscall instruction of this architecture is not written yet (x86_64 and aarch64 are)"
#endif

long shunt_sys(long nr, long a, long b, long c, long d, long e, long f)
{
	long r = raw6(nr, a, b, c, d, e, f);
	if (r < 0 && r > -4096) {
		errno = (int)-r;
		return -1;
	}
	return r;
}

extern int __sigaction(int sig, const struct sigaction *act, struct sigaction *old);

int sys_sigaction(int sig, const struct sigaction *act, struct sigaction *old) { return __sigaction(sig, act, old); }

int sys_poll1(int fd, short events, int timeout_ms)
{
	struct pollfd p = {.fd = fd, .events = events};
	struct timespec ts = {timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
	return (int)shunt_sys(SYS_ppoll, (long)&p, 1, timeout_ms < 0 ? 0 : (long)&ts, 0, 8, 0);
}

int shunt_futex_wait(uint32_t *w, uint32_t val, const struct timespec *rel)
{
	return (int)shunt_sys(SYS_futex, (long)w, FUTEX_WAIT, val, (long)rel, 0, 0);
}

int shunt_futex_wake(uint32_t *w, int n) { return (int)shunt_sys(SYS_futex, (long)w, FUTEX_WAKE, n, 0, 0, 0); }

static int no_waitv; /* atomic: the kernel has no futex_waitv (Linux < 5.16) */

int shunt_have_waitv(void) { return !__atomic_load_n(&no_waitv, __ATOMIC_RELAXED); }

int shunt_futex_waitv(struct shunt_waitv *v, unsigned n, const struct timespec *abs)
{
	if (__atomic_load_n(&no_waitv, __ATOMIC_RELAXED))
		return errno = ENOSYS, -1;
	int r = (int)shunt_sys(SYS_futex_waitv, (long)v, n, 0, (long)abs, CLOCK_MONOTONIC, 0);
	if (r < 0 && errno == ENOSYS)
		__atomic_store_n(&no_waitv, 1, __ATOMIC_RELAXED);
	return r;
}
