/*
 * spec.c - strict job-spec validation: JSON (docs/job-spec.md) to gpu_job_config.
 *
 * Every object is checked against its list of known keys first, so an unknown or misspelt
 * field is an error rather than silently ignored. Every error names the field by its
 * dotted path. Numbers: integer fields take JSON integers only; real fields take integers
 * or reals, which must be finite (JSON has no NaN, and "NaN" as a string is a type error).
 *
 * The canonical spec (api_spec_to_json) is an input too: its resolved IDX files
 * (data.train_images and the others, in pairs, instead of data.train / data.eval) and its
 * whole autocast table (precision.autocast.table, every op, instead of the overrides) are
 * parsed like the fields they stand for, so that it parses back to the same spec.
 *
 * Threads: reentrant; no global state.
 */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "api/api.h"

typedef struct {
    api_error *err;
    const api_spec_opts *opts;
} ctx;

static int fail(ctx *c, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(ctx *c, const char *field, const char *fmt, ...)
{
    va_list ap;
    snprintf(c->err->code, sizeof(c->err->code), "invalid_spec");
    snprintf(c->err->field, sizeof(c->err->field), "%s", field);
    va_start(ap, fmt);
    vsnprintf(c->err->message, sizeof(c->err->message), fmt, ap);
    va_end(ap);
    return GPU_EINVAL;
}

void api_spec_opts_default(api_spec_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->nroots = 2;
    snprintf(o->roots[0], sizeof(o->roots[0]), "/usr/share/datasets");
    snprintf(o->roots[1], sizeof(o->roots[1]), "/usr/share/games");
}

/* Reject keys of obj not in the NULL-terminated list known; path names obj. */
static int only_keys(ctx *c, json_t *obj, const char *path, const char *const *known)
{
    const char *key;
    json_t *v;
    json_object_foreach(obj, key, v)
    {
        int ok = 0;
        for (const char *const *k = known; *k; k++)
            ok |= strcmp(*k, key) == 0;
        if (!ok) {
            char f[128];
            snprintf(f, sizeof(f), "%s%s%s", path, *path ? "." : "", key);
            return fail(c, f, "unknown field");
        }
    }
    (void)v;
    return 0;
}

static int want_object(ctx *c, json_t *v, const char *field)
{
    return json_is_object(v) ? 0 : fail(c, field, "must be an object");
}

/* A range of reals; an open end excludes its bound. */
typedef struct {
    double lo, hi;
    bool lo_open, hi_open;
} range;

#define CLOSED(a, b) ((range){(a), (b), false, false})
#define ABOVE(a, b) ((range){(a), (b), true, false})  /* (a, b] */
#define BETWEEN(a, b) ((range){(a), (b), true, true}) /* (a, b) */
#define UPTO(a, b) ((range){(a), (b), false, true})   /* [a, b) */

/* Optional real in r, kept as the double the document holds (hyperparameters that PyTorch
 * keeps as Python floats); *out unchanged when absent. */
static int get_double(ctx *c, json_t *obj, const char *key, const char *field, range r,
                      double *out)
{
    json_t *v = json_object_get(obj, key);
    if (!v)
        return 0;
    if (!json_is_number(v))
        return fail(c, field, "must be a number");
    double d = json_number_value(v);
    if (!isfinite(d) || (r.lo_open ? d <= r.lo : d < r.lo) || (r.hi_open ? d >= r.hi : d > r.hi))
        return fail(c, field, "must be a finite number in %c%g, %g%c", r.lo_open ? '(' : '[', r.lo,
                    r.hi, r.hi_open ? ')' : ']');
    *out = d;
    return 0;
}

/* get_double for a value kept as a float; *out unchanged when absent. The range holds for
 * the float too: 1e-50 is in (0, 1) but its float is 0, which would print as 0 and be
 * refused when read back. */
static int get_real(ctx *c, json_t *obj, const char *key, const char *field, range r, float *out)
{
    double d = *out;
    int rc = get_double(c, obj, key, field, r, &d);
    if (rc || !json_object_get(obj, key))
        return rc;
    double f = (float)d;
    if (!isfinite(f) || (r.lo_open ? f <= r.lo : f < r.lo) || (r.hi_open ? f >= r.hi : f > r.hi))
        return fail(c, field, "must be in %c%g, %g%c as a 32-bit float (%g rounds to %g)",
                    r.lo_open ? '(' : '[', r.lo, r.hi, r.hi_open ? ')' : ']', d, f);
    *out = (float)d;
    return 0;
}

static int get_int(ctx *c, json_t *obj, const char *key, const char *field, long long lo,
                   long long hi, int64_t *out)
{
    json_t *v = json_object_get(obj, key);
    if (!v)
        return 0;
    if (!json_is_integer(v))
        return fail(c, field, "must be an integer");
    long long n = json_integer_value(v);
    if (n < lo || n > hi)
        return fail(c, field, "must be an integer in [%lld, %lld]", lo, hi);
    *out = n;
    return 0;
}

static int get_int32(ctx *c, json_t *obj, const char *key, const char *field, int lo, int hi,
                     int *out)
{
    int64_t v = *out;
    int rc = get_int(c, obj, key, field, lo, hi, &v);
    *out = (int)v;
    return rc;
}

static int get_bool(ctx *c, json_t *obj, const char *key, const char *field, bool *out)
{
    json_t *v = json_object_get(obj, key);
    if (!v)
        return 0;
    if (!json_is_boolean(v))
        return fail(c, field, "must be true or false");
    *out = json_is_true(v);
    return 0;
}

/* Optional string that must be one of the NULL-terminated choices; *idx gets its index. */
/* on_numerics's values, in gpu_on_numerics order. */
static const char *const on_numerics_names[] = {"stop", "branch", "ask", NULL};

static int get_choice(ctx *c, json_t *obj, const char *key, const char *field,
                      const char *const *choices, int *idx)
{
    json_t *v = json_object_get(obj, key);
    if (!v)
        return 0;
    if (json_is_string(v))
        for (int i = 0; choices[i]; i++)
            if (strcmp(choices[i], json_string_value(v)) == 0) {
                *idx = i;
                return 0;
            }
    char list[160] = "";
    for (int i = 0; choices[i]; i++)
        snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s\"%s\"", i ? ", " : "",
                 choices[i]);
    return fail(c, field, "must be one of %s", list);
}

static int parse_gpt(ctx *c, json_t *m, gpu_model_config *mc)
{
    static const char *const keys[] = {"type",  "n_layer",    "n_head",    "d_model", "seq_len",
                                       "vocab", "init_scale", "attention", NULL};
    static const char *const attns[] = {"materialized", "flash", NULL};
    int attn = (int)mc->attention, rc;
    if ((rc = only_keys(c, m, "model", keys)) ||
        (rc = get_choice(c, m, "attention", "model.attention", attns, &attn)) ||
        (rc = get_int32(c, m, "n_layer", "model.n_layer", 1, 96, &mc->n_layer)) ||
        (rc = get_int32(c, m, "n_head", "model.n_head", 1, 128, &mc->n_head)) ||
        (rc = get_int32(c, m, "d_model", "model.d_model", 1, 16384, &mc->d_model)) ||
        (rc = get_int32(c, m, "seq_len", "model.seq_len", 1, 65536, &mc->seq_len)) ||
        (rc = get_int32(c, m, "vocab", "model.vocab", 2, 65536, &mc->vocab)) ||
        (rc = get_real(c, m, "init_scale", "model.init_scale", ABOVE(0, 1e6), &mc->init_scale)))
        return rc;
    if (mc->d_model % mc->n_head != 0)
        return fail(c, "model.n_head", "must divide d_model (%d)", mc->d_model);
    mc->attention = (gpu_attention)attn;
    int hd = mc->d_model / mc->n_head;
    if (mc->attention == GPU_ATTN_FLASH && !gpu_flash_head_dim_ok(hd))
        return fail(c, "model.attention",
                    "\"flash\" needs a head_dim (d_model / n_head) of 16, 32, 48 or 64, not %d",
                    hd);
    return 0;
}

static int parse_mlp(ctx *c, json_t *m, gpu_model_config *mc)
{
    static const char *const keys[] = {"type", "layers", "activation", "init_scale", NULL};
    static const char *const acts[] = {"relu", "gelu", NULL};
    int act = (int)mc->activation, rc;
    json_t *layers;

    if ((rc = only_keys(c, m, "model", keys)) ||
        (rc = get_choice(c, m, "activation", "model.activation", acts, &act)) ||
        (rc = get_real(c, m, "init_scale", "model.init_scale", ABOVE(0, 1e6), &mc->init_scale)))
        return rc;
    mc->activation = (gpu_activation)act;
    layers = json_object_get(m, "layers");
    if (!layers)
        return 0;
    if (!json_is_array(layers) || json_array_size(layers) < 2 ||
        json_array_size(layers) > GPU_MAX_LAYERS)
        return fail(c, "model.layers", "must be an array of 2 to %d widths", GPU_MAX_LAYERS);
    mc->nlayers = (int)json_array_size(layers);
    for (int i = 0; i < mc->nlayers; i++) {
        json_t *w = json_array_get(layers, (size_t)i);
        char f[32];
        snprintf(f, sizeof(f), "model.layers[%d]", i);
        if (!json_is_integer(w) || json_integer_value(w) < 1 || json_integer_value(w) > 65536)
            return fail(c, f, "must be an integer width in [1, 65536]");
        mc->layers[i] = (int)json_integer_value(w);
    }
    return 0;
}

