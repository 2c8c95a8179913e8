/* Relayed ring pairs (btl_shunt.h; docs/mpi.md, "Across hosts"): a lease
 * to a rank on another host gets a ring pair whose other end is this
 * host's relay (READY's Relayed bit), which carries the ring's bytes to
 * the other host's relay and into the peer's ring (docs/crosshost.md).
 *
 * The relay copies bytes; it does not know records (records.c: stamps
 * stored last, records that never wrap, tails published once per stride),
 * and the two hosts' rings need not have one size. So on a relayed pair
 * the stream goes into the ring exactly as on a lease: each fragment a
 * 16-byte header (its stamp the fragment's number) and its payload,
 * written with the core's copy API (ring.c), which publishes the tail and
 * wakes the relay on every write. The reader copies the ring's bytes into
 * a buffer and parses them as it parses a lease.
 *
 * The handover cannot name ring pairs: each host's pair is its own (its
 * region, slot and generation), and the two ends of a stretch know only
 * their own. So:
 *
 *   - the sender switches once its write ring is reader-attached: the
 *     relay attaches it only once the other host's guest attached the
 *     ring this stretch's bytes go into there (docs/crosshost.md,
 *     "Attached end to end"), so RING_OK is not waited for;
 *   - the sender starts its ring at a random offset, the stretch's token,
 *     which the relays carry into the receiver's ring as its start, and
 *     SWITCH (epoch 0, a record ring's epoch never is) names it: the
 *     receiver reads its ring if it started at that token, waits while
 *     its ring has neither started nor been left, and otherwise (left
 *     unstarted, started for a later stretch, or let go) knows that none
 *     of the stretch reached this host: hostd gave the sender ResumeAll,
 *     and the lease carries the whole stretch after SWITCH;
 *   - a refused stretch gets no RING_NO (its pair's name means nothing
 *     here): the receiver lets go of a pair the relay left unstarted.
 *
 * The end of a relayed stretch is not a DOWN mark on the lease: the relay
 * frees a byte of the sender's ring only once the other host's ring holds
 * it, and only the receiving relay knows where that ring ended, so hostd
 * sends RESUME (docs/protocol.md) with that offset, X:
 *
 *   sender: leaves the ring at W, resends the ring's bytes [X, W) on the
 *           lease as they are (no header: they continue the stream), then
 *           the fragments that waited for ring room; LEFT. ResumeAll: from
 *           the stretch's start. ResumeReset, or an offset the ring does
 *           not hold: the stream cannot go on, and the peer fails (the job
 *           ends with an error naming it), as when its lease breaks.
 *   receiver: the relay marked its ring left at X: it reads the ring to
 *           that mark, hands the bytes of a record cut there to the
 *           lease's parser (the rest of it comes first on the lease), and
 *           reads the lease; LEFT.
 *
 * Offsets: the sender's ring's tail at the start (wtail0) is the token's
 * offset, as in the preload library (f->wtail0, f->wstart). */
#include "btl_shunt.h"

#include <stdlib.h>
#include <string.h>

/* room is what the relayed ring c->sf.w can take now, its reader's head
 * read afresh (0 if the head is impossible: the writer waits for RESUME). */
static uint64_t room(struct shunt_ring *w)
{
	uint64_t h = __atomic_load_n((uint64_t *)(w->hdr + SHUNT_OFF_HEAD), __ATOMIC_SEQ_CST);
	if (h < w->peer || h > w->own)
		return 0;
	w->peer = h;
	return w->cap - (w->own - h);
}

int relay_fits(struct mca_btl_base_endpoint_t *ep, size_t len) { return room(&ep->tx->sf.w) >= sizeof(struct shunt_rec) + len; }

