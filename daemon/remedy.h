/*
 * remedy.h - internal header of daemon/: the remedy each recommendation of the diagnostics
 * carries, as data: a patch of the job's spec (a JSON merge patch, what POST
 * /v1/jobs/{id}/branch applies) and whether the problem stops a run that goes on as it is
 * (a policy acts on those; a warning such as little headroom left does not). One table in
 * remedy.c, keyed by the recommendation's kind, is the only place that decides them.
 *
 * Threads: reentrant.
 */
#ifndef AMPD_DAEMON_REMEDY_H
#define AMPD_DAEMON_REMEDY_H

#include <jansson.h>
#include <stdbool.h>

#include "gpu/gpu.h"

/* The remedy of recommendation r in job c: {"patch": {...}, "acts": true|false} and, when
 * the branch should start well before the problem (a loss spike), "rewind": N steps (a new
 * reference); NULL when the recommendation has none that a spec can say. */
json_t *daemon_remedy(const gpu_job_config *c, const gpu_recommendation *r);

#endif /* AMPD_DAEMON_REMEDY_H */
