/* The BTL's session with hostd (btl_shunt.h), through the core's session
 * (shunt.h): LISTEN for the lease listener, INTENT before a lease connects,
 * OPEN after it connected (active) or was accepted (passive), and the
 * verdict; REVOKE; after a hostd restart, LISTEN and REATTACH again.
 *
 * OPEN waits for its verdict, and hostd answers only once both ends asked,
 * so each OPEN runs on a short-lived thread of its own: the progress loop
 * never waits, and two ranks connecting to each other at once cannot stall
 * each other. The thread posts the verdict in its struct verdict; the
 * progress loop applies it (hostd_take).
 *
 * The registry: the flows this process holds, for the session's reader
 * thread (REVOKE, REATTACH), under reg_mu; the data path never takes it.
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

struct verdict {
	struct shunt_msg req, reply;
	int done;  /* atomic: reply is set */
	int refs;  /* atomic: the thread and the connection */
	int taken; /* the connection applied the reply (progress loop only) */
};

/* verdict_put drops one reference to v. The last one gives back a READY
 * that no connection took (its connection closed or gave up first), so
 * hostd frees that flow now instead of when the session ends. */
static void verdict_put(struct verdict *v)
{
	if (__atomic_sub_fetch(&v->refs, 1, __ATOMIC_ACQ_REL) != 0)
		return;
	if (__atomic_load_n(&v->done, __ATOMIC_ACQUIRE) && !v->taken && v->reply.type == SHUNT_READY) {
		struct shunt_flow id = {.region_id = v->reply.region_id, .slot = v->reply.slot, .gen = v->reply.gen,
					.side = v->reply.side, .session = session};
		shunt_flow_close(&id);
	}
	free(v);
}

/* ---- the registry ---- */

