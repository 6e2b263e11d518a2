/*
 * step_host.cu - the tests' synchronous host-buffer wrappers of a training step after
 * backward on the device (declared in tests/cudahost/cudahost.h; the launches are
 * gpu/cuda/cuda_step.h's): the optimizers with a given found_inf, back-to-back scaler
 * updates, unscale + clip, a diagnostics collection, and whole step tails (begin, unscale,
 * clip, optimizer, scaler update) run as the trainer runs them, without a host sync between
 * steps.
 *
 * Invariants: the state a wrapper starts from is gpu_cuda_step_state_make's (the one
 * gpu_cuda_step_state_init writes), with found_inf or the scale set as the call asks; every
 * device buffer is freed on every path. Threads: synchronous (default stream); each call
 * owns its buffers.
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_common.cuh"
#include "gpu/cuda/cuda_step.h"
#include "tests/cudahost/cudahost.h"

static bool dt_ok(gpu_dtype dt)
{
    return dt == GPU_FP32 || dt == GPU_FP16 || dt == GPU_BF16;
}

/* cudaMalloc(*d, bytes) (a few bytes for 0, so that every buffer is a valid pointer) and,
 * when src is not NULL, copy bytes of src into it. */
static cudaError_t dev_dup(void **d, const void *src, size_t bytes)
{
    cudaError_t e = cudaMalloc(d, bytes ? bytes : 16);
    if (e == cudaSuccess && src != NULL && bytes > 0)
        e = cudaMemcpy(*d, src, bytes, cudaMemcpyHostToDevice);
    return e;
}

/* Copy bytes of device d into host dst (nothing when dst is NULL or bytes is 0). */
static cudaError_t dev_get(void *dst, const void *d, size_t bytes)
{
    if (dst == NULL || bytes == 0)
        return cudaSuccess;
    return cudaMemcpy(dst, d, bytes, cudaMemcpyDeviceToHost);
}

/* A scaler state with the given scale and nothing counted. */
static gpu_scaler_state scaler_at(float scale)
{
    gpu_scaler_state s;
    memset(&s, 0, sizeof(s));
    s.scale = scale;
    return s;
}

/* The clip kernel without clipping (applied + 1 and the bias corrections unless found_inf),
 * then gmul written over the coefficient. */
static int prepare_update(gpu_cuda_step_state *d_state, const gpu_optim_config *c, float gmul)
{
    gpu_optim_config noclip = *c;
    noclip.grad_clip = 0.0f;
    int rc = gpu_cuda_step_clip_launch(d_state, &noclip, 0);
    if (rc != 0)
        return rc;
    GPU_CUDA_CHECK(cudaMemcpy(&d_state->clip, &gmul, sizeof(gmul), cudaMemcpyHostToDevice));
    return 0;
}

/* The device buffers of one optimizer wrapper call. */
typedef struct {
    gpu_cuda_step_state *state;  /* t - 1 steps applied, found_inf as given */
    void *x;                     /* the parameters: p, or the lowp weights */
    float *g, *m, *v;            /* m and v only where the caller has them */
} upd_dev;

/* The arguments both optimizer wrappers check; x is p or the lowp weights. */
static bool upd_args_ok(const gpu_optim_config *c, gpu_dtype wdt, const void *x, const float *g,
                        const float *m, const float *v, size_t n)
{
    if (c == NULL || !dt_ok(wdt))
        return false;
    return n == 0 ||
           (x != NULL && g != NULL && (c->type == GPU_OPT_SGD || (m != NULL && v != NULL)));
}

/* Allocate d's buffers and copy in, in this order: the state of step t (t - 1 applied,
 * found_inf), x (xbytes), g, m and v (n floats each; m, v only when not NULL). */
static int upd_upload(upd_dev *d, int64_t t, bool found_inf, const void *x, size_t xbytes,
                      const float *g, const float *m, const float *v, size_t n)
{
    gpu_cuda_step_state h;
    gpu_scaler_state s0 = scaler_at(1.0f);
    size_t fb = n * sizeof(float);

    gpu_cuda_step_state_make(&h, &s0, t - 1, 0);
    h.found_inf = found_inf;
    GPU_CUDA_CHECK(dev_dup((void **)&d->state, &h, sizeof(h)));
    GPU_CUDA_CHECK(dev_dup(&d->x, x, xbytes));
    GPU_CUDA_CHECK(dev_dup((void **)&d->g, g, fb));
    if (m != NULL)
        GPU_CUDA_CHECK(dev_dup((void **)&d->m, m, fb));
    if (v != NULL)
        GPU_CUDA_CHECK(dev_dup((void **)&d->v, v, fb));
    return 0;
}

