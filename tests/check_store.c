/*
 * check_store.c - the SQLite store: migrations and re-open, job rows (filters, keyset
 * cursor, idempotency, timestamps, flags, cascading delete), metric rows through the
 * writer (NaN/+-Inf round-trip, flags, upsert, evals, truncate), downsampling against a
 * brute-force computation over random data, the rollup table against the raw rows,
 * events, checkpoints (their deletion, and a job's disk use: the sum of their bytes), the
 * latest row, counters, readers on several threads while the writer appends, the
 * migration from schema version 1, and the per-layer diagnostics
 * (NaN/+-Inf/missing round trip, step flags, upsert, latest, truncate, delete, and the
 * heatmap range against a reference: subsampling that keeps special steps, layers by
 * first appearance, every cell), and a store that cannot write (store_test_fault as a full
 * disk, a real lock held by another connection): rows held and written exactly once when
 * writing works again, store_flush and the synchronous writes failing meanwhile, no
 * checkpoint recorded over held rows, the health and the writer's probe, a bounded close.
 *
 * Each test opens a fresh database file made with mkstemp in a directory under /tmp and
 * removes it (and its -wal/-shm files) afterwards; the directory and anything a failed
 * test left in it go when the test case ends. The brute-force reference keeps what the test wrote
 * in an array indexed by step and computes buckets, special points and rollups from it directly,
 * without the store's aggregation code.
 *
 * Threads: Check forks one child per test; the concurrency test starts reader threads.
 */
#include <check.h>
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "store/store.h"

#define NF STORE_M_NFIELDS
#define NLF STORE_L_NFIELDS
#define SCHEMA_VERSION 9 /* the fp8 layer fields */
#define EVAL_BITS ((1u << STORE_M_EVAL_LOSS) | (1u << STORE_M_EVAL_ACC))

static char tmp_dir[64];
static char db_path[96];
static store *st;

/* Unchecked fixture (the parent process): a directory for the test case's files, removed
 * with whatever a failed test left in it. */
static void dir_setup(void)
{
    snprintf(tmp_dir, sizeof(tmp_dir), "/tmp/ampd-store-XXXXXX");
    if (!mkdtemp(tmp_dir)) {
        perror("mkdtemp");
        abort();
    }
}

static void dir_teardown(void)
{
    DIR *d = opendir(tmp_dir);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char p[400];
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(p, sizeof(p), "%s/%s", tmp_dir, e->d_name);
        unlink(p);
    }
    if (d)
        closedir(d);
    rmdir(tmp_dir);
}

static void make_path(void)
{
    int fd;
    snprintf(db_path, sizeof(db_path), "%s/db-XXXXXX", tmp_dir);
    fd = mkstemp(db_path);
    ck_assert_int_ge(fd, 0);
    close(fd);
}

static void remove_db(void)
{
    char p[128];
    unlink(db_path);
    snprintf(p, sizeof(p), "%s-wal", db_path);
    unlink(p);
    snprintf(p, sizeof(p), "%s-shm", db_path);
    unlink(p);
}

static int all_fields[NF]; /* 0 .. NF - 1 (setup fills it) */

static void setup(void)
{
    for (int i = 0; i < NF; i++)
        all_fields[i] = i;
    make_path();
    ck_assert_int_eq(store_open(db_path, &st), 0);
    ck_assert_ptr_nonnull(st);
}

static void teardown(void)
{
    store_close(st);
    st = NULL;
    remove_db();
}

static int64_t new_job(const char *name, const char *dtype)
{
    int64_t id = 0;
    bool existed = true;
    ck_assert_int_eq(
        store_job_insert(st, name, dtype, 1000, "{\"steps\":1000}", NULL, &id, &existed), 0);
    ck_assert(!existed);
    ck_assert_int_gt(id, 0);
    return id;
}

/* A second, plain connection to the test database. */
static sqlite3 *raw_open(void)
{
    sqlite3 *db = NULL;
    ck_assert_int_eq(sqlite3_open_v2(db_path, &db, SQLITE_OPEN_READWRITE, NULL), SQLITE_OK);
    sqlite3_busy_timeout(db, 5000);
    return db;
}

static int64_t raw_int(sqlite3 *db, const char *sql, int64_t arg)
{
    sqlite3_stmt *q = NULL;
    int64_t v;
    ck_assert_int_eq(sqlite3_prepare_v2(db, sql, -1, &q, NULL), SQLITE_OK);
    if (sqlite3_bind_parameter_count(q) > 0)
        sqlite3_bind_int64(q, 1, arg);
    ck_assert_int_eq(sqlite3_step(q), SQLITE_ROW);
    v = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    return v;
}

static bool same(double a, double b)
{
    return (isnan(a) && isnan(b)) || a == b;
}

/* ---- the reference model ------------------------------------------------------------------- */

typedef struct {
    bool present;
    bool has_eval; /* eval fields present (else NaN and not flagged) */
    double v[NF];
} mrow;

typedef struct {
    mrow *rows;
    int64_t n; /* steps 0..n-1 */
} model;

static uint64_t rng_state;

static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static double urand(void)
{
    return (double)(rnd() >> 11) / 9007199254740992.0;
}

static model model_new(int64_t n)
{
    model m = {calloc((size_t)n, sizeof(mrow)), n};
    ck_assert_ptr_nonnull(m.rows);
    return m;
}

/* A random field of the step lines (not an eval field). */
static int step_field(void)
{
    for (;;) {
        int f = (int)(rnd() % NF);
        if (store_metric_field(f)->line == STORE_LINE_STEP)
            return f;
    }
}

/* Random values with NaN, +-Inf, overflow and skipped steps sprinkled in. */
static void gen_metric(store_metric *m, int64_t job, int64_t step, bool eval)
{
    memset(m, 0, sizeof(*m));
    m->job_id = job;
    m->step = step;
    for (int i = 0; i < NF; i++)
        m->v[i] = (urand() - 0.3) * 100.0;
    m->v[STORE_M_OVERFLOW] = rnd() % 200 == 0 ? 1.0 : 0.0;
    m->v[STORE_M_SKIPPED] = (m->v[STORE_M_OVERFLOW] != 0 || rnd() % 300 == 0) ? 1.0 : 0.0;
    if (rnd() % 100 == 0)
        m->v[step_field()] = NAN;
    if (rnd() % 150 == 0)
        m->v[step_field()] = INFINITY;
    if (rnd() % 150 == 0)
        m->v[step_field()] = -INFINITY;
    m->has_eval = eval;
    if (eval) {
        m->v[STORE_M_EVAL_LOSS] = rnd() % 10 == 0 ? NAN : urand();
        m->v[STORE_M_EVAL_ACC] = urand();
    } else {
        m->v[STORE_M_EVAL_LOSS] = m->v[STORE_M_EVAL_ACC] = NAN;
    }
}

static void put(model *md, const store_metric *m)
{
    mrow *r = &md->rows[m->step];
    ck_assert_int_lt(m->step, md->n);
    if (!m->has_eval && r->present) {
        /* an upsert without eval keeps the row's eval values */
        double el = r->v[STORE_M_EVAL_LOSS], ea = r->v[STORE_M_EVAL_ACC];
        memcpy(r->v, m->v, sizeof(r->v));
        r->v[STORE_M_EVAL_LOSS] = el;
        r->v[STORE_M_EVAL_ACC] = ea;
    } else {
        memcpy(r->v, m->v, sizeof(r->v));
        r->has_eval = m->has_eval;
        if (!m->has_eval)
            r->v[STORE_M_EVAL_LOSS] = r->v[STORE_M_EVAL_ACC] = NAN;
    }
    r->present = true;
    ck_assert_int_eq(store_metric_append(st, m), 0);
}

static unsigned row_flags(const mrow *r, uint32_t mask)
{
    unsigned f = 0;
    if (r->v[STORE_M_OVERFLOW] != 0 && !isnan(r->v[STORE_M_OVERFLOW]))
        f |= STORE_F_OVERFLOW;
    if (r->v[STORE_M_SKIPPED] != 0 && !isnan(r->v[STORE_M_SKIPPED]))
        f |= STORE_F_SKIPPED;
    for (int i = 0; i < NF; i++)
        if (((mask >> i) & 1u) && !isfinite(r->v[i]) && (r->has_eval || !((EVAL_BITS >> i) & 1u)))
            f |= STORE_F_NONFINITE;
    return f;
}

/* A reference point: the brute-force aggregate of the present rows in [lo, hi]. */
typedef struct {
    int64_t first, last, count;
    unsigned flags;
    double min[NF], max[NF], lastv[NF];
} rpoint;

static rpoint brute(const model *md, int64_t lo, int64_t hi, uint32_t mask)
{
    rpoint p;
    memset(&p, 0, sizeof(p));
    for (int i = 0; i < NF; i++)
        p.min[i] = p.max[i] = p.lastv[i] = NAN;
    for (int64_t s = lo < 0 ? 0 : lo; s <= hi && s < md->n; s++) {
        const mrow *r = &md->rows[s];
        if (!r->present)
            continue;
        if (p.count == 0)
            p.first = s;
        p.last = s;
        p.count++;
        p.flags |= row_flags(r, mask);
        for (int i = 0; i < NF; i++) {
            double x = r->v[i];
            if (!isnan(x) && (isnan(p.min[i]) || x < p.min[i]))
                p.min[i] = x;
            if (!isnan(x) && (isnan(p.max[i]) || x > p.max[i]))
                p.max[i] = x;
            p.lastv[i] = x;
        }
    }
    return p;
}

static int64_t model_last(const model *md)
{
    for (int64_t s = md->n - 1; s >= 0; s--)
        if (md->rows[s].present)
            return s;
    return -1;
}

/* The expected series: buckets, then the special steps merged in by step_first (buckets
 * first on ties; a special step whose bucket is that step alone is not repeated). */
static rpoint *expected(const model *md, const int *fields, int nf, int64_t from, int64_t to,
                        int points, int *n, int64_t *total)
{
    uint32_t mask = 0;
    rpoint *bk, *sp, *out;
    int nb = 0, ns = 0, no = 0, i = 0, j = 0;
    int64_t w;

    for (int k = 0; k < nf; k++)
        mask |= 1u << fields[k];
    if (from < 0)
        from = 0;
    if (to < 0)
        to = model_last(md);
    *n = 0;
    *total = 0;
    bk = calloc((size_t)md->n + 2, sizeof(rpoint));
    sp = calloc((size_t)md->n + 2, sizeof(rpoint));
    out = calloc(2 * (size_t)md->n + 4, sizeof(rpoint));
    ck_assert(bk && sp && out);
    if (to < from)
        goto done;
    if (points <= 0) {
        for (int64_t s = from; s <= to && s < md->n; s++)
            if (md->rows[s].present) {
                out[no++] = brute(md, s, s, mask);
                (*total)++;
            }
        goto done;
    }
    w = (to - from + 1 + points - 1) / points;
    for (int64_t a = from; a <= to; a += w) {
        rpoint p = brute(md, a, a + w - 1 > to ? to : a + w - 1, mask);
        if (p.count) {
            bk[nb++] = p;
            *total += p.count;
        }
    }
    for (int64_t s = from; s <= to && s < md->n; s++)
        if (md->rows[s].present && row_flags(&md->rows[s], mask))
            sp[ns++] = brute(md, s, s, mask);
    while (i < nb || j < ns) {
        if (j >= ns || (i < nb && bk[i].first <= sp[j].first)) {
            out[no++] = bk[i++];
        } else {
            if (!(no > 0 && out[no - 1].count == 1 && out[no - 1].first == sp[j].first))
                out[no++] = sp[j];
            j++;
        }
    }
done:
    free(bk);
    free(sp);
    *n = no;
    return out;
}

static void check_series(const model *md, int64_t job, const int *fields, int nf, int64_t from,
                         int64_t to, int points)
{
    store_series se;
    int n;
    int64_t total;
    rpoint *want = expected(md, fields, nf, from, to, points, &n, &total);

    ck_assert_int_eq(store_series_query(st, job, fields, nf, from, to, points, &se), 0);
    ck_assert_msg(se.npoints == n, "from %lld to %lld points %d: %d points, want %d",
                  (long long)from, (long long)to, points, se.npoints, n);
    ck_assert_int_eq(se.total_steps, total);
    ck_assert_int_eq(se.nfields, nf);
    for (int k = 0; k < n; k++) {
        const store_point *p = &se.points[k];
        ck_assert_msg(p->step_first == want[k].first && p->step_last == want[k].last &&
                          p->count == want[k].count && p->flags == want[k].flags,
                      "point %d (from %lld to %lld points %d): [%lld,%lld] n=%lld f=%u, want "
                      "[%lld,%lld] n=%lld f=%u",
                      k, (long long)from, (long long)to, points, (long long)p->step_first,
                      (long long)p->step_last, (long long)p->count, p->flags,
                      (long long)want[k].first, (long long)want[k].last, (long long)want[k].count,
                      want[k].flags);
        for (int f = 0; f < nf; f++) {
            int fi = fields[f];
            ck_assert_msg(same(p->min[f], want[k].min[fi]) && same(p->max[f], want[k].max[fi]) &&
                              same(p->last[f], want[k].lastv[fi]),
                          "point %d field %s: %g %g %g, want %g %g %g", k, store_metric_name(fi),
                          p->min[f], p->max[f], p->last[f], want[k].min[fi], want[k].max[fi],
                          want[k].lastv[fi]);
        }
    }
    store_series_free(&se);
    free(want);
}


/* Every rollup row equals the brute-force aggregate of the raw rows under it, and every
 * non-empty bucket has one. */
