/*
 * cuda_comm.cu - the gradient all-reduce of a CUDA rank through NCCL, and the comm hooks'
 * kernels (the contract is in gpu/cuda/cuda_comm.h).
 *
 * Loading: libnccl is opened once per process with dlopen() ("libnccl.so.2", then
 * "libnccl.so", then the CUDA toolkit's lib64/ and lib/ copies) and its entry points are
 * resolved into a table typed from <nccl.h>, as cuda_blas.cu does for cuBLASLt: the program
 * never links against NCCL, and a rank on a machine without it fails with GPU_ENODEV and the
 * reason. Bootstrap as llm.c does it: rank 0 makes the unique id, the host's MPI broadcasts
 * it (the plan's bcast), every rank calls ncclCommInitRank on its own device.
 *
 * Hooks, per element, as gpu/comm.c computes them for the CPU ranks: NONE: g / N in fp32,
 * then ncclFloat SUM in place. FP16 / BF16: r = round16(g), q = round16(r / N) into the
 * bucket's 16-bit buffer, ncclHalf / ncclBfloat16 SUM in place (NCCL adds two 16-bit values
 * per hop and rounds the sum to 16 bits), then widened exactly into g. The division is IEEE
 * (nvcc's default -prec-div=true), so a bucket's values match the CPU's bit for bit. The
 * pre-hook check flags any inf/NaN (an all-ones exponent) in a device int.
 *
 * Streams: the communication stream is non-blocking; for bucket i it waits for an event the
 * compute stream records once backward has enqueued the bucket's last gradient kernel.
 * Buckets are started in index order on every rank (NCCL needs the same collectives in the
 * same order everywhere); a bucket is started only after all those before it, even if its
 * gradients were ready earlier. The compute stream waits for the last bucket (an event after
 * the flag's copy to pinned memory) before the unscale reads the gradients.
 *
 * Threads: the loader is guarded by pthread_once; a gpu_cuda_comm is driven by one thread.
 */
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "gpu/comm.h"
#include "gpu/cuda/cuda_comm.h"
#include "gpu/cuda/cuda_common.cuh"
#include "gpu/cuda/cuda_util.h"

/* ---- the library ------------------------------------------------------------------------- */

#define NCCL_FUNCS(X)                         \
    X(get_version, ncclGetVersion)            \
    X(unique_id, ncclGetUniqueId)             \
    X(init_rank, ncclCommInitRank)            \
    X(destroy, ncclCommDestroy)               \
    X(abort_comm, ncclCommAbort)              \
    X(all_reduce, ncclAllReduce)              \
    X(error_string, ncclGetErrorString)       \
    X(async_error, ncclCommGetAsyncError)

static struct {
    int rc;                 /* the one load: 0 or GPU_ENODEV */
    char why[320];
    char version[32];       /* "NCCL 2.28.3" */
#define NC_FIELD(field, fn) decltype(&fn) field;
    NCCL_FUNCS(NC_FIELD)
#undef NC_FIELD
} nc;

static pthread_once_t nc_once = PTHREAD_ONCE_INIT;

static const char *const nc_paths[] = {
    "libnccl.so.2", "libnccl.so", "/usr/local/cuda/lib64/libnccl.so.2",
    "/usr/local/cuda/lib/libnccl.so.2",
};