/* Copy back, in this order: the state into *h, x (xbytes), m and v (when not NULL). */
static int upd_download(const upd_dev *d, gpu_cuda_step_state *h, void *x, size_t xbytes,
                        float *m, float *v, size_t n)
{
    GPU_CUDA_CHECK(dev_get(h, d->state, sizeof(*h)));
    GPU_CUDA_CHECK(dev_get(x, d->x, xbytes));
    GPU_CUDA_CHECK(dev_get(m, d->m, n * sizeof(float)));
    GPU_CUDA_CHECK(dev_get(v, d->v, n * sizeof(float)));
    return 0;
}

static void upd_free(upd_dev *d)
{
    cudaFree(d->v);
    cudaFree(d->m);
    cudaFree(d->g);
    cudaFree(d->x);
    cudaFree(d->state);
}

/* See cudahost.h. All pointers host, borrowed. */
extern "C" int gpu_cuda_optim_update_host(const gpu_optim_config *c, double lr, int64_t t,
                                          float gmul, bool found_inf, float *p, const float *g,
                                          float *m, float *v, size_t n, void *work,
                                          gpu_dtype wdt, int64_t *applied)
{
    int rc = gpu_cuda_ready();
    upd_dev d = {NULL, NULL, NULL, NULL, NULL};
    gpu_cuda_step_state h;
    void *d_work = NULL;
    size_t fb = n * sizeof(float), wb;

    if (rc != 0)
        return rc;
    if (!upd_args_ok(c, wdt, p, g, m, v, n))
        return GPU_EINVAL;
    wb = n * gpu_dtype_size(wdt);

    rc = upd_upload(&d, t, found_inf, p, fb, g, m, v, n);
    if (rc != 0)
        goto fail;
    if (work != NULL)
        GPU_CUDA_TRY(dev_dup(&d_work, work, wb));
    rc = prepare_update(d.state, c, gmul);
    if (rc == 0)
        rc = gpu_cuda_optim_launch(c, lr, d.state, (float *)d.x, d.g, d.m, d.v, n, d_work, wdt, 0);
    if (rc == 0)
        rc = upd_download(&d, &h, p, fb, m, v, n);
    if (rc != 0)
        goto fail;
    GPU_CUDA_TRY(dev_get(work, d_work, wb));
    if (applied != NULL)
        *applied = h.applied;
    rc = 0;
fail:
    cudaFree(d_work);
    upd_free(&d);
    return rc;
}

/* See cudahost.h. All pointers host, borrowed. */
extern "C" int gpu_cuda_optim_update_lowp_host(const gpu_optim_config *c, double lr, int64_t t,
                                               float gmul, bool found_inf, void *w,
                                               gpu_dtype wdt, const float *g, float *m,
                                               float *v, size_t n, int64_t *lost,
                                               int64_t *applied)
{
    int rc = gpu_cuda_ready();
    upd_dev d = {NULL, NULL, NULL, NULL, NULL};
    gpu_cuda_step_state h;
    size_t *d_off = NULL, *d_cnt = NULL, zero = 0;
    size_t wb;

    if (rc != 0)
        return rc;
    if (!upd_args_ok(c, wdt, w, g, m, v, n))
        return GPU_EINVAL;
    wb = n * gpu_dtype_size(wdt);

    rc = upd_upload(&d, t, found_inf, w, wb, g, m, v, n);
    if (rc != 0)
        goto fail;
    GPU_CUDA_TRY(dev_dup((void **)&d_off, &zero, sizeof(zero)));
    GPU_CUDA_TRY(dev_dup((void **)&d_cnt, &n, sizeof(n)));
    rc = prepare_update(d.state, c, gmul);
    if (rc == 0)
        rc = gpu_cuda_optim_lowp_launch(c, lr, d.state, d.x, wdt, d.g, d.m, d.v, d_off, d_cnt, 1, n,
                                        NULL, 0);
    if (rc == 0)
        rc = upd_download(&d, &h, w, wb, m, v, n);
    if (rc != 0)
        goto fail;
    if (lost != NULL)
        *lost = (int64_t)h.lost_step;
    if (applied != NULL)
        *applied = h.applied;
    rc = 0;
fail:
    cudaFree(d_cnt);
    cudaFree(d_off);
    upd_free(&d);
    return rc;
}

