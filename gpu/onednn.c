/*
 * onednn.c - GEMMs on oneDNN's matmul primitive, opened at run time.
 *
 * oneDNN (Debian libdnnl2) has brgemm matmul kernels that beat OpenBLAS's sgemm on AVX-512
 * (213-221 against 156-173 GFLOP/s at the MLP's shapes on a 2-core AMD EPYC with AVX-512)
 * and multiply bf16 operands natively with fp32 accumulation where the CPU has AVX512_BF16
 * or AMX (392-435 GFLOP/s there, twice its fp32 rate). Like OpenBLAS (blas.c) the library
 * is opened with dlopen(), so a machine without it runs every GEMM on OpenBLAS.
 *
 * One matmul primitive per shape (dtype, transposes, sizes, leading dimensions, beta, the
 * thread count) is created on first use and kept in a fixed table, a refused shape too; a
 * shape that finds the table full gets a primitive for that call alone. Each primitive
 * uses a user-provided scratchpad: a per-thread buffer grown on demand, whose high-water
 * mark gpu_dnnl_peak() reports, so the trainer can count it as workspace. Each thread keeps
 * its last BOUND_SLOTS shapes bound to memory objects, so a call on a known shape only
 * points them at its operands and runs.
 *
 * Invariants: the library is loaded at most once per process and never closed; cached
 * primitives are never destroyed, so a looked-up primitive stays valid while it runs.
 * Only the brgemm implementations are taken (operands with their natural leading
 * dimensions): others are refused (GPU_EBLAS) and the caller goes to OpenBLAS or widens.
 * oneDNN 2.6's "gemm:jit" matmul, which it picks for padded leading dimensions, corrupted
 * the heap in the emulated CUDA suite, and its reference code is slow.
 *
 * Threads: any thread may call gpu_dnnl_gemm, also several at once (table lookups hold a
 * mutex; each thread has its own stream, scratchpad and bindings). oneDNN runs on the OpenMP
 * team of the calling thread (omp_set_num_threads); called inside a parallel region it runs
 * on one.
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

#include "gpu/gpu_int.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>

#ifndef AMPD_DNNL_PATH
#define AMPD_DNNL_PATH "libdnnl.so.2"
#endif

#define FN(name) __typeof__(dnnl_##name) *name
static struct {
    FN(engine_create);
    FN(stream_create);
    FN(stream_destroy);
    FN(stream_wait);
    FN(memory_desc_init_by_strides);
    FN(memory_desc_get_size);
    FN(matmul_desc_init);
    FN(primitive_attr_create);
    FN(primitive_attr_destroy);
    FN(primitive_attr_set_scratchpad_mode);
    FN(primitive_attr_set_post_ops);
    FN(post_ops_create);
    FN(post_ops_destroy);
    FN(post_ops_append_sum);
    FN(primitive_desc_create);
    FN(primitive_desc_destroy);
    FN(primitive_desc_query);
    FN(primitive_desc_query_md);
    FN(primitive_create);
    FN(primitive_destroy);
    FN(primitive_execute);
    FN(memory_create);
    FN(memory_destroy);
    FN(memory_set_data_handle);
    FN(version);
    FN(get_effective_cpu_isa);
} dn;
#undef FN

typedef struct {
    int dt, ta, tb, M, N, K, lda, ldb, ldc;
    float beta; /* C = A B + beta C: a sum post-op unless 0 */
    int threads; /* the team it runs on: a primitive (and its scratchpad) is made for one */
} prim_key;

typedef struct {
    prim_key key;
    dnnl_primitive_t prim;
    size_t scratch;
    bool used;
} prim_entry;

#define TABLE_SIZE 512 /* a power of two; a GPT step has a few dozen shapes */

static struct {
    int rc;                 /* result of the one load: 0 or GPU_EBLAS */
    void *lib;
    dnnl_engine_t engine;
    bool f32, bf16;         /* which dtypes have fast kernels here */
    char info[96];
    prim_entry table[TABLE_SIZE];
    int entries;
} st = {.rc = GPU_EBLAS};

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_key_t thread_key;
static atomic_size_t scratch_peak;

