/*
 * ranks.h - internal header of daemon/: starting a data-parallel job's ranks under Open
 * MPI's mpirun (ranks.c). Threads: the calling thread only.
 */
#ifndef AMPD_DAEMON_RANKS_H
#define AMPD_DAEMON_RANKS_H

#include "gpu/gpu.h"

/* The launcher's exit status when ranks on another host were lost (a node died, or its
 * ranks stopped answering): the daemon then retries the job from its last checkpoint, up to
 * its --max-retries (EX_TEMPFAIL). */
#define DAEMON_EXIT_LOST 75

/* Run `ampd run` with argv (argv[0] is "run", the last one the spec's path) as
 * c->dist.world_size ranks under mpirun, or srun for launcher slurm (slurm.h), and
 * supervise them until they end (SIGINT/SIGTERM are passed on as a stop after the current
 * step). A spec read from stdin ("-"; its text in spec, len bytes) is handed to the ranks in
 * a temporary file. With dir (the checkpoint directory; NULL: none) the ranks' heartbeats
 * there are watched (beat.h): a rank that stops answering, or ranks that stop finishing
 * steps, for c->dist.rank_timeout_s (after a start-up grace that grows with the rank count)
 * end the job, the rank named. Returns the process exit status, as `ampd run`'s, or
 * DAEMON_EXIT_LOST. */
int daemon_ranks_launch(const gpu_job_config *c, int argc, char **argv, const char *spec,
                        size_t len, const char *dir);

#endif /* AMPD_DAEMON_RANKS_H */
