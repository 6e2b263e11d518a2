/*
 * blas.c - the engine's GEMM: OpenBLAS opened at run time, plus the fp64 reference.
 *
 * OpenBLAS (a DYNAMIC_ARCH build) chooses its kernel set once, in a library constructor,
 * from the OPENBLAS_CORETYPE environment variable or its own CPU detection, and that
 * detection picks the generic SSE3 "Prescott" kernels on some of our AVX-512 machines
 * (~37 GFLOP/s instead of 200-290). So the library is not linked: it is opened with
 * dlopen() (the file configure found, or $AMPD_OPENBLAS) after OPENBLAS_CORETYPE has been
 * set from CPUID (unless the user set it), and the entry points are looked up with dlsym().
 *
 * gpu_gemm() follows the tensor-core contract: 16-bit operands are widened exactly to fp32
 * into the caller's scratch, then multiplied with cblas_sgemm (fp32 accumulation).
 *
 * Invariants: the library is loaded at most once per process (pthread_once) and never
 * closed; after a failed load every entry point returns GPU_EBLAS. The description string
 * of each thread count is written once and never changed, so gpu_blas_info()'s result
 * stays valid forever.
 *
 * Threads: everything here may be called from any thread. Loading sets an environment
 * variable (setenv), which is not safe while another thread reads the environment; call
 * gpu_blas_init() early, before starting threads, where that matters.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "gpu/gpu_int.h"

#ifndef AMPD_OPENBLAS_PATH
#define AMPD_OPENBLAS_PATH "libopenblas.so.0"
#endif

/* CBLAS enum values (cblas.h); passed as int, which is how the C ABI passes the enums.
 * Debian's libopenblas.so.0 uses 32-bit integers (the 64-bit build is libopenblas64). */
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

typedef void (*sgemm_fn)(int order, int ta, int tb, int m, int n, int k, float alpha,
                         const float *a, int lda, const float *b, int ldb, float beta,
                         float *c, int ldc);
typedef void (*set_threads_fn)(int n);
typedef int (*get_threads_fn)(void);
typedef char *(*get_str_fn)(void);

#define INFO_MAX 256
#define INFO_SLOTS 65 /* one description per thread count 1..64 (OpenBLAS's MAX_THREADS) */

static struct {
    int rc;                     /* result of the one load: 0 or GPU_EBLAS */
    void *lib;
    sgemm_fn sgemm;
    set_threads_fn set_threads;
    get_threads_fn get_threads;
    get_str_fn corename;
    get_str_fn config;
    char version[32];           /* "OpenBLAS 0.3.21" */
    char source[32];            /* " from OPENBLAS_CORETYPE" when the user chose, else "" */
    char note[96];              /* "; ..." when the kernel choice was not applied */
    char failed[INFO_MAX];      /* the description after a failed load */
} blas;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t threads_lock = PTHREAD_MUTEX_INITIALIZER;
static char infos[INFO_SLOTS][INFO_MAX];   /* written once each, under threads_lock */
static _Atomic(const char *) info_now;

/* The OpenBLAS kernel set for this CPU, or NULL to leave the choice to OpenBLAS.
 * Measured with bench/sgemm on a 2-core Xeon with AVX-512 BF16/FP16 (2 threads, best of 10,
 * GFLOP/s at the MLP's large GEMMs / 2048 square): Cooperlake 257-277 / 294, SkylakeX
 * 257-273 / 305, Haswell 144-152 / 161, Prescott 57-62 / 56. Cooperlake's sgemm kernels
 * are SkylakeX's (0.3.21 adds only bf16 sbgemm kernels to them), so the two tie; the name
 * follows the CPU. */
static const char *choose_coretype(void)
{
#if defined(__x86_64__) || defined(__i386__)
    const gpu_cpu_features *f = gpu_cpu();
    if (f->avx512bf16 && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq)
        return "Cooperlake";
    if (f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq)
        return "SkylakeX";
    if (f->avx2 && f->fma)
        return "Haswell";
#endif
    return NULL;
}

/* The library to open: $AMPD_OPENBLAS when set (a machine where OpenBLAS is not where
 * configure found it, e.g. a GPU machine running carried test binaries), else the path
 * configure found. */
static const char *openblas_path(void)
{
    const char *p = getenv("AMPD_OPENBLAS");
    return p != NULL && p[0] != '\0' ? p : AMPD_OPENBLAS_PATH;
}

/* Set OPENBLAS_CORETYPE for the library's constructor and record in blas.note why the
 * kernel set may differ from the automatic choice. Returns the coretype asked for. */
static const char *prepare_coretype(void)
{
    const char *user = getenv("OPENBLAS_CORETYPE");
    if (user != NULL && user[0] != '\0') {
        snprintf(blas.source, sizeof blas.source, " from OPENBLAS_CORETYPE");
        return NULL;
    }
    void *already = dlopen(openblas_path(), RTLD_NOW | RTLD_NOLOAD);
    if (already != NULL) {
        dlclose(already);
        snprintf(blas.note, sizeof blas.note,
                 "; library was already loaded, kernel choice not applied");
        return NULL;
    }
    const char *core = choose_coretype();
    if (core != NULL)
        setenv("OPENBLAS_CORETYPE", core, 1); /* unset or empty here */
    return core;
}

