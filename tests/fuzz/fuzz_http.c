/*
 * fuzz_http.c - libFuzzer harness of the HTTP request path: the input is the bytes a client
 * sends on one connection (one request, or several pipelined), written to a real server
 * (api_start: libmicrohttpd's parser, then request admission, routing, query parsing and
 * every handler of api/) on a loopback port; the harness half-closes the connection and
 * reads what the server answers until it closes the connection, or has sent everything and
 * then been silent for QUIET_MS. (A connection the server keeps open, for another request
 * or for the rest of an unfinished one, is left to it until its request-head deadline,
 * which the harness sets to HEAD_TIMEOUT_S.)
 *
 * Why a running server and not the admission and route functions called directly: what
 * reaches admit(), the router and the handlers is what libmicrohttpd makes of the bytes
 * (the URL unescaped, the query split into arguments, headers folded, bodies chunked or
 * not), so the inputs our code sees are the ones a real client can produce, and the
 * harness needs nothing of api/'s internals: it calls the public API only.
 * libmicrohttpd itself is not instrumented; the coverage that guides the fuzzer is ours.
 *
 * The server: a bearer token ("fuzz-token"), the Host "fuzz" and the Origin
 * "http://fuzz.example" allowed (the seeds' headers), a web root with an app, and a store
 * seeded once with three finished jobs (metrics with an overflow and a NaN, eval, events,
 * per-layer rows, a checkpoint file, a summary), so that every route has data to answer
 * with and every stream ends. The job queue is a stub (submit answers job 1 as new, the
 * rest 409), so the store never changes and an input answers the same each time.
 *
 * AMPD_FUZZ_ECHO=1 in the environment copies every answer to stderr.
 *
 * Properties: after every input the server still answers: a GET /healthz on a new
 * connection gets its 200 within 10 s (a server that hangs, deadlocks or stops accepting
 * fails). Before the next input the harness waits until the process has no more threads
 * than when it was idle: a server with a thread per connection frees a thread's store
 * reader as the thread exits, after the socket closed, and libFuzzer's per-input leak check
 * must not see it in flight.
 *
 * Seeds: tests/fuzz/corpus/http/ (one request of each route and method, bad ones, a
 * pipelined pair).
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>

#include "api/api.h"
#include "store/store.h"
#include "tests/fuzz/fuzz.h"

#define ANSWER_MS 10000
#define QUIET_MS 5       /* sent everything and heard nothing this long: the answer is over */
#define HEAD_TIMEOUT_S 1 /* the server closes a connection whose request head is overdue */

static store *st;
static api_server *srv;
static unsigned port;
static int idle_threads; /* this process's threads while no request is served */
static bool echo; /* AMPD_FUZZ_ECHO set: the answers go to stderr (to look at the seeds) */

static int submit(void *ctx, const char *name, const char *dtype, int64_t steps,
                  const char *spec_json, const char *idem_key, int64_t *id, bool *existed)
{
    (void)ctx, (void)name, (void)dtype, (void)steps, (void)spec_json, (void)idem_key;
    *id = 1;
    *existed = false;
    return 0;
}

static int refuse(void *ctx, int64_t id)
{
    (void)ctx, (void)id;
    return STORE_ECONFLICT;
}

static void info(void *ctx, api_queue_info *out)
{
    (void)ctx;
    memset(out, 0, sizeof(*out));
    out->max_running = 1;
}

