/*
 * cuda_none.c - the CUDA entry points of gpu.h in a build without CUDA (configure found no
 * nvcc, or --without-cuda). This is the documented CPU-only build: the probe says why there
 * is no device and every other entry point reports GPU_ENODEV, so callers take the CPU path.
 *
 * Threads: all functions are pure and thread-safe.
 */
#include <stdio.h>

#include "gpu/gpu.h"

/* why (whylen bytes, may be NULL) receives the reason. */
int gpu_cuda_probe(char *why, size_t whylen)
{
    if (why != NULL && whylen > 0)
        snprintf(why, whylen, "built without CUDA (configure found no nvcc)");
    return GPU_ENODEV;
}

/* No buffers are touched. */
int gpu_cuda_cvt_f32_f16(uint16_t *dst, const float *src, size_t n)
{
    (void)dst, (void)src, (void)n;
    return GPU_ENODEV;
}

int gpu_cuda_cvt_f16_f32(float *dst, const uint16_t *src, size_t n)
{
    (void)dst, (void)src, (void)n;
    return GPU_ENODEV;
}

int gpu_cuda_cvt_f32_bf16(uint16_t *dst, const float *src, size_t n)
{
    (void)dst, (void)src, (void)n;
    return GPU_ENODEV;
}

int gpu_cuda_cvt_bf16_f32(float *dst, const uint16_t *src, size_t n)
{
    (void)dst, (void)src, (void)n;
    return GPU_ENODEV;
}

int gpu_cuda_unscale(float *g, const size_t *offsets, const size_t *counts, int ntensors,
                     float inv, gpu_grad_stat *stats, bool *found_inf, double *sumsq)
{
    (void)g, (void)offsets, (void)counts, (void)ntensors, (void)inv, (void)stats;
    (void)found_inf, (void)sumsq;
    return GPU_ENODEV;
}
