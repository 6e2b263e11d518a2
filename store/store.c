/*
 * store.c - the store's front: open and close, the log hook and error strings, status, metric and
 * layer-field names (the metric table's rows), the job rows (written synchronously on the write
 * connection), and the reads of jobs, events, checkpoints, the latest metric row, the per-layer
 * diagnostics and the counters.
 *
 * Invariants: the write connection is only used under wlock, so a job write waits at most
 * for the writer's current batch and never meets SQLITE_BUSY from this process. Reads
 * use this thread's read connection (store_reader): under WAL they never wait for the
 * writer and see every transaction committed before they start.
 *
 * Threads: every public function is thread-safe. Read connections are closed by their
 * thread's exit (the pthread key's destructor) or by store_close, whichever comes first;
 * no thread may use the store once store_close has begun.
 */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store/store_int.h"

struct store_rconn {
    store *s;
    store_conn *c;
    store_rconn *prev, *next;
};

#define STATUS_NAME_(id, name) [id] = name,
static const char *const status_names[STORE_NSTATUS] = {STORE_STATUSES(STATUS_NAME_)};
#undef STATUS_NAME_

#define FIELD_(id, name, line, type, src, since)                                                   \
    [STORE_M_##id] = {#name, STORE_LINE_##line, STORE_TYPE_##type, since},
static const store_metric_info metric_fields[STORE_M_NFIELDS] = {STORE_METRICS(FIELD_)};
#undef FIELD_

static _Atomic(store_log_fn) log_fn;
static _Atomic(void *) log_arg;

void store_set_log(store_log_fn fn, void *arg)
{
    atomic_store(&log_arg, arg);
    atomic_store(&log_fn, fn);
}

void store_log(int level, const char *func, const char *fmt, ...)
{
    store_log_fn fn = atomic_load(&log_fn);
    char msg[2048];
    va_list ap;
    if (!fn)
        return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fn(atomic_load(&log_arg), level, func, msg);
}

const char *store_strerror(int code)
{
    switch (code) {
#define STORE_ERR_CASE_(name, val, msg)                                                            \
    case (val):                                                                                    \
        return (msg);
        STORE_ERRORS(STORE_ERR_CASE_)
#undef STORE_ERR_CASE_
    }
    return "unknown error";
}

double store_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *store_status_name(store_status s)
{
    return (int)s >= 0 && s < STORE_NSTATUS ? status_names[s] : "unknown";
}

/* The index of name in names[0..n), or -1 (also for a NULL name). */
static int name_index(const char *const *names, int n, const char *name)
{
    for (int i = 0; name && i < n; i++)
        if (strcmp(name, names[i]) == 0)
            return i;
    return -1;
}

int store_status_parse(const char *name, store_status *out)
{
    int i = name_index(status_names, STORE_NSTATUS, name);
    if (i < 0)
        return STORE_EINVAL;
    *out = (store_status)i;
    return 0;
}

bool store_status_finished(store_status s)
{
    return s == STORE_SUCCEEDED || s == STORE_FAILED || s == STORE_CANCELLED || s == STORE_BRANCHED;
}

bool store_status_waiting(store_status s)
{
    return s == STORE_QUEUED || s == STORE_PREEMPTED;
}

bool store_status_active(store_status s)
{
    return store_status_waiting(s) || s == STORE_RUNNING;
}

const store_metric_info *store_metric_field(int field)
{
    return field >= 0 && field < STORE_M_NFIELDS ? &metric_fields[field] : NULL;
}

#define MISSING_BITS 0x7ff8000000a4d15eull /* a quiet NaN; the payload spells "missing" */

double store_missing(void)
{
    uint64_t u = MISSING_BITS;
    double v;
    memcpy(&v, &u, sizeof(v));
    return v;
}

bool store_is_missing(double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof(u));
    return u == MISSING_BITS;
}

const char *store_metric_name(int field)
{
    return field >= 0 && field < STORE_M_NFIELDS ? metric_fields[field].name : NULL;
}

int store_metric_parse(const char *name)
{
    for (int i = 0; name && i < STORE_M_NFIELDS; i++)
        if (strcmp(metric_fields[i].name, name) == 0)
            return i;
    return -1;
}

/* ---- connections ---------------------------------------------------------------------------- */

static void rconn_unlink(store *s, store_rconn *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        s->rconns = r->next;
    if (r->next)
        r->next->prev = r->prev;
}

/* The pthread key's destructor: the thread is exiting. */
static void rconn_destroy(void *arg)
{
    store_rconn *r = arg;
    pthread_mutex_lock(&r->s->rlock);
    rconn_unlink(r->s, r);
    pthread_mutex_unlock(&r->s->rlock);
    store_conn_close(r->c);
    free(r);
}

store_conn *store_reader(store *s)
{
    store_rconn *r = pthread_getspecific(s->rkey);
    if (r)
        return r->c;
    r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    if (store_conn_open(s->path, false, &r->c) != 0) {
        free(r);
        return NULL;
    }
    r->s = s;
    pthread_mutex_lock(&s->rlock);
    r->next = s->rconns;
    if (s->rconns)
        s->rconns->prev = r;
    s->rconns = r;
    pthread_mutex_unlock(&s->rlock);
    if (pthread_setspecific(s->rkey, r) != 0) {
        pthread_mutex_lock(&s->rlock);
        rconn_unlink(s, r);
        pthread_mutex_unlock(&s->rlock);
        store_conn_close(r->c);
        free(r);
        return NULL;
    }
    return r->c;
}