/* A primitive of the table bound to memory objects of its key's layouts, for one thread: a
 * call points the objects at its operands instead of creating and destroying four objects
 * (that, and the table's mutex, cost ~3 us a call: a quarter of a 128 x 128 x 64 bf16
 * product, of which a GPT step makes thousands in its attention heads). prim NULL: a key
 * oneDNN refused. */
typedef struct {
    prim_key key;
    dnnl_primitive_t prim; /* borrowed from the table, or owned when it was full */
    size_t scratch;
    dnnl_memory_t mem[4];  /* A, B, C, scratchpad */
    bool owned;
} bound;

#define BOUND_SLOTS 16 /* a GPT's heads use 6 shapes per thread, its linears a dozen */

typedef struct {
    dnnl_stream_t stream;
    void *scratch;
    size_t cap;
    bound slot[BOUND_SLOTS];
    int nslots;            /* slots in use */
    int next;              /* the slot a new key takes when all are in use */
} thread_state;

static void bound_clear(bound *b)
{
    for (int i = 0; i < 4; i++)
        if (b->mem[i] != NULL)
            dn.memory_destroy(b->mem[i]);
    if (b->owned)
        dn.primitive_destroy(b->prim);
    memset(b, 0, sizeof *b);
}

static void thread_state_free(void *p)
{
    thread_state *ts = p;
    if (ts == NULL)
        return;
    for (int i = 0; i < ts->nslots; i++)
        bound_clear(&ts->slot[i]);
    if (ts->stream != NULL)
        dn.stream_destroy(ts->stream);
    free(ts->scratch);
    free(ts);
}

/* The threads oneDNN runs a primitive on from here: one inside a parallel region. */
static int team(void)
{
#ifdef _OPENMP
    return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    return 1;
#endif
}

static const char *dnnl_path(void)
{
    const char *p = getenv("AMPD_ONEDNN");
    return p != NULL && p[0] != '\0' ? p : AMPD_DNNL_PATH;
}

