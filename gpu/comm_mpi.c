/*
 * comm_mpi.c - data-parallel communication over Open MPI (the build with MPI; comm_none.c
 * is the build without): joining the ranks, the gradient buckets and their comm hooks
 * (comm.c's header says what each hook computes), the all-reduces run by a communication
 * thread while backward goes on, and the small reductions that keep the ranks in step.
 *
 * Invariants: buckets are started in index order on every rank, whatever order their
 * gradients became ready in, so every rank issues the same collectives in the same order;
 * gpu_comm_finish starts any bucket backward did not report, so the result never depends
 * on the ready calls (only the overlap does). The main thread calls MPI only while the
 * communication thread is idle (every started bucket done), so MPI_THREAD_SERIALIZED is
 * enough.
 *
 * Threads: the trainer's thread and one communication thread per gpu_comm, which issues
 * MPI_Iallreduce for each bucket handed to it, polls them with MPI_Test (sleeping between
 * polls rather than spinning, so that it does not take a core from the ranks' compute) and
 * unpacks finished 16-bit buckets.
 */
#include "config.h"

#ifdef HAVE_MPI

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <mpi.h>

#include "gpu/comm.h"
#include "gpu/gpu_int.h"


typedef struct {
    size_t lo, hi;      /* elements [lo, hi) of the gradient block */
    size_t ready;       /* elements reported this step */
    uint16_t *half;     /* FP16/BF16: the bucket on the wire */
    MPI_Request req;
    bool started, done;
} bucket;

struct gpu_comm {
    int rank, size, local_size;
    double *times; /* every rank's step and busy time (gpu_comm_step_time), 2 a rank */
    MPI_Datatype t16;
    MPI_Op op_f16, op_bf16;
    MPI_Datatype tctl;
    MPI_Op op_ctl;
    /* the plan */
    float *grads;
    gpu_comm_hook hook;
    bucket *b;
    int nb;
    /* this step */
    int next;            /* the next bucket to start */
    bool pre_nonfinite;
    double t_first, t_last;
    int64_t bytes;
    /* the communication thread: buckets [issued, queued) wait for their Iallreduce */
    pthread_t th;
    bool th_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int queued, issued, ndone;
    bool idle; /* the thread waits (it makes no MPI call) */
    bool quit;
    int err;
    char msg[256];
};

/* ---- the 16-bit sums (user-defined MPI_Ops over gpu_comm_sum16) ---------------------------- */

static void op_f16(void *in, void *inout, int *len, MPI_Datatype *dt)
{
    (void)dt;
    gpu_comm_sum16(in, inout, *len, GPU_FP16);
}

static void op_bf16(void *in, void *inout, int *len, MPI_Datatype *dt)
{
    (void)dt;
    gpu_comm_sum16(in, inout, *len, GPU_BF16);
}

/* The step's agreement as 7 doubles: the loss is summed, the rest take the maximum (the
 * scale and tracker travel twice, negated in the second copy, for their minimum). */
enum { CTL_LOSS, CTL_INF, CTL_PRE, CTL_SUMSQ, CTL_SCALE, CTL_NSCALE, CTL_TRACK, CTL_NTRACK, CTL_N };

static void op_ctl(void *in, void *inout, int *len, MPI_Datatype *dt)
{
    const double *a = in;
    double *b = inout;
    (void)dt;
    for (int i = 0; i < *len; i++, a += CTL_N, b += CTL_N) {
        b[CTL_LOSS] += a[CTL_LOSS];
        for (int k = CTL_INF; k < CTL_N; k++)
            b[k] = a[k] > b[k] || isnan(a[k]) ? a[k] : b[k];
    }
}

/* ---- joining -------------------------------------------------------------------------------- */

