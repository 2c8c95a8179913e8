/* Handover (btl_shunt.h): the path state machine of each direction, which
 * moves its stream between the lease and a ring, marking every move in the
 * stream itself (SWITCH, DOWN, MOVE).
 *
 * Sender's side of a direction (paths_step):
 *
 *   lease k, on TCP --READY + RING_OK(pair)--> SWITCH(pair), its ring
 *        ^    |                                       |
 *        |    | TCP(reason) hostd                     | DOWN(reason) from hostd,
 *        |    | does not recover from                 | or the ring broke
 *        |    v                                       v
 *        |  retry (backoff)       lease k <-- DOWN(bytes, records) mark; LEFT
 *        |    |                      (READY again later: SWITCH again)
 *        |    v
 *   MOVE(k+1) and BYE on lease k once lease k+1 got READY + RING_OK;
 *   SWITCH on lease k+1, its ring
 *
 * A pair that hostd takes back before the sender used it (DOWN, or a ring
 * too small) gets RING_NO(pair) on the lease instead of SWITCH.
 *
 * Receiver's side: it reads the one place where the stream goes on (ep->rx
 * and ep->rx_ring) and follows the marks; it attaches a pair when hostd
 * says READY and answers RING_OK(pair) on the lease's reverse direction
 * (hostd.c), so the sender never writes a ring that its reader cannot
 * read. It leaves a pair (LEFT) when the stream says the sender did: DOWN
 * drained, or RING_NO; hostd's DOWN needs nothing more from it. */
#include "btl_shunt.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

/* ---- reasons ---- */

const char *reason_name(uint16_t r)
{
	switch (r) {
	case R_REFUSED: return "connection refused";
	case R_UNREACHABLE: return "unreachable";
	case R_RING_SMALL: return "ring too small";
	case R_RING_BROKEN: return "ring reset";
	case R_LEASE_ONLY: return "btl_shunt_ring=0";
	case R_NOT_RELAYED: return "vsock stretch to a peer that is not a vsock VM";
	}
	return shunt_reason_name(r);
}

/* permanent: a new lease would get the same answer. */
static int permanent(uint16_t r)
{
	return r == SHUNT_REASON_LOOPBACK || r == SHUNT_REASON_NOT_LOCAL || r == SHUNT_REASON_CROSS_GROUP ||
	       r == SHUNT_REASON_DISABLED || r == SHUNT_REASON_VERSION || r == R_RING_SMALL || r == R_LEASE_ONLY ||
	       r == R_NOT_RELAYED;
}

/* recovers: hostd keeps the lease's record with this reason and sends
 * READY by itself once the reason goes (a policy reload, the firewall's
 * check, room in the region), or answers later (no-intent, no-listener:
 * READY or TCP(timeout) follows). For the others (no hostd, a pairing
 * timeout, the peer's session or the conntrack entry gone) only a new
 * lease can get a ring. */
static int recovers(uint16_t r)
{
	switch (r) {
	case SHUNT_REASON_POLICY: case SHUNT_REASON_POLICY_RELOAD: case SHUNT_REASON_GUEST_LIMIT:
	case SHUNT_REASON_GUEST_QUOTA: case SHUNT_REASON_NO_SPACE: case SHUNT_REASON_ADMIN: case SHUNT_REASON_FIREWALL:
	case SHUNT_REASON_INTERNAL: case SHUNT_REASON_NO_INTENT: case SHUNT_REASON_NO_LISTENER:
		return 1;
	}
	return 0;
}

void say_path(struct mca_btl_base_endpoint_t *ep, uint16_t reason, const char *what)
{
	if (ep->said && ep->said_reason == reason)
		return;
	ep->said = 1;
	ep->said_reason = reason;
	/* peer-gone at level 1: it is how every job ends (the first rank to
	 * finish ends its session), and a peer that really died is reported
	 * at level 0 when its lease ends without goodbye. */
	int level = reason == SHUNT_REASON_NONE || reason == SHUNT_REASON_PEER_GONE ? 1 : 0;
	say(level, "to %s: %s%s%s%s", ep->who, what, reason ? " (" : "",
	    reason ? reason_name(reason) : "", reason ? ")" : "");
}

