/*
 * sched.c - the scheduler and worker supervision (contract in sched.h).
 *
 * A worker is an `ampd run` child process, started by daemon_spawn (spawn.h) as cfg.exe with
 *   run --every 1 --checkpoint-dir <shared_dir>/jobs/<id> [--resume CKPT | --branch-from
 *       CKPT (a branch's first start: its parent's checkpoint)] [--data-root R]...
 *       [--launcher L --slurm-...] <shared_dir>/jobs/<id>/spec.json
 * in its own process group (shared_dir: the data directory unless --shared-dir), stdin
 * /dev/null, stdout a pipe to the scheduler, stderr appended to
 * <shared_dir>/jobs/<id>/worker.log, every other descriptor closed, every signal
 * disposition back to the default (signals blocked across the fork until then), an empty
 * signal mask, the open-file soft limit the daemon started with (cfg.nofile_child: ampd
 * serve raises its own for connections; programs that use select() want the usual one),
 * and PR_SET_PDEATHSIG(SIGKILL) so that a worker never outlives a daemon killed with -9
 * (the scheduler thread that forks it lives until every worker is reaped, so the death
 * signal only fires when the daemon process dies).
 *
 * The scheduler thread polls the worker pipes and a self-pipe (submit, cancel, resume and
 * stop write a byte) with a 200 ms timeout and hands a readable worker to ingest.c, which
 * turns its lines into store writes (worker.h), READ_TURN_BYTES of them a turn at most: a
 * worker that writes faster than the daemon reads must not keep the turn from ending (the
 * queue's plan, cancels and the other workers' timers all wait for it).
 * Children are reaped with waitpid(WNOHANG) each turn (no SIGCHLD handler). A worker's job
 * ends after it has exited and its pipe is drained: the store is flushed, the lifecycle
 * event written, then the status (succeeded / failed with the reason and the log's last
 * lines / cancelled / interrupted), which ends the job's stream.
 *
 * The store's back-pressure (docs/architecture.md, "The store"): a pipe is read only while
 * the store takes more (daemon_ingest_takes_lines); otherwise the worker blocks on its full
 * pipe, which is neither a failure nor silence (the hung timer stops meanwhile). An exited
 * worker whose end the store refuses stays in the table and is tried again every
 * END_RETRY_S once the store writes; no queued job starts meanwhile; a worker left waiting
 * stall_timeout_s is stopped, its job failed with the reason. Only a stopping daemon gives
 * up an end it cannot record (the job stays running in the store, and the next start's
 * recovery interrupts and resumes it).
 *
 * Invariants: a job id is in the worker table iff its store status is running and this
 * daemon started it; the table changes only on the scheduler thread and only under mu;
 * every store status change of a queued or running job happens under mu, so cancel,
 * resume, delete and the start of a worker never interleave.
 *
 * Threads: one scheduler thread; the daemon_sched_* calls come from the HTTP threads and
 * take mu. A worker's parsing state is touched by the scheduler thread only.
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "api/api.h"
#include "daemon/ckpt.h"
#include "daemon/fs.h"
#include "daemon/line.h"
#include "daemon/log.h"
#include "daemon/machine.h"
#include "daemon/policy.h"
#include "daemon/queue.h"
#include "daemon/ranks.h"
#include "daemon/sched.h"
#include "daemon/spawn.h"
#include "daemon/worker.h"
#include "gpu/gpu.h"
#include "store/store.h"

#define POLL_MS 200
#define TURN_MAX_S 1.0 /* a turn counts for at most this much of a worker's silence */
#define SCHEDULE_EVERY_S 2.0 /* look at the queue at least this often */
#define GRACE_S 30.0         /* SIGTERM to SIGKILL, on cancel and on stop */
#define END_RETRY_S 1.0         /* a job's end the store could not record: tried again after */
#define READ_TURN_BYTES (256u << 10) /* a worker's output read in one turn, at most */

struct daemon_sched {
    store *st;
    daemon_sched_config cfg;
    pthread_t thread;
    int wake[2];
    pthread_mutex_t mu;
    /* under mu */
    worker **workers;
    int64_t *busy; /* the workers' jobs, for the queue's plan (max_running entries) */
    int nworkers;
    bool stop_requested, need_schedule;
    int64_t started, failed;
    daemon_queue queue;    /* the queued jobs as last planned */
    api_spec_opts roots;   /* the data roots, as the specs' parser takes them */
    daemon_machine *owned; /* the machine, when the config gave none */
    /* scheduler thread only */
    bool pausing;        /* workers are not read: the store cannot take more */
    double pause_start;
};

static void wake_up(daemon_sched *s)
{
    char c = 1;
    ssize_t r = write(s->wake[1], &c, 1);
    (void)r; /* a full pipe already means "wake up" */
}

static void job_dir(const daemon_sched *s, int64_t id, char *out, size_t len)
{
    snprintf(out, len, "%s/jobs/%lld", s->cfg.shared_dir, (long long)id);
}

/* dir created (mode 0750) and made absolute in place; -1 after a log line. */
static int absolute_dir(char *dir, size_t len, const char *what)
{
    char abs[PATH_MAX];
    if (daemon_mkdirs(dir, 0750) != 0 || !realpath(dir, abs) || strlen(abs) >= len) {
        log_error("cannot use the %s %s: %s", what, dir, strerror(errno));
        return -1;
    }
    memcpy(dir, abs, strlen(abs) + 1);
    return 0;
}

/* Whether the store writes (its last attempt did). */
static bool writes_ok(daemon_sched *s)
{
    store_health h;
    store_get_health(s->st, &h);
    return h.code == 0;
}

static worker *find_worker_locked(daemon_sched *s, int64_t id)
{
    for (int i = 0; i < s->nworkers; i++)
        if (s->workers[i]->job == id)
            return s->workers[i];
    return NULL;
}

/* Job id's worker while it has not exited, else NULL (under mu). A job whose ranks wait in
 * Slurm's queue has one though its status is queued. */
static worker *live_worker_locked(daemon_sched *s, int64_t id)
{
    worker *w = find_worker_locked(s, id);
    return w && !w->exited ? w : NULL;
}

/* Take mu and read job id into *j (cleared first): 0 or the store's code. Every call is
 * paired with unlock_job, whatever it returned. */
static int lock_job(daemon_sched *s, int64_t id, store_job *j)
{
    memset(j, 0, sizeof(*j));
    pthread_mutex_lock(&s->mu);
    return store_job_get(s->st, id, j);
}

static void unlock_job(daemon_sched *s, store_job *j)
{
    pthread_mutex_unlock(&s->mu);
    store_job_clear(j);
}

/* Signal a worker's process group (under mu, or on the scheduler thread for kills). */
static void signal_worker(worker *w, int sig)
{
    if (w->exited || w->pid <= 0)
        return;
    if (kill(-w->pid, sig) != 0 && errno == ESRCH)
        kill(w->pid, sig);
}

/* Ask a worker to checkpoint and stop (SIGTERM, once; SIGKILL after GRACE_S). */
static void stop_worker_locked(worker *w, double now)
{
    if (w->term_sent)
        return;
    w->term_sent = true;
    w->term_at = now;
    signal_worker(w, SIGTERM);
}

/* ---- spawning ----------------------------------------------------------------------------- */

/* A branch without a checkpoint of its own starts from its parent's at the branch step
 * (or, where the parent began there itself, the ancestor's it began with): its path in
 * ckpt (even when the file is gone: the worker then fails naming it) and the
 * step in *from; a branch from step 0 starts from the beginning (ckpt ""). 0, or GPU_EINVAL
 * when the parent has no record of it. */
static int branch_start(daemon_sched *s, const store_job *j, char *ckpt, size_t len, int64_t *from)
{
    int64_t step = api_branch_step(j->branch);
    if (step > 0 && api_branch_checkpoint(s->st, j->parent_id, step, ckpt, len) != 0)
        ckpt[0] = '\0';
    if (step == 0)
        return 0; /* a branch from the start: nothing to load */
    if (!ckpt[0]) {
        log_error("job %lld: its parent, job %lld, has no checkpoint at step %lld any more",
                  (long long)j->id, (long long)j->parent_id, (long long)step);
        return GPU_EINVAL;
    }
    *from = step;
    return 0;
}

