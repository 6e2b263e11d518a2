/*
 * optim.c - optimizers (AdamW, SGD with momentum) and the learning-rate schedule.
 *
 * The update is PyTorch's (torch.optim, single-tensor path, fp32 tensors on the CPU) operation
 * for operation, so that it gives PyTorch's bits (tests/check_optim.c compares 200 steps with
 * values torch.optim produced). The hyperparameters are the spec's doubles; each scalar is
 * formed in double and rounded to float once, as PyTorch casts a Python float for a kernel:
 *   AdamW: p = p * (float)(1 - lr*wd)
 *          m = fma(g, (float)(1 - b1), m * (float)b1)          (mul_ then add_ with alpha)
 *          v = fma((float)(1 - b2) * g, g, v * (float)b2)      (mul_ then addcmul_)
 *          p = p + ((float)(-lr / (1 - b1^t)) * m) / (sqrt(v) / (float)sqrt(1 - b2^t)
 *                                                      + (float)eps)       (addcdiv_)
 *   SGD:   d = wd != 0 ? fma(p, (float)wd, g) : g; buf = d at t == 1, else
 *          buf * (float)momentum + d (no buffer when momentum is 0); p = fma(buf, (float)-lr, p)
 * where g is the incoming gradient times gmul, and fma is one rounding (PyTorch's vectorised
 * add_ and addcmul_ kernels fuse there). The loops have an AVX-512 path (chosen from CPUID at
 * first use; GCC does not vectorise them at -O2) and a portable path (built for FMA hardware
 * as well, picked at load time) that perform the same IEEE operations in the same order, so
 * all give bit-identical results. Parameters are processed in chunks of CHUNK elements so
 * that the low-precision working copy is written while the chunk is still in cache; with
 * GPU_PAR_MIN elements or more the chunks are shared out among the OpenMP team. Every element's
 * result depends on that element alone, so it is the same with any number of threads.
 * gpu_optim_update_in_grads writes the working copy into the gradients the update has read
 * (a model with no room for a copy of its own); there a matrix's chunks are whole rows.
 *
 * Invariants: after gpu_optim_update with work != NULL, work[i] is the round-to-nearest-even
 * image of p[i] in wdt (bit-identical to gpu_f32_to_f16 / gpu_f32_to_bf16).
 * Threads: an update of GPU_PAR_MIN elements or more runs on the OpenMP team (omp_get_max_threads,
 * which the engine sets; none is started inside an active parallel region). The only shared
 * state is the kernel path choice (an atomic, read once per call); calls on distinct buffers
 * may run concurrently.
 */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OPTIM_HAVE_X86 1
#else
#define OPTIM_HAVE_X86 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gpu/gpu_int.h"

#define CHUNK 1024          /* elements per kernel call: a multiple of 64 */
#ifndef GPU_OPTIM_LR_DEFAULT /* a build may pick another (tests/check_default.sh's second ampd) */
#define GPU_OPTIM_LR_DEFAULT 1e-3
#endif

void gpu_optim_defaults(gpu_optim_config *c)
{
    memset(c, 0, sizeof(*c));
    c->type = GPU_OPT_ADAMW;
    c->lr = GPU_OPTIM_LR_DEFAULT;
    c->beta1 = 0.9;
    c->beta2 = 0.999;
    c->eps = 1e-8;
    c->momentum = 0.9;
    c->weight_decay = 0.0;
    c->grad_clip = 0.0f;
    c->warmup_steps = 0;
    c->schedule = GPU_SCHED_CONSTANT;
    c->min_lr_ratio = 0.0f;
}

static bool in_unit(double x) /* [0, 1) */
{
    return x >= 0.0 && x < 1.0;
}

/* Checks every field; on a bad value stores the job-spec name of the field in *field
 * (a static string; field may be NULL) and returns GPU_EINVAL. c is borrowed. */
