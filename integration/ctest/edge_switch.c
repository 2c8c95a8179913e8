/* edge_switch.c: streams across path switches (issue 11). Both ends send a
 * seeded pseudo-random stream and check the other's byte for byte, while
 * the test's hostd moves the connection between TCP and the rings every
 * few milliseconds: each switch lands at some point of a call (mid-writev,
 * during MSG_PEEK, with bytes pending on both paths, during
 * shutdown(SHUT_WR), in an epoll or poll wait).
 *
 *   stream SEED BYTES    blocking: a writer thread (write, send, writev,
 *                        sendmsg) and a reader (read, recv, readv,
 *                        recvmsg, MSG_PEEK then read, MSG_WAITALL), small
 *                        and large calls; then shutdown(SHUT_WR) and EOF
 *   streamnb SEED BYTES  non-blocking, one thread, epoll (level)
 *   streamet SEED BYTES  non-blocking, edge-triggered epoll
 *   streampoll SEED BYTES non-blocking, poll
 *   nbconnect            a non-blocking connect used at once
 *   shortconns           SHUNT_EDGE_CONNS (1000) short connections in a
 *                        row, as shunt-connrate makes them: connect, 8
 *                        bytes each way ("plain" echo), close. None may
 *                        wait for hostd, even one that stops reading
 *                        its control channel
 *   closeunwatched       a connection on the rings (READY) is dup'd and
 *                        its fd closed: no epoll set of the library may
 *                        still hold that fd (a set polling the socket
 *                        when the last fd closes can hold its release,
 *                        the FIN, until the waiting thread wakes)
 *
 * SHUNT_EDGE_PACE_US (either end's own) makes the writers of the stream
 * tests sleep that long after each call's worth: a stream that lasts, for
 * a test that flips its path meanwhile (TestVsockPreload).
 *
 * The client sends "NAME SEED BYTES\n"; the server plays the same test
 * with the directions swapped. Each prints "PASS NAME sent S received R"
 * or FAIL with the first wrong offset. SHUNT_EDGE_SEED and
 * SHUNT_EDGE_BYTES set the client's parameters. */
#include "edge.h"

#include <sys/uio.h>

#define DEADLINE_S 120
#define BUF 270000 /* the largest call (chunk) */

struct gen {
	uint64_t s;
	uint8_t b[8];
	int have;
};

static void gen_init(struct gen *g, uint64_t seed, int dir)
{
	g->s = seed * 0x9e3779b97f4a7c15ull + (uint64_t)dir * 0xbf58476d1ce4e5b9ull + 1;
	g->have = 0;
}

static uint64_t rnd(uint64_t *s)
{
	*s ^= *s >> 12;
	*s ^= *s << 25;
	*s ^= *s >> 27;
	return *s * 0x2545f4914f6cdd1dull;
}

static void gen_fill(struct gen *g, uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (!g->have) {
			uint64_t v = rnd(&g->s);
			memcpy(g->b, &v, 8);
			g->have = 8;
		}
		p[i] = g->b[8 - g->have--];
	}
}

/* chunk: a call's size: small, medium or large. */
static size_t chunk(uint64_t *s, size_t cap)
{
	uint64_t v = rnd(s);
	size_t n = v % 3 == 0 ? 1 + (v >> 8) % 64 : v % 3 == 1 ? 100 + (v >> 8) % 4000 : 16384 + (v >> 8) % 250000;
	return n < cap ? n : cap;
}

struct side {
	int fd;
	const char *t;
	uint64_t seed;
	size_t bytes;
	int dir;                 /* the stream this end sends */
	size_t sent, got;
	int bad;                 /* a wrong byte, or an error */
	char why[160];
};

