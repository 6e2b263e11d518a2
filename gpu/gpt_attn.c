/*
 * gpt_attn.c - the GPT's causal multi-head attention, forward and backward: materialised
 * (nanoGPT's non-flash attention; the softmax's probabilities saved) and flash
 * (FlashAttention-2's numerics; the row log-sum-exp saved and P recomputed). The numerics
 * of each are gpu/gpt.c's top comment and gpu/gpt.h's; the model's passes call these
 * through gpu/gpt_int.h, the tests through gpu/gpt.h.
 *
 * Invariants: masked positions (j > i) are never part of any arithmetic; every head's
 * values come from the same operations in the same order whatever the number of threads.
 * Threads: the (sequence, head) pairs run side by side, one per thread with its own slot
 * of scratch, when the caller's slots allow (each_head); else in order, each GEMM and row
 * pass on the whole OpenMP team. Diagnostics run with one slot.
 */
#include <math.h>
#include <string.h>

#include "gpu/diag.h"
#include "gpu/gpt.h"
#include "gpu/gpt_int.h"
#include "gpu/gpu_int.h"

/* ---- causal multi-head attention -------------------------------------------------------- */

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

/* ---- bf16 rows, rounded inline ---------------------------------------------------------
 * The attention's rows are short (T values), and a call of gpu_round_n or gpu_cvt_from_f32
 * per rounding of a row costs more than the rounding. These round to bf16 in the loop
 * itself, with the conversion's own rounding (gpu_fmt_bf16_round): the same values. */

INLINE float bf16_rd(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = gpu_fmt_bf16_round(u);
    memcpy(&x, &u, sizeof x);
    return x;
}

HOT static void bf16_rd_row(float *restrict v, int n)
{
    for (int j = 0; j < n; j++)
        v[j] = bf16_rd(v[j]);
}

/* v = rd(rd(v) * scale): a GEMM output rounded, then scaled in bf16. */
HOT static void bf16_scale_row(float *restrict v, float scale, int n)
{
    for (int j = 0; j < n; j++)
        v[j] = bf16_rd(bf16_rd(v[j]) * scale);
}

/* See gpu/gpt.h. */
size_t gpu_gpt_attention_scratch_floats(int T, int hd, gpu_dtype mm_dt, int slots)
{
    size_t most = 0;
    for (int i = 0; i < 2; i++) { /* operands in fp32, or stored in mm_dt */
        gpu_dtype dt = i == 0 ? GPU_FP32 : mm_dt;
        size_t qk = gpu_gemm_ex_scratch_floats(T, T, hd, dt, dt, mm_dt, 0);
        size_t pv = gpu_gemm_ex_scratch_floats(T, hd, T, dt, dt, mm_dt, 0);
        most = qk > most ? qk : most;
        most = pv > most ? pv : most;
    }
    size_t per = 2 * align16f((size_t)T * (size_t)T) + 4 * align16f((size_t)T * (size_t)hd) +
                 align16f(most);
    return (size_t)(slots > 1 ? slots : 1) * per;
}

/* A head's slot: two T x T regions, 3 T x hd floats for its Q, K and V widened densely to
 * fp32 or (the first 2 T x hd) its Q, K, V and dY stored densely in mm_dt, then its GEMMs'
 * scratch (a dense T x hd output first where one is needed). */
static float *head_dense(float *slot, int T)
{
    return slot + 2 * align16f((size_t)T * (size_t)T);
}

static uint16_t *head_dense16(float *slot, int T)
{
    return (uint16_t *)(void *)head_dense(slot, T);
}

/* A GEMM's scratch and its length in floats. */
typedef struct {
    float *p;
    size_t n;
} gemm_space;

static gemm_space head_gemm_scratch(float *slot, int T, int hd, gpu_dtype mm_dt)
{
    size_t before = 2 * align16f((size_t)T * (size_t)T) + 3 * align16f((size_t)T * (size_t)hd);
    return (gemm_space){slot + before,
                        gpu_gpt_attention_scratch_floats(T, hd, mm_dt, 1) - before};
}

/* gs less a dense M x N output at its start. */
static gemm_space after_dense(gemm_space gs, int M, int N)
{
    size_t d = align16f((size_t)M * (size_t)N);
    return d <= gs.n ? (gemm_space){gs.p + d, gs.n - d} : (gemm_space){NULL, 0};
}

/* The head's n blocks of T x hd 16-bit values, ld apart in rows and C apart from each other
 * (Q, K, V of qkv), copied densely to dst: the native kernels take no strided operand. */
static void head_copy16(uint16_t *dst, const uint16_t *src, int n, int T, int hd, size_t ld,
                        size_t C)
{
    for (int b = 0; b < n; b++)
        for (int i = 0; i < T; i++)
            memcpy(dst + ((size_t)b * T + i) * hd, src + b * C + (size_t)i * ld,
                   sizeof(uint16_t) * (size_t)hd);
}

