/*
 * serve.c - `ampd serve`: the daemon. Opens the store, recovers and starts the scheduler,
 * starts the HTTP server, then waits for SIGTERM or SIGINT and stops in the reverse order:
 * the server (closing SSE streams; a request still busy after 5 s is left behind), the
 * scheduler (running jobs checkpoint and become interrupted, 30 s at most), the store (only
 * flushed when a request was left behind, which may still read it; the process exits).
 *
 * The dashboard (web/: index.html, css/, js/, vendor/) is served at / from --web-root, else
 * from web/ beside the ampd executable when that holds index.html (the build tree), else
 * from AMPD_WEBDIR (make install puts it there) when that does; otherwise only the API is
 * served. One log line says which.
 *
 * One daemon per data directory and per database: before the database is opened (and so
 * before the jobs a dead daemon left running are recovered) the daemon takes an exclusive
 * lock on DATA_DIR/ampd.lock and on DB.lock beside the database (daemon/lock.c), held until
 * it exits; a second daemon on either refuses to start, naming the first one's pid.
 *
 * Start-up errors (bad options, an unusable token file, data directory or database, a
 * data directory or database another daemon holds, a port in use, a non-loopback address
 * without a token, a --web-root without index.html) print one line and exit 1 (2 for bad
 * usage); nothing after start-up exits.
 *
 * At start it raises its open-file soft limit to the hard limit, since every HTTP connection
 * is a descriptor (the server's connection cap follows from the limit); workers are given
 * the old soft limit back.
 *
 * Threads: SIGTERM, SIGINT (and SIGPIPE, ignored) are blocked before any thread starts, so
 * every thread inherits the mask and the main thread takes them with sigwait(). Workers get
 * a clean mask (sched.c). After the first signal a second SIGINT kills the daemon at once.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "api/api.h"
#include "config.h"
#include "daemon/daemon.h"
#include "daemon/fs.h"
#include "daemon/lock.h"
#include "daemon/log.h"
#include "daemon/machine.h"
#include "daemon/opts.h"
#include "daemon/sched.h"
#include "store/store.h"

#define TOKEN_FILE_MAX 4096
#define PATH_LEN 1024

#ifndef AMPD_WEBDIR
#define AMPD_WEBDIR "" /* set by Makefile.am: $(pkgdatadir)/web */
#endif

typedef struct {
    char listen[128];
    char db[PATH_LEN];
    char data_dir[PATH_LEN];
    char shared_dir[PATH_LEN];
    char token_file[PATH_LEN];
    char port_file[PATH_LEN];
    char web_root[PATH_LEN]; /* --web-root; after find_web_root, the one served or "" */
    char token[256];
    int nroots;
    char roots[DAEMON_MAX_ROOTS][512];
    int nallow_hosts, nallow_origins;
    char allow_hosts[API_MAX_ALLOW][API_ALLOW_LEN];
    char allow_origins[API_MAX_ALLOW][API_ALLOW_LEN];
    int max_running, max_retries, worker_timeout_s, stall_timeout_s, metrics_keep_s;
    int head_timeout_s, max_per_addr;
    bool demo, no_dashboard, share_devices, no_preempt;
    const char *cpus, *devices; /* --cpus, --devices: NULL for all */
    daemon_launch_opts launch;  /* --launcher, --slurm-* */
} serve_args;

/* One more --data-root. */
static int root_arg(void *args, const char *v)
{
    serve_args *a = args;
    if (a->nroots >= DAEMON_MAX_ROOTS || a->nroots >= API_MAX_ROOTS) {
        fprintf(stderr, "ampd serve: at most %d --data-root options\n", DAEMON_MAX_ROOTS);
        return -1;
    }
    if (daemon_opts_copy("serve", "--data-root", v, a->roots[a->nroots], sizeof(a->roots[0])))
        return -1;
    a->nroots++;
    return 0;
}

/* --preempt on|off. */
static int preempt_arg(void *args, const char *v)
{
    serve_args *a = args;
    if (strcmp(v, "on") != 0 && strcmp(v, "off") != 0) {
        fprintf(stderr, "ampd serve: --preempt takes on or off, not '%s'\n", v);
        return -1;
    }
    a->no_preempt = strcmp(v, "off") == 0;
    return 0;
}

