/*
 * beat.h - internal header of daemon/: the ranks' heartbeats (beat.c). Each rank of a
 * supervised data-parallel job runs a thread that rewrites <dir>/rank-<r>.beat every second
 * with its pid, host, last step and when that step ended; the launcher (ranks.c) reads them
 * and ends the job when a rank stops answering (stopped, dead, a frozen process) or no rank
 * finishes a step (a collective that never returns, a rank spinning) for rank_timeout_s.
 *
 * Also the straggler watch: a rank the others keep waiting for (daemon_straggle_*).
 *
 * Threads: daemon_beat_progress is thread-safe (an atomic); the beat thread is the
 * handle's own; daemon_beat_check is reentrant; a straggler watch is its caller's.
 */
#ifndef AMPD_DAEMON_BEAT_H
#define AMPD_DAEMON_BEAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct daemon_beat daemon_beat; /* opaque */

/* The heartbeats' clock: wall-clock seconds (ranks on other hosts share it, within NTP). */
double daemon_beat_now(void);

/* Start rank's heartbeat into dir (the job's checkpoint directory). 0, or -1 with errno. */
int daemon_beat_start(const char *dir, int rank, daemon_beat **out);
/* The rank made progress: it finished step (or an eval or a checkpoint at it). */
void daemon_beat_progress(daemon_beat *b, int64_t step);
/* Stop the thread and remove the file. NULL is accepted. */
void daemon_beat_stop(daemon_beat *b);

/* Wait (at most timeout_s) until every one of nranks ranks has started its heartbeat in
 * dir, i.e. has come out of MPI's start-up: 0, or -1 at the timeout. The ranks' first
 * message then reaches ranks that are ready for it (Open MPI 4.1's TCP transport can crash
 * a rank still in MPI_Init that a faster node's message reaches). */
int daemon_beat_wait_all(const char *dir, int nranks, double timeout_s);

/* The launcher's look at nranks heartbeats in dir, started seconds after the epoch (wall
 * clock) with grace_s for the ranks to start: 0 while every rank answers and some rank
 * progresses within timeout_s; else 1 and why names the rank, its host and its last step.
 * seen (nranks flags, all false at the launch, kept by the caller between looks) marks the
 * ranks whose heartbeat has been seen: one that was seen and is gone has stopped it itself
 * (it finished, or stopped after a step) and has left; no verdict on it, while the launcher
 * winds down. */
int daemon_beat_check(const char *dir, int nranks, bool *seen, double started, double grace_s,
                      double timeout_s, char *why, size_t len);

/* After the launcher has ended: the ranks that left a heartbeat behind (killed before they
 * could stop it: their node died, or they were killed) and went silent first, within a
 * moment of each other, in why ("rank 2 (host n2, pid 812, step 40), rank 3 (...)").
 * Returns how many (0: every rank stopped its own). */
int daemon_beat_lost(const char *dir, int nranks, char *why, size_t len);

/* ---- stragglers ----
 * Rank 0 adds every step's busy times (each rank's step without its wait for the
 * all-reduce: gpu_trainer_rank_busy). Over windows of DAEMON_STRAGGLE_WINDOW steps it
 * compares each rank's mean with the median rank's: a rank above DAEMON_STRAGGLE_RATIO
 * times the median in DAEMON_STRAGGLE_WINDOWS windows in a row straggles; it no longer
 * does after a window below that ratio. */
#define DAEMON_STRAGGLE_WINDOW 50
#define DAEMON_STRAGGLE_WINDOWS 2
#define DAEMON_STRAGGLE_RATIO 1.2

typedef struct daemon_straggle daemon_straggle; /* opaque */

/* A watch of n ranks (NULL when out of memory). */
daemon_straggle *daemon_straggle_new(int n);
void daemon_straggle_free(daemon_straggle *s);
/* One step's busy times (n of them). Returns 1 when a rank has just begun to straggle, -1
 * when the one that straggled no longer does (*rank that rank, *ratio its last window's
 * mean over the median rank's), else 0. */
int daemon_straggle_add(daemon_straggle *s, const double *busy, int *rank, double *ratio);

#endif /* AMPD_DAEMON_BEAT_H */