/* Whether branch j's record lists what among what starts anew ("resets"). */
static bool branch_resets(const store_job *j, const char *what)
{
    json_t *b = json_loads(j->branch ? j->branch : "", 0, NULL);
    json_t *arr = json_object_get(b, "resets");
    bool found = false;
    for (size_t i = 0; i < json_array_size(arr) && !found; i++) {
        const char *v = json_string_value(json_array_get(arr, i));
        found = v && strcmp(v, what) == 0;
    }
    json_decref(b);
    return found;
}

/* Prepare a queued job to restart from its newest checkpoint whose file is there (the
 * worker verifies it and walks back further past damaged ones): the records of the newer
 * ones whose files are gone are removed, each with an event saying why it was skipped, and
 * the metric rows after it are deleted. *from gets its step (0: none, from scratch). A
 * branch without one of its own starts from its parent's (*branch set). */
static int prepare_resume(daemon_sched *s, const store_job *j, char *ckpt, size_t len,
                          int64_t *from, bool *branch)
{
    store_checkpoint *cks = NULL;
    int n = 0;
    ckpt[0] = '\0';
    *from = 0;
    *branch = false;
    if (j->checkpoint_step > 0 && store_checkpoint_list(s->st, j->id, &cks, &n) == 0) {
        for (int i = n - 1; i >= 0 && !ckpt[0]; i--) {
            if (cks[i].step > j->checkpoint_step)
                continue;
            if (access(cks[i].path, R_OK) == 0) {
                snprintf(ckpt, len, "%s", cks[i].path);
                *from = cks[i].step;
                break;
            }
            int e = errno;
            daemon_ingest_skip_event(s->st, j->id, cks[i].step, cks[i].path,
                                     e == ENOENT ? "missing" : strerror(e));
            if (e == ENOENT) /* a file that is there but unreadable keeps its record */
                store_checkpoint_delete(s->st, j->id, cks[i].step);
        }
        free(cks);
    }
    if (!ckpt[0] && j->parent_id > 0) {
        if (branch_start(s, j, ckpt, len, from) != 0)
            return GPU_EINVAL;
        *branch = ckpt[0] != '\0';
    } else if (j->checkpoint_step > 0 && !ckpt[0])
        log_warn("job %lld: no checkpoint file is left (the last was at step %lld); starting "
                 "from scratch",
                 (long long)j->id, (long long)j->checkpoint_step);
    if (*from != j->checkpoint_step && !*branch)
        store_job_set_checkpoint(s->st, j->id, *from);
    return store_metrics_truncate(s->st, j->id, *from);
}

typedef struct {
    char *argv[24 + 2 * DAEMON_MAX_ROOTS]; /* worker_argv's at most, with the NULL */
    char **envp;       /* the environment with the job's CUDA_VISIBLE_DEVICES (NULL: ours) */
    char visible[300]; /* that variable */
    cpu_set_t cpus;    /* the cores the job was given */
    char every[8];
    char spec[700];
    char ckpt[600];
    bool branch;           /* ckpt is the parent's, a branch's start (--branch-from) */
    bool reset_scale;      /* ... whose loss scaler starts anew (--branch-reset) */
    int out[2], log, null; /* the stdout pipe, worker.log and /dev/null; -1: closed */
} spawn_args;

/* The worker's cores and, for a job given GPUs, an environment whose CUDA_VISIBLE_DEVICES
 * names them (so that its ranks see them as devices 0, 1, ...). 0 or GPU_ENOMEM. */
static int placement_env(const daemon_start *st, spawn_args *a)
{
    extern char **environ;
    size_t n = 0, k = 0;
    CPU_ZERO(&a->cpus);
    for (int i = 0; i < st->place.ncpus; i++)
        CPU_SET(st->place.cpus[i], &a->cpus);
    if (st->place.ndevices == 0)
        return 0;
    while (environ[n])
        n++;
    if (!(a->envp = calloc(n + 2, sizeof(*a->envp))))
        return GPU_ENOMEM;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "CUDA_VISIBLE_DEVICES=", 21) != 0)
            a->envp[k++] = environ[i];
    memcpy(a->visible, "CUDA_VISIBLE_DEVICES=", 21);
    daemon_placement_devices(&st->place, a->visible + 21, sizeof(a->visible) - 21);
    a->envp[k] = a->visible;
    return 0;
}

static void close_fds(spawn_args *a)
{
    int *fds[] = {&a->out[0], &a->out[1], &a->log, &a->null};
    for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++)
        if (*fds[i] >= 0) {
            close(*fds[i]);
            *fds[i] = -1;
        }
}

/* The job's directory and files for w's run: spec.json, the metrics made ready for a
 * restart (prepare_resume), worker.log opened for appending with a header line, /dev/null
 * and the stdout pipe. On failure err says why. */
static int worker_files(daemon_sched *s, const store_job *j, worker *w, spawn_args *a,
                        int64_t *from, char *err, size_t errlen)
{
    char path[700], head[1024];
    struct stat sb;

    if (daemon_mkdirs(w->dir, 0750) != 0) {
        snprintf(err, errlen, "cannot create %s: %s", w->dir, strerror(errno));
        return GPU_EIO;
    }
    snprintf(a->spec, sizeof(a->spec), "%s/spec.json", w->dir);
    if (daemon_write_atomic(a->spec, j->spec ? j->spec : "{}") != 0) {
        snprintf(err, errlen, "cannot write %s: %s", a->spec, strerror(errno));
        return GPU_EIO;
    }
    if (prepare_resume(s, j, a->ckpt, sizeof(a->ckpt), from, &a->branch) != 0) {
        snprintf(err, errlen,
                 j->parent_id > 0 ? "cannot find the parent's checkpoint it branches from"
                                  : "cannot prepare the job's metrics for a restart");
        return GPU_EIO;
    }
    a->reset_scale = a->branch && branch_resets(j, "loss_scale");
    snprintf(path, sizeof(path), "%s/worker.log", w->dir);
    a->log = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
    a->null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (a->log < 0 || a->null < 0 || pipe2(a->out, O_CLOEXEC) != 0) {
        snprintf(err, errlen, "cannot set up the worker's files: %s", strerror(errno));
        return GPU_EIO;
    }
    snprintf(head, sizeof(head), "---- worker for job %lld starting%s%s\n", (long long)j->id,
             a->ckpt[0] ? (a->branch ? ", branching from " : ", resuming from ") : "", a->ckpt);
    if (write(a->log, head, strlen(head)) < 0)
        log_warn("cannot write %s: %s", path, strerror(errno));
    if (fstat(a->log, &sb) == 0)
        w->log_start = sb.st_size; /* the failure reason quotes only this run's lines */
    return 0;
}

/* The worker's command line (see the top of the file) in a->argv; device: its --device
 * ("": none). */
static void worker_argv(const daemon_sched *s, worker *w, spawn_args *a, const char *device)
{
    int k = 0;
    snprintf(a->every, sizeof(a->every), "1");
    a->argv[k++] = (char *)s->cfg.exe;
    a->argv[k++] = "run";
    a->argv[k++] = "--every";
    a->argv[k++] = a->every;
    a->argv[k++] = "--checkpoint-dir";
    a->argv[k++] = w->dir;
    a->argv[k++] = "--no-delete";
    if (a->ckpt[0]) {
        a->argv[k++] = a->branch ? "--branch-from" : "--resume";
        a->argv[k++] = a->ckpt;
        if (a->branch && a->reset_scale) {
            a->argv[k++] = "--branch-reset";
            a->argv[k++] = "loss_scale";
        }
    }
    if (device[0]) {
        a->argv[k++] = "--device";
        a->argv[k++] = (char *)device;
    }
    for (int i = 0; i < s->cfg.nroots && i < DAEMON_MAX_ROOTS; i++) {
        a->argv[k++] = "--data-root";
        a->argv[k++] = (char *)s->cfg.roots[i];
    }
    k += daemon_launch_argv(&s->cfg.launch, a->argv + k);
    a->argv[k++] = a->spec;
    a->argv[k] = NULL;
}

/* Start the worker of job j (status queued, under mu) where st placed it. On failure err
 * says why. */
