/*
 * check_spec.c - job-spec validation: the complete example of docs/job-spec.md parses with
 * its values, every omitted field gets its default, and bad input is refused with the
 * offending field named.
 *
 * Data roots point at a temporary directory with a fake IDX dataset, text files and token
 * files so the tests do not depend on installed packages.
 */
#include <check.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "api/api.h"

static char root[256];
static api_spec_opts opts;

static void touch(const char *dir, const char *name)
{
    char p[512];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    ck_assert_ptr_nonnull(f);
    fclose(f);
}

static void setup(void)
{
    char dir[300];
    snprintf(root, sizeof(root), "/tmp/ampd-spec-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(root));
    snprintf(dir, sizeof(dir), "%s/fashion-mnist", root);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    touch(dir, "train-images-idx3-ubyte.gz");
    touch(dir, "train-labels-idx1-ubyte.gz");
    touch(dir, "t10k-images-idx3-ubyte");
    touch(dir, "t10k-labels-idx1-ubyte");
    /* text and token sources (their content is the worker's business, not the spec's) */
    snprintf(dir, sizeof(dir), "%s/fortunes", root);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    touch(dir, "cookie");
    touch(dir, "cookie.dat");
    touch(root, "shakespeare.txt");
    touch(root, "tiny_train.bin");
    touch(root, "tiny_val.bin");
    memset(&opts, 0, sizeof(opts));
    opts.nroots = 1;
    snprintf(opts.roots[0], sizeof(opts.roots[0]), "%s", root);
}

static void teardown(void)
{
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
    ck_assert_int_eq(system(cmd), 0);
}

static int parse(const char *json, gpu_job_config *c, api_error *e)
{
    return api_spec_parse(json, strlen(json), &opts, c, e);
}

/* Parsing json must fail and name field. */
static void expect_field(const char *json, const char *field)
{
    gpu_job_config c;
    api_error e;
    int rc = parse(json, &c, &e);
    ck_assert_msg(rc == GPU_EINVAL, "accepted: %s", json);
    ck_assert_str_eq(e.code, "invalid_spec");
    ck_assert_msg(strcmp(e.field, field) == 0, "%s: field \"%s\", expected \"%s\" (%s)", json,
                  e.field, field, e.message);
    ck_assert_msg(strlen(e.message) > 5, "no message for %s", json);
}

START_TEST(test_full_example)
{
    const char *spec =
        "{\"name\": \"fmnist-fp16\","
        " \"model\": {\"type\": \"mlp\", \"layers\": [784, 1024, 1024, 10], \"activation\": "
        "\"relu\"},"
        " \"data\": {\"type\": \"idx\", \"train\": \"fashion-mnist\", \"eval\": "
        "\"fashion-mnist:test\"},"
        " \"precision\": {\"dtype\": \"fp16\", \"master_weights\": true,"
        "   \"loss_scale\": {\"mode\": \"dynamic\", \"init\": 65536, \"growth_factor\": 2.0,"
        "     \"backoff_factor\": 0.5, \"growth_interval\": 2000, \"hysteresis\": 1,"
        "     \"min_scale\": 1.0, \"max_scale\": 16777216},"
        "   \"autocast\": {\"overrides\": {\"softmax\": \"fp32\"}}},"
        " \"optimizer\": {\"type\": \"adamw\", \"lr\": 0.001, \"betas\": [0.9, 0.999], \"eps\": "
        "1e-8,"
        "   \"weight_decay\": 0.0, \"grad_clip\": 1.0, \"warmup_steps\": 0, \"schedule\": "
        "\"cosine\"},"
        " \"batch_size\": 256, \"steps\": 2000, \"seed\": 1,"
        " \"eval_every\": 200, \"checkpoint_every\": 500,"
        " \"checkpoints\": {\"keep_last\": 3, \"keep_best\": 1}, \"diagnostics_every\": 50,"
        " \"device\": \"auto\", \"distributed\": {\"world_size\": 1, \"comm_hook\": \"none\"}}";
    gpu_job_config c;
    api_error e;
    ck_assert_int_eq(parse(spec, &c, &e), 0);
    ck_assert_str_eq(c.name, "fmnist-fp16");
    ck_assert_int_eq(c.model.nlayers, 4);
    ck_assert_int_eq(c.model.layers[1], 1024);
    ck_assert_int_eq(c.dtype, GPU_FP16);
    ck_assert(c.master_weights);
    ck_assert_int_eq(c.scaler.mode, GPU_SCALE_DYNAMIC);
    ck_assert_float_eq(c.scaler.init_scale, 65536.0f);
    ck_assert_float_eq(c.scaler.max_scale, 16777216.0f);
    ck_assert_int_eq(c.optim.schedule, GPU_SCHED_COSINE);
    ck_assert_float_eq(c.optim.grad_clip, 1.0f);
    ck_assert_int_eq(c.autocast.policy[GPU_OP_SOFTMAX], GPU_CAST_FP32);
    ck_assert_int_eq(c.steps, 2000);
    ck_assert_int_eq(c.eval_every, 200);
    ck_assert_int_eq(c.checkpoint_every, 500);
    ck_assert_int_eq(c.checkpoint_keep_last, 3);
    ck_assert_int_eq(c.checkpoint_keep_best, 1);
    ck_assert_ptr_nonnull(strstr(c.data.train_images, "fashion-mnist/train-images-idx3-ubyte.gz"));
    ck_assert_ptr_nonnull(strstr(c.data.eval_labels, "fashion-mnist/t10k-labels-idx1-ubyte"));
    json_t *canon = api_spec_to_json(&c);
    ck_assert_ptr_nonnull(canon);
    ck_assert_str_eq(
        json_string_value(json_object_get(json_object_get(canon, "precision"), "dtype")), "fp16");
    json_t *ck = json_object_get(canon, "checkpoints");
    ck_assert(json_is_object(ck) && json_object_size(ck) == 2);
    ck_assert_int_eq(json_integer_value(json_object_get(ck, "keep_last")), 3);
    ck_assert_int_eq(json_integer_value(json_object_get(ck, "keep_best")), 1);
    ck_assert_ptr_null(json_object_get(canon, "checkpoint_keep_last"));
    json_decref(canon);
}
END_TEST

START_TEST(test_defaults)
{
    gpu_job_config c;
    api_error e;
    ck_assert_int_eq(parse("{}", &c, &e), 0);
    ck_assert_int_eq(c.dtype, GPU_FP32);
    ck_assert_int_eq(c.scaler.mode, GPU_SCALE_NONE);
    ck_assert_int_eq(c.data.type, GPU_DATA_IDX);
    ck_assert_ptr_nonnull(strstr(c.data.eval_images, "t10k-images"));
    ck_assert_int_eq(c.batch_size, 256);
    ck_assert_str_eq(c.device, "auto");
    ck_assert_int_eq(c.checkpoint_every, 0);
    ck_assert_int_eq(c.checkpoint_keep_last, 3);
    ck_assert_int_eq(c.checkpoint_keep_best, 1);
    ck_assert_int_eq(parse("{\"checkpoints\": {\"keep_last\": 0, \"keep_best\": 0}}", &c, &e), 0);
    ck_assert_int_eq(c.checkpoint_keep_last, 0); /* every checkpoint kept */
    ck_assert_int_eq(c.checkpoint_keep_best, 0);
    /* a key left out of the object keeps its default */
    ck_assert_int_eq(parse("{\"checkpoints\": {\"keep_best\": 2}}", &c, &e), 0);
    ck_assert_int_eq(c.checkpoint_keep_last, 3);
    ck_assert_int_eq(c.checkpoint_keep_best, 2);
    ck_assert_int_eq(parse("{\"checkpoints\": {}}", &c, &e), 0);
    ck_assert_int_eq(c.checkpoint_keep_last, 3);
    ck_assert_int_eq(c.checkpoint_keep_best, 1);
    /* fp16 defaults to dynamic scaling, bf16 to none (PyTorch, DeepSpeed) */
    ck_assert_int_eq(parse("{\"precision\": {\"dtype\": \"fp16\"}}", &c, &e), 0);
    ck_assert_int_eq(c.scaler.mode, GPU_SCALE_DYNAMIC);
    ck_assert_float_eq(c.scaler.init_scale, 65536.0f);
    ck_assert_int_eq(c.scaler.growth_interval, 2000);
    ck_assert_int_eq(parse("{\"precision\": {\"dtype\": \"bf16\"}}", &c, &e), 0);
    ck_assert_int_eq(c.scaler.mode, GPU_SCALE_NONE);
    /* synthetic data follows the model's shape */
    ck_assert_int_eq(
        parse("{\"model\": {\"layers\": [20, 8, 3]}, \"data\": {\"type\": \"synthetic\"}}", &c, &e),
        0);
    ck_assert_int_eq(c.data.synth_features, 20);
    ck_assert_int_eq(c.data.synth_classes, 3);
    ck_assert_int_eq(parse("{\"data\": {\"train\": \"fashion-mnist\", \"eval\": null}}", &c, &e),
                     0);
    ck_assert_int_eq(c.data.eval_images[0], '\0');
}
END_TEST

/* CUDA devices are accepted whatever this machine has: a job fails when it starts on a
 * device that cannot be used (tests/check_run.sh). */
START_TEST(test_devices)
{
    const char *ok[] = {"auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:63"};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        char json[64];
        gpu_job_config c;
        api_error e;
        snprintf(json, sizeof(json), "{\"device\": \"%s\"}", ok[i]);
        ck_assert_msg(parse(json, &c, &e) == 0, "%s: %s", json, e.message);
        ck_assert_str_eq(c.device, ok[i]);
        json_t *canon = api_spec_to_json(&c);
        ck_assert_str_eq(json_string_value(json_object_get(canon, "device")), ok[i]);
        json_decref(canon);
    }
}
END_TEST

