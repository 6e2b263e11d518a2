/*
 * cuda_step.cu - the kernels of a training step after backward, driven by a state struct in
 * device memory (gpu_cuda_step_state, see gpu/cuda/cuda_step.h), and their launch functions.
 * The tests' synchronous host-buffer wrappers are in tests/cudahost/step_host.cu.
 *
 * What runs where, all on the caller's stream:
 *   begin      1 thread: scale_used, inv = (float)(1.0 / (double)scale), per-step resets.
 *   unscale    cuda_unscale.cu's fused pass (gpu_cuda_unscale_launch) with the multiplier
 *              read from the state (the host does not know the scale without a sync) and
 *              found_inf and sumsq written into it.
 *   clip       1 thread: grad_norm, clip coefficient (train.c's clip_coef), applied + 1 and
 *              the bias corrections in double (b^t by double-double exponentiation: the
 *              correctly rounded power; glibc's pow is within 0.52 ulp of it, see the header).
 *   optim      grid-stride loops over the parameters; every thread first reads found_inf
 *              and returns when it is set, so a skipped step writes nothing.
 *   lowp       the same per tensor (2-D grid) on 16-bit weights, counting lost updates
 *              with one atomic per block.
 *   scaler     1 thread: gpu_scaler_rule (gpu/scaler_rule.h), the function that
 *              gpu_scaler_update (scaler.c) is on the host.
 *   diag       grid-stride scans over fp32 values with diag.c's bit-pattern thresholds,
 *              block reductions, atomics into per-layer counters; the first layer to hold
 *              inf/NaN by an atomicCAS (kernels of one stream run in call order).
 *
 * Invariants: every fp32 operation of the optimizers is an explicit round-to-nearest
 * intrinsic (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn, and __fmaf_rn where optim.c fuses
 * as PyTorch does; doubles likewise) in gpu/optim.c's order, so nvcc contracts nothing else
 * into FMAs and the results equal the CPU's bit for bit
 * (nvcc's default keeps fp32 subnormals, as the CPU does). The working copy and 16-bit
 * weights are rounded with cuda_common.cuh's conversions, which equal gpu/format.c's.
 *
 * Threads: launch functions only enqueue (gpu_cuda_step_state_init also waits for its copy);
 * the host helpers are pure.
 */
#include <cfloat>
#include <stdlib.h>

#include "gpu/cuda/cuda_common.cuh"
#include "gpu/cuda/cuda_step.h"
#include "gpu/scaler_rule.h"

#define ST_THREADS 256
#define ST_WARPS (ST_THREADS / 32)
#define ST_PER_THREAD 4          /* elements per thread before the grid widens */
#define ST_MAX_BLOCKS 4096u
#define ST_MAX_BLOCKS_Y 65535
#define FULL_MASK 0xFFFFFFFFu

/* ---- small helpers ------------------------------------------------------------------------- */

__device__ static __forceinline__ unsigned long long warp_sum(unsigned long long x)
{
    for (int off = 16; off > 0; off >>= 1)
        x += __shfl_down_sync(FULL_MASK, x, off);
    return x;
}

__device__ static __forceinline__ unsigned warp_max(unsigned x)
{
    for (int off = 16; off > 0; off >>= 1)
        x = max(x, __shfl_down_sync(FULL_MASK, x, off));
    return x;
}

/* Sum of x over the block (all ST_THREADS threads must call it); the result is valid in
 * thread 0. part: ST_WARPS shared slots, free again when the call returns. */
__device__ static unsigned long long block_sum(unsigned long long x, unsigned long long *part)
{
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    x = warp_sum(x);
    if (lane == 0)
        part[warp] = x;
    __syncthreads();
    if (warp == 0) {
        x = lane < ST_WARPS ? part[lane] : 0ull;
        x = warp_sum(x);
    }
    __syncthreads();
    return x;
}

__device__ static __forceinline__ double dev_nan(void)
{
    return __longlong_as_double(0x7FF8000000000000LL);
}

/* hi + lo *= bh + bl in double-double arithmetic (|lo| <= ulp(hi) / 2 after each call). */
__device__ static void dd_mul(double *hi, double *lo, double bh, double bl)
{
    double p = __dmul_rn(*hi, bh);
    double e = __fma_rn(*hi, bh, -p);
    e = __dadd_rn(e, __dadd_rn(__dmul_rn(*hi, bl), __dmul_rn(*lo, bh)));
    double s = __dadd_rn(p, e);
    *lo = __dsub_rn(e, __dsub_rn(s, p));
    *hi = s;
}