static int fail(gpu_comm *c, int mpi_rc, const char *what)
{
    char s[MPI_MAX_ERROR_STRING] = "";
    int n = 0;
    MPI_Error_string(mpi_rc, s, &n);
    pthread_mutex_lock(&c->mu);
    if (!c->err) {
        c->err = GPU_ECOMM;
        snprintf(c->msg, sizeof(c->msg), "rank %d: %s: %s", c->rank, what, s);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return GPU_ECOMM;
}

int gpu_comm_init(gpu_comm **out, char *err, size_t errlen)
{
    int provided = 0, rc, local;
    gpu_comm *c;
    *out = NULL;
    rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) {
        snprintf(err, errlen, "MPI_Init_thread failed (code %d)", rc);
        return GPU_ECOMM;
    }
    if (provided < MPI_THREAD_SERIALIZED) {
        snprintf(err, errlen, "this MPI offers thread level %d, below MPI_THREAD_SERIALIZED",
                 provided);
        MPI_Finalize();
        return GPU_ECOMM;
    }
    if (!(c = calloc(1, sizeof(*c)))) {
        MPI_Finalize();
        return GPU_ENOMEM;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &c->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &c->size);
    if (!(c->times = calloc(2 * (size_t)c->size, sizeof(*c->times)))) {
        free(c);
        MPI_Finalize();
        return GPU_ENOMEM;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    gpu_comm_local(&local, &c->local_size);
    MPI_Type_contiguous(2, MPI_BYTE, &c->t16);
    MPI_Type_commit(&c->t16);
    MPI_Type_contiguous(CTL_N, MPI_DOUBLE, &c->tctl);
    MPI_Type_commit(&c->tctl);
    MPI_Op_create(op_f16, 1, &c->op_f16);
    MPI_Op_create(op_bf16, 1, &c->op_bf16);
    MPI_Op_create(op_ctl, 1, &c->op_ctl);
    *out = c;
    return 0;
}

static void stop_thread(gpu_comm *c)
{
    if (!c->th_started)
        return;
    pthread_mutex_lock(&c->mu);
    c->quit = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->th, NULL);
    c->th_started = false;
}

static void free_buckets(gpu_comm *c)
{
    for (int i = 0; c->b && i < c->nb; i++)
        free(c->b[i].half);
    free(c->b);
    c->b = NULL;
    c->nb = 0;
}

