/*
 * diag.c - per-layer AMP diagnostics: the counters a model's forward and backward feed
 * (gpu_diag_*), their reduction to per-layer statistics, and the recommendations drawn
 * from them and from the loss scaler's state.
 *
 * Counting works on the bit patterns of the fp32 values before they are rounded to the
 * op's dtype, with thresholds that are exact for round-to-nearest-even:
 *   - a value becomes inf/NaN when |x| >= the dtype's overflow threshold (fp16 65520, bf16
 *     0x7F7F8000, fp32 only inf/NaN itself);
 *   - a non-zero value becomes exactly 0 (flushes) when |x| <= half the dtype's smallest
 *     subnormal (fp16 2^-25, bf16 2^-134; never for fp32);
 *   - it would flush without loss scaling when |x| / S <= that half, S the loss scale;
 *   - max-abs values are taken over finite values only.
 * The scan loops are branch-free integer code over 32-bit lanes (cloned for AVX-512 and
 * AVX2), so a scan costs about one read of data that the caller has just written.
 *
 * Recommendations are plain sentences keyed by (kind, layer); each is issued once per job
 * and again only when its number changes by a factor of two or more.
 *
 * Threads: none. A gpu_diag and a gpu_diag_advisor belong to one trainer.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "gpu/diag.h"

#ifdef __clang__ /* clang 14 gives clones of static functions global resolvers, which clash */
#define HOT
#else
#define HOT __attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3")))
#endif

/* Elements per inner block: the 32-bit lane counters cannot wrap within one. */
#define BLOCK 65536
/* Round in chunks of this many floats so the scan and the rounding share the cache. */
#define ROUND_CHUNK 8192

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* |x| bit pattern from which rounding to dt gives inf/NaN. */
static uint32_t overflow_bits(gpu_dtype dt)
{
    switch (dt) {
    case GPU_FP16:
        return 0x477FF000u; /* 65520 */
    case GPU_BF16:
        return 0x7F7F8000u;
    case GPU_FP32:
        break;
    }
    return 0x7F800000u;
}

/* Largest |x| bit pattern that rounds to 0 in dt (0: nothing flushes). */
static uint32_t flush_bits(gpu_dtype dt)
{
    switch (dt) {
    case GPU_FP16:
        return 0x33000000u; /* 2^-25 */
    case GPU_BF16:
        return 0x00008000u; /* 2^-134, an fp32 subnormal */
    case GPU_FP32:
        break;
    }
    return 0;
}

/* Largest |g| bit pattern with |g| / scale <= half the smallest subnormal of dt, decided
 * in double: the flush threshold of the gradient that the loss scale multiplied. */
static uint32_t flush_bits_scaled(gpu_dtype dt, float scale)
{
    uint32_t fb = flush_bits(dt);
    if (fb == 0 || !(scale > 0.0f) || !isfinite(scale))
        return 0;
    double h = (double)u2f(fb), s = (double)scale;
    float t = (float)(h * s);
    if (!isfinite(t))
        t = FLT_MAX;
    while (t > 0.0f && (double)t / s > h)
        t = nextafterf(t, 0.0f);
    while (t < FLT_MAX && (double)nextafterf(t, INFINITY) / s <= h)
        t = nextafterf(t, INFINITY);
    return f2u(t);
}

typedef struct {
    uint32_t amax; /* bit pattern of the largest finite |x| */
    int64_t nonzero, flushed, flushed_unscaled, nonfinite;
} scan_acc;

/* One block (n <= BLOCK) of the gradient scan. */
HOT static void scan_block(const uint32_t *restrict x, size_t n, uint32_t ovf, uint32_t fl,
                           uint32_t ufl, scan_acc *acc)
{
    /* |x| patterns fit in int32; signed max vectorises where a select on unsigned does not */
    int32_t amax = 0;
    uint32_t nz = 0, f = 0, uf = 0, nf = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t a = x[i] & 0x7FFFFFFFu, am1 = a - 1u;
        int32_t fin = (int32_t)a < 0x7F800000 ? (int32_t)a : 0;
        amax = fin > amax ? fin : amax;
        nz += a != 0u;
        f += am1 < fl;
        uf += am1 < ufl;
        nf += a >= ovf;
    }
    acc->amax = (uint32_t)amax > acc->amax ? (uint32_t)amax : acc->amax;
    acc->nonzero += nz;
    acc->flushed += f;
    acc->flushed_unscaled += uf;
    acc->nonfinite += nf;
}

