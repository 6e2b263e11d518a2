/*
 * schema.c - the store's SQLite connections: opening them with their PRAGMAs, the
 * versioned migrations, and the SQL of every statement with a per-connection cache of
 * prepared statements.
 *
 * Migrations are an ordered array of steps; step i brings the schema from version i to
 * i + 1 and runs in one transaction together with the schema_version row that records it.
 * A database whose version is above the newest step comes from a newer ampd and is
 * refused. A step's SQL never changes once released: a new column or index is a new step.
 * The steps after the hand-written ones come from the metric-field table: version v adds
 * the columns of the fields whose `since` is v (a new metric needs no SQL of its own).
 *
 * Integrity: store_open runs PRAGMA quick_check (every page and index entry read once, the
 * indexes' contents against their tables not compared: that is integrity_check, several
 * times slower) before the migrations, so that a damaged file is refused at start rather
 * than failing the writes of new jobs. It reads the whole file: on a 1 GB database (6.3M
 * metric rows, bench/store_ingest) it takes 4-8 s from the page cache and 22 s from a cold
 * disk on a 2-core machine, so it is bounded by STORE_CHECK_MAX_S; a check that took more
 * than a second says how long in the log.
 *
 * Statements: every statement's text is a constant in this file (the column lists are
 * spelled from store.h's STORE_METRICS table at compile time); values only ever reach SQL as
 * bound parameters. Each connection prepares a statement on first use with
 * SQLITE_PREPARE_PERSISTENT and keeps it until the connection closes.
 *
 * Threads: a store_conn is used by one thread at a time (the caller's lock or thread).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store/store_int.h"

/* ---- migrations --------------------------------------------------------------------------- */

static const char *const migration_1[] = {
    "CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, "
    "dtype TEXT NOT NULL, status TEXT NOT NULL, created_at REAL NOT NULL, started_at REAL, "
    "finished_at REAL, steps INTEGER NOT NULL, step INTEGER NOT NULL DEFAULT 0, "
    "checkpoint_step INTEGER NOT NULL DEFAULT 0, retries INTEGER NOT NULL DEFAULT 0, "
    "cancel_requested INTEGER NOT NULL DEFAULT 0, spec TEXT NOT NULL, summary TEXT, "
    "error TEXT, idem_key TEXT UNIQUE)",
    "CREATE INDEX jobs_status ON jobs(status, id)",
    /* nan_mask: bit i = field i was NaN (SQLite stores NaN as NULL; a NULL without its bit
     * is an absent eval value). nf_mask: bit i = field i was NaN or +-Inf. special: see
     * store_int.h. */
    "CREATE TABLE metrics (job_id INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE, "
    "rank INTEGER NOT NULL, step INTEGER NOT NULL, "
    "loss REAL, lr REAL, loss_scale REAL, overflow REAL, skipped REAL, "
    "overflow_total REAL, skipped_total REAL, grad_norm REAL, step_ms REAL, "
    "samples_per_s REAL, mem_bytes REAL, peak_mem_bytes REAL, comm_bytes REAL, "
    "comm_ms REAL, eval_loss REAL, eval_acc REAL, "
    "nan_mask INTEGER NOT NULL DEFAULT 0, nf_mask INTEGER NOT NULL DEFAULT 0, "
    "special INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (job_id, rank, step)) WITHOUT ROWID",
    "CREATE INDEX metrics_special ON metrics(job_id, rank, step) WHERE special != 0",
    "CREATE TABLE metrics_rollup (job_id INTEGER NOT NULL REFERENCES jobs(id) "
    "ON DELETE CASCADE, rank INTEGER NOT NULL, level INTEGER NOT NULL, "
    "bucket INTEGER NOT NULL, step_first INTEGER NOT NULL, step_last INTEGER NOT NULL, "
    "count INTEGER NOT NULL, flags INTEGER NOT NULL, nf_mask INTEGER NOT NULL, "
    "loss_min REAL, loss_max REAL, loss_last REAL, lr_min REAL, lr_max REAL, "
    "lr_last REAL, loss_scale_min REAL, loss_scale_max REAL, loss_scale_last REAL, "
    "overflow_min REAL, overflow_max REAL, overflow_last REAL, skipped_min REAL, "
    "skipped_max REAL, skipped_last REAL, overflow_total_min REAL, "
    "overflow_total_max REAL, overflow_total_last REAL, skipped_total_min REAL, "
    "skipped_total_max REAL, skipped_total_last REAL, grad_norm_min REAL, "
    "grad_norm_max REAL, grad_norm_last REAL, step_ms_min REAL, step_ms_max REAL, "
    "step_ms_last REAL, samples_per_s_min REAL, samples_per_s_max REAL, "
    "samples_per_s_last REAL, mem_bytes_min REAL, mem_bytes_max REAL, "
    "mem_bytes_last REAL, peak_mem_bytes_min REAL, peak_mem_bytes_max REAL, "
    "peak_mem_bytes_last REAL, comm_bytes_min REAL, comm_bytes_max REAL, "
    "comm_bytes_last REAL, comm_ms_min REAL, comm_ms_max REAL, comm_ms_last REAL, "
    "eval_loss_min REAL, eval_loss_max REAL, eval_loss_last REAL, eval_acc_min REAL, "
    "eval_acc_max REAL, eval_acc_last REAL, "
    "PRIMARY KEY (job_id, rank, level, bucket)) WITHOUT ROWID",
    "CREATE TABLE layer_stats (job_id INTEGER NOT NULL REFERENCES jobs(id) "
    "ON DELETE CASCADE, step INTEGER NOT NULL, layer INTEGER NOT NULL, name TEXT NOT NULL, "
    "act_amax REAL, act_headroom REAL, grad_amax REAL, grad_amax_scaled REAL, "
    "grad_underflow REAL, grad_underflow_unscaled REAL, "
    "nonfinite INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (job_id, step, layer)) WITHOUT ROWID",
    "CREATE TABLE events (id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL REFERENCES "
    "jobs(id) ON DELETE CASCADE, step INTEGER NOT NULL, ts REAL NOT NULL, "
    "kind TEXT NOT NULL, message TEXT NOT NULL, data TEXT)",
    "CREATE INDEX events_job ON events(job_id, id)",
    "CREATE TABLE checkpoints (job_id INTEGER NOT NULL REFERENCES jobs(id) "
    "ON DELETE CASCADE, step INTEGER NOT NULL, path TEXT NOT NULL, "
    "bytes INTEGER NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (job_id, step)) "
    "WITHOUT ROWID",
    NULL};

