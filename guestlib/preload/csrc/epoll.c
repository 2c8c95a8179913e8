/* epoll: interest in connections is kept here, where their readiness is
 * worked out (wait.c, fast_events: the kernel socket's for a TCP path, the
 * ring's for a ring path, and the switch between them). Their kernel
 * sockets are in the kernel's set too, edge-triggered and tagged
 * (CONN_TAG), only to wake a wait and to note the TCP path's own edges
 * for EPOLLET interests (drop_magic): the tagged events are never reported.
 * Everything else is the kernel's. A set that holds an epoll set (nesting)
 * is told of the inner set's connections' readiness too. Waiting is
 * wait.c's: spin, arm, block with the helper's eventfd in the set.
 *
 * No event of the library's own (a tagged socket, a helper's eventfd) is
 * ever handed to the program, whatever the path: every kernel wait goes
 * through strip() (epoll_wait, epoll_pwait, epoll_pwait2; sets with no
 * fast-path interest; sets the library does not know, such as a dup of a
 * set or one inherited across exec). A thread blocked on a set is kicked
 * (struct waiter) when another thread adds or changes a fast-path interest
 * there, so that it arms the new interest's rings: Apache's event MPM adds
 * connections to its listener thread's set while that thread sleeps in it,
 * and the set had no fast-path interest before (the tag once leaked there
 * as epoll_event.data, and APR crashed on it). */
#include "preload.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define EFD_MAGIC      0x5348554e54454644ull /* "SHUNTEFD": the helper's eventfd in a set */
#define CONN_TAG       0x53484e5400000000ull /* "SHNT" + fd: a connection's kernel socket in a set, a wake-up only */
#define TAG_MASK       0xffffffff00000000ull
#define KERNEL_EVERY   16                    /* while spinning, the kernel is asked every this many turns */
#define KERNEL_POLL_NS 5000                  /* epoll_wait(0) asks the kernel at most this often */
#define RECHECK_NS     1000000               /* a waiter without an eventfd looks again this often */
#define REG_MAX        4                     /* helpers' eventfds a set remembers being in its kernel set */

/* What an EPOLLET interest in a connection was last reported at: where
 * each direction is (stream offsets, paths, the rings' positions and the
 * flags the peer sets on them: start, leave, FIN, attach) and the events.
 * A report is due when any of it moved: every switch of path, every
 * byte or room on a ring, every start or leave mark is a new edge, even
 * when the stream offsets did not move (a report whose read found nothing
 * yet, then the writer's leave mark, with the TCP bytes after it already
 * in the kernel: no new kernel edge will come for them). */
struct edge {
	uint64_t roff, sent, rtail, whead;
	const struct rings *rg;
	uint32_t rflags, wflags, got;
	size_t slen, alen;
	int seof, rring, wring, rleft, wleft, down, peer_gone;
};

/* One interest in a fast-path fd, or in a nested set (in). */
struct epi {
	int fd;
	struct epoll_event ev;
	int seen;        /* EPOLLET: last is what was reported */
	struct edge last;
	uint32_t kedge;  /* EPOLLET: the kernel socket's own edges (tagged events) not reported yet */
	struct ep *in;   /* a nested set */
	int pend;        /* a socket whose connect is under way: in the kernel's set too, until settled */
};

/* A thread blocked in a set's kernel wait: an interest added or changed
 * meanwhile writes efd (its eventfd, in the kernel set as EFD_MAGIC), so
 * that it looks again and arms the new interest's rings. */
struct waiter {
	int efd;
	int kicked;
	struct waiter *next;
};

/* The library's side of one epoll set. Sets are never freed: closing one
 * empties it for the next set with its fd number, so a pointer to it (an
 * outer set's in) never dangles. */
struct ep {
	int fd;
	int live;        /* an open epoll fd; under ep_mu */
	unsigned gen;    /* fork_gen when it became live: another, so a fork since may share its kernel set; under ep_mu */
	struct ep *next; /* the list of sets with fds >= FD_MAX */
	pthread_mutex_t mu; /* guards the fields below */
	struct epi *it;
	int n, cap;
	int pend;          /* interests with pend set */
	int64_t kernel_at; /* when epoll_wait(0) last asked the kernel */
	struct waiter *waiters; /* threads blocked in the kernel wait */
	int nested;        /* atomic: another set held it once (kick_outer looks for it then) */
	/* helpers' eventfds known to be in the kernel set (efd_in), by
	 * (efd, helper id); the kernel drops one when its helper's thread
	 * exits (the eventfd closes), and a later helper has another id */
	struct {
		int efd;
		unsigned id;
	} reg[REG_MAX];
	unsigned reg_next;
};

