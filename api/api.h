/*
 * api.h - the public header of the api/ module: job-spec validation, the JSON encoding of
 * metric values, and the HTTP server (REST API, SSE streams, Prometheus, the dashboard's
 * static files).
 *
 * A job spec is the JSON document of docs/job-spec.md. Parsing is strict: unknown fields
 * are rejected, every value is range-checked, and every error names the field it is about
 * (dotted path, e.g. "optimizer.lr" or "model.layers[2]"). Named datasets resolve inside
 * the configured data roots; a path outside them is refused.
 *
 * The server reads the run history from the store and reaches the job queue only through
 * the api_jobs callbacks its host installs (the daemon's scheduler): the api/ module never
 * includes daemon/.
 *
 * Messages (a refused web root, a store failure in mid-response, ...) go to the store's log
 * hook (store_set_log), which the host installs for both modules.
 *
 * Errors: the spec and server functions return 0 or a gpu/ code (GPU_EINVAL, GPU_ENOMEM,
 * GPU_EIO; gpu_strerror) with a message; the api_jobs callbacks return the store's codes
 * (STORE_ENOTFOUND, STORE_ECONFLICT, ...; store_strerror), which the handlers map to HTTP
 * statuses.
 *
 * Threads: the spec functions are reentrant and keep no global state; the server runs
 * its own threads (see api_start).
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

/* The codes of a job that can never run here, answered 422 (api_jobs.admit: the machine;
 * api_spec_check_data: the data). */
#define API_E_DOES_NOT_FIT "does_not_fit"
#define API_E_UNUSABLE_DATA "unusable_data"
/* A branch its parent's checkpoint cannot start (POST /v1/jobs/{id}/branch): no checkpoint
 * at that step, another model or world size, a patched spec that is refused; 422. */
#define API_E_INVALID_BRANCH "invalid_branch"

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
/* Set c->device to dev when it is a device a spec may name ("auto", "cpu", "cuda", "cuda:N"):
 * 0, else GPU_EINVAL with err filled (field "device"). */
int api_spec_device(const char *dev, gpu_job_config *c, api_error *err);
/* Whether the data of job c (parsed from spec, borrowed: the names it gave) can train its
 * model, read as the worker will read it: 0, or GPU_EINVAL with err (code "unusable_data";
 * the field, "data.train", "data.eval" or "model.vocab"...; the message naming the datasets
 * as the spec does, not by the data roots' paths). Reads every file of the data. */
int api_spec_check_data(const gpu_job_config *c, json_t *spec, api_error *err);
/* The validated config as a JSON object with every field filled in (the canonical form
 * the daemon stores and reports), a spec that api_spec_parse accepts and turns into the
 * same config. Caller owns the returned reference (json_decref). */
json_t *api_spec_to_json(const gpu_job_config *c);
/* api_spec_to_json as compact text: the effective spec that the store keeps for a job (a
 * resume runs it as queued, whatever defaults a later ampd has). NULL when out of memory;
 * the caller frees it. */
char *api_spec_effective(const gpu_job_config *c);
/* The autocast table as a JSON object {"linear": "lowp", ...}; caller owns it. */
json_t *api_autocast_to_json(const gpu_autocast *a);

/* ---- the HTTP server (server.c) -------------------------------------------------------- */

struct store;
typedef struct api_server api_server; /* opaque */

typedef struct {
    int running, queued, max_running;
    int64_t workers_started, workers_failed;
} api_queue_info;

/* A queued job's place in the queue, as the scheduler last planned it. */
typedef struct {
    int position;          /* 1: the next to start */
    int priority;
    char waiting_for[192]; /* why it has not started ("" before the scheduler looked) */
} api_queue_place;

/* The job queue as the server sees it, installed by the host (the daemon's scheduler).
 * Every callback gets ctx and must be thread-safe (HTTP threads call them); each returns
 * 0 or a STORE_E* code. */
typedef struct {
    void *ctx;
    /* Queue a validated job (spec_json: its effective spec, api_spec_effective); idem_key
     * may be NULL. */
    int (*submit)(void *ctx, const char *name, const char *dtype, int64_t steps,
                  const char *spec_json, const char *idem_key, int64_t *id, bool *existed);
    /* Queue a validated branch of job parent, starting from its checkpoint at from_step
     * (branch_json: the branch's record; what: its reason and patch in words);
     * STORE_ENOTFOUND when that checkpoint's file is gone by then. NULL: no branching. */
    int (*branch)(void *ctx, const char *name, const char *dtype, int64_t steps,
                  const char *spec_json, int64_t parent, int64_t from_step, const char *branch_json,
                  const char *what, int64_t *id);
    int (*cancel)(void *ctx, int64_t id);
    int (*resume)(void *ctx, int64_t id);
    int (*pause)(void *ctx, int64_t id);
    int (*unpause)(void *ctx, int64_t id);
    int (*set_priority)(void *ctx, int64_t id, int priority);
    int (*remove)(void *ctx, int64_t id);
    void (*info)(void *ctx, api_queue_info *out);
    /* Whether job c can ever run on this machine: 0, or GPU_EINVAL with e naming the field
     * and what the machine has (answered 422). NULL: every job can. */
    int (*admit)(void *ctx, const gpu_job_config *c, api_error *e);
    /* The machine's cores and devices and their holders (GET /v1/resources), a new
     * reference; NULL: none to say. */
    json_t *(*resources)(void *ctx);
    /* Job id's place in the queue: 0, or STORE_ENOTFOUND when it is not queued (or not yet
     * planned). NULL: not known. */
    int (*queued)(void *ctx, int64_t id, api_queue_place *out);
} api_jobs;

/* A branch of a job (api_branch_create): from its checkpoint at from_step, or (0) at the
 * newest one before sign_step, where a problem showed (with rewind > 0: the newest at or
 * before sign_step - rewind, else the oldest before sign_step); its spec the parent's with
 * patch (a JSON merge patch, borrowed) applied; reason in words (NULL: "by hand"); remedy
 * the recommendation event it takes (0: none). */
typedef struct {
    int64_t from_step, sign_step, rewind;
    json_t *patch;
    const char *reason;
    int64_t remedy;
} api_branch_req;
#define API_BRANCH_MAX_DEPTH 64 /* ancestors a branch may have, plus one */

/* Create the branch b of job parent and queue it through jobs->branch (docs/api.md,
 * "Branches"): 0 with *id, or the HTTP status of the refusal (404: no such job; 422:
 * API_E_INVALID_BRANCH, or the admission's and the data's own codes, naming the field; 503)
 * with e filled. o: the data roots the spec is resolved with. */
int api_branch_create(struct store *st, const api_spec_opts *o, const api_jobs *jobs,
                      int64_t parent, const api_branch_req *b, int64_t *id, api_error *e);
/* The step a job was branched at, from its branch record (store_job's branch: the JSON
 * text, NULL for a job that is not a branch; 0 then). */
int64_t api_branch_step(const char *branch);
/* The file (path) of job's checkpoint at step; when job has none there and step is the
 * step it was branched at, the ancestor's checkpoint it began with. 0, STORE_ENOTFOUND, or
 * another store code. */
int api_branch_checkpoint(struct store *st, int64_t job, int64_t step, char *path, size_t len);

#define API_MAX_ALLOW 16 /* --allow-host and --allow-origin entries */
#define API_ALLOW_LEN 256

typedef struct {
    char listen[128];      /* "127.0.0.1:8080", "[::1]:8080", "0.0.0.0:8080" */
    char token[256];       /* bearer token for mutating endpoints; empty: none (loopback only) */
    size_t max_body;       /* request body limit in bytes (1 MiB) */
    api_spec_opts spec;    /* data roots for spec validation */
    char web_root[512];    /* static dashboard files; empty: none */
    int metrics_keep_s;    /* /metrics keeps a finished job's series this long; 0: drops them */
    /* A request head (request line and headers) must be complete this long after its
     * connection opened or its previous request ended, however slowly it trickles in (0: 10). */
    int head_timeout_s;
    /* Open connections from one address beyond loopback (an IPv6 /64 counts as one
     * address); more are closed at accept (0: 64). */
    int max_per_addr;
    /* Open connections in all; 0: from the open-file limit. */
    unsigned max_conns;
    int stop_timeout_ms; /* api_stop waits this long for busy requests (0: 5000) */
    /* Host header values answered besides the listen address and localhost, 127.0.0.1 and
     * [::1] with the bound port: "NAME" (any port) or "NAME:PORT" (api_check_allow_host) */
    int nallow_hosts;
    char allow_hosts[API_MAX_ALLOW][API_ALLOW_LEN];
    /* Origin header values admitted besides the daemon's own ("scheme://host[:port]") */
    int nallow_origins;
    char allow_origins[API_MAX_ALLOW][API_ALLOW_LEN];
} api_config;

/* Whether v is a valid --allow-host value ("NAME" or "NAME:PORT", NAME a DNS name, an IPv4
 * address or a bracketed IPv6 address) or --allow-origin value ("http://host[:port]" or
 * "https://..."; no path, no trailing slash). 0, or GPU_EINVAL with the reason in err. */
int api_check_allow_host(const char *v, char *err, size_t errlen);
int api_check_allow_origin(const char *v, char *err, size_t errlen);

/* Start serving (a fixed pool of libmicrohttpd threads and one watcher thread; see
 * server.c). st is borrowed and must outlive the server; jobs is copied (NULL: degraded
 * mode, mutations answer 503), its ctx must outlive the server. Refuses (GPU_EINVAL with a
 * message in err) to listen beyond loopback without a token, and an invalid allow_hosts or
 * allow_origins entry. Caller stops with api_stop().
 *
 * Every request is admitted only when its Host header names this daemon (see api_config)
 * and its Origin header, when present, is the daemon's own origin or an allowed one (421
 * and 403 otherwise); every POST and DELETE must carry Content-Type: application/json, a
 * header that a cross-site form or no-cors fetch cannot send (415 otherwise). */
int api_start(const api_config *c, struct store *st, const api_jobs *jobs, api_server **out,
              char *err, size_t errlen);
/* The port actually bound (useful with port 0). */
unsigned api_port(const api_server *a);
/* Close every connection (ending SSE streams) and free. NULL is accepted. Waits at most
 * stop_timeout_ms for the requests in progress: when one is still busy then (a handler
 * blocked), returns GPU_ETIMEDOUT and leaves it behind; the server is freed once it ends,
 * but it may still use the store and the api_jobs ctx, so the host should exit rather than
 * free them. 0 otherwise. */
int api_stop(api_server *a);

/* JSON encoding of metric values (api/json.c). A non-finite double becomes the string
 * "NaN", "Infinity" or "-Infinity" (never dropped); a float is written as its shortest
 * round-trip decimal (0.001, not 0.00100000005). Both return a new reference. */
json_t *api_json_num(double v);
json_t *api_json_float(float v);
/* The double nearest the shortest decimal that reads back as v (v when not finite). */
double api_float_value(float v);

#endif /* AMPD_API_H */
