/* Lease I/O (btl_shunt.h): a lease's non-blocking writes (a queue of
 * records, the head maybe partly written) and reads (a buffer parsed into
 * records), and what the records on a lease mean.
 *
 * A lease carries, from sender to receiver, HELLO first, then the
 * direction's stream while it is on this lease (DATA, numbered by the
 * stream's count) and its marks (SWITCH, DOWN, MOVE; handover.c), RING_NO
 * for a pair it will not use, and BYE; in the reverse direction the
 * receiver's RING_OK for each pair it attached, and its BYE.
 * A record on a lease that is not (or not yet) where the stream goes on
 * waits in the buffer until it is (MOVE). Any record out of order fails
 * the peer. */
#include "btl_shunt.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

size_t max_record(void) { return sizeof(struct shunt_rec) + shunt_btl.super.btl_max_send_size + 1024; }

/* ---- writing a lease ---- */

/* lease_writev writes iov to a lease without SIGPIPE: a peer that is gone
 * is an error for the BTL to name, never a signal that kills the rank. */
ssize_t lease_writev(int fd, struct iovec *iov, int n)
{
	struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
	return sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* lease_flush writes queued records: 1 when the queue is empty, 0 when the
 * socket is full (EPOLLOUT then resumes), -1 when the connection failed. */
int lease_flush(struct conn *c)
{
	struct frag *f;
	while ((f = c->lq.head)) {
		size_t hl = f->raw ? 0 : sizeof f->hdr; /* raw: a relayed ring's resent bytes */
		struct iovec iov[2] = {{&f->hdr, hl}, {f->seg.seg_addr.pval, f->seg.seg_len}};
		size_t total = hl + f->seg.seg_len, skip = f->done;
		int i = 0;
		if (skip >= hl) {
			skip -= hl;
			i = 1;
		}
		iov[i].iov_base = (uint8_t *)iov[i].iov_base + skip;
		iov[i].iov_len -= skip;
		ssize_t n = lease_writev(c->fd, iov + i, 2 - i);
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

void push_control(struct conn *c, uint8_t kind, const void *p, size_t n)
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
void finish(struct conn *c)
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

/* ---- reading a lease ---- */

/* handle processes one record of c: 1 done, 0 not yet (c is not where the
 * stream goes on), -1 c or its peer failed. */
static int handle(struct conn *c, struct shunt_rec *h, uint8_t *p)
{
	struct mca_btl_base_endpoint_t *ep = c->ep;
	if (c->out) { /* the reverse direction of our own lease */
		switch (h->kind) {
		case REC_RING_OK:
			if (h->len < sizeof c->ok)
				return -1;
			memcpy(&c->ok, p, sizeof c->ok);
			return 1;
		case REC_BYE:
			c->bye = 1;
			return 1;
		}
		return -1;
	}
	if (!c->hello)
		return conn_hello(c, h, p);
	if (h->kind == REC_RING_NO) /* the sender will not use a pair: let it go */
		return rx_refused(c, h, p);
	if (h->kind == REC_BYE) {
		c->bye = 1;
		if (ep->rx == c && ep->rx_ring && c->relayed) {
			/* Its ring's last bytes may still be on their way through
			 * the relays (its end leaves the ring at CLOSE): BYE is
			 * taken once the ring ended (relayed.c); an EOF meanwhile
			 * is no error. */
			ep->bye = 1;
			return 0;
		}
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
	if (ep->rx_ring) /* the stream is in the ring: only its end comes here (relayed: after the ring's end) */
		return c->relayed ? 0 : rx_down(ep, c, h, p);
	switch (h->kind) {
	case REC_DATA:
		if (h->stamp != ep->rx_frags) {
			peer_failed(ep, "a fragment is missing on its lease");
			return -1;
		}
		ep->rx_frags++;
		deliver(h->tag, p, h->len);
		return 1;
	case REC_SWITCH:
		return rx_switch(ep, c, h, p);
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
	while (c->in_len - pos >= sizeof(struct shunt_rec) && !c->dead) {
		struct shunt_rec h;
		memcpy(&h, c->in + pos, sizeof h);
		if (h.len > max_record()) {
			if (c->ep)
				peer_failed(c->ep, "a record on its lease is too long");
			c->dead = 1;
			break;
		}
		if (c->in_len - pos < sizeof h + h.len)
			break;
		int r = handle(c, (struct shunt_rec *)(c->in + pos), c->in + pos + sizeof h);
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

void lease_take_back(struct conn *c, const uint8_t *p, size_t n)
{
	if (n) {
		if (c->in_len + n > c->in_cap || !c->in) {
			uint8_t *b = realloc(c->in, c->in_len + n);
			if (!b) {
				peer_failed(c->ep, "out of memory for a lease buffer");
				c->dead = 1;
				return;
			}
			c->in = b;
			c->in_cap = c->in_len + n;
		}
		memmove(c->in + n, c->in, c->in_len);
		memcpy(c->in, p, n);
		c->in_len += n;
	}
	conn_parse(c);
}

/* lease_end_cause says why a lease ended without the peer's goodbye, by
 * what the kernel said: a FIN is the peer's process exiting (the kernel
 * closes its sockets), a reset is a firewall's REJECT with tcp-reset as
 * often as a process that died with bytes unread, a time-out is a path
 * that stopped carrying packets. */
static const char *lease_end_cause(int err)
{
	switch (err) {
	case 0:
		return "its lease closed without goodbye: did the process exit or die?";
	case ECONNRESET:
		return "its lease was reset (a firewall rule that rejects it with a TCP reset, or the process died with bytes unread)";
	case ETIMEDOUT:
		return "its lease timed out (a firewall now dropping its packets, or the peer's guest gone)";
	case EHOSTUNREACH:
	case ENETUNREACH:
		return "its lease lost its route (the peer's guest or its network gone, or a firewall's REJECT)";
	}
	return "its lease failed on read";
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
		int err = n < 0 ? errno : 0;
		c->eof = 1;
		if (!c->closing && !c->bye && !shunt_btl.finalizing && c->ep)
			peer_failed(c->ep, lease_end_cause(err));
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
