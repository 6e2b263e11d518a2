/*
 * ingest.c - a worker's stdout lines into store writes (contract in worker.h).
 *
 * The scheduler hands over a worker whose pipe poll() found readable; its lines are parsed
 * as JSON (no fixed line length; one longer than LINE_MAX_BYTES is dropped) and written to
 * the store (whose stream orders the SSE messages; store.h):
 *   step       -> store_metric_append; "overflow" and "scale" events; at a run's first
 *                 step a "memory" event with the bytes by category
 *   eval       -> store_metric_eval
 *   checkpoint -> store_checkpoint_add (which first makes every metric up to the checkpoint
 *                 durable, so a restart never resumes past a lost row),
 *                 store_job_set_checkpoint
 *   checkpoint_drop -> the file deleted (the worker runs with --no-delete, so a file goes
 *                 only after the newer checkpoint's line, which came first, is recorded),
 *                 store_checkpoint_delete
 *   summary    -> store_job_set_summary (the line as is)
 *   layers     -> store_layer_stats_append (one row per layer, the scale and the first
 *                 layer to produce inf/NaN)
 *   event      -> store_event_append with the line's kind ("recommendation", ...) and
 *                 message, data {"layer": ...} when the line names one. Kinds the daemon
 *                 writes itself (lifecycle, overflow, scale, memory) are refused.
 *   start, resume -> "lifecycle" events; a resume that walked back past the checkpoint it
 *                 was given (damaged ones) truncates the metrics to the step it continues
 *                 from, and each checkpoint it skipped gets a "checkpoint" event (why)
 *
 * The store's back-pressure (docs/architecture.md, "The store"): a pipe is read only while
 * the store takes more (daemon_ingest_takes_lines: it writes and its queue is short);
 * otherwise the worker blocks on its full pipe. A checkpoint or summary the store refuses
 * (STORE_EFULL, STORE_EBUSY, STORE_EIO) is kept in the worker and recorded when it can
 * (daemon_ingest_checkpoints, daemon_ingest_summary).
 *
 * Invariants: checkpoint lines are carried out in the order the worker printed them; a
 * checkpoint's file is deleted only after the newer one is recorded; at most
 * MAX_EVENTS_PER_RUN overflow and scale events and MAX_WORKER_EVENTS worker events are
 * written per worker run.
 *
 * Threads: the scheduler thread only (a worker's parsing state is its own), but for
 * daemon_ingest_branch (an API thread): ckpt_files_mu makes a branch's check of its
 * checkpoint file and its insert one step against a drop's search for branches and its
 * delete.
 */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api/api.h"
#include "daemon/ckpt.h"
#include "daemon/line.h"
#include "daemon/log.h"
#include "daemon/worker.h"
#include "store/store.h"

#define LINE_MAX_BYTES (64u << 20)
#define READ_CHUNK 65536
#define MAX_EVENTS_PER_RUN 2000 /* overflow and scale events of one worker run */
#define MAX_WORKER_EVENTS 2000  /* events (recommendations, ...) a worker run may add */

double daemon_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- the store's back-pressure -------------------------------------------------------------- */

/* A store failure that passes (a full disk, a lock, an I/O error): what failed is tried again
 * once the store writes again. Any other code (the job is gone, a bad argument) is final. */
bool daemon_ingest_transient(int rc)
{
    return rc == STORE_EFULL || rc == STORE_EBUSY || rc == STORE_EIO;
}

/* Whether w's pipe may be read now. The store takes what a worker prints while it writes
 * and its queue is short; else the worker is left blocked on its full pipe (paused, not
 * failed) until it does. A worker told to stop is still read while the queue has room
 * (its last lines and checkpoint matter, and it prints little more); an exited one is
 * drained whatever the queue (a pipe holds little). */
bool daemon_ingest_takes_lines(store *st, const worker *w)
{
    store_health h;
    if (w->exited)
        return true;
    store_get_health(st, &h);
    if (w->term_sent)
        return h.held < STORE_QUEUE_MAX / 2;
    return h.code == 0 && h.held < STORE_QUEUE_HIGH;
}

/* ---- events ------------------------------------------------------------------------------- */

/* Record an event in the store. Strings are borrowed; data (may be NULL) is consumed. */
void daemon_ingest_event(store *st, int64_t job, int64_t step, const char *kind,
                         const char *message, json_t *data)
{
    char *d = data ? json_dumps(data, JSON_COMPACT) : NULL;
    store_event_append(st, job, step, kind, message, d);
    free(d);
    json_decref(data);
}

