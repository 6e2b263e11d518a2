/*
 * check_cuda_gpt.c - Check suite "cuda_gpt": the GPT on the device (gpu/cuda/cuda_gpt.c)
 * against the CPU model (gpu/gpt.c), forward and backward, with and without diagnostics.
 *
 * Each case plans the CPU model (gpu_gpt_plan with the default autocast table or the
 * overrides named), initialises it with gpu_gpt_init_params and then moves every 1-D
 * tensor (layer norms, biases) by 0.1 N(0, 1), so that a lost bias or layer-norm weight
 * shows in the forward; the same parameters (fp32 master and the job-dtype working copy) and
 * tokens go to the device, whose buffers (activations, workspace, gradients) start out as NaN
 * so that a read of anything not written, or a gradient not written, shows. The device step
 * state is set with gpu_cuda_step_state_init and gpu_cuda_step_begin_launch, so that the
 * backward is seeded with scale_used (4 in fp32 jobs, 1024 in fp16 jobs, 1 in bf16 jobs).
 *
 * Cases (layers, heads, d_model, seq_len, vocab, batch), in fp32, fp16 and bf16 unless
 * named: base (2, 2, 64, 32, 256, 3); t1 (2, 2, 64, 1, 256, 3); vocab (1, 2, 32, 8, 50257,
 * 3); odd (1, 3, 21, 5, 37, batch 2 of a plan for 3: H > B, head size 7, biases not 16-byte
 * aligned, so both attention batchings and both linear paths run; fp32 without a master);
 * fp16 without master weights; linear=fp32 without master weights (fp16, bf16: 16-bit
 * weights widened for fp32 GEMMs, qkv stored in mm_dt != lin_dt); a mixed table (matmul
 * fp32; softmax, add, cross_entropy, embedding lowp; layer_norm input; gelu fp32: a 16-bit
 * residual stream, 16-bit probabilities and an fp32 attention), fp16 and bf16; flash
 * attention (2, 2, 64, 70, 256, 3: head_dim 32, two 64-row tiles, the second partial) in all
 * three dtypes (fp32 materialises), flash-lin32 (1, 1, 16, 9, 64, bf16, linear=fp32: head_dim
 * 16, y written as fp32 values), flash-wide (1, 2, 128, 65, 64, fp16 without master weights,
 * head_dim 64, batch 1 of a plan for 2).
 *
 * Checks and tolerances. The device repeats the CPU's rounding points; the kernels are
 * bit-exact (tests/check_cuda_ops.c) except flash attention (within the 16-bit rounding of
 * P, see cuda_ops.h; the same tolerances cover it), and only the GEMMs' (and the loss sum's)
 * summation order differs, which moves fp32 results by a few ulp and flips a 16-bit rounding only
 * where an fp32 value lies within that of a rounding boundary (about 1e-4 of the values in
 * fp16, less in bf16), by one unit:
 *   - loss (summed on the device, divided by N here) within 1e-5 relative of the CPU's mean
 *     in fp32 jobs, 2e-3 in 16-bit jobs;
 *   - argmax hits equal in fp32; within 2 + N/50 in 16-bit jobs (rounded logits tie);
 *   - every gradient tensor of the plan's table: max |gpu - cpu| <= 1e-4 (fp32) / 3e-2
 *     (16-bit) times the tensor's max |cpu| (exactly equal when that is 0), and no inf/NaN
 *     where the CPU has none; in a 16-bit job a tensor whose CPU gradients are all values of
 *     the job's dtype (the rounded linear and layer-norm gradients) must hold only such
 *     values on the device too, which no summation order changes (a missing rounding
 *     point, half an ulp, would pass the tolerance). Each case prints its worst ratio.
 * The diagnostics run (the device collects the CPU's calls) must give the same results
 * within those tolerances and the same counters: the layer table is gpt.c's (names and
 * order checked on the CPU), value counts exact, overflow and inf/NaN counts exact, the
 * amax values within the gradient tolerance, the non-zero and flushed counts within
 * n / 100 + 2 (a value near a threshold may land on either side), first inf/NaN layer equal.
 * Overflow: an fp16 job seeded so that the loss gradient overflows fp16 at the targets
 * (g = 1e5): the CPU's gradients hold inf/NaN and the device's are non-finite at exactly
 * the same elements (every sum holding an inf is inf or NaN in any order, and the finite
 * ones stay far below 65504); the diagnostics name lm_head's backward first on both.
 * Repeat: the same step twice gives bit-identical results, and a forward without a step
 * state (loss only) the same loss and hits bit for bit.
 *
 * Without a device (or cuBLASLt) main prints "check_cuda_gpt: SKIP: <why>" once, the device tests
 * return at once (the suite exits 77, SKIP), and t_args checks the argument errors and GPU_ENODEV.
 *
 * Threads: CK_NOFORK, as tests/check_cuda.c, so the CUDA state of main's probe is the one the
 * tests use; every device test probes first.
 */
