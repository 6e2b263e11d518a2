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

double daemon_beat_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void beat_write(daemon_beat *b)
{
    char line[256];
    int n = snprintf(line, sizeof(line), "%ld %s %lld %.3f %.3f\n", (long)getpid(), b->host,
                     (long long)atomic_load(&b->step), atomic_load(&b->step_time), daemon_beat_now());
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
    atomic_store(&b->step_time, daemon_beat_now());
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
    atomic_store(&b->step_time, daemon_beat_now());
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

/* Ranks whose heartbeats stopped within this long of the first to stop went together. */
#define LOST_TOGETHER_S 1.5

int daemon_beat_wait_all(const char *dir, int nranks, double timeout_s)
{
    struct timespec tick = {0, 5 * 1000 * 1000};
    double end = daemon_beat_now() + timeout_s;
    char path[700];
    for (int r = 0; r < nranks;) {
        snprintf(path, sizeof(path), "%s/rank-%d.beat", dir, r);
        if (access(path, F_OK) == 0) {
            r++;
            continue;
        }
        if (daemon_beat_now() > end)
            return -1;
        nanosleep(&tick, NULL);
    }
    return 0;
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

int daemon_beat_check(const char *dir, int nranks, bool *seen, double started, double grace_s,
                      double timeout_s, char *why, size_t len)
{
    double now = daemon_beat_now(), newest = 0;
    int slowest = -1;
    long long least = 0;
    beat_line l, low;
    for (int r = 0; r < nranks; r++) {
        beat_read(dir, r, &l);
        if (!l.seen && seen[r])
            continue; /* it stopped its heartbeat itself: it has left (finished or stopped) */
        seen[r] = seen[r] || l.seen;
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

int daemon_beat_lost(const char *dir, int nranks, char *why, size_t len)
{
    beat_line l;
    double first = 0;
    int n = 0;
    size_t used = 0;
    why[0] = '\0';
    for (int r = 0; r < nranks; r++) { /* when the first of them went silent */
        beat_read(dir, r, &l);
        if (l.seen && (first == 0 || l.beat_time < first))
            first = l.beat_time;
    }
    for (int r = 0; r < nranks && used < len; r++) {
        beat_read(dir, r, &l);
        if (!l.seen || l.beat_time > first + LOST_TOGETHER_S)
            continue;
        used += (size_t)snprintf(why + used, len - used, "%srank %d (host %s, pid %ld, step %lld)",
                                 n ? ", " : "", r, l.host, l.pid, l.step);
        n++;
    }
    return n;
}

/* ---- stragglers ------------------------------------------------------------------------------ */

struct daemon_straggle {
    int n, steps, streak, streak_rank, flagged; /* flagged: the straggling rank, or -1 */
    double *sum, *mean;
};

daemon_straggle *daemon_straggle_new(int n)
{
    daemon_straggle *s = calloc(1, sizeof(*s));
    if (!s || !(s->sum = calloc((size_t)n, sizeof(double))) ||
        !(s->mean = calloc((size_t)n, sizeof(double)))) {
        daemon_straggle_free(s);
        return NULL;
    }
    s->n = n;
    s->flagged = s->streak_rank = -1;
    return s;
}

void daemon_straggle_free(daemon_straggle *s)
{
    if (!s)
        return;
    free(s->sum);
    free(s->mean);
    free(s);
}

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The window's slowest rank and its mean over the median rank's mean. */
static int window_slowest(daemon_straggle *s, double *ratio)
{
    int worst = 0;
    double med;
    for (int r = 0; r < s->n; r++) {
        s->mean[r] = s->sum[r] / s->steps;
        if (s->mean[r] > s->mean[worst])
            worst = r;
    }
    *ratio = s->mean[worst];
    qsort(s->mean, (size_t)s->n, sizeof(double), cmp_dbl);
    med = s->n % 2 ? s->mean[s->n / 2] : 0.5 * (s->mean[s->n / 2 - 1] + s->mean[s->n / 2]);
    *ratio = med > 0 ? *ratio / med : 1.0;
    return worst;
}

int daemon_straggle_add(daemon_straggle *s, const double *busy, int *rank, double *ratio)
{
    int worst;
    for (int r = 0; r < s->n; r++)
        s->sum[r] += busy[r] > 0 ? busy[r] : 0;
    if (++s->steps < DAEMON_STRAGGLE_WINDOW)
        return 0;
    worst = window_slowest(s, ratio);
    memset(s->sum, 0, (size_t)s->n * sizeof(double));
    s->steps = 0;
    if (*ratio < DAEMON_STRAGGLE_RATIO) {
        s->streak = 0;
        if (s->flagged < 0)
            return 0;
        *rank = s->flagged;
        s->flagged = -1;
        return -1;
    }
    s->streak = worst == s->streak_rank ? s->streak + 1 : 1;
    s->streak_rank = worst;
    if (s->streak < DAEMON_STRAGGLE_WINDOWS || s->flagged == worst)
        return 0;
    s->flagged = worst;
    *rank = worst;
    return 1;
}
