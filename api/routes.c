/*
 * routes.c - the JSON endpoints of docs/api.md: jobs (submit, list, get, cancel, resume,
 * delete), metrics (JSON and CSV, raw or downsampled), layers, events, checkpoints
 * (list and download), compare, system, healthz and the API's OpenAPI description.
 *
 * Every answer is built in an api_buf (no per-field allocations, no quadratic
 * concatenation); store reads go through store.h's prepared statements. Query parameters
 * are parsed strictly: a bad value is a 400 that names the parameter. The job queue (the
 * host's api_jobs) may be absent (a degraded, read-only server): mutations then answer 503.
 *
 * Threads: handlers run on their connection's thread; they share only the api_server
 * (read-only here) and the thread-safe store and job queue.
 */
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "api/api_int.h"
#include "config.h"

#define SPEC_MAX_DEPTH 32 /* a job spec nests 4 levels; anything deeper is refused */
#define IDEM_KEY_MAX 200
#define RAW_CHUNK_STEPS 16384 /* raw series are read from the store this many steps at a time */
#define MAX_POINTS 10000      /* downsampled answers are for plots */
#define MAX_COMPARE 16

/* ---- helpers --------------------------------------------------------------------------- */

static void ok_json(api_resp *r, unsigned status)
{
    r->status = status;
    r->ctype = NULL;
}

/* A store error as an HTTP error (not-found names what was looked for); writing: the request
 * failed writing to the store rather than reading it (the 503 says which). */
void api_store_error(api_resp *r, int rc, const char *what, int64_t id, bool writing)
{
    if (rc == STORE_ENOTFOUND)
        api_error_resp(r, 404, "not_found", NULL, "no %s %lld", what, (long long)id);
    else if (rc == STORE_ECONFLICT)
        api_error_resp(r, 409, "conflict", NULL, "%s %lld is in the wrong state", what,
                       (long long)id);
    else if (rc == STORE_EINVAL)
        api_error_resp(r, 400, "invalid_request", NULL, "the store refused the request");
    else
        api_error_resp(r, 503, "unavailable", NULL, "the run history could not be %s (%s)",
                       writing ? "written" : "read", store_strerror(rc));
}

static void store_error(api_resp *r, int rc, const char *what, int64_t id)
{
    api_store_error(r, rc, what, id, false);
}

/* Load the route's job into j; false with r filled when it cannot be. */
bool api_load_job(api_req *q, api_resp *r, store_job *j)
{
    memset(j, 0, sizeof(*j));
    if (q->route.job < 0) {
        api_error_resp(r, 404, "not_found", NULL, "no job %.64s (ids are positive integers)",
                       q->path + 9);
        return false;
    }
    int rc = store_job_get(q->srv->st, q->route.job, j);
    if (rc) {
        store_error(r, rc, "job", q->route.job);
        return false;
    }
    return true;
}

/* An optional integer query parameter in [lo, hi]; false with a 400 in r when malformed. */
bool api_query_int(api_req *q, api_resp *r, const char *name, int64_t lo, int64_t hi,
                   int64_t dflt, int64_t *out)
{
    const char *v = api_query(q, name);
    *out = dflt;
    if (!v)
        return true;
    if (api_parse_i64(v, lo, hi, out) != 0) {
        api_error_resp(r, 400, "invalid_parameter", name, "must be an integer in [%lld, %lld]",
                       (long long)lo, (long long)hi);
        return false;
    }
    return true;
}

/* true when text (after leading spaces) starts with one of the two characters */
static bool looks_like(const char *text, char a, char b)
{
    if (!text)
        return false;
    while (*text == ' ' || *text == '\n' || *text == '\t' || *text == '\r')
        text++;
    return *text == a || *text == b;
}

/* Stored JSON (written by ampd itself) spliced in as is; null when absent. */
static void put_stored_json(api_buf *b, const char *text)
{
    if (looks_like(text, '{', '['))
        api_buf_puts(b, text);
    else if (text && *text)
        api_buf_json_str(b, text);
    else
        api_buf_puts(b, "null");
}

static void put_unix(api_buf *b, double t)
{
    if (t > 0)
        api_buf_json_num(b, t);
    else
        api_buf_puts(b, "null");
}

/* An optional whole number of o, or dflt when absent; false when present but not one. */
static bool spec_int(const json_t *o, const char *key, json_int_t dflt, json_int_t *out)
{
    const json_t *v = json_object_get(o, key);
    *out = dflt;
    if (!v)
        return true;
    if (!json_is_integer(v))
        return false;
    *out = json_integer_value(v);
    return true;
}

/* The model of a stored spec, in words, with the defaults of docs/job-spec.md: "mlp
 * 784-1024-1024-10" or "gpt 4L d256 4h T128" ("... flash" with flash attention). 0 with
 * type and text filled, -1 when the spec is not a JSON object with a well-formed model (the
 * caller writes null). */
static int model_text(const char *spec, const char **type, char *text, size_t len)
{
    static const json_int_t dflt_layers[] = {784, 1024, 1024, 10};
    json_t *root = spec ? json_loads(spec, JSON_REJECT_DUPLICATES, NULL) : NULL;
    const json_t *m, *v;
    const char *t = "mlp";
    size_t off = 0;
    int rc = -1;

    if (!json_is_object(root))
        goto fail;
    m = json_object_get(root, "model");
    if (m && !json_is_object(m))
        goto fail;
    v = json_object_get(m, "type");
    if (v && !(t = json_string_value(v)))
        goto fail;
    if (strcmp(t, "gpt") == 0) {
        json_int_t nl, nh, d, T;
        if (!spec_int(m, "n_layer", 4, &nl) || !spec_int(m, "n_head", 4, &nh) ||
            !spec_int(m, "d_model", 256, &d) || !spec_int(m, "seq_len", 128, &T))
            goto fail;
        const char *attn = json_string_value(json_object_get(m, "attention"));
        *type = "gpt";
        off = (size_t)snprintf(text, len, "gpt %lldL d%lld %lldh T%lld%s", (long long)nl,
                               (long long)d, (long long)nh, (long long)T,
                               attn && strcmp(attn, "flash") == 0 ? " flash" : "");
    } else if (strcmp(t, "mlp") == 0) {
        size_t n;
        v = json_object_get(m, "layers");
        if (v && (!json_is_array(v) || json_array_size(v) == 0))
            goto fail;
        n = v ? json_array_size(v) : sizeof(dflt_layers) / sizeof(dflt_layers[0]);
        *type = "mlp";
        off = (size_t)snprintf(text, len, "mlp");
        for (size_t i = 0; i < n && off < len; i++) {
            const json_t *w = v ? json_array_get(v, i) : NULL;
            if (w && !json_is_integer(w))
                goto fail;
            off += (size_t)snprintf(text + off, len - off, "%c%lld", i ? '-' : ' ',
                                    (long long)(w ? json_integer_value(w) : dflt_layers[i]));
        }
    } else {
        goto fail;
    }
    rc = off < len ? 0 : -1;
fail:
    json_decref(root);
    return rc;
}

/* "queue": a queued or preempted job's position, priority and what it waits for; null
 * otherwise. */
static void put_queue_place(api_buf *b, const store_job *j, const api_jobs *jobs)
{
    api_queue_place p;
    api_buf_puts(b, ",\"queue\":");
    if (!store_status_waiting(j->status) || !jobs || !jobs->queued ||
        jobs->queued(jobs->ctx, j->id, &p) != 0) {
        api_buf_puts(b, "null");
        return;
    }
    api_buf_printf(b, "{\"position\":%d,\"priority\":%d,\"waiting_for\":", p.position,
                   p.priority);
    api_buf_json_str(b, p.waiting_for);
    api_buf_putc(b, '}');
}

