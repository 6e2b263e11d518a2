/*
 * check_train.c - whole training runs through the trainer, turning the seed's lessons into
 * facts:
 *   - a short Fashion-MNIST run in fp16 with dynamic scaling whose loss falls;
 *   - fp16 without loss scaling loses a deep, narrow MLP's first-layer gradients to
 *     underflow (all exact zeros) and does not learn, where dynamic scaling does;
 *   - fp16 without master weights loses most updates to rounding and stalls, where master
 *     weights converge;
 *   - fp16 activations beyond 65504 make every step overflow until the scale sits at its
 *     floor, and the job fails with a diagnosis that recommends bf16; bf16 trains it;
 *   - the same seed gives the same run, bit for bit;
 *   - an MLP in fp16 or bf16 that keeps its weights' working copy in the gradient block runs
 *     bit for bit as one that rounds the master in its GEMMs.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/comm.h"
#include "gpu/gpu.h"
#include "gpu/twin.h"
#include "tests/testutil.h"

typedef struct {
    double first, last;
    gpu_eval_result eval;
    gpu_step_metrics m;
    gpu_grad_stat fc1w;
    int rc;
    char err[512];
} run_result;

static void train(const gpu_job_config *c, run_result *r)
{
    gpu_trainer *t;
    memset(r, 0, sizeof(*r));
    ck_assert_msg(gpu_trainer_create(c, &t, r->err, sizeof(r->err)) == 0, "create: %s", r->err);
    for (int64_t i = 0; i < c->steps; i++) {
        r->rc = gpu_trainer_step(t, &r->m, r->err, sizeof(r->err));
        if (i == 0)
            r->first = r->m.loss;
        if (r->rc)
            break;
    }
    r->last = r->m.loss;
    r->fc1w = gpu_trainer_grad_stats(t)[0];
    ck_assert_str_eq(gpu_trainer_tensor_name(t, 0), "fc1.weight");
    ck_assert_int_eq(gpu_trainer_eval(t, &r->eval), 0);
    gpu_trainer_free(t);
}

START_TEST(test_fashion_mnist)
{
    const char *dir = getenv("AMPD_TEST_DATA");
    gpu_job_config c;
    gpu_trainer *t;
    gpu_step_metrics m;
    gpu_eval_result ev;
    char err[512];
    double head = 0, tail = 0;

    if (!dir)
        dir = "/usr/share/datasets/fashion-mnist";
    test_cpu_job(&c);
    c.data.type = GPU_DATA_IDX;
    snprintf(c.data.train_images, sizeof(c.data.train_images), "%s/train-images-idx3-ubyte.gz",
             dir);
    snprintf(c.data.train_labels, sizeof(c.data.train_labels), "%s/train-labels-idx1-ubyte.gz",
             dir);
    snprintf(c.data.eval_images, sizeof(c.data.eval_images), "%s/t10k-images-idx3-ubyte.gz", dir);
    snprintf(c.data.eval_labels, sizeof(c.data.eval_labels), "%s/t10k-labels-idx1-ubyte.gz", dir);
    c.model.nlayers = 3;
    c.model.layers[1] = 256;
    c.model.layers[2] = 10;
    c.dtype = GPU_FP16;
    gpu_scaler_defaults(&c.scaler, GPU_FP16);
    c.batch_size = 128;
    c.steps = 150;
    ck_assert_msg(gpu_trainer_create(&c, &t, err, sizeof(err)) == 0,
                  "%s (install the Debian package dataset-fashion-mnist)", err);
    for (int i = 0; i < 150; i++) {
        ck_assert_int_eq(gpu_trainer_step(t, &m, err, sizeof(err)), 0);
        ck_assert(isfinite(m.loss));
        if (i < 10)
            head += m.loss / 10;
        if (i >= 140)
            tail += m.loss / 10;
    }
    ck_assert_int_eq(gpu_trainer_eval(t, &ev), 0);
    ck_assert_int_eq(ev.count, 10000);
    ck_assert_msg(tail < 0.5 * head, "loss fell only from %.3f to %.3f", head, tail);
    ck_assert_msg(ev.accuracy > 0.78, "test accuracy %.3f", ev.accuracy);
    ck_assert(m.mem.master == 4 * gpu_trainer_params(t));
    /* the MLP's GEMMs round the master as they read it: no 16-bit copy of the weights */
    ck_assert(m.mem.weights == 0);
    gpu_trainer_free(t);
}
END_TEST