static int parse_model(ctx *c, json_t *m, gpu_model_config *mc)
{
    static const char *const types[] = {"mlp", "gpt", NULL};
    int type = (int)mc->type, rc;
    if ((rc = want_object(c, m, "model")) ||
        (rc = get_choice(c, m, "type", "model.type", types, &type)))
        return rc;
    mc->type = (gpu_model_type)type;
    return mc->type == GPU_MODEL_GPT ? parse_gpt(c, m, mc) : parse_mlp(c, m, mc);
}

/* Is path inside one of the data roots (after resolving symlinks)? */
static int inside_roots(const api_spec_opts *o, const char *real)
{
    for (int i = 0; i < o->nroots; i++) {
        char root[PATH_MAX];
        if (!realpath(o->roots[i], root))
            continue;
        size_t n = strlen(root);
        if (strncmp(real, root, n) == 0 && (real[n] == '/' || real[n] == '\0'))
            return 1;
    }
    return 0;
}

static int file_exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* Find <dir>/<prefix>-<kind>-ubyte[.gz] into out. */
static int find_idx(const char *dir, const char *prefix, const char *kind, char *out, size_t outlen)
{
    snprintf(out, outlen, "%s/%s-%s-ubyte.gz", dir, prefix, kind);
    if (file_exists(out))
        return 0;
    snprintf(out, outlen, "%s/%s-%s-ubyte", dir, prefix, kind);
    return file_exists(out) ? 0 : -1;
}

/* Resolve name (a name under a data root, or an absolute or "./" path) to the real path
 * real[PATH_MAX] of something that exists inside the data roots; else fail on field. */
static int locate(ctx *c, const char *field, const char *name, char *real)
{
    char path[PATH_MAX];
    for (int i = 0; i <= c->opts->nroots; i++) {
        if (i == c->opts->nroots) {
            if (name[0] != '/' && strncmp(name, "./", 2) != 0)
                break;
            snprintf(path, sizeof(path), "%s", name);
        } else if (strchr(name, '/') == NULL && strcmp(name, "..") != 0) {
            snprintf(path, sizeof(path), "%s/%s", c->opts->roots[i], name);
        } else {
            continue;
        }
        if (!realpath(path, real))
            continue;
        if (!inside_roots(c->opts, real))
            return fail(c, field, "path \"%s\" is outside the data roots", name);
        return 0;
    }
    if (name[0] == '/' || strchr(name, '/'))
        return fail(c, field, "path \"%s\" is outside the data roots or does not exist", name);
    return fail(c, field, "unknown dataset \"%s\" (looked in %s%s)", name, c->opts->roots[0],
                c->opts->nroots > 1 ? " and the other data roots" : "");
}

/* Resolve the path of a data file (absolute or "./", inside the data roots, a regular file
 * once symlinks are followed) into out[len], which may be path itself; else fail on field. */
static int resolve_file(ctx *c, const char *field, const char *path, char *out, size_t len)
{
    char real[PATH_MAX];
    struct stat st;
    int rc;

    if (!path[0] || strlen(path) >= 512)
        return fail(c, field, "must be the path of a file inside the data roots");
    if ((rc = locate(c, field, path, real)) != 0)
        return rc;
    if (stat(real, &st) != 0 || !S_ISREG(st.st_mode))
        return fail(c, field, "%s is not a regular file", real);
    if (strlen(real) >= len)
        return fail(c, field, "path \"%s\" is too long", real);
    snprintf(out, len, "%s", real);
    return 0;
}

/* Resolve "name[:split]" or a directory path to the image and label files of a split. */
static int resolve_dataset(ctx *c, const char *field, const char *spec, const char *dflt_split,
                           char *images, char *labels, size_t len)
{
    char name[512], real[PATH_MAX];
    const char *split = dflt_split, *colon = strrchr(spec, ':');
    size_t n = colon ? (size_t)(colon - spec) : strlen(spec);
    int rc;

    if (n == 0 || n >= sizeof(name))
        return fail(c, field, "must name a dataset, e.g. \"fashion-mnist\"");
    memcpy(name, spec, n);
    name[n] = '\0';
    if (colon)
        split = colon + 1;
    if (strcmp(split, "train") != 0 && strcmp(split, "test") != 0)
        return fail(c, field, "unknown split \"%s\": use \"train\" or \"test\"", split);
    const char *prefix = strcmp(split, "train") == 0 ? "train" : "t10k";
    if ((rc = locate(c, field, name, real)) != 0)
        return rc;
    if (find_idx(real, prefix, "images-idx3", images, len) != 0 ||
        find_idx(real, prefix, "labels-idx1", labels, len) != 0)
        return fail(c, field, "no %s-images-idx3-ubyte[.gz] and %s-labels-idx1-ubyte[.gz] in %s",
                    prefix, prefix, real);
    /* the files themselves resolved too (a symlink in the directory), as data.train_images
     * and the others resolve them when a canonical spec is submitted back */
    if ((rc = resolve_file(c, field, images, images, len)) != 0)
        return rc;
    return resolve_file(c, field, labels, labels, len);
}

/* Resolve a text or token source (a file; for text also a directory) into out[len]. */
static int resolve_seq(ctx *c, const char *field, const char *spec, bool text, char *out,
                       size_t len)
{
    char real[PATH_MAX];
    struct stat st;
    int rc;

    if (!spec[0] || strlen(spec) >= 512)
        return fail(c, field, "must name a %s inside the data roots",
                    text ? "text file or directory" : "token file");
    if ((rc = locate(c, field, spec, real)) != 0)
        return rc;
    if (stat(real, &st) != 0 || !(S_ISREG(st.st_mode) || (text && S_ISDIR(st.st_mode))))
        return fail(c, field, "%s is not a %s", real,
                    text ? "regular file or a directory" : "regular file (an llm.c .bin shard)");
    if (strlen(real) >= len)
        return fail(c, field, "path \"%s\" is too long", real);
    snprintf(out, len, "%s", real);
    return 0;
}

/* data.type "text" and "tokens": train, eval, val_fraction. */
static int parse_seq_data(ctx *c, json_t *d, gpu_data_config *dc)
{
    static const char *const other[] = {"features", "classes", "train_size", "eval_size", NULL};
    static const char *const idx_only[] = {"train_images", "train_labels", "eval_images",
                                           "eval_labels", NULL};
    bool text = dc->type == GPU_DATA_TEXT;
    const char *kind = text ? "text" : "tokens";
    json_t *train = json_object_get(d, "train"), *eval = json_object_get(d, "eval");
    int rc;

    for (const char *const *k = other; *k; k++)
        if (json_object_get(d, *k)) {
            char f[64];
            snprintf(f, sizeof(f), "data.%s", *k);
            return fail(c, f, "only for \"synthetic\" data");
        }
    for (const char *const *k = idx_only; *k; k++)
        if (json_object_get(d, *k)) {
            char f[64];
            snprintf(f, sizeof(f), "data.%s", *k);
            return fail(c, f, "only for \"idx\" data");
        }
    if (!train)
        return fail(c, "data.train", "is required for \"%s\" data: a %s inside the data roots",
                    kind, text ? "text file or directory" : "token file");
    if (!json_is_string(train))
        return fail(c, "data.train", "must be a dataset name or path");
    if (eval && !json_is_string(eval) && !json_is_null(eval))
        return fail(c, "data.eval", "must be a dataset name, a path or null");
    if (!(dc->val_fraction > 0 && dc->val_fraction < 1))
        dc->val_fraction = 0.1f;
    if ((rc = get_real(c, d, "val_fraction", "data.val_fraction", BETWEEN(0, 1),
                       &dc->val_fraction)) != 0)
        return rc;
    if ((rc = resolve_seq(c, "data.train", json_string_value(train), text, dc->seq_train,
                          sizeof(dc->seq_train))) != 0)
        return rc;
    dc->seq_eval[0] = '\0';
    if (!eval || json_is_null(eval))
        return 0;
    if (json_object_get(d, "val_fraction"))
        return fail(c, "data.val_fraction", "is not used when data.eval is given");
    return resolve_seq(c, "data.eval", json_string_value(eval), text, dc->seq_eval,
                       sizeof(dc->seq_eval));
}

/* data.<kind>_images and data.<kind>_labels (kind "train" or "eval"), the resolved files
 * of the canonical spec: both or neither, and not with data.<kind>; both null for no eval
 * set (images and labels then empty). *given tells. */
