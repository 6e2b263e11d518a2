/*
 * mlp.c - a multi-layer perceptron (linear, ReLU or GELU, ..., linear, softmax
 * cross-entropy) trained under the autocast policy.
 *
 * Numerics, the same contract a GPU with tensor cores follows: each linear layer runs in
 * lin_dt; its operands are stored in lin_dt, the GEMM accumulates in fp32 and the output
 * (bias added in fp32) is rounded to lin_dt, so a value beyond fp16's range becomes inf.
 * Activations compute in fp32 on their rounded input and round to act_dt. Cross-entropy
 * runs in ce_dt (fp32 by default). Backward runs in the dtype of its forward op: every
 * gradient leaves its op rounded to that op's dtype (a too-large loss scale overflows it,
 * a too-small gradient flushes to zero), and only then lands in the fp32 gradient block.
 *
 * Diagnostics (a gpu_diag, NULL = off, which costs one predictable branch per row or
 * layer): each linear layer ("fc1", ...) accounts its fp32 outputs row by row in the
 * epilogue before they are rounded, its weight, bias and input gradients chunk by chunk
 * right before they are rounded, and the units of its outputs that upstream flushing
 * starved of any gradient (starve_scan). Collecting changes no computed value.
 *
 * Buffers: parameters, activations and the fp32 scratch are owned by the caller (one
 * block each, llm.c style); this file only plans their layout and fills them.
 * Threads: none of its own; the GEMMs use the BLAS library's threads.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gpu/diag.h"
#include "gpu/fp8.h"
#include "gpu/gpu_int.h"
#include "gpu/mlp.h"

/* Columns of the bias gradient summed by one thread at a time. */
#define COL_BLOCK 128

static size_t align64(size_t n)
{
    return (n + 63) & ~(size_t)63;
}

static int act_needs_z(const gpu_mlp *m, int l)
{
    return l == m->nlin - 1 || m->act == GPU_ACT_GELU;
}

/* The weights' rounding in a GEMM: the fp32 master is rounded to the layer's dtype. */
static unsigned round_w(gpu_dtype wdt)
{
    return wdt == GPU_FP32 ? GPU_GEMM_ROUND_B : 0;
}

/* GEMM scratch of layer l's forward (fwd) or of its two backward products (!fwd), for
 * weights stored in wdt. dz is fp32 holding values of lin_dt. */
static size_t layer_gemm_scratch(const gpu_mlp *m, int l, gpu_dtype wdt, bool fwd)
{
    int in = m->width[l], out = m->width[l + 1], b = m->max_batch;
    gpu_dtype dt = m->lin_dt;
    if (fwd)
        return gpu_gemm_ex_scratch_floats(b, out, in, dt, wdt, dt, round_w(wdt));
    size_t dw = gpu_gemm_ex_scratch_floats(out, in, b, GPU_FP32, dt, dt, 0);
    size_t dx = gpu_gemm_ex_scratch_floats(b, in, out, GPU_FP32, wdt, dt, round_w(wdt));
    return dw > dx ? dw : dx;
}

/* The largest GEMM scratch of the forward or the backward, with the weights in the working
 * copy (wdt) or in the fp32 master. */
static size_t gemm_scratch(const gpu_mlp *m, gpu_dtype wdt, bool fwd)
{
    size_t most = 0;
    for (int l = 0; l < m->nlin; l++) {
        size_t a = layer_gemm_scratch(m, l, wdt, fwd), b = layer_gemm_scratch(m, l, GPU_FP32, fwd);
        most = a > most ? a : most;
        most = b > most ? b : most;
    }
    return most;
}

/* Floats after act_backward's row for the starve state (2 B + 4 maxw bytes). */
static size_t starve_floats(const gpu_mlp *m, int maxw)
{
    return (2 * (size_t)m->max_batch + 4 * (size_t)maxw + 3) / 4;
}

/* The scratch serves the forward and the backward in turn, each from its start:
 *   forward:  out32 [B x maxw] | bias32 [maxw] | GEMM scratch
 *   backward: dz [B x maxw] | dx [B x maxw] | tmp [maxw + starve] | GEMM scratch */