START_TEST(test_underflow_lesson)
{
    gpu_job_config c;
    run_result none, dyn, fp32;
    test_narrow_job(&c, 12, 0.5f, GPU_SCALE_NONE);
    c.steps = 300;
    train(&c, &none);
    test_narrow_job(&c, 12, 0.5f, GPU_SCALE_DYNAMIC);
    c.steps = 300;
    train(&c, &dyn);
    test_narrow_job(&c, 12, 0.5f, GPU_SCALE_NONE);
    c.dtype = GPU_FP32;
    c.steps = 300;
    train(&c, &fp32);
    int64_t n = 32 * 32;
    /* without scaling every first-layer gradient flushed to zero in fp16 */
    ck_assert_msg(none.fc1w.zeros == n, "only %lld of %lld grads flushed",
                  (long long)none.fc1w.zeros, (long long)n);
    ck_assert_msg(none.eval.loss > 1.3, "unscaled fp16 still learned: %.3f", none.eval.loss);
    /* dynamic scaling keeps them and the model learns, like fp32 */
    ck_assert_msg(dyn.fc1w.zeros < n / 20, "%lld grads still zero", (long long)dyn.fc1w.zeros);
    ck_assert_msg(dyn.eval.loss < 1.05, "scaled fp16 eval loss %.3f", dyn.eval.loss);
    ck_assert_msg(fp32.eval.loss < 1.05, "fp32 eval loss %.3f", fp32.eval.loss);
    ck_assert_int_eq(dyn.m.overflow_total, dyn.m.skipped_total);
}
END_TEST

START_TEST(test_master_weights_lesson)
{
    gpu_job_config c;
    run_result with, without;
    test_narrow_job(&c, 4, 2.0f, GPU_SCALE_DYNAMIC);
    c.optim.lr = 3e-5f;
    c.steps = 2000;
    train(&c, &with);
    c.master_weights = false;
    train(&c, &without);
    ck_assert_int_eq(with.m.lost_total, 0);
    int64_t updates = 2000 * (int64_t)(32 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4);
    ck_assert_msg(without.m.lost_total > updates / 2, "%lld of %lld updates lost",
                  (long long)without.m.lost_total, (long long)updates);
    ck_assert_msg(with.eval.loss < without.eval.loss - 0.2,
                  "master weights %.3f vs fp16 weights %.3f", with.eval.loss, without.eval.loss);
    ck_assert_msg(without.eval.loss > 0.95 * without.first, "fp16 weights did not stall");
}
END_TEST

START_TEST(test_overflow_floor)
{
    gpu_job_config c;
    run_result r, bf;
    test_narrow_job(&c, 4, 300.0f, GPU_SCALE_DYNAMIC);
    c.steps = 500;
    train(&c, &r);
    /* 16 backoffs from 65536 to the floor of 1, then 50 overflowing steps at the floor */
    ck_assert_int_eq(r.rc, GPU_ESCALE_FLOOR);
    ck_assert_int_eq(r.m.step, 16 + 50);
    ck_assert_float_eq(r.m.loss_scale, 1.0f);
    ck_assert(!isfinite(r.m.loss));
    ck_assert_int_eq(r.m.overflow_total, 66);
    ck_assert_int_eq(r.m.skipped_total, 66);
    ck_assert_msg(strstr(r.err, "use bf16") != NULL, "diagnosis: %s", r.err);
    ck_assert_msg(strstr(r.err, "fc") != NULL, "no tensor named: %s", r.err);
    /* the same job in bf16 trains: bf16 has fp32's range */
    c.dtype = GPU_BF16;
    gpu_scaler_defaults(&c.scaler, GPU_BF16);
    c.steps = 100;
    train(&c, &bf);
    ck_assert_int_eq(bf.rc, 0);
    ck_assert(isfinite(bf.last));
    ck_assert_int_eq(bf.m.overflow_total, 0);
}
END_TEST

START_TEST(test_scale_backoff_then_growth)
{
    gpu_job_config c;
    run_result r;
    test_narrow_job(&c, 4, 1.0f, GPU_SCALE_DYNAMIC);
    c.scaler.init_scale = 16777216.0f; /* 2^24: the first backward overflows fp16 */
    c.scaler.growth_interval = 50;
    c.steps = 200;
    train(&c, &r);
    ck_assert_int_eq(r.rc, 0);
    ck_assert_msg(r.m.overflow_total >= 1, "no overflow at scale 2^24");
    ck_assert_int_eq(r.m.overflow_total, r.m.skipped_total);
    ck_assert(r.m.loss_scale < 16777216.0f);
    ck_assert(isfinite(r.last) && r.last < r.first);
}
END_TEST

