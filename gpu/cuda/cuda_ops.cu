/*
 * cuda_ops.cu - the CUDA kernels of the models' non-GEMM ops and their launch functions (the
 * contract is in gpu/cuda/cuda_ops.h; the tests' host wrappers are in
 * tests/cudahost/ops_host.cu): embedding, layer norm (with the residual add before it, and
 * backward the residual gradient's sum and cast), GELU (tanh and erf; the GPT's backward also
 * with the bias gradient), ReLU, bias add, bias gradient, softmax cross-entropy and the causal
 * attention softmax.
 *
 * Numerics: the kernels reproduce the CPU ops of gpu/gpt.c and gpu/mlp.c operation for
 * operation, so that their results equal the CPU's bit for bit wherever the CPU's arithmetic
 * is plain fp32:
 *   - every fp32 operation is an explicit round-to-nearest intrinsic (__fadd_rn, __fmul_rn,
 *     __fdiv_rn, __fsqrt_rn), which nvcc never contracts into an FMA (the CPU code is built
 *     without contraction);
 *   - exp is the CPU's own polynomial (gpt.c's vexp), not expf;
 *   - a row reduction keeps the CPU's order: 16 partial sums, lane k of a 16-lane group
 *     adding elements k, k+16, ... of the row's first multiple of 16 in order, then the tail
 *     summed from 0 and the 16 partial sums added in lane order (gpt.c's sum16);
 *   - a sum over rows (embedding gradients, bias and layer-norm weight gradients) is one
 *     thread per column adding the rows in increasing order, as the CPU loops; for more than
 *     COL_ROWS rows the column sums go through partial sums over chunks of COL_CHUNK_ROWS
 *     rows (then they are deterministic but no longer the CPU's order);
 *   - conversions to and from fp16/bf16 are cuda_common.cuh's bit-exact functions.
 * Left to the GPU's libm: erff and expf of the MLP's GELU, and the double exp and log of the
 * cross-entropy (its losses, and the MLP's probabilities).
 *
 * Layout: elementwise kernels are grid-stride loops; row kernels give each row to a group of
 * 16 lanes (a half warp) whose shuffles use the half's mask, so the two halves of a warp may
 * leave their loops independently; column kernels give each column of a chunk of rows to a
 * thread. Nothing uses atomics, so every result is deterministic. The embedding gradient
 * sorts the rows by token with CUB's stable radix sort, then one block per token adds its
 * rows in order.
 *
 * Threads: the *_launch functions only enqueue on the caller's stream.
 */
#include <math.h>
#include <stdlib.h>

#include <cub/device/device_radix_sort.cuh>

#include "gpu/cuda/cuda_common.cuh"
#include "gpu/cuda/cuda_ops.h"
#include "gpu/cuda/cuda_util.h"

#define OPS_THREADS 256
#define OPS_MAX_BLOCKS 65535u
#define GROUP 16            /* lanes per row: the CPU's 16 partial sums */
#define COL_ROWS 256        /* rows summed by one thread before partial sums are used */
#define COL_CHUNK_ROWS 64   /* then rows per partial sum: enough blocks to fill the GPU */
#define COL_MAX_CHUNKS 4096
#define LN_EPS 1e-5f
#define GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_K1 0.044715f

/* ---- fp32 arithmetic as the CPU does it ----------------------------------------------------- */

__device__ static __forceinline__ float add_rn(float a, float b)
{
    return __fadd_rn(a, b);
}

__device__ static __forceinline__ float sub_rn(float a, float b)
{
    return __fsub_rn(a, b);
}

__device__ static __forceinline__ float mul_rn(float a, float b)
{
    return __fmul_rn(a, b);
}

__device__ static __forceinline__ float div_rn(float a, float b)
{
    return __fdiv_rn(a, b);
}

__device__ static __forceinline__ float nan_f(void)
{
    return __uint_as_float(0x7FC00000u);
}

/* 2^e for e in [-126, 127] (other values give garbage, as on the CPU). */
__device__ static __forceinline__ float pow2i(int32_t e)
{
    return __uint_as_float((uint32_t)(e + 127) << 23);
}

/* gpt.c's vexp, operation for operation: Cody-Waite reduction by ln 2, Cephes' degree-6
 * polynomial, the power of two applied as two factors. */
__device__ static __forceinline__ float cpu_exp(float x)
{
    float xc = x < -104.0f ? -104.0f : x;
    xc = xc > 89.0f ? 89.0f : xc;
    float t = add_rn(mul_rn(xc, 1.44269504088896341f), 12582912.0f);
    float n = sub_rn(t, 12582912.0f);
    int32_t ni = (int32_t)__float_as_uint(t) - 0x4B400000;
    float r = sub_rn(xc, mul_rn(n, 0.693359375f));
    r = add_rn(r, mul_rn(n, 2.12194440e-4f));
    float p = 1.9875691500e-4f;
    p = add_rn(mul_rn(p, r), 1.3981999507e-3f);
    p = add_rn(mul_rn(p, r), 8.3334519073e-3f);
    p = add_rn(mul_rn(p, r), 4.1665795894e-2f);
    p = add_rn(mul_rn(p, r), 1.6666665459e-1f);
    p = add_rn(mul_rn(p, r), 5.0000001201e-1f);
    p = add_rn(add_rn(mul_rn(p, mul_rn(r, r)), r), 1.0f);
    int32_t n1 = ni >> 1, n2 = ni - n1;
    float y = mul_rn(mul_rn(p, pow2i(n1)), pow2i(n2));
    return x != x ? x : y;
}

/* ---- storage -------------------------------------------------------------------------------- */

/* The value of the 16-bit pattern h of dt (fp16 or bf16). */
__device__ static __forceinline__ float ld16(uint16_t h, gpu_dtype dt)
{
    return __uint_as_float(dt == GPU_FP16 ? gpu_fmt_f16_to_f32(h) : gpu_fmt_bf16_to_f32(h));
}

/* Element i of a tensor stored in dt, as an fp32 value. */
__device__ static __forceinline__ float ld(const void *p, size_t i, gpu_dtype dt)
{
    if (dt == GPU_FP32)
        return ((const float *)p)[i];
    return ld16(((const uint16_t *)p)[i], dt);
}

/* v rounded to dt (gpu_round). */
__device__ static __forceinline__ float rd(float v, gpu_dtype dt)
{
    uint32_t u = __float_as_uint(v);
    if (dt == GPU_FP16)
        return __uint_as_float(gpu_fmt_f16_to_f32(gpu_fmt_f32_to_f16(u)));
    if (dt == GPU_BF16)
        return __uint_as_float(gpu_fmt_bf16_round(u));
    return v;
}

