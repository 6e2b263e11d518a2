/*
 * gpt_int.h - what the GPT's two files share (internal to gpu/; the API is gpu/gpt.h):
 * gpu/gpt.c (the model, its plan and its ops but the attention) and gpu/gpt_attn.c (causal
 * multi-head attention, materialised and flash). Holds the kernel-cloning macros, the
 * fused rounding passes, the vectorisable exp and sums every softmax uses, the OpenMP team
 * helpers, and the attention's entry points for the model's passes.
 *
 * Invariants: every helper here computes each value with the same arithmetic in the same
 * order whatever the number of threads (gpu/gpt.c's top comment). Threads: the _par
 * passes start an OpenMP team for n of at least PAR_MIN floats; the rest run on the
 * calling thread.
 */
#ifndef AMPD_GPT_INT_H
#define AMPD_GPT_INT_H

#include <string.h>

#include "gpu/diag.h"
#include "gpu/gpu_int.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Elementwise kernels, cloned for AVX-512 and AVX2 and picked at load time (ifunc).
 * no-trapping-math lets the branch-free selects (clamps, NaN passes) vectorise without
 * AVX-512's masks; results are the same IEEE values (ampd never enables FP traps). */
#ifdef __clang__ /* clang 14 gives clones of static functions global resolvers, which clash */
#define HOT
#else
// clang-format off
#define HOT __attribute__((target_clones("avx512f", "avx2", "default"), \
                           optimize("O3", "no-trapping-math")))
// clang-format on
#endif
#define INLINE static inline __attribute__((always_inline))

#define CHUNK 1024 /* floats per chunk of a fused elementwise pass (4 KiB: its passes stay in L1) */
#define PAR_MIN 16384 /* floats below which a pass stays on one thread (a team costs ~1 us) */

static inline size_t align16f(size_t n)
{
    return (n + 15) & ~(size_t)15;
}

static inline size_t min_sz(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* Whether a pass over n floats is worth a team of threads. */
static inline bool big(size_t n)
{
    return n >= PAR_MIN;
}

/* Round n floats in place to dt (nothing to do for fp32). */
static inline void rnd(float *v, size_t n, gpu_dtype dt)
{
    if (dt != GPU_FP32)
        gpu_round_n(v, v, n, dt);
}

/* Round values of dtype `from` to dtype `to` in place: the cast between two ops, or the
 * backward of a cast from `to` (which rounds the gradient to the dtype cast from). */
static inline void cast(float *v, size_t n, gpu_dtype from, gpu_dtype to)
{
    if (to != GPU_FP32 && to != from)
        gpu_round_n(v, v, n, to);
}

/* v rounded to a, then cast from a to b (an op's output rounded and handed to an op in b),
 * CHUNK floats at a time on every core: the same values, as rounding is elementwise. */
static inline void rnd_cast_par(float *v, size_t n, gpu_dtype a, gpu_dtype b)
{
    if (a == GPU_FP32 && b == GPU_FP32)
        return;
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = min_sz(CHUNK, n - i);
        rnd(v + i, k, a);
        cast(v + i, k, a, b);
    }
}

static inline void rnd_par(float *v, size_t n, gpu_dtype dt)
{
    rnd_cast_par(v, n, dt, dt);
}

/* dst = src rounded to dt (a 16-bit dtype), and the same values stored in dt at store when
 * it is not NULL, in the same pass; on every core. */
static inline void round_par(float *dst, const float *src, size_t n, gpu_dtype dt, void *store)
{
    size_t es = gpu_dtype_size(dt);
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = min_sz(CHUNK, n - i);
        gpu_round_n(dst + i, src + i, k, dt);
        if (store)
            gpu_cvt_from_f32((char *)store + i * es, dt, dst + i, k);
    }
}

/* 2^e as a float, for e in [-126, 127] (other values give garbage, never UB). */
INLINE float pow2(int32_t e)
{
    uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE int32_t i_of(float f)
{
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i;
}

/* exp(x) for every float: Cody-Waite reduction by ln 2, Cephes' degree-6 polynomial, and
 * the power of two applied as two factors so that results down to the subnormals and up to
 * inf come out right. Branch-free, so loops over it vectorise. */
INLINE float vexp(float x)
{
    float xc = x < -104.0f ? -104.0f : x;
    xc = xc > 89.0f ? 89.0f : xc;
    float t = xc * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: round to integer */
    float n = t - 12582912.0f;
    int32_t ni = i_of(t) - 0x4B400000;
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t n1 = ni >> 1, n2 = ni - n1;
    float y = p * pow2(n1) * pow2(n2);
    return x != x ? x : y;
}

/* Sum of n floats with 16 partial sums (a fixed order whatever the vector width). */
INLINE float sum16(const float *restrict v, int n)
{
    float acc[16] = {0};
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++)
            acc[k] += v[j + k];
    float s = 0.0f;
    for (; j < n; j++)
        s += v[j];
    for (int k = 0; k < 16; k++)
        s += acc[k];
    return s;
}

HOT static inline void scale_n(float *restrict v, float s, size_t n)
{
    for (size_t j = 0; j < n; j++)
        v[j] *= s;
}

/* p[j] = exp(s[j] - mx) for j < n; returns their sum. */
HOT static inline float exp_shifted(float *restrict p, const float *restrict s, float mx, int n)
{
    for (int j = 0; j < n; j++)
        p[j] = vexp(s[j] - mx);
    return sum16(p, n);
}

HOT static inline void div_n(float *restrict p, float d, int n)
{
    for (int j = 0; j < n; j++)
        p[j] = p[j] / d;
}

/* The OpenMP team a parallel region would start here, at most most (1 without OpenMP). */
static inline int team_size(int most)
{
#ifdef _OPENMP
    int n = omp_get_max_threads();
#else
    int n = 1;
#endif
    return n < 1 ? 1 : n > most ? most : n;
}

/* The calling thread's number in its OpenMP team (0 outside one). */
static inline int team_rank(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* ---- the attention (gpt_attn.c) ---------------------------------------------------------- */

/* What the model stores in mm_dt for an attention pass: on the native path qkv (multiplied
 * as it is stored) and where the heads also store their output (y, or dqkv; NULL: not);
 * elsewhere, for the backward, qkv to widen. */
typedef struct {
    const uint16_t *qkv;
    uint16_t *out;
    const uint16_t *wide; /* the backward's qkv stored in mm_dt, which the heads widen (qkv
                           * NULL: the library cannot take mm_dt as stored) */
} attn_store;

/* gpu_gpt_attention_fwd (gpu/gpt.h), or with st (NULL: none) on qkv stored in mm_dt, which
 * runs natively. */
int gpt_attn_fwd16(const float *qkv, const attn_store *st, int B, int T, int C, int H,
                   gpu_dtype mm_dt, gpu_dtype sm_dt, float *probs, float *y, float *scratch,
                   int slots, gpu_diag *diag, int layer);
/* gpu_gpt_attention_bwd, or with st as gpt_attn_fwd16 (qkv may then be NULL; the heads store
 * dqkv only without diag, which sees it before it is rounded), or with st->wide, whose slices
 * each head widens (qkv may then be NULL). */
int gpt_attn_bwd16(const float *dy, const float *qkv, const attn_store *st, const float *probs,
                   int B, int T, int C, int H, gpu_dtype mm_dt, gpu_dtype sm_dt, float *dqkv,
                   float *scratch, int slots, gpu_diag *diag, int layer);

#endif
