/* Connections (btl_shunt.h): the lease connect, accept and HELLO, the
 * lease's non-blocking I/O, and the path state machine of each direction.
 *
 * Sender's side of a direction (paths_step):
 *
 *   lease k, asking hostd --READY + RING_OK--> SWITCH, ring k
 *        |                                          |
 *        | TCP(reason) or RING_NO                   | reset (REVOKE) or broken
 *        v                                          v
 *   lease k, on TCP  <------------------------ DOWN(bytes, records)
 *        |
 *        | retry (backoff): lease k+1 gets READY + RING_OK
 *        v
 *   MOVE(k+1) and BYE on lease k; SWITCH on lease k+1, ring k+1
 *
 * Receiver's side: it reads the one place where the stream goes on (ep->rx
 * and ep->rx_ring) and follows the marks; it attaches a ring when hostd says
 * READY and answers RING_OK (or RING_NO) on the lease's reverse direction,
 * so the sender never writes a ring that its reader cannot read.
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
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

static size_t max_record(void) { return sizeof(struct rec) + shunt_btl.super.btl_max_send_size + 1024; }

/* ---- reasons ---- */

const char *reason_name(uint16_t r)
{
	switch (r) {
	case R_REFUSED: return "connection refused";
	case R_UNREACHABLE: return "unreachable";
	case R_RING_SMALL: return "ring too small";
	case R_RING_BROKEN: return "ring reset";
	case R_LEASE_ONLY: return "btl_shunt_ring=0";
	case R_PEER: return "peer said no";
	}
	return shunt_reason_name(r);
}

/* permanent: a new lease would get the same answer. */
static int permanent(uint16_t r)
{
	return r == SHUNT_REASON_LOOPBACK || r == SHUNT_REASON_NOT_LOCAL || r == SHUNT_REASON_CROSS_GROUP ||
	       r == SHUNT_REASON_DISABLED || r == SHUNT_REASON_VERSION || r == R_RING_SMALL || r == R_LEASE_ONLY;
}

void say_path(struct mca_btl_base_endpoint_t *ep, uint16_t reason, const char *what)
{
	if (ep->said && ep->said_reason == reason)
		return;
	ep->said = 1;
	ep->said_reason = reason;
	say(reason == SHUNT_REASON_NONE ? 1 : 0, "to %s: %s%s%s%s", ep->who, what, reason ? " (" : "",
	    reason ? reason_name(reason) : "", reason ? ")" : "");
}

static void ring_rx_del(struct mca_btl_base_endpoint_t *ep);

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
	shunt_btl.lease_busy = 1; /* HELLO, verdicts, the handover: check often */
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
	free(c);
}

/* ---- writing a lease ---- */

/* lease_flush writes queued records: 1 when the queue is empty, 0 when the
 * socket is full (EPOLLOUT then resumes), -1 when the connection failed. */
int lease_flush(struct conn *c)
{
	struct frag *f;
	while ((f = c->lq.head)) {
		struct iovec iov[2] = {{&f->hdr, sizeof f->hdr}, {f->seg.seg_addr.pval, f->seg.seg_len}};
		size_t total = sizeof f->hdr + f->seg.seg_len, skip = f->done;
		int i = 0;
		if (skip >= sizeof f->hdr) {
			skip -= sizeof f->hdr;
			i = 1;
		}
		iov[i].iov_base = (uint8_t *)iov[i].iov_base + skip;
		iov[i].iov_len -= skip;
		ssize_t n = writev(c->fd, iov + i, 2 - i);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK) {
				conn_set_pollout(c, 1);
				return 0;
			}
			return -1;
		}
		f->done += n;
		if (f->done < total)
			continue;
		fq_pop(&c->lq);
		if (f->internal)
			frag_put(f);
		else
			frag_done(f);
	}
	conn_set_pollout(c, 0);
	if (c->closing == 1) {
		shutdown(c->fd, SHUT_WR);
		c->closing = 2;
	}
	return 1;
}

