/*
 * main.c - the ampd executable: dispatches `ampd serve`, `ampd run`, `ampd version` and
 * `ampd help`.
 *
 * provides: main. uses: daemon_serve_main (daemon/serve.c), daemon_run_main (daemon/run.c),
 * daemon_log_install (daemon/log.c), gpu_blas_info, gpu_cuda_probe. Threads: the main thread
 * only.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "daemon/daemon.h"
#include "daemon/log.h"
#include "gpu/gpu.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: ampd COMMAND [ARGS]\n"
               "commands:\n"
               "  serve          run the daemon (REST API, job queue, run history)\n"
               "  run JOB.json   train a job in the foreground (JSON lines on stdout)\n"
               "  version        print the version and the backends found\n"
               "  help           this text\n"
               "`ampd serve --help` and `ampd run --help` describe their options.\n");
}

static int version(void)
{
    char why[256], paths[128];
    int cuda = gpu_cuda_probe(why, sizeof(why)) == 0;
    gpu_blas_init(0);
    gpu_gemm_paths(paths, sizeof(paths));
    printf("ampd %s\nblas: %s\ngemm fp32: %s\ngemm fp16: %s\ngemm bf16: %s\n"
           "gemm paths (AMPD_GEMM): %s\nconvert: %s\ncuda: %s\n",
           PACKAGE_VERSION, gpu_blas_info(), gpu_gemm_info(GPU_FP32), gpu_gemm_info(GPU_FP16),
           gpu_gemm_info(GPU_BF16), paths, gpu_cvt_impl(), cuda ? "device available" : why);
    return 0;
}

/* The engine's passes and oneDNN share an OpenMP team (libgomp). By default its threads
 * spin for a long while at the end of each parallel region; when other processes keep the
 * cores busy (other jobs, a build, the tests of `make -j2 check`) every region then waits a
 * scheduler time slice for a thread without a core, and a step gets 5-15x slower (a bf16
 * MLP step: 350 ms against 26 ms passive, at load 5). A short spin keeps the quiet
 * machine's speed (8.4 ms against 10.9 ms passive, and a GPT step 170 against 199 ms) and
 * then sleeps. libgomp reads its settings when it loads, before main: so unless the user
 * chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT), ampd executes itself again, once, with
 * GOMP_SPINCOUNT=20000. If that fails it carries on with libgomp's default. */
static void openmp_wait_policy(char **argv)
{
    if (getenv("OMP_WAIT_POLICY") != NULL || getenv("GOMP_SPINCOUNT") != NULL)
        return;
    if (setenv("GOMP_SPINCOUNT", "20000", 1) != 0)
        return;
    execv("/proc/self/exe", argv);
}

int main(int argc, char **argv)
{
    openmp_wait_policy(argv);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    daemon_log_install(); /* the store's and the API's messages in the same log */
    if (strcmp(argv[1], "run") == 0)
        return daemon_run_main(argc - 1, argv + 1);
    if (strcmp(argv[1], "serve") == 0)
        return daemon_serve_main(argc - 1, argv + 1);
    if (strcmp(argv[1], "version") == 0 || strcmp(argv[1], "--version") == 0)
        return version();
    if (strcmp(argv[1], "help") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "ampd: unknown command \"%s\"\n", argv[1]);
    usage(stderr);
    return 2;
}
