/*
 * data.c - datasets: IDX image/label files (MNIST, Fashion-MNIST; gzip or raw) and a
 * synthetic classification set.
 *
 * Image data is kept as uint8 (47 MB for Fashion-MNIST's training set) and normalised to
 * zero mean and unit variance while a batch is gathered; the mean and standard deviation
 * come from the training set. Synthetic data is kept as floats.
 *
 * Invariants: count > 0, features > 0, every label < classes. Threads: a dataset is
 * immutable after loading and may be read from several threads.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "gpu/gpu_int.h"

#define IDX_MAX_ITEMS 10000000

struct gpu_dataset {
    int count, features, classes;
    uint8_t *pixels; /* count x features, image data; NULL for synthetic */
    float *values;   /* count x features, synthetic data; NULL for images */
    uint8_t *labels; /* count */
    float mean, inv_std;
};

void gpu_dataset_free(gpu_dataset *d)
{
    if (!d)
        return;
    free(d->pixels);
    free(d->values);
    free(d->labels);
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

/* Read an IDX file of uint8 with `ndims` dimensions; *data is malloc'ed (caller frees). */
static int idx_read(const char *path, int ndims, uint32_t dims[3], uint8_t **data, char *err,
                    size_t errlen)
{
    uint8_t hdr[16];
    size_t total = 1;
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
        total *= dims[i];
    }
    if (total > (size_t)1 << 34) {
        snprintf(err, errlen, "%s: %zu elements is too large", path, total);
        goto fail;
    }
    *data = malloc(total);
    if (!*data) {
        rc = GPU_ENOMEM;
        snprintf(err, errlen, "%s: cannot allocate %zu bytes", path, total);
        goto fail;
    }
    if (gz_read_all(f, *data, total) != 0) {
        snprintf(err, errlen, "%s: truncated data (expected %zu bytes)", path, total);
        goto fail;
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
    d->features = (int)(idims[1] * idims[2]);
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
