/*
 * ops_host.cu - the tests' synchronous host-buffer wrappers of the models' non-GEMM ops and
 * of flash attention (declared in tests/cudahost/cudahost.h; the launches are
 * gpu/cuda/cuda_ops.h's). Each takes the CPU op's calling convention (fp32 host arrays
 * holding values of the dtype named), stores every tensor on the device in that dtype, runs
 * the op's *_launch on the default stream and converts the results back.
 *
 * Invariants: GPU_ENODEV without a device before anything is allocated; every device buffer
 * is freed on every path (STEP below). Threads: synchronous; each call owns its buffers.
 */
#include <stdint.h>
#include <stdlib.h>

#include "gpu/cuda/cuda_common.cuh"
#include "gpu/cuda/cuda_ops.h"
#include "tests/cudahost/cudahost.h"

static bool dt_ok(gpu_dtype dt)
{
    return (unsigned)dt <= (unsigned)GPU_BF16;
}

/* *d = a device buffer of bytes bytes (NULL when bytes is 0). */
static int dev_alloc(void **d, size_t bytes)
{
    *d = NULL;
    if (bytes == 0)
        return 0;
    GPU_CUDA_CHECK(cudaMalloc(d, bytes));
    return 0;
}

/* *d = a device copy of bytes bytes at h. */
static int dev_raw(void **d, const void *h, size_t bytes)
{
    int rc = dev_alloc(d, bytes);
    if (rc != 0 || bytes == 0)
        return rc;
    GPU_CUDA_CHECK(cudaMemcpy(*d, h, bytes, cudaMemcpyHostToDevice));
    return 0;
}

/* *d = the n fp32 values at h stored in dt (exact when they are values of dt). */
static int dev_put(void **d, const float *h, size_t n, gpu_dtype dt)
{
    size_t bytes = n * gpu_dtype_size(dt);
    if (dt == GPU_FP32 || bytes == 0)
        return dev_raw(d, h, bytes);
    void *tmp = malloc(bytes);
    *d = NULL;
    if (tmp == NULL)
        return GPU_ENOMEM;
    gpu_cvt_from_f32(tmp, dt, h, n);
    int rc = dev_raw(d, tmp, bytes);
    free(tmp);
    return rc;
}

/* The n values of a device tensor stored in dt into h as fp32. */
static int dev_get(float *h, const void *d, size_t n, gpu_dtype dt)
{
    size_t bytes = n * gpu_dtype_size(dt);
    void *tmp = NULL;
    int rc = 0;
    if (bytes == 0)
        return 0;
    if (dt == GPU_FP32) {
        GPU_CUDA_CHECK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
        return 0;
    }
    tmp = malloc(bytes);
    if (tmp == NULL)
        return GPU_ENOMEM;
    GPU_CUDA_TRY(cudaMemcpy(tmp, d, bytes, cudaMemcpyDeviceToHost));
    gpu_cvt_to_f32(h, tmp, dt, n);
fail:
    free(tmp);
    return rc;
}

/* The ops below: rc = the first failing step; device buffers freed on every path. */
#define STEP(call)           \
    do {                     \
        rc = (call);         \
        if (rc != 0)         \
            goto fail;       \
    } while (0)

/* See cudahost.h. */
int gpu_cuda_embed_fwd(const int *x, int B, int T, int C, int V, const void *wte,
                       const void *wpe, gpu_dtype wdt, gpu_dtype out_dt, float *out)
{
    int rc = gpu_cuda_ready();
    void *d_x = NULL, *d_wte = NULL, *d_wpe = NULL, *d_out = NULL;
    if (rc != 0)
        return rc;
    if (B < 0 || T < 1 || C < 1 || V < 1 || !dt_ok(wdt) || !dt_ok(out_dt))
        return GPU_EINVAL;
    size_t N = (size_t)B * T, es = gpu_dtype_size(wdt);
    if (N == 0)
        return 0;
    if (x == NULL || wte == NULL || wpe == NULL || out == NULL)
        return GPU_EINVAL;
    STEP(dev_raw(&d_x, x, N * sizeof(int)));
    STEP(dev_raw(&d_wte, wte, (size_t)V * C * es));
    STEP(dev_raw(&d_wpe, wpe, (size_t)T * C * es));
    STEP(dev_alloc(&d_out, N * C * gpu_dtype_size(out_dt)));
    STEP(gpu_cuda_embed_fwd_launch((const int *)d_x, B, T, C, V, d_wte, d_wpe, wdt, out_dt, d_out,
                                   out_dt, 0));
    STEP(dev_get(out, d_out, N * C, out_dt));
fail:
    cudaFree(d_out);
    cudaFree(d_wpe);
    cudaFree(d_wte);
    cudaFree(d_x);
    return rc;
}

