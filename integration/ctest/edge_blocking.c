/* edge_blocking: the edge suite's tests of waits (edge.h). */
#include "edge.h"

#include <linux/sockios.h>
#include <sys/ioctl.h>

/* many: MANY connections in one epoll set (or poll set); data arrives on
 * the last while the client sleeps in the wait, which must return with
 * that fd ready. The wait has no timeout, as in a server; a wait that
 * sleeps through the data is killed by SIGALRM after FAIL_AFTER_S. */
#define FAIL_AFTER_S 5
int many(const char *ip, int port, const char *t)
{
	static int fd[MANY];
	static struct pollfd p[MANY];
	int settle = settle_ms;
	settle_ms = 0; /* once for all of them, below */
	for (int i = 0; i < MANY; i++) {
		if ((fd[i] = dial(ip, port, 0)) < 0)
			return fail(t, "connect");
		if (write(fd[i], "many\n", 5) != 5)
			return fail(t, "send the test name");
		p[i] = (struct pollfd){.fd = fd[i], .events = POLLIN};
	}
	usleep(settle * 1000 + 500000);
	int ep = -1, last = fd[MANY - 1], n;
	if (!strcmp(t, "epollmany")) {
		ep = epoll_create1(0);
		for (int i = 0; i < MANY; i++) {
			struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd[i]};
			if (epoll_ctl(ep, EPOLL_CTL_ADD, fd[i], &ev))
				return fail(t, "epoll_ctl");
		}
	}
	if (write(last, "d", 1) != 1)
		return fail(t, "ask for data");
	printf("waiting; killed by SIGALRM if the wait sleeps through the data for %d s\n", FAIL_AFTER_S);
	fflush(stdout);
	alarm(FAIL_AFTER_S);
	if (ep >= 0) {
		struct epoll_event got[4];
		n = epoll_wait(ep, got, 4, -1);
		if (n != 1 || got[0].data.fd != last)
			return fail(t, "epoll_wait did not report the last connection alone");
		close(ep);
	} else {
		n = poll(p, MANY, -1);
		if (n != 1 || p[MANY - 1].revents != POLLIN)
			return fail(t, "poll did not report the last connection alone");
	}
	alarm(0);
	char b;
	if (read(last, &b, 1) != 1 || b != 'x')
		return fail(t, "read after the wait");
	for (int i = 0; i < MANY; i++)
		close(fd[i]);
	printf("PASS %s\n", t);
	return 0;
}

/* ---- a call blocked in one thread, acted on from another ----
 *
 * The call runs in a thread of its own. The main thread waits until that
 * thread sleeps in the kernel (state S in /proc: past the library's spin),
 * then signals it, shuts the socket down or closes it, and waits for the
 * call to end, at most BOUND_MS: a call that does not end is a failure
 * (the process exits with the thread still blocked). */
#define BOUND_MS 5000
#define FORKS    30 /* forkloop */

struct call {
	int fd, op, flags; /* op: 'r' recv, 's' send, 'S' shutdown(fd, flags), 'e' epoll_wait and
			    * 'E' epoll_pwait on the set flags, 'p' poll, 'x' select (for input on fd) */
	char buf[65536];
	size_t n;
	ssize_t ret;
	int err;
	pid_t tid;
	int64_t took_ns;
	pthread_t th;
};

static int64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *run_call(void *arg)
{
	struct call *c = arg;
	__atomic_store_n(&c->tid, gettid(), __ATOMIC_SEQ_CST);
	int64_t t0 = mono_ns();
	struct epoll_event ev;
	struct pollfd p = {.fd = c->fd, .events = POLLIN};
	fd_set rs;
	FD_ZERO(&rs);
	FD_SET(c->fd, &rs);
	sigset_t none;
	sigemptyset(&none);
	c->ret = c->op == 'r' ? recv(c->fd, c->buf, c->n, c->flags)
		 : c->op == 's' ? send(c->fd, c->buf, c->n, c->flags)
		 : c->op == 'e' ? epoll_wait(c->flags, &ev, 1, -1)
		 : c->op == 'E' ? epoll_pwait(c->flags, &ev, 1, -1, &none)
		 : c->op == 'p' ? poll(&p, 1, -1)
		 : c->op == 'x' ? select(c->fd + 1, &rs, NULL, NULL, NULL) : shutdown(c->fd, c->flags);
	c->err = errno;
	c->took_ns = mono_ns() - t0;
	return NULL;
}

