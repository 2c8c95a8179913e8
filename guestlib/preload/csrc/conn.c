/* Connections and hostd: the session's callbacks that move a connection
 * between TCP and the rings (READY, DOWN, TCP), LEFT when both directions
 * left a ring pair, CLOSE at the last close, what a new hostd must hear
 * after a restart (LISTEN, REATTACH, OPEN again), and the leaver thread,
 * which also sends the OPENs the open delay holds back (open.c). Nothing
 * here waits for hostd: a connection is on TCP until READY, and its reads
 * and writes go on meanwhile (path.c). */
#include "preload.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/futex.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>

/* ---- ring pairs: kept for reuse, never freed (preload.h) ---- */

static pthread_mutex_t rings_mu = PTHREAD_MUTEX_INITIALIZER; /* a leaf */
static struct rings *free_rings;

static struct rings *rings_new(void)
{
	pthread_mutex_lock(&rings_mu);
	struct rings *rg = free_rings;
	if (rg)
		free_rings = rg->next_free;
	pthread_mutex_unlock(&rings_mu);
	if (!rg) {
		if ((rg = calloc(1, sizeof *rg)))
			rg->resume_fd = -1;
		return rg;
	}
	rg->wleft = rg->rleft = 0;
	rg->next_free = NULL;
	__atomic_store_n(&rg->left, 0, __ATOMIC_SEQ_CST);
	__atomic_store_n(&rg->down, 0, __ATOMIC_SEQ_CST);
	__atomic_store_n(&rg->peer_gone, 0, __ATOMIC_SEQ_CST);
	__atomic_store_n(&rg->resumed, 0, __ATOMIC_SEQ_CST);
	rg->resume_fd = -1;
	rg->relayed = rg->bridged = 0;
	return rg;
}

/* conn_fork: rings_mu across fork (fork.c). */
void conn_fork(int phase)
{
	if (phase == FORK_PREPARE)
		pthread_mutex_lock(&rings_mu);
	else if (phase == FORK_PARENT)
		pthread_mutex_unlock(&rings_mu);
	else
		pthread_mutex_init(&rings_mu, NULL);
}

void rings_free(struct rings *rg)
{
	pthread_mutex_lock(&rings_mu);
	rg->next_free = free_rings;
	free_rings = rg;
	pthread_mutex_unlock(&rings_mu);
}

void flow_wake(struct flow *f)
{
	/* A connection no sleeper ever armed (a short one, never polled by
	 * the library) costs no system call: a sleeper that arms it now
	 * checks what changed after its arm (arm_flow), and the caller
	 * changed it before this fence. */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (!__atomic_load_n(&f->ev_armed, __ATOMIC_RELAXED))
		return;
	__atomic_store_n(&f->ev, 0, __ATOMIC_SEQ_CST);
	shunt_futex_wake(&f->ev, INT_MAX);
	if (shunt_kicks_enabled()) /* VM mode: the helpers sleep on the kick count */
		shunt_kick_local();
}

/* ---- leaving a ring pair ---- */

/* left marks one direction gone; the one that completes the pair gets it
 * back to release (LEFT) once its lock is let go. */
static struct rings *left(struct rings *rg, int bit)
{
	return (__atomic_or_fetch(&rg->left, bit, __ATOMIC_SEQ_CST) & 3) == 3 ? rg : NULL;
}

struct rings *writer_leave(struct flow *f, struct rings *rg)
{
	if (!rg || rg->wleft)
		return NULL;
	int started = f->wring;
	rg->wleft = 1;
	f->wring = 0;
	shunt_ring_leave(&rg->sf.w);
	if (__atomic_load_n(&rg->resumed, __ATOMIC_SEQ_CST))
		resume_writer(f, rg, started); /* before LEFT: the ring's bytes are still ours */
	if (verbose > 1)
		plog("shunt: fd %d: writer left the ring at %llu", f->fd, (unsigned long long)f->sent);
	return left(rg, 1);
}

struct rings *reader_leave(struct flow *f, struct rings *rg)
{
	if (!rg || rg->rleft)
		return NULL;
	rg->rleft = 1;
	f->rring = 0;
	__atomic_store_n(&f->rhold, 0, __ATOMIC_RELAXED);
	shunt_ring_leave_read(&rg->sf.r);
	if (verbose > 1)
		plog("shunt: fd %d: reader left the ring at %llu", f->fd, (unsigned long long)f->roff);
	return left(rg, 2);
}