/* See cudahost.h. */
int gpu_cuda_embed_bwd(const int *x, int B, int T, int C, int V, const float *dout,
                       gpu_dtype dt, float *dwte, float *dwpe)
{
    int rc = gpu_cuda_ready();
    void *d_x = NULL, *d_dout = NULL, *d_dwte = NULL, *d_dwpe = NULL, *d_work = NULL;
    size_t wbytes = 0;
    if (rc != 0)
        return rc;
    if (B < 0 || T < 1 || C < 1 || V < 1 || !dt_ok(dt))
        return GPU_EINVAL;
    size_t N = (size_t)B * T;
    if (N == 0)
        return 0;
    if (x == NULL || dout == NULL || dwte == NULL || dwpe == NULL || N > (size_t)INT32_MAX)
        return GPU_EINVAL;
    STEP(gpu_cuda_embed_bwd_workspace((int)N, &wbytes));
    STEP(dev_raw(&d_x, x, N * sizeof(int)));
    STEP(dev_put(&d_dout, dout, N * C, dt));
    STEP(dev_put(&d_dwte, dwte, (size_t)V * C, GPU_FP32));
    STEP(dev_put(&d_dwpe, dwpe, (size_t)T * C, GPU_FP32));
    STEP(dev_alloc(&d_work, wbytes));
    STEP(gpu_cuda_embed_bwd_launch((const int *)d_x, B, T, C, V, d_dout, dt, dt, (float *)d_dwte,
                                   (float *)d_dwpe, d_work, wbytes, 0));
    STEP(dev_get(dwte, d_dwte, (size_t)V * C, GPU_FP32));
    STEP(dev_get(dwpe, d_dwpe, (size_t)T * C, GPU_FP32));
fail:
    cudaFree(d_work);
    cudaFree(d_dwpe);
    cudaFree(d_dwte);
    cudaFree(d_dout);
    cudaFree(d_x);
    return rc;
}

/* See cudahost.h. */
int gpu_cuda_layernorm_fwd(const float *x, const float *g, const float *b, int N, int C,
                           gpu_dtype dt, float *y, float *mean, float *rstd)
{
    int rc = gpu_cuda_ready();
    void *d_x = NULL, *d_g = NULL, *d_b = NULL, *d_y = NULL, *d_mean = NULL, *d_rstd = NULL;
    if (rc != 0)
        return rc;
    if (N < 0 || C < 1 || !dt_ok(dt))
        return GPU_EINVAL;
    if (N == 0)
        return 0;
    if (x == NULL || g == NULL || b == NULL || y == NULL || mean == NULL || rstd == NULL)
        return GPU_EINVAL;
    size_t n = (size_t)N * C;
    STEP(dev_put(&d_x, x, n, dt));
    STEP(dev_put(&d_g, g, (size_t)C, GPU_FP32));
    STEP(dev_put(&d_b, b, (size_t)C, GPU_FP32));
    STEP(dev_alloc(&d_y, n * gpu_dtype_size(dt)));
    STEP(dev_alloc(&d_mean, (size_t)N * sizeof(float)));
    STEP(dev_alloc(&d_rstd, (size_t)N * sizeof(float)));
    STEP(gpu_cuda_layernorm_fwd_launch(d_x, dt, d_g, d_b, GPU_FP32, N, C, dt, d_y, dt,
                                       (float *)d_mean, (float *)d_rstd, 0));
    STEP(dev_get(y, d_y, n, dt));
    STEP(dev_get(mean, d_mean, (size_t)N, GPU_FP32));
    STEP(dev_get(rstd, d_rstd, (size_t)N, GPU_FP32));
fail:
    cudaFree(d_rstd);
    cudaFree(d_mean);
    cudaFree(d_y);
    cudaFree(d_b);
    cudaFree(d_g);
    cudaFree(d_x);
    return rc;
}