static int load_symbol(void **out, const char *name)
{
    *out = dlsym(blas.lib, name);
    if (*out == NULL) {
        const char *why = dlerror();
        fprintf(stderr, "ampd: cannot load OpenBLAS from %s: %s\n", openblas_path(),
                why != NULL ? why : name);
        snprintf(blas.failed, sizeof blas.failed, "OpenBLAS unavailable (no %s in %s)",
                 name, openblas_path());
        return GPU_EBLAS;
    }
    return 0;
}

/* Copy the first two words of openblas_get_config() ("OpenBLAS 0.3.21 ..."). */
static void read_version(void)
{
    const char *cfg = blas.config();
    int words = 0;
    size_t n = 0;
    while (cfg != NULL && cfg[n] != '\0' && n + 1 < sizeof blas.version) {
        if (cfg[n] == ' ' && ++words == 2)
            break;
        n++;
    }
    memcpy(blas.version, cfg != NULL ? cfg : "", n);
    blas.version[n] = '\0';
    if (n == 0)
        snprintf(blas.version, sizeof blas.version, "OpenBLAS");
}

/* Apply the thread count and publish the matching description. Caller holds
 * threads_lock. */
static void set_threads_locked(int nthreads)
{
    if (nthreads <= 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        nthreads = cpus > 0 ? (int)(cpus < INFO_SLOTS - 1 ? cpus : INFO_SLOTS - 1) : 1;
    }
    blas.set_threads(nthreads);
    int got = blas.get_threads();
    int slot = got < 1 ? 0 : got >= INFO_SLOTS ? INFO_SLOTS - 1 : got;
    char *info = infos[slot];
    if (info[0] == '\0') {
        const char *core = blas.corename();
        snprintf(info, INFO_MAX, "%s (%s kernels%s, %d thread%s%s)", blas.version,
                 core != NULL ? core : "unknown", blas.source, got, got == 1 ? "" : "s",
                 blas.note);
    }
    atomic_store(&info_now, info);
}

static void load(void)
{
    void *sym[5];
    const char *asked = prepare_coretype();

    dlerror();
    blas.lib = dlopen(openblas_path(), RTLD_NOW | RTLD_LOCAL);
    if (blas.lib == NULL) {
        const char *why = dlerror();
        fprintf(stderr, "ampd: cannot load OpenBLAS from %s: %s\n", openblas_path(),
                why != NULL ? why : "unknown error");
        snprintf(blas.failed, sizeof blas.failed, "OpenBLAS unavailable (cannot load %s)",
                 openblas_path());
        goto fail;
    }
    if (load_symbol(&sym[0], "cblas_sgemm") != 0 ||
        load_symbol(&sym[1], "openblas_set_num_threads") != 0 ||
        load_symbol(&sym[2], "openblas_get_num_threads") != 0 ||
        load_symbol(&sym[3], "openblas_get_corename") != 0 ||
        load_symbol(&sym[4], "openblas_get_config") != 0)
        goto fail;
    /* dlsym returns object pointers; POSIX guarantees they convert to function pointers. */
    blas.sgemm = (sgemm_fn)sym[0];
    blas.set_threads = (set_threads_fn)sym[1];
    blas.get_threads = (get_threads_fn)sym[2];
    blas.corename = (get_str_fn)sym[3];
    blas.config = (get_str_fn)sym[4];
    read_version();
    const char *core = blas.corename();
    if (asked != NULL && (core == NULL || strcasecmp(core, asked) != 0))
        snprintf(blas.note, sizeof blas.note, "; %s was asked for", asked);
    blas.rc = 0;
    pthread_mutex_lock(&threads_lock);
    set_threads_locked(0);
    pthread_mutex_unlock(&threads_lock);
    return;

fail:
    if (blas.lib != NULL)
        dlclose(blas.lib);
    blas.lib = NULL;
    blas.rc = GPU_EBLAS;
    atomic_store(&info_now, blas.failed);
}

static int ensure_loaded(void)
{
    pthread_once(&load_once, load);
    return blas.rc;
}

int gpu_blas_init(int nthreads)
{
    int rc = ensure_loaded();
    if (rc != 0)
        return rc;
    pthread_mutex_lock(&threads_lock);
    set_threads_locked(nthreads);
    pthread_mutex_unlock(&threads_lock);
    return 0;
}

/* Loads the library when needed. The result is static; never freed. */
const char *gpu_blas_info(void)
{
    ensure_loaded();
    return atomic_load(&info_now);
}

/* ---- GEMM ------------------------------------------------------------------------------ */

/* Elements spanned by a row-major rows x cols matrix with leading dimension ld. */
static size_t footprint(int rows, int cols, int ld)
{
    if (rows <= 0 || cols <= 0)
        return 0;
    return (size_t)(rows - 1) * (size_t)ld + (size_t)cols;
}

