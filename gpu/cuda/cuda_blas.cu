/*
 * cuda_blas.cu - the CUDA backend's GEMMs through cuBLASLt (declarations and the full
 * contract in gpu/cuda/cuda_blas.h). The tests' host-buffer wrappers of gpu_cuda_matmul are
 * in tests/cudahost/blas_host.cu.
 *
 * Loading: libcublasLt is opened once per process with dlopen() ("libcublasLt.so.13", then
 * "libcublasLt.so", then /usr/local/cuda/lib64/libcublasLt.so.13) and every entry point used
 * here is resolved with dlsym() into a table typed from <cublasLt.h> (decltype), so the
 * program never links against cuBLAS and runs on machines without it: the handle then fails
 * to open with GPU_ENODEV and the reason. The library is never closed.
 *
 * Row-major to column-major: cuBLASLt is column-major, and a row-major M x N matrix at ld is
 * the column-major N x M matrix at the same ld. So C = op(A) op(B) is computed as
 * C^T = op(B)^T op(A)^T: cuBLASLt's A is our B (N x K after its op), its B is our A (K x M),
 * its D is C^T (N x M), and the bias (one value per row of D) is our per-column bias[N].
 *
 * Numerics: compute type CUBLAS_COMPUTE_32F (plain fp32 FMA or tensor cores with fp32
 * accumulation, never TF32), scale type fp32, alpha 1. The heuristic is told the real
 * alignment of every pointer (its default assumes 256 bytes), may use the 32 MiB workspace,
 * must not use TF32 inputs or 16-bit accumulators, and may only use split-K reductions whose
 * partial sums stay in fp32 (COMPUTE_TYPE; OUTPUT_TYPE too when C is fp32): the in-place
 * scheme would round partial sums to a 16-bit C several times and is not reproducible. So
 * the fp32 result (+ beta C + bias, then GELU) is rounded to C's dtype exactly once.
 * No algorithm cache here: cuBLASLt caches heuristic results itself (its heuristics cache).
 *
 * Threads: loading is guarded by pthread_once; a handle serves one thread and one stream at a
 * time (shared workspace); gpu_cuda_matmul only enqueues work and never synchronises; the
 * argument helpers are pure.
 */
#include <cublasLt.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>

#include "gpu/cuda/cuda_blas.h"
#include "gpu/cuda/cuda_common.cuh"
#include "gpu/fp8_rule.h"

/* ---- the library ------------------------------------------------------------------------- */

#define LT_FUNCS(X)                                            \
    X(create, cublasLtCreate)                                  \
    X(destroy, cublasLtDestroy)                                \
    X(get_version, cublasLtGetVersion)                         \
    X(status_name, cublasLtGetStatusName)                      \
    X(desc_create, cublasLtMatmulDescCreate)                   \
    X(desc_destroy, cublasLtMatmulDescDestroy)                 \
    X(desc_set, cublasLtMatmulDescSetAttribute)                \
    X(layout_create, cublasLtMatrixLayoutCreate)               \
    X(layout_destroy, cublasLtMatrixLayoutDestroy)             \
    X(layout_set, cublasLtMatrixLayoutSetAttribute)            \
    X(pref_create, cublasLtMatmulPreferenceCreate)             \
    X(pref_destroy, cublasLtMatmulPreferenceDestroy)           \
    X(pref_set, cublasLtMatmulPreferenceSetAttribute)          \
    X(heuristic, cublasLtMatmulAlgoGetHeuristic)               \
    X(matmul, cublasLtMatmul)

static struct {
    int rc;                 /* result of the one load: 0 or GPU_ENODEV */
    char why[320];          /* the reason when rc != 0 */
    size_t version;         /* cublasLtGetVersion(), e.g. 130100 */
#define LT_FIELD(field, fn) decltype(&fn) field;
    LT_FUNCS(LT_FIELD)
#undef LT_FIELD
} lt;

static pthread_once_t lt_once = PTHREAD_ONCE_INIT;

static const char *const lt_paths[] = {
    "libcublasLt.so.13", "libcublasLt.so", "/usr/local/cuda/lib64/libcublasLt.so.13",
};

