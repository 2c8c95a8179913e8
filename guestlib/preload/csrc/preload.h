/* Private to libshunt-preload.so: the state its files share. The library
 * is the core (guestlib/c, shunt.h) plus these interposition files:
 *
 *   preload.c   libc symbols, configuration, logging, the fd table, the
 *               process's session with hostd
 *   socket.c    socket, connect, listen, accept; addresses and verdicts
 *   io.c        read/write, send/recv families, sendfile, shutdown
 *   wait.c      poll, select, and the helper threads that sleep on rings
 *   epoll.c     epoll
 *   lifetime.c  close, dup, fcntl, ioctl, fork, exec, exit
 *   guard.c     the safety net (bytes on a flow's kernel socket) and
 *               io_uring detection
 *
 * Locks: tab_mu (the fd table) and ep_mu (the epoll sets, epoll.c) are
 * never held together; ep_mu comes before a set's mu, and a set's mu is
 * dropped before another set's is taken (nesting). A flow's rmu and wmu
 * are taken alone, around ring copies and a blocking call's first spin
 * (io.c): never while it sleeps, so a second reader, a non-blocking call,
 * shutdown and close never wait behind a sleeper. free_mu (freed flows, lifetime.c) is a leaf. The core's
 * session lock is innermost: messages are sent under tab_mu, and the
 * session calls back without its lock. fork: lifetime.c's atfork handlers
 * take every lock above (ep_mu and the sets, tab_mu, free_mu; then the
 * core's take the session's), so the child starts with none held. */
#ifndef SHUNT_PRELOAD_H
#define SHUNT_PRELOAD_H

#define _GNU_SOURCE
#include "shunt.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* The interposed libc functions are the library's only exported symbols:
 * it is built with -fvisibility=hidden, so its own helpers and the core's
 * never bind to, or shadow, a program's symbols of the same name. */
#define INTERPOSE __attribute__((visibility("default")))

/* ---- libc: the next definition of each interposed symbol (preload.c) ---- */

/* REAL_READY makes sure the real_* pointers are set: it is the first line
 * of every interposed function (see resolve_real in preload.c). */
extern int real_ready;
void resolve_real(void);
#define REAL_READY()                                                      \
	do {                                                              \
		if (__builtin_expect(!__atomic_load_n(&real_ready, __ATOMIC_ACQUIRE), 0)) \
			resolve_real();                                   \
	} while (0)

#define REAL(name) extern __typeof__(name) *real_##name
REAL(socket); REAL(connect); REAL(listen); REAL(accept4); REAL(close);
REAL(read); REAL(write); REAL(recv); REAL(send); REAL(recvfrom); REAL(sendto);
REAL(recvmsg); REAL(sendmsg); REAL(readv); REAL(writev); REAL(shutdown);
REAL(dup); REAL(dup2); REAL(dup3); REAL(fcntl); REAL(ioctl); REAL(poll); REAL(ppoll);
REAL(epoll_create); REAL(epoll_create1); REAL(epoll_ctl);
REAL(epoll_wait); REAL(epoll_pwait); REAL(sendfile); REAL(execve); REAL(execvp); REAL(execvpe);
REAL(setsockopt); REAL(getsockopt); REAL(recvmmsg); REAL(sendmmsg); REAL(splice);
#undef REAL

/* ---- configuration (environment, read once at load) ---- */

extern int verbose;      /* SHUNT_VERBOSE: 1 a line per connection, 2 also per send and receive */
extern int disabled;     /* SHUNT_DISABLE=1 */
extern int64_t spin_ns;  /* SHUNT_SPIN_NS, SHUNT_WAIT: how long a blocking call spins before it sleeps */
extern pid_t my_pid;     /* getpid(), kept current across fork (a flow's owner is compared on every call) */

