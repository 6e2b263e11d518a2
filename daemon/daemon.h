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

/* `ampd run [options] JOB.json`: train in the foreground, one JSON line per step on
 * stdout. Returns the process exit status (0 succeeded, 1 failed, 2 bad usage or spec,
 * 130 interrupted). */
int daemon_run_main(int argc, char **argv);

#endif /* AMPD_DAEMON_H */