/* The data-parallel fields, their defaults, and the canonical spec's echo of them. */
START_TEST(test_distributed)
{
    gpu_job_config c;
    api_error e;
    ck_assert_int_eq(parse("{}", &c, &e), 0);
    ck_assert_int_eq(c.dist.world_size, 1);
    ck_assert_int_eq(c.dist.hook, GPU_HOOK_NONE);
    ck_assert(c.dist.bucket_mb == 25.0);
    ck_assert_int_eq(c.dist.nhosts, 0);
    ck_assert_int_eq(c.grad_accum_steps, 1);
    if (!gpu_comm_available())
        return; /* world_size > 1 is refused without MPI (test_bad_values) */
    ck_assert_int_eq(parse("{\"batch_size\": 64, \"grad_accum_steps\": 4, \"distributed\": "
                           "{\"world_size\": 4, \"comm_hook\": \"bf16\", \"bucket_mb\": 2.5, "
                           "\"hosts\": [\"node-a:2\", \"node_b.lan\"]}}",
                           &c, &e),
                     0);
    ck_assert_int_eq(c.dist.world_size, 4);
    ck_assert_int_eq(c.dist.hook, GPU_HOOK_BF16);
    ck_assert(c.dist.bucket_mb == 2.5);
    ck_assert_int_eq(c.dist.nhosts, 2);
    ck_assert_str_eq(c.dist.hosts[0], "node-a:2");
    ck_assert_str_eq(c.dist.hosts[1], "node_b.lan");
    ck_assert_int_eq(c.grad_accum_steps, 4);
    json_t *canon = api_spec_to_json(&c), *d = json_object_get(canon, "distributed");
    ck_assert_int_eq(json_integer_value(json_object_get(d, "world_size")), 4);
    ck_assert_str_eq(json_string_value(json_object_get(d, "comm_hook")), "bf16");
    ck_assert(json_real_value(json_object_get(d, "bucket_mb")) == 2.5);
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(d, "hosts"), 1)),
                     "node_b.lan");
    ck_assert_int_eq(json_integer_value(json_object_get(canon, "grad_accum_steps")), 4);
    json_decref(canon);
}
END_TEST

/* The launcher: mpirun or Slurm, what srun asks for, and the fields that contradict. */
START_TEST(test_launcher)
{
    gpu_job_config c;
    api_error e;
    ck_assert_int_eq(parse("{}", &c, &e), 0);
    ck_assert_int_eq(c.dist.launcher, GPU_LAUNCH_DEFAULT);
    json_t *canon = api_spec_to_json(&c), *d = json_object_get(canon, "distributed");
    ck_assert_ptr_null(json_object_get(d, "launcher")); /* the daemon's to choose */
    ck_assert_ptr_null(json_object_get(d, "slurm"));
    json_decref(canon);
    if (!gpu_comm_available())
        return;
    ck_assert_int_eq(parse("{\"distributed\": {\"world_size\": 4, \"launcher\": \"slurm\", "
                           "\"slurm\": {\"nodes\": 2, \"tasks_per_node\": 2, \"cpus_per_task\": 8, "
                           "\"gpus_per_task\": 1, \"partition\": \"gpu\", \"account\": \"ml-team\", "
                           "\"time\": \"1-12:00:00\"}}}",
                           &c, &e),
                     0);
    ck_assert_int_eq(c.dist.launcher, GPU_LAUNCH_SLURM);
    ck_assert_int_eq(c.dist.slurm.nodes, 2);
    ck_assert_int_eq(c.dist.slurm.tasks_per_node, 2);
    ck_assert_int_eq(c.dist.slurm.cpus_per_task, 8);
    ck_assert_int_eq(c.dist.slurm.gpus_per_task, 1);
    ck_assert_str_eq(c.dist.slurm.partition, "gpu");
    ck_assert_str_eq(c.dist.slurm.account, "ml-team");
    ck_assert_str_eq(c.dist.slurm.time, "1-12:00:00");
    canon = api_spec_to_json(&c);
    d = json_object_get(canon, "distributed");
    ck_assert_str_eq(json_string_value(json_object_get(d, "launcher")), "slurm");
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(d, "slurm"), "account")),
                     "ml-team");
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(d, "slurm"), "nodes")), 2);
    json_decref(canon);
    /* contradictions name their field, and what contradicts it */
    static const struct {
        const char *spec, *field, *says;
    } bad[] = {
        {"{\"world_size\": 4, \"launcher\": \"slurm\", \"hosts\": [\"a\"]}", "distributed.hosts",
         "Slurm"},
        {"{\"world_size\": 4, \"launcher\": \"mpirun\", \"slurm\": {\"nodes\": 2}}",
         "distributed.slurm", "launcher"},
        {"{\"world_size\": 4, \"slurm\": {\"nodes\": 2, \"tasks_per_node\": 3}}",
         "distributed.slurm.tasks_per_node", "2 nodes x 3 tasks per node"},
        {"{\"world_size\": 2, \"slurm\": {\"nodes\": 3}}", "distributed.slurm.nodes",
         "more nodes than the 2 ranks"},
        {"{\"world_size\": 4, \"slurm\": {\"tasks_per_node\": 3}}",
         "distributed.slurm.tasks_per_node", "does not divide"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char spec[256];
        snprintf(spec, sizeof(spec), "{\"distributed\": %s}", bad[i].spec);
        ck_assert_int_eq(parse(spec, &c, &e), GPU_EINVAL);
        ck_assert_str_eq(e.field, bad[i].field);
        ck_assert_msg(strstr(e.message, bad[i].says), "%s: %s", spec, e.message);
    }
}
END_TEST

