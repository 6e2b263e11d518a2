/*
 * fp8.c - the two 8-bit floating-point formats of FP8 training (OCP's, NVIDIA's): E4M3
 * (bias 7, largest 448, no infinity, NaN S.1111.111) and E5M2 (bias 15, largest 57344,
 * IEEE-like infinities and NaNs), converted from and to fp32.
 *
 * Semantics (the contract of gpu.h; NVIDIA's __nv_cvt_float_to_fp8 gives the same bits,
 * tests/check_fp8.c compares every fp32 input):
 *   fp32 -> fp8: round to nearest, ties to even, on the exact value; subnormal results and
 *     signed zeros are kept (a value at or below half the smallest subnormal becomes a zero
 *     of its sign). A value whose rounding lands beyond the largest finite one (and +-inf)
 *     becomes +-max when saturating; otherwise E4M3 gives its NaN with the sign (0x7F|s) and
 *     E5M2 +-inf. Every NaN becomes the one NaN code 0x7F (sign dropped), in both formats.
 *   fp8 -> fp32: exact; E5M2's infinities are +-inf; every NaN code gives the canonical quiet
 *     NaN 0x7FC00000.
 * Integer arithmetic on the bits only, so MXCSR (FTZ/DAZ, the rounding mode) cannot change
 * a result. The bulk conversions run the scalar ones (decoding through a table of the 256
 * codes), on the OpenMP team from GPU_PAR_MIN elements: each element's result depends on
 * that element alone.
 *
 * Scaling (Transformer Engine's recipes, per tensor): current scaling from this step's amax;
 * delayed scaling from a history of amaxes, computed before the history rolls, the previous
 * scale kept for an amax of 0, inf or NaN, an infinite scale made FLT_MAX, and nothing
 * changed in a step whose amax is 0 (TE: a module that did not run). The division is fp32
 * round-to-nearest, so the scales are the bits TE computes.
 *
 * Threads: all functions are thread-safe (the tables are built once, under pthread_once).
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "gpu/gpu_int.h"

typedef struct {
    int mbits, bias;
    uint32_t zero_below; /* |x| bits at or below half the smallest subnormal: a zero */
    uint32_t too_big;    /* |x| bits at 2^(emax + 1) and above: past every code */
    uint8_t max_code;    /* the largest finite value's code */
} fp8_fmt;

static const fp8_fmt fmts[2] = {
    [GPU_E4M3] = {3, 7, 0x3A800000u /* 2^-10 */, 0x44000000u /* 512 */, 0x7E},
    [GPU_E5M2] = {2, 15, 0x37000000u /* 2^-17 */, 0x47800000u /* 65536 */, 0x7B},
};

const char *gpu_fp8_format_name(gpu_fp8_format f)
{
    return f == GPU_E5M2 ? "e5m2" : "e4m3";
}

float gpu_fp8_max(gpu_fp8_format f)
{
    return f == GPU_E5M2 ? GPU_E5M2_MAX : GPU_E4M3_MAX;
}

/* The code of |x| (bits a, finite, above zero_below) rounded to nearest even, before any
 * overflow check: up to 0xFF for a value past the largest finite one. */
static unsigned round_code(const fp8_fmt *p, uint32_t a)
{
    int e = (int)(a >> 23) - 127 + p->bias; /* the biased fp8 exponent */
    uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    int shift = 23 - p->mbits + (e < 1 ? 1 - e : 0); /* bits rounded off (<= 24) */
    unsigned code = (e >= 1 ? (unsigned)(e - 1) << p->mbits : 0) + (m >> shift);
    uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (code & 1)))
        code++; /* a carry moves into the exponent, as it should */
    return code;
}

uint8_t gpu_f32_to_fp8(float x, gpu_fp8_format f, bool saturate)
{
    const fp8_fmt *p = &fmts[f == GPU_E5M2];
    uint32_t b, a;
    memcpy(&b, &x, sizeof(b));
    a = b & 0x7FFFFFFFu;
    uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
    if (a > 0x7F800000u) /* NaN */
        return 0x7Fu;
    if (a <= p->zero_below)
        return sign;
    unsigned code = a >= p->too_big ? 0xFFu : round_code(p, a);
    if (code > p->max_code)
        code = saturate ? p->max_code : f == GPU_E5M2 ? 0x7Cu : 0x7Fu;
    return sign | (uint8_t)code;
}

