/*
 * gpu.h - the ampd training engine: the one public header of the gpu/ module.
 *
 * The engine trains a model with automatic mixed precision (AMP): number formats and
 * conversions, the autocast policy, the dynamic loss scaler, fp32 master weights,
 * optimizers, models, data loaders and backends (CPU always, CUDA when built). It has no
 * dependency on HTTP, JSON or SQLite so that tests, benchmarks and GPU checks link it alone.
 *
 * Conventions: functions return 0 or a negative GPU_E* code; results go through trailing
 * out-pointers; every *_free accepts NULL. Ownership is stated in each comment.
 *
 * Threads: the engine is not thread-safe per object; one trainer is driven by one thread.
 * The conversion and BLAS entry points are safe to call from any thread.
 */
#ifndef AMPD_GPU_H
#define AMPD_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Enumerations: int-sized in C; the CUDA sources (C++) give them int as a fixed underlying
 * type too, so that any int a caller passes (a bad value included) is a valid value for the
 * checks that refuse it, not undefined behaviour. */
#ifdef __cplusplus
#define GPU_ENUM enum : int
#else
#define GPU_ENUM enum
#endif

/* ---- errors ---------------------------------------------------------------------------- */

#define GPU_ERRORS(X)                                                              \
    X(GPU_OK, 0, "ok")                                                             \
    X(GPU_EINVAL, -1, "invalid argument")                                          \
    X(GPU_ENOMEM, -2, "out of memory")                                             \
    X(GPU_EIO, -3, "input/output error")                                           \
    X(GPU_EFORMAT, -4, "malformed data file")                                      \
    X(GPU_ENODEV, -5, "no such device")                                            \
    X(GPU_EBLAS, -6, "BLAS library unavailable")                                   \
    X(GPU_ESCALE_FLOOR, -7, "loss scale stuck at its floor")                       \
    X(GPU_ENONFINITE, -8, "non-finite loss")                                       \
    X(GPU_ECUDA, -9, "CUDA error")                                                 \
    X(GPU_EINTR, -10, "interrupted")                                               \
    X(GPU_ECOMM, -11, "collective communication failed")                           \
    X(GPU_ETIMEDOUT, -12, "timed out")                                             \
    X(GPU_ESCRATCH, -13, "scratch smaller than the operation needs")               \
    X(GPU_EGUARD, -14, "memory written outside its block")

enum gpu_error {
#define GPU_ERR_ENUM(name, val, msg) name = (val),
    GPU_ERRORS(GPU_ERR_ENUM)
#undef GPU_ERR_ENUM
};

/* A static string that describes code; never NULL. */
const char *gpu_strerror(int code);

/* Where the engine's messages go (the store's way, as SQLITE_CONFIG_LOG): the engine never
 * writes to stderr itself; what it has to say beyond its return codes (why OpenBLAS did not
 * load, the detail of a failed cuBLASLt or NCCL call) reaches fn(arg, level, func, message),
 * from whichever thread hit it. NULL (the default) drops them. Process-wide; install it
 * before the first gpu_ call. The levels are the store's (store_log_level). */
