/* Lifetime of fds and flows: close, dup, fcntl, ioctl, exec, exit (the
 * rules in docs/preload.md; fork is fork.c's).
 *
 * exec: the library's state goes with the old image, so a flow on the
 * rings whose fd stays open is reset first, and a fork child's copy of
 * its parent's flow is replaced by an unconnected socket (before_exec).
 * exit: FIN and CLOSE for the flows still open, as the kernel sends FIN
 * (fini).
 * Flows themselves: references, release and reuse (preload.h, struct
 * flow). */
#include "preload.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <limits.h>
#include <sys/ioctl.h>

/* ---- flows: references, release, reuse ---- */

static pthread_mutex_t free_mu = PTHREAD_MUTEX_INITIALIZER;
static struct flow *free_flows; /* under free_mu */

struct flow *flow_new(void)
{
	pthread_mutex_lock(&free_mu);
	struct flow *f = free_flows;
	if (f)
		free_flows = f->next_free;
	pthread_mutex_unlock(&free_mu);
	if (!f)
		return calloc(1, sizeof *f);
	/* A freed flow is out of the open queue and the index (release, and
	 * conn_open queues only what it published under tab_mu); unlinking
	 * again costs a lock and makes sure a flow is never reset while the
	 * queue or a chain still points through it. */
	open_forget(f);
	/* Reused: everything but users (0) and the stash's buffer. */
	f->refs = f->nonblock = f->finished = 0;
	f->owner = 0;
	f->next_free = NULL;
	f->req = 0;
	f->told = 0;
	f->told_at = 0;
	f->open_at = 0;
	f->onext = f->oprev = f->inext = NULL;
	f->dropped = f->fork_drop = f->fork_held = 0;
	f->share = NULL; /* left at its release (conn_end) */
	f->share_io = f->share_tries = f->fork_share = 0;
	f->exec_leave = 0;
	f->exec_share = NULL;
	f->have_remote = f->have_tuple = 0;
	__atomic_store_n(&f->ev_armed, 0, __ATOMIC_RELAXED);
	f->roff = f->sent = 0;
	f->rring = f->wring = f->winflight = f->rblocked = f->attach_due = 0;
	f->rs_head = f->rs_len = 0; /* the resend's buffer is kept, as the stash's */
	f->rhold = 0;
	f->resent = 0;
	__atomic_store_n(&f->resending, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&f->rst, 0, __ATOMIC_RELAXED);
	f->shead = f->slen = f->sring = 0;
	f->seof = 0;
	f->ahead = NULL; /* freed with the flow (flow_discard) */
	f->alen = 0;
	f->ahead_at = 0;
	f->aheads = 0;
	f->rbytes[0] = f->rbytes[1] = f->wbytes[0] = f->wbytes[1] = 0;
	f->rswitch = f->wswitch = f->stashed = 0;
	f->stats_said = 0;
	__atomic_store_n(&f->rg, NULL, __ATOMIC_RELAXED);
	__atomic_store_n(&f->closed, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&f->rd_shut, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&f->wr_shut, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&f->rcvtimeo, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&f->sndtimeo, 0, __ATOMIC_RELAXED);
	return f;
}

/* flows_fork: free_mu across fork (fork.c). */
void flows_fork(int phase)
{
	if (phase == FORK_PREPARE)
		pthread_mutex_lock(&free_mu);
	else if (phase == FORK_PARENT)
		pthread_mutex_unlock(&free_mu);
	else
		pthread_mutex_init(&free_mu, NULL);
}

void flow_discard(struct flow *f)
{
	if (!f)
		return;
	/* A stretch held ahead is the flow's own memory (a fork child's copy
	 * too): nobody reads it any more. poll and epoll read only alen. */
	free(f->ahead);
	f->ahead = NULL;
	__atomic_store_n(&f->alen, 0, __ATOMIC_RELEASE);
	pthread_mutex_lock(&free_mu);
	f->next_free = free_flows;
	free_flows = f;
	pthread_mutex_unlock(&free_mu);
}

void flow_publish(int fd, struct flow *f)
{
	pthread_mutex_init(&f->rmu, NULL);
	pthread_mutex_init(&f->wmu, NULL);
	f->refs = 1;
	__atomic_store_n(&f->users, 1, __ATOMIC_RELEASE);
	__atomic_store_n(&fds[fd], f, __ATOMIC_RELEASE);
}

