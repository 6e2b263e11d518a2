/*
 * train.c - the trainer: owns a job's memory blocks, data and state, and runs AMP steps.
 *
 * Memory, the llm.c way: one block each for the fp32 master weights, the working copy the
 * forward pass reads (in the job's dtype), the fp32 gradients, the optimizer state (m, v),
 * the saved activations and an fp32 workspace, with a table of named tensors into the
 * parameter-shaped blocks. For an fp32 job the master is the working copy; with
 * master_weights off there is no master, only the low-precision weights.
 *
 * One step: gather a shuffled batch, forward, backward seeded with the loss scale S, one
 * fused unscale pass (inf/NaN check on the scaled values, multiply by 1/S, per-tensor
 * stats, global norm), skip the update if anything overflowed, else clip and update with
 * the working copy refreshed in the same pass, then update the scale.
 *
 * fp8 (cfg.fp8.on; docs/fp8.md): the models' linears cast to fp8 with the scaling state of
 * gpu/fp8.h, a block of its own (the checkpoint tensor "fp8.scaling"); after each micro-step's
 * forward and backward the staging amaxes are reduced across ranks and delayed scaling
 * updates every row. The fp8 copies of the GEMM operands are a block of their own (mem.fp8).
 *
 * Diagnostics: every diagnostics_every steps the forward and backward feed per-layer
 * counters (diag.c); a step whose gradients overflowed without collecting is run again on
 * the same batch with collection on before it is skipped (the weights have not changed, so
 * the recomputation sees the same numbers and has no side effect). The counters become
 * per-layer statistics, with the fraction of each layer's updates that rounded away when
 * master weights are off, and then recommendations (once per job each, see diag.c).
 *
 * Devices: cfg.device "cpu" runs here; "cuda" / "cuda:N" on that CUDA device or the job fails
 * with the reason; "auto" on CUDA device 0 when gpu_cuda_probe() finds one usable and the
 * device twin can be made there (cuBLASLt loads), else here.
 * On CUDA the host blocks stay (initialisation, checkpoints, the tensor table) and a device
 * twin (cuda_train.c) holds their copies and runs each step on the device, synchronising once
 * at its end; the host builds the batches and keeps the scalars from the step's snapshot.
 * There, a step that overflows without collecting diagnostics is not run again: the next step
 * collects them instead (the device learns of the overflow only at the step's end).
 * gpu_trainer_state() copies the device blocks to the host first, gpu_trainer_set_scalars()
 * copies the restored host blocks back.
 *
 * Threads: a trainer is driven by one thread; BLAS uses its own, the gradient accumulation
 * (grads_ready) the OpenMP team.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/comm.h"
#include "gpu/diag.h"
#include "gpu/fp8.h"
#include "gpu/gpt.h"
#include "gpu/gpu_int.h"
#include "gpu/mlp.h"
#include "gpu/twin.h"

#define TRAINER_MAX_TENSORS GPU_GPT_MAX_TENSORS

struct gpu_trainer {
    gpu_job_config cfg;
    gpu_mlp mlp;
    gpu_gpt *gpt; /* the model when it is a GPT (heap: a large plan) */
    gpu_dataset *train, *eval;
    float *master; /* fp32 master weights, or the fp32 params of an fp32 job */
    void *work;    /* working copy in cfg.dtype; == master for fp32 */
    float *grads, *m, *v;
    float *accum;  /* grad_accum_steps > 1: a later micro-step's gradients, added to grads */
    uint8_t *acts;
    float *scratch, *xbatch;
    int *ybatch, *perm, *xtok; /* xtok: a GPT's input tokens */
    int perm_pos;
    int64_t skipped; /* the steps' batches skipped (data.skip_batches) */
    int ntensors;
    size_t offsets[TRAINER_MAX_TENSORS], counts[TRAINER_MAX_TENSORS];
    char names[TRAINER_MAX_TENSORS][48];
    int ndim[TRAINER_MAX_TENSORS];
    int64_t shape[TRAINER_MAX_TENSORS][2];
    gpu_grad_stat stats[TRAINER_MAX_TENSORS];
    gpu_scaler_state scaler;
    int64_t step, applied, lost_total;
    int64_t lib_bytes;      /* GEMM library scratch counted in mem.workspace */
    double lr; /* this step's learning rate (gpu_lr_at) */
    gpu_rng rng;
    gpu_mem mem;
    /* diagnostics */
    gpu_diag *diag;
    gpu_layer_stat *lstats; /* GPU_DIAG_MAX_LAYERS entries */
    bool diagnosed;         /* the last step collected */
    gpu_diag_advisor *advisor;
    int64_t tensor_lost[TRAINER_MAX_TENSORS]; /* master weights off: per tensor, last update */
    /* CUDA */
    bool use_cuda;          /* the job runs on CUDA device cuda_index */
    bool copy_in_grads;     /* the weight matrices' working copy lives in the gradient block
                             * between an update and the next backward (a CPU MLP in fp16 or
                             * bf16, which keeps no copy of its own; one gradient block) */
    bool copy_ready;        /* it is there now: written by the last update, since when no
                             * backward ran and nothing else wrote the weights */
    int cuda_index;
    gpu_cuda_twin *cuda;    /* the device twin, once created */
    bool diag_next;         /* the last step overflowed undiagnosed: collect on this one */
    char device_text[256];  /* "auto" fell back to the CPU: "cpu (CUDA unusable: why)" */
    /* data parallelism */
    gpu_comm *comm;         /* NULL: one rank */
    int rank, world;        /* this rank and the number of ranks (0 and 1 without comm) */
    int micro;              /* the micro-step backward is in (grad_accum_steps) */
    double *rank_busy;      /* rank 0: each rank's last step without its all-reduce wait */
    bool comm_overflow;     /* the last step's inf/NaN came from the compressed all-reduce */
    int comm_first;         /* then: the first tensor (in backward order) it hit */
    /* fp8 (cfg.fp8.on): the scaling state (a block, in checkpoints), the GEMMs' fp8 copies */
    gpu_fp8_run fp8;
    float *fp8_state;
    uint8_t *fp8_block;
    float *fp8_amax;               /* staging amaxes for the all-reduce */
    gpu_fp8_cast_stats *fp8_stats; /* a collecting step's casts, per row; their amaxes and scales */
    float *fp8_damax, *fp8_dscale;
    /* step profile */
    bool profile_next;      /* profile the next step */
    bool profiling;         /* this step is profiled (step_cpu's clock reads) */
    bool profiled;          /* prof holds a step's phases */
    gpu_profile prof;
};

/* Defaults for every job field; see gpu.h and docs/job-spec.md. */
void gpu_job_defaults(gpu_job_config *c)
{
    memset(c, 0, sizeof(*c));
    snprintf(c->name, sizeof(c->name), "job");
    c->model.type = GPU_MODEL_MLP;
    c->model.nlayers = 4;
    c->model.layers[0] = 784;
    c->model.layers[1] = 1024;
    c->model.layers[2] = 1024;
    c->model.layers[3] = 10;
    c->model.activation = GPU_ACT_RELU;
    c->model.init_scale = 1.0f;
    c->model.n_layer = 4;
    c->model.n_head = 4;
    c->model.d_model = 256;
    c->model.seq_len = 128;
    c->model.vocab = 256;
    c->data.val_fraction = 0.1f;
    c->data.type = GPU_DATA_SYNTHETIC;
    c->data.synth_features = 784;
    c->data.synth_classes = 10;
    c->data.synth_train = 8192;
    c->data.synth_eval = 2048;
    c->dtype = GPU_FP32;
    c->master_weights = true;
    gpu_scaler_defaults(&c->scaler, GPU_FP32);
    gpu_autocast_defaults(&c->autocast);
    gpu_optim_defaults(&c->optim);
    c->batch_size = 256;
    c->steps = 2000;
    c->seed = 1;
    c->eval_every = 0;
    c->checkpoint_every = 0;
    c->checkpoint_keep_last = 3;
    c->max_branches = 2;
    c->checkpoint_keep_best = 1;
    c->diagnostics_every = 0;
    c->threads = 0;
    c->grad_accum_steps = 1;
    c->dist.world_size = 1;
    c->dist.rank_timeout_s = 60;
    c->res.devices = -1;
    c->dist.hook = GPU_HOOK_NONE;
    c->dist.bucket_mb = 25.0;
    snprintf(c->device, sizeof(c->device), "auto");
    gpu_fp8_defaults(&c->fp8);
}

const char *gpu_job_dtype_name(const gpu_job_config *c)
{
    return c->fp8.on ? "fp8" : gpu_dtype_name(c->dtype);
}

void gpu_trainer_free(gpu_trainer *t)
{
    if (!t)
        return;
    gpu_cuda_twin_free(t->cuda);
    gpu_dataset_free(t->train);
    gpu_dataset_free(t->eval);
    if (t->work != t->master)
        gpu_block_free(t->work);
    gpu_block_free(t->master);
    gpu_block_free(t->grads);
    gpu_block_free(t->accum);
    gpu_block_free(t->m);
    gpu_block_free(t->v);
    gpu_block_free(t->acts);
    gpu_block_free(t->scratch);
    gpu_block_free(t->fp8_state);
    gpu_block_free(t->fp8_block);
    free(t->fp8_amax);
    free(t->fp8_stats);
    free(t->fp8_damax);
    free(t->fp8_dscale);
    free(t->xbatch);
    free(t->ybatch);
    free(t->perm);
    free(t->xtok);
    free(t->gpt);
    free(t->diag);
    free(t->lstats);
    free(t->advisor);
    free(t->rank_busy);
    free(t);
}

