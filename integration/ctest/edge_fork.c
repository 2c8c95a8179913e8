/* edge_fork.c: real servers' fork models under the library (docs/preload.md,
 * Rules: fork), each side bounded by an alarm and printing what it saw on
 * failure.
 *
 *   edge forkserver IP PORT  accept, fork at once, the parent closes its
 *                            copy; the child reads the test name and serves:
 *                            afork (echo), inetd (dup2 onto 0 and 1, exec
 *                            /bin/cat)
 *   edge prefork IP PORT     listen, fork PREFORK workers that accept on the
 *                            shared listener; each answers its pid, then
 *                            echoes
 *   edge reuseport IP PORT   the same, but each worker makes its own
 *                            SO_REUSEPORT listener (two, and closes one)
 *
 * Client tests: afork (16 MiB echoed by the forked child, checked byte by
 * byte), inetd (the same through /bin/cat), prefork (two connections at
 * once reach both workers), reuseport (two connections to SO_REUSEPORT
 * workers, each on the fast path), forkring (fork while a connection on the rings
 * streams: the children exit without touching it, its bytes are checked). */
#include "edge.h"

#include <sys/prctl.h>

#define FORK_BOUND_S 30       /* every process of these tests ends by then (the test's own bound is 60 s) */
#define READ_BOUND_S 10       /* a client's read that waits longer fails and says what it saw */
#define STREAM_BYTES (16 << 20) /* afork, inetd */
#define PREFORK 2
#define RING_FORKS 5          /* forkring: children forked while the stream runs */

/* ---- a seeded stream, checked as it comes back ---- */

static uint8_t pattern(uint64_t *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return (uint8_t)*x;
}

struct stream {
	int fd;
	size_t n;
	uint64_t seed;
	size_t sent;
	int err; /* the writer's errno, 0 if it wrote all */
	int fork_every; /* > 0: fork a child that exits at once after this many chunks (forkring) */
	int forks;
};

static void *writer(void *arg)
{
	struct stream *s = arg;
	uint64_t x = s->seed;
	uint8_t buf[65536];
	int chunks = 0;
	while (s->sent < s->n) {
		size_t k = s->n - s->sent < sizeof buf ? s->n - s->sent : sizeof buf;
		for (size_t i = 0; i < k; i++)
			buf[i] = pattern(&x);
		size_t off = 0;
		while (off < k) {
			ssize_t w = write(s->fd, buf + off, k - off);
			if (w <= 0) {
				s->err = w < 0 ? errno : EIO;
				return NULL;
			}
			off += w;
			s->sent += w;
		}
		if (s->fork_every && ++chunks % s->fork_every == 0 && s->forks < RING_FORKS) {
			pid_t pid = fork();
			if (pid == 0)
				_exit(0); /* a helper that never touches the connection */
			if (pid < 0 || waitpid(pid, NULL, 0) != pid) {
				s->err = ECHILD;
				return NULL;
			}
			s->forks++;
		}
	}
	return NULL;
}

/* echo_stream writes n seeded bytes on fd from a thread and checks the
 * echo as it reads it: 0, or 1 after printing where it went wrong. */
static int echo_stream(int fd, size_t n, uint64_t seed, int fork_every, const char *t)
{
	struct stream s = {.fd = fd, .n = n, .seed = seed, .fork_every = fork_every};
	pthread_t th;
	if (pthread_create(&th, NULL, writer, &s))
		return fail(t, "thread");
	uint64_t x = seed;
	uint8_t buf[65536];
	size_t got = 0;
	int bad = 0;
	while (got < n && !bad) {
		ssize_t k = read(fd, buf, sizeof buf);
		if (k <= 0) {
			printf("FAIL %s: read %zd (errno %d %s) after %zu of %zu bytes; the writer sent %zu (errno %d)\n", t, k,
			       errno, strerror(errno), got, n, s.sent, s.err);
			bad = 1;
			break;
		}
		for (ssize_t i = 0; i < k; i++)
			if (buf[i] != pattern(&x)) {
				printf("FAIL %s: byte %zu differs (lost, duplicated or reordered); the writer sent %zu\n", t,
				       got + i, s.sent);
				bad = 1;
				break;
			}
		got += k;
	}
	if (bad)
		shutdown(fd, SHUT_RDWR); /* the writer must not block for ever */
	pthread_join(th, NULL);
	if (!bad && s.err)
		return printf("FAIL %s: write: errno %d %s after %zu bytes\n", t, s.err, strerror(s.err), s.sent), 1;
	if (!bad && fork_every && s.forks != RING_FORKS)
		return printf("FAIL %s: forked %d children, want %d\n", t, s.forks, RING_FORKS), 1;
	return bad;
}