/* Emit the overflow event waiting for the scale that followed it (NaN: unknown). */
void daemon_ingest_flush_overflow(store *st, worker *w, double new_scale)
{
    char msg[256];
    int n;
    if (!w->pending)
        return;
    w->pending = false;
    if (w->events >= MAX_EVENTS_PER_RUN)
        return;
    if (++w->events == MAX_EVENTS_PER_RUN) {
        daemon_ingest_event(
            st, w->job, w->pending_step, "overflow",
            "further overflow and scale events of this run are not recorded as events; "
            "the metrics keep every step",
            NULL);
        return;
    }
    n = snprintf(msg, sizeof(msg), "step %lld: gradients overflowed%s", (long long)w->pending_step,
                 w->pending_skipped ? "; optimizer step skipped" : "");
    if (!isnan(new_scale) && new_scale != w->pending_scale)
        snprintf(msg + n, sizeof(msg) - (size_t)n, "; loss scale %g -> %g", w->pending_scale,
                 new_scale);
    else
        snprintf(msg + n, sizeof(msg) - (size_t)n, "; loss scale %g", w->pending_scale);
    daemon_ingest_event(st, w->job, w->pending_step, "overflow", msg,
                        json_pack("{s:b, s:o, s:o}", "skipped", w->pending_skipped, "loss_scale",
                                  api_json_num(w->pending_scale), "new_loss_scale",
                                  api_json_num(new_scale)));
}

/* ---- line parsing ------------------------------------------------------------------------- */

static double field(json_t *o, const char *key)
{
    return daemon_line_num(json_object_get(o, key));
}

/* The "step" of a line, or -1 when absent or not a non-negative integer. */
static int64_t line_step(json_t *o)
{
    json_t *v = json_object_get(o, "step");
    return json_is_integer(v) && json_integer_value(v) >= 0 ? (int64_t)json_integer_value(v) : -1;
}

/* The memory event of a run's first step: its bytes by category (the line's "mem"), which
 * the step rows keep only as totals. */
static void memory_event(store *st, worker *w, int64_t step, json_t *mem)
{
    static const char *const cats[] = {"weights",     "master",    "grads", "optimizer",
                                       "activations", "workspace", "fp8"};
    char msg[320];
    int n;
    if (!json_is_object(mem))
        return;
    n = snprintf(msg, sizeof(msg), "step %lld holds %.1f MiB:", (long long)step,
                 field(mem, "total") / 1048576.0);
    for (size_t i = 0; i < sizeof(cats) / sizeof(cats[0]) && n > 0 && (size_t)n < sizeof(msg); i++)
        if (strcmp(cats[i], "fp8") != 0 || field(mem, "fp8") > 0) /* fp8: an fp8 job's */
            n += snprintf(msg + n, sizeof(msg) - (size_t)n, "%s %s %.1f MiB", i ? "," : "", cats[i],
                          field(mem, cats[i]) / 1048576.0);
    daemon_ingest_event(st, w->job, step, "memory", msg, json_incref(mem));
}

static void on_step(store *st, worker *w, json_t *o)
{
    store_metric m;
    int64_t step = line_step(o);
    double scale;

    if (step < 1)
        return;
    memset(&m, 0, sizeof(m));
    m.job_id = w->job;
    m.step = step;
    for (int i = 0; i < STORE_M_NFIELDS; i++)
        m.v[i] = NAN;
    daemon_line_fields(o, STORE_LINE_STEP, m.v);
    scale = m.v[STORE_M_LOSS_SCALE];
    store_metric_append(st, &m);
    if (!w->have_prev)
        memory_event(st, w, step, json_object_get(o, "mem"));

    /* The scale of step N is the one its backward used; a change shows at step N+1. */
    daemon_ingest_flush_overflow(st, w, scale);
    if (w->have_prev && step == w->last_step + 1 && scale != w->prev_scale &&
        !(isnan(scale) && isnan(w->prev_scale)) && w->events < MAX_EVENTS_PER_RUN) {
        char msg[160];
        w->events++;
        snprintf(msg, sizeof(msg), "after step %lld: loss scale %g -> %g (%s)",
                 (long long)w->last_step, w->prev_scale, scale,
                 scale < w->prev_scale ? "backoff" : "growth");
        daemon_ingest_event(st, w->job, w->last_step, "scale", msg,
                            json_pack("{s:o, s:o}", "from", api_json_num(w->prev_scale), "to",
                                      api_json_num(scale)));
    }
    if (json_is_true(json_object_get(o, "overflow"))) {
        w->pending = true;
        w->pending_step = step;
        w->pending_scale = scale;
        w->pending_skipped = json_is_true(json_object_get(o, "skipped"));
    }
    w->prev_scale = scale;
    w->have_prev = true;
    w->last_step = step;
}