static void *writer(void *arg)
{
	struct side *x = arg;
	struct gen g;
	gen_init(&g, x->seed, x->dir);
	uint64_t r = x->seed ^ 0x77;
	uint8_t *buf = malloc(BUF);
	const char *pe = getenv("SHUNT_EDGE_PACE_US");
	long pace = pe && *pe ? atol(pe) : 0;
	while (x->sent < x->bytes) {
		if (pace > 0 && x->sent)
			usleep((useconds_t)pace);
		size_t n = chunk(&r, x->bytes - x->sent);
		gen_fill(&g, buf, n);
		size_t off = 0;
		while (off < n) {
			ssize_t k;
			uint64_t how = rnd(&r) % 4;
			if (how == 2 && n - off >= 3) { /* writev in three pieces: a switch mid-writev */
				size_t a = (n - off) / 3, b = (n - off) / 3;
				struct iovec iov[3] = {{buf + off, a}, {buf + off + a, b}, {buf + off + a + b, n - off - a - b}};
				k = writev(x->fd, iov, 3);
			} else if (how == 3) {
				struct iovec iov = {buf + off, n - off};
				struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
				k = sendmsg(x->fd, &mh, MSG_NOSIGNAL);
			} else if (how == 1) {
				k = send(x->fd, buf + off, n - off, MSG_NOSIGNAL);
			} else {
				k = write(x->fd, buf + off, n - off);
			}
			if (k <= 0) {
				snprintf(x->why, sizeof x->why, "write at %zu: %s", x->sent + off, strerror(errno));
				x->bad = 1;
				free(buf);
				return NULL;
			}
			off += k;
		}
		x->sent += n;
	}
	free(buf);
	if (shutdown(x->fd, SHUT_WR) < 0) { /* while the hostd flips: half-close mid-switch */
		snprintf(x->why, sizeof x->why, "shutdown: %s", strerror(errno));
		x->bad = 1;
	}
	return NULL;
}

/* check compares n received bytes with the peer's stream. */
static int check(struct side *x, struct gen *g, const uint8_t *p, size_t n)
{
	uint8_t want[4096];
	for (size_t i = 0; i < n; i += sizeof want) {
		size_t m = n - i < sizeof want ? n - i : sizeof want;
		gen_fill(g, want, m);
		if (memcmp(want, p + i, m)) {
			size_t j = 0;
			while (want[j] == p[i + j])
				j++;
			snprintf(x->why, sizeof x->why, "byte %zu is %#x, want %#x", x->got + i + j, p[i + j], want[j]);
			x->bad = 1;
			return -1;
		}
	}
	x->got += n;
	return 0;
}

static void *reader(void *arg)
{
	struct side *x = arg;
	struct gen g;
	gen_init(&g, x->seed, !x->dir);
	uint64_t r = x->seed ^ 0x99;
	uint8_t *buf = malloc(BUF), peek[64];
	size_t short_at = (size_t)-1;
	for (;;) {
		size_t n = chunk(&r, BUF);
		uint64_t how = rnd(&r) % 5;
		ssize_t k;
		if (how == 0) { /* peek, then read what it showed: a switch during MSG_PEEK */
			k = recv(x->fd, peek, sizeof peek, MSG_PEEK);
			if (k > 0) {
				ssize_t k2 = read(x->fd, buf, k);
				if (k2 != k || memcmp(buf, peek, k)) {
					snprintf(x->why, sizeof x->why, "read after a peek of %zd at %zu: %zd bytes, %s", k, x->got, k2,
						 k2 == k ? "other bytes" : strerror(errno));
					x->bad = 1;
					goto out;
				}
			}
		} else if (how == 1) {
			size_t want = n < x->bytes - x->got ? n : x->bytes - x->got;
			k = recv(x->fd, buf, want ? want : 1, MSG_WAITALL);
			if (k >= 0 && (size_t)k != want && want)
				short_at = x->got + k; /* only the end (EOF, an error) may cut it short */
		} else if (how == 2) {
			struct iovec iov[2] = {{buf, n / 2 + 1}, {buf + n / 2 + 1, n / 2}};
			k = readv(x->fd, iov, 2);
		} else if (how == 3) {
			struct iovec iov = {buf, n};
			struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
			k = recvmsg(x->fd, &mh, 0);
		} else {
			k = read(x->fd, buf, n);
		}
		if (k < 0) {
			snprintf(x->why, sizeof x->why, "read at %zu: %s", x->got, strerror(errno));
			x->bad = 1;
			goto out;
		}
		if (k == 0)
			break;
		if (short_at != (size_t)-1 && x->got >= short_at) {
			snprintf(x->why, sizeof x->why, "a MSG_WAITALL returned short at %zu, and more came", short_at);
			x->bad = 1;
			goto out;
		}
		if (check(x, &g, buf, k))
			goto out;
	}
	if (x->got != x->bytes) {
		snprintf(x->why, sizeof x->why, "EOF after %zu of %zu bytes", x->got, x->bytes);
		x->bad = 1;
	}
out:
	free(buf);
	return NULL;
}

