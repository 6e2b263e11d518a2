/*
 * twin.h - the trainer's device twin (gpu/cuda/cuda_train.c; gpu/cuda/cuda_none.c without
 * CUDA), internal to the gpu/ module, and the two trainer functions (gpu/train.c) the CUDA
 * side and the tests need: the job plan and the last step's gradients.
 *
 * When a job runs on CUDA, train.c keeps its host blocks (initialisation, checkpoints, the
 * tensor table) and drives a twin that holds the same blocks on the device and runs whole
 * steps there. Declared here, free of CUDA types, so that train.c and cuda_none.c build
 * without the CUDA headers; gpu/cuda/cuda_model.h holds the device side.
 *
 * Invariants: the twin's blocks use the host plan's offsets (gpu_mlp / gpu_gpt), so the
 * tensor table and checkpoints are shared; the host blocks are current only after
 * gpu_cuda_twin_download.
 * Threads: a twin is driven by its trainer's thread only. A step enqueues its work on the
 * twin's stream and synchronises once, at its end; the other calls are synchronous.
 */
#ifndef AMPD_GPU_TWIN_H
#define AMPD_GPU_TWIN_H

#include "gpu/cuda/cuda_comm.h"
#include "gpu/gpt.h"
#include "gpu/gpu_int.h"
#include "gpu/mlp.h"

typedef struct gpu_cuda_twin gpu_cuda_twin; /* opaque */

/* The host side a twin mirrors, borrowed for the twin's life (train.c's blocks). */
typedef struct {
    const gpu_job_config *cfg;
    const gpu_mlp *mlp;          /* the model: the MLP, unless gpt is not NULL */
    const gpu_gpt *gpt;
    int ntensors;                /* the tensor table (offsets and counts into the blocks) */
    const size_t *offsets, *counts;
    float *master;               /* fp32 master (the params of an fp32 job), or NULL */
    void *work;                  /* the working copy in cfg->dtype (== master for fp32) */
    float *m, *v;                /* optimizer state (v NULL for SGD) */
    /* an fp8 job (NULL otherwise): the recipe, the number of GEMMs, which run in fp8, the
     * history length, and the host scaling state (gpu/fp8.h's rows; 3 ngemm x (2 + len)) */
    const gpu_fp8_config *fp8;
    int fp8_ngemm, fp8_len;
    const bool *fp8_on;
    float *fp8_state;
    /* a collecting step's fp8 casts per row, written after it (gpu/fp8.h's stats, amax and
     * scale_used: the amax NaN when a NaN was cast, the scale NaN for a row not cast) */
    gpu_fp8_cast_stats *fp8_stats;
    float *fp8_amax, *fp8_scale;
} gpu_cuda_host;

/* What one device step returns (read after the step's one synchronisation). */
typedef struct {
    double loss;                 /* the batch's mean loss (may be inf/NaN) */
    bool found_inf;              /* the gradients held inf/NaN: the update was skipped */
    bool floor_failed;           /* the scaler failed at its floor (GPU_ESCALE_FLOOR) */
    double grad_norm;            /* NaN when found_inf */
    int64_t lost_updates;        /* master weights off: updates rounded away this step */
    double step_ms;              /* CUDA events: from the batch upload to the snapshot */
    gpu_scaler_state scaler;     /* after this step's update */
    int64_t applied, lost_total;
    /* with several ranks (gpu_cuda_twin_comm), the gradient all-reduce: */
    int64_t comm_bytes;          /* handed to NCCL */
    double comm_ms, comm_exposed_ms;
    bool pre_nonfinite;          /* this rank's gradients held inf/NaN before the hook */
} gpu_cuda_step_out;

/* Plan job c's model: into *m for an MLP, or into *g (allocated here; the caller frees it,
 * NULL for an MLP) for a GPT. err (may be NULL) says why a plan is refused. */
int gpu_job_plan(const gpu_job_config *c, gpu_mlp *m, gpu_gpt **g, char *err, size_t errlen);

