/*
 * check_cuda_train.c - Check suite "cuda_train": whole training steps and jobs on a CUDA
 * device (gpu/cuda/cuda_train.c, gpu/cuda/cuda_mlp.c, gpu/cuda/cuda_gpt.c) against the CPU
 * trainer.
 *
 * Every comparison builds two trainers from one job, device "cpu" and device "cuda": the
 * same initial weights and the same batches (both are drawn on the host from the seed).
 * With a device:
 *   - the MLP (ReLU and GELU; fp32, fp16 with dynamic scaling, bf16; master weights on and
 *     off; SGD with momentum and weight decay for two steps, AdamW for one) and the GPT
 *     (2 layers, d_model 64, 2 heads, seq_len 32, vocab 256, on generated text; fp32, fp16,
 *     bf16 with and without master weights), step by step:
 *       loss within 1e-5 relative in fp32, 1e-3 with 16-bit ops (the summation order of the
 *       GEMMs differs; in 16 bits a logit can round to the neighbouring value);
 *       every gradient tensor, and after the update the weights (the fp32 master, or the
 *       16-bit weights without one) and the optimizer state: max |device - cpu| within
 *       1e-4 (fp32) / 2e-2 (16-bit) of the tensor's max |cpu| (v, a square, within twice
 *       that); the global gradient norm within the same relative bound; with AdamW, whose
 *       first step moves each weight by about lr whatever the gradient's size, a weight whose
 *       gradient is so small that the two may differ in sign (|g| <= 4 tol max |g|) may also
 *       differ by 2.5 lr;
 *       overflow and skip flags, the loss scale, the scaler's whole state and its counters
 *       identical; lost updates (master weights off) within 5% + 16 (updates that sit on a
 *       rounding boundary); nothing inf/NaN on the device where the CPU holds a finite value;
 *       the eval loss within the loss bound, the accuracy within 1%;
 *     and the memory the device trainer reports: the CPU's categories, the parameter blocks
 *     by the CPU's formulas, the workspace at least cuBLASLt's;
 *   - a forced overflow (fp16 at a loss scale of 1e30) is skipped identically: both steps
 *     overflow, neither moves a weight (bit for bit), the scale halves the same way; the CPU
 *     diagnoses the overflowing step itself (it runs it again), the device the next one, and
 *     both name the same first layer to hold inf/NaN and where;
 *   - per-layer diagnostics (diagnostics_every 1, fp16) of the MLP and the GPT: the same
 *     layers by name and dtype in the same order, act_amax and grad_amax within 2e-2
 *     relative, the overflow and inf/NaN counts identical, the underflow fractions within
 *     0.02 (flushing near a threshold; the device skips mlp.c's starved-unit analysis);
 *     and of an fp8 MLP (its head's gradient underflowing) and an fp8 GPT, each operand's
 *     fp8 amax, scale, headroom, saturated and underflow fractions as the CPU reports them;
 *   - a checkpoint taken from a device trainer and restored into a new one continues with
 *     the same losses (1e-9 relative) and weights (1e-6 of max |w|) as the original (fp16,
 *     and fp8 with its scaling rows);
 *   - fp8 (an MLP of widths multiples of 16; delayed scaling with and without master
 *     weights, current scaling): step by step as the 16-bit jobs, the fp8.scaling rows among
 *     the blocks; a 10-class head is refused naming fc3 ("auto": the CPU, saying why), and
 *     trains kept in bf16; the GPT's block linears likewise (delayed with and without master
 *     weights, current, one linear kept in bf16), a seq_len of 24 refused naming it;
 *   - one rank through NCCL (the all-reduce path of a data-parallel job on one device): hook
 *     none leaves every gradient and loss bit for bit as without it, fp16 and bf16 round each
 *     gradient to their type and change nothing else, 4 / 2 bytes per parameter;
 *   - a complete job, Fashion-MNIST (under $AMPD_TEST_DATA, /usr/share/datasets/fashion-mnist
 *     by default; skipped when missing), 784-256-10, fp16 with dynamic scaling, batch 128,
 *     1000 steps, on the device and on the CPU: test accuracies within 1 percentage point.
 * Device selection runs with or without a device: "cuda:64" and "cuda:x" are refused
 * (GPU_EINVAL); without a device "cuda" and "cuda:0" fail with GPU_ENODEV and the reason
 * and "auto" runs on the CPU; with one, "auto" runs on cuda:0 and "cuda:63" names the
 * missing device.
 * Without a device main prints "check_cuda_train: SKIP: <why>" once, the device tests
 * return at once and the suite exits 77 (SKIP).
 *
 * Threads: CK_NOFORK so that the CUDA state of main's probe is the one the tests use.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/gpt.h"
#include "gpu/twin.h"
#include "tests/cudatest.h"

#define TOL32 1e-4
#define TOL16 2e-2
#define LTOL32 1e-5
#define LTOL16 1e-3

static double rel_diff(double a, double b)
{
    double m = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
    return m > 0.0 ? fabs(a - b) / m : 0.0;
}

/* ---- jobs ---------------------------------------------------------------------------------- */

/* A small MLP on synthetic data, SGD with momentum and weight decay. */
static void mlp_job(gpu_job_config *c, gpu_dtype dt, bool master, gpu_activation act)
{
    gpu_job_defaults(c);
    c->dtype = dt;
    c->master_weights = master;
    gpu_scaler_defaults(&c->scaler, dt);
    c->model.nlayers = 4;
    c->model.layers[0] = 48;
    c->model.layers[1] = 96;
    c->model.layers[2] = 64;
    c->model.layers[3] = 10;
    c->model.activation = act;
    c->data.type = GPU_DATA_SYNTHETIC;
    c->data.synth_features = 48;
    c->data.synth_classes = 10;
    c->data.synth_train = 2048;
    c->data.synth_eval = 512;
    c->batch_size = 64;
    c->steps = 10;
    c->optim.type = GPU_OPT_SGD;
    c->optim.lr = 0.05f;
    c->optim.momentum = 0.9f;
    c->optim.weight_decay = 1e-4f;
}

static char text_path[256];

