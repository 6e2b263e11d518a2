/*
 * check_data.c - the sequence datasets of data.c: text files and directories read as bytes,
 * llm.c token shards, the train/validation split, seeded batch sampling and evaluation
 * windows; IDX image/label pairs and headers that claim more than their files hold.
 *
 * Every input is written by the test into a temporary directory (no installed package is
 * needed): text with every byte value, directories with the entries a text directory must
 * skip (*.dat indexes, symlinks, hidden files, subdirectories), valid token shards whose
 * token i is i (so a window's tokens give away its position) and broken ones (bad magic,
 * bad version, truncated header and data, extra bytes, non-positive counts).
 *
 * Threads: Check forks one child per test; each test has its own temporary directory.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpu/gpu.h"

static char dir[64];

static void setup(void)
{
    snprintf(dir, sizeof(dir), "/tmp/ampd-data-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    ck_assert_int_eq(system(cmd), 0);
}

/* dir/name into out. */
static const char *in_dir(char *out, size_t len, const char *name)
{
    snprintf(out, len, "%s/%s", dir, name);
    return out;
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(p, 1, n, f), n);
    ck_assert_int_eq(fclose(f), 0);
}

/* An llm.c shard: header (magic, version, count), then ntok little-endian uint16 tokens
 * and extra trailing bytes. */
static void write_shard(const char *path, int32_t magic, int32_t version, int32_t count,
                        const uint16_t *tok, size_t ntok, size_t extra)
{
    size_t n = 1024 + 2 * ntok + extra;
    uint8_t *b = calloc(1, n);
    int32_t h[3] = {magic, version, count};
    ck_assert_ptr_nonnull(b);
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < 4; k++)
            b[4 * i + k] = (uint8_t)((uint32_t)h[i] >> (8 * k));
    for (size_t i = 0; i < ntok; i++) {
        b[1024 + 2 * i] = (uint8_t)(tok[i] & 0xFF);
        b[1024 + 2 * i + 1] = (uint8_t)(tok[i] >> 8);
    }
    write_bytes(path, b, n);
    free(b);
}

/* Every token of a sequence set through one window spanning all of it: the set must hold
 * exactly want[0..n) (only its size is checked when n < 2). */
static void expect_tokens(const gpu_dataset *d, const int *want, int64_t n)
{
    ck_assert_int_eq(gpu_dataset_ntokens(d), n);
    if (n < 2) /* no window holds a single token */
        return;
    int T = (int)n - 1;
    int *x = malloc(sizeof(int) * (size_t)T), *y = malloc(sizeof(int) * (size_t)T);
    ck_assert(x && y);
    ck_assert_int_eq(gpu_dataset_nwindows(d, T), 1);
    gpu_dataset_window(d, 0, T, x, y);
    for (int t = 0; t < T; t++) {
        ck_assert_msg(x[t] == want[t], "token %d: %d, want %d", t, x[t], want[t]);
        ck_assert_int_eq(y[t], want[t + 1]);
    }
    free(x);
    free(y);
}

START_TEST(test_text_file_split)
{
    enum { N = 1001 };
    uint8_t src[N];
    int want[N];
    char path[128], err[256];
    gpu_dataset *tr, *va;
    for (int i = 0; i < N; i++) /* every byte value, 0 and >= 128 included */
        want[i] = src[i] = (uint8_t)((i * 7 + 3) % 256);
    write_bytes(in_dir(path, sizeof(path), "t.txt"), src, N);

    const float fracs[] = {0.1f, 0.25f, 0.5f, 0.999f};
    for (size_t k = 0; k < sizeof(fracs) / sizeof(fracs[0]); k++) {
        ck_assert_int_eq(gpu_dataset_load_text(path, NULL, fracs[k], &tr, &va, err, sizeof(err)),
                         0);
        int64_t nv = (int64_t)(fracs[k] * (double)N + 0.5);
        ck_assert_int_eq(gpu_dataset_ntokens(tr) + gpu_dataset_ntokens(va), N);
        ck_assert_int_eq(gpu_dataset_ntokens(va), nv);
        expect_tokens(tr, want, N - nv);        /* train: the head, */
        expect_tokens(va, want + (N - nv), nv); /* val: the tail */
        ck_assert_int_eq(gpu_dataset_vocab(tr), 256);
        ck_assert_int_eq(gpu_dataset_vocab(va), 256);
        ck_assert_int_eq(gpu_dataset_count(tr), 0);
        gpu_dataset_free(tr);
        gpu_dataset_free(va);
    }
    /* "" as eval path means no eval source, like NULL */
    ck_assert_int_eq(gpu_dataset_load_text(path, "", 0.1f, &tr, &va, err, sizeof(err)), 0);
    ck_assert_int_eq(gpu_dataset_ntokens(va), 100);
    gpu_dataset_free(tr);
    gpu_dataset_free(va);
}
END_TEST

