/*
 * check_emu.cu - Check suite "cudaemu": the CUDA emulator itself (tests/cudaemu), so that the
 * suites that run the backend on it can be trusted to fail when the code is wrong.
 *
 *   - barriers and shuffles compute what CUDA defines: a block reduction through warp
 *     shuffles and shared memory over partial warps and many blocks; __shfl_xor_sync and
 *     __shfl_down_sync with sub-warp widths, lane by lane, against the definitions;
 *   - under a shuffle seed a warp runs ahead of the others from a warp barrier, so a read of
 *     another warp's shared memory without __syncthreads sees stale values;
 *   - launches with a bad shape fail with cudaErrorInvalidConfiguration and run nothing;
 *   - copies that leave their allocation, or that name host memory as device memory, fail;
 *   - in a child process: host code that dereferences a device pointer, a kernel that writes
 *     past its allocation and a block whose threads wait at barriers that cannot open are
 *     each reported by name and kill the process (the emulator's message is checked);
 *   - the emulated cuBLASLt rejects an attribute of the wrong size, as the library does;
 *   - the half and bfloat16 conversions, and the math intrinsics kernels use (they link);
 *   - the tensor-core instruction (ptx_mma.h, mma.sync m16n8k16): fp16 and bf16 products on
 *     two warps of a block, each lane's fragments built from PTX's element formulas, exact
 *     against a double reference (the values are small integers and halves, so every sum is
 *     exact); a partial warp and a warp whose lanes do not all execute it are reported and
 *     abort.
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
#include <ptx_mma.h>

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

/* The 16-bit value v into a fragment's element i: register i / 2, the low half for even i. */
static __device__ void mma_put(uint32_t *r, int i, uint16_t v)
{
    r[i / 2] |= (uint32_t)v << (16 * (i % 2));
}

/* d_w = A_w B + C through the tensor-core instruction (ptx_mma.h) on warp w of the block:
 * A_w the w-th 16 x 16 row-major tile of a, B 16 x 8 row-major (B(k, n) = b[8 k + n]), C and
 * D_w 16 x 8 row-major (D_w at d + 128 w). Each lane assembles its fragments from PTX's
 * element-by-element formulas (groupID g = lane >> 2, threadID_in_group t = lane % 4), which
 * the emulator implements as lane-and-register lookups: the two must agree. */
template <typename T>
static __global__ void k_mma(const uint16_t *a, const uint16_t *b, const float *c, float *d)
{
    int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane % 4;
    uint32_t fa[4] = {0, 0, 0, 0}, fb[2] = {0, 0};
    float acc[4];
    for (int i = 0; i < 8; i++) {
        int row = i < 2 || (i >= 4 && i < 6) ? g : g + 8;
        int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
        mma_put(fa, i, a[w * 256 + row * 16 + col]);
    }
    for (int i = 0; i < 4; i++)
        mma_put(fb, i, b[(2 * t + (i & 1) + (i >= 2 ? 8 : 0)) * 8 + g]);
    for (int i = 0; i < 4; i++)
        acc[i] = c[(i < 2 ? g : g + 8) * 8 + 2 * t + (i & 1)];
    emu_mma_m16n8k16<T>(acc, fa, fb);
    for (int i = 0; i < 4; i++)
        d[w * 128 + (i < 2 ? g : g + 8) * 8 + 2 * t + (i & 1)] = acc[i];
}

/* One warp: the lanes below `lanes` execute the instruction, the others a __syncwarp (which
 * the emulator's first barrier of the call lets through with them). */
static __global__ void k_mma_some_lanes(int lanes)
{
    uint32_t fa[4] = {0, 0, 0, 0}, fb[2] = {0, 0};
    float acc[4] = {0, 0, 0, 0};
    if ((int)threadIdx.x < lanes)
        emu_mma_m16n8k16<__half>(acc, fa, fb);
    else
        __syncwarp();
}

/* Each thread publishes a value in shared memory, passes a warp barrier only, and reads the
 * same lane's slot of the other warp (a race: only __syncthreads orders the two warps); then
 * again after __syncthreads. */