/* Pseudo-English text (words drawn from a fixed list) for the GPT, written once. */
static void write_text(void)
{
    static const char *const words[] = {
        "the", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was", "for",
        "on", "are", "as", "with", "his", "they", "at", "be", "this", "have", "from", "or",
        "one", "had", "by", "word", "but", "not", "what", "all", "were", "we", "when",
        "your", "can", "said", "there", "use", "an", "each", "which", "she", "do", "how",
        "their", "if", "will", "up", "other", "about", "out", "many", "then", "them",
    };
    char dir[] = "/tmp/check_cuda_train.XXXXXX";
    uint64_t s = 12345;
    if (text_path[0])
        return;
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(text_path, sizeof(text_path), "%s/text.txt", dir);
    FILE *f = fopen(text_path, "w");
    ck_assert_ptr_nonnull(f);
    for (int i = 0; i < 6000; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        fputs(words[(s >> 33) % (sizeof(words) / sizeof(words[0]))], f);
        fputc((s >> 20) % 11 == 0 ? '\n' : ' ', f);
    }
    ck_assert_int_eq(fclose(f), 0);
}

/* The small GPT of the brief on the generated text, SGD with momentum. */
static void gpt_job(gpu_job_config *c, gpu_dtype dt, bool master)
{
    write_text();
    gpu_job_defaults(c);
    c->dtype = dt;
    c->master_weights = master;
    gpu_scaler_defaults(&c->scaler, dt);
    c->model.type = GPU_MODEL_GPT;
    c->model.n_layer = 2;
    c->model.n_head = 2;
    c->model.d_model = 64;
    c->model.seq_len = 32;
    c->model.vocab = 256;
    c->data.type = GPU_DATA_TEXT;
    snprintf(c->data.seq_train, sizeof(c->data.seq_train), "%s", text_path);
    c->data.val_fraction = 0.1f;
    c->batch_size = 4;
    c->steps = 10;
    c->optim.type = GPU_OPT_SGD;
    c->optim.lr = 0.05f;
    c->optim.momentum = 0.9f;
    c->optim.weight_decay = 1e-4f;
}

static gpu_trainer *make(const gpu_job_config *base, const char *device)
{
    gpu_job_config c = *base;
    gpu_trainer *t = NULL;
    char err[512] = "";
    snprintf(c.device, sizeof(c.device), "%s", device);
    int rc = gpu_trainer_create(&c, &t, err, sizeof(err));
    ck_assert_msg(rc == 0, "create on %s: %s (%s)", device, err, gpu_strerror(rc));
    gpu_trainer_keep_grads(t); /* the tests compare gradients after the update */
    return t;
}

/* ---- comparisons ----------------------------------------------------------------------------- */

/* The state tensors of t as floats (I32 tensors left NULL). */
typedef struct {
    gpu_state_tensor *v;
    int n;
    float **f;
    size_t *count;
} state_view;

static void state_get(gpu_trainer *t, state_view *s)
{
    ck_assert_int_eq(gpu_trainer_state(t, &s->v, &s->n), 0);
    s->f = xmalloc((size_t)s->n * sizeof(*s->f));
    s->count = xmalloc((size_t)s->n * sizeof(*s->count));
    for (int i = 0; i < s->n; i++) {
        const gpu_state_tensor *e = &s->v[i];
        gpu_dtype dt = GPU_FP32;
        s->f[i] = NULL;
        if (strcmp(e->dtype, "I32") == 0)
            continue;
        ck_assert_int_eq(gpu_dtype_parse(strcmp(e->dtype, "F32") == 0   ? "fp32"
                                         : strcmp(e->dtype, "F16") == 0 ? "fp16"
                                                                        : "bf16",
                                         &dt),
                         0);
        s->count[i] = e->bytes / gpu_dtype_size(dt);
        s->f[i] = xmalloc(s->count[i] * sizeof(float));
        gpu_cvt_to_f32(s->f[i], e->data, dt, s->count[i]);
    }
}

static void state_put(state_view *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->f[i]);
    free(s->f);
    free(s->count);
    free(s->v);
}

/* max |dev - cpu| over n values (less `extra` where small[i] is set) must be within tol of
 * max |cpu|; dev may hold inf/NaN only where cpu does. */
static void expect_close(const char *what, const float *cpu, const float *dev, size_t n,
                         double tol, const bool *small, double extra)
{
    double cmax = 0.0, dmax = 0.0;
    size_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        ck_assert_msg(!isfinite(cpu[i]) || isfinite(dev[i]),
                      "%s[%zu]: %g on the device, %g on the CPU", what, i, (double)dev[i],
                      (double)cpu[i]);
        if (isfinite(cpu[i]) && fabs(cpu[i]) > cmax)
            cmax = fabs(cpu[i]);
    }
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(cpu[i]))
            continue;
        double d = fabs((double)dev[i] - (double)cpu[i]) - (small && small[i] ? extra : 0.0);
        if (d > dmax) {
            dmax = d;
            worst = i;
        }
    }
    ck_assert_msg(dmax <= tol * cmax,
                  "%s: max |device - cpu| %g at %zu (cpu %.9g, device %.9g) > %g x max |cpu| %g",
                  what, dmax, worst, n ? (double)cpu[worst] : 0.0, n ? (double)dev[worst] : 0.0,
                  tol, cmax);
}

/* Element offset and count of every parameter tensor, from the state's weight entries. */
static int tensor_layout(const state_view *s, size_t *off, size_t *cnt, const char **names)
{
    int k = 0;
    const uint8_t *base = s->v[0].data;
    for (int i = 0; i < s->n; i++) {
        const gpu_state_tensor *e = &s->v[i];
        if (strncmp(e->name, "optim.", 6) == 0 || strncmp(e->name, "fp8.", 4) == 0 ||
            strcmp(e->dtype, "I32") == 0)
            continue; /* not parameters: the optimizer's, fp8's scaling, the data order */
        size_t es = e->bytes / s->count[i];
        off[k] = (size_t)((const uint8_t *)e->data - base) / es;
        cnt[k] = s->count[i];
        names[k] = e->name;
        k++;
    }
    return k;
}

