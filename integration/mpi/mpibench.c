/* MPI latency and bandwidth between pairs of ranks, in the style of
 * osu_latency and osu_bw (osu_multi_lat with more than 2 ranks), for make
 * bench-mpi (integration/mpi_bench_test.go).
 *
 *   mpibench [-l MAXLAT] [-b MAXBW] [-n ITERATIONS] [-w WARMUP_SECONDS] [-r REPEAT] [-s MINBW] [-a A2A_ITERATIONS]
 *            [-A ALLREDUCE_ITERATIONS] [-B BIBW_SIZE]
 *
 * An even number of ranks: rank i < N/2 pairs with rank i + N/2 (with the
 * ranks split evenly between two guests in rank order, every pair crosses
 * them), and all pairs run at once; rank 0 prints its pair's figures.
 * -a adds an 8-byte MPI_Alltoall over all ranks, after the ping-pongs;
 * -A an 8-byte MPI_Allreduce (a sum of one int64); -B the bandwidth of
 * every pair sending both ways at once, at one size (as osu_bibw).
 * -b 0 leaves the bandwidth out.
 *
 * A warm-up of small ping-pongs (0.5 s by default) comes first, so that
 * every transport is measured in its steady state (a transport that sets
 * up a fast path after the first messages has done so).
 * Prints, rank 0:
 *   lat SIZE USEC_ONE_WAY      ping-pong, 0 B and powers of two up to MAXLAT
 *   bw SIZE MB_PER_S           windows of 64 outstanding isends and one
 *                              ack, powers of two from 8 B up to MAXBW
 *   a2a 8 USEC                 with -a: one MPI_Alltoall of 8 B a rank
 *   ar 8 USEC                  with -A: one MPI_Allreduce of 8 B
 *   bibw SIZE MB_PER_S         with -B: both directions' bytes, windows
 *                              of 64 isends and 64 irecvs on each side
 *   data ok | data MISMATCH    every received buffer is checked */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WINDOW 64

static void fill(uint8_t *b, size_t n, int seed)
{
	for (size_t i = 0; i < n; i++)
		b[i] = (uint8_t)(i * 31 + seed);
}

static int check(const uint8_t *b, size_t n, int seed)
{
	for (size_t i = 0; i < n; i++)
		if (b[i] != (uint8_t)(i * 31 + seed))
			return 0;
	return 1;
}