/* True when path is this worker's checkpoint file of step. */
static bool ckpt_path_ok(const worker *w, int64_t step, const char *path)
{
    char want[700];
    if (step < 0 || !path)
        return false;
    daemon_ckpt_path(w->dir, step, want, sizeof(want));
    return strcmp(path, want) == 0;
}

/* The branch of job that starts from its checkpoint at step and has none of its own yet
 * (it waits, or runs toward its first): that checkpoint is its start. 0 when none. */
static int64_t branch_start_of(store *st, int64_t job, int64_t step)
{
    int64_t *ids = NULL, found = 0;
    int n = 0;
    if (store_job_branches(st, job, &ids, &n) != 0)
        return 0;
    for (int i = 0; i < n && !found; i++) {
        store_job b;
        if (store_job_get(st, ids[i], &b) != 0)
            continue;
        if (api_branch_step(b.branch) == step && b.checkpoint_step == 0 &&
            !store_status_finished(b.status))
            found = b.id;
        store_job_clear(&b);
    }
    free(ids);
    return found;
}

static pthread_mutex_t ckpt_files_mu = PTHREAD_MUTEX_INITIALIZER;

/* See worker.h. */
int daemon_ingest_branch(store *st, const char *name, const char *dtype, int64_t steps,
                         const char *spec_json, int64_t parent, int64_t from_step,
                         const char *branch_json, int64_t *id)
{
    char path[PATH_MAX];
    int rc = 0;
    pthread_mutex_lock(&ckpt_files_mu);
    if (from_step > 0)
        rc = api_branch_checkpoint(st, parent, from_step, path, sizeof(path));
    if (rc == 0 && from_step > 0 && access(path, R_OK) != 0)
        rc = STORE_ENOTFOUND;
    if (rc == 0)
        rc = store_job_insert_branch(st, name, dtype, steps, spec_json, parent, branch_json, id);
    pthread_mutex_unlock(&ckpt_files_mu);
    return rc;
}

/* Drop a checkpoint the worker gave up: delete its file, then its record; not one that a
 * branch starts from (branch_start_of), which stays with its record. 0, or the store's
 * transient failure (the file is gone then; the record goes when the op is tried again). */
static int drop_checkpoint(store *st, worker *w, const pending_ckpt *c)
{
    int rc;
    pthread_mutex_lock(&ckpt_files_mu);
    int64_t branch = branch_start_of(st, w->job, c->step);
    if (branch) {
        pthread_mutex_unlock(&ckpt_files_mu);
        log_info("job %lld: the checkpoint at step %lld stays: job %lld, a branch, starts from it",
                 (long long)w->job, (long long)c->step, (long long)branch);
        return 0;
    }
    rc = unlink(c->path) != 0 && errno != ENOENT ? errno : 0;
    pthread_mutex_unlock(&ckpt_files_mu);
    if (rc) {
        log_warn("job %lld: cannot delete %s: %s", (long long)w->job, c->path, strerror(rc));
        return 0; /* its record stays: the file still takes its bytes */
    }
    rc = store_checkpoint_delete(st, w->job, c->step);
    if (daemon_ingest_transient(rc))
        return rc;
    if (rc != 0 && rc != STORE_ENOTFOUND)
        log_error("job %lld: cannot remove the record of the checkpoint at step %lld: %s",
                  (long long)w->job, (long long)c->step, store_strerror(rc));
    log_debug("job %lld: checkpoint %lld dropped", (long long)w->job, (long long)c->step);
    return 0;
}

/* Carry out w's pending checkpoint lines in their order: a checkpoint is recorded (by
 * store_checkpoint_add, which first makes every row queued before it durable: the steps up
 * to the checkpoint came before its line), a dropped one deleted. While the store cannot
 * write they wait here, so a checkpoint is never recorded over rows the store holds but has
 * not written, and a file is never deleted before the newer checkpoint whose line came
 * first is recorded. 0 when none is left. */
int daemon_ingest_checkpoints(store *st, worker *w)
{
    while (w->nckpts > 0) {
        pending_ckpt *c = &w->ckpts[0];
        int rc = 0;
        if (c->drop) {
            rc = drop_checkpoint(st, w, c);
        } else {
            if (!c->added && (rc = store_checkpoint_add(st, w->job, c->step, c->path,
                                                        c->bytes < 0 ? 0 : c->bytes)) == 0)
                c->added = true;
            if (rc == 0)
                rc = store_job_set_checkpoint(st, w->job, c->step);
        }
        if (daemon_ingest_transient(rc)) {
            if (!w->ckpt_warned)
                log_warn("job %lld: the checkpoint at step %lld is %s once the store writes "
                         "again (%s)",
                         (long long)w->job, (long long)c->step, c->drop ? "dropped" : "recorded",
                         store_strerror(rc));
            w->ckpt_warned = true;
            return rc;
        }
        if (rc)
            log_error("job %lld: cannot record the checkpoint at step %lld: %s",
                      (long long)w->job, (long long)c->step, store_strerror(rc));
        else if (w->ckpt_warned && !c->drop)
            log_info("job %lld: the checkpoint at step %lld is recorded", (long long)w->job,
                     (long long)c->step);
        memmove(&w->ckpts[0], &w->ckpts[1], sizeof(w->ckpts[0]) * (size_t)(w->nckpts - 1));
        w->nckpts--;
    }
    w->ckpt_warned = false;
    return 0;
}