/* b^t for t >= 1, 0 <= b < 1: exponentiation by squaring in double-double (relative error
 * about 2^-100), rounded once to double. Results below 2^-54 lose that precision, but then
 * 1 - b^t rounds to 1 whatever they are. */
__device__ static double pow_int(double b, long long t)
{
    double rh = 1.0, rl = 0.0, xh = b, xl = 0.0;
    for (; t > 0; t >>= 1) {
        if (t & 1)
            dd_mul(&rh, &rl, xh, xl);
        if (t > 1)
            dd_mul(&xh, &xl, xh, xl);
    }
    return rh;
}

/* See cuda_step.h. */
extern "C" void gpu_cuda_step_state_make(gpu_cuda_step_state *h, const gpu_scaler_state *s,
                                         int64_t applied, int64_t lost_total)
{
    memset(h, 0, sizeof(*h));
    h->scaler = *s;
    h->scale_used = s->scale;
    h->inv = (float)(1.0 / (double)s->scale);
    h->clip = 1.0f;
    h->bc1 = 1.0;
    h->bc2_sqrt = 1.0f;
    h->applied = (long long)applied;
    h->lost_total = (unsigned long long)lost_total;
}

/* ---- begin, clip, scaler ------------------------------------------------------------------- */

static __global__ void gpu_k_step_begin(gpu_cuda_step_state *st)
{
    float scale = st->scaler.scale;
    st->scale_used = scale;
    st->inv = __double2float_rn(__ddiv_rn(1.0, (double)scale));
    st->found_inf = 0;
    st->floor_failed = 0;
    st->sumsq = 0.0;
    st->grad_norm = 0.0;
    st->clip = 1.0f;
    st->lost_step = 0ull;
}

static __global__ void gpu_k_step_clip(gpu_cuda_step_state *st, float grad_clip, double b1,
                                       double b2)
{
    bool found = st->found_inf != 0;
    double norm = found ? dev_nan() : __dsqrt_rn(st->sumsq);
    float clip = 1.0f;

    st->grad_norm = norm;
    if (grad_clip > 0.0f && norm > (double)grad_clip)
        clip = __double2float_rn(__ddiv_rn((double)grad_clip, __dadd_rn(norm, 1e-6)));
    st->clip = clip;
    if (found)
        return;
    long long t = ++st->applied;
    if (t < 1)
        t = 1;
    st->bc1 = __dsub_rn(1.0, pow_int(b1, t));
    st->bc2_sqrt = __double2float_rn(__dsqrt_rn(__dsub_rn(1.0, pow_int(b2, t))));
}

/* gpu_scaler_update on the device: the same function (gpu/scaler_rule.h). */
static __global__ void gpu_k_scaler_update(gpu_cuda_step_state *st, gpu_scaler_config c)
{
    st->floor_failed = gpu_scaler_rule(&st->scaler, &c, st->found_inf != 0) != 0;
}

/* ---- optimizers ---------------------------------------------------------------------------- */

/* How the working copy / weights are stored. */
enum { WK_NONE = 0, WK_F32, WK_F16, WK_BF16 };

/* The step-independent constants, formed on the host as in optim.c's consts_init. */
typedef struct {
    double lr, wd;            /* for the per-step constants */
    float b1, b2, omb1, omb2, eps, wd_f, neg_lr, momentum;
    int have_buf;     /* SGD: a momentum buffer was given */
} opt_args;

/* The per-step constants (consts_init), formed by every thread from the args and the state. */
typedef struct {
    float gmul, b1, b2, omb1, omb2, eps, decay, neg_step, bc2_sqrt, wd, neg_lr, momentum;
    int sgd_mode;     /* 0: no buffer; 1: first step, buf = d; 2: buf = mom * buf + d */
} opt_k;

