/*
 * cuda_mlp.c - the MLP of gpu/mlp.c on a CUDA device: the same graph with the same rounding
 * points, built from the kernels of cuda_blas.h, cuda_ops.h and cuda_step.h (contract in
 * gpu/cuda/cuda_model.h).
 *
 * Forward, per linear l (in = width[l], out = width[l + 1]):
 *   o = x_l W^T            cuBLASLt, operands in lin_dt, fp32 accumulation, fp32 output
 *   z = rd(o + b, lin_dt)  bias add (the bias read in its storage dtype and added in fp32),
 *                          saved in lin_dt when backward needs it (GELU layers, the logits)
 *   x_{l+1} = rd(rd(act(z), act_dt), lin_dt)
 * then the cross-entropy in ce_dt (GPU_CUDA_CE_MLP: mlp.c's arithmetic), its probabilities
 * saved in ce_dt. The input is cast to lin_dt first. A linear that runs in fp32 reads the fp32
 * master weights when there are some, as mlp.c does; 16-bit weights without a master are
 * widened to fp32 for it (exactly).
 * Backward: dz = rd(rd((p - onehot) * S / B, ce_dt), lin_dt) with S read on the device
 * (state->scale_used); per linear, from the top: the weight gradient dz^T x_l (fp32 output
 * written at grads + w_off[l], then rounded to lin_dt in place), the bias gradient (column
 * sums of dz in fp32, rounded to lin_dt, at grads + b_off[l]) and, below the first layer, the
 * input gradient dz W (fp32, rounded to lin_dt) through the activation's backward in act_dt.
 * Every gradient is rounded exactly where mlp.c rounds it; the fp32 gradient block uses the
 * CPU plan's offsets.
 *
 * fp8 (c->fp8; docs/fp8.md): a linear that runs in fp8 casts its input and its weight (with
 * the scaling rows of gpu/fp8.h on the device, through cuda_blas.h's kernels) into fp8 copies
 * and their transposes, which the fp8 GEMMs take in the TN layout: o = x W^T forward; in
 * backward the output gradient is cast with its transpose, dW = dz^T x and dX = dz W; the
 * rest of the layer is the bf16 one. Every dimension is a multiple of 16
 * (gpu_cuda_mlp_fp8_plan).
 *
 * Casts and roundings that are not part of a kernel are bias adds of a row of zeros:
 * rd(v + 0, dt) = rd(v, dt) for every v except -0, which becomes +0 (the only bit that can
 * differ from the CPU's casts; no value, comparison or update depends on it).
 *
 * Diagnostics (c->diag not NULL): each linear l accounts, as layer l, its fp32 outputs after
 * the bias add and before rounding (forward), and in backward the gradient arriving at its
 * output, its weight and bias gradients and its input gradient before they are rounded, in
 * mlp.c's order, so that the first layer to hold inf/NaN is the CPU's. The fp32 values
 * diagnostics need are materialised only then. mlp.c's "starved units" analysis (gradients
 * that are 0 because everything upstream flushed) is not done on the device: those counts
 * stay 0.
 *
 * Memory: the activation block and the workspace are laid out for the batch of each call
 * (every region grows with B, so blocks planned for max_batch hold any B <= max_batch).
 * Threads: everything is enqueued on c->stream; nothing synchronises the host.
 */
#include <stdio.h>
#include <string.h>

#include "gpu/cuda/cuda_model.h"
#include "gpu/cuda/cuda_util.h"
#include "gpu/fp8.h"

static bool act_needs_z(const gpu_mlp *m, int l)
{
    return l == m->nlin - 1 || m->act == GPU_ACT_GELU;
}

static int max_width(const gpu_mlp *m)
{
    int w = 0;
    for (int i = 0; i <= m->nlin; i++)
        w = m->width[i] > w ? m->width[i] : w;
    return w;
}

/* Byte offsets in the activation block for B rows. */
typedef struct {
    size_t x[GPU_MAX_LAYERS]; /* input of linear l, lin_dt, B x width[l] */
    size_t z[GPU_MAX_LAYERS]; /* output of linear l when backward needs it, lin_dt */
    size_t probs;             /* the softmax, ce_dt, B x classes */
    size_t bytes;
} mlp_acts;