/* stretch_drain: once the writer left a vsock stretch's write ring (wmu
 * held, which keeps the stretch attached), waits until its daemon's bridge
 * carried the ring's last bytes and LEFT to the host (bounded, stretch.c)
 * before the kernel's FIN: the Go library's Close does the same
 * (guestlib/stretch.go, drainStretch). Nothing for a region's rings. */
void stretch_drain(struct rings *rg)
{
	if (rg->wleft && shunt_flow_stretch(&rg->sf))
		shunt_flow_drain(&rg->sf);
}

/* rings_done gives back a pair both directions left: LEFT to hostd, the
 * region hold let go. Both locks are taken (in order, none held by the
 * caller) so that no reader or writer looks at f->rg meanwhile. */
void rings_done(struct flow *f, struct rings *rg)
{
	if (!rg)
		return;
	pthread_mutex_lock(&f->rmu);
	pthread_mutex_lock(&f->wmu);
	if (__atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) == rg)
		__atomic_store_n(&f->rg, NULL, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&f->wmu);
	pthread_mutex_unlock(&f->rmu);
	if (f->owner == my_pid)
		shunt_flow_left(&rg->sf);
	plog("shunt: fd %d: left the rings (slot %u): tcp", f->fd, rg->sf.slot);
	shunt_flow_detach(&rg->sf);
	rings_free(rg);
	flow_wake(f);
}

/* conn_end: the connection's last fd closes. The writer leaves its ring
 * first, so the peer reads the ring's bytes and then the kernel's FIN or
 * RST; the reader leaves too, so the peer's writer goes back to TCP. */
void conn_end(struct flow *f)
{
	if (f->owner != my_pid || f->finished)
		return;
	f->finished = 1;
	share_leave(f); /* its last close, or exit: other holders may take it */
	pthread_mutex_lock(&f->rmu);
	pthread_mutex_lock(&f->wmu);
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	/* Without rings, the side is the role's: the connecting end is A. */
	struct shunt_flow id = {.req = f->req, .side = f->role == SHUNT_ROLE_PASSIVE ? 2 : 1, .session = session};
	if (rg) {
		writer_leave(f, rg);
		stretch_drain(rg);
		reader_leave(f, rg);
		id = rg->sf;
		__atomic_store_n(&f->rg, NULL, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&f->wmu);
	pthread_mutex_unlock(&f->rmu);
	if (rg || f->told) /* a connection hostd never heard of is owed nothing */
		shunt_flow_close(&id);
	open_lived(f);
	if (rg) {
		shunt_flow_detach(&rg->sf);
		rings_free(rg);
	}
}

/* ---- hostd's messages ---- */

/* hold takes a reference to f, which fds[] holds (tab_mu held): its users
 * are above zero while an fd points to it. Taken by the flow found, not by
 * its fd: a closed fd's number is reused at once, and a late READY, TCP or
 * DOWN must never reach the connection that took it. */
static struct flow *hold(struct flow *f)
{
	__atomic_add_fetch(&f->users, 1, __ATOMIC_ACQ_REL);
	return f;
}

/* lease_keepalive keeps an idle lease's packets coming while its bytes
 * take the rings: hostd keeps a connection there only while its packets
 * are seen past the firewall both ways (proof_max_age, 35 s by default).
 * A program that set keepalive itself keeps its own timing. */
static void lease_keepalive(int fd)
{
	int on = 0, idle = 15, intvl = 5;
	socklen_t len = sizeof on;
	if (real_getsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, &len) == 0 && on)
		return;
	on = 1;
	real_setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
	real_setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
	real_setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
}