/* asleep reports whether thread tid sleeps in the kernel, waiting up to
 * BOUND_MS for it. A thread that ended is not asleep. */
static int asleep(pid_t tid)
{
	char path[64], st[512];
	snprintf(path, sizeof path, "/proc/self/task/%d/stat", tid);
	for (int ms = 0; ms < BOUND_MS; ms++) {
		int f = open(path, O_RDONLY);
		if (f < 0)
			return 0;
		ssize_t k = read(f, st, sizeof st - 1);
		close(f);
		st[k > 0 ? k : 0] = 0;
		char *p = strrchr(st, ')');
		if (p && p[1] == ' ' && p[2] == 'S')
			return 1;
		usleep(1000);
	}
	return 0;
}

/* start runs the call c in a thread; 0 once it sleeps in the kernel. */
static int start(struct call *c)
{
	c->tid = 0;
	if (pthread_create(&c->th, NULL, run_call, c))
		return -1;
	for (int ms = 0; !__atomic_load_n(&c->tid, __ATOMIC_SEQ_CST) && ms < BOUND_MS; ms++)
		usleep(1000);
	return asleep(c->tid) ? 0 : -1;
}

/* ended waits up to ms for the call to end: 1 if it did. */
static int ended(struct call *c, int ms)
{
	struct timespec until;
	clock_gettime(CLOCK_MONOTONIC, &until);
	until.tv_sec += ms / 1000;
	until.tv_nsec += (ms % 1000) * 1000000L;
	if (until.tv_nsec >= 1000000000)
		until.tv_sec++, until.tv_nsec -= 1000000000;
	return pthread_clockjoin_np(c->th, NULL, CLOCK_MONOTONIC, &until) == 0;
}

static volatile sig_atomic_t hits;
static sem_t handled;

static void on_alarm(int sig)
{
	(void)sig;
	hits++;
	sem_post(&handled);
}

/* handle installs on_alarm for SIGALRM, with SA_RESTART or without. */
static void handle(int restart)
{
	struct sigaction sa = {.sa_handler = on_alarm, .sa_flags = restart ? SA_RESTART : 0};
	sigemptyset(&sa.sa_mask);
	sigaction(SIGALRM, &sa, NULL);
	hits = 0;
}

/* handled_within waits up to BOUND_MS for the handler to have run. */
static int handled_within(void)
{
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += BOUND_MS / 1000;
	return sem_timedwait(&handled, &until) == 0;
}

/* interrupted: the call c, asleep, gets SIGALRM; it must end with
 * -1/want within BOUND_MS. */
static int interrupted(const char *t, struct call *c, int want, const char *what)
{
	if (start(c))
		return fail(t, "the call did not block");
	pthread_kill(c->th, SIGALRM);
	if (!ended(c, BOUND_MS))
		return printf("FAIL %s: %s: still blocked %d s after the signal\n", t, what, BOUND_MS / 1000), 1;
	if (c->ret != -1 || c->err != want)
		return printf("FAIL %s: %s: got %zd (errno %d %s), want -1 (%s)\n", t, what, c->ret, c->err,
			      strerror(c->err), strerror(want)), 1;
	if (!handled_within())
		return fail(t, "the handler did not run");
	return 0;
}

/* timeo sets SO_RCVTIMEO or SO_SNDTIMEO to ms. */
static void timeo(int fd, int opt, int ms)
{
	struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
	setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv);
}