static void nc_load(void)
{
    void *lib = NULL;
    char first[256] = "";
    int v = 0;

    for (size_t i = 0; i < sizeof(nc_paths) / sizeof(nc_paths[0]) && lib == NULL; i++) {
        lib = dlopen(nc_paths[i], RTLD_NOW | RTLD_LOCAL);
        if (lib == NULL && i == 0) {
            const char *e = dlerror();
            snprintf(first, sizeof(first), "%s", e != NULL ? e : "dlopen failed");
        }
    }
    if (lib == NULL) {
        snprintf(nc.why, sizeof(nc.why), "libnccl.so.2 not found: %s", first);
        nc.rc = GPU_ENODEV;
        return;
    }
#define NC_SYM(field, fn)                                                                   \
    nc.field = reinterpret_cast<decltype(&fn)>(dlsym(lib, #fn));                            \
    if (nc.field == NULL) {                                                                 \
        snprintf(nc.why, sizeof(nc.why), "libnccl has no %s", #fn);                        \
        goto fail;                                                                          \
    }
    NCCL_FUNCS(NC_SYM)
#undef NC_SYM
    if (nc.get_version(&v) != ncclSuccess || v < 21000) {
        snprintf(nc.why, sizeof(nc.why), "NCCL %d is too old (2.10 or newer, for bf16)", v);
        goto fail;
    }
    /* 2.9 and later: major * 10000 + minor * 100 + patch */
    snprintf(nc.version, sizeof(nc.version), "NCCL %d.%d.%d", v / 10000, v / 100 % 100, v % 100);
    nc.rc = 0;
    return;
fail:
    dlclose(lib);
    nc.rc = GPU_ENODEV;
}

extern "C" const char *gpu_cuda_comm_version(void)
{
    pthread_once(&nc_once, nc_load);
    return nc.rc == 0 ? nc.version : "no NCCL";
}

/* ---- the hooks' kernels ------------------------------------------------------------------ */

#define HOOK_THREADS 256
#define HOOK_BLOCKS 1024

__device__ static __forceinline__ uint16_t narrow16(float x, bool fp16)
{
    uint32_t u = gpu_fmt_f2u(x);
    return fp16 ? gpu_fmt_f32_to_f16(u) : gpu_fmt_f32_to_bf16(u);
}

__device__ static __forceinline__ float widen16(uint16_t h, bool fp16)
{
    return gpu_fmt_u2f(fp16 ? gpu_fmt_f16_to_f32(h) : gpu_fmt_bf16_to_f32(h));
}

/* The hook's first half over g[0..n): flag inf/NaN, then g / N in place (half == NULL) or
 * round16(round16(g) / N) into half. */
static __global__ void __launch_bounds__(HOOK_THREADS)
hook_kernel(float *g, uint16_t *half, size_t n, float N, bool fp16, int *flag)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = g[i];
        if ((gpu_fmt_f2u(v) & 0x7F800000u) == 0x7F800000u)
            *flag = 1;
        if (half == NULL)
            g[i] = v / N;
        else
            half[i] = narrow16(widen16(narrow16(v, fp16), fp16) / N, fp16);
    }
}

static __global__ void __launch_bounds__(HOOK_THREADS)
widen_kernel(float *g, const uint16_t *half, size_t n, bool fp16)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        g[i] = widen16(half[i], fp16);
}

/* ---- the communicator -------------------------------------------------------------------- */

typedef struct {
    size_t lo, hi, ready;
    uint16_t *half;          /* FP16 / BF16: the bucket on the wire (device) */
    cudaEvent_t ev;          /* recorded on the compute stream when the bucket is complete */
} bucket;

struct gpu_cuda_comm {
    int world, rank;
    gpu_comm_hook hook;
    ncclComm_t nccl;
    bool have_nccl, failed;
    cudaStream_t compute, side;
    bool have_side;
    float *grads;
    bucket *b;
    int nb, next;
    void *block;             /* device: the flag, then the 16-bit buckets */
    int *flag, *h_flag;      /* pre-hook inf/NaN: device, pinned mirror */
    cudaEvent_t ev_start, ev_bwd, ev_end;
    int nev;                 /* of the three above, created */
    int64_t bytes;
    int err;                 /* the first failure of a ready call */
};

static int nccl_fail(gpu_cuda_comm *c, ncclResult_t r, const char *what)
{
    gpu_log(GPU_LOG_ERROR, "NCCL", "error %s (%d) (in %s)", nc.error_string(r), (int)r, what);
    c->failed = true;
    return GPU_ECOMM;
}

/* The unique id on every rank: made by rank 0, broadcast by the host. */
static int agree_id(const gpu_cuda_comm_plan *p, ncclUniqueId *id, char *err, size_t errlen)
{
    memset(id, 0, sizeof(*id));
    if (p->rank == 0) {
        ncclResult_t r = nc.unique_id(id);
        if (r != ncclSuccess) {
            snprintf(err, errlen, "ncclGetUniqueId: %s", nc.error_string(r));
            return GPU_ECOMM;
        }
    }
    if (p->world > 1 && (p->bcast == NULL || p->bcast(p->bcast_ctx, id, sizeof(*id)) != 0)) {
        snprintf(err, errlen, "rank %d: cannot receive NCCL's unique id from rank 0", p->rank);
        return GPU_ECOMM;
    }
    return 0;
}