static void ready(struct flow *f, const struct shunt_msg *m)
{
	struct rings *old = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (old || __atomic_load_n(&f->closed, __ATOMIC_SEQ_CST)) {
		plog("shunt: fd %d: READY (slot %u) while %s; left at once", f->fd, m->slot, old ? "it holds rings" : "closing");
		struct shunt_flow id = {.req = m->req_id, .region_id = m->region_id, .slot = m->slot, .gen = m->gen, .side = m->side,
					.session = session};
		shunt_flow_left(&id);
		return;
	}
	struct rings *rg = rings_new();
	if (!rg || shunt_flow_attach(session, m, &rg->sf)) {
		plog("shunt: fd %d: %s; stays on tcp", f->fd, rg ? "READY does not match the region" : "out of memory");
		struct shunt_flow id = {.req = m->req_id, .region_id = m->region_id, .slot = m->slot, .gen = m->gen, .side = m->side,
					.session = session};
		shunt_flow_left(&id);
		if (rg)
			rings_free(rg);
		return;
	}
	rg->sf.w.owner = rg->sf.r.owner = &rg->sf;
	rg->relayed = m->relayed;
	rg->bridged = m->relayed || shunt_flow_stretch(&rg->sf);
	/* A reader asleep in a blocking kernel recv would not see the ring
	 * start: the peer must not move before it is back (path.c). */
	pthread_mutex_lock(&f->rmu);
	if (f->dropped) { /* a fork let it go to the kernel meanwhile (fork.c); hostd had its CLOSE */
		pthread_mutex_unlock(&f->rmu);
		plog("shunt: fd %d: READY (slot %u) after a fork let the connection go; ignored", f->fd, m->slot);
		shunt_flow_detach(&rg->sf);
		rings_free(rg);
		return;
	}
	__atomic_store_n(&f->rg, rg, __ATOMIC_RELEASE);
	if (f->rblocked)
		f->attach_due = 1;
	else
		shunt_ring_attach_reader(&rg->sf.r);
	pthread_mutex_unlock(&f->rmu);
	guard(f->fd);
	lease_keepalive(f->fd);
	plog("shunt: fd %d: shunt (slot %u, ring %llu bytes)", f->fd, m->slot, (unsigned long long)rg->sf.r.cap);
	flow_wake(f); /* a reader asleep on TCP now waits for the ring's start too */
}

/* reader_idle_leave: at DOWN, the reader leaves at once if nothing can
 * come through its ring any more (rmu held): it never marked the ring
 * attached (READY came while it was asleep in the kernel's recv, so the
 * peer's writer cannot have started; it would mark it only once a byte
 * came, and an idle peer sends none), or the ring's writer left (or is
 * gone): what the ring still holds is copied to the front of the stash
 * first (aside.c, reader_drain), so that a program that does not read for
 * a while loses nothing when hostd takes the ring's memory away after a
 * revocation; a reader still before the ring's start copies its stretch
 * aside instead (reader_ahead). Else it leaves when it reads the writer's
 * mark (path.c). */
static struct rings *reader_idle_leave(struct flow *f, struct rings *rg)
{
	if (rg->rleft)
		return NULL;
	if (__atomic_load_n(&f->rst, __ATOMIC_SEQ_CST))
		return reader_leave(f, rg); /* reset by RESUME: nothing more is read */
	if (shunt_flow_reset(&rg->sf)) {
		/* The peer's safety net (guard.c) or hostd's revocation reset
		 * the rings: the connection is reset, on TCP too. Leaving
		 * without this, a DOWN(peer-gone) from the peer's close had
		 * the reader take the kernel's FIN as a clean end. */
		__atomic_store_n(&f->rst, 1, __ATOMIC_SEQ_CST);
		return reader_leave(f, rg);
	}
	if (f->attach_due) {
		f->attach_due = 0;
		return reader_leave(f, rg);
	}
	struct shunt_ring *r = &rg->sf.r;
	uint64_t start;
	/* The mark is read first: a writer's start and bytes come before it. */
	if (!shunt_ring_writer_left(r) && !__atomic_load_n(&rg->peer_gone, __ATOMIC_SEQ_CST))
		return NULL;
	if (!shunt_ring_started(r, &start))
		return reader_leave(f, rg);
	if (!f->rring && f->roff != start) {
		/* TCP bytes before the ring's start are still due: after a
		 * DOWN for a firewall that now drops them, they come only with
		 * TCP's retransmissions once the rule goes. The ring must not
		 * wait for them: hostd takes a retired region back after its
		 * grace, and gives the connection rings again only after LEFT. */
		struct rings *done = NULL;
		if (start > f->roff && !reader_ahead(f, rg, start, &done))
			return done;
		return NULL;
	}
	if (shunt_ring_buffered(r) != 0 && reader_drain(f, r))
		return NULL; /* no memory, or reset: it leaves (or fails) when it reads the ring */
	return reader_leave(f, rg);
}

