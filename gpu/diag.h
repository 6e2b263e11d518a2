/*
 * diag.h - per-layer diagnostics (gpu/diag.c), internal to the gpu/ module: the collection
 * the models feed during a step (gpu_diag, gpu_diag_*), its reduction to gpu.h's per-layer
 * statistics, and the advisor that turns statistics and the scaler state into
 * recommendations. The CUDA backend keeps the same counters on the device
 * (gpu/cuda/cuda_step.h, gpu_cuda_diag) and exports them into a gpu_diag.
 *
 * Invariants: collection is off (free) when the pointer is NULL; counters are exact counts,
 * thresholds are bit patterns (gpu_diag_flush_bits), so host and device agree exactly.
 * Threads: none. A gpu_diag and a gpu_diag_advisor belong to one trainer.
 */
#ifndef AMPD_GPU_DIAG_H
#define AMPD_GPU_DIAG_H

#include "gpu/gpu_int.h"

/* A model's forward and backward take a gpu_diag pointer; NULL turns collection off (no
 * cost). When on, every low-precision op reports, per layer: the largest |output| it
 * produced in fp32 before rounding (and how many outputs became inf/NaN when rounded to
 * the op's dtype), and for each gradient it rounds: how many non-zero fp32 values became
 * exactly 0 (flushed) with the current loss scale, and how many would have flushed without
 * it (|g / S| below half the dtype's smallest subnormal). The first layer whose forward
 * output or backward gradient held inf/NaN is recorded with its direction. */
#define GPU_DIAG_MAX_LAYERS 256

typedef struct {
    char name[48];          /* "fc1", "blocks.2.mlp.fc", ... */
    gpu_dtype dtype;        /* the op's compute dtype */
    float act_amax;         /* max |output| in fp32 before rounding, over finite values */
    int64_t act_n, act_overflow;     /* outputs; outputs that became inf/NaN when rounded */
    float grad_amax;        /* max |weight gradient| before rounding (scaled) */
    int64_t grad_n;         /* weight-gradient elements */
    int64_t grad_flushed;   /* non-zero values rounded to exactly 0 at the current scale */
    int64_t grad_flushed_unscaled; /* ... that would flush without loss scaling */
    int64_t grad_nonfinite; /* inf/NaN after rounding */
    /* added with diag.c: */
    int64_t grad_nonzero;   /* non-zero weight-gradient values before rounding */
    int64_t in_n, in_nonzero;       /* the input gradient the layer's backward passes down */
    int64_t in_flushed, in_flushed_unscaled, in_nonfinite; /* ... as for the weight gradient */
    int64_t out_nonfinite;  /* inf/NaN in the gradient arriving at the layer's output */
    int64_t grad_starved;   /* weight-gradient values exactly 0 because every gradient
                             * reaching their unit was flushed upstream (gpu_diag_starved) */
    int64_t grad_starved_unscaled; /* non-zero values whose unit would get no gradient
                                    * without loss scaling (and that would not flush alone) */
} gpu_layer_diag;

struct gpu_diag {
    int nlayers;
    gpu_layer_diag layer[GPU_DIAG_MAX_LAYERS];
    float scale;            /* the loss scale the backward was seeded with */
    int first_nonfinite;    /* index of the first layer to produce inf/NaN, or -1 */
    bool first_in_forward;  /* ... in its forward output (else in its backward) */
};

/* Start a step's collection (clears every layer, keeps the names). */
void gpu_diag_begin(gpu_diag *d, float scale);
/* The layer slot for name (created on first use; -1 when the table is full). */
int gpu_diag_layer(gpu_diag *d, const char *name, gpu_dtype dt);
/* Account an op's fp32 outputs y[0..n) about to be rounded to the layer's dtype. */
void gpu_diag_forward(gpu_diag *d, int layer, const float *y, size_t n);
/* Account a weight gradient g[0..n) (fp32, before rounding to the layer's dtype). */
void gpu_diag_weight_grad(gpu_diag *d, int layer, const float *g, size_t n);
/* Account an activation gradient (input of the layer's backward) for inf/NaN only. */
void gpu_diag_backward(gpu_diag *d, int layer, const float *g, size_t n);
/* Account the gradient the layer's backward passes to its input, g[0..n) in fp32 before it
 * is rounded to the layer's dtype (flushes, inf/NaN; optional for a model). */
void gpu_diag_input_grad(gpu_diag *d, int layer, const float *g, size_t n);
/* Round g[0..n) in place to the layer's dtype, accounting it first as a weight gradient
 * (weight = true) or an input gradient, chunk by chunk while it is in cache. d may be
 * NULL (then this is gpu_round_n). */
