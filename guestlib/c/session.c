/* The session with hostd (shunt.h): state, the reader thread, requests,
 * keepalive, and the flows the session's region holds; opening the
 * channel is opening.c's. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#define LOG_MAX 512 /* a log line; longer ones are cut */

void shunt_logf(struct shunt_session *s, const char *fmt, ...)
{
	if (!s->c.log)
		return;
	char buf[LOG_MAX];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof buf, fmt, ap);
	va_end(ap);
	s->c.log(s->c.arg, buf);
}

/* ---- fork ----
 *
 * A fork child has only the forking thread: a session lock that another
 * thread held at that moment would stay held in the child for good. So
 * every session's lock is taken before fork and let go after it
 * (pthread_atfork). In the child the locks are made new and each session
 * stays the parent's (s->pid): the child's own first ensure opens its own
 * channel, and the parent's reader thread, requests and verdicts stay with
 * the parent. The child closes its copy of the parent's channel, so hostd
 * sees the parent's session end when the parent's does. A caller that
 * sends under locks of its own (the preload library's fd table) registers
 * its atfork handlers after making its session: its prepare handler then
 * runs first and takes its locks before these. */
static pthread_mutex_t all_mu = PTHREAD_MUTEX_INITIALIZER;
/* This process's pid, for the checks above (each connection's connect or
 * accept asks whether the session is this process's: getpid is a system
 * call): made new in the fork child (once any session exists, the
 * handlers run). */
static pid_t self;

pid_t session_self(void)
{
	pid_t p = __atomic_load_n(&self, __ATOMIC_RELAXED);
	if (!p) {
		p = getpid();
		__atomic_store_n(&self, p, __ATOMIC_RELAXED);
	}
	return p;
}
static struct shunt_session **all; /* every session made; under all_mu */
static size_t nall, call;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static int fork_ok; /* the handlers are registered */

static void fork_prepare(void)
{
	pthread_mutex_lock(&all_mu);
	for (size_t i = 0; i < nall; i++) {
		struct shunt_session *s = all[i];
		pthread_mutex_lock(&s->mu);
		/* An open under way (without mu, opening.c): its descriptor must
		 * not reach the child. It ends within its own bounds. */
		if (s->opening && s->pid == session_self())
			shunt_logf(s, "shunt: fork waits for the control channel's open under way");
		while (s->opening && s->pid == session_self())
			pthread_cond_wait(&s->cv, &s->mu);
	}
	regions_fork_prepare();
}

static void fork_parent(void)
{
	regions_fork_parent();
	for (size_t i = 0; i < nall; i++)
		pthread_mutex_unlock(&all[i]->mu);
	pthread_mutex_unlock(&all_mu);
}

static void fork_child(void)
{
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	for (size_t i = 0; i < nall; i++) {
		struct shunt_session *s = all[i];
		pthread_mutex_init(&s->mu, NULL);
		pthread_cond_init(&s->cv, &ca);
		if (s->fd >= 0)
			sys_close(s->fd);
		__atomic_store_n(&s->fd, -1, __ATOMIC_SEQ_CST);
		s->pend = NULL; /* on the stacks of threads the child does not have */
		s->tried = 0;
		s->opening = 0; /* fork_prepare waited for the parent's; kept for clarity */
		s->opens = 0;   /* the child's first open is its own */
		s->outlen = 0; /* the parent's; its writer thread did not come along */
		s->writer = 0;
	}
	pthread_condattr_destroy(&ca);
	__atomic_store_n(&self, getpid(), __ATOMIC_RELAXED);
	regions_fork_child();
	pthread_mutex_init(&all_mu, NULL);
}

static void fork_register(void) { fork_ok = pthread_atfork(fork_prepare, fork_parent, fork_child) == 0; }

/* remember adds s to the sessions the fork handlers keep: 0, or -1
 * without memory (then there is no session: one that a fork could leave
 * locked in the child is worse). */