struct held {
	struct conn *c;
	uint32_t region_id, slot;
	uint64_t gen;
	uint8_t side;
	struct shunt_addr local, remote;
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static struct held *reg;
static int nreg, reg_cap;

static void reg_add(struct conn *c)
{
	pthread_mutex_lock(&reg_mu);
	if (nreg == reg_cap) {
		int cap = reg_cap ? 2 * reg_cap : 16;
		struct held *n = realloc(reg, cap * sizeof *n);
		if (!n) {
			pthread_mutex_unlock(&reg_mu);
			say(0, "out of memory: a hostd restart will revoke a flow of %s", c->ep ? c->ep->who : "a peer");
			return;
		}
		reg = n;
		reg_cap = cap;
	}
	reg[nreg++] = (struct held){c, c->region_id, c->sf.slot, c->sf.gen, c->sf.side, c->local, c->remote};
	pthread_mutex_unlock(&reg_mu);
}

static void reg_del(struct conn *c)
{
	pthread_mutex_lock(&reg_mu);
	for (int i = 0; i < nreg; i++)
		if (reg[i].c == c)
			reg[i--] = reg[--nreg];
	pthread_mutex_unlock(&reg_mu);
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

static void on_revoke(void *arg, const struct shunt_msg *m)
{
	(void)arg;
	pthread_mutex_lock(&reg_mu);
	for (int i = 0; i < nreg; i++)
		if (reg[i].slot == m->slot && reg[i].gen == m->gen && reg[i].region_id == m->region_id) {
			__atomic_store_n(&reg[i].c->revoke_reason, m->reason, __ATOMIC_RELAXED);
			__atomic_store_n(&reg[i].c->revoked, 1, __ATOMIC_RELEASE);
		}
	pthread_mutex_unlock(&reg_mu);
}

static int on_holds(void *arg)
{
	(void)arg;
	return !__atomic_load_n(&shunt_btl.finalizing, __ATOMIC_RELAXED);
}

/* on_announce tells a new hostd of the listener and of every flow held,
 * which it adopted from the region and keeps for its grace. */
static void on_announce(void *arg, struct shunt_session *s)
{
	(void)arg;
	struct shunt_msg l = {.type = SHUNT_LISTEN, .local = shunt_btl.laddr};
	shunt_session_send(s, &l);
	pthread_mutex_lock(&reg_mu);
	int n = nreg;
	struct held *copy = n ? malloc(n * sizeof *copy) : NULL;
	if (copy)
		memcpy(copy, reg, n * sizeof *copy);
	pthread_mutex_unlock(&reg_mu);
	if (n && !copy) {
		say(0, "out of memory: cannot tell the new hostd of %d flows; they will be revoked", n);
		n = 0;
	}
	for (int i = 0; i < n; i++) {
		struct shunt_msg m = {.type = SHUNT_REATTACH, .region_id = copy[i].region_id, .slot = copy[i].slot,
				      .gen = copy[i].gen, .side = copy[i].side, .local = copy[i].local, .remote = copy[i].remote};
		shunt_session_send(s, &m);
	}
	free(copy);
	__atomic_store_n(&listened, 1, __ATOMIC_SEQ_CST);
	say(1, "told the new hostd of the listener and %d flows", n);
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
		.holds = on_holds,
		.announce = on_announce,
	};
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

void hostd_intent(struct conn *c)
{
	struct shunt_msg m = {.type = SHUNT_INTENT, .local = c->local, .remote = c->remote};
	shunt_session_send(session, &m);
}

static void *verdict_main(void *arg)
{
	struct verdict *v = arg;
	shunt_session_request(session, &v->req, &v->reply, mca_btl_shunt_component.verdict_ms);
	__atomic_store_n(&v->done, 1, __ATOMIC_RELEASE);
	verdict_put(v);
	return NULL;
}

/* hostd_open asks for c's verdict on a thread of its own; without hostd
 * the verdict is TCP(no-hostd) at once. */
void hostd_open(struct conn *c, uint8_t role)
{
	c->fstate = F_ASKING;
	if (!mca_btl_shunt_component.ring) {
		c->fstate = F_TCP;
		c->reason = R_LEASE_ONLY;
		return;
	}
	if (!hostd_ready()) {
		c->fstate = F_TCP;
		c->reason = SHUNT_REASON_NO_HOSTD;
		return;
	}
	hostd_listen();
	struct verdict *v = calloc(1, sizeof *v);
	if (!v) {
		c->fstate = F_TCP;
		c->reason = SHUNT_REASON_INTERNAL;
		return;
	}
	v->req = (struct shunt_msg){.type = SHUNT_OPEN, .role = role, .local = c->local, .remote = c->remote};
	v->refs = 2;
	if (shunt_thread_detached(verdict_main, v)) {
		free(v);
		c->fstate = F_TCP;
		c->reason = SHUNT_REASON_INTERNAL;
		return;
	}
	c->v = v;
}

/* give_up drops the connection's claim on its verdict. */
static void give_up(struct conn *c)
{
	if (c->v)
		verdict_put(c->v);
	c->v = NULL;
}

void hostd_take(struct conn *c)
{
	if (!c->v || !__atomic_load_n(&c->v->done, __ATOMIC_ACQUIRE))
		return;
	struct shunt_msg m = c->v->reply;
	int use = c->fstate == F_ASKING;
	c->v->taken = use; /* otherwise the last reference gives a READY back */
	give_up(c);
	if (!use)
		return;
	if (m.type != SHUNT_READY) {
		c->fstate = F_TCP;
		c->reason = m.reason;
		return;
	}
	if (shunt_flow_attach(session, &m, &c->sf)) {
		struct shunt_flow id = {.region_id = m.region_id, .slot = m.slot, .gen = m.gen, .side = m.side, .session = session};
		shunt_flow_close(&id);
		c->fstate = F_TCP;
		c->reason = SHUNT_REASON_INTERNAL;
		say(0, "%s: READY does not match the region; the lease stays on tcp", c->ep ? c->ep->who : "a peer");
		return;
	}
	c->region_id = m.region_id;
	c->fstate = F_READY;
	c->rr = (struct shunt_rec_ring){.r = c->out ? &c->sf.w : &c->sf.r};
	reg_add(c);
}

void hostd_close(struct conn *c)
{
	if (c->fstate == F_ASKING)
		give_up(c);
	if (c->fstate != F_READY) {
		if (c->fstate == F_ASKING)
			c->fstate = F_CLOSED;
		return;
	}
	reg_del(c);
	shunt_flow_close(&c->sf);
	/* Nothing touches the rings after CLOSE: the writer marked the ring's
	 * end (DOWN) or never used it, the reader drained it. */
	shunt_flow_detach(&c->sf);
	c->fstate = F_CLOSED;
}

int conn_revoked(struct conn *c, uint16_t *reason)
{
	if (!__atomic_load_n(&c->revoked, __ATOMIC_ACQUIRE))
		return 0;
	*reason = __atomic_load_n(&c->revoke_reason, __ATOMIC_RELAXED);
	return 1;
}

void hostd_fini(void)
{
	/* The session stays (the core has no close); without listeners and
	 * flows it no longer reconnects (on_holds). */
}
