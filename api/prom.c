/*
 * prom.c - GET /metrics: the Prometheus text exposition format 0.0.4.
 *
 * Every family has its # HELP and # TYPE lines and all of its samples together; counters
 * end in _total, units are in the name (_seconds, _bytes); label values are escaped
 * (\\, \", \n) and non-finite samples are written NaN, +Inf, -Inf; a missing value
 * (an eval field before the first eval) is left out. The per-job series cover the running
 * jobs and those that finished less than cfg.metrics_keep_s ago (so a job's final values
 * reach a Prometheus that scrapes after it ended; ampd_job_running says which is which).
 * Their values come from the job's latest metric row (store_metric_latest), labelled with
 * the job's id, name and dtype; the per-layer gauges come from its latest diagnosed step
 * (store_layer_stats_get) with the layer's name added.
 *
 * ampd_step_duration_seconds is a histogram of the step times of every step row a job has
 * stored: the server keeps per job the counts up to the last step it has read and reads
 * only the rows after it on each scrape, so a scrape costs the steps since the previous
 * one. A job that went back to a checkpoint (its latest step fell below the last one
 * counted) counts its rerun steps again when they are stored: they ran twice.
 *
 * Threads: runs on the requesting connection's thread; reads the store, the scheduler's
 * counters and the server's atomic status counters; the histograms are guarded by
 * srv->prom_mu.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/api_int.h"

#define PROM_MAX_JOBS 1000
#define HIST_CHUNK 65536 /* step rows read per query when a histogram catches up */

/* Upper bounds (seconds) of the step-time histogram's buckets; +Inf follows. */
static const double hist_le[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                 0.1,    0.25,  0.5,    1,     2.5,  5,     10};
#define HIST_NB ((int)(sizeof(hist_le) / sizeof(hist_le[0])))

struct api_prom_hist {
    int64_t job, through; /* counted the job's step rows up to step `through` */
    uint64_t counts[HIST_NB + 1]; /* per bucket (not cumulative); the last is +Inf */
    uint64_t count;
    double sum;
    bool seen; /* in the current scrape's job list */
};

typedef struct {
    const store_job *job;
    store_metric m;
} job_row;

typedef struct {
    const store_job *job;
    store_layer_stat *rows; /* heap */
    int n;
} job_layers;

static void family(api_buf *b, const char *name, const char *type, const char *help)
{
    api_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* The labels that name a job on every per-job and per-layer series, without the closing
 * brace: job_id (not "job", which Prometheus keeps for its scrape target), name, dtype. */
static void job_labels_open(api_buf *b, const store_job *j)
{
    api_buf_printf(b, "{job_id=\"%lld\",name=\"", (long long)j->id);
    api_buf_prom_label(b, j->name);
    api_buf_puts(b, "\",dtype=\"");
    api_buf_prom_label(b, j->dtype);
    api_buf_putc(b, '"');
}

static void job_labels(api_buf *b, const store_job *j)
{
    job_labels_open(b, j);
    api_buf_putc(b, '}');
}

/* One per-layer family of the latest diagnosed step: fields[f] (STORE_L_*) for f < nf, each
 * labelled operand=ops[f] when ops is not NULL (an fp8 layer's operands). A layer that did
 * not report a field has no sample of it. */
static void layer_family(api_buf *b, const char *name, const char *help, const job_layers *jl,
                         int n, const int *fields, const char *const *ops, int nf)
{
    family(b, name, "gauge", help);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < jl[i].n; k++)
            for (int f = 0; f < nf; f++) {
                const store_layer_stat *r = &jl[i].rows[k];
                if ((r->missing >> fields[f]) & 1u)
                    continue;
                api_buf_puts(b, name);
                job_labels_open(b, jl[i].job);
                api_buf_puts(b, ",layer=\"");
                api_buf_prom_label(b, r->name);
                if (ops)
                    api_buf_printf(b, "\",operand=\"%s", ops[f]);
                api_buf_puts(b, "\"} ");
                api_buf_prom_num(b, r->v[fields[f]]);
                api_buf_putc(b, '\n');
            }
}