int gpu_optim_validate(const gpu_optim_config *c, const char **field)
{
    const char *bad = NULL;

    if (c->type != GPU_OPT_ADAMW && c->type != GPU_OPT_SGD)
        bad = "optimizer.type";
    else if (!(isfinite(c->lr) && c->lr > 0.0 && c->lr <= FLT_MAX))
        bad = "optimizer.lr";
    else if (!in_unit(c->beta1) || !in_unit(c->beta2))
        bad = "optimizer.betas";
    else if (!(isfinite(c->eps) && c->eps > 0.0 && c->eps <= FLT_MAX))
        bad = "optimizer.eps";
    else if (!(isfinite(c->weight_decay) && c->weight_decay >= 0.0 &&
               c->weight_decay <= FLT_MAX))
        bad = "optimizer.weight_decay";
    else if (!in_unit(c->momentum))
        bad = "optimizer.momentum";
    else if (!(isfinite(c->grad_clip) && c->grad_clip >= 0.0f))
        bad = "optimizer.grad_clip";
    else if (c->warmup_steps < 0)
        bad = "optimizer.warmup_steps";
    else if (c->schedule != GPU_SCHED_CONSTANT && c->schedule != GPU_SCHED_COSINE &&
             c->schedule != GPU_SCHED_LINEAR)
        bad = "optimizer.schedule";
    else if (!(c->min_lr_ratio >= 0.0f && c->min_lr_ratio <= 1.0f))
        bad = "optimizer.min_lr_ratio";
    if (field)
        *field = bad;
    return bad ? GPU_EINVAL : 0;
}

/*
 * Learning rate for 0-based step `step` of `total` (c borrowed), a double (as PyTorch's
 * schedulers hand the optimizer a Python float):
 *   step < W (W = warmup_steps):  lr * (step + 1) / W
 *   otherwise, with D = max(total - W, 1), p = clamp((step - W) / D, 0, 1), r = min_lr_ratio:
 *     constant: lr
 *     cosine:   lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)
 *     linear:   lr * (r + (1 - r) * (1 - p))
 * So the decay starts at lr on step W and reaches lr * r at step total (the last step,
 * total - 1, is one 1/D short of it). A negative step counts as step 0.
 */
double gpu_lr_at(const gpu_optim_config *c, int64_t step, int64_t total)
{
    double lr = c->lr, r = c->min_lr_ratio;
    int64_t w = c->warmup_steps;

    if (step < 0)
        step = 0;
    if (step < w)
        return lr * (double)(step + 1) / (double)w;
    if (c->schedule == GPU_SCHED_CONSTANT)
        return lr;
    int64_t d = total - w;
    if (d < 1)
        d = 1;
    double p = (double)(step - w) / (double)d;
    if (p > 1.0)
        p = 1.0;
    double f = c->schedule == GPU_SCHED_COSINE ? 0.5 * (1.0 + cos(M_PI * p)) : 1.0 - p;
    return lr * (r + (1.0 - r) * f);
}

/* ---- per-chunk kernels --------------------------------------------------------------- */

typedef struct {
    float gmul;
    float b1, b2, omb1, omb2, eps; /* AdamW: (float) of beta1, beta2, 1-beta1, 1-beta2, eps */
    float decay;        /* AdamW: (float)(1 - lr*wd) */
    float neg_step;     /* AdamW: (float)(-lr / (1 - b1^t)) */
    float bc2_sqrt;     /* AdamW: (float)sqrt(1 - b2^t) */
    float wd, neg_lr;   /* SGD: (float)wd, (float)-lr */
    float momentum;
    bool first;         /* t == 1 (SGD buffer initialisation) */
} step_consts;

static void consts_init(step_consts *k, const gpu_optim_config *c, double lr, int64_t t,
                        float gmul)
{
    if (t < 1)
        t = 1;
    k->gmul = gmul;
    k->b1 = (float)c->beta1;
    k->b2 = (float)c->beta2;
    k->omb1 = (float)(1.0 - c->beta1);
    k->omb2 = (float)(1.0 - c->beta2);
    k->eps = (float)c->eps;
    k->decay = (float)(1.0 - lr * c->weight_decay);
    k->neg_step = (float)(-(lr / (1.0 - pow(c->beta1, (double)t))));
    k->bc2_sqrt = (float)sqrt(1.0 - pow(c->beta2, (double)t));
    k->wd = (float)c->weight_decay;
    k->neg_lr = (float)-lr;
    k->momentum = (float)c->momentum;
    k->first = t == 1;
}

