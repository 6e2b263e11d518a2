/*
 * ranks.c - the launcher of a data-parallel `ampd run`: the process that the user or the
 * daemon started stays as the job's supervisor and runs
 *   mpirun -np N [--host H1,H2 | --oversubscribe] [--allow-run-as-root] --bind-to none
 *          AMPD run ARGS...
 * so that every rank is the same `ampd run` with the same arguments, under Open MPI; or,
 * for launcher slurm, srun --mpi=pmix with what the spec asks of Slurm (slurm.c), which
 * this file treats as it treats mpirun, the stop going through scancel instead.
 *
 * Signals: mpirun runs in a process group of its own, so a terminal's Ctrl-C or the
 * daemon's SIGTERM to the worker's group reaches the supervisor only; it forwards them to
 * mpirun as SIGUSR1, which mpirun passes to every rank, and the ranks agree to stop after
 * the same step (rank 0 checkpoints). Should the supervisor die, mpirun gets SIGTERM
 * (PR_SET_PDEATHSIG; mpirun is started by daemon_spawn, spawn.h, with this process's stdin,
 * stdout and stderr and no other descriptor) and takes the ranks down. A rank that dies
 * makes mpirun end the job and say which rank and signal on stderr, which is the job's log.
 * With a checkpoint directory the supervisor also watches the ranks' heartbeats there
 * (beat.h): a rank that stops answering, or ranks that finish no step, for rank_timeout_s
 * end the job (mpirun's process group, then every process of the spec, get SIGKILL), the
 * rank named in the log.
 *
 * When the launcher fails, the ranks that left a heartbeat behind (killed, or on a node
 * that died) are named; with ranks on other hosts the exit status is then DAEMON_EXIT_LOST,
 * which the daemon retries. A rank that died by a signal inside MPI's start-up (its
 * heartbeat never appeared) gets the ranks launched once more.
 *
 * Output: the ranks inherit stdout and stderr through the launcher; only rank 0 writes to
 * stdout. Exit status: 0 or 130 (interrupted) as the ranks said; DAEMON_EXIT_LOST; 1 for
 * anything else (a rank failed or died, the launcher could not start or was killed).
 *
 * Threads: the calling thread only.
 */
#include "config.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon/beat.h"
#include "daemon/line.h"
#include "daemon/log.h"
#include "daemon/ranks.h"
#include "daemon/slurm.h"
#include "daemon/spawn.h"

#define MAX_ARGS 64

static volatile sig_atomic_t child_pid, stop_asked, by_slurm;

/* A stop for the ranks: mpirun passes SIGUSR1 on to them; under Slurm the watch loop asks
 * scancel (not async-signal-safe work). */
static void forward(int sig)
{
    (void)sig;
    stop_asked = 1;
    if (child_pid > 0 && !by_slurm)
        kill((pid_t)child_pid, SIGUSR1);
}

/* mpirun's argument vector in argv_out (strings in buf); 0 or -1 when it does not fit. */
static int build_argv(const gpu_job_config *c, int argc, char **argv, const char *exe,
                      char *np, size_t nplen, char *hosts, size_t hostslen, char **out)
{
    int n = 0;
    snprintf(np, nplen, "%d", c->dist.world_size);
#ifdef AMPD_MPIRUN
    out[n++] = AMPD_MPIRUN;
#endif
    out[n++] = "-np";
    out[n++] = np;
    if (c->dist.nhosts > 0) {
        size_t used = 0;
        hosts[0] = '\0';
        for (int i = 0; i < c->dist.nhosts; i++)
            used += (size_t)snprintf(hosts + used, used < hostslen ? hostslen - used : 0, "%s%s",
                                     i ? "," : "", c->dist.hosts[i]);
        if (used >= hostslen)
            return -1;
        out[n++] = "--host";
        out[n++] = hosts;
    } else {
        out[n++] = "--oversubscribe"; /* one machine: N ranks whatever its core count */
    }
    if (geteuid() == 0)
        out[n++] = "--allow-run-as-root";
    out[n++] = "--bind-to";
    out[n++] = "none"; /* each rank's BLAS threads may use any core */
    out[n++] = (char *)exe;
    for (int i = 0; i < argc && n < MAX_ARGS - 1; i++)
        out[n++] = argv[i];
    if (n >= MAX_ARGS - 1)
        return -1;
    out[n] = NULL;
    return 0;
}

/* The spec read from stdin ("-") in a file the ranks can read: its path in path. */
static int spec_file(const char *spec, size_t len, char *path, size_t pathlen)
{
    const char *dir = getenv("TMPDIR");
    int fd;
    snprintf(path, pathlen, "%s/ampd-spec-XXXXXX", dir && *dir ? dir : "/tmp");
    if ((fd = mkstemp(path)) < 0)
        return -1;
    if (write(fd, spec, len) != (ssize_t)len) {
        close(fd);
        unlink(path);
        return -1;
    }
    return close(fd);
}

/* The ranks' watch: where their heartbeats are (NULL: not watched), the limits, and the
 * Slurm job (NULL: mpirun). */