/* A head's product in mm_dt: every operand holds values of mm_dt (fp32, or stored in
 * mm_dt), so the library may take them in it: bf16 natively, fp32 operands converted
 * densely first. There an output inside wider rows (a head's columns of y or dqkv) is made
 * dense in gs and copied there: the native kernels take no padded output. Elsewhere fp32
 * operands are read where they are (OpenBLAS takes the strided ones). A 16-bit operand is
 * always what the conversions wrote (P, dS, dY here, Q, K, V copied from the stored qkv). */
static int head_mm(bool ta, bool tb, int M, int N, int K, const void *A, gpu_dtype adt,
                   int lda, const void *B, gpu_dtype bdt, int ldb, gpu_dtype mm_dt, float *C,
                   int ldc, gemm_space gs)
{
    bool native = mm_dt != GPU_FP32 && gpu_gemm_in_place(mm_dt);
    float *dense = ldc == N || !native ? C : gs.p;
    gemm_space rest = dense == C ? gs : after_dense(gs, M, N);
    if (dense != C && rest.p == NULL) /* no room for the dense output */
        return GPU_ESCRATCH;
    int rc = gpu_gemm_ex(ta, tb, M, N, K, A, adt, lda, B, bdt, ldb, mm_dt,
                         GPU_GEMM_AB_CONVERTED, 0.0f, dense, dense == C ? ldc : N, rest.p,
                         rest.n);
    for (int i = 0; rc == 0 && dense != C && i < M; i++)
        memcpy(C + (size_t)i * ldc, dense + (size_t)i * N, sizeof(float) * (size_t)N);
    return rc;
}

/* head_mm of a head's output block inside wider rows (ldc > N) on the native path, stored
 * in mm_dt into c16's rows as it is copied out of the dense product: one pass for the copy,
 * the rounding and the store. */
static int head_mm_out(bool ta, bool tb, int M, int N, int K, const void *A, gpu_dtype adt,
                       int lda, const void *B, gpu_dtype bdt, int ldb, gpu_dtype mm_dt,
                       uint16_t *c16, int ldc, gemm_space gs)
{
    gemm_space rest = after_dense(gs, M, N);
    if (rest.p == NULL) /* no room for the dense output */
        return GPU_ESCRATCH;
    int rc = gpu_gemm_ex(ta, tb, M, N, K, A, adt, lda, B, bdt, ldb, mm_dt,
                         GPU_GEMM_AB_CONVERTED, 0.0f, gs.p, N, rest.p, rest.n);
    if (rc == 0)
        gpu_cvt_rows_from_f32(c16, mm_dt, (size_t)ldc, gs.p, (size_t)N, (size_t)M, (size_t)N);
    return rc;
}

/* head_mm on fp32 operands (values of mm_dt). */
static int head_gemm(bool ta, bool tb, int M, int N, int K, const float *A, int lda,
                     const float *B, int ldb, gpu_dtype mm_dt, float *C, int ldc,
                     gemm_space gs)
{
    return head_mm(ta, tb, M, N, K, A, GPU_FP32, lda, B, GPU_FP32, ldb, mm_dt, C, ldc, gs);
}

/* One sequence and head's share of an attention pass: its slot of scratch and whether its
 * row passes may start their own team (only when the heads run in order). */
typedef int (*head_fn)(const void *ctx, int b, int h, float *scratch, bool par_rows);

/* fn for every sequence b < B and head h < H. With slots > 1 the heads are shared out to
 * that many threads, each with its own slot of scratch (per floats), and each head's GEMMs
 * and rows run on its thread; else the heads run in order, every GEMM and row pass on the
 * whole team. Either way each head computes the same values. Returns the first error. */
static int each_head(int B, int H, int slots, size_t per, float *scratch, head_fn fn,
                     const void *ctx)
{
    int tasks = B * H, rc = 0;
    if (slots <= 1 || tasks == 1) {
        for (int t = 0; t < tasks && rc == 0; t++)
            rc = fn(ctx, t / H, t % H, scratch, true);
        return rc;
    }
#pragma omp parallel num_threads(slots < tasks ? slots : tasks)
    {
        float *mine = scratch + per * (size_t)team_rank();
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) {
            int r = fn(ctx, t / H, t % H, mine, false);
            if (r != 0) {
#pragma omp atomic write
                rc = r;
            }
        }
    }
    return rc;
}

static float attn_scale(int hd)
{
    return (float)(1.0 / sqrt((double)hd));
}

/* Whether the rows of one sequence and head's T x T scores are worth a team of threads (a
 * row's work is a few exps per entry, so a quarter of PAR_MIN). */
static __attribute__((unused)) bool big_rows(int T)
{
    return (size_t)T * (size_t)T >= PAR_MIN / 4;
}