/* The leaver: a reader that DOWN could not make leave (the ring's writer
 * had not left yet) leaves when it reads the writer's mark; a program that
 * reads nothing meanwhile (idle, or asleep elsewhere) would never send
 * LEFT, and hostd could never give the connection rings again. One thread
 * per process, started at the first connection, looks again at the
 * connections that wait for a leave, every 1 ms and backing off to 50 ms,
 * and sends the OPENs that the open delay held back (open.c) when they are
 * due. It sleeps on leaver_tick (a futex word, no lock: fork-safe; a child
 * starts its own) with the earliest of those as its timeout, or none. */
static pid_t leaver_pid;     /* atomic: the process whose leaver runs, or is being started */
static pid_t leaver_up;      /* atomic: the process whose leaver runs (pthread_create returned) */
static uint32_t leaver_tick; /* atomic: 1 after something the leaver must look at */
static uint32_t leaver_due;  /* atomic: 1 after a DOWN that left a reader behind */

#define LEAVER_BATCH 64

/* leave_idle makes the readers (and writers) of connections that had DOWN
 * leave where they can: how many still wait. */
static int leave_idle(void)
{
	struct flow *fl[LEAVER_BATCH];
	int n = 0, waiting = 0;
	pthread_mutex_lock(&tab_mu);
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = fds[fd];
		struct rings *rg = f && f->owner == my_pid ? __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) : NULL;
		if (!rg || !__atomic_load_n(&rg->down, __ATOMIC_SEQ_CST) || (__atomic_load_n(&rg->left, __ATOMIC_SEQ_CST) & 3) == 3)
			continue;
		waiting++;
		int dup = 0;
		for (int i = 0; i < n && !dup; i++)
			dup = fl[i] == f;
		if (!dup && n < LEAVER_BATCH)
			fl[n++] = hold(f);
	}
	pthread_mutex_unlock(&tab_mu);
	for (int i = 0; i < n; i++) {
		struct flow *f = fl[i];
		struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE), *done = NULL, *d = NULL;
		if (rg) {
			pthread_mutex_lock(&f->wmu);
			if (__atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) == rg)
				done = writer_leave(f, rg);
			pthread_mutex_unlock(&f->wmu);
			pthread_mutex_lock(&f->rmu);
			if (__atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) == rg)
				d = reader_idle_leave(f, rg);
			pthread_mutex_unlock(&f->rmu);
		}
		if (done || d)
			waiting--;
		rings_done(f, done ? done : d);
		flow_put(f);
	}
	return waiting + resend_idle();
}

static void *leaver(void *arg)
{
	(void)arg;
	int64_t back = 1000000, leave_at = 0; /* 0: no reader waits for a leave */
	for (;;) {
		__atomic_store_n(&leaver_tick, 0, __ATOMIC_SEQ_CST);
		int64_t now = now_ns();
		if (__atomic_exchange_n(&leaver_due, 0, __ATOMIC_SEQ_CST))
			leave_at = now, back = 1000000;
		if (leave_at && now >= leave_at) {
			if (leave_idle() > 0) {
				leave_at = now + back;
				back = back * 2 < 50000000 ? back * 2 : 50000000;
			} else {
				leave_at = 0;
			}
		}
		int64_t open_at = open_due(), until = leave_at;
		if (open_at && (!until || open_at < until))
			until = open_at;
		struct timespec ts, *tp = NULL;
		if (until) {
			int64_t ns = until - now_ns();
			ns = ns > 0 ? ns : 0;
			ts = (struct timespec){ns / 1000000000, ns % 1000000000};
			tp = &ts;
		}
		/* Returns at once if a kick set leaver_tick since the store. */
		shunt_futex_wait(&leaver_tick, 0, tp);
	}
	return NULL;
}

/* A process that cannot start threads (HAProxy as packaged sets its
 * process limit to 0) is told so once, not at every connection (it once
 * logged it 29,419 times); it tries again at most once a second, quietly. */
#define LEAVER_RETRY_NS 1000000000
static pid_t leaver_said;      /* atomic: the process that said it cannot start its leaver */
static int64_t leaver_next_try; /* atomic: no new attempt before this (ns, monotonic) */

