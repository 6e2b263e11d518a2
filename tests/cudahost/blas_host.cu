/*
 * blas_host.cu - the tests' synchronous host-buffer wrappers of the cuBLASLt GEMMs
 * (declared in tests/cudahost/cudahost.h): gpu_cuda_mm_host runs gpu_cuda_matmul
 * (gpu/cuda/cuda_blas.h) on host arrays with a handle of its own (gpu_cuda_mm8_host its fp8
 * product, gpu_cuda_fp8_cast_host the fp8 cast), and gpu_cuda_gemm_host
 * gives it gpu_gemm()'s contract (mixed operand dtypes widened on the host first).
 *
 * Invariants: the arguments are checked by the backend's own gpu_cuda_mm_check (host
 * pointers) and spans (gpu_cuda_mm_spans); C and aux are written back only when everything
 * succeeded, aux first. Threads: synchronous; each call opens and frees its own handle.
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_blas.h"
#include "gpu/cuda/cuda_common.cuh"
#include "tests/cudahost/cudahost.h"

static bool dt_ok(gpu_dtype dt)
{
    return dt == GPU_FP32 || dt == GPU_FP16 || dt == GPU_BF16;
}

/* Copy the n-element span of a host matrix to a new device buffer (*d stays NULL when n is
 * 0). src holds elements of dt, or fp32 values of dt when from_f32 (converted first). */
static int upload(void **d, const void *src, gpu_dtype dt, int64_t n, bool from_f32)
{
    int rc = 0;
    void *tmp = NULL;
    size_t bytes = (size_t)n * gpu_dtype_size(dt);

    *d = NULL;
    if (n == 0)
        return 0;
    if (from_f32 && dt != GPU_FP32) {
        tmp = malloc(bytes);
        if (tmp == NULL)
            return GPU_ENOMEM;
        gpu_cvt_from_f32(tmp, dt, (const float *)src, (size_t)n);
        src = tmp;
    }
    GPU_CUDA_TRY(cudaMalloc(d, bytes));
    GPU_CUDA_TRY(cudaMemcpy(*d, src, bytes, cudaMemcpyHostToDevice));
fail:
    free(tmp);
    return rc;
}

/* Copy back the M x N elements of each of batch matrices (ld, stride apart) of the device
 * span d (n elements of dt) into the host fp32 array dst at the same positions. */
static int download(float *dst, const void *d, gpu_dtype dt, int64_t n, int M, int N, int ld,
                    int batch, int64_t stride)
{
    int rc = 0;
    float *all = (float *)malloc((size_t)n * sizeof(float));
    void *raw = malloc((size_t)n * gpu_dtype_size(dt));

    if (all == NULL || raw == NULL) {
        rc = GPU_ENOMEM;
        goto fail;
    }
    GPU_CUDA_TRY(cudaMemcpy(raw, d, (size_t)n * gpu_dtype_size(dt), cudaMemcpyDeviceToHost));
    gpu_cvt_to_f32(all, raw, dt, (size_t)n);
    for (int b = 0; b < batch; b++)
        for (int i = 0; i < M; i++) {
            size_t off = (size_t)b * (size_t)stride + (size_t)i * (size_t)ld;
            memcpy(dst + off, all + off, (size_t)N * sizeof(float));
        }
fail:
    free(raw);
    free(all);
    return rc;
}

