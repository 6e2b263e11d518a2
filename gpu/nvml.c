/*
 * nvml.c - the machine's NVIDIA GPUs as the driver's management library (NVML,
 * libnvidia-ml.so.1) reports them: index, name, UUID, memory total / free / used, and
 * whether the device answers. The daemon reads its inventory here, never through the CUDA
 * runtime, so it holds no CUDA context and no device memory of its own.
 *
 * The library ships with the driver, not the toolkit, so it is opened with dlopen() on
 * first use ($AMPD_NVML names another file; the tests point it at the CUDA emulator's
 * stand-in), and its few functions are looked up by name. Without it (no driver) every
 * call answers GPU_ENODEV with the reason.
 *
 * Invariants: the library is loaded and initialised at most once per process and never
 * closed. Threads: thread-safe (NVML is; the load runs under pthread_once).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"

/* The part of nvml.h this file uses (the ABI is stable: these are the _v2 entry points). */
typedef int nvml_ret;
typedef struct nvml_device_st *nvml_device;
typedef struct {
    unsigned long long total, free, used;
} nvml_memory;

static struct {
    int rc;        /* 0 once loaded and initialised; else GPU_ENODEV */
    char why[256]; /* the reason when rc != 0 */
    nvml_ret (*init)(void);
    nvml_ret (*count)(unsigned *n);
    nvml_ret (*handle)(unsigned i, nvml_device *d);
    nvml_ret (*name)(nvml_device d, char *name, unsigned len);
    nvml_ret (*uuid)(nvml_device d, char *uuid, unsigned len);
    nvml_ret (*memory)(nvml_device d, nvml_memory *m);
    const char *(*error)(nvml_ret r);
} nv;

static pthread_once_t nv_once = PTHREAD_ONCE_INIT;

static const char *nvml_path(void)
{
    const char *e = getenv("AMPD_NVML");
    return e && *e ? e : "libnvidia-ml.so.1";
}

static const char *nv_error(nvml_ret r)
{
    static _Thread_local char buf[32];
    if (nv.error)
        return nv.error(r);
    snprintf(buf, sizeof(buf), "NVML error %d", r);
    return buf;
}

static void nv_load(void)
{
    const char *path = nvml_path();
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    nvml_ret r;

    nv.rc = GPU_ENODEV;
    if (!lib) {
        const char *e = dlerror();
        snprintf(nv.why, sizeof(nv.why), "no NVIDIA driver (%s: %s)", path,
                 e ? e : "dlopen failed");
        return;
    }
    struct {
        void **fn;
        const char *name;
    } syms[] = {{(void **)&nv.init, "nvmlInit_v2"},
                {(void **)&nv.count, "nvmlDeviceGetCount_v2"},
                {(void **)&nv.handle, "nvmlDeviceGetHandleByIndex_v2"},
                {(void **)&nv.name, "nvmlDeviceGetName"},
                {(void **)&nv.uuid, "nvmlDeviceGetUUID"},
                {(void **)&nv.memory, "nvmlDeviceGetMemoryInfo"},
                {(void **)&nv.error, "nvmlErrorString"}};
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++)
        if (!(*syms[i].fn = dlsym(lib, syms[i].name))) {
            snprintf(nv.why, sizeof(nv.why), "%s has no %s", path, syms[i].name);
            return;
        }
    if ((r = nv.init()) != 0) {
        snprintf(nv.why, sizeof(nv.why), "NVML does not start: %s", nv_error(r));
        return;
    }
    nv.rc = 0;
}

/* One device's fields; its health is what NVML said when a query failed. */
static void nv_device(unsigned i, gpu_nvml_device *d)
{
    nvml_device h;
    nvml_memory m;
    nvml_ret r;

    memset(d, 0, sizeof(*d));
    d->index = (int)i;
    snprintf(d->health, sizeof(d->health), "ok");
    if ((r = nv.handle(i, &h)) != 0 || (r = nv.name(h, d->name, sizeof(d->name))) != 0 ||
        (r = nv.uuid(h, d->uuid, sizeof(d->uuid))) != 0 || (r = nv.memory(h, &m)) != 0) {
        snprintf(d->health, sizeof(d->health), "%s", nv_error(r));
        return;
    }
    d->memory_total = m.total;
    d->memory_free = m.free;
    d->memory_used = m.used;
}

/* See gpu.h. */
int gpu_nvml_devices(gpu_nvml_device *out, int max, int *n, char *why, size_t whylen)
{
    unsigned count = 0;
    nvml_ret r;

    *n = 0;
    pthread_once(&nv_once, nv_load);
    if (nv.rc != 0) {
        if (why)
            snprintf(why, whylen, "%s", nv.why);
        return nv.rc;
    }
    if ((r = nv.count(&count)) != 0) {
        if (why)
            snprintf(why, whylen, "NVML cannot count the devices: %s", nv_error(r));
        return GPU_ENODEV;
    }
    for (unsigned i = 0; i < count && (int)i < max; i++)
        nv_device(i, &out[i]);
    *n = count < (unsigned)max ? (int)count : max;
    if (why)
        snprintf(why, whylen, "%u device%s (NVML)", count, count == 1 ? "" : "s");
    return 0;
}