/* Version 2: per-layer diagnostics. Version 1's layer_stats was a placeholder that no
 * ampd ever wrote to, so it is replaced rather than altered. layer_stats.nan_mask: bit i =
 * field i was NaN (NULL without its bit: the field was not reported). layer_steps: one row
 * per diagnosed step (flags: STORE_LS_*; first_layer/first_where NULL when no layer
 * produced inf/NaN). */
static const char *const migration_2[] = {
    "DROP TABLE layer_stats",
    "CREATE TABLE layer_stats (job_id INTEGER NOT NULL REFERENCES jobs(id) "
    "ON DELETE CASCADE, step INTEGER NOT NULL, layer INTEGER NOT NULL, name TEXT NOT NULL, "
    "dtype TEXT NOT NULL, act_amax REAL, act_headroom REAL, act_overflow REAL, "
    "grad_amax REAL, grad_underflow REAL, grad_underflow_unscaled REAL, "
    "grad_nonfinite REAL, lost_updates REAL, nan_mask INTEGER NOT NULL DEFAULT 0, "
    "PRIMARY KEY (job_id, step, layer)) WITHOUT ROWID",
    "CREATE TABLE layer_steps (job_id INTEGER NOT NULL REFERENCES jobs(id) "
    "ON DELETE CASCADE, step INTEGER NOT NULL, scale REAL, nlayers INTEGER NOT NULL, "
    "flags INTEGER NOT NULL DEFAULT 0, first_layer TEXT, first_where TEXT, "
    "PRIMARY KEY (job_id, step)) WITHOUT ROWID",
    NULL};

/* Version 5: the stream, one row per message of a job's SSE stream in the order the store
 * took them in (seq); kind is a store_stream_kind, ref the event's id for an event. The
 * jobs recorded before it get their rows in (step, kind) order. */
static const char *const migration_5[] = {
    "CREATE TABLE stream (seq INTEGER PRIMARY KEY, job_id INTEGER NOT NULL REFERENCES "
    "jobs(id) ON DELETE CASCADE, step INTEGER NOT NULL, kind INTEGER NOT NULL, ref INTEGER)",
    "CREATE INDEX stream_job ON stream(job_id, seq)",
    "CREATE INDEX stream_step ON stream(job_id, kind, step)",
    "INSERT INTO stream(job_id, step, kind, ref) SELECT job_id, step, kind, ref FROM ("
    "SELECT job_id, step, 0 AS kind, NULL AS ref FROM metrics WHERE rank=0 "
    "UNION ALL SELECT job_id, step, 1, NULL FROM metrics WHERE rank=0 AND "
    "(eval_loss IS NOT NULL OR eval_acc IS NOT NULL) "
    "UNION ALL SELECT job_id, step, 2, NULL FROM layer_steps "
    "UNION ALL SELECT job_id, step, 3, NULL FROM checkpoints "
    "UNION ALL SELECT job_id, step, 4, id FROM events "
    "UNION ALL SELECT id, step, 5, NULL FROM jobs WHERE status IN "
    "('succeeded', 'failed', 'cancelled')) ORDER BY job_id, step, kind, ref",
    NULL};

/* Version 6: experiments, named groups of jobs compared arm by arm (an arm: the runs of one
 * precision or variant, one per seed). baseline is the arm the others are compared with;
 * request the JSON it was created from. A member row goes with its job (ON DELETE CASCADE)
 * and with its experiment. */
static const char *const migration_6[] = {
    "CREATE TABLE experiments (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, "
    "created_at REAL NOT NULL, baseline TEXT NOT NULL, request TEXT)",
    "CREATE TABLE experiment_jobs (experiment_id INTEGER NOT NULL REFERENCES experiments(id) "
    "ON DELETE CASCADE, job_id INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE, "
    "arm TEXT NOT NULL, seed INTEGER NOT NULL, position INTEGER NOT NULL, "
    "PRIMARY KEY (experiment_id, job_id)) WITHOUT ROWID",
    "CREATE INDEX experiment_jobs_job ON experiment_jobs(job_id)",
    NULL};

/* Version 7: how a job's ranks were launched, as the launcher last reported it (a JSON
 * object: the launcher, Slurm's job id, state, reason and nodes, every rank's host). */
static const char *const migration_7[] = {"ALTER TABLE jobs ADD COLUMN launch TEXT", NULL};

/* Version 8: a branch's lineage: the job it was branched from (parent_id, indexed for the
 * parent's list of branches) and what the branch is (a JSON object: the parent, the step of
 * the checkpoint it starts from, the reason and the spec patch). */
