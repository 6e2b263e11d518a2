/*
 * cudatest.h - helpers shared by the CUDA test suites (check_cuda, check_cuda_gemm,
 * check_cuda_ops, check_cuda_step, check_cuda_gpt, check_cuda_train): float bit patterns, an
 * allocation that fails the test, the device checks every device test starts with (it
 * returns at once when they fail), and the suites' main(): one line "<suite>: SKIP: <why>"
 * without a usable device or "<suite>: device: <description>" with one, then the suite
 * without fork (CK_NOFORK), so that the CUDA state the first probe creates is the one the
 * tests use; without a device the exit status is 77 (SKIP) once the tests that need none
 * have passed. The suites install a log hook that puts the engine's messages on stderr.
 *
 * Header-only (static inline functions), included by the test programs alone. have_blas()
 * and blas_check() are there only when gpu/cuda/cuda_blas.h was included first (directly or
 * through tests/cudahost/cudahost.h): they need the CUDA headers, which check_cuda (built
 * without CUDA too) does not have.
 */
#ifndef AMPD_CUDATEST_H
#define AMPD_CUDATEST_H

#include <check.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"

static inline uint32_t f2u(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static inline float u2f(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

/* malloc that fails the test instead of returning NULL (n == 0 allocates one byte). */
static inline void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

/* Whether a CUDA device is usable (gpu_cuda_probe). */
static inline bool have_device(void)
{
    char why[256];
    return gpu_cuda_probe(why, sizeof(why)) == 0;
}

#ifdef AMPD_CUDA_BLAS_H
/* Whether a device and cuBLASLt are usable, checked once (the probe, then opening a handle);
 * *why (may be NULL) receives the device's description, or the reason why not. */
static inline bool blas_check(const char **why)
{
    static int have = -1;     /* 1: device and cuBLASLt usable, 0: not, -1: not checked */
    static char reason[320];  /* the device's description, or why there is none */
    if (have < 0) {
        char desc[256] = "", err[320] = "";
        gpu_cuda_blas *b = NULL;
        int rc = gpu_cuda_probe(desc, sizeof(desc));
        have = rc == 0 && gpu_cuda_blas_open(&b, err, sizeof(err)) == 0;
        snprintf(reason, sizeof(reason), "%s", rc == 0 && !have ? err : desc);
        gpu_cuda_blas_free(b);
    }
    if (why != NULL)
        *why = reason;
    return have == 1;
}

/* blas_check() for the tests of the suites that run GEMMs. */
static inline bool have_blas(void)
{
    return blas_check(NULL);
}
#endif

/* A suite's main(): prints "<name>: SKIP: <why>" when have is false, else
 * "<name>: device: <why>", then runs s without fork. Returns main's exit status: failure
 * when a test failed; without a device, when the tests that need none passed, 77
 * (automake's SKIP), since the device tests did not run. */
/* The engine's log hook of the CUDA suites: each message on stderr, so that a failed CUDA,
 * cuBLASLt or NCCL call on a real device says what failed in the suite's log. */
static inline void cudatest_log(void *arg, int level, const char *func, const char *msg)
{
    (void)arg;
    fprintf(stderr, "[gpu log %d] %s: %s\n", level, func, msg);
}

static inline int cudatest_run(const char *name, bool have, const char *why, Suite *s)
{
    gpu_set_log(cudatest_log, NULL);
    if (!have)
        printf("%s: SKIP: %s\n", name, why);
    else
        printf("%s: device: %s\n", name, why);
    fflush(stdout);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    if (failed)
        return EXIT_FAILURE;
    return have ? EXIT_SUCCESS : 77;
}

/* cudatest_run() for a suite whose tests need the device only: the probe's reason or the
 * device's description. */
static inline int cudatest_main(const char *name, Suite *s)
{
    char why[256];
    gpu_set_log(cudatest_log, NULL); /* before the probe, which may log */
    bool have = gpu_cuda_probe(why, sizeof(why)) == 0;
    return cudatest_run(name, have, why, s);
}

#endif /* AMPD_CUDATEST_H */
