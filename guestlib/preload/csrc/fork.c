/* fork: which process keeps which connection (docs/preload.md, Rules).
 *
 * A connection that has carried no ring byte either way and whose read
 * ring this end has not marked attached is young. A young one hostd has
 * not heard of (in the open delay: no OPEN yet) is shared at the fork:
 * both processes keep it on TCP, and the one that ends up holding it
 * alone, having used it, OPENs it (share.c). Accept-then-fork servers
 * (socat fork, dropbear) fork within microseconds of accept, so their
 * child serves the connection on the fast path once the parent closed
 * its copy; a child that execs with it (inetd, sshd) leaves it on TCP.
 *
 * A young one whose OPEN went out is let go at the fork, in both
 * processes: the library forgets it, and its fd is a plain kernel socket
 * that libc serves, in the parent, in the child and across exec, for as
 * long as it lives (`tcp (fork)` with -v). The parent tells hostd
 * (CLOSE), so the peer stays on TCP and any rings are freed.
 *
 * Every fd of a let-go connection becomes FD_KERNEL in both processes:
 * the library ignores it until its close (a second connect() to check a
 * non-blocking one, which the kernel answers with 0, opens nothing).
 *
 * A connection on the rings stays with the parent (fork for a helper:
 * redis BGSAVE, a worker that only logs): the child's copy fails with
 * ENOTCONN (io.c, path.c), close only forgets it, and an exec puts an
 * unconnected socket in its place (lifetime.c), so no process but the
 * parent ever reads or writes it. A socket inside connect(), or whose
 * non-blocking connect is under way, is FD_KERNEL in both; so is a
 * connection another thread's connect or accept made but had not yet
 * told the library of (fork_gen, open.c). Listeners are shared: a child
 * that accepts on an inherited one registers it in its own session first
 * (socket.c).
 *
 * posix_spawn and posix_spawnp run no atfork handler (glibc builds them
 * on clone(CLONE_VM | CLONE_VFORK) and its internal execve): they are
 * interposed below, and apply the let-go rule before the spawn; so are
 * system and popen (glibc calls its internal posix_spawn, which no
 * preload sees). Not covered: vfork, whose child gets the raw kernel
 * socket of every inherited fd (docs/preload.md, Rules: spawn).
 *
 * Locks: a fork child has only the forking thread, so a lock another
 * thread held would stay held in it for good. The prepare handler takes
 * every lock of the library in the order preload.h gives (the core's
 * handler, registered before this one, runs after it and takes the
 * session's), including each connection's rmu and wmu: so the choice of
 * what to let go sees no read or write step half done, and no OPEN half
 * sent (open.c sends under wmu). The parent's handler lets them go, the
 * child's makes them new. */
#include "preload.h"

#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>

unsigned fork_gen;

/* letgo_ok: f is young: it has moved no byte on a ring and will not without this end
 * (rmu and wmu held): its read ring is not attached, its writer never
 * started, and the reader keeps nothing aside. */
static int letgo_ok(struct flow *f)
{
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (f->owner != my_pid || __atomic_load_n(&f->closed, __ATOMIC_SEQ_CST))
		return 0;
	if (f->rbytes[1] || f->wbytes[1] || f->rring || f->wring || f->slen || f->seof || f->alen)
		return 0;
	return !rg || (f->attach_due && !rg->wleft && !rg->rleft);
}

static void fork_prepare(void)
{
	ep_fork(FORK_PREPARE);
	pthread_mutex_lock(&tab_mu);
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = fds[fd];
		if (!f || f->fork_held)
			continue;
		pthread_mutex_lock(&f->rmu);
		pthread_mutex_lock(&f->wmu);
		f->fork_held = 1;
		/* Young: shared if hostd has not heard of it (share.c), else
		 * let go. */
		if (letgo_ok(f)) {
			if (!f->told && share_prepare(f) == 0)
				f->fork_share = 1;
			else
				f->fork_drop = 1;
		}
	}
	open_fork(FORK_PREPARE);
	flows_fork(FORK_PREPARE);
	conn_fork(FORK_PREPARE);
}

/* letgo_locked: the parent lets f go (its rmu and wmu held; at a fork
 * tab_mu too, before exec not): out of
 * the open queue and the index, off any rings it holds (READY came while
 * its reader slept in the kernel), never OPENed again. */
static void letgo_locked(struct flow *f)
{
	f->dropped = 1;
	share_poison(f); /* the kernel socket is a program's now: no holder may take it */
	open_forget(f);
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (rg) {
		writer_leave(f, rg);
		reader_leave(f, rg);
		f->attach_due = 0;
		__atomic_store_n(&f->rg, NULL, __ATOMIC_RELEASE);
	}
	f->fork_rg = rg;
	f->fork_close = f->told;
	f->told = 0;
}

/* letgo_done: after the locks, what hostd hears about f (CLOSE if OPEN
 * went out), and its rings, if READY gave it some, go back. */