/* Job c's training and eval sets into *train and *eval (NULL: none). */
static int load_data(const gpu_job_config *c, gpu_dataset **train, gpu_dataset **eval, char *err,
                     size_t errlen)
{
    const gpu_data_config *d = &c->data;
    int rc;
    if (d->type == GPU_DATA_SYNTHETIC) {
        rc = gpu_dataset_synthetic(d->synth_train, d->synth_features, d->synth_classes, c->seed,
                                   c->seed * 2 + 1, train);
        if (!rc && d->synth_eval > 0)
            rc = gpu_dataset_synthetic(d->synth_eval, d->synth_features, d->synth_classes,
                                       c->seed, c->seed * 2 + 2, eval);
        if (rc)
            snprintf(err, errlen, "data: cannot build the synthetic set (%s)", gpu_strerror(rc));
        return rc;
    }
    if (d->type == GPU_DATA_TEXT)
        return gpu_dataset_load_text(d->seq_train, d->seq_eval, d->val_fraction, train,
                                     eval, err, errlen);
    if (d->type == GPU_DATA_TOKENS)
        return gpu_dataset_load_tokens(d->seq_train, d->seq_eval, d->val_fraction, train,
                                       eval, err, errlen);
    rc = gpu_dataset_load_idx(d->train_images, d->train_labels, train, err, errlen);
    if (!rc && d->eval_images[0]) {
        rc = gpu_dataset_load_idx(d->eval_images, d->eval_labels, eval, err, errlen);
        if (!rc)
            gpu_dataset_normalize_like(*eval, *train);
    }
    return rc;
}

static int check_seq_shapes(const gpu_job_config *c, const gpu_dataset *train,
                            const gpu_dataset *eval, char *err, size_t errlen)
{
    const gpu_model_config *mc = &c->model;
    const gpu_dataset *sets[2] = {train, eval};
    for (int i = 0; i < 2; i++) {
        if (!sets[i])
            continue;
        if (gpu_dataset_ntokens(sets[i]) < mc->seq_len + 1) {
            snprintf(err, errlen, "data.%s: has %lld tokens, fewer than seq_len + 1 = %d",
                     i ? "eval" : "train", (long long)gpu_dataset_ntokens(sets[i]),
                     mc->seq_len + 1);
            return GPU_EINVAL;
        }
        if (gpu_dataset_vocab(sets[i]) > mc->vocab) {
            snprintf(err, errlen, "model.vocab: is %d but the data has token %d", mc->vocab,
                     gpu_dataset_vocab(sets[i]) - 1);
            return GPU_EINVAL;
        }
    }
    return 0;
}

/* Whether the sets fit job c's model (features and classes; tokens and vocab). */
static int check_shapes(const gpu_job_config *c, const gpu_dataset *train, const gpu_dataset *eval,
                        char *err, size_t errlen)
{
    if (c->model.type == GPU_MODEL_GPT)
        return check_seq_shapes(c, train, eval, err, errlen);
    const gpu_model_config *mc = &c->model;
    int in = mc->layers[0], out = mc->layers[mc->nlayers - 1];
    const gpu_dataset *sets[2] = {train, eval};
    for (int i = 0; i < 2; i++) {
        if (!sets[i])
            continue;
        if (gpu_dataset_features(sets[i]) != in) {
            snprintf(err, errlen, "model.layers[0]: is %d but the data has %d features", in,
                     gpu_dataset_features(sets[i]));
            return GPU_EINVAL;
        }
        if (gpu_dataset_classes(sets[i]) > out) {
            snprintf(err, errlen, "model.layers[%d]: is %d but the data has %d classes",
                     mc->nlayers - 1, out, gpu_dataset_classes(sets[i]));
            return GPU_EINVAL;
        }
    }
    return 0;
}

/* See gpu.h. */
int gpu_job_check_data(const gpu_job_config *c, char *err, size_t errlen)
{
    gpu_dataset *train = NULL, *eval = NULL;
    int rc;
    if (c->data.type == GPU_DATA_SYNTHETIC) /* made to the model's shape */
        return 0;
    rc = load_data(c, &train, &eval, err, errlen);
    if (rc == 0)
        rc = check_shapes(c, train, eval, err, errlen);
    gpu_dataset_free(train);
    gpu_dataset_free(eval);
    return rc;
}

static void table_add(gpu_trainer *t, const char *name, size_t off, size_t count, int ndim,
                      int64_t rows, int64_t cols)
{
    int i = t->ntensors++;
    snprintf(t->names[i], sizeof(t->names[i]), "%s", name);
    t->offsets[i] = off;
    t->counts[i] = count;
    t->ndim[i] = ndim;
    t->shape[i][0] = rows;
    t->shape[i][1] = cols;
}

static void build_table(gpu_trainer *t)
{
    const gpu_mlp *m = &t->mlp;
    t->ntensors = 0;
    if (t->gpt) {
        for (int i = 0; i < t->gpt->ntensors; i++) {
            const gpu_gpt_tensor *g = &t->gpt->tensor[i];
            table_add(t, g->name, g->off, g->count, g->ndim, g->shape[0], g->shape[1]);
        }
        return;
    }
    for (int l = 0; l < m->nlin; l++) {
        char name[48];
        snprintf(name, sizeof(name), "fc%d.weight", l + 1);
        table_add(t, name, m->w_off[l], (size_t)m->width[l + 1] * m->width[l], 2,
                  m->width[l + 1], m->width[l]);
        snprintf(name, sizeof(name), "fc%d.bias", l + 1);
        table_add(t, name, m->b_off[l], (size_t)m->width[l + 1], 1, m->width[l + 1], 0);
    }
}

/* Byte accounting by category; allocation follows it exactly. */
/* The sizes a model plan gives the trainer. */
typedef struct {
    size_t nparams, act_bytes, scratch_floats, input_bytes;
    bool work_copy; /* a working copy of the weights in the job's dtype beside the master */
    size_t fp8_bytes, fp8_state_floats; /* an fp8 job's copies and scaling state */
} model_sizes;

/* Whether the job keeps the weights in its dtype beside the fp32 master. The MLP on the
 * CPU does not: its GEMMs round the master to the layers' dtype as they read it (the values
 * the copy would hold), unless a linear layer runs in the other 16-bit dtype. In fp32 the
 * "working copy" is the master itself. */
static bool keeps_work_copy(const gpu_job_config *c, const gpu_mlp *m, const gpu_gpt *g,
                            bool cuda)
{
    if (c->dtype == GPU_FP32 || !c->master_weights || cuda || g)
        return true;
    return m->lin_dt != c->dtype && m->lin_dt != GPU_FP32;
}

static model_sizes sizes_of(const gpu_job_config *c, const gpu_mlp *m, const gpu_gpt *g,
                            bool cuda)
{
    model_sizes z;
    if (g) { /* the whole batch's tokens are drawn (a rank keeps its share) */
        z = (model_sizes){g->nparams,
                          g->act_bytes,
                          g->scratch_floats,
                          2 * (size_t)c->batch_size * (size_t)g->seq_len * sizeof(int),
                          true,
                          0,
                          0};
        if (c->fp8.on) {
            z.fp8_bytes = g->fp8_bytes;
            z.fp8_state_floats = gpu_fp8_state_floats(&c->fp8, g->nfp8);
        }
    } else {
        z = (model_sizes){m->nparams,
                          m->act_bytes,
                          m->scratch_floats,
                          (size_t)gpu_rank_batch(c) * ((size_t)m->width[0] * 4 + 4),
                          true,
                          0,
                          0};
        if (c->fp8.on) {
            z.fp8_bytes = m->fp8_bytes;
            z.fp8_state_floats = gpu_fp8_state_floats(&c->fp8, m->nlin);
        }
    }
    z.work_copy = keeps_work_copy(c, m, g, cuda);
    return z;
}

static void plan_memory(const gpu_job_config *c, model_sizes z, gpu_mem *mem)
{
    int64_t P = (int64_t)z.nparams;
    memset(mem, 0, sizeof(*mem));
    mem->weights = z.work_copy ? P * (int64_t)gpu_dtype_size(c->dtype) : 0;
    mem->master = (c->dtype != GPU_FP32 && c->master_weights) ? P * 4 : 0;
    mem->grads = P * 4 * (c->grad_accum_steps > 1 ? 2 : 1); /* + the micro-step's */
    mem->optimizer = P * 4 * (c->optim.type == GPU_OPT_ADAMW ? 2 : 1);
    mem->activations = (int64_t)z.act_bytes;
    mem->workspace = (int64_t)z.scratch_floats * 4 + (int64_t)z.input_bytes;
    mem->fp8 = (int64_t)z.fp8_bytes + (int64_t)z.fp8_state_floats * 4;
    mem->total = mem->weights + mem->master + mem->grads + mem->optimizer + mem->activations +
                 mem->workspace + mem->fp8;
}

/* See gpu/twin.h. */
int gpu_job_plan(const gpu_job_config *c, gpu_mlp *m, gpu_gpt **g, char *err, size_t errlen)
{
    char dummy[8];
    if (!err) {
        err = dummy;
        errlen = sizeof(dummy);
    }
    *g = NULL;
    if (c->model.type != GPU_MODEL_GPT) {
        int rc = gpu_mlp_plan(m, &c->model, &c->autocast, c->dtype, gpu_rank_batch(c), err, errlen);
        return rc == 0 && c->fp8.on ? gpu_mlp_plan_fp8(m, &c->fp8, err, errlen) : rc;
    }
    if (!(*g = malloc(sizeof(**g))))
        return GPU_ENOMEM;
    int rc = gpu_gpt_plan(*g, &c->model, &c->autocast, c->dtype, gpu_rank_batch(c), err, errlen);
    if (rc == 0 && c->fp8.on)
        rc = gpu_gpt_plan_fp8(*g, &c->fp8, err, errlen);
    if (rc) {
        free(*g);
        *g = NULL;
    }
    return rc;
}

