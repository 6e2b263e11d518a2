/*
 * gpt.c - a GPT-2-style pre-LN decoder (token and position embeddings, causal multi-head
 * attention, GELU MLP, final layer norm, LM head tied to the token embedding) trained under
 * the autocast policy.
 *
 * Numerics: the graph is PyTorch's GPT-2 (nanoGPT's non-flash attention) run under
 * torch.autocast with fp32 parameters, op by op:
 *   - embedding is not an autocast op: it runs in its weights' dtype (fp32 master weights,
 *     so fp32), and wte[x] + wpe[t] is an fp32 add. The residual stream therefore stays
 *     fp32: add(fp32, fp16) promotes to fp32. (resid_dt below; an override of "embedding" or
 *     "add" changes it. Without master weights the embedding reads the 16-bit weights'
 *     values but the stream is still held in fp32, where PyTorch's model.half() would hold
 *     it in 16 bits.)
 *   - layer norms (ln1, ln2, ln_f) run in fp32 on the stream; their output is cast to the
 *     linear's dtype (lin_dt, the low dtype);
 *   - every linear (attn.qkv, attn.proj, mlp.fc, mlp.proj, and the tied lm_head) is a GEMM
 *     on operands of lin_dt with fp32 accumulation; the bias is added in fp32 and the output
 *     rounded to lin_dt, so beyond 65504 it becomes inf in fp16;
 *   - attention: Q K^T and P V are "matmul" ops (mm_dt): S = rd(rd(Q K^T) * hd^-1/2) (the
 *     product is rounded before the scaling, as nanoGPT computes it); the softmax runs in
 *     sm_dt (fp32) over the causal positions only: masked positions get probability 0 and
 *     are never part of any arithmetic, so masking cannot make a NaN (an overflowed score
 *     still does, as on a GPU); P is cast to mm_dt for P V. With model.attention "flash" and
 *     a 16-bit mm_dt, FlashAttention-2's numerics instead (gpu_gpt_flash_fwd in gpu/gpt.h): S
 *     stays fp32, only P and dS are rounded to mm_dt, the row log-sum-exp is saved and P is
 *     recomputed in the backward;
 *   - GELU (tanh approximation) runs in its input's dtype: computed in fp32 and rounded;
 *   - cross-entropy runs in ce_dt (fp32) on the rounded logits.
 * Backward mirrors it: every gradient leaves its op rounded to the op's dtype, and each
 * cast's backward rounds the gradient to the dtype it cast from. Weight gradients of the
 * low-precision GEMMs are rounded to lin_dt before they land in the fp32 gradient block;
 * layer-norm gradients are fp32; the tied wte gets the head's (rounded) gradient plus the
 * embedding's fp32 gradient, summed in fp32. In an fp32 job every op is fp32.
 *
 * Weights: an op reads the working copy (the job's dtype) unless autocast runs it in fp32
 * and there is an fp32 master, which it then reads (gpu_mlp_weights' contract).
 *
 * Buffers: parameters (one block, named tensors in gpu_gpt.tensor), saved activations (one
 * byte block; 16-bit tensors where the op's dtype is) and the fp32 scratch are owned by the
 * caller; this file plans their layout and fills them. No allocation per step.
 * Threads: none of its own; the GEMMs use the BLAS library's threads.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gpu/diag.h"
#include "gpu/gpt.h"
#include "gpu/gpu_int.h"

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

#define LN_EPS 1e-5f
#define CHUNK 4096 /* floats per chunk of a fused elementwise pass (16 KiB, in L1) */
#define GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_K1 0.044715f

static size_t align64(size_t n)
{
    return (n + 63) & ~(size_t)63;
}

static size_t align16f(size_t n)
{
    return (n + 15) & ~(size_t)15;
}

/* Round n floats in place to dt (nothing to do for fp32). */
static void rnd(float *v, size_t n, gpu_dtype dt)
{
    if (dt != GPU_FP32)
        gpu_round_n(v, v, n, dt);
}

/* Round values of dtype `from` to dtype `to` in place: the cast between two ops, or the
 * backward of a cast from `to` (which rounds the gradient to the dtype cast from). */
static void cast(float *v, size_t n, gpu_dtype from, gpu_dtype to)
{
    if (to != GPU_FP32 && to != from)
        gpu_round_n(v, v, n, to);
}

/* PyTorch's promotion of two float dtypes (only fp32 and one low dtype occur). */
static gpu_dtype promote(gpu_dtype a, gpu_dtype b)
{
    return a == GPU_FP32 || b == GPU_FP32 ? GPU_FP32 : a;
}

/* ---- vectorisable math ------------------------------------------------------------------ */

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

HOT static void exp_kernel(float *restrict dst, const float *restrict x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = vexp(x[i]);
}

/* exp in fp32; see gpu/gpt.h. */
void gpu_gpt_exp(float *dst, const float *x, size_t n)
{
    exp_kernel(dst, x, n);
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

/* ---- elementwise kernels ---------------------------------------------------------------- */

HOT static void add_row(float *restrict v, const float *restrict b, int n)
{
    for (int j = 0; j < n; j++)
        v[j] += b[j];
}

HOT static void add_to(float *restrict dst, const float *restrict a, const float *restrict b,
                       size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = a[i] + b[i];
}

HOT static void scale_n(float *restrict v, float s, size_t n)
{
    for (size_t j = 0; j < n; j++)
        v[j] *= s;
}

HOT static void col_sum(float *restrict acc, const float *restrict row, int n)
{
    for (int j = 0; j < n; j++)
        acc[j] += row[j];
}

/* ---- embedding -------------------------------------------------------------------------- */

static const float *row_f32(const void *base, gpu_dtype dt, size_t row, int C, float *tmp)
{
    size_t off = row * (size_t)C;
    if (dt == GPU_FP32)
        return (const float *)base + off;
    gpu_cvt_to_f32(tmp, (const uint16_t *)base + off, dt, (size_t)C);
    return tmp;
}

/* See gpu/gpt.h. */
void gpu_gpt_embed_fwd(const int *x, int B, int T, int C, const void *wte, const void *wpe,
                       gpu_dtype wdt, gpu_dtype out_dt, float *out, float *tmp)
{
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            size_t r = (size_t)b * T + t;
            float *o = out + r * C;
            gpu_cvt_to_f32(o, row_f32(wte, wdt, (size_t)x[r], C, tmp), GPU_FP32, (size_t)C);
            add_row(o, row_f32(wpe, wdt, (size_t)t, C, tmp), C);
            rnd(o, (size_t)C, out_dt);
        }
}

/* See gpu/gpt.h. */
void gpu_gpt_embed_bwd(const int *x, int B, int T, int C, const float *dout, float *dwte,
                       float *dwpe)
{
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            size_t r = (size_t)b * T + t;
            const float *d = dout + r * C;
            add_row(dwte + (size_t)x[r] * C, d, C);
            add_row(dwpe + (size_t)t * C, d, C);
        }
}

/* ---- layer norm ------------------------------------------------------------------------- */

HOT static void ln_row_fwd(const float *restrict x, const float *restrict g,
                           const float *restrict b, int C, float *restrict y, float *mean_out,
                           float *rstd_out)
{
    float mean = sum16(x, C) / (float)C;
    for (int j = 0; j < C; j++)
        y[j] = (x[j] - mean) * (x[j] - mean);
    float var = sum16(y, C) / (float)C;
    float rstd = 1.0f / sqrtf(var + LN_EPS);
    for (int j = 0; j < C; j++)
        y[j] = (x[j] - mean) * rstd * g[j] + b[j];
    *mean_out = mean;
    *rstd_out = rstd;
}

/* See gpu/gpt.h. */
void gpu_gpt_layernorm_fwd(const float *x, const float *g, const float *b, int N, int C,
                           gpu_dtype dt, float *y, float *mean, float *rstd)
{
    for (int i = 0; i < N; i++) {
        float *yr = y + (size_t)i * C;
        ln_row_fwd(x + (size_t)i * C, g, b, C, yr, mean + i, rstd + i);
        rnd(yr, (size_t)C, dt);
    }
}

