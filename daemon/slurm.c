/*
 * slurm.c - a data-parallel job's ranks under Slurm (contract in slurm.h): srun's command
 * line, the job followed in Slurm's queue by name, its stop through scancel and its final
 * state read before Slurm forgets it (MinJobAge, 300 s by default).
 *
 * srun runs as
 *   srun --mpi=pmix --job-name=NAME --ntasks=N [--nodes=K] [--ntasks-per-node=T]
 *        [--cpus-per-task=C] [--gpus-per-task=G] [--partition=P] [--account=A] [--time=L]
 *        --kill-on-bad-exit=1 --quiet AMPD run ARGS...
 * srun with PMIx, not PMI-2: Debian's Open MPI has PMIx and no PMI-1/2 support. An srun that
 * allocates its own job is never requeued by Slurm (requeue applies to batch jobs), so the
 * daemon alone restarts a job whose node died (--max-retries). --kill-on-bad-exit ends every
 * rank when one fails, as mpirun does. The Slurm commands are run with the daemon's
 * environment (SLURM_CONF and the like reach them), each bounded in time.
 *
 * Invariants: squeue and scancel name the job by NAME and the calling user (--me), so they
 * never touch another job; a "launch" line is printed only while the ranks do not run
 * (waiting, or ended), so it never lands between two halves of a rank's line.
 *
 * Threads: the launcher's thread only.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon/line.h"
#include "daemon/log.h"
#include "daemon/slurm.h"
#include "daemon/spawn.h"
#include "daemon/worker.h"

#define CMD_TIMEOUT_S 10.0
#define POLL_WAITING_S 1.0
#define POLL_RUNNING_S 10.0
#define REPEAT_LINE_S 10.0 /* a waiting job's line again, so the daemon sees the launcher live */

/* The Slurm command name's path through PATH into path (the child may not search: execvp
 * is not async-signal-safe). 0, or -1 with a message. */
static int find_cmd(const char *name, char *path, size_t len)
{
    const char *dirs = getenv("PATH");
    for (const char *d = dirs ? dirs : "/usr/bin:/bin"; *d;) {
        size_t n = strcspn(d, ":");
        snprintf(path, len, "%.*s/%s", (int)n, d, name);
        if (n > 0 && access(path, X_OK) == 0)
            return 0;
        d += n + (d[n] == ':');
    }
    log_error("%s: not found in PATH (Debian package slurm-client)", name);
    return -1;
}

/* Run argv[0] (found in PATH) with its stdout in out (len bytes, NUL-terminated; NULL:
 * discarded), for at most CMD_TIMEOUT_S. Returns its exit status, or -1. */
