/*
 * sched.h - internal header of daemon/: the scheduler and worker supervision (sched.c).
 *
 * One scheduler thread owns the queue: it starts up to max_running workers (each one
 * `ampd run` child process: the job's spec on disk, JSON lines on a pipe, stderr in
 * <data_dir>/jobs/<id>/worker.log), reads their lines into the store,
 * supervises them (crash: the job fails with the signal and the log's last lines; no
 * output for worker_timeout_s: killed and failed as hung; left unread while the store cannot
 * write: paused, stopped and failed after stall_timeout_s) and finishes them, recording a
 * job's end once the store can. Cancel sends
 * SIGTERM: the worker checkpoints and exits, the job becomes cancelled. Pause does the
 * same and the job becomes paused, out of the queue until unpaused. With preempt on, a
 * waiting job of higher priority that cannot start stops the running jobs of lower
 * priority that make room for it (queue.h) the same way: they become preempted, wait in the
 * queue and resume from their checkpoints. Stop sends SIGTERM
 * to every worker: they checkpoint and their jobs become interrupted. At start, jobs left
 * running by a dead daemon become interrupted; interrupted jobs are queued again and
 * resume from their last checkpoint (metrics after it are deleted first) until
 * max_retries restarts have been used, then they fail.
 *
 * Errors: the daemon_sched_* calls return 0 or the store's codes (STORE_ENOTFOUND,
 * STORE_ECONFLICT, STORE_EIO, STORE_EFULL, STORE_EBUSY; store_strerror).
 *
 * Threads: the daemon_sched_* calls are thread-safe (the HTTP threads call them).
 */
#ifndef AMPD_DAEMON_SCHED_H
#define AMPD_DAEMON_SCHED_H

#include <stdbool.h>
#include <stdint.h>

#include "api/api.h"
#include "daemon/opts.h"

struct store;
typedef struct daemon_sched daemon_sched; /* opaque */

#define DAEMON_MAX_ROOTS 8

typedef struct {
    char exe[512];          /* the ampd binary workers run (usually /proc/self/exe resolved) */
    char data_dir[512];     /* jobs/<id>/{spec.json,worker.log,ckpt-<step>.safetensors} */
    char shared_dir[512];   /* where jobs/ is instead ("": data_dir): a directory every node
                               of a cluster sees at the same path (--shared-dir) */
    int nroots;
    char roots[DAEMON_MAX_ROOTS][512]; /* data roots passed to workers (--data-root) */
    int max_running;        /* concurrent workers (1) */
    int max_retries;        /* automatic resumes of an interrupted job, or of one that lost
                               a node (3) */
    daemon_launch_opts launch; /* handed to every worker (--launcher, --slurm-*) */
    bool preempt;           /* a waiting job of higher priority stops lower ones */
    int worker_timeout_s;   /* a worker silent this long is hung (600) */
    /* The open-file soft limit workers start with; 0: this process's (ampd serve raises its
     * own for connections and gives workers the one it started with). */
    unsigned long nofile_child;
    /* A worker left unread this long because the store cannot write is stopped and its job
     * failed (3600; 0: never). */
    int stall_timeout_s;
    /* The cores and GPUs jobs are placed on (borrowed; NULL: all of this machine's). */
    struct daemon_machine *machine;
} daemon_sched_config;

/* Recover jobs left by a previous daemon (see above) and start the scheduler thread.
 * st is borrowed and must outlive the scheduler. Caller stops with daemon_sched_stop(). */
int daemon_sched_start(struct store *st, const daemon_sched_config *c, daemon_sched **out);
/* Interrupt every running job (SIGTERM, wait for the checkpoint, at most 30 s before
 * SIGKILL), stop the thread, free. NULL is accepted. */
void daemon_sched_stop(daemon_sched *s);

/* Queue a validated job. spec_json is the submitted spec (the worker validates it again
 * with the same data roots). */
int daemon_sched_submit(daemon_sched *s, const char *name, const char *dtype, int64_t steps,
                        const char *spec_json, const char *idem_key, int64_t *id,
                        bool *existed);
/* Queue a validated branch of job parent: it starts from parent's checkpoint at from_step
 * (branch_json: its record; what: the reason and the patch, for the two jobs' events). */
int daemon_sched_branch(daemon_sched *s, const char *name, const char *dtype, int64_t steps,
                        const char *spec_json, int64_t parent, int64_t from_step,
                        const char *branch_json, const char *what, int64_t *id);
/* STORE_ENOTFOUND, or STORE_ECONFLICT when the job is not queued, preempted, paused or
 * running. */
int daemon_sched_cancel(daemon_sched *s, int64_t id);
/* STORE_ECONFLICT unless the job is cancelled, failed or interrupted. */
int daemon_sched_resume(daemon_sched *s, int64_t id);
/* Stop a job and keep it out of the queue until unpaused: a queued or preempted one at once,
 * a running one once its worker has checkpointed. STORE_ECONFLICT in any other state. */
int daemon_sched_pause(daemon_sched *s, int64_t id);
/* Queue a paused job again (it resumes from its checkpoint); STORE_ECONFLICT unless paused. */
int daemon_sched_unpause(daemon_sched *s, int64_t id);
/* Give a job that has not finished another priority (its stored spec says it, so a resume
 * keeps it); the queue's order follows, and preemption with it. STORE_ECONFLICT once it
 * has finished. */
int daemon_sched_set_priority(daemon_sched *s, int64_t id, int priority);
/* STORE_ECONFLICT while the job is queued, preempted or running; removes its files too. */
int daemon_sched_delete(daemon_sched *s, int64_t id);

typedef api_queue_info daemon_sched_info;
void daemon_sched_get_info(daemon_sched *s, daemon_sched_info *out);

/* The scheduler as the HTTP server's job queue (api_start's api_jobs), ctx = s. */
void daemon_sched_api(daemon_sched *s, api_jobs *out);

#endif /* AMPD_DAEMON_SCHED_H */
