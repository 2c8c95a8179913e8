/* edge_fork.c: real servers' fork models under the library (docs/preload.md,
 * Rules: fork), each side bounded by an alarm and printing what it saw on
 * failure.
 *
 *   edge forkserver IP PORT [keep|parentio|inetd]
 *                            accept, fork at once; the parent closes its
 *                            copy (after KEEP_MS, after writing "P"); the
 *                            child reads the test name and echoes, or (inetd)
 *                            dup2s it onto 0 and 1 and execs /bin/cat
 *   edge prefork IP PORT     listen, fork PREFORK workers that accept on the
 *                            shared listener; each answers its pid, then
 *                            echoes
 *   edge reuseport IP PORT   the same, but each worker makes its own
 *                            SO_REUSEPORT listener (two, and closes one)
 *
 * Client tests: afork (16 MiB echoed by the forked child, checked byte by
 * byte), aforkkeep (the same once the parent that held it too is gone),
 * aforkp (the same after the parent's byte), inetd (the same through
 * /bin/cat), prefork (two connections at
 * once reach both workers), reuseport (two connections to SO_REUSEPORT
 * workers, each on the fast path), forkring (fork while a connection on the rings
 * streams: the children exit without touching it, its bytes are checked),
 * spawnkeep (against "edge spawnserver": the same through a spawned
 * /bin/cat while the server keeps its copy), systemkeep (the same through
 * system(), against "edge systemserver"), forkconnect (fork while a
 * non-blocking connect is under way, then
 * connect() again in both processes, as hiredis does: no OPEN), forkdup
 * (fork inside the open delay with only a dup of the connection in an
 * epoll set: epoll_wait reports it), forkstorm (a thread forks for
 * STORM_MS while others connect, accept, echo, and close sockets under a
 * polling thread: every byte checked, then the process idles and a new
 * connection works). */
#include "edge.h"

#include <spawn.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>

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

/* forkserver: accept, fork at once (socat fork, dropbear, inetd, sshd):
 * the child gets the connection. mode says what the parent does with its
 * copy: "" closes it at once; "keep" keeps it KEEP_MS, then closes it (the
 * child serves on TCP meanwhile, then alone on the fast path); "parentio"
 * writes "P" on it first (two processes used it: TCP for good); "inetd"
 * closes it at once, and the child, without reading, dup2s it onto 0 and 1
 * and execs /bin/cat. Without "inetd" the child reads the test's name,
 * then echoes. The connection is young at the fork (inside the open
 * delay): both processes hold it, and the child OPENs it once alone
 * (share.c). */
#define KEEP_MS 100

int forkserver(const char *ip, int port, const char *mode)
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
			if (!strcmp(mode, "inetd")) {
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
			char name[80];
			read_name(c, name, sizeof name);
			echo_all(c);
			close(c);
			_exit(0);
		}
		if (!strcmp(mode, "keep"))
			usleep(KEEP_MS * 1000);
		if (!strcmp(mode, "parentio") && write(c, "P", 1) != 1)
			printf("FAIL parentio-server: write: %s\n", strerror(errno));
		close(c);
	}
}

/* spawnserver: accept, read the test's name, and posix_spawn /bin/cat
 * with the connection as its stdin and stdout (dup2 file actions), while
 * this process keeps its copy until cat exits, well past the open delay
 * (a CGI-style server). The spawn must let the connection go to the
 * kernel first: else this process's library OPENs it, the peer moves to
 * the rings, and cat never sees its bytes. */
static void *spawn_reap(void *arg)
{
	intptr_t v = (intptr_t)arg;
	int c = (int)(v & 0xffff), st;
	waitpid((pid_t)(v >> 16), &st, 0);
	close(c);
	return NULL;
}

/* With shell, the same through system("exec cat <&N >&N") (systemserver):
 * the connection inherited by the shell (no FD_CLOEXEC), and this process
 * keeping its copy until the shell ends. glibc spawns the shell without
 * any hook a preload library sees, so the library lets the connection go
 * in its system() (fork.c), else the peer would move to the rings cat
 * does not read. */