static void release(gpu_comm *c, bool finalize)
{
    if (!c)
        return;
    stop_thread(c);
    free_buckets(c);
    free(c->times);
    MPI_Op_free(&c->op_f16);
    MPI_Op_free(&c->op_bf16);
    MPI_Op_free(&c->op_ctl);
    MPI_Type_free(&c->t16);
    MPI_Type_free(&c->tctl);
    if (finalize)
        MPI_Finalize();
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

void gpu_comm_free(gpu_comm *c)
{
    release(c, true);
}

void gpu_comm_abandon(gpu_comm *c)
{
    release(c, false);
}

int gpu_comm_rank(const gpu_comm *c)
{
    return c ? c->rank : 0;
}

int gpu_comm_size(const gpu_comm *c)
{
    return c ? c->size : 1;
}

int gpu_comm_hosts(gpu_comm *c, char *names, size_t each)
{
    char *me = calloc(1, each);
    int rc;
    if (!me)
        return GPU_ENOMEM;
    if (gethostname(me, each - 1) != 0 || !me[0])
        snprintf(me, each, "localhost");
    rc = MPI_Allgather(me, (int)each, MPI_CHAR, names, (int)each, MPI_CHAR, MPI_COMM_WORLD);
    free(me);
    if (rc != MPI_SUCCESS)
        return fail(c, rc, "MPI_Allgather (host names)");
    for (int r = 0; r < c->size; r++)
        names[(size_t)r * each + each - 1] = '\0';
    return 0;
}

int gpu_comm_local_size(const gpu_comm *c)
{
    return c ? c->local_size : 1;
}

const char *gpu_comm_error(const gpu_comm *c)
{
    return c ? c->msg : "";
}

int gpu_comm_any(gpu_comm *c, bool mine, bool *any)
{
    int v = mine, r = 0;
    int rc = MPI_Allreduce(&v, &r, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS)
        return fail(c, rc, "MPI_Allreduce (vote)");
    *any = r != 0;
    return 0;
}

int gpu_comm_max(gpu_comm *c, float *v, int n)
{
    int rc = MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    return rc == MPI_SUCCESS ? 0 : fail(c, rc, "MPI_Allreduce (fp8 amax)");
}

int gpu_comm_bcast(gpu_comm *c, void *buf, size_t bytes)
{
    int rc = MPI_Bcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
    return rc == MPI_SUCCESS ? 0 : fail(c, rc, "MPI_Bcast");
}

/* The 16-bit type of a FP16 or BF16 hook. */
static gpu_dtype hook_dtype(gpu_comm_hook h)
{
    return h == GPU_HOOK_FP16 ? GPU_FP16 : GPU_BF16;
}

/* ---- the communication thread ------------------------------------------------------------- */

static int issue(gpu_comm *c, bucket *k)
{
    int n = (int)(k->hi - k->lo);
    if (c->hook == GPU_HOOK_NONE)
        return MPI_Iallreduce(MPI_IN_PLACE, c->grads + k->lo, n, MPI_FLOAT, MPI_SUM,
                              MPI_COMM_WORLD, &k->req);
    return MPI_Iallreduce(MPI_IN_PLACE, k->half, n, c->t16,
                          c->hook == GPU_HOOK_FP16 ? c->op_f16 : c->op_bf16, MPI_COMM_WORLD,
                          &k->req);
}

/* Poll the buckets in flight once; returns how many finished (unpacked and marked). */
static int poll_once(gpu_comm *c, int from, int to)
{
    int finished = 0;
    for (int i = from; i < to; i++) {
        bucket *k = &c->b[i];
        int flag = 0, rc;
        if (k->done)
            continue;
        if ((rc = MPI_Test(&k->req, &flag, MPI_STATUS_IGNORE)) != MPI_SUCCESS) {
            fail(c, rc, "MPI_Test (gradient bucket)");
            flag = 1;
        }
        if (!flag)
            continue;
        if (c->hook != GPU_HOOK_NONE)
            gpu_cvt_to_f32(c->grads + k->lo, k->half, hook_dtype(c->hook), k->hi - k->lo);
        pthread_mutex_lock(&c->mu);
        k->done = true;
        c->ndone++;
        c->t_last = gpu_now();
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        finished++;
    }
    return finished;
}

static void *comm_main(void *arg)
{
    gpu_comm *c = arg;
    const struct timespec nap = {0, 20000}; /* 20 us between polls */
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->quit && c->issued == c->queued && c->ndone == c->issued) {
            c->idle = true;
            pthread_cond_broadcast(&c->cv);
            pthread_cond_wait(&c->cv, &c->mu);
        }
        c->idle = false;
        if (c->quit)
            break;
        int from = c->issued, to = c->queued;
        pthread_mutex_unlock(&c->mu);
        for (int i = from; i < to; i++) {
            int rc = issue(c, &c->b[i]);
            if (rc != MPI_SUCCESS) {
                fail(c, rc, "MPI_Iallreduce (gradient bucket)");
                c->b[i].req = MPI_REQUEST_NULL;
            }
        }
        if (poll_once(c, 0, to) == 0 && from == to)
            nanosleep(&nap, NULL);
        pthread_mutex_lock(&c->mu);
        c->issued = to;
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- buckets ------------------------------------------------------------------------------- */

int gpu_comm_nbuckets(const gpu_comm *c)
{
    return c->nb;
}

int gpu_comm_plan(gpu_comm *c, float *grads, const size_t *off, const size_t *count, int n,
                  gpu_comm_hook hook, double bucket_mb, char *err, size_t errlen)
{
    size_t lo[n > 0 ? n : 1], hi[n > 0 ? n : 1];
    stop_thread(c);
    free_buckets(c);
    if (!(c->b = calloc((size_t)n, sizeof(*c->b))))
        return GPU_ENOMEM;
    c->grads = grads;
    c->hook = hook;
    c->nb = gpu_comm_buckets(off, count, n, bucket_mb, lo, hi);
    for (int i = 0; i < c->nb; i++)
        c->b[i] = (bucket){.lo = lo[i], .hi = hi[i], .req = MPI_REQUEST_NULL};
    for (int i = 0; hook != GPU_HOOK_NONE && i < c->nb; i++)
        if (!(c->b[i].half = malloc((c->b[i].hi - c->b[i].lo) * sizeof(uint16_t)))) {
            snprintf(err, errlen, "out of memory for the 16-bit gradient buckets");
            return GPU_ENOMEM;
        }
    if (pthread_create(&c->th, NULL, comm_main, c) != 0) {
        snprintf(err, errlen, "cannot start the communication thread");
        return GPU_ENOMEM;
    }
    c->th_started = true;
    return 0;
}

void gpu_comm_begin(gpu_comm *c)
{
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->nb; i++) {
        c->b[i].ready = 0;
        c->b[i].started = c->b[i].done = false;
    }
    c->queued = c->issued = c->ndone = 0;
    pthread_mutex_unlock(&c->mu);
    c->next = 0;
    c->pre_nonfinite = false;
    c->bytes = 0;
    c->t_first = c->t_last = 0.0;
}

/* Whether any of x[0..n) is inf or NaN (an all-ones exponent). */
static bool any_nonfinite(const float *x, size_t n)
{
    uint32_t hit = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof(u));
        hit |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return hit != 0;
}