/* ---- the receiver's ring ---- */

void ring_rx_add(struct mca_btl_base_endpoint_t *ep)
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

void ring_rx_del(struct mca_btl_base_endpoint_t *ep)
{
	int i = ep->rx_index;
	if (i < 0)
		return;
	struct mca_btl_base_endpoint_t *last = shunt_btl.ring_rx[--shunt_btl.nring_rx];
	shunt_btl.ring_rx[i] = last;
	last->rx_index = i;
	ep->rx_index = -1;
}

/* ring_rx_poll delivers what arrived in ep's incoming ring: records, or
 * on a relayed pair the stream's bytes (relayed.c). */
int ring_rx_poll(struct mca_btl_base_endpoint_t *ep)
{
	struct conn *c = ep->rx;
	int n = 0, err = 0;
	if (c->relayed)
		return relay_rx_poll(ep);
	while (n < 32) {
		struct shunt_rec *h = shunt_rec_poll(&c->rr, &err);
		if (!h) {
			if (err)
				peer_failed(ep, "its ring holds an impossible record (corrupt)");
			break;
		}
		if (h->kind == REC_DATA) {
			ep->rx_frags++;
			deliver(h->tag, shunt_rec_payload(h), h->len);
			n++;
		}
		shunt_rec_consume(&c->rr, h);
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
		struct shunt_rec *h = shunt_rec_poll(&c->rr, &err);
		if (!h)
			return -1;
		if (h->kind == REC_DATA) {
			ep->rx_frags++;
			deliver(h->tag, shunt_rec_payload(h), h->len);
		}
		shunt_rec_consume(&c->rr, h);
	}
	return c->sf.r.own == d->bytes && c->rr.next == d->records && ep->rx_frags == d->frags ? 0 : -1;
}

/* rx_switch takes SWITCH on ep's lease c: the stream goes on in c's ring. */
int rx_switch(struct mca_btl_base_endpoint_t *ep, struct conn *c, const struct shunt_rec *h, const uint8_t *p)
{
	struct rec_switch s;
	if (h->len < sizeof s)
		return -1;
	memcpy(&s, p, sizeof s);
	if (s.frags != ep->rx_frags) {
		peer_failed(ep, "its ring starts at another count than its lease ended");
		return -1;
	}
	if (s.epoch == 0) /* relayed.c: a relayed stretch, named by its start (gen) */
		return relay_rx_switch(ep, c, s.gen);
	struct rec_ring pair = {.gen = s.gen, .region = s.region, .slot = s.slot};
	if (!holds_pair(c, &pair)) {
		peer_failed(ep, "it switched to a ring pair this end does not hold");
		return -1;
	}
	if (c->relayed) {
		peer_failed(ep, "it writes records into a ring that hostd says is relayed");
		return -1;
	}
	c->rr.epoch = s.epoch;
	c->rr.next = 0;
	ep->rx_ring = 1;
	ring_rx_add(ep);
	return 1;
}

/* rx_down takes the record that ends ep's ring on its lease c, which must
 * be DOWN: it drains the ring to DOWN's count, then reads the lease. */
int rx_down(struct mca_btl_base_endpoint_t *ep, struct conn *c, const struct shunt_rec *h, const uint8_t *p)
{
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
	shunt_ring_leave_read(&c->sf.r);
	hostd_left(c, c->down ? c->down_reason : R_RING_BROKEN);
	say(1, "from %s: ring ended after %llu fragments; on the lease", ep->who, (unsigned long long)d.frags);
	return 1;
}

/* rx_refused takes RING_NO on c: the sender will not use the pair it
 * names. Off it now, or when its READY comes (hostd.c). */
