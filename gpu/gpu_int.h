/*
 * gpu_int.h - declarations shared inside the gpu/ module only (not part of the API).
 *
 * Holds the seeded random number generator every component uses (so that a job with the
 * same seed is reproducible bit for bit), CPU feature detection, and the MLP model
 * interface that train.c drives. Nothing here is thread-safe unless it says so.
 */
#ifndef AMPD_GPU_INT_H
#define AMPD_GPU_INT_H

#include "gpu/gpu.h"

/* ---- random numbers: splitmix64-seeded xoshiro256** -------------------------------------- */

typedef struct {
    uint64_t s[4];
} gpu_rng;

void gpu_rng_seed(gpu_rng *r, uint64_t seed);
uint64_t gpu_rng_next(gpu_rng *r);
/* Uniform in [0, 1) with 24 random bits. */
float gpu_rng_uniform(gpu_rng *r);
/* Standard normal (Box-Muller). */
float gpu_rng_normal(gpu_rng *r);
/* Uniform integer in [0, n). */
uint32_t gpu_rng_below(gpu_rng *r, uint32_t n);

/* ---- CPU features (format.c) ------------------------------------------------------------- */

typedef struct {
    bool avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq, avx512bf16, avx512fp16;
} gpu_cpu_features;

/* Read once from CPUID (and XGETBV for OS support); thread-safe. */
const gpu_cpu_features *gpu_cpu(void);

/* A kernel-path switch for components with an AVX-512 and a portable path: the path is
 * chosen from CPUID at first use and can be forced by tests. 0 means not chosen yet. */
enum { GPU_IMPL_UNSET = 0, GPU_IMPL_PORTABLE, GPU_IMPL_AVX512 };
int gpu_impl_pick(_Atomic int *sw);
/* Force "portable" or "avx512": GPU_EINVAL for other names, GPU_ENODEV when the CPU lacks
 * AVX-512. name is borrowed. */
int gpu_impl_force(_Atomic int *sw, const char *name);
const char *gpu_impl_name(int id);

/* Monotonic clock in seconds. */
double gpu_now(void);


/* ---- the MLP (mlp.c) ---------------------------------------------------------------------- */

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
} gpu_mlp;

/* The parameters the ops read: p holds the working copy (pdt), master the fp32 copy or
 * NULL. An op that autocast runs in fp32 reads master when there is one. */
typedef struct {
    const void *p;
    gpu_dtype pdt;
    const float *master;
} gpu_mlp_weights;

/* Plan the layout for model mc under policy a and job dtype dt. GPU_EINVAL with a message
 * in err when the model is malformed. */
int gpu_mlp_plan(gpu_mlp *m, const gpu_model_config *mc, const gpu_autocast *a, gpu_dtype dt,
                 int max_batch, char *err, size_t errlen);
/* Fill params (fp32, nparams) with PyTorch's nn.Linear init (Kaiming-uniform weights and
 * uniform biases in +-1/sqrt(fan_in)) times init_scale. */
void gpu_mlp_init_params(const gpu_mlp *m, float *params, float init_scale, gpu_rng *rng);
/* Forward pass of B <= max_batch rows x (fp32, B x width[0]) with labels y. Saves what
 * backward needs in acts; *loss receives the mean cross-entropy (double, may be inf/NaN)
 * and *correct the number of rows whose argmax equals the label. scratch holds
 * scratch_floats floats. All pointers borrowed. */
int gpu_mlp_forward(const gpu_mlp *m, const gpu_mlp_weights *w, const float *x, const int *y,
                    int B, uint8_t *acts, float *scratch, double *loss, int *correct);
/* Backward pass after gpu_mlp_forward with the same B and y: the loss gradient is seeded
 * with `seed` (the loss scale) and every gradient comes out of its op rounded to the op's
 * dtype before it is written to grads (fp32, nparams). */
int gpu_mlp_backward(const gpu_mlp *m, const gpu_mlp_weights *w, const int *y, int B,
                     float seed, const uint8_t *acts, float *scratch, float *grads);

#endif /* AMPD_GPU_INT_H */
