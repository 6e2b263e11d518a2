/*
 * cuda_prof.c - the CUDA step profile (cuda_model.h): CUDA events recorded on the step's
 * stream between groups of ops, read back into a gpu_profile once the stream has
 * synchronised.
 *
 * Invariants: ev[0 .. n) are created events; names[i] is the phase that ends at ev[i]
 * (names[0], the start, is unused); cap grows by doubling and never shrinks, so the events
 * are created once, by the first profiled steps. A failed mark sets `failed` and records
 * nothing more until the next start.
 *
 * Threads: one profiler serves one stream at a time, from the thread that enqueues on it.
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_model.h"

struct gpu_cuda_prof {
    cudaEvent_t *ev;
    const char **names;
    int n, cap, created;
    bool failed;
};

/* See cuda_model.h. */
int gpu_cuda_prof_create(gpu_cuda_prof **out)
{
    *out = calloc(1, sizeof(**out));
    return *out != NULL ? 0 : GPU_ENOMEM;
}

void gpu_cuda_prof_free(gpu_cuda_prof *p)
{
    if (p == NULL)
        return;
    for (int i = 0; i < p->created; i++)
        cudaEventDestroy(p->ev[i]);
    free(p->ev);
    free(p->names);
    free(p);
}

/* Room for one more event (created here); false when memory or the runtime fails. */
static bool grow(gpu_cuda_prof *p)
{
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 256;
        cudaEvent_t *ev = realloc(p->ev, sizeof(*ev) * (size_t)cap);
        if (ev == NULL)
            return false;
        p->ev = ev;
        const char **names = realloc(p->names, sizeof(*names) * (size_t)cap);
        if (names == NULL)
            return false;
        p->names = names;
        p->cap = cap;
    }
    if (p->n == p->created) {
        if (cudaEventCreate(&p->ev[p->n]) != cudaSuccess)
            return false;
        p->created++;
    }
    return true;
}

void gpu_cuda_prof_mark(gpu_cuda_prof *p, cudaStream_t s, const char *phase)
{
    if (p == NULL || p->failed)
        return;
    if (!grow(p) || cudaEventRecord(p->ev[p->n], s) != cudaSuccess) {
        p->failed = true;
        return;
    }
    p->names[p->n++] = phase;
}

int gpu_cuda_prof_start(gpu_cuda_prof *p, cudaStream_t s)
{
    p->n = 0;
    p->failed = false;
    gpu_cuda_prof_mark(p, s, "start");
    return p->failed ? GPU_ECUDA : 0;
}

int gpu_cuda_prof_read(gpu_cuda_prof *p, gpu_profile *out)
{
    memset(out, 0, sizeof(*out));
    if (p->failed)
        return GPU_ECUDA;
    for (int i = 1; i < p->n; i++) {
        float ms = 0.0f;
        int rc = gpu_cuda_c_check(cudaEventElapsedTime(&ms, p->ev[i - 1], p->ev[i]),
                                  "cudaEventElapsedTime");
        if (rc)
            return rc;
        gpu_profile_add(out, p->names[i], (double)ms);
    }
    return 0;
}