static size_t plan_scratch(const gpu_mlp *m, int maxw, gpu_dtype wdt)
{
    size_t slot = (size_t)m->max_batch * (size_t)maxw, w = (size_t)maxw;
    size_t fwd = slot + w + gemm_scratch(m, wdt, true);
    size_t bwd = 2 * slot + w + starve_floats(m, maxw) + gemm_scratch(m, wdt, false);
    return (fwd > bwd ? fwd : bwd) + 64;
}

/* Plan the MLP's layout; see gpu/mlp.h. */
int gpu_mlp_plan(gpu_mlp *m, const gpu_model_config *mc, const gpu_autocast *a, gpu_dtype dt,
                 int max_batch, char *err, size_t errlen)
{
    size_t off = 0, bytes = 0;
    int maxw = 0;

    memset(m, 0, sizeof(*m));
    if (mc->nlayers < 2 || mc->nlayers > GPU_MAX_LAYERS) {
        snprintf(err, errlen, "model.layers: needs 2 to %d widths", GPU_MAX_LAYERS);
        return GPU_EINVAL;
    }
    m->nlin = mc->nlayers - 1;
    m->act = mc->activation;
    m->max_batch = max_batch;
    for (int i = 0; i < mc->nlayers; i++) {
        if (mc->layers[i] < 1 || mc->layers[i] > 65536) {
            snprintf(err, errlen, "model.layers[%d]: width must be in 1..65536", i);
            return GPU_EINVAL;
        }
        m->width[i] = mc->layers[i];
        if (m->width[i] > maxw)
            maxw = m->width[i];
    }
    m->lin_dt = gpu_autocast_dtype(a, GPU_OP_LINEAR, dt, GPU_FP32);
    m->act_dt = gpu_autocast_dtype(a, mc->activation == GPU_ACT_GELU ? GPU_OP_GELU : GPU_OP_RELU,
                                   dt, m->lin_dt);
    m->ce_dt = gpu_autocast_dtype(a, GPU_OP_CROSS_ENTROPY, dt, m->lin_dt);
    for (int l = 0; l < m->nlin; l++) {
        m->w_off[l] = off;
        off += (size_t)m->width[l + 1] * m->width[l];
        m->b_off[l] = off;
        off += (size_t)m->width[l + 1];
    }
    m->nparams = off;
    for (int l = 0; l < m->nlin; l++) {
        size_t es = gpu_dtype_size(m->lin_dt);
        m->x_off[l] = bytes;
        bytes = align64(bytes + (size_t)max_batch * m->width[l] * es);
        m->z_off[l] = bytes;
        if (act_needs_z(m, l))
            bytes = align64(bytes + (size_t)max_batch * m->width[l + 1] * es);
    }
    m->probs_off = bytes;
    bytes = align64(bytes + (size_t)max_batch * m->width[m->nlin] * sizeof(float));
    m->act_bytes = bytes;
    /* the weights the GEMMs read are the working copy, which is 16-bit at most */
    m->scratch_floats = plan_scratch(m, maxw, dt);
    return 0;
}

/* The fp8 layers, the fp8 block and the scratch their GEMMs add; see gpu/mlp.h. */
int gpu_mlp_plan_fp8(gpu_mlp *m, const gpu_fp8_config *f, char *err, size_t errlen)
{
    char names[GPU_MAX_LAYERS][16];
    const char *np[GPU_MAX_LAYERS];
    size_t bytes = 0, most = 0;
    int maxw = 0;
    for (int l = 0; l < m->nlin; l++) {
        snprintf(names[l], sizeof(names[l]), "fc%d", l + 1);
        np[l] = names[l];
    }
    int rc = gpu_fp8_plan_keep(f, m->nlin, np, m->fp8, err, errlen);
    if (rc)
        return rc;
    for (int l = 0; l <= m->nlin; l++)
        maxw = m->width[l] > maxw ? m->width[l] : maxw;
    for (int l = 0; l < m->nlin; l++) {
        int in = m->width[l], out = m->width[l + 1], b = m->max_batch;
        if (!m->fp8[l])
            continue;
        m->x8_off[l] = bytes;
        bytes = align64(bytes + (size_t)b * in);
        m->w8_off[l] = bytes;
        bytes = align64(bytes + (size_t)out * in);
        size_t s = gpu_gemm_fp8_linear_scratch_floats(b, out, in);
        most = s > most ? s : most;
    }
    m->fp8_bytes = bytes;
    /* the gradient's fp8 copy and the fp8 GEMMs' scratch, after the 16-bit ones' room */
    m->scratch_floats += ((size_t)m->max_batch * maxw + 3) / 4 + 16 + most;
    return 0;
}