static int spawn_locked(daemon_sched *s, const store_job *j, const daemon_start *st, worker **out,
                        char *err, size_t errlen)
{
    spawn_args a = {.out = {-1, -1}, .log = -1, .null = -1};
    daemon_spawn_opts o = {.exe = s->cfg.exe,
                           .death_signal = SIGKILL,
                           .nofile = s->cfg.nofile_child, /* the limit the daemon started with */
                           .exec_error = "ampd: cannot execute the worker binary"};
    worker *w = calloc(1, sizeof(*w));
    int64_t from = 0;
    pid_t pid;

    if (!w || placement_env(st, &a) != 0) {
        snprintf(err, errlen, "out of memory");
        free(w);
        free(a.envp);
        return GPU_ENOMEM;
    }
    w->fd = -1;
    w->job = j->id;
    w->ranks = st->req.ranks;
    w->priority = st->priority;
    job_dir(s, j->id, w->dir, sizeof(w->dir));
    if (worker_files(s, j, w, &a, &from, err, errlen) != 0)
        goto fail;
    worker_argv(s, w, &a, st->device);
    o.argv = a.argv;
    o.in = a.null;
    o.out = a.out[1];
    o.err = a.log;
    o.affinity = st->place.ncpus > 0 ? &a.cpus : NULL;
    o.envp = a.envp;
    if (daemon_spawn(&o, &pid) != 0) {
        snprintf(err, errlen, "cannot fork a worker: %s", strerror(errno));
        goto fail;
    }
    free(a.envp);
    w->fd = a.out[0];
    a.out[0] = -1;
    close_fds(&a);
    fcntl(w->fd, F_SETFL, fcntl(w->fd, F_GETFL) | O_NONBLOCK);
    w->pid = pid;
    w->started = w->last_output = daemon_now_s();
    w->base_step = w->last_step = w->resumed_from = w->newest_ckpt = from;
    w->final_scale = NAN;
    *out = w;
    return 0;
fail:
    free(a.envp);
    close_fds(&a);
    daemon_worker_free(w);
    return GPU_EIO;
}

/* "placed on cores 0-1 and GPUs 2,3" for the job's start event and log line. */
static void placement_text(const daemon_start *st, char *out, size_t len)
{
    const daemon_placement *p = &st->place;
    char cpus[256] = "", devs[256] = "";
    daemon_placement_cpus(p, cpus, sizeof(cpus));
    daemon_placement_devices(p, devs, sizeof(devs));
    snprintf(out, len, "placed on %s%s%s%s%s%s%s",
             p->ncpus ? (p->ncpus == 1 ? "core " : "cores ") : "", cpus,
             p->ncpus && p->ndevices ? " and " : "",
             p->ndevices ? (p->ndevices == 1 ? "GPU " : "GPUs ") : "", devs,
             p->ncpus || p->ndevices ? "" : "no core or GPU of its own",
             st->req.ranks == 0 ? " (its ranks on other machines)" : "");
}

/* The placement as the start event's data: {"cpus": [...], "devices": [...]}. */
static json_t *placement_json(const daemon_start *st)
{
    json_t *cpus = json_array(), *devs = json_array();
    for (int i = 0; cpus && i < st->place.ncpus; i++)
        json_array_append_new(cpus, json_integer(st->place.cpus[i]));
    for (int i = 0; devs && i < st->place.ndevices; i++)
        json_array_append_new(devs, json_integer(st->place.devices[i]));
    return json_pack("{s:o, s:o}", "cpus", cpus, "devices", devs);
}

/* Start one planned job (under mu): its worker, its status, its placement event. */
static void start_one_locked(daemon_sched *s, const daemon_start *st)
{
    store_job j;
    worker *w = NULL;
    char err[1536], msg[1600];
    memset(&j, 0, sizeof(j));
    if (store_job_get(s->st, st->job, &j) != 0 || !store_status_waiting(j.status)) {
        daemon_machine_release(s->cfg.machine, st->job);
        store_job_clear(&j);
        return;
    }
    if (spawn_locked(s, &j, st, &w, err, sizeof(err)) != 0) {
        daemon_machine_release(s->cfg.machine, st->job);
        log_error("job %lld: %s", (long long)j.id, err);
        snprintf(msg, sizeof(msg), "failed to start: %s", err);
        daemon_ingest_event(s->st, j.id, 0, "lifecycle", msg, NULL);
        store_job_set_status(s->st, j.id, STORE_FAILED, err);
        s->failed++;
        store_job_clear(&j);
        return;
    }
    if (store_job_set_status(s->st, j.id, STORE_RUNNING, NULL) != 0)
        log_error("job %lld: cannot mark it running", (long long)j.id);
    s->workers[s->nworkers++] = w;
    s->started++;
    placement_text(st, msg, sizeof(msg));
    daemon_ingest_event(s->st, j.id, 0, "lifecycle", msg, placement_json(st));
    log_info("job %lld (%s): worker %d started%s, %s", (long long)j.id, j.name, (int)w->pid,
             w->base_step ? ", resuming" : "", msg);
    store_job_clear(&j);
}

/* Tell the running jobs the head of the queue preempts to checkpoint and stop (under mu). */
static void preempt_locked(daemon_sched *s)
{
    queue_running *run = calloc((size_t)s->nworkers + 1, sizeof(*run));
    int64_t *victims = calloc((size_t)s->nworkers + 1, sizeof(*victims));
    int n = 0;
    if (!run || !victims)
        goto out;
    for (int i = 0; i < s->nworkers; i++) {
        worker *w = s->workers[i];
        run[i] = (queue_running){w->job, w->priority, w->started, w->term_sent || w->exited};
    }
    daemon_queue_preempt(s->st, s->cfg.machine, run, s->nworkers, s->cfg.max_running,
                         &s->queue, victims, &n);
    for (int i = 0; i < n; i++) {
        worker *w = find_worker_locked(s, victims[i]);
        int64_t by = s->queue.jobs[s->queue.head].id;
        char msg[160];
        if (!w)
            continue;
        snprintf(msg, sizeof(msg), "preempting: job %lld (priority %d) needs what it holds; it "
                 "checkpoints and stops", (long long)by, s->queue.jobs[s->queue.head].priority);
        log_info("job %lld (priority %d): %s", (long long)w->job, w->priority, msg);
        daemon_ingest_event(s->st, w->job, w->last_step, "lifecycle", msg, NULL);
        w->preempt_by = by;
        stop_worker_locked(w, daemon_now_s());
    }
out:
    free(run);
    free(victims);
}

/* Start the queued jobs that fit, in the queue's order, while slots are free (under mu). */
static void start_queued_locked(daemon_sched *s)
{
    daemon_start *starts;
    int n = 0, slots = s->cfg.max_running - s->nworkers;
    /* while the store cannot write, queued jobs wait: their start is a write too */
    if (!writes_ok(s) || !(starts = calloc((size_t)(slots > 0 ? slots : 1), sizeof(*starts))))
        return;
    if (slots < 0)
        slots = 0;
    for (int i = 0; i < s->nworkers; i++)
        s->busy[i] = s->workers[i]->job;
    s->queue.busy = s->busy;
    s->queue.nbusy = s->nworkers;
    daemon_queue_plan(s->st, s->cfg.machine, &s->roots, s->cfg.max_running, slots, starts, &n,
                      &s->queue);
    s->queue.busy = NULL;
    s->queue.nbusy = 0;
    for (int i = 0; i < n; i++)
        start_one_locked(s, &starts[i]);
    free(starts);
    if (s->cfg.preempt && s->queue.head >= 0 && s->nworkers > 0) /* a job waits for room */
        preempt_locked(s);
}

/* ---- ending a worker ---------------------------------------------------------------------- */

static const char *signal_name(int sig)
{
    const char *abbrev = sigabbrev_np(sig);
    static _Thread_local char buf[32];
    snprintf(buf, sizeof(buf), "SIG%s", abbrev ? abbrev : "?");
    return buf;
}

/* The status of a job whose worker was told to stop and did: cancelled, paused, preempted,
 * branched by its on_numerics (failed, with err, when the branch could not be made), or
 * interrupted (the daemon stops). */
static store_status stopped_status(const worker *w, char *err, size_t errlen)
{
    if (!w->cancel && w->branching && !w->branch_child) {
        snprintf(err, errlen, "on_numerics branch: the branch could not be made: %s",
                 w->branch_err ? w->branch_err : "the worker stopped before it could");
        return STORE_FAILED;
    }
    return w->cancel       ? STORE_CANCELLED
           : w->pause      ? STORE_PAUSED
           : w->branching  ? STORE_BRANCHED
           : w->preempt_by ? STORE_PREEMPTED
                           : STORE_INTERRUPTED;
}

