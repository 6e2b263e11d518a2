/*
 * data.c - datasets: IDX image/label files (MNIST, Fashion-MNIST; gzip or raw), a
 * synthetic classification set, and sequence sets for language models: text (the bytes of
 * a file, or of a directory's files, as tokens 0..255) and llm.c token shards.
 *
 * Image data is kept as uint8 (47 MB for Fashion-MNIST's training set) and normalised to
 * zero mean and unit variance while a batch is gathered; the mean and standard deviation
 * come from the training set. Synthetic data is kept as floats. A sequence set is one
 * token array, uint8 for text and uint16 for token shards; its count, features and classes
 * are 0, and gpu_dataset_gather() must not be called on it.
 *
 * Text directories: every entry in byte-wise name order (strcmp) that is a regular file
 * (lstat: symlinks, subdirectories and devices are skipped), whose name does not start
 * with '.' and does not end in ".dat" (the strfile index files of Debian's fortunes, whose
 * "*.u8" entries are symlinks and skipped too), concatenated with nothing in between.
 *
 * Sequence batches are drawn by a counter-based hash of (seed, step, row), so a batch
 * depends on nothing but those: a job resumed at step k draws the batches it would have.
 *
 * Invariants: count > 0, features > 0, every label < classes (classification sets);
 * ntokens > 0 and every token < vocab (sequence sets). Threads: a dataset is immutable
 * after loading and may be read from several threads.
 */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "gpu/gpu_int.h"

#define IDX_MAX_ITEMS 10000000
#define IDX_MAX_BYTES ((size_t)1 << 34)
#define IDX_FIRST_READ ((size_t)1 << 20)

struct gpu_dataset {
    int count, features, classes;
    uint8_t *pixels; /* count x features, image data; NULL for synthetic */
    float *values;   /* count x features, synthetic data; NULL for images */
    uint8_t *labels; /* count */
    float mean, inv_std;
    /* sequence sets: exactly one of tok8 (text) and tok16 (token shards) is set */
    int64_t ntokens;
    uint8_t *tok8;
    uint16_t *tok16;
    int vocab; /* largest token of the whole source + 1 (256 for text) */
};

void gpu_dataset_free(gpu_dataset *d)
{
    if (!d)
        return;
    free(d->pixels);
    free(d->values);
    free(d->labels);
    free(d->tok8);
    free(d->tok16);
    free(d);
}

int gpu_dataset_count(const gpu_dataset *d)
{
    return d->count;
}
int gpu_dataset_features(const gpu_dataset *d)
{
    return d->features;
}
int gpu_dataset_classes(const gpu_dataset *d)
{
    return d->classes;
}

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Read exactly n bytes; 0 on success. */
static int gz_read_all(gzFile f, void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n > 0) {
        unsigned chunk = n > (1u << 30) ? (1u << 30) : (unsigned)n;
        int got = gzread(f, p, chunk);
        if (got <= 0)
            return -1;
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

/* Read an IDX file of uint8 with `ndims` dimensions; *data is malloc'ed (caller frees).
 * The buffer grows as the data arrives (IDX_FIRST_READ bytes, then doubling up to what the
 * header says), so a header that claims more than the file holds costs no more memory
 * than the file's data. */
static int idx_read(const char *path, int ndims, uint32_t dims[3], uint8_t **data, char *err,
                    size_t errlen)
{
    uint8_t hdr[16], *p;
    size_t total = 1, got = 0, cap = 0;
    int rc = GPU_EFORMAT;
    gzFile f = gzopen(path, "rb");

    *data = NULL;
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno ? errno : ENOENT));
        return GPU_EIO;
    }
    if (gz_read_all(f, hdr, 4 + 4 * (size_t)ndims) != 0) {
        snprintf(err, errlen, "%s: truncated IDX header", path);
        goto fail;
    }
    if (hdr[0] != 0 || hdr[1] != 0 || hdr[2] != 0x08 || hdr[3] != ndims) {
        snprintf(err, errlen, "%s: not an IDX uint8 file with %d dimensions", path, ndims);
        goto fail;
    }
    for (int i = 0; i < ndims; i++) {
        dims[i] = be32(hdr + 4 + 4 * i);
        if (dims[i] == 0 || dims[i] > IDX_MAX_ITEMS) {
            snprintf(err, errlen, "%s: dimension %d is %u", path, i, dims[i]);
            goto fail;
        }
        if (total > IDX_MAX_BYTES / dims[i]) { /* before the product can wrap */
            snprintf(err, errlen, "%s: more than %zu elements", path, IDX_MAX_BYTES);
            goto fail;
        }
        total *= dims[i];
    }
    if (ndims == 3 && (uint64_t)dims[1] * dims[2] > INT_MAX) {
        snprintf(err, errlen, "%s: images of %u x %u pixels are too large", path, dims[1],
                 dims[2]);
        goto fail;
    }
    while (got < total) {
        size_t want = total - got;
        if (got + want > cap) {
            size_t ncap = cap ? 2 * cap : IDX_FIRST_READ;
            ncap = ncap < total ? ncap : total;
            if (!(p = realloc(*data, ncap))) {
                rc = GPU_ENOMEM;
                snprintf(err, errlen, "%s: cannot allocate %zu bytes", path, ncap);
                goto fail;
            }
            *data = p;
            cap = ncap;
            want = cap - got;
        }
        if (gz_read_all(f, *data + got, want) != 0) {
            snprintf(err, errlen, "%s: truncated data (expected %zu bytes)", path, total);
            goto fail;
        }
        got += want;
    }
    gzclose(f);
    return 0;