static void lt_load(void)
{
    void *lib = NULL;
    char first[256] = "";

    for (size_t i = 0; i < sizeof(lt_paths) / sizeof(lt_paths[0]) && lib == NULL; i++) {
        lib = dlopen(lt_paths[i], RTLD_NOW | RTLD_LOCAL);
        if (lib == NULL && i == 0) {
            const char *e = dlerror();
            snprintf(first, sizeof(first), "%s", e != NULL ? e : "dlopen failed");
        }
    }
    if (lib == NULL) {
        snprintf(lt.why, sizeof(lt.why), "libcublasLt.so.13 not found: %s", first);
        lt.rc = GPU_ENODEV;
        return;
    }
#define LT_SYM(field, fn)                                                                   \
    lt.field = reinterpret_cast<decltype(&fn)>(dlsym(lib, #fn));                            \
    if (lt.field == NULL) {                                                                 \
        snprintf(lt.why, sizeof(lt.why), "libcublasLt has no %s", #fn);                     \
        goto fail;                                                                          \
    }
    LT_FUNCS(LT_SYM)
#undef LT_SYM
    lt.version = lt.get_version();
    if (lt.version < 110000) {
        snprintf(lt.why, sizeof(lt.why), "libcublasLt %zu is too old (11.0 or newer needed)",
                 lt.version);
        goto fail;
    }
    lt.rc = 0;
    return;
fail:
    dlclose(lib);
    lt.rc = GPU_ENODEV;
}

static void set_why(char *why, size_t whylen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_why(char *why, size_t whylen, const char *fmt, ...)
{
    if (why == NULL || whylen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, whylen, fmt, ap);
    va_end(ap);
}

/* Log a failed cuBLASLt call and return GPU_ECUDA. */
static int lt_fail(cublasStatus_t s, const char *what, const char *file, int line)
{
    gpu_log(GPU_LOG_ERROR, "cuBLASLt", "%s:%d: error %s (%d) (in %s)", file, line,
            lt.status_name(s), (int)s, what);
    return GPU_ECUDA;
}

/* For functions with a `fail:` label and an `int rc`: on error set rc and jump. */
#define LT_TRY(call)                                                        \
    do {                                                                    \
        cublasStatus_t s_ = (call);                                         \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                  \
            rc = lt_fail(s_, #call, __FILE__, __LINE__);                    \
            goto fail;                                                      \
        }                                                                   \
    } while (0)

/* ---- handles ----------------------------------------------------------------------------- */

struct gpu_cuda_blas {
    cublasLtHandle_t handle;
    void *workspace;        /* GPU_CUDA_BLAS_WORKSPACE bytes on the device */
    bool fp8;               /* the device has fp8 tensor cores (else no_fp8 says why) */
    char no_fp8[320];
};

extern "C" bool gpu_cuda_has_fp8(char *why, size_t whylen);

/* See cuda_blas.h. why may be NULL. */
extern "C" int gpu_cuda_blas_open(gpu_cuda_blas **out, char *why, size_t whylen)
{
    int rc = 0;
    gpu_cuda_blas *b = NULL;
    cudaError_t e;
    cublasStatus_t s;

    set_why(why, whylen, "%s", "");
    if (out == NULL)
        return GPU_EINVAL;
    *out = NULL;
    if (gpu_cuda_ready() != 0) {
        if (gpu_cuda_probe(why, whylen) == 0)
            set_why(why, whylen, "no CUDA device");
        return GPU_ENODEV;
    }
    pthread_once(&lt_once, lt_load);
    if (lt.rc != 0) {
        set_why(why, whylen, "%s", lt.why);
        return lt.rc;
    }
    b = (gpu_cuda_blas *)calloc(1, sizeof(*b));
    if (b == NULL) {
        set_why(why, whylen, "out of host memory");
        return GPU_ENOMEM;
    }
    /* the allocation also makes the device's primary context current on this thread, which
     * cuBLASLt (a driver-API library) uses */
    e = cudaMalloc(&b->workspace, GPU_CUDA_BLAS_WORKSPACE);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        set_why(why, whylen, "cannot allocate the %zu MiB cuBLASLt workspace: %s",
                GPU_CUDA_BLAS_WORKSPACE >> 20, cudaGetErrorString(e));
        b->workspace = NULL;
        rc = e == cudaErrorMemoryAllocation ? GPU_ENOMEM : GPU_ECUDA;
        goto fail;
    }
    s = lt.create(&b->handle);
    if (s != CUBLAS_STATUS_SUCCESS) {
        set_why(why, whylen, "cublasLtCreate failed: %s", lt.status_name(s));
        b->handle = NULL;
        rc = GPU_ECUDA;
        goto fail;
    }
    b->fp8 = gpu_cuda_has_fp8(b->no_fp8, sizeof(b->no_fp8));
    *out = b;
    return 0;
fail:
    gpu_cuda_blas_free(b);
    return rc;
}

/* See cuda_blas.h: cudaFree waits for the device, so no work still uses the workspace. */
extern "C" void gpu_cuda_blas_free(gpu_cuda_blas *b)
{
    if (b == NULL)
        return;
    if (b->handle != NULL)
        lt.destroy(b->handle);
    cudaFree(b->workspace);
    free(b);
}

/* ---- arguments --------------------------------------------------------------------------- */

static bool dtype_ok(gpu_dtype dt)
{
    return dt == GPU_FP32 || dt == GPU_FP16 || dt == GPU_BF16;
}

static size_t esize(gpu_dtype dt)
{
    return dt == GPU_FP32 ? 4 : 2;
}

static const char *epi_name(gpu_cuda_epilogue e)
{
    return e == GPU_CUDA_EPI_NONE ? "none" : e == GPU_CUDA_EPI_BIAS ? "bias" : "bias+gelu";
}

/* See cuda_blas.h. */
extern "C" bool gpu_cuda_span(int64_t rows, int64_t cols, int64_t ld, int batch, int64_t stride,
                              int64_t *out)
{
    int64_t a, b, c;
    *out = 0;
    if (rows == 0 || cols == 0 || batch == 0)
        return true;
    if (__builtin_mul_overflow(rows - 1, ld, &a) ||
        __builtin_mul_overflow((int64_t)batch - 1, stride, &b) ||
        __builtin_add_overflow(a, b, &c) || __builtin_add_overflow(c, cols, out))
        return false;
    return *out <= INT64_MAX / 4;
}

/* See cuda_blas.h. */
extern "C" bool gpu_cuda_mm_spans(const gpu_cuda_mm *p, int64_t *sa, int64_t *sb, int64_t *sc,
                                  int64_t *sx)
{
    int64_t ar = p->ta ? p->K : p->M, ac = p->ta ? p->M : p->K;
    int64_t br = p->tb ? p->N : p->K, bc = p->tb ? p->K : p->N;
    *sx = 0;
    return gpu_cuda_span(ar, ac, p->lda, p->batch, p->stride_a, sa) &&
           gpu_cuda_span(br, bc, p->ldb, p->batch, p->stride_b, sb) &&
           gpu_cuda_span(p->M, p->N, p->ldc, p->batch, p->stride_c, sc) &&
           (p->aux == NULL || gpu_cuda_span(p->M, p->N, p->aux_ld, 1, 0, sx));
}

static int bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Log why gpu_cuda_matmul refuses its arguments; return GPU_EINVAL. */
static int bad(const char *fmt, ...)
{
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    gpu_log(GPU_LOG_ERROR, "gpu_cuda_matmul", "%s", why);
    return GPU_EINVAL;
}

static bool misaligned(const void *ptr, size_t align)
{
    return ptr != NULL && (uintptr_t)ptr % align != 0;
}

/* See cuda_blas.h. */
extern "C" int gpu_cuda_mm_check(const gpu_cuda_mm *p, bool device)
{
    int64_t sa, sb, sc, sx;

    if (p == NULL)
        return bad("no parameters");
    if (p->M < 0 || p->N < 0 || p->K < 0)
        return bad("negative size M %d N %d K %d", p->M, p->N, p->K);
    if (!dtype_ok(p->adt) || !dtype_ok(p->bdt) || !dtype_ok(p->cdt))
        return bad("unknown dtype (A %d, B %d, C %d)", (int)p->adt, (int)p->bdt, (int)p->cdt);
    if (p->adt != p->bdt)
        return bad("A is %s but B is %s: the operands must share a dtype",
                   gpu_dtype_name(p->adt), gpu_dtype_name(p->bdt));
    if (p->cdt != GPU_FP32 && p->cdt != p->adt)
        return bad("%s operands cannot produce a %s C (only %s or fp32)",
                   gpu_dtype_name(p->adt), gpu_dtype_name(p->cdt), gpu_dtype_name(p->adt));
    if (p->batch < 1)
        return bad("batch %d < 1", p->batch);
    if (p->lda < 1 || p->lda < (p->ta ? p->M : p->K))
        return bad("lda %d too small for %s A (%d columns)", p->lda, p->ta ? "K x M" : "M x K",
                   p->ta ? p->M : p->K);
    if (p->ldb < 1 || p->ldb < (p->tb ? p->K : p->N))
        return bad("ldb %d too small for %s B (%d columns)", p->ldb, p->tb ? "N x K" : "K x N",
                   p->tb ? p->K : p->N);
    if (p->ldc < 1 || p->ldc < p->N)
        return bad("ldc %d < N %d", p->ldc, p->N);
    if (p->stride_a < 0 || p->stride_b < 0 || p->stride_c < 0)
        return bad("negative batch stride");
    if (p->batch > 1 && p->stride_c < 1)
        return bad("batch %d with stride_c 0: the outputs would overlap", p->batch);
    if (p->epilogue != GPU_CUDA_EPI_NONE && p->epilogue != GPU_CUDA_EPI_BIAS &&
        p->epilogue != GPU_CUDA_EPI_BIAS_GELU)
        return bad("unknown epilogue %d", (int)p->epilogue);
    if (p->epilogue != GPU_CUDA_EPI_NONE && p->batch != 1)
        return bad("the %s epilogue needs batch 1 (not %d)", epi_name(p->epilogue), p->batch);
    if (p->epilogue != GPU_CUDA_EPI_NONE && p->K == 0 && p->M > 0 && p->N > 0)
        return bad("the %s epilogue needs K >= 1", epi_name(p->epilogue));
    if (p->aux != NULL && p->epilogue != GPU_CUDA_EPI_BIAS_GELU)
        return bad("aux needs the bias+gelu epilogue (not %s)", epi_name(p->epilogue));
    if (p->aux != NULL && (p->aux_ld < 1 || p->aux_ld < p->N || p->aux_ld % 8 != 0))
        return bad("aux_ld %d must be a multiple of 8 and >= N %d", p->aux_ld, p->N);
    if (!gpu_cuda_mm_spans(p, &sa, &sb, &sc, &sx))
        return bad("matrices too large (M %d N %d K %d, batch %d)", p->M, p->N, p->K, p->batch);
    if (p->M > 0 && p->N > 0) {
        if (p->C == NULL)
            return bad("C is NULL");
        if (p->K > 0 && (p->A == NULL || p->B == NULL))
            return bad("A or B is NULL");
        if (p->epilogue != GPU_CUDA_EPI_NONE && p->bias == NULL)
            return bad("the %s epilogue needs a bias", epi_name(p->epilogue));
    }
    if (device) {
        if (misaligned(p->A, esize(p->adt)) || misaligned(p->B, esize(p->bdt)) ||
            misaligned(p->C, esize(p->cdt)))
            return bad("A, B or C is not aligned to its element size");
        if (misaligned(p->bias, 16) || misaligned(p->aux, 16))
            return bad("bias and aux must be 16-byte aligned");
    }
    return 0;
}

/* ---- K == 0: C = beta C ------------------------------------------------------------------ */

#define SC_THREADS 256u
#define SC_MAX_BLOCKS 65535u

/* c = beta * c over batch M x N matrices (0 when beta is 0, whatever c held), rounded to cdt
 * as the CPU rounds gpu_gemm's fp32 result. */
static __global__ void gpu_k_scale_c(void *c, gpu_dtype cdt, int M, int N, int ldc,
                                     int64_t stride, int batch, float beta)
{
    size_t mn = (size_t)M * (size_t)N, total = mn * (size_t)batch;
    size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        size_t off = (i / mn) * (size_t)stride + (i % mn) / (size_t)N * (size_t)ldc + i % N;
        if (cdt == GPU_FP32) {
            float *x = (float *)c + off;
            *x = beta == 0.0f ? 0.0f : __fmul_rn(beta, *x);
        } else {
            uint16_t *h = (uint16_t *)c + off;
            if (beta == 0.0f) {
                *h = 0;
            } else if (cdt == GPU_FP16) {
                float y = __fmul_rn(beta, __uint_as_float(gpu_fmt_f16_to_f32(*h)));
                *h = gpu_fmt_f32_to_f16(__float_as_uint(y));
            } else {
                float y = __fmul_rn(beta, __uint_as_float(gpu_fmt_bf16_to_f32(*h)));
                *h = gpu_fmt_f32_to_bf16(__float_as_uint(y));
            }
        }
    }
}

static int scale_c(const gpu_cuda_mm *p, cudaStream_t stream)
{
    if (p->beta == 1.0f)
        return 0;
    size_t total = (size_t)p->M * (size_t)p->N * (size_t)p->batch;
    gpu_k_scale_c<<<gpu_cuda_blocks(total, SC_THREADS, SC_MAX_BLOCKS), SC_THREADS, 0, stream>>>(
        p->C, p->cdt, p->M, p->N, p->ldc, p->stride_c, p->batch, p->beta);
    GPU_CUDA_CHECK(cudaGetLastError());
    return 0;
}

/* ---- cuBLASLt ------------------------------------------------------------------------------ */

static cudaDataType_t cuda_type(gpu_dtype dt)
{
    return dt == GPU_FP32 ? CUDA_R_32F : dt == GPU_FP16 ? CUDA_R_16F : CUDA_R_16BF;
}

/* The largest power of two (at most 256) that divides the address. */
static uint32_t align_of(const void *ptr)
{
    uintptr_t a = (uintptr_t)ptr;
    uint32_t al = 1;
    while (al < 256 && a % (al * 2) == 0)
        al *= 2;
    return al;
}

template <typename T>
static cublasStatus_t desc_set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, T v)
{
    return lt.desc_set(d, a, &v, sizeof(v));
}

template <typename T>
static cublasStatus_t layout_set(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t a,
                                 T v)
{
    return lt.layout_set(l, a, &v, sizeof(v));
}

template <typename T>
static cublasStatus_t pref_set(cublasLtMatmulPreference_t p,
                               cublasLtMatmulPreferenceAttributes_t a, T v)
{
    return lt.pref_set(p, a, &v, sizeof(v));
}

/* A column-major layout of dt, rows x cols at ld, strided batched when batch > 1. */
static cublasStatus_t make_layout(cublasLtMatrixLayout_t *l, gpu_dtype dt, int rows, int cols,
                                  int ld, int batch, int64_t stride)
{
    cublasStatus_t s = lt.layout_create(l, cuda_type(dt), (uint64_t)rows, (uint64_t)cols,
                                        (int64_t)ld);
    if (s != CUBLAS_STATUS_SUCCESS) {
        *l = NULL;
        return s;
    }
    if (batch > 1) {
        s = layout_set(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, (int32_t)batch);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = layout_set(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
    }
    return s;
}

/* The operation descriptor: transposes, compute and scale types, epilogue and its pointers. */
static cublasStatus_t make_desc(cublasLtMatmulDesc_t *d, const gpu_cuda_mm *p)
{
    cublasStatus_t s = lt.desc_create(d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s != CUBLAS_STATUS_SUCCESS) {
        *d = NULL;
        return s;
    }
    /* cuBLASLt's A is our B, its B our A (see the top of the file) */
    s = desc_set(*d, CUBLASLT_MATMUL_DESC_TRANSA, (int32_t)(p->tb ? CUBLAS_OP_T : CUBLAS_OP_N));
    if (s == CUBLAS_STATUS_SUCCESS)
        s = desc_set(*d, CUBLASLT_MATMUL_DESC_TRANSB,
                     (int32_t)(p->ta ? CUBLAS_OP_T : CUBLAS_OP_N));
    if (s != CUBLAS_STATUS_SUCCESS || p->epilogue == GPU_CUDA_EPI_NONE)
        return s;
    uint32_t epi = p->epilogue == GPU_CUDA_EPI_BIAS ? CUBLASLT_EPILOGUE_BIAS
                   : p->aux != NULL                 ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                                    : CUBLASLT_EPILOGUE_GELU_BIAS;
    s = desc_set(*d, CUBLASLT_MATMUL_DESC_EPILOGUE, epi);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = desc_set(*d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p->bias);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = desc_set(*d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, (int32_t)cuda_type(p->cdt));
    if (s == CUBLAS_STATUS_SUCCESS && p->aux != NULL) {
        s = desc_set(*d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p->aux);
        if (s == CUBLAS_STATUS_SUCCESS)   /* the aux dtype is left at its default: C's */
            s = desc_set(*d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, (int64_t)p->aux_ld);
    }
    return s;
}

/* The heuristic's constraints: workspace, real pointer alignments, fp32 accumulation. */
static cublasStatus_t make_pref(cublasLtMatmulPreference_t *pr, const gpu_cuda_mm *p)
{
    uint32_t red = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    if (p->cdt == GPU_FP32)
        red |= CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
    uint64_t impl = ~(uint64_t)(CUBLASLT_NUMERICAL_IMPL_FLAGS_ACCUMULATOR_16F |
                                CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_TF32);
    cublasStatus_t s = lt.pref_create(pr);
    if (s != CUBLAS_STATUS_SUCCESS) {
        *pr = NULL;
        return s;
    }
    s = pref_set(*pr, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                 (uint64_t)GPU_CUDA_BLAS_WORKSPACE);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = pref_set(*pr, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_of(p->B));
    if (s == CUBLAS_STATUS_SUCCESS)
        s = pref_set(*pr, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_of(p->A));
    if (s == CUBLAS_STATUS_SUCCESS)
        s = pref_set(*pr, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_of(p->C));
    if (s == CUBLAS_STATUS_SUCCESS)
        s = pref_set(*pr, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_of(p->C));
    if (s == CUBLAS_STATUS_SUCCESS)
        s = pref_set(*pr, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, red);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = pref_set(*pr, CUBLASLT_MATMUL_PREF_IMPL_MASK, impl);
    return s;
}

/* The objects of one cuBLASLt call, each NULL until made. */
typedef struct {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulPreference_t pref;
} lt_call;

static void lt_call_free(lt_call *c)
{
    if (c->pref != NULL)
        lt.pref_destroy(c->pref);
    if (c->lc != NULL)
        lt.layout_destroy(c->lc);
    if (c->lb != NULL)
        lt.layout_destroy(c->lb);
    if (c->la != NULL)
        lt.layout_destroy(c->la);
    if (c->op != NULL)
        lt.desc_destroy(c->op);
}

/* Pick an algorithm for c and enqueue D = C = alpha op(A) op(B) + beta C in cuBLASLt's terms
 * (A, B its operands: our B and A). *none: cuBLASLt has none for it (rc GPU_EINVAL, for the
 * caller to say why). */
static int lt_call_run(gpu_cuda_blas *b, cudaStream_t stream, const lt_call *c, const void *A,
                       const void *B, void *C, float beta, bool *none)
{
    int rc = 0, found = 0;
    cublasLtMatmulHeuristicResult_t res;
    const float alpha = 1.0f;
    memset(&res, 0, sizeof(res));
    cublasStatus_t s =
        lt.heuristic(b->handle, c->op, c->la, c->lb, c->lc, c->lc, c->pref, 1, &res, &found);
    *none = s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && found < 1);
    if (*none)
        return GPU_EINVAL;
    LT_TRY(s);
    LT_TRY(lt.matmul(b->handle, c->op, &alpha, A, c->la, B, c->lb, &beta, C, c->lc, C, c->lc,
                     &res.algo, b->workspace, GPU_CUDA_BLAS_WORKSPACE, stream));
fail:
    return rc;
}

/* M, N, K >= 1: pick an algorithm and enqueue the product. */
static int lt_matmul(gpu_cuda_blas *b, cudaStream_t stream, const gpu_cuda_mm *p)
{
    int rc = 0;
    lt_call c = {NULL, NULL, NULL, NULL, NULL};
    bool none = false;

    LT_TRY(make_desc(&c.op, p));
    LT_TRY(make_layout(&c.la, p->bdt, p->tb ? p->K : p->N, p->tb ? p->N : p->K, p->ldb, p->batch,
                       p->stride_b));
    LT_TRY(make_layout(&c.lb, p->adt, p->ta ? p->M : p->K, p->ta ? p->K : p->M, p->lda, p->batch,
                       p->stride_a));
    LT_TRY(make_layout(&c.lc, p->cdt, p->N, p->M, p->ldc, p->batch, p->stride_c));
    LT_TRY(make_pref(&c.pref, p));
    rc = lt_call_run(b, stream, &c, p->B, p->A, p->C, p->beta, &none);
    if (none)
        rc = bad("cuBLASLt has no algorithm for %s operands to %s C, M %d N %d K %d, "
                 "ta %d tb %d, lda %d ldb %d ldc %d, batch %d, epilogue %s%s",
                 gpu_dtype_name(p->adt), gpu_dtype_name(p->cdt), p->M, p->N, p->K, (int)p->ta,
                 (int)p->tb, p->lda, p->ldb, p->ldc, p->batch, epi_name(p->epilogue),
                 p->aux != NULL ? " with aux" : "");
fail:
    lt_call_free(&c);
    return rc;
}

/* Device pointers in p borrowed; enqueued on stream, no host synchronisation. */
extern "C" int gpu_cuda_matmul(gpu_cuda_blas *b, cudaStream_t stream, const gpu_cuda_mm *p)
{
    if (b == NULL)
        return bad("no handle");
    int rc = gpu_cuda_mm_check(p, true);
    if (rc != 0)
        return rc;
    if (p->M == 0 || p->N == 0)
        return 0;
    if (p->K == 0)
        return scale_c(p, stream);
    return lt_matmul(b, stream, p);
}

/* ---- fp8 ------------------------------------------------------------------------------------
 * The product is the TN one cuBLASLt's fp8 kernels take: cuBLASLt's A is our B (N x K
 * row-major, transposed: TRANSA T), its B our A (TRANSB N), and the dequantisation factors
 * go to A_SCALE_POINTER (b_scale_inv) and B_SCALE_POINTER (a_scale_inv), as Transformer
 * Engine passes its scale_inv. The cast is a grid-stride loop over format_rule.h's
 * conversion, so its codes are the CPU's; its amax is an atomicMax on the bits of |x|, which
 * order as the values do for non-negative floats (max needs no order: deterministic). */

static cudaDataType_t fp8_type(gpu_fp8_format f)
{
    return f == GPU_E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
}

extern "C" bool gpu_cuda_has_fp8(char *why, size_t whylen)
{
    int dev = 0;
    struct cudaDeviceProp prop;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        set_why(why, whylen, "no CUDA device");
        return false;
    }
    if (prop.major * 10 + prop.minor >= 89)
        return true;
    set_why(why, whylen,
            "%s (device %d) is sm_%d%d: fp8 GEMMs need fp8 tensor cores, compute capability 8.9 "
            "or above (Ada, Hopper: an H100 or H200)",
            prop.name, dev, prop.major, prop.minor);
    return false;
}