/* One more --allow-host or --allow-origin value, checked by check; -1 with a message. */
static int allow_arg(const char *opt, const char *v,
                     int (*check)(const char *v, char *err, size_t errlen),
                     char (*list)[API_ALLOW_LEN], int *n)
{
    char why[400];
    if (*n >= API_MAX_ALLOW) {
        fprintf(stderr, "ampd serve: at most %d %s options\n", API_MAX_ALLOW, opt);
        return -1;
    }
    if (check(v, why, sizeof(why)) != 0) {
        fprintf(stderr, "ampd serve: %s %s\n", opt, why);
        return -1;
    }
    if (daemon_opts_copy("serve", opt, v, list[*n], API_ALLOW_LEN) != 0)
        return -1;
    (*n)++;
    return 0;
}

static int allow_host_arg(void *args, const char *v)
{
    serve_args *a = args;
    return allow_arg("--allow-host", v, api_check_allow_host, a->allow_hosts, &a->nallow_hosts);
}

static int allow_origin_arg(void *args, const char *v)
{
    serve_args *a = args;
    return allow_arg("--allow-origin", v, api_check_allow_origin, a->allow_origins,
                     &a->nallow_origins);
}

static void show_max_allow(char *out, size_t len)
{
    snprintf(out, len, "%d", API_MAX_ALLOW);
}

static void show_webdir(char *out, size_t len)
{
    snprintf(out, len, "%s", AMPD_WEBDIR[0] ? AMPD_WEBDIR : "none");
}

#define STR_OPT(field)                                                                             \
    .kind = DAEMON_OPT_STR, .off = offsetof(serve_args, field),                                    \
    .len = sizeof(((serve_args *)0)->field)
#define INT_OPT(field, l, h, d)                                                                    \
    .kind = DAEMON_OPT_INT, .off = offsetof(serve_args, field), .lo = (l), .hi = (h), .def = (d)
#define FLAG_OPT(field) .kind = DAEMON_OPT_FLAG, .off = offsetof(serve_args, field)

