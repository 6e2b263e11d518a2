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
 *   - the emulated cuBLASLt rejects an attribute of the wrong size, as the library does.
 *
 * This file is CUDA: the build runs it through cu2cc.sh like the backend's kernels.
 */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cublasLt.h>
#include <cuda_runtime.h>

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

/* Run fn in a child with stderr captured: true when the child died (a signal or a non-zero
 * exit, as the sanitizers report it) and its stderr holds want. */
static bool child_dies_saying(void (*fn)(void), const char *want)
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
    if (!died || strstr(buf, want) == NULL)
        fprintf(stderr, "child: status 0x%x, stderr:\n%s\n", status, buf);
    return died && strstr(buf, want) != NULL;
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
    suite_add_tcase(s, tc);
    return cudatest_main("check_cudaemu_self", s);
}