static float decode(uint8_t v, gpu_fp8_format f)
{
    const fp8_fmt *p = &fmts[f == GPU_E5M2];
    unsigned mag = v & 0x7Fu, e = mag >> p->mbits, m = mag & ((1u << p->mbits) - 1);
    uint32_t bits, sign = (uint32_t)(v & 0x80u) << 24;
    float out;
    if (f == GPU_E4M3 ? mag == 0x7Fu : e == 0x1Fu) {
        bits = f == GPU_E5M2 && m == 0 ? sign | 0x7F800000u : 0x7FC00000u;
    } else if (e > 0) {
        bits = sign | (e - (unsigned)p->bias + 127u) << 23 | m << (23 - p->mbits);
    } else { /* subnormal or zero: m x 2^(1 - bias - mbits), exact in fp32 */
        out = ldexpf((float)m, 1 - p->bias - p->mbits);
        memcpy(&bits, &out, sizeof(bits));
        bits |= sign;
    }
    memcpy(&out, &bits, sizeof(out));
    return out;
}

static float tables[2][256];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void build_tables(void)
{
    for (int c = 0; c < 256; c++) {
        tables[GPU_E4M3][c] = decode((uint8_t)c, GPU_E4M3);
        tables[GPU_E5M2][c] = decode((uint8_t)c, GPU_E5M2);
    }
}

float gpu_fp8_to_f32(uint8_t v, gpu_fp8_format f)
{
    pthread_once(&tables_once, build_tables);
    return tables[f == GPU_E5M2][v];
}

void gpu_cvt_f32_fp8(uint8_t *dst, const float *src, size_t n, gpu_fp8_format f, bool saturate)
{
#pragma omp parallel for if (gpu_par_worth(n)) schedule(static)
    for (size_t i = 0; i < n; i++)
        dst[i] = gpu_f32_to_fp8(src[i], f, saturate);
}

void gpu_cvt_fp8_f32(float *dst, const uint8_t *src, size_t n, gpu_fp8_format f)
{
    pthread_once(&tables_once, build_tables);
    const float *t = tables[f == GPU_E5M2];
#pragma omp parallel for if (gpu_par_worth(n)) schedule(static)
    for (size_t i = 0; i < n; i++)
        dst[i] = t[src[i]];
}

/* ---- scaling ---------------------------------------------------------------------------- */

float gpu_fp8_scaled_max(gpu_fp8_format f, int margin)
{
    return ldexpf(gpu_fp8_max(f), -margin); /* a power of two: exact */
}

float gpu_fp8_current_scale(float amax, float scaled_max, float epsilon)
{
    if (amax < epsilon)
        amax = epsilon;
    if (isinf(amax) || isnan(amax) || amax == 0.0f)
        return 1.0f;
    float scale = scaled_max / amax;
    return isinf(scale) ? FLT_MAX : scale;
}

void gpu_fp8_delayed_update(float *history, int len, gpu_fp8_amax_algo algo, float scaled_max,
                            float *scale, float *scale_inv)
{
    float last = history[0], amax = 0.0f;
    if (last == 0.0f) /* the tensor did not take part this step */
        return;
    for (int i = 0; i < len; i++)
        amax = fmaxf(amax, history[i]);
    if (algo == GPU_FP8_AMAX_MOST_RECENT)
        amax = last;
    if (isfinite(amax) && amax > 0.0f) {
        float s = scaled_max / amax;
        *scale = isinf(s) ? FLT_MAX : s;
    }
    *scale_inv = 1.0f / *scale;
    memmove(history, history + 1, (size_t)(len - 1) * sizeof(float));
    history[len - 1] = last;
    history[0] = 0.0f; /* the staging slot: the oldest entry, which leaves the window */
}
