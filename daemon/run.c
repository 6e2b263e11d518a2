/*
 * run.c - `ampd run JOB.json`: validate a job spec, train it in the foreground and print
 * one JSON line per step, eval lines and a final summary on stdout (logs go to stderr).
 * The start line names the device the job runs on ("cpu" or "cuda:N (...)"); a CUDA device
 * that cannot be used fails the job with the reason. A step that collected per-layer
 * diagnostics (every diagnostics_every steps and every overflowing step, or on CUDA the
 * step after it) adds a "layers" line, and each new recommendation an "event" line of kind
 * "recommendation"; --every never suppresses either.
 *
 * Non-finite numbers are written as the strings "NaN", "Infinity" and "-Infinity", never
 * dropped. SIGINT/SIGTERM stop the loop after the current step; the summary then says
 * "interrupted".
 *
 * Checkpoints (--checkpoint-dir): every checkpoint_every steps, at the end and on a stop
 * signal, then the retention (checkpoints.keep_last, checkpoints.keep_best; daemon/ckpt.h)
 * drops the ones it does not keep: each is deleted, or with --no-delete left for the caller
 * (the daemon deletes it once it has recorded the newer checkpoint), and named in a
 * "checkpoint_drop" line. --resume walks back to the newest checkpoint that verifies
 * (daemon_ckpt_resume), says in the "resume" line which it used and why it skipped the
 * others, and starts from step 0 when none does; when it resumes in the checkpoint
 * directory, the files after the step it continues from are dropped (those steps are trained
 * again), and the retention starts from the files up to it. --branch-from starts a branch
 * from exactly the checkpoint given (its parent's), failing when that one does not verify.
 *
 * Data parallelism: a job with distributed.world_size N > 1 started by hand or by the daemon
 * starts its N ranks under mpirun (ranks.c) and supervises them; each rank is this same
 * command under mpirun. Rank 0 prints the lines and writes the checkpoints; the other ranks'
 * stdout goes to /dev/null and their log lines carry "rank N". A stop (SIGINT, SIGTERM, or
 * SIGUSR1 from mpirun) is voted on after every step, so every rank stops after the same one.
 *
 * Threads: the calling thread only (BLAS has its own).
 */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api/api.h"
#include "daemon/beat.h"
#include "daemon/ckpt.h"
#include "daemon/daemon.h"
#include "daemon/line.h"
#include "daemon/log.h"
#include "daemon/opts.h"
#include "daemon/ranks.h"
#include "daemon/remedy.h"

#define SPEC_MAX_BYTES (1 << 20)

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

/* This rank's heartbeat (a supervised rank of a data-parallel job; NULL otherwise). */
static daemon_beat *beat;
/* Rank 0 of several: every rank's host (HOST_LEN bytes each) and the straggler watch. */
#define HOST_LEN 64
static char *hosts;
static int nhosts;
static daemon_straggle *straggle;

static const char *rank_host(int r)
{
    return hosts && r >= 0 && r < nhosts ? hosts + (size_t)r * HOST_LEN : "?";
}

typedef struct {
    const char *path;
    const char *ckpt_dir; /* --checkpoint-dir: NULL for none */
    const char *resume;   /* --resume: a checkpoint file or directory, or NULL */
    const char *branch_from; /* --branch-from: a checkpoint file of the parent job, or NULL */
    const char *branch_reset; /* --branch-reset: what starts anew ("loss_scale"), or NULL */
    bool no_delete;       /* --no-delete: dropped checkpoints are left for the caller */
    int every;            /* --every: every Nth step line is printed */
    int roots_given;      /* --data-root options read */
    int64_t profile;      /* --profile: the step to profile, 0 for none */
    const char *device;   /* --device: instead of the spec's (the daemon's placement) */
    daemon_launch_opts launch; /* --launcher, --slurm-*: where the spec leaves them open */
    api_spec_opts opts;
} run_args;

/* One layer of a "layers" line: its name, dtype and the store's layer fields, in the
 * store's order (STORE_LAYER_FIELDS; gpu_layer_stat has a member of each name). */
