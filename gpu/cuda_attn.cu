/*
 * cuda_attn.cu - the GPT's flash attention on tensor cores (FlashAttention-2): the causal
 * softmax(Q K^T / sqrt(hd)) V of every (sequence, head) without the B x H x T x T score or
 * probability matrices in memory, forward and backward. Declared in gpu/cuda_ops.h.
 *
 * Numerics (gpu_gpt_flash_fwd/bwd in gpu/gpt.c are the reference): Q, K, V, dY are 16-bit
 * (fp16 or bf16) values; the products run on tensor cores (WMMA 16x16x16, fp32
 * accumulation); the scores S = (Q K^T) * scale, the softmax, its statistics and dS stay in
 * fp32, and only P (for P V and dV) and dS (for dQ and dK) are rounded to 16 bits, as the
 * CPU rounds them. Forward: the online softmax, one pass over the key tiles with a running
 * row max m and sum l; P~ = exp(S - m_running) is rounded (the CPU rounds the normalised P,
 * so the two differ by 16-bit rounding, not more); y = acc / l; lse = m + log(l) saved.
 * Backward: D_i = dY_i . O_i, then P = exp(S - lse) recomputed exactly as normalised;
 * dV = rd(P)^T dY, dP = dY V^T (fp32), dS = (P (dP - D)) * scale, dK = rd(dS)^T Q in one
 * kernel (a block per key tile, looping over query tiles) and dQ = rd(dS) K in another (a
 * block per query tile, looping over key tiles): no atomics, so every run gives the same
 * bits. dQ, dK and dV are written in fp32 (not rounded) into dqkv [N x 3C].
 *
 * Tiles: 64 query rows per block (4 warps x 16), 64 keys per tile; a lane owns half a row
 * (32 columns) of its warp's 16 x 64 score tile and, forward, half of its output row. The
 * 16 x 64 products go through a per-warp fp32 tile in shared memory. head_dim (HD) is a
 * template parameter: 16, 32, 48 or 64; shared memory stays within the static 48 KiB.
 * Rows at or beyond T are read as zeros and never written.
 *
 * Alignment: the 16-byte loads need qkv and dy 16-byte aligned with C a multiple of 8 (it
 * is: HD is a multiple of 16); WMMA's shared-memory operands are 32-byte aligned.
 *
 * Threads: launches only enqueue on the stream given; kernels synchronise their warps with
 * __syncwarp between a lane's writes to a warp's tile and other lanes' reads of it.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include "gpu/cuda_common.cuh"
#include "gpu/cuda_ops.h"

using namespace nvcuda;

#define FA_TILE 64                   /* query rows per block; keys per tile */
#define FA_WARPS 4                   /* each warp: 16 query (or key) rows */
#define FA_THREADS (32 * FA_WARPS)
#define FA_FULL 0xFFFFFFFFu
#ifdef __CUDACC__
#define FA_UNROLL _Pragma("unroll") /* the lanes' 32-entry rows stay in registers */
#else
#define FA_UNROLL
#endif

/* Everything a flash kernel reads: device pointers, sizes, the scale. */
typedef struct {
    const uint16_t *qkv;   /* [B T x 3C] 16-bit */
    const uint16_t *dy;    /* [B T x C] 16-bit (backward) */
    const void *o;         /* [B T x C] in odt: the forward's output as saved (backward) */
    gpu_dtype odt;
    float *lse;            /* [B H x T] */
    float *dsum;           /* [B H x T]: D (backward) */
    float *dqkv;           /* [B T x 3C] fp32 (backward) */
    void *y;               /* [B T x C]: 16-bit, or fp32 values of the 16-bit dtype (y32) */
    bool y32;
    int B, T, H;
    float scale;
} fa_args;

template <typename E>
using frag_a = wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major>;
template <typename E>
using frag_bt = wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major>;
template <typename E>
using frag_b = wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::row_major>;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag_c;

/* fp32 to the 16-bit dtype's bits (round to nearest even), and back. */
template <typename E>
__device__ static __forceinline__ uint16_t fa_bits(float x);
template <>
__device__ __forceinline__ uint16_t fa_bits<__half>(float x)
{
    return gpu_dev_f32_to_f16(gpu_dev_f2u(x));
}
template <>
__device__ __forceinline__ uint16_t fa_bits<__nv_bfloat16>(float x)
{
    return gpu_dev_f32_to_bf16(gpu_dev_f2u(x));
}
template <typename E>
__device__ static __forceinline__ float fa_value(uint16_t h);
template <>
__device__ __forceinline__ float fa_value<__half>(uint16_t h)
{
    return gpu_dev_u2f(gpu_dev_f16_to_f32(h));
}
template <>
__device__ __forceinline__ float fa_value<__nv_bfloat16>(uint16_t h)
{
    return gpu_dev_u2f(gpu_dev_bf16_to_f32(h));
}

