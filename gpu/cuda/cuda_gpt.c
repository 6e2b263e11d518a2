/*
 * cuda_gpt.c - the GPT of gpu/gpt.c (GPT-2 pre-LN decoder, tied embeddings) on a CUDA device:
 * plain C that enqueues the kernels of cuda_ops.h, the GEMMs of cuda_blas.h and the
 * diagnostics counters of cuda_step.h on one stream. The contract is gpu/cuda/cuda_model.h.
 *
 * Graph and rounding points: gpt.c's, op for op. Every op has the dtype of the CPU plan
 * (lin_dt, mm_dt, sm_dt, ln_dt, gelu_dt, ce_dt, emb_dt, resid_dt); its inputs are values of
 * that dtype, it computes in fp32 and rounds its outputs and (backward) its gradients to it.
 * A tensor is stored in the dtype of its values (16-bit values as 16 bits), so the casts
 * between ops fuse into the kernels' loads and stores. The GEMMs accumulate in fp32 and
 * round once: a linear is rd(X W^T + b, lin_dt) (the bias added to the fp32 accumulator,
 * by cuBLASLt's bias epilogue or by the bias-add kernel, as gpt.c adds it), the attention's
 * products are rd(., mm_dt), weight gradients are fp32 GEMM results rounded to lin_dt in
 * place. The only differences from the CPU are the summation orders of the GEMMs, of the
 * column sums beyond 256 rows and of the summed loss. Not used: cuBLASLt's bias + GELU
 * epilogue, whose GELU takes the unrounded pre-activation (gpt.c rounds it to lin_dt
 * first) and may use the hardware tanh (2^-11 relative): mlp.fc takes the bias epilogue and
 * then the GELU kernel, bit-exact with gpt.c.
 *
 * Where values live (N = B x T rows, C = d_model, H heads, layer l's part of the activation
 * block at l x blk_bytes, every region 256-byte aligned; dtype in brackets):
 *   activations, per layer: resid [resid_dt] (the block's input); ln1 [lin]; ln1 mean, rstd
 *     [fp32]; qkv [mm_dt] (N x 3C: its only readers are the attention products, which read it
 *     as mm_dt values); probs [sm_dt] (B x H x T x T, saved as the CPU saves them, with exact
 *     zeros above the diagonal; not recomputed); pm [mm_dt] (the same probabilities cast to
 *     mm_dt for P V and dV, when sm_dt differs: saved, as PyTorch's autograd saves the cast,
 *     rather than cast again in the backward); atty [lin] (attention output); resid_mid
 *     [resid_dt]; ln2, mean, rstd; fc [lin] (GELU's input); gelu [lin]; then resid_final
 *     [resid_dt], ln_f [lin], mean, rstd, and the logits [lin] (N x V): the forward's fused
 *     cross-entropy (llm.c's classifier) overwrites them with the loss gradient, which the
 *     backward reads, so they live in the activation block.
 *   workspace (temporaries of one call): a zero float; an fp32 scratch N x 4C (GEMM outputs
 *     before their bias or rounding, the attention output before its cast, dQKV); the
 *     scores B x H x T x T (fp32 room: S, then dP / dS in mm_dt); the residual gradient
 *     [resid_dt]; gradient buffers ga [lin, N x C], gb [lin, N x 4C], gd [mm_dt, N x C];
 *     the column-sum, cross-entropy and embedding workspaces of cuda_ops.h; an fp32
 *     diagnostics buffer; with lin_dt fp32, a buffer that widens 16-bit weights chunk by
 *     chunk when there is no fp32 master (an fp32 linear of a 16-bit job without master
 *     weights reads the 16-bit values, as gpt.c does).
 *   Attention products are strided-batched GEMMs on the qkv layout: one launch per head
 *   batched over the sequences, or per sequence batched over the heads when H > B.
 *   Flash attention (m->flash): the kernels of cuda_attn.cu instead; probs holds the row
 *   log-sum-exp (fp32, B x H x T), the scores region D = dY . O (fp32, B x H x T), there is no
 *   P cast, the forward writes y straight into atty and, when lin_dt is mm_dt and nothing is
 *   collected, the backward writes dQKV rounded straight into gb.
 *
 * The loss gradient: the forward's cross-entropy is fused with its backward when ctx->state
 * is set: dlogits = rd(rd(p g - [y] g, ce_dt), lin_dt) with g = state->scale_used / N read on
 * the device when that kernel runs (so gpu_cuda_step_begin_launch must come before the
 * forward). A forward without a state (an eval batch) computes the loss only; a backward
 * must follow a forward with a state (without one it returns GPU_EINVAL).
 *
 * Fusions on the residual stream: a block's residual adds are done by the layer norm that
 * follows them (ln2, then the next block's ln1 or ln_f: gpu_cuda_add_layernorm_fwd_launch),
 * and backward each layer norm adds its dx onto the stream's gradient and leaves that
 * gradient's lin_dt copy for the linear below (gpu_cuda_layernorm_bwd_resid_launch), with
 * gpt.c's rounding at each of the steps it fuses.
 *
 * Diagnostics (ctx->diag not NULL): the calls gpt.c makes, in its order, with its values:
 * per linear the fp32 outputs before rounding (accumulator + bias), the arriving gradient
 * (inf/NaN), the weight and bias gradients and the input gradient before rounding; the
 * causal entries of Q K^T before rounding (packed by row with 2-D copies) and, backward, dS
 * and dQ, dK; lm_head likewise. Layer slots are gpu_cuda_gpt_diag_layer's (cuda_model.h),
 * gpt.c's order of creation: blocks.<i>.attn.qkv, attn.scores, attn.proj, mlp.fc, mlp.proj
 * at 5i .. 5i + 4, lm_head at 5 n_layer.
 * Collecting takes the fp32 path (fp32 GEMM outputs, then the bias, the count and the
 * rounding kernels), so its results equal the CPU's within the same tolerances but need not
 * equal those of a step without diagnostics bit for bit (cuBLASLt may pick other kernels).
 *
 * Tokens are not checked (that needs the host): a token outside [0, vocab) gives a row of
 * NaN, a target outside it a NaN loss.
 *
 * Threads: everything is enqueued on ctx->stream; nothing synchronises the host. One
 * context (its blas handle and workspace) serves one stream at a time.
 */
#include <stdint.h>
#include <string.h>

#include "gpu/cuda/cuda_model.h"
#include "gpu/cuda/cuda_util.h"
#include "gpu/fp8.h"

#define DIAG_MIN_FLOATS ((size_t)1 << 20)  /* diagnostics buffer: at least 4 MiB */
#define WIDEN_MAX_FLOATS ((size_t)1 << 22) /* widening buffer: at most 16 MiB */
#define CONVERT_STEP ((size_t)1 << 30)     /* elements per conversion launch (an int count) */
#define NO_BIAS SIZE_MAX

/* Byte offsets of one layer's activations, inside its part of the block. */
typedef struct {
    size_t resid, ln1, ln1_mean, ln1_rstd, qkv, probs, pm, atty, hmid, ln2, ln2_mean, ln2_rstd,
        fc, gelu;
} blk_off;

/* The device layout for B sequences (byte offsets). */
typedef struct {
    blk_off b;
    size_t blk_bytes;
    size_t resf, lnf, lnf_mean, lnf_rstd, logits, acts_bytes;
    size_t zero, f32, scores, dres, ga, gb, gd, colw, cew, dg, wid, embw;
    size_t dg_floats, wid_floats, embw_bytes, ws_bytes;
} gpt_lay;

/* An fp8 job's block for B sequences (N rows; byte offsets): per fp8 GEMM g what its
 * backward reads of its forward, the input's transpose x8t[g] (K x N) and the weight's
 * w8t[g] (K x O); then, shared by the GEMMs, the forward's input x8 (N x K) and weight w8
 * (O x K) and backward's output gradient g8 (N x O) and its transpose g8t (O x N). */