fail:
    free(*data);
    *data = NULL;
    gzclose(f);
    return rc;
}

static void measure_norm(gpu_dataset *d)
{
    size_t n = (size_t)d->count * (size_t)d->features;
    double s = 0, ss = 0;
    for (size_t i = 0; i < n; i++) {
        double v = d->pixels[i] / 255.0;
        s += v;
        ss += v * v;
    }
    double mean = s / (double)n;
    double var = ss / (double)n - mean * mean;
    d->mean = (float)mean;
    d->inv_std = (float)(1.0 / sqrt(var > 1e-12 ? var : 1.0));
}

/* Load an IDX image/label pair; see gpu.h. */
int gpu_dataset_load_idx(const char *images, const char *labels, gpu_dataset **out, char *err,
                         size_t errlen)
{
    uint32_t idims[3], ldims[3];
    gpu_dataset *d = calloc(1, sizeof(*d));
    int rc;

    *out = NULL;
    if (!d)
        return GPU_ENOMEM;
    rc = idx_read(images, 3, idims, &d->pixels, err, errlen);
    if (rc)
        goto fail;
    rc = idx_read(labels, 1, ldims, &d->labels, err, errlen);
    if (rc)
        goto fail;
    rc = GPU_EFORMAT;
    if (ldims[0] != idims[0]) {
        snprintf(err, errlen, "%s has %u labels but %s has %u images", labels, ldims[0], images,
                 idims[0]);
        goto fail;
    }
    d->count = (int)idims[0];
    d->features = (int)((uint64_t)idims[1] * idims[2]); /* below INT_MAX (idx_read) */
    d->classes = 0;
    for (int i = 0; i < d->count; i++)
        if (d->labels[i] + 1 > d->classes)
            d->classes = d->labels[i] + 1;
    measure_norm(d);
    *out = d;
    return 0;
fail:
    gpu_dataset_free(d);
    return rc;
}

/* Build a synthetic set; see gpu.h. */
int gpu_dataset_synthetic(int n, int features, int classes, uint64_t teacher_seed,
                          uint64_t sample_seed, gpu_dataset **out)
{
    gpu_rng rt, rs;
    float *teacher = NULL;
    gpu_dataset *d = NULL;

    *out = NULL;
    if (n <= 0 || features <= 0 || classes < 2 || classes > 256)
        return GPU_EINVAL;
    d = calloc(1, sizeof(*d));
    teacher = malloc(sizeof(float) * (size_t)features * (size_t)classes);
    if (!d || !teacher)
        goto fail;
    d->values = malloc(sizeof(float) * (size_t)n * (size_t)features);
    d->labels = malloc((size_t)n);
    if (!d->values || !d->labels)
        goto fail;
    d->count = n;
    d->features = features;
    d->classes = classes;
    gpu_rng_seed(&rt, teacher_seed ^ 0x7EAC4E2ull);
    gpu_rng_seed(&rs, sample_seed);
    for (size_t i = 0; i < (size_t)features * (size_t)classes; i++)
        teacher[i] = gpu_rng_normal(&rt);
    for (int i = 0; i < n; i++) {
        float *x = d->values + (size_t)i * features;
        int best = 0;
        float bestv = -INFINITY;
        for (int j = 0; j < features; j++)
            x[j] = gpu_rng_normal(&rs);
        for (int c = 0; c < classes; c++) {
            const float *w = teacher + (size_t)c * features;
            float s = 0;
            for (int j = 0; j < features; j++)
                s += w[j] * x[j];
            if (s > bestv) {
                bestv = s;
                best = c;
            }
        }
        d->labels[i] = (uint8_t)best;
    }
    free(teacher);
    *out = d;
    return 0;
fail:
    free(teacher);
    gpu_dataset_free(d);
    return GPU_ENOMEM;
}

