/*
 * lt.cc - cuBLASLt emulated on the CPU for the CUDA emulator (tests/cudaemu), the subset
 * gpu/cuda/cuda_blas.cu uses, with the library's documented semantics:
 *
 *   D = epilogue(alpha * op(A) op(B) + beta * C (+ bias)), column-major, per batch,
 *
 * op(A) m x k, op(B) k x n, C and D m x n; the bias has one value per row of D; GELU is the
 * tanh form; GELU_AUX stores the pre-GELU value (in D's dtype) at the aux pointer and ld.
 * The product runs through gpu_gemm (exact widening of fp16/bf16 operands, fp32
 * accumulation, the CPU backend's contract); the epilogue runs in fp32 and D is rounded to
 * its dtype once.
 *
 * fp8 (CUDA_R_8F_E4M3, CUDA_R_8F_E5M2 A and B): D = alpha * (A_SCALE x B_SCALE) * op(A) op(B),
 * the product through gpu_gemm_fp8 with its exact accumulator (FAST_ACCUM is accepted and
 * changes nothing here: the emulator is the exact model, not Hopper's), D fp32 or bf16, beta
 * 0; the library's fp8 rules are checked: TN only (TRANSA T, TRANSB N), not E5M2 x E5M2,
 * no epilogue.

 * Checked as the library checks, so that a wrong call fails here as it would on a GPU:
 * every attribute's size; compute type 32F and scale type 32F; operand dtypes; dimensions
 * that agree; ld >= rows; the alignment the heuristic was promised (MIN_ALIGNMENT_*, 256
 * bytes when not set) against the pointers given to the matmul. And beyond what the library
 * checks: every operand, the bias, aux and the workspace must lie inside one device
 * allocation (emu_device_span), else the call fails with a message naming the operand.
 *
 * Threads: handles are independent; the work runs under the emulator's lock.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cublasLt.h"
#include "nccl.h"
#include "gpu/gpu.h"
#include "tests/cudaemu/emu.h"

struct emu_lt_handle {
    int unused;
};

struct emu_lt_desc {
    cublasComputeType_t compute;
    cudaDataType_t scale;
    int32_t transa, transb;
    uint32_t epilogue;
    const void *bias;
    int32_t bias_type;      /* -1: D's */
    void *aux;
    int64_t aux_ld;
    const float *a_scale, *b_scale; /* fp8: device pointers (NULL: 1) */
    int8_t fast_accum;
};

struct emu_lt_layout {
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld;
    int32_t batch;
    int64_t stride;
};

struct emu_lt_pref {
    uint64_t max_workspace;
    uint32_t align[4];      /* A, B, C, D */
    uint32_t reduction;
    uint64_t impl;
};

/* ---- objects and attributes ---------------------------------------------------------------- */