static void check_rollups(const model *md, int64_t job)
{
    static const int64_t levels[4] = {10, 100, 1000, 10000};
    sqlite3 *db = raw_open();
    sqlite3_stmt *q = NULL;
    int64_t rows = 0, want_rows = 0;

    ck_assert_int_eq(sqlite3_prepare_v2(db,
                                        "SELECT * FROM metrics_rollup WHERE job_id=?1 AND "
                                        "rank=0 ORDER BY level, bucket",
                                        -1, &q, NULL),
                     SQLITE_OK);
    sqlite3_bind_int64(q, 1, job);
    while (sqlite3_step(q) == SQLITE_ROW) {
        int64_t L = sqlite3_column_int64(q, 2), b = sqlite3_column_int64(q, 3);
        rpoint p = brute(md, b * L, b * L + L - 1, (1u << NF) - 1);
        rows++;
        ck_assert_msg(p.count == sqlite3_column_int64(q, 6), "level %lld bucket %lld count",
                      (long long)L, (long long)b);
        ck_assert_int_eq(sqlite3_column_int64(q, 4), p.first);
        ck_assert_int_eq(sqlite3_column_int64(q, 5), p.last);
        ck_assert_uint_eq((unsigned)sqlite3_column_int(q, 7) & 3u, p.flags & 3u);
        for (int i = 0; i < NF; i++) {
            double got[3];
            for (int k = 0; k < 3; k++)
                got[k] = sqlite3_column_type(q, 9 + 3 * i + k) == SQLITE_NULL
                             ? NAN
                             : sqlite3_column_double(q, 9 + 3 * i + k);
            ck_assert_msg(same(got[0], p.min[i]) && same(got[1], p.max[i]) &&
                              same(got[2], p.lastv[i]),
                          "level %lld bucket %lld field %d", (long long)L, (long long)b, i);
        }
    }
    sqlite3_finalize(q);
    sqlite3_close(db);
    for (int l = 0; l < 4; l++)
        for (int64_t b = 0; b * levels[l] < md->n; b++)
            want_rows += brute(md, b * levels[l], b * levels[l] + levels[l] - 1, 0).count > 0;
    ck_assert_int_eq(rows, want_rows);
}

/* ---- schema ------------------------------------------------------------------------------- */

START_TEST(test_migrate_and_reopen)
{
    sqlite3 *db = raw_open();
    static const char *const tables[] = {"jobs",        "metrics",       "metrics_rollup",
                                         "layer_stats", "layer_steps",   "events",
                                         "checkpoints", "schema_version", "experiments",
                                         "experiment_jobs"};
    store_metric m;
    store_job j;
    int64_t id;
    store_series se;
    int f = STORE_M_LOSS;

    ck_assert_int_eq(raw_int(db, "SELECT MAX(version) FROM schema_version", 0), SCHEMA_VERSION);
    for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++) {
        sqlite3_stmt *q;
        ck_assert_int_eq(sqlite3_prepare_v2(db, "SELECT COUNT(*) FROM sqlite_schema WHERE name=?1",
                                            -1, &q, NULL),
                         SQLITE_OK);
        sqlite3_bind_text(q, 1, tables[i], -1, SQLITE_STATIC);
        ck_assert_int_eq(sqlite3_step(q), SQLITE_ROW);
        ck_assert_msg(sqlite3_column_int(q, 0) == 1, "table %s missing", tables[i]);
        sqlite3_finalize(q);
    }
    {
        sqlite3_stmt *q;
        ck_assert_int_eq(sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &q, NULL), SQLITE_OK);
        ck_assert_int_eq(sqlite3_step(q), SQLITE_ROW);
        ck_assert_str_eq((const char *)sqlite3_column_text(q, 0), "wal");
        sqlite3_finalize(q);
    }
    sqlite3_close(db);

    id = new_job("keep", "fp16");
    gen_metric(&m, id, 7, false);
    m.v[STORE_M_LOSS] = 1.5;
    ck_assert_int_eq(store_metric_append(st, &m), 0);
    store_close(st);

    ck_assert_int_eq(store_open(db_path, &st), 0);
    db = raw_open();
    ck_assert_int_eq(raw_int(db, "SELECT MAX(version) FROM schema_version", 0), SCHEMA_VERSION);
    ck_assert_int_eq(raw_int(db, "SELECT COUNT(*) FROM schema_version", 0), SCHEMA_VERSION);
    sqlite3_close(db);
    ck_assert_int_eq(store_job_get(st, id, &j), 0);
    ck_assert_str_eq(j.name, "keep");
    ck_assert_int_eq(j.step, 7);
    store_job_clear(&j);
    ck_assert_int_eq(store_series_query(st, id, &f, 1, 0, -1, 0, &se), 0);
    ck_assert_int_eq(se.npoints, 1);
    ck_assert(se.points[0].last[0] == 1.5);
    store_series_free(&se);
}
END_TEST