/* Job id with steps metric rows and the rest; it ends in status. */
static int seed_job(const char *dir, const char *name, int64_t steps, store_status status)
{
    store_metric m;
    store_layer_stat rows[2];
    store_layer_info li = {.scale = 65536.0};
    char path[700], summary[160];
    int64_t id;
    bool existed;

    if (store_job_insert(st, name, "fp16", steps, "{\"name\":\"fuzz\"}", NULL, &id, &existed) ||
        store_job_set_status(st, id, STORE_RUNNING, NULL))
        return -1;
    for (int64_t s = 1; s <= steps; s++) {
        memset(&m, 0, sizeof(m));
        m.job_id = id;
        m.step = s;
        for (int f = 0; f < STORE_M_NFIELDS; f++)
            m.v[f] = f == STORE_M_OVERFLOW ? (s == 3) : (double)s / (double)(f + 1);
        if (s == 4)
            m.v[STORE_M_LOSS] = NAN;
        m.v[STORE_M_EVAL_LOSS] = m.v[STORE_M_EVAL_ACC] = store_missing();
        if (store_metric_append(st, &m))
            return -1;
    }
    m.v[STORE_M_EVAL_LOSS] = 0.5;
    m.v[STORE_M_EVAL_ACC] = 0.75;
    memset(rows, 0, sizeof(rows));
    for (int i = 0; i < 2; i++) {
        snprintf(rows[i].name, sizeof(rows[i].name), "fc%d", i + 1);
        snprintf(rows[i].dtype, sizeof(rows[i].dtype), "fp16");
        for (int f = 0; f < STORE_L_NFIELDS; f++)
            rows[i].v[f] = i + f;
    }
    snprintf(path, sizeof(path), "%s/ckpt-%lld.safetensors", dir, (long long)id);
    snprintf(summary, sizeof(summary),
             "{\"type\":\"summary\",\"name\":\"%s\",\"status\":\"%s\",\"steps\":%lld}", name,
             store_status_name(status), (long long)steps);
    if (store_metric_eval(st, id, 0, steps / 2, m.v) ||
        store_event_append(st, id, 3, "overflow", "step 3: gradients overflowed", NULL) ||
        store_event_append(st, id, 3, "recommendation", "use bf16", "{\"layer\":\"fc1\"}") ||
        store_layer_stats_append(st, id, 3, &li, rows, 2) ||
        fuzz_write(dir, strrchr(path, '/') + 1, "checkpoint", 10) ||
        store_checkpoint_add(st, id, steps, path, 10) || store_flush(st) ||
        store_job_set_checkpoint(st, id, steps) || store_job_set_summary(st, id, summary) ||
        store_job_set_status(st, id, status, status == STORE_FAILED ? "it failed" : NULL))
        return -1;
    return store_flush(st);
}

static int setup(void)
{
    const char *dir = fuzz_dir();
    char db[600], web[600];
    api_config c;
    api_jobs jobs = {.submit = submit, .cancel = refuse, .resume = refuse, .remove = refuse,
                     .info = info};
    struct rlimit nofile;

    if (!dir)
        return -1;
    /* connections the server keeps until their head deadline hold descriptors (as the
     * daemon does, the soft limit goes up to the hard one) */
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        setrlimit(RLIMIT_NOFILE, &nofile);
    }
    snprintf(db, sizeof(db), "%s/fuzz.db", dir);
    snprintf(web, sizeof(web), "%s/web", dir);
    if (mkdir(web, 0700) != 0 || fuzz_write(web, "index.html", "<!doctype html>", 15) ||
        fuzz_write(web, "app.js", "export {};", 10) || store_open(db, &st) != 0 ||
        seed_job(dir, "first", 12, STORE_SUCCEEDED) || seed_job(dir, "second", 5, STORE_FAILED) ||
        seed_job(dir, "third", 3, STORE_CANCELLED))
        return -1;
    memset(&c, 0, sizeof(c));
    snprintf(c.listen, sizeof(c.listen), "127.0.0.1:0");
    snprintf(c.token, sizeof(c.token), "fuzz-token");
    snprintf(c.web_root, sizeof(c.web_root), "%.500s", web);
    c.max_body = 1 << 16;
    c.head_timeout_s = HEAD_TIMEOUT_S;
    c.nallow_hosts = 1; /* the seeds' Host, whatever port the server bound */
    snprintf(c.allow_hosts[0], sizeof(c.allow_hosts[0]), "fuzz");
    c.nallow_origins = 1;
    snprintf(c.allow_origins[0], sizeof(c.allow_origins[0]), "http://fuzz.example");
    c.metrics_keep_s = 3600;
    api_spec_opts_default(&c.spec);
    c.spec.nroots = 1;
    snprintf(c.spec.roots[0], sizeof(c.spec.roots[0]), "%s", dir);
    if (api_start(&c, st, &jobs, &srv, db, sizeof(db)) != 0) {
        fprintf(stderr, "fuzz: api_start: %s\n", db);
        return -1;
    }
    port = api_port(srv);
    return 0;
}

/* connect(2) that a signal does not break (libFuzzer's timers send SIGALRM): an
 * interrupted connect goes on in the background, so wait for it. 0 or -1 with errno. */