static pthread_mutex_t ep_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ep *eps[FD_MAX]; /* by fd; under ep_mu */
static struct ep *eps_high;    /* sets with fds >= FD_MAX, a list; under ep_mu */
static int eps_top;            /* one past the highest fd in eps; under ep_mu */

/* find_locked returns fd's set (live or not), making it if create. */
static struct ep *find_locked(int fd, int create)
{
	if (fd < 0)
		return NULL;
	struct ep **slot = fd < FD_MAX ? &eps[fd] : &eps_high;
	if (fd >= FD_MAX)
		while (*slot && (*slot)->fd != fd)
			slot = &(*slot)->next;
	if (!*slot && create) {
		struct ep *e = calloc(1, sizeof *e);
		if (!e)
			return NULL;
		e->fd = fd;
		pthread_mutex_init(&e->mu, NULL);
		__atomic_store_n(slot, e, __ATOMIC_RELEASE);
		if (fd < FD_MAX && fd >= eps_top)
			eps_top = fd + 1;
	}
	if (*slot && create && !(*slot)->live) {
		memset((*slot)->reg, 0, sizeof (*slot)->reg); /* a new kernel set */
		(*slot)->live = 1;
		(*slot)->gen = __atomic_load_n(&fork_gen, __ATOMIC_RELAXED);
	}
	return *slot;
}

/* ep_get returns the live set of epfd, making it if create (or NULL). */
static struct ep *ep_get(int epfd, int create)
{
	pthread_mutex_lock(&ep_mu);
	struct ep *e = find_locked(epfd, create);
	if (e && !e->live)
		e = NULL;
	pthread_mutex_unlock(&ep_mu);
	return e;
}

int ep_is_set(int fd) { return ep_get(fd, 0) != NULL; }

int ep_maybe_set(int fd)
{
	struct ep *e = fd >= 0 && fd < FD_MAX ? __atomic_load_n(&eps[fd], __ATOMIC_ACQUIRE) : NULL;
	return e && __atomic_load_n(&e->live, __ATOMIC_RELAXED);
}

int ep_high_in(unsigned first, unsigned last, int *out, int max)
{
	int n = 0;
	pthread_mutex_lock(&ep_mu);
	for (struct ep *e = eps_high; e && n < max; e = e->next)
		if (e->live && (unsigned)e->fd >= first && (unsigned)e->fd <= last)
			out[n++] = e->fd;
	pthread_mutex_unlock(&ep_mu);
	return n;
}

/* drop_locked forgets fd's interests in e before fd's kernel close, and
 * takes its kernel socket out of e's kernel set: a thread asleep in that
 * set's epoll_wait may hold the file's last reference after the close
 * (Linux 6.10+ polls an item under a reference of its own), and the
 * socket's release (the FIN) would then wait until that thread returns to
 * user space (guard.c, guard_forget). But a connection that other
 * processes may hold since a fork (shared: its fd is closed here, not its
 * socket) keeps its kernel socket in a set a fork may have shared (made
 * before this process's last fork): that entry is the other process's
 * too, whose epoll_wait would no longer wake for it (without the library,
 * such a close removes nothing from the set either). */
static void drop_locked(struct ep *e, int fd, int shared)
{
	int had = 0;
	pthread_mutex_lock(&e->mu);
	for (int j = 0; j < e->n; j++)
		if (e->it[j].fd == fd) {
			e->pend -= e->it[j].pend;
			e->it[j--] = e->it[--e->n];
			had = 1;
		}
	if (had && !(shared && e->gen != __atomic_load_n(&fork_gen, __ATOMIC_RELAXED)))
		real_epoll_ctl(e->fd, EPOLL_CTL_DEL, fd, NULL);
	pthread_mutex_unlock(&e->mu);
}

void ep_forget(int fd, int was_fast)
{
	pthread_mutex_lock(&ep_mu);
	struct ep *self = find_locked(fd, 0);
	if (self && !self->live)
		self = NULL;
	if (was_fast || self) { /* drop its interests in every set */
		for (int i = 0; i < eps_top; i++)
			if (eps[i] && eps[i]->live)
				drop_locked(eps[i], fd, was_fast == 2);
		for (struct ep *e = eps_high; e; e = e->next)
			if (e->live)
				drop_locked(e, fd, was_fast == 2);
	}
	if (self) {
		pthread_mutex_lock(&self->mu);
		self->n = self->pend = 0;
		self->kernel_at = 0;
		self->live = 0;
		pthread_mutex_unlock(&self->mu);
	}
	pthread_mutex_unlock(&ep_mu);
}