int store_open(const char *path, store **out)
{
    store *s;
    int rc;

    if (!out)
        return STORE_EINVAL;
    *out = NULL;
    if (!path || !*path || strcmp(path, ":memory:") == 0 || strncmp(path, "file:", 5) == 0) {
        log_error("store path must be a plain file name (got \"%s\")", path ? path : "(null)");
        return STORE_EINVAL;
    }
    s = calloc(1, sizeof(*s));
    if (!s)
        return STORE_EIO;
    pthread_mutex_init(&s->wlock, NULL);
    pthread_mutex_init(&s->rlock, NULL);
    pthread_mutex_init(&s->cmu, NULL);
    {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&s->ccv, &ca);
        pthread_condattr_destroy(&ca);
    }
    s->path = strdup(path);
    if (!s->path || pthread_key_create(&s->rkey, rconn_destroy) != 0) {
        free(s->path);
        pthread_mutex_destroy(&s->wlock);
        pthread_mutex_destroy(&s->rlock);
        pthread_mutex_destroy(&s->cmu);
        pthread_cond_destroy(&s->ccv);
        free(s);
        return STORE_EIO;
    }
    if ((rc = store_conn_open(path, true, &s->w)) != 0)
        goto fail;
    if ((rc = store_check_integrity(s->w, path)) != 0)
        goto fail;
    if ((rc = store_migrate(s->w, path)) != 0)
        goto fail;
    if ((rc = store_writer_start(s)) != 0)
        goto fail;
    *out = s;
    return 0;
fail:
    store_close(s);
    return rc;
}

void store_close(store *s)
{
    if (!s)
        return;
    store_writer_stop(s);
    pthread_key_delete(s->rkey);
    pthread_mutex_lock(&s->rlock);
    while (s->rconns) {
        store_rconn *r = s->rconns;
        s->rconns = r->next;
        store_conn_close(r->c);
        free(r);
    }
    pthread_mutex_unlock(&s->rlock);
    /* The last connection to close checkpoints the WAL into the database and removes it. */
    store_conn_close(s->w);
    pthread_mutex_destroy(&s->wlock);
    pthread_mutex_destroy(&s->rlock);
    pthread_mutex_destroy(&s->cmu);
    pthread_cond_destroy(&s->ccv);
    free(s->path);
    free(s);
}

/* ---- synchronous writes -------------------------------------------------------------------- */

int store_wbegin(store *s)
{
    pthread_mutex_lock(&s->wlock);
    return atomic_load(&s->fault);
}

int store_wend(store *s, int rc)
{
    pthread_mutex_unlock(&s->wlock);
    store_writer_probe(s, rc);
    return rc;
}

int store_wstmt(store *s, int stmt, sqlite3_stmt **st)
{
    int rc = store_wbegin(s);
    if (rc == 0 && !(*st = store_stmt(s->w, stmt)))
        rc = STORE_EIO;
    return rc;
}

int store_txn_begin(store *s)
{
    int rc = store_wbegin(s);
    return rc ? rc : store_exec_stmt(s->w, ST_BEGIN_IMMEDIATE);
}

/* ---- the stream ------------------------------------------------------------------------------ */

void store_committed(store *s)
{
    pthread_mutex_lock(&s->cmu);
    s->commits++;
    pthread_cond_broadcast(&s->ccv);
    pthread_mutex_unlock(&s->cmu);
}

bool store_wait_commit(store *s, uint64_t *seen, int timeout_ms)
{
    struct timespec ts;
    bool changed;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&s->cmu);
    while (s->commits == *seen && timeout_ms > 0)
        if (pthread_cond_timedwait(&s->ccv, &s->cmu, &ts) != 0)
            break;
    changed = s->commits != *seen;
    *seen = s->commits;
    pthread_mutex_unlock(&s->cmu);
    return changed;
}

int store_stream_add(store *s, int64_t job, int64_t step, store_stream_kind kind, int64_t ref)
{
    sqlite3_stmt *st = store_stmt(s->w, ST_STREAM_ADD);
    int rc;
    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, step);
    sqlite3_bind_int(st, 3, (int)kind);
    if (ref > 0)
        sqlite3_bind_int64(st, 4, ref);
    rc = sqlite3_step(st);
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(s->w->db, st, rc, __func__);
    store_stmt_done(st);
    return rc;
}

int store_stream_at_step(store *s, int64_t job, int64_t step, int64_t *seq)
{
    store_conn *c;
    sqlite3_stmt *st;
    int rc;

    if (!s || !seq)
        return STORE_EINVAL;
    *seq = 0;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_STREAM_AT_STEP)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, step);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        *seq = sqlite3_column_int64(st, 0);
    rc = rc == SQLITE_ROW || rc == SQLITE_DONE ? 0 : store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
    return rc;
}

int store_stream_read(store *s, int64_t job, int64_t after, int limit, store_stream_row **out,
                      int *n)
{
    store_conn *c;
    sqlite3_stmt *st;
    store_stream_row *rows;
    int rc, k = 0;

    if (!s || !out || !n || limit < 1 || limit > 100000)
        return STORE_EINVAL;
    *out = NULL;
    *n = 0;
    if (!(rows = malloc(sizeof(*rows) * (size_t)limit)))
        return STORE_EIO;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_STREAM_READ))) {
        free(rows);
        return STORE_EIO;
    }
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, after);
    sqlite3_bind_int(st, 3, limit);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW && k < limit) {
        rows[k].seq = sqlite3_column_int64(st, 0);
        rows[k].step = sqlite3_column_int64(st, 1);
        rows[k].kind = (store_stream_kind)sqlite3_column_int(st, 2);
        rows[k].ref = sqlite3_column_int64(st, 3);
        k++;
    }
    rc = rc == SQLITE_DONE || rc == SQLITE_ROW ? 0 : store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
    if (rc || k == 0) {
        free(rows);
        return rc;
    }
    *out = rows;
    *n = k;
    return 0;
}

/* ---- jobs ----------------------------------------------------------------------------------- */

void store_job_clear(store_job *j)
{
    if (!j)
        return;
    free(j->spec);
    free(j->summary);
    free(j->error);
    free(j->launch);
    free(j->branch);
    j->spec = j->summary = j->error = j->launch = j->branch = NULL;
}

void store_jobs_free(store_job *jobs, int n)
{
    for (int i = 0; jobs && i < n; i++)
        store_job_clear(&jobs[i]);
    free(jobs);
}

