/*
 * ckpt.c - checkpoints as safetensors files: the weights (fp32 master, or the
 * low-precision weights without one), the optimizer state and the data order as tensors,
 * and the step, scaler state and RNG state as string metadata. Any safetensors reader
 * loads the weights by name ("fc1.weight", ...).
 *
 * Layout: 8-byte little-endian header length, the JSON header (padded with spaces to a
 * multiple of 8), then the tensors' bytes in header order.
 *
 * Invariants: a checkpoint file is complete or absent: it is written to a temporary file,
 * fsynced and renamed into place, and the directory is fsynced. Loading checks every
 * tensor's dtype, shape and size against the job before it copies anything that matters:
 * a checkpoint of another job is refused.
 *
 * Threads: the caller's; one trainer at a time.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/ckpt.h"

#define CKPT_FORMAT "ampd-checkpoint-1"
#define CKPT_MAX_HEADER (16 << 20)

static void meta_i64(json_t *meta, const char *key, int64_t v)
{
    char buf[32];
    snprintf(buf, sizeof(buf), "%" PRId64, v);
    json_object_set_new(meta, key, json_string(buf));
}

static json_t *scalars_meta(const gpu_state_scalars *sc)
{
    json_t *m = json_object();
    char buf[96];
    json_object_set_new(m, "format", json_string(CKPT_FORMAT));
    meta_i64(m, "step", sc->step);
    meta_i64(m, "applied", sc->applied);
    meta_i64(m, "lost_total", sc->lost_total);
    meta_i64(m, "perm_pos", sc->perm_pos);
    snprintf(buf, sizeof(buf), "%.9g", (double)sc->scaler.scale);
    json_object_set_new(m, "scaler.scale", json_string(buf));
    meta_i64(m, "scaler.growth_tracker", sc->scaler.growth_tracker);
    meta_i64(m, "scaler.hysteresis_left", sc->scaler.hysteresis_left);
    meta_i64(m, "scaler.floor_streak", sc->scaler.floor_streak);
    meta_i64(m, "scaler.steps", sc->scaler.steps);
    meta_i64(m, "scaler.overflow_total", sc->scaler.overflow_total);
    meta_i64(m, "scaler.skipped_total", sc->scaler.skipped_total);
    meta_i64(m, "scaler.growth_total", sc->scaler.growth_total);
    meta_i64(m, "scaler.backoff_total", sc->scaler.backoff_total);
    snprintf(buf, sizeof(buf), "%016" PRIx64 "%016" PRIx64 "%016" PRIx64 "%016" PRIx64,
             sc->rng[0], sc->rng[1], sc->rng[2], sc->rng[3]);
    json_object_set_new(m, "rng", json_string(buf));
    meta_i64(m, "world_size", sc->world_size);
    return m;
}

/* The header JSON, padded to a multiple of 8 bytes; caller frees. */
static char *build_header(const gpu_state_tensor *v, int n, const gpu_state_scalars *sc,
                          size_t *len)
{
    json_t *h = json_object();
    size_t off = 0;
    json_object_set_new(h, "__metadata__", scalars_meta(sc));
    for (int i = 0; i < n; i++) {
        json_t *shape = json_array();
        for (int d = 0; d < v[i].ndim; d++)
            json_array_append_new(shape, json_integer(v[i].shape[d]));
        json_object_set_new(h, v[i].name,
                            json_pack("{s:s, s:o, s:[I,I]}", "dtype", v[i].dtype, "shape",
                                      shape, "data_offsets", (json_int_t)off,
                                      (json_int_t)(off + v[i].bytes)));
        off += v[i].bytes;
    }
    char *text = json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(h);
    if (!text)
        return NULL;
    size_t n0 = strlen(text), padded = (n0 + 7) & ~(size_t)7;
    char *out = realloc(text, padded + 1);
    if (!out) {
        free(text);
        return NULL;
    }
    memset(out + n0, ' ', padded - n0);
    out[padded] = '\0';
    *len = padded;
    return out;
}

