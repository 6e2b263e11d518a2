/*
 * api_int.h - the api/ module's internal header: the pieces the HTTP server is built from
 * (a growable output buffer and the encoders that write into it, strict query-parameter
 * parsing, the route table) and the server state shared by server.c, routes.c, sse.c and
 * prom.c. Nothing here is part of the public contract; tests/check_api.c tests the pure
 * functions directly.
 *
 * Ownership: an api_buf owns its bytes until api_buf_steal() hands them over (free()).
 * Encoders never fail halfway: on allocation failure the buffer is marked (b->oom) and
 * further appends are ignored, so callers check once at the end.
 *
 * Threads: the buffer and encoder functions are reentrant; the server state is shared by
 * libmicrohttpd's pool threads and the watcher thread (its mutable parts are atomics or
 * under conn_mu, park_mu or prom_mu).
 */
#ifndef AMPD_API_INT_H
#define AMPD_API_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "api/api.h"
#include "store/store.h"

/* ---- growable buffer (encode.c) --------------------------------------------------------- */

typedef struct {
    char *data; /* NUL-terminated when not empty */
    size_t len, cap;
    bool oom;
} api_buf;

void api_buf_init(api_buf *b);
void api_buf_free(api_buf *b);  /* NULL accepted */
void api_buf_reset(api_buf *b); /* keep the storage, drop the contents */
void api_buf_put(api_buf *b, const char *s, size_t n);
void api_buf_puts(api_buf *b, const char *s);
void api_buf_putc(api_buf *b, char c);
void api_buf_printf(api_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Hand the bytes over (NUL-terminated, never NULL unless oom); caller frees with free().
 * The buffer is left empty. */
char *api_buf_steal(api_buf *b, size_t *len);

/* A JSON string literal (quotes included); invalid UTF-8 becomes U+FFFD, control
 * characters are escaped. NULL writes null. */
void api_buf_json_str(api_buf *b, const char *s);
/* A JSON number; NaN and +-Inf become the strings "NaN", "Infinity", "-Infinity", a
 * missing value (store_missing()) null. Written as the shortest of %.9g / %.17g that
 * reads back exactly. */
void api_buf_json_num(api_buf *b, double v);
/* A number for CSV: NaN, Inf, -Inf for the non-finite values, nothing (an empty cell)
 * for a missing one. */
void api_buf_csv_num(api_buf *b, double v);
/* A sample value in the Prometheus text format: NaN, +Inf, -Inf. */
void api_buf_prom_num(api_buf *b, double v);
/* A Prometheus label value, escaped (\\, \", \n) without the quotes. */
void api_buf_prom_label(api_buf *b, const char *s);
/* ISO-8601 UTC with milliseconds ("2025-01-02T03:04:05.678Z") as a JSON string, or null
 * when t <= 0. */
void api_buf_json_time(api_buf *b, double t);
/* Copy a JSON text into b with the whitespace outside strings removed (the text must
 * already be valid JSON). */
void api_buf_json_compact(api_buf *b, const char *text, size_t len);

/* ---- strict parsing (encode.c) ---------------------------------------------------------- */

/* A decimal integer in [lo, hi]: optional '-', digits only, no spaces, no overflow.
 * Returns 0 or -1. */
int api_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);
/* A comma-separated list of metric names ("loss,loss_scale"). Fills fields (at most
 * STORE_M_NFIELDS, no duplicates). On error returns -1 and a message in err. */
int api_parse_fields(const char *s, int *fields, int *n, char *err, size_t errlen);
/* A comma-separated list of job ids (1..max entries, positive, no duplicates). */
int api_parse_ids(const char *s, int64_t *ids, int max, int *n, char *err, size_t errlen);
/* Nesting depth of a JSON text (objects and arrays, strings skipped). */
int api_json_depth(const char *text, size_t len);
/* Constant-time comparison of a presented token with the configured one. */
bool api_token_equal(const char *given, size_t given_len, const char *want);

/* ---- routes (route.c) -------------------------------------------------------------------- */

