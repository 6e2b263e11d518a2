/*
 * testutil.h - helpers shared by the test suites: a short sleep, and the deep, narrow fp16
 * MLP on a 4-class synthetic problem that the AMP lessons (check_train, check_diag) use.
 * Header-only (static functions), included by the test programs alone.
 */
#ifndef AMPD_TESTUTIL_H
#define AMPD_TESTUTIL_H

#include <stdio.h>
#include <time.h>

#include "gpu/gpu.h"

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