/* `ampd serve`'s options: the parser and the help read this table. */
static const daemon_opt serve_opts[] = {
    {"listen", 0, "ADDR:PORT", STR_OPT(listen), .def_str = "127.0.0.1:8080",
     .help = "address to listen on (default %s); beyond\nloopback only with --token-file"},
    {"data-dir", 0, "DIR", STR_OPT(data_dir),
     .help = "job files and the database (default $XDG_STATE_HOME/ampd\nor "
             "~/.local/state/ampd; created if missing)"},
    {"db", 0, "FILE", STR_OPT(db), .help = "the SQLite database (default DATA_DIR/ampd.db)"},
    {"shared-dir", 0, "DIR", STR_OPT(shared_dir),
     .help = "where the job directories are (spec, log, checkpoints,\nheartbeats; default "
             "DATA_DIR): jobs that run on other\nmachines need one every node sees at the same "
             "path"},
    {"data-root", 0, "DIR", .kind = DAEMON_OPT_CALL, .repeat = true, .set = root_arg,
     .show = daemon_opts_show_roots,
     .help = "where named datasets are found (repeatable; default\n%s)"},
    {"token-file", 0, "FILE", STR_OPT(token_file),
     .help = "bearer token (first line) required by mutating requests;\nthe file must not be "
             "readable by group or others"},
    {"max-running", 0, "N", INT_OPT(max_running, 1, 64, 1),
     .help = "jobs that run at once (default %s)"},
    {"cpus", 0, "LIST", .kind = DAEMON_OPT_PTR, .off = offsetof(serve_args, cpus),
     .help = "the cores jobs are placed on, e.g. 0-7,16 (default: every\ncore of the affinity "
             "ampd starts with)"},
    {"devices", 0, "LIST", .kind = DAEMON_OPT_PTR, .off = offsetof(serve_args, devices),
     .help = "the GPUs (NVML indices) jobs are placed on, e.g. 0,2\n(default: every GPU the "
             "driver reports)"},
    {"share-devices", 0, NULL, FLAG_OPT(share_devices),
     .help = "let several jobs share a GPU (each job still gets one\nGPU per rank)"},
    {"preempt", 0, "on|off", .kind = DAEMON_OPT_CALL, .set = preempt_arg,
     .help = "whether a queued job of higher priority that does not\nfit stops running jobs of "
             "lower priority at a checkpoint\n(they resume when it leaves room; default on)"},
    {"max-retries", 0, "N", INT_OPT(max_retries, 0, 1000, 3),
     .help = "automatic resumes of a job interrupted by a stop of the\ndaemon, or that lost a "
             "node (default %s)"},
    DAEMON_LAUNCH_OPTS(serve_args, launch),
    {"worker-timeout", 0, "S", INT_OPT(worker_timeout_s, 1, 7 * 24 * 3600, 600),
     .help = "a worker silent this long is killed as hung (default %s)"},
    {"stall-timeout", 0, "S", INT_OPT(stall_timeout_s, 0, 30 * 24 * 3600, 3600),
     .help = "a job whose worker has waited this long for the store to\nwrite (a full disk, a "
             "lock) is stopped and failed\n(default %s; 0: it waits as long as it takes)"},
    {"metrics-keep", 0, "S", INT_OPT(metrics_keep_s, 0, 30 * 24 * 3600, 3600),
     .help = "/metrics keeps a finished job's series S seconds, so that\nPrometheus scrapes its "
             "final values (default %s; 0: no)"},
    {"head-timeout", 0, "S", INT_OPT(head_timeout_s, 1, 3600, 10),
     .help = "a connection must send a whole request head (request\nline and headers) within S "
             "seconds of opening or of its\nprevious request's end, or it is closed (default %s)"},
    {"max-per-address", 0, "N", INT_OPT(max_per_addr, 1, 1000000, 64),
     .help = "connections from one address beyond loopback (an IPv6\n/64 counts as one); more "
             "are refused (default %s)"},
    {"allow-host", 0, "NAME[:PORT]", .kind = DAEMON_OPT_CALL, .repeat = true,
     .set = allow_host_arg, .show = show_max_allow,
     .help = "also answer requests whose Host header is NAME\n(any port, or PORT only); the "
             "daemon answers only to\nlocalhost, 127.0.0.1, [::1] and the listen address with\n"
             "its port otherwise (repeatable, at most %s)"},
    {"allow-origin", 0, "ORIGIN", .kind = DAEMON_OPT_CALL, .repeat = true,
     .set = allow_origin_arg, .show = show_max_allow,
     .help = "admit requests from pages of ORIGIN (http://host:port),\nrefused otherwise unless "
             "they are the daemon's own\n(repeatable, at most %s)"},
    {"port-file", 0, "FILE", STR_OPT(port_file),
     .help = "write the bound port to FILE once listening (for tests)"},
    {"web-root", 0, "DIR", STR_OPT(web_root), .show = show_webdir,
     .help = "the dashboard's files (default: web/ beside the ampd\nbinary when it holds "
             "index.html, else %s)"},
    {"no-dashboard", 0, NULL, FLAG_OPT(no_dashboard),
     .help = "serve only the API, not the dashboard at /"},
    {"demo", 0, NULL, FLAG_OPT(demo),
     .help = "on an empty database, queue the Fashion-MNIST MLP in\nfp32, fp16 and bf16 (the "
             "side-by-side experiment)"},
    {"help", 0, NULL, .kind = DAEMON_OPT_HELP, .help = ""},
    {"version", 0, NULL, .kind = DAEMON_OPT_VERSION, .help = ""},
};

static const daemon_opts_cmd serve_cmd = {
    .name = "serve",
    .opts = serve_opts,
    .nopts = (int)(sizeof(serve_opts) / sizeof(serve_opts[0])),
    .about = "  Run the training daemon in the foreground (logs on stderr; SIGTERM or Ctrl-C\n"
             "  stops it: running jobs checkpoint and resume at the next start).\n",
    .col = 23,
};

