/*
 * cuda_attn.cu - the GPT's flash attention on tensor cores (FlashAttention-2): the causal
 * softmax(Q K^T / sqrt(hd)) V of every (sequence, head) without the B x H x T x T score or
 * probability matrices in memory, forward and backward. Declared in gpu/cuda/cuda_ops.h.
 *
 * Numerics (gpu_gpt_flash_fwd/bwd in gpu/gpt.c are the reference): Q, K, V, dY are 16-bit
 * (fp16 or bf16) values; the products run on tensor cores (mma.sync m16n8k16, fp32
 * accumulation); the scores S = (Q K^T) * scale, the softmax, its statistics and dS stay in
 * fp32, and only P (for P V and dV) and dS (for dQ and dK) are rounded to 16 bits, as the
 * CPU rounds them. Forward: the online softmax, one pass over the key tiles with a running
 * row max m and sum l; P~ = exp(S - m_running) is rounded (the CPU rounds the normalised P,
 * so the two differ by 16-bit rounding, not more); y = acc / l; lse = m + log(l) saved.
 * Backward: D_i = dY_i . O_i, then P = exp(S - lse) recomputed exactly as normalised;
 * dV = rd(P)^T dY, dP = dY V^T (fp32), dS = (P (dP - D)) * scale, dK = rd(dS)^T Q in one
 * kernel (a block per key tile, looping over query tiles) and dQ = rd(dS) K in another (a
 * block per query tile, looping over key tiles): no atomics, so every run gives the same
 * bits. dQ, dK and dV are written into dqkv [N x 3C], rounded to 16 bits or in fp32 (not
 * rounded) for the caller to inspect first (diagnostics).
 *
 * Tiles: 64 query rows (or keys) per block, 4 warps of 16 rows, 64 columns per tile, in
 * FlashAttention-2's arrangement: the products' fp32 accumulators stay in registers in the
 * instruction's layout (ptx_mma.h in tests/cudaemu spells it out: lane 4 g + t holds rows g
 * and g + 8, columns 2t and 2t + 1 of each 8-column slice), the row max and sum are reduced
 * across the 4 lanes of a row with shuffles, and an accumulator pair of 8-column slices,
 * rounded to 16 bits, is already the A operand of the next product (P V, dS K, ...). Shared
 * memory holds only the 16-bit K, V, Q or dY tiles, row-major with rows padded to HD + 8
 * values, and transposed ([HD][72]) where a product needs them as its k dimension, so that
 * every operand is a conflict-free 32-bit load. A tile comes in from global memory a whole
 * row per group of lanes (coalesced 16-byte loads), and its transpose is made from the
 * row-major copy in shared memory. The backward kernels take 16 columns at a time (two
 * slices), which keeps their registers low. head_dim (HD) is a template parameter: 16, 32,
 * 48 or 64; shared memory stays within the static 48 KiB.
 * Rows at or beyond T are read as zeros and never written.
 *
 * Alignment: the 16-byte loads need qkv and dy 16-byte aligned with C a multiple of 8 (it
 * is: HD is a multiple of 16).
 *
 * Threads: launches only enqueue on the stream given; a block's threads share the tiles
 * between __syncthreads; nothing else is shared.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "gpu/cuda/cuda_common.cuh"
#include "gpu/cuda/cuda_ops.h"

#ifndef __CUDACC__
#include <ptx_mma.h> /* the emulator (tests/cudaemu): the PTX instruction as a function */
#endif

