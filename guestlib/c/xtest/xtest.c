/* shunt-xtest: the C side of the cross-language tests
 * (guestlib/preload/preload_test.go) and the core's own C tests
 * (records.c), built against the core (make ctest).
 *
 *   shunt-xtest vectors                      frames in hex on stdin; for each,
 *                                            "OK <re-encoded hex> <fields>" or "ERR"
 *   shunt-xtest reasons                      every reason's name, one a line
 *   shunt-xtest ring-read  FILE SLOT GEN SIDE        read to EOF; "bytes N crc C"
 *   shunt-xtest ring-write FILE SLOT GEN SIDE N SEED  write N bytes, FIN; "crc C"
 *   shunt-xtest records NAME                 one case of records.c's tests
 *   shunt-xtest session CONTROL              a session with a (fake) hostd: OPEN,
 *                                            attach the READY's flow in whatever
 *                                            region it names, read to EOF
 *                                            ("bytes N crc C"), write "done", CLOSE,
 *                                            and report the regions mapped before
 *                                            and after UNREGION ("regions 1 0")
 *
 *   shunt-xtest reopen CONTROL               a program thread's ensure and send while
 *                                            the reader reopens the channel (reopen.c)
 *   shunt-xtest together CONTROL             two threads' ensure during one open (reopen.c)
 *   shunt-xtest forkopen CONTROL             a fork during another thread's open (reopen.c)
 *
 *   shunt-xtest stretch BYTES MODE           a vsock stretch through shunt-vstretchd
 *                                            ($SHUNT_VSTRETCHD): stretch.c
 *
 * SIDE is the flow side this process plays (A writes ring AB, reads BA). */
#define _GNU_SOURCE
#include "shunt.h"

#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static uint32_t crc_table[256];
static void crc_init(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
		crc_table[i] = c;
	}
}
static uint32_t crc_update(uint32_t crc, const uint8_t *p, size_t n)
{
	crc = ~crc;
	while (n--)
		crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
	return ~crc;
}

static int hexval(int c) { return c <= '9' ? c - '0' : (c | 32) - 'a' + 10; }

static void print_addr(const struct shunt_addr *a)
{
	for (int i = 0; i < 16; i++)
		printf("%02x", a->ip[i]);
	printf(":%u", a->port);
}

static int vectors(void)
{
	static char line[20000];
	static uint8_t frame[10000], out[10000];
	while (fgets(line, sizeof line, stdin)) {
		size_t n = strcspn(line, "\r\n") / 2;
		for (size_t i = 0; i < n; i++)
			frame[i] = hexval(line[2 * i]) << 4 | hexval(line[2 * i + 1]);
		struct shunt_msg m;
		if (shunt_msg_decode(frame, n, &m) != 0) {
			printf("ERR\n");
			continue;
		}
		ssize_t k = shunt_msg_encode(&m, out, sizeof out);
		printf("OK ");
		for (ssize_t i = 0; i < k; i++)
			printf("%02x", out[i]);
		printf(" type=%u req=%" PRIu32 " role=%u side=%u reason=%u slot=%" PRIu32 " gen=%" PRIu64
		       " cap=%" PRIu32 " ab=%" PRIu64 " ba=%" PRIu64 " rid=%" PRIu32 " guest=%" PRIu32 " rsize=%" PRIu64
		       " pid=%" PRIu32 " nonce=%" PRIu64 " formats=%" PRIu32 " offset=%" PRIu64 " region=%s text=%s local=",
		       m.type, m.req_id, m.role, m.side, m.reason, m.slot, m.gen, m.capacity, m.ring_ab, m.ring_ba,
		       m.region_id, m.guest_id, m.region_size, m.pid, m.nonce, m.formats, m.offset, m.region, m.text);
		print_addr(&m.local);
		printf(" remote=");
		print_addr(&m.remote);
		printf("\n");
	}
	return 0;
}

static int ring_open(const char *path, uint32_t slot, uint64_t gen, int side, int writer, struct shunt_ring *r)
{
	int fd = open(path, O_RDWR);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) < 0)
		return perror(path), -1;
	void *mem = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (mem == MAP_FAILED)
		return perror("mmap"), -1;
	struct shunt_region g;
	struct shunt_slot s;
	if (shunt_region_attach(&g, mem, st.st_size) || shunt_region_slot(&g, slot, &s) || s.gen != gen || s.state != 2)
		return fprintf(stderr, "bad region or slot\n"), -1;
	/* A writes AB and reads BA; B the other way round. */
	int ab = (side == 1) == writer;
	uint64_t off = ab ? s.ring_ab : s.ring_ba;
	size_t len = SHUNT_RING_HEADER + s.capacity;
	int err = writer ? shunt_ring_writer(r, (uint8_t *)mem + off, len, s.capacity)
			 : shunt_ring_reader(r, (uint8_t *)mem + off, len, s.capacity);
	if (err)
		return fprintf(stderr, "attach ring: %d\n", err), -1;
	return 0;
}

static void logline(void *arg, const char *line)
{
	(void)arg;
	fprintf(stderr, "%s\n", line);
}

/* session plays a process guest's side of a flow in a region that hostd
 * hands over as a descriptor. */