/* A job whose ranks on another host were lost (a node died) goes back to the queue while
 * it has retries left (max_retries); w->retry gets its number. Under mu. */
static bool retry_lost(daemon_sched *s, worker *w)
{
    store_job j;
    bool again = false;
    memset(&j, 0, sizeof(j));
    if (store_job_get(s->st, w->job, &j) == 0 && j.retries < s->cfg.max_retries &&
        store_job_set_retries(s->st, w->job, j.retries + 1) == 0) {
        w->retry = j.retries + 1;
        again = true;
    }
    store_job_clear(&j);
    return again;
}

/* Decide the job's final status from how its worker ended; err gets the failure reason
 * (for a preempted job, by whom; for one queued again, what it lost). */
static store_status final_status(daemon_sched *s, worker *w, char *err, size_t errlen)
{
    int n = 0;
    err[0] = '\0';
    if (w->stalled) {
        n = snprintf(err, errlen,
                     "stopped: the store could not write the run's history for %d s (%s)",
                     s->cfg.stall_timeout_s, w->stall_why);
    } else if (w->hung) {
        n = snprintf(err, errlen, "hung: no output for %d s", s->cfg.worker_timeout_s);
    } else if (WIFEXITED(w->wstatus)) {
        int code = WEXITSTATUS(w->wstatus);
        if (code == 0)
            return STORE_SUCCEEDED;
        if (w->branching && w->branch_child && !w->cancel)
            return STORE_BRANCHED; /* it failed by itself at the problem its branch remedies */
        if (code == 130)
            return stopped_status(w, err, errlen);
        if (code == DAEMON_EXIT_LOST && !w->term_sent) {
            daemon_log_tail(w->dir, w->log_start, err, errlen);
            return retry_lost(s, w) ? STORE_QUEUED : STORE_FAILED;
        }
        if (w->summary_error)
            n = snprintf(err, errlen, "%s (worker exited with status %d)", w->summary_error, code);
        else
            n = snprintf(err, errlen, "worker exited with status %d", code);
    } else if (WIFSIGNALED(w->wstatus)) {
        int sig = WTERMSIG(w->wstatus);
        if (w->term_sent && (sig == SIGTERM || sig == SIGKILL))
            return stopped_status(w, err, errlen);
        n = snprintf(err, errlen, "worker killed by signal %d (%s)", sig, signal_name(sig));
    }
    (void)n;
    daemon_log_tail(w->dir, w->log_start, err, errlen);
    return STORE_FAILED;
}

/* Take w out of the table and free what its job held (under mu). */
static void remove_worker_locked(daemon_sched *s, worker *w)
{
    daemon_machine_release(s->cfg.machine, w->job);
    for (int i = 0; i < s->nworkers; i++)
        if (s->workers[i] == w) {
            s->workers[i] = s->workers[--s->nworkers];
            break;
        }
    s->need_schedule = true;
}

/* The lifecycle event that ends w's run, from its decided end (under mu). */
static void end_message(const daemon_sched *s, const worker *w, char *msg, size_t len)
{
    const char *why = w->end_err ? w->end_err : "?";
    if (w->end_status == STORE_FAILED)
        snprintf(msg, len, "failed: %s", why);
    else if (w->end_status == STORE_PREEMPTED)
        snprintf(msg, len, "%s; it resumes from its checkpoint at step %lld",
                 w->end_err ? w->end_err : "preempted", (long long)w->newest_ckpt);
    else if (w->end_status == STORE_QUEUED)
        snprintf(msg, len, "retrying from its checkpoint at step %lld (retry %d of %d): %s",
                 (long long)w->newest_ckpt, w->retry, s->cfg.max_retries, why);
    else if (w->end_status == STORE_BRANCHED)
        snprintf(msg, len,
                 "branched: job %lld goes on from a checkpoint before step %lld, with its "
                 "remedy",
                 (long long)w->branch_child,
                 (long long)json_integer_value(json_object_get(w->remedy, "step")));
    else
        snprintf(msg, len, "%s", store_status_name(w->end_status));
}

/* ---- on_numerics (policy.h) ------------------------------------------------------------- */

/* The data roots the workers get, as the spec parser's options. */
static void spec_opts(const daemon_sched *s, api_spec_opts *o)
{
    memset(o, 0, sizeof(*o));
    for (int i = 0; i < s->cfg.nroots && i < API_MAX_ROOTS; i++, o->nroots++)
        snprintf(o->roots[i], sizeof(o->roots[i]), "%s", s->cfg.roots[i]);
}

/* The policy's look at w's first remedy (scheduler thread): an event saying what it does,
 * and the worker stopped to branch or to ask (as a pause). */
static void apply_policy(daemon_sched *s, worker *w)
{
    static const char *const acts[] = {"none", "branch", "ask"};
    store_job j;
    char msg[1200];
    daemon_policy act;
    w->policy_done = true;
    if (store_job_get(s->st, w->job, &j) != 0)
        return;
    act = daemon_policy_decide(s->st, &j, w->remedy, msg, sizeof(msg));
    store_job_clear(&j);
    int64_t step = json_integer_value(json_object_get(w->remedy, "step"));
    if (msg[0])
        daemon_ingest_event(s->st, w->job, step, DAEMON_POLICY_EVENT, msg,
                            json_pack("{s:O, s:I, s:s}", "patch",
                                      json_object_get(w->remedy, "patch"), "step", (json_int_t)step,
                                      "act", acts[act]));
    if (act == DAEMON_POLICY_NONE)
        return;
    pthread_mutex_lock(&s->mu);
    if (act == DAEMON_POLICY_BRANCH && !w->cancel && (!w->term_sent || w->exited))
        w->branching = true; /* a worker that failed by itself meanwhile is branched too */
    else if (act == DAEMON_POLICY_ASK && !w->term_sent && !w->exited)
        w->pause = true;
    if ((w->branching || w->pause) && !w->term_sent && !w->exited) {
        stop_worker_locked(w, daemon_now_s());
        log_info("job %lld: %s", (long long)w->job, msg);
    }
    pthread_mutex_unlock(&s->mu);
}

/* The branch of w's job once its worker has stopped for it (scheduler thread, outside
 * mu): w->branch_child, or w->branch_err. Not for a job cancelled meanwhile. */
static void policy_branch(daemon_sched *s, worker *w)
{
    api_spec_opts o;
    api_jobs jobs;
    char err[600];
    w->branch_tried = true;
    if (w->cancel || !WIFEXITED(w->wstatus) || WEXITSTATUS(w->wstatus) == 0)
        return; /* stopped for it (130) or failed by itself: branched; finished: not */
    spec_opts(s, &o);
    daemon_sched_api(s, &jobs);
    if (daemon_policy_branch(s->st, &o, &jobs, w->job, w->remedy, &w->branch_child, err,
                             sizeof(err)) != 0) {
        w->branch_child = 0;
        w->branch_err = strdup(err);
        log_warn("job %lld: on_numerics branch: the branch could not be made: %s",
                 (long long)w->job, err);
    }
}

/* The worker has exited: drain its pipe and write the job's end (scheduler thread): the
 * summary and checkpoints the store has not taken yet, every queued row, the lifecycle
 * event, then the status (which ends the job's stream). The status is decided and written
 * under mu, so that no cancel or resume sees the job half ended. While the store cannot
 * write (a full disk, a lock), the end waits: the worker stays in the table, its exit
 * already known, and a later turn tries again, so that the job is never left running
 * without a worker; only a daemon that is stopping gives up (give_up), leaving the job to
 * the next start's recovery. Returns true when w is done with (and freed). */
