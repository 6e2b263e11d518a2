/*
 * lock.c - the exclusive locks of `ampd serve` (lock.h): flock(2) on a lock file that holds
 * the pid of the daemon that owns it.
 *
 * flock locks belong to the open file description: the kernel drops one when its last
 * descriptor closes, so a daemon killed with SIGKILL leaves a lock file with a stale pid
 * but no lock, and the next daemon takes it. The descriptor is close-on-exec: a worker
 * holds a copy only between fork and exec, never after, so a worker that outlives its
 * daemon does not keep the next one out.
 *
 * The holder writes its pid after taking the lock, so a daemon that finds the lock taken
 * may read the file before the pid is in it; it reads again for up to a second.
 *
 * Threads: start-up only.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "daemon/lock.h"

#define PID_WAIT_TRIES 20 /* 20 x 50 ms */

/* The pid written in the lock file, or 0 when there is none (yet). */
static long holder_pid(int fd)
{
    char buf[32];
    for (int i = 0; i < PID_WAIT_TRIES; i++) {
        ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
        char *end;
        long pid;
        if (n > 0) {
            buf[n] = '\0';
            pid = strtol(buf, &end, 10);
            if (end != buf && *end == '\n' && pid > 0)
                return pid;
        }
        nanosleep(&(struct timespec){0, 50 * 1000000L}, NULL);
    }
    return 0;
}

int daemon_lock_take(const char *path, const char *what, int *fd, char *err, size_t errlen)
{
    char pid[32];
    int rc, n;
    int f = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);

    *fd = -1;
    if (f < 0) {
        rc = -errno;
        snprintf(err, errlen, "cannot open the lock file %s of %s: %s", path, what,
                 strerror(errno));
        return rc;
    }
    while ((rc = flock(f, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR)
        ;
    if (rc != 0) {
        if (errno == EWOULDBLOCK) {
            long other = holder_pid(f);
            if (other > 0)
                snprintf(err, errlen, "another ampd (pid %ld) holds %s (lock file %s)", other, what,
                         path);
            else
                snprintf(err, errlen, "another ampd holds %s (lock file %s, no pid in it)", what,
                         path);
            rc = -EWOULDBLOCK;
        } else {
            rc = -errno;
            snprintf(err, errlen, "cannot lock %s (lock file %s): %s", what, path, strerror(errno));
        }
        goto fail;
    }
    n = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
    errno = 0;
    if (ftruncate(f, 0) != 0 || pwrite(f, pid, (size_t)n, 0) != n) {
        rc = errno ? -errno : -EIO;
        snprintf(err, errlen, "cannot write the pid into the lock file %s: %s", path,
                 strerror(errno));
        goto fail;
    }
    *fd = f;
    return 0;
fail:
    close(f);
    return rc;
}

void daemon_lock_release(int fd)
{
    if (fd < 0)
        return;
    flock(fd, LOCK_UN);
    close(fd);
}