START_TEST(test_malformed_json)
{
    gpu_job_config c;
    api_error e;
    const char *bad[] = {"",
                         "{",
                         "[1,2]x",
                         "{\"steps\": 1,}",
                         "nul",
                         "{\"a\":1, \"a\":2}",
                         "{\"optimizer\": {\"lr\": 1e400}}"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        ck_assert_int_eq(parse(bad[i], &c, &e), GPU_EINVAL);
        ck_assert_msg(strcmp(e.code, "invalid_json") == 0, "%s -> %s", bad[i], e.code);
        ck_assert(strlen(e.message) > 0);
    }
    expect_field("[]", "");
    expect_field("42", "");
}
END_TEST

START_TEST(test_unknown_fields)
{
    expect_field("{\"stepz\": 10}", "stepz");
    expect_field("{\"model\": {\"layer\": [1, 2]}}", "model.layer");
    expect_field("{\"precision\": {\"loss_scale\": {\"init_scale\": 2}}}",
                 "precision.loss_scale.init_scale");
    expect_field("{\"optimizer\": {\"learning_rate\": 0.1}}", "optimizer.learning_rate");
    expect_field("{\"precision\": {\"autocast\": {\"overrides\": {\"conv9d\": \"fp32\"}}}}",
                 "precision.autocast.overrides.conv9d");
    expect_field("{\"distributed\": {\"ranks\": 2}}", "distributed.ranks");
    expect_field("{\"checkpoints\": {\"keep_last\": 3, \"keep\": 2}}", "checkpoints.keep");
    /* the retention keys sit in "checkpoints" only: no top-level form */
    expect_field("{\"checkpoint_keep_last\": 3}", "checkpoint_keep_last");
    expect_field("{\"checkpoint_keep_best\": 1}", "checkpoint_keep_best");
}
END_TEST

