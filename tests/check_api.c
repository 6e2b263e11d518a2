/*
 * check_api.c - the HTTP server (api/server.c, routes.c, sse.c, prom.c, encode.c).
 *
 * Three test cases:
 *   units     the pure pieces: strict integer, list and id parsing, the route table, JSON
 *             strings (escapes, invalid UTF-8), numbers (NaN/Infinity, shortest round
 *             trip), CSV and Prometheus numbers and labels, the series encoders (JSON and
 *             CSV, raw and bucketed), the token comparison, JSON depth and compaction,
 *             the per-address limit's addresses (loopback exempt, IPv6 by /64) and counts;
 *             Host values and the --allow-host / --allow-origin checks; the embedded OpenAPI
 *             description against the route table, the metric and layer fields and the
 *             autocast ops the binary knows; the statistics of experiments (t quantiles,
 *             Welch's test, the moments and the unigram plateau) against references.
 *   store     a server over a real store in a temporary directory and no scheduler (the
 *             degraded mode): every GET route, each job's model in words (mlp and gpt, the
 *             spec's defaults, null for a malformed spec), the 4xx errors (404, 405 + Allow, 401 +
 *             WWW-Authenticate, 413 by Content-Length and chunked, 414, 415, 400 naming the
 *             parameter), 503 for submits, metrics as JSON and CSV (raw and downsampled,
 *             NaN and Infinity kept, overflow steps kept), per-layer stats (one step, the
 *             latest, the heatmap with its subsampling, 400s naming the parameter, the
 *             Prometheus gauges), events with a cursor, checkpoint download, compare,
 *             system, Prometheus text parsed line by line,
 *             SSE of a finished job (backlog, resume by Last-Event-ID, `end`), SSE of a
 *             running job followed through the store, the heartbeat, and api_stop ending
 *             open streams at once and returning within its deadline while a handler is
 *             blocked; the accept policy's per-address limit and the sweep of overdue request
 *             heads; a trickled request head and an idle kept-alive connection closed at a
 *             1 s head deadline; a FIFO in the web root answered 404 at once; who may send a
 *             request (421 for a Host that does not name the daemon, 403 for a foreign Origin,
 *             400 for two Content-Length headers, 415 for a change without Content-Type:
 *             application/json) and the allowed hosts and origins.
 *   live      the same server with a real scheduler whose worker is tests/sched_worker.sh:
 *             submit (201, Location, Idempotency-Key -> 200 with the same job for the same
 *             JSON, 422 for another body), the job
 *             runs to succeeded, cancel / resume / delete with 202, 409 and 204, an SSE
 *             client that disconnects and resumes with Last-Event-ID sees every step
 *             exactly once, 100 concurrent SSE clients all see the whole run, a worker's
 *             layers and recommendation lines reach SSE clients, /layers and /events, and
 *             a store that cannot write (store_test_fault): /healthz degraded with the
 *             reason and ok again after, a submit's 503 saying the history could not be
 *             written.
 *
 * The HTTP client is a small raw-socket one (HTTP/1.1, chunked decoding) so the test needs
 * no libcurl. Only 127.0.0.1 is used.
 */
#include <arpa/inet.h>
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gpu/gpu_int.h"
#include "tests/testutil.h"
#include "api/api_int.h"
#include "daemon/line.h"
#include "daemon/sched.h"

#define TOKEN "s3cret-token"

/* ---- a raw HTTP client ----------------------------------------------------------------- */

typedef struct {
    int fd;
    api_buf raw;  /* bytes as received */
    api_buf body; /* decoded body */
    bool hdone, chunked, done, eof;
    int status;
    char headers[8192];
    size_t pos; /* next raw byte to decode */
} hconn;

static void hc_open(hconn *c, unsigned port)
{
    struct sockaddr_in a;
    memset(c, 0, sizeof(*c));
    api_buf_init(&c->raw);
    api_buf_init(&c->body);
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(c->fd, 0);
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(connect(c->fd, (struct sockaddr *)&a, sizeof(a)), 0);
}

static void hc_close(hconn *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    api_buf_free(&c->raw);
    api_buf_free(&c->body);
}

static void hc_send(hconn *c, const char *data, size_t len)
{
    while (len > 0) {
        ssize_t n = send(c->fd, data, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return; /* the server may close early (413): what it answered is still read */
        data += n;
        len -= (size_t)n;
    }
}

/* Decode what has arrived: the head, then the body (chunked or not). */
static void hc_decode(hconn *c)
{
    if (!c->hdone) {
        const char *end = c->raw.data ? strstr(c->raw.data, "\r\n\r\n") : NULL;
        if (!end)
            return;
        size_t hl = (size_t)(end - c->raw.data) + 4;
        ck_assert_uint_lt(hl, sizeof(c->headers));
        memcpy(c->headers, c->raw.data, hl);
        c->headers[hl] = '\0';
        ck_assert_int_eq(sscanf(c->headers, "HTTP/1.%*d %d", &c->status), 1);
        c->hdone = true;
        c->pos = hl;
        for (const char *h = c->headers; (h = strstr(h, "\r\n")) != NULL; h += 2)
            if (strncasecmp(h + 2, "Transfer-Encoding: chunked", 26) == 0)
                c->chunked = true;
    }
    if (!c->chunked) {
        api_buf_put(&c->body, c->raw.data + c->pos, c->raw.len - c->pos);
        c->pos = c->raw.len;
        return;
    }
    while (!c->done) {
        const char *p = c->raw.data + c->pos;
        const char *nl = strstr(p, "\r\n");
        if (!nl)
            return;
        unsigned long n = strtoul(p, NULL, 16);
        size_t need = (size_t)(nl - p) + 2 + n + 2;
        if (c->raw.len - c->pos < need)
            return;
        if (n == 0) {
            c->done = true;
            return;
        }
        api_buf_put(&c->body, nl + 2, n);
        c->pos += need;
    }
}

/* Read what arrives within timeout_ms; false on EOF or timeout without data. */
static bool hc_pump(hconn *c, int timeout_ms)
{
    char buf[65536];
    struct pollfd pf = {c->fd, POLLIN, 0};
    if (c->eof || c->done)
        return false;
    if (poll(&pf, 1, timeout_ms) <= 0)
        return false;
    ssize_t n = recv(c->fd, buf, sizeof(buf), 0);
    if (n <= 0) {
        c->eof = true;
        return false;
    }
    api_buf_put(&c->raw, buf, (size_t)n);
    hc_decode(c);
    return true;
}

/* Pump until the decoded body holds needle; false on EOF or after timeout_ms. */
static bool hc_wait(hconn *c, const char *needle, int timeout_ms)
{
    double end = gpu_now() + timeout_ms / 1000.0;
    while (!(c->body.data && strstr(c->body.data, needle))) {
        int left = (int)((end - gpu_now()) * 1000);
        if (left <= 0 || c->eof || c->done)
            return false;
        hc_pump(c, left < 100 ? left : 100);
    }
    return true;
}

/* Read to the end of the response (close or last chunk). */
static void hc_read_all(hconn *c, int timeout_ms)
{
    double end = gpu_now() + timeout_ms / 1000.0;
    while (!c->eof && !c->done) {
        int left = (int)((end - gpu_now()) * 1000);
        ck_assert_msg(left > 0, "the response did not end in %d ms", timeout_ms);
        hc_pump(c, left < 200 ? left : 200);
    }
}

typedef struct {
    int status;
    char headers[8192];
    char *body;
    size_t len;
} hresp;

static void hresp_free(hresp *r)
{
    free(r->body);
    r->body = NULL;
}

/* One request on a new connection (Connection: close); extra: more header lines, each
 * ending in \r\n. */
static void http(unsigned port, const char *method, const char *path, const char *extra,
                 const char *body, size_t blen, hresp *out)
{
    hconn c;
    char head[16384];
    int n;
    hc_open(&c, port);
    n = snprintf(head, sizeof(head),
                 "%s %s HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nConnection: close\r\n%s", method, path,
                 port, extra ? extra : "");
    if (body)
        n += snprintf(head + n, sizeof(head) - (size_t)n, "Content-Length: %zu\r\n", blen);
    n += snprintf(head + n, sizeof(head) - (size_t)n, "\r\n");
    hc_send(&c, head, (size_t)n);
    if (body)
        hc_send(&c, body, blen);
    hc_read_all(&c, 10000);
    ck_assert(c.hdone);
    out->status = c.status;
    memcpy(out->headers, c.headers, sizeof(out->headers));
    out->body = api_buf_steal(&c.body, &out->len);
    hc_close(&c);
}

/* The value of header name in r (a static copy), or NULL. */
static const char *header(const hresp *r, const char *name)
{
    static char val[1024];
    size_t nl = strlen(name);
    for (const char *h = r->headers; (h = strstr(h, "\r\n")) != NULL; h += 2) {
        if (strncasecmp(h + 2, name, nl) == 0 && h[2 + nl] == ':') {
            const char *v = h + 3 + nl;
            while (*v == ' ')
                v++;
            size_t vl = strcspn(v, "\r");
            snprintf(val, sizeof(val), "%.*s", (int)vl, v);
            return val;
        }
    }
    return NULL;
}

static json_t *json_of(const hresp *r)
{
    json_error_t e;
    json_t *j = json_loadb(r->body, r->len, 0, &e);
    ck_assert_msg(j != NULL, "not JSON (%s): %.300s", e.text, r->body);
    return j;
}

/* GET path expecting status; returns the parsed JSON body (caller decrefs). */
static json_t *get_json(unsigned port, const char *path, int status)
{
    hresp r;
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_msg(r.status == status, "GET %s: %d, expected %d: %.300s", path, r.status, status,
                  r.body);
    ck_assert_str_eq(header(&r, "Content-Type"), "application/json");
    json_t *j = json_of(&r);
    hresp_free(&r);
    return j;
}

/* An error answer: status, code and (when not NULL) the field it names. */
static void expect_error(const hresp *r, int status, const char *code, const char *field)
{
    ck_assert_msg(r->status == status, "status %d, expected %d: %.300s", r->status, status,
                  r->body);
    json_t *j = json_of(r);
    json_t *e = json_object_get(j, "error");
    ck_assert_ptr_nonnull(e);
    ck_assert_str_eq(json_string_value(json_object_get(e, "code")), code);
    ck_assert_ptr_nonnull(json_string_value(json_object_get(e, "message")));
    if (field)
        ck_assert_str_eq(json_string_value(json_object_get(e, "field")), field);
    json_decref(j);
}

static void req_error(unsigned port, const char *method, const char *path, const char *extra,
                      const char *body, int status, const char *code, const char *field)
{
    hresp r;
    http(port, method, path, extra, body, body ? strlen(body) : 0, &r);
    expect_error(&r, status, code, field);
    hresp_free(&r);
}

/* A whole request as given (head and body) on a new connection; out gets the first response
 * and *answers the number of responses that came back before the server closed. */
static void raw_http(unsigned port, const char *request, hresp *out, int *answers)
{
    hconn c;
    hc_open(&c, port);
    hc_send(&c, request, strlen(request));
    while (hc_pump(&c, 2000))
        ;
    ck_assert_msg(c.eof, "the server kept the connection open after %.200s", request);
    ck_assert(c.hdone);
    *answers = 0;
    for (const char *h = c.raw.data; h && (h = strstr(h, "HTTP/1.1 ")) != NULL; h++)
        (*answers)++;
    out->status = c.status;
    memcpy(out->headers, c.headers, sizeof(out->headers));
    out->body = api_buf_steal(&c.body, &out->len);
    hc_close(&c);
}

/* GET path with the given Host (NULL: none) and extra header lines; the status. */
static int get_as(unsigned port, const char *path, const char *host, const char *extra)
{
    char req[1024];
    hresp r;
    int n;
    snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\n%s%s%sConnection: close\r\n%s\r\n", path,
             host ? "Host: " : "", host ? host : "", host ? "\r\n" : "", extra ? extra : "");
    raw_http(port, req, &r, &n);
    int status = r.status;
    if (status != 200)
        expect_error(&r, status,
                     status == 421   ? "misdirected_request"
                     : status == 403 ? "forbidden_origin"
                                     : "invalid_request",
                     NULL);
    hresp_free(&r);
    return status;
}

/* ---- unit tests ------------------------------------------------------------------------ */

START_TEST(test_parse_int)
{
    int64_t v;
    ck_assert_int_eq(api_parse_i64("42", 0, 100, &v), 0);
    ck_assert_int_eq(v, 42);
    ck_assert_int_eq(api_parse_i64("-7", -10, 10, &v), 0);
    ck_assert_int_eq(v, -7);
    ck_assert_int_eq(api_parse_i64("9223372036854775807", 0, INT64_MAX, &v), 0);
    ck_assert(v == INT64_MAX);
    ck_assert_int_eq(api_parse_i64("-9223372036854775808", INT64_MIN, 0, &v), 0);
    ck_assert(v == INT64_MIN);
    const char *bad[] = {"",
                         "-",
                         "+1",
                         " 1",
                         "1 ",
                         "1a",
                         "0x10",
                         "1.0",
                         "1e3",
                         "9223372036854775808",
                         "-9223372036854775809",
                         "99999999999999999999999",
                         "101",
                         "-1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        ck_assert_msg(api_parse_i64(bad[i], 0, 100, &v) != 0, "accepted \"%s\"", bad[i]);
    ck_assert(api_parse_i64(NULL, 0, 1, &v) != 0);
}
END_TEST

START_TEST(test_parse_lists)
{
    int f[STORE_M_NFIELDS], n;
    int64_t ids[4];
    char err[160];
    ck_assert_int_eq(api_parse_fields("loss,loss_scale,eval_acc", f, &n, err, sizeof(err)), 0);
    ck_assert_int_eq(n, 3);
    ck_assert_int_eq(f[0], STORE_M_LOSS);
    ck_assert_int_eq(f[1], STORE_M_LOSS_SCALE);
    ck_assert_int_eq(f[2], STORE_M_EVAL_ACC);
    ck_assert_int_ne(api_parse_fields("loss,bogus", f, &n, err, sizeof(err)), 0);
    ck_assert_ptr_nonnull(strstr(err, "bogus"));
    ck_assert_int_ne(api_parse_fields("loss,,lr", f, &n, err, sizeof(err)), 0);
    ck_assert_int_ne(api_parse_fields("loss,loss", f, &n, err, sizeof(err)), 0);
    ck_assert_int_ne(api_parse_fields("", f, &n, err, sizeof(err)), 0);
    ck_assert_int_ne(api_parse_fields("loss,", f, &n, err, sizeof(err)), 0);

    ck_assert_int_eq(api_parse_ids("3,1,2", ids, 4, &n, err, sizeof(err)), 0);
    ck_assert_int_eq(n, 3);
    ck_assert(ids[0] == 3 && ids[1] == 1 && ids[2] == 2);
    ck_assert_int_ne(api_parse_ids("1,x", ids, 4, &n, err, sizeof(err)), 0);
    ck_assert_ptr_nonnull(strstr(err, "\"x\""));
    ck_assert_int_ne(api_parse_ids("1,0", ids, 4, &n, err, sizeof(err)), 0);
    ck_assert_int_ne(api_parse_ids("1,1", ids, 4, &n, err, sizeof(err)), 0);
    ck_assert_int_ne(api_parse_ids("1,2,3,4,5", ids, 4, &n, err, sizeof(err)), 0);
    ck_assert_int_ne(api_parse_ids("", ids, 4, &n, err, sizeof(err)), 0);
    ck_assert_int_ne(api_parse_ids("1,-2", ids, 4, &n, err, sizeof(err)), 0);
}
END_TEST

/* Host values and the --allow-host / --allow-origin checks. */
START_TEST(test_host_parse)
{
    static const struct {
        const char *v, *name;
        int port;
    } ok[] = {{"localhost", "localhost", -1},  {"LocalHost:8080", "localhost", 8080},
              {"127.0.0.1:1", "127.0.0.1", 1}, {"[::1]:65535", "[::1]", 65535},
              {"[::1]", "[::1]", -1},          {"ampd.example.org", "ampd.example.org", -1},
              {"my_host-2:0", "my_host-2", 0}};
    static const char *const bad[] = {"",        ":80",   "a:",           "a:x",     "a:65536",
                                      "a:-1",    "a:+80", "a:080000",     "a b",     "a/b",
                                      "a:80/",   "[::1",  "[]:80",        "[::1]80", "[::g]",
                                      "a:80:90", "a@b",   "evil.com\r\nX"};
    api_host h;
    char err[400];
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        ck_assert_msg(api_host_parse(ok[i].v, &h) == 0, "refused %s", ok[i].v);
        ck_assert_str_eq(h.name, ok[i].name);
        ck_assert_int_eq(h.port, ok[i].port);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        ck_assert_msg(api_host_parse(bad[i], &h) != 0, "accepted \"%s\"", bad[i]);
    ck_assert_int_ne(api_host_parse(NULL, &h), 0);

    ck_assert_int_eq(api_check_allow_host("ampd.example.org", err, sizeof(err)), 0);
    ck_assert_int_eq(api_check_allow_host("ampd.example.org:8443", err, sizeof(err)), 0);
    ck_assert_int_eq(api_check_allow_host("[fd00::1]:80", err, sizeof(err)), 0);
    ck_assert_int_eq(api_check_allow_host("a:0", err, sizeof(err)), GPU_EINVAL);
    ck_assert_int_eq(api_check_allow_host("http://a", err, sizeof(err)), GPU_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "\"http://a\" is not NAME or NAME:PORT"));

    ck_assert_int_eq(api_check_allow_origin("http://ampd.example.org", err, sizeof(err)), 0);
    ck_assert_int_eq(api_check_allow_origin("https://ampd.example.org:8443", err, sizeof(err)), 0);
    ck_assert_int_eq(api_check_allow_origin("http://[::1]:8080", err, sizeof(err)), 0);
    static const char *const bad_origins[] = {"ampd.example.org", "http://",     "http://a/",
                                              "http://a/x",       "ftp://a",     "null",
                                              "http://a:0",       "https://a:x", ""};
    for (size_t i = 0; i < sizeof(bad_origins) / sizeof(bad_origins[0]); i++)
        ck_assert_msg(api_check_allow_origin(bad_origins[i], err, sizeof(err)) == GPU_EINVAL,
                      "accepted %s", bad_origins[i]);
    ck_assert_ptr_nonnull(strstr(err, "is not an origin"));
}
END_TEST

START_TEST(test_routes)
{
    static const struct {
        const char *path;
        api_route_id id;
        int64_t job, step;
        unsigned allow;
    } ok[] = {
        {"/healthz", API_R_HEALTHZ, -1, -1, API_M_GET | API_M_HEAD},
        {"/metrics", API_R_PROM, -1, -1, API_M_GET | API_M_HEAD},
        {"/v1/system", API_R_SYSTEM, -1, -1, API_M_GET | API_M_HEAD},
        {"/v1/compare", API_R_COMPARE, -1, -1, API_M_GET | API_M_HEAD},
        {"/v1/jobs", API_R_JOBS, -1, -1, API_M_GET | API_M_HEAD | API_M_POST},
        {"/v1/jobs/", API_R_JOBS, -1, -1, API_M_GET | API_M_HEAD | API_M_POST},
        {"/v1/jobs/17", API_R_JOB, 17, -1, API_M_GET | API_M_HEAD | API_M_DELETE},
        {"/v1/jobs/abc", API_R_JOB, -1, -1, API_M_GET | API_M_HEAD | API_M_DELETE},
        {"/v1/jobs/007", API_R_JOB, -1, -1, API_M_GET | API_M_HEAD | API_M_DELETE},
        {"/v1/jobs/0", API_R_JOB, -1, -1, API_M_GET | API_M_HEAD | API_M_DELETE},
        {"/v1/jobs/99999999999999999999", API_R_JOB, -1, -1, API_M_GET | API_M_HEAD | API_M_DELETE},
        {"/v1/jobs/5/cancel", API_R_JOB_CANCEL, 5, -1, API_M_POST},
        {"/v1/jobs/5/resume", API_R_JOB_RESUME, 5, -1, API_M_POST},
        {"/v1/jobs/5/metrics", API_R_JOB_METRICS, 5, -1, API_M_GET | API_M_HEAD},
        {"/v1/jobs/5/layers", API_R_JOB_LAYERS, 5, -1, API_M_GET | API_M_HEAD},
        {"/v1/jobs/5/events", API_R_JOB_EVENTS, 5, -1, API_M_GET | API_M_HEAD},
        {"/v1/jobs/5/stream", API_R_JOB_STREAM, 5, -1, API_M_GET | API_M_HEAD},
        {"/v1/jobs/5/checkpoints", API_R_JOB_CKPTS, 5, -1, API_M_GET | API_M_HEAD},
        {"/v1/jobs/5/checkpoints/", API_R_JOB_CKPTS, 5, -1, API_M_GET | API_M_HEAD},
        {"/v1/jobs/5/checkpoints/500", API_R_JOB_CKPT, 5, 500, API_M_GET | API_M_HEAD},
        {"/v1/jobs/5/checkpoints/0", API_R_JOB_CKPT, 5, 0, API_M_GET | API_M_HEAD},
        {"/v1/jobs/5/checkpoints/x", API_R_JOB_CKPT, 5, -1, API_M_GET | API_M_HEAD},
    };
    static const char *const bad[] = {"",
                                      "healthz",
                                      "/",
                                      "/v1",
                                      "/v1/",
                                      "/v2/jobs",
                                      "/v1/jobsx",
                                      "/v1/jobs/5/nope",
                                      "/v1/jobs/5/cancel/x",
                                      "/v1/jobs/5/metrics/1",
                                      "/v1/jobs/5/checkpoints/1/2",
                                      "/healthz/x",
                                      "/index.html"};
    api_route r;
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        ck_assert_msg(api_route_match(ok[i].path, false, &r) == 0, "%s unmatched", ok[i].path);
        ck_assert_msg(r.id == ok[i].id, "%s: route %d", ok[i].path, (int)r.id);
        ck_assert_msg(r.job == ok[i].job, "%s: job %lld", ok[i].path, (long long)r.job);
        ck_assert_msg(r.step == ok[i].step, "%s: step %lld", ok[i].path, (long long)r.step);
        ck_assert_msg(r.allow == ok[i].allow, "%s: allow %u", ok[i].path, r.allow);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        ck_assert_msg(api_route_match(bad[i], false, &r) != 0, "%s matched", bad[i]);
    /* with static files, unknown non-API paths are files */
    ck_assert_int_eq(api_route_match("/", true, &r), 0);
    ck_assert_int_eq(r.id, API_R_STATIC);
    ck_assert_int_eq(api_route_match("/app.js", true, &r), 0);
    ck_assert_int_eq(r.id, API_R_STATIC);
    ck_assert_int_ne(api_route_match("/v1/nope", true, &r), 0);

    char allow[64];
    api_allow_string(API_M_GET | API_M_HEAD | API_M_POST, allow, sizeof(allow));
    ck_assert_str_eq(allow, "GET, HEAD, POST");
    api_allow_string(API_M_POST, allow, sizeof(allow));
    ck_assert_str_eq(allow, "POST");
    ck_assert_uint_eq(api_method_bit("DELETE"), API_M_DELETE);
    ck_assert_uint_eq(api_method_bit("PUT"), 0);
    ck_assert_uint_eq(api_method_bit("get"), 0);
}
END_TEST