/* The raw scores' rounding, scaling and cast for the softmax, over n values: a row's causal
 * entries, or a head's whole T x T block at once (one pass instead of calls per short row;
 * the masked entries it also changes are never read). */
static void scores_fwd(float *s, size_t n, float scale, gpu_dtype mm_dt, gpu_dtype sm_dt)
{
    rnd(s, n, mm_dt);
    scale_n(s, scale, n);
    rnd(s, n, mm_dt);
    cast(s, n, mm_dt, sm_dt);
}

/* Row i's softmax from its scores s (n = i + 1 causal entries, ready for it) into p, 0 above
 * the diagonal, rounded to sm_dt. Masked scores are never read. */
static void probs_row(const float *s, float *p, int n, int T, gpu_dtype sm_dt)
{
    softmax_row(s, n, p);
    memset(p + n, 0, sizeof(float) * (size_t)(T - n));
    rnd(p, (size_t)n, sm_dt);
}

/* Row i of the attention's forward from the raw scores s (rows of T): scores_fwd on its
 * causal entries, then probs_row. */
static void attn_row_fwd(float *s, float *p, int n, int T, float scale, gpu_dtype mm_dt,
                         gpu_dtype sm_dt)
{
    scores_fwd(s, (size_t)n, scale, mm_dt, sm_dt);
    probs_row(s, p, n, T, sm_dt);
}

/* attn_row_fwd of the native heads (16-bit mm_dt); with bf16 and the softmax in fp32
 * (autocast's default), in fused loops. */
static void attn_row_fwd16(float *s, float *p, int n, int T, float scale, gpu_dtype mm_dt,
                           gpu_dtype sm_dt)
{
    if (mm_dt != GPU_BF16 || sm_dt != GPU_FP32) {
        attn_row_fwd(s, p, n, T, scale, mm_dt, sm_dt);
        return;
    }
    bf16_scale_row(s, scale, n);
    softmax_row(s, n, p);
    memset(p + n, 0, sizeof(float) * (size_t)(T - n));
}

/* P cast to mm_dt for a matmul (pm), or P itself when that takes no rounding. */
static const float *p_for_mm(const float *P, float *pm, size_t n, gpu_dtype mm_dt,
                             gpu_dtype sm_dt)
{
    if (mm_dt == GPU_FP32 || mm_dt == sm_dt)
        return P;
    round_par(pm, P, n, mm_dt, NULL);
    return pm;
}

/* The arguments of one attention pass, shared by its heads. */
typedef struct {
    const float *qkv, *dy, *probs, *o, *lse;
    const uint16_t *qkv16; /* qkv stored in mm_dt, multiplied as it is (NULL: qkv in fp32) */
    const uint16_t *qkv_w; /* qkv stored in mm_dt, each head widening its own slices (the
                            * backward's heads where qkv16 is NULL; NULL: qkv in fp32) */
    uint16_t *out16;       /* with qkv16: y, or without diag dqkv, stored there in mm_dt
                            * and only there (NULL: dqkv written in fp32, for diag) */
    float *P, *y, *dqkv, *L;
    int T, C, H;
    gpu_dtype mm_dt, sm_dt;
    gpu_diag *diag;
    int layer;
} attn_args;

/* Round `rows` rows of w floats, ld apart, to dt: a head's block of an output, in cache
 * right after its GEMM (instead of a sweep over the whole output). */
static void rnd_block(float *v, int rows, int w, size_t ld, gpu_dtype dt)
{
    for (int i = 0; dt == GPU_BF16 && i < rows; i++)
        bf16_rd_row(v + (size_t)i * ld, w);
    if (dt == GPU_FP16)
        gpu_round_rows(v, ld, v, ld, (size_t)rows, (size_t)w, dt);
}

/* The head's output y (T rows of hd at yh) rounded to mm_dt after its GEMM returned rc. */
static int head_y_done(const attn_args *a, int rc, float *yh)
{
    if (rc == 0)
        rnd_block(yh, a->T, a->C / a->H, (size_t)a->C, a->mm_dt);
    return rc;
}

/* The head's dQ, dK and dV (T rows of hd at dq, dq + C, dq + 2C) rounded to mm_dt after
 * its GEMMs returned rc; with diag, the pass rounds them after diag_dqk has seen them. */
static int head_dqkv_done(const attn_args *a, int rc, float *dq)
{
    for (int k = 0; rc == 0 && !a->diag && k < 3; k++)
        rnd_block(dq + (size_t)k * a->C, a->T, a->C / a->H, 3 * (size_t)a->C, a->mm_dt);
    return rc;
}

/* The head's causal scores S (T x T), accounted to the diagnostics when they are on. */
static void diag_scores(const attn_args *a, const float *S)
{
    for (int i = 0; a->diag && i < a->T; i++)
        gpu_diag_forward(a->diag, a->layer, S + (size_t)i * a->T, (size_t)i + 1);
}