/* Store v into element i of a tensor stored in dt (rounding it to dt). */
__device__ static __forceinline__ void st(void *p, size_t i, gpu_dtype dt, float v)
{
    uint32_t u = __float_as_uint(v);
    if (dt == GPU_FP32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = dt == GPU_FP16 ? gpu_fmt_f32_to_f16(u) : gpu_fmt_f32_to_bf16(u);
}

/* ---- 16-lane row groups --------------------------------------------------------------------- */

__device__ static __forceinline__ unsigned group_lane(void)
{
    return threadIdx.x % GROUP;
}

/* The shuffle mask of the calling thread's half warp. */
__device__ static __forceinline__ unsigned group_mask(void)
{
    return 0xFFFFu << (threadIdx.x & 16u);
}

__device__ static __forceinline__ size_t group_first(void)
{
    return ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / GROUP;
}

__device__ static __forceinline__ size_t group_stride(void)
{
    return (size_t)gridDim.x * blockDim.x / GROUP;
}

/* The end of the CPU's sum16: s (the tail, summed from 0) plus the 16 lanes' partial sums in
 * lane order. Every lane of the group returns the same value. */
__device__ static __forceinline__ float fold16(float s, float acc, unsigned mask)
{
    for (int q = 0; q < GROUP; q++)
        s = add_rn(s, __shfl_sync(mask, acc, q, GROUP));
    return s;
}

static bool dt_ok(gpu_dtype dt)
{
    return (unsigned)dt <= (unsigned)GPU_BF16;
}

static unsigned row_blocks(size_t rows)
{
    return gpu_cuda_blocks(rows * GROUP, OPS_THREADS, OPS_MAX_BLOCKS);
}

static unsigned flat_blocks(size_t n)
{
    return gpu_cuda_blocks(n, OPS_THREADS, OPS_MAX_BLOCKS);
}

/* ---- embedding ------------------------------------------------------------------------------ */

static __global__ void __launch_bounds__(OPS_THREADS)
k_embed_fwd(const int *x, int T, int C, int V, const void *wte, const void *wpe, gpu_dtype wdt,
            gpu_dtype dt, void *out, gpu_dtype odt, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / (size_t)C, c = i - r * (size_t)C, t = r % (size_t)T;
        int tok = x[r];
        float v = nan_f();
        if (tok >= 0 && tok < V)
            v = add_rn(ld(wte, (size_t)tok * C + c, wdt), ld(wpe, t * C + c, wdt));
        st(out, i, odt, rd(v, dt));
    }
}

/* See cuda_ops.h. */
int gpu_cuda_embed_fwd_launch(const int *x, int B, int T, int C, int V, const void *wte,
                              const void *wpe, gpu_dtype wdt, gpu_dtype dt, void *out,
                              gpu_dtype odt, cudaStream_t stream)
{
    size_t n = (size_t)B * (size_t)T * (size_t)C;
    if (B < 0 || T < 1 || C < 1 || V < 1 || !dt_ok(wdt) || !dt_ok(dt) || !dt_ok(odt))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if (x == NULL || wte == NULL || wpe == NULL || out == NULL)
        return GPU_EINVAL;
    k_embed_fwd<<<flat_blocks(n), OPS_THREADS, 0, stream>>>(x, T, C, V, wte, wpe, wdt, dt, out,
                                                            odt, n);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

static __global__ void k_iota(int *v, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        v[i] = i;
}

/* One block per run of equal tokens in the sorted keys: each thread adds a column's rows in
 * increasing row order (the sort is stable) onto what dwte holds. */
static __global__ void __launch_bounds__(OPS_THREADS)
k_embed_dwte(const unsigned *key, const int *row, int N, int C, int V, const void *dout,
             gpu_dtype ddt, gpu_dtype dt, float *dwte)
{
    for (int pos = blockIdx.x; pos < N; pos += gridDim.x) {
        const unsigned v = key[pos];
        if (v >= (unsigned)V || (pos > 0 && key[pos - 1] == v))
            continue;
        float *w = dwte + (size_t)v * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = w[c];
            for (int k = pos; k < N && key[k] == v; k++)
                acc = add_rn(acc, rd(ld(dout, (size_t)row[k] * C + c, ddt), dt));
            w[c] = acc;
        }
    }
}

/* dwpe[t][c] += the rows of position t, batch by batch in order. */
static __global__ void __launch_bounds__(OPS_THREADS)
k_embed_dwpe(int B, int T, int C, const void *dout, gpu_dtype ddt, gpu_dtype dt, float *dwpe)
{
    size_t n = (size_t)T * C, stride = (size_t)T * C;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float acc = dwpe[i];
        for (int b = 0; b < B; b++)
            acc = add_rn(acc, rd(ld(dout, (size_t)b * stride + i, ddt), dt));
        dwpe[i] = acc;
    }
}

/* The embedding gradient's workspace: sorted keys, row indices before and after the sort
 * (N ints each, 256-byte aligned), then CUB's temporaries (*temp bytes). */
static int embed_layout(int N, size_t *temp, size_t *total)
{
    size_t tb = 0;
    cudaError_t e = cub::DeviceRadixSort::SortPairs(NULL, tb, (const unsigned *)NULL,
                                                    (unsigned *)NULL, (const int *)NULL,
                                                    (int *)NULL, N, 0, 32, (cudaStream_t)0);
    if (e != cudaSuccess)
        return gpu_cuda_fail(e, "cub::DeviceRadixSort::SortPairs (size query)", __FILE__,
                             __LINE__);
    *temp = tb;
    *total = 3 * gpu_align256((size_t)N * sizeof(int)) + tb;
    return 0;
}

/* See cuda_ops.h. */
int gpu_cuda_embed_bwd_workspace(int N, size_t *bytes)
{
    size_t temp;
    int rc = gpu_cuda_ready();
    if (rc != 0)
        return rc;
    if (N < 0 || bytes == NULL)
        return GPU_EINVAL;
    return embed_layout(N, &temp, bytes);
}

/* See cuda_ops.h. */
int gpu_cuda_embed_bwd_launch(const int *x, int B, int T, int C, int V, const void *dout,
                              gpu_dtype ddt, gpu_dtype dt, float *dwte, float *dwpe, void *work,
                              size_t work_bytes, cudaStream_t stream)
{
    size_t N = (size_t)B * (size_t)T, temp, total;
    if (B < 0 || T < 1 || C < 1 || V < 1 || N > (size_t)INT32_MAX || !dt_ok(ddt) || !dt_ok(dt))
        return GPU_EINVAL;
    if (N == 0)
        return 0;
    if (x == NULL || dout == NULL || dwte == NULL || dwpe == NULL || work == NULL)
        return GPU_EINVAL;
    int rc = embed_layout((int)N, &temp, &total);
    if (rc != 0)
        return rc;
    if (work_bytes < total)
        return GPU_EINVAL;
    size_t a = gpu_align256(N * sizeof(int));
    unsigned *keys = (unsigned *)work;
    int *rows_in = (int *)((char *)work + a), *rows = (int *)((char *)work + 2 * a);
    void *cub_temp = (char *)work + 3 * a;

    k_iota<<<flat_blocks(N), OPS_THREADS, 0, stream>>>(rows_in, (int)N);
    GPU_CUDA_CHECK(cudaGetLastError());
    GPU_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, temp, (const unsigned *)x, keys,
                                                   (const int *)rows_in, rows, (int)N, 0, 32,
                                                   stream));
    unsigned blocks = N < OPS_MAX_BLOCKS ? (unsigned)N : OPS_MAX_BLOCKS;
    k_embed_dwte<<<blocks, OPS_THREADS, 0, stream>>>(keys, rows, (int)N, C, V, dout, ddt, dt,
                                                     dwte);
    GPU_CUDA_CHECK(cudaGetLastError());
    k_embed_dwpe<<<flat_blocks((size_t)T * C), OPS_THREADS, 0, stream>>>(B, T, C, dout, ddt, dt,
                                                                        dwpe);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* ---- column sums over rows (layer-norm weights, biases) ------------------------------------- */

