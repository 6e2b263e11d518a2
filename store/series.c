/*
 * series.c - aggregates of metric rows (min/max/last per field) and the series query:
 * a job's rank-0 metric rows over a step range, raw or downsampled into buckets.
 *
 * Downsampling: with w = ceil((to - from + 1) / points), output bucket k covers
 * [from + k*w, from + (k+1)*w - 1]. Each output bucket is decomposed into the coarsest
 * pieces that tile it exactly: whole rollup buckets of the largest level <= w in the
 * middle, finer levels and finally raw rows at the unaligned edges. So every bucket's
 * min/max/last are exact (equal to a scan of the raw rows), and an output bucket reads at
 * most 2 * 9 rows of each finer level and 2 * 9 raw rows besides its middle, whatever the
 * range. Each source (raw rows, each level) is one ordered cursor that either steps
 * forward or re-seeks, because the pieces arrive in increasing step order. The SELECTs
 * return only the requested fields.
 *
 * Special steps (overflow, skipped, or a NaN/Inf in a requested field) come from the
 * partial index metrics_special and are returned again as their own raw points (count 1),
 * unless their bucket is that single step already. The whole query reads one snapshot
 * (a read transaction), so rollups and raw rows always agree.
 *
 * Threads: runs on the caller's read connection.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "store/store_int.h"

const int64_t store_levels[STORE_NLEVELS] = {10, 100, 1000, 10000};

#define MAX_POINTS 10000000 /* beyond this a raw query is refused: ask for points */
#define SKIP_ROWS 32        /* a cursor steps over gaps up to this many keys, else seeks */

/* ---- aggregates --------------------------------------------------------------------------- */

void store_agg_init(store_agg *a)
{
    a->step_first = a->step_last = a->count = 0;
    a->flags = 0;
    a->nf_mask = 0;
    for (int i = 0; i < STORE_M_NFIELDS; i++)
        a->min[i] = a->max[i] = a->last[i] = store_missing();
}

void store_agg_add(store_agg *a, int64_t step, const double *v, unsigned flags, uint32_t nf)
{
    bool later = a->count == 0 || step > a->step_last;
    bool earlier = a->count == 0 || step < a->step_first;
    for (int i = 0; i < STORE_M_NFIELDS; i++) {
        double x = v[i];
        if (!isnan(x)) {
            if (isnan(a->min[i]) || x < a->min[i])
                a->min[i] = x;
            if (isnan(a->max[i]) || x > a->max[i])
                a->max[i] = x;
        }
        if (later)
            a->last[i] = x;
    }
    if (later)
        a->step_last = step;
    if (earlier)
        a->step_first = step;
    a->count++;
    a->flags |= flags;
    a->nf_mask |= nf;
}

void store_agg_merge(store_agg *a, const store_agg *b)
{
    bool later;
    if (b->count == 0)
        return;
    if (a->count == 0) {
        *a = *b;
        return;
    }
    later = b->step_last > a->step_last;
    for (int i = 0; i < STORE_M_NFIELDS; i++) {
        if (!isnan(b->min[i]) && (isnan(a->min[i]) || b->min[i] < a->min[i]))
            a->min[i] = b->min[i];
        if (!isnan(b->max[i]) && (isnan(a->max[i]) || b->max[i] > a->max[i]))
            a->max[i] = b->max[i];
        if (later)
            a->last[i] = b->last[i];
    }
    if (later)
        a->step_last = b->step_last;
    if (b->step_first < a->step_first)
        a->step_first = b->step_first;
    a->count += b->count;
    a->flags |= b->flags;
    a->nf_mask |= b->nf_mask;
}

/* Column i; NULL is a NaN when nan is set (the row's nf_mask has the field), else missing. */
static double col_double(sqlite3_stmt *st, int i, bool nan)
{
    if (sqlite3_column_type(st, i) != SQLITE_NULL)
        return sqlite3_column_double(st, i);
    return nan ? NAN : store_missing();
}