START_TEST(test_newer_schema_refused)
{
    sqlite3 *db;
    store *s2 = (store *)1;
    store_close(st);
    st = NULL;
    db = raw_open();
    ck_assert_int_eq(
        sqlite3_exec(db, "INSERT INTO schema_version VALUES(999, 0)", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    ck_assert_int_eq(store_open(db_path, &s2), STORE_ECONFLICT);
    ck_assert_ptr_null(s2);
}
END_TEST

START_TEST(test_open_bad_input)
{
    store *s2 = NULL;
    char path[128];
    FILE *f;
    int fd;

    store_close(NULL);
    ck_assert_int_eq(store_open(":memory:", &s2), STORE_EINVAL);
    ck_assert_int_eq(store_open("", &s2), STORE_EINVAL);
    ck_assert_int_eq(store_open(NULL, &s2), STORE_EINVAL);
    snprintf(path, sizeof(path), "%s/bad-XXXXXX", tmp_dir);
    fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    close(fd);
    f = fopen(path, "wb");
    for (int i = 0; i < 4096; i++)
        fputc("not a database "[i % 15], f);
    fclose(f);
    ck_assert_int_eq(store_open(path, &s2), STORE_EIO);
    ck_assert_ptr_null(s2);
    unlink(path);
}
END_TEST

/* ---- jobs --------------------------------------------------------------------------------- */

START_TEST(test_job_list_cursor)
{
    int64_t ids[25];
    bool seen[26] = {false};
    store_job_filter f = {.status = -1, .limit = 10};
    store_job *jobs;
    int n, total = 0, pages = 0;

    for (int i = 0; i < 25; i++) {
        char name[32];
        snprintf(name, sizeof(name), "job-%d", i % 5);
        ids[i] = new_job(name, i % 2 ? "bf16" : "fp16");
        if (i > 0)
            ck_assert_int_gt(ids[i], ids[i - 1]);
    }
    for (int i = 0; i < 25; i += 3)
        ck_assert_int_eq(store_job_set_status(st, ids[i], STORE_RUNNING, NULL), 0);
    do {
        ck_assert_int_eq(store_job_list(st, &f, &jobs, &n), 0);
        for (int k = 0; k < n; k++) {
            int idx = (int)(jobs[k].id - ids[0]);
            ck_assert(idx >= 0 && idx < 25 && !seen[idx]);
            seen[idx] = true;
            if (k > 0)
                ck_assert_int_lt(jobs[k].id, jobs[k - 1].id);
            if (total + k == 0)
                ck_assert_int_eq(jobs[k].id, ids[24]);
            ck_assert_str_eq(jobs[k].spec, "{\"steps\":1000}");
        }
        if (n > 0)
            f.after = jobs[n - 1].id;
        total += n;
        pages++;
        ck_assert_int_eq(n, pages < 3 ? 10 : pages == 3 ? 5 : 0);
        store_jobs_free(jobs, n);
    } while (n > 0);
    ck_assert_int_eq(total, 25);
    ck_assert_int_eq(pages, 4);

    f = (store_job_filter){.status = -1, .dtype = "bf16", .limit = 1000};
    ck_assert_int_eq(store_job_list(st, &f, &jobs, &n), 0);
    ck_assert_int_eq(n, 12);
    for (int k = 0; k < n; k++)
        ck_assert_str_eq(jobs[k].dtype, "bf16");
    store_jobs_free(jobs, n);

    f = (store_job_filter){.status = STORE_RUNNING, .limit = 1000};
    ck_assert_int_eq(store_job_list(st, &f, &jobs, &n), 0);
    ck_assert_int_eq(n, 9);
    store_jobs_free(jobs, n);

    f = (store_job_filter){.status = STORE_QUEUED, .dtype = "fp16", .name = "job-2", .limit = 1000};
    ck_assert_int_eq(store_job_list(st, &f, &jobs, &n), 0);
    /* job-2: i = 2, 7, 12, 17, 22; fp16: even i -> 2, 12, 22; queued: not i % 3 == 0 */
    ck_assert_int_eq(n, 2);
    ck_assert_int_eq(jobs[0].id, ids[22]);
    ck_assert_int_eq(jobs[1].id, ids[2]);
    store_jobs_free(jobs, n);

    f = (store_job_filter){.status = -1, .name = "job-2'; DROP TABLE jobs; --", .limit = 10};
    ck_assert_int_eq(store_job_list(st, &f, &jobs, &n), 0);
    ck_assert_int_eq(n, 0);
    store_jobs_free(jobs, n);

    f.limit = 0;
    ck_assert_int_eq(store_job_list(st, &f, &jobs, &n), STORE_EINVAL);
    f.limit = 1001;
    ck_assert_int_eq(store_job_list(st, &f, &jobs, &n), STORE_EINVAL);
    f.limit = 10;
    f.status = STORE_NSTATUS;
    ck_assert_int_eq(store_job_list(st, &f, &jobs, &n), STORE_EINVAL);
}
END_TEST

START_TEST(test_job_idempotency)
{
    int64_t a, b, c, d, e;
    bool existed;
    ck_assert_int_eq(store_job_insert(st, "x", "fp16", 10, "{}", "key-1", &a, &existed), 0);
    ck_assert(!existed);
    ck_assert_int_eq(store_job_insert(st, "x", "fp16", 10, "{}", "key-1", &b, &existed), 0);
    ck_assert(existed);
    ck_assert_int_eq(a, b);
    ck_assert_int_eq(store_job_insert(st, "x", "fp16", 10, "{}", "key-2", &c, &existed), 0);
    ck_assert(!existed);
    ck_assert_int_eq(c, a + 1); /* the retry took no id */
    ck_assert_int_eq(store_job_insert(st, "x", "fp16", 10, "{}", NULL, &d, &existed), 0);
    ck_assert_int_eq(store_job_insert(st, "x", "fp16", 10, "{}", NULL, &e, &existed), 0);
    ck_assert(!existed);
    ck_assert_int_ne(d, e);

    char longname[200];
    memset(longname, 'a', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    ck_assert_int_eq(store_job_insert(st, longname, "fp16", 10, "{}", NULL, &d, NULL),
                     STORE_EINVAL);
    ck_assert_int_eq(store_job_insert(st, "x", "fp16-long", 10, "{}", NULL, &d, NULL),
                     STORE_EINVAL);
    ck_assert_int_eq(store_job_insert(st, "x", "fp16", 10, NULL, NULL, &d, NULL), STORE_EINVAL);
}
END_TEST

START_TEST(test_job_state)
{
    store_job j;
    double t0 = (double)time(NULL);
    int64_t id = new_job("s", "bf16"), id2 = new_job("t", "fp32");
    int64_t *ids;
    int n;

    ck_assert_int_eq(store_job_get(st, id, &j), 0);
    ck_assert_int_eq(j.status, STORE_QUEUED);
    ck_assert(j.created_at >= t0 - 1 && j.created_at <= t0 + 5);
    ck_assert(j.started_at == 0 && j.finished_at == 0);
    ck_assert_ptr_null(j.summary);
    ck_assert_ptr_null(j.error);
    ck_assert_ptr_null(j.launch);
    ck_assert_int_eq(j.steps, 1000);
    store_job_clear(&j);

    ck_assert_int_eq(store_job_set_status(st, id, STORE_RUNNING, NULL), 0);
    ck_assert_int_eq(store_job_get(st, id, &j), 0);
    ck_assert_int_eq(j.status, STORE_RUNNING);
    ck_assert(j.started_at >= j.created_at && j.finished_at == 0);
    store_job_clear(&j);

    ck_assert_int_eq(store_job_set_status(st, id, STORE_FAILED, "worker killed by signal 9"), 0);
    ck_assert_int_eq(store_job_set_summary(st, id, "{\"final_loss\":0.5}"), 0);
    ck_assert_int_eq(store_job_set_checkpoint(st, id, 500), 0);
    ck_assert_int_eq(store_job_set_cancel(st, id, true), 0);
    ck_assert_int_eq(store_job_set_retries(st, id, 2), 0);
    ck_assert_int_eq(store_job_set_launch(st, id, "{\"launcher\":\"slurm\",\"job_id\":\"12\"}"), 0);
    ck_assert_int_eq(store_job_get(st, id, &j), 0);
    ck_assert_str_eq(j.launch, "{\"launcher\":\"slurm\",\"job_id\":\"12\"}");
    ck_assert_int_eq(j.status, STORE_FAILED);
    ck_assert(j.finished_at >= j.started_at && j.started_at > 0);
    ck_assert_str_eq(j.error, "worker killed by signal 9");
    ck_assert_str_eq(j.summary, "{\"final_loss\":0.5}");
    ck_assert_int_eq(j.checkpoint_step, 500);
    ck_assert(j.cancel_requested);
    ck_assert_int_eq(j.retries, 2);
    store_job_clear(&j);

    /* resumed: running again clears finished_at and the error */
    ck_assert_int_eq(store_job_set_status(st, id, STORE_RUNNING, NULL), 0);
    ck_assert_int_eq(store_job_set_cancel(st, id, false), 0);
    ck_assert_int_eq(store_job_get(st, id, &j), 0);
    ck_assert(j.finished_at == 0 && j.started_at > 0);
    ck_assert_ptr_null(j.error);
    ck_assert(!j.cancel_requested);
    store_job_clear(&j);

    ck_assert_int_eq(store_job_set_status(st, 99999, STORE_RUNNING, NULL), STORE_ENOTFOUND);
    ck_assert_int_eq(store_job_set_summary(st, 99999, "{}"), STORE_ENOTFOUND);
    ck_assert_int_eq(store_job_set_launch(st, 99999, "{}"), STORE_ENOTFOUND);

    ck_assert_int_eq(store_job_set_cancel(st, 99999, true), STORE_ENOTFOUND);
    ck_assert_int_eq(store_job_get(st, 99999, &j), STORE_ENOTFOUND);
    ck_assert_int_eq(store_job_set_status(st, id, STORE_NSTATUS, NULL), STORE_EINVAL);

    ck_assert_int_eq(store_job_ids(st, STORE_QUEUED, &ids, &n), 0);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(ids[0], id2);
    free(ids);
    ck_assert_int_eq(store_job_ids(st, STORE_RUNNING, &ids, &n), 0);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(ids[0], id);
    free(ids);

    /* branches: the lineage is on the row from its insert; the parent lists them */
    int64_t b1, b2;
    int nb = -1;
    ck_assert_int_eq(store_job_branches(st, id, &ids, &nb), 0);
    ck_assert_int_eq(nb, 0);
    ck_assert_ptr_null(ids);
    ck_assert_int_eq(store_job_insert_branch(st, "b", "fp16", 1000, "{}", id,
                                             "{\"parent\":1,\"step\":500}", &b1),
                     0);
    ck_assert_int_eq(store_job_insert_branch(st, "b", "bf16", 1000, "{}", id, "{}", &b2), 0);
    ck_assert_int_eq(store_job_insert_branch(st, "b", "bf16", 1000, "{}", 0, "{}", &b2),
                     STORE_EINVAL);
    ck_assert_int_eq(store_job_get(st, b1, &j), 0);
    ck_assert_int_eq(j.parent_id, id);
    ck_assert_str_eq(j.branch, "{\"parent\":1,\"step\":500}");
    ck_assert_int_eq(j.status, STORE_QUEUED);
    store_job_clear(&j);
    ck_assert_int_eq(store_job_branches(st, id, &ids, &nb), 0);
    ck_assert_int_eq(nb, 2);
    ck_assert(ids[0] == b1 && ids[1] > b1);
    free(ids);
    ck_assert_int_eq(store_job_get(st, id, &j), 0);
    ck_assert(j.parent_id == 0 && j.branch == NULL);
    store_job_clear(&j);

    for (int s = 0; s < STORE_NSTATUS; s++) {
        store_status back;
        ck_assert_int_eq(store_status_parse(store_status_name((store_status)s), &back), 0);
        ck_assert_int_eq(back, s);
    }
    ck_assert_int_eq(store_status_parse("done", &(store_status){0}), STORE_EINVAL);
    ck_assert(store_status_finished(STORE_CANCELLED) && !store_status_finished(STORE_INTERRUPTED));
    for (int i = 0; i < NF; i++)
        ck_assert_int_eq(store_metric_parse(store_metric_name(i)), i);
    ck_assert_int_eq(store_metric_parse("loss; DROP"), -1);
    ck_assert_str_eq(store_metric_name(STORE_M_LOSS_SCALE), "loss_scale");
}
END_TEST

START_TEST(test_job_delete_cascade)
{
    int64_t a = new_job("a", "fp16"), b = new_job("b", "fp16");
    store_metric m;
    store_series se;
    store_event *ev;
    store_checkpoint *ck;
    store_job j;
    sqlite3 *db;
    int n, f = STORE_M_LOSS;
    static const char *const counts[] = {
        "SELECT COUNT(*) FROM metrics WHERE job_id=?1",
        "SELECT COUNT(*) FROM metrics_rollup WHERE job_id=?1",
        "SELECT COUNT(*) FROM events WHERE job_id=?1",
        "SELECT COUNT(*) FROM checkpoints WHERE job_id=?1",
        "SELECT COUNT(*) FROM layer_stats WHERE job_id=?1",
        "SELECT COUNT(*) FROM layer_steps WHERE job_id=?1",
    };
    store_layer_stat lrow;

    for (int64_t s = 0; s < 2500; s++) {
        gen_metric(&m, a, s, s % 100 == 0);
        ck_assert_int_eq(store_metric_append(st, &m), 0);
        m.job_id = b;
        ck_assert_int_eq(store_metric_append(st, &m), 0);
    }
    for (int k = 0; k < 5; k++) {
        ck_assert_int_eq(store_event_append(st, a, k, "lifecycle", "started", NULL), 0);
        ck_assert_int_eq(store_event_append(st, b, k, "lifecycle", "started", "{\"x\":1}"), 0);
    }
    ck_assert_int_eq(store_checkpoint_add(st, a, 500, "/tmp/a-500", 10), 0);
    ck_assert_int_eq(store_checkpoint_add(st, b, 500, "/tmp/b-500", 10), 0);
    memset(&lrow, 0, sizeof(lrow));
    snprintf(lrow.name, sizeof(lrow.name), "fc1");
    snprintf(lrow.dtype, sizeof(lrow.dtype), "fp16");
    ck_assert_int_eq(store_layer_stats_append(st, a, 10, NULL, &lrow, 1), 0);
    ck_assert_int_eq(store_layer_stats_append(st, b, 10, NULL, &lrow, 1), 0);
    ck_assert_int_eq(store_flush(st), 0);
    db = raw_open();
    for (size_t i = 0; i < 6; i++)
        ck_assert_int_gt(raw_int(db, counts[i], a), 0);

    /* not flushed: the delete must commit the queue before it cascades */
    ck_assert_int_eq(store_layer_stats_append(st, a, 20, NULL, &lrow, 1), 0);
    ck_assert_int_eq(store_job_delete(st, a), 0);
    for (size_t i = 0; i < 6; i++) {
        ck_assert_msg(raw_int(db, counts[i], a) == 0, "%s", counts[i]);
        ck_assert_int_gt(raw_int(db, counts[i], b), 0);
    }
    sqlite3_close(db);
    ck_assert_int_eq(store_job_get(st, a, &j), STORE_ENOTFOUND);
    ck_assert_int_eq(store_job_delete(st, a), STORE_ENOTFOUND);
    ck_assert_int_eq(store_series_query(st, a, &f, 1, 0, -1, 100, &se), 0);
    ck_assert_int_eq(se.npoints, 0);
    store_series_free(&se);
    ck_assert_int_eq(store_event_list(st, a, 0, 100, &ev, &n), 0);
    ck_assert_int_eq(n, 0);
    store_events_free(ev, n);
    ck_assert_int_eq(store_checkpoint_list(st, a, &ck, &n), 0);
    ck_assert_int_eq(n, 0);
    free(ck);
    ck_assert_int_eq(store_metric_latest(st, a, &m), STORE_ENOTFOUND);
    {
        store_layer_stat *lr = NULL;
        int64_t at;
        ck_assert_int_eq(store_layer_stats_get(st, a, -1, &lr, &n, &at, NULL), STORE_ENOTFOUND);
        ck_assert_int_eq(store_layer_stats_get(st, b, -1, &lr, &n, &at, NULL), 0);
        ck_assert_int_eq(n, 1);
        ck_assert_int_eq(at, 10);
        free(lr);
    }

    /* rows still arriving for the deleted job are dropped; the writer keeps going */
    gen_metric(&m, a, 3000, false);
    ck_assert_int_eq(store_metric_append(st, &m), 0);
    ck_assert_int_eq(store_event_append(st, a, 3000, "lifecycle", "late", NULL), 0);
    ck_assert_int_eq(store_layer_stats_append(st, a, 3000, NULL, &lrow, 1), 0);
    gen_metric(&m, b, 3000, false);
    ck_assert_int_eq(store_metric_append(st, &m), 0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(store_metric_latest(st, a, &m), STORE_ENOTFOUND);
    ck_assert_int_eq(store_metric_latest(st, b, &m), 0);
    ck_assert_int_eq(m.step, 3000);
    ck_assert_int_eq(store_checkpoint_add(st, a, 600, "/tmp/a-600", 1), STORE_ENOTFOUND);
}
END_TEST

/* ---- metrics ------------------------------------------------------------------------------ */

START_TEST(test_metrics_roundtrip)
{
    int64_t job = new_job("m", "fp16");
    model md = model_new(10000);
    store_metric m;
    store_series se;
    store_stats stats;
    int nspecial = 0;

    rng_state = 0x9e3779b97f4a7c15ull;
    for (int64_t s = 0; s < 10000; s++) {
        gen_metric(&m, job, s, s % 250 == 0);
        if (s == 17) { /* every kind of non-finite in one row */
            m.v[STORE_M_LOSS] = NAN;
            m.v[STORE_M_GRAD_NORM] = INFINITY;
            m.v[STORE_M_LOSS_SCALE] = -INFINITY;
        }
        put(&md, &m);
    }
    /* a rank-1 row is stored but is not part of the rank-0 series */
    gen_metric(&m, job, 10, false);
    m.rank = 1;
    m.v[STORE_M_LOSS] = 12345.0;
    ck_assert_int_eq(store_metric_append(st, &m), 0);
    ck_assert_int_eq(store_flush(st), 0);

    ck_assert_int_eq(store_series_query(st, job, all_fields, NF, 0, -1, 0, &se), 0);
    ck_assert_int_eq(se.npoints, 10000);
    ck_assert_int_eq(se.total_steps, 10000);
    for (int k = 0; k < se.npoints; k++) {
        const store_point *p = &se.points[k];
        const mrow *r = &md.rows[k];
        ck_assert_int_eq(p->step_first, k);
        ck_assert_int_eq(p->step_last, k);
        ck_assert_int_eq(p->count, 1);
        ck_assert_uint_eq(p->flags, row_flags(r, (1u << NF) - 1));
        nspecial += p->flags != 0;
        for (int f = 0; f < NF; f++) {
            ck_assert_msg(same(p->min[f], r->v[f]) && same(p->max[f], r->v[f]) &&
                              same(p->last[f], r->v[f]),
                          "step %d field %d: %g want %g", k, f, p->last[f], r->v[f]);
            if (isinf(r->v[f]))
                ck_assert(isinf(p->last[f]) && signbit(p->last[f]) == signbit(r->v[f]));
        }
    }
    ck_assert(isnan(se.points[17].last[STORE_M_LOSS]));
    ck_assert(isinf(se.points[17].last[STORE_M_GRAD_NORM]) &&
              se.points[17].last[STORE_M_GRAD_NORM] > 0);
    ck_assert(isinf(se.points[17].last[STORE_M_LOSS_SCALE]) &&
              se.points[17].last[STORE_M_LOSS_SCALE] < 0);
    ck_assert_uint_eq(se.points[17].flags & STORE_F_NONFINITE, STORE_F_NONFINITE);
    ck_assert_int_gt(nspecial, 50); /* the generator did make overflow/NaN steps */
    ck_assert_int_eq(se.points[10].last[STORE_M_LOSS] == 12345.0, 0);
    store_series_free(&se);

    /* a sub-range, fields in another order */
    {
        int fl[3] = {STORE_M_GRAD_NORM, STORE_M_LOSS, STORE_M_EVAL_LOSS};
        check_series(&md, job, fl, 3, 4990, 5010, 0);
    }

    ck_assert_int_eq(store_metric_latest(st, job, &m), 0);
    ck_assert_int_eq(m.step, 9999);
    ck_assert_int_eq(m.rank, 0);
    ck_assert(!m.has_eval);
    for (int f = 0; f < NF; f++)
        ck_assert(same(m.v[f], md.rows[9999].v[f]));

    store_get_stats(st, &stats);
    ck_assert_int_eq(stats.metric_rows, 10001);
    ck_assert_int_ge(stats.batches, 1);
    ck_assert_int_eq(stats.queue_depth, 0);
    ck_assert_int_eq(stats.jobs_by_status[STORE_QUEUED], 1);
    {
        store_job j;
        ck_assert_int_eq(store_job_get(st, job, &j), 0);
        ck_assert_int_eq(j.step, 9999);
        store_job_clear(&j);
    }
    check_rollups(&md, job);
    free(md.rows);
}
END_TEST

/* store_metric_eval of an eval line's two fields. */
static int eval_at(int64_t job, int64_t step, double loss, double acc)
{
    double v[NF];
    for (int i = 0; i < NF; i++)
        v[i] = NAN;
    v[STORE_M_EVAL_LOSS] = loss;
    v[STORE_M_EVAL_ACC] = acc;
    return store_metric_eval(st, job, 0, step, v);
}

START_TEST(test_upsert_and_eval)
{
    int64_t job = new_job("u", "fp16");
    model md = model_new(30000);
    store_metric m;
    int fl[4] = {STORE_M_LOSS, STORE_M_EVAL_LOSS, STORE_M_EVAL_ACC, STORE_M_GRAD_NORM};

    rng_state = 12345;
    for (int64_t s = 0; s < 25000; s++) {
        gen_metric(&m, job, s, false);
        put(&md, &m);
        if (s % 200 == 199) { /* eval after its step row, as `ampd run` prints them */
            double loss = s == 1999 ? NAN : urand(), acc = urand();
            ck_assert_int_eq(eval_at(job, s, loss, acc), 0);
            md.rows[s].v[STORE_M_EVAL_LOSS] = loss;
            md.rows[s].v[STORE_M_EVAL_ACC] = acc;
            md.rows[s].has_eval = true;
        }
    }
    ck_assert_int_eq(store_flush(st), 0);
    /* rewrite steps (a resumed job without truncate, out of order), some with eval */
    for (int k = 0; k < 300; k++) {
        int64_t s = (int64_t)(rnd() % 25000);
        gen_metric(&m, job, s, k % 3 == 0);
        m.v[STORE_M_LOSS] = k % 2 ? -1000.0 - k : 1000.0 + k; /* new extremes */
        put(&md, &m);
    }
    /* an eval before its row, then the row */
    ck_assert_int_eq(eval_at(job, 26000, 0.25, 0.75), 0);
    ck_assert_int_eq(store_flush(st), 0);
    gen_metric(&m, job, 26000, false);
    put(&md, &m);
    md.rows[26000].v[STORE_M_EVAL_LOSS] = 0.25;
    md.rows[26000].v[STORE_M_EVAL_ACC] = 0.75;
    md.rows[26000].has_eval = true;
    ck_assert_int_eq(store_flush(st), 0);

    ck_assert_int_eq(store_metric_latest(st, job, &m), 0);
    ck_assert_int_eq(m.step, 26000);
    ck_assert(m.has_eval);
    ck_assert(m.v[STORE_M_EVAL_LOSS] == 0.25 && m.v[STORE_M_EVAL_ACC] == 0.75);

    check_series(&md, job, all_fields, NF, 0, -1, 0);
    check_series(&md, job, fl, 4, 0, -1, 10);
    check_series(&md, job, fl, 4, 0, -1, 250);
    check_series(&md, job, all_fields, NF, 37, 24999, 23);
    check_rollups(&md, job);
    free(md.rows);
}
END_TEST

START_TEST(test_truncate)
{
    int64_t job = new_job("t", "fp16");
    model md = model_new(40000);
    store_metric m;
    store_job j;
    int fl[3] = {STORE_M_LOSS, STORE_M_LOSS_SCALE, STORE_M_OVERFLOW};

    rng_state = 777;
    for (int64_t s = 1; s <= 25000; s++) {
        gen_metric(&m, job, s, s % 500 == 0);
        put(&md, &m);
    }
    ck_assert_int_eq(store_checkpoint_add(st, job, 12000, "/tmp/ck", 5), 0);
    /* truncate without a flush first: the queued rows must be committed before the delete */
    ck_assert_int_eq(store_metrics_truncate(st, job, 12345), 0);
    for (int64_t s = 12346; s < md.n; s++)
        md.rows[s].present = false;
    ck_assert_int_eq(store_job_get(st, job, &j), 0);
    ck_assert_int_eq(j.step, 12345);
    store_job_clear(&j);
    ck_assert_int_eq(store_metric_latest(st, job, &m), 0);
    ck_assert_int_eq(m.step, 12345);
    check_rollups(&md, job);
    check_series(&md, job, fl, 3, 0, -1, 0);
    check_series(&md, job, fl, 3, 0, -1, 1000);
    check_series(&md, job, fl, 3, 0, -1, 7);
    check_series(&md, job, all_fields, NF, 11111, -1, 3);
    check_series(&md, job, fl, 3, 0, 30000, 2);

    /* the resumed job writes its steps again, with other values */
    for (int64_t s = 12346; s <= 30000; s++) {
        gen_metric(&m, job, s, s % 500 == 0);
        put(&md, &m);
    }
    ck_assert_int_eq(store_flush(st), 0);
    check_rollups(&md, job);
    check_series(&md, job, fl, 3, 0, -1, 1000);
    check_series(&md, job, fl, 3, 5, -1, 3);
    check_series(&md, job, all_fields, NF, 12000, 13000, 10);

    /* truncating everything, and at a bucket edge */
    ck_assert_int_eq(store_metrics_truncate(st, job, 9999), 0);
    for (int64_t s = 10000; s < md.n; s++)
        md.rows[s].present = false;
    check_rollups(&md, job);
    check_series(&md, job, fl, 3, 0, -1, 100);
    ck_assert_int_eq(store_metrics_truncate(st, job, 0), 0);
    for (int64_t s = 1; s < md.n; s++)
        md.rows[s].present = false;
    check_rollups(&md, job);
    ck_assert_int_eq(store_metric_latest(st, job, &m), STORE_ENOTFOUND);
    free(md.rows);
}
END_TEST

/* Random data with gaps, many widths and alignments, levels used and not used. */
START_TEST(test_downsample_bruteforce)
{
    int64_t job = new_job("d", "fp16"), other = new_job("other", "fp16");
    model md = model_new(40000);
    store_metric m;
    int fl[5] = {STORE_M_LOSS, STORE_M_LOSS_SCALE, STORE_M_GRAD_NORM, STORE_M_EVAL_ACC,
                 STORE_M_STEP_MS};
    int one = STORE_M_LR;
    struct {
        int64_t from, to;
        int points;
    } cases[] = {
        {0, -1, 1000},      /* w 36: raw rows only */
        {0, -1, 100},       /* w 360: level 100 */
        {0, -1, 36},        /* w 1000: level 1000 aligned */
        {0, -1, 7},         /* w 5143: levels 1000 and 100 with edges */
        {0, -1, 2},         /* w 18000: level 10000 */
        {0, -1, 1},         /* one bucket */
        {123, 29876, 37},   /* unaligned both ends */
        {5, 25000, 10000},  /* w 3 */
        {777, 10776, 1},    /* one unaligned bucket of 10000 */
        {999, 31001, 16},   /* w 2001 */
        {0, 99, 100},       /* w 1 */
        {35000, 40000, 10}, /* beyond the data: empty */
        {100, 50, 10},      /* to < from: empty */
        {0, 100000, 3},     /* to beyond the data */
    };

    rng_state = 4242;
    /* steps 0..35999 with 10% gaps, written mostly in order with some blocks out of order */
    for (int64_t blk = 0; blk < 360; blk++) {
        int64_t b = blk % 50 == 7 ? blk + 1 : blk % 50 == 8 ? blk - 1 : blk;
        for (int64_t s = b * 100; s < b * 100 + 100; s++) {
            if (rnd() % 10 == 0)
                continue;
            gen_metric(&m, job, s, s % 50 == 0);
            put(&md, &m);
            if (s % 1000 == 0) { /* another job's rows interleave */
                m.job_id = other;
                ck_assert_int_eq(store_metric_append(st, &m), 0);
            }
        }
    }
    ck_assert_int_eq(store_flush(st), 0);
    check_rollups(&md, job);
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        check_series(&md, job, fl, 5, cases[c].from, cases[c].to, cases[c].points);
        check_series(&md, job, &one, 1, cases[c].from, cases[c].to, cases[c].points);
    }
    check_series(&md, job, all_fields, NF, 0, -1, 13);
    check_series(&md, job, NULL, 0, 0, -1, 13);

    /* special steps are never hidden: each overflow/skipped/NaN step is its own point */
    {
        store_series se;
        int f = STORE_M_LOSS, found = 0, want = 0;
        ck_assert_int_eq(store_series_query(st, job, &f, 1, 0, -1, 10, &se), 0);
        for (int64_t s = 0; s < md.n; s++) {
            if (!md.rows[s].present || !row_flags(&md.rows[s], 1u << f))
                continue;
            want++;
            for (int k = 0; k < se.npoints; k++)
                if (se.points[k].count == 1 && se.points[k].step_first == s) {
                    found++;
                    break;
                }
        }
        ck_assert_int_gt(want, 100);
        ck_assert_int_eq(found, want);
        ck_assert_int_le(se.npoints, 10 + want);
        store_series_free(&se);
    }
    free(md.rows);
}
END_TEST

START_TEST(test_bad_input)
{
    store_series se;
    store_metric m;
    int bad = NF, f = 0;
    int64_t job = new_job("b", "fp16");

    ck_assert_int_eq(store_series_query(st, job, &bad, 1, 0, -1, 10, &se), STORE_EINVAL);
    ck_assert_int_eq(store_series_query(st, job, &f, NF + 1, 0, -1, 10, &se), STORE_EINVAL);
    ck_assert_int_eq(store_series_query(st, job, NULL, 1, 0, -1, 10, &se), STORE_EINVAL);
    ck_assert_int_eq(store_series_query(NULL, job, &f, 1, 0, -1, 10, &se), STORE_EINVAL);
    ck_assert_int_eq(store_series_query(st, 4242, &f, 1, 0, -1, 10, &se), 0);
    ck_assert_int_eq(se.npoints, 0);
    store_series_free(&se);
    store_series_free(NULL);
    gen_metric(&m, job, -1, false);
    ck_assert_int_eq(store_metric_append(st, &m), STORE_EINVAL);
    ck_assert_int_eq(store_metric_append(st, NULL), STORE_EINVAL);
    ck_assert_int_eq(
        store_event_append(st, job, 1, "a-kind-name-that-is-far-too-long-to-fit", "m", NULL),
        STORE_EINVAL);
    ck_assert_int_eq(store_event_append(st, job, 1, "k", NULL, NULL), STORE_EINVAL);
    ck_assert_int_eq(store_checkpoint_add(st, job, -5, "/x", 1), STORE_EINVAL);
    store_job_clear(NULL);
    store_jobs_free(NULL, 0);
    store_events_free(NULL, 0);
}
END_TEST

/* ---- events, checkpoints ----------------------------------------------------------------- */

START_TEST(test_events_cursor)
{
    int64_t a = new_job("a", "fp16"), b = new_job("b", "fp16"), after = 0;
    store_event *ev;
    int n, total = 0;
    double t0 = (double)time(NULL);

    for (int k = 0; k < 25; k++) {
        char msg[64];
        snprintf(msg, sizeof(msg), "event %d with 'quotes' and \"json\"", k);
        ck_assert_int_eq(store_event_append(st, a, 10 * k, k % 2 ? "overflow" : "scale", msg,
                                            k % 3 ? NULL : "{\"scale\":32768}"),
                         0);
        ck_assert_int_eq(store_event_append(st, b, k, "lifecycle", "other job", NULL), 0);
    }
    ck_assert_int_eq(store_flush(st), 0);
    for (;;) {
        ck_assert_int_eq(store_event_list(st, a, after, 10, &ev, &n), 0);
        if (n == 0) {
            store_events_free(ev, n);
            break;
        }
        for (int k = 0; k < n; k++) {
            int idx = total + k;
            char msg[64];
            snprintf(msg, sizeof(msg), "event %d with 'quotes' and \"json\"", idx);
            ck_assert_int_gt(ev[k].id, after);
            ck_assert_int_eq(ev[k].job_id, a);
            ck_assert_int_eq(ev[k].step, 10 * idx);
            ck_assert_str_eq(ev[k].kind, idx % 2 ? "overflow" : "scale");
            ck_assert_str_eq(ev[k].message, msg);
            if (idx % 3)
                ck_assert_ptr_null(ev[k].data);
            else
                ck_assert_str_eq(ev[k].data, "{\"scale\":32768}");
            ck_assert(ev[k].ts >= t0 - 1 && ev[k].ts <= t0 + 10);
            after = ev[k].id;
        }
        ck_assert_int_eq(n, total < 20 ? 10 : 5);
        total += n;
        store_events_free(ev, n);
    }
    ck_assert_int_eq(total, 25);
    ck_assert_int_eq(store_event_list(st, a, 0, 0, &ev, &n), STORE_EINVAL);
}
END_TEST

START_TEST(test_checkpoints)
{
    int64_t job = new_job("c", "fp16");
    store_checkpoint *ck;
    int n;

    ck_assert_int_eq(store_checkpoint_add(st, job, 1000, "/data/jobs/1/ckpt-1000", 123), 0);
    ck_assert_int_eq(store_checkpoint_add(st, job, 500, "/data/jobs/1/ckpt-500", 100), 0);
    ck_assert_int_eq(store_checkpoint_add(st, job, 1500, "/data/jobs/1/ckpt-1500", 150), 0);
    ck_assert_int_eq(store_checkpoint_add(st, job, 1000, "/data/jobs/1/ckpt-1000b", 124), 0);
    ck_assert_int_eq(store_checkpoint_list(st, job, &ck, &n), 0);
    ck_assert_int_eq(n, 3);
    ck_assert_int_eq(ck[0].step, 500);
    ck_assert_int_eq(ck[1].step, 1000);
    ck_assert_int_eq(ck[2].step, 1500);
    ck_assert_str_eq(ck[1].path, "/data/jobs/1/ckpt-1000b");
    ck_assert_int_eq(ck[1].bytes, 124);
    ck_assert(ck[0].created_at > 1e9);
    free(ck);
    ck_assert_int_eq(store_checkpoint_add(st, 4242, 1, "/x", 1), STORE_ENOTFOUND);

    /* the job's disk use is the sum of its checkpoints' bytes; a deleted one leaves it,
     * with its stream row */
    store_job j;
    memset(&j, 0, sizeof(j));
    ck_assert_int_eq(store_job_get(st, job, &j), 0);
    ck_assert_int_eq(j.checkpoint_bytes, 100 + 124 + 150);
    store_job_clear(&j);
    ck_assert_int_eq(store_checkpoint_delete(st, job, 1000), 0);
    ck_assert_int_eq(store_checkpoint_delete(st, job, 1000), STORE_ENOTFOUND);
    ck_assert_int_eq(store_checkpoint_list(st, job, &ck, &n), 0);
    ck_assert_int_eq(n, 2);
    ck_assert(ck[0].step == 500 && ck[1].step == 1500);
    free(ck);
    ck_assert_int_eq(store_job_get(st, job, &j), 0);
    ck_assert_int_eq(j.checkpoint_bytes, 100 + 150);
    store_job_clear(&j);
    store_stream_row *rows = NULL;
    int nrows = 0, c1000 = 0;
    ck_assert_int_eq(store_stream_read(st, job, 0, 1000, &rows, &nrows), 0);
    for (int i = 0; i < nrows; i++)
        c1000 += rows[i].kind == STORE_SM_CHECKPOINT && rows[i].step == 1000;
    free(rows);
    ck_assert_int_eq(c1000, 0);
    store_job_filter f = {.status = -1, .limit = 1000};
    store_job *all = NULL;
    ck_assert_int_eq(store_job_list(st, &f, &all, &n), 0);
    for (int i = 0; i < n; i++)
        if (all[i].id == job)
            ck_assert_int_eq(all[i].checkpoint_bytes, 100 + 150);
    store_jobs_free(all, n);
}
END_TEST

/* ---- concurrency -------------------------------------------------------------------------- */

enum { NREADERS = 4 };
static atomic_int writer_done;
static atomic_long reader_iters[NREADERS]; /* each reader's rounds of queries so far */
static int64_t conc_job;

/* Rows are written in step order from 0, so every committed snapshot holds a prefix: each
 * query must see steps 0..k with no gap, whatever k is. arg: the reader's index. */
static void *reader_main(void *arg)
{
    int f[2] = {STORE_M_LOSS, STORE_M_STEP_MS};
    int64_t last_seen = -1;
    long iters = 0;
    atomic_long *done = &reader_iters[(intptr_t)arg];
    while (!atomic_load(&writer_done) || iters < 5) {
        store_metric m;
        store_series se;
        store_job j;
        store_stats stats;
        int64_t sum = 0;

        if (store_metric_latest(st, conc_job, &m) == 0) {
            ck_assert_int_ge(m.step, last_seen);
            last_seen = m.step;
            ck_assert(m.v[STORE_M_LOSS] == (double)m.step * 0.5);
        }
        ck_assert_int_eq(store_series_query(st, conc_job, f, 2, 0, -1, 50, &se), 0);
        for (int k = 0; k < se.npoints; k++) {
            const store_point *p = &se.points[k];
            ck_assert_int_eq(p->count, p->step_last - p->step_first + 1);
            ck_assert(p->min[0] == (double)p->step_first * 0.5);
            ck_assert(p->max[0] == (double)p->step_last * 0.5);
            ck_assert(p->last[1] == (double)p->step_last);
            if (k > 0)
                ck_assert_int_eq(p->step_first, se.points[k - 1].step_last + 1);
            sum += p->count;
        }
        ck_assert_int_eq(sum, se.total_steps);
        if (se.npoints)
            ck_assert_int_eq(se.total_steps, se.points[se.npoints - 1].step_last + 1);
        store_series_free(&se);
        if (last_seen > 10) {
            ck_assert_int_eq(store_series_query(st, conc_job, f, 2, 0, last_seen, 0, &se), 0);
            ck_assert_int_eq(se.npoints, last_seen + 1);
            store_series_free(&se);
        }
        ck_assert_int_eq(store_job_get(st, conc_job, &j), 0);
        store_job_clear(&j);
        store_get_stats(st, &stats);
        iters++;
        atomic_store(done, iters);
    }
    return (void *)iters;
}

/* Every reader has queried again since seen[] (their counts then), at most 10 s: the writes
 * go on only once each has read between them. */
static void readers_went_on(long seen[NREADERS])
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < NREADERS; i++) {
        while (atomic_load(&reader_iters[i]) <= seen[i]) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            ck_assert_msg(t.tv_sec - t0.tv_sec < 10, "reader %d made no query in 10 s", i);
            usleep(1000);
        }
        seen[i] = atomic_load(&reader_iters[i]);
    }
}