static void default_data_dir(char *out, size_t len)
{
    const char *xdg = getenv("XDG_STATE_HOME"), *home = getenv("HOME");
    if (xdg && xdg[0] == '/')
        snprintf(out, len, "%s/ampd", xdg);
    else if (home && home[0])
        snprintf(out, len, "%s/.local/state/ampd", home);
    else
        snprintf(out, len, "/var/lib/ampd");
}

/* --demo: on an empty database, queue the seed experiment: the same Fashion-MNIST MLP in
 * fp32, fp16 (dynamic loss scaling) and bf16, validated like any submitted spec, grouped as
 * the experiment "demo-fmnist" (one seed each: its page says that a verdict needs more). */
static void queue_demo(store *st, daemon_sched *sc, const api_config *ac)
{
    static const char *const dtypes[] = {"fp32", "fp16", "bf16"};
    store_job_filter f = {.status = -1, .limit = 1};
    store_job *jobs = NULL;
    store_member m[3];
    int n = 0, queued = 0;
    int64_t exp;

    if (store_job_list(st, &f, &jobs, &n) != 0 || n > 0) {
        store_jobs_free(jobs, n);
        return;
    }
    for (int i = 0; i < 3; i++) {
        char spec[512];
        gpu_job_config c;
        api_error e;
        int64_t id;
        bool existed;
        snprintf(spec, sizeof(spec),
                 "{\"name\": \"demo-fmnist-%s\", \"model\": {\"type\": \"mlp\", \"layers\": "
                 "[784, 1024, 1024, 10]}, \"data\": {\"type\": \"idx\", \"train\": "
                 "\"fashion-mnist\"}, \"precision\": {\"dtype\": \"%s\"}, \"batch_size\": 256, "
                 "\"steps\": 2000, \"eval_every\": 200, \"checkpoint_every\": 500}",
                 dtypes[i], dtypes[i]);
        if (api_spec_parse(spec, strlen(spec), &ac->spec, &c, &e) != 0) {
            log_warn("demo: %s: %s (install the Debian package dataset-fashion-mnist)",
                     e.field, e.message);
            return;
        }
        if (daemon_sched_submit(sc, c.name, dtypes[i], c.steps, spec, NULL, &id, &existed) != 0)
            continue;
        log_info("demo: queued job %lld (%s)", (long long)id, c.name);
        m[queued] = (store_member){.job_id = id, .seed = (int64_t)c.seed};
        snprintf(m[queued++].arm, STORE_ARM_MAX, "%s", dtypes[i]);
    }
    if (queued && store_experiment_create(st, "demo-fmnist", "fp32", NULL, m, queued, &exp) == 0)
        log_info("demo: the experiment %lld groups them", (long long)exp);
}

/* 0 to run, 1 for --help/--version (exit 0), 2 for bad usage. */
static int parse_args(int argc, char **argv, serve_args *a)
{
    int first, rc;

    memset(a, 0, sizeof(*a));
    rc = daemon_opts_parse(&serve_cmd, argc, argv, a, &first);
    if (rc == DAEMON_OPTS_HELP) {
        daemon_opts_usage(stdout, &serve_cmd);
        return 1;
    }
    if (rc == DAEMON_OPTS_VERSION) {
        printf("ampd %s\n", PACKAGE_VERSION);
        return 1;
    }
    if (rc == DAEMON_OPTS_OK && first != argc) {
        fprintf(stderr, "ampd serve: unexpected argument \"%s\"\n", argv[first]);
        rc = DAEMON_OPTS_BAD;
    }
    if (rc == DAEMON_OPTS_OK && a->no_dashboard && a->web_root[0]) {
        fprintf(stderr, "ampd serve: --web-root and --no-dashboard exclude each other\n");
        rc = DAEMON_OPTS_BAD;
    }
    if (rc != DAEMON_OPTS_OK) {
        fprintf(stderr, "`ampd serve --help` lists the options\n");
        return 2;
    }
    if (!a->data_dir[0])
        default_data_dir(a->data_dir, sizeof(a->data_dir));
    if (a->nroots == 0) {
        api_spec_opts d;
        api_spec_opts_default(&d);
        for (int i = 0; i < d.nroots && i < DAEMON_MAX_ROOTS; i++, a->nroots++)
            snprintf(a->roots[i], sizeof(a->roots[i]), "%s", d.roots[i]);
    }
    return 0;
}

