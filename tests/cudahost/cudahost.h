/*
 * cudahost.h - synchronous host-buffer wrappers of the CUDA backend's launch functions, for
 * the test suites only (tests/check_cuda_gemm.c, check_cuda_ops.c, check_cuda_step.c, run
 * on a GPU as tests/check_cuda_* and on the emulator as tests/check_cudaemu_*). Each call
 * copies host arrays to new device buffers, enqueues the gpu/cuda/ launches on the default
 * stream, waits, copies the results back and frees what it allocated:
 *   blas_host.cu   gpu_cuda_matmul (gpu/cuda/cuda_blas.h), and gpu_gemm's contract on it
 *   ops_host.cu    the models' non-GEMM ops and flash attention (gpu/cuda/cuda_ops.h)
 *   step_host.cu   the optimizers, scaler, unscale + clip, diagnostics and whole step
 *                  tails of gpu/cuda/cuda_step.h
 * Built by nvcc into tests/libcudahost.a and, rewritten by tests/cudaemu/cu2cc.sh, into
 * tests/libcudahost_emu.a; neither is linked into ampd or gpu/libampdgpu.a.
 *
 * Invariants: without a device every wrapper returns GPU_ENODEV and leaves its buffers
 * alone (tests check it); the arguments are checked before anything is allocated. The
 * numerics are the launch functions' own: a wrapper only converts fp32 host values to the
 * storage dtype and back, which is exact for values of that dtype.
 * Threads: synchronous; a call owns its device buffers (and, blas, its cuBLASLt handle), so
 * calls from different threads are independent.
 */
#ifndef AMPD_TESTS_CUDAHOST_H
#define AMPD_TESTS_CUDAHOST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/cuda/cuda_blas.h"
#include "gpu/cuda/cuda_ops.h"
#include "gpu/cuda/cuda_step.h"
#include "gpu/gpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- GEMMs (blas_host.cu, gpu/cuda/cuda_blas.h) ------------------------------------- */

/* gpu_gemm()'s exact contract on the device: A and B host arrays of adt / bdt (any pair:
 * mixed pairs are widened to fp32 on the host first, exactly), C a host fp32 array.
 * Synchronous. GPU_ENODEV without a device or cuBLASLt, GPU_EINVAL for the arguments
 * gpu_gemm() refuses (C untouched). */
int gpu_cuda_gemm_host(bool ta, bool tb, int M, int N, int K, const void *A, gpu_dtype adt,
                       int lda, const void *B, gpu_dtype bdt, int ldb, float beta, float *C,
                       int ldc);

/* gpu_cuda_matmul() on host buffers: A and B are host arrays in adt / bdt storage; C, bias
 * and aux are host fp32 arrays holding values of cdt (C converted to cdt storage and back;
 * only the M x N elements of each batch are written back, C's padding is left alone; aux
 * receives its M x N elements, its padding untouched). Synchronous. Returns
 * what gpu_cuda_matmul() returns, or GPU_ENODEV / GPU_ENOMEM / GPU_ECUDA; C and aux are
 * untouched on failure. */
int gpu_cuda_mm_host(const gpu_cuda_mm *p);

/* gpu_cuda_matmul_fp8() on host buffers: A and B host arrays of fp8 codes (their spans),
 * the two scale_invs as values, C a host fp32 array holding values of cdt (its M x N
 * elements written back; untouched on failure). Synchronous; returns what the launch does,
 * or GPU_ENODEV / GPU_ENOMEM / GPU_ECUDA. */
int gpu_cuda_mm8_host(const gpu_cuda_mm8 *p, float a_scale_inv, float b_scale_inv);
/* gpu_cuda_fp8_cast() on host buffers: src rows x cols values of sdt (storage), dst (and
 * dst_t, may be NULL) host arrays of codes, scale a value; *amax and *counts (either may be
 * NULL) in and out. */
int gpu_cuda_fp8_cast_host(uint8_t *dst, uint8_t *dst_t, const void *src, gpu_dtype sdt, int rows,
                           int cols, gpu_fp8_format f, float scale, float *amax,
                           gpu_cuda_fp8_counts *counts);
/* gpu_cuda_fp8_delayed() on a host copy of the scaling state (nrows rows of 2 + len floats,
 * updated in place), and gpu_cuda_fp8_current() on one row (2 + 1 floats) from amax. */
int gpu_cuda_fp8_delayed_host(float *state, int nrows, int len, bool most_recent,
                              const float scaled_max[3]);