typedef GPU_ENUM {
    GPU_LOG_DEBUG = 0,
    GPU_LOG_INFO,
    GPU_LOG_WARN,
    GPU_LOG_ERROR
} gpu_log_level;
typedef void (*gpu_log_fn)(void *arg, int level, const char *func, const char *msg);
void gpu_set_log(gpu_log_fn fn, void *arg);
/* Format a message for the installed hook (nothing happens without one). */
void gpu_log(int level, const char *func, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- number formats (format.c) --------------------------------------------------------- */

typedef GPU_ENUM { GPU_FP32 = 0, GPU_FP16 = 1, GPU_BF16 = 2 } gpu_dtype;

#define GPU_FP16_MAX 65504.0f
#define GPU_BF16_MAX 3.3895313892515355e38f
#define GPU_FP16_NAN 0x7E00u /* the one canonical quiet NaN each format produces */
#define GPU_BF16_NAN 0x7FC0u

const char *gpu_dtype_name(gpu_dtype dt);     /* "fp32", "fp16", "bf16" */
int gpu_dtype_parse(const char *s, gpu_dtype *out);
size_t gpu_dtype_size(gpu_dtype dt);           /* 4 or 2 */
float gpu_dtype_max(gpu_dtype dt);             /* largest finite value */
float gpu_dtype_min_subnormal(gpu_dtype dt);   /* smallest positive value */

/* Scalar reference conversions: round-to-nearest-even, subnormals kept, every NaN becomes
 * the canonical quiet NaN of the target (sign dropped), |x| >= 65520 -> fp16 inf. */
uint16_t gpu_f32_to_f16(float x);
float gpu_f16_to_f32(uint16_t h);
uint16_t gpu_f32_to_bf16(float x);
float gpu_bf16_to_f32(uint16_t h);
/* Value of x after a round trip through dt (identity for GPU_FP32). */
float gpu_round(float x, gpu_dtype dt);

/* Bulk conversions, vectorised (AVX-512 or F16C+AVX2, chosen from CPUID at first use,
 * portable C otherwise) and bit-identical to the scalar functions above. src and dst may
 * not overlap, except gpu_round_n which works in place (dst == src allowed). */
void gpu_cvt_f32_f16(uint16_t *dst, const float *src, size_t n);
void gpu_cvt_f16_f32(float *dst, const uint16_t *src, size_t n);
void gpu_cvt_f32_bf16(uint16_t *dst, const float *src, size_t n);
void gpu_cvt_bf16_f32(float *dst, const uint16_t *src, size_t n);
void gpu_round_n(float *dst, const float *src, size_t n, gpu_dtype dt);
/* Typed helpers: dst/src hold elements of the named dtype (float for fp32, uint16_t for
 * the 16-bit formats). Same-dtype calls copy. */
void gpu_cvt_to_f32(float *dst, const void *src, gpu_dtype sdt, size_t n);
void gpu_cvt_from_f32(void *dst, gpu_dtype ddt, const float *src, size_t n);
/* gpu_cvt_from_f32 of rows of cols floats, lds apart at src, into rows ldd elements apart
 * at dst: the same values, in one call on the calling thread (for many short rows, such as
 * a block of a wider tensor, inside a pass already shared out to the threads). */
void gpu_cvt_rows_from_f32(void *dst, gpu_dtype ddt, size_t ldd, const float *src, size_t lds,
                           size_t rows, size_t cols);
/* The same for gpu_cvt_to_f32 (src: elements of sdt, lds apart), and for gpu_round_n (in
 * place when dst == src and ldd == lds). */
void gpu_cvt_rows_to_f32(float *dst, size_t ldd, const void *src, gpu_dtype sdt, size_t lds,
                         size_t rows, size_t cols);
void gpu_round_rows(float *dst, size_t ldd, const float *src, size_t lds, size_t rows,
                    size_t cols, gpu_dtype dt);
/* Name of the conversion path in use: "avx512bf16" (AVX-512 with the bf16 rounding of
 * AVX512_BF16), "avx512", "f16c", or "portable". */
const char *gpu_cvt_impl(void);
/* Force a conversion path for tests: one of those names; returns GPU_ENODEV if the CPU lacks
 * it, GPU_EINVAL for an unknown name. */
int gpu_cvt_force(const char *impl);

/* ---- fp8 (fp8.c) ------------------------------------------------------------------------- */

/* E4M3 (bias 7, largest 448, no infinity, NaN S.1111.111) and E5M2 (bias 15, largest
 * 57344, IEEE-like infinities and NaNs), the formats of FP8 training. */
typedef GPU_ENUM{GPU_E4M3 = 0, GPU_E5M2 = 1} gpu_fp8_format;

#define GPU_E4M3_MAX 448.0f
#define GPU_E5M2_MAX 57344.0f

const char *gpu_fp8_format_name(gpu_fp8_format f); /* "e4m3", "e5m2" */
float gpu_fp8_max(gpu_fp8_format f);               /* largest finite value */
/* Round to nearest even, subnormals and signed zeros kept. Past the largest finite value
 * (+-inf included): +-max when saturate (what Transformer Engine and CUDA use), otherwise
 * E4M3's NaN (0x7F with the sign) or E5M2's +-inf. Every NaN becomes 0x7F (sign dropped).
 * Bit for bit NVIDIA's __nv_cvt_float_to_fp8. */
uint8_t gpu_f32_to_fp8(float x, gpu_fp8_format f, bool saturate);
/* Exact; a NaN code gives the canonical quiet NaN (0x7FC00000). */
float gpu_fp8_to_f32(uint8_t v, gpu_fp8_format f);
/* Bulk versions of the two (the same bits; src and dst may not overlap). The encoding is
 * vectorised with AVX-512F or AVX2 where the CPU has it (gpu_fp8_impl names the path). */
void gpu_cvt_f32_fp8(uint8_t *dst, const float *src, size_t n, gpu_fp8_format f, bool saturate);
void gpu_cvt_fp8_f32(float *dst, const uint8_t *src, size_t n, gpu_fp8_format f);
const char *gpu_fp8_impl(void); /* "avx512", "avx2" or "portable" */
/* gpu_cvt_f32_fp8 on the path named impl (for tests and benchmarks): GPU_ENODEV when the
 * CPU lacks it, GPU_EINVAL for another name. */
int gpu_cvt_f32_fp8_on(const char *impl, uint8_t *dst, const float *src, size_t n, gpu_fp8_format f,
                       bool saturate);

/* Per-tensor scaling (Transformer Engine's recipes; docs/fp8.md). A tensor x is cast as
 * fp8(x * scale), and a GEMM's product of two such tensors is multiplied by both
 * scale_inv = 1 / scale (fp32, rounded to nearest). */
typedef GPU_ENUM{GPU_FP8_AMAX_MAX = 0, GPU_FP8_AMAX_MOST_RECENT = 1} gpu_fp8_amax_algo;

/* The value the scale maps amax to: f's largest value x 2^-margin (margin >= 0). */
float gpu_fp8_scaled_max(gpu_fp8_format f, int margin);
/* Current scaling (Float8CurrentScaling): from this step's amax, raised to epsilon first when
 * below it; 1 when it is 0, inf or NaN; scaled_max / amax otherwise, FLT_MAX if that is inf. */
float gpu_fp8_current_scale(float amax, float scaled_max, float epsilon);
/* One step of delayed scaling (DelayedScaling) of one tensor role. history[0..len) holds the
 * staging slot [0], where the caller has put this step's amax, and the len - 1 amaxes
 * before it, oldest first. When that amax is 0 (the tensor did not take part) nothing
 * changes. Otherwise the amax used is history[0] (MOST_RECENT) or the largest of all len
 * entries, NaNs skipped as fmaxf skips them (MAX); from it *scale becomes scaled_max / amax
 * (FLT_MAX if that is inf) when it is finite and above 0, else stays; then the history
 * rolls (the oldest entry goes, this step's amax becomes the newest) and the staging slot
 * is cleared. *scale_inv becomes 1 / *scale. */
void gpu_fp8_delayed_update(float *history, int len, gpu_fp8_amax_algo algo, float scaled_max,
                            float *scale, float *scale_inv);

/* A scaled cast's counts (docs/fp8.md, "Reading the fp8 diagnostics"). */
typedef struct {
    int64_t n;         /* values cast */
    int64_t saturated; /* |x * scale| beyond the largest finite value (inf included): clipped */
    int64_t underflow; /* non-zero finite values that became a zero */
    int64_t nonzero;   /* non-zero finite values */
    int64_t nan;       /* NaN values (they stay NaN) */
} gpu_fp8_cast_stats;

/* dst[i] = fp8(src[i] * scale), saturating, for n values of dtype sdt; the product is fp32,
 * rounded to nearest, as Transformer Engine's cast kernels compute it (dst NULL: the amax
 * alone, st not counted). *amax (NULL: not
 * wanted) gets the largest |src[i]| with NaNs skipped as fmaxf skips them (TE's amax; an inf
 * counts). st (NULL: not counted) gets the counts added. Runs on the OpenMP team from
 * GPU_PAR_MIN values; every result is independent of the thread count. */
void gpu_fp8_cast(uint8_t *dst, const void *src, gpu_dtype sdt, size_t n, gpu_fp8_format f,
                  float scale, float *amax, gpu_fp8_cast_stats *st);
/* The amax of n values of dtype sdt alone (current scaling's first pass), as gpu_fp8_cast. */
float gpu_fp8_amax(const void *src, gpu_dtype sdt, size_t n);

/* The accumulator of an fp8 GEMM. bits 0 (the default) is exact: every product (exact in
 * fp32) is added in fp32, as by an fp32 GEMM. bits > 0 models Hopper's fp8 tensor cores
 * (an approximation, to be calibrated on the hardware; docs/fp8.md): each partial sum keeps
 * `bits` mantissa bits, truncated, and is promoted (added to an fp32 total) every `promote`
 * products along K. */
typedef struct {
    int bits;    /* 0, or 1..23 */
    int promote; /* >= 1 (128: every 4 WGMMAs) */
} gpu_fp8_acc;

/* C[M,N] = (op(A) op(B)) * (a_scale_inv * b_scale_inv), row-major, for fp8 codes A (format af)
 * and B (bf), the two scale_invs multiplied first (one fp32 rounding), then the accumulated
 * sum once. ta/tb and the leading dimensions as gpu_gemm. acc NULL is exact. E5M2 x E5M2 is
 * GPU_EINVAL, as cuBLASLt refuses it. scratch holds scratch_floats floats, at least
 * gpu_gemm_fp8_scratch_floats(...) (else GPU_ESCRATCH, nothing written). */
int gpu_gemm_fp8(bool ta, bool tb, int M, int N, int K, const uint8_t *A, gpu_fp8_format af,
                 float a_scale_inv, int lda, const uint8_t *B, gpu_fp8_format bf, float b_scale_inv,
                 int ldb, const gpu_fp8_acc *acc, float *C, int ldc, float *scratch,
                 size_t scratch_floats);
size_t gpu_gemm_fp8_scratch_floats(int M, int N, int K);
/* The most a linear's three fp8 GEMMs take: Y = X W^T (N x O from K), dX and dW. */
size_t gpu_gemm_fp8_linear_scratch_floats(int N, int O, int K);

/* The fp8 training recipe of a job (precision.dtype "fp8" and precision.fp8; docs/fp8.md).
 * Which format each GEMM operand takes: HYBRID, TE's default, casts the forward's inputs and
 * weights to E4M3 and the backward's output gradients to E5M2; E4M3 casts all three to E4M3. */
typedef GPU_ENUM{GPU_FP8_DELAYED = 0, GPU_FP8_CURRENT = 1} gpu_fp8_recipe;
typedef GPU_ENUM{GPU_FP8_HYBRID = 0, GPU_FP8_ALL_E4M3 = 1} gpu_fp8_formats;
#define GPU_FP8_MAX_KEEP 16
typedef struct {
    bool on;                     /* the job is an fp8 job (its dtype is then bf16) */
    gpu_fp8_recipe recipe;       /* DELAYED */
    gpu_fp8_formats format;      /* HYBRID */
    int margin;                  /* delayed: scale = fp8_max / amax / 2^margin (0) */
    int amax_history_len;        /* delayed (1024) */
    gpu_fp8_amax_algo amax_algo; /* delayed (MAX) */
    float amax_epsilon;          /* current: the amax's floor (0) */
    gpu_fp8_acc acc;             /* {0, 128}: exact */
    int nkeep;
    char keep[GPU_FP8_MAX_KEEP]
             [32]; /* layers whose GEMMs stay in bf16 ("fc1", "blocks.0.attn.qkv") */
} gpu_fp8_config;
/* TE's DelayedScaling defaults (on stays false). */
void gpu_fp8_defaults(gpu_fp8_config *c);
/* An operand's format under c: role 0 the input, 1 the weight, 2 the output gradient. */
gpu_fp8_format gpu_fp8_role_format(const gpu_fp8_config *c, int role);

/* ---- BLAS (blas.c) ---------------------------------------------------------------------- */

/* Open the BLAS library once (thread-safe). On x86 it chooses OpenBLAS's kernel set from
 * CPUID unless OPENBLAS_CORETYPE is set. Each call sets the BLAS thread count: nthreads <= 0
 * means every online CPU. Returns GPU_EBLAS with a message in the log when the library
 * cannot be loaded. */
int gpu_blas_init(int nthreads);
/* Description like "OpenBLAS 0.3.21 (SkylakeX kernels, 2 threads)"; valid forever. */
const char *gpu_blas_info(void);

/* C[M,N] = op(A)[M,K] * op(B)[K,N] + beta * C, row-major, fp32 accumulation.
 * A and B hold elements of adt / bdt (float or uint16_t), which are multiplied exactly (the
 * tensor-core contract: low-precision operands, fp32 accumulate). C is fp32; the caller
 * rounds it to the op's dtype. ta/tb: A is stored K x M (lda >= M) when ta, else M x K
 * (lda >= K); likewise B. scratch (borrowed) holds scratch_floats floats, at least
 * gpu_gemm_scratch_floats(...) for these operands (NULL and 0 when that is 0): else
 * GPU_ESCRATCH and nothing is written. 16-bit operands are converted block by block, so the
 * scratch is bounded, never a copy of a whole operand. Safe to call from several threads at
 * once on distinct C and scratch. */
int gpu_gemm(bool ta, bool tb, int M, int N, int K,
             const void *A, gpu_dtype adt, int lda,
             const void *B, gpu_dtype bdt, int ldb,
             float beta, float *C, int ldc, float *scratch, size_t scratch_floats);
size_t gpu_gemm_scratch_floats(bool ta, bool tb, int M, int N, int K,
                               gpu_dtype adt, int lda, gpu_dtype bdt, int ldb);
/* The same product computed in cdt, as autocast runs a matmul: the operands are values of
 * cdt and the products are accumulated in fp32. A 16-bit operand must be fp32 or of cdt. An
 * fp32 operand named in `round` (GPU_GEMM_ROUND_A/B) is rounded to cdt (round-to-nearest-
 * even; e.g. the fp32 master weights); any other fp32 operand must already hold values of
 * cdt (e.g. a gradient the model has rounded), so the library may take it in cdt, e.g.
 * bf16 natively with AVX512_BF16 or AMX. An operand of the other 16-bit dtype makes the
 * product exact, as gpu_gemm. GPU_GEMM_A/B_CONVERTED: the bf16 operand holds values the
 * engine's conversions to bf16 wrote (gpu_cvt_f32_bf16 and what calls it, or copies of such
 * values), which the native bf16 kernels then read without first scanning them for the
 * subnormals those kernels would read as zero (the conversions note those; gpu_int.h). */
enum {
    GPU_GEMM_ROUND_A = 1,
    GPU_GEMM_ROUND_B = 2,
    GPU_GEMM_A_CONVERTED = 4,
    GPU_GEMM_B_CONVERTED = 8,
    GPU_GEMM_AB_CONVERTED = GPU_GEMM_A_CONVERTED | GPU_GEMM_B_CONVERTED,
};
int gpu_gemm_ex(bool ta, bool tb, int M, int N, int K,
                const void *A, gpu_dtype adt, int lda,
                const void *B, gpu_dtype bdt, int ldb, gpu_dtype cdt, unsigned round,
                float beta, float *C, int ldc, float *scratch, size_t scratch_floats);
size_t gpu_gemm_ex_scratch_floats(int M, int N, int K, gpu_dtype adt, gpu_dtype bdt,
                                  gpu_dtype cdt, unsigned round);
/* Force a GEMM path for tests and comparisons (AMPD_GEMM in the environment does the same
 * at first use): "auto"; "openblas" (everything on OpenBLAS, 16-bit operands widened);
 * "widen" (fp32 on oneDNN, 16-bit operands widened to it); "native" (bf16 natively on
 * oneDNN); "emulated" (bf16 planned as native, the native kernels emulated: every CPU, slow,
 * for tests). GPU_ENODEV when this machine lacks it, GPU_EINVAL for an unknown name. */
int gpu_gemm_force(const char *path);
/* The path in effect ("auto" when AMPD_GEMM names none this machine has); static. */
const char *gpu_gemm_path(void);
/* The paths this machine has besides auto, space-separated ("openblas widen native
 * emulated"), into out (len bytes, truncated). */
void gpu_gemm_paths(char *out, size_t len);
/* Which library and path a GEMM computing in dt takes here, e.g. "native bf16, oneDNN 2.6.3
 * (avx512_core_bf16)"; static. AMPD_GEMM=openblas in the environment forces OpenBLAS. */
const char *gpu_gemm_info(gpu_dtype dt);
/* Whether GEMMs computing in dt take operands stored in dt as they are (fp32 always; bf16
 * where it runs natively), so a caller holding a copy in dt saves the conversion. */
bool gpu_gemm_in_place(gpu_dtype dt);
/* The most scratch the GEMM libraries have allocated themselves in any thread, in bytes. */
size_t gpu_gemm_lib_bytes(void);
/* The naive triple loop with double accumulation: the reference the tests compare with. */
void gpu_gemm_ref(bool ta, bool tb, int M, int N, int K, const float *A, int lda,
                  const float *B, int ldb, float beta, float *C, int ldc);

/* What the daemon does when a run's diagnostics give a remedy for a problem that stops it
 * (the job spec's on_numerics): nothing more than today (the run fails or goes on), branch
 * from the last checkpoint before it with the remedy, or pause and ask. */
typedef GPU_ENUM{GPU_NUMERICS_STOP = 0, GPU_NUMERICS_BRANCH, GPU_NUMERICS_ASK} gpu_on_numerics;

/* ---- loss scaling (scaler.c) ------------------------------------------------------------ */

typedef GPU_ENUM { GPU_SCALE_NONE = 0, GPU_SCALE_STATIC, GPU_SCALE_DYNAMIC } gpu_scale_mode;

typedef struct {
    gpu_scale_mode mode;
    float init_scale;       /* 65536 */
    double growth_factor;   /* 2.0, > 1 (a double, as PyTorch keeps it) */
    double backoff_factor;  /* 0.5, in (0,1) */
    int growth_interval;    /* 2000 clean steps */
    int hysteresis;         /* 1 = none (PyTorch); n = n overflows before backing off */
    float min_scale;        /* floor, > 0 */
    float max_scale;        /* ceiling: growth is refused above it */
    int floor_patience;     /* consecutive overflowing steps at the floor before failing */
} gpu_scaler_config;

typedef struct {
    float scale;
    int growth_tracker;     /* clean steps since the last overflow or growth attempt */
    int hysteresis_left;
    int floor_streak;       /* consecutive overflowing steps at the floor */
    int64_t steps;
    int64_t overflow_total; /* steps whose gradients held inf/NaN */
    int64_t skipped_total;  /* optimizer steps skipped */
    int64_t growth_total;
    int64_t backoff_total;
} gpu_scaler_state;

/* PyTorch defaults for the given dtype: dynamic for fp16, none for fp32 and bf16. */
void gpu_scaler_defaults(gpu_scaler_config *c, gpu_dtype dt);
/* GPU_EINVAL (with the field in *field) when a value is out of range. */
int gpu_scaler_validate(const gpu_scaler_config *c, const char **field);
void gpu_scaler_init(gpu_scaler_state *s, const gpu_scaler_config *c);
/* The multiplier the unscale pass uses: (float)(1.0 / (double)scale). */
float gpu_scaler_inv(const gpu_scaler_state *s);
/* Apply one step's outcome. found_inf: the step's gradients held inf/NaN (and so the
 * optimizer step was skipped). PyTorch-exact for hysteresis 1 with no floor/ceiling hit.
 * Returns GPU_ESCALE_FLOOR when the scale has overflowed at its floor floor_patience times
 * in a row (the job should fail with a diagnosis), else 0. */
int gpu_scaler_update(gpu_scaler_state *s, const gpu_scaler_config *c, bool found_inf);

/* Per-tensor outcome of the fused unscale pass. */
typedef struct {
    float amax;         /* max |g| over finite elements, after unscaling */
    float amax_scaled;  /* the same before unscaling (what the low dtype had to hold) */
    int64_t nonfinite;  /* inf/NaN elements seen (on the scaled value) */
    int64_t zeros;      /* exact zeros after unscaling */
} gpu_grad_stat;

/* One fused pass over every gradient tensor: check the scaled value for inf/NaN, multiply
 * by inv (skipped when inv == 1.0f), record per-tensor stats, and accumulate the sum of
 * squares of the unscaled values in double. Tensors are described by offsets/counts into
 * one block g (borrowed, modified in place). stats has ntensors entries (may be NULL).
 * *found_inf is set when any element was not finite; *sumsq receives the sum of squares
 * (meaningless when found_inf). */
void gpu_unscale(float *g, const size_t *offsets, const size_t *counts, int ntensors,
                 float inv, gpu_grad_stat *stats, bool *found_inf, double *sumsq);
/* Name of the unscale path in use, "avx512" or "portable" (bit-identical results), and a
 * way to force one for tests: GPU_ENODEV if the CPU lacks it, GPU_EINVAL if unknown. */
const char *gpu_unscale_impl(void);
int gpu_unscale_force(const char *impl);

/* ---- optimizers (optim.c) --------------------------------------------------------------- */

typedef GPU_ENUM { GPU_OPT_ADAMW = 0, GPU_OPT_SGD } gpu_opt_type;
typedef GPU_ENUM { GPU_SCHED_CONSTANT = 0, GPU_SCHED_COSINE, GPU_SCHED_LINEAR } gpu_sched;

typedef struct {
    gpu_opt_type type;
    double lr;                /* the spec's doubles, as PyTorch keeps its hyperparameters */
    double beta1, beta2, eps; /* AdamW */
    double momentum;          /* SGD (nesterov off) */
    double weight_decay;      /* decoupled for AdamW, L2 into the gradient for SGD */
    float grad_clip;          /* global-norm clip on unscaled grads; <= 0 disables */
    int warmup_steps;         /* linear warmup from 0 */
    gpu_sched schedule;
    float min_lr_ratio;       /* floor of the decay as a fraction of lr (0) */
} gpu_optim_config;

void gpu_optim_defaults(gpu_optim_config *c);
int gpu_optim_validate(const gpu_optim_config *c, const char **field);
/* Learning rate for 0-based step `step` of `total` steps. */
double gpu_lr_at(const gpu_optim_config *c, int64_t step, int64_t total);

/* One optimizer update of n parameters, fused: reads grads g (fp32, unscaled, multiplied
 * by gmul, e.g. the clip coefficient), updates the fp32 master copy p and the state m/v
 * (v unused by SGD; pass NULL), and writes the working copy `work` in wdt (NULL when the
 * master is the working copy). t is the 1-based count of applied steps (bias correction).
 * All pointers borrowed. */
void gpu_optim_update(const gpu_optim_config *c, double lr, int64_t t, float gmul,
                      float *p, const float *g, float *m, float *v, size_t n,
                      void *work, gpu_dtype wdt);
/* A weight matrix of the parameter block: rows x cols parameters, row-major from element
 * off. */
typedef struct {
    size_t off;
    int rows, cols;
} gpu_optim_matrix;
/* gpu_optim_update for a model with no room for a working copy of its own (the MLP on the
 * CPU): each matrix of mats (ascending, disjoint; the first GPU_MAX_LAYERS) gets its copy in
 * wdt (fp16 or bf16) inside its own gradients, written once the update has read them; the
 * other parameters get none. The next forward and backward read it there
 * (gpu_optim_copy_at); a backward must read a matrix's copy before it writes that matrix's
 * gradient. */
void gpu_optim_update_in_grads(const gpu_optim_config *c, double lr, int64_t t, float gmul,
                               float *p, float *g, float *m, float *v, size_t n,
                               const gpu_optim_matrix *mats, int nmats, gpu_dtype wdt);
/* Where that update left the copy of the matrix at element off with cols columns in the
 * gradient block g, row-major with leading dimension *ld = cols: fp16's as fp32 values, each
 * in place of its gradient (*dt = GPU_FP32), bf16's in the first half of the matrix's
 * gradient bytes (*dt = GPU_BF16). */
const void *gpu_optim_copy_at(const float *g, size_t off, int cols, gpu_dtype wdt,
                              gpu_dtype *dt, int *ld);
/* The same without master weights: the parameters live only in wdt (uint16_t for the 16-bit
 * formats). Returns in *lost the number of elements whose update was non-zero but rounded
 * away (the stored value did not change). */
void gpu_optim_update_lowp(const gpu_optim_config *c, double lr, int64_t t, float gmul,
                           void *w, gpu_dtype wdt, const float *g, float *m, float *v,
                           size_t n, int64_t *lost);
/* Name of the update-kernel path in use, "avx512" or "portable" (bit-identical results), and
 * a way to force one for tests: GPU_ENODEV if the CPU lacks it, GPU_EINVAL if unknown. */
const char *gpu_optim_impl(void);
int gpu_optim_force(const char *impl);

/* ---- autocast policy (autocast.c) ------------------------------------------------------- */

typedef GPU_ENUM {
    GPU_CAST_LOWP = 0,  /* run in the job's low dtype, fp32 accumulation */
    GPU_CAST_FP32,      /* run in fp32 */
    GPU_CAST_INPUT      /* run in the dtype of the input */
} gpu_cast_policy;

typedef GPU_ENUM {
    GPU_OP_LINEAR = 0, GPU_OP_MATMUL, GPU_OP_RELU, GPU_OP_GELU, GPU_OP_ADD,
    GPU_OP_SOFTMAX, GPU_OP_LOG_SOFTMAX, GPU_OP_CROSS_ENTROPY, GPU_OP_LAYER_NORM,
    GPU_OP_EXP, GPU_OP_LOG, GPU_OP_SUM, GPU_OP_NORM, GPU_OP_EMBEDDING,
    GPU_OP_COUNT
} gpu_op;

typedef struct {
    gpu_cast_policy policy[GPU_OP_COUNT];
} gpu_autocast;

/* The default table (PyTorch's CUDA lists): matmul-like ops LOWP; softmax, log-softmax,
 * cross-entropy, layer norm, exp/log, sums and norms FP32; elementwise ops INPUT. */
void gpu_autocast_defaults(gpu_autocast *a);
const char *gpu_op_name(gpu_op op);
int gpu_op_parse(const char *name, gpu_op *out);
const char *gpu_cast_policy_name(gpu_cast_policy p); /* "lowp", "fp32", "input" */
int gpu_cast_policy_parse(const char *s, gpu_cast_policy *out);
/* The dtype an op runs in under job dtype dt when its input has dtype in. */
gpu_dtype gpu_autocast_dtype(const gpu_autocast *a, gpu_op op, gpu_dtype dt, gpu_dtype in);

/* ---- data (data.c) ---------------------------------------------------------------------- */

typedef GPU_ENUM { GPU_DATA_IDX = 0, GPU_DATA_SYNTHETIC, GPU_DATA_TEXT, GPU_DATA_TOKENS } gpu_data_type;

typedef struct {
    gpu_data_type type;
    char train_images[512], train_labels[512]; /* IDX files, gzip or raw */
    char eval_images[512], eval_labels[512];   /* empty: no eval set */
    /* synthetic: a fixed random teacher labels Gaussian inputs */
    int synth_features, synth_classes, synth_train, synth_eval;
    /* text (bytes of a file, or of every file of a directory in name order; vocab 256) and
     * tokens (llm.c shards: 256 int32 header, magic 20240520, version 1, count, uint16s) */
    char seq_train[512];
    char seq_eval[512];   /* empty: the last val_fraction of the training tokens */
    float val_fraction;   /* 0.1 */
    bool in_order;        /* idx, synthetic: every epoch in the file's order (not shuffled) */
    int64_t skip_batches; /* the steps' batches the run's data order starts past: step s
                           * trains on what step s + skip_batches would (0) */
} gpu_data_config;

typedef struct gpu_dataset gpu_dataset; /* opaque */

/* Load an IDX image/label pair (gzip or raw, detected from the bytes). Images must be
 * 3-d uint8, labels 1-d uint8 with the same count. Caller frees with gpu_dataset_free(). */
int gpu_dataset_load_idx(const char *images, const char *labels, gpu_dataset **out,
                         char *err, size_t errlen);
/* A deterministic synthetic classification set: Gaussian inputs labelled by the argmax of a
 * random linear teacher. The teacher depends only on teacher_seed, the samples only on
 * sample_seed (so a train and an eval set share a teacher). Caller frees. */
int gpu_dataset_synthetic(int n, int features, int classes, uint64_t teacher_seed,
                          uint64_t sample_seed, gpu_dataset **out);
/* Normalise d with the mean and standard deviation measured on `from` (for image data;
 * a no-op for synthetic data). Borrowed pointers. */
void gpu_dataset_normalize_like(gpu_dataset *d, const gpu_dataset *from);
void gpu_dataset_free(gpu_dataset *d);
int gpu_dataset_count(const gpu_dataset *d);
int gpu_dataset_features(const gpu_dataset *d);
int gpu_dataset_classes(const gpu_dataset *d);
/* Write rows idx[0..n) as normalised floats into x (n x features) and labels into y. */
void gpu_dataset_gather(const gpu_dataset *d, const int *idx, int n, float *x, int *y);

/* Sequence datasets (data.c). Load a text or token source and split it: *train gets the
 * first (1 - val_fraction) of the tokens and *val the rest (or the eval source when
 * eval_path is not empty/NULL). Caller frees both with gpu_dataset_free(). */
int gpu_dataset_load_text(const char *path, const char *eval_path, float val_fraction,
                          gpu_dataset **train, gpu_dataset **val, char *err, size_t errlen);
int gpu_dataset_load_tokens(const char *path, const char *eval_path, float val_fraction,
                            gpu_dataset **train, gpu_dataset **val, char *err, size_t errlen);
int64_t gpu_dataset_ntokens(const gpu_dataset *d);  /* 0 for a classification set */
int gpu_dataset_vocab(const gpu_dataset *d);        /* largest token + 1 (256 for text) */
/* The unigram statistics of a sequence set: the entropy (nats) of its token frequencies and
 * the frequency of its most frequent token, the loss and the accuracy of a model that
 * predicts every token from these frequencies alone (the plateau a language model sits on
 * before it uses the context). GPU_EINVAL for a classification set. */
int gpu_dataset_unigram(const gpu_dataset *d, double *entropy, double *top_freq);
/* B windows of T+1 consecutive tokens at positions drawn from (seed, step) alone (so a
 * resumed job draws the same batches): inputs x[b*T+t], targets y[b*T+t] = next token. */
void gpu_dataset_sample_seq(const gpu_dataset *d, uint64_t seed, int64_t step, int B, int T,
                            int *x, int *y);
/* Non-overlapping windows for evaluation: how many of length T+1, and window i. */
int64_t gpu_dataset_nwindows(const gpu_dataset *d, int T);
void gpu_dataset_window(const gpu_dataset *d, int64_t i, int T, int *x, int *y);

/* ---- jobs and the trainer (train.c) ---------------------------------------------------- */

#define GPU_MAX_LAYERS 16
#define GPU_MAX_CUDA_DEVICES 64 /* "cuda:N" names a device N below this */

typedef GPU_ENUM { GPU_ACT_RELU = 0, GPU_ACT_GELU } gpu_activation;
typedef GPU_ENUM { GPU_MODEL_MLP = 0, GPU_MODEL_GPT } gpu_model_type;
/* gpt: how attention is computed (docs/job-spec.md, model.attention) */
typedef GPU_ENUM {
    GPU_ATTN_MATERIALIZED = 0, /* the B x H x T x T softmax stored (nanoGPT's non-flash path) */
    GPU_ATTN_FLASH             /* fused, the softmax recomputed (FlashAttention-2's numerics) */
} gpu_attention;

typedef struct {
    gpu_model_type type;
    int nlayers;                 /* mlp: number of widths in layers[] (>= 2) */
    int layers[GPU_MAX_LAYERS];  /* mlp: widths, input first, classes last */
    gpu_activation activation;   /* mlp */
    float init_scale;            /* multiplies the default initialisation; 1.0 */
    /* gpt: a GPT-2-style pre-LN decoder with tied embeddings */
    int n_layer, n_head, d_model, seq_len, vocab;
    gpu_attention attention;
} gpu_model_config;

/* Whether flash attention supports head_dim hd: 16, 32, 48 or 64 (its tensor-core tiles and
 * their shared memory). */
static inline bool gpu_flash_head_dim_ok(int hd)
{
    return hd >= 16 && hd <= 64 && hd % 16 == 0;
}

/* What the data-parallel all-reduce does to the gradients (PyTorch's DDP comm hooks):
 * NONE all-reduces them in fp32; FP16 and BF16 cast each bucket to the 16-bit type, divide
 * by the world size there, sum in that type and copy the result back. */
typedef enum { GPU_HOOK_NONE = 0, GPU_HOOK_FP16, GPU_HOOK_BF16 } gpu_comm_hook;

#define GPU_MAX_HOSTS 16

/* Who starts a data-parallel job's ranks: Open MPI's mpirun (on this machine or across
 * distributed.hosts), or Slurm's srun with PMIx on the nodes Slurm allocates. DEFAULT: the
 * one the daemon (or `ampd run --launcher`) was given, else mpirun. */
typedef enum { GPU_LAUNCH_DEFAULT = 0, GPU_LAUNCH_MPIRUN, GPU_LAUNCH_SLURM } gpu_launcher;

/* What srun asks Slurm for (docs/cluster.md); 0 and "" leave a choice to Slurm, or to the
 * daemon's --slurm-partition, --slurm-account and --slurm-time. */
typedef struct {
    int nodes;          /* -N; 0: as Slurm places world_size tasks */
    int tasks_per_node; /* --ntasks-per-node; 0: not said (world_size / nodes when nodes is) */
    int cpus_per_task;  /* --cpus-per-task; 0: not said (Slurm's 1) */
    int gpus_per_task;  /* --gpus-per-task; 0: none asked for */
    char partition[64]; /* -p */
    char account[64];   /* -A */
    char time[32];      /* -t, Slurm's time format ("30", "1:00:00", "2-00:00:00") */
} gpu_slurm_config;

/* Data parallelism: world_size ranks of one job, each training on its share of the global
 * batch, the gradients all-reduced in buckets while backward runs. */
typedef struct {
    int world_size;        /* ranks (1: one process, no communication) */
    gpu_comm_hook hook;    /* NONE */
    double bucket_mb;      /* a bucket's size in MiB of fp32 gradients (25, as DDP) */
    int nhosts;            /* 0: every rank on this machine */
    char hosts[GPU_MAX_HOSTS][128]; /* mpirun's host list: "name" or "name:slots" */
    bool oversubscribe;    /* more ranks than the cores they are given (false) */
    int rank_timeout_s;    /* a rank without progress this long ends the job (60) */
    gpu_launcher launcher; /* DEFAULT */
    gpu_slurm_config slurm;
} gpu_dist_config;

/* What a job asks the daemon to hold for it while it runs (docs/scheduling.md); the trainer
 * does not read it. */
typedef struct {
    int cpus;          /* cores per rank; 0: the job's threads, else an even share */
    int devices;       /* GPUs per rank; -1: 1 for a CUDA job, 0 for a CPU job */
    int64_t memory_mb; /* host memory the job needs; 0: not said */
} gpu_resources;

typedef struct {
    char name[128];
    gpu_model_config model;
    gpu_data_config data;
    gpu_dtype dtype;
    bool master_weights;
    gpu_scaler_config scaler;
    gpu_autocast autocast;
    gpu_optim_config optim;
    int batch_size;              /* the global batch of one micro-step, split over the ranks */
    int grad_accum_steps;        /* micro-steps per optimizer step (1) */
    gpu_dist_config dist;
    int64_t steps;
    uint64_t seed;
    int64_t eval_every;          /* 0: only at the end */
    int64_t checkpoint_every;
    int checkpoint_keep_last;    /* checkpoints.keep_last: kept (3); 0: every one */
    int checkpoint_keep_best;    /* checkpoints.keep_best: also kept, lowest eval loss (1) */
    int64_t diagnostics_every;
    int threads;                 /* CPU threads (OpenMP team, BLAS); 0: all cores */
    char device[16];             /* "auto" (CUDA device 0 when one is usable, else the CPU),
                                  * "cpu", "cuda" (device 0) or "cuda:N" */
    int priority;                /* the daemon's queue order, higher first (0) */
    gpu_resources res;
    gpu_on_numerics on_numerics; /* what the daemon does with an acting remedy (STOP) */
    int max_branches;            /* branches on_numerics BRANCH may make in a lineage (2) */
    gpu_fp8_config fp8;          /* fp8.on: the linear layers' GEMMs in fp8 (dtype bf16) */
} gpu_job_config;

/* The job's precision as users name it: "fp8" for an fp8 job, else its dtype's name. */
const char *gpu_job_dtype_name(const gpu_job_config *c);

/* Whether job c's data can train its model, read the way the trainer reads it (every file,
 * so that a token past model.vocab is seen): 0, or the error the trainer would give, in err
 * (naming the files by their paths, or the spec's field: "model.vocab: ...", "data.train:
 * ..."). */
int gpu_job_check_data(const gpu_job_config *c, char *err, size_t errlen);

/* Defaults for every field (documented in docs/job-spec.md); dtype fp32. */
void gpu_job_defaults(gpu_job_config *c);

/* Bytes by category, as the metrics report them. */
typedef struct {
    int64_t weights;      /* working copy the forward pass reads (the params for fp32) */
    int64_t master;       /* fp32 master copy (0 when it is the working copy or disabled) */
    int64_t grads;
    int64_t optimizer;
    int64_t activations;  /* saved for backward, in their storage dtype */
    int64_t workspace;    /* GEMM widening buffers and temporaries */
    int64_t fp8;          /* an fp8 job's fp8 copies of the GEMM operands and scaling state */
    int64_t total;
} gpu_mem;

typedef struct {
    int64_t step;          /* 1-based */
    double loss;           /* unscaled training loss of the batch (may be inf/NaN) */
    float lr;
    float loss_scale;      /* scale used for this step's backward */
    bool overflow;         /* gradients held inf/NaN */
    bool skipped;          /* the optimizer step was skipped */
    int64_t overflow_total, skipped_total;
    double grad_norm;      /* global norm of unscaled grads before clipping; NaN on overflow */
    double step_ms;
    double samples_per_s;
    double tokens_per_s;   /* sequence models: tokens trained per second (0 otherwise) */
    int64_t lost_updates;  /* master_weights off: updates that rounded away this step */
    int64_t lost_total;    /* ... of params_total elements in total */
    int64_t comm_bytes;    /* gradient bytes this rank handed to the all-reduce (0: one rank) */
    double comm_ms;        /* time the step's all-reduces were in flight (first start to last
                            * completion) */
    double comm_exposed_ms; /* the part of comm_ms after backward ended (not overlapped) */
    double step_ms_max;    /* the slowest rank's step time (step_ms with one rank) */
    int slowest_rank;      /* that rank */
    gpu_mem mem;
    gpu_mem peak;
    bool diagnosed;        /* per-layer diagnostics were collected (gpu_trainer_diagnostics) */
} gpu_step_metrics;

typedef struct {
    double loss;
    double accuracy;
    int64_t count;
} gpu_eval_result;

typedef struct gpu_trainer gpu_trainer; /* opaque */

/* The bytes the job's blocks will take (*out, by category) without allocating them;
 * GPU_EINVAL with a message for a malformed model. */
int gpu_job_memory(const gpu_job_config *c, gpu_mem *out, char *err, size_t errlen);

/* Build the model, load the data and allocate every block, on the device cfg->device names
 * (see gpu_job_config). On failure returns a GPU_E* code (GPU_ENODEV when the CUDA device
 * asked for cannot be used) and, when err is not NULL, a message naming the problem. Caller
 * frees with gpu_trainer_free(). cfg is copied. */
int gpu_trainer_create(const gpu_job_config *cfg, gpu_trainer **out, char *err, size_t errlen);
void gpu_trainer_free(gpu_trainer *t);
/* Run one training step and fill *m. Returns GPU_ESCALE_FLOOR (with err) when the scale is
 * stuck at its floor; the step's metrics are still filled. */
int gpu_trainer_step(gpu_trainer *t, gpu_step_metrics *m, char *err, size_t errlen);
/* Whether anything has written outside the trainer's blocks (weights, gradients, optimizer
 * state, activations, scratch): GPU_EGUARD with which block and how far out in err (may be
 * NULL), else 0. Each block's header is checked, and in guard mode the bytes around it.
 * gpu_trainer_step checks after every step (GPU_EGUARD instead of its result). */
int gpu_trainer_check(const gpu_trainer *t, char *err, size_t errlen);
/* Guard mode, for finding stray writes: each of a trainer's blocks made between two
 * inaccessible pages (a write past one faults where it is made) with a pattern around it
 * that gpu_trainer_check verifies. On when AMPD_GUARD is set (and not "0") at the first
 * block a process makes; gpu_guard_set (tests) changes it for the blocks made afterwards. */
bool gpu_guard_on(void);
void gpu_guard_set(bool on);
/* Evaluate on the eval set (or the training set when there is none). */
int gpu_trainer_eval(gpu_trainer *t, gpu_eval_result *r);
int64_t gpu_trainer_params(const gpu_trainer *t);
/* gpu_dataset_unigram of the trainer's training set (this rank's, under data parallelism). */
int gpu_trainer_unigram(const gpu_trainer *t, double *entropy, double *top_freq);
/* Where the trainer runs: "cpu", "cpu (CUDA unusable: why)" when "auto" found a device it
 * could not use, or "cuda:N (device name, compute capability, memory; what the job holds)".
 * Valid while the trainer lives. */
const char *gpu_trainer_device(const gpu_trainer *t);
const gpu_scaler_state *gpu_trainer_scaler(const gpu_trainer *t);
/* The named tensors of the parameter blocks ("fc1.weight", ...) and the per-tensor
 * gradient statistics of the last step (ntensors entries; valid until the next step). */
int gpu_trainer_tensors(const gpu_trainer *t);
const char *gpu_trainer_tensor_name(const gpu_trainer *t, int i);
const gpu_grad_stat *gpu_trainer_grad_stats(const gpu_trainer *t);

/* ---- data parallelism (comm.c) ----------------------------------------------------------
 *
 * A job with dist.world_size N > 1 runs as N processes started by Open MPI's mpirun, each
 * one rank: the same trainer on its 1/N of every global batch (rank r takes samples
 * [r B/N, (r+1) B/N) of the batch world 1 would draw), the gradients all-reduced (MPI on
 * CPU ranks, NCCL on CUDA ranks) in buckets of dist.bucket_mb while backward still runs,
 * with the job's comm hook.
 * Every rank then holds the same gradients, finds the same inf/NaN, skips the same steps
 * and keeps the same scaler state (compared every step: a difference is GPU_ECOMM).
 * Every rank must call the collective functions (gpu_trainer_step, gpu_comm_any) the same
 * number of times, in the same order.
 *
 * Errors: GPU_ECOMM (with a message) when MPI fails or the build has no MPI. */
typedef struct gpu_comm gpu_comm; /* opaque */

/* "none", "fp16", "bf16" (the job spec's comm_hook names). */
const char *gpu_comm_hook_name(gpu_comm_hook h);
/* "default", "mpirun" or "slurm". */
const char *gpu_launcher_name(gpu_launcher l);
/* Whether this build has MPI (else every job has one rank). */
bool gpu_comm_available(void);
/* Whether this process is a rank of an mpirun job (mpirun's environment says so). */
bool gpu_comm_launched(void);
/* Join the ranks of this process's mpirun job (once per process; MPI_Init_thread). */
int gpu_comm_init(gpu_comm **out, char *err, size_t errlen);
/* Leave (MPI_Finalize). NULL is accepted. */
void gpu_comm_free(gpu_comm *c);
/* Free c without MPI_Finalize: for a rank that fails alone (its trainer could not start, say)
 * while the others wait in a collective. MPI_Finalize would wait for them; a rank that
 * exits without it makes mpirun end the whole job. NULL is accepted. */
void gpu_comm_abandon(gpu_comm *c);
int gpu_comm_rank(const gpu_comm *c);
int gpu_comm_size(const gpu_comm *c);
/* The ranks on this machine (mpirun's local size; 1 when unknown). */
int gpu_comm_local_size(const gpu_comm *c);
/* Every rank's host name (gethostname), rank r's at names + r * each (each bytes, cut and
 * NUL-terminated; names holds gpu_comm_size(c) of them). Collective: every rank calls it. */
int gpu_comm_hosts(gpu_comm *c, char *names, size_t each);
/* What the last GPU_ECOMM was about ("rank 1: MPI_Allreduce ...: ..."; "" when none). */
const char *gpu_comm_error(const gpu_comm *c);
/* *any = whether mine is true on some rank (a MAX all-reduce, so every rank agrees). */
int gpu_comm_any(gpu_comm *c, bool mine, bool *any);
/* When the last step's inf/NaN came from the compressed all-reduce (every rank's gradients
 * were finite before it): the tensors whose reduced gradients hold inf/NaN, in backward
 * order (at most max, names valid while t lives); 0 otherwise. The step's diagnostics then
 * say where = "comm". */
int gpu_trainer_comm_overflow(const gpu_trainer *t, const char **names, int max);
/* Rank 0 of several: every rank's last step in ms without the time it waited for the
 * gradients' all-reduce (*busy, one entry a rank, valid until the next step); returns the
 * rank count, 0 on the other ranks and with one rank. A rank whose busy time stays above
 * the others' is the one they wait for. */
int gpu_trainer_rank_busy(const gpu_trainer *t, const double **busy);
/* Make t one rank of c's job (before its first step): c's size must be the job's
 * dist.world_size (whose division of batch_size gpu_trainer_create checked), and every rank
 * on the same backend. c is borrowed and must outlive t. */
int gpu_trainer_set_comm(gpu_trainer *t, gpu_comm *c, char *err, size_t errlen);

/* ---- step profile (train.c; on CUDA cuda_prof.c) ---------------------------------------
 *
 * Where one step's time goes, phase by phase, for finding what to make faster. On CUDA each
 * group of ops is closed by a CUDA event on the step's stream and a phase is the device time
 * between events ("embed.fwd", "layernorm.fwd" (with the residual adds fused into it),
 * "linear.fwd", "attention.fwd", "gelu.fwd", "head.fwd" (lm_head and the fused
 * cross-entropy; an MLP's loss), the same with ".bwd", "upload", "unscale", "clip",
 * "optimizer", "scaler"); the events cost the step a few microseconds each. On the CPU,
 * whose ops run one after another, the clock times "forward", "backward", "unscale" and
 * "optimizer". A collecting (diagnostics) step counts its collection in the phases it
 * happens in. */
#define GPU_PROFILE_MAX_PHASES 32
typedef struct {
    char name[24];
    double ms;     /* summed over the step */
    int calls;     /* op groups it sums */
} gpu_phase_time;

typedef struct {
    int n;                                     /* phases, in the order they first ran */
    gpu_phase_time phase[GPU_PROFILE_MAX_PHASES];
} gpu_profile;

/* Add ms to phase name (a new phase when p has room; else the time is dropped). */
void gpu_profile_add(gpu_profile *p, const char *name, double ms);
/* Profile the next step; afterwards gpu_trainer_profile() returns its phases. */
void gpu_trainer_profile_next(gpu_trainer *t);
/* The phases of the last profiled step (NULL before any), valid until the next one. */
const gpu_profile *gpu_trainer_profile(const gpu_trainer *t);

/* ---- per-layer diagnostics (diag.c, train.c) -------------------------------------------
 *
 * A trainer collects them every diagnostics_every steps and on every step whose gradients
 * overflowed (recomputing that step's forward and backward on the same batch when it was
 * not a collecting step; the step is skipped either way). Layers are the model's
 * low-precision ops in forward order ("fc1", "fc2", ... for the MLP). */
typedef struct {
    const char *name;         /* borrowed from the trainer */
    gpu_dtype dtype;          /* the op's compute dtype */
    double act_amax;          /* largest finite |output| before rounding to dtype */
    double act_headroom;      /* dtype max / act_amax; +inf when act_amax is 0 */
    int64_t act_overflow;     /* outputs that became inf/NaN when rounded to dtype */
    double grad_amax;         /* largest finite |weight gradient|, unscaled (divided by S) */
    double grad_underflow;    /* fraction of the non-zero weight-gradient values lost to 0 in
                               * dtype at the current scale S: flushed when rounded, or 0
                               * because every gradient reaching their unit was flushed
                               * upstream (MLP) */
    double grad_underflow_unscaled; /* the fraction that would be lost without loss scaling
                                     * (|g / S| <= half dtype's smallest subnormal) */
    int64_t grad_nonfinite;   /* weight-gradient values that were inf/NaN in dtype */
    double lost_updates;      /* master_weights off: fraction of the layer's parameter
                               * updates that rounded away this step; 0 otherwise */
    /* an fp8 layer's GEMM operands (fp8 set; docs/fp8.md): in (its input), w (its weight),
     * grad (its output gradient) */
    bool fp8;
#define GPU_LAYER_FP8_STAT(r)                                                                      \
    double fp8_##r##_amax;      /* largest |x|, NaN when a NaN was cast */                         \
    double fp8_##r##_scale;     /* the scale the cast used */                                      \
    double fp8_##r##_headroom;  /* log2(fp8 max / (amax x scale)): < 0 saturates */                \
    double fp8_##r##_saturated; /* fraction of the values clipped to +-max */                      \
    double fp8_##r##_underflow; /* fraction of the non-zero values that became 0 */
    GPU_LAYER_FP8_STAT(in)
    GPU_LAYER_FP8_STAT(w)
    GPU_LAYER_FP8_STAT(grad)
#undef GPU_LAYER_FP8_STAT
} gpu_layer_stat;

/* A plain-language recommendation drawn from the diagnostics and the scaler state. */
typedef struct {
    const char *layer;        /* the layer it is about, or NULL for the whole job */
    const char *kind;         /* a stable key: "act_overflow", "act_headroom", "underflow",
                               * "lost_updates", "scale_floor", "scale_below_one" */
    const char *message;      /* e.g. "activations of fc2 exceed fp16's 65504 (max
                               * 1.2e+05): use bf16" */
} gpu_recommendation;

/* The per-layer results of the last step when it collected them (metrics.diagnosed):
 * *layers (n entries, borrowed, valid until the next step), the first layer whose output
 * or gradient held inf/NaN (NULL when none) and where ("forward", "backward", or "comm" when
 * every rank's gradients were finite and the compressed all-reduce made them inf/NaN; NULL when
 * none). GPU_EINVAL (and *n = 0) when the last step did not collect. Out-pointers other
 * than layers and n may be NULL. */
int gpu_trainer_diagnostics(const gpu_trainer *t, const gpu_layer_stat **layers, int *n,
                            const char **first_nonfinite_layer, const char **where);
/* The recommendations that are new at the last step (n may be 0): each distinct one is
 * given once per job, and again only when its number changes by a factor of two or more.
 * Borrowed, valid until the next step. Always 0. */
int gpu_trainer_recommendations(const gpu_trainer *t, const gpu_recommendation **recs, int *n);

/* ---- checkpoint state (train.c) -------------------------------------------------------- */

/* One tensor of a trainer's state, pointing into its blocks: the weights (the fp32 master,
 * or the low-precision weights when there is none), the optimizer state and the data
 * order. Names follow PyTorch ("fc1.weight", "optim.exp_avg.fc1.weight", ...). */
typedef struct {
    char name[64];
    const char *dtype; /* safetensors dtype: "F32", "F16", "BF16" or "I32" */
    int ndim;
    int64_t shape[2];
    void *data;        /* borrowed: valid while the trainer lives */
    size_t bytes;
} gpu_state_tensor;

typedef struct {
    int64_t step;        /* steps taken */
    int64_t applied;     /* optimizer steps applied (AdamW's t) */
    int64_t lost_total;
    int64_t perm_pos;    /* position in the shuffled data order */
    int64_t skipped;     /* the steps' batches skipped so far (data.skip_batches applied) */
    gpu_scaler_state scaler;
    uint64_t rng[4];     /* the shuffling generator */
    int world_size;      /* the ranks that trained it (0: not recorded; set_scalars refuses
                          * another number) */
} gpu_state_scalars;

/* The trainer's state tensors: a heap array of *n entries (caller frees it with free();
 * the data stays the trainer's). Writing into the data and then calling
 * gpu_trainer_set_scalars() restores a checkpoint. */
int gpu_trainer_state(gpu_trainer *t, gpu_state_tensor **out, int *n);
void gpu_trainer_get_scalars(const gpu_trainer *t, gpu_state_scalars *out);
/* Restore the scalars after the tensors were written, and refresh the working copy from
 * the master weights. GPU_EINVAL when a value cannot belong to this job. */
int gpu_trainer_set_scalars(gpu_trainer *t, const gpu_state_scalars *in);

/* ---- CUDA (gpu/cuda/; cuda_none.c when built without CUDA) ------------------------------ */

/* 0 when a CUDA device can be used; otherwise GPU_ENODEV and a reason in why (e.g.
 * "built without CUDA", "no CUDA driver", "no CUDA device"). */
int gpu_cuda_probe(char *why, size_t whylen);
/* One visible CUDA device, as the runtime describes it (no context is created). */
typedef struct {
    char name[256];
    uint64_t memory_bytes; /* total global memory */
    int cc_major, cc_minor;
    int multiprocessors;
} gpu_cuda_device;
/* The first max devices into out (caller's array), their number in *n; GPU_ENODEV (with *n
 * 0) when there is none, no driver, or no CUDA in this build. */
int gpu_cuda_devices(gpu_cuda_device *out, int max, int *n);
/* One NVIDIA GPU as the driver's management library (NVML) sees it, without a CUDA
 * context (gpu/nvml.c). index is NVML's, the order CUDA_VISIBLE_DEVICES numbers. */
typedef struct {
    int index;
    char name[96];
    char uuid[96];
    uint64_t memory_total, memory_free, memory_used; /* bytes */
    char health[96]; /* "ok", or what NVML answered when the device was queried */
} gpu_nvml_device;
/* The machine's first max GPUs into out, their number in *n, and a line for the log in why
 * (may be NULL). GPU_ENODEV (*n 0, the reason in why) without the NVIDIA driver's library
 * ($AMPD_NVML, else libnvidia-ml.so.1). */
int gpu_nvml_devices(gpu_nvml_device *out, int max, int *n, char *why, size_t whylen);
/* The bytes job c's blocks take on a CUDA device, by category, as the CUDA trainer allocates
 * them (cuBLASLt's workspace and the batch and step-state blocks in workspace); computed
 * without a device. GPU_ENODEV in a build without CUDA; plan errors as gpu_job_memory. */
int gpu_cuda_job_memory(const gpu_job_config *c, gpu_mem *out, char *err, size_t errlen);
/* Host-to-host wrappers that run the CUDA conversion kernels (for tests and checks):
 * copy in, convert on the device, copy out. */
int gpu_cuda_cvt_f32_f16(uint16_t *dst, const float *src, size_t n);
int gpu_cuda_cvt_f16_f32(float *dst, const uint16_t *src, size_t n);
int gpu_cuda_cvt_f32_bf16(uint16_t *dst, const float *src, size_t n);
int gpu_cuda_cvt_bf16_f32(float *dst, const uint16_t *src, size_t n);
/* The fused unscale kernel with gpu_unscale()'s contract, on host buffers. */
int gpu_cuda_unscale(float *g, const size_t *offsets, const size_t *counts, int ntensors,
                     float inv, gpu_grad_stat *stats, bool *found_inf, double *sumsq);

#ifdef __cplusplus
}
#endif
#endif /* AMPD_GPU_H */