/* One block of the forward scan: finite max-abs and the count that overflows. */
HOT static void amax_block(const uint32_t *restrict x, size_t n, uint32_t ovf, uint32_t *amaxp,
                           int64_t *over)
{
    int32_t amax = (int32_t)*amaxp;
    uint32_t nf = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t a = x[i] & 0x7FFFFFFFu;
        int32_t fin = (int32_t)a < 0x7F800000 ? (int32_t)a : 0;
        amax = fin > amax ? fin : amax;
        nf += a >= ovf;
    }
    *amaxp = (uint32_t)amax;
    *over += nf;
}

static void scan(const float *g, size_t n, gpu_dtype dt, float scale, scan_acc *acc)
{
    const uint32_t *x = (const uint32_t *)(const void *)g;
    uint32_t ovf = overflow_bits(dt), fl = flush_bits(dt), ufl = flush_bits_scaled(dt, scale);
    memset(acc, 0, sizeof(*acc));
    for (size_t off = 0; off < n; off += BLOCK)
        scan_block(x + off, n - off < BLOCK ? n - off : BLOCK, ovf, fl, ufl, acc);
}

/* ---- collection ------------------------------------------------------------------------ */

/* Start a step's collection; see gpu/diag.h. */
void gpu_diag_begin(gpu_diag *d, float scale)
{
    for (int i = 0; i < d->nlayers; i++) {
        gpu_layer_diag *l = &d->layer[i];
        char name[sizeof(l->name)];
        gpu_dtype dt = l->dtype;
        memcpy(name, l->name, sizeof(name));
        memset(l, 0, sizeof(*l));
        memcpy(l->name, name, sizeof(name));
        l->dtype = dt;
    }
    d->scale = scale;
    d->first_nonfinite = -1;
    d->first_in_forward = false;
}

/* The layer slot for name; see gpu/diag.h. A known name keeps its slot (and takes dt). */
int gpu_diag_layer(gpu_diag *d, const char *name, gpu_dtype dt)
{
    for (int i = 0; i < d->nlayers; i++)
        if (strcmp(d->layer[i].name, name) == 0) {
            d->layer[i].dtype = dt;
            return i;
        }
    if (d->nlayers >= GPU_DIAG_MAX_LAYERS)
        return -1;
    gpu_layer_diag *l = &d->layer[d->nlayers];
    memset(l, 0, sizeof(*l));
    snprintf(l->name, sizeof(l->name), "%s", name);
    l->dtype = dt;
    return d->nlayers++;
}

static void note_first(gpu_diag *d, int layer, bool forward)
{
    if (d->first_nonfinite < 0) {
        d->first_nonfinite = layer;
        d->first_in_forward = forward;
    }
}

/* Forward outputs before rounding; see gpu/diag.h. */
void gpu_diag_forward(gpu_diag *d, int layer, const float *y, size_t n)
{
    if (layer < 0 || layer >= d->nlayers)
        return;
    gpu_layer_diag *l = &d->layer[layer];
    const uint32_t *x = (const uint32_t *)(const void *)y;
    uint32_t ovf = overflow_bits(l->dtype), amax = f2u(l->act_amax);
    int64_t over = 0;
    for (size_t off = 0; off < n; off += BLOCK)
        amax_block(x + off, n - off < BLOCK ? n - off : BLOCK, ovf, &amax, &over);
    l->act_amax = u2f(amax);
    l->act_n += (int64_t)n;
    l->act_overflow += over;
    if (over > 0)
        note_first(d, layer, true);
}