/* Read the token: the file's first line, which must be non-empty; the file must not be
 * readable or writable by group or others. -1 with err filled otherwise. */
static int read_token(const char *path, char *token, size_t len, char *err, size_t errlen)
{
    char buf[TOKEN_FILE_MAX + 1];
    struct stat sb;
    FILE *f = fopen(path, "r");
    size_t n;

    if (!f) {
        snprintf(err, errlen, "token file %s: %s", path, strerror(errno));
        return -1;
    }
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        snprintf(err, errlen, "token file %s: not a regular file", path);
        fclose(f);
        return -1;
    }
    if (sb.st_mode & 077) {
        snprintf(err, errlen,
                 "token file %s is accessible by group or others (mode %04o); "
                 "run chmod 600 %s",
                 path, (unsigned)(sb.st_mode & 07777), path);
        fclose(f);
        return -1;
    }
    n = fread(buf, 1, TOKEN_FILE_MAX, f);
    fclose(f);
    buf[n] = '\0';
    buf[strcspn(buf, "\r\n")] = '\0';
    n = strlen(buf);
    while (n > 0 && (buf[n - 1] == ' ' || buf[n - 1] == '\t'))
        buf[--n] = '\0';
    if (n == 0 || n >= len) {
        snprintf(err, errlen, "token file %s: the first line must hold a token of 1 to %zu bytes",
                 path, len - 1);
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)buf[i] <= ' ' || (unsigned char)buf[i] >= 127) {
            snprintf(err, errlen, "token file %s: the token must be printable ASCII without spaces",
                     path);
            return -1;
        }
    memcpy(token, buf, n + 1);
    return 0;
}

