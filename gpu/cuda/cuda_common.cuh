/*
 * cuda_common.cuh - shared pieces of the CUDA backend, for CUDA sources only: the kernel
 * files gpu/cuda/cuda_*.cu and the tests' wrappers in tests/cudahost.
 *
 * Holds the error-checking macros (they log the CUDA error with file:line (gpu_log) and
 * turn it into GPU_ECUDA; a daemon never exits on a CUDA error), the "is there a device"
 * check every host wrapper starts with, and the 16-byte chunk of eight 16-bit values that
 * vectorised loads move. The fp32 <-> fp16/bf16 conversions are gpu/format_rule.h's, the
 * CPU's own (gpu_fmt_*: integer bit operations only, not __float2half, whose NaN and
 * rounding behaviour differ), so they match the CPU bit for bit whatever the FTZ mode.
 *
 * Threads: the helpers are pure; the macros touch only the calling thread's CUDA error state.
 */
#ifndef AMPD_CUDA_COMMON_CUH
#define AMPD_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpu/format_rule.h" /* fp32 <-> fp16 / bf16 on bit patterns, as on the host */
#include "gpu/gpu.h"

/* ---- errors ------------------------------------------------------------------------------ */

/* Log a failed CUDA call and return GPU_ECUDA. what is the call's source text. */
static inline int gpu_cuda_fail(cudaError_t e, const char *what, const char *file, int line)
{
    gpu_log(GPU_LOG_ERROR, "CUDA", "%s:%d: error %s: %s (in %s)", file, line,
            cudaGetErrorName(e), cudaGetErrorString(e), what);
    return GPU_ECUDA;
}

/* For functions with a `fail:` cleanup label and an `int rc`: on error set rc, jump. */
#define GPU_CUDA_TRY(call)                                                  \
    do {                                                                    \
        cudaError_t e_ = (call);                                            \
        if (e_ != cudaSuccess) {                                            \
            rc = gpu_cuda_fail(e_, #call, __FILE__, __LINE__);              \
            goto fail;                                                      \
        }                                                                   \
    } while (0)

/* For functions that hold no resources: on error return GPU_ECUDA. */
#define GPU_CUDA_CHECK(call)                                                \
    do {                                                                    \
        cudaError_t e_ = (call);                                            \
        if (e_ != cudaSuccess)                                              \
            return gpu_cuda_fail(e_, #call, __FILE__, __LINE__);            \
    } while (0)

/* 0 when at least one CUDA device is visible, else GPU_ENODEV (no driver, no device). The
 * failed query's error is cleared so that it does not surface in a later call. */
static inline int gpu_cuda_ready(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        return GPU_ENODEV;
    }
    return count > 0 ? 0 : GPU_ENODEV;
}

/* Blocks for a grid-stride loop over n elements with `threads` threads per block. */
static inline unsigned gpu_cuda_blocks(size_t n, unsigned threads, unsigned cap)
{
    size_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    return b > cap ? cap : (unsigned)b;
}

/* ---- 16-byte chunks of 16-bit values --------------------------------------------------- */

/* Eight 16-bit values: one 16-byte load or store. */
struct alignas(16) gpu_dev_chunk {
    uint32_t w[4];
};

/* The bit pattern of value e (< 8) of a chunk. */
__host__ __device__ static __forceinline__ uint16_t gpu_dev_chunk_bits(const gpu_dev_chunk &c,
                                                                       int e)
{
    return (uint16_t)(c.w[e / 2] >> (e % 2 * 16));
}

#endif /* AMPD_CUDA_COMMON_CUH */
