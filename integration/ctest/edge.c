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
 * programs built with 64-bit file offsets make: fcntl64, sendfile64)
 * rst (the server closes with SO_LINGER {1, 0}: ECONNRESET) unread (the
 * server closes with the client's bytes unread in its ring: ECONNRESET) chk mmsg
 * splice iov (fortified reads, sendmmsg/recvmmsg, splice both ways, IOV_MAX
 * iovecs) rawwrite (a raw write(2) to a fast-path fd: both ends fail with
 * ECONNRESET, none hangs; the server prints "PASS rawwrite-server")
 * connrefused (PORT closed: a non-blocking connect says EINPROGRESS, then
 * POLLERR and ECONNREFUSED in SO_ERROR; a blocking one ECONNREFUSED)
 * uring (after io_uring_setup, connections stay on TCP)
 * waiteintr (a blocked epoll_wait, epoll_pwait, poll, select: EINTR)
 * afork aforkkeep aforkp inetd prefork reuseport forkring forkconnect forkdup forkstorm
 * apacheevent (edge_epoll.c: Apache's event MPM: a worker adds a connection
 * to the listener thread's sleeping set; never the library's tag)
 * rawclose (edge_raw.c: syscall(SYS_close), close_range, raw dup2)
 * bulk4m (edge_vfork.c: 4 MiB through "edge vforkserver" or any echo)
 * settlestorm (edge_locks.c: short connections from 4 threads, libpq's way)
 * nproc lostsession (edge_limits.c: no threads, no session: TCP, said once)
 * spawnkeep systemkeep (fork models and forks in the library's windows, edge_fork.c:
 * against "edge forkserver", "edge prefork", "edge reuseport", "edge
 * spawnserver" and "edge systemserver", the others against the server) */
#include "edge.h"

#include <limits.h>
#include <sys/syscall.h>
#include <sys/uio.h>

/* The fortified reads (glibc declares them only under _FORTIFY_SOURCE). */
extern ssize_t __read_chk(int fd, void *buf, size_t n, size_t buflen);
extern ssize_t __recv_chk(int fd, void *buf, size_t n, size_t buflen, int flags);
extern ssize_t __recvfrom_chk(int fd, void *buf, size_t n, size_t buflen, int flags, struct sockaddr *addr, socklen_t *len);


int fail(const char *t, const char *why)
{
	printf("FAIL %s: %s (errno %d %s)\n", t, why, errno, strerror(errno));
	return 1;
}

int full(int fd, char *buf, int n)
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

void drain(int fd)
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

/* edge_switch.c, when it is linked in (the Makefile's EDGE_SRC). */
int switch_serve(int c, const char *name) __attribute__((weak));
int switch_client(const char *ip, int port, const char *t) __attribute__((weak));

static void serve(int c)
{
	char name[80] = {0};
	int i = 0;
	while (i < 79 && read(c, name + i, 1) == 1 && name[i] != '\n')
		i++;
	name[i] = 0;
	if (switch_serve && switch_serve(c, name))
		return;
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
	} else if (!strcmp(name, "rst")) {
		/* Close with RST: the client's read must fail with ECONNRESET. */
		struct linger lg = {.l_onoff = 1, .l_linger = 0};
		setsockopt(c, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
	} else if (!strcmp(name, "unread")) {
		/* Close with bytes unread: a reset, as the kernel's close does
		 * for its own unread data, ring or not. "k": the name was read;
		 * the client's "r" comes through the ring, "g" says it was read
		 * (so this end's reader is on the ring); then its next bytes
		 * are left unread, and the close must reset. */
		write(c, "k", 1);
		if (read(c, buf, 1) == 1 && buf[0] == 'r' && write(c, "g", 1) == 1) {
			struct pollfd p = {.fd = c, .events = POLLIN};
			poll(&p, 1, 5000);
			usleep(50000); /* all ten bytes, not just the first */
		}
	} else if (!strcmp(name, "rawwrite")) {
		/* The client writes to its fast-path fd with a raw write(2):
		 * the read after "g" must end with an error, not wait for
		 * ever. "k" says the name was read; the client's "r" comes
		 * through the ring, so this end has its rings once it reads
		 * it (before, a raw write could be taken from TCP as part of
		 * the stream: docs/preload.md, the safety net); "g" lets the
		 * client write past its library. */
		write(c, "k", 1);
		struct pollfd p = {.fd = c, .events = POLLIN};
		int ready = poll(&p, 1, 5000), k = ready == 1 ? read(c, buf, 1) : -2;
		int got_r = k == 1 && buf[0] == 'r', e = errno;
		struct timespec t0, t1;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		if (got_r) {
			write(c, "g", 1);
			ready = poll(&p, 1, 5000);
			k = ready == 1 ? read(c, buf, 1) : -2;
			e = errno;
		}
		clock_gettime(CLOCK_MONOTONIC, &t1);
		if (!got_r)
			printf("FAIL rawwrite-server: the client's r: poll %d, read %d (errno %d %s)\n", ready, k, e, strerror(e));
		else if (k == -1 && e == ECONNRESET)
			printf("PASS rawwrite-server (%ld ms)\n", (long)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000));
		else
			printf("FAIL rawwrite-server: poll %d, read %d (errno %d %s), want -1 (ECONNRESET)\n", ready, k, e, strerror(e));
		fflush(stdout);
	} else if (!strcmp(name, "rawclose")) {
		/* Each connection says who it is (8 bytes), then echoes: a
		 * client that reaches an older connection's server reads no
		 * fresh number (edge_raw.c). */
		static int conns;
		int k = snprintf(buf, sizeof buf, "%07d\n", __atomic_add_fetch(&conns, 1, __ATOMIC_SEQ_CST));
		write(c, buf, k);
		while ((k = read(c, buf, sizeof buf)) > 0)
			write(c, buf, k);
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

/* settle_ms: how long dial waits after the connect, for hostd's READY
 * (nothing waits for it any more: a test of the rings must give it time;
 * SHUNT_EDGE_SETTLE_MS, 0 for tests that want the switch itself). */
int settle_ms = 150;

int dial(const char *ip, int port, int nonblock)
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
	if (settle_ms)
		usleep(settle_ms * 1000);
	return fd;
}

int echo_ok(int fd, const char *msg)
{
	char b[64];
	int n = strlen(msg);
	return write(fd, msg, n) == n && full(fd, b, n) == n && !memcmp(b, msg, n);
}

/* connrefused: PORT is closed on the peer. As with plain TCP, a
 * non-blocking connect says EINPROGRESS, then poll (or epoll) reports
 * POLLERR and SO_ERROR holds ECONNREFUSED; a blocking connect fails with
 * ECONNREFUSED at once. */
static int connrefused(const char *ip, int port, const char *t)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	inet_pton(AF_INET, ip, &a.sin_addr);
	for (int use_epoll = 0; use_epoll < 2; use_epoll++) {
		int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
		if (connect(fd, (struct sockaddr *)&a, sizeof a) != -1 || errno != EINPROGRESS)
			return fail(t, "a non-blocking connect to a closed port did not say EINPROGRESS");
		unsigned got;
		if (use_epoll) {
			int ep = epoll_create1(0);
			struct epoll_event ev = {.events = EPOLLOUT, .data.fd = fd}, out;
			if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) || epoll_wait(ep, &out, 1, 5000) != 1)
				return fail(t, "epoll_wait did not report the failed connect");
			got = (out.events & EPOLLERR ? POLLERR : 0) | (out.events & EPOLLHUP ? POLLHUP : 0);
			close(ep);
		} else {
			struct pollfd p = {.fd = fd, .events = POLLOUT};
			if (poll(&p, 1, 5000) != 1)
				return fail(t, "poll did not report the failed connect");
			got = p.revents;
		}
		if (!(got & POLLERR) || !(got & POLLHUP))
			return printf("FAIL %s: %s reported %#x, want POLLERR and POLLHUP\n", t, use_epoll ? "epoll" : "poll", got), 1;
		int err = 0;
		socklen_t l = sizeof err;
		if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l) || err != ECONNREFUSED)
			return printf("FAIL %s: SO_ERROR %d (%s), want ECONNREFUSED\n", t, err, strerror(err)), 1;
		close(fd);
	}
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int r = connect(fd, (struct sockaddr *)&a, sizeof a);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	if (r != -1 || errno != ECONNREFUSED)
		return fail(t, "a blocking connect to a closed port is not ECONNREFUSED");
	if (t1.tv_sec - t0.tv_sec > 1)
		return fail(t, "a blocking connect to a closed port took more than a second");
	close(fd);
	printf("PASS %s\n", t);
	return 0;
}

