/*
 * worker.h - internal header of daemon/: a worker (one `ampd run` child of the scheduler)
 * as sched.c supervises it, and the calls of ingest.c that turn its stdout lines into store
 * writes (events, metric rows, checkpoints and their drops, the summary).
 *
 * Invariants: a worker's parsing state and its pending checkpoints are changed only by the
 * ingest calls; the scheduler owns the rest (its process, its end). A checkpoint line the
 * store could not take waits in ckpts[] in the order the worker printed it.
 *
 * Threads: a worker is touched by the scheduler thread only, except the flags that cancel
 * sets under the scheduler's mutex (sched.c). The ingest calls are not thread-safe.
 */
#ifndef AMPD_DAEMON_WORKER_H
#define AMPD_DAEMON_WORKER_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "store/store.h"

#define MAX_PENDING_CKPTS 64    /* checkpoint lines of a worker waiting for the store */

/* A checkpoint or checkpoint_drop line the store has not taken yet. */
typedef struct {
    int64_t step, bytes;
    bool drop;  /* a checkpoint_drop: delete the file and its record */
    bool added; /* store_checkpoint_add done; store_job_set_checkpoint not yet */
    char path[512];
} pending_ckpt;

typedef struct {
    int64_t job;
    int ranks; /* its processes here (a start-up grace before its first step grows with them) */
    pid_t pid;
    int fd; /* read end of the stdout pipe; -1 after EOF */
    char dir[640];
    off_t log_start; /* worker.log size when this run started */
    double started, last_output, term_at;
    bool term_sent, kill_sent, cancel, exited, hung;
    bool pause;         /* stopped by hand: its job becomes paused */
    int64_t preempt_by; /* stopped for this job: its job becomes preempted (0: not) */
    int priority;
    int retry;          /* queued again after losing a node: its retry number (0: not) */
    /* on_numerics (policy.h): the first remedy for a problem that stops the run, as
     * {"patch", "step", "message"} (NULL: none yet), whether the policy has looked at it,
     * and a branch it stops the worker for: the child made once it has exited */
    json_t *remedy;
    bool policy_done, branching, branch_tried;
    int64_t branch_child;
    char *branch_err;
    json_t *launch;     /* what the launcher last said ("launch" lines merged), or NULL */
    bool launch_running; /* the ranks have said they run: a late "waiting" line is stale */
    int wstatus;
    /* line assembly */
    char *buf;
    size_t len, cap;
    bool discarding; /* inside an over-long line */
    /* parsing state */
    int64_t base_step, last_step;
    int64_t resumed_from; /* the checkpoint step the worker was given (0: none) */
    int64_t newest_ckpt;  /* the newest checkpoint recorded for this run: never dropped */
    double prev_scale, final_scale;
    bool have_prev;
    bool pending; /* an overflow event waits for the next step's scale */
    int64_t pending_step;
    double pending_scale;
    bool pending_skipped;
    int events, worker_events;
    store_layer_stat *layers; /* the rows of a "layers" line being parsed */
    size_t layers_cap;
    char *summary_error;
    /* the store's back-pressure: a worker is not read while the store cannot take more */
    bool paused;
    double paused_since;
    bool stalled;          /* stopped after stall_timeout_s paused; its job fails */
    char stall_why[256];   /* the store's failure then */
    /* what the store could not record yet: tried again until it can */
    char *summary_line;
    pending_ckpt ckpts[MAX_PENDING_CKPTS];
    int nckpts;
    bool ckpt_warned;
    /* the end, once the worker has exited (finish_worker) */
    bool drained, end_decided, end_event, end_warned;
    store_status end_status;
    char *end_err;
    double end_retry_at;
} worker;
/* The monotonic clock in seconds. */
double daemon_now_s(void);

/* A store failure that passes (STORE_EFULL, STORE_EBUSY, STORE_EIO): tried again later. */
bool daemon_ingest_transient(int rc);
/* Whether w's pipe may be read now (the store's back-pressure; see ingest.c). */
bool daemon_ingest_takes_lines(store *st, const worker *w);
/* Read what w's pipe has while the store takes it, each line into the store, at most
 * max_bytes (0: until the pipe is empty), so that a worker that writes faster than the store
 * takes its lines cannot keep the scheduler's turn from ending; on EOF or an error the pipe
 * is closed (w->fd becomes -1). */
void daemon_ingest_read(store *st, worker *w, size_t max_bytes);
/* Record an event in the store. Strings are borrowed; data (may be NULL) is consumed. */
void daemon_ingest_event(store *st, int64_t job, int64_t step, const char *kind,
                         const char *message, json_t *data);
/* A checkpoint a resume did not use: a "checkpoint" event and a log line saying why. */
void daemon_ingest_skip_event(store *st, int64_t job, int64_t step, const char *path,
                              const char *reason);
/* Emit the overflow event waiting for the scale that followed it (NaN: unknown). */
void daemon_ingest_flush_overflow(store *st, worker *w, double new_scale);
/* Record w's checkpoint lines waiting for the store; 0 when none is left, else the store's
 * transient code. */
int daemon_ingest_checkpoints(store *st, worker *w);
/* Insert a branch of job parent from its checkpoint at from_step (0: from the start) as
 * store_job_insert_branch does, once the checkpoint's file is there: its check and the
 * insert exclude the dropping of checkpoint files (daemon_ingest_checkpoints, which keeps
 * the file of a branch it finds), so a file checked is the branch's. STORE_ENOTFOUND when
 * the file is gone (the retention dropped it), else the store's code. */
int daemon_ingest_branch(store *st, const char *name, const char *dtype, int64_t steps,
                         const char *spec_json, int64_t parent, int64_t from_step,
                         const char *branch_json, int64_t *id);
/* Store w's summary line if one waits; 0 when none is left, else the store's transient code. */
int daemon_ingest_summary(store *st, worker *w);
/* Close w's pipe and free w with its buffers. NULL is accepted. */
void daemon_worker_free(worker *w);

#endif /* AMPD_DAEMON_WORKER_H */