struct alignas(16) fa_chunk {
    unsigned w[4];
};

/* A block's shared memory: two 64 x HD tiles (K and V, Q and dY), and each warp's fp32
 * 16 x 64 product and 16-bit 16 x 64 operand (P or dS). 40 KiB at HD 64. */
template <int HD>
struct fa_smem {
    alignas(32) uint16_t t0[FA_TILE * HD];
    alignas(32) uint16_t t1[FA_TILE * HD];
    alignas(32) float s[FA_WARPS][16 * FA_TILE];
    alignas(32) uint16_t p[FA_WARPS][16 * FA_TILE];
};

/* Where a thread works: its warp, the row r of the warp's 16-row tiles it owns and the half
 * h of that row; its (sequence, head) and the sequence's qkv and dy rows. */
typedef struct {
    int warp, r, h, bh, C, hoff;
    size_t ld;
    const uint16_t *qkv, *dy;
} fa_pos;

__device__ static fa_pos fa_where(const fa_args &a, int HD)
{
    fa_pos p;
    int lane = threadIdx.x % 32, b = blockIdx.y / a.H;
    p.warp = threadIdx.x / 32;
    p.r = lane / 2;
    p.h = lane % 2;
    p.bh = blockIdx.y;
    p.C = a.H * HD;
    p.hoff = blockIdx.y % a.H * HD;
    p.ld = 3 * (size_t)p.C;
    p.qkv = a.qkv + (size_t)b * a.T * p.ld;
    p.dy = a.dy != NULL ? a.dy + (size_t)b * a.T * p.C : NULL;
    return p;
}

/* s[64 x HD] = rows [r0, r0 + 64) of a 16-bit matrix g (row stride ld), columns
 * [col, col + HD); rows at or beyond `rows` are zeros. All threads of the block. */
template <int HD>
__device__ static void fa_load(uint16_t *s, const uint16_t *g, int r0, int rows, size_t ld,
                               int col)
{
    const int per_row = HD / 8;
    for (int i = threadIdx.x; i < FA_TILE * per_row; i += FA_THREADS) {
        int r = i / per_row, c = i % per_row * 8;
        fa_chunk v = {{0u, 0u, 0u, 0u}};
        if (r0 + r < rows)
            v = *(const fa_chunk *)(g + (size_t)(r0 + r) * ld + col + c);
        *(fa_chunk *)(s + r * HD + c) = v;
    }
}

/* out[16 x 64] (fp32, row stride FA_TILE) = A B^T: A the warp's 16 x HD fragments, B the
 * 64 x HD tile sb (row-major). The warp together. */
template <typename E, int HD>
__device__ static void fa_abt(float *out, const frag_a<E> *a, const uint16_t *sb)
{
    for (int j = 0; j < FA_TILE / 16; j++) {
        frag_c acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int k = 0; k < HD / 16; k++) {
            frag_bt<E> b;
            wmma::load_matrix_sync(b, (const E *)sb + j * 16 * HD + k * 16, HD);
            wmma::mma_sync(acc, a[k], b, acc);
        }
        wmma::store_matrix_sync(out + j * 16, acc, FA_TILE, wmma::mem_row_major);
    }
}

/* acc[HD / 16] += P B: P the warp's 16 x 64 tile p (16-bit, row stride FA_TILE), B the
 * 64 x HD tile sb (row-major). The warp together. */
template <typename E, int HD>
__device__ static void fa_pb(frag_c *acc, const uint16_t *p, const uint16_t *sb)
{
    for (int k = 0; k < FA_TILE / 16; k++) {
        frag_a<E> a;
        wmma::load_matrix_sync(a, (const E *)p + k * 16, FA_TILE);
        for (int d = 0; d < HD / 16; d++) {
            frag_b<E> b;
            wmma::load_matrix_sync(b, (const E *)sb + k * 16 * HD + d * 16, HD);
            wmma::mma_sync(acc[d], a, b, acc[d]);
        }
    }
}