static bool finish_worker(daemon_sched *s, worker *w, bool give_up)
{
    char err[4096], msg[4200];
    bool removed = false;
    int rc;

    if (!w->drained) {
        daemon_ingest_read(s->st, w, 0);
        if (w->fd >= 0) { /* a grandchild holds the pipe open: what the worker wrote is read */
            close(w->fd);
            w->fd = -1;
        }
        daemon_ingest_flush_overflow(s->st, w, w->final_scale);
        w->drained = true;
    }
    /* every metric row is committed before the job says it ended */
    if ((rc = daemon_ingest_summary(s->st, w)) == 0 &&
        (rc = daemon_ingest_checkpoints(s->st, w)) == 0)
        rc = store_flush(s->st);
    if (rc == 0 && w->remedy && !w->policy_done)
        apply_policy(s, w); /* it ended (failed, perhaps) in the turn its remedy came */
    if (rc == 0 && w->branching && !w->branch_tried)
        policy_branch(s, w); /* its checkpoints are on record: the branch can start from one */
    if (rc == 0) {
        pthread_mutex_lock(&s->mu);
        if (!w->end_decided) {
            w->end_status = final_status(s, w, err, sizeof(err));
            if (w->end_status == STORE_PREEMPTED)
                snprintf(err, sizeof(err), "preempted by job %lld", (long long)w->preempt_by);
            w->end_err = w->end_status == STORE_FAILED || w->end_status == STORE_PREEMPTED ||
                                 w->end_status == STORE_QUEUED
                             ? strdup(err)
                             : NULL;
            w->end_decided = true;
        }
        if (!w->end_event) { /* once: a finished job's stream ends with its end message */
            end_message(s, w, msg, sizeof(msg));
            daemon_ingest_event(s->st, w->job, w->last_step, "lifecycle", msg, NULL);
            w->end_event = true;
        }
        rc = store_job_set_status(s->st, w->job, w->end_status,
                                  w->end_status == STORE_QUEUED ? NULL : w->end_err);
        if (rc == 0 && w->end_status == STORE_QUEUED)
            s->need_schedule = true;
        if (rc == 0 || !daemon_ingest_transient(rc) || give_up) {
            remove_worker_locked(s, w);
            removed = true;
            if (w->end_status == STORE_FAILED)
                s->failed++;
        }
        pthread_mutex_unlock(&s->mu);
    }
    if (rc && daemon_ingest_transient(rc) && !give_up) {
        if (!w->end_warned)
            log_warn("job %lld: worker %d has exited; its end is recorded once the store "
                     "writes again (%s)",
                     (long long)w->job, (int)w->pid, store_strerror(rc));
        w->end_warned = true;
        w->end_retry_at = daemon_now_s() + END_RETRY_S;
        return false;
    }
    if (rc) {
        log_error("job %lld: cannot record its end (%s)%s", (long long)w->job,
                  store_strerror(rc),
                  give_up ? ": it stays running in the store until the next start recovers it"
                          : "");
        if (!removed) {
            pthread_mutex_lock(&s->mu);
            remove_worker_locked(s, w);
            pthread_mutex_unlock(&s->mu);
        }
    } else if (w->end_status == STORE_FAILED) { /* the first line; the log's are in the error */
        log_warn("job %lld: %.*s", (long long)w->job,
                 (int)strcspn(w->end_err ? w->end_err : "?", "\n"), w->end_err ? w->end_err : "?");
    } else {
        log_info("job %lld: %s at step %lld%s", (long long)w->job,
                 store_status_name(w->end_status), (long long)w->last_step,
                 w->end_warned ? " (recorded once the store could write again)" : "");
    }
    daemon_worker_free(w);
    return true;
}

/* A worker paused longer than stall_timeout_s: stop it (it checkpoints and exits, read as
 * any stopping worker); its job fails with the store's reason (under mu). */
static void stall_worker(daemon_sched *s, worker *w, double now)
{
    store_health h;
    store_get_health(s->st, &h);
    snprintf(w->stall_why, sizeof(w->stall_why), "%s",
             h.code ? h.message : "its queue stayed full");
    log_warn("job %lld: worker %d has waited %d s for the store (%s); stopping it, the job "
             "fails",
             (long long)w->job, (int)w->pid, s->cfg.stall_timeout_s, w->stall_why);
    w->stalled = true;
    stop_worker_locked(w, now);
}

/* Log when the scheduler starts and stops leaving workers unread for the store. */
static void note_pause(daemon_sched *s, int paused, double now)
{
    store_health h;
    if (paused > 0 && !s->pausing) {
        store_get_health(s->st, &h);
        log_warn("the store cannot take more (%s, %lld items held): %d worker(s) paused until "
                 "it can",
                 h.code ? h.message : "its queue is full", (long long)h.held, paused);
        s->pausing = true;
        s->pause_start = now;
    } else if (paused == 0 && s->pausing) {
        log_info("the store takes the workers' lines again after %.1f s", now - s->pause_start);
        s->pausing = false;
    }
}

/* ---- the scheduler thread ----------------------------------------------------------------- */

/* The scheduler thread's state from turn to turn. */
typedef struct {
    struct pollfd *fds; /* fds[0]: the self-pipe; then the workers that are read */
    worker **polled;    /* polled[i]: the worker of fds[i], i >= 1 */
    int nfds;
    bool stopping;
    double stop_deadline, last_schedule, last_reap;
} sched_loop;

/* The stop: every worker gets SIGTERM (once) and GRACE_S to checkpoint (under mu). */
static void begin_stop_locked(daemon_sched *s, sched_loop *l, double now)
{
    l->stopping = true;
    l->stop_deadline = now + GRACE_S;
    for (int i = 0; i < s->nworkers; i++)
        stop_worker_locked(s->workers[i], now);
    if (s->nworkers)
        log_info("stopping: waiting for %d worker(s) to checkpoint", s->nworkers);
}

/* The poll set: the self-pipe and every worker whose lines the store takes; the others are
 * paused, left blocked on their full pipes (under mu). Returns how many are paused. */
static int poll_set_locked(daemon_sched *s, sched_loop *l, double now)
{
    int paused = 0;
    l->fds[0].fd = s->wake[0];
    l->fds[0].events = POLLIN;
    l->nfds = 1;
    for (int i = 0; i < s->nworkers; i++) {
        worker *w = s->workers[i];
        if (w->fd < 0)
            continue;
        /* back-pressure: the worker blocks on its pipe */
        if (!daemon_ingest_takes_lines(s->st, w)) {
            if (!w->paused)
                w->paused_since = now;
            w->paused = true;
            paused++;
            continue;
        }
        w->paused = false;
        l->polled[l->nfds] = w;
        l->fds[l->nfds].fd = w->fd;
        l->fds[l->nfds].events = POLLIN;
        l->fds[l->nfds].revents = 0;
        l->nfds++;
    }
    return paused;
}

/* The start of a turn: the stop begun once requested, queued jobs started while not
 * stopping, the poll set built. False when the thread is done (stopping, no worker left). */
static bool begin_turn(daemon_sched *s, sched_loop *l, double now)
{
    int paused;
    pthread_mutex_lock(&s->mu);
    if (s->stop_requested && !l->stopping)
        begin_stop_locked(s, l, now);
    if (l->stopping && s->nworkers == 0) {
        pthread_mutex_unlock(&s->mu);
        return false;
    }
    if (!l->stopping && (s->need_schedule || now - l->last_schedule >= SCHEDULE_EVERY_S)) {
        s->need_schedule = false;
        l->last_schedule = now;
        start_queued_locked(s);
    }
    paused = poll_set_locked(s, l, now);
    pthread_mutex_unlock(&s->mu);
    note_pause(s, paused, now);
    return true;
}

/* Wait POLL_MS at most for the self-pipe or a worker's output, read the workers that have
 * some, and record the checkpoints the store could not take before. */
static void poll_workers(daemon_sched *s, sched_loop *l)
{
    if (poll(l->fds, (nfds_t)l->nfds, POLL_MS) < 0 && errno != EINTR)
        log_warn("poll: %s", strerror(errno));
    if (l->fds[0].revents) {
        char drain[64];
        while (read(s->wake[0], drain, sizeof(drain)) > 0)
            ;
    }
    for (int i = 1; i < l->nfds; i++)
        if (l->fds[i].revents)
            daemon_ingest_read(s->st, l->polled[i], READ_TURN_BYTES);
    for (int i = 0; i < s->nworkers; i++) /* checkpoints the store could not take before */
        if (s->workers[i]->nckpts > 0 && !s->workers[i]->exited && writes_ok(s))
            daemon_ingest_checkpoints(s->st, s->workers[i]);
}

/* One running worker (under mu): reaped once it has exited; else its silence and its wait
 * for the store timed, and killed when hung or slow to stop. */