static int remember(struct shunt_session *s)
{
	pthread_once(&fork_once, fork_register);
	if (!fork_ok)
		return -1;
	pthread_mutex_lock(&all_mu);
	if (nall == call) {
		size_t c = call ? 2 * call : 4;
		struct shunt_session **more = realloc(all, c * sizeof *more);
		if (!more) {
			pthread_mutex_unlock(&all_mu);
			return -1;
		}
		all = more;
		call = c;
	}
	all[nall++] = s;
	pthread_mutex_unlock(&all_mu);
	return 0;
}

struct shunt_session *shunt_session_new(const struct shunt_session_config *c)
{
	struct shunt_session *s = calloc(1, sizeof *s);
	if (!s)
		return NULL;
	s->c = *c;
	s->c.control = c->control ? strdup(c->control) : NULL;
	s->c.region = c->region ? strdup(c->region) : NULL;
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	if (!s->c.control || (c->region && !s->c.region) || pthread_cond_init(&s->cv, &ca)) {
		free((char *)s->c.control);
		free((char *)s->c.region);
		free(s);
		return NULL;
	}
	pthread_condattr_destroy(&ca);
	pthread_mutex_init(&s->mu, NULL);
	s->region_path = s->c.region;
	s->fd = -1;
	if (remember(s)) {
		free((char *)s->c.control);
		free((char *)s->c.region);
		free(s);
		return NULL;
	}
	s->pid = session_self(); /* after remember registered the fork handlers, which keep session_self()'s pid current */
	return s;
}

int shunt_session_vm(struct shunt_session *s) { return __atomic_load_n(&s->vm, __ATOMIC_SEQ_CST); }
int shunt_session_vsock(struct shunt_session *s) { return __atomic_load_n(&s->vsock, __ATOMIC_SEQ_CST); }
int shunt_session_stretches(struct shunt_session *s) { return shunt_stretch_enabled() || shunt_session_vsock(s); }

/* keepalive_on: a port or vsock channel gets keepalives (keepalive). */
static int keepalive_on(struct shunt_session *s) { return shunt_session_vm(s) || shunt_session_vsock(s); }

/* ---- writing: nothing waits for hostd ----
 *
 * The callers are a program's connect(), accept() and close() (OPEN,
 * CLOSE, LEFT) and the reader thread (PONG, LEFT): none may wait for
 * hostd. A hostd that reads slowly (each OPEN of a connection that is
 * already gone costs it a conntrack lookup's retries) filled the socket,
 * and a blocking write then held the program, and the session's lock (so
 * the reader too), until hostd had read three quarters of it: seconds.
 * So a frame is written without blocking, and what the channel does not
 * take waits in s->outq, in order, for a writer thread that drains it as
 * hostd reads. Past OUTQ_MAX queued bytes only CLOSE and LEFT are queued
 * (what hostd must hear to free slots); anything else fails, as with no
 * hostd (an OPEN's connection stays on TCP, and is owed no CLOSE: so the
 * queue stays bounded even while hostd reads nothing). A port that takes
 * nothing for SHUNT_PORT_WRITE_NS drops its queue, as a port whose host
 * end is gone takes no data (a socket's end shows as EOF to the reader). */
#define OUTQ_MAX (64 << 10)

/* nb_write writes what the channel takes now: bytes, or -1 with errno. */
static ssize_t nb_write(int fd, int port, const uint8_t *buf, size_t n)
{
	return port ? sys_write(fd, buf, n) : sys_send(fd, buf, n, MSG_DONTWAIT | MSG_NOSIGNAL);
}