START_TEST(test_deterministic)
{
    gpu_job_config c;
    gpu_trainer *a, *b;
    gpu_step_metrics ma, mb;
    test_narrow_job(&c, 5, 1.0f, GPU_SCALE_DYNAMIC);
    ck_assert_int_eq(gpu_trainer_create(&c, &a, NULL, 0), 0);
    ck_assert_int_eq(gpu_trainer_create(&c, &b, NULL, 0), 0);
    for (int i = 0; i < 50; i++) {
        ck_assert_int_eq(gpu_trainer_step(a, &ma, NULL, 0), 0);
        ck_assert_int_eq(gpu_trainer_step(b, &mb, NULL, 0), 0);
        ck_assert_msg(memcmp(&ma.loss, &mb.loss, sizeof(double)) == 0, "step %d differs", i);
    }
    gpu_trainer_free(a);
    gpu_trainer_free(b);
}
END_TEST

/* Whether t's gradient block holds fc1's weights rounded to dt where the update leaves the
 * copy (gpu_optim_copy_at): the share of fc1's weights that it does. */
static double copy_share(gpu_trainer *t, gpu_dtype dt)
{
    gpu_state_tensor *v;
    const float *g;
    int n, ld, same = 0;
    gpu_dtype sdt;
    ck_assert_int_eq(gpu_trainer_grads(t, &g), 0);
    ck_assert_int_eq(gpu_trainer_state(t, &v, &n), 0);
    ck_assert_str_eq(v[0].name, "fc1.weight");
    const float *w = v[0].data;
    int rows = (int)v[0].shape[0], cols = (int)v[0].shape[1];
    const void *at = gpu_optim_copy_at(g, 0, cols, dt, &sdt, &ld);
    for (int i = 0; i < rows * cols; i++) {
        size_t k = (size_t)(i / cols) * (size_t)ld + (size_t)(i % cols);
        if (sdt == GPU_BF16)
            same += ((const uint16_t *)at)[k] == gpu_f32_to_bf16(w[i]);
        else
            same += ((const float *)at)[k] == gpu_f16_to_f32(gpu_f32_to_f16(w[i]));
    }
    free(v);
    return (double)same / (rows * cols);
}

/* A trainer's state (scalars and every tensor's bytes), as a checkpoint holds it. */
typedef struct {
    gpu_state_scalars sc;
    uint8_t *bytes;
} saved_state;

static void state_save(gpu_trainer *t, saved_state *s)
{
    gpu_state_tensor *v;
    int n;
    size_t total = 0;
    gpu_trainer_get_scalars(t, &s->sc);
    ck_assert_int_eq(gpu_trainer_state(t, &v, &n), 0);
    for (int i = 0; i < n; i++)
        total += v[i].bytes;
    s->bytes = malloc(total);
    ck_assert_ptr_nonnull(s->bytes);
    for (int i = 0, at = 0; i < n; at += (int)v[i++].bytes)
        memcpy(s->bytes + at, v[i].data, v[i].bytes);
    free(v);
}

/* Write a saved state back into the trainer's tensors and scalars: a restore. */
static void state_restore(gpu_trainer *t, saved_state *s)
{
    gpu_state_tensor *v;
    int n;
    ck_assert_int_eq(gpu_trainer_state(t, &v, &n), 0);
    for (int i = 0, at = 0; i < n; at += (int)v[i++].bytes)
        memcpy(v[i].data, s->bytes + at, v[i].bytes);
    free(v);
    ck_assert_int_eq(gpu_trainer_set_scalars(t, &s->sc), 0);
}

/* The losses of steps 1..n of a trainer (whose weights do not move: lr 1e-30). */
static void losses(gpu_trainer *t, double *out, int n)
{
    gpu_step_metrics m;
    for (int i = 0; i < n; i++) {
        ck_assert_int_eq(gpu_trainer_step(t, &m, NULL, 0), 0);
        out[i] = m.loss;
    }
}

/* data.skip_batches: with weights that do not move (lr 1e-30), a step's loss is a function
 * of its batch alone, so a run that skips k batches has at step s the loss of the plain run
 * at step s + k: from its start (shuffled, across epoch boundaries, and in the file's
 * order), and from a restored state that skipped fewer (a branch that skips more: the rest
 * is skipped from there, and the state then says so). */