/* plog writes one line to stderr when verbose (-v). */
void plog(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

int64_t now_ns(void);

/* ---- the session with hostd: one per process ---- */

extern struct shunt_session *session;

/* ---- flows and the fd table ----
 *
 * The table covers fds below FD_MAX. A socket whose fd is FD_MAX or more
 * is never a candidate and stays on plain TCP (an accepted one lets its
 * peer's connect wait out hostd's pairing timeout, then both stay on
 * TCP). A dup of a fast-path fd that would land there fails (EMFILE, or
 * EBADF for dup2; lifetime.c), since its writes would reach the idle
 * kernel socket. Epoll sets of any fd number work (epoll.c). */
#define FD_MAX 65536

/* A fast-path flow, shared by the fds that dup made of one socket.
 *
 * Lifetime (lifetime.c): a call takes a reference (flow_get) for as long
 * as it is inside, and the fds hold one together; whoever drops the last
 * one releases the flow (FIN, CLOSE to hostd). So close() from another
 * thread never frees a flow under a sleeping call: it marks it closed and
 * wakes the sleepers, which return EBADF. Freed flows are kept for reuse,
 * never given back to malloc, and sf is only ever replaced whole, so the
 * lock-free readers of fds[] (poll, epoll) always find a struct flow whose
 * rings are mapped ring memory. */
struct flow {
	struct shunt_flow sf;
	int refs;       /* fds pointing here; guarded by tab_mu */
	int users;      /* atomic: 1 while refs > 0, plus 1 per call inside */
	pid_t owner;    /* the process that may use it (see fork) */
	int nonblock;
	int revoked;    /* REVOKE came */
	int finished;   /* FIN and CLOSE sent at exit (lifetime.c) */
	int closed;     /* atomic: its last fd was closed; calls still inside fail with EBADF */
	int rd_shut;    /* atomic: shutdown(SHUT_RD): reads return what is buffered, then 0 */
	int wr_shut;    /* atomic: shutdown(SHUT_WR): writes fail with EPIPE */
	/* atomic: the kernel socket's SO_RCVTIMEO and SO_SNDTIMEO in ns (0:
	 * none), read back from the kernel at READY and at each setsockopt */
	int64_t rcvtimeo, sndtimeo;
	int rst;        /* SO_LINGER {1, 0} at the last close: reset the rings, not FIN (lifetime.c) */
	pthread_mutex_t rmu, wmu; /* one reader and one writer at a time in the rings (SPSC); held while a call spins, not while it sleeps */
	struct flow *next_free;   /* on the free list; under free_mu */
};

/* kind[]: a TCP socket, a listener registered with hostd, a socket whose
 * non-blocking connect is under way (socket.c: settle). */
enum { FD_NONE, FD_TCP, FD_LISTENER, FD_PENDING };

extern struct flow *fds[FD_MAX];  /* written under tab_mu, read atomically (flow_of) */
extern uint8_t kind[FD_MAX];      /* under tab_mu, or by the thread that just got the fd */
extern uint8_t nonblk[FD_MAX];    /* O_NONBLOCK of candidate sockets, before a verdict */
extern pthread_mutex_t tab_mu;

static inline struct flow *flow_of(int fd)
{
	return fd >= 0 && fd < FD_MAX ? __atomic_load_n(&fds[fd], __ATOMIC_ACQUIRE) : NULL;
}

/* lifetime.c: flow_new gives an unpublished flow (NULL without memory),
 * flow_discard takes one back, flow_publish makes it fd's (one fd, one
 * reference). flow_get returns fd's flow with a reference for the caller,
 * or NULL; flow_put drops it (the last one releases the flow) and keeps
 * errno. */
struct flow *flow_new(void);
void flow_discard(struct flow *f);
void flow_publish(int fd, struct flow *f);
struct flow *flow_get(int fd);
void flow_put(struct flow *f);

/* ---- shared helpers ---- */

/* socket.c */
int local_of(int fd, struct shunt_addr *a);
int remote_of(int fd, struct shunt_addr *a);
/* settle: fd's non-blocking connect, if it was under way and has ended,
 * gets hostd's verdict now (connected) or stays on TCP (failed, the error
 * left in SO_ERROR). Every call that looks at a socket's flow calls it
 * first (flow_get, poll, epoll), so no byte moves before the verdict. */
void settle(int fd);
static inline int pending(int fd)
{
	return fd >= 0 && fd < FD_MAX && __atomic_load_n(&kind[fd], __ATOMIC_ACQUIRE) == FD_PENDING;
}

/* io.c: the ring side of recv and send, for any flags; flow_timeouts
 * reads fd's SO_RCVTIMEO and SO_SNDTIMEO back from the kernel into f. */
ssize_t fast_recv(struct flow *f, void *buf, size_t n, int flags);
ssize_t fast_send(struct flow *f, const void *buf, size_t n, int flags);
void flow_timeouts(int fd, struct flow *f);

/* wait.c: poll events a fast-path fd has for interest ev. */
short fast_events(struct flow *f, short ev);

/* A set of ring wait words to sleep on (the rings' waiting flags), any
 * number; seq is the kick count from before they were set (VM mode). */
struct arm {
	uint32_t **flag;
	int n, cap;
	int short_of_memory; /* some flags could not be recorded: sleep in slices */
	uint32_t seq;
	uint32_t *inline_flags[16];
};
void arm_init(struct arm *a);
void arm_add(struct arm *a, struct flow *f, int reader);
void arm_set(struct arm *a, uint32_t v);
void arm_free(struct arm *a);

/* The calling thread's helper (wait.c). block_start has its sleepers
 * sleep on the armed words and write its eventfd (helper_efd) when one is
 * woken; it returns the timeout to block in the kernel with (ns, < 0
 * none): ns, or a re-check period when not every word has a sleeper.
 * block_stop ends the sleep. h is NULL when no helper is available (then
 * every wait is sliced). */
struct helper;
struct helper *helper(void);
int helper_efd(struct helper *h);
int64_t block_start(struct helper *h, struct arm *a, int64_t ns);
void block_stop(struct helper *h);
int remaining_ms(int64_t deadline);
void wait_after_fork(void);

/* epoll.c: drop fd from every set, and forget the set if fd is one. */
void ep_forget(int fd, int was_fast);
int ep_is_set(int fd);
/* epoll.c: its locks across fork (lifetime.c's atfork handlers). */
enum { FORK_PREPARE, FORK_PARENT, FORK_CHILD };
void ep_fork(int phase);

/* lifetime.c */
void lifetime_init(void);

/* guard.c: guard watches fd, a new flow's kernel socket: bytes arriving
 * there mean the program wrote past the library (a raw syscall), and the
 * flow is ended with ECONNRESET instead of hanging. uring_seen is set once
 * the process sets up io_uring: new connections stay on TCP. */
void guard(int fd);
void guard_after_fork(void);
extern int uring_seen;

#endif