/* ---- servers ---- */

static int listener(const char *ip, int port, int reuseport)
{
	int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	setsockopt(l, SOL_SOCKET, reuseport ? SO_REUSEPORT : SO_REUSEADDR, &one, sizeof one);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	inet_pton(AF_INET, ip, &a.sin_addr);
	if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 16))
		return perror("listen"), -1;
	return l;
}

static int read_name(int c, char *name, int cap)
{
	int i = 0;
	while (i < cap - 1 && read(c, name + i, 1) == 1 && name[i] != '\n')
		i++;
	name[i] = 0;
	return i;
}

static ssize_t full_write(int fd, const char *buf, size_t n)
{
	size_t off = 0;
	while (off < n) {
		ssize_t w = write(fd, buf + off, n - off);
		if (w <= 0)
			return -1;
		off += w;
	}
	return off;
}

static void echo_all(int c)
{
	char buf[65536];
	ssize_t k;
	while ((k = read(c, buf, sizeof buf)) > 0)
		if (full_write(c, buf, k) != k)
			break;
}

/* forkserver: accept, fork at once (socat fork, inetd, sshd): the child
 * gets the connection, the parent closes its copy. With the open delay
 * the fork comes before any OPEN, so the connection is a plain kernel
 * socket in both (fork.c). */
int forkserver(const char *ip, int port)
{
	int l = listener(ip, port, 0);
	if (l < 0)
		return 1;
	signal(SIGCHLD, SIG_IGN); /* no zombies */
	for (;;) {
		int c = accept(l, NULL, NULL);
		if (c < 0)
			continue;
		pid_t pid = fork();
		if (pid == 0) {
			prctl(PR_SET_PDEATHSIG, SIGKILL);
			alarm(FORK_BOUND_S);
			close(l);
			char name[80];
			read_name(c, name, sizeof name);
			if (!strcmp(name, "inetd")) {
				/* inetd: the connection is the program's stdin and stdout. */
				if (dup2(c, 0) != 0 || dup2(c, 1) != 1) {
					printf("FAIL inetd-server: dup2: %s\n", strerror(errno));
					_exit(1);
				}
				close(c);
				execl("/bin/cat", "cat", (char *)NULL);
				printf("FAIL inetd-server: exec /bin/cat: %s\n", strerror(errno));
				_exit(1);
			}
			echo_all(c);
			close(c);
			_exit(0);
		}
		close(c);
	}
}

/* serve_worker answers a worker's connection: its pid, then an echo. */
static void serve_worker(int c)
{
	char name[80], line[32];
	read_name(c, name, sizeof name);
	int n = snprintf(line, sizeof line, "%d\n", (int)getpid());
	write(c, line, n);
	echo_all(c);
	close(c);
}

static void *worker_thread(void *arg)
{
	serve_worker((int)(intptr_t)arg);
	return NULL;
}

/* prefork: PREFORK workers accept on the listener their parent made (nginx);
 * each connection is its worker's, with the worker's own session, one at a
 * time. With reuseport each worker listens itself, on two SO_REUSEPORT
 * sockets of which it closes one (the other must stay registered with
 * hostd), and serves each connection in a thread: the kernel picks the
 * worker by hash, so both connections may be one worker's. */
int prefork(const char *ip, int port, int reuseport)
{
	int l = reuseport ? -1 : listener(ip, port, 0);
	if (!reuseport && l < 0)
		return 1;
	for (int i = 0; i < PREFORK; i++) {
		pid_t pid = fork();
		if (pid < 0)
			return perror("fork"), 1;
		if (pid)
			continue;
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (reuseport) {
			l = listener(ip, port, 1);
			int spare = listener(ip, port, 1);
			if (l < 0 || spare < 0)
				_exit(1);
			close(spare);
		}
		for (;;) {
			int c = accept(l, NULL, NULL);
			pthread_t th;
			if (c < 0)
				continue;
			if (!reuseport)
				serve_worker(c);
			else if (pthread_create(&th, NULL, worker_thread, (void *)(intptr_t)c) == 0)
				pthread_detach(th);
			else
				close(c);
		}
	}
	for (;;)
		pause();
}

