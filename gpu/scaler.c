/*
 * scaler.c - the loss scaler: configuration, the per-step scale update and the fused
 * unscale pass over the gradients.
 *
 * The update follows PyTorch's _amp_update_scale_ exactly for the default configuration
 * (hysteresis 1, the scale never at its floor or ceiling): products are formed in double and
 * stored as float, the growth tracker resets on every overflow and on every growth attempt,
 * and growth is refused when the result would not be finite. Beyond PyTorch it adds
 * DeepSpeed/Megatron hysteresis, a floor (min_scale) that fails the job after floor_patience
 * overflowing steps in a row, and a ceiling (max_scale).
 *
 * gpu_unscale has an AVX-512 path (chosen from CPUID at first use) and a portable path. The
 * pass cuts each tensor into chunks of UCHUNK elements (an empty tensor is one empty chunk)
 * that the OpenMP team shares out; each chunk gives partial stats and a partial sum of squares
 * (16 double lanes from zero, the chunk's element i going to lane i % 16, the lanes added
 * 0..15), and the partials are combined in tensor and chunk order on the calling thread.
 * The chunks do not depend on the number of threads, and both paths accumulate in the same
 * order, so every result (sumsq included) is the same bits with any number of threads and on
 * either path.
 *
 * The update itself is gpu/scaler_rule.h's gpu_scaler_rule, shared with the CUDA step.
 *
 * Invariants: a state initialised by gpu_scaler_init and driven by gpu_scaler_update keeps
 * min_scale <= scale <= max(init_scale, max_scale) in dynamic mode.
 * Threads: state objects are per trainer (one thread). gpu_unscale runs on the OpenMP team
 * (omp_get_max_threads, which the engine sets) when there are GPU_PAR_MIN elements or more and
 * the caller is not in an active parallel region; its path choice is a process-wide atomic,
 * and it is safe to call from any thread on distinct buffers.
 */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SCALER_HAVE_X86 1
#else
#define SCALER_HAVE_X86 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "gpu/gpu_int.h"
#include "gpu/scaler_rule.h"

/* ---- configuration ------------------------------------------------------------------- */

void gpu_scaler_defaults(gpu_scaler_config *c, gpu_dtype dt)
{
    memset(c, 0, sizeof(*c));
    c->mode = dt == GPU_FP16 ? GPU_SCALE_DYNAMIC : GPU_SCALE_NONE;
    c->init_scale = 65536.0f;
    c->growth_factor = 2.0f;
    c->backoff_factor = 0.5f;
    c->growth_interval = 2000;
    c->hysteresis = 1;
    c->min_scale = 1.0f;
    c->max_scale = 16777216.0f;
    c->floor_patience = 50;
}

/* Checks every field; on a bad value stores the job-spec name of the field in *field
 * (a static string; field may be NULL) and returns GPU_EINVAL. c is borrowed. */
int gpu_scaler_validate(const gpu_scaler_config *c, const char **field)
{
    const char *bad = NULL;

    if (c->mode != GPU_SCALE_NONE && c->mode != GPU_SCALE_STATIC &&
        c->mode != GPU_SCALE_DYNAMIC)
        bad = "precision.loss_scale.mode";
    else if (c->mode != GPU_SCALE_NONE && !(isfinite(c->init_scale) && c->init_scale > 0.0f))
        bad = "precision.loss_scale.init";
    else if (!(isfinite(c->growth_factor) && c->growth_factor > 1.0f))
        bad = "precision.loss_scale.growth_factor";
    else if (!(c->backoff_factor > 0.0f && c->backoff_factor < 1.0f))
        bad = "precision.loss_scale.backoff_factor";
    else if (c->growth_interval < 1)
        bad = "precision.loss_scale.growth_interval";
    else if (c->hysteresis < 1)
        bad = "precision.loss_scale.hysteresis";
    else if (!(isfinite(c->min_scale) && c->min_scale > 0.0f))
        bad = "precision.loss_scale.min_scale";
    else if (!(isfinite(c->max_scale) && c->max_scale >= c->min_scale))
        bad = "precision.loss_scale.max_scale";
    else if (c->floor_patience < 1)
        bad = "precision.loss_scale.floor_patience";
    else if (c->mode == GPU_SCALE_DYNAMIC &&
             !(c->init_scale >= c->min_scale && c->init_scale <= c->max_scale))
        bad = "precision.loss_scale.init";
    if (field)
        *field = bad;
    return bad ? GPU_EINVAL : 0;
}

/* Resets *s for a fresh run under config c (both borrowed). */
void gpu_scaler_init(gpu_scaler_state *s, const gpu_scaler_config *c)
{
    memset(s, 0, sizeof(*s));
    s->scale = c->mode == GPU_SCALE_NONE ? 1.0f : c->init_scale;
    s->hysteresis_left = c->hysteresis;
}