int64_t store_row_read(sqlite3_stmt *st, uint32_t mask, double *v, unsigned *flags, uint32_t *nf)
{
    int col = STORE_RAW_FIELDS;
    *nf = (uint32_t)sqlite3_column_int64(st, STORE_RAW_NF);
    for (int i = 0; i < STORE_M_NFIELDS; i++)
        v[i] = (mask >> i) & 1u ? col_double(st, col++, (*nf >> i) & 1u) : store_missing();
    *flags =
        (unsigned)sqlite3_column_int(st, STORE_RAW_SPECIAL) & (STORE_F_OVERFLOW | STORE_F_SKIPPED);
    return sqlite3_column_int64(st, STORE_RAW_STEP);
}

/* A bucket's min and max are NULL only when no step in it has a number for the field: they
 * read as missing. Its last is NULL when its last step had none: missing, or a NaN when
 * the bucket holds a NaN or Inf of the field (the NaN step is also a point of its own). */
int64_t store_agg_read(sqlite3_stmt *st, uint32_t mask, store_agg *a)
{
    int col = STORE_RU_FIELDS;
    uint32_t nf = (uint32_t)sqlite3_column_int64(st, STORE_RU_NF);
    store_agg_init(a);
    for (int i = 0; i < STORE_M_NFIELDS; i++)
        if ((mask >> i) & 1u) {
            a->min[i] = col_double(st, col++, false);
            a->max[i] = col_double(st, col++, false);
            a->last[i] = col_double(st, col++, (nf >> i) & 1u);
        }
    a->step_first = sqlite3_column_int64(st, STORE_RU_FIRST);
    a->step_last = sqlite3_column_int64(st, STORE_RU_LAST);
    a->count = sqlite3_column_int64(st, STORE_RU_COUNT);
    a->flags =
        (unsigned)sqlite3_column_int(st, STORE_RU_FLAGS) & (STORE_F_OVERFLOW | STORE_F_SKIPPED);
    a->nf_mask = (uint32_t)sqlite3_column_int64(st, STORE_RU_NF);
    return sqlite3_column_int64(st, STORE_RU_BUCKET);
}

/* ---- output --------------------------------------------------------------------------------- */

typedef struct {
    store_point *pts;
    double *vals; /* 3 * nf per point: min, max, last */
    int n, cap, nf;
    const int *fields;
} builder;

static int b_push(builder *b, const store_agg *a, unsigned flags)
{
    size_t stride = 3 * (size_t)b->nf;
    double *v;
    if (b->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 256;
        store_point *np;
        if (b->n >= MAX_POINTS) {
            log_warn("series of more than %d points refused: ask for fewer (points=N)", MAX_POINTS);
            return STORE_EINVAL;
        }
        np = realloc(b->pts, (size_t)cap * sizeof(*np));
        if (!np)
            return STORE_EIO;
        b->pts = np;
        if (stride) {
            double *nv = realloc(b->vals, (size_t)cap * stride * sizeof(*nv));
            if (!nv)
                return STORE_EIO;
            b->vals = nv;
        }
        b->cap = cap;
    }
    b->pts[b->n] = (store_point){a->step_first, a->step_last, a->count, flags, NULL, NULL, NULL};
    v = stride ? b->vals + (size_t)b->n * stride : NULL;
    for (int j = 0; j < b->nf; j++) {
        v[j] = a->min[b->fields[j]];
        v[b->nf + j] = a->max[b->fields[j]];
        v[2 * b->nf + j] = a->last[b->fields[j]];
    }
    b->n++;
    return 0;
}

static void b_free(builder *b)
{
    free(b->pts);
    free(b->vals);
    b->pts = NULL;
    b->vals = NULL;
    b->n = b->cap = 0;
}

