/*
 * ranks.c - the launcher of a data-parallel `ampd run`: the process that the user or the
 * daemon started stays as the job's supervisor and runs
 *   mpirun -np N [--host H1,H2 | --oversubscribe] [--allow-run-as-root] --bind-to none
 *          AMPD run ARGS...
 * so that every rank is the same `ampd run` with the same arguments, under Open MPI.
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
 * Output: the ranks inherit stdout and stderr through mpirun; only rank 0 writes to
 * stdout. Exit status: 0 or 130 (interrupted) as the ranks said; 1 for anything else (a
 * rank failed or died, mpirun could not start or was killed).
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
#include "daemon/log.h"
#include "daemon/ranks.h"
#include "daemon/spawn.h"

#define MAX_ARGS 64

static volatile sig_atomic_t child_pid;

static void forward(int sig)
{
    (void)sig;
    if (child_pid > 0)
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

/* The ranks' watch: where their heartbeats are (NULL: not watched) and the limits. */
typedef struct {
    const char *dir;
    int nranks;
    double started, grace_s, timeout_s;
} rank_watch;

/* Wait for mpirun (pid) while watching the ranks' heartbeats; 1 when they were ended as hung
 * (the reason logged), else 0 with mpirun's status. */
static int wait_watching(pid_t pid, const rank_watch *w, int *status)
{
    struct timespec tick = {0, 200 * 1000 * 1000};
    char why[512];
    for (int i = 1;; i++) {
        pid_t got = waitpid(pid, status, WNOHANG);
        if (got == pid)
            return 0;
        if (got < 0 && errno != EINTR) {
            log_error("waitpid: %s", strerror(errno));
            *status = 1 << 8;
            return 0;
        }
        if (w->dir && i % 5 == 0 &&
            daemon_beat_check(w->dir, w->nranks, w->started, w->grace_s, w->timeout_s, why,
                              sizeof(why))) {
            log_error("%s: ending the job", why);
            kill(-pid, SIGKILL); /* mpirun's group: mpirun and the ranks it started */
            while (waitpid(pid, status, 0) < 0 && errno == EINTR)
                ;
            return 1;
        }
        nanosleep(&tick, NULL);
    }
}

/* Start mpirun with args and wait for it, passing SIGINT/SIGTERM on as SIGUSR1. */
static int run_mpirun(char **args, const rank_watch *w)
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
    if (wait_watching(pid, w, &status)) {
        while (args[n + 1])
            n++;
        /* a rank that left mpirun's group goes too: every process of this spec but this one
         * (the daemon's workers name it by its absolute path) */
        if (args[n][0] == '/')
            daemon_end_strays(args[n], 10.0, &killed);
        return 1;
    }
    if (WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 130))
        return WEXITSTATUS(status);
    if (WIFEXITED(status))
        log_error("the job's ranks failed (mpirun exit status %d; mpirun's lines above name "
                  "the rank)",
                  WEXITSTATUS(status));
    else
        log_error("mpirun was killed by signal %d", WTERMSIG(status));
    return 1;
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
    (void)argc, (void)argv, (void)spec, (void)len, (void)dir, (void)run_mpirun,
        (void)spec_file, (void)build_argv, (void)clear_beats;
    log_error("distributed.world_size %d: this ampd was built without MPI", c->dist.world_size);
    return 2;
#else
    char exe[1024], np[16], hosts[GPU_MAX_HOSTS * 130], tmp[1024] = "";
    char *args[MAX_ARGS];
    /* a start-up grace that grows with the ranks: mpirun starts them one by one */
    rank_watch w = {dir, c->dist.world_size, 0, 30.0 + 2.0 * c->dist.world_size,
                    (double)c->dist.rank_timeout_s};
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    int status;

    if (n <= 0) {
        log_error("cannot find the ampd executable (/proc/self/exe): %s", strerror(errno));
        return 1;
    }
    exe[n] = '\0';
    if (argc > 1 && strcmp(argv[argc - 1], "-") == 0) {
        if (spec_file(spec, len, tmp, sizeof(tmp)) != 0) {
            log_error("cannot write the spec for the ranks (%s): %s", tmp, strerror(errno));
            return 1;
        }
        argv[argc - 1] = tmp;
    }
    if (build_argv(c, argc, argv, exe, np, sizeof(np), hosts, sizeof(hosts), args) != 0) {
        log_error("too many arguments for mpirun");
        status = 2;
    } else {
        log_info("%d ranks: %s -np %d%s%s", c->dist.world_size, args[0], c->dist.world_size,
                 c->dist.nhosts ? " --host " : "", c->dist.nhosts ? hosts : "");
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        w.started = (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
        clear_beats(dir, c->dist.world_size);
        status = run_mpirun(args, &w);
    }
    if (tmp[0])
        unlink(tmp);
    return status;
#endif
}