void gpu_dataset_normalize_like(gpu_dataset *d, const gpu_dataset *from)
{
    if (d->pixels && from->pixels) {
        d->mean = from->mean;
        d->inv_std = from->inv_std;
    }
}

/* Gather rows idx[0..n) into x (n x features, fp32) and y; see gpu.h. */
void gpu_dataset_gather(const gpu_dataset *d, const int *idx, int n, float *x, int *y)
{
    size_t f = (size_t)d->features;
    for (int i = 0; i < n; i++) {
        size_t r = (size_t)idx[i];
        float *dst = x + (size_t)i * f;
        if (d->values) {
            memcpy(dst, d->values + r * f, f * sizeof(float));
        } else {
            const uint8_t *src = d->pixels + r * f;
            float scale = d->inv_std / 255.0f, shift = -d->mean * d->inv_std;
            for (size_t j = 0; j < f; j++)
                dst[j] = (float)src[j] * scale + shift;
        }
        y[i] = d->labels[r];
    }
}

/* ---- sequence sets ---------------------------------------------------------------------- */

#define SEQ_MAX_TOKENS ((int64_t)1 << 34)
#define SHARD_MAGIC 20240520u
#define SHARD_VERSION 1u
#define SHARD_HEADER 1024 /* 256 int32, little-endian */

int64_t gpu_dataset_ntokens(const gpu_dataset *d)
{
    return d->ntokens;
}
/* One pass over the tokens: the counts, then -sum p log p and the largest p. */
int gpu_dataset_unigram(const gpu_dataset *d, double *entropy, double *top_freq)
{
    int64_t *count;
    int64_t top = 0;
    double h = 0;

    if (!d || d->ntokens <= 0 || d->vocab <= 0 || !entropy || !top_freq)
        return GPU_EINVAL;
    if (!(count = calloc((size_t)d->vocab, sizeof(*count))))
        return GPU_ENOMEM;
    for (int64_t i = 0; i < d->ntokens; i++)
        count[d->tok8 ? d->tok8[i] : d->tok16[i]]++;
    for (int v = 0; v < d->vocab; v++) {
        double p = (double)count[v] / (double)d->ntokens;
        if (count[v] > 0)
            h -= p * log(p);
        if (count[v] > top)
            top = count[v];
    }
    free(count);
    *entropy = h;
    *top_freq = (double)top / (double)d->ntokens;
    return 0;
}

int gpu_dataset_vocab(const gpu_dataset *d)
{
    return d->vocab;
}

/* A growing byte buffer. */
typedef struct {
    uint8_t *p;
    size_t n, cap;
} byte_buf;

static int buf_reserve(byte_buf *b, size_t more)
{
    size_t cap = b->cap ? b->cap : 65536;
    if (b->n + more <= b->cap)
        return 0;
    while (cap < b->n + more)
        cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p)
        return GPU_ENOMEM;
    b->p = p;
    b->cap = cap;
    return 0;
}

