/*
 * server.c - the HTTP server (the REST contract of docs/api.md) on libmicrohttpd 0.9.75:
 * start and stop, request admission (routing, method, bearer token, size and media-type
 * limits), request bodies, turning a handler's answer into an MHD response, and static
 * files.
 *
 * Request flow: MHD calls on_request() first with the headers only. Everything that can be
 * decided from the headers is decided there (421 a Host that does not name this daemon, 403
 * a foreign Origin, 400 ambiguous framing: two Content-Length headers, or one with
 * Transfer-Encoding, 404 unknown route, 405 wrong method with Allow, 401 missing or wrong
 * token, 413 declared body too large, 415 a POST or DELETE without Content-Type:
 * application/json, 414 URL too long) and answered at once, so MHD never reads such a
 * body. The Host and Origin checks keep other sites' pages out (DNS rebinding, cross-site
 * requests), and the media-type rule makes every change a request that a page of another
 * origin can only send after a CORS preflight, which this server never grants. Otherwise the
 * body is accumulated in the per-request context (at most max_body bytes; beyond that it
 * is dropped and the request answered 413), and on the last call the handler that the
 * route table (route.c) names for the method fills an api_resp that respond() sends.
 *
 * Static files are opened with O_NONBLOCK and served only when fstat says regular file, so
 * a FIFO or device in the web root is a 404 rather than a handler blocked in open().
 *
 * Threads: MHD runs a fixed pool of threads (MHD_USE_INTERNAL_POLLING_THREAD with
 * MHD_USE_POLL and MHD_OPTION_THREAD_POOL_SIZE), each polling its share of the connections
 * (poll, not epoll: libmicrohttpd 0.9.75's epoll mode leaves a connection open after its
 * answer when the client shut its sending side right after the request; check_slow.sh),
 * so an idle or slow connection costs a socket and some memory, never a thread. The pool has as many threads as cores, at least 4 and at most 16: the handlers
 * are CPU-bound store reads and short store writes, so more threads than cores buy little,
 * but a connection stays on the thread that accepted it, and one slow request (a long
 * series, a delete that waits for the writer) holds up its thread's other connections: with
 * at least 4 it holds up a quarter of them at most, even on a 1- or 2-core machine; each
 * thread keeps a read connection to the store, hence the ceiling. Handlers must not wait:
 * an SSE stream with nothing to send suspends its connection (sse.c). One watcher thread
 * (watch_main) waits for the store's commits and resumes the SSE streams that have news or
 * a heartbeat due, and closes the connections whose request head is overdue (conn.c); it
 * also logs what the limits refused, at most every LOG_EVERY_MS. The per-request context
 * belongs to its connection's pool thread and is freed in the completion callback. Shared
 * state (api_server) is read-only after start except the atomics (stopping, the counters)
 * and what conn_mu, park_mu and prom_mu guard.
 *
 * Limits: at most max_conns connections in all (from the open-file limit, which the daemon
 * raises to its hard limit at start, less what the store, the workers' pipes and log files
 * and files being sent need), at most max_per_addr from one address beyond loopback
 * (refused at accept), a complete request head within head_timeout_ms (conn.c), and
 * libmicrohttpd's idle timeout of CONN_TIMEOUT_S (a slow reader of a response).
 * api_stop() ends the streams, then runs MHD_stop_daemon (which waits for the requests in
 * progress) on a thread of its own and waits for it at most stop_timeout_ms; past that it
 * leaves that thread to free the server (stop_mu and stop_cv guard that hand-over).
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "api/api_int.h"

#define MAX_PATH_LEN 2048       /* longest URL path accepted */
#define MAX_QUERY_LEN 8192      /* longest total of query keys and values */
#define DISCARD_CAP (64u << 20) /* a chunked body this far past max_body closes the socket */
#define CONN_TIMEOUT_S 60u
#define DEFAULT_HEARTBEAT_MS 15000
#define DEFAULT_MAX_BODY (1u << 20)
#define DEFAULT_HEAD_TIMEOUT_S 10
#define DEFAULT_MAX_PER_ADDR 64u
#define POOL_MIN 4
#define POOL_MAX 16
#define FD_RESERVE 512u    /* descriptors kept from connections: store, pipes, logs, files */
#define MAX_CONNS 65536u   /* each connection reserves libmicrohttpd's 32 KiB buffer pool */
#define WATCH_SLICE_MS 250 /* the watcher's longest wait: api_stop waits at most this long */
#define LOG_EVERY_MS 10000 /* the watcher logs what the limits refused at most this often */
#define MHD_LOG_BURST 20u  /* libmicrohttpd's messages logged per LOG_EVERY_MS */
#define STOP_GRACE_MS 1000 /* api_stop waits this long for the SSE streams to end */
#define DEFAULT_STOP_TIMEOUT_MS 5000

/* Per-request state (MHD's con_cls); freed in on_completed. */
typedef struct {
    api_route route;
    unsigned method;
    bool too_large;
    uint64_t discarded;
    api_buf body;
} req_ctx;