/* One per-job family: field is a STORE_M_* column, scale multiplies it. */
static void job_family(api_buf *b, const char *name, const char *type, const char *help,
                       const job_row *rows, int n, int field, double scale)
{
    family(b, name, type, help);
    for (int i = 0; i < n; i++) {
        if (store_is_missing(rows[i].m.v[field]))
            continue;
        api_buf_puts(b, name);
        job_labels(b, rows[i].job);
        api_buf_putc(b, ' ');
        api_buf_prom_num(b, rows[i].m.v[field] * scale);
        api_buf_putc(b, '\n');
    }
}

/* ---- the step-time histograms ---------------------------------------------------------- */

void api_prom_free(api_server *s)
{
    free(s->prom_hist);
    s->prom_hist = NULL;
    s->prom_nhist = 0;
}

/* The histogram of job, created empty when absent; NULL when out of memory. */
static struct api_prom_hist *hist_of(api_server *s, int64_t job)
{
    for (int i = 0; i < s->prom_nhist; i++)
        if (s->prom_hist[i].job == job)
            return &s->prom_hist[i];
    struct api_prom_hist *h = realloc(s->prom_hist, sizeof(*h) * (size_t)(s->prom_nhist + 1));
    if (!h)
        return NULL;
    s->prom_hist = h;
    h = &s->prom_hist[s->prom_nhist++];
    memset(h, 0, sizeof(*h));
    h->job = job;
    return h;
}

/* Count the step rows of h's job stored after h->through (latest: its latest step). */
static void hist_catch_up(api_server *s, struct api_prom_hist *h, int64_t latest)
{
    const int field = STORE_M_STEP_MS;
    store_series se;
    if (latest < h->through)
        h->through = latest; /* resumed from a checkpoint: the steps after it run again */
    while (h->through < latest) {
        int64_t to = latest - h->through > HIST_CHUNK ? h->through + HIST_CHUNK : latest;
        if (store_series_query(s->st, h->job, &field, 1, h->through + 1, to, 0, &se) != 0)
            return; /* counted so far stays; the next scrape tries again */
        for (int i = 0; i < se.npoints; i++) {
            double sec = se.points[i].last[0] * 1e-3;
            int k = 0;
            if (!isfinite(sec))
                continue;
            while (k < HIST_NB && sec > hist_le[k])
                k++;
            h->counts[k]++;
            h->count++;
            h->sum += sec;
        }
        store_series_free(&se);
        h->through = to;
    }
}

static void hist_write(api_buf *b, const store_job *j, const struct api_prom_hist *h)
{
    static const char name[] = "ampd_step_duration_seconds";
    uint64_t cum = 0;
    for (int k = 0; k <= HIST_NB; k++) {
        cum += h->counts[k];
        api_buf_printf(b, "%s_bucket", name);
        job_labels_open(b, j);
        if (k < HIST_NB) {
            api_buf_puts(b, ",le=\"");
            api_buf_prom_num(b, hist_le[k]);
            api_buf_printf(b, "\"} %llu\n", (unsigned long long)cum);
        } else {
            api_buf_printf(b, ",le=\"+Inf\"} %llu\n", (unsigned long long)cum);
        }
    }
    api_buf_printf(b, "%s_sum", name);
    job_labels(b, j);
    api_buf_putc(b, ' ');
    api_buf_prom_num(b, h->sum);
    api_buf_printf(b, "\n%s_count", name);
    job_labels(b, j);
    api_buf_printf(b, " %llu\n", (unsigned long long)h->count);
}

