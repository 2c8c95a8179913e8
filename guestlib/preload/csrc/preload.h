/* Private to libshunt-preload.so: the state its files share. The library
 * is the core (guestlib/c, shunt.h) plus these interposition files:
 *
 *   preload.c   libc symbols, configuration, logging, the fd table, the
 *               process's session with hostd
 *   socket.c    socket, connect, listen, accept; addresses
 *   conn.c      connections and hostd: READY, DOWN, LEFT, CLOSE
 *   open.c      OPEN after the open delay; the request-id index
 *   path.c      a connection's reader and writer: TCP, rings, switching
 *   aside.c     ring bytes the reader keeps in its own memory to leave a
 *               ring early: drained at DOWN, or held ahead of TCP bytes
 *   io.c        read/write, send/recv families, sendfile, splice, shutdown
 *   wait.c      poll, select, and the helper threads that sleep on rings
 *   epoll.c     epoll
 *   lifetime.c  close, dup, fcntl, ioctl, exec, exit
 *   raw.c       what changes an fd past those: syscall(SYS_close, ...),
 *               close_range, closefrom; vfork; children sharing memory
 *   resume.c    RESUME (relayed flows): resend ring bytes on TCP, or reset
 *   fork.c      fork: which connections each process keeps
 *   share.c     a young connection several processes hold after a fork
 *   guard.c     the safety net (bytes on a flow's kernel socket) and
 *               io_uring detection
 *
 * Locks, in the one order they may be taken (an arrow: the left one may
 * be held while the right one is taken, never the other way):
 *
 *   settle_mu -> ep_mu -> a set's mu -> tab_mu -> a flow's rmu -> its wmu
 *             -> idx_mu -> free_mu, rings_mu, guard_mu -> the session's lock
 *
 * settle_mu (socket.c) is first: a settle makes the connection (conn_open:
 * tab_mu, idx_mu, and the session when OPEN goes at once). It is taken
 * only for a socket whose non-blocking connect is under way, by the first
 * call that looks at it: getsockopt, poll, epoll and every I/O call settle
 * first. So no code that holds any lock after it may call an interposed
 * function (the library's internal lookups use real_*): the leaver once
 * held tab_mu (tuple, open.c) and called the interposed getsockopt on a
 * socket whose settle was not done yet, and waited for settle_mu while the
 * next settle held it and waited for tab_mu (pgbench -C hung;
 * TestPreloadEdgeServers settlestorm). ep_mu comes before a set's mu, and
 * a set's mu is dropped before another set's is taken (nesting). tab_mu
 * (the fd table) and ep_mu are held together only by fork.c's prepare
 * handler, in the order ep_mu, every set's mu, then tab_mu: no other path
 * may take them the other way round (forget, fork_parent and
 * conn_announce let tab_mu go before any epoll call). A flow's rmu and wmu
 * are taken around one step of a read or write (path.c) and a ring wait's
 * first spin: never while a call sleeps or blocks in the kernel, so a
 * second reader, a non-blocking call, shutdown and close never wait behind
 * a sleeper. Both are taken only in that order (rings_done, conn_end),
 * after tab_mu when both are held (fork). idx_mu (open.c: the open queue
 * and the request-id index) comes after them; free_mu (freed flows,
 * lifetime.c), rings_mu (conn.c) and guard_mu (guard.c) are leaves but for
 * the session. resume.c takes tab_mu alone (a dup of a connection's fd)
 * and, in the leaver, tab_mu then a connection's wmu (a resend). The core's session lock is innermost: messages are sent
 * under tab_mu, a flow's wmu or idx_mu, and the session calls back without
 * its lock. fork: fork.c's atfork handlers take every lock above (ep_mu
 * and the sets, tab_mu, each connection's rmu and wmu, idx_mu, free_mu,
 * rings_mu; then the core's
 * take the session's), so the child starts with none held. */
#ifndef SHUNT_PRELOAD_H
#define SHUNT_PRELOAD_H

#define _GNU_SOURCE
#include "shunt.h"
#include "sys.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
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
REAL(posix_spawn); REAL(posix_spawnp); REAL(system); REAL(popen);
#undef REAL