#include <check.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_model.h"
#include "gpu/diag.h"
#include "gpu/gpt.h"
#include "gpu/gpu_int.h"
#include "tests/cudatest.h"

#define MAX_REPORTS 20

static int nerr; /* failures of the running test (the first MAX_REPORTS printed) */

static void err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void err(const char *fmt, ...)
{
    va_list ap;
    if (nerr++ >= MAX_REPORTS)
        return;
    fputs("check_cuda_gpt: FAIL: ", stdout);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fputc('\n', stdout);
    fflush(stdout);
}

static void *xcalloc(size_t n)
{
    void *p = calloc(1, n ? n : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

#define CK_CUDA(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                 \
    } while (0)

/* ---- cases ---------------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    int L, H, C, T, V;
    int plan_B, B; /* max_batch of both plans; the batch run */
    gpu_dtype dt;
    bool master;
    const char *cast; /* autocast overrides "op=policy,..." or NULL */
    bool flash;       /* model.attention "flash" */
} gcase;

#define MIXED                                                                                      \
    "matmul=fp32,softmax=lowp,add=lowp,layer_norm=input,gelu=fp32,"                                \
    "cross_entropy=lowp,embedding=lowp"

static const gcase CASES[] = {
    {"base", 2, 2, 64, 32, 256, 3, 3, GPU_FP32, true, NULL, false},
    {"base", 2, 2, 64, 32, 256, 3, 3, GPU_FP16, true, NULL, false},
    {"base", 2, 2, 64, 32, 256, 3, 3, GPU_BF16, true, NULL, false},
    {"t1", 2, 2, 64, 1, 256, 3, 3, GPU_FP32, true, NULL, false},
    {"t1", 2, 2, 64, 1, 256, 3, 3, GPU_FP16, true, NULL, false},
    {"t1", 2, 2, 64, 1, 256, 3, 3, GPU_BF16, true, NULL, false},
    {"vocab", 1, 2, 32, 8, 50257, 3, 3, GPU_FP32, true, NULL, false},
    {"vocab", 1, 2, 32, 8, 50257, 3, 3, GPU_FP16, true, NULL, false},
    {"vocab", 1, 2, 32, 8, 50257, 3, 3, GPU_BF16, true, NULL, false},
    {"odd", 1, 3, 21, 5, 37, 3, 2, GPU_FP32, false, NULL, false},
    {"odd", 1, 3, 21, 5, 37, 3, 2, GPU_FP16, true, NULL, false},
    {"odd", 1, 3, 21, 5, 37, 3, 2, GPU_BF16, true, NULL, false},
    {"nomaster", 2, 2, 32, 16, 256, 2, 2, GPU_FP16, false, NULL, false},
    {"linear32", 2, 2, 32, 16, 256, 2, 2, GPU_FP16, false, "linear=fp32", false},
    {"linear32", 2, 2, 32, 16, 256, 2, 2, GPU_BF16, false, "linear=fp32", false},
    {"mixed", 2, 2, 32, 16, 256, 2, 2, GPU_FP16, true, MIXED, false},
    {"mixed", 2, 2, 32, 16, 256, 2, 2, GPU_BF16, true, MIXED, false},
    {"flash", 2, 2, 64, 70, 256, 3, 3, GPU_FP32, true, NULL, true},
    {"flash", 2, 2, 64, 70, 256, 3, 3, GPU_FP16, true, NULL, true},
    {"flash", 2, 2, 64, 70, 256, 3, 3, GPU_BF16, true, NULL, true},
    {"flash-lin32", 1, 1, 16, 9, 64, 2, 2, GPU_BF16, false, "linear=fp32", true},
    {"flash-wide", 1, 2, 128, 65, 64, 2, 1, GPU_FP16, false, NULL, true},
};
#define NCASES (sizeof(CASES) / sizeof(CASES[0]))

static const gcase OVERFLOW_CASE = {"overflow", 1, 2, 32, 8, 64, 2, 2, GPU_FP16, true, NULL, false};