static int parse_idx_files(ctx *c, json_t *d, const char *kind, char *images, char *labels,
                           size_t len, bool *given)
{
    char fi[32], fl[32];
    json_t *vi, *vl;
    int rc;

    snprintf(fi, sizeof(fi), "%s_images", kind);
    snprintf(fl, sizeof(fl), "%s_labels", kind);
    vi = json_object_get(d, fi);
    vl = json_object_get(d, fl);
    *given = vi || vl;
    if (!*given)
        return 0;
    snprintf(fi, sizeof(fi), "data.%s_images", kind);
    snprintf(fl, sizeof(fl), "data.%s_labels", kind);
    if (!vi || !vl)
        return fail(c, vi ? fl : fi, "is required with %s (the two files of a split)",
                    vi ? fi : fl);
    if (json_object_get(d, kind))
        return fail(c, fi, "names the files of data.%s: give one or the other", kind);
    if (strcmp(kind, "eval") == 0 && json_is_null(vi) != json_is_null(vl))
        return fail(c, json_is_null(vi) ? fi : fl, "is null (no eval set) only with %s null",
                    json_is_null(vi) ? fl : fi);
    if (strcmp(kind, "eval") == 0 && json_is_null(vi)) {
        images[0] = labels[0] = '\0';
        return 0;
    }
    if (!json_is_string(vi))
        return fail(c, fi, "must be the path of an IDX file inside the data roots");
    if (!json_is_string(vl))
        return fail(c, fl, "must be the path of an IDX file inside the data roots");
    if ((rc = resolve_file(c, fi, json_string_value(vi), images, len)) != 0)
        return rc;
    return resolve_file(c, fl, json_string_value(vl), labels, len);
}

static int parse_data(ctx *c, json_t *d, gpu_data_config *dc)
{
    static const char *const keys[] = {
        "type",        "train",       "eval",         "features",     "classes",
        "train_size",  "eval_size",   "val_fraction", "train_images", "train_labels",
        "eval_images", "eval_labels", "shuffle",      "skip_batches", NULL};
    bool train_files, eval_files, shuffle = !dc->in_order;
    /* in gpu_data_type's order */
    static const char *const types[] = {"idx", "synthetic", "text", "tokens", NULL};
    int type = (int)dc->type, rc;
    json_t *train, *eval;

    if ((rc = want_object(c, d, "data")) || (rc = only_keys(c, d, "data", keys)) ||
        (rc = get_choice(c, d, "type", "data.type", types, &type)))
        return rc;
    dc->type = (gpu_data_type)type;
    if ((rc = get_int(c, d, "skip_batches", "data.skip_batches", 0, 10000000, &dc->skip_batches)) ||
        (rc = get_bool(c, d, "shuffle", "data.shuffle", &shuffle)))
        return rc;
    dc->in_order = !shuffle;
    if (dc->type == GPU_DATA_TEXT || dc->type == GPU_DATA_TOKENS) {
        if (json_object_get(d, "shuffle"))
            return fail(c, "data.shuffle",
                        "only for \"idx\" and \"synthetic\" data (text and token batches are "
                        "windows at random places)");
        return parse_seq_data(c, d, dc);
    }
    if (json_object_get(d, "val_fraction"))
        return fail(c, "data.val_fraction", "only for \"text\" and \"tokens\" data");
    if (dc->type == GPU_DATA_SYNTHETIC) {
        static const char *const files[] = {"train",        "eval",        "train_images",
                                            "train_labels", "eval_images", "eval_labels",
                                            NULL};
        for (const char *const *k = files; *k; k++)
            if (json_object_get(d, *k)) {
                char f[64];
                snprintf(f, sizeof(f), "data.%s", *k);
                return fail(c, f,
                            "synthetic data takes features, classes, train_size and eval_size");
            }
        if ((rc = get_int32(c, d, "features", "data.features", 1, 65536, &dc->synth_features)) ||
            (rc = get_int32(c, d, "classes", "data.classes", 2, 256, &dc->synth_classes)) ||
            (rc = get_int32(c, d, "train_size", "data.train_size", 1, 10000000,
                            &dc->synth_train)) ||
            (rc = get_int32(c, d, "eval_size", "data.eval_size", 0, 10000000, &dc->synth_eval)))
            return rc;
        /* classes not given is the model's last width, which must be a valid count too (else
         * the canonical spec, which gives it, would be refused) */
        if (dc->synth_classes < 2 || dc->synth_classes > 256)
            return fail(c, "data.classes",
                        "is %d (the model's last width): synthetic data has 2 to 256 classes",
                        dc->synth_classes);
        return 0;
    }
    for (const char *const *k = keys + 3; *k && strcmp(*k, "val_fraction") != 0; k++)
        if (json_object_get(d, *k)) {
            char f[64];
            snprintf(f, sizeof(f), "data.%s", *k);
            return fail(c, f, "only for \"synthetic\" data");
        }
    train = json_object_get(d, "train");
    eval = json_object_get(d, "eval");
    if (train && !json_is_string(train))
        return fail(c, "data.train", "must be a dataset name or path");
    if (eval && !json_is_string(eval) && !json_is_null(eval))
        return fail(c, "data.eval", "must be a dataset name, a path or null");
    dc->eval_images[0] = dc->eval_labels[0] = '\0';
    if ((rc = parse_idx_files(c, d, "train", dc->train_images, dc->train_labels,
                              sizeof(dc->train_images), &train_files)) != 0 ||
        (rc = parse_idx_files(c, d, "eval", dc->eval_images, dc->eval_labels,
                              sizeof(dc->eval_images), &eval_files)) != 0)
        return rc;
    char tr[520], ev[540];
    snprintf(tr, sizeof(tr), "%s", train ? json_string_value(train) : "fashion-mnist");
    if (!train_files && (rc = resolve_dataset(c, "data.train", tr, "train", dc->train_images,
                                              dc->train_labels, sizeof(dc->train_images))) != 0)
        return rc;
    /* no eval set: eval null, or training files without an eval split (the canonical form
     * of a job without one) */
    if (eval_files || (eval && json_is_null(eval)) || (train_files && !eval))
        return 0;
    if (eval) {
        snprintf(ev, sizeof(ev), "%s", json_string_value(eval));
    } else {
        char *colon = strrchr(tr, ':');
        if (colon)
            *colon = '\0';
        snprintf(ev, sizeof(ev), "%s:test", tr);
    }
    return resolve_dataset(c, "data.eval", ev, "test", dc->eval_images, dc->eval_labels,
                           sizeof(dc->eval_images));
}

static int parse_scaler(ctx *c, json_t *ls, gpu_scaler_config *s)
{
    static const char *const keys[] = {
        "mode",       "init",      "growth_factor", "backoff_factor", "growth_interval",
        "hysteresis", "min_scale", "max_scale",     "floor_patience", NULL};
    static const char *const modes[] = {"none", "static", "dynamic", NULL};
    int mode = (int)s->mode, rc;
    const char *field = NULL;
    const float big = 3.0e38f;

    if ((rc = want_object(c, ls, "precision.loss_scale")) ||
        (rc = only_keys(c, ls, "precision.loss_scale", keys)) ||
        (rc = get_choice(c, ls, "mode", "precision.loss_scale.mode", modes, &mode)) ||
        (rc =
             get_real(c, ls, "init", "precision.loss_scale.init", ABOVE(0, big), &s->init_scale)) ||
        (rc = get_double(c, ls, "growth_factor", "precision.loss_scale.growth_factor",
                         ABOVE(1, big), &s->growth_factor)) ||
        (rc = get_double(c, ls, "backoff_factor", "precision.loss_scale.backoff_factor",
                       BETWEEN(0, 1), &s->backoff_factor)) ||
        (rc = get_int32(c, ls, "growth_interval", "precision.loss_scale.growth_interval", 1,
                        INT_MAX, &s->growth_interval)) ||
        (rc = get_int32(c, ls, "hysteresis", "precision.loss_scale.hysteresis", 1, 1000000,
                        &s->hysteresis)) ||
        (rc = get_real(c, ls, "min_scale", "precision.loss_scale.min_scale", ABOVE(0, big),
                       &s->min_scale)) ||
        (rc = get_real(c, ls, "max_scale", "precision.loss_scale.max_scale", ABOVE(0, big),
                       &s->max_scale)) ||
        (rc = get_int32(c, ls, "floor_patience", "precision.loss_scale.floor_patience", 1, INT_MAX,
                        &s->floor_patience)))
        return rc;
    s->mode = (gpu_scale_mode)mode;
    if (gpu_scaler_validate(s, &field) != 0)
        return fail(c, field ? field : "precision.loss_scale",
                    "is out of range (growth_factor > 1, backoff_factor in (0,1), "
                    "0 < min_scale <= init <= max_scale)");
    return 0;
}

/* One op's policy v at field f into *p. An fp8 job's linear layers run in fp8, which its
 * table names "fp8" ("lowp" too, as the other dtypes' tables write it: a spec cloned from
 * one); the other ops and jobs take the three policies. */