/* One row of the layer-norm backward: dx written, dg/db accumulated. The two row sums use
 * 16 partial sums, as sum16. */
HOT static void ln_row_bwd(const float *restrict dy, const float *restrict x, float mean,
                           float rstd, const float *restrict g, int C, float *restrict dx,
                           float *restrict dg, float *restrict db)
{
    float a1[16] = {0}, a2[16] = {0}, m1 = 0.0f, m2 = 0.0f;
    int j = 0;
    for (; j + 16 <= C; j += 16)
        for (int k = 0; k < 16; k++) {
            float xh = (x[j + k] - mean) * rstd, d = dy[j + k] * g[j + k];
            a1[k] += d;
            a2[k] += d * xh;
            dg[j + k] += dy[j + k] * xh;
            db[j + k] += dy[j + k];
        }
    for (; j < C; j++) {
        float xh = (x[j] - mean) * rstd, d = dy[j] * g[j];
        m1 += d;
        m2 += d * xh;
        dg[j] += dy[j] * xh;
        db[j] += dy[j];
    }
    for (int k = 0; k < 16; k++) {
        m1 += a1[k];
        m2 += a2[k];
    }
    m1 /= (float)C;
    m2 /= (float)C;
    for (j = 0; j < C; j++)
        dx[j] = rstd * (dy[j] * g[j] - m1 - (x[j] - mean) * rstd * m2);
}

/* See gpu/gpt.h. dx may not alias dy or x. */
void gpu_gpt_layernorm_bwd(const float *dy, const float *x, const float *mean, const float *rstd,
                           const float *g, int N, int C, gpu_dtype dt, float *dx, float *dg,
                           float *db)
{
    memset(dg, 0, sizeof(float) * (size_t)C);
    memset(db, 0, sizeof(float) * (size_t)C);
    for (int i = 0; i < N; i++) {
        float *dxr = dx + (size_t)i * C;
        ln_row_bwd(dy + (size_t)i * C, x + (size_t)i * C, mean[i], rstd[i], g, C, dxr, dg, db);
        rnd(dxr, (size_t)C, dt);
    }
    rnd(dg, (size_t)C, dt);
    rnd(db, (size_t)C, dt);
}

/* ---- GELU (tanh approximation) ---------------------------------------------------------- */

/* 0.5 x (1 + tanh z) = x sigmoid(2z) with z = sqrt(2/pi) (x + 0.044715 x^3): one exp, and
 * no cancellation in 1 + tanh z for x < -3, where PyTorch's fp32 kernel returns values a
 * few 1e-8 |x| off (or 0) and this one stays within a few ulp. */
HOT static void gelu_kernel(float *restrict dst, const float *restrict u, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float x = u[i];
        float z = GELU_K0 * (x + GELU_K1 * x * x * x);
        dst[i] = x / (1.0f + vexp(-2.0f * z));
    }
}

/* d *= gelu'(u) = s + 2 x s (1 - s) z'(x), s = sigmoid(2z). */
HOT static void gelu_grad_kernel(float *restrict d, const float *restrict u, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float x = u[i];
        float z = GELU_K0 * (x + GELU_K1 * x * x * x);
        float s = 1.0f / (1.0f + vexp(-2.0f * z));
        float dz = GELU_K0 * (1.0f + 3.0f * GELU_K1 * x * x);
        d[i] *= s + 2.0f * x * s * (1.0f - s) * dz;
    }
}

/* See gpu/gpt.h. */
void gpu_gpt_gelu_fwd(float *dst, const float *u, size_t n, gpu_dtype dt)
{
    if (dst == u) {
        /* in place: the kernel reads each element before writing it */
        for (size_t i = 0; i < n; i += 4096) {
            size_t k = n - i < 4096 ? n - i : 4096;
            float tmp[4096];
            gelu_kernel(tmp, u + i, k);
            memcpy(dst + i, tmp, k * sizeof(float));
        }
    } else {
        gelu_kernel(dst, u, n);
    }
    rnd(dst, n, dt);
}

/* See gpu/gpt.h. */
void gpu_gpt_gelu_bwd(float *d, const float *u, size_t n, gpu_dtype dt)
{
    gelu_grad_kernel(d, u, n);
    rnd(d, n, dt);
}

/* ---- causal multi-head attention -------------------------------------------------------- */

/* p[j] = exp(s[j] - mx) for j < n; returns their sum. */
HOT static float exp_shifted(float *restrict p, const float *restrict s, float mx, int n)
{
    for (int j = 0; j < n; j++)
        p[j] = vexp(s[j] - mx);
    return sum16(p, n);
}

HOT static void div_n(float *restrict p, float d, int n)
{
    for (int j = 0; j < n; j++)
        p[j] = p[j] / d;
}

/* P[0..n) = softmax(s[0..n)) in fp32 (division by the sum, as PyTorch's kernels); returns
 * the row's log-sum-exp, max + log(sum). A NaN or a +inf in s makes the row NaN, as it does
 * there. */
static float softmax_row(const float *s, int n, float *p)
{
    float mx = s[0];
    for (int j = 1; j < n; j++)
        mx = s[j] > mx || s[j] != s[j] ? s[j] : mx;
    float l = exp_shifted(p, s, mx, n);
    div_n(p, l, n);
    return mx + logf(l);
}

/* d[j] = p[j] (d[j] - sum_k p[k] d[k]) over the n causal positions, in place. */
HOT static void softmax_row_bwd(const float *restrict p, float *restrict d, int n)
{
    float acc[16] = {0}, dot = 0.0f;
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++)
            acc[k] += p[j + k] * d[j + k];
    for (; j < n; j++)
        dot += p[j] * d[j];
    for (int k = 0; k < 16; k++)
        dot += acc[k];
    for (j = 0; j < n; j++)
        d[j] = p[j] * (d[j] - dot);
}

/* See gpu/gpt.h. */
size_t gpu_gpt_attention_scratch_floats(int T)
{
    return 2 * align16f((size_t)T * (size_t)T);
}

static float attn_scale(int hd)
{
    return (float)(1.0 / sqrt((double)hd));
}

/* See gpu/gpt.h. */
int gpu_gpt_attention_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype mm_dt,
                          gpu_dtype sm_dt, float *probs, float *y, float *scratch, gpu_diag *diag,
                          int layer)
{
    int hd = C / H, ld = 3 * C;
    float scale = attn_scale(hd);
    size_t TT = (size_t)T * T;
    float *S = scratch, *Pm = scratch + align16f(TT);

    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd;
            const float *k = q + C, *v = q + 2 * C;
            float *P = probs + ((size_t)b * H + h) * TT;
            int rc =
                gpu_gemm(false, true, T, T, hd, q, GPU_FP32, ld, k, GPU_FP32, ld, 0.0f, S, T, NULL);
            if (rc)
                return rc;
            /* whole-matrix passes; the masked entries are computed but never read */
            if (diag)
                for (int i = 0; i < T; i++)
                    gpu_diag_forward(diag, layer, S + (size_t)i * T, (size_t)i + 1);
            rnd(S, TT, mm_dt);
            scale_n(S, scale, TT);
            rnd(S, TT, mm_dt);
            cast(S, TT, mm_dt, sm_dt);
            for (int i = 0; i < T; i++) {
                float *p = P + (size_t)i * T;
                softmax_row(S + (size_t)i * T, i + 1, p);
                memset(p + i + 1, 0, sizeof(float) * (size_t)(T - i - 1));
            }
            rnd(P, TT, sm_dt);
            const float *pm = P;
            if (mm_dt != GPU_FP32 && mm_dt != sm_dt) {
                gpu_round_n(Pm, P, TT, mm_dt);
                pm = Pm;
            }
            rc = gpu_gemm(false, false, T, hd, T, pm, GPU_FP32, T, v, GPU_FP32, ld, 0.0f,
                          y + (size_t)b * T * C + (size_t)h * hd, C, NULL);
            if (rc)
                return rc;
        }
    rnd(y, (size_t)B * T * C, mm_dt);
    return 0;
}

/* dQ and dK (the first 2C of each row of dqkv [rows x 3C]), the score matmul's input
 * gradients before rounding, accounted for layer. diag may be NULL. */
