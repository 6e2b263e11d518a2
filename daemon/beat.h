/*
 * beat.h - internal header of daemon/: the ranks' heartbeats (beat.c). Each rank of a
 * supervised data-parallel job runs a thread that rewrites <dir>/rank-<r>.beat every second
 * with its pid, host, last step and when that step ended; the launcher (ranks.c) reads them
 * and ends the job when a rank stops answering (stopped, dead, a frozen process) or no rank
 * finishes a step (a collective that never returns, a rank spinning) for rank_timeout_s.
 *
 * Threads: daemon_beat_progress is thread-safe (an atomic); the beat thread is the
 * handle's own; daemon_beat_check is reentrant.
 */
#ifndef AMPD_DAEMON_BEAT_H
#define AMPD_DAEMON_BEAT_H

#include <stddef.h>
#include <stdint.h>

typedef struct daemon_beat daemon_beat; /* opaque */

/* Start rank's heartbeat into dir (the job's checkpoint directory). 0, or -1 with errno. */
int daemon_beat_start(const char *dir, int rank, daemon_beat **out);
/* The rank made progress: it finished step (or an eval or a checkpoint at it). */
void daemon_beat_progress(daemon_beat *b, int64_t step);
/* Stop the thread and remove the file. NULL is accepted. */
void daemon_beat_stop(daemon_beat *b);

/* The launcher's look at nranks heartbeats in dir, started seconds after the epoch (wall
 * clock) with grace_s for the ranks to start: 0 while every rank answers and some rank
 * progresses within timeout_s; else 1 and why names the rank, its host and its last step. */
int daemon_beat_check(const char *dir, int nranks, double started, double grace_s,
                      double timeout_s, char *why, size_t len);

#endif /* AMPD_DAEMON_BEAT_H */
