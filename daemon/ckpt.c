/*
 * ckpt.c - checkpoints as safetensors files: the weights (fp32 master, or the
 * low-precision weights without one), the optimizer state and the data order as tensors,
 * and the step, scaler state and RNG state as string metadata. Any safetensors reader
 * loads the weights by name ("fc1.weight", ...).
 *
 * Layout: 8-byte little-endian header length, the JSON header (padded with spaces to a
 * multiple of 8), then the tensors' bytes in header order.
 *
 * Format 2 ("format": "ampd-checkpoint-2", the second metadata key) adds "crc32": eight
 * lowercase hex digits, the CRC-32 (zlib's, ISO-HDLC) of the file from byte 8 to its end,
 * computed with those eight digits read as "00000000". So the header (the step, the scaler,
 * the shapes) and every tensor byte are covered. It also records "loss" (the training loss
 * of the step), "eval_loss" (when an eval ran at that step) and "finite" ("1" when every
 * weight and optimizer value is finite), which the retention policy reads. Format 1 files
 * (written before checksums) have none of these: they load after the structural checks
 * alone, and count as finite.
 *
 * Invariants: a checkpoint file is complete or absent: it is written to a temporary file,
 * fsynced and renamed into place, and the directory is fsynced. Loading checks the file's
 * size against its header (a truncation is named as one), its checksum, then every
 * tensor's dtype, shape and size against the job, before it copies anything into the
 * trainer: a damaged file or a checkpoint of another job leaves the trainer as it was (short
 * of a read error after those checks).
 *
 * Threads: the caller's; one trainer at a time.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "daemon/ckpt.h"

#define CKPT_FORMAT_1 "ampd-checkpoint-1"
#define CKPT_FORMAT_2 "ampd-checkpoint-2"
#define CKPT_MAX_HEADER (16 << 20)
#define CKPT_CRC_KEY "\"crc32\":\""
#define CKPT_CHUNK (1 << 20)

/* ---- names -------------------------------------------------------------------------------- */

void daemon_ckpt_path(const char *dir, int64_t step, char *buf, size_t len)
{
    snprintf(buf, len, "%s/ckpt-%" PRId64 ".safetensors", dir, step);
}

int daemon_ckpt_step_of(const char *name, int64_t *step)
{
    static const char pre[] = "ckpt-", suf[] = ".safetensors";
    const char *p = name + sizeof(pre) - 1;
    char *end;
    if (strncmp(name, pre, sizeof(pre) - 1) != 0 || *p < '0' || *p > '9')
        return -1;
    errno = 0;
    long long v = strtoll(p, &end, 10);
    if (errno || strcmp(end, suf) != 0)
        return -1;
    *step = v;
    return 0;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int daemon_ckpt_scan(const char *dir, int64_t **steps, int *n)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    int64_t *v = NULL, step;
    int cnt = 0, cap = 0, rc = 0;

    *steps = NULL;
    *n = 0;
    if (!d)
        return GPU_EIO;
    while ((e = readdir(d)) != NULL) {
        if (daemon_ckpt_step_of(e->d_name, &step) != 0)
            continue;
        if (cnt == cap) {
            int64_t *nv = realloc(v, sizeof(*v) * (size_t)(cap = cap ? 2 * cap : 16));
            if (!nv) {
                rc = GPU_ENOMEM;
                goto fail;
            }
            v = nv;
        }
        v[cnt++] = step;
    }
    closedir(d);
    if (cnt > 1)
        qsort(v, (size_t)cnt, sizeof(*v), cmp_i64);
    *steps = v;
    *n = cnt;
    return 0;
fail:
    closedir(d);
    free(v);
    return rc;
}

bool daemon_ckpt_healthy(const daemon_ckpt_info *info)
{
    return info->finite && (!info->has_loss || isfinite(info->loss));
}

/* ---- writing ------------------------------------------------------------------------------ */