typedef struct {
    size_t x8t[4 * GPU_GPT_MAX_LAYERS], w8t[4 * GPU_GPT_MAX_LAYERS];
    size_t x8, w8, g8, g8t, bytes;
} gpt_fp8;

/* One forward or backward call. */
typedef struct {
    const gpu_gpt *m;
    const gpu_cuda_model_ctx *c;
    cudaStream_t st;
    gpt_lay L;
    gpt_fp8 F; /* an fp8 job's */
    int B, T, C, H, hd, V, N;
    size_t nC;  /* N x C */
    bool widen; /* fp32 linears on 16-bit weights without a master */
    uint8_t *acts, *ws;
} gpt_run;

/* A weight tensor as an op reads it: pointer and storage dtype. */
typedef struct {
    const void *p;
    gpu_dtype dt;
} wref;

/* An attention operand: element strides from one sequence and from one head to the next. */
typedef struct {
    void *p;
    gpu_dtype dt;
    int ld;
    int64_t sb, sh;
} aop;

/* ---- small helpers ------------------------------------------------------------------------ */

static size_t es(gpu_dtype dt)
{
    return gpu_dtype_size(dt);
}

static size_t max_sz(size_t a, size_t b)
{
    return a > b ? a : b;
}

static size_t take(size_t *at, size_t bytes)
{
    size_t off = *at;
    *at = gpu_align256(off + bytes);
    return off;
}

/* Element i of a tensor stored in dt. */
static const void *cel(const void *p, size_t i, gpu_dtype dt)
{
    return (const uint8_t *)p + i * es(dt);
}

static void *el(void *p, size_t i, gpu_dtype dt)
{
    return (uint8_t *)p + i * es(dt);
}

static bool dt_ok(gpu_dtype dt)
{
    return dt == GPU_FP32 || dt == GPU_FP16 || dt == GPU_BF16;
}

static void *act(const gpt_run *r, int l, size_t off)
{
    return r->acts + (size_t)l * r->L.blk_bytes + off;
}

static void *wsp(const gpt_run *r, size_t off)
{
    return r->ws + off;
}

/* The diagnostics layer of op (GPU_CUDA_GPT_*) of block l, or of lm_head when l < 0. */
static int dl(const gpt_run *r, int l, int op)
{
    return gpu_cuda_gpt_diag_layer(r->m, l, op);
}

/* ---- layout ------------------------------------------------------------------------------- */

/* The layout for B sequences; every region grows with B, so B <= max_batch fits the sizes
 * planned for max_batch. GPU_ENODEV without a device (the embedding's sort workspace is a
 * device query). */
static int layout(const gpu_gpt *m, int B, gpt_lay *L)
{
    size_t T = (size_t)m->seq_len, C = (size_t)m->d_model, V = (size_t)m->vocab;
    size_t N = (size_t)B * T, H = (size_t)m->n_head, bhtt = (size_t)B * H * T * T;
    size_t bht = (size_t)B * H * T;
    size_t el_ = es(m->lin_dt), em = es(m->mm_dt), esm = es(m->sm_dt), er = es(m->resid_dt);
    size_t f = sizeof(float), at = 0;
    blk_off *b = &L->b;

    memset(L, 0, sizeof(*L));
    b->resid = take(&at, N * C * er);
    b->ln1 = take(&at, N * C * el_);
    b->ln1_mean = take(&at, N * f);
    b->ln1_rstd = take(&at, N * f);
    b->qkv = take(&at, N * 3 * C * em);
    b->probs = take(&at, m->flash ? bht * f : bhtt * esm); /* flash: the log-sum-exp */
    b->pm = take(&at, m->sm_dt != m->mm_dt && !m->flash ? bhtt * em : 0);
    b->atty = take(&at, N * C * el_);
    b->hmid = take(&at, N * C * er);
    b->ln2 = take(&at, N * C * el_);
    b->ln2_mean = take(&at, N * f);
    b->ln2_rstd = take(&at, N * f);
    b->fc = take(&at, N * 4 * C * el_);
    b->gelu = take(&at, N * 4 * C * el_);
    L->blk_bytes = at;
    at *= (size_t)m->n_layer;
    L->resf = take(&at, N * C * er);
    L->lnf = take(&at, N * C * el_);
    L->lnf_mean = take(&at, N * f);
    L->lnf_rstd = take(&at, N * f);
    L->logits = take(&at, N * V * el_);
    L->acts_bytes = at;

    at = 0;
    L->zero = take(&at, f);
    L->f32 = take(&at, N * 4 * C * f);
    L->scores = take(&at, m->flash ? bht * f : bhtt * f); /* flash: D = dY . O */
    L->dres = take(&at, N * C * er);
    L->ga = take(&at, N * C * el_);
    L->gb = take(&at, N * 4 * C * el_);
    L->gd = take(&at, N * C * em);
    L->colw = take(&at, max_sz(gpu_cuda_bias_grad_workspace((int)N, (int)(4 * C)),
                               gpu_cuda_layernorm_bwd_workspace((int)N, (int)C)));
    L->cew = take(&at, gpu_cuda_ce_workspace((int)N));
    L->dg_floats = max_sz(max_sz(DIAG_MIN_FLOATS, V), max_sz((size_t)B * H * T, 4 * C));
    L->dg = take(&at, L->dg_floats * f);
    if (m->lin_dt == GPU_FP32) /* at least one row of any weight; whole block weights */
        L->wid_floats = max_sz(4 * C, 4 * C * C < WIDEN_MAX_FLOATS ? 4 * C * C : WIDEN_MAX_FLOATS);
    L->wid = take(&at, L->wid_floats * f);
    int rc = gpu_cuda_embed_bwd_workspace((int)N, &L->embw_bytes);
    if (rc != 0)
        return rc;
    L->embw = take(&at, L->embw_bytes);
    L->ws_bytes = at;
    return 0;
}

static bool model_ok(const gpu_gpt *m)
{
    return m != NULL && m->n_layer >= 1 && m->n_layer <= GPU_GPT_MAX_LAYERS && m->n_head >= 1 &&
           m->d_model >= 1 && m->d_model % m->n_head == 0 && m->seq_len >= 1 && m->vocab >= 1 &&
           m->max_batch >= 1 && dt_ok(m->lin_dt) && dt_ok(m->mm_dt) && dt_ok(m->sm_dt) &&
           dt_ok(m->ln_dt) && dt_ok(m->gelu_dt) && dt_ok(m->ce_dt) && dt_ok(m->emb_dt) &&
           dt_ok(m->resid_dt) &&
           (!m->flash || (m->mm_dt != GPU_FP32 && gpu_cuda_flash_supported(m->head_dim) &&
                          (m->lin_dt == m->mm_dt || m->lin_dt == GPU_FP32)));
}

/* Sizes for up to max_batch sequences (1 <= max_batch <= m->max_batch); see cuda_model.h.
 * Pointers borrowed. GPU_ENODEV without a device. */
int gpu_cuda_gpt_plan(const gpu_gpt *m, int max_batch, size_t *acts_bytes, size_t *ws_bytes)
{
    gpt_lay L;
    if (!model_ok(m) || acts_bytes == NULL || ws_bytes == NULL || max_batch < 1 ||
        max_batch > m->max_batch)
        return GPU_EINVAL;
    int rc = layout(m, max_batch, &L);
    if (rc != 0)
        return rc;
    *acts_bytes = L.acts_bytes;
    *ws_bytes = L.ws_bytes;
    return 0;
}

/* GEMM g's output and input widths: attn.qkv 3C x C, attn.proj C x C, mlp.fc 4C x C,
 * mlp.proj C x 4C (gpt.c's order, g = 4 block + k). */