/* Encode s as a JSON string, parse it back and compare with want. */
static void json_str_roundtrip(const char *s, const char *want)
{
    api_buf b;
    json_error_t e;
    api_buf_init(&b);
    api_buf_putc(&b, '[');
    api_buf_json_str(&b, s);
    api_buf_putc(&b, ']');
    json_t *j = json_loads(b.data, 0, &e);
    ck_assert_msg(j != NULL, "invalid JSON %s: %s", b.data, e.text);
    ck_assert_str_eq(json_string_value(json_array_get(j, 0)), want);
    json_decref(j);
    api_buf_free(&b);
}

START_TEST(test_json_strings)
{
    json_str_roundtrip("plain", "plain");
    json_str_roundtrip("q\"b\\s/", "q\"b\\s/");
    json_str_roundtrip("tab\tnl\ncr\r\x01\x1f", "tab\tnl\ncr\r\x01\x1f");
    json_str_roundtrip("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80",
                       "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
    /* invalid UTF-8: a lone continuation byte, a truncated sequence, an overlong slash,
     * a surrogate, 0xFF */
    json_str_roundtrip("a\x80z", "a\xef\xbf\xbdz");
    json_str_roundtrip("a\xe2\x82", "a\xef\xbf\xbd\xef\xbf\xbd");
    json_str_roundtrip("\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd");
    json_str_roundtrip("\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
    json_str_roundtrip("\xff", "\xef\xbf\xbd");
    api_buf b;
    api_buf_init(&b);
    api_buf_json_str(&b, NULL);
    ck_assert_str_eq(b.data, "null");
    api_buf_free(&b);
}
END_TEST

static const char *num_text(void (*fn)(api_buf *, double), double v, api_buf *b)
{
    api_buf_reset(b);
    fn(b, v);
    return b->data;
}

START_TEST(test_numbers)
{
    api_buf b;
    api_buf_init(&b);
    ck_assert_str_eq(num_text(api_buf_json_num, NAN, &b), "\"NaN\"");
    ck_assert_str_eq(num_text(api_buf_json_num, INFINITY, &b), "\"Infinity\"");
    ck_assert_str_eq(num_text(api_buf_json_num, -INFINITY, &b), "\"-Infinity\"");
    ck_assert_str_eq(num_text(api_buf_json_num, 65536.0, &b), "65536.0");
    ck_assert_str_eq(num_text(api_buf_json_num, 0.5, &b), "0.5");
    ck_assert_str_eq(num_text(api_buf_json_num, 0.001, &b), "0.001");
    ck_assert_str_eq(num_text(api_buf_json_num, 0.1, &b), "0.1");
    ck_assert_str_eq(num_text(api_buf_csv_num, NAN, &b), "NaN");
    ck_assert_str_eq(num_text(api_buf_csv_num, INFINITY, &b), "Inf");
    ck_assert_str_eq(num_text(api_buf_csv_num, -INFINITY, &b), "-Inf");
    ck_assert_str_eq(num_text(api_buf_csv_num, store_missing(), &b), "");
    ck_assert_str_eq(num_text(api_buf_json_num, store_missing(), &b), "null");
    ck_assert(!store_is_missing(NAN) && isnan(store_missing()));
    ck_assert_str_eq(num_text(api_buf_csv_num, 3.0, &b), "3");
    ck_assert_str_eq(num_text(api_buf_prom_num, NAN, &b), "NaN");
    ck_assert_str_eq(num_text(api_buf_prom_num, INFINITY, &b), "+Inf");
    ck_assert_str_eq(num_text(api_buf_prom_num, -INFINITY, &b), "-Inf");
    /* every finite double reads back exactly */
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < 50000; i++) {
        double v;
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        memcpy(&v, &x, sizeof(v));
        if (!isfinite(v))
            continue;
        num_text(api_buf_json_num, v, &b);
        ck_assert_msg(strtod(b.data, NULL) == v || (v == 0 && strtod(b.data, NULL) == 0),
                      "%s != %.17g", b.data, v);
        json_t *j = json_loads(b.data, JSON_DECODE_ANY, NULL);
        ck_assert_msg(j != NULL, "not a JSON number: %s", b.data);
        json_decref(j);
    }
    api_buf_reset(&b);
    api_buf_json_time(&b, 0);
    ck_assert_str_eq(b.data, "null");
    api_buf_reset(&b);
    api_buf_json_time(&b, 1700000000.25);
    ck_assert_str_eq(b.data, "\"2023-11-14T22:13:20.250Z\"");
    api_buf_free(&b);
}
END_TEST

START_TEST(test_prom_label)
{
    api_buf b;
    api_buf_init(&b);
    api_buf_prom_label(&b, "a\"b\\c\nd\xff");
    ck_assert_str_eq(b.data, "a\\\"b\\\\c\\nd\xef\xbf\xbd");
    api_buf_free(&b);
}
END_TEST

/* The per-address limit's addresses and counts (conn.c). */
static socklen_t sa4(struct sockaddr_storage *ss, const char *ip)
{
    struct sockaddr_in *a = (struct sockaddr_in *)ss;
    memset(ss, 0, sizeof(*ss));
    a->sin_family = AF_INET;
    ck_assert_int_eq(inet_pton(AF_INET, ip, &a->sin_addr), 1);
    return sizeof(*a);
}

static socklen_t sa6(struct sockaddr_storage *ss, const char *ip)
{
    struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
    memset(ss, 0, sizeof(*ss));
    a->sin6_family = AF_INET6;
    ck_assert_int_eq(inet_pton(AF_INET6, ip, &a->sin6_addr), 1);
    return sizeof(*a);
}

START_TEST(test_peer_addresses)
{
    struct sockaddr_storage ss;
    api_addr a, b;
    api_peers p;
    socklen_t n;

    /* loopback is exempt, in every spelling */
    n = sa4(&ss, "127.0.0.1");
    ck_assert(!api_addr_of((struct sockaddr *)&ss, n, &a));
    n = sa4(&ss, "127.200.3.4");
    ck_assert(!api_addr_of((struct sockaddr *)&ss, n, &a));
    n = sa6(&ss, "::1");
    ck_assert(!api_addr_of((struct sockaddr *)&ss, n, &a));
    n = sa6(&ss, "::ffff:127.0.0.1");
    ck_assert(!api_addr_of((struct sockaddr *)&ss, n, &a));
    ck_assert(!api_addr_of(NULL, 0, &a));
    n = sa4(&ss, "10.0.0.1");
    ck_assert(!api_addr_of((struct sockaddr *)&ss, n - 1, &a)); /* short */
    /* an IPv4 address and its IPv4-mapped IPv6 form are one address */
    ck_assert(api_addr_of((struct sockaddr *)&ss, n, &a));
    n = sa6(&ss, "::ffff:10.0.0.1");
    ck_assert(api_addr_of((struct sockaddr *)&ss, n, &b));
    ck_assert_mem_eq(a.b, b.b, sizeof(a.b));
    n = sa4(&ss, "10.0.0.2");
    ck_assert(api_addr_of((struct sockaddr *)&ss, n, &b));
    ck_assert(memcmp(a.b, b.b, sizeof(a.b)) != 0);
    /* IPv6 by its /64 */
    n = sa6(&ss, "2001:db8:1:2::1");
    ck_assert(api_addr_of((struct sockaddr *)&ss, n, &a));
    n = sa6(&ss, "2001:db8:1:2:ffff:1:2:3");
    ck_assert(api_addr_of((struct sockaddr *)&ss, n, &b));
    ck_assert_mem_eq(a.b, b.b, sizeof(a.b));
    n = sa6(&ss, "2001:db8:1:3::1");
    ck_assert(api_addr_of((struct sockaddr *)&ss, n, &b));
    ck_assert(memcmp(a.b, b.b, sizeof(a.b)) != 0);
    n = sa6(&ss, "::2"); /* not loopback, not IPv4 */
    ck_assert(api_addr_of((struct sockaddr *)&ss, n, &b));

    /* counts: up and down, forgotten at 0, many addresses in the buckets */
    memset(&p, 0, sizeof(p));
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(api_peers_add(&p, &a), 0);
    ck_assert_uint_eq(api_peers_count(&p, &a), 3);
    ck_assert_uint_eq(api_peers_count(&p, &b), 0);
    api_peers_del(&p, &b); /* not counted: nothing happens */
    api_peers_del(&p, &a);
    ck_assert_uint_eq(api_peers_count(&p, &a), 2);
    for (int i = 0; i < 5000; i++) {
        char ip[32];
        api_addr x;
        snprintf(ip, sizeof(ip), "10.%d.%d.1", i / 250, i % 250);
        n = sa4(&ss, ip);
        ck_assert(api_addr_of((struct sockaddr *)&ss, n, &x));
        ck_assert_int_eq(api_peers_add(&p, &x), 0);
    }
    ck_assert_uint_eq(p.naddrs, 5001);
    api_peers_del(&p, &a);
    api_peers_del(&p, &a);
    ck_assert_uint_eq(api_peers_count(&p, &a), 0);
    ck_assert_uint_eq(p.naddrs, 5000);
    api_peers_free(&p);
    ck_assert_uint_eq(p.naddrs, 0);
    api_peers_free(NULL);
}
END_TEST

/* The statistics of an experiment's verdicts (stats.c) against references: Student's t
 * quantiles from the standard tables (to 9 digits), p-values and a Welch test from Simpson's
 * rule on the t density in fp64 (200000 intervals), the moments by hand. */
START_TEST(test_stats)
{
    static const struct {
        double df, q;
    } table[] = {{1, 12.706204736}, {2, 4.302652730}, {5, 2.570581836},
                 {10, 2.228138852}, {30, 2.042272456}, {120, 1.979930405}};
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        ck_assert_double_eq_tol(api_t_quantile975(table[i].df), table[i].q, 2e-8 * table[i].q);
    ck_assert_double_eq_tol(api_t_two_sided_p(2.0, 10), 0.07338803477, 1e-9);
    ck_assert_double_eq_tol(api_t_two_sided_p(-2.0, 10), 0.07338803477, 1e-9);
    ck_assert_double_eq_tol(api_t_two_sided_p(0, 3), 1.0, 1e-12);
    ck_assert(isnan(api_t_two_sided_p(1, 0)));

    const double a[] = {1, 2, 3, 4, 5}, b[] = {2, 4, NAN, 6, 8, 10};
    api_moments ma, mb, one;
    api_moments_of(a, 5, &ma);
    api_moments_of(b, 6, &mb); /* the NaN is skipped */
    ck_assert_int_eq(ma.n, 5);
    ck_assert_int_eq(mb.n, 5);
    ck_assert_double_eq_tol(ma.mean, 3, 1e-15);
    ck_assert_double_eq_tol(ma.sd, sqrt(2.5), 1e-15);
    ck_assert_double_eq_tol(mb.sd, sqrt(10), 1e-14);
    ck_assert(ma.min == 1 && ma.max == 5 && mb.min == 2 && mb.max == 10);
    api_welch_result w;
    api_welch(&ma, &mb, &w);
    ck_assert_double_eq_tol(w.diff, -3, 1e-15);
    ck_assert_double_eq_tol(w.t, -1.8973665961, 1e-9);
    ck_assert_double_eq_tol(w.df, 5.8823529412, 1e-9);
    ck_assert_double_eq_tol(w.p, 0.1075311949, 1e-9);
    ck_assert_int_eq(w.verdict, API_V_WITHIN);
    /* the interval's half-width is the quantile times the standard error */
    ck_assert_double_eq_tol(w.half, api_t_quantile975(w.df) * sqrt(2.5), 1e-12);

    /* a clear difference, then too few seeds, then no spread at all */
    const double c[] = {10, 10.5, 11, 11.5, 12};
    api_moments mc, ms, mo;
    api_moments_of(c, 5, &mc);
    api_welch(&mc, &ma, &w);
    ck_assert_int_eq(w.verdict, API_V_OUTSIDE);
    ck_assert(w.p < 1e-4);
    api_moments_of(a, 1, &one);
    ck_assert(isnan(one.sd));
    api_welch(&one, &ma, &w);
    ck_assert_int_eq(w.verdict, API_V_FEW_SEEDS);
    ck_assert_double_eq_tol(w.diff, -2, 1e-15);
    /* equal values have no spread, even where their sum does not divide back exactly */
    const double mem[] = {243400768, 243400768, 243400768}, tenth[] = {0.1, 0.1, 0.1};
    api_moments_of(mem, 3, &ms);
    ck_assert(ms.sd == 0 && ms.mean == 243400768);
    api_moments_of(tenth, 3, &ms);
    ck_assert(ms.sd == 0 && ms.mean == 0.1);
    const double same[] = {7, 7, 7}, other[] = {8, 8, 8};
    api_moments_of(same, 3, &ms);
    api_moments_of(other, 3, &mo);
    api_welch(&ms, &ms, &w);
    ck_assert_int_eq(w.verdict, API_V_WITHIN);
    api_welch(&mo, &ms, &w);
    ck_assert_int_eq(w.verdict, API_V_OUTSIDE);

    /* the plateau: fortunes' unigram entropy 3.315 nats, the top byte 15.8% */
    ck_assert(api_on_plateau(3.26, 0.159, 3.315, 0.158));
    ck_assert(api_on_plateau(3.94, 0.155, 3.315, 0.158));  /* not even there yet */
    ck_assert(!api_on_plateau(2.98, 0.21, 3.315, 0.158));  /* left it */
    ck_assert(!api_on_plateau(3.2, 0.25, 3.315, 0.158));   /* the accuracy says it left */
    ck_assert(api_on_plateau(3.2, NAN, 3.315, 0.158));     /* no accuracy: the loss decides */
    ck_assert(!api_on_plateau(3.26, 0.159, NAN, 0.158));   /* no unigram level known */
    ck_assert(!api_on_plateau(NAN, 0.159, 3.315, 0.158));
}
END_TEST

START_TEST(test_misc)
{
    ck_assert(api_token_equal("abc", 3, "abc"));
    ck_assert(!api_token_equal("abd", 3, "abc"));
    ck_assert(!api_token_equal("ab", 2, "abc"));
    ck_assert(!api_token_equal("abcd", 4, "abc"));
    ck_assert(!api_token_equal("", 0, ""));
    ck_assert_int_eq(api_json_depth("{\"a\":[1,{\"b\":\"[[[\"}]}", 22), 3);
    ck_assert_int_eq(api_json_depth("1", 1), 0);

    const char *in = "{ \"a\" : [1, 2],\n\t\"s\": \"x y \\\" z\" }";
    api_buf b;
    api_buf_init(&b);
    api_buf_json_compact(&b, in, strlen(in));
    ck_assert_str_eq(b.data, "{\"a\":[1,2],\"s\":\"x y \\\" z\"}");
    api_buf_reset(&b);
    for (int i = 0; i < 100000; i++)
        api_buf_puts(&b, "0123456789");
    ck_assert_uint_eq(b.len, 1000000);
    ck_assert(!b.oom);
    size_t len;
    char *s = api_buf_steal(&b, &len);
    ck_assert_uint_eq(len, 1000000);
    ck_assert_uint_eq(b.len, 0);
    free(s);
}
END_TEST

/* A hand-made series: a bucket, an overflow step and a NaN step. */
static void make_series(store_series *se, double *vals)
{
    static store_point pts[3];
    memset(se, 0, sizeof(*se));
    se->nfields = 2;
    se->fields[0] = STORE_M_LOSS;
    se->fields[1] = STORE_M_LOSS_SCALE;
    se->npoints = 3;
    se->points = pts;
    se->total_steps = 12;
    /* point i uses vals[6i .. 6i+5]: min[2], max[2], last[2] */
    pts[0] = (store_point){1, 10, 10, 0, vals, vals + 2, vals + 4};
    pts[1] =
        (store_point){5, 5, 1, STORE_F_OVERFLOW | STORE_F_SKIPPED, vals + 6, vals + 8, vals + 10};
    pts[2] = (store_point){11, 11, 1, STORE_F_NONFINITE, vals + 12, vals + 14, vals + 16};
}

START_TEST(test_series_json)
{
    double v[18] = {0.5, 1024,  2.0, 65536, 0.7, 2048,  /* bucket */
                    1.5, 32768, 1.5, 32768, 1.5, 32768, /* overflow step */
                    NAN, 8,     NAN, 8,     NAN, 8};    /* NaN step */
    store_series se;
    api_series_enc e;
    api_buf b;
    make_series(&se, v);
    memset(&e, 0, sizeof(e));
    e.nfields = 2;
    e.fields[0] = STORE_M_LOSS;
    e.fields[1] = STORE_M_LOSS_SCALE;
    api_buf_init(&b);
    api_series_begin(&e, &b, 7);
    api_series_points(&e, &b, &se, 0, se.npoints);
    api_series_end(&e, &b, se.total_steps);
    json_t *j = json_loads(b.data, 0, NULL);
    ck_assert_msg(j != NULL, "invalid JSON: %s", b.data);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "job")), 7);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total_steps")), 12);
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(j, "fields"), 1)),
                     "loss_scale");
    json_t *p = json_object_get(j, "points");
    ck_assert_int_eq(json_array_size(p), 3);
    json_t *p0 = json_array_get(p, 0), *p1 = json_array_get(p, 1), *p2 = json_array_get(p, 2);
    ck_assert_int_eq(json_integer_value(json_object_get(p0, "count")), 10);
    ck_assert_int_eq(json_integer_value(json_object_get(p0, "step_last")), 10);
    ck_assert(json_is_false(json_object_get(p0, "overflow")));
    ck_assert(json_real_value(json_object_get(json_object_get(p0, "loss"), "min")) == 0.5);
    ck_assert(json_real_value(json_object_get(json_object_get(p0, "loss"), "max")) == 2.0);
    ck_assert(json_real_value(json_object_get(json_object_get(p0, "loss"), "last")) == 0.7);
    ck_assert(json_real_value(json_object_get(json_object_get(p0, "loss_scale"), "last")) == 2048);
    ck_assert(json_is_true(json_object_get(p1, "overflow")));
    ck_assert(json_is_true(json_object_get(p1, "skipped")));
    ck_assert(json_real_value(json_object_get(p1, "loss")) == 1.5); /* raw: a plain value */
    ck_assert(json_is_true(json_object_get(p2, "nonfinite")));
    ck_assert_str_eq(json_string_value(json_object_get(p2, "loss")), "NaN");
    json_decref(j);

    /* the same JSON written in pieces (as a streamed response is) */
    api_buf whole, parts;
    api_buf_init(&whole);
    api_buf_init(&parts);
    api_series_begin(&e, &whole, 7);
    api_series_points(&e, &whole, &se, 0, se.npoints);
    api_series_end(&e, &whole, 12);
    api_series_begin(&e, &parts, 7);
    for (int i = 0; i < se.npoints; i++)
        api_series_points(&e, &parts, &se, i, 1);
    api_series_end(&e, &parts, 12);
    ck_assert_str_eq(whole.data, parts.data);
    api_buf_free(&whole);
    api_buf_free(&parts);

    /* CSV, bucketed */
    api_buf_reset(&b);
    e.csv = true;
    api_series_begin(&e, &b, 7);
    api_series_points(&e, &b, &se, 0, se.npoints);
    api_series_end(&e, &b, se.total_steps);
    ck_assert_str_eq(b.data, "step,step_last,count,flags,loss_min,loss_max,loss_last,"
                             "loss_scale_min,loss_scale_max,loss_scale_last\n"
                             "1,10,10,0,0.5,2,0.7,1024,65536,2048\n"
                             "5,5,1,3,1.5,1.5,1.5,32768,32768,32768\n"
                             "11,11,1,4,NaN,NaN,NaN,8,8,8\n");
    /* CSV, raw */
    api_buf_reset(&b);
    e.raw = true;
    se.npoints = 2;
    se.points++;
    api_series_begin(&e, &b, 7);
    api_series_points(&e, &b, &se, 0, se.npoints);
    api_series_end(&e, &b, 2);
    ck_assert_str_eq(b.data, "step,loss,loss_scale\n5,1.5,32768\n11,NaN,8\n");
    api_buf_free(&b);
}
END_TEST

