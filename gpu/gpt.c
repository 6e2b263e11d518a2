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
 * Files: this one holds the ops but the attention, the plan and the passes; the attention
 * (materialised and flash) is gpu/gpt_attn.c, and gpu/gpt_int.h what both share.
 *
 * Buffers: parameters (one block, named tensors in gpu_gpt.tensor), saved activations (one
 * byte block; 16-bit tensors where the op's dtype is) and the fp32 scratch are owned by the
 * caller; this file plans their layout and fills them. No allocation per step.
 * Threads: every pass runs on the OpenMP team (its size is the ICV the engine sets from the
 * job's threads; a pass over fewer than PAR_MIN floats stays on the calling thread). The
 * linears' GEMMs are called from the calling thread and use the GEMM library's threads. The
 * attention's (sequence, head) pairs run side by side, one per thread with its own slot of
 * scratch and its GEMMs on that thread, when the plan's attn_slots allows (see each_head);
 * else in order, each GEMM and row pass on the whole team. Work is shared out by
 * independent outputs only: rows, chunks of an elementwise pass, heads or the score rows of
 * one head, and blocks of columns for the sums over rows (bias, layer-norm and embedding
 * gradients), whose rows are added in order; the loss is summed in row order. So each value
 * comes from the same arithmetic in the same order whatever the number of threads, and
 * results are bit-identical to one thread's (check_gpt's test_threads_bitwise). Diagnostics
 * are not thread-safe: a pass that feeds them runs on the calling thread alone. Other
 * temporaries are on the stack (CHUNK floats at most). Fused passes: rounding and casts are
 * made in the pass that produces or consumes a tensor (a linear's input gradient is rounded
 * by its consumer when there are no diagnostics, the attention's outputs by their head), the
 * residual adds in the projections' output rows, and the stream's gradient is rounded to
 * lin_dt as it is summed.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gpu/diag.h"
#include "gpu/fp8.h"
#include "gpu/gpt.h"
#include "gpu/gpt_int.h"
#include "gpu/gpu_int.h"

#define LN_EPS 1e-5f
#define COLS 64 /* columns per block of a sum over rows: the unit its threads share out */
#define PIECE 512 /* floats of a row widened at a time on the stack */
#define CE_ROWS 512 /* rows of cross-entropy whose losses are held before they are summed */
#define GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_K1 0.044715f

static size_t align64(size_t n)
{
    return (n + 63) & ~(size_t)63;
}

static int min_int(int a, int b)
{
    return a < b ? a : b;
}

/* Rows of C floats per block of a row-wise pass: a CHUNK's worth (at least one). */
static int row_block(int C)
{
    return CHUNK / C > 0 ? CHUNK / C : 1;
}

static void cast_par(float *v, size_t n, gpu_dtype from, gpu_dtype to)
{
    if (to != GPU_FP32 && to != from)
        rnd_par(v, n, to);
}

/* n floats of src (values of dt) stored in dt at dst, chunks on every core. */
static void store_par(void *dst, gpu_dtype dt, const float *src, size_t n)
{
    size_t es = gpu_dtype_size(dt);
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK)
        gpu_cvt_from_f32((char *)dst + i * es, dt, src + i, min_sz(CHUNK, n - i));
}

/* PyTorch's promotion of two float dtypes (only fp32 and one low dtype occur). */
static gpu_dtype promote(gpu_dtype a, gpu_dtype b)
{
    return a == GPU_FP32 || b == GPU_FP32 ? GPU_FP32 : a;
}

/* ---- vectorisable math ------------------------------------------------------------------ */

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

/* acc[j] += a[i ld + j] for each row i < rows in turn, j < w: a block of columns summed. */
HOT static void col_block(float *restrict acc, const float *restrict a, size_t rows, size_t ld,
                          int w)
{
    for (size_t i = 0; i < rows; i++)
        for (int j = 0; j < w; j++)
            acc[j] += a[i * ld + j];
}

/* col_block on bf16 values (each widened exactly): the same sums, in the same order. */
HOT static void col_block_bf16(float *restrict acc, const uint16_t *restrict a, size_t rows,
                               size_t ld, int w)
{
    for (size_t i = 0; i < rows; i++)
        for (int j = 0; j < w; j++) {
            uint32_t u = (uint32_t)a[i * ld + j] << 16;
            float f;
            memcpy(&f, &u, sizeof f);
            acc[j] += f;
        }
}

/* col_block on 16-bit values of dt, widened a row's block at a time. */
static void col_block16(float *acc, const uint16_t *a, gpu_dtype dt, size_t rows, size_t ld,
                        int w)
{
    if (dt == GPU_BF16) {
        col_block_bf16(acc, a, rows, ld, w);
        return;
    }
    for (size_t i = 0; i < rows; i++) {
        float row[COLS];
        gpu_cvt_to_f32(row, a + i * ld, dt, (size_t)w);
        col_block(acc, row, 1, (size_t)w, w);
    }
}

/* See gpu/gpt.h. Blocks of COLS columns shared out to the threads, so that each sum is the
 * sequential one. */
void gpu_gpt_bias_grad(float *acc, const float *dy, const uint16_t *dy16, gpu_dtype dt,
                       size_t rows, int n)
{
#pragma omp parallel for schedule(static) if (big(rows * (size_t)n))
    for (int c = 0; c < n; c += COLS) {
        int w = min_int(COLS, n - c);
        memset(acc + c, 0, sizeof(float) * (size_t)w);
        if (dy16)
            col_block16(acc + c, dy16 + c, dt, rows, (size_t)n, w);
        else
            col_block(acc + c, dy + c, rows, (size_t)n, w);
    }
}

/* ---- embedding -------------------------------------------------------------------------- */

/* o = rd(wte[tok] + wpe[t], out_dt), one row of C; 16-bit weights widened a piece at a time. */
static void embed_row(float *o, const void *wte, const void *wpe, gpu_dtype wdt, size_t tok,
                      size_t t, int C, gpu_dtype out_dt)
{
    size_t es = gpu_dtype_size(wdt);
    const uint8_t *pe = (const uint8_t *)wpe + t * (size_t)C * es;
    gpu_cvt_to_f32(o, (const uint8_t *)wte + tok * (size_t)C * es, wdt, (size_t)C);
    if (wdt == GPU_FP32)
        add_row(o, (const float *)pe, C);
    for (int j = 0; wdt != GPU_FP32 && j < C; j += PIECE) {
        float tmp[PIECE];
        int k = min_int(PIECE, C - j);
        gpu_cvt_to_f32(tmp, pe + (size_t)j * es, wdt, (size_t)k);
        add_row(o + j, tmp, k);
    }
    rnd(o, (size_t)C, out_dt);
}

/* See gpu/gpt.h. Rows on every core. */
void gpu_gpt_embed_fwd(const int *x, int B, int T, int C, const void *wte, const void *wpe,
                       gpu_dtype wdt, gpu_dtype out_dt, float *out, float *tmp)
{
    int N = B * T;
    (void)tmp;
#pragma omp parallel for schedule(static) if (big((size_t)N * C))
    for (int r = 0; r < N; r++)
        embed_row(out + (size_t)r * C, wte, wpe, wdt, (size_t)x[r], (size_t)(r % T), C, out_dt);
}

/* See gpu/gpt.h. Each gradient row sums its contributions in row order, as one thread would:
 * wpe's by position on every core, wte's (scattered by token) by blocks of columns. */
void gpu_gpt_embed_bwd(const int *x, int B, int T, int C, const float *dout, float *dwte,
                       float *dwpe)
{
    size_t N = (size_t)B * T;
#pragma omp parallel for schedule(static) if (big(N * C))
    for (int t = 0; t < T; t++)
        for (int b = 0; b < B; b++)
            add_row(dwpe + (size_t)t * C, dout + ((size_t)b * T + t) * C, C);
#pragma omp parallel for schedule(static) if (big(N * C))
    for (int c = 0; c < C; c += COLS) {
        int w = min_int(COLS, C - c);
        for (size_t r = 0; r < N; r++)
            add_row(dwte + (size_t)x[r] * C + c, dout + r * C + c, w);
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

/* Layer norm of N rows, rounded to dt, on the calling thread. */
static void ln_rows_fwd(const float *x, const float *g, const float *b, int N, int C, gpu_dtype dt,
                        float *y, float *mean, float *rstd)
{
    for (int i = 0; i < N; i++) {
        float *yr = y + (size_t)i * C;
        ln_row_fwd(x + (size_t)i * C, g, b, C, yr, mean + i, rstd + i);
        rnd(yr, (size_t)C, dt);
    }
}

/* See gpu/gpt.h. Blocks of rows on every core. */
void gpu_gpt_layernorm_fwd(const float *x, const float *g, const float *b, int N, int C,
                           gpu_dtype dt, float *y, float *mean, float *rstd)
{
    int rows = row_block(C);
#pragma omp parallel for schedule(static) if (big((size_t)N * C))
    for (int r = 0; r < N; r += rows) {
        size_t at = (size_t)r * C;
        ln_rows_fwd(x + at, g, b, min_int(rows, N - r), C, dt, y + at, mean + r, rstd + r);
    }
}

/* dx of one row of the layer-norm backward. The two row sums use 16 partial sums, as
 * sum16. */
HOT static void ln_row_dx(const float *restrict dy, const float *restrict x, float mean,
                          float rstd, const float *restrict g, int C, float *restrict dx)
{
    float a1[16] = {0}, a2[16] = {0}, m1 = 0.0f, m2 = 0.0f;
    int j = 0;
    for (; j + 16 <= C; j += 16)
        for (int k = 0; k < 16; k++) {
            float xh = (x[j + k] - mean) * rstd, d = dy[j + k] * g[j + k];
            a1[k] += d;
            a2[k] += d * xh;
        }
    for (; j < C; j++) {
        float xh = (x[j] - mean) * rstd, d = dy[j] * g[j];
        m1 += d;
        m2 += d * xh;
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

/* dx of N rows, rounded to dt, on the calling thread. */
static void ln_rows_dx(const float *dy, const float *x, const float *mean, const float *rstd,
                       const float *g, int N, int C, gpu_dtype dt, float *dx)
{
    for (int i = 0; i < N; i++) {
        size_t at = (size_t)i * C;
        ln_row_dx(dy + at, x + at, mean[i], rstd[i], g, C, dx + at);
        rnd(dx + at, (size_t)C, dt);
    }
}

/* dg[j] += dy xhat, db[j] += dy over the rows in order, for a block of w columns of rows of
 * ld floats. */
HOT static void ln_grad_block(const float *restrict dy, const float *restrict x,
                              const float *restrict mean, const float *restrict rstd, int N,
                              size_t ld, int w, float *restrict dg, float *restrict db)
{
    for (int i = 0; i < N; i++) {
        const float *d = dy + (size_t)i * ld, *xr = x + (size_t)i * ld;
        float mu = mean[i], rs = rstd[i];
        for (int j = 0; j < w; j++) {
            float xh = (xr[j] - mu) * rs;
            dg[j] += d[j] * xh;
            db[j] += d[j];
        }
    }
}

/* The layer norm's weight gradients, rounded to dt: sums over the rows in order, blocks of
 * columns on every core. */
static void ln_grads(const float *dy, const float *x, const float *mean, const float *rstd,
                     int N, int C, gpu_dtype dt, float *dg, float *db)
{
#pragma omp parallel for schedule(static) if (big((size_t)N * C))
    for (int c = 0; c < C; c += COLS) {
        int w = min_int(COLS, C - c);
        memset(dg + c, 0, sizeof(float) * (size_t)w);
        memset(db + c, 0, sizeof(float) * (size_t)w);
        ln_grad_block(dy + c, x + c, mean, rstd, N, (size_t)C, w, dg + c, db + c);
        rnd(dg + c, (size_t)w, dt);
        rnd(db + c, (size_t)w, dt);
    }
}

/* See gpu/gpt.h. dx may not alias dy or x. dx by blocks of rows, then dg and db by blocks of
 * columns, on every core. */
void gpu_gpt_layernorm_bwd(const float *dy, const float *x, const float *mean, const float *rstd,
                           const float *g, int N, int C, gpu_dtype dt, float *dx, float *dg,
                           float *db)
{
    int rows = row_block(C);
#pragma omp parallel for schedule(static) if (big((size_t)N * C))
    for (int r = 0; r < N; r += rows) {
        size_t at = (size_t)r * C;
        ln_rows_dx(dy + at, x + at, mean + r, rstd + r, g, min_int(rows, N - r), C, dt, dx + at);
    }
    ln_grads(dy, x, mean, rstd, N, C, dt, dg, db);
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

/* dst = rd(gelu(u), dt) for k <= CHUNK floats (dst may equal u), on the calling thread. */
static void gelu_chunk(float *dst, const float *u, size_t k, gpu_dtype dt)
{
    if (dst == u) { /* in place: the kernel reads each element before writing it */
        float tmp[CHUNK];
        gelu_kernel(tmp, u, k);
        memcpy(dst, tmp, k * sizeof(float));
    } else {
        gelu_kernel(dst, u, k);
    }
    rnd(dst, k, dt);
}

/* See gpu/gpt.h. Chunks on every core. */
void gpu_gpt_gelu_fwd(float *dst, const float *u, size_t n, gpu_dtype dt)
{
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK)
        gelu_chunk(dst + i, u + i, min_sz(CHUNK, n - i), dt);
}

/* See gpu/gpt.h. Chunks on every core. */
void gpu_gpt_gelu_bwd(float *d, const float *u, size_t n, gpu_dtype dt)
{
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = min_sz(CHUNK, n - i);
        gelu_grad_kernel(d + i, u + i, k);
        rnd(d + i, k, dt);
    }
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

/* One row of the head's forward from its raw logits z: rounded, cast, the cross-entropy's
 * softmax into p (rounded); returns the row's loss, *hit whether the argmax is the target. */
static double head_row(float *z, float *p, int V, int target, gpu_dtype lin_dt, gpu_dtype ce_dt,
                       int *hit)
{
    int arg;
    rnd(z, (size_t)V, lin_dt);
    cast(z, (size_t)V, lin_dt, ce_dt);
    double loss = ce_row(z, V, target, p, &arg);
    *hit = arg == target;
    rnd(p, (size_t)V, ce_dt);
    return loss;
}

/* See gpu/gpt.h. Rows on every core, CE_ROWS at a time, whose losses are then summed in row
 * order (the sum of the sequential loop); with diag on the calling thread alone. */
int gpu_gpt_head_fwd(const float *x, const void *wte, gpu_dtype wdt, const int *y, int N, int C,
                     int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float *logits, float *probs,
                     float *gscratch, gpu_diag *diag, int layer, double *loss_sum, int *correct)
{
    double total = 0.0, loss[CE_ROWS];
    int hits = 0;
    /* x holds values of lin_dt: the library may take it in lin_dt (bf16 natively) */
    int rc = gpu_gemm_ex(false, true, N, V, C, x, GPU_FP32, C, wte, wdt, C, lin_dt, 0, 0.0f,
                         logits, V, gscratch, gpu_gpt_head_scratch_floats(N, C, V, wdt, lin_dt));
    if (rc)
        return rc;
    for (int r = 0; r < N; r += CE_ROWS) {
        int n = min_int(CE_ROWS, N - r);
#pragma omp parallel for schedule(static) reduction(+ : hits) if (!diag && big((size_t)n * V))
        for (int i = r; i < r + n; i++) {
            float *z = logits + (size_t)i * V;
            int hit;
            if (diag)
                gpu_diag_forward(diag, layer, z, (size_t)V);
            loss[i - r] = head_row(z, probs + (size_t)i * V, V, y[i], lin_dt, ce_dt, &hit);
            hits += hit;
        }
        for (int i = 0; i < n; i++)
            total += loss[i];
    }
    *loss_sum = total;
    *correct = hits;
    return 0;
}

/* gpu_diag_round_grad: with diag, accounted and rounded on the calling thread; without,
 * rounded on every core. */
static void round_grad(gpu_diag *diag, int layer, bool weight, float *g, size_t n, gpu_dtype dt)
{
    if (diag)
        gpu_diag_round_grad(diag, layer, weight, g, n, dt);
    else
        rnd_par(g, n, dt);
}

/* See gpu/gpt.h. */
int gpu_gpt_head_bwd(const float *probs, const int *y, const void *xs, const void *wte,
                     gpu_dtype wdt, int N, int C, int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float g,
                     float *dlogits, float *dx, float *dwte, float *gscratch, gpu_diag *diag,
                     int layer)
{
#pragma omp parallel for schedule(static) if (big((size_t)N * V))
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
    size_t gn = gpu_gpt_head_scratch_floats(N, C, V, wdt, lin_dt);
    int rc = gpu_gemm_ex(true, false, V, C, N, dlogits, GPU_FP32, V, xs, lin_dt, C, lin_dt, 0,
                         0.0f, dwte, C, gscratch, gn);
    if (rc)
        return rc;
    round_grad(diag, layer, true, dwte, (size_t)V * C, lin_dt);
    rc = gpu_gemm_ex(false, false, N, C, V, dlogits, GPU_FP32, V, wte, wdt, C, lin_dt, 0, 0.0f, dx,
                     C, gscratch, gn);
    if (rc)
        return rc;
    round_grad(diag, layer, false, dx, (size_t)N * C, lin_dt);
    return 0;
}

/* ---- the model: layout ------------------------------------------------------------------ */

/* The fp32 scratch regions (floats, for max_batch sequences). */
typedef struct {
    float *big;         /* N x max(4C, V): GEMM outputs, logits, dlogits, GELU input, the
                         * stream's gradient in lin_dt */
    float *in32;        /* N x 4C: GEMM inputs (fp32 values of lin_dt); 4C-wide gradients */
    float *qkvm;        /* N x 3C: qkv in mm_dt when it differs; layer-norm input temporaries */
    float *aty;         /* N x C: attention output / its gradient; layer-norm dx */
    float *dqkv;        /* N x 3C */
    float *dres;        /* N x C: the residual stream's gradient */
    float *att;         /* attention temporaries */
    float *row0, *row1; /* 4C each: bias and layer-norm weights in fp32 */
    void *dyl;          /* N x 4C of lin_dt: a linear's output gradient (with dy_copy) */
    float *g;           /* GEMM widening scratch (the rest) */
    size_t gn;          /* its floats */
} gpt_scratch;

/* Carve the scratch regions from base (NULL: only count); returns the floats before the
 * GEMM scratch. */
static size_t carve(const gpu_gpt *m, float *base, gpt_scratch *sc)
{
    size_t N = (size_t)m->max_batch * m->seq_len, C = (size_t)m->d_model;
    size_t wide = 4 * C > (size_t)m->vocab ? 4 * C : (size_t)m->vocab;
    size_t dyl = m->dy_copy ? N * 4 * C * gpu_dtype_size(m->lin_dt) / sizeof(float) : 0;
    size_t sizes[10] = {N * wide,
                        N * 4 * C,
                        N * 3 * C,
                        N * C,
                        N * 3 * C,
                        N * C,
                        gpu_gpt_attention_scratch_floats(m->seq_len, m->head_dim, m->mm_dt,
                                                         m->attn_slots),
                        4 * C,
                        4 * C,
                        dyl};
    float *dyf = NULL;
    float **slot[11] = {&sc->big,  &sc->in32, &sc->qkvm, &sc->aty, &sc->dqkv, &sc->dres,
                        &sc->att,  &sc->row0, &sc->row1, &dyf,     &sc->g};
    size_t off = 0;
    for (int i = 0; i < 11; i++) {
        if (base)
            *slot[i] = base + off;
        if (i < 10)
            off += align16f(sizes[i]);
    }
    sc->dyl = dyl > 0 ? dyf : NULL;
    sc->gn = base && m->scratch_floats > off ? m->scratch_floats - off : 0;
    return off;
}

/* The most scratch a linear's three GEMMs take: y = x W^T (N x O from K) with x in xdt,
 * dW = dY^T X with dY in ddt and X in xwdt, dX = dY W; W (O x K) in wdt. Planned with the
 * dtypes the calls pass: the GEMM takes more scratch for an operand stored in lin_dt than
 * for its fp32 values where it may have to widen it (gpu_gemm_ex refuses a short scratch). */
static size_t linear_gemm_scratch(int N, int O, int K, gpu_dtype xdt, gpu_dtype xwdt,
                                  gpu_dtype ddt, gpu_dtype wdt, gpu_dtype lin_dt)
{
    size_t s[3] = {
        gpu_gemm_ex_scratch_floats(N, O, K, xdt, wdt, lin_dt, 0),
        gpu_gemm_ex_scratch_floats(O, K, N, ddt, xwdt, lin_dt, 0),
        gpu_gemm_ex_scratch_floats(N, K, O, ddt, wdt, lin_dt, 0),
    };
    size_t most = s[0] > s[1] ? s[0] : s[1];
    return most > s[2] ? most : s[2];
}

/* See gpu/gpt.h. The head reads x and dlogits in fp32, the saved x in lin_dt. */
size_t gpu_gpt_head_scratch_floats(int N, int C, int V, gpu_dtype wdt, gpu_dtype lin_dt)
{
    return linear_gemm_scratch(N, V, C, GPU_FP32, lin_dt, GPU_FP32, wdt, lin_dt);
}

/* The dtype the blocks' linears hand their saved input X and their output gradient dY to
 * the GEMMs in (linear_fwd, linear_bwd): lin_dt as stored where the library takes it so
 * (then the fp32 copies of the inputs the forward saves in lin_dt are needed by nothing),
 * else fp32 (values of lin_dt). */
static gpu_dtype lin_io_dt(const gpu_gpt *m)
{
    return m->lin_dt != GPU_FP32 && gpu_gemm_in_place(m->lin_dt) ? m->lin_dt : GPU_FP32;
}

/* Floats of GEMM widening scratch: the largest any GEMM of the passes needs, with 16-bit
 * weights unless everything is fp32 (the working copy is in the job's dtype). */
static size_t plan_gemm_scratch(const gpu_gpt *m, gpu_dtype dt)
{
    int N = m->max_batch * m->seq_len, C = m->d_model;
    int dims[4][2] = {{3 * C, C}, {C, C}, {4 * C, C}, {C, 4 * C}}; /* out, in */
    gpu_dtype io = lin_io_dt(m);
    size_t most = gpu_gpt_head_scratch_floats(N, C, m->vocab, dt, m->lin_dt);
    for (int i = 0; i < 4; i++) {
        size_t s = linear_gemm_scratch(N, dims[i][0], dims[i][1], io, io, io, dt, m->lin_dt);
        most = s > most ? s : most;
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
    /* The heads' GEMMs read Q, K and V inside qkv's rows: in fp32 and widened 16-bit they
     * run there on OpenBLAS, which may be called from the team's threads at once only on one
     * thread of its own (else it fights them: an fp32 GPT step measured 877 ms against
     * 312 ms on 2 cores); native bf16 takes dense copies on oneDNN, one thread per head.
     * So heads run side by side only when OpenBLAS has one thread. */
    m->attn_slots = gpu_blas_threads() == 1 ? team_size(max_batch * m->n_head) : 1;
    m->dy_copy = lin_io_dt(m) != GPU_FP32;
    layout_params(m);
    layout_acts(m);
    m->scratch_floats = carve(m, NULL, &(gpt_scratch){0}) + plan_gemm_scratch(m, dt) + 16;
    return 0;
}

static const char *const linear_kind[4] = {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"};

void gpu_gpt_linear_name(int g, char *out, size_t len)
{
    snprintf(out, len, "blocks.%d.%s", g / 4, linear_kind[g % 4]);
}

/* The fp8 GEMMs' layout and scratch; see gpu/gpt.h. */
int gpu_gpt_plan_fp8(gpu_gpt *m, const gpu_fp8_config *f, char *err, size_t errlen)
{
    char names[4 * GPU_GPT_MAX_LAYERS][48];
    const char *np[4 * GPU_GPT_MAX_LAYERS] = {0};
    int n = 4 * m->n_layer, N = m->max_batch * m->seq_len, C = m->d_model;
    int dims[4][2] = {{3 * C, C}, {C, C}, {4 * C, C}, {C, 4 * C}}; /* out, in */
    size_t bytes = 0, most = 0;
    for (int g = 0; g < n; g++) {
        gpu_gpt_linear_name(g, names[g], sizeof(names[g]));
        np[g] = names[g];
    }
    int rc = gpu_fp8_plan_keep(f, n, np, m->fp8, err, errlen);
    if (rc)
        return rc;
    m->nfp8 = n;
    for (int g = 0; g < n; g++) {
        const gpu_gpt_block *P = &m->blk[g / 4];
        const size_t w[4] = {P->qkv_w, P->proj_w, P->fc_w, P->mproj_w};
        int O = dims[g % 4][0], K = dims[g % 4][1];
        m->fp8_w[g] = w[g % 4];
        if (!m->fp8[g])
            continue;
        m->x8_off[g] = bytes;
        bytes = align64(bytes + (size_t)N * K);
        m->w8_off[g] = bytes;
        bytes = align64(bytes + (size_t)O * K);
        size_t s = gpu_gemm_fp8_linear_scratch_floats(N, O, K);
        most = s > most ? s : most;
    }
    m->fp8_bytes = bytes;
    /* the output gradient's fp8 copy at the GEMM scratch's start, then the fp8 GEMMs' */
    m->scratch_floats += ((size_t)N * 4 * C + 3) / 4 + 16 + most;
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

/* What becomes of a linear's rounded output besides out: saved in lin_dt at store, or added
 * to the residual stream as dst = rd(res + out, resid_dt). NULL: not wanted. only16: the
 * saved values are all that is read afterwards (out's fp32 values may stay unrounded). */
typedef struct {
    uint8_t *store;
    const float *res;
    float *dst;
    bool only16;
} lin_out;

/* Row i of a linear's output o: the bias in fp32, diagnostics on the fp32 value, rounding,
 * then where `to` sends it. */
static void linear_row(const gpu_gpt *m, float *o, const float *bias, int O, size_t i,
                       const lin_out *to, gpu_diag *diag, int layer)
{
    gpu_dtype dt = m->lin_dt;
    add_row(o, bias, O);
    if (diag)
        gpu_diag_forward(diag, layer, o, (size_t)O);
    if (!to->only16) /* else the conversion makes the rounding */
        rnd(o, (size_t)O, dt);
    if (to->store)
        gpu_cvt_from_f32(to->store + i * (size_t)O * gpu_dtype_size(dt), dt, o, (size_t)O);
    if (to->dst) {
        float *d = to->dst + i * (size_t)O;
        add_to(d, to->res + i * (size_t)O, o, (size_t)O);
        rnd(d, (size_t)O, m->resid_dt);
    }
}

/* The fp8 GEMM of the linear whose weight is at w_off, or -1 (not an fp8 job, or the layer
 * is kept in lin_dt). */
static int fp8_gemm(const gpu_gpt *m, const gpu_gpt_weights *w, size_t w_off)
{
    for (int g = 0; w->fp8 && g < m->nfp8; g++)
        if (m->fp8_w[g] == w_off)
            return m->fp8[g] ? g : -1;
    return -1;
}

/* The weight an fp8 cast reads: the fp32 master, or the working copy without one. */
static const void *fp8_weight(const gpu_gpt_weights *w, size_t off, gpu_dtype *dt)
{
    *dt = w->master ? GPU_FP32 : w->pdt;
    return w->master ? (const void *)(w->master + off)
                     : (const uint8_t *)w->p + off * gpu_dtype_size(w->pdt);
}

/* Linear g's forward GEMM in fp8: its saved input (lin_dt) and its weight cast (the copies
 * kept for backward), out = x W^T unrounded. */
static int fp8_fwd(const gpu_gpt *m, const gpu_gpt_weights *w, int g, const uint8_t *saved, int N,
                   int K, int O, float *out, const gpt_scratch *sc)
{
    gpu_fp8_run *run = w->fp8;
    uint8_t *x8 = w->fp8_block + m->x8_off[g], *w8 = w->fp8_block + m->w8_off[g];
    gpu_dtype wdt;
    const void *W = fp8_weight(w, m->fp8_w[g], &wdt);
    float sx = gpu_fp8_cast_role(run, g, GPU_FP8_X, x8, saved, m->lin_dt, (size_t)N * K);
    float sw = gpu_fp8_cast_role(run, g, GPU_FP8_W, w8, W, wdt, (size_t)O * K);
    return gpu_gemm_fp8(false, true, N, O, K, x8, gpu_fp8_role_format(&run->cfg, GPU_FP8_X), sx, K,
                        w8, gpu_fp8_role_format(&run->cfg, GPU_FP8_W), sw, K, &run->cfg.acc, out, O,
                        sc->g, sc->gn);
}

/* Linear g's backward GEMMs in fp8: dY (n values of ddt) cast to the gradient's format at the
 * GEMM scratch's start, then dW = dY^T X and dX = dY W on the forward's fp8 copies. */
static int fp8_bwd(const gpu_gpt *m, const gpu_gpt_weights *w, int g, const void *dy, gpu_dtype ddt,
                   int N, int K, int O, float *gw, float *dX, const gpt_scratch *sc)
{
    gpu_fp8_run *run = w->fp8;
    const gpu_fp8_config *c = &run->cfg;
    const uint8_t *x8 = w->fp8_block + m->x8_off[g], *w8 = w->fp8_block + m->w8_off[g];
    uint8_t *g8 = (uint8_t *)(void *)sc->g;
    size_t skip = ((size_t)N * O + 3) / 4 + 16;
    gpu_fp8_format fg = gpu_fp8_role_format(c, GPU_FP8_G), f4 = GPU_E4M3;
    float sg = gpu_fp8_cast_role(run, g, GPU_FP8_G, g8, dy, ddt, (size_t)N * O);
    float sx = gpu_fp8_scale_inv(run, g, GPU_FP8_X), sw = gpu_fp8_scale_inv(run, g, GPU_FP8_W);
    int rc = gpu_gemm_fp8(true, false, O, K, N, g8, fg, sg, O, x8, f4, sx, K, &c->acc, gw, K,
                          sc->g + skip, sc->gn - skip);
    if (rc == 0)
        rc = gpu_gemm_fp8(false, false, N, K, O, g8, fg, sg, O, w8, f4, sw, K, &c->acc, dX, K,
                          sc->g + skip, sc->gn - skip);
    return rc;
}

/* out[N x O] = rd(in W^T + b, lin_dt), then `to`: the rows after the GEMM on every core (on
 * the calling thread with diag). in holds fp32 values of lin_dt; saved, the same values
 * stored in lin_dt, is what the GEMM reads where it takes lin_dt as it is stored
 * (lin_io_dt; in is then not read). */
static int linear_fwd(const gpu_gpt *m, const gpu_gpt_weights *w, const float *in,
                      const uint8_t *saved, int N, int K, int O, size_t w_off, size_t b_off,
                      float *out, const lin_out *to, const gpt_scratch *sc, gpu_diag *diag,
                      int layer)
{
    gpu_dtype dt = m->lin_dt, wdt, adt = lin_io_dt(m);
    const void *W = wsrc(w, w_off, dt, &wdt);
    const void *x = adt == GPU_FP32 ? (const void *)in : saved; /* in may be NULL then */
    int g = fp8_gemm(m, w, w_off);
    int rc = g >= 0 ? fp8_fwd(m, w, g, saved, N, K, O, out, sc)
                    : gpu_gemm_ex(false, true, N, O, K, x, adt, K, W, wdt, K, dt,
                                  GPU_GEMM_AB_CONVERTED, 0.0f, out, O, sc->g, sc->gn);
    if (rc)
        return rc;
    const float *bias = wf32(w, b_off, (size_t)O, dt, sc->row0);
#pragma omp parallel for schedule(static) if (!diag && big((size_t)N * O))
    for (int i = 0; i < N; i++)
        linear_row(m, out + (size_t)i * O, bias, O, (size_t)i, to, diag, layer);
    return 0;
}

/* Where a linear's output gradient is stored in lin_dt for its two GEMMs: sc->dyl where
 * they take lin_dt as it is stored, else NULL. The pass that makes the gradient stores it
 * there while it is in cache where it can (dY_stored); else linear_bwd converts it. */
static void *dy_store(const gpu_gpt *m, const gpt_scratch *sc)
{
    return sc->dyl && lin_io_dt(m) != GPU_FP32 ? sc->dyl : NULL;
}

/* X (n values saved in lin_dt) as the weight gradient's GEMM reads it: in place where the
 * library takes lin_dt as stored, else widened once into dX, which the input gradient's GEMM
 * writes only afterwards (the two have the same shape). The GEMM then reads one fp32
 * operand whole instead of widening it block by block and summing partial products. */
static const void *x_for_dw(const gpu_gpt *m, const uint8_t *X, size_t n, float *dX,
                            gpu_dtype *xdt)
{
    *xdt = lin_io_dt(m);
    if (*xdt == m->lin_dt)
        return X;
    gpu_cvt_to_f32(dX, X, m->lin_dt, n);
    return dX;
}

/* linear_bwd in fp8: the GEMMs, then the roundings and the bias gradient as in lin_dt. */
static int fp8_linear_bwd(const gpu_gpt *m, const gpu_gpt_weights *w, int g, const void *dy,
                          gpu_dtype ddt, const float *dY, const void *dy16, int N, int K, int O,
                          float *gw, float *gb, float *dX, const gpt_scratch *sc, gpu_diag *diag,
                          int layer)
{
    gpu_dtype dt = m->lin_dt;
    int rc = fp8_bwd(m, w, g, dy, ddt, N, K, O, gw, dX, sc);
    if (rc)
        return rc;
    round_grad(diag, layer, true, gw, (size_t)O * K, dt);
    gpu_gpt_bias_grad(gb, dY, dy16, dt, (size_t)N, O);
    round_grad(diag, layer, true, gb, (size_t)O, dt);
    if (diag)
        gpu_diag_round_grad(diag, layer, false, dX, (size_t)N * K, dt);
    return 0;
}

/* Backward of a linear in lin_dt from dY [N x O] (values of lin_dt; also in dy_store() when
 * dY_stored) and its saved input X (lin_dt, N x K): weight and bias gradients rounded to
 * lin_dt into grads, dX [N x K] written. With diag: the arriving dY, then each gradient
 * before it is rounded, dX included. Without, dX is left in fp32 for its consumer to round
 * to lin_dt in the pass it makes over dX anyway (rounding twice gives the same values).
 * Where dY is stored in dy_store() every use reads it there, so with dY_stored and no diag
 * dY's fp32 values are never read (their producer need not write them: dy_only16). */
static int linear_bwd(const gpu_gpt *m, const gpu_gpt_weights *w, const float *dY,
                      bool dY_stored, const uint8_t *X, int N, int K, int O, size_t w_off,
                      size_t b_off, float *grads, float *dX, const gpt_scratch *sc,
                      gpu_diag *diag, int layer)
{
    gpu_dtype dt = m->lin_dt, wdt, ddt = GPU_FP32, xdt;
    float *gw = grads + w_off, *gb = grads + b_off;
    const void *dy = dY;
    void *dy16 = dy_store(m, sc);
    if (diag)
        gpu_diag_backward(diag, layer, dY, (size_t)N * O);
    if (dy16) { /* once for both GEMMs, not once in each */
        if (!dY_stored)
            store_par(dy16, dt, dY, (size_t)N * O);
        dy = dy16;
        ddt = dt;
    }
    int g = fp8_gemm(m, w, w_off);
    if (g >= 0)
        return fp8_linear_bwd(m, w, g, dy, ddt, dY, dy16, N, K, O, gw, gb, dX, sc, diag, layer);
    const void *x = x_for_dw(m, X, (size_t)N * K, dX, &xdt);
    int rc = gpu_gemm_ex(true, false, O, K, N, dy, ddt, O, x, xdt, K, dt, GPU_GEMM_AB_CONVERTED,
                         0.0f, gw, K, sc->g, sc->gn);
    if (rc)
        return rc;
    round_grad(diag, layer, true, gw, (size_t)O * K, dt);
    gpu_gpt_bias_grad(gb, dY, dy16, dt, (size_t)N, O);
    round_grad(diag, layer, true, gb, (size_t)O, dt);
    const void *W = wsrc(w, w_off, dt, &wdt);
    rc = gpu_gemm_ex(false, false, N, K, O, dy, ddt, O, W, wdt, K, dt, GPU_GEMM_AB_CONVERTED, 0.0f,
                     dX, K, sc->g, sc->gn);
    if (rc)
        return rc;
    if (diag)
        gpu_diag_round_grad(diag, layer, false, dX, (size_t)N * K, dt);
    return 0;
}

/* Whether a linear's output gradient is read by its backward only as stored in dy_store()
 * (see linear_bwd), so that the pass making it may leave its fp32 values unwritten. */
static bool dy_only16(const gpu_gpt *m, const gpt_scratch *sc, const gpu_diag *diag)
{
    return !diag && dy_store(m, sc) != NULL;
}

/* Whether the layer norms read the stream rounded to ln_dt (an override), not the stream. */
static bool ln_rounds(const gpu_gpt *m)
{
    return m->ln_dt != GPU_FP32 && m->ln_dt != m->resid_dt;
}

/* The layer norm's input for n floats of the stream x: x itself, or its values rounded to
 * ln_dt in tmp. */
static const float *ln_input(const gpu_gpt *m, const float *x, size_t n, float *tmp)
{
    if (!ln_rounds(m))
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
 * that takes no work, else a converted copy in buf (on the calling thread). */
static const float *saved_as(const gpu_gpt *m, const uint8_t *src, size_t n, gpu_dtype dt,
                             float *buf)
{
    if (m->lin_dt == GPU_FP32 && dt == GPU_FP32)
        return (const float *)src;
    gpu_cvt_to_f32(buf, src, m->lin_dt, n);
    cast(buf, n, m->lin_dt, dt);
    return buf;
}

/* saved_as for a whole tensor, chunks on every core. */
static const float *saved_par(const gpu_gpt *m, const uint8_t *src, size_t n, gpu_dtype dt,
                              float *buf)
{
    size_t es = gpu_dtype_size(m->lin_dt);
    if (m->lin_dt == GPU_FP32 && dt == GPU_FP32)
        return (const float *)src;
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK)
        saved_as(m, src + i * es, min_sz(CHUNK, n - i), dt, buf + i);
    return buf;
}

/* v (values of `from`) cast to lin_dt and saved at store, chunks on every core (the copy is
 * a no-op when v is the saved tensor itself). */
static void cast_store(const gpu_gpt *m, float *v, uint8_t *store, size_t n, gpu_dtype from)
{
    gpu_dtype lin = m->lin_dt;
    size_t es = gpu_dtype_size(lin);
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = min_sz(CHUNK, n - i);
        cast(v + i, k, from, lin);
        gpu_cvt_from_f32(store + i * es, lin, v + i, k);
    }
}

/* A layer norm on the stream x: its output cast to lin_dt and saved at store; mean and rstd
 * saved. Returns the output's fp32 values (in sc->in32, or the saved tensor itself), or NULL
 * when !f32 and the saved tensor is 16-bit (then each block passes through the stack).
 * Blocks of rows on every core, each block's passes made while it is in cache. */
static const float *ln_fwd(const gpu_gpt *m, const gpu_gpt_weights *w, const float *x, size_t g_off,
                           size_t b_off, int N, uint8_t *acts, size_t store, size_t mean,
                           size_t rstd, const gpt_scratch *sc, bool f32)
{
    int C = m->d_model, rows = row_block(C);
    const float *g = wf32(w, g_off, (size_t)C, m->ln_dt, sc->row0);
    const float *b = wf32(w, b_off, (size_t)C, m->ln_dt, sc->row1);
    float *y = f32 || m->lin_dt == GPU_FP32 ? out_for(m, acts, store, sc->in32) : NULL;
    float *mu = (float *)(acts + mean), *rs = (float *)(acts + rstd);
    size_t es = gpu_dtype_size(m->lin_dt);
#pragma omp parallel for schedule(static) if (big((size_t)N * C))
    for (int r = 0; r < N; r += rows) {
        int k = min_int(rows, N - r);
        size_t at = (size_t)r * C, n = (size_t)k * C;
        float tmp[CHUNK], *yb = y ? y + at : n <= CHUNK ? tmp : sc->in32 + at;
        const float *xin = ln_input(m, x + at, n, sc->qkvm + at);
        ln_rows_fwd(xin, g, b, k, C, m->ln_dt, yb, mu + r, rs + r);
        if (y) /* its fp32 values are wanted too */
            cast(yb, n, m->ln_dt, m->lin_dt);
        /* the conversion makes the cast's rounding itself (a no-op if saved) */
        gpu_cvt_from_f32(acts + store + at * es, m->lin_dt, yb, n);
    }
    return y;
}

/* Layer-norm backward from dy (a linear's input gradient, rounded here to lin_dt; modified):
 * dx written into dx (values of resid_dt, cast back from ln_dt) by blocks of rows, then the
 * weight gradients into grads by blocks of columns, on every core. */
static void ln_bwd(const gpu_gpt *m, const gpu_gpt_weights *w, float *dy, const float *x,
                   const uint8_t *acts, size_t mean, size_t rstd, size_t g_off, size_t b_off, int N,
                   float *grads, float *dx, const gpt_scratch *sc)
{
    int C = m->d_model, rows = row_block(C);
    const float *g = wf32(w, g_off, (size_t)C, m->ln_dt, sc->row0);
    const float *mu = (const float *)(acts + mean), *rs = (const float *)(acts + rstd);
    const float *xin = ln_rounds(m) ? sc->qkvm : x;
#pragma omp parallel for schedule(static) if (big((size_t)N * C))
    for (int r = 0; r < N; r += rows) {
        int k = min_int(rows, N - r);
        size_t at = (size_t)r * C, n = (size_t)k * C;
        rnd(dy + at, n, m->lin_dt);
        cast(dy + at, n, m->lin_dt, m->ln_dt);
        ln_input(m, x + at, n, sc->qkvm + at);
        ln_rows_dx(dy + at, xin + at, mu + r, rs + r, g, k, C, m->ln_dt, dx + at);
        cast(dx + at, n, m->ln_dt, m->resid_dt);
    }
    ln_grads(dy, xin, mu, rs, N, C, m->ln_dt, grads + g_off, grads + b_off);
}

/* Whether the linears read the stream's gradient rounded to lin_dt, not the gradient. */
static bool lin_rounds(const gpu_gpt *m)
{
    return m->lin_dt != GPU_FP32 && m->lin_dt != m->resid_dt;
}

/* dres = rd(dres + dx, resid_dt): the stream's two gradient contributions summed; and, with
 * lin not NULL, the sum rounded to lin_dt into lin (the add's gradient handed to its lin_dt
 * input) and stored in lin_dt at dy_store() for the linear that reads it, in the same pass.
 * Chunks on every core. */
static void resid_acc(const gpu_gpt *m, const gpt_scratch *sc, const float *dx, size_t n,
                      float *lin)
{
    float *dres = sc->dres;
    char *lin16 = lin ? dy_store(m, sc) : NULL;
    size_t es = gpu_dtype_size(m->lin_dt);
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = min_sz(CHUNK, n - i);
        add_row(dres + i, dx + i, (int)k);
        rnd(dres + i, k, m->resid_dt);
        if (lin)
            gpu_round_n(lin + i, dres + i, k, m->lin_dt);
        if (lin16)
            gpu_cvt_from_f32(lin16 + i * es, m->lin_dt, lin + i, k);
    }
}

/* The stream's gradient as the linears read it: sc->dres, or its rounding to lin_dt, which
 * resid_acc (or the backward, for the last block) leaves in sc->big. */
static const float *dres_lin(const gpu_gpt *m, const gpt_scratch *sc)
{
    return lin_rounds(m) ? sc->big : sc->dres;
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
 * store, chunk by chunk so that each chunk is read from memory once; chunks on every core.
 * g NULL: only the saved values are wanted (each chunk passes through the stack). */
static void gelu_fwd_chunked(const gpu_gpt *m, const float *u, float *g, uint8_t *store, size_t n)
{
    gpu_dtype lin = m->lin_dt, dt = m->gelu_dt;
    size_t es = gpu_dtype_size(lin);
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = min_sz(CHUNK, n - i);
        float tmp[CHUNK], out[CHUNK], *gc = g ? g + i : out;
        const float *in = u + i;
        if (dt != GPU_FP32 && dt != lin) { /* the cast into GELU's dtype */
            gpu_round_n(tmp, in, k, dt);
            in = tmp;
        }
        if (!g && dt == lin) { /* only stored: the conversion makes GELU's rounding */
            gelu_kernel(out, in, k);
            gpu_cvt_from_f32(store + i * es, lin, out, k);
            continue;
        }
        gelu_chunk(gc, in, k, dt);
        cast(gc, k, dt, lin);
        gpu_cvt_from_f32(store + i * es, lin, gc, k); /* no-op when g is the saved tensor */
    }
}

/* d (mlp.proj's input gradient, rounded here to lin_dt: the gradient at GELU's output cast to
 * lin_dt) becomes the gradient at mlp.fc's output, chunk by chunk: through the cast, GELU's
 * backward in gelu_dt from the saved input, and the cast back, also stored in lin_dt at
 * dy_store() for mlp.fc's backward (only there with only16: d is then left as it came);
 * chunks on every core. */
static void gelu_bwd_chunked(const gpu_gpt *m, const gpt_scratch *sc, float *d,
                             const uint8_t *saved_u, size_t n, bool only16)
{
    gpu_dtype lin = m->lin_dt, dt = m->gelu_dt;
    size_t es = gpu_dtype_size(lin);
    char *d16 = dy_store(m, sc);
#pragma omp parallel for schedule(static) if (big(n))
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t k = min_sz(CHUNK, n - i);
        float tmp[CHUNK], out[CHUNK], *g = only16 ? out : d + i;
        gpu_round_n(g, d + i, k, lin);
        cast(g, k, lin, dt);
        gelu_grad_kernel(g, saved_as(m, saved_u + i * es, k, dt, tmp), k);
        rnd(g, k, dt);
        cast(g, k, dt, lin);
        if (d16)
            gpu_cvt_from_f32(d16 + i * es, lin, g, k);
    }
}

/* Block l's saved qkv where the heads may read it as stored: 16-bit lin_dt equal to mm_dt,
 * materialised attention; else NULL. */
static const uint16_t *qkv_saved16(const gpu_gpt *m, const uint8_t *acts, int l)
{
    if (m->flash || m->mm_dt == GPU_FP32 || m->mm_dt != m->lin_dt)
        return NULL;
    return (const uint16_t *)(const void *)(acts + m->act[l].qkv);
}

/* qkv_saved16 where the heads may multiply it as it is stored: natively, as planned
 * (dy_copy: the backward's heads store dqkv in the planned copy); else NULL. */
static const uint16_t *qkv16_of(const gpu_gpt *m, const uint8_t *acts, int l)
{
    if (!m->dy_copy || !gpu_gemm_in_place(m->mm_dt))
        return NULL;
    return qkv_saved16(m, acts, l);
}

/* The attention of block l on its qkv (values of lin_dt): y (values of lin_dt) written and
 * saved. */
static int attention_fwd(const gpu_gpt *m, int l, int B, const float *qkv, uint8_t *acts,
                         const gpt_scratch *sc, gpu_diag *diag)
{
    const gpu_gpt_block_acts *A = &m->act[l];
    int T = m->seq_len, C = m->d_model, rc;
    size_t nC = (size_t)B * T * C;
    const float *q = qkv;
    if (m->mm_dt != GPU_FP32 && m->mm_dt != m->lin_dt) {
        round_par(sc->qkvm, qkv, 3 * nC, m->mm_dt, NULL);
        q = sc->qkvm;
    }
    float *y = out_for(m, acts, A->atty, sc->aty);
    const uint16_t *qkv16 = qkv16_of(m, acts, l);
    attn_store st = {qkv16, (uint16_t *)(void *)(acts + A->atty), NULL};
    int dsc = dlayer(diag, l, "attn.scores", m->mm_dt); /* flash: its slot, no counts */
    if (m->flash)
        rc = gpu_gpt_flash_fwd(q, B, T, C, m->n_head, m->mm_dt, actf(acts, A->probs), y, sc->att,
                               m->attn_slots);
    else
        rc = gpt_attn_fwd16(q, qkv16 ? &st : NULL, B, T, C, m->n_head, m->mm_dt, m->sm_dt,
                            actf(acts, A->probs), y, sc->att, m->attn_slots, diag, dsc);
    if (rc)
        return rc;
    if (!qkv16) /* else the heads stored it */
        cast_store(m, y, acts + A->atty, nC, m->mm_dt);
    return 0;
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

    /* attention; attn.proj's rows also make the residual add */
    bool f32 = lin_io_dt(m) == GPU_FP32; /* the linears' inputs are also needed in fp32 */
    const float *a = ln_fwd(m, w, hin, P->ln1_w, P->ln1_b, N, acts, A->ln1, A->ln1_mean,
                            A->ln1_rstd, sc, f32);
    float *qkv = out_for(m, acts, A->qkv, sc->big);
    rc = linear_fwd(m, w, a, acts + A->ln1, N, C, 3 * C, P->qkv_w, P->qkv_b, qkv,
                    &(lin_out){acts + A->qkv, NULL, NULL, qkv16_of(m, acts, l) != NULL}, sc, diag,
                    dlayer(diag, l, "attn.qkv", lin));
    if (!rc)
        rc = attention_fwd(m, l, B, qkv, acts, sc, diag);
    if (!rc)
        rc = linear_fwd(m, w, out_for(m, acts, A->atty, sc->aty), acts + A->atty, N, C, C,
                        P->proj_w, P->proj_b, sc->big, &(lin_out){NULL, hin, hmid, false}, sc, diag,
                        dlayer(diag, l, "attn.proj", lin));
    if (rc)
        return rc;

    /* MLP; mlp.proj's rows also make the residual add */
    a = ln_fwd(m, w, hmid, P->ln2_w, P->ln2_b, N, acts, A->ln2, A->ln2_mean, A->ln2_rstd, sc,
               f32);
    float *u = out_for(m, acts, A->fc, sc->big);
    rc = linear_fwd(m, w, a, acts + A->ln2, N, C, 4 * C, P->fc_w, P->fc_b, u,
                    &(lin_out){acts + A->fc, NULL, NULL, false}, sc, diag,
                    dlayer(diag, l, "mlp.fc", lin));
    if (rc)
        return rc;
    float *g = f32 ? out_for(m, acts, A->gelu, sc->in32) : NULL;
    gelu_fwd_chunked(m, u, g, acts + A->gelu, n4);
    return linear_fwd(m, w, g, acts + A->gelu, N, 4 * C, C, P->mproj_w, P->mproj_b, sc->big,
                      &(lin_out){NULL, hmid, actf(acts, block_out(m, l)), false}, sc, diag,
                      dlayer(diag, l, "mlp.proj", lin));
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
    gpu_gpt_embed_fwd(x, B, T, C, wte, wpe, edt, m->resid_dt, actf(acts, m->act[0].resid), NULL);
    for (int l = 0; l < m->n_layer; l++) {
        rc = block_fwd(m, w, l, B, acts, &sc, diag);
        if (rc)
            return rc;
    }
    const float *a = ln_fwd(m, w, actf(acts, m->resid_final), m->lnf_w, m->lnf_b, N, acts, m->lnf,
                            m->lnf_mean, m->lnf_rstd, &sc, true);
    wte = wsrc(w, m->wte, m->lin_dt, &wdt);
    rc = gpu_gpt_head_fwd(a, wte, wdt, y, N, C, m->vocab, m->lin_dt, m->ce_dt, sc.big,
                          actf(acts, m->probs), sc.g, diag, dlayer(diag, -1, "lm_head", m->lin_dt),
                          &sum, correct);
    if (rc)
        return rc;
    *loss = sum / N;
    return 0;
}

/* The attention's backward of block l from sc->aty (attn.proj's input gradient, rounded
 * here, or by the heads as they store it in mm_dt): dqkv, values of lin_dt, written to
 * sc->dqkv, or with *stored set only stored in lin_dt at dy_store() (the heads store it
 * there where they run natively, without diagnostics: dy_only16). */
static int attention_bwd(const gpu_gpt *m, int l, int B, const uint8_t *acts,
                         const gpt_scratch *sc, gpu_diag *diag, bool *stored)
{
    const gpu_gpt_block_acts *A = &m->act[l];
    int T = m->seq_len, C = m->d_model, rc;
    size_t nC = (size_t)B * T * C;
    gpu_dtype lin = m->lin_dt;
    const uint16_t *qkv16 = qkv16_of(m, acts, l);
    const uint16_t *wide = qkv16 ? NULL : qkv_saved16(m, acts, l); /* the heads widen it */
    attn_store st = {qkv16, dy_only16(m, sc, diag) ? dy_store(m, sc) : NULL, wide};
    *stored = qkv16 && st.out;
    if (!qkv16) /* the heads round their slices as they store them */
        rnd_cast_par(sc->aty, nC, lin, m->mm_dt);
    const float *qkv = qkv16 || wide ? NULL /* the heads take the stored qkv */
                                     : saved_par(m, acts + A->qkv, 3 * nC, m->mm_dt, sc->qkvm);
    int dsc = dlayer(diag, l, "attn.scores", m->mm_dt);
    if (m->flash)
        rc = gpu_gpt_flash_bwd(sc->aty, qkv, saved_par(m, acts + A->atty, nC, lin, sc->in32),
                               cactf(acts, A->probs), B, T, C, m->n_head, m->mm_dt, sc->dqkv,
                               sc->att, diag ? 1 : m->attn_slots, diag, dsc);
    else
        rc = gpt_attn_bwd16(sc->aty, qkv, qkv16 || wide ? &st : NULL, cactf(acts, A->probs), B,
                            T, C, m->n_head, m->mm_dt, m->sm_dt, sc->dqkv, sc->att, m->attn_slots,
                            diag, dsc);
    if (rc)
        return rc;
    cast_par(sc->dqkv, 3 * nC, m->mm_dt, lin);
    return 0;
}

/* One block's backward: sc->dres holds the gradient of the block's output on entry (and
 * dres_lin its rounding to lin_dt) and of its input on return (with its rounding in sc->big
 * when lin_next). */
static int block_bwd(const gpu_gpt *m, const gpu_gpt_weights *w, int l, int B, const uint8_t *acts,
                     const gpt_scratch *sc, gpu_diag *diag, float *grads, bool lin_next)
{
    const gpu_gpt_block *P = &m->blk[l];
    const gpu_gpt_block_acts *A = &m->act[l];
    int T = m->seq_len, C = m->d_model, N = B * T, rc;
    size_t nC = (size_t)N * C, n4 = 4 * nC;
    gpu_dtype lin = m->lin_dt;
    float *dlin = lin_rounds(m) ? sc->big : NULL;
    bool stored = dy_store(m, sc) != NULL, dlin_stored = stored && dlin;

    /* MLP: the add hands dres to mlp.proj's output */
    rc = linear_bwd(m, w, dres_lin(m, sc), dlin_stored, acts + A->gelu, N, 4 * C, C, P->mproj_w,
                    P->mproj_b, grads, sc->in32, sc, diag, dlayer(diag, l, "mlp.proj", lin));
    if (rc)
        return rc;
    gelu_bwd_chunked(m, sc, sc->in32, acts + A->fc, n4, dy_only16(m, sc, diag));
    rc = linear_bwd(m, w, sc->in32, stored, acts + A->ln2, N, C, 4 * C, P->fc_w, P->fc_b, grads,
                    sc->big, sc, diag, dlayer(diag, l, "mlp.fc", lin));
    if (rc)
        return rc;
    ln_bwd(m, w, sc->big, cactf(acts, A->resid_mid), acts, A->ln2_mean, A->ln2_rstd, P->ln2_w,
           P->ln2_b, N, grads, sc->aty, sc);
    resid_acc(m, sc, sc->aty, nC, dlin);

    /* attention */
    rc = linear_bwd(m, w, dres_lin(m, sc), dlin_stored, acts + A->atty, N, C, C, P->proj_w,
                    P->proj_b, grads, sc->aty, sc, diag, dlayer(diag, l, "attn.proj", lin));
    bool dqkv_stored = false;
    if (!rc)
        rc = attention_bwd(m, l, B, acts, sc, diag, &dqkv_stored);
    if (!rc)
        rc = linear_bwd(m, w, sc->dqkv, dqkv_stored, acts + A->ln1, N, C, 3 * C, P->qkv_w,
                        P->qkv_b, grads, sc->big, sc, diag, dlayer(diag, l, "attn.qkv", lin));
    if (rc)
        return rc;
    ln_bwd(m, w, sc->big, cactf(acts, A->resid), acts, A->ln1_mean, A->ln1_rstd, P->ln1_w, P->ln1_b,
           N, grads, sc->aty, sc);
    resid_acc(m, sc, sc->aty, nC, lin_next ? dlin : NULL);
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
    if (lin_rounds(m)) /* the last block reads it from sc.big (dres_lin), and stored */
        round_par(sc.big, sc.dres, nC, m->lin_dt, dy_store(m, &sc));
    for (int l = m->n_layer - 1; l >= 0; l--) {
        rc = block_bwd(m, w, l, B, acts, &sc, diag, grads, l > 0);
        if (rc)
            return rc;
        gpu_gpt_block_done(m, l, ready);
    }
    /* the embedding: its output was held in resid_dt; it ran in emb_dt */
    cast_par(sc.dres, nC, m->resid_dt, m->emb_dt);
    memset(grads + m->wpe, 0, sizeof(float) * (size_t)T * C);
    gpu_gpt_embed_bwd(x, B, T, C, sc.dres, grads + m->wte, grads + m->wpe);
    gpu_grad_done(ready, m->wpe, (size_t)T * C);
    gpu_grad_done(ready, m->wte, (size_t)m->vocab * C);
    return 0;
}
