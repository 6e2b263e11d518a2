/*
 * cuda_model.h - the MLP and the GPT on a CUDA device (internal to the engine; built only
 * with CUDA), and the step profile. Plain C (gpu/cuda/cuda_mlp.c, gpu/cuda/cuda_gpt.c) that
 * drives the kernels of cuda_blas.h, cuda_ops.h and cuda_step.h on one stream;
 * gpu/cuda/cuda_train.c owns the memory and runs whole steps with them (the twin of
 * gpu/twin.h), gpu/cuda/cuda_prof.c times them.
 *
 * Memory, the llm.c way and with the CPU's layout: the parameter-shaped blocks (fp32
 * master, working copy in the job's dtype, fp32 gradients, m, v) use the element offsets of
 * the CPU plan (gpu_mlp / gpu_gpt), so checkpoints and the tensor table are shared; the
 * activation block and the workspace have a device layout of their own, planned by
 * gpu_cuda_*_plan below (16-bit activations stored as 16 bits: that is where AMP saves
 * memory). Every pointer in gpu_cuda_model_ctx is a device pointer.
 *
 * Numerics: the CPU contract (gpu/mlp.h, gpu/gpt.h): each op computes in fp32 from values
 * of its dtype and rounds its outputs and gradients to that dtype; the GEMMs accumulate in
 * fp32 (CUBLAS_COMPUTE_32F). Results match the CPU's within the tolerances
 * tests/check_cuda_train.c states (orders of summation differ).
 *
 * Threads: everything is enqueued on ctx->stream; nothing synchronises the host.
 */
#ifndef AMPD_CUDA_MODEL_H
#define AMPD_CUDA_MODEL_H

#include <cuda_runtime_api.h>

#include "gpu/cuda/cuda_blas.h"
#include "gpu/cuda/cuda_ops.h"
#include "gpu/cuda/cuda_step.h"
#include "gpu/diag.h"
#include "gpu/gpt.h"
#include "gpu/mlp.h"

/* ---- step profile (cuda_prof.c) ------------------------------------------------------
 *
 * Marks on a stream: a mark records a CUDA event and charges the device time since the
 * previous mark (or the start) to its phase, a static string (gpu_profile's names). Events
 * are created as marks need them and kept for the next profiled step. */
typedef struct gpu_cuda_prof gpu_cuda_prof; /* opaque */

int gpu_cuda_prof_create(gpu_cuda_prof **out);
void gpu_cuda_prof_free(gpu_cuda_prof *p);
/* Forget the last step's marks and record the start on stream s. */
int gpu_cuda_prof_start(gpu_cuda_prof *p, cudaStream_t s);
/* Nothing when p is NULL; a failure is kept and reported by gpu_cuda_prof_read. */
void gpu_cuda_prof_mark(gpu_cuda_prof *p, cudaStream_t s, const char *phase);
/* After the stream has synchronised: the phases into *out (cleared first). */
int gpu_cuda_prof_read(gpu_cuda_prof *p, gpu_profile *out);

