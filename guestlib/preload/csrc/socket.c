/* Sockets: socket, connect, listen, accept; addresses; hostd's verdicts.
 * A TCP socket becomes a candidate at socket() (or accept() on a
 * registered listener) and a fast-path flow when hostd answers READY. */
#include "preload.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

/* How long connect() and accept() wait for hostd's verdict. */
#define VERDICT_TIMEOUT_MS  5000

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

/* ---- verdicts ---- */

/* adopt applies hostd's verdict for fd: READY attaches the rings. */
static void adopt(int fd, const struct shunt_msg *v, const char *who)
{
	char ip[INET6_ADDRSTRLEN];
	struct shunt_addr r = {0};
	remote_of(fd, &r);
	inet_ntop(AF_INET6, r.ip, ip, sizeof ip);
	if (v->type != SHUNT_READY) {
		plog("shunt: fd %d %s [%s]:%u: tcp (%s)", fd, who, ip, r.port, shunt_reason_name(v->reason));
		return;
	}
	struct flow *f = flow_new();
	struct shunt_flow sf;
	if (!f || shunt_flow_attach(session, v, &sf)) {
		plog("shunt: fd %d: %s; tcp", fd, f ? "READY does not match the region" : "out of memory");
		struct shunt_flow id = {.region_id = v->region_id, .slot = v->slot, .gen = v->gen, .side = v->side, .session = session};
		shunt_flow_close(&id);
		flow_discard(f);
		return;
	}
	f->sf = sf; /* whole (preload.h, struct flow) */
	f->sf.w.owner = f->sf.r.owner = &f->sf;
	f->owner = my_pid;
	f->nonblock = nonblk[fd];
	int one = 1;
	setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one); /* the lease */
	flow_timeouts(fd, f); /* set on the socket before READY: the kernel has them */
	flow_publish(fd, f);
	guard(fd);
	plog("shunt: fd %d %s [%s]:%u: shunt (slot %u, ring %llu bytes)", fd, who, ip, r.port, v->slot,
	     (unsigned long long)f->sf.r.cap);
}

static void open_side(int fd, uint8_t role, const char *who)
{
	struct shunt_msg m = {.type = SHUNT_OPEN, .role = role}, v;
	if (local_of(fd, &m.local) || remote_of(fd, &m.remote))
		return;
	shunt_session_request(session, &m, &v, VERDICT_TIMEOUT_MS);
	adopt(fd, &v, who);
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

/* source_for asks the kernel which source address it would use (a
 * connected UDP socket sends nothing). */
static int source_for(const struct sockaddr *dst, socklen_t len, struct sockaddr_storage *src)
{
	if (len > sizeof(struct sockaddr_storage))
		return -1;
	int u = real_socket(dst->sa_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (u < 0)
		return -1;
	struct sockaddr_storage d;
	memcpy(&d, dst, len);
	if (d.ss_family == AF_INET && ((struct sockaddr_in *)&d)->sin_port == 0)
		((struct sockaddr_in *)&d)->sin_port = htons(9);
	socklen_t sl = sizeof *src;
	int r = real_connect(u, (struct sockaddr *)&d, len) < 0 || getsockname(u, (struct sockaddr *)src, &sl) < 0 ? -1 : 0;
	real_close(u);
	if (src->ss_family == AF_INET)
		((struct sockaddr_in *)src)->sin_port = 0;
	else
		((struct sockaddr_in6 *)src)->sin6_port = 0;
	return r;
}

INTERPOSE int connect(int fd, const struct sockaddr *addr, socklen_t len)
{
	REAL_READY();
	struct shunt_addr remote, local;
	if (fd < 0 || fd >= FD_MAX || kind[fd] != FD_TCP || disabled || !addr || to_addr(addr, &remote))
		return real_connect(fd, addr, len);
	if (is_loopback(&remote)) {
		plog("shunt: fd %d connect: tcp (loopback)", fd);
		return real_connect(fd, addr, len);
	}
	if (__atomic_load_n(&uring_seen, __ATOMIC_RELAXED)) {
		plog("shunt: fd %d connect: tcp (io_uring: the process set up io_uring, which the library cannot see)", fd);
		return real_connect(fd, addr, len);
	}
	if (shunt_session_ensure(session)) {
		plog("shunt: fd %d connect: tcp (no-hostd)", fd);
		return real_connect(fd, addr, len);
	}
	/* Bind first to learn the tuple, announce it, then connect. */
	struct sockaddr_storage src;
	if (local_of(fd, &local) == 0 && local.port == 0 && source_for(addr, len, &src) == 0)
		bind(fd, (struct sockaddr *)&src, src.ss_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6));
	if (local_of(fd, &local) == 0) {
		struct shunt_msg in = {.type = SHUNT_INTENT, .local = local, .remote = remote};
		shunt_session_send(session, &in);
	}
	int r = real_connect(fd, addr, len);
	if (r == 0) {
		open_side(fd, SHUNT_ROLE_ACTIVE, "connect");
		return 0;
	}
	/* Non-blocking connect: exactly the kernel's answer. The verdict is
	 * asked for once the connection is up (settle), by the first call
	 * that looks at the socket; a failed connect keeps its error in
	 * SO_ERROR and POLLERR, as on plain TCP. */
	if (errno == EINPROGRESS)
		__atomic_store_n(&kind[fd], FD_PENDING, __ATOMIC_RELEASE);
	return r;
}

/* settle_mu makes one thread settle a socket while the others that look at
 * it wait, so none of them moves a byte over TCP before the verdict.
 * settling is set in the thread that settles: the calls it makes on the
 * socket meanwhile (getsockopt, setsockopt) must not wait for itself. */
static pthread_mutex_t settle_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int settling;

void settle(int fd)
{
	if (!pending(fd) || settling)
		return;
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
	if (p.revents & (POLLERR | POLLHUP))
		plog("shunt: fd %d connect: tcp (the connect failed; its error stays in SO_ERROR)", fd);
	else
		open_side(fd, SHUNT_ROLE_ACTIVE, "connect");
	__atomic_store_n(&kind[fd], FD_TCP, __ATOMIC_RELEASE);
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

INTERPOSE int listen(int fd, int backlog)
{
	REAL_READY();
	int r = real_listen(fd, backlog);
	if (r == 0 && fd >= 0 && fd < FD_MAX && kind[fd] == FD_TCP && !disabled && shunt_session_ensure(session) == 0) {
		struct shunt_msg m = {.type = SHUNT_LISTEN};
		if (local_of(fd, &m.local) == 0 && shunt_session_send(session, &m) == 0) {
			shunt_session_sync(session);
			kind[fd] = FD_LISTENER;
		}
	}
	return r;
}

INTERPOSE int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags)
{
	REAL_READY();
	int c = real_accept4(fd, addr, len, flags);
	if (c >= 0 && c < FD_MAX && fd >= 0 && fd < FD_MAX && kind[fd] == FD_LISTENER) {
		kind[c] = FD_TCP;
		nonblk[c] = (flags & SOCK_NONBLOCK) != 0;
		struct shunt_addr r;
		if (__atomic_load_n(&uring_seen, __ATOMIC_RELAXED))
			plog("shunt: fd %d accept: tcp (io_uring: the process set up io_uring)", c);
		else if (remote_of(c, &r) == 0 && !is_loopback(&r))
			open_side(c, SHUNT_ROLE_PASSIVE, "accept");
	}
	return c;
}

INTERPOSE int accept(int fd, struct sockaddr *addr, socklen_t *len) { return accept4(fd, addr, len, 0); }