#define LAYER_REAL(v) api_json_num(v)
#define LAYER_COUNT(v) json_integer((json_int_t)(v))
static json_t *layer_json(const gpu_layer_stat *l)
{
    json_t *o = json_pack("{s:s, s:s}", "name", l->name, "dtype",
                          l->fp8 ? "fp8" : gpu_dtype_name(l->dtype));
    /* the fp8 fields (since 9) are an fp8 layer's only: the others do not report them */
#define LAYER_FIELD_(id, field, kind, since)                                                       \
    if (since < 9 || l->fp8)                                                                       \
        json_object_set_new(o, #field, LAYER_##kind(l->field));
    STORE_LAYER_FIELDS(LAYER_FIELD_)
#undef LAYER_FIELD_
    return o;
}

/* The "layers" line of a diagnosed step and an "event" line per new recommendation, with
 * its remedy when it has one (daemon/remedy.h). Returns the step when a remedy for a
 * problem that stops the run was among them, else 0. */
static int64_t emit_diagnostics(const gpu_job_config *c, gpu_trainer *t, const gpu_step_metrics *m)
{
    const gpu_layer_stat *ls;
    const gpu_recommendation *recs;
    const char *first, *where;
    int n, nrecs;
    int64_t problem = 0;
    if (m->diagnosed && gpu_trainer_diagnostics(t, &ls, &n, &first, &where) == 0) {
        json_t *arr = json_array();
        for (int i = 0; i < n; i++)
            json_array_append_new(arr, layer_json(&ls[i]));
        json_t *fn = first ? json_pack("{s:s, s:s}", "layer", first, "where", where) : json_null();
        const char *hit[64];
        int nhit = gpu_trainer_comm_overflow(t, hit, 64);
        if (fn && nhit > 0) { /* where: "comm", with the tensors the all-reduce made inf/NaN */
            json_t *names = json_array();
            for (int i = 0; i < nhit; i++)
                json_array_append_new(names, json_string(hit[i]));
            json_object_set_new(fn, "tensors", names);
        }
        daemon_line_emit(json_pack("{s:s, s:I, s:o, s:o, s:o}", "type", "layers", "step",
                                   (json_int_t)m->step, "scale", api_json_float(m->loss_scale),
                                   "first_nonfinite", fn, "layers", arr));
    }
    gpu_trainer_recommendations(t, &recs, &nrecs);
    for (int i = 0; i < nrecs; i++) {
        json_t *line = json_pack("{s:s, s:I, s:s, s:o, s:s}", "type", "event", "step",
                                 (json_int_t)m->step, "kind", "recommendation", "layer",
                                 recs[i].layer ? json_string(recs[i].layer) : json_null(),
                                 "message", recs[i].message);
        json_t *remedy = daemon_remedy(c, &recs[i]);
        if (json_is_true(json_object_get(remedy, "acts")) && problem == 0) {
            /* the branch starts before the step, or at or before step - rewind */
            int64_t rewind = json_integer_value(json_object_get(remedy, "rewind"));
            problem = rewind > 0 ? m->step - rewind + 1 : m->step;
            if (problem < 1)
                problem = 1;
        }
        if (line && remedy)
            json_object_set_new(line, "remedy", remedy);
        else
            json_decref(remedy);
        daemon_line_emit(line);
    }
    return problem;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int64_t n)
{
    if (n == 0)
        return NAN;
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int every_arg(void *args, const char *v)
{
    run_args *a = args;
    a->every = atoi(v);
    if (a->every < 1) {
        fprintf(stderr, "ampd run: --every must be a positive integer\n");
        return -1;
    }
    return 0;
}

/* One more --data-root: the first one replaces the default roots. */
static int root_arg(void *args, const char *v)
{
    run_args *a = args;
    if (a->roots_given >= API_MAX_ROOTS) {
        fprintf(stderr, "ampd run: at most %d --data-root options\n", API_MAX_ROOTS);
        return -1;
    }
    snprintf(a->opts.roots[a->roots_given++], sizeof(a->opts.roots[0]), "%s", v);
    a->opts.nroots = a->roots_given;
    return 0;
}

static int profile_arg(void *args, const char *v)
{
    run_args *a = args;
    char *end;
    long long x;
    errno = 0;
    x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < 1) {
        fprintf(stderr, "ampd run: --profile needs a step number >= 1, not '%s'\n", v);
        return -1;
    }
    a->profile = x;
    return 0;
}

/* `ampd run`'s options: the parser and the help read this table. */
static const daemon_opt run_opts[] = {
    {"every", 'e', "N", .kind = DAEMON_OPT_INT, .off = offsetof(run_args, every), .def = 1,
     .set = every_arg, .help = "print every Nth step line (default %s)"},
    {"data-root", 'd', "DIR", .kind = DAEMON_OPT_CALL, .repeat = true, .set = root_arg,
     .show = daemon_opts_show_roots,
     .help = "where named datasets are found (repeatable;\ndefault %s)"},
    {"checkpoint-dir", 'c', "DIR", .kind = DAEMON_OPT_PTR, .off = offsetof(run_args, ckpt_dir),
     .help = "write ckpt-<step>.safetensors every checkpoint_every\nsteps, at the end and when "
             "stopped by a signal; keep\ncheckpoints.keep_last (+ keep_best, + the last "
             "healthy)"},
    {"resume", 'r', "CKPT|DIR", .kind = DAEMON_OPT_PTR, .off = offsetof(run_args, resume),
     .help = "continue from a checkpoint of the same job: the newest\none that verifies, CKPT "
             "or older (step 0 when none)"},
    {"branch-from", 'B', "CKPT", .kind = DAEMON_OPT_PTR, .off = offsetof(run_args, branch_from),
     .help = "start a branch from exactly this checkpoint of another\njob (its parent), with "
             "this spec's changes"},
    {"branch-reset", 'R', "WHAT", .kind = DAEMON_OPT_PTR, .off = offsetof(run_args, branch_reset),
     .help = "with --branch-from: \"loss_scale\" starts the loss scaler\nanew from this "
             "spec's settings instead of carrying\nits state over"},
    {"no-delete", 'n', NULL, .kind = DAEMON_OPT_FLAG, .off = offsetof(run_args, no_delete),
     .help = "name the checkpoints the retention drops in\n\"checkpoint_drop\" lines, without "
             "deleting them"},
    {"profile", 'p', "STEP", .kind = DAEMON_OPT_CALL, .set = profile_arg,
     .help = "time step STEP phase by phase (attention, linears,\noptimizer...) and print a "
             "\"profile\" line after it"},
    {"device", 'D', "DEV", .kind = DAEMON_OPT_PTR, .off = offsetof(run_args, device),
     .help = "train on DEV instead of the spec's device (the daemon's\nplacement: \"cpu\", or "
             "\"cuda:0\" and \"cuda\" within\nCUDA_VISIBLE_DEVICES)"},
    DAEMON_LAUNCH_OPTS(run_args, launch),
    {"help", 'h', NULL, .kind = DAEMON_OPT_HELP},
};

static const daemon_opts_cmd run_cmd = {
    .name = "run",
    .opts = run_opts,
    .nopts = (int)(sizeof(run_opts) / sizeof(run_opts[0])),
    .list_options = true,
    .operands = "JOB.json|-",
    .about = "  Train the job in the foreground; one JSON line per step on stdout.\n",
    .col = 24,
};

/* --device: the spec's device checked the spec's way, then replaced. */
static int override_device(gpu_job_config *c, const char *dev, api_error *e)
{
    int rc = api_spec_device(dev, c, e);
    if (rc)
        snprintf(e->field, sizeof(e->field), "--device");
    return rc;
}

static int parse_args(int argc, char **argv, run_args *a)
{
    int first, rc;
    memset(a, 0, sizeof(*a));
    api_spec_opts_default(&a->opts);
    rc = daemon_opts_parse(&run_cmd, argc, argv, a, &first);
    if (rc == DAEMON_OPTS_HELP) {
        daemon_opts_usage(stdout, &run_cmd);
        return 1;
    }
    if (rc == DAEMON_OPTS_BAD)
        return 2;
    if (rc != DAEMON_OPTS_OK || first != argc - 1) {
        daemon_opts_usage(stderr, &run_cmd);
        return 2;
    }
    if (a->branch_reset && !a->branch_from) {
        fprintf(stderr, "ampd run: --branch-reset goes with --branch-from\n");
        return 2;
    }
    if (a->resume && a->branch_from) {
        fprintf(stderr, "ampd run: --resume and --branch-from exclude each other (a branch "
                        "resumes from its own checkpoints once it has some)\n");
        return 2;
    }
    a->path = argv[first];
    return 0;
}

/* Read the whole spec file (or stdin for "-"); caller frees *out. */
static int read_spec(const char *path, char **out, size_t *len)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    char *buf = NULL;
    size_t n = 0;
    if (!f) {
        fprintf(stderr, "ampd run: %s: %s\n", path, strerror(errno));
        return -1;
    }
    buf = malloc(SPEC_MAX_BYTES + 1);
    if (buf)
        n = fread(buf, 1, SPEC_MAX_BYTES + 1, f);
    if (f != stdin)
        fclose(f);
    if (!buf || n > SPEC_MAX_BYTES) {
        fprintf(stderr, "ampd run: %s: larger than %d bytes\n", path, SPEC_MAX_BYTES);
        free(buf);
        return -1;
    }
    *out = buf;
    *len = n;
    return 0;
}