/* See cudahost.h. Per step: found_inf copied into the state on the device, the update
 * launched, the state copied into a device trace; one synchronising copy at the end. */
extern "C" int gpu_cuda_scaler_update_host(gpu_scaler_state *s, const gpu_scaler_config *c,
                                           const bool *found_inf, int nsteps,
                                           gpu_scaler_state *trace, bool *floor)
{
    int rc = gpu_cuda_ready();
    gpu_cuda_step_state h, *d_state = NULL, *d_trace = NULL, *h_trace = NULL;
    int *h_found = NULL, *d_found = NULL;
    size_t ns;

    if (rc != 0)
        return rc;
    if (s == NULL || c == NULL || nsteps < 0 || (nsteps > 0 && found_inf == NULL))
        return GPU_EINVAL;
    if (nsteps == 0)
        return 0;
    ns = (size_t)nsteps;
    h_found = (int *)malloc(ns * sizeof(*h_found));
    h_trace = (gpu_cuda_step_state *)malloc(ns * sizeof(*h_trace));
    if (h_found == NULL || h_trace == NULL) {
        rc = GPU_ENOMEM;
        goto fail;
    }
    for (size_t k = 0; k < ns; k++)
        h_found[k] = found_inf[k] ? 1 : 0;
    gpu_cuda_step_state_make(&h, s, 0, 0);

    GPU_CUDA_TRY(dev_dup((void **)&d_state, &h, sizeof(h)));
    GPU_CUDA_TRY(dev_dup((void **)&d_found, h_found, ns * sizeof(*d_found)));
    GPU_CUDA_TRY(dev_dup((void **)&d_trace, NULL, ns * sizeof(*d_trace)));
    for (size_t k = 0; k < ns; k++) {
        GPU_CUDA_TRY(cudaMemcpyAsync(&d_state->found_inf, d_found + k, sizeof(int),
                                     cudaMemcpyDeviceToDevice, 0));
        rc = gpu_cuda_scaler_update_launch(d_state, c, 0);
        if (rc != 0)
            goto fail;
        GPU_CUDA_TRY(cudaMemcpyAsync(d_trace + k, d_state, sizeof(*d_trace),
                                     cudaMemcpyDeviceToDevice, 0));
    }
    GPU_CUDA_TRY(dev_get(h_trace, d_trace, ns * sizeof(*h_trace)));
    for (size_t k = 0; k < ns; k++) {
        if (trace != NULL)
            trace[k] = h_trace[k].scaler;
        if (floor != NULL)
            floor[k] = h_trace[k].floor_failed != 0;
    }
    *s = h_trace[ns - 1].scaler;
    rc = 0;
fail:
    cudaFree(d_trace);
    cudaFree(d_found);
    cudaFree(d_state);
    free(h_trace);
    free(h_found);
    return rc;
}

/* The extent of the tensors (largest offset + count) and the largest count; GPU_EINVAL when
 * the tables are missing. */
static int tensor_span(const size_t *offsets, const size_t *counts, int ntensors, size_t *span,
                       size_t *max_count)
{
    *span = 0;
    *max_count = 0;
    if (ntensors < 0 || (ntensors > 0 && (offsets == NULL || counts == NULL)))
        return GPU_EINVAL;
    for (int t = 0; t < ntensors; t++) {
        if (offsets[t] + counts[t] > *span)
            *span = offsets[t] + counts[t];
        if (counts[t] > *max_count)
            *max_count = counts[t];
    }
    return 0;
}

