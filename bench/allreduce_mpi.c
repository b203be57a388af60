/* OpenMPI's MPI_Allreduce on f32, swept like `hvd bench allreduce`, for bench/allreduce.sh.
 * Prints one JSON object per size: median and p99 of the slowest rank per iteration, algbw, busbw.
 * `allreduce_mpi --memcpy [MAX_BYTES]` (no mpirun) prints the single-thread memcpy bandwidth of a 256 MiB buffer
 * instead, then of every sweep size from 64 KiB to MAX_BYTES. `allreduce_mpi --handoff` (no mpirun) prints what one
 * handoff between two threads bound to the same CPU costs (each waits for its turn with sched_yield, as ranks
 * beyond cores do): the floor under an allreduce of more ranks than cores, where every core must run each of its
 * ranks once per operation, so passes between them at least twice. */
#define _GNU_SOURCE
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median bandwidth of 7 rounds of `reps` copies of `n` bytes between the same two buffers (as an allreduce
 * benchmark reuses its buffers). */
static double memcpy_gbps(char *a, char *b, size_t n, size_t reps) {
    double t[7];
    for (int i = 0; i < 7; i++) {
        double s = now();
        for (size_t r = 0; r < reps; r++) memcpy(r % 2 ? a : b, r % 2 ? b : a, n);
        t[i] = (now() - s) / reps;
        a[i] = b[n - 1 - i]; /* keep the copies observable */
    }
    qsort(t, 7, sizeof t[0], cmp);
    return n / t[3] / 1e9;
}

/* The 256 MiB line, then one line per allreduce size from 64 KiB up to `max_bytes` (x4 steps, as the sweep). */
static int memcpy_bandwidth(size_t max_bytes) {
    size_t n = (size_t)256 << 20;
    if (max_bytes > n) n = max_bytes;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) return 1;
    memset(a, 1, n);
    memset(b, 2, n);
    printf("{\"memcpy_bytes\": %zu, \"memcpy_gbps\": %.3f}\n", (size_t)256 << 20,
           memcpy_gbps(a, b, (size_t)256 << 20, 1));
    for (size_t bytes = 4; bytes <= max_bytes; bytes *= 4) {
        if (bytes < ((size_t)64 << 10)) continue;
        size_t reps = ((size_t)256 << 20) / bytes;
        printf("{\"memcpy_bytes\": %zu, \"memcpy_gbps\": %.3f, \"per_size\": true}\n", bytes,
               memcpy_gbps(a, b, bytes, reps < 1 ? 1 : reps));
    }
    free(a);
    free(b);
    return 0;
}

static _Atomic long turn;
#define HANDOFFS 200000L

/* One of two threads on CPU 0 taking turns HANDOFFS times each. */
static void *take_turns(void *arg) {
    long me = (long)arg;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(0, &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    for (long i = 0; i < HANDOFFS; i++) {
        while (atomic_load(&turn) % 2 != me) sched_yield();
        atomic_fetch_add(&turn, 1);
    }
    return NULL;
}

/* The median over 5 rounds of the time of one handoff between two threads sharing CPU 0, in microseconds. */
static int handoff(void) {
    double t[5];
    for (int round = 0; round < 5; round++) {
        pthread_t threads[2];
        atomic_store(&turn, 0);
        double start = now();
        for (long i = 0; i < 2; i++) pthread_create(&threads[i], NULL, take_turns, (void *)i);
        for (int i = 0; i < 2; i++) pthread_join(threads[i], NULL);
        t[round] = (now() - start) / (2.0 * HANDOFFS) * 1e6;
    }
    qsort(t, 5, sizeof t[0], cmp);
    printf("{\"handoff_us\": %.3f}\n", t[2]);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--handoff") == 0) return handoff();
    if (argc > 1 && strcmp(argv[1], "--memcpy") == 0)
        return memcpy_bandwidth(argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)256 << 20);
    size_t max_bytes = (size_t)256 << 20;
    if (argc > 1) max_bytes = strtoull(argv[1], NULL, 10);
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    float *buf = malloc(max_bytes), *out = malloc(max_bytes);
    for (size_t i = 0; i < max_bytes / 4; i++) buf[i] = 1.0f;
    for (size_t bytes = 4; bytes <= max_bytes; bytes *= 4) {
        size_t iters = ((size_t)512 << 20) / bytes;
        if (iters < 5) iters = 5;
        if (iters > 1000) iters = 1000;
        int count = (int)(bytes / 4);
        size_t warm = iters / 5 < 1 ? 1 : (iters / 5 > 200 ? 200 : iters / 5); /* as hvd bench */
        for (size_t i = 0; i < warm; i++) MPI_Allreduce(buf, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double *t = malloc(iters * sizeof(double)), *worst = malloc(iters * sizeof(double));
        for (size_t i = 0; i < iters; i++) {
            double s = now();
            MPI_Allreduce(buf, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            t[i] = now() - s;
        }
        MPI_Allreduce(t, worst, (int)iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        qsort(worst, iters, sizeof(double), cmp);
        double med = worst[(size_t)((iters - 1) * 0.5 + 0.5)];
        double p99 = worst[(size_t)((iters - 1) * 0.99 + 0.5)];
        double algbw = bytes / med / 1e9;
        if (rank == 0)
            printf("{\"backend\": \"openmpi\", \"ranks\": %d, \"bytes\": %zu, \"iters\": %zu, \"median_us\": %.3f, "
                   "\"p99_us\": %.3f, \"algbw_gbps\": %.4f, \"busbw_gbps\": %.4f}\n",
                   size, bytes, iters, med * 1e6, p99 * 1e6, algbw, algbw * 2.0 * (size - 1) / size);
        fflush(stdout);
        free(t);
        free(worst);
    }
    free(buf);
    free(out);
    MPI_Finalize();
    return 0;
}