/* The histogram family for the jobs of rows; forgets the jobs no longer listed. */
static void hist_family(api_server *s, api_buf *b, const job_row *rows, int n)
{
    family(b, "ampd_step_duration_seconds", "histogram",
           "Durations of the job's stored training steps.");
    pthread_mutex_lock(&s->prom_mu);
    for (int i = 0; i < s->prom_nhist; i++)
        s->prom_hist[i].seen = false;
    for (int i = 0; i < n; i++) {
        struct api_prom_hist *h = hist_of(s, rows[i].job->id);
        if (!h)
            continue;
        h->seen = true;
        hist_catch_up(s, h, rows[i].m.step);
        hist_write(b, rows[i].job, h);
    }
    for (int i = 0; i < s->prom_nhist;)
        if (!s->prom_hist[i].seen)
            s->prom_hist[i] = s->prom_hist[--s->prom_nhist];
        else
            i++;
    pthread_mutex_unlock(&s->prom_mu);
}

/* ---- the handler --------------------------------------------------------------------------- */

/* The jobs whose series are exported: the running ones and those finished within keep_s.
 * *out is freed with store_jobs_free. */
static int exported_jobs(api_server *s, store_job **out, int *n)
{
    store_job_filter f = {.status = STORE_RUNNING, .limit = PROM_MAX_JOBS};
    store_job *run = NULL, *recent = NULL, *all;
    int nrun = 0, nrecent = 0, k;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* finished_at is unix time */
    double now = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;

    *out = NULL;
    *n = 0;
    if (store_job_list(s->st, &f, &run, &nrun) != 0)
        return -1;
    f.status = -1;
    if (s->cfg.metrics_keep_s > 0 && store_job_list(s->st, &f, &recent, &nrecent) != 0)
        nrecent = 0;
    all = calloc((size_t)(nrun + nrecent) + 1, sizeof(*all));
    if (!all) {
        store_jobs_free(run, nrun);
        store_jobs_free(recent, nrecent);
        return -1;
    }
    memcpy(all, run, sizeof(*all) * (size_t)nrun);
    k = nrun;
    for (int i = 0; i < nrecent; i++) {
        const store_job *j = &recent[i];
        if (store_status_finished(j->status) && j->finished_at > 0 &&
            now - j->finished_at <= s->cfg.metrics_keep_s)
            all[k++] = *j;
        else
            store_job_clear(&recent[i]);
    }
    free(run); /* the jobs' strings moved to all */
    free(recent);
    *out = all;
    *n = k;
    return 0;
}

/* The per-job families of the latest step's metrics: name, type, help, the metric field and
 * the factor to its unit (ms to s). */
static const struct {
    const char *name, *type, *help;
    int field;
    double scale;
} job_metrics[] = {
    {"ampd_loss_scale", "gauge", "Loss-scale factor of the latest step.", STORE_M_LOSS_SCALE, 1.0},
    {"ampd_loss", "gauge", "Training loss of the latest step.", STORE_M_LOSS, 1.0},
    {"ampd_overflow_steps_total", "counter",
     "Steps whose gradients overflowed (inf/NaN) in the job.", STORE_M_OVERFLOW_TOTAL, 1.0},
    {"ampd_skipped_steps_total", "counter", "Optimizer steps skipped in the job.",
     STORE_M_SKIPPED_TOTAL, 1.0},
    {"ampd_step_seconds", "gauge", "Duration of the latest training step.", STORE_M_STEP_MS,
     1e-3},
    {"ampd_samples_per_second", "gauge", "Training throughput of the latest step.",
     STORE_M_SAMPLES_PER_S, 1.0},
    {"ampd_device_memory_bytes", "gauge", "Memory the job's training state holds on its device.",
     STORE_M_MEM_BYTES, 1.0},
    {"ampd_comm_bytes", "gauge",
     "Gradient bytes rank 0 handed to the all-reduce in the latest step.", STORE_M_COMM_BYTES,
     1.0},
    {"ampd_comm_seconds", "gauge", "Time the latest step's gradient all-reduces were in flight.",
     STORE_M_COMM_MS, 1e-3},
    {"ampd_comm_exposed_seconds", "gauge",
     "Part of the latest step's all-reduce time not hidden behind backward.",
     STORE_M_COMM_EXPOSED_MS, 1e-3},
    {"ampd_slowest_rank_step_seconds", "gauge",
     "Duration of the latest step on the job's slowest rank.", STORE_M_STEP_MS_MAX, 1e-3},
    {"ampd_slowest_rank", "gauge", "The rank that was slowest in the latest step.",
     STORE_M_SLOWEST_RANK, 1.0},
};