/* Chunks of rows the column sums split rows into (1: one sequential sum, the CPU's order). */
static int col_chunks(int rows)
{
    if (rows <= COL_ROWS)
        return 1;
    int c = (rows + COL_CHUNK_ROWS - 1) / COL_CHUNK_ROWS;
    return c < COL_MAX_CHUNKS ? c : COL_MAX_CHUNKS;
}

/* out[j] = rd(sum over chunks of part[k][j], dt), the chunks in order. */
static __global__ void __launch_bounds__(OPS_THREADS)
k_col_finish(const float *part, int nchunks, int n, gpu_dtype dt, float *out)
{
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int k = 0; k < nchunks; k++)
            s = add_rn(s, part[(size_t)k * n + j]);
        out[j] = rd(s, dt);
    }
}

/* ---- layer norm ----------------------------------------------------------------------------- */

/* Element i of the layer norm's input: x, or the residual add rd(x + r, xdt) when r is given. */
__device__ static __forceinline__ float ln_in(const void *x, gpu_dtype xdt, const void *r,
                                              gpu_dtype rdt, size_t i)
{
    float v = ld(x, i, xdt);
    return r == NULL ? v : rd(add_rn(v, ld(r, i, rdt)), xdt);
}

/* One row per group; with r, the first pass writes the row's input x + r to xo (the tail,
 * which every lane sums, by lane 0) and the other passes compute it again. */
static __global__ void __launch_bounds__(OPS_THREADS)
k_ln_fwd(const void *x, gpu_dtype xdt, const void *r, gpu_dtype rdt, void *xo, const void *g,
         const void *b, gpu_dtype wdt, int N, int C, gpu_dtype dt, void *y, gpu_dtype ydt,
         float *mean, float *rstd)
{
    const unsigned lane = group_lane(), mask = group_mask();
    const int c16 = C & ~(GROUP - 1);
    for (size_t row = group_first(); row < (size_t)N; row += group_stride()) {
        const size_t o = row * (size_t)C;
        float acc = 0.0f, s = 0.0f;
        for (int j = lane; j < c16; j += GROUP) {
            float v = ln_in(x, xdt, r, rdt, o + j);
            if (r != NULL)
                st(xo, o + j, xdt, v);
            acc = add_rn(acc, rd(v, dt));
        }
        for (int j = c16; j < C; j++) {
            float v = ln_in(x, xdt, r, rdt, o + j);
            if (r != NULL && lane == 0)
                st(xo, o + j, xdt, v);
            s = add_rn(s, rd(v, dt));
        }
        const float mu = div_rn(fold16(s, acc, mask), (float)C);

        acc = 0.0f;
        s = 0.0f;
        for (int j = lane; j < c16; j += GROUP) {
            float d = sub_rn(rd(ln_in(x, xdt, r, rdt, o + j), dt), mu);
            acc = add_rn(acc, mul_rn(d, d));
        }
        for (int j = c16; j < C; j++) {
            float d = sub_rn(rd(ln_in(x, xdt, r, rdt, o + j), dt), mu);
            s = add_rn(s, mul_rn(d, d));
        }
        const float var = div_rn(fold16(s, acc, mask), (float)C);
        const float rs = div_rn(1.0f, __fsqrt_rn(add_rn(var, LN_EPS)));

        for (int j = lane; j < C; j += GROUP) {
            float xh = mul_rn(sub_rn(rd(ln_in(x, xdt, r, rdt, o + j), dt), mu), rs);
            st(y, o + j, ydt, rd(add_rn(mul_rn(xh, ld(g, j, wdt)), ld(b, j, wdt)), dt));
        }
        if (lane == 0) {
            mean[row] = mu;
            rstd[row] = rs;
        }
    }
}

/* Both layer-norm forwards: r NULL (plain) or the residual add first. */
static int ln_fwd_launch(const void *x, gpu_dtype xdt, const void *r, gpu_dtype rdt, void *xo,
                         const void *g, const void *b, gpu_dtype wdt, int N, int C, gpu_dtype dt,
                         void *y, gpu_dtype ydt, float *mean, float *rstd, cudaStream_t stream)
{
    if (N < 0 || C < 1 || !dt_ok(xdt) || !dt_ok(rdt) || !dt_ok(wdt) || !dt_ok(dt) ||
        !dt_ok(ydt))
        return GPU_EINVAL;
    if (N == 0)
        return 0;
    if (x == NULL || g == NULL || b == NULL || y == NULL || mean == NULL || rstd == NULL ||
        (r != NULL && xo == NULL))
        return GPU_EINVAL;
    k_ln_fwd<<<row_blocks((size_t)N), OPS_THREADS, 0, stream>>>(x, xdt, r, rdt, xo, g, b, wdt, N,
                                                                C, dt, y, ydt, mean, rstd);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* See cuda_ops.h. */
int gpu_cuda_layernorm_fwd_launch(const void *x, gpu_dtype xdt, const void *g, const void *b,
                                  gpu_dtype wdt, int N, int C, gpu_dtype dt, void *y,
                                  gpu_dtype ydt, float *mean, float *rstd, cudaStream_t stream)
{
    return ln_fwd_launch(x, xdt, NULL, GPU_FP32, NULL, g, b, wdt, N, C, dt, y, ydt, mean, rstd,
                         stream);
}

/* See cuda_ops.h. */
int gpu_cuda_add_layernorm_fwd_launch(const void *a, const void *r, gpu_dtype rdt, void *xo,
                                      gpu_dtype xdt, const void *g, const void *b,
                                      gpu_dtype wdt, int N, int C, gpu_dtype dt, void *y,
                                      gpu_dtype ydt, float *mean, float *rstd,
                                      cudaStream_t stream)
{
    if (r == NULL)
        return GPU_EINVAL;
    return ln_fwd_launch(a, xdt, r, rdt, xo, g, b, wdt, N, C, dt, y, ydt, mean, rstd, stream);
}

/* dx of one row per group (gpt.c's ln_row_bwd with its 16 partial sums), put where out says. */
static __global__ void __launch_bounds__(OPS_THREADS)
k_ln_bwd_dx(const void *dy, gpu_dtype dydt, const void *x, gpu_dtype xdt, const float *mean,
            const float *rstd, const void *g, gpu_dtype wdt, int N, int C, gpu_dtype dt,
            gpu_cuda_dres out)
{
    const unsigned lane = group_lane(), mask = group_mask();
    const int c16 = C & ~(GROUP - 1);
    for (size_t row = group_first(); row < (size_t)N; row += group_stride()) {
        const size_t o = row * (size_t)C;
        const float mu = mean[row], rs = rstd[row];
        float a1 = 0.0f, a2 = 0.0f, m1 = 0.0f, m2 = 0.0f;
        for (int j = lane; j < c16; j += GROUP) {
            float xh = mul_rn(sub_rn(rd(ld(x, o + j, xdt), dt), mu), rs);
            float d = mul_rn(rd(ld(dy, o + j, dydt), dt), ld(g, j, wdt));
            a1 = add_rn(a1, d);
            a2 = add_rn(a2, mul_rn(d, xh));
        }
        for (int j = c16; j < C; j++) {
            float xh = mul_rn(sub_rn(rd(ld(x, o + j, xdt), dt), mu), rs);
            float d = mul_rn(rd(ld(dy, o + j, dydt), dt), ld(g, j, wdt));
            m1 = add_rn(m1, d);
            m2 = add_rn(m2, mul_rn(d, xh));
        }
        m1 = div_rn(fold16(m1, a1, mask), (float)C);
        m2 = div_rn(fold16(m2, a2, mask), (float)C);
        for (int j = lane; j < C; j += GROUP) {
            float d = mul_rn(rd(ld(dy, o + j, dydt), dt), ld(g, j, wdt));
            float xh = mul_rn(sub_rn(rd(ld(x, o + j, xdt), dt), mu), rs);
            float v = rd(rd(mul_rn(rs, sub_rn(sub_rn(d, m1), mul_rn(xh, m2))), dt), out.rdt);
            if (out.acc)
                v = rd(add_rn(ld(out.dres, o + j, out.rdt), v), out.rdt);
            st(out.dres, o + j, out.rdt, v);
            if (out.lin != NULL)
                st(out.lin, o + j, out.lindt, rd(v, out.lindt));
        }
    }
}

/* dg and db of one chunk of rows, one thread per column; written rounded when there is one
 * chunk, else as partial sums part[k][j] (dg) and part[nchunks + k][j] (db). */
static __global__ void __launch_bounds__(OPS_THREADS)
k_ln_bwd_cols(const void *dy, gpu_dtype dydt, const void *x, gpu_dtype xdt, const float *mean,
              const float *rstd, int N, int C, gpu_dtype dt, int per, int nchunks, float *dg,
              float *db, float *part)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x, k = blockIdx.y;
    if (j >= C)
        return;
    const int i0 = k * per, i1 = N - i0 < per ? N : i0 + per;
    float sg = 0.0f, sb = 0.0f;
    for (int i = i0; i < i1; i++) {
        size_t o = (size_t)i * C + j;
        float d = rd(ld(dy, o, dydt), dt);
        float xh = mul_rn(sub_rn(rd(ld(x, o, xdt), dt), mean[i]), rstd[i]);
        sg = add_rn(sg, mul_rn(d, xh));
        sb = add_rn(sb, d);
    }
    if (nchunks == 1) {
        dg[j] = rd(sg, dt);
        db[j] = rd(sb, dt);
    } else {
        part[(size_t)k * C + j] = sg;
        part[((size_t)nchunks + k) * C + j] = sb;
    }
}