static opt_args opt_args_make(const gpu_optim_config *c, double lr, bool have_buf)
{
    opt_args a;
    a.lr = lr;
    a.wd = c->weight_decay;
    a.b1 = (float)c->beta1;
    a.b2 = (float)c->beta2;
    a.omb1 = (float)(1.0 - c->beta1);
    a.omb2 = (float)(1.0 - c->beta2);
    a.eps = (float)c->eps;
    a.wd_f = (float)c->weight_decay;
    a.neg_lr = (float)-lr;
    a.momentum = (float)c->momentum;
    a.have_buf = have_buf;
    return a;
}

__device__ static opt_k opt_consts(const opt_args &a, const gpu_cuda_step_state *st)
{
    opt_k k;
    long long t = st->applied < 1 ? 1 : st->applied;
    k.gmul = st->clip;
    k.b1 = a.b1;
    k.b2 = a.b2;
    k.omb1 = a.omb1;
    k.omb2 = a.omb2;
    k.eps = a.eps;
    k.decay = __double2float_rn(__dsub_rn(1.0, __dmul_rn(a.lr, a.wd)));
    k.neg_step = __double2float_rn(-__ddiv_rn(a.lr, st->bc1));
    k.bc2_sqrt = st->bc2_sqrt;
    k.wd = a.wd_f;
    k.neg_lr = a.neg_lr;
    k.momentum = a.momentum;
    k.sgd_mode = (a.momentum == 0.0f || !a.have_buf) ? 0 : (t == 1 ? 1 : 2);
    return k;
}

/* One AdamW element (optim.c's adamw_chunk): returns the new p, updates *m and *v. */
__device__ static __forceinline__ float adamw_one(const opt_k &k, float p, float g, float *m,
                                                  float *v)
{
    float gi = __fmul_rn(g, k.gmul);
    float mi = __fmaf_rn(gi, k.omb1, __fmul_rn(*m, k.b1));
    float vi = __fmaf_rn(__fmul_rn(k.omb2, gi), gi, __fmul_rn(*v, k.b2));
    *m = mi;
    *v = vi;
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
    return __fadd_rn(__fmul_rn(p, k.decay), __fdiv_rn(__fmul_rn(k.neg_step, mi), denom));
}

/* One SGD element (optim.c's sgd_chunk); buf is NULL in mode 0. */
__device__ static __forceinline__ float sgd_one(const opt_k &k, float p, float g, float *buf)
{
    float d = __fmul_rn(g, k.gmul);
    if (k.wd != 0.0f)
        d = __fmaf_rn(p, k.wd, d);
    if (k.sgd_mode == 1) {
        *buf = d;
    } else if (k.sgd_mode == 2) {
        d = __fadd_rn(__fmul_rn(*buf, k.momentum), d);
        *buf = d;
    }
    return __fmaf_rn(d, k.neg_lr, p);
}

template <int SGD>
__device__ static __forceinline__ float opt_one(const opt_k &k, float p, const float *g,
                                                float *m, float *v, size_t i)
{
    if (SGD)
        return sgd_one(k, p, g[i], k.sgd_mode != 0 ? m + i : NULL);
    return adamw_one(k, p, g[i], m + i, v + i);
}

template <int WK>
__device__ static __forceinline__ void store_work(void *work, size_t i, float x)
{
    if constexpr (WK == WK_F32)
        ((float *)work)[i] = x;
    else if constexpr (WK == WK_F16)
        ((uint16_t *)work)[i] = gpu_fmt_f32_to_f16(__float_as_uint(x));
    else if constexpr (WK == WK_BF16)
        ((uint16_t *)work)[i] = gpu_fmt_f32_to_bf16(__float_as_uint(x));
}

template <int SGD, int WK>
static __global__ void __launch_bounds__(ST_THREADS)
gpu_k_optim(opt_args a, const gpu_cuda_step_state *st, float *p, const float *g, float *m,
            float *v, size_t n, void *work)
{
    if (st->found_inf)
        return;
    const opt_k k = opt_consts(a, st);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float pi = opt_one<SGD>(k, p[i], g, m, v, i);
        p[i] = pi;
        store_work<WK>(work, i, pi);
    }
}

/* gpu_optim_update_lowp on tensor blockIdx.y (strided): the weights are widened, updated
 * in fp32 and rounded back; an element whose fp32 value changed but whose stored value did
 * not is a lost update. */