int rx_refused(struct conn *c, const struct shunt_rec *h, const uint8_t *p)
{
	struct rec_ring r;
	if (h->len < sizeof r)
		return -1;
	memcpy(&r, p, sizeof r);
	if (holds_pair(c, &r)) {
		shunt_ring_leave_read(&c->sf.r);
		hostd_left(c, r.reason);
	} else {
		c->no = r;
	}
	return 1;
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
	if (permanent(reason) || recovers(reason) || shunt_btl.finalizing) {
		ep->retry_at = 0;
		return;
	}
	int ms = ep->retry_ms ? ep->retry_ms : mca_btl_shunt_component.retry_ms;
	ep->retry_at = now_ns() + (int64_t)ms * 1000000;
	ep->retry_ms = 2 * ms < mca_btl_shunt_component.retry_max_ms ? 2 * ms : mca_btl_shunt_component.retry_max_ms;
}

/* ring_fits: the largest fragment's record fits in half the ring, as
 * shunt_rec_reserve requires (so a record never waits for the whole ring). */
static int ring_fits(struct conn *c) { return shunt_rec_span(shunt_btl.super.btl_max_send_size + SHUNT_REC_LINE) <= c->sf.w.cap / 2; }

/* ring_reason: why c's ring ended, as the ring says, else R_RING_BROKEN. */
static uint16_t ring_reason(struct conn *c)
{
	uint16_t r = shunt_rec_reason(&c->rr);
	return r ? r : R_RING_BROKEN;
}

/* refuse tells the receiver that c's pair will not carry the stream
 * (RING_NO) and leaves it. */
static void refuse(struct conn *c, uint16_t reason)
{
	struct rec_ring no = {.gen = c->sf.gen, .region = c->sf.region_id, .slot = c->sf.slot, .reason = reason};
	/* A relayed pair's name means nothing on the other host: its
	 * receiver lets its own go once the relay left it unstarted. */
	if (!c->relayed)
		push_control(c, REC_RING_NO, &no, sizeof no);
	shunt_ring_leave(&c->sf.w);
	hostd_left(c, reason);
}

/* peer_ok: the receiver attached the ring the stream would go into: it
 * said RING_OK for this pair, or (relayed) the relay says so. A vsock
 * stretch's write ring is attached by this VM's shunt-vstretchd as soon
 * as its stream opens, whatever the other end did, so there RING_OK is
 * waited for too: both VMs' READYs name the one flow of this host, and
 * a SWITCH that came before the receiver's READY would be taken for a
 * stretch that never reached it (relayed.c). */
static int peer_ok(struct conn *c)
{
	if (!c->relayed)
		return holds_pair(c, &c->ok);
	return relay_ready(c) && (!shunt_flow_stretch(&c->sf) || holds_pair(c, &c->ok));
}

/* switch_up moves ep's stream into c's ring (SWITCH on c), c the lease it
 * is on: 1, or 0 if the ring is too small (then c is done with hostd). */
static int switch_up(struct mca_btl_base_endpoint_t *ep, struct conn *c)
{
	if (!ring_fits(c)) {
		say(0, "to %s: the ring (%llu bytes) is too small for fragments of %zu bytes; raise ring_size in hostd's policy or lower btl_shunt_max_send_size",
		    ep->who, (unsigned long long)c->sf.w.cap, (size_t)shunt_btl.super.btl_max_send_size);
		refuse(c, R_RING_SMALL);
		hostd_close(c); /* hostd forgets the lease: no READY again */
		c->reason = R_RING_SMALL;
		return 0;
	}
	struct rec_switch s = {.epoch = new_epoch(), .frags = ep->tx_frags, .gen = c->sf.gen, .region = c->sf.region_id,
			       .slot = c->sf.slot};
	c->wtail0 = c->sf.w.own;
	if (c->relayed) { /* relayed.c: epoch 0, the stretch named by its start */
		s.epoch = 0;
		s.gen = c->token = new_epoch() & ((1ull << 62) - 1);
	}
	c->rr.epoch = s.epoch;
	c->rr.next = 0;
	shunt_ring_start(&c->sf.w, c->relayed ? c->token : 0);
	push_control(c, REC_SWITCH, &s, sizeof s);
	ep->tx_ring = 1;
	ep->retry_ms = 0;
	ep->retry_at = 0;
	char what[80];
	snprintf(what, sizeof what, "%sring (slot %u, %llu bytes)", c->relayed ? "relayed " : "", c->sf.slot,
		 (unsigned long long)c->sf.w.cap);
	say_path(ep, SHUNT_REASON_NONE, what);
	return 1;
}