/* ep_letgo: fd's connection became a plain kernel socket (a fork let it
 * go, fork.c), so its interests here become the kernel's own, with the
 * program's events and data. The kernel's set is shared by both processes
 * of the fork: the parent changes it (kernel set), the child only forgets
 * its copy of the interests. */
void ep_letgo(int fd, int kernel)
{
	pthread_mutex_lock(&ep_mu);
	for (int i = 0; i <= eps_top; i++) {
		struct ep *e = i < eps_top ? eps[i] : eps_high;
		for (; e; e = i < eps_top ? NULL : e->next) {
			if (!e->live)
				continue;
			pthread_mutex_lock(&e->mu);
			for (int j = 0; j < e->n; j++) {
				struct epi *x = &e->it[j];
				if (x->fd != fd || x->in || x->pend)
					continue;
				if (kernel)
					real_epoll_ctl(e->fd, EPOLL_CTL_MOD, fd, &x->ev);
				e->it[j--] = e->it[--e->n];
			}
			pthread_mutex_unlock(&e->mu);
		}
	}
	pthread_mutex_unlock(&ep_mu);
}

/* ep_fork takes ep_mu and every set's mu before fork, and lets them go in
 * the parent, or makes them new in the child (lifetime.c). A thread that
 * holds a set's mu waits for no other lock of ours (scan lets go of it
 * before it takes a nested set's), so taking them all cannot deadlock. */
static void fork_set(struct ep *e, int phase)
{
	if (phase == FORK_PREPARE)
		pthread_mutex_lock(&e->mu);
	else if (phase == FORK_PARENT)
		pthread_mutex_unlock(&e->mu);
	else
		pthread_mutex_init(&e->mu, NULL);
}

void ep_fork(int phase)
{
	if (phase == FORK_PREPARE)
		pthread_mutex_lock(&ep_mu);
	for (int i = 0; i < eps_top; i++)
		if (eps[i])
			fork_set(eps[i], phase);
	for (struct ep *e = eps_high; e; e = e->next)
		fork_set(e, phase);
	if (phase == FORK_PARENT)
		pthread_mutex_unlock(&ep_mu);
	else if (phase == FORK_CHILD)
		pthread_mutex_init(&ep_mu, NULL);
}

/* add appends x to e (e->mu held): 0, or -1 with ENOMEM. */
static int add(struct ep *e, struct epi x)
{
	if (e->n == e->cap) {
		int cap = e->cap ? 2 * e->cap : 8;
		struct epi *it = realloc(e->it, cap * sizeof *it);
		if (!it)
			return errno = ENOMEM, -1;
		e->it = it, e->cap = cap;
	}
	e->it[e->n++] = x;
	return 0;
}

static int find(struct ep *e, int fd)
{
	for (int i = 0; i < e->n; i++)
		if (e->it[i].fd == fd)
			return i;
	return -1;
}

/* kick_locked wakes every thread blocked on e (e->mu held): an interest
 * changed, which their armed rings do not cover. */
static void kick_locked(struct ep *e)
{
	for (struct waiter *w = e->waiters; w; w = w->next)
		if (!w->kicked) {
			uint64_t one = 1;
			w->kicked = 1;
			ssize_t r = real_write(w->efd, &one, sizeof one); /* fails only when the count is full: awake anyway */
			(void)r;
		}
}

/* kick_outer kicks the waiters of every set that holds e, and of theirs,
 * up to the kernel's 4 levels of nesting (e->mu not held): an outer set's
 * waiter armed the inner set's rings as they were, and the kernel wakes
 * it for the inner set's kernel events only, never for a ring. */
static void kick_outer(struct ep *e, int depth)
{
	if (depth >= 4 || !__atomic_load_n(&e->nested, __ATOMIC_RELAXED))
		return;
	struct ep *outer[16];
	int n = 0;
	pthread_mutex_lock(&ep_mu);
	for (int i = 0; i <= eps_top; i++) {
		struct ep *o = i < eps_top ? eps[i] : eps_high;
		for (; o; o = i < eps_top ? NULL : o->next) {
			if (!o->live || o == e)
				continue;
			pthread_mutex_lock(&o->mu);
			for (int j = 0; j < o->n; j++)
				if (o->it[j].in == e) {
					kick_locked(o);
					if (n < 16)
						outer[n++] = o;
					break;
				}
			pthread_mutex_unlock(&o->mu);
		}
	}
	pthread_mutex_unlock(&ep_mu);
	for (int i = 0; i < n; i++)
		kick_outer(outer[i], depth + 1);
}

/* efd_in makes sure eventfd efd (helper id) is in e's kernel set as
 * EFD_MAGIC: an epoll_ctl the first time, not at every wait. 0, or -1. */