/* Host pointers in p borrowed (see cuda_blas.h); synchronous. */
extern "C" int gpu_cuda_mm_host(const gpu_cuda_mm *p)
{
    int rc = gpu_cuda_ready();
    int64_t sa = 0, sb = 0, sc = 0, sx = 0;
    gpu_cuda_blas *b = NULL;
    gpu_cuda_mm d;
    void *d_a = NULL, *d_b = NULL, *d_c = NULL, *d_bias = NULL, *d_aux = NULL;
    char why[320];

    if (rc != 0)
        return rc;
    rc = gpu_cuda_mm_check(p, false);
    if (rc != 0)
        return rc;
    if (p->M == 0 || p->N == 0)
        return 0;
    gpu_cuda_mm_spans(p, &sa, &sb, &sc, &sx);
    rc = gpu_cuda_blas_open(&b, why, sizeof(why));
    if (rc != 0) {
        fprintf(stderr, "gpu_cuda_mm_host: %s\n", why);
        return rc;
    }
    d = *p;
    if ((rc = upload(&d_a, p->A, p->adt, p->K > 0 ? sa : 0, false)) != 0 ||
        (rc = upload(&d_b, p->B, p->bdt, p->K > 0 ? sb : 0, false)) != 0 ||
        (rc = upload(&d_c, p->C, p->cdt, sc, true)) != 0 ||
        (rc = upload(&d_bias, p->bias, p->cdt, p->bias != NULL ? p->N : 0, true)) != 0)
        goto fail;
    if (sx > 0)
        GPU_CUDA_TRY(cudaMalloc(&d_aux, (size_t)sx * gpu_dtype_size(p->cdt)));
    d.A = d_a;
    d.B = d_b;
    d.C = d_c;
    d.bias = d_bias;
    d.aux = d_aux;
    rc = gpu_cuda_matmul(b, 0, &d);
    if (rc != 0)
        goto fail;
    GPU_CUDA_TRY(cudaDeviceSynchronize());
    if (d_aux != NULL) {
        /* aux first: C's copy is the last step, so a failure leaves both untouched */
        float *tmp = (float *)malloc((size_t)sx * sizeof(float));
        if (tmp == NULL) {
            rc = GPU_ENOMEM;
            goto fail;
        }
        memcpy(tmp, p->aux, (size_t)sx * sizeof(float));
        rc = download(tmp, d_aux, p->cdt, sx, p->M, p->N, p->aux_ld, 1, 0);
        if (rc == 0)
            rc = download((float *)p->C, d_c, p->cdt, sc, p->M, p->N, p->ldc, p->batch,
                          p->stride_c);
        if (rc == 0)
            memcpy(p->aux, tmp, (size_t)sx * sizeof(float));
        free(tmp);
    } else {
        rc = download((float *)p->C, d_c, p->cdt, sc, p->M, p->N, p->ldc, p->batch,
                      p->stride_c);
    }
fail:
    cudaFree(d_aux);
    cudaFree(d_bias);
    cudaFree(d_c);
    cudaFree(d_b);
    cudaFree(d_a);
    gpu_cuda_blas_free(b);
    return rc;
}

/* gpu_gemm()'s argument rules (gpu/blas.c), without a message. */
static bool gemm_args_ok(bool ta, bool tb, int M, int N, int K, const void *A, gpu_dtype adt,
                         int lda, const void *B, gpu_dtype bdt, int ldb, const float *C, int ldc)
{
    if (M < 0 || N < 0 || K < 0 || !dt_ok(adt) || !dt_ok(bdt))
        return false;
    int a_cols = ta ? M : K, b_cols = tb ? K : N;
    if (lda < 1 || lda < a_cols || ldb < 1 || ldb < b_cols || ldc < 1 || ldc < N)
        return false;
    if (M > 0 && N > 0 && C == NULL)
        return false;
    return !(M > 0 && N > 0 && K > 0 && (A == NULL || B == NULL));
}

/* A 16-bit host matrix widened to a new fp32 array over its whole span (*out NULL when the
 * span is empty). */
static int widen(float **out, const void *src, gpu_dtype dt, int rows, int cols, int ld)
{
    int64_t n = 0;
    *out = NULL;
    if (!gpu_cuda_span(rows, cols, ld, 1, 0, &n))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    *out = (float *)malloc((size_t)n * sizeof(float));
    if (*out == NULL)
        return GPU_ENOMEM;
    gpu_cvt_to_f32(*out, src, dt, (size_t)n);
    return 0;
}