/* Portable kernels. The operation order is fixed (fmaf where PyTorch fuses, no other
 * contraction: -std=c11 keeps it off), and the AVX-512 kernels below perform the same IEEE
 * operations in the same order, so the paths give bit-identical results. The fma clone
 * only turns fmaf's library call into the instruction. */
#if OPTIM_HAVE_X86 && defined(__GNUC__) && !defined(__clang__)
#define FMA_CLONES __attribute__((target_clones("fma", "default")))
#else
#define FMA_CLONES
#endif

FMA_CLONES static void adamw_chunk(const step_consts *k, float *restrict p,
                                   const float *restrict g, float *restrict m,
                                   float *restrict v, size_t n)
{
    const float gmul = k->gmul, decay = k->decay, b1 = k->b1, b2 = k->b2;
    const float omb1 = k->omb1, omb2 = k->omb2, eps = k->eps;
    const float neg_step = k->neg_step, bc2_sqrt = k->bc2_sqrt;

    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * gmul;
        float mi = fmaf(gi, omb1, m[i] * b1);
        float vi = fmaf(omb2 * gi, gi, v[i] * b2);
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = p[i] * decay + (neg_step * mi) / denom;
    }
}

/* mode 0: no buffer (momentum 0 or none given); 1: first step, buf = d; 2: buf = mom*buf + d */
static int sgd_mode(const step_consts *k, const float *buf)
{
    if (k->momentum == 0.0f || buf == NULL)
        return 0;
    return k->first ? 1 : 2;
}

FMA_CLONES static void sgd_chunk(const step_consts *k, float *restrict p,
                                 const float *restrict g, float *restrict buf, size_t n)
{
    const float gmul = k->gmul, wd = k->wd, neg_lr = k->neg_lr, mom = k->momentum;
    const bool decay = wd != 0.0f;
    int mode = sgd_mode(k, buf);

    for (size_t i = 0; i < n; i++) {
        float d = g[i] * gmul;
        if (decay)
            d = fmaf(p[i], wd, d);
        if (mode == 1)
            buf[i] = d;
        else if (mode == 2)
            d = buf[i] = buf[i] * mom + d;
        p[i] = fmaf(d, neg_lr, p[i]);
    }
}

#if OPTIM_HAVE_X86
#define V16 16

static inline __mmask16 tail_mask(size_t rem)
{
    return rem >= V16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1u);
}

__attribute__((target("avx512f"))) static void
adamw_chunk_avx512(const step_consts *k, float *restrict p, const float *restrict g,
                   float *restrict m, float *restrict v, size_t n)
{
    const __m512 gmul = _mm512_set1_ps(k->gmul), decay = _mm512_set1_ps(k->decay);
    const __m512 b1 = _mm512_set1_ps(k->b1), b2 = _mm512_set1_ps(k->b2);
    const __m512 omb1 = _mm512_set1_ps(k->omb1), omb2 = _mm512_set1_ps(k->omb2);
    const __m512 eps = _mm512_set1_ps(k->eps), nstep = _mm512_set1_ps(k->neg_step);
    const __m512 bc2 = _mm512_set1_ps(k->bc2_sqrt);

    for (size_t i = 0; i < n; i += V16) {
        __mmask16 mk = tail_mask(n - i);
        __m512 gi = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, g + i), gmul);
        __m512 mi = _mm512_fmadd_ps(gi, omb1,
                                    _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, m + i), b1));
        __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(omb2, gi), gi,
                                    _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, v + i), b2));
        _mm512_mask_storeu_ps(m + i, mk, mi);
        _mm512_mask_storeu_ps(v + i, mk, vi);
        __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
        __m512 pi = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, p + i), decay);
        pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(nstep, mi), denom));
        _mm512_mask_storeu_ps(p + i, mk, pi);
    }
}

