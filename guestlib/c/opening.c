/* Opening the session's control channel (shunt.h, shunt_session_ensure):
 * by a program thread at its first need, or by the reader thread after
 * hostd went away (session_reconnect); what a failed open says, and
 * region 0 mapped (again). channel.c does the opening itself. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* map_region maps region 0 from path (mu held): 0, or -1. */
static int map_region(struct shunt_session *s, const char *path)
{
	int fd = open(path, O_RDWR | O_CLOEXEC);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) < 0) {
		if (fd >= 0)
			sys_close(fd);
		return -1;
	}
	void *mem = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	sys_close(fd);
	if (mem == MAP_FAILED)
		return -1;
	/* Into s->reg only once it holds: a remap that fails (region0_check)
	 * keeps the old mapping and its description together. */
	struct shunt_region g;
	if (shunt_region_attach(&g, mem, st.st_size)) {
		munmap(mem, st.st_size);
		return -1;
	}
	s->reg = g;
	s->region = mem;
	return 0;
}

/* reason_of is why connections stay on TCP when channel_open failed with
 * errno e: an older hostd (version), every control port of the VM in use
 * by other processes (control-limit, as Go says), hostd refusing a
 * process outside the guest's network namespace (not-guest), or no
 * hostd. */
static unsigned reason_of(int e)
{
	return e == EPROTONOSUPPORT ? SHUNT_REASON_VERSION
	       : e == EBUSY	    ? SHUNT_REASON_CONTROL_LIMIT
	       : e == EPERM	    ? SHUNT_REASON_NOT_GUEST
				    : SHUNT_REASON_NO_HOSTD;
}

/* quiet says, for a vsock open's errno e, that a device that did not
 * answer is left alone a while (open_vsock). */
static const char *quiet(int e) { return e == ETIMEDOUT ? " (no answer: not tried again for 30 s)" : ""; }
_Static_assert(SHUNT_VSOCK_QUIET_NS == 30000000000LL, "quiet says 30 s");

/* say_unreachable logs why channel_open failed (errno e, m what hostd
 * answered), once per kind of failure, not at every retry, with what to
 * do about it. mu held. */
static void say_unreachable(struct shunt_session *s, int e, const struct shunt_msg *m)
{
	if (e == EBUSY || s->said == e) /* channel_open said which ports are busy */
		return;
	s->said = e;
	/* A VM with vsock and no control port found nothing there either
	 * (discovering: channel_open tried vsock before the socket). */
	if (s->vsock_err && strcmp(s->c.control, SHUNT_VSOCK_CONTROL))
		shunt_logf(s, "shunt: no hostd over vsock (CID 2 port %d): %s%s; a VM without control port needs hostd to serve "
			      "its vsock (a vsock block in its guest block, hostd.hcl)",
			   SHUNT_VSOCK_CONTROL_PORT, strerror(s->vsock_err), quiet(s->vsock_err));
	if (e == EPROTONOSUPPORT)
		shunt_logf(s, "shunt: hostd at %s is older or shares no ring format: connections stay on TCP (version)", s->c.control);
	else if (e == EPERM)
		shunt_logf(s, "shunt: connections stay on TCP (not-guest): %s", m->text);
	else if (!strcmp(s->c.control, SHUNT_VSOCK_CONTROL))
		shunt_logf(s, "shunt: hostd unreachable over vsock (CID 2 port %d): %s%s: connections stay on TCP (no-hostd). "
			      "Does hostd serve this VM's vsock (a vsock block in its guest block, hostd.hcl)?",
			   SHUNT_VSOCK_CONTROL_PORT, strerror(e), quiet(e));
	else if (e == EACCES || e == ENOENT)
		shunt_logf(s, "shunt: hostd unreachable at %s: %s (uid %d), and hostd serves no guest in this network namespace: "
			      "connections stay on TCP (no-hostd). Give the guest its netns in hostd.hcl (every process of the "
			      "guest may then connect, after setuid or chroot too), or open the channel before dropping privileges "
			      "(docs/preload.md)",
			   s->c.control, strerror(e), (int)getuid());
	else
		shunt_logf(s, "shunt: hostd unreachable at %s: %s: connections stay on TCP (no-hostd)", s->c.control, strerror(e));
}

/* region0_check maps a VM's region 0 again when its mapping no longer
 * shows the region WELCOME w names (no valid header, another size or
 * generation): its ivshmem device was unplugged and plugged back (a live
 * migration, docs/vm.md), so the old mapping shows dead memory and the
 * new device may be disabled or elsewhere. The BAR is found (and enabled)
 * again, as Go's remapRegionZero does. The old mapping is kept: its
 * connections left its rings before the unplug (DOWN(migrating)), and
 * nothing counts its users. mu held; before the announcements (OPEN
 * again), so every READY after them finds the new mapping. */