typedef struct {
    double tol, ltol;
    bool adam;
} bounds;

static void compare_metrics(const gpu_step_metrics *mc, const gpu_step_metrics *mg,
                            const gpu_trainer *tc, const gpu_trainer *tg, const bounds *b)
{
    ck_assert_int_eq(mc->step, mg->step);
    ck_assert_msg(mc->overflow == mg->overflow, "step %lld: overflow cpu %d device %d",
                  (long long)mc->step, mc->overflow, mg->overflow);
    ck_assert_int_eq(mc->skipped, mg->skipped);
    ck_assert_msg(mc->loss_scale == mg->loss_scale, "loss scale cpu %g device %g",
                  (double)mc->loss_scale, (double)mg->loss_scale);
    ck_assert_int_eq(mc->overflow_total, mg->overflow_total);
    ck_assert_int_eq(mc->skipped_total, mg->skipped_total);
    ck_assert_msg(isfinite(mc->loss) == isfinite(mg->loss), "loss cpu %g device %g", mc->loss,
                  mg->loss);
    if (isfinite(mc->loss))
        ck_assert_msg(rel_diff(mc->loss, mg->loss) <= b->ltol,
                      "step %lld: loss cpu %.12g device %.12g", (long long)mc->step, mc->loss,
                      mg->loss);
    if (!mc->overflow)
        ck_assert_msg(rel_diff(mc->grad_norm, mg->grad_norm) <= b->tol,
                      "grad norm cpu %.9g device %.9g", mc->grad_norm, mg->grad_norm);
    else
        ck_assert(isnan(mg->grad_norm));
    double lost = (double)(mc->lost_updates > mg->lost_updates ? mc->lost_updates
                                                               : mg->lost_updates);
    ck_assert_msg(llabs(mc->lost_updates - mg->lost_updates) <= 0.05 * lost + 16,
                  "lost updates cpu %lld device %lld", (long long)mc->lost_updates,
                  (long long)mg->lost_updates);
    const gpu_scaler_state *sc = gpu_trainer_scaler(tc), *sg = gpu_trainer_scaler(tg);
    ck_assert(sc->scale == sg->scale);
    ck_assert_int_eq(sc->growth_tracker, sg->growth_tracker);
    ck_assert_int_eq(sc->hysteresis_left, sg->hysteresis_left);
    ck_assert_int_eq(sc->floor_streak, sg->floor_streak);
    ck_assert_int_eq(sc->steps, sg->steps);
    ck_assert_int_eq(sc->overflow_total, sg->overflow_total);
    ck_assert_int_eq(sc->skipped_total, sg->skipped_total);
    ck_assert_int_eq(sc->growth_total, sg->growth_total);
    ck_assert_int_eq(sc->backoff_total, sg->backoff_total);
}

/* The memory the device trainer reports, against the CPU's formulas. */
static void check_memory(const gpu_job_config *c, gpu_trainer *tg, const gpu_step_metrics *m)
{
    int64_t P = gpu_trainer_params(tg);
    const gpu_mem *g = &m->mem;
    ck_assert_int_eq(g->weights, P * (int64_t)gpu_dtype_size(c->dtype));
    ck_assert_int_eq(g->master, c->dtype != GPU_FP32 && c->master_weights ? P * 4 : 0);
    ck_assert_int_eq(g->grads, P * 4);
    ck_assert_int_eq(g->optimizer, P * 4 * (c->optim.type == GPU_OPT_ADAMW ? 2 : 1));
    ck_assert_int_gt(g->activations, 0);
    ck_assert_int_ge(g->workspace, (int64_t)32 << 20);
    ck_assert_int_eq(g->total, g->weights + g->master + g->grads + g->optimizer + g->activations +
                                   g->workspace + g->fp8);
    ck_assert(c->fp8.on ? g->fp8 > 0 : g->fp8 == 0);
    ck_assert_int_eq(m->peak.total, g->total);
    ck_assert_msg(strncmp(gpu_trainer_device(tg), "cuda:", 5) == 0, "device %s",
                  gpu_trainer_device(tg));
}

/* Gradients, weights and optimizer state of the two trainers after a step. */
static void compare_blocks(gpu_trainer *tc, gpu_trainer *tg, const gpu_job_config *c,
                           const bounds *b)
{
    const float *gc, *gd;
    state_view sc, sg;
    size_t off[GPU_GPT_MAX_TENSORS], cnt[GPU_GPT_MAX_TENSORS];
    const char *names[GPU_GPT_MAX_TENSORS];
    char what[128];

    ck_assert_int_eq(gpu_trainer_grads(tc, &gc), 0);
    ck_assert_int_eq(gpu_trainer_grads(tg, &gd), 0);
    state_get(tc, &sc);
    state_get(tg, &sg);
    ck_assert_int_eq(sc.n, sg.n);
    int nt = tensor_layout(&sc, off, cnt, names);
    for (int k = 0; k < nt; k++) {
        snprintf(what, sizeof(what), "gradient of %s", names[k]);
        expect_close(what, gc + off[k], gd + off[k], cnt[k], b->tol, NULL, 0.0);
    }
    for (int i = 0; i < sc.n; i++) {
        const char *name = sc.v[i].name;
        ck_assert_str_eq(name, sg.v[i].name);
        ck_assert_str_eq(sc.v[i].dtype, sg.v[i].dtype);
        ck_assert_uint_eq(sc.v[i].bytes, sg.v[i].bytes);
        if (sc.f[i] == NULL) {
            ck_assert_msg(memcmp(sc.v[i].data, sg.v[i].data, sc.v[i].bytes) == 0, "%s", name);
            continue;
        }
        bool *small = NULL;
        double tol = strncmp(name, "optim.exp_avg_sq.", 17) == 0 ? 2 * b->tol : b->tol;
        if (b->adam && strncmp(name, "optim.", 6) != 0) {
            /* the gradient of these weights: a near-zero one may flip AdamW's step */
            int k = 0;
            while (k < nt && strcmp(names[k], name) != 0)
                k++;
            ck_assert_int_lt(k, nt);
            double gmax = 0.0;
            for (size_t j = 0; j < cnt[k]; j++)
                gmax = fabs(gc[off[k] + j]) > gmax ? fabs(gc[off[k] + j]) : gmax;
            small = xmalloc(cnt[k] * sizeof(bool));
            for (size_t j = 0; j < cnt[k]; j++)
                small[j] = fabs(gc[off[k] + j]) <= 4 * b->tol * gmax;
        }
        snprintf(what, sizeof(what), "%s after the update", name);
        expect_close(what, sc.f[i], sg.f[i], sc.count[i], tol, small, 2.5 * c->optim.lr);
        free(small);
    }
    const gpu_grad_stat *stc = gpu_trainer_grad_stats(tc), *stg = gpu_trainer_grad_stats(tg);
    for (int k = 0; k < gpu_trainer_tensors(tc); k++) {
        ck_assert_int_eq(stc[k].nonfinite, stg[k].nonfinite);
        ck_assert_msg(rel_diff(stc[k].amax, stg[k].amax) <= b->tol, "%s: amax cpu %g device %g",
                      gpu_trainer_tensor_name(tc, k), (double)stc[k].amax, (double)stg[k].amax);
    }
    state_put(&sc);
    state_put(&sg);
}