/* The bytes a job's blocks will take; see gpu.h. */
int gpu_job_memory(const gpu_job_config *c, gpu_mem *out, char *err, size_t errlen)
{
    gpu_mlp m;
    gpu_gpt *g = NULL;
    int rc = gpu_job_plan(c, &m, &g, err, errlen);
    if (!rc)
        plan_memory(c, sizes_of(c, &m, g, strncmp(c->device, "cuda", 4) == 0), out);
    free(g);
    return rc;
}

/* The blocks the CPU model runs in (acts, scratch); checked by the caller. */
static void alloc_host_model(gpu_trainer *t)
{
    model_sizes z = sizes_of(&t->cfg, &t->mlp, t->gpt, t->use_cuda);
    t->acts = gpu_block_alloc(z.act_bytes, "activations");
    t->scratch = gpu_block_alloc(z.scratch_floats * sizeof(float), "scratch");
}

static int fail_alloc(const gpu_trainer *t, char *err, size_t errlen)
{
    snprintf(err, errlen, "the job needs %lld bytes of memory, which could not be allocated",
             (long long)t->mem.total);
    return GPU_ENOMEM;
}

/* An fp8 job's GEMMs: how many, and which run in fp8 (the others are kept in bf16). */
static int fp8_gemms(const gpu_trainer *t, const bool **on)
{
    *on = t->gpt ? t->gpt->fp8 : t->mlp.fp8;
    return t->gpt ? t->gpt->nfp8 : t->mlp.nlin;
}

/* GEMM g's layer name, as the diagnostics name it ("fc2", "blocks.1.mlp.fc"). */
static void fp8_gemm_name(const gpu_trainer *t, int g, char *out, size_t len)
{
    if (t->gpt)
        gpu_gpt_linear_name(g, out, len);
    else
        snprintf(out, len, "fc%d", g + 1);
}

/* An fp8 job's blocks: the scaling state (scales of 1, empty histories) and the copies. */
static bool alloc_fp8(gpu_trainer *t, model_sizes z)
{
    const bool *on;
    int ngemm = fp8_gemms(t, &on), rows = ngemm * GPU_FP8_ROLES;
    t->fp8_state = gpu_block_alloc(z.fp8_state_floats * sizeof(float), "fp8 scaling");
    t->fp8_block = gpu_block_alloc(z.fp8_bytes ? z.fp8_bytes : 1, "fp8 copies");
    t->fp8_amax = calloc((size_t)rows, sizeof(float));
    t->fp8_stats = calloc((size_t)rows, sizeof(gpu_fp8_cast_stats));
    t->fp8_damax = calloc((size_t)rows, sizeof(float));
    t->fp8_dscale = calloc((size_t)rows, sizeof(float));
    if (!t->fp8_state || !t->fp8_block || !t->fp8_amax || !t->fp8_stats || !t->fp8_damax ||
        !t->fp8_dscale)
        return false;
    gpu_fp8_run_init(&t->fp8, &t->cfg.fp8, ngemm, on, t->fp8_state);
    return true;
}

static int allocate(gpu_trainer *t, char *err, size_t errlen)
{
    const gpu_job_config *c = &t->cfg;
    model_sizes z = sizes_of(c, &t->mlp, t->gpt, t->use_cuda);
    size_t P = z.nparams, B = (size_t)c->batch_size, b = (size_t)gpu_rank_batch(c);
    bool fp32 = c->dtype == GPU_FP32;

    if (fp32 || c->master_weights)
        t->master = gpu_block_alloc(P * sizeof(float), fp32 ? "weights" : "master weights");
    if (z.work_copy)
        t->work = fp32 ? (void *)t->master
                       : gpu_block_alloc(P * gpu_dtype_size(c->dtype), "weights");
    t->grads = gpu_block_alloc(P * sizeof(float), "gradients");
    if (c->grad_accum_steps > 1)
        t->accum = gpu_block_alloc(P * sizeof(float), "accumulated gradients");
    t->m = gpu_block_alloc(P * sizeof(float), "optimizer m");
    if (c->optim.type == GPU_OPT_ADAMW)
        t->v = gpu_block_alloc(P * sizeof(float), "optimizer v");
    if (!t->use_cuda) /* the host model's blocks (the device has its own) */
        alloc_host_model(t);
    if (c->fp8.on && !alloc_fp8(t, z))
        return fail_alloc(t, err, errlen);
    if (t->gpt) {
        size_t T = (size_t)t->gpt->seq_len;
        t->xtok = malloc(sizeof(int) * B * T);
        t->ybatch = malloc(sizeof(int) * B * T);
    } else {
        t->xbatch = malloc(sizeof(float) * b * t->mlp.width[0]); /* this rank's rows */
        t->ybatch = malloc(sizeof(int) * b);
        t->perm = malloc(sizeof(int) * (size_t)gpu_dataset_count(t->train));
    }
    t->copy_in_grads = !t->use_cuda && !t->gpt && t->master && !z.work_copy &&
                       c->grad_accum_steps == 1 && t->mlp.lin_dt == c->dtype;
    t->diag = calloc(1, sizeof(*t->diag));
    t->lstats = calloc(GPU_DIAG_MAX_LAYERS, sizeof(*t->lstats));
    t->advisor = calloc(1, sizeof(*t->advisor));
    if (!t->diag || !t->lstats || !t->advisor || (!t->master && (fp32 || c->master_weights)) ||
        (!t->work && z.work_copy) || !t->grads || (!t->accum && c->grad_accum_steps > 1) || !t->m ||
        (!t->v && c->optim.type == GPU_OPT_ADAMW) || (!t->use_cuda && (!t->acts || !t->scratch)) ||
        !(t->xbatch || t->xtok) || !t->ybatch || !(t->perm || t->gpt))
        return fail_alloc(t, err, errlen);
    return 0;
}

/* Initialise the weights in fp32 (the master, or a temporary without one) and round the
 * working copy from them. */
static int init_weights(gpu_trainer *t)
{
    size_t P = (size_t)gpu_trainer_params(t);
    float *init = t->master ? t->master : malloc(P * sizeof(float));
    gpu_rng r;
    if (!init)
        return GPU_ENOMEM;
    gpu_rng_seed(&r, t->cfg.seed);
    if (t->gpt)
        gpu_gpt_init_params(t->gpt, init, t->cfg.model.init_scale, &r);
    else
        gpu_mlp_init_params(&t->mlp, init, t->cfg.model.init_scale, &r);
    if (t->work && t->work != (void *)init)
        gpu_cvt_from_f32(t->work, t->cfg.dtype, init, P);
    if (!t->master)
        free(init);
    return 0;
}

static void shuffle(gpu_trainer *t)
{
    int n = gpu_dataset_count(t->train);
    if (!t->perm)
        return;
    for (int i = 0; i < n; i++)
        t->perm[i] = i;
    for (int i = n - 1; i > 0 && !t->cfg.data.in_order; i--) {
        int j = (int)gpu_rng_below(&t->rng, (uint32_t)i + 1);
        int tmp = t->perm[i];
        t->perm[i] = t->perm[j];
        t->perm[j] = tmp;
    }
    t->perm_pos = 0;
}

/* Skip n steps' batches of the data order (data.skip_batches): classification rows are
 * drawn and dropped as next_batch draws them; sequence batches, a function of the step,
 * are offset by t->skipped. */
static void skip_batches(gpu_trainer *t, int64_t n)
{
    int total = gpu_dataset_count(t->train);
    int64_t rows = n * t->cfg.batch_size * t->cfg.grad_accum_steps;
    t->skipped += n;
    while (t->perm && rows > 0) {
        if (t->perm_pos >= total)
            shuffle(t);
        int64_t take = total - t->perm_pos < rows ? total - t->perm_pos : rows;
        t->perm_pos += (int)take;
        rows -= take;
    }
}

/* Where the job runs, from cfg.device: t->use_cuda and t->cuda_index. GPU_EINVAL for a
 * malformed device, GPU_ENODEV when the CUDA device asked for cannot be used (the reason in
 * err). */