/* What one forward/backward works on. */
typedef struct {
    cudaStream_t stream;
    gpu_cuda_blas *blas;
    const void *work;      /* weights in the job's dtype (== master for fp32) */
    const float *master;   /* fp32 master weights, or NULL (master_weights off) */
    gpu_dtype wdt;         /* dtype of work */
    float *grads;          /* fp32, nparams: written (not accumulated) by backward */
    void *acts;            /* the activation block, acts_bytes */
    void *ws;              /* the workspace, ws_bytes */
    const gpu_cuda_step_state *state; /* backward seeds the loss gradient with
                                       * state->scale_used (read on the device) */
    double *loss_sum;      /* device: the summed (not mean) cross-entropy of the batch */
    int *correct;          /* device: argmax hits */
    gpu_cuda_diag *diag;   /* NULL: no diagnostics this step */
    gpu_cuda_prof *prof;   /* NULL: the step is not profiled */
    const gpu_grad_ready *ready; /* NULL: nobody; else told of each parameter gradient once
                                  * the kernels that write it are enqueued (as on the CPU) */
    /* an fp8 job (fp8 NULL otherwise; docs/fp8.md): the scaling rows of gpu/fp8.h on the
     * device, GEMM g's operand r at row 3 g + r of 2 + fp8_len floats; which GEMMs run in
     * fp8 (host array); the fp8 operands' block (gpu_cuda_*_fp8_plan); whether casts
     * record their amax (delayed scaling, training) */
    const gpu_fp8_config *fp8;
    float *fp8_state;
    int fp8_len;
    const bool *fp8_on;
    uint8_t *fp8_block;
    bool fp8_record;
    gpu_cuda_fp8_counts *fp8_counts; /* a collecting step's: one per row, zeroed; else NULL */
} gpu_cuda_model_ctx;

/* ---- fp8 linears (cuda_fp8.c), the MLP's and the GPT's -------------------------------- */

/* Cast rows x cols values of dt at src into fp8 dst (and its transpose dst_t; either may be
 * NULL) with the scaling row of GEMM g's operand r (0 input, 1 weight, 2 output gradient),
 * by ctx->fp8's recipe: current scaling sets the row's scale from this tensor first; delayed
 * scaling records the amax in the staging slot when ctx->fp8_record. */
int gpu_cuda_fp8_cast_op(const gpu_cuda_model_ctx *c, int g, int r, const void *src, gpu_dtype dt,
                         int rows, int cols, uint8_t *dst, uint8_t *dst_t);
/* gpu_cuda_fp8_cast_op of GEMM g's weight (rows x cols at parameter offset w_off): the fp32
 * master when there is one, else the working copy, as the CPU's fp8 linears read it. */
int gpu_cuda_fp8_cast_weight(const gpu_cuda_model_ctx *c, int g, size_t w_off, int rows, int cols,
                             uint8_t *dst, uint8_t *dst_t);
/* C[M x N] (fp32, ld N) = (A B^T) x the scale_inv of GEMM g's operands ra and rb: fp8 A
 * (M x K) and B (N x K), both K-major (cuBLASLt's TN). */
int gpu_cuda_fp8_gemm_op(const gpu_cuda_model_ctx *c, int g, int M, int N, int K, const uint8_t *A,
                         int ra, const uint8_t *B, int rb, float *C);

/* ---- MLP (cuda_mlp.c) ---------------------------------------------------------------- */

/* Bytes of the activation block and the workspace for up to max_batch rows of m. */
int gpu_cuda_mlp_plan(const gpu_mlp *m, int max_batch, size_t *acts_bytes, size_t *ws_bytes);
/* An fp8 MLP on the device (on[l]: linear l in fp8): the bytes of its fp8 operands' block
 * for up to max_batch rows (each fp8 linear's input and weight and their transposes, the
 * output gradient's and its transpose), 0 with the block's size in *bytes; GPU_EINVAL with
 * the reason in err (naming the layer) when a dimension of an fp8 GEMM is not a multiple of
 * 16, as cuBLASLt's fp8 kernels need. */
int gpu_cuda_mlp_fp8_plan(const gpu_mlp *m, const bool *on, int max_batch, size_t *bytes, char *err,
                          size_t errlen);
/* Forward of B rows: x (device fp32, B x width[0]), y (device int, B); writes *loss_sum and
 * *correct (device) and saves what backward needs. */
int gpu_cuda_mlp_forward(const gpu_mlp *m, const gpu_cuda_model_ctx *c, const float *x,
                         const int *y, int B);
/* Backward after forward with the same B and y: grads written, seeded with the scale. */
int gpu_cuda_mlp_backward(const gpu_mlp *m, const gpu_cuda_model_ctx *c, const float *x,
                          const int *y, int B);

