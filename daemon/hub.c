/*
 * hub.c - the live hub: the recent lines of each job, for SSE readers (see hub.h).
 *
 * Invariants: a job's ring holds lines in the order they were pushed and their steps are
 * nondecreasing; every step line with a step above dropped_through is still in the ring
 * (lines are dropped oldest first); a reader that has seen the step line `after` is owed
 * exactly the lines pushed after it, which are the lines following the last step line
 * with step <= after. An entry is freed only when no reader holds it (readers counts the
 * callers of daemon_hub_lines() waiting on it; an unlinked entry with readers is freed by
 * the last one).
 *
 * Threads: one mutex guards everything; each entry has its own condition variable (on
 * CLOCK_MONOTONIC) so that a line wakes only the readers of its job.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/hub.h"
#include "gpu/gpu.h"
#include "store/store.h"

#define FINISHED_LINES 1024 /* lines a finished job keeps */

typedef struct {
    int64_t step;
    bool is_step;
    char *json;
} hub_entry;

typedef struct hub_job {
    struct hub_job *next;
    int64_t job;
    pthread_cond_t cond;
    hub_entry *ring;
    int head, count;
    int64_t dropped_through;
    uint64_t finish_seq; /* order of finishing; 0 while live */
    bool finished, unlinked;
    int readers;
} hub_job;

struct daemon_hub {
    pthread_mutex_t mu;
    hub_job *jobs;
    int line_cap, keep_finished;
    uint64_t finish_counter;
};

/* See hub.h; *out is freed with daemon_hub_free(). */
int daemon_hub_create(int line_cap, int keep_finished, daemon_hub **out)
{
    daemon_hub *h;
    *out = NULL;
    if (line_cap < 16 || keep_finished < 1)
        return GPU_EINVAL;
    h = calloc(1, sizeof(*h));
    if (!h)
        return GPU_ENOMEM;
    pthread_mutex_init(&h->mu, NULL);
    h->line_cap = line_cap;
    h->keep_finished = keep_finished;
    *out = h;
    return 0;
}

static hub_entry *entry_at(const daemon_hub *h, hub_job *j, int i)
{
    return &j->ring[(j->head + i) % h->line_cap];
}

static void job_free(daemon_hub *h, hub_job *j)
{
    if (!j)
        return;
    for (int i = 0; i < j->count; i++)
        free(entry_at(h, j, i)->json);
    free(j->ring);
    pthread_cond_destroy(&j->cond);
    free(j);
}

/* See hub.h. No reader may be inside daemon_hub_lines(). */
void daemon_hub_free(daemon_hub *h)
{
    if (!h)
        return;
    for (hub_job *j = h->jobs, *next; j; j = next) {
        next = j->next;
        job_free(h, j);
    }
    pthread_mutex_destroy(&h->mu);
    free(h);
}

static hub_job *find_locked(daemon_hub *h, int64_t job)
{
    for (hub_job *j = h->jobs; j; j = j->next)
        if (j->job == job)
            return j;
    return NULL;
}

static hub_job *create_locked(daemon_hub *h, int64_t job, int64_t base_step)
{
    pthread_condattr_t ca;
    hub_job *j = calloc(1, sizeof(*j));
    if (!j)
        return NULL;
    j->ring = calloc((size_t)h->line_cap, sizeof(hub_entry));
    if (!j->ring) {
        free(j);
        return NULL;
    }
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cond, &ca);
    pthread_condattr_destroy(&ca);
    j->job = job;
    j->dropped_through = base_step;
    j->next = h->jobs;
    h->jobs = j;
    return j;
}

/* Unlink j from the list; free it now unless a reader holds it (the last one frees it). */
static void unlink_locked(daemon_hub *h, hub_job *j)
{
    for (hub_job **p = &h->jobs; *p; p = &(*p)->next)
        if (*p == j) {
            *p = j->next;
            break;
        }
    j->unlinked = true;
    j->finished = true;
    pthread_cond_broadcast(&j->cond);
    if (j->readers == 0)
        job_free(h, j);
}

/* Drop the oldest line of j. */
static void drop_oldest_locked(daemon_hub *h, hub_job *j)
{
    hub_entry *e = entry_at(h, j, 0);
    if (e->is_step && e->step > j->dropped_through)
        j->dropped_through = e->step;
    free(e->json);
    e->json = NULL;
    j->head = (j->head + 1) % h->line_cap;
    j->count--;
}

/* See hub.h. */
int daemon_hub_open(daemon_hub *h, int64_t job, int64_t base_step)
{
    hub_job *j;
    int rc = 0;
    pthread_mutex_lock(&h->mu);
    j = find_locked(h, job);
    if (!j) {
        if (!create_locked(h, job, base_step))
            rc = GPU_ENOMEM;
    } else {
        while (j->count > 0 && entry_at(h, j, j->count - 1)->step > base_step) {
            hub_entry *e = entry_at(h, j, j->count - 1);
            free(e->json);
            e->json = NULL;
            j->count--;
        }
        if (base_step < j->dropped_through)
            j->dropped_through = base_step;
        j->finished = false;
        j->finish_seq = 0;
        pthread_cond_broadcast(&j->cond);
    }
    pthread_mutex_unlock(&h->mu);
    return rc;
}