START_TEST(test_bad_values)
{
    expect_field("{\"optimizer\": {\"lr\": -0.1}}", "optimizer.lr");
    expect_field("{\"optimizer\": {\"lr\": 0}}", "optimizer.lr");
    expect_field("{\"optimizer\": {\"lr\": \"NaN\"}}", "optimizer.lr");
    expect_field("{\"optimizer\": {\"betas\": [0.9, 1.0]}}", "optimizer.betas");
    expect_field("{\"optimizer\": {\"betas\": [0.9]}}", "optimizer.betas");
    expect_field("{\"optimizer\": {\"eps\": -1}}", "optimizer.eps");
    expect_field("{\"optimizer\": {\"type\": \"lamb\"}}", "optimizer.type");
    expect_field("{\"optimizer\": {\"schedule\": 3}}", "optimizer.schedule");
    expect_field("{\"batch_size\": 0}", "batch_size");
    expect_field("{\"data\": {\"skip_batches\": -1}}", "data.skip_batches");
    expect_field("{\"data\": {\"skip_batches\": 1.5}}", "data.skip_batches");
    expect_field("{\"data\": {\"shuffle\": \"no\"}}", "data.shuffle");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", "
                 "\"train\": \"fortunes\", \"shuffle\": false}}",
                 "data.shuffle");
    expect_field("{\"checkpoints\": {\"keep_last\": -1}}", "checkpoints.keep_last");
    expect_field("{\"checkpoints\": {\"keep_last\": \"3\"}}", "checkpoints.keep_last");
    expect_field("{\"checkpoints\": {\"keep_last\": 1000001}}", "checkpoints.keep_last");
    expect_field("{\"checkpoints\": {\"keep_best\": 1001}}", "checkpoints.keep_best");
    expect_field("{\"checkpoints\": {\"keep_best\": -1}}", "checkpoints.keep_best");
    expect_field("{\"checkpoints\": 3}", "checkpoints");
    expect_field("{\"checkpoints\": null}", "checkpoints");
    expect_field("{\"checkpoints\": [3, 1]}", "checkpoints");
    expect_field("{\"batch_size\": -5}", "batch_size");
    expect_field("{\"batch_size\": 2.5}", "batch_size");
    expect_field("{\"batch_size\": 100000000}", "batch_size");
    expect_field("{\"steps\": \"10\"}", "steps");
    expect_field("{\"steps\": 0}", "steps");
    expect_field("{\"seed\": -1}", "seed");
    expect_field("{\"name\": 7}", "name");
    expect_field("{\"name\": \"\"}", "name");
    expect_field("{\"model\": {\"layers\": [784]}}", "model.layers");
    expect_field("{\"model\": {\"layers\": [784, 0, 10]}}", "model.layers[1]");
    expect_field("{\"model\": {\"layers\": [784, 1e9, 10]}}", "model.layers[1]");
    expect_field("{\"model\": {\"layers\": \"784-10\"}}", "model.layers");
    expect_field("{\"model\": {\"activation\": \"tanh\"}}", "model.activation");
    expect_field("{\"model\": []}", "model");
    expect_field("{\"precision\": {\"dtype\": \"fp4\"}}", "precision.dtype");
    expect_field("{\"precision\": {\"master_weights\": 1}}", "precision.master_weights");
    expect_field("{\"precision\": {\"loss_scale\": {\"mode\": \"auto\"}}}",
                 "precision.loss_scale.mode");
    expect_field(
        "{\"precision\": {\"dtype\": \"fp16\", \"loss_scale\": {\"backoff_factor\": 1.5}}}",
        "precision.loss_scale.backoff_factor");
    expect_field("{\"precision\": {\"dtype\": \"fp16\", \"loss_scale\": {\"growth_factor\": 0.5}}}",
                 "precision.loss_scale.growth_factor");
    expect_field("{\"precision\": {\"dtype\": \"fp16\", \"loss_scale\": {\"growth_interval\": 0}}}",
                 "precision.loss_scale.growth_interval");
    expect_field("{\"precision\": {\"autocast\": {\"overrides\": {\"softmax\": \"fp64\"}}}}",
                 "precision.autocast.overrides.softmax");
    expect_field("{\"device\": \"tpu\"}", "device");
    expect_field("{\"device\": \"cuda:x\"}", "device");
    expect_field("{\"device\": \"cuda:64\"}", "device");
    expect_field("{\"device\": \"cuda:-1\"}", "device");
    expect_field("{\"device\": \"cuda:+1\"}", "device");
    expect_field("{\"device\": \"cuda:\"}", "device");
    expect_field("{\"device\": \"cuda:1 \"}", "device");
    expect_field("{\"device\": \"cuda:0000000000001\"}", "device");
    expect_field("{\"device\": 0}", "device");
    expect_field("{\"distributed\": {\"world_size\": 0}}", "distributed.world_size");
    expect_field("{\"distributed\": {\"world_size\": 1025}}", "distributed.world_size");
    /* a batch that does not split over the ranks; without MPI, any second rank */
    expect_field("{\"distributed\": {\"world_size\": 3}}",
                 gpu_comm_available() ? "batch_size" : "distributed.world_size");
    expect_field("{\"batch_size\": 6, \"distributed\": {\"world_size\": 4}}",
                 gpu_comm_available() ? "batch_size" : "distributed.world_size");
    expect_field("{\"distributed\": {\"bucket_mb\": 0}}", "distributed.bucket_mb");
    expect_field("{\"distributed\": {\"hosts\": []}}", "distributed.hosts");
    expect_field("{\"distributed\": {\"hosts\": \"a,b\"}}", "distributed.hosts");
    expect_field("{\"distributed\": {\"hosts\": [\"a\", \"b c\"]}}", "distributed.hosts[1]");
    expect_field("{\"distributed\": {\"hosts\": [\"-np\"]}}", "distributed.hosts[0]");
    expect_field("{\"grad_accum_steps\": 0}", "grad_accum_steps");
    expect_field("{\"distributed\": {\"comm_hook\": \"fp8\"}}", "distributed.comm_hook");
    expect_field("{\"distributed\": {\"launcher\": \"ssh\"}}", "distributed.launcher");
    expect_field("{\"distributed\": {\"slurm\": []}}", "distributed.slurm");
    expect_field("{\"distributed\": {\"slurm\": {\"qos\": \"high\"}}}", "distributed.slurm.qos");
    expect_field("{\"distributed\": {\"slurm\": {\"partition\": \"a b\"}}}",
                 "distributed.slurm.partition");
    expect_field("{\"distributed\": {\"slurm\": {\"partition\": \"-p\"}}}",
                 "distributed.slurm.partition");
    expect_field("{\"distributed\": {\"slurm\": {\"time\": \"1h\"}}}", "distributed.slurm.time");
    expect_field("{\"distributed\": {\"slurm\": {\"gpus_per_task\": -1}}}",
                 "distributed.slurm.gpus_per_task");
    /* a gpt needs sequence data, its heads must divide d_model, its fields are its own */
    expect_field("{\"model\": {\"type\": \"gpt\"}}", "data.type");
    expect_field("{\"model\": {\"type\": \"gpt\", \"d_model\": 100, \"n_head\": 3}}",
                 "model.n_head");
    expect_field("{\"model\": {\"type\": \"gpt\", \"layers\": [2, 3]}}", "model.layers");
    expect_field("{\"model\": {\"type\": \"gpt\", \"vocab\": 1}}", "model.vocab");
    expect_field("{\"model\": {\"type\": \"mlp\", \"n_layer\": 2}}", "model.n_layer");
    expect_field("{\"model\": {\"type\": \"mlp\"}, \"data\": {\"type\": \"text\", "
                 "\"train\": \"fashion-mnist\"}}",
                 "data.type");
    expect_field("{\"data\": {\"type\": \"synthetic\", \"classes\": 1}}", "data.classes");
    expect_field("{\"data\": {\"type\": \"idx\", \"features\": 3}}", "data.features");
    /* a model that cannot fit is refused with what it needs */
    gpu_job_config c;
    api_error e;
    ck_assert_int_eq(parse("{\"model\": {\"layers\": [65536, 65536, 65536, 65536]}}", &c, &e),
                     GPU_EINVAL);
    ck_assert_str_eq(e.field, "model.layers");
    ck_assert_msg(strstr(e.message, "GiB") && strstr(e.message, "this machine has"), "%s",
                  e.message);
    ck_assert_int_eq(parse("{\"model\": {\"layers\": [784, 4096, 10]}, \"batch_size\": 65536,"
                           " \"data\": {\"type\": \"synthetic\"}}",
                           &c, &e),
                     0);
}
END_TEST

START_TEST(test_data_roots)
{
    gpu_job_config c;
    api_error e;
    char spec[700];
    /* a path inside the root is accepted, one outside is refused */
    snprintf(spec, sizeof(spec), "{\"data\": {\"train\": \"%s/fashion-mnist\"}}", root);
    ck_assert_int_eq(parse(spec, &c, &e), 0);
    expect_field("{\"data\": {\"train\": \"/etc\"}}", "data.train");
    expect_field("{\"data\": {\"train\": \"/usr/share/datasets/../../../etc\"}}", "data.train");
    snprintf(spec, sizeof(spec), "{\"data\": {\"train\": \"%s/fashion-mnist/../..\"}}", root);
    expect_field(spec, "data.train");
    expect_field("{\"data\": {\"train\": \"../fashion-mnist\"}}", "data.train");
    expect_field("{\"data\": {\"train\": \"mnist\"}}", "data.train");
    expect_field("{\"data\": {\"train\": \"fashion-mnist:valid\"}}", "data.train");
    expect_field("{\"data\": {\"train\": \"fashion-mnist\", \"eval\": \"nope\"}}", "data.eval");
    expect_field("{\"data\": {\"train\": 5}}", "data.train");
    /* a symlink inside the root that leads outside is refused */
    char link[400];
    snprintf(link, sizeof(link), "%s/escape", root);
    ck_assert_int_eq(symlink("/etc", link), 0);
    expect_field("{\"data\": {\"train\": \"escape\"}}", "data.train");
}
END_TEST