/* See cuda_ops.h. */
size_t gpu_cuda_layernorm_bwd_workspace(int N, int C)
{
    int nchunks = col_chunks(N);
    if (nchunks == 1 || C < 1)
        return 0;
    return 2 * (size_t)nchunks * (size_t)C * sizeof(float);
}

/* See cuda_ops.h. */
int gpu_cuda_layernorm_bwd_resid_launch(const void *dy, gpu_dtype dydt, const void *x,
                                        gpu_dtype xdt, const float *mean, const float *rstd,
                                        const void *g, gpu_dtype wdt, int N, int C, gpu_dtype dt,
                                        const gpu_cuda_dres *out, float *dg, float *db,
                                        void *work, cudaStream_t stream)
{
    if (N < 0 || C < 1 || out == NULL || !dt_ok(dydt) || !dt_ok(xdt) || !dt_ok(wdt) ||
        !dt_ok(dt) || !dt_ok(out->rdt) || !dt_ok(out->lindt))
        return GPU_EINVAL;
    int nchunks = col_chunks(N), per = N > 0 ? (N + nchunks - 1) / nchunks : 0;
    if (dg == NULL || db == NULL || (nchunks > 1 && work == NULL))
        return GPU_EINVAL;
    if (N > 0 && (dy == NULL || x == NULL || mean == NULL || rstd == NULL || g == NULL ||
                  out->dres == NULL))
        return GPU_EINVAL;
    if (out->lin == dy && dy != NULL && out->lindt != dydt)
        return GPU_EINVAL;
    /* the column sums first: the dx kernel may overwrite dy with lin; with no rows the sums
     * are the CPU's zeros */
    float *part = (float *)work;
    dim3 grid((unsigned)((C + OPS_THREADS - 1) / OPS_THREADS), (unsigned)nchunks);
    k_ln_bwd_cols<<<grid, OPS_THREADS, 0, stream>>>(dy, dydt, x, xdt, mean, rstd, N, C, dt, per,
                                                    nchunks, dg, db, part);
    GPU_CUDA_CHECK(cudaGetLastError());
    if (nchunks > 1) {
        k_col_finish<<<flat_blocks((size_t)C), OPS_THREADS, 0, stream>>>(part, nchunks, C, dt,
                                                                         dg);
        GPU_CUDA_CHECK(cudaGetLastError());
        k_col_finish<<<flat_blocks((size_t)C), OPS_THREADS, 0, stream>>>(
            part + (size_t)nchunks * C, nchunks, C, dt, db);
        GPU_CUDA_CHECK(cudaGetLastError());
    }
    if (N > 0) {
        k_ln_bwd_dx<<<row_blocks((size_t)N), OPS_THREADS, 0, stream>>>(
            dy, dydt, x, xdt, mean, rstd, g, wdt, N, C, dt, *out);
        GPU_CUDA_CHECK(cudaGetLastError());
    }
    return 0;
}

/* See cuda_ops.h. */
int gpu_cuda_layernorm_bwd_launch(const void *dy, gpu_dtype dydt, const void *x, gpu_dtype xdt,
                                  const float *mean, const float *rstd, const void *g,
                                  gpu_dtype wdt, int N, int C, gpu_dtype dt, void *dx,
                                  gpu_dtype dxdt, float *dg, float *db, void *work,
                                  cudaStream_t stream)
{
    gpu_cuda_dres out = {dx, dxdt, false, NULL, GPU_FP32};
    return gpu_cuda_layernorm_bwd_resid_launch(dy, dydt, x, xdt, mean, rstd, g, wdt, N, C, dt,
                                               &out, dg, db, work, stream);
}

/* ---- GELU (tanh approximation, GPT) --------------------------------------------------------- */

/* z = sqrt(2/pi) (x + 0.044715 x^3), as gpt.c groups it. */
__device__ static __forceinline__ float gelu_z(float x)
{
    return mul_rn(GELU_K0, add_rn(x, mul_rn(mul_rn(mul_rn(GELU_K1, x), x), x)));
}

__device__ static __forceinline__ float gelu_tanh(float x)
{
    return div_rn(x, add_rn(1.0f, cpu_exp(mul_rn(-2.0f, gelu_z(x)))));
}

/* s + 2 x s (1 - s) z'(x), s = sigmoid(2z). */
__device__ static __forceinline__ float gelu_tanh_grad(float x)
{
    float s = div_rn(1.0f, add_rn(1.0f, cpu_exp(mul_rn(-2.0f, gelu_z(x)))));
    float dz = mul_rn(GELU_K0, add_rn(1.0f, mul_rn(mul_rn(mul_rn(3.0f, GELU_K1), x), x)));
    return add_rn(s, mul_rn(mul_rn(mul_rn(mul_rn(2.0f, x), s), sub_rn(1.0f, s)), dz));
}