/* steps steps of c on the CPU and on the device, compared after each; then eval. */
static void compare_job(const gpu_job_config *c, int steps, const bounds *b)
{
    gpu_trainer *tc = make(c, "cpu"), *tg = make(c, "cuda");
    gpu_step_metrics mc, mg;
    gpu_eval_result ec, eg;
    char err[512];

    ck_assert_str_eq(gpu_trainer_device(tc), "cpu");
    ck_assert_int_eq(gpu_trainer_params(tc), gpu_trainer_params(tg));
    ck_assert_int_eq(gpu_trainer_tensors(tc), gpu_trainer_tensors(tg));
    for (int s = 0; s < steps; s++) {
        int rc = gpu_trainer_step(tc, &mc, err, sizeof(err));
        ck_assert_int_eq(gpu_trainer_step(tg, &mg, err, sizeof(err)), rc);
        compare_metrics(&mc, &mg, tc, tg, b);
        compare_blocks(tc, tg, c, b);
        check_memory(c, tg, &mg);
    }
    ck_assert_int_eq(gpu_trainer_eval(tc, &ec), 0);
    ck_assert_int_eq(gpu_trainer_eval(tg, &eg), 0);
    ck_assert_int_eq(ec.count, eg.count);
    ck_assert_msg(rel_diff(ec.loss, eg.loss) <= b->ltol, "eval loss cpu %.12g device %.12g",
                  ec.loss, eg.loss);
    ck_assert_msg(fabs(ec.accuracy - eg.accuracy) <= 0.01, "eval accuracy cpu %g device %g",
                  ec.accuracy, eg.accuracy);
    gpu_trainer_free(tc);
    gpu_trainer_free(tg);
}

static const bounds B32 = {TOL32, LTOL32, false}, B16 = {TOL16, LTOL16, false};

/* ---- tests ----------------------------------------------------------------------------------- */

START_TEST(t_select)
{
    gpu_job_config c;
    gpu_trainer *t = NULL;
    char err[512];
    bool dev = have_device();

    mlp_job(&c, GPU_FP32, true, GPU_ACT_RELU);
    const char *bad[] = {"cuda:64", "cuda:x", "cuda:-1", "cuda:", "gpu"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(c.device, sizeof(c.device), "%s", bad[i]);
        ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), GPU_EINVAL);
        ck_assert_ptr_null(t);
        ck_assert_msg(strncmp(err, "device: must be", 15) == 0, "%s: %s", bad[i], err);
    }
    snprintf(c.device, sizeof(c.device), "auto");
    ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), 0);
    ck_assert_msg(strcmp(gpu_trainer_device(t), "cpu") == 0 ||
                      (dev && strncmp(gpu_trainer_device(t), "cuda:0 (", 8) == 0),
                  "auto runs on %s", gpu_trainer_device(t));
    ck_assert_int_eq(dev, strcmp(gpu_trainer_device(t), "cpu") != 0);
    gpu_trainer_free(t);
    if (!dev) {
        const char *none[] = {"cuda", "cuda:0", "cuda:3"};
        for (size_t i = 0; i < sizeof(none) / sizeof(none[0]); i++) {
            char want[64];
            snprintf(c.device, sizeof(c.device), "%s", none[i]);
            t = NULL;
            ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), GPU_ENODEV);
            ck_assert_ptr_null(t);
            snprintf(want, sizeof(want), "device \"%s\": ", none[i]);
            ck_assert_msg(strncmp(err, want, strlen(want)) == 0, "%s", err);
            ck_assert_msg(strstr(err, "no CUDA") || strstr(err, "without CUDA") ||
                              strstr(err, "CUDA unavailable"),
                          "%s", err);
        }
        return;
    }
    gpu_cuda_device devs[GPU_MAX_CUDA_DEVICES];
    int ndev = 0;
    ck_assert_int_eq(gpu_cuda_devices(devs, GPU_MAX_CUDA_DEVICES, &ndev), 0);
    if (ndev < GPU_MAX_CUDA_DEVICES) {
        snprintf(c.device, sizeof(c.device), "cuda:63");
        ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), GPU_ENODEV);
        ck_assert_msg(strstr(err, "no CUDA device 63") != NULL, "%s", err);
    }
    snprintf(c.device, sizeof(c.device), "cpu");
    ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), 0);
    ck_assert_str_eq(gpu_trainer_device(t), "cpu");
    gpu_trainer_free(t);
}
END_TEST

START_TEST(t_mlp_fp32)
{
    gpu_job_config c;
    if (!have_device())
        return;
    mlp_job(&c, GPU_FP32, true, GPU_ACT_RELU);
    compare_job(&c, 2, &B32);
    mlp_job(&c, GPU_FP32, true, GPU_ACT_GELU);
    compare_job(&c, 2, &B32);
}
END_TEST