static void letgo_done(struct flow *f, const char *why)
{
	struct rings *rg = f->fork_rg;
	struct shunt_flow id = {.req = f->req, .side = f->role == SHUNT_ROLE_PASSIVE ? 2 : 1, .session = session};
	if (rg)
		id = rg->sf;
	if (f->fork_close)
		shunt_flow_close(&id);
	if (rg) {
		shunt_flow_detach(&rg->sf);
		rings_free(rg);
	}
	plog("shunt: fd %d: tcp (%s: no ring carried its bytes yet; it stays a kernel socket%s)", f->fd, why,
	     f->fork_close ? ", hostd told" : "");
	f->fork_rg = NULL;
	f->fork_drop = 0;
}

/* A let-go pass (fork_parent, spawn_letgo) in two halves: under tab_mu
 * it marks the flows (fork_drop 2, chained on fork_next) and takes every
 * fd that refers to one out of the table (drop_fd_locked, which lists the
 * fd); after the locks, letgo_after gives each listed fd's epoll interest
 * to the kernel, drops its guard, tells hostd (letgo_done) and puts the
 * fds' reference. */
struct letgo_fds {
	int n, cap, *fd;
};

static void drop_fd_locked(struct letgo_fds *l, int fd, struct flow *f)
{
	__atomic_store_n(&fds[fd], NULL, __ATOMIC_RELEASE);
	kind[fd] = FD_KERNEL;
	f->refs--;
	int *more;
	if (l->n == l->cap && (more = realloc(l->fd, (l->cap = l->cap ? 2 * l->cap : 16) * sizeof *l->fd)))
		l->fd = more;
	if (l->n < l->cap && l->fd)
		l->fd[l->n++] = fd;
}

static void letgo_after(struct letgo_fds *l, struct flow *let, const char *why)
{
	for (int i = 0; i < l->n; i++) {
		ep_letgo(l->fd[i], 1);
		guard_forget(l->fd[i]);
	}
	int listed = l->fd != NULL;
	free(l->fd);
	while (let) {
		struct flow *f = let;
		let = f->fork_next;
		if (!listed) { /* out of memory for the list: f->fd at least */
			ep_letgo(f->fd, 1);
			guard_forget(f->fd);
		}
		letgo_done(f, why);
		if (!f->refs)
			flow_put(f); /* the fds' reference; calls still inside finish on TCP */
	}
}

/* mark_letgo_locked puts f on the let-go chain (its first fd seen). */
static void mark_letgo_locked(struct flow *f, struct flow **let)
{
	if (!f->dropped)
		letgo_locked(f);
	else
		f->fork_close = 0; /* let go before (an exec that failed): hostd knows */
	f->fork_drop = 2;
	f->fork_next = *let;
	*let = f;
}

static void fork_parent(void)
{
	conn_fork(FORK_PARENT);
	flows_fork(FORK_PARENT);
	open_fork(FORK_PARENT);
	fork_gen++;
	struct flow *let = NULL;
	/* The fds that held a let-go connection (any dup, not only f->fd,
	 * which the program may have moved or reused): their epoll interests
	 * become the kernel's and the guard lets them go, after the locks. */
	struct letgo_fds l = {0};
	for (int fd = 0; fd < FD_MAX; fd++) {
		if (kind[fd] == FD_PENDING || kind[fd] == FD_CONNECTING) {
			kind[fd] = FD_KERNEL;
			plog("shunt: fd %d connect: tcp (fork: the connect was under way)", fd);
		}
		struct flow *f = fds[fd];
		if (!f)
			continue;
		if (f->fork_drop == 1) /* its first fd: on the list (2) */
			mark_letgo_locked(f, &let);
		if (f->fork_drop)
			drop_fd_locked(&l, fd, f);
		f->fork_share = 0; /* it stays queued: OPEN when this process holds it alone */
		if (f->fork_held) {
			f->fork_held = 0;
			pthread_mutex_unlock(&f->wmu);
			pthread_mutex_unlock(&f->rmu);
		}
	}
	pthread_mutex_unlock(&tab_mu);
	ep_fork(FORK_PARENT);
	letgo_after(&l, let, "fork");
}

/* ---- posix_spawn ----
 *
 * glibc's posix_spawn is clone(CLONE_VM | CLONE_VFORK) and its own
 * execve: no atfork handler and no interposed execve run in the child.
 * So the fork rule is applied here, before the spawn, in the parent: a
 * connection no ring carried yet whose fd the new image may inherit is let
 * go to the kernel (as at a fork: CLOSE if OPEN went out), so that an
 * accept-then-spawn server's child reads every byte on the kernel socket.
 * An fd may be inherited if it lacks FD_CLOEXEC, or, when there are file
 * actions, at all (a dup2 action copies any fd; glibc's action list is
 * opaque, so a close action cannot be told from it): that may let go a
 * connection the child does not get, which only costs it the fast path.
 * A connection on the rings stays the parent's: the new image gets its
 * raw kernel socket, as before (docs/preload.md, Rules: spawn). */