static void meta_i64(json_t *meta, const char *key, int64_t v)
{
    char buf[32];
    snprintf(buf, sizeof(buf), "%" PRId64, v);
    json_object_set_new(meta, key, json_string(buf));
}

static void meta_f64(json_t *meta, const char *key, double v)
{
    char buf[40];
    snprintf(buf, sizeof(buf), "%.9g", v);
    json_object_set_new(meta, key, json_string(buf));
}

static json_t *scalars_meta(const gpu_state_scalars *sc, const daemon_ckpt_info *info)
{
    json_t *m = json_object();
    char buf[96];
    json_object_set_new(m, "format", json_string(CKPT_FORMAT_2));
    json_object_set_new(m, "crc32", json_string("00000000")); /* filled in after the dump */
    meta_i64(m, "step", sc->step);
    meta_i64(m, "applied", sc->applied);
    meta_i64(m, "lost_total", sc->lost_total);
    meta_i64(m, "perm_pos", sc->perm_pos);
    meta_i64(m, "data.skipped", sc->skipped);
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
    snprintf(buf, sizeof(buf), "%016" PRIx64 "%016" PRIx64 "%016" PRIx64 "%016" PRIx64, sc->rng[0],
             sc->rng[1], sc->rng[2], sc->rng[3]);
    json_object_set_new(m, "rng", json_string(buf));
    meta_i64(m, "world_size", sc->world_size);
    if (info->has_loss)
        meta_f64(m, "loss", info->loss);
    if (info->has_eval)
        meta_f64(m, "eval_loss", info->eval_loss);
    json_object_set_new(m, "finite", json_string(info->finite ? "1" : "0"));
    return m;
}