START_TEST(test_seq_data)
{
    gpu_job_config c;
    api_error e;
    char spec[700], want[PATH_MAX];
    json_t *canon, *d;

    /* a text directory by name: default val_fraction, no eval source */
    ck_assert_int_eq(parse("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"fortunes\"}}", &c, &e), 0);
    ck_assert_int_eq(c.data.type, GPU_DATA_TEXT);
    ck_assert_ptr_nonnull(realpath(root, want));
    strcat(want, "/fortunes");
    ck_assert_str_eq(c.data.seq_train, want);
    ck_assert_str_eq(c.data.seq_eval, "");
    ck_assert_float_eq(c.data.val_fraction, 0.1f);
    canon = api_spec_to_json(&c);
    d = json_object_get(canon, "data");
    ck_assert_str_eq(json_string_value(json_object_get(d, "type")), "text");
    ck_assert_str_eq(json_string_value(json_object_get(d, "train")), want);
    ck_assert(json_is_null(json_object_get(d, "eval")));
    ck_assert_float_eq_tol(json_number_value(json_object_get(d, "val_fraction")), 0.1, 1e-7);
    json_decref(canon);
    /* a text file by name, and by absolute path inside the root */
    ck_assert_int_eq(parse("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"shakespeare.txt\","
                           " \"val_fraction\": 0.25}}",
                           &c, &e),
                     0);
    ck_assert_ptr_nonnull(strstr(c.data.seq_train, "/shakespeare.txt"));
    ck_assert_float_eq(c.data.val_fraction, 0.25f);
    snprintf(spec, sizeof(spec),
             "{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"%s/fortunes/cookie\", \"eval\": "
             "\"shakespeare.txt\"}}",
             root);
    ck_assert_int_eq(parse(spec, &c, &e), 0);
    ck_assert_ptr_nonnull(strstr(c.data.seq_train, "/fortunes/cookie"));
    ck_assert_ptr_nonnull(strstr(c.data.seq_eval, "/shakespeare.txt"));
    /* token files, with an eval file */
    ck_assert_int_eq(parse("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"tokens\", \"train\": \"tiny_train.bin\","
                           " \"eval\": \"tiny_val.bin\"}}",
                           &c, &e),
                     0);
    ck_assert_int_eq(c.data.type, GPU_DATA_TOKENS);
    ck_assert_ptr_nonnull(strstr(c.data.seq_train, "/tiny_train.bin"));
    ck_assert_ptr_nonnull(strstr(c.data.seq_eval, "/tiny_val.bin"));
    canon = api_spec_to_json(&c);
    d = json_object_get(canon, "data");
    ck_assert_str_eq(json_string_value(json_object_get(d, "type")), "tokens");
    ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(d, "eval")), "tiny_val.bin"));
    ck_assert_ptr_null(json_object_get(d, "val_fraction"));
    json_decref(canon);
    ck_assert_int_eq(parse("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"tokens\", \"train\": \"tiny_train.bin\","
                           " \"eval\": null}}",
                           &c, &e),
                     0);
    ck_assert_str_eq(c.data.seq_eval, "");
    /* the attention: materialised by default, flash on request (canonical form both ways) */
    ck_assert_int_eq(c.model.attention, GPU_ATTN_MATERIALIZED);
    canon = api_spec_to_json(&c);
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(canon, "model"), "attention")),
                     "materialized");
    json_decref(canon);
    ck_assert_int_eq(parse("{\"model\": {\"type\": \"gpt\", \"d_model\": 128, \"n_head\": 4, \"attention\": \"flash\"},"
                           " \"data\": {\"type\": \"text\", \"train\": \"fortunes\"}}",
                           &c, &e),
                     0);
    ck_assert_int_eq(c.model.attention, GPU_ATTN_FLASH);
    canon = api_spec_to_json(&c);
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(canon, "model"), "attention")),
                     "flash");
    json_decref(canon);
    expect_field("{\"model\": {\"type\": \"gpt\", \"attention\": \"sdpa\"}, \"data\": {\"type\": \"text\", "
                 "\"train\": \"fortunes\"}}",
                 "model.attention");
    /* flash needs a head_dim of 16, 32, 48 or 64: 256 / 4 = 64 passes, 100 / 2 = 50 does not */
    expect_field("{\"model\": {\"type\": \"gpt\", \"d_model\": 100, \"n_head\": 2, \"attention\": \"flash\"},"
                 " \"data\": {\"type\": \"text\", \"train\": \"fortunes\"}}",
                 "model.attention");
    expect_field("{\"model\": {\"type\": \"mlp\", \"attention\": \"flash\"}}", "model.attention");

    /* errors name the field */
    expect_field("{\"data\": {\"type\": \"csv\"}}", "data.type");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\"}}", "data.train");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": 3}}", "data.train");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"\"}}", "data.train");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"nope.txt\"}}", "data.train");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"/etc/passwd\"}}", "data.train");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"../shakespeare.txt\"}}",
                 "data.train");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"fortunes/cookie\"}}", "data.train");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"tokens\", \"train\": \"fortunes\"}}", "data.train");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"tokens\", \"train\": \"tiny_train.bin\", \"eval\": "
                 "\"fortunes\"}}",
                 "data.eval");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"fortunes\", \"eval\": 5}}",
                 "data.eval");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"fortunes\", \"eval\": "
                 "\"missing\"}}",
                 "data.eval");
    /* 1e-50 and 0.99999999999 are in (0, 1) as doubles; their floats are 0 and 1 */
    const char *bad_fracs[] = {"0", "1", "1.5", "-0.1", "\"0.1\"", "null", "1e-50", "0.99999999999"};
    for (size_t i = 0; i < sizeof(bad_fracs) / sizeof(bad_fracs[0]); i++) {
        snprintf(spec, sizeof(spec),
                 "{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"fortunes\", \"val_fraction\": "
                 "%s}}",
                 bad_fracs[i]);
        expect_field(spec, "data.val_fraction");
    }
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"fortunes\", \"eval\": "
                 "\"shakespeare.txt\", \"val_fraction\": 0.2}}",
                 "data.val_fraction");
    expect_field("{\"data\": {\"type\": \"idx\", \"val_fraction\": 0.2}}", "data.val_fraction");
    expect_field("{\"data\": {\"type\": \"synthetic\", \"val_fraction\": 0.2}}",
                 "data.val_fraction");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"fortunes\", \"classes\": 3}}",
                 "data.classes");
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"tokens\", \"train\": \"tiny_train.bin\", \"split\": "
                 "1}}",
                 "data.split");
    /* a symlink inside the root that leads outside is refused */
    char link[400];
    snprintf(link, sizeof(link), "%s/passwd", root);
    ck_assert_int_eq(symlink("/etc/passwd", link), 0);
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\": \"passwd\"}}", "data.train");
}
END_TEST

/* The canonical text of a parsed spec, as `ampd run` prints it; caller frees. */
static char *canonical(const gpu_job_config *c)
{
    json_t *j = api_spec_to_json(c);
    char *text = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(9));
    json_decref(j);
    ck_assert_ptr_nonnull(text);
    return text;
}

