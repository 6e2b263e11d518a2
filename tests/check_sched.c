/*
 * check_sched.c - the scheduler and worker supervision (daemon/sched.c), against a real
 * store in a temporary directory. The worker binary is
 * tests/sched_worker.sh, a test double that prints the lines `ampd run` prints and crashes,
 * aborts after its summary, hangs, fails, overflows or stops on SIGTERM as its spec asks, so
 * that every path of the supervision runs in well under a second.
 *
 * Checks: a job runs to succeeded with exactly one metric row per step, NaN/Infinity
 * decoded, checkpoints and the summary recorded, the job's stream in order with its end
 * last; a crashed worker fails
 * its job with the signal and its log's last lines and the next queued job runs; a worker
 * that prints its whole run, a "succeeded" summary included, and then aborts (SIGABRT, as
 * glibc does on a double free in the cleanup) fails its job too, naming the signal, with
 * every step row kept, and the next queued job runs; a hung worker is killed; a failing
 * worker's summary error is kept; cancel (queued and running)
 * and resume from the checkpoint; restart recovery (running -> interrupted -> resumed,
 * retries exhausted -> failed); a restart whose newest checkpoint file is gone resumes from
 * the one before it (not from scratch), and a worker that walks back past a damaged one
 * has the metrics truncated to the step it continues from, each with an event saying why;
 * a stop interrupts running jobs, which resume on the next start; two slots run two jobs at
 * once; overflow and scale events; over-long and garbage lines;
 * layers lines stored as layer stats (NaN/Infinity, scale, first non-finite layer) and
 * recommendation events (with their layer) stored, each after its step in the stream;
 * delete; the worker's descriptors, signal state and process group; a cancel that reaches a worker
 * before its exec (no handler of the daemon runs in it); an unrunnable worker binary; a store
 * that cannot write (store_test_fault): the worker paused and not killed as hung, every row
 * once, a job that ends meanwhile recorded afterwards (status, summary, checkpoints), no
 * queued job started meanwhile, checkpoint drops waiting behind the checkpoints the store has
 * not recorded, and the stall timeout failing a job with the reason. Preemption's choice
 * (queue.c over machine.c, on the emulator's four GPUs): the fewest running jobs of lower
 * priority, the lowest and the latest started first, and none when that would not do.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/beat.h"
#include "daemon/ckpt.h"
#include "daemon/machine.h"
#include "daemon/policy.h"
#include "daemon/queue.h"
#include "daemon/remedy.h"
#include "daemon/sched.h"
#include "daemon/worker.h"
#include "gpu/gpu_int.h"
#include "store/store.h"
#include "tests/testutil.h"

typedef struct {
    char dir[256], db[300];
    store *st;
    daemon_sched *sc;
    daemon_sched_config cfg;
} fixture;

static void worker_path(char *out, size_t len)
{
    const char *src = getenv("srcdir");
    char p[PATH_MAX + 64], abs[PATH_MAX];
    snprintf(p, sizeof(p), "%s/tests/sched_worker.sh", src ? src : ".");
    ck_assert_msg(realpath(p, abs) != NULL, "the fake worker %s is missing", p);
    ck_assert_uint_lt(strlen(abs), len);
    memcpy(out, abs, strlen(abs) + 1);
}

/* A fresh directory and store; the scheduler is started by start_sched(). */
static void setup(fixture *f)
{
    memset(f, 0, sizeof(*f));
    snprintf(f->dir, sizeof(f->dir), "/tmp/check_sched.XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(f->dir));
    snprintf(f->db, sizeof(f->db), "%s/ampd.db", f->dir);
    ck_assert_int_eq(store_open(f->db, &f->st), 0);
    worker_path(f->cfg.exe, sizeof(f->cfg.exe));
    snprintf(f->cfg.data_dir, sizeof(f->cfg.data_dir), "%s/data", f->dir);
    f->cfg.nroots = 1;
    snprintf(f->cfg.roots[0], sizeof(f->cfg.roots[0]), "/usr/share/datasets");
    f->cfg.max_running = 1;
    f->cfg.max_retries = 3;
    f->cfg.worker_timeout_s = 30;
}

static void start_sched(fixture *f)
{
    ck_assert_int_eq(daemon_sched_start(f->st, &f->cfg, &f->sc), 0);
}

static void teardown(fixture *f)
{
    char cmd[400];
    daemon_sched_stop(f->sc);
    store_close(f->st);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", f->dir);
    ck_assert_int_eq(system(cmd), 0);
}

static int64_t submit(fixture *f, const char *spec)
{
    int64_t id = 0;
    bool existed = true;
    ck_assert_int_eq(daemon_sched_submit(f->sc, "t", "fp32", 20, spec, NULL, &id, &existed), 0);
    ck_assert(!existed);
    return id;
}

/* Wait (at most timeout_s) until job has status st; fails the test otherwise. */
static void wait_status(fixture *f, int64_t id, store_status st, double timeout_s)
{
    double t0 = gpu_now();
    store_job j;
    for (;;) {
        memset(&j, 0, sizeof(j));
        ck_assert_int_eq(store_job_get(f->st, id, &j), 0);
        store_status cur = j.status;
        char err[600];
        snprintf(err, sizeof(err), "%s", j.error ? j.error : "");
        store_job_clear(&j);
        if (cur == st)
            return;
        ck_assert_msg(gpu_now() - t0 < timeout_s, "job %lld: status %s, expected %s (error: %s)",
                      (long long)id, store_status_name(cur), store_status_name(st), err);
        test_sleep_ms(10);
    }
}

/* Wait until the job's last recorded step reaches step (the store's progress). */
static void wait_step(fixture *f, int64_t id, int64_t step, double timeout_s)
{
    double t0 = gpu_now();
    for (;;) {
        store_metric m;
        if (store_metric_latest(f->st, id, &m) == 0 && m.step >= step)
            return;
        ck_assert_msg(gpu_now() - t0 < timeout_s, "job %lld never reached step %lld", (long long)id,
                      (long long)step);
        test_sleep_ms(10);
    }
}

static store_job get_job(fixture *f, int64_t id)
{
    store_job j;
    memset(&j, 0, sizeof(j));
    ck_assert_int_eq(store_job_get(f->st, id, &j), 0);
    return j;
}

/* The raw series of one field; asserts the steps are exactly 1..n, once each. */
static void check_rows(fixture *f, int64_t id, int field, int64_t n, store_series *se)
{
    ck_assert_int_eq(store_flush(f->st), 0);
    ck_assert_int_eq(store_series_query(f->st, id, &field, 1, 0, -1, 0, se), 0);
    ck_assert_int_eq(se->npoints, n);
    for (int i = 0; i < se->npoints; i++) {
        ck_assert_int_eq(se->points[i].step_first, i + 1);
        ck_assert_int_eq(se->points[i].count, 1);
    }
}

/* Count the events of a job of this kind whose message contains text (NULL: any). */
static int count_events(fixture *f, int64_t id, const char *kind, const char *text)
{
    store_event *ev = NULL;
    int n = 0, c = 0;
    ck_assert_int_eq(store_flush(f->st), 0);
    ck_assert_int_eq(store_event_list(f->st, id, 0, 1000, &ev, &n), 0);
    for (int i = 0; i < n; i++)
        if (strcmp(ev[i].kind, kind) == 0 && (!text || strstr(ev[i].message, text)))
            c++;
    store_events_free(ev, n);
    return c;
}

/* The pid of job id's worker, from its "worker N started" event (the worker's start line),
 * at most timeout_s; fails the test otherwise. */
static int worker_pid(fixture *f, int64_t id, double timeout_s)
{
    store_event *ev = NULL;
    int n = 0, pid = 0;
    double t0 = gpu_now();
    for (;;) {
        ck_assert_int_eq(store_flush(f->st), 0);
        ck_assert_int_eq(store_event_list(f->st, id, 0, 100, &ev, &n), 0);
        for (int i = 0; i < n && pid == 0; i++)
            if (sscanf(ev[i].message, "worker %d started", &pid) != 1)
                pid = 0;
        store_events_free(ev, n);
        if (pid > 0)
            return pid;
        ck_assert_msg(gpu_now() - t0 < timeout_s, "job %lld: no worker started within %.0f s",
                      (long long)id, timeout_s);
        test_sleep_ms(10);
    }
}

/* The state letter of process pid (its /proc/PID/stat: R, S, D, Z...), '?' when it is gone. */
static char proc_state(int pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE *fp = fopen(path, "r");
    if (fp == NULL)
        return '?';
    size_t n = fread(buf, 1, sizeof(buf) - 1, fp);
    fclose(fp);
    buf[n] = '\0';
    const char *end = strrchr(buf, ')'); /* after the command name, which may hold anything */
    return end != NULL && end[1] == ' ' ? end[2] : '?';
}

/* Whether process pid runs: it exists and is not a zombie. */
static bool running(int pid)
{
    char st = proc_state(pid);
    return st != '?' && st != 'Z' && st != 'X';
}

/* Wait (at most timeout_s) until process pid has exec'd the program name (the basename of
 * /proc/PID/exe) and sleeps in it (the exec is complete: the descriptors it closes are
 * closed); fails the test otherwise. */
static void wait_exec(int pid, const char *name, double timeout_s)
{
    char path[64], exe[PATH_MAX] = "";
    double t0 = gpu_now();
    snprintf(path, sizeof(path), "/proc/%d/exe", pid);
    for (;;) {
        ssize_t n = readlink(path, exe, sizeof(exe) - 1);
        exe[n > 0 ? n : 0] = '\0';
        const char *base = strrchr(exe, '/');
        if (base != NULL && strcmp(base + 1, name) == 0 && proc_state(pid) == 'S')
            return;
        ck_assert_msg(gpu_now() - t0 < timeout_s,
                      "process %d does not sleep in %s after %.0f s (it runs %s, state %c)", pid,
                      name, timeout_s, exe[0] ? exe : "?", proc_state(pid));
        test_sleep_ms(5);
    }
}

/* Wait (at most timeout_s) until the worker pid is gone: exited and reaped by the scheduler
 * (which does so in each turn, whether the store writes or not); fails the test otherwise. */
static void wait_gone(int pid, double timeout_s)
{
    double t0 = gpu_now();
    while (kill(pid, 0) == 0 || errno != ESRCH) {
        ck_assert_msg(gpu_now() - t0 < timeout_s, "worker %d still there after %.0f s (%s)", pid,
                      timeout_s, running(pid) ? "running" : "exited, not reaped");
        test_sleep_ms(10);
    }
}

static bool dir_exists(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* ---- the scheduler ------------------------------------------------------------------------ */

START_TEST(test_job_succeeds)
{
    fixture f;
    store_series se;
    store_checkpoint *ck = NULL;
    int nck = 0, n = 0;
    int fields[2] = {STORE_M_GRAD_NORM, STORE_M_SAMPLES_PER_S};

    setup(&f);
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"ok\",\"steps\":20,\"ckpt\":5}");
    wait_status(&f, id, STORE_SUCCEEDED, 10);
    check_rows(&f, id, STORE_M_LOSS, 20, &se);
    ck_assert(se.points[19].last[0] == 20.5);
    store_series_free(&se);

    /* "NaN" and "Infinity" strings come back as non-finite doubles. */
    ck_assert_int_eq(store_series_query(f.st, id, fields, 2, 0, -1, 0, &se), 0);
    ck_assert_int_eq(se.npoints, 20);
    ck_assert(isnan(se.points[3].last[0]));
    ck_assert(isinf(se.points[3].last[1]) && se.points[3].last[1] > 0);
    store_series_free(&se);
    int mf[2] = {STORE_M_MEM_BYTES, STORE_M_PEAK_MEM_BYTES};
    ck_assert_int_eq(store_series_query(f.st, id, mf, 2, 0, -1, 0, &se), 0);
    ck_assert(se.points[6].last[0] == 1007 && se.points[6].last[1] == 1007);
    store_series_free(&se);

    store_job j = get_job(&f, id);
    ck_assert_int_eq(j.step, 20);
    ck_assert_int_eq(j.checkpoint_step, 20);
    ck_assert_ptr_nonnull(j.summary);
    ck_assert_ptr_nonnull(strstr(j.summary, "\"status\":\"succeeded\""));
    ck_assert_ptr_null(j.error);
    store_job_clear(&j);
    ck_assert_int_eq(store_checkpoint_list(f.st, id, &ck, &nck), 0);
    ck_assert_int_eq(nck, 4);
    for (int i = 0; i < nck; i++)
        ck_assert_int_eq(access(ck[i].path, R_OK), 0);
    free(ck);
    ck_assert_int_eq(count_events(&f, id, "lifecycle", "started"), 1);
    ck_assert_int_eq(count_events(&f, id, "lifecycle", "succeeded"), 1);

    /* The stream: every step in order, each checkpoint after its step, the end last. */
    store_stream_row *rows = NULL;
    ck_assert_int_eq(store_stream_read(f.st, id, 0, 1000, &rows, &n), 0);
    int steps = 0, cks = 0;
    for (int i = 0; i < n; i++) {
        if (rows[i].kind == STORE_SM_STEP)
            ck_assert_int_eq(rows[i].step, ++steps);
        if (rows[i].kind == STORE_SM_CHECKPOINT) {
            ck_assert_int_eq(rows[i].step, steps);
            cks++;
        }
        ck_assert(i == 0 || rows[i].seq > rows[i - 1].seq);
    }
    ck_assert_int_eq(steps, 20);
    ck_assert_int_eq(cks, 4);
    ck_assert(n > 0 && rows[n - 1].kind == STORE_SM_END);
    free(rows);

    daemon_sched_info info;
    daemon_sched_get_info(f.sc, &info);
    ck_assert_int_eq(info.workers_started, 1);
    ck_assert_int_eq(info.workers_failed, 0);
    ck_assert_int_eq(info.running, 0);
    ck_assert_int_eq(info.queued, 0);
    ck_assert_int_eq(info.max_running, 1);
    teardown(&f);
}
END_TEST

START_TEST(test_crash_fails_only_its_job)
{
    fixture f;
    store_series se;
    setup(&f);
    start_sched(&f);
    int64_t bad = submit(&f, "{\"mode\":\"crash\",\"steps\":20}");
    int64_t good = submit(&f, "{\"mode\":\"ok\",\"steps\":8}");
    wait_status(&f, bad, STORE_FAILED, 10);
    store_job j = get_job(&f, bad);
    ck_assert_ptr_nonnull(j.error);
    ck_assert_msg(strstr(j.error, "worker killed by signal 9 (SIGKILL)") != NULL, "%s", j.error);
    ck_assert_msg(strstr(j.error, "boom: the fake worker crashes") != NULL, "%s", j.error);
    store_job_clear(&j);
    wait_status(&f, good, STORE_SUCCEEDED, 10);
    check_rows(&f, good, STORE_M_LOSS, 8, &se);
    store_series_free(&se);
    check_rows(&f, bad, STORE_M_LOSS, 3, &se); /* what it did before the crash is kept */
    store_series_free(&se);
    daemon_sched_info info;
    daemon_sched_get_info(f.sc, &info);
    ck_assert_int_eq(info.workers_started, 2);
    ck_assert_int_eq(info.workers_failed, 1);
    teardown(&f);
}
END_TEST

/* The exit status decides, not the summary: a worker that printed "succeeded" and then died of
 * SIGABRT (status 134 in a shell) has failed. */
START_TEST(test_abort_after_summary_fails)
{
    fixture f;
    store_series se;
    setup(&f);
    start_sched(&f);
    int64_t bad = submit(&f, "{\"mode\":\"abort\",\"steps\":12}");
    int64_t good = submit(&f, "{\"mode\":\"ok\",\"steps\":8}");
    wait_status(&f, bad, STORE_FAILED, 10);
    store_job j = get_job(&f, bad);
    ck_assert_ptr_nonnull(j.error);
    ck_assert_msg(strstr(j.error, "worker killed by signal 6 (SIGABRT)") != NULL, "%s", j.error);
    ck_assert_msg(strstr(j.error, "double free or corruption") != NULL, "%s", j.error);
    ck_assert_int_eq(j.step, 12);
    store_job_clear(&j);
    ck_assert_int_eq(count_events(&f, bad, "lifecycle", "failed: worker killed by signal 6"), 1);
    ck_assert_int_eq(count_events(&f, bad, "lifecycle", "succeeded"), 0);
    check_rows(&f, bad, STORE_M_LOSS, 12, &se); /* every step it printed is kept */
    ck_assert(se.points[11].last[0] == 12.5);
    store_series_free(&se);
    wait_status(&f, good, STORE_SUCCEEDED, 10);
    check_rows(&f, good, STORE_M_LOSS, 8, &se);
    store_series_free(&se);
    daemon_sched_info info;
    daemon_sched_get_info(f.sc, &info);
    ck_assert_int_eq(info.workers_started, 2);
    ck_assert_int_eq(info.workers_failed, 1);
    teardown(&f);
}
END_TEST

START_TEST(test_hung_worker_is_killed)
{
    fixture f;
    setup(&f);
    f.cfg.worker_timeout_s = 1;
    start_sched(&f);
    double t0 = gpu_now();
    int64_t id = submit(&f, "{\"mode\":\"hang\"}");
    wait_status(&f, id, STORE_FAILED, 10);
    ck_assert(gpu_now() - t0 >= 1.0);
    store_job j = get_job(&f, id);
    ck_assert_msg(strncmp(j.error, "hung: no output for 1 s", 23) == 0, "%s", j.error);
    store_job_clear(&j);
    teardown(&f);
}
END_TEST

START_TEST(test_failed_worker_reason)
{
    fixture f;
    setup(&f);
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"fail\"}");
    wait_status(&f, id, STORE_FAILED, 10);
    store_job j = get_job(&f, id);
    ck_assert_msg(strstr(j.error, "loss scale stuck (worker exited with status 1)") != NULL, "%s",
                  j.error);
    ck_assert_msg(strstr(j.error, "fake failure on stderr") != NULL, "%s", j.error);
    ck_assert_ptr_nonnull(j.summary);
    store_job_clear(&j);
    teardown(&f);
}
END_TEST