static void print_spec_error(const api_error *e)
{
    json_t *o = json_pack("{s:{s:s, s:s, s:s}}", "error", "code", e->code, "field", e->field,
                          "message", e->message);
    char *s = json_dumps(o, JSON_COMPACT);
    fprintf(stderr, "%s\n", s ? s : "invalid spec");
    free(s);
    json_decref(o);
}

/* Say which backend a job with device "auto" got (the trainer chose it: CUDA device 0 when
 * gpu_cuda_probe finds one usable, else the CPU, and then the probe's reason). */
static void log_device(const gpu_job_config *c, const gpu_trainer *t)
{
    char why[256];
    if (strcmp(c->device, "auto") != 0)
        return;
    if (strncmp(gpu_trainer_device(t), "cpu", 3) != 0) {
        log_info("device auto: using the CUDA backend, %s", gpu_trainer_device(t));
        return;
    }
    if (strcmp(gpu_trainer_device(t), "cpu") != 0) { /* "cpu (CUDA unusable: ...)" */
        log_warn("device auto: using the CPU backend %s", gpu_trainer_device(t) + 4);
        return;
    }
    (void)gpu_cuda_probe(why, sizeof(why));
    log_info("device auto: using the CPU backend (%s)", why);
}

typedef struct {
    double *times;
    int64_t ntimes, cap;
    gpu_step_metrics last;
    bool stepped; /* last holds a step of this run */
    gpu_eval_result eval;
    int have_eval;
    int64_t eval_step;
    daemon_ckpt_info *kept; /* the checkpoint directory's files the retention manages */
    int nkept, capkept;
    int64_t problem_step; /* the first step a remedy for a problem that stops the run was
                           * given at (0: none): the retention keeps the newest checkpoint
                           * before it, where a branch with the remedy starts */
} run_state;

static void emit_eval(gpu_trainer *t, run_state *s, int64_t step)
{
    if (gpu_trainer_eval(t, &s->eval) != 0)
        return;
    s->have_eval = 1;
    s->eval_step = step;
    daemon_line_emit(daemon_line_eval(step, &s->eval));
}

