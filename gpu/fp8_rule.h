/*
 * fp8_rule.h - fp8 scaling's per-tensor rules (Transformer Engine's recipes), written once
 * for the host and the device: gpu_fp8_current_scale and gpu_fp8_delayed_update (gpu/fp8.c)
 * are these functions, so that a device kernel running them gives the host's bits. Internal
 * to the gpu/ module; the contract is gpu.h's ("fp8") and docs/fp8.md's.
 *
 * Invariants: plain C that C, C++ and CUDA read alike; one IEEE fp32 division rounded to
 * nearest for each scale and each scale_inv (nothing an FMA could contract), fmaxf's NaN
 * rule for the history's largest entry. GPU_FP8R is __host__ __device__ under nvcc and
 * static inline otherwise.
 * Threads: pure apart from the history and scales given, which belong to their caller.
 */
#ifndef AMPD_GPU_FP8_RULE_H
#define AMPD_GPU_FP8_RULE_H

#include <float.h>
#include <math.h>
#include <string.h>

#ifdef __CUDACC__
#define GPU_FP8R __host__ __device__ static __forceinline__
#else
#define GPU_FP8R static inline
#endif

/* Current scaling: amax raised to epsilon when below it; 1 for an amax of 0, inf or NaN;
 * scaled_max / amax otherwise, FLT_MAX when that is inf. */
GPU_FP8R float gpu_fp8r_current_scale(float amax, float scaled_max, float epsilon)
{
    if (amax < epsilon)
        amax = epsilon;
    if (isinf(amax) || isnan(amax) || amax == 0.0f)
        return 1.0f;
    float scale = scaled_max / amax;
    return isinf(scale) ? FLT_MAX : scale;
}

/* Delayed scaling's step on history[0..len) (staging slot first), *scale and *scale_inv:
 * nothing when the staged amax is 0; else the amax (the staged one, most_recent, or the
 * largest of all, NaNs skipped) gives the scale when finite and above 0 (the old one stays
 * otherwise), then the history rolls and the staging slot is cleared. */
GPU_FP8R void gpu_fp8r_delayed_update(float *history, int len, int most_recent, float scaled_max,
                                      float *scale, float *scale_inv)
{
    float last = history[0], amax = 0.0f;
    if (last == 0.0f) /* the tensor did not take part this step */
        return;
    for (int i = 0; i < len; i++)
        amax = fmaxf(amax, history[i]);
    if (most_recent)
        amax = last;
    if (isfinite(amax) && amax > 0.0f) {
        float s = scaled_max / amax;
        *scale = isinf(s) ? FLT_MAX : s;
    }
    *scale_inv = 1.0f / *scale;
    for (int i = 0; i + 1 < len; i++) /* the oldest entry leaves */
        history[i] = history[i + 1];
    history[len - 1] = last;
    history[0] = 0.0f; /* the staging slot (len 1: the one entry, cleared after use) */
}

#endif /* AMPD_GPU_FP8_RULE_H */
