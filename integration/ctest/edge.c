/* edge: socket semantics that preload libraries often get wrong, checked
 * under shunt-run against plain TCP behaviour (preload_test.go runs it).
 *
 *   edge server IP PORT         serve every test's server side
 *   edge client IP PORT TEST    run one test's client side; prints PASS/FAIL
 *
 * Tests: peek waitall halfclose dup nonblock epoll nested fork exec revoke plain
 * exitopen (the server prints "PASS exitopen-server" or FAIL for that one)
 * epollmany pollmany (MANY connections; each prints MANY -v lines)
 * eintr restart rcvtimeo threads closewake (a call blocked in one thread,
 * acted on from another: signals, timeouts, shutdown, close)
 * sigsend sndtimeo shutwr (the same for a send on a full ring; a second
 * connection lets the server read) forkloop (fork while another thread
 * connects; FORKS children connect) nonblock64 sendfile64 (the calls
 * programs built with 64-bit file offsets make: fcntl64, sendfile64) */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* epollmany, pollmany: fast-path connections in one wait set. More than a
 * wait once watched (64 rings; data on the others slept until the
 * timeout), and more than one futex_waitv call takes (127 rings). */
#define MANY 200

static int fail(const char *t, const char *why)
{
	printf("FAIL %s: %s (errno %d %s)\n", t, why, errno, strerror(errno));
	return 1;
}

static int full(int fd, char *buf, int n)
{
	int got = 0;
	while (got < n) {
		int k = read(fd, buf + got, n - got);
		if (k <= 0)
			return k < 0 ? -1 : got;
		got += k;
	}
	return got;
}

static void drain(int fd)
{
	char b[4096];
	while (read(fd, b, sizeof b) > 0)
		;
}

/* sink connections wait for a release connection before they read:
 * the client fills its ring and blocks in send meanwhile. */
static pthread_mutex_t sink_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sink_cv = PTHREAD_COND_INITIALIZER;
static unsigned releases;
#define SINK_WAIT_S 10 /* a sink reads anyway after this long */

static void sink(int c)
{
	pthread_mutex_lock(&sink_mu);
	unsigned seen = releases;
	pthread_mutex_unlock(&sink_mu);
	write(c, "k", 1); /* it reads nothing more until released */
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += SINK_WAIT_S;
	pthread_mutex_lock(&sink_mu);
	while (releases == seen && pthread_cond_timedwait(&sink_cv, &sink_mu, &until) == 0)
		;
	pthread_mutex_unlock(&sink_mu);
	drain(c);
}

static void serve(int c)
{
	char name[32] = {0};
	int i = 0;
	while (i < 31 && read(c, name + i, 1) == 1 && name[i] != '\n')
		i++;
	name[i] = 0;
	char buf[65536];
	if (!strcmp(name, "peek")) {
		write(c, "hello", 5);
		drain(c);
	} else if (!strcmp(name, "waitall")) {
		memset(buf, 'w', 1000);
		for (int k = 0; k < 10; k++) {
			write(c, buf, 1000);
			usleep(2000);
		}
		drain(c);
	} else if (!strcmp(name, "halfclose") || !strcmp(name, "sendfile64")) {
		int n = 0, k;
		while ((k = read(c, buf, sizeof buf)) > 0)
			n += k;
		int m = snprintf(buf, sizeof buf, "ack:%d", n);
		write(c, buf, m);
	} else if (!strcmp(name, "epoll") || !strcmp(name, "nested")) {
		usleep(50000);
		write(c, "x", 1);
		usleep(200000);
		write(c, "y", 1);
		drain(c);
	} else if (!strcmp(name, "revoke")) {
		drain(c);
	} else if (!strcmp(name, "cmd")) {
		/* Commands: x sends "x", h sends "hello"; other bytes are
		 * ignored. */
		char cmd;
		while (read(c, &cmd, 1) == 1)
			if (cmd == 'x')
				write(c, "x", 1);
			else if (cmd == 'h')
				write(c, "hello", 5);
	} else if (!strcmp(name, "sink")) {
		sink(c);
	} else if (!strcmp(name, "release")) {
		pthread_mutex_lock(&sink_mu);
		releases++;
		pthread_cond_broadcast(&sink_cv);
		pthread_mutex_unlock(&sink_mu);
	} else if (!strcmp(name, "exitopen")) {
		/* The client exits without close(): as with kernel TCP, we must
		 * read its bytes and then EOF, not ECONNRESET. */
		int got = full(c, buf, 4);
		int eof = got == 4 ? read(c, buf + 4, 1) : -2;
		if (got == 4 && !memcmp(buf, "bye!", 4) && eof == 0)
			printf("PASS exitopen-server\n");
		else
			printf("FAIL exitopen-server: got %d bytes, then %d (errno %d %s)\n", got, eof, errno, strerror(errno));
		fflush(stdout);
	} else if (!strcmp(name, "many")) {
		/* One of MANY connections: on "d", answer after a while (the
		 * client is asleep in its wait by then). */
		char cmd;
		while (read(c, &cmd, 1) == 1)
			if (cmd == 'd') {
				usleep(200000);
				write(c, "x", 1);
			}
	} else { /* dup nonblock fork plain: echo */
		int k;
		while ((k = read(c, buf, sizeof buf)) > 0)
			write(c, buf, k);
	}
	close(c);
}

