/*
 * nvml.c - the CUDA emulator's stand-in for the NVIDIA driver's management library, built
 * as tests/cudaemu/libnvidia-ml.so.1 for the tests, which point $AMPD_NVML at it. It
 * reports $AMPD_CUDAEMU_DEVICES devices (default 1) of $AMPD_CUDAEMU_MEMORY bytes each
 * (default 16 GiB), all of it free, as the emulator's CUDA runtime does (tests/cudaemu/emu.cc),
 * through the entry points gpu/nvml.c looks up, with NVML's return codes.
 *
 * Threads: stateless apart from the init count; thread-safe.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *d);
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned len);
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned len);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m);
const char *nvmlErrorString(nvmlReturn_t r);

static int inits;

static unsigned devices(void)
{
    const char *e = getenv("AMPD_CUDAEMU_DEVICES");
    int n = e ? atoi(e) : 1;
    return n > 0 ? (unsigned)n : 0;
}

/* A handle is the device's index + 1 (never NULL). */
static long index_of(nvmlDevice_t d)
{
    long i = (long)(size_t)d - 1;
    return inits > 0 && i >= 0 && i < (long)devices() ? i : -1;
}

nvmlReturn_t nvmlInit_v2(void)
{
    inits++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void)
{
    if (inits == 0)
        return NVML_ERROR_UNINITIALIZED;
    inits--;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n)
{
    if (inits == 0)
        return NVML_ERROR_UNINITIALIZED;
    *n = devices();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *d)
{
    if (inits == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (i >= devices())
        return NVML_ERROR_INVALID_ARGUMENT;
    *d = (nvmlDevice_t)(size_t)(i + 1);
    return NVML_SUCCESS;
}

static nvmlReturn_t put(char *dst, unsigned len, const char *s)
{
    if (strlen(s) >= len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned len)
{
    return index_of(d) < 0 ? NVML_ERROR_INVALID_ARGUMENT
                           : put(name, len, "ampd CUDA emulator (CPU)");
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned len)
{
    char s[64];
    long i = index_of(d);
    if (i < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(s, sizeof(s), "GPU-00000000-0000-0000-0000-%012ld", i);
    return put(uuid, len, s);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    const char *e = getenv("AMPD_CUDAEMU_MEMORY");
    if (index_of(d) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    m->total = e ? strtoull(e, NULL, 10) : 16ULL << 30;
    m->free = m->total;
    m->used = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    case NVML_ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    default:
        return "Unknown Error";
    }
}