static int efd_in(struct ep *e, int efd, unsigned id)
{
	pthread_mutex_lock(&e->mu);
	for (int i = 0; i < REG_MAX; i++)
		if (e->reg[i].id == id && e->reg[i].efd == efd) {
			pthread_mutex_unlock(&e->mu);
			return 0;
		}
	pthread_mutex_unlock(&e->mu);
	struct epoll_event m = {.events = EPOLLIN, .data.u64 = EFD_MAGIC};
	if (real_epoll_ctl(e->fd, EPOLL_CTL_ADD, efd, &m) < 0 && errno != EEXIST)
		return -1;
	pthread_mutex_lock(&e->mu);
	unsigned at = e->reg_next++ % REG_MAX;
	e->reg[at].efd = efd;
	e->reg[at].id = id;
	pthread_mutex_unlock(&e->mu);
	return 0;
}

static void wait_on(struct ep *e, struct waiter *w)
{
	w->next = e->waiters;
	e->waiters = w;
}

static void wait_off(struct ep *e, struct waiter *w)
{
	pthread_mutex_lock(&e->mu);
	for (struct waiter **p = &e->waiters; *p; p = &(*p)->next)
		if (*p == w) {
			*p = w->next;
			break;
		}
	pthread_mutex_unlock(&e->mu);
}

/* ctl_kernel registers (or changes, or drops) a connection's kernel
 * socket in the kernel's set as a wake-up for interest ev. */
static int ctl_kernel(int epfd, int op, int fd, const struct epoll_event *ev)
{
	struct epoll_event k = {.events = EPOLLET, .data.u64 = CONN_TAG | (uint32_t)fd};
	if (ev)
		k.events |= ev->events & (EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLPRI);
	int r = real_epoll_ctl(epfd, op, fd, &k);
	if (r < 0 && op == EPOLL_CTL_ADD && errno == EEXIST)
		r = real_epoll_ctl(epfd, EPOLL_CTL_MOD, fd, &k);
	return r;
}

/* ctl_nested registers an inner epoll set with the kernel as usual and
 * also here, so the outer set sees the inner set's fast-path readiness. */
static int ctl_nested(int epfd, int op, int fd, struct epoll_event *ev)
{
	int r = real_epoll_ctl(epfd, op, fd, ev);
	struct ep *e = r < 0 ? NULL : ep_get(epfd, 1), *in = ep_get(fd, 0);
	if (!e || !in)
		return r;
	pthread_mutex_lock(&e->mu);
	int at = find(e, fd);
	if (op == EPOLL_CTL_DEL && at >= 0)
		e->it[at] = e->it[--e->n];
	else if (op == EPOLL_CTL_MOD && at >= 0)
		e->it[at].ev = *ev;
	else if (op == EPOLL_CTL_ADD && at < 0 && add(e, (struct epi){.fd = fd, .ev = *ev, .in = in})) {
		pthread_mutex_unlock(&e->mu);
		real_epoll_ctl(epfd, EPOLL_CTL_DEL, fd, NULL); /* all or nothing */
		return errno = ENOMEM, -1;
	}
	if (op != EPOLL_CTL_DEL)
		kick_locked(e);
	pthread_mutex_unlock(&e->mu);
	if (op == EPOLL_CTL_ADD)
		__atomic_store_n(&in->nested, 1, __ATOMIC_RELAXED);
	if (op != EPOLL_CTL_DEL)
		kick_outer(e, 0);
	return r;
}

/* ctl_pending registers a socket whose non-blocking connect is under way
 * with the kernel as usual and also here, so that the set's waits settle
 * it (socket.c) and then move it here if it takes the fast path. */
static int ctl_pending(int epfd, int op, int fd, struct epoll_event *ev)
{
	int r = real_epoll_ctl(epfd, op, fd, ev);
	struct ep *e = r < 0 ? NULL : ep_get(epfd, 1);
	if (!e)
		return r;
	pthread_mutex_lock(&e->mu);
	int at = find(e, fd);
	if (op == EPOLL_CTL_DEL && at >= 0) {
		e->pend -= e->it[at].pend;
		e->it[at] = e->it[--e->n];
	} else if (op == EPOLL_CTL_MOD && at >= 0) {
		e->it[at].ev = *ev;
	} else if (op == EPOLL_CTL_ADD && at < 0) {
		if (add(e, (struct epi){.fd = fd, .ev = *ev, .pend = 1})) {
			pthread_mutex_unlock(&e->mu);
			real_epoll_ctl(epfd, EPOLL_CTL_DEL, fd, NULL); /* all or nothing */
			return errno = ENOMEM, -1;
		}
		e->pend++;
	}
	if (op != EPOLL_CTL_DEL)
		kick_locked(e); /* its waits re-check it every 1 ms until it settles */
	pthread_mutex_unlock(&e->mu);
	if (op != EPOLL_CTL_DEL)
		kick_outer(e, 0);
	return r;
}