/* See hub.h; json is borrowed (copied). */
int daemon_hub_push(daemon_hub *h, int64_t job, int64_t step, bool is_step, const char *json,
                    size_t len)
{
    hub_job *j;
    hub_entry *e;
    char *copy = malloc(len + 1);
    if (!copy)
        return GPU_ENOMEM;
    memcpy(copy, json, len);
    copy[len] = '\0';
    pthread_mutex_lock(&h->mu);
    j = find_locked(h, job);
    if (!j)
        j = create_locked(h, job, step > 0 ? step - 1 : 0);
    if (!j) {
        pthread_mutex_unlock(&h->mu);
        free(copy);
        return GPU_ENOMEM;
    }
    if (j->count == h->line_cap)
        drop_oldest_locked(h, j);
    e = entry_at(h, j, j->count++);
    e->step = step;
    e->is_step = is_step;
    e->json = copy;
    pthread_cond_broadcast(&j->cond);
    pthread_mutex_unlock(&h->mu);
    return 0;
}

/* See hub.h. A finished job keeps its last FINISHED_LINES lines. */
void daemon_hub_finish(daemon_hub *h, int64_t job)
{
    hub_job *j;
    int nfinished = 0;
    pthread_mutex_lock(&h->mu);
    j = find_locked(h, job);
    if (j && !j->finished) {
        j->finished = true;
        j->finish_seq = ++h->finish_counter;
        while (j->count > FINISHED_LINES)
            drop_oldest_locked(h, j);
        pthread_cond_broadcast(&j->cond);
    }
    for (hub_job *k = h->jobs; k; k = k->next)
        nfinished += k->finished;
    while (nfinished > h->keep_finished) {
        hub_job *oldest = NULL;
        for (hub_job *k = h->jobs; k; k = k->next)
            if (k->finished && (!oldest || k->finish_seq < oldest->finish_seq))
                oldest = k;
        unlink_locked(h, oldest);
        nfinished--;
    }
    pthread_mutex_unlock(&h->mu);
}

/* See hub.h. */
void daemon_hub_remove(daemon_hub *h, int64_t job)
{
    hub_job *j;
    pthread_mutex_lock(&h->mu);
    j = find_locked(h, job);
    if (j)
        unlink_locked(h, j);
    pthread_mutex_unlock(&h->mu);
}

/* Index in j's ring of the first line a reader that has seen step `after` is owed. */
static int first_owed_locked(daemon_hub *h, hub_job *j, int64_t after)
{
    for (int i = j->count - 1; i >= 0; i--) {
        hub_entry *e = entry_at(h, j, i);
        if (e->is_step && e->step <= after)
            return i + 1;
    }
    return 0;
}

static void deadline_after(struct timespec *ts, int ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* Copy lines [from, count) of j into a new array; caller frees with api_lines_free. */
static int copy_lines_locked(daemon_hub *h, hub_job *j, int from, daemon_line **lines, int *n)
{
    int k = j->count - from;
    daemon_line *out = calloc((size_t)k, sizeof(*out));
    if (!out)
        return GPU_ENOMEM;
    for (int i = 0; i < k; i++) {
        hub_entry *e = entry_at(h, j, from + i);
        out[i].step = e->step;
        out[i].json = strdup(e->json);
        if (!out[i].json) {
            api_lines_free(out, i);
            return GPU_ENOMEM;
        }
    }
    *lines = out;
    *n = k;
    return 0;
}

/* Lines of job after step `after`; see api_jobs.lines in api.h. *lines is heap
 * (api_lines_free). */
int daemon_hub_lines(daemon_hub *h, int64_t job, int64_t after, int timeout_ms, daemon_line **lines,
                     int *n, int64_t *oldest, bool *finished)
{
    struct timespec deadline;
    hub_job *j;
    int rc = 0;

    *lines = NULL;
    *n = 0;
    *oldest = 1;
    *finished = false;
    deadline_after(&deadline, timeout_ms > 0 ? timeout_ms : 0);
    pthread_mutex_lock(&h->mu);
    j = find_locked(h, job);
    if (!j) {
        pthread_mutex_unlock(&h->mu);
        return STORE_ENOTFOUND;
    }
    j->readers++;
    for (;;) {
        int from = first_owed_locked(h, j, after);
        if (from < j->count) {
            rc = copy_lines_locked(h, j, from, lines, n);
            break;
        }
        if (j->finished || timeout_ms <= 0)
            break;
        if (pthread_cond_timedwait(&j->cond, &h->mu, &deadline) == ETIMEDOUT)
            timeout_ms = 0; /* one last look, then return */
    }
    *oldest = j->dropped_through + 1;
    *finished = j->finished;
    j->readers--;
    if (j->unlinked && j->readers == 0)
        job_free(h, j);
    pthread_mutex_unlock(&h->mu);
    return rc;
}