extern "C" int gpu_cuda_mm8_check(const gpu_cuda_mm8 *p, bool device)
{
    if (p == NULL)
        return bad("fp8: no parameters");
    if (p->M < 0 || p->N < 0 || p->K < 0)
        return bad("fp8: negative size M %d N %d K %d", p->M, p->N, p->K);
    if ((p->af != GPU_E4M3 && p->af != GPU_E5M2) || (p->bf != GPU_E4M3 && p->bf != GPU_E5M2))
        return bad("fp8: unknown format (A %d, B %d)", (int)p->af, (int)p->bf);
    if (p->af == GPU_E5M2 && p->bf == GPU_E5M2)
        return bad("fp8: E5M2 x E5M2 is not a product cuBLASLt has (one operand must be E4M3)");
    if (p->cdt != GPU_FP32 && p->cdt != GPU_BF16)
        return bad("fp8: C must be fp32 or bf16, not %s", gpu_dtype_name(p->cdt));
    if (p->K % 16 || p->N % 16 || p->lda % 16 || p->ldb % 16)
        return bad("fp8: K %d, N %d, lda %d and ldb %d must be multiples of 16", p->K, p->N, p->lda,
                   p->ldb);
    if (p->lda < p->K || p->ldb < p->K || p->ldc < p->N || p->ldc < 1)
        return bad("fp8: lda %d or ldb %d below K %d, or ldc %d below N %d", p->lda, p->ldb, p->K,
                   p->ldc, p->N);
    if (p->M > 0 && p->N > 0 &&
        (p->C == NULL || (p->K > 0 && (p->A == NULL || p->B == NULL || p->a_scale_inv == NULL ||
                                       p->b_scale_inv == NULL))))
        return bad("fp8: A, B, C or a scale_inv is NULL");
    if (device && (misaligned(p->A, 16) || misaligned(p->B, 16) || misaligned(p->C, 16) ||
                   misaligned(p->a_scale_inv, 4) || misaligned(p->b_scale_inv, 4)))
        return bad("fp8: A, B and C must be 16-byte aligned");
    return 0;
}