START_TEST(test_cancel_and_resume)
{
    fixture f;
    store_series se;
    char log[600], buf[4096];
    setup(&f);
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"slow\",\"steps\":40,\"ckpt\":10,\"delay\":0.02}");
    wait_step(&f, id, 5, 10);
    ck_assert_int_eq(daemon_sched_cancel(f.sc, id), 0);
    wait_status(&f, id, STORE_CANCELLED, 10);
    store_job j = get_job(&f, id);
    int64_t at = j.checkpoint_step;
    ck_assert_int_ge(at, 5);
    ck_assert_int_lt(at, 40);
    ck_assert(j.cancel_requested);
    store_job_clear(&j);
    ck_assert_int_eq(daemon_sched_cancel(f.sc, id), STORE_ECONFLICT);
    ck_assert_int_eq(daemon_sched_cancel(f.sc, 12345), STORE_ENOTFOUND);

    ck_assert_int_eq(daemon_sched_resume(f.sc, id), 0);
    wait_status(&f, id, STORE_SUCCEEDED, 20);
    check_rows(&f, id, STORE_M_LOSS, 40, &se);
    store_series_free(&se);
    ck_assert_int_eq(count_events(&f, id, "lifecycle", "resumed from the checkpoint"), 1);
    ck_assert_int_eq(daemon_sched_resume(f.sc, id), STORE_ECONFLICT);

    snprintf(log, sizeof(log), "%s/data/jobs/%lld/worker.log", f.dir, (long long)id);
    FILE *lf = fopen(log, "r");
    ck_assert_ptr_nonnull(lf);
    size_t n = fread(buf, 1, sizeof(buf) - 1, lf);
    buf[n] = '\0';
    fclose(lf);
    snprintf(log, sizeof(log), "resuming from %s/data/jobs/%lld/ckpt-%lld.safetensors", f.dir,
             (long long)id, (long long)at);
    ck_assert_msg(strstr(buf, log) != NULL, "%s", buf);
    teardown(&f);
}
END_TEST