/* settle_set settles e's sockets whose connect was under way (outside
 * e->mu: settling waits for hostd), then takes a fast-path one out of the
 * kernel's set (its interest is here now) and forgets one left on TCP
 * (the kernel's set has it). */
static void settle_set(struct ep *e)
{
	int fd[16], k = 0;
	pthread_mutex_lock(&e->mu);
	for (int i = 0; i < e->n && k < 16; i++)
		if (e->it[i].pend)
			fd[k++] = e->it[i].fd;
	pthread_mutex_unlock(&e->mu);
	for (int i = 0; i < k; i++)
		settle(fd[i]);
	pthread_mutex_lock(&e->mu);
	for (int i = 0; i < e->n; i++) {
		struct epi *x = &e->it[i];
		if (!x->pend || pending(x->fd))
			continue;
		x->pend = 0;
		e->pend--;
		if (flow_of(x->fd)) {
			ctl_kernel(e->fd, EPOLL_CTL_MOD, x->fd, &x->ev);
			x->seen = 0;
			x->kedge = 0;
		} else {
			e->it[i--] = e->it[--e->n];
		}
	}
	pthread_mutex_unlock(&e->mu);
}

INTERPOSE int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
	REAL_READY();
	if (ep_is_set(fd))
		return ctl_nested(epfd, op, fd, ev);
	if (pending(fd))
		return ctl_pending(epfd, op, fd, ev);
	struct flow *f = flow_of(fd);
	struct ep *e = ep_get(epfd, f != NULL);
	if (!e && f) /* the kernel's set alone would miss the rings */
		return errno = ENOMEM, -1;
	if (!e)
		return real_epoll_ctl(epfd, op, fd, ev);
	pthread_mutex_lock(&e->mu);
	int at = find(e, fd), r = 0;
	if (!f && at < 0) {
		pthread_mutex_unlock(&e->mu);
		return real_epoll_ctl(epfd, op, fd, ev);
	}
	if (op == EPOLL_CTL_ADD && at >= 0)
		r = -1, errno = EEXIST;
	else if (op != EPOLL_CTL_ADD && at < 0)
		r = -1, errno = ENOENT;
	else if (op == EPOLL_CTL_DEL) {
		real_epoll_ctl(epfd, EPOLL_CTL_DEL, fd, NULL);
		e->pend -= e->it[at].pend;
		e->it[at] = e->it[--e->n];
	} else if (op == EPOLL_CTL_MOD) {
		e->it[at].ev = *ev, e->it[at].seen = 0, e->it[at].kedge = 0;
		if (!e->it[at].pend)
			ctl_kernel(epfd, EPOLL_CTL_MOD, fd, ev);
	} else if ((r = ctl_kernel(epfd, EPOLL_CTL_ADD, fd, ev)) == 0 && (r = add(e, (struct epi){.fd = fd, .ev = *ev})))
		real_epoll_ctl(epfd, EPOLL_CTL_DEL, fd, NULL); /* all or nothing */
	if (r == 0 && op != EPOLL_CTL_DEL)
		kick_locked(e);
	pthread_mutex_unlock(&e->mu);
	if (r == 0 && op != EPOLL_CTL_DEL)
		kick_outer(e, 0);
	return r;
}

static uint32_t ep_from_poll(short r)
{
	return (r & POLLIN ? EPOLLIN : 0) | (r & POLLOUT ? EPOLLOUT : 0) | (r & POLLERR ? EPOLLERR : 0) |
	       (r & POLLHUP ? EPOLLHUP : 0) | (r & POLLRDHUP ? EPOLLRDHUP : 0);
}

enum scan { REPORT, PEEK, ARM };

/* edge_of takes f's state for an EPOLLET report of got (struct edge).
 * Read without the reader's and writer's locks: a torn view only makes
 * one more report, never one less, since every change is compared. */
