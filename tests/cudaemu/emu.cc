/*
 * emu.cc - a CUDA device emulated on the CPU, so that the CUDA backend's kernels and the
 * host code that drives them (gpu/cuda/cuda_*.cu, gpu/cuda/cuda_*.c, and the tests'
 * wrappers in tests/cudahost) run and are checked on machines without a GPU. It is a test
 * tool: it tells whether the code computes what the tests expect (indexing, reductions, launch
 * shapes, the host/device protocol), not how fast it runs or whether it has data races that
 * only a real GPU's scheduling would expose.
 *
 * What it models:
 *  - Kernels: a launch runs every block of the grid, one after another; the threads of a
 *    block are cooperative fibers (own stacks, switched in user space). A thread runs until
 *    it finishes or reaches __syncthreads, __syncwarp or a warp shuffle; a barrier opens
 *    when every live thread of the block (or every live lane of the mask) has arrived, and
 *    a barrier that can never open (threads of one block waiting at different barriers) is
 *    reported as a deadlock and aborts. Launch shapes are checked as the runtime checks them
 *    (1..1024 threads, grid limits) and a bad one is a sticky cudaGetLastError error.
 *    Each opening of a full-warp barrier gets a number, unique in the process, that the lanes
 *    it releases can ask for (emu_warp_shared), with a scratch area per warp: the tensor-core
 *    instruction (ptx_mma.h) passes the lanes' fragments through it.
 *  - Memory: each cudaMalloc is its own mapping with an inaccessible page right after the
 *    allocation (256-byte granularity) and one before it, and every device page is
 *    PROT_NONE while host code runs: a kernel that writes past its buffer and host code that
 *    dereferences a device pointer both fault, and the SIGSEGV handler names the allocation
 *    before the default action (or the sanitizer's) runs. Inside the device's code (kernels,
 *    copies, the emulated libraries) an allocation is opened on its first touch by that
 *    handler and closed again when the device's work returns, so that a launch costs
 *    system calls only for the allocations it uses. Copies, memsets, cuBLASLt operands
 *    and CUB buffers must lie inside one allocation, or the call fails with a message.
 *    The device's memory is $AMPD_CUDAEMU_MEMORY bytes (default 16 GiB); its count is
 *    $AMPD_CUDAEMU_DEVICES (default 1; 0 makes cudaGetDeviceCount fail with
 *    cudaErrorNoDevice, as without a driver), of which a process sees those that
 *    $CUDA_VISIBLE_DEVICES lists, as the driver does (indices up to the first that does
 *    not exist). $AMPD_CUDAEMU_SM is its compute capability x 10 (default 90, an H100's;
 *    80 makes it an A100 without fp8). $AMPD_CUDAEMU_STATS=1 prints, at exit, each
 *    kernel's launches, threads, suspensions and seconds.
 *  - Order: blocks run in index order and threads start in index order, unless
 *    $AMPD_CUDAEMU_SHUFFLE is a seed: then every launch runs its blocks, and starts the
 *    threads of each block, in an order drawn from it, as a GPU gives no order. A kernel
 *    whose results depend on that order (float atomics, "first block wins" logic) then
 *    gives different bits under different seeds. Under a seed, too, the lanes a warp
 *    barrier (a shuffle, __syncwarp, a tensor-core instruction) releases run next, ahead of
 *    the block's other warps, so that a missing __syncthreads between one warp's writes to
 *    shared memory and another's reads shows as stale data.
 *  - Streams and events: work runs when it is enqueued, so every stream is always idle;
 *    events record the host's monotonic clock. A stream may wait only for a recorded
 *    event, and only events made with timing are timed (what a GPU would get wrong).
 *  - NCCL: nccl.cc, a stand-in over MPI that the emulated dlopen hands out (see there).
 *
 * Invariants: all state is behind one recursive lock (API calls and kernels are serialised);
 * outside every emu_device_begin/end pair all device pages are PROT_NONE (an allocation
 * opened inside is closed again by the outermost emu_device_end).
 *
 * Threads: any thread may call the API; one runs at a time.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <map>
#include <set>
#include <string>

#include "cuda_runtime.h"
#include "tests/cudaemu/emu.h"

#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/common_interface_defs.h>
#endif

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

/* ---- state --------------------------------------------------------------------------------- */

struct alloc {
    char *map;          /* the mapping: guard page, pages of the allocation, guard page */
    size_t maplen;
    size_t size;        /* bytes asked for */
    size_t body;        /* bytes of the pages between the guards */
    bool open;          /* readable and writable until the device's work returns */
};