static void diag_dqk(gpu_diag *diag, int layer, const float *dqkv, size_t rows, int C)
{
    for (size_t r = 0; diag != NULL && r < rows; r++)
        gpu_diag_input_grad(diag, layer, dqkv + r * 3 * (size_t)C, 2 * (size_t)C);
}

/* See gpu/gpt.h. */
int gpu_gpt_attention_bwd(const float *dy, const float *qkv, const float *probs, int B, int T,
                          int C, int H, gpu_dtype mm_dt, gpu_dtype sm_dt, float *dqkv,
                          float *scratch, gpu_diag *diag, int layer)
{
    int hd = C / H, ld = 3 * C;
    float scale = attn_scale(hd);
    size_t TT = (size_t)T * T;
    float *dS = scratch, *Pm = scratch + align16f(TT);

    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            size_t off = (size_t)b * T * ld + (size_t)h * hd;
            const float *q = qkv + off, *k = q + C, *v = q + 2 * C;
            float *dq = dqkv + off, *dk = dq + C, *dv = dq + 2 * C;
            const float *dyh = dy + (size_t)b * T * C + (size_t)h * hd;
            const float *P = probs + ((size_t)b * H + h) * TT, *pm = P;
            if (mm_dt != GPU_FP32 && mm_dt != sm_dt) {
                gpu_round_n(Pm, P, TT, mm_dt);
                pm = Pm;
            }
            /* dV = Pm^T dY; dP = dY V^T (both matmul outputs, rounded to mm_dt) */
            int rc = gpu_gemm(true, false, T, hd, T, pm, GPU_FP32, T, dyh, GPU_FP32, C, 0.0f, dv,
                              ld, NULL);
            if (!rc)
                rc = gpu_gemm(false, true, T, T, hd, dyh, GPU_FP32, C, v, GPU_FP32, ld, 0.0f, dS, T,
                              NULL);
            if (rc)
                return rc;
            rnd(dS, TT, mm_dt);
            cast(dS, TT, mm_dt, sm_dt); /* P's cast to mm_dt, backward */
            for (int i = 0; i < T; i++) {
                /* the masked entries of dP (never read) become exact zeros of dS */
                float *d = dS + (size_t)i * T;
                softmax_row_bwd(P + (size_t)i * T, d, i + 1);
                memset(d + i + 1, 0, sizeof(float) * (size_t)(T - i - 1));
            }
            rnd(dS, TT, sm_dt);
            cast(dS, TT, sm_dt, mm_dt); /* S's cast to sm_dt, backward */
            scale_n(dS, scale, TT);     /* the scaling, in mm_dt */
            rnd(dS, TT, mm_dt);
            if (diag)
                gpu_diag_backward(diag, layer, dS, TT); /* arriving at Q K^T's output */
            /* dQ = dS K, dK = dS^T Q */
            rc = gpu_gemm(false, false, T, hd, T, dS, GPU_FP32, T, k, GPU_FP32, ld, 0.0f, dq, ld,
                          NULL);
            if (!rc)
                rc = gpu_gemm(true, false, T, hd, T, dS, GPU_FP32, T, q, GPU_FP32, ld, 0.0f, dk, ld,
                              NULL);
            if (rc)
                return rc;
        }
    diag_dqk(diag, layer, dqkv, (size_t)B * T, C);
    rnd(dqkv, (size_t)B * T * ld, mm_dt);
    return 0;
}

/* ---- flash attention ---------------------------------------------------------------------- */

/* S = rd(Q K^T * scale) for one sequence and head: the fp32 product, scaled in fp32 (never
 * rounded to mm_dt). Only the causal entries are read. */
static int flash_scores(const float *q, const float *k, int T, int hd, int ld, float *S)
{
    int rc = gpu_gemm(false, true, T, T, hd, q, GPU_FP32, ld, k, GPU_FP32, ld, 0.0f, S, T, NULL);
    if (rc == 0)
        scale_n(S, attn_scale(hd), (size_t)T * T);
    return rc;
}

/* p[j] = exp(p[j] - c) for j < n, in place. */
HOT static void exp_minus(float *restrict p, float c, int n)
{
    for (int j = 0; j < n; j++)
        p[j] = vexp(p[j] - c);
}

/* d[j] = (p[j] (d[j] - D)) scale for j < n, in place: dS from dP, fp32, in that order. */
HOT static void flash_ds_row(const float *restrict p, float *restrict d, float D, float scale,
                             int n)
{
    for (int j = 0; j < n; j++)
        d[j] = (p[j] * (d[j] - D)) * scale;
}

/* See gpu/gpt.h. */
int gpu_gpt_flash_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype mm_dt, float *lse,
                      float *y, float *scratch)
{
    int hd = C / H, ld = 3 * C;
    size_t TT = (size_t)T * T;
    float *S = scratch, *P = scratch + align16f(TT);

    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const float *q = qkv + (size_t)b * T * ld + (size_t)h * hd;
            float *L = lse + ((size_t)b * H + h) * T;
            int rc = flash_scores(q, q + C, T, hd, ld, S);
            if (rc)
                return rc;
            for (int i = 0; i < T; i++) {
                float *p = P + (size_t)i * T;
                L[i] = softmax_row(S + (size_t)i * T, i + 1, p);
                memset(p + i + 1, 0, sizeof(float) * (size_t)(T - i - 1));
            }
            rnd(P, TT, mm_dt);
            rc = gpu_gemm(false, false, T, hd, T, P, GPU_FP32, T, q + 2 * C, GPU_FP32, ld, 0.0f,
                          y + (size_t)b * T * C + (size_t)h * hd, C, NULL);
            if (rc)
                return rc;
        }
    rnd(y, (size_t)B * T * C, mm_dt);
    return 0;
}

/* One sequence and head of gpu_gpt_flash_bwd: P recomputed from the saved log-sum-exp. */
static int flash_bwd_head(const float *dyh, const float *q, const float *oh, const float *L,
                          int T, int C, int hd, gpu_dtype mm_dt, float *dq, float *scratch)
{
    int ld = 3 * C;
    size_t TT = (size_t)T * T;
    float *P = scratch, *W = scratch + align16f(TT);
    int rc = flash_scores(q, q + C, T, hd, ld, P);
    if (rc)
        return rc;
    for (int i = 0; i < T; i++) {
        exp_minus(P + (size_t)i * T, L[i], i + 1);
        memset(P + (size_t)i * T + i + 1, 0, sizeof(float) * (size_t)(T - i - 1));
    }
    gpu_round_n(W, P, TT, mm_dt); /* dV = rd(P) ^T dY */
    rc = gpu_gemm(true, false, T, hd, T, W, GPU_FP32, T, dyh, GPU_FP32, C, 0.0f, dq + 2 * C, ld,
                  NULL);
    if (!rc) /* dP = dY V^T, kept in fp32 */
        rc = gpu_gemm(false, true, T, T, hd, dyh, GPU_FP32, C, q + 2 * C, GPU_FP32, ld, 0.0f, W,
                      T, NULL);
    if (rc)
        return rc;
    float scale = attn_scale(hd);
    for (int i = 0; i < T; i++) {
        float D = 0.0f; /* D_i = dY_i . O_i, fp32 */
        for (int c = 0; c < hd; c++)
            D = fmaf(dyh[(size_t)i * C + c], oh[(size_t)i * C + c], D);
        flash_ds_row(P + (size_t)i * T, W + (size_t)i * T, D, scale, i + 1);
        memset(W + (size_t)i * T + i + 1, 0, sizeof(float) * (size_t)(T - i - 1));
    }
    rnd(W, TT, mm_dt); /* dQ = rd(dS) K, dK = rd(dS)^T Q */
    rc = gpu_gemm(false, false, T, hd, T, W, GPU_FP32, T, q + C, GPU_FP32, ld, 0.0f, dq, ld, NULL);
    if (!rc)
        rc = gpu_gemm(true, false, T, hd, T, W, GPU_FP32, T, q, GPU_FP32, ld, 0.0f, dq + C, ld,
                      NULL);
    return rc;
}

