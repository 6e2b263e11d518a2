/*
 * cuda_unscale.cu - the fused unscale + overflow check + per-tensor statistics kernel, its
 * launch function (declared in cuda_step.h: the training step runs it with the multiplier,
 * flag and sum of its device state) and gpu_cuda_unscale(), its host-buffer wrapper with
 * gpu_unscale()'s contract (gpu.h).
 *
 * For every element x (the scaled gradient), as gpu_unscale() in gpu/scaler.c does: a
 * non-finite x (the check is on the scaled value, as in PyTorch) is counted and left
 * untouched; a finite x becomes y = x * inv unless inv == 1.0f (one IEEE round-to-nearest
 * fp32 product, so y equals the CPU's bit for bit, subnormals included) and updates the
 * tensor's stats: amax = max |y|, amax_scaled = max |x|, the count of exact zeros y, and the
 * sum of (double)y^2 (in a different order than on the CPU, so equal only to rounding). inv
 * is read from device memory when the kernel starts, so the step can use a scale the host
 * has not seen; the wrapper uploads its host float.
 *
 * Layout: a 2-D grid; blockIdx.y walks the tensors (strided: at most US_MAX_BLOCKS_Y rows),
 * blockIdx.x/threadIdx.x make a grid-stride loop inside one tensor; a block with none of a
 * tensor's elements skips it. Each block reduces with warp shuffles and shared memory, then
 * issues one atomic per statistic: atomicMax on the bit patterns of non-negative floats
 * (ordered like unsigned integers) and atomicAdd on 64-bit counters, whose results do not
 * depend on the order the blocks run in. The double sum of squares would (floating-point
 * addition does not associate), so each block writes its own partial to a slot, and a
 * second one-block kernel adds the slots in a fixed order: the gradient norm, and with
 * clipping the update, are the same bits in every run. The overflow flag is a plain store
 * of 1 by any block that saw a non-finite value, so the step can skip on the device without
 * a host synchronisation.
 *
 * Threads: gpu_cuda_unscale_launch only enqueues work on the caller's stream; the wrapper is
 * synchronous and owns its device buffers.
 */
#include <stdlib.h>

#include "gpu/cuda/cuda_common.cuh"
#include "gpu/cuda/cuda_step.h"

#define US_THREADS 256
#define US_WARPS (US_THREADS / 32)
#define US_PER_THREAD 32      /* elements per thread before the grid widens */
#define US_MAX_BLOCKS_X 1024u
#define US_MAX_BLOCKS_Y 64     /* US_MAX_BLOCKS_X * this = GPU_CUDA_UNSCALE_PARTS */
#define US_SUM_THREADS 256
static_assert(US_MAX_BLOCKS_X * US_MAX_BLOCKS_Y <= GPU_CUDA_UNSCALE_PARTS,
              "one partial-sum slot per block of the largest grid");

typedef struct {
    float amax, amax_scaled;
    unsigned long long nonfinite, zeros;
    double sumsq;
} us_acc;

__device__ static __forceinline__ void us_warp_reduce(us_acc *a)
{
    for (int off = 16; off > 0; off >>= 1) {
        a->amax = fmaxf(a->amax, __shfl_down_sync(0xFFFFFFFFu, a->amax, off));
        a->amax_scaled = fmaxf(a->amax_scaled, __shfl_down_sync(0xFFFFFFFFu, a->amax_scaled, off));
        a->nonfinite += __shfl_down_sync(0xFFFFFFFFu, a->nonfinite, off);
        a->zeros += __shfl_down_sync(0xFFFFFFFFu, a->zeros, off);
        a->sumsq += __shfl_down_sync(0xFFFFFFFFu, a->sumsq, off);
    }
}

