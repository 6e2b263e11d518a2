/*
 * fp8_gemm.c - the fp8 GEMM and the fp8 recipe's configuration.
 *
 * The GEMM multiplies fp8 codes as Hopper's tensor cores do in cuBLASLt's scaled mode:
 * D = (sum of the products of the decoded operands) * (a_scale_inv * b_scale_inv). Exact
 * (the default): every fp8 value is exact in bf16 (E4M3 spans 2^-9..448 with 4 significant
 * bits, E5M2 2^-16..57344 with 3), so the operands are decoded to bf16 and multiplied by the
 * engine's bf16 GEMM, whose products are exact in fp32 and whose sums are fp32 (products of
 * two fp8 values are multiples of 2^-25, never fp32 subnormals, so kernels that flush
 * subnormals lose nothing). The accumulator model (acc.bits > 0) is a plain loop, slow, for
 * questions about the hardware, not for training speed.
 *
 * Threads: thread-safe (the decode tables are built once, under pthread_once); the exact
 * path uses the GEMM libraries' threads, the model the OpenMP team.
 */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "gpu/gpu_int.h"

void gpu_fp8_defaults(gpu_fp8_config *c)
{
    memset(c, 0, sizeof(*c));
    c->recipe = GPU_FP8_DELAYED;
    c->format = GPU_FP8_HYBRID;
    c->amax_history_len = 1024;
    c->amax_algo = GPU_FP8_AMAX_MAX;
    c->acc.promote = 128;
}

gpu_fp8_format gpu_fp8_role_format(const gpu_fp8_config *c, int role)
{
    return role == 2 && c->format == GPU_FP8_HYBRID ? GPU_E5M2 : GPU_E4M3;
}

/* ---- decoding ---------------------------------------------------------------------------- */

static uint16_t bf16_of[2][256];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void build(void)
{
    for (int f = 0; f < 2; f++)
        for (int c = 0; c < 256; c++) {
            float v = gpu_fp8_to_f32((uint8_t)c, (gpu_fp8_format)f);
            uint32_t u;
            memcpy(&u, &v, sizeof(u));
            bf16_of[f][c] = (uint16_t)(u >> 16); /* the low half is 0: exact */
        }
}

/* rows x cols codes (leading dimension ld) into a packed bf16 array. */
static void decode_bf16(uint16_t *dst, const uint8_t *src, int rows, int cols, int ld,
                        gpu_fp8_format f)
{
    const uint16_t *t = bf16_of[f == GPU_E5M2];
#pragma omp parallel for if (gpu_par_worth((size_t)rows * cols)) schedule(static)
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            dst[(size_t)r * cols + c] = t[src[(size_t)r * ld + c]];
}

static void decode_f32(float *dst, const uint8_t *src, int rows, int cols, int ld, gpu_fp8_format f)
{
#pragma omp parallel for if (gpu_par_worth((size_t)rows * cols)) schedule(static)
    for (int r = 0; r < rows; r++)
        gpu_cvt_fp8_f32(dst + (size_t)r * cols, src + (size_t)r * ld, (size_t)cols, f);
}

/* ---- the GEMM ------------------------------------------------------------------------------ */

static size_t half_floats(size_t n)
{
    return (n + 1) / 2 + 16; /* bf16 values, rounded up, and room to align */
}

size_t gpu_gemm_fp8_scratch_floats(int M, int N, int K)
{
    size_t a = (size_t)M * K, b = (size_t)K * N;
    size_t exact = half_floats(a) + half_floats(b) +
                   gpu_gemm_ex_scratch_floats(M, N, K, GPU_BF16, GPU_BF16, GPU_BF16, 0);
    size_t model = a + b;
    return exact > model ? exact : model;
}

size_t gpu_gemm_fp8_linear_scratch_floats(int N, int O, int K)
{
    size_t s[3] = {gpu_gemm_fp8_scratch_floats(N, O, K), gpu_gemm_fp8_scratch_floats(N, K, O),
                   gpu_gemm_fp8_scratch_floats(O, K, N)};
    size_t most = s[0] > s[1] ? s[0] : s[1];
    return most > s[2] ? most : s[2];
}

/* The partial sum kept to `bits` mantissa bits, the rest cut off (toward zero). */
static float trunc_bits(float x, int bits)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7F800000u) != 0x7F800000u)
        u &= ~((1u << (23 - bits)) - 1u);
    memcpy(&x, &u, sizeof(x));
    return x;
}

/* The accumulator model on decoded fp32 operands, packed (A: ta ? K x M : M x K). */
static void model_gemm(bool ta, bool tb, int M, int N, int K, const float *A, const float *B,
                       const gpu_fp8_acc *acc, float s, float *C, int ldc)
{
#pragma omp parallel for schedule(static)
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float total = 0.0f;
            for (int k0 = 0; k0 < K; k0 += acc->promote) {
                int k1 = K - k0 < acc->promote ? K : k0 + acc->promote;
                float part = 0.0f;
                for (int k = k0; k < k1; k++) {
                    float a = ta ? A[(size_t)k * M + i] : A[(size_t)i * K + k];
                    float b = tb ? B[(size_t)j * K + k] : B[(size_t)k * N + j];
                    part = trunc_bits(part + a * b, acc->bits);
                }
                total += part;
            }
            C[(size_t)i * ldc + j] = total * s;
        }
}

static void *aligned(float *p)
{
    return (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

int gpu_gemm_fp8(bool ta, bool tb, int M, int N, int K, const uint8_t *A, gpu_fp8_format af,
                 float a_scale_inv, int lda, const uint8_t *B, gpu_fp8_format bf, float b_scale_inv,
                 int ldb, const gpu_fp8_acc *acc, float *C, int ldc, float *scratch,
                 size_t scratch_floats)
{
    int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    bool model = acc && acc->bits > 0;
    float s = a_scale_inv * b_scale_inv;

    if (M < 0 || N < 0 || K < 0 || (af == GPU_E5M2 && bf == GPU_E5M2) || lda < ac || ldb < bc ||
        ldc < N || (model && (acc->bits > 23 || acc->promote < 1)))
        return GPU_EINVAL;
    if (scratch_floats < gpu_gemm_fp8_scratch_floats(M, N, K))
        return GPU_ESCRATCH;
    if (M == 0 || N == 0)
        return 0;
    pthread_once(&once, build);
    if (model) {
        float *a32 = scratch, *b32 = scratch + (size_t)ar * ac;
        decode_f32(a32, A, ar, ac, lda, af);
        decode_f32(b32, B, br, bc, ldb, bf);
        model_gemm(ta, tb, M, N, K, a32, b32, acc, s, C, ldc);
        return 0;
    }
    uint16_t *a16 = aligned(scratch);
    uint16_t *b16 = aligned(scratch + half_floats((size_t)ar * ac));
    float *rest = scratch + half_floats((size_t)ar * ac) + half_floats((size_t)br * bc);
    size_t rest_n = scratch_floats - (size_t)(rest - scratch);
    decode_bf16(a16, A, ar, ac, lda, af);
    decode_bf16(b16, B, br, bc, ldb, bf);
    int rc = gpu_gemm_ex(ta, tb, M, N, K, a16, GPU_BF16, ac, b16, GPU_BF16, bc, GPU_BF16,
                         GPU_GEMM_AB_CONVERTED, 0.0f, C, ldc, rest, rest_n);
    if (rc)
        return rc;
#pragma omp parallel for if (gpu_par_worth((size_t)M * N)) schedule(static)
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++)
            C[(size_t)i * ldc + j] *= s;
    return 0;
}