/* The daemon's own families: jobs by status, workers, the store's rows and queue. */
static void daemon_families(api_buf *b, const store_stats *stats, const api_queue_info *info)
{
    family(b, "ampd_jobs", "gauge", "Jobs in the run history by status.");
    for (int i = 0; i < STORE_NSTATUS; i++)
        api_buf_printf(b, "ampd_jobs{status=\"%s\"} %lld\n", store_status_name((store_status)i),
                       (long long)stats->jobs_by_status[i]);
    family(b, "ampd_workers_started_total", "counter",
           "Worker processes started since the daemon started.");
    api_buf_printf(b, "ampd_workers_started_total %lld\n", (long long)info->workers_started);
    family(b, "ampd_workers_failed_total", "counter",
           "Worker processes that crashed, hung or failed since the daemon started.");
    api_buf_printf(b, "ampd_workers_failed_total %lld\n", (long long)info->workers_failed);
    family(b, "ampd_store_rows_total", "counter",
           "Metric rows written to the store since the daemon started.");
    api_buf_printf(b, "ampd_store_rows_total %lld\n", (long long)stats->metric_rows);
    family(b, "ampd_store_queue_depth", "gauge", "Metric rows waiting for the store's writer.");
    api_buf_printf(b, "ampd_store_queue_depth %lld\n", (long long)stats->queue_depth);
}

/* One family of the GPUs (GET /v1/resources' devices): key of each, or with key NULL the
 * first job that holds it (0: free). */
static void gpu_family(api_buf *b, json_t *devs, const char *name, const char *help,
                       const char *key)
{
    size_t i;
    json_t *d;
    family(b, name, "gauge", help);
    json_array_foreach(devs, i, d) {
        json_t *v = key ? json_object_get(d, key) : json_array_get(json_object_get(d, "jobs"), 0);
        api_buf_printf(b, "%s{gpu=\"%lld\",name=\"", name,
                       (long long)json_integer_value(json_object_get(d, "index")));
        api_buf_prom_label(b, json_string_value(json_object_get(d, "name")));
        api_buf_printf(b, "\"} %lld\n", (long long)json_integer_value(v));
    }
}

/* The machine's families, from the scheduler's resources: free cores and, per GPU, its
 * memory and the job that holds it. */
static void machine_families(api_server *s, api_buf *b)
{
    json_t *res = s->jobs && s->jobs->resources ? s->jobs->resources(s->jobs->ctx) : NULL;
    json_t *devs = json_object_get(res, "devices");
    if (!res)
        return;
    family(b, "ampd_cpus_free", "gauge", "Cores no job holds, of those ampd places jobs on.");
    api_buf_printf(b, "ampd_cpus_free %lld\n",
                   (long long)json_integer_value(json_object_get(res, "cpus_free")));
    gpu_family(b, devs, "ampd_gpu_memory_used_bytes", "GPU memory in use, as NVML reports it.",
               "memory_used");
    gpu_family(b, devs, "ampd_gpu_memory_total_bytes", "GPU memory, as NVML reports it.",
               "memory_total");
    gpu_family(b, devs, "ampd_gpu_job", "The job that holds the GPU (0: free).", NULL);
    json_decref(res);
}

/* The jobs' families: whether each runs, the latest step's metrics, the step-time
 * histogram and two per-layer diagnostics. */