int spawnserver(const char *ip, int port, int shell)
{
	extern char **environ;
	int l = listener(ip, port, 0);
	if (l < 0)
		return 1;
	for (;;) {
		int c = accept(l, NULL, NULL);
		if (c < 0)
			continue;
		char name[80];
		read_name(c, name, sizeof name);
		if (shell) {
			char cmd[64];
			snprintf(cmd, sizeof cmd, "exec cat <&%d >&%d", c, c);
			if (system(cmd) != 0)
				printf("FAIL system-server: %s failed\n", cmd);
			close(c);
			continue;
		}
		posix_spawn_file_actions_t fa;
		posix_spawn_file_actions_init(&fa);
		posix_spawn_file_actions_adddup2(&fa, c, 0);
		posix_spawn_file_actions_adddup2(&fa, c, 1);
		pid_t pid;
		char *argv[] = {"cat", NULL};
		pthread_t th;
		if (posix_spawn(&pid, "/bin/cat", &fa, NULL, argv, environ) ||
		    pthread_create(&th, NULL, spawn_reap, (void *)(((intptr_t)pid << 16) | c)))
			close(c);
		else
			pthread_detach(th);
		posix_spawn_file_actions_destroy(&fa);
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
 * our FIN, and the peer's EOF. inetd's cat echoes our name too; aforkp
 * reads the parent's "P" first; aforkkeep echoes a line, then waits until
 * the parent closed its copy and the child moved to the fast path, so
 * that the stream runs there (the switch mid-stream is the test's). */
static int forked_echo(const char *ip, int port, const char *t)
{
	int fd = named_dial(ip, port, t);
	if (fd < 0)
		return fail(t, "connect");
	char b0[8];
	if (!strcmp(t, "inetd") && (full(fd, b0, 6) != 6 || memcmp(b0, "inetd\n", 6)))
		return fail(t, "cat's echo of our name");
	if (!strcmp(t, "aforkp") && (full(fd, b0, 1) != 1 || b0[0] != 'P'))
		return fail(t, "the parent's P");
	if (!strcmp(t, "aforkkeep")) {
		if (!echo_ok(fd, "while the parent holds it"))
			return fail(t, "echo while the parent holds the connection");
		usleep(3 * KEEP_MS * 1000);
	}
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

/* ---- forks in the windows: connect, delay, OPEN out, READY coming ---- */

/* forkconnect: fork while a non-blocking connect is under way; each
 * process then asks connect() whether it ended (the kernel answers 0
 * once, then EISCONN) and keeps the socket past the open delay. The
 * socket is the kernel's in both: the test's log must show no OPEN. */
static int forkconnect(const char *ip, int port, const char *t)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	inet_pton(AF_INET, ip, &a.sin_addr);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	if (connect(fd, (struct sockaddr *)&a, sizeof a) != -1 || errno != EINPROGRESS)
		return fail(t, "a non-blocking connect did not say EINPROGRESS");
	fflush(stdout);
	pid_t pid = fork();
	if (pid < 0)
		return fail(t, "fork");
	struct pollfd p = {.fd = fd, .events = POLLOUT};
	int r = poll(&p, 1, 5000) == 1 ? connect(fd, (struct sockaddr *)&a, sizeof a) : -2;
	if (r != 0 && !(r == -1 && errno == EISCONN)) {
		printf("FAIL %s: %s: connect again: %d (errno %d %s), want 0 or EISCONN\n", t, pid ? "parent" : "child", r, errno,
		       strerror(errno));
		if (!pid)
			_exit(1);
		return 1;
	}
	usleep(30000); /* past the open delay: an OPEN queued by mistake goes out now */
	if (!pid)
		_exit(0);
	int st;
	if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st))
		return fail(t, "the child");
	int fl = fcntl(fd, F_GETFL);
	fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
	if (write(fd, "echo\n", 5) != 5 || !echo_ok(fd, "after connect again"))
		return fail(t, "echo");
	close(fd);
	printf("PASS %s\n", t);
	return 0;
}

/* forkdup: the connection's only epoll interest is on a dup of its fd
 * when a fork inside the open delay lets it go: epoll_wait must report
 * the echo on the dup (the kernel's set serves it from then on). */
static int forkdup(const char *ip, int port, const char *t)
{
	settle_ms = 0; /* the fork must come inside the open delay */
	int c = dial(ip, port, 0);
	if (c < 0)
		return fail(t, "connect");
	int d = dup(c), ep = epoll_create1(0);
	struct epoll_event ev = {.events = EPOLLIN, .data.fd = d}, out;
	if (d < 0 || ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, d, &ev))
		return fail(t, "dup, epoll");
	fflush(stdout);
	pid_t pid = fork();
	if (pid == 0)
		_exit(0);
	int st;
	if (pid < 0 || waitpid(pid, &st, 0) != pid)
		return fail(t, "fork");
	if (write(c, "echo\nping", 9) != 9)
		return fail(t, "write");
	int n = epoll_wait(ep, &out, 1, READ_BOUND_S * 1000);
	if (n != 1 || out.data.fd != d)
		return printf("FAIL %s: epoll_wait on the dup: %d, want its echo\n", t, n), 1;
	char b[4];
	if (full(d, b, 4) != 4 || memcmp(b, "ping", 4))
		return fail(t, "the echo on the dup");
	close(ep), close(d), close(c);
	printf("PASS %s\n", t);
	return 0;
}