static void watch_worker_locked(daemon_sched *s, const sched_loop *l, worker *w, double now,
                                double held_up)
{
    int status;
    if (w->exited)
        return;
    w->last_output += held_up;
    if (waitpid(w->pid, &status, WNOHANG) == w->pid) {
        w->exited = true;
        w->wstatus = status;
        return;
    }
    if (w->paused) { /* silent because it is not read: not hung */
        w->last_output = now;
        if (!w->term_sent && s->cfg.stall_timeout_s > 0 &&
            now - w->paused_since > s->cfg.stall_timeout_s)
            stall_worker(s, w, now);
    }
    /* until its first step a job of many ranks is still starting them: 2 s more a rank */
    double limit = s->cfg.worker_timeout_s + (w->last_step > w->base_step ? 0 : 2.0 * w->ranks);
    if (!w->hung && !w->term_sent && s->cfg.worker_timeout_s > 0 &&
        now - w->last_output > limit) {
        log_warn("job %lld: worker %d printed nothing for %.0f s; killing it", (long long)w->job,
                 (int)w->pid, limit);
        w->hung = true;
        signal_worker(w, SIGKILL);
    }
    if (w->term_sent && !w->kill_sent &&
        (now - w->term_at > GRACE_S || (l->stopping && now > l->stop_deadline))) {
        log_warn("job %lld: worker %d did not stop within %.0f s; killing it", (long long)w->job,
                 (int)w->pid, GRACE_S);
        w->kill_sent = true;
        signal_worker(w, SIGKILL);
    }
}

/* Reap the exited, kill the hung and the slow to stop; returns the time it did. The table
 * changes only on this thread, so it can be walked here without mu; the flags that cancel
 * sets are read under it. */
static double reap_workers(daemon_sched *s, sched_loop *l)
{
    double now = daemon_now_s(), held_up;
    /* A worker is hung when it says nothing while the scheduler listens: a turn that took
     * long (this thread waited in a store call, up to its busy timeout) counts for at most
     * TURN_MAX_S of its silence. */
    held_up =
        l->last_reap > 0 && now - l->last_reap > TURN_MAX_S ? now - l->last_reap - TURN_MAX_S : 0;
    l->last_reap = now;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->nworkers; i++)
        watch_worker_locked(s, l, s->workers[i], now, held_up);
    pthread_mutex_unlock(&s->mu);
    return now;
}

/* End the exited workers whose end may be tried now (finish_worker): at once the first
 * time, then every END_RETRY_S once the store writes (a stopping daemon tries regardless,
 * and gives up after the stop's deadline). */
static void end_workers(daemon_sched *s, const sched_loop *l, double now)
{
    for (int i = 0; i < s->nworkers;) {
        worker *w = s->workers[i];
        if (w->exited && now >= w->end_retry_at &&
            (!w->end_warned || writes_ok(s) || l->stopping) &&
            finish_worker(s, w, l->stopping && now > l->stop_deadline))
            continue; /* w is gone: the next one moved to slot i */
        i++;
    }
}

static void *sched_main(void *arg)
{
    daemon_sched *s = arg;
    sched_loop l;

    memset(&l, 0, sizeof(l));
    l.fds = calloc((size_t)s->cfg.max_running + 1, sizeof(*l.fds));
    l.polled = calloc((size_t)s->cfg.max_running + 1, sizeof(*l.polled));
    if (!l.fds || !l.polled) {
        log_error("out of memory: the scheduler cannot run");
        goto done;
    }
    while (begin_turn(s, &l, daemon_now_s())) {
        poll_workers(s, &l);
        for (int i = 0; i < s->nworkers; i++)
            if (s->workers[i]->remedy && !s->workers[i]->policy_done && !s->workers[i]->exited)
                apply_policy(s, s->workers[i]);
        end_workers(s, &l, reap_workers(s, &l));
    }
done:
    free(l.fds);
    free(l.polled);
    return NULL;
}

/* ---- recovery ----------------------------------------------------------------------------- */

/* The processes of job id that the dead daemon left (its worker, mpirun, the ranks, which
 * may take seconds to follow their parent): ended before the job can start again, so that
 * two runs never share its checkpoint directory. */
static void end_strays(daemon_sched *s, int64_t id)
{
    char dir[640], spec[700];
    int killed = 0, left;
    job_dir(s, id, dir, sizeof(dir));
    snprintf(spec, sizeof(spec), "%s/spec.json", dir);
    left = daemon_end_strays(spec, 10.0, &killed);
    if (killed)
        log_warn("job %lld: ended %d process%s the previous daemon left running%s",
                 (long long)id, killed, killed == 1 ? "" : "es",
                 left ? " (some are still there after 10 s)" : "");
}

/* Jobs a dead daemon left running become interrupted (their processes ended first);
 * interrupted jobs are queued again (retries + 1) or failed once they have been restarted
 * max_retries times. */
static int recover(daemon_sched *s)
{
    int64_t *ids = NULL;
    int n = 0, rc;

    rc = store_job_ids(s->st, STORE_RUNNING, &ids, &n);
    for (int i = 0; rc == 0 && i < n; i++) {
        end_strays(s, ids[i]);
        log_warn("job %lld was running when the daemon stopped; it is interrupted",
                 (long long)ids[i]);
        rc = store_job_set_status(s->st, ids[i], STORE_INTERRUPTED,
                                  "the daemon stopped while the job was running");
    }
    free(ids);
    ids = NULL;
    if (rc == 0)
        rc = store_job_ids(s->st, STORE_INTERRUPTED, &ids, &n);
    for (int i = 0; rc == 0 && i < n; i++) {
        store_job j;
        char msg[256];
        memset(&j, 0, sizeof(j));
        if (store_job_get(s->st, ids[i], &j) != 0)
            continue;
        int retries = j.retries + 1;
        rc = store_job_set_retries(s->st, j.id, retries);
        if (rc == 0 && retries > s->cfg.max_retries) {
            snprintf(msg, sizeof(msg), "interrupted too often: %d restarts (max_retries %d)",
                     retries - 1, s->cfg.max_retries);
            log_warn("job %lld: %s", (long long)j.id, msg);
            store_event_append(s->st, j.id, j.step, "lifecycle", msg, NULL);
            rc = store_job_set_status(s->st, j.id, STORE_FAILED, msg);
        } else if (rc == 0) {
            snprintf(msg, sizeof(msg), "queued again after an interruption (restart %d of %d)",
                     retries, s->cfg.max_retries);
            log_info("job %lld: %s, from step %lld", (long long)j.id, msg,
                     (long long)j.checkpoint_step);
            rc = store_job_set_status(s->st, j.id, STORE_QUEUED, NULL);
            store_event_append(s->st, j.id, j.checkpoint_step, "lifecycle", msg, NULL);
        }
        store_job_clear(&j);
    }
    free(ids);
    return rc;
}

/* ---- the public calls --------------------------------------------------------------------- */

/* See sched.h. st is borrowed; c is copied. */
int daemon_sched_start(store *st, const daemon_sched_config *c, daemon_sched **out)
{
    daemon_sched *s;
    char jobs[600];
    int rc = GPU_EIO;

    *out = NULL;
    if (!st || !c || !c->exe[0] || !c->data_dir[0] || c->nroots < 0 || c->nroots > DAEMON_MAX_ROOTS)
        return GPU_EINVAL;
    s = calloc(1, sizeof(*s));
    if (!s)
        return GPU_ENOMEM;
    s->st = st;
    s->cfg = *c;
    s->wake[0] = s->wake[1] = -1;
    if (s->cfg.max_running < 1)
        s->cfg.max_running = 1;
    if (s->cfg.max_retries < 0)
        s->cfg.max_retries = 0;
    s->roots.nroots = c->nroots < API_MAX_ROOTS ? c->nroots : API_MAX_ROOTS;
    for (int i = 0; i < s->roots.nroots; i++)
        snprintf(s->roots.roots[i], sizeof(s->roots.roots[i]), "%s", c->roots[i]);
    if (!s->cfg.shared_dir[0])
        memcpy(s->cfg.shared_dir, s->cfg.data_dir, sizeof(s->cfg.shared_dir));
    if (absolute_dir(s->cfg.data_dir, sizeof(s->cfg.data_dir), "data directory") != 0 ||
        absolute_dir(s->cfg.shared_dir, sizeof(s->cfg.shared_dir), "shared directory") != 0) {
        free(s);
        return GPU_EIO;
    }
    snprintf(jobs, sizeof(jobs), "%s/jobs", s->cfg.shared_dir);
    if (daemon_mkdirs(jobs, 0750) != 0) {
        log_error("cannot create %s: %s", jobs, strerror(errno));
        free(s);
        return GPU_EIO;
    }
    if (!s->cfg.machine) {
        char err[300];
        if (daemon_machine_new(NULL, NULL, false, &s->owned, err, sizeof(err)) != 0) {
            log_error("%s", err);
            free(s);
            return GPU_EIO;
        }
        s->cfg.machine = s->owned;
    }
    pthread_mutex_init(&s->mu, NULL);
    s->workers = calloc((size_t)s->cfg.max_running, sizeof(*s->workers));
    s->busy = calloc((size_t)s->cfg.max_running, sizeof(*s->busy));
    if (!s->workers || !s->busy) {
        rc = GPU_ENOMEM;
        goto fail;
    }
    if (pipe2(s->wake, O_CLOEXEC | O_NONBLOCK) != 0)
        goto fail;
    if ((rc = recover(s)) != 0) {
        log_error("cannot recover the jobs of the previous run");
        goto fail;
    }
    s->need_schedule = true;
    if (pthread_create(&s->thread, NULL, sched_main, s) != 0) {
        rc = GPU_ENOMEM;
        goto fail;
    }
    *out = s;
    return 0;
fail:
    if (s->wake[0] >= 0) {
        close(s->wake[0]);
        close(s->wake[1]);
    }
    free(s->workers);
    free(s->busy);
    pthread_mutex_destroy(&s->mu);
    daemon_machine_free(s->owned);
    free(s);
    return rc;
}