static int pick_device(gpu_trainer *t, char *err, size_t errlen)
{
    const char *s = t->cfg.device;
    char why[256], *end = NULL;
    gpu_cuda_device devs[GPU_MAX_CUDA_DEVICES];
    int n = 0, local = 1;

    if (strcmp(s, "cpu") == 0)
        return 0;
    if (t->cfg.grad_accum_steps > 1) {
        /* the device twin runs whole steps of one micro-batch */
        if (strcmp(s, "auto") == 0) {
            if (gpu_cuda_probe(NULL, 0) == 0)
                snprintf(t->device_text, sizeof(t->device_text),
                         "cpu (gradient accumulation: the CUDA backend runs one micro-batch "
                         "per step)");
            return 0;
        }
        snprintf(err, errlen,
                 "device \"%s\": jobs with grad_accum_steps > 1 run on the CPU (\"cpu\" or "
                 "\"auto\")", s);
        return GPU_EINVAL;
    }
    if (t->cfg.dist.world_size > 1) {
        /* one device per rank, as NCCL wants: the rank's number on its host */
        if (strncmp(s, "cuda:", 5) == 0) {
            snprintf(err, errlen,
                     "device \"%s\": a job of several ranks uses \"cuda\" (each rank takes the "
                     "device of its number on its host) or \"auto\"", s);
            return GPU_EINVAL;
        }
        gpu_comm_local(&t->cuda_index, &local);
    }
    if (strcmp(s, "auto") == 0) {
        /* every rank of the host the same way: CUDA when each gets a device of its own */
        t->use_cuda = gpu_cuda_probe(NULL, 0) == 0 &&
                      gpu_cuda_devices(devs, GPU_MAX_CUDA_DEVICES, &n) == 0 && local <= n;
        return 0;
    }
    if (strcmp(s, "cuda") != 0) {
        long i = -1;
        if (strncmp(s, "cuda:", 5) == 0 && s[5] >= '0' && s[5] <= '9')
            i = strtol(s + 5, &end, 10);
        if (i < 0 || i >= GPU_MAX_CUDA_DEVICES || *end) {
            snprintf(err, errlen,
                     "device: must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\" with N from "
                     "0 to %d, not \"%s\"",
                     GPU_MAX_CUDA_DEVICES - 1, s);
            return GPU_EINVAL;
        }
        t->cuda_index = (int)i;
    }
    if (gpu_cuda_probe(why, sizeof(why)) != 0) {
        snprintf(err, errlen, "device \"%s\": %s", s, why);
        return GPU_ENODEV;
    }
    (void)gpu_cuda_devices(devs, GPU_MAX_CUDA_DEVICES, &n);
    if (t->cuda_index >= n) {
        if (t->cfg.dist.world_size > 1)
            snprintf(err, errlen,
                     "device \"%s\": rank %d of this host needs CUDA device %d, but the host has "
                     "%d (NCCL runs one rank per device)", s, t->cuda_index, t->cuda_index, n);
        else
            snprintf(err, errlen, "device \"%s\": no CUDA device %d (this machine has %d)", s,
                     t->cuda_index, n);
        return GPU_ENODEV;
    }
    t->use_cuda = true;
    return 0;
}

/* Create the device twin from the initialised host blocks; t->mem becomes its device bytes. */
static int start_cuda(gpu_trainer *t, char *err, size_t errlen)
{
    gpu_cuda_host h = {
        .cfg = &t->cfg,
        .mlp = t->gpt ? NULL : &t->mlp,
        .gpt = t->gpt,
        .ntensors = t->ntensors,
        .offsets = t->offsets,
        .counts = t->counts,
        .master = t->master,
        .work = t->work,
        .m = t->m,
        .v = t->v,
    };
    if (t->fp8_state) {
        h.fp8 = &t->cfg.fp8;
        h.fp8_ngemm = fp8_gemms(t, &h.fp8_on);
        h.fp8_len = t->fp8.len;
        h.fp8_state = t->fp8_state;
        h.fp8_stats = t->fp8_stats;
        h.fp8_amax = t->fp8_damax;
        h.fp8_scale = t->fp8_dscale;
    }
    return gpu_cuda_twin_create(&h, t->cuda_index, &t->scaler, t->applied, t->lost_total,
                                &t->cuda, &t->mem, err, errlen);
}

/* Build a trainer; see gpu.h. */
int gpu_trainer_create(const gpu_job_config *cfg, gpu_trainer **out, char *err, size_t errlen)
{
    char dummy[8];
    gpu_trainer *t = calloc(1, sizeof(*t));
    int rc;

    if (!err) {
        err = dummy;
        errlen = sizeof(dummy);
    }
    err[0] = '\0';
    *out = NULL;
    if (!t)
        return GPU_ENOMEM;
    t->cfg = *cfg;
    rc = gpu_blas_init(cfg->threads);
    if (rc) {
        snprintf(err, errlen, "cannot load the BLAS library (%s)", gpu_strerror(rc));
        goto fail;
    }
    if (cfg->batch_size < 1 || cfg->steps < 0 || cfg->grad_accum_steps < 1) {
        snprintf(err, errlen,
                 cfg->batch_size < 1  ? "batch_size: must be >= 1"
                 : cfg->steps < 0     ? "steps: must be >= 0"
                                      : "grad_accum_steps: must be >= 1");
        rc = GPU_EINVAL;
        goto fail;
    }
    if (cfg->dist.world_size > 1 && cfg->batch_size % cfg->dist.world_size != 0) {
        snprintf(err, errlen, "batch_size: %d does not divide into %d ranks", cfg->batch_size,
                 cfg->dist.world_size);
        rc = GPU_EINVAL;
        goto fail;
    }
    t->world = 1;
    rc = pick_device(t, err, errlen);
    if (rc)
        goto fail;
    rc = gpu_job_plan(cfg, &t->mlp, &t->gpt, err, errlen);
    if (rc)
        goto fail;
    rc = load_data(&t->cfg, &t->train, &t->eval, err, errlen);
    if (rc)
        goto fail;
    rc = check_shapes(&t->cfg, t->train, t->eval, err, errlen);
    if (rc)
        goto fail;
    build_table(t);
    plan_memory(&t->cfg, sizes_of(&t->cfg, &t->mlp, t->gpt, t->use_cuda), &t->mem);
    rc = allocate(t, err, errlen);
    if (rc)
        goto fail;
    rc = init_weights(t);
    if (rc) {
        snprintf(err, errlen, "cannot allocate the initial weights");
        goto fail;
    }
    gpu_scaler_init(&t->scaler, &cfg->scaler);
    gpu_rng_seed(&t->rng, cfg->seed ^ 0xDA7A5EEDull);
    shuffle(t);
    skip_batches(t, cfg->data.skip_batches);
    if (t->use_cuda && (rc = start_cuda(t, err, errlen))) {
        if (rc != GPU_ENODEV || strcmp(cfg->device, "auto") != 0)
            goto fail;
        /* "auto" and the device cannot be used after all (no cuBLASLt, say): the CPU */
        snprintf(t->device_text, sizeof(t->device_text), "cpu (CUDA unusable: %.200s)", err);
        err[0] = '\0';
        t->use_cuda = false;
        alloc_host_model(t);
        rc = GPU_ENOMEM;
        if (!t->acts || !t->scratch)
            goto fail;
        plan_memory(&t->cfg, sizes_of(&t->cfg, &t->mlp, t->gpt, t->use_cuda), &t->mem);
    }
    *out = t;
    return 0;
fail:
    gpu_trainer_free(t);
    return rc;
}

int64_t gpu_trainer_params(const gpu_trainer *t)
{
    return (int64_t)(t->gpt ? t->gpt->nparams : t->mlp.nparams);
}

int gpu_trainer_unigram(const gpu_trainer *t, double *entropy, double *top_freq)
{
    return gpu_dataset_unigram(t ? t->train : NULL, entropy, top_freq);
}

const gpu_scaler_state *gpu_trainer_scaler(const gpu_trainer *t)
{
    return &t->scaler;
}

int gpu_trainer_tensors(const gpu_trainer *t)
{
    return t->ntensors;
}

const char *gpu_trainer_tensor_name(const gpu_trainer *t, int i)
{
    return (i >= 0 && i < t->ntensors) ? t->names[i] : NULL;
}

const gpu_grad_stat *gpu_trainer_grad_stats(const gpu_trainer *t)
{
    return t->stats;
}

/* Every rank on CUDA or every rank on the CPU (their collectives differ). */
static int same_backend(gpu_trainer *t, gpu_comm *c, char *err, size_t errlen)
{
    bool any_cuda = false, any_cpu = false;
    if (gpu_comm_any(c, t->cuda != NULL, &any_cuda) || gpu_comm_any(c, !t->cuda, &any_cpu)) {
        snprintf(err, errlen, "%s", gpu_comm_error(c));
        return GPU_ECOMM;
    }
    if (any_cuda && any_cpu) {
        snprintf(err, errlen,
                 "device \"%s\": some ranks train on CUDA and others on the CPU (rank %d on %s); "
                 "give every rank a device or say \"cpu\"",
                 t->cfg.device, gpu_comm_rank(c), t->cuda ? "CUDA" : "the CPU");
        return GPU_EINVAL;
    }
    return 0;
}

static int bcast_id(void *ctx, void *buf, size_t bytes)
{
    return gpu_comm_bcast(ctx, buf, bytes);
}

/* CUDA ranks: NCCL through the twin, over the CPU's buckets (c NULL: one rank, no MPI). */
static int join_nccl(gpu_trainer *t, gpu_comm *c, char *err, size_t errlen)
{
    size_t lo[t->ntensors], hi[t->ntensors];
    const gpu_dist_config *d = &t->cfg.dist;
    gpu_cuda_comm_plan p = {
        .world = gpu_comm_size(c),
        .rank = gpu_comm_rank(c),
        .hook = d->hook,
        .nbuckets = gpu_comm_buckets(t->offsets, t->counts, t->ntensors, d->bucket_mb, lo, hi),
        .lo = lo,
        .hi = hi,
        .bcast = c ? bcast_id : NULL,
        .bcast_ctx = c,
    };
    return gpu_cuda_twin_comm(t->cuda, &p, &t->mem, err, errlen);
}

/* See gpu/twin.h. */
int gpu_trainer_nccl_alone(gpu_trainer *t, char *err, size_t errlen)
{
    return t->cuda ? join_nccl(t, NULL, err, errlen) : GPU_EINVAL;
}

