/*
 * log.h - internal header of daemon/: the one logger of the ampd process. Leveled lines on
 * stderr (ISO-8601 UTC time, level, function, message); main() installs it as the log
 * hook of the libraries below it (store_set_log, which api/ reports through too, and
 * gpu_set_log), so their messages come out the same way.
 *
 * Threads: every function is thread-safe (one fprintf per line, which stdio locks).
 */
#ifndef AMPD_DAEMON_LOG_H
#define AMPD_DAEMON_LOG_H

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
/* A tag written before each line's function ("rank 1"; NULL or "": none). Call it before
 * other threads log. */
void daemon_log_set_tag(const char *tag);
/* Install the logger as the store's log hook, which the API uses too, and the engine's (their
 * levels are the same numbers as daemon_log_level). */
void daemon_log_install(void);

#define daemon_log(level, ...)                                                                     \
    do {                                                                                           \
        if (daemon_log_enabled(level))                                                             \
            daemon_log_write(level, __func__, __VA_ARGS__);                                        \
    } while (0)
#define log_debug(...) daemon_log(DAEMON_LOG_DEBUG, __VA_ARGS__)
#define log_info(...) daemon_log(DAEMON_LOG_INFO, __VA_ARGS__)
#define log_warn(...) daemon_log(DAEMON_LOG_WARN, __VA_ARGS__)
#define log_error(...) daemon_log(DAEMON_LOG_ERROR, __VA_ARGS__)

#endif /* AMPD_DAEMON_LOG_H */