START_TEST(test_text_directory)
{
    char p[160], d[128], err[256];
    const char *a = "alpha\n", *b = "beta\n";
    gpu_dataset *tr, *va;
    in_dir(d, sizeof(d), "corpus");
    ck_assert_int_eq(mkdir(d, 0755), 0);
    /* created out of order; read in name order: "a" then "b.txt" */
    snprintf(p, sizeof(p), "%s/b.txt", d);
    write_bytes(p, b, strlen(b));
    snprintf(p, sizeof(p), "%s/a", d);
    write_bytes(p, a, strlen(a));
    snprintf(p, sizeof(p), "%s/a.dat", d); /* a strfile index: skipped */
    write_bytes(p, "\0\0\0\2XXXX", 8);
    snprintf(p, sizeof(p), "%s/a.u8", d); /* a symlink (as in fortunes): skipped */
    ck_assert_int_eq(symlink("a", p), 0);
    snprintf(p, sizeof(p), "%s/.hidden", d);
    write_bytes(p, "HIDDEN", 6);
    snprintf(p, sizeof(p), "%s/sub", d); /* a subdirectory: skipped, not descended */
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof(p), "%s/sub/c", d);
    write_bytes(p, "SUB", 3);

    /* with an eval source nothing is split off: train holds the whole concatenation */
    const char *cat = "alpha\nbeta\n";
    int want[32];
    int n = (int)strlen(cat);
    for (int i = 0; i < n; i++)
        want[i] = (unsigned char)cat[i];
    ck_assert_int_eq(gpu_dataset_load_text(d, d, 0.1f, &tr, &va, err, sizeof(err)), 0);
    expect_tokens(tr, want, n);
    expect_tokens(va, want, n);
    gpu_dataset_free(tr);
    gpu_dataset_free(va);
    /* and split: val is the last round(0.1 * 11) = 1 byte */
    ck_assert_int_eq(gpu_dataset_load_text(d, NULL, 0.1f, &tr, &va, err, sizeof(err)), 0);
    expect_tokens(tr, want, n - 1);
    ck_assert_int_eq(gpu_dataset_ntokens(va), 1);
    gpu_dataset_free(tr);
    gpu_dataset_free(va);

    /* a directory with nothing to read is refused, naming it */
    in_dir(d, sizeof(d), "nothing");
    ck_assert_int_eq(mkdir(d, 0755), 0);
    snprintf(p, sizeof(p), "%s/x.dat", d);
    write_bytes(p, "idx", 3);
    snprintf(p, sizeof(p), "%s/x.u8", d);
    ck_assert_int_eq(symlink("x.dat", p), 0);
    ck_assert_int_eq(gpu_dataset_load_text(d, NULL, 0.1f, &tr, &va, err, sizeof(err)), GPU_EFORMAT);
    ck_assert_ptr_null(tr);
    ck_assert_ptr_null(va);
    ck_assert_msg(strstr(err, d) && strstr(err, "no text"), "%s", err);
}
END_TEST