int gpu_cuda_fp8_current_host(float *row, float amax, float scaled_max, float epsilon);

/* ---- the ops (ops_host.cu, gpu/cuda/cuda_ops.h) ---------------------------------------
 *
 * The CPU op's calling convention: fp32 host arrays holding values of the dtype named, each
 * tensor stored on the device in that dtype. GPU_EINVAL, GPU_ENOMEM or GPU_ECUDA besides. */

/* wte/wpe: host arrays in wdt (float or uint16_t), like the CPU op; out values of out_dt. */
int gpu_cuda_embed_fwd(const int *x, int B, int T, int C, int V, const void *wte,
                       const void *wpe, gpu_dtype wdt, gpu_dtype out_dt, float *out);
/* dout values of dt; dwte (V x C) and dwpe (T x C) accumulated. */
int gpu_cuda_embed_bwd(const int *x, int B, int T, int C, int V, const float *dout,
                       gpu_dtype dt, float *dwte, float *dwpe);
/* x, y, dy, dx values of dt; g, b, mean, rstd, dg, db fp32. */
int gpu_cuda_layernorm_fwd(const float *x, const float *g, const float *b, int N, int C,
                           gpu_dtype dt, float *y, float *mean, float *rstd);
int gpu_cuda_layernorm_bwd(const float *dy, const float *x, const float *mean,
                           const float *rstd, const float *g, int N, int C, gpu_dtype dt,
                           float *dx, float *dg, float *db);
/* GPT GELU: dst may equal u; d in place. */
int gpu_cuda_gelu_tanh_fwd(float *dst, const float *u, size_t n, gpu_dtype dt);
int gpu_cuda_gelu_tanh_bwd(float *d, const float *u, size_t n, gpu_dtype dt);
/* MLP activation: dst = rd(act(z), dt); d in place, saved as for the launch form. */
int gpu_cuda_act_fwd(gpu_activation act, float *dst, const float *z, size_t n, gpu_dtype dt);
int gpu_cuda_act_bwd(gpu_activation act, float *d, const float *saved, size_t n, gpu_dtype dt);
/* in: fp32 (a GEMM output); bias: host array in bdt; out values of dt. */
int gpu_cuda_bias_add(float *out, const float *in, const void *bias, gpu_dtype bdt, int rows,
                      int n, gpu_dtype dt);
int gpu_cuda_bias_grad(float *db, const float *dz, int rows, int n, gpu_dtype dt);
/* logits: values of ldt (raw fp32 GEMM outputs when ldt is fp32); probs (may be NULL) values
 * of ce_dt; y host. */
int gpu_cuda_ce_fwd(gpu_cuda_ce_style style, const float *logits, gpu_dtype ldt, const int *y,
                    int N, int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float *probs,
                    double *loss_sum, int *correct);
/* logits in: values of ldt; out: the dlogits, values of lin_dt stored in ldt. */
int gpu_cuda_ce_fused(gpu_cuda_ce_style style, float *logits, gpu_dtype ldt, const int *y,
                      int N, int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float seed, int count,
                      double *loss_sum, int *correct);
/* probs values of ce_dt; dlogits values of lin_dt. */
int gpu_cuda_ce_bwd(gpu_cuda_ce_style style, const float *probs, const int *y, int N, int V,
                    gpu_dtype ce_dt, gpu_dtype lin_dt, float seed, int count, float *dlogits);
/* S values of sdt; P values of sm_dt; Pm (may be NULL) values of mm_dt. */
int gpu_cuda_attn_softmax_fwd(const float *S, gpu_dtype sdt, int BH, int T, int hd,
                              gpu_dtype mm_dt, gpu_dtype sm_dt, float *P, float *Pm);
/* The CPU's calling convention (gpu_gpt_flash_fwd / _bwd): qkv, y, dy, o values of dt, o
 * stored in dt; dqkv rounded to dt like the CPU's. */
int gpu_cuda_flash_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype dt, float *lse,
                       float *y);
int gpu_cuda_flash_bwd(const float *dy, const float *qkv, const float *o, const float *lse,
                       int B, int T, int C, int H, gpu_dtype dt, float *dqkv);
/* P values of sm_dt; dP values of dpdt; dS values of mm_dt. */
int gpu_cuda_attn_softmax_bwd(const float *P, const float *dP, gpu_dtype dpdt, int BH, int T,
                              int hd, gpu_dtype mm_dt, gpu_dtype sm_dt, float *dS);