/* The canonical spec round-trips: parsed back it is accepted and prints the same text. */
START_TEST(test_canonical_roundtrip)
{
    static const char *const specs[] = {
        "{}",
        "{\"data\": {\"train\": \"fashion-mnist\", \"eval\": null}, \"precision\": "
        "{\"dtype\": \"fp16\", \"loss_scale\": {\"init\": 1024, \"growth_factor\": 1.5}}}",
        "{\"model\": {\"layers\": [12, 7, 3], \"activation\": \"gelu\", \"init_scale\": 0.3},"
        " \"data\": {\"type\": \"synthetic\", \"train_size\": 100, \"eval_size\": 0,"
        " \"shuffle\": false, \"skip_batches\": 12},"
        " \"precision\": {\"dtype\": \"bf16\", \"master_weights\": false, \"autocast\":"
        " {\"overrides\": {\"softmax\": \"lowp\", \"add\": \"fp32\"}}},"
        " \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.0123, \"momentum\": 0.7,"
        " \"schedule\": \"linear\", \"min_lr_ratio\": 0.1, \"grad_clip\": 0.3}}",
        "{\"model\": {\"type\": \"gpt\", \"n_layer\": 2, \"d_model\": 64, \"n_head\": 4,"
        " \"attention\": \"flash\"}, \"data\": {\"type\": \"text\", \"train\": \"fortunes\","
        " \"val_fraction\": 0.3, \"skip_batches\": 3}, \"optimizer\": {\"betas\": [0.8, 0.95],"
        " \"eps\": 1e-6},"
        " \"seed\": 9007199254740993, \"grad_accum_steps\": 3, \"device\": \"cpu\"}",
        "{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"tokens\", \"train\":"
        " \"tiny_train.bin\", \"eval\": \"tiny_val.bin\"}, \"distributed\": {\"bucket_mb\": 0.1}}",
        "{\"distributed\": {\"launcher\": \"slurm\", \"slurm\": {\"partition\": \"debug\","
        " \"time\": \"30\"}}}",
        "{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"margin\": 2, \"amax_history_len\": 16,"
        " \"amax_compute_algo\": \"most_recent\", \"keep\": [\"fc1\", \"fc3\"]}}}",
        "{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"recipe\": \"current\", \"format\":"
        " \"e4m3\", \"amax_epsilon\": 1e-12, \"accumulator\": {\"mantissa_bits\": 13}}}}",
    };
    for (size_t i = 0; i < sizeof(specs) / sizeof(specs[0]); i++) {
        gpu_job_config c1, c2;
        api_error e;
        ck_assert_msg(parse(specs[i], &c1, &e) == 0, "%s: %s %s", specs[i], e.field, e.message);
        char *t1 = canonical(&c1);
        ck_assert_msg(parse(t1, &c2, &e) == 0, "the canonical spec %s is refused: %s %s", t1,
                      e.field, e.message);
        char *t2 = canonical(&c2);
        ck_assert_str_eq(t2, t1);
        ck_assert_mem_eq(&c2.autocast, &c1.autocast, sizeof(c1.autocast));
        ck_assert(c2.data.skip_batches == c1.data.skip_batches &&
                  c2.data.in_order == c1.data.in_order);
        if (i == 2) /* the data order, given when not the default */
            ck_assert(c1.data.skip_batches == 12 && c1.data.in_order &&
                      strstr(t1, "\"shuffle\":false") && strstr(t1, "\"skip_batches\":12"));
        free(t1);
        free(t2);
    }
}
END_TEST

/* precision.dtype "fp8": a bf16 job with fp8 GEMMs, TE's DelayedScaling defaults, its fields
 * checked and each refusal naming the field. */
START_TEST(test_fp8)
{
    gpu_job_config c;
    api_error e;
    ck_assert_int_eq(parse("{\"precision\": {\"dtype\": \"fp8\"}}", &c, &e), 0);
    ck_assert(c.fp8.on && c.dtype == GPU_BF16 && c.scaler.mode == GPU_SCALE_NONE);
    ck_assert(c.fp8.recipe == GPU_FP8_DELAYED && c.fp8.format == GPU_FP8_HYBRID &&
              c.fp8.margin == 0 && c.fp8.amax_history_len == 1024 &&
              c.fp8.amax_algo == GPU_FP8_AMAX_MAX && c.fp8.acc.bits == 0 &&
              c.fp8.acc.promote == 128 && c.fp8.nkeep == 0);
    ck_assert_str_eq(gpu_job_dtype_name(&c), "fp8");
    char *t = canonical(&c);
    ck_assert_msg(strstr(t, "\"dtype\":\"fp8\"") &&
                      strstr(t, "\"fp8\":{\"recipe\":\"delayed\",\"format\":\"hybrid\"") &&
                      strstr(t, "\"linear\":\"fp8\"") && strstr(t, "\"matmul\":\"lowp\""),
                  "%s", t);
    ck_assert_int_eq(parse(t, &c, &e), 0); /* the canonical spec reads back */
    ck_assert(c.fp8.on && c.autocast.policy[GPU_OP_LINEAR] == GPU_CAST_LOWP);
    free(t);
    /* the autocast table: fp8 is the linear layers' policy in an fp8 job, and only there */
    for (int i = 0; i < 2; i++) {
        char spec[160];
        snprintf(spec, sizeof(spec),
                 "{\"precision\": {\"dtype\": \"fp8\", \"autocast\": {\"overrides\": "
                 "{\"linear\": \"%s\"}}}}",
                 i ? "lowp" : "fp8"); /* lowp: a spec cloned from another dtype's job */
        ck_assert_int_eq(parse(spec, &c, &e), 0);
    }
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"autocast\": {\"overrides\": "
                 "{\"linear\": \"fp32\"}}}}",
                 "precision.autocast.overrides.linear");
    expect_field("{\"precision\": {\"dtype\": \"bf16\", \"autocast\": {\"overrides\": "
                 "{\"linear\": \"fp8\"}}}}",
                 "precision.autocast.overrides.linear");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"autocast\": {\"overrides\": "
                 "{\"softmax\": \"fp8\"}}}}",
                 "precision.autocast.overrides.softmax");
    ck_assert_int_eq(parse("{\"precision\": {\"dtype\": \"bf16\"}}", &c, &e), 0);
    t = canonical(&c);
    ck_assert_msg(strstr(t, "\"linear\":\"lowp\""), "%s", t);
    free(t);
    ck_assert_int_eq(parse("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"recipe\": "
                           "\"current\", \"keep\": [\"fc2\"]}}}",
                           &c, &e),
                     0);
    ck_assert(c.fp8.recipe == GPU_FP8_CURRENT && c.fp8.nkeep == 1 &&
              strcmp(c.fp8.keep[0], "fc2") == 0);
    ck_assert_int_eq(parse("{\"precision\": {\"dtype\": \"bf16\"}}", &c, &e), 0);
    ck_assert(!c.fp8.on);
    expect_field("{\"precision\": {\"dtype\": \"fp16\", \"fp8\": {}}}", "precision.fp8");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"recipe\": \"mx\"}}}",
                 "precision.fp8.recipe");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"format\": \"e5m2\"}}}",
                 "precision.fp8.format");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"margin\": -1}}}",
                 "precision.fp8.margin");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"amax_history_len\": 0}}}",
                 "precision.fp8.amax_history_len");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"recipe\": \"current\","
                 " \"margin\": 1}}}",
                 "precision.fp8.margin");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"amax_epsilon\": 1}}}",
                 "precision.fp8.amax_epsilon");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"accumulator\":"
                 " {\"mantissa_bits\": 24}}}}",
                 "precision.fp8.accumulator.mantissa_bits");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"accumulator\":"
                 " {\"promote_every\": 0}}}}",
                 "precision.fp8.accumulator.promote_every");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"keep\": [\"fc1\", \"fc1\"]}}}",
                 "precision.fp8.keep[1]");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"keep\": [\"fc4\"]}}}",
                 "precision.fp8.keep");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"keep\": \"fc1\"}}}",
                 "precision.fp8.keep");
    expect_field("{\"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"scale\": 1}}}",
                 "precision.fp8.scale");
    ck_assert_int_eq(parse("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", "
                           "\"train\": \"fortunes\"}, \"precision\": {\"dtype\": \"fp8\", \"fp8\": "
                           "{\"keep\": [\"blocks.0.attn.qkv\"]}}}",
                           &c, &e),
                     0);
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\":"
                 " \"fortunes\"}, \"precision\": {\"dtype\": \"fp8\", \"fp8\": {\"keep\": "
                 "[\"lm_head\"]}}}",
                 "precision.fp8.keep");
}
END_TEST