/* The fp8 product's descriptor: TN, the scale pointers, fast accumulation. */
static cublasStatus_t make_desc8(cublasLtMatmulDesc_t *d, const gpu_cuda_mm8 *p)
{
    cublasStatus_t s = lt.desc_create(d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s != CUBLAS_STATUS_SUCCESS) {
        *d = NULL;
        return s;
    }
    s = desc_set(*d, CUBLASLT_MATMUL_DESC_TRANSA, (int32_t)CUBLAS_OP_T);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = desc_set(*d, CUBLASLT_MATMUL_DESC_TRANSB, (int32_t)CUBLAS_OP_N);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = desc_set(*d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, p->b_scale_inv);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = desc_set(*d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, p->a_scale_inv);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = desc_set(*d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, (int8_t)(p->fast_accum ? 1 : 0));
    return s;
}

static int lt_matmul8(gpu_cuda_blas *b, cudaStream_t stream, const gpu_cuda_mm8 *p)
{
    int rc = 0;
    lt_call c = {NULL, NULL, NULL, NULL, NULL};
    gpu_cuda_mm q; /* the preference's view: alignments and the reduction scheme */
    bool none = false;

    memset(&q, 0, sizeof(q));
    q.A = p->A, q.B = p->B, q.C = p->C, q.cdt = p->cdt;
    LT_TRY(make_desc8(&c.op, p));
    LT_TRY(lt.layout_create(&c.la, fp8_type(p->bf), (uint64_t)p->K, (uint64_t)p->N, p->ldb));
    LT_TRY(lt.layout_create(&c.lb, fp8_type(p->af), (uint64_t)p->K, (uint64_t)p->M, p->lda));
    LT_TRY(lt.layout_create(&c.lc, cuda_type(p->cdt), (uint64_t)p->N, (uint64_t)p->M, p->ldc));
    LT_TRY(make_pref(&c.pref, &q));
    rc = lt_call_run(b, stream, &c, p->B, p->A, p->C, 0.0f, &none);
    if (none)
        rc = bad("cuBLASLt has no fp8 algorithm for %s x %s to %s, M %d N %d K %d",
                 gpu_fp8_format_name(p->af), gpu_fp8_format_name(p->bf), gpu_dtype_name(p->cdt),
                 p->M, p->N, p->K);
fail:
    lt_call_free(&c);
    return rc;
}