static int attn_head_fwd(const void *ctx, int b, int h, float *scratch, bool par_rows)
{
    (void)par_rows; /* read only by the pragmas, which a build without OpenMP drops */
    const attn_args *a = ctx;
    int T = a->T, C = a->C, hd = C / a->H, ld = 3 * C;
    size_t TT = (size_t)T * T;
    float scale = attn_scale(hd), *S = scratch;
    float *Pm = a->mm_dt != GPU_FP32 && a->mm_dt != a->sm_dt ? scratch + align16f(TT) : NULL;
    const float *q = a->qkv + (size_t)b * T * ld + (size_t)h * hd;
    const float *k = q + C, *v = q + 2 * C;
    float *P = a->P + ((size_t)b * a->H + h) * TT;
    gemm_space gs = head_gemm_scratch(scratch, T, hd, a->mm_dt);
    int rc = head_gemm(false, true, T, T, hd, q, ld, k, ld, a->mm_dt, S, T, gs);
    if (rc)
        return rc;
    diag_scores(a, S);
    scores_fwd(S, TT, scale, a->mm_dt, a->sm_dt);
#pragma omp parallel for schedule(static, 1) if (par_rows && big_rows(T))
    for (int i = 0; i < T; i++)
        probs_row(S + (size_t)i * T, P + (size_t)i * T, i + 1, T, a->sm_dt);
    if (Pm)
        gpu_round_n(Pm, P, TT, a->mm_dt);
    float *yh = a->y + (size_t)b * T * C + (size_t)h * hd;
    rc = head_gemm(false, false, T, hd, T, Pm ? Pm : P, T, v, ld, a->mm_dt, yh, C, gs);
    return head_y_done(a, rc, yh);
}

/* attn_head_fwd on qkv stored in mm_dt (qkv16), which the GEMMs take as it is: P is stored
 * in mm_dt after its row pass (the rounding of P to mm_dt, one call for the block). */
static int attn_head_fwd16(const void *ctx, int b, int h, float *scratch, bool par_rows)
{
    (void)par_rows;
    const attn_args *a = ctx;
    int T = a->T, C = a->C, hd = C / a->H, ld = 3 * C;
    size_t TT = (size_t)T * T;
    gpu_dtype dt = a->mm_dt;
    float scale = attn_scale(hd), *S = scratch;
    gemm_space gs = head_gemm_scratch(scratch, T, hd, dt);
    uint16_t *Pd = (uint16_t *)(void *)(scratch + align16f(TT)), *q = head_dense16(scratch, T);
    size_t th = (size_t)T * hd;
    float *P = a->P + ((size_t)b * a->H + h) * TT;
    head_copy16(q, a->qkv16 + (size_t)b * T * ld + (size_t)h * hd, 3, T, hd, ld, C);
    int rc = head_mm(false, true, T, T, hd, q, dt, hd, q + th, dt, hd, dt, S, T, gs);
    if (rc)
        return rc;
    diag_scores(a, S);
#pragma omp parallel for schedule(static, 1) if (par_rows && big_rows(T))
    for (int i = 0; i < T; i++)
        attn_row_fwd16(S + (size_t)i * T, P + (size_t)i * T, i + 1, T, scale, dt, a->sm_dt);
    gpu_cvt_from_f32(Pd, dt, P, TT);
    size_t yo = (size_t)b * T * C + (size_t)h * hd;
    /* attn.proj reads only the stored y */
    return head_mm_out(false, false, T, hd, T, Pd, dt, T, q + 2 * th, dt, hd, dt,
                       a->out16 + yo, C, gs);
}

/* See gpu/gpt_int.h. */
int gpt_attn_fwd16(const float *qkv, const attn_store *st, int B, int T, int C, int H,
                   gpu_dtype mm_dt, gpu_dtype sm_dt, float *probs, float *y, float *scratch,
                   int slots, gpu_diag *diag, int layer)
{
    const uint16_t *qkv16 = st ? st->qkv : NULL;
    attn_args a = {.qkv = qkv, .qkv16 = qkv16, .out16 = st ? st->out : NULL, .P = probs, .y = y,
                   .T = T, .C = C, .H = H, .mm_dt = mm_dt, .sm_dt = sm_dt, .diag = diag,
                   .layer = layer};
    size_t per = gpu_gpt_attention_scratch_floats(T, C / H, mm_dt, 1);
    return each_head(B, H, diag ? 1 : slots, per, scratch,
                     qkv16 ? attn_head_fwd16 : attn_head_fwd, &a);
}

/* See gpu/gpt.h. */
int gpu_gpt_attention_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype mm_dt,
                          gpu_dtype sm_dt, float *probs, float *y, float *scratch, int slots,
                          gpu_diag *diag, int layer)
{
    return gpt_attn_fwd16(qkv, NULL, B, T, C, H, mm_dt, sm_dt, probs, y, scratch, slots, diag,
                          layer);
}

