/*
 * cuda_step.h - the device side of a training step after backward (gpu/cuda/cuda_step.cu):
 * unscale with the device's scale, clip coefficient, fused AdamW/SGD (with fp32 master
 * weights or without), the loss-scaler update and the per-layer diagnostics counters, all
 * driven by a small state struct that lives in device memory, so that a whole AMP step runs
 * without a host synchronisation.
 *
 * One step on one stream (every call only enqueues; d_ = device pointer):
 *   gpu_cuda_step_begin_launch(d_state)           scale_used, inv; per-step fields reset
 *   ... forward, backward seeded with d_state->scale_used ...
 *   gpu_cuda_step_unscale_launch(..., d_state)    found_inf, sumsq, per-tensor stats
 *   gpu_cuda_step_clip_launch(d_state, optim)     grad_norm, clip; applied + 1 and the bias
 *                                                 corrections unless found_inf
 *   gpu_cuda_optim_launch(optim, lr, d_state, ...)       or gpu_cuda_optim_lowp_launch:
 *                                                 skipped entirely when found_inf
 *   gpu_cuda_scaler_update_launch(d_state, scaler) gpu_scaler_update's own rule
 *   gpu_cuda_step_snapshot(d_state, h_pinned, ...) read by the host one step later
 * lr is the host's gpu_lr_at(step - 1, steps) (it depends on the step index only); the
 * bias-correction t is the device's applied count, which a skipped step does not advance.
 * A step with inf/NaN gradients is skipped on the device: the unscale pass sets found_inf,
 * and the optimizer kernels (gpu_k_optim, gpu_k_optim_lowp in cuda_step.cu) return before
 * they write anything when it is set. The whole step in prose: docs/architecture.md, "The
 * AMP step".
 *
 * Numerics: the optimizer kernels perform gpu/optim.c's IEEE operations in its order with
 * round-to-nearest intrinsics (no FMA contraction) and form the bias corrections in double
 * from b^t computed by double-double exponentiation (the correctly rounded power). glibc's
 * pow, which the CPU uses, is within 0.52 ulp and differs from it in the last bit of the
 * double about once in 2500 (b, t); that reaches the fp32 constants only when one sits on a
 * rounding boundary, so p, m, v and the working copy equal the CPU's bit for bit in practice
 * and within 1 ulp always. The scaler update, clip formula and diagnostics thresholds are
 * exact; sumsq is summed in another order than on the CPU (equal to rounding).
 *
 * Threads: the *_launch functions only enqueue on the caller's stream (no host
 * synchronisation; gpu_cuda_step_state_init, not on the step path, also waits for its copy);
 * the host helpers are pure. The tests' synchronous host-buffer wrappers of these launches
 * (gpu_cuda_*_host) are in tests/cudahost/cudahost.h.
 */
#ifndef AMPD_CUDA_STEP_H
#define AMPD_CUDA_STEP_H

#include "gpu/gpu.h"

#ifdef __CUDACC__
#include <cuda_runtime.h>
#else
/* the runtime's own definition (driver_types.h), so C callers need no CUDA header */
typedef struct CUstream_st *cudaStream_t;
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- device state ------------------------------------------------------------------------ */

/* One trainer's step state, in device memory. The host writes it once
 * (gpu_cuda_step_state_init) and then only reads snapshots of it. */
typedef struct {
    gpu_scaler_state scaler;     /* the loss scaler, exactly as gpu_scaler_update keeps it */
    /* set by gpu_cuda_step_begin_launch */
    float scale_used;            /* the scale this step's backward is seeded with */
    float inv;                   /* (float)(1.0 / (double)scale_used): the unscale multiplier */
    /* set by the unscale pass */
    int found_inf;               /* the step's gradients held inf/NaN (the step is skipped) */
    int floor_failed;            /* set by the scaler update: gpu_scaler_update would have
                                  * returned GPU_ESCALE_FLOOR */
    double sumsq;                /* sum of squares of the unscaled gradients */
    /* set by the clip kernel */
    double grad_norm;            /* sqrt(sumsq); NaN when found_inf */
    double bc1;                  /* 1 - beta1^t (double), t = max(applied, 1) */
    float clip;                  /* the gradient multiplier gmul (1 when not clipping) */
    float bc2_sqrt;              /* (float)sqrt(1 - beta2^t) */
    long long applied;           /* optimizer steps applied (AdamW's t) */
    /* set by the lowp optimizer */
    unsigned long long lost_step;   /* updates that rounded away this step */
    unsigned long long lost_total;  /* ... since the start */
} gpu_cuda_step_state;