/* timed_out: the call c, with a socket timeout of ms, must end by itself
 * with -1/EAGAIN, no sooner than the timeout. */
static int timed_out(const char *t, struct call *c, int ms)
{
	if (pthread_create(&c->th, NULL, run_call, c))
		return fail(t, "thread");
	if (!ended(c, ms + BOUND_MS))
		return printf("FAIL %s: a call with a %d ms timeout still blocks after %d ms\n", t, ms, ms + BOUND_MS), 1;
	if (c->ret != -1 || c->err != EAGAIN)
		return printf("FAIL %s: timed out with %zd (errno %d %s), want -1 (EAGAIN)\n", t, c->ret, c->err, strerror(c->err)), 1;
	if (c->took_ns < (int64_t)(ms - 10) * 1000000)
		return printf("FAIL %s: timed out after %lld ms, before its %d ms\n", t, (long long)(c->took_ns / 1000000), ms), 1;
	return 0;
}

/* say sends the test (or server mode) name on a new connection. */
static int say(int fd, const char *name)
{
	char line[40];
	int ln = snprintf(line, sizeof line, "%s\n", name);
	return write(fd, line, ln) == ln ? 0 : -1;
}

/* sink_full connects to a sink and fills the ring towards it (the server
 * reads nothing until released). A fill that went to the kernel socket
 * instead (READY later than dial's settle, on a loaded machine: a send
 * blocked there would move to the ring when READY comes and complete) is
 * seen by the kernel's unacknowledged bytes, and tried again on a new
 * connection. */
static int sink_full(const char *ip, int port)
{
	for (int try = 0; try < 5; try++) {
		int fd = dial(ip, port, 0);
		char k, buf[4096] = {0};
		if (fd < 0 || say(fd, "sink") || read(fd, &k, 1) != 1 || k != 'k')
			return -1;
		int i = 0;
		while (i < 1 << 16 && send(fd, buf, sizeof buf, MSG_DONTWAIT) >= 0)
			i++;
		if (i == 1 << 16 || errno != EAGAIN) {
			errno = i == 1 << 16 ? ENOBUFS : errno; /* a 256 MiB ring? */
			return -1;
		}
		int queued = 0;
		if (ioctl(fd, SIOCOUTQ, &queued) == 0 && queued == 0)
			return fd;
		fprintf(stderr, "sink_full: %d bytes went to the kernel socket, not the ring: again\n", queued);
		close(fd);
		usleep(200000);
	}
	errno = EAGAIN;
	return -1;
}

/* release lets every sink read (on a connection of its own). */
static int release(const char *ip, int port)
{
	int fd = dial(ip, port, 0);
	if (fd < 0 || say(fd, "release"))
		return -1;
	close(fd);
	return 0;
}

