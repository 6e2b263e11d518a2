/*
 * check_emu.cu - Check suite "cudaemu": the CUDA emulator itself (tests/cudaemu), so that the
 * suites that run the backend on it can be trusted to fail when the code is wrong.
 *
 *   - barriers and shuffles compute what CUDA defines: a block reduction through warp
 *     shuffles and shared memory over partial warps and many blocks; __shfl_xor_sync and
 *     __shfl_down_sync with sub-warp widths, lane by lane, against the definitions;
 *   - launches with a bad shape fail with cudaErrorInvalidConfiguration and run nothing;
 *   - copies that leave their allocation, or that name host memory as device memory, fail;
 *   - in a child process: host code that dereferences a device pointer, a kernel that writes
 *     past its allocation and a block whose threads wait at barriers that cannot open are
 *     each reported by name and kill the process (the emulator's message is checked);
 *   - the emulated cuBLASLt rejects an attribute of the wrong size, as the library does;
 *   - the half and bfloat16 conversions, and the math intrinsics kernels use (they link);
 *   - the warp matrix API (mma.h): fp16 and bf16 products with both B layouts, ldm larger
 *     than the tile, accumulators loaded and stored in both layouts, exact against a double
 *     reference (the values are small integers and halves, so every sum is exact); two warps
 *     of one block each with its own product; a lane reading an element another lane stored
 *     reads stale memory without __syncwarp (deliberately: see mma.h) and the right value
 *     with it, and a read before the store sees the old memory in every lane; a misaligned
 *     pointer, a bad ldm and a partial warp are reported and abort, and so are (each call's
 *     work is shared by the warp's lanes, which must be in step) a lane that passes another
 *     ldm or pointer to a load or a store, another C to mma_sync, or a B fragment of the
 *     other layout, lanes of one warp in different calls, and a write to a tile while the
 *     warp loads it.
 *
 * This file is CUDA: the build runs it through cu2cc.sh like the backend's kernels.
 */
#include <check.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include "tests/cudatest.h"

#define RED_THREADS 96      /* three warps; 1000 elements leave the last block partly idle */

/* out[blockIdx.x] = sum of x over the block's slice (blockDim.x elements each). */
static __global__ void k_block_sum(const int *x, int n, int *out)
{
    __shared__ int part[32];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = i < n ? x[i] : 0;
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_down_sync(0xFFFFFFFFu, v, off);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (unsigned w = 0; w < (blockDim.x + 31) / 32; w++)
            s += part[w];
        out[blockIdx.x] = s;
    }
}

/* out[3 * lane + 0..2]: xor-shuffle by 3 within groups of 8, down-shuffle by 5 within
 * groups of 16, and the value of lane 2 of each group of 4. */
static __global__ void k_shuffles(int *out)
{
    int lane = threadIdx.x;
    int v = 100 + lane;
    out[3 * lane] = __shfl_xor_sync(0xFFFFFFFFu, v, 3, 8);
    out[3 * lane + 1] = __shfl_down_sync(0xFFFFFFFFu, v, 5, 16);
    out[3 * lane + 2] = __shfl_sync(0xFFFFFFFFu, v, 2, 4);
}

static __global__ void k_fill(float *p, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        p[i] = (float)i;
}

/* Half of warp 0 waits at __syncthreads, the other half at __syncwarp: never opens. */
static __global__ void k_deadlock(void)
{
    if (threadIdx.x < 16)
        __syncthreads();
    else
        __syncwarp();
}

/* out[8 * lane + 0..7]: the math intrinsics on exact cases, and a float xor-shuffle. */
static __global__ void k_math(float *out)
{
    int lane = threadIdx.x;
    float *o = out + 8 * lane;
    o[0] = __expf(0.0f);
    o[1] = __logf(1.0f);
    o[2] = expf(0.0f) + logf(1.0f);
    o[3] = exp2f((float)(lane % 4));
    o[4] = fmaxf(-INFINITY, (float)lane);
    o[5] = __frcp_rn(4.0f);
    o[6] = __fdividef(1.0f, 8.0f);
    o[7] = __shfl_xor_sync(0xFFFFFFFFu, (float)lane + 0.5f, 1);
}