void spawn_letgo(int any_fd)
{
	struct flow *let = NULL;
	pthread_mutex_lock(&tab_mu);
	for (int fd = 0; fd < FD_MAX; fd++) {
		struct flow *f = fds[fd];
		if (!f || f->owner != my_pid || f->fork_drop)
			continue;
		if (!any_fd) {
			int fl = real_fcntl(fd, F_GETFD, 0);
			if (fl < 0 || (fl & FD_CLOEXEC))
				continue;
		}
		pthread_mutex_lock(&f->rmu);
		pthread_mutex_lock(&f->wmu);
		if (letgo_ok(f))
			mark_letgo_locked(f, &let);
		pthread_mutex_unlock(&f->wmu);
		pthread_mutex_unlock(&f->rmu);
	}
	if (!let) {
		pthread_mutex_unlock(&tab_mu);
		return;
	}
	struct letgo_fds l = {0};
	for (int fd = 0; fd < FD_MAX; fd++) { /* every fd of a let-go connection, not only the inherited ones */
		struct flow *f = fds[fd];
		if (f && f->fork_drop == 2)
			drop_fd_locked(&l, fd, f);
	}
	pthread_mutex_unlock(&tab_mu);
	letgo_after(&l, let, "spawn");
}

INTERPOSE int posix_spawn(pid_t *pid, const char *path, const posix_spawn_file_actions_t *fa, const posix_spawnattr_t *at,
			  char *const argv[], char *const envp[])
{
	REAL_READY();
	spawn_letgo(fa != NULL);
	return real_posix_spawn(pid, path, fa, at, argv, envp);
}

INTERPOSE int posix_spawnp(pid_t *pid, const char *file, const posix_spawn_file_actions_t *fa, const posix_spawnattr_t *at,
			   char *const argv[], char *const envp[])
{
	REAL_READY();
	spawn_letgo(fa != NULL);
	return real_posix_spawnp(pid, file, fa, at, argv, envp);
}

/* system and popen: glibc runs the shell through its internal
 * posix_spawn, which no preload sees, so the spawn rule is applied here,
 * before: a young connection on an fd without FD_CLOEXEC, which the shell
 * and what it runs inherit, is let go to the kernel (a CGI-style
 * `system("prog <&3 >&3")`). */
INTERPOSE int system(const char *command)
{
	REAL_READY();
	if (command)
		spawn_letgo(0);
	return real_system(command);
}

INTERPOSE FILE *popen(const char *command, const char *type)
{
	REAL_READY();
	spawn_letgo(0);
	return real_popen(command, type);
}

/* letgo_exec: before exec (lifetime.c), f, which has an fd that stays
 * open, is let go as at a fork if no ring carried its bytes: a READY
 * handled meanwhile finds it dropped, and hostd hears CLOSE now (the
 * channel is close-on-exec). 1 if let go, 0 if it is on the rings. */
int letgo_exec(struct flow *f)
{
	pthread_mutex_lock(&f->rmu);
	pthread_mutex_lock(&f->wmu);
	int ok = !f->dropped && letgo_ok(f);
	if (ok)
		letgo_locked(f);
	pthread_mutex_unlock(&f->wmu);
	pthread_mutex_unlock(&f->rmu);
	if (ok)
		letgo_done(f, "exec");
	return ok || f->dropped;
}

static void fork_child(void)
{
	pthread_mutex_init(&tab_mu, NULL);
	ep_fork(FORK_CHILD);
	my_pid = getpid();
	open_fork(FORK_CHILD);
	flows_fork(FORK_CHILD);
	conn_fork(FORK_CHILD);
	fork_gen++;
	for (int fd = 0; fd < FD_MAX; fd++) {
		if (kind[fd] == FD_PENDING || kind[fd] == FD_CONNECTING)
			kind[fd] = FD_KERNEL;
		if (kind[fd] == FD_LISTENER)
			linherited[fd] = 1;
		struct flow *f = fds[fd];
		if (!f)
			continue;
		if (f->fork_held) { /* its first fd */
			f->fork_held = 0;
			pthread_mutex_init(&f->rmu, NULL);
			pthread_mutex_init(&f->wmu, NULL);
			/* Only the fds' reference: the calls that were inside it
			 * are the parent's threads', which the child does not
			 * have, so its last close releases it (leaving its share
			 * slot, share.c) instead of never. */
			__atomic_store_n(&f->users, 1, __ATOMIC_RELAXED);
		}
		if (f->fork_share) { /* the child holds it too, on TCP, and may OPEN it once alone */
			f->fork_share = 0;
			f->owner = my_pid;
			share_child(f);
			open_requeue(f, open_delay_ns);
		}
		if (f->fork_drop) { /* the parent's to let go; here only forgotten */
			fds[fd] = NULL;
			kind[fd] = FD_KERNEL;
			ep_letgo(fd, 0);
			if (--f->refs == 0)
				flow_discard(f);
		}
	}
	settle_after_fork();
	wait_after_fork();
	sleep_after_fork();
	guard_after_fork();
}

/* After the session is made (preload.c), so that these prepare handlers
 * run before the core's: tab_mu comes before the session's lock. */
void fork_init(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }
