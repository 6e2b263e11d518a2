/*
 * api.h - the public header of the api/ module: job-spec validation (and, later, the
 * HTTP server).
 *
 * A job spec is the JSON document of DESIGN.md §4. Parsing is strict: unknown fields are
 * rejected, every value is range-checked, and every error names the field it is about
 * (dotted path, e.g. "optimizer.lr" or "model.layers[2]"). Named datasets resolve inside
 * the configured data roots; a path outside them is refused.
 *
 * Threads: the functions are reentrant; they keep no global state.
 */
#ifndef AMPD_API_H
#define AMPD_API_H

#include <jansson.h>

#include "gpu/gpu.h"

#define API_MAX_ROOTS 8

/* Where named datasets are looked up. */
typedef struct {
    int nroots;
    char roots[API_MAX_ROOTS][512];
} api_spec_opts;

/* A validation error: a stable code, the field it names and a sentence for people. */
typedef struct {
    char code[32];
    char field[128];
    char message[384];
} api_error;

/* Default options: the data roots /usr/share/datasets (Debian's dataset-* packages) and
 * /usr/share/games (where Debian's fortunes package puts its text). */
void api_spec_opts_default(api_spec_opts *o);

/* Parse and validate a job spec given as JSON text of len bytes. On success fills *out
 * (every field not given gets its documented default) and returns 0. On failure returns
 * GPU_EINVAL and fills *err (code "invalid_json" or "invalid_spec"). Borrowed arguments. */
int api_spec_parse(const char *text, size_t len, const api_spec_opts *o, gpu_job_config *out,
                   api_error *err);
/* The same for an already parsed JSON object (borrowed). */
int api_spec_from_json(json_t *spec, const api_spec_opts *o, gpu_job_config *out, api_error *err);
/* The validated config as a JSON object with every field filled in (the canonical form
 * the daemon stores and reports). Caller owns the returned reference (json_decref). */
json_t *api_spec_to_json(const gpu_job_config *c);
/* The autocast table as a JSON object {"linear": "lowp", ...}; caller owns it. */
json_t *api_autocast_to_json(const gpu_autocast *a);

/* ---- the HTTP server (server.c) -------------------------------------------------------- */

struct store;
struct daemon_sched;
typedef struct api_server api_server; /* opaque */

typedef struct {
    char listen[128];      /* "127.0.0.1:8080", "[::1]:8080", "0.0.0.0:8080" */
    char token[256];       /* bearer token for mutating endpoints; empty: none (loopback only) */
    size_t max_body;       /* request body limit in bytes (1 MiB) */
    api_spec_opts spec;    /* data roots for spec validation */
    char web_root[512];    /* static dashboard files; empty: none */
} api_config;

/* Start serving. st and sc are borrowed and must outlive the server. Refuses (GPU_EINVAL
 * with a message in err) to listen beyond loopback without a token. Caller stops with
 * api_stop(). */
int api_start(const api_config *c, struct store *st, struct daemon_sched *sc,
              api_server **out, char *err, size_t errlen);
/* The port actually bound (useful with port 0). */
unsigned api_port(const api_server *a);
/* Close every connection (ending SSE streams) and free. NULL is accepted. */
void api_stop(api_server *a);

/* JSON encoding of metric values (api/json.c). A non-finite double becomes the string
 * "NaN", "Infinity" or "-Infinity" (never dropped); a float is written as its shortest
 * round-trip decimal (0.001, not 0.00100000005). Both return a new reference. */
json_t *api_json_num(double v);
json_t *api_json_float(float v);
/* The double nearest the shortest decimal that reads back as v (v when not finite). */
double api_float_value(float v);

#endif /* AMPD_API_H */
