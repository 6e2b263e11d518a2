/*
 * gpt.h - the GPT model (gpu/gpt.c), internal to the gpu/ module: its plan (parameter
 * tensors, activation offsets, the op dtypes), its init, forward and backward, and the ops
 * it is built from, exported for the tests and mirrored by the CUDA kernels
 * (gpu/cuda/cuda_ops.h names the CPU op each kernel follows).
 *
 * A GPT-2-style pre-LN decoder with tied embeddings: h = wte[x] + wpe[t]; per block
 * h += attn.proj(attention(attn.qkv(ln1(h)))), h += mlp.proj(gelu(mlp.fc(ln2(h))));
 * logits = ln_f(h) wte^T; mean cross-entropy over the B x T next-token targets.
 *
 * Parameters live in one block (layout and a table of named tensors below); activations in
 * one byte block; an fp32 scratch block holds temporaries. Rows are N = B x T tokens, d_model
 * C, H heads of head_dim C/H. The dtypes each op runs in come from the autocast table (see
 * gpt.c for the exact mapping of PyTorch autocast onto the graph); the residual stream is
 * held as fp32 floats whose values are of resid_dt (fp32 by default).
 *
 * Invariants: each op computes in fp32 from values of its dtype and rounds its outputs (and,
 * backward, its gradients) to that dtype; the parameter layout is the checkpoints' and the
 * CUDA backend's.
 * Threads: the passes between the GEMMs, the ops below included, run on the OpenMP team,
 * with results that do not depend on its size (see gpt.c); the GEMMs are called from the
 * calling thread. A plan is read-only once made.
 */
#ifndef AMPD_GPU_GPT_H
#define AMPD_GPU_GPT_H

#include "gpu/gpu_int.h"
#include "gpu/mlp.h" /* gpu_mlp_weights */

#define GPU_GPT_MAX_LAYERS 48
#define GPU_GPT_MAX_TENSORS (4 + 12 * GPU_GPT_MAX_LAYERS)

/* One named parameter tensor: PyTorch-style name ("blocks.0.attn.qkv.weight"), element
 * offset and count in the parameter block, row-major shape (ndim 1 or 2). */
typedef struct {
    char name[40];
    size_t off, count;
    int ndim;
    int64_t shape[2];
} gpu_gpt_tensor;

/* Element offsets of one block's parameters. Linear weights are [out x in]. */
typedef struct {
    size_t ln1_w, ln1_b;   /* [C] */
    size_t qkv_w, qkv_b;   /* [3C x C], [3C]: q, k, v stacked, heads contiguous in each */
    size_t proj_w, proj_b; /* [C x C], [C] (attn.proj) */
    size_t ln2_w, ln2_b;   /* [C] */
    size_t fc_w, fc_b;     /* [4C x C], [4C] */
    size_t mproj_w, mproj_b; /* [C x 4C], [C] (mlp.proj) */
} gpu_gpt_block;

/* Byte offsets of one block's saved activations (max_batch x seq_len rows each). */
typedef struct {
    size_t resid;              /* fp32 N x C: the block's input (residual stream) */
    size_t ln1;                /* lin_dt N x C: ln1 output cast to the linear's dtype */
    size_t ln1_mean, ln1_rstd; /* fp32 N */
    size_t qkv;                /* lin_dt N x 3C */
    size_t probs;              /* fp32 B x H x T x T softmax output, 0 above the diagonal;
                                * flash: fp32 B x H x T log-sum-exp of each score row */
    size_t atty;               /* lin_dt N x C: attention output, attn.proj's input */
    size_t resid_mid;          /* fp32 N x C: after the attention residual add */
    size_t ln2, ln2_mean, ln2_rstd;
    size_t fc;                 /* lin_dt N x 4C: mlp.fc output (GELU's input) */
    size_t gelu;               /* lin_dt N x 4C: GELU output cast to mlp.proj's dtype */
} gpu_gpt_block_acts;