/* A weight gradient before rounding; see gpu/diag.h. */
void gpu_diag_weight_grad(gpu_diag *d, int layer, const float *g, size_t n)
{
    if (layer < 0 || layer >= d->nlayers)
        return;
    gpu_layer_diag *l = &d->layer[layer];
    scan_acc a;
    scan(g, n, l->dtype, d->scale, &a);
    if (u2f(a.amax) > l->grad_amax)
        l->grad_amax = u2f(a.amax);
    l->grad_n += (int64_t)n;
    l->grad_nonzero += a.nonzero;
    l->grad_flushed += a.flushed;
    l->grad_flushed_unscaled += a.flushed_unscaled;
    l->grad_nonfinite += a.nonfinite;
    if (a.nonfinite > 0)
        note_first(d, layer, false);
}

/* The input gradient a layer's backward produces, before rounding; see gpu/diag.h. */
void gpu_diag_input_grad(gpu_diag *d, int layer, const float *g, size_t n)
{
    if (layer < 0 || layer >= d->nlayers)
        return;
    gpu_layer_diag *l = &d->layer[layer];
    scan_acc a;
    scan(g, n, l->dtype, d->scale, &a);
    l->in_n += (int64_t)n;
    l->in_nonzero += a.nonzero;
    l->in_flushed += a.flushed;
    l->in_flushed_unscaled += a.flushed_unscaled;
    l->in_nonfinite += a.nonfinite;
    if (a.nonfinite > 0)
        note_first(d, layer, false);
}

/* The gradient arriving at a layer's output, already rounded; see gpu/diag.h. */
void gpu_diag_backward(gpu_diag *d, int layer, const float *g, size_t n)
{
    if (layer < 0 || layer >= d->nlayers)
        return;
    const uint32_t *x = (const uint32_t *)(const void *)g;
    uint32_t amax = 0;
    int64_t bad = 0;
    for (size_t off = 0; off < n; off += BLOCK)
        amax_block(x + off, n - off < BLOCK ? n - off : BLOCK, 0x7F800000u, &amax, &bad);
    d->layer[layer].out_nonfinite += bad;
    if (bad > 0)
        note_first(d, layer, false);
}

/* Account and round, chunk by chunk; see gpu/diag.h. */
void gpu_diag_round_grad(gpu_diag *d, int layer, bool weight, float *g, size_t n, gpu_dtype dt)
{
    if (!d) {
        gpu_round_n(g, g, n, dt);
        return;
    }
    for (size_t off = 0; off < n; off += ROUND_CHUNK) {
        size_t len = n - off < ROUND_CHUNK ? n - off : ROUND_CHUNK;
        if (weight)
            gpu_diag_weight_grad(d, layer, g + off, len);
        else
            gpu_diag_input_grad(d, layer, g + off, len);
        gpu_round_n(g + off, g + off, len, dt);
    }
}

/* Values starved by an upstream flush; see gpu/diag.h. */
void gpu_diag_starved(gpu_diag *d, int layer, int64_t zero, int64_t unscaled)
{
    if (layer >= 0 && layer < d->nlayers) {
        d->layer[layer].grad_starved += zero;
        d->layer[layer].grad_starved_unscaled += unscaled;
    }
}

/* Flush threshold at a scale; see gpu/diag.h. */
uint32_t gpu_diag_flush_bits(gpu_dtype dt, float scale)
{
    return flush_bits_scaled(dt, scale);
}

/* ---- statistics ------------------------------------------------------------------------ */