/* ---- the step after backward (step_host.cu, gpu/cuda/cuda_step.h) ------------------- */

/* gpu_optim_update() on the device, plus found_inf: the whole step is skipped when set.
 * t is the 1-based applied count including this step (the device starts at t - 1 and
 * advances unless found_inf); *applied (may be NULL) receives the device's count after.
 * p, g, m, v, work as in gpu_optim_update (host, borrowed). */
int gpu_cuda_optim_update_host(const gpu_optim_config *c, double lr, int64_t t, float gmul,
                               bool found_inf, float *p, const float *g, float *m, float *v,
                               size_t n, void *work, gpu_dtype wdt, int64_t *applied);
/* gpu_optim_update_lowp() on the device, with found_inf and *applied as above; *lost (may
 * be NULL) receives the lost-update count (0 when skipped). */
int gpu_cuda_optim_update_lowp_host(const gpu_optim_config *c, double lr, int64_t t,
                                    float gmul, bool found_inf, void *w, gpu_dtype wdt,
                                    const float *g, float *m, float *v, size_t n,
                                    int64_t *lost, int64_t *applied);
/* nsteps device scaler updates back to back (no host sync between them) from *s (in/out,
 * the final state) with found_inf[k] for step k; trace[k] (may be NULL) receives the state
 * after step k and floor[k] (may be NULL) whether it failed at the floor. */
int gpu_cuda_scaler_update_host(gpu_scaler_state *s, const gpu_scaler_config *c,
                                const bool *found_inf, int nsteps, gpu_scaler_state *trace,
                                bool *floor);
/* Unscale at `scale` (inv formed on the device) and clip on the device: g (host, in place),
 * stats, found_inf and sumsq as gpu_unscale(); *norm and *clip (may be NULL) the clip
 * kernel's grad_norm and clip coefficient for c->grad_clip. */
int gpu_cuda_clip_host(const gpu_optim_config *c, float scale, float *g,
                       const size_t *offsets, const size_t *counts, int ntensors,
                       gpu_grad_stat *stats, bool *found_inf, double *sumsq, double *norm,
                       float *clip);

/* One diagnostics call for gpu_cuda_diag_host: x[0..n) (host) accounted for layer as kind. */
typedef struct {
    int layer;
    gpu_cuda_diag_kind kind;
    const float *x;
    size_t n;
} gpu_cuda_diag_call;

/* A collection begun at `scale` and then the calls in order, on the device (a call for a
 * layer outside [0, nlayers) is ignored, as gpu_diag_* ignore one the table does not hold);
 * layer l has dtype dtypes[l]. *out receives the header and the first nlayers layers. */
int gpu_cuda_diag_host(const gpu_dtype *dtypes, int nlayers, float scale,
                       const gpu_cuda_diag_call *calls, int ncalls, gpu_cuda_diag *out);

/* The buffers of a run of step tails (host, borrowed, updated in place). */
typedef struct {
    size_t n;                    /* parameters */
    int ntensors;
    const size_t *offsets, *counts;  /* the tensors (the gradient layout; lowp updates) */
    float *master;               /* fp32 master weights; NULL: no master (lowp weights) */
    void *work;                  /* working copy in wdt (NULL with a master: none), or the
                                  * lowp weights without a master */
    gpu_dtype wdt;
    float *m, *v;                /* optimizer state (v NULL for SGD; m may be NULL for SGD) */
} gpu_cuda_tail_bufs;

/* nsteps step tails back to back without a host sync: begin -> unscale (grads + k*n, the
 * scaled gradients of step k, host, not modified) -> clip -> optimizer at lr[k] (lowp when
 * b->master is NULL) -> scaler update. *s and *applied are the initial scaler state and
 * applied count (updated to the final ones). trace[k] (nsteps entries, may be NULL): the
 * state after step k; stats (nsteps * ntensors, may be NULL) the per-tensor unscale stats;
 * tensor_lost (nsteps * ntensors, may be NULL) the lowp per-tensor lost counts. */
int gpu_cuda_step_tail_host(const gpu_optim_config *oc, const gpu_scaler_config *sc,
                            gpu_scaler_state *s, int64_t *applied, int nsteps,
                            const float *lr, const float *grads, gpu_cuda_tail_bufs *b,
                            gpu_cuda_step_state *trace, gpu_grad_stat *stats,
                            int64_t *tensor_lost);

#ifdef __cplusplus
}
#endif

#endif /* AMPD_TESTS_CUDAHOST_H */
