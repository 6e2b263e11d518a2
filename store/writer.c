/*
 * writer.c - the store's one writer thread: a bounded queue of metric rows, eval results,
 * per-layer diagnostics and events, committed in batched transactions, with the metric
 * rollups maintained as rows arrive; the synchronous truncate; periodic WAL checkpoints.
 * A diagnosed step's layer rows travel as one queue item (one heap block).
 *
 * Queue: a FIFO of fixed-size chunks holding at most STORE_QUEUE_MAX items; an appender
 * blocks while it is full (nothing is ever dropped to make room). The writer takes everything
 * queued, up to W_BATCH items, per transaction (after lingering W_LINGER_MS for more when
 * the queue is short and nobody is flushing). `processed` counts the items handled, so
 * store_flush waits for processed >= the `enqueued` it saw.
 *
 * Rollups (metrics_rollup): for each (job, rank) and level the writer keeps the bucket
 * being filled in memory, loaded from the table when rows move into another bucket, and
 * upserts the changed buckets at the end of every batch. Invariant, after each commit:
 * every rollup row equals the aggregate of the metric rows under it. A row whose step is
 * beyond its bucket's last step is folded in; any other row (a rewrite, an out-of-order
 * step, an eval result for an existing row) marks its buckets dirty, and dirty buckets are
 * rebuilt in the same transaction, finest level first (level 0 from the raw rows, each
 * coarser level from the ten buckets below it).
 *
 * Eval results for a step row not yet written wait in a small pending table and are
 * merged into the row when it arrives.
 *
 * Errors: a row for a job that no longer exists fails its foreign key and is dropped with
 * a warning. Any other failure (a full disk, another process's lock, an I/O error) rolls
 * the batch back, forgets the in-memory buckets and retries the same batch, after 100 ms
 * doubling to STORE_RETRY_MAX_MS, for as long as it takes: the batch is held, the queue
 * behind it grows (appenders block only at STORE_QUEUE_MAX; the host pauses its producers
 * long before, store.h), store_flush reports the failure instead of waiting, and
 * store_get_health says why. A synchronous write that fails the same way asks for a probe:
 * the writer then commits a one-page write (store_probe_write) until one succeeds, so that
 * the health follows the disk even when nothing is queued. Nothing is dropped except by
 * store_close: what it cannot commit within STORE_CLOSE_WAIT_S is logged as lost.
 *
 * Threads: appenders and flushers take `mu`; the writer thread takes `mu` for the queue
 * and the store's wlock for each batch; the rollup state is only touched under wlock.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/store_int.h"

#define W_CAP STORE_QUEUE_MAX     /* queued items before appenders block */
#define W_BATCH 10000             /* items per transaction at most */
#define W_CHUNK 2048              /* items per queue chunk */
#define W_LINGER_MS 10            /* wait this long for a short queue to fill */
#define W_CKPT_S 10.0             /* wal_checkpoint(TRUNCATE) at most this often... */
#define W_CKPT_BYTES (64LL << 20) /* ...or when the WAL file grows past this */
#define W_MAX_SERIES 64           /* (job, rank) pairs whose open buckets stay in memory */
#define W_MAX_PENDING 256         /* eval results waiting for their step row */
#define W_MAX_JOBSTEPS 64
#define W_RETRY_MIN_MS 100
#define W_REMIND_S 60.0 /* a failure that lasts is logged again this often */

enum { W_METRIC, W_EVAL, W_EVENT, W_LAYERS };

/* A diagnosed step's layer rows (heap, one block, freed after the batch). */
typedef struct {
    store_layer_info info;
    int n;
    store_layer_stat rows[];
} wlayers;

typedef struct {
    int kind;
    int rank;
    int64_t job, step;
    union {
        struct {
            double v[STORE_M_NFIELDS]; /* W_EVAL: only the EVAL fields are read */
            bool has_eval;
        } m;
        struct {
            double ts;
            char kind[32];
            char *message, *data; /* heap, freed after the batch */
        } ev;
        wlayers *layers; /* heap, freed after the batch */
    } u;
} witem;

typedef struct wchunk {
    struct wchunk *next;
    int head, tail;
    witem it[W_CHUNK];
} wchunk;

typedef struct {
    bool open;     /* agg holds bucket `bucket` (as in the table plus this batch's rows) */
    bool modified; /* agg changed since it was last written */
    int64_t bucket;
    store_agg agg;
} wbucket;

typedef struct {
    int64_t job;
    int rank;
    uint64_t used;
    bool hi_known;
    int64_t hi; /* the highest step with a row in the table (-1: none) */
    wbucket lv[STORE_NLEVELS];
} wseries;

typedef struct {
    int64_t job;
    int rank;
    int64_t step;
    double v[STORE_M_NFIELDS]; /* the EVAL fields */
    bool taken; /* merged into a row of the batch in progress */
} wpending;

typedef struct {
    int64_t job;
    int rank;
    int li;
    int64_t bucket;
} wdirty;

struct store_writer {
    store *s;
    pthread_t thread;
    bool started;
    char *wal_path;

    /* the queue, under mu */
    pthread_mutex_t mu;
    pthread_cond_t nonempty, notfull, done;
    wchunk *head, *tail, *spare;
    int nspare;
    int64_t count;
    uint64_t enqueued, processed;
    int flushers;
    bool stop;
    double stop_at; /* when stop was set (monotonic) */
    pthread_cond_t wake; /* a writer waiting to retry: a fault was cleared, or stop */
    /* health, under mu: the writer's last attempt failed with fail_code (0: it wrote) */
    int fail_code;
    double fail_since, fail_mono, fail_logged; /* unix, monotonic, last log (monotonic) */
    uint64_t fail_gen;                         /* failed attempts, for store_flush */
    int64_t failures, attempts;                /* since open; since the last commit */
    char fail_msg[256];
    bool probe;    /* a synchronous write failed: try a write of the writer's own */
    bool gave_up;  /* closing, and the failure outlasted STORE_CLOSE_WAIT_S */

    /* the writer thread's */
    witem *batch;
    double last_ckpt;
    int64_t commits_since_ckpt;