/* mkdir -p with mode 0700 for directories this creates. */
/* Write the bound port to path atomically (a reader never sees a partial file). */
static int write_port_file(const char *path, unsigned port)
{
    char tmp[PATH_LEN + 8];
    FILE *f;
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    f = fopen(tmp, "w");
    if (!f)
        return -1;
    fprintf(f, "%u\n", port);
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* dir holds a regular file index.html (following symlinks) */
static bool has_index(const char *dir)
{
    char p[PATH_MAX + 16];
    struct stat sb;
    return snprintf(p, sizeof(p), "%s/index.html", dir) < (int)sizeof(p) && stat(p, &sb) == 0 &&
           S_ISREG(sb.st_mode);
}

/* Choose the dashboard's directory (see the top of the file) and resolve it: a->web_root
 * becomes its real path, or "" with why saying why none is served. -1 with err when an
 * explicit --web-root is unusable. */
static int find_web_root(serve_args *a, char *why, size_t whylen, char *err, size_t errlen)
{
    char exe[PATH_MAX], beside[PATH_MAX + 8] = "", real[PATH_MAX];
    const char *pick = NULL;
    char *slash;

    if (a->no_dashboard) {
        snprintf(why, whylen, "--no-dashboard");
        return 0;
    }
    if (a->web_root[0]) {
        if (!realpath(a->web_root, real)) {
            snprintf(err, errlen, "--web-root %s: %s", a->web_root, strerror(errno));
            return -1;
        }
        if (!has_index(real)) {
            snprintf(err, errlen, "--web-root %s: no index.html in it", a->web_root);
            return -1;
        }
    } else {
        if (realpath("/proc/self/exe", exe) && (slash = strrchr(exe, '/')) != NULL) {
            *slash = '\0';
            snprintf(beside, sizeof(beside), "%s/web", exe);
        }
        if (beside[0] && has_index(beside))
            pick = beside;
        else if (AMPD_WEBDIR[0] && has_index(AMPD_WEBDIR))
            pick = AMPD_WEBDIR;
        if (!pick) {
            snprintf(why, whylen, "no index.html in %s%s%s; --web-root DIR names one",
                     beside[0] ? beside : "web/ beside the binary",
                     AMPD_WEBDIR[0] ? " nor in " : "", AMPD_WEBDIR);
            return 0;
        }
        if (!realpath(pick, real)) {
            snprintf(why, whylen, "%s: %s", pick, strerror(errno));
            return 0;
        }
    }
    if (strlen(real) >= sizeof(a->web_root)) {
        snprintf(err, errlen, "the dashboard's path is too long (%zu bytes)", strlen(real));
        return -1;
    }
    memcpy(a->web_root, real, strlen(real) + 1);
    return 0;
}

/* Fill the scheduler's config; -1 with err when a path does not fit. */
static int sched_config(const serve_args *a, daemon_sched_config *sc, char *err, size_t errlen)
{
    ssize_t n;
    memset(sc, 0, sizeof(*sc));
    n = readlink("/proc/self/exe", sc->exe, sizeof(sc->exe) - 1);
    if (n <= 0 || (size_t)n >= sizeof(sc->exe) - 1) {
        snprintf(err, errlen, "cannot find the ampd executable (/proc/self/exe): %s",
                 n < 0 ? strerror(errno) : "path too long");
        return -1;
    }
    sc->exe[n] = '\0';
    if (strlen(a->data_dir) >= sizeof(sc->data_dir)) {
        snprintf(err, errlen, "the data directory's path is too long");
        return -1;
    }
    memcpy(sc->data_dir, a->data_dir, strlen(a->data_dir) + 1);
    if (strlen(a->shared_dir) >= sizeof(sc->shared_dir)) {
        snprintf(err, errlen, "the shared directory's path is too long");
        return -1;
    }
    memcpy(sc->shared_dir, a->shared_dir, strlen(a->shared_dir) + 1);
    if (strcmp(a->launch.launcher, "slurm") == 0 && !a->shared_dir[0])
        log_warn("--launcher slurm: the ranks read and write the job directories under %s/jobs "
                 "(checkpoints, heartbeats); every node must see them at that path (or give "
                 "--shared-dir)",
                 a->data_dir);
    sc->nroots = a->nroots;
    for (int i = 0; i < a->nroots; i++)
        snprintf(sc->roots[i], sizeof(sc->roots[i]), "%s", a->roots[i]);
    sc->max_running = a->max_running;
    sc->max_retries = a->max_retries;
    sc->launch = a->launch;
    sc->preempt = !a->no_preempt;
    sc->worker_timeout_s = a->worker_timeout_s;
    sc->stall_timeout_s = a->stall_timeout_s;
    return 0;
}

static int api_config_fill(const serve_args *a, api_config *ac, char *err, size_t errlen)
{
    memset(ac, 0, sizeof(*ac));
    if (strlen(a->web_root) >= sizeof(ac->web_root)) {
        snprintf(err, errlen, "the dashboard's path %s is too long", a->web_root);
        return -1;
    }
    memcpy(ac->web_root, a->web_root, strlen(a->web_root) + 1);
    snprintf(ac->listen, sizeof(ac->listen), "%s", a->listen);
    snprintf(ac->token, sizeof(ac->token), "%s", a->token);
    ac->max_body = 1 << 20;
    ac->metrics_keep_s = a->metrics_keep_s;
    ac->head_timeout_s = a->head_timeout_s;
    ac->max_per_addr = a->max_per_addr;
    ac->nallow_hosts = a->nallow_hosts;
    memcpy(ac->allow_hosts, a->allow_hosts, sizeof(ac->allow_hosts));
    ac->nallow_origins = a->nallow_origins;
    memcpy(ac->allow_origins, a->allow_origins, sizeof(ac->allow_origins));
    ac->spec.nroots = a->nroots;
    for (int i = 0; i < a->nroots; i++)
        snprintf(ac->spec.roots[i], sizeof(ac->spec.roots[i]), "%s", a->roots[i]);
    return 0;
}

/* Raise the open-file soft limit to the hard limit: every connection is a descriptor, and the
 * server's connection cap follows from the limit. *was becomes the soft limit before (the
 * one workers get back), 0 when it was not changed. */
static void raise_nofile(unsigned long *was)
{
    struct rlimit rl;
    rlim_t before;

    *was = 0;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max)
        return;
    before = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
        log_warn("cannot raise the open-file limit from %llu to its hard limit: %s",
                 (unsigned long long)before, strerror(errno));
        return;
    }
    *was = (unsigned long)before;
}

