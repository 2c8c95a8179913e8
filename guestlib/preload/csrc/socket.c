/* Sockets: socket, connect, listen, accept; addresses. A TCP socket
 * becomes a candidate at socket() (or accept() on a registered listener)
 * and a connection (conn.c) when connect() or accept() returns it
 * established: OPEN goes to hostd, and nothing waits for the answer. */
#include "preload.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

/* ---- addresses ---- */

static int to_addr(const struct sockaddr *sa, struct shunt_addr *a)
{
	memset(a, 0, sizeof *a);
	if (sa->sa_family == AF_INET) {
		const struct sockaddr_in *s4 = (const void *)sa;
		a->ip[10] = a->ip[11] = 0xff;
		memcpy(a->ip + 12, &s4->sin_addr, 4);
		a->port = ntohs(s4->sin_port);
		return 0;
	}
	if (sa->sa_family == AF_INET6) {
		const struct sockaddr_in6 *s6 = (const void *)sa;
		memcpy(a->ip, &s6->sin6_addr, 16);
		a->port = ntohs(s6->sin6_port);
		return 0;
	}
	return -1;
}

static int is_loopback(const struct shunt_addr *a)
{
	static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
	static const uint8_t v6lo[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
	if (!memcmp(a->ip, v4, 12))
		return a->ip[12] == 127;
	return !memcmp(a->ip, v6lo, 16);
}

int local_of(int fd, struct shunt_addr *a)
{
	struct sockaddr_storage ss;
	socklen_t len = sizeof ss;
	return getsockname(fd, (struct sockaddr *)&ss, &len) < 0 ? -1 : to_addr((struct sockaddr *)&ss, a);
}

int remote_of(int fd, struct shunt_addr *a)
{
	struct sockaddr_storage ss;
	socklen_t len = sizeof ss;
	return getpeername(fd, (struct sockaddr *)&ss, &len) < 0 ? -1 : to_addr((struct sockaddr *)&ss, a);
}

/* ---- calls ---- */

INTERPOSE int socket(int domain, int type, int protocol)
{
	REAL_READY();
	int fd = real_socket(domain, type, protocol);
	if (fd >= 0 && fd < FD_MAX && (domain == AF_INET || domain == AF_INET6) && (type & 0xf) == SOCK_STREAM) {
		kind[fd] = FD_TCP;
		nonblk[fd] = (type & SOCK_NONBLOCK) != 0;
	}
	return fd;
}

INTERPOSE int connect(int fd, const struct sockaddr *addr, socklen_t len)
{
	REAL_READY();
	struct shunt_addr remote;
	/* A connection's socket is connected again (hiredis asks connect()
	 * whether its non-blocking connect ended: the kernel answers 0 once,
	 * then EISCONN): the kernel's answer, and the same connection. */
	if (fd < 0 || fd >= FD_MAX || kind[fd] != FD_TCP || flow_of(fd) || disabled || !addr || to_addr(addr, &remote))
		return real_connect(fd, addr, len);
	if (is_loopback(&remote) && !loopback) {
		plog("shunt: fd %d connect: tcp (loopback)", fd);
		return real_connect(fd, addr, len);
	}
	if (__atomic_load_n(&uring_seen, __ATOMIC_RELAXED)) {
		plog("shunt: fd %d connect: tcp (io_uring: the process set up io_uring, which the library cannot see)", fd);
		return real_connect(fd, addr, len);
	}
	/* FD_CONNECTING while the kernel connects: a fork meanwhile (another
	 * thread) makes the socket the kernel's in both processes (fork.c),
	 * and the kind this call leaves is then FD_KERNEL's. The generation
	 * is read before ensure, which may wait for another thread's open:
	 * a fork during that wait counts too. */
	unsigned gen = __atomic_load_n(&fork_gen, __ATOMIC_RELAXED);
	if (shunt_session_ensure(session)) {
		plog("shunt: fd %d connect: tcp (%s)", fd, shunt_reason_name(shunt_session_reason(session)));
		return real_connect(fd, addr, len);
	}
	__atomic_store_n(&kind[fd], FD_CONNECTING, __ATOMIC_RELEASE);
	int r = real_connect(fd, addr, len), e = errno;
	uint8_t k = FD_CONNECTING;
	/* Non-blocking connect: exactly the kernel's answer. The connection
	 * is opened once it is up (settle), by the first call that looks at
	 * the socket; a failed connect keeps its error in SO_ERROR and
	 * POLLERR, as on plain TCP. */
	int forked = !__atomic_compare_exchange_n(&kind[fd], &k, r == 0 ? FD_TCP : e == EINPROGRESS ? FD_PENDING : FD_TCP, 0,
						  __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
	if (r == 0 && !forked)
		conn_open(fd, SHUNT_ROLE_ACTIVE, "connect", gen, &remote, -1);
	errno = e;
	return r;
}

/* settle_mu makes one thread settle a socket while the others that look at
 * it wait (a moment: OPEN is sent, nothing is waited for), so that every
 * byte of the connection is counted. settling is set in the thread that
 * settles: the calls it makes on the socket meanwhile (getsockopt,
 * setsockopt) must not wait for itself. It is the first lock of the
 * library's one order (preload.h, Locks): a settle takes tab_mu and
 * idx_mu (conn_open), so no holder of those may call an interposed
 * function, which would settle. */
static pthread_mutex_t settle_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int settling;

/* settle_after_fork: a thread that was settling is not in the child; the
 * sockets it settled are plain TCP there (fork.c). */
void settle_after_fork(void) { pthread_mutex_init(&settle_mu, NULL); }

void settle(int fd)
{
	if (!pending(fd) || settling)
		return;
	/* The number's generation before anything is asked of the socket:
	 * another thread may close it and a new socket take the number
	 * meanwhile (conn_open and the kind's change below check it). */
	uint32_t fdg = __atomic_load_n(&fd_gen[fd], __ATOMIC_ACQUIRE);
	struct pollfd p = {.fd = fd, .events = POLLOUT};
	if (real_poll(&p, 1, 0) != 1)
		return; /* still connecting */
	pthread_mutex_lock(&settle_mu);
	if (!pending(fd)) {
		pthread_mutex_unlock(&settle_mu);
		return;
	}
	int e = errno;
	settling = 1;
	unsigned gen = __atomic_load_n(&fork_gen, __ATOMIC_RELAXED);
	if (p.revents & (POLLERR | POLLHUP))
		plog("shunt: fd %d connect: tcp (the connect failed; its error stays in SO_ERROR)", fd);
	else
		conn_open(fd, SHUNT_ROLE_ACTIVE, "connect", gen, NULL, fdg);
	if (test_settle_delay_ns) { /* widen the window in which the leaver may OPEN it (tests) */
		struct timespec ts = {test_settle_delay_ns / 1000000000, test_settle_delay_ns % 1000000000};
		nanosleep(&ts, NULL);
	}
	uint8_t k = FD_PENDING; /* a fork meanwhile made it FD_KERNEL: it stays so */
	pthread_mutex_lock(&tab_mu); /* a close meanwhile: the number is another socket's now */
	if (fd_gen[fd] == fdg)
		__atomic_compare_exchange_n(&kind[fd], &k, FD_TCP, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
	pthread_mutex_unlock(&tab_mu);
	settling = 0;
	pthread_mutex_unlock(&settle_mu);
	errno = e;
}

/* getsockopt: SO_ERROR of a socket whose non-blocking connect was under
 * way is the usual way to learn it ended: settle it first. The core and
 * this library call it too. */
INTERPOSE int getsockopt(int fd, int level, int name, void *val, socklen_t *len)
{
	REAL_READY();
	settle(fd);
	return real_getsockopt(fd, level, name, val, len);
}

/* Listeners are hostd's per guest, counted per session: LISTEN from each
 * session that accepts on an address, UNLISTEN when its last listener there
 * closes. */
uint8_t linherited[FD_MAX];

/* register_listener sends LISTEN for fd and, with sync, waits for hostd
 * to have it (PING/PONG), so that it is in effect before any peer's OPEN:
 * 0, or -1. */
static int register_listener(int fd, int sync)
{
	struct shunt_msg m = {.type = SHUNT_LISTEN};
	if (local_of(fd, &m.local) || shunt_session_send(session, &m))
		return -1;
	if (sync)
		shunt_session_sync(session);
	return 0;
}

INTERPOSE int listen(int fd, int backlog)
{
	REAL_READY();
	int r = real_listen(fd, backlog);
	if (r == 0 && fd >= 0 && fd < FD_MAX && kind[fd] == FD_TCP && !disabled && shunt_session_ensure(session) == 0 &&
	    register_listener(fd, 1) == 0) {
		linherited[fd] = 0;
		kind[fd] = FD_LISTENER;
	}
	return r;
}

/* unlisten: fd, a listener this process registered, is closing (no longer
 * in kind[]). UNLISTEN goes only if no other listener of this process is
 * on its address (SO_REUSEPORT sockets, a dup'd listener), since hostd
 * counts one per session. */
void unlisten(int fd)
{
	struct shunt_msg m = {.type = SHUNT_UNLISTEN};
	struct shunt_addr other;
	if (local_of(fd, &m.local))
		return;
	for (int i = 0; i < FD_MAX; i++)
		if (i != fd && __atomic_load_n(&kind[i], __ATOMIC_ACQUIRE) == FD_LISTENER && !linherited[i] && local_of(i, &other) == 0 &&
		    !memcmp(&other, &m.local, sizeof other))
			return;
	shunt_session_send(session, &m);
}

INTERPOSE int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags)
{
	REAL_READY();
	unsigned gen = __atomic_load_n(&fork_gen, __ATOMIC_RELAXED);
	int c = real_accept4(fd, addr, len, flags);
	if (c >= 0 && c < FD_MAX && fd >= 0 && fd < FD_MAX && kind[fd] == FD_LISTENER && linherited[fd] &&
	    shunt_session_ensure(session) == 0 && register_listener(fd, 0) == 0) {
		/* A fork child's first accept on its parent's listener: this
		 * session listens too, so the listener outlives a parent that
		 * exits (a daemon's first fork; an nginx master's workers).
		 * LISTEN goes without waiting for hostd's PONG: the listener is
		 * in effect already through the parent's session (hostd counts
		 * listeners per guest), so a peer's OPEN meanwhile finds it; the
		 * LISTEN only matters once the parent unlistens, which no wait
		 * here could order anyway (another process's channel). The
		 * accepted connection's own OPEN goes later on this channel, in
		 * order after the LISTEN. The session's channel is opened here
		 * (ensure: once, with a backoff after a failure), as the
		 * accepted connection needs it in any case. */
		linherited[fd] = 0;
		plog("shunt: fd %d: listener inherited at fork: registered in this process's session", fd);
	}
	if (c >= 0 && c < FD_MAX && fd >= 0 && fd < FD_MAX && kind[fd] == FD_LISTENER) {
		kind[c] = FD_TCP;
		nonblk[c] = (flags & SOCK_NONBLOCK) != 0;
		struct shunt_addr r;
		if (__atomic_load_n(&uring_seen, __ATOMIC_RELAXED))
			plog("shunt: fd %d accept: tcp (io_uring: the process set up io_uring)", c);
		else if (shunt_session_ensure(session))
			plog("shunt: fd %d accept: tcp (%s)", c, shunt_reason_name(shunt_session_reason(session)));
		else if (remote_of(c, &r) == 0 && (!is_loopback(&r) || loopback))
			conn_open(c, SHUNT_ROLE_PASSIVE, "accept", gen, &r, -1);
	}
	return c;
}

INTERPOSE int accept(int fd, struct sockaddr *addr, socklen_t *len) { return accept4(fd, addr, len, 0); }
