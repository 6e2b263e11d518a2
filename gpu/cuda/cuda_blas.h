/*
 * cuda_blas.h - the CUDA backend's GEMMs through cuBLASLt (gpu/cuda/cuda_blas.cu): internal
 * to the gpu/ module, not part of gpu.h.
 *
 * Row-major semantics exactly like gpu_gemm() in gpu.h: C[M,N] = op(A)[M,K] op(B)[K,N] +
 * beta * C with fp32 accumulation (CUBLAS_COMPUTE_32F, never TF32), optionally strided
 * batched and with a bias or bias + GELU epilogue. cuBLASLt is opened at run time with
 * dlopen(), so nothing links against cuBLAS: without the library (or without a device)
 * opening a handle returns GPU_ENODEV.
 *
 * Threads: a gpu_cuda_blas may be used by one thread at a time, with its calls ordered on
 * one stream at a time (its workspace is shared by the calls); different handles are
 * independent. The argument helpers are pure. The tests' synchronous host-buffer wrappers
 * (gpu_cuda_gemm_host, gpu_cuda_mm_host) are in tests/cudahost/cudahost.h.
 */
#ifndef AMPD_CUDA_BLAS_H
#define AMPD_CUDA_BLAS_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gpu_cuda_blas gpu_cuda_blas; /* opaque: a cuBLASLt handle and its workspace */

/* Bytes of device workspace each handle owns (cuBLASLt's split-K and stream-K kernels use
 * it; Hopper wants 32 MiB). */
#define GPU_CUDA_BLAS_WORKSPACE ((size_t)32 << 20)

/* Open a handle on the current device: check for a device, load libcublasLt once per
 * process, create the cuBLASLt handle and allocate the workspace. On failure returns
 * GPU_ENODEV (no device, or no cuBLASLt: "libcublasLt.so.13 not found: ..."), GPU_ECUDA or
 * GPU_ENOMEM, with the reason in why (whylen bytes, may be NULL); on success why is set to
 * the empty string. *out receives the handle; the caller frees it with gpu_cuda_blas_free(). */
int gpu_cuda_blas_open(gpu_cuda_blas **out, char *why, size_t whylen);
/* Frees the handle and its workspace (waits for the device to finish with them).
 * Accepts NULL. */
void gpu_cuda_blas_free(gpu_cuda_blas *b);

typedef GPU_ENUM {
    GPU_CUDA_EPI_NONE = 0,  /* C = AB + beta C */
    GPU_CUDA_EPI_BIAS,      /* C = AB + beta C + bias (bias[j] added to every row) */
    GPU_CUDA_EPI_BIAS_GELU  /* C = gelu(AB + beta C + bias), GELU's tanh approximation */
} gpu_cuda_epilogue;

/* One (strided batched) product; all sizes and strides in elements. */
typedef struct {
    bool ta, tb;             /* A stored K x M (lda >= M) when ta, else M x K (lda >= K);
                              * B stored N x K (ldb >= K) when tb, else K x N (ldb >= N) */
    int M, N, K;             /* >= 0 */
    const void *A;           /* adt: float for GPU_FP32, uint16_t bit patterns otherwise */
    gpu_dtype adt;
    int lda;
    const void *B;           /* bdt, which must equal adt */
    gpu_dtype bdt;
    int ldb;
    void *C;                 /* cdt: fp32 for fp32 operands; adt or fp32 for 16-bit ones */
    gpu_dtype cdt;
    int ldc;                 /* >= N */
    float beta;              /* any value; 0 ignores C's old contents (NaN included) */
    int batch;               /* >= 1 products; batch i uses A + i*stride_a, ... */
    int64_t stride_a, stride_b, stride_c; /* >= 0 (used when batch > 1); C's batches must
                                           * not overlap (stride_c >= 1 is checked) */
    gpu_cuda_epilogue epilogue;  /* not NONE only with batch == 1 and K >= 1 */
    const void *bias;        /* N elements of cdt, 16-byte aligned (BIAS, BIAS_GELU) */
    void *aux;               /* BIAS_GELU, may be NULL: receives the pre-GELU values
                              * AB + beta C + bias rounded to cdt, M rows of N at aux_ld,
                              * 16-byte aligned */
    int aux_ld;              /* with aux: a multiple of 8, >= N */
} gpu_cuda_mm;

/* Enqueue C = op(A) op(B) + beta C (+ epilogue) on stream; p's pointers are device pointers,
 * borrowed (C may not overlap A, B, bias or aux). The fp32 accumulation (plus beta C and the
 * bias, then GELU) is rounded to cdt once, to nearest even; a 16-bit C overflows to inf as
 * gpu_f32_to_f16() does. M or N == 0 does nothing; K == 0 makes C = beta C (0 when beta is 0)
 * with a kernel of its own. No host synchronisation. Returns 0, GPU_EINVAL for bad arguments
 * or a combination cuBLASLt has no algorithm for (with a message in the log; nothing is
 * enqueued), or GPU_ECUDA for a failed launch (logged). */
int gpu_cuda_matmul(gpu_cuda_blas *b, cudaStream_t stream, const gpu_cuda_mm *p);

