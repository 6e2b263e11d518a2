/*
 * cuda_train.c - the trainer's device twin (interface in gpu/twin.h, device conventions
 * in gpu/cuda/cuda_model.h): the blocks of a gpu_trainer on a CUDA device and whole training
 * steps run there.
 *
 * Memory: one cudaMalloc per block, with the CPU plan's element offsets for the
 * parameter-shaped ones: the fp32 master (the params of an fp32 job), the working copy in the
 * job's dtype (the weights themselves without master weights), the fp32 gradients, m and v;
 * the activation block and the workspace the device model plans (gpu_cuda_*_plan) for this
 * rank's share of the batch (gpu_rank_batch); the batch
 * (inputs, then labels or targets); a small block with the step state, the tensor table
 * (offsets, counts), the per-tensor statistics and lost updates, the diagnostics counters
 * and the loss and hit count. A pinned host block mirrors the small block (the snapshot the
 * host reads) and stages the batch. gpu_mem counts the device bytes in the CPU's categories
 * (the parameter blocks by the same formulas; activations the device plan's; workspace the
 * device workspace, the batch, the small block and cuBLASLt's workspace); the description
 * adds what cudaMemGetInfo says the job took.
 *
 * A step, on one stream (and NCCL's): the host batch is copied into the pinned staging area and
 * uploaded (cudaMemcpyAsync); begin (scale_used, inv); [diagnostics begin]; forward; backward
 * seeded on the device with the scale [with several ranks, the buckets' all-reduce on NCCL's
 * stream as backward reports them (cuda_comm.h), the compute stream waiting for the last
 * one]; unscale; clip; the optimizer (with master weights) or
 * the lowp optimizer (without); the scaler update; the snapshot of the state, statistics,
 * loss, lost updates [and diagnostics] into pinned memory; then ONE cudaStreamSynchronize at
 * the end: the only point where a step waits for the device. Its duration is measured with
 * two CUDA events (upload to snapshot).
 *
 * An fp8 job (the MLP or the GPT) adds two blocks, the scaling rows (uploaded with the
 * others, downloaded into the host's for a checkpoint) and the fp8 operands; after backward
 * and the gradients' all-reduce, the staged amaxes are reduced across the ranks (NCCL, MAX)
 * and delayed scaling's update runs on the device. A collecting step's casts count into
 * one gpu_cuda_fp8_counts per row of the small block, mirrored with the step's snapshot and
 * handed to the host's fp8 stats (train.c reports them as on the CPU).
 *
 * Differences from the CPU trainer: a step that overflows without collecting diagnostics is
 * not run again to collect them (the device does not know about the overflow until the
 * step's end); train.c collects them on the next step instead. Eval synchronises once per
 * batch (the staging area is reused). Everything else (losses, gradients, updates, the
 * scaler) follows the CPU within the tolerances tests/check_cuda_train.c states.
 *
 * Threads: a twin is driven by one thread at a time, like its trainer; every entry point
 * makes the twin's device current first. Host transfers of the blocks (create, download,
 * upload) are stream-ordered on the twin's stream and then synchronised.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_comm.h"
#include "gpu/cuda/cuda_model.h"
#include "gpu/cuda/cuda_util.h"
#include "gpu/fp8.h"
#include "gpu/twin.h"

/* The next region of `bytes` at *off (256-byte aligned); returns its offset. */
static size_t take(size_t *off, size_t bytes)
{
    size_t at = *off;
    *off = gpu_align256(at + bytes);
    return at;
}

/* Byte offsets of the small block (and of its pinned mirror). */
typedef struct {
    size_t state, offsets, counts, tstats, tlost, diag, fp8, loss, correct;
    size_t parts;                /* the unscale's partial sums: last, not mirrored on the host */
    size_t bytes;
} small_layout;

struct gpu_cuda_twin {
    gpu_cuda_host h;             /* borrowed host blocks (h.cfg points at cfg below) */
    gpu_job_config cfg;
    int device;
    char desc[320];
    size_t P;                    /* parameters */
    int B;                       /* batch size: rows of a batch at most */
    int rows;                    /* loss rows per sample: 1 (MLP) or seq_len (GPT) */
    size_t xsize;                /* input bytes per sample */
    size_t max_count;            /* the largest tensor */
    cudaStream_t stream;
    bool have_stream;
    cudaEvent_t ev[2];
    int nevents;
    gpu_cuda_prof *prof;         /* created by the first profiled step */
    gpu_cuda_blas *blas;
    /* device blocks */
    float *master;               /* NULL without master weights (16-bit jobs only) */
    void *work;                  /* == master for fp32 */
    float *grads, *m, *v;
    void *acts, *ws, *batch, *small;
    size_t acts_bytes, ws_bytes, batch_bytes;
    float *fp8_state; /* an fp8 job's scaling rows, and its fp8 operands' block */
    uint8_t *fp8_block;
    float *fp8_amax; /* with several ranks, at the fp8 block's end: the staged amaxes */
    size_t fp8_state_bytes, fp8_bytes;
    small_layout sl;
    void *x;                     /* in batch */
    int *y;
    /* pinned host: the small block's mirror, then the batch staging */
    uint8_t *pinned;
    void *h_x;
    int *h_y;
    gpu_mem mem;
    /* several ranks: the gradient all-reduce, and backward's hook into it */
    gpu_cuda_comm *comm;
    gpu_grad_ready ready;
};