/* See cudahost.h. */
int gpu_cuda_layernorm_bwd(const float *dy, const float *x, const float *mean,
                           const float *rstd, const float *g, int N, int C, gpu_dtype dt,
                           float *dx, float *dg, float *db)
{
    int rc = gpu_cuda_ready();
    void *d_dy = NULL, *d_x = NULL, *d_mean = NULL, *d_rstd = NULL, *d_g = NULL, *d_dx = NULL;
    void *d_dg = NULL, *d_db = NULL, *d_work = NULL;
    if (rc != 0)
        return rc;
    if (N < 0 || C < 1 || !dt_ok(dt) || dg == NULL || db == NULL)
        return GPU_EINVAL;
    if (N > 0 && (dy == NULL || x == NULL || mean == NULL || rstd == NULL || g == NULL ||
                  dx == NULL))
        return GPU_EINVAL;
    size_t n = (size_t)N * C;
    STEP(dev_put(&d_dy, dy, n, dt));
    STEP(dev_put(&d_x, x, n, dt));
    STEP(dev_put(&d_mean, mean, (size_t)N, GPU_FP32));
    STEP(dev_put(&d_rstd, rstd, (size_t)N, GPU_FP32));
    STEP(dev_put(&d_g, g, N > 0 ? (size_t)C : 0, GPU_FP32));
    STEP(dev_alloc(&d_dx, n * gpu_dtype_size(dt)));
    STEP(dev_alloc(&d_dg, (size_t)C * sizeof(float)));
    STEP(dev_alloc(&d_db, (size_t)C * sizeof(float)));
    STEP(dev_alloc(&d_work, gpu_cuda_layernorm_bwd_workspace(N, C)));
    STEP(gpu_cuda_layernorm_bwd_launch(d_dy, dt, d_x, dt, (const float *)d_mean,
                                       (const float *)d_rstd, d_g, GPU_FP32, N, C, dt, d_dx, dt,
                                       (float *)d_dg, (float *)d_db, d_work, 0));
    STEP(dev_get(dx, d_dx, n, dt));
    STEP(dev_get(dg, d_dg, (size_t)C, GPU_FP32));
    STEP(dev_get(db, d_db, (size_t)C, GPU_FP32));
fail:
    cudaFree(d_work);
    cudaFree(d_db);
    cudaFree(d_dg);
    cudaFree(d_dx);
    cudaFree(d_g);
    cudaFree(d_rstd);
    cudaFree(d_mean);
    cudaFree(d_x);
    cudaFree(d_dy);
    return rc;
}

/* An elementwise op on host arrays: in1 (and in2 when not NULL) up, kernel, out down. The
 * launch runs in place on the first input's device copy when inplace is set. */
typedef enum { EW_GELU_FWD, EW_GELU_BWD, EW_ACT_FWD, EW_ACT_BWD } ew_op;