START_TEST(test_cancel_queued)
{
    fixture f;
    setup(&f);
    start_sched(&f);
    int64_t first = submit(&f, "{\"mode\":\"hang\"}");
    int64_t second = submit(&f, "{\"mode\":\"ok\"}");
    wait_status(&f, first, STORE_RUNNING, 10);
    ck_assert_int_eq(daemon_sched_cancel(f.sc, second), 0);
    store_job j = get_job(&f, second);
    ck_assert_int_eq(j.status, STORE_CANCELLED); /* at once */
    store_job_clear(&j);
    ck_assert_int_eq(daemon_sched_delete(f.sc, first), STORE_ECONFLICT);
    /* A worker that dies of the SIGTERM without a checkpoint is still cancelled. */
    ck_assert_int_eq(daemon_sched_cancel(f.sc, first), 0);
    wait_status(&f, first, STORE_CANCELLED, 10);
    j = get_job(&f, first);
    ck_assert_int_eq(j.checkpoint_step, 0);
    store_job_clear(&j);
    /* Resume without a checkpoint starts from scratch. */
    teardown(&f);
}
END_TEST

START_TEST(test_worker_descriptors)
{
    fixture f;
    char path[600], target[600];
    setup(&f);
    start_sched(&f);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGUSR2, SIG_IGN);
    int64_t id = submit(&f, "{\"mode\":\"fds\"}");
    int pid = worker_pid(&f, id, 10);
    /* until bash has exec'd sleep it holds the script open (fd 255) */
    wait_exec(pid, "sleep", 10);
    snprintf(path, sizeof(path), "/proc/%d/fd", pid);
    DIR *d = opendir(path);
    ck_assert_ptr_nonnull(d);
    struct dirent *e;
    int nfd = 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        ck_assert_msg(atoi(e->d_name) <= 2, "the worker inherited descriptor %s", e->d_name);
        nfd++;
    }
    closedir(d);
    ck_assert_int_eq(nfd, 3);
    snprintf(path, sizeof(path), "/proc/%d/fd/2", pid);
    ssize_t tl = readlink(path, target, sizeof(target) - 1);
    ck_assert_int_gt(tl, 0);
    target[tl] = '\0';
    ck_assert_ptr_nonnull(strstr(target, "/worker.log"));
    ck_assert_int_eq(getpgid(pid), pid);
    /* No signal blocked or ignored, though this process ignores SIGPIPE and SIGUSR2 (glibc's
     * own signals 32 and 33, which sigaction() cannot change, are not looked at). */
    snprintf(path, sizeof(path), "/proc/%d/status", pid);
    FILE *sf = fopen(path, "r");
    ck_assert_ptr_nonnull(sf);
    char line[256];
    int seen = 0;
    while (fgets(line, sizeof(line), sf)) {
        if (strncmp(line, "SigBlk:", 7) == 0 || strncmp(line, "SigIgn:", 7) == 0) {
            unsigned long long mask = strtoull(line + 7, NULL, 16);
            ck_assert_msg((mask & ~(3ULL << 31)) == 0, "%s", line);
            seen++;
        }
    }
    fclose(sf);
    ck_assert_int_eq(seen, 2);
    ck_assert_int_eq(daemon_sched_cancel(f.sc, id), 0);
    wait_status(&f, id, STORE_CANCELLED, 10);
    teardown(&f);
}
END_TEST

/* A handler of the test process; if it ever runs in a worker (between fork and exec) it
 * leaves a mark. */
static char term_mark[300];
static void on_term(int sig)
{
    int fd = open(term_mark, O_WRONLY | O_CREAT | O_APPEND, 0600);
    (void)sig;
    if (fd >= 0)
        close(fd);
    _exit(3);
}

START_TEST(test_cancel_at_spawn)
{
    fixture f;
    struct sigaction sa, old;
    setup(&f);
    snprintf(term_mark, sizeof(term_mark), "%s/handler-ran", f.dir);
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, &old);
    signal(SIGUSR2, SIG_IGN);
    start_sched(&f);
    for (int i = 0; i < 10; i++) {
        int64_t id = submit(&f, "{\"mode\":\"hang\"}");
        double t0 = gpu_now();
        for (;;) { /* cancel the moment the job runs: its worker may not have exec'd yet */
            store_job j = get_job(&f, id);
            store_status st = j.status;
            store_job_clear(&j);
            if (st == STORE_RUNNING)
                break;
            ck_assert(gpu_now() - t0 < 10);
        }
        ck_assert_int_eq(daemon_sched_cancel(f.sc, id), 0);
        wait_status(&f, id, STORE_CANCELLED, 10);
    }
    ck_assert_msg(access(term_mark, F_OK) != 0, "a worker ran the parent's SIGTERM handler");
    sigaction(SIGTERM, &old, NULL);
    teardown(&f);
}
END_TEST

START_TEST(test_recovery_after_crash)
{
    fixture f;
    store_series se;
    store_metric m;
    int64_t id, spent;
    bool existed;
    char dir[600], ck[1400];
    setup(&f);

    /* What a daemon killed with -9 leaves: a running job with a checkpoint at step 10 and
     * metric rows up to 13; a job already restarted max_retries times. */
    ck_assert_int_eq(store_job_insert(f.st, "crashed", "fp32", 20,
                                      "{\"mode\":\"ok\",\"steps\":20,\"ckpt\":5}", NULL, &id,
                                      &existed),
                     0);
    ck_assert_int_eq(store_job_set_status(f.st, id, STORE_RUNNING, NULL), 0);
    snprintf(dir, sizeof(dir), "%s/data/jobs/%lld", f.dir, (long long)id);
    snprintf(ck, sizeof(ck), "mkdir -p %s && echo w > %s/ckpt-10.safetensors", dir, dir);
    ck_assert_int_eq(system(ck), 0);
    snprintf(ck, sizeof(ck), "%s/ckpt-10.safetensors", dir);
    ck_assert_int_eq(store_checkpoint_add(f.st, id, 10, ck, 2), 0);
    ck_assert_int_eq(store_job_set_checkpoint(f.st, id, 10), 0);
    for (int s = 1; s <= 13; s++) {
        memset(&m, 0, sizeof(m));
        m.job_id = id;
        m.step = s;
        for (int k = 0; k < STORE_M_NFIELDS; k++)
            m.v[k] = NAN;
        m.v[STORE_M_LOSS] = 100 + s;
        ck_assert_int_eq(store_metric_append(f.st, &m), 0);
    }
    ck_assert_int_eq(
        store_job_insert(f.st, "spent", "fp32", 20, "{\"mode\":\"ok\"}", NULL, &spent, &existed),
        0);
    ck_assert_int_eq(store_job_set_status(f.st, spent, STORE_INTERRUPTED, NULL), 0);
    ck_assert_int_eq(store_job_set_retries(f.st, spent, 3), 0);
    ck_assert_int_eq(store_flush(f.st), 0);

    start_sched(&f);
    wait_status(&f, id, STORE_SUCCEEDED, 10);
    check_rows(&f, id, STORE_M_LOSS, 20, &se);
    for (int i = 0; i < 10; i++) /* rows up to the checkpoint are the first run's */
        ck_assert(se.points[i].last[0] == 101 + i);
    for (int i = 10; i < 20; i++) /* 11..13 were replaced, not duplicated */
        ck_assert(se.points[i].last[0] == i + 1.5);
    store_series_free(&se);
    store_job j = get_job(&f, id);
    ck_assert_int_eq(j.retries, 1);
    store_job_clear(&j);
    j = get_job(&f, spent);
    ck_assert_int_eq(j.status, STORE_FAILED);
    ck_assert_msg(strstr(j.error, "interrupted too often") != NULL, "%s", j.error);
    store_job_clear(&j);
    teardown(&f);
}
END_TEST

/* A daemon killed with -9 left job id running with checkpoints at 5, 10 and 15 (files for
 * those in `files`, records for all three, the last at 15) and metric rows 1..13 whose
 * loss is 100 + step. */
static int64_t crashed_job(fixture *f, const char *spec, const int *files, int nfiles)
{
    store_metric m;
    int64_t id;
    bool existed;
    char dir[600], cmd[1400], ck[700];
    ck_assert_int_eq(store_job_insert(f->st, "crashed", "fp32", 20, spec, NULL, &id, &existed), 0);
    ck_assert_int_eq(store_job_set_status(f->st, id, STORE_RUNNING, NULL), 0);
    snprintf(dir, sizeof(dir), "%s/data/jobs/%lld", f->dir, (long long)id);
    snprintf(cmd, sizeof(cmd), "mkdir -p %s", dir);
    ck_assert_int_eq(system(cmd), 0);
    for (int i = 0; i < nfiles; i++) {
        snprintf(cmd, sizeof(cmd), "echo w > %s/ckpt-%d.safetensors", dir, files[i]);
        ck_assert_int_eq(system(cmd), 0);
    }
    for (int s = 5; s <= 15; s += 5) {
        snprintf(ck, sizeof(ck), "%s/ckpt-%d.safetensors", dir, s);
        ck_assert_int_eq(store_checkpoint_add(f->st, id, s, ck, 2), 0);
    }
    ck_assert_int_eq(store_job_set_checkpoint(f->st, id, 15), 0);
    for (int s = 1; s <= 13; s++) {
        memset(&m, 0, sizeof(m));
        m.job_id = id;
        m.step = s;
        for (int k = 0; k < STORE_M_NFIELDS; k++)
            m.v[k] = NAN;
        m.v[STORE_M_LOSS] = 100 + s;
        ck_assert_int_eq(store_metric_append(f->st, &m), 0);
    }
    ck_assert_int_eq(store_flush(f->st), 0);
    return id;
}

/* Steps 1..from keep the first run's rows, the later ones are the rerun's, and the job's
 * stream has each step once. */
static void check_resumed_rows(fixture *f, int64_t id, int64_t from)
{
    store_series se;
    store_stream_row *rows = NULL;
    int n = 0, steps = 0;
    check_rows(f, id, STORE_M_LOSS, 20, &se);
    for (int i = 0; i < 20; i++)
        ck_assert_msg(se.points[i].last[0] == (i < from ? 101 + i : i + 1.5),
                      "step %d: loss %g (resumed after step %lld)", i + 1, se.points[i].last[0],
                      (long long)from);
    store_series_free(&se);
    ck_assert_int_eq(store_stream_read(f->st, id, 0, 1000, &rows, &n), 0);
    for (int i = 0; i < n; i++)
        if (rows[i].kind == STORE_SM_STEP)
            ck_assert_int_eq(rows[i].step, ++steps);
    ck_assert_int_eq(steps, 20);
    free(rows);
}