static __global__ void __launch_bounds__(OPS_THREADS)
k_gelu_tanh_fwd(const void *u, gpu_dtype udt, void *out, gpu_dtype odt, size_t n, gpu_dtype dt)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        st(out, i, odt, rd(gelu_tanh(rd(ld(u, i, udt), dt)), dt));
}

/* dx = rd(rd(dy, dt) gelu'(rd(u, dt)), dt) of element i. */
__device__ static __forceinline__ float gelu_bwd_at(const void *dy, gpu_dtype gdt, const void *u,
                                                    gpu_dtype udt, size_t i, gpu_dtype dt)
{
    float d = rd(ld(dy, i, gdt), dt);
    return rd(mul_rn(d, gelu_tanh_grad(rd(ld(u, i, udt), dt))), dt);
}

static __global__ void __launch_bounds__(OPS_THREADS)
k_gelu_tanh_bwd(const void *dy, void *dx, gpu_dtype gdt, const void *u, gpu_dtype udt,
                size_t n, gpu_dtype dt)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        st(dx, i, gdt, gelu_bwd_at(dy, gdt, u, udt, i, dt));
}

/* See cuda_ops.h. */
int gpu_cuda_gelu_tanh_fwd_launch(const void *u, gpu_dtype udt, void *out, gpu_dtype odt,
                                  size_t n, gpu_dtype dt, cudaStream_t stream)
{
    if (!dt_ok(udt) || !dt_ok(odt) || !dt_ok(dt))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if (u == NULL || out == NULL)
        return GPU_EINVAL;
    k_gelu_tanh_fwd<<<flat_blocks(n), OPS_THREADS, 0, stream>>>(u, udt, out, odt, n, dt);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* See cuda_ops.h. */
int gpu_cuda_gelu_tanh_bwd_launch(const void *dy, void *dx, gpu_dtype gdt, const void *u,
                                  gpu_dtype udt, size_t n, gpu_dtype dt, cudaStream_t stream)
{
    if (!dt_ok(gdt) || !dt_ok(udt) || !dt_ok(dt))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if (dy == NULL || dx == NULL || u == NULL)
        return GPU_EINVAL;
    k_gelu_tanh_bwd<<<flat_blocks(n), OPS_THREADS, 0, stream>>>(dy, dx, gdt, u, udt, n, dt);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* ---- MLP activations (ReLU, GELU with erf) -------------------------------------------------- */

/* mlp.c's gelu and gelu_grad, with the GPU's erff and expf. */
__device__ static __forceinline__ float gelu_erf(float x)
{
    return mul_rn(mul_rn(0.5f, x), add_rn(1.0f, erff(mul_rn(x, 0.70710678f))));
}

__device__ static __forceinline__ float gelu_erf_grad(float x)
{
    float e = expf(mul_rn(mul_rn(-0.5f, x), x));
    return add_rn(mul_rn(0.5f, add_rn(1.0f, erff(mul_rn(x, 0.70710678f)))),
                  mul_rn(mul_rn(x, e), 0.39894228f));
}

static __global__ void __launch_bounds__(OPS_THREADS)
k_act_fwd(int gelu, const void *z, gpu_dtype zdt, void *out, gpu_dtype odt, size_t n,
          gpu_dtype dt)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = ld(z, i, zdt);
        v = gelu ? gelu_erf(v) : (v > 0.0f ? v : 0.0f);
        st(out, i, odt, rd(v, dt));
    }
}

static __global__ void __launch_bounds__(OPS_THREADS)
k_act_bwd(int gelu, const void *dy, void *dx, gpu_dtype gdt, const void *saved, gpu_dtype sdt,
          size_t n, gpu_dtype dt)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float d = rd(ld(dy, i, gdt), dt), s = ld(saved, i, sdt);
        d = gelu ? rd(mul_rn(d, gelu_erf_grad(s)), dt) : (s > 0.0f ? d : 0.0f);
        st(dx, i, gdt, d);
    }
}

