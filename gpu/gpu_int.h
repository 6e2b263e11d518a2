/*
 * gpu_int.h - what every part of the gpu/ module shares (internal; the API is gpu.h).
 *
 * Holds the seeded random number generator every component draws from (rng.c; a job with
 * the same seed is reproducible bit for bit), CPU feature detection and the AVX-512 /
 * portable kernel-path switch (cpu.c), the monotonic clock (cpu.c), the bf16 subnormal
 * watch (format.c; the scalar conversions are gpu/format_rule.h), and the gpu_diag
 * forward declaration that the models' passes take. The subjects have headers of their own:
 * gpu/mlp.h (the MLP), gpu/gpt.h (the GPT), gpu/diag.h (per-layer diagnostics), gpu/twin.h
 * (the trainer's device twin) and gpu/scaler_rule.h (the loss-scale update, host and
 * device); the CUDA backend is under gpu/cuda/. The module's parts in prose:
 * docs/architecture.md, "Modules".
 *
 * Invariants: a gpu_rng stream depends only on its seed. Threads: gpu_cpu, gpu_impl_* and
 * gpu_now are thread-safe; a gpu_rng belongs to one thread. Uses C11 atomics, so nvcc does
 * not read this header (the .cu files include gpu.h, gpu/scaler_rule.h and gpu/cuda/
 * headers only).
 */
#ifndef AMPD_GPU_INT_H
#define AMPD_GPU_INT_H

#include "gpu/format_rule.h"
#include "gpu/gpu.h"

/* ---- random numbers: splitmix64-seeded xoshiro256** -------------------------------------- */

typedef struct {
    uint64_t s[4];
} gpu_rng;

void gpu_rng_seed(gpu_rng *r, uint64_t seed);
uint64_t gpu_rng_next(gpu_rng *r);
/* Uniform in [0, 1) with 24 random bits. */
float gpu_rng_uniform(gpu_rng *r);
/* Standard normal (Box-Muller). */
float gpu_rng_normal(gpu_rng *r);
/* Uniform integer in [0, n). */
uint32_t gpu_rng_below(gpu_rng *r, uint32_t n);

/* ---- CPU features (cpu.c) ---------------------------------------------------------------- */

typedef struct {
    bool avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq, avx512bf16, avx512fp16;
} gpu_cpu_features;

/* Read once from CPUID (and XGETBV for OS support); thread-safe. */
const gpu_cpu_features *gpu_cpu(void);

/* A kernel-path switch for components with an AVX-512 and a portable path: the path is
 * chosen from CPUID at first use and can be forced by tests. 0 means not chosen yet. */
enum { GPU_IMPL_UNSET = 0, GPU_IMPL_PORTABLE, GPU_IMPL_AVX512 };
int gpu_impl_pick(_Atomic int *sw);
/* Force "portable" or "avx512": GPU_EINVAL for other names, GPU_ENODEV when the CPU lacks
 * AVX-512. name is borrowed. */
int gpu_impl_force(_Atomic int *sw, const char *name);
const char *gpu_impl_name(int id);

/* bf16 subnormals, which the native bf16 GEMM kernels (AVX512_BF16, AMX) read as zero:
 * gpu_bf16_has_subnormal() scans n values; gpu_bf16_subnormals_made() says whether any
 * conversion to bf16 in this process has met a subnormal (the conversions watch their inputs
 * at no extra pass) or gpu_bf16_admit() has found one. While it says no, no bf16 value the
 * conversions wrote is subnormal. Values that arrive in bf16 by other ways (a checkpoint's
 * 16-bit weights) go through gpu_bf16_admit() to keep that true. Thread-safe; never reset. */
bool gpu_bf16_has_subnormal(const uint16_t *x, size_t n);
/* Whether n fp32 values (as bits) hold a subnormal, which could round to a bf16 one. */
bool gpu_f32_has_subnormal(const uint32_t *x, size_t n);
bool gpu_bf16_subnormals_made(void);
void gpu_bf16_admit(const uint16_t *x, size_t n);
/* What a pass that rounds to bf16 itself (gpu_fmt_bf16_round) calls when one of its fp32
 * inputs was subnormal (gpu_f32_subnormal). */
void gpu_bf16_note_subnormal(void);