static void emit_summary(const gpu_job_config *c, gpu_trainer *t, run_state *s, const char *status,
                         const char *error)
{
    const gpu_scaler_state *sc = t ? gpu_trainer_scaler(t) : NULL;
    double med = median(s->times, s->ntimes);
    json_t *o =
        json_pack("{s:s, s:s, s:s, s:s, s:I}", "type", "summary", "name", c->name, "status", status,
                  "dtype", gpu_job_dtype_name(c), "steps", (json_int_t)s->last.step);
    if (error)
        json_object_set_new(o, "error", json_string(error));
    if (sc) {
        json_object_set_new(o, "final_loss", api_json_num(s->last.loss));
        json_object_set_new(o, "final_loss_scale", api_json_float(sc->scale));
        json_object_set_new(o, "overflow_total", json_integer(sc->overflow_total));
        json_object_set_new(o, "skipped_total", json_integer(sc->skipped_total));
        json_object_set_new(o, "lost_updates_total", json_integer(s->last.lost_total));
        json_object_set_new(o, "params", json_integer(gpu_trainer_params(t)));
        json_object_set_new(o, "median_step_ms", api_json_num(med));
        json_object_set_new(o, "samples_per_s", api_json_num(c->batch_size / (med * 1e-3)));
        json_object_set_new(o, "peak_mem", daemon_line_mem(&s->last.peak));
    }
    if (s->have_eval) {
        json_object_set_new(o, "eval_loss", api_json_num(s->eval.loss));
        json_object_set_new(o, "eval_acc", api_json_num(s->eval.accuracy));
    }
    daemon_line_emit(o);
}

static void record_time(run_state *s, double ms)
{
    if (s->ntimes == s->cap) {
        int64_t cap = s->cap ? s->cap * 2 : 1024;
        double *p = cap <= (1 << 24) ? realloc(s->times, sizeof(double) * (size_t)cap) : NULL;
        if (!p)
            return;
        s->times = p;
        s->cap = cap;
    }
    s->times[s->ntimes++] = ms;
}

/* The start line; a sequence set's "data" says the unigram level its loss and accuracy
 * start from (gpu_dataset_unigram): the plateau the daemon and the dashboard name. "spec"
 * stays the line's last member (scripts cut it out of the text). */
static void emit_start(const gpu_job_config *c, gpu_trainer *t)
{
    json_t *spec = api_spec_to_json(c);
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:s, s:s, s:s}", "type", "start", "name",
                          c->name, "params", (json_int_t)gpu_trainer_params(t), "device",
                          gpu_trainer_device(t), "blas", gpu_blas_info(), "gemm",
                          gpu_gemm_info(c->dtype), "convert", gpu_cvt_impl());
    double h, top;
    if (o && gpu_trainer_unigram(t, &h, &top) == 0)
        json_object_set_new(o, "data", json_pack("{s:f, s:f}", "unigram_entropy", h,
                                                 "unigram_top_freq", top));
    if (o)
        json_object_set_new(o, "spec", spec ? spec : json_null());
    else
        json_decref(spec);
    daemon_line_emit(o);
}

/* Drop the checkpoint of step in the checkpoint directory: delete it (unless --no-delete)
 * and print its "checkpoint_drop" line. */
static void drop(const run_args *a, int64_t step, const char *reason)
{
    char path[1100];
    bool deleted = false;
    daemon_ckpt_path(a->ckpt_dir, step, path, sizeof(path));
    if (!a->no_delete) {
        deleted = unlink(path) == 0;
        if (!deleted && errno != ENOENT)
            log_warn("cannot delete %s: %s", path, strerror(errno));
    }
    log_debug("checkpoint %s dropped (%s)", path, reason);
    daemon_line_emit(json_pack("{s:s, s:I, s:s, s:s, s:b}", "type", "checkpoint_drop", "step",
                               (json_int_t)step, "path", path, "reason", reason, "deleted",
                               deleted));
}

/* Add a checkpoint to the ones the retention manages; 0 or GPU_ENOMEM. */
static int kept_add(run_state *s, const daemon_ckpt_info *info)
{
    for (int i = 0; i < s->nkept; i++)
        if (s->kept[i].step == info->step) { /* rewritten: the newer file counts */
            s->kept[i] = *info;
            return 0;
        }
    if (s->nkept == s->capkept) {
        int cap = s->capkept ? 2 * s->capkept : 16;
        daemon_ckpt_info *v = realloc(s->kept, sizeof(*v) * (size_t)cap);
        if (!v)
            return GPU_ENOMEM;
        s->kept = v;
        s->capkept = cap;
    }
    s->kept[s->nkept++] = *info;
    return 0;
}

/* Apply the job's retention to the managed checkpoints. */
static void retain(const gpu_job_config *c, const run_args *a, run_state *s)
{
    bool *keep = s->nkept ? malloc(sizeof(*keep) * (size_t)s->nkept) : NULL;
    int m = 0;
    if (!keep || daemon_ckpt_retain(s->kept, s->nkept, c->checkpoint_keep_last,
                                    c->checkpoint_keep_best, s->problem_step, keep) != 0) {
        free(keep); /* out of memory: nothing is dropped this time */
        return;
    }
    for (int i = 0; i < s->nkept; i++) {
        if (keep[i])
            s->kept[m++] = s->kept[i];
        else
            drop(a, s->kept[i].step, "retention");
    }
    s->nkept = m;
    free(keep);
}

/* True when the two paths name the same directory. */
static bool same_dir(const char *x, const char *y)
{
    char rx[4096], ry[4096];
    return realpath(x, rx) && realpath(y, ry) && strcmp(rx, ry) == 0;
}