static const char *const migration_8[] = {"ALTER TABLE jobs ADD COLUMN parent_id INTEGER",
                                          "ALTER TABLE jobs ADD COLUMN branch TEXT",
                                          "CREATE INDEX jobs_parent ON jobs(parent_id)", NULL};

/* The hand-written steps. The versions without one add only the columns of the fields
 * whose `since` names them (store.h's STORE_METRICS and STORE_LAYER_FIELDS); a new field
 * takes a version above every version here. */
static const struct {
    int version;
    const char *const *sql;
} migrations[] = {{1, migration_1}, {2, migration_2}, {5, migration_5},
                  {6, migration_6}, {7, migration_7}, {8, migration_8}};
#define NMIGRATIONS ((int)(sizeof(migrations) / sizeof(migrations[0])))

/* The schema version that added each layer field's column (STORE_LAYER_FIELDS). */
#define LSINCE_(id, f, kind, since) since,
static const int layer_since[STORE_L_NFIELDS] = {STORE_LAYER_FIELDS(LSINCE_)};

int store_schema_version(void)
{
    int v = migrations[NMIGRATIONS - 1].version;
    for (int i = 0; i < STORE_M_NFIELDS; i++)
        if (store_metric_field(i)->since > v)
            v = store_metric_field(i)->since;
    for (int i = 0; i < STORE_L_NFIELDS; i++)
        v = layer_since[i] > v ? layer_since[i] : v;
    return v;
}

/* ---- statements --------------------------------------------------------------------------- */

/* Column lists spelled from the field table (store.h's STORE_METRICS), one macro per list;
 * each takes a table row (id, name, line, type, src, since). */
#define COL_(id, f, ...) #f ","
#define Q_(...) "?,"
#define RCOL_(id, f, ...) #f "_min," #f "_max," #f "_last,"
#define RQ_(...) "?,?,?,"
#define RSET_(id, f, ...)                                                                          \
    #f "_min=excluded." #f "_min," #f "_max=excluded." #f "_max," #f "_last=excluded." #f "_last,"
#define PCOL_(id, f, ...) "," #f
#define PRCOL_(id, f, ...) "," #f "_min," #f "_max," #f "_last"
/* A step line's upsert overwrites its STEP fields and keeps the EVAL values the row already
 * has unless it brings its own; an eval result's update sets only the EVAL fields. */
#define SET_(id, f, line, ...) SET_##line(f)
#define SET_STEP(f) #f "=excluded." #f ","
#define SET_EVAL(f) #f "=CASE WHEN :has_eval THEN excluded." #f " ELSE " #f " END,"
#define EVSET_(id, f, line, ...) EVSET_##line(f)
#define EVSET_STEP(f)
#define EVSET_EVAL(f) #f "=?,"

#define LCOL_(id, f, ...) "," #f
#define LQ_(id, f, ...) ",?"
#define LSET_(id, f, ...) "," #f "=excluded." #f

#define RAW_COLS "step,special,nf_mask,nan_mask,rank" STORE_METRICS(PCOL_)
#define ROLLUP_COLS "bucket,step_first,step_last,count,flags,nf_mask" STORE_METRICS(PRCOL_)
#define JOB_COLS                                                                                   \
    "id,name,dtype,status,created_at,started_at,finished_at,steps,step,checkpoint_step,"           \
    "retries,cancel_requested,spec,summary,error,"                                                 \
    "(SELECT COALESCE(SUM(bytes), 0) FROM checkpoints WHERE checkpoints.job_id = jobs.id),launch," \
    "parent_id,branch"

/* clang-format off */
/* The fields ?1..?N, then the STORE_MU_ parameters (store_int.h) in the order they first
 * appear. Without an eval the row keeps the eval values (and their mask bits) it already
 * had. */
#define METRIC_UPSERT_SQL                                                                          \
    "INSERT INTO metrics(" STORE_METRICS(COL_) "job_id,rank,step,nan_mask,nf_mask,special) "       \
    "VALUES(" STORE_METRICS(Q_) ":job,:rank,:step,:nan,:nf,:special) "                             \
    "ON CONFLICT(job_id,rank,step) DO UPDATE SET " STORE_METRICS(SET_)                             \
    "nan_mask=CASE WHEN :has_eval THEN excluded.nan_mask "                                         \
    "ELSE excluded.nan_mask|(nan_mask&:eval_bits) END,"                                            \
    "nf_mask=CASE WHEN :has_eval THEN excluded.nf_mask "                                           \
    "ELSE excluded.nf_mask|(nf_mask&:eval_bits) END,"                                              \
    "special=(excluded.special&3)|CASE WHEN (CASE WHEN :has_eval THEN excluded.nf_mask "           \
    "ELSE excluded.nf_mask|(nf_mask&:eval_bits) END)!=0 THEN 4 ELSE 0 END"

/* The EVAL fields ?1..?k in field order, then the named parameters (bound by name). */
#define METRIC_EVAL_SQL                                                                            \
    "UPDATE metrics SET " STORE_METRICS(EVSET_)                                                    \
    "nan_mask=(nan_mask&~:eval_bits)|:nan, nf_mask=(nf_mask&~:eval_bits)|:nf, "                    \
    "special=(special&3)|CASE WHEN ((nf_mask&~:eval_bits)|:nf)!=0 THEN 4 ELSE 0 END "              \
    "WHERE job_id=:job AND rank=:rank AND step=:step"