START_TEST(t_mlp_fp16)
{
    gpu_job_config c;
    if (!have_device())
        return;
    for (int master = 1; master >= 0; master--) {
        mlp_job(&c, GPU_FP16, master, GPU_ACT_RELU);
        compare_job(&c, 2, &B16);
    }
    mlp_job(&c, GPU_FP16, true, GPU_ACT_GELU);
    compare_job(&c, 2, &B16);
}
END_TEST

START_TEST(t_mlp_bf16)
{
    gpu_job_config c;
    if (!have_device())
        return;
    for (int master = 1; master >= 0; master--) {
        mlp_job(&c, GPU_BF16, master, GPU_ACT_RELU);
        compare_job(&c, 2, &B16);
    }
}
END_TEST

/* fp8 (docs/fp8.md): an MLP whose dimensions are multiples of 16, delayed scaling (master
 * weights on and off) and current scaling, step by step against the CPU's fp8 trainer,
 * the fp8.scaling state included among the blocks compared; a layer whose width is not a
 * multiple of 16 is refused naming it, and "auto" takes the CPU, saying why. */
static void fp8_on(gpu_job_config *c, gpu_fp8_recipe recipe)
{
    c->fp8.on = true;
    c->fp8.recipe = recipe;
    c->fp8.amax_history_len = 8;
}

static void fp8_mlp_job(gpu_job_config *c, bool master, gpu_fp8_recipe recipe)
{
    mlp_job(c, GPU_BF16, master, GPU_ACT_RELU);
    c->model.layers[3] = 16;
    c->data.synth_classes = 16;
    fp8_on(c, recipe);
}

static void fp8_gpt_job(gpu_job_config *c, bool master, gpu_fp8_recipe recipe)
{
    gpt_job(c, GPU_BF16, master);
    fp8_on(c, recipe);
}

/* c on "cuda" is refused naming what (and the multiple of 16); "auto" trains it on the CPU
 * and says why. */
static void fp8_refused(gpu_job_config *c, const char *what)
{
    gpu_trainer *t;
    char err[512];
    snprintf(c->device, sizeof(c->device), "cuda");
    ck_assert_int_eq(gpu_trainer_create(c, &t, err, sizeof(err)), GPU_ENODEV);
    ck_assert_msg(strstr(err, what) && strstr(err, "16"), "%s", err);
    snprintf(c->device, sizeof(c->device), "auto");
    ck_assert_int_eq(gpu_trainer_create(c, &t, err, sizeof(err)), 0);
    ck_assert_msg(strstr(gpu_trainer_device(t), "cpu (CUDA unusable") &&
                      strstr(gpu_trainer_device(t), what),
                  "%s", gpu_trainer_device(t));
    gpu_trainer_free(t);
}

START_TEST(t_mlp_fp8)
{
    gpu_job_config c;
    gpu_trainer *t;
    char err[512];
    if (!have_device())
        return;
    for (int master = 1; master >= 0; master--) {
        fp8_mlp_job(&c, master, GPU_FP8_DELAYED);
        compare_job(&c, 4, &B16);
    }
    fp8_mlp_job(&c, true, GPU_FP8_CURRENT);
    compare_job(&c, 3, &B16);
    fp8_mlp_job(&c, true, GPU_FP8_DELAYED);
    c.model.layers[3] = 10; /* the 10-class head: not a multiple of 16 */
    c.data.synth_classes = 10;
    fp8_refused(&c, "fc3");
    snprintf(c.device, sizeof(c.device), "cuda");
    c.fp8.nkeep = 1; /* kept in bf16, it trains there */
    snprintf(c.fp8.keep[0], sizeof(c.fp8.keep[0]), "fc3");
    ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), 0);
    ck_assert(strncmp(gpu_trainer_device(t), "cuda:", 5) == 0);
    gpu_trainer_free(t);
}
END_TEST

/* The GPT's block linears in fp8 (the head in bf16), as the MLP: delayed scaling with and
 * without master weights, current scaling, one linear kept in bf16; a seq_len that is not a
 * multiple of 16 is refused naming it ("auto": the CPU, saying why). */
START_TEST(t_gpt_fp8)
{
    gpu_job_config c;
    if (!have_device())
        return;
    for (int master = 1; master >= 0; master--) {
        fp8_gpt_job(&c, master, GPU_FP8_DELAYED);
        compare_job(&c, 3, &B16);
    }
    fp8_gpt_job(&c, true, GPU_FP8_CURRENT);
    compare_job(&c, 2, &B16);
    fp8_gpt_job(&c, true, GPU_FP8_DELAYED);
    c.fp8.nkeep = 1;
    snprintf(c.fp8.keep[0], sizeof(c.fp8.keep[0]), "blocks.1.mlp.fc");
    compare_job(&c, 2, &B16);
    fp8_gpt_job(&c, true, GPU_FP8_DELAYED);
    c.model.seq_len = 24;
    fp8_refused(&c, "model.seq_len");
}
END_TEST

START_TEST(t_mlp_adamw)
{
    gpu_job_config c;
    bounds b32 = B32, b16 = B16;
    if (!have_device())
        return;
    b32.adam = b16.adam = true;
    mlp_job(&c, GPU_FP32, true, GPU_ACT_RELU);
    gpu_optim_defaults(&c.optim);
    c.optim.weight_decay = 0.01f;
    compare_job(&c, 1, &b32);
    mlp_job(&c, GPU_FP16, true, GPU_ACT_RELU);
    gpu_optim_defaults(&c.optim);
    compare_job(&c, 1, &b16);
    mlp_job(&c, GPU_BF16, false, GPU_ACT_RELU);
    gpu_optim_defaults(&c.optim);
    compare_job(&c, 1, &b16);
}
END_TEST

/* An fp32 linear under an fp16 job without master weights: the device widens the weights. */
START_TEST(t_mlp_fp32_linear)
{
    gpu_job_config c;
    if (!have_device())
        return;
    mlp_job(&c, GPU_FP16, false, GPU_ACT_RELU);
    c.autocast.policy[GPU_OP_LINEAR] = GPU_CAST_FP32;
    compare_job(&c, 2, &B16);
}
END_TEST