/* See gpu/gpt.h. */
int gpu_gpt_flash_bwd(const float *dy, const float *qkv, const float *o, const float *lse, int B,
                      int T, int C, int H, gpu_dtype mm_dt, float *dqkv, float *scratch,
                      gpu_diag *diag, int layer)
{
    int hd = C / H, ld = 3 * C;
    if (diag) /* the gradient arriving at the attention: inf/NaN */
        gpu_diag_backward(diag, layer, dy, (size_t)B * T * C);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            size_t off = (size_t)b * T * ld + (size_t)h * hd;
            size_t yoff = (size_t)b * T * C + (size_t)h * hd;
            int rc = flash_bwd_head(dy + yoff, qkv + off, o + yoff, lse + ((size_t)b * H + h) * T,
                                    T, C, hd, mm_dt, dqkv + off, scratch);
            if (rc)
                return rc;
        }
    diag_dqk(diag, layer, dqkv, (size_t)B * T, C);
    rnd(dqkv, (size_t)B * T * ld, mm_dt);
    return 0;
}

/* ---- tied head and cross-entropy -------------------------------------------------------- */

/* Cross-entropy of one row of logits z: p = softmax(z) written (fp32), the row's loss
 * returned, *arg the argmax (a NaN wins, as in the MLP). */
static double ce_row(const float *z, int V, int target, float *p, int *arg)
{
    float mx = z[0];
    int a = 0;
    for (int j = 1; j < V; j++)
        if (z[j] > mx || z[j] != z[j]) {
            mx = z[j];
            a = j;
        }
    float sum = exp_shifted(p, z, mx, V);
    div_n(p, sum, V);
    *arg = a;
    return -((double)z[target] - (double)mx - log((double)sum));
}

/* See gpu/gpt.h. */
int gpu_gpt_head_fwd(const float *x, const void *wte, gpu_dtype wdt, const int *y, int N, int C,
                     int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float *logits, float *probs,
                     float *gscratch, gpu_diag *diag, int layer, double *loss_sum, int *correct)
{
    double total = 0.0;
    int hits = 0;
    int rc = gpu_gemm(false, true, N, V, C, x, GPU_FP32, C, wte, wdt, C, 0.0f, logits, V, gscratch);
    if (rc)
        return rc;
    for (int i = 0; i < N; i++) {
        float *z = logits + (size_t)i * V, *p = probs + (size_t)i * V;
        int arg;
        if (diag)
            gpu_diag_forward(diag, layer, z, (size_t)V);
        rnd(z, (size_t)V, lin_dt);
        cast(z, (size_t)V, lin_dt, ce_dt);
        total += ce_row(z, V, y[i], p, &arg);
        hits += arg == y[i];
        rnd(p, (size_t)V, ce_dt);
    }
    *loss_sum = total;
    *correct = hits;
    return 0;
}

/* See gpu/gpt.h. */
int gpu_gpt_head_bwd(const float *probs, const int *y, const void *xs, const void *wte,
                     gpu_dtype wdt, int N, int C, int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float g,
                     float *dlogits, float *dx, float *dwte, float *gscratch, gpu_diag *diag,
                     int layer)
{
    for (int i = 0; i < N; i++) {
        float *d = dlogits + (size_t)i * V;
        const float *p = probs + (size_t)i * V;
        for (int j = 0; j < V; j++)
            d[j] = p[j] * g;
        d[y[i]] -= g;
        rnd(d, (size_t)V, ce_dt);
        cast(d, (size_t)V, ce_dt, lin_dt); /* the logits' cast to ce_dt, backward */
    }
    if (diag)
        gpu_diag_backward(diag, layer, dlogits, (size_t)N * V);
    int rc = gpu_gemm(true, false, V, C, N, dlogits, GPU_FP32, V, xs, lin_dt, C, 0.0f, dwte, C,
                      gscratch);
    if (rc)
        return rc;
    gpu_diag_round_grad(diag, layer, true, dwte, (size_t)V * C, lin_dt);
    rc = gpu_gemm(false, false, N, C, V, dlogits, GPU_FP32, V, wte, wdt, C, 0.0f, dx, C, gscratch);
    if (rc)
        return rc;
    gpu_diag_round_grad(diag, layer, false, dx, (size_t)N * C, lin_dt);
    return 0;
}

/* ---- the model: layout ------------------------------------------------------------------ */

/* The fp32 scratch regions (floats, for max_batch sequences). */
typedef struct {
    float *big;         /* N x max(4C, V): GEMM outputs, logits, dlogits, GELU input */
    float *in32;        /* N x 4C: GEMM inputs (fp32 values of lin_dt); 4C-wide gradients */
    float *qkvm;        /* N x 3C: qkv in mm_dt when it differs; layer-norm input temporaries */
    float *aty;         /* N x C: attention output / its gradient; layer-norm dx */
    float *dqkv;        /* N x 3C */
    float *dres;        /* N x C: the residual stream's gradient */
    float *att;         /* attention temporaries */
    float *row0, *row1; /* 4C each: bias and layer-norm weights in fp32 */
    float *chunk;       /* CHUNK floats: elementwise passes done chunk by chunk in cache */
    float *g;           /* GEMM widening scratch (the rest) */
} gpt_scratch;

/* Carve the scratch regions from base (NULL: only count); returns the floats before the
 * GEMM scratch. */
static size_t carve(const gpu_gpt *m, float *base, gpt_scratch *sc)
{
    size_t N = (size_t)m->max_batch * m->seq_len, C = (size_t)m->d_model;
    size_t wide = 4 * C > (size_t)m->vocab ? 4 * C : (size_t)m->vocab;
    size_t sizes[10] = {N * wide,
                        N * 4 * C,
                        N * 3 * C,
                        N * C,
                        N * 3 * C,
                        N * C,
                        gpu_gpt_attention_scratch_floats(m->seq_len),
                        4 * C,
                        4 * C,
                        CHUNK};
    float **slot[11] = {&sc->big, &sc->in32, &sc->qkvm, &sc->aty,   &sc->dqkv, &sc->dres,
                        &sc->att, &sc->row0, &sc->row1, &sc->chunk, &sc->g};
    size_t off = 0;
    for (int i = 0; i < 11; i++) {
        if (base)
            *slot[i] = base + off;
        if (i < 10)
            off += align16f(sizes[i]);
    }
    return off;
}

/* Floats of GEMM widening scratch: the largest any GEMM of the passes needs, with 16-bit
 * weights unless everything is fp32 (the working copy is in the job's dtype). */
static size_t plan_gemm_scratch(const gpu_gpt *m, gpu_dtype dt)
{
    int N = m->max_batch * m->seq_len, C = m->d_model, V = m->vocab;
    int dims[5][2] = {{3 * C, C}, {C, C}, {4 * C, C}, {C, 4 * C}, {V, C}}; /* out, in */
    gpu_dtype ld = m->lin_dt, wd = dt;
    size_t most = 0;
    for (int i = 0; i < 5; i++) {
        int O = dims[i][0], K = dims[i][1];
        size_t s[3] = {
            gpu_gemm_scratch_floats(false, true, N, O, K, GPU_FP32, K, wd, K),
            gpu_gemm_scratch_floats(true, false, O, K, N, GPU_FP32, O, ld, K),
            gpu_gemm_scratch_floats(false, false, N, K, O, GPU_FP32, O, wd, K),
        };
        for (int j = 0; j < 3; j++)
            most = s[j] > most ? s[j] : most;
    }
    return most;
}