/* Field i's min, max, last ?3i+1..?3i+3, then the STORE_RU_ parameters (store_int.h). */
#define ROLLUP_UPSERT_SQL                                                                          \
    "INSERT INTO metrics_rollup(" STORE_METRICS(RCOL_)                                             \
    "job_id,rank,level,bucket,step_first,step_last,count,flags,nf_mask) "                          \
    "VALUES(" STORE_METRICS(RQ_) ":job,:rank,:level,:bucket,:first,:last,:count,:flags,:nf) "      \
    "ON CONFLICT(job_id,rank,level,bucket) DO UPDATE SET " STORE_METRICS(RSET_)                    \
    "step_first=excluded.step_first,step_last=excluded.step_last,count=excluded.count,"            \
    "flags=excluded.flags,nf_mask=excluded.nf_mask"

/* job ?1, step ?2, layer ?3, name ?4, dtype ?5, nan_mask ?6, the fields from ?7 */
#define LAYER_UPSERT_SQL                                                                           \
    "INSERT INTO layer_stats(job_id,step,layer,name,dtype,nan_mask" STORE_LAYER_FIELDS(LCOL_)      \
    ") VALUES(?,?,?,?,?,?" STORE_LAYER_FIELDS(LQ_) ") ON CONFLICT(job_id,step,layer) DO UPDATE "   \
    "SET name=excluded.name,dtype=excluded.dtype,nan_mask=excluded.nan_mask"                       \
    STORE_LAYER_FIELDS(LSET_)
#define LAYER_GET_SQL                                                                              \
    "SELECT layer,name,dtype,nan_mask" STORE_LAYER_FIELDS(LCOL_) " FROM layer_stats "              \
    "WHERE job_id=?1 AND step=?2 ORDER BY layer"
/* clang-format on */

