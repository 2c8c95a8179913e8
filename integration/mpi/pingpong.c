/* MPI ping-pong latency and streaming bandwidth between ranks 0 and 1, in
 * the style of osu_latency and osu_bw. Prints one line per size:
 *   lat SIZE USEC_ONE_WAY
 *   bw SIZE MB_PER_S
 * and checks every received buffer's contents. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void fill(char *b, int n, int seed) { for (int i = 0; i < n; i++) b[i] = (char)(i * 31 + seed); }
static int check(const char *b, int n, int seed)
{
	for (int i = 0; i < n; i++)
		if (b[i] != (char)(i * 31 + seed))
			return 0;
	return 1;
}

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	int rank, size;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (size != 2) {
		if (!rank)
			fprintf(stderr, "run with 2 ranks\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	int max = argc > 1 ? atoi(argv[1]) : 1 << 20;
	char *buf = malloc(max), *rbuf = malloc(max);
	int bad = 0;
	for (int n = 0; n <= max; n = n ? n * 2 : 1) {
		int iters = n <= 8192 ? 2000 : 200, warm = iters / 10;
		fill(buf, n, n);
		double t0 = 0;
		for (int i = 0; i < iters + warm; i++) {
			if (i == warm) {
				MPI_Barrier(MPI_COMM_WORLD);
				t0 = MPI_Wtime();
			}
			if (rank == 0) {
				MPI_Send(buf, n, MPI_CHAR, 1, 1, MPI_COMM_WORLD);
				MPI_Recv(rbuf, n, MPI_CHAR, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			} else {
				MPI_Recv(rbuf, n, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				MPI_Send(rbuf, n, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
			}
		}
		if (!check(rbuf, n, n))
			bad = 1;
		if (rank == 0)
			printf("lat %d %.3f\n", n, (MPI_Wtime() - t0) * 1e6 / (2.0 * iters));
	}
	/* Bandwidth: windows of 64 outstanding sends, one ack per window. */
	int sizes[] = {65536, 1 << 20};
	for (int s = 0; s < 2; s++) {
		int n = sizes[s];
		if (n > max)
			continue;
		int windows = n <= 65536 ? 40 : 8;
		MPI_Request req[64];
		fill(buf, n, 7);
		MPI_Barrier(MPI_COMM_WORLD);
		double t0 = MPI_Wtime();
		for (int w = 0; w < windows; w++) {
			for (int i = 0; i < 64; i++) {
				if (rank == 0)
					MPI_Isend(buf, n, MPI_CHAR, 1, 2, MPI_COMM_WORLD, &req[i]);
				else
					MPI_Irecv(rbuf, n, MPI_CHAR, 0, 2, MPI_COMM_WORLD, &req[i]);
			}
			MPI_Waitall(64, req, MPI_STATUSES_IGNORE);
			if (rank == 0)
				MPI_Recv(rbuf, 1, MPI_CHAR, 1, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			else
				MPI_Send(buf, 1, MPI_CHAR, 0, 3, MPI_COMM_WORLD);
		}
		double t = MPI_Wtime() - t0;
		if (rank == 1 && !check(rbuf, n, 7))
			bad = 1;
		if (rank == 0)
			printf("bw %d %.1f\n", n, (double)n * 64 * windows / t / 1e6);
	}
	int anybad = 0;
	MPI_Allreduce(&bad, &anybad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
	if (rank == 0)
		printf(anybad ? "data MISMATCH\n" : "data ok\n");
	MPI_Finalize();
	return anybad;
}