void lease_push(struct conn *c, struct frag *f)
{
	f->done = 0;
	if (f->hdr.kind == REC_DATA && c->ep)
		f->hdr.stamp = c->ep->tx_frags++;
	int was_empty = !c->lq.head;
	fq_push(&c->lq, f);
	shunt_btl.lease_busy = 1;
	if (was_empty && lease_flush(c) < 0 && c->ep && !c->closing)
		peer_failed(c->ep, "its lease failed on write");
}

static void push_control(struct conn *c, uint8_t kind, const void *p, size_t n)
{
	struct frag *f = frag_control(kind, p, n);
	if (!f) {
		if (c->ep)
			peer_failed(c->ep, "out of memory for a control record");
		return;
	}
	lease_push(c, f);
}

/* finish ends our use of c: BYE, then shutdown once written (lease_flush),
 * then close at EOF (conn_read). */
static void finish(struct conn *c)
{
	if (c->closing)
		return;
	hostd_close(c);
	push_control(c, REC_BYE, NULL, 0);
	c->closing = 1;
	if (!c->lq.head || lease_flush(c) == 1) {
		if (c->closing == 1) {
			shutdown(c->fd, SHUT_WR);
			c->closing = 2;
		}
	}
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
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one); /* the lease */
}

/* lease_open connects a new lease to ep, announced to hostd (INTENT before
 * connect, OPEN after), and sends HELLO. The connect itself waits at most
 * wait_ms: a local peer answers in well under a millisecond. Returns 0 (the
 * connection is ep->tx, or ep->tx_next if ep already has one) or -errno. */