/* flow_get: a flow's users only grow from above zero, so a reference is
 * never taken on a flow being released; a flow that left fd (closed, or
 * reused for another fd) between the two loads is let go again. Freed
 * flows are never unmapped, so a stale pointer is safe to look at. */
int flow_hold(struct flow *f)
{
	int u = __atomic_load_n(&f->users, __ATOMIC_ACQUIRE);
	while (u > 0 && !__atomic_compare_exchange_n(&f->users, &u, u + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
		;
	return u > 0;
}

struct flow *flow_get(int fd)
{
	settle(fd);
	for (;;) {
		struct flow *f = flow_of(fd);
		if (!f)
			return NULL;
		int u = flow_hold(f);
		if (u && flow_of(fd) == f)
			return f;
		if (u)
			flow_put(f);
	}
}

/* say_stats prints f's counters (SHUNT_STATS), once: at the program's
 * last close of it, so that the line is out before the program can exit
 * (the last reference may be the leaver thread's), or at its release. */
static void say_stats(struct flow *f)
{
	if (!stats || f->owner != my_pid || __atomic_exchange_n(&f->stats_said, 1, __ATOMIC_ACQ_REL))
		return;
	pstat("shunt: fd %d stats: read %llu tcp + %llu ring = %llu, wrote %llu tcp + %llu ring = %llu; "
	      "to the rings: %u reading, %u writing; stashed %u; resent %llu; held ahead %u",
	      f->fd, (unsigned long long)f->rbytes[0], (unsigned long long)f->rbytes[1], (unsigned long long)f->roff,
	      (unsigned long long)f->wbytes[0], (unsigned long long)f->wbytes[1], (unsigned long long)f->sent, f->rswitch,
	      f->wswitch, f->stashed, (unsigned long long)f->resent, f->aheads);
}

/* release ends a connection nobody uses any more: both directions leave
 * their rings and hostd hears CLOSE (conn.c); a fork child's copy is only
 * forgotten. */
static void release(struct flow *f)
{
	open_forget(f); /* out of the open queue and the index before it can be reused */
	say_stats(f);
	conn_end(f);
	flow_discard(f);
}

void flow_put(struct flow *f)
{
	if (__atomic_sub_fetch(&f->users, 1, __ATOMIC_ACQ_REL))
		return;
	int e = errno;
	release(f);
	errno = e;
}

/* ---- close and dup ---- */

/* reset_if_unread makes the kernel close of a connection with bytes
 * nobody read (in its read ring, the stash, or a stretch held aside) a
 * reset (SO_LINGER 0: RST), as the kernel does for its own unread data,
 * so that the peer does not take a stream this end dropped for a clean
 * end. Without rmu: a reader may be blocked in the kernel holding it, and
 * a count that races a read is what the kernel's close sees too. */
static void reset_if_unread(struct flow *f, struct rings *rg, int fd)
{
	if (f->share)
		return; /* another process may hold the socket and read it (share.c) */
	ssize_t ring = rg ? shunt_ring_buffered(&rg->sf.r) : 0;
	if (ring == 0 && !__atomic_load_n(&f->slen, __ATOMIC_RELAXED) && !__atomic_load_n(&f->alen, __ATOMIC_RELAXED))
		return;
	struct linger l = {.l_onoff = 1, .l_linger = 0};
	real_setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
	if (verbose)
		plog("shunt: fd %d: closed with unread bytes (ring %zd, stash %zu, held %zu): reset", fd, ring, f->slen, f->alen);
}

/* forget drops fd's reference to its flow (the last one releases it), its
 * listener registration and its epoll interests, before the kernel close. */
void forget(int fd)
{
	if (fd < 0)
		return;
	struct flow *f = NULL;
	int last = 0, listener = 0, was_pending = 0, shared = 0;
	if (fd < FD_MAX) {
		pthread_mutex_lock(&tab_mu);
		f = fds[fd];
		__atomic_store_n(&fds[fd], NULL, __ATOMIC_RELEASE);
		__atomic_store_n(&fd_gen[fd], fd_gen[fd] + 1, __ATOMIC_RELEASE); /* settle: conn_open */
		last = f && --f->refs == 0;
		shared = f && f->share; /* its socket may be another process's too (share.c): epoll.c */
		listener = kind[fd] == FD_LISTENER && !linherited[fd]; /* a fork child's copy was never its session's */
		was_pending = kind[fd] == FD_PENDING;
		kind[fd] = FD_NONE;
		linherited[fd] = 0;
		pthread_mutex_unlock(&tab_mu);
	}
	if (listener)
		unlisten(fd);
	ep_forget(fd, shared ? 2 : f != NULL || was_pending);
	guard_forget(fd); /* before the kernel close: the watcher's epoll must not hold the last reference (guard.c) */
	if (!last)
		return;
	/* Calls still inside (other threads) end with EBADF; the last one
	 * out releases the flow. The writer leaves its ring now, before the
	 * kernel's close: the peer reads the ring's bytes, then FIN or RST. */
	if (f->owner == my_pid) {
		__atomic_store_n(&f->closed, 1, __ATOMIC_SEQ_CST);
		struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE), *done = NULL;
		reset_if_unread(f, rg, fd);
		if (rg) {
			shunt_ring_stop(&rg->sf.r, 1);
			shunt_ring_stop(&rg->sf.w, 0);
			pthread_mutex_lock(&f->wmu);
			if (__atomic_load_n(&f->rg, __ATOMIC_ACQUIRE) == rg)
				done = writer_leave(f, rg);
			pthread_mutex_unlock(&f->wmu);
		}
		rings_done(f, done);
		if (__atomic_load_n(&f->resending, __ATOMIC_SEQ_CST))
			resend_close(f, fd); /* a RESUME's resend before the FIN (resume.c) */
		flow_wake(f);
		say_stats(f);
	}
	flow_put(f);
}

INTERPOSE int close(int fd)
{
	REAL_READY();
	if (!vm_child())
		forget(fd);
	return real_close(fd);
}

/* share makes fd, a new duplicate of old, share old's flow. */
static void share(int old, int fd)
{
	if (fd < 0 || fd >= FD_MAX || old < 0 || old >= FD_MAX || fd == old)
		return;
	forget(fd);
	pthread_mutex_lock(&tab_mu);
	struct flow *f = fds[old];
	if (f)
		f->refs++;
	__atomic_store_n(&fds[fd], f, __ATOMIC_RELEASE);
	kind[fd] = kind[old] == FD_LISTENER || kind[old] == FD_CONNECTING ? FD_TCP : kind[old]; /* the listener registration stays with old; connect()'s kind is its fd's */
	nonblk[fd] = nonblk[old];
	pthread_mutex_unlock(&tab_mu);
}

/* beyond reports a duplicate of a fast-path fd that would land at FD_MAX
 * or above, where the table cannot follow it: its writes would go to the
 * idle kernel socket. The dup fails instead, with err. */
static int beyond(int old, int fd, int err)
{
	if (fd < FD_MAX || !flow_of(old))
		return 0;
	plog("shunt: fd %d: a duplicate at fd %d is beyond the library's table (%d fds); refused", old, fd, FD_MAX);
	errno = err;
	return 1;
}

INTERPOSE int dup(int old)
{
	REAL_READY();
	if (vm_child())
		return real_dup(old);
	int fd = real_dup(old);
	if (fd >= 0 && beyond(old, fd, EMFILE)) {
		real_close(fd);
		return -1;
	}
	if (fd >= 0)
		share(old, fd);
	return fd;
}

INTERPOSE int dup2(int old, int fd)
{
	REAL_READY();
	if (vm_child())
		return real_dup2(old, fd);
	if (beyond(old, fd, EBADF))
		return -1;
	if (old != fd)
		forget(fd);
	int r = real_dup2(old, fd);
	if (r >= 0)
		share(old, r);
	return r;
}

INTERPOSE int dup3(int old, int fd, int flags)
{
	REAL_READY();
	if (vm_child())
		return real_dup3(old, fd, flags);
	if (beyond(old, fd, EBADF))
		return -1;
	forget(fd);
	int r = real_dup3(old, fd, flags);
	if (r >= 0)
		share(old, r);
	return r;
}

/* ---- fcntl and ioctl ---- */

static void set_nonblock(int fd, int on)
{
	if (fd < 0 || fd >= FD_MAX)
		return;
	nonblk[fd] = on;
	struct flow *f = flow_get(fd);
	if (f) {
		f->nonblock = on;
		flow_put(f);
	}
}

INTERPOSE int fcntl(int fd, int cmd, ...)
{
	REAL_READY();
	va_list ap;
	va_start(ap, cmd);
	long arg = va_arg(ap, long);
	va_end(ap);
	int r = real_fcntl(fd, cmd, arg);
	if (r >= 0 && (cmd == F_SETFL || cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) && vm_child())
		return r;
	if (r >= 0 && cmd == F_SETFL)
		set_nonblock(fd, (arg & O_NONBLOCK) != 0);
	if (r >= 0 && (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC)) {
		if (beyond(fd, r, arg >= FD_MAX ? EINVAL : EMFILE)) {
			real_close(r);
			return -1;
		}
		share(fd, r);
	}
	return r;
}

/* Programs built with 64-bit file offsets (nginx, redis, python3) call
 * fcntl64; on 64-bit targets it is the same call. */
INTERPOSE int fcntl64(int fd, int cmd, ...)
{
	va_list ap;
	va_start(ap, cmd);
	long arg = va_arg(ap, long);
	va_end(ap);
	return fcntl(fd, cmd, arg);
}

INTERPOSE int ioctl(int fd, unsigned long req, ...)
{
	REAL_READY();
	va_list ap;
	va_start(ap, req);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	struct flow *f = req == FIONREAD ? flow_get(fd) : NULL;
	if (f) {
		ssize_t n = conn_buffered(f, fd);
		*(int *)arg = n > INT_MAX ? INT_MAX : (int)n;
		flow_put(f);
		return 0;
	}
	int r = real_ioctl(fd, req, arg);
	if (r == 0 && req == FIONBIO)
		set_nonblock(fd, *(int *)arg != 0);
	return r;
}

/* ---- exit ---- */

/* At exit() the kernel sends FIN on every socket the program left open:
 * before that, each connection's writer leaves its ring (so the peer reads
 * what was sent and then EOF) and hostd hears CLOSE. The flows are not
 * freed: other threads may still be inside them. A process killed by a
 * signal gets no such exit: hostd tells its peers (DOWN, peer-gone), whose
 * readers drain the rings and then read what the kernel says. */
__attribute__((destructor)) static void fini(void)
{
	if (!real_write || !session)
		return;
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = flow_of(fd);
		if (f && f->owner == my_pid && !f->finished)
			conn_end(f); /* once per flow, though dup'd fds share it */
	}
}