/* ---- a server over a store ------------------------------------------------------------- */

static char dir[256], dbpath[320];
static store *st;
static api_server *srv;
static unsigned port;
static daemon_sched *sc;

static void start_server(daemon_sched *with)
{
    api_config c;
    api_jobs jobs;
    char err[256];
    memset(&c, 0, sizeof(c));
    snprintf(c.listen, sizeof(c.listen), "127.0.0.1:0");
    snprintf(c.token, sizeof(c.token), "%s", TOKEN);
    c.max_body = 4096;
    c.metrics_keep_s = 3600;
    api_spec_opts_default(&c.spec);
    if (with)
        daemon_sched_api(with, &jobs);
    ck_assert_msg(api_start(&c, st, with ? &jobs : NULL, &srv, err, sizeof(err)) == 0, "%s", err);
    port = api_port(srv);
    ck_assert_uint_gt(port, 0);
}

static void store_setup(void)
{
    setenv("AMPD_SSE_HEARTBEAT_MS", "100", 1);
    snprintf(dir, sizeof(dir), "/tmp/check_api.XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(dbpath, sizeof(dbpath), "%s/ampd.db", dir);
    ck_assert_int_eq(store_open(dbpath, &st), 0);
    sc = NULL;
    start_server(NULL);
}

static void store_teardown(void)
{
    char cmd[400];
    api_stop(srv);
    srv = NULL;
    daemon_sched_stop(sc);
    sc = NULL;
    store_close(st);
    st = NULL;
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    ck_assert_int_eq(system(cmd), 0);
}

static int64_t add_job(const char *name, const char *dtype, int64_t steps)
{
    int64_t id;
    bool existed;
    char spec[256];
    snprintf(spec, sizeof(spec), "{\"name\":\"%s\",\"steps\":%lld}", name, (long long)steps);
    ck_assert_int_eq(store_job_insert(st, name, dtype, steps, spec, NULL, &id, &existed), 0);
    return id;
}

/* Rows 1..n for job: loss 1/step, overflow at multiples of 97, NaN loss at 50, +Inf at 51,
 * eval at multiples of 100. */
static void add_rows(int64_t job, int64_t first, int64_t n)
{
    for (int64_t s = first; s < first + n; s++) {
        store_metric m;
        memset(&m, 0, sizeof(m));
        m.job_id = job;
        m.step = s;
        for (int f = 0; f < STORE_M_NFIELDS; f++)
            m.v[f] = 0;
        m.v[STORE_M_LOSS] = s == 50 ? NAN : s == 51 ? INFINITY : 1.0 / (double)s;
        m.v[STORE_M_LR] = 0.001;
        m.v[STORE_M_LOSS_SCALE] = 65536;
        m.v[STORE_M_OVERFLOW] = m.v[STORE_M_SKIPPED] = s % 97 == 0;
        m.v[STORE_M_OVERFLOW_TOTAL] = m.v[STORE_M_SKIPPED_TOTAL] = (double)(s / 97);
        m.v[STORE_M_STEP_MS] = 25;
        m.v[STORE_M_SAMPLES_PER_S] = 10000;
        m.v[STORE_M_MEM_BYTES] = 1 << 20;
        m.v[STORE_M_COMM_BYTES] = 4096;
        m.v[STORE_M_COMM_MS] = 2;
        m.v[STORE_M_COMM_EXPOSED_MS] = 0.5;
        m.v[STORE_M_STEP_MS_MAX] = 30;
        m.v[STORE_M_SLOWEST_RANK] = 1;
        m.v[STORE_M_EVAL_LOSS] = m.v[STORE_M_EVAL_ACC] = NAN;
        if (s % 100 == 0) {
            m.has_eval = true;
            m.v[STORE_M_EVAL_LOSS] = 0.25;
            m.v[STORE_M_EVAL_ACC] = 0.9;
        }
        ck_assert_int_eq(store_metric_append(st, &m), 0);
    }
    ck_assert_int_eq(store_flush(st), 0);
}

START_TEST(test_basics)
{
    json_t *j = get_json(port, "/healthz", 200);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")), "ok");
    json_decref(j);

    req_error(port, "GET", "/nope", NULL, NULL, 404, "not_found", NULL);
    req_error(port, "GET", "/", NULL, NULL, 404, "not_found", NULL);
    req_error(port, "GET", "/v1/jobs/abc", NULL, NULL, 404, "not_found", NULL);
    req_error(port, "GET", "/v1/jobs/12345", NULL, NULL, 404, "not_found", NULL);
    req_error(port, "GET", "/v1/jobs/12345/metrics", NULL, NULL, 404, "not_found", NULL);
    req_error(port, "GET", "/v1/jobs/12345/stream", NULL, NULL, 404, "not_found", NULL);

    hresp r;
    http(port, "PUT", "/v1/jobs", NULL, NULL, 0, &r);
    expect_error(&r, 405, "method_not_allowed", NULL);
    ck_assert_str_eq(header(&r, "Allow"), "GET, HEAD, POST");
    hresp_free(&r);
    http(port, "DELETE", "/healthz", "Authorization: Bearer " TOKEN "\r\n", NULL, 0, &r);
    expect_error(&r, 405, "method_not_allowed", NULL);
    ck_assert_str_eq(header(&r, "Allow"), "GET, HEAD");
    hresp_free(&r);
    http(port, "GET", "/v1/jobs/1/cancel", NULL, NULL, 0, &r);
    expect_error(&r, 405, "method_not_allowed", NULL);
    ck_assert_str_eq(header(&r, "Allow"), "POST");
    hresp_free(&r);

    /* HEAD: the headers of GET, no body */
    http(port, "HEAD", "/healthz", NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_uint_eq(r.len, 0);
    hresp_free(&r);

    /* a very long path or query */
    char path[5000];
    memset(path, 'a', sizeof(path));
    memcpy(path, "/v1/", 4);
    path[sizeof(path) - 1] = '\0';
    req_error(port, "GET", path, NULL, NULL, 414, "uri_too_long", NULL);
    char q[9000];
    snprintf(q, sizeof(q), "/v1/jobs?name=");
    memset(q + 14, 'x', sizeof(q) - 15);
    q[sizeof(q) - 1] = '\0';
    req_error(port, "GET", q, NULL, NULL, 414, "uri_too_long", NULL);
}
END_TEST

START_TEST(test_auth_and_limits)
{
    static const char spec[] = "{\"name\":\"t\",\"data\":{\"type\":\"synthetic\"},\"steps\":5}";
    const char *json_hdr = "Content-Type: application/json\r\n";
    char hdr[256];
    hresp r;

    /* no token, a wrong token, a wrong scheme */
    http(port, "POST", "/v1/jobs", json_hdr, spec, strlen(spec), &r);
    expect_error(&r, 401, "unauthorized", NULL);
    ck_assert_ptr_nonnull(header(&r, "WWW-Authenticate"));
    ck_assert_int_eq(strncmp(header(&r, "WWW-Authenticate"), "Bearer", 6), 0);
    hresp_free(&r);
    snprintf(hdr, sizeof(hdr), "%sAuthorization: Bearer wrong\r\n", json_hdr);
    req_error(port, "POST", "/v1/jobs", hdr, spec, 401, "unauthorized", NULL);
    snprintf(hdr, sizeof(hdr), "%sAuthorization: Bearer " TOKEN "x\r\n", json_hdr);
    req_error(port, "POST", "/v1/jobs", hdr, spec, 401, "unauthorized", NULL);
    snprintf(hdr, sizeof(hdr), "%sAuthorization: Basic " TOKEN "\r\n", json_hdr);
    req_error(port, "POST", "/v1/jobs", hdr, spec, 401, "unauthorized", NULL);
    req_error(port, "DELETE", "/v1/jobs/1", NULL, NULL, 401, "unauthorized", NULL);
    req_error(port, "POST", "/v1/jobs/1/cancel", NULL, NULL, 401, "unauthorized", NULL);

    /* media type */
    req_error(port, "POST", "/v1/jobs",
              "Authorization: Bearer " TOKEN "\r\nContent-Type: text/plain\r\n", spec, 415,
              "unsupported_media_type", NULL);
    req_error(port, "POST", "/v1/jobs", "Authorization: Bearer " TOKEN "\r\n", spec, 415,
              "unsupported_media_type", NULL);
    req_error(port, "POST", "/v1/jobs",
              "Authorization: Bearer " TOKEN "\r\nContent-Type: application/jsonx\r\n", spec, 415,
              "unsupported_media_type", NULL);

    snprintf(hdr, sizeof(hdr), "%sAuthorization: Bearer " TOKEN "\r\n", json_hdr);
    /* bad bodies: 400 with the code and the field */
    req_error(port, "POST", "/v1/jobs", hdr, "{\"steps\": ", 400, "invalid_json", NULL);
    req_error(port, "POST", "/v1/jobs", hdr, "", 400, "invalid_json", NULL);
    req_error(port, "POST", "/v1/jobs", hdr, "{\"optimizer\": {\"lr\": -1}}", 400, "invalid_spec",
              "optimizer.lr");
    req_error(port, "POST", "/v1/jobs", hdr, "{\"bogus\": 1}", 400, "invalid_spec", "bogus");
    req_error(port, "POST", "/v1/jobs", hdr, "{\"steps\": \"ten\"}", 400, "invalid_spec", "steps");
    req_error(port, "POST", "/v1/jobs", hdr, "[1,2]", 400, "invalid_spec", NULL);
    char deep[200];
    memset(deep, '[', 100);
    memset(deep + 100, ']', 99);
    deep[199] = '\0';
    req_error(port, "POST", "/v1/jobs", hdr, deep, 400, "invalid_json", NULL);
    /* a bad Idempotency-Key */
    char hk[400];
    snprintf(hk, sizeof(hk), "%sIdempotency-Key: has space\r\n", hdr);
    req_error(port, "POST", "/v1/jobs", hk, spec, 400, "invalid_request", "Idempotency-Key");
    /* a valid spec with no scheduler: 503 */
    req_error(port, "POST", "/v1/jobs", hdr, spec, 503, "unavailable", NULL);
    req_error(port, "POST", "/v1/jobs",
              "Authorization: Bearer " TOKEN
              "\r\nContent-Type: application/json; charset=utf-8\r\n",
              spec, 503, "unavailable", NULL);
    int64_t id = add_job("a", "fp16", 10);
    char path[64];
    snprintf(path, sizeof(path), "/v1/jobs/%lld/cancel", (long long)id);
    req_error(port, "POST", path, hdr, NULL, 503, "unavailable", NULL);

    /* 413: a declared length over max_body is refused before the body is read */
    char big[8192];
    memset(big, ' ', sizeof(big));
    big[0] = '{';
    big[sizeof(big) - 1] = '}';
    http(port, "POST", "/v1/jobs", hdr, big, sizeof(big), &r);
    expect_error(&r, 413, "body_too_large", NULL);
    hresp_free(&r);
    {
        hconn c;
        char head[512];
        hc_open(&c, port);
        int n = snprintf(head, sizeof(head),
                         "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nConnection: close\r\n%s"
                         "Content-Length: 100000000\r\n\r\n",
                         port, hdr);
        hc_send(&c, head, (size_t)n);
        hc_read_all(&c, 5000); /* answered without sending a byte of the body */
        ck_assert_int_eq(c.status, 413);
        hc_close(&c);
    }
    /* 413: a chunked body that grows past max_body */
    {
        hconn c;
        char head[512];
        hc_open(&c, port);
        int n = snprintf(head, sizeof(head),
                         "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nConnection: close\r\n%s"
                         "Transfer-Encoding: chunked\r\n\r\n",
                         port, hdr);
        hc_send(&c, head, (size_t)n);
        for (int i = 0; i < 4; i++) {
            n = snprintf(head, sizeof(head), "800\r\n");
            hc_send(&c, head, (size_t)n);
            hc_send(&c, big, 0x800);
            hc_send(&c, "\r\n", 2);
        }
        hc_send(&c, "0\r\n\r\n", 5);
        hc_read_all(&c, 5000);
        ck_assert_int_eq(c.status, 413);
        ck_assert_ptr_nonnull(strstr(c.body.data, "body_too_large"));
        hc_close(&c);
    }
    /* the server still serves */
    json_decref(get_json(port, "/healthz", 200));
}
END_TEST

START_TEST(test_jobs)
{
    int64_t a = add_job("alpha", "fp16", 100);
    int64_t b = add_job("beta", "bf16", 100);
    int64_t c = add_job("gamma", "fp16", 100);
    int64_t d = add_job("alpha", "fp32", 100);
    ck_assert_int_eq(store_job_set_status(st, b, STORE_RUNNING, NULL), 0);
    ck_assert_int_eq(store_job_set_status(st, c, STORE_FAILED, "worker killed by signal 9"), 0);
    ck_assert_int_eq(store_job_set_summary(st, c, "{\"type\":\"summary\",\"final_loss\":0.5}"), 0);
    add_rows(b, 1, 40);

    json_t *j = get_json(port, "/v1/jobs", 200);
    json_t *jobs = json_object_get(j, "jobs");
    ck_assert_int_eq(json_array_size(jobs), 4);
    ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(jobs, 0), "id")), d);
    ck_assert(json_is_null(json_object_get(j, "next")));
    json_decref(j);

    /* keyset pagination */
    j = get_json(port, "/v1/jobs?limit=2", 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "jobs")), 2);
    int64_t next = json_integer_value(json_object_get(j, "next"));
    ck_assert_int_eq(next, c);
    json_decref(j);
    char path[128];
    snprintf(path, sizeof(path), "/v1/jobs?limit=2&after=%lld", (long long)next);
    j = get_json(port, path, 200);
    jobs = json_object_get(j, "jobs");
    ck_assert_int_eq(json_array_size(jobs), 2);
    ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(jobs, 0), "id")), b);
    ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(jobs, 1), "id")), a);
    json_decref(j);

    /* filters */
    j = get_json(port, "/v1/jobs?dtype=fp16", 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "jobs")), 2);
    json_decref(j);
    j = get_json(port, "/v1/jobs?name=alpha", 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "jobs")), 2);
    json_decref(j);
    j = get_json(port, "/v1/jobs?status=failed", 200);
    jobs = json_object_get(j, "jobs");
    ck_assert_int_eq(json_array_size(jobs), 1);
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(jobs, 0), "error")),
                     "worker killed by signal 9");
    json_decref(j);
    j = get_json(port, "/v1/jobs?status=running&dtype=bf16&name=beta", 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "jobs")), 1);
    json_decref(j);

    /* bad filters name the parameter */
    const char *bad[][2] = {{"/v1/jobs?status=done", "status"},
                            {"/v1/jobs?dtype=fp4", "dtype"},
                            {"/v1/jobs?limit=0", "limit"},
                            {"/v1/jobs?limit=1001", "limit"},
                            {"/v1/jobs?limit=ten", "limit"},
                            {"/v1/jobs?limit=", "limit"},
                            {"/v1/jobs?limit=99999999999999999999", "limit"},
                            {"/v1/jobs?after=-1", "after"},
                            {"/v1/jobs?after=1.5", "after"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        req_error(port, "GET", bad[i][0], NULL, NULL, 400, "invalid_parameter", bad[i][1]);
    {   /* the status filter's error lists every status (from the store's table) */
        hresp r;
        http(port, "GET", "/v1/jobs?status=done", NULL, NULL, 0, &r);
        ck_assert_msg(r.body &&
                          strstr(r.body,
                                 "must be one of queued, running, succeeded, failed, "
                                 "cancelled, interrupted, preempted, paused, branched\"") != NULL,
                      "%s", r.body ? r.body : "(no body)");
        hresp_free(&r);
    }

    /* one job: spec, progress, timestamps, summary */
    snprintf(path, sizeof(path), "/v1/jobs/%lld", (long long)b);
    j = get_json(port, path, 200);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")), "running");
    ck_assert_str_eq(json_string_value(json_object_get(j, "dtype")), "bf16");
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "spec"), "name")),
                     "beta");
    json_t *prog = json_object_get(j, "progress");
    ck_assert_int_eq(json_integer_value(json_object_get(prog, "step")), 40);
    ck_assert_int_eq(json_integer_value(json_object_get(prog, "steps")), 100);
    ck_assert(fabs(json_number_value(json_object_get(prog, "fraction")) - 0.4) < 1e-12);
    const char *created = json_string_value(json_object_get(j, "created_at"));
    ck_assert_ptr_nonnull(created);
    ck_assert_uint_eq(strlen(created), 24);
    ck_assert_int_eq(created[23], 'Z');
    ck_assert(json_number_value(json_object_get(j, "created_at_unix")) > 1.6e9);
    ck_assert_ptr_nonnull(json_string_value(json_object_get(j, "started_at")));
    ck_assert(json_is_null(json_object_get(j, "finished_at")));
    ck_assert(json_is_null(json_object_get(j, "summary")));
    ck_assert(json_is_null(json_object_get(j, "error")));
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld", (long long)c);
    j = get_json(port, path, 200);
    ck_assert(json_real_value(json_object_get(json_object_get(j, "summary"), "final_loss")) == 0.5);
    json_decref(j);

    /* layers: no layer data yet */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/layers", (long long)b);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "job")), b);
    ck_assert(json_is_null(json_object_get(j, "step")));
    ck_assert_int_eq(json_array_size(json_object_get(j, "layers")), 0);
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/layers?step=x", (long long)b);
    req_error(port, "GET", path, NULL, NULL, 400, "invalid_parameter", "step");

    /* compare */
    snprintf(path, sizeof(path), "/v1/compare?ids=%lld,%lld", (long long)c, (long long)a);
    j = get_json(port, path, 200);
    jobs = json_object_get(j, "jobs");
    ck_assert_int_eq(json_array_size(jobs), 2);
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(jobs, 0), "dtype")), "fp16");
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(jobs, 1), "name")), "alpha");
    ck_assert(json_is_null(json_object_get(json_array_get(jobs, 1), "summary")));
    ck_assert_int_eq(json_array_size(json_object_get(j, "fields")), 1);
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(j, "fields"), 0)),
                     "final_loss");
    json_decref(j);
    req_error(port, "GET", "/v1/compare", NULL, NULL, 400, "invalid_parameter", "ids");
    req_error(port, "GET", "/v1/compare?ids=1,x", NULL, NULL, 400, "invalid_parameter", "ids");
    req_error(port, "GET", "/v1/compare?ids=", NULL, NULL, 400, "invalid_parameter", "ids");
    snprintf(path, sizeof(path), "/v1/compare?ids=%lld,99999", (long long)a);
    hresp r;
    http(port, "GET", path, NULL, NULL, 0, &r);
    expect_error(&r, 404, "not_found", "ids");
    ck_assert_ptr_nonnull(strstr(r.body, "99999"));
    hresp_free(&r);
}
END_TEST

/* The "model" object of a job, from its stored spec with the documented defaults. */
static void expect_model(json_t *job, const char *type, const char *text)
{
    json_t *m = json_object_get(job, "model");
    if (!type) {
        ck_assert_msg(json_is_null(m), "model should be null");
        return;
    }
    ck_assert_msg(json_is_object(m), "model should be an object");
    ck_assert_int_eq(json_object_size(m), 2);
    ck_assert_str_eq(json_string_value(json_object_get(m, "type")), type);
    ck_assert_str_eq(json_string_value(json_object_get(m, "text")), text);
}