#define FA_TILE 64                   /* query rows (keys) per block; columns per tile */
#define FA_WARPS 4                   /* each warp: 16 rows */
#define FA_THREADS (32 * FA_WARPS)
#define FA_SLICES (FA_TILE / 8)      /* 8-column slices of a tile row */
#define FA_LD(hd) ((hd) + 8)         /* row stride (values) of a row-major [64][HD] tile */
#define FA_LDT (FA_TILE + 8)         /* row stride of a transposed [HD][64] tile */
#define FA_FULL 0xFFFFFFFFu
#ifdef __CUDACC__
#define FA_UNROLL _Pragma("unroll") /* the fragments and accumulators stay in registers */
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
    void *dqkv;            /* [B T x 3C] (backward): fp32, or rounded to 16 bits (d16) */
    bool d16;
    void *y;               /* [B T x C]: 16-bit, or fp32 values of the 16-bit dtype (y32) */
    bool y32;
    int B, T, H;
    float scale;
} fa_args;

/* fp32 to the 16-bit dtype's bits (round to nearest even), and back. */
template <typename E>
__device__ static __forceinline__ uint16_t fa_bits(float x)
{
    if constexpr (std::is_same<E, __half>::value)
        return gpu_fmt_f32_to_f16(gpu_fmt_f2u(x));
    else
        return gpu_fmt_f32_to_bf16(gpu_fmt_f2u(x));
}

template <typename E>
__device__ static __forceinline__ float fa_value(uint16_t h)
{
    if constexpr (std::is_same<E, __half>::value)
        return gpu_fmt_u2f(gpu_fmt_f16_to_f32(h));
    else
        return gpu_fmt_u2f(gpu_fmt_bf16_to_f32(h));
}

/* two values rounded to E, lo in the low half: one 32-bit operand register */
template <typename E>
__device__ static __forceinline__ uint32_t fa_pair(float lo, float hi)
{
    return (uint32_t)fa_bits<E>(lo) | (uint32_t)fa_bits<E>(hi) << 16;
}

/* d[4] += A B for one 16 x 8 x 16 tile: a[4], b[2] and d in the instruction's layout; t is
 * the operands' PTX type ("f16" or "bf16"). */
#define FA_MMA_ASM(t)                                                                         \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." t "." t ".f32 {%0, %1, %2, %3}, "         \
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                                       \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                      \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))

template <typename E>
__device__ static __forceinline__ void fa_mma(float *d, const uint32_t *a, const uint32_t *b)
{
#ifndef __CUDACC__
    emu_mma_m16n8k16<E>(d, a, b);
#elif defined(__CUDA_ARCH__)
    if constexpr (std::is_same<E, __half>::value)
        FA_MMA_ASM("f16");
    else
        FA_MMA_ASM("bf16");
#endif
}

/* Where a thread works: its warp, its lane's g = lane / 4 and t = lane % 4 (its rows
 * g and g + 8 of the warp's 16, its columns 2t, 2t + 1 of each 8-column slice); its
 * (sequence, head) and the sequence's qkv and dy rows. */
typedef struct {
    int warp, g, t, bh, C, hoff;
    size_t ld;
    const uint16_t *qkv, *dy;
} fa_pos;

__device__ static fa_pos fa_where(const fa_args &a, int HD)
{
    fa_pos p;
    int lane = threadIdx.x % 32, b = blockIdx.y / a.H;
    p.warp = threadIdx.x / 32;
    p.g = lane / 4;
    p.t = lane % 4;
    p.bh = blockIdx.y;
    p.C = a.H * HD;
    p.hoff = blockIdx.y % a.H * HD;
    p.ld = 3 * (size_t)p.C;
    p.qkv = a.qkv + (size_t)b * a.T * p.ld;
    p.dy = a.dy != NULL ? a.dy + (size_t)b * a.T * p.C : NULL;
    return p;
}

/* Rows [r0, r0 + 64), columns [col, col + HD) of a 16-bit matrix g (row stride ld) into the
 * row-major tile s ([64][FA_LD(HD)]); rows at or beyond `rows` are zeros. All threads of the
 * block. Consecutive threads take consecutive 16-byte chunks of a row, so that a warp's
 * loads cover whole rows (4 rows of 128 bytes for HD 64: 4 cache lines, not 32) and a
 * quarter warp's stores one row of s (no bank conflicts). */
