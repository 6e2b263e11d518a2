/*
 * cuda_format.cu - the CUDA number-format kernels, gpu_cuda_probe(), gpu_cuda_devices()
 * and the host-to-host conversion wrappers declared in gpu.h.
 *
 * The kernels are grid-stride loops over the __host__ __device__ conversions of
 * cuda_common.cuh, so their results equal gpu/format.c's scalar functions bit for bit.
 * The wrappers allocate device buffers, copy in, launch, copy out and free (synchronous;
 * meant for tests and checks, not for the training step).
 *
 * Threads: every function may be called from any thread; each wrapper owns its buffers.
 */
#include <stdio.h>

#include "gpu/cuda/cuda_common.cuh"

#define CVT_THREADS 256u
#define CVT_MAX_BLOCKS 65535u

static __global__ void gpu_k_f32_f16(uint16_t *dst, const float *src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = gpu_fmt_f32_to_f16(__float_as_uint(src[i]));
}

static __global__ void gpu_k_f16_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __uint_as_float(gpu_fmt_f16_to_f32(src[i]));
}

static __global__ void gpu_k_f32_bf16(uint16_t *dst, const float *src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = gpu_fmt_f32_to_bf16(__float_as_uint(src[i]));
}

static __global__ void gpu_k_bf16_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = __uint_as_float(gpu_fmt_bf16_to_f32(src[i]));
}

/* Copy n elements of src to the device, run kern, copy the n results back into dst.
 * dst and src are host pointers, borrowed. */
template <typename D, typename S>
static int cvt_on_device(D *dst, const S *src, size_t n, void (*kern)(D *, const S *, size_t))
{
    int rc = gpu_cuda_ready();
    S *d_src = NULL;
    D *d_dst = NULL;
    unsigned blocks = gpu_cuda_blocks(n, CVT_THREADS, CVT_MAX_BLOCKS);

    if (rc != 0 || n == 0)
        return rc;
    if (dst == NULL || src == NULL)
        return GPU_EINVAL;
    GPU_CUDA_TRY(cudaMalloc((void **)&d_src, n * sizeof(S)));
    GPU_CUDA_TRY(cudaMalloc((void **)&d_dst, n * sizeof(D)));
    GPU_CUDA_TRY(cudaMemcpy(d_src, src, n * sizeof(S), cudaMemcpyHostToDevice));
    kern<<<blocks, CVT_THREADS>>>(d_dst, d_src, n);
    GPU_CUDA_TRY(cudaGetLastError());
    GPU_CUDA_TRY(cudaMemcpy(dst, d_dst, n * sizeof(D), cudaMemcpyDeviceToHost));
    rc = 0;
fail:
    cudaFree(d_dst);
    cudaFree(d_src);
    return rc;
}

/* why (whylen bytes, may be NULL) receives the reason on failure, a device description on
 * success. */
extern "C" int gpu_cuda_probe(char *why, size_t whylen)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    char buf[256];

    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (e == cudaErrorInsufficientDriver)
            snprintf(buf, sizeof(buf), "no CUDA driver (%s: %s)", cudaGetErrorName(e),
                     cudaGetErrorString(e));
        else if (e == cudaErrorNoDevice)
            snprintf(buf, sizeof(buf), "no CUDA device (%s: %s)", cudaGetErrorName(e),
                     cudaGetErrorString(e));
        else
            snprintf(buf, sizeof(buf), "CUDA unavailable (%s: %s)", cudaGetErrorName(e),
                     cudaGetErrorString(e));
    } else if (count <= 0) {
        snprintf(buf, sizeof(buf), "no CUDA device");
    } else {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
            snprintf(buf, sizeof(buf), "%.200s (sm_%d%d), %d device%s", prop.name, prop.major,
                     prop.minor, count, count == 1 ? "" : "s");
        else
            snprintf(buf, sizeof(buf), "%d CUDA device%s", count, count == 1 ? "" : "s");
        (void)cudaGetLastError();
    }
    if (why != NULL && whylen > 0)
        snprintf(why, whylen, "%s", buf);
    return e == cudaSuccess && count > 0 ? 0 : GPU_ENODEV;
}

/* out: max entries, the caller's; *n receives how many were filled. */
extern "C" int gpu_cuda_devices(gpu_cuda_device *out, int max, int *n)
{
    int count = 0;
    *n = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count <= 0) {
        (void)cudaGetLastError();
        return GPU_ENODEV;
    }
    for (int i = 0; i < count && *n < max; i++) {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
            (void)cudaGetLastError();
            continue;
        }
        gpu_cuda_device *d = &out[(*n)++];
        snprintf(d->name, sizeof(d->name), "%s", prop.name);
        d->memory_bytes = (uint64_t)prop.totalGlobalMem;
        d->cc_major = prop.major;
        d->cc_minor = prop.minor;
        d->multiprocessors = prop.multiProcessorCount;
    }
    return *n > 0 ? 0 : GPU_ENODEV;
}

/* dst and src are host buffers of n elements, borrowed. */
extern "C" int gpu_cuda_cvt_f32_f16(uint16_t *dst, const float *src, size_t n)
{
    return cvt_on_device(dst, src, n, gpu_k_f32_f16);
}

extern "C" int gpu_cuda_cvt_f16_f32(float *dst, const uint16_t *src, size_t n)
{
    return cvt_on_device(dst, src, n, gpu_k_f16_f32);
}

extern "C" int gpu_cuda_cvt_f32_bf16(uint16_t *dst, const float *src, size_t n)
{
    return cvt_on_device(dst, src, n, gpu_k_f32_bf16);
}

extern "C" int gpu_cuda_cvt_bf16_f32(float *dst, const uint16_t *src, size_t n)
{
    return cvt_on_device(dst, src, n, gpu_k_bf16_f32);
}
