/*
 * scaler_rule.h - the loss scaler's per-step update, written once for the host and the
 * device: gpu_scaler_update (gpu/scaler.c) is this function, and the CUDA step's scaler
 * kernel (gpu/cuda/cuda_step.cu) runs it in one device thread. Internal to the gpu/ module.
 *
 * Dynamic mode, one step (found_inf = the step's gradients held inf/NaN):
 *   overflow: tracker = 0; floor_streak + 1 if the scale was already <= min_scale, else 0;
 *             hysteresis_left - 1 (not below 0); when it is then <= 0 the scale backs off:
 *             scale = max((float)(scale * backoff), min_scale), products in double.
 *             Returns GPU_ESCALE_FLOOR once floor_streak reaches floor_patience.
 *   clean:    floor_streak = 0; tracker + 1; when it reaches growth_interval the tracker
 *             resets to 0, the hysteresis is refilled, and cand = (float)(scale * growth) is
 *             taken only when finite and <= max_scale.
 * backoff_total counts the overflows that lowered the scale, growth_total the growths.
 * In every mode an overflowing step is counted in overflow_total and skipped_total: even
 * with mode none (scale 1) an inf/NaN gradient skips the optimizer step rather than
 * poisoning the weights. Static and none never change the scale.
 *
 * Invariants: plain C that C, C++ and CUDA read alike, so that host and device results are
 * bit-identical: each product is one IEEE double multiply rounded once to float (nothing an
 * FMA could contract), isfinite from <math.h>, no library calls. GPU_HD marks the function
 * __host__ __device__ under nvcc and is empty otherwise (the C compiler, and the CUDA
 * emulator's host C++ of tests/cudaemu).
 * Threads: pure apart from *s, which belongs to one trainer (one device thread on CUDA).
 */
#ifndef AMPD_GPU_SCALER_RULE_H
#define AMPD_GPU_SCALER_RULE_H

#include <math.h>

#include "gpu/gpu.h"

#ifdef __CUDACC__
#define GPU_HD __host__ __device__
#else
#define GPU_HD
#endif

/* One step's update of s (in place) under c with the step's found_inf; 0 or
 * GPU_ESCALE_FLOOR. s and c borrowed. */
GPU_HD static inline int gpu_scaler_rule(gpu_scaler_state *s, const gpu_scaler_config *c,
                                         bool found_inf)
{
    s->steps++;
    if (found_inf) {
        s->overflow_total++;
        s->skipped_total++;
    }
    if (c->mode != GPU_SCALE_DYNAMIC) {
        if (c->mode == GPU_SCALE_NONE)
            s->scale = 1.0f;
        return 0;
    }
    if (!found_inf) {
        s->floor_streak = 0;
        if (s->growth_tracker + 1 < c->growth_interval) {
            s->growth_tracker++;
            return 0;
        }
        s->growth_tracker = 0;
        s->hysteresis_left = c->hysteresis;
        float cand = (float)((double)s->scale * (double)c->growth_factor);
        if (isfinite(cand) && cand <= c->max_scale) {
            s->scale = cand;
            s->growth_total++;
        }
        return 0;
    }

    s->growth_tracker = 0;
    s->floor_streak = s->scale <= c->min_scale ? s->floor_streak + 1 : 0;
    if (s->hysteresis_left > 0)
        s->hysteresis_left--;
    if (s->hysteresis_left <= 0) {
        float next = (float)((double)s->scale * (double)c->backoff_factor);
        if (!(next >= c->min_scale))
            next = c->min_scale;
        if (next < s->scale)
            s->backoff_total++;
        s->scale = next;
    }
    return s->floor_streak >= c->floor_patience ? GPU_ESCALE_FLOOR : 0;
}

#endif /* AMPD_GPU_SCALER_RULE_H */
