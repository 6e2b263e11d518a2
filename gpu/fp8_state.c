/*
 * fp8_state.c - the fp8 scaling state of a model's GEMMs (gpu/fp8.h): the scale each cast
 * takes under the job's recipe, the amaxes it records, and delayed scaling's update.
 *
 * Delayed scaling follows Transformer Engine: a cast uses the row's scale, computed from the
 * amaxes of earlier steps, and puts its own amax in the row's staging slot (the largest of
 * the step's casts, fmaxf's NaN rule); after each forward and backward the trainer reduces
 * the staging slots across ranks and updates every row (gpu_fp8_delayed_update). Current
 * scaling measures each tensor first and casts it with the scale of its own amax.
 *
 * Threads: the trainer's; the casts use the OpenMP team.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gpu/fp8.h"

static int row_len(const gpu_fp8_config *c)
{
    return c->recipe == GPU_FP8_DELAYED ? c->amax_history_len : 1;
}

size_t gpu_fp8_state_floats(const gpu_fp8_config *c, int ngemm)
{
    return (size_t)ngemm * GPU_FP8_ROLES * (size_t)(2 + row_len(c));
}

static float *row(const gpu_fp8_run *run, int r)
{
    return run->state + (size_t)r * (size_t)(2 + run->len);
}

int gpu_fp8_plan_keep(const gpu_fp8_config *c, int n, const char *const *names, bool *on, char *err,
                      size_t errlen)
{
    if (n > GPU_FP8_MAX_GEMMS) {
        snprintf(err, errlen, "precision.dtype: fp8 takes at most %d linear layers",
                 GPU_FP8_MAX_GEMMS);
        return GPU_EINVAL;
    }
    for (int g = 0; g < n; g++)
        on[g] = true;
    for (int k = 0; k < c->nkeep; k++) {
        int g = 0;
        while (g < n && strcmp(names[g], c->keep[k]) != 0)
            g++;
        if (g == n) {
            snprintf(err, errlen,
                     "precision.fp8.keep: the model has no linear layer \"%s\" (its layers: "
                     "%s ... %s)",
                     c->keep[k], n ? names[0] : "none", n ? names[n - 1] : "none");
            return GPU_EINVAL;
        }
        on[g] = false;
    }
    return 0;
}

void gpu_fp8_run_init(gpu_fp8_run *run, const gpu_fp8_config *c, int ngemm, const bool *on,
                      float *state)
{
    memset(run, 0, sizeof(*run));
    run->cfg = *c;
    run->ngemm = ngemm;
    run->len = row_len(c);
    run->state = state;
    run->record = true;
    memcpy(run->on, on, (size_t)ngemm * sizeof(bool));
    memset(state, 0, gpu_fp8_state_floats(c, ngemm) * sizeof(float));
    for (int r = 0; r < ngemm * GPU_FP8_ROLES; r++)
        row(run, r)[0] = row(run, r)[1] = 1.0f;
}

/* The step's amax of row r for the diagnostics: NaN when the tensor held one. */
static void note(gpu_fp8_run *run, int r, float amax, const gpu_fp8_cast_stats *one)
{
    if (!run->stats)
        return;
    gpu_fp8_cast_stats *st = &run->stats[r];
    st->n += one->n;
    st->saturated += one->saturated;
    st->underflow += one->underflow;
    st->nonzero += one->nonzero;
    st->nan += one->nan;
    run->amax[r] = st->nan > 0 ? NAN : fmaxf(run->amax[r], amax);
    run->scale_used[r] = row(run, r)[0];
}

float gpu_fp8_cast_role(gpu_fp8_run *run, int g, int role, uint8_t *dst, const void *src,
                        gpu_dtype sdt, size_t n)
{
    const gpu_fp8_config *c = &run->cfg;
    int r = g * GPU_FP8_ROLES + role;
    float *w = row(run, r), amax;
    gpu_fp8_format f = gpu_fp8_role_format(c, role);
    gpu_fp8_cast_stats one = {0};
    if (c->recipe == GPU_FP8_CURRENT) {
        amax = gpu_fp8_amax(src, sdt, n);
        w[0] = gpu_fp8_current_scale(amax, gpu_fp8_max(f), c->amax_epsilon);
        w[1] = 1.0f / w[0];
        w[2] = amax;
    }
    gpu_fp8_cast(dst, src, sdt, n, f, w[0], &amax, run->stats ? &one : NULL);
    if (c->recipe == GPU_FP8_DELAYED && run->record)
        w[2] = fmaxf(w[2], amax);
    note(run, r, amax, &one);
    return w[1];
}

float gpu_fp8_scale_inv(const gpu_fp8_run *run, int g, int role)
{
    return row(run, g * GPU_FP8_ROLES + role)[1];
}

void gpu_fp8_staging_get(const gpu_fp8_run *run, float *out)
{
    for (int r = 0; r < run->ngemm * GPU_FP8_ROLES; r++)
        out[r] = row(run, r)[2];
}

void gpu_fp8_staging_set(gpu_fp8_run *run, const float *in)
{
    for (int r = 0; r < run->ngemm * GPU_FP8_ROLES; r++)
        row(run, r)[2] = in[r];
}

void gpu_fp8_update(gpu_fp8_run *run)
{
    const gpu_fp8_config *c = &run->cfg;
    if (c->recipe != GPU_FP8_DELAYED)
        return;
    for (int r = 0; r < run->ngemm * GPU_FP8_ROLES; r++) {
        float *w = row(run, r);
        float top = gpu_fp8_scaled_max(gpu_fp8_role_format(c, r % GPU_FP8_ROLES), c->margin);
        gpu_fp8_delayed_update(w + 2, run->len, c->amax_algo, top, &w[0], &w[1]);
    }
}

void gpu_fp8_save_scales(gpu_fp8_run *run)
{
    for (int r = 0; r < run->ngemm * GPU_FP8_ROLES; r++)
        memcpy(run->saved[r], row(run, r), 2 * sizeof(float));
}

void gpu_fp8_swap_scales(gpu_fp8_run *run)
{
    for (int r = 0; r < run->ngemm * GPU_FP8_ROLES; r++) {
        float t[2], *w = row(run, r);
        memcpy(t, w, sizeof(t));
        memcpy(w, run->saved[r], sizeof(t));
        memcpy(run->saved[r], t, sizeof(t));
    }
}