/* Queue a checkpoint line (drop: a checkpoint_drop) after the ones still waiting for the
 * store, and carry out what can be. */
static void queue_checkpoint(store *st, worker *w, int64_t step, const char *path, int64_t bytes,
                             bool drop)
{
    pending_ckpt *c;
    if (strlen(path) >= sizeof(w->ckpts[0].path)) {
        log_warn("job %lld: ignoring a checkpoint path longer than %zu bytes", (long long)w->job,
                 sizeof(w->ckpts[0].path) - 1);
        return;
    }
    if (w->nckpts == MAX_PENDING_CKPTS) {
        log_warn("job %lld: the checkpoint at step %lld is never %s: %d newer lines wait for "
                 "the store",
                 (long long)w->job, (long long)w->ckpts[0].step,
                 w->ckpts[0].drop ? "dropped" : "recorded", MAX_PENDING_CKPTS);
        memmove(&w->ckpts[0], &w->ckpts[1], sizeof(w->ckpts[0]) * (MAX_PENDING_CKPTS - 1));
        w->nckpts--;
    }
    c = &w->ckpts[w->nckpts++];
    memset(c, 0, sizeof(*c));
    c->step = step;
    c->bytes = bytes;
    c->drop = drop;
    snprintf(c->path, sizeof(c->path), "%s", path);
    daemon_ingest_checkpoints(st, w);
}

/* Store w's summary line (kept until the store takes it); 0 when it is stored. */
int daemon_ingest_summary(store *st, worker *w)
{
    int rc;
    if (!w->summary_line)
        return 0;
    rc = store_job_set_summary(st, w->job, w->summary_line);
    if (rc && daemon_ingest_transient(rc))
        return rc;
    if (rc)
        log_error("job %lld: cannot store the summary: %s", (long long)w->job,
                  store_strerror(rc));
    free(w->summary_line);
    w->summary_line = NULL;
    return 0;
}

static void on_checkpoint(store *st, worker *w, json_t *o)
{
    int64_t step = line_step(o);
    const char *path = json_string_value(json_object_get(o, "path"));
    json_t *bytes = json_object_get(o, "bytes");

    if (!ckpt_path_ok(w, step, path)) {
        log_warn("job %lld: ignoring a checkpoint line outside %s", (long long)w->job, w->dir);
        return;
    }
    w->newest_ckpt = step;
    queue_checkpoint(st, w, step, path,
                     json_is_integer(bytes) ? (int64_t)json_integer_value(bytes) : 0, false);
}

/* A "checkpoint_drop" line: the worker's retention (or its resume) gave up a checkpoint of
 * the job's directory. Its newer checkpoint's line came first, and the drop waits in line
 * behind it until it is recorded (daemon_ingest_checkpoints), so deleting the file never leaves
 * the job without the checkpoint a restart would use. */
static void on_drop(store *st, worker *w, json_t *o)
{
    int64_t step = line_step(o);
    const char *path = json_string_value(json_object_get(o, "path"));

    if (!ckpt_path_ok(w, step, path) || step == w->newest_ckpt) {
        log_warn("job %lld: ignoring a checkpoint_drop line (step %lld)", (long long)w->job,
                 (long long)step);
        return;
    }
    queue_checkpoint(st, w, step, path, 0, true);
}

/* A checkpoint a resume did not use: a "checkpoint" event and a log line saying why. */
void daemon_ingest_skip_event(store *st, int64_t job, int64_t step, const char *path,
                              const char *reason)
{
    const char *slash = strrchr(path, '/');
    const char *file = slash ? slash + 1 : path;
    char msg[768];
    snprintf(msg, sizeof(msg), "skipped the checkpoint at step %lld (%.100s): %.500s",
             (long long)step, file, reason);
    log_warn("job %lld: %s", (long long)job, msg);
    daemon_ingest_event(
        st, job, step, "checkpoint", msg,
        json_pack("{s:I, s:s, s:s}", "step", (json_int_t)step, "file", file, "reason", reason));
}

