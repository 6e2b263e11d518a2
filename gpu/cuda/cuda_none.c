/*
 * cuda_none.c - the CUDA entry points of gpu.h in a build without CUDA (configure found no
 * nvcc, or --without-cuda). This is the documented CPU-only build: the probe says why there
 * is no device and every other entry point reports GPU_ENODEV, so callers take the CPU path
 * (the trainer never creates a device twin: its creation fails with the probe's reason).
 *
 * Threads: all functions are pure and thread-safe.
 */
#include <stdio.h>

#include "gpu/twin.h"

/* why (whylen bytes, may be NULL) receives the reason. */
int gpu_cuda_probe(char *why, size_t whylen)
{
    if (why != NULL && whylen > 0)
        snprintf(why, whylen, "built without CUDA (configure found no nvcc)");
    return GPU_ENODEV;
}

int gpu_cuda_devices(gpu_cuda_device *out, int max, int *n)
{
    (void)out, (void)max;
    *n = 0;
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

int gpu_cuda_job_memory(const gpu_job_config *c, gpu_mem *out, char *err, size_t errlen)
{
    (void)c, (void)out;
    if (err != NULL && errlen > 0)
        snprintf(err, errlen, "built without CUDA");
    return GPU_ENODEV;
}

/* The trainer's device twin (gpu/twin.h): it cannot be created, so the others never run. */
int gpu_cuda_twin_create(const gpu_cuda_host *h, int device, const gpu_scaler_state *s,
                         int64_t applied, int64_t lost_total, gpu_cuda_twin **out,
                         gpu_mem *mem, char *err, size_t errlen)
{
    char why[128];
    (void)device, (void)s, (void)applied, (void)lost_total, (void)mem;
    *out = NULL;
    (void)gpu_cuda_probe(why, sizeof(why));
    if (err != NULL && errlen > 0)
        snprintf(err, errlen, "device \"%s\": %s", h->cfg->device, why);
    return GPU_ENODEV;
}

void gpu_cuda_twin_free(gpu_cuda_twin *d)
{
    (void)d;
}

const char *gpu_cuda_twin_describe(const gpu_cuda_twin *d)
{
    (void)d;
    return "no CUDA";
}

int gpu_cuda_twin_step(gpu_cuda_twin *d, const void *x, const int *y, int B, double lr,
                       gpu_diag *diag, gpu_grad_stat *stats, int64_t *tensor_lost,
                       gpu_cuda_step_out *out, gpu_profile *prof)
{
    (void)d, (void)x, (void)y, (void)B, (void)lr, (void)diag, (void)stats, (void)tensor_lost;
    (void)out, (void)prof;
    return GPU_ENODEV;
}

int gpu_cuda_twin_eval(gpu_cuda_twin *d, const void *x, const int *y, int B, double *loss_sum,
                       int *correct)
{
    (void)d, (void)x, (void)y, (void)B, (void)loss_sum, (void)correct;
    return GPU_ENODEV;
}

int gpu_cuda_twin_download(gpu_cuda_twin *d, float *grads)
{
    (void)d, (void)grads;
    return GPU_ENODEV;
}

int gpu_cuda_twin_upload(gpu_cuda_twin *d, const gpu_scaler_state *s, int64_t applied,
                         int64_t lost_total)
{
    (void)d, (void)s, (void)applied, (void)lost_total;
    return GPU_ENODEV;
}

int gpu_cuda_twin_comm(gpu_cuda_twin *d, const gpu_cuda_comm_plan *p, gpu_mem *mem, char *err,
                       size_t errlen)
{
    (void)d, (void)p, (void)mem, (void)err, (void)errlen;
    return GPU_ENODEV;
}