/* ---- GPT (cuda_gpt.c) ---------------------------------------------------------------- */

int gpu_cuda_gpt_plan(const gpu_gpt *m, int max_batch, size_t *acts_bytes, size_t *ws_bytes);
/* An fp8 GPT on the device (m planned by gpu_gpt_plan_fp8; on[g]: GEMM g in fp8): the bytes
 * of its fp8 operands' block for up to max_batch sequences (each fp8 linear's transposed
 * input and weight, and the shared forward and gradient copies), 0 with the size in *bytes;
 * GPU_EINVAL with the reason in err (naming the field) when seq_len or d_model is not a
 * multiple of 16, as cuBLASLt's fp8 kernels need. */
int gpu_cuda_gpt_fp8_plan(const gpu_gpt *m, const bool *on, int max_batch, size_t *bytes, char *err,
                          size_t errlen);
/* Forward of B sequences: tokens x and targets y (device int, B x seq_len each). */
int gpu_cuda_gpt_forward(const gpu_gpt *m, const gpu_cuda_model_ctx *c, const int *x,
                         const int *y, int B);
int gpu_cuda_gpt_backward(const gpu_gpt *m, const gpu_cuda_model_ctx *c, const int *x,
                          const int *y, int B);

/* ---- trainer (cuda_train.c) ------------------------------------------------------------
 *
 * The device twin of gpu_trainer (its interface, free of CUDA types, is in gpu/twin.h) owns
 * one device allocation per block, the step state and a pinned host snapshot, and runs a
 * step as: upload the batch, begin, forward, backward, unscale, clip, optimizer, scaler
 * update, snapshot, then one cudaStreamSynchronize.
 *
 * Diagnostics layers on the device are the slots the CPU model would give them (the order in
 * which its forward first names them): the MLP's linear l is layer l ("fc<l+1>"); the GPT's
 * block b has its five low-precision ops at GPU_CUDA_GPT_DIAG_OPS * b + op (below) and
 * "lm_head" comes last, at GPU_CUDA_GPT_DIAG_OPS * n_layer. */
#include <stdio.h>

enum {
    GPU_CUDA_GPT_QKV = 0,   /* blocks.<b>.attn.qkv (lin_dt) */
    GPU_CUDA_GPT_SCORES,    /* blocks.<b>.attn.scores, Q K^T (mm_dt) */
    GPU_CUDA_GPT_PROJ,      /* blocks.<b>.attn.proj (lin_dt) */
    GPU_CUDA_GPT_FC,        /* blocks.<b>.mlp.fc (lin_dt) */
    GPU_CUDA_GPT_MPROJ,     /* blocks.<b>.mlp.proj (lin_dt) */
    GPU_CUDA_GPT_DIAG_OPS
};

/* The diagnostics layer of op (GPU_CUDA_GPT_*) of block b, or of lm_head when b < 0. */
static inline int gpu_cuda_gpt_diag_layer(const gpu_gpt *m, int b, int op)
{
    return b < 0 ? GPU_CUDA_GPT_DIAG_OPS * m->n_layer : GPU_CUDA_GPT_DIAG_OPS * b + op;
}

/* Name the layers of d (host) in the device's order, with their dtypes, for the MLP mlp or,
 * when gpt is not NULL, the GPT; names already there keep their slots (gpu_diag_layer). */
void gpu_cuda_diag_names(gpu_diag *d, const gpu_mlp *mlp, const gpu_gpt *gpt);

/* 0 for cudaSuccess; otherwise log the error with what (the call) and return GPU_ECUDA. */
static inline int gpu_cuda_c_check(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return 0;
    gpu_log(GPU_LOG_ERROR, "CUDA", "error %s: %s (in %s)", cudaGetErrorName(e),
            cudaGetErrorString(e), what);
    return GPU_ECUDA;
}

#endif /* AMPD_CUDA_MODEL_H */
