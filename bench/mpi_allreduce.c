/* Open MPI on its own for bench/backends: MPI_Allreduce (in place, float32 sum) timed as bench/backends.lua times dlua's, so the mpi column can be read against the engine's own speed. */
/* usage: mpicc -O2 bench/mpi_allreduce.c -o X; mpirun -np N X <sizes in bytes, comma-separated> <repeats>
   Rank 0 prints `bytes<TAB>seconds<TAB>busbw GB/s` per size; seconds = median over repeats of the slowest rank. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int reps(long bytes, int repeats) {  // the schedule of bench/backends.lua
  int r = repeats;
  if (bytes >= 256L << 20) r = repeats / 6 > 3 ? repeats / 6 : 3;
  else if (bytes >= 64L << 20) r = repeats / 3 > 3 ? repeats / 3 : 3;
  else if (bytes >= 16L << 20) r = repeats / 2 > 5 ? repeats / 2 : 5;
  return r;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc < 3) {
    if (rank == 0) fprintf(stderr, "usage: mpi_allreduce <sizes in bytes, comma-separated> <repeats>\n");
    MPI_Finalize();
    return 2;
  }
  int repeats = atoi(argv[2]);
  double factor = 2.0 * (size - 1) / size;
  for (char *s = strtok(argv[1], ","); s; s = strtok(NULL, ",")) {
    long bytes = atol(s), n = bytes / 4;
    float *buf = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));  // (n)
    if (!buf) MPI_Abort(MPI_COMM_WORLD, 1);
    for (long i = 0; i < n; i++) buf[i] = 1.0f;
    int k = reps(bytes, repeats);
    for (int w = 0; w < (bytes >= 64L << 20 ? 1 : 3); w++)
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double *t = malloc((size_t)k * sizeof(double));  // (k)
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < k; i++) {  // back to back, as nccl-tests time them
      double t0 = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      t[i] = MPI_Wtime() - t0;
    }
    MPI_Allreduce(MPI_IN_PLACE, t, k, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    qsort(t, (size_t)k, sizeof(double), cmp);
    double med = k % 2 ? t[k / 2] : (t[k / 2 - 1] + t[k / 2]) / 2;
    if (rank == 0) printf("%ld\t%.6g\t%.4f\n", bytes, med, factor * bytes / med / 1e9);
    fflush(stdout);
    free(t);
    free(buf);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  MPI_Finalize();
  return 0;
}