/* Write the warp's 16 x HD accumulators as fp32 rows [row0, row0 + 16) of dqkv at column col,
 * through its tile t; rows at or beyond T skipped. */
template <int HD>
__device__ static void fa_store_rows(const frag_c *acc, float *t, const fa_args &a,
                                     const fa_pos &p, int row0, int col)
{
    __syncwarp();
    for (int d = 0; d < HD / 16; d++)
        wmma::store_matrix_sync(t + d * 16, acc[d], FA_TILE, wmma::mem_row_major);
    __syncwarp();
    if (row0 + p.r < a.T) {
        float *dst = a.dqkv + ((size_t)(p.bh / a.H) * a.T + row0 + p.r) * p.ld + col;
        FA_UNROLL
        for (int c = 0; c < HD / 2; c++)
            dst[p.h * (HD / 2) + c] = t[p.r * FA_TILE + p.h * (HD / 2) + c];
    }
}

/* Stage a 64-row tile of the sequence (rows r0.., columns col..) in t and load the warp's 16
 * rows of it as A fragments; the block together. */
template <typename E, int HD>
__device__ static void fa_stage(frag_a<E> *f, uint16_t *t, const uint16_t *g, int r0, int rows,
                                size_t ld, int col, int warp)
{
    fa_load<HD>(t, g, r0, rows, ld, col);
    __syncthreads();
    for (int k = 0; k < HD / 16; k++)
        wmma::load_matrix_sync(f[k], (const E *)t + warp * 16 * HD + k * 16, HD);
}

/* ---- forward ------------------------------------------------------------------------------ */

/* One block: 64 query rows of one (sequence, head); blocks of the longest rows first. */
template <typename E, int HD>
__global__ static void __launch_bounds__(FA_THREADS) gpu_k_flash_fwd(fa_args a)
{
    __shared__ fa_smem<HD> sm;
    const fa_pos p = fa_where(a, HD);
    const int qt = gridDim.x - 1 - blockIdx.x, i = qt * FA_TILE + p.warp * 16 + p.r;
    float *ss = sm.s[p.warp];
    frag_a<E> qf[HD / 16];
    frag_c pv[HD / 16];
    float o[HD / 2], m = -INFINITY, l = 0.0f;

    fa_stage<E, HD>(qf, sm.t0, p.qkv, qt * FA_TILE, a.T, p.ld, p.hoff, p.warp);
    FA_UNROLL
    for (int c = 0; c < HD / 2; c++)
        o[c] = 0.0f;
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();
        fa_load<HD>(sm.t0, p.qkv, kt * FA_TILE, a.T, p.ld, p.C + p.hoff);
        fa_load<HD>(sm.t1, p.qkv, kt * FA_TILE, a.T, p.ld, 2 * p.C + p.hoff);
        __syncthreads();
        fa_abt<E, HD>(ss, qf, sm.t0);
        __syncwarp();
        /* the online softmax over this tile's half row: running max, rescale, P~ */
        const float *s = ss + p.r * FA_TILE + p.h * 32;
        uint16_t *pt = sm.p[p.warp] + p.r * FA_TILE + p.h * 32;
        int j0 = kt * FA_TILE + p.h * 32;
        float mx = -INFINITY, sum = 0.0f;
        FA_UNROLL
        for (int c = 0; c < 32; c++)
            if (j0 + c <= i)
                mx = fmaxf(mx, __fmul_rn(s[c], a.scale));
        mx = fmaxf(m, fmaxf(mx, __shfl_xor_sync(FA_FULL, mx, 1)));
        float alpha = expf(__fsub_rn(m, mx));
        FA_UNROLL
        for (int c = 0; c < 32; c++) {
            float e = j0 + c <= i ? expf(__fsub_rn(__fmul_rn(s[c], a.scale), mx)) : 0.0f;
            sum = __fadd_rn(sum, e);
            pt[c] = fa_bits<E>(e);
        }
        sum = __fadd_rn(sum, __shfl_xor_sync(FA_FULL, sum, 1));
        l = __fadd_rn(__fmul_rn(l, alpha), sum);
        m = mx;
        __syncwarp();
        for (int d = 0; d < HD / 16; d++)
            wmma::fill_fragment(pv[d], 0.0f);
        fa_pb<E, HD>(pv, sm.p[p.warp], sm.t1);
        for (int d = 0; d < HD / 16; d++)
            wmma::store_matrix_sync(ss + d * 16, pv[d], FA_TILE, wmma::mem_row_major);
        __syncwarp();
        const float *add = ss + p.r * FA_TILE + p.h * (HD / 2);
        FA_UNROLL
        for (int c = 0; c < HD / 2; c++)
            o[c] = __fadd_rn(__fmul_rn(o[c], alpha), add[c]);
    }
    if (i >= a.T)
        return;
    size_t at = ((size_t)(p.bh / a.H) * a.T + i) * p.C + p.hoff + p.h * (HD / 2);
    FA_UNROLL
    for (int c = 0; c < HD / 2; c++) {
        uint16_t v = fa_bits<E>(__fdiv_rn(o[c], l));
        if (a.y32)
            ((float *)a.y)[at + c] = fa_value<E>(v);
        else
            ((uint16_t *)a.y)[at + c] = v;
    }
    if (p.h == 0)
        a.lse[(size_t)p.bh * a.T + i] = __fadd_rn(m, logf(l));
}

