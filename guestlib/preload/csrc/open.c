/* OPEN: a connection is offered to hostd only once it has lived the open
 * delay (SHUNT_OPEN_DELAY_MS, 5 ms; the Go library's Options.OpenDelay),
 * as a router's flow offload waits for a flow to prove itself: one closed
 * sooner (an HTTP/1.0 request, an RPC per connection) never reaches hostd,
 * and costs neither end an OPEN, a pairing or a CLOSE. Nothing waits for
 * the delay: the connection is on TCP meanwhile, as it would be while
 * hostd answers.
 *
 * Waiting connections are in one queue, oldest first (the delay is the
 * same for all, so the head is always the next due): the leaver thread
 * (conn.c) sleeps until the head is due and sends its OPEN; a connection
 * closed before leaves the queue at its release. A fork shares the
 * connections still waiting between parent and child (share.c): each
 * queues it, and the one that ends up holding it alone sends OPEN.
 *
 * The request-id index maps hostd's READY, TCP and DOWN to their
 * connection: a hash of chains, filled when OPEN gives a connection its
 * request id and emptied at its release, so a message costs a short chain
 * walk under idx_mu instead of a look at every fd. */
#include "preload.h"

#include <arpa/inet.h>
#include <stdlib.h>
#include <sys/mman.h>

int64_t open_delay_ns = 5000000;
int open_delay_adapt = 1;

/* The open delay adapts to what this process's connections do, so that a
 * server or client of short connections under load (ab -c 16, pgbench -C,
 * a connection per request) stops offering them: on a busy machine the
 * tail of such connections outlives 5 ms, and each one offered costs both
 * ends and hostd an OPEN, a pairing, READY, and CLOSE, for bytes that were
 * nearly all sent already. A connection that was offered but closed less
 * than OPEN_PAYS_NS (or four delays) after its OPEN did not pay for it:
 * the delay doubles, up to OPEN_DELAY_MAX_NS. One that lived longer halves
 * it again, down to SHUNT_OPEN_DELAY_MS. Connections closed within the
 * delay say nothing: hostd never heard of them. So the delay climbs above
 * a short-connection load's tail within a few connections, and the first
 * long-lived connections bring it back; a long-lived connection meanwhile
 * reaches the rings later (at most OPEN_DELAY_MAX_NS, well inside hostd's
 * pairing timeout), never not at all. 200 ms: the time from OPEN to
 * READY (hostd's checks, the proof of passage, both ends' switch) and back
 * at the close costs a connection that lives less about what the rings
 * save it (Apache's keep-alive connections of 100 requests, about 160 ms
 * under ab -c 16, ran at 0.8x plain on the rings and 1.0x on TCP; issue
 * 21). Counted by time after OPEN, not by
 * bytes: a latency-bound connection (small messages, long life) pays back
 * as well as a bulk one. Per process tree: the delay lives in a
 * MAP_SHARED page made at the process's first connection, which the
 * children it forks after share, so that a server that forks a process
 * per connection (PostgreSQL's backends) learns in its children for the
 * next ones. SHUNT_OPEN_DELAY_MS=0 (at once) turns it off, and so does
 * SHUNT_OPEN_DELAY_ADAPT=0 (the delay stays SHUNT_OPEN_DELAY_MS: tests
 * whose steps are timed against it, such as the edge suite's servers,
 * which serve one short connection per test). The Go library
 * does the same (guestlib, openDelay). */
#define OPEN_DELAY_MAX_NS 200000000LL
#define OPEN_PAYS_NS 200000000LL
static int64_t delay_own;   /* the delay, if no page can be had */
static int64_t *delay_page; /* atomic: the shared word; the delay now, 0 until adapted: open_delay_ns */

static int64_t *delay_word(void)
{
	int64_t *p = __atomic_load_n(&delay_page, __ATOMIC_ACQUIRE);
	if (p)
		return p;
	void *m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED)
		return &delay_own;
	if (!__atomic_compare_exchange_n(&delay_page, &p, (int64_t *)m, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
		munmap(m, 4096);
		return p;
	}
	return m;
}

static int64_t open_delay(void)
{
	int64_t d = __atomic_load_n(delay_word(), __ATOMIC_RELAXED);
	return d ? d : open_delay_ns;
}