START_TEST(test_job_model)
{
    static const struct {
        const char *spec, *type, *text;
    } t[] = {
        {"{\"name\":\"mlp\",\"model\":{\"type\":\"mlp\",\"layers\":[32,64,4]}}", "mlp",
         "mlp 32-64-4"},
        {"{\"name\":\"mlp-default\"}", "mlp", "mlp 784-1024-1024-10"},
        {"{\"model\":{\"activation\":\"gelu\",\"layers\":[784,256,10]}}", "mlp",
         "mlp 784-256-10"},
        {"{\"model\":{\"type\":\"gpt\",\"n_layer\":6,\"n_head\":8,\"d_model\":512,"
         "\"seq_len\":64,\"vocab\":256}}",
         "gpt", "gpt 6L d512 8h T64"},
        {"{\"model\":{\"type\":\"gpt\"},\"data\":{\"type\":\"text\",\"train\":\"fortunes\"}}",
         "gpt", "gpt 4L d256 4h T128"},
        {"{\"model\":{\"type\":\"gpt\",\"attention\":\"flash\"}}", "gpt", "gpt 4L d256 4h T128 flash"},
        {"{\"model\":{\"type\":\"gpt\",\"attention\":\"materialized\"}}", "gpt", "gpt 4L d256 4h T128"},
        {"{\"model\":{\"type\":\"gpt\",\"d_model\":\"big\"}}", NULL, NULL},
        {"{\"model\":{\"layers\":[32,\"x\"]}}", NULL, NULL},
        {"{\"model\":{\"type\":\"rnn\"}}", NULL, NULL},
        {"{\"model\":[1,2]}", NULL, NULL},
        {"not json", NULL, NULL},
    };
    const size_t n = sizeof(t) / sizeof(t[0]);
    int64_t ids[sizeof(t) / sizeof(t[0])];
    char path[64];

    for (size_t i = 0; i < n; i++) {
        bool existed;
        char name[16];
        snprintf(name, sizeof(name), "m%zu", i);
        ck_assert_int_eq(store_job_insert(st, name, "fp32", 10, t[i].spec, NULL, &ids[i], &existed),
                         0);
    }
    /* one job */
    for (size_t i = 0; i < n; i++) {
        snprintf(path, sizeof(path), "/v1/jobs/%lld", (long long)ids[i]);
        json_t *j = get_json(port, path, 200);
        expect_model(j, t[i].type, t[i].text);
        json_decref(j);
    }
    /* the list (newest first) */
    json_t *j = get_json(port, "/v1/jobs?limit=1000", 200);
    json_t *jobs = json_object_get(j, "jobs");
    ck_assert_uint_eq(json_array_size(jobs), n);
    for (size_t i = 0; i < n; i++) {
        json_t *job = json_array_get(jobs, n - 1 - i);
        ck_assert_int_eq(json_integer_value(json_object_get(job, "id")), ids[i]);
        expect_model(job, t[i].type, t[i].text);
    }
    json_decref(j);
}
END_TEST

START_TEST(test_metrics)
{
    int64_t id = add_job("m", "fp16", 1000);
    char path[160];
    add_rows(id, 1, 1000);

    /* raw, selected fields */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?fields=loss,overflow", (long long)id);
    json_t *j = get_json(port, path, 200);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total_steps")), 1000);
    json_t *pts = json_object_get(j, "points");
    ck_assert_int_eq(json_array_size(pts), 1000);
    for (size_t i = 0; i < 1000; i++) {
        json_t *p = json_array_get(pts, i);
        ck_assert_int_eq(json_integer_value(json_object_get(p, "step")), (json_int_t)i + 1);
        ck_assert_int_eq(json_integer_value(json_object_get(p, "count")), 1);
    }
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(pts, 49), "loss")), "NaN");
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(pts, 50), "loss")),
                     "Infinity");
    ck_assert(json_is_true(json_object_get(json_array_get(pts, 96), "overflow")));
    ck_assert(json_number_value(json_object_get(json_array_get(pts, 1), "loss")) == 0.5);
    ck_assert_ptr_null(json_object_get(json_array_get(pts, 1), "lr"));
    json_decref(j);

    /* from / to */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?fields=loss&from=10&to=19", (long long)id);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "points")), 10);
    json_decref(j);

    /* a `to` far beyond the last step answers at once with the rows there are (the reader
     * once walked the empty range chunk by chunk, and the answer never ended) */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?fields=loss&from=991&to=%lld",
             (long long)id, (long long)INT64_MAX);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "points")), 10);
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?from=5000&to=888888888888889",
             (long long)id);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "points")), 0);
    json_decref(j);

    /* every field by default */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?to=3", (long long)id);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "fields")), STORE_M_NFIELDS);
    ck_assert(json_number_value(json_object_get(json_array_get(json_object_get(j, "points"), 0),
                                                "loss_scale")) == 65536);
    json_decref(j);

    /* downsampled: min/max/last buckets, every overflow and non-finite step kept */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?fields=loss,loss_scale&points=20",
             (long long)id);
    j = get_json(port, path, 200);
    pts = json_object_get(j, "points");
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total_steps")), 1000);
    ck_assert_int_le(json_array_size(pts), 40);
    int overflow_seen = 0, buckets = 0;
    bool nan_seen = false;
    for (size_t i = 0; i < json_array_size(pts); i++) {
        json_t *p = json_array_get(pts, i);
        if (json_integer_value(json_object_get(p, "count")) > 1) {
            buckets++;
            ck_assert(json_is_object(json_object_get(p, "loss")));
            ck_assert_ptr_nonnull(json_object_get(json_object_get(p, "loss"), "min"));
        } else if (json_is_true(json_object_get(p, "overflow"))) {
            overflow_seen++;
        } else if (json_integer_value(json_object_get(p, "step")) == 50) {
            nan_seen = json_is_string(json_object_get(p, "loss"));
        }
    }
    ck_assert_int_ge(buckets, 10);
    ck_assert_int_eq(overflow_seen, 1000 / 97);
    ck_assert(nan_seen);
    json_decref(j);

    /* CSV, raw and bucketed */
    hresp r;
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?fields=loss,lr&format=csv&to=51",
             (long long)id);
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_int_eq(strncmp(header(&r, "Content-Type"), "text/csv", 8), 0);
    ck_assert_int_eq(strncmp(header(&r, "Content-Disposition"), "attachment", 10), 0);
    ck_assert_int_eq(strncmp(r.body, "step,loss,lr\n1,1,0.001\n2,0.5,0.001\n", 35), 0);
    ck_assert_ptr_nonnull(strstr(r.body, "\n50,NaN,0.001\n51,Inf,0.001\n"));
    hresp_free(&r);

    /* a step without an eval has an empty eval cell (and null in JSON); a NaN eval is NaN */
    int64_t ev = add_job("e", "fp16", 3);
    for (int64_t s = 1; s <= 3; s++) {
        store_metric m;
        memset(&m, 0, sizeof(m));
        m.job_id = ev;
        m.step = s;
        for (int f = 0; f < STORE_M_NFIELDS; f++)
            m.v[f] = store_missing();
        m.v[STORE_M_LOSS] = 0.5;
        m.v[STORE_M_LR] = s == 3 ? store_missing() : 0.001; /* a field the line lacked */
        m.has_eval = s >= 2;
        m.v[STORE_M_EVAL_LOSS] = s == 2 ? 0.25 : NAN;
        ck_assert_int_eq(store_metric_append(st, &m), 0);
    }
    ck_assert_int_eq(store_flush(st), 0);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?fields=loss,lr,eval_loss&format=csv",
             (long long)ev);
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_str_eq(r.body, "step,loss,lr,eval_loss\n1,0.5,0.001,\n2,0.5,0.001,0.25\n3,0.5,,NaN\n");
    hresp_free(&r);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?fields=lr,eval_loss", (long long)ev);
    j = get_json(port, path, 200);
    pts = json_object_get(j, "points");
    ck_assert(json_is_null(json_object_get(json_array_get(pts, 0), "eval_loss")));
    ck_assert(json_is_null(json_object_get(json_array_get(pts, 2), "lr")));
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(pts, 2), "eval_loss")), "NaN");
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?fields=loss&format=csv&points=10",
             (long long)id);
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_int_eq(
        strncmp(r.body, "step,step_last,count,flags,loss_min,loss_max,loss_last\n", 55), 0);
    hresp_free(&r);

    /* bad parameters name themselves */
    const char *bad[][2] = {{"fields=loss,nope", "fields"},
                            {"fields=", "fields"},
                            {"from=-1", "from"},
                            {"to=x", "to"},
                            {"from=10&to=5", "to"},
                            {"points=-1", "points"},
                            {"points=1000001", "points"},
                            {"format=xml", "format"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?%s", (long long)id, bad[i][0]);
        http(port, "GET", path, NULL, NULL, 0, &r);
        expect_error(&r, 400, "invalid_parameter", bad[i][1]);
        if (i == 0)
            ck_assert_ptr_nonnull(strstr(r.body, "nope"));
        hresp_free(&r);
    }

    /* a larger raw series crosses the chunk boundary intact */
    int64_t big = add_job("big", "fp32", 40000);
    add_rows(big, 1, 40000);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?fields=loss&format=csv", (long long)big);
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    int lines = 0;
    int64_t expect = 1;
    for (char *p = strchr(r.body, '\n'); p && p[1]; p = strchr(p + 1, '\n')) {
        ck_assert_int_eq(strtoll(p + 1, NULL, 10), expect);
        expect++;
        lines++;
    }
    ck_assert_int_eq(lines, 40000);
    hresp_free(&r);
}
END_TEST

START_TEST(test_events_checkpoints)
{
    int64_t id = add_job("e", "fp16", 100);
    char path[160], file[400];
    for (int i = 1; i <= 5; i++) {
        char msg[32];
        snprintf(msg, sizeof(msg), "event %d", i);
        ck_assert_int_eq(store_event_append(st, id, i * 10, i == 3 ? "scale" : "overflow", msg,
                                            i == 3 ? "{\"from\":65536,\"to\":32768}" : NULL),
                         0);
    }
    ck_assert_int_eq(store_flush(st), 0);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/events?limit=3", (long long)id);
    json_t *j = get_json(port, path, 200);
    json_t *ev = json_object_get(j, "events");
    ck_assert_int_eq(json_array_size(ev), 3);
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(ev, 0), "message")),
                     "event 1");
    ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(ev, 2), "step")), 30);
    ck_assert_int_eq(
        json_integer_value(json_object_get(json_object_get(json_array_get(ev, 2), "data"), "to")),
        32768);
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(ev, 2), "kind")), "scale");
    json_int_t next = json_integer_value(json_object_get(j, "next"));
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/events?limit=3&after=%lld", (long long)id,
             (long long)next);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "events")), 2);
    ck_assert(json_is_null(json_object_get(j, "next")));
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/events?limit=0", (long long)id);
    req_error(port, "GET", path, NULL, NULL, 400, "invalid_parameter", "limit");

    /* checkpoints: list, download, missing */
    snprintf(file, sizeof(file), "%s/ckpt-50.safetensors", dir);
    FILE *f = fopen(file, "wb");
    ck_assert_ptr_nonnull(f);
    for (int i = 0; i < 100000; i++)
        fputc(i * 7 & 0xff, f);
    fclose(f);
    ck_assert_int_eq(store_checkpoint_add(st, id, 50, file, 100000), 0);
    snprintf(file, sizeof(file), "%s/ckpt-90.safetensors", dir); /* never written */
    ck_assert_int_eq(store_checkpoint_add(st, id, 90, file, 10), 0);
    ck_assert_int_eq(store_flush(st), 0);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/checkpoints", (long long)id);
    j = get_json(port, path, 200);
    json_t *ck = json_object_get(j, "checkpoints");
    ck_assert_int_eq(json_array_size(ck), 2);
    ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(ck, 0), "step")), 50);
    ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(ck, 0), "bytes")), 100000);
    ck_assert_ptr_null(json_object_get(json_array_get(ck, 0), "path"));
    json_decref(j);
    hresp r;
    snprintf(path, sizeof(path), "/v1/jobs/%lld/checkpoints/50", (long long)id);
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_str_eq(header(&r, "Content-Type"), "application/octet-stream");
    ck_assert_str_eq(header(&r, "Content-Disposition"),
                     "attachment; filename=\"ckpt-50.safetensors\"");
    ck_assert_uint_eq(r.len, 100000);
    for (size_t i = 0; i < r.len; i++)
        ck_assert_int_eq((unsigned char)r.body[i], (int)(i * 7 & 0xff));
    hresp_free(&r);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/checkpoints/90", (long long)id);
    req_error(port, "GET", path, NULL, NULL, 404, "not_found", NULL);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/checkpoints/60", (long long)id);
    req_error(port, "GET", path, NULL, NULL, 404, "not_found", NULL);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/checkpoints/x", (long long)id);
    req_error(port, "GET", path, NULL, NULL, 404, "not_found", NULL);
}
END_TEST

START_TEST(test_system)
{
    json_t *j = get_json(port, "/v1/system", 200);
    json_t *v = json_object_get(j, "versions");
    ck_assert_ptr_nonnull(json_string_value(json_object_get(v, "ampd")));
    ck_assert_ptr_nonnull(json_string_value(json_object_get(v, "sqlite")));
    ck_assert_str_eq(json_string_value(json_object_get(v, "libmicrohttpd")), MHD_get_version());
    ck_assert_ptr_nonnull(json_string_value(json_object_get(v, "jansson")));
    ck_assert_ptr_nonnull(json_string_value(json_object_get(v, "blas")));
    json_t *cpu = json_object_get(json_object_get(j, "devices"), "cpu");
    ck_assert_int_ge(json_integer_value(json_object_get(cpu, "cores")), 1);
    ck_assert_ptr_nonnull(json_string_value(json_object_get(cpu, "model")));
    json_t *cuda = json_object_get(json_object_get(j, "devices"), "cuda");
    ck_assert(json_is_boolean(json_object_get(cuda, "available")));
    ck_assert_ptr_nonnull(json_string_value(json_object_get(cuda, "detail")));
    json_t *gpus = json_object_get(cuda, "gpus"); /* one entry per device, none without */
    ck_assert(json_is_array(gpus));
    ck_assert_int_eq(json_array_size(gpus) > 0, json_is_true(json_object_get(cuda, "available")));
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "autocast"), "softmax")),
                     "fp32");
    ck_assert(json_is_null(json_object_get(j, "queue"))); /* no scheduler */
    /* this server has a token: the dashboard asks for it before a change */
    ck_assert(json_is_true(json_object_get(json_object_get(j, "auth"), "token_required")));
    ck_assert_ptr_nonnull(json_object_get(j, "capacity"));
    json_decref(j);
}
END_TEST

/* Parse Prometheus text: every sample belongs to a family declared by # TYPE before it,
 * families are contiguous, names and labels are well formed, values are numbers. Returns
 * the value of the first sample whose text starts with `want` (NAN if none). */
static double prom_check(const char *text, const char *want)
{
    char fam[64][64];
    int nfam = 0;
    char cur[64] = "";
    bool hist = false;
    double found = NAN;
    const char *line = text;
    while (*line) {
        const char *end = strchr(line, '\n');
        ck_assert_msg(end != NULL, "the exposition must end with a newline");
        char l[1024];
        snprintf(l, sizeof(l), "%.*s", (int)(end - line), line);
        line = end + 1;
        if (strncmp(l, "# HELP ", 7) == 0)
            continue;
        if (strncmp(l, "# TYPE ", 7) == 0) {
            char name[64], type[32];
            ck_assert_int_eq(sscanf(l + 7, "%63s %31s", name, type), 2);
            ck_assert_msg(strcmp(type, "gauge") == 0 || strcmp(type, "counter") == 0 ||
                              strcmp(type, "histogram") == 0,
                          "%s", l);
            hist = strcmp(type, "histogram") == 0;
            if (strcmp(type, "counter") == 0)
                ck_assert_msg(strlen(name) > 6 && strcmp(name + strlen(name) - 6, "_total") == 0,
                              "counter %s must end in _total", name);
            for (int i = 0; i < nfam; i++)
                ck_assert_msg(strcmp(fam[i], name) != 0, "family %s declared twice", name);
            ck_assert_int_lt(nfam, 64);
            snprintf(fam[nfam++], sizeof(fam[0]), "%s", name);
            snprintf(cur, sizeof(cur), "%s", name);
            continue;
        }
        ck_assert_msg(l[0] != '#' && l[0] != '\0', "unexpected line: %s", l);
        size_t nl = strspn(l, "abcdefghijklmnopqrstuvwxyz_:ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789");
        size_t cl = strlen(cur);
        bool in_family = nl == cl && strncmp(l, cur, nl) == 0;
        if (hist && nl > cl && strncmp(l, cur, cl) == 0) /* a histogram's _bucket, _sum, _count */
            in_family = (nl - cl == 7 && strncmp(l + cl, "_bucket", 7) == 0) ||
                        (nl - cl == 4 && strncmp(l + cl, "_sum", 4) == 0) ||
                        (nl - cl == 6 && strncmp(l + cl, "_count", 6) == 0);
        ck_assert_msg(in_family && (!hist || nl > cl), "sample %s outside its family %s", l, cur);
        const char *p = l + nl;
        if (*p == '{') {
            p++;
            while (*p != '}') {
                size_t kl = strspn(p, "abcdefghijklmnopqrstuvwxyz_");
                ck_assert_msg(kl > 0 && p[kl] == '=' && p[kl + 1] == '"', "bad label: %s", l);
                p += kl + 2;
                while (*p != '"') {
                    ck_assert_msg(*p != '\0' && *p != '\n', "unterminated label: %s", l);
                    if (*p == '\\') {
                        ck_assert_msg(p[1] == '\\' || p[1] == '"' || p[1] == 'n', "bad escape %s",
                                      l);
                        p++;
                    }
                    p++;
                }
                p++;
                if (*p == ',')
                    p++;
            }
            p++;
        }
        ck_assert_msg(*p == ' ', "no value: %s", l);
        p++;
        char *e;
        double v = strtod(p, &e);
        ck_assert_msg(e != p && *e == '\0', "bad value: %s", l);
        if (isnan(found) && want && strncmp(l, want, strlen(want)) == 0)
            found = v;
    }
    return found;
}