/* The hook's first half on bucket k (on this thread), then hand it to the thread. */
static void start(gpu_comm *c, bucket *k)
{
    float *g = c->grads + k->lo;
    size_t n = k->hi - k->lo;
    float N = (float)c->size;
    if (any_nonfinite(g, n))
        c->pre_nonfinite = true;
    if (c->hook == GPU_HOOK_NONE) {
        for (size_t i = 0; i < n; i++)
            g[i] /= N;
        c->bytes += (int64_t)(n * sizeof(float));
    } else {
        gpu_dtype dt = hook_dtype(c->hook);
        gpu_round_n(g, g, n, dt);
        for (size_t i = 0; i < n; i++)
            g[i] /= N;
        gpu_cvt_from_f32(k->half, dt, g, n);
        c->bytes += (int64_t)(n * sizeof(uint16_t));
    }
    k->started = true;
    pthread_mutex_lock(&c->mu);
    if (c->queued == 0)
        c->t_first = gpu_now();
    c->queued++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* Start the buckets that are complete, in order. */
static void start_ready(gpu_comm *c)
{
    while (c->next < c->nb && c->b[c->next].ready >= c->b[c->next].hi - c->b[c->next].lo)
        start(c, &c->b[c->next++]);
}

void gpu_comm_ready(gpu_comm *c, size_t off, size_t count)
{
    for (int i = 0; i < c->nb; i++)
        c->b[i].ready += gpu_comm_overlap(c->b[i].lo, c->b[i].hi, off, count);
    start_ready(c);
}

int gpu_comm_finish(gpu_comm *c, gpu_comm_stats *out)
{
    double t0 = gpu_now();
    int rc;
    while (c->next < c->nb)
        start(c, &c->b[c->next++]);
    pthread_mutex_lock(&c->mu);
    /* every bucket done and the thread back to waiting: MPI is ours again */
    while ((c->ndone < c->nb || !c->idle) && !c->err)
        pthread_cond_wait(&c->cv, &c->mu);
    rc = c->err;
    pthread_mutex_unlock(&c->mu);
    out->bytes = c->bytes;
    out->ms = c->nb ? (c->t_last - c->t_first) * 1e3 : 0.0;
    out->exposed_ms = (gpu_now() - t0) * 1e3;
    if (out->exposed_ms > out->ms)
        out->exposed_ms = out->ms;
    out->pre_nonfinite = c->pre_nonfinite;
    return rc;
}

int gpu_comm_control(gpu_comm *c, gpu_comm_ctl *v)
{
    double in[CTL_N], res[CTL_N];
    int rc;
    in[CTL_LOSS] = v->loss;
    in[CTL_INF] = v->found_inf;
    in[CTL_PRE] = v->pre_nonfinite;
    in[CTL_SUMSQ] = v->sumsq;
    in[CTL_SCALE] = v->scale;
    in[CTL_NSCALE] = -(double)v->scale;
    in[CTL_TRACK] = (double)v->tracker;
    in[CTL_NTRACK] = -(double)v->tracker;
    rc = MPI_Allreduce(in, res, 1, c->tctl, c->op_ctl, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS)
        return fail(c, rc, "MPI_Allreduce (step agreement)");
    v->loss = res[CTL_LOSS] / c->size;
    v->found_inf = res[CTL_INF] != 0 || isnan(res[CTL_INF]);
    v->pre_nonfinite = res[CTL_PRE] != 0;
    v->sumsq = res[CTL_SUMSQ];
    v->scalers_equal = res[CTL_SCALE] == -res[CTL_NSCALE] && res[CTL_TRACK] == -res[CTL_NTRACK];
    return 0;
}

int gpu_comm_step_time(gpu_comm *c, double ms, double busy_ms, double *max_ms, int *rank,
                       double *busy_all)
{
    double mine[2] = {ms, busy_ms};
    int rc = MPI_Allgather(mine, 2, MPI_DOUBLE, c->times, 2, MPI_DOUBLE, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS)
        return fail(c, rc, "MPI_Allgather (step times)");
    *rank = 0; /* the first of the slowest, as MAXLOC */
    for (int r = 1; r < c->size; r++)
        if (c->times[2 * r] > c->times[2 * *rank])
            *rank = r;
    *max_ms = c->times[2 * *rank];
    for (int r = 0; busy_all && r < c->size; r++)
        busy_all[r] = c->times[2 * r + 1];
    return 0;
}

#endif /* HAVE_MPI */