int64_t api_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void api_error_resp(api_resp *r, unsigned status, const char *code, const char *field,
                    const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    r->status = status;
    r->ctype = NULL;
    api_buf_reset(&r->body);
    api_buf_puts(&r->body, "{\"error\":{\"code\":");
    api_buf_json_str(&r->body, code);
    api_buf_puts(&r->body, ",\"field\":");
    api_buf_json_str(&r->body, field);
    api_buf_puts(&r->body, ",\"message\":");
    api_buf_json_str(&r->body, msg);
    api_buf_puts(&r->body, "}}");
}

const char *api_query(const api_req *q, const char *name)
{
    return MHD_lookup_connection_value(q->conn, MHD_GET_ARGUMENT_KIND, name);
}

static void resp_init(api_resp *r)
{
    memset(r, 0, sizeof(*r));
    api_buf_init(&r->body);
    r->fd = -1;
    r->status = 500;
}

static void resp_clear(api_resp *r)
{
    api_buf_free(&r->body);
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
    if (r->reader_cls && r->reader_free)
        r->reader_free(r->reader_cls);
    r->reader = NULL;
    r->reader_cls = NULL;
}

/* ---- responses ------------------------------------------------------------------------- */

static void add_header(struct MHD_Response *m, const char *name, const char *value)
{
    if (value && value[0])
        MHD_add_response_header(m, name, value);
}

/* Send r on c (consumes r). Returns MHD's verdict. */
static enum MHD_Result respond(api_server *s, struct MHD_Connection *c, api_resp *r)
{
    struct MHD_Response *m = NULL;
    const char *ctype = r->ctype ? r->ctype : "application/json";
    enum MHD_Result ok;