/* ---- clients ---- */

static int named_dial(const char *ip, int port, const char *t)
{
	int fd = dial(ip, port, 0);
	if (fd < 0)
		return -1;
	struct timeval tv = {READ_BOUND_S, 0};
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	char line[40];
	int n = snprintf(line, sizeof line, "%s\n", t);
	if (write(fd, line, n) != n) {
		close(fd);
		return -1;
	}
	return fd;
}

/* afork, inetd: the forked child (or /bin/cat) echoes STREAM_BYTES; then
 * our FIN, and the peer's EOF. */
static int forked_echo(const char *ip, int port, const char *t)
{
	int fd = named_dial(ip, port, t);
	if (fd < 0)
		return fail(t, "connect");
	if (echo_stream(fd, STREAM_BYTES, 0x5eed0001 + port, 0, t))
		return 1;
	char b;
	ssize_t k = -2;
	if (shutdown(fd, SHUT_WR) || (k = read(fd, &b, 1)) != 0)
		return printf("FAIL %s: after our FIN: read %zd (errno %d %s), want EOF\n", t, k, errno, strerror(errno)), 1;
	close(fd);
	printf("PASS %s (%d MiB echoed)\n", t, STREAM_BYTES >> 20);
	return 0;
}

static int prefork_client(const char *ip, int port, const char *t)
{
	int fd[PREFORK];
	long pid[PREFORK];
	for (int i = 0; i < PREFORK; i++) {
		char line[32] = {0};
		int n = 0;
		fd[i] = named_dial(ip, port, t);
		if (fd[i] < 0)
			return fail(t, "connect");
		while (n < (int)sizeof line - 1 && read(fd[i], line + n, 1) == 1 && line[n] != '\n')
			n++;
		pid[i] = atol(line);
		if (!pid[i])
			return printf("FAIL %s: connection %d: no worker pid (got \"%s\")\n", t, i + 1, line), 1;
		if (!echo_ok(fd[i], "worker"))
			return printf("FAIL %s: connection %d (worker %ld): echo\n", t, i + 1, pid[i]), 1;
	}
	if (pid[0] == pid[1] && strcmp(t, "reuseport")) /* the kernel spreads reuseport connections by hash */
		return printf("FAIL %s: both connections reached worker %ld\n", t, pid[0]), 1;
	for (int i = 0; i < PREFORK; i++) {
		if (echo_stream(fd[i], 1 << 20, 0x5eed0100 + i, 0, t))
			return printf("FAIL %s: connection %d (worker %ld)\n", t, i + 1, pid[i]), 1;
		close(fd[i]);
	}
	printf("PASS %s (workers %ld and %ld)\n", t, pid[0], pid[1]);
	return 0;
}

/* forkring: a connection on the rings streams while the writer forks
 * helpers that exit at once; the connection stays on the rings (the test
 * reads the -v log) and no byte is lost. */
static int forkring(const char *ip, int port, const char *t)
{
	int fd = named_dial(ip, port, "echo");
	if (fd < 0)
		return fail(t, "connect");
	if (!echo_ok(fd, "before the forks"))
		return fail(t, "echo before the forks");
	if (echo_stream(fd, 8 << 20, 0x5eed0200, 16, t))
		return 1;
	if (!echo_ok(fd, "after the forks"))
		return fail(t, "echo after the forks");
	close(fd);
	printf("PASS %s (%d children forked while 8 MiB streamed)\n", t, RING_FORKS);
	return 0;
}

int fork_client(const char *ip, int port, const char *t)
{
	alarm(FORK_BOUND_S);
	signal(SIGPIPE, SIG_IGN);
	if (!strcmp(t, "afork") || !strcmp(t, "inetd")) {
		settle_ms = 0; /* the name goes at once: the server forks well inside the open delay */
		return forked_echo(ip, port, t);
	}
	if (!strcmp(t, "prefork") || !strcmp(t, "reuseport"))
		return prefork_client(ip, port, t);
	return forkring(ip, port, t);
}