START_TEST(t_gpt)
{
    gpu_job_config c;
    if (!have_device())
        return;
    gpt_job(&c, GPU_FP32, true);
    compare_job(&c, 2, &B32);
    gpt_job(&c, GPU_FP16, true);
    compare_job(&c, 2, &B16);
    for (int master = 1; master >= 0; master--) {
        gpt_job(&c, GPU_BF16, master);
        compare_job(&c, 2, &B16);
    }
}
END_TEST

START_TEST(t_overflow)
{
    gpu_job_config c;
    gpu_step_metrics mc, mg;
    state_view before, after;
    const gpu_layer_stat *ls;
    const char *lc, *wc, *lg, *wg;
    int n;
    if (!have_device())
        return;
    mlp_job(&c, GPU_FP16, true, GPU_ACT_RELU);
    c.scaler.init_scale = 1e30f;
    c.scaler.max_scale = 1e30f;
    gpu_trainer *tc = make(&c, "cpu"), *tg = make(&c, "cuda");
    state_get(tg, &before);
    for (int s = 1; s <= 2; s++) {
        ck_assert_int_eq(gpu_trainer_step(tc, &mc, NULL, 0), 0);
        ck_assert_int_eq(gpu_trainer_step(tg, &mg, NULL, 0), 0);
        ck_assert(mc.overflow && mc.skipped && mg.overflow && mg.skipped);
        compare_metrics(&mc, &mg, tc, tg, &B16);
        ck_assert(gpu_trainer_scaler(tg)->scale == 1e30f * powf(0.5f, (float)s));
        ck_assert_int_eq(mg.overflow_total, s);
        /* the CPU runs the step again to diagnose it; the device diagnoses the next one */
        ck_assert(mc.diagnosed);
        ck_assert(mg.diagnosed == (s == 2));
        ck_assert_int_eq(gpu_trainer_diagnostics(tc, &ls, &n, &lc, &wc), 0);
        if (s == 2) {
            ck_assert_int_eq(gpu_trainer_diagnostics(tg, &ls, &n, &lg, &wg), 0);
            ck_assert_ptr_nonnull(lc);
            ck_assert_ptr_nonnull(lg);
            ck_assert_str_eq(lc, lg);
            ck_assert_str_eq(wc, wg);
        } else {
            ck_assert_int_eq(gpu_trainer_diagnostics(tg, &ls, &n, &lg, &wg), GPU_EINVAL);
        }
        const gpu_grad_stat *st = gpu_trainer_grad_stats(tg);
        int64_t nonfinite = 0;
        for (int k = 0; k < gpu_trainer_tensors(tg); k++)
            nonfinite += st[k].nonfinite;
        ck_assert_int_gt(nonfinite, 0);
    }
    state_get(tg, &after); /* the same host blocks: compare the copies state_get made */
    ck_assert_int_eq(before.n, after.n);
    for (int i = 0; i < before.n; i++)
        ck_assert_msg(before.f[i] == NULL ||
                          memcmp(before.f[i], after.f[i], before.count[i] * sizeof(float)) == 0,
                      "%s moved in a skipped step", before.v[i].name);
    state_put(&before);
    state_put(&after);
    gpu_trainer_free(tc);
    gpu_trainer_free(tg);
}
END_TEST

/* One diagnosed fp16 step of c on both: the per-layer statistics agree. */
/* An fp8 layer's operands as the device counts them and as the CPU does: amax and scale
 * within the 16-bit bounds, headroom within 0.05 bits, the fractions within 0.02. */
static void compare_fp8_fields(const gpu_layer_stat *a, const gpu_layer_stat *b)
{
    const char *role[3] = {"in", "w", "grad"};
    const double va[3][5] = {
        {a->fp8_in_amax, a->fp8_in_scale, a->fp8_in_headroom, a->fp8_in_saturated,
         a->fp8_in_underflow},
        {a->fp8_w_amax, a->fp8_w_scale, a->fp8_w_headroom, a->fp8_w_saturated, a->fp8_w_underflow},
        {a->fp8_grad_amax, a->fp8_grad_scale, a->fp8_grad_headroom, a->fp8_grad_saturated,
         a->fp8_grad_underflow}};
    const double vb[3][5] = {
        {b->fp8_in_amax, b->fp8_in_scale, b->fp8_in_headroom, b->fp8_in_saturated,
         b->fp8_in_underflow},
        {b->fp8_w_amax, b->fp8_w_scale, b->fp8_w_headroom, b->fp8_w_saturated, b->fp8_w_underflow},
        {b->fp8_grad_amax, b->fp8_grad_scale, b->fp8_grad_headroom, b->fp8_grad_saturated,
         b->fp8_grad_underflow}};
    for (int r = 0; r < 3; r++) {
        ck_assert_msg(va[r][0] > 0 && rel_diff(va[r][0], vb[r][0]) <= TOL16 &&
                          rel_diff(va[r][1], vb[r][1]) <= TOL16,
                      "%s %s: amax %g %g, scale %g %g", a->name, role[r], va[r][0], vb[r][0],
                      va[r][1], vb[r][1]);
        ck_assert_msg(fabs(va[r][2] - vb[r][2]) <= 0.05, "%s %s: headroom %g %g", a->name, role[r],
                      va[r][2], vb[r][2]);
        for (int k = 3; k < 5; k++)
            ck_assert_msg(fabs(va[r][k] - vb[r][k]) <= 0.02, "%s %s: %s %g %g", a->name, role[r],
                          k == 3 ? "saturated" : "underflow", va[r][k], vb[r][k]);
    }
}