static __global__ void __launch_bounds__(US_THREADS)
gpu_k_unscale(float *g, const size_t *offsets, const size_t *counts, int ntensors,
              const float *d_inv, gpu_cuda_step_tstat *stats, int *found, double *parts)
{
    __shared__ us_acc part[US_WARPS];
    double block_sumsq = 0.0;       /* thread 0's: this block's tensors, in order */
    const float inv = *d_inv;
    const bool scale = inv != 1.0f;
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const size_t stride = (size_t)gridDim.x * blockDim.x;

    /* the loop condition depends on blockIdx only, so __syncthreads below is uniform */
    for (int t = blockIdx.y; t < ntensors; t += gridDim.y) {
        size_t n = counts[t];
        if ((size_t)blockIdx.x * blockDim.x >= n)
            continue;   /* none of t's elements is this block's: skipped by all its threads */
        float *p = g + offsets[t];
        us_acc a = {0.0f, 0.0f, 0ull, 0ull, 0.0};

        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
            float x = p[i];
            if (!isfinite(x)) {
                a.nonfinite++;
                continue;
            }
            float y = x;
            if (scale) {
                y = __fmul_rn(x, inv);
                p[i] = y;
            }
            a.amax_scaled = fmaxf(a.amax_scaled, fabsf(x));
            a.amax = fmaxf(a.amax, fabsf(y));   /* fmaxf ignores a NaN y (inv not finite) */
            a.zeros += y == 0.0f;
            a.sumsq += (double)y * (double)y;
        }

        us_warp_reduce(&a);
        if (lane == 0)
            part[warp] = a;
        __syncthreads();
        if (warp == 0) {
            us_acc z = {0.0f, 0.0f, 0ull, 0ull, 0.0};
            a = lane < US_WARPS ? part[lane] : z;
            us_warp_reduce(&a);
            if (lane == 0) {
                gpu_cuda_step_tstat *s = &stats[t];
                if (a.amax > 0.0f)
                    atomicMax(&s->amax, __float_as_uint(a.amax));
                if (a.amax_scaled > 0.0f)
                    atomicMax(&s->amax_scaled, __float_as_uint(a.amax_scaled));
                if (a.nonfinite != 0) {
                    atomicAdd(&s->nonfinite, a.nonfinite);
                    *found = 1;
                }
                if (a.zeros != 0)
                    atomicAdd(&s->zeros, a.zeros);
                block_sumsq += a.sumsq;
            }
        }
        __syncthreads();  /* part[] is reused by the next tensor */
    }
    if (threadIdx.x == 0)
        parts[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = block_sumsq;
}

/* *sumsq = the n partials added in a fixed order: thread i sums slots i, i + 256, ... in
 * turn, then a fixed tree over the threads. One block. */
