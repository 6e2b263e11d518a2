/*
 * nccl.cc - NCCL emulated for the CUDA emulator (tests/cudaemu): the subset
 * gpu/cuda/cuda_comm.cu uses, over MPI, so that the multi-rank CUDA path (the bootstrap, the
 * hooks' kernels, the collectives' order and arguments) runs under mpirun on machines
 * without a GPU. Like NCCL, one communicator per process with one device each.
 *
 * What it checks as NCCL would, and more: ranks and counts in range; the communicator's size
 * and rank match MPI's (the stand-in is MPI_COMM_WORLD, duplicated); every rank was given
 * the same unique id (a job whose ranks skipped the broadcast fails in ncclCommInitRank,
 * where NCCL would hang); SUM over fp32, fp16 and bf16, and MAX over fp32 only; both buffers
 * inside one device allocation each (emu_device_span).
 *
 * Numerics: ncclAllReduce copies the device buffer to the host, reduces with MPI_Allreduce
 * and copies the result back: fp32 with MPI_SUM or MPI_MAX; fp16 and bf16 with a user-defined MPI_Op
 * over gpu_comm_sum16 (the CPU ranks' op: two 16-bit values added in fp32, the sum rounded
 * to the 16-bit type, nearest even), as each hop of NCCL's ring does. With two ranks that is
 * one addition per element, the same on every rank.
 *
 * Without MPI (a build without it, or a process not under mpirun) a communicator of one
 * rank works: its all-reduce is a copy.
 *
 * Threads: a communicator serves one thread at a time; work runs when it is enqueued (the
 * emulator's streams are always idle).
 */
#include "config.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <vector>

#include "gpu/comm.h"
#include "nccl.h"
#include "tests/cudaemu/emu.h"

#ifdef HAVE_MPI
#define OMPI_SKIP_MPICXX 1 /* the C API only: MPI's C++ bindings do not build with -Wextra */
#include <mpi.h>
#endif

struct ncclComm {
    int nranks, rank;
#ifdef HAVE_MPI
    MPI_Comm mpi;
    MPI_Datatype t16;
    MPI_Op op_f16, op_bf16;
#endif
};

extern "C" ncclResult_t ncclGetVersion(int *version)
{
    *version = 22800; /* the toolkit's NCCL 2.28 */
    return ncclSuccess;
}

extern "C" const char *ncclGetErrorString(ncclResult_t r)
{
    static const char *const s[] = {
        "no error", "unhandled cuda error", "unhandled system error", "internal error",
        "invalid argument", "invalid usage", "remote process exited or there was a network error",
        "NCCL operation in progress",
    };
    return r >= ncclSuccess && r < ncclNumResults ? s[r] : "unknown result code";
}

extern "C" ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    memset(id, 0, sizeof(*id));
    snprintf(id->internal, sizeof(id->internal), "cudaemu %ld %ld.%09ld", (long)getpid(),
             (long)t.tv_sec, t.tv_nsec);
    return ncclSuccess;
}

#ifdef HAVE_MPI
static uint64_t fnv1a(const void *p, size_t n)
{
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static void op_f16(void *in, void *inout, int *len, MPI_Datatype *)
{
    gpu_comm_sum16((const uint16_t *)in, (uint16_t *)inout, *len, GPU_FP16);
}

static void op_bf16(void *in, void *inout, int *len, MPI_Datatype *)
{
    gpu_comm_sum16((const uint16_t *)in, (uint16_t *)inout, *len, GPU_BF16);
}

/* Join MPI_COMM_WORLD as (nranks, rank) with id; ncclInvalidUsage when MPI disagrees. */
static ncclResult_t join(ncclComm *c, const ncclUniqueId *id)
{
    int init = 0, size = 0, rank = 0;
    MPI_Initialized(&init);
    if (!init) {
        emu_report("ncclCommInitRank: %d ranks but MPI is not initialised (mpirun)", c->nranks);
        return ncclInvalidUsage;
    }
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (size != c->nranks || rank != c->rank) {
        emu_report("ncclCommInitRank: rank %d of %d, but MPI says rank %d of %d", c->rank,
                   c->nranks, rank, size);
        return ncclInvalidUsage;
    }
    MPI_Comm_dup(MPI_COMM_WORLD, &c->mpi);
    unsigned long long h = fnv1a(id, sizeof(*id)), lo = 0, hi = 0;
    MPI_Allreduce(&h, &lo, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, c->mpi);
    MPI_Allreduce(&h, &hi, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, c->mpi);
    if (lo != hi) {
        emu_report("ncclCommInitRank: the ranks hold different unique ids (rank 0's was not "
                   "broadcast)");
        MPI_Comm_free(&c->mpi);
        return ncclInvalidUsage;
    }
    MPI_Type_contiguous(2, MPI_BYTE, &c->t16);
    MPI_Type_commit(&c->t16);
    MPI_Op_create(op_f16, 1, &c->op_f16);
    MPI_Op_create(op_bf16, 1, &c->op_bf16);
    return ncclSuccess;
}

static void leave_mpi(ncclComm *c)
{
    MPI_Op_free(&c->op_f16);
    MPI_Op_free(&c->op_bf16);
    MPI_Type_free(&c->t16);
    MPI_Comm_free(&c->mpi);
}

static ncclResult_t reduce(ncclComm *c, void *buf, size_t count, ncclDataType_t dt,
                           ncclRedOp_t op)
{
    if (count > (size_t)INT32_MAX) {
        emu_report("ncclAllReduce: %zu elements are more than the stand-in reduces at once",
                   count);
        return ncclInvalidArgument;
    }
    int rc = dt == ncclFloat32
                 ? MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT,
                                 op == ncclMax ? MPI_MAX : MPI_SUM, c->mpi)
                 : MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, c->t16,
                                 dt == ncclFloat16 ? c->op_f16 : c->op_bf16, c->mpi);
    return rc == MPI_SUCCESS ? ncclSuccess : ncclRemoteError;
}
#else
static ncclResult_t join(ncclComm *c, const ncclUniqueId *id)
{
    (void)id;
    emu_report("ncclCommInitRank: %d ranks in a build without MPI", c->nranks);
    return ncclInvalidUsage;
}