START_TEST(test_text_errors)
{
    char p[128], q[128], err[256];
    gpu_dataset *tr, *va;
    in_dir(p, sizeof(p), "missing.txt");
    ck_assert_int_eq(gpu_dataset_load_text(p, NULL, 0.1f, &tr, &va, err, sizeof(err)), GPU_EIO);
    ck_assert_msg(strstr(err, p) != NULL, "%s", err);
    write_bytes(in_dir(p, sizeof(p), "ok.txt"), "hello world", 11);
    /* a missing eval source is named */
    in_dir(q, sizeof(q), "nope.txt");
    ck_assert_int_eq(gpu_dataset_load_text(p, q, 0.1f, &tr, &va, err, sizeof(err)), GPU_EIO);
    ck_assert_msg(strstr(err, q) != NULL, "%s", err);
    /* val_fraction must be in (0, 1) when it is used */
    ck_assert_int_eq(gpu_dataset_load_text(p, NULL, 0.0f, &tr, &va, err, sizeof(err)), GPU_EINVAL);
    ck_assert_int_eq(gpu_dataset_load_text(p, NULL, 1.0f, &tr, &va, err, sizeof(err)), GPU_EINVAL);
    ck_assert_int_eq(gpu_dataset_load_text(p, p, 0.0f, &tr, &va, err, sizeof(err)), 0);
    gpu_dataset_free(tr);
    gpu_dataset_free(va);
    /* too short to split: round(0.01 * 11) = 0 tokens of validation */
    ck_assert_int_eq(gpu_dataset_load_text(p, NULL, 0.01f, &tr, &va, err, sizeof(err)),
                     GPU_EFORMAT);
    ck_assert_msg(strstr(err, p) && strstr(err, "too few"), "%s", err);
    /* an empty file */
    write_bytes(in_dir(p, sizeof(p), "empty.txt"), "", 0);
    ck_assert_int_eq(gpu_dataset_load_text(p, NULL, 0.1f, &tr, &va, err, sizeof(err)), GPU_EFORMAT);
    ck_assert_msg(strstr(err, p) != NULL, "%s", err);
}
END_TEST

/* Write dir/count.bin, a shard whose token i is i (n <= 65536), and load it with eval as
 * the eval source (which may be that same file). */
static void counting_set(int n, const char *eval, float vf, gpu_dataset **tr, gpu_dataset **va)
{
    char p[128], err[256];
    uint16_t *t = malloc(sizeof(uint16_t) * (size_t)n);
    ck_assert_ptr_nonnull(t);
    for (int i = 0; i < n; i++)
        t[i] = (uint16_t)i;
    write_shard(in_dir(p, sizeof(p), "count.bin"), 20240520, 1, n, t, (size_t)n, 0);
    free(t);
    ck_assert_int_eq(gpu_dataset_load_tokens(p, eval, vf, tr, va, err, sizeof(err)), 0);
}

