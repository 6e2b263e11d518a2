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
 *   loss_spike        PaLM's: from a checkpoint about REMEDY_REWIND steps before the spike
 *                     ("rewind"), skip the next REMEDY_SKIP batches (data.skip_batches
 *                     grows by it, so a second spike's remedy is another patch)
 *   fp8_underflow,    the layer kept in bf16 (precision.fp8.keep, with the layers kept
 *   fp8_saturation    already), as Megatron and Transformer Engine keep sensitive layers
 * Invariants: a patch changes only what its sentence names, and never the model or the
 * world size (a branch from a checkpoint could not take it).
 */
#include <string.h>

#include "daemon/remedy.h"

#define REMEDY_REWIND 100
#define REMEDY_SKIP 200

typedef json_t *(*patch_fn)(const gpu_job_config *c, const char *layer);

static json_t *to_bf16(const gpu_job_config *c)
{
    (void)c;
    return json_pack("{s:{s:s}}", "precision", "dtype", "bf16");
}

static json_t *half_rate(const gpu_job_config *c)
{
    return json_pack("{s:{s:f}}", "optimizer", "lr", c->optim.lr / 2);
}

static json_t *act_overflow(const gpu_job_config *c, const char *layer)
{
    (void)layer;
    return c->dtype == GPU_FP16 ? to_bf16(c) : half_rate(c);
}

static json_t *act_headroom(const gpu_job_config *c, const char *layer)
{
    (void)layer;
    return c->dtype == GPU_FP16 ? to_bf16(c) : NULL;
}

static json_t *underflow(const gpu_job_config *c, const char *layer)
{
    (void)layer;
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

static json_t *lost_updates(const gpu_job_config *c, const char *layer)
{
    (void)layer;
    (void)c;
    return json_pack("{s:{s:b}}", "precision", "master_weights", 1);
}

static json_t *scale_below_one(const gpu_job_config *c, const char *layer)
{
    (void)layer;
    return c->dtype == GPU_FP16 ? to_bf16(c) : half_rate(c);
}

static json_t *scale_floor(const gpu_job_config *c, const char *layer)
{
    (void)layer;
    if (c->scaler.min_scale > 1.0f)
        return json_pack("{s:{s:{s:f}}}", "precision", "loss_scale", "min_scale", 1.0);
    return scale_below_one(c, layer);
}

static json_t *comm_overflow(const gpu_job_config *c, const char *layer)
{
    (void)layer;
    if (c->dist.hook == GPU_HOOK_NONE)
        return NULL;
    return json_pack("{s:{s:s}}", "distributed", "comm_hook",
                     c->dist.hook == GPU_HOOK_FP16 ? "bf16" : "none");
}

static json_t *loss_spike(const gpu_job_config *c, const char *layer)
{
    (void)layer;
    return json_pack("{s:{s:I}}", "data", "skip_batches",
                     (json_int_t)(c->data.skip_batches + REMEDY_SKIP));
}

/* An fp8 layer's trouble: the layer's GEMMs in bf16 (the kept layers so far, and it). */
static json_t *fp8_keep(const gpu_job_config *c, const char *layer)
{
    json_t *keep = json_array();
    for (int k = 0; keep && k < c->fp8.nkeep; k++) {
        if (layer && strcmp(c->fp8.keep[k], layer) == 0)
            return json_decref(keep), NULL; /* kept already */
        json_array_append_new(keep, json_string(c->fp8.keep[k]));
    }
    if (!layer || !c->fp8.on || c->fp8.nkeep >= GPU_FP8_MAX_KEEP)
        return json_decref(keep), NULL;
    json_array_append_new(keep, json_string(layer));
    return json_pack("{s:{s:{s:o}}}", "precision", "fp8", "keep", keep);
}

static const struct {
    const char *kind;
    bool acts;  /* the problem stops a run that goes on as it is */
    int rewind; /* the branch starts this many steps before the problem or earlier */
    patch_fn patch;
} rules[] = {
    {"act_overflow", true, 0, act_overflow},   {"act_headroom", false, 0, act_headroom},
    {"underflow", true, 0, underflow},         {"lost_updates", true, 0, lost_updates},
    {"scale_floor", true, 0, scale_floor},     {"scale_below_one", true, 0, scale_below_one},
    {"comm_overflow", true, 0, comm_overflow}, {"loss_spike", true, REMEDY_REWIND, loss_spike},
    {"fp8_underflow", false, 0, fp8_keep},     {"fp8_saturation", false, 0, fp8_keep},
};

json_t *daemon_remedy(const gpu_job_config *c, const gpu_recommendation *r)
{
    for (size_t i = 0; r->kind && i < sizeof(rules) / sizeof(rules[0]); i++) {
        if (strcmp(rules[i].kind, r->kind) != 0)
            continue;
        json_t *patch = rules[i].patch(c, r->layer), *out;
        out = patch ? json_pack("{s:o, s:b}", "patch", patch, "acts", rules[i].acts) : NULL;
        if (out && rules[i].rewind > 0)
            json_object_set_new(out, "rewind", json_integer(rules[i].rewind));
        return out;
    }
    return NULL;
}