int store_grow(void *v, int *cap, int cnt, size_t elem, int first)
{
    void **pv = v, *p;
    int nc;
    if (cnt < *cap)
        return 0;
    nc = *cap ? 2 * *cap : first;
    if (!(p = realloc(*pv, (size_t)nc * elem)))
        return STORE_EIO;
    *pv = p;
    *cap = nc;
    return 0;
}

int store_bind_text(sqlite3_stmt *st, int i, const char *v)
{
    return v ? sqlite3_bind_text(st, i, v, -1, SQLITE_TRANSIENT) : sqlite3_bind_null(st, i);
}

char *store_column_dup(sqlite3_stmt *st, int i)
{
    const unsigned char *t = sqlite3_column_text(st, i);
    return t ? strdup((const char *)t) : NULL;
}

void store_column_copy(sqlite3_stmt *st, int i, char *dst, size_t size)
{
    const unsigned char *t = sqlite3_column_text(st, i);
    snprintf(dst, size, "%s", t ? (const char *)t : "");
}

/* A job from the current row of a JOB_COLS statement; 0 or STORE_EIO (out of memory). */
static int job_from_row(sqlite3_stmt *st, store_job *j)
{
    const unsigned char *status = sqlite3_column_text(st, 3);
    store_status stat = STORE_FAILED;

    memset(j, 0, sizeof(*j));
    j->id = sqlite3_column_int64(st, 0);
    store_column_copy(st, 1, j->name, sizeof(j->name));
    store_column_copy(st, 2, j->dtype, sizeof(j->dtype));
    if (store_status_parse((const char *)status, &stat) != 0)
        log_warn("job %lld has unknown status \"%s\"", (long long)j->id,
                 status ? (const char *)status : "");
    j->status = stat;
    j->created_at = sqlite3_column_double(st, 4);
    j->started_at = sqlite3_column_double(st, 5); /* NULL reads as 0 */
    j->finished_at = sqlite3_column_double(st, 6);
    j->steps = sqlite3_column_int64(st, 7);
    j->step = sqlite3_column_int64(st, 8);
    j->checkpoint_step = sqlite3_column_int64(st, 9);
    j->retries = sqlite3_column_int(st, 10);
    j->cancel_requested = sqlite3_column_int(st, 11) != 0;
    j->spec = store_column_dup(st, 12);
    j->summary = store_column_dup(st, 13);
    j->error = store_column_dup(st, 14);
    j->checkpoint_bytes = sqlite3_column_int64(st, 15);
    j->launch = store_column_dup(st, 16);
    j->parent_id = sqlite3_column_int64(st, 17);
    j->branch = store_column_dup(st, 18);
    if (!j->spec || (sqlite3_column_type(st, 13) != SQLITE_NULL && !j->summary) ||
        (sqlite3_column_type(st, 14) != SQLITE_NULL && !j->error) ||
        (sqlite3_column_type(st, 16) != SQLITE_NULL && !j->launch) ||
        (sqlite3_column_type(st, 18) != SQLITE_NULL && !j->branch)) {
        store_job_clear(j);
        return STORE_EIO;
    }
    return 0;
}

/* The job that holds idem_key: 0 with *id, 1 when none does, or an error. Under wlock. */
static int job_by_idem(store *s, const char *idem_key, int64_t *id)
{
    sqlite3_stmt *st = store_stmt(s->w, ST_JOB_BY_IDEM);
    int rc;
    if (!st)
        return STORE_EIO;
    store_bind_text(st, 1, idem_key);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        *id = sqlite3_column_int64(st, 0);
        rc = 0;
    } else {
        rc = rc == SQLITE_DONE ? 1 : store_sql_error(s->w->db, st, rc, __func__);
    }
    store_stmt_done(st);
    return rc;
}

/* A job's row, a branch's when parent_id is not 0 (see store_job_insert). */
static int job_insert(store *s, const char *name, const char *dtype, int64_t steps,
                      const char *spec_json, const char *idem_key, int64_t parent_id,
                      const char *branch_json, int64_t *id, bool *existed)
{
    sqlite3_stmt *st;
    int rc;

    if (!s || !name || !dtype || !spec_json || !id ||
        strlen(name) >= sizeof(((store_job *)0)->name) ||
        strlen(dtype) >= sizeof(((store_job *)0)->dtype) || steps < 0)
        return STORE_EINVAL;
    if (existed)
        *existed = false;
    if ((rc = store_wbegin(s)) != 0)
        goto out;
    /* a retry finds its job before any insert, so that it consumes no id (AUTOINCREMENT
     * counts an insert that the key's conflict turns into nothing) */
    if (idem_key && (rc = job_by_idem(s, idem_key, id)) <= 0) {
        if (rc == 0 && existed)
            *existed = true;
        goto out;
    }
    st = store_stmt(s->w, ST_JOB_INSERT);
    if (!st) {
        rc = STORE_EIO;
        goto out;
    }
    sqlite3_bind_text(st, 1, name, -1, SQLITE_TRANSIENT);
    sqlite3_bind_text(st, 2, dtype, -1, SQLITE_TRANSIENT);
    sqlite3_bind_double(st, 3, store_now());
    sqlite3_bind_int64(st, 4, steps);
    sqlite3_bind_text(st, 5, spec_json, -1, SQLITE_TRANSIENT);
    store_bind_text(st, 6, idem_key);
    if (parent_id > 0)
        sqlite3_bind_int64(st, 7, parent_id);
    else
        sqlite3_bind_null(st, 7);
    store_bind_text(st, 8, branch_json);
    rc = sqlite3_step(st);
    if (rc != SQLITE_DONE) {
        rc = store_sql_error(s->w->db, st, rc, __func__);
        store_stmt_done(st);
        goto out;
    }
    store_stmt_done(st);
    if (sqlite3_changes(s->w->db) == 1) {
        *id = sqlite3_last_insert_rowid(s->w->db);
        rc = 0;
    } else if ((rc = job_by_idem(s, idem_key, id)) >= 0) { /* another process took the key */
        rc = rc == 0 ? 0 : STORE_EIO;
        if (rc == 0 && existed)
            *existed = true;
    }
out:
    return store_wend(s, rc);
}