    /* rollup state and batch bookkeeping, under s->wlock */
    wseries series[W_MAX_SERIES];
    int nseries;
    uint64_t tick;
    wpending pending[W_MAX_PENDING];
    int npending;
    wdirty *dirty;
    int ndirty, capdirty;
    struct {
        int64_t job, step;
    } jobsteps[W_MAX_JOBSTEPS];
    int njobsteps;
    int64_t dropped, dropped_job;
};

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static struct timespec mono_at(double t)
{
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* ---- the queue ------------------------------------------------------------------------------ */

static int q_push(store_writer *w, const witem *it)
{
    pthread_mutex_lock(&w->mu);
    while (w->count >= W_CAP && !w->stop)
        pthread_cond_wait(&w->notfull, &w->mu);
    if (w->stop) {
        pthread_mutex_unlock(&w->mu);
        log_error("store is closing: item not queued");
        return STORE_EIO;
    }
    if (!w->tail || w->tail->tail == W_CHUNK) {
        wchunk *c = w->spare;
        if (c) {
            w->spare = c->next;
            w->nspare--;
        } else if (!(c = malloc(sizeof(*c)))) {
            pthread_mutex_unlock(&w->mu);
            log_error("out of memory queueing a store item");
            return STORE_EIO;
        }
        c->next = NULL;
        c->head = c->tail = 0;
        if (w->tail)
            w->tail->next = c;
        else
            w->head = c;
        w->tail = c;
    }
    w->tail->it[w->tail->tail++] = *it;
    w->count++;
    w->enqueued++;
    pthread_cond_signal(&w->nonempty);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

static void chunk_recycle(store_writer *w, wchunk *c)
{
    if (w->nspare < 4) {
        c->next = w->spare;
        w->spare = c;
        w->nspare++;
    } else {
        free(c);
    }
}

/* Move up to max items, oldest first, to out (mu held). */
static int q_pop(store_writer *w, witem *out, int max)
{
    int n = 0;
    while (n < max && w->head) {
        wchunk *c = w->head;
        int k = c->tail - c->head;
        if (k > max - n)
            k = max - n;
        memcpy(out + n, c->it + c->head, (size_t)k * sizeof(witem));
        c->head += k;
        n += k;
        if (c->head < c->tail)
            break;
        if (c == w->tail) {
            c->head = c->tail = 0;
            break;
        }
        w->head = c->next;
        chunk_recycle(w, c);
    }
    w->count -= n;
    return n;
}

int64_t store_writer_depth(store *s)
{
    int64_t n;
    if (!s || !s->wr)
        return 0;
    pthread_mutex_lock(&s->wr->mu);
    n = s->wr->count;
    pthread_mutex_unlock(&s->wr->mu);
    return n;
}

/* ---- rollup state ------------------------------------------------------------------------- */

static int level_index(int64_t level)
{
    for (int i = 0; i < STORE_NLEVELS; i++)
        if (store_levels[i] == level)
            return i;
    return -1;
}

static void bind_real(sqlite3_stmt *st, int i, double v)
{
    if (isnan(v))
        sqlite3_bind_null(st, i);
    else
        sqlite3_bind_double(st, i, v);
}

/* Write bucket (job, rank, li, bucket) = a, or delete it when a is empty. */
static int rollup_write(store *s, int64_t job, int rank, int li, int64_t bucket, const store_agg *a)
{
    sqlite3_stmt *st = store_stmt(s->w, a->count > 0 ? ST_ROLLUP_UPSERT : ST_ROLLUP_DELETE);
    int rc;
    if (!st)
        return STORE_EIO;
    if (a->count > 0) {
        for (int i = 0; i < STORE_M_NFIELDS; i++) {
            bind_real(st, 3 * i + 1, a->min[i]);
            bind_real(st, 3 * i + 2, a->max[i]);
            bind_real(st, 3 * i + 3, a->last[i]);
        }
        sqlite3_bind_int64(st, STORE_RUP_JOB, job);
        sqlite3_bind_int(st, STORE_RUP_RANK, rank);
        sqlite3_bind_int64(st, STORE_RUP_LEVEL, store_levels[li]);
        sqlite3_bind_int64(st, STORE_RUP_BUCKET, bucket);
        sqlite3_bind_int64(st, STORE_RUP_FIRST, a->step_first);
        sqlite3_bind_int64(st, STORE_RUP_LAST, a->step_last);
        sqlite3_bind_int64(st, STORE_RUP_COUNT, a->count);
        sqlite3_bind_int(st, STORE_RUP_FLAGS,
                         (int)(a->flags | (a->nf_mask ? STORE_SPECIAL_NF : 0)));
        sqlite3_bind_int64(st, STORE_RUP_NF, a->nf_mask);
    } else {
        sqlite3_bind_int64(st, 1, job);
        sqlite3_bind_int(st, 2, rank);
        sqlite3_bind_int64(st, 3, store_levels[li]);
        sqlite3_bind_int64(st, 4, bucket);
    }
    rc = sqlite3_step(st);
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(s->w->db, st, rc, __func__);
    store_stmt_done(st);
    return rc;
}

int store_rollup_rebuild(store *s, int64_t job, int rank, int li, int64_t bucket)
{
    int64_t L = store_levels[li];
    sqlite3_stmt *st;
    store_agg a;
    int rc;

    store_agg_init(&a);
    if (li == 0) {
        if (!(st = store_stmt(s->w, ST_RAW_RANGE)))
            return STORE_EIO;
        sqlite3_bind_int64(st, 1, job);
        sqlite3_bind_int(st, 2, rank);
        sqlite3_bind_int64(st, 3, bucket * L);
        sqlite3_bind_int64(st, 4, bucket * L + L - 1);
        while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
            double v[STORE_M_NFIELDS];
            unsigned flags;
            uint32_t nf;
            int64_t step = store_row_read(st, STORE_ALL_FIELDS, v, &flags, &nf);
            store_agg_add(&a, step, v, flags, nf);
        }
    } else {
        int64_t ratio = L / store_levels[li - 1];
        if (!(st = store_stmt(s->w, ST_ROLLUP_RANGE)))
            return STORE_EIO;
        sqlite3_bind_int64(st, 1, job);
        sqlite3_bind_int(st, 2, rank);
        sqlite3_bind_int64(st, 3, store_levels[li - 1]);
        sqlite3_bind_int64(st, 4, bucket * ratio);
        sqlite3_bind_int64(st, 5, bucket * ratio + ratio - 1);
        while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
            store_agg b;
            store_agg_read(st, STORE_ALL_FIELDS, &b);
            store_agg_merge(&a, &b);
        }
    }
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(s->w->db, st, rc, __func__);
    store_stmt_done(st);
    if (rc)
        return rc;
    return rollup_write(s, job, rank, li, bucket, &a);
}

/* Make bk hold bucket b of level li: write back what it held, load b from the table
 * (known_empty: b is past every row, so it has no row to load). */