static void leave_mpi(ncclComm *c)
{
    (void)c;
}

static ncclResult_t reduce(ncclComm *c, void *buf, size_t count, ncclDataType_t dt,
                           ncclRedOp_t op)
{
    (void)c, (void)buf, (void)count, (void)dt, (void)op;
    return ncclInvalidUsage;
}
#endif

extern "C" ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    if (comm == NULL || nranks < 1 || rank < 0 || rank >= nranks)
        return ncclInvalidArgument;
    ncclComm *c = (ncclComm *)calloc(1, sizeof(*c));
    if (c == NULL)
        return ncclSystemError;
    c->nranks = nranks;
    c->rank = rank;
    ncclResult_t r = nranks > 1 ? join(c, &id) : ncclSuccess;
    if (r != ncclSuccess) {
        free(c);
        return r;
    }
    *comm = c;
    return ncclSuccess;
}

extern "C" ncclResult_t ncclCommDestroy(ncclComm_t c)
{
    if (c == NULL)
        return ncclInvalidArgument;
    if (c->nranks > 1)
        leave_mpi(c);
    free(c);
    return ncclSuccess;
}

extern "C" ncclResult_t ncclCommAbort(ncclComm_t c)
{
    return ncclCommDestroy(c);
}

extern "C" ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *e)
{
    if (c == NULL || e == NULL)
        return ncclInvalidArgument;
    *e = ncclSuccess;
    return ncclSuccess;
}

extern "C" ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count,
                                      ncclDataType_t dt, ncclRedOp_t op, ncclComm_t c,
                                      cudaStream_t stream)
{
    (void)stream;
    if (c == NULL || (op != ncclSum && !(op == ncclMax && dt == ncclFloat32)) ||
        (dt != ncclFloat32 && dt != ncclFloat16 && dt != ncclBfloat16)) {
        emu_report("ncclAllReduce: the stand-in sums fp32, fp16 or bf16 and takes the MAX of "
                   "fp32 (op %d, type %d)",
                   (int)op, (int)dt);
        return ncclInvalidArgument;
    }
    size_t bytes = count * (dt == ncclFloat32 ? 4 : 2);
    if (count == 0)
        return ncclSuccess;
    if (emu_device_span(send, bytes) != 0 || emu_device_span(recv, bytes) != 0) {
        emu_report("ncclAllReduce: a buffer of %zu bytes is not inside one device allocation",
                   bytes);
        return ncclInvalidArgument;
    }
    std::vector<unsigned char> host(bytes);
    emu_device_begin();
    memcpy(host.data(), send, bytes);
    emu_device_end();
    ncclResult_t r = c->nranks > 1 ? reduce(c, host.data(), count, dt, op) : ncclSuccess;
    if (r != ncclSuccess)
        return r;
    emu_device_begin();
    memcpy(recv, host.data(), bytes);
    emu_device_end();
    return ncclSuccess;
}

extern "C" void *emu_nccl_sym(const char *name)
{
#define EMU_SYM(fn)                  \
    if (strcmp(name, #fn) == 0)      \
        return (void *)fn;
    EMU_SYM(ncclGetVersion)
    EMU_SYM(ncclGetUniqueId)
    EMU_SYM(ncclCommInitRank)
    EMU_SYM(ncclCommDestroy)
    EMU_SYM(ncclCommAbort)
    EMU_SYM(ncclAllReduce)
    EMU_SYM(ncclGetErrorString)
    EMU_SYM(ncclCommGetAsyncError)
#undef EMU_SYM
    return NULL;
}
