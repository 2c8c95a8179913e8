/* MPI latency and bandwidth between ranks 0 and 1, in the style of
 * osu_latency and osu_bw, for make bench-mpi (integration/mpi_bench_test.go).
 *
 *   mpibench [-l MAXLAT] [-b MAXBW] [-n ITERATIONS] [-w WARMUP_SECONDS] [-r REPEAT] [-s MINBW]
 *
 * A warm-up of small ping-pongs (0.5 s by default) comes first, so that
 * every transport is measured in its steady state (a transport that sets
 * up a fast path after the first messages has done so).
 * Prints, rank 0:
 *   lat SIZE USEC_ONE_WAY      ping-pong, 0 B and powers of two up to MAXLAT
 *   bw SIZE MB_PER_S           windows of 64 outstanding isends and one
 *                              ack, powers of two from 8 B up to MAXBW
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
	while ((opt = getopt(argc, argv, "l:b:n:w:r:s:")) != -1) {
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
	}
	MPI_Init(&argc, &argv);
	int rank, size;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (size != 2) {
		if (!rank)
			fprintf(stderr, "run with 2 ranks\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	size_t max = maxlat > maxbw ? maxlat : maxbw;
	uint8_t *buf = malloc(max), *rbuf = malloc(max);
	int bad = 0;
	for (double t0 = MPI_Wtime();;) { /* warm-up: rank 0 says when it is over */
		for (int i = 0; i < 100; i++) {
			if (rank == 0) {
				MPI_Send(buf, 8, MPI_BYTE, 1, 9, MPI_COMM_WORLD);
				MPI_Recv(rbuf, 8, MPI_BYTE, 1, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			} else {
				MPI_Recv(rbuf, 8, MPI_BYTE, 0, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				MPI_Send(rbuf, 8, MPI_BYTE, 0, 9, MPI_COMM_WORLD);
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
			if (rank == 0) {
				MPI_Send(buf, (int)n, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
				MPI_Recv(rbuf, (int)n, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			} else {
				MPI_Recv(rbuf, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				MPI_Send(rbuf, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
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
					if (rank == 0)
						MPI_Isend(buf, (int)n, MPI_BYTE, 1, 2, MPI_COMM_WORLD, &req[i]);
					else
						MPI_Irecv(rbuf, (int)n, MPI_BYTE, 0, 2, MPI_COMM_WORLD, &req[i]);
				}
				MPI_Waitall(WINDOW, req, MPI_STATUSES_IGNORE);
				if (rank == 0)
					MPI_Recv(rbuf, 1, MPI_BYTE, 1, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				else
					MPI_Send(buf, 1, MPI_BYTE, 0, 3, MPI_COMM_WORLD);
			}
			double t = MPI_Wtime() - t0;
			if (pass && rank == 0)
				printf("bw %zu %.1f\n", n, (double)n * WINDOW * nw / t / 1e6);
		}
		if (rank == 1 && !check(rbuf, n, 7))
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
