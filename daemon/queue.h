/*
 * queue.h - internal header of daemon/: which queued jobs start now and where (queue.c).
 * The queue's order is priority (higher first), then submission; each job is placed on
 * the machine's free cores and GPUs (machine.h); the first job that does not fit reserves
 * what it would take once the running jobs end, and later ones run ahead of it only on
 * what that leaves (backfill that never delays it). A job that waits gets a "waiting"
 * event whenever its reason changes, and the reason is kept for GET /v1/jobs. A job's spec
 * is read once, on the first plan that sees it queued. Preempted jobs wait in the queue
 * like queued ones, in the same order.
 *
 * Preemption: when the head of the queue cannot start and running jobs of lower priority
 * hold what it lacks, daemon_queue_preempt names the fewest of them, lowest priority and
 * latest started first, whose ends would let it start; the scheduler stops them at a
 * checkpoint and they come back as preempted.
 *
 * Threads: not thread-safe; the scheduler calls it under its mutex.
 */
#ifndef AMPD_DAEMON_QUEUE_H
#define AMPD_DAEMON_QUEUE_H

#include <stdint.h>

#include "api/api.h"
#include "daemon/machine.h"
#include "store/store.h"

#define QUEUE_WHY_LEN 192

/* A job to start, with what it holds and the worker's --device ("" to keep its spec's). */
typedef struct {
    int64_t job;
    int priority;
    daemon_request req;
    daemon_placement place;
    char device[16];
} daemon_start;

/* A running job as preemption sees it. */
typedef struct {
    int64_t job;
    int priority;
    double started;
    bool stopping; /* told to stop already (its resources are as good as free) */
} queue_running;

/* A queued job as the scheduler knows it: what it asks for, worked out once from its spec
 * (a queued job's spec never changes), and what it waits for. */
typedef struct {
    int64_t id;
    int priority;
    daemon_request req;
    char device[16];          /* the worker's --device ("" to keep its spec's) */
    char why[QUEUE_WHY_LEN];  /* why it has not started ("" before it waited) */
    char note[64];            /* "preempted by job 14" for a preempted job, else "" */
} queue_entry;

/* The queued jobs as last planned, in the queue's order (position i + 1 is jobs[i]). The
 * caller zeroes it before the first plan and frees it with daemon_queue_free. */
typedef struct {
    queue_entry *jobs;
    int n;
    int head; /* the first that could not start (-1: none) */
    /* Jobs queued in the store that have a worker already (a Slurm job waiting in Slurm's
     * queue): not planned. The scheduler sets them before each plan (borrowed). */
    const int64_t *busy;
    int nbusy;
} daemon_queue;

/* Plan this turn's starts: at most max of them into starts[] (*n; max may be 0), each
 * already placed on m (release it when its start fails). roots resolve the specs of jobs
 * queued since the last plan; max_running splits the cores between jobs that do not say. */
void daemon_queue_plan(store *st, daemon_machine *m, const api_spec_opts *roots,
                       int max_running, int max, daemon_start *starts, int *n, daemon_queue *q);
/* After a plan: the running jobs (run[0..nrun), max_running slots in all) to stop so that
 * the head of the queue can start, into victims[] (*n, at most nrun); none when it is not
 * waiting, when what is already stopping frees enough, or when stopping every running job
 * of lower priority would not. The head's reason says whom it waits for. */
void daemon_queue_preempt(store *st, const daemon_machine *m, const queue_running *run,
                          int nrun, int max_running, daemon_queue *q, int64_t *victims, int *n);
/* The ids of the jobs that wait to start, the queued and the preempted ones, into *ids (the
 * caller frees it) and *n: 0, or -1 when the store cannot say. */
int daemon_queue_waiting_ids(store *st, int64_t **ids, int *n);
/* A new priority for job when it is in the queue (its order follows on the next plan). */
void daemon_queue_set_priority(daemon_queue *q, int64_t job, int priority);
/* Job's place in the queue as last planned (position from 1, priority, why it waits): 0, or
 * -1 when it was not queued then. */
int daemon_queue_place(const daemon_queue *q, int64_t job, api_queue_place *out);
/* Free q's entries (q itself is the caller's). */
void daemon_queue_free(daemon_queue *q);

#endif /* AMPD_DAEMON_QUEUE_H */