int signals(const char *ip, int port, const char *t)
{
	sem_init(&handled, 0, 0);
	signal(SIGPIPE, SIG_IGN);
	int fd = -1;
	static struct call c;
	if (!strcmp(t, "waiteintr")) {
		/* A wait for input on a fast-path fd, interrupted by a handler
		 * without SA_RESTART: -1/EINTR, as the kernel's (nginx logged
		 * "epoll_wait() failed (11: Resource temporarily unavailable)"). */
		if ((fd = dial(ip, port, 0)) < 0 || say(fd, "cmd"))
			return fail(t, "connect");
		int ep = epoll_create1(0);
		struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
		if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev))
			return fail(t, "epoll_ctl");
		handle(0);
		static const struct {
			int op;
			const char *what;
		} waits[] = {{'e', "epoll_wait"}, {'E', "epoll_pwait"}, {'p', "poll"}, {'x', "select"}};
		for (size_t i = 0; i < sizeof waits / sizeof *waits; i++) {
			c = (struct call){.fd = fd, .op = waits[i].op, .flags = ep};
			if (interrupted(t, &c, EINTR, waits[i].what))
				return 1;
		}
		close(ep);
	} else if (!strcmp(t, "eintr")) {
		/* Without SA_RESTART a blocked read fails with EINTR; with some
		 * bytes already read, it returns them. */
		if ((fd = dial(ip, port, 0)) < 0 || say(fd, "cmd"))
			return fail(t, "connect");
		handle(0);
		c = (struct call){.fd = fd, .op = 'r', .n = 1};
		if (interrupted(t, &c, EINTR, "read"))
			return 1;
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (write(fd, "h", 1) != 1 || poll(&p, 1, BOUND_MS) != 1)
			return fail(t, "hello");
		c = (struct call){.fd = fd, .op = 'r', .n = 10, .flags = MSG_WAITALL};
		if (start(&c))
			return fail(t, "recv(MSG_WAITALL) did not block after the first 5 bytes");
		pthread_kill(c.th, SIGALRM);
		if (!ended(&c, BOUND_MS) || c.ret != 5 || memcmp(c.buf, "hello", 5))
			return printf("FAIL %s: MSG_WAITALL interrupted after 5 bytes: got %zd (errno %d)\n", t, c.ret, c.err), 1;
	} else if (!strcmp(t, "restart")) {
		/* With SA_RESTART the read goes on, and returns data sent after
		 * the handler ran. */
		if ((fd = dial(ip, port, 0)) < 0 || say(fd, "cmd"))
			return fail(t, "connect");
		handle(1);
		c = (struct call){.fd = fd, .op = 'r', .n = 1};
		if (start(&c))
			return fail(t, "the read did not block");
		pthread_kill(c.th, SIGALRM);
		if (!handled_within())
			return fail(t, "the handler did not run");
		if (!asleep(c.tid))
			return printf("FAIL %s: the read ended after an SA_RESTART handler: %zd (errno %d %s)\n", t, c.ret,
				      c.err, strerror(c.err)), 1;
		if (write(fd, "x", 1) != 1 || !ended(&c, BOUND_MS) || c.ret != 1 || c.buf[0] != 'x' || hits != 1)
			return printf("FAIL %s: after the handler: got %zd (errno %d), handler ran %d times\n", t, c.ret, c.err, (int)hits), 1;
	} else if (!strcmp(t, "rcvtimeo")) {
		/* Set before connect, on the kernel socket: the read times out
		 * with EAGAIN. With a timeout, even an SA_RESTART handler makes
		 * a read fail with EINTR (signal(7)). */
		fd = socket(AF_INET, SOCK_STREAM, 0);
		timeo(fd, SO_RCVTIMEO, 200);
		struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
		inet_pton(AF_INET, ip, &a.sin_addr);
		if (connect(fd, (struct sockaddr *)&a, sizeof a) || say(fd, "cmd"))
			return fail(t, "connect");
		c = (struct call){.fd = fd, .op = 'r', .n = 1};
		if (timed_out(t, &c, 200))
			return 1;
		timeo(fd, SO_RCVTIMEO, 100000);
		handle(1);
		c = (struct call){.fd = fd, .op = 'r', .n = 1};
		if (interrupted(t, &c, EINTR, "read with SO_RCVTIMEO and SA_RESTART"))
			return 1;
		timeo(fd, SO_RCVTIMEO, 0); /* none again: the data is read */
		c = (struct call){.fd = fd, .op = 'r', .n = 1};
		if (start(&c) || write(fd, "x", 1) != 1 || !ended(&c, BOUND_MS) || c.ret != 1)
			return fail(t, "read after clearing SO_RCVTIMEO");
	} else if (!strcmp(t, "shutwr")) {
		/* shutdown(SHUT_WR) from another thread ends a send blocked on
		 * a full ring with EPIPE, and does not wait for it. */
		if ((fd = sink_full(ip, port)) < 0)
			return fail(t, "fill the ring");
		c = (struct call){.fd = fd, .op = 's', .n = 1000};
		if (start(&c))
			return fail(t, "the send did not block");
		static struct call o;
		o = (struct call){.fd = fd, .op = 'S', .flags = SHUT_WR};
		if (pthread_create(&o.th, NULL, run_call, &o) || !ended(&o, BOUND_MS) || o.ret != 0)
			return fail(t, "shutdown(SHUT_WR) waited behind a blocked send");
		if (!ended(&c, BOUND_MS) || c.ret != -1 || c.err != EPIPE)
			return printf("FAIL %s: the blocked send got %zd (errno %d %s), want -1 (EPIPE)\n", t, c.ret, c.err,
				      strerror(c.err)), 1;
		if (release(ip, port))
			return fail(t, "release");
	} else if (!strcmp(t, "sigsend") || !strcmp(t, "sndtimeo")) {
		/* A send blocked on a full ring: the same rules as a read. */
		if ((fd = sink_full(ip, port)) < 0)
			return fail(t, "fill the ring");
		c = (struct call){.fd = fd, .op = 's', .n = 1000};
		if (!strcmp(t, "sigsend")) {
			handle(0);
			if (interrupted(t, &c, EINTR, "send"))
				return 1;
			handle(1);
			c = (struct call){.fd = fd, .op = 's', .n = 1000};
			if (start(&c))
				return fail(t, "the send did not block");
			pthread_kill(c.th, SIGALRM);
			if (!handled_within() || !asleep(c.tid))
				return printf("FAIL %s: the send ended after an SA_RESTART handler: %zd (errno %d %s)\n", t,
					      c.ret, c.err, strerror(c.err)), 1;
			if (release(ip, port) || !ended(&c, BOUND_MS) || c.ret != 1000)
				return printf("FAIL %s: after the handler and the release: %zd (errno %d)\n", t, c.ret, c.err), 1;
		} else {
			timeo(fd, SO_SNDTIMEO, 200);
			if (timed_out(t, &c, 200))
				return 1;
			timeo(fd, SO_SNDTIMEO, 100000);
			handle(1);
			c = (struct call){.fd = fd, .op = 's', .n = 1000};
			if (interrupted(t, &c, EINTR, "send with SO_SNDTIMEO and SA_RESTART"))
				return 1;
			if (release(ip, port))
				return fail(t, "release");
		}
	} else if (!strcmp(t, "threads")) {
		/* While one thread is blocked in recv, another's send and
		 * non-blocking recv on the same socket do not wait for it, and
		 * its shutdown(SHUT_RD) ends the recv with 0, as with the
		 * kernel. */
		if ((fd = dial(ip, port, 0)) < 0 || say(fd, "cmd"))
			return fail(t, "connect");
		c = (struct call){.fd = fd, .op = 'r', .n = 1};
		if (start(&c))
			return fail(t, "the recv did not block");
		static struct call o;
		o = (struct call){.fd = fd, .op = 's', .n = 1, .buf = "n"};
		if (pthread_create(&o.th, NULL, run_call, &o) || !ended(&o, BOUND_MS) || o.ret != 1)
			return fail(t, "a send waited behind a blocked recv");
		o = (struct call){.fd = fd, .op = 'r', .n = 1, .flags = MSG_DONTWAIT};
		if (pthread_create(&o.th, NULL, run_call, &o) || !ended(&o, BOUND_MS))
			return fail(t, "a recv(MSG_DONTWAIT) waited behind a blocked recv");
		if (o.ret != -1 || o.err != EAGAIN)
			return printf("FAIL %s: recv(MSG_DONTWAIT) beside a blocked recv: %zd (errno %d %s), want -1 (EAGAIN)\n",
				      t, o.ret, o.err, strerror(o.err)), 1;
		if (shutdown(fd, SHUT_RD))
			return fail(t, "shutdown");
		if (!ended(&c, BOUND_MS) || c.ret != 0)
			return printf("FAIL %s: shutdown(SHUT_RD) from another thread: the recv got %zd (errno %d), want 0\n", t,
				      c.ret, c.err), 1;
		char b;
		if (read(fd, &b, 1) != 0)
			return fail(t, "a read after shutdown(SHUT_RD) is not EOF");
	} else if (!strcmp(t, "closewake")) {
		/* close from another thread: the blocked read ends (EBADF) and
		 * close does not wait for it; the next connection works. */
		if ((fd = dial(ip, port, 0)) < 0 || say(fd, "cmd"))
			return fail(t, "connect");
		c = (struct call){.fd = fd, .op = 'r', .n = 1};
		if (start(&c))
			return fail(t, "the read did not block");
		close(fd);
		if (!ended(&c, BOUND_MS))
			return fail(t, "a read still blocked after another thread closed its fd");
		if (c.ret != -1 || c.err != EBADF)
			return printf("FAIL %s: the read got %zd (errno %d %s), want -1 (EBADF)\n", t, c.ret, c.err, strerror(c.err)), 1;
		if ((fd = dial(ip, port, 0)) < 0 || say(fd, "echo") || !echo_ok(fd, "after close"))
			return fail(t, "the next connection");
	}
	close(fd);
	printf("PASS %s\n", t);
	return 0;
}