static int run_cmd(char *const *argv, char *out, size_t len)
{
    char path[512];
    int fds[2], status = -1;
    size_t used = 0;
    pid_t pid;
    double end = daemon_now_s() + CMD_TIMEOUT_S;
    if (find_cmd(argv[0], path, sizeof(path)) != 0)
        return -1;
    if (pipe2(fds, O_CLOEXEC) != 0)
        return -1;
    daemon_spawn_opts o = {.exe = path,
                           .argv = argv,
                           .in = -1,
                           .out = fds[1],
                           .err = -1,
                           .death_signal = SIGKILL,
                           .exec_error = "ampd: cannot run a Slurm command"};
    if (daemon_spawn(&o, &pid) != 0) {
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    close(fds[1]);
    for (;;) {
        struct pollfd p = {fds[0], POLLIN, 0};
        char tmp[1024];
        int left = (int)((end - daemon_now_s()) * 1000);
        if (left <= 0 || poll(&p, 1, left) <= 0) {
            if (errno == EINTR && left > 0)
                continue;
            log_warn("%s took more than %.0f s; ended", argv[0], CMD_TIMEOUT_S);
            kill(pid, SIGKILL);
            break;
        }
        ssize_t k = read(fds[0], tmp, sizeof(tmp));
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        for (ssize_t i = 0; out && i < k && used + 1 < len; i++)
            out[used++] = tmp[i];
    }
    if (out)
        out[used] = '\0';
    close(fds[0]);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void daemon_slurm_init(daemon_slurm *s, int attempt)
{
    char host[64] = "";
    memset(s, 0, sizeof(*s));
    if (gethostname(host, sizeof(host) - 1) != 0 || !host[0])
        snprintf(host, sizeof(host), "localhost");
    host[strcspn(host, ".")] = '\0';
    if (attempt > 1)
        snprintf(s->name, sizeof(s->name), "ampd-%s-%ld-%d", host, (long)getpid(), attempt);
    else
        snprintf(s->name, sizeof(s->name), "ampd-%s-%ld", host, (long)getpid());
}

/* Append "--opt=value" (value printed from fmt) to out through buf. */
static int add_opt(char **out, int *n, int max, char *buf, size_t len, size_t *used,
                   const char *opt, const char *value)
{
    int k = snprintf(buf + *used, len - *used, "%s=%s", opt, value);
    if (k < 0 || (size_t)k >= len - *used || *n >= max - 1)
        return -1;
    out[(*n)++] = buf + *used;
    *used += (size_t)k + 1;
    return 0;
}

int daemon_slurm_argv(const daemon_slurm *s, const gpu_job_config *c, const char *exe, int argc,
                      char **argv, char *buf, size_t buflen, char **out, int max)
{
    const gpu_slurm_config *sl = &c->dist.slurm;
    char num[16];
    size_t used = 0;
    int n = 0, rc = 0;
    const struct {
        const char *opt;
        int v;
    } nums[] = {{"--ntasks", c->dist.world_size},
                {"--nodes", sl->nodes},
                {"--ntasks-per-node", sl->tasks_per_node},
                {"--cpus-per-task", sl->cpus_per_task},
                {"--gpus-per-task", sl->gpus_per_task}};
    const struct {
        const char *opt, *v;
    } words[] = {
        {"--mpi", "pmix"},          {"--job-name", s->name}, {"--partition", sl->partition},
        {"--account", sl->account}, {"--time", sl->time},    {"--kill-on-bad-exit", "1"}};

    if (find_cmd("srun", buf, buflen) != 0)
        return -1;
    out[n++] = buf;
    used = strlen(buf) + 1;
    for (size_t i = 0; rc == 0 && i < sizeof(words) / sizeof(words[0]); i++)
        if (words[i].v[0])
            rc = add_opt(out, &n, max, buf, buflen, &used, words[i].opt, words[i].v);
    for (size_t i = 0; rc == 0 && i < sizeof(nums) / sizeof(nums[0]); i++)
        if (nums[i].v > 0) {
            snprintf(num, sizeof(num), "%d", nums[i].v);
            rc = add_opt(out, &n, max, buf, buflen, &used, nums[i].opt, num);
        }
    if (rc || n + argc + 3 > max)
        return -1;
    out[n++] = "--quiet";
    out[n++] = (char *)exe;
    for (int i = 0; i < argc; i++)
        out[n++] = argv[i];
    out[n] = NULL;
    return 0;
}

/* The "launch" line of what is known now. */
static void emit_state(daemon_slurm *s, double now)
{
    daemon_line_emit(json_pack("{s:s, s:s, s:s, s:s, s:s, s:s}", "type", "launch", "launcher",
                               "slurm", "job_id", s->id, "state", s->state, "reason", s->reason,
                               "nodes", s->nodes));
    s->last_line = now;
}

/* Ask squeue for the job ("ID|STATE|REASON|NODES"; all states when ended): 1 when it was
 * listed (s updated), 0 when not, -1 when squeue failed. */
static int query(daemon_slurm *s, bool ended)
{
    char name[200], out[1024];
    char *argv[] = {"squeue", "--noheader",           "--me",
                    name,     "--format=%i|%T|%r|%N", ended ? "--states=all" : NULL,
                    NULL};
    char *f[4], *save = NULL;
    int k = 0;
    snprintf(name, sizeof(name), "--name=%s", s->name);
    if (run_cmd(argv, out, sizeof(out)) != 0)
        return -1;
    out[strcspn(out, "\n")] = '\0';
    for (char *t = strtok_r(out, "|", &save); t && k < 4; t = strtok_r(NULL, "|", &save))
        f[k++] = t;
    if (k < 2)
        return 0;
    snprintf(s->id, sizeof(s->id), "%s", f[0]);
    snprintf(s->state, sizeof(s->state), "%s", f[1]);
    snprintf(s->reason, sizeof(s->reason), "%s", k > 2 ? f[2] : "");
    if (k > 3 && strcmp(f[3], "(null)") != 0)
        snprintf(s->nodes, sizeof(s->nodes), "%s", f[3]);
    return 1;
}

/* Reasons a job waits for that never pass by themselves, as squeue prints them (a prefix and
 * what it means); a job waiting for one of them would wait forever. */
static const struct {
    const char *prefix, *meaning;
} never[] = {
    {"PartitionNodeLimit", "it asks for more nodes than its partition allows or has"},
    {"PartitionTimeLimit", "its time limit is beyond its partition's"},
    {"PartitionConfig", "it asks for more than its partition's configuration allows"},
    {"BadConstraints", "its constraints cannot be met by any node"},
    {"InvalidAccount", "its account is not valid"},
    {"InvalidQOS", "its QOS is not valid"},
    {"AssocMax", "it asks beyond a per-job limit of its association"},
    {"QOSMax", "it asks beyond a per-job limit of its QOS"},
    {"DependencyNeverSatisfied", "its dependency can never be met"},
};

/* The meaning of a waiting reason that never passes, else NULL. */
static const char *never_passes(const char *reason)
{
    for (size_t i = 0; i < sizeof(never) / sizeof(never[0]); i++)
        if (strncmp(reason, never[i].prefix, strlen(never[i].prefix)) == 0)
            return never[i].meaning;
    return NULL;
}

bool daemon_slurm_poll(daemon_slurm *s)
{
    char old[sizeof(s->state) + sizeof(s->reason)];
    double mono = daemon_now_s();
    if (mono < s->next_poll)
        return false;
    s->next_poll = mono + (s->started ? POLL_RUNNING_S : POLL_WAITING_S);
    snprintf(old, sizeof(old), "%s|%s", s->state, s->reason);
    if (query(s, false) != 1 || s->started)
        return false;
    if (strcmp(s->state, "PENDING") != 0 && strcmp(s->state, "CONFIGURING") != 0) {
        s->started = true;
        log_info("Slurm job %s: %s on %s", s->id, s->state, s->nodes);
        return true;
    }
    char now_state[sizeof(old)];
    snprintf(now_state, sizeof(now_state), "%s|%s", s->state, s->reason);
    if (strcmp(old, now_state) != 0) {
        log_info("Slurm job %s: %s (%s)", s->id, s->state, s->reason);
        emit_state(s, mono);
    } else if (mono - s->last_line >= REPEAT_LINE_S) {
        emit_state(s, mono);
    }
    const char *why = s->refused ? NULL : never_passes(s->reason);
    if (why) {
        log_error("Slurm would never start job %s as asked: PENDING (%s): %s; cancelled", s->id,
                  s->reason, why);
        s->refused = true;
        daemon_slurm_signal(s, false);
    }
    return false;
}

int daemon_slurm_signal(daemon_slurm *s, bool kill_all)
{
    char name[200];
    bool waiting = !s->started;
    char *argv[] = {"scancel", "--me", name, kill_all ? "--signal=KILL" : "--signal=USR1", NULL};
    snprintf(name, sizeof(name), "--name=%s", s->name);
    if (waiting && !kill_all) /* no rank to stop after a step: the request goes */
        argv[3] = NULL;
    log_info("Slurm job %s: scancel%s", s->id[0] ? s->id : s->name,
             argv[3] ? (kill_all ? " --signal=KILL"
                                 : " --signal=USR1 (the ranks stop after "
                                   "the same step)")
                     : " (still waiting)");
    return run_cmd(argv, NULL, 0) == 0 ? 0 : -1;
}

void daemon_slurm_finish(daemon_slurm *s, double timeout_s)
{
    struct timespec pause = {0, 250 * 1000 * 1000};
    double end = daemon_now_s() + timeout_s;
    int got = 0;
    while (daemon_now_s() < end) { /* COMPLETING: a node still cleans up (or is dead) */
        got = query(s, true);
        if (got == 1 && strcmp(s->state, "RUNNING") != 0 && strcmp(s->state, "COMPLETING") != 0 &&
            strcmp(s->state, "PENDING") != 0 && strcmp(s->state, "CONFIGURING") != 0)
            break;
        nanosleep(&pause, NULL);
    }
    if (got != 1) {
        log_warn("Slurm no longer lists job %s; its final state is unknown",
                 s->id[0] ? s->id : s->name);
        return;
    }
    log_info("Slurm job %s ended: %s%s%s", s->id, s->state, s->nodes[0] ? " on " : "", s->nodes);
    emit_state(s, daemon_now_s());
}