static int parse_policy(ctx *c, const char *f, gpu_op o, json_t *v, bool fp8, gpu_cast_policy *p)
{
    const char *s = json_is_string(v) ? json_string_value(v) : NULL;
    bool fp8_linear = fp8 && o == GPU_OP_LINEAR;
    if (s && strcmp(s, "fp8") == 0 && fp8_linear) {
        *p = GPU_CAST_LOWP;
        return 0;
    }
    if (s && strcmp(s, "fp8") == 0)
        return fail(c, f,
                    o == GPU_OP_LINEAR ? "is \"fp8\" in an fp8 job only (precision.dtype \"fp8\")"
                                       : "fp8 runs the linear layers' GEMMs only: \"lowp\", "
                                         "\"fp32\" or \"input\"");
    if (!s || gpu_cast_policy_parse(s, p) != 0)
        return fail(c, f,
                    fp8_linear ? "must be \"fp8\" (an fp8 job's linear layers)"
                               : "must be \"lowp\", \"fp32\" or \"input\"");
    if (fp8_linear && *p != GPU_CAST_LOWP)
        return fail(c, f,
                    "must be \"fp8\": an fp8 job runs its linear layers in fp8 (keep a layer "
                    "in bf16 with precision.fp8.keep, or use precision.dtype \"bf16\")");
    return 0;
}

/* An object of op: policy at field (overrides or table) into a; *seen counts the ops. */
static int parse_policies(ctx *c, json_t *obj, const char *field, bool fp8, gpu_autocast *a,
                          int *seen)
{
    json_t *v;
    const char *op;
    int rc;

    *seen = 0;
    if (!json_is_object(obj))
        return fail(c, field, "must be an object of op: policy");
    json_object_foreach(obj, op, v)
    {
        char f[128];
        gpu_op o;
        gpu_cast_policy p;
        snprintf(f, sizeof(f), "%s.%s", field, op);
        if (gpu_op_parse(op, &o) != 0)
            return fail(c, f, "unknown op (see GET /v1/system for the autocast table)");
        if ((rc = parse_policy(c, f, o, v, fp8, &p)))
            return rc;
        a->policy[o] = p;
        (*seen)++;
    }
    return 0;
}

/* precision.autocast: overrides (the ops named change, the others keep their default), or
 * table, the whole table as the canonical spec prints it (every op, no overrides). */
static int parse_autocast(ctx *c, json_t *ac, bool fp8, gpu_autocast *a)
{
    static const char *const keys[] = {"overrides", "table", NULL};
    json_t *ov, *table;
    gpu_autocast t;
    int rc, seen;

    if ((rc = want_object(c, ac, "precision.autocast")) ||
        (rc = only_keys(c, ac, "precision.autocast", keys)))
        return rc;
    ov = json_object_get(ac, "overrides");
    table = json_object_get(ac, "table");
    if (ov && table)
        return fail(c, "precision.autocast.table",
                    "is the whole table: give it or overrides, not both");
    if (ov)
        return parse_policies(c, ov, "precision.autocast.overrides", fp8, a, &seen);
    if (!table)
        return 0;
    t = *a;
    if ((rc = parse_policies(c, table, "precision.autocast.table", fp8, &t, &seen)) != 0)
        return rc;
    for (int i = 0; seen < GPU_OP_COUNT && i < GPU_OP_COUNT; i++)
        if (!json_object_get(table, gpu_op_name((gpu_op)i)))
            return fail(c, "precision.autocast.table",
                        "lists every op (\"%s\" is missing); to change some ops only, use "
                        "precision.autocast.overrides",
                        gpu_op_name((gpu_op)i));
    *a = t;
    return 0;
}

/* precision.fp8.accumulator: {"mantissa_bits", "promote_every"}. */
static int parse_fp8_acc(ctx *c, json_t *a, gpu_fp8_acc *acc)
{
    static const char *const keys[] = {"mantissa_bits", "promote_every", NULL};
    const char *f = "precision.fp8.accumulator";
    int rc;
    if ((rc = want_object(c, a, f)) || (rc = only_keys(c, a, f, keys)) ||
        (rc = get_int32(c, a, "mantissa_bits", "precision.fp8.accumulator.mantissa_bits", 0, 23,
                        &acc->bits)) ||
        (rc = get_int32(c, a, "promote_every", "precision.fp8.accumulator.promote_every", 1,
                        1 << 20, &acc->promote)))
        return rc;
    return 0;
}

/* precision.fp8.keep: the layers whose GEMMs stay in bf16 (checked against the model when it
 * is planned). */
static int parse_fp8_keep(ctx *c, json_t *a, gpu_fp8_config *f)
{
    size_t i;
    json_t *v;
    if (!json_is_array(a) || json_array_size(a) > GPU_FP8_MAX_KEEP)
        return fail(c, "precision.fp8.keep", "must be an array of at most %d layer names",
                    GPU_FP8_MAX_KEEP);
    f->nkeep = 0;
    json_array_foreach(a, i, v)
    {
        const char *s = json_string_value(v);
        char field[64];
        snprintf(field, sizeof(field), "precision.fp8.keep[%zu]", i);
        if (!s || !*s || strlen(s) >= sizeof(f->keep[0]))
            return fail(c, field, "must be a layer's name (\"fc1\"), 1 to %zu characters",
                        sizeof(f->keep[0]) - 1);
        for (int k = 0; k < f->nkeep; k++)
            if (strcmp(f->keep[k], s) == 0)
                return fail(c, field, "names \"%s\" twice", s);
        snprintf(f->keep[f->nkeep++], sizeof(f->keep[0]), "%s", s);
    }
    return 0;
}

/* The first of a recipe's fields present in o that the other recipe does not take. */
static const char *other_recipes_field(json_t *o, gpu_fp8_recipe r)
{
    static const char *const delayed[] = {"margin", "amax_history_len", "amax_compute_algo", NULL};
    static const char *const current[] = {"amax_epsilon", NULL};
    const char *const *wrong = r == GPU_FP8_DELAYED ? current : delayed;
    for (int i = 0; wrong[i]; i++)
        if (json_object_get(o, wrong[i]))
            return wrong[i];
    return NULL;
}

/* precision.fp8 (docs/fp8.md): the recipe and its fields. */
static int parse_fp8(ctx *c, json_t *o, gpu_fp8_config *f)
{
    static const char *const keys[] = {
        "recipe",      "format", "margin", "amax_history_len", "amax_compute_algo", "amax_epsilon",
        "accumulator", "keep",   NULL};
    static const char *const recipes[] = {"delayed", "current", NULL};
    static const char *const formats[] = {"hybrid", "e4m3", NULL};
    static const char *const algos[] = {"max", "most_recent", NULL};
    int recipe = (int)f->recipe, format = (int)f->format, algo = (int)f->amax_algo, rc;
    const char *wrong;
    char field[64];
    json_t *v;

    if ((rc = want_object(c, o, "precision.fp8")) ||
        (rc = only_keys(c, o, "precision.fp8", keys)) ||
        (rc = get_choice(c, o, "recipe", "precision.fp8.recipe", recipes, &recipe)) ||
        (rc = get_choice(c, o, "format", "precision.fp8.format", formats, &format)) ||
        (rc = get_choice(c, o, "amax_compute_algo", "precision.fp8.amax_compute_algo", algos,
                         &algo)) ||
        (rc = get_int32(c, o, "margin", "precision.fp8.margin", 0, 64, &f->margin)) ||
        (rc = get_int32(c, o, "amax_history_len", "precision.fp8.amax_history_len", 1, 16384,
                        &f->amax_history_len)) ||
        (rc = get_real(c, o, "amax_epsilon", "precision.fp8.amax_epsilon", CLOSED(0, 3e38),
                       &f->amax_epsilon)))
        return rc;
    f->recipe = (gpu_fp8_recipe)recipe;
    f->format = (gpu_fp8_formats)format;
    f->amax_algo = (gpu_fp8_amax_algo)algo;
    if ((wrong = other_recipes_field(o, f->recipe))) {
        snprintf(field, sizeof(field), "precision.fp8.%s", wrong);
        return fail(c, field, "belongs to the %s recipe, and this one is \"%s\"",
                    f->recipe == GPU_FP8_DELAYED ? "current" : "delayed", recipes[recipe]);
    }
    if ((v = json_object_get(o, "accumulator")) && (rc = parse_fp8_acc(c, v, &f->acc)))
        return rc;
    if ((v = json_object_get(o, "keep")) && (rc = parse_fp8_keep(c, v, f)))
        return rc;
    return 0;
}

static int parse_precision(ctx *c, json_t *p, gpu_job_config *jc)
{
    static const char *const keys[] = {"dtype", "master_weights", "loss_scale", "autocast", "fp8",
                                       NULL};
    static const char *const dtypes[] = {"fp32", "fp16", "bf16", "fp8", NULL};
    int dt = jc->fp8.on ? 3 : (int)jc->dtype, rc;
    json_t *v;

    if ((rc = want_object(c, p, "precision")) || (rc = only_keys(c, p, "precision", keys)) ||
        (rc = get_choice(c, p, "dtype", "precision.dtype", dtypes, &dt)) ||
        (rc = get_bool(c, p, "master_weights", "precision.master_weights", &jc->master_weights)))
        return rc;
    /* an fp8 job's other ops run in bf16, as under Transformer Engine with bf16 autocast */
    jc->fp8.on = dt == 3;
    jc->dtype = jc->fp8.on ? GPU_BF16 : (gpu_dtype)dt;
    gpu_scaler_defaults(&jc->scaler, jc->dtype);
    if ((v = json_object_get(p, "fp8")) && !jc->fp8.on)
        return fail(c, "precision.fp8", "is the fp8 recipe: it needs precision.dtype \"fp8\"");
    if (v && (rc = parse_fp8(c, v, &jc->fp8)))
        return rc;
    if ((v = json_object_get(p, "loss_scale")) && (rc = parse_scaler(c, v, &jc->scaler)))
        return rc;
    if ((v = json_object_get(p, "autocast")) &&
        (rc = parse_autocast(c, v, jc->fp8.on, &jc->autocast)))
        return rc;
    return 0;
}