static int write_all(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* Write the trainer's state to dir/ckpt-<step>.safetensors atomically; see ckpt.h. */
int daemon_ckpt_save(gpu_trainer *t, const char *dir, char *path, size_t pathlen,
                     int64_t *bytes, char *err, size_t errlen)
{
    gpu_state_tensor *v = NULL;
    gpu_state_scalars sc;
    char tmp[1024], *header = NULL;
    size_t hlen = 0;
    int n = 0, fd = -1, rc = GPU_EIO;
    uint64_t total = 0;

    gpu_trainer_get_scalars(t, &sc);
    if (gpu_trainer_state(t, &v, &n) != 0 || !(header = build_header(v, n, &sc, &hlen))) {
        snprintf(err, errlen, "checkpoint: out of memory");
        rc = GPU_ENOMEM;
        goto fail;
    }
    snprintf(path, pathlen, "%s/ckpt-%" PRId64 ".safetensors", dir, sc.step);
    snprintf(tmp, sizeof(tmp), "%s/.ckpt-%" PRId64 ".tmp", dir, sc.step);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    if (fd < 0 || write_all(fd, len8, 8) || write_all(fd, header, hlen))
        goto io_fail;
    total = 8 + hlen;
    for (int i = 0; i < n; i++) {
        if (write_all(fd, v[i].data, v[i].bytes))
            goto io_fail;
        total += v[i].bytes;
    }
    if (fsync(fd) != 0 || close(fd) != 0) {
        fd = -1;
        goto io_fail;
    }
    fd = -1;
    if (rename(tmp, path) != 0 || fsync_dir(dir) != 0)
        goto io_fail;
    *bytes = (int64_t)total;
    rc = 0;
    goto out;
io_fail:
    snprintf(err, errlen, "checkpoint %s: %s", tmp, strerror(errno));
    if (fd >= 0)
        close(fd);
    unlink(tmp);
fail:
out:
    free(header);
    free(v);
    return rc;
}

static int meta_get(json_t *meta, const char *key, int64_t *out)
{
    const char *s = json_string_value(json_object_get(meta, key));
    char *end;
    if (!s)
        return -1;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || end == s)
        return -1;
    *out = v;
    return 0;
}

static int parse_scalars(json_t *meta, gpu_state_scalars *sc)
{
    int64_t gt, hl, fs, ws;
    const char *scale = json_string_value(json_object_get(meta, "scaler.scale"));
    const char *rng = json_string_value(json_object_get(meta, "rng"));
    const char *fmt = json_string_value(json_object_get(meta, "format"));
    memset(sc, 0, sizeof(*sc));
    if (!fmt || strcmp(fmt, CKPT_FORMAT) != 0 || !scale || !rng || strlen(rng) != 64 ||
        meta_get(meta, "step", &sc->step) || meta_get(meta, "applied", &sc->applied) ||
        meta_get(meta, "lost_total", &sc->lost_total) ||
        meta_get(meta, "perm_pos", &sc->perm_pos) ||
        meta_get(meta, "scaler.growth_tracker", &gt) ||
        meta_get(meta, "scaler.hysteresis_left", &hl) ||
        meta_get(meta, "scaler.floor_streak", &fs) ||
        meta_get(meta, "scaler.steps", &sc->scaler.steps) ||
        meta_get(meta, "scaler.overflow_total", &sc->scaler.overflow_total) ||
        meta_get(meta, "scaler.skipped_total", &sc->scaler.skipped_total) ||
        meta_get(meta, "scaler.growth_total", &sc->scaler.growth_total) ||
        meta_get(meta, "scaler.backoff_total", &sc->scaler.backoff_total))
        return -1;
    if (meta_get(meta, "world_size", &ws) != 0)
        ws = 1; /* written before data parallelism */
    sc->world_size = (int)ws;
    sc->scaler.scale = strtof(scale, NULL);
    sc->scaler.growth_tracker = (int)gt;
    sc->scaler.hysteresis_left = (int)hl;
    sc->scaler.floor_streak = (int)fs;
    for (int i = 0; i < 4; i++) {
        char part[17];
        memcpy(part, rng + 16 * i, 16);
        part[16] = '\0';
        sc->rng[i] = strtoull(part, NULL, 16);
    }
    return 0;
}

