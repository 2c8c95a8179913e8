/* Connections (btl_shunt.h): a connection's life (new, closed), the lease
 * connect, accepting leases, and HELLO, which names the rank a lease comes
 * from. Its I/O is lease.c; the path of the direction it carries is
 * handover.c.
 *
 * A lease is one direction's kernel TCP connection, opened by the sender:
 *
 *   sender                                 receiver
 *   connect(), OPEN to hostd          -->  accept_all: a conn, no peer yet
 *   HELLO (job, rank, lease number)   -->  conn_hello: its endpoint, OPEN
 *
 * Closing: an end that is done with a lease writes BYE, then shuts down its
 * write side once everything is written, and closes when it reads EOF, so
 * neither end ever closes with unread bytes (which would reset the
 * connection and lose the other's last records). EOF without BYE before it,
 * outside MPI_Finalize, means the peer process died. */
#include "btl_shunt.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- connections ---- */

struct conn *conn_new(int fd, int out)
{
	struct conn *c = calloc(1, sizeof *c);
	if (!c)
		return NULL;
	c->fd = fd;
	c->out = out;
	struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
	if (epoll_ctl(shunt_btl.efd, EPOLL_CTL_ADD, fd, &ev) < 0) {
		free(c);
		return NULL;
	}
	c->next = shunt_btl.conns;
	shunt_btl.conns = c;
	shunt_btl.lease_busy = 1; /* HELLO, hostd's word, the handover: check often */
	return c;
}

void conn_set_pollout(struct conn *c, int on)
{
	if (c->pollout == on || c->fd < 0)
		return;
	c->pollout = on;
	struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0), .data.ptr = c};
	epoll_ctl(shunt_btl.efd, EPOLL_CTL_MOD, c->fd, &ev);
}

/* conn_free closes c; queued DATA fragments complete with an error (only
 * a dead peer or MPI_Finalize get here with any). */
void conn_free(struct conn *c)
{
	hostd_close(c);
	for (struct conn **pp = &shunt_btl.conns; *pp; pp = &(*pp)->next)
		if (*pp == c) {
			*pp = c->next;
			break;
		}
	if (c->fd >= 0) {
		epoll_ctl(shunt_btl.efd, EPOLL_CTL_DEL, c->fd, NULL);
		close(c->fd);
	}
	struct frag *f;
	while ((f = fq_pop(&c->lq))) {
		if (f->internal) {
			frag_put(f);
			continue;
		}
		if (f->base.des_flags & MCA_BTL_DES_SEND_ALWAYS_CALLBACK)
			f->base.des_cbfunc(&shunt_btl.super, f->ep, &f->base, OPAL_ERR_UNREACH);
		if (f->base.des_flags & MCA_BTL_DES_FLAGS_BTL_OWNERSHIP)
			frag_put(f);
	}
	struct mca_btl_base_endpoint_t *ep = c->ep;
	if (ep) {
		if (ep->tx == c) {
			ep->tx = NULL;
			ep->tx_ring = 0;
			while ((f = fq_pop(&ep->q))) { /* never sent: the peer is gone */
				f->base.des_cbfunc(&shunt_btl.super, ep, &f->base, OPAL_ERR_UNREACH);
				if (f->base.des_flags & MCA_BTL_DES_FLAGS_BTL_OWNERSHIP)
					frag_put(f);
			}
		}
		if (ep->tx_next == c)
			ep->tx_next = NULL;
		if (ep->rx == c) {
			ep->rx = NULL;
			ep->rx_ring = 0;
			ring_rx_del(ep);
		}
	}
	free(c->in);
	free(c->rb);
	free(c);
}

/* ---- the lease connect ---- */

static socklen_t to_sockaddr(const struct shunt_addr *a, struct sockaddr_storage *ss)
{
	static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
	memset(ss, 0, sizeof *ss);
	if (!memcmp(a->ip, v4, 12)) {
		struct sockaddr_in *s4 = (struct sockaddr_in *)ss;
		s4->sin_family = AF_INET;
		memcpy(&s4->sin_addr, a->ip + 12, 4);
		s4->sin_port = htons(a->port);
		return sizeof *s4;
	}
	struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)ss;
	s6->sin6_family = AF_INET6;
	memcpy(&s6->sin6_addr, a->ip, 16);
	s6->sin6_port = htons(a->port);
	return sizeof *s6;
}

static void from_sockaddr(const struct sockaddr_storage *ss, struct shunt_addr *a)
{
	memset(a, 0, sizeof *a);
	if (ss->ss_family == AF_INET) {
		const struct sockaddr_in *s4 = (const void *)ss;
		a->ip[10] = a->ip[11] = 0xff;
		memcpy(a->ip + 12, &s4->sin_addr, 4);
		a->port = ntohs(s4->sin_port);
	} else {
		const struct sockaddr_in6 *s6 = (const void *)ss;
		memcpy(a->ip, &s6->sin6_addr, 16);
		a->port = ntohs(s6->sin6_port);
	}
}

