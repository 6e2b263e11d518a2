/*
 * fuzz_spec.c - libFuzzer harness of the job-spec parser (api/spec.c): the input is the
 * body of a POST /v1/jobs (or the file of `ampd run`), parsed with a data root of its own
 * that holds an IDX dataset ("fashion-mnist"), a text file, a text directory and a token
 * shard, so that every data type resolves.
 *
 * Properties beyond "no crash, no sanitizer report": a spec the parser accepts has a
 * canonical form (api_spec_to_json) that the parser accepts back and that prints the same,
 * byte for byte (the round trip `ampd run` promises).
 *
 * Seeds: tests/fuzz/corpus/spec/ (the example jobs of every data type and model).
 */
#include <jansson.h>

#include "api/api.h"
#include "tests/fuzz/fuzz.h"

static api_spec_opts opts;

/* The data root: the names the seeds use. 0 or -1. */
static int setup(void)
{
    static const char *const idx[] = {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                                      "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};
    const char *dir = fuzz_dir();
    char sub[600];
    if (!dir)
        return -1;
    snprintf(sub, sizeof(sub), "%s/fashion-mnist", dir);
    if (mkdir(sub, 0700) != 0)
        return -1;
    for (int i = 0; i < 4; i++)
        if (fuzz_write(sub, idx[i], "", 0) != 0)
            return -1;
    snprintf(sub, sizeof(sub), "%s/texts", dir);
    if (mkdir(sub, 0700) != 0 || fuzz_write(sub, "a.txt", "abc", 3) != 0 ||
        fuzz_write(dir, "text.txt", "hello", 5) != 0 || fuzz_write(dir, "tok.bin", "", 0) != 0)
        return -1;
    opts.nroots = 1;
    snprintf(opts.roots[0], sizeof(opts.roots[0]), "%s", dir);
    return 0;
}

/* The canonical text of c, as `ampd run` prints it; caller frees. */
static char *canonical(const gpu_job_config *c)
{
    json_t *j = api_spec_to_json(c);
    char *text = j ? json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(9)) : NULL;
    json_decref(j);
    if (!text)
        fuzz_fail("api_spec_to_json gave no text");
    return text;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    gpu_job_config c, back;
    api_error e;
    char *t1, *t2;

    if (!ready) {
        if (setup() != 0)
            fuzz_fail("cannot make the data root");
        ready = 1;
    }
    if (api_spec_parse((const char *)data, size, &opts, &c, &e) != 0) {
        if (!e.code[0] || !e.message[0])
            fuzz_fail("a refused spec without an error code or message");
        return 0;
    }
    t1 = canonical(&c);
    if (api_spec_parse(t1, strlen(t1), &opts, &back, &e) != 0)
        fuzz_fail("the canonical spec %s is refused: %s: %s", t1, e.field, e.message);
    t2 = canonical(&back);
    if (strcmp(t1, t2) != 0)
        fuzz_fail("the canonical spec changes when parsed back:\n%s\n%s", t1, t2);
    free(t1);
    free(t2);
    return 0;
}
