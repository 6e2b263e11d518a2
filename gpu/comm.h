/*
 * comm.h - internal header of gpu/: the gradient all-reduce of a data-parallel step, as the
 * trainer drives it (comm.c; the public side is in gpu.h).
 *
 * A step: gpu_comm_begin, then backward reports each finished gradient range with
 * gpu_comm_ready (through a gpu_grad_ready hook); a bucket whose gradients are all ready
 * gets its hook applied and its all-reduce started, in bucket order, while backward goes on;
 * gpu_comm_finish starts what is left, waits for every bucket and reports the bytes and
 * times; gpu_comm_control agrees on the step (found-inf, the norm, the loss, the scaler).
 *
 * Buckets follow the tensor table backwards (the order backward produces gradients), whole
 * tensors each, up to bucket_mb MiB of fp32 gradients; the first one is capped at 1 MiB
 * (DDP's first bucket) so that communication starts early. A tensor larger than a bucket
 * gets one of its own.
 *
 * Threads: the trainer's thread calls these; one communication thread per gpu_comm runs
 * the all-reduces and unpacks their results. MPI is called by one thread at a time.
 */
#ifndef AMPD_GPU_COMM_H
#define AMPD_GPU_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu.h"

#ifdef __cplusplus
extern "C" { /* gpu/cuda/cuda_comm.cu shares the bucket layout */
#endif

/* The buckets over the n tensors (element offsets and counts in table order), as
 * gpu_comm_plan makes them: bucket i covers elements [lo[i], hi[i]) (lo and hi hold n
 * entries); returns how many. Pure: the CUDA ranks' plan too. */
int gpu_comm_buckets(const size_t *off, const size_t *count, int n, double bucket_mb,
                     size_t *lo, size_t *hi);
/* How many elements of [off, off + count) fall in [lo, hi): what a ready report adds to a
 * bucket. */
size_t gpu_comm_overlap(size_t lo, size_t hi, size_t off, size_t count);
/* One hop of a 16-bit SUM (dt GPU_FP16 or GPU_BF16): inout[i] = round16(widen(in[i]) +
 * widen(inout[i])), the sum in fp32 rounded to nearest even; as NCCL's ring adds. */
void gpu_comm_sum16(const uint16_t *in, uint16_t *inout, int len, gpu_dtype dt);
/* This process's rank on its host and the number of ranks there, as mpirun numbers them
 * (0 and 1 when not launched by mpirun): which CUDA device a rank takes, known before it
 * joins. */
void gpu_comm_local(int *rank, int *size);
/* bytes at buf from rank 0 to every rank (the NCCL bootstrap); 0 or GPU_ECOMM. Called while
 * the communication thread is idle. */
int gpu_comm_bcast(gpu_comm *c, void *buf, size_t bytes);
/* v[0..n) becomes the largest of every rank's v[i] (fp8's amax reduction); 0 or GPU_ECOMM.
 * Called while the communication thread is idle. */
int gpu_comm_max(gpu_comm *c, float *v, int n);

/* Build the buckets over the n tensors (element offsets and counts into grads, in table
 * order). grads is borrowed for the trainer's life. */
int gpu_comm_plan(gpu_comm *c, float *grads, const size_t *off, const size_t *count, int n,
                  gpu_comm_hook hook, double bucket_mb, char *err, size_t errlen);
int gpu_comm_nbuckets(const gpu_comm *c);

/* A new step: no bucket ready. */
void gpu_comm_begin(gpu_comm *c);
/* Gradients [off, off + count) of the block are final for this step. */
void gpu_comm_ready(gpu_comm *c, size_t off, size_t count);

typedef struct {
    int64_t bytes;      /* handed to the all-reduces (count x the hook's element size) */
    double ms;          /* first start to last completion */
    double exposed_ms;  /* spent waiting in gpu_comm_finish */
    bool pre_nonfinite; /* this rank's gradients held inf/NaN before the hook */
} gpu_comm_stats;

/* Start the buckets not started yet, wait for all of them; the gradients then hold the
 * reduced values on every rank. */
int gpu_comm_finish(gpu_comm *c, gpu_comm_stats *out);

/* One step's agreement, in and out (a single all-reduce): */
typedef struct {
    double loss;        /* in: this rank's loss; out: the mean over the ranks */
    bool found_inf;     /* out: true when any rank found inf/NaN */
    bool pre_nonfinite; /* out: true when any rank's gradients held inf/NaN before the hook */
    double sumsq;       /* out: the largest of the ranks' (they hold the same gradients) */
    float scale;        /* in: the scale this step used */
    int64_t tracker;    /* in: the scaler's growth tracker */
    bool scalers_equal; /* out: every rank has the same scale and tracker */
} gpu_comm_ctl;
int gpu_comm_control(gpu_comm *c, gpu_comm_ctl *v);

/* The slowest rank's step time and that rank (the first of the slowest); with busy_all (one
 * entry a rank), every rank's busy_ms too: its step without the time it waited for the
 * all-reduce, which is where a straggler shows (the others wait for it). One collective. */
int gpu_comm_step_time(gpu_comm *c, double ms, double busy_ms, double *max_ms, int *rank,
                       double *busy_all);

#ifdef __cplusplus
}
#endif

#endif /* AMPD_GPU_COMM_H */
