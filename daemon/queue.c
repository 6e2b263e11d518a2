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
    if (j.status == STORE_PREEMPTED && j.error)
        snprintf(e->note, sizeof(e->note), "%s", j.error);
    store_job_clear(&j);
}

int daemon_queue_waiting_ids(store *st, int64_t **ids, int *n)
{
    int64_t *more = NULL, *all;
    int k = 0;
    if (store_job_ids(st, STORE_QUEUED, ids, n) != 0)
        return -1;
    if (store_job_ids(st, STORE_PREEMPTED, &more, &k) != 0 ||
        (k > 0 && !(all = realloc(*ids, (size_t)(*n + k) * sizeof(**ids))))) {
        free(more);
        free(*ids);
        *ids = NULL;
        return -1;
    }
    if (k > 0) {
        memcpy(all + *n, more, (size_t)k * sizeof(*more));
        *ids = all;
        *n += k;
    }
    free(more);
    return 0;
}

/* q's entries made the queued jobs', in the queue's order: the known ones kept (with their
 * reasons), the new ones read from their specs. Unchanged when the store cannot say. */
static void refresh(store *st, daemon_machine *m, const api_spec_opts *roots, int max_running,
                    daemon_queue *q)
{
    int64_t *ids = NULL;
    queue_entry *now = NULL, *old;
    int n = 0;
    if (daemon_queue_waiting_ids(st, &ids, &n) != 0 || (n > 0 && !(now = calloc((size_t)n, sizeof(*now))))) {
        free(ids);
        return;
    }
    if (q->n > 0)
        qsort(q->jobs, (size_t)q->n, sizeof(*q->jobs), by_id);
    for (int i = 0; i < n; i++) {
        queue_entry key = {.id = ids[i]};
        bool busy = false;
        for (int k = 0; k < q->nbusy && !busy; k++)
            busy = q->busy[k] == ids[i];
        if (busy) { /* its worker runs: the entry goes */
            memmove(ids + i, ids + i + 1, (size_t)(n - i - 1) * sizeof(*ids));
            n--, i--;
            continue;
        }
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

/* Remember what e waits for (after how it was preempted, if it was); a "waiting" event and
 * a log line when it is new. */
static void note_wait(store *st, queue_entry *e, const char *why)
{
    char full[QUEUE_WHY_LEN];
    snprintf(full, sizeof(full), "%s%s%s", e->note, e->note[0] ? "; " : "", why);
    if (strcmp(e->why, full) == 0)
        return;
    snprintf(e->why, sizeof(e->why), "%s", full);
    log_info("job %lld: %s", (long long)e->id, full);
    daemon_ingest_event(st, e->id, 0, "lifecycle", full, NULL);
}

void daemon_queue_plan(store *st, daemon_machine *m, const api_spec_opts *roots,
                       int max_running, int max, daemon_start *starts, int *n, daemon_queue *q)
{
    bool blocked = false;
    char why[QUEUE_WHY_LEN];

    *n = 0;
    refresh(st, m, roots, max_running, q);
    q->head = -1;
    daemon_machine_unreserve(m);
    for (int i = 0; i < q->n; i++) {
        queue_entry *e = &q->jobs[i];
        daemon_start *s = &starts[*n];
        if (*n == max) { /* every slot taken */
            snprintf(why, sizeof(why), "waiting for a running job to end (--max-running %d)",
                     max_running);
            note_wait(st, e, why);
            q->head = q->head < 0 ? i : q->head;
            continue;
        }
        memset(s, 0, sizeof(*s));
        s->job = e->id;
        s->req = e->req;
        if (daemon_machine_place(m, s->job, &s->req, &s->place, why, sizeof(why)) != 0) {
            if (!blocked) /* the head of the queue: later jobs must not delay it */
                daemon_machine_reserve(m, &s->req);
            q->head = q->head < 0 ? i : q->head;
            blocked = true;
            note_wait(st, e, why);
            continue;
        }
        snprintf(s->device, sizeof(s->device), "%s", e->device);
        s->priority = e->priority;
        (*n)++;
    }
    daemon_machine_unreserve(m);
}

/* Lowest priority first; of one priority, the latest started first (it loses the least). */
static int by_cost(const void *a, const void *b)
{
    const queue_running *x = a, *y = b;
    if (x->priority != y->priority)
        return x->priority < y->priority ? -1 : 1;
    return x->started > y->started ? -1 : x->started < y->started;
}

/* Whether the head fits once the jobs of skip[0..n) have ended (nrun of max_running run). */
static bool fits_without(const daemon_machine *m, const daemon_request *r, const int64_t *skip,
                         int n, int nrun, int max_running)
{
    return nrun - n < max_running && daemon_machine_fits_without(m, r, skip, n);
}

void daemon_queue_preempt(store *st, const daemon_machine *m, const queue_running *run,
                          int nrun, int max_running, daemon_queue *q, int64_t *victims, int *n)
{
    queue_running *cand;
    int64_t *skip;
    int nskip = 0, ncand = 0, first;
    char why[QUEUE_WHY_LEN];
    size_t k;

    *n = 0;
    if (q->head < 0 || q->head >= q->n || nrun == 0)
        return;
    queue_entry *e = &q->jobs[q->head];
    cand = calloc((size_t)nrun, sizeof(*cand));
    skip = calloc((size_t)nrun, sizeof(*skip));
    if (!cand || !skip)
        goto out;
    for (int i = 0; i < nrun; i++)
        if (run[i].stopping)
            skip[nskip++] = run[i].job;
        else if (run[i].priority < e->priority)
            cand[ncand++] = run[i];
    if (fits_without(m, &e->req, skip, nskip, nrun, max_running))
        goto out; /* what is stopping already makes room */
    qsort(cand, (size_t)ncand, sizeof(*cand), by_cost);
    first = nskip;
    for (int i = 0; i < ncand && !fits_without(m, &e->req, skip, nskip, nrun, max_running); i++)
        skip[nskip++] = cand[i].job;
    if (!fits_without(m, &e->req, skip, nskip, nrun, max_running))
        goto out; /* even all of them would not do */
    for (int i = first; i < nskip && nskip - first > 1;) { /* spare the ones it can do without */
        int64_t job = skip[i];
        skip[i] = skip[--nskip];
        if (fits_without(m, &e->req, skip, nskip, nrun, max_running))
            continue;
        skip[nskip++] = skip[i];
        skip[i++] = job;
    }
    k = (size_t)snprintf(why, sizeof(why), "preempting job%s", nskip - first > 1 ? "s" : "");
    for (int i = first; i < nskip && k < sizeof(why); i++) {
        victims[(*n)++] = skip[i];
        k += (size_t)snprintf(why + k, sizeof(why) - k, "%s %lld", i > first ? "," : "",
                              (long long)skip[i]);
    }
    if (k < sizeof(why))
        snprintf(why + k, sizeof(why) - k, " (lower priority): waiting for %s to checkpoint",
                 *n > 1 ? "them" : "it");
    note_wait(st, e, why);
out:
    free(cand);
    free(skip);
}

void daemon_queue_set_priority(daemon_queue *q, int64_t job, int priority)
{
    for (int i = 0; i < q->n; i++)
        if (q->jobs[i].id == job)
            q->jobs[i].priority = priority;
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