START_TEST(test_concurrent_readers)
{
    pthread_t th[NREADERS];
    long seen[NREADERS] = {0};
    store_metric m;
    store_series se;
    int f = STORE_M_LOSS;

    conc_job = new_job("conc", "fp16");
    atomic_store(&writer_done, 0);
    for (int i = 0; i < NREADERS; i++) {
        atomic_store(&reader_iters[i], 0);
        ck_assert_int_eq(pthread_create(&th[i], NULL, reader_main, (void *)(intptr_t)i), 0);
    }
    memset(&m, 0, sizeof(m));
    m.job_id = conc_job;
    for (int64_t s = 0; s < 60000; s++) {
        m.step = s;
        m.v[STORE_M_LOSS] = (double)s * 0.5;
        m.v[STORE_M_STEP_MS] = (double)s;
        m.v[STORE_M_EVAL_LOSS] = m.v[STORE_M_EVAL_ACC] = NAN;
        ck_assert_int_eq(store_metric_append(st, &m), 0);
        if (s % 5000 == 0)
            readers_went_on(seen); /* the readers query while the rows go in */
    }
    ck_assert_int_eq(store_flush(st), 0);
    atomic_store(&writer_done, 1);
    for (int i = 0; i < NREADERS; i++) {
        void *iters;
        ck_assert_int_eq(pthread_join(th[i], &iters), 0);
        ck_assert_int_ge((long)iters, 5);
    }
    ck_assert_int_eq(store_series_query(st, conc_job, &f, 1, 0, -1, 0, &se), 0);
    ck_assert_int_eq(se.npoints, 60000);
    store_series_free(&se);
}
END_TEST