int lease_open(struct mca_btl_base_endpoint_t *ep, int wait_ms)
{
	struct shunt_addr remote;
	memcpy(remote.ip, ep->addr.ip, 16);
	remote.port = ep->addr.port;
	struct sockaddr_storage dst, src;
	socklen_t dlen = to_sockaddr(&remote, &dst);
	struct shunt_addr me = shunt_btl.laddr;
	me.port = 0;
	socklen_t slen = to_sockaddr(&me, &src);
	if (src.ss_family != dst.ss_family)
		return -EAFNOSUPPORT;
	int fd = socket(dst.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	struct shunt_addr local;
	socklen_t l = sizeof src;
	if (bind(fd, (struct sockaddr *)&src, slen) < 0 || getsockname(fd, (struct sockaddr *)&src, &l) < 0) {
		int e = errno;
		close(fd);
		return -e;
	}
	from_sockaddr(&src, &local);
	int asked = mca_btl_shunt_component.ring && hostd_ready();
	if (asked) {
		hostd_listen();
		struct conn tmp = {.local = local, .remote = remote};
		hostd_intent(&tmp);
	}
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
	if (r < 0) {
		int e = errno;
		close(fd);
		return -e;
	}
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
	if (asked) {
		hostd_open(c, SHUNT_ROLE_ACTIVE);
	} else {
		c->fstate = F_TCP;
		c->reason = mca_btl_shunt_component.ring ? SHUNT_REASON_NO_HOSTD : R_LEASE_ONLY;
	}
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

/* ---- delivering ---- */

static inline void deliver(uint8_t tag, void *p, size_t len)
{
	mca_btl_active_message_callback_t *reg = mca_btl_base_active_message_trigger + tag;
	mca_btl_base_segment_t seg = {.seg_addr.pval = p, .seg_len = len};
	mca_btl_base_descriptor_t d;
	memset(&d, 0, sizeof d);
	d.des_segments = &seg;
	d.des_segment_count = 1;
	reg->cbfunc(&shunt_btl.super, tag, &d, reg->cbdata);
}

static void ring_rx_add(struct mca_btl_base_endpoint_t *ep)
{
	if (ep->rx_index >= 0)
		return;
	if (shunt_btl.nring_rx == shunt_btl.ring_rx_cap) {
		int cap = shunt_btl.ring_rx_cap ? 2 * shunt_btl.ring_rx_cap : 16;
		void *n = realloc(shunt_btl.ring_rx, cap * sizeof *shunt_btl.ring_rx);
		if (!n) {
			peer_failed(ep, "out of memory");
			return;
		}
		shunt_btl.ring_rx = n;
		shunt_btl.ring_rx_cap = cap;
	}
	ep->rx_index = shunt_btl.nring_rx;
	shunt_btl.ring_rx[shunt_btl.nring_rx++] = ep;
}

static void ring_rx_del(struct mca_btl_base_endpoint_t *ep)
{
	int i = ep->rx_index;
	if (i < 0)
		return;
	struct mca_btl_base_endpoint_t *last = shunt_btl.ring_rx[--shunt_btl.nring_rx];
	shunt_btl.ring_rx[i] = last;
	last->rx_index = i;
	ep->rx_index = -1;
}

/* ring_rx_poll delivers what arrived in ep's incoming ring: records. */
int ring_rx_poll(struct mca_btl_base_endpoint_t *ep)
{
	struct conn *c = ep->rx;
	int n = 0, err = 0;
	while (n < 32) {
		struct rec *h = rr_poll(&c->rr, &err);
		if (!h) {
			if (err)
				peer_failed(ep, "its ring holds an impossible record (corrupt)");
			break;
		}
		if (h->kind == REC_DATA) {
			ep->rx_frags++;
			deliver(h->tag, rec_payload(h), h->len);
			n++;
		}
		rr_consume(&c->rr, h);
		if (ep->rx != c || !ep->rx_ring)
			break;
	}
	return n;
}

/* drain reads ep's ring up to the writer's final count (DOWN). */
static int drain(struct mca_btl_base_endpoint_t *ep, struct conn *c, const struct rec_down *d)
{
	int err = 0;
	while (c->sf.r.own < d->bytes) {
		struct rec *h = rr_poll(&c->rr, &err);
		if (!h)
			return -1;
		if (h->kind == REC_DATA) {
			ep->rx_frags++;
			deliver(h->tag, rec_payload(h), h->len);
		}
		rr_consume(&c->rr, h);
	}
	return c->sf.r.own == d->bytes && c->rr.next == d->records && ep->rx_frags == d->frags ? 0 : -1;
}

/* ---- reading a lease ---- */

static struct mca_btl_base_endpoint_t *peer_of(const struct rec_hello *h);

/* handle processes one record of c: 1 done, 0 not yet (c is not where the
 * stream goes on), -1 c or its peer failed. */
static int handle(struct conn *c, struct rec *h, uint8_t *p)
{
	struct mca_btl_base_endpoint_t *ep = c->ep;
	if (c->out) { /* the reverse direction of our own lease */
		switch (h->kind) {
		case REC_RING_OK:
			c->peer_ok = 1;
			return 1;
		case REC_RING_NO:
			c->peer_no = 1;
			c->peer_reason = h->len >= sizeof(struct rec_no) ? ((struct rec_no *)p)->reason : R_PEER;
			return 1;
		case REC_BYE:
			c->bye = 1;
			return 1;
		}
		return -1;
	}
	if (!c->hello) {
		if (h->kind != REC_HELLO || h->len < sizeof(struct rec_hello))
			return -1;
		struct rec_hello hello;
		memcpy(&hello, p, sizeof hello);
		if (!(ep = peer_of(&hello)))
			return -1;
		c->ep = ep;
		c->hello = 1;
		c->lease = hello.lease;
		if (!ep->rx && hello.lease == 0)
			ep->rx = c;
		hostd_open(c, SHUNT_ROLE_PASSIVE);
		if (c->fstate == F_TCP)
			push_control(c, REC_RING_NO, &(struct rec_no){.reason = c->reason}, sizeof(struct rec_no));
		return 1;
	}
	if (h->kind == REC_RING_NO) { /* the sender will not use the ring: let it go */
		hostd_close(c);
		return 1;
	}
	if (h->kind == REC_BYE) {
		c->bye = 1;
		if (ep->rx == c) {
			ep->bye = 1;
			if (ep->rx_ring) {
				/* The sender wrote BYE after its last record: take
				 * those before the flow goes (finish closes it). */
				while (ep->rx == c && ep->rx_ring && ring_rx_poll(ep) > 0)
					;
				ep->rx_ring = 0;
				ring_rx_del(ep);
			}
		}
		finish(c);
		return 1;
	}
	if (ep->rx != c)
		return 0;
	if (ep->rx_ring) { /* the stream is in the ring: only its end comes here */
		struct rec_down d;
		if (h->kind != REC_DOWN || h->len < sizeof d)
			return -1;
		memcpy(&d, p, sizeof d);
		if (drain(ep, c, &d)) {
			peer_failed(ep, "its ring ended short of the count it announced (data lost)");
			return -1;
		}
		ep->rx_ring = 0;
		ring_rx_del(ep);
		hostd_close(c);
		say(1, "from %s: ring ended after %llu fragments; on the lease", ep->who, (unsigned long long)d.frags);
		return 1;
	}
	switch (h->kind) {
	case REC_DATA:
		if (h->stamp != ep->rx_frags) {
			peer_failed(ep, "a fragment is missing on its lease");
			return -1;
		}
		ep->rx_frags++;
		deliver(h->tag, p, h->len);
		return 1;
	case REC_SWITCH: {
		struct rec_switch s;
		if (h->len < sizeof s || c->fstate != F_READY)
			return -1;
		memcpy(&s, p, sizeof s);
		if (s.frags != ep->rx_frags) {
			peer_failed(ep, "its ring starts at another count than its lease ended");
			return -1;
		}
		c->rr.epoch = s.epoch;
		c->rr.next = 0;
		ep->rx_ring = 1;
		ring_rx_add(ep);
		return 1;
	}
	case REC_MOVE: {
		struct rec_move m;
		if (h->len < sizeof m)
			return -1;
		memcpy(&m, p, sizeof m);
		if (m.frags != ep->rx_frags) {
			peer_failed(ep, "its new lease starts at another count than the old one ended");
			return -1;
		}
		struct conn *n = NULL;
		for (struct conn *o = shunt_btl.conns; o; o = o->next)
			if (o->ep == ep && !o->out && o->hello && o->lease == m.lease && o != c)
				n = o;
		if (!n)
			return -1;
		ep->rx = n;
		hostd_close(c);
		if (n->in_len)
			shunt_btl.reparse = n; /* its SWITCH may be waiting (conn_parse) */
		return 1;
	}
	}
	return -1;
}

static void conn_parse(struct conn *c)
{
	size_t pos = 0;
	while (c->in_len - pos >= sizeof(struct rec) && !c->dead) {
		struct rec h;
		memcpy(&h, c->in + pos, sizeof h);
		if (h.len > max_record()) {
			if (c->ep)
				peer_failed(c->ep, "a record on its lease is too long");
			c->dead = 1;
			break;
		}
		if (c->in_len - pos < sizeof h + h.len)
			break;
		int r = handle(c, (struct rec *)(c->in + pos), c->in + pos + sizeof h);
		if (r == 0)
			break;
		if (r < 0) {
			if (c->ep && !c->dead)
				peer_failed(c->ep, "its lease carried a record out of order");
			c->dead = 1;
			break;
		}
		pos += sizeof h + h.len;
	}
	if (pos) {
		memmove(c->in, c->in + pos, c->in_len - pos);
		c->in_len -= pos;
	}
	struct conn *n = shunt_btl.reparse;
	if (n && n != c) {
		shunt_btl.reparse = NULL;
		conn_parse(n);
	}
}

/* conn_read reads what the socket has and handles it. */
static void conn_read(struct conn *c)
{
	for (;;) {
		if (!c->in) {
			c->in_cap = 2 * max_record();
			if (!(c->in = malloc(c->in_cap))) {
				peer_failed(c->ep, "out of memory for a lease buffer");
				c->dead = 1;
				return;
			}
		}
		if (c->in_len == c->in_cap) { /* a full buffer that waits for its turn */
			conn_parse(c);
			if (c->in_len == c->in_cap)
				return;
		}
		ssize_t n = read(c->fd, c->in + c->in_len, c->in_cap - c->in_len);
		if (n > 0) {
			c->in_len += n;
			conn_parse(c);
			if (c->dead)
				return;
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		c->eof = 1;
		if (!c->closing && !c->bye && !shunt_btl.finalizing && c->ep)
			peer_failed(c->ep, "its lease closed without goodbye: did the process die?");
		c->dead = 1;
		return;
	}
}

void conn_event(struct conn *c, uint32_t events)
{
	if (events & (EPOLLIN | EPOLLERR | EPOLLHUP))
		conn_read(c);
	if (!c->dead && (events & EPOLLOUT) && lease_flush(c) < 0) {
		if (c->ep && !c->closing && !shunt_btl.finalizing)
			peer_failed(c->ep, "its lease failed on write");
		c->dead = 1;
	}
}

/* ---- who is it ---- */

static struct mca_btl_base_endpoint_t *peer_of(const struct rec_hello *h)
{
	if (h->magic != SHUNT_BTL_MAGIC || h->version != SHUNT_BTL_VERSION || h->jobid != OPAL_PROC_MY_NAME.jobid) {
		say(0, "a lease from a process not of this job or of another btl/shunt version; closed");
		return NULL;
	}
	return ep_of(h->vpid);
}

/* ---- the sender's path ---- */

static uint64_t new_epoch(void)
{
	uint64_t e = 0;
	if (getrandom(&e, sizeof e, GRND_NONBLOCK) != sizeof e)
		e = (uint64_t)now_ns() * 0x9e3779b97f4a7c15ull ^ (uintptr_t)&e;
	return (e | 1ull << 32) & ~(1ull << 63);
}

static void schedule_retry(struct mca_btl_base_endpoint_t *ep, uint16_t reason)
{
	if (permanent(reason) || shunt_btl.finalizing) {
		ep->retry_at = 0;
		return;
	}
	int ms = ep->retry_ms ? ep->retry_ms : mca_btl_shunt_component.retry_ms;
	ep->retry_at = now_ns() + (int64_t)ms * 1000000;
	ep->retry_ms = 2 * ms < mca_btl_shunt_component.retry_max_ms ? 2 * ms : mca_btl_shunt_component.retry_max_ms;
}

/* ring_fits: the largest fragment's record fits in half the ring, as
 * rr_reserve requires (so a record never waits for the whole ring). */
static int ring_fits(struct conn *c) { return rec_span(shunt_btl.super.btl_max_send_size + REC_LINE) <= c->sf.w.cap / 2; }

static void switch_up(struct mca_btl_base_endpoint_t *ep, struct conn *c)
{
	if (!ring_fits(c)) {
		push_control(c, REC_RING_NO, &(struct rec_no){.reason = R_RING_SMALL}, sizeof(struct rec_no));
		hostd_close(c);
		c->reason = R_RING_SMALL;
		c->fstate = F_TCP;
		say(0, "to %s: the ring (%llu bytes) is too small for fragments of %zu bytes; raise ring_size in hostd's policy or lower btl_shunt_max_send_size",
		    ep->who, (unsigned long long)c->sf.w.cap, (size_t)shunt_btl.super.btl_max_send_size);
		return;
	}
	struct rec_switch s = {.epoch = new_epoch(), .frags = ep->tx_frags};
	c->rr.epoch = s.epoch;
	c->rr.next = 0;
	push_control(c, REC_SWITCH, &s, sizeof s);
	ep->tx_ring = 1;
	ep->retry_ms = 0;
	char what[80];
	snprintf(what, sizeof what, "ring (slot %u, %llu bytes)", c->sf.slot, (unsigned long long)c->sf.w.cap);
	say_path(ep, SHUNT_REASON_NONE, what);
}

/* go_down moves ep's stream from the ring back to its lease. */
static void go_down(struct mca_btl_base_endpoint_t *ep, struct conn *c, uint16_t reason)
{
	struct rec_down d = {.bytes = c->sf.w.own, .records = c->rr.next, .frags = ep->tx_frags};
	push_control(c, REC_DOWN, &d, sizeof d);
	ep->tx_ring = 0;
	hostd_close(c);
	c->fstate = F_TCP;
	c->reason = reason;
	struct frag *f;
	while ((f = fq_pop(&ep->q))) {
		f->hdr = (struct rec){.len = f->seg.seg_len, .kind = REC_DATA, .tag = f->hdr.tag};
		lease_push(c, f);
	}
	char what[64];
	snprintf(what, sizeof what, "ring ended, back on the lease");
	ep->said = 0;
	say_path(ep, reason, what);
	schedule_retry(ep, reason);
}

void paths_step(struct mca_btl_base_endpoint_t *ep)
{
	struct conn *c = ep->tx, *n = ep->tx_next;
	if (!c)
		return;
	hostd_take(c);
	if (n)
		hostd_take(n);
	if (c->closing)
		return;
	uint16_t why;
	if (ep->tx_ring) {
		if (c->rr.resv)
			return;
		if (conn_revoked(c, &why))
			go_down(ep, c, why);
		else if (rr_broken(&c->rr))
			go_down(ep, c, rr_reason(&c->rr));
		return;
	}
	if (c->fstate == F_READY && c->peer_ok) {
		switch_up(ep, c);
		return;
	}
	if (c->fstate == F_READY && c->peer_no) {
		hostd_close(c);
		c->fstate = F_TCP;
		c->reason = c->peer_reason;
	}
	if (c->fstate == F_READY && conn_revoked(c, &why)) { /* revoked before it was used */
		push_control(c, REC_RING_NO, &(struct rec_no){.reason = why}, sizeof(struct rec_no));
		hostd_close(c);
		c->fstate = F_TCP;
		c->reason = why;
	}
	if (c->fstate == F_TCP) {
		say_path(ep, c->reason, "tcp");
		if (!n && !ep->retry_at)
			schedule_retry(ep, c->reason);
		c->fstate = F_CLOSED; /* said; retries go by ep->retry_at */
	}
	if (n) {
		if (n->fstate == F_READY && n->peer_ok && ring_fits(n)) {
			struct rec_move m = {.lease = n->lease, .frags = ep->tx_frags};
			push_control(c, REC_MOVE, &m, sizeof m);
			finish(c);
			ep->tx = n;
			ep->tx_next = NULL;
			ep->said = 0;
			switch_up(ep, n);
			return;
		}
		int gave_up = n->fstate == F_TCP || n->fstate == F_CLOSED || n->peer_no ||
			      (n->fstate == F_READY && conn_revoked(n, &why));
		if (gave_up) {
			uint16_t r = n->fstate == F_TCP ? n->reason : n->peer_no ? n->peer_reason : R_RING_BROKEN;
			push_control(n, REC_RING_NO, &(struct rec_no){.reason = r}, sizeof(struct rec_no));
			finish(n);
			ep->tx_next = NULL;
			say(1, "to %s: a new lease got tcp (%s); staying on the old one", ep->who, reason_name(r));
			schedule_retry(ep, r);
		}
		return;
	}
	if (ep->retry_at && now_ns() >= ep->retry_at) {
		ep->retry_at = 0;
		int r = hostd_ready() ? lease_open(ep, mca_btl_shunt_component.connect_ms) : -ENOTCONN;
		if (r < 0)
			schedule_retry(ep, SHUNT_REASON_NO_HOSTD);
	}
}

/* rx_step: the receiving side of c answers hostd's verdict on the lease's
 * reverse direction. */

void rx_step(struct conn *c)
{
	int was = c->fstate;
	hostd_take(c);
	if (was != F_ASKING || c->fstate == F_ASKING || c->closing)
		return;
	if (c->fstate == F_READY)
		push_control(c, REC_RING_OK, NULL, 0);
	else
		push_control(c, REC_RING_NO, &(struct rec_no){.reason = c->reason}, sizeof(struct rec_no));
}