/* ---- fp8 (docs/fp8.md) -------------------------------------------------------------------
 *
 * One fp8 product, C = (A B^T) x (a_scale_inv x b_scale_inv): A is M x K and B is N x K, both
 * row-major fp8 codes (the TN layout, the only one Hopper's fp8 GEMMs take: a product of
 * another layout multiplies a transposed copy, which gpu_cuda_fp8_cast writes); fp32
 * accumulation; C fp32 or bf16, rounded once. K, N, lda and ldb multiples of 16 and the
 * pointers 16-byte aligned, as cuBLASLt's fp8 kernels need; E5M2 x E5M2 is refused, as
 * cuBLASLt refuses it. fast_accum: cuBLASLt's FAST_ACCUM (no promotion of the tensor cores'
 * partial sums; Transformer Engine's forward default). */
typedef struct {
    int M, N, K;
    const uint8_t *A;
    gpu_fp8_format af;
    int lda;
    const uint8_t *B;
    gpu_fp8_format bf;
    int ldb;
    const float *a_scale_inv, *b_scale_inv; /* device pointers to one float each */
    void *C;
    gpu_dtype cdt;
    int ldc;
    bool fast_accum;
} gpu_cuda_mm8;

/* Enqueue the product on stream. GPU_EINVAL for bad arguments (logged); GPU_ENODEV, with
 * the device named in the log, on a device without fp8 tensor cores (below sm_89: an A100
 * is sm_80); GPU_ECUDA for a failed launch. */
int gpu_cuda_matmul_fp8(gpu_cuda_blas *b, cudaStream_t stream, const gpu_cuda_mm8 *p);
/* 0 when p describes a product gpu_cuda_matmul_fp8 can run (device: its pointers are device
 * pointers, their alignment checked), else GPU_EINVAL with a message in the log. */
int gpu_cuda_mm8_check(const gpu_cuda_mm8 *p, bool device);
/* Whether this device multiplies fp8 (compute capability 8.9 or above); its name and
 * capability into why when it does not (may be NULL). */
bool gpu_cuda_has_fp8(char *why, size_t whylen);

/* A tensor's fp8 casts counted on the device for the diagnostics (gpu_fp8_cast_stats):
 * values cast, saturated, non-zero finite values made 0, non-zero finite values, NaNs; the
 * largest |x| (the bits of a float, NaNs skipped) and the scale of the last cast. Zeroed by
 * the caller; each counted cast adds to it. */
typedef struct {
    unsigned long long n, saturated, underflow, nonzero, nan;
    unsigned int amax;
    float scale;
} gpu_cuda_fp8_counts;

/* Enqueue the cast of rows x cols values of sdt (row-major) to fp8: dst[i] = fp8(src[i] x
 * *scale) saturating, bit for bit gpu_fp8_cast's codes (dst NULL: only the amax, current
 * scaling's first pass); with dst_t (may be NULL) the same
 * codes transposed (cols x rows), for a GEMM that needs the other layout; with amax (may be
 * NULL; its old value >= 0) raised to the largest |src[i]|, NaNs skipped as fmaxf skips them;
 * with counts (may be NULL; dst not NULL) the cast counted into it, as gpu_fp8_cast counts.
 * scale, amax and counts are device pointers. GPU_EINVAL for bad arguments, GPU_ECUDA for a
 * failed launch. */
int gpu_cuda_fp8_cast(cudaStream_t stream, uint8_t *dst, uint8_t *dst_t, const void *src,
                      gpu_dtype sdt, int rows, int cols, gpu_fp8_format f, const float *scale,
                      float *amax, gpu_cuda_fp8_counts *counts);
/* The scaling rules of gpu/fp8_rule.h on the device, on rows laid out as the CPU's scaling
 * state (gpu/fp8.h: scale, scale_inv, then len history entries, the staging slot first):
 * current scaling sets row[0..2] = scale, scale_inv, amax from *amax (device); delayed
 * scaling updates `nrows` rows, row r with scaled_max[r % 3] (the input's, the weight's, the
 * output gradient's). One thread per row. GPU_EINVAL for bad arguments, GPU_ECUDA for a
 * failed launch. */
int gpu_cuda_fp8_current(cudaStream_t stream, float *row, const float *amax, float scaled_max,
                         float epsilon);
int gpu_cuda_fp8_delayed(cudaStream_t stream, float *state, int nrows, int len, bool most_recent,
                         const float scaled_max[3]);

/* ---- argument helpers (no device needed; the host wrappers of the tests use them) ------- */

/* 0 when p describes a product gpu_cuda_matmul can run, else GPU_EINVAL with a message
 * (gpu_log, from "gpu_cuda_matmul"). device: the pointers are device pointers (their
 * alignment is checked too). p borrowed. */
int gpu_cuda_mm_check(const gpu_cuda_mm *p, bool device);
/* Elements spanned by `batch` rows x cols matrices at ld, stride apart: *out = 0 when they
 * are empty. false when the span (or its bytes) would not fit in an int64_t. */
bool gpu_cuda_span(int64_t rows, int64_t cols, int64_t ld, int batch, int64_t stride,
                   int64_t *out);
/* The spans (gpu_cuda_span) of p's A, B, C and aux (*sx = 0 without aux); false when one
 * does not fit. p borrowed. */
bool gpu_cuda_mm_spans(const gpu_cuda_mm *p, int64_t *sa, int64_t *sb, int64_t *sc,
                       int64_t *sx);

#ifdef __cplusplus
}
#endif
#endif /* AMPD_CUDA_BLAS_H */