/* ---- per-layer diagnostics --------------------------------------------------------------- */

static store_layer_stat lstat(const char *name, const char *dtype, const double *v,
                              unsigned missing)
{
    store_layer_stat r;
    memset(&r, 0, sizeof(r));
    snprintf(r.name, sizeof(r.name), "%s", name);
    snprintf(r.dtype, sizeof(r.dtype), "%s", dtype);
    for (int f = 0; f < NLF; f++)
        r.v[f] = (missing >> f) & 1u ? NAN : v[f];
    r.missing = missing;
    return r;
}

static void check_lrow(const store_layer_stat *got, const store_layer_stat *want)
{
    ck_assert_str_eq(got->name, want->name);
    ck_assert_str_eq(got->dtype, want->dtype);
    ck_assert_uint_eq(got->missing, want->missing);
    for (int f = 0; f < NLF; f++)
        ck_assert_msg(same(got->v[f], want->v[f]), "%s.%s: %g, expected %g", want->name,
                      store_layer_field_name(f), got->v[f], want->v[f]);
}

/* Make the database look as schema version v left it: drop the columns of the fields added
 * after v (the fp8 layer fields: version 9), the branches' lineage (version 8), jobs.launch
 * (version 7), the experiments (version 6), the stream table (version 5) and the schema_version
 * rows above v (the other tables are the caller's). */
#define LSINCE_(id, f, kind, since) since,
static const int layer_since[NLF] = {STORE_LAYER_FIELDS(LSINCE_)};