/* Append every byte of the file path (opened through symlinks) to b. */
static int append_file(const char *path, byte_buf *b, char *err, size_t errlen)
{
    struct stat st;
    int rc = 0;
    FILE *f = fopen(path, "rb");

    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return GPU_EIO;
    }
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: not a regular file", path);
        rc = GPU_EFORMAT;
        goto out;
    }
    if (buf_reserve(b, (size_t)st.st_size + 1) != 0)
        goto nomem;
    for (;;) { /* to the end, even if the file grew since fstat */
        if (b->n == b->cap && buf_reserve(b, 65536) != 0)
            goto nomem;
        size_t want = b->cap - b->n, got = fread(b->p + b->n, 1, want, f);
        b->n += got;
        if ((int64_t)b->n > SEQ_MAX_TOKENS) {
            snprintf(err, errlen, "%s: more than %lld bytes of text", path,
                     (long long)SEQ_MAX_TOKENS);
            rc = GPU_EFORMAT;
            goto out;
        }
        if (got < want) {
            if (ferror(f)) {
                snprintf(err, errlen, "%s: read error", path);
                rc = GPU_EIO;
            }
            goto out;
        }
    }
nomem:
    snprintf(err, errlen, "%s: cannot allocate memory for its text", path);
    rc = GPU_ENOMEM;
out:
    fclose(f);
    return rc;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Names a text directory skips whatever they are: hidden files and *.dat indexes. */
static int skipped_name(const char *name)
{
    size_t n = strlen(name);
    return name[0] == '.' || (n >= 4 && strcmp(name + n - 4, ".dat") == 0);
}

/* Append the text files of dir (see the top of this file) in name order to b. */
static int append_dir(const char *dir, byte_buf *b, char *err, size_t errlen)
{
    char **names = NULL;
    size_t n = 0, cap = 0;
    int used = 0, rc = 0;
    struct dirent *e;
    DIR *dp = opendir(dir);

    if (!dp) {
        snprintf(err, errlen, "%s: %s", dir, strerror(errno));
        return GPU_EIO;
    }
    for (;;) {
        errno = 0; /* readdir's only error report */
        if (!(e = readdir(dp)))
            break;
        if (skipped_name(e->d_name))
            continue;
        if (n == cap) {
            size_t ncap = cap ? 2 * cap : 64;
            char **p = realloc(names, ncap * sizeof(*names));
            if (!p)
                goto nomem;
            names = p;
            cap = ncap;
        }
        if (!(names[n] = strdup(e->d_name)))
            goto nomem;
        n++;
    }
    if (errno != 0) {
        snprintf(err, errlen, "%s: %s", dir, strerror(errno));
        rc = GPU_EIO;
        goto out;
    }
    qsort(names, n, sizeof(*names), cmp_names);
    for (size_t i = 0; i < n; i++) {
        char path[PATH_MAX];
        struct stat st;
        if ((size_t)snprintf(path, sizeof(path), "%s/%s", dir, names[i]) >= sizeof(path)) {
            snprintf(err, errlen, "%s/%s: path too long", dir, names[i]);
            rc = GPU_EINVAL;
            goto out;
        }
        if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode))
            continue;
        if ((rc = append_file(path, b, err, errlen)) != 0)
            goto out;
        used++;
    }
    if (used == 0) {
        snprintf(err, errlen, "%s: no text files in it (regular files not named .* or *.dat)", dir);
        rc = GPU_EFORMAT;
    }
    goto out;
nomem:
    snprintf(err, errlen, "%s: cannot allocate memory for its file names", dir);
    rc = GPU_ENOMEM;
out:
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    closedir(dp);
    return rc;
}

/* A reader fills *tok (malloc'ed, caller frees) with *n tokens and *vocab with max + 1. */
typedef int (*seq_reader)(const char *path, void **tok, int64_t *n, int *vocab, char *err,
                          size_t errlen);