/* ---- exec ----
 *
 * The library's state does not survive exec, but fds without FD_CLOEXEC
 * do: in the new image a fast-path fd would be a plain kernel socket, and
 * bytes written to it would go where the peer does not read. So before
 * exec, a connection this process owns on an fd that stays open is let
 * go to the kernel if no ring carried its bytes yet (as at a fork), and
 * one on the rings is reset
 * (the peer sees ECONNRESET) and its kernel socket shut down (the new image
 * sees EPIPE / EOF): an error on both sides, never silent loss. */
static void before_exec(void)
{
	if (getpid() != my_pid)
		return; /* a vfork child: this memory is its parent's, whose connections go on */
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = flow_of(fd);
		if (!f)
			continue;
		int fl = real_fcntl(fd, F_GETFD, 0);
		if (fl < 0 || (fl & FD_CLOEXEC)) {
			if (f->share && f->owner == my_pid)
				f->exec_leave = 1; /* the new image may not hold it: leave its slot (below) */
			continue;
		}
		if (f->dropped)
			continue; /* let go already (an exec that failed): the kernel's */
		if (f->owner != my_pid) {
			/* A fork child's copy of its parent's flow (fork.c): the
			 * new image gets an unconnected socket in its place
			 * (ENOTCONN, as here), never the parent's connection. */
			int s = real_socket(AF_INET, SOCK_STREAM, 0);
			if (s >= 0 && real_dup2(s, fd) == fd)
				plog("shunt: fd %d: the parent's connection on the rings: not usable across exec (ENOTCONN)", fd);
			if (s >= 0)
				real_close(s);
			continue;
		}
		/* No ring carried its bytes yet: let go as at a fork (fork.c),
		 * so that a READY handled meanwhile cannot attach it; the new
		 * image goes on with the kernel socket. */
		if (letgo_exec(f))
			continue;
		struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
		if (!rg)
			continue;
		/* Both reset flags first, then the wake-ups (as hostd does). */
		__atomic_store_n((uint32_t *)(rg->sf.w.hdr + SHUNT_OFF_RESET), 1, __ATOMIC_SEQ_CST);
		__atomic_store_n((uint32_t *)(rg->sf.r.hdr + SHUNT_OFF_RESET), 1, __ATOMIC_SEQ_CST);
		shunt_ring_abort(&rg->sf.w);
		shunt_ring_abort(&rg->sf.r);
		real_shutdown(fd, SHUT_RDWR);
		plog("shunt: fd %d stays open across exec: flow reset", fd);
		shunt_flow_close(&rg->sf);
	}
	/* A connection shared since a fork (share.c) whose fds all close at
	 * the exec: the new image does not hold it, so the other holders
	 * need not wait for it (socat's child execs its program so). One
	 * that an fd keeps open was let go above, and its slot poisoned. */
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = flow_of(fd);
		if (f && f->exec_leave) {
			f->exec_leave = 0;
			if (!f->dropped && f->share)
				share_exec(f);
		}
	}
}