/* fp8rows: an fp8 job's scaling rows, whose casts a collecting step counts (3 a GEMM). */
static void small_plan(small_layout *s, int ntensors, int fp8rows)
{
    size_t off = 0, nt = (size_t)ntensors;
    s->state = take(&off, sizeof(gpu_cuda_step_state));
    s->offsets = take(&off, nt * sizeof(size_t));
    s->counts = take(&off, nt * sizeof(size_t));
    s->tstats = take(&off, nt * sizeof(gpu_cuda_step_tstat));
    s->tlost = take(&off, nt * sizeof(unsigned long long));
    s->diag = take(&off, sizeof(gpu_cuda_diag));
    s->fp8 = take(&off, (size_t)fp8rows * sizeof(gpu_cuda_fp8_counts));
    s->loss = take(&off, sizeof(double));
    s->correct = take(&off, sizeof(int));
    s->parts = take(&off, GPU_CUDA_UNSCALE_PARTS * sizeof(double));
    s->bytes = off;
}

/* The object of type at byte offset off of the block at base. */
#define AT(base, off, type) ((type *)(void *)((uint8_t *)(base) + (off)))

static gpu_cuda_step_state *d_state(const gpu_cuda_twin *d)
{
    return AT(d->small, d->sl.state, gpu_cuda_step_state);
}

static size_t fp8_counts_bytes(const gpu_cuda_twin *d)
{
    return 3 * (size_t)d->h.fp8_ngemm * sizeof(gpu_cuda_fp8_counts);
}

static gpu_cuda_step_state *h_state(const gpu_cuda_twin *d)
{
    return AT(d->pinned, d->sl.state, gpu_cuda_step_state);
}

/* Make the twin's device current on the calling thread. */
static int use_device(const gpu_cuda_twin *d)
{
    return gpu_cuda_c_check(cudaSetDevice(d->device), "cudaSetDevice");
}

/* Enqueue a host <-> device copy of bytes on the twin's stream (nothing for 0 bytes). */
static int copy(const gpu_cuda_twin *d, void *dst, const void *src, size_t bytes,
                enum cudaMemcpyKind kind)
{
    if (bytes == 0)
        return 0;
    return gpu_cuda_c_check(cudaMemcpyAsync(dst, src, bytes, kind, d->stream), "cudaMemcpyAsync");
}

static int sync_stream(const gpu_cuda_twin *d)
{
    return gpu_cuda_c_check(cudaStreamSynchronize(d->stream), "cudaStreamSynchronize");
}

/* Name the GPT's or the MLP's diagnostics layers in the device's order; see cuda_model.h. */
void gpu_cuda_diag_names(gpu_diag *d, const gpu_mlp *mlp, const gpu_gpt *gpt)
{
    static const char *const ops[GPU_CUDA_GPT_DIAG_OPS] = {
        "attn.qkv", "attn.scores", "attn.proj", "mlp.fc", "mlp.proj",
    };
    char name[48];
    if (gpt == NULL) {
        for (int l = 0; l < mlp->nlin; l++) {
            snprintf(name, sizeof(name), "fc%d", l + 1);
            gpu_diag_layer(d, name, mlp->lin_dt);
        }
        return;
    }
    for (int b = 0; b < gpt->n_layer; b++)
        for (int op = 0; op < GPU_CUDA_GPT_DIAG_OPS; op++) {
            snprintf(name, sizeof(name), "blocks.%d.%s", b, ops[op]);
            gpu_diag_layer(d, name, op == GPU_CUDA_GPT_SCORES ? gpt->mm_dt : gpt->lin_dt);
        }
    gpu_diag_layer(d, "lm_head", gpt->lin_dt);
}

/* The batch block: B inputs of xsize bytes, then B * rows int labels. */
static size_t batch_bytes(int B, size_t xsize, int rows)
{
    return gpu_align256((size_t)B * xsize) + (size_t)B * (size_t)rows * sizeof(int);
}

/* Select the device, open cuBLASLt, create the stream and the timing events. *free0
 * receives the device's free bytes before the job allocated anything. */
static int open_device(gpu_cuda_twin *d, size_t *free0, char *err, size_t errlen)
{
    const char *name = d->cfg.device;
    struct cudaDeviceProp prop;
    size_t total = 0;
    char why[320];
    cudaError_t e = cudaSetDevice(d->device);

    if (e == cudaSuccess)
        e = cudaGetDeviceProperties(&prop, d->device);
    if (e == cudaSuccess)
        e = cudaMemGetInfo(free0, &total);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(err, errlen, "device \"%s\": cannot use CUDA device %d (%s: %s)", name,
                 d->device, cudaGetErrorName(e), cudaGetErrorString(e));
        return GPU_ENODEV;
    }
    snprintf(d->desc, sizeof(d->desc), "cuda:%d (%.200s, sm_%d%d, %.1f GiB)", d->device,
             prop.name, prop.major, prop.minor, (double)total / (double)(1u << 30));
    int rc = gpu_cuda_blas_open(&d->blas, why, sizeof(why));
    if (rc) {
        snprintf(err, errlen, "device \"%s\": %s", name, why);
        return rc;
    }
    rc = gpu_cuda_c_check(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking),
                          "cudaStreamCreateWithFlags");
    d->have_stream = rc == 0;
    while (rc == 0 && d->nevents < 2) {
        rc = gpu_cuda_c_check(cudaEventCreate(&d->ev[d->nevents]), "cudaEventCreate");
        d->nevents += rc == 0;
    }
    if (rc)
        snprintf(err, errlen, "device \"%s\": cannot create a stream and events", name);
    return rc;
}