/* go_down moves ep's stream from the ring back to its lease c: a DOWN
 * mark, or on a relayed pair the resend from RESUME's offset (relayed.c). */
static void go_down(struct mca_btl_base_endpoint_t *ep, struct conn *c, uint16_t reason)
{
	if (c->relayed) {
		if (relay_resume(ep, c))
			return;
	} else {
		struct rec_down d = {.bytes = c->sf.w.own, .records = c->rr.next, .frags = ep->tx_frags};
		push_control(c, REC_DOWN, &d, sizeof d);
		ep->tx_ring = 0;
		shunt_ring_leave(&c->sf.w);
		hostd_left(c, reason);
	}
	struct frag *f;
	while ((f = fq_pop(&ep->q))) {
		f->hdr = (struct shunt_rec){.len = f->seg.seg_len, .kind = REC_DATA, .tag = f->hdr.tag};
		lease_push(c, f);
	}
	ep->said = 0;
	say_path(ep, reason, "ring ended, back on the lease");
	schedule_retry(ep, reason);
}

/* drop_next gives up ep's newer lease n: BYE, CLOSE. */
static void drop_next(struct mca_btl_base_endpoint_t *ep, struct conn *n, uint16_t r, int retry)
{
	if (n->fstate == F_READY)
		refuse(n, r);
	finish(n);
	ep->tx_next = NULL;
	if (retry) {
		say(1, "to %s: a new lease got tcp (%s); staying on the old one", ep->who, reason_name(r));
		schedule_retry(ep, r);
	}
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
	if (ep->tx_ring) {
		if (c->rr.resv)
			return;
		if (c->down)
			go_down(ep, c, c->down_reason);
		else if (!c->relayed && shunt_rec_broken(&c->rr)) /* relayed: RESUME says where it ended */
			go_down(ep, c, ring_reason(c));
		else if (n)
			drop_next(ep, n, SHUNT_REASON_NONE, 0);
		return;
	}
	if (c->fstate == F_READY && c->down) /* taken back before it was used */
		refuse(c, c->down_reason);
	if (c->fstate == F_READY && peer_ok(c) && switch_up(ep, c)) {
		if (n)
			drop_next(ep, n, SHUNT_REASON_NONE, 0);
		return;
	}
	if ((c->fstate == F_TCP || c->fstate == F_NONE) && c->told) {
		c->told = 0;
		/* no-intent and no-listener are answers for now: READY or
		 * TCP(timeout) follows. */
		if (c->reason != SHUNT_REASON_NO_INTENT && c->reason != SHUNT_REASON_NO_LISTENER)
			say_path(ep, c->reason, "tcp");
		if (!n && !ep->retry_at)
			schedule_retry(ep, c->reason);
	}
	if (n) {
		if (n->fstate == F_READY && n->down)
			refuse(n, n->down_reason);
		if (n->fstate == F_READY && peer_ok(n) && ring_fits(n)) {
			struct rec_move m = {.lease = n->lease, .frags = ep->tx_frags};
			push_control(c, REC_MOVE, &m, sizeof m);
			finish(c);
			ep->tx = n;
			ep->tx_next = NULL;
			ep->said = 0;
			switch_up(ep, n);
			return;
		}
		if (n->fstate == F_READY && !ring_fits(n))
			drop_next(ep, n, R_RING_SMALL, 1);
		else if ((n->fstate == F_TCP && !recovers(n->reason)) || n->fstate == F_NONE || n->fstate == F_CLOSED)
			drop_next(ep, n, n->reason, 1);
		return;
	}
	if (ep->retry_at && now_ns() >= ep->retry_at) {
		ep->retry_at = 0;
		int r = hostd_ready() ? lease_open(ep, mca_btl_shunt_component.connect_ms) : -ENOTCONN;
		if (r < 0)
			schedule_retry(ep, SHUNT_REASON_NO_HOSTD);
	}
}