START_TEST(test_restart_skips_missing_checkpoint)
{
    fixture f;
    static const int files[] = {5, 10}; /* ckpt-15's file is gone */
    setup(&f);
    int64_t id = crashed_job(&f, "{\"mode\":\"ok\",\"steps\":20,\"ckpt\":5}", files, 2);
    start_sched(&f);
    wait_status(&f, id, STORE_SUCCEEDED, 10);
    /* from 10, the newest checkpoint left: not from scratch */
    check_resumed_rows(&f, id, 10);
    ck_assert_int_eq(
        count_events(&f, id, "checkpoint",
                     "skipped the checkpoint at step 15 (ckpt-15.safetensors): missing"),
        1);
    ck_assert_int_eq(count_events(&f, id, "lifecycle", "resumed from the checkpoint at step 10"),
                     1);
    teardown(&f);
}
END_TEST

START_TEST(test_worker_walks_back)
{
    fixture f;
    static const int files[] = {5, 10, 15};
    setup(&f);
    /* the worker finds ckpt-15 damaged and continues from 10 */
    int64_t id =
        crashed_job(&f, "{\"mode\":\"ok\",\"steps\":20,\"ckpt\":5,\"walkback\":5}", files, 3);
    start_sched(&f);
    wait_status(&f, id, STORE_SUCCEEDED, 10);
    check_resumed_rows(&f, id, 10);
    ck_assert_int_eq(count_events(&f, id, "checkpoint",
                                  "skipped the checkpoint at step 15 (ckpt-15.safetensors): "
                                  "checksum mismatch: fake"),
                     1);
    ck_assert_int_eq(count_events(&f, id, "lifecycle",
                                  "resumed from the checkpoint at step 10, the newest that "
                                  "verifies (1 newer skipped)"),
                     1);
    teardown(&f);
}
END_TEST

START_TEST(test_stop_interrupts_and_restart_resumes)
{
    fixture f;
    store_series se;
    setup(&f);
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"slow\",\"steps\":30,\"ckpt\":100,\"delay\":0.02}");
    int64_t queued = submit(&f, "{\"mode\":\"ok\",\"steps\":5}");
    wait_step(&f, id, 4, 10);
    daemon_sched_stop(f.sc);
    f.sc = NULL;
    store_job j = get_job(&f, id);
    ck_assert_int_eq(j.status, STORE_INTERRUPTED);
    ck_assert_int_ge(j.checkpoint_step, 4); /* the checkpoint taken on SIGTERM */
    store_job_clear(&j);
    j = get_job(&f, queued);
    ck_assert_int_eq(j.status, STORE_QUEUED);
    store_job_clear(&j);

    start_sched(&f);
    wait_status(&f, id, STORE_SUCCEEDED, 20);
    wait_status(&f, queued, STORE_SUCCEEDED, 10);
    check_rows(&f, id, STORE_M_LOSS, 30, &se);
    store_series_free(&se);
    j = get_job(&f, id);
    ck_assert_int_eq(j.retries, 1);
    store_job_clear(&j);
    teardown(&f);
}
END_TEST

START_TEST(test_two_slots)
{
    fixture f;
    store_series se;
    daemon_sched_info info;
    setup(&f);
    f.cfg.max_running = 2;
    start_sched(&f);
    int64_t a = submit(&f, "{\"mode\":\"slow\",\"steps\":25,\"delay\":0.02}");
    int64_t b = submit(&f, "{\"mode\":\"slow\",\"steps\":25,\"delay\":0.02}");
    int64_t c = submit(&f, "{\"mode\":\"ok\",\"steps\":5}");
    wait_step(&f, a, 2, 10);
    wait_step(&f, b, 2, 10);
    daemon_sched_get_info(f.sc, &info);
    ck_assert_int_eq(info.running, 2);
    ck_assert_int_eq(info.queued, 1);
    ck_assert_int_eq(info.max_running, 2);
    store_job j = get_job(&f, c);
    ck_assert_int_eq(j.status, STORE_QUEUED); /* both slots are taken */
    store_job_clear(&j);
    wait_status(&f, a, STORE_SUCCEEDED, 20);
    wait_status(&f, b, STORE_SUCCEEDED, 20);
    wait_status(&f, c, STORE_SUCCEEDED, 20);
    check_rows(&f, a, STORE_M_LOSS, 25, &se);
    store_series_free(&se);
    check_rows(&f, b, STORE_M_LOSS, 25, &se);
    store_series_free(&se);
    teardown(&f);
}
END_TEST

START_TEST(test_overflow_events)
{
    fixture f;
    store_series se;
    setup(&f);
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"overflow\",\"steps\":6}");
    wait_status(&f, id, STORE_SUCCEEDED, 10);
    check_rows(&f, id, STORE_M_OVERFLOW, 6, &se);
    ck_assert(se.points[0].last[0] == 1 && se.points[3].last[0] == 0);
    store_series_free(&se);
    ck_assert_int_eq(count_events(&f, id, "overflow", NULL), 3);
    ck_assert_int_eq(
        count_events(&f, id, "overflow",
                     "step 1: gradients overflowed; optimizer step skipped; loss scale 8 -> 4"),
        1);
    ck_assert_int_eq(count_events(&f, id, "overflow", "step 3: gradients overflowed"), 1);
    ck_assert_int_eq(count_events(&f, id, "overflow", "loss scale 2 -> 1"), 1);
    ck_assert_int_eq(count_events(&f, id, "scale", NULL), 3);
    ck_assert_int_eq(count_events(&f, id, "scale", "after step 2: loss scale 4 -> 2 (backoff)"), 1);
    teardown(&f);
}
END_TEST

START_TEST(test_long_and_garbage_lines)
{
    fixture f;
    store_series se;
    store_layer_stat *rows = NULL;
    int64_t at;
    int n;
    setup(&f);
    start_sched(&f);
    int64_t a = submit(&f, "{\"mode\":\"longline\",\"steps\":6}");
    int64_t b = submit(&f, "{\"mode\":\"garbage\",\"steps\":6}");
    wait_status(&f, a, STORE_SUCCEEDED, 10);
    wait_status(&f, b, STORE_SUCCEEDED, 10);
    check_rows(&f, a, STORE_M_LOSS, 6, &se);
    store_series_free(&se);
    check_rows(&f, b, STORE_M_LOSS, 6, &se);
    store_series_free(&se);
    /* a layers line without layers or without a step is dropped; a nameless layer ends
     * the list; event lines with a bad kind or no message are dropped */
    ck_assert_int_eq(store_layer_stats_get(f.st, b, 2, &rows, &n, &at, NULL), STORE_ENOTFOUND);
    ck_assert_int_eq(store_layer_stats_get(f.st, b, -1, &rows, &n, &at, NULL), 0);
    ck_assert_int_eq(at, 3);
    ck_assert_int_eq(n, 0);
    free(rows);
    ck_assert_int_eq(count_events(&f, b, "recommendation", NULL), 0);
    ck_assert_int_eq(count_events(&f, b, "Bad Kind", NULL), 0);
    teardown(&f);
}
END_TEST