/* Per-tensor statistics of the device unscale pass (gpu_grad_stat on the device), zeroed
 * by its launch before the kernel accumulates into them. */
typedef struct {
    unsigned int amax, amax_scaled;  /* bit patterns of non-negative floats (ordered like
                                      * unsigned integers: atomicMax on the bits) */
    unsigned long long nonfinite, zeros;
} gpu_cuda_step_tstat;

/* The per-layer diagnostics counters of diag.c on the device (gpu_layer_diag's counters;
 * the starved counts are the model's and stay on the host). */
typedef struct {
    unsigned int act_amax;       /* bits of the largest finite |output| before rounding */
    unsigned int grad_amax;      /* bits of the largest finite |weight gradient| (scaled) */
    unsigned long long act_n, act_overflow;
    unsigned long long grad_n, grad_nonzero, grad_flushed, grad_flushed_unscaled,
        grad_nonfinite;
    unsigned long long in_n, in_nonzero, in_flushed, in_flushed_unscaled, in_nonfinite;
    unsigned long long out_nonfinite;
} gpu_cuda_diag_layer;

#define GPU_CUDA_DIAG_MAX_LAYERS 256  /* GPU_DIAG_MAX_LAYERS of gpu/diag.h */

typedef struct {
    float scale;                 /* the loss scale the backward is seeded with */
    unsigned int flush_scaled[3];  /* gpu_diag_flush_bits(dt, scale) by gpu_dtype */
    int first;                   /* -1, or 2 * layer + 1 (forward output) / 2 * layer
                                  * (backward value): the first layer to hold inf/NaN */
    int pad;                     /* explicit padding before the 8-byte aligned layers */
    gpu_cuda_diag_layer layer[GPU_CUDA_DIAG_MAX_LAYERS];
} gpu_cuda_diag;

/* What a diagnostics launch accounts, as the gpu_diag_* function of the same name. */
typedef GPU_ENUM {
    GPU_CUDA_DIAG_FORWARD = 0,   /* gpu_diag_forward: outputs before rounding */
    GPU_CUDA_DIAG_WEIGHT_GRAD,   /* gpu_diag_weight_grad */
    GPU_CUDA_DIAG_INPUT_GRAD,    /* gpu_diag_input_grad */
    GPU_CUDA_DIAG_BACKWARD       /* gpu_diag_backward: inf/NaN of an arriving gradient */
} gpu_cuda_diag_kind;

/* ---- launch functions: device pointers borrowed, enqueued on stream, no host sync -------- */

/* Write the initial state: the scaler state s, the applied count and lost total (a fresh
 * run: gpu_scaler_init's state, 0, 0; a resumed run: the checkpoint's scalars). Waits for
 * the stream, so that the copy has read its host source (not for the step path). s
 * borrowed. */
int gpu_cuda_step_state_init(gpu_cuda_step_state *d_state, const gpu_scaler_state *s,
                             int64_t applied, int64_t lost_total, cudaStream_t stream);
/* Start a step: scale_used = scaler.scale, inv = (float)(1.0 / (double)scale_used),
 * found_inf = floor_failed = 0, sumsq = grad_norm = 0, clip = 1, lost_step = 0. */
int gpu_cuda_step_begin_launch(gpu_cuda_step_state *d_state, cudaStream_t stream);
/* The doubles of the scratch the unscale pass writes its per-block partial sums to. */
#define GPU_CUDA_UNSCALE_PARTS (1024 * 64)
/* gpu_unscale() on the device (the fused pass of gpu/cuda/cuda_unscale.cu): zeroes *d_found,
 * *d_sumsq and d_stats (ntensors entries), then one pass over the tensors of d_g (modified in
 * place) with the multiplier *d_inv, read when the kernel starts; *d_found is set to 1 when
 * a tensor holds inf/NaN. *d_sumsq is added up from per-block partials in d_parts
 * (GPU_CUDA_UNSCALE_PARTS doubles of scratch) in a fixed order, so it is the same in every
 * run. max_count is the largest counts[] entry (it sizes the grid). The arguments are not
 * checked (the callers do). Returns 0 or GPU_ECUDA (launch errors). */