/* See gpu.h. */
int gpu_trainer_set_comm(gpu_trainer *t, gpu_comm *c, char *err, size_t errlen)
{
    const gpu_dist_config *d = &t->cfg.dist;
    int n = gpu_comm_size(c), rc;
    if (n != d->world_size) {
        snprintf(err, errlen,
                 "distributed.world_size: the job asks for %d ranks but was started with %d",
                 d->world_size, n);
        return GPU_EINVAL;
    }
    if ((rc = same_backend(t, c, err, errlen)))
        return rc;
    if (gpu_comm_rank(c) == 0 && !(t->rank_busy = calloc((size_t)n, sizeof(*t->rank_busy))))
        return GPU_ENOMEM;
    rc = t->cuda ? join_nccl(t, c, err, errlen)
                 : gpu_comm_plan(c, t->grads, t->offsets, t->counts, t->ntensors, d->hook,
                                 d->bucket_mb, err, errlen);
    if (rc)
        return rc;
    t->comm = c;
    t->rank = gpu_comm_rank(c);
    t->world = n;
    return 0;
}

/* The next global batch of B samples (every rank draws the batch world 1 would, from the
 * same shuffle), of which this rank keeps its share: rows
 * [rank B/world, (rank + 1) B/world) at the front of the batch buffers. draw counts the
 * batches drawn in the step (micro-steps), so that GPT batches stay a function of (seed,
 * step, draw) alone. */
static void next_batch(gpu_trainer *t, int B, int draw)
{
    int n = gpu_dataset_count(t->train), b = B / t->world, first = t->rank * b;
    if (t->gpt) {
        /* batches depend on (seed, step) alone, so a resumed job draws the same ones */
        size_t T = (size_t)t->gpt->seq_len;
        int K = t->cfg.grad_accum_steps;
        int64_t s = t->step + t->skipped;
        int64_t k = K > 1 ? (s - 1) * K + draw + 1 : s;
        gpu_dataset_sample_seq(t->train, t->cfg.seed, k, B, (int)T, t->xtok, t->ybatch);
        if (first > 0) {
            memmove(t->xtok, t->xtok + first * T, sizeof(int) * b * T);
            memmove(t->ybatch, t->ybatch + first * T, sizeof(int) * b * T);
        }
        return;
    }
    int idx[B];
    for (int i = 0; i < B; i++) {
        if (t->perm_pos >= n)
            shuffle(t);
        idx[i] = t->perm[t->perm_pos++];
    }
    gpu_dataset_gather(t->train, idx + first, b, t->xbatch, t->ybatch);
}

static gpu_mlp_weights weights_view(gpu_trainer *t)
{
    gpu_mlp_weights w = {t->work, t->cfg.dtype, NULL, NULL, NULL, NULL};
    if (t->fp8_state) {
        w.fp8 = &t->fp8;
        w.fp8_block = t->fp8_block;
    }
    if (t->cfg.dtype != GPU_FP32 && t->master)
        w.master = t->master;
    if (t->copy_ready)
        w.in_grads = t->grads;
    return w;
}

/* See gpu.h. */
void gpu_profile_add(gpu_profile *p, const char *name, double ms)
{
    int i = 0;
    while (i < p->n && strcmp(p->phase[i].name, name) != 0)
        i++;
    if (i == p->n) {
        if (p->n == GPU_PROFILE_MAX_PHASES)
            return;
        snprintf(p->phase[i].name, sizeof(p->phase[i].name), "%s", name);
        p->n++;
    }
    p->phase[i].ms += ms;
    p->phase[i].calls++;
}

/* A profiled CPU step's phase: the time since *t0, which becomes now. */
static void cpu_phase(gpu_trainer *t, const char *name, double *t0)
{
    double now = gpu_now();
    if (t->profiling)
        gpu_profile_add(&t->prof, name, (now - *t0) * 1e3);
    *t0 = now;
}

/* The trainer's gpu_grad_ready hook: a later micro-step's gradients are added to the ones
 * gathered so far (in blocks of 16384 on the OpenMP team from 2^15 elements: elementwise, so
 * the same bits with any number of threads), and the last micro-step's go to the all-reduce. */
static void grads_ready(void *ctx, size_t off, size_t count)
{
    gpu_trainer *t = ctx;
    const size_t block = 16384;
    size_t nblocks = (count + block - 1) / block;
    if (t->micro > 0) {
#pragma omp parallel for schedule(static) if (count >= (size_t)1 << 15)
        for (size_t b = 0; b < nblocks; b++) {
            size_t lo = b * block, len = count - lo < block ? count - lo : block;
            float *g = t->grads + off + lo;
            const float *a = t->accum + off + lo;
            for (size_t i = 0; i < len; i++)
                g[i] += a[i];
        }
    }
    if (t->comm && t->micro == t->cfg.grad_accum_steps - 1)
        gpu_comm_ready(t->comm, off, count);
}

/* The model's forward and backward on the current batch of B rows, collecting into diag
 * (NULL: off), backward seeded with seed. With ready (NULL: none) the gradients of micro-step
 * t->micro > 0 go to accum and the hook adds them up. */
static int forward_backward(gpu_trainer *t, int B, float seed, const gpu_grad_ready *ready,
                            double *loss, gpu_diag *diag)
{
    gpu_mlp_weights w = weights_view(t);
    float *dst = ready && t->micro > 0 ? t->accum : t->grads;
    int correct, rc;
    double t0 = gpu_now();
    if (t->gpt)
        rc = gpu_gpt_forward(t->gpt, &w, t->xtok, t->ybatch, B, t->acts, t->scratch, diag, loss,
                             &correct);
    else
        rc = gpu_mlp_forward(&t->mlp, &w, t->xbatch, t->ybatch, B, t->acts, t->scratch, loss,
                             &correct, diag);
    cpu_phase(t, "forward", &t0);
    if (rc)
        return rc;
    if (t->gpt)
        rc = gpu_gpt_backward(t->gpt, &w, t->xtok, t->ybatch, B, seed, t->acts, t->scratch, diag,
                              dst, ready);
    else
        rc = gpu_mlp_backward(&t->mlp, &w, t->ybatch, B, seed, t->acts, t->scratch, dst, diag,
                              ready);
    t->copy_ready = false; /* the gradients have replaced it */
    cpu_phase(t, "backward", &t0);
    return rc;
}

/* Clip coefficient for global-norm clipping of the unscaled gradients. */
static float clip_coef(const gpu_optim_config *o, double norm)
{
    if (o->grad_clip <= 0.0f || !(norm > o->grad_clip))
        return 1.0f;
    return (float)(o->grad_clip / (norm + 1e-6));
}

static void apply_update(gpu_trainer *t, double lr, float gmul, gpu_step_metrics *m)
{
    const gpu_job_config *c = &t->cfg;
    size_t P = (size_t)gpu_trainer_params(t);
    t->applied++;
    if (t->copy_in_grads) {
        gpu_optim_matrix mats[GPU_MAX_LAYERS];
        for (int l = 0; l < t->mlp.nlin; l++)
            mats[l] = (gpu_optim_matrix){t->mlp.w_off[l], t->mlp.width[l + 1], t->mlp.width[l]};
        gpu_optim_update_in_grads(&c->optim, lr, t->applied, gmul, t->master, t->grads, t->m, t->v,
                                  P, mats, t->mlp.nlin, c->dtype);
        t->copy_ready = true;
    } else if (t->master) {
        void *work = t->work == t->master ? NULL : t->work;
        gpu_optim_update(&c->optim, lr, t->applied, gmul, t->master, t->grads, t->m, t->v, P, work,
                         c->dtype);
    } else {
        /* tensor by tensor (the update is elementwise, so this equals one call over the
         * block) to know each layer's lost updates */
        int64_t lost = 0;
        size_t es = gpu_dtype_size(c->dtype);
        for (int i = 0; i < t->ntensors; i++) {
            size_t off = t->offsets[i];
            gpu_optim_update_lowp(&c->optim, lr, t->applied, gmul, (uint8_t *)t->work + off * es,
                                  c->dtype, t->grads + off, t->m + off, t->v ? t->v + off : NULL,
                                  t->counts[i], &t->tensor_lost[i]);
            lost += t->tensor_lost[i];
        }
        m->lost_updates = lost;
        t->lost_total += lost;
    }
}

/* The diagnostics layer a parameter tensor belongs to: its name without the last
 * component ("fc1.weight" -> "fc1"); -1 when the model reported no such layer. */
static int tensor_layer(const gpu_trainer *t, int i)
{
    const char *name = t->names[i], *dot = strrchr(name, '.');
    size_t len = dot ? (size_t)(dot - name) : strlen(name);
    for (int l = 0; l < t->diag->nlayers; l++)
        if (strncmp(t->diag->layer[l].name, name, len) == 0 && t->diag->layer[l].name[len] == 0)
            return l;
    return -1;
}

/* Collect (on) the fp8 casts' counts, amaxes and scales of the step, or stop (!on). */
static void fp8_collect(gpu_trainer *t, bool on)
{
    int rows = t->fp8.ngemm * GPU_FP8_ROLES;
    if (!t->fp8_state)
        return;
    t->fp8.stats = on ? t->fp8_stats : NULL;
    t->fp8.amax = t->fp8_damax;
    t->fp8.scale_used = t->fp8_dscale;
    if (!on)
        return;
    memset(t->fp8_stats, 0, sizeof(*t->fp8_stats) * (size_t)rows);
    for (int r = 0; r < rows; r++)
        t->fp8_damax[r] = 0.0f, t->fp8_dscale[r] = NAN;
}

/* An fp8 layer's operand r (a row of the scaling state) as the diagnostics report it. */
static void fp8_role_stat(const gpu_trainer *t, int r, double *v)
{
    const gpu_fp8_cast_stats *st = &t->fp8_stats[r];
    double amax = t->fp8_damax[r], scale = t->fp8_dscale[r];
    double top = gpu_fp8_max(gpu_fp8_role_format(&t->cfg.fp8, r % GPU_FP8_ROLES));
    v[0] = amax;
    v[1] = scale;
    v[2] = amax > 0 ? log2(top / (amax * scale)) : INFINITY; /* NaN for a NaN amax */
    v[3] = st->n ? (double)st->saturated / (double)st->n : 0.0;
    v[4] = st->nonzero ? (double)st->underflow / (double)st->nonzero : 0.0;
}

