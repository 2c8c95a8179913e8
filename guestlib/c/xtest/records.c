/* shunt-xtest records NAME: the core's records in a ring (records.c) over
 * plain memory, no hostd (guestlib/preload/records_test.go runs each
 * case; make ctest builds shunt-xtest). Exit 0 if the case holds, else 1
 * and why.
 *
 * Cases:
 *   stream    a writer and a reader thread move 200000 records of seeded
 *             random sizes (0 B to 16 KiB) through a 64 KiB ring: every
 *             record arrives once, in order, with its bytes (wraps, PADs,
 *             a full ring on the way)
 *   stale     a ring full of records stamped by another epoch (an earlier
 *             flow's bytes), and after a lap the writer's own old records:
 *             the reader never takes one of them for a new record
 *   corrupt   a record with a valid stamp and an impossible length:
 *             shunt_rec_poll says SHUNT_ECORRUPT, and reads nothing outside
 *   drain     the writer stops after a reset (the MPI transport's DOWN):
 *             the reader reads exactly to the writer's final count, then
 *             finds nothing
 *   half      a record larger than half the ring is refused (SHUNT_EINVAL)
 *   stride    no index per record: the head stays unpublished while the
 *             reader consumes within a stride; a writer short of room
 *             publishes its tail and asks for the head ("writer waiting"),
 *             and the reader's next consume publishes it and clears that
 *   cost      SHUNT_REC_COUNT 8-byte records written, polled and consumed
 *             by one thread: the ends' own work per message, without the
 *             line transfers between cores; prints "ns T" for all
 *
 * and, across processes, with a Go end (shm/ring/records.go) or another C
 * one: fd 3 is a region, the flow is slot SHUNT_REC_SLOT of generation
 * SHUNT_REC_GEN, this process is side SHUNT_REC_SIDE (1: A writes ring AB
 * and reads BA; 2: B), and both rings' writers stamp from SHUNT_REC_EPOCH:
 *   echo      writes every record back (its length, tag and bytes; the
 *             pad of shunt_rec_pad(0, len)) until the ring it reads is
 *             reset and drained; prints "echo N records"
 *   ping      SHUNT_REC_COUNT round trips of an 8-byte record, after one
 *             untimed; prints "ns T" for them, then resets the ring it
 *             writes, which stops an echo
 * Both wait by spinning, and yield the CPU after SHUNT_YIELD_AFTER_NS as
 * every waiter does (guestlib/preload/records_test.go, shm/records_bench_test.go). */
#define _GNU_SOURCE
#include "shunt.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

#define CAP (64u << 10)

static uint8_t *mem;
static struct shunt_ring wr, rd;
static struct shunt_rec_ring w, r;

static int fail(const char *why, unsigned long long a, unsigned long long b)
{
	fprintf(stderr, "FAIL: %s (%llu, %llu)\n", why, a, b);
	exit(1);
}

/* setup formats a ring in plain memory as hostd does (magic, capacity) and
 * attaches both ends with the given epochs. */
static void setup(uint64_t wepoch, uint64_t repoch)
{
	if (!mem && posix_memalign((void **)&mem, 4096, SHUNT_RING_HEADER + CAP))
		fail("no memory", 0, 0);
	memset(mem, 0, SHUNT_RING_HEADER);
	*(uint32_t *)(mem + SHUNT_OFF_MAGIC) = SHUNT_RING_MAGIC;
	*(uint64_t *)(mem + SHUNT_OFF_CAPACITY) = CAP;
	if (shunt_ring_writer(&wr, mem, SHUNT_RING_HEADER + CAP, CAP) || shunt_ring_reader(&rd, mem, SHUNT_RING_HEADER + CAP, CAP))
		fail("attach", 0, 0);
	w = (struct shunt_rec_ring){.r = &wr, .epoch = wepoch};
	r = (struct shunt_rec_ring){.r = &rd, .epoch = repoch};
}

