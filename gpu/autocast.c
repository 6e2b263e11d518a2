/*
 * autocast.c - the autocast policy table: which dtype each op runs in.
 *
 * The defaults mirror PyTorch's CUDA autocast lists (aten/src/ATen/autocast_mode.h):
 * linear and matmul are "lower precision" ops (LOWP: the job's low dtype with fp32
 * accumulation); softmax, log_softmax, cross-entropy (nll_loss), layer_norm, exp, log, sum
 * and norm are fp32 ops; relu, gelu, add and embedding are not in any list, so they run in
 * the dtype of their input (INPUT; embedding thus runs in the weight's dtype). A job may
 * override entries; the table is plain data.
 *
 * Threads: no shared mutable state; every function is safe from any thread.
 */
#include <string.h>

#include "gpu/gpu.h"

static const char *const op_names[GPU_OP_COUNT] = {
    [GPU_OP_LINEAR] = "linear",
    [GPU_OP_MATMUL] = "matmul",
    [GPU_OP_RELU] = "relu",
    [GPU_OP_GELU] = "gelu",
    [GPU_OP_ADD] = "add",
    [GPU_OP_SOFTMAX] = "softmax",
    [GPU_OP_LOG_SOFTMAX] = "log_softmax",
    [GPU_OP_CROSS_ENTROPY] = "cross_entropy",
    [GPU_OP_LAYER_NORM] = "layer_norm",
    [GPU_OP_EXP] = "exp",
    [GPU_OP_LOG] = "log",
    [GPU_OP_SUM] = "sum",
    [GPU_OP_NORM] = "norm",
    [GPU_OP_EMBEDDING] = "embedding",
};

static const gpu_cast_policy default_policy[GPU_OP_COUNT] = {
    [GPU_OP_LINEAR] = GPU_CAST_LOWP,
    [GPU_OP_MATMUL] = GPU_CAST_LOWP,
    [GPU_OP_RELU] = GPU_CAST_INPUT,
    [GPU_OP_GELU] = GPU_CAST_INPUT,
    [GPU_OP_ADD] = GPU_CAST_INPUT,
    [GPU_OP_SOFTMAX] = GPU_CAST_FP32,
    [GPU_OP_LOG_SOFTMAX] = GPU_CAST_FP32,
    [GPU_OP_CROSS_ENTROPY] = GPU_CAST_FP32,
    [GPU_OP_LAYER_NORM] = GPU_CAST_FP32,
    [GPU_OP_EXP] = GPU_CAST_FP32,
    [GPU_OP_LOG] = GPU_CAST_FP32,
    [GPU_OP_SUM] = GPU_CAST_FP32,
    [GPU_OP_NORM] = GPU_CAST_FP32,
    [GPU_OP_EMBEDDING] = GPU_CAST_INPUT,
};

static const char *const policy_names[] = {
    [GPU_CAST_LOWP] = "lowp",
    [GPU_CAST_FP32] = "fp32",
    [GPU_CAST_INPUT] = "input",
};

#define NPOLICIES ((int)(sizeof(policy_names) / sizeof(policy_names[0])))

/* Fills *a (borrowed) with the default table. */
void gpu_autocast_defaults(gpu_autocast *a)
{
    memcpy(a->policy, default_policy, sizeof(a->policy));
}

/* A static string, or "unknown" for a value outside the enum. */
const char *gpu_op_name(gpu_op op)
{
    if ((int)op < 0 || op >= GPU_OP_COUNT)
        return "unknown";
    return op_names[op];
}

/* name and out borrowed; GPU_EINVAL (out untouched) for an unknown name. */
int gpu_op_parse(const char *name, gpu_op *out)
{
    for (int i = 0; i < GPU_OP_COUNT; i++) {
        if (strcmp(name, op_names[i]) == 0) {
            *out = (gpu_op)i;
            return 0;
        }
    }
    return GPU_EINVAL;
}

/* A static string, or "unknown" for a value outside the enum. */
const char *gpu_cast_policy_name(gpu_cast_policy p)
{
    if ((int)p < 0 || (int)p >= NPOLICIES)
        return "unknown";
    return policy_names[p];
}

/* s and out borrowed; accepts exactly "lowp", "fp32" and "input"; GPU_EINVAL otherwise. */
int gpu_cast_policy_parse(const char *s, gpu_cast_policy *out)
{
    for (int i = 0; i < NPOLICIES; i++) {
        if (strcmp(s, policy_names[i]) == 0) {
            *out = (gpu_cast_policy)i;
            return 0;
        }
    }
    return GPU_EINVAL;
}

/* a borrowed. An fp32 job runs everything in fp32. Otherwise LOWP gives dt, FP32 gives fp32
 * and INPUT gives in. An op outside the enum runs in fp32. */
gpu_dtype gpu_autocast_dtype(const gpu_autocast *a, gpu_op op, gpu_dtype dt, gpu_dtype in)
{
    if (dt == GPU_FP32 || (int)op < 0 || op >= GPU_OP_COUNT)
        return GPU_FP32;
    switch (a->policy[op]) {
    case GPU_CAST_LOWP:
        return dt;
    case GPU_CAST_INPUT:
        return in;
    case GPU_CAST_FP32:
    default:
        return GPU_FP32;
    }
}