/* PyTorch's nn.Linear init; see gpu/mlp.h. */
void gpu_mlp_init_params(const gpu_mlp *m, float *params, float init_scale, gpu_rng *rng)
{
    for (int l = 0; l < m->nlin; l++) {
        int in = m->width[l], out = m->width[l + 1];
        float bound = init_scale / sqrtf((float)in);
        float *w = params + m->w_off[l], *b = params + m->b_off[l];
        for (size_t i = 0; i < (size_t)out * in; i++)
            w[i] = (2.0f * gpu_rng_uniform(rng) - 1.0f) * bound;
        for (int i = 0; i < out; i++)
            b[i] = (2.0f * gpu_rng_uniform(rng) - 1.0f) * bound;
    }
}

/* The weight operand of a linear layer: the fp32 master for an fp32 op when there is one,
 * or when there is no working copy (the GEMM rounds it to the op's dtype). */
static const void *weight_ptr(const gpu_mlp *m, const gpu_mlp_weights *w, size_t off, gpu_dtype *dt)
{
    if ((m->lin_dt == GPU_FP32 || w->p == NULL) && w->master) {
        *dt = GPU_FP32;
        return w->master + off;
    }
    *dt = w->pdt;
    return (const uint8_t *)w->p + off * gpu_dtype_size(w->pdt);
}

/* Layer l's weight matrix as its GEMMs read it (*ld, the GEMM flags for it in *flags): the
 * copy in the gradient block, the working copy, or the master rounded as it is read. */
static const void *lin_weight(const gpu_mlp *m, const gpu_mlp_weights *w, int l, gpu_dtype *dt,
                              int *ld, unsigned *flags)
{
    *flags = GPU_GEMM_B_CONVERTED;
    if (w->in_grads)
        return gpu_optim_copy_at(w->in_grads, m->w_off[l], m->width[l], m->lin_dt, dt, ld);
    *ld = m->width[l];
    const void *W = weight_ptr(m, w, m->w_off[l], dt);
    *flags |= round_w(*dt);
    return W;
}

static float gelu(float x)
{
    return 0.5f * x * (1.0f + erff(x * 0.70710678f));
}

static float gelu_grad(float x)
{
    return 0.5f * (1.0f + erff(x * 0.70710678f)) + x * expf(-0.5f * x * x) * 0.39894228f;
}

/* Elementwise kernels, cloned for AVX-512 and AVX2 and picked at load time (ifunc). */
#ifdef __clang__ /* clang 14 gives clones of static functions global resolvers, which clash */
#define HOT
#else
#define HOT __attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3")))
#endif

HOT static void add_row(float *restrict v, const float *restrict b, int n)
{
    for (int j = 0; j < n; j++)
        v[j] += b[j];
}

HOT static void relu_row(float *restrict v, int n)
{
    for (int j = 0; j < n; j++)
        v[j] = v[j] > 0.0f ? v[j] : 0.0f;
}

/* dx = x > 0 ? dx : 0, the ReLU backward from the saved output x. */
HOT static void relu_mask_row(float *restrict dx, const float *restrict x, int n)
{
    for (int j = 0; j < n; j++)
        dx[j] = x[j] > 0.0f ? dx[j] : 0.0f;
}

HOT static void col_sum(float *restrict acc, const float *restrict row, int n)
{
    for (int j = 0; j < n; j++)
        acc[j] += row[j];
}

static void gelu_row(float *v, int n)
{
    for (int j = 0; j < n; j++)
        v[j] = gelu(v[j]);
}

/* Linear epilogue for one output row, in L1: add the bias in fp32, round to lin_dt (z),
 * save z when backward needs it, then activate, round to act_dt and store the next
 * layer's input in lin_dt. */