static uint64_t rnd(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

static uint8_t pat(uint64_t n, size_t i) { return (uint8_t)(n * 131 + i * 7 + (i >> 8)); }

#define N 200000

static void *writer(void *arg)
{
	(void)arg;
	uint64_t seed = 42;
	for (uint64_t n = 0; n < N; n++) {
		size_t len = rnd(&seed) % 4 ? rnd(&seed) % 200 : rnd(&seed) % (16u << 10);
		uint16_t pad = shunt_rec_pad(24, len);
		struct shunt_rec *h;
		int err;
		while (!(h = shunt_rec_reserve(&w, pad + len, &err)))
			if (err != SHUNT_EAGAIN)
				fail("reserve", (unsigned long long)err, n);
		uint8_t *p = (uint8_t *)(h + 1) + pad;
		for (size_t i = 0; i < len; i++)
			p[i] = pat(n, i);
		shunt_rec_commit(&w, h, len, pad, SHUNT_REC_DATA, (uint8_t)n);
	}
	return NULL;
}

static int stream(void)
{
	setup(0x1234500000000ull, 0x1234500000000ull);
	pthread_t th;
	pthread_create(&th, NULL, writer, NULL);
	uint64_t seed = 42, pads = 0;
	for (uint64_t n = 0; n < N;) {
		int err = 0;
		struct shunt_rec *h = shunt_rec_poll(&r, &err);
		if (err)
			fail("poll", (unsigned long long)err, n);
		if (!h)
			continue;
		if (h->kind == SHUNT_REC_PAD) {
			pads++;
			shunt_rec_consume(&r, h);
			continue;
		}
		size_t want = rnd(&seed) % 4 ? rnd(&seed) % 200 : rnd(&seed) % (16u << 10);
		if (h->len != want || h->tag != (uint8_t)n)
			fail("length or tag", h->len, want);
		uint8_t *p = shunt_rec_payload(h);
		if (want >= SHUNT_REC_ALIGN_FROM && ((uintptr_t)(p + 24) % SHUNT_REC_LINE))
			fail("large payload not aligned after the header", (uintptr_t)p % SHUNT_REC_LINE, 0);
		for (size_t i = 0; i < want; i++)
			if (p[i] != pat(n, i))
				fail("byte", n, i);
		shunt_rec_consume(&r, h);
		n++;
	}
	pthread_join(th, NULL);
	int err = 0;
	if (shunt_rec_poll(&r, &err) || err)
		fail("a record after the last", 0, 0);
	if (!pads)
		fail("no PAD: the ring never wrapped mid-record", 0, 0);
	printf("stream: %d records, %llu pads, %llu bytes\n", N, (unsigned long long)pads, (unsigned long long)rd.own);
	return 0;
}

static int stale(void)
{
	/* An earlier flow's records everywhere, each line stamped 0..k of its
	 * own epoch: the new flow starts at record 0 too. */
	const uint64_t E = 0x777700000000ull;
	setup(E, E);
	for (uint64_t off = 0, k = 0; off < CAP; off += SHUNT_REC_LINE, k++) {
		struct shunt_rec *h = (struct shunt_rec *)(mem + SHUNT_RING_HEADER + off);
		*h = (struct shunt_rec){.len = 8, .kind = SHUNT_REC_DATA, .stamp = 0x555500000000ull + k};
	}
	int err = 0;
	if (shunt_rec_poll(&r, &err) || err)
		fail("took an earlier flow's record", 0, 0);
	/* Record 0: a payload that holds, at every line where a one-line
	 * record will start a lap later, exactly the stamp that record will
	 * have (the worst an application's data can do). */
	size_t big = 16u << 10;
	uint16_t pad = shunt_rec_pad(0, big);
	struct shunt_rec *h = shunt_rec_reserve(&w, pad + big, &err);
	if (!h)
		fail("reserve", (unsigned long long)err, 0);
	uint64_t span = shunt_rec_span(pad + big);
	uint8_t *p = (uint8_t *)(h + 1) + pad;
	memset(p, 0, big);
	for (uint64_t x = SHUNT_REC_LINE; x < span; x += SHUNT_REC_LINE) {
		uint64_t k = 1 + (CAP + x - span) / SHUNT_REC_LINE, at = x + 8 - sizeof(struct shunt_rec) - pad;
		if (at + 8 <= big)
			memcpy(p + at, &(uint64_t){E + k}, 8);
	}
	shunt_rec_commit(&w, h, big, pad, SHUNT_REC_DATA, 0);
	if (!(h = shunt_rec_poll(&r, &err)))
		fail("record 0", (unsigned long long)err, 0);
	shunt_rec_consume(&r, h);
	/* One-line records for two laps; after each, the reader looks at the
	 * next line, which the writer has not written: it must see nothing. */
	for (uint64_t n = 1; n < 2 * CAP / SHUNT_REC_LINE; n++) {
		if (!(h = shunt_rec_reserve(&w, 8, &err)))
			fail("reserve", (unsigned long long)err, n);
		memcpy(h + 1, &n, 8);
		shunt_rec_commit(&w, h, 8, 0, SHUNT_REC_DATA, 0);
		if (!(h = shunt_rec_poll(&r, &err)) || *(uint64_t *)shunt_rec_payload(h) != n)
			fail("record", n, 0);
		shunt_rec_consume(&r, h);
		if (shunt_rec_poll(&r, &err) || err)
			fail("took stale bytes of this ring for a new record", n, 0);
	}
	printf("stale: ok\n");
	return 0;
}

static int corrupt(void)
{
	setup(0x4200000000ull, 0x4200000000ull);
	struct shunt_rec *h = (struct shunt_rec *)(mem + SHUNT_RING_HEADER);
	*h = (struct shunt_rec){.len = CAP, .kind = SHUNT_REC_DATA, .stamp = 0x4200000000ull};
	int err = 0;
	if (shunt_rec_poll(&r, &err) || err != SHUNT_ECORRUPT)
		fail("impossible length accepted", (unsigned long long)err, 0);
	*h = (struct shunt_rec){.len = 8, .kind = 99, .stamp = 0x4200000000ull};
	err = 0;
	if (shunt_rec_poll(&r, &err) || err != SHUNT_ECORRUPT)
		fail("unknown kind accepted", (unsigned long long)err, 0);
	printf("corrupt: ok\n");
	return 0;
}

static int drain(void)
{
	setup(0x99900000000ull, 0x99900000000ull);
	int err;
	for (uint64_t n = 0; n < 100; n++) {
		struct shunt_rec *h = shunt_rec_reserve(&w, 300, &err);
		if (!h)
			fail("reserve", (unsigned long long)err, n);
		shunt_rec_commit(&w, h, 300, 0, SHUNT_REC_DATA, 0);
	}
	shunt_ring_abort(&wr); /* hostd's revocation */
	if (shunt_rec_reserve(&w, 8, &err) || err != SHUNT_ERESET || !shunt_rec_broken(&w))
		fail("a reset ring took a record", (unsigned long long)err, 0);
	uint64_t bytes = wr.own, records = w.next; /* what DOWN carries */
	while (rd.own < bytes) {
		err = 0;
		struct shunt_rec *h = shunt_rec_poll(&r, &err);
		if (!h)
			fail("drain stopped short", rd.own, bytes);
		shunt_rec_consume(&r, h);
	}
	err = 0;
	if (rd.own != bytes || r.next != records || shunt_rec_poll(&r, &err))
		fail("drain count", r.next, records);
	printf("drain: ok\n");
	return 0;
}

static int half(void)
{
	setup(0x10000000000ull, 0x10000000000ull);
	int err = 0;
	if (shunt_rec_reserve(&w, CAP / 2, &err) || err != SHUNT_EINVAL)
		fail("a record of half the ring was reserved", (unsigned long long)err, 0);
	printf("half: ok\n");
	return 0;
}

static int stride(void)
{
	setup(0x20000000000ull, 0x20000000000ull);
	uint64_t *head = (uint64_t *)(mem + SHUNT_OFF_HEAD), *tail = (uint64_t *)(mem + SHUNT_OFF_TAIL);
	uint32_t *wwait = (uint32_t *)(mem + SHUNT_OFF_WWAIT);
	int err = 0;
	struct shunt_rec *h;
	for (unsigned i = 0; i < CAP / SHUNT_REC_LINE; i++) {
		if (!(h = shunt_rec_reserve(&w, 8, &err)))
			fail("reserve", (unsigned long long)err, i);
		shunt_rec_commit(&w, h, 8, 0, SHUNT_REC_DATA, 0);
	}
	for (int i = 0; i < 2; i++) {
		if (!(h = shunt_rec_poll(&r, &err)))
			fail("poll", (unsigned long long)err, i);
		shunt_rec_consume(&r, h);
	}
	if (*head != 0)
		fail("head published within a stride", *head, 0);
	if (shunt_rec_reserve(&w, 8, &err) || err != SHUNT_EAGAIN)
		fail("reserve in a ring the writer sees full", (unsigned long long)err, 0);
	if (*tail != CAP || *wwait == 0)
		fail("a writer short of room publishes its tail and asks for the head", *tail, *wwait);
	if (!(h = shunt_rec_poll(&r, &err)))
		fail("poll", (unsigned long long)err, 2);
	shunt_rec_consume(&r, h);
	if (*head != 3 * SHUNT_REC_LINE || *wwait != 0)
		fail("the reader answers the request with its head", *head, *wwait);
	if (!(h = shunt_rec_reserve(&w, 8, &err)))
		fail("reserve after the reader answered", (unsigned long long)err, 0);
	printf("stride: ok\n");
	return 0;
}

static uint64_t env_u64(const char *name)
{
	const char *v = getenv(name);
	return v ? strtoull(v, NULL, 0) : 0;
}

static int64_t now_ns(void);

static int cost(void)
{
	setup(0x30000000000ull, 0x30000000000ull);
	uint64_t n = env_u64("SHUNT_REC_COUNT");
	int err = 0;
	int64_t t0 = now_ns();
	for (uint64_t i = 0; i < n; i++) {
		struct shunt_rec *h = shunt_rec_reserve(&w, 8, &err);
		if (!h)
			fail("reserve", (unsigned long long)err, i);
		memcpy(h + 1, &i, 8);
		shunt_rec_commit(&w, h, 8, 0, SHUNT_REC_DATA, 0);
		if (!(h = shunt_rec_poll(&r, &err)) || memcmp(h + 1, &i, 8))
			fail("poll", (unsigned long long)err, i);
		shunt_rec_consume(&r, h);
	}
	printf("ns %lld\n", (long long)(now_ns() - t0));
	return 0;
}

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* attach maps the region on fd 3 and attaches this side's ends of the
 * flow the environment names: w writes one ring, r reads the other. */
static void attach(void)
{
	struct stat st;
	if (fstat(3, &st) < 0)
		fail("no region on fd 3", 0, 0);
	uint8_t *m = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, 3, 0);
	if (m == MAP_FAILED)
		fail("mmap the region", st.st_size, 0);
	struct shunt_region g;
	struct shunt_slot s;
	uint64_t slot = env_u64("SHUNT_REC_SLOT"), gen = env_u64("SHUNT_REC_GEN"), epoch = env_u64("SHUNT_REC_EPOCH");
	if (shunt_region_attach(&g, m, st.st_size) || shunt_region_slot(&g, slot, &s) || s.gen != gen)
		fail("bad region or slot", slot, gen);
	int a = env_u64("SHUNT_REC_SIDE") == 1;
	size_t len = SHUNT_RING_HEADER + s.capacity;
	if (shunt_ring_writer(&wr, m + (a ? s.ring_ab : s.ring_ba), len, s.capacity) ||
	    shunt_ring_reader(&rd, m + (a ? s.ring_ba : s.ring_ab), len, s.capacity))
		fail("attach the rings", s.ring_ab, s.ring_ba);
	w = (struct shunt_rec_ring){.r = &wr, .epoch = epoch};
	r = (struct shunt_rec_ring){.r = &rd, .epoch = epoch};
}