int relay_put(struct mca_btl_base_endpoint_t *ep, uint8_t tag, const void *p, size_t len)
{
	struct shunt_ring *w = &ep->tx->sf.w;
	struct shunt_rec h = {.len = len, .kind = REC_DATA, .tag = tag, .stamp = ep->tx_frags};
	size_t total = sizeof h + len;
	/* All or nothing: a fragment is never cut between the ring and the
	 * queue, so RESUME's resend is the ring's bytes alone. */
	if (room(w) < total)
		return 0;
	if (total <= SMALL_FRAG) { /* one write: one tail store, one wake */
		uint8_t b[SMALL_FRAG];
		memcpy(b, &h, sizeof h);
		memcpy(b + sizeof h, p, len);
		if (shunt_ring_write(w, b, total) != (ssize_t)total)
			return 0;
	} else if (shunt_ring_write(w, &h, sizeof h) != (ssize_t)sizeof h ||
		   shunt_ring_write(w, p, len) != (ssize_t)len) {
		/* The ring was reset or left meanwhile (room was checked):
		 * nothing more goes in, and RESUME says what the peer has. */
		return 0;
	}
	ep->tx_frags++;
	return 1;
}

int relay_ready(struct conn *c) { return shunt_ring_reader_attached(&c->sf.w); }

/* idle: c holds a relayed pair the relay left without starting it. */
static int idle(struct conn *c)
{
	uint64_t st;
	return c->fstate == F_READY && c->relayed && shunt_ring_writer_left(&c->sf.r) && !shunt_ring_started(&c->sf.r, &st);
}

void relay_rx_idle(struct conn *c)
{
	struct mca_btl_base_endpoint_t *ep = c->ep;
	if (c->out || (ep && ep->rx == c && ep->rx_ring) || !idle(c))
		return;
	shunt_ring_leave_read(&c->sf.r);
	hostd_left(c, c->down ? c->down_reason : SHUNT_REASON_TIMEOUT);
}

int relay_rx_switch(struct mca_btl_base_endpoint_t *ep, struct conn *c, uint64_t token)
{
	uint64_t st;
	if (c->fstate == F_READY && !c->relayed) {
		peer_failed(ep, "it writes a relayed stream into a ring that hostd says is not relayed");
		return -1;
	}
	/* One look at the ring, the leave mark first: a writer starts before
	 * it leaves, so a ring seen left then shows its start if it had one.
	 * (Two looks at the start raced with the bridge starting the ring
	 * between them: the stretch was taken for one that never came, and
	 * the job hung, its sender on the ring and its receiver on the lease;
	 * TestVsockMPI, once in 16 runs.) */
	int held = c->fstate == F_READY;
	int left = held && shunt_ring_writer_left(&c->sf.r);
	int started = held && shunt_ring_started(&c->sf.r, &st);
	if (started && st == token) {
		c->rb_len = 0;
		ep->rx_ring = 1;
		ring_rx_add(ep);
		return 1;
	}
	if (held && !left && !started)
		return 0; /* its bytes may still come: lease_work parses again */
	say(1, "from %s: none of a relayed stretch reached this host; it comes on the lease (%s, ring %s at %llu, stretch %llu%s)", ep->who,
	    held ? "pair held" : "no pair", started ? "started" : "not started", started ? (unsigned long long)st : 0ull,
	    (unsigned long long)token, left ? ", ring left" : "");
	relay_rx_idle(c);
	return 1;
}

/* rx_end: ep's relayed ring c ended (left by the relay, drained): the
 * stream goes on on the lease, after the cut record's first bytes. */
static void rx_end(struct mca_btl_base_endpoint_t *ep, struct conn *c, size_t pos)
{
	ep->rx_ring = 0;
	ring_rx_del(ep);
	shunt_ring_leave_read(&c->sf.r);
	hostd_left(c, c->down ? c->down_reason : SHUNT_REASON_PEER_GONE);
	size_t left = c->rb_len - pos;
	c->rb_len = 0;
	say(1, "from %s: relayed ring ended after %llu fragments; on the lease", ep->who,
	    (unsigned long long)ep->rx_frags);
	lease_take_back(c, c->rb + pos, left);
}