int gpu_cuda_unscale_launch(float *d_g, const size_t *d_offsets, const size_t *d_counts,
                            int ntensors, size_t max_count, const float *d_inv,
                            gpu_cuda_step_tstat *d_stats, int *d_found, double *d_sumsq,
                            double *d_parts, cudaStream_t stream);
/* gpu_cuda_unscale_launch with the step state's fields: inv read from d_state, found_inf,
 * sumsq and d_stats (ntensors entries) zeroed and written; d_parts its scratch. */
int gpu_cuda_step_unscale_launch(float *d_g, const size_t *d_offsets, const size_t *d_counts,
                                 int ntensors, size_t max_count, gpu_cuda_step_tstat *d_stats,
                                 gpu_cuda_step_state *d_state, double *d_parts,
                                 cudaStream_t stream);
/* One thread: grad_norm = found_inf ? NaN : sqrt(sumsq); clip = train.c's clip_coef
 * (c->grad_clip / (norm + 1e-6) as float when norm > grad_clip > 0, else 1); unless
 * found_inf, applied + 1 and bc1, bc2_sqrt for t = max(applied, 1) from c->beta1/beta2.
 * Run it every step, clipping or not: the optimizer launches read what it writes. c borrowed
 * (read at the call). */
int gpu_cuda_step_clip_launch(gpu_cuda_step_state *d_state, const gpu_optim_config *c,
                              cudaStream_t stream);
/* gpu_optim_update() over one block of n parameters with gmul = d_state->clip and the bias
 * corrections of the clip kernel; does nothing (writes nothing) when found_inf. d_m: AdamW
 * first moment or SGD momentum buffer (NULL allowed for SGD); d_v: AdamW second moment
 * (NULL for SGD); d_work: working copy in wdt (NULL: none). Buffers may not overlap.
 * GPU_EINVAL for a NULL buffer AdamW needs or a bad wdt. */
int gpu_cuda_optim_launch(const gpu_optim_config *c, double lr,
                          const gpu_cuda_step_state *d_state, float *d_p, const float *d_g,
                          float *d_m, float *d_v, size_t n, void *d_work, gpu_dtype wdt,
                          cudaStream_t stream);
/* gpu_optim_update_lowp() on the tensors (offsets/counts into the blocks) of the weights
 * d_w (elements of wdt), skipped when found_inf. The lost updates are added to lost_step
 * and lost_total and, per tensor, written to d_tensor_lost (ntensors entries, zeroed first;
 * may be NULL). max_count as for the unscale pass. */
int gpu_cuda_optim_lowp_launch(const gpu_optim_config *c, double lr,
                               gpu_cuda_step_state *d_state, void *d_w, gpu_dtype wdt,
                               const float *d_g, float *d_m, float *d_v,
                               const size_t *d_offsets, const size_t *d_counts, int ntensors,
                               size_t max_count, unsigned long long *d_tensor_lost,
                               cudaStream_t stream);
/* One thread: gpu_scaler_update(&scaler, c, found_inf), its result in floor_failed: the
 * function itself, gpu_scaler_rule of gpu/scaler_rule.h. c borrowed (read at the call). */
int gpu_cuda_scaler_update_launch(gpu_cuda_step_state *d_state, const gpu_scaler_config *c,
                                  cudaStream_t stream);
/* Copy the state (and, when d_stats is not NULL, ntensors per-tensor stats) to host memory
 * h_state / h_stats, which should be pinned (cudaHostAlloc) for the copy to be
 * asynchronous; the host reads them after a later synchronisation point (an event). */
int gpu_cuda_step_snapshot(const gpu_cuda_step_state *d_state, gpu_cuda_step_state *h_state,
                           const gpu_cuda_step_tstat *d_stats, gpu_cuda_step_tstat *h_stats,
                           int ntensors, cudaStream_t stream);

