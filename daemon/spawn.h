/*
 * spawn.h - internal header of daemon/: starting a child process from a clean slate
 * (spawn.c), for the scheduler's workers (sched.c) and a data-parallel job's mpirun
 * (ranks.c).
 *
 * Also the end of the processes a dead daemon left behind (daemon_end_strays).
 *
 * Errors: daemon_spawn returns 0 or GPU_EIO with errno (the fork failed).
 *
 * Threads: thread-safe; PR_SET_PDEATHSIG ties the child to the calling thread, so the
 * caller's thread must live as long as the child should.
 */
#ifndef AMPD_DAEMON_SPAWN_H
#define AMPD_DAEMON_SPAWN_H

#include <sched.h>
#include <sys/types.h>

typedef struct {
    const char *exe;        /* the program, execv'd */
    char *const *argv;      /* its arguments, NULL-terminated */
    int in, out, err;       /* the child's stdin, stdout and stderr; -1: this process's */
    int death_signal;       /* sent to the child when the calling thread dies */
    unsigned long nofile;   /* the child's open-file soft limit; 0: this process's */
    const char *exec_error; /* written to the child's stderr when execv fails */
    const cpu_set_t *affinity; /* the child's CPUs (its threads' and children's); NULL: ours */
    char *const *envp;      /* the child's environment; NULL: this process's */
} daemon_spawn_opts;

/* Start o->exe in a process group of its own (pid = pgid, set on both sides of the fork,
 * so the group exists before any kill), with o's stdin, stdout and stderr, every other
 * descriptor closed, every signal disposition back to the default, an empty signal mask
 * (every signal is blocked across the fork until then), o->nofile, o->affinity, o->envp,
 * and o->death_signal as its PR_SET_PDEATHSIG. *pid gets the child's pid. */
int daemon_spawn(const daemon_spawn_opts *o, pid_t *pid);

/* End the processes a dead daemon left of a job: every process whose arguments include "run"
 * and spec_path (its worker, mpirun and the ranks all run `... run ... SPEC`; give an
 * absolute path) gets SIGKILL, and
 * the call returns once none is left, or after timeout_s with those still there. *killed gets
 * how many were found; returns how many are left (0: all gone). */
int daemon_end_strays(const char *spec_path, double timeout_s, int *killed);

#endif /* AMPD_DAEMON_SPAWN_H */