int relay_rx_poll(struct mca_btl_base_endpoint_t *ep)
{
	struct conn *c = ep->rx;
	if (!c->rb) {
		c->rb_cap = 2 * max_record();
		if (!(c->rb = malloc(c->rb_cap))) {
			peer_failed(ep, "out of memory for its relayed ring's buffer");
			return 0;
		}
	}
	size_t pos = 0;
	int n = 0;
	while (n < 32) {
		size_t have = c->rb_len - pos;
		struct shunt_rec h;
		if (have >= sizeof h) {
			memcpy(&h, c->rb + pos, sizeof h);
			if (h.kind != REC_DATA || h.len > max_record() - sizeof h || h.stamp != ep->rx_frags) {
				peer_failed(ep, "its relayed ring carried a record out of order (data lost or corrupt)");
				return n;
			}
			if (have >= sizeof h + h.len) {
				ep->rx_frags++;
				deliver(h.tag, c->rb + pos + sizeof h, h.len);
				pos += sizeof h + h.len;
				n++;
				if (ep->rx != c || !ep->rx_ring)
					break;
				continue;
			}
		}
		/* No whole record: read more. */
		if (pos) {
			memmove(c->rb, c->rb + pos, c->rb_len - pos);
			c->rb_len -= pos;
			pos = 0;
		}
		ssize_t k = shunt_ring_read(&c->sf.r, c->rb + c->rb_len, c->rb_cap - c->rb_len);
		if (k > 0) {
			c->rb_len += k;
			continue;
		}
		if (k == SHUNT_EAGAIN)
			break;
		if (k == SHUNT_ELEFT || k == 0) {
			rx_end(ep, c, 0);
			return n;
		}
		if (!shunt_btl.finalizing)
			peer_failed(ep, "its relayed ring was reset or is corrupt");
		return n;
	}
	if (pos && ep->rx == c) {
		memmove(c->rb, c->rb + pos, c->rb_len - pos);
		c->rb_len -= pos;
	}
	return n;
}

int relay_resume(struct mca_btl_base_endpoint_t *ep, struct conn *c)
{
	struct shunt_ring *w = &c->sf.w;
	uint64_t off = c->resume_at, start = c->token, end = start + (w->own - c->wtail0);
	uint16_t reason = c->down_reason;
	shunt_ring_leave(w);
	if (off == SHUNT_RESUME_ALL)
		off = start;
	if (c->gone) /* a vsock stretch's peer-gone (hostd.c): no reader left for them */
		off = end;
	int ok = off >= start && off <= end;
	size_t n = ok ? end - off : 0;
	uint8_t *buf = n ? malloc(n) : NULL;
	ssize_t k = !ok || (n && !buf) ? SHUNT_EINVAL : 0;
	if (!k && n)
		k = shunt_ring_unfreed(w, c->wtail0 + (off - start), buf, n);
	/* The ring's bytes from X, as they are: the stream goes on there. */
	size_t max = shunt_btl.super.btl_max_send_size;
	for (size_t at = 0; k == (ssize_t)n && at < n;) {
		size_t m = n - at < max ? n - at : max;
		struct frag *f = frag_get(m);
		if (!f) {
			k = -1;
			break;
		}
		memcpy(f->buf, buf + at, m);
		f->internal = 1;
		f->raw = 1;
		lease_push(c, f);
		at += m;
	}
	free(buf);
	ep->tx_ring = 0;
	hostd_left(c, reason);
	if (k == (ssize_t)n) {
		say(1, "to %s: relayed ring ended (%s): %zu of its bytes resent on the lease", ep->who, reason_name(reason), n);
		return 0;
	}
	char why[240];
	snprintf(why, sizeof why,
		 "its relayed stream cannot go on (%s): hostd says the other host's ring ended at %s%llu, this ring's stretch is [%llu, %llu)",
		 reason_name(reason), c->resume_at == SHUNT_RESUME_RESET ? "an unknown offset " : "",
		 (unsigned long long)c->resume_at, (unsigned long long)start, (unsigned long long)end);
	peer_failed(ep, why);
	return -1;
}
