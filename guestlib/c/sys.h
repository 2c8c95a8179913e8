/* The core's system-call layer (sys.c): system calls made with the
 * syscall instruction itself, so that no interposition catches them, and
 * the one set of futex helpers for the core and the libraries built on it.
 *
 * The preload library (guestlib/preload) interposes libc's socket, I/O and
 * syscall() wrappers; the core runs inside it and must not reach its own
 * wrappers (a control socket taken for a program's fd, a lock of the
 * library's taken under the session's). So the core calls none of them:
 * every system call that an LD_PRELOAD library may interpose goes through
 * shunt_sys, and `make check` (core-syms) checks with nm that the core's
 * objects call no symbol the preload library defines. */
#ifndef SHUNT_SYS_H
#define SHUNT_SYS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif

/* shunt_sys makes system call nr with up to six arguments: its result, or
 * -1 with errno set, as syscall(2). */
long shunt_sys(long nr, long a, long b, long c, long d, long e, long f);

static inline ssize_t sys_read(int fd, void *buf, size_t n) { return shunt_sys(SYS_read, fd, (long)buf, (long)n, 0, 0, 0); }
static inline ssize_t sys_write(int fd, const void *buf, size_t n) { return shunt_sys(SYS_write, fd, (long)buf, (long)n, 0, 0, 0); }
static inline int sys_close(int fd) { return (int)shunt_sys(SYS_close, fd, 0, 0, 0, 0, 0); }
static inline int sys_socket(int domain, int type, int proto) { return (int)shunt_sys(SYS_socket, domain, type, proto, 0, 0, 0); }
static inline int sys_connect(int fd, const struct sockaddr *a, socklen_t len)
{
	return (int)shunt_sys(SYS_connect, fd, (long)a, (long)len, 0, 0, 0);
}
static inline ssize_t sys_recvmsg(int fd, struct msghdr *msg, int flags) { return shunt_sys(SYS_recvmsg, fd, (long)msg, flags, 0, 0, 0); }
static inline ssize_t sys_send(int fd, const void *buf, size_t n, int flags)
{
	return shunt_sys(SYS_sendto, fd, (long)buf, (long)n, flags, 0, 0);
}
static inline int sys_setsockopt(int fd, int level, int name, const void *val, socklen_t len)
{
	return (int)shunt_sys(SYS_setsockopt, fd, level, name, (long)val, (long)len, 0);
}
static inline int sys_shutdown(int fd, int how) { return (int)shunt_sys(SYS_shutdown, fd, how, 0, 0, 0, 0); }

/* sys_sigaction is sigaction(2) by glibc's other name for it, which the
 * preload library's sigaction (SIGBUS, sigbus.c) does not catch. */
struct sigaction;
int sys_sigaction(int sig, const struct sigaction *act, struct sigaction *old);

/* sys_poll1 is poll(2) on one fd; timeout_ms < 0 waits without bound. */
int sys_poll1(int fd, short events, int timeout_ms);

/* Futexes. Never FUTEX_PRIVATE: the words are shared with other
 * processes (rings, records) or are the process's own (then shared costs
 * nothing but a hash). shunt_futex_wait sleeps while *w == val, for at
 * most rel (NULL: no bound); shunt_futex_wake wakes up to n sleepers. */
int shunt_futex_wait(uint32_t *w, uint32_t val, const struct timespec *rel);
int shunt_futex_wake(uint32_t *w, int n);

/* struct futex_waitv (Linux 5.16+): several words in one sleep. */
struct shunt_waitv {
	uint64_t val, uaddr;
	uint32_t flags, reserved;
};
#define SHUNT_WAITV_MAX 128 /* FUTEX_WAITV_MAX: words per call */
#define SHUNT_FUTEX_32  2   /* FUTEX_32: a 32-bit word */

static inline struct shunt_waitv shunt_waitv_word(const uint32_t *w, uint32_t val)
{
	return (struct shunt_waitv){.val = val, .uaddr = (uintptr_t)w, .flags = SHUNT_FUTEX_32};
}

/* shunt_futex_waitv sleeps while every word holds its val, until abs
 * (CLOCK_MONOTONIC; NULL: no bound): 0 or the index woken, or -1 with
 * errno (ENOSYS on a kernel without it, remembered: shunt_have_waitv then
 * says 0 and every later call fails at once). The kernel restarts it after
 * an SA_RESTART handler, unlike a timed FUTEX_WAIT (the kick and socket
 * sleeps choose between them by that). */
int shunt_futex_waitv(struct shunt_waitv *v, unsigned n, const struct timespec *abs);
int shunt_have_waitv(void);

#endif