static void epilogue_row(const gpu_mlp *m, int l, int i, float *o, const float *bias32,
                         uint8_t *acts, gpu_diag *diag, int slot)
{
    int out = m->width[l + 1];
    size_t es = gpu_dtype_size(m->lin_dt), at = (size_t)i * out * es;
    add_row(o, bias32, out);
    if (diag)
        gpu_diag_forward(diag, slot, o, (size_t)out);
    gpu_round_n(o, o, (size_t)out, m->lin_dt);
    if (act_needs_z(m, l))
        gpu_cvt_from_f32(acts + m->z_off[l] + at, m->lin_dt, o, (size_t)out);
    if (l == m->nlin - 1)
        return;
    if (m->act == GPU_ACT_RELU)
        relu_row(o, out);
    else
        gelu_row(o, out);
    gpu_round_n(o, o, (size_t)out, m->act_dt);
    gpu_cvt_from_f32(acts + m->x_off[l + 1] + at, m->lin_dt, o, (size_t)out);
}

/* The diagnostics slot of linear layer l ("fc1", "fc2", ...), or -1 without diagnostics. */
static int diag_slot(gpu_diag *diag, const gpu_mlp *m, int l)
{
    char name[16];
    if (!diag)
        return -1;
    snprintf(name, sizeof(name), "fc%d", l + 1);
    return gpu_diag_layer(diag, name, m->lin_dt);
}

static bool is_fp8(const gpu_mlp *m, const gpu_mlp_weights *w, int l)
{
    return w->fp8 && m->fp8[l];
}

/* An fp8 layer's forward GEMM: its input and weight cast to fp8 (copies kept for backward),
 * multiplied, out32 = x W^T unrounded. The weight is cast from the fp32 master when there is
 * one, as Transformer Engine casts a high-precision parameter. */
static int fp8_fwd_gemm(const gpu_mlp *m, const gpu_mlp_weights *w, int l, const uint8_t *acts,
                        int B, float *out32, float *scratch, size_t gn)
{
    gpu_fp8_run *run = w->fp8;
    int in = m->width[l], out = m->width[l + 1];
    uint8_t *x8 = w->fp8_block + m->x8_off[l], *w8 = w->fp8_block + m->w8_off[l];
    gpu_dtype wdt = w->master ? GPU_FP32 : w->pdt;
    const void *W = w->master ? (const void *)(w->master + m->w_off[l])
                              : (const uint8_t *)w->p + m->w_off[l] * gpu_dtype_size(w->pdt);
    float sx =
        gpu_fp8_cast_role(run, l, GPU_FP8_X, x8, acts + m->x_off[l], m->lin_dt, (size_t)B * in);
    float sw = gpu_fp8_cast_role(run, l, GPU_FP8_W, w8, W, wdt, (size_t)out * in);
    return gpu_gemm_fp8(false, true, B, out, in, x8, gpu_fp8_role_format(&run->cfg, GPU_FP8_X), sx,
                        in, w8, gpu_fp8_role_format(&run->cfg, GPU_FP8_W), sw, in, &run->cfg.acc,
                        out32, out, scratch, gn);
}

/* An fp8 layer's backward GEMMs: dz (B x out, values of lin_dt) cast to fp8 with the output
 * gradient's scale, then dx = dz W (l > 0) and gw = dz^T x on the forward's fp8 copies. */
static int fp8_bwd_gemms(const gpu_mlp *m, const gpu_mlp_weights *w, int l, int B, const float *dz,
                         float *dx, float *gw, float *scratch, size_t gn)
{
    gpu_fp8_run *run = w->fp8;
    const gpu_fp8_config *c = &run->cfg;
    int in = m->width[l], out = m->width[l + 1], rc = 0;
    const uint8_t *x8 = w->fp8_block + m->x8_off[l], *w8 = w->fp8_block + m->w8_off[l];
    uint8_t *g8 = (uint8_t *)(void *)scratch;
    size_t skip = ((size_t)B * out + 3) / 4 + 16;
    gpu_fp8_format fg = gpu_fp8_role_format(c, GPU_FP8_G), f4 = GPU_E4M3;
    float sg = gpu_fp8_cast_role(run, l, GPU_FP8_G, g8, dz, GPU_FP32, (size_t)B * out);
    float sx = gpu_fp8_scale_inv(run, l, GPU_FP8_X), sw = gpu_fp8_scale_inv(run, l, GPU_FP8_W);
    if (l > 0)
        rc = gpu_gemm_fp8(false, false, B, in, out, g8, fg, sg, out, w8, f4, sw, in, &c->acc, dx,
                          in, scratch + skip, gn - skip);
    if (rc == 0)
        rc = gpu_gemm_fp8(true, false, out, in, B, g8, fg, sg, out, x8, f4, sx, in, &c->acc, gw, in,
                          scratch + skip, gn - skip);
    return rc;
}

