/*
 * cuda_ops.h - the CUDA kernels of the models' non-GEMM ops (gpu/cuda/cuda_ops.cu):
 * embedding, layer norm (with the residual add before it, and backward the residual
 * gradient's sum and cast), GELU (tanh, GPT; its backward also with the bias gradient), ReLU
 * and GELU (erf, MLP), bias add and bias gradient, softmax cross-entropy (with or without
 * its gradient fused in) and the causal attention softmax; the flash attention of
 * gpu/cuda/cuda_attn.cu. Internal to the gpu/ module (not part of gpu.h).
 *
 * Numerics: each op mirrors its CPU counterpart in gpu/gpt.c or gpu/mlp.c (named at each
 * function). Its compute dtype dt rounds its outputs (and, backward, its gradients) with
 * round-to-nearest-even; a tensor is stored in a storage dtype (float for GPU_FP32, uint16_t
 * bit patterns for GPU_FP16/GPU_BF16) given next to it, so that the casts between ops fuse
 * into the loads and stores: a loaded input is rounded to dt where the CPU casts it, and a
 * result is stored as rd(rd(v, dt), storage dtype), which is the CPU's cast to the next op's
 * dtype. The fp32 arithmetic is the CPU's, operation for operation (no FMA contraction, the
 * CPU's exp polynomial, the CPU's 16 partial sums in row reductions), so most results equal
 * the CPU's bit for bit; the exceptions are named at each function.
 *
 * Each op is a *_launch function: device pointers (borrowed), enqueued on `stream`, no host
 * synchronisation, no allocation. Returns 0, GPU_EINVAL for bad arguments (nothing enqueued)
 * or GPU_ECUDA for a launch error (logged). Every size may be 0: nothing is enqueued, except
 * that sums over no rows (layer-norm dg/db, bias gradient, cross-entropy totals) are written
 * as 0. Workspaces must be 256-byte aligned (as cudaMalloc returns them). The tests call the
 * ops through synchronous host wrappers with the CPU op's calling convention (same names
 * without _launch, tests/cudahost/cudahost.h).
 *
 * Threads: the launch functions may be called from any thread for any stream; kernels on
 * one stream run in order. Workspaces must not be shared by launches that may overlap.
 */
#ifndef AMPD_CUDA_OPS_H
#define AMPD_CUDA_OPS_H

#include <cuda_runtime_api.h>

#include "gpu/gpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- embedding (gpu_gpt_embed_fwd / gpu_gpt_embed_bwd) ----------------------------------- */

/* out[b*T+t][c] = rd(wte[x[b*T+t]][c] + wpe[t][c], dt), stored in odt, for N = B*T rows of
 * C. wte [V x C] and wpe [T x C] are stored in wdt. A token outside [0, V) gives a row of
 * NaN (the CPU model rejects such tokens before the op). Bit-exact. */
int gpu_cuda_embed_fwd_launch(const int *x, int B, int T, int C, int V, const void *wte,
                              const void *wpe, gpu_dtype wdt, gpu_dtype dt, void *out,
                              gpu_dtype odt, cudaStream_t stream);
/* Bytes of workspace gpu_cuda_embed_bwd_launch needs for N = B*T rows (a device radix
 * sort's temporaries). GPU_ENODEV without a device. */
int gpu_cuda_embed_bwd_workspace(int N, size_t *bytes);
/* dwte[x[r]] += d[r] and dwpe[t] += d[r] (fp32, accumulated into what they hold), where
 * d = rd(dout, dt) and dout is stored in ddt. Deterministic and bit-exact: the rows are
 * sorted by token (stable, on the device) and each (token, column) is summed by one thread in
 * increasing row order, as the CPU does; no atomics. Rows whose token is outside [0, V) add
 * nothing to dwte (they still add to dwpe). work: gpu_cuda_embed_bwd_workspace(B*T) bytes
 * (GPU_EINVAL if work_bytes is less). */
int gpu_cuda_embed_bwd_launch(const int *x, int B, int T, int C, int V, const void *dout,
                              gpu_dtype ddt, gpu_dtype dt, float *dwte, float *dwpe, void *work,
                              size_t work_bytes, cudaStream_t stream);

/* ---- layer norm (gpu_gpt_layernorm_fwd / gpu_gpt_layernorm_bwd) -------------------------- */

/* Per row of C: x = rd(x, dt) (x stored in xdt), y = rd((x - mean) * rstd * g + b, dt)
 * stored in ydt; g, b stored in wdt (not rounded: the CPU reads them as they are); mean and
 * rstd (fp32, N each) written. Eps 1e-5. Bit-exact (the CPU's 16 partial sums per row). */