/* ---- backward ----------------------------------------------------------------------------- */

/* D = dY . O per row and head, in fp32, channel by channel (gpt.c's order). */
template <typename E, int HD>
__global__ static void __launch_bounds__(FA_THREADS) gpu_k_flash_dsum(fa_args a)
{
    size_t n = (size_t)blockIdx.x * FA_THREADS + threadIdx.x, C = (size_t)a.H * HD;
    if (n >= (size_t)a.B * a.T * a.H)
        return;
    size_t row = n / a.H, hh = n % a.H, off = row * C + hh * HD;
    float d = 0.0f;
    for (int c = 0; c < HD; c++) {
        float o = a.odt == GPU_FP32 ? ((const float *)a.o)[off + c]
                                    : fa_value<E>(((const uint16_t *)a.o)[off + c]);
        d = __fmaf_rn(fa_value<E>(a.dy[off + c]), o, d);
    }
    size_t b = row / a.T, t = row % a.T;
    a.dsum[(b * a.H + hh) * a.T + t] = d;
}

/* P = exp(S scale - lse) of one score (0 where masked), and dS = (P (dP - D)) scale. */
__device__ static __forceinline__ float fa_prob(float s, float scale, float lse, bool valid)
{
    return valid ? expf(__fsub_rn(__fmul_rn(s, scale), lse)) : 0.0f;
}

__device__ static __forceinline__ float fa_ds(float p, float dp, float D, float scale, bool valid)
{
    return valid ? __fmul_rn(__fmul_rn(p, __fsub_rn(dp, D)), scale) : 0.0f;
}

/* dK and dV of 64 keys of one (sequence, head): a warp owns 16 keys, its tiles are
 * transposed (rows = keys, columns = queries), and it loops over the query tiles from the
 * diagonal on. */
template <typename E, int HD>
__global__ static void __launch_bounds__(FA_THREADS) gpu_k_flash_dkv(fa_args a)
{
    __shared__ fa_smem<HD> sm;
    const fa_pos p = fa_where(a, HD);
    const int kt = blockIdx.x, key = kt * FA_TILE + p.warp * 16 + p.r;
    const float *lse = a.lse + (size_t)p.bh * a.T, *dsum = a.dsum + (size_t)p.bh * a.T;
    float *ss = sm.s[p.warp];
    uint16_t *sp = sm.p[p.warp] + p.r * FA_TILE + p.h * 32;
    frag_a<E> kf[HD / 16], vf[HD / 16];
    frag_c dk[HD / 16], dv[HD / 16];
    float pr[32];

    fa_stage<E, HD>(kf, sm.t0, p.qkv, kt * FA_TILE, a.T, p.ld, p.C + p.hoff, p.warp);
    fa_stage<E, HD>(vf, sm.t1, p.qkv, kt * FA_TILE, a.T, p.ld, 2 * p.C + p.hoff, p.warp);
    for (int k = 0; k < HD / 16; k++) {
        wmma::fill_fragment(dk[k], 0.0f);
        wmma::fill_fragment(dv[k], 0.0f);
    }
    for (int qt = kt; qt < (int)gridDim.x; qt++) {
        int j0 = qt * FA_TILE + p.h * 32;
        const float *s = ss + p.r * FA_TILE + p.h * 32;
        __syncthreads();
        fa_load<HD>(sm.t0, p.qkv, qt * FA_TILE, a.T, p.ld, p.hoff);
        fa_load<HD>(sm.t1, p.dy, qt * FA_TILE, a.T, p.C, p.hoff);
        __syncthreads();
        fa_abt<E, HD>(ss, kf, sm.t0); /* S^T = K Q^T */
        __syncwarp();
        FA_UNROLL
        for (int c = 0; c < 32; c++) {
            bool valid = j0 + c >= key && j0 + c < a.T;
            pr[c] = fa_prob(s[c], a.scale, valid ? lse[j0 + c] : 0.0f, valid);
            sp[c] = fa_bits<E>(pr[c]);
        }
        __syncwarp();
        fa_pb<E, HD>(dv, sm.p[p.warp], sm.t1); /* dV += rd(P)^T dY */
        fa_abt<E, HD>(ss, vf, sm.t1);          /* dP^T = V dY^T */
        __syncwarp();
        FA_UNROLL
        for (int c = 0; c < 32; c++) {
            bool valid = j0 + c >= key && j0 + c < a.T;
            sp[c] = fa_bits<E>(fa_ds(pr[c], s[c], valid ? dsum[j0 + c] : 0.0f, a.scale, valid));
        }
        __syncwarp();
        fa_pb<E, HD>(dk, sm.p[p.warp], sm.t0); /* dK += rd(dS)^T Q */
    }
    fa_store_rows<HD>(dk, ss, a, p, kt * FA_TILE + p.warp * 16, p.C + p.hoff);
    fa_store_rows<HD>(dv, ss, a, p, kt * FA_TILE + p.warp * 16, 2 * p.C + p.hoff);
}