START_TEST(test_layers_and_recommendations)
{
    fixture f;
    store_layer_stat *rows = NULL;
    store_layer_info info;
    store_layer_range lr;
    store_event *ev = NULL;
    int64_t at;
    int n, nev = 0, fields[2] = {STORE_L_ACT_OVERFLOW, STORE_L_ACT_HEADROOM};

    setup(&f);
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"overflow\",\"steps\":6,\"diag\":2}");
    wait_status(&f, id, STORE_SUCCEEDED, 10);
    ck_assert_int_eq(store_flush(f.st), 0);

    /* the latest diagnosed step: every field as the worker printed it */
    ck_assert_int_eq(store_layer_stats_get(f.st, id, -1, &rows, &n, &at, &info), 0);
    ck_assert_int_eq(at, 6);
    ck_assert_int_eq(n, 2);
    ck_assert_str_eq(rows[0].name, "fc1");
    ck_assert_str_eq(rows[0].dtype, "fp16");
    ck_assert(rows[0].v[STORE_L_ACT_AMAX] == 6.5);
    ck_assert(rows[0].v[STORE_L_ACT_HEADROOM] == 32.75);
    ck_assert(rows[0].v[STORE_L_GRAD_AMAX] == 0.125);
    ck_assert(rows[0].v[STORE_L_GRAD_UNDERFLOW] == 0.25);
    ck_assert(rows[0].v[STORE_L_GRAD_UNDERFLOW_UNSCALED] == 0.75);
    /* an fp16 layer reports every field but the fp8 ones */
    const unsigned fp8_bits = ((1u << STORE_L_NFIELDS) - 1) & ~((1u << STORE_L_FP8_IN_AMAX) - 1);
    ck_assert_uint_eq(rows[0].missing, fp8_bits);
    ck_assert_str_eq(rows[1].name, "fc2");
    ck_assert(isinf(rows[1].v[STORE_L_ACT_HEADROOM]) && rows[1].v[STORE_L_ACT_HEADROOM] > 0);
    ck_assert(isnan(rows[1].v[STORE_L_GRAD_UNDERFLOW]));
    ck_assert(rows[1].v[STORE_L_GRAD_AMAX] == 0.0625);
    ck_assert(rows[1].v[STORE_L_ACT_OVERFLOW] == 0);
    ck_assert_uint_eq(rows[1].missing, fp8_bits);
    ck_assert(info.scale == 1);
    ck_assert_str_eq(info.first_layer, "");
    ck_assert_uint_eq(info.flags, 0);
    free(rows);

    /* an overflowing step: its scale, the first non-finite layer, the counts */
    ck_assert_int_eq(store_layer_stats_get(f.st, id, 1, &rows, &n, &at, &info), 0);
    ck_assert_int_eq(n, 2);
    ck_assert(info.scale == 8);
    ck_assert_str_eq(info.first_layer, "fc2");
    ck_assert_str_eq(info.first_where, "forward");
    ck_assert_uint_eq(info.flags, STORE_LS_NONFINITE | STORE_LS_OVERFLOW);
    ck_assert(rows[1].v[STORE_L_ACT_OVERFLOW] == 5 && rows[1].v[STORE_L_GRAD_NONFINITE] == 5);
    ck_assert(isnan(rows[1].v[STORE_L_GRAD_AMAX]));
    free(rows);
    ck_assert_int_eq(store_layer_stats_get(f.st, id, 5, &rows, &n, &at, NULL), STORE_ENOTFOUND);

    /* every overflowing step and every second step was diagnosed */
    ck_assert_int_eq(store_layer_stats_range(f.st, id, 0, -1, 100, fields, 2, &lr), 0);
    ck_assert_int_eq(lr.nsteps, 5);
    static const int64_t want_steps[] = {1, 2, 3, 4, 6};
    for (int k = 0; k < 5; k++)
        ck_assert_int_eq(lr.steps[k], want_steps[k]);
    ck_assert_int_eq(lr.nlayers, 2);
    ck_assert(lr.values[STORE_LR_AT(&lr, 1, 0, 2)] == 5 &&
              lr.values[STORE_LR_AT(&lr, 1, 0, 3)] == 0);
    store_layer_range_free(&lr);

    /* recommendations are events (with the layer as data); a worker event of a kind the
     * daemon writes itself is not taken */
    ck_assert_int_eq(count_events(&f, id, "recommendation", NULL), 2);
    ck_assert_int_eq(count_events(&f, id, "scale", NULL), 3);
    ck_assert_int_eq(count_events(&f, id, "scale", "not the daemon"), 0);
    ck_assert_int_eq(store_event_list(f.st, id, 0, 1000, &ev, &nev), 0);
    int with_layer = 0, without = 0;
    for (int i = 0; i < nev; i++) {
        if (strcmp(ev[i].kind, "recommendation") != 0)
            continue;
        ck_assert_int_eq(ev[i].step, 1);
        if (ev[i].data) {
            ck_assert_str_eq(ev[i].data, "{\"layer\":\"fc1\"}");
            ck_assert_ptr_nonnull(strstr(ev[i].message, "fc1 flush to zero"));
            with_layer++;
        } else {
            ck_assert_str_eq(ev[i].message, "loss scale pinned at its minimum");
            without++;
        }
    }
    ck_assert_int_eq(with_layer, 1);
    ck_assert_int_eq(without, 1);
    store_events_free(ev, nev);

    /* the stream has the diagnosed steps and the recommendations, after their step */
    store_stream_row *srows = NULL;
    ck_assert_int_eq(store_stream_read(f.st, id, 0, 1000, &srows, &n), 0);
    int nlayers = 0, nevents = 0;
    int64_t last_step = 0;
    for (int i = 0; i < n; i++) {
        if (srows[i].kind == STORE_SM_STEP)
            last_step = srows[i].step;
        if (srows[i].kind == STORE_SM_LAYERS) {
            ck_assert_int_eq(srows[i].step, last_step);
            nlayers++;
        }
        nevents += srows[i].kind == STORE_SM_EVENT;
    }
    ck_assert_int_eq(nlayers, 5);
    ck_assert_int_ge(nevents, 2);
    free(srows);
    teardown(&f);
}
END_TEST

START_TEST(test_delete)
{
    fixture f;
    char dir[600];
    setup(&f);
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"ok\",\"steps\":3,\"ckpt\":1}");
    wait_status(&f, id, STORE_SUCCEEDED, 10);
    snprintf(dir, sizeof(dir), "%s/data/jobs/%lld", f.dir, (long long)id);
    ck_assert(dir_exists(dir));
    ck_assert_int_eq(daemon_sched_delete(f.sc, id), 0);
    ck_assert(!dir_exists(dir));
    store_job j;
    ck_assert_int_eq(store_job_get(f.st, id, &j), STORE_ENOTFOUND);
    ck_assert_int_eq(daemon_sched_delete(f.sc, id), STORE_ENOTFOUND);
    ck_assert_int_eq(daemon_sched_resume(f.sc, id), STORE_ENOTFOUND);
    teardown(&f);
}
END_TEST

START_TEST(test_bad_worker_binary)
{
    fixture f;
    setup(&f);
    snprintf(f.cfg.exe, sizeof(f.cfg.exe), "%s/no-such-ampd", f.dir);
    start_sched(&f);
    int64_t id = submit(&f, "{}");
    wait_status(&f, id, STORE_FAILED, 10);
    store_job j = get_job(&f, id);
    ck_assert_msg(strstr(j.error, "worker exited with status 127") != NULL, "%s", j.error);
    ck_assert_msg(strstr(j.error, "cannot execute the worker binary") != NULL, "%s", j.error);
    store_job_clear(&j);
    teardown(&f);
}
END_TEST

START_TEST(test_idempotent_submit)
{
    fixture f;
    int64_t a, b;
    bool existed;
    setup(&f);
    start_sched(&f);
    ck_assert_int_eq(
        daemon_sched_submit(f.sc, "t", "fp32", 3, "{\"steps\":3}", "key-1", &a, &existed), 0);
    ck_assert(!existed);
    ck_assert_int_eq(
        daemon_sched_submit(f.sc, "t", "fp32", 3, "{\"steps\":3}", "key-1", &b, &existed), 0);
    ck_assert(existed);
    ck_assert_int_eq(a, b);
    wait_status(&f, a, STORE_SUCCEEDED, 10);
    teardown(&f);
}
END_TEST

/* ---- a store that cannot write (store_test_fault: every write fails as on a full disk) ---- */

/* Wait until the store's health code is code, at most timeout_s. */
static void wait_health(fixture *f, int code, double timeout_s)
{
    double t0 = gpu_now();
    store_health h;
    for (;;) {
        store_get_health(f->st, &h);
        if (h.code == code)
            return;
        ck_assert_msg(gpu_now() - t0 < timeout_s, "store health %d, expected %d", h.code, code);
        test_sleep_ms(10);
    }
}

/* The status of job now (the store's). */
static store_status status_of(fixture *f, int64_t id)
{
    store_job j = get_job(f, id);
    store_status st = j.status;
    store_job_clear(&j);
    return st;
}

/* The number of checkpoints recorded for job. */
static int count_checkpoints(fixture *f, int64_t id)
{
    store_checkpoint *ck = NULL;
    int n = 0;
    ck_assert_int_eq(store_checkpoint_list(f->st, id, &ck, &n), 0);
    free(ck);
    return n;
}

/* While the store cannot write, the scheduler stops reading the worker (it waits on its
 * pipe) without counting that against worker_timeout_s; nothing is lost, and the job
 * runs to its end once the store writes again. */
START_TEST(test_store_full_pauses_worker)
{
    fixture f;
    store_series se;
    setup(&f);
    f.cfg.worker_timeout_s = 1;
    start_sched(&f);
    /* 115 steps after step 5 sleep 5.75 s in all: the worker outlives the pause below */
    int64_t id = submit(&f, "{\"mode\":\"slow\",\"steps\":120,\"ckpt\":20,\"delay\":0.05}");
    wait_step(&f, id, 5, 30);
    int pid = worker_pid(&f, id, 10);
    ck_assert_int_eq(store_test_fault(f.st, STORE_EFULL), 0);
    wait_health(&f, STORE_EFULL, 5);
    /* The time itself is what is tested: unread for longer than worker_timeout_s (and a
     * scheduler turn), and than the three attempts of old, the worker runs on. */
    for (double t0 = gpu_now(); gpu_now() - t0 < 2.5; test_sleep_ms(20))
        ck_assert_msg(running(pid), "worker %d ended %.2f s into the pause", pid, gpu_now() - t0);
    ck_assert_int_eq(status_of(&f, id), STORE_RUNNING);
    daemon_sched_info info;
    daemon_sched_get_info(f.sc, &info);
    ck_assert_int_eq(info.running, 1);
    ck_assert_int_eq(info.workers_failed, 0);
    ck_assert_int_eq(store_test_fault(f.st, 0), 0);
    wait_status(&f, id, STORE_SUCCEEDED, 60);
    check_rows(&f, id, STORE_M_LOSS, 120, &se);
    store_series_free(&se);
    store_job j = get_job(&f, id);
    ck_assert_int_eq(j.step, 120);
    ck_assert_int_eq(j.checkpoint_step, 120);
    ck_assert_ptr_nonnull(j.summary);
    ck_assert_ptr_null(j.error);
    store_job_clear(&j);
    ck_assert_int_eq(count_checkpoints(&f, id), 6);
    ck_assert_int_eq(count_events(&f, id, "lifecycle", "succeeded"), 1);
    teardown(&f);
}
END_TEST

/* A worker that ends while the store cannot write: its end (status, summary, checkpoints,
 * every row) is recorded once it can, and meanwhile the job stays running with its worker
 * in the table; a queued job does not start. */
START_TEST(test_store_full_job_ends)
{
    fixture f;
    store_series se;
    setup(&f);
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"slow\",\"steps\":20,\"ckpt\":5,\"delay\":0.02}");
    int64_t next = submit(&f, "{\"mode\":\"ok\",\"steps\":3}");
    wait_step(&f, id, 2, 10);
    int pid = worker_pid(&f, id, 10);
    ck_assert_int_eq(store_test_fault(f.st, STORE_EFULL), 0);
    wait_gone(pid, 30); /* it printed its last lines (the pipe holds them), exited, was reaped */
    ck_assert_int_eq(status_of(&f, id), STORE_RUNNING);
    ck_assert_int_eq(status_of(&f, next), STORE_QUEUED);
    daemon_sched_info info;
    daemon_sched_get_info(f.sc, &info);
    ck_assert_int_eq(info.running, 1);
    ck_assert_int_eq(store_test_fault(f.st, 0), 0);
    wait_status(&f, id, STORE_SUCCEEDED, 20);
    check_rows(&f, id, STORE_M_LOSS, 20, &se);
    store_series_free(&se);
    store_job j = get_job(&f, id);
    ck_assert_int_eq(j.checkpoint_step, 20);
    ck_assert_ptr_nonnull(j.summary);
    ck_assert_ptr_nonnull(strstr(j.summary, "\"status\":\"succeeded\""));
    store_job_clear(&j);
    ck_assert_int_eq(count_checkpoints(&f, id), 4);
    ck_assert_int_eq(count_events(&f, id, "lifecycle", "succeeded"), 1);
    store_stream_row *rows = NULL;
    int n = 0, steps = 0;
    ck_assert_int_eq(store_stream_read(f.st, id, 0, 1000, &rows, &n), 0);
    for (int i = 0; i < n; i++)
        if (rows[i].kind == STORE_SM_STEP)
            ck_assert_int_eq(rows[i].step, ++steps);
    ck_assert_int_eq(steps, 20);
    ck_assert(n > 0 && rows[n - 1].kind == STORE_SM_END);
    free(rows);
    wait_status(&f, next, STORE_SUCCEEDED, 20);
    teardown(&f);
}
END_TEST