/* "branches": the ids of the jobs branched from job id, oldest first. */
static void put_branches(api_buf *b, store *st, int64_t id)
{
    int64_t *ids = NULL;
    int n = 0;
    api_buf_puts(b, ",\"branches\":[");
    if (store_job_branches(st, id, &ids, &n) == 0)
        for (int i = 0; i < n; i++)
            api_buf_printf(b, "%s%lld", i ? "," : "", (long long)ids[i]);
    api_buf_putc(b, ']');
    free(ids);
}

void api_job_json(api_buf *b, const store_job *j, bool full, store *st, const api_jobs *jobs)
{
    const char *mtype = NULL;
    char mtext[256];
    double frac = j->steps > 0 ? (double)j->step / (double)j->steps : 0.0;
    if (frac > 1)
        frac = 1;
    if (frac < 0)
        frac = 0;
    api_buf_printf(b, "{\"id\":%lld,\"name\":", (long long)j->id);
    api_buf_json_str(b, j->name);
    api_buf_puts(b, ",\"dtype\":");
    api_buf_json_str(b, j->dtype);
    api_buf_puts(b, ",\"model\":");
    if (model_text(j->spec, &mtype, mtext, sizeof(mtext)) == 0) {
        api_buf_printf(b, "{\"type\":\"%s\",\"text\":", mtype);
        api_buf_json_str(b, mtext);
        api_buf_putc(b, '}');
    } else {
        api_buf_puts(b, "null");
    }
    api_buf_puts(b, ",\"status\":");
    api_buf_json_str(b, store_status_name(j->status));
    api_buf_printf(b,
                   ",\"progress\":{\"step\":%lld,\"steps\":%lld,\"fraction\":", (long long)j->step,
                   (long long)j->steps);
    api_buf_json_num(b, frac);
    api_buf_puts(b, "},\"created_at\":");
    api_buf_json_time(b, j->created_at);
    api_buf_puts(b, ",\"started_at\":");
    api_buf_json_time(b, j->started_at);
    api_buf_puts(b, ",\"finished_at\":");
    api_buf_json_time(b, j->finished_at);
    api_buf_puts(b, ",\"created_at_unix\":");
    put_unix(b, j->created_at);
    api_buf_puts(b, ",\"started_at_unix\":");
    put_unix(b, j->started_at);
    api_buf_puts(b, ",\"finished_at_unix\":");
    put_unix(b, j->finished_at);
    api_buf_printf(b,
                   ",\"retries\":%d,\"checkpoint_step\":%lld,\"checkpoint_bytes\":%lld,"
                   "\"cancel_requested\":%s,\"error\":",
                   j->retries, (long long)j->checkpoint_step, (long long)j->checkpoint_bytes,
                   j->cancel_requested ? "true" : "false");
    api_buf_json_str(b, j->error);
    api_buf_puts(b, ",\"summary\":");
    put_stored_json(b, looks_like(j->summary, '{', '{') ? j->summary : NULL);
    api_buf_puts(b, ",\"launch\":");
    put_stored_json(b, looks_like(j->launch, '{', '{') ? j->launch : NULL);
    api_buf_puts(b, ",\"branch\":");
    put_stored_json(b, looks_like(j->branch, '{', '{') ? j->branch : NULL);
    put_queue_place(b, j, jobs);
    if (st) {
        api_buf_puts(b, ",\"plateau\":");
        api_put_plateau(b, st, j->id);
        put_branches(b, st, j->id);
    }
    if (full) {
        api_buf_puts(b, ",\"spec\":");
        put_stored_json(b, looks_like(j->spec, '{', '{') ? j->spec : NULL);
    }
    api_buf_putc(b, '}');
}

/* ---- healthz, system ------------------------------------------------------------------- */

/* Liveness, and whether the store writes: while it cannot (a full disk, another process's
 * lock), "degraded" with the reason; still 200, the daemon is up and holds what it could
 * not write (restarting it would not help). */
void api_h_healthz(api_req *q, api_resp *r)
{
    store_health h;
    store_get_health(q->srv->st, &h);
    ok_json(r, 200);
    if (h.code == 0) {
        api_buf_puts(&r->body, "{\"status\":\"ok\"}");
        return;
    }
    api_buf_puts(&r->body, "{\"status\":\"degraded\",\"reason\":");
    api_buf_json_str(&r->body, h.reason);
    api_buf_puts(&r->body, ",\"message\":");
    api_buf_json_str(&r->body, h.message);
    api_buf_printf(&r->body, ",\"held\":%lld,\"since\":", (long long)h.held);
    api_buf_json_time(&r->body, h.since);
    api_buf_puts(&r->body, ",\"since_unix\":");
    put_unix(&r->body, h.since);
    api_buf_putc(&r->body, '}');
}

/* The API's own description (docs/openapi.yaml, embedded as JSON when ampd was built). */
void api_h_openapi(api_req *q, api_resp *r)
{
    (void)q;
    ok_json(r, 200);
    api_buf_put(&r->body, api_openapi_json, api_openapi_json_len);
}

#define API_MAX_GPUS 16
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static char cuda_text[256];
static bool cuda_ok;
static gpu_cuda_device cuda_devs[API_MAX_GPUS];
static int cuda_ndevs;

static void probe_cuda(void)
{
    cuda_ok = gpu_cuda_probe(cuda_text, sizeof(cuda_text)) == 0;
    if (cuda_ok)
        (void)gpu_cuda_devices(cuda_devs, API_MAX_GPUS, &cuda_ndevs);
}

/* See api_int.h. */
void api_system_probe(void)
{
    pthread_once(&cuda_once, probe_cuda);
}

/* The GPUs, as [{"index", "name", "memory_bytes", "compute_capability", "multiprocessors"}]. */
static void put_gpus(api_buf *b)
{
    api_buf_putc(b, '[');
    for (int i = 0; i < cuda_ndevs; i++) {
        const gpu_cuda_device *d = &cuda_devs[i];
        api_buf_printf(b, "%s{\"index\":%d,\"name\":", i ? "," : "", i);
        api_buf_json_str(b, d->name);
        api_buf_printf(b,
                       ",\"memory_bytes\":%llu,\"compute_capability\":\"%d.%d\","
                       "\"multiprocessors\":%d}",
                       (unsigned long long)d->memory_bytes, d->cc_major, d->cc_minor,
                       d->multiprocessors);
    }
    api_buf_putc(b, ']');
}

/* The machine's cores and GPUs and the jobs that hold them, as the scheduler keeps them. */
void api_h_resources(api_req *q, api_resp *r)
{
    api_server *s = q->srv;
    json_t *o = s->jobs && s->jobs->resources ? s->jobs->resources(s->jobs->ctx) : NULL;
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!text) {
        api_error_resp(r, 503, "unavailable", NULL,
                       s->jobs ? "out of memory" : "the scheduler is not running");
        return;
    }
    ok_json(r, 200);
    api_buf_puts(&r->body, text);
    free(text);
}