template <int HD>
__device__ static void fa_load(uint16_t *s, const uint16_t *g, int r0, int rows, size_t ld,
                               int col)
{
    for (int i = threadIdx.x; i < FA_TILE * (HD / 8); i += FA_THREADS) {
        int r = i / (HD / 8), c = i % (HD / 8) * 8;
        gpu_dev_chunk v = gpu_dev_chunk{{0u, 0u, 0u, 0u}};
        if (r0 + r < rows)
            v = *(const gpu_dev_chunk *)(g + (size_t)(r0 + r) * ld + col + c);
        *(gpu_dev_chunk *)(s + r * FA_LD(HD) + c) = v;
    }
}

/* The transpose of the row-major tile s into st ([HD][FA_LDT]), both in shared memory (s
 * complete: after a __syncthreads). A thread takes two consecutive rows of an 8-column
 * chunk, so that it writes whole 32-bit pairs of st, and the 32 lanes of a warp take 32 row
 * pairs (no bank conflicts on st). */
template <int HD>
__device__ static void fa_transpose(uint16_t *st, const uint16_t *s)
{
    for (int i = threadIdx.x; i < (FA_TILE / 2) * (HD / 8); i += FA_THREADS) {
        int r = 2 * (i % (FA_TILE / 2)), c = i / (FA_TILE / 2) * 8;
        gpu_dev_chunk v0 = *(const gpu_dev_chunk *)(s + r * FA_LD(HD) + c);
        gpu_dev_chunk v1 = *(const gpu_dev_chunk *)(s + (r + 1) * FA_LD(HD) + c);
        FA_UNROLL
        for (int e = 0; e < 8; e++) {
            uint32_t lo = gpu_dev_chunk_bits(v0, e), hi = gpu_dev_chunk_bits(v1, e);
            *(uint32_t *)(st + (c + e) * FA_LDT + r) = lo | hi << 16;
        }
    }
}

/* a[k] (k < HD / 16): the A fragments of the warp's 16 rows (from row0) of the row-major
 * tile s, over its HD columns. */
template <int HD>
__device__ static void fa_frag_a(uint32_t (*a)[4], const uint16_t *s, int row0, const fa_pos &p)
{
    FA_UNROLL
    for (int k = 0; k < HD / 16; k++) {
        const uint16_t *x = s + (row0 + p.g) * FA_LD(HD) + k * 16 + 2 * p.t;
        a[k][0] = *(const uint32_t *)x;
        a[k][1] = *(const uint32_t *)(x + 8 * FA_LD(HD));
        a[k][2] = *(const uint32_t *)(x + 8);
        a[k][3] = *(const uint32_t *)(x + 8 * FA_LD(HD) + 8);
    }
}

/* b: the B fragment whose B(k, n) is s[(n0 + n) * ld + k0 + k] (k < 16, n < 8): a tile whose
 * rows are B's columns. */
__device__ static __forceinline__ void fa_frag_b(uint32_t *b, const uint16_t *s, int ld, int n0,
                                                 int k0, const fa_pos &p)
{
    const uint16_t *x = s + (n0 + p.g) * ld + k0 + 2 * p.t;
    b[0] = *(const uint32_t *)x;
    b[1] = *(const uint32_t *)(x + 8);
}

/* x[j] = A B^T over the 8-column slices j0 .. j0 + n - 1: A the warp's fragments a (16 x HD),
 * B the row-major [64][HD] tile sb (slice j: its rows 8j .. 8j + 7). */
template <typename E, int HD>
__device__ static __forceinline__ void fa_abt(float (*x)[4], int j0, int n,
                                              const uint32_t (*a)[4], const uint16_t *sb,
                                              const fa_pos &p)
{
    FA_UNROLL
    for (int j = 0; j < n; j++) {
        x[j][0] = x[j][1] = x[j][2] = x[j][3] = 0.0f;
        FA_UNROLL
        for (int k = 0; k < HD / 16; k++) {
            uint32_t b[2];
            fa_frag_b(b, sb, FA_LD(HD), (j0 + j) * 8, k * 16, p);
            fa_mma<E>(x[j], a[k], b);
        }
    }
}