/* The unscale multiplier for the current scale; s is borrowed. A scale of 1 (mode none)
 * gives exactly 1, which makes gpu_unscale skip the multiply. */
float gpu_scaler_inv(const gpu_scaler_state *s)
{
    return (float)(1.0 / (double)s->scale);
}

/* ---- the per-step update ------------------------------------------------------------- */

/* The rule of gpu/scaler_rule.h, which the CUDA step's scaler kernel runs too (so the two
 * cannot drift apart). s is updated in place; s and c are borrowed. */
int gpu_scaler_update(gpu_scaler_state *s, const gpu_scaler_config *c, bool found_inf)
{
    return gpu_scaler_rule(s, c, found_inf);
}

/* ---- the fused unscale pass ---------------------------------------------------------- */

#define LANES 16
#define UCHUNK 32768        /* elements of a tensor per work item: a multiple of 64 */
#define UBATCH 64           /* work items per parallel region */

/* One chunk's partial results. */
typedef struct {
    float amax, amax_scaled;
    int64_t nonfinite, zeros;
    double sumsq;           /* the chunk's 16 lanes added 0..15 */
} chunk_acc;

static double lanes_sum(const double *lane)
{
    double s = 0.0;
    for (int l = 0; l < LANES; l++)
        s += lane[l];
    return s;
}

/*
 * Portable path. For each element x (the scaled gradient):
 *   not finite (|x| > FLT_MAX or NaN): counted, left untouched;
 *   finite: y = x * inv (or x when inv == 1), stored; amax_scaled = max(|x|),
 *           amax = max(|y|), zeros += (y == 0), lane[i % 16] += (double)y * y.
 * The max is written as (a > m ? a : m) to match the AVX-512 VMAXPS operand order, so a NaN
 * y (only possible when inv is not finite) never replaces the running maximum.
 */
static void unscale_portable(float *g, size_t n, float inv, chunk_acc *t)
{
    const bool mul = inv != 1.0f;
    double lane[LANES] = {0};
    float amax = 0.0f, amax_s = 0.0f;
    int64_t nonfinite = 0, zeros = 0;

    for (size_t i = 0; i < n; i++) {
        float x = g[i];
        float a = fabsf(x);
        if (!(a <= FLT_MAX)) {
            nonfinite++;
            continue;
        }
        float y = mul ? x * inv : x;
        if (mul)
            g[i] = y;
        float ay = fabsf(y);
        amax_s = a > amax_s ? a : amax_s;
        amax = ay > amax ? ay : amax;
        zeros += y == 0.0f;
        lane[i % LANES] += (double)y * (double)y;
    }
    t->amax = amax;
    t->amax_scaled = amax_s;
    t->nonfinite = nonfinite;
    t->zeros = zeros;
    t->sumsq = lanes_sum(lane);
}

#if SCALER_HAVE_X86
/* AVX-512 path: 16 elements per iteration, the tail with masked loads and stores. Lane k
 * of the two 8-wide double accumulators is lane k of the portable path, and the product
 * (double)y * y is exact, so the FMA gives the same sums as the portable add. */
__attribute__((target("avx512f"))) static void
unscale_avx512(float *g, size_t n, float inv, chunk_acc *t)
{
    const bool mul = inv != 1.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512 vmax = _mm512_set1_ps(FLT_MAX);
    const __m512 zero = _mm512_setzero_ps();
    __m512 amax = zero, amax_s = zero;
    __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
    double lane[LANES];
    int64_t nonfinite = 0, zeros = 0;

    for (size_t i = 0; i < n; i += LANES) {
        size_t rem = n - i;
        __mmask16 valid = rem >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1u);
        __m512 x = _mm512_maskz_loadu_ps(valid, g + i);
        __m512 a = _mm512_abs_ps(x);
        __mmask16 fin = _mm512_mask_cmp_ps_mask(valid, a, vmax, _CMP_LE_OQ);
        nonfinite += __builtin_popcount((unsigned)(valid & (__mmask16)~fin));
        __m512 y = x;
        if (mul) {
            y = _mm512_mul_ps(x, vinv);
            _mm512_mask_storeu_ps(g + i, fin, y);
        }
        y = _mm512_maskz_mov_ps(fin, y);
        amax_s = _mm512_mask_max_ps(amax_s, fin, a, amax_s);
        amax = _mm512_mask_max_ps(amax, fin, _mm512_abs_ps(y), amax);
        zeros += __builtin_popcount((unsigned)_mm512_mask_cmp_ps_mask(fin, y, zero,
                                                                       _CMP_EQ_OQ));
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(y));
        __m512d hi = _mm512_cvtps_pd(
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
        acc_lo = _mm512_fmadd_pd(lo, lo, acc_lo);
        acc_hi = _mm512_fmadd_pd(hi, hi, acc_hi);
    }
    _mm512_storeu_pd(lane, acc_lo);
    _mm512_storeu_pd(lane + 8, acc_hi);
    t->amax = _mm512_reduce_max_ps(amax);
    t->amax_scaled = _mm512_reduce_max_ps(amax_s);
    t->nonfinite = nonfinite;
    t->zeros = zeros;
    t->sumsq = lanes_sum(lane);
}
#endif