START_TEST(test_skip_batches)
{
    enum { N = 24, K = 7, AT = 5 };
    for (int in_order = 0; in_order < 2; in_order++) {
        gpu_job_config c;
        gpu_trainer *a, *b;
        saved_state st;
        double la[N + K], lb[N];
        test_narrow_job(&c, 3, 1.0f, GPU_SCALE_DYNAMIC);
        c.dtype = GPU_FP32;
        c.optim.lr = 1e-30f;
        c.data.synth_train = 200; /* an epoch of 3 batches and a part */
        c.data.in_order = in_order;
        ck_assert_int_eq(gpu_trainer_create(&c, &a, NULL, 0), 0);
        losses(a, la, N + K);
        gpu_trainer_free(a);
        c.data.skip_batches = K;
        ck_assert_int_eq(gpu_trainer_create(&c, &b, NULL, 0), 0);
        losses(b, lb, N);
        gpu_trainer_free(b);
        for (int i = 0; i < N; i++)
            ck_assert_msg(lb[i] == la[i + K],
                          "in_order %d: step %d of the skipping run is not step %d of the "
                          "plain one",
                          in_order, i + 1, i + 1 + K);
        /* a branch that skips K from the plain run's state at step AT */
        c.data.skip_batches = 0;
        ck_assert_int_eq(gpu_trainer_create(&c, &a, NULL, 0), 0);
        losses(a, lb, AT);
        state_save(a, &st);
        gpu_trainer_free(a);
        ck_assert_int_eq(st.sc.skipped, 0);
        c.data.skip_batches = K;
        ck_assert_int_eq(gpu_trainer_create(&c, &b, NULL, 0), 0);
        state_restore(b, &st);
        losses(b, lb, N - AT);
        for (int i = 0; i < N - AT; i++)
            ck_assert_msg(lb[i] == la[AT + i + K],
                          "in_order %d: the branch's step %d is not the plain run's step %d",
                          in_order, AT + i + 1, AT + i + 1 + K);
        free(st.bytes);
        gpu_trainer_get_scalars(b, &st.sc);
        gpu_trainer_free(b);
        ck_assert_int_eq(st.sc.skipped, K);
        /* a state that skipped more than the job says cannot be this job's */
        c.data.skip_batches = K - 1;
        ck_assert_int_eq(gpu_trainer_create(&c, &a, NULL, 0), 0);
        ck_assert_int_eq(gpu_trainer_set_scalars(a, &st.sc), GPU_EINVAL);
        gpu_trainer_free(a);
    }
}
END_TEST

/* The CPU MLP in fp16 or bf16 keeps its weights' working copy in the gradient block between
 * an update and the next backward; the run is the one of a trainer that keeps its gradients
 * (and rounds the master in the GEMMs), bit for bit: through fp16's overflowing steps
 * (skipped, with diagnostics recomputed), collecting steps, an eval and a restore of the
 * state saved five steps before. */
START_TEST(test_copy_in_grads)
{
    gpu_dtype dt = _i ? GPU_BF16 : GPU_FP16;
    gpu_job_config c;
    gpu_trainer *t[2];
    gpu_step_metrics m[2];
    gpu_eval_result e[2];
    saved_state saved[2];
    bool looked = false;
    test_narrow_job(&c, 4, 1.0f, GPU_SCALE_DYNAMIC);
    c.model.layers[1] = 47;
    c.model.layers[2] = 29;
    c.dtype = dt;
    gpu_scaler_defaults(&c.scaler, dt);
    if (dt == GPU_FP16) {
        c.scaler.init_scale = 16777216.0f; /* the first backward overflows */
        c.scaler.growth_interval = 3;
    }
    c.diagnostics_every = 5;
    for (int k = 0; k < 2; k++)
        ck_assert_int_eq(gpu_trainer_create(&c, &t[k], NULL, 0), 0);
    gpu_trainer_keep_grads(t[1]);
    for (int i = 0; i < 30; i++) {
        for (int k = 0; k < 2; k++)
            ck_assert_int_eq(gpu_trainer_step(t[k], &m[k], NULL, 0), 0);
        ck_assert_msg(memcmp(&m[0].loss, &m[1].loss, sizeof(double)) == 0 &&
                          memcmp(&m[0].grad_norm, &m[1].grad_norm, sizeof(double)) == 0,
                      "%s step %d: loss %.17g vs %.17g", gpu_dtype_name(dt), i, m[0].loss,
                      m[1].loss);
        ck_assert(m[0].skipped == m[1].skipped);
        if (i >= 8 && !looked && !m[0].skipped) { /* the copy is where the next forward
                                                    * reads it; not in the other trainer */
            ck_assert(copy_share(t[0], dt) == 1.0);
            ck_assert(copy_share(t[1], dt) < 0.5);
            looked = true;
        }
        if (i == 12) {
            for (int k = 0; k < 2; k++)
                ck_assert_int_eq(gpu_trainer_eval(t[k], &e[k]), 0);
            ck_assert(memcmp(&e[0].loss, &e[1].loss, sizeof(double)) == 0);
        }
        for (int k = 0; k < 2 && (i == 15 || i == 20); k++)
            (i == 15 ? state_save : state_restore)(t[k], &saved[k]);
    }
    ck_assert(looked);
    if (dt == GPU_FP16) /* growth overflows again now and then, after updates */
        ck_assert_int_ge(m[0].skipped_total, 3);
    for (int k = 0; k < 2; k++) {
        gpu_trainer_free(t[k]);
        free(saved[k].bytes);
    }
}
END_TEST

