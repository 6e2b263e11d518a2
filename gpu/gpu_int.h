/*
 * gpu_int.h - declarations shared inside the gpu/ module only (not part of the API).
 *
 * Holds the seeded random number generator every component uses (so that a job with the
 * same seed is reproducible bit for bit), CPU feature detection, and the MLP model
 * interface that train.c drives, and the per-layer diagnostics that models feed (diag.c).
 * Nothing here is thread-safe unless it says so.
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


/* Per-layer diagnostics (defined with diag.c's section below); models take a pointer. */
typedef struct gpu_diag gpu_diag;

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
 * scratch_floats floats. diag (NULL: off) collects each linear layer's outputs as "fc1",
 * "fc2", ... (after gpu_diag_begin). All pointers borrowed. */
int gpu_mlp_forward(const gpu_mlp *m, const gpu_mlp_weights *w, const float *x, const int *y,
                    int B, uint8_t *acts, float *scratch, double *loss, int *correct,
                    gpu_diag *diag);
/* Backward pass after gpu_mlp_forward with the same B and y: the loss gradient is seeded
 * with `seed` (the loss scale) and every gradient comes out of its op rounded to the op's
 * dtype before it is written to grads (fp32, nparams). diag (NULL: off; begun with
 * scale == seed) collects each layer's weight, bias and input gradients before they are
 * rounded, and the underflow that starves units of the layers below (see mlp.c). */
int gpu_mlp_backward(const gpu_mlp *m, const gpu_mlp_weights *w, const int *y, int B,
                     float seed, const uint8_t *acts, float *scratch, float *grads,
                     gpu_diag *diag);

/* ---- per-layer diagnostics collection (diag.c) ------------------------------------------
 *
 * A model's forward and backward take a gpu_diag pointer; NULL turns collection off (no
 * cost). When on, every low-precision op reports, per layer: the largest |output| it
 * produced in fp32 before rounding (and how many outputs became inf/NaN when rounded to
 * the op's dtype), and for each gradient it rounds: how many non-zero fp32 values became
 * exactly 0 (flushed) with the current loss scale, and how many would have flushed without
 * it (|g / S| below half the dtype's smallest subnormal). The first layer whose forward
 * output or backward gradient held inf/NaN is recorded with its direction. */
#define GPU_DIAG_MAX_LAYERS 256

typedef struct {
    char name[48];          /* "fc1", "blocks.2.mlp.fc", ... */
    gpu_dtype dtype;        /* the op's compute dtype */
    float act_amax;         /* max |output| in fp32 before rounding, over finite values */
    int64_t act_n, act_overflow;     /* outputs; outputs that became inf/NaN when rounded */
    float grad_amax;        /* max |weight gradient| before rounding (scaled) */
    int64_t grad_n;         /* weight-gradient elements */
    int64_t grad_flushed;   /* non-zero values rounded to exactly 0 at the current scale */
    int64_t grad_flushed_unscaled; /* ... that would flush without loss scaling */
    int64_t grad_nonfinite; /* inf/NaN after rounding */
    /* added with diag.c: */
    int64_t grad_nonzero;   /* non-zero weight-gradient values before rounding */
    int64_t in_n, in_nonzero;       /* the input gradient the layer's backward passes down */
    int64_t in_flushed, in_flushed_unscaled, in_nonfinite; /* ... as for the weight gradient */
    int64_t out_nonfinite;  /* inf/NaN in the gradient arriving at the layer's output */
    int64_t grad_starved;   /* weight-gradient values exactly 0 because every gradient
                             * reaching their unit was flushed upstream (gpu_diag_starved) */
    int64_t grad_starved_unscaled; /* non-zero values whose unit would get no gradient
                                    * without loss scaling (and that would not flush alone) */
} gpu_layer_diag;

struct gpu_diag {
    int nlayers;
    gpu_layer_diag layer[GPU_DIAG_MAX_LAYERS];
    float scale;            /* the loss scale the backward was seeded with */
    int first_nonfinite;    /* index of the first layer to produce inf/NaN, or -1 */
    bool first_in_forward;  /* ... in its forward output (else in its backward) */
};