/* The fp8 fields of the layers whose GEMMs ran in fp8. */
static void fp8_layer_stats(gpu_trainer *t)
{
    for (int g = 0; t->fp8_state && g < t->fp8.ngemm; g++) {
        char name[48];
        fp8_gemm_name(t, g, name, sizeof(name));
        for (int l = 0; l < t->diag->nlayers; l++) {
            gpu_layer_stat *s = &t->lstats[l];
            double v[GPU_FP8_ROLES][5];
            if (strcmp(s->name, name) != 0 || !t->fp8.on[g])
                continue;
            for (int r = 0; r < GPU_FP8_ROLES; r++)
                fp8_role_stat(t, g * GPU_FP8_ROLES + r, v[r]);
            s->fp8 = true;
#define FP8_PUT(r, k)                                                                              \
    s->fp8_##r##_amax = v[k][0], s->fp8_##r##_scale = v[k][1], s->fp8_##r##_headroom = v[k][2],    \
    s->fp8_##r##_saturated = v[k][3], s->fp8_##r##_underflow = v[k][4]
            FP8_PUT(in, GPU_FP8_X);
            FP8_PUT(w, GPU_FP8_W);
            FP8_PUT(grad, GPU_FP8_G);
#undef FP8_PUT
        }
    }
    fp8_collect(t, false);
}

/* Per-layer statistics of a collecting step, with the lost updates when they were
 * counted (an update was applied without master weights), and the fp8 layers' operands. */
static void layer_stats(gpu_trainer *t, bool updated)
{
    int64_t lost[GPU_DIAG_MAX_LAYERS] = {0}, count[GPU_DIAG_MAX_LAYERS] = {0};
    gpu_diag_stats(t->diag, t->lstats);
    fp8_layer_stats(t); /* the device's counts are in fp8_stats too */
    if (!updated || t->master)
        return;
    for (int i = 0; i < t->ntensors; i++) {
        int l = tensor_layer(t, i);
        if (l < 0)
            continue;
        lost[l] += t->tensor_lost[i];
        count[l] += (int64_t)t->counts[i];
    }
    for (int l = 0; l < t->diag->nlayers; l++)
        if (count[l] > 0)
            t->lstats[l].lost_updates = (double)lost[l] / (double)count[l];
}

static void advise(gpu_trainer *t, const gpu_step_metrics *m, bool found_inf)
{
    const gpu_job_config *c = &t->cfg;
    gpu_diag_context ctx = {
        .dtype = c->dtype,
        .master_weights = t->master != NULL,
        .mode = c->scaler.mode,
        .scale = m->loss_scale,
        .next_scale = t->scaler.scale,
        .min_scale = c->scaler.min_scale,
        .max_scale = c->scaler.max_scale,
        .floor_streak = t->scaler.floor_streak,
        .floor_patience = c->scaler.floor_patience,
        .comm_tensor = t->comm_overflow && t->comm_first >= 0 ? t->names[t->comm_first] : NULL,
        .hook = c->dist.hook,
        .loss = m->loss,
        .overflow = found_inf,
        .fp8 = c->fp8.on ? &c->fp8 : NULL,
    };
    gpu_diag_advise(t->advisor, t->diagnosed ? t->diag : NULL, t->lstats, &ctx);
}

/* The failure at the scale's floor, with the step's diagnosis (every overflowing step
 * collects one) and the tensors whose gradients held inf/NaN. */
static void floor_message(const gpu_trainer *t, float scale_used, char *err, size_t errlen)
{
    const gpu_job_config *c = &t->cfg;
    gpu_diag_context ctx = {.dtype = c->dtype, .scale = scale_used, .mode = c->scaler.mode};
    char why[256];
    gpu_diag_explain(t->diagnosed ? t->diag : NULL, t->lstats, &ctx, why, sizeof(why));
    int n = snprintf(err, errlen,
                     "loss scale stuck at its floor %g for %d overflowing steps in a row: %s; "
                     "tensors with inf/NaN gradients:",
                     (double)c->scaler.min_scale, t->scaler.floor_streak, why);
    int listed = 0;
    for (int i = 0; i < t->ntensors && n > 0 && (size_t)n < errlen; i++)
        if (t->stats[i].nonfinite > 0) {
            n += snprintf(err + n, errlen - (size_t)n, " %s", t->names[i]);
            listed++;
        }
    if (!listed && n > 0 && (size_t)n < errlen)
        snprintf(err + n, errlen - (size_t)n, " none (the loss itself is not finite)");
}

/* After a forward and backward of an fp8 job: the staging amaxes reduced across ranks (MAX, one
 * all-reduce for every GEMM and role, as Transformer Engine reduces them) and delayed scaling's
 * update. Not after a recomputation, which records nothing. */
static int fp8_sync(gpu_trainer *t)
{
    if (!t->fp8_state || t->cfg.fp8.recipe != GPU_FP8_DELAYED)
        return 0;
    if (t->comm) {
        gpu_fp8_staging_get(&t->fp8, t->fp8_amax);
        int rc = gpu_comm_max(t->comm, t->fp8_amax, t->fp8.ngemm * GPU_FP8_ROLES);
        if (rc)
            return rc;
        gpu_fp8_staging_set(&t->fp8, t->fp8_amax);
    }
    gpu_fp8_update(&t->fp8);
    return 0;
}

/* The micro-steps of one optimizer step: forward and backward on each of
 * grad_accum_steps batches (the first one already drawn), the gradients summed, each
 * backward seeded with S / grad_accum_steps (PyTorch's loss / accumulation steps); with
 * several ranks the last backward's gradients are all-reduced as they become ready. *loss:
 * the mean of the micro-steps' losses; *pre_nonfinite: this rank's gradients held inf/NaN
 * before the all-reduce. */
static int micro_steps(gpu_trainer *t, int b, double *loss, bool *pre_nonfinite,
                       gpu_step_metrics *m)
{
    const int K = t->cfg.grad_accum_steps;
    const gpu_grad_ready hook = {grads_ready, t};
    const gpu_grad_ready *ready = K > 1 || t->comm ? &hook : NULL;
    float seed = K > 1 ? t->scaler.scale / (float)K : t->scaler.scale;
    double sum = 0.0, one;
    int rc = 0;

    if (t->comm)
        gpu_comm_begin(t->comm);
    if (t->fp8_state)
        gpu_fp8_save_scales(&t->fp8);
    for (t->micro = 0; t->micro < K; t->micro++) {
        if (t->micro > 0)
            next_batch(t, t->cfg.batch_size, t->micro);
        bool last = t->micro == K - 1;
        rc = forward_backward(t, b, seed, ready, &one, last && t->diagnosed ? t->diag : NULL);
        if (rc)
            break;
        sum += one;
        /* the last micro-step's after its all-reduce (MPI is the comm thread's until then) */
        if (!last && (rc = fp8_sync(t)))
            break;
    }
    t->micro = 0;
    *loss = sum / K;
    if (rc || !t->comm)
        return rc ? rc : fp8_sync(t);
    gpu_comm_stats cs;
    double t0 = gpu_now();
    rc = gpu_comm_finish(t->comm, &cs);
    if (rc == 0)
        rc = fp8_sync(t);
    cpu_phase(t, "comm.wait", &t0);
    m->comm_bytes = cs.bytes;
    m->comm_ms = cs.ms;
    m->comm_exposed_ms = cs.exposed_ms;
    *pre_nonfinite = cs.pre_nonfinite;
    return rc;
}

/* With several ranks: agree on the step (found-inf, norm, loss) and check that every
 * rank's scaler is the same. */
static int agree(gpu_trainer *t, bool pre_nonfinite, double *loss, bool *found_inf,
                 double *sumsq, char *err, size_t errlen)
{
    gpu_comm_ctl v = {.loss = *loss,
                      .found_inf = *found_inf,
                      .pre_nonfinite = pre_nonfinite,
                      .sumsq = *sumsq,
                      .scale = t->scaler.scale,
                      .tracker = t->scaler.growth_tracker};
    int rc = gpu_comm_control(t->comm, &v);
    if (rc) {
        snprintf(err, errlen, "%s", gpu_comm_error(t->comm));
        return rc;
    }
    if (!v.scalers_equal) {
        snprintf(err, errlen, "rank %d: the ranks' loss scalers differ at step %lld", t->rank,
                 (long long)t->step);
        return GPU_ECOMM;
    }
    *loss = v.loss;
    *found_inf = v.found_inf;
    *sumsq = v.sumsq;
    /* inf/NaN after the all-reduce that no rank had before it: the compressed sum */
    t->comm_overflow = v.found_inf && !v.pre_nonfinite;
    t->comm_first = -1;
    for (int i = t->ntensors - 1; t->comm_overflow && i >= 0 && t->comm_first < 0; i--)
        if (t->stats[i].nonfinite > 0)
            t->comm_first = i;
    return 0;
}

/* Around recomputing a step (start, then !start): an fp8 job casts with the scales the step
 * began with and records no amax, so that the recomputation sees the step's numbers and
 * leaves the scaling state as it was. */
static void fp8_recompute(gpu_trainer *t, bool start)
{
    if (!t->fp8_state)
        return;
    gpu_fp8_swap_scales(&t->fp8);
    t->fp8.record = !start;
}