using namespace nvcuda;

#define WM_LDA 24   /* A: 16 rows of 24 elements (ldm: a multiple of 8 for 16-bit types) */
#define WM_LDB 32   /* B: 16 rows or columns of 32 */
#define WM_LDC 20   /* C and D: 16 rows (C) or columns (D) of 20 floats (a multiple of 4) */

/* d = scale * (A B + C) on one warp: A row-major, B in layout LB, both of the 16-bit type T
 * (their bits in a and b), C loaded row-major, D stored column-major. */
template <typename T, typename LB>
static __global__ void k_wmma(const uint16_t *a, const uint16_t *b, const float *c, float *d,
                              float scale)
{
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::load_matrix_sync(fa, reinterpret_cast<const T *>(a), WM_LDA);
    wmma::load_matrix_sync(fb, reinterpret_cast<const T *>(b), WM_LDB);
    wmma::load_matrix_sync(acc, c, WM_LDC, wmma::mem_row_major);
    wmma::mma_sync(acc, fa, fb, acc);
    for (int i = 0; i < acc.num_elements; i++)
        acc.x[i] *= scale;
    wmma::store_matrix_sync(d, acc, WM_LDC, wmma::mem_col_major);
}

/* Two warps, each with its own product in its own shared tile: warp w stores A_w B + w (A_w
 * the w-th 16x16 row-major tile of a, B row-major), and after __syncwarp its lanes copy the
 * tile out, each reading 8 elements that other lanes stored. */
static __global__ void k_wmma_two_warps(const uint16_t *a, const uint16_t *b, float *out)
{
    __shared__ __align__(32) float tile[2][256];
    int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, (float)w);
    wmma::load_matrix_sync(fa, reinterpret_cast<const __half *>(a) + w * 256, 16);
    wmma::load_matrix_sync(fb, reinterpret_cast<const __half *>(b), 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(tile[w], acc, 16, wmma::mem_row_major);
    __syncwarp();
    for (int e = 8 * lane; e < 8 * lane + 8; e++)
        out[w * 256 + e] = tile[w][e];
}

/* One warp stores the accumulator c (row-major) to a shared tile that held -1, and each lane
 * reads element (lane + 1) % 32, which another lane stores: mode 0, right after the store (a
 * race on a GPU); mode 1, after the store and a __syncwarp; mode 2, before the store. */
static __global__ void k_wmma_readback(const float *c, float *out, int mode)
{
    __shared__ __align__(32) float tile[256];
    int lane = threadIdx.x;
    for (int e = lane; e < 256; e += 32)
        tile[e] = -1.0f;
    __syncwarp();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::load_matrix_sync(acc, c, 16, wmma::mem_row_major);
    float before = tile[(lane + 1) % 32];
    wmma::store_matrix_sync(tile, acc, 16, wmma::mem_row_major);
    if (mode == 1)
        __syncwarp();
    out[lane] = mode == 2 ? before : tile[(lane + 1) % 32];
}

/* An accumulator load from c + off with ldm ldc, then an A load with ldm lda. */
static __global__ void k_wmma_operands(const float *c, int off, unsigned ldc, const uint16_t *a,
                                       unsigned lda)
{
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
    wmma::load_matrix_sync(acc, c + off, ldc, wmma::mem_row_major);
    wmma::load_matrix_sync(fa, reinterpret_cast<const __half *>(a), lda);
}

/* One warp's warp matrix calls, one lane (lane 5) out of step in mode: 1, another ldm for
 * its A load; 2, another pointer; 3, a C fragment that differs at mma_sync; 4, the upper half
 * of the warp loads B again while the lower half calls mma_sync; 5, another ldm for its store;
 * 6, B loaded as col_major; 7, every lane writes the tile A came from right after the load,
 * without __syncwarp (a race with the other lanes' load). Mode 0: all in step. */