/* Reduce the counters; see gpu/diag.h. */
void gpu_diag_stats(const gpu_diag *d, gpu_layer_stat *out)
{
    for (int i = 0; i < d->nlayers; i++) {
        const gpu_layer_diag *l = &d->layer[i];
        gpu_layer_stat *o = &out[i];
        /* the values that are not 0 in exact arithmetic: non-zero ones and starved ones */
        double base = (double)l->grad_nonzero + (double)l->grad_starved;
        memset(o, 0, sizeof(*o));
        o->name = l->name;
        o->dtype = l->dtype;
        o->act_amax = l->act_amax;
        o->act_headroom =
            l->act_amax > 0.0f ? (double)gpu_dtype_max(l->dtype) / l->act_amax : (double)INFINITY;
        o->act_overflow = l->act_overflow;
        o->grad_amax = d->scale > 0.0f ? (double)l->grad_amax / d->scale : (double)l->grad_amax;
        if (base > 0) {
            o->grad_underflow = ((double)l->grad_flushed + (double)l->grad_starved) / base;
            o->grad_underflow_unscaled =
                ((double)l->grad_flushed_unscaled + (double)l->grad_starved +
                 (double)l->grad_starved_unscaled) /
                base;
        }
        o->grad_nonfinite = l->grad_nonfinite;
    }
}

/* ---- recommendations ------------------------------------------------------------------- */

static double pct(double f)
{
    return 100.0 * f;
}

/* Give a recommendation unless the same (kind, layer) was given with a number within a
 * factor of two of value (value > 0). */
__attribute__((format(printf, 5, 6))) static void
offer(gpu_diag_advisor *a, const char *kind, const char *layer, double value, const char *fmt, ...)
{
    gpu_diag_seen *s = NULL;
    const char *lname = layer ? layer : "";
    for (int i = 0; i < a->nseen && !s; i++)
        if (strcmp(a->seen[i].kind, kind) == 0 && strcmp(a->seen[i].layer, lname) == 0)
            s = &a->seen[i];
    if (s) {
        double r = value / s->value;
        if (r < 2.0 && r > 0.5)
            return;
    } else {
        if (a->nseen >= GPU_DIAG_MAX_SEEN)
            return; /* remembered too many: stay quiet rather than repeat */
        s = &a->seen[a->nseen++];
        snprintf(s->kind, sizeof(s->kind), "%s", kind);
        snprintf(s->layer, sizeof(s->layer), "%s", lname);
    }
    s->value = value;
    if (a->nnew >= GPU_DIAG_MAX_RECS)
        return;
    int k = a->nnew++;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->message[k], sizeof(a->message[k]), fmt, ap);
    va_end(ap);
    snprintf(a->kind[k], sizeof(a->kind[k]), "%s", kind);
    snprintf(a->layer[k], sizeof(a->layer[k]), "%s", lname);
    a->rec[k].kind = a->kind[k];
    a->rec[k].layer = layer ? a->layer[k] : NULL;
    a->rec[k].message = a->message[k];
}

/* The value from which rounding to dt overflows, as a double. */
static double overflow_value(gpu_dtype dt)
{
    return (double)u2f(overflow_bits(dt));
}

/* Why the scale cannot help; see gpu/diag.h. */
void gpu_diag_explain(const gpu_diag *d, const gpu_layer_stat *st, const gpu_diag_context *c,
                      char *buf, size_t len)
{
    const char *fix = c->dtype == GPU_FP16 ? "use bf16" : "lower the learning rate";
    if (!d || d->first_nonfinite < 0) {
        snprintf(buf, len, "the gradients hold inf/NaN at every scale: %s", fix);
        return;
    }
    const gpu_layer_stat *l = &st[d->first_nonfinite];
    const char *dn = gpu_dtype_name(l->dtype);
    if (d->first_in_forward && l->act_amax >= overflow_value(l->dtype))
        snprintf(buf, len,
                 "%s's forward activations reach %.2g, beyond %s's %.6g, which no loss scale "
                 "can fix: %s",
                 l->name, l->act_amax, dn, (double)gpu_dtype_max(l->dtype),
                 l->dtype == GPU_FP16 ? "use bf16" : "lower the learning rate");
    else if (d->first_in_forward)
        snprintf(buf, len,
                 "%s's forward output holds inf/NaN (its inputs or weights are not finite): "
                 "the model diverged; lower the learning rate",
                 l->name);
    else
        snprintf(buf, len, "%s's gradients overflow %s even at loss scale %g: %s", l->name, dn,
                 (double)d->scale, fix);
}