/* The header JSON, padded to a multiple of 8 bytes; caller frees. */
static char *build_header(const gpu_state_tensor *v, int n, const gpu_state_scalars *sc,
                          const daemon_ckpt_info *info, size_t *len)
{
    json_t *h = json_object();
    size_t off = 0;
    json_object_set_new(h, "__metadata__", scalars_meta(sc, info));
    for (int i = 0; i < n; i++) {
        json_t *shape = json_array();
        for (int d = 0; d < v[i].ndim; d++)
            json_array_append_new(shape, json_integer(v[i].shape[d]));
        json_object_set_new(h, v[i].name,
                            json_pack("{s:s, s:o, s:[I,I]}", "dtype", v[i].dtype, "shape", shape,
                                      "data_offsets", (json_int_t)off,
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

/* True when every value of a floating-point tensor is finite (other dtypes: true). */
static bool tensor_finite(const gpu_state_tensor *v)
{
    if (strcmp(v->dtype, "F32") == 0) {
        const float *p = v->data;
        for (size_t i = 0; i < v->bytes / sizeof(float); i++)
            if (!isfinite(p[i]))
                return false;
    } else if (strcmp(v->dtype, "F16") == 0 || strcmp(v->dtype, "BF16") == 0) {
        const uint16_t *p = v->data;
        uint16_t exp = strcmp(v->dtype, "F16") == 0 ? 0x7C00u : 0x7F80u;
        for (size_t i = 0; i < v->bytes / sizeof(uint16_t); i++)
            if ((p[i] & exp) == exp)
                return false;
    }
    return true;
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

/* zlib's crc32 over any length (its length argument is an unsigned int). */
static uint32_t crc_update(uint32_t crc, const void *buf, size_t n)
{
    const Bytef *p = buf;
    while (n > 0) {
        uInt k = n > CKPT_CHUNK ? CKPT_CHUNK : (uInt)n;
        crc = (uint32_t)crc32(crc, p, k);
        p += k;
        n -= k;
    }
    return crc;
}

/* Write the trainer's state to dir/ckpt-<step>.safetensors atomically; see ckpt.h. */
int daemon_ckpt_save(gpu_trainer *t, const char *dir, daemon_ckpt_info *info, char *path,
                     size_t pathlen, char *err, size_t errlen)
{
    gpu_state_tensor *v = NULL;
    gpu_state_scalars sc;
    char tmp[1024], *header = NULL, *crc_at;
    size_t hlen = 0;
    int n = 0, fd = -1, rc = GPU_EIO;
    uint64_t total = 0;
    uint32_t crc;

    gpu_trainer_get_scalars(t, &sc);
    if (gpu_trainer_state(t, &v, &n) != 0) {
        snprintf(err, errlen, "checkpoint: out of memory");
        rc = GPU_ENOMEM;
        goto fail;
    }
    info->finite = true;
    for (int i = 0; i < n && info->finite; i++)
        info->finite = tensor_finite(&v[i]);
    if (!(header = build_header(v, n, &sc, info, &hlen)) ||
        !(crc_at = strstr(header, CKPT_CRC_KEY))) {
        snprintf(err, errlen, "checkpoint: out of memory");
        rc = GPU_ENOMEM;
        goto fail;
    }
    crc_at += strlen(CKPT_CRC_KEY);
    crc = crc_update((uint32_t)crc32(0L, Z_NULL, 0), header, hlen);
    for (int i = 0; i < n; i++)
        crc = crc_update(crc, v[i].data, v[i].bytes);
    char hex[9];
    snprintf(hex, sizeof(hex), "%08" PRIx32, crc);
    memcpy(crc_at, hex, 8);

    daemon_ckpt_path(dir, sc.step, path, pathlen);
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
    info->step = sc.step;
    info->bytes = (int64_t)total;
    info->checksummed = true;
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

/* ---- reading ------------------------------------------------------------------------------ */

/* An open checkpoint whose header has been read and checked against the file's size. */
typedef struct {
    FILE *f;
    json_t *h;     /* the header */
    char *text;    /* its bytes, NUL-terminated */
    uint64_t hlen; /* their number */
    uint64_t size; /* the file's */
    int format;    /* 1 or 2 */
    uint32_t crc;  /* format 2: the stored checksum */
    size_t crc_at; /* format 2: where its eight digits are in text */
} ckpt_file;

static void ckpt_close(ckpt_file *c)
{
    if (c->f)
        fclose(c->f);
    json_decref(c->h);
    free(c->text);
    memset(c, 0, sizeof(*c));
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

static bool meta_f64_get(json_t *meta, const char *key, double *out)
{
    const char *s = json_string_value(json_object_get(meta, key));
    char *end;
    if (!s)
        return false;
    *out = strtod(s, &end);
    return end != s && !*end;
}

/* The end of the last tensor's bytes, from the header's data_offsets; -1 when an entry is
 * not a tensor description. */
static int data_end(json_t *h, uint64_t *end, char *why, size_t whylen)
{
    const char *key;
    json_t *e;
    *end = 0;
    json_object_foreach(h, key, e)
    {
        json_t *offs = json_object_get(e, "data_offsets");
        json_t *a = json_array_get(offs, 0), *b = json_array_get(offs, 1);
        if (strcmp(key, "__metadata__") == 0)
            continue;
        if (!json_is_integer(a) || !json_is_integer(b) || json_integer_value(a) < 0 ||
            json_integer_value(b) < json_integer_value(a)) {
            snprintf(why, whylen, "damaged header: tensor %.100s has no valid data_offsets", key);
            return -1;
        }
        if ((uint64_t)json_integer_value(b) > *end)
            *end = (uint64_t)json_integer_value(b);
    }
    return 0;
}

/* Open path and read its header into c; why gets the reason on failure (no path). */
static int ckpt_open(const char *path, ckpt_file *c, daemon_ckpt_info *info, char *why,
                     size_t whylen)
{
    struct stat sb;
    uint8_t len8[8];
    uint64_t end = 0;
    json_t *meta;
    const char *fmt, *crc, *fin;
    int64_t step;
    int rc = GPU_EFORMAT;

    memset(c, 0, sizeof(*c));
    memset(info, 0, sizeof(*info));
    info->loss = info->eval_loss = NAN;
    if (!(c->f = fopen(path, "rb")) || fstat(fileno(c->f), &sb) != 0) {
        snprintf(why, whylen, "%s", errno == ENOENT ? "missing" : strerror(errno));
        rc = GPU_EIO;
        goto fail;
    }
    c->size = (uint64_t)sb.st_size;
    info->bytes = (int64_t)c->size;
    if (c->size < 8) {
        snprintf(why, whylen, "truncated: %" PRIu64 " bytes, not even a header length", c->size);
        goto fail;
    }
    if (fread(len8, 1, 8, c->f) != 8) {
        snprintf(why, whylen, "cannot read it: %s", strerror(errno));
        rc = GPU_EIO;
        goto fail;
    }
    for (int i = 0; i < 8; i++)
        c->hlen |= (uint64_t)len8[i] << (8 * i);
    if (c->hlen == 0 || c->hlen > CKPT_MAX_HEADER) {
        snprintf(why, whylen, "not an ampd checkpoint (a header of %" PRIu64 " bytes)", c->hlen);
        goto fail;
    }
    if (c->size < 8 + c->hlen) {
        snprintf(why, whylen,
                 "truncated: %" PRIu64 " bytes, shorter than its %" PRIu64 "-byte header", c->size,
                 c->hlen);
        goto fail;
    }
    if (!(c->text = malloc(c->hlen + 1))) {
        snprintf(why, whylen, "out of memory");
        rc = GPU_ENOMEM;
        goto fail;
    }
    if (fread(c->text, 1, c->hlen, c->f) != c->hlen) {
        snprintf(why, whylen, "cannot read it: %s", strerror(errno));
        rc = GPU_EIO;
        goto fail;
    }
    c->text[c->hlen] = '\0';
    c->h = json_loadb(c->text, c->hlen, 0, NULL);
    meta = json_object_get(c->h, "__metadata__");
    fmt = json_string_value(json_object_get(meta, "format"));
    if (!json_is_object(c->h) || !fmt ||
        (strcmp(fmt, CKPT_FORMAT_1) != 0 && strcmp(fmt, CKPT_FORMAT_2) != 0) ||
        meta_get(meta, "step", &step) != 0) {
        snprintf(why, whylen, "not an ampd checkpoint (safetensors with %s or %s metadata)",
                 CKPT_FORMAT_2, CKPT_FORMAT_1);
        goto fail;
    }
    if (data_end(c->h, &end, why, whylen) != 0)
        goto fail;
    if (c->size < 8 + c->hlen + end) {
        snprintf(why, whylen, "truncated: %" PRIu64 " of its %" PRIu64 " bytes", c->size,
                 8 + c->hlen + end);
        goto fail;
    }
    if (c->size > 8 + c->hlen + end) {
        snprintf(why, whylen, "damaged: %" PRIu64 " bytes after its last tensor",
                 c->size - 8 - c->hlen - end);
        goto fail;
    }
    info->step = step;
    info->finite = true;
    c->format = strcmp(fmt, CKPT_FORMAT_2) == 0 ? 2 : 1;
    if (c->format == 1)
        return 0;
    crc = json_string_value(json_object_get(meta, "crc32"));
    char *at = strstr(c->text, CKPT_CRC_KEY);
    if (!crc || strlen(crc) != 8 || strspn(crc, "0123456789abcdef") != 8 || !at ||
        strncmp(at + strlen(CKPT_CRC_KEY), crc, 8) != 0 || at[strlen(CKPT_CRC_KEY) + 8] != '"') {
        snprintf(why, whylen, "damaged header: no valid crc32 in its metadata");
        goto fail;
    }
    c->crc = (uint32_t)strtoul(crc, NULL, 16);
    c->crc_at = (size_t)(at - c->text) + strlen(CKPT_CRC_KEY);
    info->checksummed = true;
    info->has_loss = meta_f64_get(meta, "loss", &info->loss);
    info->has_eval = meta_f64_get(meta, "eval_loss", &info->eval_loss);
    fin = json_string_value(json_object_get(meta, "finite"));
    info->finite = !fin || strcmp(fin, "0") != 0;
    return 0;
fail:
    ckpt_close(c);
    return rc;
}

/* Format 2: the checksum over the file; GPU_EFORMAT on a mismatch. */
static int ckpt_check_crc(ckpt_file *c, char *why, size_t whylen)
{
    uint8_t *buf = NULL;
    uint64_t left = c->size - 8 - c->hlen;
    uint32_t crc;
    char keep[8];
    int rc = 0;

    if (c->format != 2)
        return 0;
    memcpy(keep, c->text + c->crc_at, 8);
    memset(c->text + c->crc_at, '0', 8);
    crc = crc_update((uint32_t)crc32(0L, Z_NULL, 0), c->text, c->hlen);
    memcpy(c->text + c->crc_at, keep, 8);
    if (!(buf = malloc(CKPT_CHUNK))) {
        snprintf(why, whylen, "out of memory");
        return GPU_ENOMEM;
    }
    errno = 0;
    if (fseeko(c->f, (off_t)(8 + c->hlen), SEEK_SET) != 0)
        goto read_fail;
    while (left > 0) {
        size_t k = left > CKPT_CHUNK ? CKPT_CHUNK : (size_t)left;
        if (fread(buf, 1, k, c->f) != k)
            goto read_fail;
        crc = crc_update(crc, buf, k);
        left -= k;
    }
    if (crc != c->crc) {
        snprintf(why, whylen,
                 "checksum mismatch: crc32 %08" PRIx32 " in its header, %08" PRIx32 " of its bytes",
                 c->crc, crc);
        rc = GPU_EFORMAT;
    }
    goto out;
read_fail:
    snprintf(why, whylen, "cannot read it: %s", errno ? strerror(errno) : "short read");
    rc = GPU_EIO;
out:
    free(buf);
    return rc;
}

/* See ckpt.h. */
int daemon_ckpt_read_info(const char *path, daemon_ckpt_info *info, char *err, size_t errlen)
{
    ckpt_file c;
    char why[400];
    int rc = ckpt_open(path, &c, info, why, sizeof(why));
    if (rc)
        snprintf(err, errlen, "%s: %s", path, why);
    ckpt_close(&c);
    return rc;
}

static int parse_scalars(json_t *meta, gpu_state_scalars *sc)
{
    int64_t gt, hl, fs, ws;
    const char *scale = json_string_value(json_object_get(meta, "scaler.scale"));
    const char *rng = json_string_value(json_object_get(meta, "rng"));
    memset(sc, 0, sizeof(*sc));
    if (!scale || !rng || strlen(rng) != 64 || meta_get(meta, "step", &sc->step) ||
        meta_get(meta, "applied", &sc->applied) || meta_get(meta, "lost_total", &sc->lost_total) ||
        meta_get(meta, "perm_pos", &sc->perm_pos) || meta_get(meta, "scaler.growth_tracker", &gt) ||
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
    if (meta_get(meta, "data.skipped", &sc->skipped) != 0)
        sc->skipped = 0; /* written before data.skip_batches */
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

/* A safetensors float dtype as a gpu_dtype; -1 for another (I32) or none. */
static int float_dtype(const char *name)
{
    static const char *const names[] = {"F32", "F16", "BF16"};
    static const gpu_dtype dts[] = {GPU_FP32, GPU_FP16, GPU_BF16};
    for (int i = 0; name && i < 3; i++)
        if (strcmp(name, names[i]) == 0)
            return (int)dts[i];
    return -1;
}

/* Check one tensor's header entry against the job's tensor; its file offset in *off. With
 * convert (a branch's start), a float tensor of the same shape in another float dtype fits
 * too: *from gets the file's dtype (else -1: as the job keeps it). */
static int match_tensor(json_t *h, const gpu_state_tensor *v, bool convert, uint64_t *off,
                        int *from, char *why, size_t whylen)
{
    json_t *e = json_object_get(h, v->name), *shape, *offs;
    if (!json_is_object(e)) {
        snprintf(why, whylen, "the checkpoint has no tensor %s: it is another job's", v->name);
        return -1;
    }
    shape = json_object_get(e, "shape");
    offs = json_object_get(e, "data_offsets");
    const char *dt = json_string_value(json_object_get(e, "dtype"));
    int fdt = float_dtype(dt), vdt = float_dtype(v->dtype);
    size_t bytes = v->bytes;
    *from = -1;
    if (convert && dt && fdt >= 0 && vdt >= 0 && fdt != vdt) {
        *from = fdt;
        bytes = v->bytes / gpu_dtype_size((gpu_dtype)vdt) * gpu_dtype_size((gpu_dtype)fdt);
    }
    bool ok = dt && (*from >= 0 || strcmp(dt, v->dtype) == 0) &&
              json_array_size(shape) == (size_t)v->ndim && json_array_size(offs) == 2;
    for (int d = 0; ok && d < v->ndim; d++)
        ok = json_integer_value(json_array_get(shape, (size_t)d)) == v->shape[d];
    if (ok) {
        json_int_t a = json_integer_value(json_array_get(offs, 0));
        json_int_t b = json_integer_value(json_array_get(offs, 1));
        ok = (uint64_t)(b - a) == bytes; /* ckpt_open checked 0 <= a <= b <= the data */
        *off = (uint64_t)a;
    }
    if (!ok)
        snprintf(why, whylen, "checkpoint tensor %s does not match this job (%s, %d dims)", v->name,
                 v->dtype, v->ndim);
    return ok ? 0 : -1;
}

static int read_at(FILE *f, uint64_t off, void *buf, size_t n)
{
    return fseeko(f, (off_t)off, SEEK_SET) == 0 && fread(buf, 1, n, f) == n ? 0 : -1;
}

/* Read tensor v stored in dtype from at off, converted to v's dtype through fp32 (exact
 * from a 16-bit dtype to fp32, rounded to nearest even the other way). 0, -1 (a read
 * error, errno set) or GPU_ENOMEM. */
static int read_converted(FILE *f, uint64_t off, const gpu_state_tensor *v, gpu_dtype from)
{
    gpu_dtype to = (gpu_dtype)float_dtype(v->dtype);
    size_t n = v->bytes / gpu_dtype_size(to);
    void *raw = malloc(n * gpu_dtype_size(from));
    float *f32 = to == GPU_FP32 ? v->data : malloc(n * sizeof(float));
    int rc = raw && f32 ? 0 : GPU_ENOMEM;
    if (rc == 0 && read_at(f, off, raw, n * gpu_dtype_size(from)) != 0)
        rc = -1;
    if (rc == 0) {
        gpu_cvt_to_f32(f32, raw, from, n);
        if (to != GPU_FP32)
            gpu_cvt_from_f32(v->data, to, f32, n);
    }
    free(raw);
    if (f32 != v->data)
        free(f32);
    return rc;
}

/* The load, with the reason in why (no path). convert: a branch's start, whose float
 * tensors may be in another dtype (match_tensor); *nconv counts them. */
static int load(gpu_trainer *t, const char *path, bool convert, daemon_ckpt_info *info, int *nconv,
                char *why, size_t whylen)
{
    ckpt_file c;
    gpu_state_tensor *v = NULL;
    gpu_state_scalars sc, now;
    uint64_t *offs = NULL;
    int *from = NULL, n = 0, rc;

    if ((rc = ckpt_open(path, &c, info, why, whylen)) != 0)
        return rc;
    if ((rc = ckpt_check_crc(&c, why, whylen)) != 0)
        goto out;
    rc = GPU_EFORMAT;
    if (parse_scalars(json_object_get(c.h, "__metadata__"), &sc)) {
        snprintf(why, whylen, "not an ampd checkpoint (its metadata lacks the trainer's state)");
        goto out;
    }
    *nconv = 0;
    if (gpu_trainer_state(t, &v, &n) != 0 || !(offs = calloc((size_t)n, sizeof(*offs))) ||
        !(from = calloc((size_t)n, sizeof(*from)))) {
        rc = GPU_ENOMEM;
        snprintf(why, whylen, "out of memory");
        goto out;
    }
    rc = GPU_EINVAL;
    for (int i = 0; i < n; i++) {
        if (match_tensor(c.h, &v[i], convert, &offs[i], &from[i], why, whylen) == 0)
            continue;
        if (!convert || strcmp(v[i].name, "fp8.scaling") != 0)
            goto out;
        /* a branch into fp8, or with another history length: its scaling starts afresh */
        offs[i] = UINT64_MAX;
    }
    gpu_trainer_get_scalars(t, &now);
    if (sc.world_size != now.world_size) {
        snprintf(why, whylen,
                 "written by a job of %d rank(s) and this one has %d "
                 "(distributed.world_size): resume it with the world size it was trained with",
                 sc.world_size, now.world_size);
        goto out;
    }
    for (int i = 0; i < n; i++) {
        uint64_t at = 8 + c.hlen + offs[i];
        if (offs[i] == UINT64_MAX)
            continue;
        rc = from[i] < 0 ? read_at(c.f, at, v[i].data, v[i].bytes)
                         : read_converted(c.f, at, &v[i], (gpu_dtype)from[i]);
        *nconv += from[i] >= 0;
        if (rc == GPU_ENOMEM) {
            snprintf(why, whylen, "out of memory");
            goto out;
        }
        if (rc) {
            snprintf(why, whylen, "cannot read it: %s", errno ? strerror(errno) : "short read");
            rc = GPU_EIO;
            goto out;
        }
    }
    rc = gpu_trainer_set_scalars(t, &sc);
    if (rc)
        snprintf(why, whylen, "the checkpoint's state does not fit this job");
out:
    free(from);
    free(offs);
    free(v);
    ckpt_close(&c);
    return rc;
}

/* ---- resuming ----------------------------------------------------------------------------- */

void daemon_ckpt_resumed_clear(daemon_ckpt_resumed *out)
{
    if (!out)
        return;
    free(out->skipped);
    out->skipped = NULL;
    out->nskipped = 0;
}

static int add_skip(daemon_ckpt_resumed *out, int64_t step, const char *path, const char *why)
{
    daemon_ckpt_skip *v = realloc(out->skipped, sizeof(*v) * (size_t)(out->nskipped + 1));
    if (!v)
        return GPU_ENOMEM;
    out->skipped = v;
    v += out->nskipped++;
    v->step = step;
    snprintf(v->path, sizeof(v->path), "%s", path);
    snprintf(v->reason, sizeof(v->reason), "%s", why);
    return 0;
}

/* One candidate: 0 loaded, 1 skipped, or a fatal error (another job's checkpoint). */
static int attempt(gpu_trainer *t, const char *path, int64_t step, daemon_ckpt_resumed *out,
                   char *err, size_t errlen)
{
    char why[400];
    int nconv;
    int rc = load(t, path, false, &out->info, &nconv, why, sizeof(why));
    if (rc == 0) {
        out->step = out->info.step;
        snprintf(out->path, sizeof(out->path), "%s", path);
        return 0;
    }
    if (rc == GPU_EIO || rc == GPU_EFORMAT) {
        out->touched |= rc == GPU_EIO; /* a read error may come after the trainer was written */
        return add_skip(out, step, path, why) ? GPU_ENOMEM : 1;
    }
    snprintf(err, errlen, "%s: %s", path, why);
    return rc;
}

/* See ckpt.h. */
int daemon_ckpt_resume(gpu_trainer *t, const char *from, daemon_ckpt_resumed *out, char *err,
                       size_t errlen)
{
    struct stat sb;
    int64_t bound = INT64_MAX, *steps = NULL;
    int n = 0, rc = 1;
    char path[1100];

    memset(out, 0, sizeof(*out));
    if (stat(from, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        snprintf(out->dir, sizeof(out->dir), "%s", from);
    } else {
        const char *slash = strrchr(from, '/');
        if (!slash)
            snprintf(out->dir, sizeof(out->dir), ".");
        else
            snprintf(out->dir, sizeof(out->dir), "%.*s", (int)(slash - from + (slash == from)),
                     from);
        if (daemon_ckpt_step_of(slash ? slash + 1 : from, &bound) != 0)
            bound = -1; /* another name: that file alone */
        rc = attempt(t, from, bound, out, err, errlen);
        if (rc <= 0 || bound < 0)
            return rc < 0 ? rc : 0;
    }
    if (daemon_ckpt_scan(out->dir, &steps, &n) != 0)
        n = 0; /* an unreadable directory has nothing older to offer */
    for (int i = n - 1; i >= 0 && rc == 1; i--) {
        if (steps[i] >= bound)
            continue;
        daemon_ckpt_path(out->dir, steps[i], path, sizeof(path));
        rc = attempt(t, path, steps[i], out, err, errlen);
    }
    free(steps);
    return rc < 0 ? rc : 0;
}

/* See ckpt.h. */
int daemon_ckpt_load_exact(gpu_trainer *t, const char *path, daemon_ckpt_resumed *out, char *err,
                           size_t errlen)
{
    char why[400];
    const char *slash = strrchr(path, '/');
    int rc;
    memset(out, 0, sizeof(*out));
    snprintf(out->dir, sizeof(out->dir), "%.*s", slash ? (int)(slash - path) : 1,
             slash ? path : ".");
    rc = load(t, path, true, &out->info, &out->converted, why, sizeof(why));
    if (rc) {
        out->touched = rc == GPU_EIO;
        snprintf(err, errlen, "%s: %s", path, why);
        return rc;
    }
    out->step = out->info.step;
    snprintf(out->path, sizeof(out->path), "%s", path);
    return 0;
}

/* ---- retention ---------------------------------------------------------------------------- */

typedef struct {
    int64_t step;
    double key;
    int idx;
} ranked;

static int by_step_desc(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    return (x->step < y->step) - (x->step > y->step);
}

static int by_key_then_newest(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    if (x->key != y->key)
        return (x->key > y->key) - (x->key < y->key);
    return by_step_desc(a, b);
}

/* See ckpt.h. */
int daemon_ckpt_retain(const daemon_ckpt_info *v, int n, int keep_last, int keep_best,
                       int64_t before, bool *keep)
{
    ranked *r = NULL;
    int m = 0;
    for (int i = 0; i < n; i++)
        keep[i] = true;
    if (keep_last <= 0 || n == 0)
        return 0;
    if (!(r = malloc(sizeof(*r) * (size_t)n)))
        return GPU_ENOMEM;
    for (int i = 0; i < n; i++) {
        keep[i] = false;
        r[i] = (ranked){.step = v[i].step, .key = 0, .idx = i};
    }
    qsort(r, (size_t)n, sizeof(*r), by_step_desc);
    for (int i = 0; i < n && i < keep_last; i++)
        keep[r[i].idx] = true;
    for (int i = 0; i < n; i++)
        if (daemon_ckpt_healthy(&v[r[i].idx])) {
            keep[r[i].idx] = true; /* the newest healthy one */
            break;
        }
    for (int i = 0; before > 0 && i < n; i++)
        if (r[i].step < before) {
            keep[r[i].idx] = true; /* the newest before the problem: a branch starts there */
            break;
        }
    for (int i = 0; i < n; i++)
        if (v[i].has_eval && isfinite(v[i].eval_loss))
            r[m++] = (ranked){.step = v[i].step, .key = v[i].eval_loss, .idx = i};
    qsort(r, (size_t)m, sizeof(*r), by_key_then_newest);
    for (int i = 0; i < m && i < keep_best; i++)
        keep[r[i].idx] = true;
    free(r);
    return 0;
}
