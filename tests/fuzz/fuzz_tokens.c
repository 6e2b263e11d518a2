/*
 * fuzz_tokens.c - libFuzzer harness of the llm.c token-shard loader (gpu/data.c,
 * gpu_dataset_load_tokens): the input is a training shard and an eval shard (fuzz.h's
 * split; an empty eval shard means none, and the validation tokens are split off the
 * training ones). Sets the loader accepts must keep their invariants (tokens, a vocabulary
 * above every token) and serve what a GPT step and an eval read: a batch of windows drawn
 * for a step, and the first and last eval windows.
 *
 * Seeds: tests/fuzz/corpus/tokens/ (small shards, with and without an eval shard).
 */
#include "gpu/gpu.h"
#include "tests/fuzz/fuzz.h"

#define B 3
#define T 5

/* Every token of x[0..n) below vocab. */
static void check_tokens(const int *x, int n, int vocab)
{
    for (int i = 0; i < n; i++)
        if (x[i] < 0 || x[i] >= vocab)
            fuzz_fail("token %d of a vocabulary of %d", x[i], vocab);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *tr, *ev;
    size_t ntr, nev;
    char ptr[64], pev[64] = "", err[512] = "";
    gpu_dataset *train = NULL, *val = NULL;
    int ft, fe = -1, x[B * T], y[B * T];

    fuzz_split(data, size, &tr, &ntr, &ev, &nev);
    ft = fuzz_file(tr, ntr, ptr, sizeof(ptr));
    if (nev > 0)
        fe = fuzz_file(ev, nev, pev, sizeof(pev));
    if (ft < 0 || (nev > 0 && fe < 0))
        fuzz_fail("cannot make the input files");
    if (gpu_dataset_load_tokens(ptr, nev > 0 ? pev : NULL, 0.25f, &train, &val, err,
                                sizeof(err)) == 0) {
        int vocab = gpu_dataset_vocab(train);
        if (gpu_dataset_ntokens(train) <= 0 || gpu_dataset_ntokens(val) <= 0 || vocab <= 0 ||
            vocab > 65536 || gpu_dataset_vocab(val) != vocab)
            fuzz_fail("%lld training and %lld eval tokens, vocabulary %d",
                      (long long)gpu_dataset_ntokens(train), (long long)gpu_dataset_ntokens(val),
                      vocab);
        memset(x, 0, sizeof(x));
        memset(y, 0, sizeof(y));
        gpu_dataset_sample_seq(train, 7, 3, B, T, x, y);
        check_tokens(x, B * T, vocab);
        check_tokens(y, B * T, vocab);
        int64_t nw = gpu_dataset_nwindows(val, T);
        if (nw > 0) {
            gpu_dataset_window(val, 0, T, x, y);
            gpu_dataset_window(val, nw - 1, T, x + T, y + T);
            check_tokens(x, 2 * T, vocab);
            check_tokens(y, 2 * T, vocab);
        }
        gpu_dataset_free(train);
        gpu_dataset_free(val);
    } else if (!err[0]) {
        fuzz_fail("a refused shard without a message");
    }
    close(ft);
    if (fe >= 0)
        close(fe);
    return 0;
}