/* Host arrays borrowed; synchronous. */
extern "C" int gpu_cuda_gemm_host(bool ta, bool tb, int M, int N, int K, const void *A,
                                  gpu_dtype adt, int lda, const void *B, gpu_dtype bdt, int ldb,
                                  float beta, float *C, int ldc)
{
    int rc = gpu_cuda_ready();
    float *wa = NULL, *wb = NULL;
    gpu_cuda_mm m;

    if (rc != 0)
        return rc;
    if (!gemm_args_ok(ta, tb, M, N, K, A, adt, lda, B, bdt, ldb, C, ldc))
        return GPU_EINVAL;
    if (M == 0 || N == 0)
        return 0;
    memset(&m, 0, sizeof(m));
    m.ta = ta;
    m.tb = tb;
    m.M = M;
    m.N = N;
    m.K = K;
    m.A = A;
    m.adt = adt;
    m.lda = lda;
    m.B = B;
    m.bdt = bdt;
    m.ldb = ldb;
    m.C = C;
    m.cdt = GPU_FP32;
    m.ldc = ldc;
    m.beta = beta;
    m.batch = 1;
    if (adt != bdt) {
        /* cuBLASLt needs one operand dtype: widen the 16-bit ones (exact, as gpu_gemm does) */
        if (K > 0 && adt != GPU_FP32 &&
            (rc = widen(&wa, A, adt, ta ? K : M, ta ? M : K, lda)) != 0)
            goto done;
        if (K > 0 && bdt != GPU_FP32 &&
            (rc = widen(&wb, B, bdt, tb ? N : K, tb ? K : N, ldb)) != 0)
            goto done;
        if (wa != NULL)
            m.A = wa;
        if (wb != NULL)
            m.B = wb;
        m.adt = m.bdt = GPU_FP32;
    }
    rc = gpu_cuda_mm_host(&m);
done:
    free(wa);
    free(wb);
    return rc;
}

/* ---- fp8 ------------------------------------------------------------------------------------ */

/* A device copy of n bytes at src (*d NULL when n is 0). */
static int upload_bytes(void **d, const void *src, size_t n)
{
    int rc = 0;
    *d = NULL;
    if (n == 0)
        return 0;
    GPU_CUDA_TRY(cudaMalloc(d, n));
    GPU_CUDA_TRY(cudaMemcpy(*d, src, n, cudaMemcpyHostToDevice));
fail:
    return rc;
}

extern "C" int gpu_cuda_mm8_host(const gpu_cuda_mm8 *p, float a_scale_inv, float b_scale_inv)
{
    int rc = gpu_cuda_ready();
    gpu_cuda_blas *b = NULL;
    gpu_cuda_mm8 d;
    void *d_a = NULL, *d_b = NULL, *d_c = NULL, *d_s = NULL;
    float scales[2] = {a_scale_inv, b_scale_inv};
    int64_t sa = 0, sb = 0, sc = 0;
    char why[320];

    if (rc != 0)
        return rc;
    d = *p; /* the scales are values here: the check sees them as host pointers */
    d.a_scale_inv = &scales[0];
    d.b_scale_inv = &scales[1];
    if ((rc = gpu_cuda_mm8_check(&d, false)) != 0)
        return rc;
    gpu_cuda_span(p->M, p->K, p->lda, 1, 0, &sa);
    gpu_cuda_span(p->N, p->K, p->ldb, 1, 0, &sb);
    gpu_cuda_span(p->M, p->N, p->ldc, 1, 0, &sc);
    if ((rc = gpu_cuda_blas_open(&b, why, sizeof(why))) != 0) {
        fprintf(stderr, "gpu_cuda_mm8_host: %s\n", why);
        return rc;
    }
    d = *p;
    if ((rc = upload_bytes(&d_a, p->A, (size_t)sa)) != 0 ||
        (rc = upload_bytes(&d_b, p->B, (size_t)sb)) != 0 ||
        (rc = upload(&d_c, p->C, p->cdt, sc, true)) != 0 ||
        (rc = upload_bytes(&d_s, scales, sizeof(scales))) != 0)
        goto fail;
    d.A = (const uint8_t *)d_a;
    d.B = (const uint8_t *)d_b;
    d.C = d_c;
    d.a_scale_inv = (const float *)d_s;
    d.b_scale_inv = (const float *)d_s + 1;
    if ((rc = gpu_cuda_matmul_fp8(b, 0, &d)) != 0)
        goto fail;
    GPU_CUDA_TRY(cudaDeviceSynchronize());
    if (sc > 0)
        rc = download((float *)p->C, d_c, p->cdt, sc, p->M, p->N, p->ldc, 1, 0);
fail:
    cudaFree(d_s);
    cudaFree(d_c);
    cudaFree(d_b);
    cudaFree(d_a);
    gpu_cuda_blas_free(b);
    return rc;
}

