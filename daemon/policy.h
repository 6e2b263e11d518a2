/*
 * policy.h - internal header of daemon/: the job spec's on_numerics, what the daemon does
 * when a run's diagnostics give a remedy for a problem that stops it (daemon/remedy.h):
 * nothing more ("stop"), branch the job from its newest checkpoint before the problem with
 * the remedy ("branch": the job is stopped and ends branched), or pause it and ask ("ask").
 * The scheduler (sched.c) asks daemon_policy_decide once per worker run, on the first such
 * remedy, and makes the branch with daemon_policy_branch once the stopped worker has exited.
 *
 * Threads: the scheduler's; the store is thread-safe.
 */
#ifndef AMPD_DAEMON_POLICY_H
#define AMPD_DAEMON_POLICY_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "api/api.h"
#include "store/store.h"

typedef enum { DAEMON_POLICY_NONE = 0, DAEMON_POLICY_BRANCH, DAEMON_POLICY_ASK } daemon_policy;

/* The kind of the events the policy writes (their data: {"patch", "step", "act"}). */
#define DAEMON_POLICY_EVENT "policy"

/* What job j's on_numerics does with remedy ({"patch", "step", "message"}: the first remedy
 * for a problem that stops the run, at the step where it showed). msg gets the sentence for
 * the job's events: why it branches or asks, or why it does not (max_branches reached, the
 * remedy applied before in the lineage, asked before); "" when there is nothing to say. */
daemon_policy daemon_policy_decide(store *st, const store_job *j, json_t *remedy, char *msg,
                                   size_t len);

/* Whether job's newest policy event is an ask (about patch; NULL: about any remedy). */
bool daemon_policy_asked(store *st, int64_t job, json_t *patch);

/* The branch of job that the policy stopped: remedy's patch from the newest checkpoint
 * before its step, through api_branch_create (o: the data roots; jobs: the queue). 0 with
 * *child, or the refusal's status with its message in err. */
int daemon_policy_branch(store *st, const api_spec_opts *o, const api_jobs *jobs, int64_t job,
                         json_t *remedy, int64_t *child, char *err, size_t len);

#endif /* AMPD_DAEMON_POLICY_H */