/* spin is one empty turn of a wait that started at *start (0: now), as
 * shm/wait spins: PAUSE on every turn (it slows the loads of the line the
 * peer is about to write, so its store gets the line sooner), and every 64
 * turns a clock read, yielding once SHUNT_YIELD_AFTER_NS passed. */
static void spin(unsigned *turn, int64_t *start)
{
	if (!*start)
		*start = now_ns();
#if defined(__x86_64__)
	__builtin_ia32_pause();
#endif
	if (++*turn % 64)
		return;
	shunt_spin_yield(now_ns() - *start);
}

/* next returns the next DATA record, waiting for it, or NULL once the
 * ring is reset and drained. */
static struct shunt_rec *next(void)
{
	unsigned turn = 0;
	int64_t start = 0;
	for (;;) {
		int err = 0;
		struct shunt_rec *h = shunt_rec_poll(&r, &err);
		if (err)
			fail("poll", (unsigned long long)-err, r.next);
		if (h && h->kind == SHUNT_REC_PAD) {
			shunt_rec_consume(&r, h);
			continue;
		}
		if (h)
			return h;
		if (shunt_rec_broken(&r))
			return NULL;
		spin(&turn, &start);
	}
}

/* room reserves a record of pad + len bytes, waiting while the ring is full. */
static struct shunt_rec *room(size_t n)
{
	unsigned turn = 0;
	int64_t start = 0;
	for (;;) {
		int err;
		struct shunt_rec *h = shunt_rec_reserve(&w, n, &err);
		if (h)
			return h;
		if (err != SHUNT_EAGAIN)
			fail("reserve", (unsigned long long)-err, w.next);
		spin(&turn, &start);
	}
}