static pthread_mutex_t lock;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static std::map<uintptr_t, alloc> *allocs;    /* by user address */
static std::set<void *> *hosts;               /* cudaHostAlloc blocks */
static std::set<void *> *streams, *events;
static size_t used, total;
static int ndevices, current;
static volatile int open_depth;               /* emu_device_begin nesting: > 0 in device code */
static bool protect = true;
static cudaError_t last_error;
static size_t page;
static unsigned long long shuffle;     /* $AMPD_CUDAEMU_SHUFFLE; 0: index order */
static int sm = 90;                    /* $AMPD_CUDAEMU_SM: the compute capability, x10 */
static struct sigaction old_segv;

struct kstat {
    unsigned long long launches, threads, suspends;
    double seconds;
};
static std::map<std::string, kstat> *stats;    /* by kernel name, with $AMPD_CUDAEMU_STATS */

static void print_stats(void)
{
    fprintf(stderr, "cudaemu: %-40s %9s %12s %12s %9s\n", "kernel", "launches", "threads",
            "suspends", "seconds");
    for (auto &kv : *stats)
        fprintf(stderr, "cudaemu: %-40s %9llu %12llu %12llu %9.3f\n", kv.first.c_str(),
                kv.second.launches, kv.second.threads, kv.second.suspends, kv.second.seconds);
}

/* The emulator keeps one core busy while OpenBLAS's idle workers (the emulated cuBLASLt and
 * the CPU reference use them) would spin for 2^28 cycles on the others before sleeping:
 * make them sleep at once, unless the user chose otherwise. Runs before main(). */
__attribute__((constructor)) static void quiet_blas(void)
{
    setenv("OPENBLAS_THREAD_TIMEOUT", "4", 0);
}

