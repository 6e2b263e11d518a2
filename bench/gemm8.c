/*
 * gemm8.c - the fp8 GEMMs of a GPT-2 step against bf16 on a CUDA device, through the
 * engine's own cuBLASLt calls (gpu/cuda/cuda_blas.h): for each linear of GPT-2 124M (d 768,
 * 4d MLP) at TOKENS token rows, Y = X W^T in bf16 (gpu_cuda_matmul, bf16 C) and in fp8
 * (gpu_cuda_matmul_fp8, E4M3 x E4M3, bf16 C) with cuBLASLt's split accumulation and with its
 * fast accumulation (Transformer Engine's forward default). Each is timed with CUDA events:
 * the median of 20 calls after 5 warm-up ones. A Markdown table on stdout, with the rates and
 * fp8's speed-up over bf16.
 *
 * Usage: bench/gemm8 [TOKENS [CALLS]]   (default 8192: batch 8 of 1024; CALLS timed, 20, after
 *        min(5, CALLS) warm-up ones)
 * bench/gpu.sh runs it on a GPU machine (tests/gpu/prepare.sh packs it); the CUDA emulator's
 * build (tests/gemm8_emu) runs it with a few tokens in check_cudaemu_run.sh.
 * Threads: one; everything on one stream.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_blas.h"
#include "gpu/gpu.h"

enum { MAX_TIMED = 100 };
static int warm = 5, timed = 20; /* the calls before timing, and those timed (argv[2]) */

static int cmp(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef struct {
    gpu_cuda_blas *b;
    cudaEvent_t e0, e1;
} bench;

/* The median ms of one product: fp8 (0: bf16, 1: split accumulation, 2: fast). */
static int time_one(bench *z, int fp8, int M, int N, int K, void *a, void *w, void *c,
                    const float *s, float *ms)
{
    float t[MAX_TIMED];
    for (int i = 0; i < warm + timed; i++) {
        int rc;
        cudaEventRecord(z->e0, 0);
        if (fp8) {
            gpu_cuda_mm8 p = {.M = M,
                              .N = N,
                              .K = K,
                              .A = a,
                              .af = GPU_E4M3,
                              .lda = K,
                              .B = w,
                              .bf = GPU_E4M3,
                              .ldb = K,
                              .a_scale_inv = s,
                              .b_scale_inv = s + 1,
                              .C = c,
                              .cdt = GPU_BF16,
                              .ldc = N,
                              .fast_accum = fp8 == 2};
            rc = gpu_cuda_matmul_fp8(z->b, 0, &p);
        } else {
            gpu_cuda_mm p = {.tb = true,
                             .M = M,
                             .N = N,
                             .K = K,
                             .A = a,
                             .adt = GPU_BF16,
                             .lda = K,
                             .B = w,
                             .bdt = GPU_BF16,
                             .ldb = K,
                             .C = c,
                             .cdt = GPU_BF16,
                             .ldc = N,
                             .batch = 1};
            rc = gpu_cuda_matmul(z->b, 0, &p);
        }
        cudaEventRecord(z->e1, 0);
        if (rc != 0 || cudaEventSynchronize(z->e1) != cudaSuccess)
            return rc ? rc : GPU_ECUDA;
        if (i >= warm)
            cudaEventElapsedTime(&t[i - warm], z->e0, z->e1);
    }
    qsort(t, (size_t)timed, sizeof(t[0]), cmp);
    *ms = t[timed / 2];
    return 0;
}

int main(int argc, char **argv)
{
    static const struct {
        const char *name;
        int out, in;
    } lin[] = {{"attn.qkv", 2304, 768},
               {"attn.proj", 768, 768},
               {"mlp.fc", 3072, 768},
               {"mlp.proj", 768, 3072}};
    int M = argc > 1 ? atoi(argv[1]) : 8192;
    if (argc > 2) {
        timed = atoi(argv[2]);
        warm = timed < 5 ? timed : 5;
    }
    char why[320];
    bench z;
    void *a = NULL, *w = NULL, *c = NULL, *s = NULL;
    const float scales[2] = {1.0f / 64, 1.0f / 1024};

    if (M < 16 || M % 16 || timed < 1 || timed > MAX_TIMED) {
        fprintf(stderr,
                "usage: bench/gemm8 [TOKENS [CALLS]]   (TOKENS a multiple of 16; "
                "CALLS timed, 1 to %d)\n",
                MAX_TIMED);
        return 2;
    }
    if (gpu_cuda_blas_open(&z.b, why, sizeof(why)) != 0) {
        fprintf(stderr, "bench/gemm8: %s\n", why);
        return 1;
    }
    if (!gpu_cuda_has_fp8(why, sizeof(why))) {
        fprintf(stderr, "bench/gemm8: %s\n", why);
        return 1;
    }
    size_t most = (size_t)M * 3072 * 2; /* the largest operand, as bf16 */
    if (cudaMalloc(&a, most) || cudaMalloc(&w, (size_t)3072 * 768 * 2) || cudaMalloc(&c, most) ||
        cudaMalloc(&s, sizeof(scales)) || cudaMemset(a, 0x3A, most) ||
        cudaMemset(w, 0x3A, (size_t)3072 * 768 * 2) ||
        cudaMemcpy(s, scales, sizeof(scales), cudaMemcpyHostToDevice)) {
        fprintf(stderr, "bench/gemm8: cannot allocate the operands\n");
        return 1;
    }
    cudaEventCreate(&z.e0);
    cudaEventCreate(&z.e1);
    gpu_cuda_device dev[1];
    int nd = 0;
    gpu_cuda_devices(dev, 1, &nd);
    printf("## fp8 against bf16: GPT-2 124M's linears, Y = X W^T at %d token rows\n\n", M);
    printf("Device: %s; C in bf16; the median of %d calls after %d\n\n", nd ? dev[0].name : "?",
           timed, warm);
    printf("| linear | M x N x K | bf16 ms (TFLOP/s) | fp8 ms (TFLOP/s) | fp8 fast-accum ms "
           "(TFLOP/s) | fp8 / bf16 speed-up (fast) |\n|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < sizeof(lin) / sizeof(lin[0]); i++) {
        int N = lin[i].out, K = lin[i].in;
        double flop = 2.0 * M * N * K;
        float t[3];
        for (int k = 0; k < 3; k++)
            if (time_one(&z, k, M, N, K, a, w, c, s, &t[k]) != 0) {
                fprintf(stderr, "bench/gemm8: %s failed\n", lin[i].name);
                return 1;
            }
        printf("| %s | %d x %d x %d | %.3f (%.0f) | %.3f (%.0f) | %.3f (%.0f) | %.2f (%.2f) |\n",
               lin[i].name, M, N, K, t[0], flop / t[0] / 1e9, t[1], flop / t[1] / 1e9, t[2],
               flop / t[2] / 1e9, t[0] / t[1], t[0] / t[2]);
    }
    cudaFree(a);
    cudaFree(w);
    cudaFree(c);
    cudaFree(s);
    gpu_cuda_blas_free(z.b);
    return 0;
}