typedef struct {
    int n_layer, n_head, d_model, seq_len, vocab, head_dim;
    int max_batch;
    int attn_slots;            /* threads the attention's heads are shared out to: the
                                * OpenMP team's size when planned, at most B x n_head */
    bool flash;                /* flash attention: asked for and mm_dt 16-bit (else the
                                * attention is materialised) */
    bool dy_copy;              /* lin_dt 16-bit and multiplied as it is stored: a linear's
                                * output gradient is converted once for its two GEMMs */
    /* op dtypes: linear layers and lm_head; attention matmuls (QK^T, AV); their softmax;
     * layer norms; GELU; cross-entropy; the embedding; the residual stream's values */
    gpu_dtype lin_dt, mm_dt, sm_dt, ln_dt, gelu_dt, ce_dt, emb_dt, resid_dt;
    size_t wte, wpe, lnf_w, lnf_b; /* [V x C], [T x C], [C], [C] */
    gpu_gpt_block blk[GPU_GPT_MAX_LAYERS];
    size_t nparams;
    int ntensors;
    gpu_gpt_tensor tensor[GPU_GPT_MAX_TENSORS]; /* in block order */
    gpu_gpt_block_acts act[GPU_GPT_MAX_LAYERS];
    size_t resid_final;          /* fp32 N x C: the last block's output */
    size_t lnf, lnf_mean, lnf_rstd; /* lin_dt N x C; fp32 N; fp32 N */
    size_t probs;                /* fp32 N x V: the cross-entropy's softmax */
    size_t act_bytes;
    size_t scratch_floats;
    /* fp8 (gpu_gpt_plan_fp8): the blocks' linears are fp8 GEMM g = 4 l + k, k 0..3 for
     * attn.qkv, attn.proj, mlp.fc and mlp.proj (nfp8 = 4 n_layer; the head stays in lin_dt);
     * fp8[g] unless kept in bf16, with its weight at fp8_w[g] (a parameter offset) and the
     * fp8 copies of its input (max_batch x seq_len x in) and weight at x8_off[g] and
     * w8_off[g] in the fp8 block */
    int nfp8;
    bool fp8[4 * GPU_GPT_MAX_LAYERS];
    size_t fp8_w[4 * GPU_GPT_MAX_LAYERS];
    size_t x8_off[4 * GPU_GPT_MAX_LAYERS], w8_off[4 * GPU_GPT_MAX_LAYERS];
    size_t fp8_bytes;
} gpu_gpt;

/* The parameters the ops read, as for the MLP: the working copy p in pdt, the fp32 master
 * or NULL; an op autocast runs in fp32 reads the master when there is one. */
typedef gpu_mlp_weights gpu_gpt_weights;

/* The name of the blocks' linear g ("blocks.2.mlp.fc") into out. */
void gpu_gpt_linear_name(int g, char *out, size_t len);
/* Plan fp8 GEMMs for an fp8 job (f->on): the blocks' linears but those f keeps; the fp8 block
 * and more scratch. GPU_EINVAL naming a kept layer the model lacks. */
int gpu_gpt_plan_fp8(gpu_gpt *m, const gpu_fp8_config *f, char *err, size_t errlen);
/* Plan the layout for model mc (n_layer, n_head, d_model, seq_len, vocab) under policy a and
 * job dtype dt for up to max_batch sequences of seq_len tokens. GPU_EINVAL with a message
 * naming the field in err when the model is malformed or too large. */
int gpu_gpt_plan(gpu_gpt *m, const gpu_model_config *mc, const gpu_autocast *a, gpu_dtype dt,
                 int max_batch, char *err, size_t errlen);
/* GPT-2's init into params (fp32, nparams): linear and embedding weights normal(0, 0.02),
 * the residual projections (attn.proj, mlp.proj) normal(0, 0.02 / sqrt(2 n_layer)), the
 * normal draws times init_scale; biases 0; layer norms weight 1, bias 0. */
void gpu_gpt_init_params(const gpu_gpt *m, float *params, float init_scale, gpu_rng *rng);
/* Forward pass of B <= max_batch sequences: tokens x[B*T] and next-token targets y[B*T]
 * (each in [0, vocab), else GPU_EINVAL). Saves what backward needs in acts (act_bytes);
 * *loss receives the mean cross-entropy (may be inf/NaN), *correct the number of positions
 * whose argmax equals the target. scratch holds scratch_floats floats. diag (NULL: off)
 * receives every low-precision op's fp32 outputs before rounding, as layers
 * "blocks.<i>.attn.qkv", "blocks.<i>.attn.scores" (Q K^T), "blocks.<i>.attn.proj",
 * "blocks.<i>.mlp.fc", "blocks.<i>.mlp.proj" and "lm_head". All pointers borrowed. */