static void add_tensor(gpu_gpt *m, size_t *off, size_t *field, const char *name, int64_t r,
                       int64_t c)
{
    gpu_gpt_tensor *t = &m->tensor[m->ntensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->off = *off;
    t->ndim = c > 0 ? 2 : 1;
    t->shape[0] = r;
    t->shape[1] = c > 0 ? c : 0;
    t->count = (size_t)r * (size_t)(c > 0 ? c : 1);
    *field = *off;
    *off += t->count;
}

static void layout_params(gpu_gpt *m)
{
    int64_t C = m->d_model;
    size_t off = 0;
    char name[40];
    add_tensor(m, &off, &m->wte, "wte", m->vocab, C);
    add_tensor(m, &off, &m->wpe, "wpe", m->seq_len, C);
    for (int l = 0; l < m->n_layer; l++) {
        gpu_gpt_block *b = &m->blk[l];
        struct {
            const char *suffix;
            size_t *field;
            int64_t r, c;
        } t[12] = {
            {"ln1.weight", &b->ln1_w, C, 0},
            {"ln1.bias", &b->ln1_b, C, 0},
            {"attn.qkv.weight", &b->qkv_w, 3 * C, C},
            {"attn.qkv.bias", &b->qkv_b, 3 * C, 0},
            {"attn.proj.weight", &b->proj_w, C, C},
            {"attn.proj.bias", &b->proj_b, C, 0},
            {"ln2.weight", &b->ln2_w, C, 0},
            {"ln2.bias", &b->ln2_b, C, 0},
            {"mlp.fc.weight", &b->fc_w, 4 * C, C},
            {"mlp.fc.bias", &b->fc_b, 4 * C, 0},
            {"mlp.proj.weight", &b->mproj_w, C, 4 * C},
            {"mlp.proj.bias", &b->mproj_b, C, 0},
        };
        for (int i = 0; i < 12; i++) {
            snprintf(name, sizeof name, "blocks.%d.%s", l, t[i].suffix);
            add_tensor(m, &off, t[i].field, name, t[i].r, t[i].c);
        }
    }
    add_tensor(m, &off, &m->lnf_w, "ln_f.weight", C, 0);
    add_tensor(m, &off, &m->lnf_b, "ln_f.bias", C, 0);
    m->nparams = off;
}

static size_t take(size_t *bytes, size_t n)
{
    size_t at = *bytes;
    *bytes = align64(*bytes + n);
    return at;
}

static void layout_acts(gpu_gpt *m)
{
    size_t N = (size_t)m->max_batch * m->seq_len, C = (size_t)m->d_model;
    size_t es = gpu_dtype_size(m->lin_dt), f = sizeof(float), bytes = 0;
    size_t T = (size_t)m->seq_len, TT = T * T;
    for (int l = 0; l < m->n_layer; l++) {
        gpu_gpt_block_acts *a = &m->act[l];
        a->resid = take(&bytes, N * C * f);
        a->ln1 = take(&bytes, N * C * es);
        a->ln1_mean = take(&bytes, N * f);
        a->ln1_rstd = take(&bytes, N * f);
        a->qkv = take(&bytes, N * 3 * C * es);
        a->probs = take(&bytes, (size_t)m->max_batch * m->n_head * (m->flash ? T : TT) * f);
        a->atty = take(&bytes, N * C * es);
        a->resid_mid = take(&bytes, N * C * f);
        a->ln2 = take(&bytes, N * C * es);
        a->ln2_mean = take(&bytes, N * f);
        a->ln2_rstd = take(&bytes, N * f);
        a->fc = take(&bytes, N * 4 * C * es);
        a->gelu = take(&bytes, N * 4 * C * es);
    }
    m->resid_final = take(&bytes, N * C * f);
    m->lnf = take(&bytes, N * C * es);
    m->lnf_mean = take(&bytes, N * f);
    m->lnf_rstd = take(&bytes, N * f);
    m->probs = take(&bytes, N * (size_t)m->vocab * f);
    m->act_bytes = bytes;
}

/* Bytes the activations and scratch will need, in double (to refuse absurd sizes before
 * any size_t arithmetic can wrap). */
static double estimate_bytes(const gpu_model_config *mc, int max_batch)
{
    double N = (double)max_batch * mc->seq_len, C = mc->d_model, V = mc->vocab;
    double per_layer =
        N * C * 4 * 18 + (double)max_batch * mc->n_head * mc->seq_len * (double)mc->seq_len * 4;
    double wide = 4 * C > V ? 4 * C : V;
    return mc->n_layer * per_layer + N * (V + wide) * 4 + N * C * 64 + V * C * 4 * 4;
}

/* Plan the GPT's layout; see gpu/gpt.h. */
int gpu_gpt_plan(gpu_gpt *m, const gpu_model_config *mc, const gpu_autocast *a, gpu_dtype dt,
                 int max_batch, char *err, size_t errlen)
{
    memset(m, 0, sizeof(*m));
    if (mc->n_layer < 1 || mc->n_layer > GPU_GPT_MAX_LAYERS) {
        snprintf(err, errlen, "model.n_layer: must be in 1..%d", GPU_GPT_MAX_LAYERS);
        return GPU_EINVAL;
    }
    if (mc->d_model < 1 || mc->d_model > 16384) {
        snprintf(err, errlen, "model.d_model: must be in 1..16384");
        return GPU_EINVAL;
    }
    if (mc->n_head < 1 || mc->n_head > mc->d_model || mc->d_model % mc->n_head != 0) {
        snprintf(err, errlen, "model.n_head: must divide d_model (%d)", mc->d_model);
        return GPU_EINVAL;
    }
    if (mc->seq_len < 1 || mc->seq_len > 16384) {
        snprintf(err, errlen, "model.seq_len: must be in 1..16384");
        return GPU_EINVAL;
    }
    if (mc->vocab < 1 || mc->vocab > (1 << 24)) {
        snprintf(err, errlen, "model.vocab: must be in 1..%d", 1 << 24);
        return GPU_EINVAL;
    }
    if (max_batch < 1 || (double)max_batch * mc->seq_len * 4 * mc->d_model > 2147483647.0) {
        snprintf(err, errlen,
                 "batch_size: must be >= 1 with batch_size x seq_len x 4 d_model "
                 "below 2^31");
        return GPU_EINVAL;
    }
    int hd = mc->d_model / mc->n_head;
    if (mc->attention == GPU_ATTN_FLASH && !gpu_flash_head_dim_ok(hd)) {
        snprintf(err, errlen,
                 "model.attention: \"flash\" needs a head_dim (d_model / n_head) of 16, 32, "
                 "48 or 64, not %d",
                 hd);
        return GPU_EINVAL;
    }
    if (estimate_bytes(mc, max_batch) > 0x1p48) {
        snprintf(err, errlen, "model: the activations would take more than 256 TiB");
        return GPU_EINVAL;
    }
    m->n_layer = mc->n_layer;
    m->n_head = mc->n_head;
    m->d_model = mc->d_model;
    m->seq_len = mc->seq_len;
    m->vocab = mc->vocab;
    m->head_dim = mc->d_model / mc->n_head;
    m->max_batch = max_batch;
    /* PyTorch autocast with fp32 parameters: see the top of this file */
    m->lin_dt = gpu_autocast_dtype(a, GPU_OP_LINEAR, dt, GPU_FP32);
    m->mm_dt = gpu_autocast_dtype(a, GPU_OP_MATMUL, dt, m->lin_dt);
    m->sm_dt = gpu_autocast_dtype(a, GPU_OP_SOFTMAX, dt, m->mm_dt);
    m->emb_dt = gpu_autocast_dtype(a, GPU_OP_EMBEDDING, dt, GPU_FP32);
    m->resid_dt = gpu_autocast_dtype(a, GPU_OP_ADD, dt, promote(m->emb_dt, m->lin_dt));
    m->ln_dt = gpu_autocast_dtype(a, GPU_OP_LAYER_NORM, dt, m->resid_dt);
    m->gelu_dt = gpu_autocast_dtype(a, GPU_OP_GELU, dt, m->lin_dt);
    m->ce_dt = gpu_autocast_dtype(a, GPU_OP_CROSS_ENTROPY, dt, m->lin_dt);
    m->flash = mc->attention == GPU_ATTN_FLASH && m->mm_dt != GPU_FP32;
    layout_params(m);
    layout_acts(m);
    m->scratch_floats = carve(m, NULL, &(gpt_scratch){0}) + plan_gemm_scratch(m, dt) + 16;
    return 0;
}

/* GPT-2's init; see gpu/gpt.h. */
void gpu_gpt_init_params(const gpu_gpt *m, float *params, float init_scale, gpu_rng *rng)
{
    float std = 0.02f * init_scale;
    float std_res = (float)(0.02 / sqrt(2.0 * m->n_layer)) * init_scale;
    for (int i = 0; i < m->ntensors; i++) {
        const gpu_gpt_tensor *t = &m->tensor[i];
        float *p = params + t->off;
        size_t len = strlen(t->name);
        bool bias = len > 5 && strcmp(t->name + len - 5, ".bias") == 0;
        bool ln = strstr(t->name, "ln1.") || strstr(t->name, "ln2.") || strstr(t->name, "ln_f.");
        bool res = strstr(t->name, "attn.proj.weight") || strstr(t->name, "mlp.proj.weight");
        if (bias || ln) {
            float v = bias ? 0.0f : 1.0f;
            for (size_t j = 0; j < t->count; j++)
                p[j] = v;
            continue;
        }
        float s = res ? std_res : std;
        for (size_t j = 0; j < t->count; j++)
            p[j] = gpu_rng_normal(rng) * s;
    }
}

/* ---- the model: passes ------------------------------------------------------------------ */

/* The operand an op in dtype dt reads at param offset off: the fp32 master when the op runs
 * in fp32 and there is one, else the working copy (in pdt, the job's dtype). */
static const void *wsrc(const gpu_gpt_weights *w, size_t off, gpu_dtype dt, gpu_dtype *sdt)
{
    if (dt == GPU_FP32 && w->master) {
        *sdt = GPU_FP32;
        return w->master + off;
    }
    *sdt = w->pdt;
    return (const uint8_t *)w->p + off * gpu_dtype_size(w->pdt);
}

/* The same as fp32 values (widened into buf, n floats, when the source is 16-bit). */
static const float *wf32(const gpu_gpt_weights *w, size_t off, size_t n, gpu_dtype dt, float *buf)
{
    gpu_dtype sdt;
    const void *src = wsrc(w, off, dt, &sdt);
    if (sdt == GPU_FP32)
        return src;
    gpu_cvt_to_f32(buf, src, sdt, n);
    return buf;
}

/* The diagnostics slot of "blocks.<blk>.<what>" (or "<what>" for blk < 0); -1 when off. */
static int dlayer(gpu_diag *diag, int blk, const char *what, gpu_dtype dt)
{
    char name[48];
    if (!diag)
        return -1;
    if (blk < 0)
        snprintf(name, sizeof name, "%s", what);
    else
        snprintf(name, sizeof name, "blocks.%d.%s", blk, what);
    return gpu_diag_layer(diag, name, dt);
}

/* out[N x O] = rd(in W^T + b, lin_dt), row by row: bias in fp32, diagnostics on the fp32
 * value, rounding, and the copy into store (lin_dt) when store is not NULL. in holds fp32
 * values of lin_dt. */
static int linear_fwd(const gpu_gpt *m, const gpu_gpt_weights *w, const float *in, int N, int K,
                      int O, size_t w_off, size_t b_off, float *out, uint8_t *store,
                      const gpt_scratch *sc, gpu_diag *diag, int layer)
{
    gpu_dtype dt = m->lin_dt, wdt;
    const void *W = wsrc(w, w_off, dt, &wdt);
    int rc = gpu_gemm(false, true, N, O, K, in, GPU_FP32, K, W, wdt, K, 0.0f, out, O, sc->g);
    if (rc)
        return rc;
    const float *bias = wf32(w, b_off, (size_t)O, dt, sc->row0);
    size_t es = gpu_dtype_size(dt);
    for (int i = 0; i < N; i++) {
        float *o = out + (size_t)i * O;
        add_row(o, bias, O);
        if (diag)
            gpu_diag_forward(diag, layer, o, (size_t)O);
        rnd(o, (size_t)O, dt);
        if (store)
            gpu_cvt_from_f32(store + (size_t)i * O * es, dt, o, (size_t)O);
    }
    return 0;
}

/* Backward of a linear in lin_dt from dY [N x O] (values of lin_dt) and its saved input X
 * (lin_dt, N x K): weight and bias gradients rounded to lin_dt into grads, dX [N x K]
 * written rounded to lin_dt. With diag: the arriving dY, then each gradient before it is
 * rounded (gpu_diag_round_grad rounds without diag). */
static int linear_bwd(const gpu_gpt *m, const gpu_gpt_weights *w, const float *dY, const uint8_t *X,
                      int N, int K, int O, size_t w_off, size_t b_off, float *grads, float *dX,
                      const gpt_scratch *sc, gpu_diag *diag, int layer)
{
    gpu_dtype dt = m->lin_dt, wdt;
    float *gw = grads + w_off, *gb = grads + b_off;
    if (diag)
        gpu_diag_backward(diag, layer, dY, (size_t)N * O);
    int rc = gpu_gemm(true, false, O, K, N, dY, GPU_FP32, O, X, dt, K, 0.0f, gw, K, sc->g);
    if (rc)
        return rc;
    gpu_diag_round_grad(diag, layer, true, gw, (size_t)O * K, dt);
    memset(gb, 0, sizeof(float) * (size_t)O);
    for (int i = 0; i < N; i++)
        col_sum(gb, dY + (size_t)i * O, O);
    gpu_diag_round_grad(diag, layer, true, gb, (size_t)O, dt);
    const void *W = wsrc(w, w_off, dt, &wdt);
    rc = gpu_gemm(false, false, N, K, O, dY, GPU_FP32, O, W, wdt, K, 0.0f, dX, K, sc->g);
    if (rc)
        return rc;
    gpu_diag_round_grad(diag, layer, false, dX, (size_t)N * K, dt);
    return 0;
}

/* The layer norm's input: the stream x itself, or its values rounded to ln_dt in tmp. */
static const float *ln_input(const gpu_gpt *m, const float *x, size_t n, float *tmp)
{
    if (m->ln_dt == GPU_FP32 || m->ln_dt == m->resid_dt)
        return x;
    gpu_round_n(tmp, x, n, m->ln_dt);
    return tmp;
}

/* Where an op writes the fp32 values of a tensor saved in lin_dt at acts + off: the saved
 * tensor itself when lin_dt is fp32 (nothing to copy), else the scratch buffer tmp. */
static float *out_for(const gpu_gpt *m, uint8_t *acts, size_t off, float *tmp)
{
    return m->lin_dt == GPU_FP32 ? (float *)(acts + off) : tmp;
}

/* fp32 values of a tensor saved in lin_dt, rounded to dt: the saved floats themselves when
 * that takes no work, else a converted copy in buf. */
static const float *saved_as(const gpu_gpt *m, const uint8_t *src, size_t n, gpu_dtype dt,
                             float *buf)
{
    if (m->lin_dt == GPU_FP32 && dt == GPU_FP32)
        return (const float *)src;
    gpu_cvt_to_f32(buf, src, m->lin_dt, n);
    cast(buf, n, m->lin_dt, dt);
    return buf;
}

/* A layer norm on the stream x: its output cast to lin_dt and saved at store; mean and rstd
 * saved. Returns the output's fp32 values (in sc->in32, or the saved tensor itself). */
static const float *ln_fwd(const gpu_gpt *m, const gpu_gpt_weights *w, const float *x, size_t g_off,
                           size_t b_off, int N, uint8_t *acts, size_t store, size_t mean,
                           size_t rstd, const gpt_scratch *sc)
{
    size_t C = (size_t)m->d_model, n = (size_t)N * C;
    const float *g = wf32(w, g_off, C, m->ln_dt, sc->row0);
    const float *b = wf32(w, b_off, C, m->ln_dt, sc->row1);
    float *y = out_for(m, acts, store, sc->in32);
    const float *xin = ln_input(m, x, n, sc->qkvm);
    size_t es = gpu_dtype_size(m->lin_dt), rows = CHUNK / C > 0 ? CHUNK / C : 1;
    for (size_t r = 0; r < (size_t)N; r += rows) { /* a block of rows at a time, in cache */
        size_t k = (size_t)N - r < rows ? (size_t)N - r : rows, at = r * C;
        gpu_gpt_layernorm_fwd(xin + at, g, b, (int)k, (int)C, m->ln_dt, y + at,
                              (float *)(acts + mean) + r, (float *)(acts + rstd) + r);
        cast(y + at, k * C, m->ln_dt, m->lin_dt);
        gpu_cvt_from_f32(acts + store + at * es, m->lin_dt, y + at, k * C); /* no-op if saved */
    }
    return y;
}

/* Layer-norm backward from dy (values of lin_dt, modified): dx written into dx (values of
 * resid_dt, cast back from ln_dt), weight gradients into grads. */
static void ln_bwd(const gpu_gpt *m, const gpu_gpt_weights *w, float *dy, const float *x,
                   const uint8_t *acts, size_t mean, size_t rstd, size_t g_off, size_t b_off, int N,
                   float *grads, float *dx, const gpt_scratch *sc)
{
    size_t C = (size_t)m->d_model, n = (size_t)N * C;
    cast(dy, n, m->lin_dt, m->ln_dt);
    const float *g = wf32(w, g_off, C, m->ln_dt, sc->row0);
    gpu_gpt_layernorm_bwd(dy, ln_input(m, x, n, sc->qkvm), (const float *)(acts + mean),
                          (const float *)(acts + rstd), g, N, (int)C, m->ln_dt, dx, grads + g_off,
                          grads + b_off);
    cast(dx, n, m->ln_dt, m->resid_dt);
}

/* dst = rd(a + b, resid_dt): a residual add (b is a linear's output in lin_dt). */
static void resid_add(const gpu_gpt *m, float *dst, const float *a, const float *b, size_t n)
{
    add_to(dst, a, b, n);
    rnd(dst, n, m->resid_dt);
}

/* dres += dx in resid_dt: the stream's two gradient contributions summed. */
static void resid_acc(const gpu_gpt *m, float *dres, const float *dx, size_t n)
{
    for (size_t i = 0; i < n; i += 1 << 20) {
        size_t k = n - i < (1 << 20) ? n - i : (1 << 20);
        add_row(dres + i, dx + i, (int)k);
    }
    rnd(dres, n, m->resid_dt);
}

/* dres rounded to lin_dt: the add's gradient handed to its lin_dt input (dres itself, or a
 * rounded copy in dst). */
static const float *to_lin(const gpu_gpt *m, float *dst, const float *dres, size_t n)
{
    if (m->lin_dt == GPU_FP32 || m->lin_dt == m->resid_dt)
        return dres;
    gpu_round_n(dst, dres, n, m->lin_dt);
    return dst;
}

static float *actf(uint8_t *acts, size_t off)
{
    return (float *)(acts + off);
}

static const float *cactf(const uint8_t *acts, size_t off)
{
    return (const float *)(acts + off);
}

static size_t block_out(const gpu_gpt *m, int l)
{
    return l + 1 < m->n_layer ? m->act[l + 1].resid : m->resid_final;
}

static int check_tokens(const gpu_gpt *m, const int *x, const int *y, int B)
{
    size_t N = (size_t)B * m->seq_len;
    if (B < 1 || B > m->max_batch || !x || !y)
        return GPU_EINVAL;
    for (size_t i = 0; i < N; i++)
        if (x[i] < 0 || x[i] >= m->vocab || y[i] < 0 || y[i] >= m->vocab)
            return GPU_EINVAL;
    return 0;
}

/* g = the GELU of the fc output u (values of lin_dt), cast back to lin_dt and saved at
 * store, chunk by chunk so that each chunk is read from memory once. */
static void gelu_fwd_chunked(const gpu_gpt *m, const float *u, float *g, uint8_t *store, size_t n,
                             float *tmp)
{
    gpu_dtype lin = m->lin_dt, dt = m->gelu_dt;
    size_t es = gpu_dtype_size(lin);
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        const float *in = u + i;
        if (dt != GPU_FP32 && dt != lin) { /* the cast into GELU's dtype */
            gpu_round_n(tmp, in, k, dt);
            in = tmp;
        }
        gpu_gpt_gelu_fwd(g + i, in, k, dt);
        cast(g + i, k, dt, lin);
        gpu_cvt_from_f32(store + i * es, lin, g + i, k); /* no-op when g is the saved tensor */
    }
}

