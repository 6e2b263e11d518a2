/*
 * spawn.c - a child process started from a clean slate (contract in spawn.h): fork, then
 * in the child setpgid, PR_SET_PDEATHSIG (and _exit when the parent is already gone),
 * every disposition back to SIG_DFL (SIG_IGN too: a child gets SIGPIPE back), stdin,
 * stdout and stderr from the caller's descriptors, every other one closed (close_range,
 * else one by one up to the open-file limit), the open-file soft limit the caller gave,
 * an empty signal mask, execv.
 *
 * Invariants: every signal stays blocked from before the fork until the child has put
 * every disposition back to the default, so a signal that reaches the child before its
 * execv (a cancel's SIGTERM to its group) never runs a handler inherited from this
 * process; between fork and execv the child makes async-signal-safe calls only.
 *
 * Threads: any thread; the calling thread's signal mask is restored before the return.
 */
#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "daemon/spawn.h"
#include "gpu/gpu.h"

/* What the child needs, computed before the fork (the child may not allocate or lock). */
typedef struct {
    pid_t parent;
    long maxfd; /* descriptors below it are closed when close_range is missing */
    struct rlimit nofile;
    int set_nofile;
    struct sigaction dfl;
    sigset_t none;
} spawn_prep;

static void prepare(const daemon_spawn_opts *o, spawn_prep *p)
{
    struct rlimit rl;
    memset(p, 0, sizeof(*p));
    p->parent = getpid();
    p->maxfd = 65536;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur < (rlim_t)(1 << 20))
        p->maxfd = (long)rl.rlim_cur;
    if (o->nofile && getrlimit(RLIMIT_NOFILE, &p->nofile) == 0 &&
        (rlim_t)o->nofile < p->nofile.rlim_cur) {
        p->nofile.rlim_cur = (rlim_t)o->nofile;
        p->set_nofile = 1;
    }
    p->dfl.sa_handler = SIG_DFL;
    sigemptyset(&p->dfl.sa_mask);
    sigemptyset(&p->none);
}

/* The child's write of o->exec_error and the reason (async-signal-safe). */
static void exec_failed(const daemon_spawn_opts *o, int err)
{
    const char *why = strerrordesc_np(err);
    ssize_t r = 0;
    if (!o->exec_error)
        return;
    r += write(2, o->exec_error, strlen(o->exec_error));
    if (why) {
        r += write(2, ": ", 2);
        r += write(2, why, strlen(why));
    }
    r += write(2, "\n", 1);
    (void)r;
}

/* The child, from the fork to execve: async-signal-safe calls only. Never returns. */
static void child(const daemon_spawn_opts *o, const spawn_prep *p)
{
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, o->death_signal);
    if (getppid() != p->parent)
        _exit(127);
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction cur;
        if (sig != SIGKILL && sig != SIGSTOP && sigaction(sig, NULL, &cur) == 0 &&
            cur.sa_handler != SIG_DFL)
            sigaction(sig, &p->dfl, NULL);
    }
    if ((o->in >= 0 && dup2(o->in, 0) < 0) || (o->out >= 0 && dup2(o->out, 1) < 0) ||
        (o->err >= 0 && dup2(o->err, 2) < 0))
        _exit(127);
    if (syscall(SYS_close_range, 3U, ~0U, 0U) != 0)
        for (long fd = 3; fd < p->maxfd; fd++)
            close((int)fd);
    if (p->set_nofile)
        setrlimit(RLIMIT_NOFILE, &p->nofile);
    if (o->affinity)
        sched_setaffinity(0, sizeof(*o->affinity), o->affinity);
    sigprocmask(SIG_SETMASK, &p->none, NULL);
    execve(o->exe, o->argv, o->envp ? o->envp : environ);
    exec_failed(o, errno);
    _exit(127);
}

/* See spawn.h. */
int daemon_spawn(const daemon_spawn_opts *o, pid_t *pid)
{
    spawn_prep p;
    sigset_t all, old;
    pid_t child_pid;
    int err;

    prepare(o, &p);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    child_pid = fork();
    if (child_pid == 0)
        child(o, &p);
    err = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (child_pid < 0) {
        errno = err;
        return GPU_EIO;
    }
    setpgid(child_pid, child_pid); /* also here, so that the group exists before any kill() */
    *pid = child_pid;
    return 0;
}

/* Whether process pid runs `... run ... arg ...`: ampd run (a worker or a rank), or the
 * mpirun that started ranks of it; an editor with the same file open does not. */
static bool runs_with(const char *pid, const char *arg)
{
    char path[64], buf[8192];
    size_t n;
    bool found = false, run = false;
    FILE *f;
    snprintf(path, sizeof(path), "/proc/%s/cmdline", pid);
    if (!(f = fopen(path, "re")))
        return false;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    for (size_t i = 0; i < n; i += strlen(buf + i) + 1) {
        found = found || strcmp(buf + i, arg) == 0;
        run = run || strcmp(buf + i, "run") == 0;
    }
    return found && run;
}

/* SIGKILL to every process (not this one) that runs with arg; how many there were. */
static int kill_runs_with(const char *arg)
{
    DIR *d = opendir("/proc");
    struct dirent *e;
    int n = 0;
    if (!d)
        return 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9' || atol(e->d_name) == (long)getpid() ||
            !runs_with(e->d_name, arg))
            continue;
        kill((pid_t)atol(e->d_name), SIGKILL);
        n++;
    }
    closedir(d);
    return n;
}

int daemon_end_strays(const char *spec_path, double timeout_s, int *killed)
{
    struct timespec pause = {0, 20 * 1000 * 1000};
    int left = kill_runs_with(spec_path);
    *killed = left;
    for (double waited = 0; left > 0 && waited < timeout_s; waited += 0.02) {
        nanosleep(&pause, NULL);
        left = kill_runs_with(spec_path); /* a killed process is gone once its cmdline is */
    }
    return left;
}