/* After a resume in the checkpoint directory: the files after the step it continues from
 * are dropped (the skipped ones with their reason), those up to it are managed by the
 * retention (one whose header is damaged is dropped). */
static void seed_kept(const run_args *a, run_state *s, const daemon_ckpt_resumed *res)
{
    int64_t *steps = NULL;
    int n = 0;
    char path[1100], err[600], why[700];
    if (daemon_ckpt_scan(a->ckpt_dir, &steps, &n) != 0)
        return;
    for (int i = 0; i < n; i++) {
        daemon_ckpt_info info;
        const char *reason = NULL;
        if (steps[i] > res->step) {
            snprintf(why, sizeof(why), "newer than the checkpoint resumed from (step %lld)",
                     (long long)res->step);
            for (int k = 0; k < res->nskipped; k++)
                if (res->skipped[k].step == steps[i])
                    snprintf(why, sizeof(why), "%s", res->skipped[k].reason);
            reason = why;
        } else {
            daemon_ckpt_path(a->ckpt_dir, steps[i], path, sizeof(path));
            if (daemon_ckpt_read_info(path, &info, err, sizeof(err)) != 0) {
                snprintf(why, sizeof(why), "%s", err);
                reason = why;
            } else if (kept_add(s, &info) != 0) {
                break;
            }
        }
        if (reason)
            drop(a, steps[i], reason);
    }
    free(steps);
}

/* Save a checkpoint, print its line and apply the retention; 0 or an error with err
 * filled. */
static int checkpoint(const gpu_job_config *c, const run_args *a, gpu_trainer *t, run_state *s,
                      char *err, size_t errlen)
{
    char path[1024];
    daemon_ckpt_info info;
    gpu_state_scalars sc;
    gpu_trainer_get_scalars(t, &sc);
    memset(&info, 0, sizeof(info));
    info.has_loss = s->stepped && s->last.step == sc.step;
    info.loss = s->last.loss;
    info.has_eval = s->have_eval && s->eval_step == sc.step;
    info.eval_loss = s->eval.loss;
    int rc = daemon_ckpt_save(t, a->ckpt_dir, &info, path, sizeof(path), err, errlen);
    if (rc)
        return rc;
    daemon_line_emit(json_pack("{s:s, s:I, s:s, s:I, s:b}", "type", "checkpoint", "step",
                               (json_int_t)info.step, "path", path, "bytes", (json_int_t)info.bytes,
                               "healthy", daemon_ckpt_healthy(&info)));
    if (kept_add(s, &info) == 0)
        retain(c, a, s);
    return 0;
}

/* The profile line of step `step` (gpu_trainer_profile), when it has one. */
static void emit_profile(gpu_trainer *t, int64_t step, double step_ms)
{
    const gpu_profile *p = gpu_trainer_profile(t);
    if (p == NULL)
        return;
    json_t *phases = json_array();
    double sum = 0.0;
    for (int i = 0; i < p->n; i++) {
        json_array_append_new(phases, json_pack("{s:s, s:o, s:i}", "name", p->phase[i].name,
                                                "ms", api_json_num(p->phase[i].ms), "calls",
                                                p->phase[i].calls));
        sum += p->phase[i].ms;
    }
    daemon_line_emit(json_pack("{s:s, s:I, s:s, s:o, s:o, s:o}", "type", "profile", "step",
                               (json_int_t)step, "device", gpu_trainer_device(t), "step_ms",
                               api_json_num(step_ms), "phases_ms", api_json_num(sum), "phases",
                               phases));
}

/* Rank 0 of several: the straggler watch (beat.h) fed with the step's busy times; an event
 * line when a rank begins or ends straggling, naming its host. */
static void watch_stragglers(gpu_trainer *t, int64_t step)
{
    const double *busy;
    int n = gpu_trainer_rank_busy(t, &busy), rank = 0, verdict;
    double ratio = 0;
    char msg[400];
    if (n < 2 || (!straggle && !(straggle = daemon_straggle_new(n))))
        return;
    if (!(verdict = daemon_straggle_add(straggle, busy, &rank, &ratio)))
        return;
    if (verdict > 0)
        snprintf(msg, sizeof(msg),
                 "rank %d on %s straggles: its steps' work (without waiting "
                 "for the all-reduce) took %.2fx the median rank's over each of the last %d "
                 "windows of %d steps; the others wait for it",
                 rank, rank_host(rank), ratio, DAEMON_STRAGGLE_WINDOWS, DAEMON_STRAGGLE_WINDOW);
    else
        snprintf(msg, sizeof(msg),
                 "rank %d on %s no longer straggles (%.2fx the median rank's "
                 "work over the last %d steps)",
                 rank, rank_host(rank), ratio, DAEMON_STRAGGLE_WINDOW);
    log_warn("%s", msg);
    daemon_line_emit(json_pack("{s:s, s:I, s:s, s:s}", "type", "event", "step", (json_int_t)step,
                               "kind", "straggler", "message", msg));
}

/* The step loop from the trainer's current step to the end or a stop signal. Returns 0,
 * 1 (failed, err filled) or 130 (interrupted). */