/* Checkpoint lines the store cannot take wait in their order: a checkpoint_drop waits behind
 * the newer checkpoint whose line came before it, so no file is deleted before that one is
 * recorded, and once the store writes the records are exactly the files kept. */
START_TEST(test_store_full_drops_wait)
{
    fixture f;
    char dir[600], path[700];
    store_checkpoint *ck = NULL;
    int n = 0, files = 0;
    setup(&f);
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"slow\",\"steps\":20,\"ckpt\":4,\"keep\":2,"
                            "\"delay\":0.02}");
    wait_step(&f, id, 2, 10);
    int pid = worker_pid(&f, id, 10);
    ck_assert_int_eq(store_test_fault(f.st, STORE_EFULL), 0);
    wait_gone(pid, 30); /* the worker checkpointed, dropped, exited and was reaped meanwhile */
    snprintf(dir, sizeof(dir), "%s/jobs/%lld", f.cfg.data_dir, (long long)id);
    ck_assert_int_eq(store_checkpoint_list(f.st, id, &ck, &n), 0);
    for (int i = 0; i < n; i++) /* what is recorded is there */
        ck_assert_msg(access(ck[i].path, R_OK) == 0, "%s is recorded but gone", ck[i].path);
    free(ck);
    ck_assert_int_eq(store_test_fault(f.st, 0), 0);
    wait_status(&f, id, STORE_SUCCEEDED, 20);
    ck_assert_int_eq(store_checkpoint_list(f.st, id, &ck, &n), 0);
    ck_assert_int_eq(n, 2);
    ck_assert_int_eq(ck[0].step, 16);
    ck_assert_int_eq(ck[1].step, 20);
    free(ck);
    for (int s = 4; s <= 20; s += 4) {
        snprintf(path, sizeof(path), "%s/ckpt-%d.safetensors", dir, s);
        files += access(path, F_OK) == 0;
    }
    ck_assert_int_eq(files, 2);
    teardown(&f);
}
END_TEST

/* A worker that waits for the store longer than stall_timeout_s is stopped; its job fails
 * with the reason, recorded (with every row it printed) once the store writes again. */
START_TEST(test_store_stall_fails_job)
{
    fixture f;
    store_series se;
    setup(&f);
    f.cfg.stall_timeout_s = 1;
    start_sched(&f);
    int64_t id = submit(&f, "{\"mode\":\"slow\",\"steps\":2000,\"delay\":0.01}");
    wait_step(&f, id, 3, 10);
    int pid = worker_pid(&f, id, 10);
    ck_assert_int_eq(store_test_fault(f.st, STORE_EFULL), 0);
    wait_gone(pid, 30); /* paused, stopped after 1 s, checkpointed, exited, reaped */
    ck_assert_int_eq(status_of(&f, id), STORE_RUNNING);
    ck_assert_int_eq(store_test_fault(f.st, 0), 0);
    wait_status(&f, id, STORE_FAILED, 20);
    store_job j = get_job(&f, id);
    ck_assert_msg(strstr(j.error, "stopped: the store could not write the run's history for 1 s "
                                  "(the disk is full") != NULL,
                  "%s", j.error);
    int64_t last = j.step;
    ck_assert_int_gt(last, 3);
    ck_assert_int_lt(last, 2000);
    ck_assert_int_eq(j.checkpoint_step, last);
    store_job_clear(&j);
    check_rows(&f, id, STORE_M_LOSS, last, &se);
    store_series_free(&se);
    teardown(&f);
}
END_TEST

/* ---- preemption's choice (queue.c, machine.c) ------------------------------------------------- */

/* A store and the emulator's machine of four GPUs (its NVML stand-in), with jobs placed by
 * the queue's plan as the scheduler does; running ones are marked so in the store. */
typedef struct {
    fixture f;
    daemon_machine *m;
    daemon_queue q;
    api_spec_opts roots;
    queue_running run[8];
    int nrun;
} preempt_fx;

static void preempt_setup(preempt_fx *p)
{
    char err[256];
    memset(p, 0, sizeof(*p));
    setup(&p->f);
    ck_assert_msg(access("tests/cudaemu/libnvidia-ml.so.1", R_OK) == 0,
                  "the NVML stand-in is not built (make check builds it)");
    setenv("AMPD_NVML", "tests/cudaemu/libnvidia-ml.so.1", 1);
    setenv("AMPD_CUDAEMU_DEVICES", "4", 1);
    ck_assert_msg(daemon_machine_new(NULL, NULL, false, &p->m, err, sizeof(err)) == 0, "%s", err);
    unsetenv("AMPD_NVML");
    unsetenv("AMPD_CUDAEMU_DEVICES");
    p->roots.nroots = 0;
}

static void preempt_teardown(preempt_fx *p)
{
    daemon_queue_free(&p->q);
    daemon_machine_free(p->m);
    store_close(p->f.st);
    p->f.st = NULL;
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", p->f.dir);
    ck_assert_int_eq(system(cmd), 0);
}

/* Queue a job of `gpus` GPUs and priority prio; plan: when it starts it runs (started at
 * time t). Returns its id. */
static int64_t preempt_job(preempt_fx *p, int gpus, int prio, double t)
{
    char spec[400];
    int64_t id = 0;
    bool existed;
    daemon_start st[8];
    int n = 0;
    snprintf(spec, sizeof(spec),
             "{\"model\": {\"layers\": [4, 8, 2]}, \"data\": {\"type\": \"synthetic\"}, "
             "\"device\": \"cuda\", \"priority\": %d, \"resources\": {\"devices\": %d}}",
             prio, gpus);
    ck_assert_int_eq(store_job_insert(p->f.st, "t", "fp32", 10, spec, NULL, &id, &existed), 0);
    daemon_queue_plan(p->f.st, p->m, &p->roots, 8, 8, st, &n, &p->q);
    for (int i = 0; i < n; i++) {
        ck_assert_int_eq(store_job_set_status(p->f.st, st[i].job, STORE_RUNNING, NULL), 0);
        p->run[p->nrun++] = (queue_running){st[i].job, st[i].priority, t, false};
    }
    return id;
}

/* The victims the head of the queue names now, as "a,b" in the order given. */
static void preempt_victims(preempt_fx *p, char *out, size_t len)
{
    int64_t v[8];
    int n = 0;
    size_t k = 0;
    daemon_start st[8];
    int ns = 0;
    daemon_queue_plan(p->f.st, p->m, &p->roots, 8, 8, st, &ns, &p->q);
    ck_assert_int_eq(ns, 0);
    daemon_queue_preempt(p->f.st, p->m, p->run, p->nrun, 8, &p->q, v, &n);
    out[0] = '\0';
    for (int i = 0; i < n; i++)
        k += (size_t)snprintf(out + k, len - k, "%s%lld", i ? "," : "", (long long)v[i]);
}

/* Four 1-GPU jobs run (priorities 0, 0, 5, -1); a job of priority 10 that needs one GPU
 * stops the one of priority -1; one that needs two stops it and the later of the two of
 * priority 0 (and, once they are stopping, names nobody more); one of priority -1 stops
 * nobody; one that needs more than the lower ones hold stops nobody either. */
START_TEST(test_preempt_choice)
{
    preempt_fx p;
    char v[64], want[64];
    preempt_setup(&p);
    int64_t a = preempt_job(&p, 1, 0, 1.0), b = preempt_job(&p, 1, 0, 2.0);
    int64_t c = preempt_job(&p, 1, 5, 3.0), d = preempt_job(&p, 1, -1, 4.0);
    ck_assert_int_eq(p.nrun, 4);
    (void)a;
    (void)c;

    int64_t h1 = preempt_job(&p, 1, 10, 5.0);
    preempt_victims(&p, v, sizeof(v));
    snprintf(want, sizeof(want), "%lld", (long long)d);
    ck_assert_str_eq(v, want);
    ck_assert_int_eq(store_job_set_status(p.f.st, h1, STORE_CANCELLED, NULL), 0);

    int64_t h2 = preempt_job(&p, 2, 10, 5.0);
    preempt_victims(&p, v, sizeof(v));
    snprintf(want, sizeof(want), "%lld,%lld", (long long)d, (long long)b);
    ck_assert_str_eq(v, want);
    {
        api_queue_place qp;
        ck_assert_int_eq(daemon_queue_place(&p.q, h2, &qp), 0);
        ck_assert_msg(strstr(qp.waiting_for, "preempting jobs") != NULL, "%s", qp.waiting_for);
    }
    /* once they are stopping, nobody more is named */
    for (int i = 0; i < p.nrun; i++)
        p.run[i].stopping = p.run[i].job == d || p.run[i].job == b;
    preempt_victims(&p, v, sizeof(v));
    ck_assert_str_eq(v, "");
    for (int i = 0; i < p.nrun; i++)
        p.run[i].stopping = false;
    ck_assert_int_eq(store_job_set_status(p.f.st, h2, STORE_CANCELLED, NULL), 0);

    int64_t h3 = preempt_job(&p, 1, -1, 5.0); /* no running job has a lower priority */
    preempt_victims(&p, v, sizeof(v));
    ck_assert_str_eq(v, "");
    ck_assert_int_eq(store_job_set_status(p.f.st, h3, STORE_CANCELLED, NULL), 0);

    preempt_job(&p, 4, 3, 5.0); /* the priority 5 job keeps a GPU it would need */
    preempt_victims(&p, v, sizeof(v));
    ck_assert_str_eq(v, "");
    preempt_teardown(&p);
}
END_TEST