int gpu_cuda_layernorm_fwd_launch(const void *x, gpu_dtype xdt, const void *g, const void *b,
                                  gpu_dtype wdt, int N, int C, gpu_dtype dt, void *y,
                                  gpu_dtype ydt, float *mean, float *rstd, cudaStream_t stream);
/* gpt.c's resid_add followed by its ln_fwd (the residual add that ends a block, then the next
 * layer norm): x = rd(a + r, xdt) written to xo (a and xo stored in xdt, r in rdt; xo may not
 * alias a or r), then gpu_cuda_layernorm_fwd_launch on x. Bit-exact. */
int gpu_cuda_add_layernorm_fwd_launch(const void *a, const void *r, gpu_dtype rdt, void *xo,
                                      gpu_dtype xdt, const void *g, const void *b,
                                      gpu_dtype wdt, int N, int C, gpu_dtype dt, void *y,
                                      gpu_dtype ydt, float *mean, float *rstd,
                                      cudaStream_t stream);
/* Bytes of workspace for the column sums of gpu_cuda_layernorm_bwd_launch (0 when N <= 256). */
size_t gpu_cuda_layernorm_bwd_workspace(int N, int C);
/* From dy (stored in dydt, rounded to dt) and the forward's x (xdt, rounded to dt), mean,
 * rstd and g (wdt): dx = rd(., dt) stored in dxdt (may not alias dy or x); dg and db (C
 * each, fp32 holding values of dt) written with the sums over rows rounded to dt. dx is
 * bit-exact. dg/db: for N <= 256 one sequential sum per column (bit-exact); beyond, partial
 * sums over chunks of rows then their sum (deterministic, within fp32 rounding of the CPU's).
 * work: gpu_cuda_layernorm_bwd_workspace(N, C) bytes (may be NULL when that is 0). */
int gpu_cuda_layernorm_bwd_launch(const void *dy, gpu_dtype dydt, const void *x, gpu_dtype xdt,
                                  const float *mean, const float *rstd, const void *g,
                                  gpu_dtype wdt, int N, int C, gpu_dtype dt, void *dx,
                                  gpu_dtype dxdt, float *dg, float *db, void *work,
                                  cudaStream_t stream);
/* Where gpu_cuda_layernorm_bwd_resid_launch puts dx: into the residual stream's gradient dres
 * (stored in rdt), added (acc: gpt.c's resid_acc) or written, and then, when lin is not NULL,
 * that gradient rounded to lindt and stored in lindt (gpt.c's to_lin: the dY of the linear
 * below). */
typedef struct {
    void *dres;
    gpu_dtype rdt;
    bool acc;
    void *lin;
    gpu_dtype lindt;
} gpu_cuda_dres;
/* gpu_cuda_layernorm_bwd_launch with dx going into out: dres = rd(dres + rd(dx, rdt), rdt)
 * (acc) or rd(dx, rdt), then lin = rd(dres, lindt). dres may not alias dy or x; lin may equal
 * dy when lindt is dydt (the column sums are taken first, and each element of dy is read
 * before it is overwritten by the same thread). Bit-exact as the three CPU steps. */
int gpu_cuda_layernorm_bwd_resid_launch(const void *dy, gpu_dtype dydt, const void *x,
                                        gpu_dtype xdt, const float *mean, const float *rstd,
                                        const void *g, gpu_dtype wdt, int N, int C, gpu_dtype dt,
                                        const gpu_cuda_dres *out, float *dg, float *db,
                                        void *work, cudaStream_t stream);

/* ---- GELU, tanh approximation (gpu_gpt_gelu_fwd / gpu_gpt_gelu_bwd) ----------------------- */

/* out = rd(gelu(rd(u, dt)), dt) stored in odt; u stored in udt; out may equal u when
 * odt == udt. The CPU's formula x / (1 + exp(-2z)) with its exp. Bit-exact. */
int gpu_cuda_gelu_tanh_fwd_launch(const void *u, gpu_dtype udt, void *out, gpu_dtype odt,
                                  size_t n, gpu_dtype dt, cudaStream_t stream);
/* dx = rd(rd(dy, dt) * gelu'(rd(u, dt)), dt), dy and dx stored in gdt (dx may equal dy).
 * Bit-exact. */
int gpu_cuda_gelu_tanh_bwd_launch(const void *dy, void *dx, gpu_dtype gdt, const void *u,
                                  gpu_dtype udt, size_t n, gpu_dtype dt, cudaStream_t stream);
/* The same on a [rows x n] matrix, fused with the bias gradient of the linear whose output
 * gradient dx is: db (n, fp32 holding values of bdt) as gpu_cuda_bias_grad_launch(dx, gdt,
 * rows, n, bdt, db, work) computes it from dx as stored (bit-exact up to 256 rows,
 * deterministic beyond; work: gpu_cuda_bias_grad_workspace(rows, n) bytes). Saves the bias
 * gradient's read of dx. */