static void edge_of(struct flow *f, uint32_t got, struct edge *d)
{
	memset(d, 0, sizeof *d);
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	d->roff = __atomic_load_n(&f->roff, __ATOMIC_RELAXED);
	d->sent = __atomic_load_n(&f->sent, __ATOMIC_RELAXED);
	d->rring = __atomic_load_n(&f->rring, __ATOMIC_RELAXED);
	d->wring = __atomic_load_n(&f->wring, __ATOMIC_RELAXED);
	d->slen = __atomic_load_n(&f->slen, __ATOMIC_RELAXED);
	d->alen = __atomic_load_n(&f->alen, __ATOMIC_RELAXED);
	d->seof = __atomic_load_n(&f->seof, __ATOMIC_RELAXED);
	d->got = got;
	d->rg = rg;
	if (rg) {
		d->rtail = __atomic_load_n((uint64_t *)(rg->sf.r.hdr + SHUNT_OFF_TAIL), __ATOMIC_SEQ_CST);
		d->wflags = __atomic_load_n((uint32_t *)(rg->sf.r.hdr + SHUNT_OFF_WFLAGS), __ATOMIC_SEQ_CST);
		d->whead = __atomic_load_n((uint64_t *)(rg->sf.w.hdr + SHUNT_OFF_HEAD), __ATOMIC_SEQ_CST);
		d->rflags = __atomic_load_n((uint32_t *)(rg->sf.w.hdr + SHUNT_OFF_RFLAGS), __ATOMIC_SEQ_CST);
		d->rleft = __atomic_load_n(&rg->rleft, __ATOMIC_RELAXED);
		d->wleft = __atomic_load_n(&rg->wleft, __ATOMIC_RELAXED);
		d->down = __atomic_load_n(&rg->down, __ATOMIC_SEQ_CST);
		d->peer_gone = __atomic_load_n(&rg->peer_gone, __ATOMIC_SEQ_CST);
	}
}

static int same_edge(const struct edge *a, const struct edge *b)
{
	return a->roff == b->roff && a->sent == b->sent && a->rtail == b->rtail && a->whead == b->whead && a->rg == b->rg &&
	       a->rflags == b->rflags && a->wflags == b->wflags && a->got == b->got && a->slen == b->slen && a->alen == b->alen && a->seof == b->seof &&
	       a->rring == b->rring && a->wring == b->wring && a->rleft == b->rleft && a->wleft == b->wleft && a->down == b->down &&
	       a->peer_gone == b->peer_gone;
}

/* scan goes over a set's fast-path interests. REPORT writes up to max
 * ready ones to out (level-triggered; EPOLLET once per new state of the
 * paths or new edge of the kernel socket, struct edge and drop_magic;
 * EPOLLONESHOT then disarms), PEEK only counts them (at most max) and
 * changes nothing, ARM adds their rings' wait words to a. A nested set is
 * ready (EPOLLIN) when a PEEK of it finds something. */
static int scan(struct ep *e, struct epoll_event *out, int max, enum scan mode, struct arm *a)
{
	int k = 0;
	pthread_mutex_lock(&e->mu);
	for (int i = 0; i < e->n && k < max; i++) {
		struct epi *x = &e->it[i];
		if (x->in) {
			struct ep *in = x->in;
			epoll_data_t data = x->ev.data;
			if (in == e || !(x->ev.events & EPOLLIN))
				continue;
			pthread_mutex_unlock(&e->mu); /* one set's lock at a time */
			int ready = mode == ARM ? (scan(in, NULL, INT_MAX, ARM, a), 0) : scan(in, NULL, 1, PEEK, NULL);
			pthread_mutex_lock(&e->mu);
			if (ready && mode == REPORT)
				out[k] = (struct epoll_event){.events = EPOLLIN, .data = data};
			k += ready;
			continue;
		}
		struct flow *f = x->pend ? NULL : flow_of(x->fd);
		if (!f || !(x->ev.events & ~(EPOLLET | EPOLLONESHOT)))
			continue;
		short want = (x->ev.events & EPOLLIN ? POLLIN : 0) | (x->ev.events & EPOLLOUT ? POLLOUT : 0) |
			     (x->ev.events & EPOLLRDHUP ? POLLRDHUP : 0);
		if (mode == ARM) {
			if (want & POLLIN)
				arm_add(a, f, 1);
			if (want & POLLOUT)
				arm_add(a, f, 0);
			continue;
		}
		uint32_t got = ep_from_poll(fast_events(f, x->fd, want, -1)) & (x->ev.events | EPOLLERR | EPOLLHUP);
		if (!got)
			continue;
		if (x->ev.events & EPOLLET) {
			/* Once per new state of the paths (edge_of), or a new
			 * edge of the kernel socket for an event it reports. */
			struct edge now;
			edge_of(f, got, &now);
			if (x->seen && same_edge(&now, &x->last) && !(x->kedge & got))
				continue;
			if (mode == REPORT) {
				x->seen = 1;
				x->last = now;
				x->kedge = 0;
			}
		}
		if (mode == REPORT) {
			if (x->ev.events & EPOLLONESHOT)
				x->ev.events &= EPOLLET | EPOLLONESHOT;
			out[k] = (struct epoll_event){.events = got, .data = x->ev.data};
		}
		k++;
	}
	pthread_mutex_unlock(&e->mu);
	return k;
}