static int load_symbols(void)
{
#define SYM(name)                                                             \
    do {                                                                      \
        *(void **)&dn.name = dlsym(st.lib, "dnnl_" #name);                    \
        if (dn.name == NULL)                                                  \
            return GPU_EBLAS;                                                 \
    } while (0)
    SYM(engine_create);
    SYM(stream_create);
    SYM(stream_destroy);
    SYM(stream_wait);
    SYM(memory_desc_init_by_strides);
    SYM(memory_desc_get_size);
    SYM(matmul_desc_init);
    SYM(primitive_attr_create);
    SYM(primitive_attr_destroy);
    SYM(primitive_attr_set_scratchpad_mode);
    SYM(primitive_attr_set_post_ops);
    SYM(post_ops_create);
    SYM(post_ops_destroy);
    SYM(post_ops_append_sum);
    SYM(primitive_desc_create);
    SYM(primitive_desc_destroy);
    SYM(primitive_desc_query);
    SYM(primitive_desc_query_md);
    SYM(primitive_create);
    SYM(primitive_destroy);
    SYM(primitive_execute);
    SYM(memory_create);
    SYM(memory_destroy);
    SYM(memory_set_data_handle);
    SYM(version);
    SYM(get_effective_cpu_isa);
#undef SYM
    return 0;
}

static const char *isa_name(dnnl_cpu_isa_t isa)
{
    if ((isa & dnnl_cpu_isa_avx512_core_amx) == dnnl_cpu_isa_avx512_core_amx)
        return "amx";
    if ((isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16)
        return "avx512_core_bf16";
    if ((isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core)
        return "avx512_core";
    if ((isa & dnnl_cpu_isa_avx2) == dnnl_cpu_isa_avx2)
        return "avx2";
    return "sse41";
}

/* AddressSanitizer builds turn off the sanitizer's tracking of dynamic TLS blocks, which
 * a process that has opened oneDNN trips over. GCC 12's runtime (Debian's libasan8; clang
 * 14's too) takes a block that starts 16 bytes past a page boundary for glibc 2.19-2.24's,
 * whose extent a {size, start} header in those 16 bytes gives. glibc 2.25 and later malloc
 * the block, and when ASan puts the chunk at a page boundary those bytes are ASan's own
 * chunk header: the thread's "DTLS" becomes a garbage range, which LeakSanitizer's tracer
 * scans at exit and dies on ("Tracer caught signal 11", "LeakSanitizer has encountered a
 * fatal error"; LSAN_OPTIONS=verbosity=1:log_threads=1 shows it as "DTLS n at" a range far
 * from any mapping). libdnnl.so, opened here, has 36 bytes of thread_local data that every
 * thread of its OpenMP team touches in a primitive, and a new thread's first small malloc
 * tends to start a page of ASan's allocator: a process whose primitives ran on two threads
 * or more crashes at exit nearly every time. Without the tracking the leak check still
 * reaches every block, as a heap chunk of its thread's DTV, so what a thread_local points to
 * stays reachable and leaks are reported as before. ASAN_OPTIONS set by the user override
 * this; the hook is in this file so that every program that can open oneDNN has it. */
#if defined(__SANITIZE_ADDRESS__)
#define AMPD_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AMPD_ASAN 1
#endif
#endif

#ifdef AMPD_ASAN
const char *__asan_default_options(void);

__attribute__((visibility("default"), used)) const char *__asan_default_options(void)
{
    return "intercept_tls_get_addr=0";
}
#endif

static void load(void)
{
    st.lib = dlopen(dnnl_path(), RTLD_NOW | RTLD_LOCAL);
    if (st.lib == NULL)
        return;
    if (load_symbols() != 0 || pthread_key_create(&thread_key, thread_state_free) != 0 ||
        dn.engine_create(&st.engine, dnnl_cpu, 0) != dnnl_success) {
        dlclose(st.lib);
        st.lib = NULL;
        return;
    }
    dnnl_cpu_isa_t isa = dn.get_effective_cpu_isa();
    const dnnl_version_t *v = dn.version();
    /* brgemm matmul needs AVX-512; below it oneDNN's f32 matmul is no faster than OpenBLAS */
    st.f32 = (isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
    st.bf16 = (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
    snprintf(st.info, sizeof st.info, "oneDNN %d.%d.%d (%s)", v->major, v->minor, v->patch,
             isa_name(isa));
    st.rc = 0;
}

int gpu_dnnl_init(void)
{
    pthread_once(&load_once, load);
    return st.rc;
}

bool gpu_dnnl_has(gpu_dtype dt)
{
    if (gpu_dnnl_init() != 0)
        return false;
    return dt == GPU_FP32 ? st.f32 : dt == GPU_BF16 ? st.bf16 : false;
}

const char *gpu_dnnl_info(void)
{
    return gpu_dnnl_init() == 0 ? st.info : NULL;
}

size_t gpu_dnnl_peak(void)
{
    return atomic_load(&scratch_peak);
}

static thread_state *thread_get(void)
{
    thread_state *ts = pthread_getspecific(thread_key);
    if (ts != NULL)
        return ts;
    ts = calloc(1, sizeof *ts);
    if (ts == NULL)
        return NULL;
    if (dn.stream_create(&ts->stream, st.engine, dnnl_stream_default_flags) != dnnl_success ||
        pthread_setspecific(thread_key, ts) != 0) {
        thread_state_free(ts);
        return NULL;
    }
    return ts;
}

static void *thread_scratch(thread_state *ts, size_t bytes)
{
    if (bytes <= ts->cap)
        return ts->scratch;
    void *p = realloc(ts->scratch, bytes);
    if (p == NULL)
        return NULL;
    ts->scratch = p;
    ts->cap = bytes;
    size_t old = atomic_load(&scratch_peak);
    while (bytes > old && !atomic_compare_exchange_weak(&scratch_peak, &old, bytes))
        ;
    return p;
}

/* The attributes of a primitive: user scratchpad, and C = A B + beta C when beta != 0. */
static dnnl_primitive_attr_t make_attr(float beta)
{
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    if (dn.primitive_attr_create(&attr) != dnnl_success)
        return NULL;
    if (dn.primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user) != dnnl_success)
        goto fail;
    if (beta != 0.0f) {
        if (dn.post_ops_create(&po) != dnnl_success || dn.post_ops_append_sum(po, beta) ||
            dn.primitive_attr_set_post_ops(attr, po) != dnnl_success)
            goto fail;
        dn.post_ops_destroy(po);
    }
    return attr;

fail:
    if (po != NULL)
        dn.post_ops_destroy(po);
    dn.primitive_attr_destroy(attr);
    return NULL;
}

/* Memory descriptors of A (M x K), B (K x N) and C (M x N) with the key's layout. */
static int make_descs(const prim_key *k, dnnl_memory_desc_t *a, dnnl_memory_desc_t *b,
                      dnnl_memory_desc_t *c)
{
    dnnl_data_type_t dt = k->dt == GPU_BF16 ? dnnl_bf16 : dnnl_f32;
    dnnl_dims_t da = {k->M, k->K}, db = {k->K, k->N}, dc = {k->M, k->N};
    dnnl_dims_t sa = {k->lda, 1}, sat = {1, k->lda}, sb = {k->ldb, 1}, sbt = {1, k->ldb};
    dnnl_dims_t sc = {k->ldc, 1};
    if (dn.memory_desc_init_by_strides(a, 2, da, dt, k->ta ? sat : sa) != dnnl_success ||
        dn.memory_desc_init_by_strides(b, 2, db, dt, k->tb ? sbt : sb) != dnnl_success ||
        dn.memory_desc_init_by_strides(c, 2, dc, dnnl_f32, sc) != dnnl_success)
        return GPU_EBLAS;
    return 0;
}

/* Create the primitive of a key; refuses oneDNN's reference implementations. */
static int create(const prim_key *k, dnnl_primitive_t *prim, size_t *scratch)
{
    dnnl_memory_desc_t a, b, c;
    dnnl_matmul_desc_t md;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_attr_t attr = NULL;
    const char *impl = NULL;
    int rc = make_descs(k, &a, &b, &c);
    if (rc != 0)
        return rc;
    rc = GPU_EBLAS;
    if (dn.matmul_desc_init(&md, &a, &b, NULL, &c) != dnnl_success ||
        (attr = make_attr(k->beta)) == NULL ||
        dn.primitive_desc_create(&pd, &md, attr, st.engine, NULL) != dnnl_success)
        goto fail;
    if (dn.primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) != dnnl_success ||
        impl == NULL || strncmp(impl, "brg", 3) != 0)
        goto fail;
    *scratch = dn.memory_desc_get_size(dn.primitive_desc_query_md(pd, dnnl_query_scratchpad_md,
                                                                  0));
    if (dn.primitive_create(prim, pd) != dnnl_success)
        goto fail;
    rc = 0;

fail:
    if (pd != NULL)
        dn.primitive_desc_destroy(pd);
    if (attr != NULL)
        dn.primitive_attr_destroy(attr);
    return rc;
}

static size_t key_hash(const prim_key *k)
{
    const unsigned char *b = (const unsigned char *)k;
    size_t h = 1469598103934665603u;
    for (size_t i = 0; i < sizeof *k; i++)
        h = (h ^ b[i]) * 1099511628211u;
    return h;
}

/* The cached primitive of k, created on first use; a refused key is remembered as such
 * (GPU_EBLAS at once). *owned: the caller must destroy it (the table was full). */
static int lookup(const prim_key *k, dnnl_primitive_t *prim, size_t *scratch, bool *owned)
{
    size_t i = key_hash(k) & (TABLE_SIZE - 1);
    int rc = 0;
    *owned = false;
    pthread_mutex_lock(&table_mu);
    while (st.table[i].used && memcmp(&st.table[i].key, k, sizeof *k) != 0)
        i = (i + 1) & (TABLE_SIZE - 1);
    if (st.table[i].used) {
        *prim = st.table[i].prim;
        *scratch = st.table[i].scratch;
        rc = *prim != NULL ? 0 : GPU_EBLAS;
    } else if (st.entries >= TABLE_SIZE / 2) {
        rc = create(k, prim, scratch);
        *owned = rc == 0;
    } else {
        rc = create(k, prim, scratch);
        st.table[i] = (prim_entry){.key = *k, .prim = rc == 0 ? *prim : NULL,
                                   .scratch = rc == 0 ? *scratch : 0, .used = true};
        st.entries++;
    }
    pthread_mutex_unlock(&table_mu);
    return rc;
}

/* b's memory objects for its key and primitive (b->key, prim, scratch and owned set). */
static int bound_init(bound *b)
{
    dnnl_memory_desc_t md[4];
    dnnl_dims_t sdim = {(dnnl_dim_t)(b->scratch > 0 ? b->scratch : 1)}, sstr = {1};
    if (b->prim == NULL)
        return 0;
    if (make_descs(&b->key, &md[0], &md[1], &md[2]) != 0 ||
        dn.memory_desc_init_by_strides(&md[3], 1, sdim, dnnl_u8, sstr) != dnnl_success)
        return GPU_EBLAS;
    for (int i = 0; i < 4; i++)
        if (dn.memory_create(&b->mem[i], &md[i], st.engine, DNNL_MEMORY_NONE) != dnnl_success)
            return GPU_EBLAS;
    return 0;
}

/* This thread's binding of key k, made on first use (with the table's primitive); NULL when
 * out of memory or the objects cannot be made. */
static bound *bind(thread_state *ts, const prim_key *k, int *rc)
{
    for (int i = 0; i < ts->nslots; i++)
        if (memcmp(&ts->slot[i].key, k, sizeof *k) == 0)
            return &ts->slot[i];
    int i = ts->nslots;
    if (i < BOUND_SLOTS) {
        ts->nslots++;
    } else {
        i = ts->next;
        ts->next = (i + 1) % BOUND_SLOTS;
    }
    bound *b = &ts->slot[i];
    bound_clear(b);
    b->key = *k;
    *rc = lookup(k, &b->prim, &b->scratch, &b->owned);
    if (*rc == GPU_EBLAS && b->prim == NULL) /* refused: remembered here too */
        return b;
    if (*rc == 0 && (*rc = bound_init(b)) == 0)
        return b;
    bound_clear(b); /* the slot stays in use, keyed by nothing a call makes */
    return NULL;
}

/* Run b's primitive on the caller's operands with this thread's stream and scratchpad. */
static int run_bound(thread_state *ts, const bound *b, const void *A, const void *B, float *C)
{
    void *pad = thread_scratch(ts, b->scratch > 0 ? b->scratch : 1);
    void *ptr[4] = {(void *)A, (void *)B, C, pad};
    const int arg[4] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST, DNNL_ARG_SCRATCHPAD};
    dnnl_exec_arg_t args[4];
    if (b->prim == NULL)
        return GPU_EBLAS;
    if (pad == NULL)
        return GPU_ENOMEM;
    for (int i = 0; i < 4; i++) {
        if (dn.memory_set_data_handle(b->mem[i], ptr[i]) != dnnl_success)
            return GPU_EBLAS;
        args[i] = (dnnl_exec_arg_t){arg[i], b->mem[i]};
    }
    if (dn.primitive_execute(b->prim, ts->stream, 4, args) != dnnl_success ||
        dn.stream_wait(ts->stream) != dnnl_success)
        return GPU_EBLAS;
    return 0;
}

int gpu_dnnl_gemm(gpu_dtype dt, bool ta, bool tb, int M, int N, int K, const void *A, int lda,
                  const void *B, int ldb, float beta, float *C, int ldc)
{
    if (!gpu_dnnl_has(dt))
        return GPU_EBLAS;
    prim_key k = {dt, ta, tb, M, N, K, lda, ldb, ldc, beta, team()};
    thread_state *ts = thread_get();
    int rc = GPU_ENOMEM;
    bound *b = ts != NULL ? bind(ts, &k, &rc) : NULL;
    return b != NULL ? run_bound(ts, b, A, B, C) : rc;
}

#else /* !HAVE_ONEDNN */

int gpu_dnnl_init(void)
{
    return GPU_EBLAS;
}

bool gpu_dnnl_has(gpu_dtype dt)
{
    (void)dt;
    return false;
}

const char *gpu_dnnl_info(void)
{
    return NULL;
}

size_t gpu_dnnl_peak(void)
{
    return 0;
}

int gpu_dnnl_gemm(gpu_dtype dt, bool ta, bool tb, int M, int N, int K, const void *A, int lda,
                  const void *B, int ldb, float beta, float *C, int ldc)
{
    (void)dt, (void)ta, (void)tb, (void)M, (void)N, (void)K, (void)A, (void)lda, (void)B;
    (void)ldb, (void)beta, (void)C, (void)ldc;
    return GPU_EBLAS;
}

#endif