int store_job_insert(store *s, const char *name, const char *dtype, int64_t steps,
                     const char *spec_json, const char *idem_key, int64_t *id, bool *existed)
{
    return job_insert(s, name, dtype, steps, spec_json, idem_key, 0, NULL, id, existed);
}

int store_job_insert_branch(store *s, const char *name, const char *dtype, int64_t steps,
                            const char *spec_json, int64_t parent_id, const char *branch_json,
                            int64_t *id)
{
    if (parent_id <= 0 || !branch_json)
        return STORE_EINVAL;
    return job_insert(s, name, dtype, steps, spec_json, NULL, parent_id, branch_json, id, NULL);
}

int store_job_branches(store *s, int64_t id, int64_t **ids, int *n)
{
    store_conn *c;
    sqlite3_stmt *st;
    int rc, cap = 0;

    if (!s || !ids || !n)
        return STORE_EINVAL;
    *ids = NULL;
    *n = 0;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_JOB_BRANCHES)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, id);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (store_grow(ids, &cap, *n, sizeof(**ids), 4) != 0) {
            rc = SQLITE_NOMEM;
            break;
        }
        (*ids)[(*n)++] = sqlite3_column_int64(st, 0);
    }
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
    if (rc) {
        free(*ids);
        *ids = NULL;
        *n = 0;
    }
    return rc;
}

int store_job_get(store *s, int64_t id, store_job *out)
{
    store_conn *c;
    sqlite3_stmt *st;
    int rc;

    if (!s || !out)
        return STORE_EINVAL;
    memset(out, 0, sizeof(*out));
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_JOB_GET)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, id);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        rc = job_from_row(st, out);
    else if (rc == SQLITE_DONE)
        rc = STORE_ENOTFOUND;
    else
        rc = store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
    return rc;
}

int store_job_list(store *s, const store_job_filter *f, store_job **out, int *n)
{
    store_conn *c;
    sqlite3_stmt *st;
    store_job *jobs = NULL;
    int rc, cnt = 0;

    if (!s || !f || !out || !n)
        return STORE_EINVAL;
    *out = NULL;
    *n = 0;
    if (f->limit < 1 || f->limit > 1000 || f->status < -1 || f->status >= STORE_NSTATUS ||
        f->after < 0)
        return STORE_EINVAL;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_JOB_LIST)))
        return STORE_EIO;
    jobs = calloc((size_t)f->limit, sizeof(*jobs));
    if (!jobs)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, f->after > 0 ? f->after : INT64_MAX);
    store_bind_text(st, 2, f->status >= 0 ? status_names[f->status] : NULL);
    store_bind_text(st, 3, f->dtype);
    store_bind_text(st, 4, f->name);
    sqlite3_bind_int(st, 5, f->limit);
    rc = SQLITE_DONE;
    while (cnt < f->limit && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        if ((rc = job_from_row(st, &jobs[cnt])) != 0)
            goto fail;
        cnt++;
        rc = SQLITE_DONE;
    }
    if (rc != SQLITE_DONE) {
        rc = store_sql_error(c->db, st, rc, __func__);
        goto fail;
    }
    store_stmt_done(st);
    *out = jobs;
    *n = cnt;
    return 0;
fail:
    store_stmt_done(st);
    store_jobs_free(jobs, cnt);
    return rc;
}

/* Step a bound UPDATE/DELETE of the write connection (wlock held) and reset it;
 * STORE_ENOTFOUND when it changed no row. */
int store_step_change(store *s, sqlite3_stmt *st, const char *func)
{
    int rc = sqlite3_step(st);
    if (rc != SQLITE_DONE)
        rc = store_sql_error(s->w->db, st, rc, func);
    else
        rc = sqlite3_changes(s->w->db) > 0 ? 0 : STORE_ENOTFOUND;
    store_stmt_done(st);
    return rc;
}

/* The end of a synchronous write's transaction: commit when rc is 0, else roll back what is
 * open; the write gate is left and readers are woken either way. Returns rc or the commit's
 * error. */
int store_txn_end(store *s, int rc)
{
    if (rc == 0)
        rc = store_exec_stmt(s->w, ST_COMMIT);
    if (rc && !sqlite3_get_autocommit(s->w->db))
        store_exec_stmt(s->w, ST_ROLLBACK);
    store_wend(s, rc);
    store_committed(s);
    return rc;
}

int store_job_set_status(store *s, int64_t id, store_status stat, const char *error)
{
    sqlite3_stmt *st;
    int rc;

    if (!s || (int)stat < 0 || stat >= STORE_NSTATUS)
        return STORE_EINVAL;
    /* The end of the stream comes after every row the job queued. */
    if (store_status_finished(stat) && (rc = store_flush(s)) != 0)
        return rc;
    /* one transaction: a reader that sees the job finished sees its end row */
    if ((rc = store_txn_begin(s)) != 0)
        return store_wend(s, rc);
    if (!(st = store_stmt(s->w, ST_JOB_STATUS))) {
        rc = STORE_EIO;
    } else {
        sqlite3_bind_int64(st, 1, id);
        sqlite3_bind_text(st, 2, status_names[stat], -1, SQLITE_STATIC);
        store_bind_text(st, 3, error);
        sqlite3_bind_int(st, 4, stat == STORE_RUNNING);
        sqlite3_bind_double(st, 5, store_now());
        sqlite3_bind_int(st, 6, store_status_finished(stat));
        sqlite3_bind_int(st, 7, stat == STORE_RUNNING || stat == STORE_QUEUED);
        rc = store_step_change(s, st, __func__);
    }
    if (rc == 0 && store_status_finished(stat)) {
        if (!(st = store_stmt(s->w, ST_STREAM_END))) {
            rc = STORE_EIO;
        } else {
            sqlite3_bind_int64(st, 1, id);
            rc = store_step_change(s, st, __func__);
        }
    }
    return store_txn_end(s, rc);
}