int gpu_cuda_gelu_tanh_bwd_bias_launch(const void *dy, void *dx, gpu_dtype gdt, const void *u,
                                       gpu_dtype udt, int rows, int n, gpu_dtype dt,
                                       gpu_dtype bdt, float *db, void *work,
                                       cudaStream_t stream);

/* ---- MLP activations (mlp.c's epilogue_row and act_backward) ------------------------------ */

/* out = rd(act(z), dt) stored in odt, z stored in zdt and used as it is (the MLP does not
 * round the activation's input). ReLU: z > 0 ? z : 0 (NaN -> 0). GELU: exact (erf) form,
 * 0.5 z (1 + erf(z / sqrt 2)), with the GPU's erff: within a few fp32 ulp of glibc's, more
 * below -2 where the CPU's 1 + erf cancels. out may equal z when odt == zdt. */
int gpu_cuda_act_fwd_launch(gpu_activation act, const void *z, gpu_dtype zdt, void *out,
                            gpu_dtype odt, size_t n, gpu_dtype dt, cudaStream_t stream);
/* d = rd(dy, dt); ReLU: dx = saved > 0 ? d : 0 with saved the ReLU's output; GELU:
 * dx = rd(d * gelu'(saved), dt) with saved its input z. dy, dx stored in gdt (dx may equal
 * dy); saved in sdt. ReLU is bit-exact; GELU uses the GPU's erff and expf. */
int gpu_cuda_act_bwd_launch(gpu_activation act, const void *dy, void *dx, gpu_dtype gdt,
                            const void *saved, gpu_dtype sdt, size_t n, gpu_dtype dt,
                            cudaStream_t stream);

/* ---- bias add, bias gradient ------------------------------------------------------------- */

/* out[i][j] = rd(in[i][j] + bias[j], dt) over rows x n: in (the GEMM's output) stored in idt,
 * bias in bdt, out in odt (out may equal in when odt == idt). The linear epilogue of gpt.c
 * and mlp.c. Bit-exact. */
int gpu_cuda_bias_add_launch(const void *in, gpu_dtype idt, const void *bias, gpu_dtype bdt,
                             int rows, int n, gpu_dtype dt, void *out, gpu_dtype odt,
                             cudaStream_t stream);
/* Bytes of workspace gpu_cuda_bias_grad_launch needs (0 when rows <= 256). */
size_t gpu_cuda_bias_grad_workspace(int rows, int n);
/* db[j] = rd(sum over rows of dz[i][j], dt) (fp32 array, n), dz stored in zdt (values of dt):
 * mlp.c's bias_grad and gpt.c's linear_bwd. Summed as the layer norm's dg (see above):
 * bit-exact up to 256 rows, deterministic beyond. work may be NULL when its size is 0. */
int gpu_cuda_bias_grad_launch(const void *dz, gpu_dtype zdt, int rows, int n, gpu_dtype dt,
                              float *db, void *work, cudaStream_t stream);

/* ---- softmax cross-entropy --------------------------------------------------------------- */

/* The two CPU cross-entropies differ in their arithmetic, so the kernels follow either:
 *   GPT (gpu_gpt_head_fwd / _bwd): z = rd(rd(logit, lin_dt), ce_dt); exp in fp32 (the CPU's
 *     polynomial), the row sum in fp32 with the CPU's 16 partial sums, p = e / sum;
 *     dlogit = p*g, minus g at the target.
 *   MLP (mlp.c cross_entropy / ce_backward): z = rd(logit, lin_dt) (not cast to ce_dt); exp
 *     and the row sum in double, p = (float)(e / sum); dlogit = (p - onehot) * g.
 * Both: the row's argmax as the CPU finds it (the first maximum; the last NaN if any), its
 * loss -(z[y] - max - log(sum)) in double, p rounded to ce_dt, dlogits rounded to ce_dt then
 * lin_dt, g = seed / (float)count. GPT probs and dlogits are bit-exact; the losses differ from
 * the CPU's by the last bits of the double log (and, MLP, exp). */
typedef GPU_ENUM { GPU_CUDA_CE_GPT = 0, GPU_CUDA_CE_MLP } gpu_cuda_ce_style;

/* Bytes of workspace for N rows (per-row losses and hits). */
size_t gpu_cuda_ce_workspace(int N);
/* Forward over N rows of V logits (stored in ldt) with targets y[N] (device): probs (N x V,
 * values of ce_dt) stored in pdt (NULL: not written); *loss_sum (double, device) the summed
 * loss in a fixed order and *correct (int, device) the argmax hits. A target outside [0, V)
 * gives a NaN loss. work: gpu_cuda_ce_workspace(N) bytes. */