/* dQ of 64 query rows of one (sequence, head), looping over the key tiles up to the
 * diagonal; longest rows first. */
template <typename E, int HD>
__global__ static void __launch_bounds__(FA_THREADS) gpu_k_flash_dq(fa_args a)
{
    __shared__ fa_smem<HD> sm;
    const fa_pos p = fa_where(a, HD);
    const int qt = gridDim.x - 1 - blockIdx.x, i = qt * FA_TILE + p.warp * 16 + p.r;
    const float lse = i < a.T ? a.lse[(size_t)p.bh * a.T + i] : 0.0f;
    const float D = i < a.T ? a.dsum[(size_t)p.bh * a.T + i] : 0.0f;
    float *ss = sm.s[p.warp];
    uint16_t *sp = sm.p[p.warp] + p.r * FA_TILE + p.h * 32;
    frag_a<E> qf[HD / 16], df[HD / 16];
    frag_c dq[HD / 16];
    float pr[32];

    fa_stage<E, HD>(qf, sm.t0, p.qkv, qt * FA_TILE, a.T, p.ld, p.hoff, p.warp);
    fa_stage<E, HD>(df, sm.t1, p.dy, qt * FA_TILE, a.T, p.C, p.hoff, p.warp);
    for (int k = 0; k < HD / 16; k++)
        wmma::fill_fragment(dq[k], 0.0f);
    for (int kt = 0; kt <= qt; kt++) {
        int j0 = kt * FA_TILE + p.h * 32;
        const float *s = ss + p.r * FA_TILE + p.h * 32;
        __syncthreads();
        fa_load<HD>(sm.t0, p.qkv, kt * FA_TILE, a.T, p.ld, p.C + p.hoff);
        fa_load<HD>(sm.t1, p.qkv, kt * FA_TILE, a.T, p.ld, 2 * p.C + p.hoff);
        __syncthreads();
        fa_abt<E, HD>(ss, qf, sm.t0); /* S = Q K^T */
        __syncwarp();
        FA_UNROLL
        for (int c = 0; c < 32; c++)
            pr[c] = fa_prob(s[c], a.scale, lse, j0 + c <= i && i < a.T);
        __syncwarp();
        fa_abt<E, HD>(ss, df, sm.t1); /* dP = dY V^T */
        __syncwarp();
        FA_UNROLL
        for (int c = 0; c < 32; c++)
            sp[c] = fa_bits<E>(fa_ds(pr[c], s[c], D, a.scale, j0 + c <= i && i < a.T));
        __syncwarp();
        fa_pb<E, HD>(dq, sm.p[p.warp], sm.t0); /* dQ += rd(dS) K */
    }
    fa_store_rows<HD>(dq, ss, a, p, qt * FA_TILE + p.warp * 16, p.hoff);
}

/* ---- launches ----------------------------------------------------------------------------- */

typedef void (*fa_kernel)(fa_args);