__attribute__((target("avx512f"))) static void
sgd_chunk_avx512(const step_consts *k, float *restrict p, const float *restrict g,
                 float *restrict buf, size_t n)
{
    const __m512 gmul = _mm512_set1_ps(k->gmul), wd = _mm512_set1_ps(k->wd);
    const __m512 nlr = _mm512_set1_ps(k->neg_lr), mom = _mm512_set1_ps(k->momentum);
    const bool decay = k->wd != 0.0f;
    int mode = sgd_mode(k, buf);

    for (size_t i = 0; i < n; i += V16) {
        __mmask16 mk = tail_mask(n - i);
        __m512 pi = _mm512_maskz_loadu_ps(mk, p + i);
        __m512 d = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, g + i), gmul);
        if (decay)
            d = _mm512_fmadd_ps(pi, wd, d);
        if (mode == 2)
            d = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, buf + i), mom), d);
        if (mode != 0)
            _mm512_mask_storeu_ps(buf + i, mk, d);
        _mm512_mask_storeu_ps(p + i, mk, _mm512_fmadd_ps(d, nlr, pi));
    }
}
#endif

static atomic_int optim_impl_id = GPU_IMPL_UNSET;

const char *gpu_optim_impl(void)
{
    return gpu_impl_name(gpu_impl_pick(&optim_impl_id));
}

/* impl is borrowed. */
int gpu_optim_force(const char *impl)
{
    return gpu_impl_force(&optim_impl_id, impl);
}


static void step_chunk(const gpu_optim_config *c, const step_consts *k, int impl, float *p,
                       const float *g, float *m, float *v, size_t n)
{
#if OPTIM_HAVE_X86
    if (impl == GPU_IMPL_AVX512) {
        if (c->type == GPU_OPT_SGD)
            sgd_chunk_avx512(k, p, g, m, n);
        else
            adamw_chunk_avx512(k, p, g, m, v, n);
        return;
    }
#endif
    (void)impl;
    if (c->type == GPU_OPT_SGD)
        sgd_chunk(k, p, g, m, n);
    else
        adamw_chunk(k, p, g, m, v, n);
}

/* Writes src[0..n) into dst (elements of wdt) starting at element off. */
static void store_work(void *dst, gpu_dtype wdt, size_t off, const float *src, size_t n)
{
    if (wdt == GPU_FP16)
        gpu_cvt_f32_f16((uint16_t *)dst + off, src, n);
    else if (wdt == GPU_BF16)
        gpu_cvt_f32_bf16((uint16_t *)dst + off, src, n);
    else
        memcpy((float *)dst + off, src, n * sizeof(float));
}

/* One call's update: the chunk kernels' arguments. p is the fp32 parameters (master, or
 * the working copy itself), w the 16-bit working copy (may be NULL). */
typedef struct {
    const gpu_optim_config *c;
    step_consts k;
    int impl;
    float *p;
    void *w;
    gpu_dtype wdt;
    const float *g;
    float *m, *v;
    size_t n;
} update_job;

static size_t chunk_count(const update_job *u)
{
    return (u->n + CHUNK - 1) / CHUNK;
}

static size_t chunk_len(const update_job *u, size_t off)
{
    return u->n - off < CHUNK ? u->n - off : CHUNK;
}

/* Chunk i of the fp32 parameters, and of the working copy when there is one. */
static void f32_chunk(const update_job *u, size_t i)
{
    size_t off = i * CHUNK, len = chunk_len(u, off);
    float *m = u->m ? u->m + off : NULL, *v = u->v ? u->v + off : NULL;

    step_chunk(u->c, &u->k, u->impl, u->p + off, u->g + off, m, v, len);
    if (u->w)
        store_work(u->w, u->wdt, off, u->p + off, len);
}

/* Chunk i of the 16-bit parameters w (no master) updated in place through fp32; returns the
 * number of its updates that rounded away. */
static int64_t lowp_chunk(const update_job *u, size_t i)
{
    float cur[CHUNK], old[CHUNK];
    uint16_t out[CHUNK];
    size_t off = i * CHUNK, len = chunk_len(u, off);
    uint16_t *w = (uint16_t *)u->w + off;
    float *m = u->m ? u->m + off : NULL, *v = u->v ? u->v + off : NULL;
    int64_t nlost = 0;

    if (u->wdt == GPU_FP16)
        gpu_cvt_f16_f32(cur, w, len);
    else
        gpu_cvt_bf16_f32(cur, w, len);
    memcpy(old, cur, len * sizeof(float));
    step_chunk(u->c, &u->k, u->impl, cur, u->g + off, m, v, len);
    if (u->wdt == GPU_FP16)
        gpu_cvt_f32_f16(out, cur, len);
    else
        gpu_cvt_f32_bf16(out, cur, len);
    for (size_t j = 0; j < len; j++)
        nlost += (cur[j] != old[j]) & (out[j] == w[j]);
    memcpy(w, out, len * sizeof(uint16_t));
    return nlost;
}