static int session(const char *control)
{
	struct shunt_session_config c = {.control = control, .log = logline};
	struct shunt_session *s = shunt_session_new(&c);
	if (!s || shunt_session_ensure(s))
		return perror("session"), 1;
	struct shunt_msg open = {.type = SHUNT_OPEN, .role = SHUNT_ROLE_ACTIVE}, v;
	open.local.port = 1;
	open.remote.port = 2;
	shunt_session_request(s, &open, &v, 5000);
	struct shunt_flow f;
	if (v.type != SHUNT_READY || shunt_flow_attach(s, &v, &f))
		return fprintf(stderr, "verdict %u (reason %u), region %u: no flow\n", v.type, v.reason, v.region_id), 1;
	static uint8_t buf[64 << 10];
	uint64_t total = 0;
	uint32_t crc = 0;
	for (;;) {
		ssize_t n = shunt_ring_read(&f.r, buf, sizeof buf);
		if (n == SHUNT_EAGAIN) {
			shunt_ring_wait(&f.r, 1, 25000, -1);
			continue;
		}
		if (n < 0)
			return fprintf(stderr, "read: %zd\n", n), 1;
		if (n == 0)
			break;
		crc = crc_update(crc, buf, n);
		total += n;
	}
	printf("bytes %" PRIu64 " crc %" PRIu32 "\n", total, crc);
	fflush(stdout);
	if (shunt_ring_write(&f.w, "done", 4) != 4)
		return fprintf(stderr, "write failed\n"), 1;
	shunt_ring_close_write(&f.w);
	int before = shunt_session_regions(s);
	shunt_flow_close(&f);
	shunt_flow_detach(&f);
	int after = before;
	for (int i = 0; i < 5000 && after; i++) { /* UNREGION comes from the test, within 5 s */
		struct timespec ms = {0, 1000000};
		nanosleep(&ms, NULL);
		after = shunt_session_regions(s);
	}
	printf("regions %d %d\n", before, after);
	fflush(stdout);
	return 0;
}

int records(const char *name); /* records.c */
int fault_test(void);           /* fault.c */
int stretch_test(uint64_t bytes, const char *mode); /* stretch.c */
int reopen_test(const char *control);               /* reopen.c */
int together_test(const char *control);             /* reopen.c */
int forkopen_test(const char *control);             /* reopen.c */

int main(int argc, char **argv)
{
	crc_init();
	if (argc == 3 && !strcmp(argv[1], "records"))
		return records(argv[2]);
	if (argc == 3 && !strcmp(argv[1], "session"))
		return session(argv[2]);
	if (argc == 4 && !strcmp(argv[1], "stretch"))
		return stretch_test(strtoull(argv[2], 0, 10), argv[3]);
	if (argc == 3 && !strcmp(argv[1], "reopen"))
		return reopen_test(argv[2]);
	if (argc == 3 && !strcmp(argv[1], "together"))
		return together_test(argv[2]);
	if (argc == 3 && !strcmp(argv[1], "forkopen"))
		return forkopen_test(argv[2]);
	if (argc >= 2 && !strcmp(argv[1], "fault"))
		return fault_test();
	if (argc >= 2 && !strcmp(argv[1], "vectors"))
		return vectors();
	if (argc >= 2 && !strcmp(argv[1], "reasons")) {
		for (unsigned r = 0; r < SHUNT_NUM_REASONS; r++)
			printf("%s\n", shunt_reason_name(r));
		return 0;
	}
	if (argc < 6)
		return fprintf(stderr, "usage: see the source\n"), 2;
	int writer = !strcmp(argv[1], "ring-write");
	struct shunt_ring r;
	if (ring_open(argv[2], strtoul(argv[3], 0, 10), strtoull(argv[4], 0, 10), atoi(argv[5]), writer, &r))
		return 1;
	static uint8_t buf[1 << 20];
	uint32_t crc = 0;
	if (!writer) {
		uint64_t total = 0;
		for (;;) {
			ssize_t n = shunt_ring_read(&r, buf, 1 + rand() % sizeof buf);
			if (n == SHUNT_EAGAIN) {
				shunt_ring_wait(&r, 1, 25000, -1);
				continue;
			}
			if (n < 0)
				return fprintf(stderr, "read: %zd\n", n), 1;
			if (n == 0)
				break;
			crc = crc_update(crc, buf, n);
			total += n;
		}
		printf("bytes %" PRIu64 " crc %" PRIu32 "\n", total, crc);
		return 0;
	}
	uint64_t left = strtoull(argv[6], 0, 10), x = strtoull(argv[7], 0, 10) | 1;
	while (left) {
		size_t k = 1 + rand() % sizeof buf;
		if (k > left)
			k = left;
		for (size_t i = 0; i < k; i++) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			buf[i] = x;
		}
		crc = crc_update(crc, buf, k);
		for (size_t off = 0; off < k;) {
			ssize_t n = shunt_ring_write(&r, buf + off, k - off);
			if (n == SHUNT_EAGAIN) {
				shunt_ring_wait(&r, 0, 25000, -1);
				continue;
			}
			if (n < 0)
				return fprintf(stderr, "write: %zd\n", n), 1;
			off += n;
		}
		left -= k;
	}
	shunt_ring_close_write(&r);
	printf("crc %" PRIu32 "\n", crc);
	return 0;
}