void api_h_system(api_req *q, api_resp *r)
{
    api_server *s = q->srv;
    api_buf *b = &r->body;
    api_queue_info info;
    store_stats stats;
    gpu_autocast ac;
    json_t *acj;
    char *acs;

    pthread_once(&cuda_once, probe_cuda);
    gpu_autocast_defaults(&ac);
    acj = api_autocast_to_json(&ac);
    acs = acj ? json_dumps(acj, JSON_COMPACT) : NULL;
    json_decref(acj);
    store_get_stats(s->st, &stats);
    memset(&info, 0, sizeof(info));
    if (s->jobs)
        s->jobs->info(s->jobs->ctx, &info);

    ok_json(r, 200);
    api_buf_puts(b, "{\"devices\":{\"cpu\":{\"model\":");
    api_buf_json_str(b, s->cpu_model);
    api_buf_printf(b, ",\"cores\":%d},\"cuda\":{\"available\":%s,\"detail\":", s->cores,
                   cuda_ok ? "true" : "false");
    api_buf_json_str(b, cuda_text);
    api_buf_puts(b, ",\"gpus\":");
    put_gpus(b);
    /* the backend a job with "device": "auto" gets */
    api_buf_printf(b, "}},\"backend\":\"%s\",\"versions\":{\"ampd\":", cuda_ok ? "cuda" : "cpu");
    api_buf_json_str(b, PACKAGE_VERSION);
    api_buf_puts(b, ",\"sqlite\":");
    api_buf_json_str(b, sqlite3_libversion());
    api_buf_puts(b, ",\"libmicrohttpd\":");
    api_buf_json_str(b, MHD_get_version());
    api_buf_puts(b, ",\"jansson\":");
    api_buf_json_str(b, jansson_version_str());
    api_buf_puts(b, ",\"blas\":");
    api_buf_json_str(b, s->blas_info);
    api_buf_puts(b, "},\"gemm\":{\"fp32\":");
    api_buf_json_str(b, gpu_gemm_info(GPU_FP32));
    api_buf_puts(b, ",\"fp16\":");
    api_buf_json_str(b, gpu_gemm_info(GPU_FP16));
    api_buf_puts(b, ",\"bf16\":");
    api_buf_json_str(b, gpu_gemm_info(GPU_BF16));
    api_buf_puts(b, "},\"autocast\":");
    api_buf_puts(b, acs ? acs : "null");
    free(acs);
    if (s->jobs)
        api_buf_printf(b,
                       ",\"queue\":{\"running\":%d,\"queued\":%d,\"max_running\":%d,"
                       "\"workers_started\":%lld,\"workers_failed\":%lld}",
                       info.running, info.queued, info.max_running, (long long)info.workers_started,
                       (long long)info.workers_failed);
    else
        api_buf_puts(b, ",\"queue\":null");
    api_buf_printf(b, ",\"capacity\":{\"max_running\":%d,\"free_slots\":%d,\"cpu_cores\":%d}",
                   info.max_running,
                   info.max_running > info.running ? info.max_running - info.running : 0, s->cores);
    api_buf_puts(b, ",\"jobs\":{");
    for (int i = 0; i < STORE_NSTATUS; i++)
        api_buf_printf(b, "%s\"%s\":%lld", i ? "," : "", store_status_name((store_status)i),
                       (long long)stats.jobs_by_status[i]);
    api_buf_printf(b, "},\"store\":{\"metric_rows\":%lld,\"queue_depth\":%lld,\"batches\":%lld}",
                   (long long)stats.metric_rows, (long long)stats.queue_depth,
                   (long long)stats.batches);
    api_buf_printf(b, ",\"auth\":{\"token_required\":%s}}", s->cfg.token[0] ? "true" : "false");
}

/* ---- jobs ------------------------------------------------------------------------------ */

void api_h_jobs_list(api_req *q, api_resp *r)
{
    store_job_filter f = {.status = -1};
    store_job *jobs = NULL;
    int n = 0, rc;
    int64_t limit, after;
    const char *v;

    if ((v = api_query(q, "status"))) {
        store_status st;
        if (store_status_parse(v, &st) != 0) {
#define STATUS_LIST_(id, name) ", " name
            static const char list[] = STORE_STATUSES(STATUS_LIST_); /* ", queued, ..." */
#undef STATUS_LIST_
            api_error_resp(r, 400, "invalid_parameter", "status", "must be one of %s", &list[2]);
            return;
        }
        f.status = (int)st;
    }
    if ((v = api_query(q, "dtype"))) {
        gpu_dtype dt;
        if (gpu_dtype_parse(v, &dt) != 0 && strcmp(v, "fp8") != 0) {
            api_error_resp(r, 400, "invalid_parameter", "dtype", "must be fp32, fp16, bf16 or fp8");
            return;
        }
        f.dtype = v;
    }
    if ((v = api_query(q, "name"))) {
        if (!*v || strlen(v) >= sizeof(((store_job *)0)->name)) {
            api_error_resp(r, 400, "invalid_parameter", "name", "must be 1 to %zu bytes",
                           sizeof(((store_job *)0)->name) - 1);
            return;
        }
        f.name = v;
    }
    if (!api_query_int(q, r, "limit", 1, 1000, 50, &limit) ||
        !api_query_int(q, r, "after", 1, INT64_MAX, 0, &after))
        return;
    f.limit = (int)limit;
    f.after = after;
    rc = store_job_list(q->srv->st, &f, &jobs, &n);
    if (rc) {
        store_error(r, rc, "job", 0);
        return;
    }
    ok_json(r, 200);
    api_buf_puts(&r->body, "{\"jobs\":[");
    for (int i = 0; i < n; i++) {
        if (i)
            api_buf_putc(&r->body, ',');
        api_job_json(&r->body, &jobs[i], false, NULL, q->srv->jobs);
    }
    if (n == f.limit && n > 0)
        api_buf_printf(&r->body, "],\"next\":%lld}", (long long)jobs[n - 1].id);
    else
        api_buf_puts(&r->body, "],\"next\":null}");
    store_jobs_free(jobs, n);
}

/* An Idempotency-Key is 1..200 visible ASCII characters. */
static bool idem_key_ok(const char *k)
{
    size_t n = strlen(k);
    if (n == 0 || n > IDEM_KEY_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)k[i] < 0x21 || (unsigned char)k[i] > 0x7e)
            return false;
    return true;
}

/* Whether spec (the request's effective spec) is the same JSON as stored, the effective spec
 * the job was queued with: equal values, the order of an object's members and the
 * whitespace aside (so a request that spells out a default is the same request). */
static bool same_spec(const char *stored, const char *spec)
{
    json_t *a = stored ? json_loads(stored, JSON_REJECT_DUPLICATES, NULL) : NULL;
    json_t *b = json_loads(spec, JSON_REJECT_DUPLICATES, NULL);
    bool same = a && b && json_equal(a, b);
    json_decref(a);
    json_decref(b);
    return same;
}

/* Whether job c (spec: the spec as sent) can ever run here: it fits the machine (the
 * scheduler's admission) and its data can train its model; else e says why. */
bool api_job_can_run(const api_jobs *jobs, const gpu_job_config *c, json_t *spec, api_error *e)
{
    if (jobs->admit && jobs->admit(jobs->ctx, c, e) != 0)
        return false;
    return api_spec_check_data(c, spec, e) == 0;
}