static __global__ void __launch_bounds__(US_SUM_THREADS)
gpu_k_sumsq(const double *parts, size_t n, double *sumsq)
{
    __shared__ double s[US_SUM_THREADS];
    double x = 0.0;
    for (size_t i = threadIdx.x; i < n; i += US_SUM_THREADS)
        x += parts[i];
    s[threadIdx.x] = x;
    __syncthreads();
    for (int half = US_SUM_THREADS / 2; half > 0; half >>= 1) {
        if ((int)threadIdx.x < half)
            s[threadIdx.x] += s[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        *sumsq = s[0];
}

/* Device pointers borrowed; see cuda_step.h. */
extern "C" int gpu_cuda_unscale_launch(float *d_g, const size_t *d_offsets,
                                       const size_t *d_counts, int ntensors, size_t max_count,
                                       const float *d_inv, gpu_cuda_step_tstat *d_stats,
                                       int *d_found, double *d_sumsq, double *d_parts,
                                       cudaStream_t stream)
{
    GPU_CUDA_CHECK(cudaMemsetAsync(d_found, 0, sizeof(*d_found), stream));
    if (ntensors <= 0) {    /* otherwise gpu_k_sumsq writes it */
        GPU_CUDA_CHECK(cudaMemsetAsync(d_sumsq, 0, sizeof(*d_sumsq), stream));
        return 0;
    }
    GPU_CUDA_CHECK(cudaMemsetAsync(d_stats, 0, (size_t)ntensors * sizeof(*d_stats), stream));
    dim3 grid(gpu_cuda_blocks(max_count, US_THREADS * US_PER_THREAD, US_MAX_BLOCKS_X),
              ntensors < US_MAX_BLOCKS_Y ? ntensors : US_MAX_BLOCKS_Y);
    gpu_k_unscale<<<grid, US_THREADS, 0, stream>>>(d_g, d_offsets, d_counts, ntensors, d_inv,
                                                   d_stats, d_found, d_parts);
    GPU_CUDA_CHECK(cudaGetLastError());
    gpu_k_sumsq<<<1, US_SUM_THREADS, 0, stream>>>(d_parts, (size_t)grid.x * grid.y, d_sumsq);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* gpu_unscale() on the device. g (host, borrowed) is modified in place over the span its
 * tensors cover; offsets/counts (ntensors entries) borrowed; stats (may be NULL) receives
 * ntensors entries. Returns GPU_ENODEV without a device, GPU_EINVAL on bad arguments,
 * GPU_ECUDA (logged) on a CUDA error; g is then unchanged. */
extern "C" int gpu_cuda_unscale(float *g, const size_t *offsets, const size_t *counts,
                                int ntensors, float inv, gpu_grad_stat *stats, bool *found_inf,
                                double *sumsq)
{
    int rc = gpu_cuda_ready();
    size_t span = 0, max_count = 0;
    float *d_g = NULL, *d_inv = NULL;
    size_t *d_off = NULL, *d_cnt = NULL;
    gpu_cuda_step_tstat *d_st = NULL, *h_st = NULL;
    int *d_found = NULL;
    double *d_sumsq = NULL, *d_parts = NULL;
    int h_found = 0;
    double h_sumsq = 0.0;

    if (rc != 0)
        return rc;
    if (found_inf == NULL || sumsq == NULL || ntensors < 0 ||
        (ntensors > 0 && (offsets == NULL || counts == NULL)))
        return GPU_EINVAL;
    for (int t = 0; t < ntensors; t++) {
        if (offsets[t] + counts[t] > span)
            span = offsets[t] + counts[t];
        if (counts[t] > max_count)
            max_count = counts[t];
    }
    if (ntensors == 0) {
        *found_inf = false;
        *sumsq = 0.0;
        return 0;
    }
    if (span > 0 && g == NULL)
        return GPU_EINVAL;
    h_st = (gpu_cuda_step_tstat *)malloc((size_t)ntensors * sizeof(*h_st));
    if (h_st == NULL)
        return GPU_ENOMEM;

    if (span > 0)
        GPU_CUDA_TRY(cudaMalloc((void **)&d_g, span * sizeof(*d_g)));
    GPU_CUDA_TRY(cudaMalloc((void **)&d_off, (size_t)ntensors * sizeof(*d_off)));
    GPU_CUDA_TRY(cudaMalloc((void **)&d_cnt, (size_t)ntensors * sizeof(*d_cnt)));
    GPU_CUDA_TRY(cudaMalloc((void **)&d_inv, sizeof(*d_inv)));
    GPU_CUDA_TRY(cudaMalloc((void **)&d_st, (size_t)ntensors * sizeof(*d_st)));
    GPU_CUDA_TRY(cudaMalloc((void **)&d_found, sizeof(*d_found)));
    GPU_CUDA_TRY(cudaMalloc((void **)&d_sumsq, sizeof(*d_sumsq)));
    GPU_CUDA_TRY(cudaMalloc((void **)&d_parts, GPU_CUDA_UNSCALE_PARTS * sizeof(*d_parts)));
    if (span > 0)
        GPU_CUDA_TRY(cudaMemcpy(d_g, g, span * sizeof(*g), cudaMemcpyHostToDevice));
    GPU_CUDA_TRY(cudaMemcpy(d_off, offsets, (size_t)ntensors * sizeof(*offsets),
                            cudaMemcpyHostToDevice));
    GPU_CUDA_TRY(cudaMemcpy(d_cnt, counts, (size_t)ntensors * sizeof(*counts),
                            cudaMemcpyHostToDevice));
    GPU_CUDA_TRY(cudaMemcpy(d_inv, &inv, sizeof(inv), cudaMemcpyHostToDevice));
    rc = gpu_cuda_unscale_launch(d_g, d_off, d_cnt, ntensors, max_count, d_inv, d_st, d_found,
                                 d_sumsq, d_parts, 0);
    if (rc != 0)
        goto fail;
    GPU_CUDA_TRY(cudaMemcpy(h_st, d_st, (size_t)ntensors * sizeof(*h_st),
                            cudaMemcpyDeviceToHost));
    GPU_CUDA_TRY(cudaMemcpy(&h_found, d_found, sizeof(h_found), cudaMemcpyDeviceToHost));
    GPU_CUDA_TRY(cudaMemcpy(&h_sumsq, d_sumsq, sizeof(h_sumsq), cudaMemcpyDeviceToHost));
    if (span > 0)
        GPU_CUDA_TRY(cudaMemcpy(g, d_g, span * sizeof(*g), cudaMemcpyDeviceToHost));

    if (stats != NULL)
        gpu_cuda_step_stats_export(h_st, ntensors, stats);
    *found_inf = h_found != 0;
    *sumsq = h_sumsq;
    rc = 0;
fail:
    cudaFree(d_parts);
    cudaFree(d_sumsq);
    cudaFree(d_found);
    cudaFree(d_st);
    cudaFree(d_inv);
    cudaFree(d_cnt);
    cudaFree(d_off);
    cudaFree(d_g);
    free(h_st);
    return rc;
}