static atomic_int unscale_impl_id = GPU_IMPL_UNSET;

const char *gpu_unscale_impl(void)
{
    return gpu_impl_name(gpu_impl_pick(&unscale_impl_id));
}

/* impl is borrowed. */
int gpu_unscale_force(const char *impl)
{
    return gpu_impl_force(&unscale_impl_id, impl);
}

/* A work item: n elements of tensor `tensor` from g (the tensor's start when first). */
typedef struct {
    float *g;
    size_t n;
    int tensor;
    bool first;
} chunk_item;

/* Walks the tensors chunk by chunk: the next chunk is element pos of tensor k. */
typedef struct {
    float *g;
    const size_t *offsets, *counts;
    int ntensors, k;
    size_t pos;
} chunk_cursor;

/* Fills items with the next chunks (at most UBATCH, each tensor's in order, one empty chunk
 * for an empty tensor); returns their number, their elements in *elems. */
static int next_chunks(chunk_cursor *c, chunk_item *items, size_t *elems)
{
    int n = 0;

    *elems = 0;
    while (n < UBATCH && c->k < c->ntensors) {
        size_t count = c->counts[c->k], left = count - c->pos;
        size_t len = left < UCHUNK ? left : UCHUNK;
        items[n++] = (chunk_item){c->g + c->offsets[c->k] + c->pos, len, c->k, c->pos == 0};
        *elems += len;
        c->pos += len;
        if (c->pos >= count) {
            c->k++;
            c->pos = 0;
        }
    }
    return n;
}


/* Item i on path impl into acc[i]. */
static void run_chunk(const chunk_item *items, int i, float inv, int impl, chunk_acc *acc)
{
#if SCALER_HAVE_X86
    if (impl == GPU_IMPL_AVX512) {
        unscale_avx512(items[i].g, items[i].n, inv, &acc[i]);
        return;
    }
#endif
    (void)impl;
    unscale_portable(items[i].g, items[i].n, inv, &acc[i]);
}

/* Runs the n items (elems elements) into acc[0..n), on the OpenMP team when they are many. */
static void run_chunks(const chunk_item *items, int n, size_t elems, float inv, int impl,
                       chunk_acc *acc)
{
    if (!gpu_par_worth(elems)) {
        for (int i = 0; i < n; i++)
            run_chunk(items, i, inv, impl, acc);
        return;
    }
#pragma omp parallel for schedule(dynamic)
    for (int i = 0; i < n; i++)
        run_chunk(items, i, inv, impl, acc);
}

/* Adds a chunk's partial stats to its tensor's s (which the tensor's first chunk sets). */
static void stat_merge(gpu_grad_stat *s, const chunk_acc *a, bool first)
{
    if (first) {
        s->amax = a->amax;
        s->amax_scaled = a->amax_scaled;
        s->nonfinite = a->nonfinite;
        s->zeros = a->zeros;
        return;
    }
    s->amax = a->amax > s->amax ? a->amax : s->amax;
    s->amax_scaled = a->amax_scaled > s->amax_scaled ? a->amax_scaled : s->amax_scaled;
    s->nonfinite += a->nonfinite;
    s->zeros += a->zeros;
}

/* See gpu.h. g, offsets and counts are borrowed (g modified in place); stats, found_inf and
 * sumsq are out-pointers (each may be NULL). *found_inf receives true or false (it is
 * assigned, not OR-ed). A gradient whose scaled value is finite but whose unscaled value
 * overflows (possible only when scale < 1) is not flagged; it shows in amax and sumsq. */
void gpu_unscale(float *g, const size_t *offsets, const size_t *counts, int ntensors,
                 float inv, gpu_grad_stat *stats, bool *found_inf, double *sumsq)
{
    chunk_cursor cur = {g, offsets, counts, ntensors, 0, 0};
    chunk_item items[UBATCH];
    chunk_acc acc[UBATCH];
    double total = 0.0;
    bool any = false;
    int impl = gpu_impl_pick(&unscale_impl_id);
    size_t elems;
    int n;

    while ((n = next_chunks(&cur, items, &elems)) > 0) {
        run_chunks(items, n, elems, inv, impl, acc);
        for (int i = 0; i < n; i++) {
            total += acc[i].sumsq;
            any |= acc[i].nonfinite > 0;
            if (stats)
                stat_merge(&stats[items[i].tensor], &acc[i], items[i].first);
        }
    }
    if (found_inf)
        *found_inf = any;
    if (sumsq)
        *sumsq = total;
}