/* Hand b's storage to out and point every point at its values. */
static void b_finish(builder *b, store_series *out)
{
    size_t stride = 3 * (size_t)b->nf;
    for (int i = 0; i < b->n && stride; i++) {
        double *v = b->vals + (size_t)i * stride;
        b->pts[i].min = v;
        b->pts[i].max = v + b->nf;
        b->pts[i].last = v + 2 * b->nf;
    }
    out->points = b->pts;
    out->values = b->vals;
    out->npoints = b->n;
    b->pts = NULL;
    b->vals = NULL;
    b->n = b->cap = 0;
}

/* ---- cursors -------------------------------------------------------------------------------- */

typedef struct {
    sqlite3_stmt *st;
    int li;       /* -1: raw rows; else the rollup level index */
    bool active;  /* seeked at least once */
    bool has_row; /* st is on a row (key); false after active: exhausted */
    int64_t key;  /* step (raw) or bucket (rollup) of the current row */
    int64_t end;  /* the last key any piece can ask for */
} cursor;

typedef struct {
    store_conn *c;
    int64_t job;
    uint32_t mask;
    cursor raw, lv[STORE_NLEVELS];
    int err;
} query;

static void cursor_step(query *q, cursor *cu)
{
    int rc = sqlite3_step(cu->st);
    if (rc == SQLITE_ROW) {
        cu->has_row = true;
        cu->key = sqlite3_column_int64(cu->st, cu->li < 0 ? STORE_RAW_STEP : STORE_RU_BUCKET);
    } else {
        cu->has_row = false;
        if (rc != SQLITE_DONE && !q->err)
            q->err = store_sql_error(q->c->db, cu->st, rc, "store_series_query");
    }
}

static void cursor_seek(query *q, cursor *cu, int64_t lo)
{
    sqlite3_reset(cu->st);
    sqlite3_bind_int64(cu->st, 1, q->job);
    sqlite3_bind_int(cu->st, 2, 0);
    if (cu->li < 0) {
        sqlite3_bind_int64(cu->st, 3, lo);
        sqlite3_bind_int64(cu->st, 4, cu->end);
    } else {
        sqlite3_bind_int64(cu->st, 3, store_levels[cu->li]);
        sqlite3_bind_int64(cu->st, 4, lo);
        sqlite3_bind_int64(cu->st, 5, cu->end);
    }
    cu->active = true;
    cursor_step(q, cu);
}

/* Fold the rows of cu with keys in [lo, hi] into a. Calls on one cursor ask for
 * increasing, disjoint key ranges. */
static void cursor_fold(query *q, cursor *cu, int64_t lo, int64_t hi, store_agg *a)
{
    if (lo > hi || q->err || (cu->active && !cu->has_row))
        return;
    if (!cu->active || (cu->key < lo && lo - cu->key > SKIP_ROWS))
        cursor_seek(q, cu, lo);
    else
        while (cu->has_row && cu->key < lo)
            cursor_step(q, cu);
    while (cu->has_row && cu->key <= hi) {
        if (cu->li < 0) {
            double v[STORE_M_NFIELDS];
            unsigned flags;
            uint32_t nf;
            int64_t step = store_row_read(cu->st, q->mask, v, &flags, &nf);
            store_agg_add(a, step, v, flags, nf);
        } else {
            store_agg b;
            store_agg_read(cu->st, q->mask, &b);
            store_agg_merge(a, &b);
        }
        cursor_step(q, cu);
    }
}

/* Fold the steps [a, e] into agg: whole buckets of level li in the middle, the edges with
 * the finer levels (li - 1 ... 0) and raw rows. */
