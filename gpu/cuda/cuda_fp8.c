/*
 * cuda_fp8.c - an fp8 linear's casts and GEMMs on a CUDA device, for the MLP (cuda_mlp.c) and
 * the GPT (cuda_gpt.c): the scaled casts of cuda_blas.h with the recipe of ctx->fp8 applied
 * on the device, and the fp8 GEMM with the two operands' scale_inv read from their scaling
 * rows (gpu/fp8.h's layout: GEMM g's operand r at row 3 g + r of 2 + fp8_len floats, scale,
 * scale_inv, then the amax history whose first slot stages this step's amax).
 *
 * The rules are gpu/fp8_state.c's on the CPU: current scaling measures the tensor, sets the
 * row's scale from that amax and then casts; delayed scaling casts with the row's scale and,
 * while training (ctx->fp8_record), folds the tensor's amax into the staging slot, which the
 * trainer's update after backward rolls into the history. On a collecting step
 * (ctx->fp8_counts) each cast also counts into its row's gpu_cuda_fp8_counts.
 *
 * Threads: everything is enqueued on ctx->stream.
 */
#include "gpu/cuda/cuda_model.h"
#include "gpu/cuda/cuda_util.h"
#include "gpu/fp8.h"

/* The scaling row of GEMM g's operand r. */
static float *row_of(const gpu_cuda_model_ctx *c, int g, int r)
{
    return c->fp8_state + (size_t)(3 * g + r) * (size_t)(2 + c->fp8_len);
}

/* See cuda_model.h. */
int gpu_cuda_fp8_cast_op(const gpu_cuda_model_ctx *c, int g, int r, const void *src, gpu_dtype dt,
                         int rows, int cols, uint8_t *dst, uint8_t *dst_t)
{
    const gpu_fp8_config *f = c->fp8;
    gpu_fp8_format fmt = gpu_fp8_role_format(f, r);
    float *row = row_of(c, g, r);
    cudaStream_t s = c->stream;
    gpu_cuda_fp8_counts *k = c->fp8_counts ? c->fp8_counts + 3 * g + r : NULL;
    if (f->recipe == GPU_FP8_CURRENT) {
        GPU_TRY(gpu_cuda_c_check(cudaMemsetAsync(row + 2, 0, sizeof(float), s), "fp8 amax"));
        GPU_TRY(gpu_cuda_fp8_cast(s, NULL, NULL, src, dt, rows, cols, fmt, row, row + 2, NULL));
        GPU_TRY(gpu_cuda_fp8_current(s, row, row + 2, gpu_fp8_max(fmt), f->amax_epsilon));
        return gpu_cuda_fp8_cast(s, dst, dst_t, src, dt, rows, cols, fmt, row, NULL, k);
    }
    return gpu_cuda_fp8_cast(s, dst, dst_t, src, dt, rows, cols, fmt, row,
                             c->fp8_record ? row + 2 : NULL, k);
}

/* See cuda_model.h. */
int gpu_cuda_fp8_cast_weight(const gpu_cuda_model_ctx *c, int g, size_t w_off, int rows, int cols,
                             uint8_t *dst, uint8_t *dst_t)
{
    const void *W = c->master ? (const void *)(c->master + w_off)
                              : (const uint8_t *)c->work + w_off * gpu_dtype_size(c->wdt);
    return gpu_cuda_fp8_cast_op(c, g, GPU_FP8_W, W, c->master ? GPU_FP32 : c->wdt, rows, cols, dst,
                                dst_t);
}

/* See cuda_model.h. */
int gpu_cuda_fp8_gemm_op(const gpu_cuda_model_ctx *c, int g, int M, int N, int K, const uint8_t *A,
                         int ra, const uint8_t *B, int rb, float *C)
{
    const gpu_fp8_config *f = c->fp8;
    gpu_cuda_mm8 mm = {.M = M,
                       .N = N,
                       .K = K,
                       .A = A,
                       .af = gpu_fp8_role_format(f, ra),
                       .lda = K,
                       .B = B,
                       .bf = gpu_fp8_role_format(f, rb),
                       .ldb = K,
                       .a_scale_inv = row_of(c, g, ra) + 1,
                       .b_scale_inv = row_of(c, g, rb) + 1,
                       .C = C,
                       .cdt = GPU_FP32,
                       .ldc = N};
    return gpu_cuda_matmul_fp8(c->blas, c->stream, &mm);
}