    if (r->reader) {
        m = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN,
                                              r->reader_block ? r->reader_block : 65536,
                                              r->reader, r->reader_cls, r->reader_free);
        if (m)
            r->reader_cls = NULL; /* MHD owns it now */
    } else if (r->fd >= 0) {
        m = MHD_create_response_from_fd((size_t)r->fd_size, r->fd);
        if (m)
            r->fd = -1; /* MHD closes it */
    } else {
        size_t len;
        char *body = api_buf_steal(&r->body, &len);
        if (!body) {
            log_error("out of memory building a %u response", r->status);
            resp_clear(r);
            return MHD_NO;
        }
        m = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
        if (!m)
            free(body);
    }
    if (!m) {
        resp_clear(r);
        return MHD_NO;
    }
    if (r->status != MHD_HTTP_NO_CONTENT)
        add_header(m, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    add_header(m, MHD_HTTP_HEADER_LOCATION, r->location);
    add_header(m, MHD_HTTP_HEADER_ALLOW, r->allow);
    add_header(m, MHD_HTTP_HEADER_CONTENT_DISPOSITION, r->disposition);
    if (r->www_auth)
        add_header(m, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer realm=\"ampd\"");
    if (strncmp(ctype, "text/event-stream", 17) == 0) {
        add_header(m, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        add_header(m, "X-Accel-Buffering", "no");
    }
    ok = MHD_queue_response(c, r->status, m);
    MHD_destroy_response(m);
    if (r->status < API_NCODES)
        atomic_fetch_add(&s->codes[r->status], 1);
    resp_clear(r);
    return ok;
}

/* ---- static files ---------------------------------------------------------------------- */

static const char *mime_type(const char *path)
{
    static const struct {
        const char *ext, *type;
    } t[] = {{".html", "text/html; charset=utf-8"},
             {".js", "text/javascript; charset=utf-8"},
             {".mjs", "text/javascript; charset=utf-8"},
             {".css", "text/css; charset=utf-8"},
             {".json", "application/json"},
             {".svg", "image/svg+xml"},
             {".png", "image/png"},
             {".ico", "image/x-icon"},
             {".txt", "text/plain; charset=utf-8"},
             {".map", "application/json"}};
    const char *dot = strrchr(path, '.');
    for (size_t i = 0; dot && i < sizeof(t) / sizeof(t[0]); i++)
        if (strcasecmp(dot, t[i].ext) == 0)
            return t[i].type;
    return "application/octet-stream";
}

/* GET of a file under web_root; "/" is index.html. No ".." segment, no escape through a
 * symlink (the resolved path must stay inside the resolved root). */
static void static_file(api_req *q, api_resp *r)
{
    const char *root = q->srv->web_root_real;
    char want[PATH_MAX], real[PATH_MAX];
    const char *rel = strcmp(q->path, "/") == 0 ? "/index.html" : q->path;
    struct stat st;
    size_t rl = strlen(root);

    if (strstr(rel, "/..") || strchr(rel, '\\') ||
        snprintf(want, sizeof(want), "%s%s", root, rel) >= (int)sizeof(want) ||
        !realpath(want, real) || strncmp(real, root, rl) != 0 || real[rl] != '/') {
        api_error_resp(r, 404, "not_found", NULL, "no such file: %s", q->path);
        return;
    }
    /* O_NONBLOCK: opening a FIFO for reading would wait for a writer; only a regular file
     * is served, and it is read normally (the flag cleared) */
    int fd = open(real, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    int fl = fd >= 0 ? fcntl(fd, F_GETFL) : -1;
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || fl < 0 ||
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        if (fd >= 0)
            close(fd);
        api_error_resp(r, 404, "not_found", NULL, "no such file: %s", q->path);
        return;
    }
    r->status = 200;
    r->fd = fd;
    r->fd_size = (uint64_t)st.st_size;
    r->ctype = mime_type(real);
}

/* ---- admission and dispatch ------------------------------------------------------------ */

typedef struct {
    size_t total;
} query_len;

static enum MHD_Result sum_query(void *cls, enum MHD_ValueKind kind, const char *key,
                                 const char *value)
{
    query_len *ql = cls;
    (void)kind;
    ql->total += strlen(key) + (value ? strlen(value) : 0) + 2;
    return MHD_YES;
}

static bool is_mutating(unsigned method)
{
    return method == API_M_POST || method == API_M_DELETE;
}

/* The bearer token check; true when the request may go on. */
static bool authorized(api_server *s, struct MHD_Connection *c)
{
    const char *h;
    if (!s->cfg.token[0])
        return true;
    h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    h += 7;
    while (*h == ' ')
        h++;
    size_t n = strlen(h);
    while (n > 0 && (h[n - 1] == ' ' || h[n - 1] == '\t'))
        n--;
    return api_token_equal(h, n, s->cfg.token);
}

/* media type of a Content-Type value is application/json (parameters allowed) */
static bool is_json_type(const char *ct)
{
    if (!ct)
        return false;
    while (*ct == ' ')
        ct++;
    if (strncasecmp(ct, "application/json", 16) != 0)
        return false;
    ct += 16;
    while (*ct == ' ' || *ct == '\t')
        ct++;
    return *ct == '\0' || *ct == ';';
}

/* ---- Host, Origin and framing ----------------------------------------------------------- */

int api_host_parse(const char *v, api_host *out)
{
    const char *end, *p;
    int64_t port = -1;
    size_t n;

    memset(out, 0, sizeof(*out));
    out->port = -1;
    if (!v)
        return -1;
    if (v[0] == '[') { /* an IPv6 address */
        end = strchr(v, ']');
        if (!end || end == v + 1)
            return -1;
        for (p = v + 1; p < end; p++)
            if (!isxdigit((unsigned char)*p) && *p != ':' && *p != '.')
                return -1;
        end++;
    } else { /* a DNS name or an IPv4 address */
        end = v + strcspn(v, ":");
        if (end == v)
            return -1;
        for (p = v; p < end; p++)
            if (!isalnum((unsigned char)*p) && *p != '.' && *p != '-' && *p != '_')
                return -1;
    }
    n = (size_t)(end - v);
    if (n >= sizeof(out->name))
        return -1;
    if (*end == ':') {
        if (strlen(end + 1) > 5 || !isdigit((unsigned char)end[1]) ||
            api_parse_i64(end + 1, 0, 65535, &port) != 0)
            return -1;
    } else if (*end != '\0') {
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        out->name[i] = (char)tolower((unsigned char)v[i]);
    out->name[n] = '\0';
    out->port = (int)port;
    return 0;
}

int api_check_allow_host(const char *v, char *err, size_t errlen)
{
    api_host h;
    if (api_host_parse(v, &h) == 0 && h.port != 0)
        return 0;
    snprintf(err, errlen,
             "\"%.200s\" is not NAME or NAME:PORT (a DNS name, an IPv4 address or an [IPv6] "
             "address; a port from 1 to 65535)",
             v ? v : "");
    return GPU_EINVAL;
}

int api_check_allow_origin(const char *v, char *err, size_t errlen)
{
    api_host h;
    size_t skip = v && strncasecmp(v, "http://", 7) == 0    ? 7
                  : v && strncasecmp(v, "https://", 8) == 0 ? 8
                                                            : 0;
    if (skip && api_host_parse(v + skip, &h) == 0 && h.port != 0)
        return 0;
    snprintf(err, errlen,
             "\"%.200s\" is not an origin: want http://HOST or https://HOST, with :PORT when "
             "it is not the scheme's default, and no path (not even a trailing /)",
             v ? v : "");
    return GPU_EINVAL;
}

/* The Host values the server answers to: localhost, 127.0.0.1, [::1] and the listen address
 * with the bound port, then the allowed ones. */
static int hosts_init(api_server *s, char *err, size_t errlen)
{
    static const char *const local[] = {"localhost", "127.0.0.1", "[::1]"};
    api_host h;

    s->nhosts = 0;
    for (size_t i = 0; i < sizeof(local) / sizeof(local[0]); i++) {
        snprintf(s->hosts[s->nhosts].name, sizeof(s->hosts[0].name), "%s", local[i]);
        s->hosts[s->nhosts++].port = (int)s->port;
    }
    if (api_host_parse(s->cfg.listen, &h) == 0) { /* parse_listen accepted it already */
        h.port = (int)s->port;
        s->hosts[s->nhosts++] = h;
    }
    if (s->cfg.nallow_hosts < 0 || s->cfg.nallow_hosts > API_MAX_ALLOW ||
        s->cfg.nallow_origins < 0 || s->cfg.nallow_origins > API_MAX_ALLOW) {
        snprintf(err, errlen, "at most %d allowed hosts and %d allowed origins", API_MAX_ALLOW,
                 API_MAX_ALLOW);
        return GPU_EINVAL;
    }
    for (int i = 0; i < s->cfg.nallow_hosts; i++) {
        char why[320];
        if (api_check_allow_host(s->cfg.allow_hosts[i], why, sizeof(why)) != 0) {
            snprintf(err, errlen, "allowed host: %s", why);
            return GPU_EINVAL;
        }
        api_host_parse(s->cfg.allow_hosts[i], &s->hosts[s->nhosts++]);
    }
    for (int i = 0; i < s->cfg.nallow_origins; i++) {
        char why[320];
        if (api_check_allow_origin(s->cfg.allow_origins[i], why, sizeof(why)) != 0) {
            snprintf(err, errlen, "allowed origin: %s", why);
            return GPU_EINVAL;
        }
    }
    return 0;
}

/* The Host header names this daemon. An HTTP/1.0 request without one is not a browser's,
 * so it is admitted (refuse_sender refuses an HTTP/1.1 request without Host). */
static bool host_ok(const api_server *s, const char *host)
{
    api_host h;
    if (!host)
        return true;
    if (api_host_parse(host, &h) != 0)
        return false;
    if (h.port < 0)
        h.port = 80;
    for (int i = 0; i < s->nhosts; i++)
        if (strcmp(s->hosts[i].name, h.name) == 0 &&
            (s->hosts[i].port < 0 || s->hosts[i].port == h.port))
            return true;
    return false;
}

/* The Origin header, when there is one, is the daemon's own (http:// and the Host header, as
 * a browser sends for a page of this daemon) or an allowed one. */
static bool origin_ok(const api_server *s, const char *origin, const char *host)
{
    if (!origin)
        return true;
    if (host && strncasecmp(origin, "http://", 7) == 0 && strcasecmp(origin + 7, host) == 0)
        return true;
    for (int i = 0; i < s->cfg.nallow_origins; i++)
        if (strcasecmp(origin, s->cfg.allow_origins[i]) == 0)
            return true;
    return false;
}

typedef struct {
    int content_length, transfer_encoding, host;
} framing;

static enum MHD_Result count_framing(void *cls, enum MHD_ValueKind kind, const char *key,
                                     const char *value)
{
    framing *f = cls;
    (void)kind, (void)value;
    if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) == 0)
        f->content_length++;
    else if (strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING) == 0)
        f->transfer_encoding++;
    else if (strcasecmp(key, MHD_HTTP_HEADER_HOST) == 0)
        f->host++;
    return MHD_YES;
}