static int elementwise(ew_op op, gpu_activation act, float *out, const float *in1,
                       const float *in2, size_t n, gpu_dtype dt)
{
    int rc = gpu_cuda_ready();
    void *d1 = NULL, *d2 = NULL, *d_out = NULL;
    if (rc != 0)
        return rc;
    if (!dt_ok(dt) || ((op == EW_ACT_FWD || op == EW_ACT_BWD) && act != GPU_ACT_RELU &&
                       act != GPU_ACT_GELU))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if (out == NULL || in1 == NULL || (op != EW_GELU_FWD && op != EW_ACT_FWD && in2 == NULL))
        return GPU_EINVAL;
    size_t bytes = n * gpu_dtype_size(dt);
    STEP(dev_put(&d1, in1, n, dt));
    if (in2 != NULL && op != EW_GELU_FWD && op != EW_ACT_FWD)
        STEP(dev_put(&d2, in2, n, dt));
    switch (op) {
    case EW_GELU_FWD:
        STEP(dev_alloc(&d_out, bytes));
        STEP(gpu_cuda_gelu_tanh_fwd_launch(d1, dt, d_out, dt, n, dt, 0));
        break;
    case EW_GELU_BWD: /* in1 = d (in place), in2 = u */
        STEP(gpu_cuda_gelu_tanh_bwd_launch(d1, d1, dt, d2, dt, n, dt, 0));
        break;
    case EW_ACT_FWD:
        STEP(dev_alloc(&d_out, bytes));
        STEP(gpu_cuda_act_fwd_launch(act, d1, dt, d_out, dt, n, dt, 0));
        break;
    case EW_ACT_BWD: /* in1 = d (in place), in2 = saved */
        STEP(gpu_cuda_act_bwd_launch(act, d1, d1, dt, d2, dt, n, dt, 0));
        break;
    }
    STEP(dev_get(out, d_out != NULL ? d_out : d1, n, dt));
fail:
    cudaFree(d_out);
    cudaFree(d2);
    cudaFree(d1);
    return rc;
}

/* See cudahost.h. */
int gpu_cuda_gelu_tanh_fwd(float *dst, const float *u, size_t n, gpu_dtype dt)
{
    return elementwise(EW_GELU_FWD, GPU_ACT_GELU, dst, u, NULL, n, dt);
}

/* See cudahost.h. */
int gpu_cuda_gelu_tanh_bwd(float *d, const float *u, size_t n, gpu_dtype dt)
{
    return elementwise(EW_GELU_BWD, GPU_ACT_GELU, d, d, u, n, dt);
}

/* See cudahost.h. */
int gpu_cuda_act_fwd(gpu_activation act, float *dst, const float *z, size_t n, gpu_dtype dt)
{
    return elementwise(EW_ACT_FWD, act, dst, z, NULL, n, dt);
}

/* See cudahost.h. */
int gpu_cuda_act_bwd(gpu_activation act, float *d, const float *saved, size_t n, gpu_dtype dt)
{
    return elementwise(EW_ACT_BWD, act, d, d, saved, n, dt);
}

/* See cudahost.h. */
int gpu_cuda_bias_add(float *out, const float *in, const void *bias, gpu_dtype bdt, int rows,
                      int n, gpu_dtype dt)
{
    int rc = gpu_cuda_ready();
    void *d_in = NULL, *d_bias = NULL, *d_out = NULL;
    if (rc != 0)
        return rc;
    if (rows < 0 || n < 0 || !dt_ok(bdt) || !dt_ok(dt))
        return GPU_EINVAL;
    size_t total = (size_t)rows * n;
    if (total == 0)
        return 0;
    if (out == NULL || in == NULL || bias == NULL)
        return GPU_EINVAL;
    STEP(dev_put(&d_in, in, total, GPU_FP32));
    STEP(dev_raw(&d_bias, bias, (size_t)n * gpu_dtype_size(bdt)));
    STEP(dev_alloc(&d_out, total * gpu_dtype_size(dt)));
    STEP(gpu_cuda_bias_add_launch(d_in, GPU_FP32, d_bias, bdt, rows, n, dt, d_out, dt, 0));
    STEP(dev_get(out, d_out, total, dt));
fail:
    cudaFree(d_out);
    cudaFree(d_bias);
    cudaFree(d_in);
    return rc;
}