void emu_report(const char *fmt, ...)
{
    va_list ap;
    fputs("cudaemu: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* The allocation whose mapping (guards included) holds p, or NULL. Lock held. */
static const alloc *mapping_of(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    auto it = allocs->upper_bound(a + 2 * page);  /* a user address is < 2 pages in */
    while (it != allocs->begin()) {
        --it;
        const alloc &m = it->second;
        if (a >= (uintptr_t)m.map && a < (uintptr_t)m.map + m.maplen)
            return &m;
        if ((uintptr_t)m.map + m.maplen + 2 * page < a)
            break;
    }
    return NULL;
}

/* In device code, a touch of a closed allocation opens it (any thread: OpenBLAS's run the
 * emulated GEMMs); anything else is reported and handed to the previous handler. */
static void on_segv(int sig, siginfo_t *si, void *ctx)
{
    (void)sig;
    (void)ctx;
    alloc *m = allocs != NULL ? (alloc *)mapping_of(si->si_addr) : NULL;
    if (m != NULL) {
        char *user = m->map + page + (m->body - ((m->size + 255) & ~(size_t)255));
        char *a = (char *)si->si_addr;
        bool inside = a >= m->map + page && a < m->map + page + m->body;
        if (inside && open_depth > 0 &&
            mprotect(m->map + page, m->body, PROT_READ | PROT_WRITE) == 0) {
            m->open = true;
            return;
        }
        if (a >= user && a < user + m->size)
            emu_report("host code touched device memory at %p (allocation %p, %zu bytes): "
                       "on a GPU this is an illegal access", (void *)a, (void *)user, m->size);
        else
            emu_report("access at %p outside the device allocation %p (%zu bytes): %td bytes "
                       "%s it", (void *)a, (void *)user, m->size,
                       a < user ? user - a : a - (user + m->size), a < user ? "before" : "past");
    }
    sigaction(SIGSEGV, &old_segv, NULL);    /* return: the access faults again, as before */
}

/* How many of the machine's n devices this process sees: $CUDA_VISIBLE_DEVICES, when set,
 * lists indices, and the list ends at the first that is not a device (as the driver reads
 * it); the process sees them renumbered from 0. */
static int visible(int n)
{
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    int k = 0;
    if (v == NULL)
        return n;
    while (*v) {
        char *end;
        long i = strtol(v, &end, 10);
        if (end == v || i < 0 || i >= n)
            break;
        k++;
        v = *end == ',' ? end + 1 : end;
        if (*end != ',' && *end != '\0')
            break;
    }
    return k;
}

static void init(void)
{
    pthread_mutexattr_t at;
    pthread_mutexattr_init(&at);
    pthread_mutexattr_settype(&at, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&lock, &at);
    allocs = new std::map<uintptr_t, alloc>();
    hosts = new std::set<void *>();
    streams = new std::set<void *>();
    events = new std::set<void *>();
    page = (size_t)sysconf(_SC_PAGESIZE);
    const char *e = getenv("AMPD_CUDAEMU_MEMORY");
    total = e != NULL ? strtoull(e, NULL, 10) : (size_t)16 << 30;
    e = getenv("AMPD_CUDAEMU_DEVICES");
    ndevices = visible(e != NULL ? atoi(e) : 1);
    e = getenv("AMPD_CUDAEMU_SM");
    if (e && atoi(e) >= 10 && atoi(e) <= 129)
        sm = atoi(e);
    e = getenv("AMPD_CUDAEMU_STATS");
    if (e != NULL && strcmp(e, "1") == 0) {
        stats = new std::map<std::string, kstat>();
        atexit(print_stats);
    }
    e = getenv("AMPD_CUDAEMU_SHUFFLE");
    shuffle = e != NULL ? strtoull(e, NULL, 10) : 0;
    e = getenv("AMPD_CUDAEMU_PROTECT");
    protect = e == NULL || strcmp(e, "0") != 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
}

static void enter(void)
{
    pthread_once(&once, init);
    pthread_mutex_lock(&lock);
}

static void leave(void)
{
    pthread_mutex_unlock(&lock);
}

void emu_device_begin(void)
{
    enter();
    open_depth = open_depth + 1;
}

/* Close the allocations the device's work opened. */
void emu_device_end(void)
{
    open_depth = open_depth - 1;
    if (open_depth == 0 && protect)
        for (auto &kv : *allocs)
            if (kv.second.open) {
                mprotect(kv.second.map + page, kv.second.body, PROT_NONE);
                kv.second.open = false;
            }
    leave();
}

int emu_device_span(const void *p, size_t n)
{
    enter();
    uintptr_t a = (uintptr_t)p;
    int rc = -1;
    auto it = allocs->upper_bound(a);
    if (p != NULL && it != allocs->begin()) {
        --it;
        if (a >= it->first && n <= it->second.size && a - it->first <= it->second.size - n)
            rc = 0;
    }
    leave();
    return rc;
}

static bool is_device(const void *p)
{
    return emu_device_span(p, 1) == 0;
}

static cudaError_t fail(cudaError_t e)
{
    last_error = e;
    return e;
}

/* ---- device -------------------------------------------------------------------------------- */

extern "C" cudaError_t cudaGetDeviceCount(int *count)
{
    enter();
    *count = ndevices > 0 ? ndevices : 0;
    cudaError_t e = ndevices > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
    leave();
    return e;
}

extern "C" cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
    enter();
    cudaError_t e = cudaSuccess;
    if (device < 0 || device >= ndevices) {
        e = fail(cudaErrorInvalidDevice);
    } else {
        memset(prop, 0, sizeof(*prop));
        snprintf(prop->name, sizeof(prop->name), "ampd CUDA emulator (CPU)");
        prop->totalGlobalMem = total;
        prop->sharedMemPerBlock = 48 << 10;
        prop->warpSize = 32;
        prop->maxThreadsPerBlock = 1024;
        prop->major = sm / 10; /* $AMPD_CUDAEMU_SM (default 90: an H100's sm_90) */
        prop->minor = sm % 10;
        prop->multiProcessorCount = 132;
    }
    leave();
    return e;
}

extern "C" cudaError_t cudaSetDevice(int device)
{
    enter();
    cudaError_t e = device >= 0 && device < ndevices ? cudaSuccess : fail(cudaErrorInvalidDevice);
    if (e == cudaSuccess)
        current = device;
    leave();
    return e;
}

extern "C" cudaError_t cudaGetDevice(int *device)
{
    enter();
    *device = current;
    leave();
    return ndevices > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}

extern "C" cudaError_t cudaDeviceSynchronize(void)
{
    return cudaSuccess;
}

extern "C" cudaError_t cudaGetLastError(void)
{
    enter();
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    leave();
    return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void)
{
    return last_error;
}

extern "C" const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    }
    return "cudaErrorUnknown";
}

extern "C" const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    }
    return "unknown error";
}

/* ---- memory -------------------------------------------------------------------------------- */

extern "C" cudaError_t cudaMalloc(void **p, size_t size)
{
    enter();
    cudaError_t e = cudaSuccess;
    size_t rounded = (size + 255) & ~(size_t)255;
    size_t body = (rounded + page - 1) / page * page;
    if (size == 0) {
        *p = NULL;
    } else if (size > total || used + body > total) {
        e = fail(cudaErrorMemoryAllocation);
    } else {
        size_t maplen = body + 2 * page;
        char *m = (char *)mmap(NULL, maplen, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            e = fail(cudaErrorMemoryAllocation);
        } else {
            char *user = m + page + (body - rounded);
            alloc a = {m, maplen, size, body, false};
            (*allocs)[(uintptr_t)user] = a;
            if (!protect)
                mprotect(m + page, body, PROT_READ | PROT_WRITE);
            used += body;
            *p = user;
        }
    }
    leave();
    return e;
}

extern "C" cudaError_t cudaFree(void *p)
{
    if (p == NULL)
        return cudaSuccess;
    enter();
    cudaError_t e = cudaSuccess;
    auto it = allocs->find((uintptr_t)p);
    if (it == allocs->end()) {
        emu_report("cudaFree(%p): not a device allocation", p);
        e = fail(cudaErrorInvalidDevicePointer);
    } else {
        munmap(it->second.map, it->second.maplen);
        used -= it->second.body;
        allocs->erase(it);
    }
    leave();
    return e;
}