static void compare_diag(gpu_job_config *c)
{
    gpu_step_metrics mc, mg;
    const gpu_layer_stat *lc, *lg;
    const char *fc, *fg, *wc, *wg;
    int nc, ng;
    c->diagnostics_every = 1;
    gpu_trainer *tc = make(c, "cpu"), *tg = make(c, "cuda");
    ck_assert_int_eq(gpu_trainer_step(tc, &mc, NULL, 0), 0);
    ck_assert_int_eq(gpu_trainer_step(tg, &mg, NULL, 0), 0);
    ck_assert(mc.diagnosed && mg.diagnosed);
    ck_assert_int_eq(gpu_trainer_diagnostics(tc, &lc, &nc, &fc, &wc), 0);
    ck_assert_int_eq(gpu_trainer_diagnostics(tg, &lg, &ng, &fg, &wg), 0);
    ck_assert_int_eq(nc, ng);
    ck_assert_ptr_null(fc);
    ck_assert_ptr_null(fg);
    for (int i = 0; i < nc; i++) {
        const gpu_layer_stat *a = &lc[i], *b = &lg[i];
        ck_assert_str_eq(a->name, b->name);
        ck_assert_int_eq(a->dtype, b->dtype);
        ck_assert_msg(rel_diff(a->act_amax, b->act_amax) <= TOL16, "%s: act_amax %g %g",
                      a->name, a->act_amax, b->act_amax);
        ck_assert_msg(rel_diff(a->grad_amax, b->grad_amax) <= TOL16, "%s: grad_amax %g %g",
                      a->name, a->grad_amax, b->grad_amax);
        ck_assert_int_eq(a->act_overflow, b->act_overflow);
        ck_assert_int_eq(a->grad_nonfinite, b->grad_nonfinite);
        ck_assert_msg(fabs(a->grad_underflow - b->grad_underflow) <= 0.02, "%s: underflow %g %g",
                      a->name, a->grad_underflow, b->grad_underflow);
        ck_assert_msg(fabs(a->grad_underflow_unscaled - b->grad_underflow_unscaled) <= 0.02,
                      "%s: underflow unscaled %g %g", a->name, a->grad_underflow_unscaled,
                      b->grad_underflow_unscaled);
        ck_assert_msg(fabs(a->lost_updates - b->lost_updates) <= 0.02, "%s: lost %g %g",
                      a->name, a->lost_updates, b->lost_updates);
        ck_assert_msg(a->fp8 == b->fp8, "%s: fp8 %d %d", a->name, a->fp8, b->fp8);
        if (a->fp8)
            compare_fp8_fields(a, b);
    }
    gpu_trainer_free(tc);
    gpu_trainer_free(tg);
}

START_TEST(t_diag)
{
    gpu_job_config c;
    if (!have_device())
        return;
    mlp_job(&c, GPU_FP16, true, GPU_ACT_RELU);
    compare_diag(&c);
    mlp_job(&c, GPU_FP16, false, GPU_ACT_GELU);
    compare_diag(&c);
    gpt_job(&c, GPU_FP16, true);
    compare_diag(&c);
    fp8_mlp_job(&c, true, GPU_FP8_DELAYED); /* the device counts its casts */
    c.model.init_scale = 8.0f; /* the head's gradient underflows in E5M2 (docs/fp8.md) */
    compare_diag(&c);
    fp8_gpt_job(&c, true, GPU_FP8_CURRENT);
    compare_diag(&c);
}
END_TEST

/* A checkpoint of c taken from a device trainer after 3 steps and restored into a new one
 * continues with the original's losses and state. */
static void checkpoint_case(const gpu_job_config *cj)
{
    gpu_job_config c = *cj;
    gpu_step_metrics ma, mb;
    gpu_state_scalars sc;
    state_view sa, sb, ra, rb;
    gpu_trainer *a = make(&c, "cuda"), *b = make(&c, "cuda");
    for (int s = 0; s < 3; s++)
        ck_assert_int_eq(gpu_trainer_step(a, &ma, NULL, 0), 0);
    state_get(a, &sa);
    ck_assert_int_eq(gpu_trainer_state(b, &sb.v, &sb.n), 0);
    ck_assert_int_eq(sa.n, sb.n);
    for (int i = 0; i < sa.n; i++) {
        ck_assert_uint_eq(sa.v[i].bytes, sb.v[i].bytes);
        memcpy(sb.v[i].data, sa.v[i].data, sa.v[i].bytes);
    }
    free(sb.v);
    gpu_trainer_get_scalars(a, &sc);
    ck_assert_int_eq(gpu_trainer_set_scalars(b, &sc), 0);
    for (int s = 0; s < 2; s++) {
        ck_assert_int_eq(gpu_trainer_step(a, &ma, NULL, 0), 0);
        ck_assert_int_eq(gpu_trainer_step(b, &mb, NULL, 0), 0);
        ck_assert_int_eq(ma.step, mb.step);
        ck_assert_msg(rel_diff(ma.loss, mb.loss) <= 1e-9, "loss %.17g %.17g", ma.loss, mb.loss);
        ck_assert(ma.loss_scale == mb.loss_scale);
    }
    state_get(a, &ra);
    state_get(b, &rb);
    for (int i = 0; i < ra.n; i++)
        if (ra.f[i] != NULL)
            expect_close(ra.v[i].name, ra.f[i], rb.f[i], ra.count[i], 1e-6, NULL, 0.0);
    state_put(&sa);
    state_put(&ra);
    state_put(&rb);
    gpu_trainer_free(a);
    gpu_trainer_free(b);
}

START_TEST(t_checkpoint)
{
    gpu_job_config c;
    if (!have_device())
        return;
    mlp_job(&c, GPU_FP16, true, GPU_ACT_RELU);
    gpu_optim_defaults(&c.optim);
    checkpoint_case(&c);
    /* fp8: the scaling rows travel with the checkpoint (downloaded, then uploaded) */
    fp8_mlp_job(&c, true, GPU_FP8_DELAYED);
    checkpoint_case(&c);
}
END_TEST

/* One rank through NCCL (gpu_trainer_nccl_alone), fp32 at scale 1, against the same job
 * without it: hook none changes nothing (x / 1, then a sum over one rank), bit for bit,
 * step after step; fp16 and bf16 round every gradient to 16 bits and do nothing else; the
 * bytes are 4 or 2 per parameter and the times are in order. */
