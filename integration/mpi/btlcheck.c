/* Data checks for an MPI transport across guests (integration/mpi_btl_test.go).
 *
 *   btlcheck [-b] [-t SECONDS] [-m MAXBYTES]
 *
 * -b: the first MPI operation after MPI_Init is a barrier (both ranks of a
 * pair connect to each other at the same moment), then the phases.
 *
 * Every rank checks every byte it receives. Phases, all ranks at once:
 *   p2p      blocking send/recv with a partner in the other half of the
 *            ranks (the other guest), every size from 0 to MAXBYTES: powers
 *            of two, one less and one more, and a few odd sizes
 *   nonblock 16 outstanding isend/irecv each way with distinct tags,
 *            completed in reverse order
 *   wildcard rank 0 receives from MPI_ANY_SOURCE with MPI_ANY_TAG, checks
 *            the status against the contents
 *   coll     allreduce, alltoall, bcast from every root, small and large
 * With -t the phases repeat until SECONDS have passed (rank 0 decides), and
 * each round prints "round N ok". The last line of rank 0 is "data ok" or
 * "data MISMATCH"; the exit status is 0 only for "data ok". */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int rank, size, bad;

static uint8_t pat(uint32_t seed, size_t i) { return (uint8_t)((i * 2654435761u) >> 13 ^ seed * 40503u ^ i); }

static void fill(uint8_t *b, size_t n, uint32_t seed)
{
	for (size_t i = 0; i < n; i++)
		b[i] = pat(seed, i);
}

static void check(const uint8_t *b, size_t n, uint32_t seed, const char *what, int peer)
{
	for (size_t i = 0; i < n; i++)
		if (b[i] != pat(seed, i)) {
			if (bad++ < 5)
				fprintf(stderr, "rank %d: %s from %d: %zu bytes: byte %zu is %u, want %u\n", rank, what, peer, n, i, b[i],
					pat(seed, i));
			return;
		}
}

static int nsizes;
static size_t sizes[256];

static void add(size_t n, size_t max)
{
	if (n > max)
		return;
	for (int i = 0; i < nsizes; i++)
		if (sizes[i] == n)
			return;
	sizes[nsizes++] = n;
}