extern "C" cudaError_t cudaHostAlloc(void **p, size_t size, unsigned int flags)
{
    (void)flags;
    enter();
    *p = malloc(size ? size : 1);
    cudaError_t e = *p != NULL ? cudaSuccess : fail(cudaErrorMemoryAllocation);
    if (*p != NULL)
        hosts->insert(*p);
    leave();
    return e;
}

extern "C" cudaError_t cudaMallocHost(void **p, size_t size)
{
    return cudaHostAlloc(p, size, 0);
}

extern "C" cudaError_t cudaFreeHost(void *p)
{
    if (p == NULL)
        return cudaSuccess;
    enter();
    cudaError_t e = cudaSuccess;
    if (hosts->erase(p) == 0) {
        emu_report("cudaFreeHost(%p): not a cudaHostAlloc block", p);
        e = fail(cudaErrorInvalidValue);
    } else {
        free(p);
    }
    leave();
    return e;
}

extern "C" cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    enter();
    *free_bytes = total - used;
    *total_bytes = total;
    leave();
    return cudaSuccess;
}

static bool stream_ok(cudaStream_t s)
{
    enter();
    bool ok = s == NULL || streams->count((void *)s) > 0;
    leave();
    if (!ok)
        emu_report("stream %p was never created (or was destroyed)", (void *)s);
    return ok;
}

/* Whether [p, p + n) is where kind says: device memory inside one allocation, or host
 * memory (not device memory) for the host side. n == 0 is always fine. */
static bool side_ok(const void *p, size_t n, bool device, const char *what)
{
    if (n == 0)
        return true;
    if (device && emu_device_span(p, n) != 0) {
        emu_report("%s: [%p, +%zu) is not inside one device allocation", what, p, n);
        return false;
    }
    if (!device && (p == NULL || is_device(p))) {
        emu_report("%s: %p is %s, not host memory", what, p, p == NULL ? "NULL" : "device memory");
        return false;
    }
    return true;
}

/* Whether a copy of kind may touch dst's and src's spans (cudaMemcpyDefault: as the
 * pointers say). what names the call in the message. */
static cudaError_t copy_ok(void *dst, size_t dn, const void *src, size_t sn,
                           enum cudaMemcpyKind kind, const char *what)
{
    char name[64];
    if (kind == cudaMemcpyDefault)
        kind = is_device(dst) ? (is_device(src) ? cudaMemcpyDeviceToDevice
                                                : cudaMemcpyHostToDevice)
                              : (is_device(src) ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    if ((int)kind < 0 || (int)kind > 3)
        return cudaErrorInvalidMemcpyDirection;
    bool dd = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    bool sd = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    snprintf(name, sizeof(name), "%s destination", what);
    if (!side_ok(dst, dn, dd, name))
        return cudaErrorInvalidValue;
    snprintf(name, sizeof(name), "%s source", what);
    return side_ok(src, sn, sd, name) ? cudaSuccess : cudaErrorInvalidValue;
}

extern "C" cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind)
{
    cudaError_t e = copy_ok(dst, n, src, n, kind, "cudaMemcpy");
    if (e != cudaSuccess)
        return fail(e);
    emu_device_begin();
    if (n > 0)
        memmove(dst, src, n);
    emu_device_end();
    return cudaSuccess;
}

extern "C" cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n,
                                       enum cudaMemcpyKind kind, cudaStream_t stream)
{
    if (!stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    return cudaMemcpy(dst, src, n, kind);
}

/* height rows of width bytes, pitches apart; each side must lie in one allocation. */
extern "C" cudaError_t cudaMemcpy2D(void *dst, size_t dpitch, const void *src, size_t spitch,
                                    size_t width, size_t height, enum cudaMemcpyKind kind)
{
    if (width > dpitch || width > spitch) {
        emu_report("cudaMemcpy2D: width %zu exceeds a pitch (%zu, %zu)", width, dpitch, spitch);
        return fail(cudaErrorInvalidValue);
    }
    if (width == 0 || height == 0)
        return cudaSuccess;
    cudaError_t e = copy_ok(dst, (height - 1) * dpitch + width, src,
                            (height - 1) * spitch + width, kind, "cudaMemcpy2D");
    if (e != cudaSuccess)
        return fail(e);
    emu_device_begin();
    for (size_t r = 0; r < height; r++)
        memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    emu_device_end();
    return cudaSuccess;
}

extern "C" cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src,
                                         size_t spitch, size_t width, size_t height,
                                         enum cudaMemcpyKind kind, cudaStream_t stream)
{
    if (!stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    return cudaMemcpy2D(dst, dpitch, src, spitch, width, height, kind);
}

extern "C" cudaError_t cudaMemset(void *p, int value, size_t n)
{
    if (!side_ok(p, n, true, "cudaMemset"))
        return fail(cudaErrorInvalidValue);
    emu_device_begin();
    if (n > 0)
        memset(p, value, n);
    emu_device_end();
    return cudaSuccess;
}

extern "C" cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t stream)
{
    if (!stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    return cudaMemset(p, value, n);
}

/* ---- streams and events -------------------------------------------------------------------- */

struct emu_event {
    bool recorded;
    bool untimed;       /* cudaEventDisableTiming */
    struct timespec t;
};

extern "C" cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags)
{
    (void)flags;
    enter();
    void *h = malloc(1);
    streams->insert(h);
    *s = (cudaStream_t)h;
    leave();
    return cudaSuccess;
}

