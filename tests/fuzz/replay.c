/*
 * replay.c - the main of tests/fuzz/replay_<name>: a harness built with the ordinary C
 * compiler runs every file named on the command line (each file of a directory, in name
 * order) through LLVMFuzzerTestOneInput once, as a libFuzzer binary does with files. `make
 * check` replays the checked-in corpus this way (tests/check_fuzz.sh), so the inputs that
 * once crashed stay tests in every build, the sanitizer build of CI included.
 *
 * As libFuzzer's -rss_limit_mb=2048 does, the process may use 2 GiB of address space (not
 * under AddressSanitizer, which reserves terabytes of shadow): an input that makes the code
 * allocate more fails the same way in both (the harnesses treat running out of memory on a
 * small input as a failure).
 *
 * Prints one line per input and a count; exits 0 when every input ran (a crash aborts).
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "tests/fuzz/fuzz.h"

#define REPLAY_MAX_BYTES ((rlim_t)2 << 30)

/* Run the file at path; 0 or -1 (unreadable). */
static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    uint8_t *buf = NULL;
    long n;
    int rc = -1;

    if (!f)
        goto fail;
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0)
        goto fail;
    buf = malloc((size_t)n + 1); /* +1: never malloc(0) */
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n)
        goto fail;
    printf("replay %s (%ld bytes)\n", path, n);
    fflush(stdout);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    rc = 0;
fail:
    if (rc)
        fprintf(stderr, "replay: cannot read %s\n", path);
    free(buf);
    if (f)
        fclose(f);
    return rc;
}

/* Run path, or every regular file in it when it is a directory; adds to *count. */
static int run_path(const char *path, int *count)
{
    struct stat st;
    struct dirent **names = NULL;
    int n, rc = 0;

    if (stat(path, &st) != 0) {
        fprintf(stderr, "replay: %s does not exist\n", path);
        return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
        (*count)++;
        return run_file(path);
    }
    n = scandir(path, &names, NULL, alphasort);
    if (n < 0) {
        fprintf(stderr, "replay: cannot list %s\n", path);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        char p[4096];
        struct stat fs;
        snprintf(p, sizeof(p), "%s/%s", path, names[i]->d_name);
        if (names[i]->d_name[0] != '.' && stat(p, &fs) == 0 && S_ISREG(fs.st_mode)) {
            (*count)++;
            rc |= run_file(p);
        }
        free(names[i]);
    }
    free(names);
    return rc;
}

int main(int argc, char **argv)
{
    int count = 0, rc = 0;
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE|DIR...\n", argv[0]);
        return 2;
    }
#ifndef __SANITIZE_ADDRESS__
    struct rlimit lim;
    if (getrlimit(RLIMIT_AS, &lim) == 0 && (lim.rlim_max == RLIM_INFINITY ||
                                            lim.rlim_max > REPLAY_MAX_BYTES)) {
        lim.rlim_cur = REPLAY_MAX_BYTES;
        if (setrlimit(RLIMIT_AS, &lim) != 0)
            perror("replay: setrlimit");
    }
#endif
    for (int i = 1; i < argc; i++)
        rc |= run_path(argv[i], &count);
    printf("replayed %d inputs\n", count);
    return rc ? 1 : 0;
}