template <int SGD, int WK>
static __global__ void __launch_bounds__(ST_THREADS)
gpu_k_optim_lowp(opt_args a, gpu_cuda_step_state *st, void *w, const float *g, float *m,
                 float *v, const size_t *offsets, const size_t *counts, int ntensors,
                 unsigned long long *tensor_lost)
{
    __shared__ unsigned long long part[ST_WARPS];
    if (st->found_inf)      /* the same for every thread: no barrier is skipped by some */
        return;
    bool mine = false;      /* whether any of this block's tensors reaches its elements */
    for (int t = blockIdx.y; t < ntensors && !mine; t += gridDim.y)
        mine = (size_t)blockIdx.x * blockDim.x < counts[t];
    if (!mine)              /* block-uniform too */
        return;
    const opt_k k = opt_consts(a, st);
    const size_t stride = (size_t)gridDim.x * blockDim.x;

    for (int t = blockIdx.y; t < ntensors; t += gridDim.y) {
        const size_t off = offsets[t], n = counts[t];
        if ((size_t)blockIdx.x * blockDim.x >= n)
            continue;   /* none of t's elements is this block's: skipped by all its threads */
        unsigned long long lost = 0;
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
            size_t j = off + i;
            if constexpr (WK == WK_F32) {
                float *wf = (float *)w;
                wf[j] = opt_one<SGD>(k, wf[j], g, m, v, j);
            } else {
                uint16_t *w16 = (uint16_t *)w;
                uint16_t old16 = w16[j];
                float old = __uint_as_float(WK == WK_F16 ? gpu_fmt_f16_to_f32(old16)
                                                         : gpu_fmt_bf16_to_f32(old16));
                float cur = opt_one<SGD>(k, old, g, m, v, j);
                uint16_t out = WK == WK_F16 ? gpu_fmt_f32_to_f16(__float_as_uint(cur))
                                            : gpu_fmt_f32_to_bf16(__float_as_uint(cur));
                lost += (cur != old) & (out == old16);
                w16[j] = out;
            }
        }
        if constexpr (WK == WK_F32)
            continue;   /* fp32 weights lose no update: nothing to count */
        lost = block_sum(lost, part);
        if (threadIdx.x == 0 && lost != 0) {
            atomicAdd(&st->lost_step, lost);
            atomicAdd(&st->lost_total, lost);
            if (tensor_lost != NULL)
                atomicAdd(&tensor_lost[t], lost);
        }
    }
}

static int wk_of(gpu_dtype wdt, bool have_work)
{
    if (!have_work)
        return WK_NONE;
    switch (wdt) {
    case GPU_FP32:
        return WK_F32;
    case GPU_FP16:
        return WK_F16;
    case GPU_BF16:
        return WK_BF16;
    }
    return -1;
}

template <int SGD>
static void optim_dispatch(int wk, dim3 grid, cudaStream_t stream, const opt_args &a,
                           const gpu_cuda_step_state *st, float *p, const float *g, float *m,
                           float *v, size_t n, void *work)
{
    switch (wk) {
    case WK_NONE:
        gpu_k_optim<SGD, WK_NONE><<<grid, ST_THREADS, 0, stream>>>(a, st, p, g, m, v, n, work);
        break;
    case WK_F32:
        gpu_k_optim<SGD, WK_F32><<<grid, ST_THREADS, 0, stream>>>(a, st, p, g, m, v, n, work);
        break;
    case WK_F16:
        gpu_k_optim<SGD, WK_F16><<<grid, ST_THREADS, 0, stream>>>(a, st, p, g, m, v, n, work);
        break;
    default:
        gpu_k_optim<SGD, WK_BF16><<<grid, ST_THREADS, 0, stream>>>(a, st, p, g, m, v, n, work);
        break;
    }
}

template <int SGD>
static void lowp_dispatch(int wk, dim3 grid, cudaStream_t stream, const opt_args &a,
                          gpu_cuda_step_state *st, void *w, const float *g, float *m, float *v,
                          const size_t *off, const size_t *cnt, int nt,
                          unsigned long long *tlost)
{
    switch (wk) {
    case WK_F32:
        gpu_k_optim_lowp<SGD, WK_F32><<<grid, ST_THREADS, 0, stream>>>(a, st, w, g, m, v, off,
                                                                      cnt, nt, tlost);
        break;
    case WK_F16:
        gpu_k_optim_lowp<SGD, WK_F16><<<grid, ST_THREADS, 0, stream>>>(a, st, w, g, m, v, off,
                                                                      cnt, nt, tlost);
        break;
    default:
        gpu_k_optim_lowp<SGD, WK_BF16><<<grid, ST_THREADS, 0, stream>>>(a, st, w, g, m, v, off,
                                                                       cnt, nt, tlost);
        break;
    }
}

