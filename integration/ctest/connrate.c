/* shunt-connrate: short connections, as an HTTP/1.0 client or an RPC per
 * connection makes them: connect, 8 bytes there, 8 back, close. Run plain
 * and under shunt-run to compare (integration/preload_bench_test.go,
 * BenchmarkPreloadConnRate).
 *
 *   shunt-connrate serve ADDR PORT        accept and echo, one at a time
 *   shunt-connrate client ADDR PORT N     N connections in a row; prints
 *                                         "setup_us <median> rate <conns/s>"
 *
 * setup is connect + accept + the first 8-byte round trip; the rate counts
 * whole connections, close included. Every wait has a bound (SO_RCVTIMEO). */
#define _GNU_SOURCE
#include <arpa/inet.h>

#include "tool.h"

static int cmp(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	tool_name = "shunt-connrate";
	if (argc < 4) {
		fprintf(stderr, "usage: shunt-connrate serve ADDR PORT | client ADDR PORT N\n");
		return 2;
	}
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
	if (inet_pton(AF_INET, argv[2], &sa.sin_addr) != 1)
		die("address");
	char buf[8];
	if (!strcmp(argv[1], "serve")) {
		int l = tool_listen(&sa);
		for (;;) {
			int c = tool_accept(l);
			bounded(c, 10, 1);
			if (full(c, buf, 8, 1) == 0 && full(c, buf, 8, 0) == 0)
				while (read(c, buf, sizeof buf) > 0) /* until the client's close */
					;
			close(c);
		}
	}
	int n = argc > 4 ? atoi(argv[4]) : 1000;
	if (n < 1)
		n = 1;
	int64_t *setup = calloc(n, sizeof *setup);
	if (!setup)
		die("calloc");
	int64_t t0 = now_ns();
	for (int i = 0; i < n; i++) {
		int64_t s = now_ns();
		int fd = socket(AF_INET, SOCK_STREAM, 0);
		if (fd < 0)
			die("socket");
		bounded(fd, 10, 1);
		if (connect(fd, (struct sockaddr *)&sa, sizeof sa))
			die("connect");
		memcpy(buf, "connrate", 8);
		if (full(fd, buf, 8, 0) || full(fd, buf, 8, 1)) {
			fprintf(stderr, "shunt-connrate: connection %d of %d, after %.1f ms: ", i + 1, n, (now_ns() - s) / 1e6);
			die("round trip");
		}
		setup[i] = now_ns() - s;
		close(fd);
	}
	double secs = (now_ns() - t0) / 1e9;
	qsort(setup, n, sizeof *setup, cmp);
	printf("setup_us %.1f rate %.0f\n", setup[n / 2] / 1e3, n / secs);
	return 0;
}