static void job_families(api_server *s, api_buf *b, const job_row *rows, int nrows,
                         const job_layers *layers, int nlayers)
{
    family(b, "ampd_job_running", "gauge",
           "1 while the job runs, 0 once it has finished (its series are kept for a while).");
    for (int i = 0; i < nrows; i++) {
        api_buf_puts(b, "ampd_job_running");
        job_labels(b, rows[i].job);
        api_buf_printf(b, " %d\n", rows[i].job->status == STORE_RUNNING);
    }
    for (size_t k = 0; k < sizeof(job_metrics) / sizeof(job_metrics[0]); k++)
        job_family(b, job_metrics[k].name, job_metrics[k].type, job_metrics[k].help, rows, nrows,
                   job_metrics[k].field, job_metrics[k].scale);
    hist_family(s, b, rows, nrows);
    static const int headroom[] = {STORE_L_ACT_HEADROOM}, underflow[] = {STORE_L_GRAD_UNDERFLOW};
    static const int fp8_ufl[] = {STORE_L_FP8_IN_UNDERFLOW, STORE_L_FP8_W_UNDERFLOW,
                                  STORE_L_FP8_GRAD_UNDERFLOW};
    static const char *const fp8_ops[] = {"in", "w", "grad"};
    layer_family(b, "ampd_layer_act_headroom",
                 "Dtype max over the largest forward output of the layer, at the job's "
                 "latest diagnosed step (+Inf: all zero).",
                 layers, nlayers, headroom, NULL, 1);
    layer_family(b, "ampd_layer_grad_underflow_ratio",
                 "Fraction of the layer's weight-gradient elements flushed to zero at the loss "
                 "scale, at the job's latest diagnosed step.",
                 layers, nlayers, underflow, NULL, 1);
    layer_family(b, "ampd_layer_fp8_underflow_ratio",
                 "An fp8 layer's operand (in: its input, w: its weight, grad: its output "
                 "gradient): the fraction of its non-zero values its fp8 cast made 0, at the "
                 "job's latest diagnosed step.",
                 layers, nlayers, fp8_ufl, fp8_ops, 3);
}

void api_h_prom(api_req *q, api_resp *r)
{
    api_server *s = q->srv;
    api_buf *b = &r->body;
    store_stats stats;
    api_queue_info info;
    store_job *jobs = NULL;
    job_row *rows = NULL;
    job_layers *layers = NULL;
    int njobs = 0, nrows = 0, nlayers = 0;

    store_get_stats(s->st, &stats);
    memset(&info, 0, sizeof(info));
    if (s->jobs)
        s->jobs->info(s->jobs->ctx, &info);
    if (exported_jobs(s, &jobs, &njobs) != 0) {
        jobs = NULL;
        njobs = 0;
    }
    rows = njobs > 0 ? calloc((size_t)njobs, sizeof(*rows)) : NULL;
    for (int i = 0; rows && i < njobs; i++) {
        if (store_metric_latest(s->st, jobs[i].id, &rows[nrows].m) == 0)
            rows[nrows++].job = &jobs[i];
    }
    layers = njobs > 0 ? calloc((size_t)njobs, sizeof(*layers)) : NULL;
    for (int i = 0; layers && i < njobs; i++) {
        int64_t at;
        if (store_layer_stats_get(s->st, jobs[i].id, -1, &layers[nlayers].rows, &layers[nlayers].n,
                                  &at, NULL) == 0)
            layers[nlayers++].job = &jobs[i];
    }

    r->status = 200;
    r->ctype = "text/plain; version=0.0.4; charset=utf-8";
    daemon_families(b, &stats, &info);
    machine_families(s, b);
    job_families(s, b, rows, nrows, layers, nlayers);
    family(b, "ampd_http_requests_total", "counter", "HTTP responses sent, by status code.");
    for (int code = 100; code < API_NCODES; code++) {
        unsigned long long c = atomic_load(&s->codes[code]);
        if (c)
            api_buf_printf(b, "ampd_http_requests_total{code=\"%d\"} %llu\n", code, c);
    }
    for (int i = 0; i < nlayers; i++)
        free(layers[i].rows);
    free(layers);
    free(rows);
    store_jobs_free(jobs, njobs);
}