static int loop(const gpu_job_config *c, const run_args *a, gpu_trainer *t, gpu_comm *comm,
                run_state *s, char *err, size_t errlen)
{
    gpu_state_scalars sc;
    bool stop = stop_requested, lead = gpu_comm_rank(comm) == 0;
    gpu_trainer_get_scalars(t, &sc);
    for (int64_t step = sc.step; step < c->steps && !stop; step++) {
        if (step + 1 == a->profile)
            gpu_trainer_profile_next(t);
        int rc = gpu_trainer_step(t, &s->last, err, errlen);
        s->stepped = true;
        record_time(s, s->last.step_ms);
        if (s->last.step % a->every == 0 || rc || s->last.step == c->steps || s->last.overflow)
            daemon_line_emit(daemon_line_step(&s->last));
        if (s->last.step == a->profile)
            emit_profile(t, s->last.step, s->last.step_ms);
        int64_t problem = emit_diagnostics(c, t, &s->last);
        if (problem > 0 && s->problem_step == 0)
            s->problem_step = problem;
        watch_stragglers(t, s->last.step);
        if (rc) {
            if (!err[0])
                snprintf(err, errlen, "%s", gpu_strerror(rc));
            log_error("step %lld: %s", (long long)s->last.step, err);
            return 1;
        }
        if (lead && c->eval_every > 0 && s->last.step % c->eval_every == 0 &&
            s->last.step < c->steps)
            emit_eval(t, s, s->last.step);
        if (lead && a->ckpt_dir && c->checkpoint_every > 0 &&
            s->last.step % c->checkpoint_every == 0 && s->last.step < c->steps &&
            checkpoint(c, a, t, s, err, errlen))
            return 1;
        daemon_beat_progress(beat, s->last.step); /* after its eval and checkpoint, if any */
        stop = stop_requested;
        if (comm && gpu_comm_any(comm, stop, &stop) != 0) {
            snprintf(err, errlen, "%s", gpu_comm_error(comm));
            return 1;
        }
    }
    return stop ? 130 : 0;
}

/* FNV-1a over the trainer's state (weights, optimizer state, data order): equal on every
 * rank of a data-parallel job, which each rank's last log line shows. */
static uint64_t state_hash(gpu_trainer *t)
{
    gpu_state_tensor *v = NULL;
    uint64_t h = 0xcbf29ce484222325ull;
    int n = 0;
    if (gpu_trainer_state(t, &v, &n) != 0)
        return 0;
    for (int i = 0; i < n; i++)
        for (size_t k = 0; k < v[i].bytes; k++)
            h = (h ^ ((const uint8_t *)v[i].data)[k]) * 0x100000001b3ull;
    free(v);
    return h;
}

/* A rank's last word: where it stopped and a hash of its state. */
static void log_rank_end(gpu_trainer *t, gpu_comm *comm)
{
    const gpu_scaler_state *sc = gpu_trainer_scaler(t);
    gpu_state_scalars s;
    gpu_trainer_get_scalars(t, &s);
    log_info("rank %d of %d stopped at step %lld: loss scale %g, skipped %lld, state %016llx",
             gpu_comm_rank(comm), gpu_comm_size(comm), (long long)s.step, (double)sc->scale,
             (long long)sc->skipped_total, (unsigned long long)state_hash(t));
}

/* The "resume" line: the step it continues from, the checkpoint (null: none verified, from
 * step 0) and the ones skipped, newest first, with their reasons; the same in the log. */
static void report_resume(const daemon_ckpt_resumed *res)
{
    json_t *skipped = json_array();
    for (int i = 0; i < res->nskipped; i++) {
        const daemon_ckpt_skip *k = &res->skipped[i];
        log_warn("skipped the checkpoint %s: %s", k->path, k->reason);
        json_array_append_new(skipped, json_pack("{s:o, s:s, s:s}", "step",
                                                 k->step >= 0 ? json_integer(k->step) : json_null(),
                                                 "path", k->path, "reason", k->reason));
    }
    if (res->path[0])
        log_info("resuming from %s (step %lld)%s", res->path, (long long)res->step,
                 res->info.checksummed ? ", checksum verified"
                                       : ": format 1, written before checksums, not verified");
    else
        log_warn("no checkpoint verifies (%d skipped): training from step 0", res->nskipped);
    daemon_line_emit(json_pack("{s:s, s:I, s:o, s:b, s:o}", "type", "resume", "step",
                               (json_int_t)res->step, "path",
                               res->path[0] ? json_string(res->path) : json_null(), "verified",
                               res->path[0] && res->info.checksummed, "skipped", skipped));
}

/* A branch's start, after its parent's checkpoint has loaded: with --branch-reset
 * loss_scale the scaler starts anew from this spec's settings (the parent's scale means
 * nothing under another dtype or scaler). 0 or an error with err filled. */
static int branch_reset(const gpu_job_config *c, const run_args *a, gpu_trainer *t, char *err,
                        size_t errlen)
{
    gpu_state_scalars sc;
    if (!a->branch_reset)
        return 0;
    if (strcmp(a->branch_reset, "loss_scale") != 0) {
        snprintf(err, errlen, "--branch-reset %s: only \"loss_scale\" starts anew",
                 a->branch_reset);
        return GPU_EINVAL;
    }
    gpu_trainer_get_scalars(t, &sc);
    gpu_scaler_init(&sc.scaler, &c->scaler);
    int rc = gpu_trainer_set_scalars(t, &sc);
    if (rc)
        snprintf(err, errlen, "cannot start the loss scaler anew: %s", gpu_strerror(rc));
    return rc;
}