/* dQ and dK (the first 2C of each row of dqkv [rows x 3C]), the score matmul's input
 * gradients before rounding, accounted for layer, then dqkv rounded to mm_dt (without diag
 * each head rounds its own). */
static void diag_dqk(gpu_diag *diag, int layer, float *dqkv, size_t rows, int C, gpu_dtype mm_dt)
{
    if (!diag)
        return;
    for (size_t r = 0; r < rows; r++)
        gpu_diag_input_grad(diag, layer, dqkv + r * 3 * (size_t)C, 2 * (size_t)C);
    rnd_par(dqkv, rows * 3 * (size_t)C, mm_dt);
}

/* The attention's backward in three parts, each over n values: a row's causal entries, or
 * (the first and last) a head's whole T x T block at once, as scores_fwd. dP arriving (the
 * P V matmul's output gradient) through P's cast to mm_dt: */
static void dprobs_in(float *d, size_t n, gpu_dtype mm_dt, gpu_dtype sm_dt)
{
    rnd(d, n, mm_dt);
    cast(d, n, mm_dt, sm_dt);
}

/* Row i's softmax backward (p: the saved P; n = i + 1 causal entries), 0 above the diagonal
 * (masked entries of dP are never read). */
static void dprobs_row(const float *p, float *d, int n, int T)
{
    softmax_row_bwd(p, d, n);
    memset(d + n, 0, sizeof(float) * (size_t)(T - n));
}

/* dS leaving for Q K^T's output: rounded to sm_dt, through S's cast to sm_dt and the scaling
 * in mm_dt. */
static void dscores_out(float *d, size_t n, float scale, gpu_dtype mm_dt, gpu_dtype sm_dt)
{
    rnd(d, n, sm_dt);
    cast(d, n, sm_dt, mm_dt);
    scale_n(d, scale, n);
    rnd(d, n, mm_dt);
}

/* Row i of the attention's backward: dP (d, n = i + 1 causal entries) becomes dS arriving
 * at Q K^T's output. */
static void attn_row_bwd(const float *p, float *d, int n, int T, float scale, gpu_dtype mm_dt,
                         gpu_dtype sm_dt)
{
    dprobs_in(d, (size_t)n, mm_dt, sm_dt);
    dprobs_row(p, d, n, T);
    dscores_out(d, (size_t)n, scale, mm_dt, sm_dt);
}

/* attn_row_bwd of the native heads, fused as attn_row_fwd16. */
static void attn_row_bwd16(const float *p, float *d, int n, int T, float scale, gpu_dtype mm_dt,
                           gpu_dtype sm_dt)
{
    if (mm_dt != GPU_BF16 || sm_dt != GPU_FP32) {
        attn_row_bwd(p, d, n, T, scale, mm_dt, sm_dt);
        return;
    }
    bf16_rd_row(d, n);
    softmax_row_bwd(p, d, n);
    memset(d + n, 0, sizeof(float) * (size_t)(T - n));
    bf16_scale_row(d, scale, n); /* the cast back to bf16, the scaling and its rounding */
}

/* The head's Q, K and V (at off in qkv_w) widened densely into its slot: T x hd each, one
 * after the other; *ld becomes hd. */
static const float *head_widened(const attn_args *a, size_t off, float *slot, int *ld)
{
    int T = a->T, hd = a->C / a->H;
    float *q = head_dense(slot, T);
    for (int i = 0; i < 3; i++)
        gpu_cvt_rows_to_f32(q + (size_t)i * T * hd, (size_t)hd,
                            a->qkv_w + off + (size_t)i * a->C, a->mm_dt, (size_t)*ld, (size_t)T,
                            (size_t)hd);
    *ld = hd;
    return q;
}

