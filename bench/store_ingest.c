/*
 * store_ingest.c - benchmark of the store (targets in docs/benchmarks.md): the metric ingest rate
 * through the public API (store_metric_append for every row, then store_flush: the time until all
 * rows are committed), and the time to downsample the resulting 1M-step series to 1000 points with
 * store_series_query.
 *
 * Usage: store_ingest [ROWS] [DB]  (default 1000000 rows, a temporary file in /tmp that is
 * removed afterwards). Prints one "name value" line per result:
 *   rows_per_s, append_rows_per_s (the producer side alone), downsample_ms (median of 21
 *   queries, from 0 to the end, aligned to the rollup buckets), downsample_unaligned_ms
 *   (from 1 to ROWS-2: every bucket edge falls inside a rollup bucket, the worst case),
 *   downsample_points, raw_10k_ms (10,000 raw rows), db_bytes.
 *
 * Threads: the calling thread appends; the store's writer thread commits.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/store.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median milliseconds of n queries (after one warm-up); *npoints from the last. */
static double time_query(store *st, int64_t job, int64_t from, int64_t to, int points, int n,
                         int *npoints)
{
    static const int fields[4] = {STORE_M_LOSS, STORE_M_LOSS_SCALE, STORE_M_GRAD_NORM,
                                  STORE_M_STEP_MS};
    double *ms = malloc((size_t)n * sizeof(double)), med;
    store_series se;
    for (int i = -1; i < n; i++) {
        double t0 = now_s();
        if (store_series_query(st, job, fields, 4, from, to, points, &se) != 0) {
            fprintf(stderr, "store_series_query failed\n");
            exit(1);
        }
        if (i >= 0)
            ms[i] = (now_s() - t0) * 1e3;
        *npoints = se.npoints;
        store_series_free(&se);
    }
    qsort(ms, (size_t)n, sizeof(double), cmp_double);
    med = ms[n / 2];
    free(ms);
    return med;
}

/* The store's warnings and errors on stderr. */
static void print_log(void *arg, int level, const char *func, const char *msg)
{
    (void)arg;
    if (level >= STORE_LOG_WARN)
        fprintf(stderr, "store: %s: %s\n", func, msg);
}

int main(int argc, char **argv)
{
    int64_t rows = argc > 1 ? atoll(argv[1]) : 1000000, job;
    char path[256];
    bool temp = argc <= 2;
    store *st;
    store_metric m;
    uint64_t x = 88172645463325252ull;
    double t0, t1, t2, loss = 2.3, scale = 65536.0;
    int npoints;
    struct stat sb;

    if (rows < 10000) {
        fprintf(stderr, "usage: store_ingest [ROWS >= 10000] [DB]\n");
        return 2;
    }
    if (temp) {
        int fd;
        snprintf(path, sizeof(path), "/tmp/ampd-bench-store-XXXXXX");
        if ((fd = mkstemp(path)) < 0) {
            perror("mkstemp");
            return 1;
        }
        close(fd);
    } else {
        snprintf(path, sizeof(path), "%s", argv[2]);
    }
    store_set_log(print_log, NULL);
    if (store_open(path, &st) != 0 ||
        store_job_insert(st, "bench", "fp16", rows, "{}", NULL, &job, NULL) != 0) {
        fprintf(stderr, "cannot open the store at %s\n", path);
        return 1;
    }

    memset(&m, 0, sizeof(m));
    m.job_id = job;
    t0 = now_s();
    for (int64_t s = 0; s < rows; s++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        bool overflow = x % 2000 == 0; /* about what dynamic loss scaling does */
        loss = loss * 0.99999 + (double)(x >> 40) * 1e-9;
        if (overflow)
            scale *= 0.5;
        else if (s % 2000 == 1999)
            scale *= 2.0;
        m.step = s;
        m.v[STORE_M_LOSS] = overflow ? NAN : loss;
        m.v[STORE_M_LR] = 1e-3;
        m.v[STORE_M_LOSS_SCALE] = scale;
        m.v[STORE_M_OVERFLOW] = overflow;
        m.v[STORE_M_SKIPPED] = overflow;
        m.v[STORE_M_GRAD_NORM] = overflow ? INFINITY : 0.5 + (double)(x & 1023) * 1e-4;
        m.v[STORE_M_STEP_MS] = 20.0 + (double)(x & 255) * 0.01;
        m.v[STORE_M_SAMPLES_PER_S] = 10000.0;
        m.v[STORE_M_MEM_BYTES] = 44208564.0;
        m.v[STORE_M_PEAK_MEM_BYTES] = 44208564.0;
        m.v[STORE_M_EVAL_LOSS] = m.v[STORE_M_EVAL_ACC] = NAN;
        m.has_eval = false;
        if (store_metric_append(st, &m) != 0) {
            fprintf(stderr, "append failed\n");
            return 1;
        }
    }
    t1 = now_s();
    store_flush(st);
    t2 = now_s();
    /* a finished series: a daemon opening this database must not try to run it */
    store_job_set_status(st, job, STORE_SUCCEEDED, NULL);
    printf("rows %lld\n", (long long)rows);
    printf("append_rows_per_s %.0f\n", (double)rows / (t1 - t0));
    printf("rows_per_s %.0f\n", (double)rows / (t2 - t0));

    printf("downsample_ms %.3f\n", time_query(st, job, 0, -1, 1000, 21, &npoints));
    printf("downsample_points %d\n", npoints);
    printf("downsample_unaligned_ms %.3f\n", time_query(st, job, 1, rows - 2, 1000, 21, &npoints));
    printf("downsample_unaligned_points %d\n", npoints);
    printf("raw_10k_ms %.3f\n", time_query(st, job, rows / 2, rows / 2 + 9999, 0, 11, &npoints));
    store_close(st);
    if (stat(path, &sb) == 0)
        printf("db_bytes %lld\n", (long long)sb.st_size);
    if (temp) {
        char p[300];
        unlink(path);
        snprintf(p, sizeof(p), "%s-wal", path);
        unlink(p);
        snprintf(p, sizeof(p), "%s-shm", path);
        unlink(p);
    }
    return 0;
}