static const char *const stmt_sql[ST_COUNT] = {
    [ST_BEGIN] = "BEGIN",
    [ST_BEGIN_IMMEDIATE] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
    [ST_VERSION_GET] = "SELECT COALESCE(MAX(version), 0) FROM schema_version",
    [ST_VERSION_ADD] = "INSERT INTO schema_version(version, applied_at) VALUES(?1, ?2)",
    [ST_JOB_INSERT] = "INSERT INTO jobs(name, dtype, status, created_at, steps, spec, idem_key, "
                      "parent_id, branch) VALUES(?1, ?2, 'queued', ?3, ?4, ?5, ?6, ?7, ?8) "
                      "ON CONFLICT(idem_key) DO NOTHING",
    [ST_JOB_BRANCHES] = "SELECT id FROM jobs WHERE parent_id = ?1 ORDER BY id",
    [ST_JOB_BY_IDEM] = "SELECT id FROM jobs WHERE idem_key = ?1",
    [ST_JOB_GET] = "SELECT " JOB_COLS " FROM jobs WHERE id = ?1",
    [ST_JOB_LIST] = "SELECT " JOB_COLS " FROM jobs WHERE id < ?1 AND (?2 IS NULL OR status = ?2) "
                    "AND (?3 IS NULL OR dtype = ?3) AND (?4 IS NULL OR name = ?4) "
                    "ORDER BY id DESC LIMIT ?5",
    [ST_JOB_IDS] = "SELECT id FROM jobs WHERE status = ?1 ORDER BY id",
    /* ?4: stamp started_at; ?6: stamp finished_at; ?7: clear finished_at; ?5: now. */
    [ST_JOB_STATUS] = "UPDATE jobs SET status = ?2, error = ?3, "
                      "started_at = CASE WHEN ?4 THEN ?5 ELSE started_at END, "
                      "finished_at = CASE WHEN ?6 THEN ?5 WHEN ?7 THEN NULL ELSE finished_at END "
                      "WHERE id = ?1",
    [ST_JOB_SUMMARY] = "UPDATE jobs SET summary = ?2 WHERE id = ?1",
    [ST_JOB_SPEC] = "UPDATE jobs SET spec = ?2 WHERE id = ?1",
    [ST_JOB_LAUNCH] = "UPDATE jobs SET launch = ?2 WHERE id = ?1",
    [ST_JOB_CHECKPOINT] = "UPDATE jobs SET checkpoint_step = ?2 WHERE id = ?1",
    [ST_JOB_CANCEL] = "UPDATE jobs SET cancel_requested = ?2 WHERE id = ?1",
    [ST_JOB_RETRIES] = "UPDATE jobs SET retries = ?2 WHERE id = ?1",
    [ST_JOB_DELETE] = "DELETE FROM jobs WHERE id = ?1",
    [ST_JOB_STEP_MAX] = "UPDATE jobs SET step = MAX(step, ?2) WHERE id = ?1",
    [ST_JOB_STEP_MIN] = "UPDATE jobs SET step = MIN(step, ?2) WHERE id = ?1",
    [ST_JOB_COUNTS] = "SELECT status, COUNT(*) FROM jobs GROUP BY status",
    [ST_METRIC_UPSERT] = METRIC_UPSERT_SQL,
    [ST_METRIC_EVAL] = METRIC_EVAL_SQL,
    [ST_METRIC_LATEST] = "SELECT " RAW_COLS " FROM metrics WHERE job_id=?1 AND rank=0 "
                         "ORDER BY step DESC LIMIT 1",
    [ST_METRIC_MAX_STEP] = "SELECT MAX(step) FROM metrics WHERE job_id=?1 AND rank=?2",
    [ST_METRIC_TRUNCATE] = "DELETE FROM metrics WHERE job_id=?1 AND step>?2",
    [ST_RAW_RANGE] = "SELECT " RAW_COLS " FROM metrics WHERE job_id=?1 AND rank=?2 "
                     "AND step>=?3 AND step<=?4 ORDER BY step",
    [ST_ROLLUP_GET] = "SELECT " ROLLUP_COLS " FROM metrics_rollup WHERE job_id=?1 AND rank=?2 "
                      "AND level=?3 AND bucket=?4",
    [ST_ROLLUP_RANGE] = "SELECT " ROLLUP_COLS " FROM metrics_rollup WHERE job_id=?1 AND rank=?2 "
                        "AND level=?3 AND bucket>=?4 AND bucket<=?5 ORDER BY bucket",
    [ST_ROLLUP_UPSERT] = ROLLUP_UPSERT_SQL,
    [ST_ROLLUP_DELETE] = "DELETE FROM metrics_rollup WHERE job_id=?1 AND rank=?2 AND level=?3 "
                         "AND bucket=?4",
    [ST_ROLLUP_TRUNCATE] = "DELETE FROM metrics_rollup WHERE job_id=?1 AND bucket*level>?2",
    [ST_ROLLUP_STRADDLING] = "SELECT rank, level, bucket FROM metrics_rollup WHERE job_id=?1 "
                             "AND bucket*level<=?2 AND (bucket+1)*level-1>?2 "
                             "ORDER BY level, rank, bucket",
    [ST_LAYER_TRUNCATE] = "DELETE FROM layer_stats WHERE job_id=?1 AND step>?2",
    [ST_LAYER_STEP_TRUNCATE] = "DELETE FROM layer_steps WHERE job_id=?1 AND step>?2",
    /* job ?1, step ?2, scale ?3, nlayers ?4, flags ?5, first_layer ?6, first_where ?7 */
    [ST_LAYER_STEP_UPSERT] = "INSERT INTO layer_steps(job_id, step, scale, nlayers, flags, "
                             "first_layer, first_where) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7) "
                             "ON CONFLICT(job_id, step) DO UPDATE SET scale=excluded.scale, "
                             "nlayers=excluded.nlayers, flags=excluded.flags, "
                             "first_layer=excluded.first_layer, first_where=excluded.first_where",
    [ST_LAYER_STEP_GET] = "SELECT step, scale, nlayers, flags, first_layer, first_where "
                          "FROM layer_steps WHERE job_id=?1 AND step=?2",
    [ST_LAYER_STEP_LATEST] = "SELECT step, scale, nlayers, flags, first_layer, first_where "
                             "FROM layer_steps WHERE job_id=?1 ORDER BY step DESC LIMIT 1",
    [ST_LAYER_STEP_RANGE] = "SELECT step, flags FROM layer_steps WHERE job_id=?1 AND step>=?2 "
                            "AND step<=?3 ORDER BY step",
    [ST_LAYER_UPSERT] = LAYER_UPSERT_SQL,
    [ST_LAYER_TRIM] = "DELETE FROM layer_stats WHERE job_id=?1 AND step=?2 AND layer>=?3",
    [ST_LAYER_GET] = LAYER_GET_SQL,
    [ST_EVENT_INSERT] = "INSERT INTO events(job_id, step, ts, kind, message, data) "
                        "VALUES(?1, ?2, ?3, ?4, ?5, ?6)",
    [ST_EVENT_LIST] = "SELECT id, job_id, step, ts, kind, message, data FROM events "
                      "WHERE job_id=?1 AND id>?2 ORDER BY id LIMIT ?3",
    [ST_CKPT_ADD] = "INSERT INTO checkpoints(job_id, step, path, bytes, created_at) "
                    "VALUES(?1, ?2, ?3, ?4, ?5) ON CONFLICT(job_id, step) DO UPDATE SET "
                    "path=excluded.path, bytes=excluded.bytes, created_at=excluded.created_at",
    [ST_CKPT_LIST] = "SELECT step, bytes, created_at, path FROM checkpoints WHERE job_id=?1 "
                     "ORDER BY step",
    [ST_CKPT_DELETE] = "DELETE FROM checkpoints WHERE job_id=?1 AND step=?2",
    [ST_STREAM_CKPT_DELETE] = "DELETE FROM stream WHERE job_id=?1 AND step=?2 AND kind=3",
    [ST_STREAM_ADD] = "INSERT INTO stream(job_id, step, kind, ref) VALUES(?1, ?2, ?3, ?4)",
    [ST_STREAM_END] = "INSERT INTO stream(job_id, step, kind) SELECT id, step, 5 FROM jobs "
                      "WHERE id=?1",
    [ST_STREAM_READ] = "SELECT seq, step, kind, ref FROM stream WHERE job_id=?1 AND seq>?2 "
                       "ORDER BY seq LIMIT ?3",
    [ST_STREAM_TRUNCATE] = "DELETE FROM stream WHERE job_id=?1 AND step>?2 AND kind<=2",
    [ST_STREAM_AT_STEP] = "SELECT MAX(COALESCE((SELECT seq FROM stream WHERE job_id=?1 AND "
                          "kind=0 AND step<=?2 ORDER BY step DESC, seq DESC LIMIT 1), 0), "
                          "COALESCE((SELECT MAX(seq) FROM stream WHERE job_id=?1 AND kind=5), 0))",
    /* rank 0's rows with an eval result (a NaN one is NULL with its bit in ?2), found
     * through the stream's eval rows (its index) rather than a scan of every step */
    [ST_EVAL_LIST] = "SELECT step, eval_loss, eval_acc, nan_mask FROM metrics WHERE job_id=?1 "
                     "AND rank=0 AND step IN (SELECT step FROM stream WHERE job_id=?1 AND "
                     "kind=1) AND (eval_loss IS NOT NULL OR eval_acc IS NOT NULL OR "
                     "(nan_mask & ?2) != 0) ORDER BY step",
    [ST_EVENT_LAST] = "SELECT id, job_id, step, ts, kind, message, data FROM events "
                      "WHERE job_id=?1 AND kind=?2 ORDER BY id DESC LIMIT 1",
    [ST_EXP_INSERT] = "INSERT INTO experiments(name, created_at, baseline, request) "
                      "VALUES(?1, ?2, ?3, ?4)",
    [ST_EXP_MEMBER_ADD] = "INSERT INTO experiment_jobs(experiment_id, job_id, arm, seed, "
                          "position) VALUES(?1, ?2, ?3, ?4, ?5)",
    [ST_EXP_GET] = "SELECT id, name, created_at, baseline, request FROM experiments WHERE id=?1",
    [ST_EXP_LIST] = "SELECT id, name, created_at, baseline, request FROM experiments "
                    "WHERE id < ?1 ORDER BY id DESC LIMIT ?2",
    [ST_EXP_MEMBERS] = "SELECT e.job_id, e.arm, e.seed, j.status FROM experiment_jobs e "
                       "JOIN jobs j ON j.id = e.job_id WHERE e.experiment_id=?1 "
                       "ORDER BY e.position",
    [ST_EXP_DELETE] = "DELETE FROM experiments WHERE id=?1",
};

