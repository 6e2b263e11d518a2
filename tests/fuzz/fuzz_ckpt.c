/*
 * fuzz_ckpt.c - libFuzzer harness of the checkpoint reader (daemon/ckpt.c): the input is a
 * checkpoint file offered to `ampd run --resume`. Its header is read
 * (daemon_ckpt_read_info), then the file is resumed from (daemon_ckpt_resume: the checks
 * of the header, the checksum, every tensor against the job's, then the load) into a fresh
 * trainer of one small job (an fp16 MLP 4-3-2 on synthetic data, AdamW, dynamic loss
 * scaling, so that weights, optimizer state, data order and scaler state are all in it). A
 * checkpoint the reader resumes from must leave a trainer that trains on: one more step
 * runs (unless the job is done), which reads everything the checkpoint set (the data order
 * indexes the training set).
 *
 * Seeds: tests/fuzz/corpus/ckpt/ (checkpoints of this job written by `ampd run
 * --checkpoint-dir` at steps 3 and 6: with a checksum, and in the first format, without).
 */
#include "api/api.h"
#include "daemon/ckpt.h"
#include "tests/fuzz/fuzz.h"

/* The job of the seeds; keep it in step with them (tests/fuzz/README). */
static const char job[] =
    "{\"name\": \"fuzz-ckpt\", \"model\": {\"layers\": [4, 3, 2]}, \"data\": {\"type\": "
    "\"synthetic\", \"train_size\": 8, \"eval_size\": 0}, \"precision\": {\"dtype\": \"fp16\"}, "
    "\"batch_size\": 4, \"steps\": 6, \"threads\": 1, \"device\": \"cpu\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static gpu_job_config cfg;
    static int ready;
    gpu_trainer *t = NULL;
    gpu_state_scalars sc;
    gpu_step_metrics m;
    daemon_ckpt_info info;
    daemon_ckpt_resumed r;
    api_error e;
    char path[64], err[512];
    int fd, rc;

    if (!ready) {
        if (api_spec_parse(job, strlen(job), NULL, &cfg, &e) != 0)
            fuzz_fail("the harness's job is refused: %s: %s", e.field, e.message);
        ready = 1;
    }
    if (gpu_trainer_create(&cfg, &t, err, sizeof(err)) != 0)
        fuzz_fail("cannot make the trainer: %s", err);
    fd = fuzz_file(data, size, path, sizeof(path));
    if (fd < 0)
        fuzz_fail("cannot make the input file");
    err[0] = '\0';
    if (daemon_ckpt_read_info(path, &info, err, sizeof(err)) != 0 && !err[0])
        fuzz_fail("a refused header without a message");
    err[0] = '\0';
    memset(&r, 0, sizeof(r));
    rc = daemon_ckpt_resume(t, path, &r, err, sizeof(err));
    if (rc == 0 && r.path[0]) { /* a file not named ckpt-<N>.safetensors: that one alone */
        gpu_trainer_get_scalars(t, &sc);
        if (sc.step != r.step || sc.step > cfg.steps)
            fuzz_fail("resumed at step %lld, the trainer is at %lld", (long long)r.step,
                      (long long)sc.step);
        if (sc.step < cfg.steps)
            gpu_trainer_step(t, &m, err, sizeof(err));
    } else if (rc == 0 && (r.nskipped != 1 || !r.skipped[0].reason[0])) {
        fuzz_fail("nothing resumed, and the file not skipped with its reason");
    } else if (rc != 0 && !err[0]) {
        fuzz_fail("a refused checkpoint without a message");
    }
    daemon_ckpt_resumed_clear(&r);
    close(fd);
    gpu_trainer_free(t);
    return 0;
}