/* forkstorm: a thread forks for STORM_MS (every fourth child connects
 * and echoes on its own) while other threads make connections and keep
 * each a random 0-12 ms (forks land in the open delay, with OPEN out and
 * READY coming, with a reader asleep in recv), echo STORM_BYTES through
 * each, checked; accept and serve connections to this process's own
 * listener; and connect non-blocking while another thread closes the
 * socket at a random moment and a third polls it (settle). Then the
 * process must idle (no thread spins: the open queue is sound) and a new
 * connection must work. A thread that hangs fails the test; with
 * SHUNT_EDGE_GDB=1 gdb prints every thread's stack first. */
#define STORM_MS 3000
#define STORM_BYTES 16384

static volatile int storm_on = 1;
static const char *storm_ip;
static int storm_port, self_port;
static struct sockaddr_in self_addr;
static int storm_bad, storm_conns, storm_forks, storm_closes, storm_accepts;

static int storm_echo(int fd, unsigned seed)
{
	static __thread uint8_t out[STORM_BYTES], in[STORM_BYTES];
	uint64_t x = seed | 1;
	for (int i = 0; i < STORM_BYTES; i++)
		out[i] = pattern(&x);
	if (full_write(fd, (char *)out, STORM_BYTES) != STORM_BYTES || full(fd, (char *)in, STORM_BYTES) != STORM_BYTES)
		return -1;
	return memcmp(in, out, STORM_BYTES) ? 1 : 0;
}

static void *storm_connector(void *arg)
{
	int self = (int)(intptr_t)arg;
	unsigned seed = 0x5eed0300 + self;
	while (__atomic_load_n(&storm_on, __ATOMIC_SEQ_CST)) {
		int fd = socket(AF_INET, SOCK_STREAM, 0);
		struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(storm_port)};
		inet_pton(AF_INET, storm_ip, &a.sin_addr);
		if (self)
			a = self_addr;
		struct timeval tv = {READ_BOUND_S, 0};
		setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
		if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
			printf("FAIL forkstorm: connect: %s\n", strerror(errno));
			__atomic_add_fetch(&storm_bad, 1, __ATOMIC_SEQ_CST);
			close(fd);
			continue;
		}
		usleep(rand_r(&seed) % 12000);
		int r = (self || write(fd, "echo\n", 5) == 5) ? storm_echo(fd, rand_r(&seed)) : -1;
		if (r) {
			printf("FAIL forkstorm: %s connection: %s\n", self ? "self" : "server", r < 0 ? strerror(errno) : "bytes differ");
			__atomic_add_fetch(&storm_bad, 1, __ATOMIC_SEQ_CST);
		} else {
			__atomic_add_fetch(&storm_conns, 1, __ATOMIC_SEQ_CST);
		}
		close(fd);
	}
	return NULL;
}

static void *storm_acceptor(void *arg)
{
	int l = (int)(intptr_t)arg;
	for (;;) {
		int c = accept(l, NULL, NULL);
		if (c < 0)
			return NULL; /* the listener was shut down */
		struct timeval tv = {READ_BOUND_S, 0};
		setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
		char buf[STORM_BYTES];
		if (full(c, buf, STORM_BYTES) == STORM_BYTES)
			full_write(c, buf, STORM_BYTES);
		close(c);
		__atomic_add_fetch(&storm_accepts, 1, __ATOMIC_SEQ_CST);
	}
}