extern "C" cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}

extern "C" cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    enter();
    cudaError_t e = cudaSuccess;
    if (s == NULL || streams->erase((void *)s) == 0)
        e = fail(cudaErrorInvalidResourceHandle);
    else
        free((void *)s);
    leave();
    return e;
}

extern "C" cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    return stream_ok(s) ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}

extern "C" cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned int flags)
{
    enter();
    emu_event *e = (emu_event *)calloc(1, sizeof(*e));
    e->untimed = (flags & cudaEventDisableTiming) != 0;
    events->insert(e);
    *ev = (cudaEvent_t)e;
    leave();
    return cudaSuccess;
}

extern "C" cudaError_t cudaEventCreate(cudaEvent_t *ev)
{
    return cudaEventCreateWithFlags(ev, cudaEventDefault);
}

static emu_event *event_of(cudaEvent_t ev)
{
    enter();
    emu_event *e = events->count((void *)ev) ? (emu_event *)ev : NULL;
    leave();
    return e;
}

extern "C" cudaError_t cudaEventDestroy(cudaEvent_t ev)
{
    enter();
    cudaError_t e = cudaSuccess;
    if (events->erase((void *)ev) == 0)
        e = fail(cudaErrorInvalidResourceHandle);
    else
        free((void *)ev);
    leave();
    return e;
}

extern "C" cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t stream)
{
    emu_event *e = event_of(ev);
    if (e == NULL || !stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    clock_gettime(CLOCK_MONOTONIC, &e->t);
    e->recorded = true;
    return cudaSuccess;
}

/* Work runs when it is enqueued, so the event has happened; it must have been recorded. */
extern "C" cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t ev, unsigned int flags)
{
    emu_event *e = event_of(ev);
    (void)flags;
    if (e == NULL || !stream_ok(stream))
        return fail(cudaErrorInvalidResourceHandle);
    if (!e->recorded) { /* CUDA treats it as done; a wait on nothing is a bug here */
        emu_report("cudaStreamWaitEvent: event %p was never recorded", (void *)ev);
        return fail(cudaErrorInvalidResourceHandle);
    }
    return cudaSuccess;
}

extern "C" cudaError_t cudaEventSynchronize(cudaEvent_t ev)
{
    return event_of(ev) != NULL ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}

extern "C" cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    emu_event *a = event_of(start), *b = event_of(end);
    if (a == NULL || b == NULL || !a->recorded || !b->recorded)
        return fail(cudaErrorInvalidResourceHandle);
    if (a->untimed || b->untimed) {
        emu_report("cudaEventElapsedTime: an event was created with cudaEventDisableTiming");
        return fail(cudaErrorInvalidResourceHandle);
    }
    *ms = (float)((double)(b->t.tv_sec - a->t.tv_sec) * 1e3 +
                  (double)(b->t.tv_nsec - a->t.tv_nsec) / 1e6);
    return cudaSuccess;
}

/* ---- fibers -------------------------------------------------------------------------------- */

#define EMU_MAX_THREADS 1024
#define EMU_STACK (128u << 10)

enum { F_READY, F_BLOCK, F_WARP, F_DONE };

struct fiber {
    void *sp;           /* saved stack pointer while suspended */
    int state;
    unsigned mask;      /* F_WARP: the lanes it waits for */
    uint3 tid;
    void *fake;         /* ASan's fake stack while switched out */
    int parity;         /* which slots buffer its next exchange uses */
    int stack;          /* its stack while it runs or waits, else -1 */
    unsigned long long gen;     /* the full-warp barrier that last released it, else 0 */
};

static fiber fibers[EMU_MAX_THREADS];
static uint64_t slots[2][EMU_MAX_THREADS];    /* warp exchanges, double-buffered */
static unsigned long long warp_gen;           /* full-warp barriers opened so far */
/* per warp: what its lanes share in a collective call (emu_warp_shared) */
alignas(64) static unsigned char warp_shared[EMU_MAX_THREADS / 32][EMU_WARP_SHARED];
static char *stacks;                /* EMU_MAX_THREADS stacks, a guard page below each */
static int nfib, cur;
static void *sched_sp;
#ifdef __SANITIZE_ADDRESS__
static void *sched_fake;        /* ASan's bookkeeping of the stack switches */
static const void *main_bottom;
static size_t main_size;
#endif
static unsigned long long nsuspend;    /* suspensions since the launch began */
static void (*body_fn)(void *);
static void *body_arg;
static const char *kernel_name;

