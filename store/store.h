/*
 * store.h - the public header of the store/ module: ampd's run history in SQLite.
 *
 * Tables (docs/architecture.md, "The store"): jobs, metrics (one row per job, rank and step),
 * metrics_rollup (min/max/last per bucket of 10, 100, 1000 and 10000 steps, maintained by the
 * writer so a long series downsamples without scanning it), layer_stats (one row per job, diagnosed
 * step and layer) with layer_steps (one per diagnosed step), events, checkpoints, schema_version.
 * WAL mode, synchronous=NORMAL, busy_timeout, versioned migrations run at open, prepared statements
 * only: nothing a client sends reaches SQL except as a bound parameter.
 *
 * Writes of metrics, layer stats and events are asynchronous: they are queued to the one
 * writer thread, which commits them in batched transactions and checkpoints the WAL
 * periodically. Job rows are written synchronously (they are rare and callers need them
 * durable before they answer). store_flush() waits until everything queued before it is
 * committed. A write that fails for want of space, for another process's lock or an I/O
 * error drops nothing: the writer holds the batch and retries it until it commits,
 * store_flush and the synchronous writes report the failure (STORE_EFULL, STORE_EBUSY,
 * STORE_EIO), and store_get_health says why until writing works again.
 *
 * Threads: every function is thread-safe. Reads use one SQLite connection per calling
 * thread (opened on first use); the writer thread owns the write connection.
 *
 * Errors: functions return 0 or a negative STORE_E* code (store_strerror); messages go to
 * the host's log hook (store_set_log).
 * NaN metric values round-trip (SQLite turns NaN into NULL, so a per-row mask records
 * which fields were NaN); +-Inf are stored as they are.
 */
#ifndef AMPD_STORE_H
#define AMPD_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The error codes every function returns (0 on success), with their strerror text. */
#define STORE_ERRORS(X)                                                                            \
    X(STORE_ENOTFOUND, -101, "not found")                                                          \
    X(STORE_ECONFLICT, -102, "conflict (wrong state for the operation, or a duplicate)")          \
    X(STORE_EIO, -103, "database error")                                                           \
    X(STORE_EINVAL, -104, "invalid argument")                                                      \
    X(STORE_EFULL, -105, "the disk is full")                                                       \
    X(STORE_EBUSY, -106, "the database is locked by another process")
#define STORE_ERR_ENUM_(name, val, msg) name = (val),
enum { STORE_ERRORS(STORE_ERR_ENUM_) };
#undef STORE_ERR_ENUM_

/* "not found", ...; "unknown error" for any other value. */
const char *store_strerror(int code);

/* Where the store's messages go (SQLite's way, as SQLITE_CONFIG_LOG): the store never
 * writes to stderr itself; what it has to say beyond its return codes (the SQLite error
 * behind a STORE_EIO, a migration, an eval result dropped, a batch lost) reaches fn(arg,
 * level, func, message), from any of the store's threads. NULL (the default) drops them.
 * Process-wide; install it before store_open. */
typedef enum {
    STORE_LOG_DEBUG = 0,
    STORE_LOG_INFO,
    STORE_LOG_WARN,
    STORE_LOG_ERROR
} store_log_level;
typedef void (*store_log_fn)(void *arg, int level, const char *func, const char *msg);
void store_set_log(store_log_fn fn, void *arg);
/* Format a message for the installed hook (nothing happens without one). The modules built
 * on the store (api/) report through it too, so a host installs one hook for both. */
