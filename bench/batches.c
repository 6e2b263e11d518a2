/*
 * batches.c - the training batches and validation windows of a GPT job, as ampd draws them,
 * for checking a port of the data order (bench/convergence.sh compares them with
 * bench/torch_convergence.py's before any run).
 *
 * Loads the data with the engine's own loader (gpu_dataset_load_text, or _tokens: the
 * split of gpu/data.c, the first (1 - val_fraction) of the tokens for training) and draws
 * each asked-for step's batch with gpu_dataset_sample_seq(seed, step), step counted from 1
 * as gpu/train.c does (one draw per step: grad_accum_steps 1, one rank). Validation
 * follows gpu/train.c's eval_gpt: use = min(nwin, 32 x batch) of the nwin non-overlapping
 * windows, window j of them at index j * nwin / use (integer division), use x seq_len
 * positions in all (the "count" of ampd's eval line).
 *
 * Output, one line each (text; the tokens' hash is FNV-1a 64 fed one token value at a time,
 * x[0..T) then y[0..T), printed as 16 hex digits):
 *   # batches: <what was loaded>
 *   train_tokens <n>
 *   val_tokens <n>
 *   eval <nwin> <use> <count> <hash of every used window's x and y, in order>
 *   batch <step> <row> <hash of the row's x and y>     (rows 0..batch-1 of each step)
 *
 * Invariants: reads the data once; what it prints depends on the arguments and the data
 * alone. Threads: one.
 *
 * Usage: batches [--type text|tokens] [--val-fraction F] PATH SEQ_LEN BATCH SEED STEP...
 *        STEP is a step number (>= 1) or a range FIRST-LAST; defaults: text, 0.1.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull

/* FNV-1a over n token values, continuing from h. */
static uint64_t fnv_tokens(uint64_t h, const int *tok, int n)
{
    for (int i = 0; i < n; i++) {
        h ^= (uint64_t)(uint32_t)tok[i];
        h *= FNV_PRIME;
    }
    return h;
}

/* A whole non-negative decimal number into *v; 0 when it is one. */
static int parse_i64(const char *s, int64_t *v)
{
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || x < 0)
        return -1;
    *v = x;
    return 0;
}

/* "N" or "FIRST-LAST" into [*first, *last], every step >= 1; 0 when it is one. */
static int parse_steps(const char *s, int64_t *first, int64_t *last)
{
    char buf[64];
    const char *dash = strchr(s, '-');
    if (strlen(s) >= sizeof buf)
        return -1;
    if (!dash) {
        if (parse_i64(s, first) != 0 || *first < 1)
            return -1;
        *last = *first;
        return 0;
    }
    memcpy(buf, s, (size_t)(dash - s));
    buf[dash - s] = '\0';
    if (parse_i64(buf, first) != 0 || parse_i64(dash + 1, last) != 0)
        return -1;
    return *first >= 1 && *last >= *first ? 0 : -1;
}

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--type text|tokens] [--val-fraction F] PATH SEQ_LEN BATCH SEED STEP...\n"
            "  STEP: a step (>= 1) or a range FIRST-LAST\n",
            argv0);
}

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"type", required_argument, NULL, 't'},
        {"val-fraction", required_argument, NULL, 'f'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *type = "text";
    float val_fraction = 0.1f; /* the job spec's field is a float too */
    int opt;
    while ((opt = getopt_long(argc, argv, "t:f:h", longopts, NULL)) != -1) {
        if (opt == 't') {
            type = optarg;
        } else if (opt == 'f') {
            char *end;
            val_fraction = strtof(optarg, &end);
            if (end == optarg || *end != '\0') {
                usage(argv[0]);
                return EXIT_FAILURE;
            }
        } else {
            usage(argv[0]);
            return opt == 'h' ? EXIT_SUCCESS : EXIT_FAILURE;
        }
    }
    int64_t T, B, seed;
    if (argc - optind < 5 || (strcmp(type, "text") != 0 && strcmp(type, "tokens") != 0) ||
        parse_i64(argv[optind + 1], &T) != 0 || T < 1 || T > 65536 ||
        parse_i64(argv[optind + 2], &B) != 0 || B < 1 || B > 65536 ||
        parse_i64(argv[optind + 3], &seed) != 0) {
        usage(argv[0]);
        return EXIT_FAILURE;
    }
    for (int i = optind + 4; i < argc; i++) {
        int64_t a, b;
        if (parse_steps(argv[i], &a, &b) != 0) {
            fprintf(stderr, "batches: %s: not a step (>= 1) or a range FIRST-LAST\n", argv[i]);
            return EXIT_FAILURE;
        }
    }

    const char *path = argv[optind];
    gpu_dataset *train = NULL, *val = NULL;
    char err[512] = "";
    int rc = strcmp(type, "text") == 0
                 ? gpu_dataset_load_text(path, NULL, val_fraction, &train, &val, err, sizeof err)
                 : gpu_dataset_load_tokens(path, NULL, val_fraction, &train, &val, err,
                                           sizeof err);
    if (rc != 0) {
        fprintf(stderr, "batches: %s\n", err[0] ? err : gpu_strerror(rc));
        return EXIT_FAILURE;
    }
    if (gpu_dataset_ntokens(train) < T + 1) {
        fprintf(stderr, "batches: %s: %" PRId64 " training tokens, fewer than SEQ_LEN + 1\n",
                path, gpu_dataset_ntokens(train));
        gpu_dataset_free(train);
        gpu_dataset_free(val);
        return EXIT_FAILURE;
    }
    int *x = malloc(sizeof(int) * (size_t)(B * T)), *y = malloc(sizeof(int) * (size_t)(B * T));
    if (!x || !y) {
        fprintf(stderr, "batches: out of memory\n");
        free(x);
        free(y);
        gpu_dataset_free(train);
        gpu_dataset_free(val);
        return EXIT_FAILURE;
    }

    printf("# batches: %s (%s), val_fraction %.9g, seq_len %" PRId64 ", batch %" PRId64
           ", seed %" PRId64 "\n",
           path, type, (double)val_fraction, T, B, seed);
    printf("train_tokens %" PRId64 "\n", gpu_dataset_ntokens(train));
    printf("val_tokens %" PRId64 "\n", gpu_dataset_ntokens(val));

    int64_t nwin = gpu_dataset_nwindows(val, (int)T);
    int64_t use = nwin < 32 * B ? nwin : 32 * B;
    uint64_t h = FNV_OFFSET;
    for (int64_t j = 0; j < use; j++) {
        gpu_dataset_window(val, j * nwin / use, (int)T, x, y);
        h = fnv_tokens(fnv_tokens(h, x, (int)T), y, (int)T);
    }
    printf("eval %" PRId64 " %" PRId64 " %" PRId64 " %016" PRIx64 "\n", nwin, use, use * T, h);

    for (int i = optind + 4; i < argc; i++) {
        int64_t first, last;
        parse_steps(argv[i], &first, &last);
        for (int64_t k = first; k <= last; k++) {
            gpu_dataset_sample_seq(train, (uint64_t)seed, k, (int)B, (int)T, x, y);
            for (int64_t b = 0; b < B; b++) {
                uint64_t r = fnv_tokens(FNV_OFFSET, x + b * T, (int)T);
                r = fnv_tokens(r, y + b * T, (int)T);
                printf("batch %" PRId64 " %" PRId64 " %016" PRIx64 "\n", k, b, r);
            }
        }
    }
    free(x);
    free(y);
    gpu_dataset_free(train);
    gpu_dataset_free(val);
    return fflush(stdout) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