/* The step on the CPU after the batch: forward, backward (micro-steps, all-reduce), unscale,
 * update, scaler. Returns 0, GPU_ESCALE_FLOOR (the step is complete) or an error. */
static int step_cpu(gpu_trainer *t, gpu_step_metrics *m, bool *found_inf, char *err,
                    size_t errlen)
{
    const gpu_job_config *c = &t->cfg;
    int b = gpu_rank_batch(c);
    double loss, sumsq;
    bool pre_nonfinite = false;
    int rc;

    if (t->diagnosed)
        gpu_diag_begin(t->diag, t->scaler.scale);
    fp8_collect(t, t->diagnosed);
    rc = micro_steps(t, b, &loss, &pre_nonfinite, m);
    if (rc) {
        if (rc == GPU_ECOMM)
            snprintf(err, errlen, "%s", gpu_comm_error(t->comm));
        return rc;
    }
    double t0 = gpu_now();
    gpu_unscale(t->grads, t->offsets, t->counts, t->ntensors, gpu_scaler_inv(&t->scaler), t->stats,
                found_inf, &sumsq);
    cpu_phase(t, "unscale", &t0);
    if (t->comm && (rc = agree(t, pre_nonfinite, &loss, found_inf, &sumsq, err, errlen)))
        return rc;
    if (*found_inf && !t->diagnosed) {
        /* diagnose the overflow: the same batch and weights again, collecting (this rank's
         * share; no communication) */
        double again;
        t->diagnosed = true;
        gpu_diag_begin(t->diag, t->scaler.scale);
        fp8_collect(t, true);
        fp8_recompute(t, true);
        rc = forward_backward(t, b, t->scaler.scale, NULL, &again, t->diag);
        fp8_recompute(t, false);
        if (rc)
            return rc;
    }
    m->loss = loss;
    m->grad_norm = *found_inf ? NAN : sqrt(sumsq);
    t0 = gpu_now();
    if (!*found_inf)
        apply_update(t, t->lr, clip_coef(&c->optim, m->grad_norm), m);
    cpu_phase(t, "optimizer", &t0);
    if (t->diagnosed)
        layer_stats(t, !*found_inf);
    return gpu_scaler_update(&t->scaler, &c->scaler, *found_inf);
}

/* The step on the CUDA device after the batch: the whole step there, then the host takes the
 * scalars of its snapshot. *ms: the step's device time (CUDA events). Returns as step_cpu. */
static int step_cuda(gpu_trainer *t, gpu_step_metrics *m, bool *found_inf, double *ms,
                     char *err, size_t errlen)
{
    gpu_cuda_step_out o;
    const void *x = t->gpt ? (const void *)t->xtok : (const void *)t->xbatch;
    int rc = gpu_cuda_twin_step(t->cuda, x, t->ybatch, gpu_rank_batch(&t->cfg), t->lr,
                                t->diagnosed ? t->diag : NULL, t->stats, t->tensor_lost, &o,
                                t->profiling ? &t->prof : NULL);
    if (rc == GPU_ECOMM)
        snprintf(err, errlen, "rank %d: the NCCL all-reduce failed (the rank's log says why)",
                 t->rank);
    if (rc)
        return rc;
    t->scaler = o.scaler;
    t->applied = o.applied;
    t->lost_total = o.lost_total;
    m->comm_bytes = o.comm_bytes;
    m->comm_ms = o.comm_ms;
    m->comm_exposed_ms = o.comm_exposed_ms;
    if (t->comm) {
        /* the ranks reduced the same gradients: this checks it (the scalers after the
         * update), and averages the loss */
        double sumsq = o.found_inf ? 0.0 : o.grad_norm * o.grad_norm;
        if ((rc = agree(t, o.pre_nonfinite, &o.loss, &o.found_inf, &sumsq, err, errlen)))
            return rc;
    }
    *found_inf = o.found_inf;
    *ms = o.step_ms;
    m->loss = o.loss;
    m->grad_norm = o.grad_norm;
    m->lost_updates = o.lost_updates;
    /* the device cannot run an overflowing step again: the next step collects instead */
    t->diag_next = o.found_inf && !t->diagnosed;
    if (t->diagnosed)
        layer_stats(t, !o.found_inf);
    return o.floor_failed ? GPU_ESCALE_FLOOR : 0;
}

/* The GEMM libraries' own scratch (oneDNN's scratchpads, grown on first use) is part of a
 * CPU job's workspace: add what they hold now to the planned workspace. */
static void count_lib_scratch(gpu_trainer *t)
{
    int64_t lib = (int64_t)gpu_gemm_lib_bytes();
    t->mem.workspace += lib - t->lib_bytes;
    t->mem.total += lib - t->lib_bytes;
    t->lib_bytes = lib;
}

/* See gpu.h. The header of every block; in guard mode also the pattern around it. */
int gpu_trainer_check(const gpu_trainer *t, char *err, size_t errlen)
{
    const void *blocks[] = {t->master, t->work, t->grads, t->accum, t->m, t->v, t->acts,
                            t->scratch};
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) {
        int rc = gpu_block_check(blocks[i], err, errlen);
        if (rc)
            return rc;
    }
    return 0;
}

/* One training step; see gpu.h. */
int gpu_trainer_step(gpu_trainer *t, gpu_step_metrics *m, char *err, size_t errlen)
{
    const gpu_job_config *c = &t->cfg;
    int B = c->batch_size, rc;
    double t0 = gpu_now(), device_ms = 0.0;
    bool found_inf = false;
    char dummy[8];

    memset(m, 0, sizeof(*m));
    m->step = ++t->step;
    t->lr = gpu_lr_at(&c->optim, t->step - 1, c->steps);
    m->lr = (float)t->lr;
    m->loss_scale = t->scaler.scale;
    t->diagnosed = (c->diagnostics_every > 0 && t->step % c->diagnostics_every == 0) ||
                   t->diag_next;
    t->diag_next = false;
    t->profiling = t->profile_next;
    t->profile_next = false;
    if (t->profiling)
        memset(&t->prof, 0, sizeof(t->prof));
    next_batch(t, B, 0);
    rc = t->cuda ? step_cuda(t, m, &found_inf, &device_ms, err ? err : dummy,
                             err ? errlen : sizeof(dummy))
                 : step_cpu(t, m, &found_inf, err ? err : dummy, err ? errlen : sizeof(dummy));
    if (t->profiling)
        t->profiled = rc == 0 || rc == GPU_ESCALE_FLOOR;
    t->profiling = false;
    if (gpu_trainer_check(t, err, errlen) != 0) /* before anything reads what it wrote */
        return GPU_EGUARD;
    if (rc && rc != GPU_ESCALE_FLOOR)
        return rc;
    advise(t, m, found_inf);
    m->diagnosed = t->diagnosed;
    m->overflow = found_inf;
    m->skipped = found_inf;
    m->overflow_total = t->scaler.overflow_total;
    m->skipped_total = t->scaler.skipped_total;
    m->lost_total = t->lost_total;
    m->step_ms = t->cuda ? device_ms : (gpu_now() - t0) * 1e3;
    m->step_ms_max = m->step_ms;
    if (t->comm && gpu_comm_step_time(t->comm, m->step_ms, m->step_ms - m->comm_exposed_ms,
                                      &m->step_ms_max, &m->slowest_rank, t->rank_busy)) {
        if (err)
            snprintf(err, errlen, "%s", gpu_comm_error(t->comm));
        return GPU_ECOMM;
    }
    m->samples_per_s = (double)B * c->grad_accum_steps / (m->step_ms_max * 1e-3);
    if (t->gpt)
        m->tokens_per_s = m->samples_per_s * t->gpt->seq_len;
    if (!t->cuda)
        count_lib_scratch(t);
    m->mem = t->mem;
    m->peak = t->mem;
    if (rc == GPU_ESCALE_FLOOR && err)
        floor_message(t, m->loss_scale, err, errlen);
    return rc;
}

/* See gpu.h. */
void gpu_trainer_profile_next(gpu_trainer *t)
{
    t->profile_next = true;
}

const gpu_profile *gpu_trainer_profile(const gpu_trainer *t)
{
    return t->profiled ? &t->prof : NULL;
}

/* The last step's per-layer results; see gpu.h. */
int gpu_trainer_diagnostics(const gpu_trainer *t, const gpu_layer_stat **layers, int *n,
                            const char **first_nonfinite_layer, const char **where)
{
    const gpu_diag *d = t->diag;
    bool any = t->diagnosed && d->first_nonfinite >= 0;
    if (first_nonfinite_layer)
        *first_nonfinite_layer = any ? d->layer[d->first_nonfinite].name : NULL;
    if (where)
        *where = any ? (d->first_in_forward ? "forward" : "backward") : NULL;
    if (t->diagnosed && t->comm_overflow && t->comm_first >= 0) {
        /* the ranks' own passes were finite: the all-reduce made the first inf/NaN */
        int l = tensor_layer(t, t->comm_first);
        if (first_nonfinite_layer)
            *first_nonfinite_layer = l >= 0 ? d->layer[l].name : t->names[t->comm_first];
        if (where)
            *where = "comm";
    }
    *layers = t->lstats;
    *n = t->diagnosed ? d->nlayers : 0;
    return t->diagnosed ? 0 : GPU_EINVAL;
}

/* See gpu.h. */
int gpu_trainer_rank_busy(const gpu_trainer *t, const double **busy)
{
    *busy = t->rank_busy;
    return t->rank_busy ? t->world : 0;
}

/* See gpu.h. */
int gpu_trainer_comm_overflow(const gpu_trainer *t, const char **names, int max)
{
    int n = 0;
    for (int i = t->ntensors - 1; t->comm_overflow && i >= 0; i--)
        if (t->stats[i].nonfinite > 0 && n < max)
            names[n++] = t->names[i];
    return n;
}