/* One linear layer forward: out32 = round_lin(x W^T + b) (fp32 values), its epilogue
 * applied row by row (each row accounted to the diagnostics while it is in L1). scratch:
 * the GEMM's, gn floats. */
static int linear_fwd(const gpu_mlp *m, const gpu_mlp_weights *w, int l, uint8_t *acts, int B,
                      float *out32, float *bias32, float *scratch, size_t gn, gpu_diag *diag)
{
    int slot = diag_slot(diag, m, l);
    int in = m->width[l], out = m->width[l + 1];
    gpu_dtype wdt, bdt;
    int ld;
    unsigned flags;
    const void *W = lin_weight(m, w, l, &wdt, &ld, &flags);
    const void *bias = weight_ptr(m, w, m->b_off[l], &bdt);
    /* in lin_dt: the weights may be the fp32 master, rounded as autocast casts them */
    int rc = is_fp8(m, w, l) ? fp8_fwd_gemm(m, w, l, acts, B, out32, scratch, gn)
                             : gpu_gemm_ex(false, true, B, out, in, acts + m->x_off[l], m->lin_dt,
                                           in, W, wdt, ld, m->lin_dt, flags | GPU_GEMM_A_CONVERTED,
                                           0.0f, out32, out, scratch, gn);
    if (rc)
        return rc;
    gpu_cvt_to_f32(bias32, bias, bdt, (size_t)out);
    if (bdt == GPU_FP32)
        gpu_round_n(bias32, bias32, (size_t)out, m->lin_dt);
    /* rows are independent; the diagnostics account them in order, on one thread */
#pragma omp parallel for if (!diag && (size_t)B * out >= GPU_PAR_MIN) schedule(static)
    for (int i = 0; i < B; i++)
        epilogue_row(m, l, i, out32 + (size_t)i * out, bias32, acts, diag, slot);
    return 0;
}

/* Softmax cross-entropy in ce_dt on rounded logits; fills probs, returns the summed loss. */
static double cross_entropy(const gpu_mlp *m, const float *logits, const int *y, int B,
                            float *probs, int *correct)
{
    int C = m->width[m->nlin];
    double total = 0.0;
    *correct = 0;
    for (int i = 0; i < B; i++) {
        const float *z = logits + (size_t)i * C;
        float *p = probs + (size_t)i * C;
        float mx = z[0];
        int arg = 0;
        for (int j = 1; j < C; j++)
            if (z[j] > mx || isnan(z[j])) {
                mx = z[j];
                arg = j;
            }
        double sum = 0.0;
        for (int j = 0; j < C; j++)
            sum += exp((double)z[j] - mx);
        for (int j = 0; j < C; j++)
            p[j] = (float)(exp((double)z[j] - mx) / sum);
        total += -((double)z[y[i]] - mx - log(sum));
        if (arg == y[i])
            (*correct)++;
    }
    gpu_round_n(probs, probs, (size_t)B * C, m->ce_dt);
    return total;
}

/* Forward pass; see gpu/mlp.h. */
int gpu_mlp_forward(const gpu_mlp *m, const gpu_mlp_weights *w, const float *x, const int *y, int B,
                    uint8_t *acts, float *scratch, double *loss, int *correct, gpu_diag *diag)
{
    size_t B_ = (size_t)B;
    int maxw = 0;
    for (int i = 0; i <= m->nlin; i++)
        maxw = m->width[i] > maxw ? m->width[i] : maxw;
    float *out32 = scratch;
    float *bias32 = out32 + (size_t)m->max_batch * maxw;
    float *gscratch = bias32 + maxw;
    size_t gn = m->scratch_floats - (size_t)(gscratch - scratch);

    if (B < 1 || B > m->max_batch)
        return GPU_EINVAL;
    /* the input is cast to the first linear's dtype (autocast's input cast) */
    gpu_cvt_from_f32(acts + m->x_off[0], m->lin_dt, x, B_ * m->width[0]);
    for (int l = 0; l < m->nlin; l++) {
        int rc = linear_fwd(m, w, l, acts, B, out32, bias32, gscratch, gn, diag);
        if (rc)
            return rc;
    }
    *loss = cross_entropy(m, out32, y, B, (float *)(acts + m->probs_off), correct) / B;
    return 0;
}