/* forkloop: a thread connects and closes in a loop (the session's and the
 * fd table's locks change hands all the time) while the main thread forks
 * FORKS times. Each child must make a connection of its own (fast path or
 * TCP) and exit; one that hangs is killed by its alarm. The parent's
 * connection made before the forks (on the rings by then) must still
 * echo after them, the process must idle, and a new connection work. */
static volatile int looping = 1;
static const char *loop_ip;
static int loop_port, loops;

static void *connect_loop(void *arg)
{
	(void)arg;
	while (__atomic_load_n(&looping, __ATOMIC_SEQ_CST)) {
		int fd = dial(loop_ip, loop_port, 0);
		if (fd >= 0 && !say(fd, "echo") && echo_ok(fd, "loop"))
			loops++;
		close(fd);
	}
	return NULL;
}

int forkloop(const char *ip, int port, const char *t)
{
	loop_ip = ip, loop_port = port;
	int kept = dial(ip, port, 0);
	if (kept < 0 || say(kept, "echo") || !echo_ok(kept, "before the forks"))
		return fail(t, "the parent's connection");
	pthread_t th;
	if (pthread_create(&th, NULL, connect_loop, NULL))
		return fail(t, "thread");
	for (int i = 0; i < FORKS; i++) {
		fflush(stdout);
		pid_t pid = fork();
		if (pid == 0) {
			alarm(BOUND_MS / 1000);
			int fd = dial(ip, port, 0);
			int ok = fd >= 0 && !say(fd, "echo") && echo_ok(fd, "child");
			close(fd);
			_exit(ok ? 0 : 1);
		}
		int st;
		if (pid < 0 || waitpid(pid, &st, 0) != pid)
			return fail(t, "fork");
		if (WIFSIGNALED(st))
			return printf("FAIL %s: child %d of %d hung (killed by signal %d)\n", t, i + 1, FORKS, WTERMSIG(st)), 1;
		if (!WIFEXITED(st) || WEXITSTATUS(st))
			return printf("FAIL %s: child %d of %d could not connect\n", t, i + 1, FORKS), 1;
	}
	__atomic_store_n(&looping, 0, __ATOMIC_SEQ_CST);
	pthread_join(th, NULL);
	if (!echo_ok(kept, "after the forks"))
		return fail(t, "the parent's connection after the forks");
	close(kept);
	if (!idle_ok(t))
		return 1;
	int fd = dial(ip, port, 0);
	if (fd < 0 || say(fd, "echo") || !echo_ok(fd, "after the forks"))
		return fail(t, "a new connection after the forks");
	close(fd);
	printf("PASS %s (%d children; %d connections meanwhile)\n", t, FORKS, loops);
	return 0;
}