static __global__ void k_wmma_diverge(const uint16_t *a, float *c, int mode)
{
    __shared__ __align__(32) uint16_t tile[512];
    int lane = threadIdx.x % 32;
    bool odd = lane == 5;
    const __half *t = reinterpret_cast<const __half *>(tile);
    for (int e = lane; e < 512; e += 32)
        tile[e] = a[e];
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fbc;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, t + (mode == 2 && odd ? 16 : 0), mode == 1 && odd ? 32 : 16);
    if (mode == 7)
        tile[lane] = 0x3C00;    /* 1.0 over 0.0 */
    if (mode == 6 && odd)
        wmma::load_matrix_sync(fbc, t + 256, 16);
    else
        wmma::load_matrix_sync(fb, t + 256, 16);
    if (mode == 3 && odd)
        acc.x[7] = 1.0f;
    if (mode == 4 && lane >= 16)
        wmma::load_matrix_sync(fb, t + 256, 16);
    else
        wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, mode == 5 && odd ? 20 : 16, wmma::mem_row_major);
}

START_TEST(t_block_sum)
{
    const int n = 1000, blocks[2] = {RED_THREADS, 160};
    int *h = (int *)malloc(n * sizeof(int)), *d = NULL, *dout = NULL, out[16];
    for (int i = 0; i < n; i++)
        h[i] = i * 7 - 300;
    ck_assert_int_eq(cudaMalloc(&d, n * sizeof(int)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&dout, sizeof(out)), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(d, h, n * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
    for (int b = 0; b < 2; b++) {
        int bs = blocks[b], nb = (n + bs - 1) / bs;
        k_block_sum<<<nb, bs>>>(d, n, dout);
        ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
        ck_assert_int_eq(cudaMemcpy(out, dout, nb * sizeof(int), cudaMemcpyDeviceToHost),
                         cudaSuccess);
        for (int k = 0; k < nb; k++) {
            int want = 0;
            for (int i = k * bs; i < (k + 1) * bs && i < n; i++)
                want += h[i];
            ck_assert_msg(out[k] == want, "block %d of %d threads: %d, want %d", k, bs, out[k],
                          want);
        }
    }
    cudaFree(d);
    cudaFree(dout);
    free(h);
}
END_TEST

START_TEST(t_shuffles)
{
    int *d = NULL, out[96];
    ck_assert_int_eq(cudaMalloc(&d, sizeof(out)), cudaSuccess);
    k_shuffles<<<1, 32>>>(d);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(out, d, sizeof(out), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int lane = 0; lane < 32; lane++) {
        int down = (lane % 16) + 5 < 16 ? lane + 5 : lane;
        ck_assert_int_eq(out[3 * lane], 100 + (lane ^ 3));
        ck_assert_int_eq(out[3 * lane + 1], 100 + down);
        ck_assert_int_eq(out[3 * lane + 2], 100 + (lane & ~3) + 2);
    }
    cudaFree(d);
}
END_TEST

START_TEST(t_bad_launch)
{
    float *d = NULL, h[4] = {-1, -1, -1, -1};
    ck_assert_int_eq(cudaMalloc(&d, sizeof(h)), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(d, h, sizeof(h), cudaMemcpyHostToDevice), cudaSuccess);
    k_fill<<<1, 2048>>>(d, 4);             /* more than 1024 threads */
    ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidConfiguration);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);     /* read once, then cleared */
    k_fill<<<dim3(1, 70000), 32>>>(d, 4);  /* grid y over 65535 */
    ck_assert_int_eq(cudaGetLastError(), cudaErrorInvalidConfiguration);
    ck_assert_int_eq(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost), cudaSuccess);
    ck_assert(h[0] == -1.0f && h[3] == -1.0f);             /* nothing ran */
    k_fill<<<1, 4>>>(d, 4);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost), cudaSuccess);
    ck_assert(h[0] == 0.0f && h[3] == 3.0f);
    cudaFree(d);
}
END_TEST