START_TEST(test_sample_seq)
{
    enum { N = 20000, B = 16, T = 32, DRAWS = 200 };
    static int x[B * T], y[B * T], x2[B * T], y2[B * T];
    gpu_dataset *tr, *va;
    counting_set(N, NULL, 0.1f, &tr, &va);
    const int64_t n = gpu_dataset_ntokens(tr);
    ck_assert_int_eq(n, 18000);
    ck_assert_int_eq(gpu_dataset_vocab(tr), N); /* tokens 0..19999, val included */

    /* every row is a true window inside the set: x = T consecutive tokens, y = x + 1 */
    int64_t lo = n, hi = -1;
    double sum = 0;
    for (int s = 0; s < DRAWS; s++) {
        gpu_dataset_sample_seq(tr, 7, s, B, T, x, y);
        for (int b = 0; b < B; b++) {
            int64_t pos = x[b * T];
            ck_assert(pos >= 0 && pos + T <= n - 1);
            for (int t = 0; t < T; t++) {
                ck_assert_int_eq(x[b * T + t], pos + t);
                ck_assert_int_eq(y[b * T + t], pos + t + 1);
            }
            lo = pos < lo ? pos : lo;
            hi = pos > hi ? pos : hi;
            sum += (double)pos;
        }
    }
    /* 3200 draws spread over the whole range: both ends reached, mean near the middle
     * (its standard error is ~90 tokens here) */
    ck_assert_msg(lo < n / 100 && hi > n - T - 1 - n / 100, "positions %lld..%lld", (long long)lo,
                  (long long)hi);
    double mean = sum / (DRAWS * B), mid = (double)(n - T - 1) / 2;
    ck_assert_msg(mean > mid - 600 && mean < mid + 600, "mean position %g, middle %g", mean, mid);

    /* a batch depends on (seed, step) only: the same pair again, after other draws */
    gpu_dataset_sample_seq(tr, 7, 3, B, T, x, y);
    gpu_dataset_sample_seq(tr, 7, 99, B, T, x2, y2);
    gpu_dataset_sample_seq(tr, 7, 3, B, T, x2, y2);
    ck_assert_mem_eq(x, x2, sizeof(x));
    ck_assert_mem_eq(y, y2, sizeof(y));
    /* ... and the rows of a batch come from different places */
    int same = 0;
    for (int b = 1; b < B; b++)
        same += x[b * T] == x[0];
    ck_assert_int_lt(same, 2);
    /* another step or another seed gives another batch */
    gpu_dataset_sample_seq(tr, 7, 4, B, T, x2, y2);
    ck_assert(memcmp(x, x2, sizeof(x)) != 0);
    gpu_dataset_sample_seq(tr, 8, 3, B, T, x2, y2);
    ck_assert(memcmp(x, x2, sizeof(x)) != 0);
    /* a batch of B rows is the first B rows of a larger batch at the same (seed, step) */
    gpu_dataset_sample_seq(tr, 7, 3, 4, T, x2, y2);
    ck_assert_mem_eq(x, x2, sizeof(int) * 4 * T);

    gpu_dataset_free(tr);
    gpu_dataset_free(va);

    /* exactly T+1 tokens: one possible window; fewer: nothing is written */
    char p[128];
    counting_set(40, in_dir(p, sizeof(p), "count.bin"), 0.1f, &tr, &va); /* 40 tokens each */
    gpu_dataset_sample_seq(tr, 5, 0, 2, 39, x, y);
    for (int t = 0; t < 39; t++)
        ck_assert(x[t] == t && x[39 + t] == t && y[t] == t + 1);
    /* T 36: starts 0..3 only, and every one of them drawn */
    int hits[5] = {0};
    for (int s = 0; s < 50; s++) {
        gpu_dataset_sample_seq(tr, 5, s, 4, 36, x, y);
        for (int b = 0; b < 4; b++) {
            ck_assert(x[b * 36] >= 0 && x[b * 36] <= 3);
            hits[x[b * 36]]++;
        }
    }
    ck_assert(hits[0] && hits[1] && hits[2] && hits[3]);
    for (int i = 0; i < B * T; i++)
        x2[i] = y2[i] = -7;
    gpu_dataset_sample_seq(tr, 5, 0, 2, 40, x2, y2);
    gpu_dataset_sample_seq(tr, 5, 0, 0, 8, x2, y2);
    for (int i = 0; i < B * T; i++)
        ck_assert(x2[i] == -7 && y2[i] == -7);
    gpu_dataset_free(tr);
    gpu_dataset_free(va);
}
END_TEST

START_TEST(test_windows)
{
    enum { N = 1000 };
    int x[64], y[64], seen[N];
    gpu_dataset *tr, *va;
    char p[128];
    counting_set(N, in_dir(p, sizeof(p), "count.bin"), 0.1f, &tr, &va); /* N tokens each */

    const int Ts[] = {1, 7, 63, 999};
    for (size_t k = 0; k < sizeof(Ts) / sizeof(Ts[0]); k++) {
        int T = Ts[k];
        int64_t nw = gpu_dataset_nwindows(va, T);
        ck_assert_int_eq(nw, N / (T + 1));
        memset(seen, 0, sizeof(seen));
        int *xs = T <= 64 ? x : malloc(sizeof(int) * (size_t)T);
        int *ys = T <= 64 ? y : malloc(sizeof(int) * (size_t)T);
        ck_assert(xs && ys);
        for (int64_t i = 0; i < nw; i++) {
            gpu_dataset_window(va, i, T, xs, ys);
            for (int t = 0; t < T; t++) {
                ck_assert_int_eq(ys[t], xs[t] + 1);
                seen[xs[t]]++;
            }
            seen[ys[T - 1]]++;
        }
        /* windows tile [0, nw(T+1)) exactly: every token once, nothing after */
        for (int i = 0; i < N; i++)
            ck_assert_msg(seen[i] == (i < nw * (T + 1)), "T %d: token %d seen %d times", T, i,
                          seen[i]);
        /* out of range: nothing written */
        xs[0] = -3;
        gpu_dataset_window(va, nw, T, xs, ys);
        gpu_dataset_window(va, -1, T, xs, ys);
        ck_assert_int_eq(xs[0], -3);
        if (xs != x) {
            free(xs);
            free(ys);
        }
    }
    ck_assert_int_eq(gpu_dataset_nwindows(va, N), 0);
    ck_assert_int_eq(gpu_dataset_nwindows(va, 0), 0);
    gpu_dataset_free(tr);
    gpu_dataset_free(va);
}
END_TEST