/* dlogits = seed/B (p - onehot), leaving cross-entropy in ce_dt and entering the last
 * linear's backward in lin_dt. */
static void ce_backward(const gpu_mlp *m, const float *probs, const int *y, int B, float seed,
                        float *dz)
{
    int C = m->width[m->nlin];
    float g = seed / (float)B;
    for (int i = 0; i < B; i++)
        for (int j = 0; j < C; j++)
            dz[(size_t)i * C + j] = (probs[(size_t)i * C + j] - (j == y[i] ? 1.0f : 0.0f)) * g;
    gpu_round_n(dz, dz, (size_t)B * C, m->ce_dt);
    gpu_round_n(dz, dz, (size_t)B * C, m->lin_dt);
}

/* One row of dZ of layer l-1 from dX of layer l: through the activation in act_dt, then
 * the cast back to lin_dt, in pieces of ROW_PIECE that convert the saved input on the
 * stack. */
#define ROW_PIECE 256
static void act_backward_row(const gpu_mlp *m, int l, const uint8_t *acts, int i, float *dx)
{
    int n = m->width[l];
    size_t es = gpu_dtype_size(m->lin_dt);
    float *d = dx + (size_t)i * n, tmp[ROW_PIECE];
    gpu_round_n(d, d, (size_t)n, m->act_dt);
    for (int j0 = 0; j0 < n; j0 += ROW_PIECE) {
        int len = n - j0 < ROW_PIECE ? n - j0 : ROW_PIECE;
        size_t at = ((size_t)i * n + (size_t)j0) * es;
        if (m->act == GPU_ACT_RELU) {
            const float *x = (const float *)(acts + m->x_off[l] + at);
            if (m->lin_dt != GPU_FP32) {
                gpu_cvt_to_f32(tmp, acts + m->x_off[l] + at, m->lin_dt, (size_t)len);
                x = tmp;
            }
            relu_mask_row(d + j0, x, len);
        } else {
            gpu_cvt_to_f32(tmp, acts + m->z_off[l - 1] + at, m->lin_dt, (size_t)len);
            for (int j = 0; j < len; j++)
                d[j0 + j] *= gelu_grad(tmp[j]);
        }
    }
    if (m->act != GPU_ACT_RELU)
        gpu_round_n(d, d, (size_t)n, m->act_dt);
    gpu_round_n(d, d, (size_t)n, m->lin_dt);
}

/* dZ of layer l-1 from dX of layer l, row by row on every core. The activation's input z
 * is read from acts (GELU) or recovered from its ReLU output x_l, which equals z where
 * z > 0. */
static void act_backward(const gpu_mlp *m, int l, const uint8_t *acts, int B, float *dx)
{
#pragma omp parallel for if ((size_t)B * m->width[l] >= GPU_PAR_MIN) schedule(static)
    for (int i = 0; i < B; i++)
        act_backward_row(m, l, acts, i, dx);
}

/* Diagnostics of underflow that cascades. A unit of linear l that some row uses (its ReLU
 * is active, or any unit of a GELU or of the last layer) but whose incoming gradient dz is
 * 0 in every row has a weight row and bias that are 0 only because upstream roundings
 * flushed the gradient: they are "starved". The same question is asked without the loss
 * scale, following which rows of dz would be entirely 0 at scale 1: a value would be 0 if
 * it would flush (|dz| / S <= half the smallest subnormal) or its row would be 0 entirely
 * (every value of the gradient row it came from would be 0). One starve_state lives in the
 * backward's tmp buffer, after the row that act_backward uses. */
typedef struct {
    uint8_t *rowdead, *rowdead_next; /* B: the row of dz would be all 0 without scaling */
    uint8_t *active, *alive, *alive_u, *starved_u; /* per output unit */
    uint32_t ufl; /* largest |dz| bit pattern that flushes at scale 1 */
    bool on;
} starve_state;

