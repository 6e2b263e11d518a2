/*
 * daemon.h - the public header of the daemon/ module: the two commands main() dispatches
 * to. The module's pieces have internal headers of their own: log.h (the logger and the
 * hooks it installs in store/ and api/), sched.h (the scheduler and the job queue it gives
 * the HTTP server), worker.h (a worker, and ingest.c's reading of its lines into the
 * store), spawn.h (a child process from a clean slate), fs.h (file helpers), opts.h (the
 * commands' option tables), line.h (the worker's JSON lines, written and read from the
 * metric-field table) and ckpt.h (checkpoints).
 *
 * Threads: each command runs on the calling (main) thread and starts what it needs.
 */
#ifndef AMPD_DAEMON_H
#define AMPD_DAEMON_H

/* `ampd run [options] JOB.json`: train in the foreground, one JSON line per step on
 * stdout. Returns the process exit status (0 succeeded, 1 failed, 2 bad usage or spec,
 * 130 interrupted). */
int daemon_run_main(int argc, char **argv);

/* `ampd serve [options]`: the daemon in the foreground until SIGTERM/SIGINT. Returns the
 * process exit status (0 after a graceful stop, 1 start-up error, 2 bad usage). */
int daemon_serve_main(int argc, char **argv);

#endif /* AMPD_DAEMON_H */