START_TEST(test_prometheus)
{
    int64_t id = add_job("we\"ird\\name", "fp16", 1000);
    ck_assert_int_eq(store_job_set_status(st, id, STORE_RUNNING, NULL), 0);
    add_rows(id, 1, 51); /* the latest row has an infinite loss */
    add_job("q", "fp32", 10);
    json_decref(get_json(port, "/healthz", 200));
    req_error(port, "GET", "/nope", NULL, NULL, 404, "not_found", NULL);

    hresp r;
    http(port, "GET", "/metrics", NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_str_eq(header(&r, "Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
    ck_assert(prom_check(r.body, "ampd_jobs{status=\"queued\"}") == 1);
    ck_assert(prom_check(r.body, "ampd_jobs{status=\"running\"}") == 1);
    ck_assert(prom_check(r.body, "ampd_store_rows_total") >= 51);
    ck_assert(prom_check(r.body, "ampd_http_requests_total{code=\"404\"}") >= 1);
    ck_assert(prom_check(r.body, "ampd_http_requests_total{code=\"200\"}") >= 1);
    char want[160];
    snprintf(want, sizeof(want),
             "ampd_loss_scale{job_id=\"%lld\",name=\"we\\\"ird\\\\name\",dtype=\"fp16\"}",
             (long long)id);
    ck_assert(prom_check(r.body, want) == 65536);
    snprintf(want, sizeof(want), "ampd_loss{job_id=\"%lld\",", (long long)id);
    double loss = prom_check(r.body, want);
    ck_assert(isinf(loss) && loss > 0);
    ck_assert_ptr_nonnull(strstr(r.body, "} +Inf\n"));
    snprintf(want, sizeof(want), "ampd_step_seconds{job_id=\"%lld\",", (long long)id);
    ck_assert(fabs(prom_check(r.body, want) - 0.025) < 1e-12);
    snprintf(want, sizeof(want), "ampd_overflow_steps_total{job_id=\"%lld\",", (long long)id);
    ck_assert(prom_check(r.body, want) == 0);
    snprintf(want, sizeof(want), "ampd_device_memory_bytes{job_id=\"%lld\",", (long long)id);
    ck_assert(prom_check(r.body, want) == 1 << 20);
    snprintf(want, sizeof(want), "ampd_comm_bytes{job_id=\"%lld\",", (long long)id);
    ck_assert(prom_check(r.body, want) == 4096);
    snprintf(want, sizeof(want), "ampd_comm_seconds{job_id=\"%lld\",", (long long)id);
    ck_assert(fabs(prom_check(r.body, want) - 0.002) < 1e-12);
    snprintf(want, sizeof(want), "ampd_comm_exposed_seconds{job_id=\"%lld\",", (long long)id);
    ck_assert(fabs(prom_check(r.body, want) - 0.0005) < 1e-12);
    snprintf(want, sizeof(want), "ampd_slowest_rank_step_seconds{job_id=\"%lld\",",
             (long long)id);
    ck_assert(fabs(prom_check(r.body, want) - 0.030) < 1e-12);
    snprintf(want, sizeof(want), "ampd_slowest_rank{job_id=\"%lld\",", (long long)id);
    ck_assert(prom_check(r.body, want) == 1);
    snprintf(want, sizeof(want), "ampd_job_running{job_id=\"%lld\",", (long long)id);
    ck_assert(prom_check(r.body, want) == 1);
    hresp_free(&r);

    /* the step-time histogram: every stored step (25 ms each), caught up scrape by scrape */
    const char *le[][2] = {{"0.01", "0"}, {"0.025", "N"}, {"0.05", "N"}, {"+Inf", "N"}};
    for (int round = 0; round < 2; round++) {
        int n = round == 0 ? 51 : 61;
        if (round == 1)
            add_rows(id, 52, 10);
        http(port, "GET", "/metrics", NULL, NULL, 0, &r);
        for (size_t k = 0; k < sizeof(le) / sizeof(le[0]); k++) {
            snprintf(want, sizeof(want), "ampd_step_duration_seconds_bucket{job_id=\"%lld\",name=\"we\\\"ird\\\\name\",dtype=\"fp16\",le=\"%s\"}", (long long)id, le[k][0]);
            ck_assert_msg(prom_check(r.body, want) == (le[k][1][0] == 'N' ? n : 0), "%s", want);
        }
        snprintf(want, sizeof(want), "ampd_step_duration_seconds_count{job_id=\"%lld\",", (long long)id);
        ck_assert(prom_check(r.body, want) == n);
        snprintf(want, sizeof(want), "ampd_step_duration_seconds_sum{job_id=\"%lld\",", (long long)id);
        ck_assert(fabs(prom_check(r.body, want) - 0.025 * n) < 1e-9);
        hresp_free(&r);
    }

    /* a finished job's series stay (metrics_keep_s), marked as not running */
    ck_assert_int_eq(store_job_set_status(st, id, STORE_SUCCEEDED, NULL), 0);
    http(port, "GET", "/metrics", NULL, NULL, 0, &r);
    snprintf(want, sizeof(want), "ampd_job_running{job_id=\"%lld\",", (long long)id);
    ck_assert(prom_check(r.body, want) == 0);
    snprintf(want, sizeof(want), "ampd_loss_scale{job_id=\"%lld\",", (long long)id);
    ck_assert(prom_check(r.body, want) == 65536);
    hresp_free(&r);
}
END_TEST

/* Steps 10, 20, ..., 100 of a three-layer job: fc1 (fp16) plain; fc2 (fp16) overflows at
 * 10 and 70 (act_overflow 7; at 10 a NaN grad_amax and the first non-finite), headroom
 * +Inf, lost_updates NaN; head (fp32) does not report lost_updates. */
static void add_layer_rows(int64_t job)
{
    for (int64_t s = 10; s <= 100; s += 10) {
        store_layer_stat r[3];
        store_layer_info info;
        memset(r, 0, sizeof(r));
        memset(&info, 0, sizeof(info));
        info.scale = s == 10 ? 65536 : 32768;
        if (s == 10) {
            snprintf(info.first_layer, sizeof(info.first_layer), "fc2");
            snprintf(info.first_where, sizeof(info.first_where), "forward");
        }
        for (int l = 0; l < 3; l++) {
            snprintf(r[l].name, sizeof(r[l].name), "%s", l == 0 ? "fc1" : l == 1 ? "fc2" : "head");
            snprintf(r[l].dtype, sizeof(r[l].dtype), "%s", l == 2 ? "fp32" : "fp16");
            r[l].v[STORE_L_ACT_AMAX] = (double)s + l;
            r[l].v[STORE_L_ACT_HEADROOM] = 65504.0 / ((double)s + l);
            r[l].v[STORE_L_GRAD_AMAX] = 0.5;
            r[l].v[STORE_L_GRAD_UNDERFLOW] = 0.125 * l;
            r[l].v[STORE_L_GRAD_UNDERFLOW_UNSCALED] = 0.25 * l;
        }
        r[1].v[STORE_L_ACT_HEADROOM] = INFINITY;
        r[1].v[STORE_L_GRAD_AMAX] = s == 10 ? NAN : 0.5;
        r[1].v[STORE_L_LOST_UPDATES] = NAN; /* NaN, but not a sign of overflow */
        r[1].v[STORE_L_ACT_OVERFLOW] = s == 10 || s == 70 ? 7 : 0;
        r[2].missing = 1u << STORE_L_LOST_UPDATES;
        r[2].v[STORE_L_LOST_UPDATES] = NAN;
        /* fc1 reports its fp8 operands, as an fp8 layer does; the others leave them out */
        r[0].v[STORE_L_FP8_GRAD_UNDERFLOW] = 0.375;
        for (int f = STORE_L_FP8_IN_AMAX; f < STORE_L_NFIELDS; f++)
            r[1].missing |= 1u << f, r[2].missing |= 1u << f;
        ck_assert_int_eq(store_layer_stats_append(st, job, s, &info, r, 3), 0);
    }
    ck_assert_int_eq(store_flush(st), 0);
}

START_TEST(test_layers)
{
    int64_t id = add_job("layers", "fp16", 100);
    char path[200];
    json_t *j, *l;

    /* no diagnosed step yet: an empty answer, not an error */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/layers", (long long)id);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "job")), id);
    ck_assert(json_is_null(json_object_get(j, "step")));
    ck_assert(json_is_null(json_object_get(j, "first_nonfinite")));
    ck_assert_int_eq(json_array_size(json_object_get(j, "layers")), 0);
    json_decref(j);
    add_layer_rows(id);

    /* the latest diagnosed step */
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "step")), 100);
    ck_assert(json_number_value(json_object_get(j, "scale")) == 32768);
    ck_assert(json_is_null(json_object_get(j, "first_nonfinite")));
    ck_assert(json_is_false(json_object_get(j, "overflow")));
    ck_assert_int_eq(json_array_size(json_object_get(j, "layers")), 3);
    l = json_array_get(json_object_get(j, "layers"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(l, "name")), "fc1");
    ck_assert_str_eq(json_string_value(json_object_get(l, "dtype")), "fp16");
    ck_assert(json_number_value(json_object_get(l, "act_amax")) == 100);
    ck_assert(json_number_value(json_object_get(l, "act_headroom")) == 655.04);
    ck_assert_int_eq(json_object_size(l), 2 + STORE_L_NFIELDS);
    json_decref(j);

    /* one step: non-finite values as strings, counts as integers, missing as null */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/layers?step=10", (long long)id);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "step")), 10);
    ck_assert(json_number_value(json_object_get(j, "scale")) == 65536);
    ck_assert_str_eq(
        json_string_value(json_object_get(json_object_get(j, "first_nonfinite"), "layer")), "fc2");
    ck_assert_str_eq(
        json_string_value(json_object_get(json_object_get(j, "first_nonfinite"), "where")),
        "forward");
    ck_assert(json_is_true(json_object_get(j, "nonfinite")));
    ck_assert(json_is_true(json_object_get(j, "overflow")));
    l = json_array_get(json_object_get(j, "layers"), 1);
    ck_assert_str_eq(json_string_value(json_object_get(l, "act_headroom")), "Infinity");
    ck_assert_str_eq(json_string_value(json_object_get(l, "grad_amax")), "NaN");
    ck_assert(json_is_integer(json_object_get(l, "act_overflow")));
    ck_assert_int_eq(json_integer_value(json_object_get(l, "act_overflow")), 7);
    ck_assert_int_eq(json_integer_value(json_object_get(l, "grad_nonfinite")), 0);
    l = json_array_get(json_object_get(j, "layers"), 2);
    ck_assert_str_eq(json_string_value(json_object_get(l, "dtype")), "fp32");
    ck_assert(json_is_null(json_object_get(l, "lost_updates")));
    ck_assert(json_number_value(json_object_get(l, "grad_underflow_unscaled")) == 0.5);
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/layers?step=20", (long long)id);
    j = get_json(port, path, 200);
    ck_assert(json_is_false(json_object_get(j, "nonfinite")));
    l = json_array_get(json_object_get(j, "layers"), 1);
    ck_assert_str_eq(json_string_value(json_object_get(l, "lost_updates")), "NaN");
    ck_assert(json_number_value(json_object_get(l, "grad_amax")) == 0.5);
    json_decref(j);

    /* a heatmap: 4 of the 10 steps, the overflowing 10 and 70 always among them */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/layers?from=0&steps=4", (long long)id);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total_steps")), 10);
    ck_assert(json_is_null(json_object_get(j, "to")));
    json_t *steps = json_object_get(j, "steps");
    static const int want[] = {10, 20, 70, 100};
    ck_assert_int_eq(json_array_size(steps), 4);
    for (int k = 0; k < 4; k++)
        ck_assert_int_eq(json_integer_value(json_array_get(steps, (size_t)k)), want[k]);
    ck_assert(json_is_true(json_array_get(json_object_get(j, "overflow"), 2)));
    ck_assert(json_is_false(json_array_get(json_object_get(j, "overflow"), 1)));
    ck_assert(json_number_value(json_array_get(json_object_get(j, "scale"), 0)) == 65536);
    ck_assert_str_eq(json_string_value(json_object_get(
                         json_array_get(json_object_get(j, "first_nonfinite"), 0), "layer")),
                     "fc2");
    ck_assert(json_is_null(json_array_get(json_object_get(j, "first_nonfinite"), 1)));
    ck_assert_int_eq(json_array_size(json_object_get(j, "layers")), 3);
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(j, "layers"), 2)), "head");
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(j, "dtypes"), 2)), "fp32");
    json_t *fields = json_object_get(j, "fields");
    ck_assert_int_eq(json_object_size(fields), 5); /* the default fields */
    json_t *hr = json_object_get(fields, "act_headroom");
    ck_assert_int_eq(json_array_size(hr), 3);
    ck_assert_int_eq(json_array_size(json_array_get(hr, 0)), 4);
    ck_assert(json_number_value(json_array_get(json_array_get(hr, 0), 2)) == 65504.0 / 70);
    ck_assert_str_eq(json_string_value(json_array_get(json_array_get(hr, 1), 3)), "Infinity");
    ck_assert(json_number_value(json_array_get(
                  json_array_get(json_object_get(fields, "grad_underflow"), 2), 0)) == 0.25);
    ck_assert_ptr_nonnull(json_object_get(fields, "grad_underflow_unscaled"));
    ck_assert_ptr_nonnull(json_object_get(fields, "act_amax"));
    ck_assert_ptr_nonnull(json_object_get(fields, "grad_amax"));
    json_decref(j);

    /* chosen fields and a window */
    snprintf(path, sizeof(path),
             "/v1/jobs/%lld/layers?from=20&to=70&fields=act_overflow,lost_updates", (long long)id);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total_steps")), 6);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "to")), 70);
    fields = json_object_get(j, "fields");
    ck_assert_int_eq(json_object_size(fields), 2);
    json_t *ovf = json_array_get(json_object_get(fields, "act_overflow"), 1);
    ck_assert_int_eq(json_array_size(ovf), 6);
    ck_assert(json_is_integer(json_array_get(ovf, 5)));
    ck_assert_int_eq(json_integer_value(json_array_get(ovf, 5)), 7);
    ck_assert_int_eq(json_integer_value(json_array_get(ovf, 0)), 0);
    ck_assert(json_is_null(
        json_array_get(json_array_get(json_object_get(fields, "lost_updates"), 2), 0)));
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/layers?from=500", (long long)id);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total_steps")), 0);
    ck_assert_int_eq(json_array_size(json_object_get(j, "steps")), 0);
    ck_assert_int_eq(json_array_size(json_object_get(j, "layers")), 0);
    json_decref(j);

    /* errors name the parameter */
    static const struct {
        const char *query, *field;
        int status;
    } bad[] = {
        {"step=15", "step", 404},
        {"step=x", "step", 400},
        {"step=-1", "step", 400},
        {"step=10&from=0", "step", 400},
        {"step=10&fields=act_amax", "step", 400},
        {"from=-1", "from", 400},
        {"from=1x", "from", 400},
        {"from=50&to=40", "to", 400},
        {"steps=0", "steps", 400},
        {"steps=2001", "steps", 400},
        {"fields=loss", "fields", 400},
        {"fields=", "fields", 400},
        {"fields=act_amax,,grad_amax", "fields", 400},
        {"fields=act_amax,act_amax", "fields", 400},
        {"fields=act_amax,", "fields", 400},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(path, sizeof(path), "/v1/jobs/%lld/layers?%s", (long long)id, bad[i].query);
        req_error(port, "GET", path, NULL, NULL, bad[i].status,
                  bad[i].status == 404 ? "not_found" : "invalid_parameter", bad[i].field);
    }
    req_error(port, "GET", "/v1/jobs/4242/layers", NULL, NULL, 404, "not_found", NULL);
    req_error(port, "GET", "/v1/jobs/4242/layers?from=0", NULL, NULL, 404, "not_found", NULL);

    /* Prometheus: the running job's latest diagnosed step, per layer */
    ck_assert_int_eq(store_job_set_status(st, id, STORE_RUNNING, NULL), 0);
    hresp r;
    char want_s[160];
    http(port, "GET", "/metrics", NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    snprintf(want_s, sizeof(want_s),
             "ampd_layer_act_headroom{job_id=\"%lld\",name=\"layers\",dtype=\"fp16\","
             "layer=\"fc1\"}",
             (long long)id);
    ck_assert(prom_check(r.body, want_s) == 655.04);
    snprintf(want_s, sizeof(want_s),
             "ampd_layer_act_headroom{job_id=\"%lld\",name=\"layers\",dtype=\"fp16\","
             "layer=\"fc2\"}",
             (long long)id);
    double v = prom_check(r.body, want_s);
    ck_assert(isinf(v) && v > 0);
    snprintf(want_s, sizeof(want_s),
             "ampd_layer_grad_underflow_ratio{job_id=\"%lld\",name=\"layers\",dtype=\"fp16\","
             "layer=\"head\"}",
             (long long)id);
    ck_assert(prom_check(r.body, want_s) == 0.25);
    snprintf(want_s, sizeof(want_s),
             "ampd_layer_fp8_underflow_ratio{job_id=\"%lld\",name=\"layers\",dtype=\"fp16\","
             "layer=\"fc1\",operand=\"grad\"}",
             (long long)id);
    ck_assert(prom_check(r.body, want_s) == 0.375);
    ck_assert(strstr(r.body, "ampd_layer_fp8_underflow_ratio{") &&
              !strstr(r.body, "layer=\"fc2\",operand="));
    hresp_free(&r);
}
END_TEST

/* The id of the last message sse_steps() read (0: none). */
static int64_t sse_last_id;

/* The steps of the `event: step` messages in an SSE body, in order; checks that every
 * message is well formed, of its type, and that the ids increase. Returns the count;
 * steps[] gets them. (The body is split by hand: libc string searches over a
 * multi-megabyte remainder, as sanitizers check them, would make this quadratic.) */
static int sse_steps(const char *body, int64_t *steps, int max)
{
    int n = 0;
    const char *p = body;
    sse_last_id = 0;
    while (*p) {
        const char *e = p;
        while (e[0] && !(e[0] == '\n' && e[1] == '\n'))
            e++;
        size_t len = (size_t)(e - p);
        char *m = malloc(len + 1);
        ck_assert_ptr_nonnull(m);
        memcpy(m, p, len);
        m[len] = '\0';
        p = *e ? e + 2 : e;
        if (strncmp(m, "id: ", 4) != 0) { /* ": ping", "retry: ..." */
            ck_assert_msg(m[0] == ':' || strncmp(m, "retry: ", 7) == 0, "bad message: %.200s", m);
            free(m);
            continue;
        }
        long long id;
        char ev[32];
        ck_assert_int_eq(sscanf(m, "id: %lld\nevent: %31s\ndata: ", &id, ev), 2);
        const char *data = strstr(m, "\ndata: ");
        ck_assert_ptr_nonnull(data);
        json_t *j = json_loads(data + 7, 0, NULL);
        ck_assert_msg(j != NULL, "bad data: %.200s", data);
        if (strcmp(ev, "end") != 0)
            ck_assert_str_eq(json_string_value(json_object_get(j, "type")), ev);
        ck_assert_msg(id > sse_last_id, "id %lld after %lld", id, (long long)sse_last_id);
        sse_last_id = id;
        if (strcmp(ev, "step") == 0 && n < max)
            steps[n++] = json_integer_value(json_object_get(j, "step"));
        json_decref(j);
        free(m);
    }
    return n;
}

/* ---- the metric-field table reaches every layer ---------------------------------------- */

/* A value for field f that no other field has, exact in its JSON form (a float for FLOAT,
 * an integer for INT, 1 for BOOL). */
static double field_value(int f)
{
    switch (store_metric_field(f)->type) {
    case STORE_TYPE_BOOL:
        return 1.0;
    case STORE_TYPE_INT:
        return 1000.0 + f;
    case STORE_TYPE_FLOAT:
        return 0.25 + f;
    default:
        return 1.5 + f * 0.125;
    }
}

/* gpu_step_metrics and gpu_eval_result filled through the table's src members, each
 * field with its field_value. */
#define FILL_(id, name, line, type, src, since) FILL_##line(STORE_M_##id, src)
#define FILL_STEP(f, src) m->src = field_value(f);
#define FILL_EVAL(f, src) e->src = field_value(f);
static void fill_from_table(gpu_step_metrics *m, gpu_eval_result *e)
{
    memset(m, 0, sizeof(*m));
    memset(e, 0, sizeof(*e));
    m->step = 7;
    STORE_METRICS(FILL_)
}
#undef FILL_
#undef FILL_STEP
#undef FILL_EVAL

/* The worker's line as text (what goes through the pipe), read back by the daemon. */
static void through_pipe(json_t *line, store_line kind, double *v)
{
    char *text = json_dumps(line, JSON_COMPACT | JSON_REAL_PRECISION(9));
    json_t *o;
    ck_assert_ptr_nonnull(text);
    o = json_loads(text, 0, NULL);
    ck_assert_ptr_nonnull(o);
    daemon_line_fields(o, kind, v);
    json_decref(o);
    free(text);
    json_decref(line);
}

/* Every field of STORE_METRICS: printed by the worker, read by the daemon, stored, and
 * served by the metrics API (its field list, JSON points and CSV header) and the SSE
 * replay, with its value intact. A field added to the table is checked here unchanged. */
START_TEST(test_metric_table_layers)
{
    gpu_step_metrics m;
    gpu_eval_result e;
    store_metric row;
    int64_t id = add_job("table", "fp16", 7);
    char path[160];
    json_t *j, *names, *pt;
    hresp r;

    fill_from_table(&m, &e);
    memset(&row, 0, sizeof(row));
    for (int f = 0; f < STORE_M_NFIELDS; f++)
        row.v[f] = NAN;
    through_pipe(daemon_line_step(&m), STORE_LINE_STEP, row.v);
    through_pipe(daemon_line_eval(7, &e), STORE_LINE_EVAL, row.v);
    for (int f = 0; f < STORE_M_NFIELDS; f++)
        ck_assert_msg(row.v[f] == field_value(f), "%s: the daemon read %g, the worker had %g",
                      store_metric_name(f), row.v[f], field_value(f));
    row.job_id = id;
    row.step = 7;
    row.has_eval = true;
    ck_assert_int_eq(store_metric_append(st, &row), 0);
    ck_assert_int_eq(store_flush(st), 0);

    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics", (long long)id);
    j = get_json(port, path, 200);
    names = json_object_get(j, "fields");
    pt = json_array_get(json_object_get(j, "points"), 0);
    ck_assert_int_eq(json_array_size(names), STORE_M_NFIELDS);
    for (int f = 0; f < STORE_M_NFIELDS; f++) {
        const char *name = store_metric_name(f);
        json_t *v = json_object_get(pt, name);
        ck_assert_str_eq(json_string_value(json_array_get(names, (size_t)f)), name);
        /* overflow and skipped are the point's flags of the same names */
        ck_assert_msg(v && (json_is_true(v) || json_number_value(v) == field_value(f)),
                      "%s missing or wrong in the API's point", name);
    }
    json_decref(j);

    snprintf(path, sizeof(path), "/v1/jobs/%lld/metrics?format=csv", (long long)id);
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    {
        char *nl = strchr(r.body, '\n'), *tok, *save = NULL;
        int col = 0;
        ck_assert_ptr_nonnull(nl);
        *nl = '\0';
        for (tok = strtok_r(r.body, ",", &save); tok; tok = strtok_r(NULL, ",", &save), col++)
            ck_assert_str_eq(tok, col == 0 ? "step" : store_metric_name(col - 1));
        ck_assert_int_eq(col, 1 + STORE_M_NFIELDS);
        col = 0;
        for (tok = strtok_r(nl + 1, ",\n", &save); tok; tok = strtok_r(NULL, ",\n", &save), col++)
            ck_assert_msg(strtod(tok, NULL) == (col == 0 ? 7.0 : field_value(col - 1)),
                          "CSV column %d: %s", col, tok);
        ck_assert_int_eq(col, 1 + STORE_M_NFIELDS);
    }
    hresp_free(&r);

    ck_assert_int_eq(store_job_set_status(st, id, STORE_RUNNING, NULL), 0);
    ck_assert_int_eq(store_job_set_status(st, id, STORE_SUCCEEDED, NULL), 0);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/stream", (long long)id);
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    for (int f = 0; f < STORE_M_NFIELDS; f++) {
        char key[64];
        snprintf(key, sizeof(key), "\"%s\":", store_metric_name(f));
        ck_assert_msg(strstr(r.body, key), "%s missing from the SSE replay", key);
    }
    hresp_free(&r);
}
END_TEST

