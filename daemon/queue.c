/*
 * queue.c - the queue's order and each turn's placements (contract in queue.h).
 *
 * Each turn lists the queued jobs; a job seen for the first time has its spec read from the
 * store (the effective spec kept at submit, so a job is placed as it was queued) and its
 * request worked out, once. The jobs are ordered by priority and id and placed in that
 * order until the slots run out. A spec that no longer parses (a dataset removed since it
 * was queued) still starts, on one core: its worker fails with the reason.
 *
 * Threads: see queue.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/queue.h"
#include "daemon/worker.h"

static int by_priority(const void *a, const void *b)
{
    const queue_entry *x = a, *y = b;
    if (x->priority != y->priority)
        return x->priority > y->priority ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static int by_id(const void *a, const void *b)
{
    const queue_entry *x = a, *y = b;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The worker's --device for a placed job: the GPUs it was given are its CUDA_VISIBLE_DEVICES,
 * so one rank trains on cuda:0 and ranks on "cuda" (each its number on the host); "auto"
 * without GPUs is the CPU. */
static void device_arg(const gpu_job_config *c, const daemon_request *r, char *out, size_t len)
{
    out[0] = '\0';
    if (r->cuda && r->devices > 0)
        snprintf(out, len, "%s", r->ranks > 1 ? "cuda" : "cuda:0");
    else if (!r->cuda && strcmp(c->device, "auto") == 0)
        snprintf(out, len, "cpu");
}

/* Job id's entry from its spec; a spec that does not parse asks for one core. */
static void entry_of(store *st, daemon_machine *m, const api_spec_opts *roots, int max_running,
                     int64_t id, queue_entry *e)
{
    store_job j;
    api_error err;
    gpu_job_config c;
    memset(e, 0, sizeof(*e));
    memset(&j, 0, sizeof(j));
    e->id = id;
    e->req = (daemon_request){.ranks = 1, .cpus = 1, .device_index = -1};
    if (store_job_get(st, id, &j) == 0 && j.spec &&
        api_spec_parse(j.spec, strlen(j.spec), roots, &c, &err) == 0) {
        e->priority = c.priority;
        daemon_machine_request(m, &c, max_running, &e->req);
        device_arg(&c, &e->req, e->device, sizeof(e->device));
    }
    store_job_clear(&j);
}

/* q's entries made the queued jobs', in the queue's order: the known ones kept (with their
 * reasons), the new ones read from their specs. Unchanged when the store cannot say. */
static void refresh(store *st, daemon_machine *m, const api_spec_opts *roots, int max_running,
                    daemon_queue *q)
{
    int64_t *ids = NULL;
    queue_entry *now = NULL, *old;
    int n = 0;
    if (store_job_ids(st, STORE_QUEUED, &ids, &n) != 0 ||
        (n > 0 && !(now = calloc((size_t)n, sizeof(*now))))) {
        free(ids);
        return;
    }
    if (q->n > 0)
        qsort(q->jobs, (size_t)q->n, sizeof(*q->jobs), by_id);
    for (int i = 0; i < n; i++) {
        queue_entry key = {.id = ids[i]};
        old = q->n ? bsearch(&key, q->jobs, (size_t)q->n, sizeof(*q->jobs), by_id) : NULL;
        if (old)
            now[i] = *old;
        else
            entry_of(st, m, roots, max_running, ids[i], &now[i]);
    }
    free(ids);
    free(q->jobs);
    if (n > 0)
        qsort(now, (size_t)n, sizeof(*now), by_priority);
    q->jobs = now;
    q->n = n;
}

/* Remember what e waits for; a "waiting" event and a log line when it is new. */
static void note_wait(store *st, queue_entry *e, const char *why)
{
    if (strcmp(e->why, why) == 0)
        return;
    snprintf(e->why, sizeof(e->why), "%s", why);
    log_info("job %lld: %s", (long long)e->id, why);
    daemon_ingest_event(st, e->id, 0, "lifecycle", why, NULL);
}

void daemon_queue_plan(store *st, daemon_machine *m, const api_spec_opts *roots,
                       int max_running, int max, daemon_start *starts, int *n, daemon_queue *q)
{
    bool blocked = false;
    char why[QUEUE_WHY_LEN];

    *n = 0;
    refresh(st, m, roots, max_running, q);
    daemon_machine_unreserve(m);
    for (int i = 0; i < q->n; i++) {
        queue_entry *e = &q->jobs[i];
        daemon_start *s = &starts[*n];
        if (*n == max) { /* every slot taken */
            snprintf(why, sizeof(why), "waiting for a running job to end (--max-running %d)",
                     max_running);
            note_wait(st, e, why);
            continue;
        }
        memset(s, 0, sizeof(*s));
        s->job = e->id;
        s->req = e->req;
        if (daemon_machine_place(m, s->job, &s->req, &s->place, why, sizeof(why)) != 0) {
            if (!blocked) /* the head of the queue: later jobs must not delay it */
                daemon_machine_reserve(m, &s->req);
            blocked = true;
            note_wait(st, e, why);
            continue;
        }
        snprintf(s->device, sizeof(s->device), "%s", e->device);
        (*n)++;
    }
    daemon_machine_unreserve(m);
}

int daemon_queue_place(const daemon_queue *q, int64_t job, api_queue_place *out)
{
    for (int i = 0; i < q->n; i++)
        if (q->jobs[i].id == job) {
            memset(out, 0, sizeof(*out));
            out->position = i + 1;
            out->priority = q->jobs[i].priority;
            snprintf(out->waiting_for, sizeof(out->waiting_for), "%s", q->jobs[i].why);
            return 0;
        }
    return -1;
}

void daemon_queue_free(daemon_queue *q)
{
    if (!q)
        return;
    free(q->jobs);
    q->jobs = NULL;
    q->n = 0;
}