/* Lock the data directory, then the database (lock.h); -1 with err when either is held by
 * another daemon or cannot be locked. *dir_fd and *db_fd hold the locks. */
static int take_locks(const serve_args *a, int *dir_fd, int *db_fd, char *err, size_t errlen)
{
    char path[PATH_MAX + 16], what[PATH_LEN + 32], why[PATH_MAX + PATH_LEN * 2], real[PATH_MAX];

    snprintf(path, sizeof(path), "%s/ampd.lock", a->data_dir);
    snprintf(what, sizeof(what), "the data directory %s", a->data_dir);
    if (daemon_lock_take(path, what, dir_fd, why, sizeof(why)) != 0) {
        snprintf(err, errlen, "%.3900s: stop it, or give this daemon another --data-dir", why);
        return -1;
    }
    /* beside the file itself, so that a symlink to the database is the same database */
    snprintf(path, sizeof(path), "%s.lock", realpath(a->db, real) ? real : a->db);
    snprintf(what, sizeof(what), "the database %s", a->db);
    if (daemon_lock_take(path, what, db_fd, why, sizeof(why)) != 0) {
        snprintf(err, errlen, "%.3900s: stop it, or give this daemon another --db", why);
        return -1;
    }
    return 0;
}

/* The URL clients use: the listen address with the bound port. */
static void url_of(const char *listen, unsigned port, char *out, size_t len)
{
    char host[128];
    const char *colon = strrchr(listen, ':');
    size_t n = colon ? (size_t)(colon - listen) : strlen(listen);
    if (n >= sizeof(host))
        n = sizeof(host) - 1;
    memcpy(host, listen, n);
    host[n] = '\0';
    snprintf(out, len, "http://%s:%u", host, port);
}

/* The token read, the data directory created and made absolute, the database's default
 * path, the data roots made absolute (a root that cannot be is kept as given, with a
 * warning); -1 with err. */
static int resolve_paths(serve_args *a, char *err, size_t errlen)
{
    char abs[PATH_MAX];
    if (a->token_file[0] && read_token(a->token_file, a->token, sizeof(a->token), err, errlen))
        return -1;
    if (daemon_mkdirs(a->data_dir, 0700) != 0 || !realpath(a->data_dir, abs)) {
        snprintf(err, errlen, "cannot create the data directory %s: %s", a->data_dir,
                 strerror(errno));
        return -1;
    }
    if (strlen(abs) >= sizeof(a->data_dir)) {
        snprintf(err, errlen, "the data directory's path is too long");
        return -1;
    }
    memcpy(a->data_dir, abs, strlen(abs) + 1);
    if (!a->db[0] &&
        snprintf(a->db, sizeof(a->db), "%s/ampd.db", a->data_dir) >= (int)sizeof(a->db)) {
        snprintf(err, errlen, "the database path is too long");
        return -1;
    }
    for (int i = 0; i < a->nroots; i++)
        if (realpath(a->roots[i], abs) && strlen(abs) < sizeof(a->roots[i]))
            memcpy(a->roots[i], abs, strlen(abs) + 1);
        else
            log_warn("data root %s: %s", a->roots[i], strerror(errno));
    return 0;
}

/* The log lines that say the daemon serves: where, with what, and the dashboard. */
static void log_serving(const serve_args *a, const char *url, const char *nodash)
{
    char why[256];
    if (gpu_cuda_probe(why, sizeof(why)) == 0)
        snprintf(why, sizeof(why), "CUDA device available");
    log_info("ampd %s serving %s (db %s, data dir %s, blas %s, device: %s, max running %d%s)",
             PACKAGE_VERSION, url, a->db, a->data_dir, gpu_blas_info(), why, a->max_running,
             a->token[0] ? ", token required" : "");
    log_info("gemm: fp32 %s; fp16 %s; bf16 %s", gpu_gemm_info(GPU_FP32),
             gpu_gemm_info(GPU_FP16), gpu_gemm_info(GPU_BF16));
    if (a->web_root[0])
        log_info("dashboard: %s/ (files from %s)", url, a->web_root);
    else
        log_info("dashboard: not served (%s)", nodash);
}