/* ---- the OpenAPI description (docs/openapi.yaml, embedded as JSON) ------------------------ */

/* The embedded description, parsed; a test failure when it is not one JSON object. */
static json_t *openapi_doc(void)
{
    json_error_t je;
    json_t *doc = json_loadb(api_openapi_json, api_openapi_json_len, JSON_REJECT_DUPLICATES, &je);
    ck_assert_msg(json_is_object(doc), "the embedded OpenAPI JSON does not parse: %s", je.text);
    return doc;
}

/* components/schemas/<name> */
static json_t *openapi_schema(json_t *doc, const char *name)
{
    json_t *s = json_object_get(json_object_get(json_object_get(doc, "components"), "schemas"),
                                name);
    ck_assert_msg(json_is_object(s), "no schema %s in the OpenAPI description", name);
    return s;
}

/* Whether the JSON array a holds the string v. */
static bool json_has_str(const json_t *a, const char *v)
{
    size_t i;
    json_t *e;
    json_array_foreach(a, i, e) if (json_is_string(e) && strcmp(json_string_value(e), v) == 0)
        return true;
    return false;
}

/* The schema a "$ref" names (one level), or s itself. */
static json_t *openapi_deref(json_t *doc, json_t *s)
{
    const char *ref = json_string_value(json_object_get(s, "$ref"));
    const char *pfx = "#/components/schemas/";
    if (!ref)
        return s;
    ck_assert_msg(strncmp(ref, pfx, strlen(pfx)) == 0, "unexpected $ref %s", ref);
    return openapi_schema(doc, ref + strlen(pfx));
}

/* Every route of API_ROUTES is a path of the description with exactly the methods the table
 * gives it (GET, POST, DELETE; HEAD comes with GET), and every path outside the dashboard's is
 * a route: neither can gain an endpoint the other lacks. */
START_TEST(test_openapi_routes)
{
    json_t *doc = openapi_doc();
    json_t *paths = json_object_get(doc, "paths");
    /* automatic: whether a handler is NULL is not a load-time constant in every build (PIE
     * under the sanitizers) */
    const struct {
        const char *pattern;
        bool get, post, del;
    } rows[] = {
#define ROW_(id, pattern, get, post, del) {pattern, get != NULL, post != NULL, del != NULL},
        API_ROUTES(ROW_)
#undef ROW_
    };
    size_t nrows = sizeof(rows) / sizeof(rows[0]);
    const char *key;
    json_t *item;

    ck_assert_str_eq(json_string_value(json_object_get(doc, "openapi")), "3.1.0");
    for (size_t i = 0; i < nrows; i++) {
        item = json_object_get(paths, rows[i].pattern);
        ck_assert_msg(json_is_object(item), "route %s is not in the OpenAPI paths",
                      rows[i].pattern);
        ck_assert_msg((json_object_get(item, "get") != NULL) == rows[i].get &&
                          (json_object_get(item, "post") != NULL) == rows[i].post &&
                          (json_object_get(item, "delete") != NULL) == rows[i].del,
                      "the OpenAPI methods of %s differ from API_ROUTES'", rows[i].pattern);
        ck_assert_msg(!json_object_get(item, "put") && !json_object_get(item, "patch") &&
                          !json_object_get(item, "head") && !json_object_get(item, "options"),
                      "%s describes a method the server does not route", rows[i].pattern);
    }
    json_object_foreach(paths, key, item)
    {
        bool found = strcmp(key, "/") == 0 || strcmp(key, "/{file}") == 0; /* the dashboard */
        for (size_t i = 0; i < nrows && !found; i++)
            found = strcmp(rows[i].pattern, key) == 0;
        ck_assert_msg(found, "OpenAPI path %s is not a route of API_ROUTES", key);
    }
    json_decref(doc);
}
END_TEST

/* The metric fields: MetricName lists STORE_METRICS in order; MetricPoint has one property per
 * field (overflow and skipped being its flags) besides step, step_last, count, nonfinite and
 * job (a lineage's);
 * the SSE step and eval messages have the fields of their line, typed as the table says. */
START_TEST(test_openapi_metric_fields)
{
    json_t *doc = openapi_doc();
    json_t *names = json_object_get(openapi_schema(doc, "MetricName"), "enum");
    json_t *point = json_object_get(openapi_schema(doc, "MetricPoint"), "properties");
    json_t *stepm = json_object_get(openapi_schema(doc, "StepMessage"), "properties");
    json_t *evalm = json_object_get(openapi_schema(doc, "EvalMessage"), "properties");

    ck_assert_int_eq((int)json_array_size(names), STORE_M_NFIELDS);
    ck_assert_int_eq((int)json_object_size(point), STORE_M_NFIELDS + 5);
    for (int f = 0; f < STORE_M_NFIELDS; f++) {
        const store_metric_info *m = store_metric_field(f);
        json_t *own = m->line == STORE_LINE_STEP ? stepm : evalm;
        json_t *other = m->line == STORE_LINE_STEP ? evalm : stepm;
        json_t *sch = openapi_deref(doc, json_object_get(own, m->name));
        const json_t *type = json_object_get(sch, "type");
        ck_assert_msg(json_is_string(json_array_get(names, (size_t)f)) &&
                          strcmp(json_string_value(json_array_get(names, (size_t)f)), m->name) == 0,
                      "MetricName[%d] is not %s", f, m->name);
        ck_assert_msg(json_object_get(point, m->name), "MetricPoint lacks %s", m->name);
        ck_assert_msg(json_object_get(own, m->name) && !json_object_get(other, m->name),
                      "%s is not in the SSE message of its line only", m->name);
        if (m->type == STORE_TYPE_INT)
            ck_assert_msg(json_has_str(type, "integer") && json_has_str(type, "null"),
                          "%s (INT) is not typed [integer, null] in its SSE message", m->name);
        else if (m->type == STORE_TYPE_BOOL)
            ck_assert_msg(json_has_str(type, "boolean") && json_has_str(type, "null"),
                          "%s (BOOL) is not typed [boolean, null] in its SSE message", m->name);
        else
            ck_assert_msg(json_object_get(sch, "anyOf") && !type,
                          "%s (a real) is not a number, NaN/Infinity or null in its SSE message",
                          m->name);
    }
    ck_assert_int_eq((int)json_object_size(stepm) + (int)json_object_size(evalm),
                     STORE_M_NFIELDS + 4); /* type and step in each */
    json_decref(doc);
}
END_TEST

/* The layer fields (LayerField, LayerRow) and the autocast ops (AutocastOp) are the store's and
 * the engine's. */
START_TEST(test_openapi_layers_autocast)
{
    json_t *doc = openapi_doc();
    json_t *lf = json_object_get(openapi_schema(doc, "LayerField"), "enum");
    json_t *row = json_object_get(openapi_schema(doc, "LayerRow"), "properties");
    json_t *ops = json_object_get(openapi_schema(doc, "AutocastOp"), "enum");

    ck_assert_int_eq((int)json_array_size(lf), STORE_L_NFIELDS);
    ck_assert_int_eq((int)json_object_size(row), STORE_L_NFIELDS + 2); /* name, dtype */
    for (int f = 0; f < STORE_L_NFIELDS; f++) {
        ck_assert_str_eq(json_string_value(json_array_get(lf, (size_t)f)),
                         store_layer_field_name(f));
        ck_assert_msg(json_object_get(row, store_layer_field_name(f)), "LayerRow lacks %s",
                      store_layer_field_name(f));
    }
    ck_assert_int_eq((int)json_array_size(ops), GPU_OP_COUNT);
    for (int o = 0; o < GPU_OP_COUNT; o++)
        ck_assert_str_eq(json_string_value(json_array_get(ops, (size_t)o)), gpu_op_name((gpu_op)o));
    json_decref(doc);
}
END_TEST

/* The text of docs/<name> in the source tree; the caller frees it. */
static char *read_doc(const char *name)
{
    const char *srcdir = getenv("srcdir");
    char path[512], *text;
    FILE *fp;
    long n;

    snprintf(path, sizeof(path), "%s/docs/%s", srcdir ? srcdir : ".", name);
    fp = fopen(path, "rb");
    ck_assert_msg(fp != NULL, "cannot open %s", path);
    fseek(fp, 0, SEEK_END);
    n = ftell(fp);
    rewind(fp);
    text = calloc(1, (size_t)n + 1);
    ck_assert_ptr_nonnull(text);
    ck_assert_int_eq(fread(text, 1, (size_t)n, fp), (size_t)n);
    fclose(fp);
    return text;
}

/* docs/api.md documents every metric field of the table, and docs/diagnostics.md every
 * layer field (each as `name`). */
START_TEST(test_metric_fields_documented)
{
    char key[64], *text = read_doc("api.md");
    for (int f = 0; f < STORE_M_NFIELDS; f++) {
        snprintf(key, sizeof(key), "`%s`", store_metric_name(f));
        ck_assert_msg(strstr(text, key), "docs/api.md does not document the metric %s", key);
    }
    free(text);
    text = read_doc("diagnostics.md");
    for (int f = 0; f < STORE_L_NFIELDS; f++) {
        snprintf(key, sizeof(key), "`%s`", store_layer_field_name(f));
        ck_assert_msg(strstr(text, key), "docs/diagnostics.md does not document the layer "
                                         "field %s", key);
    }
    free(text);
}
END_TEST

/* The message of an SSE body whose data holds `what` (its "id: " line), or NULL. */
static const char *sse_find(const char *body, const char *what)
{
    const char *d = strstr(body, what);
    if (!d)
        return NULL;
    while (d > body && !(d[-1] == '\n' && d - 1 > body && d[-2] == '\n'))
        d--;
    return strncmp(d, "id: ", 4) == 0 ? d : NULL;
}

START_TEST(test_sse_finished)
{
    int64_t id = add_job("s", "fp16", 300);
    int64_t steps[400];
    char path[160], hdr[64];
    add_rows(id, 1, 300);
    ck_assert_int_eq(store_event_append(st, id, 0, "lifecycle", "started", NULL), 0);
    ck_assert_int_eq(store_event_append(st, id, 97, "overflow", "overflow at 97", NULL), 0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(store_job_set_status(st, id, STORE_RUNNING, NULL), 0);
    ck_assert_int_eq(store_job_set_summary(st, id,
                                           "{\"type\":\"summary\",\"status\":"
                                           "\"succeeded\",\"final_loss\":0.003}"),
                     0);
    ck_assert_int_eq(store_job_set_status(st, id, STORE_SUCCEEDED, NULL), 0);

    hresp r, full;
    snprintf(path, sizeof(path), "/v1/jobs/%lld/stream", (long long)id);
    http(port, "GET", path, NULL, NULL, 0, &full);
    ck_assert_int_eq(full.status, 200);
    ck_assert_str_eq(header(&full, "Content-Type"), "text/event-stream");
    ck_assert_str_eq(header(&full, "Cache-Control"), "no-cache");
    int n = sse_steps(full.body, steps, 400);
    ck_assert_int_eq(n, 300);
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(steps[i], i + 1);
    /* the store's order: each step, its eval; the events as they were appended; the end */
    const char *s100 = sse_find(full.body, "{\"type\":\"step\",\"step\":100,");
    const char *e100 = sse_find(full.body, "{\"type\":\"eval\",\"step\":100,");
    const char *s101 = sse_find(full.body, "{\"type\":\"step\",\"step\":101,");
    ck_assert(s100 && e100 && s101 && s100 < e100 && e100 < s101);
    const char *ev0 = strstr(full.body, "\"kind\":\"lifecycle\"");
    const char *ev97 = strstr(full.body, "\"kind\":\"overflow\"");
    const char *end = strstr(full.body, "event: end\ndata: ");
    ck_assert(ev0 && ev97 && end && sse_find(full.body, "\"step\":300,") < ev0 && ev0 < ev97 &&
              ev97 < end);
    ck_assert_ptr_nonnull(strstr(end, "\"final_loss\":0.003"));
    ck_assert_ptr_null(strstr(end + 1, "event:"));
    ck_assert_ptr_nonnull(strstr(full.body, "\"loss\":\"NaN\""));
    ck_assert_ptr_nonnull(strstr(full.body, "\"loss\":\"Infinity\""));
    ck_assert_ptr_null(strstr(full.body, "\"eval_loss\":null")); /* no eval field in a step */

    /* a resume at every id delivers exactly what followed it in the uninterrupted read */
    int resumes = 0;
    for (const char *m = full.body; (m = strstr(m, "\nid: ")); m++) {
        long long mid;
        ck_assert_int_eq(sscanf(m + 5, "%lld", &mid), 1);
        const char *next = strstr(m + 1, "\n\n");
        ck_assert_ptr_nonnull(next);
        next += 2;
        snprintf(hdr, sizeof(hdr), "Last-Event-ID: %lld\r\n", mid);
        http(port, "GET", path, hdr, NULL, 0, &r);
        if (*next == '\0') { /* after the end: 204, so that clients stop reconnecting */
            ck_assert_int_eq(r.status, 204);
            ck_assert_uint_eq(r.len, 0);
        } else {
            ck_assert_int_eq(r.status, 200);
            ck_assert_msg(strncmp(r.body, "retry: 2000\n\n", 13) == 0 &&
                              strcmp(r.body + 13, next) == 0,
                          "the resume at %lld differs from the uninterrupted read", mid);
        }
        hresp_free(&r);
        resumes++;
    }
    ck_assert_int_ge(resumes, 300 + 3 + 3); /* steps, evals, events, the end */

    /* ?last_event_id and ?from_step (after the message of that step) */
    const char *s299 = sse_find(full.body, "{\"type\":\"step\",\"step\":299,");
    long long id299;
    ck_assert(s299 && sscanf(s299, "id: %lld", &id299) == 1);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/stream?last_event_id=%lld", (long long)id, id299);
    http(port, "GET", path, NULL, NULL, 0, &r);
    n = sse_steps(r.body, steps, 400);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(steps[0], 300);
    hresp_free(&r);
    /* a client with the steps and the state of a finished job (from the REST API) has it all */
    snprintf(path, sizeof(path), "/v1/jobs/%lld/stream?from_step=299", (long long)id);
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 204);
    hresp_free(&r);
    /* resumed: from_step skips the end of the run it was resumed from */
    ck_assert_int_eq(store_job_set_status(st, id, STORE_RUNNING, NULL), 0);
    add_rows(id, 301, 2);
    hconn f;
    char head[256];
    hc_open(&f, port);
    n = snprintf(head, sizeof(head),
                 "GET /v1/jobs/%lld/stream?from_step=0 HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n\r\n",
                 (long long)id, port);
    hc_send(&f, head, (size_t)n);
    ck_assert(hc_wait(&f, "{\"type\":\"step\",\"step\":302,", 3000));
    ck_assert(hc_wait(&f, "\n: ping\n\n", 2000));
    ck_assert_int_eq(sse_steps(f.body.data, steps, 400), 2);
    ck_assert_int_eq(steps[0], 301);
    ck_assert_ptr_null(strstr(f.body.data, "event: end\n"));
    hc_close(&f);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/stream", (long long)id);
    req_error(port, "GET", path, "Last-Event-ID: abc\r\n", NULL, 400, "invalid_parameter",
              "Last-Event-ID");
    snprintf(path, sizeof(path), "/v1/jobs/%lld/stream?from_step=x", (long long)id);
    req_error(port, "GET", path, NULL, NULL, 400, "invalid_parameter", "from_step");
    hresp_free(&full);
}
END_TEST

START_TEST(test_sse_running_and_stop)
{
    int64_t id = add_job("live", "fp16", 100);
    char path[160], head[256];
    hconn c;
    ck_assert_int_eq(store_job_set_status(st, id, STORE_RUNNING, NULL), 0);
    add_rows(id, 1, 10);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/stream", (long long)id);
    hc_open(&c, port);
    int n =
        snprintf(head, sizeof(head), "GET %s HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n\r\n", path, port);
    hc_send(&c, head, (size_t)n);
    ck_assert(hc_wait(&c, "{\"type\":\"step\",\"step\":10,", 3000));
    /* no data: a heartbeat (100 ms in this test) */
    ck_assert(hc_wait(&c, "\n: ping\n\n", 2000));
    /* rows that reach the store are followed */
    add_rows(id, 11, 10);
    ck_assert(hc_wait(&c, "{\"type\":\"step\",\"step\":20,", 3000));
    int64_t steps[64];
    ck_assert_int_eq(sse_steps(c.body.data, steps, 64), 20);
    for (int i = 0; i < 20; i++)
        ck_assert_int_eq(steps[i], i + 1);
    /* ?from_step: what follows the step a client loaded from /metrics */
    hconn f;
    hc_open(&f, port);
    n = snprintf(head, sizeof(head), "GET %s?from_step=12 HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n\r\n",
                 path, port);
    hc_send(&f, head, (size_t)n);
    ck_assert(hc_wait(&f, "{\"type\":\"step\",\"step\":20,", 3000));
    ck_assert(hc_wait(&f, "\n: ping\n\n", 2000)); /* the step's message is complete */
    ck_assert_int_eq(sse_steps(f.body.data, steps, 64), 8);
    ck_assert_int_eq(steps[0], 13);
    hc_close(&f);

    /* api_stop ends the open stream promptly */
    double t0 = gpu_now();
    api_stop(srv);
    srv = NULL;
    double took = gpu_now() - t0;
    ck_assert_msg(took < 2.0, "api_stop took %.2f s with a stream open", took);
    hc_read_all(&c, 2000);
    hc_close(&c);
}
END_TEST

START_TEST(test_sse_many_clients)
{
    enum { N = 100 };
    static hconn c[N];
    int64_t id = add_job("many", "bf16", 100);
    char head[256];
    ck_assert_int_eq(store_job_set_status(st, id, STORE_RUNNING, NULL), 0);
    add_rows(id, 1, 5);
    int n = snprintf(head, sizeof(head),
                     "GET /v1/jobs/%lld/stream HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n\r\n",
                     (long long)id, port);
    for (int i = 0; i < N; i++) {
        hc_open(&c[i], port);
        hc_send(&c[i], head, (size_t)n);
    }
    for (int i = 0; i < N; i++)
        ck_assert_msg(hc_wait(&c[i], "{\"type\":\"step\",\"step\":5,", 5000), "client %d", i);
    /* all of them are connected at once; the job goes on and ends */
    add_rows(id, 6, 20);
    ck_assert_int_eq(store_job_set_summary(st, id,
                                           "{\"type\":\"summary\",\"status\":"
                                           "\"succeeded\"}"),
                     0);
    ck_assert_int_eq(store_job_set_status(st, id, STORE_SUCCEEDED, NULL), 0);
    for (int i = 0; i < N; i++) {
        int64_t steps[64];
        hc_read_all(&c[i], 10000);
        ck_assert_int_eq(sse_steps(c[i].body.data, steps, 64), 25);
        for (int k = 0; k < 25; k++)
            ck_assert_int_eq(steps[k], k + 1);
        ck_assert_ptr_nonnull(strstr(c[i].body.data, "event: end\n"));
        hc_close(&c[i]);
    }
}
END_TEST

/* The per-address limit as the accept policy applies it, and the head deadline's sweep,
 * on the fixture's server (defaults: 64 per address, 10 s). */
START_TEST(test_conn_limits)
{
    enum { N = 64 };
    struct sockaddr_storage ss, other, local;
    api_conn *c[N + 1];
    socklen_t n = sa4(&ss, "192.0.2.7"), no = sa4(&other, "192.0.2.8"),
              nl = sa4(&local, "127.0.0.1");
    int closed = 0;
    int64_t next = INT64_MAX, now = api_now_ms();

    for (int i = 0; i < N; i++) {
        ck_assert(api_conn_admit(srv, (struct sockaddr *)&ss, n));
        ck_assert_int_eq(api_conn_open(srv, -1, (struct sockaddr *)&ss, n, &c[i]), 0);
    }
    ck_assert(!api_conn_admit(srv, (struct sockaddr *)&ss, n)); /* the 65th is refused */
    ck_assert(api_conn_admit(srv, (struct sockaddr *)&other, no));
    ck_assert(api_conn_admit(srv, (struct sockaddr *)&local, nl)); /* loopback: exempt */
    ck_assert_int_eq(api_conn_open(srv, -1, (struct sockaddr *)&local, nl, &c[N]), 0);
    api_conn_close(srv, c[0]);
    ck_assert(api_conn_admit(srv, (struct sockaddr *)&ss, n));

    /* the sweep: nothing is due yet, and the next deadline is the oldest head's */
    api_conn_sweep(srv, now, &closed, &next);
    ck_assert_int_eq(closed, 0);
    ck_assert(next > now && next <= api_now_ms() + 10000);
    /* a head that completed is no longer swept; one awaited again is */
    api_conn_head_done(srv, c[1]);
    api_conn_head_done(srv, c[2]);
    api_conn_head_wait(srv, c[2]);
    next = INT64_MAX;
    api_conn_sweep(srv, api_now_ms() + 60000, &closed, &next);
    ck_assert_int_eq(closed, N - 1); /* c[1..N], less c[1] */
    ck_assert(next == INT64_MAX);
    api_conn_sweep(srv, api_now_ms() + 60000, &closed, &next);
    ck_assert_int_eq(closed, 0);
    for (int i = 1; i <= N; i++)
        api_conn_close(srv, c[i]);
    api_conn_close(srv, NULL);
    ck_assert_uint_eq(srv->peers.naddrs, 0);
}
END_TEST