void api_h_jobs_submit(api_req *q, api_resp *r)
{
    api_server *s = q->srv;
    gpu_job_config cfg;
    api_error e;
    char *spec;
    store_job j;
    const char *key;
    int64_t id = 0;
    bool existed = false;
    int rc;

    if (!q->body || q->body_len == 0) {
        api_error_resp(r, 400, "invalid_json", NULL, "the request body is empty (send a job spec)");
        return;
    }
    if (api_json_depth(q->body, q->body_len) > SPEC_MAX_DEPTH) {
        api_error_resp(r, 400, "invalid_json", NULL, "the JSON nests deeper than %d levels",
                       SPEC_MAX_DEPTH);
        return;
    }
    key = MHD_lookup_connection_value(q->conn, MHD_HEADER_KIND, "Idempotency-Key");
    if (key && !idem_key_ok(key)) {
        api_error_resp(r, 400, "invalid_request", "Idempotency-Key",
                       "must be 1 to %d visible ASCII characters", IDEM_KEY_MAX);
        return;
    }
    memset(&e, 0, sizeof(e));
    if (api_spec_parse(q->body, q->body_len, &s->cfg.spec, &cfg, &e) != 0) {
        api_error_resp(r, 400, e.code[0] ? e.code : "invalid_spec", e.field[0] ? e.field : NULL,
                       "%s", e.message);
        return;
    }
    if (!s->jobs) {
        api_error_resp(r, 503, "unavailable", NULL, "the scheduler is not running");
        return;
    }
    json_t *sent = json_loadb(q->body, q->body_len, 0, NULL);
    bool can = api_job_can_run(s->jobs, &cfg, sent, &e);
    json_decref(sent);
    if (!can) {
        api_error_resp(r, 422, e.code, e.field, "%s", e.message);
        return;
    }
    /* the spec as the worker will resolve it (every default filled in, data paths resolved),
     * so that a resume by a later ampd with other defaults runs the job that was queued */
    if (!(spec = api_spec_effective(&cfg))) {
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        return;
    }
    rc = s->jobs->submit(s->jobs->ctx, cfg.name, gpu_job_dtype_name(&cfg), cfg.steps, spec, key,
                         &id, &existed);
    if (rc) {
        free(spec);
        api_store_error(r, rc, "job", id, true);
        return;
    }
    rc = store_job_get(s->st, id, &j);
    if (rc) {
        free(spec);
        store_error(r, rc, "job", id);
        return;
    }
    /* a retry repeats its request: the key of another request is a client's mistake */
    bool same = !existed || same_spec(j.spec, spec);
    free(spec);
    if (!same) {
        api_error_resp(r, 422, "idempotency_key_reused", "Idempotency-Key",
                       "the Idempotency-Key \"%s\" was used for job %lld with another body; "
                       "send a new key for a new job (or the same body to get job %lld back)",
                       key, (long long)id, (long long)id);
        store_job_clear(&j);
        return;
    }
    ok_json(r, existed ? 200 : 201);
    snprintf(r->location, sizeof(r->location), "/v1/jobs/%lld", (long long)id);
    api_job_json(&r->body, &j, true, NULL, q->srv->jobs);
    store_job_clear(&j);
}

void api_h_job_get(api_req *q, api_resp *r)
{
    store_job j;
    if (!api_load_job(q, r, &j))
        return;
    ok_json(r, 200);
    api_job_json(&r->body, &j, true, q->srv->st, q->srv->jobs);
    store_job_clear(&j);
}

/* What each action on a job does, and in which states it may. */
static const struct {
    api_route_id route;
    const char *verb, *when;
} job_actions[] = {
    {API_R_JOB_CANCEL, "cancelled", "only a queued, preempted, paused or running job can be"},
    {API_R_JOB_RESUME, "resumed", "only a cancelled, failed or interrupted job can be"},
    {API_R_JOB_PAUSE, "paused", "only a queued, preempted or running job can be"},
    {API_R_JOB_UNPAUSE, "unpaused", "only a paused job can be"},
    {API_R_JOB_PRIORITY, "re-prioritised", "only a job that has not finished can be"},
    {API_R_JOB, "deleted", "a queued, preempted or running job cannot be"},
};

static int job_action_call(const api_jobs *jobs, api_route_id what, int64_t id, int priority)
{
    switch (what) {
    case API_R_JOB_PRIORITY:
        return jobs->set_priority ? jobs->set_priority(jobs->ctx, id, priority) : STORE_ECONFLICT;
    case API_R_JOB_CANCEL:
        return jobs->cancel(jobs->ctx, id);
    case API_R_JOB_RESUME:
        return jobs->resume(jobs->ctx, id);
    case API_R_JOB_PAUSE:
        return jobs->pause ? jobs->pause(jobs->ctx, id) : STORE_ECONFLICT;
    case API_R_JOB_UNPAUSE:
        return jobs->unpause ? jobs->unpause(jobs->ctx, id) : STORE_ECONFLICT;
    default:
        return jobs->remove(jobs->ctx, id);
    }
}

/* The body of POST /v1/jobs/{id}/priority, {"priority": N}: true with *out, else false with
 * a 400 in r. */
static bool priority_of(const api_req *q, api_resp *r, int *out)
{
    json_t *b = NULL, *v;
    bool ok = false;
    if (q->body && q->body_len > 0 && api_json_depth(q->body, q->body_len) <= 2)
        b = json_loadb(q->body, q->body_len, JSON_REJECT_DUPLICATES, NULL);
    v = json_object_get(b, "priority");
    if (json_is_object(b) && json_object_size(b) == 1 && json_is_integer(v) &&
        json_integer_value(v) >= -1000 && json_integer_value(v) <= 1000) {
        *out = (int)json_integer_value(v);
        ok = true;
    } else {
        api_error_resp(r, 400, "invalid_parameter", "priority",
                       "send {\"priority\": N} with N an integer from -1000 to 1000 (higher "
                       "first)");
    }
    json_decref(b);
    return ok;
}

void api_h_job_action(api_req *q, api_resp *r)
{
    api_server *s = q->srv;
    api_route_id what = q->route.id;
    const char *verb = "deleted", *when = "";
    store_job j;
    int rc, priority = 0;

    for (size_t i = 0; i < sizeof(job_actions) / sizeof(job_actions[0]); i++)
        if (job_actions[i].route == what) {
            verb = job_actions[i].verb;
            when = job_actions[i].when;
        }
    if (!api_load_job(q, r, &j))
        return;
    store_job_clear(&j);
    if (!s->jobs) {
        api_error_resp(r, 503, "unavailable", NULL, "the scheduler is not running");
        return;
    }
    if (what == API_R_JOB_PRIORITY && !priority_of(q, r, &priority))
        return;
    rc = job_action_call(s->jobs, what, q->route.job, priority);
    if (rc == STORE_ECONFLICT) {
        char now[32] = "in another state";
        if (store_job_get(s->st, q->route.job, &j) == 0) {
            snprintf(now, sizeof(now), "%s", store_status_name(j.status));
            store_job_clear(&j);
        }
        api_error_resp(r, 409, "conflict", NULL, "job %lld is %s; %s %s", (long long)q->route.job,
                       now, when, verb);
        return;
    }
    if (rc) {
        api_store_error(r, rc, "job", q->route.job, true);
        return;
    }
    if (what == API_R_JOB) {
        r->status = 204;
        return;
    }
    rc = store_job_get(s->st, q->route.job, &j);
    if (rc) {
        store_error(r, rc, "job", q->route.job);
        return;
    }
    ok_json(r, what == API_R_JOB_PRIORITY ? 200 : 202); /* a new priority holds at once */
    api_job_json(&r->body, &j, true, NULL, q->srv->jobs);
    store_job_clear(&j);
}

/* ---- metrics --------------------------------------------------------------------------- */

/* The metrics body is produced while it is sent (MHD calls series_read on the connection's
 * thread), a piece of at most PIECE_POINTS points at a time: a raw series is read from the
 * store RAW_CHUNK_STEPS steps at a time, so no response sits in memory whole. */
#define PIECE_POINTS 2048

#define LINEAGE_MAX (API_BRANCH_MAX_DEPTH + 1)

typedef struct {
    int64_t job, hi;
} lineage_seg;