int gpu_gpt_forward(const gpu_gpt *m, const gpu_gpt_weights *w, const int *x, const int *y,
                    int B, uint8_t *acts, float *scratch, gpu_diag *diag, double *loss,
                    int *correct);
/* Backward pass after gpu_gpt_forward with the same x, y and B: the loss gradient is seeded
 * with `seed` (the loss scale); every gradient leaves its op rounded to the op's dtype and
 * is then written (not accumulated) into grads (fp32, nparams; the tied wte gets the sum of
 * the head's and the embedding's gradients in fp32). diag (NULL: off; begun with scale ==
 * seed) receives, per low-precision op, the gradient arriving at its output, then its
 * weight and bias gradients and its input gradient before they are rounded. ready (NULL:
 * none) hears of ln_f's gradients, then each block's from the last, then wpe and wte. */
int gpu_gpt_backward(const gpu_gpt *m, const gpu_gpt_weights *w, const int *x, const int *y,
                     int B, float seed, const uint8_t *acts, float *scratch, gpu_diag *diag,
                     float *grads, const gpu_grad_ready *ready);
/* Report block l's twelve parameter gradients to ready (NULL: nobody), in table order: what
 * a backward (this one or the CUDA model's) calls once block l's gradients are written. */
void gpu_gpt_block_done(const gpu_gpt *m, int l, const gpu_grad_ready *ready);

/* The GPT's ops, exported for the tests (the model is built from them). Arrays are fp32
 * holding values of the dtype named; "dt" is the op's compute dtype: its inputs are values
 * of dt, it computes in fp32 and rounds its outputs (and, backward, its gradients) to dt.
 * All pointers borrowed; outputs may not overlap inputs unless stated. */

/* out[b*T+t] = rd(wte[x] + wpe[t], out_dt) for N = B*T rows of C; wte/wpe in wdt; tmp is
 * unused (may be NULL). */
void gpu_gpt_embed_fwd(const int *x, int B, int T, int C, const void *wte, const void *wpe,
                       gpu_dtype wdt, gpu_dtype out_dt, float *out, float *tmp);
/* dwte[x] += dout rows, dwpe[t] += dout rows, in fp32. */
void gpu_gpt_embed_bwd(const int *x, int B, int T, int C, const float *dout, float *dwte,
                       float *dwpe);
/* Layer norm (eps 1e-5) over rows of C: y = rd((x - mean) * rstd * g + b, dt); mean and
 * rstd (fp32, N each) saved for backward. */
void gpu_gpt_layernorm_fwd(const float *x, const float *g, const float *b, int N, int C,
                           gpu_dtype dt, float *y, float *mean, float *rstd);
/* From dy (values of dt): dx = rd(., dt) written; dg, db (C each) written with the sums
 * over rows rounded to dt. */
void gpu_gpt_layernorm_bwd(const float *dy, const float *x, const float *mean,
                           const float *rstd, const float *g, int N, int C, gpu_dtype dt,
                           float *dx, float *dg, float *db);
/* GELU, tanh approximation: dst = rd(gelu(u), dt) (dst may equal u). */
void gpu_gpt_gelu_fwd(float *dst, const float *u, size_t n, gpu_dtype dt);
/* d = rd(d * gelu'(u), dt), in place (d holds values of dt). */
void gpu_gpt_gelu_bwd(float *d, const float *u, size_t n, gpu_dtype dt);
/* A linear's bias gradient: acc[j] = the sum of column j of dy [rows x n] over the rows in
 * order, read from dy16 instead when it is not NULL (the same values stored in 16-bit dt):
 * the same sums either way. */
void gpu_gpt_bias_grad(float *acc, const float *dy, const uint16_t *dy16, gpu_dtype dt,
                       size_t rows, int n);
/* exp(x) in fp32 (within 2 ulp over the whole range, inf/0/NaN as expf), the vectorised
 * kernel the softmaxes and GELU use. */
