/*
 * testutil.h - helpers shared by the test suites: a case's SKIP line, a short sleep, and the
 * deep, narrow fp16 MLP on a 4-class synthetic problem that the AMP lessons (check_train,
 * check_diag) use. Header-only (static functions), included by the test programs alone.
 */
#ifndef AMPD_TESTUTIL_H
#define AMPD_TESTUTIL_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "gpu/gpu.h"

/* A case, or a variant of one (on: a path or implementation; NULL for the whole case), that
 * cannot run on this machine says so, since Check has no skip status of its own: one line
 * "SKIP: <case> on <on>: <reason>" on stdout, which CI's summary collects (grep SKIP
 * tests/check_*.log), flushed at once so that it reaches the log before the case's forked
 * process ends. fn is the case's __func__ (START_TEST(x) defines x_fn): printed as x. A suite
 * that cannot run at all exits 77 instead. */
static inline void test_skip(const char *fn, const char *on, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline void test_skip(const char *fn, const char *on, const char *fmt, ...)
{
    size_t n = strlen(fn);
    va_list ap;
    if (n > 3 && strcmp(fn + n - 3, "_fn") == 0)
        n -= 3;
    printf("SKIP: %.*s%s%s: ", (int)n, fn, on ? " on " : "", on ? on : "");
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
}
#define TEST_SKIP(on, ...) test_skip(__func__, on, __VA_ARGS__)

static inline void test_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* gpu_job_defaults on the CPU backend: the suites that assert the CPU's exact behaviour
 * (bit-identical reruns, re-diagnosing an overflowing step) stay on it on a GPU machine,
 * where "auto" would pick CUDA. */
static inline void test_cpu_job(gpu_job_config *c)
{
    gpu_job_defaults(c);
    snprintf(c->device, sizeof(c->device), "cpu");
}

/* A deep (depth widths), 32-wide MLP with a 4-class head on synthetic data, in fp16 with
 * the given loss-scaling mode, batch 64, one BLAS thread, on the CPU. */
static inline void test_narrow_job(gpu_job_config *c, int depth, float init,
                                   gpu_scale_mode mode)
{
    test_cpu_job(c);
    c->dtype = GPU_FP16;
    gpu_scaler_defaults(&c->scaler, GPU_FP16);
    c->scaler.mode = mode;
    c->model.nlayers = depth;
    for (int i = 0; i < depth - 1; i++)
        c->model.layers[i] = 32;
    c->model.layers[depth - 1] = 4;
    c->model.init_scale = init;
    c->data.type = GPU_DATA_SYNTHETIC;
    c->data.synth_features = 32;
    c->data.synth_classes = 4;
    c->data.synth_train = 4096;
    c->data.synth_eval = 1024;
    c->batch_size = 64;
    c->threads = 1;
}

#endif /* AMPD_TESTUTIL_H */