/* Byte offsets in the workspace for B rows. */
typedef struct {
    size_t zero;  /* fp32 zeros, max width: the bias of a plain cast */
    size_t f32;   /* fp32 B x max width: GEMM outputs, fp32 copies for diagnostics */
    size_t dz[2]; /* lin_dt B x max width: the gradient between two linears, twice */
    size_t wide;  /* fp32 weights of an fp32 linear widened from 16 bits (lin_dt fp32 only) */
    size_t ce;    /* cross-entropy row losses */
    size_t col;   /* bias-gradient partial sums */
    size_t bytes;
} mlp_ws;

static void acts_layout(const gpu_mlp *m, int B, mlp_acts *a)
{
    size_t es = gpu_dtype_size(m->lin_dt), off = 0, rows = (size_t)B;
    for (int l = 0; l < m->nlin; l++) {
        a->x[l] = off;
        off = gpu_align256(off + rows * (size_t)m->width[l] * es);
        a->z[l] = off;
        if (act_needs_z(m, l))
            off = gpu_align256(off + rows * (size_t)m->width[l + 1] * es);
    }
    a->probs = off;
    off = gpu_align256(off + rows * (size_t)m->width[m->nlin] * gpu_dtype_size(m->ce_dt));
    a->bytes = off;
}

static void ws_layout(const gpu_mlp *m, int B, mlp_ws *w)
{
    size_t maxw = (size_t)max_width(m), rows = (size_t)B, es = gpu_dtype_size(m->lin_dt);
    size_t wmax = 0, col = 0, off = 0;
    for (int l = 0; l < m->nlin; l++) {
        size_t n = (size_t)m->width[l] * (size_t)m->width[l + 1];
        size_t c = gpu_cuda_bias_grad_workspace(B, m->width[l + 1]);
        wmax = n > wmax ? n : wmax;
        col = c > col ? c : col;
    }
    w->zero = off;
    off = gpu_align256(off + maxw * sizeof(float));
    w->f32 = off;
    off = gpu_align256(off + rows * maxw * sizeof(float));
    for (int i = 0; i < 2; i++) {
        w->dz[i] = off;
        off = gpu_align256(off + rows * maxw * es);
    }
    w->wide = off;
    if (m->lin_dt == GPU_FP32) /* the plan cannot tell whether the weights are 16-bit */
        off = gpu_align256(off + wmax * sizeof(float));
    w->ce = off;
    off = gpu_align256(off + gpu_cuda_ce_workspace(B));
    w->col = off;
    off = gpu_align256(off + col);
    w->bytes = off;
}

/* Byte offsets in the fp8 block for B rows: per fp8 linear l its input x8[l] (B x in) and
 * its transpose, its weight w8[l] (out x in) and its transpose; the output gradient of the
 * linear in backward (B x max width) and its transpose, shared. */
typedef struct {
    size_t x8[GPU_MAX_LAYERS], x8t[GPU_MAX_LAYERS], w8[GPU_MAX_LAYERS], w8t[GPU_MAX_LAYERS];
    size_t g8, g8t, bytes;
} mlp_fp8;

static void fp8_layout(const gpu_mlp *m, const bool *on, int B, mlp_fp8 *f)
{
    size_t off = 0, rows = (size_t)B, maxw = (size_t)max_width(m);
    for (int l = 0; l < m->nlin; l++) {
        size_t in = (size_t)m->width[l], out = (size_t)m->width[l + 1];
        if (!on[l])
            continue;
        f->x8[l] = off;
        off = gpu_align256(off + rows * in);
        f->x8t[l] = off;
        off = gpu_align256(off + rows * in);
        f->w8[l] = off;
        off = gpu_align256(off + out * in);
        f->w8t[l] = off;
        off = gpu_align256(off + out * in);
    }
    f->g8 = off;
    off = gpu_align256(off + rows * maxw);
    f->g8t = off;
    off = gpu_align256(off + rows * maxw);
    f->bytes = off;
}

