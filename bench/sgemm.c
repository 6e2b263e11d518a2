/*
 * sgemm.c - the fp32 GEMM rate of the engine's GEMM library on this machine.
 *
 * Goes through gpu_blas_init() and gpu_gemm() with fp32 operands, so it measures the
 * library and kernel set the engine itself uses (AMPD_GEMM, where the engine honours it,
 * chooses between its libraries here as in a training run). For each shape the rate is
 * the best of 3 timed batches of calls (each batch at least -s seconds) after a warm-up
 * call.
 *
 * Shapes (--shapes):
 *   square  squares 512, 1024, 2048 only.
 *   mlp     the squares, then every GEMM of one training step of bench/mlp.sh's MLP
 *           784-1024-1024-10 at batch 256 (the default): forward Y = X W^T, backward
 *           dW = dY^T X of each layer and dX = dY W of every layer but the first (the
 *           engine computes no gradient for the input: gpu/mlp.c).
 *   gpt     the squares, then every GEMM shape of one training step of bench/gpt.sh's GPT
 *           (n_layer 4, d 256, 4 heads of 64, T 128, batch 16 = 2048 token rows, fc 4d,
 *           vocab 256, tied LM head): for each of qkv (768 x 256), attn proj (256 x 256),
 *           fc (1024 x 256), fc proj (256 x 1024) and lm_head (256 x 256) the forward
 *           X W^T, dW = dY^T X and dX = dY W, and the six per-head attention products of
 *           gpu/gpt.c (S = Q K^T, Y = P V, dV = P^T dY, dP = dY V^T, dQ = dS K,
 *           dK = dS^T Q: 128 x 128 x 64 or 128 x 64 x 128, with the strides of the
 *           fused qkv rows).
 *
 * Each step shape carries how many times one training step calls it ("per step": 4 for
 * a GPT block's linears, 1 for the LM head, batch x heads x layers = 256 for an attention
 * product, 1 for the MLP's). The machine-readable lines at the end:
 *   best_sgemm_gflops <value>   the best rate over the squares
 *   step_gemm_gflop <value>     the step's GEMM work: sum of per step x 2 M N K, in GFLOP
 *   step_sgemm_gflops <value>   that work divided by the time one step's GEMMs take at
 *                               the measured rates: sum(per step x flops) /
 *                               sum(per step x flops / rate) (not with --shapes square)
 *
 * Usage: sgemm [-t threads] [-s seconds per batch] [--shapes mlp|gpt|square]
 *        (defaults: 2 threads, 0.2 s, mlp)
 * Threads: single-threaded driver; the BLAS uses its own threads.
 */
#include <getopt.h>
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
    int lda, ldb, ldc; /* 0: packed (the smallest legal leading dimension) */
    int per_step;      /* calls in one training step; 0: a square, not part of a step */
} shape;

static const shape squares[] = {
    {"square 512", false, false, 512, 512, 512, 0, 0, 0, 0},
    {"square 1024", false, false, 1024, 1024, 1024, 0, 0, 0, 0},
    {"square 2048", false, false, 2048, 2048, 2048, 0, 0, 0, 0},
};

/* bench/mlp.sh: MLP 784-1024-1024-10, batch 256 */
static const shape mlp_step[] = {
    {"fwd fc1 X.W1^T", false, true, 256, 1024, 784, 0, 0, 0, 1},
    {"fwd fc2 X.W2^T", false, true, 256, 1024, 1024, 0, 0, 0, 1},
    {"fwd fc3 X.W3^T", false, true, 256, 10, 1024, 0, 0, 0, 1},
    {"bwd fc3 dW=dY^T.X", true, false, 10, 1024, 256, 0, 0, 0, 1},
    {"bwd fc3 dX=dY.W3", false, false, 256, 1024, 10, 0, 0, 0, 1},
    {"bwd fc2 dW=dY^T.X", true, false, 1024, 1024, 256, 0, 0, 0, 1},
    {"bwd fc2 dX=dY.W2", false, false, 256, 1024, 1024, 0, 0, 0, 1},
    {"bwd fc1 dW=dY^T.X", true, false, 1024, 784, 256, 0, 0, 0, 1},
};