static int parse_optimizer(ctx *c, json_t *o, gpu_optim_config *oc)
{
    static const char *const keys[] = {"type",     "lr",           "betas",     "eps",
                                       "momentum", "weight_decay", "grad_clip", "warmup_steps",
                                       "schedule", "min_lr_ratio", NULL};
    static const char *const types[] = {"adamw", "sgd", NULL};
    static const char *const scheds[] = {"constant", "cosine", "linear", NULL};
    int type = (int)oc->type, sched = (int)oc->schedule, rc;
    const char *field = NULL;
    json_t *betas;

    if ((rc = want_object(c, o, "optimizer")) || (rc = only_keys(c, o, "optimizer", keys)) ||
        (rc = get_choice(c, o, "type", "optimizer.type", types, &type)) ||
        (rc = get_choice(c, o, "schedule", "optimizer.schedule", scheds, &sched)) ||
        (rc = get_double(c, o, "lr", "optimizer.lr", ABOVE(0, 1e6), &oc->lr)) ||
        (rc = get_double(c, o, "eps", "optimizer.eps", ABOVE(0, 1), &oc->eps)) ||
        (rc = get_double(c, o, "momentum", "optimizer.momentum", UPTO(0, 1), &oc->momentum)) ||
        (rc = get_double(c, o, "weight_decay", "optimizer.weight_decay", CLOSED(0, 1e6),
                       &oc->weight_decay)) ||
        (rc =
             get_real(c, o, "grad_clip", "optimizer.grad_clip", CLOSED(0, 3e38), &oc->grad_clip)) ||
        (rc = get_int32(c, o, "warmup_steps", "optimizer.warmup_steps", 0, INT_MAX,
                        &oc->warmup_steps)) ||
        (rc = get_real(c, o, "min_lr_ratio", "optimizer.min_lr_ratio", CLOSED(0, 1),
                       &oc->min_lr_ratio)))
        return rc;
    oc->type = (gpu_opt_type)type;
    oc->schedule = (gpu_sched)sched;
    betas = json_object_get(o, "betas");
    if (betas) {
        if (!json_is_array(betas) || json_array_size(betas) != 2 ||
            !json_is_number(json_array_get(betas, 0)) || !json_is_number(json_array_get(betas, 1)))
            return fail(c, "optimizer.betas", "must be an array of two numbers in [0, 1)");
        oc->beta1 = json_number_value(json_array_get(betas, 0));
        oc->beta2 = json_number_value(json_array_get(betas, 1));
    }
    if (gpu_optim_validate(oc, &field) != 0)
        return fail(c, field ? field : "optimizer",
                    "is out of range (lr > 0, betas in [0, 1), eps > 0, momentum in [0, 1))");
    return 0;
}

/* distributed.hosts: mpirun's host list, "name" or "name:slots" each. */
static int parse_hosts(ctx *c, json_t *v, gpu_dist_config *d)
{
    char field[64];
    size_t i;
    json_t *h;
    if (!json_is_array(v) || json_array_size(v) < 1 || json_array_size(v) > GPU_MAX_HOSTS)
        return fail(c, "distributed.hosts", "must be an array of 1 to %d host names",
                    GPU_MAX_HOSTS);
    json_array_foreach(v, i, h)
    {
        const char *s = json_string_value(h);
        snprintf(field, sizeof(field), "distributed.hosts[%zu]", i);
        if (!s || !*s || strlen(s) >= sizeof(d->hosts[0]) ||
            strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:") !=
                strlen(s) ||
            s[0] == '-')
            return fail(c, field, "must be a host name, or \"name:slots\" (letters, digits, "
                                  "'.', '-', '_')");
        snprintf(d->hosts[i], sizeof(d->hosts[i]), "%s", s);
    }
    d->nhosts = (int)json_array_size(v);
    return 0;
}

/* An optional string of at most len - 1 characters from chars (a Slurm name or time). */
static int get_word(ctx *c, json_t *obj, const char *key, const char *field, const char *chars,
                    char *out, size_t len)
{
    json_t *v = json_object_get(obj, key);
    const char *s = json_string_value(v);
    if (!v)
        return 0;
    if (!s || !*s || strlen(s) >= len || strspn(s, chars) != strlen(s) || s[0] == '-')
        return fail(c, field, "must be a string of 1 to %zu characters from \"%s\"", len - 1,
                    chars);
    snprintf(out, len, "%s", s);
    return 0;
}

#define NAME_CHARS "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"

/* distributed.slurm: what srun asks Slurm for. */
static int parse_slurm(ctx *c, json_t *v, gpu_dist_config *d)
{
    static const char *const keys[] = {"nodes",     "tasks_per_node", "cpus_per_task",
                                       "gpus_per_task", "partition",  "account",
                                       "time",      NULL};
    gpu_slurm_config *sl = &d->slurm;
    int rc;
    if ((rc = want_object(c, v, "distributed.slurm")) ||
        (rc = only_keys(c, v, "distributed.slurm", keys)) ||
        (rc = get_int32(c, v, "nodes", "distributed.slurm.nodes", 1, 1024, &sl->nodes)) ||
        (rc = get_int32(c, v, "tasks_per_node", "distributed.slurm.tasks_per_node", 1, 1024,
                        &sl->tasks_per_node)) ||
        (rc = get_int32(c, v, "cpus_per_task", "distributed.slurm.cpus_per_task", 1, 4096,
                        &sl->cpus_per_task)) ||
        (rc = get_int32(c, v, "gpus_per_task", "distributed.slurm.gpus_per_task", 0, 64,
                        &sl->gpus_per_task)) ||
        (rc = get_word(c, v, "partition", "distributed.slurm.partition", NAME_CHARS,
                       sl->partition, sizeof(sl->partition))) ||
        (rc = get_word(c, v, "account", "distributed.slurm.account", NAME_CHARS, sl->account,
                       sizeof(sl->account))) ||
        (rc = get_word(c, v, "time", "distributed.slurm.time", "0123456789:-", sl->time,
                       sizeof(sl->time))))
        return rc;
    return 0;
}

/* The launcher's fields agree with each other and with world_size. */
static int check_launcher(ctx *c, json_t *v, const gpu_dist_config *d)
{
    const gpu_slurm_config *sl = &d->slurm;
    if (d->launcher == GPU_LAUNCH_MPIRUN && json_object_get(v, "slurm"))
        return fail(c, "distributed.slurm", "applies to launcher \"slurm\" only");
    if (d->launcher == GPU_LAUNCH_SLURM && d->nhosts > 0)
        return fail(c, "distributed.hosts",
                    "is mpirun's host list; under Slurm the nodes are Slurm's to choose "
                    "(distributed.slurm.nodes says how many)");
    if (sl->nodes > d->world_size)
        return fail(c, "distributed.slurm.nodes", "is %d, more nodes than the %d ranks",
                    sl->nodes, d->world_size);
    if (sl->tasks_per_node > 0 && sl->nodes > 0 && sl->nodes * sl->tasks_per_node != d->world_size)
        return fail(c, "distributed.slurm.tasks_per_node",
                    "%d nodes x %d tasks per node is not distributed.world_size %d", sl->nodes,
                    sl->tasks_per_node, d->world_size);
    if (sl->tasks_per_node > 0 && sl->nodes == 0 && d->world_size % sl->tasks_per_node != 0)
        return fail(c, "distributed.slurm.tasks_per_node",
                    "%d does not divide distributed.world_size %d", sl->tasks_per_node,
                    d->world_size);
    return 0;
}

static int parse_distributed(ctx *c, json_t *v, gpu_dist_config *d)
{
    static const char *const keys[] = {"world_size",    "comm_hook",      "bucket_mb", "hosts",
                                       "oversubscribe", "rank_timeout_s", "launcher",  "slurm",
                                       NULL};
    static const char *const hooks[] = {"none", "fp16", "bf16", NULL};
    static const char *const launchers[] = {"default", "mpirun", "slurm", NULL};
    int hook = (int)d->hook, launcher = (int)d->launcher, rc;
    float mb = (float)d->bucket_mb;
    json_t *h;
    if ((rc = want_object(c, v, "distributed")) || (rc = only_keys(c, v, "distributed", keys)) ||
        (rc = get_int32(c, v, "world_size", "distributed.world_size", 1, 1024, &d->world_size)) ||
        (rc = get_choice(c, v, "comm_hook", "distributed.comm_hook", hooks, &hook)) ||
        (rc = get_real(c, v, "bucket_mb", "distributed.bucket_mb", ABOVE(0, 1024), &mb)) ||
        ((h = json_object_get(v, "hosts")) && (rc = parse_hosts(c, h, d))) ||
        (rc = get_bool(c, v, "oversubscribe", "distributed.oversubscribe", &d->oversubscribe)) ||
        (rc = get_int32(c, v, "rank_timeout_s", "distributed.rank_timeout_s", 5, 86400,
                        &d->rank_timeout_s)) ||
        (rc = get_choice(c, v, "launcher", "distributed.launcher", launchers, &launcher)) ||
        ((h = json_object_get(v, "slurm")) && (rc = parse_slurm(c, h, d))))
        return rc;
    d->hook = (gpu_comm_hook)hook;
    d->bucket_mb = mb;
    d->launcher = (gpu_launcher)launcher;
    if ((rc = check_launcher(c, v, d)))
        return rc;
    if (d->world_size > 1 && !gpu_comm_available())
        return fail(c, "distributed.world_size",
                    "this ampd was built without MPI, so a job has one rank (install Debian's "
                    "openmpi-bin and libopenmpi-dev and build again)");
    return 0;
}