/* nonblocking plays both directions in one thread: epoll (level or edge)
 * or poll. */
static void nonblocking1(struct side *x, int mode, uint8_t *out, uint8_t *in)
{
	fcntl(x->fd, F_SETFL, fcntl(x->fd, F_GETFL) | O_NONBLOCK);
	int ep = -1, et = mode == 1;
	struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | (et ? EPOLLET : 0), .data.fd = x->fd};
	if (mode < 2) {
		ep = epoll_create1(0);
		epoll_ctl(ep, EPOLL_CTL_ADD, x->fd, &ev);
	}
	struct gen wg, rg;
	gen_init(&wg, x->seed, x->dir);
	gen_init(&rg, x->seed, !x->dir);
	uint64_t r = x->seed ^ 0x55;
	size_t olen = 0, ooff = 0;
	int wdone = 0, eof = 0;
	while (!eof || !wdone) {
		int in_ready = 0, out_ready = 0;
		if (mode < 2) {
			struct epoll_event got[4];
			int k = epoll_wait(ep, got, 4, 10000);
			if (k <= 0) {
				snprintf(x->why, sizeof x->why, "epoll_wait: %d (%s) at sent %zu received %zu", k, strerror(errno), x->sent, x->got);
				x->bad = 1;
				return;
			}
			in_ready = (got[0].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) != 0;
			out_ready = (got[0].events & (EPOLLOUT | EPOLLERR)) != 0;
		} else {
			struct pollfd p = {.fd = x->fd, .events = (eof ? 0 : POLLIN) | (wdone ? 0 : POLLOUT)};
			int k = poll(&p, 1, 10000);
			if (k <= 0) {
				snprintf(x->why, sizeof x->why, "poll: %d (%s) at sent %zu received %zu", k, strerror(errno), x->sent, x->got);
				x->bad = 1;
				return;
			}
			in_ready = (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
			out_ready = (p.revents & (POLLOUT | POLLERR)) != 0;
		}
		while (out_ready && !wdone) { /* until EAGAIN (edge-triggered) */
			if (ooff == olen) {
				if (x->sent == x->bytes) {
					if (shutdown(x->fd, SHUT_WR) < 0) {
						snprintf(x->why, sizeof x->why, "shutdown: %s", strerror(errno));
						x->bad = 1;
						return;
					}
					wdone = 1;
					if (mode < 2) {
						ev.events &= ~EPOLLOUT;
						epoll_ctl(ep, EPOLL_CTL_MOD, x->fd, &ev);
					}
					break;
				}
				olen = chunk(&r, x->bytes - x->sent);
				ooff = 0;
				gen_fill(&wg, out, olen);
			}
			ssize_t k = send(x->fd, out + ooff, olen - ooff, MSG_NOSIGNAL);
			if (k < 0 && errno == EAGAIN)
				break;
			if (k <= 0) {
				snprintf(x->why, sizeof x->why, "send at %zu: %s", x->sent, strerror(errno));
				x->bad = 1;
				return;
			}
			ooff += k;
			if (ooff == olen)
				x->sent += olen;
		}
		while (in_ready && !eof) {
			ssize_t k = recv(x->fd, in, chunk(&r, BUF), 0);
			if (k < 0 && errno == EAGAIN)
				break;
			if (k < 0) {
				snprintf(x->why, sizeof x->why, "recv at %zu: %s", x->got, strerror(errno));
				x->bad = 1;
				return;
			}
			if (k == 0) {
				eof = 1;
				if (mode < 2) {
					ev.events &= ~EPOLLIN;
					epoll_ctl(ep, EPOLL_CTL_MOD, x->fd, &ev);
				}
				break;
			}
			if (check(x, &rg, in, k))
				return;
		}
		if (mode < 2 && eof && wdone)
			break;
	}
	if (x->got != x->bytes) {
		snprintf(x->why, sizeof x->why, "EOF after %zu of %zu bytes", x->got, x->bytes);
		x->bad = 1;
	}
}