void gpu_diag_round_grad(gpu_diag *d, int layer, bool weight, float *g, size_t n,
                         gpu_dtype dt);
/* Account underflow that cascades (the model decides which values; see mlp.c): zero
 * weight-gradient values that are exactly 0 before rounding only because every gradient
 * reaching their unit was flushed upstream (lost with and without the loss scale), and
 * unscaled further non-zero values, which would not flush on their own, whose unit would get
 * no gradient without loss scaling (lost only without it). */
void gpu_diag_starved(gpu_diag *d, int layer, int64_t zero, int64_t unscaled);
/* The largest |x| bit pattern of an fp32 value that flushes to 0 in dt once divided by
 * scale (scale 1: plain rounding; 0 for fp32, where nothing flushes). */
uint32_t gpu_diag_flush_bits(gpu_dtype dt, float scale);

/* Reduce the counters of the last collection to statistics, out[i] for layer i (names
 * borrowed from d; lost_updates left 0 for the trainer to fill). */
void gpu_diag_stats(const gpu_diag *d, gpu_layer_stat *out);

/* What the advisor knows beyond the statistics. */
typedef struct {
    gpu_dtype dtype;       /* the job's dtype (of the weights when master weights are off) */
    bool master_weights;   /* an fp32 master copy exists */
    gpu_scale_mode mode;
    float scale;           /* the loss scale the step ran with */
    float next_scale;      /* the scale after the step's update */
    float min_scale, max_scale;
    int floor_streak;      /* consecutive overflowing steps at the floor */
    int floor_patience;
    /* the step's inf/NaN came from the compressed all-reduce (finite on every rank before
     * it): the first tensor it hit, and the hook; NULL: it did not */
    const char *comm_tensor;
    gpu_comm_hook hook;
    double loss;   /* the step's loss (rank 0's; NaN: not known) */
    bool overflow; /* the step's gradients held inf/NaN (the update was skipped) */
    const gpu_fp8_config *fp8; /* an fp8 job's recipe; NULL otherwise */
} gpu_diag_context;

#define GPU_DIAG_MAX_RECS 32    /* new recommendations one step can give */
/* A loss spike (OLMo's rule): a finite loss of a step whose gradients are finite, more than
 * GPU_DIAG_SPIKE_SIGMA standard deviations above the mean of the previous
 * GPU_DIAG_SPIKE_WINDOW such losses, once GPU_DIAG_SPIKE_MIN of them are known. */
#define GPU_DIAG_SPIKE_WINDOW 128
#define GPU_DIAG_SPIKE_MIN 64
#define GPU_DIAG_SPIKE_SIGMA 6.0
#define GPU_DIAG_MAX_SEEN 1024  /* distinct (kind, layer) pairs remembered per job */

typedef struct {
    char kind[24];
    char layer[48];
    double value;          /* the number the recommendation was last given with */
} gpu_diag_seen;

typedef struct {
    int nseen;
    gpu_diag_seen seen[GPU_DIAG_MAX_SEEN];
    double losses[GPU_DIAG_SPIKE_WINDOW]; /* the last finite losses of clean steps (a ring) */
    int nlosses, loss_next;
    bool spiking; /* the last clean step was a spike: the ones after it are the same spike */
    int nnew;
    gpu_recommendation rec[GPU_DIAG_MAX_RECS]; /* point into the arrays below */
    char kind[GPU_DIAG_MAX_RECS][24];
    char layer[GPU_DIAG_MAX_RECS][48];
    char message[GPU_DIAG_MAX_RECS][256];
} gpu_diag_advisor;

/* Replace a's list of new recommendations with those of this step: from the statistics
 * st (d->nlayers entries) when d is not NULL (the step collected), and from the scaler
 * state and the loss in c always (the loss then joins the spike window, after it was
 * judged, so that a spike is measured against the steps before it). A recommendation is new when
 * its (kind, layer) was not given before in the job, or its number changed by a factor of two or
 * more since. */
void gpu_diag_advise(gpu_diag_advisor *a, const gpu_diag *d, const gpu_layer_stat *st,
                     const gpu_diag_context *c);
/* One clause on why the scale cannot help, from the first inf/NaN of d (may be NULL),
 * ending in what to do, e.g. "fc2's forward activations reach 1.2e+05, beyond fp16's
 * 65504, which no loss scale can fix: use bf16". */
void gpu_diag_explain(const gpu_diag *d, const gpu_layer_stat *st, const gpu_diag_context *c,
                      char *buf, size_t len);

#endif /* AMPD_GPU_DIAG_H */