/* A loss spike (see GPU_DIAG_SPIKE_*): judged against the window, then added to it. Told
 * at its first step; a later spike is told when it is twice the size (in standard
 * deviations) of the last one told, or half. */
static void spike(gpu_diag_advisor *a, const gpu_diag_context *c)
{
    if (!isfinite(c->loss) || c->overflow)
        return;
    int n = a->nlosses;
    if (n >= GPU_DIAG_SPIKE_MIN) {
        double mean = 0, var = 0;
        for (int i = 0; i < n; i++)
            mean += a->losses[i];
        mean /= n;
        for (int i = 0; i < n; i++)
            var += (a->losses[i] - mean) * (a->losses[i] - mean);
        double sd = sqrt(var / (n - 1)), z = sd > 0 ? (c->loss - mean) / sd : 0;
        bool first = !a->spiking;
        a->spiking = z > GPU_DIAG_SPIKE_SIGMA;
        if (a->spiking && first)
            offer(a, "loss_spike", NULL, z,
                  "loss spike: %.4g is %.0f standard deviations above the mean %.4g of the last "
                  "%d steps, with finite gradients (the data, or the data with this state of "
                  "the weights): rewind and skip the batches around it",
                  c->loss, z, mean, n);
    }
    a->losses[a->loss_next] = c->loss;
    a->loss_next = (a->loss_next + 1) % GPU_DIAG_SPIKE_WINDOW;
    if (a->nlosses < GPU_DIAG_SPIKE_WINDOW)
        a->nlosses++;
}

/* This step's recommendations; see gpu/diag.h. */
/* The fp8 operands' trouble in layer l: the worst underflow (>= 10% of the non-zero values
 * of an operand became 0) and the worst saturation (>= 1% clipped), each with the way out
 * the remedy takes (the layer in bf16; docs/fp8.md). True when an operand underflowed: the
 * gradients the layer passes on then underflow because of it, not of the loss scale. */
static bool advise_fp8(gpu_diag_advisor *a, const gpu_layer_stat *l, const gpu_fp8_config *f)
{
    static const char *const roles[] = {"forward input", "weight", "output gradient"};
    const double ufl[3] = {l->fp8_in_underflow, l->fp8_w_underflow, l->fp8_grad_underflow};
    const double sat[3] = {l->fp8_in_saturated, l->fp8_w_saturated, l->fp8_grad_saturated};
    const double scale[3] = {l->fp8_in_scale, l->fp8_w_scale, l->fp8_grad_scale};
    int u = 0, s = 0;
    for (int r = 1; r < 3; r++) {
        u = ufl[r] > ufl[u] ? r : u;
        s = sat[r] > sat[s] ? r : s;
    }
    const char *fu = gpu_fp8_format_name(gpu_fp8_role_format(f, u));
    const char *fs = gpu_fp8_format_name(gpu_fp8_role_format(f, s));
    char margin[32] = "";
    if (f->recipe == GPU_FP8_DELAYED && f->margin > 0)
        snprintf(margin, sizeof(margin), ", margin %d", f->margin);
    if (ufl[u] >= 0.10)
        offer(a, "fp8_underflow", l->name, ufl[u],
              "%s %s: %.0f%% of the non-zero values underflow to 0 in %s (scale %.3g%s): %s"
              "keep %s in bf16",
              l->name, roles[u], pct(ufl[u]), fu, scale[u], margin,
              f->recipe == GPU_FP8_DELAYED ? "use current scaling or a smaller margin, or " : "",
              l->name);
    if (sat[s] >= 0.01)
        offer(a, "fp8_saturation", l->name, sat[s],
              "%s %s: %.0f%% of the values saturate at %s's %g (scale %.3g): %skeep %s in bf16",
              l->name, roles[s], pct(sat[s]), fs, (double)gpu_fp8_max(gpu_fp8_role_format(f, s)),
              scale[s],
              f->recipe == GPU_FP8_DELAYED ? "use current scaling or a larger margin, or " : "",
              l->name);
    return ufl[u] >= 0.10;
}