static void fold_span(query *q, int li, int64_t a, int64_t e, store_agg *agg)
{
    int64_t L, b1, b2;
    if (a > e)
        return;
    if (li < 0) {
        cursor_fold(q, &q->raw, a, e, agg);
        return;
    }
    L = store_levels[li];
    b1 = (a + L - 1) / L;
    b2 = (e + 1) / L - 1;
    if (b1 > b2) {
        fold_span(q, li - 1, a, e, agg);
        return;
    }
    fold_span(q, li - 1, a, b1 * L - 1, agg);
    cursor_fold(q, &q->lv[li], b1, b2, agg);
    fold_span(q, li - 1, (b2 + 1) * L, e, agg);
}

static unsigned point_flags(unsigned flags, uint32_t nf, uint32_t mask)
{
    return (flags & (STORE_F_OVERFLOW | STORE_F_SKIPPED)) | ((nf & mask) ? STORE_F_NONFINITE : 0);
}

/* Every row of [from, to] (one statement), as raw points into b, or only the special ones
 * (overflow, skipped, non-finite in a requested field) when special. */
static int scan_rows(query *q, int64_t from, int64_t to, bool special, builder *b)
{
    sqlite3_stmt *st = store_stmt_fields(q->c, special ? STORE_Q_SPECIAL : STORE_Q_RAW, 0, q->mask);
    int rc;
    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, q->job);
    sqlite3_bind_int(st, 2, 0);
    sqlite3_bind_int64(st, 3, from);
    sqlite3_bind_int64(st, 4, to);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        double v[STORE_M_NFIELDS];
        unsigned flags;
        uint32_t nf;
        store_agg a;
        int64_t step = store_row_read(st, q->mask, v, &flags, &nf);
        if (special && !flags && !(nf & q->mask))
            continue;
        store_agg_init(&a);
        store_agg_add(&a, step, v, flags, nf);
        if ((rc = b_push(b, &a, point_flags(flags, nf, q->mask))) != 0) {
            store_stmt_done(st);
            return rc;
        }
    }
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(q->c->db, st, rc, __func__);
    store_stmt_done(st);
    return rc;
}

/* Buckets of width w over [from, to] into b; *total gets the rows they cover. */
static int scan_buckets(query *q, int64_t from, int64_t to, int64_t w, builder *b, int64_t *total)
{
    int li = -1, rc = 0;
    *total = 0;
    while (li + 1 < STORE_NLEVELS && store_levels[li + 1] <= w)
        li++;
    q->raw = (cursor){.st = store_stmt_fields(q->c, STORE_Q_RAW, 0, q->mask), .li = -1, .end = to};
    if (!q->raw.st)
        return STORE_EIO;
    for (int i = 0; i <= li; i++) {
        q->lv[i] = (cursor){.st = store_stmt_fields(q->c, STORE_Q_ROLLUP, i, q->mask),
                            .li = i,
                            .end = to / store_levels[i]};
        if (!q->lv[i].st)
            return STORE_EIO;
    }
    for (int64_t a = from; a <= to && !rc; a += w) {
        int64_t e = to - a < w ? to : a + w - 1;
        store_agg agg;
        store_agg_init(&agg);
        fold_span(q, li, a, e, &agg);
        if (q->err)
            rc = q->err;
        else if (agg.count > 0) {
            *total += agg.count;
            rc = b_push(b, &agg, point_flags(agg.flags, agg.nf_mask, q->mask));
        }
        if (to - a < w)
            break;
    }
    store_stmt_done(q->raw.st);
    for (int i = 0; i <= li; i++)
        store_stmt_done(q->lv[i].st);
    return rc;
}

/* Merge buckets and special points by step_first into out (buckets first on ties); a
 * special step whose bucket is that one step alone is not repeated. */