/* ---- configuration (environment, read once at load) ---- */

extern int verbose;      /* SHUNT_VERBOSE: 1 a line per connection, 2 also per send and receive */
extern int disabled;     /* SHUNT_DISABLE=1 */
extern int64_t spin_ns;  /* SHUNT_SPIN_NS, SHUNT_WAIT: how long a blocking call spins before it sleeps */
extern pid_t my_pid;     /* getpid(), kept current across fork (a flow's owner is compared on every call) */
extern int64_t open_delay_ns; /* SHUNT_OPEN_DELAY_MS (default 5, 0: at once): how long a connection lives before OPEN */
extern int open_delay_adapt;  /* SHUNT_OPEN_DELAY_ADAPT=0: the delay stays open_delay_ns (open.c, open_lived) */

extern int loopback;     /* SHUNT_TEST_LOOPBACK=1: loopback connections are candidates (tests with a fake hostd) */
extern int stats;        /* SHUNT_STATS=1: each connection's bytes per path at its close */
extern int64_t test_stash_delay_ns; /* SHUNT_TEST_STASH_DELAY_US: a reader on TCP with a ring that has not
				     * started sleeps this long between its check and its read (tests) */
extern int64_t test_settle_delay_ns; /* SHUNT_TEST_SETTLE_DELAY_US: a settle sleeps this long after it made the
				      * connection, before it lets settle_mu go (tests: the lock-order window) */