/* See sched.h. Waits for the workers (at most 30 s, then SIGKILL); their jobs are
 * interrupted. */
void daemon_sched_stop(daemon_sched *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop_requested = true;
    pthread_mutex_unlock(&s->mu);
    wake_up(s);
    pthread_join(s->thread, NULL);
    for (int i = 0; i < s->nworkers; i++) /* none: the thread ends when the table is empty */
        daemon_worker_free(s->workers[i]);
    close(s->wake[0]);
    close(s->wake[1]);
    free(s->workers);
    free(s->busy);
    pthread_mutex_destroy(&s->mu);
    daemon_queue_free(&s->queue);
    daemon_machine_free(s->owned);
    free(s);
}

/* A branch of a job that its on_numerics "ask" paused answers the question: the job ends
 * branched (under mu). */
static void answer_ask_locked(daemon_sched *s, int64_t parent, int64_t child)
{
    store_job j;
    char msg[200];
    if (store_job_get(s->st, parent, &j) != 0)
        return;
    int64_t step = j.step;
    bool asked = j.status == STORE_PAUSED && !find_worker_locked(s, parent) &&
                 daemon_policy_asked(s->st, parent, NULL);
    store_job_clear(&j);
    if (!asked)
        return;
    snprintf(msg, sizeof(msg), "branched: job %lld goes on in its place (on_numerics ask)",
             (long long)child);
    daemon_ingest_event(s->st, parent, step, "lifecycle", msg, NULL);
    if (store_job_set_status(s->st, parent, STORE_BRANCHED, NULL) == 0)
        log_info("job %lld: %s", (long long)parent, msg);
}

/* See sched.h. */
int daemon_sched_branch(daemon_sched *s, const char *name, const char *dtype, int64_t steps,
                        const char *spec_json, int64_t parent, int64_t from_step,
                        const char *branch_json, const char *what, int64_t *id)
{
    char msg[600];
    int rc = daemon_ingest_branch(s->st, name, dtype, steps, spec_json, parent, from_step,
                                  branch_json, id);
    if (rc != 0)
        return rc;
    if (from_step > 0)
        snprintf(msg, sizeof(msg), "branched from job %lld at step %lld: %s", (long long)parent,
                 (long long)from_step, what);
    else
        snprintf(msg, sizeof(msg), "branched from job %lld from its start: %s", (long long)parent,
                 what);
    daemon_ingest_event(s->st, *id, from_step, "lifecycle", msg, NULL);
    if (from_step > 0)
        snprintf(msg, sizeof(msg),
                 "branch: job %lld starts from this job's checkpoint at step %lld: %s",
                 (long long)*id, (long long)from_step, what);
    else
        snprintf(msg, sizeof(msg), "branch: job %lld starts from this job's start: %s",
                 (long long)*id, what);
    daemon_ingest_event(s->st, parent, from_step, "branch", msg, NULL);
    log_info("job %lld: a branch of job %lld from step %lld (%s)", (long long)*id,
             (long long)parent, (long long)from_step, what);
    pthread_mutex_lock(&s->mu);
    answer_ask_locked(s, parent, *id);
    s->need_schedule = true;
    pthread_mutex_unlock(&s->mu);
    wake_up(s);
    return 0;
}

/* See sched.h. Borrowed strings; *id and *existed are outputs. */
int daemon_sched_submit(daemon_sched *s, const char *name, const char *dtype, int64_t steps,
                        const char *spec_json, const char *idem_key, int64_t *id, bool *existed)
{
    int rc = store_job_insert(s->st, name, dtype, steps, spec_json, idem_key, id, existed);
    if (rc != 0)
        return rc;
    if (!*existed) {
        pthread_mutex_lock(&s->mu);
        s->need_schedule = true;
        pthread_mutex_unlock(&s->mu);
        wake_up(s);
    }
    return 0;
}

/* See sched.h: a queued job is cancelled at once; a running one gets SIGTERM and becomes
 * cancelled when its worker has checkpointed and exited. */
int daemon_sched_cancel(daemon_sched *s, int64_t id)
{
    store_job j;
    worker *w;
    int rc;

    rc = lock_job(s, id, &j);
    if (rc != 0)
        goto out;
    w = live_worker_locked(s, id);
    if (!w && (store_status_waiting(j.status) || j.status == STORE_PAUSED)) {
        char msg[64];
        snprintf(msg, sizeof(msg), "cancelled while %s", store_status_name(j.status));
        daemon_ingest_event(s->st, id, j.step, "lifecycle", msg, NULL);
        rc = store_job_set_status(s->st, id, STORE_CANCELLED, NULL);
        if (rc == 0)
            log_info("job %lld: %s", (long long)id, msg);
    } else if (w && store_status_active(j.status)) { /* running, or waiting in Slurm's queue */
        rc = store_job_set_cancel(s->st, id, true);
        if (rc == 0 && !w->cancel) {
            w->cancel = true;
            stop_worker_locked(w, daemon_now_s());
            log_info("job %lld: cancel requested; worker %d checkpoints and stops", (long long)id,
                     (int)w->pid);
            store_event_append(s->st, id, w->last_step, "lifecycle", "cancel requested", NULL);
        }
    } else {
        rc = STORE_ECONFLICT;
    }
out:
    unlock_job(s, &j);
    return rc;
}

/* See sched.h: metric rows after the last checkpoint are deleted and the job is queued;
 * its worker starts with --resume (from scratch when no checkpoint is left). */
int daemon_sched_resume(daemon_sched *s, int64_t id)
{
    store_job j;
    char ckpt[600], msg[200];
    int64_t from = 0;
    bool branch;
    int rc;

    rc = lock_job(s, id, &j);
    if (rc == 0 && j.status != STORE_CANCELLED && j.status != STORE_FAILED &&
        j.status != STORE_INTERRUPTED)
        rc = STORE_ECONFLICT;
    if (rc == 0)
        rc = prepare_resume(s, &j, ckpt, sizeof(ckpt), &from, &branch);
    if (rc == 0)
        rc = store_job_set_cancel(s->st, id, false);
    if (rc == 0)
        rc = store_job_set_status(s->st, id, STORE_QUEUED, NULL);
    if (rc == 0) {
        if (from > 0)
            snprintf(msg, sizeof(msg), "resume requested: from the checkpoint at step %lld%s",
                     (long long)from, branch ? " of its parent" : "");
        else
            snprintf(msg, sizeof(msg), "resume requested: no checkpoint, from the start");
        daemon_ingest_event(s->st, id, from, "lifecycle", msg, NULL);
        log_info("job %lld: %s", (long long)id, msg);
        s->need_schedule = true;
    }
    unlock_job(s, &j);
    if (rc == 0)
        wake_up(s);
    return rc;
}

/* See sched.h: a queued or preempted job is paused at once; a running one gets SIGTERM and
 * becomes paused when its worker has checkpointed and exited. */