static void fp8_dims(const gpu_gpt *m, int g, int *O, int *K)
{
    static const int o[4] = {3, 1, 4, 1}, k[4] = {1, 1, 1, 4};
    *O = o[g % 4] * m->d_model;
    *K = k[g % 4] * m->d_model;
}

static void fp8_layout(const gpu_gpt *m, const bool *on, int B, gpt_fp8 *f)
{
    size_t off = 0, N = (size_t)B * (size_t)m->seq_len, C4 = 4 * (size_t)m->d_model;
    for (int g = 0; g < m->nfp8; g++) {
        int O, K;
        if (!on[g])
            continue;
        fp8_dims(m, g, &O, &K);
        f->x8t[g] = off;
        off = gpu_align256(off + N * (size_t)K);
        f->w8t[g] = off;
        off = gpu_align256(off + (size_t)O * (size_t)K);
    }
    f->x8 = off; /* the widest input and output are 4C, the largest weight 4C x C */
    off = gpu_align256(off + N * C4);
    f->w8 = off;
    off = gpu_align256(off + C4 * (size_t)m->d_model);
    f->g8 = off;
    off = gpu_align256(off + N * C4);
    f->g8t = off;
    off = gpu_align256(off + N * C4);
    f->bytes = off;
}

/* See cuda_model.h. */
int gpu_cuda_gpt_fp8_plan(const gpu_gpt *m, const bool *on, int max_batch, size_t *bytes, char *err,
                          size_t errlen)
{
    gpt_fp8 f;
    if (!model_ok(m) || m->nfp8 > 4 * GPU_GPT_MAX_LAYERS || max_batch < 1)
        return GPU_EINVAL;
    if (m->seq_len % 16) {
        snprintf(err, errlen,
                 "model.seq_len: fp8 on CUDA multiplies the batch's token rows in the weight "
                 "gradients' GEMMs, which need a multiple of 16 rows for any batch: seq_len %d "
                 "is not one",
                 m->seq_len);
        return GPU_EINVAL;
    }
    if (m->d_model % 16) {
        snprintf(err, errlen,
                 "model.d_model: fp8 GEMMs on CUDA need every dimension a multiple of 16, and "
                 "d_model %d is not one",
                 m->d_model);
        return GPU_EINVAL;
    }
    fp8_layout(m, on, max_batch, &f);
    *bytes = f.bytes;
    return 0;
}

/* Check the arguments and set up a call for B sequences (acts and ws 256-byte aligned, as
 * cudaMalloc returns them); the zero float is written. */
static int run_init(gpt_run *r, const gpu_gpt *m, const gpu_cuda_model_ctx *c, const int *x,
                    const int *y, int B, bool backward)
{
    if (!model_ok(m) || c == NULL || x == NULL || y == NULL || B < 1 || B > m->max_batch)
        return GPU_EINVAL;
    if (c->blas == NULL || c->work == NULL || c->acts == NULL || c->ws == NULL || !dt_ok(c->wdt) ||
        (m->lin_dt != GPU_FP32 && m->lin_dt != c->wdt))
        return GPU_EINVAL;
    if ((uintptr_t)c->acts % GPU_CUDA_ALIGN != 0 || (uintptr_t)c->ws % GPU_CUDA_ALIGN != 0)
        return GPU_EINVAL; /* the regions' alignment (cuda_ops.h's workspaces need 256) */
    if (backward ? (c->grads == NULL || c->state == NULL)
                 : (c->loss_sum == NULL || c->correct == NULL))
        return GPU_EINVAL;
    memset(r, 0, sizeof(*r));
    int rc = layout(m, B, &r->L);
    if (rc != 0)
        return rc;
    r->m = m;
    r->c = c;
    r->st = c->stream;
    r->B = B;
    r->T = m->seq_len;
    r->C = m->d_model;
    r->H = m->n_head;
    r->hd = m->head_dim;
    r->V = m->vocab;
    r->N = B * m->seq_len;
    r->nC = (size_t)r->N * (size_t)r->C;
    r->widen = m->lin_dt == GPU_FP32 && c->master == NULL && c->wdt != GPU_FP32;
    r->acts = (uint8_t *)c->acts;
    r->ws = (uint8_t *)c->ws;
    if (c->fp8) {
        if (c->fp8_state == NULL || c->fp8_block == NULL || c->fp8_on == NULL ||
            m->nfp8 > 4 * GPU_GPT_MAX_LAYERS || m->seq_len % 16 || m->d_model % 16)
            return GPU_EINVAL;
        fp8_layout(m, c->fp8_on, B, &r->F);
    }
    return gpu_cuda_c_check(cudaMemsetAsync(wsp(r, r->L.zero), 0, sizeof(float), r->st),
                            "cudaMemsetAsync");
}

/* The weights an op in dtype op reads at element offset off: the fp32 master when the op
 * runs in fp32 and there is one, else the working copy (gpt.c's wsrc). */
static wref wsrc(const gpt_run *r, size_t off, gpu_dtype op)
{
    const gpu_cuda_model_ctx *c = r->c;
    if (op == GPU_FP32 && c->master != NULL)
        return (wref){c->master + off, GPU_FP32};
    return (wref){cel(c->work, off, c->wdt), c->wdt};
}

/* ---- conversions and diagnostics ---------------------------------------------------------- */

/* out[0..n) = rd(in, dt) stored in odt (in stored in idt; out may equal in when odt == idt):
 * the bias-add kernel with one zero column. Values already of dt in the same storage are
 * copied (or left alone in place). */
