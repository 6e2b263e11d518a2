/*
 * daemon.h - the public header of the daemon/ module: logging and the commands that
 * main() dispatches to (`ampd run`; `ampd serve` and `ampd worker` come with the daemon).
 *
 * Threads: daemon_log is thread-safe (one fprintf per line); the commands run on the
 * calling thread.
 */
#ifndef AMPD_DAEMON_H
#define AMPD_DAEMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>

#include "gpu/gpu.h"

typedef enum {
    DAEMON_LOG_DEBUG = 0,
    DAEMON_LOG_INFO,
    DAEMON_LOG_WARN,
    DAEMON_LOG_ERROR
} daemon_log_level;

/* Messages below this level are dropped (default INFO; AMPD_LOG=debug|info|warn|error). */
void daemon_log_set_level(daemon_log_level level);
int daemon_log_enabled(daemon_log_level level);
/* Write one line to stderr: ISO-8601 UTC time, level, function, message. */
void daemon_log_write(daemon_log_level level, const char *func, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define daemon_log(level, ...)                                                                     \
    do {                                                                                           \
        if (daemon_log_enabled(level))                                                             \
            daemon_log_write(level, __func__, __VA_ARGS__);                                        \
    } while (0)
#define log_debug(...) daemon_log(DAEMON_LOG_DEBUG, __VA_ARGS__)
#define log_info(...) daemon_log(DAEMON_LOG_INFO, __VA_ARGS__)
#define log_warn(...) daemon_log(DAEMON_LOG_WARN, __VA_ARGS__)
#define log_error(...) daemon_log(DAEMON_LOG_ERROR, __VA_ARGS__)

/* ---- the scheduler and worker supervision (sched.c) -------------------------------------
 *
 * One scheduler thread owns the queue: it starts up to max_running workers (each one
 * `ampd run` child process: the job's spec on disk, JSON lines on a pipe, stderr in
 * <data_dir>/jobs/<id>/worker.log), reads their lines into the store and the live hub,
 * supervises them (crash: the job fails with the signal and the log's last lines; no
 * output for worker_timeout_s: killed and failed as hung) and finishes them. Cancel sends
 * SIGTERM: the worker checkpoints and exits, the job becomes cancelled. Stop sends SIGTERM
 * to every worker: they checkpoint and their jobs become interrupted. At start, jobs left
 * running by a dead daemon become interrupted; interrupted jobs are queued again and
 * resume from their last checkpoint (metrics after it are deleted first) until
 * max_retries restarts have been used, then they fail.
 *
 * Threads: the daemon_sched_* calls are thread-safe (the HTTP threads call them).
 */
struct store;
typedef struct daemon_sched daemon_sched; /* opaque */

#define DAEMON_MAX_ROOTS 8

typedef struct {
    char exe[512];          /* the ampd binary workers run (usually /proc/self/exe resolved) */
    char data_dir[512];     /* jobs/<id>/{spec.json,worker.log,ckpt-<step>.safetensors} */
    int nroots;
    char roots[DAEMON_MAX_ROOTS][512]; /* data roots passed to workers (--data-root) */
    int max_running;        /* concurrent workers (1) */
    int max_retries;        /* automatic resumes of an interrupted job (3) */
    int worker_timeout_s;   /* a worker silent this long is hung (600) */
} daemon_sched_config;

/* Recover jobs left by a previous daemon (see above) and start the scheduler thread.
 * st is borrowed and must outlive the scheduler. Caller stops with daemon_sched_stop(). */
int daemon_sched_start(struct store *st, const daemon_sched_config *c, daemon_sched **out);
/* Interrupt every running job (SIGTERM, wait for the checkpoint, at most 30 s before
 * SIGKILL), stop the thread, free. NULL is accepted. */
void daemon_sched_stop(daemon_sched *s);

/* Queue a validated job. spec_json is the submitted spec (the worker validates it again
 * with the same data roots). Returns the store's codes. */
int daemon_sched_submit(daemon_sched *s, const char *name, const char *dtype, int64_t steps,
                        const char *spec_json, const char *idem_key, int64_t *id,
                        bool *existed);
/* STORE_ENOTFOUND, or STORE_ECONFLICT when the job is not queued or running. */
int daemon_sched_cancel(daemon_sched *s, int64_t id);
/* STORE_ECONFLICT unless the job is cancelled, failed or interrupted. */
int daemon_sched_resume(daemon_sched *s, int64_t id);
/* STORE_ECONFLICT while the job is queued or running; removes its files too. */
int daemon_sched_delete(daemon_sched *s, int64_t id);

/* Create path and its missing parents (mode for the ones created); 0 or -1 with errno. */
int daemon_mkdirs(const char *path, unsigned mode);

/* ---- live lines for SSE (hub in sched.c) ------------------------------------------------ */

/* A JSON line a worker printed ("step", "eval", "checkpoint", "event", "summary") with the
 * step it belongs to. */
typedef struct {
    int64_t step;
    char *json; /* heap */
} daemon_line;

/* Wait up to timeout_ms for lines of job with step > after (step lines) or for its end.
 * Fills *lines (heap array, free with daemon_lines_free) with what the hub still holds;
 * *oldest is the smallest step the hub still holds for the job (a reader whose `after` is
 * below oldest - 1 must read the gap from the store). *finished is set once the job has
 * ended (its summary line, if any, is among the lines). STORE_ENOTFOUND when the hub has
 * never seen the job (not running since this daemon started). */
int daemon_sched_lines(daemon_sched *s, int64_t job, int64_t after, int timeout_ms,
                       daemon_line **lines, int *n, int64_t *oldest, bool *finished);
void daemon_lines_free(daemon_line *lines, int n);

typedef struct {
    int running, queued, max_running;
    int64_t workers_started, workers_failed;
} daemon_sched_info;
void daemon_sched_get_info(daemon_sched *s, daemon_sched_info *out);

/* ---- checkpoints (ckpt.c) ---------------------------------------------------------------- */

/* Write t's state to dir/ckpt-<step>.safetensors atomically (temp file, fsync, rename,
 * directory fsync). path receives the file's path and *bytes its size; err a message on
 * failure. Borrowed arguments. */
int daemon_ckpt_save(gpu_trainer *t, const char *dir, char *path, size_t pathlen,
                     int64_t *bytes, char *err, size_t errlen);
/* Load a checkpoint written by daemon_ckpt_save into a trainer built from the same spec.
 * GPU_EFORMAT (with err naming the problem) for another job's or a damaged file. */
int daemon_ckpt_load(gpu_trainer *t, const char *path, char *err, size_t errlen);

/* `ampd run [options] JOB.json`: train in the foreground, one JSON line per step on
 * stdout. Returns the process exit status (0 succeeded, 1 failed, 2 bad usage or spec,
 * 130 interrupted). */
int daemon_run_main(int argc, char **argv);

/* `ampd serve [options]`: the daemon in the foreground until SIGTERM/SIGINT. Returns the
 * process exit status (0 after a graceful stop, 1 start-up error, 2 bad usage). */
int daemon_serve_main(int argc, char **argv);

#endif /* AMPD_DAEMON_H */
