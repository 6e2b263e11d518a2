/*
 * error.c - the engine's error strings and its log hook (gpu_set_log).
 *
 * Threads: gpu_strerror and gpu_log are thread-safe (the hook is read atomically).
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>

#include "gpu/gpu_int.h"

static _Atomic(gpu_log_fn) log_fn;
static _Atomic(void *) log_arg;

void gpu_set_log(gpu_log_fn fn, void *arg)
{
    atomic_store(&log_arg, arg);
    atomic_store(&log_fn, fn);
}

void gpu_log(int level, const char *func, const char *fmt, ...)
{
    gpu_log_fn fn = atomic_load(&log_fn);
    char msg[1024];
    va_list ap;
    if (!fn)
        return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fn(atomic_load(&log_arg), level, func, msg);
}

const char *gpu_strerror(int code)
{
    switch (code) {
#define GPU_ERR_CASE(name, val, msg) \
    case (val):                      \
        return (msg);
        GPU_ERRORS(GPU_ERR_CASE)
#undef GPU_ERR_CASE
    }
    return "unknown error";
}
