/*
 * queue.h - internal header of daemon/: which queued jobs start now and where (queue.c).
 * The queue's order is priority (higher first), then submission; each job is placed on
 * the machine's free cores and GPUs (machine.h); the first job that does not fit reserves
 * what it would take once the running jobs end, and later ones run ahead of it only on
 * what that leaves (backfill that never delays it). A job that waits gets a "waiting"
 * event whenever its reason changes, and the reason is kept for GET /v1/jobs.
 *
 * Threads: not thread-safe; the scheduler calls it under its mutex.
 */
#ifndef AMPD_DAEMON_QUEUE_H
#define AMPD_DAEMON_QUEUE_H

#include <stdint.h>

#include "api/api.h"
#include "daemon/machine.h"
#include "store/store.h"

#define QUEUE_MAX_WAITS 256   /* waiting jobs whose reason is remembered */
#define QUEUE_MAX_ORDER 4096  /* queued jobs whose place is remembered */
#define QUEUE_WHY_LEN 192

/* A job to start, with what it holds and the worker's --device ("" to keep its spec's). */
typedef struct {
    int64_t job;
    daemon_request req;
    daemon_placement place;
    char device[16];
} daemon_start;

/* The reasons jobs wait for, by job, and the queue's order as last planned. */
typedef struct {
    int n;
    int64_t job[QUEUE_MAX_WAITS];
    char why[QUEUE_MAX_WAITS][QUEUE_WHY_LEN];
    int norder;
    int64_t order[QUEUE_MAX_ORDER];
    int priority[QUEUE_MAX_ORDER];
} daemon_waits;

/* Plan this turn's starts: at most max of them into starts[] (*n; max may be 0), each
 * already placed on m (release it when its start fails). roots resolve the specs' datasets; max_running
 * splits the cores between jobs that do not say. */
void daemon_queue_plan(store *st, daemon_machine *m, const api_spec_opts *roots,
                       int max_running, int max, daemon_start *starts, int *n, daemon_waits *w);
/* Job's place in the queue as last planned (position from 1, priority, why it waits): 0, or
 * -1 when it was not queued then. */
int daemon_queue_place(const daemon_waits *w, int64_t job, api_queue_place *out);

#endif /* AMPD_DAEMON_QUEUE_H */