typedef struct {
    api_server *srv;
    int64_t job;
    api_series_enc enc;
    api_buf out;
    size_t off;
    store_series se; /* downsampled: the whole answer; raw: the current chunk */
    bool have_se, raw_done, ended, failed;
    int idx; /* next point of se to encode */
    int64_t lo, hi_limit, known_end, total;
    /* raw: the jobs read one after the other (one, or a branch's lineage root first), each
     * up to step hi; from, to and end: the request's range and the job's last step */
    lineage_seg seg[LINEAGE_MAX];
    int nseg, iseg;
    int64_t from, to, end;
} series_stream;

static void series_free(void *cls)
{
    series_stream *ss = cls;
    if (!ss)
        return;
    if (ss->have_se)
        store_series_free(&ss->se);
    api_buf_free(&ss->out);
    free(ss);
}

/* Read the next chunk of a raw series into ss->se. */
static int raw_chunk(series_stream *ss)
{
    int64_t lo = ss->lo;
    int64_t hi = ss->hi_limit - lo < RAW_CHUNK_STEPS ? ss->hi_limit : lo + RAW_CHUNK_STEPS - 1;
    int rc = store_series_query(ss->srv->st, ss->enc.job, ss->enc.fields, ss->enc.nfields, lo, hi,
                                0, &ss->se);
    if (rc)
        return rc;
    ss->have_se = true;
    ss->idx = 0;
    ss->total += ss->se.total_steps;
    if (ss->se.npoints > 0 && ss->se.points[ss->se.npoints - 1].step_last > ss->known_end)
        ss->known_end = ss->se.points[ss->se.npoints - 1].step_last;
    /* an empty chunk past the job's last known step ends the series, whatever `to` says:
     * rows beyond it are still read while they keep coming, but a large `to` never makes
     * the reader walk an empty range chunk by chunk */
    ss->raw_done = hi >= ss->hi_limit || (ss->se.npoints == 0 && hi >= ss->known_end);
    ss->lo = hi + 1;
    return 0;
}

/* Read segment i of a raw series from here on: its job's steps after the previous
 * segment's end, within the request's range. */
static void series_segment(series_stream *ss, int i)
{
    const lineage_seg *g = &ss->seg[i];
    int64_t lo = i > 0 && ss->seg[i - 1].hi + 1 > ss->from ? ss->seg[i - 1].hi + 1 : ss->from;
    ss->iseg = i;
    ss->enc.job = g->job;
    ss->lo = lo;
    ss->hi_limit = g->hi < ss->to ? g->hi : ss->to;
    ss->known_end = i == ss->nseg - 1 ? ss->end : ss->hi_limit;
    ss->raw_done = lo > ss->hi_limit;
}

/* ss->seg: job j alone, or with lineage its ancestors first, root first, each up to the
 * step its child branched at. An ancestor deleted since ends the walk up there. */
static int series_lineage(series_stream *ss, const store_job *j, bool lineage)
{
    lineage_seg rev[LINEAGE_MAX];
    int n = 0, rc = 0;
    store_job a, cur;
    rev[n++] = (lineage_seg){j->id, INT64_MAX};
    memset(&cur, 0, sizeof(cur));
    int64_t parent = lineage ? j->parent_id : 0, step = api_branch_step(j->branch);
    while (parent > 0 && n < LINEAGE_MAX) {
        rc = store_job_get(ss->srv->st, parent, &a);
        if (rc == STORE_ENOTFOUND) {
            rc = 0;
            break;
        }
        if (rc)
            break;
        rev[n++] = (lineage_seg){parent, step};
        store_job_clear(&cur);
        cur = a;
        parent = cur.parent_id;
        step = api_branch_step(cur.branch);
    }
    store_job_clear(&cur);
    ss->nseg = n;
    for (int i = 0; i < n; i++)
        ss->seg[i] = rev[n - 1 - i];
    ss->enc.lineage = lineage;
    ss->enc.nlineage = n;
    for (int i = 0; i < n; i++)
        ss->enc.ids[i] = ss->seg[i].job;
    return rc;
}

/* Append the next piece of the body to ss->out. */
static void series_piece(series_stream *ss)
{
    if (ss->have_se && ss->idx < ss->se.npoints) {
        int n = ss->se.npoints - ss->idx < PIECE_POINTS ? ss->se.npoints - ss->idx : PIECE_POINTS;
        api_series_points(&ss->enc, &ss->out, &ss->se, ss->idx, n);
        ss->idx += n;
        return;
    }
    if (ss->have_se) {
        store_series_free(&ss->se);
        ss->have_se = false;
    }
    if (ss->enc.raw && ss->raw_done && ss->iseg + 1 < ss->nseg) {
        series_segment(ss, ss->iseg + 1);
        return;
    }
    if (ss->enc.raw && !ss->raw_done) {
        int rc = raw_chunk(ss);
        if (rc) {
            log_warn("job %lld: metrics: the store failed mid-response (%d)", (long long)ss->job,
                     rc);
            ss->failed = true;
        }
        return;
    }
    api_series_end(&ss->enc, &ss->out, ss->total);
    ss->ended = true;
}

static ssize_t series_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    series_stream *ss = cls;
    (void)pos;
    for (;;) {
        if (ss->off < ss->out.len) {
            size_t n = ss->out.len - ss->off < max ? ss->out.len - ss->off : max;
            memcpy(buf, ss->out.data + ss->off, n);
            ss->off += n;
            return (ssize_t)n;
        }
        if (ss->out.oom || ss->failed)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        api_buf_reset(&ss->out);
        ss->off = 0;
        if (ss->ended)
            return MHD_CONTENT_READER_END_OF_STREAM;
        series_piece(ss);
    }
}

void api_h_job_metrics(api_req *q, api_resp *r)
{
    api_server *s = q->srv;
    series_stream *ss;
    store_job j;
    int64_t from, to, points;
    const char *v;
    char err[160];
    bool lineage = false;
    int rc;

    ss = calloc(1, sizeof(*ss));
    if (!ss) {
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        return;
    }
    api_buf_init(&ss->out);
    if ((v = api_query(q, "fields"))) {
        if (api_parse_fields(v, ss->enc.fields, &ss->enc.nfields, err, sizeof(err)) != 0) {
            api_error_resp(r, 400, "invalid_parameter", "fields", "%s", err);
            goto fail;
        }
    } else {
        ss->enc.nfields = STORE_M_NFIELDS;
        for (int i = 0; i < STORE_M_NFIELDS; i++)
            ss->enc.fields[i] = i;
    }
    if (!api_query_int(q, r, "from", 0, INT64_MAX, 0, &from) ||
        !api_query_int(q, r, "to", 0, INT64_MAX, -1, &to) ||
        !api_query_int(q, r, "points", 0, MAX_POINTS, 0, &points))
        goto fail;
    if (to >= 0 && to < from) {
        api_error_resp(r, 400, "invalid_parameter", "to", "must not be below from (%lld)",
                       (long long)from);
        goto fail;
    }
    if ((v = api_query(q, "format"))) {
        if (strcmp(v, "csv") == 0) {
            ss->enc.csv = true;
        } else if (strcmp(v, "json") != 0) {
            api_error_resp(r, 400, "invalid_parameter", "format", "must be json or csv");
            goto fail;
        }
    }
    if ((v = api_query(q, "lineage"))) {
        lineage = strcmp(v, "true") == 0 || strcmp(v, "1") == 0;
        if (!lineage && strcmp(v, "false") != 0 && strcmp(v, "0") != 0) {
            api_error_resp(r, 400, "invalid_parameter", "lineage", "must be true or false");
            goto fail;
        }
        if (lineage && points > 0) {
            api_error_resp(r, 400, "invalid_parameter", "lineage",
                           "needs the raw series (points=0): a branch's ancestors are not "
                           "downsampled together");
            goto fail;
        }
    }
    if (!api_load_job(q, r, &j))
        goto fail;
    ss->srv = s;
    ss->job = j.id;
    ss->enc.raw = points == 0;
    ss->from = from;
    ss->to = to >= 0 ? to : INT64_MAX;
    ss->end = j.step;
    rc = series_lineage(ss, &j, lineage);
    store_job_clear(&j);
    /* The first read happens here, so that a store failure is still a proper 503. */
    if (rc == 0 && ss->enc.raw) {
        series_segment(ss, 0);
        rc = ss->raw_done ? 0 : raw_chunk(ss);
    } else if (rc == 0) {
        rc = store_series_query(s->st, ss->job, ss->enc.fields, ss->enc.nfields, from, to,
                                (int)points, &ss->se);
        ss->have_se = rc == 0;
        ss->total = rc == 0 ? ss->se.total_steps : 0;
    }
    if (rc) {
        store_error(r, rc, "metrics of job", q->route.job);
        goto fail;
    }
    api_series_begin(&ss->enc, &ss->out, ss->job);
    if (ss->enc.csv) {
        r->ctype = "text/csv; charset=utf-8";
        snprintf(r->disposition, sizeof(r->disposition),
                 "attachment; filename=\"job-%lld-metrics.csv\"", (long long)ss->job);
    }
    r->status = 200;
    r->reader = series_read;
    r->reader_free = series_free;
    r->reader_cls = ss;
    return;
fail:
    series_free(ss);
}

