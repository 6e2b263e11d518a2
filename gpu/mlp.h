/*
 * mlp.h - the MLP model (gpu/mlp.c), internal to the gpu/ module: its plan (the layout of
 * the parameter and activation blocks and the dtypes autocast gives each op), its init, and
 * the forward and backward passes that train.c drives (gpu/cuda/cuda_mlp.c runs the same
 * plan on a device).
 *
 * Invariants: each op computes in fp32 from values of its dtype and rounds its outputs (and,
 * backward, its gradients) to that dtype; the parameter block's offsets are shared with the
 * CUDA backend and with checkpoints.
 * Threads: none of its own; the GEMMs use the BLAS library's threads. A plan is read-only
 * once made.
 */
#ifndef AMPD_GPU_MLP_H
#define AMPD_GPU_MLP_H

#include "gpu/gpu_int.h"

/* Layout and dtypes of one MLP. Parameters live in one block: for linear layer l the weight
 * [out x in] at w_off[l] and the bias [out] at b_off[l] (element offsets). Activations live
 * in one byte block: x_off[l] is the input of linear l (lin_dt, batch x width[l]); z_off[l]
 * its output when backward needs it (GELU layers and the logits); probs_off the fp32
 * softmax (batch x classes). */
typedef struct {
    int nlin;
    int width[GPU_MAX_LAYERS];
    gpu_activation act;
    int max_batch;
    gpu_dtype lin_dt, act_dt, ce_dt;
    size_t w_off[GPU_MAX_LAYERS], b_off[GPU_MAX_LAYERS];
    size_t nparams;
    size_t x_off[GPU_MAX_LAYERS], z_off[GPU_MAX_LAYERS], probs_off;
    size_t act_bytes;
    size_t scratch_floats; /* fp32 workspace: GEMM widening, outputs, backward buffers */
    /* fp8 (gpu_mlp_plan_fp8): linear l's GEMMs run in fp8 when fp8[l]; its input's and its
     * weight's fp8 copies (kept from forward for backward) live in the fp8 block at x8_off[l]
     * (max_batch x width[l]) and w8_off[l] (width[l + 1] x width[l]) */
    bool fp8[GPU_MAX_LAYERS];
    size_t x8_off[GPU_MAX_LAYERS], w8_off[GPU_MAX_LAYERS];
    size_t fp8_bytes;
} gpu_mlp;

/* The parameters the ops read: p holds the working copy (pdt), master the fp32 copy or
 * NULL. An op that autocast runs in fp32 reads master when there is one. p may be NULL
 * when there is a master and the linear layers run in pdt or fp32: the GEMMs then round
 * the master to their dtype as they read it, so no 16-bit copy of the weights is kept.
 * A bf16 p holds what the conversions to bf16 wrote (gpu_cvt_from_f32, as the trainer's
 * optimizer does; GPU_GEMM_B_CONVERTED in gpu.h): the GEMMs read it without a subnormal scan.
 * in_grads (NULL: none) is the gradient block while it holds the weight matrices' copy in
 * lin_dt (gpu_optim_update_in_grads): the GEMMs read it there, and the backward reads each
 * layer's before it writes that layer's weight gradient. */
typedef struct {
    const void *p;
    gpu_dtype pdt;
    const float *master;
    const float *in_grads;
    /* an fp8 job: the scaling state (which the casts update) and the fp8 block */
    struct gpu_fp8_run *fp8;
    uint8_t *fp8_block;
} gpu_mlp_weights;

/* Plan the layout for model mc under policy a and job dtype dt. GPU_EINVAL with a message
 * in err when the model is malformed. */
int gpu_mlp_plan(gpu_mlp *m, const gpu_model_config *mc, const gpu_autocast *a, gpu_dtype dt,
                 int max_batch, char *err, size_t errlen);
/* Plan fp8 GEMMs for an fp8 job (f->on): every linear layer but those f keeps ("fc1", ...);
 * the fp8 block's layout, more scratch. GPU_EINVAL naming a kept layer the model lacks. */
int gpu_mlp_plan_fp8(gpu_mlp *m, const gpu_fp8_config *f, char *err, size_t errlen);
/* Fill params (fp32, nparams) with PyTorch's nn.Linear init (Kaiming-uniform weights and
 * uniform biases in +-1/sqrt(fan_in)) times init_scale. */
void gpu_mlp_init_params(const gpu_mlp *m, float *params, float init_scale, gpu_rng *rng);
/* Forward pass of B <= max_batch rows x (fp32, B x width[0]) with labels y. Saves what
 * backward needs in acts; *loss receives the mean cross-entropy (double, may be inf/NaN)
 * and *correct the number of rows whose argmax equals the label. scratch holds
 * scratch_floats floats. diag (NULL: off) collects each linear layer's outputs as "fc1",
 * "fc2", ... (after gpu_diag_begin). All pointers borrowed. */
int gpu_mlp_forward(const gpu_mlp *m, const gpu_mlp_weights *w, const float *x, const int *y,
                    int B, uint8_t *acts, float *scratch, double *loss, int *correct,
                    gpu_diag *diag);
/* Backward pass after gpu_mlp_forward with the same B and y: the loss gradient is seeded
 * with `seed` (the loss scale) and every gradient comes out of its op rounded to the op's
 * dtype before it is written to grads (fp32, nparams). diag (NULL: off; begun with
 * scale == seed) collects each layer's weight, bias and input gradients before they are
 * rounded, and the underflow that starves units of the layers below (see mlp.c). ready
 * (NULL: none) hears of each layer's weight and bias gradients once they are written. */
int gpu_mlp_backward(const gpu_mlp *m, const gpu_mlp_weights *w, const int *y, int B,
                     float seed, const uint8_t *acts, float *scratch, float *grads,
                     gpu_diag *diag, const gpu_grad_ready *ready);

#endif /* AMPD_GPU_MLP_H */