int main(int argc, char **argv)
{
	size_t maxlat = 1 << 20, maxbw = 4 << 20;
	int opt, small = 4000; /* ping-pongs per size up to 8 KiB */
	double warmup = 0.5;
	int repeat = 1; /* bandwidth passes per size (for profiling) */
	size_t minbw = 8;
	int a2a = 0, ar = 0;
	size_t bibw = 0;
	while ((opt = getopt(argc, argv, "l:b:n:w:r:s:a:A:B:")) != -1) {
		if (opt == 'l')
			maxlat = (size_t)atol(optarg);
		else if (opt == 'b')
			maxbw = (size_t)atol(optarg);
		else if (opt == 'n')
			small = atoi(optarg);
		else if (opt == 'w')
			warmup = atof(optarg);
		else if (opt == 'r')
			repeat = atoi(optarg);
		else if (opt == 's')
			minbw = (size_t)atol(optarg);
		else if (opt == 'a')
			a2a = atoi(optarg);
		else if (opt == 'A')
			ar = atoi(optarg);
		else if (opt == 'B')
			bibw = (size_t)atol(optarg);
	}
	MPI_Init(&argc, &argv);
	int rank, size;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (size < 2 || size % 2) {
		if (!rank)
			fprintf(stderr, "run with an even number of ranks\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	/* first: the pair's rank 0 side, which sends first */
	int first = rank < size / 2, peer = first ? rank + size / 2 : rank - size / 2;
	size_t max = maxlat > maxbw ? maxlat : maxbw;
	if (bibw > max)
		max = bibw;
	uint8_t *buf = malloc(max + 8 * size), *rbuf = malloc(max + 8 * size);
	int bad = 0;
	for (double t0 = MPI_Wtime();;) { /* warm-up: rank 0 says when it is over */
		for (int i = 0; i < 100; i++) {
			if (first) {
				MPI_Send(buf, 8, MPI_BYTE, peer, 9, MPI_COMM_WORLD);
				MPI_Recv(rbuf, 8, MPI_BYTE, peer, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			} else {
				MPI_Recv(rbuf, 8, MPI_BYTE, peer, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				MPI_Send(rbuf, 8, MPI_BYTE, peer, 9, MPI_COMM_WORLD);
			}
		}
		int more = MPI_Wtime() - t0 < warmup;
		MPI_Bcast(&more, 1, MPI_INT, 0, MPI_COMM_WORLD);
		if (!more)
			break;
	}
	for (size_t n = 0; n <= maxlat; n = n ? n * 2 : 1) {
		int iters = n <= 8192 ? small : n <= 131072 ? 400 : 60, warm = iters / 10;
		fill(buf, n, (int)n);
		double t0 = 0;
		for (int i = 0; i < iters + warm; i++) {
			if (i == warm) {
				MPI_Barrier(MPI_COMM_WORLD);
				t0 = MPI_Wtime();
			}
			if (first) {
				MPI_Send(buf, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
				MPI_Recv(rbuf, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			} else {
				MPI_Recv(rbuf, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				MPI_Send(rbuf, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
			}
		}
		if (!check(rbuf, n, (int)n))
			bad = 1;
		if (rank == 0)
			printf("lat %zu %.3f\n", n, (MPI_Wtime() - t0) * 1e6 / (2.0 * iters));
	}
	for (size_t n = minbw; n <= maxbw; n *= 2) {
		/* About 64 MiB per size, at least 5 windows. */
		size_t w = (64u << 20) / (WINDOW * n);
		int windows = w < 5 ? 5 : w > 400 ? 400 : (int)w;
		MPI_Request req[WINDOW];
		fill(buf, n, 7);
		memset(rbuf, 0, n);
		for (int pass = 0; pass <= repeat; pass++) { /* a warm-up window set, then the measured ones */
			int nw = pass ? windows : 2;
			MPI_Barrier(MPI_COMM_WORLD);
			double t0 = MPI_Wtime();
			for (int k = 0; k < nw; k++) {
				for (int i = 0; i < WINDOW; i++) {
					if (first)
						MPI_Isend(buf, (int)n, MPI_BYTE, peer, 2, MPI_COMM_WORLD, &req[i]);
					else
						MPI_Irecv(rbuf, (int)n, MPI_BYTE, peer, 2, MPI_COMM_WORLD, &req[i]);
				}
				MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
				if (first)
					MPI_Recv(rbuf, 1, MPI_BYTE, peer, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				else
					MPI_Send(buf, 1, MPI_BYTE, peer, 3, MPI_COMM_WORLD);
			}
			double t = MPI_Wtime() - t0;
			if (pass && rank == 0)
				printf("bw %zu %.1f\n", n, (double)n * WINDOW * nw / t / 1e6);
		}
		if (!first && !check(rbuf, n, 7))
			bad = 1;
	}
	if (a2a > 0) {
		/* rank r sends 8 bytes to each rank, seeded by sender and receiver */
		for (int j = 0; j < size; j++)
			fill(buf + 8 * j, 8, rank * size + j);
		double t0 = 0;
		for (int i = 0; i < a2a + a2a / 10; i++) {
			if (i == a2a / 10) {
				MPI_Barrier(MPI_COMM_WORLD);
				t0 = MPI_Wtime();
			}
			MPI_Alltoall(buf, 8, MPI_BYTE, rbuf, 8, MPI_BYTE, MPI_COMM_WORLD);
		}
		double t = MPI_Wtime() - t0;
		for (int j = 0; j < size; j++)
			if (!check(rbuf + 8 * j, 8, j * size + rank))
				bad = 1;
		if (rank == 0)
			printf("a2a 8 %.3f\n", t * 1e6 / a2a);
	}
	if (ar > 0) {
		int64_t v = rank + 1, sum = 0;
		double t0 = 0;
		for (int i = 0; i < ar + ar / 10; i++) {
			if (i == ar / 10) {
				MPI_Barrier(MPI_COMM_WORLD);
				t0 = MPI_Wtime();
			}
			MPI_Allreduce(&v, &sum, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
			if (sum != (int64_t)size * (size + 1) / 2)
				bad = 1;
		}
		if (rank == 0)
			printf("ar 8 %.3f\n", (MPI_Wtime() - t0) * 1e6 / ar);
	}
	if (bibw > 0) {
		size_t n = bibw, w = (64u << 20) / (WINDOW * n);
		int windows = w < 5 ? 5 : w > 400 ? 400 : (int)w;
		MPI_Request req[2 * WINDOW];
		fill(buf, n, 11); /* both sides send the same bytes */
		memset(rbuf, 0, n);
		for (int pass = 0; pass <= 1; pass++) { /* a warm-up window set, then the measured ones */
			int nw = pass ? windows : 2;
			MPI_Barrier(MPI_COMM_WORLD);
			double t0 = MPI_Wtime();
			for (int k = 0; k < nw; k++) {
				for (int i = 0; i < WINDOW; i++)
					MPI_Irecv(rbuf, (int)n, MPI_BYTE, peer, 4, MPI_COMM_WORLD, &req[i]);
				for (int i = 0; i < WINDOW; i++)
					MPI_Isend(buf, (int)n, MPI_BYTE, peer, 4, MPI_COMM_WORLD, &req[WINDOW + i]);
				MPI_Waitall(2 * WINDOW, req, MPI_STATUSES_IGNORE);
			}
			double t = MPI_Wtime() - t0;
			if (pass && rank == 0)
				printf("bibw %zu %.1f\n", n, 2.0 * n * WINDOW * nw / t / 1e6);
		}
		if (!check(rbuf, n, 11))
			bad = 1;
	}
	int anybad = 0;
	MPI_Allreduce(&bad, &anybad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
	if (rank == 0)
		printf(anybad ? "data MISMATCH\n" : "data ok\n");
	free(buf);
	free(rbuf);
	MPI_Finalize();
	return anybad;
}
