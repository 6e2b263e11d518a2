/*
 * line.c - the worker's metric lines: written from the engine's structs and read back
 * into store rows, both from the metric-field table (store.h's STORE_METRICS: a row's src
 * names the gpu_step_metrics or gpu_eval_result member the worker prints).
 *
 * Invariants: every field of the table is printed and read back under its name; a float
 * reads back as its shortest decimal (api_json_float), a double as the worker printed it
 * (run.c: 9 significant digits); a non-finite value is never dropped.
 *
 * Threads: reentrant.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api/api.h"
#include "daemon/line.h"

/* A table row's value in its JSON form. */
#define JSON_NUM(v) api_json_num(v)
#define JSON_FLOAT(v) api_json_float(v)
#define JSON_INT(v) json_integer((json_int_t)(v))
#define JSON_BOOL(v) json_boolean(v)

#define PUT_STEP_(id, name, line, type, src, since) PUT_STEP_##line(name, type, src)
#define PUT_STEP_STEP(name, type, src) json_object_set_new(o, #name, JSON_##type(m->src));
#define PUT_STEP_EVAL(name, type, src)
#define PUT_EVAL_(id, name, line, type, src, since) PUT_EVAL_##line(name, type, src)
#define PUT_EVAL_STEP(name, type, src)
#define PUT_EVAL_EVAL(name, type, src) json_object_set_new(o, #name, JSON_##type(r->src));

json_t *daemon_line_mem(const gpu_mem *m)
{
    return json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "weights", (json_int_t)m->weights,
                     "master", (json_int_t)m->master, "grads", (json_int_t)m->grads, "optimizer",
                     (json_int_t)m->optimizer, "activations", (json_int_t)m->activations,
                     "workspace", (json_int_t)m->workspace, "fp8", (json_int_t)m->fp8, "total",
                     (json_int_t)m->total);
}

json_t *daemon_line_step(const gpu_step_metrics *m)
{
    json_t *o = json_pack("{s:s, s:I}", "type", "step", "step", (json_int_t)m->step);
    if (!o)
        return NULL;
    STORE_METRICS(PUT_STEP_)
    json_object_set_new(o, "mem", daemon_line_mem(&m->mem));
    return o;
}

json_t *daemon_line_eval(int64_t step, const gpu_eval_result *r)
{
    json_t *o = json_pack("{s:s, s:I}", "type", "eval", "step", (json_int_t)step);
    if (!o)
        return NULL;
    STORE_METRICS(PUT_EVAL_)
    json_object_set_new(o, "count", json_integer((json_int_t)r->count));
    return o;
}

double daemon_line_num(json_t *v)
{
    const char *str;
    if (json_is_number(v))
        return json_number_value(v);
    if (json_is_boolean(v))
        return json_is_true(v) ? 1.0 : 0.0;
    str = json_string_value(v);
    if (str && strcmp(str, "Infinity") == 0)
        return INFINITY;
    if (str && strcmp(str, "-Infinity") == 0)
        return -INFINITY;
    return NAN;
}

void daemon_line_fields(json_t *o, store_line line, double *v)
{
    for (int i = 0; i < STORE_M_NFIELDS; i++) {
        const store_metric_info *f = store_metric_field(i);
        json_t *x = json_object_get(o, f->name);
        if (f->line == line)
            v[i] = x && !json_is_null(x) ? daemon_line_num(x) : store_missing();
    }
}

/* See line.h. */
void daemon_line_emit(json_t *obj)
{
    char *s = json_dumps(obj, JSON_COMPACT | JSON_REAL_PRECISION(9));
    size_t n = s ? strlen(s) : 0, off = 0;
    if (s) {
        s[n] = '\n'; /* over the terminator: the line is written by length */
        while (off <= n) {
            ssize_t k = write(STDOUT_FILENO, s + off, n + 1 - off);
            if (k < 0 && errno == EINTR)
                continue;
            if (k <= 0)
                break; /* the reader is gone: nothing to print to */
            off += (size_t)k;
        }
        free(s);
    }
    json_decref(obj);
}