/* bench/gpt.sh: n_layer 4, d 256, 4 heads (hd 64), T 128, batch 16, vocab 256 */
#define GPT_ROWS 2048 /* batch 16 x T 128 */
#define GPT_LAYERS 4
#define GPT_HEADS_ALL (16 * 4 * GPT_LAYERS) /* batch x heads x layers */
/* each linear (out x in weight W, 2048 token rows): Y = X W^T, dW = dY^T X, dX = dY W */
static const shape gpt_step[] = {
    {"fwd qkv X.W^T", false, true, GPT_ROWS, 768, 256, 0, 0, 0, GPT_LAYERS},
    {"bwd qkv dW=dY^T.X", true, false, 768, 256, GPT_ROWS, 0, 0, 0, GPT_LAYERS},
    {"bwd qkv dX=dY.W", false, false, GPT_ROWS, 256, 768, 0, 0, 0, GPT_LAYERS},
    {"fwd proj X.W^T", false, true, GPT_ROWS, 256, 256, 0, 0, 0, GPT_LAYERS},
    {"bwd proj dW=dY^T.X", true, false, 256, 256, GPT_ROWS, 0, 0, 0, GPT_LAYERS},
    {"bwd proj dX=dY.W", false, false, GPT_ROWS, 256, 256, 0, 0, 0, GPT_LAYERS},
    {"fwd fc X.W^T", false, true, GPT_ROWS, 1024, 256, 0, 0, 0, GPT_LAYERS},
    {"bwd fc dW=dY^T.X", true, false, 1024, 256, GPT_ROWS, 0, 0, 0, GPT_LAYERS},
    {"bwd fc dX=dY.W", false, false, GPT_ROWS, 256, 1024, 0, 0, 0, GPT_LAYERS},
    {"fwd fc_proj X.W^T", false, true, GPT_ROWS, 256, 1024, 0, 0, 0, GPT_LAYERS},
    {"bwd fc_proj dW=dY^T.X", true, false, 256, 1024, GPT_ROWS, 0, 0, 0, GPT_LAYERS},
    {"bwd fc_proj dX=dY.W", false, false, GPT_ROWS, 1024, 256, 0, 0, 0, GPT_LAYERS},
    {"fwd lm_head X.W^T", false, true, GPT_ROWS, 256, 256, 0, 0, 0, 1},
    {"bwd lm_head dW=dY^T.X", true, false, 256, 256, GPT_ROWS, 0, 0, 0, 1},
    {"bwd lm_head dX=dY.W", false, false, GPT_ROWS, 256, 256, 0, 0, 0, 1},
    /* per (sequence, head): q, k, v are 128 x 64 slices of the fused qkv rows (ld 3d =
     * 768), dY and Y slices of d-wide rows (ld 256), P, S, dP, dS 128 x 128 */
    {"attn S=Q.K^T", false, true, 128, 128, 64, 768, 768, 128, GPT_HEADS_ALL},
    {"attn Y=P.V", false, false, 128, 64, 128, 128, 768, 256, GPT_HEADS_ALL},
    {"attn dV=P^T.dY", true, false, 128, 64, 128, 128, 256, 768, GPT_HEADS_ALL},
    {"attn dP=dY.V^T", false, true, 128, 128, 64, 256, 768, 128, GPT_HEADS_ALL},
    {"attn dQ=dS.K", false, false, 128, 64, 128, 128, 768, 768, GPT_HEADS_ALL},
    {"attn dK=dS^T.Q", true, false, 128, 64, 128, 128, 768, 768, GPT_HEADS_ALL},
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

static double shape_flops(const shape *s)
{
    return 2.0 * s->M * s->N * (double)s->K;
}

/* Best GFLOP/s of one shape, or a negative GPU_E* code. */
static double measure(const shape *s, double batch_s)
{
    unsigned seed = 12345u;
    /* A is K x M when ta, else M x K; B is N x K when tb, else K x N; C is M x N */
    int lda = s->lda ? s->lda : s->ta ? s->M : s->K;
    int ldb = s->ldb ? s->ldb : s->tb ? s->K : s->N;
    int ldc = s->ldc ? s->ldc : s->N;
    float *A = random_matrix((size_t)(s->ta ? s->K : s->M) * (size_t)lda, &seed);
    float *B = random_matrix((size_t)(s->tb ? s->N : s->K) * (size_t)ldb, &seed);
    float *C = random_matrix((size_t)s->M * (size_t)ldc, &seed);
    double best = 0.0, flops = shape_flops(s);
    int rc = GPU_ENOMEM;
    if (A == NULL || B == NULL || C == NULL)
        goto fail;
    rc = gpu_gemm(s->ta, s->tb, s->M, s->N, s->K, A, GPU_FP32, lda, B, GPU_FP32, ldb, 0.0f, C, ldc,
                  NULL, 0);
    if (rc != 0)
        goto fail;
    for (int batch = 0; batch < 3; batch++) {
        int calls = 0;
        double t0 = now(), t;
        do {
            gpu_gemm(s->ta, s->tb, s->M, s->N, s->K, A, GPU_FP32, lda, B, GPU_FP32, ldb, 0.0f, C,
                     ldc, NULL, 0);
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

/* Measure and print n shapes; accumulate the best rate, the step's work and its time.
 * Returns 0 or EXIT_FAILURE. */
static int run(const shape *v, size_t n, double batch_s, double *best, double *work, double *secs)
{
    for (size_t i = 0; i < n; i++) {
        const shape *s = &v[i];
        double g = measure(s, batch_s);
        if (g < 0) {
            fprintf(stderr, "sgemm: %s: %s\n", s->name, gpu_strerror((int)g));
            return EXIT_FAILURE;
        }
        printf("  %-22s %2d %2d %5d %5d %5d %8d %9.1f\n", s->name, s->ta, s->tb, s->M, s->N, s->K,
               s->per_step, g);
        fflush(stdout);
        if (s->per_step == 0 && g > *best)
            *best = g;
        if (s->per_step > 0 && g > 0) {
            *work += s->per_step * shape_flops(s);
            *secs += s->per_step * shape_flops(s) / (g * 1e9);
        }
    }
    return 0;
}

static void usage(const char *argv0)
{
    fprintf(stderr, "usage: %s [-t threads] [-s seconds per batch] [--shapes mlp|gpt|square]\n",
            argv0);
}

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"shapes", required_argument, NULL, 'S'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int threads = 2, opt;
    double batch_s = 0.2;
    const char *set = "mlp";
    while ((opt = getopt_long(argc, argv, "t:s:h", longopts, NULL)) != -1) {
        if (opt == 't') {
            threads = atoi(optarg);
        } else if (opt == 's') {
            batch_s = atof(optarg);
        } else if (opt == 'S') {
            set = optarg;
        } else {
            usage(argv[0]);
            return opt == 'h' ? EXIT_SUCCESS : EXIT_FAILURE;
        }
    }
    const shape *step = NULL;
    size_t nstep = 0;
    if (strcmp(set, "mlp") == 0) {
        step = mlp_step;
        nstep = sizeof mlp_step / sizeof mlp_step[0];
    } else if (strcmp(set, "gpt") == 0) {
        step = gpt_step;
        nstep = sizeof gpt_step / sizeof gpt_step[0];
    } else if (strcmp(set, "square") != 0) {
        usage(argv[0]);
        return EXIT_FAILURE;
    }
    if (optind < argc) {
        usage(argv[0]);
        return EXIT_FAILURE;
    }
    int rc = gpu_blas_init(threads);
    if (rc != 0) {
        fprintf(stderr, "sgemm: %s\n", gpu_strerror(rc));
        return EXIT_FAILURE;
    }
    const char *env = getenv("AMPD_GEMM");
    printf("# %s\n", gpu_gemm_info(GPU_FP32));
    printf("# AMPD_GEMM=%s; shapes: %s\n", env && *env ? env : "(unset)", set);
    printf("# %-22s %2s %2s %5s %5s %5s %8s %9s\n", "shape", "ta", "tb", "M", "N", "K", "per step",
           "GFLOP/s");
    double best = 0.0, work = 0.0, secs = 0.0;
    if (run(squares, sizeof squares / sizeof squares[0], batch_s, &best, &work, &secs) != 0 ||
        run(step, nstep, batch_s, &best, &work, &secs) != 0)
        return EXIT_FAILURE;
    printf("best_sgemm_gflops %.1f\n", best);
    if (nstep > 0) {
        printf("step_gemm_gflop %.6f\n", work * 1e-9);
        printf("step_sgemm_gflops %.1f\n", secs > 0 ? work / secs * 1e-9 : 0.0);
    }
    return EXIT_SUCCESS;
}