/* The closer hands a connecting socket to a poller and closes it at a
 * random moment; the next socket is made only once the poller has let go
 * of the number. */
static int close_fd = -1;
static sem_t close_go, close_done;

static void *storm_poller(void *arg)
{
	(void)arg;
	for (;;) {
		sem_wait(&close_go);
		int fd = __atomic_load_n(&close_fd, __ATOMIC_SEQ_CST);
		if (fd == -1)
			return NULL; /* the end; -2: closed already */
		while (fd >= 0 && __atomic_load_n(&close_fd, __ATOMIC_SEQ_CST) == fd) {
			struct pollfd p = {.fd = fd, .events = POLLOUT};
			poll(&p, 1, 0); /* settles it: OPEN queued */
		}
		sem_post(&close_done);
	}
}

static void *storm_closer(void *arg)
{
	(void)arg;
	unsigned seed = 0x5eed0400;
	while (__atomic_load_n(&storm_on, __ATOMIC_SEQ_CST)) {
		int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
		struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(storm_port)};
		inet_pton(AF_INET, storm_ip, &a.sin_addr);
		connect(fd, (struct sockaddr *)&a, sizeof a);
		__atomic_store_n(&close_fd, fd, __ATOMIC_SEQ_CST);
		sem_post(&close_go);
		usleep(rand_r(&seed) % 1500);
		close(fd);
		__atomic_store_n(&close_fd, -2, __ATOMIC_SEQ_CST);
		sem_wait(&close_done);
		storm_closes++;
	}
	__atomic_store_n(&close_fd, -1, __ATOMIC_SEQ_CST);
	sem_post(&close_go);
	return NULL;
}

/* wait_child waits for pid to end, for at most READ_BOUND_S (a child
 * stuck in the library's fork handler never reaches its alarm): its
 * status, or -1 after killing it. */
static int wait_child(pid_t pid)
{
	int st, pfd = (int)syscall(SYS_pidfd_open, pid, 0);
	struct pollfd p = {.fd = pfd, .events = POLLIN};
	if (pfd >= 0 && poll(&p, 1, READ_BOUND_S * 1000) != 1) {
		kill(pid, SIGKILL);
		waitpid(pid, &st, 0);
		close(pfd);
		return -1;
	}
	if (pfd >= 0)
		close(pfd);
	return waitpid(pid, &st, 0) == pid ? st : -1;
}

static void *storm_forker(void *arg)
{
	(void)arg;
	while (__atomic_load_n(&storm_on, __ATOMIC_SEQ_CST)) {
		pid_t pid = fork();
		if (pid == 0) {
			alarm(READ_BOUND_S);
			if (storm_forks % 4)
				_exit(0);
			settle_ms = 0;
			int fd = dial(storm_ip, storm_port, 0);
			_exit(fd >= 0 && write(fd, "echo\n", 5) == 5 && echo_ok(fd, "child") ? 0 : 1);
		}
		int st = pid < 0 ? -1 : wait_child(pid);
		if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st)) {
			printf("FAIL forkstorm: child %d: %s\n", storm_forks, pid < 0 ? "fork failed" : "hung or failed");
			__atomic_add_fetch(&storm_bad, 1, __ATOMIC_SEQ_CST);
		}
		storm_forks++;
	}
	return NULL;
}

/* idle_ok: the process, with nothing to do, uses almost no CPU (a thread
 * that spins, as the leaver did on a corrupt open queue, fails it). */
int idle_ok(const char *t)
{
	struct rusage a, b;
	getrusage(RUSAGE_SELF, &a);
	usleep(300000);
	getrusage(RUSAGE_SELF, &b);
	long us = (b.ru_utime.tv_sec - a.ru_utime.tv_sec + b.ru_stime.tv_sec - a.ru_stime.tv_sec) * 1000000L +
		  (b.ru_utime.tv_usec - a.ru_utime.tv_usec) + (b.ru_stime.tv_usec - a.ru_stime.tv_usec);
	if (us > 100000) {
		printf("FAIL %s: idle for 300 ms, the process used %ld ms of CPU (a thread spins)\n", t, us / 1000);
		return 0;
	}
	return 1;
}