/* resources: what the daemon holds for the job (the scheduler derives what is not said). */
static int parse_resources(ctx *c, json_t *v, gpu_resources *r)
{
    static const char *const keys[] = {"cpus", "devices", "memory_mb", NULL};
    int rc;
    if ((rc = want_object(c, v, "resources")) || (rc = only_keys(c, v, "resources", keys)) ||
        (rc = get_int32(c, v, "cpus", "resources.cpus", 0, 4096, &r->cpus)) ||
        (rc = get_int32(c, v, "devices", "resources.devices", 0, GPU_MAX_CUDA_DEVICES,
                        &r->devices)) ||
        (rc = get_int(c, v, "memory_mb", "resources.memory_mb", 0, 1LL << 40, &r->memory_mb)))
        return rc;
    return 0;
}

#define DEVICE_MSG "must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\" with N from 0 to %d"

/* "auto", "cpu", "cuda" or "cuda:N" with N a decimal below GPU_MAX_CUDA_DEVICES. Whether
 * the device exists is the trainer's question, when the job starts. */
static int parse_device(ctx *c, json_t *v, gpu_job_config *jc)
{
    const char *s = json_string_value(v);
    char *end = NULL;
    if (!json_is_string(v))
        return fail(c, "device", DEVICE_MSG, GPU_MAX_CUDA_DEVICES - 1);
    if (strcmp(s, "auto") && strcmp(s, "cpu") && strcmp(s, "cuda")) {
        long n = -1;
        if (strncmp(s, "cuda:", 5) == 0 && s[5] >= '0' && s[5] <= '9')
            n = strtol(s + 5, &end, 10);
        if (n < 0 || n >= GPU_MAX_CUDA_DEVICES || *end || strlen(s) >= sizeof(jc->device))
            return fail(c, "device", DEVICE_MSG, GPU_MAX_CUDA_DEVICES - 1);
    }
    snprintf(jc->device, sizeof(jc->device), "%s", s);
    return 0;
}

/* See api.h. */
int api_spec_device(const char *dev, gpu_job_config *c, api_error *err)
{
    ctx cx = {err, NULL};
    json_t *v = json_string(dev);
    int rc = v ? parse_device(&cx, v, c) : GPU_ENOMEM;
    json_decref(v);
    return rc;
}

/* In msg, every occurrence of path replaced by name. */
static void rename_path(char *msg, size_t len, const char *path, const char *name)
{
    char out[1024];
    size_t k = 0, n = strlen(path);
    const char *p = msg;
    if (!path[0] || !strcmp(path, name))
        return;
    while (*p && k + 1 < sizeof(out)) {
        if (strncmp(p, path, n) == 0) {
            k += (size_t)snprintf(out + k, sizeof(out) - k, "%s", name);
            k = k < sizeof(out) ? k : sizeof(out) - 1;
            p += n;
        } else {
            out[k++] = *p++;
        }
    }
    out[k] = '\0';
    snprintf(msg, len, "%s", out);
}

/* The dataset a data field names, as the spec gave it (the default's name when absent). */
static const char *given(json_t *data, const char *key, const char *dflt)
{
    const char *s = json_string_value(json_object_get(data, key));
    return s ? s : dflt;
}

/* An IDX file's path in msg as the spec named it: the file given (data.KEY), else "NAME
 * (FILE)", the dataset and the file of it. */
static void rename_file(char *msg, size_t len, const char *path, json_t *data, const char *key,
                        const char *name)
{
    char shown[700];
    const char *base = strrchr(path, '/');
    if (json_is_string(json_object_get(data, key)))
        snprintf(shown, sizeof(shown), "%s", json_string_value(json_object_get(data, key)));
    else
        snprintf(shown, sizeof(shown), "%s (%s)", name, base ? base + 1 : path);
    rename_path(msg, len, path, shown);
}

/* See api.h. */
int api_spec_check_data(const gpu_job_config *c, json_t *spec, api_error *err)
{
    char msg[1024];
    const gpu_data_config *d = &c->data;
    json_t *data = json_object_get(spec, "data");
    const char *train = given(data, "train", "fashion-mnist"), *colon;
    int rc = gpu_job_check_data(c, msg, sizeof(msg));
    if (rc == 0)
        return 0;
    /* the files as the user named them, not where the data roots put them */
    rename_path(msg, sizeof(msg), d->seq_train, train);
    rename_path(msg, sizeof(msg), d->seq_eval, given(data, "eval", d->seq_eval));
    rename_file(msg, sizeof(msg), d->train_images, data, "train_images", train);
    rename_file(msg, sizeof(msg), d->train_labels, data, "train_labels", train);
    rename_file(msg, sizeof(msg), d->eval_images, data, "eval_images", given(data, "eval", train));
    rename_file(msg, sizeof(msg), d->eval_labels, data, "eval_labels", given(data, "eval", train));
    memset(err, 0, sizeof(*err));
    snprintf(err->code, sizeof(err->code), "%s", API_E_UNUSABLE_DATA);
    colon = strstr(msg, ": ");
    if (colon && (!strncmp(msg, "model.", 6) || !strncmp(msg, "data.", 5)) &&
        (size_t)(colon - msg) < sizeof(err->field)) {
        const char *name = NULL;
        memcpy(err->field, msg, (size_t)(colon - msg));
        if (!strcmp(err->field, "data.train"))
            name = train;
        else if (!strcmp(err->field, "data.eval"))
            name = given(data, "eval", d->seq_eval[0] ? d->seq_eval : "the eval split");
        if (name && !strstr(colon + 2, name)) /* say which dataset */
            snprintf(err->message, sizeof(err->message), "%.120s %.250s", name, colon + 2);
        else
            snprintf(err->message, sizeof(err->message), "%.380s", colon + 2);
    } else {
        snprintf(err->field, sizeof(err->field), "data.train");
        snprintf(err->message, sizeof(err->message), "%.380s", msg);
    }
    return GPU_EINVAL;
}

/* checkpoints: the retention, which checkpoints stay (daemon/ckpt.h). */
static int parse_checkpoints(ctx *c, json_t *v, gpu_job_config *jc)
{
    static const char *const keys[] = {"keep_last", "keep_best", NULL};
    int rc;
    if ((rc = want_object(c, v, "checkpoints")) || (rc = only_keys(c, v, "checkpoints", keys)) ||
        (rc = get_int32(c, v, "keep_last", "checkpoints.keep_last", 0, 1000000,
                        &jc->checkpoint_keep_last)) ||
        (rc = get_int32(c, v, "keep_best", "checkpoints.keep_best", 0, 1000,
                        &jc->checkpoint_keep_best)))
        return rc;
    return 0;
}

