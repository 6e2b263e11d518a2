/*
 * remedy.c - the remedies of the diagnostics' recommendations (contract in remedy.h).
 *
 * A rule per recommendation kind (gpu/diag.c's keys) builds the patch from the job's
 * config, following what the recommendation's sentence says:
 *   act_overflow      fp16: bf16 (fp32's range); otherwise the model diverges: half the rate
 *   act_headroom      bf16 (a warning: the run has not failed)
 *   underflow         no or static loss scaling: dynamic; dynamic in fp16: bf16; dynamic in
 *                     bf16: a floor 256 times higher (at most the initial scale)
 *   lost_updates      master weights on
 *   scale_floor       a floor above 1: the floor at 1; otherwise as scale_below_one
 *   scale_below_one   fp16: bf16; otherwise half the rate
 *   comm_overflow     a compressed all-reduce: fp16 -> bf16, bf16 -> none; an fp32 one has
 *                     no remedy of its own (its gradients overflow fp32)
 * Invariants: a patch changes only what its sentence names, and never the model or the
 * world size (a branch from a checkpoint could not take it).
 */
#include <string.h>

#include "daemon/remedy.h"

typedef json_t *(*patch_fn)(const gpu_job_config *c);

static json_t *to_bf16(const gpu_job_config *c)
{
    (void)c;
    return json_pack("{s:{s:s}}", "precision", "dtype", "bf16");
}

static json_t *half_rate(const gpu_job_config *c)
{
    return json_pack("{s:{s:f}}", "optimizer", "lr", c->optim.lr / 2);
}

static json_t *act_overflow(const gpu_job_config *c)
{
    return c->dtype == GPU_FP16 ? to_bf16(c) : half_rate(c);
}

static json_t *act_headroom(const gpu_job_config *c)
{
    return c->dtype == GPU_FP16 ? to_bf16(c) : NULL;
}

static json_t *underflow(const gpu_job_config *c)
{
    if (c->scaler.mode != GPU_SCALE_DYNAMIC)
        return json_pack("{s:{s:{s:s}}}", "precision", "loss_scale", "mode", "dynamic");
    if (c->dtype == GPU_FP16)
        return to_bf16(c);
    double floor = (double)c->scaler.min_scale * 256;
    if (floor > (double)c->scaler.init_scale)
        floor = (double)c->scaler.init_scale;
    return floor > (double)c->scaler.min_scale
               ? json_pack("{s:{s:{s:f}}}", "precision", "loss_scale", "min_scale", floor)
               : NULL;
}

static json_t *lost_updates(const gpu_job_config *c)
{
    (void)c;
    return json_pack("{s:{s:b}}", "precision", "master_weights", 1);
}

static json_t *scale_below_one(const gpu_job_config *c)
{
    return c->dtype == GPU_FP16 ? to_bf16(c) : half_rate(c);
}

static json_t *scale_floor(const gpu_job_config *c)
{
    if (c->scaler.min_scale > 1.0f)
        return json_pack("{s:{s:{s:f}}}", "precision", "loss_scale", "min_scale", 1.0);
    return scale_below_one(c);
}

static json_t *comm_overflow(const gpu_job_config *c)
{
    if (c->dist.hook == GPU_HOOK_NONE)
        return NULL;
    return json_pack("{s:{s:s}}", "distributed", "comm_hook",
                     c->dist.hook == GPU_HOOK_FP16 ? "bf16" : "none");
}

static const struct {
    const char *kind;
    bool acts; /* the problem stops a run that goes on as it is */
    patch_fn patch;
} rules[] = {
    {"act_overflow", true, act_overflow},   {"act_headroom", false, act_headroom},
    {"underflow", true, underflow},         {"lost_updates", true, lost_updates},
    {"scale_floor", true, scale_floor},     {"scale_below_one", true, scale_below_one},
    {"comm_overflow", true, comm_overflow},
};

json_t *daemon_remedy(const gpu_job_config *c, const gpu_recommendation *r)
{
    for (size_t i = 0; r->kind && i < sizeof(rules) / sizeof(rules[0]); i++) {
        if (strcmp(rules[i].kind, r->kind) != 0)
            continue;
        json_t *patch = rules[i].patch(c);
        return patch ? json_pack("{s:o, s:b}", "patch", patch, "acts", rules[i].acts) : NULL;
    }
    return NULL;
}
