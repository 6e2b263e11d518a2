/*
 * queue.c - the queue's order and each turn's placements (contract in queue.h).
 *
 * Each turn reads the queued jobs' specs from the store (the effective spec kept at submit,
 * so a job is placed as it was queued), orders them by priority and id, and places them in
 * that order until the slots run out. A spec that no longer parses (a dataset removed since
 * it was queued) still starts, on one core: its worker fails with the reason.
 *
 * Threads: see queue.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/queue.h"
#include "daemon/worker.h"

typedef struct {
    int64_t id;
    int priority;
    gpu_job_config cfg;
    bool parsed;
} queued;

static int by_priority(const void *a, const void *b)
{
    const queued *x = a, *y = b;
    if (x->priority != y->priority)
        return x->priority > y->priority ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The queued jobs with their parsed specs, in queue order; NULL when none (or no memory). */
static queued *load(store *st, const api_spec_opts *roots, int *n)
{
    int64_t *ids = NULL;
    queued *q = NULL;
    *n = 0;
    if (store_job_ids(st, STORE_QUEUED, &ids, n) != 0 || *n == 0 ||
        !(q = calloc((size_t)*n, sizeof(*q)))) {
        free(ids);
        *n = 0;
        return NULL;
    }
    for (int i = 0; i < *n; i++) {
        store_job j;
        api_error e;
        memset(&j, 0, sizeof(j));
        q[i].id = ids[i];
        if (store_job_get(st, ids[i], &j) == 0 && j.spec &&
            api_spec_parse(j.spec, strlen(j.spec), roots, &q[i].cfg, &e) == 0) {
            q[i].parsed = true;
            q[i].priority = q[i].cfg.priority;
        }
        store_job_clear(&j);
    }
    free(ids);
    qsort(q, (size_t)*n, sizeof(*q), by_priority);
    return q;
}

/* Remember job's reason; a "waiting" event and a log line when it is new. */
static void note_wait(store *st, daemon_waits *w, int64_t job, const char *why)
{
    int i = 0;
    while (i < w->n && w->job[i] != job)
        i++;
    if (i < w->n && strcmp(w->why[i], why) == 0)
        return;
    if (i == w->n) {
        if (w->n == QUEUE_MAX_WAITS)
            return;
        w->n++;
    }
    w->job[i] = job;
    snprintf(w->why[i], QUEUE_WHY_LEN, "%s", why);
    log_info("job %lld: %s", (long long)job, why);
    daemon_ingest_event(st, job, 0, "lifecycle", why, NULL);
}

static void forget_wait(daemon_waits *w, int64_t job)
{
    for (int i = 0; i < w->n; i++)
        if (w->job[i] == job) {
            w->n--;
            w->job[i] = w->job[w->n];
            memcpy(w->why[i], w->why[w->n], QUEUE_WHY_LEN);
            return;
        }
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

void daemon_queue_plan(store *st, daemon_machine *m, const api_spec_opts *roots,
                       int max_running, int max, daemon_start *starts, int *n, daemon_waits *w)
{
    int nq = 0;
    queued *q = load(st, roots, &nq);
    bool blocked = false;
    char why[QUEUE_WHY_LEN];

    *n = 0;
    w->norder = 0;
    for (int i = 0; i < nq && w->norder < QUEUE_MAX_ORDER; i++, w->norder++) {
        w->order[w->norder] = q[i].id;
        w->priority[w->norder] = q[i].priority;
    }
    for (int k = w->n - 1; k >= 0; k--) { /* jobs no longer queued wait for nothing */
        int i = 0;
        while (i < nq && q[i].id != w->job[k])
            i++;
        if (i == nq)
            forget_wait(w, w->job[k]);
    }
    daemon_machine_unreserve(m);
    for (int i = 0; i < nq; i++) {
        daemon_start *s = &starts[*n];
        if (*n == max) { /* every slot taken */
            snprintf(why, sizeof(why), "waiting for a running job to end (--max-running %d)",
                     max_running);
            note_wait(st, w, q[i].id, why);
            continue;
        }
        memset(s, 0, sizeof(*s));
        s->job = q[i].id;
        if (q[i].parsed)
            daemon_machine_request(m, &q[i].cfg, max_running, &s->req);
        else
            s->req = (daemon_request){.ranks = 1, .cpus = 1, .device_index = -1};
        if (daemon_machine_place(m, s->job, &s->req, &s->place, why, sizeof(why)) != 0) {
            if (!blocked) /* the head of the queue: later jobs must not delay it */
                daemon_machine_reserve(m, &s->req);
            blocked = true;
            note_wait(st, w, s->job, why);
            continue;
        }
        if (q[i].parsed)
            device_arg(&q[i].cfg, &s->req, s->device, sizeof(s->device));
        forget_wait(w, s->job);
        (*n)++;
    }
    daemon_machine_unreserve(m);
    free(q);
}

int daemon_queue_place(const daemon_waits *w, int64_t job, api_queue_place *out)
{
    int i = 0;
    while (i < w->norder && w->order[i] != job)
        i++;
    if (i == w->norder)
        return -1;
    memset(out, 0, sizeof(*out));
    out->position = i + 1;
    out->priority = w->priority[i];
    for (int k = 0; k < w->n; k++)
        if (w->job[k] == job)
            snprintf(out->waiting_for, sizeof(out->waiting_for), "%s", w->why[k]);
    return 0;
}