/* Start a diagnostics collection (gpu_diag_begin): every counter zeroed, first = -1,
 * scale = d_state->scaler.scale and its flush thresholds (gpu_diag_flush_bits). */
int gpu_cuda_diag_begin_launch(gpu_cuda_diag *d_diag, const gpu_cuda_step_state *d_state,
                               cudaStream_t stream);
/* Account d_x[0..n) (fp32 values before rounding to the layer's dtype dt) for layer
 * (0 <= layer < GPU_CUDA_DIAG_MAX_LAYERS; other values are ignored, as on the CPU) as kind. */
int gpu_cuda_diag_launch(gpu_cuda_diag *d_diag, int layer, gpu_dtype dt,
                         gpu_cuda_diag_kind kind, const float *d_x, size_t n,
                         cudaStream_t stream);
/* Copy the header and the first nlayers layers of d_diag to h_diag (pinned, see above). */
int gpu_cuda_diag_snapshot(const gpu_cuda_diag *d_diag, gpu_cuda_diag *h_diag, int nlayers,
                           cudaStream_t stream);

/* ---- host helpers (no device needed) ----------------------------------------------------- */

/* The per-tensor stats as gpu_grad_stat (n entries). Pointers borrowed. */
void gpu_cuda_step_stats_export(const gpu_cuda_step_tstat *src, int n, gpu_grad_stat *dst);
/* The state gpu_cuda_step_state_init writes, built in host memory *h: scaler state s (and
 * scale_used = its scale, inv its multiplier), applied and lost_total as given, clip 1, bias
 * corrections 1, every other field 0. s borrowed. */
void gpu_cuda_step_state_make(gpu_cuda_step_state *h, const gpu_scaler_state *s,
                              int64_t applied, int64_t lost_total);

#ifdef __cplusplus
}
#endif

/* ---- C only: gpu/diag.h (C11 atomics, through gpu_int.h) is not for nvcc ------------- */
#ifndef __cplusplus
#include <string.h>

#include "gpu/diag.h"

_Static_assert(GPU_CUDA_DIAG_MAX_LAYERS == GPU_DIAG_MAX_LAYERS, "diag layer tables differ");

/* Fill d's counters (its first d->nlayers layers; src must hold them), scale and first
 * inf/NaN from a device snapshot; names, dtypes and the starved counts of d are kept, so
 * that gpu_diag_stats(d, ...) then gives the per-layer statistics. Pointers borrowed. */
static inline void gpu_cuda_diag_export(const gpu_cuda_diag *src, gpu_diag *d)
{
    d->scale = src->scale;
    d->first_nonfinite = src->first < 0 ? -1 : src->first / 2;
    d->first_in_forward = src->first >= 0 && (src->first & 1) != 0;
    for (int i = 0; i < d->nlayers && i < GPU_CUDA_DIAG_MAX_LAYERS; i++) {
        const gpu_cuda_diag_layer *s = &src->layer[i];
        gpu_layer_diag *l = &d->layer[i];
        memcpy(&l->act_amax, &s->act_amax, sizeof(l->act_amax));
        memcpy(&l->grad_amax, &s->grad_amax, sizeof(l->grad_amax));
        l->act_n = (int64_t)s->act_n;
        l->act_overflow = (int64_t)s->act_overflow;
        l->grad_n = (int64_t)s->grad_n;
        l->grad_nonzero = (int64_t)s->grad_nonzero;
        l->grad_flushed = (int64_t)s->grad_flushed;
        l->grad_flushed_unscaled = (int64_t)s->grad_flushed_unscaled;
        l->grad_nonfinite = (int64_t)s->grad_nonfinite;
        l->in_n = (int64_t)s->in_n;
        l->in_nonzero = (int64_t)s->in_nonzero;
        l->in_flushed = (int64_t)s->in_flushed;
        l->in_flushed_unscaled = (int64_t)s->in_flushed_unscaled;
        l->in_nonfinite = (int64_t)s->in_nonfinite;
        l->out_nonfinite = (int64_t)s->out_nonfinite;
    }
}
#endif
#endif /* AMPD_CUDA_STEP_H */