/* plog writes one line to stderr when verbose (-v); pstat always. */
void plog(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void pstat(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

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

/* A connection: a kernel TCP socket that hostd was told of (OPEN), shared
 * by the fds that dup made of it. Its bytes go over TCP or through a ring
 * pair, per direction, switching at exact stream offsets as hostd's READY
 * and DOWN say (docs/DESIGN.md, path switching; path.c): every byte the
 * program reads or writes is counted, so that the reader knows where a
 * ring's stretch starts and the writer where to start one.
 *
 * Lifetime (lifetime.c): a call takes a reference (flow_get) for as long
 * as it is inside, and the fds hold one together; whoever drops the last
 * one releases the connection (leave the rings, CLOSE to hostd). So
 * close() from another thread never frees a flow under a sleeping call:
 * it marks it closed and wakes the sleepers, which return EBADF. Freed
 * flows and ring pairs are kept for reuse, never given back to malloc, so
 * the lock-free readers of fds[] (poll, epoll) always find a struct flow,
 * and a struct rings whose rings were ring memory. */
struct rings {
	struct shunt_flow sf;
	int wleft;      /* this end's writer left (under wmu) */
	int rleft;      /* this end's reader left (under rmu) */
	int left;       /* atomic: 1 writer left, 2 reader left: LEFT when both */
	int down;       /* atomic: DOWN came */
	int peer_gone;  /* atomic: DOWN(peer-gone): the reader drains and leaves without the writer's mark */
	int resumed;    /* atomic: the DOWN is a RESUME (resume.c): the writer resends from resume_at */
	uint64_t resume_at;
	int resume_fd;  /* while RESUME is handled: a dup of the connection's socket, to reset it (or -1) */
	int relayed;    /* READY's Relayed: the other end is the relay to a peer host (resume.c, resume_down) */
	/* A bridge writes the read ring: relayed, or a vsock stretch's
	 * (stretch.c). The other end's FIN and TCP bytes outrun the ring bytes
	 * the bridges carry, so a kernel EOF proves no writer died (guard.c),
	 * and the reader holds it for the ring (path.c, relay_holds). */
	int bridged;
	struct rings *next_free;
};

struct flow {
	int refs;       /* fds pointing here; guarded by tab_mu */
	int users;      /* atomic: 1 while refs > 0, plus 1 per call inside */
	pid_t owner;    /* the process that may use it (see fork) */
	int nonblock;
	int finished;   /* left and CLOSE sent at exit (lifetime.c) */
	int closed;     /* atomic: its last fd was closed; calls still inside fail with EBADF */
	int rd_shut;    /* atomic: shutdown(SHUT_RD) */
	int wr_shut;    /* atomic: shutdown(SHUT_WR): writes fail with EPIPE */
	/* atomic: the kernel socket's SO_RCVTIMEO and SO_SNDTIMEO in ns (0:
	 * none), read back from the kernel at OPEN and at each setsockopt */
	int64_t rcvtimeo, sndtimeo;
	int fd;         /* the fd it was opened on (logs, and hostd's callbacks) */
	uint32_t req;   /* its request id (0 until OPEN): names it to hostd for its whole life; set under wmu and idx_mu */
	int told;       /* hostd was sent its OPEN (or REATTACH): it is owed a CLOSE */
	int64_t told_at; /* when this process sent its OPEN (0: not sent): the open delay adapts (open.c, open_lived) */
	/* The open delay and the request-id index (open.c), under idx_mu:
	 * when OPEN is due (0: not waiting), the queue's links, and the
	 * index's chain (in it from OPEN to release). */
	int64_t open_at;
	struct flow *onext, *oprev, *inext;
	/* The tuple, for OPEN: looked up when OPEN goes (a connection closed
	 * sooner costs no system call for it), on f->fd or a surviving dup
	 * (open.c, tuple); remote may be known from connect or accept. */
	struct shunt_addr local, remote;
	int have_remote, have_tuple; /* remote is known; so are local and the timeouts (once: a shared connection asks again) */
	int dropped;    /* under rmu and wmu: a fork let it go to the kernel (fork.c): never OPENed, never on rings */
	/* fork.c, from the prepare handler to the parent's or child's: to be
	 * let go, its locks taken; what the parent owes hostd */
	int fork_drop, fork_held, fork_close;
	struct rings *fork_rg;
	struct flow *fork_next;
	/* share.c: a connection kept by several processes after a fork, on
	 * TCP until one of them is its only holder (NULL: this process's
	 * alone); this process noted its I/O there; OPEN attempts since the
	 * fork; fork.c: to be shared at this fork (prepare to parent/child) */
	struct share *share;
	int share_io, share_tries, fork_share;
	/* lifetime.c, across an exec that would close every fd of a shared
	 * connection: the slot this process left for it (share_exec) */
	int exec_leave;
	struct share *exec_share;
	uint8_t role;   /* SHUNT_ROLE_ACTIVE (it connected) or PASSIVE, for OPEN again */
	struct rings *rg; /* atomic: the ring pair READY gave, until both directions left it */
	/* A futex word for events that sleepers on the kernel socket must see
	 * (READY, DOWN, close, shutdown): they arm it as a ring's wait word
	 * (wait.c) and flow_wake clears it and wakes them. */
	uint32_t ev;
	int ev_armed;   /* atomic: a sleeper armed ev once (arm_flow): flow_wake must wake from now on */
	/* The reader, under rmu (path.c). */
	uint64_t roff;  /* stream offset of the next byte for the program */
	int rring;      /* reading the ring */
	uint8_t *stash; /* TCP bytes read past a ring's start, for after its stretch */
	size_t shead, slen, scap;
	size_t sring;   /* how many of the stash's first bytes came from a ring (a drain, an ahead): counted as ring bytes */
	int seof;       /* a kernel EOF (1) or error (-errno) seen while a ring held a stretch */
	/* A ring's stretch copied out while TCP bytes before its start were
	 * still due (aside.c, reader_ahead): alen bytes at stream offset
	 * ahead_at, at most a ring's capacity, one at a time. Every read of
	 * the kernel stops at ahead_at meanwhile, and there they move to the
	 * front of the stash (path.c). alen is read atomically by poll and
	 * epoll: the bytes count as readable only once roff reached them. */
	uint8_t *ahead;
	size_t alen;
	uint64_t ahead_at;
	int rblocked;   /* readers asleep in a blocking kernel recv (no rings then) */
	int64_t rhold;  /* a relayed ring's reader holds a kernel EOF or error until this (ns; 0: none; path.c) */
	int attach_due; /* READY came while rblocked: the reader marks the ring attached when back */
	/* The writer, under wmu. */
	uint64_t sent;  /* stream offset of the next byte written */
	int wring;      /* writing the ring */
	int winflight;  /* kernel sends under way without wmu: no ring starts meanwhile */
	uint64_t wstart, wtail0; /* where the writer started its ring: stream offset, ring bytes written before */
	/* RESUME's ring bytes to send on TCP before any new byte (resume.c);
	 * no ring starts while they wait. resending: rs_len > 0 (atomic, for
	 * the leaver); rst: RESUME, or rings found reset at a DOWN (conn.c),
	 * reset the connection (atomic): reads and
	 * writes fail with ECONNRESET. */
	uint8_t *resend;
	size_t rs_head, rs_len, rs_cap;
	uint64_t resent;
	int resending, rst;
	/* Bytes per path, for SHUNT_STATS (0 TCP, 1 ring); under rmu / wmu. */
	uint64_t rbytes[2], wbytes[2];
	unsigned rswitch, wswitch, stashed; /* moves to a ring per direction; stash uses */
	unsigned aheads;                    /* stretches copied out ahead of their TCP bytes (reader_ahead) */
	int stats_said;                     /* SHUNT_STATS line out (lifetime.c) */
	pthread_mutex_t rmu, wmu; /* one reader and one writer at a time (SPSC rings, stream offsets); never held while a call sleeps */
	struct flow *next_free;   /* on the free list; under free_mu */
};

/* kind[]: a TCP socket, a listener registered with hostd, a socket whose
 * non-blocking connect is under way (socket.c: settle), a socket inside
 * connect() (socket.c), and a socket that is the kernel's for good: a
 * fork or a spawn let its connection go, or found its connect under way
 * (fork.c). The library leaves an FD_KERNEL socket alone (connect,
 * settle, listen, accept, OPEN) until its close; dup copies the kind. */
enum { FD_NONE, FD_TCP, FD_LISTENER, FD_PENDING, FD_CONNECTING, FD_KERNEL };

extern struct flow *fds[FD_MAX];  /* written under tab_mu, read atomically (flow_of) */
extern uint8_t kind[FD_MAX];      /* under tab_mu, or by the thread that just got the fd */
extern uint8_t nonblk[FD_MAX];    /* O_NONBLOCK of candidate sockets, before they are connections */
extern uint8_t linherited[FD_MAX]; /* a listener a fork child inherited: not yet in its own session (socket.c) */
extern pthread_mutex_t tab_mu;
/* fd_gen counts the closes of each fd number (forget, under tab_mu): a
 * settle that found a socket pending makes it a connection only if the
 * number was not closed and reused meanwhile (conn_open's fdg). */
extern uint32_t fd_gen[FD_MAX];

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
void flows_fork(int phase);
void flow_publish(int fd, struct flow *f);
struct flow *flow_get(int fd);
void flow_put(struct flow *f);
/* flow_hold takes a reference to f if it is not being released: 1, or 0. */
int flow_hold(struct flow *f);

/* ---- shared helpers ---- */

/* socket.c */
int local_of(int fd, struct shunt_addr *a);
void unlisten(int fd);
int remote_of(int fd, struct shunt_addr *a);
/* settle: fd's non-blocking connect, if it was under way and has ended,
 * becomes a connection (OPEN, nothing waited for) or stays plain (failed,
 * the error left in SO_ERROR). Every call that looks at a socket's flow
 * calls it first (flow_get, poll, epoll). */
void settle(int fd);
void settle_after_fork(void);
static inline int pending(int fd)
{
	return fd >= 0 && fd < FD_MAX && __atomic_load_n(&kind[fd], __ATOMIC_ACQUIRE) == FD_PENDING;
}

/* open.c: conn_open makes fd a connection and sends OPEN (role active or
 * passive) once it has lived open_delay_ns (remote: the peer's address if
 * the caller knows it, else NULL); gen is fork_gen from before
 * the kernel call that made the connection (connect, accept): if a fork
 * came in between, the child holds a copy the library never saw, so the
 * connection is the kernel's (FD_KERNEL) in this process too; fdg, if not
 * -1, is fd_gen[fd] from when the caller saw the socket (settle): if fd
 * was closed since, it is another socket now, and nothing is made of it
 * (a stale settle once gave a blocking socket a non-blocking flow: its
 * reads said EAGAIN); by_req finds a connection
 * by request id with a reference (flow_put), or NULL; open_forget takes f
 * out of the open queue and the index (at release, and when a fork lets
 * it go). open_due sends the OPENs that are due and returns when the next
 * one is (ns, monotonic; 0: none): the leaver thread calls it. */
void conn_open(int fd, uint8_t role, const char *who, unsigned gen, const struct shunt_addr *remote, long fdg);
struct flow *by_req(uint32_t req);
void open_forget(struct flow *f);
int64_t open_due(void);
void open_fork(int phase);
/* conn.c: hostd's side of connections: the session's callbacks attach
 * READY's rings, and DOWN makes both directions leave them. leaver_start
 * makes sure this process's leaver thread runs (0, or -1), leaver_wake
 * wakes it to look at the open queue again. */
int leaver_start(void);
void leaver_wake(void);
void conn_fork(int phase);
void conn_cb(void *arg, const struct shunt_msg *m);
void conn_revoked(void *arg, const struct shunt_msg *m);
int conn_holds(void *arg);
void conn_announce(void *arg, struct shunt_session *s);
/* flow_wake wakes every sleeper that armed f->ev. */
void flow_wake(struct flow *f);
/* writer_leave makes f's writer leave its ring (wmu held); reader_leave
 * the reader (rmu held). Each returns the rings to give back with
 * rings_done after the lock is let go (both directions left), or NULL. */
struct rings *writer_leave(struct flow *f, struct rings *rg);
/* A vsock stretch's last bytes to the host after the writer left (conn.c). */
void stretch_drain(struct rings *rg);
/* conn_down is hostd's DOWN for f; leaver_kick has the leaver look at
 * the connections again (a direction left behind, a resend waiting). */
void conn_down(struct flow *f, const struct shunt_msg *m);
void leaver_kick(void);
/* resume.c: RESUME for f (from conn_cb); resume_writer computes the
 * resend as the writer leaves (wmu held); resend_step sends what the
 * kernel takes now (wmu held): 0 all sent, -EAGAIN, or -errno;
 * resend_wait sleeps until fd is writable (0, EAGAIN, EINTR); resend_idle
 * is the leaver's: how many resends still wait. */
void resume(struct flow *f, const struct shunt_msg *m);
int resume_down(struct flow *f, const struct shunt_msg *m);
void resume_writer(struct flow *f, struct rings *rg, int started);
ssize_t resend_step(struct flow *f, int fd);
int resend_wait(struct flow *f, int fd, int64_t left);
int resend_idle(void);
/* resend_close: before the kernel close of a connection's last fd, what
 * waits of its resend goes out (bounded; lifetime.c, forget). */
void resend_close(struct flow *f, int fd);
struct rings *reader_leave(struct flow *f, struct rings *rg);
/* aside.c, rmu held. reader_drain moves what r holds, its writer left or
 * gone, to the front of f's stash, where the reader finds it before any
 * later TCP byte: 0, or -1 without memory or with the ring reset (it
 * stays then). reader_ahead: f's reader is on TCP before rg's ring's start
 * (start > f->roff) and the ring's writer left it or is gone: it copies
 * the ring's stretch out to f->ahead and leaves the ring: 0 (*done: the
 * rings to give back, or NULL), or -1 when it stays (no memory, a reset
 * ring, or a stretch already held ahead: then it waits for TCP).
 * ahead_lim: how many bytes the reader may take from TCP before a stretch
 * held ahead (SIZE_MAX: none is). ahead_due: once the TCP stream reached
 * it, its bytes go to the front of the stash: 0, or -1 without memory. */
int reader_drain(struct flow *f, struct shunt_ring *r);
int reader_ahead(struct flow *f, struct rings *rg, uint64_t start, struct rings **done);
size_t ahead_lim(struct flow *f);
int ahead_due(struct flow *f);
void rings_done(struct flow *f, struct rings *rg);
void rings_free(struct rings *rg);
/* conn_end: the last fd closed: leave the rings, CLOSE to hostd. */
void conn_end(struct flow *f);

/* path.c: the reader and the writer of a connection, for any flags;
 * flow_timeouts reads fd's SO_RCVTIMEO and SO_SNDTIMEO back from the
 * kernel into f. */
ssize_t conn_recv(struct flow *f, int fd, void *buf, size_t n, int flags, int64_t *deadline);
/* kernel_peek peeks at the socket's next byte without blocking (rmu
 * held): 1, 0 at EOF, or -1 with errno (EAGAIN: nothing yet). The kernel
 * reports an RST once, and a peek uses that up too: the error is kept in
 * f->seof, so the program's read still gets ECONNRESET. */
ssize_t kernel_peek(struct flow *f, int fd);
ssize_t conn_send(struct flow *f, int fd, const void *buf, size_t n, int flags, int64_t *deadline);
ssize_t conn_buffered(struct flow *f, int fd);
/* A kernel call that writes to the connection's socket itself (sendfile,
 * splice): conn_tcp_begin returns 1 if the writer is on TCP, and then
 * conn_tcp_end(f, bytes written) must follow; 0 if it is on the ring. */
int conn_tcp_begin(struct flow *f); /* 0 too while a RESUME's resend waits (conn_send), or after shutdown(SHUT_WR) */
/* conn_write_shut: after shutdown(SHUT_WR), 1 with EPIPE (and SIGPIPE
 * unless MSG_NOSIGNAL), before a copying path takes anything from its
 * source; the library answers, since the kernel's FIN may not be out yet. */
int conn_write_shut(struct flow *f, int flags);
void conn_tcp_end(struct flow *f, ssize_t k);
void flow_timeouts(int fd, struct flow *f);

/* wait.c: poll events of a connection for interest ev, given the kernel
 * socket's revents kev (for the events conn_kernel_events asks of it;
 * -1: ask the kernel now). */
short fast_events(struct flow *f, int fd, short ev, short kev);
short conn_kernel_events(struct flow *f, short ev);

/* A set of ring wait words to sleep on (the rings' waiting flags), any
 * number; seq is the kick count from before they were set (VM mode). */
struct arm {
	uint32_t **flag;
	int n, cap;
	int short_of_memory; /* some flags could not be recorded: sleep in slices */
	uint32_t seq;
	uint32_t *inline_flags[16];
	/* In VM mode the set sleeper sleeps on the kick count, not on flag[]
	 * (BAR memory); the words of vsock stretches' rings (local: their
	 * peer, shunt-vstretchd, wakes them by futex) are added to its sleep
	 * too, the first LOCAL_MAX of them (the rest are seen within a kick
	 * sleep's bound). */
#define LOCAL_MAX 16
	uint32_t *local[LOCAL_MAX];
	int nlocal;
};
void arm_init(struct arm *a);
void arm_add(struct arm *a, struct flow *f, int reader);
void arm_word(struct arm *a, uint32_t *w);
/* arm_flow arms f's event word (f->ev), noting that it has a sleeper */
void arm_flow(struct arm *a, struct flow *f);
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
/* helper_id numbers the process's helpers from 1 (an eventfd's number may
 * be reused by a later helper; the pair (efd, id) is not). wake_efd: the
 * calling thread's eventfd (its helper's), even where futex_waitv is
 * missing, or -1, and its helper's id: epoll.c kicks a waiter through it. */
unsigned helper_id(struct helper *h);
int wake_efd(unsigned *id);
int64_t block_start(struct helper *h, struct arm *a, int64_t ns);
void block_stop(struct helper *h);
int remaining_ms(int64_t deadline);
/* sleep.c: a blocking call sleeps until fd has events, a word of a (set to
 * 1 by arm_set) is woken, or timeout_ns (< 0: none): 0, or EINTR when a
 * signal handler must end the call (the kernel's choice, as for recv). */
int conn_sleep(int fd, short events, struct arm *a, int64_t timeout_ns);
void sleep_after_fork(void);
void wait_after_fork(void);

/* epoll.c: drop fd from every set, and forget the set if fd is one.
 * was_fast: 1 fd was a connection's, 2 one other processes may hold
 * since a fork (share.c): then a set a fork may have shared keeps its
 * kernel socket, as the kernel's close would. */
void ep_forget(int fd, int was_fast);
int ep_is_set(int fd);
/* epoll.c: fd's interests become the kernel's (fork.c lets its connection
 * go); kernel: this process changes the shared kernel set. */
void ep_letgo(int fd, int kernel);
/* epoll.c: its locks across fork (lifetime.c's atfork handlers). */
enum { FORK_PREPARE, FORK_PARENT, FORK_CHILD };
void ep_fork(int phase);

/* fork.c: the atfork handlers, registered once the session is made.
 * fork_gen counts forks (under tab_mu; read atomically): conn_open's gen.
 * letgo_exec lets f go before exec if it has carried no ring byte (1;
 * CLOSE to hostd if OPEN went out), else 0: it is on the rings. */
void fork_init(void);
extern unsigned fork_gen;
int letgo_exec(struct flow *f);

/* share.c: share_prepare counts a child about to be born as a holder of
 * f (the prepare handler; a slot is made at the first fork): 0, or -1 if
 * that cannot be recorded (then f is let go). share_child makes the child
 * a holder, share_io notes this process's I/O on f (every reader and
 * writer step calls it), share_alone says whether this process may OPEN
 * f: 1 it is the only holder and no other did I/O since the fork, 0 not
 * yet (another holds it), -1 never (another used it). share_leave takes
 * this process out (its last close, exit, or taking f for its own);
 * share_poison bars everyone (an exec or a let-go gives the kernel
 * socket to a program the library cannot see). */
int share_prepare(struct flow *f);
void share_child(struct flow *f);
void share_note_io(struct flow *f);
static inline void share_io(struct flow *f)
{
	if (__builtin_expect(f->share != NULL, 0))
		share_note_io(f);
}
int share_alone(struct flow *f);
void share_leave(struct flow *f);
void share_poison(struct flow *f);
/* share_exec takes this process out of f's slot before an exec that
 * closes every fd of f (the new image will not hold it), remembering the
 * slot; share_exec_failed puts it back if the exec failed, poisoned (an
 * other process may have taken f meanwhile: the safety net then ends it) */
void share_exec(struct flow *f);
void share_exec_failed(struct flow *f);
/* open.c: open_requeue queues f's OPEN again for now + ns (f not queued) */
void open_requeue(struct flow *f, int64_t ns);
/* open_lived: f, which was offered to hostd, is ending: the open delay
 * adapts to how long it lived after its OPEN (open.c). */
void open_lived(struct flow *f);

/* guard.c: guard watches fd, a new flow's kernel socket: bytes arriving
 * there mean the program wrote past the library (a raw syscall), and the
 * flow is ended with ECONNRESET instead of hanging. uring_seen is set once
 * the process sets up io_uring: new connections stay on TCP. */
void guard(int fd);
/* guard_forget takes fd out of the watcher's set: before every kernel
 * close of an fd (close, dup2 and dup3 onto it), see guard.c. */
void guard_forget(int fd);
void guard_after_fork(void);
extern int uring_seen;
/* uring marks the process as an io_uring user (how: which call said so). */
void uring(const char *how);

/* lifetime.c: forget drops fd from the library's state (flow reference,
 * listener, epoll interests, guard) before its kernel close. */
void forget(int fd);
/* raw.c: vm_child says whether the caller is a child that shares this
 * process's memory (clone(CLONE_VM) without fork's handlers): its calls
 * go straight to libc and never change the parent's state. */
int vm_child(void);
/* fork.c: spawn_letgo lets go, before a spawn, the young connections the
 * child may inherit (any_fd: every one, else those without FD_CLOEXEC). */
void spawn_letgo(int any_fd);
/* epoll.c: ep_maybe_set says, without a lock, whether fd may be a set
 * the library knows (forget decides under the locks); ep_high_in lists
 * the sets at FD_MAX or above within [first, last] (up to max). */
int ep_maybe_set(int fd);
int ep_high_in(unsigned first, unsigned last, int *out, int max);

#endif