extern "C" int gpu_cuda_matmul_fp8(gpu_cuda_blas *b, cudaStream_t stream, const gpu_cuda_mm8 *p)
{
    if (b == NULL)
        return bad("fp8: no handle");
    int rc = gpu_cuda_mm8_check(p, true);
    if (rc != 0)
        return rc;
    if (!b->fp8) {
        gpu_log(GPU_LOG_ERROR, "gpu_cuda_matmul_fp8", "%s", b->no_fp8);
        return GPU_ENODEV;
    }
    if (p->M == 0 || p->N == 0)
        return 0;
    if (p->K == 0) { /* C = 0, as the exact sum of nothing */
        gpu_cuda_mm z;
        memset(&z, 0, sizeof(z));
        z.M = p->M, z.N = p->N, z.C = p->C, z.cdt = p->cdt, z.ldc = p->ldc, z.batch = 1;
        return scale_c(&z, stream);
    }
    return lt_matmul8(b, stream, p);
}

#define CAST_THREADS 256u
#define CAST_MAX_BLOCKS 4096u

static __device__ float load_as_f32(const void *src, gpu_dtype dt, size_t i)
{
    if (dt == GPU_FP32)
        return ((const float *)src)[i];
    uint16_t h = ((const uint16_t *)src)[i];
    return __uint_as_float(dt == GPU_FP16 ? gpu_fmt_f16_to_f32(h) : gpu_fmt_bf16_to_f32(h));
}