START_TEST(test_bad_config)
{
    gpu_job_config c;
    gpu_trainer *t = NULL;
    char err[512];
    test_narrow_job(&c, 4, 1.0f, GPU_SCALE_DYNAMIC);
    c.model.layers[0] = 33; /* data has 32 features */
    ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), GPU_EINVAL);
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(err, "model.layers[0]") != NULL, "%s", err);
    test_cpu_job(&c);
    c.data.type = GPU_DATA_IDX;
    snprintf(c.data.train_images, sizeof(c.data.train_images), "/nonexistent/x-images");
    snprintf(c.data.train_labels, sizeof(c.data.train_labels), "/nonexistent/x-labels");
    ck_assert_int_eq(gpu_trainer_create(&c, &t, err, sizeof(err)), GPU_EIO);
    ck_assert_msg(strstr(err, "/nonexistent/x-images") != NULL, "%s", err);
}
END_TEST

/* A rank's place on its node: Open MPI's variables under mpirun, Slurm's under srun (a
 * node's task count from SLURM_STEP_TASKS_PER_NODE, "2(x2),1", by SLURM_NODEID). */
START_TEST(test_local_rank)
{
    static const struct {
        const char *per_node, *node;
        int size;
    } cases[] = {{"2(x2),1", "0", 2}, {"2(x2),1", "1", 2}, {"2(x2),1", "2", 1},
                 {"4", "0", 4},       {"1,3,2", "1", 3},   {"2(x", "0", 1},
                 {"x", "0", 1},       {"2(x2)", "5", 1}};
    int rank, size;
    unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
    unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    setenv("SLURM_LOCALID", "1", 1);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        setenv("SLURM_STEP_TASKS_PER_NODE", cases[i].per_node, 1);
        setenv("SLURM_NODEID", cases[i].node, 1);
        gpu_comm_local(&rank, &size);
        ck_assert_msg(size == cases[i].size && rank == 1, "%s on node %s: rank %d of %d",
                      cases[i].per_node, cases[i].node, rank, size);
    }
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1); /* mpirun inside an allocation: its own */
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3", 1);
    gpu_comm_local(&rank, &size);
    ck_assert_int_eq(rank, 0);
    ck_assert_int_eq(size, 3);
    unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
    unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    unsetenv("SLURM_STEP_TASKS_PER_NODE");
    unsetenv("SLURM_NODEID");
    unsetenv("SLURM_LOCALID");
    gpu_comm_local(&rank, &size);
    ck_assert_int_eq(rank, 0);
    ck_assert_int_eq(size, 1);
}
END_TEST

static Suite *train_suite(void)
{
    Suite *s = suite_create("train");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_fashion_mnist);
    tcase_add_test(tc, test_underflow_lesson);
    tcase_add_test(tc, test_master_weights_lesson);
    tcase_add_test(tc, test_overflow_floor);
    tcase_add_test(tc, test_scale_backoff_then_growth);
    tcase_add_test(tc, test_deterministic);
    tcase_add_test(tc, test_skip_batches);
    tcase_add_loop_test(tc, test_copy_in_grads, 0, 2);
    tcase_add_test(tc, test_bad_config);
    tcase_add_test(tc, test_local_rank);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(train_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