/* A request head that trickles in is cut at the deadline; so is an idle keep-alive
 * connection; a complete request on time is answered. */
START_TEST(test_head_deadline)
{
    api_config c;
    api_server *s;
    char err[256], buf[4096];
    hconn slow, idle;
    memset(&c, 0, sizeof(c));
    snprintf(c.listen, sizeof(c.listen), "127.0.0.1:0");
    api_spec_opts_default(&c.spec);
    c.head_timeout_s = 1;
    ck_assert_msg(api_start(&c, st, NULL, &s, err, sizeof(err)) == 0, "%s", err);
    hc_open(&slow, api_port(s));
    hc_open(&idle, api_port(s));
    char req[96];
    snprintf(req, sizeof(req), "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n\r\n",
             api_port(s));
    hc_send(&idle, req, strlen(req));
    ck_assert(hc_wait(&idle, "{\"status\":\"ok\"}", 2000));
    double t0 = gpu_now();
    bool cut = false;
    /* a byte every 100 ms: libmicrohttpd's own timeout would never fire */
    for (size_t i = 0; i < strlen(req) - 1 && !cut; i++) {
        struct pollfd pf = {slow.fd, POLLIN, 0};
        hc_send(&slow, req + i, 1);
        if (poll(&pf, 1, 100) == 1)
            cut = recv(slow.fd, buf, sizeof(buf), 0) <= 0;
    }
    double took = gpu_now() - t0;
    ck_assert_msg(cut, "a head trickled for %.1f s was not cut", took);
    ck_assert_msg(took > 0.8 && took < 2.5, "cut after %.2f s (deadline 1 s)", took);
    /* the keep-alive connection that sent nothing more is closed at its deadline too */
    hc_pump(&idle, 2000);
    while (hc_pump(&idle, 2000))
        ;
    ck_assert(idle.eof);
    hc_close(&slow);
    hc_close(&idle);
    api_stop(s);
}
END_TEST

/* Who may send a request: the Host header must name the daemon, an Origin header must be the
 * daemon's own, the framing must be unambiguous, and a change must carry Content-Type:
 * application/json (a header a page of another site cannot send without a preflight). */
START_TEST(test_sender)
{
    char host[64], origin[96], req[1024], path[64];
    hresp r;
    int n;

    snprintf(host, sizeof(host), "127.0.0.1:%u", port);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, NULL), 200);
    snprintf(host, sizeof(host), "localhost:%u", port);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, NULL), 200);
    snprintf(host, sizeof(host), "LOCALHOST:%u", port);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, NULL), 200);
    snprintf(host, sizeof(host), "[::1]:%u", port);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, NULL), 200);
    /* a DNS-rebinding page: the browser sends the page's own name */
    snprintf(host, sizeof(host), "rebind.example:%u", port);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, NULL), 421);
    ck_assert_int_eq(get_as(port, "/healthz", host, NULL), 421);
    ck_assert_int_eq(get_as(port, "/", "127.0.0.1", NULL), 421); /* port 80 */
    snprintf(host, sizeof(host), "127.0.0.1:%u", port + 1);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, NULL), 421);
    ck_assert_int_eq(get_as(port, "/v1/jobs", "127.0.0.1:x", NULL), 421);
    ck_assert_int_eq(get_as(port, "/v1/jobs", "", NULL), 421);
    ck_assert_int_eq(get_as(port, "/v1/jobs", NULL, NULL), 400); /* HTTP/1.1 needs one */
    raw_http(port, "GET /healthz HTTP/1.0\r\n\r\n", &r, &n);     /* HTTP/1.0 without Host */
    ck_assert_int_eq(r.status, 200);
    hresp_free(&r);
    snprintf(host, sizeof(host), "rebind.example:%u", port);
    snprintf(req, sizeof(req), "GET /v1/jobs HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n",
             host);
    raw_http(port, req, &r, &n);
    expect_error(&r, 421, "misdirected_request", "Host");
    ck_assert_ptr_nonnull(strstr(r.body, "--allow-host"));
    hresp_free(&r);

    /* Origin: the daemon's own page, another origin, an opaque one */
    snprintf(host, sizeof(host), "127.0.0.1:%u", port);
    snprintf(origin, sizeof(origin), "Origin: http://127.0.0.1:%u\r\n", port);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, origin), 200);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, "Origin: http://evil.example:9999\r\n"), 403);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, "Origin: null\r\n"), 403);
    snprintf(origin, sizeof(origin), "Origin: https://127.0.0.1:%u\r\n", port);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, origin), 403);
    snprintf(origin, sizeof(origin), "Origin: http://localhost:%u\r\n", port);
    ck_assert_int_eq(get_as(port, "/v1/jobs", host, origin), 403); /* another origin */
    int64_t id = add_job("x", "fp32", 10);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/cancel", (long long)id);
    req_error(port, "POST", path,
              "Origin: http://evil.example:9999\r\nAuthorization: Bearer " TOKEN
              "\r\nContent-Type: application/json\r\n",
              NULL, 403, "forbidden_origin", "Origin");

    /* a change without Content-Type: application/json (what curl -X POST, a form or a no-cors
     * fetch sends) */
    req_error(port, "POST", path, "Authorization: Bearer " TOKEN "\r\n", NULL, 415,
              "unsupported_media_type", "Content-Type");
    req_error(port, "POST", path, "Authorization: Bearer " TOKEN "\r\nContent-Type: text/plain\r\n",
              "{}", 415, "unsupported_media_type", "Content-Type");
    snprintf(path, sizeof(path), "/v1/jobs/%lld", (long long)id);
    http(port, "DELETE", path, "Authorization: Bearer " TOKEN "\r\n", NULL, 0, &r);
    expect_error(&r, 415, "unsupported_media_type", "Content-Type");
    ck_assert_ptr_nonnull(strstr(r.body, "needs the header Content-Type: application/json"));
    ck_assert_ptr_nonnull(strstr(r.body, "curl -X DELETE -H 'Content-Type: application/json'"));
    hresp_free(&r);
    json_decref(get_json(port, path, 200)); /* nothing was deleted */

    /* framing: two Content-Length headers (the second would leave "GET ..." to be read as a
     * request of its own), Content-Length with Transfer-Encoding, two Host headers */
    snprintf(req, sizeof(req),
             "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nAuthorization: Bearer " TOKEN
             "\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
             "Content-Length: 37\r\n\r\n{}GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
             port);
    raw_http(port, req, &r, &n);
    expect_error(&r, 400, "invalid_request", "Content-Length");
    ck_assert_ptr_nonnull(strstr(r.body, "2 Content-Length headers"));
    ck_assert_int_eq(n, 1);
    hresp_free(&r);
    snprintf(req, sizeof(req),
             "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nAuthorization: Bearer " TOKEN
             "\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
             "Content-Length: 2\r\nConnection: close\r\n\r\n{}",
             port);
    raw_http(port, req, &r, &n);
    expect_error(&r, 400, "invalid_request", "Content-Length");
    hresp_free(&r);
    snprintf(req, sizeof(req),
             "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nAuthorization: Bearer " TOKEN
             "\r\nContent-Type: application/json\r\nContent-Length: 7\r\n"
             "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n",
             port);
    raw_http(port, req, &r, &n);
    expect_error(&r, 400, "invalid_request", "Content-Length");
    hresp_free(&r);
    snprintf(req, sizeof(req),
             "GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:%u\r\nHost: rebind.example\r\n"
             "Connection: close\r\n\r\n",
             port);
    raw_http(port, req, &r, &n);
    expect_error(&r, 400, "invalid_request", "Host");
    hresp_free(&r);
}
END_TEST

/* --allow-host and --allow-origin (api_config's lists), and api_start refusing bad entries. */
START_TEST(test_allow_lists)
{
    api_config c;
    api_server *s2 = NULL;
    char err[512], host[64];
    memset(&c, 0, sizeof(c));
    api_spec_opts_default(&c.spec);
    snprintf(c.listen, sizeof(c.listen), "127.0.0.1:0");
    c.nallow_hosts = 2;
    snprintf(c.allow_hosts[0], sizeof(c.allow_hosts[0]), "AMPD.example");
    snprintf(c.allow_hosts[1], sizeof(c.allow_hosts[1]), "proxy.example:8443");
    c.nallow_origins = 1;
    snprintf(c.allow_origins[0], sizeof(c.allow_origins[0]), "https://ampd.example");
    ck_assert_msg(api_start(&c, st, NULL, &s2, err, sizeof(err)) == 0, "%s", err);
    unsigned p2 = api_port(s2);
    ck_assert_int_eq(get_as(p2, "/healthz", "ampd.example", NULL), 200); /* any port */
    ck_assert_int_eq(get_as(p2, "/healthz", "ampd.example:443", NULL), 200);
    ck_assert_int_eq(get_as(p2, "/healthz", "proxy.example:8443", NULL), 200);
    ck_assert_int_eq(get_as(p2, "/healthz", "proxy.example:8444", NULL), 421);
    ck_assert_int_eq(get_as(p2, "/healthz", "proxy.example", NULL), 421);
    ck_assert_int_eq(get_as(p2, "/healthz", "sub.ampd.example", NULL), 421);
    snprintf(host, sizeof(host), "127.0.0.1:%u", p2);
    ck_assert_int_eq(get_as(p2, "/healthz", host, "Origin: https://ampd.example\r\n"), 200);
    ck_assert_int_eq(get_as(p2, "/healthz", host, "Origin: HTTPS://AMPD.example\r\n"), 200);
    ck_assert_int_eq(get_as(p2, "/healthz", host, "Origin: http://ampd.example\r\n"), 403);
    ck_assert_int_eq(get_as(p2, "/healthz", host, "Origin: https://ampd.example:444\r\n"), 403);
    ck_assert_int_eq(api_stop(s2), 0);

    snprintf(c.allow_hosts[1], sizeof(c.allow_hosts[1]), "http://proxy.example");
    ck_assert_int_eq(api_start(&c, st, NULL, &s2, err, sizeof(err)), GPU_EINVAL);
    ck_assert_ptr_null(s2);
    ck_assert_ptr_nonnull(strstr(err, "\"http://proxy.example\" is not NAME or NAME:PORT"));
    snprintf(c.allow_hosts[1], sizeof(c.allow_hosts[1]), "proxy.example");
    snprintf(c.allow_origins[0], sizeof(c.allow_origins[0]), "https://ampd.example/");
    ck_assert_int_eq(api_start(&c, st, NULL, &s2, err, sizeof(err)), GPU_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "is not an origin"));
    c.nallow_origins = API_MAX_ALLOW + 1;
    ck_assert_int_eq(api_start(&c, st, NULL, &s2, err, sizeof(err)), GPU_EINVAL);
    ck_assert_ptr_null(s2);
}
END_TEST

/* A job queue whose cancel blocks until released (or 8 s pass), as a handler stuck in a
 * callback, a file or a lock would be. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool entered, release, returned;
} stuck_queue;

static int stuck_cancel(void *ctx, int64_t id)
{
    stuck_queue *q = ctx;
    struct timespec dl;
    (void)id;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 8;
    pthread_mutex_lock(&q->mu);
    q->entered = true;
    pthread_cond_broadcast(&q->cv);
    while (!q->release && pthread_cond_timedwait(&q->cv, &q->mu, &dl) == 0)
        ;
    q->returned = true;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return STORE_ECONFLICT;
}

/* The threads of this process: the entries of /proc/self/task. */
static int thread_count(void)
{
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    int n = 0;
    ck_assert_ptr_nonnull(d);
    while ((e = readdir(d)) != NULL)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* api_stop returns within its deadline whatever a handler is doing: a request blocked in
 * the queue's cancel is left behind (GPU_ETIMEDOUT) and the server is freed once it ends
 * (by the stop thread, which then ends too: the process is back to its threads from before
 * the server). */
START_TEST(test_stop_deadline)
{
    stuck_queue q = {.entered = false};
    api_jobs jobs = {.ctx = &q, .cancel = stuck_cancel};
    api_config c;
    api_server *s2 = NULL;
    char err[256], req[512];
    hconn h;

    pthread_mutex_init(&q.mu, NULL);
    pthread_cond_init(&q.cv, NULL);
    memset(&c, 0, sizeof(c));
    api_spec_opts_default(&c.spec);
    snprintf(c.listen, sizeof(c.listen), "127.0.0.1:0");
    c.stop_timeout_ms = 1000;
    int threads = thread_count();
    ck_assert_msg(api_start(&c, st, &jobs, &s2, err, sizeof(err)) == 0, "%s", err);
    int64_t id = add_job("stuck", "fp32", 10);
    hc_open(&h, api_port(s2));
    int n = snprintf(req, sizeof(req),
                     "POST /v1/jobs/%lld/cancel HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n"
                     "Content-Type: application/json\r\nContent-Length: 0\r\n\r\n",
                     (long long)id, api_port(s2));
    hc_send(&h, req, (size_t)n);
    pthread_mutex_lock(&q.mu);
    while (!q.entered)
        pthread_cond_wait(&q.cv, &q.mu);
    pthread_mutex_unlock(&q.mu);

    double t0 = gpu_now();
    int rc = api_stop(s2);
    double took = gpu_now() - t0;
    ck_assert_msg(took < 2.5, "api_stop took %.2f s with a handler blocked (deadline 1 s)", took);
    ck_assert_int_eq(rc, GPU_ETIMEDOUT);
    pthread_mutex_lock(&q.mu);
    q.release = true;
    pthread_cond_broadcast(&q.cv);
    while (!q.returned)
        pthread_cond_wait(&q.cv, &q.mu);
    pthread_mutex_unlock(&q.mu);
    hc_close(&h);
    for (t0 = gpu_now(); thread_count() > threads; test_sleep_ms(10))
        ck_assert_msg(gpu_now() - t0 < 5,
                      "%d threads 5 s after the handler ended, %d before the server: the stop "
                      "thread has not freed it",
                      thread_count(), threads);
    pthread_cond_destroy(&q.cv);
    pthread_mutex_destroy(&q.mu);
}
END_TEST

START_TEST(test_start_refusals)
{
    api_config c;
    api_server *s = NULL;
    char err[256];
    memset(&c, 0, sizeof(c));
    api_spec_opts_default(&c.spec);
    snprintf(c.listen, sizeof(c.listen), "0.0.0.0:0");
    ck_assert_int_eq(api_start(&c, st, NULL, &s, err, sizeof(err)), GPU_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "token"));
    ck_assert_ptr_null(s);
    snprintf(c.listen, sizeof(c.listen), "[::]:0");
    ck_assert_int_eq(api_start(&c, st, NULL, &s, err, sizeof(err)), GPU_EINVAL);
    const char *bad[] = {"127.0.0.1", "127.0.0.1:",   "127.0.0.1:65536", "127.0.0.1:x", "::1:80",
                         "[::1]80",   "300.1.1.1:80", "host:80",         ":80",         ""};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(c.listen, sizeof(c.listen), "%s", bad[i]);
        ck_assert_msg(api_start(&c, st, NULL, &s, err, sizeof(err)) == GPU_EINVAL, "%s", bad[i]);
    }
    /* IPv6 loopback, when the machine has it */
    snprintf(c.listen, sizeof(c.listen), "[::1]:0");
    if (api_start(&c, st, NULL, &s, err, sizeof(err)) == 0) {
        ck_assert_uint_gt(api_port(s), 0);
        api_stop(s);
    }
    api_stop(NULL);
    ck_assert_uint_eq(api_port(NULL), 0);
}
END_TEST

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

