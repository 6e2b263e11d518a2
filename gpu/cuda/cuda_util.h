/*
 * cuda_util.h - two host-side helpers the CUDA backend's C files (gpu/cuda/cuda_*.c) and
 * CUDA files (gpu/cuda/cuda_*.cu) share: GPU_TRY, which returns the first failing call's
 * code, and the 256-byte alignment of the regions carved out of one device allocation.
 * Plain C that C, C++ and nvcc read alike; includes no CUDA header.
 *
 * Invariants: GPU_CUDA_ALIGN is what cudaMalloc guarantees and what the workspaces of
 * gpu/cuda/cuda_ops.h require, so a region at a gpu_align256 offset of a cudaMalloc'd block
 * may be handed to any launch. GPU_TRY is for functions that hold nothing to release (a
 * function with a `fail:` label uses cuda_common.cuh's GPU_CUDA_TRY for CUDA calls).
 * Threads: pure.
 */
#ifndef AMPD_CUDA_UTIL_H
#define AMPD_CUDA_UTIL_H

#include <stddef.h>

/* Evaluate call (an int: 0 or a negative GPU_E* code) and return it when it is not 0. */
#define GPU_TRY(call)          \
    do {                       \
        int rc_ = (call);      \
        if (rc_ != 0)          \
            return rc_;        \
    } while (0)

#define GPU_CUDA_ALIGN 256

/* n rounded up to a multiple of GPU_CUDA_ALIGN. */
static inline size_t gpu_align256(size_t n)
{
    return (n + (GPU_CUDA_ALIGN - 1)) & ~(size_t)(GPU_CUDA_ALIGN - 1);
}

#endif /* AMPD_CUDA_UTIL_H */