static int parse_top(ctx *c, json_t *spec, gpu_job_config *jc)
{
    static const char *const keys[] = {"name",
                                       "model",
                                       "data",
                                       "precision",
                                       "optimizer",
                                       "batch_size",
                                       "grad_accum_steps",
                                       "steps",
                                       "seed",
                                       "eval_every",
                                       "checkpoint_every",
                                       "checkpoints",
                                       "diagnostics_every",
                                       "device",
                                       "distributed",
                                       "threads",
                                       "priority",
                                       "resources",
                                       "on_numerics",
                                       "max_branches",
                                       NULL};
    json_t *v;
    int64_t seed = (int64_t)jc->seed;
    int rc, policy = (int)jc->on_numerics;

    if (!json_is_object(spec))
        return fail(c, "", "the job spec must be a JSON object");
    if ((rc = only_keys(c, spec, "", keys)))
        return rc;
    if ((v = json_object_get(spec, "name"))) {
        if (!json_is_string(v) || json_string_length(v) == 0 || json_string_length(v) > 127)
            return fail(c, "name", "must be a string of 1 to 127 characters");
        snprintf(jc->name, sizeof(jc->name), "%s", json_string_value(v));
    }
    if (((v = json_object_get(spec, "model")) && (rc = parse_model(c, v, &jc->model))) ||
        ((v = json_object_get(spec, "precision")) && (rc = parse_precision(c, v, jc))) ||
        ((v = json_object_get(spec, "optimizer")) && (rc = parse_optimizer(c, v, &jc->optim))) ||
        ((v = json_object_get(spec, "distributed")) && (rc = parse_distributed(c, v, &jc->dist))) ||
        ((v = json_object_get(spec, "device")) && (rc = parse_device(c, v, jc))) ||
        ((v = json_object_get(spec, "resources")) && (rc = parse_resources(c, v, &jc->res))) ||
        ((v = json_object_get(spec, "checkpoints")) && (rc = parse_checkpoints(c, v, jc))))
        return rc;
    if ((rc = get_int32(c, spec, "batch_size", "batch_size", 1, 65536, &jc->batch_size)) ||
        (rc = get_int32(c, spec, "grad_accum_steps", "grad_accum_steps", 1, 4096,
                        &jc->grad_accum_steps)) ||
        (rc = get_int(c, spec, "steps", "steps", 1, 1000000000LL, &jc->steps)) ||
        (rc = get_int(c, spec, "seed", "seed", 0, INT64_MAX, &seed)) ||
        (rc = get_int(c, spec, "eval_every", "eval_every", 0, 1000000000LL, &jc->eval_every)) ||
        (rc = get_int(c, spec, "checkpoint_every", "checkpoint_every", 0, 1000000000LL,
                      &jc->checkpoint_every)) ||
        (rc = get_int(c, spec, "diagnostics_every", "diagnostics_every", 0, 1000000000LL,
                      &jc->diagnostics_every)) ||
        (rc = get_int32(c, spec, "threads", "threads", 0, 1024, &jc->threads)) ||
        (rc = get_int32(c, spec, "priority", "priority", -1000, 1000, &jc->priority)) ||
        (rc = get_int32(c, spec, "max_branches", "max_branches", 0, API_BRANCH_MAX_DEPTH - 1,
                        &jc->max_branches)) ||
        (rc = get_choice(c, spec, "on_numerics", "on_numerics", on_numerics_names, &policy)))
        return rc;
    jc->on_numerics = (gpu_on_numerics)policy;
    jc->seed = (uint64_t)seed;
    if (jc->batch_size % jc->dist.world_size != 0)
        return fail(c, "batch_size",
                    "%d does not split evenly over distributed.world_size = %d ranks "
                    "(the global batch is divided between them)",
                    jc->batch_size, jc->dist.world_size);
    /* data last: synthetic defaults follow the model's shape */
    jc->data.synth_features = jc->model.layers[0];
    jc->data.synth_classes = jc->model.layers[jc->model.nlayers - 1];
    v = json_object_get(spec, "data");
    if (!v)
        v = json_object();
    else
        json_incref(v);
    rc = parse_data(c, v, &jc->data);
    json_decref(v);
    if (rc)
        return rc;
    bool seq = jc->data.type == GPU_DATA_TEXT || jc->data.type == GPU_DATA_TOKENS;
    if (jc->model.type == GPU_MODEL_GPT && !seq)
        return fail(c, "data.type", "a gpt model trains on \"text\" or \"tokens\" data");
    if (jc->model.type == GPU_MODEL_MLP && seq)
        return fail(c, "data.type", "an mlp trains on \"idx\" or \"synthetic\" data");
    return 0;
}

/* b bytes as "12.3 GiB", or "45.6 MiB" below a GiB, in buf (24 bytes). */
static const char *size_str(char *buf, double b)
{
    if (b >= 1024.0 * 1024.0 * 1024.0)
        snprintf(buf, 24, "%.1f GiB", b / (1024.0 * 1024.0 * 1024.0));
    else
        snprintf(buf, 24, "%.1f MiB", b / (1024.0 * 1024.0));
    return buf;
}

/* Refuse the job: it needs m but `where` has `have` bytes. The field is the batch size when
 * activations and workspace are most of it, else the model. */
static int too_big(ctx *c, const gpu_mem *m, const char *where, double have)
{
    char s[8][24];
    bool batch = m->activations + m->workspace > m->total / 2;
    return fail(c, batch ? "batch_size" : "model.layers",
                "the job needs %s (weights %s, master %s, gradients %s, optimizer %s, "
                "activations %s, workspace %s) but %s has %s",
                size_str(s[0], (double)m->total), size_str(s[1], (double)m->weights),
                size_str(s[2], (double)m->master), size_str(s[3], (double)m->grads),
                size_str(s[4], (double)m->optimizer), size_str(s[5], (double)m->activations),
                size_str(s[6], (double)m->workspace), where, size_str(s[7], have));
}

/* The index of the CUDA device the job will train on, or -1: "cpu", no GPU, or an index
 * beyond the count (the job fails when it starts, saying so). */
static int cuda_index(const char *dev, int count)
{
    if (strcmp(dev, "auto") == 0 || strcmp(dev, "cuda") == 0)
        return count > 0 ? 0 : -1;
    if (strncmp(dev, "cuda:", 5) == 0 && atoi(dev + 5) < count)
        return atoi(dev + 5);
    return -1;
}

/* A model plan's error, "field: message" (model.layers when it names no field). */
static int plan_error(ctx *c, const char *err)
{
    const char *sep = strstr(err, ": ");
    size_t n = sep ? (size_t)(sep - err) : 0;
    char field[96];
    if (n == 0 || n >= sizeof(field) || strcspn(err, " ") < n)
        return fail(c, "model.layers", "%s", err);
    snprintf(field, sizeof(field), "%.*s", (int)n, err);
    return fail(c, field, "%s", sep + 2);
}

/* Refuse a job whose blocks cannot fit in this machine's memory, or in the memory of the
 * GPU it will train on, saying what it needs. */
static int check_memory(ctx *c, const gpu_job_config *jc)
{
    gpu_mem m;
    char err[256], where[320];
    double phys = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    gpu_cuda_device gpus[64];
    int n = 0, k;

    if (gpu_job_memory(jc, &m, err, sizeof(err)) != 0)
        return plan_error(c, err);
    if ((double)m.total > 0.8 * phys)
        return too_big(c, &m, "this machine", phys);
    if (strcmp(jc->device, "cpu") == 0 ||      /* no CUDA call for a CPU job */
        gpu_cuda_devices(gpus, 64, &n) != 0 || (k = cuda_index(jc->device, n)) < 0 ||
        gpu_cuda_job_memory(jc, &m, err, sizeof(err)) != 0 ||
        (uint64_t)m.total <= gpus[k].memory_bytes)
        return 0;
    snprintf(where, sizeof(where), "cuda:%d (%.200s, the device \"%s\" trains on)", k,
             gpus[k].name, jc->device);
    return too_big(c, &m, where, (double)gpus[k].memory_bytes);
}

/* Parse a job spec object; see api.h. */
int api_spec_from_json(json_t *spec, const api_spec_opts *o, gpu_job_config *out, api_error *err)
{
    ctx c = {err, o};
    gpu_job_config jc;
    api_spec_opts dflt;

    memset(err, 0, sizeof(*err));
    if (!o) {
        api_spec_opts_default(&dflt);
        c.opts = &dflt;
    }
    gpu_job_defaults(&jc);
    jc.data.type = GPU_DATA_IDX;
    jc.dtype = GPU_FP32;
    int rc = parse_top(&c, spec, &jc);
    if (!rc)
        rc = check_memory(&c, &jc);
    if (rc)
        return rc;
    *out = jc;
    return 0;
}