static int client(const char *ip, int port, const char *t)
{
	if (!strcmp(t, "epollmany") || !strcmp(t, "pollmany"))
		return many(ip, port, t);
	static const char *blocking[] = {"waiteintr", "eintr", "restart", "rcvtimeo", "sigsend", "sndtimeo", "shutwr", "threads", "closewake"};
	for (size_t i = 0; i < sizeof blocking / sizeof *blocking; i++)
		if (!strcmp(t, blocking[i]))
			return signals(ip, port, t);
	if (!strcmp(t, "forkloop"))
		return forkloop(ip, port, t);
	if (!strcmp(t, "afork") || !strcmp(t, "aforkkeep") || !strcmp(t, "aforkp") || !strcmp(t, "inetd") ||
	    !strcmp(t, "prefork") || !strcmp(t, "reuseport") ||
	    !strcmp(t, "forkring") || !strcmp(t, "forkconnect") || !strcmp(t, "forkdup") || !strcmp(t, "forkstorm") ||
	    !strcmp(t, "spawnkeep") || !strcmp(t, "systemkeep"))
		return fork_client(ip, port, t);
	if (!strcmp(t, "connrefused"))
		return connrefused(ip, port, t);
	if (!strcmp(t, "apacheevent"))
		return apache_event(ip, port, t);
	if (!strcmp(t, "rawclose"))
		return raw_fd_calls(ip, port, t);
	if (!strcmp(t, "bulk4m"))
		return bulk_client(ip, port, t);
	if (!strcmp(t, "settlestorm"))
		return settle_storm(ip, port, t);
	if (!strcmp(t, "nproc") || !strcmp(t, "lostsession"))
		return limits_client(ip, port, t);
	if (!strcmp(t, "uring")) {
		/* Fails (no params), but the process has asked for io_uring. */
		long r = syscall(SYS_io_uring_setup, 0, NULL);
		(void)r;
	}
	alarm(10); /* a call that sends past the ring would hang: fail instead */
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
		/* The fd stays open across exec: on the rings the library
		 * resets the connection, so the new image gets an error instead
		 * of writing where nobody reads; on TCP it goes on. */
		signal(SIGPIPE, SIG_IGN);
		char fds[16];
		snprintf(fds, sizeof fds, "%d", fd);
		fflush(stdout);
		execl("/proc/self/exe", "edge", "exec-child", fds, (char *)NULL);
		return fail(t, "exec");
	} else if (!strcmp(t, "revoke")) {
		/* The test deletes the conntrack entry meanwhile: hostd moves
		 * the connection to TCP (DOWN), which goes on. */
		if (!echo_ok(fd, "before"))
			return fail(t, "echo before");
		printf("blocked\n");
		fflush(stdout);
		char go[8];
		if (!fgets(go, sizeof go, stdin))
			return fail(t, "the test's go-ahead");
		if (!echo_ok(fd, "after conntrack -D"))
			return fail(t, "echo after the conntrack entry was deleted");
	} else if (!strcmp(t, "exitopen")) {
		if (write(fd, "bye!", 4) != 4)
			return fail(t, "write");
		printf("PASS %s\n", t);
		fflush(stdout);
		exit(0); /* fd still open: the library's exit path sends FIN */
	} else if (!strcmp(t, "unread")) {
		if (read(fd, b, 1) != 1 || b[0] != 'k' || write(fd, "r", 1) != 1 || read(fd, b, 1) != 1 || b[0] != 'g')
			return fail(t, "the server's go-ahead");
		if (write(fd, "0123456789", 10) != 10)
			return fail(t, "write");
		int n = read(fd, b, 1);
		if (n != -1 || errno != ECONNRESET)
			return printf("FAIL %s: a read after the peer closed with our bytes unread: %d (errno %d %s), want -1 (ECONNRESET)\n",
				      t, n, errno, strerror(errno)), 1;
	} else if (!strcmp(t, "rst")) {
		int n = read(fd, b, 1);
		if (n != -1 || errno != ECONNRESET)
			return fail(t, "a read after the peer's close with SO_LINGER 0 is not ECONNRESET");
	} else if (!strcmp(t, "chk")) {
		struct sockaddr_storage ss;
		socklen_t sl = sizeof ss;
		if (write(fd, "abc", 3) != 3 || __read_chk(fd, b, 3, sizeof b) != 3 || memcmp(b, "abc", 3))
			return fail(t, "__read_chk");
		if (write(fd, "def", 3) != 3 || __recv_chk(fd, b, 3, sizeof b, MSG_WAITALL) != 3 || memcmp(b, "def", 3))
			return fail(t, "__recv_chk");
		if (write(fd, "ghi", 3) != 3 || __recvfrom_chk(fd, b, 3, sizeof b, MSG_WAITALL, (struct sockaddr *)&ss, &sl) != 3 ||
		    memcmp(b, "ghi", 3))
			return fail(t, "__recvfrom_chk");
	} else if (!strcmp(t, "mmsg")) {
		char *words[] = {"one", "two", "three"};
		struct iovec iv[3];
		struct mmsghdr mv[3];
		memset(mv, 0, sizeof mv);
		for (int i = 0; i < 3; i++) {
			iv[i] = (struct iovec){words[i], strlen(words[i])};
			mv[i].msg_hdr.msg_iov = &iv[i];
			mv[i].msg_hdr.msg_iovlen = 1;
		}
		if (sendmmsg(fd, mv, 3, 0) != 3 || mv[2].msg_len != 5)
			return fail(t, "sendmmsg");
		char in[3][8];
		int got = 0;
		while (got < 11) {
			struct iovec ri[3];
			struct mmsghdr rv[3];
			memset(rv, 0, sizeof rv);
			for (int i = 0; i < 3; i++) {
				ri[i] = (struct iovec){in[i], sizeof in[i]};
				rv[i].msg_hdr.msg_iov = &ri[i];
				rv[i].msg_hdr.msg_iovlen = 1;
			}
			int n = recvmmsg(fd, rv, 3, MSG_WAITFORONE, NULL);
			if (n <= 0)
				return fail(t, "recvmmsg");
			for (int i = 0; i < n && got + (int)rv[i].msg_len <= 11; i++) {
				memcpy(b + got, in[i], rv[i].msg_len);
				got += rv[i].msg_len;
			}
		}
		if (memcmp(b, "onetwothree", 11))
			return fail(t, "the bytes through sendmmsg and recvmmsg");
	} else if (!strcmp(t, "splice")) {
		int in[2], out[2];
		if (pipe(in) || pipe(out) || write(in[1], "spliced", 7) != 7)
			return fail(t, "pipe");
		if (splice(in[0], NULL, fd, NULL, 7, 0) != 7)
			return fail(t, "splice from a pipe to the socket");
		int got = 0;
		while (got < 7) {
			ssize_t k = splice(fd, NULL, out[1], NULL, 7 - got, 0);
			if (k <= 0)
				return fail(t, "splice from the socket to a pipe");
			got += k;
		}
		if (full(out[0], b, 7) != 7 || memcmp(b, "spliced", 7))
			return fail(t, "the bytes through splice");
	} else if (!strcmp(t, "iov")) {
		/* IOV_MAX one-byte iovecs each way; one more is EINVAL. */
		static struct iovec iv[IOV_MAX + 1];
		static char out[IOV_MAX + 1], in[IOV_MAX + 1];
		for (int i = 0; i <= IOV_MAX; i++) {
			out[i] = 'a' + i % 26;
			iv[i] = (struct iovec){&out[i], 1};
		}
		if (writev(fd, iv, IOV_MAX + 1) != -1 || errno != EINVAL)
			return fail(t, "writev with IOV_MAX + 1 iovecs is not EINVAL");
		if (writev(fd, iv, IOV_MAX) != IOV_MAX)
			return fail(t, "writev with IOV_MAX iovecs");
		for (int i = 0; i <= IOV_MAX; i++)
			iv[i] = (struct iovec){&in[i], 1};
		int got = 0;
		while (got < IOV_MAX) {
			ssize_t k = readv(fd, iv + got, IOV_MAX - got);
			if (k <= 0)
				return fail(t, "readv");
			got += k;
		}
		if (memcmp(in, out, IOV_MAX))
			return fail(t, "the bytes through writev and readv");
	} else if (!strcmp(t, "rawwrite")) {
		/* Past the library while the writer is on the ring: the bytes
		 * land on the kernel socket, out of the stream's order. The
		 * ring is given time to come (READY), one byte through the
		 * library moves the writer there, and the server's "g" says
		 * it read that byte (so its reader is on the ring too). */
		if (read(fd, b, 1) != 1 || b[0] != 'k')
			return fail(t, "the server's go-ahead");
		usleep(1000000);
		if (write(fd, "r", 1) != 1)
			return fail(t, "write through the library");
		if (read(fd, b, 1) != 1 || b[0] != 'g')
			return fail(t, "the server's g");
		if (syscall(SYS_write, fd, "raw", 3) != 3)
			return fail(t, "raw write");
		alarm(0);
		struct pollfd p = {.fd = fd, .events = POLLIN};
		int ready = poll(&p, 1, 5000);
		int n = ready == 1 ? read(fd, b, 1) : -2;
		if (n != -1 || errno != ECONNRESET)
			return printf("FAIL %s: after a raw write: poll %d, read %d (errno %d %s), want -1 (ECONNRESET)\n", t,
				      ready, n, errno, strerror(errno)), 1;
	} else if (!strcmp(t, "uring")) {
		if (!echo_ok(fd, "after io_uring"))
			return fail(t, "echo");
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
	const char *st = getenv("SHUNT_EDGE_SETTLE_MS");
	if (st && *st)
		settle_ms = atoi(st);
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
	if (argc == 4 && (!strcmp(argv[1], "spawnserver") || !strcmp(argv[1], "systemserver")))
		return spawnserver(argv[2], atoi(argv[3]), !strcmp(argv[1], "systemserver"));
	if (argc == 6 && !strcmp(argv[1], "vforkserver"))
		return vfork_server(argv[2], atoi(argv[3]), argv[4], atoi(argv[5]));
	if ((argc == 4 || argc == 5) && !strcmp(argv[1], "forkserver"))
		return forkserver(argv[2], atoi(argv[3]), argc == 5 ? argv[4] : "");
	if (argc == 4 && (!strcmp(argv[1], "prefork") || !strcmp(argv[1], "reuseport")))
		return prefork(argv[2], atoi(argv[3]), !strcmp(argv[1], "reuseport"));
	if (argc == 3 && !strcmp(argv[1], "exec-child")) {
		int fd = atoi(argv[2]);
		usleep(10000);
		char b[16];
		if (write(fd, "after exec", 10) == 10) { /* on TCP at exec: it goes on, in order */
			if (full(fd, b, 10) != 10 || memcmp(b, "after exec", 10))
				return fail("exec", "a connection on TCP across exec lost or reordered bytes");
		} else if (errno != EPIPE && errno != ECONNRESET) {
			return fail("exec", "a write after exec of a connection on the rings did not fail (EPIPE or ECONNRESET)");
		}
		printf("PASS exec\n");
		return 0;
	}
	if (argc == 5 && !strcmp(argv[1], "client") && switch_client && (!strncmp(argv[4], "stream", 6) || !strcmp(argv[4], "nbconnect") ||
	    !strcmp(argv[4], "shortconns") || !strcmp(argv[4], "closeunwatched")))
		return switch_client(argv[2], atoi(argv[3]), argv[4]);
	if (argc == 5 && !strcmp(argv[1], "client"))
		return client(argv[2], atoi(argv[3]), argv[4]);
	fprintf(stderr, "usage: edge server|forkserver|prefork|reuseport IP PORT | edge client IP PORT TEST\n");
	return 2;
}