/* UPDATE jobs SET <column> = v WHERE id = id, for the statements that set one integer. */
static int job_set_int(store *s, int stmt, int64_t id, int64_t v, const char *func)
{
    sqlite3_stmt *st;
    int rc;

    if (!s)
        return STORE_EINVAL;
    if ((rc = store_wstmt(s, stmt, &st)) == 0) {
        sqlite3_bind_int64(st, 1, id);
        sqlite3_bind_int64(st, 2, v);
        rc = store_step_change(s, st, func);
    }
    return store_wend(s, rc);
}

/* The same for the statements that set one text. */
static int job_set_text(store *s, int stmt, int64_t id, const char *v, const char *func)
{
    sqlite3_stmt *st;
    int rc;

    if (!s)
        return STORE_EINVAL;
    if ((rc = store_wstmt(s, stmt, &st)) == 0) {
        sqlite3_bind_int64(st, 1, id);
        store_bind_text(st, 2, v);
        rc = store_step_change(s, st, func);
    }
    return store_wend(s, rc);
}

int store_job_set_summary(store *s, int64_t id, const char *summary_json)
{
    return job_set_text(s, ST_JOB_SUMMARY, id, summary_json, __func__);
}

int store_job_set_spec(store *s, int64_t id, const char *spec_json)
{
    if (!spec_json)
        return STORE_EINVAL;
    return job_set_text(s, ST_JOB_SPEC, id, spec_json, __func__);
}

int store_job_set_launch(store *s, int64_t id, const char *launch_json)
{
    return job_set_text(s, ST_JOB_LAUNCH, id, launch_json, __func__);
}

int store_job_set_checkpoint(store *s, int64_t id, int64_t step)
{
    if (step < 0)
        return STORE_EINVAL;
    return job_set_int(s, ST_JOB_CHECKPOINT, id, step, __func__);
}

int store_job_set_cancel(store *s, int64_t id, bool requested)
{
    return job_set_int(s, ST_JOB_CANCEL, id, requested ? 1 : 0, __func__);
}

int store_job_set_retries(store *s, int64_t id, int retries)
{
    if (retries < 0)
        return STORE_EINVAL;
    return job_set_int(s, ST_JOB_RETRIES, id, retries, __func__);
}

int store_job_delete(store *s, int64_t id)
{
    sqlite3_stmt *st;
    int rc;

    if (!s)
        return STORE_EINVAL;
    /* Rows queued before the delete are committed first, so the cascade removes them too. */
    if ((rc = store_flush(s)) != 0)
        return rc;
    if ((rc = store_wstmt(s, ST_JOB_DELETE, &st)) == 0) {
        sqlite3_bind_int64(st, 1, id);
        /* One statement: the job and, by ON DELETE CASCADE, its metrics, rollups, layer
         * stats, events, checkpoints and stream go in one implicit transaction. */
        rc = store_step_change(s, st, __func__);
        store_writer_forget(s, id, INT64_MIN);
    }
    store_wend(s, rc);
    store_committed(s);
    return rc;
}

int store_job_ids(store *s, store_status stat, int64_t **ids, int *n)
{
    store_conn *c;
    sqlite3_stmt *st;
    int64_t *v = NULL;
    int rc, cnt = 0, cap = 0;

    if (!s || !ids || !n || (int)stat < 0 || stat >= STORE_NSTATUS)
        return STORE_EINVAL;
    *ids = NULL;
    *n = 0;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_JOB_IDS)))
        return STORE_EIO;
    sqlite3_bind_text(st, 1, status_names[stat], -1, SQLITE_STATIC);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if ((rc = store_grow(&v, &cap, cnt, sizeof(*v), 16)) != 0)
            goto fail;
        v[cnt++] = sqlite3_column_int64(st, 0);
    }
    if (rc != SQLITE_DONE) {
        rc = store_sql_error(c->db, st, rc, __func__);
        goto fail;
    }
    store_stmt_done(st);
    *ids = v;
    *n = cnt;
    return 0;
fail:
    store_stmt_done(st);
    free(v);
    return rc;
}

/* ---- events, checkpoints, latest metric -------------------------------------------------- */

void store_events_free(store_event *ev, int n)
{
    for (int i = 0; ev && i < n; i++) {
        free(ev[i].message);
        free(ev[i].data);
    }
    free(ev);
}

int store_event_list(store *s, int64_t job, int64_t after, int limit, store_event **out, int *n)
{
    store_conn *c;
    sqlite3_stmt *st;
    store_event *ev = NULL;
    int rc, cnt = 0, cap = 0;

    if (!s || !out || !n || limit < 1)
        return STORE_EINVAL;
    *out = NULL;
    *n = 0;
    if (limit > 10000)
        limit = 10000;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_EVENT_LIST)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, after);
    sqlite3_bind_int(st, 3, limit);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        store_event *e;
        if ((rc = store_grow(&ev, &cap, cnt, sizeof(*ev), 16)) != 0)
            goto fail;
        e = &ev[cnt];
        memset(e, 0, sizeof(*e));
        e->id = sqlite3_column_int64(st, 0);
        e->job_id = sqlite3_column_int64(st, 1);
        e->step = sqlite3_column_int64(st, 2);
        e->ts = sqlite3_column_double(st, 3);
        store_column_copy(st, 4, e->kind, sizeof(e->kind));
        e->message = store_column_dup(st, 5);
        e->data = store_column_dup(st, 6);
        cnt++;
        if (!e->message || (sqlite3_column_type(st, 6) != SQLITE_NULL && !e->data)) {
            rc = STORE_EIO;
            goto fail;
        }
    }
    if (rc != SQLITE_DONE) {
        rc = store_sql_error(c->db, st, rc, __func__);
        goto fail;
    }
    store_stmt_done(st);
    *out = ev;
    *n = cnt;
    return 0;
fail:
    store_stmt_done(st);
    store_events_free(ev, cnt);
    return rc;
}