/* See cuda_model.h. */
int gpu_cuda_mlp_fp8_plan(const gpu_mlp *m, const bool *on, int max_batch, size_t *bytes, char *err,
                          size_t errlen)
{
    mlp_fp8 f;
    if (max_batch % 16) {
        snprintf(err, errlen,
                 "batch_size: fp8 on CUDA multiplies the batch's rows in the weight "
                 "gradients' GEMMs, so each rank's %d rows must be a multiple of 16",
                 max_batch);
        return GPU_EINVAL;
    }
    for (int l = 0; l < m->nlin; l++)
        if (on[l] && (m->width[l] % 16 || m->width[l + 1] % 16)) {
            snprintf(err, errlen,
                     "precision.fp8.keep: fc%d is %d x %d, and fp8 GEMMs on CUDA need both "
                     "a multiple of 16: keep fc%d in bf16",
                     l + 1, m->width[l + 1], m->width[l], l + 1);
            return GPU_EINVAL;
        }
    fp8_layout(m, on, max_batch, &f);
    *bytes = f.bytes;
    return 0;
}

/* Plan the device blocks; see cuda_model.h. */
int gpu_cuda_mlp_plan(const gpu_mlp *m, int max_batch, size_t *acts_bytes, size_t *ws_bytes)
{
    mlp_acts a;
    mlp_ws w;
    if (m == NULL || acts_bytes == NULL || ws_bytes == NULL || m->nlin < 1 ||
        m->nlin >= GPU_MAX_LAYERS || max_batch < 1 || max_batch > m->max_batch)
        return GPU_EINVAL;
    acts_layout(m, max_batch, &a);
    ws_layout(m, max_batch, &w);
    *acts_bytes = a.bytes;
    *ws_bytes = w.bytes;
    return 0;
}

/* What one pass works on: the model, the context and the layouts for its batch. */
typedef struct {
    const gpu_mlp *m;
    const gpu_cuda_model_ctx *c;
    int B;
    mlp_acts a;
    mlp_ws w;
    mlp_fp8 f; /* an fp8 job's */
    uint8_t *acts, *ws;
    const float *zero;
} mlp_pass;

static int pass_init(mlp_pass *p, const gpu_mlp *m, const gpu_cuda_model_ctx *c, int B)
{
    if (m == NULL || c == NULL || c->blas == NULL || c->work == NULL || c->acts == NULL ||
        c->ws == NULL || m->nlin < 1 || m->nlin >= GPU_MAX_LAYERS || B < 1 || B > m->max_batch)
        return GPU_EINVAL;
    memset(p, 0, sizeof(*p));
    p->m = m;
    p->c = c;
    p->B = B;
    acts_layout(m, B, &p->a);
    ws_layout(m, B, &p->w);
    p->acts = c->acts;
    p->ws = c->ws;
    if (c->fp8)
        fp8_layout(m, c->fp8_on, B, &p->f);
    p->zero = (const float *)(const void *)(p->ws + p->w.zero);
    return gpu_cuda_c_check(cudaMemsetAsync(p->ws + p->w.zero, 0,
                                            (size_t)max_width(m) * sizeof(float), c->stream),
                            "cudaMemsetAsync (cast row)");
}

/* out = rd(in, dt) stored in odt, rows x n (n <= max width); in stored in idt. */
static int cast(const mlp_pass *p, const void *in, gpu_dtype idt, int rows, int n, gpu_dtype dt,
                void *out, gpu_dtype odt)
{
    return gpu_cuda_bias_add_launch(in, idt, p->zero, GPU_FP32, rows, n, dt, out, odt,
                                    p->c->stream);
}

/* Account x[0..n) (fp32) for linear l as kind, when diagnostics are on. */
static int diag(const mlp_pass *p, int l, gpu_cuda_diag_kind kind, const float *x, size_t n)
{
    if (p->c->diag == NULL)
        return 0;
    return gpu_cuda_diag_launch(p->c->diag, l, p->m->lin_dt, kind, x, n, p->c->stream);
}

/* A parameter tensor as mlp.c's weight_ptr picks it: the fp32 master for an fp32 linear when
 * there is one, else the working copy. */
static const void *param(const mlp_pass *p, size_t off, gpu_dtype *dt)
{
    const gpu_cuda_model_ctx *c = p->c;
    if (p->m->lin_dt == GPU_FP32 && c->master != NULL) {
        *dt = GPU_FP32;
        return c->master + off;
    }
    *dt = c->wdt;
    return (const uint8_t *)c->work + off * gpu_dtype_size(c->wdt);
}