void store_log(int level, const char *func, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

typedef struct store store; /* opaque */

/* A job's statuses, one table: the enum, the names the database and the API use, and the
 * lists the API prints are generated from it. preempted: stopped at a checkpoint for a job
 * of higher priority, waiting in the queue to resume; paused: stopped by hand at a
 * checkpoint, out of the queue until unpaused. */
#define STORE_STATUSES(X)                                                                          \
    X(STORE_QUEUED, "queued")                                                                      \
    X(STORE_RUNNING, "running")                                                                    \
    X(STORE_SUCCEEDED, "succeeded")                                                                \
    X(STORE_FAILED, "failed")                                                                      \
    X(STORE_CANCELLED, "cancelled")                                                                \
    X(STORE_INTERRUPTED, "interrupted")                                                            \
    X(STORE_PREEMPTED, "preempted")                                                                \
    X(STORE_PAUSED, "paused")                                                                      \
    X(STORE_BRANCHED, "branched")
#define STORE_STATUS_ENUM_(id, name) id,
typedef enum { STORE_STATUSES(STORE_STATUS_ENUM_) STORE_NSTATUS } store_status;
#undef STORE_STATUS_ENUM_

const char *store_status_name(store_status s); /* "queued", ... */
int store_status_parse(const char *name, store_status *out);
bool store_status_finished(store_status s); /* succeeded, failed, cancelled or branched */
bool store_status_waiting(store_status s); /* queued or preempted: in the scheduler's queue */
bool store_status_active(store_status s);  /* waiting or running: not deletable */

/* Open (creating if needed) the database at path, check it (PRAGMA quick_check: a damaged
 * file is refused with STORE_EIO, SQLite's findings in the log), run migrations, start the
 * writer.
 * ":memory:" is not allowed (readers need their own connections); use a temp file.
 * Caller closes with store_close(). */
int store_open(const char *path, store **out);
/* Flush the writer, stop it and close every connection. NULL is accepted. */
void store_close(store *s);
/* Wait until everything queued so far is committed: 0. When the writer cannot commit it
 * (store_get_health), the code of its failed attempt (STORE_EFULL, STORE_EBUSY, STORE_EIO)
 * instead, without waiting for its next one: at once when the writer was already failing,
 * else when its current attempt fails (at most the busy timeout, 5 s). Nothing queued is
 * dropped: the writer keeps retrying, and a later flush succeeds once it has committed. */
int store_flush(store *s);
/* The schema version this ampd writes (a database of a higher one is refused). */
int store_schema_version(void);

/* ---- jobs ------------------------------------------------------------------------------- */

typedef struct {
    int64_t id;
    char name[128];
    char dtype[8];
    store_status status;
    double created_at, started_at, finished_at; /* unix seconds; 0 when not yet */
    int64_t steps;           /* the job's total steps */
    int64_t step;            /* last step recorded */
    int64_t checkpoint_step; /* last checkpoint (0: none) */
    int64_t checkpoint_bytes; /* the bytes of its checkpoints (their files' sizes) */
    int retries;             /* restarts after interruption or crash */
    bool cancel_requested;
    char *spec;              /* canonical spec JSON (heap) */
    char *summary;           /* summary JSON or NULL (heap) */
    char *error;             /* failure reason or NULL (heap) */
    char *launch;            /* how its ranks were launched (JSON object) or NULL (heap) */
    int64_t parent_id;       /* the job it was branched from (0: not a branch) */
    char *branch;            /* a branch's record (JSON object: parent, step, reason, patch)
                              * or NULL (heap) */
} store_job;

/* Release the heap strings of j (not j itself). */
void store_job_clear(store_job *j);

/* Insert a queued job. idem_key (may be NULL) makes the submit idempotent: a second
 * insert with the same key returns the first job's id with *existed = true. */
int store_job_insert(store *s, const char *name, const char *dtype, int64_t steps,
                     const char *spec_json, const char *idem_key, int64_t *id,
                     bool *existed);
/* Insert a queued job that is a branch of job parent_id (its record branch_json, a JSON
 * object), in one statement: the job is never seen without its lineage. */
int store_job_insert_branch(store *s, const char *name, const char *dtype, int64_t steps,
                            const char *spec_json, int64_t parent_id, const char *branch_json,
                            int64_t *id);
/* The ids of the jobs branched from job id, oldest first (*ids: heap, free(); NULL when
 * n is 0). */
int store_job_branches(store *s, int64_t id, int64_t **ids, int *n);
/* Fill *out (caller clears with store_job_clear). STORE_ENOTFOUND when absent. */
int store_job_get(store *s, int64_t id, store_job *out);

typedef struct {
    int status;        /* -1: any */
    const char *dtype; /* NULL: any */
    const char *name;  /* NULL: any; exact match */
    int64_t after;     /* keyset cursor: ids below this (newest first); 0: from the top */
    int limit;         /* 1..1000 */
} store_job_filter;

/* Jobs newest first. *out is a heap array of *n jobs; free with store_jobs_free(). */
int store_job_list(store *s, const store_job_filter *f, store_job **out, int *n);
void store_jobs_free(store_job *jobs, int n);

/* State changes. set_status stamps started_at (running) or finished_at (finished states)
 * and stores error (NULL clears it). STORE_ENOTFOUND when the job is gone. */
int store_job_set_status(store *s, int64_t id, store_status st, const char *error);
int store_job_set_summary(store *s, int64_t id, const char *summary_json);
/* Replace the job's effective spec (the scheduler does, when a job's priority changes). */
int store_job_set_spec(store *s, int64_t id, const char *spec_json);
/* What the launcher last said of the job's ranks (a JSON object; NULL clears it). */
int store_job_set_launch(store *s, int64_t id, const char *launch_json);
int store_job_set_checkpoint(store *s, int64_t id, int64_t step);
int store_job_set_cancel(store *s, int64_t id, bool requested);
int store_job_set_retries(store *s, int64_t id, int retries);
/* Delete the job and every row that belongs to it. */
int store_job_delete(store *s, int64_t id);
/* Ids of jobs in status st, oldest first (heap array, free()). */
int store_job_ids(store *s, store_status st, int64_t **ids, int *n);

/* ---- metrics and events (queued to the writer) ------------------------------------------ */

/* The step-metric fields: the one list that every layer is generated from (the worker's
 * JSON lines and the daemon's reading of them in daemon/, the store's columns, statements
 * and migrations, the API's field names, the CSV header and the SSE replay). One row per
 * field: X(ID, name, line, type, src, since)
 *   ID     STORE_M_<ID>, the field's number (its position)
 *   name   the column, the JSON key in the worker's line and the API's name
 *   line   the worker line that carries it: STEP (a "step" line) or EVAL (an "eval" line)
 *   type   its JSON form: NUM (a double; non-finite values as "NaN", "Infinity",
 *          "-Infinity"), FLOAT (a float as its shortest decimal), INT (an integer), BOOL
 *   src    the engine's value: a member of gpu_step_metrics (STEP) or gpu_eval_result
 *          (EVAL); only the worker (daemon/) expands it
 *   since  the schema version whose migration adds its columns (1: the first schema)
 * Append-only: a field's number is its bit in the masks of rows already stored, so a new
 * field goes at the end, with `since` one above the newest schema version (the migration
 * that adds its columns is generated from this row). */
#define STORE_METRICS(X)                                                                           \
    X(LOSS, loss, STEP, NUM, loss, 1)                                                              \
    X(LR, lr, STEP, FLOAT, lr, 1)                                                                  \
    X(LOSS_SCALE, loss_scale, STEP, FLOAT, loss_scale, 1)                                          \
    X(OVERFLOW, overflow, STEP, BOOL, overflow, 1)                                                 \
    X(SKIPPED, skipped, STEP, BOOL, skipped, 1)                                                    \
    X(OVERFLOW_TOTAL, overflow_total, STEP, INT, overflow_total, 1)                                \
    X(SKIPPED_TOTAL, skipped_total, STEP, INT, skipped_total, 1)                                   \
    X(GRAD_NORM, grad_norm, STEP, NUM, grad_norm, 1)                                               \
    X(STEP_MS, step_ms, STEP, NUM, step_ms, 1)                                                     \
    X(SAMPLES_PER_S, samples_per_s, STEP, NUM, samples_per_s, 1)                                   \
    X(MEM_BYTES, mem_bytes, STEP, INT, mem.total, 1)                                               \
    X(PEAK_MEM_BYTES, peak_mem_bytes, STEP, INT, peak.total, 1)                                    \
    X(COMM_BYTES, comm_bytes, STEP, INT, comm_bytes, 1)                                            \
    X(COMM_MS, comm_ms, STEP, NUM, comm_ms, 1)                                                     \
    X(EVAL_LOSS, eval_loss, EVAL, NUM, loss, 1)                                                    \
    X(EVAL_ACC, eval_acc, EVAL, NUM, accuracy, 1)                                                  \
    X(TOKENS_PER_S, tokens_per_s, STEP, NUM, tokens_per_s, 3)                                      \
    X(LOST_UPDATES, lost_updates, STEP, INT, lost_updates, 3)                                      \
    X(COMM_EXPOSED_MS, comm_exposed_ms, STEP, NUM, comm_exposed_ms, 4)                             \
    X(STEP_MS_MAX, step_ms_max, STEP, NUM, step_ms_max, 4)                                         \
    X(SLOWEST_RANK, slowest_rank, STEP, INT, slowest_rank, 4)

#define STORE_M_ENUM_(id, name, line, type, src, since) STORE_M_##id,
enum { STORE_METRICS(STORE_M_ENUM_) STORE_M_NFIELDS };
#undef STORE_M_ENUM_

typedef enum { STORE_LINE_STEP = 0, STORE_LINE_EVAL } store_line;
typedef enum { STORE_TYPE_NUM = 0, STORE_TYPE_FLOAT, STORE_TYPE_INT, STORE_TYPE_BOOL } store_type;

/* A field's row of the table. */
typedef struct {
    const char *name;
    store_line line;
    store_type type;
    int since;
} store_metric_info;

/* The row of field (NULL outside [0, STORE_M_NFIELDS)). */
const store_metric_info *store_metric_field(int field);
/* "loss", "lr", ... (the column and API names); -1 from parse for an unknown name. */
const char *store_metric_name(int field);
int store_metric_parse(const char *name);

/* A value that is missing (not reported, or an eval field of a step without an eval), as
 * opposed to a NaN the run produced: a quiet NaN with its own payload, so it travels
 * through the double arrays of rows and points. store_is_missing() tells it apart from
 * any other NaN; arithmetic on it gives an ordinary NaN. The store keeps both as NULL and
 * tells them apart by the row's nf_mask. */
double store_missing(void);
bool store_is_missing(double v);

typedef struct {
    int64_t job_id;
    int rank;
    int64_t step;
    double v[STORE_M_NFIELDS]; /* NaN allowed; store_missing() for a value not reported */
    bool has_eval;             /* the EVAL fields are meaningful (else they are missing) */
} store_metric;

/* Queue one row (upsert on (job, rank, step): a resumed job rewrites its steps). */
int store_metric_append(store *s, const store_metric *m);
/* Queue an eval result for an existing (or later) step row: the EVAL fields of v
 * (STORE_M_NFIELDS values; the others are not read). */
int store_metric_eval(store *s, int64_t job, int rank, int64_t step, const double *v);
/* Queue an event. kind: "overflow", "skip", "scale", "lifecycle", "recommendation", ...
 * data_json may be NULL. */
int store_event_append(store *s, int64_t job, int64_t step, const char *kind,
                       const char *message, const char *data_json);
/* Delete metric rows (and rollups) and per-layer diagnostics with step > after_step (before
 * a resume). Synchronous: flushes the queue first. */
int store_metrics_truncate(store *s, int64_t job, int64_t after_step);
int store_checkpoint_add(store *s, int64_t job, int64_t step, const char *path, int64_t bytes);
/* Remove the checkpoint row of (job, step) and its stream row (a checkpoint the retention
 * dropped, or one found missing or damaged); STORE_ENOTFOUND when there is none. */
int store_checkpoint_delete(store *s, int64_t job, int64_t step);

/* ---- reads ------------------------------------------------------------------------------ */

/* One point of a series: a raw step (count == 1) or a bucket of steps. For every
 * requested field: min, max and last (the value at step_last). flags: what happened in
 * the bucket. Buckets never hide an overflow, skipped or NaN step: such a step is
 * always also returned as its own raw point. */
#define STORE_F_OVERFLOW 1u
#define STORE_F_SKIPPED 2u
#define STORE_F_NONFINITE 4u
typedef struct {
    int64_t step_first, step_last, count;
    unsigned flags;
    double *min, *max, *last; /* nfields each, inside the series' storage */
} store_point;

typedef struct {
    int nfields;
    int fields[STORE_M_NFIELDS];
    int npoints;
    store_point *points; /* ordered by step_first */
    double *values;      /* storage of min/max/last */
    int64_t total_steps; /* rows in [from, to] */
} store_series;

/* The series of job (rank 0) for fields over [from, to] (inclusive; to < 0: the end).
 * points <= 0: every raw row. Otherwise at most about `points` buckets of equal step width
 * plus the raw special steps. Caller frees with store_series_free(). */
int store_series_query(store *s, int64_t job, const int *fields, int nfields, int64_t from,
                       int64_t to, int points, store_series *out);
void store_series_free(store_series *se);

typedef struct {
    int64_t id, job_id, step;
    double ts;
    char kind[32];
    char *message, *data; /* heap */
} store_event;
/* Events of a job with id > after, oldest first, at most limit. */
int store_event_list(store *s, int64_t job, int64_t after, int limit, store_event **out,
                     int *n);
void store_events_free(store_event *ev, int n);

typedef struct {
    int64_t step, bytes;
    double created_at;
    char path[512];
} store_checkpoint;
int store_checkpoint_list(store *s, int64_t job, store_checkpoint **out, int *n); /* free() */

/* The stream: one row per message of a job's SSE stream, numbered (seq, increasing over
 * the whole store) in the order the store took the data in. The writer adds a row with
 * each rank-0 metric row (step) and eval result (eval), diagnosed step (layers) and event;
 * store_checkpoint_add adds a checkpoint row and store_job_set_status an end row when the
 * job finishes (after the queue is flushed, so it is the last). A truncate (a resume)
 * removes the step, eval and layers rows past its step; the rerun steps come again with
 * new numbers. The rows hold no data: a reader builds each message from the row it names
 * (the metric row of `step`, the event `ref`, ...), so a message read live and one read
 * long after are the same. */
typedef enum {
    STORE_SM_STEP = 0,
    STORE_SM_EVAL,
    STORE_SM_LAYERS,
    STORE_SM_CHECKPOINT,
    STORE_SM_EVENT,
    STORE_SM_END
} store_stream_kind;
typedef struct {
    int64_t seq, step, ref; /* ref: the event's id (STORE_SM_EVENT), else 0 */
    store_stream_kind kind;
} store_stream_row;
/* Up to limit (1..100000) rows of job with seq > after, in seq order; *out is heap (free()),
 * NULL when *n is 0. */
int store_stream_read(store *s, int64_t job, int64_t after, int limit, store_stream_row **out,
                      int *n);
/* Where a reader that already has the steps up to `step` (and the job's state) starts: the
 * seq of job's newest step row with a step <= step, or of its latest end row when that
 * is later (the end of a run the job was resumed from); 0 when there is neither. */
int store_stream_at_step(store *s, int64_t job, int64_t step, int64_t *seq);
/* Wait until the store has committed a change since *seen (0: any), at most timeout_ms;
 * *seen becomes the current change count. Returns true when something changed. */
bool store_wait_commit(store *s, uint64_t *seen, int timeout_ms);

/* Latest metric row of a job (rank 0); STORE_ENOTFOUND when none. */
int store_metric_latest(store *s, int64_t job, store_metric *out);

/* ---- experiments (experiment.c) ------------------------------------------------------- */

/* An experiment is a named group of jobs, each in an arm (the runs of one precision or
 * variant, one per seed), compared arm by arm against its baseline arm (docs/api.md,
 * "Experiments"). The jobs are ordinary jobs; the group only names them. Deleting a job
 * takes it out of every group; deleting a group leaves its jobs (the caller deletes them
 * first when it wants them gone). */
#define STORE_ARM_MAX 32 /* arm labels are shorter than this */
typedef struct {
    int64_t job_id;
    char arm[STORE_ARM_MAX];
    int64_t seed;
    store_status status; /* the job's, filled by the reads */
} store_member;

typedef struct {
    int64_t id;
    char name[128];
    char baseline[STORE_ARM_MAX];
    double created_at;
    char *request;         /* the JSON it was created from (heap) or NULL */
    int nmembers;
    store_member *members; /* heap, in the order they were given */
} store_experiment;

/* Insert an experiment with its n members (1..STORE_EXP_MEMBERS_MAX, jobs that exist, each
 * once) in one transaction. STORE_EINVAL for a name, arm or baseline that does not fit or
 * a bad count; STORE_ECONFLICT for a job given twice; STORE_ENOTFOUND for a job that is
 * not there (nothing is inserted then). */
#define STORE_EXP_MEMBERS_MAX 256
int store_experiment_create(store *s, const char *name, const char *baseline,
                            const char *request_json, const store_member *m, int n, int64_t *id);
/* Fill *out (caller clears with store_experiment_clear). STORE_ENOTFOUND when absent. */
int store_experiment_get(store *s, int64_t id, store_experiment *out);
/* Experiments newest first with ids below after (0: from the top), at most limit (1..1000);
 * *out heap (store_experiments_free). */
int store_experiment_list(store *s, int64_t after, int limit, store_experiment **out, int *n);
void store_experiment_clear(store_experiment *e); /* NULL accepted */
void store_experiments_free(store_experiment *e, int n);
/* Delete the group (its jobs stay). STORE_ENOTFOUND when absent. */
int store_experiment_delete(store *s, int64_t id);

/* The eval results of job (rank 0) in step order: *out heap (free()) of *n. A field the
 * eval did not report is store_missing(); a NaN it reported is NaN. */
typedef struct {
    int64_t step;
    double loss, acc;
} store_eval;
int store_eval_list(store *s, int64_t job, store_eval **out, int *n);
/* The newest event of job of the given kind as a heap array of one (store_events_free(*out,
 * 1)); STORE_ENOTFOUND when there is none. */
int store_event_last(store *s, int64_t job, const char *kind, store_event **out);

/* ---- per-layer diagnostics ------------------------------------------------------------ */

/* A diagnosed step (every diagnostics_every steps and every overflow step) has one row per
 * layer (in the model's order) and one step record (the loss scale and which layer first
 * produced inf/NaN). The fields of a layer row, in this order, as X(ID, name, kind, since):
 * kind REAL (a real) or COUNT (an integer count); since the schema version that added its
 * column. The one list: the STORE_L_ enum, the store's columns and names, the worker's
 * "layers" line and the API's field names come from it. The fp8 fields are an fp8 layer's
 * (docs/fp8.md), per operand: in (its input), w (its weight), grad (its output gradient);
 * amax NaN-aware, the scale its cast used, headroom log2(fp8 max / (amax x scale)), the
 * fractions of the values that saturated and of the non-zero ones that became 0. */
#define STORE_LAYER_FP8(X, R, r)                                                                   \
    X(FP8_##R##_AMAX, fp8_##r##_amax, REAL, 9)                                                     \
    X(FP8_##R##_SCALE, fp8_##r##_scale, REAL, 9)                                                   \
    X(FP8_##R##_HEADROOM, fp8_##r##_headroom, REAL, 9)                                             \
    X(FP8_##R##_SATURATED, fp8_##r##_saturated, REAL, 9)                                           \
    X(FP8_##R##_UNDERFLOW, fp8_##r##_underflow, REAL, 9)
#define STORE_LAYER_FIELDS(X)                                                                      \
    X(ACT_AMAX, act_amax, REAL, 2)         /* max |forward output| before rounding */              \
    X(ACT_HEADROOM, act_headroom, REAL, 2) /* dtype max / act_amax (+Inf when act_amax is 0) */    \
    X(ACT_OVERFLOW, act_overflow, COUNT, 2) /* outputs that became inf/NaN when rounded */         \
    X(GRAD_AMAX, grad_amax, REAL, 2)       /* max |weight gradient|, unscaled */                   \
    X(GRAD_UNDERFLOW, grad_underflow, REAL, 2) /* fraction flushed to 0 at the scale */          \
    X(GRAD_UNDERFLOW_UNSCALED, grad_underflow_unscaled, REAL, 2) /* ... without loss scaling */    \
    X(GRAD_NONFINITE, grad_nonfinite, COUNT, 2) /* gradient elements that were inf/NaN */          \
    X(LOST_UPDATES, lost_updates, REAL, 2) /* fraction of weight updates that rounded away */      \
    STORE_LAYER_FP8(X, IN, in) STORE_LAYER_FP8(X, W, w) STORE_LAYER_FP8(X, GRAD, grad)
enum {
#define STORE_L_ENUM_(id, name, ...) STORE_L_##id,
    STORE_LAYER_FIELDS(STORE_L_ENUM_)
#undef STORE_L_ENUM_
    STORE_L_NFIELDS
};
/* "act_amax", ... (the column and API names); -1 from parse for an unknown name. */
const char *store_layer_field_name(int field);
int store_layer_field_parse(const char *name);

#define STORE_LAYER_NAME_MAX 64 /* layer names are shorter than this */
#define STORE_LAYERS_MAX 4096   /* layer rows per step */

typedef struct {
    char name[STORE_LAYER_NAME_MAX]; /* "fc1", "blocks.3.mlp.fc", ... */
    char dtype[8];                   /* the op's compute dtype: "fp16", "bf16", "fp32" */
    double v[STORE_L_NFIELDS];       /* NaN and +-Inf round-trip */
    unsigned missing;                /* bit i: field i was not reported (v[i] is NaN) */
} store_layer_stat;

/* What a diagnosed step says besides its rows. flags is computed by the append (callers'
 * values are ignored): STORE_LS_NONFINITE when a layer reported a non-finite amax or
 * gradient elements, or first_layer is set; STORE_LS_OVERFLOW when a layer's forward output
 * overflowed (act_overflow > 0). */
#define STORE_LS_NONFINITE 1u
#define STORE_LS_OVERFLOW 2u
typedef struct {
    double scale;                           /* the loss scale of the step (NaN: unknown) */
    char first_layer[STORE_LAYER_NAME_MAX]; /* first layer to produce inf/NaN; "" if none */
    char first_where[16];                   /* "forward", "backward", "comm"; "" if none */
    unsigned flags;
} store_layer_info;

/* Queue the n rows of a diagnosed step of job (info may be NULL: scale unknown, no
 * first_nonfinite). Committed by the writer in the same batched transactions as metrics;
 * upsert on (job, step, layer index): a step written again replaces its rows (and rows
 * past the new n are removed). Rows are copied. STORE_EINVAL for step < 0, n outside
 * [0, STORE_LAYERS_MAX], or a name or dtype that does not fit. */
int store_layer_stats_append(store *s, int64_t job, int64_t step, const store_layer_info *info,
                             const store_layer_stat *rows, int n);
/* The rows of job at step (step < 0: the latest diagnosed step), in layer order, as a heap
 * array (free()) of *n; *step_out gets the step and *info (may be NULL) its record.
 * STORE_ENOTFOUND when that step (or, for the latest, any step) has no stats. */
int store_layer_stats_get(store *s, int64_t job, int64_t step, store_layer_stat **rows, int *n,
                          int64_t *step_out, store_layer_info *info);

/* A heatmap over steps: the chosen fields of every layer at the diagnosed steps in
 * [from, to]. Layers are identified by name, in the order they first appear. A cell is
 * absent (has == 0) when the layer had no row at that step or did not report the field. */
typedef struct {
    char name[STORE_LAYER_NAME_MAX];
    char dtype[8];
} store_layer_name;

typedef struct {
    int64_t total_steps; /* diagnosed steps in [from, to] */
    int nsteps, nlayers, nfields;
    int fields[STORE_L_NFIELDS];
    int64_t *steps;           /* nsteps, increasing */
    store_layer_info *info;   /* nsteps */
    store_layer_name *layers; /* nlayers */
    double *values;           /* [layer][field index][step]: STORE_LR_AT */
    unsigned char *has;       /* same layout: 1 when the value is present */
} store_layer_range;
/* The index of layer l, field fields[f] and step steps[k] in values and has. */
#define STORE_LR_AT(r, l, f, k)                                                                    \
    (((size_t)(l) * (size_t)(r)->nfields + (size_t)(f)) * (size_t)(r)->nsteps + (size_t)(k))

/* Fill *out (free with store_layer_range_free) for job over [from, to] (to < 0: the end)
 * with the fields[0..nfields) (STORE_L_*, no duplicates). When more than max_steps (>= 1)
 * steps were diagnosed they are subsampled evenly, always keeping the steps flagged
 * STORE_LS_NONFINITE or STORE_LS_OVERFLOW; when those alone are more than max_steps, they
 * are the ones subsampled evenly. STORE_EINVAL for bad arguments and for an answer of more
 * than STORE_LR_MAX_CELLS values (ask for fewer steps or fields). */
#define STORE_LR_MAX_CELLS (1 << 22)
int store_layer_stats_range(store *s, int64_t job, int64_t from, int64_t to, int max_steps,
                            const int *fields, int nfields, store_layer_range *out);
void store_layer_range_free(store_layer_range *r); /* NULL accepted */

/* ---- the writer's health ----------------------------------------------------------------- */

/* The writer's queue: an append waits while STORE_QUEUE_MAX items wait for the writer. A
 * host that feeds the store from a producer it can pause (the scheduler and its workers'
 * pipes) stops feeding while more than STORE_QUEUE_HIGH wait or the store cannot write, so
 * that an append never has to wait. */
#define STORE_QUEUE_MAX (1 << 18)
#define STORE_QUEUE_HIGH (1 << 14)

/* Whether the store can write. A batch the writer cannot commit (the disk is full, another
 * process holds the database's write lock, an I/O error) is never dropped: the writer keeps
 * it and retries with a backoff (100 ms doubling to STORE_RETRY_MAX_MS) until it commits,
 * while the queue behind it grows; a synchronous write that fails the same way makes the
 * writer try a write of its own, so that the state below is found out and cleared the same
 * way. Only store_close gives up on what is still held, after STORE_CLOSE_WAIT_S, and logs
 * the loss. */
#define STORE_RETRY_MAX_MS 2000
#define STORE_CLOSE_WAIT_S 5
typedef struct {
    int code;           /* 0: the writer's last attempt wrote; else why it did not:
                         * STORE_EFULL, STORE_EBUSY or STORE_EIO */
    const char *reason; /* "disk_full", "store_locked", "store_error"; NULL when code is 0 */
    char message[256];  /* the failure in words, with SQLite's message; "" when code is 0 */
    double since;       /* unix time of the first failed attempt (0 when code is 0) */
    int64_t held;       /* items queued and not yet committed (a batch being retried too) */
    int64_t failures;   /* failed write attempts since the store was opened */
} store_health;
/* Fill *out (all zero for a NULL store). */
void store_get_health(store *s, store_health *out);

/* A test hook, for tests only: from now on every write of the store (the writer's batches
 * and the synchronous writes) fails with code (STORE_EFULL, STORE_EBUSY or STORE_EIO), as
 * when the disk is full or another process holds the lock, until it is called with 0.
 * STORE_EINVAL for another code. */
int store_test_fault(store *s, int code);

/* Counters for /metrics and /v1/system. */
typedef struct {
    int64_t jobs_by_status[STORE_NSTATUS];
    int64_t metric_rows;   /* rows written since open */
    int64_t queue_depth;   /* rows waiting for the writer */
    int64_t batches;       /* transactions committed */
} store_stats;
void store_get_stats(store *s, store_stats *out);

#endif /* AMPD_STORE_H */