START_TEST(test_tokens_valid)
{
    char a[128], b[128], err[256];
    uint16_t ta[300], tb[50];
    gpu_dataset *tr, *va;
    for (int i = 0; i < 300; i++)
        ta[i] = (uint16_t)((i * 37) % 1235); /* max 1234 */
    for (int i = 0; i < 50; i++)
        tb[i] = (uint16_t)(i == 20 ? 50256 : i);
    write_shard(in_dir(a, sizeof(a), "train.bin"), 20240520, 1, 300, ta, 300, 0);
    write_shard(in_dir(b, sizeof(b), "val.bin"), 20240520, 1, 50, tb, 50, 0);

    int want[300];
    for (int i = 0; i < 300; i++)
        want[i] = ta[i];
    ck_assert_int_eq(gpu_dataset_load_tokens(a, NULL, 0.2f, &tr, &va, err, sizeof(err)), 0);
    expect_tokens(tr, want, 240);
    expect_tokens(va, want + 240, 60);
    ck_assert_int_eq(gpu_dataset_vocab(tr), 1235);
    ck_assert_int_eq(gpu_dataset_vocab(va), 1235);
    gpu_dataset_free(tr);
    gpu_dataset_free(va);

    /* with an eval shard: vocab covers both (GPT-2's <|endoftext|> 50256 is in val) */
    ck_assert_int_eq(gpu_dataset_load_tokens(a, b, 0.2f, &tr, &va, err, sizeof(err)), 0);
    expect_tokens(tr, want, 300);
    for (int i = 0; i < 50; i++)
        want[i] = tb[i];
    expect_tokens(va, want, 50);
    ck_assert_int_eq(gpu_dataset_vocab(tr), 50257);
    ck_assert_int_eq(gpu_dataset_vocab(va), 50257);
    gpu_dataset_free(tr);
    gpu_dataset_free(va);
}
END_TEST

/* Loading path must fail with rc and a message naming the file and containing what. */
static void expect_bad(const char *path, const char *eval, int rc, const char *what)
{
    char err[256] = "";
    gpu_dataset *tr = (gpu_dataset *)&err, *va = (gpu_dataset *)&err;
    ck_assert_int_eq(gpu_dataset_load_tokens(path, eval, 0.1f, &tr, &va, err, sizeof(err)), rc);
    ck_assert_ptr_null(tr);
    ck_assert_ptr_null(va);
    const char *named = eval ? eval : path;
    ck_assert_msg(strstr(err, named) && strstr(err, what), "%s: \"%s\" lacks \"%s\"", named, err,
                  what);
}