int daemon_sched_pause(daemon_sched *s, int64_t id)
{
    store_job j;
    worker *w;
    int rc;

    rc = lock_job(s, id, &j);
    w = rc == 0 ? live_worker_locked(s, id) : NULL;
    if (rc == 0 && !w && store_status_waiting(j.status)) {
        rc = store_job_set_status(s->st, id, STORE_PAUSED, NULL);
        if (rc == 0) {
            daemon_ingest_event(s->st, id, j.checkpoint_step, "lifecycle",
                                "paused while waiting; it stays out of the queue until unpaused",
                                NULL);
            log_info("job %lld: paused while waiting", (long long)id);
        }
    } else if (rc == 0 && w && store_status_active(j.status) && !w->cancel) {
        if (!w->pause) {
            w->pause = true;
            stop_worker_locked(w, daemon_now_s());
            log_info("job %lld: pause requested; worker %d checkpoints and stops", (long long)id,
                     (int)w->pid);
            daemon_ingest_event(s->st, id, w->last_step, "lifecycle",
                                "pause requested: it checkpoints and stops", NULL);
        }
    } else if (rc == 0) {
        rc = STORE_ECONFLICT;
    }
    unlock_job(s, &j);
    return rc;
}

/* See sched.h: a paused job goes back to the queue; it resumes from its checkpoint. */
int daemon_sched_unpause(daemon_sched *s, int64_t id)
{
    store_job j;
    char msg[160];
    int rc;

    rc = lock_job(s, id, &j);
    if (rc == 0 && j.status != STORE_PAUSED)
        rc = STORE_ECONFLICT;
    if (rc == 0)
        rc = store_job_set_status(s->st, id, STORE_QUEUED, NULL);
    if (rc == 0) {
        if (j.checkpoint_step > 0)
            snprintf(msg, sizeof(msg), "unpaused: queued to resume from its checkpoint at step "
                     "%lld", (long long)j.checkpoint_step);
        else
            snprintf(msg, sizeof(msg), "unpaused: queued");
        daemon_ingest_event(s->st, id, j.checkpoint_step, "lifecycle", msg, NULL);
        log_info("job %lld: %s", (long long)id, msg);
        s->need_schedule = true;
    }
    unlock_job(s, &j);
    if (rc == 0)
        wake_up(s);
    return rc;
}

/* job's spec text with priority set, in *out (free it): 0 or GPU_EIO when it does not parse. */
static int spec_with_priority(const char *spec, int priority, int *old, char **out)
{
    json_t *o = spec ? json_loads(spec, 0, NULL) : NULL;
    int rc = GPU_EIO;
    *out = NULL;
    if (json_is_object(o)) {
        *old = (int)json_integer_value(json_object_get(o, "priority"));
        if (json_object_set_new(o, "priority", json_integer(priority)) == 0 &&
            (*out = json_dumps(o, JSON_COMPACT)) != NULL)
            rc = 0;
    }
    json_decref(o);
    return rc;
}

/* See sched.h: the stored spec says the new priority; the queue and a running worker follow. */
int daemon_sched_set_priority(daemon_sched *s, int64_t id, int priority)
{
    store_job j;
    worker *w;
    char *spec = NULL, msg[96];
    int rc, old = 0;

    rc = lock_job(s, id, &j);
    if (rc == 0 && store_status_finished(j.status))
        rc = STORE_ECONFLICT;
    if (rc == 0 && spec_with_priority(j.spec, priority, &old, &spec) != 0)
        rc = STORE_EIO;
    if (rc == 0 && old != priority && (rc = store_job_set_spec(s->st, id, spec)) == 0) {
        daemon_queue_set_priority(&s->queue, id, priority);
        if ((w = find_worker_locked(s, id)) != NULL)
            w->priority = priority;
        snprintf(msg, sizeof(msg), "priority changed from %d to %d", old, priority);
        daemon_ingest_event(s->st, id, j.step, "lifecycle", msg, NULL);
        log_info("job %lld: %s", (long long)id, msg);
        s->need_schedule = true;
    }
    unlock_job(s, &j);
    free(spec);
    if (rc == 0)
        wake_up(s);
    return rc;
}

/* See sched.h: the job's rows and its directory go. */
int daemon_sched_delete(daemon_sched *s, int64_t id)
{
    store_job j;
    char dir[640];
    int rc;

    rc = lock_job(s, id, &j);
    if (rc == 0 && store_status_active(j.status))
        rc = STORE_ECONFLICT;
    if (rc == 0)
        rc = store_job_delete(s->st, id);
    if (rc == 0) {
        job_dir(s, id, dir, sizeof(dir));
        daemon_remove_dir(dir);
        log_info("job %lld deleted", (long long)id);
    }
    unlock_job(s, &j);
    return rc;
}

/* See sched.h; *out is filled. */
void daemon_sched_get_info(daemon_sched *s, daemon_sched_info *out)
{
    int64_t *ids = NULL;
    int n = 0;
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&s->mu);
    out->running = s->nworkers;
    out->max_running = s->cfg.max_running;
    out->workers_started = s->started;
    out->workers_failed = s->failed;
    pthread_mutex_unlock(&s->mu);
    if (daemon_queue_waiting_ids(s->st, &ids, &n) == 0)
        out->queued = n;
    free(ids);
}

/* ---- the HTTP server's job queue ------------------------------------------------------------ */

static int api_submit(void *ctx, const char *name, const char *dtype, int64_t steps,
                      const char *spec_json, const char *idem_key, int64_t *id, bool *existed)
{
    return daemon_sched_submit(ctx, name, dtype, steps, spec_json, idem_key, id, existed);
}

static int api_branch(void *ctx, const char *name, const char *dtype, int64_t steps,
                      const char *spec_json, int64_t parent, int64_t from_step,
                      const char *branch_json, const char *what, int64_t *id)
{
    return daemon_sched_branch(ctx, name, dtype, steps, spec_json, parent, from_step, branch_json,
                               what, id);
}

static int api_cancel(void *ctx, int64_t id)
{
    return daemon_sched_cancel(ctx, id);
}

static int api_resume(void *ctx, int64_t id)
{
    return daemon_sched_resume(ctx, id);
}

static int api_pause(void *ctx, int64_t id)
{
    return daemon_sched_pause(ctx, id);
}

static int api_unpause(void *ctx, int64_t id)
{
    return daemon_sched_unpause(ctx, id);
}

static int api_set_priority(void *ctx, int64_t id, int priority)
{
    return daemon_sched_set_priority(ctx, id, priority);
}

static int api_remove(void *ctx, int64_t id)
{
    return daemon_sched_delete(ctx, id);
}

static void api_info(void *ctx, api_queue_info *out)
{
    daemon_sched_get_info(ctx, out);
}

/* Whether job c can ever fit this machine (machine.h). */
static int api_admit(void *ctx, const gpu_job_config *c, api_error *e)
{
    daemon_sched *s = ctx;
    daemon_request r;
    int rc;
    pthread_mutex_lock(&s->mu);
    daemon_machine_request(s->cfg.machine, c, s->cfg.max_running, &r);
    rc = daemon_machine_admit(s->cfg.machine, c, &r, e);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int api_queued(void *ctx, int64_t id, api_queue_place *out)
{
    daemon_sched *s = ctx;
    int rc;
    pthread_mutex_lock(&s->mu);
    rc = daemon_queue_place(&s->queue, id, out);
    pthread_mutex_unlock(&s->mu);
    return rc == 0 ? 0 : STORE_ENOTFOUND;
}

static json_t *api_resources(void *ctx)
{
    daemon_sched *s = ctx;
    json_t *o;
    pthread_mutex_lock(&s->mu);
    o = daemon_machine_json(s->cfg.machine);
    pthread_mutex_unlock(&s->mu);
    return o;
}

/* See sched.h. */
void daemon_sched_api(daemon_sched *s, api_jobs *out)
{
    *out = (api_jobs){.ctx = s,
                      .submit = api_submit,
                      .branch = api_branch,
                      .cancel = api_cancel,
                      .resume = api_resume,
                      .pause = api_pause,
                      .unpause = api_unpause,
                      .set_priority = api_set_priority,
                      .remove = api_remove,
                      .info = api_info,
                      .admit = api_admit,
                      .resources = api_resources,
                      .queued = api_queued};
}