int leaver_start(void)
{
	if (__atomic_load_n(&leaver_up, __ATOMIC_ACQUIRE) == my_pid)
		return 0;
	if (__atomic_load_n(&leaver_said, __ATOMIC_ACQUIRE) == my_pid && now_ns() < __atomic_load_n(&leaver_next_try, __ATOMIC_RELAXED))
		return -1;
	pid_t p = __atomic_load_n(&leaver_pid, __ATOMIC_SEQ_CST);
	if (p == my_pid || !__atomic_compare_exchange_n(&leaver_pid, &p, my_pid, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
		/* Another thread starts it now: its answer is ours, so that no
		 * caller queues an OPEN for a leaver that never ran. */
		while (__atomic_load_n(&leaver_pid, __ATOMIC_SEQ_CST) == my_pid && __atomic_load_n(&leaver_up, __ATOMIC_ACQUIRE) != my_pid)
			sched_yield();
		return __atomic_load_n(&leaver_up, __ATOMIC_ACQUIRE) == my_pid ? 0 : -1;
	}
	int e = shunt_thread_start(NULL, 64 << 10, leaver, NULL);
	if (e) {
		__atomic_store_n(&leaver_next_try, now_ns() + LEAVER_RETRY_NS, __ATOMIC_RELAXED);
		if (__atomic_exchange_n(&leaver_said, my_pid, __ATOMIC_ACQ_REL) != my_pid)
			plog("shunt: cannot start the leaver thread: %s (a process limit?): OPEN goes at once, idle readers leave "
			     "at their next read; said once",
			     strerror(e));
		__atomic_store_n(&leaver_pid, 0, __ATOMIC_SEQ_CST);
		return -1;
	}
	__atomic_store_n(&leaver_up, my_pid, __ATOMIC_RELEASE);
	return 0;
}

void leaver_wake(void)
{
	__atomic_store_n(&leaver_tick, 1, __ATOMIC_SEQ_CST);
	shunt_futex_wake(&leaver_tick, 1);
}

/* leaver_kick: a DOWN left a direction behind, or a RESUME a resend;
 * the leaver looks again. */
void leaver_kick(void)
{
	__atomic_store_n(&leaver_due, 1, __ATOMIC_SEQ_CST);
	leaver_start();
	leaver_wake();
}

/* down: the writer leaves at once, after the step of a write in progress
 * (each step under wmu is short, and the ring's stop ends its spin); the
 * reader leaves at once if it can (reader_idle_leave), else it drains and
 * leaves when it reads the writer's mark (or, the peer gone, when the ring
 * is empty). Sleepers are woken to see it. */
void conn_down(struct flow *f, const struct shunt_msg *m)
{
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (!rg || (m->slot != rg->sf.slot || m->gen != rg->sf.gen || m->region_id != rg->sf.region_id))
		return; /* an older pair's, already left */
	plog("shunt: fd %d: down (%s)", f->fd, shunt_reason_name(m->reason));
	if (m->reason == SHUNT_REASON_PEER_GONE) {
		__atomic_store_n(&rg->peer_gone, 1, __ATOMIC_SEQ_CST);
		shunt_ring_stop(&rg->sf.r, 1); /* a reader asleep on the ring looks again */
	}
	__atomic_store_n(&rg->down, 1, __ATOMIC_SEQ_CST);
	shunt_ring_stop(&rg->sf.w, 0); /* a writer asleep on a full ring leaves */
	struct rings *done = NULL, *d = NULL;
	/* Not a trylock: a writer that held wmu (a step on TCP, before or
	 * after its kernel send) would never look at DOWN again if it never
	 * started the ring, and one that did would leave only at its next
	 * write: an idle writer never. */
	pthread_mutex_lock(&f->wmu);
	if (__atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) == rg)
		done = writer_leave(f, rg);
	pthread_mutex_unlock(&f->wmu);
	pthread_mutex_lock(&f->rmu);
	int behind = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) == rg;
	if (behind)
		d = reader_idle_leave(f, rg);
	pthread_mutex_unlock(&f->rmu);
	rings_done(f, done ? done : d);
	if (behind && !done && !d)
		leaver_kick(); /* the reader waits for the writer's mark */
	flow_wake(f);
}