/* The last step's new recommendations; see gpu.h. */
int gpu_trainer_recommendations(const gpu_trainer *t, const gpu_recommendation **recs, int *n)
{
    *recs = t->advisor->rec;
    *n = t->advisor->nnew;
    return 0;
}

/* Evaluate on the eval set (or the training set); see gpu.h. */
/* Validation of a GPT: mean next-token loss and accuracy over evenly spaced
 * non-overlapping windows of the eval split (at most 32 global batches' worth), run in
 * batches of one rank's rows. */
static int eval_gpt(gpu_trainer *t, gpu_eval_result *r)
{
    const gpu_dataset *d = t->eval ? t->eval : t->train;
    gpu_mlp_weights w = weights_view(t);
    int B = gpu_rank_batch(&t->cfg), T = t->gpt->seq_len, G = t->cfg.batch_size;
    int64_t nwin = gpu_dataset_nwindows(d, T), use = nwin < 32 * (int64_t)G ? nwin : 32 * G;
    double total = 0.0;
    int64_t right = 0, done = 0;

    for (int64_t start = 0; start < use; start += B) {
        int b = use - start < B ? (int)(use - start) : B, correct;
        double loss;
        for (int i = 0; i < b; i++)
            gpu_dataset_window(d, (start + i) * nwin / use, T, t->xtok + (size_t)i * T,
                               t->ybatch + (size_t)i * T);
        if (t->cuda) {
            int rc = gpu_cuda_twin_eval(t->cuda, t->xtok, t->ybatch, b, &loss, &correct);
            if (rc)
                return rc;
            total += loss; /* the summed loss of the b x T positions */
        } else {
            int rc = gpu_gpt_forward(t->gpt, &w, t->xtok, t->ybatch, b, t->acts, t->scratch,
                                     NULL, &loss, &correct);
            if (rc)
                return rc;
            total += loss * b * T;
        }
        right += correct;
        done += (int64_t)b * T;
    }
    r->count = done;
    r->loss = done ? total / (double)done : NAN;
    r->accuracy = done ? (double)right / (double)done : NAN;
    return 0;
}

int gpu_trainer_eval(gpu_trainer *t, gpu_eval_result *r)
{
    if (t->gpt) {
        t->fp8.record = false; /* evaluation leaves the scaling state alone */
        int rc = eval_gpt(t, r);
        t->fp8.record = true;
        return rc;
    }
    const gpu_dataset *d = t->eval ? t->eval : t->train;
    gpu_mlp_weights w = weights_view(t);
    int n = gpu_dataset_count(d), B = gpu_rank_batch(&t->cfg); /* rows the blocks hold */
    double total = 0.0;
    int64_t right = 0;
    int idx[B], rc = 0;

    t->fp8.record = false; /* evaluation leaves the scaling state alone */
    for (int start = 0; start < n && rc == 0; start += B) {
        int b = n - start < B ? n - start : B, correct;
        double loss;
        for (int i = 0; i < b; i++)
            idx[i] = start + i;
        gpu_dataset_gather(d, idx, b, t->xbatch, t->ybatch);
        if (t->cuda) {
            rc = gpu_cuda_twin_eval(t->cuda, t->xbatch, t->ybatch, b, &loss, &correct);
            total += loss; /* the summed loss of the b rows */
        } else {
            rc = gpu_mlp_forward(&t->mlp, &w, t->xbatch, t->ybatch, b, t->acts, t->scratch, &loss,
                                 &correct, NULL);
            total += loss * b;
        }
        right += correct;
    }
    t->fp8.record = true;
    r->count = n;
    r->loss = total / n;
    r->accuracy = (double)right / n;
    return rc;
}

static void state_add(gpu_state_tensor *v, int *n, const char *prefix, const char *name,
                      const char *dtype, void *data, size_t elems, size_t esize, int rows,
                      int cols)
{
    gpu_state_tensor *e = &v[(*n)++];
    snprintf(e->name, sizeof(e->name), "%s%s", prefix, name);
    e->dtype = dtype;
    e->ndim = cols > 0 ? 2 : 1;
    e->shape[0] = rows;
    e->shape[1] = cols;
    e->data = data;
    e->bytes = elems * esize;
}

/* The state tensors (on CUDA, the device blocks copied to the host first); see gpu.h. */
int gpu_trainer_state(gpu_trainer *t, gpu_state_tensor **out, int *n)
{
    static const char *const names[] = {"F32", "F16", "BF16"};
    int ds = t->perm ? gpu_dataset_count(t->train) : 0;
    gpu_dtype wdt = t->master ? GPU_FP32 : t->cfg.dtype;
    uint8_t *w = t->master ? (uint8_t *)t->master : (uint8_t *)t->work;
    const char *mname = t->cfg.optim.type == GPU_OPT_ADAMW ? "optim.exp_avg."
                                                           : "optim.momentum_buffer.";
    if (t->cuda) {
        int rc = gpu_cuda_twin_download(t->cuda, NULL);
        if (rc)
            return rc;
    }
    t->copy_ready = false; /* the caller may write the weights */
    gpu_state_tensor *v = calloc((size_t)t->ntensors * 3 + 2, sizeof(*v));
    if (!v)
        return GPU_ENOMEM;
    *n = 0;
    for (int i = 0; i < t->ntensors; i++) {
        int rows = (int)t->shape[i][0], cols = t->ndim[i] == 2 ? (int)t->shape[i][1] : 0;
        size_t off = t->offsets[i], cnt = t->counts[i];
        state_add(v, n, "", t->names[i], names[wdt], w + off * gpu_dtype_size(wdt), cnt,
                  gpu_dtype_size(wdt), rows, cols);
        state_add(v, n, mname, t->names[i], "F32", t->m + off, cnt, 4, rows, cols);
        if (t->v)
            state_add(v, n, "optim.exp_avg_sq.", t->names[i], "F32", t->v + off, cnt, 4, rows,
                      cols);
    }
    if (t->perm) /* classification data: the shuffled order (sequence batches are stateless) */
        state_add(v, n, "", "data.order", "I32", t->perm, (size_t)ds, sizeof(int), ds, 0);
    if (t->fp8_state) { /* a row per GEMM and role: scale, scale_inv, amax history */
        int rows = t->fp8.ngemm * GPU_FP8_ROLES;
        state_add(v, n, "", "fp8.scaling", "F32", t->fp8_state, (size_t)rows * (2 + t->fp8.len), 4,
                  rows, 2 + t->fp8.len);
    }
    *out = v;
    return 0;
}

void gpu_trainer_get_scalars(const gpu_trainer *t, gpu_state_scalars *out)
{
    memset(out, 0, sizeof(*out));
    out->step = t->step;
    out->applied = t->applied;
    out->lost_total = t->lost_total;
    out->perm_pos = t->perm_pos;
    out->skipped = t->skipped;
    out->scaler = t->scaler;
    memcpy(out->rng, t->rng.s, sizeof(out->rng));
    out->world_size = t->world;
}

/* Restore scalars and the working copy (and, on CUDA, the device blocks); see gpu.h. */
int gpu_trainer_set_scalars(gpu_trainer *t, const gpu_state_scalars *in)
{
    int n = t->perm ? gpu_dataset_count(t->train) : 0;
    if (in->step < 0 || in->step > t->cfg.steps || in->applied < 0 || in->applied > in->step ||
        in->perm_pos < 0 || in->perm_pos > n || in->skipped < 0 ||
        in->skipped > t->cfg.data.skip_batches || !(in->scaler.scale > 0.0f) ||
        !isfinite(in->scaler.scale) || (in->world_size != 0 && in->world_size != t->world))
        return GPU_EINVAL;
    for (int i = 0; i < n; i++)
        if (t->perm[i] < 0 || t->perm[i] >= n)
            return GPU_EINVAL;
    t->step = in->step;
    t->applied = in->applied;
    t->lost_total = in->lost_total;
    t->perm_pos = (int)in->perm_pos;
    t->scaler = in->scaler;
    memcpy(t->rng.s, in->rng, sizeof(in->rng));
    t->skipped = in->skipped; /* a branch that skips more skips the rest from here */
    skip_batches(t, t->cfg.data.skip_batches - in->skipped);
    if (t->master && t->work && t->work != t->master)
        gpu_cvt_from_f32(t->work, t->cfg.dtype, t->master, (size_t)gpu_trainer_params(t));
    else if (!t->master && t->cfg.dtype == GPU_BF16) /* bf16 weights read as they were stored */
        gpu_bf16_admit(t->work, (size_t)gpu_trainer_params(t));
    t->diag_next = false;
    if (t->cuda)
        return gpu_cuda_twin_upload(t->cuda, &t->scaler, t->applied, t->lost_total);
    return 0;
}

/* Where the trainer runs; see gpu.h. */
const char *gpu_trainer_device(const gpu_trainer *t)
{
    if (t->cuda)
        return gpu_cuda_twin_describe(t->cuda);
    return t->device_text[0] ? t->device_text : "cpu";
}

/* See gpu/twin.h. */
void gpu_trainer_keep_grads(gpu_trainer *t)
{
    t->copy_in_grads = t->copy_ready = false;
}

/* The last step's gradients; see gpu/twin.h. */
int gpu_trainer_grads(gpu_trainer *t, const float **grads)
{
    if (t->cuda) {
        int rc = gpu_cuda_twin_download(t->cuda, t->grads);
        if (rc)
            return rc;
    }
    *grads = t->grads;
    return 0;
}
