/*
 * log.c - the one logger: leveled lines on stderr with an ISO-8601 UTC timestamp, the
 * level and the calling function; daemon_log_install makes it the log hook of the store
 * (which api/ reports through as well) and of the engine (gpu_set_log); their levels are
 * daemon_log_level's numbers.
 *
 * Threads: the level is an atomic int; each line is written with a single fprintf, which
 * stdio locks, so lines from different threads never interleave.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/api.h"
#include "daemon/log.h"
#include "gpu/gpu.h"
#include "store/store.h"

static atomic_int log_level = -1;
static char log_tag[96]; /* "rank 1 host " in a data-parallel job's ranks; set before threads */

void daemon_log_set_tag(const char *tag)
{
    snprintf(log_tag, sizeof(log_tag), "%s%s", tag ? tag : "", tag && *tag ? " " : "");
}

void daemon_log_set_level(daemon_log_level level)
{
    atomic_store(&log_level, (int)level);
}

static int level_from_env(void)
{
    static const char *const names[] = {"debug", "info", "warn", "error"};
    const char *e = getenv("AMPD_LOG");
    for (int i = 0; e && i < 4; i++)
        if (strcmp(e, names[i]) == 0)
            return i;
    return DAEMON_LOG_INFO;
}

int daemon_log_enabled(daemon_log_level level)
{
    int cur = atomic_load(&log_level);
    if (cur < 0) {
        cur = level_from_env();
        atomic_store(&log_level, cur);
    }
    return (int)level >= cur;
}

void daemon_log_write(daemon_log_level level, const char *func, const char *fmt, ...)
{
    static const char *const names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    char msg[2048], stamp[32];
    struct timespec ts;
    struct tm tm;
    va_list ap;

    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm);
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s.%03ldZ %-5s %s%s: %s\n", stamp, ts.tv_nsec / 1000000L, names[level],
            log_tag, func, msg);
}

/* The store's log hook (the API's messages come through it too): a message as one of our
 * lines. */
static void hook(void *arg, int level, const char *func, const char *msg)
{
    (void)arg;
    if (level < DAEMON_LOG_DEBUG || level > DAEMON_LOG_ERROR)
        level = DAEMON_LOG_ERROR;
    if (daemon_log_enabled((daemon_log_level)level))
        daemon_log_write((daemon_log_level)level, func, "%s", msg);
}

_Static_assert((int)STORE_LOG_DEBUG == (int)DAEMON_LOG_DEBUG &&
                   (int)STORE_LOG_ERROR == (int)DAEMON_LOG_ERROR &&
                   (int)GPU_LOG_DEBUG == (int)DAEMON_LOG_DEBUG &&
                   (int)GPU_LOG_ERROR == (int)DAEMON_LOG_ERROR,
               "the hooks' levels are the logger's");

void daemon_log_install(void)
{
    store_set_log(hook, NULL); /* api/ reports through the store's hook too */
    gpu_set_log(hook, NULL);
}