static int attn_head_bwd(const void *ctx, int b, int h, float *scratch, bool par_rows)
{
    (void)par_rows; /* read only by the pragmas, which a build without OpenMP drops */
    const attn_args *a = ctx;
    int T = a->T, C = a->C, hd = C / a->H, ld = 3 * C;
    size_t TT = (size_t)T * T, off = (size_t)b * T * ld + (size_t)h * hd;
    float scale = attn_scale(hd), *dS = scratch, *Pm = scratch + align16f(TT);
    int lq = ld; /* Q, K and V's leading dimension */
    const float *q = a->qkv_w ? head_widened(a, off, scratch, &lq) : a->qkv + off;
    size_t apart = a->qkv_w ? (size_t)T * hd : (size_t)C; /* from Q to K, and K to V */
    const float *k = q + apart, *v = k + apart;
    float *dq = a->dqkv + off, *dk = dq + C, *dv = dq + 2 * C;
    const float *dyh = a->dy + (size_t)b * T * C + (size_t)h * hd;
    const float *P = a->probs + ((size_t)b * a->H + h) * TT;
    const float *pm = p_for_mm(P, Pm, TT, a->mm_dt, a->sm_dt);
    /* dV = Pm^T dY; dP = dY V^T (both matmul outputs, rounded to mm_dt) */
    gemm_space gs = head_gemm_scratch(scratch, T, hd, a->mm_dt);
    int rc = head_gemm(true, false, T, hd, T, pm, T, dyh, C, a->mm_dt, dv, ld, gs);
    if (!rc)
        rc = head_gemm(false, true, T, T, hd, dyh, C, v, lq, a->mm_dt, dS, T, gs);
    if (rc)
        return rc;
    dprobs_in(dS, TT, a->mm_dt, a->sm_dt);
#pragma omp parallel for schedule(static, 1) if (par_rows && big_rows(T))
    for (int i = 0; i < T; i++)
        dprobs_row(P + (size_t)i * T, dS + (size_t)i * T, i + 1, T);
    dscores_out(dS, TT, scale, a->mm_dt, a->sm_dt);
    if (a->diag)
        gpu_diag_backward(a->diag, a->layer, dS, TT); /* arriving at Q K^T's output */
    /* dQ = dS K, dK = dS^T Q */
    rc = head_gemm(false, false, T, hd, T, dS, T, k, lq, a->mm_dt, dq, ld, gs);
    if (!rc)
        rc = head_gemm(true, false, T, hd, T, dS, T, q, lq, a->mm_dt, dk, ld, gs);
    return head_dqkv_done(a, rc, dq);
}

/* One of a head's dQ, dK and dV on the native path: op(X) Y (T x T by T x hd, both stored
 * densely in mm_dt) at offset off, stored in mm_dt at out16 as it is copied out (only there:
 * qkv's backward reads nothing else). With diagnostics it goes to dqkv unrounded: the pass
 * rounds it after diag_dqk has seen it. */
static int head_dq(const attn_args *a, bool tx, const uint16_t *X, const uint16_t *Y, size_t off,
                   gemm_space gs)
{
    int T = a->T, hd = a->C / a->H, ld = 3 * a->C;
    gpu_dtype dt = a->mm_dt;
    if (a->diag)
        return head_mm(tx, false, T, hd, T, X, dt, T, Y, dt, hd, dt, a->dqkv + off, ld, gs);
    return head_mm_out(tx, false, T, hd, T, X, dt, T, Y, dt, hd, dt, a->out16 + off, ld, gs);
}

/* attn_head_bwd on qkv stored in mm_dt (qkv16): P, the head's dY and dS are stored in mm_dt
 * (their roundings to it) for the GEMMs, which take every operand as it is. */
static int attn_head_bwd16(const void *ctx, int b, int h, float *scratch, bool par_rows)
{
    (void)par_rows;
    const attn_args *a = ctx;
    int T = a->T, C = a->C, hd = C / a->H, ld = 3 * C;
    size_t TT = (size_t)T * T, off = (size_t)b * T * ld + (size_t)h * hd;
    gpu_dtype dt = a->mm_dt;
    float scale = attn_scale(hd), *dS = scratch;
    gemm_space gs = head_gemm_scratch(scratch, T, hd, dt);
    uint16_t *Pd = (uint16_t *)(void *)(scratch + align16f(TT)); /* then dS in mm_dt */
    size_t th = (size_t)T * hd;
    uint16_t *q = head_dense16(scratch, T), *k = q + th, *v = k + th, *dy = v + th;
    head_copy16(q, a->qkv16 + off, 3, T, hd, ld, C);
    const float *dyh = a->dy + (size_t)b * T * C + (size_t)h * hd;
    const float *P = a->probs + ((size_t)b * a->H + h) * TT;
    gpu_cvt_from_f32(Pd, dt, P, TT);
    gpu_cvt_rows_from_f32(dy, dt, (size_t)hd, dyh, (size_t)C, (size_t)T, (size_t)hd);
    /* dV = P^T dY; dP = dY V^T */
    int rc = head_dq(a, true, Pd, dy, off + 2 * (size_t)C, gs);
    if (!rc)
        rc = head_mm(false, true, T, T, hd, dy, dt, hd, v, dt, hd, dt, dS, T, gs);
    if (rc)
        return rc;
#pragma omp parallel for schedule(static, 1) if (par_rows && big_rows(T))
    for (int i = 0; i < T; i++)
        attn_row_bwd16(P + (size_t)i * T, dS + (size_t)i * T, i + 1, T, scale, dt, a->sm_dt);
    gpu_cvt_from_f32(Pd, dt, dS, TT); /* dS in mm_dt, over P's */
    if (a->diag)
        gpu_diag_backward(a->diag, a->layer, dS, TT);
    /* dQ = dS K, dK = dS^T Q */
    rc = head_dq(a, false, Pd, k, off, gs);
    if (!rc)
        rc = head_dq(a, true, Pd, q, off + (size_t)C, gs);
    return rc;
}