int store_checkpoint_add(store *s, int64_t job, int64_t step, const char *path, int64_t bytes)
{
    sqlite3_stmt *st;
    int rc;

    if (!s || !path || step < 0 || bytes < 0 ||
        strlen(path) >= sizeof(((store_checkpoint *)0)->path))
        return STORE_EINVAL;
    /* Every row queued before it (the steps up to the checkpoint) is durable first, and its
     * stream row comes after them: a checkpoint is never recorded over rows the store
     * holds but could not write (the flush fails instead). */
    if ((rc = store_flush(s)) != 0)
        return rc;
    /* one transaction: the row and its stream row, or neither (a retry adds no duplicate) */
    if ((rc = store_txn_begin(s)) != 0)
        return store_wend(s, rc);
    if (!(st = store_stmt(s->w, ST_CKPT_ADD))) {
        rc = STORE_EIO;
    } else {
        sqlite3_bind_int64(st, 1, job);
        sqlite3_bind_int64(st, 2, step);
        sqlite3_bind_text(st, 3, path, -1, SQLITE_TRANSIENT);
        sqlite3_bind_int64(st, 4, bytes);
        sqlite3_bind_double(st, 5, store_now());
        rc = store_step_change(s, st, __func__); /* an unknown job fails the foreign key */
    }
    if (rc == 0)
        rc = store_stream_add(s, job, step, STORE_SM_CHECKPOINT, 0);
    return store_txn_end(s, rc);
}

int store_checkpoint_delete(store *s, int64_t job, int64_t step)
{
    sqlite3_stmt *st;
    int rc;

    if (!s)
        return STORE_EINVAL;
    if ((rc = store_txn_begin(s)) != 0)
        return store_wend(s, rc);
    for (int k = 0; k < 2 && rc == 0; k++) {
        if (!(st = store_stmt(s->w, k == 0 ? ST_CKPT_DELETE : ST_STREAM_CKPT_DELETE))) {
            rc = STORE_EIO;
            break;
        }
        sqlite3_bind_int64(st, 1, job);
        sqlite3_bind_int64(st, 2, step);
        rc = store_step_change(s, st, __func__);
        if (k == 1 && rc == STORE_ENOTFOUND)
            rc = 0; /* a checkpoint recorded before the stream existed has no row there */
    }
    return store_txn_end(s, rc);
}

int store_checkpoint_list(store *s, int64_t job, store_checkpoint **out, int *n)
{
    store_conn *c;
    sqlite3_stmt *st;
    store_checkpoint *v = NULL;
    int rc, cnt = 0, cap = 0;

    if (!s || !out || !n)
        return STORE_EINVAL;
    *out = NULL;
    *n = 0;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_CKPT_LIST)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if ((rc = store_grow(&v, &cap, cnt, sizeof(*v), 8)) != 0)
            goto fail;
        v[cnt].step = sqlite3_column_int64(st, 0);
        v[cnt].bytes = sqlite3_column_int64(st, 1);
        v[cnt].created_at = sqlite3_column_double(st, 2);
        store_column_copy(st, 3, v[cnt].path, sizeof(v[cnt].path));
        cnt++;
    }
    if (rc != SQLITE_DONE) {
        rc = store_sql_error(c->db, st, rc, __func__);
        goto fail;
    }
    store_stmt_done(st);
    *out = v;
    *n = cnt;
    return 0;
fail:
    store_stmt_done(st);
    free(v);
    return rc;
}

int store_metric_latest(store *s, int64_t job, store_metric *out)
{
    store_conn *c;
    sqlite3_stmt *st;
    unsigned flags;
    uint32_t nf;
    int rc;

    if (!s || !out)
        return STORE_EINVAL;
    memset(out, 0, sizeof(*out));
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_METRIC_LATEST)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        out->job_id = job;
        out->rank = sqlite3_column_int(st, STORE_RAW_RANK);
        out->step = store_row_read(st, STORE_ALL_FIELDS, out->v, &flags, &nf);
        out->has_eval = (sqlite3_column_int64(st, STORE_RAW_NAN) & STORE_EVAL_BITS) != 0;
        for (int i = 0; i < STORE_M_NFIELDS; i++)
            if (((STORE_EVAL_BITS >> i) & 1u) &&
                sqlite3_column_type(st, STORE_RAW_FIELDS + i) != SQLITE_NULL)
                out->has_eval = true;
        rc = 0;
    } else if (rc == SQLITE_DONE) {
        rc = STORE_ENOTFOUND;
    } else {
        rc = store_sql_error(c->db, st, rc, __func__);
    }
    store_stmt_done(st);
    return rc;
}

void store_get_stats(store *s, store_stats *out)
{
    store_conn *c;
    sqlite3_stmt *st;
    int rc;

    if (!out)
        return;
    memset(out, 0, sizeof(*out));
    if (!s)
        return;
    out->metric_rows = atomic_load(&s->metric_rows);
    out->batches = atomic_load(&s->batches);
    out->queue_depth = store_writer_depth(s);
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_JOB_COUNTS)))
        return;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        store_status stat;
        if (store_status_parse((const char *)sqlite3_column_text(st, 0), &stat) == 0)
            out->jobs_by_status[stat] = sqlite3_column_int64(st, 1);
    }
    if (rc != SQLITE_DONE)
        store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
}

/* ---- per-layer diagnostics ------------------------------------------------------------
 *
 * The reads of layer_stats and layer_steps (the writes are queued through writer.c): one
 * diagnosed step (or the latest), and the heatmap of a range of diagnosed steps, subsampled
 * evenly without dropping a step that saw inf/NaN or an overflow (unless those alone are
 * too many). A row's nan_mask bit tells a NaN field from one that was not reported (both
 * are NULL in SQLite). Every read runs in one read transaction, so a step's record and its
 * rows come from the same commit. */

#define NAME_(id, name, ...) #name,
static const char *const layer_field_names[STORE_L_NFIELDS] = {STORE_LAYER_FIELDS(NAME_)};

const char *store_layer_field_name(int field)
{
    return field >= 0 && field < STORE_L_NFIELDS ? layer_field_names[field] : NULL;
}