/* acc[d] (d < HD / 8) += P B: P the 16 x 16 block of columns kk * 16 .. whose A fragment is
 * pa, B those 16 rows of a [64][HD] matrix, read from its transpose st ([HD][FA_LDT]). */
template <typename E, int HD>
__device__ static __forceinline__ void fa_pb(float (*acc)[4], const uint32_t *pa,
                                             const uint16_t *st, int kk, const fa_pos &p)
{
    FA_UNROLL
    for (int d = 0; d < HD / 8; d++) {
        uint32_t b[2];
        fa_frag_b(b, st, FA_LDT, d * 8, kk * 16, p);
        fa_mma<E>(acc[d], pa, b);
    }
}

/* The A fragment of the 16 x 16 block made of two accumulator slices (x0: its columns 0..7,
 * x1: 8..15), rounded to E. */
template <typename E>
__device__ static __forceinline__ void fa_pack(uint32_t *pa, const float *x0, const float *x1)
{
    pa[0] = fa_pair<E>(x0[0], x0[1]);
    pa[1] = fa_pair<E>(x0[2], x0[3]);
    pa[2] = fa_pair<E>(x1[0], x1[1]);
    pa[3] = fa_pair<E>(x1[2], x1[3]);
}

/* The max (sum) of a row over the 4 lanes that hold it. */
__device__ static __forceinline__ float fa_row_max(float v)
{
    v = fmaxf(v, __shfl_xor_sync(FA_FULL, v, 1));
    return fmaxf(v, __shfl_xor_sync(FA_FULL, v, 2));
}

__device__ static __forceinline__ float fa_row_sum(float v)
{
    v = __fadd_rn(v, __shfl_xor_sync(FA_FULL, v, 1));
    return __fadd_rn(v, __shfl_xor_sync(FA_FULL, v, 2));
}

/* Write the warp's fp32 accumulators acc[HD / 8] (rows row0 + g and row0 + g + 8) into dqkv
 * at column col, rounded to E when a.d16; rows at or beyond T skipped. */
template <typename E, int HD>
__device__ static void fa_store_rows(const float (*acc)[4], const fa_args &a, const fa_pos &p,
                                     int row0, int col)
{
    FA_UNROLL
    for (int h = 0; h < 2; h++) {
        int row = row0 + p.g + 8 * h;
        if (row >= a.T)
            continue;
        size_t at = ((size_t)(p.bh / a.H) * a.T + row) * p.ld + col + 2 * p.t;
        FA_UNROLL
        for (int d = 0; d < HD / 8; d++) {
            if (a.d16)
                *(uint32_t *)((uint16_t *)a.dqkv + at + d * 8) =
                    fa_pair<E>(acc[d][2 * h], acc[d][2 * h + 1]);
            else
                *(float2 *)((float *)a.dqkv + at + d * 8) =
                    make_float2(acc[d][2 * h], acc[d][2 * h + 1]);
        }
    }
}

/* ---- forward ------------------------------------------------------------------------------ */

/* The online softmax of one tile for the thread's rows i0 and i0 + 8: s holds the products
 * Q K^T of the tile's columns (first column j0 + 2t); on return, P~ = exp(S - m) with the
 * new running max m (0 where masked), l updated, alpha[h] = exp(m_old - m) for row h. */