static bool dtype_ok(gpu_dtype dt)
{
    return dt == GPU_FP32 || dt == GPU_FP16 || dt == GPU_BF16;
}

size_t gpu_gemm_scratch_floats(bool ta, bool tb, int M, int N, int K,
                               gpu_dtype adt, int lda, gpu_dtype bdt, int ldb)
{
    size_t n = 0;
    if (M <= 0 || N <= 0 || K <= 0)
        return 0;
    if (adt != GPU_FP32)
        n += ta ? footprint(K, M, lda) : footprint(M, K, lda);
    if (bdt != GPU_FP32)
        n += tb ? footprint(N, K, ldb) : footprint(K, N, ldb);
    return n;
}

/* Widen a stored rows x cols 16-bit matrix into dst with the same leading dimension. Only
 * the rows' cols elements are read, never the padding between rows. */
static void widen(float *dst, const uint16_t *src, gpu_dtype dt, int rows, int cols, int ld)
{
    if (ld == cols) {
        size_t n = (size_t)rows * (size_t)cols;
        if (dt == GPU_FP16)
            gpu_cvt_f16_f32(dst, src, n);
        else
            gpu_cvt_bf16_f32(dst, src, n);
        return;
    }
    for (int r = 0; r < rows; r++) {
        size_t off = (size_t)r * (size_t)ld;
        if (dt == GPU_FP16)
            gpu_cvt_f16_f32(dst + off, src + off, (size_t)cols);
        else
            gpu_cvt_bf16_f32(dst + off, src + off, (size_t)cols);
    }
}

/* C = beta * C, with BLAS semantics: beta == 0 writes zeros (NaN in C does not survive). */
static void scale_c(int M, int N, float beta, float *C, int ldc)
{
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * (size_t)ldc;
        for (int j = 0; j < N; j++)
            c[j] = beta == 0.0f ? 0.0f : beta * c[j];
    }
}

static int check_args(bool ta, bool tb, int M, int N, int K, const void *A, gpu_dtype adt,
                      int lda, const void *B, gpu_dtype bdt, int ldb, const float *C, int ldc)
{
    if (M < 0 || N < 0 || K < 0 || !dtype_ok(adt) || !dtype_ok(bdt))
        return GPU_EINVAL;
    int a_cols = ta ? M : K, b_cols = tb ? K : N;
    if (lda < 1 || lda < a_cols || ldb < 1 || ldb < b_cols || ldc < 1 || ldc < N)
        return GPU_EINVAL;
    if (M > 0 && N > 0 && C == NULL)
        return GPU_EINVAL;
    if (M > 0 && N > 0 && K > 0 && (A == NULL || B == NULL))
        return GPU_EINVAL;
    return 0;
}

/* A, B and C borrowed; C must not overlap A, B or scratch. scratch borrowed, holds at
 * least gpu_gemm_scratch_floats() floats. */
int gpu_gemm(bool ta, bool tb, int M, int N, int K,
             const void *A, gpu_dtype adt, int lda,
             const void *B, gpu_dtype bdt, int ldb,
             float beta, float *C, int ldc, float *scratch)
{
    int rc = check_args(ta, tb, M, N, K, A, adt, lda, B, bdt, ldb, C, ldc);
    if (rc != 0)
        return rc;
    if (M == 0 || N == 0)
        return 0;
    if (K == 0) {
        scale_c(M, N, beta, C, ldc);
        return 0;
    }
    size_t need = gpu_gemm_scratch_floats(ta, tb, M, N, K, adt, lda, bdt, ldb);
    if (need > 0 && scratch == NULL)
        return GPU_EINVAL;
    rc = ensure_loaded();
    if (rc != 0)
        return rc;

    const float *a = A, *b = B;
    float *next = scratch;
    if (adt != GPU_FP32) {
        widen(next, A, adt, ta ? K : M, ta ? M : K, lda);
        a = next;
        next += ta ? footprint(K, M, lda) : footprint(M, K, lda);
    }
    if (bdt != GPU_FP32) {
        widen(next, B, bdt, tb ? N : K, tb ? K : N, ldb);
        b = next;
    }
    blas.sgemm(CBLAS_ROW_MAJOR, ta ? CBLAS_TRANS : CBLAS_NO_TRANS,
               tb ? CBLAS_TRANS : CBLAS_NO_TRANS, M, N, K, 1.0f, a, lda, b, ldb, beta, C,
               ldc);
    return 0;
}

/* A, B and C borrowed. Each output is the double-precision sum rounded once to fp32;
 * beta == 0 ignores C's old contents as BLAS does. */
void gpu_gemm_ref(bool ta, bool tb, int M, int N, int K, const float *A, int lda,
                  const float *B, int ldb, float beta, float *C, int ldc)
{
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
            double acc = 0.0;
            for (int k = 0; k < K; k++) {
                double a = ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                double b = tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
                acc += a * b;
            }
            float *c = &C[(size_t)i * ldc + j];
            if (beta != 0.0f)
                acc += (double)beta * (double)*c;
            *c = (float)acc;
        }
    }
}
