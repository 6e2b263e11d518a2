/*
 * policy.c - the job spec's on_numerics (contract in policy.h).
 *
 * "branch" makes at most max_branches branches in a lineage (a job's ancestors in its
 * branch record count) and never applies a remedy that the job or an ancestor was branched
 * with (their records' patches). "ask" pauses the job once per remedy: after an unpause
 * the same remedy, offered again by the resumed run, does not ask again (the job's newest
 * policy event names what was asked).
 *
 * Threads: the scheduler's.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/policy.h"

/* The id of job's recommendation event at step with message (0: not found). */
static int64_t find_event(store *st, int64_t job, int64_t step, const char *message)
{
    store_event *ev = NULL;
    int64_t after = 0, found = 0;
    int n = 0;
    store_flush(st); /* the worker's line has been queued, perhaps not yet written */
    while (!found && store_event_list(st, job, after, 500, &ev, &n) == 0 && n > 0) {
        for (int i = 0; i < n && !found; i++)
            if (ev[i].step == step && strcmp(ev[i].kind, "recommendation") == 0 &&
                strcmp(ev[i].message, message) == 0)
                found = ev[i].id;
        after = ev[n - 1].id;
        store_events_free(ev, n);
        ev = NULL;
    }
    store_events_free(ev, n);
    return found;
}

/* The job of the lineage (j itself or an ancestor) that was branched with patch, or 0. */
static int64_t applied_in(store *st, const store_job *j, json_t *patch)
{
    json_t *rec = j->branch ? json_loads(j->branch, 0, NULL) : NULL;
    json_t *lineage = json_object_get(rec, "lineage");
    int64_t found = json_equal(json_object_get(rec, "patch"), patch) ? j->id : 0;
    for (size_t i = 0; !found && i < json_array_size(lineage); i++) {
        store_job a;
        int64_t id = json_integer_value(json_array_get(lineage, i));
        if (store_job_get(st, id, &a) != 0)
            continue;
        json_t *ar = a.branch ? json_loads(a.branch, 0, NULL) : NULL;
        if (json_equal(json_object_get(ar, "patch"), patch))
            found = id;
        json_decref(ar);
        store_job_clear(&a);
    }
    json_decref(rec);
    return found;
}

/* See policy.h. */
bool daemon_policy_asked(store *st, int64_t job, json_t *patch)
{
    store_event *ev = NULL;
    bool asked = false;
    if (store_event_last(st, job, DAEMON_POLICY_EVENT, &ev) == 0) {
        json_t *d = ev->data ? json_loads(ev->data, 0, NULL) : NULL;
        const char *act = json_string_value(json_object_get(d, "act"));
        asked = act && strcmp(act, "ask") == 0 &&
                (!patch || json_equal(json_object_get(d, "patch"), patch));
        json_decref(d);
        store_events_free(ev, 1);
    }
    return asked;
}

/* Where remedy's branch starts, in words. */
static void start_text(json_t *remedy, char *buf, size_t len)
{
    long long step = json_integer_value(json_object_get(remedy, "step"));
    long long rewind = json_integer_value(json_object_get(remedy, "rewind"));
    if (rewind > 0)
        snprintf(buf, len, "the newest checkpoint at least %lld steps before step %lld", rewind,
                 step);
    else
        snprintf(buf, len, "the newest checkpoint before step %lld", step);
}

static daemon_policy decide_branch(store *st, const store_job *j, json_t *spec, json_t *remedy,
                                   const char *ptext, char *msg, size_t len)
{
    json_t *rec = j->branch ? json_loads(j->branch, 0, NULL) : NULL;
    size_t depth = json_array_size(json_object_get(rec, "lineage"));
    json_int_t max = json_integer_value(json_object_get(spec, "max_branches"));
    int64_t by;
    char from[120];
    json_decref(rec);
    if ((json_int_t)depth >= max) {
        snprintf(msg, len,
                 "on_numerics branch: not branching with %s: the lineage has %zu branch(es) "
                 "and max_branches is %lld; the job goes on as it is",
                 ptext, depth, (long long)max);
        return DAEMON_POLICY_NONE;
    }
    if ((by = applied_in(st, j, json_object_get(remedy, "patch"))) != 0) {
        snprintf(msg, len,
                 "on_numerics branch: not branching with %s: job %lld was branched with it "
                 "already; the job goes on as it is",
                 ptext, (long long)by);
        return DAEMON_POLICY_NONE;
    }
    start_text(remedy, from, sizeof(from));
    snprintf(msg, len, "on_numerics branch: stopping to branch with %s from %s: %s", ptext, from,
             json_string_value(json_object_get(remedy, "message")));
    return DAEMON_POLICY_BRANCH;
}

daemon_policy daemon_policy_decide(store *st, const store_job *j, json_t *remedy, char *msg,
                                   size_t len)
{
    json_t *spec = json_loads(j->spec ? j->spec : "", 0, NULL);
    const char *policy = json_string_value(json_object_get(spec, "on_numerics"));
    json_t *patch = json_object_get(remedy, "patch");
    char *ptext = json_dumps(patch, JSON_COMPACT | JSON_SORT_KEYS);
    int64_t step = json_integer_value(json_object_get(remedy, "step"));
    const char *what = json_string_value(json_object_get(remedy, "message"));
    daemon_policy act = DAEMON_POLICY_NONE;
    msg[0] = '\0';
    if (policy && ptext && what && strcmp(policy, "stop") != 0) {
        int64_t ev = find_event(st, j->id, step, what);
        json_object_set_new(remedy, "event", json_integer(ev));
        if (strcmp(policy, "branch") == 0) {
            act = decide_branch(st, j, spec, remedy, ptext, msg, len);
        } else if (strcmp(policy, "ask") == 0 && !daemon_policy_asked(st, j->id, patch)) {
            char from[120];
            start_text(remedy, from, sizeof(from));
            snprintf(msg, len,
                     "on_numerics ask: paused: %s. POST /v1/jobs/%lld/branch {\"remedy\": %lld} "
                     "branches it with %s from %s; POST /v1/jobs/%lld/unpause goes on as it is",
                     what, (long long)j->id, (long long)ev, ptext, from, (long long)j->id);
            act = DAEMON_POLICY_ASK;
        }
    }
    free(ptext);
    json_decref(spec);
    return act;
}

int daemon_policy_branch(store *st, const api_spec_opts *o, const api_jobs *jobs, int64_t job,
                         json_t *remedy, int64_t *child, char *err, size_t len)
{
    api_error e;
    api_branch_req b = {.from_step = 0,
                        .sign_step = json_integer_value(json_object_get(remedy, "step")),
                        .rewind = json_integer_value(json_object_get(remedy, "rewind")),
                        .patch = json_object_get(remedy, "patch"),
                        .reason = json_string_value(json_object_get(remedy, "message")),
                        .remedy = json_integer_value(json_object_get(remedy, "event"))};
    int status = api_branch_create(st, o, jobs, job, &b, child, &e);
    if (status)
        snprintf(err, len, "%s", e.message);
    return status;
}