/* The reason the worker's "resume" line gives for skipping step, or NULL. */
static const char *skip_reason(json_t *skipped, int64_t step)
{
    size_t i;
    json_t *e;
    json_array_foreach(skipped, i, e)
    {
        if (line_step(e) == step)
            return json_string_value(json_object_get(e, "reason"));
    }
    return NULL;
}

/* A "resume" line: {"step", "path" (null: none verified), "skipped": [{"step", "path",
 * "reason"}]}. The worker walked back from the checkpoint it was given to the newest that
 * verifies: the metric rows after that step go, and each checkpoint recorded after it
 * (or named by the worker) gets an event saying why it was skipped. */
static void on_resume(store *st, worker *w, json_t *o)
{
    int64_t step = line_step(o);
    json_t *skipped = json_object_get(o, "skipped"), *e;
    bool found = json_is_string(json_object_get(o, "path"));
    store_checkpoint *cks = NULL;
    int n = 0, nskip = 0;
    size_t i;
    char msg[256];

    if (step < 0)
        step = 0;
    if (step < w->base_step) {
        if (store_metrics_truncate(st, w->job, step) != 0 ||
            store_job_set_checkpoint(st, w->job, step) != 0)
            log_error("job %lld: cannot go back to step %lld", (long long)w->job, (long long)step);
        w->base_step = w->last_step = step;
    }
    w->newest_ckpt = found ? step : -1;
    json_array_foreach(skipped, i, e)
    {
        const char *path = json_string_value(json_object_get(e, "path"));
        const char *reason = json_string_value(json_object_get(e, "reason"));
        if (path && reason) {
            daemon_ingest_skip_event(st, w->job, line_step(e), path, reason);
            nskip++;
        }
    }
    /* the records newer than it that the worker did not name: files gone meanwhile */
    if (store_checkpoint_list(st, w->job, &cks, &n) == 0)
        for (int k = n - 1; k >= 0; k--) {
            if (cks[k].step <= step || cks[k].step > w->resumed_from ||
                skip_reason(skipped, cks[k].step))
                continue;
            if (access(cks[k].path, F_OK) != 0) {
                daemon_ingest_skip_event(st, w->job, cks[k].step, cks[k].path, "missing");
                store_checkpoint_delete(st, w->job, cks[k].step);
                nskip++;
            }
        }
    free(cks);
    if (found && nskip > 0)
        snprintf(msg, sizeof(msg),
                 "resumed from the checkpoint at step %lld, the newest that verifies "
                 "(%d newer skipped)",
                 (long long)step, nskip);
    else if (found)
        snprintf(msg, sizeof(msg), "resumed from the checkpoint at step %lld", (long long)step);
    else
        snprintf(msg, sizeof(msg), "no checkpoint verifies (%d skipped): started again from step 0",
                 nskip);
    if (!found || nskip > 0)
        log_warn("job %lld: %s", (long long)w->job, msg);
    daemon_ingest_event(st, w->job, step, "lifecycle", msg, NULL);
}

static void on_summary(store *st, worker *w, json_t *o, const char *line)
{
    const char *err = json_string_value(json_object_get(o, "error"));
    w->final_scale = field(o, "final_loss_scale");
    daemon_ingest_flush_overflow(st, w, w->final_scale);
    if (err) {
        free(w->summary_error);
        w->summary_error = strdup(err);
    }
    free(w->summary_line);
    if (!(w->summary_line = strdup(line))) {
        log_error("job %lld: out of memory storing the summary", (long long)w->job);
        return;
    }
    if (daemon_ingest_summary(st, w) != 0)
        log_warn("job %lld: the summary is stored once the store writes again",
                 (long long)w->job);
}

/* A "layers" line: {"step", "scale", "first_nonfinite": {"layer", "where"} | null,
 * "layers": [{"name", "dtype", <STORE_L_ fields>}, ...]}. A field a layer does not report
 * is stored as missing; a layer without a name ends the list there. */