extern "C" int gpu_cuda_fp8_cast_host(uint8_t *dst, uint8_t *dst_t, const void *src, gpu_dtype sdt,
                                      int rows, int cols, gpu_fp8_format f, float scale,
                                      float *amax, gpu_cuda_fp8_counts *counts)
{
    int rc = gpu_cuda_ready();
    size_t n = rows > 0 && cols > 0 ? (size_t)rows * (size_t)cols : 0;
    void *d_src = NULL, *d_dst = NULL, *d_t = NULL, *d_f = NULL, *d_k = NULL;
    float f2[2] = {scale, amax ? *amax : 0.0f};

    if (rc != 0)
        return rc;
    if (rows < 0 || cols < 0 || (n > 0 && (src == NULL || (dst == NULL && amax == NULL))))
        return GPU_EINVAL;
    if (n == 0)
        return 0;
    if ((rc = upload_bytes(&d_src, src, n * gpu_dtype_size(sdt))) != 0 ||
        (rc = upload_bytes(&d_f, f2, sizeof(f2))) != 0 ||
        (counts && (rc = upload_bytes(&d_k, counts, sizeof(*counts))) != 0))
        goto fail;
    if (dst)
        GPU_CUDA_TRY(cudaMalloc(&d_dst, n));
    if (dst_t)
        GPU_CUDA_TRY(cudaMalloc(&d_t, n));
    rc = gpu_cuda_fp8_cast(0, (uint8_t *)d_dst, (uint8_t *)d_t, d_src, sdt, rows, cols, f,
                           (const float *)d_f, amax ? (float *)d_f + 1 : NULL,
                           (gpu_cuda_fp8_counts *)d_k);
    if (rc != 0)
        goto fail;
    GPU_CUDA_TRY(cudaDeviceSynchronize());
    if (dst)
        GPU_CUDA_TRY(cudaMemcpy(dst, d_dst, n, cudaMemcpyDeviceToHost));
    if (dst_t)
        GPU_CUDA_TRY(cudaMemcpy(dst_t, d_t, n, cudaMemcpyDeviceToHost));
    if (amax)
        GPU_CUDA_TRY(cudaMemcpy(amax, (float *)d_f + 1, sizeof(float), cudaMemcpyDeviceToHost));
    if (counts)
        GPU_CUDA_TRY(cudaMemcpy(counts, d_k, sizeof(*counts), cudaMemcpyDeviceToHost));
fail:
    cudaFree(d_k);
    cudaFree(d_f);
    cudaFree(d_t);
    cudaFree(d_dst);
    cudaFree(d_src);
    return rc;
}

extern "C" int gpu_cuda_fp8_delayed_host(float *state, int nrows, int len, bool most_recent,
                                         const float scaled_max[3])
{
    int rc = gpu_cuda_ready();
    void *d = NULL;
    size_t bytes = (size_t)(nrows > 0 ? nrows : 0) * (size_t)(2 + (len > 0 ? len : 0)) * 4;
    if (rc != 0)
        return rc;
    if ((rc = upload_bytes(&d, state, bytes)) != 0)
        goto fail;
    if ((rc = gpu_cuda_fp8_delayed(0, (float *)d, nrows, len, most_recent, scaled_max)) != 0)
        goto fail;
    GPU_CUDA_TRY(cudaDeviceSynchronize());
    if (bytes)
        GPU_CUDA_TRY(cudaMemcpy(state, d, bytes, cudaMemcpyDeviceToHost));
fail:
    cudaFree(d);
    return rc;
}

extern "C" int gpu_cuda_fp8_current_host(float *row, float amax, float scaled_max, float epsilon)
{
    int rc = gpu_cuda_ready();
    void *d = NULL;
    float buf[4] = {row[0], row[1], row[2], amax};
    if (rc != 0)
        return rc;
    if ((rc = upload_bytes(&d, buf, sizeof(buf))) != 0)
        goto fail;
    if ((rc = gpu_cuda_fp8_current(0, (float *)d, (const float *)d + 3, scaled_max, epsilon)) != 0)
        goto fail;
    GPU_CUDA_TRY(cudaDeviceSynchronize());
    GPU_CUDA_TRY(cudaMemcpy(row, d, 3 * sizeof(float), cudaMemcpyDeviceToHost));
fail:
    cudaFree(d);
    return rc;
}
