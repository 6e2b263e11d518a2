/*
 * check_block.c - Check suite "block": the trainer's memory blocks (gpu/block.c) and guard
 * mode.
 *
 * A block is zeroed, 64-byte aligned in guard mode, and freed the way it was made whatever
 * the mode is by then. In guard mode a write just past the end or just before the start is
 * named by gpu_block_check (which block, how many bytes out), a write that leaves the 64-byte
 * slack faults at once (in a child process), and a write into the header is found in both
 * modes, after which gpu_block_free leaves the block alone instead of freeing garbage. A
 * trainer in guard mode runs steps with its blocks checked (gpu_trainer_check).
 *
 * Threads: each test runs in its own process (Check's fork mode); the faulting writes run in
 * a child that the test waits for.
 */
#include <check.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu/gpu_int.h"

static const size_t sizes[] = {0, 1, 63, 64, 100, 4096, 4096 * 3 + 17};
#define NSIZES (sizeof sizes / sizeof sizes[0])

/* Zeroed and writable end to end, in both modes; nothing to report after that. */
START_TEST(t_zeroed_writable)
{
    char why[160];
    for (int guard = 0; guard < 2; guard++) {
        gpu_guard_set(guard);
        for (size_t i = 0; i < NSIZES; i++) {
            unsigned char *p = gpu_block_alloc(sizes[i], "test");
            ck_assert_ptr_nonnull(p);
            if (guard)
                ck_assert_uint_eq((uintptr_t)p % 64, 0);
            for (size_t j = 0; j < sizes[i]; j++)
                ck_assert_uint_eq(p[j], 0);
            memset(p, 0x5A, sizes[i]);
            ck_assert_msg(gpu_block_check(p, why, sizeof why) == 0, "%zu: %s", sizes[i], why);
            gpu_block_free(p);
        }
    }
    gpu_block_free(NULL);
    ck_assert_int_eq(gpu_block_check(NULL, why, sizeof why), 0);
}
END_TEST

/* Guard mode names a write one byte past the end, or just before the start, and where. */
START_TEST(t_guard_names_the_write)
{
    char why[160];
    gpu_guard_set(true);
    unsigned char *p = gpu_block_alloc(100, "scratch");
    ck_assert_ptr_nonnull(p);
    p[100] = 1;
    ck_assert_int_eq(gpu_block_check(p, why, sizeof why), GPU_EGUARD);
    ck_assert_msg(strstr(why, "scratch block was written 1 bytes past its end") != NULL, "%s", why);
    p[100] = 0xA5; /* the pattern back: clean again */
    ck_assert_int_eq(gpu_block_check(p, why, sizeof why), 0);
    p[127] = 0;
    ck_assert_int_eq(gpu_block_check(p, why, sizeof why), GPU_EGUARD);
    ck_assert_msg(strstr(why, "28 bytes past its end") != NULL, "%s", why);
    gpu_block_free(p);

    p = gpu_block_alloc(4096, "activations");
    ck_assert_ptr_nonnull(p);
    p[-65] = 0; /* in front of the header */
    ck_assert_int_eq(gpu_block_check(p, why, sizeof why), GPU_EGUARD);
    ck_assert_msg(strstr(why, "activations block was written 65 bytes before its start") != NULL,
                  "%s", why);
    gpu_block_free(p);
}
END_TEST

/* A write into the header (just before the block) is found in both modes, and free then
 * leaves the block alone rather than act on the header's new contents (in a child, which
 * leaves without the leak check: the block is leaked on purpose). */
START_TEST(t_header_write)
{
    char why[160];
    for (int guard = 0; guard < 2; guard++) {
        gpu_guard_set(guard);
        unsigned char *p = gpu_block_alloc(256, "gradients");
        ck_assert_ptr_nonnull(p);
        p[-1] ^= 0xFF;
        ck_assert_int_eq(gpu_block_check(p, why, sizeof why), GPU_EGUARD);
        ck_assert_msg(strstr(why, "header was overwritten") != NULL, "%s", why);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
            gpu_block_free(p);
            _exit(0);
        }
        int st;
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "free: status %d", st);
        p[-1] ^= 0xFF; /* the header back: clean, and freed for real */
        ck_assert_int_eq(gpu_block_check(p, why, sizeof why), 0);
        gpu_block_free(p);
    }
}
END_TEST