START_TEST(test_tokens_bad)
{
    char p[128], ok[128];
    uint16_t t[100];
    for (int i = 0; i < 100; i++)
        t[i] = (uint16_t)i;
    write_shard(in_dir(ok, sizeof(ok), "ok.bin"), 20240520, 1, 100, t, 100, 0);

    write_shard(in_dir(p, sizeof(p), "magic.bin"), 20240527, 1, 100, t, 100, 0);
    expect_bad(p, NULL, GPU_EFORMAT, "magic");
    write_shard(in_dir(p, sizeof(p), "version.bin"), 20240520, 2, 100, t, 100, 0);
    expect_bad(p, NULL, GPU_EFORMAT, "version");
    /* fewer tokens than the header says */
    write_shard(in_dir(p, sizeof(p), "short.bin"), 20240520, 1, 100, t, 99, 0);
    expect_bad(p, NULL, GPU_EFORMAT, "truncated");
    write_shard(in_dir(p, sizeof(p), "odd.bin"), 20240520, 1, 100, t, 99, 1);
    expect_bad(p, NULL, GPU_EFORMAT, "truncated");
    /* a header cut short, and an empty file */
    write_bytes(in_dir(p, sizeof(p), "head.bin"), "\x28\xd7\x34\x01\x01\0\0\0", 8);
    expect_bad(p, NULL, GPU_EFORMAT, "truncated");
    write_bytes(in_dir(p, sizeof(p), "empty.bin"), "", 0);
    expect_bad(p, NULL, GPU_EFORMAT, "truncated");
    /* more bytes than the header says */
    write_shard(in_dir(p, sizeof(p), "long.bin"), 20240520, 1, 100, t, 100, 2);
    expect_bad(p, NULL, GPU_EFORMAT, "size mismatch");
    write_shard(in_dir(p, sizeof(p), "count.bin"), 20240520, 1, 50, t, 100, 0);
    expect_bad(p, NULL, GPU_EFORMAT, "size mismatch");
    /* no tokens, or a negative count */
    write_shard(in_dir(p, sizeof(p), "zero.bin"), 20240520, 1, 0, t, 0, 0);
    expect_bad(p, NULL, GPU_EFORMAT, "0 tokens");
    write_shard(in_dir(p, sizeof(p), "neg.bin"), 20240520, 1, -4, t, 0, 0);
    expect_bad(p, NULL, GPU_EFORMAT, "-4 tokens");
    /* a directory, a missing file, and a bad eval shard next to a good train shard */
    expect_bad(dir, NULL, GPU_EFORMAT, "not a regular file");
    in_dir(p, sizeof(p), "missing.bin");
    expect_bad(p, NULL, GPU_EIO, "No such file");
    write_shard(in_dir(p, sizeof(p), "magic.bin"), 1, 1, 100, t, 100, 0);
    expect_bad(ok, p, GPU_EFORMAT, "magic");
    /* a text file is not a shard */
    write_bytes(in_dir(p, sizeof(p), "text.txt"), "hello, world\n", 13);
    expect_bad(p, NULL, GPU_EFORMAT, "truncated");
}
END_TEST

START_TEST(test_classification_set_has_no_tokens)
{
    gpu_dataset *d;
    int x[4] = {-1, -1, -1, -1}, y[4] = {-1, -1, -1, -1};
    ck_assert_int_eq(gpu_dataset_synthetic(16, 4, 3, 1, 2, &d), 0);
    ck_assert_int_eq(gpu_dataset_ntokens(d), 0);
    ck_assert_int_eq(gpu_dataset_vocab(d), 0);
    ck_assert_int_eq(gpu_dataset_nwindows(d, 1), 0);
    gpu_dataset_sample_seq(d, 1, 0, 2, 2, x, y);
    for (int i = 0; i < 4; i++)
        ck_assert(x[i] == -1 && y[i] == -1);
    gpu_dataset_free(d);
    gpu_dataset_free(NULL);
}
END_TEST

/* ---- IDX files ------------------------------------------------------------------------- */

/* An IDX uint8 file: the header (ndims big-endian dimensions), then n bytes of data. */
static void write_idx(const char *path, int ndims, const uint32_t *dims, const uint8_t *data,
                      size_t n)
{
    uint8_t *b = calloc(1, 4 + 4 * (size_t)ndims + n + 1);
    ck_assert_ptr_nonnull(b);
    b[2] = 0x08;
    b[3] = (uint8_t)ndims;
    for (int i = 0; i < ndims; i++)
        for (int k = 0; k < 4; k++)
            b[4 + 4 * i + k] = (uint8_t)(dims[i] >> (24 - 8 * k));
    if (n)
        memcpy(b + 4 + 4 * ndims, data, n);
    write_bytes(path, b, 4 + 4 * (size_t)ndims + n);
    free(b);
}

/* Loading the pair must fail with code, the message holding what. The address space is
 * limited to 4 GiB meanwhile (not under AddressSanitizer, which reserves terabytes), so a
 * loader that allocates what a header claims before the data is there fails with
 * GPU_ENOMEM instead. */