/* Text: a file's bytes, or a directory's text files'; vocab 256. */
static int read_text(const char *path, void **tok, int64_t *n, int *vocab, char *err, size_t errlen)
{
    struct stat st;
    byte_buf b = {NULL, 0, 0};
    int rc;

    *tok = NULL;
    if (stat(path, &st) != 0) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return GPU_EIO;
    }
    rc = S_ISDIR(st.st_mode) ? append_dir(path, &b, err, errlen)
                             : append_file(path, &b, err, errlen);
    if (rc == 0 && b.n == 0) {
        snprintf(err, errlen, "%s: no text (empty)", path);
        rc = GPU_EFORMAT;
    }
    if (rc) {
        free(b.p);
        return rc;
    }
    *tok = b.p;
    *n = (int64_t)b.n;
    *vocab = 256;
    return 0;
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* An llm.c token shard: the 1024-byte header, then exactly header[2] uint16 tokens. */
static int read_tokens(const char *path, void **tok, int64_t *n, int *vocab, char *err,
                       size_t errlen)
{
    uint8_t hdr[SHARD_HEADER];
    uint16_t *t = NULL;
    struct stat st;
    int rc = GPU_EFORMAT;
    FILE *f = fopen(path, "rb");

    *tok = NULL;
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return GPU_EIO;
    }
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: not a regular file", path);
        goto fail;
    }
    if (st.st_size < SHARD_HEADER || fread(hdr, 1, sizeof(hdr), f) != sizeof(hdr)) {
        snprintf(err, errlen,
                 "%s: truncated: %lld bytes, less than the %d-byte header of an llm.c token shard",
                 path, (long long)st.st_size, SHARD_HEADER);
        goto fail;
    }
    uint32_t magic = le32(hdr), version = le32(hdr + 4);
    int32_t count = (int32_t)le32(hdr + 8);
    if (magic != SHARD_MAGIC) {
        snprintf(err, errlen, "%s: bad magic %u (an llm.c token shard starts with %u)", path, magic,
                 SHARD_MAGIC);
        goto fail;
    }
    if (version != SHARD_VERSION) {
        snprintf(err, errlen, "%s: unsupported version %u of the token shard format (only %u)",
                 path, version, SHARD_VERSION);
        goto fail;
    }
    if (count <= 0) {
        snprintf(err, errlen, "%s: the header says %d tokens", path, count);
        goto fail;
    }
    long long want = SHARD_HEADER + 2LL * count;
    if ((long long)st.st_size != want) {
        snprintf(err, errlen,
                 "%s: %s: the header says %d tokens (a file of %lld bytes) but the file has "
                 "%lld bytes",
                 path, (long long)st.st_size < want ? "truncated" : "size mismatch", count, want,
                 (long long)st.st_size);
        goto fail;
    }
    t = malloc(sizeof(*t) * (size_t)count);
    if (!t) {
        snprintf(err, errlen, "%s: cannot allocate %d tokens", path, count);
        rc = GPU_ENOMEM;
        goto fail;
    }
    if (fread(t, sizeof(*t), (size_t)count, f) != (size_t)count) {
        snprintf(err, errlen, "%s: truncated while reading %d tokens", path, count);
        rc = ferror(f) ? GPU_EIO : GPU_EFORMAT;
        goto fail;
    }
    const uint16_t one = 1;
    bool big_endian = *(const uint8_t *)&one == 0;
    int max = 0;
    for (int32_t i = 0; i < count; i++) {
        if (big_endian)
            t[i] = (uint16_t)(t[i] >> 8 | t[i] << 8);
        if (t[i] > max)
            max = t[i];
    }
    fclose(f);
    *tok = t;
    *n = count;
    *vocab = max + 1;
    return 0;
fail:
    free(t);
    fclose(f);
    return rc;
}

static gpu_dataset *seq_wrap(void *tok, size_t width, int64_t n)
{
    gpu_dataset *d = calloc(1, sizeof(*d));
    if (!d)
        return NULL;
    d->ntokens = n;
    if (width == 1)
        d->tok8 = tok;
    else
        d->tok16 = tok;
    return d;
}

