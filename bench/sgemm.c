/*
 * sgemm.c - the best fp32 GEMM rate of the engine's BLAS on this machine.
 *
 * Goes through gpu_blas_init() and gpu_gemm() with fp32 operands, so it measures the
 * library and kernel set the engine itself uses. Shapes: squares 512, 1024, 2048 and the
 * GEMMs of one training step of the MLP 784-1024-1024-10 at batch 256 (forward Y = X W^T,
 * backward dX = dY W and dW = dY^T X). For each shape the rate is the best of a few timed
 * batches of calls after a warm-up call. The last line is machine-readable:
 *   best_sgemm_gflops <value>
 *
 * Usage: sgemm [-t threads] [-s seconds per batch]   (defaults: 2 threads, 0.2 s)
 * Threads: single-threaded driver; the BLAS uses its own threads.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gpu/gpu.h"

typedef struct {
    const char *name;
    bool ta, tb;
    int M, N, K;
} shape;

static const shape shapes[] = {
    {"square 512", false, false, 512, 512, 512},
    {"square 1024", false, false, 1024, 1024, 1024},
    {"square 2048", false, false, 2048, 2048, 2048},
    {"fwd fc1 X.W1^T", false, true, 256, 1024, 784},
    {"fwd fc2 X.W2^T", false, true, 256, 1024, 1024},
    {"fwd fc3 X.W3^T", false, true, 256, 10, 1024},
    {"bwd fc3 dX=dY.W3", false, false, 256, 1024, 10},
    {"bwd fc2 dX=dY.W2", false, false, 256, 1024, 1024},
    {"bwd fc1 dX=dY.W1", false, false, 256, 784, 1024},
    {"bwd fc3 dW=dY^T.X", true, false, 10, 1024, 256},
    {"bwd fc2 dW=dY^T.X", true, false, 1024, 1024, 256},
    {"bwd fc1 dW=dY^T.X", true, false, 1024, 784, 256},
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static float *random_matrix(size_t n, unsigned *seed)
{
    float *m = malloc(n * sizeof *m);
    if (m == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        m[i] = (float)(*seed >> 8) * (1.0f / 16777216.0f) - 0.5f;
    }
    return m;
}

/* Best GFLOP/s of one shape, or a negative GPU_E* code. */
static double measure(const shape *s, double batch_s)
{
    unsigned seed = 12345u;
    int lda = s->ta ? s->M : s->K, ldb = s->tb ? s->K : s->N;
    float *A = random_matrix((size_t)s->M * (size_t)s->K, &seed);
    float *B = random_matrix((size_t)s->K * (size_t)s->N, &seed);
    float *C = random_matrix((size_t)s->M * (size_t)s->N, &seed);
    double best = 0.0, flops = 2.0 * s->M * s->N * (double)s->K;
    int rc = GPU_ENOMEM;
    if (A == NULL || B == NULL || C == NULL)
        goto fail;
    rc = gpu_gemm(s->ta, s->tb, s->M, s->N, s->K, A, GPU_FP32, lda, B, GPU_FP32, ldb, 0.0f,
                  C, s->N, NULL);
    if (rc != 0)
        goto fail;
    for (int batch = 0; batch < 3; batch++) {
        int calls = 0;
        double t0 = now(), t;
        do {
            gpu_gemm(s->ta, s->tb, s->M, s->N, s->K, A, GPU_FP32, lda, B, GPU_FP32, ldb, 0.0f,
                     C, s->N, NULL);
            calls++;
            t = now() - t0;
        } while (t < batch_s);
        double rate = flops * calls / t * 1e-9;
        if (rate > best)
            best = rate;
    }
fail:
    free(A);
    free(B);
    free(C);
    return rc != 0 ? rc : best;
}

int main(int argc, char **argv)
{
    int threads = 2, opt;
    double batch_s = 0.2;
    while ((opt = getopt(argc, argv, "t:s:")) != -1) {
        if (opt == 't') {
            threads = atoi(optarg);
        } else if (opt == 's') {
            batch_s = atof(optarg);
        } else {
            fprintf(stderr, "usage: %s [-t threads] [-s seconds per batch]\n", argv[0]);
            return EXIT_FAILURE;
        }
    }
    int rc = gpu_blas_init(threads);
    if (rc != 0) {
        fprintf(stderr, "sgemm: %s\n", gpu_strerror(rc));
        return EXIT_FAILURE;
    }
    printf("# %s\n", gpu_blas_info());
    printf("# %-20s %2s %2s %5s %5s %5s %9s\n", "shape", "ta", "tb", "M", "N", "K", "GFLOP/s");
    double best = 0.0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const shape *s = &shapes[i];
        double g = measure(s, batch_s);
        if (g < 0) {
            fprintf(stderr, "sgemm: %s: %s\n", s->name, gpu_strerror((int)g));
            return EXIT_FAILURE;
        }
        printf("  %-20s %2d %2d %5d %5d %5d %9.1f\n", s->name, s->ta, s->tb, s->M, s->N, s->K,
               g);
        fflush(stdout);
        if (g > best)
            best = g;
    }
    printf("best_sgemm_gflops %.1f\n", best);
    return EXIT_SUCCESS;
}