/* See cudahost.h. */
int gpu_cuda_bias_grad(float *db, const float *dz, int rows, int n, gpu_dtype dt)
{
    int rc = gpu_cuda_ready();
    void *d_dz = NULL, *d_db = NULL, *d_work = NULL;
    if (rc != 0)
        return rc;
    if (rows < 0 || n < 0 || !dt_ok(dt))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if (db == NULL || (rows > 0 && dz == NULL))
        return GPU_EINVAL;
    STEP(dev_put(&d_dz, dz, (size_t)rows * n, dt));
    STEP(dev_alloc(&d_db, (size_t)n * sizeof(float)));
    STEP(dev_alloc(&d_work, gpu_cuda_bias_grad_workspace(rows, n)));
    STEP(gpu_cuda_bias_grad_launch(d_dz, dt, rows, n, dt, (float *)d_db, d_work, 0));
    STEP(dev_get(db, d_db, (size_t)n, GPU_FP32));
fail:
    cudaFree(d_work);
    cudaFree(d_db);
    cudaFree(d_dz);
    return rc;
}

/* The cross-entropy wrappers' common part: logits up (in ldt), the forward or fused kernel,
 * the sums down. probs (fwd only, may be NULL) come back as values of ce_dt. */
static int ce_host(gpu_cuda_ce_style style, float *logits, gpu_dtype ldt, const int *y, int N,
                   int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float *probs, bool fused,
                   float seed, int count, double *loss_sum, int *correct)
{
    int rc = gpu_cuda_ready();
    void *d_lg = NULL, *d_y = NULL, *d_p = NULL, *d_loss = NULL, *d_correct = NULL;
    void *d_seed = NULL, *d_work = NULL;
    if (rc != 0)
        return rc;
    if (N < 0 || V < 1 || !dt_ok(ldt) || !dt_ok(lin_dt) || !dt_ok(ce_dt) || count < 1 ||
        loss_sum == NULL || correct == NULL || (N > 0 && (logits == NULL || y == NULL)))
        return GPU_EINVAL;
    size_t n = (size_t)N * V;
    STEP(dev_put(&d_lg, logits, n, ldt));
    STEP(dev_raw(&d_y, y, (size_t)N * sizeof(int)));
    if (probs != NULL)
        STEP(dev_alloc(&d_p, n * gpu_dtype_size(ce_dt)));
    STEP(dev_alloc(&d_loss, sizeof(double)));
    STEP(dev_alloc(&d_correct, sizeof(int)));
    STEP(dev_alloc(&d_work, gpu_cuda_ce_workspace(N)));
    if (fused) { /* the seed from the device, as a device-side loss scale gives it */
        STEP(dev_put(&d_seed, &seed, 1, GPU_FP32));
        STEP(gpu_cuda_ce_fused_launch(style, d_lg, ldt, (const int *)d_y, N, V, lin_dt, ce_dt,
                                      0.0f, (const float *)d_seed, count, (double *)d_loss,
                                      (int *)d_correct, d_work, 0));
    } else {
        STEP(gpu_cuda_ce_fwd_launch(style, d_lg, ldt, (const int *)d_y, N, V, lin_dt, ce_dt,
                                    d_p, ce_dt, (double *)d_loss, (int *)d_correct, d_work,
                                    0));
    }
    GPU_CUDA_TRY(cudaMemcpy(loss_sum, d_loss, sizeof(double), cudaMemcpyDeviceToHost));
    GPU_CUDA_TRY(cudaMemcpy(correct, d_correct, sizeof(int), cudaMemcpyDeviceToHost));
    if (probs != NULL)
        STEP(dev_get(probs, d_p, n, ce_dt));
    if (fused)
        STEP(dev_get(logits, d_lg, n, ldt));
fail:
    cudaFree(d_work);
    cudaFree(d_seed);
    cudaFree(d_correct);
    cudaFree(d_loss);
    cudaFree(d_p);
    cudaFree(d_y);
    cudaFree(d_lg);
    return rc;
}

/* See cudahost.h. */
int gpu_cuda_ce_fwd(gpu_cuda_ce_style style, const float *logits, gpu_dtype ldt, const int *y,
                    int N, int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float *probs,
                    double *loss_sum, int *correct)
{
    /* the logits are only read when not fused */
    return ce_host(style, const_cast<float *>(logits), ldt, y, N, V, lin_dt, ce_dt, probs, false,
                   0.0f, 1, loss_sum, correct);
}