/* Read path (and eval_path) with rd and split; see gpu_dataset_load_text in gpu.h. */
static int load_seq(seq_reader rd, size_t width, const char *path, const char *eval_path,
                    float val_fraction, gpu_dataset **train, gpu_dataset **val, char *err,
                    size_t errlen)
{
    void *a = NULL, *b = NULL;
    int64_t na = 0, nb = 0;
    int va = 0, vb = 0, rc;
    gpu_dataset *tr = NULL, *vd = NULL;
    bool split = !eval_path || !eval_path[0];

    *train = *val = NULL;
    if (!path || !path[0]) {
        snprintf(err, errlen, "no training data given");
        return GPU_EINVAL;
    }
    if (split && !(val_fraction > 0 && val_fraction < 1)) {
        snprintf(err, errlen, "val_fraction %g is not in (0, 1)", (double)val_fraction);
        return GPU_EINVAL;
    }
    if ((rc = rd(path, &a, &na, &va, err, errlen)) != 0)
        goto fail;
    if (split) {
        int64_t nv = llround((double)val_fraction * (double)na);
        if (nv < 1 || na - nv < 1) {
            snprintf(err, errlen, "%s: %lld tokens are too few to split off a val_fraction of %g",
                     path, (long long)na, (double)val_fraction);
            rc = GPU_EFORMAT;
            goto fail;
        }
        b = malloc((size_t)nv * width);
        if (!b)
            goto nomem;
        memcpy(b, (uint8_t *)a + (size_t)(na - nv) * width, (size_t)nv * width);
        nb = nv;
        na -= nv;
        vb = va;
        void *shrunk = realloc(a, (size_t)na * width);
        if (shrunk)
            a = shrunk;
    } else if ((rc = rd(eval_path, &b, &nb, &vb, err, errlen)) != 0) {
        goto fail;
    }
    if (!(tr = seq_wrap(a, width, na)))
        goto nomem;
    a = NULL;
    if (!(vd = seq_wrap(b, width, nb)))
        goto nomem;
    b = NULL;
    tr->vocab = vd->vocab = va > vb ? va : vb;
    *train = tr;
    *val = vd;
    return 0;
nomem:
    snprintf(err, errlen, "%s: out of memory", path);
    rc = GPU_ENOMEM;
fail:
    free(a);
    free(b);
    gpu_dataset_free(tr);
    gpu_dataset_free(vd);
    return rc;
}

/* Load text; see gpu.h. */
int gpu_dataset_load_text(const char *path, const char *eval_path, float val_fraction,
                          gpu_dataset **train, gpu_dataset **val, char *err, size_t errlen)
{
    return load_seq(read_text, 1, path, eval_path, val_fraction, train, val, err, errlen);
}

/* Load llm.c token shards; see gpu.h. */
int gpu_dataset_load_tokens(const char *path, const char *eval_path, float val_fraction,
                            gpu_dataset **train, gpu_dataset **val, char *err, size_t errlen)
{
    return load_seq(read_tokens, 2, path, eval_path, val_fraction, train, val, err, errlen);
}

/* splitmix64's output function: a bijection of 64 bits that mixes every bit. */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Copy the T+1 tokens at pos as inputs x[0..T) and targets y[0..T). */
static void seq_copy(const gpu_dataset *d, int64_t pos, int T, int *x, int *y)
{
    if (d->tok8) {
        const uint8_t *p = d->tok8 + pos;
        for (int t = 0; t < T; t++) {
            x[t] = p[t];
            y[t] = p[t + 1];
        }
    } else {
        const uint16_t *p = d->tok16 + pos;
        for (int t = 0; t < T; t++) {
            x[t] = p[t];
            y[t] = p[t + 1];
        }
    }
}

/* Draw B windows from (seed, step) alone; see gpu.h. Writes nothing when the set is not a
 * sequence set, B or T is not positive, or the set has fewer than T+1 tokens. */
void gpu_dataset_sample_seq(const gpu_dataset *d, uint64_t seed, int64_t step, int B, int T, int *x,
                            int *y)
{
    const uint64_t golden = 0x9E3779B97F4A7C15ull;
    if (!d || d->ntokens <= 0 || B <= 0 || T <= 0 || d->ntokens < (int64_t)T + 1)
        return;
    /* the ntokens - T starts in [0, ntokens - T) leave room for T+1 tokens */
    uint64_t starts = (uint64_t)(d->ntokens - T);
    uint64_t h = mix64(mix64(seed + golden) + (uint64_t)step * golden);
    for (int b = 0; b < B; b++) {
        uint64_t r = mix64(h + (uint64_t)(b + 1) * golden);
        seq_copy(d, (int64_t)(r % starts), T, x + (size_t)b * T, y + (size_t)b * T);
    }
}

/* Number of whole, non-overlapping windows of T+1 tokens; see gpu.h. */
int64_t gpu_dataset_nwindows(const gpu_dataset *d, int T)
{
    if (!d || T <= 0)
        return 0;
    return d->ntokens / ((int64_t)T + 1);
}

/* Window i: tokens [i(T+1), (i+1)(T+1)); writes nothing when i is out of range. */
void gpu_dataset_window(const gpu_dataset *d, int64_t i, int T, int *x, int *y)
{
    if (i < 0 || i >= gpu_dataset_nwindows(d, T))
        return;
    seq_copy(d, i * ((int64_t)T + 1), T, x, y);
}