/* d (values of lin_dt, the gradient at GELU's output cast to lin_dt) becomes the gradient
 * at mlp.fc's output, chunk by chunk: through the cast, GELU's backward in gelu_dt from the
 * saved input, and the cast back. */
static void gelu_bwd_chunked(const gpu_gpt *m, float *d, const uint8_t *saved_u, size_t n,
                             float *tmp)
{
    gpu_dtype lin = m->lin_dt, dt = m->gelu_dt;
    size_t es = gpu_dtype_size(lin);
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        cast(d + i, k, lin, dt);
        gpu_gpt_gelu_bwd(d + i, saved_as(m, saved_u + i * es, k, dt, tmp), k, dt);
        cast(d + i, k, dt, lin);
    }
}

/* One block's forward from its input (saved at act[l].resid) to the next block's input. */
static int block_fwd(const gpu_gpt *m, const gpu_gpt_weights *w, int l, int B, uint8_t *acts,
                     const gpt_scratch *sc, gpu_diag *diag)
{
    const gpu_gpt_block *P = &m->blk[l];
    const gpu_gpt_block_acts *A = &m->act[l];
    int T = m->seq_len, C = m->d_model, N = B * T, rc;
    size_t nC = (size_t)N * C, n4 = 4 * nC;
    gpu_dtype lin = m->lin_dt;
    const float *hin = actf(acts, A->resid);
    float *hmid = actf(acts, A->resid_mid);

    /* attention */
    const float *a =
        ln_fwd(m, w, hin, P->ln1_w, P->ln1_b, N, acts, A->ln1, A->ln1_mean, A->ln1_rstd, sc);
    float *qkv = out_for(m, acts, A->qkv, sc->big);
    rc = linear_fwd(m, w, a, N, C, 3 * C, P->qkv_w, P->qkv_b, qkv, acts + A->qkv, sc, diag,
                    dlayer(diag, l, "attn.qkv", lin));
    if (rc)
        return rc;
    const float *q = qkv;
    if (m->mm_dt != GPU_FP32 && m->mm_dt != lin) {
        gpu_round_n(sc->qkvm, qkv, 3 * nC, m->mm_dt);
        q = sc->qkvm;
    }
    float *y = out_for(m, acts, A->atty, sc->aty);
    int dsc = dlayer(diag, l, "attn.scores", m->mm_dt); /* flash: its slot, no counts */
    if (m->flash)
        rc = gpu_gpt_flash_fwd(q, B, T, C, m->n_head, m->mm_dt, actf(acts, A->probs), y, sc->att);
    else
        rc = gpu_gpt_attention_fwd(q, B, T, C, m->n_head, m->mm_dt, m->sm_dt,
                                   actf(acts, A->probs), y, sc->att, diag, dsc);
    if (rc)
        return rc;
    cast(y, nC, m->mm_dt, lin);
    gpu_cvt_from_f32(acts + A->atty, lin, y, nC);
    rc = linear_fwd(m, w, y, N, C, C, P->proj_w, P->proj_b, sc->big, NULL, sc, diag,
                    dlayer(diag, l, "attn.proj", lin));
    if (rc)
        return rc;
    resid_add(m, hmid, hin, sc->big, nC);

    /* MLP */
    a = ln_fwd(m, w, hmid, P->ln2_w, P->ln2_b, N, acts, A->ln2, A->ln2_mean, A->ln2_rstd, sc);
    float *u = out_for(m, acts, A->fc, sc->big);
    rc = linear_fwd(m, w, a, N, C, 4 * C, P->fc_w, P->fc_b, u, acts + A->fc, sc, diag,
                    dlayer(diag, l, "mlp.fc", lin));
    if (rc)
        return rc;
    float *g = out_for(m, acts, A->gelu, sc->in32);
    gelu_fwd_chunked(m, u, g, acts + A->gelu, n4, sc->chunk);
    rc = linear_fwd(m, w, g, N, 4 * C, C, P->mproj_w, P->mproj_b, sc->big, NULL, sc, diag,
                    dlayer(diag, l, "mlp.proj", lin));
    if (rc)
        return rc;
    resid_add(m, actf(acts, block_out(m, l)), hmid, sc->big, nC);
    return 0;
}