static void starve_init(starve_state *st, const gpu_mlp *m, gpu_diag *diag, int B, int maxw,
                        float *tmp, size_t tmp_floats)
{
    uint8_t *p = (uint8_t *)(void *)(tmp + maxw);
    memset(st, 0, sizeof(*st));
    if (!diag || m->lin_dt == GPU_FP32 ||
        2 * (size_t)B + 4 * (size_t)maxw > (tmp_floats - (size_t)maxw) * sizeof(float))
        return;
    st->rowdead = p;
    st->rowdead_next = p + B;
    st->active = p + 2 * B;
    st->alive = st->active + maxw;
    st->alive_u = st->alive + maxw;
    st->starved_u = st->alive_u + maxw;
    st->ufl = gpu_diag_flush_bits(m->lin_dt, diag->scale);
    memset(st->rowdead, 0, (size_t)B);
    st->on = true;
}

/* One row of dz: which units got a gradient (alive), which would without scaling
 * (alive_u), and whether the whole row would be 0 without scaling (returned). */
HOT static uint8_t starve_row(const uint32_t *restrict g, int n, uint8_t rowdead, uint32_t ufl,
                              uint8_t *restrict alive, uint8_t *restrict alive_u)
{
    uint8_t all = 1;
    for (int j = 0; j < n; j++) {
        uint32_t a = g[j] & 0x7FFFFFFFu;
        uint8_t zu = rowdead | (uint8_t)(a <= ufl);
        alive[j] |= (uint8_t)(a != 0);
        alive_u[j] |= zu ^ 1;
        all &= zu;
    }
    return all;
}

/* active |= x > 0 for a row of 16-bit values (+inf pattern inf16). */
HOT static void relu_active_row(const uint16_t *restrict x, int n, uint16_t inf16,
                                uint8_t *restrict active)
{
    for (int j = 0; j < n; j++)
        active[j] |= (uint8_t)((uint16_t)(x[j] - 1u) < inf16);
}

/* Scan dz (B x out, rounded), the gradient reaching linear l: returns the starved units,
 * marks those starved only without scaling in starved_u, and passes the rows that would be
 * all 0 without scaling down to the next layer. */
static int64_t starve_scan(starve_state *st, const gpu_mlp *m, int l, const uint8_t *acts,
                           const float *dz, int B)
{
    int out = m->width[l + 1];
    bool relu = l < m->nlin - 1 && m->act == GPU_ACT_RELU;
    /* x > 0 for 16-bit storage: 0 < bits <= +inf (the sign bit clear) */
    uint16_t inf16 = m->lin_dt == GPU_FP16 ? 0x7C00u : 0x7F80u;
    int64_t n = 0;
    memset(st->active, !relu, (size_t)out);
    memset(st->alive, 0, (size_t)out);
    memset(st->alive_u, 0, (size_t)out);
    for (int i = 0; i < B; i++) {
        const uint32_t *g = (const uint32_t *)(const void *)(dz + (size_t)i * out);
        st->rowdead_next[i] = starve_row(g, out, st->rowdead[i], st->ufl, st->alive, st->alive_u);
        if (relu)
            relu_active_row((const uint16_t *)(const void *)(acts + m->x_off[l + 1]) +
                                (size_t)i * out,
                            out, inf16, st->active);
    }
    for (int j = 0; j < out; j++) {
        n += st->active[j] && !st->alive[j];
        st->starved_u[j] = st->active[j] && st->alive[j] && !st->alive_u[j];
    }
    uint8_t *t = st->rowdead;
    st->rowdead = st->rowdead_next;
    st->rowdead_next = t;
    return n;
}

/* Non-zero values of g (fp32, before rounding) in the units starved only without scaling
 * that would not flush on their own: lost only because their unit would get no gradient.
 * g is [out x len] (a weight gradient) or [out] (a bias gradient, len 1). */
static int64_t starve_extra(const starve_state *st, const float *g, int out, int len)
{
    int64_t n = 0;
    for (int j = 0; j < out; j++) {
        if (!st->starved_u[j])
            continue;
        const uint32_t *r = (const uint32_t *)(const void *)(g + (size_t)j * len);
        for (int k = 0; k < len; k++)
            n += (r[k] & 0x7FFFFFFFu) > st->ufl;
    }
    return n;
}

