/*
 * hub.h - internal header of daemon/: the live hub, which keeps the recent JSON lines of
 * each job the scheduler has seen so that SSE readers can follow a job live.
 *
 * Per job: a ring of the last line_cap lines with their steps (nondecreasing), the
 * highest step of any step line already dropped from the ring (dropped_through), a
 * condition variable broadcast on every change and a finished flag. Finished jobs are
 * kept (trimmed) until more than keep_finished of them exist; the oldest are then
 * dropped.
 *
 * Threads: every function is thread-safe (one mutex for the whole hub).
 */
#ifndef AMPD_DAEMON_HUB_H
#define AMPD_DAEMON_HUB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/sched.h"

typedef struct daemon_hub daemon_hub; /* opaque */

/* line_cap: lines kept per live job (>= 16); keep_finished: finished jobs kept (>= 1).
 * Caller frees with daemon_hub_free() once no reader is inside daemon_hub_lines(). */
int daemon_hub_create(int line_cap, int keep_finished, daemon_hub **out);
void daemon_hub_free(daemon_hub *h);

/* Make the hub follow job (creating its entry if needed): lines with a step above
 * base_step are dropped (a resumed job rewrites them), the finished flag is cleared. */
int daemon_hub_open(daemon_hub *h, int64_t job, int64_t base_step);
/* Append a line (len bytes, copied) to job's ring; is_step marks a "step" line. Creates
 * the entry when absent. Wakes the readers. */
int daemon_hub_push(daemon_hub *h, int64_t job, int64_t step, bool is_step, const char *json,
                    size_t len);
/* Mark job finished (wakes the readers) and evict old finished jobs. */
void daemon_hub_finish(daemon_hub *h, int64_t job);
/* Forget job (it was deleted); its readers are woken and see it finished. */
void daemon_hub_remove(daemon_hub *h, int64_t job);
/* daemon_sched_lines() for one hub (the api_jobs lines callback; see api.h). Returns 0,
 * STORE_ENOTFOUND for a job the hub has never seen, or GPU_ENOMEM. */
int daemon_hub_lines(daemon_hub *h, int64_t job, int64_t after, int timeout_ms, daemon_line **lines,
                     int *n, int64_t *oldest, bool *finished);

#endif /* AMPD_DAEMON_HUB_H */