/* A thread's counts of a collecting cast, summed over the warp. */
typedef struct {
    unsigned long long n, sat, ufl, nz, nan;
} fp8_cnt;

/* The warp's largest |x| bits, in lane 0. */
static __device__ uint32_t fp8_warp_max(uint32_t most)
{
    for (int off = 16; off > 0; off >>= 1) {
        uint32_t o = __shfl_down_sync(0xFFFFFFFFu, most, off);
        most = o > most ? o : most;
    }
    return most;
}

/* The warp's counts into k (most: the warp's largest |x| bits, already summed in lane 0). */
static __device__ void fp8_cnt_flush(gpu_cuda_fp8_counts *k, fp8_cnt v, uint32_t most,
                                     const float *scale)
{
    for (int off = 16; off > 0; off >>= 1) {
        v.n += __shfl_down_sync(0xFFFFFFFFu, v.n, off);
        v.sat += __shfl_down_sync(0xFFFFFFFFu, v.sat, off);
        v.ufl += __shfl_down_sync(0xFFFFFFFFu, v.ufl, off);
        v.nz += __shfl_down_sync(0xFFFFFFFFu, v.nz, off);
        v.nan += __shfl_down_sync(0xFFFFFFFFu, v.nan, off);
    }
    if (threadIdx.x % 32 != 0)
        return;
    const unsigned long long add[5] = {v.n, v.sat, v.ufl, v.nz, v.nan};
    unsigned long long *to[5] = {&k->n, &k->saturated, &k->underflow, &k->nonzero, &k->nan};
    for (int i = 0; i < 5; i++)
        if (add[i])
            atomicAdd(to[i], add[i]);
    if (most)
        atomicMax(&k->amax, (unsigned int)most);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        k->scale = *scale;
}

