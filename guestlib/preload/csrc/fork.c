/* fork: which process keeps which connection (docs/preload.md, Rules).
 *
 * A connection that has carried no ring byte either way and whose read
 * ring this end has not marked attached (it is in the open delay, or OPEN
 * went out and READY has not been acted on) is let go at the fork, in both
 * processes: the library forgets it, and its fd is a plain kernel socket
 * that libc serves, in the parent, in the child and across exec, for as
 * long as it lives (`tcp (fork)` with -v). The parent tells hostd (CLOSE,
 * if OPEN went out), so the peer stays on TCP and any rings are freed.
 * Accept-then-fork and fork+exec servers (socat fork, sshd, inetd) fork
 * long before READY, so with the open delay their connections land here:
 * the child may serve the connection, dup2 it onto 0 and 1, exec, and the
 * parent may close its copy or keep it.
 *
 * A connection on the rings stays with the parent (fork for a helper:
 * popen, system, redis BGSAVE): the child's copy fails with ENOTCONN
 * (io.c, path.c), close only forgets it, and an exec puts an unconnected
 * socket in its place (lifetime.c), so no process but the parent ever
 * reads or writes it. A socket whose non-blocking connect is under way
 * stays plain TCP in both. Listeners are shared: a child that accepts on
 * an inherited one registers it in its own session first (socket.c).
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

#include <sys/socket.h>

/* letgo_ok: f has moved no byte on a ring and will not without this end
 * (rmu and wmu held): its read ring is not attached, its writer never
 * started, and the reader keeps nothing aside. */
static int letgo_ok(struct flow *f)
{
	struct rings *rg = __atomic_load_n(&f->rg, __ATOMIC_ACQUIRE);
	if (f->owner != my_pid || __atomic_load_n(&f->closed, __ATOMIC_SEQ_CST))
		return 0;
	if (f->rbytes[1] || f->wbytes[1] || f->rring || f->wring || f->slen || f->seof)
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
		f->fork_drop = letgo_ok(f);
	}
	open_fork(FORK_PREPARE);
	flows_fork(FORK_PREPARE);
	conn_fork(FORK_PREPARE);
}

/* letgo_locked: the parent lets f go (its locks and tab_mu held): out of
 * the open queue and the index, off any rings it holds (READY came while
 * its reader slept in the kernel), never OPENed again. */
static void letgo_locked(struct flow *f)
{
	f->dropped = 1;
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

static void fork_parent(void)
{
	conn_fork(FORK_PARENT);
	flows_fork(FORK_PARENT);
	open_fork(FORK_PARENT);
	struct flow *let = NULL;
	for (int fd = 0; fd < FD_MAX; fd++) {
		if (kind[fd] == FD_PENDING) {
			kind[fd] = FD_TCP;
			plog("shunt: fd %d connect: tcp (fork: the connect was under way)", fd);
		}
		struct flow *f = fds[fd];
		if (!f)
			continue;
		if (f->fork_drop) {
			if (!f->dropped) {
				letgo_locked(f);
				f->fork_next = let;
				let = f;
			}
			__atomic_store_n(&fds[fd], NULL, __ATOMIC_RELEASE);
			f->refs--;
		}
		if (f->fork_held) {
			f->fork_held = 0;
			pthread_mutex_unlock(&f->wmu);
			pthread_mutex_unlock(&f->rmu);
		}
	}
	pthread_mutex_unlock(&tab_mu);
	ep_fork(FORK_PARENT);
	/* After the locks: what hostd hears, and the fds' reference. */
	while (let) {
		struct flow *f = let;
		let = f->fork_next;
		struct rings *rg = f->fork_rg;
		struct shunt_flow id = {.req = f->req, .side = f->role == SHUNT_ROLE_PASSIVE ? 2 : 1, .session = session};
		if (rg)
			id = rg->sf;
		if (f->fork_close)
			shunt_flow_close(&id);
		ep_letgo(f->fd, 1);
		if (rg) {
			guard_forget(f->fd);
			shunt_flow_detach(&rg->sf);
			rings_free(rg);
		}
		plog("shunt: fd %d: tcp (fork: no ring carried its bytes yet; it stays a kernel socket in both processes%s)", f->fd,
		     f->fork_close ? ", hostd told" : "");
		f->fork_rg = NULL;
		f->fork_drop = 0;
		if (!f->refs)
			flow_put(f); /* the fds' reference; calls still inside finish on TCP */
	}
}

static void fork_child(void)
{
	pthread_mutex_init(&tab_mu, NULL);
	ep_fork(FORK_CHILD);
	my_pid = getpid();
	open_fork(FORK_CHILD);
	flows_fork(FORK_CHILD);
	conn_fork(FORK_CHILD);
	for (int fd = 0; fd < FD_MAX; fd++) {
		if (kind[fd] == FD_PENDING)
			kind[fd] = FD_TCP;
		if (kind[fd] == FD_LISTENER)
			linherited[fd] = 1;
		struct flow *f = fds[fd];
		if (!f)
			continue;
		if (f->fork_held) {
			f->fork_held = 0;
			pthread_mutex_init(&f->rmu, NULL);
			pthread_mutex_init(&f->wmu, NULL);
		}
		if (f->fork_drop) { /* the parent's to let go; here only forgotten */
			fds[fd] = NULL;
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