/* See gpu/gpt_int.h. */
int gpt_attn_bwd16(const float *dy, const float *qkv, const attn_store *st, const float *probs,
                   int B, int T, int C, int H, gpu_dtype mm_dt, gpu_dtype sm_dt, float *dqkv,
                   float *scratch, int slots, gpu_diag *diag, int layer)
{
    const uint16_t *qkv16 = st ? st->qkv : NULL;
    attn_args a = {.qkv = qkv, .qkv16 = qkv16, .out16 = st ? st->out : NULL, .dy = dy,
                   .qkv_w = st ? st->wide : NULL, .probs = probs, .dqkv = dqkv, .T = T, .C = C,
                   .H = H, .mm_dt = mm_dt, .sm_dt = sm_dt, .diag = diag, .layer = layer};
    size_t per = gpu_gpt_attention_scratch_floats(T, C / H, mm_dt, 1);
    int rc = each_head(B, H, diag ? 1 : slots, per, scratch,
                       qkv16 ? attn_head_bwd16 : attn_head_bwd, &a);
    if (rc)
        return rc;
    diag_dqk(diag, layer, dqkv, (size_t)B * T, C, mm_dt);
    return 0;
}

/* See gpu/gpt.h. */
int gpu_gpt_attention_bwd(const float *dy, const float *qkv, const float *probs, int B, int T,
                          int C, int H, gpu_dtype mm_dt, gpu_dtype sm_dt, float *dqkv,
                          float *scratch, int slots, gpu_diag *diag, int layer)
{
    return gpt_attn_bwd16(dy, qkv, NULL, probs, B, T, C, H, mm_dt, sm_dt, dqkv, scratch, slots,
                          diag, layer);
}

/* ---- flash attention ---------------------------------------------------------------------- */

/* S = Q K^T for one sequence and head: the fp32 product (scaled by the row passes, in fp32,
 * never rounded to mm_dt). Only the causal entries are read. */
static int flash_scores(const float *q, const float *k, int T, int hd, int ld, float *S)
{
    return gpu_gemm(false, true, T, T, hd, q, GPU_FP32, ld, k, GPU_FP32, ld, 0.0f, S, T, NULL,
                    0);
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

/* Row i of the flash forward from the raw product s (n = i + 1 causal entries): scaled, its
 * softmax into p rounded to mm_dt (0 above the diagonal); returns the log-sum-exp. */
static float flash_row_fwd(float *s, float *p, int n, int T, float scale, gpu_dtype mm_dt)
{
    scale_n(s, scale, (size_t)n);
    float lse = softmax_row(s, n, p);
    memset(p + n, 0, sizeof(float) * (size_t)(T - n));
    rnd(p, (size_t)n, mm_dt);
    return lse;
}

static int flash_head_fwd(const void *ctx, int b, int h, float *scratch, bool par_rows)
{
    (void)par_rows; /* read only by the pragmas, which a build without OpenMP drops */
    const attn_args *a = ctx;
    int T = a->T, C = a->C, hd = C / a->H, ld = 3 * C;
    size_t TT = (size_t)T * T;
    float scale = attn_scale(hd), *S = scratch, *P = scratch + align16f(TT);
    const float *q = a->qkv + (size_t)b * T * ld + (size_t)h * hd;
    float *L = a->L + ((size_t)b * a->H + h) * T;
    int rc = flash_scores(q, q + C, T, hd, ld, S);
    if (rc)
        return rc;
#pragma omp parallel for schedule(static, 1) if (par_rows && big_rows(T))
    for (int i = 0; i < T; i++)
        L[i] = flash_row_fwd(S + (size_t)i * T, P + (size_t)i * T, i + 1, T, scale, a->mm_dt);
    float *yh = a->y + (size_t)b * T * C + (size_t)h * hd;
    rc = gpu_gemm(false, false, T, hd, T, P, GPU_FP32, T, q + 2 * C, GPU_FP32, ld, 0.0f, yh, C,
                  NULL, 0);
    return head_y_done(a, rc, yh);
}

/* See gpu/gpt.h. */
int gpu_gpt_flash_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype mm_dt, float *lse,
                      float *y, float *scratch, int slots)
{
    attn_args a = {.qkv = qkv, .L = lse, .y = y, .T = T, .C = C, .H = H, .mm_dt = mm_dt};
    return each_head(B, H, slots, gpu_gpt_attention_scratch_floats(T, C / H, mm_dt, 1),
                     scratch, flash_head_fwd, &a);
}