/* exec_failed: the exec returned: the connections before_exec took out of
 * their slots go back in (share.c). */
static int exec_failed(int r)
{
	int e = errno;
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = flow_of(fd);
		if (f && f->exec_share)
			share_exec_failed(f);
	}
	errno = e;
	return r;
}

INTERPOSE int execve(const char *path, char *const argv[], char *const envp[])
{
	REAL_READY();
	before_exec();
	return exec_failed(real_execve(path, argv, envp));
}

INTERPOSE int execv(const char *path, char *const argv[])
{
	REAL_READY();
	extern char **environ;
	return execve(path, argv, environ);
}

/* glibc's execl family calls its internal execve, which no preload can
 * see, so each is interposed here too. */
static char **argv_from(const char *first, va_list ap, char ***envp)
{
	size_t n = 1;
	va_list cp;
	va_copy(cp, ap);
	while (va_arg(cp, char *))
		n++;
	va_end(cp);
	char **argv = malloc((n + 1) * sizeof *argv);
	if (!argv)
		return NULL;
	argv[0] = (char *)first;
	for (size_t i = 1; i <= n; i++)
		argv[i] = i < n ? va_arg(ap, char *) : NULL;
	if (envp)
		*envp = va_arg(ap, char **);
	return argv;
}

/* exec_list runs the argv built by argv_from (NULL: out of memory) with
 * execvp when search is set, else execve with envp, and frees it. */