/* Every chunk of an update with fp32 parameters, on the OpenMP team when it is large. */
static void run_f32(const update_job *u)
{
    size_t nchunks = chunk_count(u);

    if (!gpu_par_worth(u->n)) {
        for (size_t i = 0; i < nchunks; i++)
            f32_chunk(u, i);
        return;
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < nchunks; i++)
        f32_chunk(u, i);
}

/* Every chunk of an update of 16-bit parameters; the number of updates that rounded away. */
static int64_t run_lowp(const update_job *u)
{
    size_t nchunks = chunk_count(u);
    int64_t nlost = 0;

    if (!gpu_par_worth(u->n)) {
        for (size_t i = 0; i < nchunks; i++)
            nlost += lowp_chunk(u, i);
        return nlost;
    }
#pragma omp parallel for schedule(static) reduction(+ : nlost)
    for (size_t i = 0; i < nchunks; i++)
        nlost += lowp_chunk(u, i);
    return nlost;
}

/* A stretch of the parameter block for gpu_optim_update_in_grads: a matrix (cols > 0), whose
 * chunks are whole rows, or the parameters between matrices (cols == 0). */
typedef struct {
    size_t off, n, cols, rows_per, chunks;
} stretch;

/* The rows of chunk i of stretch s: [*r0, *r0 + returned count). */
static size_t chunk_rows(const stretch *s, size_t i, size_t *r0)
{
    size_t rows = s->n / s->cols;
    *r0 = i * s->rows_per;
    return rows - *r0 < s->rows_per ? rows - *r0 : s->rows_per;
}

/* The update of chunk i of stretch s; fp16's copy of a matrix's rows goes over the gradients
 * the update has just read. */
static void stretch_update(const update_job *u, const stretch *s, float *g, size_t i)
{
    size_t step = s->cols ? s->rows_per * s->cols : CHUNK;
    size_t lo = i * step, len = s->n - lo < step ? s->n - lo : step, at = s->off + lo;
    float *m = u->m ? u->m + at : NULL, *v = u->v ? u->v + at : NULL;

    step_chunk(u->c, &u->k, u->impl, u->p + at, g + at, m, v, len);
    if (s->cols && u->wdt == GPU_FP16) { /* whole rows: lo is row lo / cols's start */
        gpu_dtype dt;
        int ld;
        float *dst = (float *)gpu_optim_copy_at(g, s->off, (int)s->cols, GPU_FP16, &dt, &ld);
        gpu_round_n(dst + lo / s->cols * (size_t)ld, u->p + at, len, GPU_FP16);
    }
}

/* bf16's copy of chunk i of a matrix stretch: dense rows from the start of the matrix's
 * gradients, which reach into other chunks' (so only once every gradient has been read). */
static void stretch_copy_bf16(const update_job *u, const stretch *s, float *g, size_t i)
{
    size_t r0, nr = chunk_rows(s, i, &r0);
    gpu_dtype dt;
    int ld;
    uint16_t *dst = (uint16_t *)gpu_optim_copy_at(g, s->off, (int)s->cols, GPU_BF16, &dt, &ld);
    gpu_cvt_f32_bf16(dst + r0 * (size_t)ld, u->p + s->off + r0 * s->cols, nr * s->cols);
}

static void add_stretch(stretch *s, int *ns, size_t off, size_t n, size_t cols)
{
    if (n == 0)
        return;
    size_t rows_per = cols ? (CHUNK + cols - 1) / cols : 0, step = cols ? rows_per * cols : CHUNK;
    s[(*ns)++] = (stretch){off, n, cols, rows_per, (n + step - 1) / step};
}

static void job_init(update_job *u, const gpu_optim_config *c, double lr, int64_t t,
                     float gmul, const float *g, float *m, float *v, size_t n)
{
    memset(u, 0, sizeof(*u));
    u->c = c;
    consts_init(&u->k, c, lr, t, gmul);
    u->impl = gpu_impl_pick(&optim_impl_id);
    u->g = g;
    u->m = m;
    u->v = v;
    u->n = n;
}