static int echo(void)
{
	attach();
	uint64_t n = 0;
	struct shunt_rec *h;
	while ((h = next())) {
		uint16_t pad = shunt_rec_pad(0, h->len);
		struct shunt_rec *o = room(pad + h->len);
		memcpy((uint8_t *)(o + 1) + pad, shunt_rec_payload(h), h->len);
		shunt_rec_commit(&w, o, h->len, pad, SHUNT_REC_DATA, h->tag);
		shunt_rec_consume(&r, h);
		n++;
	}
	printf("echo %llu records\n", (unsigned long long)n);
	return 0;
}

static int ping(void)
{
	attach();
	uint64_t count = env_u64("SHUNT_REC_COUNT");
	int64_t t0 = 0;
	for (uint64_t i = 0; i <= count; i++) {
		if (i == 1)
			t0 = now_ns(); /* round trip 0 waited for the echo to start */
		struct shunt_rec *o = room(8);
		memcpy(o + 1, &i, 8);
		shunt_rec_commit(&w, o, 8, 0, SHUNT_REC_DATA, 0);
		struct shunt_rec *h = next();
		if (!h || h->len != 8 || memcmp(shunt_rec_payload(h), &i, 8))
			fail("echoed record", i, h ? h->len : 0);
		shunt_rec_consume(&r, h);
	}
	printf("ns %lld\n", (long long)(count ? now_ns() - t0 : 0));
	shunt_ring_abort(&wr);
	return 0;
}

/* records runs one case (xtest.c's main calls it). */
int records(const char *c)
{
	if (!strcmp(c, "stream"))
		return stream();
	if (!strcmp(c, "stale"))
		return stale();
	if (!strcmp(c, "corrupt"))
		return corrupt();
	if (!strcmp(c, "drain"))
		return drain();
	if (!strcmp(c, "half"))
		return half();
	if (!strcmp(c, "stride"))
		return stride();
	if (!strcmp(c, "cost"))
		return cost();
	if (!strcmp(c, "echo"))
		return echo();
	if (!strcmp(c, "ping"))
		return ping();
	fprintf(stderr, "unknown case %s: stream|stale|corrupt|drain|half|stride|cost|echo|ping\n", c);
	return 2;
}