/* See cudahost.h. */
int gpu_cuda_ce_fused(gpu_cuda_ce_style style, float *logits, gpu_dtype ldt, const int *y,
                      int N, int V, gpu_dtype lin_dt, gpu_dtype ce_dt, float seed, int count,
                      double *loss_sum, int *correct)
{
    return ce_host(style, logits, ldt, y, N, V, lin_dt, ce_dt, NULL, true, seed, count,
                   loss_sum, correct);
}

/* See cudahost.h. */
int gpu_cuda_ce_bwd(gpu_cuda_ce_style style, const float *probs, const int *y, int N, int V,
                    gpu_dtype ce_dt, gpu_dtype lin_dt, float seed, int count, float *dlogits)
{
    int rc = gpu_cuda_ready();
    void *d_p = NULL, *d_y = NULL, *d_dl = NULL;
    if (rc != 0)
        return rc;
    if (N < 0 || V < 1 || count < 1 || !dt_ok(ce_dt) || !dt_ok(lin_dt))
        return GPU_EINVAL;
    size_t n = (size_t)N * V;
    if (n == 0)
        return 0;
    if (probs == NULL || y == NULL || dlogits == NULL)
        return GPU_EINVAL;
    STEP(dev_put(&d_p, probs, n, ce_dt));
    STEP(dev_raw(&d_y, y, (size_t)N * sizeof(int)));
    STEP(dev_alloc(&d_dl, n * gpu_dtype_size(lin_dt)));
    STEP(gpu_cuda_ce_bwd_launch(style, d_p, ce_dt, (const int *)d_y, N, V, ce_dt, lin_dt, seed,
                                NULL, count, d_dl, lin_dt, 0));
    STEP(dev_get(dlogits, d_dl, n, lin_dt));
fail:
    cudaFree(d_dl);
    cudaFree(d_y);
    cudaFree(d_p);
    return rc;
}

/* See cudahost.h. */
int gpu_cuda_attn_softmax_fwd(const float *S, gpu_dtype sdt, int BH, int T, int hd,
                              gpu_dtype mm_dt, gpu_dtype sm_dt, float *P, float *Pm)
{
    int rc = gpu_cuda_ready();
    void *d_S = NULL, *d_P = NULL, *d_Pm = NULL;
    if (rc != 0)
        return rc;
    if (BH < 0 || T < 1 || hd < 1 || !dt_ok(sdt) || !dt_ok(mm_dt) || !dt_ok(sm_dt))
        return GPU_EINVAL;
    size_t n = (size_t)BH * T * T;
    if (n == 0)
        return 0;
    if (S == NULL || P == NULL)
        return GPU_EINVAL;
    STEP(dev_put(&d_S, S, n, sdt));
    STEP(dev_alloc(&d_P, n * gpu_dtype_size(sm_dt)));
    if (Pm != NULL)
        STEP(dev_alloc(&d_Pm, n * gpu_dtype_size(mm_dt)));
    STEP(gpu_cuda_attn_softmax_fwd_launch(d_S, sdt, BH, T, hd, mm_dt, sm_dt, d_P, sm_dt, d_Pm,
                                          mm_dt, 0));
    STEP(dev_get(P, d_P, n, sm_dt));
    if (Pm != NULL)
        STEP(dev_get(Pm, d_Pm, n, mm_dt));
fail:
    cudaFree(d_Pm);
    cudaFree(d_P);
    cudaFree(d_S);
    return rc;
}