/* The text of a STORE_Q_ statement; false when it does not fit. */
static bool fields_sql(int kind, uint32_t mask, char *buf, size_t size)
{
    static const char *const head[] = {
        [STORE_Q_RAW] = "SELECT step,special,nf_mask,nan_mask,rank",
        [STORE_Q_SPECIAL] = "SELECT step,special,nf_mask,nan_mask,rank",
        [STORE_Q_ROLLUP] = "SELECT bucket,step_first,step_last,count,flags,nf_mask"};
    static const char *const tail[] = {
        [STORE_Q_RAW] = " FROM metrics WHERE job_id=?1 AND rank=?2 AND step>=?3 AND step<=?4 "
                        "ORDER BY step",
        [STORE_Q_SPECIAL] = " FROM metrics INDEXED BY metrics_special WHERE job_id=?1 AND "
                            "rank=?2 AND step>=?3 AND step<=?4 AND special!=0 ORDER BY step",
        [STORE_Q_ROLLUP] = " FROM metrics_rollup WHERE job_id=?1 AND rank=?2 AND level=?3 AND "
                           "bucket>=?4 AND bucket<=?5 ORDER BY bucket"};
    size_t n = (size_t)snprintf(buf, size, "%s", head[kind]);
    for (int i = 0; i < STORE_M_NFIELDS && n < size; i++) {
        if (!((mask >> i) & 1u))
            continue;
        if (kind == STORE_Q_ROLLUP)
            n += (size_t)snprintf(buf + n, size - n, ",%s_min,%s_max,%s_last",
                                  store_metric_name(i), store_metric_name(i), store_metric_name(i));
        else
            n += (size_t)snprintf(buf + n, size - n, ",%s", store_metric_name(i));
    }
    if (n < size)
        n += (size_t)snprintf(buf + n, size - n, "%s", tail[kind]);
    return n < size;
}

sqlite3_stmt *store_stmt_fields(store_conn *c, int kind, int slot, uint32_t mask)
{
    int key = kind * 8 + slot, victim = 0;
    char sql[2048];

    if (kind < STORE_Q_RAW || kind > STORE_Q_ROLLUP || slot < 0 || slot >= 8)
        return NULL;
    mask &= STORE_ALL_FIELDS;
    for (int i = 0; i < STORE_NQCACHE; i++) {
        if (c->q[i].st && c->q[i].key == key && c->q[i].mask == mask) {
            c->q[i].used = ++c->tick;
            return c->q[i].st;
        }
        if (!c->q[i].st || (c->q[victim].st && c->q[i].used < c->q[victim].used))
            victim = i;
    }
    if (!fields_sql(kind, mask, sql, sizeof(sql)))
        return NULL;
    sqlite3_finalize(c->q[victim].st);
    c->q[victim].st = NULL;
    if (sqlite3_prepare_v3(c->db, sql, -1, SQLITE_PREPARE_PERSISTENT, &c->q[victim].st, NULL) !=
        SQLITE_OK) {
        log_error("prepare failed: %s in: %s", sqlite3_errmsg(c->db), sql);
        c->q[victim].st = NULL;
        return NULL;
    }
    c->q[victim].key = key;
    c->q[victim].mask = mask;
    c->q[victim].used = ++c->tick;
    return c->q[victim].st;
}

