/*
 * prom.c - GET /metrics: the Prometheus text exposition format 0.0.4.
 *
 * Every family has its # HELP and # TYPE lines and all of its samples together; counters
 * end in _total, units are in the name (_seconds, _bytes); label values are escaped
 * (\\, \", \n) and non-finite samples are written NaN, +Inf, -Inf. Per running job the
 * values come from its latest metric row (store_metric_latest), labelled with the job's
 * id, name and dtype; the per-layer gauges come from its latest diagnosed step
 * (store_layer_stats_get), labelled with the job's id and the layer's name.
 *
 * Threads: runs on the requesting connection's thread; reads the store, the scheduler's
 * counters and the server's atomic status counters.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "api/api_int.h"

#define PROM_MAX_JOBS 1000

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

/* One per-layer family: field is a STORE_L_* field of the latest diagnosed step. */
static void layer_family(api_buf *b, const char *name, const char *help, const job_layers *jl,
                         int n, int field)
{
    family(b, name, "gauge", help);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < jl[i].n; k++) {
            const store_layer_stat *r = &jl[i].rows[k];
            if ((r->missing >> field) & 1u)
                continue;
            api_buf_puts(b, name);
            job_labels_open(b, jl[i].job);
            api_buf_puts(b, ",layer=\"");
            api_buf_prom_label(b, r->name);
            api_buf_puts(b, "\"} ");
            api_buf_prom_num(b, r->v[field]);
            api_buf_putc(b, '\n');
        }
}

/* One per-job family: field is a STORE_M_* column, scale multiplies it. */
static void job_family(api_buf *b, const char *name, const char *type, const char *help,
                       const job_row *rows, int n, int field, double scale)
{
    family(b, name, type, help);
    for (int i = 0; i < n; i++) {
        api_buf_puts(b, name);
        job_labels(b, rows[i].job);
        api_buf_putc(b, ' ');
        api_buf_prom_num(b, rows[i].m.v[field] * scale);
        api_buf_putc(b, '\n');
    }
}

void api_h_prom(api_req *q, api_resp *r)
{
    api_server *s = q->srv;
    api_buf *b = &r->body;
    store_stats stats;
    api_queue_info info;
    store_job_filter f = {.status = STORE_RUNNING, .limit = PROM_MAX_JOBS};
    store_job *jobs = NULL;
    job_row *rows = NULL;
    job_layers *layers = NULL;
    int njobs = 0, nrows = 0, nlayers = 0;

    store_get_stats(s->st, &stats);
    memset(&info, 0, sizeof(info));
    if (s->jobs)
        s->jobs->info(s->jobs->ctx, &info);
    if (store_job_list(s->st, &f, &jobs, &njobs) != 0) {
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
    family(b, "ampd_jobs", "gauge", "Jobs in the run history by status.");
    for (int i = 0; i < STORE_NSTATUS; i++)
        api_buf_printf(b, "ampd_jobs{status=\"%s\"} %lld\n", store_status_name((store_status)i),
                       (long long)stats.jobs_by_status[i]);
    family(b, "ampd_workers_started_total", "counter",
           "Worker processes started since the daemon started.");
    api_buf_printf(b, "ampd_workers_started_total %lld\n", (long long)info.workers_started);
    family(b, "ampd_workers_failed_total", "counter",
           "Worker processes that crashed, hung or failed since the daemon started.");
    api_buf_printf(b, "ampd_workers_failed_total %lld\n", (long long)info.workers_failed);
    family(b, "ampd_store_rows_total", "counter",
           "Metric rows written to the store since the daemon started.");
    api_buf_printf(b, "ampd_store_rows_total %lld\n", (long long)stats.metric_rows);
    family(b, "ampd_store_queue_depth", "gauge", "Metric rows waiting for the store's writer.");
    api_buf_printf(b, "ampd_store_queue_depth %lld\n", (long long)stats.queue_depth);

    job_family(b, "ampd_loss_scale", "gauge", "Loss-scale factor of the latest step.", rows, nrows,
               STORE_M_LOSS_SCALE, 1.0);
    job_family(b, "ampd_loss", "gauge", "Training loss of the latest step.", rows, nrows,
               STORE_M_LOSS, 1.0);
    job_family(b, "ampd_overflow_steps_total", "counter",
               "Steps whose gradients overflowed (inf/NaN) in the running job.", rows, nrows,
               STORE_M_OVERFLOW_TOTAL, 1.0);
    job_family(b, "ampd_skipped_steps_total", "counter",
               "Optimizer steps skipped in the running job.", rows, nrows, STORE_M_SKIPPED_TOTAL,
               1.0);
    job_family(b, "ampd_step_seconds", "gauge", "Duration of the latest training step.", rows,
               nrows, STORE_M_STEP_MS, 1e-3);
    job_family(b, "ampd_samples_per_second", "gauge", "Training throughput of the latest step.",
               rows, nrows, STORE_M_SAMPLES_PER_S, 1.0);
    job_family(b, "ampd_device_memory_bytes", "gauge",
               "Memory the running job's training state holds on its device.", rows, nrows,
               STORE_M_MEM_BYTES, 1.0);
    job_family(b, "ampd_comm_bytes", "gauge",
               "Gradient bytes rank 0 handed to the all-reduce in the latest step.", rows, nrows,
               STORE_M_COMM_BYTES, 1.0);
    job_family(b, "ampd_comm_seconds", "gauge",
               "Time the latest step's gradient all-reduces were in flight.", rows, nrows,
               STORE_M_COMM_MS, 1e-3);
    job_family(b, "ampd_comm_exposed_seconds", "gauge",
               "Part of the latest step's all-reduce time not hidden behind backward.", rows,
               nrows, STORE_M_COMM_EXPOSED_MS, 1e-3);
    job_family(b, "ampd_slowest_rank_step_seconds", "gauge",
               "Duration of the latest step on the job's slowest rank.", rows, nrows,
               STORE_M_STEP_MS_MAX, 1e-3);
    job_family(b, "ampd_slowest_rank", "gauge", "The rank that was slowest in the latest step.",
               rows, nrows, STORE_M_SLOWEST_RANK, 1.0);

    layer_family(b, "ampd_layer_act_headroom",
                 "Dtype max over the largest forward output of the layer, at the running job's "
                 "latest diagnosed step (+Inf: all zero).",
                 layers, nlayers, STORE_L_ACT_HEADROOM);
    layer_family(b, "ampd_layer_grad_underflow_ratio",
                 "Fraction of the layer's weight-gradient elements flushed to zero at the loss "
                 "scale, at the running job's latest diagnosed step.",
                 layers, nlayers, STORE_L_GRAD_UNDERFLOW);

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