/* The straggler watch: a rank that works 1.5x the others' for two windows is named once;
 * noise below the ratio, or one slow window, is not; it is said to end when it does. */
START_TEST(test_straggler)
{
    daemon_straggle *w = daemon_straggle_new(4);
    double busy[4];
    int rank = -1, got = 0, steps = 0;
    double ratio = 0;
    ck_assert_ptr_nonnull(w);
    /* 3 windows of noise around 10 ms (at most 1.15x), then one slow window of rank 1 */
    for (int i = 0; i < 4 * DAEMON_STRAGGLE_WINDOW; i++, steps++) {
        for (int r = 0; r < 4; r++)
            busy[r] = 10.0 + ((i + r) % 4 == 0 ? 1.5 : 0.0);
        if (i >= 3 * DAEMON_STRAGGLE_WINDOW)
            busy[1] = 15.0;
        ck_assert_int_eq(daemon_straggle_add(w, busy, &rank, &ratio), 0);
    }
    /* rank 2 straggles from here: named at the end of its second window, once */
    for (int i = 0; i < 4 * DAEMON_STRAGGLE_WINDOW; i++, steps++) {
        for (int r = 0; r < 4; r++)
            busy[r] = r == 2 ? 16.0 : 10.0;
        int v = daemon_straggle_add(w, busy, &rank, &ratio);
        if (v) {
            ck_assert_int_eq(v, 1);
            ck_assert_int_eq(got, 0);
            ck_assert_int_eq(i + 1, DAEMON_STRAGGLE_WINDOWS * DAEMON_STRAGGLE_WINDOW);
            ck_assert_int_eq(rank, 2);
            ck_assert_msg(fabs(ratio - 1.6) < 1e-9, "ratio %g", ratio);
            got = 1;
        }
    }
    ck_assert_int_eq(got, 1);
    /* it recovers: said at the end of the first even window */
    for (int i = 0; i < DAEMON_STRAGGLE_WINDOW; i++) {
        for (int r = 0; r < 4; r++)
            busy[r] = 10.0;
        int v = daemon_straggle_add(w, busy, &rank, &ratio);
        ck_assert_int_eq(v, i + 1 == DAEMON_STRAGGLE_WINDOW ? -1 : 0);
    }
    ck_assert_int_eq(rank, 2);
    daemon_straggle_free(w);
    daemon_straggle_free(NULL);
}
END_TEST

/* The ranks' heartbeats after the launcher: the ranks that left theirs behind and went
 * silent first are named, with their host; the start barrier waits for every rank's. */
START_TEST(test_lost_ranks)
{
    char dir[] = "/tmp/ampd-beat-XXXXXX", path[300], why[512];
    double now = (double)time(NULL);
    ck_assert_ptr_nonnull(mkdtemp(dir));
    ck_assert_int_eq(daemon_beat_wait_all(dir, 2, 0.05), -1);
    /* pid host step step_time beat_time: ranks 2 and 3 (n2) went silent 10 s before 0 */
    const char *lines[] = {"11 n1 40", NULL, "13 n2 35", "14 n2 35"};
    double at[] = {now, 0, now - 10, now - 9.5};
    for (int r = 0; r < 4; r++) {
        if (!lines[r])
            continue; /* rank 1 stopped its own */
        snprintf(path, sizeof(path), "%s/rank-%d.beat", dir, r);
        FILE *f = fopen(path, "w");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "%s %.3f %.3f\n", lines[r], at[r], at[r]);
        fclose(f);
    }
    ck_assert_int_eq(daemon_beat_lost(dir, 4, why, sizeof(why)), 2);
    ck_assert_msg(strstr(why, "rank 2 (host n2, pid 13, step 35)") &&
                      strstr(why, "rank 3 (host n2, pid 14, step 35)") && !strstr(why, "n1"),
                  "%s", why);
    ck_assert_int_eq(daemon_beat_wait_all(dir, 4, 0.05), -1); /* rank 1's is missing */
    ck_assert_int_eq(daemon_beat_wait_all(dir, 1, 0.05), 0);
    for (int r = 0; r < 4; r++) {
        snprintf(path, sizeof(path), "%s/rank-%d.beat", dir, r);
        unlink(path);
    }
    ck_assert_int_eq(daemon_beat_lost(dir, 4, why, sizeof(why)), 0);
    rmdir(dir);
}
END_TEST

/* The launcher's watch: a rank whose heartbeat never appeared ends the job after the
 * start-up grace; one whose heartbeat was seen and is gone has left on its own (it stopped
 * after a step while the launcher winds down) and is not called "never started". */
START_TEST(test_beat_watch)
{
    char dir[] = "/tmp/ampd-beat-XXXXXX", path[2][300], why[512];
    double now = (double)time(NULL);
    bool seen[2] = {false, false}, fresh[2] = {false, false};
    ck_assert_ptr_nonnull(mkdtemp(dir));
    for (int r = 0; r < 2; r++) {
        snprintf(path[r], sizeof(path[r]), "%s/rank-%d.beat", dir, r);
        FILE *f = fopen(path[r], "w");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "%d n%d 40 %.3f %.3f\n", 11 + r, r + 1, now, now);
        fclose(f);
    }
    /* started 100 s ago with a 30 s grace: both answer and progress */
    ck_assert_int_eq(daemon_beat_check(dir, 2, seen, now - 100, 30, 60, why, sizeof(why)), 0);
    ck_assert(seen[0] && seen[1]);
    unlink(path[0]); /* rank 0 stopped its heartbeat */
    ck_assert_int_eq(daemon_beat_check(dir, 2, seen, now - 100, 30, 60, why, sizeof(why)), 0);
    /* a watch that never saw it: rank 0 never started */
    ck_assert_int_eq(daemon_beat_check(dir, 2, fresh, now - 100, 30, 60, why, sizeof(why)), 1);
    ck_assert_msg(strstr(why, "rank 0 never started"), "%s", why);
    unlink(path[1]); /* every rank has left */
    ck_assert_int_eq(daemon_beat_check(dir, 2, seen, now - 100, 30, 60, why, sizeof(why)), 0);
    rmdir(dir);
}
END_TEST

/* remedy_is KIND PATCH: the remedy of a recommendation of kind in c is patch (JSON text;
 * NULL: none) and acts as said. */