static int exec_list(const char *path, char **argv, char **envp, int search)
{
	if (!argv)
		return errno = ENOMEM, -1;
	int r = search ? execvp(path, argv) : execve(path, argv, envp);
	free(argv);
	return r;
}

INTERPOSE int execl(const char *path, const char *arg, ...)
{
	REAL_READY();
	extern char **environ;
	va_list ap;
	va_start(ap, arg);
	char **argv = argv_from(arg, ap, NULL);
	va_end(ap);
	return exec_list(path, argv, environ, 0);
}

INTERPOSE int execle(const char *path, const char *arg, ...)
{
	REAL_READY();
	char **envp;
	va_list ap;
	va_start(ap, arg);
	char **argv = argv_from(arg, ap, &envp);
	va_end(ap);
	return exec_list(path, argv, envp, 0);
}

INTERPOSE int execlp(const char *file, const char *arg, ...)
{
	REAL_READY();
	va_list ap;
	va_start(ap, arg);
	char **argv = argv_from(arg, ap, NULL);
	va_end(ap);
	return exec_list(file, argv, NULL, 1);
}

INTERPOSE int execvpe(const char *file, char *const argv[], char *const envp[])
{
	REAL_READY();
	before_exec();
	return exec_failed(real_execvpe(file, argv, envp));
}

INTERPOSE int execvp(const char *file, char *const argv[])
{
	REAL_READY();
	before_exec();
	return exec_failed(real_execvp(file, argv));
}