/* See cuda_ops.h. */
int gpu_cuda_act_fwd_launch(gpu_activation act, const void *z, gpu_dtype zdt, void *out,
                            gpu_dtype odt, size_t n, gpu_dtype dt, cudaStream_t stream)
{
    if ((act != GPU_ACT_RELU && act != GPU_ACT_GELU) || !dt_ok(zdt) || !dt_ok(odt) ||
        !dt_ok(dt))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if (z == NULL || out == NULL)
        return GPU_EINVAL;
    k_act_fwd<<<flat_blocks(n), OPS_THREADS, 0, stream>>>(act == GPU_ACT_GELU, z, zdt, out, odt,
                                                          n, dt);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* See cuda_ops.h. */
int gpu_cuda_act_bwd_launch(gpu_activation act, const void *dy, void *dx, gpu_dtype gdt,
                            const void *saved, gpu_dtype sdt, size_t n, gpu_dtype dt,
                            cudaStream_t stream)
{
    if ((act != GPU_ACT_RELU && act != GPU_ACT_GELU) || !dt_ok(gdt) || !dt_ok(sdt) ||
        !dt_ok(dt))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if (dy == NULL || dx == NULL || saved == NULL)
        return GPU_EINVAL;
    k_act_bwd<<<flat_blocks(n), OPS_THREADS, 0, stream>>>(act == GPU_ACT_GELU, dy, dx, gdt,
                                                          saved, sdt, n, dt);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* ---- bias add, bias gradient --------------------------------------------------------------- */

static __global__ void __launch_bounds__(OPS_THREADS)
k_bias_add(const void *in, gpu_dtype idt, const void *bias, gpu_dtype bdt, int n, gpu_dtype dt,
           void *out, gpu_dtype odt, size_t total)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        st(out, i, odt, rd(add_rn(ld(in, i, idt), ld(bias, i % (size_t)n, bdt)), dt));
}

/* See cuda_ops.h. */
int gpu_cuda_bias_add_launch(const void *in, gpu_dtype idt, const void *bias, gpu_dtype bdt,
                             int rows, int n, gpu_dtype dt, void *out, gpu_dtype odt,
                             cudaStream_t stream)
{
    size_t total = (size_t)rows * (size_t)n;
    if (rows < 0 || n < 0 || !dt_ok(idt) || !dt_ok(bdt) || !dt_ok(dt) || !dt_ok(odt))
        return GPU_EINVAL;
    if (total == 0)
        return 0;
    if (in == NULL || bias == NULL || out == NULL)
        return GPU_EINVAL;
    k_bias_add<<<flat_blocks(total), OPS_THREADS, 0, stream>>>(in, idt, bias, bdt, n, dt, out,
                                                               odt, total);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* Column sums of dz over one chunk of rows (see k_ln_bwd_cols). With u, dz is first replaced
 * by its GELU backward in gdt (stored into dx, in zdt: k_gelu_tanh_bwd's values), and those
 * are summed as stored. */
static __global__ void __launch_bounds__(OPS_THREADS)
k_bias_cols(const void *dz, void *dx, gpu_dtype zdt, const void *u, gpu_dtype udt, gpu_dtype gdt,
            int rows, int n, gpu_dtype dt, int per, int nchunks, float *db, float *part)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x, k = blockIdx.y;
    if (j >= n)
        return;
    const int i0 = k * per, i1 = rows - i0 < per ? rows : i0 + per;
    float s = 0.0f;
    for (int i = i0; i < i1; i++) {
        size_t o = (size_t)i * n + j;
        float v = u != NULL ? rd(gelu_bwd_at(dz, zdt, u, udt, o, gdt), zdt) : ld(dz, o, zdt);
        if (u != NULL)
            st(dx, o, zdt, v);
        s = add_rn(s, rd(v, dt));
    }
    if (nchunks == 1)
        db[j] = rd(s, dt);
    else
        part[(size_t)k * n + j] = s;
}

/* See cuda_ops.h. */
size_t gpu_cuda_bias_grad_workspace(int rows, int n)
{
    int nchunks = col_chunks(rows);
    if (nchunks == 1 || n < 1)
        return 0;
    return (size_t)nchunks * (size_t)n * sizeof(float);
}

/* Both bias gradients: of dz, or (u not NULL) of dz's GELU backward, written into dx. */
static int bias_cols_launch(const void *dz, void *dx, gpu_dtype zdt, const void *u,
                            gpu_dtype udt, gpu_dtype gdt, int rows, int n, gpu_dtype dt,
                            float *db, void *work, cudaStream_t stream)
{
    if (rows < 0 || n < 0 || !dt_ok(zdt) || !dt_ok(udt) || !dt_ok(gdt) || !dt_ok(dt))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    int nchunks = col_chunks(rows), per = rows > 0 ? (rows + nchunks - 1) / nchunks : 0;
    if (db == NULL || (rows > 0 && (dz == NULL || (u != NULL && dx == NULL))) ||
        (nchunks > 1 && work == NULL))
        return GPU_EINVAL;
    float *part = (float *)work;
    dim3 grid((unsigned)((n + OPS_THREADS - 1) / OPS_THREADS), (unsigned)nchunks);
    k_bias_cols<<<grid, OPS_THREADS, 0, stream>>>(dz, dx, zdt, u, udt, gdt, rows, n, dt, per,
                                                  nchunks, db, part);
    GPU_CUDA_CHECK(cudaGetLastError());
    if (nchunks > 1) {
        k_col_finish<<<flat_blocks((size_t)n), OPS_THREADS, 0, stream>>>(part, nchunks, n, dt,
                                                                         db);
        GPU_CUDA_CHECK(cudaGetLastError());
    }
    return 0;
}

/* See cuda_ops.h. */
int gpu_cuda_bias_grad_launch(const void *dz, gpu_dtype zdt, int rows, int n, gpu_dtype dt,
                              float *db, void *work, cudaStream_t stream)
{
    return bias_cols_launch(dz, NULL, zdt, NULL, GPU_FP32, GPU_FP32, rows, n, dt, db, work,
                            stream);
}

/* See cuda_ops.h. */
int gpu_cuda_gelu_tanh_bwd_bias_launch(const void *dy, void *dx, gpu_dtype gdt, const void *u,
                                       gpu_dtype udt, int rows, int n, gpu_dtype dt,
                                       gpu_dtype bdt, float *db, void *work, cudaStream_t stream)
{
    if (rows > 0 && n > 0 && u == NULL)
        return GPU_EINVAL;
    return bias_cols_launch(dy, dx, gdt, u, udt, dt, rows, n, bdt, db, work, stream);
}

/* ---- softmax cross-entropy ------------------------------------------------------------------ */

typedef struct {
    gpu_cuda_ce_style style;
    gpu_dtype ldt, lin_dt, ce_dt, pdt;
    void *probs;       /* NULL: not stored */
    bool grad;         /* dlogits over the logits */
    float seed;
    const float *d_seed;
    int count;
    bool vec;          /* 16-bit logits, rows of whole 16-byte chunks: the max pass loads those */
} ce_args;

/* A logit v (a value of ldt) as the cross-entropy sees it. */
__device__ static __forceinline__ float ce_zv(const ce_args *a, float v)
{
    float z = rd(v, a->lin_dt);
    return a->style == GPU_CUDA_CE_GPT ? rd(z, a->ce_dt) : z;
}

/* The row's logit j as the cross-entropy sees it. */
__device__ static __forceinline__ float ce_z(const ce_args *a, const void *lg, size_t i)
{
    return ce_zv(a, ld(lg, i, a->ldt));
}

/* Logit j (value z) into a lane's running argmax: the last NaN's index, else the first
 * maximum (in increasing j, as each lane visits its logits). */
__device__ static __forceinline__ void ce_arg(float z, int j, int *nanidx, int *li, float *lm)
{
    if (z != z)
        *nanidx = j;
    else if (*li < 0 || z > *lm) {
        *lm = z;
        *li = j;
    }
}

/* One row per group: argmax and max (pass 1: its result does not depend on the order, so
 * 16-bit rows of whole 16-byte chunks are read 8 logits per load), the exp sum (pass 2, in
 * the CPU's 16-lane order), probabilities and dlogits (pass 3, after the group's last read
 * of the row, so dlogits may overwrite it); lane 0 writes the row's loss and hit. */
static __global__ void __launch_bounds__(OPS_THREADS)
k_ce(ce_args a, void *logits, const int *y, int N, int V, double *row_loss, int *row_hit)
{
    const unsigned lane = group_lane(), mask = group_mask();
    const int v16 = V & ~(GROUP - 1);
    const bool gpt = a.style == GPU_CUDA_CE_GPT;
    const float g = a.grad ? div_rn(a.d_seed ? *a.d_seed : a.seed, (float)a.count) : 0.0f;
    for (size_t row = group_first(); row < (size_t)N; row += group_stride()) {
        const size_t o = row * (size_t)V;
        const int t = y[row];
        int li = -1, nanidx = -1;
        float lm = 0.0f;
        if (a.vec) /* the order within a row does not matter here: 8 logits per load */
            for (int c = lane; c < V / 8; c += GROUP) {
                gpu_dev_chunk q = ((const gpu_dev_chunk *)((const uint16_t *)logits + o))[c];
                for (int e = 0; e < 8; e++)
                    ce_arg(ce_zv(&a, ld16(gpu_dev_chunk_bits(q, e), a.ldt)), 8 * c + e, &nanidx,
                           &li, &lm);
            }
        else
            for (int j = lane; j < V; j += GROUP)
                ce_arg(ce_z(&a, logits, o + j), j, &nanidx, &li, &lm);
        /* the first maximum, or the last NaN: the same winner on every lane */
        for (int off = GROUP / 2; off > 0; off >>= 1) {
            int on = __shfl_xor_sync(mask, nanidx, off, GROUP);
            int oi = __shfl_xor_sync(mask, li, off, GROUP);
            float om = __shfl_xor_sync(mask, lm, off, GROUP);
            nanidx = on > nanidx ? on : nanidx;
            if (oi >= 0 && (li < 0 || om > lm || (om == lm && oi < li))) {
                lm = om;
                li = oi;
            }
        }
        const int arg = nanidx >= 0 ? nanidx : li;
        const float mx = nanidx >= 0 ? nan_f() : lm;
        const float zt = t >= 0 && t < V ? ce_z(&a, logits, o + t) : nan_f();

        float s = 0.0f;
        double sd = 0.0;
        if (gpt) {
            float acc = 0.0f;
            for (int j = lane; j < v16; j += GROUP)
                acc = add_rn(acc, cpu_exp(sub_rn(ce_z(&a, logits, o + j), mx)));
            for (int j = v16; j < V; j++)
                s = add_rn(s, cpu_exp(sub_rn(ce_z(&a, logits, o + j), mx)));
            s = fold16(s, acc, mask);
        } else {
            for (int j = lane; j < V; j += GROUP)
                sd += exp((double)ce_z(&a, logits, o + j) - (double)mx);
            for (int off = GROUP / 2; off > 0; off >>= 1)
                sd += __shfl_down_sync(mask, sd, off, GROUP);
            sd = __shfl_sync(mask, sd, 0, GROUP);
        }
        __syncwarp(mask);

        for (int j = lane; j < V; j += GROUP) {
            float z = ce_z(&a, logits, o + j), p;
            if (gpt)
                p = div_rn(cpu_exp(sub_rn(z, mx)), s);
            else
                p = (float)(exp((double)z - (double)mx) / sd);
            p = rd(p, a.ce_dt);
            if (a.probs != NULL)
                st(a.probs, o + j, a.pdt, p);
            if (a.grad) {
                float d;
                if (gpt)
                    d = j == t ? sub_rn(mul_rn(p, g), g) : mul_rn(p, g);
                else
                    d = mul_rn(sub_rn(p, j == t ? 1.0f : 0.0f), g);
                st(logits, o + j, a.ldt, rd(rd(d, a.ce_dt), a.lin_dt));
            }
        }
        if (lane == 0) {
            double lsum = gpt ? log((double)s) : log(sd);
            row_loss[row] = -((double)zt - (double)mx - lsum);
            row_hit[row] = arg == t;
        }
    }
}

/* The sums of the row losses and hits in a fixed order (one block). */
static __global__ void __launch_bounds__(OPS_THREADS)
k_ce_reduce(const double *row_loss, const int *row_hit, int N, double *loss_sum, int *correct)
{
    __shared__ double ls[OPS_THREADS];
    __shared__ int hs[OPS_THREADS];
    const int tid = threadIdx.x;
    double l = 0.0;
    int h = 0;
    for (int i = tid; i < N; i += OPS_THREADS) {
        l += row_loss[i];
        h += row_hit[i];
    }
    ls[tid] = l;
    hs[tid] = h;
    __syncthreads();
    for (int w = OPS_THREADS / 2; w > 0; w >>= 1) {
        if (tid < w) {
            ls[tid] += ls[tid + w];
            hs[tid] += hs[tid + w];
        }
        __syncthreads();
    }
    if (tid == 0) {
        *loss_sum = ls[0];
        *correct = hs[0];
    }
}

/* See cuda_ops.h. */
size_t gpu_cuda_ce_workspace(int N)
{
    size_t n = N > 0 ? (size_t)N : 0;
    return gpu_align256(n * sizeof(double)) + gpu_align256(n * sizeof(int));
}

static int ce_launch(const ce_args *a, void *logits, const int *y, int N, int V,
                     double *loss_sum, int *correct, void *work, cudaStream_t stream)
{
    if (N < 0 || V < 1 || (a->style != GPU_CUDA_CE_GPT && a->style != GPU_CUDA_CE_MLP) ||
        !dt_ok(a->ldt) || !dt_ok(a->lin_dt) || !dt_ok(a->ce_dt) || !dt_ok(a->pdt))
        return GPU_EINVAL;
    if (loss_sum == NULL || correct == NULL || (N > 0 && work == NULL))
        return GPU_EINVAL;
    if (N > 0 && (logits == NULL || y == NULL))
        return GPU_EINVAL;
    double *row_loss = (double *)work;
    int *row_hit = (int *)((char *)work + gpu_align256((size_t)N * sizeof(double)));
    if (N > 0) {
        ce_args k = *a;
        k.vec = a->ldt != GPU_FP32 && V % 8 == 0 && (uintptr_t)logits % 16 == 0;
        k_ce<<<row_blocks((size_t)N), OPS_THREADS, 0, stream>>>(k, logits, y, N, V, row_loss,
                                                                row_hit);
        GPU_CUDA_CHECK(cudaGetLastError());
    }
    k_ce_reduce<<<1, OPS_THREADS, 0, stream>>>(row_loss, row_hit, N, loss_sum, correct);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* See cuda_ops.h. */
int gpu_cuda_ce_fwd_launch(gpu_cuda_ce_style style, const void *logits, gpu_dtype ldt,
                           const int *y, int N, int V, gpu_dtype lin_dt, gpu_dtype ce_dt,
                           void *probs, gpu_dtype pdt, double *loss_sum, int *correct,
                           void *work, cudaStream_t stream)
{
    ce_args a = {style, ldt, lin_dt, ce_dt, pdt, probs, false, 0.0f, NULL, 1, false};
    /* the kernel writes the logits only with grad set */
    return ce_launch(&a, const_cast<void *>(logits), y, N, V, loss_sum, correct, work, stream);
}

/* See cuda_ops.h. */
int gpu_cuda_ce_fused_launch(gpu_cuda_ce_style style, void *logits, gpu_dtype ldt,
                             const int *y, int N, int V, gpu_dtype lin_dt, gpu_dtype ce_dt,
                             float seed, const float *d_seed, int count, double *loss_sum,
                             int *correct, void *work, cudaStream_t stream)
{
    ce_args a = {style, ldt, lin_dt, ce_dt, GPU_FP32, NULL, true, seed, d_seed, count, false};
    if (count < 1)
        return GPU_EINVAL;
    return ce_launch(&a, logits, y, N, V, loss_sum, correct, work, stream);
}

static __global__ void __launch_bounds__(OPS_THREADS)
k_ce_bwd(gpu_cuda_ce_style style, const void *probs, gpu_dtype pdt, const int *y, int V,
         gpu_dtype ce_dt, gpu_dtype lin_dt, float seed, const float *d_seed, int count,
         void *dlogits, gpu_dtype ddt, size_t n)
{
    const float g = div_rn(d_seed ? *d_seed : seed, (float)count);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / (size_t)V;
        bool hot = (size_t)y[r] == i - r * (size_t)V;
        float p = ld(probs, i, pdt), d;
        if (style == GPU_CUDA_CE_GPT)
            d = hot ? sub_rn(mul_rn(p, g), g) : mul_rn(p, g);
        else
            d = mul_rn(sub_rn(p, hot ? 1.0f : 0.0f), g);
        st(dlogits, i, ddt, rd(rd(d, ce_dt), lin_dt));
    }
}

/* See cuda_ops.h. */
int gpu_cuda_ce_bwd_launch(gpu_cuda_ce_style style, const void *probs, gpu_dtype pdt,
                           const int *y, int N, int V, gpu_dtype ce_dt, gpu_dtype lin_dt,
                           float seed, const float *d_seed, int count, void *dlogits,
                           gpu_dtype ddt, cudaStream_t stream)
{
    size_t n = (size_t)N * (size_t)V;
    if (N < 0 || V < 1 || count < 1 || (style != GPU_CUDA_CE_GPT && style != GPU_CUDA_CE_MLP) ||
        !dt_ok(pdt) || !dt_ok(ce_dt) || !dt_ok(lin_dt) || !dt_ok(ddt))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if (probs == NULL || y == NULL || dlogits == NULL)
        return GPU_EINVAL;
    k_ce_bwd<<<flat_blocks(n), OPS_THREADS, 0, stream>>>(style, probs, pdt, y, V, ce_dt, lin_dt,
                                                         seed, d_seed, count, dlogits, ddt, n);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* ---- causal attention softmax --------------------------------------------------------------- */

typedef struct {
    gpu_dtype mm_dt, sm_dt;
    float scale;
} attn_args;

/* A score as the softmax sees it: the product rounded, scaled, rounded, cast to sm_dt. */
__device__ static __forceinline__ float attn_s(const attn_args *a, const void *S, gpu_dtype sdt,
                                               size_t i)
{
    float s = rd(ld(S, i, sdt), a->mm_dt);
    return rd(rd(mul_rn(s, a->scale), a->mm_dt), a->sm_dt);
}

/* One row i of one (batch, head) per group: gpt.c's softmax_row over j <= i. */
static __global__ void __launch_bounds__(OPS_THREADS)
k_attn_fwd(attn_args a, const void *S, gpu_dtype sdt, int BH, int T, void *P, gpu_dtype pdt,
           void *Pm, gpu_dtype pmdt)
{
    const unsigned lane = group_lane(), mask = group_mask();
    const size_t rows = (size_t)BH * T;
    for (size_t row = group_first(); row < rows; row += group_stride()) {
        const size_t o = row * (size_t)T;
        const int n = (int)(row % (size_t)T) + 1, n16 = n & ~(GROUP - 1);
        float lm = -INFINITY;
        int has_nan = 0;
        for (int j = lane; j < n; j += GROUP) {
            float s = attn_s(&a, S, sdt, o + j);
            if (s != s)
                has_nan = 1;
            else
                lm = s > lm ? s : lm;
        }
        for (int off = GROUP / 2; off > 0; off >>= 1) {
            float om = __shfl_xor_sync(mask, lm, off, GROUP);
            has_nan |= __shfl_xor_sync(mask, has_nan, off, GROUP);
            lm = om > lm ? om : lm;
        }
        const float mx = has_nan ? nan_f() : lm;
        float acc = 0.0f, s = 0.0f;
        for (int j = lane; j < n16; j += GROUP)
            acc = add_rn(acc, cpu_exp(sub_rn(attn_s(&a, S, sdt, o + j), mx)));
        for (int j = n16; j < n; j++)
            s = add_rn(s, cpu_exp(sub_rn(attn_s(&a, S, sdt, o + j), mx)));
        s = fold16(s, acc, mask);
        __syncwarp(mask);
        for (int j = lane; j < T; j += GROUP) {
            float p = 0.0f;
            if (j < n)
                p = rd(div_rn(cpu_exp(sub_rn(attn_s(&a, S, sdt, o + j), mx)), s), a.sm_dt);
            st(P, o + j, pdt, p);
            if (Pm != NULL)
                st(Pm, o + j, pmdt, p);
        }
    }
}

/* One row per group: gpt.c's softmax_row_bwd and the casts and scaling around it. */
static __global__ void __launch_bounds__(OPS_THREADS)
k_attn_bwd(attn_args a, const void *P, gpu_dtype pdt, const void *dP, gpu_dtype dpdt, int BH,
           int T, void *dS, gpu_dtype dsdt)
{
    const unsigned lane = group_lane(), mask = group_mask();
    const size_t rows = (size_t)BH * T;
    for (size_t row = group_first(); row < rows; row += group_stride()) {
        const size_t o = row * (size_t)T;
        const int n = (int)(row % (size_t)T) + 1, n16 = n & ~(GROUP - 1);
        float acc = 0.0f, dot = 0.0f;
        for (int j = lane; j < n16; j += GROUP) {
            float d = rd(rd(ld(dP, o + j, dpdt), a.mm_dt), a.sm_dt);
            acc = add_rn(acc, mul_rn(ld(P, o + j, pdt), d));
        }
        for (int j = n16; j < n; j++) {
            float d = rd(rd(ld(dP, o + j, dpdt), a.mm_dt), a.sm_dt);
            dot = add_rn(dot, mul_rn(ld(P, o + j, pdt), d));
        }
        dot = fold16(dot, acc, mask);
        __syncwarp(mask);
        for (int j = lane; j < T; j += GROUP) {
            float v = 0.0f;
            if (j < n) {
                float d = rd(rd(ld(dP, o + j, dpdt), a.mm_dt), a.sm_dt);
                v = rd(rd(mul_rn(ld(P, o + j, pdt), sub_rn(d, dot)), a.sm_dt), a.mm_dt);
            }
            st(dS, o + j, dsdt, rd(mul_rn(v, a.scale), a.mm_dt));
        }
    }
}

static float attn_scale(int hd)
{
    return (float)(1.0 / sqrt((double)hd));
}

/* See cuda_ops.h. */
int gpu_cuda_attn_softmax_fwd_launch(const void *S, gpu_dtype sdt, int BH, int T, int hd,
                                     gpu_dtype mm_dt, gpu_dtype sm_dt, void *P, gpu_dtype pdt,
                                     void *Pm, gpu_dtype pmdt, cudaStream_t stream)
{
    size_t rows = (size_t)BH * (size_t)T;
    if (BH < 0 || T < 1 || hd < 1 || !dt_ok(sdt) || !dt_ok(mm_dt) || !dt_ok(sm_dt) ||
        !dt_ok(pdt) || !dt_ok(pmdt))
        return GPU_EINVAL;
    if (rows == 0)
        return 0;
    if (S == NULL || P == NULL)
        return GPU_EINVAL;
    attn_args a = {mm_dt, sm_dt, attn_scale(hd)};
    k_attn_fwd<<<row_blocks(rows), OPS_THREADS, 0, stream>>>(a, S, sdt, BH, T, P, pdt, Pm, pmdt);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* See cuda_ops.h. */
int gpu_cuda_attn_softmax_bwd_launch(const void *P, gpu_dtype pdt, const void *dP,
                                     gpu_dtype dpdt, int BH, int T, int hd, gpu_dtype mm_dt,
                                     gpu_dtype sm_dt, void *dS, gpu_dtype dsdt,
                                     cudaStream_t stream)
{
    size_t rows = (size_t)BH * (size_t)T;
    if (BH < 0 || T < 1 || hd < 1 || !dt_ok(pdt) || !dt_ok(dpdt) || !dt_ok(mm_dt) ||
        !dt_ok(sm_dt) || !dt_ok(dsdt))
        return GPU_EINVAL;
    if (rows == 0)
        return 0;
    if (P == NULL || dP == NULL || dS == NULL)
        return GPU_EINVAL;
    attn_args a = {mm_dt, sm_dt, attn_scale(hd)};
    k_attn_bwd<<<row_blocks(rows), OPS_THREADS, 0, stream>>>(a, P, pdt, dP, dpdt, BH, T, dS,
                                                             dsdt);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}