enum {
    API_M_GET = 1u,
    API_M_HEAD = 2u,
    API_M_POST = 4u,
    API_M_DELETE = 8u,
};

struct api_req;
struct api_resp;

/* The API's routes, one row per path: X(ID, pattern, get, post, delete), where a pattern's
 * "{id}" segment is a job's or an experiment's id and "{step}" a checkpoint step, and
 * get/post/delete name the handler of each method (NULL: not allowed; a GET handler also answers HEAD). The route
 * matcher, the Allow headers and the dispatch are generated from it. */
#define API_ROUTES(X)                                                                              \
    X(HEALTHZ, "/healthz", api_h_healthz, NULL, NULL)                                              \
    X(PROM, "/metrics", api_h_prom, NULL, NULL)                                                    \
    X(SYSTEM, "/v1/system", api_h_system, NULL, NULL)                                              \
    X(RESOURCES, "/v1/resources", api_h_resources, NULL, NULL)                                     \
    X(OPENAPI, "/v1/openapi.json", api_h_openapi, NULL, NULL)                                      \
    X(COMPARE, "/v1/compare", api_h_compare, NULL, NULL)                                           \
    X(JOBS, "/v1/jobs", api_h_jobs_list, api_h_jobs_submit, NULL)                                  \
    X(JOB, "/v1/jobs/{id}", api_h_job_get, NULL, api_h_job_action)                                 \
    X(JOB_CANCEL, "/v1/jobs/{id}/cancel", NULL, api_h_job_action, NULL)                            \
    X(JOB_RESUME, "/v1/jobs/{id}/resume", NULL, api_h_job_action, NULL)                            \
    X(JOB_PAUSE, "/v1/jobs/{id}/pause", NULL, api_h_job_action, NULL)                              \
    X(JOB_UNPAUSE, "/v1/jobs/{id}/unpause", NULL, api_h_job_action, NULL)                          \
    X(JOB_PRIORITY, "/v1/jobs/{id}/priority", NULL, api_h_job_action, NULL)                        \
    X(JOB_BRANCH, "/v1/jobs/{id}/branch", NULL, api_h_job_branch, NULL)                            \
    X(JOB_METRICS, "/v1/jobs/{id}/metrics", api_h_job_metrics, NULL, NULL)                         \
    X(JOB_LAYERS, "/v1/jobs/{id}/layers", api_h_job_layers, NULL, NULL)                            \
    X(JOB_EVENTS, "/v1/jobs/{id}/events", api_h_job_events, NULL, NULL)                            \
    X(JOB_STREAM, "/v1/jobs/{id}/stream", api_h_stream, NULL, NULL)                                \
    X(JOB_CKPTS, "/v1/jobs/{id}/checkpoints", api_h_job_ckpts, NULL, NULL)                         \
    X(JOB_CKPT, "/v1/jobs/{id}/checkpoints/{step}", api_h_job_ckpt, NULL, NULL)                    \
    X(EXPERIMENTS, "/v1/experiments", api_h_experiments_list, api_h_experiments_create, NULL)      \
    X(EXPERIMENT, "/v1/experiments/{id}", api_h_experiment_get, NULL, api_h_experiment_action)     \
    X(EXPERIMENT_CANCEL, "/v1/experiments/{id}/cancel", NULL, api_h_experiment_action, NULL)

#define API_R_ENUM_(id, pattern, get, post, del) API_R_##id,
/* API_R_STATIC: a file of the dashboard (any other GET path outside /v1/ when files are
 * served). */
typedef enum { API_R_NONE = 0, API_ROUTES(API_R_ENUM_) API_R_STATIC } api_route_id;
#undef API_R_ENUM_

typedef struct {
    api_route_id id;
    unsigned allow; /* API_M_* the route accepts */
    int64_t job;    /* the {id} segment; -1 when it is not a valid id */
    int64_t step;   /* the {step} segment; -1 when it is not a valid step */
} api_route;

/* Match a request path (no query; one trailing slash tolerated). static_files: unknown GET
 * paths outside /v1/ go to API_R_STATIC. Returns 0 (out filled) or -1 (no such route). */
