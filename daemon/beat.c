/*
 * beat.c - the ranks' heartbeats and the launcher's watch over them (contract in beat.h).
 *
 * A beat file is one line, "pid host step step_time beat_time" (times: seconds since the
 * epoch), rewritten in place every second by the rank's beat thread, which runs whatever the
 * rank's training thread does: a rank stopped by SIGSTOP or dead stops beating; a rank
 * blocked in a collective goes on beating but makes no progress. The launcher is on the
 * same machine as the files (every rank's files are in the job's directory; with
 * distributed.hosts, on the shared filesystem the hosts need anyway).
 *
 * Threads: see beat.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "daemon/beat.h"

struct daemon_beat {
    char path[700];
    char host[128];
    int fd;
    _Atomic int64_t step;
    _Atomic double step_time;
    atomic_bool stop;
    pthread_t thread;
};

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void beat_write(daemon_beat *b)
{
    char line[256];
    int n = snprintf(line, sizeof(line), "%ld %s %lld %.3f %.3f\n", (long)getpid(), b->host,
                     (long long)atomic_load(&b->step), atomic_load(&b->step_time), wall_now());
    if (n > 0 && pwrite(b->fd, line, (size_t)n, 0) == n) {
        int rc = ftruncate(b->fd, n); /* a shorter line than the last */
        (void)rc;
    }
}

static void *beat_main(void *arg)
{
    daemon_beat *b = arg;
    struct timespec tick = {0, 100 * 1000 * 1000};
    for (int i = 0; !atomic_load(&b->stop); i++) {
        if (i % 10 == 0)
            beat_write(b);
        nanosleep(&tick, NULL);
    }
    return NULL;
}

int daemon_beat_start(const char *dir, int rank, daemon_beat **out)
{
    daemon_beat *b = calloc(1, sizeof(*b));
    if (!b)
        return -1;
    snprintf(b->path, sizeof(b->path), "%s/rank-%d.beat", dir, rank);
    if (gethostname(b->host, sizeof(b->host)) != 0 || !b->host[0])
        snprintf(b->host, sizeof(b->host), "localhost");
    atomic_store(&b->step_time, wall_now());
    b->fd = open(b->path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
    if (b->fd < 0) {
        free(b);
        return -1;
    }
    beat_write(b);
    if (pthread_create(&b->thread, NULL, beat_main, b) != 0) {
        close(b->fd);
        unlink(b->path);
        free(b);
        errno = EAGAIN;
        return -1;
    }
    *out = b;
    return 0;
}

void daemon_beat_progress(daemon_beat *b, int64_t step)
{
    if (!b)
        return;
    atomic_store(&b->step, step);
    atomic_store(&b->step_time, wall_now());
}

void daemon_beat_stop(daemon_beat *b)
{
    if (!b)
        return;
    atomic_store(&b->stop, true);
    pthread_join(b->thread, NULL);
    close(b->fd);
    unlink(b->path);
    free(b);
}

/* ---- the launcher's watch -------------------------------------------------------------------- */

typedef struct {
    bool seen;
    long pid;
    char host[128];
    long long step;
    double step_time, beat_time;
} beat_line;

static void beat_read(const char *dir, int rank, beat_line *l)
{
    char path[700];
    FILE *f;
    memset(l, 0, sizeof(*l));
    snprintf(path, sizeof(path), "%s/rank-%d.beat", dir, rank);
    if (!(f = fopen(path, "re")))
        return;
    l->seen = fscanf(f, "%ld %127s %lld %lf %lf", &l->pid, l->host, &l->step, &l->step_time,
                     &l->beat_time) == 5;
    fclose(f);
}

int daemon_beat_check(const char *dir, int nranks, double started, double grace_s,
                      double timeout_s, char *why, size_t len)
{
    double now = wall_now(), newest = 0;
    int slowest = -1;
    long long least = 0;
    beat_line l, low;
    for (int r = 0; r < nranks; r++) {
        beat_read(dir, r, &l);
        if (!l.seen) {
            if (now - started > grace_s) {
                snprintf(why, len, "rank %d never started: no heartbeat %.0f s after the job's "
                         "start (rank_timeout_s %.0f, start-up grace %.0f s)",
                         r, now - started, timeout_s, grace_s);
                return 1;
            }
            return 0; /* still starting: no verdict on progress yet */
        }
        if (now - l.beat_time > timeout_s) {
            snprintf(why, len, "rank %d (host %s, pid %ld) has not answered for %.0f s "
                     "(stopped, dead or frozen; rank_timeout_s %.0f); its last step was %lld",
                     r, l.host, l.pid, now - l.beat_time, timeout_s, l.step);
            return 1;
        }
        newest = l.step_time > newest ? l.step_time : newest;
        if (slowest < 0 || l.step < least) {
            slowest = r, least = l.step, low = l;
        }
    }
    if (slowest >= 0 && now - newest > timeout_s && now - started > grace_s) {
        snprintf(why, len, "no rank has finished a step for %.0f s (rank_timeout_s %.0f): "
                 "rank %d (host %s, pid %ld) is the furthest behind, at step %lld "
                 "(deadlocked in a collective, or spinning)",
                 now - newest, timeout_s, slowest, low.host, low.pid, least);
        return 1;
    }
    return 0;
}