/* Forward pass; see gpu/gpt.h. */
int gpu_gpt_forward(const gpu_gpt *m, const gpu_gpt_weights *w, const int *x, const int *y, int B,
                    uint8_t *acts, float *scratch, gpu_diag *diag, double *loss, int *correct)
{
    gpt_scratch sc;
    gpu_dtype edt, wdt;
    double sum = 0.0;
    int rc = check_tokens(m, x, y, B);
    if (rc)
        return rc;
    int T = m->seq_len, C = m->d_model, N = B * T;
    carve(m, scratch, &sc);

    const void *wte = wsrc(w, m->wte, m->emb_dt, &edt), *wpe = wsrc(w, m->wpe, m->emb_dt, &edt);
    gpu_gpt_embed_fwd(x, B, T, C, wte, wpe, edt, m->resid_dt, actf(acts, m->act[0].resid), sc.row0);
    for (int l = 0; l < m->n_layer; l++) {
        rc = block_fwd(m, w, l, B, acts, &sc, diag);
        if (rc)
            return rc;
    }
    const float *a = ln_fwd(m, w, actf(acts, m->resid_final), m->lnf_w, m->lnf_b, N, acts, m->lnf,
                            m->lnf_mean, m->lnf_rstd, &sc);
    wte = wsrc(w, m->wte, m->lin_dt, &wdt);
    rc = gpu_gpt_head_fwd(a, wte, wdt, y, N, C, m->vocab, m->lin_dt, m->ce_dt, sc.big,
                          actf(acts, m->probs), sc.g, diag, dlayer(diag, -1, "lm_head", m->lin_dt),
                          &sum, correct);
    if (rc)
        return rc;
    *loss = sum / N;
    return 0;
}