static int merge_points(builder *bk, builder *sp, builder *out)
{
    int i = 0, j = 0, rc = 0;
    size_t stride = 3 * (size_t)out->nf;
    while (!rc && (i < bk->n || j < sp->n)) {
        builder *from;
        int k;
        store_agg a;
        if (j >= sp->n || (i < bk->n && bk->pts[i].step_first <= sp->pts[j].step_first)) {
            from = bk;
            k = i++;
        } else {
            from = sp;
            k = j++;
            if (out->n > 0 && out->pts[out->n - 1].count == 1 &&
                out->pts[out->n - 1].step_first == from->pts[k].step_first)
                continue;
        }
        /* b_push copies from an aggregate; rebuild one from the point's values. */
        store_agg_init(&a);
        a.step_first = from->pts[k].step_first;
        a.step_last = from->pts[k].step_last;
        a.count = from->pts[k].count;
        for (int f = 0; f < out->nf; f++) {
            const double *v = from->vals + (size_t)k * stride;
            a.min[out->fields[f]] = v[f];
            a.max[out->fields[f]] = v[out->nf + f];
            a.last[out->fields[f]] = v[2 * out->nf + f];
        }
        rc = b_push(out, &a, from->pts[k].flags);
    }
    return rc;
}

int store_series_query(store *s, int64_t job, const int *fields, int nfields, int64_t from,
                       int64_t to, int points, store_series *out)
{
    query q;
    builder bk = {0}, sp = {0}, all = {0};
    sqlite3_stmt *st;
    int rc;

    if (!out)
        return STORE_EINVAL;
    memset(out, 0, sizeof(*out));
    if (!s || nfields < 0 || nfields > STORE_M_NFIELDS || (nfields > 0 && !fields))
        return STORE_EINVAL;
    memset(&q, 0, sizeof(q));
    for (int i = 0; i < nfields; i++) {
        if (fields[i] < 0 || fields[i] >= STORE_M_NFIELDS)
            return STORE_EINVAL;
        out->fields[i] = fields[i];
        q.mask |= 1u << fields[i];
    }
    out->nfields = nfields;
    bk.nf = sp.nf = all.nf = nfields;
    bk.fields = sp.fields = all.fields = out->fields;
    q.job = job;
    if (!(q.c = store_reader(s)))
        return STORE_EIO;
    if ((rc = store_exec_stmt(q.c, ST_BEGIN)) != 0)
        return rc;

    if (from < 0)
        from = 0;
    if (to < 0) {
        if (!(st = store_stmt(q.c, ST_METRIC_MAX_STEP))) {
            rc = STORE_EIO;
            goto out;
        }
        sqlite3_bind_int64(st, 1, job);
        sqlite3_bind_int(st, 2, 0);
        rc = sqlite3_step(st);
        if (rc == SQLITE_ROW) {
            to = sqlite3_column_type(st, 0) == SQLITE_NULL ? -1 : sqlite3_column_int64(st, 0);
            rc = 0;
        } else {
            rc = store_sql_error(q.c->db, st, rc, __func__);
        }
        store_stmt_done(st);
        if (rc)
            goto out;
    }
    if (to > INT64_MAX / 4)
        to = INT64_MAX / 4;
    if (to < from)
        goto out; /* empty */
    if (points <= 0) {
        if ((rc = scan_rows(&q, from, to, false, &all)) == 0)
            out->total_steps = all.n;
    } else {
        int64_t range = to - from + 1;
        int64_t w = (range + points - 1) / points;
        if ((rc = scan_buckets(&q, from, to, w, &bk, &out->total_steps)) != 0)
            goto out;
        if ((rc = scan_rows(&q, from, to, true, &sp)) != 0)
            goto out;
        rc = merge_points(&bk, &sp, &all);
    }
out:
    if (store_exec_stmt(q.c, ST_COMMIT) != 0)
        store_exec_stmt(q.c, ST_ROLLBACK);
    b_free(&bk);
    b_free(&sp);
    if (rc) {
        b_free(&all);
        memset(out, 0, sizeof(*out));
        return rc;
    }
    b_finish(&all, out);
    return 0;
}

void store_series_free(store_series *se)
{
    if (!se)
        return;
    free(se->points);
    free(se->values);
    se->points = NULL;
    se->values = NULL;
    se->npoints = 0;
}
