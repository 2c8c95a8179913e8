/* shunt-stream: one-way streaming with chosen read and write sizes, the C
 * side of BenchmarkGuestSizes (integration/sizes_bench_test.go). Run plain
 * and under shunt-run to compare with kernel TCP and the Go library. It
 * speaks perf.Serve's sink protocol, so either end may be the Go one.
 *
 *   shunt-stream serve ADDR PORT          accept sinks one at a time: a
 *       first byte 'r' and a 4-byte big-endian size reads with read()
 *       calls of that size; 's' reads 8 KiB at a time; at EOF the byte
 *       count goes back as a line
 *   shunt-stream send ADDR PORT WSIZE RSIZE TOTAL [DELAY_MS]
 *       write TOTAL bytes in WSIZE writes to a sink reading RSIZE (0:
 *       the sink's default, 's'), then
 *       half-close and wait for the count; prints "gbs <GB/s>". The
 *       clock starts DELAY_MS after the connection (under shunt-run: time
 *       for hostd to pair it; the header's write then moves it).
 *
 * Every wait has a bound (SO_RCVTIMEO, SO_SNDTIMEO). */
#define _GNU_SOURCE
#include <arpa/inet.h>

#include "tool.h"

#define MAXSIZE (16u << 20)

static void sink(int c, char *buf)
{
	unsigned char hdr[4];
	size_t size = 8 << 10;
	if (full(c, buf, 1, 1))
		return;
	if (buf[0] == 'r') {
		if (full(c, (char *)hdr, 4, 1))
			return;
		size = (size_t)hdr[0] << 24 | hdr[1] << 16 | hdr[2] << 8 | hdr[3];
		if (size < 1 || size > MAXSIZE)
			return;
	}
	long long n = 0;
	for (;;) {
		ssize_t k = read(c, buf, size);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			break;
		n += k;
	}
	char line[32];
	int len = snprintf(line, sizeof line, "%lld\n", n);
	full(c, line, len, 0);
}

int main(int argc, char **argv)
{
	tool_name = "shunt-stream";
	if (argc < 4) {
		fprintf(stderr, "usage: shunt-stream serve ADDR PORT | send ADDR PORT WSIZE RSIZE TOTAL [DELAY_MS]\n");
		return 2;
	}
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
	if (inet_pton(AF_INET, argv[2], &sa.sin_addr) != 1)
		die("address");
	char *buf = malloc(MAXSIZE);
	if (!buf)
		die("malloc");
	memset(buf, 'x', MAXSIZE);
	if (!strcmp(argv[1], "serve")) {
		int l = tool_listen(&sa);
		for (;;) {
			int c = tool_accept(l);
			bounded(c, 30, 0);
			sink(c, buf);
			close(c);
		}
	}
	if (argc < 7) {
		fprintf(stderr, "usage: shunt-stream send ADDR PORT WSIZE RSIZE TOTAL [DELAY_MS]\n");
		return 2;
	}
	size_t wsize = strtoul(argv[4], NULL, 10), rsize = strtoul(argv[5], NULL, 10);
	long long total = strtoll(argv[6], NULL, 10);
	if (wsize < 1 || wsize > MAXSIZE || rsize > MAXSIZE || total < 1)
		die("sizes");
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0)
		die("socket");
	bounded(fd, 30, 0);
	if (connect(fd, (struct sockaddr *)&sa, sizeof sa))
		die("connect");
	unsigned char hdr[5] = {'r', rsize >> 24, rsize >> 16, rsize >> 8, rsize};
	if (rsize == 0)
		hdr[0] = 's'; /* the sink's own way: 8 KiB reads here, io.Copy in Go */
	if (full(fd, (char *)hdr, rsize ? 5 : 1, 0))
		die("header");
	if (argc > 7) {
		struct timespec d = {0, atoi(argv[7]) % 1000 * 1000000L};
		nanosleep(&d, NULL);
	}
	int64_t t0 = now_ns();
	for (long long left = total; left > 0;) {
		size_t k = left < (long long)wsize ? (size_t)left : wsize;
		if (full(fd, buf, k, 0))
			die("write");
		left -= k;
	}
	if (shutdown(fd, SHUT_WR))
		die("shutdown");
	char line[32] = {0};
	size_t got = 0;
	while (got < sizeof line - 1) {
		ssize_t k = read(fd, line + got, sizeof line - 1 - got);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			break;
		got += k;
		if (memchr(line, '\n', got))
			break;
	}
	double secs = (now_ns() - t0) / 1e9;
	close(fd); /* under shunt-run with SHUNT_STATS=1, the path's byte counts */
	if (strtoll(line, NULL, 10) != total) {
		fprintf(stderr, "shunt-stream: the sink counted %s bytes, want %lld\n", line, total);
		return 1;
	}
	printf("gbs %.3f\n", total / secs / 1e9);
	return 0;
}