/* The effective spec a job is stored with: every value exact (a double that needs 17 digits
 * keeps them; nine print the rest as `ampd run` does), and it parses to the same config. */
START_TEST(test_effective_exact)
{
    gpu_job_config c1, c2;
    api_error e;
    ck_assert_int_eq(parse("{\"optimizer\": {\"lr\": 1.0000000001e-3, \"betas\": [0.9, 0.95]},"
                           " \"data\": {\"type\": \"text\", \"train\": \"fortunes\","
                           " \"val_fraction\": 0.1}, \"model\": {\"type\": \"gpt\"}}",
                           &c1, &e),
                     0);
    char *t = api_spec_effective(&c1);
    ck_assert_ptr_nonnull(t);
    ck_assert_msg(parse(t, &c2, &e) == 0, "%s refused: %s %s", t, e.field, e.message);
    ck_assert_msg(c2.optim.lr == c1.optim.lr, "lr %.17g read back as %.17g", c1.optim.lr,
                  c2.optim.lr);
    ck_assert_msg(strstr(t, "\"lr\":0.0010000000001"), "%s", t);
    free(t);
    ck_assert_int_eq(parse("{\"optimizer\": {\"lr\": 0.001}}", &c1, &e), 0);
    t = api_spec_effective(&c1);
    ck_assert_msg(strstr(t, "\"lr\":0.001,") && strstr(t, "\"betas\":[0.9,0.999]"), "%s", t);
    free(t);
}
END_TEST

/* What a job asks the daemon for: resources, priority, distributed.oversubscribe; defaults,
 * ranges naming the field, and the canonical form that reads back the same. */