/* Host, Origin and the framing headers (libmicrohttpd reads the first Content-Length of
 * several, which leaves the rest of the body to be read as another request). Returns true
 * with r filled when the request is refused. */
static bool refuse_sender(api_server *s, struct MHD_Connection *c, const char *version, api_resp *r)
{
    const char *host = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_ORIGIN);
    framing f = {0};

    MHD_get_connection_values(c, MHD_HEADER_KIND, count_framing, &f);
    if (f.content_length > 1) {
        api_error_resp(r, 400, "invalid_request", "Content-Length",
                       "the request has %d Content-Length headers: send exactly one",
                       f.content_length);
        return true;
    }
    if (f.content_length && f.transfer_encoding) {
        api_error_resp(r, 400, "invalid_request", "Content-Length",
                       "the request has both Content-Length and Transfer-Encoding: send one");
        return true;
    }
    if (f.host > 1 || (!host && strcmp(version, MHD_HTTP_VERSION_1_0) != 0)) {
        api_error_resp(r, 400, "invalid_request", "Host",
                       "the request has %d Host headers: send exactly one", f.host);
        return true;
    }
    if (!host_ok(s, host)) {
        api_error_resp(r, 421, "misdirected_request", "Host",
                       "the Host header \"%.200s\" does not name this daemon, which answers to "
                       "localhost, 127.0.0.1 and [::1] with port %u, its listen address, and the "
                       "names given with ampd serve --allow-host",
                       host, s->port);
        return true;
    }
    if (!origin_ok(s, origin, host)) {
        api_error_resp(r, 403, "forbidden_origin", "Origin",
                       "requests from pages of another origin (%.200s) are refused; ampd serve "
                       "--allow-origin %.200s admits that origin",
                       origin, origin);
        return true;
    }
    return false;
}

/* Decide what the headers alone decide. Returns true with r filled when the request is
 * answered now. */