static int convert(const gpt_run *r, const void *in, gpu_dtype idt, void *out, gpu_dtype odt,
                   size_t n, gpu_dtype dt)
{
    if (idt == odt && (dt == GPU_FP32 || dt == idt)) {
        if (in == out || n == 0)
            return 0;
        return gpu_cuda_c_check(
            cudaMemcpyAsync(out, in, n * es(idt), cudaMemcpyDeviceToDevice, r->st),
            "cudaMemcpyAsync");
    }
    for (size_t i = 0; i < n; i += CONVERT_STEP) {
        size_t k = n - i < CONVERT_STEP ? n - i : CONVERT_STEP;
        int rc = gpu_cuda_bias_add_launch(cel(in, i, idt), idt, wsp(r, r->L.zero), GPU_FP32, (int)k,
                                          1, dt, el(out, i, odt), odt, r->st);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* Account n fp32 values for layer as kind (nothing without diagnostics). */
static int diag32(const gpt_run *r, int layer, gpu_dtype dt, gpu_cuda_diag_kind kind,
                  const float *x, size_t n)
{
    if (r->c->diag == NULL)
        return 0;
    return gpu_cuda_diag_launch(r->c->diag, layer, dt, kind, x, n, r->st);
}

/* The same for values stored in xdt: 16-bit ones are widened chunk by chunk. */
static int diag_any(const gpt_run *r, int layer, gpu_dtype dt, gpu_cuda_diag_kind kind,
                    const void *x, gpu_dtype xdt, size_t n)
{
    if (r->c->diag == NULL || xdt == GPU_FP32)
        return diag32(r, layer, dt, kind, (const float *)x, n);
    float *buf = wsp(r, r->L.dg);
    for (size_t i = 0; i < n; i += r->L.dg_floats) {
        size_t k = n - i < r->L.dg_floats ? n - i : r->L.dg_floats;
        int rc = convert(r, cel(x, i, xdt), xdt, buf, GPU_FP32, k, GPU_FP32);
        if (rc == 0)
            rc = diag32(r, layer, dt, kind, buf, k);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* The fp32 values x[0..n) accounted for layer as kind (lin_dt's counters) before their
 * rounding, then rounded to lin_dt into out, stored in odt (out may equal x when odt is
 * fp32). */
static int diag_round(const gpt_run *r, int layer, gpu_cuda_diag_kind kind, float *x, size_t n,
                      void *out, gpu_dtype odt)
{
    gpu_dtype lin = r->m->lin_dt;
    int rc = diag32(r, layer, lin, kind, x, n);
    if (rc == 0)
        rc = convert(r, x, GPU_FP32, out, odt, n, lin);
    return rc;
}

/* ---- GEMMs --------------------------------------------------------------------------------- */

static int mm(const gpt_run *r, const gpu_cuda_mm *p)
{
    return gpu_cuda_matmul(r->c->blas, r->st, p);
}

/* One product C[M x N] (cdt, ld ldc) = op(A) op(B) over K: beta 0, one batch, no epilogue
 * (the caller sets the other fields). */
static gpu_cuda_mm mm_desc(bool ta, bool tb, int M, int N, int K, const void *A, gpu_dtype adt,
                           int lda, const void *B, gpu_dtype bdt, int ldb, void *C, gpu_dtype cdt,
                           int ldc)
{
    gpu_cuda_mm p = {.ta = ta,
                     .tb = tb,
                     .M = M,
                     .N = N,
                     .K = K,
                     .A = A,
                     .adt = adt,
                     .lda = lda,
                     .B = B,
                     .bdt = bdt,
                     .ldb = ldb,
                     .C = C,
                     .cdt = cdt,
                     .ldc = ldc,
                     .beta = 0.0f,
                     .batch = 1};
    return p;
}

/* The product p with rows [o0, o0 + k) of the K-wide weight w, widened into the fp32
 * widening buffer, as its B operand. */
static int mm_widened(const gpt_run *r, gpu_cuda_mm *p, wref w, int o0, int k, int K)
{
    int rc = convert(r, cel(w.p, (size_t)o0 * K, w.dt), w.dt, wsp(r, r->L.wid), GPU_FP32,
                     (size_t)k * K, GPU_FP32);
    if (rc != 0)
        return rc;
    p->B = wsp(r, r->L.wid);
    p->bdt = GPU_FP32;
    return mm(r, p);
}

static int widen_chunk(const gpt_run *r, int K)
{
    size_t rows = r->L.wid_floats / (size_t)K;
    return rows > (size_t)INT32_MAX ? INT32_MAX : (int)rows;
}

/* Cp[M x O] (cdt, ld O) = X[M x K] W^T (+ bias, cuBLASLt's epilogue, when bias is not NULL)
 * for the lin_dt linear weight [O x K] at w_off; X stored in lin_dt. */
static int wgemm_fwd(const gpt_run *r, const void *X, int M, int K, int O, size_t w_off, void *Cp,
                     gpu_dtype cdt, const void *bias)
{
    gpu_dtype lin = r->m->lin_dt;
    wref w = wsrc(r, w_off, lin);
    gpu_cuda_mm p = mm_desc(false, true, M, O, K, X, lin, K, w.p, w.dt, K, Cp, cdt, O);
    p.epilogue = bias != NULL ? GPU_CUDA_EPI_BIAS : GPU_CUDA_EPI_NONE;
    p.bias = bias;
    if (!r->widen)
        return mm(r, &p);
    int rows = widen_chunk(r, K);
    for (int o0 = 0; o0 < O; o0 += rows) {
        int k = O - o0 < rows ? O - o0 : rows;
        p.N = k;
        p.C = el(Cp, (size_t)o0, cdt);
        int rc = mm_widened(r, &p, w, o0, k, K);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* dX[N x K] (cdt) = dY[N x O] W for the linear weight [O x K] at w_off; dY in lin_dt. With
 * widening the products over chunks of W's rows are summed in fp32 (beta 1). */
static int wgemm_dx(const gpt_run *r, const void *dY, int O, int K, size_t w_off, void *dX,
                    gpu_dtype cdt)
{
    gpu_dtype lin = r->m->lin_dt;
    wref w = wsrc(r, w_off, lin);
    gpu_cuda_mm p = mm_desc(false, false, r->N, K, O, dY, lin, O, w.p, w.dt, K, dX, cdt, K);
    if (!r->widen)
        return mm(r, &p);
    int rows = widen_chunk(r, K);
    for (int o0 = 0; o0 < O; o0 += rows) {
        int k = O - o0 < rows ? O - o0 : rows;
        p.K = k;
        p.A = cel(dY, (size_t)o0, lin);
        p.beta = o0 == 0 ? 0.0f : 1.0f;
        int rc = mm_widened(r, &p, w, o0, k, K);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* One attention product per (sequence, head): C = op(A) op(B), M x Nn x K each. */
static int agemm(const gpt_run *r, bool ta, bool tb, int M, int Nn, int K, aop a, aop b, aop c)
{
    bool heads_outer = r->H <= r->B;
    int outer = heads_outer ? r->H : r->B, batch = heads_outer ? r->B : r->H;
    for (int o = 0; o < outer; o++) {
        int64_t ao = heads_outer ? a.sh : a.sb, bo = heads_outer ? b.sh : b.sb;
        int64_t co = heads_outer ? c.sh : c.sb;
        gpu_cuda_mm p = mm_desc(ta, tb, M, Nn, K, el(a.p, (size_t)(ao * o), a.dt), a.dt, a.ld,
                                el(b.p, (size_t)(bo * o), b.dt), b.dt, b.ld,
                                el(c.p, (size_t)(co * o), c.dt), c.dt, c.ld);
        p.batch = batch;
        p.stride_a = heads_outer ? a.sb : a.sh;
        p.stride_b = heads_outer ? b.sb : b.sh;
        p.stride_c = heads_outer ? c.sb : c.sh;
        int rc = mm(r, &p);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* ---- fp8 linears ---------------------------------------------------------------------------- */

/* The fp8 GEMM of the linear whose weight is at w_off, or -1 (not an fp8 job, or a linear
 * kept in bf16, or the head). */
static int fp8_gemm(const gpt_run *r, size_t w_off)
{
    const gpu_gpt *m = r->m;
    for (int g = 0; r->c->fp8 != NULL && g < m->nfp8; g++)
        if (m->fp8_w[g] == w_off)
            return r->c->fp8_on[g] ? g : -1;
    return -1;
}

/* F[N x O] = X W^T in fp8 (gpt.c's fp8_fwd): the input (lin_dt) and the weight (the fp32
 * master when there is one) cast with their transposes kept for backward. */
static int fp8_fwd(const gpt_run *r, int g, const void *X, int K, int O, size_t w_off, float *F)
{
    const gpu_cuda_model_ctx *c = r->c;
    uint8_t *b = c->fp8_block;
    GPU_TRY(gpu_cuda_fp8_cast_op(c, g, GPU_FP8_X, X, r->m->lin_dt, r->N, K, b + r->F.x8,
                                 b + r->F.x8t[g]));
    GPU_TRY(gpu_cuda_fp8_cast_weight(c, g, w_off, O, K, b + r->F.w8, b + r->F.w8t[g]));
    return gpu_cuda_fp8_gemm_op(c, g, r->N, O, K, b + r->F.x8, GPU_FP8_X, b + r->F.w8, GPU_FP8_W,
                                F);
}

/* gw[O x K] = dY^T X in fp8: the output gradient (lin_dt) cast with its transpose, then the
 * product with the forward's transposed input. */
static int fp8_dw(const gpt_run *r, int g, const void *dY, int K, int O, float *gw)
{
    const gpu_cuda_model_ctx *c = r->c;
    uint8_t *b = c->fp8_block;
    GPU_TRY(gpu_cuda_fp8_cast_op(c, g, GPU_FP8_G, dY, r->m->lin_dt, r->N, O, b + r->F.g8,
                                 b + r->F.g8t));
    return gpu_cuda_fp8_gemm_op(c, g, O, K, r->N, b + r->F.g8t, GPU_FP8_G, b + r->F.x8t[g],
                                GPU_FP8_X, gw);
}

/* F[N x K] = dY W in fp8, from the gradient's copy fp8_dw made and the forward's W^T. */
static int fp8_dx(const gpt_run *r, int g, int K, int O, float *F)
{
    uint8_t *b = r->c->fp8_block;
    return gpu_cuda_fp8_gemm_op(r->c, g, r->N, K, O, b + r->F.g8, GPU_FP8_G, b + r->F.w8t[g],
                                GPU_FP8_W, F);
}

/* ---- linear layers ------------------------------------------------------------------------- */

/* out[N x O] = rd(X W^T + b, lin_dt) stored in odt (gpt.c's linear_fwd); X [N x K] in lin_dt.
 * The bias epilogue when the output is lin_dt, the bias is stored in lin_dt and 16-byte
 * aligned and nothing is collected; else the fp32 product, then the bias kernel (and with
 * diagnostics the fp32 sum is accounted before its rounding). */
static int linear_fwd(const gpt_run *r, const void *X, int K, int O, size_t w_off, size_t b_off,
                      void *out, gpu_dtype odt, int layer)
{
    gpu_dtype lin = r->m->lin_dt;
    wref b = wsrc(r, b_off, lin);
    size_t n = (size_t)r->N * (size_t)O;
    float *F = wsp(r, r->L.f32);
    int g = fp8_gemm(r, w_off);
    if (g < 0 && r->c->diag == NULL && odt == lin && b.dt == lin && !r->widen &&
        (uintptr_t)b.p % 16 == 0)
        return wgemm_fwd(r, X, r->N, K, O, w_off, out, lin, b.p);
    int rc = g >= 0 ? fp8_fwd(r, g, X, K, O, w_off, F)
                    : wgemm_fwd(r, X, r->N, K, O, w_off, F, GPU_FP32, NULL);
    if (rc != 0)
        return rc;
    if (r->c->diag == NULL)
        return gpu_cuda_bias_add_launch(F, GPU_FP32, b.p, b.dt, r->N, O, lin, out, odt, r->st);
    rc = gpu_cuda_bias_add_launch(F, GPU_FP32, b.p, b.dt, r->N, O, GPU_FP32, F, GPU_FP32, r->st);
    if (rc == 0)
        rc = diag_round(r, layer, GPU_CUDA_DIAG_FORWARD, F, n, out, odt);
    return rc;
}

/* gpt.c's linear_bwd: from dY [N x O] (lin_dt values, stored in lin_dt) and the saved
 * input X [N x K] (lin_dt): the weight and bias gradients written into ctx->grads rounded to
 * lin_dt (b_off NO_BIAS: no bias gradient, for the head or one already taken), dX =
 * rd(dY W, lin_dt) stored in dxdt. Diagnostics: dY arriving, then each gradient before
 * rounding. */
static int linear_bwd(const gpt_run *r, const void *dY, const void *X, int K, int O, size_t w_off,
                      size_t b_off, void *dX, gpu_dtype dxdt, int layer)
{
    gpu_dtype lin = r->m->lin_dt;
    float *gw = r->c->grads + w_off, *F = wsp(r, r->L.f32);
    size_t nw = (size_t)O * (size_t)K;
    bool dg = r->c->diag != NULL;
    int rc = diag_any(r, layer, lin, GPU_CUDA_DIAG_BACKWARD, dY, lin, (size_t)r->N * O);
    if (rc != 0)
        return rc;
    int g = fp8_gemm(r, w_off);
    if (g >= 0) {
        rc = fp8_dw(r, g, dY, K, O, gw);
    } else {
        gpu_cuda_mm p = mm_desc(true, false, O, K, r->N, dY, lin, O, X, lin, K, gw, GPU_FP32, K);
        rc = mm(r, &p);
    }
    if (rc == 0)
        rc = diag_round(r, layer, GPU_CUDA_DIAG_WEIGHT_GRAD, gw, nw, gw, GPU_FP32);
    if (rc == 0 && b_off != NO_BIAS) {
        float *gb = r->c->grads + b_off;
        rc = gpu_cuda_bias_grad_launch(dY, lin, r->N, O, dg ? GPU_FP32 : lin, gb, wsp(r, r->L.colw),
                                       r->st);
        if (rc == 0 && dg)
            rc = diag_round(r, layer, GPU_CUDA_DIAG_WEIGHT_GRAD, gb, (size_t)O, gb, GPU_FP32);
    }
    if (rc != 0)
        return rc;
    if (g < 0 && !dg && dxdt == lin && !r->widen)
        return wgemm_dx(r, dY, O, K, w_off, dX, lin);
    rc = g >= 0 ? fp8_dx(r, g, K, O, F) : wgemm_dx(r, dY, O, K, w_off, F, GPU_FP32);
    if (rc == 0)
        rc = diag_round(r, layer, GPU_CUDA_DIAG_INPUT_GRAD, F, (size_t)r->N * K, dX, dxdt);
    return rc;
}

/* ---- layer norms and the residual stream --------------------------------------------------- */

/* One of the model's layer norms: its weights (offsets), its input on the residual stream
 * (resid_dt), its output (lin_dt) and its saved statistics. */
typedef struct {
    size_t g, b;
    void *x, *y;
    float *mean, *rstd;
} ln_site;

/* Layer l's ln1 (which 1) or ln2 (which 2); ln_f for l == n_layer. */
static ln_site ln_at(const gpt_run *r, int l, int which)
{
    const gpu_gpt *m = r->m;
    const blk_off *b = &r->L.b;
    if (l == m->n_layer)
        return (ln_site){m->lnf_w, m->lnf_b, r->acts + r->L.resf, r->acts + r->L.lnf,
                         (float *)(r->acts + r->L.lnf_mean), (float *)(r->acts + r->L.lnf_rstd)};
    const gpu_gpt_block *P = &m->blk[l];
    if (which == 1)
        return (ln_site){P->ln1_w, P->ln1_b, act(r, l, b->resid), act(r, l, b->ln1),
                         act(r, l, b->ln1_mean), act(r, l, b->ln1_rstd)};
    return (ln_site){P->ln2_w, P->ln2_b, act(r, l, b->hmid), act(r, l, b->ln2),
                     act(r, l, b->ln2_mean), act(r, l, b->ln2_rstd)};
}

/* gpt.c's ln_fwd on the stream s.x, normalised in ln_dt, s.y stored in lin_dt. With add (a
 * linear's output, lin_dt) the residual add before it too (gpt.c's resid_add): s.x =
 * rd(a + add, resid_dt), written by the same kernel. */
static int ln_fwd(const gpt_run *r, ln_site s, const void *a, const void *add)
{
    const gpu_gpt *m = r->m;
    wref g = wsrc(r, s.g, m->ln_dt), b = wsrc(r, s.b, m->ln_dt);
    if (add == NULL)
        return gpu_cuda_layernorm_fwd_launch(s.x, m->resid_dt, g.p, b.p, g.dt, r->N, r->C,
                                             m->ln_dt, s.y, m->lin_dt, s.mean, s.rstd, r->st);
    return gpu_cuda_add_layernorm_fwd_launch(a, add, m->lin_dt, s.x, m->resid_dt, g.p, b.p, g.dt,
                                             r->N, r->C, m->ln_dt, s.y, m->lin_dt, s.mean, s.rstd,
                                             r->st);
}

/* gpt.c's ln_bwd from dy in ga (lin_dt values, stored in lin_dt) into the residual gradient
 * dres (resid_dt): added (gpt.c's resid_acc) when acc, else written; the weight gradients
 * written into ctx->grads rounded to ln_dt. With below (a linear reads the stream's gradient
 * next), dres rounded to lin_dt then replaces dy in ga (gpt.c's to_lin) when the two dtypes'
 * storages differ. One kernel for the three CPU steps. */
static int ln_bwd(const gpt_run *r, ln_site s, bool acc, bool below)
{
    const gpu_gpt *m = r->m;
    wref g = wsrc(r, s.g, m->ln_dt);
    void *ga = wsp(r, r->L.ga);
    bool cast = below && m->lin_dt != m->resid_dt;
    gpu_cuda_dres out = {wsp(r, r->L.dres), m->resid_dt, acc, cast ? ga : NULL, m->lin_dt};
    return gpu_cuda_layernorm_bwd_resid_launch(ga, m->lin_dt, s.x, m->resid_dt, s.mean, s.rstd,
                                               g.p, g.dt, r->N, r->C, m->ln_dt, &out,
                                               r->c->grads + s.g, r->c->grads + s.b,
                                               wsp(r, r->L.colw), r->st);
}

/* The residual gradient handed to a linear's output: dres itself when lin_dt and resid_dt
 * share a storage, else its lin_dt copy that ln_bwd left in ga. */
static const void *dres_lin(const gpt_run *r)
{
    return r->m->lin_dt == r->m->resid_dt ? wsp(r, r->L.dres) : wsp(r, r->L.ga);
}

/* ---- attention ----------------------------------------------------------------------------- */

/* The causal entries of the fp32 scores S [B x H x T x T] accounted as Q K^T's outputs: row
 * i of every (sequence, head) packed by one 2-D copy, as many rows as the buffer holds. */
static int diag_scores(const gpt_run *r, int layer, const float *S)
{
    size_t bh = (size_t)r->B * (size_t)r->H, T = (size_t)r->T, fill = 0;
    float *buf = wsp(r, r->L.dg);
    gpu_dtype mmd = r->m->mm_dt;
    int rc = 0;
    for (size_t i = 0; i < T && rc == 0; i++) {
        size_t k = bh * (i + 1);
        if (fill + k > r->L.dg_floats) {
            rc = diag32(r, layer, mmd, GPU_CUDA_DIAG_FORWARD, buf, fill);
            fill = 0;
        }
        if (rc == 0)
            rc = gpu_cuda_c_check(cudaMemcpy2DAsync(buf + fill, (i + 1) * sizeof(float), S + i * T,
                                                    T * T * sizeof(float), (i + 1) * sizeof(float),
                                                    bh, cudaMemcpyDeviceToDevice, r->st),
                                  "cudaMemcpy2DAsync");
        fill += k;
    }
    if (rc == 0)
        rc = diag32(r, layer, mmd, GPU_CUDA_DIAG_FORWARD, buf, fill);
    return rc;
}

/* dQ and dK (the first 2C columns of the fp32 dQKV [N x 3C]) accounted as the score
 * product's input gradients, packed by 2-D copies. */
static int diag_dqk(const gpt_run *r, int layer, const float *dq)
{
    size_t w = 2 * (size_t)r->C, ld = 3 * (size_t)r->C, rows = r->L.dg_floats / w;
    float *buf = wsp(r, r->L.dg);
    for (size_t r0 = 0; r0 < (size_t)r->N; r0 += rows) {
        size_t k = (size_t)r->N - r0 < rows ? (size_t)r->N - r0 : rows;
        int rc = gpu_cuda_c_check(cudaMemcpy2DAsync(buf, w * sizeof(float), dq + r0 * ld,
                                                    ld * sizeof(float), w * sizeof(float), k,
                                                    cudaMemcpyDeviceToDevice, r->st),
                                  "cudaMemcpy2DAsync");
        if (rc == 0)
            rc = diag32(r, layer, r->m->mm_dt, GPU_CUDA_DIAG_INPUT_GRAD, buf, k * w);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* Operands on the qkv layout [N x 3C] (mm_dt): part 0 (Q), 1 (K) or 2 (V). */
static aop qkv_op(const gpt_run *r, void *qkv, int part)
{
    int ld = 3 * r->C;
    return (aop){el(qkv, (size_t)part * r->C, r->m->mm_dt), r->m->mm_dt, ld, (int64_t)r->T * ld,
                 r->hd};
}

/* A score-shaped operand [B x H x T x T] stored in dt. */
static aop tt_op(const gpt_run *r, void *p, gpu_dtype dt)
{
    int64_t tt = (int64_t)r->T * r->T;
    return (aop){p, dt, r->T, tt * r->H, tt};
}

/* A head-interleaved operand [N x ld] with head columns at hd apart. */
static aop rows_op(const gpt_run *r, void *p, gpu_dtype dt, int ld)
{
    return (aop){p, dt, ld, (int64_t)r->T * ld, r->hd};
}

/* gpu_gpt_attention_fwd for layer l: qkv -> probs (saved) -> atty (lin_dt). */
static int attn_fwd(const gpt_run *r, int l)
{
    const gpu_gpt *m = r->m;
    gpu_dtype mmd = m->mm_dt, lin = m->lin_dt;
    bool dg = r->c->diag != NULL;
    void *qkv = act(r, l, r->L.b.qkv), *P = act(r, l, r->L.b.probs);
    void *atty = act(r, l, r->L.b.atty), *S = wsp(r, r->L.scores);
    void *Pm = m->sm_dt != mmd ? act(r, l, r->L.b.pm) : P;
    gpu_dtype sdt = dg ? GPU_FP32 : mmd;
    int T = r->T, hd = r->hd, BH = r->B * r->H;

    if (m->flash) /* y straight into atty: lin_dt is mm_dt, or fp32 holding its values */
        return gpu_cuda_flash_fwd_launch(qkv, mmd, r->B, T, r->H, hd, P, atty, lin, r->st);
    int rc =
        agemm(r, false, true, T, T, hd, qkv_op(r, qkv, 0), qkv_op(r, qkv, 1), tt_op(r, S, sdt));
    if (rc == 0 && dg)
        rc = diag_scores(r, dl(r, l, GPU_CUDA_GPT_SCORES), S);
    if (rc == 0)
        rc = gpu_cuda_attn_softmax_fwd_launch(S, sdt, BH, T, hd, mmd, m->sm_dt, P, m->sm_dt,
                                              Pm != P ? Pm : NULL, mmd, r->st);
    if (rc != 0)
        return rc;
    /* Y = rd(Pm V, mm_dt), heads merged, then cast to lin_dt */
    bool direct = mmd == lin;
    void *Y = direct ? atty : wsp(r, r->L.f32);
    gpu_dtype ydt = direct ? lin : GPU_FP32;
    rc = agemm(r, false, false, T, hd, T, tt_op(r, Pm, mmd), qkv_op(r, qkv, 2),
               rows_op(r, Y, ydt, r->C));
    if (rc == 0 && !direct)
        rc = convert(r, Y, GPU_FP32, atty, lin, r->nC, mmd);
    return rc;
}

/* The materialised backward of layer l (gpu_gpt_attention_bwd): dQKV in fp32 into dq. */
static int attn_bwd_dense(const gpt_run *r, int l, float *dq)
{
    const gpu_gpt *m = r->m;
    gpu_dtype mmd = m->mm_dt, smd = m->sm_dt;
    int T = r->T, hd = r->hd, BH = r->B * r->H, layer = dl(r, l, GPU_CUDA_GPT_SCORES);
    size_t bhtt = (size_t)BH * T * T;
    void *qkv = act(r, l, r->L.b.qkv), *P = act(r, l, r->L.b.probs);
    void *dY = wsp(r, r->L.gd), *dS = wsp(r, r->L.scores);
    void *Pm = smd != mmd ? act(r, l, r->L.b.pm) : P; /* P's cast, saved by the forward */

    /* dV = Pm^T dY; dP = dY V^T (rounded to mm_dt) */
    int rc = agemm(r, true, false, T, hd, T, tt_op(r, Pm, mmd), rows_op(r, dY, mmd, r->C),
                   rows_op(r, dq + 2 * r->C, GPU_FP32, 3 * r->C));
    if (rc == 0)
        rc = agemm(r, false, true, T, T, hd, rows_op(r, dY, mmd, r->C), qkv_op(r, qkv, 2),
                   tt_op(r, dS, mmd));
    if (rc == 0)
        rc = gpu_cuda_attn_softmax_bwd_launch(P, smd, dS, mmd, BH, T, hd, mmd, smd, dS, mmd, r->st);
    if (rc == 0)
        rc = diag_any(r, layer, mmd, GPU_CUDA_DIAG_BACKWARD, dS, mmd, bhtt);
    /* dQ = dS K, dK = dS^T Q */
    if (rc == 0)
        rc = agemm(r, false, false, T, hd, T, tt_op(r, dS, mmd), qkv_op(r, qkv, 1),
                   rows_op(r, dq, GPU_FP32, 3 * r->C));
    if (rc == 0)
        rc = agemm(r, true, false, T, hd, T, tt_op(r, dS, mmd), qkv_op(r, qkv, 0),
                   rows_op(r, dq + r->C, GPU_FP32, 3 * r->C));
    return rc;
}

/* The flash backward of layer l (gpu_gpt_flash_bwd): dY accounted as the gradient arriving,
 * dQKV into out in odt (fp32 before its rounding, or rounded to mm_dt); the scores region
 * holds D. */
static int attn_bwd_flash(const gpt_run *r, int l, void *out, gpu_dtype odt)
{
    const gpu_gpt *m = r->m;
    void *dY = wsp(r, r->L.gd);
    int rc = diag_any(r, dl(r, l, GPU_CUDA_GPT_SCORES), m->mm_dt, GPU_CUDA_DIAG_BACKWARD, dY,
                      m->mm_dt, r->nC);
    if (rc == 0)
        rc = gpu_cuda_flash_bwd_launch(act(r, l, r->L.b.qkv), dY, m->mm_dt, act(r, l, r->L.b.atty),
                                       m->lin_dt, act(r, l, r->L.b.probs), r->B, r->T, r->H, r->hd,
                                       wsp(r, r->L.scores), out, odt, r->st);
    return rc;
}

/* The attention's backward for layer l: from dY in gd (mm_dt) to dQKV rounded to mm_dt, then
 * cast to lin_dt into gb (N x 3C). The flash kernels round into gb themselves when that is
 * all there is to do (lin_dt is mm_dt, no diagnostics to take before the rounding). */
static int attn_bwd(const gpt_run *r, int l)
{
    const gpu_gpt *m = r->m;
    float *dq = wsp(r, r->L.f32);
    if (m->flash && m->lin_dt == m->mm_dt && r->c->diag == NULL)
        return attn_bwd_flash(r, l, wsp(r, r->L.gb), m->mm_dt);
    int rc = m->flash ? attn_bwd_flash(r, l, dq, GPU_FP32) : attn_bwd_dense(r, l, dq);
    if (rc == 0 && r->c->diag != NULL)
        rc = diag_dqk(r, dl(r, l, GPU_CUDA_GPT_SCORES), dq);
    if (rc == 0)
        rc = convert(r, dq, GPU_FP32, wsp(r, r->L.gb), m->lin_dt, 3 * r->nC, m->mm_dt);
    return rc;
}

/* ---- the model ----------------------------------------------------------------------------- */

/* rc, after closing the step profile's phase (when the step is profiled and rc is 0). */
static int mark(const gpt_run *r, int rc, const char *phase)
{
    if (rc == 0)
        gpu_cuda_prof_mark(r->c->prof, r->st, phase);
    return rc;
}

/* gpt.c's block_fwd for layer l, after its ln1 (the forward or the block before ran it); the
 * block's last residual add is fused into the layer norm that follows it. */
static int block_fwd(const gpt_run *r, int l)
{
    const gpu_gpt *m = r->m;
    const gpu_gpt_block *P = &m->blk[l];
    const blk_off *b = &r->L.b;
    gpu_dtype lin = m->lin_dt;
    int C = r->C;
    void *ga = wsp(r, r->L.ga), *fc = act(r, l, b->fc), *gelu = act(r, l, b->gelu);
    ln_site ln2 = ln_at(r, l, 2);

    int rc = mark(r, linear_fwd(r, act(r, l, b->ln1), C, 3 * C, P->qkv_w, P->qkv_b,
                                act(r, l, b->qkv), m->mm_dt, dl(r, l, GPU_CUDA_GPT_QKV)),
                  "linear.fwd");
    if (rc == 0)
        rc = mark(r, attn_fwd(r, l), "attention.fwd");
    if (rc == 0)
        rc = mark(r, linear_fwd(r, act(r, l, b->atty), C, C, P->proj_w, P->proj_b, ga, lin,
                                dl(r, l, GPU_CUDA_GPT_PROJ)),
                  "linear.fwd");
    if (rc == 0)
        rc = mark(r, ln_fwd(r, ln2, act(r, l, b->resid), ga), "layernorm.fwd");
    if (rc == 0)
        rc = mark(r, linear_fwd(r, ln2.y, C, 4 * C, P->fc_w, P->fc_b, fc, lin,
                                dl(r, l, GPU_CUDA_GPT_FC)),
                  "linear.fwd");
    if (rc == 0)
        rc = mark(r, gpu_cuda_gelu_tanh_fwd_launch(fc, lin, gelu, lin, 4 * r->nC, m->gelu_dt,
                                                   r->st),
                  "gelu.fwd");
    if (rc == 0)
        rc = mark(r, linear_fwd(r, gelu, 4 * C, C, P->mproj_w, P->mproj_b, ga, lin,
                                dl(r, l, GPU_CUDA_GPT_MPROJ)),
                  "linear.fwd");
    if (rc == 0) /* the next block's ln1, or ln_f */
        rc = mark(r, ln_fwd(r, ln_at(r, l + 1, 1), ln2.x, ga), "layernorm.fwd");
    return rc;
}

/* The tied head's logits rd(ln_f wte^T, lin_dt) into the logits buffer; with diagnostics
 * and a 16-bit lin_dt, through the fp32 buffer a chunk of rows at a time. */
static int head_fwd(const gpt_run *r)
{
    const gpu_gpt *m = r->m;
    gpu_dtype lin = m->lin_dt;
    int layer = dl(r, -1, 0), C = r->C, V = r->V;
    void *x = r->acts + r->L.lnf, *logits = r->acts + r->L.logits;
    size_t nv = (size_t)r->N * (size_t)V;
    if (r->c->diag == NULL || lin == GPU_FP32) {
        int rc = wgemm_fwd(r, x, r->N, C, V, m->wte, logits, lin, NULL);
        if (rc == 0 && lin == GPU_FP32)
            rc = diag32(r, layer, lin, GPU_CUDA_DIAG_FORWARD, logits, nv);
        return rc;
    }
    float *buf = wsp(r, r->L.dg);
    size_t rows = r->L.dg_floats / (size_t)V;
    for (size_t r0 = 0; r0 < (size_t)r->N; r0 += rows) {
        size_t k = (size_t)r->N - r0 < rows ? (size_t)r->N - r0 : rows;
        int rc = wgemm_fwd(r, cel(x, r0 * C, lin), (int)k, C, V, m->wte, buf, GPU_FP32, NULL);
        if (rc == 0)
            rc = diag_round(r, layer, GPU_CUDA_DIAG_FORWARD, buf, k * V, el(logits, r0 * V, lin),
                            lin);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* Forward of B sequences (1 <= B <= the max_batch planned); see cuda_model.h. x, y: device
 * tokens and targets (B x seq_len), ctx's buffers (acts and ws 256-byte aligned): borrowed.
 * Enqueued on ctx->stream, no host synchronisation. GPU_EINVAL for bad arguments. */
int gpu_cuda_gpt_forward(const gpu_gpt *m, const gpu_cuda_model_ctx *c, const int *x, const int *y,
                         int B)
{
    gpt_run r;
    int rc = run_init(&r, m, c, x, y, B, false);
    if (rc != 0)
        return rc;
    wref wte = wsrc(&r, m->wte, m->emb_dt), wpe = wsrc(&r, m->wpe, m->emb_dt);
    rc = mark(&r, gpu_cuda_embed_fwd_launch(x, B, r.T, r.C, r.V, wte.p, wpe.p, wte.dt,
                                            m->resid_dt, act(&r, 0, r.L.b.resid), m->resid_dt,
                                            r.st),
              "embed.fwd");
    if (rc == 0)
        rc = mark(&r, ln_fwd(&r, ln_at(&r, 0, 1), NULL, NULL), "layernorm.fwd");
    for (int l = 0; l < m->n_layer && rc == 0; l++)
        rc = block_fwd(&r, l);
    if (rc == 0)
        rc = head_fwd(&r);
    if (rc != 0)
        return rc;
    void *logits = r.acts + r.L.logits, *cew = wsp(&r, r.L.cew);
    if (c->state != NULL)
        rc = gpu_cuda_ce_fused_launch(GPU_CUDA_CE_GPT, logits, m->lin_dt, y, r.N, r.V, m->lin_dt,
                                      m->ce_dt, 1.0f, &c->state->scale_used, r.N, c->loss_sum,
                                      c->correct, cew, r.st);
    else
        rc = gpu_cuda_ce_fwd_launch(GPU_CUDA_CE_GPT, logits, m->lin_dt, y, r.N, r.V, m->lin_dt,
                                    m->ce_dt, NULL, GPU_FP32, c->loss_sum, c->correct, cew, r.st);
    return mark(&r, rc, "head.fwd");
}

/* gpt.c's gelu_bwd of layer l, in place on gb (lin_dt); without diagnostics fused with
 * mlp.fc's bias gradient (written into ctx->grads rounded to lin_dt), whose linear_bwd then
 * skips it. */
static int gelu_bwd(const gpt_run *r, int l)
{
    const gpu_gpt *m = r->m;
    gpu_dtype lin = m->lin_dt;
    void *gb = wsp(r, r->L.gb), *fc = act(r, l, r->L.b.fc);
    if (r->c->diag != NULL)
        return gpu_cuda_gelu_tanh_bwd_launch(gb, gb, lin, fc, lin, 4 * r->nC, m->gelu_dt, r->st);
    return gpu_cuda_gelu_tanh_bwd_bias_launch(gb, gb, lin, fc, lin, r->N, 4 * r->C, m->gelu_dt,
                                              lin, r->c->grads + m->blk[l].fc_b,
                                              wsp(r, r->L.colw), r->st);
}

/* gpt.c's block_bwd for layer l: dres holds the gradient of the block's output on entry (and
 * its lin_dt copy is in ga when their storages differ), of its input on return. */
static int block_bwd(const gpt_run *r, int l)
{
    const gpu_gpt *m = r->m;
    const gpu_gpt_block *P = &m->blk[l];
    const blk_off *b = &r->L.b;
    gpu_dtype lin = m->lin_dt;
    int C = r->C;
    void *ga = wsp(r, r->L.ga), *gb = wsp(r, r->L.gb);

    /* MLP */
    int rc = mark(r, linear_bwd(r, dres_lin(r), act(r, l, b->gelu), 4 * C, C, P->mproj_w,
                                P->mproj_b, gb, lin, dl(r, l, GPU_CUDA_GPT_MPROJ)),
                  "linear.bwd");
    if (rc == 0)
        rc = mark(r, gelu_bwd(r, l), "gelu.bwd");
    if (rc == 0) /* mlp.fc's bias gradient: taken by gelu_bwd unless collecting */
        rc = mark(r, linear_bwd(r, gb, act(r, l, b->ln2), C, 4 * C, P->fc_w,
                                r->c->diag == NULL ? NO_BIAS : P->fc_b, ga, lin,
                                dl(r, l, GPU_CUDA_GPT_FC)),
                  "linear.bwd");
    if (rc == 0)
        rc = mark(r, ln_bwd(r, ln_at(r, l, 2), true, true), "layernorm.bwd");
    /* attention */
    if (rc == 0)
        rc = mark(r, linear_bwd(r, dres_lin(r), act(r, l, b->atty), C, C, P->proj_w, P->proj_b,
                                wsp(r, r->L.gd), m->mm_dt, dl(r, l, GPU_CUDA_GPT_PROJ)),
                  "linear.bwd");
    if (rc == 0)
        rc = mark(r, attn_bwd(r, l), "attention.bwd");
    if (rc == 0)
        rc = mark(r, linear_bwd(r, gb, act(r, l, b->ln1), C, 3 * C, P->qkv_w, P->qkv_b, ga, lin,
                                dl(r, l, GPU_CUDA_GPT_QKV)),
                  "linear.bwd");
    if (rc == 0)
        rc = mark(r, ln_bwd(r, ln_at(r, l, 1), true, l > 0), "layernorm.bwd");
    return rc;
}

/* Backward after a forward with a state, the same x, y and B; see cuda_model.h. Every
 * gradient of ctx->grads is written. Enqueued on ctx->stream, no host synchronisation. */
int gpu_cuda_gpt_backward(const gpu_gpt *m, const gpu_cuda_model_ctx *c, const int *x, const int *y,
                          int B)
{
    gpt_run r;
    int rc = run_init(&r, m, c, x, y, B, true);
    if (rc != 0)
        return rc;
    void *ga = wsp(&r, r.L.ga), *dres = wsp(&r, r.L.dres);
    /* the head: dlogits were left in the logits by the forward's fused cross-entropy */
    rc = mark(&r, linear_bwd(&r, r.acts + r.L.logits, r.acts + r.L.lnf, r.C, r.V, m->wte,
                             NO_BIAS, ga, m->lin_dt, dl(&r, -1, 0)),
              "head.bwd");
    if (rc == 0)
        rc = mark(&r, ln_bwd(&r, ln_at(&r, m->n_layer, 1), false, true), "layernorm.bwd");
    if (rc == 0) {
        gpu_grad_done(c->ready, m->lnf_w, (size_t)r.C);
        gpu_grad_done(c->ready, m->lnf_b, (size_t)r.C);
    }
    for (int l = m->n_layer - 1; l >= 0 && rc == 0; l--)
        if ((rc = block_bwd(&r, l)) == 0)
            gpu_gpt_block_done(m, l, c->ready);
    /* the embedding: wpe written, wte's rows added onto the head's gradient in row order */
    if (rc == 0)
        rc = gpu_cuda_c_check(
            cudaMemsetAsync(c->grads + m->wpe, 0, sizeof(float) * r.T * (size_t)r.C, r.st),
            "cudaMemsetAsync");
    if (rc == 0)
        rc = gpu_cuda_embed_bwd_launch(x, B, r.T, r.C, r.V, dres, m->resid_dt, m->emb_dt,
                                       c->grads + m->wte, c->grads + m->wpe, wsp(&r, r.L.embw),
                                       r.L.embw_bytes, r.st);
    if (rc == 0) {
        gpu_grad_done(c->ready, m->wpe, (size_t)r.T * (size_t)r.C);
        gpu_grad_done(c->ready, m->wte, (size_t)r.V * (size_t)r.C);
    }
    return mark(&r, rc, "embed.bwd");
}