void gpu_gpt_exp(float *dst, const float *x, size_t n);
/* Causal multi-head attention on qkv [N x 3C] (values of mm_dt): per sequence and head,
 * S = rd(rd(Q K^T, mm_dt) / sqrt(hd), mm_dt); P = rd(softmax(S), sm_dt) over j <= i only
 * (masked positions get exactly 0, no -inf arithmetic); y = rd(rd(P, mm_dt) V, mm_dt),
 * heads merged into y [N x C]. probs [B x H x T x T] saved. scratch holds
 * gpu_gpt_attention_scratch_floats(T, C / H, mm_dt, slots) floats (the GEMMs take their
 * operands in mm_dt: bf16 natively where the CPU has it). slots > 1 shares the (sequence,
 * head) pairs out to that many threads at once, each running its heads' GEMMs and rows
 * alone (few, coarse parallel regions); 1 runs the heads in order, each GEMM and row pass
 * on the whole team. diag (NULL: off; runs as slots 1) and layer: Q K^T's causal outputs
 * are accounted under that layer (backward: dS arriving, dQ and dK before rounding). */
size_t gpu_gpt_attention_scratch_floats(int T, int hd, gpu_dtype mm_dt, int slots);
int gpu_gpt_attention_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype mm_dt,
                          gpu_dtype sm_dt, float *probs, float *y, float *scratch, int slots,
                          gpu_diag *diag, int layer);
/* From dy [N x C] (values of mm_dt): dqkv [N x 3C] written, rounded to mm_dt. */
int gpu_gpt_attention_bwd(const float *dy, const float *qkv, const float *probs, int B, int T,
                          int C, int H, gpu_dtype mm_dt, gpu_dtype sm_dt, float *dqkv,
                          float *scratch, int slots, gpu_diag *diag, int layer);
/* Flash attention (model.attention "flash", FlashAttention-2's numerics), same shapes and
 * scratch: per sequence and head, S = rd(Q K^T, fp32) * hd^-1/2 in fp32 (never rounded to
 * mm_dt); P = softmax(S) in fp32 over j <= i; lse[b, h, i] = max_j S + log(sum_j exp(S - max))
 * saved (fp32, B x H x T) instead of P; y = rd(rd(P, mm_dt) V, mm_dt). */
int gpu_gpt_flash_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype mm_dt, float *lse,
                      float *y, float *scratch, int slots);
/* Its backward, P = exp(S - lse) recomputed: dV = rd(P) ^T dY; dP = dY V^T in fp32;
 * D_i = dY_i . O_i in fp32 (o: the forward's output as saved, N x C); dS = P (dP - D_i) *
 * hd^-1/2 in fp32, then dQ = rd(dS) K, dK = rd(dS)^T Q; dqkv rounded to mm_dt. diag: dY
 * accounted as the gradient arriving (inf/NaN), dQ and dK as input gradients. */
int gpu_gpt_flash_bwd(const float *dy, const float *qkv, const float *o, const float *lse, int B,
                      int T, int C, int H, gpu_dtype mm_dt, float *dqkv, float *scratch, int slots,
                      gpu_diag *diag, int layer);
/* Tied head and cross-entropy: logits = rd(x wte^T, lin_dt) (x: N x C values of lin_dt,
 * wte: V x C in wdt), then cross-entropy in ce_dt: probs (N x V, fp32) saved, *loss_sum the
 * summed loss (double), *correct the argmax hits. logits: N x V fp32 scratch. gscratch
 * holds gpu_gpt_head_scratch_floats() floats (0, and NULL allowed, when lin_dt and wdt are
 * fp32); the backward takes the same. */
size_t gpu_gpt_head_scratch_floats(int N, int C, int V, gpu_dtype wdt, gpu_dtype lin_dt);
int gpu_gpt_head_fwd(const float *x, const void *wte, gpu_dtype wdt, const int *y, int N,
                     int C, int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float *logits,
                     float *probs, float *gscratch, gpu_diag *diag, int layer,
                     double *loss_sum, int *correct);
/* dlogits = rd(rd((probs - onehot(y)) * g, ce_dt), lin_dt) (N x V scratch); dx = rd(dlogits
 * wte, lin_dt) written (N x C); dwte = rd(dlogits^T xs, lin_dt) written (V x C), where xs
 * is the saved head input in lin_dt. */
int gpu_gpt_head_bwd(const float *probs, const int *y, const void *xs, const void *wte,
                     gpu_dtype wdt, int N, int C, int V, gpu_dtype lin_dt, gpu_dtype ce_dt,
                     float g, float *dlogits, float *dx, float *dwte, float *gscratch,
                     gpu_diag *diag, int layer);

#endif /* AMPD_GPU_GPT_H */