static void nonblocking(struct side *x, int mode)
{
	uint8_t *out = malloc(BUF), *in = malloc(BUF);
	nonblocking1(x, mode, out, in);
	free(out);
	free(in);
}

static int play(int fd, const char *t, uint64_t seed, size_t bytes, int dir)
{
	struct side x = {.fd = fd, .t = t, .seed = seed, .bytes = bytes, .dir = dir};
	signal(SIGPIPE, SIG_IGN); /* a peer that dies: EPIPE, reported, not the end of the server */
	if (!dir)
		alarm(DEADLINE_S); /* the client's deadline (the server serves many) */
	if (!strcmp(t, "stream")) {
		pthread_t w, r;
		pthread_create(&w, NULL, writer, &x);
		pthread_create(&r, NULL, reader, &x);
		pthread_join(w, NULL);
		pthread_join(r, NULL);
	} else {
		nonblocking(&x, !strcmp(t, "streamnb") ? 0 : !strcmp(t, "streamet") ? 1 : 2);
	}
	if (x.bad)
		printf("FAIL %s%s: %s (sent %zu, received %zu)\n", t, dir ? "-server" : "", x.why, x.sent, x.got);
	else
		printf("PASS %s%s sent %zu received %zu\n", t, dir ? "-server" : "", x.sent, x.got);
	fflush(stdout);
	close(fd);
	return x.bad;
}

/* switch_serve: the server's side of the tests here (1 if name is one). */
int switch_serve(int c, const char *name)
{
	char t[16];
	unsigned long long seed, bytes;
	if (sscanf(name, "%15s %llu %llu", t, &seed, &bytes) != 3 || strncmp(t, "stream", 6))
		return 0;
	play(c, t, seed, bytes, 1);
	return 1;
}

/* shortconns: connect, "connrate" there and back, close, n times. The
 * fd number of each is the last one's: a late READY, TCP or DOWN for a
 * closed connection must not reach the next. */
static int shortconns(const char *ip, int port, const char *t)
{
	const char *e = getenv("SHUNT_EDGE_CONNS");
	int n = e && *e ? atoi(e) : 1000;
	struct timespec t0, t1, c0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	settle_ms = 0;
	for (int i = 0; i < n; i++) {
		clock_gettime(CLOCK_MONOTONIC, &c0);
		int fd = dial(ip, port, 0);
		if (fd < 0)
			return fail(t, "connect");
		struct timeval tv = {5, 0};
		setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
		char b[8];
		int k = write(fd, "plain\nconnrate", 14) == 14 ? full(fd, b, 8) : -2;
		if (k != 8 || memcmp(b, "connrate", 8)) {
			clock_gettime(CLOCK_MONOTONIC, &t1);
			printf("FAIL %s: connection %d of %d, after %ld ms: %s (errno %d %s)\n", t, i + 1, n,
			       (long)((t1.tv_sec - c0.tv_sec) * 1000 + (t1.tv_nsec - c0.tv_nsec) / 1000000),
			       k == -2 ? "write" : k == 8 ? "the echo differs" : "read the echo", errno, strerror(errno));
			return 1;
		}
		close(fd);
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	printf("PASS %s %d connections in %ld ms\n", t, n, (long)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000));
	return 0;
}

/* in_epoll_set: whether some epoll fd of this process lists fd (its
 * /proc/self/fdinfo "tfd:" lines). */
