/*
 * cuda_comm.h - the gradient all-reduce of a CUDA rank (cuda_comm.cu): NCCL, opened at run
 * time, with the comm hooks' kernels around it. Internal to the CUDA backend; the twin
 * (cuda_train.c) drives it during a step, train.c describes the job's ranks (gpu/twin.h).
 *
 * A step: gpu_cuda_comm_begin; backward reports each finished gradient range with
 * gpu_cuda_comm_ready once the kernels that write it are enqueued on the compute stream; a
 * bucket whose gradients are all reported gets an event there, and the communication
 * stream waits for that event, runs the hook's first half (divide by N, or round to the
 * 16-bit type, divide and round again), ncclAllReduce (SUM) and the widening back into the
 * fp32 gradients, while the compute stream goes on with backward. gpu_cuda_comm_finish
 * starts what is left and makes the compute stream wait for the last bucket; after the
 * step's synchronisation gpu_cuda_comm_result reads the bytes, times and the pre-hook
 * inf/NaN flag. The hooks and buckets are those of the CPU ranks (gpu/comm.c): same order,
 * same arithmetic per element.
 *
 * Threads: one thread drives a gpu_cuda_comm (the twin's); nothing here synchronises the
 * host except create and free.
 */
#ifndef AMPD_CUDA_COMM_H
#define AMPD_CUDA_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu.h"

#ifdef __CUDACC__
#include <cuda_runtime.h>
#else
typedef struct CUstream_st *cudaStream_t;
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The ranks of a job and its buckets, as train.c plans them (gpu_comm_buckets) and hands
 * them to the twin (gpu_cuda_twin_comm in gpu/twin.h). Plain C, free of CUDA types. */
typedef struct {
    int world, rank;
    gpu_comm_hook hook;
    int nbuckets;
    const size_t *lo, *hi;     /* bucket i: gradient elements [lo[i], hi[i]) */
    /* bytes at buf from rank 0 to every rank (NCCL's unique id); not called with 1 rank */
    int (*bcast)(void *ctx, void *buf, size_t bytes);
    void *bcast_ctx;
} gpu_cuda_comm_plan;

typedef struct gpu_cuda_comm gpu_cuda_comm; /* opaque */

/* Load NCCL, agree on the unique id, join the communicator on the current device and
 * allocate the 16-bit buckets; grads (device, fp32) is borrowed, compute is the stream
 * backward runs on. *bytes: the device bytes taken. GPU_ENODEV without NCCL, GPU_ECOMM
 * when the communicator cannot be made, with the reason in err. */
int gpu_cuda_comm_create(const gpu_cuda_comm_plan *p, float *grads, cudaStream_t compute,
                         gpu_cuda_comm **out, size_t *bytes, char *err, size_t errlen);
void gpu_cuda_comm_free(gpu_cuda_comm *c);
/* "NCCL 2.28.3" (the library's version), valid while the process lives. */
const char *gpu_cuda_comm_version(void);

int gpu_cuda_comm_begin(gpu_cuda_comm *c);
/* Gradients [off, off + count) are written by work already enqueued on the compute stream.
 * A failure is kept for gpu_cuda_comm_finish. */
void gpu_cuda_comm_ready(gpu_cuda_comm *c, size_t off, size_t count);
int gpu_cuda_comm_finish(gpu_cuda_comm *c);

/* buf[0..n) (device fp32) = its element-wise MAX over the ranks, in place, on the compute
 * stream: after gpu_cuda_comm_finish, so every rank issues its collectives in one order
 * (an fp8 job's amaxes). Not counted in the step's bytes and times. */
int gpu_cuda_comm_max(gpu_cuda_comm *c, float *buf, size_t n);

typedef struct {
    int64_t bytes;         /* handed to ncclAllReduce (elements x the hook's size) */
    double ms;             /* the first bucket's start to the last one's end (CUDA events) */
    double exposed_ms;     /* the part after backward's end */
    bool pre_nonfinite;    /* this rank's gradients held inf/NaN before the hook */
} gpu_cuda_comm_stats;

/* After the compute stream has synchronised past gpu_cuda_comm_finish's wait. */
int gpu_cuda_comm_result(gpu_cuda_comm *c, gpu_cuda_comm_stats *out, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif /* AMPD_CUDA_COMM_H */
