/*
 * lock.h - internal header of daemon/: the exclusive locks `ampd serve` holds on its data
 * directory and its database, so that a second daemon on either refuses to start instead
 * of taking the first one's running jobs for interrupted (lock.c).
 *
 * Errors: 0 or a negative errno value (-EWOULDBLOCK: another process holds the lock), with
 * a message in err. Threads: start-up only, on the main thread.
 */
#ifndef AMPD_DAEMON_LOCK_H
#define AMPD_DAEMON_LOCK_H

#include <stddef.h>

/* Take the exclusive lock of the lock file at path (created, mode 0600), which stands for
 * `what` ("the data directory /var/lib/ampd"), and write this process's pid into it. *fd
 * receives the descriptor that holds the lock (close-on-exec, so workers never hold it)
 * until daemon_lock_release() or the process's end, a kill -9 included. When another
 * process holds it, err names that process's pid and what it holds. */
int daemon_lock_take(const char *path, const char *what, int *fd, char *err, size_t errlen);
/* Release a lock taken by daemon_lock_take (the file stays); -1 is accepted. */
void daemon_lock_release(int fd);

#endif /* AMPD_DAEMON_LOCK_H */
