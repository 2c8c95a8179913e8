/* edge_locks.c: the library's locks under load (issue 21: `pgbench -C`
 * deadlocked in 3 of 12 runs). THREADS threads each make short
 * connections for RUN_MS, as libpq does: a non-blocking connect, poll
 * until it is up, SO_ERROR, one echo, close. Every connection is settled
 * (socket.c) while the leaver thread sends OPENs (open.c); once the
 * leaver held tab_mu and waited for settle_mu, which a settle held while
 * it waited for tab_mu. A deadline turns a hang into a FAIL.
 *
 *   edge client IP PORT settlestorm   (against "edge server": echo)
 *
 * preload_edge_servers_test.go runs it with a 1 ms open delay and
 * SHUNT_TEST_SETTLE_DELAY_US, which widens the window. */
#include "edge.h"

#define THREADS  4
#define RUN_MS   3000
#define DEADLINE 30 /* s: all threads done by then, or the test fails */

static const char *s_ip;
static int s_port;
static long done[THREADS];
static int errs;

static int connect_nb(void)
{
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(s_port)};
	inet_pton(AF_INET, s_ip, &a.sin_addr);
	if (connect(fd, (struct sockaddr *)&a, sizeof a) && errno != EINPROGRESS)
		return close(fd), -1;
	struct pollfd p = {.fd = fd, .events = POLLOUT};
	int err = 0;
	socklen_t l = sizeof err;
	if (poll(&p, 1, 5000) != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l) || err)
		return close(fd), -1;
	return fd;
}

static void *storm(void *arg)
{
	int i = (int)(intptr_t)arg;
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	do {
		int fd = connect_nb();
		if (fd < 0) {
			__atomic_add_fetch(&errs, 1, __ATOMIC_RELAXED);
			continue;
		}
		char name[] = "settlestorm\nx", b;
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (write(fd, name, sizeof name - 1) != sizeof name - 1 || poll(&p, 1, 5000) != 1 || read(fd, &b, 1) != 1 || b != 'x')
			__atomic_add_fetch(&errs, 1, __ATOMIC_RELAXED);
		close(fd);
		done[i]++;
		clock_gettime(CLOCK_MONOTONIC, &t);
	} while ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 < RUN_MS);
	return NULL;
}

static void on_alarm(int sig)
{
	(void)sig;
	char m[160];
	int n = snprintf(m, sizeof m, "FAIL settlestorm: not done within %d s (a deadlock?); connections per thread: %ld %ld %ld %ld\n",
			 DEADLINE, done[0], done[1], done[2], done[3]);
	ssize_t r = write(1, m, n);
	(void)r;
	_exit(1);
}

int settle_storm(const char *ip, int port, const char *t)
{
	s_ip = ip, s_port = port;
	signal(SIGALRM, on_alarm);
	alarm(DEADLINE);
	pthread_t th[THREADS];
	for (int i = 0; i < THREADS; i++)
		pthread_create(&th[i], NULL, storm, (void *)(intptr_t)i);
	for (int i = 0; i < THREADS; i++)
		pthread_join(th[i], NULL);
	alarm(0);
	long n = 0;
	for (int i = 0; i < THREADS; i++)
		n += done[i];
	if (errs > n / 10)
		return printf("FAIL %s: %d of %ld connections failed\n", t, errs, n), 1;
	printf("PASS %s (%ld connections, %d failed)\n", t, n, errs);
	return 0;
}