int store_layer_field_parse(const char *name)
{
    return name_index(layer_field_names, STORE_L_NFIELDS, name);
}

/* The current row of ST_LAYER_STEP_GET / ST_LAYER_STEP_LATEST into info; returns the step. */
static int64_t info_read(sqlite3_stmt *st, store_layer_info *info)
{
    memset(info, 0, sizeof(*info));
    info->scale = sqlite3_column_type(st, 1) == SQLITE_NULL ? NAN : sqlite3_column_double(st, 1);
    info->flags = (unsigned)sqlite3_column_int(st, 3);
    store_column_copy(st, 4, info->first_layer, sizeof(info->first_layer));
    store_column_copy(st, 5, info->first_where, sizeof(info->first_where));
    return sqlite3_column_int64(st, 0);
}

/* The record of (job, step), step < 0: the latest. STORE_ENOTFOUND when there is none. */
static int step_read(store_conn *c, int64_t job, int64_t step, int64_t *step_out,
                     store_layer_info *info)
{
    sqlite3_stmt *st = store_stmt(c, step < 0 ? ST_LAYER_STEP_LATEST : ST_LAYER_STEP_GET);
    int rc;
    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    if (step >= 0)
        sqlite3_bind_int64(st, 2, step);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        *step_out = info_read(st, info);
        rc = 0;
    } else if (rc == SQLITE_DONE) {
        rc = STORE_ENOTFOUND;
    } else {
        rc = store_sql_error(c->db, st, rc, __func__);
    }
    store_stmt_done(st);
    return rc;
}

/* The rows of (job, step) in layer order into *rows (heap, realloc'd; *cap its capacity)
 * and *n. */
static int rows_read(store_conn *c, int64_t job, int64_t step, store_layer_stat **rows, int *cap,
                     int *n)
{
    sqlite3_stmt *st = store_stmt(c, ST_LAYER_GET);
    int rc;
    *n = 0;
    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, step);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        store_layer_stat *r;
        uint32_t nan_mask;
        if (*n == *cap) {
            int nc = *cap ? 2 * *cap : 32;
            store_layer_stat *nr = realloc(*rows, (size_t)nc * sizeof(*nr));
            if (!nr) {
                store_stmt_done(st);
                return STORE_EIO;
            }
            *rows = nr;
            *cap = nc;
        }
        r = &(*rows)[(*n)++];
        memset(r, 0, sizeof(*r));
        store_column_copy(st, 1, r->name, sizeof(r->name));
        store_column_copy(st, 2, r->dtype, sizeof(r->dtype));
        nan_mask = (uint32_t)sqlite3_column_int64(st, 3);
        for (int f = 0; f < STORE_L_NFIELDS; f++) {
            int col = STORE_LG_FIELDS + f;
            if (sqlite3_column_type(st, col) != SQLITE_NULL) {
                r->v[f] = sqlite3_column_double(st, col);
            } else {
                r->v[f] = NAN;
                if (!((nan_mask >> f) & 1u))
                    r->missing |= 1u << f;
            }
        }
    }
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
    return rc;
}

/* End a read transaction (COMMIT, or ROLLBACK when that fails). */
static void read_end(store_conn *c)
{
    if (store_exec_stmt(c, ST_COMMIT) != 0)
        store_exec_stmt(c, ST_ROLLBACK);
}

int store_layer_stats_get(store *s, int64_t job, int64_t step, store_layer_stat **rows, int *n,
                          int64_t *step_out, store_layer_info *info)
{
    store_layer_info tmp;
    store_conn *c;
    int rc, cap = 0;
    int64_t at = -1;

    if (!rows || !n)
        return STORE_EINVAL;
    *rows = NULL;
    *n = 0;
    if (step_out)
        *step_out = -1;
    if (!s)
        return STORE_EINVAL;
    if (!(c = store_reader(s)))
        return STORE_EIO;
    if ((rc = store_exec_stmt(c, ST_BEGIN)) != 0)
        return rc;
    rc = step_read(c, job, step, &at, &tmp);
    if (rc == 0)
        rc = rows_read(c, job, at, rows, &cap, n);
    read_end(c);
    if (rc) {
        free(*rows);
        *rows = NULL;
        *n = 0;
        return rc;
    }
    if (step_out)
        *step_out = at;
    if (info)
        *info = tmp;
    return 0;
}

/* ---- the heatmap --------------------------------------------------------------------------- */

void store_layer_range_free(store_layer_range *r)
{
    if (!r)
        return;
    free(r->steps);
    free(r->info);
    free(r->layers);
    free(r->values);
    free(r->has);
    memset(r, 0, sizeof(*r));
}

/* Mark k of the m indices idx[0..m) evenly (the first and the last among them). */
static void pick_even(const int64_t *idx, int64_t m, int64_t k, unsigned char *keep)
{
    if (k <= 0 || m <= 0)
        return;
    if (k >= m) {
        for (int64_t i = 0; i < m; i++)
            keep[idx[i]] = 1;
        return;
    }
    if (k == 1) {
        keep[idx[m - 1]] = 1; /* the most recent */
        return;
    }
    for (int64_t j = 0; j < k; j++)
        keep[idx[(int64_t)((double)j * (double)(m - 1) / (double)(k - 1) + 0.5)]] = 1;
}

/* The diagnosed steps of job in [from, to], subsampled to max_steps: out->steps,
 * out->nsteps and out->total_steps. */