static bool admit(api_server *s, struct MHD_Connection *c, const char *url, const char *method,
                  const char *version, req_ctx *x, api_resp *r)
{
    query_len ql = {0};
    const char *cl;

    x->method = api_method_bit(method);
    if (refuse_sender(s, c, version, r))
        return true;
    if (strlen(url) > MAX_PATH_LEN) {
        api_error_resp(r, 414, "uri_too_long", NULL, "the path is longer than %d bytes",
                       MAX_PATH_LEN);
        return true;
    }
    MHD_get_connection_values(c, MHD_GET_ARGUMENT_KIND, sum_query, &ql);
    if (ql.total > MAX_QUERY_LEN) {
        api_error_resp(r, 414, "uri_too_long", NULL, "the query is longer than %d bytes",
                       MAX_QUERY_LEN);
        return true;
    }
    if (api_route_match(url, s->web_root_real[0] != '\0', &x->route) != 0) {
        api_error_resp(r, 404, "not_found", NULL, "no route %.16s %.200s", method, url);
        return true;
    }
    if (!(x->method & x->route.allow)) {
        api_allow_string(x->route.allow, r->allow, sizeof(r->allow));
        api_error_resp(r, 405, "method_not_allowed", NULL,
                       "%.16s is not allowed here (allowed: %s)", method, r->allow);
        return true;
    }
    if (is_mutating(x->method) && !authorized(s, c)) {
        r->www_auth = true;
        api_error_resp(r, 401, "unauthorized", NULL,
                       "this endpoint needs the header Authorization: Bearer <token>");
        return true;
    }
    cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        int64_t n;
        if (api_parse_i64(cl, 0, INT64_MAX, &n) != 0 || (uint64_t)n > s->cfg.max_body) {
            api_error_resp(r, 413, "body_too_large", NULL,
                           "the request body is larger than %zu bytes", s->cfg.max_body);
            return true;
        }
    }
    /* every change: a header that a form or a no-cors fetch of another site cannot send */
    if (is_mutating(x->method) && !is_json_type(MHD_lookup_connection_value(
                                      c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE))) {
        if (x->route.id == API_R_JOBS)
            api_error_resp(r, 415, "unsupported_media_type", "Content-Type",
                           "the job spec must be sent with Content-Type: application/json");
        else
            api_error_resp(r, 415, "unsupported_media_type", "Content-Type",
                           "%.16s %.200s needs the header Content-Type: application/json (a "
                           "change must carry it, so that no page of another site can make "
                           "one): curl -X %.16s -H 'Content-Type: application/json' URL",
                           method, url, method);
        return true;
    }
    return false;
}

static void dispatch(api_req *q, api_resp *r)
{
    api_handler h = api_route_handler(q->route.id, q->method);
    if (h)
        h(q, r);
    else if (q->route.id == API_R_STATIC)
        static_file(q, r);
    else
        api_error_resp(r, 404, "not_found", NULL, "no route");
}

/* The connection's api_conn (its socket context), or NULL. */
static api_conn *conn_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
{
    api_server *s = cls;
    req_ctx *x = *con_cls;
    api_resp r;

    if (!x) {
        api_conn_head_done(s, conn_of(c)); /* the head is complete: no deadline now */
        x = calloc(1, sizeof(*x));
        if (!x)
            return MHD_NO;
        api_buf_init(&x->body);
        *con_cls = x;
        resp_init(&r);
        if (admit(s, c, url, method, version, x, &r))
            return respond(s, c, &r);
        return MHD_YES;
    }
    if (*upload_data_size > 0) {
        if (!x->too_large && x->body.len + *upload_data_size > s->cfg.max_body) {
            x->too_large = true;
            api_buf_free(&x->body);
        }
        if (x->too_large) {
            x->discarded += *upload_data_size;
            if (x->discarded > DISCARD_CAP)
                return MHD_NO;
        } else {
            api_buf_put(&x->body, upload_data, *upload_data_size);
        }
        *upload_data_size = 0;
        return MHD_YES;
    }
    resp_init(&r);
    if (x->too_large) {
        api_error_resp(&r, 413, "body_too_large", NULL, "the request body is larger than %zu bytes",
                       s->cfg.max_body);
    } else if (x->body.oom) {
        api_error_resp(&r, 503, "unavailable", NULL, "out of memory reading the request");
    } else {
        api_req q = {.srv = s,
                     .conn = c,
                     .method = x->method,
                     .route = x->route,
                     .path = url,
                     .body = x->body.data,
                     .body_len = x->body.len};
        dispatch(&q, &r);
    }
    return respond(s, c, &r);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    req_ctx *x = *con_cls;
    (void)toe;
    api_conn_head_wait(cls, conn_of(c)); /* keep-alive: the next head's deadline runs */
    if (x) {
        api_buf_free(&x->body);
        free(x);
        *con_cls = NULL;
    }
}

/* The accept policy: the per-address limit (conn.c). */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen)
{
    return api_conn_admit(cls, addr, addrlen) ? MHD_YES : MHD_NO;
}

/* A connection starts (track it: its head's deadline, its address's count) or ends. */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    api_server *s = cls;
    const union MHD_ConnectionInfo *fd, *addr;
    const struct sockaddr *sa;
    api_conn *k = NULL;

    if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        api_conn_close(s, *socket_context);
        *socket_context = NULL;
        return;
    }
    fd = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    addr = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    sa = addr ? addr->client_addr : NULL;
    if (!fd)
        return;
    if (api_conn_open(s, fd->connect_fd, sa,
                      sa && sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                      : sizeof(struct sockaddr_in),
                      &k) != 0) {
        shutdown(fd->connect_fd, SHUT_RDWR); /* untracked, it could outstay every deadline */
        return;
    }
    *socket_context = k;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));