int api_route_match(const char *path, bool static_files, api_route *out);
/* The handler of route id for method (an API_M_* bit); NULL when it has none (and for
 * API_R_STATIC and API_R_NONE, which the server answers itself). */
typedef void (*api_handler)(struct api_req *q, struct api_resp *r);
api_handler api_route_handler(api_route_id id, unsigned method);
/* "GET, HEAD, POST" for an API_M_* mask; into buf. */
void api_allow_string(unsigned allow, char *buf, size_t len);
/* API_M_* for a method name; 0 for any other method. */
unsigned api_method_bit(const char *method);

/* ---- series encoding (encode.c) --------------------------------------------------------- */

/* The metrics response is written in three parts so raw series can be read from the store
 * in chunks: begin, points (any number of times), end. raw: CSV has one column per field
 * (step,<field>...), otherwise step,step_last,count,flags,<field>_min,_max,_last...; in
 * JSON a point of one step (count 1) carries plain values, a bucket {min, max, last} per
 * field. The fields overflow and skipped are carried by the JSON point's flags of the same
 * names (for a bucket: some step in it overflowed / was skipped). With lineage (raw only)
 * each point also names the job it comes from. */
typedef struct {
    bool csv, raw;
    int nfields;
    int fields[STORE_M_NFIELDS];
    int64_t npoints;
    /* lineage: a branch's series with its ancestors' steps first; each point names its job
     * (CSV: a first column job), JSON adds the list of jobs, root first (ids[nlineage]) */
    bool lineage;
    int64_t job; /* the job of the points being written */
    int nlineage;
    int64_t ids[API_BRANCH_MAX_DEPTH + 1];
} api_series_enc;

void api_series_begin(api_series_enc *e, api_buf *b, int64_t job);
/* Points [from, from + n) of se. */
void api_series_points(api_series_enc *e, api_buf *b, const store_series *se, int from, int n);
void api_series_end(api_series_enc *e, api_buf *b, int64_t total_steps);

/* ---- experiment statistics (stats.c) ----------------------------------------------------- */

/* The moments of the finite values of v[0..n) (the others are skipped): n, mean, the sample
 * sd (NaN for fewer than two), min and max (NaN when none). */
typedef struct {
    int n;
    double mean, sd, min, max;
} api_moments;
void api_moments_of(const double *v, int n, api_moments *out);

/* Student's t distribution: the two-sided p of t with df degrees of freedom, and the 97.5%
 * quantile (the half-width of a 95% interval in standard errors). NaN for df <= 0. */
double api_t_two_sided_p(double t, double df);
double api_t_quantile975(double df);

/* Welch's t-test of a's mean against b's at the 5% level. Both need API_MIN_SEEDS values
 * (a variance each); with fewer the verdict is API_V_FEW_SEEDS and only diff is set. */
#define API_MIN_SEEDS 2
typedef enum { API_V_WITHIN = 0, API_V_OUTSIDE, API_V_FEW_SEEDS } api_verdict;
typedef struct {
    double diff, se, df, t, p;
    double half; /* the 95% interval is diff +- half */
    api_verdict verdict;
} api_welch_result;
int api_welch(const api_moments *a, const api_moments *b, api_welch_result *out);

/* Whether an eval sits on the unigram plateau of its training data (entropy in nats, the
 * most frequent token's frequency; gpu_dataset_unigram): a loss of at least
 * API_PLATEAU_LOSS_FRAC of the entropy with an accuracy no more than API_PLATEAU_ACC_MARGIN
 * above the frequency (an accuracy that is missing does not count against it). */
#define API_PLATEAU_LOSS_FRAC 0.95
#define API_PLATEAU_ACC_MARGIN 0.02
bool api_on_plateau(double loss, double acc, double entropy, double top_freq);

/* ---- messages ---------------------------------------------------------------------------- */