START_TEST(t_nccl_alone)
{
    const gpu_comm_hook hooks[] = {GPU_HOOK_NONE, GPU_HOOK_FP16, GPU_HOOK_BF16};
    const gpu_dtype wire[] = {GPU_FP32, GPU_FP16, GPU_BF16};
    gpu_job_config c;
    gpu_step_metrics mr[2], m;
    const float *g;
    char err[512] = "";
    if (!have_device())
        return;
    mlp_job(&c, GPU_FP32, true, GPU_ACT_RELU);
    gpu_trainer *ref = make(&c, "cuda");
    size_t P = (size_t)gpu_trainer_params(ref);
    float *want = xmalloc(P * sizeof(float)), *round = xmalloc(P * sizeof(float));
    ck_assert_int_eq(gpu_trainer_step(ref, &mr[0], NULL, 0), 0);
    ck_assert_int_eq(gpu_trainer_grads(ref, &g), 0);
    memcpy(want, g, P * sizeof(float));
    ck_assert_int_eq(gpu_trainer_step(ref, &mr[1], NULL, 0), 0);
    for (int h = 0; h < 3; h++) {
        c.dist.hook = hooks[h];
        gpu_trainer *t = make(&c, "cuda");
        int rc = gpu_trainer_nccl_alone(t, err, sizeof(err));
        ck_assert_msg(rc == 0, "hook %d: %s (%s)", h, err, gpu_strerror(rc));
        ck_assert_int_eq(gpu_trainer_step(t, &m, NULL, 0), 0);
        ck_assert(m.loss == mr[0].loss);
        ck_assert_int_eq(gpu_trainer_grads(t, &g), 0);
        gpu_round_n(round, want, P, wire[h]);
        for (size_t i = 0; i < P; i++)
            ck_assert_msg(f2u(g[i]) == f2u(round[i]), "hook %d: gradient %zu is %a, not %a", h, i,
                          (double)g[i], (double)round[i]);
        ck_assert_int_eq(m.comm_bytes, (int64_t)(P * (h == 0 ? 4 : 2)));
        ck_assert(m.comm_ms >= 0.0 && m.comm_exposed_ms >= 0.0 && m.comm_exposed_ms <= m.comm_ms);
        ck_assert_int_eq(gpu_trainer_step(t, &m, NULL, 0), 0);
        if (h == 0)
            ck_assert_msg(m.loss == mr[1].loss, "step 2: %.17g, not %.17g", m.loss, mr[1].loss);
        gpu_trainer_free(t);
    }
    free(want);
    free(round);
    gpu_trainer_free(ref);
}
END_TEST

START_TEST(t_fashion_mnist)
{
    const char *dir = getenv("AMPD_TEST_DATA");
    gpu_job_config c;
    gpu_eval_result ev[2];
    gpu_step_metrics m;
    if (!have_device())
        return;
    if (!dir)
        dir = "/usr/share/datasets/fashion-mnist";
    gpu_job_defaults(&c);
    c.data.type = GPU_DATA_IDX;
    snprintf(c.data.train_images, sizeof(c.data.train_images), "%s/train-images-idx3-ubyte.gz",
             dir);
    if (access(c.data.train_images, R_OK) != 0) {
        printf("check_cuda_train: Fashion-MNIST job skipped: %s not found\n",
               c.data.train_images);
        return;
    }
    snprintf(c.data.train_labels, sizeof(c.data.train_labels), "%s/train-labels-idx1-ubyte.gz",
             dir);
    snprintf(c.data.eval_images, sizeof(c.data.eval_images), "%s/t10k-images-idx3-ubyte.gz", dir);
    snprintf(c.data.eval_labels, sizeof(c.data.eval_labels), "%s/t10k-labels-idx1-ubyte.gz", dir);
    c.model.nlayers = 3;
    c.model.layers[0] = 784;
    c.model.layers[1] = 256;
    c.model.layers[2] = 10;
    c.dtype = GPU_FP16;
    gpu_scaler_defaults(&c.scaler, GPU_FP16);
    c.batch_size = 128;
    c.steps = 1000;
    const char *devs[2] = {"cuda", "cpu"};
    for (int d = 0; d < 2; d++) {
        gpu_trainer *t = make(&c, devs[d]);
        for (int64_t s = 0; s < c.steps; s++)
            ck_assert_int_eq(gpu_trainer_step(t, &m, NULL, 0), 0);
        ck_assert_int_eq(gpu_trainer_eval(t, &ev[d]), 0);
        printf("check_cuda_train: Fashion-MNIST on %s: accuracy %.4f, loss %.4f\n",
               gpu_trainer_device(t), ev[d].accuracy, ev[d].loss);
        gpu_trainer_free(t);
    }
    ck_assert_int_eq(ev[0].count, 10000);
    ck_assert_msg(ev[0].accuracy > 0.8, "accuracy %g", ev[0].accuracy);
    ck_assert_msg(fabs(ev[0].accuracy - ev[1].accuracy) <= 0.01, "accuracy cuda %g cpu %g",
                  ev[0].accuracy, ev[1].accuracy);
}
END_TEST

static Suite *cuda_train_suite(void)
{
    Suite *s = suite_create("cuda_train");
    TCase *tc = tcase_create("cuda_train");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, t_select);
    tcase_add_test(tc, t_mlp_fp32);
    tcase_add_test(tc, t_mlp_fp16);
    tcase_add_test(tc, t_mlp_bf16);
    tcase_add_test(tc, t_mlp_fp8);
    tcase_add_test(tc, t_gpt_fp8);
    tcase_add_test(tc, t_mlp_adamw);
    tcase_add_test(tc, t_mlp_fp32_linear);
    tcase_add_test(tc, t_gpt);
    tcase_add_test(tc, t_overflow);
    tcase_add_test(tc, t_diag);
    tcase_add_test(tc, t_checkpoint);
    tcase_add_test(tc, t_nccl_alone);
    tcase_add_test(tc, t_fashion_mnist);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    int status = cudatest_main("check_cuda_train", cuda_train_suite());
    if (text_path[0]) {
        char dir[256];
        snprintf(dir, sizeof(dir), "%s", text_path);
        *strrchr(dir, '/') = '\0';
        unlink(text_path);
        rmdir(dir);
    }
    return status;
}