/* The event line of a branch's start: where from, and what did not carry over as it was. */
static void emit_branch_start(const gpu_job_config *c, const run_args *a,
                              const daemon_ckpt_resumed *res)
{
    char msg[700];
    int n = snprintf(msg, sizeof(msg), "branch start: from %s (step %lld)", res->path,
                     (long long)res->step);
    if (a->branch_reset && n > 0 && (size_t)n < sizeof(msg))
        n += snprintf(msg + n, sizeof(msg) - (size_t)n,
                      "; the loss scaler starts anew at %g (%s), its parent's state reset",
                      (double)(c->scaler.mode == GPU_SCALE_NONE ? 1.0f : c->scaler.init_scale),
                      c->scaler.mode == GPU_SCALE_NONE     ? "no loss scaling"
                      : c->scaler.mode == GPU_SCALE_STATIC ? "static"
                                                           : "dynamic");
    if (res->converted > 0 && n > 0 && (size_t)n < sizeof(msg))
        snprintf(msg + n, sizeof(msg) - (size_t)n,
                 "; %d weight tensor(s) converted to %s (master weights %s)", res->converted,
                 c->master_weights || c->dtype == GPU_FP32 ? "fp32" : gpu_dtype_name(c->dtype),
                 c->master_weights ? "on" : "off");
    log_info("%s", msg);
    daemon_line_emit(json_pack("{s:s, s:I, s:s, s:s}", "type", "event", "step",
                               (json_int_t)res->step, "kind", "branch", "message", msg));
}

/* Build the trainer, resumed when a->resume says so; 0 or an error with err filled. */
static int create(const gpu_job_config *c, const run_args *a, gpu_comm *comm, gpu_trainer **t,
                  daemon_ckpt_resumed *res, char *err, size_t errlen)
{
    int rc = gpu_trainer_create(c, t, err, errlen);
    if (!rc && comm)
        rc = gpu_trainer_set_comm(*t, comm, err, errlen);
    if (!rc)
        log_device(c, *t);
    if (rc || (!a->resume && !a->branch_from))
        return rc;
    if (a->branch_from) {
        rc = daemon_ckpt_load_exact(*t, a->branch_from, res, err, errlen);
        return rc ? rc : branch_reset(c, a, *t, err, errlen);
    }
    rc = daemon_ckpt_resume(*t, a->resume, res, err, errlen);
    if (!rc && !res->path[0] && res->touched) { /* none loaded: start from a fresh trainer */
        gpu_trainer_free(*t);
        *t = NULL;
        rc = gpu_trainer_create(c, t, err, errlen);
        if (!rc && comm)
            rc = gpu_trainer_set_comm(*t, comm, err, errlen);
    }
    return rc;
}

/* Train c to the end (one rank of comm's job when comm is not NULL); returns the exit
 * status. */
static int train(const gpu_job_config *c, const run_args *a, gpu_comm *comm)
{
    char err[1024] = "";
    gpu_trainer *t = NULL;
    daemon_ckpt_resumed res;
    run_state s;
    int rc, status;
    bool lead = gpu_comm_rank(comm) == 0;

    memset(&s, 0, sizeof(s));
    memset(&res, 0, sizeof(res));
    rc = create(c, a, comm, &t, &res, err, sizeof(err));
    if (rc) {
        log_error("%s", err);
        emit_summary(c, NULL, &s, "failed", err);
        gpu_trainer_free(t);
        daemon_ckpt_resumed_clear(&res);
        return 1;
    }
    emit_start(c, t);
    const char *asked = getenv("AMPD_GEMM");
    if (asked != NULL && asked[0] != '\0' && strcmp(asked, gpu_gemm_path()) != 0)
        log_warn("AMPD_GEMM=%s: not a GEMM path this machine has; the automatic choice runs",
                 asked);
    if (gpu_guard_on())
        log_info("guard mode: each block between inaccessible pages, checked after every step");
    if (a->resume || a->branch_from)
        report_resume(&res);
    if (lead && a->branch_from)
        emit_branch_start(c, a, &res);
    if (lead && a->ckpt_dir && a->resume && same_dir(a->ckpt_dir, res.dir))
        seed_kept(a, &s, &res);
    daemon_ckpt_resumed_clear(&res);
    status = loop(c, a, t, comm, &s, err, sizeof(err));
    if (comm && status != 1)
        log_rank_end(t, comm);
    /* a finished run evaluates first, so that its last checkpoint carries the eval loss
     * (checkpoints.keep_best); a stopped one saves first */
    if (lead && status == 0)
        emit_eval(t, &s, s.last.step);
    if (status == 0 && gpu_trainer_check(t, err, sizeof(err)) != 0) { /* the evaluations' */
        log_error("%s", err);
        status = 1;
    }
    if (lead && status != 1 && a->ckpt_dir && checkpoint(c, a, t, &s, err, sizeof(err)))
        status = 1;
    if (lead && status == 130)
        emit_eval(t, &s, s.last.step);
    emit_summary(c, t, &s,
                 status == 0     ? "succeeded"
                 : status == 130 ? "interrupted"
                                 : "failed",
                 status == 1 ? err : NULL);
    if (comm && status != 1) {
        /* the other ranks wait for rank 0's checkpoint: mpirun ends the job when a rank
         * leaves with a non-zero status */
        bool failed = false;
        gpu_comm_any(comm, false, &failed);
    }
    free(s.times);
    free(s.kept);
    gpu_trainer_free(t);
    return status;
}

