/*
 * fuzz.h - what the libFuzzer harnesses of tests/fuzz/ share (header-only, one copy per
 * harness): the entry point libFuzzer calls, an input as a file the code under test opens
 * by path (a memfd, never on disk), a scratch directory removed at exit, the split of one
 * input into two files, and a failed property that stops the run with its reason.
 *
 * Each harness is built twice (Makefile.am): with clang and -fsanitize=fuzzer for `make
 * fuzz`, and with the C compiler and tests/fuzz/replay.c for `make check`, which replays
 * the checked-in corpus through it.
 *
 * Threads: the calling thread only (the HTTP harness's server has its own).
 */
#ifndef AMPD_TESTS_FUZZ_H
#define AMPD_TESTS_FUZZ_H

#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A property of the code under test does not hold: say which and abort (a crash to
 * libFuzzer, with the input saved as an artifact). */
static inline void fuzz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fuzz_dir_remove(void);

static inline void fuzz_fail(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "fuzz: property failed: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    fuzz_dir_remove();
    abort();
}

/* An anonymous file holding data[0..n): its descriptor (-1 on failure), and in path the
 * name that opens it ("/proc/self/fd/N"). The caller closes it. */
static inline int fuzz_file(const uint8_t *data, size_t n, char *path, size_t len)
{
    int fd = memfd_create("ampd-fuzz", MFD_CLOEXEC);
    size_t off = 0;
    if (fd < 0)
        return -1;
    while (off < n) {
        ssize_t w = write(fd, data + off, n - off);
        if (w <= 0) {
            close(fd);
            return -1;
        }
        off += (size_t)w;
    }
    snprintf(path, len, "/proc/self/fd/%d", fd);
    return fd;
}

static char fuzz_dir_path[512];

static void fuzz_dir_remove(void)
{
    char cmd[600];
    if (!fuzz_dir_path[0])
        return;
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", fuzz_dir_path);
    if (system(cmd) != 0)
        fprintf(stderr, "fuzz: cannot remove %s\n", fuzz_dir_path);
}

/* A scratch directory of this process in $TMPDIR or /tmp (created once, removed at exit;
 * a run that crashes leaves it, which is why tests/fuzz/run.sh gives each fuzzer a TMPDIR
 * under tests/fuzz/out/), or NULL. */
static inline const char *fuzz_dir(void)
{
    const char *tmp = getenv("TMPDIR");
    if (fuzz_dir_path[0])
        return fuzz_dir_path;
    if (!tmp || tmp[0] != '/' || strlen(tmp) > 400)
        tmp = "/tmp";
    snprintf(fuzz_dir_path, sizeof(fuzz_dir_path), "%s/ampd-fuzz-XXXXXX", tmp);
    if (!mkdtemp(fuzz_dir_path)) {
        fuzz_dir_path[0] = '\0';
        return NULL;
    }
    atexit(fuzz_dir_remove);
    return fuzz_dir_path;
}

/* Write data[0..n) to dir/name; 0 or -1. */
static inline int fuzz_write(const char *dir, const char *name, const void *data, size_t n)
{
    char p[768];
    FILE *f;
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    f = fopen(p, "wb");
    if (!f)
        return -1;
    if (n && fwrite(data, 1, n, f) != n) {
        fclose(f);
        return -1;
    }
    return fclose(f) == 0 ? 0 : -1;
}

/* Two files in one input: a little-endian uint16 n, then the first file (n bytes, or what
 * is left), then the second (the rest). */
static inline void fuzz_split(const uint8_t *data, size_t size, const uint8_t **a, size_t *na,
                              const uint8_t **b, size_t *nb)
{
    size_t n = size >= 2 ? (size_t)data[0] | (size_t)data[1] << 8 : 0;
    data += size >= 2 ? 2 : size;
    size -= size >= 2 ? 2 : size;
    if (n > size)
        n = size;
    *a = data;
    *na = n;
    *b = data + n;
    *nb = size - n;
}

#endif /* AMPD_TESTS_FUZZ_H */