/* Check one tensor's header entry against the job's tensor; returns its file offset. */
static int match_tensor(json_t *h, const gpu_state_tensor *v, uint64_t data_len, uint64_t *off,
                        char *err, size_t errlen)
{
    json_t *e = json_object_get(h, v->name), *shape, *offs;
    if (!json_is_object(e)) {
        snprintf(err, errlen, "checkpoint has no tensor %s", v->name);
        return -1;
    }
    shape = json_object_get(e, "shape");
    offs = json_object_get(e, "data_offsets");
    const char *dt = json_string_value(json_object_get(e, "dtype"));
    bool ok = dt && strcmp(dt, v->dtype) == 0 && json_array_size(shape) == (size_t)v->ndim &&
              json_array_size(offs) == 2;
    for (int d = 0; ok && d < v->ndim; d++)
        ok = json_integer_value(json_array_get(shape, (size_t)d)) == v->shape[d];
    if (ok) {
        json_int_t a = json_integer_value(json_array_get(offs, 0));
        json_int_t b = json_integer_value(json_array_get(offs, 1));
        ok = a >= 0 && b >= a && (uint64_t)(b - a) == v->bytes && (uint64_t)b <= data_len;
        *off = (uint64_t)a;
    }
    if (!ok)
        snprintf(err, errlen, "checkpoint tensor %s does not match this job (%s, %d dims)",
                 v->name, v->dtype, v->ndim);
    return ok ? 0 : -1;
}

static int read_at(FILE *f, uint64_t off, void *buf, size_t n)
{
    return fseeko(f, (off_t)off, SEEK_SET) == 0 && fread(buf, 1, n, f) == n ? 0 : -1;
}

/* Load a checkpoint into a trainer built from the same spec; see ckpt.h. */
int daemon_ckpt_load(gpu_trainer *t, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    gpu_state_tensor *v = NULL;
    gpu_state_scalars sc, now;
    json_t *h = NULL;
    char *text = NULL;
    uint8_t len8[8];
    uint64_t hlen = 0, *offs = NULL;
    int n = 0, rc = GPU_EFORMAT;

    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return GPU_EIO;
    }
    if (fread(len8, 1, 8, f) != 8)
        goto bad;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)len8[i] << (8 * i);
    if (hlen == 0 || hlen > CKPT_MAX_HEADER || !(text = malloc(hlen + 1)) ||
        fread(text, 1, hlen, f) != hlen)
        goto bad;
    text[hlen] = '\0';
    h = json_loads(text, 0, NULL);
    if (!json_is_object(h) || parse_scalars(json_object_get(h, "__metadata__"), &sc))
        goto bad;
    fseeko(f, 0, SEEK_END);
    uint64_t data_len = (uint64_t)ftello(f) - 8 - hlen;
    if (gpu_trainer_state(t, &v, &n) != 0 || !(offs = calloc((size_t)n, sizeof(*offs)))) {
        rc = GPU_ENOMEM;
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++)
        if (match_tensor(h, &v[i], data_len, &offs[i], err, errlen))
            goto out;
    for (int i = 0; i < n; i++)
        if (read_at(f, 8 + hlen + offs[i], v[i].data, v[i].bytes))
            goto bad;
    gpu_trainer_get_scalars(t, &now);
    if (sc.world_size != now.world_size) {
        snprintf(err, errlen,
                 "%s was written by a job of %d rank(s) and this one has %d "
                 "(distributed.world_size): resume it with the world size it was trained with",
                 path, sc.world_size, now.world_size);
        rc = GPU_EINVAL;
        goto out;
    }
    rc = gpu_trainer_set_scalars(t, &sc);
    if (rc)
        snprintf(err, errlen, "%s: the checkpoint's state does not fit this job", path);
    goto out;
bad:
    snprintf(err, errlen, "%s: not an ampd checkpoint (safetensors, %s)", path, CKPT_FORMAT);
    rc = GPU_EFORMAT;
out:
    free(offs);
    free(v);
    json_decref(h);
    free(text);
    fclose(f);
    return rc;
}