/* ---- layers, events, checkpoints ------------------------------------------------------- */

/* GET /v1/jobs/{id}/layers has two shapes.
 *
 * One step (no parameter, or ?step=N; 404 when step N has no stats):
 *   {"job", "step", "scale", "first_nonfinite": {"layer", "where"} | null,
 *    "nonfinite": bool, "overflow": bool,
 *    "layers": [{"name", "dtype", "act_amax", "act_headroom", "act_overflow", "grad_amax",
 *                "grad_underflow", "grad_underflow_unscaled", "grad_nonfinite",
 *                "lost_updates"}, ...]}
 * with "step": null and "layers": [] while the job has no diagnosed step yet.
 *
 * A heatmap (any of from, to, steps, fields): the diagnosed steps in [from, to], at most
 * `steps` of them (default 200, at most 2000) picked evenly, never dropping a step with a
 * non-finite value or an overflow unless those alone are more than `steps`:
 *   {"job", "from", "to", "total_steps", "steps": [s...], "scale": [...],
 *    "nonfinite": [bool...], "overflow": [bool...], "first_nonfinite": [null | {...}...],
 *    "layers": [name...], "dtypes": [dtype...],
 *    "fields": {"<field>": [[value per step] per layer], ...}}
 * fields (default act_headroom,grad_underflow,grad_underflow_unscaled,act_amax,grad_amax)
 * lists any of the layer fields. A value is null where the layer had no row or did not
 * report the field; NaN and +-Inf are the strings "NaN", "Infinity", "-Infinity". */
#define LAYER_DEFAULT_STEPS 200
#define LAYER_MAX_STEPS 2000

/* A layer field value: counts as integers, null when missing. */
static void put_layer_value(api_buf *b, int field, double v, bool present)
{
    if (!present)
        api_buf_puts(b, "null");
    else if ((field == STORE_L_ACT_OVERFLOW || field == STORE_L_GRAD_NONFINITE) && isfinite(v) &&
             v == floor(v) && fabs(v) < 9e15)
        api_buf_printf(b, "%lld", (long long)v);
    else
        api_buf_json_num(b, v);
}

static void put_first_nonfinite(api_buf *b, const store_layer_info *info)
{
    if (!info->first_layer[0]) {
        api_buf_puts(b, "null");
        return;
    }
    api_buf_puts(b, "{\"layer\":");
    api_buf_json_str(b, info->first_layer);
    api_buf_puts(b, ",\"where\":");
    api_buf_json_str(b, info->first_where[0] ? info->first_where : NULL);
    api_buf_putc(b, '}');
}

/* "act_amax, act_headroom, ...": the layer fields, from a string constant that starts ", ". */
#define LAYER_NAME_(id, name, ...) ", " #name
#define LAYER_NAMES (&STORE_LAYER_FIELDS(LAYER_NAME_)[2])

/* A comma-separated list of layer field names into fields; false with a 400 in r. */
static bool parse_layer_fields(const char *v, int *fields, int *n, api_resp *r)
{
    const char *p = v;
    *n = 0;
    for (;;) {
        size_t len = strcspn(p, ",");
        char item[40];
        int f = -1;
        if (len > 0 && len < sizeof(item)) {
            memcpy(item, p, len);
            item[len] = '\0';
            f = store_layer_field_parse(item);
        }
        if (f < 0) {
            if (len == 0)
                api_error_resp(r, 400, "invalid_parameter", "fields",
                               "empty field name in the list");
            else
                api_error_resp(r, 400, "invalid_parameter", "fields",
                               "unknown layer field \"%.*s\" (%s)",
                               (int)(len < 40 ? len : 40), p, LAYER_NAMES);
            return false;
        }
        for (int i = 0; i < *n; i++)
            if (fields[i] == f) {
                api_error_resp(r, 400, "invalid_parameter", "fields", "field \"%s\" listed twice",
                               item);
                return false;
            }
        fields[(*n)++] = f;
        if (!p[len])
            return true;
        p += len + 1;
    }
}

/* ,"recommendations": the job's recommendation events up to step (every one when step < 0)
 * with their data (the layer, the remedy), oldest first; [] when they cannot be read. */
static void put_recommendations(api_buf *b, store *st, int64_t job, int64_t step)
{
    store_event *ev = NULL;
    int64_t after = 0;
    int n = 0, k = 0;
    api_buf_puts(b, ",\"recommendations\":[");
    while (store_event_list(st, job, after, 500, &ev, &n) == 0 && n > 0) {
        for (int i = 0; i < n; i++)
            if (strcmp(ev[i].kind, "recommendation") == 0 && (step < 0 || ev[i].step <= step)) {
                api_buf_puts(b, k++ ? ",{" : "{");
                api_put_event_fields(b, &ev[i]);
                api_buf_putc(b, '}');
            }
        after = ev[n - 1].id;
        store_events_free(ev, n);
        ev = NULL;
    }
    store_events_free(ev, n);
    api_buf_putc(b, ']');
}

static void layers_step(api_req *q, api_resp *r, int64_t job, int64_t step)
{
    store_layer_stat *rows = NULL;
    store_layer_info info;
    int64_t at = -1;
    int n = 0;
    int rc = store_layer_stats_get(q->srv->st, job, step, &rows, &n, &at, &info);
    api_buf *b = &r->body;

    if (rc == STORE_ENOTFOUND && step < 0) {
        ok_json(r, 200);
        api_buf_printf(b,
                       "{\"job\":%lld,\"step\":null,\"scale\":null,\"first_nonfinite\":null,"
                       "\"nonfinite\":false,\"overflow\":false,\"layers\":[]}",
                       (long long)job);
        return;
    }
    if (rc == STORE_ENOTFOUND) {
        api_error_resp(r, 404, "not_found", "step", "job %lld has no layer stats at step %lld",
                       (long long)job, (long long)step);
        return;
    }
    if (rc) {
        store_error(r, rc, "layer stats of job", job);
        return;
    }
    ok_json(r, 200);
    api_buf_putc(b, '{');
    api_put_layers_fields(b, job, at, &info, rows, n);
    put_recommendations(b, q->srv->st, job, step);
    api_buf_putc(b, '}');
    free(rows);
}