static int bucket_load(store_writer *w, wseries *se, int li, int64_t b, bool known_empty)
{
    wbucket *bk = &se->lv[li];
    sqlite3_stmt *st;
    int rc;

    if (bk->open && bk->modified) {
        if ((rc = rollup_write(w->s, se->job, se->rank, li, bk->bucket, &bk->agg)) != 0)
            return rc;
    }
    bk->open = false;
    bk->modified = false;
    if (known_empty) {
        store_agg_init(&bk->agg);
        bk->open = true;
        bk->bucket = b;
        return 0;
    }
    if (!(st = store_stmt(w->s->w, ST_ROLLUP_GET)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, se->job);
    sqlite3_bind_int(st, 2, se->rank);
    sqlite3_bind_int64(st, 3, store_levels[li]);
    sqlite3_bind_int64(st, 4, b);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        store_agg_read(st, STORE_ALL_FIELDS, &bk->agg);
        rc = 0;
    } else if (rc == SQLITE_DONE) {
        store_agg_init(&bk->agg);
        rc = 0;
    } else {
        rc = store_sql_error(w->s->w->db, st, rc, __func__);
    }
    store_stmt_done(st);
    if (rc == 0) {
        bk->open = true;
        bk->bucket = b;
    }
    return rc;
}

/* Write back every changed open bucket of se. */
static int series_write(store_writer *w, wseries *se)
{
    for (int li = 0; li < STORE_NLEVELS; li++) {
        wbucket *bk = &se->lv[li];
        if (bk->open && bk->modified) {
            int rc = rollup_write(w->s, se->job, se->rank, li, bk->bucket, &bk->agg);
            if (rc)
                return rc;
            bk->modified = false;
        }
    }
    return 0;
}

static int series_get(store_writer *w, int64_t job, int rank, wseries **out)
{
    int victim = 0;
    for (int i = 0; i < w->nseries; i++)
        if (w->series[i].job == job && w->series[i].rank == rank) {
            w->series[i].used = ++w->tick;
            *out = &w->series[i];
            return 0;
        }
    if (w->nseries < W_MAX_SERIES) {
        victim = w->nseries++;
    } else {
        for (int i = 1; i < w->nseries; i++)
            if (w->series[i].used < w->series[victim].used)
                victim = i;
        int rc = series_write(w, &w->series[victim]);
        if (rc)
            return rc;
    }
    memset(&w->series[victim], 0, sizeof(w->series[victim]));
    w->series[victim].job = job;
    w->series[victim].rank = rank;
    w->series[victim].used = ++w->tick;
    *out = &w->series[victim];
    return 0;
}

static int dirty_add(store_writer *w, int64_t job, int rank, int li, int64_t bucket)
{
    if (w->ndirty == w->capdirty) {
        int cap = w->capdirty ? 2 * w->capdirty : 64;
        wdirty *nd = realloc(w->dirty, (size_t)cap * sizeof(*nd));
        if (!nd)
            return STORE_EIO;
        w->dirty = nd;
        w->capdirty = cap;
    }
    w->dirty[w->ndirty++] = (wdirty){job, rank, li, bucket};
    return 0;
}

static int dirty_cmp(const void *pa, const void *pb)
{
    const wdirty *a = pa, *b = pb;
    if (a->li != b->li)
        return a->li < b->li ? -1 : 1;
    if (a->job != b->job)
        return a->job < b->job ? -1 : 1;
    if (a->rank != b->rank)
        return a->rank < b->rank ? -1 : 1;
    if (a->bucket != b->bucket)
        return a->bucket < b->bucket ? -1 : 1;
    return 0;
}

/* Rebuild the dirty buckets, finest level first, and drop them from memory so that the
 * next row reloads what was rebuilt. Open buckets were written back before. */
static int dirty_rebuild(store_writer *w)
{
    if (w->ndirty == 0)
        return 0;
    qsort(w->dirty, (size_t)w->ndirty, sizeof(*w->dirty), dirty_cmp);
    for (int i = 0; i < w->ndirty; i++) {
        const wdirty *d = &w->dirty[i];
        int rc;
        if (i > 0 && dirty_cmp(d, &w->dirty[i - 1]) == 0)
            continue;
        if ((rc = store_rollup_rebuild(w->s, d->job, d->rank, d->li, d->bucket)) != 0)
            return rc;
        for (int k = 0; k < w->nseries; k++) {
            wbucket *bk = &w->series[k].lv[d->li];
            if (w->series[k].job == d->job && w->series[k].rank == d->rank && bk->open &&
                bk->bucket == d->bucket)
                bk->open = bk->modified = false;
        }
    }
    w->ndirty = 0;
    return 0;
}

/* The highest step of (job, rank) in the table, the row just written included. */
static int series_hi(store_writer *w, wseries *se)
{
    sqlite3_stmt *st = store_stmt(w->s->w, ST_METRIC_MAX_STEP);
    int rc;
    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, se->job);
    sqlite3_bind_int(st, 2, se->rank);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        se->hi = sqlite3_column_type(st, 0) == SQLITE_NULL ? -1 : sqlite3_column_int64(st, 0);
        se->hi_known = true;
        rc = 0;
    } else {
        rc = store_sql_error(w->s->w->db, st, rc, __func__);
    }
    store_stmt_done(st);
    return rc;
}

/* Fold a freshly written row into the buckets of its (job, rank). */
static int rollup_add(store_writer *w, int64_t job, int rank, int64_t step, const double *v,
                      unsigned flags, uint32_t nf)
{
    wseries *se;
    int64_t hi; /* the highest step in the table before this row */
    int rc = series_get(w, job, rank, &se);
    if (rc)
        return rc;
    if (!se->hi_known && (rc = series_hi(w, se)) != 0)
        return rc;
    hi = se->hi;
    if (step > se->hi)
        se->hi = step;
    for (int li = 0; li < STORE_NLEVELS; li++) {
        int64_t b = step / store_levels[li];
        wbucket *bk = &se->lv[li];
        if ((!bk->open || bk->bucket != b) &&
            (rc = bucket_load(w, se, li, b, b * store_levels[li] > hi)) != 0)
            return rc;
        if (bk->agg.count == 0 || step > bk->agg.step_last) {
            store_agg_add(&bk->agg, step, v, flags, nf);
            bk->modified = true;
        } else if ((rc = dirty_add(w, job, rank, li, b)) != 0) {
            return rc;
        }
    }
    return 0;
}

/* ---- pending evals ------------------------------------------------------------------------ */

static wpending *pending_find(store_writer *w, int64_t job, int rank, int64_t step)
{
    for (int i = 0; i < w->npending; i++) {
        wpending *p = &w->pending[i];
        if (!p->taken && p->job == job && p->rank == rank && p->step == step)
            return p;
    }
    return NULL;
}

static void pending_remove(store_writer *w, int i)
{
    memmove(&w->pending[i], &w->pending[i + 1], (size_t)(w->npending - i - 1) * sizeof(wpending));
    w->npending--;
}

static void pending_add(store_writer *w, int64_t job, int rank, int64_t step, const double *v)
{
    wpending *p = pending_find(w, job, rank, step);
    if (!p) {
        if (w->npending == W_MAX_PENDING) {
            log_warn("eval result of job %lld step %lld dropped: its step row never came",
                     (long long)w->pending[0].job, (long long)w->pending[0].step);
            pending_remove(w, 0);
        }
        p = &w->pending[w->npending++];
    }
    p->job = job;
    p->rank = rank;
    p->step = step;
    memcpy(p->v, v, sizeof(p->v));
    p->taken = false;
}