START_TEST(test_static_and_head)
{
    char web[300], p[400], err[256];
    api_config c;
    api_server *s2 = NULL;
    hresp r;

    snprintf(web, sizeof(web), "%s/web", dir);
    ck_assert_int_eq(mkdir(web, 0755), 0);
    snprintf(p, sizeof(p), "%s/index.html", web);
    write_file(p, "<!doctype html><title>ampd</title>");
    snprintf(p, sizeof(p), "%s/app.js", web);
    write_file(p, "console.log(1);");
    snprintf(p, sizeof(p), "%s/secret.txt", dir);
    write_file(p, "outside");
    snprintf(p, sizeof(p), "%s/escape.txt", web);
    char target[400];
    snprintf(target, sizeof(target), "%s/secret.txt", dir);
    ck_assert_int_eq(symlink(target, p), 0);

    memset(&c, 0, sizeof(c));
    snprintf(c.listen, sizeof(c.listen), "127.0.0.1:0");
    snprintf(c.web_root, sizeof(c.web_root), "%s", web);
    api_spec_opts_default(&c.spec);
    ck_assert_msg(api_start(&c, st, NULL, &s2, err, sizeof(err)) == 0, "%s", err);
    unsigned p2 = api_port(s2);
    http(p2, "GET", "/", NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_str_eq(header(&r, "Content-Type"), "text/html; charset=utf-8");
    ck_assert_str_eq(r.body, "<!doctype html><title>ampd</title>");
    hresp_free(&r);
    http(p2, "GET", "/app.js", NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_int_eq(strncmp(header(&r, "Content-Type"), "text/javascript", 15), 0);
    hresp_free(&r);
    req_error(p2, "GET", "/escape.txt", NULL, NULL, 404, "not_found", NULL);
    req_error(p2, "GET", "/../secret.txt", NULL, NULL, 404, "not_found", NULL);
    req_error(p2, "GET", "/%2e%2e/secret.txt", NULL, NULL, 404, "not_found", NULL);
    req_error(p2, "GET", "/nope.html", NULL, NULL, 404, "not_found", NULL);
    req_error(p2, "POST", "/", NULL, NULL, 405, "method_not_allowed", NULL);
    json_decref(get_json(p2, "/healthz", 200)); /* the API is still there */
    /* a FIFO (or any file that is not regular) is a 404 at once, not a handler blocked in
     * open() waiting for a writer, and the server still stops promptly */
    snprintf(p, sizeof(p), "%s/pipe", web);
    ck_assert_int_eq(mkfifo(p, 0644), 0);
    double t0 = gpu_now();
    req_error(p2, "GET", "/pipe", NULL, NULL, 404, "not_found", NULL);
    ck_assert_msg(gpu_now() - t0 < 2.0, "GET of a FIFO took %.2f s", gpu_now() - t0);
    t0 = gpu_now();
    ck_assert_int_eq(api_stop(s2), 0);
    ck_assert_msg(gpu_now() - t0 < 2.0, "api_stop took %.2f s", gpu_now() - t0);

    /* HEAD of a stream and of a metrics series: headers only */
    int64_t id = add_job("h", "fp16", 10);
    add_rows(id, 1, 10);
    snprintf(p, sizeof(p), "/v1/jobs/%lld/stream", (long long)id);
    http(port, "HEAD", p, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_str_eq(header(&r, "Content-Type"), "text/event-stream");
    ck_assert_uint_eq(r.len, 0);
    hresp_free(&r);
    snprintf(p, sizeof(p), "/v1/jobs/%lld/metrics", (long long)id);
    http(port, "HEAD", p, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_uint_eq(r.len, 0);
    hresp_free(&r);
}
END_TEST

/* ---- a server with a real scheduler ---------------------------------------------------- */

static void live_setup(void)
{
    daemon_sched_config cfg;
    const char *src = getenv("srcdir");
    char p[PATH_MAX + 64];

    setenv("AMPD_SSE_HEARTBEAT_MS", "200", 1);
    snprintf(dir, sizeof(dir), "/tmp/check_api.XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(dbpath, sizeof(dbpath), "%s/ampd.db", dir);
    ck_assert_int_eq(store_open(dbpath, &st), 0);
    memset(&cfg, 0, sizeof(cfg));
    snprintf(p, sizeof(p), "%s/tests/sched_worker.sh", src ? src : ".");
    ck_assert_msg(realpath(p, cfg.exe) != NULL, "the fake worker %s is missing", p);
    snprintf(cfg.data_dir, sizeof(cfg.data_dir), "%s/data", dir);
    cfg.nroots = 1;
    snprintf(cfg.roots[0], sizeof(cfg.roots[0]), "/usr/share/datasets");
    cfg.max_running = 2;
    cfg.max_retries = 3;
    cfg.worker_timeout_s = 30;
    ck_assert_int_eq(daemon_sched_start(st, &cfg, &sc), 0);
    start_server(sc);
}

static json_t *job_json(int64_t id)
{
    char path[64];
    snprintf(path, sizeof(path), "/v1/jobs/%lld", (long long)id);
    return get_json(port, path, 200);
}

static void wait_job(int64_t id, const char *status, double timeout_s)
{
    double t0 = gpu_now();
    for (;;) {
        json_t *j = job_json(id);
        char cur[32];
        snprintf(cur, sizeof(cur), "%s", json_string_value(json_object_get(j, "status")));
        json_decref(j);
        if (strcmp(cur, status) == 0)
            return;
        ck_assert_msg(gpu_now() - t0 < timeout_s, "job %lld is %s, expected %s", (long long)id, cur,
                      status);
        test_sleep_ms(20);
    }
}

static int64_t post_job(const char *spec, const char *idem, int want_status)
{
    char hdr[512];
    hresp r;
    snprintf(hdr, sizeof(hdr),
             "Authorization: Bearer " TOKEN "\r\nContent-Type: application/json\r\n%s%s%s",
             idem ? "Idempotency-Key: " : "", idem ? idem : "", idem ? "\r\n" : "");
    http(port, "POST", "/v1/jobs", hdr, spec, strlen(spec), &r);
    ck_assert_msg(r.status == want_status, "POST: %d %.300s", r.status, r.body);
    json_t *j = json_of(&r);
    int64_t id = json_integer_value(json_object_get(j, "id"));
    char loc[64];
    snprintf(loc, sizeof(loc), "/v1/jobs/%lld", (long long)id);
    ck_assert_str_eq(header(&r, "Location"), loc);
    ck_assert(json_is_object(json_object_get(j, "spec")));
    json_decref(j);
    hresp_free(&r);
    return id;
}

static int action(const char *method, int64_t id, const char *verb)
{
    char path[96];
    hresp r;
    snprintf(path, sizeof(path), "/v1/jobs/%lld%s%s", (long long)id, verb ? "/" : "",
             verb ? verb : "");
    http(port, method, path,
         "Authorization: Bearer " TOKEN "\r\nContent-Type: application/json\r\n", NULL, 0, &r);
    int s = r.status;
    if (s == 202) {
        json_t *j = json_of(&r);
        ck_assert_int_eq(json_integer_value(json_object_get(j, "id")), id);
        json_decref(j);
    } else if (s == 409) {
        expect_error(&r, 409, "conflict", NULL);
    } else if (s == 204) {
        ck_assert_uint_eq(r.len, 0);
    }
    hresp_free(&r);
    return s;
}

START_TEST(test_live_lifecycle)
{
    static const char spec[] =
        "{\n  \"name\": \"synthetic-run\",\n  \"data\": {\"type\": \"synthetic\"},\n"
        "  \"precision\": {\"dtype\": \"fp16\"},\n  \"steps\": 12\n}";
    int64_t id = post_job(spec, "key-1", 201);
    ck_assert_int_eq(post_job(spec, "key-1", 200), id);
    /* the same JSON written otherwise (members reordered, no whitespace) is the same body */
    static const char same[] = "{\"steps\":12,\"precision\":{\"dtype\":\"fp16\"},"
                               "\"data\":{\"type\":\"synthetic\"},\"name\":\"synthetic-run\"}";
    ck_assert_int_eq(post_job(same, "key-1", 200), id);
    /* the key of another body: 422 naming the key, and no job is queued */
    static const char other[] = "{\"name\": \"synthetic-run\", \"data\": {\"type\": "
                                "\"synthetic\"}, \"precision\": {\"dtype\": \"fp16\"}, "
                                "\"steps\": 13}";
    hresp r;
    http(port, "POST", "/v1/jobs",
         "Authorization: Bearer " TOKEN "\r\nContent-Type: application/json\r\n"
         "Idempotency-Key: key-1\r\n",
         other, strlen(other), &r);
    expect_error(&r, 422, "idempotency_key_reused", "Idempotency-Key");
    ck_assert_ptr_nonnull(strstr(r.body, "\\\"key-1\\\" was used for job"));
    hresp_free(&r);
    json_t *list = get_json(port, "/v1/jobs", 200);
    ck_assert_int_eq(json_array_size(json_object_get(list, "jobs")), 1);
    json_decref(list);
    /* a new key takes the other body */
    int64_t id2 = post_job(other, "key-2", 201);
    ck_assert_int_ne(id2, id);
    ck_assert_int_eq(post_job(other, "key-2", 200), id2);
    json_t *j = job_json(id);
    ck_assert_str_eq(json_string_value(json_object_get(j, "dtype")), "fp16");
    ck_assert_str_eq(json_string_value(json_object_get(j, "name")), "synthetic-run");
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(j, "spec"), "steps")), 12);
    /* the job keeps its spec as resolved at submit, every default written out: a resume by a
     * later ampd with other defaults runs the job that was queued */
    json_t *opt = json_object_get(json_object_get(j, "spec"), "optimizer");
    ck_assert_str_eq(json_string_value(json_object_get(opt, "type")), "adamw");
    ck_assert_double_eq(json_number_value(json_object_get(opt, "lr")), 0.001);
    ck_assert_int_eq(json_array_size(json_object_get(opt, "betas")), 2);
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(j, "spec"), "seed")), 1);
    ck_assert_str_eq(json_string_value(json_object_get(
                         json_object_get(json_object_get(json_object_get(j, "spec"), "precision"),
                                         "loss_scale"),
                         "mode")),
                     "dynamic");
    json_decref(j);
    /* so a retry that spells out a default is the same request */
    static const char spelled[] = "{\"name\": \"synthetic-run\", \"data\": {\"type\": "
                                  "\"synthetic\"}, \"precision\": {\"dtype\": \"fp16\"}, "
                                  "\"steps\": 12, \"optimizer\": {\"lr\": 0.001}}";
    ck_assert_int_eq(post_job(spelled, "key-1", 200), id);
    wait_job(id, "succeeded", 20);
    j = job_json(id);
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(j, "progress"), "step")),
                     12);
    ck_assert(json_is_object(json_object_get(j, "summary")));
    ck_assert_ptr_nonnull(json_string_value(json_object_get(j, "finished_at")));
    json_decref(j);

    /* wrong states: 409; delete: 204, then 404 */
    ck_assert_int_eq(action("POST", id, "cancel"), 409);
    ck_assert_int_eq(action("POST", id, "resume"), 409);
    ck_assert_int_eq(action("DELETE", id, NULL), 204);
    ck_assert_int_eq(action("DELETE", id, NULL), 404);
    ck_assert_int_eq(action("POST", id, "cancel"), 404);

    /* cancel a running job, resume it, let it finish */
    int64_t slow = 0;
    bool existed;
    ck_assert_int_eq(daemon_sched_submit(sc, "slow", "fp16", 40,
                                         "{\"mode\":\"slow\",\"steps\":40,\"delay\":0.02,"
                                         "\"ckpt\":5}",
                                         NULL, &slow, &existed),
                     0);
    wait_job(slow, "running", 10);
    ck_assert_int_eq(action("DELETE", slow, NULL), 409);
    ck_assert_int_eq(action("POST", slow, "cancel"), 202);
    wait_job(slow, "cancelled", 10);
    ck_assert_int_eq(action("POST", slow, "resume"), 202);
    wait_job(slow, "succeeded", 20);
    char path[96];
    snprintf(path, sizeof(path), "/v1/jobs/%lld/checkpoints", (long long)slow);
    j = get_json(port, path, 200);
    ck_assert_int_ge(json_array_size(json_object_get(j, "checkpoints")), 1);
    json_decref(j);

    j = get_json(port, "/v1/system", 200);
    ck_assert_int_eq(
        json_integer_value(json_object_get(json_object_get(j, "queue"), "max_running")), 2);
    json_decref(j);
}
END_TEST

START_TEST(test_live_stream_resume)
{
    enum { STEPS = 60, CLIENTS = 100 };
    static hconn many[CLIENTS];
    int64_t id = 0, steps[STEPS + 10];
    bool existed;
    char head[256];
    hconn c;

    ck_assert_int_eq(daemon_sched_submit(sc, "stream", "fp16", STEPS,
                                         "{\"mode\":\"slow\",\"steps\":60,\"delay\":0.025,"
                                         "\"ckpt\":10}",
                                         NULL, &id, &existed),
                     0);
    int n = snprintf(head, sizeof(head),
                     "GET /v1/jobs/%lld/stream HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n\r\n",
                     (long long)id, port);
    /* 100 clients from the start (the job is queued or just starting) */
    for (int i = 0; i < CLIENTS; i++) {
        hc_open(&many[i], port);
        hc_send(&many[i], head, (size_t)n);
    }
    /* one client reads to step 15, drops the connection and resumes */
    hc_open(&c, port);
    hc_send(&c, head, (size_t)n);
    ck_assert(hc_wait(&c, "{\"type\":\"step\",\"step\":15,", 15000));
    /* the last complete message: the body may end inside one */
    char *cut = c.body.data + c.body.len;
    while (cut > c.body.data && !(cut[-1] == '\n' && cut[-2] == '\n'))
        cut--;
    *cut = '\0';
    int got = sse_steps(c.body.data, steps, STEPS + 10);
    int64_t last = steps[got - 1], last_id = sse_last_id;
    hc_close(&c);
    /* steps go on meanwhile: the store has a few more before the client comes back */
    int64_t more = last + 3 < STEPS ? last + 3 : STEPS;
    for (double t0 = gpu_now();; test_sleep_ms(10)) {
        store_metric m;
        if (store_metric_latest(st, id, &m) == 0 && m.step >= more)
            break;
        ck_assert_msg(gpu_now() - t0 < 10, "job %lld: step %lld not recorded within 10 s",
                      (long long)id, (long long)more);
    }
    hc_open(&c, port);
    n = snprintf(head, sizeof(head),
                 "GET /v1/jobs/%lld/stream HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n"
                 "Last-Event-ID: %lld\r\n\r\n",
                 (long long)id, port, (long long)last_id);
    hc_send(&c, head, (size_t)n);
    hc_read_all(&c, 20000);
    got = sse_steps(c.body.data, steps, STEPS + 10);
    ck_assert_int_eq(got, STEPS - last);
    for (int i = 0; i < got; i++)
        ck_assert_int_eq(steps[i], last + 1 + i);
    ck_assert_ptr_nonnull(strstr(c.body.data, "event: checkpoint\n"));
    const char *end = strstr(c.body.data, "event: end\ndata: ");
    ck_assert_ptr_nonnull(end);
    ck_assert_ptr_nonnull(strstr(end, "\"type\":\"summary\""));
    hc_close(&c);

    for (int i = 0; i < CLIENTS; i++) {
        hc_read_all(&many[i], 20000);
        got = sse_steps(many[i].body.data, steps, STEPS + 10);
        ck_assert_msg(got == STEPS, "client %d saw %d steps", i, got);
        for (int k = 0; k < got; k++)
            ck_assert_int_eq(steps[k], k + 1);
        ck_assert_ptr_nonnull(strstr(many[i].body.data, "event: end\n"));
        /* each checkpoint once */
        int ck = 0;
        for (const char *p = many[i].body.data; (p = strstr(p, "event: checkpoint\n")); p++)
            ck++;
        ck_assert_int_eq(ck, STEPS / 10);
    }
    /* one shape live and replayed: a read of the finished job is what the live clients got */
    hresp r;
    char path[96];
    snprintf(path, sizeof(path), "/v1/jobs/%lld/stream", (long long)id);
    http(port, "GET", path, NULL, NULL, 0, &r);
    ck_assert_int_eq(r.status, 200);
    for (int i = 0; i < CLIENTS; i++) {
        char *b = many[i].body.data, *w = b;
        for (char *p = b; *p;) { /* drop the heartbeats: they are not messages */
            if (strncmp(p, ": ping\n\n", 8) == 0 && (p == b || p[-1] == '\n')) {
                p += 8;
                continue;
            }
            *w++ = *p++;
        }
        *w = '\0';
        ck_assert_msg(strcmp(b, r.body) == 0, "client %d's live stream differs from the replay", i);
        hc_close(&many[i]);
    }
    hresp_free(&r);
}
END_TEST

/* A client that stops reading while 30000 steps are stored gets every one of them when it
 * reads again, with no gap or repeat. */
START_TEST(test_live_stream_gap)
{
    enum { STEPS = 30000 };
    static int64_t steps[STEPS + 10];
    int64_t id = 0;
    bool existed;
    char head[256];
    hconn c;
    int small = 4096;

    ck_assert_int_eq(daemon_sched_submit(sc, "gap", "fp16", STEPS,
                                         "{\"mode\":\"ok\",\"steps\":30000}", NULL, &id, &existed),
                     0);
    memset(&c, 0, sizeof(c));
    api_buf_init(&c.raw);
    api_buf_init(&c.body);
    c.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(c.fd, 0);
    ck_assert_int_eq(setsockopt(c.fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(connect(c.fd, (struct sockaddr *)&a, sizeof(a)), 0);
    int n = snprintf(head, sizeof(head),
                     "GET /v1/jobs/%lld/stream HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n\r\n",
                     (long long)id, port);
    hc_send(&c, head, (size_t)n);
    wait_job(id, "succeeded", 30); /* not reading meanwhile */
    hc_read_all(&c, 30000);
    int got = sse_steps(c.body.data, steps, STEPS + 10);
    ck_assert_int_eq(got, STEPS);
    for (int i = 0; i < got; i++)
        ck_assert_int_eq(steps[i], i + 1);
    ck_assert_ptr_nonnull(strstr(c.body.data, "event: end\n"));
    hc_close(&c);
}
END_TEST

/* A job whose worker prints layers lines and recommendations: a live SSE client gets them
 * as `event: layers` and `event: event`, and /layers and /events answer from the store. */
START_TEST(test_live_layers)
{
    int64_t id = 0;
    bool existed;
    char head[256], path[128];
    hconn c;

    ck_assert_int_eq(daemon_sched_submit(sc, "diag", "fp16", 30,
                                         "{\"mode\":\"slow\",\"steps\":30,\"delay\":0.02,"
                                         "\"diag\":10}",
                                         NULL, &id, &existed),
                     0);
    int n = snprintf(head, sizeof(head),
                     "GET /v1/jobs/%lld/stream HTTP/1.1\r\nHost: 127.0.0.1:%u\r\n\r\n",
                     (long long)id, port);
    hc_open(&c, port);
    hc_send(&c, head, (size_t)n);
    hc_read_all(&c, 20000);
    ck_assert_ptr_nonnull(strstr(c.body.data, "event: end\n"));
    for (int s = 10; s <= 30; s += 10) {
        char want[96];
        snprintf(want, sizeof(want),
                 "event: layers\ndata: {\"type\":\"layers\",\"job\":%lld,\"step\":%d,",
                 (long long)id, s);
        ck_assert_msg(strstr(c.body.data, want) != NULL, "no layers message for step %d", s);
    }
    const char *rec = strstr(c.body.data, "\"kind\":\"recommendation\"");
    ck_assert_ptr_nonnull(rec);
    rec = sse_find(c.body.data, "\"kind\":\"recommendation\"");
    ck_assert(rec && strstr(rec, "\nevent: event\ndata: {\"type\":\"event\",\"id\":") &&
              strstr(rec, "\"step\":10,") < strstr(rec, "\"kind\":\"recommendation\""));
    hc_close(&c);

    snprintf(path, sizeof(path), "/v1/jobs/%lld/layers", (long long)id);
    json_t *j = get_json(port, path, 200);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "step")), 30);
    json_t *l = json_array_get(json_object_get(j, "layers"), 1);
    ck_assert_str_eq(json_string_value(json_object_get(l, "name")), "fc2");
    ck_assert_str_eq(json_string_value(json_object_get(l, "act_headroom")), "Infinity");
    ck_assert_str_eq(json_string_value(json_object_get(l, "grad_underflow")), "NaN");
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/layers?from=0", (long long)id);
    j = get_json(port, path, 200);
    ck_assert_int_eq(json_array_size(json_object_get(j, "steps")), 3);
    json_decref(j);
    snprintf(path, sizeof(path), "/v1/jobs/%lld/events", (long long)id);
    j = get_json(port, path, 200);
    int recs = 0;
    json_t *ev = json_object_get(j, "events");
    for (size_t i = 0; i < json_array_size(ev); i++) {
        json_t *e = json_array_get(ev, i);
        if (strcmp(json_string_value(json_object_get(e, "kind")), "recommendation") != 0)
            continue;
        recs++;
        json_t *layer = json_object_get(json_object_get(e, "data"), "layer");
        ck_assert(layer == NULL || strcmp(json_string_value(layer), "fc1") == 0);
    }
    ck_assert_int_eq(recs, 2);
    json_decref(j);
}
END_TEST

/* /healthz while the store cannot write (store_test_fault: as on a full disk), and a write
 * the store refuses: a 503 that says the history could not be written. */
START_TEST(test_live_store_cannot_write)
{
    static const char spec[] = "{\"name\": \"full\", \"data\": {\"type\": \"synthetic\"}, "
                               "\"steps\": 3}";
    static const char hdr[] = "Authorization: Bearer " TOKEN "\r\n"
                              "Content-Type: application/json\r\n";
    double t0 = gpu_now();
    hresp r;
    json_t *j;

    j = get_json(port, "/healthz", 200);
    ck_assert_str_eq(json_string_value(json_object_get(j, "status")), "ok");
    json_decref(j);
    ck_assert_int_eq(store_test_fault(st, STORE_EFULL), 0);
    http(port, "POST", "/v1/jobs", hdr, spec, strlen(spec), &r);
    expect_error(&r, 503, "unavailable", NULL);
    ck_assert_msg(strstr(r.body, "the run history could not be written (the disk is full)"),
                  "%s", r.body);
    hresp_free(&r);
    for (;;) { /* the writer finds out by a write of its own */
        j = get_json(port, "/healthz", 200);
        if (strcmp(json_string_value(json_object_get(j, "status")), "degraded") == 0)
            break;
        json_decref(j);
        ck_assert_msg(gpu_now() - t0 < 5, "/healthz never said degraded");
        test_sleep_ms(20);
    }
    ck_assert_str_eq(json_string_value(json_object_get(j, "reason")), "disk_full");
    ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(j, "message")), "disk"));
    ck_assert(json_is_integer(json_object_get(j, "held")));
    ck_assert(json_is_string(json_object_get(j, "since")));
    ck_assert(json_number_value(json_object_get(j, "since_unix")) > 1e9);
    json_decref(j);
    ck_assert_int_eq(store_test_fault(st, 0), 0);
    for (;;) {
        j = get_json(port, "/healthz", 200);
        bool ok = strcmp(json_string_value(json_object_get(j, "status")), "ok") == 0;
        json_decref(j);
        if (ok)
            break;
        ck_assert_msg(gpu_now() - t0 < 10, "/healthz never said ok again");
        test_sleep_ms(20);
    }
    wait_job(post_job(spec, NULL, 201), "succeeded", 10);
}
END_TEST

static Suite *api_suite(void)
{
    Suite *s = suite_create("api");
    TCase *u = tcase_create("units");
    tcase_set_timeout(u, 20);
    tcase_add_test(u, test_parse_int);
    tcase_add_test(u, test_parse_lists);
    tcase_add_test(u, test_host_parse);
    tcase_add_test(u, test_routes);
    tcase_add_test(u, test_json_strings);
    tcase_add_test(u, test_numbers);
    tcase_add_test(u, test_prom_label);
    tcase_add_test(u, test_misc);
    tcase_add_test(u, test_stats);
    tcase_add_test(u, test_peer_addresses);
    tcase_add_test(u, test_series_json);
    tcase_add_test(u, test_metric_fields_documented);
    tcase_add_test(u, test_openapi_routes);
    tcase_add_test(u, test_openapi_metric_fields);
    tcase_add_test(u, test_openapi_layers_autocast);
    suite_add_tcase(s, u);

    TCase *t = tcase_create("store");
    tcase_add_checked_fixture(t, store_setup, store_teardown);
    tcase_set_timeout(t, 30);
    tcase_add_test(t, test_basics);
    tcase_add_test(t, test_auth_and_limits);
    tcase_add_test(t, test_jobs);
    tcase_add_test(t, test_job_model);
    tcase_add_test(t, test_metrics);
    tcase_add_test(t, test_metric_table_layers);
    tcase_add_test(t, test_events_checkpoints);
    tcase_add_test(t, test_system);
    tcase_add_test(t, test_prometheus);
    tcase_add_test(t, test_layers);
    tcase_add_test(t, test_sse_finished);
    tcase_add_test(t, test_sse_running_and_stop);
    tcase_add_test(t, test_sse_many_clients);
    tcase_add_test(t, test_sender);
    tcase_add_test(t, test_allow_lists);
    tcase_add_test(t, test_stop_deadline);
    tcase_add_test(t, test_start_refusals);
    tcase_add_test(t, test_conn_limits);
    tcase_add_test(t, test_head_deadline);
    tcase_add_test(t, test_static_and_head);
    suite_add_tcase(s, t);

    TCase *l = tcase_create("live");
    tcase_add_checked_fixture(l, live_setup, store_teardown);
    tcase_set_timeout(l, 60);
    tcase_add_test(l, test_live_lifecycle);
    tcase_add_test(l, test_live_stream_resume);
    tcase_add_test(l, test_live_stream_gap);
    tcase_add_test(l, test_live_layers);
    tcase_add_test(l, test_live_store_cannot_write);
    suite_add_tcase(s, l);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(api_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