/* Start a step's collection (clears every layer, keeps the names). */
void gpu_diag_begin(gpu_diag *d, float scale);
/* The layer slot for name (created on first use; -1 when the table is full). */
int gpu_diag_layer(gpu_diag *d, const char *name, gpu_dtype dt);
/* Account an op's fp32 outputs y[0..n) about to be rounded to the layer's dtype. */
void gpu_diag_forward(gpu_diag *d, int layer, const float *y, size_t n);
/* Account a weight gradient g[0..n) (fp32, before rounding to the layer's dtype). */
void gpu_diag_weight_grad(gpu_diag *d, int layer, const float *g, size_t n);
/* Account an activation gradient (input of the layer's backward) for inf/NaN only. */
void gpu_diag_backward(gpu_diag *d, int layer, const float *g, size_t n);
/* Account the gradient the layer's backward passes to its input, g[0..n) in fp32 before it
 * is rounded to the layer's dtype (flushes, inf/NaN; optional for a model). */
void gpu_diag_input_grad(gpu_diag *d, int layer, const float *g, size_t n);
/* Round g[0..n) in place to the layer's dtype, accounting it first as a weight gradient
 * (weight = true) or an input gradient, chunk by chunk while it is in cache. d may be
 * NULL (then this is gpu_round_n). */
void gpu_diag_round_grad(gpu_diag *d, int layer, bool weight, float *g, size_t n,
                         gpu_dtype dt);
/* Account underflow that cascades (the model decides which values; see mlp.c): zero
 * weight-gradient values that are exactly 0 before rounding only because every gradient
 * reaching their unit was flushed upstream (lost with and without the loss scale), and
 * unscaled further non-zero values, which would not flush on their own, whose unit would get
 * no gradient without loss scaling (lost only without it). */
void gpu_diag_starved(gpu_diag *d, int layer, int64_t zero, int64_t unscaled);
/* The largest |x| bit pattern of an fp32 value that flushes to 0 in dt once divided by
 * scale (scale 1: plain rounding; 0 for fp32, where nothing flushes). */
uint32_t gpu_diag_flush_bits(gpu_dtype dt, float scale);

/* Reduce the counters of the last collection to statistics, out[i] for layer i (names
 * borrowed from d; lost_updates left 0 for the trainer to fill). */
void gpu_diag_stats(const gpu_diag *d, gpu_layer_stat *out);

/* What the advisor knows beyond the statistics. */
typedef struct {
    gpu_dtype dtype;       /* the job's dtype (of the weights when master weights are off) */
    bool master_weights;   /* an fp32 master copy exists */
    gpu_scale_mode mode;
    float scale;           /* the loss scale the step ran with */
    float next_scale;      /* the scale after the step's update */
    float min_scale, max_scale;
    int floor_streak;      /* consecutive overflowing steps at the floor */
    int floor_patience;
} gpu_diag_context;

#define GPU_DIAG_MAX_RECS 32    /* new recommendations one step can give */
#define GPU_DIAG_MAX_SEEN 1024  /* distinct (kind, layer) pairs remembered per job */

typedef struct {
    char kind[24];
    char layer[48];
    double value;          /* the number the recommendation was last given with */
} gpu_diag_seen;

typedef struct {
    int nseen;
    gpu_diag_seen seen[GPU_DIAG_MAX_SEEN];
    int nnew;
    gpu_recommendation rec[GPU_DIAG_MAX_RECS]; /* point into the arrays below */
    char kind[GPU_DIAG_MAX_RECS][24];
    char layer[GPU_DIAG_MAX_RECS][48];
    char message[GPU_DIAG_MAX_RECS][256];
} gpu_diag_advisor;

/* Replace a's list of new recommendations with those of this step: from the statistics
 * st (d->nlayers entries) when d is not NULL (the step collected), and from the scaler
 * state c always. A recommendation is new when its (kind, layer) was not given before in
 * the job, or its number changed by a factor of two or more since. */