#if defined(__x86_64__)
/* Save the callee-saved registers on the current stack, store the stack pointer in *save,
 * switch to the stack `to` and restore what was saved there. */
extern "C" void emu_ctx_switch(void **save, void *to);
__asm__(".text\n"
        ".globl emu_ctx_switch\n"
        ".type emu_ctx_switch,@function\n"
        "emu_ctx_switch:\n"
        "    pushq %rbp\n"
        "    pushq %rbx\n"
        "    pushq %r12\n"
        "    pushq %r13\n"
        "    pushq %r14\n"
        "    pushq %r15\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    popq %r15\n"
        "    popq %r14\n"
        "    popq %r13\n"
        "    popq %r12\n"
        "    popq %rbx\n"
        "    popq %rbp\n"
        "    ret\n"
        ".size emu_ctx_switch, .-emu_ctx_switch\n"
        ".section .note.GNU-stack,\"\",@progbits\n"
        ".text\n");
#else
#error "the CUDA emulator's context switch is written for x86-64"
#endif

static void to_scheduler(bool finished)
{
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_start_switch_fiber(finished ? NULL : &fibers[cur].fake, main_bottom, main_size);
#else
    (void)finished;
#endif
    emu_ctx_switch(&fibers[cur].sp, sched_sp);
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(fibers[cur].fake, &main_bottom, &main_size);
#endif
}

static bool next_thread(void);

/* A fiber runs threads until one waits: when a thread finishes and the next in the queue
 * has not started, that one runs on the same stack without a switch. */
static void fiber_main(void)
{
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(NULL, &main_bottom, &main_size);
#endif
    do
        body_fn(body_arg);
    while (next_thread());
    to_scheduler(true);
    abort();    /* never resumed */
}

static char *stack_of(int i)
{
    return stacks + (size_t)i * (EMU_STACK + page) + page;
}

/* Stacks are handed out when a thread starts and taken back when it finishes, last in
 * first out: threads that never wait all run on one warm stack. */
static int free_stacks[EMU_MAX_THREADS];
static int nfree;

/* Thread i starts: give it a stack with fiber_main's address to return into, then zeroed
 * registers. */
static void fiber_start(int i)
{
    int st = free_stacks[--nfree];
    fibers[i].stack = st;
    /* the tops are staggered so that the threads' hot frames do not share cache sets */
    uintptr_t top = ((uintptr_t)stack_of(st) + EMU_STACK - (uintptr_t)(st % 61) * 64) &
                    ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = NULL;                       /* fiber_main's return address: never used */
    *--sp = (void *)fiber_main;
    for (int r = 0; r < 6; r++)
        *--sp = NULL;
    fibers[i].sp = sp;
    fibers[i].fake = NULL;
    fibers[i].parity = 0;
}

static void fiber_finish(int i)
{
    free_stacks[nfree++] = fibers[i].stack;
    fibers[i].stack = -1;
}

static void switch_to(int i)
{
    cur = i;
    threadIdx = fibers[i].tid;
    if (fibers[i].stack < 0)
        fiber_start(i);
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_start_switch_fiber(&sched_fake, stack_of(fibers[i].stack), EMU_STACK);
#endif
    emu_ctx_switch(&sched_sp, fibers[i].sp);
#ifdef __SANITIZE_ADDRESS__
    __sanitizer_finish_switch_fiber(sched_fake, NULL, NULL);
#endif
}

static void suspend(int state, unsigned mask)
{
    nsuspend++;
    fibers[cur].state = state;
    fibers[cur].mask = mask;
    to_scheduler(false);
}

void emu_syncthreads(void)
{
    suspend(F_BLOCK, 0);
}

void emu_syncwarp(unsigned mask)
{
    suspend(F_WARP, mask);
}

int emu_lane(void)
{
    return cur & 31;
}

void *emu_warp_shared(unsigned long long *gen)
{
    *gen = fibers[cur].gen;
    return warp_shared[cur >> 5];
}

/* One barrier per exchange: slots are double-buffered by each thread's exchange count, so a
 * lane that runs ahead writes the other buffer, and it cannot get two exchanges ahead
 * before the slow lanes have read (they must reach the next barrier first). */
uint64_t emu_exchange(unsigned mask, uint64_t v, int src)
{
    int base = cur & ~31, b = fibers[cur].parity;
    fibers[cur].parity ^= 1;
    slots[b][cur] = v;
    suspend(F_WARP, mask);
    /* a lane past the block's last thread does not exist: CUDA leaves the value undefined,
     * the emulator hands out a poison pattern so that the result shows it */
    return base + src < nfib ? slots[b][base + src] : 0xA5A5A5A5A5A5A5A5ull;
}