/* Allocate the device blocks on CUDA device `device` (cfg->device names it in messages),
 * upload the host blocks and write the step state (scaler state s, applied, lost_total).
 * *mem receives the device bytes by category (gpu_mem, as the CPU counts them). Returns
 * GPU_ENODEV (no device, no cuBLASLt, a build without CUDA), GPU_ENOMEM or GPU_ECUDA with
 * the reason in err. Synchronous. Caller frees with gpu_cuda_twin_free(). */
int gpu_cuda_twin_create(const gpu_cuda_host *h, int device, const gpu_scaler_state *s,
                         int64_t applied, int64_t lost_total, gpu_cuda_twin **out,
                         gpu_mem *mem, char *err, size_t errlen);
void gpu_cuda_twin_free(gpu_cuda_twin *d);
/* "cuda:N (name, sm_XY, memory)": where the twin runs; valid while it lives. */
const char *gpu_cuda_twin_describe(const gpu_cuda_twin *d);
/* Join the job's ranks (p: their number, this one's, the hook, the buckets; borrowed during
 * the call): from then on every step all-reduces the gradients through NCCL between
 * backward and the unscale, bucket by bucket while backward goes on, so that every rank's
 * unscale, clip, optimizer and scaler see the same gradients. *mem gets the twin's bytes
 * with the 16-bit buckets in the workspace. GPU_ENODEV without NCCL, GPU_ECOMM when the
 * communicator cannot be made, with the reason in err. */
int gpu_cuda_twin_comm(gpu_cuda_twin *d, const gpu_cuda_comm_plan *p, gpu_mem *mem, char *err,
                       size_t errlen);
/* One training step on the batch x (MLP: B x features floats; GPT: B x seq_len tokens) with
 * labels or targets y, at learning rate lr, synchronising once at its end. diag (NULL: off)
 * receives the per-layer counters (its layer table is filled in the device's order);
 * stats and tensor_lost (ntensors entries each) the per-tensor gradient statistics and,
 * without master weights, the lost updates; prof (NULL: off) the step's phases, timed with
 * CUDA events (gpu_profile). All pointers borrowed. */
int gpu_cuda_twin_step(gpu_cuda_twin *d, const void *x, const int *y, int B, double lr,
                       gpu_diag *diag, gpu_grad_stat *stats, int64_t *tensor_lost,
                       gpu_cuda_step_out *out, gpu_profile *prof);
/* Forward only over one batch of B rows (an eval batch): *loss_sum the summed loss, *correct
 * the argmax hits. Synchronous. */
int gpu_cuda_twin_eval(gpu_cuda_twin *d, const void *x, const int *y, int B, double *loss_sum,
                       int *correct);
/* Copy the device's master, working copy, m and v (and an fp8 job's scaling state) into the
 * host blocks and, when grads is not NULL, the gradient block into grads (nparams floats).
 * Synchronous. */
int gpu_cuda_twin_download(gpu_cuda_twin *d, float *grads);
/* Copy the host blocks to the device and rewrite the step state (a restored checkpoint).
 * Synchronous. */
int gpu_cuda_twin_upload(gpu_cuda_twin *d, const gpu_scaler_state *s, int64_t applied,
                         int64_t lost_total);

/* Join a communicator of one rank through NCCL, without MPI: a CUDA job's all-reduce path
 * (the hook's kernels, ncclAllReduce, the bytes and times) on one device, for the tests. */
int gpu_trainer_nccl_alone(gpu_trainer *t, char *err, size_t errlen);

/* The trainer's fp32 gradient block of the last step (nparams floats, borrowed until the
 * next step), copied from the device first when the job runs on CUDA: for the tests. A CPU
 * MLP in fp16 or bf16 keeps its weights' working copy there after the update, over the
 * gradients: gpu_trainer_keep_grads (before the first step) makes it round the master as its
 * GEMMs read it instead, every step, so that the gradients stay readable. */
int gpu_trainer_grads(gpu_trainer *t, const float **grads);
void gpu_trainer_keep_grads(gpu_trainer *t);

#endif /* AMPD_GPU_TWIN_H */