static int make_buckets(gpu_cuda_comm *c, const gpu_cuda_comm_plan *p, size_t *bytes)
{
    int rc = 0;
    size_t total = GPU_CUDA_ALIGN;
    c->b = (bucket *)calloc((size_t)p->nbuckets, sizeof(*c->b));
    if (c->b == NULL)
        return GPU_ENOMEM;
    for (int i = 0; i < p->nbuckets; i++, c->nb++) {
        c->b[i].lo = p->lo[i];
        c->b[i].hi = p->hi[i];
        GPU_CUDA_TRY(cudaEventCreateWithFlags(&c->b[i].ev, cudaEventDisableTiming));
        if (p->hook != GPU_HOOK_NONE)
            total += gpu_align256((p->hi[i] - p->lo[i]) * sizeof(uint16_t));
    }
    GPU_CUDA_TRY(cudaMalloc(&c->block, total));
    c->flag = (int *)c->block;
    for (size_t i = 0, at = GPU_CUDA_ALIGN; p->hook != GPU_HOOK_NONE && i < (size_t)c->nb; i++) {
        c->b[i].half = (uint16_t *)((char *)c->block + at);
        at += gpu_align256((c->b[i].hi - c->b[i].lo) * sizeof(uint16_t));
    }
    GPU_CUDA_TRY(cudaMallocHost((void **)&c->h_flag, sizeof(int)));
    *bytes = total;
    return 0;
fail:
    return rc;
}

extern "C" int gpu_cuda_comm_create(const gpu_cuda_comm_plan *p, float *grads,
                                    cudaStream_t compute, gpu_cuda_comm **out, size_t *bytes,
                                    char *err, size_t errlen)
{
    ncclUniqueId id;
    ncclResult_t r;
    int rc = 0;
    gpu_cuda_comm *c;
    *out = NULL;
    pthread_once(&nc_once, nc_load);
    if (nc.rc != 0) {
        snprintf(err, errlen, "%s", nc.why);
        return nc.rc;
    }
    if ((c = (gpu_cuda_comm *)calloc(1, sizeof(*c))) == NULL)
        return GPU_ENOMEM;
    c->world = p->world;
    c->rank = p->rank;
    c->hook = p->hook;
    c->grads = grads;
    c->compute = compute;
    if ((rc = agree_id(p, &id, err, errlen)) != 0)
        goto fail;
    if ((r = nc.init_rank(&c->nccl, p->world, id, p->rank)) != ncclSuccess) {
        snprintf(err, errlen, "rank %d: ncclCommInitRank (%d ranks): %s", p->rank, p->world,
                 nc.error_string(r));
        rc = GPU_ECOMM;
        goto fail;
    }
    c->have_nccl = true;
    GPU_CUDA_TRY(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking));
    c->have_side = true;
    GPU_CUDA_TRY(cudaEventCreate(&c->ev_start));
    c->nev++;
    GPU_CUDA_TRY(cudaEventCreate(&c->ev_bwd));
    c->nev++;
    GPU_CUDA_TRY(cudaEventCreate(&c->ev_end));
    c->nev++;
    if ((rc = make_buckets(c, p, bytes)) != 0)
        goto fail;
    *out = c;
    return 0;
fail:
    if (rc == GPU_ECUDA)
        snprintf(err, errlen, "rank %d: cannot set up the gradient buckets on the device",
                 p->rank);
    gpu_cuda_comm_free(c);
    return rc;
}

extern "C" void gpu_cuda_comm_free(gpu_cuda_comm *c)
{
    if (c == NULL)
        return;
    if (c->have_nccl)
        (void)(c->failed ? nc.abort_comm(c->nccl) : nc.destroy(c->nccl));
    for (int i = 0; i < c->nb; i++)
        cudaEventDestroy(c->b[i].ev);
    cudaEvent_t ev[3] = {c->ev_start, c->ev_bwd, c->ev_end};
    for (int i = 0; i < c->nev; i++)
        cudaEventDestroy(ev[i]);
    if (c->have_side)
        cudaStreamDestroy(c->side);
    cudaFree(c->block);
    cudaFreeHost(c->h_flag);
    free(c->b);
    free(c);
}

/* ---- a step ------------------------------------------------------------------------------ */

extern "C" int gpu_cuda_comm_begin(gpu_cuda_comm *c)
{
    for (int i = 0; i < c->nb; i++)
        c->b[i].ready = 0;
    c->next = 0;
    c->bytes = 0;
    c->err = 0;
    GPU_CUDA_CHECK(cudaMemsetAsync(c->flag, 0, sizeof(int), c->compute));
    return 0;
}

static ncclDataType_t wire_type(gpu_comm_hook h)
{
    return h == GPU_HOOK_NONE ? ncclFloat32 : h == GPU_HOOK_FP16 ? ncclFloat16 : ncclBfloat16;
}