__device__ static void fa_online(float (*s)[4], int j0, int i0, float scale, float *m, float *l,
                                 float *alpha)
{
    float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.0f, 0.0f};
    FA_UNROLL
    for (int j = 0; j < FA_SLICES; j++)
        FA_UNROLL
        for (int e = 0; e < 4; e++) {
            int h = e / 2;
            bool valid = j0 + j * 8 + e % 2 <= i0 + 8 * h;
            s[j][e] = valid ? __fmul_rn(s[j][e], scale) : -INFINITY;
            mx[h] = fmaxf(mx[h], s[j][e]);
        }
    FA_UNROLL
    for (int h = 0; h < 2; h++) {
        mx[h] = fmaxf(m[h], fa_row_max(mx[h]));
        alpha[h] = expf(__fsub_rn(m[h], mx[h]));
    }
    FA_UNROLL
    for (int j = 0; j < FA_SLICES; j++)
        FA_UNROLL
        for (int e = 0; e < 4; e++) {
            int h = e / 2;
            float v = s[j][e] == -INFINITY ? 0.0f : expf(__fsub_rn(s[j][e], mx[h]));
            s[j][e] = v;
            sum[h] = __fadd_rn(sum[h], v);
        }
    FA_UNROLL
    for (int h = 0; h < 2; h++) {
        l[h] = __fadd_rn(__fmul_rn(l[h], alpha[h]), fa_row_sum(sum[h]));
        m[h] = mx[h];
    }
}