static void downgrade_fields(sqlite3 *db, int v)
{
    char sql[512];
    for (int f = 0; f < NLF; f++) {
        if (layer_since[f] <= v || layer_since[f] <= 2) /* version 2's: migration_2's table */
            continue;
        snprintf(sql, sizeof(sql), "ALTER TABLE layer_stats DROP COLUMN %s",
                 store_layer_field_name(f));
        ck_assert_int_eq(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
    }
    if (v < 8)
        ck_assert_int_eq(sqlite3_exec(db,
                                      "DROP INDEX jobs_parent; ALTER TABLE jobs DROP COLUMN "
                                      "parent_id; ALTER TABLE jobs DROP COLUMN branch",
                                      NULL, NULL, NULL),
                         SQLITE_OK);
    if (v < 7)
        ck_assert_int_eq(sqlite3_exec(db, "ALTER TABLE jobs DROP COLUMN launch", NULL, NULL, NULL),
                         SQLITE_OK);
    if (v < 6)
        ck_assert_int_eq(sqlite3_exec(db, "DROP TABLE experiment_jobs; DROP TABLE experiments",
                                      NULL, NULL, NULL),
                         SQLITE_OK);
    if (v < 5)
        ck_assert_int_eq(sqlite3_exec(db, "DROP TABLE stream", NULL, NULL, NULL), SQLITE_OK);
    for (int f = 0; f < NF; f++) {
        const char *name = store_metric_name(f);
        if (store_metric_field(f)->since <= v)
            continue;
        snprintf(sql, sizeof(sql),
                 "ALTER TABLE metrics DROP COLUMN %s; ALTER TABLE metrics_rollup DROP COLUMN "
                 "%s_min; ALTER TABLE metrics_rollup DROP COLUMN %s_max; ALTER TABLE "
                 "metrics_rollup DROP COLUMN %s_last",
                 name, name, name, name);
        ck_assert_int_eq(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
    }
    snprintf(sql, sizeof(sql), "DELETE FROM schema_version WHERE version > %d", v);
    ck_assert_int_eq(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
}

/* A database made by the version-1 schema is migrated: its placeholder layer_stats is
 * replaced, everything else is kept. */
START_TEST(test_migrate_from_v1)
{
    int64_t id = new_job("old", "fp16");
    sqlite3 *db;
    store_layer_stat r, *rows = NULL;
    double v[NLF] = {1, 2, 3, 4, 0.5, 0.25, 0, 0};
    int64_t at;
    int n;
    store_job j;

    store_close(st);
    st = NULL;
    db = raw_open();
    downgrade_fields(db, 1);
    ck_assert_int_eq(
        sqlite3_exec(db,
                     "DROP TABLE layer_steps; DROP TABLE layer_stats; "
                     "CREATE TABLE layer_stats (job_id INTEGER NOT NULL REFERENCES jobs(id) "
                     "ON DELETE CASCADE, step INTEGER NOT NULL, layer INTEGER NOT NULL, name TEXT "
                     "NOT NULL, act_amax REAL, act_headroom REAL, grad_amax REAL, grad_amax_scaled "
                     "REAL, grad_underflow REAL, grad_underflow_unscaled REAL, nonfinite INTEGER "
                     "NOT NULL DEFAULT 0, PRIMARY KEY (job_id, step, layer)) WITHOUT ROWID; "
                     "DELETE FROM schema_version WHERE version > 1",
                     NULL, NULL, NULL),
        SQLITE_OK);
    ck_assert_int_eq(raw_int(db, "SELECT MAX(version) FROM schema_version", 0), 1);
    sqlite3_close(db);

    ck_assert_int_eq(store_open(db_path, &st), 0);
    db = raw_open();
    ck_assert_int_eq(raw_int(db, "SELECT MAX(version) FROM schema_version", 0), SCHEMA_VERSION);
    ck_assert_int_eq(raw_int(db,
                             "SELECT COUNT(*) FROM pragma_table_info('layer_stats') WHERE "
                             "name IN ('dtype','act_overflow','grad_nonfinite',"
                             "'lost_updates','nan_mask')",
                             0),
                     5);
    ck_assert_int_eq(raw_int(db,
                             "SELECT COUNT(*) FROM pragma_table_info('layer_stats') WHERE "
                             "name IN ('grad_amax_scaled','nonfinite')",
                             0),
                     0);
    sqlite3_close(db);
    ck_assert_int_eq(store_job_get(st, id, &j), 0);
    ck_assert_str_eq(j.name, "old");
    store_job_clear(&j);
    r = lstat("fc1", "fp16", v, 0);
    ck_assert_int_eq(store_layer_stats_append(st, id, 5, NULL, &r, 1), 0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(store_layer_stats_get(st, id, -1, &rows, &n, &at, NULL), 0);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(at, 5);
    check_lrow(&rows[0], &r);
    free(rows);
}
END_TEST

/* Columns of table named col. */
static int64_t column_count(sqlite3 *db, const char *table, const char *col)
{
    char sql[256];
    snprintf(sql, sizeof(sql), "SELECT COUNT(*) FROM pragma_table_info('%s') WHERE name='%s'",
             table, col);
    return raw_int(db, sql, 0);
}

/* Every field of the metric table has its column in metrics and its min/max/last in
 * metrics_rollup, and its name parses back to it. */
START_TEST(test_field_columns)
{
    sqlite3 *db = raw_open();
    static const char *const suffix[] = {"_min", "_max", "_last"};
    for (int f = 0; f < NF; f++) {
        const char *name = store_metric_name(f);
        char col[80];
        ck_assert_int_eq(store_metric_parse(name), f);
        ck_assert_int_ge(store_metric_field(f)->since, 1);
        ck_assert_int_le(store_metric_field(f)->since, store_schema_version());
        ck_assert_msg(column_count(db, "metrics", name) == 1, "metrics.%s missing", name);
        for (int k = 0; k < 3; k++) {
            snprintf(col, sizeof(col), "%s%s", name, suffix[k]);
            ck_assert_msg(column_count(db, "metrics_rollup", col) == 1,
                          "metrics_rollup.%s missing", col);
        }
    }
    ck_assert_int_eq(store_metric_parse("nope"), -1);
    ck_assert_ptr_null(store_metric_field(NF));
    sqlite3_close(db);
}
END_TEST

/* A database of schema version 2 (before tokens_per_s and lost_updates) gets the columns of
 * the fields added since, keeps its rows (the new fields read as absent, NaN), and stores
 * the new fields of new rows. */
START_TEST(test_migrate_from_v2)
{
    int64_t id = new_job("old", "fp16");
    store_metric m, got;
    sqlite3 *db;

    gen_metric(&m, id, 3, false);
    m.v[STORE_M_LOSS] = 2.5;
    ck_assert_int_eq(store_metric_append(st, &m), 0);
    store_close(st);
    st = NULL;
    db = raw_open();
    downgrade_fields(db, 2);
    ck_assert_int_eq(column_count(db, "metrics", "tokens_per_s"), 0);
    sqlite3_close(db);

    ck_assert_int_eq(store_open(db_path, &st), 0);
    db = raw_open();
    ck_assert_int_eq(raw_int(db, "SELECT MAX(version) FROM schema_version", 0), SCHEMA_VERSION);
    ck_assert_int_eq(column_count(db, "metrics", "tokens_per_s"), 1);
    ck_assert_int_eq(column_count(db, "metrics", "lost_updates"), 1);
    ck_assert_int_eq(column_count(db, "metrics_rollup", "lost_updates_last"), 1);
    ck_assert_int_eq(column_count(db, "layer_stats", "fp8_grad_underflow"), 1);
    sqlite3_close(db);
    ck_assert_int_eq(store_metric_latest(st, id, &got), 0);
    ck_assert(got.v[STORE_M_LOSS] == 2.5);
    ck_assert(isnan(got.v[STORE_M_TOKENS_PER_S]) && isnan(got.v[STORE_M_LOST_UPDATES]));

    gen_metric(&m, id, 4, false);
    m.v[STORE_M_TOKENS_PER_S] = 12345.5;
    m.v[STORE_M_LOST_UPDATES] = 17;
    ck_assert_int_eq(store_metric_append(st, &m), 0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(store_metric_latest(st, id, &got), 0);
    ck_assert_int_eq(got.step, 4);
    ck_assert(got.v[STORE_M_TOKENS_PER_S] == 12345.5 && got.v[STORE_M_LOST_UPDATES] == 17);
}
END_TEST

START_TEST(test_layer_roundtrip)
{
    int64_t job = new_job("l", "fp16"), other = new_job("o", "fp16");
    const unsigned miss3 = (1u << STORE_L_LOST_UPDATES) | (1u << STORE_L_GRAD_UNDERFLOW_UNSCALED);
    double v1[NLF] = {1000.5, 65504.0 / 1000.5, 0, 3e-3, 0.25, 0.75, 0, 0};
    double v2[NLF] = {0, INFINITY, 7, NAN, NAN, 0.5, 2, -INFINITY};
    double v3[NLF] = {1e-30, 6.5e34, 0, 1e38, 1, 0, 0, 0};
    store_layer_stat want[3] = {lstat("fc1", "fp16", v1, 0), lstat("fc2", "bf16", v2, 0),
                                lstat("blocks.11.attn.proj", "fp32", v3, miss3)};
    store_layer_stat *rows = NULL, bad;
    store_layer_info info, got;
    int64_t at;
    int n;
    sqlite3 *db;

    memset(&info, 0, sizeof(info));
    info.scale = 32768;
    snprintf(info.first_layer, sizeof(info.first_layer), "fc2");
    snprintf(info.first_where, sizeof(info.first_where), "forward");
    info.flags = 0xff; /* ignored: the store computes them */
    ck_assert_int_eq(store_layer_stats_append(st, job, 10, &info, want, 3), 0);
    ck_assert_int_eq(store_layer_stats_append(st, job, 20, NULL, want, 1), 0);
    ck_assert_int_eq(store_layer_stats_append(st, job, 30, NULL, NULL, 0), 0);
    ck_assert_int_eq(store_flush(st), 0);

    /* the latest diagnosed step, even without rows */
    ck_assert_int_eq(store_layer_stats_get(st, job, -1, &rows, &n, &at, &got), 0);
    ck_assert_int_eq(at, 30);
    ck_assert_int_eq(n, 0);
    ck_assert(isnan(got.scale));
    ck_assert_str_eq(got.first_layer, "");
    ck_assert_uint_eq(got.flags, 0);
    free(rows);
    ck_assert_int_eq(store_layer_stats_get(st, job, 20, &rows, &n, &at, &got), 0);
    ck_assert_int_eq(n, 1);
    check_lrow(&rows[0], &want[0]);
    ck_assert_uint_eq(got.flags, 0);
    free(rows);
    ck_assert_int_eq(store_layer_stats_get(st, job, 10, &rows, &n, &at, &got), 0);
    ck_assert_int_eq(at, 10);
    ck_assert_int_eq(n, 3);
    for (int i = 0; i < 3; i++)
        check_lrow(&rows[i], &want[i]);
    ck_assert(got.scale == 32768);
    ck_assert_str_eq(got.first_layer, "fc2");
    ck_assert_str_eq(got.first_where, "forward");
    ck_assert_uint_eq(got.flags, STORE_LS_NONFINITE | STORE_LS_OVERFLOW);
    free(rows);
    ck_assert_int_eq(store_layer_stats_get(st, job, 15, &rows, &n, &at, NULL), STORE_ENOTFOUND);
    ck_assert_ptr_null(rows);
    ck_assert_int_eq(n, 0);
    ck_assert_int_eq(store_layer_stats_get(st, other, -1, &rows, &n, &at, NULL), STORE_ENOTFOUND);

    /* each flag on its own */
    {
        double c[NLF] = {1, 2, 0, 1, 0, 0, 0, 0};
        store_layer_stat r = lstat("x", "fp16", c, 0);
        store_layer_info fi;
        memset(&fi, 0, sizeof(fi));
        snprintf(fi.first_layer, sizeof(fi.first_layer), "x");
        ck_assert_int_eq(store_layer_stats_append(st, other, 1, NULL, &r, 1), 0);
        ck_assert_int_eq(store_layer_stats_append(st, other, 2, &fi, &r, 1), 0);
        r.v[STORE_L_GRAD_NONFINITE] = 1;
        ck_assert_int_eq(store_layer_stats_append(st, other, 3, NULL, &r, 1), 0);
        r.v[STORE_L_GRAD_NONFINITE] = 0;
        r.v[STORE_L_ACT_OVERFLOW] = 4;
        ck_assert_int_eq(store_layer_stats_append(st, other, 4, NULL, &r, 1), 0);
        r.v[STORE_L_ACT_OVERFLOW] = 0;
        r.v[STORE_L_ACT_AMAX] = INFINITY;
        ck_assert_int_eq(store_layer_stats_append(st, other, 5, NULL, &r, 1), 0);
        r.missing = 1u << STORE_L_ACT_AMAX; /* a missing field never raises a flag */
        ck_assert_int_eq(store_layer_stats_append(st, other, 6, NULL, &r, 1), 0);
        ck_assert_int_eq(store_flush(st), 0);
        static const unsigned wantf[] = {
            0, 0, STORE_LS_NONFINITE, STORE_LS_NONFINITE, STORE_LS_OVERFLOW, STORE_LS_NONFINITE, 0};
        for (int s2 = 1; s2 <= 6; s2++) {
            ck_assert_int_eq(store_layer_stats_get(st, other, s2, &rows, &n, &at, &fi), 0);
            ck_assert_msg(fi.flags == wantf[s2], "step %d: flags %u", s2, fi.flags);
            free(rows);
        }
        ck_assert_str_eq(fi.first_layer, "");
    }

    /* upsert: step 10 written again with one layer replaces its rows and record */
    want[0].v[STORE_L_ACT_AMAX] = 12.0;
    info.scale = 16384;
    info.first_layer[0] = '\0';
    ck_assert_int_eq(store_layer_stats_append(st, job, 10, &info, want, 1), 0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(store_layer_stats_get(st, job, 10, &rows, &n, &at, &got), 0);
    ck_assert_int_eq(n, 1);
    check_lrow(&rows[0], &want[0]);
    ck_assert(got.scale == 16384);
    ck_assert_str_eq(got.first_layer, "");
    ck_assert_str_eq(got.first_where, "");
    ck_assert_uint_eq(got.flags, 0);
    free(rows);
    db = raw_open();
    ck_assert_int_eq(raw_int(db, "SELECT COUNT(*) FROM layer_stats WHERE step=10", 0), 1);
    sqlite3_close(db);

    /* rows for a job that does not exist are dropped; the writer goes on */
    ck_assert_int_eq(store_layer_stats_append(st, 4242, 1, NULL, want, 2), 0);
    ck_assert_int_eq(store_layer_stats_append(st, job, 40, NULL, want, 2), 0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(store_layer_stats_get(st, 4242, -1, &rows, &n, &at, NULL), STORE_ENOTFOUND);
    ck_assert_int_eq(store_layer_stats_get(st, job, -1, &rows, &n, &at, NULL), 0);
    ck_assert_int_eq(at, 40);
    ck_assert_int_eq(n, 2);
    free(rows);

    /* bad input */
    ck_assert_int_eq(store_layer_stats_append(NULL, job, 1, NULL, want, 1), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_append(st, job, -1, NULL, want, 1), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_append(st, job, 1, NULL, want, -1), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_append(st, job, 1, NULL, NULL, 1), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_append(st, job, 1, NULL, want, STORE_LAYERS_MAX + 1),
                     STORE_EINVAL);
    bad = want[0];
    bad.name[0] = '\0';
    ck_assert_int_eq(store_layer_stats_append(st, job, 1, NULL, &bad, 1), STORE_EINVAL);
    memset(bad.name, 'a', sizeof(bad.name)); /* unterminated */
    ck_assert_int_eq(store_layer_stats_append(st, job, 1, NULL, &bad, 1), STORE_EINVAL);
    bad = want[0];
    memset(bad.dtype, 'b', sizeof(bad.dtype));
    ck_assert_int_eq(store_layer_stats_append(st, job, 1, NULL, &bad, 1), STORE_EINVAL);
    memset(info.first_where, 'w', sizeof(info.first_where));
    ck_assert_int_eq(store_layer_stats_append(st, job, 1, &info, want, 1), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_get(st, job, -1, NULL, &n, &at, NULL), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_get(NULL, job, -1, &rows, &n, &at, NULL), STORE_EINVAL);
    ck_assert_int_eq(store_layer_field_parse("grad_underflow_unscaled"),
                     STORE_L_GRAD_UNDERFLOW_UNSCALED);
    ck_assert_int_eq(store_layer_field_parse("loss"), -1);
    ck_assert_int_eq(store_layer_field_parse(NULL), -1);
    ck_assert_str_eq(store_layer_field_name(STORE_L_LOST_UPDATES), "lost_updates");
    ck_assert_ptr_null(store_layer_field_name(NLF));
    store_layer_range_free(NULL);
}
END_TEST

START_TEST(test_layer_truncate)
{
    int64_t job = new_job("lt", "fp16");
    double v[NLF] = {1, 2, 0, 3, 0.1, 0.2, 0, 0};
    store_layer_stat rows2[2] = {lstat("fc1", "fp16", v, 0), lstat("fc2", "fp16", v, 0)};
    store_layer_stat *rows = NULL;
    store_layer_range lr;
    int f = STORE_L_ACT_AMAX, n;
    int64_t at;
    sqlite3 *db;

    for (int64_t s = 10; s <= 100; s += 10)
        ck_assert_int_eq(store_layer_stats_append(st, job, s, NULL, rows2, 2), 0);
    /* not flushed: the truncate commits the queue first */
    ck_assert_int_eq(store_metrics_truncate(st, job, 55), 0);
    ck_assert_int_eq(store_layer_stats_get(st, job, -1, &rows, &n, &at, NULL), 0);
    ck_assert_int_eq(at, 50);
    free(rows);
    ck_assert_int_eq(store_layer_stats_get(st, job, 60, &rows, &n, &at, NULL), STORE_ENOTFOUND);
    db = raw_open();
    ck_assert_int_eq(raw_int(db, "SELECT COUNT(*) FROM layer_stats WHERE job_id=?1", job), 10);
    ck_assert_int_eq(raw_int(db, "SELECT COUNT(*) FROM layer_steps WHERE job_id=?1", job), 5);
    ck_assert_int_eq(store_layer_stats_range(st, job, 0, -1, 100, &f, 1, &lr), 0);
    ck_assert_int_eq(lr.total_steps, 5);
    ck_assert_int_eq(lr.nsteps, 5);
    ck_assert_int_eq(lr.steps[4], 50);
    store_layer_range_free(&lr);

    /* the resumed job writes its steps again */
    ck_assert_int_eq(store_layer_stats_append(st, job, 60, NULL, rows2, 1), 0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(store_layer_stats_get(st, job, -1, &rows, &n, &at, NULL), 0);
    ck_assert_int_eq(at, 60);
    ck_assert_int_eq(n, 1);
    free(rows);
    ck_assert_int_eq(store_metrics_truncate(st, job, 0), 0);
    ck_assert_int_eq(store_layer_stats_get(st, job, -1, &rows, &n, &at, NULL), STORE_ENOTFOUND);
    ck_assert_int_eq(raw_int(db, "SELECT COUNT(*) FROM layer_stats WHERE job_id=?1", job), 0);
    ck_assert_int_eq(raw_int(db, "SELECT COUNT(*) FROM layer_steps WHERE job_id=?1", job), 0);
    sqlite3_close(db);
}
END_TEST

/* The reference of the range test: diagnosed steps 5, 10, ..., 2000; layers l0..l3 (l3
 * absent at multiples of 35), "late" from step 1000 on; l1 never reports lost_updates.
 * Special steps: act_overflow at multiples of 65, an infinite grad_amax at multiples of 95,
 * a first non-finite layer at multiples of 145. */
#define RNSTEPS 400
#define RNLAYERS 5
static const char *const rnames[RNLAYERS] = {"l0", "l1", "l2", "l3", "late"};

static bool rpresent(int64_t step, int l)
{
    return l < 3 || (l == 3 && step % 35 != 0) || (l == 4 && step >= 1000);
}

static double rval(int64_t step, int l, int f)
{
    uint64_t h = (uint64_t)step * 1000003u + (uint64_t)l * 101u + (uint64_t)f * 7u;
    if (f == STORE_L_ACT_OVERFLOW)
        return step % 65 == 0 && l == 2 ? 3 : 0;
    if (f == STORE_L_GRAD_NONFINITE)
        return 0;
    if (f == STORE_L_GRAD_AMAX && step % 95 == 0 && l == 0)
        return INFINITY;
    if (f != STORE_L_ACT_AMAX && f != STORE_L_GRAD_AMAX) {
        if (h % 97 == 0)
            return NAN;
        if (h % 89 == 0)
            return INFINITY;
        if (h % 83 == 0)
            return -INFINITY;
    }
    return (double)(h % 10007) / 37.0 - 50.0;
}

static bool rspecial(int64_t step)
{
    return step % 65 == 0 || step % 95 == 0 || step % 145 == 0;
}

static void range_fill(int64_t job)
{
    for (int64_t step = 5; step <= 5 * RNSTEPS; step += 5) {
        store_layer_stat rows[RNLAYERS];
        store_layer_info info;
        int n = 0;
        memset(&info, 0, sizeof(info));
        info.scale = (double)(65536 >> (step % 7));
        if (step % 145 == 0) {
            snprintf(info.first_layer, sizeof(info.first_layer), "l1");
            snprintf(info.first_where, sizeof(info.first_where), "backward");
        }
        for (int l = 0; l < RNLAYERS; l++) {
            double v[NLF];
            if (!rpresent(step, l))
                continue;
            for (int f = 0; f < NLF; f++)
                v[f] = rval(step, l, f);
            rows[n++] = lstat(rnames[l], l == 4 ? "fp32" : "fp16", v,
                              l == 1 ? 1u << STORE_L_LOST_UPDATES : 0);
        }
        ck_assert_int_eq(store_layer_stats_append(st, job, step, &info, rows, n), 0);
    }
    ck_assert_int_eq(store_flush(st), 0);
}

/* Check a range answer against the reference: the steps chosen (every one when they fit;
 * else every special one and evenly spread regular ones; else evenly spread special ones),
 * the layers in order of first appearance, and every cell. */
static void range_check(int64_t job, int64_t from, int64_t to, int max, const int *fields, int nf)
{
    store_layer_range lr;
    int64_t win[RNSTEPS], sp[RNSTEPS], reg[RNSTEPS];
    int nwin = 0, nsp = 0, nreg = 0, order[RNLAYERS], norder = 0;

    ck_assert_int_eq(store_layer_stats_range(st, job, from, to, max, fields, nf, &lr), 0);
    for (int64_t step = 5; step <= 5 * RNSTEPS; step += 5) {
        if (step < from || (to >= 0 && step > to))
            continue;
        win[nwin++] = step;
        if (rspecial(step))
            sp[nsp++] = step;
        else
            reg[nreg++] = step;
    }
    ck_assert_int_eq(lr.total_steps, nwin);
    ck_assert_int_eq(lr.nfields, nf);
    ck_assert_int_le(lr.nsteps, max);
    for (int k = 1; k < lr.nsteps; k++)
        ck_assert_int_gt(lr.steps[k], lr.steps[k - 1]);
    if (nwin <= max) {
        ck_assert_int_eq(lr.nsteps, nwin);
        for (int k = 0; k < nwin; k++)
            ck_assert_int_eq(lr.steps[k], win[k]);
    } else {
        int64_t *pool = nsp >= max ? sp : reg;
        int npool = nsp >= max ? nsp : nreg, picked = 0, prev = -1, gmin = INT32_MAX, gmax = 0;
        ck_assert_int_eq(lr.nsteps, max);
        if (nsp < max) { /* every special step is there */
            for (int i = 0; i < nsp; i++) {
                bool found = false;
                for (int k = 0; k < lr.nsteps && !found; k++)
                    found = lr.steps[k] == sp[i];
                ck_assert_msg(found, "special step %lld dropped", (long long)sp[i]);
            }
        }
        for (int i = 0; i < npool; i++) {
            bool found = false;
            for (int k = 0; k < lr.nsteps && !found; k++)
                found = lr.steps[k] == pool[i];
            if (!found)
                continue;
            if (prev >= 0) {
                gmin = i - prev < gmin ? i - prev : gmin;
                gmax = i - prev > gmax ? i - prev : gmax;
            }
            prev = i;
            picked++;
        }
        ck_assert_int_eq(picked, nsp >= max ? max : max - nsp);
        if (picked == 1 && nsp >= max) /* one of many: the most recent */
            ck_assert_int_eq(lr.steps[0], pool[npool - 1]);
        if (picked > 1) { /* evenly: the first and last, gaps differing by at most one */
            bool first = false, last = false;
            for (int k = 0; k < lr.nsteps; k++) {
                first |= lr.steps[k] == pool[0];
                last |= lr.steps[k] == pool[npool - 1];
            }
            ck_assert(first && last);
            ck_assert_int_le(gmax - gmin, 1);
        }
    }
    /* layers in order of first appearance over the chosen steps */
    for (int k = 0; k < lr.nsteps; k++)
        for (int l = 0; l < RNLAYERS; l++) {
            bool seen = false;
            for (int i = 0; i < norder; i++)
                seen |= order[i] == l;
            if (rpresent(lr.steps[k], l) && !seen)
                order[norder++] = l;
        }
    ck_assert_int_eq(lr.nlayers, norder);
    for (int l = 0; l < lr.nlayers; l++) {
        ck_assert_str_eq(lr.layers[l].name, rnames[order[l]]);
        ck_assert_str_eq(lr.layers[l].dtype, order[l] == 4 ? "fp32" : "fp16");
    }
    for (int k = 0; k < lr.nsteps; k++) {
        int64_t step = lr.steps[k];
        ck_assert(lr.info[k].scale == (double)(65536 >> (step % 7)));
        ck_assert_str_eq(lr.info[k].first_layer, step % 145 == 0 ? "l1" : "");
        ck_assert_int_eq((lr.info[k].flags & STORE_LS_OVERFLOW) != 0, step % 65 == 0);
        ck_assert_int_eq((lr.info[k].flags & STORE_LS_NONFINITE) != 0,
                         step % 95 == 0 || step % 145 == 0);
        for (int l = 0; l < lr.nlayers; l++)
            for (int f = 0; f < nf; f++) {
                size_t at = STORE_LR_AT(&lr, l, f, k);
                int rl = order[l];
                bool want = rpresent(step, rl) && !(rl == 1 && fields[f] == STORE_L_LOST_UPDATES);
                ck_assert_msg(lr.has[at] == want, "step %lld layer %s field %d: has %d",
                              (long long)step, rnames[rl], fields[f], lr.has[at]);
                if (want)
                    ck_assert_msg(same(lr.values[at], rval(step, rl, fields[f])),
                                  "step %lld layer %s field %d: %g", (long long)step, rnames[rl],
                                  fields[f], lr.values[at]);
            }
    }
    store_layer_range_free(&lr);
    ck_assert_ptr_null(lr.steps);
}

START_TEST(test_layer_range)
{
    int64_t job = new_job("lr", "fp16");
    int all[NLF], two[2] = {STORE_L_LOST_UPDATES, STORE_L_GRAD_AMAX}, dup[2] = {1, 1};
    int bad = NLF;
    store_layer_range lr;

    for (int f = 0; f < NLF; f++)
        all[f] = f;
    range_fill(job);
    range_check(job, 0, -1, 1000, all, NLF);   /* everything */
    range_check(job, 0, -1, 100, all, NLF);    /* every special step, regular ones spread */
    range_check(job, 0, -1, 20, two, 2);       /* too many special steps: those spread */
    range_check(job, 300, 1700, 60, two, 2);   /* a window */
    range_check(job, 1000, 1000, 5, all, NLF); /* one step */
    range_check(job, 997, 1003, 5, all, NLF);
    range_check(job, 995, 2000, 1, two, 2);   /* one step out of many: the last special */
    range_check(job, 2001, -1, 10, all, NLF); /* nothing there */
    range_check(job, 50, 10, 10, all, NLF);   /* an empty window */

    ck_assert_int_eq(store_layer_stats_range(st, job, 0, -1, 0, all, 1, &lr), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_range(st, job, 0, -1, 10, all, 0, &lr), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_range(st, job, 0, -1, 10, dup, 2, &lr), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_range(st, job, 0, -1, 10, &bad, 1, &lr), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_range(st, job, 0, -1, 10, NULL, 1, &lr), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_range(NULL, job, 0, -1, 10, all, 1, &lr), STORE_EINVAL);
    ck_assert_int_eq(store_layer_stats_range(st, job, 0, -1, 10, all, 1, NULL), STORE_EINVAL);
}
END_TEST

/* The kinds of job's stream rows after seq `after`, as letters (S step, E eval, L layers,
 * C checkpoint, V event, X end) with their steps: "S1 S2 E2 ...". */
static void stream_text(int64_t job, char *out, size_t len)
{
    static const char letter[] = "SELCVX";
    store_stream_row *rows = NULL;
    int n = 0;
    size_t k = 0;
    out[0] = '\0';
    ck_assert_int_eq(store_stream_read(st, job, 0, 1000, &rows, &n), 0);
    for (int i = 0; i < n && k + 24 < len; i++) {
        ck_assert(i == 0 || rows[i].seq > rows[i - 1].seq);
        ck_assert(rows[i].kind == STORE_SM_EVENT ? rows[i].ref > 0 : rows[i].ref == 0);
        k += (size_t)snprintf(out + k, len - k, "%s%c%lld", i ? " " : "", letter[rows[i].kind],
                              (long long)rows[i].step);
    }
    free(rows);
}

/* The stream: the order the store took the data in, rank 0 only, a checkpoint and the end
 * after everything queued before them; a truncate drops the rewritten steps' rows; older
 * databases get their rows in (step, kind) order. */
START_TEST(test_stream)
{
    int64_t job = new_job("stream", "fp16");
    store_layer_stat l;
    store_metric m;
    char text[512];

    memset(&l, 0, sizeof(l));
    snprintf(l.name, sizeof(l.name), "fc1");
    snprintf(l.dtype, sizeof(l.dtype), "fp16");
    for (int64_t s = 1; s <= 3; s++) {
        gen_metric(&m, job, s, false);
        ck_assert_int_eq(store_metric_append(st, &m), 0);
        m.rank = 1; /* another rank's row is not a message of the job's stream */
        ck_assert_int_eq(store_metric_append(st, &m), 0);
    }
    gen_metric(&m, job, 2, true);
    ck_assert_int_eq(store_metric_eval(st, job, 0, 2, m.v), 0);
    ck_assert_int_eq(store_event_append(st, job, 2, "overflow", "step 2", NULL), 0);
    ck_assert_int_eq(store_layer_stats_append(st, job, 3, NULL, &l, 1), 0);
    ck_assert_int_eq(store_checkpoint_add(st, job, 3, "/tmp/ckpt-3.safetensors", 10), 0);
    stream_text(job, text, sizeof(text));
    ck_assert_str_eq(text, "S1 S2 S3 E2 V2 L3 C3");

    /* a resume from step 2 rewrites steps 3..: their step and layers rows go, the rest stays */
    ck_assert_int_eq(store_metrics_truncate(st, job, 2), 0);
    gen_metric(&m, job, 3, false);
    ck_assert_int_eq(store_metric_append(st, &m), 0);
    ck_assert_int_eq(store_job_set_status(st, job, STORE_RUNNING, NULL), 0);
    ck_assert_int_eq(store_job_set_status(st, job, STORE_SUCCEEDED, NULL), 0);
    stream_text(job, text, sizeof(text));
    ck_assert_str_eq(text, "S1 S2 E2 V2 C3 S3 X3");
    int64_t at;
    ck_assert_int_eq(store_stream_at_step(st, job, 2, &at), 0);
    store_stream_row *rows = NULL;
    int n = 0;
    ck_assert_int_eq(store_stream_read(st, job, 0, 100, &rows, &n), 0);
    ck_assert_int_eq(at, rows[n - 1].seq); /* after the end, later than step 2's row */
    free(rows);

    /* the migration to version 5 fills the stream of older runs in (step, kind) order */
    store_close(st);
    st = NULL;
    sqlite3 *db = raw_open();
    downgrade_fields(db, 4);
    sqlite3_close(db);
    ck_assert_int_eq(store_open(db_path, &st), 0);
    stream_text(job, text, sizeof(text));
    ck_assert_str_eq(text, "S1 S2 E2 V2 S3 C3 X3");

    /* a deleted job's stream goes with it */
    ck_assert_int_eq(store_job_delete(st, job), 0);
    ck_assert_int_eq(store_stream_read(st, job, 0, 10, &rows, &n), 0);
    ck_assert_int_eq(n, 0);
}
END_TEST

/* ---- a store that cannot write ------------------------------------------------------------ */

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* Queue rows for steps [from, to] of job (rank 0). */
static void append_steps(int64_t job, int64_t from, int64_t to)
{
    for (int64_t step = from; step <= to; step++) {
        store_metric m;
        memset(&m, 0, sizeof(m));
        m.job_id = job;
        m.step = step;
        for (int i = 0; i < NF; i++)
            m.v[i] = (double)step;
        ck_assert_int_eq(store_metric_append(st, &m), 0);
    }
}

/* Flush until it succeeds (the writer commits at its next retry), at most timeout_s. */
static void flush_within(double timeout_s)
{
    double t0 = mono_s();
    int rc;
    while ((rc = store_flush(st)) != 0) {
        ck_assert_msg(mono_s() - t0 < timeout_s, "store_flush still fails after %.1f s: %s",
                      mono_s() - t0, store_strerror(rc));
        sleep_s(0.05);
    }
}

/* Wait until the health's code is code, at most timeout_s. */
static void health_within(int code, double timeout_s, store_health *h)
{
    double t0 = mono_s();
    for (;;) {
        store_get_health(st, h);
        if (h->code == code)
            return;
        ck_assert_msg(mono_s() - t0 < timeout_s, "health code %d, expected %d after %.1f s",
                      h->code, code, mono_s() - t0);
        sleep_s(0.02);
    }
}

/* Metric rows of job in the file (a connection of its own), and the distinct steps. */
static void count_rows(int64_t job, int64_t *rows, int64_t *steps)
{
    sqlite3 *db = raw_open();
    *rows = raw_int(db, "SELECT COUNT(*) FROM metrics WHERE job_id=?1", job);
    *steps = raw_int(db, "SELECT COUNT(DISTINCT step) FROM metrics WHERE job_id=?1", job);
    sqlite3_close(db);
}

/* The writer holds what it cannot write (here: every write fails as on a full disk, for
 * longer than the three attempts the writer used to make before it dropped a batch), the
 * flush and the synchronous writes report it, no checkpoint is recorded over the held rows,
 * the health says why; once writes work again every row is there exactly once. */
START_TEST(test_full_disk_holds_rows)
{
    int64_t job = new_job("full", "fp16"), rows, steps;
    store_checkpoint *ck = NULL;
    store_health h;
    store_job j;
    double t0;
    int n = -1;

    store_get_health(st, &h);
    ck_assert_int_eq(h.code, 0);
    ck_assert_ptr_null(h.reason);
    ck_assert_int_eq(store_test_fault(st, STORE_EINVAL), STORE_EINVAL);
    append_steps(job, 1, 100);
    ck_assert_int_eq(store_flush(st), 0);

    ck_assert_int_eq(store_test_fault(st, STORE_EFULL), 0);
    append_steps(job, 101, 300);
    t0 = mono_s();
    ck_assert_int_eq(store_flush(st), STORE_EFULL); /* reported, not waited out */
    ck_assert(mono_s() - t0 < 6.0);
    store_get_health(st, &h);
    ck_assert_int_eq(h.code, STORE_EFULL);
    ck_assert_str_eq(h.reason, "disk_full");
    ck_assert_msg(strstr(h.message, "disk is full") != NULL, "message: %s", h.message);
    ck_assert_int_eq(h.held, 200);
    ck_assert(h.since > 1e9 && h.failures >= 1);

    /* past the three attempts after which the old writer dropped the batch */
    for (t0 = mono_s(); h.failures < 4; store_get_health(st, &h)) {
        ck_assert_msg(mono_s() - t0 < 10, "%lld failed attempts in 10 s", (long long)h.failures);
        sleep_s(0.02);
    }
    t0 = mono_s();
    ck_assert_int_eq(store_flush(st), STORE_EFULL);
    ck_assert(mono_s() - t0 < 0.5); /* already failing: at once */
    store_get_health(st, &h);
    ck_assert_int_eq(h.held, 200);
    ck_assert_int_eq(store_checkpoint_add(st, job, 300, "/d/ckpt-300", 1), STORE_EFULL);
    ck_assert_int_eq(store_job_set_status(st, job, STORE_SUCCEEDED, NULL), STORE_EFULL);
    ck_assert_int_eq(store_job_set_summary(st, job, "{\"status\":\"ok\"}"), STORE_EFULL);
    ck_assert_int_eq(store_checkpoint_list(st, job, &ck, &n), 0);
    ck_assert_int_eq(n, 0);
    free(ck);
    ck_assert_int_eq(store_job_get(st, job, &j), 0);
    ck_assert_int_eq(j.status, STORE_QUEUED);
    ck_assert_ptr_null(j.summary);
    store_job_clear(&j);
    count_rows(job, &rows, &steps);
    ck_assert_int_eq(rows, 100);

    ck_assert_int_eq(store_test_fault(st, 0), 0);
    flush_within(5.0);
    store_get_health(st, &h);
    ck_assert_int_eq(h.code, 0);
    ck_assert_int_eq(h.held, 0);
    count_rows(job, &rows, &steps);
    ck_assert_int_eq(rows, 300);
    ck_assert_int_eq(steps, 300);
    ck_assert_int_eq(store_checkpoint_add(st, job, 300, "/d/ckpt-300", 1), 0);
    ck_assert_int_eq(store_job_set_summary(st, job, "{\"status\":\"ok\"}"), 0);
    ck_assert_int_eq(store_job_set_status(st, job, STORE_SUCCEEDED, NULL), 0);
    ck_assert_int_eq(store_job_get(st, job, &j), 0);
    ck_assert_int_eq(j.status, STORE_SUCCEEDED);
    ck_assert_int_eq(j.step, 300);
    store_job_clear(&j);
}
END_TEST

/* A synchronous write that fails while nothing is queued still shows in the health (the
 * writer probes), and the health clears once a write works again. */
START_TEST(test_failed_write_probed)
{
    int64_t job = new_job("probe", "bf16");
    store_health h;

    ck_assert_int_eq(store_test_fault(st, STORE_EBUSY), 0);
    ck_assert_int_eq(store_job_set_retries(st, job, 1), STORE_EBUSY);
    health_within(STORE_EBUSY, 3.0, &h);
    ck_assert_str_eq(h.reason, "store_locked");
    ck_assert_int_eq(h.held, 0);
    ck_assert_int_eq(store_test_fault(st, 0), 0);
    health_within(0, 5.0, &h);
    ck_assert_int_eq(store_job_set_retries(st, job, 1), 0);
}
END_TEST

/* Another process holds the write lock longer than the busy timeout: the writer holds the
 * rows, says the store is locked, and writes them once the lock is released. */
START_TEST(test_lock_holds_rows)
{
    int64_t job = new_job("locked", "fp32"), rows, steps;
    sqlite3 *db = raw_open();
    store_health h;

    append_steps(job, 1, 10);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(sqlite3_exec(db, "BEGIN EXCLUSIVE", NULL, NULL, NULL), SQLITE_OK);
    append_steps(job, 11, 60);
    health_within(STORE_EBUSY, 12.0, &h); /* the first attempt waits out the busy timeout */
    ck_assert_str_eq(h.reason, "store_locked");
    ck_assert_int_eq(h.held, 50);
    ck_assert_int_eq(store_flush(st), STORE_EBUSY);
    ck_assert_int_eq(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    flush_within(10.0);
    count_rows(job, &rows, &steps);
    ck_assert_int_eq(rows, 60);
    ck_assert_int_eq(steps, 60);
    store_get_health(st, &h);
    ck_assert_int_eq(h.code, 0);
}
END_TEST

/* store_close does not wait for ever on rows it cannot write. */
START_TEST(test_close_bounded)
{
    int64_t job = new_job("close", "fp32");
    double t0;

    ck_assert_int_eq(store_test_fault(st, STORE_EIO), 0);
    append_steps(job, 1, 5);
    ck_assert_int_eq(store_flush(st), STORE_EIO);
    t0 = mono_s();
    store_close(st);
    st = NULL;
    ck_assert(mono_s() - t0 < STORE_CLOSE_WAIT_S + STORE_RETRY_MAX_MS * 1e-3 + 2.0);
}
END_TEST

/* Experiments: a group is inserted whole or not at all, read back with its members in order
 * and their jobs' status, listed newest first with a cursor; deleting a job takes it out of
 * the group, deleting the group leaves its jobs. The eval list and the newest event of a
 * kind that the comparison reads. */
START_TEST(test_experiments)
{
    int64_t a = new_job("a", "fp32"), b = new_job("b", "bf16"), c = new_job("c", "bf16");
    store_member m[3] = {{.job_id = a, .arm = "fp32", .seed = 1},
                         {.job_id = b, .arm = "bf16", .seed = 1},
                         {.job_id = c, .arm = "bf16", .seed = 2}};
    store_experiment e, *v;
    store_eval *ev;
    store_event *last;
    store_metric row;
    int64_t id, id2;
    int n;

    m[1].job_id = a; /* a job twice: refused, nothing inserted */
    ck_assert_int_eq(store_experiment_create(st, "x", "fp32", NULL, m, 2, &id), STORE_ECONFLICT);
    m[1].job_id = 999; /* no such job */
    ck_assert_int_eq(store_experiment_create(st, "x", "fp32", NULL, m, 2, &id), STORE_ENOTFOUND);
    ck_assert_int_eq(store_experiment_list(st, 0, 10, &v, &n), 0);
    ck_assert_int_eq(n, 0);
    store_experiments_free(v, n);
    m[1].job_id = b;
    ck_assert_int_eq(store_experiment_create(st, "", "fp32", NULL, m, 3, &id), STORE_EINVAL);
    ck_assert_int_eq(store_experiment_create(st, "x", "fp32", NULL, m, 0, &id), STORE_EINVAL);

    ck_assert_int_eq(store_experiment_create(st, "prec", "fp32", "{\"k\":1}", m, 3, &id), 0);
    ck_assert_int_eq(store_experiment_create(st, "two", "bf16", NULL, m + 1, 2, &id2), 0);
    ck_assert_int_eq(store_job_set_status(st, b, STORE_RUNNING, NULL), 0);
    ck_assert_int_eq(store_experiment_get(st, id, &e), 0);
    ck_assert_str_eq(e.name, "prec");
    ck_assert_str_eq(e.baseline, "fp32");
    ck_assert_str_eq(e.request, "{\"k\":1}");
    ck_assert_int_eq(e.nmembers, 3);
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(e.members[i].job_id, m[i].job_id);
        ck_assert_str_eq(e.members[i].arm, m[i].arm);
        ck_assert_int_eq(e.members[i].seed, m[i].seed);
    }
    ck_assert_int_eq(e.members[1].status, STORE_RUNNING);
    store_experiment_clear(&e);
    store_experiment_clear(NULL);

    ck_assert_int_eq(store_experiment_list(st, 0, 1, &v, &n), 0);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(v[0].id, id2);
    ck_assert_int_eq(v[0].nmembers, 2);
    store_experiments_free(v, n);
    ck_assert_int_eq(store_experiment_list(st, id2, 10, &v, &n), 0);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(v[0].id, id);
    store_experiments_free(v, n);

    ck_assert_int_eq(store_job_set_status(st, b, STORE_SUCCEEDED, NULL), 0);
    ck_assert_int_eq(store_job_delete(st, b), 0);
    ck_assert_int_eq(store_experiment_get(st, id, &e), 0);
    ck_assert_int_eq(e.nmembers, 2);
    ck_assert_int_eq(e.members[1].job_id, c);
    store_experiment_clear(&e);
    ck_assert_int_eq(store_experiment_delete(st, id2), 0);
    ck_assert_int_eq(store_experiment_get(st, id2, &e), STORE_ENOTFOUND);
    ck_assert_int_eq(store_experiment_delete(st, id2), STORE_ENOTFOUND);
    store_job j;
    ck_assert_int_eq(store_job_get(st, c, &j), 0);
    store_job_clear(&j);

    /* evals: the rows with one, in step order; NaN kept, a missing accuracy missing */
    for (int64_t s = 1; s <= 30; s++) {
        gen_metric(&row, a, s, false);
        ck_assert_int_eq(store_metric_append(st, &row), 0);
    }
    double evv[STORE_M_NFIELDS];
    for (int i = 0; i < STORE_M_NFIELDS; i++)
        evv[i] = store_missing();
    evv[STORE_M_EVAL_LOSS] = 2.5;
    evv[STORE_M_EVAL_ACC] = 0.25;
    ck_assert_int_eq(store_metric_eval(st, a, 0, 10, evv), 0);
    evv[STORE_M_EVAL_LOSS] = NAN;
    evv[STORE_M_EVAL_ACC] = store_missing();
    ck_assert_int_eq(store_metric_eval(st, a, 0, 20, evv), 0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(store_eval_list(st, a, &ev, &n), 0);
    ck_assert_int_eq(n, 2);
    ck_assert(ev[0].step == 10 && ev[0].loss == 2.5 && ev[0].acc == 0.25);
    ck_assert(ev[1].step == 20 && isnan(ev[1].loss) && !store_is_missing(ev[1].loss));
    ck_assert(store_is_missing(ev[1].acc));
    free(ev);

    ck_assert_int_eq(store_event_last(st, a, "data", &last), STORE_ENOTFOUND);
    ck_assert_int_eq(store_event_append(st, a, 0, "data", "first", "{\"x\":1}"), 0);
    ck_assert_int_eq(store_event_append(st, a, 5, "lifecycle", "other", NULL), 0);
    ck_assert_int_eq(store_event_append(st, a, 9, "data", "second", "{\"x\":2}"), 0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(store_event_last(st, a, "data", &last), 0);
    ck_assert_str_eq(last->message, "second");
    ck_assert_str_eq(last->data, "{\"x\":2}");
    ck_assert_int_eq(last->step, 9);
    store_events_free(last, 1);
}
END_TEST

static Suite *store_suite(void)
{
    Suite *s = suite_create("store");
    TCase *tc = tcase_create("core");
    tcase_add_unchecked_fixture(tc, dir_setup, dir_teardown);
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_migrate_and_reopen);
    tcase_add_test(tc, test_newer_schema_refused);
    tcase_add_test(tc, test_open_bad_input);
    tcase_add_test(tc, test_job_list_cursor);
    tcase_add_test(tc, test_job_idempotency);
    tcase_add_test(tc, test_job_state);
    tcase_add_test(tc, test_job_delete_cascade);
    tcase_add_test(tc, test_experiments);
    tcase_add_test(tc, test_metrics_roundtrip);
    tcase_add_test(tc, test_upsert_and_eval);
    tcase_add_test(tc, test_truncate);
    tcase_add_test(tc, test_downsample_bruteforce);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_events_cursor);
    tcase_add_test(tc, test_checkpoints);
    tcase_add_test(tc, test_concurrent_readers);
    tcase_add_test(tc, test_migrate_from_v1);
    tcase_add_test(tc, test_migrate_from_v2);
    tcase_add_test(tc, test_field_columns);
    tcase_add_test(tc, test_layer_roundtrip);
    tcase_add_test(tc, test_layer_truncate);
    tcase_add_test(tc, test_layer_range);
    tcase_add_test(tc, test_stream);
    tcase_add_test(tc, test_full_disk_holds_rows);
    tcase_add_test(tc, test_failed_write_probed);
    tcase_add_test(tc, test_lock_holds_rows);
    tcase_add_test(tc, test_close_bounded);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(store_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
