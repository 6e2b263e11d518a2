/*
 * cpu.c - what the engine reads of the machine it runs on: the CPU's features (CPUID, and
 * XGETBV for what the OS saves), the kernel-path switches of the components that have an
 * AVX-512 and a portable path, and the monotonic clock.
 *
 * Invariants: a feature is reported only when the CPU has it and the OS saves its registers
 * (an AVX-512 CPU under an OS without ZMM state reports none of AVX-512).
 *
 * Threads: all functions are thread-safe. The features are read once (pthread_once); a
 * switch is one atomic int.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "gpu/gpu_int.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CPU_X86 1
#include <cpuid.h>
#else
#define CPU_X86 0
#endif

/* ---- CPU features ----------------------------------------------------------------------- */

static gpu_cpu_features cpu_features;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

#if CPU_X86
static uint64_t read_xcr0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static void cpu_detect(void)
{
    unsigned a, b, c, d;
    gpu_cpu_features f;

    memset(&f, 0, sizeof(f));
    if (!__get_cpuid(1, &a, &b, &c, &d))
        goto done;
    bool osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u;
    uint64_t xcr0 = osxsave ? read_xcr0() : 0;
    bool os_ymm = (xcr0 & 0x6u) == 0x6u;           /* XMM and YMM state */
    bool os_zmm = os_ymm && (xcr0 & 0xE0u) == 0xE0u; /* opmask, ZMM_Hi256, Hi16_ZMM */
    if (!avx || !os_ymm)
        goto done;
    f.fma = (c >> 12) & 1u;
    f.f16c = (c >> 29) & 1u;
    if (__get_cpuid_max(0, NULL) < 7)
        goto done;
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = (b >> 5) & 1u;
    if (os_zmm) {
        f.avx512f = (b >> 16) & 1u;
        f.avx512dq = (b >> 17) & 1u;
        f.avx512bw = (b >> 30) & 1u;
        f.avx512vl = (b >> 31) & 1u;
        f.avx512fp16 = (d >> 23) & 1u;
        unsigned max_sub = a;
        if (max_sub >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            f.avx512bf16 = (a >> 5) & 1u;
        }
    }
done:
    cpu_features = f;
}
#else
static void cpu_detect(void)
{
    memset(&cpu_features, 0, sizeof(cpu_features));
}
#endif

const gpu_cpu_features *gpu_cpu(void)
{
    pthread_once(&cpu_once, cpu_detect);
    return &cpu_features;
}

/* ---- kernel-path switches (see gpu_int.h) ---------------------------------------------- */

int gpu_impl_pick(_Atomic int *sw)
{
    int id = atomic_load_explicit(sw, memory_order_relaxed);
    if (id == GPU_IMPL_UNSET) {
        id = gpu_cpu()->avx512f ? GPU_IMPL_AVX512 : GPU_IMPL_PORTABLE;
        atomic_store_explicit(sw, id, memory_order_relaxed);
    }
    return id;
}

int gpu_impl_force(_Atomic int *sw, const char *name)
{
    int id;
    if (strcmp(name, "portable") == 0)
        id = GPU_IMPL_PORTABLE;
    else if (strcmp(name, "avx512") == 0)
        id = GPU_IMPL_AVX512;
    else
        return GPU_EINVAL;
    if (id == GPU_IMPL_AVX512 && !gpu_cpu()->avx512f)
        return GPU_ENODEV;
    atomic_store_explicit(sw, id, memory_order_relaxed);
    return 0;
}

const char *gpu_impl_name(int id)
{
    return id == GPU_IMPL_AVX512 ? "avx512" : "portable";
}

/* ---- the clock ------------------------------------------------------------------------- */

double gpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