static int connect_to(int fd, const struct sockaddr_in *a)
{
    struct pollfd p = {fd, POLLOUT, 0};
    socklen_t len = sizeof(int);
    int e = 0;
    if (connect(fd, (const struct sockaddr *)a, sizeof(*a)) == 0)
        return 0;
    if (errno != EINTR && errno != EINPROGRESS)
        return -1;
    while (poll(&p, 1, ANSWER_MS) < 0)
        if (errno != EINTR)
            return -1;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0)
        return -1;
    errno = e;
    return e ? -1 : 0;
}

/* The threads of this process (/proc/self/task), or -1. */
static int thread_count(void)
{
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    int n = 0;
    if (!d)
        return -1;
    while ((e = readdir(d)) != NULL)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Send data[0..size) on a new connection, half-close it and read the answer (see the top
 * of the file). */
static void exchange(const uint8_t *data, size_t size)
{
    struct sockaddr_in a = {.sin_family = AF_INET};
    char buf[65536];
    size_t off = 0;
    int64_t deadline, last;
    int fd;

    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect_to(fd, &a) != 0)
        fuzz_fail("cannot connect to the server: %s", strerror(errno));
    deadline = now_ms() + ANSWER_MS;
    last = now_ms();
    if (size == 0)
        shutdown(fd, SHUT_WR);
    /* send while reading, so that a large answer never blocks the sending */
    for (;;) {
        struct pollfd p = {fd, POLLIN | (off < size ? POLLOUT : 0), 0};
        int64_t t = now_ms(), wait = off == size ? last + QUIET_MS - t : deadline - t;
        if (off == size && wait <= 0)
            break;
        if (t >= deadline)
            fuzz_fail("the server took the input for %d ms (%zu of %zu bytes sent)", ANSWER_MS,
                      off, size);
        if (poll(&p, 1, (int)(wait < 1 ? 1 : wait)) <= 0)
            continue;
        if (p.revents & POLLOUT) {
            ssize_t w = send(fd, data + off, size - off, MSG_NOSIGNAL);
            if (w > 0)
                off += (size_t)w;
            if (w < 0 && errno != EINTR)
                off = size; /* the server closed: read what it said */
            if (off == size) {
                shutdown(fd, SHUT_WR);
                last = now_ms();
            }
        }
        if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t r = recv(fd, buf, sizeof(buf), 0);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0)
                break;
            last = now_ms();
            if (echo && fwrite(buf, 1, (size_t)r, stderr) != (size_t)r)
                echo = false;
        }
    }
    close(fd);
}

/* The server answers GET /healthz within ANSWER_MS, or the run fails. */
static void still_serving(void)
{
    static const char probe[] =
        "GET /healthz HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n";
    struct sockaddr_in a = {.sin_family = AF_INET};
    char buf[256];
    size_t got = 0;
    int64_t deadline = now_ms() + ANSWER_MS;
    int fd;

    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect_to(fd, &a) != 0 ||
        send(fd, probe, sizeof(probe) - 1, MSG_NOSIGNAL) != (ssize_t)sizeof(probe) - 1)
        fuzz_fail("the server no longer takes a request: %s", strerror(errno));
    while (got < 12) {
        struct pollfd p = {fd, POLLIN, 0};
        int64_t left = deadline - now_ms();
        ssize_t r;
        if (left <= 0)
            fuzz_fail("the server no longer answers GET /healthz within %d ms", ANSWER_MS);
        if (poll(&p, 1, (int)left) <= 0)
            continue;
        r = recv(fd, buf + got, sizeof(buf) - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    if (got < 12 || memcmp(buf, "HTTP/1.1 200", 12) != 0)
        fuzz_fail("GET /healthz is no longer answered 200: \"%.*s\"", (int)got, buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    int64_t deadline;

    if (!ready) {
        if (setup() != 0)
            fuzz_fail("cannot start the server");
        ready = 1;
        echo = getenv("AMPD_FUZZ_ECHO") != NULL;
        idle_threads = thread_count();
    }
    exchange(data, size);
    still_serving();
    /* a thread of the connection's own ends after the socket closed: wait for it */
    deadline = now_ms() + ANSWER_MS;
    while (thread_count() > idle_threads) {
        if (now_ms() > deadline)
            fuzz_fail("a connection's thread still runs %d ms after its request", ANSWER_MS);
        nanosleep(&(struct timespec){0, 100000}, NULL);
    }
    return 0;
}