/* Row i of the flash backward's P (n = i + 1 causal entries, from the raw product p, in
 * place): scaled, exp(S - L), 0 above the diagonal; w = P rounded to mm_dt. */
static void flash_row_p(float *p, float *w, float L, int n, int T, float scale, gpu_dtype mm_dt)
{
    scale_n(p, scale, (size_t)n);
    exp_minus(p, L, n);
    memset(p + n, 0, sizeof(float) * (size_t)(T - n));
    gpu_round_n(w, p, (size_t)T, mm_dt);
}

/* Row i of the flash backward's dS from dP (d, in place): D_i = dY_i . O_i in fp32, dS =
 * P (dP - D_i) * scale, 0 above the diagonal, rounded to mm_dt. */
static void flash_row_ds(const float *dyi, const float *oi, int hd, const float *p, float *d,
                         int n, int T, float scale, gpu_dtype mm_dt)
{
    float D = 0.0f;
    for (int c = 0; c < hd; c++)
        D = fmaf(dyi[c], oi[c], D);
    flash_ds_row(p, d, D, scale, n);
    memset(d + n, 0, sizeof(float) * (size_t)(T - n));
    rnd(d, (size_t)n, mm_dt);
}

/* One sequence and head of gpu_gpt_flash_bwd: P recomputed from the saved log-sum-exp. */
static int flash_head_bwd(const void *ctx, int b, int h, float *scratch, bool par_rows)
{
    (void)par_rows; /* read only by the pragmas, which a build without OpenMP drops */
    const attn_args *a = ctx;
    int T = a->T, C = a->C, hd = C / a->H, ld = 3 * C;
    size_t TT = (size_t)T * T, off = (size_t)b * T * ld + (size_t)h * hd;
    size_t yoff = (size_t)b * T * C + (size_t)h * hd;
    const float *dyh = a->dy + yoff, *q = a->qkv + off, *oh = a->o + yoff;
    const float *L = a->lse + ((size_t)b * a->H + h) * T;
    float *dq = a->dqkv + off, scale = attn_scale(hd);
    float *P = scratch, *W = scratch + align16f(TT);
    gpu_dtype mm_dt = a->mm_dt;
    int rc = flash_scores(q, q + C, T, hd, ld, P);
    if (rc)
        return rc;
#pragma omp parallel for schedule(static, 1) if (par_rows && big_rows(T))
    for (int i = 0; i < T; i++)
        flash_row_p(P + (size_t)i * T, W + (size_t)i * T, L[i], i + 1, T, scale, mm_dt);
    /* dV = rd(P) ^T dY */
    rc = gpu_gemm(true, false, T, hd, T, W, GPU_FP32, T, dyh, GPU_FP32, C, 0.0f, dq + 2 * C, ld,
                  NULL, 0);
    if (!rc) /* dP = dY V^T, kept in fp32 */
        rc = gpu_gemm(false, true, T, T, hd, dyh, GPU_FP32, C, q + 2 * C, GPU_FP32, ld, 0.0f, W,
                      T, NULL, 0);
    if (rc)
        return rc;
#pragma omp parallel for schedule(static, 1) if (par_rows && big_rows(T))
    for (int i = 0; i < T; i++)
        flash_row_ds(dyh + (size_t)i * C, oh + (size_t)i * C, hd, P + (size_t)i * T,
                     W + (size_t)i * T, i + 1, T, scale, mm_dt);
    /* dQ = rd(dS) K, dK = rd(dS)^T Q */
    rc = gpu_gemm(false, false, T, hd, T, W, GPU_FP32, T, q + C, GPU_FP32, ld, 0.0f, dq, ld, NULL,
                  0);
    if (!rc)
        rc = gpu_gemm(true, false, T, hd, T, W, GPU_FP32, T, q, GPU_FP32, ld, 0.0f, dq + C, ld,
                      NULL, 0);
    return head_dqkv_done(a, rc, dq);
}

/* See gpu/gpt.h. */
int gpu_gpt_flash_bwd(const float *dy, const float *qkv, const float *o, const float *lse, int B,
                      int T, int C, int H, gpu_dtype mm_dt, float *dqkv, float *scratch, int slots,
                      gpu_diag *diag, int layer)
{
    attn_args a = {.qkv = qkv, .dy = dy, .o = o, .lse = lse, .dqkv = dqkv, .T = T, .C = C,
                   .H = H, .mm_dt = mm_dt, .diag = diag};
    if (diag) /* the gradient arriving at the attention: inf/NaN */
        gpu_diag_backward(diag, layer, dy, (size_t)B * T * C);
    int rc = each_head(B, H, slots, gpu_gpt_attention_scratch_floats(T, C / H, mm_dt, 1),
                       scratch, flash_head_bwd, &a);
    if (rc)
        return rc;
    diag_dqk(diag, layer, dqkv, (size_t)B * T, C, mm_dt);
    return 0;
}