START_TEST(t_copy_bounds)
{
    char *d = NULL, h[300];
    memset(h, 1, sizeof(h));
    ck_assert_int_eq(cudaMalloc(&d, 256), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(d, h, 257, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    ck_assert_int_eq(cudaMemcpy(h, d + 8, 256, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    ck_assert_int_eq(cudaMemcpy(d, h, 16, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    ck_assert_int_eq(cudaMemset(d, 0, 512), cudaErrorInvalidValue);
    ck_assert_int_eq(cudaMemcpy(d, h, 256, cudaMemcpyHostToDevice), cudaSuccess);
    ck_assert_int_eq(cudaFree(h), cudaErrorInvalidDevicePointer);
    (void)cudaGetLastError();
    cudaFree(d);
}
END_TEST

START_TEST(t_half_convert)
{
    for (unsigned h = 0; h < 65536; h++) {
        unsigned short u = (unsigned short)h;
        unsigned e = h >> 10 & 31, m = h & 1023;
        double want = e == 0 ? ldexp(m, -24) : e < 31 ? ldexp(1024 + m, (int)e - 25) : INFINITY;
        if (h & 0x8000)
            want = -want;
        float f = __half2float(__ushort_as_half(u));
        if (e == 31 && m != 0) {
            ck_assert(isnan(f));
        } else {
            ck_assert_msg(f == (float)want && !signbit(f) == !signbit(want),
                          "half 0x%04x: %a, want %a", h, (double)f, want);
            ck_assert_int_eq(__half_as_ushort(__float2half(f)), h);
        }
        uint32_t fb = (uint32_t)h << 16, got;
        float b = __bfloat162float(__ushort_as_bfloat16(u));
        memcpy(&got, &b, sizeof(got));
        ck_assert_uint_eq(got, fb);
        if (!isnan(b))
            ck_assert_int_eq(__bfloat16_as_ushort(__float2bfloat16(b)), h);
    }
    /* to nearest, ties to even; past the largest finite value, infinity; NaN canonical */
    ck_assert_int_eq(__half_as_ushort(__float2half(1.0f + ldexpf(1.0f, -11))), 0x3C00);
    ck_assert_int_eq(__half_as_ushort(__float2half(1.0f + 3 * ldexpf(1.0f, -11))), 0x3C02);
    ck_assert_int_eq(__half_as_ushort(__float2half(1.0f + 1.5f * ldexpf(1.0f, -11))), 0x3C01);
    ck_assert_int_eq(__half_as_ushort(__float2half(65519.0f)), 0x7BFF);
    ck_assert_int_eq(__half_as_ushort(__float2half(-65520.0f)), 0xFC00);
    ck_assert_int_eq(__half_as_ushort(__float2half(ldexpf(1.0f, -25))), 0x0000);
    ck_assert_int_eq(__half_as_ushort(__float2half(ldexpf(3.0f, -26))), 0x0001);
    ck_assert_int_eq(__half_as_ushort(__float2half(ldexpf(3.0f, -25))), 0x0002);
    ck_assert_int_eq(__half_as_ushort(__float2half(NAN)), 0x7FFF);
    ck_assert_int_eq(__bfloat16_as_ushort(__float2bfloat16(1.0f + ldexpf(1.0f, -8))), 0x3F80);
    ck_assert_int_eq(__bfloat16_as_ushort(__float2bfloat16(1.0f + 3 * ldexpf(1.0f, -8))),
                     0x3F82);
    ck_assert_int_eq(__bfloat16_as_ushort(__float2bfloat16(-3.4e38f)), 0xFF80);
    ck_assert_int_eq(__bfloat16_as_ushort(__float2bfloat16(NAN)), 0x7FFF);
}
END_TEST

START_TEST(t_math)
{
    float *d = NULL, out[256];
    ck_assert_int_eq(cudaMalloc(&d, sizeof(out)), cudaSuccess);
    k_math<<<1, 32>>>(d);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(out, d, sizeof(out), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int lane = 0; lane < 32; lane++) {
        const float *o = out + 8 * lane;
        ck_assert(o[0] == 1.0f && o[1] == 0.0f && o[2] == 1.0f);
        ck_assert(o[3] == (float)(1 << (lane % 4)) && o[4] == (float)lane);
        ck_assert(o[5] == 0.25f && o[6] == 0.125f && o[7] == (float)(lane ^ 1) + 0.5f);
    }
    cudaFree(d);
}
END_TEST

/* The bits of x in binary16 (bf16 false) or bfloat16 (true); x must be exact there, and is
 * zero or a normal number. */
static uint16_t bits16(float x, bool bf16)
{
    uint32_t u, e;
    memcpy(&u, &x, sizeof(u));
    e = u >> 23 & 0xFF;
    if (bf16) {
        ck_assert((u & 0xFFFF) == 0);
        return (uint16_t)(u >> 16);
    }
    if ((u & 0x7FFFFFFF) == 0)
        return (uint16_t)(u >> 16);
    ck_assert(e >= 113 && e <= 142 && (u & 0x1FFF) == 0);
    return (uint16_t)((u >> 16 & 0x8000) | (e - 112) << 10 | (u >> 13 & 0x3FF));
}

/* the operands of the products: small integers and halves, so that products and sums are
 * exact; none symmetric, so that a transposed operand shows */
static float wm_a(int i, int k) { return (float)((3 * i + 5 * k) % 7 - 3); }
static float wm_b(int k, int j) { return 0.5f * (float)((2 * k + 3 * j) % 5 - 2); }
static float wm_c(int i, int j) { return (float)(i - 2 * j); }

/* Run k_wmma<T, LB>, B row-major when b_row, and compare D with the double reference bit for
 * bit; the padding of D (its rows 16..19) keeps its old value. */
template <typename T, typename LB>
static void check_wmma(bool bf16, bool b_row)
{
    const float scale = 0.5f, pad = -7.0f;
    uint16_t ha[16 * WM_LDA], hb[16 * WM_LDB];
    float hc[16 * WM_LDC], hd[16 * WM_LDC];
    for (int i = 0; i < 16 * WM_LDA; i++)
        ha[i] = bits16(64.0f, bf16);      /* padding: wrong if read */
    for (int i = 0; i < 16 * WM_LDB; i++)
        hb[i] = bits16(64.0f, bf16);
    for (int i = 0; i < 16 * WM_LDC; i++) {
        hc[i] = 4096.0f;
        hd[i] = pad;
    }
    for (int r = 0; r < 16; r++)
        for (int k = 0; k < 16; k++) {
            ha[r * WM_LDA + k] = bits16(wm_a(r, k), bf16);
            hb[b_row ? r * WM_LDB + k : k * WM_LDB + r] = bits16(wm_b(r, k), bf16);
            hc[r * WM_LDC + k] = wm_c(r, k);
        }
    uint16_t *da = NULL, *db = NULL;
    float *dc = NULL, *dd = NULL;
    ck_assert_int_eq(cudaMalloc(&da, sizeof(ha)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&db, sizeof(hb)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&dc, sizeof(hc)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&dd, sizeof(hd)), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(da, ha, sizeof(ha), cudaMemcpyHostToDevice), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(db, hb, sizeof(hb), cudaMemcpyHostToDevice), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(dc, hc, sizeof(hc), cudaMemcpyHostToDevice), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(dd, hd, sizeof(hd), cudaMemcpyHostToDevice), cudaSuccess);
    k_wmma<T, LB><<<1, 32>>>(da, db, dc, dd, scale);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(hd, dd, sizeof(hd), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int j = 0; j < 16; j++)
        for (int i = 0; i < WM_LDC; i++) {
            double want = pad;
            if (i < 16) {
                want = wm_c(i, j);
                for (int k = 0; k < 16; k++)
                    want += (double)wm_a(i, k) * wm_b(k, j);
                want *= scale;
            }
            ck_assert_msg(hd[j * WM_LDC + i] == (float)want, "%s, B %s: d(%d,%d) = %g, want %g",
                          bf16 ? "bf16" : "fp16", b_row ? "row-major" : "col-major", i, j,
                          (double)hd[j * WM_LDC + i], want);
        }
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
    cudaFree(dd);
}

START_TEST(t_wmma_f16)
{
    check_wmma<__half, wmma::col_major>(false, false);
    check_wmma<__half, wmma::row_major>(false, true);
}
END_TEST

START_TEST(t_wmma_bf16)
{
    check_wmma<__nv_bfloat16, wmma::row_major>(true, true);
    check_wmma<__nv_bfloat16, wmma::col_major>(true, false);
}
END_TEST

START_TEST(t_wmma_two_warps)
{
    uint16_t ha[2 * 256], hb[256];
    float out[2 * 256];
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < 16; i++)
            for (int k = 0; k < 16; k++)
                ha[w * 256 + i * 16 + k] = bits16(wm_a(i + 3 * w, k), false);
    for (int k = 0; k < 16; k++)
        for (int j = 0; j < 16; j++)
            hb[k * 16 + j] = bits16(wm_b(k, j), false);
    uint16_t *da = NULL, *db = NULL;
    float *dout = NULL;
    ck_assert_int_eq(cudaMalloc(&da, sizeof(ha)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&db, sizeof(hb)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&dout, sizeof(out)), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(da, ha, sizeof(ha), cudaMemcpyHostToDevice), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(db, hb, sizeof(hb), cudaMemcpyHostToDevice), cudaSuccess);
    k_wmma_two_warps<<<1, 64>>>(da, db, dout);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(out, dout, sizeof(out), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 16; j++) {
                double want = w;
                for (int k = 0; k < 16; k++)
                    want += (double)wm_a(i + 3 * w, k) * wm_b(k, j);
                ck_assert_msg(out[w * 256 + i * 16 + j] == (float)want,
                              "warp %d: (%d,%d) = %g, want %g", w, i, j,
                              (double)out[w * 256 + i * 16 + j], want);
            }
    cudaFree(da);
    cudaFree(db);
    cudaFree(dout);
}
END_TEST

/* A store_matrix_sync is spread over the warp's lanes (each writes the elements of its own
 * index mod 32) and lanes run one after another, so a lane that reads what another stored
 * without __syncwarp reads the old memory: the emulator makes that race (undefined on a GPU)
 * a wrong result on purpose. With __syncwarp every lane reads the stored value. And the store
 * begins when the whole warp has arrived (as CUDA documents it), so a read before it, in any
 * lane, sees the memory as it was. */
START_TEST(t_wmma_store_order)
{
    float hc[256], out[32], *dc = NULL, *dout = NULL;
    for (int e = 0; e < 256; e++)
        hc[e] = (float)(e + 1);
    ck_assert_int_eq(cudaMalloc(&dc, sizeof(hc)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&dout, sizeof(out)), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(dc, hc, sizeof(hc), cudaMemcpyHostToDevice), cudaSuccess);
    for (int mode = 0; mode < 3; mode++) {
        k_wmma_readback<<<1, 32>>>(dc, dout, mode);
        ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
        ck_assert_int_eq(cudaMemcpy(out, dout, sizeof(out), cudaMemcpyDeviceToHost),
                         cudaSuccess);
        int stale = 0;
        for (int lane = 0; lane < 32; lane++) {
            float stored = hc[(lane + 1) % 32];
            ck_assert_msg(out[lane] == (mode == 0 ? out[lane] : mode == 1 ? stored : -1.0f),
                          "mode %d, lane %d: %g", mode, lane, (double)out[lane]);
            ck_assert(out[lane] == -1.0f || out[lane] == stored);
            stale += out[lane] == -1.0f;
        }
        if (mode == 0)
            ck_assert_msg(stale > 0, "every lane read the stored tile without __syncwarp");
    }
    cudaFree(dc);
    cudaFree(dout);
}
END_TEST

/* Run fn in a child with stderr captured: true when the child died (a signal or a non-zero
 * exit, as the sanitizers report it) and its stderr holds every string of want (up to a
 * NULL). */
static bool child_dies_saying_all(void (*fn)(void), const char *const *want)
{
    int fd[2];
    char buf[4096];
    size_t len = 0;
    ck_assert_int_eq(pipe(fd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fd[1], 2);
        close(fd[0]);
        fn();
        _exit(0);
    }
    close(fd[1]);
    ssize_t r;
    while ((r = read(fd[0], buf + len, sizeof(buf) - 1 - len)) > 0)
        len += (size_t)r;
    buf[len] = '\0';
    close(fd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    bool died = WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
    bool said = true;
    for (; *want != NULL; want++)
        said = said && strstr(buf, *want) != NULL;
    if (!died || !said)
        fprintf(stderr, "child: status 0x%x, stderr:\n%s\n", status, buf);
    return died && said;
}

static bool child_dies_saying(void (*fn)(void), const char *want)
{
    const char *const w[2] = {want, NULL};
    return child_dies_saying_all(fn, w);
}

static void host_deref(void)
{
    float *d = NULL;
    if (cudaMalloc(&d, 64) != cudaSuccess)
        return;
    volatile float x = d[3];    /* a device pointer read by host code */
    (void)x;
}

static void kernel_overrun(void)
{
    float *d = NULL;
    if (cudaMalloc(&d, 256 * sizeof(float)) != cudaSuccess)
        return;
    k_fill<<<2, 256>>>(d, 512);   /* 256 elements too many */
    cudaDeviceSynchronize();
}

static void deadlock(void)
{
    k_deadlock<<<1, 32>>>();
}

/* k_wmma_operands on 512 floats and 512 halves at off, ldc, lda, with threads threads */
static void wmma_operands(int off, unsigned ldc, unsigned lda, int threads)
{
    float *c = NULL;
    uint16_t *a = NULL;
    if (cudaMalloc(&c, 512 * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&a, 512 * sizeof(uint16_t)) != cudaSuccess ||
        cudaMemset(c, 0, 512 * sizeof(float)) != cudaSuccess ||
        cudaMemset(a, 0, 512 * sizeof(uint16_t)) != cudaSuccess)
        return;
    k_wmma_operands<<<1, threads>>>(c, off, ldc, a, lda);
    cudaDeviceSynchronize();
}

static void wmma_misaligned(void) { wmma_operands(4, 16, 16, 32); }   /* 16 bytes in */
static void wmma_bad_ldm(void) { wmma_operands(0, 16, 12, 32); }       /* 12 halves */
static void wmma_partial_warp(void) { wmma_operands(0, 16, 16, 48); }  /* warp 1: 16 lanes */

/* k_wmma_diverge in mode on one warp (or two, the second in step), zeros in A and B */
static void wmma_diverge(int mode, int threads)
{
    float *c = NULL;
    uint16_t *a = NULL;
    if (cudaMalloc(&c, 512 * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&a, 512 * sizeof(uint16_t)) != cudaSuccess ||
        cudaMemset(a, 0, 512 * sizeof(uint16_t)) != cudaSuccess)
        return;
    k_wmma_diverge<<<1, threads>>>(a, c, mode);
    cudaDeviceSynchronize();
    cudaFree(a);
    cudaFree(c);
}

static void wmma_diverge_ldm(void) { wmma_diverge(1, 32); }
static void wmma_diverge_pointer(void) { wmma_diverge(2, 32); }
static void wmma_diverge_fragment(void) { wmma_diverge(3, 32); }
static void wmma_diverge_call(void) { wmma_diverge(4, 32); }
static void wmma_diverge_store(void) { wmma_diverge(5, 64); }
static void wmma_diverge_layout(void) { wmma_diverge(6, 32); }
static void wmma_load_race(void) { wmma_diverge(7, 32); }

START_TEST(t_wmma_faults)
{
    wmma_operands(8, 20, 24, 64);   /* 32 bytes in, ldm multiples of 4 and 8: fine */
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert(child_dies_saying(wmma_misaligned, "is not 32-byte (256-bit) aligned"));
    ck_assert(child_dies_saying(wmma_bad_ldm, "ldm 12 is not a multiple of 8 elements"));
    ck_assert(child_dies_saying(wmma_partial_warp, "has 16 threads: the warp matrix calls"));
}
END_TEST

/* A warp's lanes must make the same warp matrix calls with the same operands (the emulator
 * does each call's work once per warp and checks the other lanes against it). */
START_TEST(t_wmma_diverge)
{
    static const char *const ldm[] = {"wmma::load_matrix_sync in block (0,0,0), thread (",
                                      "ldm 32", "differ from those of lane", NULL};
    static const char *const pointer[] = {"wmma::load_matrix_sync in block (0,0,0), thread (",
                                          "differ from those of lane", NULL};
    static const char *const fragment[] = {"wmma::mma_sync in block (0,0,0), thread (",
                                           "its C fragment differs from that of lane", NULL};
    static const char *const store[] = {"wmma::store_matrix_sync in block (0,0,0), thread (",
                                        "ldm 20", "differ from those of lane", NULL};
    wmma_diverge(0, 64);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert(child_dies_saying_all(wmma_diverge_ldm, ldm));
    ck_assert(child_dies_saying_all(wmma_diverge_pointer, pointer));
    ck_assert(child_dies_saying_all(wmma_diverge_fragment, fragment));
    ck_assert(child_dies_saying(wmma_diverge_call, "of its warp is in wmma::"));
    ck_assert(child_dies_saying_all(wmma_diverge_store, store));
    ck_assert(child_dies_saying(wmma_diverge_layout, "fragment types or layouts differ"));
    ck_assert(child_dies_saying(wmma_load_race, "changed after lane"));
}
END_TEST

START_TEST(t_faults)
{
    ck_assert(child_dies_saying(host_deref, "host code touched device memory"));
    ck_assert(child_dies_saying(kernel_overrun, "bytes past it"));
    ck_assert(child_dies_saying(deadlock, "deadlock in kernel k_deadlock"));
}
END_TEST

START_TEST(t_lt_attribute_size)
{
    cublasLtMatmulDesc_t desc = NULL;
    ck_assert_int_eq(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                     CUBLAS_STATUS_SUCCESS);
    int64_t wide = CUBLAS_OP_T;
    int32_t narrow = CUBLAS_OP_T;
    ck_assert_int_eq(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &wide,
                                                    sizeof(wide)),
                     CUBLAS_STATUS_INVALID_VALUE);
    ck_assert_int_eq(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &narrow,
                                                    sizeof(narrow)),
                     CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulDescDestroy(desc);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("cudaemu");
    TCase *tc = tcase_create("cudaemu");
    tcase_add_test(tc, t_block_sum);
    tcase_add_test(tc, t_shuffles);
    tcase_add_test(tc, t_bad_launch);
    tcase_add_test(tc, t_copy_bounds);
    tcase_add_test(tc, t_faults);
    tcase_add_test(tc, t_lt_attribute_size);
    tcase_add_test(tc, t_half_convert);
    tcase_add_test(tc, t_math);
    tcase_add_test(tc, t_wmma_f16);
    tcase_add_test(tc, t_wmma_bf16);
    tcase_add_test(tc, t_wmma_two_warps);
    tcase_add_test(tc, t_wmma_store_order);
    tcase_add_test(tc, t_wmma_faults);
    tcase_add_test(tc, t_wmma_diverge);
    suite_add_tcase(s, tc);
    return cudatest_main("check_cudaemu_self", s);
}