/* Grid-stride over the values; counts (with dst only) as gpu_fp8_cast counts its stats. The
 * blocks are whole warps, and every thread reaches the warp sums: the amax and the counts
 * take one atomic per warp. */
static __global__ void gpu_k_fp8_cast(uint8_t *dst, uint8_t *dst_t, const void *src, gpu_dtype sdt,
                                      int rows, int cols, int e5m2, const float *scale, float *amax,
                                      gpu_cuda_fp8_counts *cnt, float top)
{
    size_t n = (size_t)rows * cols, stride = (size_t)gridDim.x * blockDim.x;
    float s = *scale;
    uint32_t most = 0;
    fp8_cnt v = {0, 0, 0, 0, 0};
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float x = load_as_f32(src, sdt, i);
        uint32_t a = __float_as_uint(x) & 0x7FFFFFFFu;
        most = a <= 0x7F800000u && a > most ? a : most; /* a NaN is skipped */
        if (!dst)
            continue;
        float y = x * s;
        uint8_t c = gpu_fmt_f32_to_fp8(__float_as_uint(y), e5m2, 1);
        dst[i] = c;
        if (dst_t)
            dst_t[(i % (size_t)cols) * (size_t)rows + i / (size_t)cols] = c;
        if (cnt) {
            bool nan = a > 0x7F800000u;
            v.n++;
            v.nan += nan;
            v.sat += fabsf(y) > top;
            v.ufl += a != 0 && !nan && (c & 0x7Fu) == 0;
            v.nz += a != 0 && a < 0x7F800000u;
        }
    }
    most = fp8_warp_max(most); /* one atomic a warp, not a thread */
    if (amax && most && threadIdx.x % 32 == 0)
        atomicMax((unsigned int *)amax, (unsigned int)most);
    if (cnt)
        fp8_cnt_flush(cnt, v, most, scale);
}