/* The instantiations, by dtype (fp16, bf16) and head_dim / 16 - 1. */
#define FA_TABLE(k)                                                                           \
    {                                                                                         \
        {k<__half, 16>, k<__half, 32>, k<__half, 48>, k<__half, 64>},                         \
        {                                                                                     \
            k<__nv_bfloat16, 16>, k<__nv_bfloat16, 32>, k<__nv_bfloat16, 48>,                 \
                k<__nv_bfloat16, 64>                                                          \
        }                                                                                     \
    }
static const fa_kernel fa_fwd[2][4] = FA_TABLE(gpu_k_flash_fwd);
static const fa_kernel fa_dsum[2][4] = FA_TABLE(gpu_k_flash_dsum);
static const fa_kernel fa_dkv[2][4] = FA_TABLE(gpu_k_flash_dkv);
static const fa_kernel fa_dq[2][4] = FA_TABLE(gpu_k_flash_dq);

/* See cuda_ops.h. */
extern "C" bool gpu_cuda_flash_supported(int hd)
{
    return gpu_flash_head_dim_ok(hd);
}

/* Shapes and dtypes every flash launch needs; the table row in *row. */
static int fa_check(gpu_dtype dt, int B, int T, int H, int hd, const void *qkv, int *row)
{
    if ((dt != GPU_FP16 && dt != GPU_BF16) || B < 0 || T < 0 || H < 1 ||
        !gpu_cuda_flash_supported(hd) || (int64_t)B * H > 65535 || qkv == NULL ||
        (uintptr_t)qkv % 16 != 0)
        return GPU_EINVAL;
    *row = dt == GPU_FP16 ? 0 : 1;
    return 0;
}

static float fa_scale(int hd)
{
    return (float)(1.0 / sqrt((double)hd)); /* gpt.c's attn_scale */
}

/* See cuda_ops.h. */
extern "C" int gpu_cuda_flash_fwd_launch(const void *qkv, gpu_dtype dt, int B, int T, int H,
                                         int hd, float *lse, void *y, gpu_dtype ydt,
                                         cudaStream_t stream)
{
    int row;
    if (fa_check(dt, B, T, H, hd, qkv, &row) != 0 || lse == NULL || y == NULL ||
        (ydt != dt && ydt != GPU_FP32))
        return GPU_EINVAL;
    if (B == 0 || T == 0)
        return 0;
    fa_args a = {(const uint16_t *)qkv, NULL, NULL, dt, lse, NULL, NULL, y, ydt == GPU_FP32,
                 B, T, H, fa_scale(hd)};
    dim3 grid((unsigned)((T + FA_TILE - 1) / FA_TILE), (unsigned)(B * H));
    fa_kernel flash_fwd = fa_fwd[row][hd / 16 - 1];
    flash_fwd<<<grid, FA_THREADS, 0, stream>>>(a);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* See cuda_ops.h. */
extern "C" int gpu_cuda_flash_bwd_launch(const void *qkv, const void *dy, gpu_dtype dt,
                                         const void *o, gpu_dtype odt, const float *lse, int B,
                                         int T, int H, int hd, float *dsum, float *dqkv,
                                         cudaStream_t stream)
{
    int row;
    if (fa_check(dt, B, T, H, hd, qkv, &row) != 0 || dy == NULL || (uintptr_t)dy % 16 != 0 ||
        o == NULL || (odt != dt && odt != GPU_FP32) || lse == NULL || dsum == NULL ||
        dqkv == NULL)
        return GPU_EINVAL;
    if (B == 0 || T == 0)
        return 0;
    fa_args a = {(const uint16_t *)qkv, (const uint16_t *)dy, o, odt, (float *)lse, dsum, dqkv,
                 NULL, false, B, T, H, fa_scale(hd)};
    size_t rows = (size_t)B * T * H;
    dim3 grid((unsigned)((T + FA_TILE - 1) / FA_TILE), (unsigned)(B * H));
    int k = hd / 16 - 1;
    fa_kernel flash_dsum = fa_dsum[row][k], flash_dkv = fa_dkv[row][k], flash_dq = fa_dq[row][k];
    flash_dsum<<<gpu_cuda_blocks(rows, FA_THREADS, 0x7FFFFFFFu), FA_THREADS, 0, stream>>>(a);
    GPU_CUDA_CHECK(cudaGetLastError());
    flash_dkv<<<grid, FA_THREADS, 0, stream>>>(a);
    GPU_CUDA_CHECK(cudaGetLastError());
    flash_dq<<<grid, FA_THREADS, 0, stream>>>(a);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}