/* See gpu.h. All pointers are borrowed; m is the AdamW first moment or the SGD momentum
 * buffer (may be NULL for SGD with momentum 0), v the AdamW second moment (NULL for SGD).
 * p, g, m, v and work must not overlap. */
void gpu_optim_update(const gpu_optim_config *c, double lr, int64_t t, float gmul,
                      float *p, const float *g, float *m, float *v, size_t n,
                      void *work, gpu_dtype wdt)
{
    update_job u;

    job_init(&u, c, lr, t, gmul, g, m, v, n);
    u.p = p;
    u.w = work;
    u.wdt = wdt;
    run_f32(&u);
}

/* Chunks of stretch st on the team (or the one thread): the update, then (a bf16 matrix) the
 * copy, once the barrier has seen every gradient of the matrix read. */
static void run_stretch(const update_job *u, const stretch *st, float *g)
{
#pragma omp for schedule(static)
    for (size_t j = 0; j < st->chunks; j++)
        stretch_update(u, st, g, j);
    if (st->cols && u->wdt == GPU_BF16) {
#pragma omp for schedule(static) nowait
        for (size_t j = 0; j < st->chunks; j++)
            stretch_copy_bf16(u, st, g, j);
    }
}

/* See gpu.h. The update goes by stretches, a matrix's chunks whole rows: fp16's copy of a
 * row replaces the row's own gradients, read by the same chunk; bf16's rows are written dense
 * from the start of the matrix's gradients (in half their bytes), which reaches into other
 * chunks' rows, after the update of the whole matrix. The schedule is static in both loops,
 * so a thread copies the rows it has just updated. All pointers borrowed; p, g, m and v must
 * not overlap. */
void gpu_optim_update_in_grads(const gpu_optim_config *c, double lr, int64_t t, float gmul,
                               float *p, float *g, float *m, float *v, size_t n,
                               const gpu_optim_matrix *mats, int nmats, gpu_dtype wdt)
{
    stretch s[2 * GPU_MAX_LAYERS + 1];
    int ns = 0;
    size_t at = 0;
    update_job u;

    job_init(&u, c, lr, t, gmul, g, m, v, n);
    u.p = p;
    u.wdt = wdt;
    for (int k = 0; k < nmats && k < GPU_MAX_LAYERS; k++) {
        add_stretch(s, &ns, at, mats[k].off - at, 0);
        add_stretch(s, &ns, mats[k].off, (size_t)mats[k].rows * mats[k].cols,
                    (size_t)mats[k].cols);
        at = mats[k].off + (size_t)mats[k].rows * mats[k].cols;
    }
    add_stretch(s, &ns, at, n - at, 0);
#pragma omp parallel if (gpu_par_worth(n))
    for (int k = 0; k < ns; k++)
        run_stretch(&u, &s[k], g);
}

const void *gpu_optim_copy_at(const float *g, size_t off, int cols, gpu_dtype wdt,
                              gpu_dtype *dt, int *ld)
{
    *dt = wdt == GPU_BF16 ? GPU_BF16 : GPU_FP32;
    *ld = cols;
    return g + off;
}

/* See gpu.h. w holds n elements of wdt (uint16_t for fp16/bf16, float for fp32), updated in
 * place; g, m, v as for gpu_optim_update; all borrowed. *lost (may be NULL) receives the
 * number of elements whose fp32 result differed from the fp32 value read but whose stored
 * 16-bit value did not change. For wdt == GPU_FP32 the fp32 result is stored as it is, so
 * *lost is 0. */
void gpu_optim_update_lowp(const gpu_optim_config *c, double lr, int64_t t, float gmul,
                           void *w, gpu_dtype wdt, const float *g, float *m, float *v,
                           size_t n, int64_t *lost)
{
    update_job u;
    int64_t nlost = 0;

    job_init(&u, c, lr, t, gmul, g, m, v, n);
    u.wdt = wdt;
    if (wdt == GPU_FP32) {
        u.p = w;
        run_f32(&u);
    } else {
        u.w = w;
        nlost = run_lowp(&u);
    }
    if (lost)
        *lost = nlost;
}