/* One block: 64 query rows of one (sequence, head); blocks of the longest rows first. */
template <typename E, int HD>
__global__ static void __launch_bounds__(FA_THREADS) gpu_k_flash_fwd(fa_args a)
{
    __shared__ __align__(16) uint16_t sk[FA_TILE * FA_LD(HD)], sv[FA_TILE * FA_LD(HD)];
    __shared__ __align__(16) uint16_t svt[HD * FA_LDT];
    const fa_pos p = fa_where(a, HD);
    const int qt = gridDim.x - 1 - blockIdx.x, i0 = qt * FA_TILE + p.warp * 16 + p.g;
    uint32_t qa[HD / 16][4];
    float o[HD / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    fa_load<HD>(sk, p.qkv, qt * FA_TILE, a.T, p.ld, p.hoff);
    __syncthreads();
    fa_frag_a<HD>(qa, sk, p.warp * 16, p);
    FA_UNROLL
    for (int d = 0; d < HD / 8; d++)
        o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    for (int kt = 0; kt <= qt; kt++) {
        float s[FA_SLICES][4], alpha[2];
        __syncthreads();
        fa_load<HD>(sk, p.qkv, kt * FA_TILE, a.T, p.ld, p.C + p.hoff);
        fa_load<HD>(sv, p.qkv, kt * FA_TILE, a.T, p.ld, 2 * p.C + p.hoff);
        __syncthreads();
        fa_transpose<HD>(svt, sv);
        __syncthreads();
        fa_abt<E, HD>(s, 0, FA_SLICES, qa, sk, p);
        fa_online(s, kt * FA_TILE + 2 * p.t, i0, a.scale, m, l, alpha);
        FA_UNROLL
        for (int d = 0; d < HD / 8; d++)
            FA_UNROLL
            for (int e = 0; e < 4; e++)
                o[d][e] = __fmul_rn(o[d][e], alpha[e / 2]);
        FA_UNROLL
        for (int kk = 0; kk < FA_TILE / 16; kk++) {
            uint32_t pa[4];
            fa_pack<E>(pa, s[2 * kk], s[2 * kk + 1]);
            fa_pb<E, HD>(o, pa, svt, kk, p);
        }
    }
    FA_UNROLL
    for (int h = 0; h < 2; h++) {
        int i = i0 + 8 * h;
        if (i >= a.T)
            continue;
        size_t at = ((size_t)(p.bh / a.H) * a.T + i) * p.C + p.hoff + 2 * p.t;
        FA_UNROLL
        for (int d = 0; d < HD / 8; d++) {
            uint16_t v0 = fa_bits<E>(__fdiv_rn(o[d][2 * h], l[h]));
            uint16_t v1 = fa_bits<E>(__fdiv_rn(o[d][2 * h + 1], l[h]));
            if (a.y32)
                *(float2 *)((float *)a.y + at + d * 8) =
                    make_float2(fa_value<E>(v0), fa_value<E>(v1));
            else
                *(uint32_t *)((uint16_t *)a.y + at + d * 8) = (uint32_t)v0 | (uint32_t)v1 << 16;
        }
        if (p.t == 0)
            a.lse[(size_t)p.bh * a.T + i] = __fadd_rn(m[h], logf(l[h]));
    }
}

/* ---- backward ----------------------------------------------------------------------------- */

/* Value e (< 8) of a chunk of eight 16-bit values. */
template <typename E>
__device__ static __forceinline__ float fa_chunk_value(const gpu_dev_chunk &c, int e)
{
    return fa_value<E>(gpu_dev_chunk_bits(c, e));
}

/* o[0..8) = the saved output O from element off: one 16-byte load of 16-bit values, or two
 * of fp32 ones. */
template <typename E>
__device__ static __forceinline__ void fa_o8(const fa_args &a, size_t off, float *o)
{
    if (a.odt == GPU_FP32) {
        float4 q0 = *(const float4 *)((const float *)a.o + off);
        float4 q1 = *(const float4 *)((const float *)a.o + off + 4);
        o[0] = q0.x, o[1] = q0.y, o[2] = q0.z, o[3] = q0.w;
        o[4] = q1.x, o[5] = q1.y, o[6] = q1.z, o[7] = q1.w;
        return;
    }
    gpu_dev_chunk c = *(const gpu_dev_chunk *)((const uint16_t *)a.o + off);
    FA_UNROLL
    for (int e = 0; e < 8; e++)
        o[e] = fa_chunk_value<E>(c, e);
}

/* D = dY . O per row and head, in fp32, channel by channel (gpt.c's order); the 8 channels of
 * a step come from 16-byte loads, so a warp reads whole rows. */
template <typename E, int HD>
__global__ static void __launch_bounds__(FA_THREADS) gpu_k_flash_dsum(fa_args a)
{
    size_t n = (size_t)blockIdx.x * FA_THREADS + threadIdx.x, C = (size_t)a.H * HD;
    if (n >= (size_t)a.B * a.T * a.H)
        return;
    size_t row = n / a.H, hh = n % a.H, off = row * C + hh * HD;
    float d = 0.0f;
    FA_UNROLL
    for (int c = 0; c < HD; c += 8) {
        gpu_dev_chunk dy = *(const gpu_dev_chunk *)(a.dy + off + c);
        float o[8];
        fa_o8<E>(a, off + c, o);
        FA_UNROLL
        for (int e = 0; e < 8; e++)
            d = __fmaf_rn(fa_chunk_value<E>(dy, e), o[e], d);
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

/* dK and dV of 64 keys of one (sequence, head): a warp owns 16 keys and works on the
 * transposed products (rows = keys, columns = queries), looping over the query tiles from
 * the diagonal on, 16 queries at a time. */
template <typename E, int HD>
__global__ static void __launch_bounds__(FA_THREADS) gpu_k_flash_dkv(fa_args a)
{
    __shared__ __align__(16) uint16_t sq[FA_TILE * FA_LD(HD)], sd[FA_TILE * FA_LD(HD)];
    __shared__ __align__(16) uint16_t sqt[HD * FA_LDT], sdt[HD * FA_LDT];
    __shared__ float slse[FA_TILE], sdsum[FA_TILE];
    const fa_pos p = fa_where(a, HD);
    const int kt = blockIdx.x, key0 = kt * FA_TILE + p.warp * 16 + p.g;
    uint32_t ka[HD / 16][4], va[HD / 16][4];
    float dk[HD / 8][4], dv[HD / 8][4];

    fa_load<HD>(sq, p.qkv, kt * FA_TILE, a.T, p.ld, p.C + p.hoff);
    fa_load<HD>(sd, p.qkv, kt * FA_TILE, a.T, p.ld, 2 * p.C + p.hoff);
    __syncthreads();
    fa_frag_a<HD>(ka, sq, p.warp * 16, p);
    fa_frag_a<HD>(va, sd, p.warp * 16, p);
    FA_UNROLL
    for (int d = 0; d < HD / 8; d++)
        FA_UNROLL
        for (int e = 0; e < 4; e++)
            dk[d][e] = dv[d][e] = 0.0f;
    for (int qt = kt; qt < (int)gridDim.x; qt++) {
        __syncthreads();
        fa_load<HD>(sq, p.qkv, qt * FA_TILE, a.T, p.ld, p.hoff);
        fa_load<HD>(sd, p.dy, qt * FA_TILE, a.T, p.C, p.hoff);
        if (threadIdx.x < FA_TILE) {
            int q = qt * FA_TILE + threadIdx.x;
            slse[threadIdx.x] = q < a.T ? a.lse[(size_t)p.bh * a.T + q] : 0.0f;
            sdsum[threadIdx.x] = q < a.T ? a.dsum[(size_t)p.bh * a.T + q] : 0.0f;
        }
        __syncthreads();
        fa_transpose<HD>(sqt, sq);
        fa_transpose<HD>(sdt, sd);
        __syncthreads();
        FA_UNROLL
        for (int kk = 0; kk < FA_TILE / 16; kk++) {
            float pt[2][4], dpt[2][4];
            uint32_t pa[4];
            fa_abt<E, HD>(pt, 2 * kk, 2, ka, sq, p); /* S^T = K Q^T */
            fa_abt<E, HD>(dpt, 2 * kk, 2, va, sd, p); /* dP^T = V dY^T */
            FA_UNROLL
            for (int j = 0; j < 2; j++)
                FA_UNROLL
                for (int e = 0; e < 4; e++) {
                    int c = kk * 16 + j * 8 + 2 * p.t + e % 2, q = qt * FA_TILE + c;
                    bool valid = q >= key0 + 8 * (e / 2) && q < a.T;
                    pt[j][e] = fa_prob(pt[j][e], a.scale, slse[c], valid);
                    dpt[j][e] = fa_ds(pt[j][e], dpt[j][e], sdsum[c], a.scale, valid);
                }
            fa_pack<E>(pa, pt[0], pt[1]);
            fa_pb<E, HD>(dv, pa, sdt, kk, p); /* dV += rd(P)^T dY */
            fa_pack<E>(pa, dpt[0], dpt[1]);
            fa_pb<E, HD>(dk, pa, sqt, kk, p); /* dK += rd(dS)^T Q */
        }
    }
    fa_store_rows<E, HD>(dk, a, p, kt * FA_TILE + p.warp * 16, p.C + p.hoff);
    fa_store_rows<E, HD>(dv, a, p, kt * FA_TILE + p.warp * 16, 2 * p.C + p.hoff);
}

/* dQ of 64 query rows of one (sequence, head), looping over the key tiles up to the
 * diagonal, 16 keys at a time; longest rows first. */
template <typename E, int HD>
__global__ static void __launch_bounds__(FA_THREADS) gpu_k_flash_dq(fa_args a)
{
    __shared__ __align__(16) uint16_t sk[FA_TILE * FA_LD(HD)], sv[FA_TILE * FA_LD(HD)];
    __shared__ __align__(16) uint16_t skt[HD * FA_LDT];
    const fa_pos p = fa_where(a, HD);
    const int qt = gridDim.x - 1 - blockIdx.x, i0 = qt * FA_TILE + p.warp * 16 + p.g;
    float lse[2], D[2], dq[HD / 8][4];
    uint32_t qa[HD / 16][4], da[HD / 16][4];

    FA_UNROLL
    for (int h = 0; h < 2; h++) {
        int i = i0 + 8 * h;
        lse[h] = i < a.T ? a.lse[(size_t)p.bh * a.T + i] : 0.0f;
        D[h] = i < a.T ? a.dsum[(size_t)p.bh * a.T + i] : 0.0f;
    }
    fa_load<HD>(sk, p.qkv, qt * FA_TILE, a.T, p.ld, p.hoff);
    fa_load<HD>(sv, p.dy, qt * FA_TILE, a.T, p.C, p.hoff);
    __syncthreads();
    fa_frag_a<HD>(qa, sk, p.warp * 16, p);
    fa_frag_a<HD>(da, sv, p.warp * 16, p);
    FA_UNROLL
    for (int d = 0; d < HD / 8; d++)
        dq[d][0] = dq[d][1] = dq[d][2] = dq[d][3] = 0.0f;
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();
        fa_load<HD>(sk, p.qkv, kt * FA_TILE, a.T, p.ld, p.C + p.hoff);
        fa_load<HD>(sv, p.qkv, kt * FA_TILE, a.T, p.ld, 2 * p.C + p.hoff);
        __syncthreads();
        fa_transpose<HD>(skt, sk);
        __syncthreads();
        FA_UNROLL
        for (int kk = 0; kk < FA_TILE / 16; kk++) {
            float s[2][4], dp[2][4];
            uint32_t pa[4];
            fa_abt<E, HD>(s, 2 * kk, 2, qa, sk, p);  /* S = Q K^T */
            fa_abt<E, HD>(dp, 2 * kk, 2, da, sv, p); /* dP = dY V^T */
            FA_UNROLL
            for (int j = 0; j < 2; j++)
                FA_UNROLL
                for (int e = 0; e < 4; e++) {
                    int h = e / 2, i = i0 + 8 * h;
                    int key = kt * FA_TILE + kk * 16 + j * 8 + 2 * p.t + e % 2;
                    bool valid = key <= i && i < a.T;
                    float pr = fa_prob(s[j][e], a.scale, lse[h], valid);
                    dp[j][e] = fa_ds(pr, dp[j][e], D[h], a.scale, valid);
                }
            fa_pack<E>(pa, dp[0], dp[1]);
            fa_pb<E, HD>(dq, pa, skt, kk, p); /* dQ += rd(dS) K */
        }
    }
    fa_store_rows<E, HD>(dq, a, p, qt * FA_TILE + p.warp * 16, p.hoff);
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
    fa_args a = {(const uint16_t *)qkv, NULL, NULL, dt, lse, NULL, NULL, false, y,
                 ydt == GPU_FP32, B, T, H, fa_scale(hd)};
    dim3 grid((unsigned)((T + FA_TILE - 1) / FA_TILE), (unsigned)(B * H));
    fa_kernel flash_fwd = fa_fwd[row][hd / 16 - 1];
    flash_fwd<<<grid, FA_THREADS, 0, stream>>>(a);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* See cuda_ops.h. */
extern "C" int gpu_cuda_flash_bwd_launch(const void *qkv, const void *dy, gpu_dtype dt,
                                         const void *o, gpu_dtype odt, const float *lse, int B,
                                         int T, int H, int hd, float *dsum, void *dqkv,
                                         gpu_dtype ddt, cudaStream_t stream)
{
    int row;
    if (fa_check(dt, B, T, H, hd, qkv, &row) != 0 || dy == NULL || (uintptr_t)dy % 16 != 0 ||
        o == NULL || (uintptr_t)o % 16 != 0 || (odt != dt && odt != GPU_FP32) || lse == NULL ||
        dsum == NULL || dqkv == NULL || (ddt != dt && ddt != GPU_FP32))
        return GPU_EINVAL;
    if (B == 0 || T == 0)
        return 0;
    fa_args a = {(const uint16_t *)qkv, (const uint16_t *)dy, o, odt, (float *)lse, dsum, dqkv,
                 ddt != GPU_FP32, NULL, false, B, T, H, fa_scale(hd)};
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