static void on_layers(store *st, worker *w, json_t *o)
{
    int64_t step = line_step(o);
    json_t *arr = json_object_get(o, "layers"), *first = json_object_get(o, "first_nonfinite");
    store_layer_info info;
    size_t n = json_array_size(arr);
    int k = 0;

    if (step < 0 || !json_is_array(arr)) {
        log_debug("job %lld: ignoring a layers line without a step or layers", (long long)w->job);
        return;
    }
    if (n > STORE_LAYERS_MAX) {
        log_warn("job %lld: step %lld reports %zu layers; keeping the first %d", (long long)w->job,
                 (long long)step, n, STORE_LAYERS_MAX);
        n = STORE_LAYERS_MAX;
    }
    if (n > w->layers_cap) {
        store_layer_stat *nl = realloc(w->layers, n * sizeof(*nl));
        if (!nl) {
            log_error("job %lld: out of memory storing layer stats", (long long)w->job);
            return;
        }
        w->layers = nl;
        w->layers_cap = n;
    }
    memset(&info, 0, sizeof(info));
    info.scale = field(o, "scale");
    if (json_is_object(first)) {
        const char *name = json_string_value(json_object_get(first, "layer"));
        const char *where = json_string_value(json_object_get(first, "where"));
        snprintf(info.first_layer, sizeof(info.first_layer), "%s", name ? name : "?");
        snprintf(info.first_where, sizeof(info.first_where), "%s", where ? where : "");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *l = json_array_get(arr, i);
        const char *name = json_string_value(json_object_get(l, "name"));
        const char *dtype = json_string_value(json_object_get(l, "dtype"));
        store_layer_stat *r = &w->layers[k];
        if (!name || !*name) {
            log_warn("job %lld: step %lld: layer %zu has no name; the rest are not stored",
                     (long long)w->job, (long long)step, i);
            break;
        }
        memset(r, 0, sizeof(*r));
        snprintf(r->name, sizeof(r->name), "%s", name);
        snprintf(r->dtype, sizeof(r->dtype), "%s", dtype ? dtype : "");
        for (int f = 0; f < STORE_L_NFIELDS; f++) {
            json_t *v = json_object_get(l, store_layer_field_name(f));
            r->v[f] = daemon_line_num(v);
            if (!v || json_is_null(v))
                r->missing |= 1u << f;
        }
        k++;
    }
    if (store_layer_stats_append(st, w->job, step, &info, w->layers, k) != 0)
        log_warn("job %lld: the layer stats of step %lld were not stored", (long long)w->job,
                 (long long)step);
}

/* An "event" line: {"step", "kind", "message", "layer"?, "remedy"?}: the layer and a
 * recommendation's remedy ({"patch": {...}, "acts": bool}) go in the event's data. */
static void on_worker_event(store *st, worker *w, json_t *o)
{
    static const char *const reserved[] = {"lifecycle", "overflow", "scale", "memory",
                                           "checkpoint"};
    const char *kind = json_string_value(json_object_get(o, "kind"));
    const char *message = json_string_value(json_object_get(o, "message"));
    const char *layer = json_string_value(json_object_get(o, "layer"));
    int64_t step = line_step(o);
    size_t kl = kind ? strlen(kind) : 0;

    if (kl == 0 || kl >= 32 || strspn(kind, "abcdefghijklmnopqrstuvwxyz_") != kl || !message) {
        log_debug("job %lld: ignoring an event line without a kind or a message",
                  (long long)w->job);
        return;
    }
    for (size_t i = 0; i < sizeof(reserved) / sizeof(reserved[0]); i++)
        if (strcmp(kind, reserved[i]) == 0) {
            log_debug("job %lld: ignoring a worker event of the daemon's kind \"%s\"",
                      (long long)w->job, kind);
            return;
        }
    if (w->worker_events >= MAX_WORKER_EVENTS)
        return;
    if (++w->worker_events == MAX_WORKER_EVENTS) {
        daemon_ingest_event(st, w->job, step < 0 ? w->last_step : step, kind,
                            "further events of this worker run are not recorded", NULL);
        return;
    }
    json_t *remedy = json_object_get(o, "remedy"), *data = NULL;
    if (!w->remedy && strcmp(kind, "recommendation") == 0 &&
        json_is_true(json_object_get(remedy, "acts")) &&
        json_is_object(json_object_get(remedy, "patch")))
        w->remedy =
            json_pack("{s:O, s:I, s:s, s:I}", "patch", json_object_get(remedy, "patch"), "step",
                      (json_int_t)(step < 0 ? w->last_step : step), "message", message, "rewind",
                      json_integer_value(json_object_get(remedy, "rewind")));
    if (layer || json_is_object(remedy)) {
        data = json_object();
        if (layer)
            json_object_set_new(data, "layer", json_string(layer));
        if (json_is_object(remedy) && json_is_object(json_object_get(remedy, "patch")))
            json_object_set(data, "remedy", remedy);
    }
    daemon_ingest_event(st, w->job, step < 0 ? w->last_step : step, kind, message, data);
}

/* The start line's "data" (a sequence set's unigram level) as a "data" event, which the
 * API's experiment comparison and the dashboard read to name the unigram plateau. */
static void on_data(store *st, worker *w, json_t *data)
{
    double h = json_number_value(json_object_get(data, "unigram_entropy"));
    double top = json_number_value(json_object_get(data, "unigram_top_freq"));
    char msg[256];
    if (!json_is_object(data) || !(h > 0) || !(top > 0))
        return;
    snprintf(msg, sizeof(msg),
             "training data: unigram entropy %.3f nats, most frequent token %.1f%% (the loss "
             "and accuracy of a model that ignores the context)",
             h, 100 * top);
    daemon_ingest_event(st, w->job, w->base_step, "data", msg, json_incref(data));
}

