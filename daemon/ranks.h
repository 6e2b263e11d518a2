/*
 * ranks.h - internal header of daemon/: starting a data-parallel job's ranks under Open
 * MPI's mpirun (ranks.c). Threads: the calling thread only.
 */
#ifndef AMPD_DAEMON_RANKS_H
#define AMPD_DAEMON_RANKS_H

#include "gpu/gpu.h"

/* Run `ampd run` with argv (argv[0] is "run", the last one the spec's path) as
 * c->dist.world_size ranks under mpirun and supervise them until they end (SIGINT/SIGTERM
 * are passed on as a stop after the current step). A spec read from stdin ("-"; its text
 * in spec, len bytes) is handed to the ranks in a temporary file. Returns the process exit
 * status, as `ampd run`'s. */
int daemon_ranks_launch(const gpu_job_config *c, int argc, char **argv, const char *spec,
                        size_t len);

#endif /* AMPD_DAEMON_RANKS_H */