START_TEST(test_resources)
{
    gpu_job_config c, d;
    api_error e;
    ck_assert_int_eq(parse("{}", &c, &e), 0);
    ck_assert_int_eq(c.res.cpus, 0);
    ck_assert_int_eq(c.res.devices, -1); /* derived from the device */
    ck_assert_int_eq(c.res.memory_mb, 0);
    ck_assert_int_eq(c.priority, 0);
    ck_assert(!c.dist.oversubscribe);
    json_t *canon = api_spec_to_json(&c), *r = json_object_get(canon, "resources");
    ck_assert_ptr_null(json_object_get(r, "devices")); /* not said: not written */
    json_decref(canon);
    ck_assert_int_eq(parse("{\"priority\": -7, \"resources\": {\"cpus\": 3, \"devices\": 0, "
                           "\"memory_mb\": 2048}, \"distributed\": {\"oversubscribe\": true}}",
                           &c, &e),
                     0);
    ck_assert_int_eq(c.priority, -7);
    ck_assert_int_eq(c.res.cpus, 3);
    ck_assert_int_eq(c.res.devices, 0);
    ck_assert_int_eq(c.res.memory_mb, 2048);
    ck_assert(c.dist.oversubscribe);
    char *t = api_spec_effective(&c);
    ck_assert_msg(parse(t, &d, &e) == 0, "%s refused: %s", t, e.message);
    ck_assert_int_eq(d.priority, -7);
    ck_assert_int_eq(d.res.cpus, 3);
    ck_assert_int_eq(d.res.devices, 0);
    ck_assert_int_eq(d.res.memory_mb, 2048);
    ck_assert(d.dist.oversubscribe);
    free(t);
    const char *bad[][2] = {{"{\"priority\": 1001}", "priority"},
                            {"{\"priority\": 1.5}", "priority"},
                            {"{\"resources\": {\"cpus\": -1}}", "resources.cpus"},
                            {"{\"resources\": {\"devices\": 65}}", "resources.devices"},
                            {"{\"resources\": {\"gpus\": 1}}", "resources.gpus"},
                            {"{\"resources\": []}", "resources"},
                            {"{\"distributed\": {\"oversubscribe\": 1}}",
                             "distributed.oversubscribe"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        ck_assert_msg(parse(bad[i][0], &c, &e) != 0, "%s accepted", bad[i][0]);
        ck_assert_msg(strcmp(e.field, bad[i][1]) == 0, "%s: field %s, not %s", bad[i][0],
                      e.field, bad[i][1]);
    }
}
END_TEST

/* The canonical spec's resolved fields as input: precision.autocast.table is the whole
 * table (every op; not with overrides), data.train_images and the others the files of a
 * split (in pairs, not with the split's name, inside the data roots, idx data only). */
START_TEST(test_canonical_fields)
{
    gpu_job_config c, d;
    api_error e;
    char spec[4096], table[600] = "", tr_i[512], tr_l[512], ev_i[512], ev_l[512];

    /* a whole table equal to the defaults but one op is that op's override */
    ck_assert_int_eq(parse("{\"precision\": {\"autocast\": {\"overrides\": {\"sum\": "
                           "\"input\"}}}}",
                           &c, &e),
                     0);
    for (int i = 0; i < GPU_OP_COUNT; i++)
        snprintf(table + strlen(table), sizeof(table) - strlen(table), "%s\"%s\": \"%s\"",
                 i ? ", " : "", gpu_op_name((gpu_op)i),
                 gpu_cast_policy_name(c.autocast.policy[i]));
    snprintf(spec, sizeof(spec), "{\"precision\": {\"autocast\": {\"table\": {%s}}}}", table);
    ck_assert_msg(parse(spec, &d, &e) == 0, "%s: %s", e.field, e.message);
    ck_assert_mem_eq(&d.autocast, &c.autocast, sizeof(c.autocast));
    ck_assert_int_eq(d.autocast.policy[GPU_OP_SUM], GPU_CAST_INPUT);
    snprintf(spec, sizeof(spec),
             "{\"precision\": {\"autocast\": {\"table\": {%s}, \"overrides\": {}}}}", table);
    expect_field(spec, "precision.autocast.table");
    ck_assert_int_eq(parse("{\"precision\": {\"autocast\": {\"table\": {\"linear\": "
                           "\"fp32\"}}}}",
                           &d, &e),
                     GPU_EINVAL);
    ck_assert_str_eq(e.field, "precision.autocast.table");
    ck_assert_msg(strstr(e.message, "\"matmul\" is missing"), "%s", e.message);
    expect_field("{\"precision\": {\"autocast\": {\"table\": {\"conv\": \"fp32\"}}}}",
                 "precision.autocast.table.conv");
    expect_field("{\"precision\": {\"autocast\": {\"table\": {\"linear\": \"fp64\"}}}}",
                 "precision.autocast.table.linear");
    expect_field("{\"precision\": {\"autocast\": {\"table\": [\"linear\"]}}}",
                 "precision.autocast.table");

    /* the resolved IDX files of a parsed spec, given back as files */
    ck_assert_int_eq(parse("{}", &c, &e), 0);
    snprintf(tr_i, sizeof(tr_i), "%s", c.data.train_images);
    snprintf(tr_l, sizeof(tr_l), "%s", c.data.train_labels);
    snprintf(ev_i, sizeof(ev_i), "%s", c.data.eval_images);
    snprintf(ev_l, sizeof(ev_l), "%s", c.data.eval_labels);
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"train_images\": \"%s\", \"train_labels\": \"%s\", "
             "\"eval_images\": \"%s\", \"eval_labels\": \"%s\"}}",
             tr_i, tr_l, ev_i, ev_l);
    ck_assert_msg(parse(spec, &d, &e) == 0, "%s: %s", e.field, e.message);
    ck_assert_str_eq(d.data.train_images, tr_i);
    ck_assert_str_eq(d.data.eval_labels, ev_l);
    /* without eval files (nor data.eval) there is no eval set: the canonical form of one */
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"type\": \"idx\", \"train_images\": \"%s\", \"train_labels\": "
             "\"%s\"}}",
             tr_i, tr_l);
    ck_assert_int_eq(parse(spec, &d, &e), 0);
    ck_assert_str_eq(d.data.eval_images, "");
    /* nor with them null, as the canonical form of a job without one prints them */
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"train_images\": \"%s\", \"train_labels\": \"%s\", "
             "\"eval_images\": null, \"eval_labels\": null}}",
             tr_i, tr_l);
    ck_assert_msg(parse(spec, &d, &e) == 0, "%s: %s", e.field, e.message);
    ck_assert_str_eq(d.data.eval_labels, "");
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"eval_images\": null, \"eval_labels\": \"%s\"}}", ev_l);
    expect_field(spec, "data.eval_images");
    expect_field("{\"data\": {\"train_images\": null, \"train_labels\": null}}",
                 "data.train_images");
    /* a name for training, files for the eval set */
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"train\": \"fashion-mnist\", \"eval_images\": \"%s\", "
             "\"eval_labels\": \"%s\"}}",
             tr_i, tr_l);
    ck_assert_int_eq(parse(spec, &d, &e), 0);
    ck_assert_str_eq(d.data.eval_images, tr_i);
    /* one of a pair, with the split's name, outside the roots, not IDX data */
    snprintf(spec, sizeof(spec), "{\"data\": {\"train_images\": \"%s\"}}", tr_i);
    expect_field(spec, "data.train_labels");
    snprintf(spec, sizeof(spec), "{\"data\": {\"eval_labels\": \"%s\"}}", ev_l);
    expect_field(spec, "data.eval_images");
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"train\": \"fashion-mnist\", \"train_images\": \"%s\", "
             "\"train_labels\": \"%s\"}}",
             tr_i, tr_l);
    expect_field(spec, "data.train_images");
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"eval\": null, \"eval_images\": \"%s\", \"eval_labels\": \"%s\"}}",
             ev_i, ev_l);
    expect_field(spec, "data.eval_images");
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"train_images\": \"/etc/passwd\", \"train_labels\": \"%s\"}}", tr_l);
    expect_field(spec, "data.train_images");
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"train_images\": \"%s\", \"train_labels\": \"%s/fashion-mnist\"}}",
             tr_i, root);
    expect_field(spec, "data.train_labels");
    snprintf(spec, sizeof(spec),
             "{\"data\": {\"train_images\": 5, \"train_labels\": \"%s\"}}", tr_l);
    expect_field(spec, "data.train_images");
    expect_field("{\"data\": {\"type\": \"synthetic\", \"eval_images\": \"x\"}}",
                 "data.eval_images");
    /* synthetic classes taken from the model's last width are range-checked as given ones
     * (fuzz_spec: [12, 6, 1] was accepted with 1 class, and its canonical spec refused) */
    expect_field("{\"model\": {\"layers\": [12, 6, 1]}, \"data\": {\"type\": \"synthetic\"}}",
                 "data.classes");
    expect_field("{\"model\": {\"layers\": [12, 300]}, \"data\": {\"type\": \"synthetic\"}}",
                 "data.classes");
    ck_assert_int_eq(parse("{\"model\": {\"layers\": [12, 300]}, \"data\": {\"type\": "
                           "\"synthetic\", \"classes\": 4}}",
                           &d, &e),
                     0);
    expect_field("{\"model\": {\"type\": \"gpt\"}, \"data\": {\"type\": \"text\", \"train\":"
                 " \"fortunes\", \"train_labels\": \"x\"}}",
                 "data.train_labels");
}
END_TEST

static Suite *spec_suite(void)
{
    Suite *s = suite_create("spec");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_full_example);
    tcase_add_test(tc, test_defaults);
    tcase_add_test(tc, test_devices);
    tcase_add_test(tc, test_distributed);
    tcase_add_test(tc, test_launcher);
    tcase_add_test(tc, test_malformed_json);
    tcase_add_test(tc, test_unknown_fields);
    tcase_add_test(tc, test_bad_values);
    tcase_add_test(tc, test_data_roots);
    tcase_add_test(tc, test_seq_data);
    tcase_add_test(tc, test_canonical_roundtrip);
    tcase_add_test(tc, test_fp8);
    tcase_add_test(tc, test_effective_exact);
    tcase_add_test(tc, test_canonical_fields);
    tcase_add_test(tc, test_resources);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(spec_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