/* "ranks 0-1 on n1, 2-3 on n2" from the hosts of the ranks in order, into out. */
static void hosts_text(json_t *hosts, char *out, size_t len)
{
    size_t n = json_array_size(hosts), used = 0, i = 0;
    out[0] = '\0';
    while (i < n && used < len) {
        const char *h = json_string_value(json_array_get(hosts, i));
        size_t j = i;
        while (j + 1 < n && h && json_string_value(json_array_get(hosts, j + 1)) &&
               strcmp(json_string_value(json_array_get(hosts, j + 1)), h) == 0)
            j++;
        if (j > i)
            used += (size_t)snprintf(out + used, len - used, "%sranks %zu-%zu on %s",
                                     used ? ", " : "", i, j, h ? h : "?");
        else
            used += (size_t)snprintf(out + used, len - used, "%srank %zu on %s", used ? ", " : "",
                                     i, h ? h : "?");
        i = j + 1;
    }
}

/* The event of a "launch" line: where the ranks run, what Slurm says while the job waits,
 * and how it ended in Slurm. */
static void launch_event(store *st, worker *w, json_t *o, const char *state)
{
    char msg[1024], where[700];
    const char *id = json_string_value(json_object_get(w->launch, "job_id"));
    const char *reason = json_string_value(json_object_get(o, "reason"));
    const char *nodes = json_string_value(json_object_get(w->launch, "nodes"));
    char job[64] = "";
    if (id && id[0])
        snprintf(job, sizeof(job), "Slurm job %s", id);
    if (json_object_get(o, "hosts")) {
        hosts_text(json_object_get(o, "hosts"), where, sizeof(where));
        snprintf(msg, sizeof(msg), "%s%s%s", job, job[0] ? " runs: " : "ranks run: ", where);
    } else if (strcmp(state, "PENDING") == 0) {
        snprintf(msg, sizeof(msg), "%s waits in Slurm's queue: PENDING (%s)", job,
                 reason && reason[0] ? reason : "no reason given");
    } else {
        snprintf(msg, sizeof(msg), "%s ended in Slurm: %s%s%s", job, state,
                 nodes && nodes[0] ? " on " : "", nodes ? nodes : "");
    }
    daemon_ingest_event(st, w->job, w->last_step, "lifecycle", msg, json_deep_copy(w->launch));
}

/* A "launch" line: merged into what the job's record says of its launch; the job is queued
 * while Slurm holds it and running once its ranks say they run. An event for each new
 * state (a repeated waiting line only keeps the worker alive). */
static void on_launch(store *st, worker *w, json_t *o)
{
    const char *state = json_string_value(json_object_get(o, "state"));
    char *text;
    bool waiting = state && strcmp(state, "PENDING") == 0, changed;
    if (!state || (waiting && w->launch_running))
        return; /* a waiting line that crossed the ranks' start */
    if (!w->launch && !(w->launch = json_object()))
        return;
    const char *prev = json_string_value(json_object_get(w->launch, "state"));
    bool was_waiting = prev && strcmp(prev, "PENDING") == 0;
    changed = !json_equal(json_object_get(w->launch, "state"), json_object_get(o, "state")) ||
              !json_equal(json_object_get(w->launch, "reason"), json_object_get(o, "reason")) ||
              json_object_get(o, "hosts");
    json_object_update(w->launch, o);
    json_object_del(w->launch, "type");
    if (!changed)
        return;
    if ((text = json_dumps(w->launch, JSON_COMPACT)) != NULL)
        store_job_set_launch(st, w->job, text);
    free(text);
    if (waiting)
        store_job_set_status(st, w->job, STORE_QUEUED, NULL);
    else if (json_object_get(o, "hosts")) {
        w->launch_running = true;
        if (was_waiting)
            store_job_set_status(st, w->job, STORE_RUNNING, NULL);
    }
    launch_event(st, w, o, state);
}