static float seed_for(gpu_dtype dt)
{
    return dt == GPU_FP32 ? 4.0f : dt == GPU_FP16 ? 1024.0f : 1.0f;
}

static void apply_cast(gpu_autocast *a, const char *spec)
{
    char buf[256];
    if (spec == NULL)
        return;
    snprintf(buf, sizeof(buf), "%s", spec);
    for (char *tok = strtok(buf, ","); tok != NULL; tok = strtok(NULL, ",")) {
        char *eq = strchr(tok, '=');
        gpu_op op;
        gpu_cast_policy pol;
        ck_assert_ptr_nonnull(eq);
        *eq = '\0';
        ck_assert_int_eq(gpu_op_parse(tok, &op), 0);
        ck_assert_int_eq(gpu_cast_policy_parse(eq + 1, &pol), 0);
        a->policy[op] = pol;
    }
}

/* ---- the CPU side --------------------------------------------------------------------------- */

typedef struct {
    gcase k;
    gpu_gpt *m;
    float seed;
    float *params, *grads;
    void *work; /* the job-dtype copy (params itself in fp32) */
    int *x, *y;
    uint8_t *acts;
    float *scratch;
    double loss; /* mean */
    int correct;
    gpu_diag *diag; /* the CPU's collection, or NULL */
} host_model;

static void host_setup(host_model *h, const gcase *k, float seed)
{
    gpu_model_config mc = {.type = GPU_MODEL_GPT,
                           .n_layer = k->L,
                           .n_head = k->H,
                           .d_model = k->C,
                           .seq_len = k->T,
                           .vocab = k->V,
                           .init_scale = 1.0f,
                           .attention = k->flash ? GPU_ATTN_FLASH : GPU_ATTN_MATERIALIZED};
    gpu_autocast a;
    gpu_rng r;
    char msg[160];
    memset(h, 0, sizeof(*h));
    h->k = *k;
    h->seed = seed;
    h->m = xcalloc(sizeof(*h->m));
    gpu_autocast_defaults(&a);
    apply_cast(&a, k->cast);
    ck_assert_msg(gpu_gpt_plan(h->m, &mc, &a, k->dt, k->plan_B, msg, sizeof(msg)) == 0, "%s", msg);
    size_t n = h->m->nparams, nt = (size_t)k->plan_B * k->T;
    h->params = xmalloc(n * sizeof(float));
    h->grads = xcalloc(n * sizeof(float));
    gpu_rng_seed(&r, 0x6770u + (uint64_t)k->dt * 131u + (uint64_t)k->C);
    gpu_gpt_init_params(h->m, h->params, 1.0f, &r);
    for (int i = 0; i < h->m->ntensors; i++) {
        const gpu_gpt_tensor *t = &h->m->tensor[i];
        if (t->ndim == 1)
            for (size_t j = 0; j < t->count; j++)
                h->params[t->off + j] += 0.1f * gpu_rng_normal(&r);
    }
    if (k->dt == GPU_FP32) {
        h->work = h->params;
    } else {
        h->work = xmalloc(n * 2);
        gpu_cvt_from_f32(h->work, k->dt, h->params, n);
    }
    h->x = xmalloc(nt * sizeof(int));
    h->y = xmalloc(nt * sizeof(int));
    for (size_t i = 0; i < nt; i++) { /* half the targets repeat the input: argmax hits */
        h->x[i] = (int)gpu_rng_below(&r, (uint32_t)k->V);
        h->y[i] = i % 2 ? (int)gpu_rng_below(&r, (uint32_t)k->V) : h->x[i];
    }
    h->acts = xcalloc(h->m->act_bytes);
    h->scratch = xcalloc(h->m->scratch_floats * sizeof(float));
}

static void host_free(host_model *h)
{
    if (h->work != h->params)
        free(h->work);
    free(h->params);
    free(h->grads);
    free(h->x);
    free(h->y);
    free(h->acts);
    free(h->scratch);
    free(h->diag);
    free(h->m);
}

/* The CPU's forward and backward, collecting diagnostics (which change nothing there). */
static void host_run(host_model *h)
{
    gpu_gpt_weights w = {.p = h->work, .pdt = h->k.dt, .master = h->k.master ? h->params : NULL};
    h->diag = xcalloc(sizeof(*h->diag));
    gpu_diag_begin(h->diag, h->seed);
    ck_assert_int_eq(gpu_gpt_forward(h->m, &w, h->x, h->y, h->k.B, h->acts, h->scratch, h->diag,
                                     &h->loss, &h->correct),
                     0);
    ck_assert_int_eq(gpu_gpt_backward(h->m, &w, h->x, h->y, h->k.B, h->seed, h->acts, h->scratch,
                                      h->diag, h->grads, NULL),
                     0);
}