typedef struct {
    const char *dir;
    int nranks;
    double started, grace_s, timeout_s;
    daemon_slurm *slurm;
    bool multi_host; /* ranks on other machines: a lost rank may be a lost node */
    int status;      /* the launcher's wait status, once it has ended */
    bool *seen;      /* the ranks whose heartbeat the watch has seen (daemon_beat_check) */
} rank_watch;

/* One turn of the Slurm side of the watch: the stop passed on, the job's state followed.
 * Returns whether the heartbeats are to be checked (the ranks run). */
static bool slurm_turn(rank_watch *w, bool *stop_sent)
{
    if (stop_asked && !*stop_sent) {
        daemon_slurm_signal(w->slurm, false);
        *stop_sent = true;
    }
    if (daemon_slurm_poll(w->slurm))
        w->started = daemon_beat_now(); /* the start-up grace counts from the ranks' start */
    return w->slurm->started;
}

/* Wait for the launcher (pid) while watching the ranks' heartbeats; 1 when they were ended
 * as hung (the reason logged), else 0 with the launcher's status. */
static int wait_watching(pid_t pid, rank_watch *w, int *status)
{
    struct timespec tick = {0, 200 * 1000 * 1000};
    char why[512];
    bool stop_sent = false;
    for (int i = 1;; i++) {
        pid_t got = waitpid(pid, status, WNOHANG);
        if (got == pid)
            return 0;
        if (got < 0 && errno != EINTR) {
            log_error("waitpid: %s", strerror(errno));
            *status = 1 << 8;
            return 0;
        }
        bool watch = w->slurm ? slurm_turn(w, &stop_sent) : true;
        if (watch && w->dir && i % 5 == 0 &&
            daemon_beat_check(w->dir, w->nranks, w->seen, w->started, w->grace_s, w->timeout_s,
                              why, sizeof(why))) {
            log_error("%s: ending the job", why);
            if (w->slurm)
                daemon_slurm_signal(w->slurm, true);
            kill(-pid, SIGKILL); /* the launcher's group: mpirun and the ranks it started */
            while (waitpid(pid, status, 0) < 0 && errno == EINTR)
                ;
            return 1;
        }
        nanosleep(&tick, NULL);
    }
}

/* The exit status of a launcher that failed (st: its wait status) or was ended as hung:
 * the lost ranks named; across hosts, DAEMON_EXIT_LOST (the daemon retries the job from its
 * checkpoint), else 1. */
static int failed_status(const rank_watch *w, int st, bool hung)
{
    char lost[900];
    int n = w->dir ? daemon_beat_lost(w->dir, w->nranks, lost, sizeof(lost)) : 0;
    if (!hung && WIFEXITED(st))
        log_error("the job's ranks failed (%s exit status %d; its lines above name the rank)",
                  w->slurm ? "srun" : "mpirun", WEXITSTATUS(st));
    else if (!hung)
        log_error("%s was killed by signal %d", w->slurm ? "srun" : "mpirun", WTERMSIG(st));
    if (n > 0)
        log_error("lost: %s went silent first, without stopping%s", lost,
                  w->multi_host ? " (their node died, or they were killed)" : " (killed)");
    if (w->multi_host && (hung || n > 0)) {
        log_error("the job lost ranks on another host; it can go on from its last checkpoint");
        if (n > 0) /* no rank writes any more: the line cannot land inside one of theirs */
            daemon_line_emit(json_pack("{s:s, s:s, s:s+}", "type", "event", "kind", "node_lost",
                                       "message", "lost ", lost));
        return DAEMON_EXIT_LOST;
    }
    return 1;
}

/* Start the launcher (mpirun or srun) with args and wait for it, passing SIGINT/SIGTERM on
 * as a stop after the same step. */
static int run_launcher(char **args, rank_watch *w)
{
    char what[1100];
    daemon_spawn_opts o = {.exe = args[0],
                           .argv = args,
                           .in = -1,
                           .out = -1,
                           .err = -1,
                           .death_signal = SIGTERM,
                           .exec_error = what};
    struct sigaction sa;
    int status = 0, killed = 0, n = 0;
    pid_t pid;

    snprintf(what, sizeof(what), "ampd run: cannot run %s", args[0]);
    by_slurm = w->slurm != NULL;
    /* ranks yield the core while they wait in a collective (one machine, many ranks); set
     * here, before the fork, since the child may only make async-signal-safe calls */
    setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
    fflush(stdout);
    if (daemon_spawn(&o, &pid) != 0) {
        log_error("fork: %s", strerror(errno));
        return 1;
    }
    child_pid = pid;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = forward;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    int hung = wait_watching(pid, w, &status);
    w->status = status;
    if (hung) {
        while (args[n + 1])
            n++;
        /* a rank that left mpirun's group goes too: every process of this spec but this one
         * (the daemon's workers name it by its absolute path) */
        if (args[n][0] == '/')
            daemon_end_strays(args[n], 10.0, &killed);
        if (w->slurm)
            daemon_slurm_finish(w->slurm, 5.0);
        return failed_status(w, status, true);
    }
    if (w->slurm)
        daemon_slurm_finish(w->slurm, 5.0);
    if (WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 130))
        return WEXITSTATUS(status);
    if (w->slurm && w->slurm->refused)
        return 1; /* Slurm would never have started it: the reason is logged */
    if (w->slurm && stop_asked && !w->slurm->started)
        return 130; /* stopped while it waited in Slurm's queue: nothing ran */
    return failed_status(w, status, false);
}

