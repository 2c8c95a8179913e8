/* An application kernel for make bench-mpi: a 2D five-point stencil (heat
 * diffusion) on a periodic grid split into blocks, one per rank, with a
 * halo exchange of each block's four edges every iteration, as MPI codes
 * for PDEs do (integration/mpi_bench_test.go).
 *
 *   stencil [-n BLOCK] [-i ITERATIONS] [-w WARMUP_SECONDS]
 *
 * Ranks form a 2 x (P/2) grid (P even), so with two ranks per guest half
 * the neighbours are in the other guest. Iterations run untimed for the
 * warm-up first (0.5 s by default: a long run's setup is amortised), then
 * the grid starts over and ITERATIONS are timed. Prints, rank 0:
 *   stencil P BLOCK ITERATIONS comm_us C compute_us X total_s T checksum S
 * where C is the mean time per iteration spent in the exchange
 * (isend/irecv/waitall of four edges, the slowest rank's) and the checksum
 * is the same whatever carries the halos. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct grid {
	int n, w; /* block side, and with a halo cell on each side */
	int up, down, left, right;
	double *a, *b;              /* this iteration's cells, the next one's */
	double *sl, *sr, *rl, *rr;  /* left and right edges, sent and received */
};

/* step is one iteration: the halo exchange, then the stencil; it adds the
 * time of each to *comm and *comp. */
static void step(struct grid *g, double *comm, double *comp)
{
	int n = g->n, w = g->w;
	double *a = g->a, *b = g->b;
	double c0 = MPI_Wtime();
	for (int i = 0; i < n; i++) {
		g->sl[i] = a[(i + 1) * w + 1];
		g->sr[i] = a[(i + 1) * w + n];
	}
	MPI_Request q[8];
	MPI_Irecv(&a[1], n, MPI_DOUBLE, g->up, 1, MPI_COMM_WORLD, &q[0]);
	MPI_Irecv(&a[(n + 1) * w + 1], n, MPI_DOUBLE, g->down, 2, MPI_COMM_WORLD, &q[1]);
	MPI_Irecv(g->rl, n, MPI_DOUBLE, g->left, 3, MPI_COMM_WORLD, &q[2]);
	MPI_Irecv(g->rr, n, MPI_DOUBLE, g->right, 4, MPI_COMM_WORLD, &q[3]);
	MPI_Isend(&a[n * w + 1], n, MPI_DOUBLE, g->down, 1, MPI_COMM_WORLD, &q[4]);
	MPI_Isend(&a[w + 1], n, MPI_DOUBLE, g->up, 2, MPI_COMM_WORLD, &q[5]);
	MPI_Isend(g->sr, n, MPI_DOUBLE, g->right, 3, MPI_COMM_WORLD, &q[6]);
	MPI_Isend(g->sl, n, MPI_DOUBLE, g->left, 4, MPI_COMM_WORLD, &q[7]);
	MPI_Waitall(8, q, MPI_STATUSES_IGNORE);
	for (int i = 0; i < n; i++) {
		a[(i + 1) * w] = g->rl[i];
		a[(i + 1) * w + n + 1] = g->rr[i];
	}
	double c1 = MPI_Wtime();
	for (int i = 1; i <= n; i++)
		for (int j = 1; j <= n; j++)
			b[i * w + j] = 0.2 * (a[i * w + j] + a[(i - 1) * w + j] + a[(i + 1) * w + j] + a[i * w + j - 1] + a[i * w + j + 1]);
	g->a = b;
	g->b = a;
	*comm += c1 - c0;
	*comp += MPI_Wtime() - c1;
}

static void init(struct grid *g, int rank)
{
	memset(g->a, 0, (size_t)g->w * g->w * sizeof *g->a);
	for (int i = 1; i <= g->n; i++)
		for (int j = 1; j <= g->n; j++)
			g->a[i * g->w + j] = (double)((rank * 7919 + i * 131 + j * 17) % 1000) / 1000.0;
}

int main(int argc, char **argv)
{
	int n = 1024, iters = 300, opt;
	double warmup = 0.5;
	while ((opt = getopt(argc, argv, "n:i:w:")) != -1) {
		if (opt == 'n')
			n = atoi(optarg);
		else if (opt == 'i')
			iters = atoi(optarg);
		else if (opt == 'w')
			warmup = atof(optarg);
	}
	MPI_Init(&argc, &argv);
	int rank, size;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (size % 2) {
		if (!rank)
			fprintf(stderr, "run with an even number of ranks\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	int rows = 2, cols = size / 2, r = rank / cols, c = rank % cols;
	struct grid g = {.n = n, .w = n + 2};
	g.up = ((r + rows - 1) % rows) * cols + c;
	g.down = ((r + 1) % rows) * cols + c;
	g.left = r * cols + (c + cols - 1) % cols;
	g.right = r * cols + (c + 1) % cols;
	g.a = malloc((size_t)g.w * g.w * sizeof *g.a);
	g.b = calloc((size_t)g.w * g.w, sizeof *g.b);
	g.sl = malloc(n * sizeof *g.sl);
	g.sr = malloc(n * sizeof *g.sr);
	g.rl = malloc(n * sizeof *g.rl);
	g.rr = malloc(n * sizeof *g.rr);
	double comm = 0, comp = 0;
	init(&g, rank);
	for (double w0 = MPI_Wtime();;) { /* warm-up: rank 0 says when it is over */
		for (int i = 0; i < 20; i++)
			step(&g, &comm, &comp);
		int more = MPI_Wtime() - w0 < warmup;
		MPI_Bcast(&more, 1, MPI_INT, 0, MPI_COMM_WORLD);
		if (!more)
			break;
	}
	init(&g, rank);
	comm = comp = 0;
	MPI_Barrier(MPI_COMM_WORLD);
	double t0 = MPI_Wtime();
	for (int it = 0; it < iters; it++)
		step(&g, &comm, &comp);
	double total = MPI_Wtime() - t0, local = 0, sum = 0, maxcomm = 0, maxcomp = 0;
	for (int i = 1; i <= n; i++)
		for (int j = 1; j <= n; j++)
			local += g.a[i * g.w + j] * (double)((i * 3 + j) % 7 + 1);
	MPI_Reduce(&local, &sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
	MPI_Reduce(&comm, &maxcomm, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
	MPI_Reduce(&comp, &maxcomp, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
	if (!rank)
		printf("stencil %d %d %d comm_us %.2f compute_us %.2f total_s %.3f checksum %.9e\n", size, n, iters,
		       maxcomm * 1e6 / iters, maxcomp * 1e6 / iters, total, sum);
	free(g.a);
	free(g.b);
	free(g.sl);
	free(g.sr);
	free(g.rl);
	free(g.rr);
	MPI_Finalize();
	return 0;
}