static int again(void) { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

/* drain is the writer thread: it writes s->outq until it is empty or the
 * channel is gone, waiting for room without the lock. */
static void *drain(void *arg)
{
	struct shunt_session *s = arg;
	pid_t pid = session_self();
	int fd = -1;
	int64_t progress = 0;
	pthread_mutex_lock(&s->mu);
	while (s->outlen && s->fd >= 0 && s->pid == pid) {
		int port = shunt_session_vm(s);
		if (s->fd != fd) { /* a new channel (its queue is its own: session_set_fd) */
			fd = s->fd;
			progress = shunt_now_ns();
		}
		ssize_t k = nb_write(fd, port, s->outq, s->outlen);
		if (k > 0) {
			memmove(s->outq, s->outq + k, s->outlen - k);
			s->outlen -= k;
			progress = shunt_now_ns();
			continue;
		}
		if (k < 0 && !again()) { /* broken: the reader sees the end */
			s->outlen = 0;
			break;
		}
		if (port && shunt_now_ns() - progress > SHUNT_PORT_WRITE_NS) {
			shunt_logf(s, "shunt: the control port took none of %zu queued bytes in %lld ms: dropped", s->outlen,
				   SHUNT_PORT_WRITE_NS / 1000000);
			s->outlen = 0;
			break;
		}
		pthread_mutex_unlock(&s->mu);
		sys_poll1(fd, POLLOUT, 100); /* bounded: fd may be closed (and its number reused) meanwhile */
		pthread_mutex_lock(&s->mu);
	}
	s->writer = 0;
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

/* write_locked sends m on the channel, or queues what the channel does
 * not take now (see above): 0, or -1 (no channel, or the queue is full).
 * A fork child never writes to its parent's channel: the child has its
 * own once it calls ensure. */
static int write_locked(struct shunt_session *s, const struct shunt_msg *m)
{
	/* getpid, not session_self(): a child that skipped the fork handlers (vfork)
	 * never writes its parent's channel. */
	if (s->fd < 0 || s->pid != getpid())
		return -1;
	uint8_t buf[SHUNT_PROTO_HEADER + SHUNT_PROTO_MAX];
	ssize_t n = shunt_msg_encode(m, buf, sizeof buf), off = 0;
	if (n < 0) {
		errno = EINVAL;
		return -1;
	}
	if (!s->outlen) {
		off = nb_write(s->fd, shunt_session_vm(s), buf, n);
		if (off == n)
			return 0;
		if (off < 0 && !again())
			return -1;
		if (off < 0)
			off = 0;
	} else if (s->outlen + n > OUTQ_MAX && m->type != SHUNT_CLOSE && m->type != SHUNT_LEFT) {
		errno = EAGAIN;
		return -1;
	}
	if (s->outlen + (n - off) > s->outcap) {
		size_t cap = s->outcap ? 2 * s->outcap : 4096;
		while (cap < s->outlen + (n - off))
			cap *= 2;
		uint8_t *q = realloc(s->outq, cap);
		if (!q) {
			if (off) /* half a frame is out: the stream is broken */
				sys_shutdown(s->fd, SHUT_RDWR);
			errno = ENOMEM;
			return -1;
		}
		s->outq = q;
		s->outcap = cap;
	}
	memcpy(s->outq + s->outlen, buf + off, n - off);
	s->outlen += n - off;
	if (!s->writer && shunt_thread_start(NULL, 0, drain, s) == 0)
		s->writer = 1; /* else the next write tries again */
	return 0;
}

int shunt_session_send(struct shunt_session *s, const struct shunt_msg *m)
{
	pthread_mutex_lock(&s->mu);
	int r = write_locked(s, m);
	pthread_mutex_unlock(&s->mu);
	return r;
}

/* Without the lock: exit handlers ask this (lifetime.c in the preload
 * library), and must not wait behind a slow channel open. */
int shunt_session_connected(struct shunt_session *s)
{
	return __atomic_load_n(&s->fd, __ATOMIC_SEQ_CST) >= 0 && __atomic_load_n(&s->pid, __ATOMIC_SEQ_CST) == session_self();
}

/* session_set_fd changes the channel (mu held); readers without mu load it
 * atomically (shunt_session_connected). */
void session_set_fd(struct shunt_session *s, int fd)
{
	s->outlen = 0; /* what the old channel did not take is not the new one's */
	s->chan++;
	__atomic_store_n(&s->fd, fd, __ATOMIC_SEQ_CST);
}

/* deadline is now + ms on the cond var's clock. */
static struct timespec deadline(int ms)
{
	struct timespec dl;
	clock_gettime(CLOCK_MONOTONIC, &dl);
	dl.tv_sec += ms / 1000;
	dl.tv_nsec += (ms % 1000) * 1000000L;
	if (dl.tv_nsec >= 1000000000) {
		dl.tv_sec++;
		dl.tv_nsec -= 1000000000;
	}
	return dl;
}

struct thread_arg { struct shunt_session *s; int fd; unsigned chan; };

int shunt_thread_start(pthread_t *th, size_t stack, void *(*fn)(void *), void *arg)
{
	pthread_t own;
	pthread_attr_t at;
	pthread_attr_init(&at);
	if (!th)
		pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	if (stack)
		pthread_attr_setstacksize(&at, stack);
	sigset_t all, old;
	sigfillset(&all);
	/* Not SIGBUS: a fault on a truncated region must reach fault.c's
	 * handler; blocked, it kills the process. */
	sigdelset(&all, SIGBUS);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	int err = pthread_create(th ? th : &own, &at, fn, arg);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&at);
	return err;
}

/* spawn starts a detached thread for the channel fd, with all signals
 * blocked (the program's handlers never run on it). */
static int spawn(void *(*fn)(void *), struct shunt_session *s, int fd)
{
	struct thread_arg *a = malloc(sizeof *a);
	if (!a)
		return -1;
	*a = (struct thread_arg){s, fd, s->chan};
	if (shunt_thread_start(NULL, 0, fn, a)) {
		free(a);
		return -1;
	}
	return 0;
}

/* keepalive PINGs hostd every SHUNT_KEEPALIVE_NS on a port, as the Go
 * library does: a restarted hostd gets no EOF through QEMU, and answers the
 * first PING before HELLO with ERROR(no-hostd), which makes the reader say
 * HELLO and announce again. On vsock too, as Go's: a hostd whose
 * vhost-user device died with it sends no reset. It ends with the channel
 * (or a fork). */
static void *keepalive(void *arg)
{
	struct thread_arg a = *(struct thread_arg *)arg;
	free(arg);
	struct shunt_session *s = a.s;
	pid_t pid = session_self();
	for (;;) {
		struct timespec ts = {SHUNT_KEEPALIVE_NS / 1000000000, SHUNT_KEEPALIVE_NS % 1000000000};
		nanosleep(&ts, NULL);
		pthread_mutex_lock(&s->mu);
		if (s->fd != a.fd || s->chan != a.chan || s->pid != pid) { /* by generation: a new channel may reuse the number */
			pthread_mutex_unlock(&s->mu);
			return NULL;
		}
		struct shunt_msg p = {.type = SHUNT_PING, .nonce = ++s->nonce};
		write_locked(s, &p);
		pthread_mutex_unlock(&s->mu);
	}
}

void session_announce(struct shunt_session *s)
{
	if (s->c.announce)
		s->c.announce(s->c.arg, s);
}

/* reader reads the channel: verdicts to their requests, PONG, KICK,
 * REVOKE, and answers hostd's keepalive PING with PONG. The channel ends at EOF, or at ERROR(no-hostd): a new hostd
 * behind a port that QEMU reconnected before we read EOF, which knows
 * nothing of this session. Either way it reconnects (session_reconnect,
 * opening.c). */
static void *reader(void *arg)
{
	struct thread_arg a = *(struct thread_arg *)arg;
	free(arg);
	struct shunt_session *s = a.s;
	int fd = a.fd, port = shunt_session_vm(s);
	struct shunt_msg m;
	struct shunt_fdq q = {.n = 0}; /* descriptors for REGIONs (regions.c) */
	for (;;) {
		while (channel_recv(fd, port, &m, &q) == 0 && !(m.type == SHUNT_ERROR && m.reason == SHUNT_REASON_NO_HOSTD)) {
			if (m.type == SHUNT_REGION || m.type == SHUNT_UNREGION) {
				/* Mapped before the next message (the READY that
				 * needs it) is read. */
				shunt_region_msg(s, &m, &q);
				continue;
			}
			int waited = 0;
			pthread_mutex_lock(&s->mu);
			if (m.type == SHUNT_READY || m.type == SHUNT_TCP) {
				for (struct pending *p = s->pend; p; p = p->next)
					if (p->id == m.req_id && !p->done) {
						*p->reply = m;
						p->done = waited = 1;
					}
			} else if (m.type == SHUNT_PONG) {
				s->pong = m.nonce;
			} else if (m.type == SHUNT_PING) {
				/* hostd's keepalive: a session that does not answer
				 * within its silence bound is closed (docs/protocol.md). */
				struct shunt_msg p = {.type = SHUNT_PONG, .nonce = m.nonce};
				if (s->fd == fd)
					write_locked(s, &p);
			} else if (m.type == SHUNT_KICK) {
				shunt_kicked();
			} else if (m.type == SHUNT_ERROR) {
				shunt_logf(s, "shunt: hostd closed the control channel: %s", m.text);
			}
			pthread_cond_broadcast(&s->cv);
			pthread_mutex_unlock(&s->mu);
			if (m.type == SHUNT_REVOKE && s->c.revoked)
				s->c.revoked(s->c.arg, &m);
			if ((m.type == SHUNT_READY || m.type == SHUNT_TCP || m.type == SHUNT_DOWN || m.type == SHUNT_RESUME) &&
			    !waited && s->c.conn)
				s->c.conn(s->c.arg, &m);
		}
		shunt_fdq_close(&q);
		/* Requests in flight go to TCP now rather than at their timeout. */
		pthread_mutex_lock(&s->mu);
		sys_close(fd);
		if (s->fd == fd)
			session_set_fd(s, -1);
		for (struct pending *p = s->pend; p; p = p->next)
			if (!p->done) {
				memset(p->reply, 0, sizeof *p->reply);
				p->reply->type = SHUNT_TCP;
				p->reply->reason = SHUNT_REASON_NO_HOSTD;
				p->done = 1;
			}
		pthread_cond_broadcast(&s->cv);
		pthread_mutex_unlock(&s->mu);
		shunt_logf(s, "shunt: lost hostd");
		if ((fd = session_reconnect(s)) < 0)
			return NULL;
		port = shunt_session_vm(s);
	}
}

int session_start_reader(struct shunt_session *s, int fd) { return spawn(reader, s, fd); }

void session_start_keepalive(struct shunt_session *s, int fd)
{
	if (keepalive_on(s) && spawn(keepalive, s, fd))
		shunt_logf(s, "shunt: no keepalive thread: a hostd restart is noticed at the next EOF only");
}

/* next_id gives a fresh request id (mu held): never 0. */
static uint32_t next_id(struct shunt_session *s) { return ++s->next_req ? s->next_req : ++s->next_req; }

/* request and sync wait on cv with mu held, so they are no cancellation
 * points: a thread cancelled there would leave mu held for good (as
 * shunt_session_ensure, opening.c). */
void shunt_session_request(struct shunt_session *s, struct shunt_msg *m, struct shunt_msg *reply, int timeout_ms)
{
	int cs;
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cs);
	struct timespec dl = deadline(timeout_ms);
	struct pending p = {.reply = reply};
	memset(reply, 0, sizeof *reply);
	reply->type = SHUNT_TCP;
	pthread_mutex_lock(&s->mu);
	m->req_id = next_id(s);
	p.id = m->req_id;
	p.next = s->pend;
	s->pend = &p;
	if (write_locked(s, m) == 0) {
		while (!p.done)
			if (pthread_cond_timedwait(&s->cv, &s->mu, &dl) == ETIMEDOUT)
				break;
		if (!p.done)
			reply->reason = SHUNT_REASON_TIMEOUT;
	} else {
		reply->reason = SHUNT_REASON_NO_HOSTD;
	}
	for (struct pending **pp = &s->pend; *pp; pp = &(*pp)->next)
		if (*pp == &p) {
			*pp = p.next;
			break;
		}
	pthread_mutex_unlock(&s->mu);
	pthread_setcancelstate(cs, NULL);
}