/* In a child: a guarded block of n bytes written at offset off; its exit status. */
static int child_writes(size_t n, long off)
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        /* the fault kills the child as it would a job (AddressSanitizer's handler would
         * report it and exit instead) */
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        sigaction(SIGSEGV, &dfl, NULL);
        gpu_guard_set(true);
        unsigned char *p = gpu_block_alloc(n, "block");
        if (p == NULL)
            _exit(3);
        ((volatile unsigned char *)p)[off] = 1;
        _exit(0);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    return status;
}

/* A write past the 64-byte slack, or before the page in front, faults where it is made. */
START_TEST(t_guard_faults)
{
    int st = child_writes(100, 128);
    ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV, "past the end: status %d", st);
    st = child_writes(4096, 4096 + 64);
    ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV, "past a page: status %d", st);
    long pg = sysconf(_SC_PAGESIZE);
    st = child_writes(100, -(pg + 200));
    ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV, "before the start: status %d", st);
    st = child_writes(100, 99); /* the last byte: fine */
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "inside: status %d", st);
}
END_TEST

/* A block made in one mode is freed right after the mode changes. */
START_TEST(t_mode_change)
{
    gpu_guard_set(true);
    void *a = gpu_block_alloc(1000, "a");
    gpu_guard_set(false);
    void *b = gpu_block_alloc(1000, "b");
    gpu_guard_set(true);
    ck_assert(a && b);
    ck_assert_int_eq(gpu_block_check(a, NULL, 0), 0);
    ck_assert_int_eq(gpu_block_check(b, NULL, 0), 0);
    gpu_block_free(b);
    gpu_guard_set(false);
    gpu_block_free(a);
}
END_TEST

/* A small MLP trainer in guard mode: its steps and evaluation leave every block clean. */
START_TEST(t_trainer_guarded)
{
    gpu_job_config c;
    gpu_trainer *t = NULL;
    gpu_step_metrics m;
    gpu_eval_result r;
    char err[256] = "";
    gpu_guard_set(true);
    gpu_job_defaults(&c);
    c.model.nlayers = 3;
    c.model.layers[0] = 20;
    c.model.layers[1] = 32;
    c.model.layers[2] = 4;
    c.data.synth_features = 20;
    c.data.synth_classes = 4;
    c.data.synth_train = 256;
    c.data.synth_eval = 64;
    c.dtype = GPU_BF16;
    gpu_scaler_defaults(&c.scaler, GPU_BF16);
    c.batch_size = 32;
    c.steps = 5;
    c.threads = 1;
    snprintf(c.device, sizeof c.device, "cpu");
    ck_assert_msg(gpu_trainer_create(&c, &t, err, sizeof err) == 0, "%s", err);
    for (int i = 0; i < 5; i++)
        ck_assert_msg(gpu_trainer_step(t, &m, err, sizeof err) == 0, "step %d: %s", i + 1, err);
    ck_assert_int_eq(gpu_trainer_eval(t, &r), 0);
    ck_assert_msg(gpu_trainer_check(t, err, sizeof err) == 0, "%s", err);
    gpu_trainer_free(t);
}
END_TEST

static Suite *block_suite(void)
{
    Suite *s = suite_create("block");
    TCase *tc = tcase_create("block");
    tcase_add_test(tc, t_zeroed_writable);
    tcase_add_test(tc, t_guard_names_the_write);
    tcase_add_test(tc, t_header_write);
    tcase_add_test(tc, t_guard_faults);
    tcase_add_test(tc, t_mode_change);
    tcase_add_test(tc, t_trainer_guarded);
    tcase_set_timeout(tc, 30);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(block_suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