/* The weight of linear l as a GEMM operand in lin_dt (widened into the workspace when an
 * fp32 linear reads 16-bit weights). */
static int weight(const mlp_pass *p, int l, const void **W)
{
    const gpu_mlp *m = p->m;
    int in = m->width[l], out = m->width[l + 1];
    gpu_dtype dt;
    *W = param(p, m->w_off[l], &dt);
    if (dt == m->lin_dt)
        return 0;
    if (m->lin_dt != GPU_FP32)
        return GPU_EINVAL; /* autocast runs a linear in the job's dtype or in fp32 only */
    void *wide = p->ws + p->w.wide;
    *W = wide;
    return cast(p, param(p, m->w_off[l], &dt), dt, out, in, GPU_FP32, wide, GPU_FP32);
}

/* C[M x N] (fp32, ldc) = op(A) op(B), operands in dt. */
static int gemm(const mlp_pass *p, bool ta, bool tb, int M, int N, int K, const void *A,
                int lda, const void *B, int ldb, gpu_dtype dt, float *C, int ldc)
{
    gpu_cuda_mm mm;
    memset(&mm, 0, sizeof(mm));
    mm.ta = ta;
    mm.tb = tb;
    mm.M = M;
    mm.N = N;
    mm.K = K;
    mm.A = A;
    mm.adt = dt;
    mm.lda = lda;
    mm.B = B;
    mm.bdt = dt;
    mm.ldb = ldb;
    mm.C = C;
    mm.cdt = GPU_FP32;
    mm.ldc = ldc;
    mm.beta = 0.0f;
    mm.batch = 1;
    mm.epilogue = GPU_CUDA_EPI_NONE;
    return gpu_cuda_matmul(p->c->blas, p->c->stream, &mm);
}

/* ---- fp8 ------------------------------------------------------------------------------------ */

static bool is_fp8(const mlp_pass *p, int l)
{
    return p->c->fp8 != NULL && p->c->fp8_on[l];
}

/* Linear l's forward GEMM in fp8: its input and its weight (the fp32 master when there is
 * one) cast with their transposes kept for backward, o = x W^T. */
static int fp8_fwd(const mlp_pass *p, int l, float *o)
{
    const gpu_mlp *m = p->m;
    uint8_t *b = p->c->fp8_block;
    int B = p->B, in = m->width[l], out = m->width[l + 1];
    GPU_TRY(gpu_cuda_fp8_cast_op(p->c, l, GPU_FP8_X, p->acts + p->a.x[l], m->lin_dt, B, in,
                                 b + p->f.x8[l], b + p->f.x8t[l]));
    GPU_TRY(
        gpu_cuda_fp8_cast_weight(p->c, l, m->w_off[l], out, in, b + p->f.w8[l], b + p->f.w8t[l]));
    return gpu_cuda_fp8_gemm_op(p->c, l, B, out, in, b + p->f.x8[l], GPU_FP8_X, b + p->f.w8[l],
                                GPU_FP8_W, o);
}

/* Linear l's output gradient dz (B x out, lin_dt) cast to fp8 with its transpose. */
static int fp8_grad(const mlp_pass *p, int l, const void *dz)
{
    uint8_t *b = p->c->fp8_block;
    return gpu_cuda_fp8_cast_op(p->c, l, GPU_FP8_G, dz, p->m->lin_dt, p->B, p->m->width[l + 1],
                                b + p->f.g8, b + p->f.g8t);
}