/* Parse JSON text; see api.h. */
int api_spec_parse(const char *text, size_t len, const api_spec_opts *o, gpu_job_config *out,
                   api_error *err)
{
    json_error_t je;
    json_t *spec = json_loadb(text, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
    if (!spec) {
        memset(err, 0, sizeof(*err));
        snprintf(err->code, sizeof(err->code), "invalid_json");
        snprintf(err->message, sizeof(err->message), "line %d column %d: %s", je.line, je.column,
                 je.text);
        return GPU_EINVAL;
    }
    int rc = api_spec_from_json(spec, o, out, err);
    json_decref(spec);
    return rc;
}

/* The autocast table as JSON; caller owns the reference. */
json_t *api_autocast_to_json(const gpu_autocast *a)
{
    json_t *o = json_object();
    for (int i = 0; i < GPU_OP_COUNT; i++)
        json_object_set_new(o, gpu_op_name((gpu_op)i),
                            json_string(gpu_cast_policy_name(a->policy[i])));
    return o;
}

/* A job's table: an fp8 job's linear layers are "fp8". */
static json_t *autocast_table_json(const gpu_job_config *c)
{
    json_t *o = api_autocast_to_json(&c->autocast);
    if (o && c->fp8.on)
        json_object_set_new(o, gpu_op_name(GPU_OP_LINEAR), json_string("fp8"));
    return o;
}

static json_t *scaler_to_json(const gpu_scaler_config *s)
{
    static const char *const modes[] = {"none", "static", "dynamic"};
    return json_pack(
        "{s:s, s:f, s:f, s:f, s:i, s:i, s:f, s:f, s:i}", "mode", modes[s->mode], "init",
        api_float_value(s->init_scale), "growth_factor", s->growth_factor,
        "backoff_factor", s->backoff_factor, "growth_interval", s->growth_interval,
        "hysteresis", s->hysteresis, "min_scale", api_float_value(s->min_scale), "max_scale",
        api_float_value(s->max_scale), "floor_patience", s->floor_patience);
}

/* data_to_json's part: skip_batches and shuffle, given when not the default. */
static json_t *data_order_json(json_t *o, const gpu_data_config *d)
{
    if (o && d->skip_batches > 0)
        json_object_set_new(o, "skip_batches", json_integer(d->skip_batches));
    if (o && d->in_order)
        json_object_set_new(o, "shuffle", json_false());
    return o;
}

static json_t *data_to_json(const gpu_data_config *d)
{
    if (d->type == GPU_DATA_SYNTHETIC)
        return json_pack("{s:s, s:i, s:i, s:i, s:i}", "type", "synthetic", "features",
                         d->synth_features, "classes", d->synth_classes, "train_size",
                         d->synth_train, "eval_size", d->synth_eval);
    if (d->type == GPU_DATA_TEXT || d->type == GPU_DATA_TOKENS) {
        const char *type = d->type == GPU_DATA_TEXT ? "text" : "tokens";
        if (d->seq_eval[0])
            return json_pack("{s:s, s:s, s:s}", "type", type, "train", d->seq_train, "eval",
                             d->seq_eval);
        return json_pack("{s:s, s:s, s:n, s:f}", "type", type, "train", d->seq_train, "eval",
                         "val_fraction", api_float_value(d->val_fraction));
    }
    return json_pack("{s:s, s:s, s:s, s:s?, s:s?}", "type", "idx", "train_images", d->train_images,
                     "train_labels", d->train_labels, "eval_images",
                     d->eval_images[0] ? d->eval_images : NULL, "eval_labels",
                     d->eval_labels[0] ? d->eval_labels : NULL);
}

static json_t *model_to_json(const gpu_model_config *m)
{
    if (m->type == GPU_MODEL_GPT)
        return json_pack("{s:s, s:i, s:i, s:i, s:i, s:i, s:f, s:s}", "type", "gpt", "n_layer",
                         m->n_layer, "n_head", m->n_head, "d_model", m->d_model, "seq_len",
                         m->seq_len, "vocab", m->vocab, "init_scale",
                         api_float_value(m->init_scale), "attention",
                         m->attention == GPU_ATTN_FLASH ? "flash" : "materialized");
    json_t *layers = json_array();
    for (int i = 0; i < m->nlayers; i++)
        json_array_append_new(layers, json_integer(m->layers[i]));
    return json_pack("{s:s, s:o, s:s, s:f}", "type", "mlp", "layers", layers, "activation",
                     m->activation == GPU_ACT_GELU ? "gelu" : "relu", "init_scale",
                     api_float_value(m->init_scale));
}

/* distributed.slurm: the numbers said (0: not said, left out) and the names given. */
static json_t *slurm_to_json(const gpu_slurm_config *sl)
{
    json_t *o = json_object();
    const struct {
        const char *key;
        int v;
    } nums[] = {{"nodes", sl->nodes},
                {"tasks_per_node", sl->tasks_per_node},
                {"cpus_per_task", sl->cpus_per_task},
                {"gpus_per_task", sl->gpus_per_task}};
    const struct {
        const char *key, *v;
    } words[] = {{"partition", sl->partition}, {"account", sl->account}, {"time", sl->time}};
    for (size_t i = 0; o && i < sizeof(nums) / sizeof(nums[0]); i++)
        if (nums[i].v > 0)
            json_object_set_new(o, nums[i].key, json_integer(nums[i].v));
    for (size_t i = 0; o && i < sizeof(words) / sizeof(words[0]); i++)
        if (words[i].v[0])
            json_object_set_new(o, words[i].key, json_string(words[i].v));
    return o;
}

static json_t *dist_to_json(const gpu_dist_config *d)
{
    json_t *o = json_pack("{s:i, s:s, s:f, s:b, s:i}", "world_size", d->world_size, "comm_hook",
                          gpu_comm_hook_name(d->hook), "bucket_mb", d->bucket_mb,
                          "oversubscribe", d->oversubscribe, "rank_timeout_s",
                          d->rank_timeout_s);
    if (o && d->nhosts > 0) {
        json_t *h = json_array();
        for (int i = 0; i < d->nhosts; i++)
            json_array_append_new(h, json_string(d->hosts[i]));
        json_object_set_new(o, "hosts", h);
    }
    if (o && d->launcher != GPU_LAUNCH_DEFAULT)
        json_object_set_new(o, "launcher", json_string(gpu_launcher_name(d->launcher)));
    if (o && (d->launcher == GPU_LAUNCH_SLURM ||
              memcmp(&d->slurm, &(gpu_slurm_config){0}, sizeof(d->slurm)) != 0))
        json_object_set_new(o, "slurm", slurm_to_json(&d->slurm));
    return o;
}

/* resources: devices only when said (else the scheduler derives it from device). */
static json_t *resources_to_json(const gpu_resources *r)
{
    json_t *o = json_pack("{s:i, s:I}", "cpus", r->cpus, "memory_mb", (json_int_t)r->memory_mb);
    if (o && r->devices >= 0)
        json_object_set_new(o, "devices", json_integer(r->devices));
    return o;
}

/* precision.fp8 as the canonical spec prints it: the recipe's own fields. */
static json_t *fp8_to_json(const gpu_fp8_config *f)
{
    static const char *const algos[] = {"max", "most_recent"};
    json_t *keep = json_array();
    json_t *o =
        json_pack("{s:s, s:s, s:{s:i, s:i}, s:o}", "recipe",
                  f->recipe == GPU_FP8_DELAYED ? "delayed" : "current", "format",
                  f->format == GPU_FP8_HYBRID ? "hybrid" : "e4m3", "accumulator", "mantissa_bits",
                  f->acc.bits, "promote_every", f->acc.promote, "keep", keep);
    for (int k = 0; keep && k < f->nkeep; k++)
        json_array_append_new(keep, json_string(f->keep[k]));
    if (o && f->recipe == GPU_FP8_DELAYED) {
        json_object_set_new(o, "margin", json_integer(f->margin));
        json_object_set_new(o, "amax_history_len", json_integer(f->amax_history_len));
        json_object_set_new(o, "amax_compute_algo", json_string(algos[f->amax_algo]));
    } else if (o) {
        json_object_set_new(o, "amax_epsilon", json_real(api_float_value(f->amax_epsilon)));
    }
    return o;
}

/* The canonical, fully defaulted spec; caller owns the reference. */
json_t *api_spec_to_json(const gpu_job_config *c)
{
    static const char *const opts[] = {"adamw", "sgd"};
    static const char *const scheds[] = {"constant", "cosine", "linear"};
    const gpu_optim_config *o = &c->optim;
    json_t *j = json_pack(
        "{s:s, s:o, s:o, s:{s:s, s:b, s:o, s:{s:o}},"
        " s:{s:s, s:f, s:[f,f], s:f, s:f, s:f, s:f, s:i, s:s, s:f},"
        " s:i, s:I, s:I, s:I, s:I, s:I, s:s, s:i}",
        "name", c->name, "model", model_to_json(&c->model), "data",
        data_order_json(data_to_json(&c->data), &c->data), "precision", "dtype",
        gpu_job_dtype_name(c), "master_weights", c->master_weights, "loss_scale",
        scaler_to_json(&c->scaler), "autocast", "table", autocast_table_json(c), "optimizer",
        "type", opts[o->type], "lr", o->lr, "betas", o->beta1, o->beta2, "eps", o->eps, "momentum",
        o->momentum, "weight_decay", o->weight_decay, "grad_clip", api_float_value(o->grad_clip),
        "warmup_steps", o->warmup_steps, "schedule", scheds[o->schedule], "min_lr_ratio",
        api_float_value(o->min_lr_ratio), "batch_size", c->batch_size, "steps",
        (json_int_t)c->steps, "seed", (json_int_t)c->seed, "eval_every", (json_int_t)c->eval_every,
        "checkpoint_every", (json_int_t)c->checkpoint_every, "diagnostics_every",
        (json_int_t)c->diagnostics_every, "device", c->device, "threads", c->threads);
    if (j && c->fp8.on)
        json_object_set_new(json_object_get(j, "precision"), "fp8", fp8_to_json(&c->fp8));
    if (j) {
        json_object_set_new(j, "grad_accum_steps", json_integer(c->grad_accum_steps));
        json_object_set_new(j, "checkpoints",
                            json_pack("{s:i, s:i}", "keep_last", c->checkpoint_keep_last,
                                      "keep_best", c->checkpoint_keep_best));
        json_object_set_new(j, "distributed", dist_to_json(&c->dist));
        json_object_set_new(j, "priority", json_integer(c->priority));
        json_object_set_new(j, "on_numerics", json_string(on_numerics_names[c->on_numerics]));
        json_object_set_new(j, "max_branches", json_integer(c->max_branches));
        json_object_set_new(j, "resources", resources_to_json(&c->res));
    }
    return j;
}

char *api_spec_effective(const gpu_job_config *c)
{
    json_t *o = api_spec_to_json(c), *back = NULL;
    /* Nine significant digits, as `ampd run` prints it, write every float exactly and most
     * doubles; a double that needs more (an lr of 1.0000000001e-3) keeps all 17. */
    char *text = o ? json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(9)) : NULL;
    if (text && !((back = json_loads(text, 0, NULL)) && json_equal(o, back))) {
        free(text);
        text = json_dumps(o, JSON_COMPACT);
    }
    json_decref(back);
    json_decref(o);
    return text;
}
