/*
 * fp8cvt.c - the fp32 -> fp8 bulk conversion (gpu_cvt_f32_fp8, gpu/fp8.c) on each path this
 * CPU has, side by side in one run: portable (one value at a time), AVX2 (8 lanes), AVX-512
 * (16 lanes). Each path converts the same 2^24 values (normal-distributed, scaled into
 * E4M3's range as a scaled cast does, some past it) to E4M3 and to E5M2, saturating; the
 * rate is the best of 5 passes, in millions of values per second, and each path's speed-up
 * over portable. Every path's codes are compared with portable's, so a fast wrong path shows.
 *
 * Usage: bench/fp8cvt [THREADS]   (default 1: one core, the path's own speed; 0: OpenMP's)
 * Prints the CPU (from /proc/cpuinfo) first. Single-threaded; not part of make check.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gpu/gpu.h"

#define N (1u << 24)

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void print_cpu(void)
{
    char line[256] = "unknown";
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof(line), f))
        if (strncmp(line, "model name", 10) == 0)
            break;
    if (f)
        fclose(f);
    char *v = strchr(line, ':');
    printf("CPU: %s", v ? v + 2 : line);
}

int main(int argc, char **argv)
{
    static const char *const paths[] = {"portable", "avx2", "avx512"};
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    float *src = malloc(N * sizeof(float));
    uint8_t *dst = malloc(N), *ref = malloc(N);
    if (!src || !dst || !ref) {
        fprintf(stderr, "fp8cvt: out of memory\n");
        return 1;
    }
#ifdef _OPENMP
    if (threads > 0)
        omp_set_num_threads(threads);
#endif
    srand(1);
    for (uint32_t i = 0; i < N; i++) { /* Box-Muller, times 100: a few sd past 448 */
        double u = (rand() + 1.0) / (RAND_MAX + 2.0), w = (rand() + 1.0) / (RAND_MAX + 2.0);
        src[i] = (float)(100.0 * sqrt(-2.0 * log(u)) * cos(6.283185307179586 * w));
    }
    print_cpu();
    printf("threads: %d (0: OpenMP's default); %u values per pass, best of 5\n", threads, N);
    printf("%-8s %-9s %12s %10s %s\n", "format", "path", "Mvalues/s", "speed-up", "codes");
    for (int f = 0; f < 2; f++) {
        double base = 0;
        gpu_cvt_f32_fp8_on("portable", ref, src, N, (gpu_fp8_format)f, true);
        for (size_t k = 0; k < sizeof(paths) / sizeof(paths[0]); k++) {
            double best = 1e30;
            if (gpu_cvt_f32_fp8_on(paths[k], dst, src, N, (gpu_fp8_format)f, true) != 0) {
                printf("%-8s %-9s %12s %10s\n", gpu_fp8_format_name((gpu_fp8_format)f), paths[k],
                       "-", "(no CPU support)");
                continue;
            }
            for (int r = 0; r < 5; r++) {
                double t = now();
                gpu_cvt_f32_fp8_on(paths[k], dst, src, N, (gpu_fp8_format)f, true);
                t = now() - t;
                best = t < best ? t : best;
            }
            double rate = N / best / 1e6;
            if (k == 0)
                base = rate;
            printf("%-8s %-9s %12.0f %9.2fx %s\n", gpu_fp8_format_name((gpu_fp8_format)f), paths[k],
                   rate, rate / base, memcmp(dst, ref, N) ? "DIFFER" : "same");
        }
    }
    printf("the engine's path: %s\n", gpu_fp8_impl());
    free(src);
    free(dst);
    free(ref);
    return 0;
}