static int choose_steps(store_conn *c, int64_t job, int64_t from, int64_t to, int max_steps,
                        store_layer_range *out)
{
    sqlite3_stmt *st = store_stmt(c, ST_LAYER_STEP_RANGE);
    int64_t *steps = NULL, *sp = NULL, *reg = NULL, n = 0, cap = 0, nsp = 0, nreg = 0;
    unsigned char *special = NULL, *keep = NULL;
    int rc;

    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, from);
    sqlite3_bind_int64(st, 3, to);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (n == cap) {
            int64_t nc = cap ? 2 * cap : 256;
            int64_t *ns = realloc(steps, (size_t)nc * sizeof(*ns));
            unsigned char *nsp_ = realloc(special, (size_t)nc);
            if (ns)
                steps = ns;
            if (nsp_)
                special = nsp_;
            if (!ns || !nsp_) {
                rc = STORE_EIO;
                store_stmt_done(st);
                goto out;
            }
            cap = nc;
        }
        steps[n] = sqlite3_column_int64(st, 0);
        special[n] =
            (sqlite3_column_int(st, 1) & (int)(STORE_LS_NONFINITE | STORE_LS_OVERFLOW)) != 0;
        n++;
    }
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
    if (rc)
        goto out;
    out->total_steps = n;
    if (n <= max_steps) {
        out->steps = steps;
        out->nsteps = (int)n;
        steps = NULL;
        goto out;
    }
    keep = calloc((size_t)n, 1);
    sp = malloc((size_t)n * sizeof(*sp));
    reg = malloc((size_t)n * sizeof(*reg));
    out->steps = malloc((size_t)max_steps * sizeof(*out->steps));
    if (!keep || !sp || !reg || !out->steps) {
        rc = STORE_EIO;
        goto out;
    }
    for (int64_t i = 0; i < n; i++) {
        if (special[i])
            sp[nsp++] = i;
        else
            reg[nreg++] = i;
    }
    if (nsp >= max_steps) {
        pick_even(sp, nsp, max_steps, keep);
    } else {
        pick_even(sp, nsp, nsp, keep);
        pick_even(reg, nreg, max_steps - nsp, keep);
    }
    for (int64_t i = 0; i < n; i++)
        if (keep[i] && out->nsteps < max_steps)
            out->steps[out->nsteps++] = steps[i];
out:
    free(steps);
    free(special);
    free(keep);
    free(sp);
    free(reg);
    return rc;
}

/* The slot of layer name in out->layers, added (with its value block) when new; hint: the
 * slot it probably has. -1 when out of memory, -2 past STORE_LR_MAX_CELLS. */
static int layer_slot(store_layer_range *out, int *cap, const store_layer_stat *row, int hint)
{
    size_t block = (size_t)out->nfields * (size_t)out->nsteps;
    if (hint >= 0 && hint < out->nlayers && strcmp(out->layers[hint].name, row->name) == 0)
        return hint;
    for (int i = 0; i < out->nlayers; i++)
        if (strcmp(out->layers[i].name, row->name) == 0)
            return i;
    if ((size_t)(out->nlayers + 1) * block > STORE_LR_MAX_CELLS)
        return -2;
    if (out->nlayers == *cap) {
        int nc = *cap ? 2 * *cap : 16;
        store_layer_name *nl = realloc(out->layers, (size_t)nc * sizeof(*nl));
        double *nv;
        unsigned char *nh;
        if (nl)
            out->layers = nl;
        nv = nl ? realloc(out->values, (size_t)nc * block * sizeof(*nv)) : NULL;
        if (nv)
            out->values = nv;
        nh = nv ? realloc(out->has, (size_t)nc * block) : NULL;
        if (nh)
            out->has = nh;
        if (!nh)
            return -1;
        *cap = nc;
    }
    int l = out->nlayers++;
    snprintf(out->layers[l].name, sizeof(out->layers[l].name), "%s", row->name);
    snprintf(out->layers[l].dtype, sizeof(out->layers[l].dtype), "%s", row->dtype);
    for (size_t i = 0; i < block; i++)
        out->values[(size_t)l * block + i] = NAN;
    memset(out->has + (size_t)l * block, 0, block);
    return l;
}

int store_layer_stats_range(store *s, int64_t job, int64_t from, int64_t to, int max_steps,
                            const int *fields, int nfields, store_layer_range *out)
{
    store_layer_stat *rows = NULL;
    store_conn *c;
    int rc, rcap = 0, lcap = 0;

    if (!out)
        return STORE_EINVAL;
    memset(out, 0, sizeof(*out));
    if (!s || max_steps < 1 || nfields < 1 || nfields > STORE_L_NFIELDS || !fields)
        return STORE_EINVAL;
    for (int i = 0; i < nfields; i++) {
        if (fields[i] < 0 || fields[i] >= STORE_L_NFIELDS)
            return STORE_EINVAL;
        for (int k = 0; k < i; k++)
            if (fields[k] == fields[i])
                return STORE_EINVAL;
        out->fields[i] = fields[i];
    }
    out->nfields = nfields;
    if (from < 0)
        from = 0;
    if (to < 0)
        to = INT64_MAX;
    if (!(c = store_reader(s)))
        return STORE_EIO;
    if ((rc = store_exec_stmt(c, ST_BEGIN)) != 0)
        return rc;
    if (to < from || (rc = choose_steps(c, job, from, to, max_steps, out)) != 0 || out->nsteps == 0)
        goto out;
    if (!(out->info = calloc((size_t)out->nsteps, sizeof(*out->info)))) {
        rc = STORE_EIO;
        goto out;
    }
    for (int k = 0; k < out->nsteps && rc == 0; k++) {
        int64_t at;
        int n = 0;
        if ((rc = step_read(c, job, out->steps[k], &at, &out->info[k])) != 0 ||
            (rc = rows_read(c, job, at, &rows, &rcap, &n)) != 0)
            break;
        for (int i = 0; i < n; i++) {
            int l = layer_slot(out, &lcap, &rows[i], i);
            if (l < 0) {
                rc = l == -2 ? STORE_EINVAL : STORE_EIO;
                break;
            }
            for (int f = 0; f < nfields; f++) {
                if ((rows[i].missing >> fields[f]) & 1u)
                    continue;
                size_t at_ = STORE_LR_AT(out, l, f, k);
                out->values[at_] = rows[i].v[fields[f]];
                out->has[at_] = 1;
            }
        }
    }
out:
    read_end(c);
    free(rows);
    if (rc) {
        store_layer_range_free(out);
        return rc;
    }
    return 0;
}