/* The ready queue of the block that runs: each index is in it at most once. */
static int queue[EMU_MAX_THREADS];
static int qhead, qlen, nblock, ndone;     /* nblock: threads at __syncthreads */
static unsigned wwait[EMU_MAX_THREADS / 32];  /* per warp, a bit a lane: at a warp barrier */
static unsigned wgone[EMU_MAX_THREADS / 32];  /* finished, or past the block's last thread */

static void make_ready(int i)
{
    fibers[i].state = F_READY;
    fibers[i].gen = 0;
    queue[(qhead + qlen++) % EMU_MAX_THREADS] = i;
}

/* The same at the front of the queue: i runs next. */
static void make_next(int i)
{
    fibers[i].state = F_READY;
    fibers[i].gen = 0;
    qhead = (qhead + EMU_MAX_THREADS - 1) % EMU_MAX_THREADS;
    queue[qhead] = i;
    qlen++;
}

/* Open the warp barrier lane i waits at when every live lane of its mask has arrived (with
 * the whole warp as the mask: every live lane waits), releasing the mask's waiting lanes in
 * lane order: at the back of the queue, or under a shuffle seed at its front, so that the
 * warp runs ahead of the block's other warps as far as the next barrier (a missing
 * __syncthreads then shows as a warp reading shared memory that the others have not
 * written yet). The lanes a full-warp barrier releases get its number (emu_warp_shared). */
static void try_warp(int i)
{
    int base = i & ~31, w = i >> 5;
    unsigned m = fibers[i].mask;
    if ((m & ~(wwait[w] | wgone[w])) != 0)
        return;
    unsigned long long gen = m == 0xFFFFFFFFu ? ++warp_gen : 0;
    unsigned r = m & wwait[w];
    wwait[w] &= ~r;
    for (int k = 0; k < 32; k++) {
        int l = shuffle != 0 ? 31 - k : k; /* to the front in reverse: lane order kept */
        if (!(r >> l & 1u))
            continue;
        if (shuffle != 0)
            make_next(base + l);
        else
            make_ready(base + l);
        fibers[base + l].gen = gen;
    }
}

/* Open __syncthreads when every live thread of the block has arrived. */
static void try_block(void)
{
    if (nblock == 0 || nblock + ndone != nfib)
        return;
    nblock = 0;
    for (int i = 0; i < nfib; i++)
        if (fibers[i].state == F_BLOCK)
            make_ready(i);
}

/* Thread i has just suspended: open what it completed. */
static void after_suspend(int i)
{
    if (fibers[i].state == F_WARP) {
        wwait[i >> 5] |= 1u << (i & 31);
        try_warp(i);
    } else if (fibers[i].state == F_BLOCK) {
        nblock++;
        try_block();
    }
}

/* The running thread has finished (called on its fiber): open what that completes, then
 * move on to the next thread in the queue when it has not started (true), or give the
 * stack back (false). */
static bool next_thread(void)
{
    int i = cur, w = i >> 5, base = i & ~31;
    fibers[i].state = F_DONE;
    ndone++;
    wgone[w] |= 1u << (i & 31);
    for (unsigned r = wwait[w]; r != 0; r &= r - 1)
        if (wwait[w] >> __builtin_ctz(r) & 1u)    /* it may have completed that barrier */
            try_warp(base + __builtin_ctz(r));
    try_block();
    if (qlen > 0 && fibers[queue[qhead]].stack < 0) {
        int j = queue[qhead];
        qhead = (qhead + 1) % EMU_MAX_THREADS;
        qlen--;
        fibers[j].stack = fibers[i].stack;
        fibers[i].stack = -1;
        fibers[j].parity = 0;
        cur = j;
        threadIdx = fibers[j].tid;
        return true;
    }
    fiber_finish(i);
    return false;
}

static void deadlock(void)
{
    emu_report("deadlock in kernel %s, block (%u,%u,%u): threads wait at barriers that "
               "cannot open", kernel_name, blockIdx.x, blockIdx.y, blockIdx.z);
    for (int i = 0; i < nfib; i++)
        if (fibers[i].state != F_DONE)
            fprintf(stderr, "  thread %d: %s (mask %08x)\n", i,
                    fibers[i].state == F_BLOCK ? "__syncthreads" : "warp barrier",
                    fibers[i].mask);
    abort();
}

/* An order of 0..n-1 drawn from the shuffle seed: i -> (a i + b) mod n with a coprime to n
 * (a fresh draw per call), or the identity without a seed. */
struct order {
    unsigned long long a, b, n;
    unsigned long long at(unsigned long long i) const
    {
        return (unsigned long long)(((unsigned __int128)a * i + b) % n);
    }
};