/* See api_int.h. */
void api_put_layers_fields(api_buf *b, int64_t job, int64_t step, const store_layer_info *info,
                           const store_layer_stat *rows, int n)
{
    api_buf_printf(b, "\"job\":%lld,\"step\":%lld,\"scale\":", (long long)job, (long long)step);
    api_buf_json_num(b, info->scale);
    api_buf_puts(b, ",\"first_nonfinite\":");
    put_first_nonfinite(b, info);
    api_buf_printf(b, ",\"nonfinite\":%s,\"overflow\":%s,\"layers\":[",
                   info->flags & STORE_LS_NONFINITE ? "true" : "false",
                   info->flags & STORE_LS_OVERFLOW ? "true" : "false");
    for (int i = 0; i < n; i++) {
        api_buf_puts(b, i ? ",{\"name\":" : "{\"name\":");
        api_buf_json_str(b, rows[i].name);
        api_buf_puts(b, ",\"dtype\":");
        api_buf_json_str(b, rows[i].dtype);
        for (int f = 0; f < STORE_L_NFIELDS; f++) {
            api_buf_printf(b, ",\"%s\":", store_layer_field_name(f));
            put_layer_value(b, f, rows[i].v[f], !((rows[i].missing >> f) & 1u));
        }
        api_buf_putc(b, '}');
    }
    api_buf_putc(b, ']');
}

static void layers_range(api_req *q, api_resp *r, int64_t job, int64_t from, int64_t to,
                         int max_steps, const int *fields, int nfields)
{
    store_layer_range lr;
    api_buf *b = &r->body;
    int rc = store_layer_stats_range(q->srv->st, job, from, to, max_steps, fields, nfields, &lr);

    if (rc == STORE_EINVAL) {
        api_error_resp(r, 400, "invalid_parameter", "steps",
                       "the answer would hold more than %d values: ask for fewer steps or fields",
                       STORE_LR_MAX_CELLS);
        return;
    }
    if (rc) {
        store_error(r, rc, "layer stats of job", job);
        return;
    }
    ok_json(r, 200);
    api_buf_printf(b, "{\"job\":%lld,\"from\":%lld,\"to\":", (long long)job, (long long)from);
    if (to >= 0)
        api_buf_printf(b, "%lld", (long long)to);
    else
        api_buf_puts(b, "null");
    api_buf_printf(b, ",\"total_steps\":%lld,\"steps\":[", (long long)lr.total_steps);
    for (int k = 0; k < lr.nsteps; k++)
        api_buf_printf(b, "%s%lld", k ? "," : "", (long long)lr.steps[k]);
    api_buf_puts(b, "],\"scale\":[");
    for (int k = 0; k < lr.nsteps; k++) {
        if (k)
            api_buf_putc(b, ',');
        api_buf_json_num(b, lr.info[k].scale);
    }
    api_buf_puts(b, "],\"nonfinite\":[");
    for (int k = 0; k < lr.nsteps; k++)
        api_buf_printf(b, "%s%s", k ? "," : "",
                       lr.info[k].flags & STORE_LS_NONFINITE ? "true" : "false");
    api_buf_puts(b, "],\"overflow\":[");
    for (int k = 0; k < lr.nsteps; k++)
        api_buf_printf(b, "%s%s", k ? "," : "",
                       lr.info[k].flags & STORE_LS_OVERFLOW ? "true" : "false");
    api_buf_puts(b, "],\"first_nonfinite\":[");
    for (int k = 0; k < lr.nsteps; k++) {
        if (k)
            api_buf_putc(b, ',');
        put_first_nonfinite(b, &lr.info[k]);
    }
    api_buf_puts(b, "],\"layers\":[");
    for (int l = 0; l < lr.nlayers; l++) {
        if (l)
            api_buf_putc(b, ',');
        api_buf_json_str(b, lr.layers[l].name);
    }
    api_buf_puts(b, "],\"dtypes\":[");
    for (int l = 0; l < lr.nlayers; l++) {
        if (l)
            api_buf_putc(b, ',');
        api_buf_json_str(b, lr.layers[l].dtype);
    }
    api_buf_puts(b, "],\"fields\":{");
    for (int f = 0; f < lr.nfields; f++) {
        api_buf_printf(b, "%s\"%s\":[", f ? "," : "", store_layer_field_name(lr.fields[f]));
        for (int l = 0; l < lr.nlayers; l++) {
            api_buf_puts(b, l ? ",[" : "[");
            for (int k = 0; k < lr.nsteps; k++) {
                size_t at = STORE_LR_AT(&lr, l, f, k);
                if (k)
                    api_buf_putc(b, ',');
                put_layer_value(b, lr.fields[f], lr.values[at], lr.has[at] != 0);
            }
            api_buf_putc(b, ']');
        }
        api_buf_putc(b, ']');
    }
    api_buf_puts(b, "}}");
    store_layer_range_free(&lr);
}

void api_h_job_layers(api_req *q, api_resp *r)
{
    static const int default_fields[] = {STORE_L_ACT_HEADROOM, STORE_L_GRAD_UNDERFLOW,
                                         STORE_L_GRAD_UNDERFLOW_UNSCALED, STORE_L_ACT_AMAX,
                                         STORE_L_GRAD_AMAX};
    int fields[STORE_L_NFIELDS], nfields = 0;
    int64_t step, from, to, steps;
    const char *fv = api_query(q, "fields");
    bool range = api_query(q, "from") || api_query(q, "to") || api_query(q, "steps") || fv;
    store_job j;

    if (!api_query_int(q, r, "step", 0, INT64_MAX, -1, &step) ||
        !api_query_int(q, r, "from", 0, INT64_MAX, 0, &from) ||
        !api_query_int(q, r, "to", 0, INT64_MAX, -1, &to) ||
        !api_query_int(q, r, "steps", 1, LAYER_MAX_STEPS, LAYER_DEFAULT_STEPS, &steps))
        return;
    if (range && step >= 0) {
        api_error_resp(r, 400, "invalid_parameter", "step",
                       "asks for one step; it cannot be combined with from, to, steps or fields");
        return;
    }
    if (to >= 0 && to < from) {
        api_error_resp(r, 400, "invalid_parameter", "to", "must not be below from (%lld)",
                       (long long)from);
        return;
    }
    if (fv) {
        if (!parse_layer_fields(fv, fields, &nfields, r))
            return;
    } else {
        nfields = (int)(sizeof(default_fields) / sizeof(default_fields[0]));
        memcpy(fields, default_fields, sizeof(default_fields));
    }
    if (!api_load_job(q, r, &j))
        return;
    store_job_clear(&j);
    if (range)
        layers_range(q, r, q->route.job, from, to, (int)steps, fields, nfields);
    else
        layers_step(q, r, q->route.job, step);
}