static int forkstorm(const char *ip, int port, const char *t)
{
	storm_ip = ip, storm_port = port;
	/* This process's own listener, on the address it reaches the server from. */
	int probe = dial(ip, port, 0);
	socklen_t sl = sizeof self_addr;
	if (probe < 0 || getsockname(probe, (struct sockaddr *)&self_addr, &sl))
		return fail(t, "connect");
	close(probe);
	self_addr.sin_port = 0;
	int l = socket(AF_INET, SOCK_STREAM, 0);
	if (bind(l, (struct sockaddr *)&self_addr, sizeof self_addr) || listen(l, 64) || getsockname(l, (struct sockaddr *)&self_addr, &sl))
		return fail(t, "listen");
	self_port = ntohs(self_addr.sin_port);
	sem_init(&close_go, 0, 0);
	sem_init(&close_done, 0, 0);
	pthread_t th[6];
	void *(*fn[6])(void *) = {storm_forker, storm_connector, storm_connector, storm_acceptor, storm_poller, storm_closer};
	void *args[6] = {NULL, (void *)0, (void *)1, (void *)(intptr_t)l, NULL, NULL};
	for (int i = 0; i < 6; i++)
		if (pthread_create(&th[i], NULL, fn[i], args[i]))
			return fail(t, "thread");
	static const char *names[6] = {"forker", "connector", "self-connector", "acceptor", "poller", "closer"};
	usleep(STORM_MS * 1000);
	__atomic_store_n(&storm_on, 0, __ATOMIC_SEQ_CST);
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += READ_BOUND_S + 2;
	for (int i = 0; i < 6; i++) {
		if (i == 3)
			shutdown(l, SHUT_RDWR);
		if (pthread_timedjoin_np(th[i == 3 ? 5 : i == 5 ? 3 : i], NULL, &until)) {
			printf("FAIL %s: the %s thread hangs\n", t, names[i == 3 ? 5 : i == 5 ? 3 : i]);
			if (getenv("SHUNT_EDGE_GDB")) {
				char cmd[128];
				fflush(stdout);
				snprintf(cmd, sizeof cmd, "gdb -batch -p %d -ex 'thread apply all bt' 2>&1", (int)getpid());
				system(cmd);
			}
			return 1;
		}
	}
	close(l);
	if (storm_bad)
		return printf("FAIL %s: %d failures (above)\n", t, storm_bad), 1;
	if (!storm_conns || !storm_forks || !storm_closes)
		return printf("FAIL %s: %d connections, %d forks, %d closes: too few\n", t, storm_conns, storm_forks, storm_closes), 1;
	if (!idle_ok(t))
		return 1;
	settle_ms = 150; /* this one takes the fast path */
	int fd = dial(ip, port, 0);
	if (fd < 0 || write(fd, "echo\n", 5) != 5 || storm_echo(fd, 0x5eed0500) || !echo_ok(fd, "after the storm"))
		return fail(t, "a connection after the storm");
	close(fd);
	printf("PASS %s (%d forks, %d connections, %d accepted, %d closed while connecting)\n", t, storm_forks, storm_conns,
	       storm_accepts, storm_closes);
	return 0;
}

int fork_client(const char *ip, int port, const char *t)
{
	alarm(FORK_BOUND_S);
	signal(SIGPIPE, SIG_IGN);
	if (!strcmp(t, "afork") || !strcmp(t, "aforkkeep") || !strcmp(t, "aforkp") || !strcmp(t, "inetd") ||
	    !strcmp(t, "spawnkeep") || !strcmp(t, "systemkeep")) {
		settle_ms = 0; /* the name goes at once: the server forks well inside the open delay */
		return forked_echo(ip, port, t);
	}
	if (!strcmp(t, "prefork") || !strcmp(t, "reuseport"))
		return prefork_client(ip, port, t);
	if (!strcmp(t, "forkconnect"))
		return forkconnect(ip, port, t);
	if (!strcmp(t, "forkdup"))
		return forkdup(ip, port, t);
	if (!strcmp(t, "forkstorm"))
		return forkstorm(ip, port, t);
	return forkring(ip, port, t);
}