/* After a commit: the merged ones are done. */
static void pending_commit(store_writer *w)
{
    for (int i = w->npending - 1; i >= 0; i--)
        if (w->pending[i].taken)
            pending_remove(w, i);
}

static void pending_rollback(store_writer *w)
{
    for (int i = 0; i < w->npending; i++)
        w->pending[i].taken = false;
}

void store_writer_forget(store *s, int64_t job, int64_t after_step)
{
    store_writer *w = s->wr;
    if (!w)
        return;
    for (int i = w->nseries - 1; i >= 0; i--)
        if (w->series[i].job == job) {
            w->series[i] = w->series[w->nseries - 1];
            w->nseries--;
        }
    for (int i = w->npending - 1; i >= 0; i--)
        if (w->pending[i].job == job && w->pending[i].step > after_step)
            pending_remove(w, i);
}

/* ---- applying a batch --------------------------------------------------------------------- */

static int jobsteps_write(store_writer *w)
{
    for (int i = 0; i < w->njobsteps; i++) {
        sqlite3_stmt *st = store_stmt(w->s->w, ST_JOB_STEP_MAX);
        int rc;
        if (!st)
            return STORE_EIO;
        sqlite3_bind_int64(st, 1, w->jobsteps[i].job);
        sqlite3_bind_int64(st, 2, w->jobsteps[i].step);
        rc = sqlite3_step(st);
        rc = rc == SQLITE_DONE ? 0 : store_sql_error(w->s->w->db, st, rc, __func__);
        store_stmt_done(st);
        if (rc)
            return rc;
    }
    w->njobsteps = 0;
    return 0;
}

static int jobstep_note(store_writer *w, int64_t job, int64_t step)
{
    int rc;
    for (int i = 0; i < w->njobsteps; i++)
        if (w->jobsteps[i].job == job) {
            if (step > w->jobsteps[i].step)
                w->jobsteps[i].step = step;
            return 0;
        }
    if (w->njobsteps == W_MAX_JOBSTEPS && (rc = jobsteps_write(w)) != 0)
        return rc;
    w->jobsteps[w->njobsteps].job = job;
    w->jobsteps[w->njobsteps].step = step;
    w->njobsteps++;
    return 0;
}

/* Step a bound insert/update of the batch. A foreign-key failure (the job is gone) drops
 * the item and is counted; other errors fail the batch. *ok says whether it was applied. */
static int batch_step(store_writer *w, sqlite3_stmt *st, int64_t job, bool *ok)
{
    int rc = sqlite3_step(st);
    *ok = rc == SQLITE_DONE;
    if (rc == SQLITE_DONE)
        rc = 0;
    else if ((rc = store_sql_error(w->s->w->db, st, rc, "store writer")) == STORE_ENOTFOUND ||
             rc == STORE_ECONFLICT) {
        if (w->dropped++ == 0)
            w->dropped_job = job;
        rc = 0;
    }
    store_stmt_done(st);
    return rc;
}

/* The stream row of a message (rank 0 only: the stream is the job's, not a rank's). */
static int stream_add(store_writer *w, const witem *it, store_stream_kind kind, int64_t ref)
{
    if (it->rank != 0)
        return 0;
    int rc = store_stream_add(w->s, it->job, it->step, kind, ref);
    if (rc == STORE_ENOTFOUND || rc == STORE_ECONFLICT)
        rc = 0; /* the job is gone (its foreign key); its rows are dropped the same way */
    return rc;
}

static int apply_metric(store_writer *w, const witem *it, int64_t *rows)
{
    sqlite3_stmt *st = store_stmt(w->s->w, ST_METRIC_UPSERT);
    double v[STORE_M_NFIELDS];
    bool has_eval = it->u.m.has_eval, ok;
    uint32_t nan_mask = 0, nf = 0;
    unsigned flags = 0;
    wpending *p;
    int rc;

    if (!st)
        return STORE_EIO;
    memcpy(v, it->u.m.v, sizeof(v));
    if (w->npending && (p = pending_find(w, it->job, it->rank, it->step))) {
        if (!has_eval) { /* the eval result that came before its row */
            for (int i = 0; i < STORE_M_NFIELDS; i++)
                if ((STORE_EVAL_BITS >> i) & 1u)
                    v[i] = p->v[i];
            has_eval = true;
        }
        p->taken = true; /* a row with its own eval supersedes it */
    }
    for (int i = 0; i < STORE_M_NFIELDS; i++) {
        if ((!has_eval && ((STORE_EVAL_BITS >> i) & 1u)) || store_is_missing(v[i])) {
            v[i] = store_missing(); /* absent: NULL without a mask bit */
            continue;
        }
        if (isnan(v[i]))
            nan_mask |= 1u << i;
        if (!isfinite(v[i]))
            nf |= 1u << i;
    }
    if (v[STORE_M_OVERFLOW] != 0 && !isnan(v[STORE_M_OVERFLOW]))
        flags |= STORE_F_OVERFLOW;
    if (v[STORE_M_SKIPPED] != 0 && !isnan(v[STORE_M_SKIPPED]))
        flags |= STORE_F_SKIPPED;
    for (int i = 0; i < STORE_M_NFIELDS; i++)
        bind_real(st, i + 1, v[i]);
    sqlite3_bind_int64(st, STORE_MU_JOB, it->job);
    sqlite3_bind_int(st, STORE_MU_RANK, it->rank);
    sqlite3_bind_int64(st, STORE_MU_STEP, it->step);
    sqlite3_bind_int64(st, STORE_MU_NAN, nan_mask);
    sqlite3_bind_int64(st, STORE_MU_NF, nf);
    sqlite3_bind_int(st, STORE_MU_SPECIAL, (int)(flags | (nf ? STORE_SPECIAL_NF : 0)));
    sqlite3_bind_int(st, STORE_MU_HAS_EVAL, has_eval);
    sqlite3_bind_int64(st, STORE_MU_EVAL_BITS, STORE_EVAL_BITS);
    if ((rc = batch_step(w, st, it->job, &ok)) != 0 || !ok)
        return rc;
    (*rows)++;
    if ((rc = stream_add(w, it, STORE_SM_STEP, 0)) != 0 ||
        (has_eval && (rc = stream_add(w, it, STORE_SM_EVAL, 0)) != 0))
        return rc;
    if ((rc = rollup_add(w, it->job, it->rank, it->step, v, flags, nf)) != 0)
        return rc;
    return it->rank == 0 ? jobstep_note(w, it->job, it->step) : 0;
}