/* Whether the launcher failed because a rank died by a signal inside MPI's start-up: it
 * reported a signal (an exit status above 128, or its own death) and some rank never
 * started its heartbeat, which each rank does as soon as MPI_Init returns. Open MPI 4.1's
 * start-up over TCP has such rare crashes (about 1 in 100 starts across two hosts here);
 * the ranks are then launched once more. */
static bool died_starting(const rank_watch *w)
{
    char path[1100];
    bool signalled =
        WIFSIGNALED(w->status) || (WIFEXITED(w->status) && WEXITSTATUS(w->status) > 128);
    for (int r = 0; signalled && w->dir && r < w->nranks; r++) {
        snprintf(path, sizeof(path), "%s/rank-%d.beat", w->dir, r);
        if (access(path, F_OK) != 0)
            return true;
    }
    return false;
}

/* Remove the heartbeats of an earlier run of the job from dir. */
static void clear_beats(const char *dir, int nranks)
{
    char path[1100];
    for (int r = 0; dir && r < nranks; r++) {
        snprintf(path, sizeof(path), "%s/rank-%d.beat", dir, r);
        unlink(path);
    }
}

/* See ranks.h. */
int daemon_ranks_launch(const gpu_job_config *c, int argc, char **argv, const char *spec,
                        size_t len, const char *dir)
{
#ifndef AMPD_MPIRUN
    (void)argc, (void)argv, (void)spec, (void)len, (void)dir, (void)run_launcher, (void)spec_file,
        (void)build_argv, (void)clear_beats;
    log_error("distributed.world_size %d: this ampd was built without MPI", c->dist.world_size);
    return 2;
#else
    char exe[1024], np[16], hosts[GPU_MAX_HOSTS * 130], tmp[1024] = "", sbuf[1024];
    char *args[MAX_ARGS];
    daemon_slurm slurm;
    /* a start-up grace that grows with the ranks: mpirun starts them one by one */
    rank_watch w = {dir,
                    c->dist.world_size,
                    0,
                    30.0 + 2.0 * c->dist.world_size,
                    (double)c->dist.rank_timeout_s,
                    NULL,
                    c->dist.nhosts > 0 || c->dist.launcher == GPU_LAUNCH_SLURM,
                    0,
                    calloc((size_t)c->dist.world_size, sizeof(bool))};
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    int status, rc;

    if (!w.seen) {
        log_error("out of memory");
        return 1;
    }
    if (n <= 0) {
        log_error("cannot find the ampd executable (/proc/self/exe): %s", strerror(errno));
        free(w.seen);
        return 1;
    }
    exe[n] = '\0';
    if (argc > 1 && strcmp(argv[argc - 1], "-") == 0) {
        if (spec_file(spec, len, tmp, sizeof(tmp)) != 0) {
            log_error("cannot write the spec for the ranks (%s): %s", tmp, strerror(errno));
            free(w.seen);
            return 1;
        }
        argv[argc - 1] = tmp;
    }
    for (int attempt = 1;; attempt++) {
        if (c->dist.launcher == GPU_LAUNCH_SLURM) {
            daemon_slurm_init(&slurm, attempt);
            w.slurm = &slurm;
            rc = daemon_slurm_argv(&slurm, c, exe, argc, argv, sbuf, sizeof(sbuf), args, MAX_ARGS);
        } else {
            rc = build_argv(c, argc, argv, exe, np, sizeof(np), hosts, sizeof(hosts), args);
        }
        if (rc != 0) {
            log_error("cannot build %s's command line", w.slurm ? "srun" : "mpirun");
            status = 2;
            break;
        }
        if (w.slurm)
            log_info("%d ranks through Slurm: srun --job-name=%s", c->dist.world_size, slurm.name);
        else
            log_info("%d ranks: %s -np %d%s%s", c->dist.world_size, args[0], c->dist.world_size,
                     c->dist.nhosts ? " --host " : "", c->dist.nhosts ? hosts : "");
        w.started = daemon_beat_now();
        clear_beats(dir, c->dist.world_size);
        memset(w.seen, 0, (size_t)c->dist.world_size * sizeof(bool));
        status = run_launcher(args, &w);
        if (status != 1 || attempt > 1 || stop_asked || !died_starting(&w))
            break;
        log_warn("a rank died by a signal inside MPI's start-up, before any step: launching "
                 "the ranks once more");
    }
    if (tmp[0])
        unlink(tmp);
    free(w.seen);
    return status;
#endif
}