/* Bias gradient: column sums of dz accumulated in fp32, rounded to lin_dt. */
static void bias_grad(const float *dz, int B, int out, gpu_dtype dt, float *db, gpu_diag *diag,
                      int slot, const starve_state *st)
{
    /* column blocks on every core; each column is summed over the rows in order */
    int blocks = (out + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for if ((size_t)B * out >= GPU_PAR_MIN) schedule(static)
    for (int c = 0; c < blocks; c++) {
        int j0 = c * COL_BLOCK, len = out - j0 < COL_BLOCK ? out - j0 : COL_BLOCK;
        memset(db + j0, 0, sizeof(float) * (size_t)len);
        for (int i = 0; i < B; i++)
            col_sum(db + j0, dz + (size_t)i * out + j0, len);
    }
    if (st)
        gpu_diag_starved(diag, slot, 0, starve_extra(st, db, out, 1));
    gpu_diag_round_grad(diag, slot, true, db, (size_t)out, dt);
}

/* Backward pass; see gpu/mlp.h. */
int gpu_mlp_backward(const gpu_mlp *m, const gpu_mlp_weights *w, const int *y, int B, float seed,
                     const uint8_t *acts, float *scratch, float *grads, gpu_diag *diag,
                     const gpu_grad_ready *ready)
{
    int maxw = 0;
    for (int i = 0; i <= m->nlin; i++)
        maxw = m->width[i] > maxw ? m->width[i] : maxw;
    size_t slot = (size_t)m->max_batch * maxw;
    size_t tmp_floats = (size_t)maxw + starve_floats(m, maxw);
    float *dz = scratch, *dx = scratch + slot, *tmp = scratch + 2 * slot;
    float *gscratch = tmp + tmp_floats;
    size_t gn = m->scratch_floats - (size_t)(gscratch - scratch);
    starve_state st;

    if (B < 1 || B > m->max_batch)
        return GPU_EINVAL;
    starve_init(&st, m, diag, B, maxw, tmp, tmp_floats);
    ce_backward(m, (const float *)(acts + m->probs_off), y, B, seed, dz);
    for (int l = m->nlin - 1; l >= 0; l--) {
        int in = m->width[l], out = m->width[l + 1];
        float *gw = grads + m->w_off[l];
        int ds = diag_slot(diag, m, l);
        gpu_dtype wdt;
        int ld, rc = 0;
        unsigned flags;
        const void *W = lin_weight(m, w, l, &wdt, &ld, &flags);
        /* dz holds values of lin_dt (rounded), so the GEMMs may take it in lin_dt; dx first,
         * as the weight gradient may overwrite W's copy */
        if (is_fp8(m, w, l))
            rc = fp8_bwd_gemms(m, w, l, B, dz, dx, gw, gscratch, gn);
        else if (l > 0)
            rc = gpu_gemm_ex(false, false, B, in, out, dz, GPU_FP32, out, W, wdt, ld, m->lin_dt,
                             flags, 0.0f, dx, in, gscratch, gn);
        if (rc == 0 && !is_fp8(m, w, l))
            rc = gpu_gemm_ex(true, false, out, in, B, dz, GPU_FP32, out, acts + m->x_off[l],
                             m->lin_dt, in, m->lin_dt, GPU_GEMM_B_CONVERTED, 0.0f, gw, in,
                             gscratch, gn);
        if (rc)
            return rc;
        if (diag)
            gpu_diag_backward(diag, ds, dz, (size_t)B * out);
        if (st.on) {
            int64_t starved = starve_scan(&st, m, l, acts, dz, B) * (in + 1);
            gpu_diag_starved(diag, ds, starved, starve_extra(&st, gw, out, in));
        }
        gpu_diag_round_grad(diag, ds, true, gw, (size_t)out * in, m->lin_dt);
        bias_grad(dz, B, out, m->lin_dt, grads + m->b_off[l], diag, ds, st.on ? &st : NULL);
        gpu_grad_done(ready, m->w_off[l], (size_t)out * in);
        gpu_grad_done(ready, m->b_off[l], (size_t)out);
        if (l == 0)
            break;
        gpu_diag_round_grad(diag, ds, false, dx, (size_t)B * in, m->lin_dt);
        act_backward(m, l, acts, B, dx);
        float *t = dz;
        dz = dx;
        dx = t;
    }
    return 0;
}