/* Linear l forward and its epilogue (bias, rounding, saved z, activation). */
static int linear_fwd(const mlp_pass *p, int l)
{
    const gpu_mlp *m = p->m;
    cudaStream_t s = p->c->stream;
    int B = p->B, in = m->width[l], out = m->width[l + 1];
    size_t n = (size_t)B * (size_t)out;
    float *o = (float *)(void *)(p->ws + p->w.f32);
    const void *W, *bias;
    gpu_dtype bdt;

    if (is_fp8(p, l)) {
        GPU_TRY(fp8_fwd(p, l, o));
    } else {
        GPU_TRY(weight(p, l, &W));
        GPU_TRY(
            gemm(p, false, true, B, out, in, p->acts + p->a.x[l], in, W, in, m->lin_dt, o, out));
    }
    bias = param(p, m->b_off[l], &bdt);
    if (p->c->diag != NULL) { /* the fp32 outputs before rounding, as mlp.c accounts them */
        GPU_TRY(gpu_cuda_bias_add_launch(o, GPU_FP32, bias, bdt, B, out, GPU_FP32, o, GPU_FP32, s));
        GPU_TRY(diag(p, l, GPU_CUDA_DIAG_FORWARD, o, n));
        bias = p->zero;
        bdt = GPU_FP32;
    }
    void *z = o;
    gpu_dtype zdt = GPU_FP32;
    if (act_needs_z(m, l)) {
        z = p->acts + p->a.z[l];
        zdt = m->lin_dt;
    }
    GPU_TRY(gpu_cuda_bias_add_launch(o, GPU_FP32, bias, bdt, B, out, m->lin_dt, z, zdt, s));
    if (l == m->nlin - 1)
        return 0;
    return gpu_cuda_act_fwd_launch(m->act, z, zdt, p->acts + p->a.x[l + 1], m->lin_dt, n,
                                   m->act_dt, s);
}

/* Forward; see cuda_model.h. */
int gpu_cuda_mlp_forward(const gpu_mlp *m, const gpu_cuda_model_ctx *c, const float *x,
                         const int *y, int B)
{
    mlp_pass p;
    if (x == NULL || y == NULL || c == NULL || c->loss_sum == NULL || c->correct == NULL)
        return GPU_EINVAL;
    GPU_TRY(pass_init(&p, m, c, B));
    /* the input is cast to the first linear's dtype (autocast's input cast) */
    GPU_TRY(cast(&p, x, GPU_FP32, B, m->width[0], m->lin_dt, p.acts + p.a.x[0], m->lin_dt));
    for (int l = 0; l < m->nlin; l++) {
        GPU_TRY(linear_fwd(&p, l));
        gpu_cuda_prof_mark(c->prof, c->stream, "linear.fwd"); /* with its activation */
    }
    int last = m->nlin - 1;
    GPU_TRY(gpu_cuda_ce_fwd_launch(GPU_CUDA_CE_MLP, p.acts + p.a.z[last], m->lin_dt, y, B,
                                   m->width[m->nlin], m->lin_dt, m->ce_dt, p.acts + p.a.probs,
                                   m->ce_dt, c->loss_sum, c->correct, p.ws + p.w.ce, c->stream));
    gpu_cuda_prof_mark(c->prof, c->stream, "head.fwd");
    return 0;
}

/* The weight and bias gradients of linear l from dz (B x out, lin_dt), with their
 * diagnostics: the arriving gradient, then each gradient before it is rounded. */
static int param_grads(const mlp_pass *p, int l, const void *dz)
{
    const gpu_mlp *m = p->m;
    const gpu_cuda_model_ctx *c = p->c;
    int B = p->B, in = m->width[l], out = m->width[l + 1];
    float *gw = c->grads + m->w_off[l], *gb = c->grads + m->b_off[l];
    bool lowp = m->lin_dt != GPU_FP32, on = c->diag != NULL;

    if (is_fp8(p, l)) { /* dW = dz^T x on the transposed copies (TN) */
        uint8_t *b = c->fp8_block;
        GPU_TRY(fp8_grad(p, l, dz));
        GPU_TRY(gpu_cuda_fp8_gemm_op(p->c, l, out, in, B, b + p->f.g8t, GPU_FP8_G, b + p->f.x8t[l],
                                     GPU_FP8_X, gw));
    } else {
        GPU_TRY(
            gemm(p, true, false, out, in, B, dz, out, p->acts + p->a.x[l], in, m->lin_dt, gw, in));
    }
    if (on) {
        const float *dz32 = dz;
        if (lowp) {
            float *f = (float *)(void *)(p->ws + p->w.f32);
            GPU_TRY(cast(p, dz, m->lin_dt, B, out, GPU_FP32, f, GPU_FP32));
            dz32 = f;
        }
        GPU_TRY(diag(p, l, GPU_CUDA_DIAG_BACKWARD, dz32, (size_t)B * (size_t)out));
        GPU_TRY(diag(p, l, GPU_CUDA_DIAG_WEIGHT_GRAD, gw, (size_t)out * (size_t)in));
    }
    if (lowp)
        GPU_TRY(cast(p, gw, GPU_FP32, out, in, m->lin_dt, gw, GPU_FP32));
    GPU_TRY(gpu_cuda_bias_grad_launch(dz, m->lin_dt, B, out, on ? GPU_FP32 : m->lin_dt, gb,
                                      p->ws + p->w.col, c->stream));
    if (on) {
        GPU_TRY(diag(p, l, GPU_CUDA_DIAG_WEIGHT_GRAD, gb, (size_t)out));
        if (lowp)
            GPU_TRY(cast(p, gb, GPU_FP32, 1, out, m->lin_dt, gb, GPU_FP32));
    }
    return 0;
}

