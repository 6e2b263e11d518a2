/*
 * comm_none.c - the data-parallel calls of a build without MPI: gpu_comm_init refuses with
 * what to install; the rest are the no-ops a caller may still make on its failure path.
 *
 * Threads: none of its own; every function is thread-safe.
 */
#include "config.h"

#ifndef HAVE_MPI

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "gpu/comm.h"
#include "gpu/gpu_int.h"

struct gpu_comm {
    int unused;
};

int gpu_comm_init(gpu_comm **out, char *err, size_t errlen)
{
    *out = NULL;
    snprintf(err, errlen, "this ampd was built without MPI (install Debian's libopenmpi-dev "
                          "and openmpi-bin, then configure again)");
    return GPU_ECOMM;
}

void gpu_comm_free(gpu_comm *c)
{
    (void)c;
}

void gpu_comm_abandon(gpu_comm *c)
{
    (void)c;
}

int gpu_comm_rank(const gpu_comm *c)
{
    (void)c;
    return 0;
}

int gpu_comm_size(const gpu_comm *c)
{
    (void)c;
    return 1;
}

int gpu_comm_hosts(gpu_comm *c, char *names, size_t each)
{
    (void)c;
    if (gethostname(names, each - 1) != 0 || !names[0])
        snprintf(names, each, "localhost");
    names[each - 1] = '\0';
    return 0;
}

int gpu_comm_local_size(const gpu_comm *c)
{
    (void)c;
    return 1;
}

const char *gpu_comm_error(const gpu_comm *c)
{
    (void)c;
    return "built without MPI";
}

int gpu_comm_any(gpu_comm *c, bool mine, bool *any)
{
    (void)c;
    *any = mine;
    return 0;
}

int gpu_comm_max(gpu_comm *c, float *v, int n)
{
    (void)c, (void)v, (void)n;
    return 0;
}

int gpu_comm_bcast(gpu_comm *c, void *buf, size_t bytes)
{
    (void)c, (void)buf, (void)bytes;
    return GPU_ECOMM;
}

int gpu_comm_plan(gpu_comm *c, float *grads, const size_t *off, const size_t *count, int n,
                  gpu_comm_hook hook, double bucket_mb, char *err, size_t errlen)
{
    (void)c, (void)grads, (void)off, (void)count, (void)n, (void)hook, (void)bucket_mb;
    snprintf(err, errlen, "this ampd was built without MPI");
    return GPU_ECOMM;
}

int gpu_comm_nbuckets(const gpu_comm *c)
{
    (void)c;
    return 0;
}

void gpu_comm_begin(gpu_comm *c)
{
    (void)c;
}

void gpu_comm_ready(gpu_comm *c, size_t off, size_t count)
{
    (void)c, (void)off, (void)count;
}

int gpu_comm_finish(gpu_comm *c, gpu_comm_stats *out)
{
    (void)c;
    memset(out, 0, sizeof(*out));
    return GPU_ECOMM;
}

int gpu_comm_control(gpu_comm *c, gpu_comm_ctl *v)
{
    (void)c, (void)v;
    return GPU_ECOMM;
}

int gpu_comm_step_time(gpu_comm *c, double ms, double busy_ms, double *max_ms, int *rank,
                       double *busy_all)
{
    (void)c, (void)busy_ms, (void)busy_all;
    *max_ms = ms;
    *rank = 0;
    return GPU_ECOMM;
}

#endif /* !HAVE_MPI */