static void region0_check(struct shunt_session *s, const struct shunt_msg *w)
{
	struct shunt_region g;
	if (!s->region || !w->region_size || s->region_path != s->bar ||
	    (shunt_region_attach(&g, s->region, s->reg.size) == 0 && g.size == w->region_size &&
	     __atomic_load_n((uint64_t *)(s->region + 64), __ATOMIC_SEQ_CST) == w->gen))
		return;
	if (shunt_find_bar(s->bar, sizeof s->bar) || map_region(s, s->bar)) {
		shunt_logf(s, "shunt: region 0 changed and its device cannot be found or mapped again: connections stay on TCP");
		return;
	}
	shunt_logf(s, "shunt: region 0 mapped again (%s, generation %llu): its device was plugged back", s->bar,
		   (unsigned long long)w->gen);
}

/* ---- one opener, without the lock ----
 *
 * An open can take seconds (a vsock connect 2 s, HELLO's write and
 * WELCOME's read 5 s each; a port's HELLOs 5 s), and every program
 * thread's close() and connect() takes mu to send (shunt_session_send).
 * So the open runs with mu let go, by one thread at a time (s->opening).
 *
 * Another thread that needs the channel meanwhile (ensure) waits for it
 * only during the process's first open (s->opens == 1), and only until
 * SHUNT_OPEN_WAIT_NS after it began (c.open_wait_ms may say another
 * bound): the threads of a program that connect together at its start
 * all reach a healthy hostd, and none waits long on a silent one, nor
 * again at the reader's reopens after hostd went away (an event loop's
 * connect, or MPI's progress, would pay it at every retry). Otherwise it
 * finds no channel, and its connection stays on TCP, as with no hostd.
 * Sends never wait.
 *
 * The opener then takes mu again and installs the channel only if the
 * session is still this process's and has none; else it closes it. A
 * fork waits for an open under way (fork_prepare, session.c), as it
 * waits for mu: the child must not inherit a half-open channel, which
 * would keep hostd from seeing the parent's session end, and a port
 * busy. A failed open, by either opener, counts for the retry limit
 * (s->tried) from its end. */

/* open_unlocked opens the channel as the session's one opener, with mu
 * held on entry and on return but not in between (the caller checked
 * that s->opening was 0, and that the session is pid's and has no
 * channel). The fd, with WELCOME in m, or -1 with errno; a channel that
 * can no longer be installed is closed (-1, ENOTCONN). */
static int open_unlocked(struct shunt_session *s, pid_t pid, struct shunt_msg *m)
{
	s->opening = shunt_now_ns();
	s->opens++;
	pthread_mutex_unlock(&s->mu);
	int fd = channel_open(s, m);
	int e = errno;
	pthread_mutex_lock(&s->mu);
	s->opening = 0;
	pthread_cond_broadcast(&s->cv); /* ensure's waiters and fork_prepare see the end once mu is let go */
	if (fd >= 0 && (s->pid != pid || s->fd >= 0)) {
		sys_close(fd);
		fd = -1;
		e = ENOTCONN;
	}
	if (fd < 0 && s->pid == pid)
		s->tried = shunt_now_ns();
	errno = e;
	return fd;
}

/* open_wait is how long after an open began another thread waits for it. */
static int64_t open_wait(const struct shunt_session *s)
{
	return s->c.open_wait_ms > 0 ? (int64_t)s->c.open_wait_ms * 1000000 : SHUNT_OPEN_WAIT_NS;
}

/* wait_open waits (mu held) for the open another thread has under way, if
 * it is this process's first, until open_wait after it began: 0 once that
 * open has ended (the channel is then open, or the open failed), -1 if it
 * still runs or is not one to wait for. */
static int wait_open(struct shunt_session *s, pid_t pid)
{
	int64_t began = s->opening;
	if (s->opens != 1)
		return -1;
	int64_t until = began + open_wait(s);
	struct timespec dl = {until / 1000000000LL, until % 1000000000LL};
	long long ms = (long long)(open_wait(s) / 1000000);
	shunt_logf(s, "shunt: waiting for another thread's open of the control channel (up to %lld ms after it began)", ms);
	while (s->opening == began && s->pid == pid)
		if (pthread_cond_timedwait(&s->cv, &s->mu, &dl) == ETIMEDOUT)
			break;
	if (s->opening == began && s->pid == pid) {
		shunt_logf(s, "shunt: another thread's open of the control channel still runs after %lld ms: this connection "
			      "stays on TCP",
			   ms);
		return -1;
	}
	return 0;
}