extern "C" cublasStatus_t cublasLtCreate(cublasLtHandle_t *h)
{
    if (h == NULL)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (gpu_blas_init(0) != 0)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    *h = (cublasLtHandle_t)calloc(1, sizeof(emu_lt_handle));
    return *h != NULL ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

extern "C" cublasStatus_t cublasLtDestroy(cublasLtHandle_t h)
{
    free(h);
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" size_t cublasLtGetVersion(void)
{
    return 130100;
}

extern "C" const char *cublasLtGetStatusName(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

extern "C" cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t ct,
                                                   cudaDataType_t st)
{
    emu_lt_desc *x = (emu_lt_desc *)calloc(1, sizeof(*x));
    if (x == NULL)
        return CUBLAS_STATUS_ALLOC_FAILED;
    x->compute = ct;
    x->scale = st;
    x->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    x->bias_type = -1;
    *d = x;
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d)
{
    free(d);
    return CUBLAS_STATUS_SUCCESS;
}

/* Copy an attribute of exactly sizeof(*dst) bytes, as the library demands. */
template <typename T>
static cublasStatus_t attr(T *dst, const void *buf, size_t n, const char *name)
{
    if (buf == NULL || n != sizeof(T)) {
        emu_report("cuBLASLt attribute %s takes %zu bytes, not %zu", name, sizeof(T), n);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    memcpy(dst, buf, sizeof(T));
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                                         cublasLtMatmulDescAttributes_t a,
                                                         const void *buf, size_t n)
{
    switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return attr(&d->transa, buf, n, "TRANSA");
    case CUBLASLT_MATMUL_DESC_TRANSB: return attr(&d->transb, buf, n, "TRANSB");
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return attr(&d->epilogue, buf, n, "EPILOGUE");
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return attr(&d->bias, buf, n, "BIAS_POINTER");
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
        return attr(&d->bias_type, buf, n, "BIAS_DATA_TYPE");
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
        return attr(&d->aux, buf, n, "EPILOGUE_AUX_POINTER");
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return attr(&d->aux_ld, buf, n, "EPILOGUE_AUX_LD");
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER: return attr(&d->a_scale, buf, n, "A_SCALE_POINTER");
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER: return attr(&d->b_scale, buf, n, "B_SCALE_POINTER");
    case CUBLASLT_MATMUL_DESC_FAST_ACCUM: return attr(&d->fast_accum, buf, n, "FAST_ACCUM");
    }
    emu_report("cuBLASLt matmul attribute %d is not emulated", (int)a);
    return CUBLAS_STATUS_INVALID_VALUE;
}

extern "C" cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType t,
                                                     uint64_t rows, uint64_t cols, int64_t ld)
{
    emu_lt_layout *x = (emu_lt_layout *)calloc(1, sizeof(*x));
    if (x == NULL)
        return CUBLAS_STATUS_ALLOC_FAILED;
    *x = emu_lt_layout{t, rows, cols, ld, 1, 0};
    *l = x;
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l)
{
    free(l);
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                           cublasLtMatrixLayoutAttribute_t a,
                                                           const void *buf, size_t n)
{
    switch (a) {
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return attr(&l->batch, buf, n, "BATCH_COUNT");
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
        return attr(&l->stride, buf, n, "STRIDED_BATCH_OFFSET");
    }
    emu_report("cuBLASLt layout attribute %d is not emulated", (int)a);
    return CUBLAS_STATUS_INVALID_VALUE;
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p)
{
    emu_lt_pref *x = (emu_lt_pref *)calloc(1, sizeof(*x));
    if (x == NULL)
        return CUBLAS_STATUS_ALLOC_FAILED;
    for (int i = 0; i < 4; i++)
        x->align[i] = 256;
    x->reduction = 0xFFFFFFFFu;
    x->impl = ~(uint64_t)0;
    *p = x;
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p)
{
    free(p);
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceSetAttribute(
    cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t a, const void *buf,
    size_t n)
{
    switch (a) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
        return attr(&p->max_workspace, buf, n, "MAX_WORKSPACE_BYTES");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
        return attr(&p->align[0], buf, n, "MIN_ALIGNMENT_A_BYTES");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
        return attr(&p->align[1], buf, n, "MIN_ALIGNMENT_B_BYTES");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
        return attr(&p->align[2], buf, n, "MIN_ALIGNMENT_C_BYTES");
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
        return attr(&p->align[3], buf, n, "MIN_ALIGNMENT_D_BYTES");
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
        return attr(&p->reduction, buf, n, "REDUCTION_SCHEME_MASK");
    case CUBLASLT_MATMUL_PREF_IMPL_MASK: return attr(&p->impl, buf, n, "IMPL_MASK");
    }
    emu_report("cuBLASLt preference attribute %d is not emulated", (int)a);
    return CUBLAS_STATUS_INVALID_VALUE;
}

/* ---- the operation ------------------------------------------------------------------------- */

static bool type_ok(cudaDataType_t t)
{
    return t == CUDA_R_32F || t == CUDA_R_16F || t == CUDA_R_16BF;
}

static bool is_fp8(cudaDataType_t t)
{
    return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2;
}

static size_t type_size(cudaDataType_t t)
{
    return is_fp8(t) ? 1 : t == CUDA_R_32F ? 4 : 2;
}

static gpu_fp8_format fp8_of(cudaDataType_t t)
{
    return t == CUDA_R_8F_E5M2 ? GPU_E5M2 : GPU_E4M3;
}

/* The fp8 rules of cuBLASLt (see the top): CUBLAS_STATUS_SUCCESS, or NOT_SUPPORTED. */
static cublasStatus_t check_fp8(const emu_lt_desc *d, const emu_lt_layout *a,
                                const emu_lt_layout *b, const emu_lt_layout *dd)
{
    if (!is_fp8(a->type) || !is_fp8(b->type)) {
        emu_report("cuBLASLt: an fp8 product needs both A and B in fp8 (types %d, %d)",
                   (int)a->type, (int)b->type);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (a->type == CUDA_R_8F_E5M2 && b->type == CUDA_R_8F_E5M2) {
        emu_report("cuBLASLt: E5M2 x E5M2 has no fp8 kernel");
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d->transa != CUBLAS_OP_T || d->transb != CUBLAS_OP_N) {
        emu_report("cuBLASLt: fp8 GEMMs take the TN layout only (TRANSA T, TRANSB N; got %d, %d)",
                   (int)d->transa, (int)d->transb);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if ((dd->type != CUDA_R_32F && dd->type != CUDA_R_16BF) ||
        d->epilogue != CUBLASLT_EPILOGUE_DEFAULT || a->batch != 1) {
        emu_report("cuBLASLt: an fp8 product here writes fp32 or bf16, one batch, no epilogue");
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

static gpu_dtype dtype_of(cudaDataType_t t)
{
    return t == CUDA_R_32F ? GPU_FP32 : t == CUDA_R_16F ? GPU_FP16 : GPU_BF16;
}

static bool has_bias(uint32_t e)
{
    return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
           e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}

static bool has_gelu(uint32_t e)
{
    return e == CUBLASLT_EPILOGUE_GELU || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
           e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}

static bool has_aux(uint32_t e)
{
    return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}

/* Everything the heuristic and the matmul both check: CUBLAS_STATUS_SUCCESS when the
 * problem is well formed; *m, *n, *k receive its sizes. */
static cublasStatus_t check_problem(const emu_lt_desc *d, const emu_lt_layout *a,
                                    const emu_lt_layout *b, const emu_lt_layout *c,
                                    const emu_lt_layout *dd, uint64_t *m, uint64_t *n,
                                    uint64_t *k)
{
    if (d->compute != CUBLAS_COMPUTE_32F || d->scale != CUDA_R_32F) {
        emu_report("cuBLASLt: only CUBLAS_COMPUTE_32F with fp32 scaling is emulated");
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    cublasStatus_t s8 = is_fp8(a->type) || is_fp8(b->type) ? check_fp8(d, a, b, dd)
                                                           : CUBLAS_STATUS_SUCCESS;
    if (s8 != CUBLAS_STATUS_SUCCESS)
        return s8;
    if (is_fp8(a->type) ? c->type != dd->type
                        : !type_ok(a->type) || a->type != b->type || c->type != dd->type ||
                              (dd->type != a->type && dd->type != CUDA_R_32F)) {
        emu_report("cuBLASLt: operand types A %d B %d C %d D %d are not supported",
                   (int)a->type, (int)b->type, (int)c->type, (int)dd->type);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (d->epilogue != CUBLASLT_EPILOGUE_DEFAULT && !has_bias(d->epilogue) &&
        !has_gelu(d->epilogue)) {
        emu_report("cuBLASLt: epilogue %u is not emulated", d->epilogue);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    *m = d->transa == CUBLAS_OP_N ? a->rows : a->cols;
    *k = d->transa == CUBLAS_OP_N ? a->cols : a->rows;
    uint64_t kb = d->transb == CUBLAS_OP_N ? b->rows : b->cols;
    *n = d->transb == CUBLAS_OP_N ? b->cols : b->rows;
    if (kb != *k || c->rows != *m || c->cols != *n || dd->rows != *m || dd->cols != *n) {
        emu_report("cuBLASLt: sizes disagree: op(A) %llux%llu, op(B) %llux%llu, C %llux%llu, "
                   "D %llux%llu", (unsigned long long)*m, (unsigned long long)*k,
                   (unsigned long long)kb, (unsigned long long)*n,
                   (unsigned long long)c->rows, (unsigned long long)c->cols,
                   (unsigned long long)dd->rows, (unsigned long long)dd->cols);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const emu_lt_layout *ls[4] = {a, b, c, dd};
    const char *names = "ABCD";
    for (int i = 0; i < 4; i++) {
        if (ls[i]->ld < (int64_t)(ls[i]->rows > 0 ? ls[i]->rows : 1)) {
            emu_report("cuBLASLt: ld %lld of %c is smaller than its %llu rows",
                       (long long)ls[i]->ld, names[i], (unsigned long long)ls[i]->rows);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
        if (ls[i]->batch != dd->batch) {
            emu_report("cuBLASLt: batch count %d of %c differs from D's %d", ls[i]->batch,
                       names[i], dd->batch);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
    }
    if (has_bias(d->epilogue) && dd->batch != 1) {
        emu_report("cuBLASLt: a bias epilogue with batch count %d is not emulated", dd->batch);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dd,
    cublasLtMatmulPreference_t p, int requested, cublasLtMatmulHeuristicResult_t res[],
    int *count)
{
    uint64_t m, n, k;
    if (h == NULL || d == NULL || p == NULL || requested < 1 || res == NULL || count == NULL)
        return CUBLAS_STATUS_INVALID_VALUE;
    *count = 0;
    cublasStatus_t s = check_problem(d, a, b, c, dd, &m, &n, &k);
    if (s != CUBLAS_STATUS_SUCCESS)
        return s;
    const emu_lt_layout *ls[4] = {a, b, c, dd};
    for (int i = 0; i < 4; i++)
        if (p->align[i] < type_size(ls[i]->type) || (p->align[i] & (p->align[i] - 1)) != 0)
            return CUBLAS_STATUS_NOT_SUPPORTED;   /* no kernel for that alignment */
    memset(&res[0], 0, sizeof(res[0]));
    for (int i = 0; i < 4; i++)
        res[0].algo.data[i] = p->align[i];
    res[0].workspaceSize = p->max_workspace < ((size_t)1 << 20) ? p->max_workspace : (size_t)1 << 20;
    res[0].algo.data[4] = res[0].workspaceSize;
    res[0].state = CUBLAS_STATUS_SUCCESS;
    res[0].wavesCount = 1.0f;
    *count = 1;
    return CUBLAS_STATUS_SUCCESS;
}

/* Elements of a column-major rows x cols matrix at ld, batch of them stride apart. */
static size_t span(uint64_t rows, uint64_t cols, int64_t ld, int batch, int64_t stride)
{
    if (rows == 0 || cols == 0)
        return 0;
    return (size_t)((cols - 1) * (uint64_t)ld + rows + (uint64_t)(batch - 1) * (uint64_t)stride);
}

static bool operand_ok(const void *p, size_t bytes, uint32_t align, const char *what)
{
    if (bytes == 0)
        return true;
    if ((uintptr_t)p % align != 0) {
        emu_report("cuBLASLt: %s at %p is not aligned to the %u bytes the algorithm was "
                   "chosen for", what, p, align);
        return false;
    }
    if (emu_device_span(p, bytes) != 0) {
        emu_report("cuBLASLt: %s [%p, +%zu bytes) is not inside one device allocation", what,
                   p, bytes);
        return false;
    }
    return true;
}

static float load(const void *p, cudaDataType_t t, size_t i)
{
    if (t == CUDA_R_32F)
        return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return t == CUDA_R_16F ? gpu_f16_to_f32(h) : gpu_bf16_to_f32(h);
}

static void store(void *p, cudaDataType_t t, size_t i, float x)
{
    if (t == CUDA_R_32F)
        ((float *)p)[i] = x;
    else
        ((uint16_t *)p)[i] = t == CUDA_R_16F ? gpu_f32_to_f16(x) : gpu_f32_to_bf16(x);
}

static float gelu_tanh(float x)
{
    const float c = 0.7978845608028654f;    /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

/* An fp8 product (one batch, TN): D = alpha (A_SCALE x B_SCALE) A^T B. Lock held, memory
 * open. cuBLASLt's A (k x m, transposed) is gpu_gemm_fp8's B (row-major, n rows of k in our
 * naming below), as in run_one. */
static int run_fp8(const emu_lt_desc *d, float alpha, const void *A, const emu_lt_layout *la,
                   const void *B, const emu_lt_layout *lb, void *D, const emu_lt_layout *ld,
                   uint64_t m, uint64_t n, uint64_t k)
{
    std::vector<float> acc(m * n);
    std::vector<float> scratch(gpu_gemm_fp8_scratch_floats((int)n, (int)m, (int)k) + 1);
    float sa = d->a_scale ? *d->a_scale : 1.0f, sb = d->b_scale ? *d->b_scale : 1.0f;
    /* D^T (n x m row-major) = B^T A: B (k x n col-major) is n x k row-major, A^T likewise */
    int rc = gpu_gemm_fp8(false, true, (int)n, (int)m, (int)k, (const uint8_t *)B, fp8_of(lb->type),
                          sb, (int)lb->ld, (const uint8_t *)A, fp8_of(la->type), sa, (int)la->ld,
                          NULL, acc.data(), (int)m, scratch.data(), scratch.size());
    if (rc != 0)
        return rc;
    for (uint64_t j = 0; j < n; j++)
        for (uint64_t i = 0; i < m; i++)
            store(D, ld->type, j * (uint64_t)ld->ld + i, alpha * acc[j * m + i]);
    return 0;
}

/* One batch entry: D = epilogue(alpha op(A) op(B) + beta C + bias). Lock held, memory open. */
static int run_one(const emu_lt_desc *d, float alpha, float beta, const void *A,
                   const emu_lt_layout *la, const void *B, const emu_lt_layout *lb,
                   const void *C, const emu_lt_layout *lc, void *D, const emu_lt_layout *ld,
                   uint64_t m, uint64_t n, uint64_t k)
{
    /* D^T (n x m, row-major) = op(B)^T op(A)^T: see gpu_gemm's row-major contract */
    bool ta = d->transb == CUBLAS_OP_T, tb = d->transa == CUBLAS_OP_T;
    std::vector<float> acc(m * n);
    gpu_dtype bdt = dtype_of(lb->type), adt = dtype_of(la->type);
    std::vector<float> scratch(gpu_gemm_scratch_floats(ta, tb, (int)n, (int)m, (int)k, bdt,
                                                       (int)lb->ld, adt, (int)la->ld) + 1);
    int rc = gpu_gemm(ta, tb, (int)n, (int)m, (int)k, B, bdt, (int)lb->ld, A, adt, (int)la->ld,
                      0.0f, acc.data(), (int)m, scratch.data(), scratch.size());
    if (rc != 0)
        return rc;
    cudaDataType_t bt = d->bias_type >= 0 ? (cudaDataType_t)d->bias_type : ld->type;
    for (uint64_t j = 0; j < n; j++)
        for (uint64_t i = 0; i < m; i++) {
            float x = alpha * acc[j * m + i];
            if (beta != 0.0f)
                x += beta * load(C, lc->type, j * (uint64_t)lc->ld + i);
            if (has_bias(d->epilogue))
                x += load(d->bias, bt, i);
            if (has_aux(d->epilogue))
                store(d->aux, ld->type, j * (uint64_t)d->aux_ld + i, x);
            if (has_gelu(d->epilogue))
                x = gelu_tanh(x);
            store(D, ld->type, j * (uint64_t)ld->ld + i, x);
        }
    return 0;
}

extern "C" cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                         const void *alpha, const void *A, cublasLtMatrixLayout_t la,
                                         const void *B, cublasLtMatrixLayout_t lb, const void *beta,
                                         const void *C, cublasLtMatrixLayout_t lc, void *D,
                                         cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t *algo,
                                         void *workspace, size_t wsize, cudaStream_t stream)
{
    (void)stream;
    uint64_t m, n, k;
    if (h == NULL || d == NULL || alpha == NULL || beta == NULL || algo == NULL)
        return CUBLAS_STATUS_INVALID_VALUE;
    cublasStatus_t s = check_problem(d, la, lb, lc, ld, &m, &n, &k);
    if (s != CUBLAS_STATUS_SUCCESS)
        return s;
    if (wsize < algo->data[4]) {
        emu_report("cuBLASLt: the algorithm needs %llu bytes of workspace, %zu given",
                   (unsigned long long)algo->data[4], wsize);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    float al = *(const float *)alpha, be = *(const float *)beta;
    int batch = ld->batch;
    bool ok = operand_ok(A, span(la->rows, la->cols, la->ld, batch, la->stride) * type_size(la->type),
                         (uint32_t)algo->data[0], "A") &&
              operand_ok(B, span(lb->rows, lb->cols, lb->ld, batch, lb->stride) * type_size(lb->type),
                         (uint32_t)algo->data[1], "B") &&
              (be == 0.0f ||
               operand_ok(C, span(lc->rows, lc->cols, lc->ld, batch, lc->stride) * type_size(lc->type),
                          (uint32_t)algo->data[2], "C")) &&
              operand_ok(D, span(ld->rows, ld->cols, ld->ld, batch, ld->stride) * type_size(ld->type),
                         (uint32_t)algo->data[3], "D") &&
              operand_ok(workspace, wsize, 1, "the workspace");
    if (ok && has_bias(d->epilogue)) {
        cudaDataType_t bt = d->bias_type >= 0 ? (cudaDataType_t)d->bias_type : ld->type;
        ok = d->bias != NULL && operand_ok(d->bias, m * type_size(bt), type_size(bt), "the bias");
    }
    if (ok && has_aux(d->epilogue))
        ok = d->aux != NULL && d->aux_ld >= (int64_t)m && d->aux_ld % 8 == 0 &&
             operand_ok(d->aux, span(m, n, d->aux_ld, 1, 0) * type_size(ld->type), 16, "aux");
    if (!ok)
        return CUBLAS_STATUS_EXECUTION_FAILED;
    if (m == 0 || n == 0)
        return CUBLAS_STATUS_SUCCESS;
    emu_device_begin();
    int rc = 0;
    if (is_fp8(la->type))
        rc = run_fp8(d, al, A, la, B, lb, D, ld, m, n, k);
    for (int i = 0; i < batch && rc == 0 && !is_fp8(la->type); i++)
        rc = run_one(d, al, be, (const char *)A + i * la->stride * type_size(la->type), la,
                     (const char *)B + i * lb->stride * type_size(lb->type), lb,
                     (const char *)C + i * lc->stride * type_size(lc->type), lc,
                     (char *)D + i * ld->stride * type_size(ld->type), ld, m, n, k);
    emu_device_end();
    return rc == 0 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

/* ---- dlopen/dlsym for gpu/cuda/cuda_blas.cu and cuda_comm.cu (NCCL: nccl.cc) ---------- */

static int lt_library, nccl_library; /* their addresses are the libraries' handles */

extern "C" void *emu_dlopen(const char *file, int mode)
{
    if (file != NULL && strstr(file, "libcublasLt") != NULL)
        return &lt_library;
    if (file != NULL && strstr(file, "libnccl") != NULL)
        return &nccl_library;
    return dlopen(file, mode);
}

extern "C" void *emu_dlsym(void *handle, const char *name)
{
    if (handle == &nccl_library)
        return emu_nccl_sym(name);
    if (handle != &lt_library)
        return dlsym(handle, name);
#define EMU_SYM(fn)                  \
    if (strcmp(name, #fn) == 0)      \
        return (void *)fn;
    EMU_SYM(cublasLtCreate)
    EMU_SYM(cublasLtDestroy)
    EMU_SYM(cublasLtGetVersion)
    EMU_SYM(cublasLtGetStatusName)
    EMU_SYM(cublasLtMatmulDescCreate)
    EMU_SYM(cublasLtMatmulDescDestroy)
    EMU_SYM(cublasLtMatmulDescSetAttribute)
    EMU_SYM(cublasLtMatrixLayoutCreate)
    EMU_SYM(cublasLtMatrixLayoutDestroy)
    EMU_SYM(cublasLtMatrixLayoutSetAttribute)
    EMU_SYM(cublasLtMatmulPreferenceCreate)
    EMU_SYM(cublasLtMatmulPreferenceDestroy)
    EMU_SYM(cublasLtMatmulPreferenceSetAttribute)
    EMU_SYM(cublasLtMatmulAlgoGetHeuristic)
    EMU_SYM(cublasLtMatmul)
#undef EMU_SYM
    return NULL;
}

extern "C" int emu_dlclose(void *handle)
{
    return handle == &lt_library || handle == &nccl_library ? 0 : dlclose(handle);
}

extern "C" char *emu_dlerror(void)
{
    return dlerror();
}
