/* shunt-xtest stretch BYTES MODE: the core's vsock stretch (stretch.c)
 * against shunt-vstretchd's protocol (guestlib/vstretch, Serve; the test
 * is guestlib/preload/stretch_test.go, which serves it at
 * $SHUNT_VSTRETCHD with a host of its own behind). With SHUNT_VSOCK=1 a
 * READY for an unmapped region (5/1.9, 64 KiB rings) attaches to the
 * daemon's memfd ring pair; the program writes BYTES of the pattern
 * wbyte() from offset 0 while it reads the other ring to its writer's
 * leave, checking rbyte(). MODE "bye": leave, DRAIN, detach (BYE);
 * "die": _exit after half the bytes, as a killed program (a break).
 * Prints "attached", "read N ok" (or "read N bad at K"), "drain R",
 * "done". Every wait is bounded (20 s). */
#define _GNU_SOURCE
#include "shunt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static uint8_t wbyte(uint64_t i) { return (uint8_t)(i * 131 + (i >> 9)); }
static uint8_t rbyte(uint64_t i) { return (uint8_t)(i * 17 + (i >> 11)); }

static void logline(void *arg, const char *line)
{
	(void)arg;
	fprintf(stderr, "%s\n", line);
}

static int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int stretch_test(uint64_t bytes, const char *mode)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	setenv("SHUNT_VSOCK", "1", 1);
	struct shunt_session_config c = {.control = "/nonexistent/shunt.sock", .log = logline};
	struct shunt_session *s = shunt_session_new(&c);
	struct shunt_msg m = {.type = SHUNT_READY, .region_id = 5, .slot = 1, .gen = 9, .side = 1, .capacity = 65536};
	struct shunt_flow f;
	if (!s || shunt_flow_attach(s, &m, &f) || !shunt_flow_stretch(&f))
		return printf("attach failed\n"), 1;
	printf("attached\n");
	int64_t end = now_ms() + 20000;
	shunt_ring_attach_reader(&f.r);
	while (!shunt_ring_reader_attached(&f.w))
		if (now_ms() > end)
			return printf("the bridge never attached the write ring\n"), 1;
	shunt_ring_start(&f.w, 0);
	uint8_t buf[4096], rb[65536];
	uint64_t sent = 0, got = 0, bad = UINT64_MAX;
	int wdone = 0, eof = 0;
	while (!(wdone && eof)) {
		if (now_ms() > end)
			return printf("stuck: sent %llu, read %llu\n", (unsigned long long)sent, (unsigned long long)got), 1;
		if (!wdone) {
			size_t n = bytes - sent < sizeof buf ? bytes - sent : sizeof buf;
			for (size_t i = 0; i < n; i++)
				buf[i] = wbyte(sent + i);
			ssize_t k = n ? shunt_ring_write(&f.w, buf, n) : 0;
			if (k > 0)
				sent += k;
			else if (k < 0 && k != SHUNT_EAGAIN)
				return printf("write: %zd\n", k), 1;
			if (!strcmp(mode, "die") && sent >= bytes / 2)
				_exit(3); /* no leave, no BYE: a killed program */
			if (sent == bytes) {
				shunt_ring_leave(&f.w);
				wdone = 1;
			}
		}
		if (!eof) {
			ssize_t k = shunt_ring_read(&f.r, rb, sizeof rb);
			for (ssize_t i = 0; i < k && bad == UINT64_MAX; i++)
				if (rb[i] != rbyte(got + i))
					bad = got + i;
			if (k > 0)
				got += k;
			else if (k == SHUNT_ELEFT || k == 0)
				eof = 1;
			else if (k != SHUNT_EAGAIN)
				return printf("read: %zd\n", k), 1;
		}
	}
	if (bad == UINT64_MAX)
		printf("read %llu ok\n", (unsigned long long)got);
	else
		printf("read %llu bad at %llu\n", (unsigned long long)got, (unsigned long long)bad);
	printf("drain %d\n", shunt_flow_drain(&f));
	shunt_flow_detach(&f);
	printf("done\n");
	return 0;
}