void conn_cb(void *arg, const struct shunt_msg *m)
{
	(void)arg;
	struct flow *f = by_req(m->req_id);
	if (!f)
		return;
	if (m->type == SHUNT_READY)
		ready(f, m);
	else if (m->type == SHUNT_DOWN) {
		if (!resume_down(f, m))
			conn_down(f, m);
	}
	else if (m->type == SHUNT_RESUME)
		resume(f, m);
	else if (m->type == SHUNT_TCP)
		plog("shunt: fd %d: tcp (%s)", f->fd, shunt_reason_name(m->reason));
	flow_put(f);
}

/* A REVOKE (hostd no longer sends it to this protocol version) is a DOWN. */
void conn_revoked(void *arg, const struct shunt_msg *m)
{
	(void)arg;
	struct flow *f = NULL;
	pthread_mutex_lock(&tab_mu);
	for (int fd = 0; fd < FD_MAX && !f; fd++) {
		struct flow *g = fds[fd];
		struct rings *rg = g && g->owner == my_pid ? __atomic_load_n(&g->rg, __ATOMIC_ACQUIRE) : NULL;
		if (rg && rg->sf.region_id == m->region_id && rg->sf.slot == m->slot && rg->sf.gen == m->gen)
			f = hold(g);
	}
	pthread_mutex_unlock(&tab_mu);
	if (!f)
		return;
	struct shunt_msg d = *m;
	d.type = SHUNT_DOWN;
	conn_down(f, &d);
	flow_put(f);
}

/* conn_holds reports whether this process has listeners or connections
 * that a new hostd must hear of. */
int conn_holds(void *arg)
{
	(void)arg;
	for (int fd = 0; fd < FD_MAX; fd++)
		if (kind[fd] == FD_LISTENER || (fds[fd] && fds[fd]->owner == my_pid))
			return 1;
	return 0;
}

/* conn_announce tells a new hostd what this process holds: LISTEN for
 * each listener, REATTACH for each connection on rings and OPEN again,
 * with its request id, for each on TCP. Collected under tab_mu, sent
 * after it. */
void conn_announce(void *arg, struct shunt_session *s)
{
	(void)arg;
	int cap = 16, n = 0;
	struct shunt_msg *ms = malloc(cap * sizeof *ms);
	struct flow **who = malloc(cap * sizeof *who);
	if (!ms || !who) {
		plog("shunt: out of memory: cannot tell the new hostd of listeners and connections");
		free(ms);
		free(who);
		return;
	}
	pthread_mutex_lock(&tab_mu);
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct shunt_msg m = {0};
		struct flow *f = fds[fd];
		if (kind[fd] == FD_LISTENER) {
			m.type = SHUNT_LISTEN;
			if (local_of(fd, &m.local))
				continue;
		} else if (f && f->owner == my_pid && f->req && !__atomic_load_n(&f->closed, __ATOMIC_SEQ_CST)) {
			/* (one without a request id is still in the open delay: its OPEN comes when due) */
			int dup = 0; /* once per connection, though dup'd fds share it */
			for (int i = 0; i < n && !dup; i++)
				dup = who[i] == f;
			if (dup)
				continue;
			struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
			f->told = 1; /* told now (a send that fails leaves a CLOSE hostd ignores) */
			if (rg)
				m = (struct shunt_msg){.type = SHUNT_REATTACH, .req_id = f->req, .region_id = rg->sf.region_id,
						       .slot = rg->sf.slot, .gen = rg->sf.gen, .side = rg->sf.side};
			else
				m = (struct shunt_msg){.type = SHUNT_OPEN, .req_id = f->req, .role = f->role};
			if (local_of(fd, &m.local) || remote_of(fd, &m.remote))
				continue;
		} else {
			continue;
		}
		if (n == cap) {
			struct shunt_msg *more = realloc(ms, 2 * cap * sizeof *more);
			struct flow **wmore = more ? realloc(who, 2 * cap * sizeof *wmore) : NULL;
			if (more)
				ms = more;
			if (!wmore) {
				plog("shunt: out of memory: told the new hostd of only %d listeners and connections", n);
				break;
			}
			who = wmore;
			cap *= 2;
		}
		who[n] = kind[fd] == FD_LISTENER ? NULL : f;
		ms[n++] = m;
	}
	pthread_mutex_unlock(&tab_mu);
	for (int i = 0; i < n; i++)
		shunt_session_send(s, &ms[i]);
	if (n)
		plog("shunt: told hostd of %d listeners and connections", n);
	free(ms);
	free(who);
}
