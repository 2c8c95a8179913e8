/* tool.h: what the small C benchmark programs of integration/ctest share
 * (connrate.c, stream.c): a clock, an exit with the program's name and
 * errno, a bound on every wait, and whole reads and writes. Each program
 * sets tool_name first. */
#ifndef SHUNT_CTEST_TOOL_H
#define SHUNT_CTEST_TOOL_H

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char *tool_name = "shunt-ctest";

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char *what)
{
	fprintf(stderr, "%s: %s: %s\n", tool_name, what, strerror(errno));
	exit(1);
}

/* bounded gives fd's reads and writes a time-out of secs, and with nodelay
 * turns Nagle's algorithm off (as Go's net package does). */
static void bounded(int fd, int secs, int nodelay)
{
	struct timeval tv = {secs, 0};
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
	if (nodelay) {
		int one = 1;
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	}
}

/* full reads (reading) or writes all n bytes of buf: 0, or -1 at an error
 * or EOF. */
static int full(int fd, char *buf, size_t n, int reading)
{
	size_t done = 0;
	while (done < n) {
		ssize_t k = reading ? read(fd, buf + done, n - done) : write(fd, buf + done, n - done);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		done += k;
	}
	return 0;
}

/* tool_listen listens on sa and says "ready" on stdout (the Go side waits
 * for it). */
static int tool_listen(const struct sockaddr_in *sa)
{
	int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(l, (const struct sockaddr *)sa, sizeof *sa) || listen(l, 128))
		die("listen");
	printf("ready\n");
	fflush(stdout);
	return l;
}

/* tool_accept accepts the next connection, past EINTR and ECONNABORTED. */
static int tool_accept(int l)
{
	for (;;) {
		int c = accept(l, NULL, NULL);
		if (c >= 0)
			return c;
		if (errno != EINTR && errno != ECONNABORTED)
			die("accept");
	}
}

#endif