/* One block's backward: sc->dres holds the gradient of the block's output on entry and of
 * its input on return. */
static int block_bwd(const gpu_gpt *m, const gpu_gpt_weights *w, int l, int B, const uint8_t *acts,
                     const gpt_scratch *sc, gpu_diag *diag, float *grads)
{
    const gpu_gpt_block *P = &m->blk[l];
    const gpu_gpt_block_acts *A = &m->act[l];
    int T = m->seq_len, C = m->d_model, N = B * T, rc;
    size_t nC = (size_t)N * C, n4 = 4 * nC;
    gpu_dtype lin = m->lin_dt;

    /* MLP: the add hands dres to mlp.proj's output */
    rc = linear_bwd(m, w, to_lin(m, sc->big, sc->dres, nC), acts + A->gelu, N, 4 * C, C, P->mproj_w,
                    P->mproj_b, grads, sc->in32, sc, diag, dlayer(diag, l, "mlp.proj", lin));
    if (rc)
        return rc;
    gelu_bwd_chunked(m, sc->in32, acts + A->fc, n4, sc->chunk);
    rc = linear_bwd(m, w, sc->in32, acts + A->ln2, N, C, 4 * C, P->fc_w, P->fc_b, grads, sc->big,
                    sc, diag, dlayer(diag, l, "mlp.fc", lin));
    if (rc)
        return rc;
    ln_bwd(m, w, sc->big, cactf(acts, A->resid_mid), acts, A->ln2_mean, A->ln2_rstd, P->ln2_w,
           P->ln2_b, N, grads, sc->aty, sc);
    resid_acc(m, sc->dres, sc->aty, nC);

    /* attention */
    rc = linear_bwd(m, w, to_lin(m, sc->big, sc->dres, nC), acts + A->atty, N, C, C, P->proj_w,
                    P->proj_b, grads, sc->aty, sc, diag, dlayer(diag, l, "attn.proj", lin));
    if (rc)
        return rc;
    cast(sc->aty, nC, lin, m->mm_dt);
    const float *qkv = saved_as(m, acts + A->qkv, 3 * nC, m->mm_dt, sc->qkvm);
    int dsc = dlayer(diag, l, "attn.scores", m->mm_dt);
    if (m->flash)
        rc = gpu_gpt_flash_bwd(sc->aty, qkv, saved_as(m, acts + A->atty, nC, lin, sc->in32),
                               cactf(acts, A->probs), B, T, C, m->n_head, m->mm_dt, sc->dqkv,
                               sc->att, diag, dsc);
    else
        rc = gpu_gpt_attention_bwd(sc->aty, qkv, cactf(acts, A->probs), B, T, C, m->n_head,
                                   m->mm_dt, m->sm_dt, sc->dqkv, sc->att, diag, dsc);
    if (rc)
        return rc;
    cast(sc->dqkv, 3 * nC, m->mm_dt, lin);
    rc = linear_bwd(m, w, sc->dqkv, acts + A->ln1, N, C, 3 * C, P->qkv_w, P->qkv_b, grads, sc->big,
                    sc, diag, dlayer(diag, l, "attn.qkv", lin));
    if (rc)
        return rc;
    ln_bwd(m, w, sc->big, cactf(acts, A->resid), acts, A->ln1_mean, A->ln1_rstd, P->ln1_w, P->ln1_b,
           N, grads, sc->aty, sc);
    resid_acc(m, sc->dres, sc->aty, nC);
    return 0;
}

/* See gpu/gpt.h. */
void gpu_gpt_block_done(const gpu_gpt *m, int l, const gpu_grad_ready *ready)
{
    const gpu_gpt_block *k = &m->blk[l];
    size_t C = (size_t)m->d_model;
    const size_t off[12] = {k->ln1_w,  k->ln1_b, k->qkv_w, k->qkv_b,   k->proj_w,  k->proj_b,
                            k->ln2_w,  k->ln2_b, k->fc_w,  k->fc_b,    k->mproj_w, k->mproj_b};
    const size_t n[12] = {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C};
    for (int i = 0; ready && i < 12; i++)
        gpu_grad_done(ready, off[i], n[i]);
}

/* Backward pass; see gpu/gpt.h. */
int gpu_gpt_backward(const gpu_gpt *m, const gpu_gpt_weights *w, const int *x, const int *y, int B,
                     float seed, const uint8_t *acts, float *scratch, gpu_diag *diag, float *grads,
                     const gpu_grad_ready *ready)
{
    gpt_scratch sc;
    gpu_dtype wdt;
    int rc = check_tokens(m, x, y, B);
    if (rc)
        return rc;
    int T = m->seq_len, C = m->d_model, N = B * T;
    size_t nC = (size_t)N * C;
    carve(m, scratch, &sc);

    const void *wte = wsrc(w, m->wte, m->lin_dt, &wdt);
    rc = gpu_gpt_head_bwd(cactf(acts, m->probs), y, acts + m->lnf, wte, wdt, N, C, m->vocab,
                          m->lin_dt, m->ce_dt, seed / (float)N, sc.big, sc.in32, grads + m->wte,
                          sc.g, diag, dlayer(diag, -1, "lm_head", m->lin_dt));
    if (rc)
        return rc;
    ln_bwd(m, w, sc.in32, cactf(acts, m->resid_final), acts, m->lnf_mean, m->lnf_rstd, m->lnf_w,
           m->lnf_b, N, grads, sc.dres, &sc);
    gpu_grad_done(ready, m->lnf_w, (size_t)C);
    gpu_grad_done(ready, m->lnf_b, (size_t)C);
    for (int l = m->n_layer - 1; l >= 0; l--) {
        rc = block_bwd(m, w, l, B, acts, &sc, diag, grads);
        if (rc)
            return rc;
        gpu_gpt_block_done(m, l, ready);
    }
    /* the embedding: its output was held in resid_dt; it ran in emb_dt */
    cast(sc.dres, nC, m->resid_dt, m->emb_dt);
    memset(grads + m->wpe, 0, sizeof(float) * (size_t)T * C);
    gpu_gpt_embed_bwd(x, B, T, C, sc.dres, grads + m->wte, grads + m->wpe);
    gpu_grad_done(ready, m->wpe, (size_t)T * C);
    gpu_grad_done(ready, m->wte, (size_t)m->vocab * C);
    return 0;
}