__global__ void k_ahead(int *out, int tag)
{
    __shared__ int s[64];
    s[threadIdx.x] = tag + (int)threadIdx.x;
    __syncwarp();
    out[threadIdx.x] = s[threadIdx.x ^ 32];
    __syncthreads();
    out[64 + threadIdx.x] = s[threadIdx.x ^ 32];
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

/* Under a shuffle seed the first warp through a warp barrier runs on ahead of the other, so
 * reading the other warp's shared memory without __syncthreads gives stale values; in index
 * order every thread writes before any reads. After __syncthreads all values are there. */
START_TEST(t_warp_ahead)
{
    const char *seed = getenv("AMPD_CUDAEMU_SHUFFLE");
    bool ahead = seed != NULL && strtoull(seed, NULL, 10) != 0;
    int *d = NULL, out[128], stale = 0;
    ck_assert_int_eq(cudaMalloc(&d, sizeof(out)), cudaSuccess);
    k_ahead<<<1, 64>>>(d, 7000);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(out, d, sizeof(out), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int i = 0; i < 64; i++) {
        ck_assert_int_eq(out[64 + i], 7000 + (i ^ 32));
        stale += out[i] != 7000 + (i ^ 32);
    }
    if (ahead)
        ck_assert_msg(stale > 0, "a warp ran ahead, yet read no stale value");
    else
        ck_assert_int_eq(stale, 0);
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

/* Run k_mma<T> on two warps and compare D with the double reference bit for bit. */
template <typename T>
static void check_mma(bool bf16)
{
    uint16_t ha[2 * 256], hb[128];
    float hc[128], hd[2 * 128];
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < 16; i++)
            for (int k = 0; k < 16; k++)
                ha[w * 256 + i * 16 + k] = bits16(wm_a(i + 3 * w, k), bf16);
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < 8; n++)
            hb[k * 8 + n] = bits16(wm_b(k, n), bf16);
    for (int i = 0; i < 16; i++)
        for (int n = 0; n < 8; n++)
            hc[i * 8 + n] = wm_c(i, n);
    uint16_t *da = NULL, *db = NULL;
    float *dc = NULL, *dd = NULL;
    ck_assert_int_eq(cudaMalloc(&da, sizeof(ha)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&db, sizeof(hb)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&dc, sizeof(hc)), cudaSuccess);
    ck_assert_int_eq(cudaMalloc(&dd, sizeof(hd)), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(da, ha, sizeof(ha), cudaMemcpyHostToDevice), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(db, hb, sizeof(hb), cudaMemcpyHostToDevice), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(dc, hc, sizeof(hc), cudaMemcpyHostToDevice), cudaSuccess);
    k_mma<T><<<1, 64>>>(da, db, dc, dd);
    ck_assert_int_eq(cudaGetLastError(), cudaSuccess);
    ck_assert_int_eq(cudaMemcpy(hd, dd, sizeof(hd), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < 16; i++)
            for (int n = 0; n < 8; n++) {
                double want = wm_c(i, n);
                for (int k = 0; k < 16; k++)
                    want += (double)wm_a(i + 3 * w, k) * wm_b(k, n);
                ck_assert_msg(hd[w * 128 + i * 8 + n] == (float)want,
                              "%s, warp %d: d(%d,%d) = %g, want %g", bf16 ? "bf16" : "fp16", w, i,
                              n, (double)hd[w * 128 + i * 8 + n], want);
            }
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
    cudaFree(dd);
}

START_TEST(t_mma)
{
    check_mma<__half>(false);
    check_mma<__nv_bfloat16>(true);
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

static void mma_partial_warp(void)    /* warp 1 of 48 threads: 16 lanes */
{
    uint16_t *a = NULL;
    float *d = NULL;
    if (cudaMalloc(&a, 512 * sizeof(uint16_t)) != cudaSuccess ||
        cudaMalloc(&d, 256 * sizeof(float)) != cudaSuccess ||
        cudaMemset(a, 0, 512 * sizeof(uint16_t)) != cudaSuccess ||
        cudaMemset(d, 0, 256 * sizeof(float)) != cudaSuccess)
        return;
    k_mma<__half><<<1, 48>>>(a, a, d, d);
    cudaDeviceSynchronize();
}

static void mma_half_warp(void)
{
    k_mma_some_lanes<<<1, 32>>>(16);
    cudaDeviceSynchronize();
}

/* The instruction is warp-collective: the emulator reports a warp it cannot run. */
START_TEST(t_mma_faults)
{
    static const char *const half[] = {"mma.sync.m16n8k16 in block (0,0,0), thread (",
                                       "only lanes 0x0000ffff of its warp execute it", NULL};
    k_mma_some_lanes<<<1, 32>>>(32);
    ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
    ck_assert(child_dies_saying(mma_partial_warp, "fewer than 32 threads"));
    ck_assert(child_dies_saying_all(mma_half_warp, half));
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
    tcase_add_test(tc, t_warp_ahead);
    tcase_add_test(tc, t_bad_launch);
    tcase_add_test(tc, t_copy_bounds);
    tcase_add_test(tc, t_faults);
    tcase_add_test(tc, t_lt_attribute_size);
    tcase_add_test(tc, t_half_convert);
    tcase_add_test(tc, t_math);
    tcase_add_test(tc, t_mma);
    tcase_add_test(tc, t_mma_faults);
    suite_add_tcase(s, tc);
    return cudatest_main("check_cudaemu_self", s);
}