int shunt_session_open(struct shunt_session *s, struct shunt_msg *m)
{
	pthread_mutex_lock(&s->mu);
	if (!m->req_id)
		m->req_id = next_id(s);
	int r = write_locked(s, m);
	pthread_mutex_unlock(&s->mu);
	return r;
}

uint32_t shunt_session_new_req(struct shunt_session *s)
{
	pthread_mutex_lock(&s->mu);
	uint32_t id = next_id(s);
	pthread_mutex_unlock(&s->mu);
	return id;
}

unsigned shunt_session_reason(struct shunt_session *s)
{
	pthread_mutex_lock(&s->mu);
	unsigned r = s->why ? s->why : SHUNT_REASON_NO_HOSTD;
	pthread_mutex_unlock(&s->mu);
	return r;
}

void shunt_session_sync(struct shunt_session *s)
{
	int cs;
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cs);
	struct timespec dl = deadline(SHUNT_SYNC_TIMEOUT_MS);
	pthread_mutex_lock(&s->mu);
	struct shunt_msg m = {.type = SHUNT_PING, .nonce = ++s->nonce};
	if (write_locked(s, &m) == 0)
		while (s->pong < m.nonce && s->fd >= 0)
			if (pthread_cond_timedwait(&s->cv, &s->mu, &dl) == ETIMEDOUT)
				break;
	pthread_mutex_unlock(&s->mu);
	pthread_setcancelstate(cs, NULL);
}