/* The gradient of linear l's input (l >= 1) from dz into dx (B x in, lin_dt): dz W in fp32,
 * rounded to lin_dt, then through the activation of layer l - 1 in act_dt. */
static int input_grad(const mlp_pass *p, int l, const void *dz, void *dx)
{
    const gpu_mlp *m = p->m;
    int B = p->B, in = m->width[l], out = m->width[l + 1];
    size_t n = (size_t)B * (size_t)in;
    bool lowp = m->lin_dt != GPU_FP32;
    float *d32 = lowp ? (float *)(void *)(p->ws + p->w.f32) : dx;
    const void *W, *saved;

    if (is_fp8(p, l)) { /* dX = dz W: the gradient's fp8 copy (param_grads made it), W^T */
        uint8_t *b = p->c->fp8_block;
        GPU_TRY(gpu_cuda_fp8_gemm_op(p->c, l, B, in, out, b + p->f.g8, GPU_FP8_G, b + p->f.w8t[l],
                                     GPU_FP8_W, d32));
    } else {
        GPU_TRY(weight(p, l, &W));
        GPU_TRY(gemm(p, false, false, B, in, out, dz, out, W, in, m->lin_dt, d32, in));
    }
    GPU_TRY(diag(p, l, GPU_CUDA_DIAG_INPUT_GRAD, d32, n));
    if (lowp)
        GPU_TRY(cast(p, d32, GPU_FP32, B, in, m->lin_dt, dx, m->lin_dt));
    /* ReLU masks with its output x_l; GELU differentiates at its input z_{l-1} */
    saved = m->act == GPU_ACT_RELU ? p->acts + p->a.x[l] : p->acts + p->a.z[l - 1];
    return gpu_cuda_act_bwd_launch(m->act, dx, dx, m->lin_dt, saved, m->lin_dt, n, m->act_dt,
                                   p->c->stream);
}

/* Backward; see cuda_model.h. x is not read: the forward saved the input, cast to lin_dt. */
int gpu_cuda_mlp_backward(const gpu_mlp *m, const gpu_cuda_model_ctx *c, const float *x,
                          const int *y, int B)
{
    mlp_pass p;
    (void)x;
    if (y == NULL || c == NULL || c->grads == NULL || c->state == NULL)
        return GPU_EINVAL;
    GPU_TRY(pass_init(&p, m, c, B));
    void *dz = p.ws + p.w.dz[0], *dx = p.ws + p.w.dz[1];
    GPU_TRY(gpu_cuda_ce_bwd_launch(GPU_CUDA_CE_MLP, p.acts + p.a.probs, m->ce_dt, y, B,
                                   m->width[m->nlin], m->ce_dt, m->lin_dt, 0.0f,
                                   &c->state->scale_used, B, dz, m->lin_dt, c->stream));
    gpu_cuda_prof_mark(c->prof, c->stream, "head.bwd");
    for (int l = m->nlin - 1; l >= 0; l--) {
        GPU_TRY(param_grads(&p, l, dz));
        gpu_grad_done(c->ready, m->w_off[l], (size_t)m->width[l] * (size_t)m->width[l + 1]);
        gpu_grad_done(c->ready, m->b_off[l], (size_t)m->width[l + 1]);
        if (l > 0)
            GPU_TRY(input_grad(&p, l, dz, dx));
        gpu_cuda_prof_mark(c->prof, c->stream, "linear.bwd");
        if (l == 0)
            break;
        void *t = dz;
        dz = dx;
        dx = t;
    }
    return 0;
}