/* libmicrohttpd's messages, at most MHD_LOG_BURST per LOG_EVERY_MS (the watcher counts the
 * rest and says how many): each client that breaks off mid-request gets a line, and a
 * flood of such clients must not flood the log. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    api_server *s = cls;
    char msg[512];
    if (atomic_fetch_add(&s->mhd_lines, 1) >= MHD_LOG_BURST) {
        atomic_fetch_add(&s->mhd_dropped, 1);
        return;
    }
    vsnprintf(msg, sizeof(msg), fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    log_warn("libmicrohttpd: %s", msg);
}

/* ---- start and stop -------------------------------------------------------------------- */

/* Parse "host:port" / "[v6]:port" into ss. */
static int parse_listen(const char *s, struct sockaddr_storage *ss, bool *v6, bool *loopback,
                        char *err, size_t errlen)
{
    char host[128];
    const char *port;
    int64_t p;

    memset(ss, 0, sizeof(*ss));
    if (s[0] == '[') {
        const char *close_br = strchr(s, ']');
        if (!close_br || close_br[1] != ':' || (size_t)(close_br - s - 1) >= sizeof(host))
            goto bad;
        memcpy(host, s + 1, (size_t)(close_br - s - 1));
        host[close_br - s - 1] = '\0';
        port = close_br + 2;
        *v6 = true;
    } else {
        const char *colon = strrchr(s, ':');
        if (!colon || colon == s || (size_t)(colon - s) >= sizeof(host) ||
            memchr(s, ':', (size_t)(colon - s)))
            goto bad;
        memcpy(host, s, (size_t)(colon - s));
        host[colon - s] = '\0';
        port = colon + 1;
        *v6 = false;
        if (strcmp(host, "localhost") == 0)
            snprintf(host, sizeof(host), "127.0.0.1");
    }
    if (api_parse_i64(port, 0, 65535, &p) != 0)
        goto bad;
    if (*v6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)p);
        if (inet_pton(AF_INET6, host, &a->sin6_addr) != 1)
            goto bad;
        *loopback = IN6_IS_ADDR_LOOPBACK(&a->sin6_addr) ||
                    (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr) && a->sin6_addr.s6_addr[12] == 127);
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)ss;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)p);
        if (inet_pton(AF_INET, host, &a->sin_addr) != 1)
            goto bad;
        *loopback = (ntohl(a->sin_addr.s_addr) >> 24) == 127;
    }
    return 0;
bad:
    snprintf(err, errlen,
             "cannot parse the listen address \"%s\" (want IPv4:port, [IPv6]:port or "
             "localhost:port)",
             s);
    return GPU_EINVAL;
}

static void read_cpu_model(api_server *s)
{
    char line[512];
    FILE *f = fopen("/proc/cpuinfo", "r");
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    s->cores = n > 0 ? (int)n : 1;
    snprintf(s->cpu_model, sizeof(s->cpu_model), "unknown");
    while (f && fgets(line, sizeof(line), f)) {
        if (strncmp(line, "model name", 10) == 0) {
            const char *v = strchr(line, ':');
            if (v) {
                v++;
                while (*v == ' ' || *v == '\t')
                    v++;
                snprintf(s->cpu_model, sizeof(s->cpu_model), "%s", v);
                s->cpu_model[strcspn(s->cpu_model, "\n")] = '\0';
            }
            break;
        }
    }
    if (f)
        fclose(f);
}

/* The connection cap: the open-file limit less FD_RESERVE and an eighth (a connection that
 * is sent a file holds a second descriptor), at most MAX_CONNS. */
static unsigned conn_cap(void)
{
    struct rlimit rl;
    rlim_t n = 1024, keep;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
        n = rl.rlim_cur == RLIM_INFINITY ? (rlim_t)MAX_CONNS * 2 : rl.rlim_cur;
    keep = FD_RESERVE + n / 8;
    if (n < 2 * keep)
        return (unsigned)(n / 2 > 16 ? n / 2 : 16);
    return n - keep > MAX_CONNS ? MAX_CONNS : (unsigned)(n - keep);
}

/* The watcher thread: resumes parked SSE streams after each commit of the store (and when
 * their heartbeat is due), shuts down connections whose request head is overdue, and logs
 * what the limits refused. Ends within WATCH_SLICE_MS once the server is stopping. */
static void *watch_main(void *arg)
{
    api_server *s = arg;
    uint64_t commits = 0;
    int64_t next_log = api_now_ms() + LOG_EVERY_MS;
    unsigned long long swept = 0;
    bool stopping = false;

    while (!stopping) {
        int64_t now = api_now_ms(), next = now + WATCH_SLICE_MS;
        int closed = 0;
        stopping = atomic_load(&s->stopping);
        if (!stopping) {
            api_sse_wake(s, commits, now, &next);
            api_conn_sweep(s, now, &closed, &next);
            swept += (unsigned long long)closed;
        }
        if (now >= next_log || stopping) {
            unsigned refused = atomic_exchange(&s->refused, 0);
            unsigned dropped = atomic_exchange(&s->mhd_dropped, 0);
            atomic_store(&s->mhd_lines, 0);
            if (dropped)
                log_warn("libmicrohttpd: %u more message(s) not logged", dropped);
            if (swept)
                log_warn("closed %llu connection(s) whose request head was not complete "
                         "within %d s",
                         swept, s->head_timeout_ms / 1000);
            if (refused)
                log_warn("refused %u connection(s) over the limit of %u per address", refused,
                         s->max_per_addr);
            swept = 0;
            next_log = now + LOG_EVERY_MS;
        }
        if (!stopping)
            store_wait_commit(s->st, &commits, next > now ? (int)(next - now) : 1);
    }
    return NULL;
}

