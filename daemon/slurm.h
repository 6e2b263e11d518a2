/*
 * slurm.h - internal header of daemon/: a data-parallel job's ranks started by Slurm
 * (slurm.c), for the launcher (ranks.c). The launcher runs srun in the foreground, exactly
 * as it runs mpirun; this file builds srun's command line, follows the job in Slurm's queue
 * by its unique name (squeue), stops it through Slurm (scancel) and reads its final state
 * before Slurm forgets it.
 *
 * What it learns goes to stdout as "launch" lines, the job's protocol (docs/cluster.md):
 *   {"type":"launch","launcher":"slurm","job_id":"12","state":"PENDING",
 *    "reason":"Resources","nodes":""}
 * while the job waits and once it has ended; rank 0 says RUNNING itself, with the hosts of
 * every rank, once they have joined (so that no line of this process lands between the
 * ranks' lines).
 *
 * Threads: the launcher's thread only.
 */
#ifndef AMPD_DAEMON_SLURM_H
#define AMPD_DAEMON_SLURM_H

#include <stdbool.h>

#include "gpu/gpu.h"

typedef struct {
    char name[160];     /* srun's --job-name: ampd-<host>-<pid>[-<attempt>], unique to this
                           launcher and attempt */
    char id[32];        /* Slurm's job id, once squeue has shown it ("": not yet) */
    char state[32];     /* the last state seen ("PENDING", "RUNNING", ...) */
    char reason[128];   /* its reason ("Resources", "Priority", "None") */
    char nodes[256];    /* the nodes it got ("n[1-2]") */
    double next_poll;   /* when squeue is asked next (monotonic seconds) */
    bool started;       /* seen in a state past PENDING: the ranks run */
    double last_line;   /* when the last "launch" line went out */
    bool refused;       /* waiting for a reason that never passes: cancelled, the job fails */
} daemon_slurm;

/* Begin following a job about to be submitted by this process, its attempt-th (the name
 * tells them apart). */
void daemon_slurm_init(daemon_slurm *s, int attempt);

/* srun's argument vector for c's ranks, each running exe with the run's argc/argv, into
 * out (max entries, NULL-terminated; strings in buf). 0, or -1 when it does not fit. */
int daemon_slurm_argv(const daemon_slurm *s, const gpu_job_config *c, const char *exe, int argc,
                      char **argv, char *buf, size_t buflen, char **out, int max);

/* Ask squeue about the job when it is time (every second until it runs, then every 10 s);
 * a new state while it waits, or every 10 s of waiting, prints a "launch" line. A job that
 * waits for a reason that never passes by itself (a partition's or an account's limit it
 * asks beyond, an invalid account: PartitionNodeLimit, PartitionTimeLimit, InvalidAccount,
 * QOSMax*Limit, ...) is cancelled with the reason logged, and s->refused set. Returns true
 * when the job has just been seen past PENDING. */
bool daemon_slurm_poll(daemon_slurm *s);

/* The stop: SIGUSR1 to every rank through Slurm (scancel --signal=USR1), so that they agree
 * on the step to stop after; a job still waiting is cancelled instead. kill: SIGKILL to
 * every rank (a hung job). Returns 0 when scancel said so. */
int daemon_slurm_signal(daemon_slurm *s, bool kill);

/* After srun has ended: wait (at most timeout_s) for Slurm's final state of the job, print
 * it as a "launch" line and log it. */
void daemon_slurm_finish(daemon_slurm *s, double timeout_s);

#endif /* AMPD_DAEMON_SLURM_H */
