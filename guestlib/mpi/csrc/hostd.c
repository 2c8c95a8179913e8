/* The BTL's session with hostd (btl_shunt.h), through the core's session
 * (shunt.h), protocol version 3: LISTEN for the lease listener; OPEN once a
 * lease connected (active) or said HELLO (passive), with nothing waiting
 * for the answer; then any number of READY, TCP and DOWN for that lease's
 * request id, for its whole life (docs/protocol.md):
 *
 *   TCP(reason)* ... READY ... DOWN ... READY ...
 *
 * READY: attach the ring pair (handover.c decides when the stream moves).
 * DOWN: the direction goes back to its lease (handover.c), and once this
 * end is off the pair, LEFT (hostd_left): hostd frees the pair when both
 * ends left, and may send READY again with a fresh pair when the reason
 * goes. CLOSE (hostd_close) when the BTL is done with a lease: hostd
 * forgets it, and a READY that crossed the CLOSE is given back (hostd
 * releases our side of it at the CLOSE). After a hostd restart: LISTEN,
 * REATTACH (with the request id) for the pairs held, OPEN again (same
 * request id) for the leases on TCP.
 *
 * The registry: one entry per announced lease, found by request id by the
 * session's reader thread (on_conn), which queues what hostd said there;
 * the progress loop applies it (hostd_take). Under reg_mu; the data path
 * never takes it.
 *
 * Lifetime: the core's session has no close yet (shunt.h), and its reader
 * thread runs code of this library, so the library pins itself
 * (RTLD_NODELETE) before the session starts: Open MPI unloads components
 * at MPI_Finalize, and a thread left without its code would crash the
 * process later. */
#include "btl_shunt.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_CONTROL "/run/shunt/guest.sock"

static struct shunt_session *session;
static int listened; /* hostd heard our LISTEN (reset when the channel drops) */
static int pending;  /* atomic: some entry has events */

/* ---- the registry ---- */

/* An event: what hostd said (READY, TCP, DOWN), the fields that matter. */
struct hword {
	struct hword *next;
	uint8_t type, side, relayed;
	uint16_t reason;
	uint32_t region_id, slot, capacity;
	uint64_t gen, ring_ab, ring_ba, offset;
};

/* held: an announced lease. c, req, role, local and remote are set once;
 * rings and the pair's names change under reg_mu (the progress loop) and
 * are what a new hostd hears (on_announce). */