/* The server's messages go to the store's log hook (store_set_log): one hook for both. */
#define log_info(...) store_log(STORE_LOG_INFO, __func__, __VA_ARGS__)
#define log_warn(...) store_log(STORE_LOG_WARN, __func__, __VA_ARGS__)
#define log_error(...) store_log(STORE_LOG_ERROR, __func__, __VA_ARGS__)

/* ---- connections (conn.c) ---------------------------------------------------------------- */

/* An address as the per-address limit counts it: IPv4 as its IPv4-mapped IPv6 form, IPv6
 * by its /64 (the rest zero), so that one host's many IPv6 addresses count once. */
typedef struct {
    unsigned char b[16];
} api_addr;

#define API_PEER_BUCKETS 1024

typedef struct api_peer api_peer;

/* Open connections per address (a chained hash table; only addresses with one or more). */
typedef struct {
    api_peer *bucket[API_PEER_BUCKETS];
    unsigned naddrs;
} api_peers;

/* The address of sa (len bytes) as the limit counts it; false for an address the limit
 * exempts (loopback: 127.0.0.0/8, ::1, ::ffff:127.0.0.0/104) or one it does not know. */
bool api_addr_of(const struct sockaddr *sa, socklen_t len, api_addr *out);
/* Connections counted for a. */
unsigned api_peers_count(const api_peers *p, const api_addr *a);
/* Count one more for a; 0 or GPU_ENOMEM. */
int api_peers_add(api_peers *p, const api_addr *a);
/* Count one less for a (forgotten at 0). */
void api_peers_del(api_peers *p, const api_addr *a);
/* Forget every address; NULL accepted. */
void api_peers_free(api_peers *p);

/* What the server knows of one connection (MHD's socket context): its descriptor, when the
 * wait for its current request head began, and the address it is counted under. */
typedef struct api_conn api_conn;
struct api_conn {
    api_conn *prev, *next; /* in the server's head list while waiting */
    int fd;
    int64_t since_ms;
    bool waiting; /* a request head is awaited (the sweeper may close it) */
    bool counted; /* counted in peers under addr */
    api_addr addr;
};

/* The per-connection hooks server.c calls from libmicrohttpd's callbacks (any pool thread;
 * each takes the server's conn_mu). */
/* The accept policy: false when sa is counted and its address holds max_per_addr already. */
bool api_conn_admit(api_server *s, const struct sockaddr *sa, socklen_t len);
/* A connection opened on fd: track it and wait for its first request head. 0, or
 * GPU_ENOMEM (*out NULL: the caller closes the connection). */
int api_conn_open(api_server *s, int fd, const struct sockaddr *sa, socklen_t len, api_conn **out);
/* The connection's request head is complete: the deadline no longer applies. */
void api_conn_head_done(api_server *s, api_conn *c);
/* A request ended; the next head on the connection is awaited from now. */
void api_conn_head_wait(api_server *s, api_conn *c);
/* The connection closed: untrack and free it. NULL accepted. */
void api_conn_close(api_server *s, api_conn *c);
/* Shut down (shutdown(2), both ways) every connection whose head is overdue at now_ms;
 * *closed counts them, *next_ms becomes the next deadline (unchanged when none is
 * earlier). Called by the watcher thread. */
void api_conn_sweep(api_server *s, int64_t now_ms, int *closed, int64_t *next_ms);

/* ---- the server ------------------------------------------------------------------------- */

struct MHD_Connection;
struct api_sse; /* an SSE stream (sse.c) */

/* HTTP status codes counted for ampd_http_requests_total (100..599). */
#define API_NCODES 600

/* A Host value the server answers to: a name (lower case; an IPv6 address in brackets)
 * and a port (-1: any). */
typedef struct {
    char name[API_ALLOW_LEN];
    int port;
} api_host;

/* Split a Host value "name[:port]" (name a DNS name or IPv4 address, or an IPv6 address in
 * brackets) into out (port -1 when absent). Returns 0, or -1 when it is not one. */
int api_host_parse(const char *v, api_host *out);