/* Bucket k onto the communication stream, behind backward's kernels for it. */
static int start(gpu_cuda_comm *c, bucket *k)
{
    size_t n = k->hi - k->lo;
    float *g = c->grads + k->lo;
    bool fp16 = c->hook == GPU_HOOK_FP16;
    unsigned blocks = gpu_cuda_blocks(n, HOOK_THREADS, HOOK_BLOCKS);
    void *wire = k->half != NULL ? (void *)k->half : (void *)g;
    ncclResult_t r;

    GPU_CUDA_CHECK(cudaEventRecord(k->ev, c->compute));
    GPU_CUDA_CHECK(cudaStreamWaitEvent(c->side, k->ev, 0));
    if (k == c->b)
        GPU_CUDA_CHECK(cudaEventRecord(c->ev_start, c->side));
    hook_kernel<<<blocks, HOOK_THREADS, 0, c->side>>>(g, k->half, n, (float)c->world, fp16,
                                                      c->flag);
    GPU_CUDA_CHECK(cudaGetLastError());
    if ((r = nc.all_reduce(wire, wire, n, wire_type(c->hook), ncclSum, c->nccl, c->side)) !=
        ncclSuccess)
        return nccl_fail(c, r, "ncclAllReduce (gradient bucket)");
    if (k->half != NULL) {
        widen_kernel<<<blocks, HOOK_THREADS, 0, c->side>>>(g, k->half, n, fp16);
        GPU_CUDA_CHECK(cudaGetLastError());
    }
    c->bytes += (int64_t)(n * (k->half != NULL ? sizeof(uint16_t) : sizeof(float)));
    return 0;
}

static void start_ready(gpu_cuda_comm *c)
{
    while (c->err == 0 && c->next < c->nb &&
           c->b[c->next].ready >= c->b[c->next].hi - c->b[c->next].lo)
        c->err = start(c, &c->b[c->next++]);
}

extern "C" void gpu_cuda_comm_ready(gpu_cuda_comm *c, size_t off, size_t count)
{
    for (int i = 0; i < c->nb; i++)
        c->b[i].ready += gpu_comm_overlap(c->b[i].lo, c->b[i].hi, off, count);
    start_ready(c);
}

extern "C" int gpu_cuda_comm_finish(gpu_cuda_comm *c)
{
    GPU_CUDA_CHECK(cudaEventRecord(c->ev_bwd, c->compute));
    while (c->err == 0 && c->next < c->nb)
        c->err = start(c, &c->b[c->next++]);
    if (c->err != 0)
        return c->err;
    if (c->nb == 0) /* nothing to reduce: the times are 0 */
        GPU_CUDA_CHECK(cudaEventRecord(c->ev_start, c->side));
    GPU_CUDA_CHECK(cudaMemcpyAsync(c->h_flag, c->flag, sizeof(int), cudaMemcpyDeviceToHost,
                                   c->side));
    GPU_CUDA_CHECK(cudaEventRecord(c->ev_end, c->side));
    GPU_CUDA_CHECK(cudaStreamWaitEvent(c->compute, c->ev_end, 0));
    return 0;
}

extern "C" int gpu_cuda_comm_max(gpu_cuda_comm *c, float *buf, size_t n)
{
    ncclResult_t r = nc.all_reduce(buf, buf, n, ncclFloat32, ncclMax, c->nccl, c->compute);
    return r == ncclSuccess ? 0 : nccl_fail(c, r, "ncclAllReduce (MAX)");
}

extern "C" int gpu_cuda_comm_result(gpu_cuda_comm *c, gpu_cuda_comm_stats *out, char *err,
                                    size_t errlen)
{
    float ms = 0.0f, exposed = 0.0f;
    ncclResult_t r = ncclSuccess;
    if (nc.async_error(c->nccl, &r) != ncclSuccess || r != ncclSuccess) {
        c->failed = true;
        snprintf(err, errlen, "rank %d: NCCL: %s", c->rank, nc.error_string(r));
        return GPU_ECOMM;
    }
    GPU_CUDA_CHECK(cudaEventElapsedTime(&ms, c->ev_start, c->ev_end));
    GPU_CUDA_CHECK(cudaEventElapsedTime(&exposed, c->ev_bwd, c->ev_end));
    out->bytes = c->bytes;
    out->ms = ms;
    out->exposed_ms = exposed < 0.0f ? 0.0 : exposed > ms ? ms : exposed;
    out->pre_nonfinite = *c->h_flag != 0;
    return 0;
}