static void bind_named(sqlite3_stmt *st, const char *name, int64_t v)
{
    sqlite3_bind_int64(st, sqlite3_bind_parameter_index(st, name), v);
}

static int apply_eval(store_writer *w, const witem *it)
{
    sqlite3_stmt *st = store_stmt(w->s->w, ST_METRIC_EVAL);
    const double *v = it->u.m.v;
    uint32_t nan_mask = 0, nf = 0;
    int k = 0, rc;
    bool ok;

    if (!st)
        return STORE_EIO;
    for (int i = 0; i < STORE_M_NFIELDS; i++) {
        if (!((STORE_EVAL_BITS >> i) & 1u))
            continue;
        bool missing = store_is_missing(v[i]);
        nan_mask |= isnan(v[i]) && !missing ? 1u << i : 0;
        nf |= !isfinite(v[i]) && !missing ? 1u << i : 0;
        bind_real(st, ++k, v[i]);
    }
    bind_named(st, ":eval_bits", STORE_EVAL_BITS);
    bind_named(st, ":nan", nan_mask);
    bind_named(st, ":nf", nf);
    bind_named(st, ":job", it->job);
    bind_named(st, ":rank", it->rank);
    bind_named(st, ":step", it->step);
    if ((rc = batch_step(w, st, it->job, &ok)) != 0 || !ok)
        return rc;
    if (sqlite3_changes(w->s->w->db) == 0) {
        pending_add(w, it->job, it->rank, it->step, v);
        return 0;
    }
    if ((rc = stream_add(w, it, STORE_SM_EVAL, 0)) != 0)
        return rc;
    for (int li = 0; li < STORE_NLEVELS; li++)
        if ((rc = dirty_add(w, it->job, it->rank, li, it->step / store_levels[li])) != 0)
            return rc;
    return 0;
}

static int apply_event(store_writer *w, const witem *it)
{
    sqlite3_stmt *st = store_stmt(w->s->w, ST_EVENT_INSERT);
    bool ok;
    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, it->job);
    sqlite3_bind_int64(st, 2, it->step);
    sqlite3_bind_double(st, 3, it->u.ev.ts);
    sqlite3_bind_text(st, 4, it->u.ev.kind, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 5, it->u.ev.message, -1, SQLITE_STATIC);
    if (it->u.ev.data)
        sqlite3_bind_text(st, 6, it->u.ev.data, -1, SQLITE_STATIC);
    int rc = batch_step(w, st, it->job, &ok);
    if (rc || !ok)
        return rc;
    return stream_add(w, it, STORE_SM_EVENT, sqlite3_last_insert_rowid(w->s->w->db));
}

/* A diagnosed step: its layer_steps row, its rows, and no rows past its layer count. */
static int apply_layers(store_writer *w, const witem *it)
{
    const wlayers *L = it->u.layers;
    sqlite3_stmt *st = store_stmt(w->s->w, ST_LAYER_STEP_UPSERT);
    bool ok;
    int rc;

    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, it->job);
    sqlite3_bind_int64(st, 2, it->step);
    bind_real(st, 3, L->info.scale);
    sqlite3_bind_int(st, 4, L->n);
    sqlite3_bind_int(st, 5, (int)L->info.flags);
    if (L->info.first_layer[0]) {
        sqlite3_bind_text(st, 6, L->info.first_layer, -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 7, L->info.first_where, -1, SQLITE_STATIC);
    }
    if ((rc = batch_step(w, st, it->job, &ok)) != 0 || !ok)
        return rc; /* the job is gone: its rows would fail the same way */
    if ((rc = stream_add(w, it, STORE_SM_LAYERS, 0)) != 0)
        return rc;
    if (!(st = store_stmt(w->s->w, ST_LAYER_TRIM)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, it->job);
    sqlite3_bind_int64(st, 2, it->step);
    sqlite3_bind_int(st, 3, L->n);
    if ((rc = batch_step(w, st, it->job, &ok)) != 0)
        return rc;
    for (int i = 0; i < L->n; i++) {
        const store_layer_stat *r = &L->rows[i];
        uint32_t nan_mask = 0;
        if (!(st = store_stmt(w->s->w, ST_LAYER_UPSERT)))
            return STORE_EIO;
        sqlite3_bind_int64(st, 1, it->job);
        sqlite3_bind_int64(st, 2, it->step);
        sqlite3_bind_int(st, 3, i);
        sqlite3_bind_text(st, 4, r->name, -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 5, r->dtype, -1, SQLITE_STATIC);
        for (int f = 0; f < STORE_L_NFIELDS; f++) {
            bool missing = (r->missing >> f) & 1u;
            if (!missing && isnan(r->v[f]))
                nan_mask |= 1u << f;
            if (missing)
                sqlite3_bind_null(st, 7 + f);
            else
                bind_real(st, 7 + f, r->v[f]);
        }
        sqlite3_bind_int64(st, 6, nan_mask);
        if ((rc = batch_step(w, st, it->job, &ok)) != 0)
            return rc;
    }
    return 0;
}

/* One transaction for items[0..n) (wlock held); n == 0 is a probe, a one-page write. On
 * failure msg gets SQLite's message. */
static int apply_batch(store_writer *w, const witem *items, int n, int64_t *rows, char *msg,
                       size_t msglen)
{
    store *s = w->s;
    int rc;

    *rows = 0;
    w->ndirty = 0;
    w->njobsteps = 0;
    w->dropped = 0;
    if ((rc = store_exec_stmt(s->w, ST_BEGIN_IMMEDIATE)) != 0)
        goto fail;
    if ((rc = atomic_load(&s->fault)) != 0)
        goto fail;
    if (n == 0 && (rc = store_probe_write(s->w)) != 0)
        goto fail;
    for (int i = 0; i < n && !rc; i++) {
        switch (items[i].kind) {
        case W_METRIC:
            rc = apply_metric(w, &items[i], rows);
            break;
        case W_EVAL:
            rc = apply_eval(w, &items[i]);
            break;
        case W_LAYERS:
            rc = apply_layers(w, &items[i]);
            break;
        default:
            rc = apply_event(w, &items[i]);
            break;
        }
    }
    for (int i = 0; i < w->nseries && !rc; i++)
        rc = series_write(w, &w->series[i]);
    if (rc || (rc = dirty_rebuild(w)) != 0 || (rc = jobsteps_write(w)) != 0)
        goto fail;
    if ((rc = store_exec_stmt(s->w, ST_COMMIT)) != 0)
        goto fail;
    store_committed(s);
    pending_commit(w);
    if (w->dropped)
        log_warn("%lld queued rows dropped: their job no longer exists (job %lld, ...)",
                 (long long)w->dropped, (long long)w->dropped_job);
    return 0;
fail:
    snprintf(msg, msglen, "%s",
             atomic_load(&s->fault) ? "injected by store_test_fault" : sqlite3_errmsg(s->w->db));
    if (!sqlite3_get_autocommit(s->w->db))
        store_exec_stmt(s->w, ST_ROLLBACK);
    w->nseries = 0; /* the open buckets may hold rows that were rolled back */
    w->ndirty = 0;
    pending_rollback(w);
    return rc;
}