/* See cudahost.h. All pointers host, borrowed. */
extern "C" int gpu_cuda_clip_host(const gpu_optim_config *c, float scale, float *g,
                                  const size_t *offsets, const size_t *counts, int ntensors,
                                  gpu_grad_stat *stats, bool *found_inf, double *sumsq,
                                  double *norm, float *clip)
{
    int rc = gpu_cuda_ready();
    gpu_cuda_step_state h, *d_state = NULL;
    gpu_scaler_state s0 = scaler_at(scale);
    gpu_cuda_step_tstat *h_st = NULL, *d_st = NULL;
    size_t span, max_count, nt;
    float *d_g = NULL;
    size_t *d_off = NULL, *d_cnt = NULL;
    double *d_parts = NULL;

    if (rc != 0)
        return rc;
    if (c == NULL || found_inf == NULL || sumsq == NULL ||
        tensor_span(offsets, counts, ntensors, &span, &max_count) != 0 ||
        (span > 0 && g == NULL))
        return GPU_EINVAL;
    nt = (size_t)ntensors;
    h_st = (gpu_cuda_step_tstat *)malloc((nt ? nt : 1) * sizeof(*h_st));
    if (h_st == NULL)
        return GPU_ENOMEM;
    gpu_cuda_step_state_make(&h, &s0, 0, 0);

    GPU_CUDA_TRY(dev_dup((void **)&d_state, &h, sizeof(h)));
    GPU_CUDA_TRY(dev_dup((void **)&d_g, g, span * sizeof(*g)));
    GPU_CUDA_TRY(dev_dup((void **)&d_off, offsets, nt * sizeof(*offsets)));
    GPU_CUDA_TRY(dev_dup((void **)&d_cnt, counts, nt * sizeof(*counts)));
    GPU_CUDA_TRY(dev_dup((void **)&d_st, NULL, nt * sizeof(*d_st)));
    GPU_CUDA_TRY(dev_dup((void **)&d_parts, NULL, GPU_CUDA_UNSCALE_PARTS * sizeof(double)));
    rc = gpu_cuda_step_begin_launch(d_state, 0);
    if (rc == 0)
        rc = gpu_cuda_step_unscale_launch(d_g, d_off, d_cnt, ntensors, max_count, d_st,
                                          d_state, d_parts, 0);
    if (rc == 0)
        rc = gpu_cuda_step_clip_launch(d_state, c, 0);
    if (rc != 0)
        goto fail;
    rc = gpu_cuda_step_snapshot(d_state, &h, d_st, h_st, ntensors, 0);
    if (rc != 0)
        goto fail;
    GPU_CUDA_TRY(cudaStreamSynchronize(0));
    GPU_CUDA_TRY(dev_get(g, d_g, span * sizeof(*g)));
    if (stats != NULL)
        gpu_cuda_step_stats_export(h_st, ntensors, stats);
    *found_inf = h.found_inf != 0;
    *sumsq = h.sumsq;
    if (norm != NULL)
        *norm = h.grad_norm;
    if (clip != NULL)
        *clip = h.clip;
    rc = 0;
fail:
    cudaFree(d_parts);
    cudaFree(d_st);
    cudaFree(d_cnt);
    cudaFree(d_off);
    cudaFree(d_g);
    cudaFree(d_state);
    free(h_st);
    return rc;
}

/* See cudahost.h. All pointers host, borrowed. */
extern "C" int gpu_cuda_diag_host(const gpu_dtype *dtypes, int nlayers, float scale,
                                  const gpu_cuda_diag_call *calls, int ncalls,
                                  gpu_cuda_diag *out)
{
    int rc = gpu_cuda_ready();
    gpu_cuda_step_state h, *d_state = NULL;
    gpu_scaler_state s0 = scaler_at(scale);
    gpu_cuda_diag *d_diag = NULL;
    float *d_x = NULL;
    size_t total = 0, off = 0;

    if (rc != 0)
        return rc;
    if (out == NULL || nlayers < 0 || nlayers > GPU_CUDA_DIAG_MAX_LAYERS ||
        (nlayers > 0 && dtypes == NULL) || ncalls < 0 || (ncalls > 0 && calls == NULL))
        return GPU_EINVAL;
    for (int i = 0; i < ncalls; i++) {
        if (calls[i].n > 0 && calls[i].x == NULL)
            return GPU_EINVAL;
        total += calls[i].n;
    }
    gpu_cuda_step_state_make(&h, &s0, 0, 0);

    GPU_CUDA_TRY(dev_dup((void **)&d_state, &h, sizeof(h)));
    GPU_CUDA_TRY(dev_dup((void **)&d_diag, NULL, sizeof(*d_diag)));
    GPU_CUDA_TRY(dev_dup((void **)&d_x, NULL, total * sizeof(*d_x)));
    for (int i = 0; i < ncalls; i++) {
        if (calls[i].n > 0)
            GPU_CUDA_TRY(cudaMemcpy(d_x + off, calls[i].x, calls[i].n * sizeof(*d_x),
                                    cudaMemcpyHostToDevice));
        off += calls[i].n;
    }
    rc = gpu_cuda_diag_begin_launch(d_diag, d_state, 0);
    off = 0;
    for (int i = 0; rc == 0 && i < ncalls; i++) {
        int l = calls[i].layer;
        /* as on the CPU, a layer the table does not hold is ignored */
        if (l >= 0 && l < nlayers)
            rc = gpu_cuda_diag_launch(d_diag, l, dtypes[l], calls[i].kind, d_x + off,
                                      calls[i].n, 0);
        off += calls[i].n;
    }
    if (rc == 0)
        rc = gpu_cuda_diag_snapshot(d_diag, out, nlayers, 0);
    if (rc != 0)
        goto fail;
    GPU_CUDA_TRY(cudaStreamSynchronize(0));
    rc = 0;
fail:
    cudaFree(d_x);
    cudaFree(d_diag);
    cudaFree(d_state);
    return rc;
}