void gpu_diag_advise(gpu_diag_advisor *a, const gpu_diag *d, const gpu_layer_stat *st,
                     const gpu_diag_context *c);
/* One clause on why the scale cannot help, from the first inf/NaN of d (may be NULL),
 * ending in what to do, e.g. "fc2's forward activations reach 1.2e+05, beyond fp16's
 * 65504, which no loss scale can fix: use bf16". */
void gpu_diag_explain(const gpu_diag *d, const gpu_layer_stat *st, const gpu_diag_context *c,
                      char *buf, size_t len);

/* ---- the GPT (gpt.c) ----------------------------------------------------------------------
 *
 * A GPT-2-style pre-LN decoder with tied embeddings: h = wte[x] + wpe[t]; per block
 * h += attn.proj(attention(attn.qkv(ln1(h)))), h += mlp.proj(gelu(mlp.fc(ln2(h))));
 * logits = ln_f(h) wte^T; mean cross-entropy over the B x T next-token targets.
 *
 * Parameters live in one block (layout and a table of named tensors below); activations in
 * one byte block; an fp32 scratch block holds temporaries. Rows are N = B x T tokens, d_model
 * C, H heads of head_dim C/H. The dtypes each op runs in come from the autocast table (see
 * gpt.c for the exact mapping of PyTorch autocast onto the graph); the residual stream is
 * held as fp32 floats whose values are of resid_dt (fp32 by default). */
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
    bool flash;                /* flash attention: asked for and mm_dt 16-bit (else the
                                * attention is materialised) */
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
} gpu_gpt;

/* The parameters the ops read, as for the MLP: the working copy p in pdt, the fp32 master
 * or NULL; an op autocast runs in fp32 reads the master when there is one. */
typedef gpu_mlp_weights gpu_gpt_weights;

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
 * weight and bias gradients and its input gradient before they are rounded. */
int gpu_gpt_backward(const gpu_gpt *m, const gpu_gpt_weights *w, const int *x, const int *y,
                     int B, float seed, const uint8_t *acts, float *scratch, gpu_diag *diag,
                     float *grads);

/* The GPT's ops, exported for the tests (the model is built from them). Arrays are fp32
 * holding values of the dtype named; "dt" is the op's compute dtype: its inputs are values
 * of dt, it computes in fp32 and rounds its outputs (and, backward, its gradients) to dt.
 * All pointers borrowed; outputs may not overlap inputs unless stated. */

/* out[b*T+t] = rd(wte[x] + wpe[t], out_dt) for N = B*T rows of C; wte/wpe in wdt; tmp
 * holds C floats (unused when wdt is fp32). */
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
/* exp(x) in fp32 (within 2 ulp over the whole range, inf/0/NaN as expf), the vectorised
 * kernel the softmaxes and GELU use. */
void gpu_gpt_exp(float *dst, const float *x, size_t n);
/* Causal multi-head attention on qkv [N x 3C] (values of mm_dt): per sequence and head,
 * S = rd(rd(Q K^T, mm_dt) / sqrt(hd), mm_dt); P = rd(softmax(S), sm_dt) over j <= i only
 * (masked positions get exactly 0, no -inf arithmetic); y = rd(rd(P, mm_dt) V, mm_dt),
 * heads merged into y [N x C]. probs [B x H x T x T] saved. scratch holds
 * gpu_gpt_attention_scratch_floats(T) floats. diag (NULL: off) and layer: Q K^T's causal
 * outputs are accounted under that layer (backward: dS arriving, dQ and dK before
 * rounding). */
size_t gpu_gpt_attention_scratch_floats(int T);
int gpu_gpt_attention_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype mm_dt,
                          gpu_dtype sm_dt, float *probs, float *y, float *scratch,
                          gpu_diag *diag, int layer);
/* From dy [N x C] (values of mm_dt): dqkv [N x 3C] written, rounded to mm_dt. */
int gpu_gpt_attention_bwd(const float *dy, const float *qkv, const float *probs, int B, int T,
                          int C, int H, gpu_dtype mm_dt, gpu_dtype sm_dt, float *dqkv,
                          float *scratch, gpu_diag *diag, int layer);