static const char *fail_reason(int code)
{
    return code == STORE_EFULL ? "disk_full" : code == STORE_EBUSY ? "store_locked" : "store_error";
}

/* A failed attempt of the writer (mu held): the health says so, flushers are told. Returns
 * false when the writer gives up on what it holds (closing, and the failure outlasted
 * STORE_CLOSE_WAIT_S). */
static bool note_failure(store_writer *w, int rc, const char *msg)
{
    double now = mono_now();
    int64_t held = (int64_t)(w->enqueued - w->processed);
    if (!w->fail_code) {
        w->fail_since = store_now();
        w->fail_mono = w->fail_logged = now;
        log_warn("the store cannot write (%s: %s): %lld items held, retrying until it can",
                 store_strerror(rc), msg, (long long)held);
    } else if (now - w->fail_logged >= W_REMIND_S) {
        w->fail_logged = now;
        log_warn("the store still cannot write after %.0f s (%s: %s): %lld items held",
                 now - w->fail_mono, store_strerror(rc), msg, (long long)held);
    }
    w->fail_code = rc;
    snprintf(w->fail_msg, sizeof(w->fail_msg), "%s: %s", store_strerror(rc), msg);
    w->fail_gen++;
    w->failures++;
    w->attempts++;
    pthread_cond_broadcast(&w->done);
    if (w->stop && now >= w->stop_at + STORE_CLOSE_WAIT_S)
        w->gave_up = true;
    return !w->gave_up;
}

/* A commit (mu held): the health is good again. */
static void note_success(store_writer *w)
{
    if (w->fail_code)
        log_info("the store writes again after %.1f s and %lld failed attempts; nothing held "
                 "was lost",
                 mono_now() - w->fail_mono, (long long)w->attempts);
    w->fail_code = 0;
    w->attempts = 0;
    w->fail_msg[0] = '\0';
    w->probe = false;
}

/* Wait before retry number `attempt` (1, 2, ...): 100 ms doubling to STORE_RETRY_MAX_MS,
 * cut short by store_test_fault(0) or a stop. */
static void retry_wait(store_writer *w, int attempt)
{
    int ms = W_RETRY_MIN_MS;
    for (int i = 1; i < attempt && ms < STORE_RETRY_MAX_MS; i++)
        ms *= 2;
    if (ms > STORE_RETRY_MAX_MS)
        ms = STORE_RETRY_MAX_MS;
    struct timespec ts = mono_at(mono_now() + ms * 1e-3);
    pthread_mutex_lock(&w->mu);
    pthread_cond_timedwait(&w->wake, &w->mu, &ts);
    pthread_mutex_unlock(&w->mu);
}

/* Commit items[0..n) (n == 0: a probe), retrying until it commits; only a closing store
 * gives up (see note_failure). The items' heap parts are freed either way. */
static void process_batch(store_writer *w, witem *items, int n)
{
    store *s = w->s;
    int64_t rows = 0;
    int rc = STORE_EIO, attempt = 0;
    char msg[200] = "";
    bool go_on = true;

    pthread_mutex_lock(&w->mu);
    go_on = !w->gave_up;
    pthread_mutex_unlock(&w->mu);
    while (go_on) {
        pthread_mutex_lock(&s->wlock);
        rc = apply_batch(w, items, n, &rows, msg, sizeof(msg));
        pthread_mutex_unlock(&s->wlock);
        pthread_mutex_lock(&w->mu);
        if (rc == 0)
            note_success(w);
        else
            go_on = note_failure(w, rc, msg);
        pthread_mutex_unlock(&w->mu);
        if (rc == 0)
            break;
        if (go_on)
            retry_wait(w, ++attempt);
    }
    if (rc == 0) {
        atomic_fetch_add(&s->metric_rows, rows);
        atomic_fetch_add(&s->batches, 1);
        w->commits_since_ckpt++;
    } else if (n > 0) {
        log_error("LOST %d queued metric rows, evals, layer stats and events: the store is "
                  "closing and could not write them within %d s (%s)",
                  n, STORE_CLOSE_WAIT_S, msg[0] ? msg : "gave up");
    }
    for (int i = 0; i < n; i++) {
        if (items[i].kind == W_EVENT) {
            free(items[i].u.ev.message);
            free(items[i].u.ev.data);
        } else if (items[i].kind == W_LAYERS) {
            free(items[i].u.layers);
        }
    }
}

static void wal_checkpoint(store_writer *w)
{
    store *s = w->s;
    int log_frames = 0, ckpt_frames = 0, rc;

    pthread_mutex_lock(&s->wlock);
    /* Readers can hold a TRUNCATE back; do not stall the queue for long behind them. */
    sqlite3_busy_timeout(s->w->db, 250);
    rc = sqlite3_wal_checkpoint_v2(s->w->db, NULL, SQLITE_CHECKPOINT_TRUNCATE, &log_frames,
                                   &ckpt_frames);
    sqlite3_busy_timeout(s->w->db, 5000);
    pthread_mutex_unlock(&s->wlock);
    w->last_ckpt = mono_now();
    if (rc == SQLITE_OK)
        w->commits_since_ckpt = 0;
    else if ((rc & 0xff) == SQLITE_BUSY)
        log_debug("WAL checkpoint postponed: readers are busy");
    else
        log_warn("WAL checkpoint failed: %s", sqlite3_errstr(rc));
}

static bool ckpt_due(store_writer *w)
{
    struct stat sb;
    if (w->commits_since_ckpt == 0)
        return false;
    if (mono_now() >= w->last_ckpt + W_CKPT_S)
        return true;
    return stat(w->wal_path, &sb) == 0 && sb.st_size > W_CKPT_BYTES;
}