static void *serve_thread(void *arg)
{
	serve((int)(intptr_t)arg);
	return NULL;
}

static int dial(const char *ip, int port, int nonblock)
{
	int fd = socket(AF_INET, SOCK_STREAM | (nonblock ? SOCK_NONBLOCK : 0), 0);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	inet_pton(AF_INET, ip, &a.sin_addr);
	int r = connect(fd, (struct sockaddr *)&a, sizeof a);
	if (r < 0 && !(nonblock && errno == EINPROGRESS))
		return -1;
	if (r < 0) {
		struct pollfd p = {.fd = fd, .events = POLLOUT};
		if (poll(&p, 1, 5000) != 1)
			return -1;
		int err = 0;
		socklen_t l = sizeof err;
		getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l);
		if (err)
			return errno = err, -1;
	}
	return fd;
}

static int echo_ok(int fd, const char *msg)
{
	char b[64];
	int n = strlen(msg);
	return write(fd, msg, n) == n && full(fd, b, n) == n && !memcmp(b, msg, n);
}

/* many: MANY connections in one epoll set (or poll set); data arrives on
 * the last while the client sleeps in the wait, which must return with
 * that fd ready. The wait has no timeout, as in a server; a wait that
 * sleeps through the data is killed by SIGALRM after FAIL_AFTER_S. */
#define FAIL_AFTER_S 5
static int many(const char *ip, int port, const char *t)
{
	static int fd[MANY];
	static struct pollfd p[MANY];
	for (int i = 0; i < MANY; i++) {
		if ((fd[i] = dial(ip, port, 0)) < 0)
			return fail(t, "connect");
		if (write(fd[i], "many\n", 5) != 5)
			return fail(t, "send the test name");
		p[i] = (struct pollfd){.fd = fd[i], .events = POLLIN};
	}
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
	int fd, op, flags; /* op: 'r' recv, 's' send, 'S' shutdown(fd, flags) */
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
	c->ret = c->op == 'r' ? recv(c->fd, c->buf, c->n, c->flags)
		 : c->op == 's' ? send(c->fd, c->buf, c->n, c->flags) : shutdown(c->fd, c->flags);
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
 * reads nothing until released). */
