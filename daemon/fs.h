/*
 * fs.h - internal header of daemon/: the file helpers of the scheduler (fs.c): directories,
 * atomic writes, a job directory's removal and the tail of a worker's log.
 *
 * Errors: daemon_mkdirs and daemon_write_atomic return 0 or -1 with errno.
 *
 * Threads: reentrant.
 */
#ifndef AMPD_DAEMON_FS_H
#define AMPD_DAEMON_FS_H

#include <stddef.h>
#include <sys/types.h>

/* Create path and its missing parents (mode for the ones created); 0 or -1 with errno. */
int daemon_mkdirs(const char *path, unsigned mode);
/* Write text to path atomically (temp file, fsync, rename); 0 or -1 with errno. */
int daemon_write_atomic(const char *path, const char *text);
/* Remove a job directory: its files (no subdirectories are ever made) and itself. */
void daemon_remove_dir(const char *dir);
/* The last lines of dir/worker.log written since byte start, appended to out. */
void daemon_log_tail(const char *dir, off_t start, char *out, size_t outlen);

#endif /* AMPD_DAEMON_FS_H */