/* Flash attention (model.attention "flash", FlashAttention-2's numerics), same shapes and
 * scratch: per sequence and head, S = rd(Q K^T, fp32) * hd^-1/2 in fp32 (never rounded to
 * mm_dt); P = softmax(S) in fp32 over j <= i; lse[b, h, i] = max_j S + log(sum_j exp(S - max))
 * saved (fp32, B x H x T) instead of P; y = rd(rd(P, mm_dt) V, mm_dt). */
int gpu_gpt_flash_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype mm_dt, float *lse,
                      float *y, float *scratch);
/* Its backward, P = exp(S - lse) recomputed: dV = rd(P) ^T dY; dP = dY V^T in fp32;
 * D_i = dY_i . O_i in fp32 (o: the forward's output as saved, N x C); dS = P (dP - D_i) *
 * hd^-1/2 in fp32, then dQ = rd(dS) K, dK = rd(dS)^T Q; dqkv rounded to mm_dt. diag: dY
 * accounted as the gradient arriving (inf/NaN), dQ and dK as input gradients. */
int gpu_gpt_flash_bwd(const float *dy, const float *qkv, const float *o, const float *lse, int B,
                      int T, int C, int H, gpu_dtype mm_dt, float *dqkv, float *scratch,
                      gpu_diag *diag, int layer);
/* Tied head and cross-entropy: logits = rd(x wte^T, lin_dt) (x: N x C values of lin_dt,
 * wte: V x C in wdt), then cross-entropy in ce_dt: probs (N x V, fp32) saved, *loss_sum the
 * summed loss (double), *correct the argmax hits. logits: N x V fp32 scratch. gscratch
 * holds max(N, V) x C floats (may be NULL when lin_dt and wdt are fp32). */
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

/* ---- the trainer's device twin (cuda_train.c; cuda_none.c without CUDA) ------------------
 *
 * When a job runs on CUDA, train.c keeps its host blocks (initialisation, checkpoints, the
 * tensor table) and drives a twin that holds the same blocks on the device and runs whole
 * steps there. Declared here, free of CUDA types, so that train.c and cuda_none.c build
 * without the CUDA headers; gpu/cuda_model.h holds the device side. */
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
/* One training step on the batch x (MLP: B x features floats; GPT: B x seq_len tokens) with
 * labels or targets y, at learning rate lr, synchronising once at its end. diag (NULL: off)
 * receives the per-layer counters (its layer table is filled in the device's order);
 * stats and tensor_lost (ntensors entries each) the per-tensor gradient statistics and,
 * without master weights, the lost updates; prof (NULL: off) the step's phases, timed with
 * CUDA events (gpu_profile). All pointers borrowed. */
int gpu_cuda_twin_step(gpu_cuda_twin *d, const void *x, const int *y, int B, float lr,
                       gpu_diag *diag, gpu_grad_stat *stats, int64_t *tensor_lost,
                       gpu_cuda_step_out *out, gpu_profile *prof);
/* Forward only over one batch of B rows (an eval batch): *loss_sum the summed loss, *correct
 * the argmax hits. Synchronous. */
int gpu_cuda_twin_eval(gpu_cuda_twin *d, const void *x, const int *y, int B, double *loss_sum,
                       int *correct);
/* Copy the device's master, working copy, m and v into the host blocks and, when grads is
 * not NULL, the gradient block into grads (nparams floats). Synchronous. */
int gpu_cuda_twin_download(gpu_cuda_twin *d, float *grads);
/* Copy the host blocks to the device and rewrite the step state (a restored checkpoint).
 * Synchronous. */
int gpu_cuda_twin_upload(gpu_cuda_twin *d, const gpu_scaler_state *s, int64_t applied,
                         int64_t lost_total);

/* The trainer's fp32 gradient block of the last step (nparams floats, borrowed until the
 * next step), copied from the device first when the job runs on CUDA: for the tests. */
int gpu_trainer_grads(gpu_trainer *t, const float **grads);

#endif /* AMPD_GPU_INT_H */