/* session_reconnect reopens the channel after hostd went away, for a
 * process that holds something (an idle one reconnects at its next
 * ensure instead), and returns the new fd, or -1 to end the reader:
 * another thread reconnected first (announce is then done here too), the
 * process forked, or it holds nothing. */
int session_reconnect(struct shunt_session *s)
{
	pid_t pid = session_self();
	for (int delay = SHUNT_BACKOFF_MIN_MS;; delay = 2 * delay < SHUNT_BACKOFF_MAX_MS ? 2 * delay : SHUNT_BACKOFF_MAX_MS) {
		if (!s->c.holds || !s->c.holds(s->c.arg))
			return -1;
		struct timespec ts = {delay / 1000, (delay % 1000) * 1000000L};
		nanosleep(&ts, NULL);
		pthread_mutex_lock(&s->mu);
		if (s->pid != pid) {
			pthread_mutex_unlock(&s->mu);
			return -1;
		}
		if (s->fd >= 0) {
			pthread_mutex_unlock(&s->mu);
			session_announce(s);
			return -1;
		}
		if (s->opening) { /* a program thread's ensure opens: look again after the next pause */
			pthread_mutex_unlock(&s->mu);
			continue;
		}
		struct shunt_msg w;
		int fd = open_unlocked(s, pid, &w);
		if (fd < 0 && s->pid != pid) {
			pthread_mutex_unlock(&s->mu);
			return -1;
		}
		s->why = fd < 0 ? reason_of(errno) : SHUNT_REASON_NO_HOSTD;
		if (fd >= 0) {
			region0_check(s, &w);
			session_set_fd(s, fd);
			session_start_keepalive(s, fd);
		}
		pthread_mutex_unlock(&s->mu);
		if (fd >= 0) {
			shunt_logf(s, "shunt: reconnected to hostd");
			session_announce(s);
			return fd;
		}
	}
}

static int ensure(struct shunt_session *s)
{
	pthread_mutex_lock(&s->mu);
	pid_t pid = session_self();
	if (s->pid != pid) { /* forked: the parent's channel and requests are not ours */
		session_set_fd(s, -1);
		__atomic_store_n(&s->pid, pid, __ATOMIC_SEQ_CST);
		s->tried = 0;
		s->pend = NULL;
		s->opening = 0;
		s->opens = 0;
	}
	if (s->fd >= 0) {
		pthread_mutex_unlock(&s->mu);
		return 0;
	}
	if (s->opening && wait_open(s, pid)) { /* another thread opens (without mu): not waited for, or too long */
		pthread_mutex_unlock(&s->mu);
		errno = ENOTCONN;
		return -1;
	}
	if (s->fd >= 0) {
		pthread_mutex_unlock(&s->mu);
		return 0;
	}
	int64_t now = shunt_now_ns();
	if (s->tried && now - s->tried < SHUNT_RETRY_NS) {
		pthread_mutex_unlock(&s->mu);
		errno = ENOTCONN;
		return -1;
	}
	s->tried = now;
	struct shunt_msg m;
	m.text[0] = 0;
	int fd = open_unlocked(s, pid, &m);
	if (fd < 0) {
		int e = errno;
		s->why = reason_of(e);
		say_unreachable(s, e, &m);
		pthread_mutex_unlock(&s->mu);
		errno = e;
		return -1;
	}
	/* Region 0: what WELCOME names (a process guest gets none: its regions
	 * come by REGION), or the BAR in a VM, or SHUNT_REGION. */
	const char *region = s->region_path ? s->region_path : m.region;
	if (!s->region && *region && map_region(s, region)) {
		shunt_logf(s, "shunt: cannot map the region %s", region);
		sys_close(fd);
		pthread_mutex_unlock(&s->mu);
		errno = ENXIO;
		return -1;
	}
	region0_check(s, &m);
	if (session_start_reader(s, fd)) {
		if (s->said != -1) /* once, not at every retry (a process limit of 0) */
			shunt_logf(s, "shunt: cannot start the control reader thread (a process limit?): connections stay on TCP");
		s->said = -1;
		sys_close(fd);
		pthread_mutex_unlock(&s->mu);
		errno = EAGAIN;
		return -1;
	}
	session_set_fd(s, fd);
	s->said = 0;
	session_start_keepalive(s, fd);
	pthread_mutex_unlock(&s->mu);
	return 0;
}

/* Not a cancellation point: ensure waits on cv with mu held, and a waiter
 * cancelled there would leave mu held for good. A program's
 * pthread_cancel takes effect at its next cancellation point. */
int shunt_session_ensure(struct shunt_session *s)
{
	int cs;
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cs);
	int r = ensure(s);
	pthread_setcancelstate(cs, NULL);
	return r;
}