static void *writer_main(void *arg)
{
    store_writer *w = arg;

    w->last_ckpt = mono_now();
    pthread_mutex_lock(&w->mu);
    for (;;) {
        int n;
        while (w->count == 0 && !w->stop && !w->probe) {
            if (w->commits_since_ckpt > 0) {
                double due = w->last_ckpt + W_CKPT_S;
                struct timespec ts = mono_at(due);
                if (mono_now() >= due) {
                    pthread_mutex_unlock(&w->mu);
                    wal_checkpoint(w);
                    pthread_mutex_lock(&w->mu);
                    continue;
                }
                pthread_cond_timedwait(&w->nonempty, &w->mu, &ts);
            } else {
                pthread_cond_wait(&w->nonempty, &w->mu);
            }
        }
        if (w->count == 0 && w->probe && !w->stop) {
            pthread_mutex_unlock(&w->mu);
            process_batch(w, NULL, 0); /* clears probe once it has written */
            pthread_mutex_lock(&w->mu);
            continue;
        }
        if (w->count == 0)
            break; /* stopping, and everything is committed */
        if (w->count < W_BATCH && !w->stop && w->flushers == 0) {
            struct timespec ts = mono_at(mono_now() + W_LINGER_MS * 1e-3);
            while (w->count < W_BATCH && !w->stop && w->flushers == 0 &&
                   pthread_cond_timedwait(&w->nonempty, &w->mu, &ts) != ETIMEDOUT)
                ;
        }
        n = q_pop(w, w->batch, W_BATCH);
        pthread_cond_broadcast(&w->notfull);
        pthread_mutex_unlock(&w->mu);

        process_batch(w, w->batch, n);
        if (ckpt_due(w))
            wal_checkpoint(w);

        pthread_mutex_lock(&w->mu);
        w->processed += (uint64_t)n;
        pthread_cond_broadcast(&w->done);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* ---- public ------------------------------------------------------------------------------- */

int store_writer_start(store *s)
{
    store_writer *w = calloc(1, sizeof(*w));
    pthread_condattr_t ca;

    if (!w)
        return STORE_EIO;
    w->s = s;
    w->batch = malloc(W_BATCH * sizeof(witem));
    w->wal_path = malloc(strlen(s->path) + 5);
    if (!w->batch || !w->wal_path) {
        free(w->batch);
        free(w->wal_path);
        free(w);
        return STORE_EIO;
    }
    sprintf(w->wal_path, "%s-wal", s->path);
    pthread_mutex_init(&w->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->nonempty, &ca);
    pthread_cond_init(&w->notfull, &ca);
    pthread_cond_init(&w->done, &ca);
    pthread_cond_init(&w->wake, &ca);
    pthread_condattr_destroy(&ca);
    s->wr = w;
    if (pthread_create(&w->thread, NULL, writer_main, w) != 0) {
        log_error("cannot start the store writer thread");
        store_writer_stop(s);
        return STORE_EIO;
    }
    w->started = true;
    return 0;
}

void store_writer_stop(store *s)
{
    store_writer *w = s ? s->wr : NULL;
    if (!w)
        return;
    if (w->started) {
        pthread_mutex_lock(&w->mu);
        w->stop = true;
        w->stop_at = mono_now();
        pthread_cond_broadcast(&w->nonempty);
        pthread_cond_broadcast(&w->notfull);
        pthread_cond_broadcast(&w->wake);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
    }
    while (w->head) {
        wchunk *c = w->head;
        w->head = c->next;
        free(c);
    }
    while (w->spare) {
        wchunk *c = w->spare;
        w->spare = c->next;
        free(c);
    }
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->nonempty);
    pthread_cond_destroy(&w->notfull);
    pthread_cond_destroy(&w->done);
    pthread_cond_destroy(&w->wake);
    free(w->dirty);
    free(w->batch);
    free(w->wal_path);
    free(w);
    s->wr = NULL;
}

int store_flush(store *s)
{
    store_writer *w;
    uint64_t target, gen;
    bool failing;
    int rc = 0;

    if (!s || !s->wr)
        return STORE_EINVAL;
    w = s->wr;
    pthread_mutex_lock(&w->mu);
    target = w->enqueued;
    gen = w->fail_gen;
    failing = w->fail_code != 0;
    w->flushers++;
    pthread_cond_signal(&w->nonempty);
    while (w->processed < target) {
        if (w->fail_code && (failing || w->fail_gen != gen)) {
            rc = w->fail_code; /* held, not lost: the writer goes on retrying */
            break;
        }
        pthread_cond_wait(&w->done, &w->mu);
    }
    w->flushers--;
    pthread_mutex_unlock(&w->mu);
    return rc;
}

void store_get_health(store *s, store_health *out)
{
    store_writer *w = s ? s->wr : NULL;
    if (!out)
        return;
    memset(out, 0, sizeof(*out));
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    out->code = w->fail_code;
    if (w->fail_code) {
        out->reason = fail_reason(w->fail_code);
        snprintf(out->message, sizeof(out->message), "%s", w->fail_msg);
        out->since = w->fail_since;
    }
    out->held = (int64_t)(w->enqueued - w->processed);
    out->failures = w->failures;
    pthread_mutex_unlock(&w->mu);
}

void store_writer_probe(store *s, int rc)
{
    store_writer *w = s ? s->wr : NULL;
    if (!w || (rc != STORE_EFULL && rc != STORE_EBUSY && rc != STORE_EIO))
        return;
    pthread_mutex_lock(&w->mu);
    if (!w->probe && !w->fail_code) {
        w->probe = true;
        pthread_cond_signal(&w->nonempty);
    }
    pthread_mutex_unlock(&w->mu);
}

int store_test_fault(store *s, int code)
{
    if (!s || !s->wr || (code != 0 && code != STORE_EFULL && code != STORE_EBUSY &&
                         code != STORE_EIO))
        return STORE_EINVAL;
    atomic_store(&s->fault, code);
    pthread_mutex_lock(&s->wr->mu);
    pthread_cond_broadcast(&s->wr->wake); /* a cleared fault: retry now */
    pthread_mutex_unlock(&s->wr->mu);
    return 0;
}

int store_metric_append(store *s, const store_metric *m)
{
    witem it;
    if (!s || !m || m->rank < 0 || m->step < 0)
        return STORE_EINVAL;
    memset(&it, 0, sizeof(it));
    it.kind = W_METRIC;
    it.job = m->job_id;
    it.rank = m->rank;
    it.step = m->step;
    memcpy(it.u.m.v, m->v, sizeof(it.u.m.v));
    it.u.m.has_eval = m->has_eval;
    return q_push(s->wr, &it);
}

int store_metric_eval(store *s, int64_t job, int rank, int64_t step, const double *v)
{
    witem it;
    if (!s || !v || rank < 0 || step < 0)
        return STORE_EINVAL;
    memset(&it, 0, sizeof(it));
    it.kind = W_EVAL;
    it.job = job;
    it.rank = rank;
    it.step = step;
    memcpy(it.u.m.v, v, sizeof(it.u.m.v));
    return q_push(s->wr, &it);
}

int store_event_append(store *s, int64_t job, int64_t step, const char *kind, const char *message,
                       const char *data_json)
{
    witem it;
    int rc;
    if (!s || !kind || !message || strlen(kind) >= sizeof(it.u.ev.kind))
        return STORE_EINVAL;
    memset(&it, 0, sizeof(it));
    it.kind = W_EVENT;
    it.job = job;
    it.step = step;
    it.u.ev.ts = store_now();
    snprintf(it.u.ev.kind, sizeof(it.u.ev.kind), "%s", kind);
    it.u.ev.message = strdup(message);
    it.u.ev.data = data_json ? strdup(data_json) : NULL;
    if (!it.u.ev.message || (data_json && !it.u.ev.data)) {
        free(it.u.ev.message);
        free(it.u.ev.data);
        return STORE_EIO;
    }
    if ((rc = q_push(s->wr, &it)) != 0) {
        free(it.u.ev.message);
        free(it.u.ev.data);
    }
    return rc;
}

/* The STORE_LS_ flags of a diagnosed step. */
static unsigned layer_flags(const store_layer_info *info, const store_layer_stat *rows, int n)
{
    unsigned flags = info && info->first_layer[0] ? STORE_LS_NONFINITE : 0;
    for (int i = 0; i < n; i++) {
        const store_layer_stat *r = &rows[i];
        bool has_ovf = !((r->missing >> STORE_L_ACT_OVERFLOW) & 1u);
        bool has_nf = !((r->missing >> STORE_L_GRAD_NONFINITE) & 1u);
        if (has_ovf && r->v[STORE_L_ACT_OVERFLOW] > 0)
            flags |= STORE_LS_OVERFLOW;
        if (has_nf && r->v[STORE_L_GRAD_NONFINITE] > 0)
            flags |= STORE_LS_NONFINITE;
        if ((!((r->missing >> STORE_L_ACT_AMAX) & 1u) && !isfinite(r->v[STORE_L_ACT_AMAX])) ||
            (!((r->missing >> STORE_L_GRAD_AMAX) & 1u) && !isfinite(r->v[STORE_L_GRAD_AMAX])))
            flags |= STORE_LS_NONFINITE;
    }
    return flags;
}

int store_layer_stats_append(store *s, int64_t job, int64_t step, const store_layer_info *info,
                             const store_layer_stat *rows, int n)
{
    wlayers *L;
    witem it;
    int rc;

    if (!s || step < 0 || n < 0 || n > STORE_LAYERS_MAX || (n > 0 && !rows))
        return STORE_EINVAL;
    if (info &&
        (strnlen(info->first_layer, sizeof(info->first_layer)) == sizeof(info->first_layer) ||
         strnlen(info->first_where, sizeof(info->first_where)) == sizeof(info->first_where)))
        return STORE_EINVAL;
    for (int i = 0; i < n; i++)
        if (!rows[i].name[0] ||
            strnlen(rows[i].name, sizeof(rows[i].name)) == sizeof(rows[i].name) ||
            strnlen(rows[i].dtype, sizeof(rows[i].dtype)) == sizeof(rows[i].dtype))
            return STORE_EINVAL;
    L = malloc(sizeof(*L) + (size_t)n * sizeof(store_layer_stat));
    if (!L)
        return STORE_EIO;
    memset(&L->info, 0, sizeof(L->info));
    L->info.scale = NAN;
    if (info) {
        L->info.scale = info->scale;
        memcpy(L->info.first_layer, info->first_layer, sizeof(L->info.first_layer));
        memcpy(L->info.first_where, info->first_where, sizeof(L->info.first_where));
        if (!L->info.first_layer[0])
            L->info.first_where[0] = '\0';
    }
    L->info.flags = layer_flags(&L->info, rows, n);
    L->n = n;
    if (n > 0)
        memcpy(L->rows, rows, (size_t)n * sizeof(store_layer_stat));
    memset(&it, 0, sizeof(it));
    it.kind = W_LAYERS;
    it.job = job;
    it.step = step;
    it.u.layers = L;
    if ((rc = q_push(s->wr, &it)) != 0)
        free(L);
    return rc;
}

/* Step a bound statement of the write connection to completion. */
static int step_done(store *s, sqlite3_stmt *st)
{
    int rc = sqlite3_step(st);
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(s->w->db, st, rc, "store_metrics_truncate");
    store_stmt_done(st);
    return rc;
}

int store_metrics_truncate(store *s, int64_t job, int64_t after_step)
{
    static const int deletes[] = {ST_METRIC_TRUNCATE, ST_ROLLUP_TRUNCATE, ST_LAYER_TRUNCATE,
                                  ST_LAYER_STEP_TRUNCATE, ST_STREAM_TRUNCATE, ST_JOB_STEP_MIN};
    struct straddle {
        int rank, li;
        int64_t bucket;
    } *sv = NULL;
    int nsv = 0, capsv = 0, rc;
    sqlite3_stmt *st;

    if (!s)
        return STORE_EINVAL;
    if (after_step < -1)
        after_step = -1;
    if ((rc = store_flush(s)) != 0)
        return rc;
    if ((rc = store_txn_begin(s)) != 0)
        goto out;
    /* Buckets that keep some rows: found before the rows go, rebuilt after. */
    if (!(st = store_stmt(s->w, ST_ROLLUP_STRADDLING))) {
        rc = STORE_EIO;
        goto fail;
    }
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, after_step);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (nsv == capsv) {
            struct straddle *nv =
                realloc(sv, (size_t)(capsv = capsv ? 2 * capsv : 16) * sizeof(*sv));
            if (!nv) {
                rc = STORE_EIO;
                store_stmt_done(st);
                goto fail;
            }
            sv = nv;
        }
        sv[nsv].rank = sqlite3_column_int(st, 0);
        sv[nsv].li = level_index(sqlite3_column_int64(st, 1));
        sv[nsv].bucket = sqlite3_column_int64(st, 2);
        if (sv[nsv].li >= 0)
            nsv++;
    }
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(s->w->db, st, rc, __func__);
    store_stmt_done(st);
    if (rc)
        goto fail;
    for (size_t i = 0; i < sizeof(deletes) / sizeof(deletes[0]); i++) {
        if (!(st = store_stmt(s->w, deletes[i]))) {
            rc = STORE_EIO;
            goto fail;
        }
        sqlite3_bind_int64(st, 1, job);
        sqlite3_bind_int64(st, 2, deletes[i] == ST_JOB_STEP_MIN && after_step < 0 ? 0 : after_step);
        if ((rc = step_done(s, st)) != 0)
            goto fail;
    }
    /* ST_ROLLUP_STRADDLING orders by level: finest first, as rebuilds need. */
    for (int i = 0; i < nsv; i++)
        if ((rc = store_rollup_rebuild(s, job, sv[i].rank, sv[i].li, sv[i].bucket)) != 0)
            goto fail;
    if ((rc = store_exec_stmt(s->w, ST_COMMIT)) != 0)
        goto fail;
    goto out;
fail:
    if (!sqlite3_get_autocommit(s->w->db))
        store_exec_stmt(s->w, ST_ROLLBACK);
out:
    store_writer_forget(s, job, after_step);
    store_wend(s, rc);
    store_committed(s);
    free(sv);
    return rc;
}