struct held {
	struct conn *c;
	uint32_t req;
	uint8_t role;
	struct shunt_addr local, remote;
	int rings; /* holds an attached pair: REATTACH it, else OPEN again */
	uint32_t region_id, slot;
	uint64_t gen;
	uint8_t side;
	struct hword *head, *tail;
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static struct held **reg;
static int nreg, reg_cap;

static struct held *reg_add(struct conn *c, uint32_t req, uint8_t role)
{
	struct held *h = calloc(1, sizeof *h);
	if (!h)
		return NULL;
	*h = (struct held){.c = c, .req = req, .role = role, .local = c->local, .remote = c->remote};
	pthread_mutex_lock(&reg_mu);
	if (nreg == reg_cap) {
		int cap = reg_cap ? 2 * reg_cap : 16;
		struct held **n = realloc(reg, cap * sizeof *n);
		if (!n) {
			pthread_mutex_unlock(&reg_mu);
			free(h);
			return NULL;
		}
		reg = n;
		reg_cap = cap;
	}
	reg[nreg++] = h;
	pthread_mutex_unlock(&reg_mu);
	return h;
}

static void reg_del(struct held *h)
{
	pthread_mutex_lock(&reg_mu);
	for (int i = 0; i < nreg; i++)
		if (reg[i] == h) {
			reg[i] = reg[--nreg];
			break;
		}
	pthread_mutex_unlock(&reg_mu);
	for (struct hword *e = h->head, *next; e; e = next) {
		next = e->next;
		free(e);
	}
	free(h);
}

/* reg_rings records the pair c holds now (rings 0: none), for a new hostd. */
static void reg_rings(struct conn *c, int rings)
{
	if (!c->h)
		return;
	pthread_mutex_lock(&reg_mu);
	c->h->rings = rings;
	c->h->region_id = c->sf.region_id;
	c->h->slot = c->sf.slot;
	c->h->gen = c->sf.gen;
	c->h->side = c->sf.side;
	pthread_mutex_unlock(&reg_mu);
}

/* give_back returns a READY that no lease takes (its lease closed): CLOSE
 * by request id and pair, which releases our side of it. A CLOSE that
 * hostd already had changes nothing. */
static void give_back(const struct shunt_msg *m)
{
	struct shunt_msg c = {.type = SHUNT_CLOSE, .req_id = m->req_id, .region_id = m->region_id, .slot = m->slot,
			      .gen = m->gen, .side = m->side};
	shunt_session_send(session, &c);
}

/* ---- session callbacks (the session's reader thread) ---- */

/* on_log passes the session's lines on, each distinct one once in a row
 * (a missing hostd is retried every second). */
static void on_log(void *arg, const char *line)
{
	(void)arg;
	static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
	static char last[256];
	pthread_mutex_lock(&mu);
	int again = !strncmp(last, line, sizeof last - 1);
	snprintf(last, sizeof last, "%s", line);
	pthread_mutex_unlock(&mu);
	if (!again)
		say(1, "%s", line);
	if (strstr(line, "lost hostd"))
		__atomic_store_n(&listened, 0, __ATOMIC_SEQ_CST);
}

/* queue hands m to the lease it names: by request id, or (a DOWN or
 * REVOKE naming no request) by the pair held. A READY no lease takes is
 * given back. */
static void queue(const struct shunt_msg *m)
{
	struct hword *e = malloc(sizeof *e);
	int taken = 0;
	pthread_mutex_lock(&reg_mu);
	for (int i = 0; i < nreg && e && !taken; i++) {
		struct held *h = reg[i];
		if (m->req_id ? h->req != m->req_id
			      : !h->rings || h->gen != m->gen || h->slot != m->slot || h->region_id != m->region_id)
			continue;
		*e = (struct hword){.type = m->type == SHUNT_REVOKE ? SHUNT_DOWN : m->type, .side = m->side, .reason = m->reason,
				    .region_id = m->region_id, .slot = m->slot, .capacity = m->capacity, .gen = m->gen,
				    .ring_ab = m->ring_ab, .ring_ba = m->ring_ba, .relayed = m->relayed, .offset = m->offset};
		if (h->tail)
			h->tail->next = e;
		else
			h->head = e;
		h->tail = e;
		taken = 1;
	}
	pthread_mutex_unlock(&reg_mu);
	if (taken) {
		__atomic_store_n(&pending, 1, __ATOMIC_RELEASE);
		return;
	}
	int lost = !e;
	free(e);
	if (m->type == SHUNT_READY)
		give_back(m);
	else if (lost)
		say(0, "out of memory: hostd's word on a lease was lost");
}

static void on_conn(void *arg, const struct shunt_msg *m)
{
	(void)arg;
	queue(m);
}

/* on_revoke: a version-3 hostd sends no REVOKE; one that does means DOWN. */
static void on_revoke(void *arg, const struct shunt_msg *m)
{
	(void)arg;
	struct shunt_msg d = *m;
	d.req_id = 0;
	queue(&d);
}

static int on_holds(void *arg)
{
	(void)arg;
	return !__atomic_load_n(&shunt_btl.finalizing, __ATOMIC_RELAXED);
}

/* on_announce tells a new hostd of the listener, of every pair held
 * (REATTACH: it adopted them from the region and keeps them for its grace)
 * and of every lease on TCP (OPEN again with the same request id: once
 * both ends did, it may move the lease to a ring pair). */
static void on_announce(void *arg, struct shunt_session *s)
{
	(void)arg;
	struct shunt_msg l = {.type = SHUNT_LISTEN, .local = shunt_btl.laddr};
	shunt_session_send(s, &l);
	pthread_mutex_lock(&reg_mu);
	int n = nreg, pairs = 0;
	struct held *copy = n ? malloc(n * sizeof *copy) : NULL;
	for (int i = 0; copy && i < n; i++)
		copy[i] = *reg[i];
	pthread_mutex_unlock(&reg_mu);
	if (n && !copy) {
		say(0, "out of memory: cannot tell the new hostd of %d leases; their rings will be taken back", n);
		n = 0;
	}
	for (int i = 0; i < n; i++) {
		struct held *h = &copy[i];
		struct shunt_msg m = {.type = SHUNT_OPEN, .req_id = h->req, .role = h->role, .local = h->local, .remote = h->remote};
		if (h->rings) {
			m = (struct shunt_msg){.type = SHUNT_REATTACH, .req_id = h->req, .region_id = h->region_id, .slot = h->slot,
					       .gen = h->gen, .side = h->side, .local = h->local, .remote = h->remote};
			pairs++;
		}
		shunt_session_send(s, &m);
	}
	free(copy);
	__atomic_store_n(&listened, 1, __ATOMIC_SEQ_CST);
	say(1, "told the new hostd of the listener, %d ring pairs and %d leases on tcp", pairs, n - pairs);
}

/* pin keeps this library mapped for the life of the process (see top). */
static void pin(void)
{
	Dl_info di;
	if (dladdr((void *)&mca_btl_shunt_component, &di) && di.dli_fname &&
	    dlopen(di.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE))
		return;
	say(0, "cannot pin %s in memory (%s): the process must not outlive MPI_Finalize by long",
	    di.dli_fname ? di.dli_fname : "mca_btl_shunt.so", dlerror());
}

int hostd_init(void)
{
	const char *control = mca_btl_shunt_component.control, *env = getenv("SHUNT_CONTROL");
	int given = 1;
	if (!control || !*control) {
		control = env && *env ? env : DEFAULT_CONTROL;
		given = env && *env;
	}
	const char *region = getenv("SHUNT_REGION");
	struct shunt_session_config c = {
		.control = control,
		.discover = !given, /* a VM's ports are looked for only when no socket is named */
		.region = region && *region ? region : NULL,
		.log = on_log,
		.revoked = on_revoke,
		.conn = on_conn,
		.holds = on_holds,
		.announce = on_announce,
		.caps = SHUNT_CAP_RESUME, /* relayed pairs: relayed.c */
	};
	/* With SHUNT_VSOCK=1 a VM without ivshmem takes its leases' ring pairs
	 * as vsock stretches through shunt-vstretchd (ready, below). */
	pin();
	session = shunt_session_new(&c);
	if (!session) {
		say(0, "out of memory: every peer stays on its lease (tcp)");
		return -1;
	}
	return 0;
}

int hostd_ready(void) { return session && shunt_session_ensure(session) == 0; }

void hostd_listen(void)
{
	if (__atomic_load_n(&listened, __ATOMIC_SEQ_CST) || !hostd_ready())
		return;
	struct shunt_msg m = {.type = SHUNT_LISTEN, .local = shunt_btl.laddr};
	if (shunt_session_send(session, &m) == 0) {
		shunt_session_sync(session);
		__atomic_store_n(&listened, 1, __ATOMIC_SEQ_CST);
	}
}

void hostd_open(struct conn *c, uint8_t role)
{
	c->fstate = F_NONE;
	c->told = 1;
	if (!mca_btl_shunt_component.ring) {
		c->reason = R_LEASE_ONLY;
		return;
	}
	if (!hostd_ready()) {
		c->reason = session ? shunt_session_reason(session) : SHUNT_REASON_NO_HOSTD;
		return;
	}
	hostd_listen();
	/* The entry first: the answer may come before OPEN returns. */
	struct shunt_msg m = {.type = SHUNT_OPEN, .req_id = shunt_session_new_req(session), .role = role,
			      .local = c->local, .remote = c->remote};
	if (!(c->h = reg_add(c, m.req_id, role))) {
		c->reason = SHUNT_REASON_INTERNAL;
		say(0, "out of memory: a lease to %s stays on tcp", c->ep ? c->ep->who : "a peer");
		return;
	}
	c->fstate = F_ASKING;
	c->told = 0;
	if (shunt_session_open(session, &m)) {
		/* The channel just dropped: the reconnect OPENs it again. */
		c->fstate = F_TCP;
		c->reason = SHUNT_REASON_NO_HOSTD;
		c->told = 1;
	}
}

int hostd_pending(void)
{
	return __atomic_load_n(&pending, __ATOMIC_RELAXED) && __atomic_exchange_n(&pending, 0, __ATOMIC_ACQUIRE);
}

/* not_relayed turns down a vsock stretch (just attached, m its READY)
 * whose pair hostd does not mark relayed: its bridges copy bytes, and a
 * lease's record rings are parsed in place, so only a pair both ends
 * take as relayed can go over it (hostd marks those between two vsock
 * VMs; docs/mpi.md). Both ends stay on the lease: a sender tells its
 * receiver RING_NO for the pair; CLOSE, so hostd sends no READY again
 * and the peer gets DOWN(peer-gone). */
static void not_relayed(struct conn *c, const struct shunt_msg *m)
{
	say(0, "%s: the ring pair is a vsock stretch that hostd does not mark relayed (the peer is not a vsock VM): the lease stays on tcp",
	    c->ep ? c->ep->who : "a peer");
	if (c->out) {
		struct rec_ring no = {.gen = m->gen, .region = m->region_id, .slot = m->slot, .reason = R_NOT_RELAYED};
		push_control(c, REC_RING_NO, &no, sizeof no);
	}
	hostd_close(c); /* detaches the stretch: shunt-vstretchd never opened its stream */
	c->reason = R_NOT_RELAYED;
	c->told = 1;
}

/* ready attaches the pair a READY names, if c may take it. */
static void ready(struct conn *c, const struct hword *e)
{
	struct shunt_msg m = {.type = SHUNT_READY, .req_id = c->h->req, .region_id = e->region_id, .slot = e->slot,
			      .gen = e->gen, .capacity = e->capacity, .ring_ab = e->ring_ab, .ring_ba = e->ring_ba,
			      .side = e->side};
	if (c->fstate == F_READY) {
		/* A second pair while one is held breaks the protocol: off it. */
		struct shunt_flow f = {.region_id = m.region_id, .slot = m.slot, .gen = m.gen, .side = m.side, .req = m.req_id,
				       .session = session};
		shunt_flow_left(&f);
		return;
	}
	if (c->closing || c->dead) {
		give_back(&m);
		return;
	}
	if (!c->out && c->no.gen == m.gen && c->no.slot == m.slot && c->no.region == m.region_id) {
		/* The sender said RING_NO for this pair before we saw it. */
		struct shunt_flow f = {.region_id = m.region_id, .slot = m.slot, .gen = m.gen, .side = m.side, .req = m.req_id,
				       .session = session};
		shunt_flow_left(&f);
		return;
	}
	if (shunt_flow_attach(session, &m, &c->sf)) {
		/* As the core says: CLOSE, and the lease stays on TCP for good
		 * (the peer gets DOWN(peer-gone)). */
		say(0, "%s: READY does not match the region; the lease stays on tcp", c->ep ? c->ep->who : "a peer");
		hostd_close(c);
		c->reason = SHUNT_REASON_INTERNAL;
		return;
	}
	if (shunt_flow_stretch(&c->sf) && !e->relayed) {
		not_relayed(c, &m);
		return;
	}
	c->fstate = F_READY;
	c->down = 0;
	c->gone = 0;
	c->relayed = e->relayed;
	c->rr = (struct shunt_rec_ring){.r = c->out ? &c->sf.w : &c->sf.r};
	reg_rings(c, 1);
	if (c->out && shunt_flow_stretch(&c->sf)) {
		/* shunt-vstretchd opens the stretch's stream once its read ring
		 * is attached (guestlib/vstretch); a lease's sender never reads
		 * it, so it says so itself, or its write ring never would be. */
		shunt_ring_attach_reader(&c->sf.r);
	}
	if (!c->out) {
		shunt_ring_attach_reader(&c->sf.r);
		struct rec_ring ok = {.gen = m.gen, .region = m.region_id, .slot = m.slot};
		push_control(c, REC_RING_OK, &ok, sizeof ok);
	}
}

void hostd_take(struct conn *c)
{
	if (!c->h)
		return;
	pthread_mutex_lock(&reg_mu);
	struct hword *e = c->h->head;
	c->h->head = c->h->tail = NULL;
	pthread_mutex_unlock(&reg_mu);
	while (e) {
		struct hword *next = e->next;
		if (c->fstate != F_CLOSED) {
			switch (e->type) {
			case SHUNT_READY:
				ready(c, e);
				break;
			case SHUNT_TCP:
				if (c->fstate != F_READY) {
					c->fstate = F_TCP;
					c->reason = e->reason;
					c->told = 1;
				}
				break;
			case SHUNT_DOWN:
			case SHUNT_RESUME:
				/* RESUME: a relayed pair's DOWN, with the offset the
				 * writer resends from (relayed.c); hostd sends no DOWN
				 * for one, and a DOWN would not say where to resend
				 * from: the stream could not go on. */
				if (c->fstate == F_READY && e->gen == c->sf.gen && e->slot == c->sf.slot && e->region_id == c->sf.region_id) {
					int first = !c->down;
					c->down = 1;
					c->down_reason = e->reason;
					c->resume_at = e->type == SHUNT_RESUME ? e->offset : SHUNT_RESUME_RESET;
					/* A vsock stretch: hostd sends DOWN(peer-gone) once the
					 * rooms carried the gone end's last bytes into this
					 * VM's ring (docs/vsock.md, "VM to VM"); the writer's
					 * bytes have no reader left. On RESUME, shunt-vstretchd
					 * stops its bridge first, which marks the read ring
					 * left where its bytes end, and ENDED says where. */
					c->gone = e->type == SHUNT_DOWN && e->reason == SHUNT_REASON_PEER_GONE && shunt_flow_stretch(&c->sf);
					if (e->type == SHUNT_RESUME && first)
						shunt_flow_stretch_end(&c->sf, e->reason);
				}
				break;
			}
		}
		free(e);
		e = next;
	}
}

void hostd_left(struct conn *c, uint16_t reason)
{
	if (c->fstate != F_READY)
		return;
	shunt_flow_left(&c->sf);
	reg_rings(c, 0);
	/* Nothing touches the rings after LEFT: the writer marked the ring's
	 * end (DOWN) or never used it, the reader drained it. */
	shunt_flow_detach(&c->sf);
	c->fstate = F_TCP;
	c->reason = reason;
	c->down = 0;
}

void hostd_close(struct conn *c)
{
	if (!c->h) {
		c->fstate = F_CLOSED;
		return;
	}
	struct shunt_msg m = {.type = SHUNT_CLOSE, .req_id = c->h->req, .side = c->h->role};
	if (c->fstate == F_READY && c->relayed && (c->out || shunt_flow_stretch(&c->sf)))
		shunt_ring_leave(&c->sf.w); /* the relay carries its last bytes, then ends the stretch (a stretch's unused one too) */
	if (c->fstate == F_READY)
		shunt_flow_close(&c->sf);
	else
		shunt_session_send(session, &m);
	shunt_flow_detach(&c->sf);
	reg_del(c->h);
	c->h = NULL;
	c->fstate = F_CLOSED;
}

void hostd_fini(void)
{
	/* The session stays (the core has no close); without listeners and
	 * flows it no longer reconnects (on_holds). */
}