/* One complete line from a worker: len bytes, no newline; line[len] is writable. */
static void handle_line(store *st, worker *w, char *line, size_t len)
{
    json_error_t jerr;
    json_t *o;
    const char *type;
    char msg[768];

    while (len > 0 && (line[len - 1] == '\r' || line[len - 1] == ' '))
        len--;
    line[len] = '\0';
    if (len == 0)
        return;
    o = json_loadb(line, len, 0, &jerr);
    type = json_string_value(json_object_get(o, "type"));
    if (!type) {
        log_debug("job %lld: ignoring a line that is not a JSON object with a type",
                  (long long)w->job);
    } else if (strcmp(type, "step") == 0) {
        on_step(st, w, o);
    } else if (strcmp(type, "eval") == 0) {
        int64_t step = line_step(o);
        if (step >= 0) {
            double v[STORE_M_NFIELDS];
            for (int i = 0; i < STORE_M_NFIELDS; i++)
                v[i] = NAN;
            daemon_line_fields(o, STORE_LINE_EVAL, v);
            store_metric_eval(st, w->job, 0, step, v);
        }
    } else if (strcmp(type, "checkpoint") == 0) {
        on_checkpoint(st, w, o);
    } else if (strcmp(type, "checkpoint_drop") == 0) {
        on_drop(st, w, o);
    } else if (strcmp(type, "summary") == 0) {
        on_summary(st, w, o, line);
    } else if (strcmp(type, "layers") == 0) {
        on_layers(st, w, o);
    } else if (strcmp(type, "event") == 0) {
        on_worker_event(st, w, o);
    } else if (strcmp(type, "start") == 0) {
        const char *blas = json_string_value(json_object_get(o, "blas"));
        const char *dev = json_string_value(json_object_get(o, "device"));
        snprintf(msg, sizeof(msg), "worker %d started on %.300s: %.0f parameters, blas %.200s",
                 (int)w->pid, dev ? dev : "?", field(o, "params"), blas ? blas : "?");
        daemon_ingest_event(st, w->job, w->base_step, "lifecycle", msg, NULL);
        on_data(st, w, json_object_get(o, "data"));
    } else if (strcmp(type, "resume") == 0) {
        on_resume(st, w, o);
    } else if (strcmp(type, "launch") == 0) {
        on_launch(st, w, o);
    } else {
        log_debug("job %lld: ignoring a \"%s\" line", (long long)w->job, type);
    }
    json_decref(o);
}

/* Split w->buf into lines; keep the incomplete tail. */
static void split_lines(store *st, worker *w)
{
    size_t start = 0;
    for (;;) {
        char *nl = memchr(w->buf + start, '\n', w->len - start);
        if (!nl)
            break;
        size_t end = (size_t)(nl - w->buf);
        if (w->discarding)
            w->discarding = false;
        else
            handle_line(st, w, w->buf + start, end - start);
        start = end + 1;
    }
    memmove(w->buf, w->buf + start, w->len - start);
    w->len -= start;
    if (w->len > LINE_MAX_BYTES) {
        log_warn("job %lld: dropping a line longer than %u bytes", (long long)w->job,
                 LINE_MAX_BYTES);
        w->len = 0;
        w->discarding = true;
    }
}

/* Read what the pipe has, while the store takes it (daemon_ingest_takes_lines); on EOF or
 * error close it. */
void daemon_ingest_read(store *st, worker *w, size_t max_bytes)
{
    size_t got = 0;
    while (w->fd >= 0) {
        ssize_t n;
        if (max_bytes > 0 && got >= max_bytes)
            return; /* the rest next turn: a fast worker must not hold the scheduler */
        if (w->cap - w->len < READ_CHUNK) {
            size_t cap = w->cap ? w->cap * 2 : 2 * READ_CHUNK;
            while (cap - w->len < READ_CHUNK)
                cap *= 2;
            char *p = realloc(w->buf, cap);
            if (!p) {
                log_error("job %lld: out of memory reading the worker", (long long)w->job);
                w->len = 0;
                w->discarding = true;
                if (w->cap < READ_CHUNK) {
                    close(w->fd);
                    w->fd = -1;
                }
                continue;
            }
            w->buf = p;
            w->cap = cap;
        }
        n = read(w->fd, w->buf + w->len, w->cap - w->len);
        if (n > 0) {
            w->len += (size_t)n;
            got += (size_t)n;
            w->last_output = daemon_now_s();
            split_lines(st, w);
            if (!daemon_ingest_takes_lines(st, w))
                return; /* the rest waits in the pipe, and the worker with it */
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        /* EOF (or a read error): a last line without a newline still counts. */
        if (w->len > 0 && !w->discarding)
            handle_line(st, w, w->buf, w->len);
        w->len = 0;
        close(w->fd);
        w->fd = -1;
    }
    /* Keep memory bounded between long lines. */
    if (w->len == 0 && w->cap > 16 * READ_CHUNK) {
        free(w->buf);
        w->buf = NULL;
        w->cap = 0;
    }
}

void daemon_worker_free(worker *w)
{
    if (!w)
        return;
    if (w->fd >= 0)
        close(w->fd);
    free(w->buf);
    free(w->layers);
    free(w->summary_error);
    free(w->summary_line);
    free(w->end_err);
    json_decref(w->launch);
    json_decref(w->remedy);
    free(w->branch_err);
    free(w);
}
