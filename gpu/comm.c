/*
 * comm.c - the parts of data-parallel communication that need no MPI, built into every
 * ampd: the hook names, whether mpirun launched us, the bucket layout, the ready count and
 * the 16-bit hop sum. The collectives are in comm_mpi.c (comm_none.c without MPI); the CUDA
 * ranks (gpu/cuda/cuda_comm.cu) and the CUDA emulator's NCCL use these helpers too.
 *
 * Hooks, as PyTorch's DDP comm hooks: NONE divides the fp32 bucket by N (x / N) and SUMs it
 * in fp32 (MPI_FLOAT, MPI_SUM). FP16 / BF16 round the bucket to the 16-bit type, divide by
 * N in fp32 and round the quotient to the 16-bit type again (what a 16-bit tensor's div_
 * does), then SUM with a user-defined MPI_Op over a 2-byte datatype: every partial sum is
 * computed in fp32 from the two 16-bit operands and rounded to the 16-bit type, nearest
 * even (as each hop of NCCL's ring sums in 16 bits: gpu_comm_sum16), so a sum beyond 65504
 * becomes inf in fp16. The result is widened exactly into the fp32 gradients. MPI has no
 * standard 16-bit float type, hence the user op; Open MPI then reduces with its generic
 * algorithms.
 *
 * Threads: every function here is pure or reads the environment; all are thread-safe.
 */
#include "config.h"

#include <stdlib.h>

#include "gpu/comm.h"
#include "gpu/gpu_int.h"

#define FIRST_BUCKET_BYTES (1u << 20)

bool gpu_comm_available(void)
{
#ifdef HAVE_MPI
    return true;
#else
    return false;
#endif
}

const char *gpu_comm_hook_name(gpu_comm_hook h)
{
    static const char *const names[] = {"none", "fp16", "bf16"};
    return h >= GPU_HOOK_NONE && h <= GPU_HOOK_BF16 ? names[h] : "?";
}

const char *gpu_launcher_name(gpu_launcher l)
{
    static const char *const names[] = {"default", "mpirun", "slurm"};
    return l >= GPU_LAUNCH_DEFAULT && l <= GPU_LAUNCH_SLURM ? names[l] : "?";
}

bool gpu_comm_launched(void)
{
    return getenv("OMPI_COMM_WORLD_SIZE") != NULL || getenv("PMIX_RANK") != NULL;
}

static int env_int(const char *name, int dflt)
{
    const char *v = getenv(name);
    return v && atoi(v) > 0 ? atoi(v) : dflt;
}

/* This node's task count from Slurm's SLURM_STEP_TASKS_PER_NODE ("2(x3),1": three nodes
 * of 2 tasks, then one of 1) and SLURM_NODEID; 1 when they are missing or malformed. */
static int slurm_local_size(void)
{
    const char *s = getenv("SLURM_STEP_TASKS_PER_NODE");
    int node = env_int("SLURM_NODEID", 0), at = 0;
    while (s && *s) {
        char *end;
        long tasks = strtol(s, &end, 10), times = 1;
        if (end == s || tasks < 1)
            return 1;
        if (end[0] == '(' && end[1] == 'x') {
            times = strtol(end + 2, &end, 10);
            if (times < 1 || *end++ != ')')
                return 1;
        }
        if (node < at + times)
            return (int)tasks;
        at += (int)times;
        s = *end == ',' ? end + 1 : end;
    }
    return 1;
}

/* Open MPI's variables under mpirun; Slurm's under srun (direct launch through PMIx). */
void gpu_comm_local(int *rank, int *size)
{
    if (getenv("OMPI_COMM_WORLD_LOCAL_SIZE") || !getenv("SLURM_STEP_TASKS_PER_NODE")) {
        *rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
        *size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
        return;
    }
    *rank = env_int("SLURM_LOCALID", 0);
    *size = slurm_local_size();
}

#define CHUNK 512

/* See comm.h: chunk by chunk through fp32. */
void gpu_comm_sum16(const uint16_t *in, uint16_t *inout, int len, gpu_dtype dt)
{
    float a[CHUNK], b[CHUNK];
    for (int i = 0; i < len; i += CHUNK) {
        int n = len - i < CHUNK ? len - i : CHUNK;
        gpu_cvt_to_f32(a, in + i, dt, (size_t)n);
        gpu_cvt_to_f32(b, inout + i, dt, (size_t)n);
        for (int k = 0; k < n; k++)
            a[k] += b[k];
        gpu_cvt_from_f32(inout + i, dt, a, (size_t)n);
    }
}

size_t gpu_comm_overlap(size_t lo, size_t hi, size_t off, size_t count)
{
    size_t a = off > lo ? off : lo, b = off + count < hi ? off + count : hi;
    return a < b ? b - a : 0;
}

int gpu_comm_buckets(const size_t *off, const size_t *count, int n, double bucket_mb,
                     size_t *lo, size_t *hi)
{
    size_t cap = (size_t)(bucket_mb * 1024.0 * 1024.0), limit = FIRST_BUCKET_BYTES;
    int nb = 0;
    if (cap < 4)
        cap = 4;
    if (limit > cap)
        limit = cap;
    for (int i = n - 1; i >= 0; i--) {
        size_t a = off[i], b = off[i] + count[i];
        /* a tensor joins the open bucket when it adjoins it and the bucket has room */
        if (nb && b == lo[nb - 1] && (hi[nb - 1] - lo[nb - 1] + count[i]) * 4 <= limit) {
            lo[nb - 1] = a;
            continue;
        }
        if (nb)
            limit = cap; /* the first bucket is closed */
        lo[nb] = a;
        hi[nb] = b;
        nb++;
    }
    return nb;
}