int gpu_cuda_ce_fwd_launch(gpu_cuda_ce_style style, const void *logits, gpu_dtype ldt,
                           const int *y, int N, int V, gpu_dtype lin_dt, gpu_dtype ce_dt,
                           void *probs, gpu_dtype pdt, double *loss_sum, int *correct,
                           void *work, cudaStream_t stream);
/* The same, fused with the backward (llm.c's classifier): the probs are not stored; dlogits
 * overwrite the logits in place (stored in ldt). g = s / (float)count with s = *d_seed when
 * d_seed (device) is not NULL, else seed: the loss scale may live on the device. */
int gpu_cuda_ce_fused_launch(gpu_cuda_ce_style style, void *logits, gpu_dtype ldt,
                             const int *y, int N, int V, gpu_dtype lin_dt, gpu_dtype ce_dt,
                             float seed, const float *d_seed, int count, double *loss_sum,
                             int *correct, void *work, cudaStream_t stream);
/* Backward from saved probs (stored in pdt): dlogits (N x V) stored in ddt; g as above. */
int gpu_cuda_ce_bwd_launch(gpu_cuda_ce_style style, const void *probs, gpu_dtype pdt,
                           const int *y, int N, int V, gpu_dtype ce_dt, gpu_dtype lin_dt,
                           float seed, const float *d_seed, int count, void *dlogits,
                           gpu_dtype ddt, cudaStream_t stream);

/* ---- causal attention softmax (the softmax of gpu_gpt_attention_fwd / _bwd) ----------------
 *
 * Score matrices [BH x T x T], row-major per (batch, head), scale = (float)(1 / sqrt(hd)).
 * Only the causal entries j <= i of row i are ever read; the others may hold anything. */

/* From S = Q K^T (stored in sdt): s = rd(rd(rd(S, mm_dt) * scale, mm_dt), sm_dt); per row
 * p = rd(softmax(s[0..i]), sm_dt) in fp32 (exact zeros above the diagonal, no -inf
 * arithmetic), stored in pdt; Pm (NULL: not written) receives the same stored in pmdt (the
 * P V operand, rd(p, mm_dt) when pmdt is mm_dt). P may equal S when pdt == sdt. Bit-exact. */
int gpu_cuda_attn_softmax_fwd_launch(const void *S, gpu_dtype sdt, int BH, int T, int hd,
                                     gpu_dtype mm_dt, gpu_dtype sm_dt, void *P, gpu_dtype pdt,
                                     void *Pm, gpu_dtype pmdt, cudaStream_t stream);
/* From the saved P (pdt) and dP = dY V^T (dpdt): d = rd(rd(dP, mm_dt), sm_dt);
 * ds = rd(p * (d - sum_j p d), sm_dt) over j <= i, 0 above; dS = rd(rd(ds, mm_dt) * scale,
 * mm_dt) stored in dsdt (dS may equal dP when dsdt == dpdt). Bit-exact. */
int gpu_cuda_attn_softmax_bwd_launch(const void *P, gpu_dtype pdt, const void *dP,
                                     gpu_dtype dpdt, int BH, int T, int hd, gpu_dtype mm_dt,
                                     gpu_dtype sm_dt, void *dS, gpu_dtype dsdt,
                                     cudaStream_t stream);

/* ---- flash attention (gpu/cuda/cuda_attn.cu): gpu_gpt_flash_fwd / _bwd of gpu/gpt.c ---- *
 *
 * Tensor cores, fp16 or bf16 (dt) only, head_dim hd 16, 32, 48 or 64, B x H <= 65535; qkv
 * [B T x 3C] and dy [B T x C] stored in dt, 16-byte aligned. Not bit-exact: the products'
 * summation order, the forward's online softmax (it rounds exp(S - running max) where the CPU
 * rounds the normalised P) and expf / logf for the CPU's exp and log; deterministic (no
 * atomics). */
bool gpu_cuda_flash_supported(int hd);
/* y [B T x C] = the attention, stored in ydt (dt, or fp32 holding values of dt); lse
 * [B H x T] fp32, the backward's input. */
int gpu_cuda_flash_fwd_launch(const void *qkv, gpu_dtype dt, int B, int T, int H, int hd,
                              float *lse, void *y, gpu_dtype ydt, cudaStream_t stream);
/* dqkv [B T x 3C] = dQ, dK, dV (every element written): in fp32 before their rounding to dt
 * when ddt is fp32, else (ddt dt) rounded to dt; o: the forward's output as saved, in odt
 * (dt or fp32), 16-byte aligned; dsum: B H x T floats of workspace. */
int gpu_cuda_flash_bwd_launch(const void *qkv, const void *dy, gpu_dtype dt, const void *o,
                              gpu_dtype odt, const float *lse, int B, int T, int H, int hd,
                              float *dsum, void *dqkv, gpu_dtype ddt, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* AMPD_CUDA_OPS_H */