/* The device buffers of a tail run. */
typedef struct {
    gpu_cuda_step_state *state, *trace;
    float *g, *master, *m, *v;
    void *work;
    size_t *off, *cnt;
    gpu_cuda_step_tstat *stats;
    unsigned long long *tlost;
    double *parts;
} tail_dev;

static void tail_free(tail_dev *d)
{
    cudaFree(d->parts);
    cudaFree(d->tlost);
    cudaFree(d->stats);
    cudaFree(d->cnt);
    cudaFree(d->off);
    cudaFree(d->work);
    cudaFree(d->v);
    cudaFree(d->m);
    cudaFree(d->master);
    cudaFree(d->g);
    cudaFree(d->trace);
    cudaFree(d->state);
}

static int tail_args_ok(const gpu_optim_config *oc, const gpu_scaler_config *sc,
                        const gpu_scaler_state *s, const int64_t *applied, int nsteps,
                        const float *lr, const float *grads, const gpu_cuda_tail_bufs *b)
{
    if (oc == NULL || sc == NULL || s == NULL || applied == NULL || b == NULL || nsteps < 0 ||
        (nsteps > 0 && lr == NULL) || (nsteps > 0 && b->n > 0 && grads == NULL) ||
        !dt_ok(b->wdt) || b->ntensors < 0 ||
        (b->ntensors > 0 && (b->offsets == NULL || b->counts == NULL)))
        return 0;
    for (int t = 0; t < b->ntensors; t++)
        if (b->offsets[t] > b->n || b->counts[t] > b->n - b->offsets[t])
            return 0;
    if (b->n > 0 && b->master == NULL && b->work == NULL)
        return 0;
    return b->n == 0 || oc->type == GPU_OPT_SGD || (b->m != NULL && b->v != NULL);
}

/* Enqueue step k of a tail run on the default stream. */
static int tail_step(const gpu_optim_config *oc, const gpu_scaler_config *sc, double lr,
                     const gpu_cuda_tail_bufs *b, const tail_dev *d, size_t max_count, int k)
{
    size_t nt = (size_t)b->ntensors;
    float *g = d->g + (size_t)k * b->n;
    int rc = gpu_cuda_step_begin_launch(d->state, 0);
    if (rc == 0)
        rc = gpu_cuda_step_unscale_launch(g, d->off, d->cnt, b->ntensors, max_count,
                                          d->stats + (size_t)k * nt, d->state, d->parts, 0);
    if (rc == 0)
        rc = gpu_cuda_step_clip_launch(d->state, oc, 0);
    if (rc == 0 && b->master != NULL)
        rc = gpu_cuda_optim_launch(oc, lr, d->state, d->master, g, d->m, d->v, b->n, d->work,
                                   b->wdt, 0);
    else if (rc == 0)
        rc = gpu_cuda_optim_lowp_launch(oc, lr, d->state, d->work, b->wdt, g, d->m, d->v,
                                        d->off, d->cnt, b->ntensors, max_count,
                                        d->tlost + (size_t)k * nt, 0);
    if (rc == 0)
        rc = gpu_cuda_scaler_update_launch(d->state, sc, 0);
    if (rc == 0)
        GPU_CUDA_CHECK(cudaMemcpyAsync(d->trace + k, d->state, sizeof(*d->trace),
                                       cudaMemcpyDeviceToDevice, 0));
    return rc;
}