static int in_epoll_set(int fd)
{
	char path[64], line[256], want[32];
	snprintf(want, sizeof want, "tfd: %8d ", fd);
	for (int e = 0; e < 1024; e++) {
		snprintf(path, sizeof path, "/proc/self/fdinfo/%d", e);
		FILE *f = fopen(path, "r");
		if (!f)
			continue;
		int hit = 0;
		while (fgets(line, sizeof line, f))
			if (!strncmp(line, want, strlen(want)))
				hit = 1;
		fclose(f);
		if (hit)
			return 1;
	}
	return 0;
}

static int closeunwatched(const char *ip, int port, const char *t)
{
	settle_ms = 0;
	int fd = dial(ip, port, 0);
	if (fd < 0)
		return fail(t, "connect");
	char b[8];
	if (write(fd, "plain\nconnrate", 14) != 14 || full(fd, b, 8) != 8)
		return fail(t, "echo");
	/* The library watches a connection's socket once it holds rings. */
	for (int i = 0; i < 2000 && !in_epoll_set(fd); i++)
		usleep(1000);
	if (!in_epoll_set(fd))
		return fail(t, "the connection's socket never showed in an epoll set (no READY?)");
	int d = dup(fd);
	if (d < 0)
		return fail(t, "dup");
	close(fd);
	if (in_epoll_set(fd))
		return fail(t, "a closed fd of a connection is still in an epoll set of the library");
	close(d);
	printf("PASS %s\n", t);
	return 0;
}

int switch_client(const char *ip, int port, const char *t)
{
	if (!strcmp(t, "shortconns"))
		return shortconns(ip, port, t);
	if (!strcmp(t, "closeunwatched"))
		return closeunwatched(ip, port, t);
	if (!strcmp(t, "nbconnect")) {
		/* Used at once: a write before the connect is known to be up
		 * gets the kernel's answer, and the bytes arrive in order. */
		settle_ms = 0; /* used at once */
		int fd = dial(ip, port, 1);
		if (fd < 0)
			return fail(t, "connect");
		const char *msg = "plain\nnb-immediate";
		size_t off = 0, n = strlen(msg);
		while (off < n) {
			ssize_t k = write(fd, msg + off, n - off);
			if (k < 0 && (errno == EAGAIN || errno == ENOTCONN)) {
				struct pollfd p = {.fd = fd, .events = POLLOUT};
				poll(&p, 1, 1000);
				continue;
			}
			if (k <= 0)
				return fail(t, "write");
			off += k;
		}
		char b[32];
		size_t got = 0, want = n - 6;
		while (got < want) {
			struct pollfd p = {.fd = fd, .events = POLLIN};
			if (poll(&p, 1, 5000) != 1)
				return fail(t, "poll for the echo");
			ssize_t k = read(fd, b + got, want - got);
			if (k < 0 && errno == EAGAIN)
				continue;
			if (k <= 0)
				return fail(t, "read the echo");
			got += k;
		}
		if (memcmp(b, "nb-immediate", want))
			return fail(t, "the echo differs");
		close(fd);
		printf("PASS %s\n", t);
		return 0;
	}
	const char *s = getenv("SHUNT_EDGE_SEED"), *b = getenv("SHUNT_EDGE_BYTES");
	uint64_t seed = s && *s ? strtoull(s, NULL, 10) : (uint64_t)time(NULL);
	size_t bytes = b && *b ? strtoull(b, NULL, 10) : 8 << 20;
	settle_ms = 0; /* the switches start at once */
	int fd = dial(ip, port, 0);
	if (fd < 0)
		return fail(t, "connect");
	char line[80];
	int n = snprintf(line, sizeof line, "%s %llu %zu\n", t, (unsigned long long)seed, bytes);
	if (write(fd, line, n) != n)
		return fail(t, "send the test name");
	printf("seed %llu bytes %zu\n", (unsigned long long)seed, bytes);
	return play(fd, t, seed, bytes, 0);
}