static unsigned long long gcd(unsigned long long x, unsigned long long y)
{
    while (y != 0) {
        unsigned long long t = x % y;
        x = y;
        y = t;
    }
    return x;
}

static order draw_order(unsigned long long n)
{
    static unsigned long long draws;
    order o = {1, 0, n};
    if (shuffle == 0 || n < 2)
        return o;
    unsigned long long x = shuffle * 0x9E3779B97F4A7C15ull + ++draws * 0xBF58476D1CE4E5B9ull;
    x ^= x >> 31;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 29;
    o.b = x % n;
    for (o.a = (x >> 17) % n | 1; gcd(o.a, n) != 1; o.a = (o.a + 2) % n)
        ;
    return o;
}

/* Run one block: its threads as fibers, each until its next barrier, in queue order. */
static void run_block(void)
{
    order o = draw_order((unsigned long long)nfib);
    qhead = qlen = nblock = ndone = 0;
    for (int w = 0; w < (nfib + 31) / 32; w++) {
        int n = nfib - 32 * w;
        wwait[w] = 0;
        wgone[w] = n < 32 ? ~0u << n : 0u;
    }
    nfree = 0;
    for (int i = EMU_MAX_THREADS - 1; i >= 0; i--)
        free_stacks[nfree++] = i;
    for (int i = 0; i < nfib; i++)
        fibers[i].stack = -1;
    for (int i = 0; i < nfib; i++)
        make_ready((int)o.at((unsigned long long)i));
    while (qlen > 0) {
        int i = queue[qhead];
        qhead = (qhead + 1) % EMU_MAX_THREADS;
        qlen--;
        switch_to(i);
        after_suspend(cur);     /* cur: the thread the fiber ran last */
    }
    if (ndone != nfib)
        deadlock();
}

static bool config_ok(const emu_config &c)
{
    unsigned long long threads = (unsigned long long)c.block.x * c.block.y * c.block.z;
    return threads >= 1 && threads <= EMU_MAX_THREADS && c.block.x <= 1024 &&
           c.block.y <= 1024 && c.block.z <= 64 && c.grid.x >= 1 && c.grid.x <= 0x7FFFFFFFu &&
           c.grid.y >= 1 && c.grid.y <= 65535 && c.grid.z >= 1 && c.grid.z <= 65535 &&
           c.shared <= (48u << 10);
}

/* ---- launches ------------------------------------------------------------------------------ */

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

void emu_run(const emu_config &c, const char *name, void (*body)(void *), void *arg)
{
    if (!config_ok(c)) {
        emu_report("launch of %s with grid (%u,%u,%u), block (%u,%u,%u), %zu bytes of shared "
                   "memory: invalid configuration", name, c.grid.x, c.grid.y, c.grid.z,
                   c.block.x, c.block.y, c.block.z, c.shared);
        fail(cudaErrorInvalidConfiguration);
        return;
    }
    if (!stream_ok(c.stream)) {
        fail(cudaErrorInvalidResourceHandle);
        return;
    }
    emu_device_begin();
    if (stacks == NULL) {
        size_t len = (size_t)EMU_MAX_THREADS * (EMU_STACK + page);
        stacks = (char *)mmap(NULL, len, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (stacks == MAP_FAILED) {
            emu_report("cannot map the fiber stacks: %s", strerror(errno));
            abort();
        }
        for (int i = 0; i < EMU_MAX_THREADS; i++)
            mprotect(stack_of(i) - page, page, PROT_NONE);
    }
    gridDim = c.grid;
    blockDim = c.block;
    nfib = (int)(c.block.x * c.block.y * c.block.z);
    for (int i = 0; i < nfib; i++) {
        fibers[i].tid.x = (unsigned)i % c.block.x;
        fibers[i].tid.y = (unsigned)i / c.block.x % c.block.y;
        fibers[i].tid.z = (unsigned)i / (c.block.x * c.block.y);
    }
    body_fn = body;
    body_arg = arg;
    kernel_name = name;
    nsuspend = 0;
    double t0 = stats != NULL ? now() : 0.0;
    unsigned long long gx = c.grid.x, gxy = gx * c.grid.y;
    order o = draw_order(gxy * c.grid.z);
    for (unsigned long long i = 0; i < o.n; i++) {
        unsigned long long b = o.at(i);
        blockIdx.x = (unsigned)(b % gx);
        blockIdx.y = (unsigned)(b / gx % c.grid.y);
        blockIdx.z = (unsigned)(b / gxy);
        run_block();
    }
    if (stats != NULL) {
        kstat &k = (*stats)[name];
        k.launches++;
        k.threads += (unsigned long long)nfib * c.grid.x * c.grid.y * c.grid.z;
        k.suspends += nsuspend;
        k.seconds += now() - t0;
    }
    emu_device_end();
}