int store_sql_error(sqlite3 *db, sqlite3_stmt *st, int rc, const char *func)
{
    int prim = rc & 0xff;
    if (rc == SQLITE_CONSTRAINT_FOREIGNKEY)
        return STORE_ENOTFOUND;
    if (prim == SQLITE_CONSTRAINT)
        return STORE_ECONFLICT;
    if (prim == SQLITE_FULL || prim == SQLITE_BUSY || prim == SQLITE_LOCKED ||
        (prim == SQLITE_IOERR && db && sqlite3_system_errno(db) == ENOSPC)) {
        log_debug("%s: sqlite error %d (%s)", func, rc,
                  db ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
        return prim == SQLITE_BUSY || prim == SQLITE_LOCKED ? STORE_EBUSY : STORE_EFULL;
    }
    log_error("%s: sqlite error %d (%s)%s%s", func, rc,
              db ? sqlite3_errmsg(db) : sqlite3_errstr(rc), st ? " in: " : "",
              st ? sqlite3_sql(st) : "");
    return STORE_EIO;
}

/* Whether the numbered parameters the writer binds are where store_int.h says. */
static bool params_ok(int id, sqlite3_stmt *st)
{
    if (id == ST_METRIC_UPSERT)
        return sqlite3_bind_parameter_index(st, ":job") == STORE_MU_JOB &&
               sqlite3_bind_parameter_index(st, ":eval_bits") == STORE_MU_EVAL_BITS &&
               sqlite3_bind_parameter_count(st) == STORE_MU_EVAL_BITS;
    if (id == ST_ROLLUP_UPSERT)
        return sqlite3_bind_parameter_index(st, ":job") == STORE_RUP_JOB &&
               sqlite3_bind_parameter_count(st) == STORE_RUP_NF;
    return true;
}

sqlite3_stmt *store_stmt(store_conn *c, int id)
{
    if (id < 0 || id >= ST_COUNT || !stmt_sql[id])
        return NULL;
    if (!c->st[id]) {
        int rc = sqlite3_prepare_v3(c->db, stmt_sql[id], -1, SQLITE_PREPARE_PERSISTENT, &c->st[id],
                                    NULL);
        if (rc != SQLITE_OK) {
            log_error("prepare failed: %s in: %s", sqlite3_errmsg(c->db), stmt_sql[id]);
            c->st[id] = NULL;
            return NULL;
        }
        if (!params_ok(id, c->st[id])) {
            log_error("parameters out of place in: %s", stmt_sql[id]);
            sqlite3_finalize(c->st[id]);
            c->st[id] = NULL;
            return NULL;
        }
    }
    return c->st[id];
}

void store_stmt_done(sqlite3_stmt *st)
{
    if (st) {
        sqlite3_reset(st);
        sqlite3_clear_bindings(st);
    }
}

int store_exec_stmt(store_conn *c, int id)
{
    sqlite3_stmt *st = store_stmt(c, id);
    if (!st)
        return STORE_EIO;
    int rc = sqlite3_step(st);
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(c->db, st, rc, __func__);
    sqlite3_reset(st);
    return rc;
}

/* Run constant SQL (PRAGMAs, migrations). */
static int exec_const(sqlite3 *db, const char *sql)
{
    char *msg = NULL;
    int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK) {
        log_error("sqlite error %d (%s) in: %s", rc, msg ? msg : sqlite3_errstr(rc), sql);
        sqlite3_free(msg);
        return STORE_EIO;
    }
    return 0;
}

static int first_int(void *arg, int n, char **vals, char **names)
{
    (void)names;
    if (n > 0 && vals[0])
        *(int *)arg = atoi(vals[0]);
    return 0;
}

int store_probe_write(store_conn *c)
{
    char sql[48];
    int v = 0, rc = sqlite3_exec(c->db, "PRAGMA user_version", first_int, &v, NULL);
    if (rc == SQLITE_OK) {
        snprintf(sql, sizeof(sql), "PRAGMA user_version=%d", v);
        rc = sqlite3_exec(c->db, sql, NULL, NULL, NULL);
    }
    return rc == SQLITE_OK ? 0 : store_sql_error(c->db, NULL, rc, __func__);
}

static int first_text(void *arg, int n, char **vals, char **names)
{
    (void)names;
    if (n > 0 && vals[0])
        snprintf(arg, 16, "%s", vals[0]);
    return 0;
}

int store_conn_open(const char *path, bool writer, store_conn **out)
{
    store_conn *c = calloc(1, sizeof(*c));
    int flags = SQLITE_OPEN_NOMUTEX |
                (writer ? SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE : SQLITE_OPEN_READONLY);
    int rc;
    char mode[16] = "";

    *out = NULL;
    if (!c)
        return STORE_EIO;
    rc = sqlite3_open_v2(path, &c->db, flags, NULL);
    if (rc != SQLITE_OK) {
        log_error("cannot open %s: %s", path, c->db ? sqlite3_errmsg(c->db) : sqlite3_errstr(rc));
        goto fail;
    }
    sqlite3_extended_result_codes(c->db, 1);
    sqlite3_busy_timeout(c->db, 5000);
    if (writer) {
        rc = sqlite3_exec(c->db, "PRAGMA journal_mode=WAL", first_text, mode, NULL);
        if (rc != SQLITE_OK || strcmp(mode, "wal") != 0) {
            log_error("cannot put %s in WAL mode (%s)", path,
                      rc != SQLITE_OK ? sqlite3_errmsg(c->db) : mode);
            goto fail;
        }
        if (exec_const(c->db, "PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON; "
                              "PRAGMA temp_store=MEMORY; PRAGMA cache_size=-32768") != 0)
            goto fail;
    } else if (exec_const(c->db, "PRAGMA cache_size=-32768; PRAGMA mmap_size=1073741824") != 0) {
        goto fail;
    }
    *out = c;
    return 0;
fail:
    store_conn_close(c);
    return STORE_EIO;
}

void store_conn_close(store_conn *c)
{
    if (!c)
        return;
    for (int i = 0; i < ST_COUNT; i++)
        sqlite3_finalize(c->st[i]);
    for (int i = 0; i < STORE_NQCACHE; i++)
        sqlite3_finalize(c->q[i].st);
    if (sqlite3_close(c->db) != SQLITE_OK)
        log_error("sqlite3_close: %s", sqlite3_errmsg(c->db));
    free(c);
}

/* sqlite3_progress_handler's callback: nonzero (interrupt) once the deadline has passed. */
static int past_deadline(void *arg)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 > *(const double *)arg;
}