/* Free what api_start built before the daemon (a NULL mhd) or after it was stopped. */
static void server_free(api_server *s)
{
    if (!s)
        return;
    api_peers_free(&s->peers);
    pthread_mutex_destroy(&s->conn_mu);
    pthread_mutex_destroy(&s->park_mu);
    pthread_mutex_destroy(&s->stop_mu);
    pthread_cond_destroy(&s->stop_cv);
    api_prom_free(s);
    pthread_mutex_destroy(&s->prom_mu);
    free(s);
}

/* See api.h. c and st are borrowed; st must not be NULL; jobs may be NULL (mutations and
 * live streams then answer 503 / read the store only). */
/* A server's state for c, st and jobs (copied), its locks and counters initialised; NULL
 * when out of memory. */
static api_server *server_new(const api_config *c, struct store *st, const api_jobs *jobs)
{
    api_server *s = calloc(1, sizeof(*s));
    pthread_condattr_t ca; /* api_stop's deadline is on the monotonic clock */
    if (!s)
        return NULL;
    s->cfg = *c;
    if (s->cfg.max_body == 0)
        s->cfg.max_body = DEFAULT_MAX_BODY;
    if (s->cfg.stop_timeout_ms <= 0)
        s->cfg.stop_timeout_ms = DEFAULT_STOP_TIMEOUT_MS;
    s->st = st;
    if (jobs) {
        s->jobs_copy = *jobs;
        s->jobs = &s->jobs_copy;
    }
    atomic_init(&s->stopping, false);
    atomic_init(&s->refused, 0);
    atomic_init(&s->mhd_lines, 0);
    atomic_init(&s->mhd_dropped, 0);
    atomic_init(&s->streams, 0);
    for (int i = 0; i < API_NCODES; i++)
        atomic_init(&s->codes[i], 0);
    pthread_mutex_init(&s->prom_mu, NULL);
    pthread_mutex_init(&s->conn_mu, NULL);
    pthread_mutex_init(&s->park_mu, NULL);
    pthread_mutex_init(&s->stop_mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->stop_cv, &ca);
    pthread_condattr_destroy(&ca);
    return s;
}

/* The limits, timeouts and machine facts the server runs with: c's, or the defaults. */
static void server_settings(api_server *s, const api_config *c)
{
    const char *hb = getenv("AMPD_SSE_HEARTBEAT_MS");
    s->heartbeat_ms = DEFAULT_HEARTBEAT_MS;
    if (hb) {
        int64_t v;
        if (api_parse_i64(hb, 10, 30000, &v) == 0)
            s->heartbeat_ms = (int)v;
        else
            log_warn("AMPD_SSE_HEARTBEAT_MS=%s ignored (want 10..30000)", hb);
    }
    s->head_timeout_ms =
        1000 * (c->head_timeout_s > 0 ? c->head_timeout_s : DEFAULT_HEAD_TIMEOUT_S);
    s->max_per_addr = c->max_per_addr > 0 ? (unsigned)c->max_per_addr : DEFAULT_MAX_PER_ADDR;
    s->max_conns = c->max_conns ? c->max_conns : conn_cap();
    if (s->cfg.web_root[0] && !realpath(s->cfg.web_root, s->web_root_real)) {
        log_warn("web root %s: %s; not serving static files", s->cfg.web_root, strerror(errno));
        s->web_root_real[0] = '\0';
    }
    read_cpu_model(s);
    s->threads = s->cores < POOL_MIN ? POOL_MIN : s->cores > POOL_MAX ? POOL_MAX : s->cores;
    /* Loads BLAS once here, before the server's threads exist (it may setenv). */
    s->blas_info = gpu_blas_info();
    api_system_probe();
}

/* libmicrohttpd listening on ss (IPv6 when v6) with s's limits; s->port the port bound. */
static int server_listen(api_server *s, const struct sockaddr_storage *ss, bool v6, char *err,
                         size_t errlen)
{
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                     MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG | (v6 ? MHD_USE_IPv6 : 0);
    const union MHD_DaemonInfo *di;
    s->mhd = MHD_start_daemon(
        flags, 0, on_accept, s, on_request, s, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, s,
        MHD_OPTION_SOCK_ADDR, (const struct sockaddr *)ss, MHD_OPTION_THREAD_POOL_SIZE,
        (unsigned)s->threads, MHD_OPTION_CONNECTION_LIMIT, s->max_conns,
        MHD_OPTION_CONNECTION_TIMEOUT, CONN_TIMEOUT_S, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, s, MHD_OPTION_END);
    if (!s->mhd) {
        snprintf(err, errlen, "cannot listen on %s (address in use or not available)",
                 s->cfg.listen);
        return GPU_EIO;
    }
    di = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : 0;
    return 0;
}