/* Wait for SIGTERM or SIGINT (blocked in set), then let a second SIGINT kill at once. */
static void wait_for_stop(sigset_t *set)
{
    int sig = 0;
    while (sigwait(set, &sig) != 0 || (sig != SIGTERM && sig != SIGINT))
        ;
    log_info("%s: stopping (running jobs checkpoint; a second Ctrl-C kills at once)",
             sig == SIGTERM ? "SIGTERM" : "SIGINT");
    sigemptyset(set);
    sigaddset(set, SIGINT);
    signal(SIGINT, SIG_DFL);
    pthread_sigmask(SIG_UNBLOCK, set, NULL);
}

/* `ampd serve`; see daemon.h. Returns the exit status. */
int daemon_serve_main(int argc, char **argv)
{
    serve_args a;
    daemon_sched_config sc;
    api_config ac;
    api_jobs jobs;
    store *st = NULL;
    daemon_sched *sched = NULL;
    daemon_machine *machine = NULL;
    api_server *api = NULL;
    char err[4096] = "", url[200], nodash[512] = "";
    sigset_t set;
    int rc, dir_lock = -1, db_lock = -1;

    rc = parse_args(argc, argv, &a);
    if (rc)
        return rc == 1 ? 0 : rc;
    if (resolve_paths(&a, err, sizeof(err)) != 0 ||
        take_locks(&a, &dir_lock, &db_lock, err, sizeof(err)) != 0)
        goto startup_error;
    if (sched_config(&a, &sc, err, sizeof(err)) != 0 ||
        find_web_root(&a, nodash, sizeof(nodash), err, sizeof(err)) != 0 ||
        api_config_fill(&a, &ac, err, sizeof(err)) != 0 ||
        daemon_machine_new(a.cpus, a.devices, a.share_devices, &machine, err, sizeof(err)) != 0)
        goto startup_error;
    sc.machine = machine;
    daemon_machine_set_slurm(machine, strcmp(a.launch.launcher, "slurm") == 0);

    raise_nofile(&sc.nofile_child);

    /* Before any thread exists: every thread inherits this mask. */
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    /* Loading BLAS may setenv (its kernel choice): do it before any thread exists. */
    gpu_blas_init(1);
    if (store_open(a.db, &st) != 0) {
        snprintf(err, sizeof(err), "cannot open the database %s (see the log above)", a.db);
        goto startup_error;
    }
    if (daemon_sched_start(st, &sc, &sched) != 0) {
        snprintf(err, sizeof(err), "cannot start the scheduler (see the log above)");
        goto startup_error;
    }
    daemon_sched_api(sched, &jobs);
    if (api_start(&ac, st, &jobs, &api, err, sizeof(err)) != 0) {
        if (!err[0])
            snprintf(err, sizeof(err), "cannot listen on %s", a.listen);
        goto startup_error;
    }
    if (a.port_file[0] && write_port_file(a.port_file, api_port(api)) != 0) {
        snprintf(err, sizeof(err), "cannot write the port file %s: %s", a.port_file,
                 strerror(errno));
        goto startup_error;
    }
    url_of(a.listen, api_port(api), url, sizeof(url));
    if (a.demo)
        queue_demo(st, sched, &ac);
    log_serving(&a, url, nodash);
    log_info("machine: %s", daemon_machine_summary(machine));

    wait_for_stop(&set);
    rc = api_stop(api);
    daemon_sched_stop(sched);
    if (rc == 0) {
        daemon_machine_free(machine); /* else a busy handler may still read it */
        store_close(st);
    } else {
        /* a request handler is still busy and may read the store: commit what is queued,
         * leave the connections open, and exit */
        store_flush(st);
        log_warn("exiting with a request still in progress");
    }
    daemon_lock_release(db_lock);
    daemon_lock_release(dir_lock);
    log_info("stopped");
    return 0;

startup_error:
    fprintf(stderr, "ampd serve: %s\n", err);
    api_stop(api);
    daemon_sched_stop(sched);
    daemon_machine_free(machine);
    store_close(st);
    daemon_lock_release(db_lock);
    daemon_lock_release(dir_lock);
    return 1;
}
