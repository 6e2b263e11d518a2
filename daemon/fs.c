/*
 * fs.c - the scheduler's file helpers (contract in fs.h): mkdir -p, a file written
 * atomically (a job's spec.json), a job directory removed, and the last lines of a
 * worker.log quoted in a failed job's reason.
 *
 * Invariants: a job directory holds files only (no subdirectories), so its removal is one
 * level deep; an atomic write leaves either the old file or the whole new one.
 *
 * Threads: reentrant (no state).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "daemon/fs.h"
#include "daemon/log.h"

#define LOG_TAIL_LINES 10
#define LOG_TAIL_BYTES 8192

/* Append text to the string in out (outlen bytes), truncating. */
static void append(char *out, size_t outlen, const char *text)
{
    size_t used = strnlen(out, outlen), n = strlen(text);
    if (used + 1 >= outlen)
        return;
    if (n > outlen - used - 1)
        n = outlen - used - 1;
    memcpy(out + used, text, n);
    out[used + n] = '\0';
}

/* Create path and its missing parents with mode; see fs.h. */
int daemon_mkdirs(const char *path, unsigned mode)
{
    char tmp[1024];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof(tmp))
        return -1;
    memcpy(tmp, path, n + 1);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            if (mkdir(tmp, (mode_t)mode) != 0 && errno != EEXIST)
                return -1;
            *p = '/';
        }
    return mkdir(tmp, (mode_t)mode) != 0 && errno != EEXIST ? -1 : 0;
}

/* Write text to path atomically (temp file, fsync, rename). */
int daemon_write_atomic(const char *path, const char *text)
{
    char tmp[1100];
    size_t n = strlen(text);
    int fd, ok;
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
    if (fd < 0)
        return -1;
    ok = write(fd, text, n) == (ssize_t)n && fsync(fd) == 0;
    ok = close(fd) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* Remove a job directory: its files (no subdirectories are ever made) and itself. */
void daemon_remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[1024];
    if (!d)
        return;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (unlink(path) != 0)
            log_warn("cannot remove %s: %s", path, strerror(errno));
    }
    closedir(d);
    if (rmdir(dir) != 0 && errno != ENOENT)
        log_warn("cannot remove %s: %s", dir, strerror(errno));
}

/* The last LOG_TAIL_LINES lines of worker.log written since byte start, appended to out. */
void daemon_log_tail(const char *dir, off_t start, char *out, size_t outlen)
{
    char path[700], buf[LOG_TAIL_BYTES + 1];
    struct stat sb;
    ssize_t n;
    char *p;
    int fd, lines = 0;

    snprintf(path, sizeof(path), "%s/worker.log", dir);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    if (fstat(fd, &sb) != 0 || sb.st_size <= start) {
        close(fd);
        return;
    }
    if (sb.st_size - start > LOG_TAIL_BYTES)
        start = sb.st_size - LOG_TAIL_BYTES;
    n = pread(fd, buf, LOG_TAIL_BYTES, start);
    close(fd);
    if (n <= 0)
        return;
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
        n--;
    buf[n] = '\0';
    for (p = buf + n; p > buf; p--)
        if (p[-1] == '\n' && ++lines == LOG_TAIL_LINES)
            break;
    append(out, outlen, "\nlast lines of worker.log:\n");
    append(out, outlen, p);
}