static void p2p(uint8_t *s, uint8_t *r, int round)
{
	int partner = (rank + size / 2) % size;
	int first = rank < partner;
	for (int k = 0; k < nsizes; k++) {
		size_t n = sizes[k];
		uint32_t mine = (uint32_t)(round * 1000003 + rank * 7919 + k), theirs = (uint32_t)(round * 1000003 + partner * 7919 + k);
		fill(s, n, mine);
		memset(r, 0, n);
		if (first) {
			MPI_Send(s, (int)n, MPI_BYTE, partner, k, MPI_COMM_WORLD);
			MPI_Recv(r, (int)n, MPI_BYTE, partner, k, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		} else {
			MPI_Recv(r, (int)n, MPI_BYTE, partner, k, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			MPI_Send(s, (int)n, MPI_BYTE, partner, k, MPI_COMM_WORLD);
		}
		check(r, n, theirs, "p2p", partner);
	}
}

#define NB 16
#define STRIDE 140000 /* more than the longest nonblock message */

static void nonblock(uint8_t *s, uint8_t *r, int round)
{
	int partner = (rank + size / 2) % size;
	size_t n = 3001;
	MPI_Request req[2 * NB];
	for (int i = 0; i < NB; i++) {
		size_t len = n * (i % 5 + 1) + (size_t)i * 4096 * (i % 3);
		MPI_Irecv(r + i * STRIDE, (int)len, MPI_BYTE, partner, 100 + i, MPI_COMM_WORLD, &req[i]);
	}
	for (int i = 0; i < NB; i++) {
		size_t len = n * (i % 5 + 1) + (size_t)i * 4096 * (i % 3);
		fill(s + i * STRIDE, len, (uint32_t)(round * 31 + rank * 131 + i));
		MPI_Isend(s + i * STRIDE, (int)len, MPI_BYTE, partner, 100 + i, MPI_COMM_WORLD, &req[NB + i]);
	}
	for (int i = 2 * NB - 1; i >= 0; i--)
		MPI_Wait(&req[i], MPI_STATUS_IGNORE);
	for (int i = 0; i < NB; i++) {
		size_t len = n * (i % 5 + 1) + (size_t)i * 4096 * (i % 3);
		check(r + i * STRIDE, len, (uint32_t)(round * 31 + partner * 131 + i), "isend/irecv", partner);
	}
}

static void wildcard(uint8_t *s, uint8_t *r, int round)
{
	const int per = 4;
	if (rank == 0) {
		for (int i = 0; i < per * (size - 1); i++) {
			MPI_Status st;
			MPI_Recv(r, 1 << 16, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st);
			int n;
			MPI_Get_count(&st, MPI_BYTE, &n);
			int j = st.MPI_TAG - 200;
			if (j < 0 || j >= per || n != 100 + 997 * j + st.MPI_SOURCE) {
				if (bad++ < 5)
					fprintf(stderr, "rank 0: wildcard: source %d tag %d count %d\n", st.MPI_SOURCE, st.MPI_TAG, n);
				continue;
			}
			check(r, n, (uint32_t)(round * 7 + st.MPI_SOURCE * 13 + j), "wildcard", st.MPI_SOURCE);
		}
	} else {
		for (int j = 0; j < per; j++) {
			int n = 100 + 997 * j + rank;
			fill(s, n, (uint32_t)(round * 7 + rank * 13 + j));
			MPI_Send(s, n, MPI_BYTE, 0, 200 + j, MPI_COMM_WORLD);
		}
	}
}

static void coll(uint8_t *s, uint8_t *r, int round, size_t max)
{
	size_t counts[] = {1, 1000, 1 << 18};
	for (int c = 0; c < 3; c++) {
		size_t n = counts[c];
		if (n * sizeof(int64_t) > max)
			continue;
		int64_t *a = (int64_t *)s, *b = (int64_t *)r;
		for (size_t i = 0; i < n; i++)
			a[i] = (int64_t)(i * 3 + rank + round);
		MPI_Allreduce(a, b, (int)n, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
		for (size_t i = 0; i < n; i++) {
			int64_t want = (int64_t)size * (int64_t)(i * 3 + round) + (int64_t)size * (size - 1) / 2;
			if (b[i] != want) {
				if (bad++ < 5)
					fprintf(stderr, "rank %d: allreduce[%zu] of %zu = %lld, want %lld\n", rank, i, n, (long long)b[i],
						(long long)want);
				break;
			}
		}
	}
	size_t per[] = {8, 5000, 200000};
	for (int c = 0; c < 3; c++) {
		size_t n = per[c];
		if (n * size > max)
			continue;
		for (int d = 0; d < size; d++)
			fill(s + d * n, n, (uint32_t)(round * 101 + rank * 17 + d));
		MPI_Alltoall(s, (int)n, MPI_BYTE, r, (int)n, MPI_BYTE, MPI_COMM_WORLD);
		for (int src = 0; src < size; src++)
			check(r + src * n, n, (uint32_t)(round * 101 + src * 17 + rank), "alltoall", src);
	}
	size_t bsz[] = {4, 70000, 1 << 20};
	for (int c = 0; c < 3; c++) {
		size_t n = bsz[c];
		if (n > max)
			continue;
		for (int root = 0; root < size; root++) {
			uint8_t *b = rank == root ? s : r;
			if (rank == root)
				fill(b, n, (uint32_t)(round * 3 + root + c));
			MPI_Bcast(b, (int)n, MPI_BYTE, root, MPI_COMM_WORLD);
			if (rank != root)
				check(b, n, (uint32_t)(round * 3 + root + c), "bcast", root);
		}
	}
}

int main(int argc, char **argv)
{
	double seconds = 0;
	size_t max = 4 << 20;
	int opt, barrier = 0;
	while ((opt = getopt(argc, argv, "bt:m:")) != -1) {
		if (opt == 'b')
			barrier = 1;
		else if (opt == 't')
			seconds = atof(optarg);
		else if (opt == 'm')
			max = (size_t)atol(optarg);
	}
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (barrier)
		MPI_Barrier(MPI_COMM_WORLD);
	if (size < 2 || size % 2) {
		if (!rank)
			fprintf(stderr, "run with an even number of ranks\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	add(0, max);
	for (size_t p = 1; p <= max; p *= 2) {
		add(p - 1, max);
		add(p, max);
		add(p + 1, max);
	}
	size_t odd[] = {3, 7, 13, 61, 63, 65, 127, 255, 257, 1000, 4093, 4099, 12345, 32767, 32769, 65537, 100003, 999999, 3000017};
	for (size_t i = 0; i < sizeof odd / sizeof *odd; i++)
		add(odd[i], max);
	size_t bufsz = max > NB * STRIDE ? max : NB * STRIDE;
	if (bufsz < (size_t)size * 200000)
		bufsz = (size_t)size * 200000;
	if (bufsz < (1 << 21))
		bufsz = 1 << 21;
	uint8_t *s = malloc(bufsz), *r = malloc(bufsz);
	double t0 = MPI_Wtime();
	for (int round = 0;; round++) {
		p2p(s, r, round);
		nonblock(s, r, round);
		wildcard(s, r, round);
		coll(s, r, round, bufsz);
		int more = seconds > 0 && MPI_Wtime() - t0 < seconds;
		MPI_Bcast(&more, 1, MPI_INT, 0, MPI_COMM_WORLD);
		if (!rank && seconds > 0) {
			printf("round %d ok at %.1fs\n", round, MPI_Wtime() - t0);
			fflush(stdout);
		}
		if (!more)
			break;
	}
	int anybad = 0;
	MPI_Allreduce(&bad, &anybad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
	if (!rank) {
		printf("%d sizes from 0 to %zu bytes; %s\n", nsizes, max, anybad ? "data MISMATCH" : "data ok");
		fflush(stdout);
	}
	free(s);
	free(r);
	MPI_Finalize();
	return anybad ? 1 : 0;
}
