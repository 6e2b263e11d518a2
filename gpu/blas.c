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
 * gpu_gemm() follows the tensor-core contract (operands of the dtype, fp32 accumulation) on
 * one of three paths, chosen per dtype from what the CPU and the libraries have:
 *   - fp32: oneDNN's matmul where it has AVX-512 kernels (onednn.c), else cblas_sgemm;
 *   - bf16 on a CPU with AVX512_BF16 or AMX: oneDNN multiplies bf16 natively;
 *   - otherwise (fp16, or bf16 without native kernels) the 16-bit operands are widened
 *     exactly to fp32 and multiplied on the fp32 path.
 * An operand not in the library's format is converted block by block as it is consumed
 * (plan_of), so a 16-bit GEMM needs a bounded scratch, never a widened copy of a whole
 * tensor. The caller says how long its scratch is; a GEMM whose plan needs more, counting
 * the widened plan a native one may give way to, is refused before it writes anything.
 * The test path "emulated" plans bf16 as native does on any CPU, its kernels emulated
 * (emu_bf16). The job's thread count applies to OpenBLAS and to the OpenMP team (oneDNN
 * and the engine's other passes).
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

#ifdef _OPENMP
#include <omp.h>
#endif

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
        gpu_log(GPU_LOG_ERROR, __func__, "cannot load OpenBLAS from %s: %s", openblas_path(),
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
        gpu_log(GPU_LOG_ERROR, __func__, "cannot load OpenBLAS from %s: %s", openblas_path(),
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

static bool fp32_on_dnnl(void);

int gpu_blas_init(int nthreads)
{
    int rc = ensure_loaded();
    if (rc != 0)
        return rc;
    pthread_mutex_lock(&threads_lock);
    set_threads_locked(nthreads);
#ifdef _OPENMP
    omp_set_num_threads(blas.get_threads());
    /* With oneDNN on fp32, OpenBLAS only takes what oneDNN's fast kernels refuse (the
     * attention's strided products): on one thread of its own, so that the OpenMP team can
     * call it from several threads at once and its own threads never spin beside the team. */
    if (fp32_on_dnnl())
        set_threads_locked(1);
#endif
    pthread_mutex_unlock(&threads_lock);
    return 0;
}

int gpu_blas_threads(void)
{
    return ensure_loaded() == 0 ? blas.get_threads() : 1;
}

/* Loads the library when needed. The result is static; never freed. */
const char *gpu_blas_info(void)
{
    ensure_loaded();
    return atomic_load(&info_now);
}

/* ---- GEMM ------------------------------------------------------------------------------ */

static bool dtype_ok(gpu_dtype dt)
{
    return dt == GPU_FP32 || dt == GPU_FP16 || dt == GPU_BF16;
}

/* The GEMM paths (gpu_gemm_force, AMPD_GEMM): "auto" picks per dtype; "openblas" runs
 * everything on OpenBLAS (16-bit operands widened); "widen" runs fp32 on oneDNN and widens
 * every 16-bit operand to it; "native" is auto's choice where oneDNN has native bf16;
 * "emulated" plans bf16 GEMMs as native does, with the native kernels emulated (emu_bf16),
 * so that the native plans and the callers' scratch for them run on every CPU. */
enum { PATH_AUTO, PATH_OPENBLAS, PATH_WIDEN, PATH_NATIVE, PATH_EMULATED, PATH_UNSET };
static const char *const path_names[] = {"auto", "openblas", "widen", "native", "emulated"};
static _Atomic int gemm_path = PATH_UNSET;

static int path_lookup(const char *name)
{
    for (int i = 0; i < PATH_UNSET; i++)
        if (name != NULL && strcmp(name, path_names[i]) == 0)
            return i;
    return -1;
}

static int path_now(void)
{
    int p = atomic_load(&gemm_path);
    if (p != PATH_UNSET)
        return p;
    p = path_lookup(getenv("AMPD_GEMM"));
    if (p < 0 || gpu_gemm_force(path_names[p]) != 0)
        p = PATH_AUTO;
    int unset = PATH_UNSET;
    atomic_compare_exchange_strong(&gemm_path, &unset, p);
    return atomic_load(&gemm_path);
}

/* Whether this machine has path p: widen and native need oneDNN's kernels. */
static bool path_here(int p)
{
    return (p != PATH_WIDEN || gpu_dnnl_has(GPU_FP32)) &&
           (p != PATH_NATIVE || gpu_dnnl_has(GPU_BF16));
}

int gpu_gemm_force(const char *path)
{
    int p = path_lookup(path);
    if (p < 0)
        return GPU_EINVAL;
    if (!path_here(p))
        return GPU_ENODEV;
    atomic_store(&gemm_path, p);
    return 0;
}

const char *gpu_gemm_path(void)
{
    return path_names[path_now()];
}

void gpu_gemm_paths(char *out, size_t len)
{
    size_t n = 0;
    if (len > 0)
        out[0] = '\0';
    for (int p = PATH_OPENBLAS; p < PATH_UNSET && n < len; p++)
        if (path_here(p))
            n += (size_t)snprintf(out + n, len - n, "%s%s", n ? " " : "", path_names[p]);
}

/* The format the library multiplies a GEMM computing in cdt in: bf16 where oneDNN has
 * native bf16 kernels, otherwise fp32 (16-bit operands widened exactly). */
static gpu_dtype lib_format(gpu_dtype cdt)
{
    int p = path_now();
    if (cdt == GPU_BF16 && (p == PATH_EMULATED ||
                            ((p == PATH_AUTO || p == PATH_NATIVE) && gpu_dnnl_has(GPU_BF16))))
        return GPU_BF16;
    return GPU_FP32;
}

static bool fp32_on_dnnl(void)
{
    return path_now() != PATH_OPENBLAS && gpu_dnnl_has(GPU_FP32);
}

/* gpu_gemm's compute dtype: the operands' when they are alike, else fp32 (exact). */
static gpu_dtype exact_dtype(gpu_dtype adt, gpu_dtype bdt)
{
    return adt == bdt ? adt : GPU_FP32;
}

/* A 16-bit cdt applies when each operand is fp32 or of cdt (else the product is exact). */
static bool cdt_ok(gpu_dtype adt, gpu_dtype bdt, gpu_dtype cdt)
{
    return cdt == GPU_FP32 || ((adt == GPU_FP32 || adt == cdt) && (bdt == GPU_FP32 || bdt == cdt));
}

static char gemm_infos[PATH_UNSET][3][192]; /* each written once, under info_lock */
static pthread_mutex_t info_lock = PTHREAD_MUTEX_INITIALIZER;

static void gemm_info_fill(char *s, size_t len, gpu_dtype dt)
{
    const char *fp32 = fp32_on_dnnl() ? gpu_dnnl_info() : gpu_blas_info();
    if (dt == GPU_FP32)
        snprintf(s, len, "%s", fp32);
    else if (lib_format(dt) == GPU_BF16 && path_now() == PATH_EMULATED)
        snprintf(s, len, "native %s emulated (widened inside, subnormals read as zero), %s",
                 gpu_dtype_name(dt), fp32);
    else if (lib_format(dt) == GPU_BF16)
        snprintf(s, len, "native %s, %s", gpu_dtype_name(dt), gpu_dnnl_info());
    else
        snprintf(s, len, "widened to fp32 block by block, %s", fp32);
}

bool gpu_gemm_in_place(gpu_dtype dt)
{
    return dtype_ok(dt) && ensure_loaded() == 0 && lib_format(dt) == dt;
}

size_t gpu_gemm_lib_bytes(void)
{
    return gpu_dnnl_peak();
}

/* Static; valid forever. */
const char *gpu_gemm_info(gpu_dtype dt)
{
    if (!dtype_ok(dt))
        return "unknown dtype";
    char *s = gemm_infos[path_now()][dt];
    pthread_mutex_lock(&info_lock);
    if (s[0] == '\0')
        gemm_info_fill(s, sizeof gemm_infos[0][0], dt);
    pthread_mutex_unlock(&info_lock);
    return s;
}

/* How a GEMM hands its operands to the library. An operand already in the library's
 * format is read in place. Of two that need converting, the smaller is converted whole
 * and the larger streamed in blocks along its non-K dimension (A by rows of C, B by
 * columns), each block converted right before its product: no whole-tensor copy of it. A
 * widened B that would take several column blocks is streamed along K instead: narrow
 * products through a dense copy of C's columns made the fp16 GPT's weight gradients (N x
 * 2048 by 2048 x 256 or 1024) 7-14% slower than fp32's, where full-width ones are 1-9%. */
typedef struct {
    gpu_dtype cdt;      /* the dtype operands are rounded to */
    gpu_dtype fmt;      /* the library format */
    bool conv_a, conv_b;
    bool stream_a;      /* A is streamed (else B, when conv_b) */
    bool split_k;       /* B streamed along K instead (the widened plan, when it would take
                         * several column blocks): full-width products summed into C */
    int block;          /* rows (A) or columns (B) per block */
    size_t a_el, b_el;  /* converted elements held for A and for B */
    size_t c_el;        /* fp32 of a dense column block of C (B streamed in several blocks:
                         * the libraries' fast kernels want C's natural leading dimension) */
} gemm_plan;

/* Elements of one streamed block: it stays in L2 between its conversion and its product. */
#define BLOCK_ELEMS ((size_t)1 << 18)

/* The block of a streamed dimension: at most BLOCK_ELEMS elements (at least 64 rows or
 * columns), a multiple of 16, the blocks as even as that allows. A short last block costs
 * the library more than its share: 1024 columns in blocks of 320, 320, 320 and 64 take 20%
 * longer than in four of 256. */
static int block_of(int dim, int K)
{
    size_t b = BLOCK_ELEMS / (size_t)K / 16 * 16;
    if (b < 64)
        b = 64;
    if (b >= (size_t)dim)
        return dim;
    size_t blocks = ((size_t)dim + b - 1) / b;
    return (int)((((size_t)dim + blocks - 1) / blocks + 15) / 16 * 16);
}

static gemm_plan plan_in(int M, int N, int K, gpu_dtype adt, gpu_dtype bdt, gpu_dtype cdt,
                         unsigned round, gpu_dtype fmt)
{
    gemm_plan p = {.cdt = cdt, .fmt = fmt};
    size_t a = (size_t)M * (size_t)K, b = (size_t)K * (size_t)N;
    bool low = cdt != GPU_FP32;
    /* an fp32 operand to round is rounded even where the library takes fp32 */
    p.conv_a = adt != p.fmt || (low && adt == GPU_FP32 && (round & GPU_GEMM_ROUND_A));
    p.conv_b = bdt != p.fmt || (low && bdt == GPU_FP32 && (round & GPU_GEMM_ROUND_B));
    p.stream_a = p.conv_a && (!p.conv_b || a > b);
    if (p.stream_a) {
        p.block = block_of(M, K);
        p.a_el = (size_t)p.block * (size_t)K;
        p.b_el = p.conv_b ? b : 0;
    } else if (p.conv_b) {
        p.block = block_of(N, K);
        p.a_el = p.conv_a ? a : 0;
        p.split_k = p.block < N && fmt == GPU_FP32;
        if (p.split_k)
            p.block = block_of(K, N);
        p.b_el = (size_t)p.block * (size_t)(p.split_k ? N : K);
        p.c_el = p.block < N && !p.split_k ? (size_t)M * (size_t)p.block : 0;
    }
    return p;
}

static gemm_plan plan_of(int M, int N, int K, gpu_dtype adt, gpu_dtype bdt, gpu_dtype cdt,
                         unsigned round)
{
    return plan_in(M, N, K, adt, bdt, cdt, round, lib_format(cdt));
}

/* Floats of scratch for a plan's converted elements, each region 64-byte aligned. */
static size_t plan_floats(const gemm_plan *p)
{
    size_t es = gpu_dtype_size(p->fmt), n = 0;
    if (p->a_el > 0)
        n += (p->a_el * es + 63) / 64 * 16;
    if (p->b_el > 0)
        n += (p->b_el * es + 63) / 64 * 16;
    n += (p->c_el + 15) / 16 * 16;
    return n > 0 ? n + 16 : 0;
}

/* The scratch a GEMM takes: its plan's, and on the native plan room for the widened one it
 * gives way to (subnormal operands, refused shapes), which converts every 16-bit operand:
 * an operand the native plan reads in place costs nothing there and a share of the scratch
 * here. */
static size_t plans_floats(const gemm_plan *p, const gemm_plan *wide)
{
    size_t n = plan_floats(p), w = p->fmt == GPU_BF16 ? plan_floats(wide) : 0;
    return w > n ? w : n;
}

size_t gpu_gemm_ex_scratch_floats(int M, int N, int K, gpu_dtype adt, gpu_dtype bdt,
                                  gpu_dtype cdt, unsigned round)
{
    if (M <= 0 || N <= 0 || K <= 0 || !dtype_ok(adt) || !dtype_ok(bdt) || !dtype_ok(cdt))
        return 0;
    if (!cdt_ok(adt, bdt, cdt))
        cdt = GPU_FP32;
    gemm_plan p = plan_of(M, N, K, adt, bdt, cdt, round);
    gemm_plan w = plan_in(M, N, K, adt, bdt, cdt, round, GPU_FP32);
    return plans_floats(&p, &w);
}

size_t gpu_gemm_scratch_floats(bool ta, bool tb, int M, int N, int K,
                               gpu_dtype adt, int lda, gpu_dtype bdt, int ldb)
{
    (void)ta, (void)tb, (void)lda, (void)ldb;
    return gpu_gemm_ex_scratch_floats(M, N, K, adt, bdt, exact_dtype(adt, bdt), 0);
}

/* n contiguous elements of sdt into the plan's format: 16-bit widened exactly to fp32, or
 * fp32 rounded to cdt (held in fp32, or narrowed to bf16). */
static void convert_run(void *dst, const gemm_plan *p, const void *src, gpu_dtype sdt,
                        size_t n)
{
    if (p->fmt != GPU_FP32)
        gpu_cvt_from_f32(dst, p->fmt, src, n);
    else if (sdt == GPU_FP32)
        gpu_round_n(dst, src, n, p->cdt);
    else
        gpu_cvt_to_f32(dst, src, sdt, n);
}

/* A stored rows x cols block (leading dimension lds) into a dense one, on every core when
 * it is large. */
static void convert(void *dst, const gemm_plan *p, const void *src, gpu_dtype sdt, int rows,
                    int cols, int lds)
{
    size_t es = gpu_dtype_size(sdt), ed = gpu_dtype_size(p->fmt);
    size_t n = (size_t)rows * (size_t)cols;
    if (lds == cols) {
        size_t chunks = (n + GPU_PAR_MIN - 1) / GPU_PAR_MIN;
#pragma omp parallel for if (chunks > 1) schedule(static)
        for (size_t c = 0; c < chunks; c++) {
            size_t at = c * GPU_PAR_MIN, len = n - at < GPU_PAR_MIN ? n - at : GPU_PAR_MIN;
            convert_run((char *)dst + at * ed, p, (const char *)src + at * es, sdt, len);
        }
        return;
    }
#pragma omp parallel for if (n >= GPU_PAR_MIN) schedule(static)
    for (int r = 0; r < rows; r++)
        convert_run((char *)dst + (size_t)r * cols * ed, p,
                    (const char *)src + (size_t)r * lds * es, sdt, (size_t)cols);
}

static int emu_bf16(bool ta, bool tb, int M, int N, int K, const void *A, int lda,
                    const void *B, int ldb, float beta, float *C, int ldc);

/* The library's product on operands in fmt. */
static int lib_gemm(gpu_dtype fmt, bool ta, bool tb, int M, int N, int K, const void *A,
                    int lda, const void *B, int ldb, float beta, float *C, int ldc)
{
    if (fmt == GPU_BF16 && path_now() == PATH_EMULATED)
        return emu_bf16(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    if (fmt == GPU_BF16)
        return gpu_dnnl_gemm(GPU_BF16, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    if (fp32_on_dnnl() &&
        gpu_dnnl_gemm(GPU_FP32, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc) == 0)
        return 0;
    blas.sgemm(CBLAS_ROW_MAJOR, ta ? CBLAS_TRANS : CBLAS_NO_TRANS,
               tb ? CBLAS_TRANS : CBLAS_NO_TRANS, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
    return 0;
}

/* n bf16 values widened to fp32 as AVX512_BF16's dot products read them: a subnormal as a
 * zero of its sign. */
static void widen_daz(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        if ((u & 0x7F800000u) == 0)
            u &= 0x80000000u;
        memcpy(&dst[i], &u, sizeof u);
    }
}

/* The native bf16 kernels as the path "emulated" runs them on any CPU: what the native plan
 * relies on of oneDNN's brgemm, kept. Operands are read where they are stored, with their
 * natural leading dimensions only (others are refused, GPU_EBLAS, as brgemm refuses them),
 * subnormals read as zero, into buffers of the kernels' own (as oneDNN's scratchpad: never
 * the caller's scratch), then multiplied in fp32. Slow; for tests. */
static int emu_bf16(bool ta, bool tb, int M, int N, int K, const void *A, int lda,
                    const void *B, int ldb, float beta, float *C, int ldc)
{
    if (lda != (ta ? M : K) || ldb != (tb ? K : N) || ldc != N)
        return GPU_EBLAS;
    size_t na = (size_t)M * (size_t)K, nb = (size_t)K * (size_t)N;
    float *w = malloc((na + nb) * sizeof(float));
    if (w == NULL)
        return GPU_ENOMEM;
    widen_daz(w, A, na);
    widen_daz(w + na, B, nb);
    int rc = lib_gemm(GPU_FP32, ta, tb, M, N, K, w, lda, w + na, ldb, beta, C, ldc);
    free(w);
    return rc;
}

/* AVX512_BF16's dot products read subnormal inputs as zero (DAZ), which the contract does
 * not allow: a GEMM that would hand the native kernels a subnormal bf16 value runs widened
 * instead. Subnormal bf16 values (|x| < 2^-126) do not occur in practice, so the check is
 * a fast scan (in place) or a look at what the conversion just wrote (in cache). */
#define SUBNORMAL 1 /* run_plan's answer: the native plan met a subnormal operand, or a
                     * shape oneDNN takes only in its slow or unsafe implementations */

/* Whether a stored bf16 block of rows x cols (leading dimension ld) holds a subnormal. */
static bool block_subnormal(const uint16_t *x, int rows, int cols, int ld)
{
    bool any = false;
    if (ld == cols)
        return gpu_bf16_has_subnormal(x, (size_t)rows * (size_t)cols);
#pragma omp parallel for reduction(| : any) if ((size_t)rows * cols >= GPU_PAR_MIN)
    for (int r = 0; r < rows; r++)
        any |= gpu_bf16_has_subnormal(x + (size_t)r * (size_t)ld, (size_t)cols);
    return any;
}

/* An operand of a GEMM: its storage and where a block of it starts. */
typedef struct {
    const void *p;
    gpu_dtype dt;
    int ld;
    bool t;
    bool converted; /* bf16 written by the conversions (GPU_GEMM_A/B_CONVERTED) */
} operand;

/* Rows [r0, r0 + nr) of op(A) (M x K), or columns [r0, r0 + nr) of op(B) (K x N): the
 * stored block's start, rows and columns. */
static const void *block_at(const operand *o, bool is_a, int r0, int nr, int K, int *rows,
                            int *cols)
{
    size_t es = gpu_dtype_size(o->dt);
    bool along_rows = is_a ? !o->t : o->t; /* the block is whole stored rows */
    *rows = along_rows ? nr : K;
    *cols = along_rows ? K : nr;
    return (const char *)o->p + (along_rows ? (size_t)r0 * o->ld : (size_t)r0) * es;
}

/* One operand for the library: in place, or its block [r0, r0 + nr) converted into buf.
 * *ld: the leading dimension the library reads it with. */
static const void *prepare(const operand *o, bool is_a, bool conv, const gemm_plan *p,
                           int r0, int nr, int K, void *buf, int *ld, bool *subnormal)
{
    int rows, cols;
    const void *src = block_at(o, is_a, r0, nr, K, &rows, &cols);
    if (!conv) {
        *ld = o->ld;
        return src;
    }
    convert(buf, p, src, o->dt, rows, cols, o->ld);
    *ld = cols;
    /* the conversion has said whether it met one; look only when something ever has */
    if (p->fmt == GPU_BF16 && gpu_bf16_subnormals_made() &&
        block_subnormal(buf, rows, cols, cols))
        *subnormal = true;
    return buf;
}

/* Whether an operand the native plan reads in place holds a subnormal (one the conversions
 * wrote cannot while they have met none). */
static bool in_place_subnormal(const operand *o, bool is_a, bool conv, int dim, int K)
{
    int rows, cols;
    if (conv || o->dt != GPU_BF16 || (o->converted && !gpu_bf16_subnormals_made()))
        return false;
    const void *src = block_at(o, is_a, 0, dim, K, &rows, &cols);
    return block_subnormal(src, rows, cols, o->ld);
}

/* Whether an fp32 operand holds a subnormal (which could narrow to a bf16 subnormal). */
static bool f32_operand_subnormal(const operand *o, bool is_a, int dim, int K)
{
    int rows, cols;
    unsigned any = 0;
    const uint32_t *x = block_at(o, is_a, 0, dim, K, &rows, &cols);
#pragma omp parallel for reduction(| : any) if ((size_t)rows * cols >= GPU_PAR_MIN)
    for (int r = 0; r < rows; r++)
        any |= gpu_f32_has_subnormal(x + (size_t)r * (size_t)o->ld, (size_t)cols);
    return any != 0;
}

/* Whether the native plan must give way to the widened one before it starts: an operand it
 * reads in place holds a subnormal, or (with beta != 0, when C cannot be written twice) an
 * operand it converts does. Otherwise the conversions look as they go (SUBNORMAL). */
static bool native_refused(const gemm_plan *p, const operand *a, const operand *b, int M, int N,
                           int K, float beta)
{
    if (in_place_subnormal(a, true, p->conv_a, M, K) ||
        in_place_subnormal(b, false, p->conv_b, N, K))
        return true;
    if (beta == 0.0f)
        return false;
    return (p->conv_a && a->dt == GPU_FP32 && f32_operand_subnormal(a, true, M, K)) ||
           (p->conv_b && b->dt == GPU_FP32 && f32_operand_subnormal(b, false, N, K));
}

/* C's columns [.., + nr) (at C, leading dimension ldc) = A B_block + beta C: through the
 * dense buffer cbuf when the plan has one (copied in first when beta != 0). */
static int column_block(const gemm_plan *p, bool ta, bool tb, int M, int nr, int K,
                        const void *A, int lda, const void *B, int ldb, float beta, float *C,
                        int ldc, float *cbuf)
{
    if (p->c_el == 0)
        return lib_gemm(p->fmt, ta, tb, M, nr, K, A, lda, B, ldb, beta, C, ldc);
    size_t row = (size_t)nr * sizeof(float);
    if (beta != 0.0f)
        for (int i = 0; i < M; i++)
            memcpy(cbuf + (size_t)i * nr, C + (size_t)i * ldc, row);
    int rc = lib_gemm(p->fmt, ta, tb, M, nr, K, A, lda, B, ldb, beta, cbuf, nr);
#pragma omp parallel for if ((size_t)M * nr >= GPU_PAR_MIN) schedule(static)
    for (int i = 0; i < M; i++)
        memcpy(C + (size_t)i * ldc, cbuf + (size_t)i * nr, row);
    return rc;
}

/* The product as the plan says: the whole operand converted once, the streamed one block
 * by block. On the native plan, SUBNORMAL as soon as a converted block holds a subnormal or
 * oneDNN refuses a block's shape (C may then be partly written). */
static int run_plan(const gemm_plan *p, int M, int N, int K, const operand *a,
                    const operand *b, float beta, float *C, int ldc, float *scratch)
{
    size_t es = gpu_dtype_size(p->fmt);
    void *abuf = scratch;
    void *bbuf = (char *)scratch + (p->a_el * es + 63) / 64 * 64;
    float *cbuf = (float *)(void *)((char *)bbuf + (p->b_el * es + 63) / 64 * 64);
    int dim = p->stream_a ? M : N, step = p->conv_a || p->conv_b ? p->block : dim;
    int lda, ldb;
    bool sub = false;
    const void *wa = NULL, *wb = NULL;
    if (!p->stream_a)
        wa = prepare(a, true, p->conv_a, p, 0, M, K, abuf, &lda, &sub);
    else
        wb = prepare(b, false, p->conv_b, p, 0, N, K, bbuf, &ldb, &sub);
    for (int r0 = 0; r0 < dim; r0 += step) {
        int nr = dim - r0 < step ? dim - r0 : step, rc;
        if (p->stream_a)
            wa = prepare(a, true, p->conv_a, p, r0, nr, K, abuf, &lda, &sub);
        else
            wb = prepare(b, false, p->conv_b, p, r0, nr, K, bbuf, &ldb, &sub);
        if (sub)
            return SUBNORMAL;
        if (p->stream_a)
            rc = lib_gemm(p->fmt, a->t, b->t, nr, N, K, wa, lda, wb, ldb, beta,
                          C + (size_t)r0 * ldc, ldc);
        else
            rc = column_block(p, a->t, b->t, M, nr, K, wa, lda, wb, ldb, beta, C + r0, ldc,
                              cbuf);
        if (rc != 0)
            return p->fmt == GPU_BF16 && rc == GPU_EBLAS && (r0 == 0 || beta == 0.0f)
                       ? SUBNORMAL : rc;
    }
    return 0;
}

/* Rows [k0, k0 + kb) of op(B) (K x N), converted into buf; *ld: the leading dimension the
 * library reads them with. */
static const float *k_block(const operand *o, const gemm_plan *p, int k0, int kb, int N,
                            float *buf, int *ld)
{
    size_t es = gpu_dtype_size(o->dt);
    int rows = o->t ? N : kb, cols = o->t ? kb : N;
    const char *src = (const char *)o->p + (o->t ? (size_t)k0 : (size_t)k0 * o->ld) * es;
    convert(buf, p, src, o->dt, rows, cols, o->ld);
    *ld = cols;
    return buf;
}

/* The widened plan split along K: A in place or converted whole, B converted a block of K
 * at a time, each product as wide as C and added to it (beta for the first, then 1): no
 * narrow products, no copies of C. The sums group differently, still in fp32. */
static int run_split_k(const gemm_plan *p, int M, int N, int K, const operand *a,
                       const operand *b, float beta, float *C, int ldc, float *scratch)
{
    float *bbuf = scratch + (p->a_el * sizeof(float) + 63) / 64 * 16;
    int lda, ldb, rc = 0;
    bool sub = false;
    const float *wa = prepare(a, true, p->conv_a, p, 0, M, K, scratch, &lda, &sub);
    for (int k0 = 0; rc == 0 && k0 < K; k0 += p->block) {
        int kb = K - k0 < p->block ? K - k0 : p->block;
        const float *ak = wa + (a->t ? (size_t)k0 * (size_t)lda : (size_t)k0);
        const float *bk = k_block(b, p, k0, kb, N, bbuf, &ldb);
        rc = lib_gemm(GPU_FP32, a->t, b->t, M, N, kb, ak, lda, bk, ldb, k0 ? 1.0f : beta, C,
                      ldc);
    }
    return rc;
}

static int run(const gemm_plan *p, int M, int N, int K, const operand *a, const operand *b,
               float beta, float *C, int ldc, float *scratch)
{
    if (p->split_k)
        return run_split_k(p, M, N, K, a, b, beta, C, ldc, scratch);
    return run_plan(p, M, N, K, a, b, beta, C, ldc, scratch);
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

static atomic_size_t gave_way; /* native plans that gave way to the widened one */

size_t gpu_gemm_native_gave_way(void)
{
    return atomic_load(&gave_way);
}

/* A, B and C borrowed; C must not overlap A, B or scratch. scratch borrowed, scratch_floats
 * long: GPU_ESCRATCH, before anything is written, when the plan needs more (also when a
 * native plan would need it only on giving way). */
int gpu_gemm_ex(bool ta, bool tb, int M, int N, int K,
                const void *A, gpu_dtype adt, int lda,
                const void *B, gpu_dtype bdt, int ldb, gpu_dtype cdt, unsigned round,
                float beta, float *C, int ldc, float *scratch, size_t scratch_floats)
{
    int rc = check_args(ta, tb, M, N, K, A, adt, lda, B, bdt, ldb, C, ldc);
    if (rc != 0 || !dtype_ok(cdt))
        return rc != 0 ? rc : GPU_EINVAL;
    if (!cdt_ok(adt, bdt, cdt))
        cdt = GPU_FP32;
    if (M == 0 || N == 0)
        return 0;
    if (K == 0) {
        scale_c(M, N, beta, C, ldc);
        return 0;
    }
    rc = ensure_loaded();
    if (rc != 0)
        return rc;
    operand a = {A, adt, lda, ta, (round & GPU_GEMM_A_CONVERTED) != 0};
    operand b = {B, bdt, ldb, tb, (round & GPU_GEMM_B_CONVERTED) != 0};
    gemm_plan p = plan_of(M, N, K, adt, bdt, cdt, round);
    gemm_plan wide = plan_in(M, N, K, adt, bdt, cdt, round, GPU_FP32);
    size_t need = plans_floats(&p, &wide);
    if (need > 0 && (scratch == NULL || need > scratch_floats))
        return GPU_ESCRATCH;
    bool gave = p.fmt == GPU_BF16 && native_refused(&p, &a, &b, M, N, K, beta);
    if (gave)
        p = wide;
    rc = run(&p, M, N, K, &a, &b, beta, C, ldc, scratch);
    if (rc == SUBNORMAL) { /* nothing written yet, or beta 0: the widened plan writes all C */
        gave = true;
        rc = run(&wide, M, N, K, &a, &b, beta, C, ldc, scratch);
    }
    if (gave)
        atomic_fetch_add(&gave_way, 1);
    return rc;
}

int gpu_gemm(bool ta, bool tb, int M, int N, int K,
             const void *A, gpu_dtype adt, int lda,
             const void *B, gpu_dtype bdt, int ldb,
             float beta, float *C, int ldc, float *scratch, size_t scratch_floats)
{
    gpu_dtype cdt = dtype_ok(adt) && dtype_ok(bdt) ? exact_dtype(adt, bdt) : GPU_FP32;
    return gpu_gemm_ex(ta, tb, M, N, K, A, adt, lda, B, bdt, ldb, cdt, 0, beta, C, ldc,
                       scratch, scratch_floats);
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