void gpu_diag_advise(gpu_diag_advisor *a, const gpu_diag *d, const gpu_layer_stat *st,
                     const gpu_diag_context *c)
{
    a->nnew = 0;
    for (int i = 0; d && i < d->nlayers; i++) {
        const gpu_layer_stat *l = &st[i];
        const char *dn = gpu_dtype_name(l->dtype);
        bool fp8_ufl = l->fp8 && c->fp8 && advise_fp8(a, l, c->fp8);
        if (l->dtype == GPU_FP32)
            continue;
        if (l->act_overflow > 0 && l->act_amax >= overflow_value(l->dtype))
            offer(a, "act_overflow", l->name, l->act_amax,
                  "activations of %s exceed %s's %.6g (max %.2g): %s", l->name, dn,
                  (double)gpu_dtype_max(l->dtype), l->act_amax,
                  l->dtype == GPU_FP16 ? "use bf16"
                                       : "the model diverges; lower the learning rate");
        else if (l->dtype == GPU_FP16 && l->act_overflow == 0 && l->act_headroom < 2.0)
            offer(a, "act_headroom", l->name, l->act_amax,
                  "activations of %s reach %.2g, within a factor of 2 of fp16's 65504: bf16 "
                  "has fp32's range",
                  l->name, l->act_amax);
        if (l->grad_underflow >= 0.10 && !fp8_ufl) {
            if (c->mode == GPU_SCALE_NONE)
                offer(a, "underflow", l->name, l->grad_underflow,
                      "%.0f%% of %s's gradients flush to zero without loss scaling: enable "
                      "dynamic loss scaling",
                      pct(l->grad_underflow), l->name);
            else if (c->mode == GPU_SCALE_STATIC)
                offer(a, "underflow", l->name, l->grad_underflow,
                      "%.0f%% of %s's gradients flush to zero at the static loss scale %g: "
                      "enable dynamic loss scaling",
                      pct(l->grad_underflow), l->name, (double)c->scale);
            else
                offer(a, "underflow", l->name, l->grad_underflow,
                      "%.0f%% of %s's gradients flush to zero even at loss scale %g: %s",
                      pct(l->grad_underflow), l->name, (double)c->scale,
                      l->dtype == GPU_FP16 ? "use bf16" : "raise precision.loss_scale.min_scale");
        }
        if (!c->master_weights && c->dtype != GPU_FP32 && l->lost_updates >= 0.10)
            offer(a, "lost_updates", l->name, l->lost_updates,
                  "%s loses %.0f%% of its weight updates to %s rounding: enable master weights",
                  l->name, pct(l->lost_updates), gpu_dtype_name(c->dtype));
    }
    int patience = c->floor_patience < 50 ? c->floor_patience : 50;
    if (c->mode == GPU_SCALE_DYNAMIC && c->floor_streak >= patience && patience > 0) {
        char why[256];
        gpu_diag_explain(d, st, c, why, sizeof(why));
        offer(a, "scale_floor", NULL, (double)c->floor_streak,
              "loss scale stuck at its floor %g for %d steps: %s", (double)c->min_scale,
              c->floor_streak, why);
    }
    if (c->comm_tensor)
        offer(a, "comm_overflow", c->comm_tensor, (double)c->scale,
              "the %s gradient all-reduce overflowed: %s's gradients were finite on every rank "
              "before it and hold inf/NaN after it (loss scale %g): use comm_hook \"%s\" or a "
              "lower loss scale",
              c->hook == GPU_HOOK_NONE ? "fp32" : gpu_comm_hook_name(c->hook),
              c->comm_tensor, (double)c->scale, c->hook == GPU_HOOK_FP16 ? "bf16" : "none");
    spike(a, c);
    if (c->mode == GPU_SCALE_DYNAMIC && c->next_scale < 1.0f)
        offer(a, "scale_below_one", NULL, 1.0,
              "the loss scale fell below 1 (%g): gradients overflow even unscaled; %s",
              (double)c->next_scale, c->dtype == GPU_FP16 ? "use bf16" : "lower the learning rate");
}