/* cudaMalloc *p of bytes (at least 1); GPU_ENOMEM with the sizes in err on failure. */
static int dev_alloc(const gpu_cuda_twin *d, void **p, size_t bytes, const char *what,
                     char *err, size_t errlen)
{
    cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
    if (e == cudaSuccess)
        return 0;
    *p = NULL;
    (void)cudaGetLastError();
    size_t free = 0, total = 0;
    (void)cudaMemGetInfo(&free, &total);
    (void)cudaGetLastError();
    snprintf(err, errlen,
             "device \"%s\": cannot allocate the %s (%zu bytes; %zu of %zu bytes free): %s",
             d->cfg.device, what, bytes, free, total, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? GPU_ENOMEM : GPU_ECUDA;
}

/* With several ranks, the room for the staged amaxes of ngemm GEMMs that are reduced
 * across them (3 a GEMM). */
static size_t fp8_amax_bytes(const gpu_job_config *c, int ngemm)
{
    return c->dist.world_size > 1 ? gpu_align256((size_t)ngemm * 3 * sizeof(float)) : 0;
}

/* The bytes of an fp8 job's operand block for B rows (the MLP's) or sequences (the GPT's);
 * GPU_EINVAL with the reason in err when the device cannot run the model's fp8 GEMMs. */
static int fp8_plan(const gpu_cuda_host *h, int B, size_t *bytes, char *err, size_t errlen)
{
    if (h->gpt)
        return gpu_cuda_gpt_fp8_plan(h->gpt, h->fp8_on, B, bytes, err, errlen);
    return gpu_cuda_mlp_fp8_plan(h->mlp, h->fp8_on, B, bytes, err, errlen);
}

/* Plan the device model and allocate every block, the pinned host block included. */
static int alloc_blocks(gpu_cuda_twin *d, char *err, size_t errlen)
{
    const gpu_cuda_host *h = &d->h;
    size_t P = d->P, pinned_bytes, xbytes = (size_t)d->B * d->xsize;
    bool fp32 = d->cfg.dtype == GPU_FP32;
    int rc = h->gpt ? gpu_cuda_gpt_plan(h->gpt, d->B, &d->acts_bytes, &d->ws_bytes)
                    : gpu_cuda_mlp_plan(h->mlp, d->B, &d->acts_bytes, &d->ws_bytes);
    if (rc) {
        snprintf(err, errlen, "device \"%s\": the device model cannot be planned (%s)",
                 d->cfg.device, gpu_strerror(rc));
        return rc;
    }
    d->batch_bytes = batch_bytes(d->B, d->xsize, d->rows);
    small_plan(&d->sl, h->ntensors, h->fp8 ? 3 * h->fp8_ngemm : 0);
    if (h->master)
        GPU_TRY(dev_alloc(d, (void **)&d->master, P * sizeof(float), "fp32 master weights", err,
                          errlen));
    if (fp32)
        d->work = d->master;
    else
        GPU_TRY(dev_alloc(d, &d->work, P * gpu_dtype_size(d->cfg.dtype), "working weights", err,
                          errlen));
    GPU_TRY(dev_alloc(d, (void **)&d->grads, P * sizeof(float), "gradients", err, errlen));
    GPU_TRY(dev_alloc(d, (void **)&d->m, P * sizeof(float), "optimizer state", err, errlen));
    if (h->v)
        GPU_TRY(dev_alloc(d, (void **)&d->v, P * sizeof(float), "optimizer state", err, errlen));
    GPU_TRY(dev_alloc(d, &d->acts, d->acts_bytes, "activations", err, errlen));
    GPU_TRY(dev_alloc(d, &d->ws, d->ws_bytes, "workspace", err, errlen));
    GPU_TRY(dev_alloc(d, &d->batch, d->batch_bytes, "batch", err, errlen));
    GPU_TRY(dev_alloc(d, &d->small, d->sl.bytes, "step state", err, errlen));
    if (h->fp8) {
        char why[320];
        if (!gpu_cuda_has_fp8(why, sizeof(why))) {
            snprintf(err, errlen, "device \"%s\": %s", d->cfg.device, why);
            return GPU_ENODEV;
        }
        d->fp8_state_bytes = (size_t)h->fp8_ngemm * 3 * (size_t)(2 + h->fp8_len) * sizeof(float);
        if (fp8_plan(h, d->B, &d->fp8_bytes, why, sizeof(why))) {
            snprintf(err, errlen, "device \"%s\": %s", d->cfg.device, why);
            return GPU_ENODEV; /* this device cannot run the job ("auto": the CPU can) */
        }
        size_t amax_at = d->fp8_bytes;
        d->fp8_bytes += fp8_amax_bytes(&d->cfg, h->fp8_ngemm);
        GPU_TRY(
            dev_alloc(d, (void **)&d->fp8_state, d->fp8_state_bytes, "fp8 scaling", err, errlen));
        GPU_TRY(dev_alloc(d, (void **)&d->fp8_block, d->fp8_bytes, "fp8 operands", err, errlen));
        if (d->fp8_bytes > amax_at)
            d->fp8_amax = (float *)(void *)(d->fp8_block + amax_at);
    }
    d->x = d->batch;
    d->y = AT(d->batch, gpu_align256(xbytes), int);
    pinned_bytes = d->sl.parts + d->batch_bytes;     /* the small block up to the partials */
    if (cudaHostAlloc((void **)&d->pinned, pinned_bytes, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        d->pinned = NULL;
        snprintf(err, errlen, "device \"%s\": cannot allocate %zu bytes of pinned host memory",
                 d->cfg.device, pinned_bytes);
        return GPU_ENOMEM;
    }
    d->h_x = d->pinned + d->sl.parts;
    d->h_y = AT(d->h_x, gpu_align256(xbytes), int);
    return 0;
}

/* The device bytes by category, as train.c's plan_memory counts the CPU's: P parameters in
 * dt, fp32 master weights when master, AdamW's second moment when adam, the activation block
 * and the rest (workspace, batch, step state, cuBLASLt's workspace). */
static void account(gpu_mem *m, size_t P, gpu_dtype dt, bool master, bool adam, size_t acts,
                    size_t rest)
{
    memset(m, 0, sizeof(*m));
    m->weights = (int64_t)P * (int64_t)gpu_dtype_size(dt);
    m->master = (dt != GPU_FP32 && master) ? (int64_t)P * 4 : 0;
    m->grads = (int64_t)P * 4;
    m->optimizer = (int64_t)P * 4 * (adam ? 2 : 1);
    m->activations = (int64_t)acts;
    m->workspace = (int64_t)rest + (int64_t)GPU_CUDA_BLAS_WORKSPACE;
    m->total = m->weights + m->master + m->grads + m->optimizer + m->activations + m->workspace;
}

/* A bound on the device bytes of the 16-bit gradient buckets of a job of several ranks (the
 * flag, each bucket 256-byte aligned; at most one bucket per tensor). */
static size_t comm_bytes(const gpu_job_config *c, size_t P, int ntensors)
{
    if (c->dist.world_size < 2)
        return 0;
    return 256 + (c->dist.hook != GPU_HOOK_NONE ? 2 * P + 256 * (size_t)ntensors : 0);
}

/* See gpu.h. */
int gpu_cuda_job_memory(const gpu_job_config *c, gpu_mem *out, char *err, size_t errlen)
{
    gpu_mlp m;
    gpu_gpt *g = NULL;
    small_layout sl;
    size_t acts = 0, ws = 0, P, xsize;
    int rows, ntensors;
    int rc = gpu_job_plan(c, &m, &g, err, errlen);
    if (rc)
        return rc;
    if (g) {
        rc = gpu_cuda_gpt_plan(g, gpu_rank_batch(c), &acts, &ws);
        P = g->nparams;
        rows = g->seq_len;
        xsize = (size_t)g->seq_len * sizeof(int);
        ntensors = g->ntensors;
    } else {
        rc = gpu_cuda_mlp_plan(&m, gpu_rank_batch(c), &acts, &ws);
        P = m.nparams;
        rows = 1;
        xsize = (size_t)m.width[0] * sizeof(float);
        ntensors = 2 * m.nlin;
    }
    size_t fp8 = 0;
    int ngemm = !c->fp8.on ? 0 : g ? g->nfp8 : m.nlin;
    if (rc == 0 && c->fp8.on) { /* the fp8 operands and scaling state */
        char why[8];
        gpu_cuda_host h = {.mlp = &m, .gpt = g, .fp8_on = g ? g->fp8 : m.fp8};
        if (fp8_plan(&h, gpu_rank_batch(c), &fp8, why, sizeof(why)) == 0)
            fp8 += gpu_fp8_state_floats(&c->fp8, ngemm) * sizeof(float) + fp8_amax_bytes(c, ngemm);
    }
    free(g);
    if (rc)
        return rc;
    small_plan(&sl, ntensors, 3 * ngemm);
    account(out, P, c->dtype, c->dtype == GPU_FP32 || c->master_weights,
            c->optim.type == GPU_OPT_ADAMW, acts,
            ws + batch_bytes(gpu_rank_batch(c), xsize, rows) + sl.bytes +
                comm_bytes(c, P, ntensors));
    out->fp8 = (int64_t)fp8;
    out->total += out->fp8;
    return 0;
}

/* Enqueue the copies of the host blocks (weights, working copy, m, v) to the device. */
static int put_blocks(const gpu_cuda_twin *d)
{
    const gpu_cuda_host *h = &d->h;
    size_t P = d->P;
    if (d->master)
        GPU_TRY(copy(d, d->master, h->master, P * sizeof(float), cudaMemcpyHostToDevice));
    if (d->work != d->master)
        GPU_TRY(copy(d, d->work, h->work, P * gpu_dtype_size(d->cfg.dtype),
                     cudaMemcpyHostToDevice));
    GPU_TRY(copy(d, d->m, h->m, P * sizeof(float), cudaMemcpyHostToDevice));
    if (d->v)
        GPU_TRY(copy(d, d->v, h->v, P * sizeof(float), cudaMemcpyHostToDevice));
    if (d->fp8_state)
        GPU_TRY(copy(d, d->fp8_state, h->fp8_state, d->fp8_state_bytes, cudaMemcpyHostToDevice));
    return 0;
}

/* Create the twin; see gpu/twin.h. */
int gpu_cuda_twin_create(const gpu_cuda_host *h, int device, const gpu_scaler_state *s,
                         int64_t applied, int64_t lost_total, gpu_cuda_twin **out,
                         gpu_mem *mem, char *err, size_t errlen)
{
    char dummy[8];
    gpu_cuda_twin *d;
    size_t free0 = 0, free1 = 0, total = 0;
    int rc;

    if (err == NULL) {
        err = dummy;
        errlen = sizeof(dummy);
    }
    err[0] = '\0';
    if (out == NULL || h == NULL || h->cfg == NULL || s == NULL || mem == NULL || device < 0 ||
        (h->mlp == NULL && h->gpt == NULL) || h->ntensors < 1 || h->offsets == NULL ||
        h->counts == NULL || h->work == NULL || h->m == NULL ||
        (h->cfg->dtype == GPU_FP32 && h->master == NULL))
        return GPU_EINVAL;
    *out = NULL;
    if ((d = calloc(1, sizeof(*d))) == NULL)
        return GPU_ENOMEM;
    d->h = *h;
    d->cfg = *h->cfg;
    d->h.cfg = &d->cfg;
    d->device = device;
    d->P = h->gpt ? h->gpt->nparams : h->mlp->nparams;
    d->B = gpu_rank_batch(&d->cfg); /* this rank's share of the batch */
    d->rows = h->gpt ? h->gpt->seq_len : 1;
    d->xsize = h->gpt ? (size_t)h->gpt->seq_len * sizeof(int)
                      : (size_t)h->mlp->width[0] * sizeof(float);
    for (int i = 0; i < h->ntensors; i++)
        d->max_count = h->counts[i] > d->max_count ? h->counts[i] : d->max_count;

    rc = open_device(d, &free0, err, errlen);
    if (!rc)
        rc = alloc_blocks(d, err, errlen);
    if (!rc)
        rc = put_blocks(d);
    if (!rc)
        rc = gpu_cuda_c_check(cudaMemsetAsync(d->grads, 0, d->P * sizeof(float), d->stream),
                              "cudaMemsetAsync (gradients)");
    if (!rc)
        rc = copy(d, AT(d->small, d->sl.offsets, size_t), h->offsets,
                  (size_t)h->ntensors * sizeof(size_t), cudaMemcpyHostToDevice);
    if (!rc)
        rc = copy(d, AT(d->small, d->sl.counts, size_t), h->counts,
                  (size_t)h->ntensors * sizeof(size_t), cudaMemcpyHostToDevice);
    if (!rc)
        rc = gpu_cuda_step_state_init(d_state(d), s, applied, lost_total, d->stream);
    if (!rc)
        rc = sync_stream(d);
    if (rc) {
        if (!err[0])
            snprintf(err, errlen, "device \"%s\": cannot set up the job on the device (%s)",
                     d->cfg.device, gpu_strerror(rc));
        gpu_cuda_twin_free(d);
        return rc;
    }
    if (cudaMemGetInfo(&free1, &total) == cudaSuccess && free0 >= free1) {
        size_t n = strlen(d->desc) - 1; /* before the closing parenthesis */
        snprintf(d->desc + n, sizeof(d->desc) - n, "; the job holds %.0f MiB)",
                 (double)(free0 - free1) / (double)(1u << 20));
    }
    (void)cudaGetLastError();
    account(&d->mem, d->P, d->cfg.dtype, d->master != NULL, d->v != NULL, d->acts_bytes,
            d->ws_bytes + d->batch_bytes + d->sl.bytes);
    d->mem.fp8 = (int64_t)(d->fp8_state_bytes + d->fp8_bytes);
    d->mem.total += d->mem.fp8;
    *mem = d->mem;
    *out = d;
    return 0;
}

/* Free the twin; accepts NULL. Waits for the stream first. */
void gpu_cuda_twin_free(gpu_cuda_twin *d)
{
    if (d == NULL)
        return;
    if (d->have_stream) {
        (void)cudaSetDevice(d->device);
        (void)cudaStreamSynchronize(d->stream);
    }
    void *blocks[] = {d->work != d->master ? d->work : NULL,
                      d->master,
                      d->grads,
                      d->m,
                      d->v,
                      d->acts,
                      d->ws,
                      d->batch,
                      d->small,
                      d->fp8_state,
                      d->fp8_block};
    for (size_t i = 0; i < sizeof(blocks) / sizeof(blocks[0]); i++)
        if (blocks[i] != NULL)
            (void)cudaFree(blocks[i]);
    if (d->pinned != NULL)
        (void)cudaFreeHost(d->pinned);
    for (int i = 0; i < d->nevents; i++)
        (void)cudaEventDestroy(d->ev[i]);
    gpu_cuda_prof_free(d->prof);
    gpu_cuda_comm_free(d->comm);
    if (d->have_stream)
        (void)cudaStreamDestroy(d->stream);
    gpu_cuda_blas_free(d->blas);
    (void)cudaGetLastError();
    free(d);
}

const char *gpu_cuda_twin_describe(const gpu_cuda_twin *d)
{
    return d->desc;
}

static void comm_ready(void *ctx, size_t off, size_t count)
{
    gpu_cuda_comm_ready(ctx, off, count);
}

/* Join the job's ranks; see gpu/twin.h. */
int gpu_cuda_twin_comm(gpu_cuda_twin *d, const gpu_cuda_comm_plan *p, gpu_mem *mem, char *err,
                       size_t errlen)
{
    size_t bytes = 0;
    if (d == NULL || p == NULL || mem == NULL || d->comm != NULL)
        return GPU_EINVAL;
    GPU_TRY(use_device(d));
    GPU_TRY(gpu_cuda_comm_create(p, d->grads, d->stream, &d->comm, &bytes, err, errlen));
    d->ready = (gpu_grad_ready){comm_ready, d->comm};
    d->mem.workspace += (int64_t)bytes;
    d->mem.total += (int64_t)bytes;
    *mem = d->mem;
    return 0;
}

/* The model's view of the blocks for one pass: a training step (train: the backward is
 * seeded from the step state; diag: collect into the device counters) or an eval batch. */
static gpu_cuda_model_ctx ctx_of(const gpu_cuda_twin *d, bool train, bool diag)
{
    gpu_cuda_model_ctx c;
    memset(&c, 0, sizeof(c));
    c.stream = d->stream;
    c.blas = d->blas;
    c.work = d->work;
    c.master = d->cfg.dtype != GPU_FP32 ? d->master : NULL;
    c.wdt = d->cfg.dtype;
    c.grads = d->grads;
    c.acts = d->acts;
    c.ws = d->ws;
    c.state = train ? d_state(d) : NULL;
    c.loss_sum = AT(d->small, d->sl.loss, double);
    c.correct = AT(d->small, d->sl.correct, int);
    c.diag = diag ? AT(d->small, d->sl.diag, gpu_cuda_diag) : NULL;
    c.ready = train && d->comm != NULL ? &d->ready : NULL;
    if (d->fp8_state) {
        c.fp8 = d->h.fp8;
        c.fp8_state = d->fp8_state;
        c.fp8_len = d->h.fp8_len;
        c.fp8_on = d->h.fp8_on;
        c.fp8_block = d->fp8_block;
        c.fp8_record = train;
        c.fp8_counts = diag ? AT(d->small, d->sl.fp8, gpu_cuda_fp8_counts) : NULL;
    }
    return c;
}

/* The staged amaxes (each row's first history slot) reduced across the ranks: gathered
 * into fp8_amax, MAX-reduced, scattered back (train.c's fp8_sync with its comm). */
static int fp8_reduce(const gpu_cuda_twin *d)
{
    size_t rows = 3 * (size_t)d->h.fp8_ngemm, pitch = (2 + (size_t)d->h.fp8_len) * sizeof(float);
    GPU_TRY(gpu_cuda_c_check(cudaMemcpy2DAsync(d->fp8_amax, sizeof(float), d->fp8_state + 2, pitch,
                                               sizeof(float), rows, cudaMemcpyDeviceToDevice,
                                               d->stream),
                             "cudaMemcpy2DAsync (fp8 amaxes)"));
    GPU_TRY(gpu_cuda_comm_max(d->comm, d->fp8_amax, rows));
    return gpu_cuda_c_check(cudaMemcpy2DAsync(d->fp8_state + 2, pitch, d->fp8_amax, sizeof(float),
                                              sizeof(float), rows, cudaMemcpyDeviceToDevice,
                                              d->stream),
                            "cudaMemcpy2DAsync (fp8 amaxes)");
}

/* After a training step's forward, backward and gradient all-reduce: the amaxes reduced
 * across the ranks, then delayed scaling's update of every row, as train.c's fp8_sync
 * does. */
static int fp8_update(const gpu_cuda_twin *d)
{
    const gpu_fp8_config *f = d->h.fp8;
    if (!d->fp8_state || f->recipe != GPU_FP8_DELAYED)
        return 0;
    if (d->comm != NULL && d->fp8_amax != NULL)
        GPU_TRY(fp8_reduce(d));
    const float top[3] = {gpu_fp8_scaled_max(gpu_fp8_role_format(f, 0), f->margin),
                          gpu_fp8_scaled_max(gpu_fp8_role_format(f, 1), f->margin),
                          gpu_fp8_scaled_max(gpu_fp8_role_format(f, 2), f->margin)};
    return gpu_cuda_fp8_delayed(d->stream, d->fp8_state, 3 * d->h.fp8_ngemm, d->h.fp8_len,
                                f->amax_algo == GPU_FP8_AMAX_MOST_RECENT, top);
}

/* Stage x and y (B samples) in pinned memory and enqueue their upload. */
static int upload_batch(const gpu_cuda_twin *d, const void *x, const int *y, int B)
{
    size_t xb = (size_t)B * d->xsize, yb = (size_t)B * (size_t)d->rows * sizeof(int);
    /* a step that failed half-way may have left the last copies from h_x/h_y in flight
     * (after a good step the stream is idle, and this costs nothing) */
    GPU_TRY(sync_stream(d));
    memcpy(d->h_x, x, xb);
    memcpy(d->h_y, y, yb);
    GPU_TRY(copy(d, d->x, d->h_x, xb, cudaMemcpyHostToDevice));
    return copy(d, d->y, d->h_y, yb, cudaMemcpyHostToDevice);
}

static int forward(const gpu_cuda_twin *d, const gpu_cuda_model_ctx *c, int B)
{
    if (d->h.gpt)
        return gpu_cuda_gpt_forward(d->h.gpt, c, (const int *)d->x, d->y, B);
    return gpu_cuda_mlp_forward(d->h.mlp, c, (const float *)d->x, d->y, B);
}

static int backward(const gpu_cuda_twin *d, const gpu_cuda_model_ctx *c, int B)
{
    if (d->h.gpt)
        return gpu_cuda_gpt_backward(d->h.gpt, c, (const int *)d->x, d->y, B);
    return gpu_cuda_mlp_backward(d->h.mlp, c, (const float *)d->x, d->y, B);
}

/* The step after backward: unscale, clip, the optimizer (skipped on the device when the
 * gradients overflowed), the scaler update; prof (NULL: off) marks each. */
static int tail(const gpu_cuda_twin *d, double lr, gpu_cuda_prof *prof)
{
    const gpu_cuda_host *h = &d->h;
    gpu_cuda_step_state *st = d_state(d);
    size_t *offsets = AT(d->small, d->sl.offsets, size_t);
    size_t *counts = AT(d->small, d->sl.counts, size_t);
    cudaStream_t s = d->stream;

    GPU_TRY(gpu_cuda_step_unscale_launch(d->grads, offsets, counts, h->ntensors, d->max_count,
                                         AT(d->small, d->sl.tstats, gpu_cuda_step_tstat), st,
                                         AT(d->small, d->sl.parts, double), s));
    gpu_cuda_prof_mark(prof, s, "unscale");
    GPU_TRY(gpu_cuda_step_clip_launch(st, &d->cfg.optim, s));
    gpu_cuda_prof_mark(prof, s, "clip");
    if (d->master)
        GPU_TRY(gpu_cuda_optim_launch(&d->cfg.optim, lr, st, d->master, d->grads, d->m, d->v, d->P,
                                      d->work != d->master ? d->work : NULL, d->cfg.dtype, s));
    else
        GPU_TRY(gpu_cuda_optim_lowp_launch(&d->cfg.optim, lr, st, d->work, d->cfg.dtype, d->grads,
                                           d->m, d->v, offsets, counts, h->ntensors, d->max_count,
                                           AT(d->small, d->sl.tlost, unsigned long long), s));
    gpu_cuda_prof_mark(prof, s, "optimizer");
    return gpu_cuda_scaler_update_launch(st, &d->cfg.scaler, s);
}

/* Enqueue the copies of what the host reads after the step into the pinned mirror. */
static int snapshot(const gpu_cuda_twin *d, int nlayers)
{
    int nt = d->h.ntensors;
    GPU_TRY(gpu_cuda_step_snapshot(d_state(d), h_state(d),
                                   AT(d->small, d->sl.tstats, gpu_cuda_step_tstat),
                                   AT(d->pinned, d->sl.tstats, gpu_cuda_step_tstat), nt,
                                   d->stream));
    GPU_TRY(copy(d, AT(d->pinned, d->sl.loss, double), AT(d->small, d->sl.loss, double),
                 sizeof(double), cudaMemcpyDeviceToHost));
    if (!d->master)
        GPU_TRY(copy(d, AT(d->pinned, d->sl.tlost, unsigned long long),
                     AT(d->small, d->sl.tlost, unsigned long long),
                     (size_t)nt * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    if (nlayers > 0)
        GPU_TRY(gpu_cuda_diag_snapshot(AT(d->small, d->sl.diag, gpu_cuda_diag),
                                       AT(d->pinned, d->sl.diag, gpu_cuda_diag), nlayers,
                                       d->stream));
    if (nlayers > 0 && d->fp8_state)
        GPU_TRY(copy(d, AT(d->pinned, d->sl.fp8, gpu_cuda_fp8_counts),
                     AT(d->small, d->sl.fp8, gpu_cuda_fp8_counts), fp8_counts_bytes(d),
                     cudaMemcpyDeviceToHost));
    return 0;
}

/* A collecting step's fp8 counts into the host's (train.c's diagnostics), as gpu/fp8_state.c
 * notes them: the amax NaN when a NaN was cast, the scale of a row that was cast. */
static void fp8_counts_export(const gpu_cuda_twin *d)
{
    const gpu_cuda_fp8_counts *k = AT(d->pinned, d->sl.fp8, gpu_cuda_fp8_counts);
    const gpu_cuda_host *h = &d->h;
    for (int r = 0; r < 3 * h->fp8_ngemm; r++) {
        union {
            unsigned int u;
            float f;
        } a = {k[r].amax};
        h->fp8_stats[r] =
            (gpu_fp8_cast_stats){(int64_t)k[r].n, (int64_t)k[r].saturated, (int64_t)k[r].underflow,
                                 (int64_t)k[r].nonzero, (int64_t)k[r].nan};
        h->fp8_amax[r] = k[r].nan > 0 ? NAN : a.f;
        h->fp8_scale[r] = k[r].n > 0 ? k[r].scale : NAN;
    }
}

/* Read the synchronised snapshot into the caller's structures. */
static void read_snapshot(const gpu_cuda_twin *d, int B, gpu_diag *diag, gpu_grad_stat *stats,
                          int64_t *tensor_lost, gpu_cuda_step_out *o)
{
    const gpu_cuda_step_state *st = h_state(d);
    const unsigned long long *tl = AT(d->pinned, d->sl.tlost, unsigned long long);
    int nt = d->h.ntensors;

    o->loss = *AT(d->pinned, d->sl.loss, double) / ((double)B * (double)d->rows);
    o->found_inf = st->found_inf != 0;
    o->floor_failed = st->floor_failed != 0;
    o->grad_norm = st->grad_norm;
    o->lost_updates = (int64_t)st->lost_step;
    o->scaler = st->scaler;
    o->applied = (int64_t)st->applied;
    o->lost_total = (int64_t)st->lost_total;
    gpu_cuda_step_stats_export(AT(d->pinned, d->sl.tstats, gpu_cuda_step_tstat), nt, stats);
    if (!d->master)
        for (int i = 0; i < nt; i++)
            tensor_lost[i] = (int64_t)tl[i];
    if (diag != NULL) {
        const gpu_cuda_diag *hd = AT(d->pinned, d->sl.diag, gpu_cuda_diag);
        gpu_diag_begin(diag, hd->scale); /* clears the host counters, keeps the names */
        gpu_cuda_diag_export(hd, diag);
        if (d->fp8_state && d->h.fp8_stats)
            fp8_counts_export(d);
    }
}

/* The profiler of a profiled step (created by the first), or NULL when prof is NULL. */
static int profiler(gpu_cuda_twin *d, const gpu_profile *prof, gpu_cuda_prof **out)
{
    *out = NULL;
    if (prof == NULL)
        return 0;
    if (d->prof == NULL)
        GPU_TRY(gpu_cuda_prof_create(&d->prof));
    *out = d->prof;
    return 0;
}

/* The all-reduce's bytes, times and pre-hook flag of the synchronised step. */
static int comm_result(gpu_cuda_twin *d, gpu_cuda_step_out *out)
{
    gpu_cuda_comm_stats cs;
    char why[256] = "";
    int rc = gpu_cuda_comm_result(d->comm, &cs, why, sizeof(why));
    if (rc) {
        gpu_log(GPU_LOG_ERROR, __func__, "%s", why);
        return rc;
    }
    out->comm_bytes = cs.bytes;
    out->comm_ms = cs.ms;
    out->comm_exposed_ms = cs.exposed_ms;
    out->pre_nonfinite = cs.pre_nonfinite;
    return 0;
}

/* One step; see gpu/twin.h. The cudaStreamSynchronize below is the step's only host wait. */
int gpu_cuda_twin_step(gpu_cuda_twin *d, const void *x, const int *y, int B, double lr,
                       gpu_diag *diag, gpu_grad_stat *stats, int64_t *tensor_lost,
                       gpu_cuda_step_out *out, gpu_profile *prof)
{
    int nlayers = 0;
    float ms = 0.0f;
    if (d == NULL || x == NULL || y == NULL || stats == NULL || tensor_lost == NULL ||
        out == NULL || B < 1 || B > d->B)
        return GPU_EINVAL;
    memset(out, 0, sizeof(*out));
    GPU_TRY(use_device(d));
    if (diag != NULL) {
        gpu_cuda_diag_names(diag, d->h.mlp, d->h.gpt);
        nlayers = diag->nlayers;
    }
    gpu_cuda_model_ctx c = ctx_of(d, true, diag != NULL);
    GPU_TRY(profiler(d, prof, &c.prof));
    GPU_TRY(gpu_cuda_c_check(cudaEventRecord(d->ev[0], d->stream), "cudaEventRecord"));
    if (c.prof != NULL)
        GPU_TRY(gpu_cuda_prof_start(c.prof, d->stream));
    GPU_TRY(upload_batch(d, x, y, B));
    GPU_TRY(gpu_cuda_step_begin_launch(d_state(d), d->stream));
    if (diag != NULL)
        GPU_TRY(gpu_cuda_diag_begin_launch(c.diag, d_state(d), d->stream));
    if (c.fp8_counts != NULL)
        GPU_TRY(gpu_cuda_c_check(cudaMemsetAsync(c.fp8_counts, 0, fp8_counts_bytes(d), d->stream),
                                 "cudaMemsetAsync (fp8 counts)"));
    gpu_cuda_prof_mark(c.prof, d->stream, "upload");
    GPU_TRY(forward(d, &c, B));
    if (d->comm != NULL)
        GPU_TRY(gpu_cuda_comm_begin(d->comm));
    GPU_TRY(backward(d, &c, B));
    if (d->comm != NULL) /* the unscale waits for the last bucket */
        GPU_TRY(gpu_cuda_comm_finish(d->comm));
    GPU_TRY(fp8_update(d)); /* its reduction after the buckets' */
    GPU_TRY(tail(d, lr, c.prof));
    GPU_TRY(snapshot(d, nlayers));
    gpu_cuda_prof_mark(c.prof, d->stream, "scaler"); /* the scaler update and the snapshot */
    GPU_TRY(gpu_cuda_c_check(cudaEventRecord(d->ev[1], d->stream), "cudaEventRecord"));
    GPU_TRY(sync_stream(d));
    GPU_TRY(gpu_cuda_c_check(cudaEventElapsedTime(&ms, d->ev[0], d->ev[1]),
                             "cudaEventElapsedTime"));
    if (c.prof != NULL)
        GPU_TRY(gpu_cuda_prof_read(c.prof, prof));
    read_snapshot(d, B, diag, stats, tensor_lost, out);
    out->step_ms = (double)ms;
    return d->comm != NULL ? comm_result(d, out) : 0;
}

/* One eval batch; see gpu/twin.h. */
int gpu_cuda_twin_eval(gpu_cuda_twin *d, const void *x, const int *y, int B, double *loss_sum,
                       int *correct)
{
    if (d == NULL || x == NULL || y == NULL || loss_sum == NULL || correct == NULL || B < 1 ||
        B > d->B)
        return GPU_EINVAL;
    GPU_TRY(use_device(d));
    gpu_cuda_model_ctx c = ctx_of(d, false, false);
    GPU_TRY(upload_batch(d, x, y, B));
    GPU_TRY(forward(d, &c, B));
    GPU_TRY(copy(d, AT(d->pinned, d->sl.loss, double), c.loss_sum, sizeof(double),
                 cudaMemcpyDeviceToHost));
    GPU_TRY(copy(d, AT(d->pinned, d->sl.correct, int), c.correct, sizeof(int),
                 cudaMemcpyDeviceToHost));
    GPU_TRY(sync_stream(d));
    *loss_sum = *AT(d->pinned, d->sl.loss, double);
    *correct = *AT(d->pinned, d->sl.correct, int);
    return 0;
}

/* Device blocks to the host blocks (and the gradients to grads); see gpu/twin.h. */
int gpu_cuda_twin_download(gpu_cuda_twin *d, float *grads)
{
    const gpu_cuda_host *h = &d->h;
    size_t P = d->P;
    GPU_TRY(use_device(d));
    if (d->master)
        GPU_TRY(copy(d, h->master, d->master, P * sizeof(float), cudaMemcpyDeviceToHost));
    if (d->work != d->master)
        GPU_TRY(copy(d, h->work, d->work, P * gpu_dtype_size(d->cfg.dtype),
                     cudaMemcpyDeviceToHost));
    GPU_TRY(copy(d, h->m, d->m, P * sizeof(float), cudaMemcpyDeviceToHost));
    if (d->v)
        GPU_TRY(copy(d, h->v, d->v, P * sizeof(float), cudaMemcpyDeviceToHost));
    if (grads != NULL)
        GPU_TRY(copy(d, grads, d->grads, P * sizeof(float), cudaMemcpyDeviceToHost));
    if (d->fp8_state)
        GPU_TRY(copy(d, h->fp8_state, d->fp8_state, d->fp8_state_bytes, cudaMemcpyDeviceToHost));
    return sync_stream(d);
}

/* Host blocks to the device and a fresh step state; see gpu/twin.h. */
int gpu_cuda_twin_upload(gpu_cuda_twin *d, const gpu_scaler_state *s, int64_t applied,
                         int64_t lost_total)
{
    GPU_TRY(use_device(d));
    GPU_TRY(put_blocks(d));
    GPU_TRY(gpu_cuda_step_state_init(d_state(d), s, applied, lost_total, d->stream));
    return sync_stream(d);
}