static void expect_idx_bad(const char *images, const char *labels, int code, const char *what)
{
    gpu_dataset *d = NULL;
    char err[512] = "";
    int rc;
#ifndef __SANITIZE_ADDRESS__
    struct rlimit old, lim;
    ck_assert_int_eq(getrlimit(RLIMIT_AS, &old), 0);
    lim = old;
    lim.rlim_cur = (rlim_t)4 << 30;
    ck_assert_int_eq(setrlimit(RLIMIT_AS, &lim), 0);
#endif
    rc = gpu_dataset_load_idx(images, labels, &d, err, sizeof(err));
#ifndef __SANITIZE_ADDRESS__
    ck_assert_int_eq(setrlimit(RLIMIT_AS, &old), 0);
#endif
    ck_assert_msg(rc == code, "%s: code %d, expected %d (%s)", images, rc, code, err);
    ck_assert_ptr_null(d);
    ck_assert_msg(strstr(err, what), "\"%s\" is not in \"%s\"", what, err);
}

/* A tiny pair loads; headers that claim more than their file holds, or more than the
 * loader takes, are refused from the header without allocating what they claim (the IDX
 * fuzzer's finding: a 41-byte input made the loader malloc 3 GB). */
START_TEST(test_idx_headers)
{
    char img[256], lab[256];
    const uint8_t pixels[12] = {0, 64, 128, 255, 1, 2, 3, 4, 250, 251, 252, 253};
    const uint8_t labels[3] = {0, 2, 1};
    gpu_dataset *d = NULL;
    char err[512] = "";
    float x[8];
    int y[2], rows[2] = {0, 2};

    in_dir(img, sizeof(img), "images");
    in_dir(lab, sizeof(lab), "labels");
    write_idx(img, 3, (const uint32_t[]){3, 2, 2}, pixels, sizeof(pixels));
    write_idx(lab, 1, (const uint32_t[]){3}, labels, sizeof(labels));
    ck_assert_msg(gpu_dataset_load_idx(img, lab, &d, err, sizeof(err)) == 0, "%s", err);
    ck_assert_int_eq(gpu_dataset_count(d), 3);
    ck_assert_int_eq(gpu_dataset_features(d), 4);
    ck_assert_int_eq(gpu_dataset_classes(d), 3);
    gpu_dataset_gather(d, rows, 2, x, y);
    ck_assert(y[0] == 0 && y[1] == 1);
    gpu_dataset_free(d);

    /* 16e9 pixels claimed (under the 2^34 limit), 12 there */
    write_idx(img, 3, (const uint32_t[]){16000, 1000, 1000}, pixels, sizeof(pixels));
    expect_idx_bad(img, lab, GPU_EFORMAT, "truncated data (expected 16000000000 bytes)");
    /* 2^23 x 2^23 x 2^18 = 2^64 wraps to 0 in 64 bits: refused, not a set of 0 features */
    write_idx(img, 3, (const uint32_t[]){1u << 23, 1u << 23, 1u << 18}, NULL, 0);
    uint8_t *many = calloc(1, (size_t)1 << 23);
    ck_assert_ptr_nonnull(many);
    write_idx(lab, 1, (const uint32_t[]){1u << 23}, many, (size_t)1 << 23);
    free(many);
    expect_idx_bad(img, lab, GPU_EFORMAT, "more than 17179869184 elements");
    /* rows x cols beyond an int of features */
    write_idx(img, 3, (const uint32_t[]){1, 65536, 65537}, pixels, sizeof(pixels));
    expect_idx_bad(img, lab, GPU_EFORMAT, "images of 65536 x 65537 pixels are too large");
}
END_TEST

static Suite *data_suite(void)
{
    Suite *s = suite_create("data");
    TCase *tc = tcase_create("text");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_text_file_split);
    tcase_add_test(tc, test_text_directory);
    tcase_add_test(tc, test_text_errors);
    suite_add_tcase(s, tc);

    tc = tcase_create("tokens");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_tokens_valid);
    tcase_add_test(tc, test_tokens_bad);
    tcase_add_test(tc, test_classification_set_has_no_tokens);
    suite_add_tcase(s, tc);

    tc = tcase_create("idx");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_idx_headers);
    suite_add_tcase(s, tc);

    tc = tcase_create("sampling");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_sample_seq);
    tcase_add_test(tc, test_windows);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(data_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