/* ---- diagnostics --------------------------------------------------------------------------- */

/* diag.c's thresholds: |x| bit patterns from which rounding to dt overflows, and the largest
 * that rounds to 0 (0: nothing flushes). */
static unsigned dg_overflow_bits(gpu_dtype dt)
{
    return dt == GPU_FP16 ? 0x477FF000u : dt == GPU_BF16 ? 0x7F7F8000u : 0x7F800000u;
}

__host__ __device__ static unsigned dg_flush_bits(gpu_dtype dt)
{
    return dt == GPU_FP16 ? 0x33000000u : dt == GPU_BF16 ? 0x00008000u : 0u;
}

/* diag.c's flush_bits_scaled: the largest |g| pattern with |g| / scale <= the dtype's
 * flush threshold, decided in double; the same IEEE operations in the same order. */
__device__ static unsigned dg_flush_scaled(gpu_dtype dt, float scale)
{
    unsigned fb = dg_flush_bits(dt);
    if (fb == 0 || !(scale > 0.0f) || !isfinite(scale))
        return 0;
    double h = (double)__uint_as_float(fb), s = (double)scale;
    float t = __double2float_rn(__dmul_rn(h, s));
    if (!isfinite(t))
        t = FLT_MAX;
    /* t >= 0 here: the neighbours of a non-negative float are its pattern -1 / +1 */
    while (t > 0.0f && __ddiv_rn((double)t, s) > h)
        t = __uint_as_float(__float_as_uint(t) - 1u);
    while (t < FLT_MAX && __ddiv_rn((double)__uint_as_float(__float_as_uint(t) + 1u), s) <= h)
        t = __uint_as_float(__float_as_uint(t) + 1u);
    return __float_as_uint(t);
}

static __global__ void gpu_k_diag_begin(gpu_cuda_diag *d, const gpu_cuda_step_state *st)
{
    float scale = st->scaler.scale;
    d->scale = scale;
    d->flush_scaled[GPU_FP32] = 0u;
    d->flush_scaled[GPU_FP16] = dg_flush_scaled(GPU_FP16, scale);
    d->flush_scaled[GPU_BF16] = dg_flush_scaled(GPU_BF16, scale);
    d->first = -1;
}

typedef struct {
    unsigned amax;
    unsigned long long nonzero, flushed, flushed_scaled, nonfinite;
} dg_acc;

__device__ static __forceinline__ void dg_add(unsigned long long *dst, unsigned long long x)
{
    if (x != 0)
        atomicAdd(dst, x);
}

__device__ static __forceinline__ void dg_max(unsigned *dst, unsigned x)
{
    if (x != 0)
        atomicMax(dst, x);
}

/* Account x[0..n) (fp32 bit patterns) as `kind` for layer: ovf, fl from dt (host), the
 * flush threshold at the loss scale from the header. */