/* ---- the device side ------------------------------------------------------------------------ */

typedef struct {
    double loss_sum;
    int correct;
    float *grads;        /* host copy (NULL after a forward only) */
    gpu_cuda_diag *diag; /* host snapshot, or NULL */
} dev_result;

typedef enum { DEV_STEP = 0, DEV_STEP_DIAG, DEV_FORWARD_ONLY } dev_mode;

static void *dalloc(size_t bytes, int fill)
{
    void *p = NULL;
    CK_CUDA(cudaMalloc(&p, bytes ? bytes : 1));
    CK_CUDA(cudaMemset(p, fill, bytes ? bytes : 1));
    return p;
}

static void *dcopy(const void *src, size_t bytes)
{
    void *p = dalloc(bytes, 0);
    CK_CUDA(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
    return p;
}

/* One step (or a forward only, without a step state) of h's model on the device. */
static void dev_run(const host_model *h, dev_mode mode, dev_result *o)
{
    const gpu_gpt *m = h->m;
    size_t n = m->nparams, nt = (size_t)h->k.B * h->k.T, acts_bytes = 0, ws_bytes = 0;
    char why[256] = "";
    cudaStream_t st;
    gpu_cuda_blas *blas = NULL;
    gpu_cuda_step_state *d_state = NULL;
    gpu_cuda_diag *d_diag = NULL;
    float *d_master = NULL;
    void *d_work;

    memset(o, 0, sizeof(*o));
    CK_CUDA(cudaStreamCreate(&st));
    ck_assert_msg(gpu_cuda_blas_open(&blas, why, sizeof(why)) == 0, "%s", why);
    ck_assert_int_eq(gpu_cuda_gpt_plan(m, h->k.plan_B, &acts_bytes, &ws_bytes), 0);
    if (h->k.master)
        d_master = dcopy(h->params, n * sizeof(float));
    if (h->k.dt == GPU_FP32 && d_master != NULL)
        d_work = d_master;
    else
        d_work = dcopy(h->work, n * gpu_dtype_size(h->k.dt));
    float *d_grads = dalloc(n * sizeof(float), 0xFF); /* NaN: every gradient is written */
    void *d_acts = dalloc(acts_bytes, 0xFF), *d_ws = dalloc(ws_bytes, 0xFF);
    double *d_loss = dalloc(sizeof(double), 0xFF);
    int *d_correct = dalloc(sizeof(int), 0xFF);
    int *d_x = dcopy(h->x, nt * sizeof(int)), *d_y = dcopy(h->y, nt * sizeof(int));
    if (mode != DEV_FORWARD_ONLY) {
        gpu_scaler_state s;
        memset(&s, 0, sizeof(s));
        s.scale = h->seed;
        d_state = dalloc(sizeof(*d_state), 0xFF);
        ck_assert_int_eq(gpu_cuda_step_state_init(d_state, &s, 0, 0, st), 0);
        ck_assert_int_eq(gpu_cuda_step_begin_launch(d_state, st), 0);
    }
    if (mode == DEV_STEP_DIAG) {
        d_diag = dalloc(sizeof(*d_diag), 0xFF);
        ck_assert_int_eq(gpu_cuda_diag_begin_launch(d_diag, d_state, st), 0);
    }
    gpu_cuda_model_ctx c = {.stream = st,
                            .blas = blas,
                            .work = d_work,
                            .master = d_master,
                            .wdt = h->k.dt,
                            .grads = d_grads,
                            .acts = d_acts,
                            .ws = d_ws,
                            .state = d_state,
                            .loss_sum = d_loss,
                            .correct = d_correct,
                            .diag = d_diag};
    ck_assert_int_eq(gpu_cuda_gpt_forward(m, &c, d_x, d_y, h->k.B), 0);
    if (mode != DEV_FORWARD_ONLY)
        ck_assert_int_eq(gpu_cuda_gpt_backward(m, &c, d_x, d_y, h->k.B), 0);
    CK_CUDA(cudaStreamSynchronize(st));
    CK_CUDA(cudaGetLastError());
    CK_CUDA(cudaMemcpy(&o->loss_sum, d_loss, sizeof(double), cudaMemcpyDeviceToHost));
    CK_CUDA(cudaMemcpy(&o->correct, d_correct, sizeof(int), cudaMemcpyDeviceToHost));
    if (mode != DEV_FORWARD_ONLY) {
        o->grads = xmalloc(n * sizeof(float));
        CK_CUDA(cudaMemcpy(o->grads, d_grads, n * sizeof(float), cudaMemcpyDeviceToHost));
    }
    if (d_diag != NULL) {
        o->diag = xmalloc(sizeof(*o->diag));
        ck_assert_int_eq(gpu_cuda_diag_snapshot(d_diag, o->diag, GPU_CUDA_DIAG_MAX_LAYERS, st), 0);
        CK_CUDA(cudaStreamSynchronize(st));
    }
    cudaFree(d_diag);
    cudaFree(d_state);
    cudaFree(d_x);
    cudaFree(d_y);
    cudaFree(d_correct);
    cudaFree(d_loss);
    cudaFree(d_ws);
    cudaFree(d_acts);
    cudaFree(d_grads);
    if (d_work != d_master)
        cudaFree(d_work);
    cudaFree(d_master);
    gpu_cuda_blas_free(blas);
    CK_CUDA(cudaStreamDestroy(st));
}

static void dev_free(dev_result *o)
{
    free(o->grads);
    free(o->diag);
    memset(o, 0, sizeof(*o));
}

/* ---- comparisons ---------------------------------------------------------------------------- */

static void case_name(const host_model *h, const char *what, char *buf, size_t len)
{
    snprintf(buf, len, "%s %s%s%s", h->k.name, gpu_dtype_name(h->k.dt),
             h->k.master ? "" : " (no master)", what);
}

static double tol_grad(gpu_dtype dt)
{
    return dt == GPU_FP32 ? 1e-4 : 3e-2;
}

/* Whether the n values of v are all values of dt (NaN excluded). */
static bool of_dtype(const float *v, size_t n, gpu_dtype dt)
{
    for (size_t i = 0; i < n; i++)
        if (!(gpu_round(v[i], dt) == v[i]))
            return false;
    return true;
}

/* Loss, hits and every gradient tensor against the CPU; prints the case's summary. */
static void compare_step(const host_model *h, const dev_result *o, const char *what)
{
    char name[96];
    gpu_dtype dt = h->k.dt;
    int N = h->k.B * h->k.T;
    double tl = dt == GPU_FP32 ? 1e-5 : 2e-3, tg = tol_grad(dt), worst = 0.0;
    const char *worst_name = "-";
    case_name(h, what, name, sizeof(name));

    double loss = o->loss_sum / N, rel = fabs(loss - h->loss) / fabs(h->loss);
    if (!(rel <= tl))
        err("%s: loss %.9g, cpu %.9g (relative %.3g > %.0e)", name, loss, h->loss, rel, tl);
    int dc = abs(o->correct - h->correct);
    if (dt == GPU_FP32 ? dc != 0 : dc > 2 + N / 50)
        err("%s: %d hits, cpu %d", name, o->correct, h->correct);
    for (int i = 0; i < h->m->ntensors && o->grads != NULL; i++) {
        const gpu_gpt_tensor *t = &h->m->tensor[i];
        const float *g = o->grads + t->off, *c = h->grads + t->off;
        double cmax = 0.0, emax = 0.0;
        size_t at = 0;
        for (size_t j = 0; j < t->count; j++) {
            if (!isfinite(c[j])) {
                err("%s: %s[%zu] is %g on the cpu", name, t->name, j, (double)c[j]);
                continue;
            }
            if (!isfinite(g[j])) {
                err("%s: %s[%zu] = %g, cpu %.9g", name, t->name, j, (double)g[j], (double)c[j]);
                continue;
            }
            cmax = fmax(cmax, fabs((double)c[j]));
            if (fabs((double)g[j] - (double)c[j]) > emax) {
                emax = fabs((double)g[j] - (double)c[j]);
                at = j;
            }
        }
        if (dt != GPU_FP32 && of_dtype(c, t->count, dt)) {
            size_t k = 0;
            while (k < t->count && gpu_round(g[k], dt) == g[k])
                k++;
            if (k < t->count)
                err("%s: %s[%zu] = %.9g is not a value of %s, as every cpu value is", name, t->name,
                    k, (double)g[k], gpu_dtype_name(dt));
        }
        double ratio = cmax > 0.0 ? emax / cmax : (emax > 0.0 ? INFINITY : 0.0);
        if (ratio > tg)
            err("%s: %s[%zu] = %.9g, cpu %.9g: error %.3g of the tensor's max %.3g (> %.0e)", name,
                t->name, at, (double)g[at], (double)c[at], ratio, cmax, tg);
        if (ratio > worst) {
            worst = ratio;
            worst_name = t->name;
        }
    }
    printf("check_cuda_gpt: %s: loss %.7f cpu %.7f (rel %.1e), hits %d cpu %d, worst gradient "
           "%s at %.1e of its max\n",
           name, loss, h->loss, rel, o->correct, h->correct, worst_name, worst);
    fflush(stdout);
}

static bool near_rel(double a, double b, double tol)
{
    return fabs(a - b) <= tol * fmax(fabs(a), fabs(b));
}

static bool near_count(int64_t a, int64_t b, int64_t n)
{
    int64_t d = a > b ? a - b : b - a;
    return d <= n / 100 + 2;
}

/* The device's diagnostics counters against the CPU's collection. overflow: inf/NaN counts
 * need only agree on being non-zero. */
static void compare_diag(const host_model *h, const dev_result *o, bool overflow)
{
    static const char *const what[GPU_CUDA_GPT_DIAG_OPS] = {"attn.qkv", "attn.scores", "attn.proj",
                                                            "mlp.fc", "mlp.proj"};
    const gpu_diag *cd = h->diag;
    char name[96], want[48];
    double tg = tol_grad(h->k.dt);
    case_name(h, " diagnostics", name, sizeof(name));

    if (cd->nlayers != GPU_CUDA_GPT_DIAG_OPS * h->k.L + 1) {
        err("%s: the cpu made %d layers, not %d", name, cd->nlayers,
            GPU_CUDA_GPT_DIAG_OPS * h->k.L + 1);
        return;
    }
    for (int i = 0; i < cd->nlayers; i++) {
        if (i < GPU_CUDA_GPT_DIAG_OPS * h->k.L)
            snprintf(want, sizeof(want), "blocks.%d.%s", i / GPU_CUDA_GPT_DIAG_OPS,
                     what[i % GPU_CUDA_GPT_DIAG_OPS]);
        else
            snprintf(want, sizeof(want), "lm_head");
        if (strcmp(cd->layer[i].name, want) != 0)
            err("%s: cpu layer %d is %s, not %s", name, i, cd->layer[i].name, want);
    }
    gpu_diag *gd = xmalloc(sizeof(*gd));
    memcpy(gd, cd, sizeof(*gd));
    gpu_cuda_diag_export(o->diag, gd);
    if (gd->scale != cd->scale)
        err("%s: scale %g, cpu %g", name, (double)gd->scale, (double)cd->scale);
    if (gd->first_nonfinite != cd->first_nonfinite ||
        (cd->first_nonfinite >= 0 && gd->first_in_forward != cd->first_in_forward))
        err("%s: first inf/NaN layer %d (forward %d), cpu %d (forward %d)", name,
            gd->first_nonfinite, (int)gd->first_in_forward, cd->first_nonfinite,
            (int)cd->first_in_forward);
    for (int i = 0; i < cd->nlayers; i++) {
        const gpu_layer_diag *a = &gd->layer[i], *b = &cd->layer[i];
        const char *ln = b->name;
        if (a->act_n != b->act_n || a->grad_n != b->grad_n || a->in_n != b->in_n)
            err("%s: %s counts act %lld grad %lld in %lld, cpu %lld %lld %lld", name, ln,
                (long long)a->act_n, (long long)a->grad_n, (long long)a->in_n, (long long)b->act_n,
                (long long)b->grad_n, (long long)b->in_n);
        int64_t ga[4] = {a->act_overflow, a->grad_nonfinite, a->in_nonfinite, a->out_nonfinite};
        int64_t gb[4] = {b->act_overflow, b->grad_nonfinite, b->in_nonfinite, b->out_nonfinite};
        for (int j = 0; j < 4; j++)
            if (overflow ? (ga[j] > 0) != (gb[j] > 0) : ga[j] != gb[j])
                err("%s: %s inf/NaN counter %d: %lld, cpu %lld", name, ln, j, (long long)ga[j],
                    (long long)gb[j]);
        if (!near_rel(a->act_amax, b->act_amax, tg) || !near_rel(a->grad_amax, b->grad_amax, tg))
            err("%s: %s amax act %g grad %g, cpu %g %g", name, ln, (double)a->act_amax,
                (double)a->grad_amax, (double)b->act_amax, (double)b->grad_amax);
        if (!near_count(a->grad_nonzero, b->grad_nonzero, b->grad_n) ||
            !near_count(a->grad_flushed, b->grad_flushed, b->grad_n) ||
            !near_count(a->grad_flushed_unscaled, b->grad_flushed_unscaled, b->grad_n) ||
            !near_count(a->in_nonzero, b->in_nonzero, b->in_n) ||
            !near_count(a->in_flushed, b->in_flushed, b->in_n) ||
            !near_count(a->in_flushed_unscaled, b->in_flushed_unscaled, b->in_n))
            err("%s: %s nonzero/flushed grad %lld %lld %lld in %lld %lld %lld, cpu grad %lld "
                "%lld %lld in %lld %lld %lld",
                name, ln, (long long)a->grad_nonzero, (long long)a->grad_flushed,
                (long long)a->grad_flushed_unscaled, (long long)a->in_nonzero,
                (long long)a->in_flushed, (long long)a->in_flushed_unscaled,
                (long long)b->grad_nonzero, (long long)b->grad_flushed,
                (long long)b->grad_flushed_unscaled, (long long)b->in_nonzero,
                (long long)b->in_flushed, (long long)b->in_flushed_unscaled);
    }
    free(gd);
}

/* ---- tests ---------------------------------------------------------------------------------- */

/* Every case of dtype dt: the CPU once (collecting), the device without and with
 * diagnostics. */
static void run_dtype(gpu_dtype dt)
{
    if (!have_blas())
        return;
    nerr = 0;
    for (size_t i = 0; i < NCASES; i++) {
        if (CASES[i].dt != dt)
            continue;
        host_model h;
        dev_result o;
        host_setup(&h, &CASES[i], seed_for(dt));
        host_run(&h);
        dev_run(&h, DEV_STEP, &o);
        compare_step(&h, &o, "");
        dev_free(&o);
        dev_run(&h, DEV_STEP_DIAG, &o);
        compare_step(&h, &o, " with diagnostics");
        compare_diag(&h, &o, false);
        dev_free(&o);
        host_free(&h);
    }
    ck_assert_msg(nerr == 0, "%d failures (the first printed above)", nerr);
}

START_TEST(t_fp32)
{
    run_dtype(GPU_FP32);
}
END_TEST

START_TEST(t_fp16)
{
    run_dtype(GPU_FP16);
}
END_TEST

START_TEST(t_bf16)
{
    run_dtype(GPU_BF16);
}
END_TEST

/* The loss gradient overflows fp16 at every target: inf/NaN gradients at the CPU's places. */
START_TEST(t_overflow)
{
    if (!have_blas())
        return;
    const gcase *k = &OVERFLOW_CASE;
    host_model h;
    dev_result o[2];
    char name[96];
    nerr = 0;
    host_setup(&h, k, 1e5f * (float)(k->B * k->T));
    host_run(&h);
    size_t bad = 0, n = h.m->nparams;
    for (size_t i = 0; i < n; i++)
        bad += !isfinite(h.grads[i]);
    ck_assert_msg(bad > 0 && bad < n, "the cpu has %zu non-finite gradients of %zu", bad, n);
    ck_assert_int_ge(h.diag->first_nonfinite, 0);
    dev_run(&h, DEV_STEP, &o[0]);
    dev_run(&h, DEV_STEP_DIAG, &o[1]);
    for (int r = 0; r < 2; r++) {
        case_name(&h, r ? " with diagnostics" : "", name, sizeof(name));
        double loss = o[r].loss_sum / (k->B * k->T);
        if (!(fabs(loss - h.loss) <= 2e-3 * fabs(h.loss)))
            err("%s: loss %.9g, cpu %.9g", name, loss, h.loss);
        for (int i = 0; i < h.m->ntensors; i++) {
            const gpu_gpt_tensor *t = &h.m->tensor[i];
            for (size_t j = 0; j < t->count; j++) {
                float g = o[r].grads[t->off + j], c = h.grads[t->off + j];
                if (isfinite(g) != isfinite(c))
                    err("%s: %s[%zu] = %g, cpu %g", name, t->name, j, (double)g, (double)c);
            }
        }
        printf("check_cuda_gpt: %s: %zu of %zu gradients non-finite on the cpu\n", name, bad, n);
    }
    compare_diag(&h, &o[1], true);
    dev_free(&o[0]);
    dev_free(&o[1]);
    host_free(&h);
    ck_assert_msg(nerr == 0, "%d failures (the first printed above)", nerr);
}
END_TEST

/* The same step twice: bit-identical; a forward without a state: the same loss and hits. */
START_TEST(t_repeat)
{
    if (!have_blas())
        return;
    host_model h;
    dev_result a, b, f;
    host_setup(&h, &CASES[1], seed_for(CASES[1].dt));
    dev_run(&h, DEV_STEP, &a);
    dev_run(&h, DEV_STEP, &b);
    dev_run(&h, DEV_FORWARD_ONLY, &f);
    ck_assert(memcmp(&a.loss_sum, &b.loss_sum, sizeof(double)) == 0);
    ck_assert(memcmp(&a.loss_sum, &f.loss_sum, sizeof(double)) == 0);
    ck_assert_int_eq(a.correct, b.correct);
    ck_assert_int_eq(a.correct, f.correct);
    ck_assert(memcmp(a.grads, b.grads, h.m->nparams * sizeof(float)) == 0);
    dev_free(&a);
    dev_free(&b);
    dev_free(&f);
    host_free(&h);
}
END_TEST

/* Argument errors (before any device work), and the plan without a device. */
START_TEST(t_args)
{
    host_model h;
    size_t ab = 0, wb = 0;
    int x[4] = {0}, y[4] = {0};
    host_setup(&h, &CASES[1], 1.0f);
    const gpu_gpt *m = h.m;
    ck_assert_int_eq(gpu_cuda_gpt_plan(NULL, 1, &ab, &wb), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_gpt_plan(m, 0, &ab, &wb), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_gpt_plan(m, m->max_batch + 1, &ab, &wb), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_gpt_plan(m, 1, NULL, &wb), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_gpt_forward(m, NULL, x, y, 1), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_gpt_backward(NULL, NULL, x, y, 1), GPU_EINVAL);

    /* host addresses stand in for device buffers: every call below fails before using them */
    static _Alignas(256) char dummy[256];
    gpu_cuda_model_ctx c = {.blas = (gpu_cuda_blas *)(void *)dummy,
                            .work = dummy,
                            .master = NULL,
                            .wdt = GPU_FP16,
                            .grads = (float *)(void *)dummy,
                            .acts = dummy,
                            .ws = dummy,
                            .state = NULL,
                            .loss_sum = (double *)(void *)dummy,
                            .correct = (int *)(void *)dummy};
    ck_assert_int_eq(gpu_cuda_gpt_forward(m, &c, x, y, 0), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_gpt_forward(m, &c, x, y, m->max_batch + 1), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_gpt_forward(m, &c, NULL, y, 1), GPU_EINVAL);
    ck_assert_int_eq(gpu_cuda_gpt_backward(m, &c, x, y, 1), GPU_EINVAL); /* no state */
    c.wdt = GPU_BF16; /* fp16 linears on bf16 weights */
    ck_assert_int_eq(gpu_cuda_gpt_forward(m, &c, x, y, 1), GPU_EINVAL);
    c.wdt = GPU_FP16;
    c.ws = dummy + 8; /* not 256-byte aligned */
    ck_assert_int_eq(gpu_cuda_gpt_forward(m, &c, x, y, 1), GPU_EINVAL);
    c.ws = dummy;
    c.loss_sum = NULL;
    ck_assert_int_eq(gpu_cuda_gpt_forward(m, &c, x, y, 1), GPU_EINVAL);

    int rc = gpu_cuda_gpt_plan(m, m->max_batch, &ab, &wb);
    char why[256];
    if (gpu_cuda_probe(why, sizeof(why)) != 0) {
        ck_assert_int_eq(rc, GPU_ENODEV);
    } else {
        size_t ab1 = 0, wb1 = 0;
        ck_assert_int_eq(rc, 0);
        ck_assert_int_eq(gpu_cuda_gpt_plan(m, 1, &ab1, &wb1), 0);
        ck_assert(ab1 > 0 && ab1 < ab && wb1 > 0 && wb1 < wb);
    }
    host_free(&h);
}
END_TEST

static Suite *cuda_gpt_suite(void)
{
    Suite *s = suite_create("cuda_gpt");
    TCase *tc = tcase_create("cuda_gpt");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, t_args);
    tcase_add_test(tc, t_fp32);
    tcase_add_test(tc, t_fp16);
    tcase_add_test(tc, t_bf16);
    tcase_add_test(tc, t_overflow);
    tcase_add_test(tc, t_repeat);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    const char *why;
    bool have = blas_check(&why);
    return cudatest_run("check_cuda_gpt", have, why, cuda_gpt_suite());
}
