/* The safety net, and io_uring.
 *
 * A connection's bytes may go over its kernel socket (TCP stretches,
 * before and after the rings) or through a ring; the library keeps them
 * in order by counting them. A write that bypasses the library (a raw
 * syscall, an io_uring submission, a glibc-internal write) is not counted:
 * on the peer it lands in the middle of the stream. What can be seen of it
 * is seen here and by the reader (path.c), and the connection is reset
 * (ECONNRESET on both ends) instead of handing the program bytes out of
 * order:
 *
 *   - bytes on the kernel socket while this end's reader is on the ring
 *     and the ring's writer has not left (a correct writer leaves before
 *     it writes TCP again): one thread per process watches the kernel
 *     sockets of connections that hold rings (an epoll set, edge-triggered
 *     input) and checks, in this order, the reader's path, the bytes, and
 *     the writer's mark;
 *   - a ring whose start lies behind what the reader already read from
 *     TCP (the peer wrote past its library before it moved to the ring):
 *     the reader's check (path.c).
 *
 * Not watched: a relayed ring pair (READY's Relayed), whose other guest's
 * FIN and TCP bytes can outrun the ring bytes the relays carry.
 *
 * Not seen: a bypassing write while no ring is attached (plain TCP: the
 * bytes are in order anyway), or one whose bytes the reader takes from TCP
 * before any ring starts (they are then part of the stream). The watcher
 * sleeps in the kernel; a READY costs one epoll_ctl, and each TCP arrival
 * on a connection holding rings wakes it once.
 *
 * io_uring moves bytes where no preload library sees them. A process that
 * sets it up (io_uring_setup through syscall(), or liburing's setup
 * functions; raw.c sees syscall(SYS_io_uring_setup)) keeps its new
 * connections on TCP. */
#include "preload.h"

#include <dlfcn.h>
#include <errno.h>
#include <string.h>

int uring_seen;

static pthread_mutex_t guard_mu = PTHREAD_MUTEX_INITIALIZER;
static int guard_ep = -1; /* under guard_mu; -2: cannot be made, no watcher */
/* fds in guard_ep (under guard_mu): each is taken out before its kernel
 * close (guard_forget). An fd left in the set can stall the close: the
 * watcher's epoll_wait takes a reference to the file while it polls it
 * (Linux 6.10+), and when the program's close lands meanwhile, that
 * reference is the last one: the socket's release (FIN) then waits for the
 * watcher to return to user space, which it does only at its next event,
 * maybe never. The peer reads no EOF (a server reading until the client's
 * close sat 10 s in its recv). EPOLL_CTL_DEL waits for a scan in progress
 * (the set's lock) and the fd still holds the file then. */
static uint8_t guarded[FD_MAX];

static void trip(int ep, int fd)
{
	struct flow *f = flow_get(fd);
	struct rings *rg = f ? __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) : NULL;
	if (!rg || f->owner != my_pid) {
		pthread_mutex_lock(&guard_mu); /* no rings: TCP bytes are all legal */
		if (fd >= 0 && fd < FD_MAX && guarded[fd] && real_epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL) == 0)
			guarded[fd] = 0;
		pthread_mutex_unlock(&guard_mu);
		if (f)
			flow_put(f);
		return;
	}
	pthread_mutex_lock(&f->rmu);
	uint64_t start;
	int on_ring = f->rring || (!rg->rleft && shunt_ring_started(&rg->sf.r, &start) && f->roff == start);
	ssize_t pk = on_ring && !f->slen ? kernel_peek(f, fd) : -1;
	int gone = pk == 0 || (pk < 0 && on_ring && !f->slen && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
	/* Not on a relayed ring: the other guest's FIN, and at a downgrade its
	 * TCP bytes, outrun the ring bytes the relays carry (the relay marks
	 * the ring left in any case; resume.c). */
	int live = !rg->bridged && !shunt_ring_writer_left(&rg->sf.r) &&
		   !__atomic_load_n((uint32_t *)(rg->sf.r.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST);
	if (gone && live && !__atomic_load_n(&rg->peer_gone, __ATOMIC_SEQ_CST)) {
		/* The kernel's FIN or RST while the peer's writer is on the ring:
		 * a live writer leaves the ring before its kernel close, so this
		 * one died (hostd says DOWN(peer-gone) too, but it may have sent
		 * another DOWN already). The reader drains the ring and leaves. */
		plog("shunt: fd %d: the kernel's end of the stream while the peer writes the ring: peer gone", fd);
		__atomic_store_n(&rg->peer_gone, 1, __ATOMIC_SEQ_CST);
		shunt_ring_stop(&rg->sf.r, 1);
		flow_wake(f);
	}
	if (pk > 0 && live) {
		/* plog, not only -v: this is a program's bug, worth a line */
		plog("shunt: fd %d: bytes arrived on the TCP socket while the peer writes the ring: a write bypassed "
		     "the library (raw syscall?); connection reset (ECONNRESET)", fd);
		__atomic_store_n((uint32_t *)(rg->sf.w.hdr + SHUNT_OFF_RESET), 1, __ATOMIC_SEQ_CST);
		__atomic_store_n((uint32_t *)(rg->sf.r.hdr + SHUNT_OFF_RESET), 1, __ATOMIC_SEQ_CST);
		shunt_ring_abort(&rg->sf.w);
		shunt_ring_abort(&rg->sf.r);
	}
	pthread_mutex_unlock(&f->rmu);
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
			trip(ep, ev[i].data.fd);
	}
}

void guard(int fd)
{
	pthread_mutex_lock(&guard_mu);
	if (guard_ep == -1) {
		guard_ep = real_epoll_create1(EPOLL_CLOEXEC);
		int e = guard_ep < 0 ? errno : shunt_thread_start(NULL, 64 << 10, watch, (void *)(intptr_t)guard_ep);
		if (e) {
			plog("shunt: cannot start the watcher of fast-path flows' TCP sockets: %s", strerror(e));
			if (guard_ep >= 0)
				real_close(guard_ep);
			guard_ep = -2;
		}
	}
	if (guard_ep >= 0 && fd >= 0 && fd < FD_MAX) {
		struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.fd = fd};
		if (real_epoll_ctl(guard_ep, EPOLL_CTL_ADD, fd, &ev) == 0 ||
		    (errno == EEXIST && real_epoll_ctl(guard_ep, EPOLL_CTL_MOD, fd, &ev) == 0))
			guarded[fd] = 1;
	}
	pthread_mutex_unlock(&guard_mu);
}

void guard_forget(int fd)
{
	if (fd < 0 || fd >= FD_MAX || !__atomic_load_n(&guarded[fd], __ATOMIC_RELAXED))
		return;
	pthread_mutex_lock(&guard_mu);
	if (guarded[fd] && guard_ep >= 0)
		real_epoll_ctl(guard_ep, EPOLL_CTL_DEL, fd, NULL);
	guarded[fd] = 0;
	pthread_mutex_unlock(&guard_mu);
}

/* The watcher did not come along; the set is the parent's. */
void guard_after_fork(void)
{
	pthread_mutex_init(&guard_mu, NULL);
	if (guard_ep >= 0)
		real_close(guard_ep);
	guard_ep = -1;
	memset(guarded, 0, sizeof guarded);
}

/* ---- io_uring ---- */

void uring(const char *how)
{
	if (!__atomic_exchange_n(&uring_seen, 1, __ATOMIC_SEQ_CST))
		plog("shunt: the process set up io_uring (%s): new connections stay on TCP", how);
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