static __global__ void __launch_bounds__(ST_THREADS)
gpu_k_diag(gpu_cuda_diag *d, int layer, int kind, gpu_dtype dt, unsigned ovf, unsigned fl,
           const unsigned *x, size_t n)
{
    __shared__ unsigned long long part[ST_WARPS];
    __shared__ unsigned part_max[ST_WARPS];
    const bool grad = kind == GPU_CUDA_DIAG_WEIGHT_GRAD || kind == GPU_CUDA_DIAG_INPUT_GRAD;
    const unsigned ufl = grad ? d->flush_scaled[dt] : 0u;
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    dg_acc a = {0u, 0ull, 0ull, 0ull, 0ull};

    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned v = x[i] & 0x7FFFFFFFu, vm1 = v - 1u;
        a.amax = max(a.amax, v < 0x7F800000u ? v : 0u);
        a.nonzero += v != 0u;
        a.flushed += vm1 < fl;
        a.flushed_scaled += vm1 < ufl;
        a.nonfinite += v >= ovf;
    }
    a.amax = warp_max(a.amax);
    if (lane == 0)
        part_max[warp] = a.amax;
    a.nonzero = block_sum(a.nonzero, part);     /* its barriers also publish part_max */
    a.flushed = block_sum(a.flushed, part);
    a.flushed_scaled = block_sum(a.flushed_scaled, part);
    a.nonfinite = block_sum(a.nonfinite, part);
    if (threadIdx.x != 0)
        return;
    for (int w = 0; w < ST_WARPS; w++)
        a.amax = max(a.amax, part_max[w]);

    gpu_cuda_diag_layer *l = &d->layer[layer];
    const unsigned long long cnt = blockIdx.x == 0 ? (unsigned long long)n : 0ull;
    switch (kind) {
    case GPU_CUDA_DIAG_FORWARD:
        dg_max(&l->act_amax, a.amax);
        dg_add(&l->act_overflow, a.nonfinite);
        dg_add(&l->act_n, cnt);
        break;
    case GPU_CUDA_DIAG_WEIGHT_GRAD:
        dg_max(&l->grad_amax, a.amax);
        dg_add(&l->grad_nonzero, a.nonzero);
        dg_add(&l->grad_flushed, a.flushed);
        dg_add(&l->grad_flushed_unscaled, a.flushed_scaled);
        dg_add(&l->grad_nonfinite, a.nonfinite);
        dg_add(&l->grad_n, cnt);
        break;
    case GPU_CUDA_DIAG_INPUT_GRAD:
        dg_add(&l->in_nonzero, a.nonzero);
        dg_add(&l->in_flushed, a.flushed);
        dg_add(&l->in_flushed_unscaled, a.flushed_scaled);
        dg_add(&l->in_nonfinite, a.nonfinite);
        dg_add(&l->in_n, cnt);
        break;
    default:
        dg_add(&l->out_nonfinite, a.nonfinite);
        break;
    }
    if (a.nonfinite != 0)
        atomicCAS(&d->first, -1, 2 * layer + (kind == GPU_CUDA_DIAG_FORWARD ? 1 : 0));
}

/* ---- launch functions (device pointers borrowed; enqueued on stream, no host sync) ------ */

/* See cuda_step.h. s borrowed; the source is staged before the call returns. */
extern "C" int gpu_cuda_step_state_init(gpu_cuda_step_state *d_state,
                                        const gpu_scaler_state *s, int64_t applied,
                                        int64_t lost_total, cudaStream_t stream)
{
    gpu_cuda_step_state h;
    if (d_state == NULL || s == NULL)
        return GPU_EINVAL;
    gpu_cuda_step_state_make(&h, s, applied, lost_total);
    GPU_CUDA_CHECK(cudaMemcpyAsync(d_state, &h, sizeof(h), cudaMemcpyHostToDevice, stream));
    /* h is on this stack: the copy must have read it before the function returns (an async
     * copy from pageable memory is not promised to stage it first) */
    GPU_CUDA_CHECK(cudaStreamSynchronize(stream));
    return 0;
}