static int sink_full(const char *ip, int port)
{
	int fd = dial(ip, port, 0);
	char k, buf[4096] = {0};
	if (fd < 0 || say(fd, "sink") || read(fd, &k, 1) != 1 || k != 'k')
		return -1;
	for (int i = 0; i < 1 << 16; i++)
		if (send(fd, buf, sizeof buf, MSG_DONTWAIT) < 0)
			return errno == EAGAIN ? fd : -1;
	errno = ENOBUFS;
	return -1; /* a 256 MiB ring? */
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

static int signals(const char *ip, int port, const char *t)
{
	sem_init(&handled, 0, 0);
	signal(SIGPIPE, SIG_IGN);
	int fd = -1;
	static struct call c;
	if (!strcmp(t, "eintr")) {
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
 * TCP) and exit; one that hangs is killed by its alarm. */
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

static int forkloop(const char *ip, int port, const char *t)
{
	loop_ip = ip, loop_port = port;
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
	printf("PASS %s (%d children; %d connections meanwhile)\n", t, FORKS, loops);
	return 0;
}

static int client(const char *ip, int port, const char *t)
{
	if (!strcmp(t, "epollmany") || !strcmp(t, "pollmany"))
		return many(ip, port, t);
	static const char *blocking[] = {"eintr", "restart", "rcvtimeo", "sigsend", "sndtimeo", "shutwr", "threads", "closewake"};
	for (size_t i = 0; i < sizeof blocking / sizeof *blocking; i++)
		if (!strcmp(t, blocking[i]))
			return signals(ip, port, t);
	if (!strcmp(t, "forkloop"))
		return forkloop(ip, port, t);
	int fd = dial(ip, port, !strcmp(t, "nonblock"));
	if (fd < 0)
		return fail(t, "connect");
	/* write(), not dprintf: glibc's stdio writes with an internal call that
	 * no preload library can see (docs/preload.md). */
	char line[40];
	int ln = snprintf(line, sizeof line, "%s\n", t);
	if (write(fd, line, ln) != ln)
		return fail(t, "send the test name");
	char b[65536];
	if (!strcmp(t, "peek")) {
		if (full(fd, b, 0) < 0 || recv(fd, b, 5, MSG_PEEK | MSG_WAITALL) != 5 || memcmp(b, "hello", 5))
			return fail(t, "MSG_PEEK did not return the data");
		memset(b, 0, 5);
		if (recv(fd, b, 5, 0) != 5 || memcmp(b, "hello", 5))
			return fail(t, "data after peek");
		int flags = fcntl(fd, F_GETFL);
		fcntl(fd, F_SETFL, flags | O_NONBLOCK);
		if (recv(fd, b, 5, 0) != -1 || errno != EAGAIN)
			return fail(t, "non-blocking recv on an empty connection is not EAGAIN");
		if (recv(fd, b, 5, MSG_DONTWAIT) != -1 || errno != EAGAIN)
			return fail(t, "MSG_DONTWAIT");
	} else if (!strcmp(t, "waitall")) {
		if (recv(fd, b, 10000, MSG_WAITALL) != 10000)
			return fail(t, "MSG_WAITALL returned short");
	} else if (!strcmp(t, "halfclose")) {
		write(fd, "bye", 3);
		if (shutdown(fd, SHUT_WR) < 0)
			return fail(t, "shutdown");
		int n = read(fd, b, sizeof b - 1);
		b[n > 0 ? n : 0] = 0;
		if (n <= 0 || strcmp(b, "ack:3"))
			return fail(t, "no answer after half-close");
		if (read(fd, b, 1) != 0)
			return fail(t, "no EOF after the peer closed");
		signal(SIGPIPE, SIG_IGN);
	} else if (!strcmp(t, "dup")) {
		int d = dup(fd);
		int d2 = fcntl(fd, F_DUPFD_CLOEXEC, 100);
		close(fd);
		if (!echo_ok(d, "via dup") || !echo_ok(d2, "via F_DUPFD"))
			return fail(t, "I/O through a duplicate after closing the original");
		int d3 = dup2(d2, 50);
		close(d2);
		close(d);
		if (d3 != 50 || !echo_ok(50, "via dup2"))
			return fail(t, "I/O through dup2");
		fd = 50;
	} else if (!strcmp(t, "nonblock64")) {
		/* fcntl64 is fcntl's name under _FILE_OFFSET_BITS=64 (nginx):
		 * a recv on the empty connection must say EAGAIN at once. */
		if (fcntl64(fd, F_SETFL, fcntl64(fd, F_GETFL) | O_NONBLOCK) < 0)
			return fail(t, "fcntl64");
		alarm(5);
		int r = recv(fd, b, 5, 0);
		int e = errno;
		alarm(0);
		if (r != -1 || e != EAGAIN)
			return fail(t, "recv after fcntl64(O_NONBLOCK) is not EAGAIN");
	} else if (!strcmp(t, "sendfile64")) {
		/* nginx with sendfile on: the body must go the way the header
		 * went (the ring), or the peer hangs. */
		char path[] = "/tmp/shunt-edge-XXXXXX";
		int in = mkstemp(path);
		if (in < 0)
			return fail(t, "mkstemp");
		unlink(path);
		for (int i = 0; i < 100; i++) {
			memset(b, 'a' + i % 26, 1000);
			if (write(in, b, 1000) != 1000)
				return fail(t, "write the file");
		}
		off64_t off = 0;
		while (off < 100000) {
			ssize_t k = sendfile64(fd, in, &off, 100000 - off);
			if (k <= 0)
				return fail(t, "sendfile64");
		}
		close(in);
		if (shutdown(fd, SHUT_WR) < 0)
			return fail(t, "shutdown");
		int n = read(fd, b, sizeof b - 1);
		b[n > 0 ? n : 0] = 0;
		if (n <= 0 || strcmp(b, "ack:100000"))
			return fail(t, "the server did not get the file's 100000 bytes");
	} else if (!strcmp(t, "nonblock")) {
		struct pollfd p = {.fd = fd, .events = POLLIN};
		write(fd, "nb", 2);
		if (poll(&p, 1, 5000) != 1 || read(fd, b, 2) != 2 || memcmp(b, "nb", 2))
			return fail(t, "poll/read after a non-blocking connect");
	} else if (!strcmp(t, "epoll") || !strcmp(t, "nested")) {
		int ep = epoll_create1(0), outer = ep;
		struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd}, got[4];
		epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
		int pfd[2];
		pipe(pfd); /* a kernel fd in the same set */
		struct epoll_event pe = {.events = EPOLLIN, .data.fd = pfd[0]};
		epoll_ctl(ep, EPOLL_CTL_ADD, pfd[0], &pe);
		if (!strcmp(t, "nested")) {
			outer = epoll_create1(0);
			struct epoll_event oe = {.events = EPOLLIN, .data.fd = ep};
			epoll_ctl(outer, EPOLL_CTL_ADD, ep, &oe);
		}
		if (epoll_wait(outer, got, 4, 0) != 0)
			return fail(t, "ready before any data");
		int n = epoll_wait(outer, got, 4, 5000);
		if (n != 1 || got[0].data.fd != (outer == ep ? fd : ep))
			return fail(t, "epoll did not report the fast-path fd (or its set)");
		if (read(fd, b, 1) != 1 || b[0] != 'x')
			return fail(t, "read after epoll");
		if (epoll_wait(outer, got, 4, 50) != 0)
			return fail(t, "level-triggered epoll reported a drained fd");
		write(pfd[1], "k", 1);
		n = epoll_wait(outer, got, 4, 1000);
		if (n != 1 || got[0].data.fd != (outer == ep ? pfd[0] : ep))
			return fail(t, "epoll did not report the kernel fd in the same set");
		read(pfd[0], b, 1);
		n = epoll_wait(outer, got, 4, 5000);
		if (n != 1 || read(fd, b, 1) != 1 || b[0] != 'y')
			return fail(t, "second message after blocking in epoll");
	} else if (!strcmp(t, "fork")) {
		pid_t pid = fork();
		if (pid == 0) { /* the child: its inherited copy is not usable */
			int bad = write(fd, "x", 1) != -1 || errno != ENOTCONN;
			close(fd);
			_exit(bad);
		}
		int st;
		waitpid(pid, &st, 0);
		if (!WIFEXITED(st) || WEXITSTATUS(st))
			return fail(t, "the child could use (or broke) the parent's flow");
		if (!echo_ok(fd, "after fork"))
			return fail(t, "the parent's flow after the child closed its copy");
	} else if (!strcmp(t, "exec")) {
		/* The fd stays open across exec: the library resets the flow, so
		 * the new image gets an error instead of writing into the void. */
		signal(SIGPIPE, SIG_IGN);
		char fds[16];
		snprintf(fds, sizeof fds, "%d", fd);
		fflush(stdout);
		execl("/proc/self/exe", "edge", "exec-child", fds, (char *)NULL);
		return fail(t, "exec");
	} else if (!strcmp(t, "revoke")) {
		printf("blocked\n");
		fflush(stdout);
		int n = read(fd, b, 1);
		if (n != -1 || errno != ECONNRESET)
			return fail(t, "a blocked read did not end with ECONNRESET");
	} else if (!strcmp(t, "exitopen")) {
		if (write(fd, "bye!", 4) != 4)
			return fail(t, "write");
		printf("PASS %s\n", t);
		fflush(stdout);
		exit(0); /* fd still open: the library's exit path sends FIN */
	} else if (!strcmp(t, "plain")) {
		if (!echo_ok(fd, "plain tcp"))
			return fail(t, "echo");
	} else {
		return fail(t, "unknown test");
	}
	close(fd);
	printf("PASS %s\n", t);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 4 && !strcmp(argv[1], "server")) {
		int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
		setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
		inet_pton(AF_INET, argv[2], &a.sin_addr);
		if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 16))
			return perror("listen"), 1;
		for (;;) {
			int c = accept(l, NULL, NULL);
			if (c < 0)
				continue;
			pthread_t th; /* a thread per test (not fork: flows stay with the parent) */
			pthread_create(&th, NULL, serve_thread, (void *)(intptr_t)c);
			pthread_detach(th);
		}
	}
	if (argc == 3 && !strcmp(argv[1], "exec-child")) {
		int fd = atoi(argv[2]);
		usleep(10000);
		if (write(fd, "after exec", 10) != -1)
			return fail("exec", "a write after exec went into the kernel socket of a fast-path flow");
		printf("PASS exec\n");
		return 0;
	}
	if (argc == 5 && !strcmp(argv[1], "client"))
		return client(argv[2], atoi(argv[3]), argv[4]);
	fprintf(stderr, "usage: edge server IP PORT | edge client IP PORT TEST\n");
	return 2;
}