/* See cudahost.h. */
int gpu_cuda_flash_fwd(const float *qkv, int B, int T, int C, int H, gpu_dtype dt, float *lse,
                       float *y)
{
    int rc = gpu_cuda_ready();
    void *d_qkv = NULL, *d_lse = NULL, *d_y = NULL;
    if (rc != 0)
        return rc;
    if (B < 0 || T < 0 || H < 1 || C % H != 0 || qkv == NULL || lse == NULL || y == NULL)
        return GPU_EINVAL;
    size_t n = (size_t)B * T * C;
    STEP(dev_put(&d_qkv, qkv, 3 * n, dt));
    STEP(dev_alloc(&d_lse, (size_t)B * H * T * sizeof(float)));
    STEP(dev_alloc(&d_y, n * gpu_dtype_size(dt)));
    STEP(gpu_cuda_flash_fwd_launch(d_qkv, dt, B, T, H, C / H, (float *)d_lse, d_y, dt, 0));
    STEP(dev_get(y, d_y, n, dt));
    STEP(dev_get(lse, d_lse, (size_t)B * H * T, GPU_FP32));
fail:
    cudaFree(d_y);
    cudaFree(d_lse);
    cudaFree(d_qkv);
    return rc;
}

/* See cudahost.h. */
int gpu_cuda_flash_bwd(const float *dy, const float *qkv, const float *o, const float *lse,
                       int B, int T, int C, int H, gpu_dtype dt, float *dqkv)
{
    int rc = gpu_cuda_ready();
    void *d_dy = NULL, *d_qkv = NULL, *d_o = NULL, *d_lse = NULL, *d_dsum = NULL, *d_dq = NULL;
    if (rc != 0)
        return rc;
    if (B < 0 || T < 0 || H < 1 || C % H != 0 || dy == NULL || qkv == NULL || o == NULL ||
        lse == NULL || dqkv == NULL)
        return GPU_EINVAL;
    size_t n = (size_t)B * T * C, rows = (size_t)B * H * T;
    STEP(dev_put(&d_dy, dy, n, dt));
    STEP(dev_put(&d_qkv, qkv, 3 * n, dt));
    STEP(dev_put(&d_o, o, n, dt));
    STEP(dev_put(&d_lse, lse, rows, GPU_FP32));
    STEP(dev_alloc(&d_dsum, rows * sizeof(float)));
    STEP(dev_alloc(&d_dq, 3 * n * gpu_dtype_size(dt)));
    STEP(gpu_cuda_flash_bwd_launch(d_qkv, d_dy, dt, d_o, dt, (const float *)d_lse, B, T, H, C / H,
                                   (float *)d_dsum, d_dq, dt, 0));
    STEP(dev_get(dqkv, d_dq, 3 * n, dt));
fail:
    cudaFree(d_dq);
    cudaFree(d_dsum);
    cudaFree(d_lse);
    cudaFree(d_o);
    cudaFree(d_qkv);
    cudaFree(d_dy);
    return rc;
}

/* See cudahost.h. When dP is stored in mm_dt, dS overwrites it (the in-place form). */
int gpu_cuda_attn_softmax_bwd(const float *P, const float *dP, gpu_dtype dpdt, int BH, int T,
                              int hd, gpu_dtype mm_dt, gpu_dtype sm_dt, float *dS)
{
    int rc = gpu_cuda_ready();
    void *d_P = NULL, *d_dP = NULL, *d_dS = NULL;
    if (rc != 0)
        return rc;
    if (BH < 0 || T < 1 || hd < 1 || !dt_ok(dpdt) || !dt_ok(mm_dt) || !dt_ok(sm_dt))
        return GPU_EINVAL;
    size_t n = (size_t)BH * T * T;
    if (n == 0)
        return 0;
    if (P == NULL || dP == NULL || dS == NULL)
        return GPU_EINVAL;
    STEP(dev_put(&d_P, P, n, sm_dt));
    STEP(dev_put(&d_dP, dP, n, dpdt));
    if (dpdt != mm_dt)
        STEP(dev_alloc(&d_dS, n * gpu_dtype_size(mm_dt)));
    STEP(gpu_cuda_attn_softmax_bwd_launch(d_P, sm_dt, d_dP, dpdt, BH, T, hd, mm_dt, sm_dt,
                                          d_dS != NULL ? d_dS : d_dP, mm_dt, 0));
    STEP(dev_get(dS, d_dS != NULL ? d_dS : d_dP, n, mm_dt));
fail:
    cudaFree(d_dS);
    cudaFree(d_dP);
    cudaFree(d_P);
    return rc;
}