static void remedy_is(const gpu_job_config *c, const char *kind, const char *patch, bool acts)
{
    gpu_recommendation r = {.layer = "fc1", .kind = kind, .message = "m"};
    json_t *got = daemon_remedy(c, &r), *want = patch ? json_loads(patch, 0, NULL) : NULL;
    char *text = got ? json_dumps(got, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    if (!patch)
        ck_assert_msg(got == NULL, "%s: a remedy %s, expected none", kind, text);
    else
        ck_assert_msg(got && json_equal(json_object_get(got, "patch"), want) &&
                          json_is_true(json_object_get(got, "acts")) == acts,
                      "%s: %s, expected patch %s acts %d", kind, text ? text : "none", patch, acts);
    free(text);
    json_decref(got);
    json_decref(want);
}

/* Each recommendation's remedy follows its sentence and the job's config. */
START_TEST(test_remedies)
{
    gpu_job_config c;
    gpu_job_defaults(&c);
    c.dtype = GPU_FP16;
    c.optim.lr = 0.01;
    c.scaler.mode = GPU_SCALE_DYNAMIC;
    c.scaler.min_scale = 1.0f;
    c.scaler.init_scale = 65536.0f;
    remedy_is(&c, "act_overflow", "{\"precision\": {\"dtype\": \"bf16\"}}", true);
    remedy_is(&c, "act_headroom", "{\"precision\": {\"dtype\": \"bf16\"}}", false);
    remedy_is(&c, "underflow", "{\"precision\": {\"dtype\": \"bf16\"}}", true);
    remedy_is(&c, "lost_updates", "{\"precision\": {\"master_weights\": true}}", true);
    remedy_is(&c, "scale_floor", "{\"precision\": {\"dtype\": \"bf16\"}}", true);
    remedy_is(&c, "comm_overflow", NULL, false); /* an fp32 all-reduce */
    remedy_is(&c, "no_such_kind", NULL, false);
    c.dist.hook = GPU_HOOK_FP16;
    remedy_is(&c, "comm_overflow", "{\"distributed\": {\"comm_hook\": \"bf16\"}}", true);
    c.dist.hook = GPU_HOOK_BF16;
    remedy_is(&c, "comm_overflow", "{\"distributed\": {\"comm_hook\": \"none\"}}", true);
    c.scaler.min_scale = 1024.0f;
    remedy_is(&c, "scale_floor", "{\"precision\": {\"loss_scale\": {\"min_scale\": 1.0}}}", true);
    c.scaler.mode = GPU_SCALE_STATIC;
    remedy_is(&c, "underflow", "{\"precision\": {\"loss_scale\": {\"mode\": \"dynamic\"}}}", true);
    c.dtype = GPU_BF16;
    c.scaler.mode = GPU_SCALE_DYNAMIC;
    c.scaler.min_scale = 1.0f;
    remedy_is(&c, "act_overflow", "{\"optimizer\": {\"lr\": 0.005}}", true);
    remedy_is(&c, "act_headroom", NULL, false);
    remedy_is(&c, "scale_below_one", "{\"optimizer\": {\"lr\": 0.005}}", true);
    remedy_is(&c, "underflow", "{\"precision\": {\"loss_scale\": {\"min_scale\": 256.0}}}", true);
    c.scaler.init_scale = 1.0f; /* no room above the floor */
    remedy_is(&c, "underflow", NULL, false);
    /* a loss spike: 200 more batches skipped, from at least 100 steps back; the only rewind */
    remedy_is(&c, "loss_spike", "{\"data\": {\"skip_batches\": 200}}", true);
    c.data.skip_batches = 200;
    remedy_is(&c, "loss_spike", "{\"data\": {\"skip_batches\": 400}}", true);
    gpu_recommendation r = {.layer = NULL, .kind = "loss_spike", .message = "m"};
    json_t *got = daemon_remedy(&c, &r);
    ck_assert_int_eq(json_integer_value(json_object_get(got, "rewind")), 100);
    json_decref(got);
    r.kind = "act_overflow";
    got = daemon_remedy(&c, &r);
    ck_assert_ptr_null(json_object_get(got, "rewind"));
    json_decref(got);
    /* an fp8 layer's trouble: it joins the layers kept in bf16 (a warning; none when kept) */
    remedy_is(&c, "fp8_underflow", NULL, false); /* not an fp8 job */
    c.fp8.on = true;
    remedy_is(&c, "fp8_underflow", "{\"precision\": {\"fp8\": {\"keep\": [\"fc1\"]}}}", false);
    c.fp8.nkeep = 1;
    snprintf(c.fp8.keep[0], sizeof(c.fp8.keep[0]), "fc3");
    remedy_is(&c, "fp8_saturation", "{\"precision\": {\"fp8\": {\"keep\": [\"fc3\", \"fc1\"]}}}",
              false);
    snprintf(c.fp8.keep[0], sizeof(c.fp8.keep[0]), "fc1");
    remedy_is(&c, "fp8_underflow", NULL, false);
}
END_TEST

/* decide J REMEDY-PATCH: daemon_policy_decide for job id with that patch at step 40. */
static daemon_policy decide(store *st, int64_t id, const char *patch, char *msg, size_t len)
{
    store_job j;
    ck_assert_int_eq(store_job_get(st, id, &j), 0);
    json_t *r = json_pack("{s:o, s:I, s:s}", "patch", json_loads(patch, 0, NULL), "step",
                          (json_int_t)40, "message", "m");
    daemon_policy act = daemon_policy_decide(st, &j, r, msg, len);
    json_decref(r);
    store_job_clear(&j);
    return act;
}

/* on_numerics: "stop" does nothing; "branch" at most max_branches times in a lineage and
 * never with a remedy applied in it before; "ask" once per remedy. */
START_TEST(test_policy)
{
    fixture f;
    char msg[1200];
    int64_t root, child, grand, stop, ask;
    const char *mw = "{\"precision\":{\"master_weights\":true}}";
    const char *bf = "{\"precision\":{\"dtype\":\"bf16\"}}";
    setup(&f);
    store *st = f.st;
    const char *spec = "{\"on_numerics\":\"branch\",\"max_branches\":2}";
    ck_assert_int_eq(store_job_insert(st, "r", "fp16", 100, spec, NULL, &root, NULL), 0);
    ck_assert_int_eq(store_job_insert_branch(st, "c", "fp16", 100, spec, root,
                                             "{\"patch\":{\"precision\":{\"master_weights\":"
                                             "true}},\"lineage\":[1]}",
                                             &child),
                     0);
    ck_assert_int_eq(store_job_insert_branch(st, "g", "bf16", 100, spec, child,
                                             "{\"patch\":{\"optimizer\":{\"lr\":0.1}},"
                                             "\"lineage\":[1,2]}",
                                             &grand),
                     0);
    ck_assert_int_eq(decide(st, root, mw, msg, sizeof(msg)), DAEMON_POLICY_BRANCH);
    ck_assert_msg(strstr(msg, "stopping to branch with {\"precision\":{\"master_weights\":true}}"),
                  "%s", msg);
    ck_assert_int_eq(decide(st, child, mw, msg, sizeof(msg)), DAEMON_POLICY_NONE);
    ck_assert_msg(strstr(msg, "job 2 was branched with it already"), "%s", msg);
    ck_assert_int_eq(decide(st, child, bf, msg, sizeof(msg)), DAEMON_POLICY_BRANCH);
    ck_assert_int_eq(decide(st, grand, bf, msg, sizeof(msg)), DAEMON_POLICY_NONE);
    ck_assert_msg(strstr(msg, "the lineage has 2 branch(es) and max_branches is 2"), "%s", msg);
    ck_assert_int_eq(
        store_job_insert(st, "s", "fp16", 100, "{\"on_numerics\":\"stop\"}", NULL, &stop, NULL), 0);
    ck_assert_int_eq(decide(st, stop, mw, msg, sizeof(msg)), DAEMON_POLICY_NONE);
    ck_assert_str_eq(msg, "");
    ck_assert_int_eq(
        store_job_insert(st, "a", "fp16", 100, "{\"on_numerics\":\"ask\"}", NULL, &ask, NULL), 0);
    ck_assert_int_eq(decide(st, ask, mw, msg, sizeof(msg)), DAEMON_POLICY_ASK);
    ck_assert_int_eq(store_event_append(st, ask, 40, DAEMON_POLICY_EVENT, msg,
                                        "{\"patch\":{\"precision\":{\"master_weights\":true}},"
                                        "\"act\":\"ask\"}"),
                     0);
    ck_assert_int_eq(store_flush(st), 0);
    ck_assert_int_eq(decide(st, ask, mw, msg, sizeof(msg)), DAEMON_POLICY_NONE); /* asked */
    ck_assert_int_eq(decide(st, ask, bf, msg, sizeof(msg)), DAEMON_POLICY_ASK);  /* another */
    teardown(&f);
}
END_TEST

/* The retention keeps the newest checkpoint before the first problem a remedy answers,
 * besides the newest ones: a branch with the remedy starts there. */
START_TEST(test_retain_before_problem)
{
    daemon_ckpt_info v[6];
    bool keep[6];
    memset(v, 0, sizeof(v));
    for (int i = 0; i < 6; i++) {
        v[i].step = 5 * (i + 1); /* 5, 10, ..., 30 */
        v[i].finite = true;
    }
    ck_assert_int_eq(daemon_ckpt_retain(v, 6, 2, 0, 0, keep), 0);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(keep[i] == (v[i].step >= 25), "step %lld", (long long)v[i].step);
    ck_assert_int_eq(daemon_ckpt_retain(v, 6, 2, 0, 12, keep), 0); /* the problem at 12 */
    for (int i = 0; i < 6; i++)
        ck_assert_msg(keep[i] == (v[i].step >= 25 || v[i].step == 10), "step %lld",
                      (long long)v[i].step);
    ck_assert_int_eq(daemon_ckpt_retain(v, 6, 2, 0, 5, keep), 0); /* none before it */
    for (int i = 0; i < 6; i++)
        ck_assert_msg(keep[i] == (v[i].step >= 25), "step %lld", (long long)v[i].step);
}
END_TEST

/* A branch's insert claims its checkpoint's file: while the file is there the branch is
 * inserted (and a drop then keeps the file: see check_branch.sh); once the retention has
 * dropped it the insert is refused with STORE_ENOTFOUND and no job is made. A branch of a
 * branch at the step the latter began at claims the first parent's file. */
START_TEST(test_branch_claims_file)
{
    fixture f;
    char ck[600];
    int64_t parent, child, grand, gone = 0, n;
    setup(&f);
    snprintf(ck, sizeof(ck), "%s/ckpt-10.safetensors", f.dir);
    ck_assert_int_eq(store_job_insert(f.st, "p", "fp16", 100, "{}", NULL, &parent, NULL), 0);
    ck_assert_int_eq(store_checkpoint_add(f.st, parent, 10, ck, 2), 0);
    ck_assert_int_eq(
        daemon_ingest_branch(f.st, "b", "fp16", 100, "{}", parent, 10, "{\"step\":10}", &gone),
        STORE_ENOTFOUND);
    ck_assert_int_eq(gone, 0);
    FILE *fp = fopen(ck, "w");
    ck_assert_ptr_nonnull(fp);
    fclose(fp);
    ck_assert_int_eq(
        daemon_ingest_branch(f.st, "b", "fp16", 100, "{}", parent, 10, "{\"step\":10}", &child), 0);
    ck_assert_int_eq(
        daemon_ingest_branch(f.st, "g", "fp16", 100, "{}", child, 10, "{\"step\":10}", &grand), 0);
    ck_assert_int_eq(
        daemon_ingest_branch(f.st, "s", "fp16", 100, "{}", parent, 0, "{\"step\":0}", &n),
        0); /* from the start: no file to claim */
    unlink(ck);
    ck_assert_int_eq(
        daemon_ingest_branch(f.st, "g2", "fp16", 100, "{}", child, 10, "{\"step\":10}", &gone),
        STORE_ENOTFOUND);
    teardown(&f);
}
END_TEST

static Suite *sched_suite(void)
{
    Suite *s = suite_create("sched");
    TCase *tc = tcase_create("scheduler");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_job_succeeds);
    tcase_add_test(tc, test_branch_claims_file);
    tcase_add_test(tc, test_crash_fails_only_its_job);
    tcase_add_test(tc, test_abort_after_summary_fails);
    tcase_add_test(tc, test_hung_worker_is_killed);
    tcase_add_test(tc, test_failed_worker_reason);
    tcase_add_test(tc, test_cancel_and_resume);
    tcase_add_test(tc, test_cancel_queued);
    tcase_add_test(tc, test_worker_descriptors);
    tcase_add_test(tc, test_cancel_at_spawn);
    tcase_add_test(tc, test_recovery_after_crash);
    tcase_add_test(tc, test_stop_interrupts_and_restart_resumes);
    tcase_add_test(tc, test_restart_skips_missing_checkpoint);
    tcase_add_test(tc, test_worker_walks_back);
    tcase_add_test(tc, test_two_slots);
    tcase_add_test(tc, test_overflow_events);
    tcase_add_test(tc, test_long_and_garbage_lines);
    tcase_add_test(tc, test_layers_and_recommendations);
    tcase_add_test(tc, test_delete);
    tcase_add_test(tc, test_bad_worker_binary);
    tcase_add_test(tc, test_idempotent_submit);
    tcase_add_test(tc, test_store_full_pauses_worker);
    tcase_add_test(tc, test_store_full_job_ends);
    tcase_add_test(tc, test_store_full_drops_wait);
    tcase_add_test(tc, test_store_stall_fails_job);
    suite_add_tcase(s, tc);
    tc = tcase_create("preempt");
    tcase_add_test(tc, test_preempt_choice);
    suite_add_tcase(s, tc);
    tc = tcase_create("ranks");
    tcase_add_test(tc, test_straggler);
    tcase_add_test(tc, test_lost_ranks);
    tcase_add_test(tc, test_beat_watch);
    tcase_add_test(tc, test_remedies);
    tcase_add_test(tc, test_policy);
    tcase_add_test(tc, test_retain_before_problem);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(sched_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