void open_lived(struct flow *f)
{
	if (!f->told_at || open_delay_ns <= 0 || !open_delay_adapt)
		return;
	int64_t life = now_ns() - f->told_at, d = open_delay(), nd = d;
	if (life < (OPEN_PAYS_NS > 4 * d ? OPEN_PAYS_NS : 4 * d))
		nd = 2 * d < OPEN_DELAY_MAX_NS ? 2 * d : OPEN_DELAY_MAX_NS;
	else
		nd = d / 2 > open_delay_ns ? d / 2 : open_delay_ns;
	int64_t seen = __atomic_load_n(delay_word(), __ATOMIC_RELAXED);
	if (nd != d && __atomic_compare_exchange_n(delay_word(), &seen, nd, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		plog("shunt: open delay now %lld ms (fd %d lived %lld ms after its OPEN)", (long long)(nd / 1000000), f->fd,
		     (long long)(life / 1000000));
}

/* idx_mu guards the queue, the index, and each flow's open_at and links;
 * it comes after tab_mu and a flow's locks (preload.h). */
static pthread_mutex_t idx_mu = PTHREAD_MUTEX_INITIALIZER;
static struct flow *oq_head, *oq_tail;
/* When the leaver wakes for the queue, as it last saw it (0: it does not):
 * a new connection wakes it only if it would sleep past the new one's
 * OPEN, so a stream of short connections costs no wake-up each. */
static int64_t wake_at;

#define IDX_BUCKETS 4096 /* request ids are sequential: consecutive ones never share a chain */
static struct flow *idx[IDX_BUCKETS];

static struct flow **bucket(uint32_t req) { return &idx[req & (IDX_BUCKETS - 1)]; }

static void idx_remove_locked(struct flow *f)
{
	if (!f->req)
		return;
	for (struct flow **p = bucket(f->req); *p; p = &(*p)->inext)
		if (*p == f) {
			*p = f->inext;
			break;
		}
	f->inext = NULL;
}

/* oq_pop_locked takes the head out of the queue whatever its fields say:
 * open_due and the fork child use it so that a head that is not marked
 * queued (a bug: a flow reset while linked) can never make them loop. */
static void oq_pop_locked(void)
{
	struct flow *f = oq_head;
	oq_head = f->onext != f ? f->onext : NULL;
	if (oq_head)
		oq_head->oprev = NULL;
	else
		oq_tail = NULL;
	f->onext = f->oprev = NULL;
	f->open_at = 0;
}

static void oq_remove_locked(struct flow *f)
{
	if (!f->open_at)
		return;
	if (f->oprev)
		f->oprev->onext = f->onext;
	else
		oq_head = f->onext;
	if (f->onext)
		f->onext->oprev = f->oprev;
	else
		oq_tail = f->oprev;
	f->onext = f->oprev = NULL;
	f->open_at = 0;
}

/* queue_locked puts f in the queue, due at at: in order, from the tail
 * (new connections are due last; only a shared one queued again can be
 * due later, share.c). It returns whether the leaver must wake for it. */
static int queue_locked(struct flow *f, int64_t at)
{
	struct flow *p = oq_tail;
	while (p && p->open_at > at)
		p = p->oprev;
	f->open_at = at;
	f->oprev = p;
	f->onext = p ? p->onext : oq_head;
	if (f->onext)
		f->onext->oprev = f;
	else
		oq_tail = f;
	if (p)
		p->onext = f;
	else
		oq_head = f;
	return !wake_at || wake_at > at;
}

void open_requeue(struct flow *f, int64_t ns)
{
	int kick = 0;
	pthread_mutex_lock(&idx_mu);
	if (!f->open_at)
		kick = queue_locked(f, now_ns() + ns);
	pthread_mutex_unlock(&idx_mu);
	if (kick)
		leaver_wake(); /* a leaver that sleeps past it, or none yet (a fork child's starts at its first use) */
}

void open_forget(struct flow *f)
{
	pthread_mutex_lock(&idx_mu);
	oq_remove_locked(f);
	idx_remove_locked(f);
	pthread_mutex_unlock(&idx_mu);
}

struct flow *by_req(uint32_t req)
{
	struct flow *hit = NULL;
	pthread_mutex_lock(&idx_mu);
	for (struct flow *f = *bucket(req); f && !hit; f = f->inext)
		if (f->req == req && f->owner == my_pid && flow_hold(f))
			hit = f;
	pthread_mutex_unlock(&idx_mu);
	return hit;
}

/* take_shared: f is held by other processes too since a fork (share.c;
 * wmu held, so no fork comes between the check and OPEN). 1: this
 * process holds it alone now and goes on to OPEN it; 0: not yet (it is
 * queued again, checked less often each time, at most every second) or
 * never (another process used it: it stays on TCP). */
static int take_shared(struct flow *f)
{
	int alone = share_alone(f);
	if (alone > 0) {
		share_leave(f);
		plog("shunt: fd %d: the only process holding the connection since a fork: this one", f->fd);
		return 1;
	}
	if (alone < 0) {
		plog("shunt: fd %d: tcp (fork: another process used the connection too)", f->fd);
		return 0;
	}
	int tries = ++f->share_tries;
	int64_t back = open_delay_ns << (tries < 8 ? tries : 8);
	if (back > 1000000000 || back <= 0)
		back = 1000000000;
	if (tries == 1)
		plog("shunt: fd %d: another process holds the connection too since a fork: on TCP until one holds it alone", f->fd);
	open_requeue(f, back);
	return 0;
}

/* send_open gives f its request id and sends OPEN (never waits: a channel
 * hostd does not read queues it). Under wmu, so that a fork sees f either
 * before (it lets it go, dropped) or after (told, it owes hostd a CLOSE). */
/* tuple looks up what OPEN needs, the first time it is sent: the
 * addresses and the socket's timeouts (the rings' waits keep them; on TCP
 * the kernel does). Under tab_mu, on an fd that is still f's, so the
 * socket cannot be closed and its number reused meanwhile: f->fd, or, if
 * the program closed that one and a dup lives on, the dup (found here,
 * in the leaver, rather than by every close). 0, or -1 if it is not
 * connected any more (nothing to offer). */
static int tuple(struct flow *f)
{
	int r = -1;
	pthread_mutex_lock(&tab_mu);
	for (int i = 0; fds[f->fd] != f && i < FD_MAX; i++)
		if (fds[i] == f)
			f->fd = i;
	if (fds[f->fd] == f && local_of(f->fd, &f->local) == 0 && (f->have_remote || remote_of(f->fd, &f->remote) == 0)) {
		flow_timeouts(f->fd, f);
		f->have_remote = f->have_tuple = 1;
		r = 0;
	}
	pthread_mutex_unlock(&tab_mu);
	return r;
}

static void send_open(struct flow *f)
{
	char ip[INET6_ADDRSTRLEN];
	struct shunt_msg m = {.type = SHUNT_OPEN, .role = f->role};
	/* A fork child's own session, made here if the child has none yet */
	if (f->share && shunt_session_ensure(session)) {
		plog("shunt: fd %d: tcp (no-hostd: this process, which holds it after a fork, cannot reach hostd)", f->fd);
		return;
	}
	if (!f->req && !f->have_tuple && tuple(f)) {
		plog("shunt: fd %d: not connected any more: no OPEN", f->fd);
		return;
	}
	pthread_mutex_lock(&f->wmu);
	m.local = f->local;
	m.remote = f->remote;
	if (f->dropped || __atomic_load_n(&f->closed, __ATOMIC_SEQ_CST) || f->owner != my_pid) {
		pthread_mutex_unlock(&f->wmu);
		return;
	}
	if (f->share && !take_shared(f)) {
		pthread_mutex_unlock(&f->wmu);
		return;
	}
	m.req_id = shunt_session_new_req(session);
	pthread_mutex_lock(&idx_mu);
	f->req = m.req_id; /* in the index before OPEN goes out: READY may come at once */
	f->inext = *bucket(f->req);
	*bucket(f->req) = f;
	pthread_mutex_unlock(&idx_mu);
	f->told = 1; /* before: a close meanwhile (another thread) still owes hostd the CLOSE */
	int r = shunt_session_open(session, &m);
	if (r)
		f->told = 0;
	f->told_at = r ? 0 : now_ns();
	pthread_mutex_unlock(&f->wmu);
	inet_ntop(AF_INET6, m.remote.ip, ip, sizeof ip);
	plog("shunt: fd %d %s [%s]:%u: open (request %u%s)", f->fd, f->role == SHUNT_ROLE_ACTIVE ? "connect" : "accept", ip,
	     m.remote.port, m.req_id,
	     !r ? "" : shunt_session_connected(session) ? "; not sent, hostd is not reading: tcp" : ", hostd away: told when it is back");
}

void conn_open(int fd, uint8_t role, const char *who, unsigned gen, const struct shunt_addr *remote, long fdg)
{
	struct flow *f = flow_new();
	if (!f) {
		plog("shunt: fd %d %s: tcp (out of memory)", fd, who);
		return;
	}
	if (remote) {
		f->remote = *remote;
		f->have_remote = 1;
	}
	f->owner = my_pid;
	f->fd = fd;
	f->role = role;
	f->nonblock = nonblk[fd];
	/* The delay is skipped where it cannot help: when it is 0, and when
	 * no thread can keep it (the OPEN then goes now, as before). */
	int delayed = open_delay_ns > 0 && leaver_start() == 0, kick = 0;
	pthread_mutex_lock(&tab_mu);
	/* one connection, one flow, whatever calls come twice; and none for a
	 * number closed since the caller saw its socket (settle) */
	int known = fds[fd] != NULL || (fdg >= 0 && fd_gen[fd] != (uint32_t)fdg);
	/* A fork since the kernel made the connection (another thread's), or
	 * one that found its connect under way: the child has a copy the
	 * library does not know, so it is the kernel's here too (fork.c). */
	int forked = !known && (__atomic_load_n(&fork_gen, __ATOMIC_RELAXED) != gen || kind[fd] == FD_KERNEL);
	if (forked)
		__atomic_store_n(&kind[fd], FD_KERNEL, __ATOMIC_RELEASE);
	if (!known && !forked) {
		flow_publish(fd, f);
		/* Queued in the same section as the publish: a close or a fork
		 * that can see f in fds[] finds it in the queue too, and takes
		 * it out before f can be freed (release, fork.c). */
		if (delayed) {
			pthread_mutex_lock(&idx_mu);
			kick = queue_locked(f, now_ns() + open_delay());
			pthread_mutex_unlock(&idx_mu);
		}
	}
	pthread_mutex_unlock(&tab_mu);
	if (known || forked) {
		if (forked)
			plog("shunt: fd %d %s: tcp (fork: a fork came while the connection was made; it stays a kernel socket)", fd, who);
		flow_discard(f);
		return;
	}
	if (!delayed) {
		if (flow_hold(f)) { /* another thread may close fd meanwhile */
			send_open(f);
			flow_put(f);
		}
		return;
	}
	if (kick)
		leaver_wake();
}

/* open_due sends every OPEN due within the next millisecond (so that a
 * stream of new connections costs one wake-up per millisecond at most),
 * each under a reference of its own, with no lock but its wmu held. */
int64_t open_due(void)
{
	for (;;) {
		int64_t next = 0;
		struct flow *f = NULL;
		pthread_mutex_lock(&idx_mu);
		if (oq_head && !oq_head->open_at) {
			oq_pop_locked(); /* cannot happen (see flow_new): never loop on it */
			pthread_mutex_unlock(&idx_mu);
			continue;
		}
		if (oq_head && oq_head->open_at <= now_ns() + 1000000) {
			f = oq_head;
			oq_remove_locked(f);
			if (!flow_hold(f))
				f = NULL; /* being released: its release finds it gone from the queue */
		} else if (oq_head) {
			next = oq_head->open_at;
		}
		int empty = !oq_head;
		if (!f)
			wake_at = next;
		pthread_mutex_unlock(&idx_mu);
		if (f) {
			send_open(f);
			flow_put(f);
			continue;
		}
		if (next || empty)
			return next;
	}
}

/* open_fork: idx_mu across fork. The child's queue and index are its
 * parent's, whose OPENs and request ids are not the child's: it starts
 * with both empty (the flows themselves are fork.c's). */
void open_fork(int phase)
{
	if (phase == FORK_PREPARE) {
		pthread_mutex_lock(&idx_mu);
		return;
	}
	if (phase == FORK_PARENT) {
		pthread_mutex_unlock(&idx_mu);
		return;
	}
	pthread_mutex_init(&idx_mu, NULL);
	wake_at = 0; /* the child's leaver is its own, started with its first connection */
	while (oq_head)
		oq_pop_locked();
	for (int i = 0; i < IDX_BUCKETS; i++)
		while (idx[i]) {
			struct flow *f = idx[i];
			idx[i] = f->inext;
			f->inext = NULL;
		}
}