/* ---- flows ---- */

int shunt_flow_attach(struct shunt_session *s, const struct shunt_msg *v, struct shunt_flow *f)
{
	struct shunt_slot sl;
	struct shunt_region g;
	void *hold;
	memset(f, 0, sizeof *f);
	if (v->side != 1 && v->side != 2)
		return SHUNT_ECORRUPT;
	if (shunt_region_hold(s, v->region_id, &g, &hold))
		return v->region_id != 0 && shunt_session_stretches(s) ? shunt_stretch_attach(s, v, f) : SHUNT_ECORRUPT;
	if (shunt_region_slot(&g, v->slot, &sl) || sl.gen != v->gen || sl.capacity != v->capacity) {
		shunt_region_release(s, hold);
		return SHUNT_ECORRUPT;
	}
	size_t len = SHUNT_RING_HEADER + sl.capacity;
	uint8_t *out = g.mem + (v->side == 1 ? sl.ring_ab : sl.ring_ba);
	uint8_t *in = g.mem + (v->side == 1 ? sl.ring_ba : sl.ring_ab);
	if (shunt_ring_writer(&f->w, out, len, sl.capacity) || shunt_ring_reader(&f->r, in, len, sl.capacity)) {
		shunt_region_release(s, hold);
		memset(f, 0, sizeof *f);
		return SHUNT_ECORRUPT;
	}
	f->region_id = v->region_id;
	f->hold = hold;
	f->slot = v->slot;
	f->gen = v->gen;
	f->side = v->side;
	f->req = v->req_id;
	f->session = s;
	f->w.owner = f->r.owner = f;
	return 0;
}

int shunt_flow_reset(const struct shunt_flow *f)
{
	return __atomic_load_n((uint32_t *)(f->r.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST) ||
	       __atomic_load_n((uint32_t *)(f->w.hdr + SHUNT_OFF_RESET), __ATOMIC_SEQ_CST);
}

int shunt_flow_close(const struct shunt_flow *f)
{
	struct shunt_msg m = {.type = SHUNT_CLOSE, .req_id = f->req, .region_id = f->region_id, .slot = f->slot, .gen = f->gen,
			      .side = f->side ? f->side : 1};
	return shunt_session_send(f->session, &m);
}

int shunt_flow_left(const struct shunt_flow *f)
{
	struct shunt_msg m = {.type = SHUNT_LEFT, .req_id = f->req, .region_id = f->region_id, .slot = f->slot, .gen = f->gen,
			      .side = f->side};
	return shunt_session_send(f->session, &m);
}

void shunt_flow_detach(struct shunt_flow *f)
{
	shunt_stretch_detach(f);
	if (f->session && f->hold)
		shunt_region_release(f->session, f->hold);
	f->hold = NULL;
}