int api_start(const api_config *c, struct store *st, const api_jobs *jobs, api_server **out,
              char *err, size_t errlen)
{
    struct sockaddr_storage ss;
    bool v6 = false, loopback = false;
    api_server *s = NULL;
    int rc;

    *out = NULL;
    if (!c || !st) {
        snprintf(err, errlen, "api_start: no configuration or no store");
        return GPU_EINVAL;
    }
    rc = parse_listen(c->listen, &ss, &v6, &loopback, err, errlen);
    if (rc)
        return rc;
    if (!loopback && !c->token[0]) {
        snprintf(err, errlen,
                 "refusing to listen on %s without a bearer token: a non-loopback address "
                 "needs --token-file (or listen on 127.0.0.1)",
                 c->listen);
        return GPU_EINVAL;
    }
    if (!(s = server_new(c, st, jobs))) {
        snprintf(err, errlen, "out of memory");
        return GPU_ENOMEM;
    }
    server_settings(s, c);
    if ((rc = server_listen(s, &ss, v6, err, errlen)) != 0 ||
        (rc = hosts_init(s, err, errlen)) != 0)
        goto fail;
    if (pthread_create(&s->watcher, NULL, watch_main, s) != 0) {
        snprintf(err, errlen, "cannot start the server's watcher thread");
        rc = GPU_ENOMEM;
        goto fail;
    }
    s->watcher_started = true;
    log_info("listening on %s (port %u)%s; %d threads, up to %u connections, %u per address "
             "beyond loopback, request heads within %d s",
             c->listen, s->port, c->token[0] ? ", bearer token required for changes" : "",
             s->threads, s->max_conns, s->max_per_addr, s->head_timeout_ms / 1000);
    *out = s;
    return 0;
fail:
    if (s->mhd)
        MHD_stop_daemon(s->mhd);
    server_free(s);
    return rc;
}

unsigned api_port(const api_server *a)
{
    return a ? a->port : 0;
}

/* MHD_stop_daemon on a thread of its own: it returns once every request in progress has
 * ended. Frees the server when api_stop has stopped waiting for it. */
static void *stop_main(void *arg)
{
    api_server *a = arg;
    bool abandoned;
    MHD_stop_daemon(a->mhd);
    pthread_mutex_lock(&a->stop_mu);
    a->stopped = true;
    abandoned = a->abandoned;
    pthread_cond_broadcast(&a->stop_cv);
    pthread_mutex_unlock(&a->stop_mu);
    if (abandoned) {
        log_info("the request that held up the stop has ended");
        server_free(a);
    }
    return NULL;
}

/* Ends the streams: the watcher stops within a slice; every parked stream is resumed, sees
 * `stopping` and ends, for which it gets STOP_GRACE_MS. */
static void end_streams(api_server *a)
{
    atomic_store(&a->stopping, true);
    if (a->watcher_started)
        pthread_join(a->watcher, NULL);
    api_sse_wake_all(a); /* libmicrohttpd must not be stopped with a suspended connection */
    /* Let the streams send their last chunk, so that clients see them end, not cut. */
    for (int64_t t0 = api_now_ms(); atomic_load(&a->streams) > 0;) {
        struct timespec ts = {0, 10 * 1000000L};
        if (api_now_ms() - t0 >= STOP_GRACE_MS)
            break;
        nanosleep(&ts, NULL);
    }
}

/* Waits until stop_main has stopped libmicrohttpd, at most stop_timeout_ms; true when it
 * has. Past the deadline the server is stop_main's to free. */
static bool wait_stopped(api_server *a)
{
    struct timespec dl;
    int rc = 0;
    bool stopped;

    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += a->cfg.stop_timeout_ms / 1000;
    dl.tv_nsec += (long)(a->cfg.stop_timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&a->stop_mu);
    while (!a->stopped && rc == 0)
        rc = pthread_cond_timedwait(&a->stop_cv, &a->stop_mu, &dl);
    stopped = a->stopped;
    if (!stopped)
        a->abandoned = true;
    pthread_mutex_unlock(&a->stop_mu);
    return stopped;
}

/* Ends every stream, closes every connection and frees a; see api.h for a request still
 * busy after stop_timeout_ms. */
int api_stop(api_server *a)
{
    pthread_attr_t at;
    pthread_t t;

    if (!a)
        return 0;
    end_streams(a);
    if (!a->mhd) {
        server_free(a);
        return 0;
    }
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, stop_main, a) != 0) {
        pthread_attr_destroy(&at);
        MHD_stop_daemon(a->mhd); /* no thread to spare: wait as long as it takes */
        server_free(a);
        return 0;
    }
    pthread_attr_destroy(&at);
    if (!wait_stopped(a)) {
        log_error("a request was still busy %d ms after the stop began; leaving it behind",
                  a->cfg.stop_timeout_ms);
        return GPU_ETIMEDOUT;
    }
    server_free(a);
    return 0;
}