/* See cudahost.h. All pointers host, borrowed. */
extern "C" int gpu_cuda_step_tail_host(const gpu_optim_config *oc, const gpu_scaler_config *sc,
                                       gpu_scaler_state *s, int64_t *applied, int nsteps,
                                       const float *lr, const float *grads,
                                       gpu_cuda_tail_bufs *b, gpu_cuda_step_state *trace,
                                       gpu_grad_stat *stats, int64_t *tensor_lost)
{
    int rc = gpu_cuda_ready();
    tail_dev d;
    gpu_cuda_step_state *h_trace = NULL;
    gpu_cuda_step_tstat *h_st = NULL;
    unsigned long long *h_lost = NULL;
    size_t ns, nt, nst, span, max_count, fb, wb;

    memset(&d, 0, sizeof(d));
    if (rc != 0)
        return rc;
    if (!tail_args_ok(oc, sc, s, applied, nsteps, lr, grads, b) ||
        tensor_span(b->offsets, b->counts, b->ntensors, &span, &max_count) != 0)
        return GPU_EINVAL;
    if (nsteps == 0)
        return 0;
    ns = (size_t)nsteps;
    nt = (size_t)b->ntensors;
    fb = b->n * sizeof(float);
    wb = b->n * gpu_dtype_size(b->wdt);
    h_trace = (gpu_cuda_step_state *)malloc(ns * sizeof(*h_trace));
    nst = ns * nt > 0 ? ns * nt : 1;
    h_st = (gpu_cuda_step_tstat *)malloc(nst * sizeof(*h_st));
    h_lost = (unsigned long long *)calloc(nst, sizeof(*h_lost));
    if (h_trace == NULL || h_st == NULL || h_lost == NULL) {
        rc = GPU_ENOMEM;
        goto fail;
    }
    GPU_CUDA_TRY(dev_dup((void **)&d.state, NULL, sizeof(*d.state)));
    rc = gpu_cuda_step_state_init(d.state, s, *applied, 0, 0);
    if (rc != 0)
        goto fail;
    GPU_CUDA_TRY(dev_dup((void **)&d.trace, NULL, ns * sizeof(*d.trace)));
    GPU_CUDA_TRY(dev_dup((void **)&d.g, grads, ns * fb));
    if (b->master != NULL)
        GPU_CUDA_TRY(dev_dup((void **)&d.master, b->master, fb));
    if (b->work != NULL)
        GPU_CUDA_TRY(dev_dup(&d.work, b->work, wb));
    if (b->m != NULL)
        GPU_CUDA_TRY(dev_dup((void **)&d.m, b->m, fb));
    if (b->v != NULL)
        GPU_CUDA_TRY(dev_dup((void **)&d.v, b->v, fb));
    GPU_CUDA_TRY(dev_dup((void **)&d.off, b->offsets, nt * sizeof(size_t)));
    GPU_CUDA_TRY(dev_dup((void **)&d.cnt, b->counts, nt * sizeof(size_t)));
    GPU_CUDA_TRY(dev_dup((void **)&d.stats, NULL, ns * nt * sizeof(*d.stats)));
    GPU_CUDA_TRY(dev_dup((void **)&d.tlost, h_lost, ns * nt * sizeof(*d.tlost)));
    GPU_CUDA_TRY(dev_dup((void **)&d.parts, NULL, GPU_CUDA_UNSCALE_PARTS * sizeof(double)));

    for (int k = 0; k < nsteps; k++) {
        rc = tail_step(oc, sc, lr[k], b, &d, max_count, k);
        if (rc != 0)
            goto fail;
    }

    GPU_CUDA_TRY(dev_get(h_trace, d.trace, ns * sizeof(*h_trace)));
    GPU_CUDA_TRY(dev_get(h_st, d.stats, ns * nt * sizeof(*h_st)));
    GPU_CUDA_TRY(dev_get(h_lost, d.tlost, ns * nt * sizeof(*h_lost)));
    GPU_CUDA_TRY(dev_get(b->master, d.master, fb));
    GPU_CUDA_TRY(dev_get(b->work, d.work, wb));
    GPU_CUDA_TRY(dev_get(b->m, d.m, fb));
    GPU_CUDA_TRY(dev_get(b->v, d.v, fb));
    if (trace != NULL)
        memcpy(trace, h_trace, ns * sizeof(*trace));
    if (stats != NULL)
        gpu_cuda_step_stats_export(h_st, (int)(ns * nt), stats);
    for (size_t i = 0; tensor_lost != NULL && i < ns * nt; i++)
        tensor_lost[i] = (int64_t)h_lost[i];
    *s = h_trace[ns - 1].scaler;
    *applied = h_trace[ns - 1].applied;
    rc = 0;
fail:
    tail_free(&d);
    free(h_lost);
    free(h_st);
    free(h_trace);
    return rc;
}