static void tune(int fd)
{
	int one = 1, idle = 15, intvl = 5;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	/* The lease: hostd keeps a connection on the rings only while its
	 * packets are seen past the firewall both ways (proof_max_age, 35 s
	 * by default), so an idle one probes every 15 s, as guestlib does. */
	setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
	setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
	setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
}

/* lease_open connects a new lease to ep (nothing bound first: the kernel
 * picks the source), announces it to hostd once connected (OPEN, answered
 * later) and sends HELLO. The connect itself waits at most wait_ms: a
 * local peer answers in well under a millisecond. Returns 0 (the
 * connection is ep->tx, or ep->tx_next if ep already has one) or -errno. */
int lease_open(struct mca_btl_base_endpoint_t *ep, int wait_ms)
{
	struct shunt_addr remote;
	memcpy(remote.ip, ep->addr.ip, 16);
	remote.port = ep->addr.port;
	struct sockaddr_storage dst, src;
	socklen_t dlen = to_sockaddr(&remote, &dst);
	int fd = socket(dst.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	int r = connect(fd, (struct sockaddr *)&dst, dlen);
	if (r < 0 && errno == EINPROGRESS) {
		struct pollfd p = {.fd = fd, .events = POLLOUT};
		int64_t end = now_ns() + (int64_t)wait_ms * 1000000;
		for (;;) {
			int left = (int)((end - now_ns()) / 1000000);
			r = poll(&p, 1, left < 0 ? 0 : left);
			if (r >= 0 || errno != EINTR)
				break;
		}
		if (r == 0) {
			close(fd);
			return -ETIMEDOUT;
		}
		int err = 0;
		socklen_t el = sizeof err;
		getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
		r = err ? -1 : 0;
		errno = err;
	}
	struct shunt_addr local;
	socklen_t l = sizeof src;
	if (r == 0 && getsockname(fd, (struct sockaddr *)&src, &l) < 0)
		r = -1;
	if (r < 0) {
		int e = errno;
		close(fd);
		return -e;
	}
	from_sockaddr(&src, &local);
	tune(fd);
	struct conn *c = conn_new(fd, 1);
	if (!c) {
		close(fd);
		return -ENOMEM;
	}
	c->ep = ep;
	c->lease = ep->leases++;
	c->local = local;
	c->remote = remote;
	struct rec_hello h = {.magic = SHUNT_BTL_MAGIC, .version = SHUNT_BTL_VERSION,
			      .jobid = OPAL_PROC_MY_NAME.jobid, .vpid = OPAL_PROC_MY_NAME.vpid, .lease = c->lease};
	push_control(c, REC_HELLO, &h, sizeof h);
	hostd_open(c, SHUNT_ROLE_ACTIVE);
	if (!ep->tx)
		ep->tx = c;
	else
		ep->tx_next = c;
	return 0;
}

/* ---- accepting ---- */

void accept_all(void)
{
	for (;;) {
		struct sockaddr_storage ss;
		socklen_t l = sizeof ss;
		int fd = accept4(shunt_btl.lfd, (struct sockaddr *)&ss, &l, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			return;
		}
		tune(fd);
		struct conn *c = conn_new(fd, 0);
		if (!c) {
			close(fd);
			say(0, "out of memory: refused a lease");
			continue;
		}
		from_sockaddr(&ss, &c->remote);
		struct sockaddr_storage me;
		l = sizeof me;
		if (getsockname(fd, (struct sockaddr *)&me, &l) == 0)
			from_sockaddr(&me, &c->local);
	}
}

/* ---- HELLO: who it is ---- */

static struct mca_btl_base_endpoint_t *peer_of(const struct rec_hello *h)
{
	if (h->magic != SHUNT_BTL_MAGIC || h->version != SHUNT_BTL_VERSION || h->jobid != OPAL_PROC_MY_NAME.jobid) {
		say(0, "a lease from a process not of this job or of another btl/shunt version; closed");
		return NULL;
	}
	return ep_of(h->vpid);
}

/* conn_hello takes the HELLO that must open an accepted lease: 1, or -1 if
 * it is not one or names no rank of this job. */
int conn_hello(struct conn *c, const struct shunt_rec *h, const uint8_t *p)
{
	if (h->kind != REC_HELLO || h->len < sizeof(struct rec_hello))
		return -1;
	struct rec_hello hello;
	memcpy(&hello, p, sizeof hello);
	struct mca_btl_base_endpoint_t *ep = peer_of(&hello);
	if (!ep)
		return -1;
	c->ep = ep;
	c->hello = 1;
	c->lease = hello.lease;
	if (!ep->rx && hello.lease == 0)
		ep->rx = c;
	hostd_open(c, SHUNT_ROLE_PASSIVE);
	return 1;
}