struct api_server {
    struct MHD_Daemon *mhd;
    api_config cfg;
    api_host hosts[API_MAX_ALLOW + 4]; /* the Host values answered (server.c, host_ok) */
    int nhosts;
    /* stop_mu and stop_cv (monotonic clock) hand the stop over between api_stop and the
     * thread that stops libmicrohttpd: */
    pthread_mutex_t stop_mu;
    pthread_cond_t stop_cv;
    bool stopped;   /* under stop_mu: MHD_stop_daemon has returned (api_stop) */
    bool abandoned; /* under stop_mu: api_stop gave up waiting; the stopping thread frees */
    struct store *st;
    const api_jobs *jobs; /* &jobs_copy, or NULL: degraded mode, mutations answer 503 */
    api_jobs jobs_copy;
    unsigned port;
    atomic_bool stopping;
    int heartbeat_ms;
    /* The limits: libmicrohttpd's pool size, all connections, connections from one counted
     * address, the request-head deadline. */
    int threads;
    unsigned max_conns, max_per_addr;
    int head_timeout_ms;
    /* The watcher thread: it resumes parked SSE streams and sweeps overdue request heads. */
    pthread_t watcher;
    bool watcher_started;
    /* conn_mu guards peers, the head list (the connections awaiting a request head, oldest
     * first) and every api_conn. */
    pthread_mutex_t conn_mu;
    api_peers peers;
    api_conn *heads, *heads_last;
    /* Counted for the watcher's log: connections the per-address limit refused,
     * libmicrohttpd's messages in this period and those not logged. */
    atomic_uint refused, mhd_lines, mhd_dropped;
    atomic_int streams; /* SSE streams open (api_stop waits for them to end) */
    /* park_mu guards parked (the SSE streams whose connection is suspended) and
     * parking_closed (api_stop has resumed them all: none may park again). */
    pthread_mutex_t park_mu;
    struct api_sse *parked;
    bool parking_closed;
    atomic_ullong codes[API_NCODES];
    const char *blas_info;
    char cpu_model[160];
    int cores;
    char web_root_real[4096]; /* realpath of cfg.web_root; empty when not serving files */
    pthread_mutex_t prom_mu;  /* guards prom_hist */
    struct api_prom_hist *prom_hist; /* per-job step-time histograms (prom.c) */
    int prom_nhist;
};

/* The members (no braces) of the JSON objects that GET /v1/jobs/{id}/layers?step=,
 * /events and /checkpoints answer with and the SSE stream sends (routes.c): one encoder
 * each, so the two always agree. */
void api_put_layers_fields(api_buf *b, int64_t job, int64_t step, const store_layer_info *info,
                           const store_layer_stat *rows, int n);
void api_put_event_fields(api_buf *b, const store_event *e);
void api_put_ckpt_fields(api_buf *b, int64_t job, const store_checkpoint *ck);

/* Free the server's step-time histograms (prom.c). */
void api_prom_free(api_server *s);

/* What a handler answers. The server turns it into an MHD response. */
typedef ssize_t (*api_reader_fn)(void *cls, uint64_t pos, char *buf, size_t max);

typedef struct api_resp {
    unsigned status;
    const char *ctype; /* static string; NULL: application/json */
    api_buf body;
    char location[96];
    char allow[64];
    char disposition[128];
    bool www_auth;
    int fd; /* >= 0: send this file (closed by MHD) */
    uint64_t fd_size;
    api_reader_fn reader;           /* non-NULL: a body of unknown length produced by reader(cls) */
    void (*reader_free)(void *cls); /* frees cls (also when the response is never sent) */
    void *reader_cls;
    size_t reader_block;            /* the reader's buffer in bytes (0: 64 KiB) */
} api_resp;

/* A request as the handlers see it. */
typedef struct api_req {
    api_server *srv;
    struct MHD_Connection *conn;
    unsigned method; /* API_M_* */
    api_route route;
    const char *path;
    const char *body; /* POST body (NUL-terminated) or NULL */
    size_t body_len;
} api_req;