static int magic(uint64_t d) { return d == EFD_MAGIC || (d & TAG_MASK) == CONN_TAG; }

/* drop_magic removes the library's own events (helpers' eventfds, the
 * connections' tagged kernel sockets: wake-ups only) from n kernel events
 * at ev; e may be NULL (a set the library does not know). A tagged event
 * is the kernel socket's own edge (new bytes or room on TCP): it is kept
 * in the interest (kedge), so that an EPOLLET interest reports the TCP
 * path's new data even when nothing the library tracks moved. */
static int drop_magic(struct ep *e, struct epoll_event *ev, int n)
{
	int kept = 0, tagged = 0;
	for (int i = 0; i < n; i++)
		if (!magic(ev[i].data.u64))
			ev[kept++] = ev[i];
		else if (ev[i].data.u64 != EFD_MAGIC)
			tagged = 1;
	if (!tagged || !e || kept == n)
		return kept;
	pthread_mutex_lock(&e->mu);
	for (int i = 0; i < n; i++) {
		if ((ev[i].data.u64 & TAG_MASK) != CONN_TAG || ev[i].data.u64 == EFD_MAGIC)
			continue;
		int at = find(e, (int)(uint32_t)ev[i].data.u64);
		if (at >= 0 && !e->it[at].in && !e->it[at].pend)
			e->it[at].kedge |= ev[i].events & (EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLPRI | EPOLLERR | EPOLLHUP);
	}
	pthread_mutex_unlock(&e->mu);
	return kept;
}

/* kwait is the kernel's wait for ns (< 0: none), rounded up to whole ms. */
static int kwait(int epfd, struct epoll_event *ev, int max, int64_t ns, const sigset_t *mask)
{
	int ms = ns < 0 ? -1 : ns >= (int64_t)INT_MAX * 1000000 ? INT_MAX : (int)((ns + 999999) / 1000000);
	return real_epoll_pwait(epfd, ev, max, ms, mask);
}

static void drain(int efd)
{
	uint64_t v;
	while (real_read(efd, &v, sizeof v) == sizeof v)
		;
}

#define FULL (-2) /* plain_wait: the set has fast-path interests now */

/* plain_wait waits on a set with no fast-path interest (e), or one the
 * library does not know (e NULL): the kernel's wait, with the library's
 * events stripped. A known set lists the thread as a waiter, so that an
 * interest added meanwhile by another thread wakes it (FULL: the caller
 * waits the full way then). */
static int plain_wait(struct ep *e, int epfd, struct epoll_event *ev, int max, int64_t deadline, const sigset_t *mask)
{
	for (;;) {
		int64_t left = deadline < 0 ? -1 : deadline - now_ns();
		if (left < 0 && deadline >= 0)
			left = 0;
		struct waiter w = {.efd = -1};
		if (e) {
			unsigned id;
			int efd = left ? wake_efd(&id) : -1;
			if (efd >= 0 && efd_in(e, efd, id))
				efd = -1;
			pthread_mutex_lock(&e->mu);
			if (e->n) {
				pthread_mutex_unlock(&e->mu);
				return FULL;
			}
			w.efd = efd;
			if (efd >= 0)
				wait_on(e, &w);
			pthread_mutex_unlock(&e->mu);
			if (efd < 0 && left) /* no eventfd: an interest added meanwhile is seen within RECHECK_NS */
				left = left < 0 || left > RECHECK_NS ? RECHECK_NS : left;
		}
		int r = kwait(epfd, ev, max, left, mask), err = errno;
		if (w.efd >= 0) {
			wait_off(e, &w);
			if (w.kicked)
				drain(w.efd);
		}
		if (r < 0)
			return errno = err, -1;
		if ((r = drop_magic(e, ev, r)) > 0)
			return r;
		if (deadline >= 0 && now_ns() >= deadline)
			return 0;
	}
}

