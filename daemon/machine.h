/*
 * machine.h - internal header of daemon/: the machine as the scheduler sees it (machine.c).
 * The cores ampd may use (the affinity it was started with, narrowed by --cpus), the
 * memory, and the GPUs the driver's NVML reports (narrowed by --devices); each core held by
 * at most one job, each GPU by one job (several with --share-devices). A job's request is
 * derived from its spec (docs/scheduling.md); admission says whether it can ever fit,
 * placement whether it fits now and on what.
 *
 * Invariants: a job holds either nothing or all it asked for; a core or (unshared) device
 * has at most one holder; reservations (for the job at the head of the queue) only keep
 * later jobs off, and are cleared by daemon_machine_unreserve.
 *
 * Errors: daemon_machine_new returns 0 or -1 with the reason; daemon_machine_admit 0 or
 * GPU_EINVAL with an api_error that names the spec's field.
 *
 * Threads: not thread-safe; the scheduler calls it under its mutex.
 */
#ifndef AMPD_DAEMON_MACHINE_H
#define AMPD_DAEMON_MACHINE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "api/api.h"
#include "gpu/gpu.h"

#define MACHINE_MAX_CPUS 1024
#define MACHINE_MAX_DEVICES 64

typedef struct daemon_machine daemon_machine; /* opaque */

/* What a job holds while it runs on this machine. */
typedef struct {
    int ranks;        /* its processes here (0: on distributed.hosts or Slurm's nodes) */
    int cpus;         /* cores: ranks x cores per rank (at most the machine's when
                       * distributed.oversubscribe) */
    int devices;      /* GPUs: ranks x GPUs per rank */
    int device_index; /* the one named by device "cuda:N", else -1 */
    bool cuda;        /* it trains on GPUs (device "cuda", "cuda:N", or "auto" with GPUs) */
    int64_t memory_mb;
} daemon_request;

/* Where a placed job runs: core ids and NVML device indices. */
typedef struct {
    int ncpus, cpus[MACHINE_MAX_CPUS];
    int ndevices, devices[MACHINE_MAX_DEVICES];
} daemon_placement;

/* Learn the machine: cpus and devices are the --cpus and --devices lists ("0-3,8"; NULL or
 * "": all there are), share whether a GPU may hold several jobs. */
int daemon_machine_new(const char *cpus, const char *devices, bool share, daemon_machine **out,
                       char *err, size_t errlen);
void daemon_machine_free(daemon_machine *m);
/* One line for the start-up log: the cores, the memory and the GPUs (or why there are none). */
const char *daemon_machine_summary(const daemon_machine *m);
int daemon_machine_ncpus(const daemon_machine *m);
/* Whether the data-parallel jobs whose spec names no launcher go to Slurm (the daemon's
 * --launcher slurm): their ranks then hold nothing here. */
void daemon_machine_set_slurm(daemon_machine *m, bool slurm);

/* Job c's request; max_running splits the cores when the job says nothing. */
void daemon_machine_request(const daemon_machine *m, const gpu_job_config *c, int max_running,
                            daemon_request *r);
/* Whether the request can ever be met here (else GPU_EINVAL and e names the field). */
int daemon_machine_admit(const daemon_machine *m, const gpu_job_config *c,
                         const daemon_request *r, api_error *e);
/* Give job the cores and devices of r when they are free and not reserved: 0 with p, or 1
 * and what it waits for in why ("2 GPUs (4 of 4 held by jobs 3, 4)"). */
int daemon_machine_place(daemon_machine *m, int64_t job, const daemon_request *r,
                         daemon_placement *p, char *why, size_t whylen);
/* Keep what r would take once the running jobs end off the jobs placed after it. */
void daemon_machine_reserve(daemon_machine *m, const daemon_request *r);
void daemon_machine_unreserve(daemon_machine *m);
/* Whether r would fit (reservations aside) once the jobs of jobs[0..n) have ended. */
bool daemon_machine_fits_without(const daemon_machine *m, const daemon_request *r,
                                 const int64_t *jobs, int n);
/* Free what job holds (nothing when it holds nothing). */
void daemon_machine_release(daemon_machine *m, int64_t job);
/* What job holds (false when nothing). */
bool daemon_machine_held(const daemon_machine *m, int64_t job, daemon_placement *p);

/* "0-3,8" for the cores of p; "0,2" for its devices (CUDA_VISIBLE_DEVICES). */
void daemon_placement_cpus(const daemon_placement *p, char *out, size_t len);
void daemon_placement_devices(const daemon_placement *p, char *out, size_t len);

/* GET /v1/resources: every core and device, free or held and by which job, device memory
 * as NVML reports it now. A new reference. */
json_t *daemon_machine_json(const daemon_machine *m);

#endif /* AMPD_DAEMON_MACHINE_H */