/* After the ranks have joined: every rank's host (kept in hosts); this rank's log tag
 * ("rank 2 n2"); rank 0's "launch" line, RUNNING with the launcher's job and every rank's
 * host. */
static int joined(const gpu_job_config *c, gpu_comm *comm, char *tag, size_t len)
{
    int n = gpu_comm_size(comm), me = gpu_comm_rank(comm);
    hosts = calloc((size_t)n, HOST_LEN);
    nhosts = n;
    const char *id = getenv("SLURM_JOB_ID"), *nodes = getenv("SLURM_JOB_NODELIST");
    bool slurm = c->dist.launcher == GPU_LAUNCH_SLURM;
    if (!hosts || gpu_comm_hosts(comm, hosts, HOST_LEN) != 0) {
        log_error("cannot learn the ranks' hosts: %s", hosts ? gpu_comm_error(comm) : "no memory");
        return -1;
    }
    snprintf(tag, len, "rank %d %s", me, hosts + (size_t)me * HOST_LEN);
    daemon_log_set_tag(tag);
    if (me == 0) {
        json_t *arr = json_array();
        for (int r = 0; r < n; r++)
            json_array_append_new(arr, json_string(hosts + (size_t)r * HOST_LEN));
        daemon_line_emit(json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:o}", "type", "launch",
                                   "launcher", gpu_launcher_name(c->dist.launcher), "job_id",
                                   slurm && id ? id : "", "state", "RUNNING", "reason", "", "nodes",
                                   slurm && nodes ? nodes : "", "hosts", arr));
    }
    return 0;
}

/* One rank of a data-parallel job (under mpirun or srun): join, train, leave. */
static int train_rank(gpu_job_config *c, const run_args *a)
{
    char err[512] = "", tag[96];
    gpu_comm *comm = NULL;
    int rc = gpu_comm_init(&comm, err, sizeof(err)), status;
    if (rc) {
        log_error("cannot join the job's ranks: %s", err);
        return 1;
    }
    if (a->ckpt_dir && daemon_beat_start(a->ckpt_dir, gpu_comm_rank(comm), &beat) != 0)
        log_warn("no heartbeat for the launcher (%s/rank-%d.beat): %s", a->ckpt_dir,
                 gpu_comm_rank(comm), strerror(errno));
    if (beat && daemon_beat_wait_all(a->ckpt_dir, gpu_comm_size(comm),
                                     30.0 + 2.0 * gpu_comm_size(comm)) != 0)
        log_warn("not every rank has started after %.0f s; going on (the launcher ends the job "
                 "if one never does)",
                 30.0 + 2.0 * gpu_comm_size(comm));
    if (joined(c, comm, tag, sizeof(tag)) != 0) {
        free(hosts);
        hosts = NULL;
        daemon_beat_stop(beat);
        beat = NULL;
        gpu_comm_abandon(comm);
        return 1;
    }
    if (gpu_comm_rank(comm) != 0 && !freopen("/dev/null", "w", stdout))
        log_warn("cannot silence stdout: %s", strerror(errno));
    if (c->threads == 0) { /* share the cores this process may use between its ranks */
        cpu_set_t set;
        long cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                                   : sysconf(_SC_NPROCESSORS_ONLN);
        int per = (int)(cores > 0 ? cores : 1) / gpu_comm_local_size(comm);
        c->threads = per > 0 ? per : 1;
    }
    status = train(c, a, comm);
    daemon_beat_stop(beat);
    beat = NULL;
    daemon_straggle_free(straggle);
    straggle = NULL;
    free(hosts);
    hosts = NULL;
    if (status == 1) /* the others may wait for this rank: leave without MPI_Finalize */
        gpu_comm_abandon(comm);
    else
        gpu_comm_free(comm);
    return status;
}

/* `ampd run`; see daemon.h. */
int daemon_run_main(int argc, char **argv)
{
    run_args a;
    api_error e;
    gpu_job_config c;
    char *text = NULL;
    size_t len = 0;
    struct sigaction sa;

    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc == 1 ? 0 : rc;
    if (read_spec(a.path, &text, &len) != 0)
        return 2;
    rc = api_spec_parse(text, len, &a.opts, &c, &e);
    if (rc == 0 && a.device)
        rc = override_device(&c, a.device, &e);
    if (rc == 0)
        daemon_launch_apply(&a.launch, &c.dist);
    if (rc == 0 && (c.dist.world_size > 1 || c.dist.launcher == GPU_LAUNCH_SLURM) &&
        !gpu_comm_launched()) {
        rc = daemon_ranks_launch(&c, argc, argv, text, len, a.ckpt_dir);
        free(text);
        return rc;
    }
    free(text);
    if (rc) {
        print_spec_error(&e);
        return 2;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL); /* mpirun passes the supervisor's stop on as SIGUSR1 */
    if (c.dist.world_size == 1 && c.dist.launcher != GPU_LAUNCH_SLURM)
        return train(&c, &a, NULL);
    return train_rank(&c, &a);
}