int store_check_integrity(store_conn *c, const char *path)
{
    sqlite3_stmt *st = NULL;
    char found[1024] = "";
    struct timespec ts;
    double deadline, took;
    int rc, rows = 0;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    deadline = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + STORE_CHECK_MAX_S;
    rc = sqlite3_prepare_v2(c->db, "PRAGMA quick_check(5)", -1, &st, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_progress_handler(c->db, 100000, past_deadline, &deadline);
        while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
            const char *t = (const char *)sqlite3_column_text(st, 0);
            size_t n = strlen(found);
            if (rows++ == 0 && t && strcmp(t, "ok") == 0)
                continue;
            snprintf(found + n, sizeof(found) - n, "%s%s", n ? "; " : "", t ? t : "?");
        }
        for (char *p = found; (p = strchr(p, '\n')) != NULL;)
            *p = ' '; /* one finding a line in SQLite's text; one log line here */
        sqlite3_progress_handler(c->db, 0, NULL, NULL);
    }
    clock_gettime(CLOCK_MONOTONIC, &ts);
    took = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 - (deadline - STORE_CHECK_MAX_S);
    if (rc == SQLITE_INTERRUPT) {
        log_warn("%s: the integrity check (PRAGMA quick_check) was stopped after %d s; "
                 "opening the database without it",
                 path, STORE_CHECK_MAX_S);
        rc = SQLITE_DONE;
    } else if (rc != SQLITE_DONE) {
        size_t n = strlen(found);
        snprintf(found + n, sizeof(found) - n, "%s%s", n ? "; " : "", sqlite3_errmsg(c->db));
    }
    sqlite3_finalize(st);
    if (rc == SQLITE_DONE && !found[0]) {
        if (took > 1.0)
            log_info("%s: integrity checked (PRAGMA quick_check) in %.1f s", path, took);
        return 0;
    }
    log_error("%s is damaged: PRAGMA quick_check says: %s (restore it from a backup, or "
              "start with another --db; sqlite3's .recover may save what is left)",
              path, found);
    return STORE_EIO;
}

/* The current version inside the open transaction, or a negative code. */
static int version_get(store_conn *c, int *version)
{
    sqlite3_stmt *st = store_stmt(c, ST_VERSION_GET);
    int rc;
    if (!st)
        return STORE_EIO;
    rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        rc = store_sql_error(c->db, st, rc, __func__);
        store_stmt_done(st);
        return rc;
    }
    *version = sqlite3_column_int(st, 0);
    store_stmt_done(st);
    return 0;
}

static int version_add(store_conn *c, int version)
{
    sqlite3_stmt *st = store_stmt(c, ST_VERSION_ADD);
    int rc;
    if (!st)
        return STORE_EIO;
    sqlite3_bind_int(st, 1, version);
    sqlite3_bind_double(st, 2, store_now());
    rc = sqlite3_step(st);
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
    return rc;
}

/* The columns of the fields added by version v (their `since`): one in metrics, min, max
 * and last in metrics_rollup for a metric; one in layer_stats for a layer field (those of
 * version 2 are in migration_2). */
static int add_field_columns(store_conn *c, int v)
{
    static const char *const table[] = {"metrics", "metrics_rollup", "metrics_rollup",
                                        "metrics_rollup"};
    static const char *const suffix[] = {"", "_min", "_max", "_last"};
    char sql[160];
    int rc;

    for (int i = 0; i < STORE_M_NFIELDS; i++) {
        if (v == 1 || store_metric_field(i)->since != v)
            continue; /* version 1's columns are in migration_1 */
        for (int k = 0; k < 4; k++) {
            snprintf(sql, sizeof(sql), "ALTER TABLE %s ADD COLUMN %s%s REAL", table[k],
                     store_metric_name(i), suffix[k]);
            if ((rc = exec_const(c->db, sql)) != 0)
                return rc;
        }
    }
    for (int i = 0; i < STORE_L_NFIELDS; i++) {
        if (v <= 2 || layer_since[i] != v)
            continue;
        snprintf(sql, sizeof(sql), "ALTER TABLE layer_stats ADD COLUMN %s REAL",
                 store_layer_field_name(i));
        if ((rc = exec_const(c->db, sql)) != 0)
            return rc;
    }
    return 0;
}

/* Bring the schema from version v - 1 to v (inside the caller's transaction). */
static int migrate_step(store_conn *c, int v)
{
    int rc;
    for (int i = 0; i < NMIGRATIONS; i++)
        for (const char *const *sql = migrations[i].sql; migrations[i].version == v && *sql; sql++)
            if ((rc = exec_const(c->db, *sql)) != 0)
                return rc;
    if ((rc = add_field_columns(c, v)) != 0)
        return rc;
    return version_add(c, v);
}

int store_migrate(store_conn *c, const char *path)
{
    int rc, version = 0, newest = store_schema_version();

    rc = exec_const(c->db, "CREATE TABLE IF NOT EXISTS schema_version "
                           "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)");
    if (rc != 0)
        return rc;
    for (;;) {
        if ((rc = store_exec_stmt(c, ST_BEGIN_IMMEDIATE)) != 0)
            return rc;
        if ((rc = version_get(c, &version)) != 0)
            goto fail;
        if (version > newest) {
            log_error("%s has schema version %d, newer than this ampd's %d: refusing to open it "
                      "(use the ampd that wrote it, or another --db)",
                      path, version, newest);
            rc = STORE_ECONFLICT;
            goto fail;
        }
        if (version == newest)
            return store_exec_stmt(c, ST_COMMIT);
        if ((rc = migrate_step(c, version + 1)) != 0)
            goto fail;
        if ((rc = store_exec_stmt(c, ST_COMMIT)) != 0)
            goto fail;
        log_info("%s: schema migrated to version %d", path, version + 1);
    }
fail:
    store_exec_stmt(c, ST_ROLLBACK);
    return rc;
}