void api_h_job_events(api_req *q, api_resp *r)
{
    store_event *ev = NULL;
    store_job j;
    int64_t after, limit;
    int n = 0, rc;

    if (!api_query_int(q, r, "after", 0, INT64_MAX, 0, &after) ||
        !api_query_int(q, r, "limit", 1, 1000, 100, &limit) || !api_load_job(q, r, &j))
        return;
    store_job_clear(&j);
    rc = store_event_list(q->srv->st, q->route.job, after, (int)limit, &ev, &n);
    if (rc) {
        store_error(r, rc, "events of job", q->route.job);
        return;
    }
    ok_json(r, 200);
    api_buf *b = &r->body;
    api_buf_printf(b, "{\"job\":%lld,\"events\":[", (long long)q->route.job);
    for (int i = 0; i < n; i++) {
        api_buf_puts(b, i ? ",{" : "{");
        api_put_event_fields(b, &ev[i]);
        api_buf_putc(b, '}');
    }
    if (n == limit && n > 0)
        api_buf_printf(b, "],\"next\":%lld}", (long long)ev[n - 1].id);
    else
        api_buf_puts(b, "],\"next\":null}");
    store_events_free(ev, n);
}

/* See api_int.h. */
void api_put_event_fields(api_buf *b, const store_event *e)
{
    api_buf_printf(b, "\"id\":%lld,\"step\":%lld,\"time\":", (long long)e->id, (long long)e->step);
    api_buf_json_time(b, e->ts);
    api_buf_puts(b, ",\"ts\":");
    put_unix(b, e->ts);
    api_buf_puts(b, ",\"kind\":");
    api_buf_json_str(b, e->kind);
    api_buf_puts(b, ",\"message\":");
    api_buf_json_str(b, e->message);
    api_buf_puts(b, ",\"data\":");
    put_stored_json(b, e->data);
}

/* See api_int.h. */
void api_put_ckpt_fields(api_buf *b, int64_t job, const store_checkpoint *ck)
{
    api_buf_printf(b, "\"step\":%lld,\"bytes\":%lld,\"created_at\":", (long long)ck->step,
                   (long long)ck->bytes);
    api_buf_json_time(b, ck->created_at);
    api_buf_puts(b, ",\"created_at_unix\":");
    put_unix(b, ck->created_at);
    api_buf_printf(b, ",\"url\":\"/v1/jobs/%lld/checkpoints/%lld\"", (long long)job,
                   (long long)ck->step);
}

void api_h_job_ckpts(api_req *q, api_resp *r)
{
    store_checkpoint *ck = NULL;
    store_job j;
    int n = 0, rc;
    int64_t total = 0;

    if (!api_load_job(q, r, &j))
        return;
    store_job_clear(&j);
    rc = store_checkpoint_list(q->srv->st, q->route.job, &ck, &n);
    if (rc) {
        store_error(r, rc, "checkpoints of job", q->route.job);
        return;
    }
    for (int i = 0; i < n; i++)
        total += ck[i].bytes;
    ok_json(r, 200);
    api_buf *b = &r->body;
    api_buf_printf(b, "{\"job\":%lld,\"bytes\":%lld,\"checkpoints\":[", (long long)q->route.job,
                   (long long)total);
    for (int i = 0; i < n; i++) {
        api_buf_puts(b, i ? ",{" : "{");
        api_put_ckpt_fields(b, q->route.job, &ck[i]);
        api_buf_putc(b, '}');
    }
    api_buf_puts(b, "]}");
    free(ck);
}

void api_h_job_ckpt(api_req *q, api_resp *r)
{
    store_checkpoint *ck = NULL;
    store_job j;
    struct stat st;
    int n = 0, rc, fd = -1;

    if (!api_load_job(q, r, &j))
        return;
    store_job_clear(&j);
    if (q->route.step < 0) {
        api_error_resp(r, 404, "not_found", NULL, "no such checkpoint (steps are integers)");
        return;
    }
    rc = store_checkpoint_list(q->srv->st, q->route.job, &ck, &n);
    if (rc) {
        store_error(r, rc, "checkpoints of job", q->route.job);
        return;
    }
    for (int i = 0; i < n; i++) {
        if (ck[i].step == q->route.step) {
            fd = open(ck[i].path, O_RDONLY | O_CLOEXEC);
            break;
        }
    }
    free(ck);
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        if (fd >= 0)
            close(fd);
        api_error_resp(r, 404, "not_found", NULL, "job %lld has no checkpoint at step %lld",
                       (long long)q->route.job, (long long)q->route.step);
        return;
    }
    r->status = 200;
    r->fd = fd;
    r->fd_size = (uint64_t)st.st_size;
    r->ctype = "application/octet-stream";
    snprintf(r->disposition, sizeof(r->disposition),
             "attachment; filename=\"ckpt-%lld.safetensors\"", (long long)q->route.step);
}

/* ---- compare --------------------------------------------------------------------------- */

/* Summary keys that describe the job rather than compare it. */
static bool compare_skip(const char *k)
{
    static const char *const skip[] = {"type", "name", "status", "dtype", "steps", "error"};
    for (size_t i = 0; i < sizeof(skip) / sizeof(skip[0]); i++)
        if (strcmp(k, skip[i]) == 0)
            return true;
    return false;
}

void api_h_compare(api_req *q, api_resp *r)
{
    int64_t ids[MAX_COMPARE];
    store_job jobs[MAX_COMPARE];
    json_t *fields = json_array();
    char err[160];
    int n = 0, loaded = 0;
    const char *v = api_query(q, "ids");

    if (!fields) {
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        return;
    }
    if (!v) {
        api_error_resp(r, 400, "invalid_parameter", "ids", "list the jobs to compare: ids=1,2,3");
        goto out;
    }
    if (api_parse_ids(v, ids, MAX_COMPARE, &n, err, sizeof(err)) != 0) {
        api_error_resp(r, 400, "invalid_parameter", "ids", "%s", err);
        goto out;
    }
    for (; loaded < n; loaded++) {
        int rc = store_job_get(q->srv->st, ids[loaded], &jobs[loaded]);
        if (rc) {
            if (rc == STORE_ENOTFOUND)
                api_error_resp(r, 404, "not_found", "ids", "no job %lld", (long long)ids[loaded]);
            else
                store_error(r, rc, "job", ids[loaded]);
            goto out;
        }
    }
    ok_json(r, 200);
    api_buf *b = &r->body;
    api_buf_puts(b, "{\"jobs\":[");
    for (int i = 0; i < n; i++) {
        const store_job *j = &jobs[i];
        api_buf_printf(b, "%s{\"id\":%lld,\"name\":", i ? "," : "", (long long)j->id);
        api_buf_json_str(b, j->name);
        api_buf_puts(b, ",\"dtype\":");
        api_buf_json_str(b, j->dtype);
        api_buf_puts(b, ",\"status\":");
        api_buf_json_str(b, store_status_name(j->status));
        api_buf_printf(b, ",\"steps\":%lld,\"step\":%lld,\"summary\":", (long long)j->steps,
                       (long long)j->step);
        put_stored_json(b, looks_like(j->summary, '{', '{') ? j->summary : NULL);
        api_buf_putc(b, '}');
        json_t *sum = j->summary ? json_loads(j->summary, 0, NULL) : NULL;
        const char *key;
        json_t *val;
        json_object_foreach(sum, key, val)
        {
            bool seen = compare_skip(key);
            for (size_t k = 0; !seen && k < json_array_size(fields); k++)
                seen = strcmp(json_string_value(json_array_get(fields, k)), key) == 0;
            if (!seen)
                json_array_append_new(fields, json_string(key));
        }
        json_decref(sum);
    }
    api_buf_puts(b, "],\"fields\":[");
    for (size_t k = 0; k < json_array_size(fields); k++) {
        if (k)
            api_buf_putc(b, ',');
        api_buf_json_str(b, json_string_value(json_array_get(fields, k)));
    }
    api_buf_puts(b, "]}");
out:
    for (int i = 0; i < loaded; i++)
        store_job_clear(&jobs[i]);
    json_decref(fields);
}