/* 1 when the fp32 bits u are a subnormal: the only inputs whose bf16 rounding can be one
 * (2^-126 is a bf16 value, and rounding is monotonic). */
static inline unsigned gpu_f32_subnormal(uint32_t u)
{
    return (unsigned)((u & 0x7F800000u) == 0) & (unsigned)((u & 0x7FFFFFu) != 0);
}

/* Passes over fewer elements than this stay on one thread. */
#define GPU_PAR_MIN ((size_t)1 << 15)
/* Whether a pass over n elements is worth a parallel region: n >= GPU_PAR_MIN, more than one
 * thread, and the caller not in an active region already (then it runs on the caller's
 * thread). Always false without OpenMP. */
bool gpu_par_worth(size_t n);

/* Monotonic clock in seconds. */
double gpu_now(void);

/* ---- memory blocks (block.c) -------------------------------------------------------------- */

/* A zeroed block of bytes named for reports ("scratch"), NULL when out of memory; freed by
 * gpu_block_free (NULL allowed). In guard mode (gpu_guard_on, gpu.h) each block lies between
 * two inaccessible pages, its end within 64 bytes of the one after it, with a pattern around
 * it; blocks keep the mode they were made in. gpu_block_check() says whether anything wrote
 * outside one (NULL: none): GPU_EGUARD with which block and how far out in why (may be
 * NULL), else 0. Thread-safe. */
void *gpu_block_alloc(size_t bytes, const char *name);
void gpu_block_free(void *p);
int gpu_block_check(const void *p, char *why, size_t len);

/* Per-layer diagnostics (gpu/diag.h); the models' forward and backward take a pointer. */
typedef struct gpu_diag gpu_diag;

/* Backward's report that gradients [off, off + count) of the parameter block are final for
 * this backward (the trainer sums micro-steps and starts the all-reduce on them). Every
 * parameter is reported exactly once per backward, in the order backward finishes them. */
typedef struct {
    void (*fn)(void *ctx, size_t off, size_t count);
    void *ctx;
} gpu_grad_ready;

static inline void gpu_grad_done(const gpu_grad_ready *r, size_t off, size_t count)
{
    if (r)
        r->fn(r->ctx, off, count);
}

/* The rows one rank's forward and backward take at a time: its share of the global batch
 * (batch_size / world_size, which the spec and the trainer check divide evenly). Activation,
 * workspace and batch blocks are planned for it, so memory is per rank. */
static inline int gpu_rank_batch(const gpu_job_config *c)
{
    return c->batch_size / (c->dist.world_size > 1 ? c->dist.world_size : 1);
}

/* OpenBLAS's thread count now (1 when oneDNN takes the fp32 GEMMs: then gpu_gemm may be
 * called from several threads of a parallel region at once without oversubscribing). */
int gpu_blas_threads(void);

/* How many GEMMs on the native bf16 plan (native or emulated) have given way to the widened
 * one (a subnormal operand, a shape the kernels refuse) in this process: the tests' proof
 * that the fallback ran. Thread-safe; never reset. */
size_t gpu_gemm_native_gave_way(void);

/* ---- oneDNN matmul (onednn.c), under gpu_gemm ---------------------------------------------- */

/* Open oneDNN once: 0, or GPU_EBLAS when it is missing (the GEMMs stay on OpenBLAS). */
int gpu_dnnl_init(void);
/* oneDNN has fast kernels for dt here: fp32 with AVX-512, bf16 with AVX512_BF16 or AMX. */
bool gpu_dnnl_has(gpu_dtype dt);
/* "oneDNN 2.6.3 (avx512_core_bf16)", or NULL without it; static. */
const char *gpu_dnnl_info(void);
/* C = op(A) op(B) + beta C with A and B of dt (fp32 or bf16), C fp32, row-major as
 * gpu_gemm. GPU_EBLAS when oneDNN cannot (the caller falls back to OpenBLAS). */
int gpu_dnnl_gemm(gpu_dtype dt, bool ta, bool tb, int M, int N, int K, const void *A, int lda,
                  const void *B, int ldb, float beta, float *C, int ldc);
/* The largest scratchpad oneDNN has needed in any thread so far, in bytes. */
size_t gpu_dnnl_peak(void);

#endif /* AMPD_GPU_INT_H */
