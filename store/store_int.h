/*
 * store_int.h - what the files of the store/ module share and nothing outside it uses:
 * the store struct, connections with their prepared-statement caches, the aggregate of a
 * bucket of metric rows (min/max/last per field) and the writer's entry points.
 *
 * Files: schema.c (connections, PRAGMAs, migrations, the SQL of every statement),
 * store.c (open/close, names, jobs, events, checkpoints, layer-stats reads, stats),
 * writer.c (the queue, the writer thread, rollup maintenance, layer-stats writes, truncate),
 * series.c (aggregates and the series query).
 *
 * Threads: the write connection is used only under store.wlock (by the writer thread for
 * its batches and by the synchronous job calls); each read connection belongs to one
 * thread (store_reader()).
 */
#ifndef AMPD_STORE_INT_H
#define AMPD_STORE_INT_H

#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>

#include "store/store.h"

#define STORE_ALL_FIELDS ((1u << STORE_M_NFIELDS) - 1u)
/* The fields an "eval" line carries (STORE_LINE_EVAL), as a mask of field bits. */
#define STORE_EVAL_BIT_(id, name, line, type, src, since)                                          \
    | (STORE_LINE_##line == STORE_LINE_EVAL ? 1u << STORE_M_##id : 0u)
#define STORE_EVAL_BITS (0u STORE_METRICS(STORE_EVAL_BIT_))
_Static_assert(STORE_M_NFIELDS <= 32, "field masks are 32-bit");

/* metrics.special: bit 0 overflow, bit 1 skipped (the STORE_F_ values), bit 2 some field
 * is NaN or +-Inf (nf_mask != 0). The partial index covers rows with special != 0. */
#define STORE_SPECIAL_NF 4u

/* Rollup levels: buckets of 10, 100, 1000 and 10000 steps, bucket b of level L covering
 * steps [b*L, (b+1)*L - 1]. Each level's buckets nest in the next one's, ten to one
 * (rebuilds use that). Level 10 keeps the raw rows read at unaligned bucket edges few. */
#define STORE_NLEVELS 4
extern const int64_t store_levels[STORE_NLEVELS];

/* ---- statements (schema.c) -------------------------------------------------------------- */

enum {
    ST_BEGIN,           /* deferred: a consistent snapshot for readers */
    ST_BEGIN_IMMEDIATE, /* writers */
    ST_COMMIT,
    ST_ROLLBACK,
    ST_VERSION_GET,
    ST_VERSION_ADD,
    ST_JOB_INSERT,
    ST_JOB_BRANCHES,
    ST_JOB_BY_IDEM,
    ST_JOB_GET,
    ST_JOB_LIST,
    ST_JOB_IDS,
    ST_JOB_STATUS,
    ST_JOB_SUMMARY,
    ST_JOB_SPEC,
    ST_JOB_LAUNCH,
    ST_JOB_CHECKPOINT,
    ST_JOB_CANCEL,
    ST_JOB_RETRIES,
    ST_JOB_DELETE,
    ST_JOB_STEP_MAX,
    ST_JOB_STEP_MIN,
    ST_JOB_COUNTS,
    ST_METRIC_UPSERT,
    ST_METRIC_EVAL,
    ST_METRIC_LATEST,
    ST_METRIC_MAX_STEP,
    ST_METRIC_TRUNCATE,
    ST_RAW_RANGE,
    ST_ROLLUP_GET,
    ST_ROLLUP_RANGE,
    ST_ROLLUP_UPSERT,
    ST_ROLLUP_DELETE,
    ST_ROLLUP_TRUNCATE,
    ST_ROLLUP_STRADDLING,
    ST_LAYER_TRUNCATE,
    ST_LAYER_STEP_TRUNCATE,
    ST_LAYER_STEP_UPSERT,
    ST_LAYER_STEP_GET,
    ST_LAYER_STEP_LATEST,
    ST_LAYER_STEP_RANGE,
    ST_LAYER_UPSERT,
    ST_LAYER_TRIM,
    ST_LAYER_GET,
    ST_EVENT_INSERT,
    ST_EVENT_LIST,
    ST_CKPT_ADD,
    ST_CKPT_LIST,
    ST_CKPT_DELETE,
    ST_STREAM_CKPT_DELETE,
    ST_STREAM_ADD,
    ST_STREAM_END,
    ST_STREAM_READ,
    ST_STREAM_TRUNCATE,
    ST_STREAM_AT_STEP,
    ST_EVAL_LIST,
    ST_EVENT_LAST,
    ST_EXP_INSERT,
    ST_EXP_MEMBER_ADD,
    ST_EXP_GET,
    ST_EXP_LIST,
    ST_EXP_MEMBERS,
    ST_EXP_DELETE,
    ST_COUNT
};

/* Parameters of ST_METRIC_UPSERT: the fields ?1..?N in field order, then these (checked
 * when the statement is prepared). */
enum {
    STORE_MU_JOB = STORE_M_NFIELDS + 1, STORE_MU_RANK, STORE_MU_STEP, STORE_MU_NAN, STORE_MU_NF,
    STORE_MU_SPECIAL, STORE_MU_HAS_EVAL, STORE_MU_EVAL_BITS
};
/* Parameters of ST_ROLLUP_UPSERT: field i's min, max, last at 3i+1..3i+3, then these. */
enum {
    STORE_RUP_JOB = 3 * STORE_M_NFIELDS + 1, STORE_RUP_RANK, STORE_RUP_LEVEL, STORE_RUP_BUCKET,
    STORE_RUP_FIRST, STORE_RUP_LAST, STORE_RUP_COUNT, STORE_RUP_FLAGS, STORE_RUP_NF
};
/* ST_METRIC_EVAL takes the EVAL fields ?1..?k in field order, then named parameters
 * (:eval_bits, :nan, :nf, :job, :rank, :step), bound by name. */

/* Columns of metric-row SELECTs (ST_RAW_RANGE, ST_METRIC_LATEST, STORE_Q_RAW,
 * STORE_Q_SPECIAL): these, then the statement's fields in field order (all STORE_M_NFIELDS
 * for the fixed statements, the field mask's for the STORE_Q_ ones). */
#define STORE_RAW_STEP 0
#define STORE_RAW_SPECIAL 1
#define STORE_RAW_NF 2
#define STORE_RAW_NAN 3
#define STORE_RAW_RANK 4
#define STORE_RAW_FIELDS 5
/* Columns of rollup SELECTs (ST_ROLLUP_GET, ST_ROLLUP_RANGE, STORE_Q_ROLLUP): these, then
 * min, max, last of each of the statement's fields. */
#define STORE_RU_BUCKET 0
#define STORE_RU_FIRST 1
#define STORE_RU_LAST 2
#define STORE_RU_COUNT 3
#define STORE_RU_FLAGS 4
#define STORE_RU_NF 5
#define STORE_RU_FIELDS 6

/* Columns of ST_LAYER_STEP_GET / ST_LAYER_STEP_LATEST: step, scale, nlayers, flags,
 * first_layer, first_where. Columns of ST_LAYER_GET: layer, name, dtype, nan_mask, then
 * the STORE_L_NFIELDS fields. */
#define STORE_LG_FIELDS 4

/* Range SELECTs that read only some fields (SQLite's cost per row grows with the columns
 * it returns). Their text is built from the fixed column names, never from input. */
enum { STORE_Q_RAW, STORE_Q_SPECIAL, STORE_Q_ROLLUP };
#define STORE_NQCACHE 16

typedef struct {
    sqlite3 *db;
    sqlite3_stmt *st[ST_COUNT]; /* prepared on first use, SQLITE_PREPARE_PERSISTENT */
    struct {
        int key;       /* kind * 8 + slot */
        uint32_t mask; /* fields */
        uint64_t used;
        sqlite3_stmt *st;
    } q[STORE_NQCACHE]; /* the field-subset statements, least recently used replaced */
    uint64_t tick;
} store_conn;

/* Open a connection to path: the writer creates the file, sets WAL, synchronous=NORMAL,
 * foreign_keys=ON; readers open read-only. Both get busy_timeout=5000. Caller closes with
 * store_conn_close(). */
int store_conn_open(const char *path, bool writer, store_conn **out);
void store_conn_close(store_conn *c);
/* The cached statement id of c, prepared on first use; NULL on error (logged). The caller
 * resets it when done (store_stmt_done). */
sqlite3_stmt *store_stmt(store_conn *c, int id);
void store_stmt_done(sqlite3_stmt *st);
/* A STORE_Q_ kind of range SELECT for the fields in mask, prepared on first use and cached
 * (slot tells apart statements that are stepped at the same time). Parameters: job ?1,
 * rank ?2, then steps ?3..?4 (raw, special) or level ?3 and buckets ?4..?5 (rollup).
 * NULL on error (logged). */
sqlite3_stmt *store_stmt_fields(store_conn *c, int kind, int slot, uint32_t mask);
/* Log the SQLite error of st (or of db when st is NULL) and map rc to a STORE_E code:
 * STORE_EFULL for a full disk (SQLITE_FULL, or an I/O error whose system errno is ENOSPC),
 * STORE_EBUSY for a lock held by another connection (SQLITE_BUSY, SQLITE_LOCKED), both
 * logged at debug level (the writer and the callers report them); STORE_EIO otherwise. */
int store_sql_error(sqlite3 *db, sqlite3_stmt *st, int rc, const char *func);
/* Run one of the transaction statements (ST_BEGIN...ST_ROLLBACK) on c. */
int store_exec_stmt(store_conn *c, int id);
/* Rewrite the database header's user_version (which the store does not use otherwise)
 * with its own value, inside the caller's transaction: a one-page write that the commit
 * puts on disk, to find out whether the database can be written (the writer's probe). */
int store_probe_write(store_conn *c);
/* PRAGMA quick_check on the write connection c before anything is written (store_open):
 * STORE_EIO, with path and SQLite's findings logged, when the file is damaged. A check
 * still running after STORE_CHECK_MAX_S seconds (a database of many GB on a slow disk) is
 * stopped with a warning and the store opens. */
#define STORE_CHECK_MAX_S 30
int store_check_integrity(store_conn *c, const char *path);
/* Bring the schema of the write connection c up to date (each migration in its own
 * transaction). STORE_ECONFLICT when the database comes from a newer ampd. */
int store_migrate(store_conn *c, const char *path);

/* ---- aggregates (series.c) -------------------------------------------------------------- */

/* Min, max and last of every field over a set of rows. min/max skip NaN (NaN when no
 * field value was a number); last is the value at step_last (NaN included). */
typedef struct {
    int64_t step_first, step_last, count;
    unsigned flags;   /* STORE_F_OVERFLOW | STORE_F_SKIPPED of any row */
    uint32_t nf_mask; /* fields that were NaN or +-Inf in some row */
    double min[STORE_M_NFIELDS], max[STORE_M_NFIELDS], last[STORE_M_NFIELDS];
} store_agg;

void store_agg_init(store_agg *a);
/* Fold one row (v: every field, NaN for absent) into a. */
void store_agg_add(store_agg *a, int64_t step, const double *v, unsigned flags, uint32_t nf);
/* Fold the aggregate b (rows disjoint from a's) into a. */
void store_agg_merge(store_agg *a, const store_agg *b);
/* Read the current row of a metric-row SELECT whose fields are mask: those into v (others
 * NaN), the flags (overflow/skipped) and nf_mask. Returns the step. */
int64_t store_row_read(sqlite3_stmt *st, uint32_t mask, double *v, unsigned *flags, uint32_t *nf);
/* Read the current row of a rollup SELECT whose fields are mask into a (fields outside
 * mask NaN). Returns the bucket. */
int64_t store_agg_read(sqlite3_stmt *st, uint32_t mask, store_agg *a);

/* ---- messages (store.c) ---------------------------------------------------------------------- */

/* The store's messages, through store_log (store.h). */
#define log_debug(...) store_log(STORE_LOG_DEBUG, __func__, __VA_ARGS__)
#define log_info(...) store_log(STORE_LOG_INFO, __func__, __VA_ARGS__)
#define log_warn(...) store_log(STORE_LOG_WARN, __func__, __VA_ARGS__)
#define log_error(...) store_log(STORE_LOG_ERROR, __func__, __VA_ARGS__)

/* ---- the store ---------------------------------------------------------------------------- */

typedef struct store_rconn store_rconn;
typedef struct store_writer store_writer;

struct store {
    char *path;
    store_conn *w;         /* the write connection; only under wlock */
    pthread_mutex_t wlock; /* also guards the writer's rollup state */
    store_writer *wr;
    pthread_key_t rkey; /* this thread's store_rconn */
    pthread_mutex_t rlock;
    store_rconn *rconns; /* every open read connection */
    atomic_llong metric_rows, batches;
    pthread_mutex_t cmu; /* with ccv: store_wait_commit's waiters */
    pthread_cond_t ccv;
    uint64_t commits; /* committed changes (under cmu) */
    atomic_int fault; /* store_test_fault's code: every write fails with it (0: none) */
};

/* A synchronous write on the write connection: store_wbegin takes wlock and returns 0, or
 * the injected fault (store_test_fault), wlock held either way; store_wend notes the
 * outcome rc (a write that failed for want of space, a lock or I/O makes the writer find
 * out when writing works again: store_writer_probe), releases wlock and returns rc. */
int store_wbegin(store *s);
int store_wend(store *s, int rc);
/* The one shape of a synchronous write of one statement:
 *     if ((rc = store_wstmt(s, ST_X, &st)) == 0) {
 *         bind; rc = store_step_change(s, st, __func__);
 *     }
 *     return store_wend(s, rc);
 * store_wstmt is store_wbegin, then the prepared statement stmt in *st (STORE_EIO when it
 * cannot be had); store_wend follows it whatever it returned. */
int store_wstmt(store *s, int stmt, sqlite3_stmt **st);
/* The same for a transaction: store_wbegin, then BEGIN IMMEDIATE; store_txn_end follows it
 * whatever it returned. */
int store_txn_begin(store *s);

/* Tell store_wait_commit's waiters that a change was committed. */
void store_committed(store *s);
/* Append a stream row (job, step, kind, ref; ref <= 0: none) with wlock held. */
int store_stream_add(store *s, int64_t job, int64_t step, store_stream_kind kind, int64_t ref);

/* This thread's read connection, opened on first use; NULL on error (logged). */
store_conn *store_reader(store *s);

/* Helpers of the synchronous calls (store.c), shared with experiment.c. */
/* Bind v as text (NULL: SQL NULL). */
int store_bind_text(sqlite3_stmt *st, int i, const char *v);
/* Column i as a heap copy (NULL for SQL NULL or out of memory), or copied into dst. */
char *store_column_dup(sqlite3_stmt *st, int i);
void store_column_copy(sqlite3_stmt *st, int i, char *dst, size_t size);
/* Step a bound UPDATE/DELETE/INSERT of the write connection (wlock held) and reset it;
 * STORE_ENOTFOUND when it changed no row. */
int store_step_change(store *s, sqlite3_stmt *st, const char *func);
/* Room for one more element in the heap array *v of *cap elements of size elem holding cnt:
 * doubled (from first) when full. 0, or STORE_EIO when out of memory (*v is kept). */
int store_grow(void *v, int *cap, int cnt, size_t elem, int first);
/* End a synchronous write's explicit transaction (store_txn_begin): commit when rc is 0,
 * else roll back; leaves wlock. Returns rc or the commit's error. */
int store_txn_end(store *s, int rc);

/* ---- the writer (writer.c) ---------------------------------------------------------------- */

int store_writer_start(store *s);
/* Commit what is queued, stop the thread, free the writer. */
void store_writer_stop(store *s);
int64_t store_writer_depth(store *s);
/* A synchronous write failed with rc: unless the writer is already retrying, it tries a
 * write of its own, and keeps trying, so that the store's health follows the disk (rc of
 * another kind, a constraint or a bad argument, is no sign of that: nothing happens). */
void store_writer_probe(store *s, int rc);
/* Drop the writer's in-memory state of job (rollup buckets, pending evals past
 * after_step; INT64_MIN: all). Call with wlock held. */
void store_writer_forget(store *s, int64_t job, int64_t after_step);
/* Recompute rollup bucket (job, rank, level li, bucket) from the rows under it (raw rows
 * for level 0, the buckets of level li-1 otherwise); deletes it when empty. wlock held,
 * inside a transaction. */
int store_rollup_rebuild(store *s, int64_t job, int rank, int li, int64_t bucket);

double store_now(void);

#endif /* AMPD_STORE_INT_H */