static int do_epoll_wait(int epfd, struct epoll_event *ev, int max, int64_t timeout_ns, const sigset_t *mask)
{
	if (max <= 0)
		return real_epoll_pwait(epfd, ev, max, 0, mask); /* the kernel's EINVAL */
	struct ep *e = ep_get(epfd, 0);
	int64_t start = now_ns(), deadline = timeout_ns < 0 ? -1 : start + timeout_ns;
	if (!e || !__atomic_load_n(&e->n, __ATOMIC_RELAXED)) {
		int r = plain_wait(e, epfd, ev, max, deadline, mask);
		if (r != FULL)
			return r;
	}
	for (unsigned turn = 0;; turn++) {
		if (__atomic_load_n(&e->pend, __ATOMIC_RELAXED))
			settle_set(e);
		int k = scan(e, ev, max, REPORT, NULL);
		/* Non-blocking progress loops (MPI) call epoll_wait(0) back to
		 * back: ask the kernel at most every KERNEL_POLL_NS then. */
		int64_t t = now_ns();
		int ask = timeout_ns == 0 ? t - e->kernel_at >= KERNEL_POLL_NS : turn % KERNEL_EVERY == 0;
		if (k < max && (k || ask)) {
			e->kernel_at = t;
			int r = real_epoll_wait(epfd, ev + k, max - k, 0);
			if (r < 0 && !k)
				return r;
			if (r > 0)
				k += drop_magic(e, ev + k, r);
		}
		if (k)
			return k;
		int64_t now = now_ns();
		if (deadline >= 0 && now >= deadline)
			return 0;
		if (now - start < spin_ns) {
			shunt_spin_yield(now - start);
			continue;
		}
		/* Block: list this thread as the set's waiter (an interest
		 * added from now on kicks it), arm every ring of interest,
		 * re-check, sleep. */
		struct helper *h = helper();
		if (h && efd_in(e, helper_efd(h), helper_id(h)))
			h = NULL; /* then the wait is sliced */
		struct waiter w = {.efd = h ? helper_efd(h) : -1};
		if (h) {
			pthread_mutex_lock(&e->mu);
			wait_on(e, &w);
			pthread_mutex_unlock(&e->mu);
		}
		struct arm a;
		arm_init(&a);
		scan(e, NULL, INT_MAX, ARM, &a);
		arm_set(&a, 1);
		if (scan(e, NULL, 1, PEEK, NULL)) {
			arm_set(&a, 0);
			arm_free(&a);
			if (h) {
				wait_off(e, &w);
				if (w.kicked)
					drain(w.efd);
			}
			continue;
		}
		int64_t left = block_start(h, &a, deadline < 0 ? -1 : deadline - now_ns());
		/* A connect under way wakes nothing in a set that waits for
		 * input: re-check it every millisecond until it is settled. */
		if (__atomic_load_n(&e->pend, __ATOMIC_RELAXED) && (left < 0 || left > 1000000))
			left = 1000000;
		int r = kwait(epfd, ev, max, left, mask);
		int err = errno;
		if (h)
			wait_off(e, &w);
		block_stop(h); /* it drains the eventfd (kicks too): errno is EAGAIN after */
		arm_set(&a, 0);
		arm_free(&a);
		errno = err;
		if (r < 0)
			return r;
		if ((r = drop_magic(e, ev, r)))
			return r;
	}
}

INTERPOSE int epoll_wait(int epfd, struct epoll_event *ev, int max, int timeout)
{
	REAL_READY();
	return do_epoll_wait(epfd, ev, max, timeout < 0 ? -1 : (int64_t)timeout * 1000000, NULL);
}

INTERPOSE int epoll_pwait(int epfd, struct epoll_event *ev, int max, int timeout, const sigset_t *mask)
{
	REAL_READY();
	return do_epoll_wait(epfd, ev, max, timeout < 0 ? -1 : (int64_t)timeout * 1000000, mask);
}

/* epoll_pwait2 (glibc 2.35, Linux 5.11): the same wait with a timespec;
 * the library's kernel waits round it up to whole milliseconds. */
INTERPOSE int epoll_pwait2(int epfd, struct epoll_event *ev, int max, const struct timespec *t, const sigset_t *mask)
{
	REAL_READY();
	if (t && (t->tv_sec < 0 || t->tv_nsec < 0 || t->tv_nsec >= 1000000000))
		return errno = EINVAL, -1;
	int64_t ns = !t ? -1 : t->tv_sec >= INT64_MAX / 1000000000 - 1 ? -1 : (int64_t)t->tv_sec * 1000000000 + t->tv_nsec;
	return do_epoll_wait(epfd, ev, max, ns, mask);
}

/* Every epoll set is known here from its creation, so that one nested in
 * another is recognized even before it holds fast-path fds. */
INTERPOSE int epoll_create1(int flags)
{
	REAL_READY();
	int fd = real_epoll_create1(flags);
	if (fd >= 0 && !ep_get(fd, 1))
		plog("shunt: out of memory: epoll set %d cannot hold fast-path fds", fd);
	return fd;
}

INTERPOSE int epoll_create(int size)
{
	REAL_READY();
	int fd = real_epoll_create(size);
	if (fd >= 0 && !ep_get(fd, 1))
		plog("shunt: out of memory: epoll set %d cannot hold fast-path fds", fd);
	return fd;
}