extern "C" int gpu_cuda_fp8_cast(cudaStream_t stream, uint8_t *dst, uint8_t *dst_t, const void *src,
                                 gpu_dtype sdt, int rows, int cols, gpu_fp8_format f,
                                 const float *scale, float *amax, gpu_cuda_fp8_counts *counts)
{
    size_t n = (size_t)rows * (size_t)cols;
    if (rows < 0 || cols < 0 || (sdt != GPU_FP32 && sdt != GPU_FP16 && sdt != GPU_BF16) ||
        (f != GPU_E4M3 && f != GPU_E5M2) || (n > 0 && (src == NULL || scale == NULL)) ||
        (n > 0 && dst == NULL && (dst_t != NULL || amax == NULL || counts != NULL)))
        return bad("fp8 cast: bad arguments (rows %d, cols %d)", rows, cols);
    if (n == 0)
        return 0;
    unsigned blocks = gpu_cuda_blocks(n, CAST_THREADS, CAST_MAX_BLOCKS);
    gpu_k_fp8_cast<<<blocks, CAST_THREADS, 0, stream>>>(
        dst, dst_t, src, sdt, rows, cols, f == GPU_E5M2, scale, amax, counts,
        f == GPU_E5M2 ? GPU_E5M2_MAX : GPU_E4M3_MAX);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        gpu_log(GPU_LOG_ERROR, "gpu_cuda_fp8_cast", "launch: %s", cudaGetErrorString(e));
        return GPU_ECUDA;
    }
    return 0;
}

static __global__ void gpu_k_fp8_current(float *row, const float *amax, float scaled_max,
                                         float epsilon)
{
    float a = *amax;
    row[0] = gpu_fp8r_current_scale(a, scaled_max, epsilon);
    row[1] = 1.0f / row[0];
    row[2] = a;
}

extern "C" int gpu_cuda_fp8_current(cudaStream_t stream, float *row, const float *amax,
                                    float scaled_max, float epsilon)
{
    if (row == NULL || amax == NULL)
        return bad("fp8 current scaling: no row or amax");
    gpu_k_fp8_current<<<1, 1, 0, stream>>>(row, amax, scaled_max, epsilon);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        gpu_log(GPU_LOG_ERROR, "gpu_cuda_fp8_current", "launch: %s", cudaGetErrorString(e));
        return GPU_ECUDA;
    }
    return 0;
}

static __global__ void gpu_k_fp8_delayed(float *state, int nrows, int len, int most_recent,
                                         float top0, float top1, float top2)
{
    int r = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (r >= nrows)
        return;
    float *w = state + (size_t)r * (size_t)(2 + len);
    float top = r % 3 == 0 ? top0 : r % 3 == 1 ? top1 : top2;
    gpu_fp8r_delayed_update(w + 2, len, most_recent, top, &w[0], &w[1]);
}

extern "C" int gpu_cuda_fp8_delayed(cudaStream_t stream, float *state, int nrows, int len,
                                    bool most_recent, const float scaled_max[3])
{
    if (nrows < 0 || len < 1 || (nrows > 0 && (state == NULL || scaled_max == NULL)))
        return bad("fp8 delayed scaling: bad arguments (rows %d, history %d)", nrows, len);
    if (nrows == 0)
        return 0;
    unsigned threads = 128, blocks = (unsigned)((nrows + 127) / 128);
    gpu_k_fp8_delayed<<<blocks, threads, 0, stream>>>(state, nrows, len, most_recent ? 1 : 0,
                                                      scaled_max[0], scaled_max[1], scaled_max[2]);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        gpu_log(GPU_LOG_ERROR, "gpu_cuda_fp8_delayed", "launch: %s", cudaGetErrorString(e));
        return GPU_ECUDA;
    }
    return 0;
}