/* Fill r with a JSON error {"error": {"code", "field", "message"}}; field may be NULL. */
void api_error_resp(api_resp *r, unsigned status, const char *code, const char *field,
                    const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* A query parameter or NULL. */
const char *api_query(const api_req *q, const char *name);
/* An optional integer query parameter in [lo, hi] (dflt when absent); false with a 400
 * naming it in r when malformed. */
bool api_query_int(api_req *q, api_resp *r, const char *name, int64_t lo, int64_t hi,
                   int64_t dflt, int64_t *out);
/* A store error as an HTTP error: 404 naming `what id`, 409, 400, or 503 saying whether the
 * run history could not be read or (writing) written. */
void api_store_error(api_resp *r, int rc, const char *what, int64_t id, bool writing);
/* Load the route's job into j; false with r filled (404, 503) when it cannot be. */
bool api_load_job(api_req *q, api_resp *r, store_job *j);
/* Whether job c (spec: the spec as sent) can ever run here: it fits the machine and its
 * data can train its model; else e says why (answered 422). */
bool api_job_can_run(const api_jobs *jobs, const gpu_job_config *c, json_t *spec, api_error *e);
/* The job object of the API (routes.c): full adds spec (always the last member); st
 * (non-NULL: the store to read them from) adds the job's unigram plateau and its branches
 * before it; jobs: for a queued job's place. */
void api_job_json(api_buf *b, const store_job *j, bool full, store *st, const api_jobs *jobs);

/* Handlers (routes.c, sse.c, prom.c). Each fills r. */
void api_h_job_branch(api_req *q, api_resp *r);
void api_h_healthz(api_req *q, api_resp *r);
void api_h_openapi(api_req *q, api_resp *r);
void api_h_system(api_req *q, api_resp *r);
void api_h_resources(api_req *q, api_resp *r);
void api_h_compare(api_req *q, api_resp *r);
void api_h_jobs_list(api_req *q, api_resp *r);
void api_h_jobs_submit(api_req *q, api_resp *r);
void api_h_job_get(api_req *q, api_resp *r);
void api_h_job_action(api_req *q, api_resp *r); /* cancel, resume, pause, unpause, priority, delete */
void api_h_job_metrics(api_req *q, api_resp *r);
void api_h_job_layers(api_req *q, api_resp *r);
void api_h_job_events(api_req *q, api_resp *r);
void api_h_job_ckpts(api_req *q, api_resp *r);
void api_h_job_ckpt(api_req *q, api_resp *r);
void api_h_prom(api_req *q, api_resp *r);
void api_h_stream(api_req *q, api_resp *r);
void api_h_experiments_list(api_req *q, api_resp *r);   /* experiment.c */
void api_h_experiments_create(api_req *q, api_resp *r);
void api_h_experiment_get(api_req *q, api_resp *r);
void api_h_experiment_action(api_req *q, api_resp *r); /* cancel, delete */
/* A job's unigram plateau (experiment.c): {"unigram_entropy", "unigram_top_freq", "step",
 * "on_plateau", "text"} at its latest eval, or null when its data has no unigram level. */
void api_put_plateau(api_buf *b, store *st, int64_t job);

/* docs/openapi.yaml as JSON (api/openapi_json.c, generated at build time by
 * build-aux/openapi2c.py): api_openapi_json_len bytes, not NUL-terminated. */
extern const char api_openapi_json[];
extern const size_t api_openapi_json_len;

/* Milliseconds on the monotonic clock. */
int64_t api_now_ms(void);

/* The parked SSE streams (sse.c; the watcher thread and api_stop call these). Resume every
 * stream whose store read predates commit count `commits` or whose heartbeat is due at
 * now_ms; *next_ms becomes the earliest heartbeat still pending (unchanged when none is
 * earlier). */
void api_sse_wake(api_server *s, uint64_t commits, int64_t now_ms, int64_t *next_ms);
/* Resume every parked stream and let none park again (the server is stopping). */
void api_sse_wake_all(api_server *s);

/* Probe the CUDA devices that GET /v1/system reports, once per process (routes.c); called
 * by api_start so that no request waits for a driver's start-up. */
void api_system_probe(void);

#endif /* AMPD_API_INT_H */