extern "C" int gpu_cuda_step_begin_launch(gpu_cuda_step_state *d_state, cudaStream_t stream)
{
    if (d_state == NULL)
        return GPU_EINVAL;
    gpu_k_step_begin<<<1, 1, 0, stream>>>(d_state);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* Grid of a per-tensor pass: x covers the largest tensor, y the tensors. */
static dim3 tensor_grid(size_t max_count, int ntensors)
{
    return dim3(gpu_cuda_blocks(max_count, ST_THREADS * ST_PER_THREAD, ST_MAX_BLOCKS),
                ntensors < ST_MAX_BLOCKS_Y ? ntensors : ST_MAX_BLOCKS_Y);
}

extern "C" int gpu_cuda_step_unscale_launch(float *d_g, const size_t *d_offsets,
                                            const size_t *d_counts, int ntensors,
                                            size_t max_count, gpu_cuda_step_tstat *d_stats,
                                            gpu_cuda_step_state *d_state, double *d_parts,
                                            cudaStream_t stream)
{
    if (d_state == NULL || ntensors < 0 ||
        (ntensors > 0 && (d_g == NULL || d_offsets == NULL || d_counts == NULL ||
                          d_stats == NULL || d_parts == NULL)))
        return GPU_EINVAL;
    return gpu_cuda_unscale_launch(d_g, d_offsets, d_counts, ntensors, max_count, &d_state->inv,
                                   d_stats, &d_state->found_inf, &d_state->sumsq, d_parts,
                                   stream);
}

/* c borrowed. */
extern "C" int gpu_cuda_step_clip_launch(gpu_cuda_step_state *d_state,
                                         const gpu_optim_config *c, cudaStream_t stream)
{
    if (d_state == NULL || c == NULL)
        return GPU_EINVAL;
    gpu_k_step_clip<<<1, 1, 0, stream>>>(d_state, c->grad_clip, c->beta1, c->beta2);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* c borrowed. */
extern "C" int gpu_cuda_optim_launch(const gpu_optim_config *c, double lr,
                                     const gpu_cuda_step_state *d_state, float *d_p,
                                     const float *d_g, float *d_m, float *d_v, size_t n,
                                     void *d_work, gpu_dtype wdt, cudaStream_t stream)
{
    bool sgd = c != NULL && c->type == GPU_OPT_SGD;
    int wk = wk_of(wdt, d_work != NULL);

    if (c == NULL || d_state == NULL || wk < 0)
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if (d_p == NULL || d_g == NULL || (!sgd && (d_m == NULL || d_v == NULL)))
        return GPU_EINVAL;
    opt_args a = opt_args_make(c, lr, d_m != NULL);
    dim3 grid(gpu_cuda_blocks(n, ST_THREADS * ST_PER_THREAD, ST_MAX_BLOCKS));
    if (sgd)
        optim_dispatch<1>(wk, grid, stream, a, d_state, d_p, d_g, d_m, d_v, n, d_work);
    else
        optim_dispatch<0>(wk, grid, stream, a, d_state, d_p, d_g, d_m, d_v, n, d_work);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* c borrowed. */
extern "C" int gpu_cuda_optim_lowp_launch(const gpu_optim_config *c, double lr,
                                          gpu_cuda_step_state *d_state, void *d_w,
                                          gpu_dtype wdt, const float *d_g, float *d_m,
                                          float *d_v, const size_t *d_offsets,
                                          const size_t *d_counts, int ntensors,
                                          size_t max_count, unsigned long long *d_tensor_lost,
                                          cudaStream_t stream)
{
    bool sgd = c != NULL && c->type == GPU_OPT_SGD;
    int wk = wk_of(wdt, true);

    if (c == NULL || d_state == NULL || wk < 0 || ntensors < 0)
        return GPU_EINVAL;
    if (ntensors == 0)
        return 0;
    if (d_w == NULL || d_g == NULL || d_offsets == NULL || d_counts == NULL ||
        (!sgd && (d_m == NULL || d_v == NULL)))
        return GPU_EINVAL;
    if (d_tensor_lost != NULL)
        GPU_CUDA_CHECK(cudaMemsetAsync(d_tensor_lost, 0,
                                       (size_t)ntensors * sizeof(*d_tensor_lost), stream));
    opt_args a = opt_args_make(c, lr, d_m != NULL);
    dim3 grid = tensor_grid(max_count, ntensors);
    if (sgd)
        lowp_dispatch<1>(wk, grid, stream, a, d_state, d_w, d_g, d_m, d_v, d_offsets, d_counts,
                         ntensors, d_tensor_lost);
    else
        lowp_dispatch<0>(wk, grid, stream, a, d_state, d_w, d_g, d_m, d_v, d_offsets, d_counts,
                         ntensors, d_tensor_lost);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* c borrowed. */
extern "C" int gpu_cuda_scaler_update_launch(gpu_cuda_step_state *d_state,
                                             const gpu_scaler_config *c, cudaStream_t stream)
{
    if (d_state == NULL || c == NULL)
        return GPU_EINVAL;
    gpu_k_scaler_update<<<1, 1, 0, stream>>>(d_state, *c);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* Host buffers borrowed; they must stay valid until the stream has passed this point. */
extern "C" int gpu_cuda_step_snapshot(const gpu_cuda_step_state *d_state,
                                      gpu_cuda_step_state *h_state,
                                      const gpu_cuda_step_tstat *d_stats,
                                      gpu_cuda_step_tstat *h_stats, int ntensors,
                                      cudaStream_t stream)
{
    if (d_state == NULL || h_state == NULL || (d_stats != NULL && h_stats == NULL))
        return GPU_EINVAL;
    GPU_CUDA_CHECK(cudaMemcpyAsync(h_state, d_state, sizeof(*h_state), cudaMemcpyDeviceToHost,
                                   stream));
    if (d_stats != NULL && ntensors > 0)
        GPU_CUDA_CHECK(cudaMemcpyAsync(h_stats, d_stats, (size_t)ntensors * sizeof(*h_stats),
                                       cudaMemcpyDeviceToHost, stream));
    return 0;
}

extern "C" int gpu_cuda_diag_begin_launch(gpu_cuda_diag *d_diag,
                                          const gpu_cuda_step_state *d_state,
                                          cudaStream_t stream)
{
    if (d_diag == NULL || d_state == NULL)
        return GPU_EINVAL;
    GPU_CUDA_CHECK(cudaMemsetAsync(d_diag, 0, sizeof(*d_diag), stream));
    gpu_k_diag_begin<<<1, 1, 0, stream>>>(d_diag, d_state);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

extern "C" int gpu_cuda_diag_launch(gpu_cuda_diag *d_diag, int layer, gpu_dtype dt,
                                    gpu_cuda_diag_kind kind, const float *d_x, size_t n,
                                    cudaStream_t stream)
{
    if (d_diag == NULL || (dt != GPU_FP32 && dt != GPU_FP16 && dt != GPU_BF16) ||
        (kind != GPU_CUDA_DIAG_FORWARD && kind != GPU_CUDA_DIAG_WEIGHT_GRAD &&
         kind != GPU_CUDA_DIAG_INPUT_GRAD && kind != GPU_CUDA_DIAG_BACKWARD))
        return GPU_EINVAL;
    if (layer < 0 || layer >= GPU_CUDA_DIAG_MAX_LAYERS || n == 0)
        return 0;
    if (d_x == NULL)
        return GPU_EINVAL;
    bool back = kind == GPU_CUDA_DIAG_BACKWARD;
    unsigned ovf = back ? 0x7F800000u : dg_overflow_bits(dt);
    unsigned fl = kind == GPU_CUDA_DIAG_WEIGHT_GRAD || kind == GPU_CUDA_DIAG_INPUT_GRAD
                      ? dg_flush_bits(dt)
                      : 0u;
    unsigned blocks = gpu_cuda_blocks(n, ST_THREADS * ST_PER_THREAD, ST_MAX_BLOCKS);
    gpu_k_diag<<<blocks, ST_THREADS, 0, stream>>>(d_diag, layer, (int)kind, dt, ovf, fl,
                                                  (const unsigned *)(const void *)d_x, n);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* Bytes of a gpu_cuda_diag holding its header and nlayers layers. */
static size_t diag_bytes(int nlayers)
{
    if (nlayers < 0)
        nlayers = 0;
    if (nlayers > GPU_CUDA_DIAG_MAX_LAYERS)
        nlayers = GPU_CUDA_DIAG_MAX_LAYERS;
    return offsetof(gpu_cuda_diag, layer) + (size_t)nlayers * sizeof(gpu_cuda_diag_layer);
}

extern "C" int gpu_cuda_diag_snapshot(const gpu_cuda_diag *d_diag, gpu_cuda_diag *h_diag,
                                      int nlayers, cudaStream_t stream)
{
    if (d_diag == NULL || h_diag == NULL)
        return GPU_EINVAL;
    GPU_CUDA_CHECK(cudaMemcpyAsync(h_diag, d_diag, diag_bytes(nlayers), cudaMemcpyDeviceToHost,
                                   stream));
    return 0;
}

/* ---- host helpers -------------------------------------------------------------------------- */

static float bits_to_float(unsigned int u)
{
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

/* Pointers borrowed. */
extern "C" void gpu_cuda_step_stats_export(const gpu_cuda_step_tstat *src, int n,
                                           gpu_grad_stat *dst)
{
    for (int t = 0; t < n; t++) {
        dst[t].amax = bits_to_float(src[t].amax);
        dst[t].amax_scaled = bits_to_float(src[t].amax_scaled);
        dst[t].nonfinite = (int64_t)src[t].nonfinite;
        dst[t].zeros = (int64_t)src[t].zeros;
    }
}
