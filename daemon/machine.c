/*
 * machine.c - the machine's cores, memory and GPUs as resources that jobs hold (contract in
 * machine.h; the rules in prose: docs/scheduling.md).
 *
 * Cores are the ones in the daemon's affinity mask at start (a container's or a taskset's
 * share), narrowed by --cpus; GPUs are those NVML reports (gpu/nvml.c: no CUDA context in
 * the daemon), narrowed by --devices. Placement is first fit in id order, so a job's cores
 * are as contiguous as the free ones allow; a shared device goes to the job that has the
 * fewest holders. The head of the queue may reserve what it would take once the running
 * jobs end (daemon_machine_reserve); a later job may then run ahead of it (backfill) only
 * on what that leaves, so it never delays the head's start.
 *
 * Invariants and threads: see machine.h.
 */
#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/machine.h"

#define MAX_HELD 256

typedef struct {
    int64_t job;
    int64_t memory_mb;
    daemon_placement p;
} holding;

struct daemon_machine {
    int ncpus, cpu[MACHINE_MAX_CPUS];
    int64_t cpu_job[MACHINE_MAX_CPUS]; /* 0: free */
    bool cpu_resv[MACHINE_MAX_CPUS];
    uint64_t memory_bytes;
    int ndev;
    gpu_nvml_device dev[MACHINE_MAX_DEVICES];
    int dev_users[MACHINE_MAX_DEVICES];
    bool dev_resv[MACHINE_MAX_DEVICES];
    bool share;
    bool slurm; /* data-parallel jobs whose spec names no launcher go to Slurm */
    char dev_why[256];
    int nheld;
    holding held[MAX_HELD];
    char summary[640];
};

/* ---- lists ("0-3,8") ------------------------------------------------------------------------ */

/* Parse a list of ids below max into in[] (flags); 0 or -1. */
static int parse_list(const char *s, bool *in, int max)
{
    while (*s) {
        char *end;
        long a = strtol(s, &end, 10), b = a;
        if (end == s || a < 0 || a >= max)
            return -1;
        if (*end == '-') {
            const char *t = end + 1;
            b = strtol(t, &end, 10);
            if (end == t || b < a || b >= max)
                return -1;
        }
        for (long i = a; i <= b; i++)
            in[i] = true;
        if (*end != ',' && *end != '\0')
            return -1;
        s = *end == ',' ? end + 1 : end;
    }
    return 0;
}

/* ids[0..n) (ascending) as "0-3,8". */
static void put_list(const int *ids, int n, char *out, size_t len)
{
    size_t k = 0;
    out[0] = '\0';
    for (int i = 0; i < n && k < len; i++) {
        int j = i;
        while (j + 1 < n && ids[j + 1] == ids[j] + 1)
            j++;
        int w = j > i ? snprintf(out + k, len - k, "%s%d-%d", k ? "," : "", ids[i], ids[j])
                      : snprintf(out + k, len - k, "%s%d", k ? "," : "", ids[i]);
        k += w > 0 ? (size_t)w : 0;
        i = j;
    }
}

void daemon_placement_cpus(const daemon_placement *p, char *out, size_t len)
{
    put_list(p->cpus, p->ncpus, out, len);
}

void daemon_placement_devices(const daemon_placement *p, char *out, size_t len)
{
    size_t k = 0;
    out[0] = '\0';
    for (int i = 0; i < p->ndevices && k < len; i++) {
        int w = snprintf(out + k, len - k, "%s%d", i ? "," : "", p->devices[i]);
        k += w > 0 ? (size_t)w : 0;
    }
}

/* ---- the inventory ----------------------------------------------------------------------- */

static int probe_cpus(daemon_machine *m, const char *list, char *err, size_t errlen)
{
    static bool want[MACHINE_MAX_CPUS];
    cpu_set_t set;
    memset(want, 0, sizeof(want));
    if (sched_getaffinity(0, sizeof(set), &set) != 0) {
        snprintf(err, errlen, "cannot read this process's CPU affinity: %s", strerror(errno));
        return -1;
    }
    if (list && *list && parse_list(list, want, MACHINE_MAX_CPUS) != 0) {
        snprintf(err, errlen, "--cpus %s: not a list of CPU ids such as 0-3,8", list);
        return -1;
    }
    for (int i = 0; i < MACHINE_MAX_CPUS && i < CPU_SETSIZE; i++)
        if (CPU_ISSET(i, &set) && (!list || !*list || want[i]))
            m->cpu[m->ncpus++] = i;
    if (m->ncpus == 0) {
        snprintf(err, errlen, "--cpus %s: none of them is in this process's affinity mask",
                 list ? list : "");
        return -1;
    }
    return 0;
}

static int probe_devices(daemon_machine *m, const char *list, char *err, size_t errlen)
{
    bool want[MACHINE_MAX_DEVICES] = {false};
    gpu_nvml_device all[MACHINE_MAX_DEVICES];
    int n = 0;
    if (list && *list && parse_list(list, want, MACHINE_MAX_DEVICES) != 0) {
        snprintf(err, errlen, "--devices %s: not a list of GPU indices such as 0,2", list);
        return -1;
    }
    (void)gpu_nvml_devices(all, MACHINE_MAX_DEVICES, &n, m->dev_why, sizeof(m->dev_why));
    for (int i = 0; i < n; i++)
        if (!list || !*list || want[i])
            m->dev[m->ndev++] = all[i];
    for (int i = 0; list && *list && i < MACHINE_MAX_DEVICES; i++)
        if (want[i] && i >= n) {
            snprintf(err, errlen, "--devices %s: there is no GPU %d (%s)", list, i, m->dev_why);
            return -1;
        }
    return 0;
}

static void make_summary(daemon_machine *m)
{
    char cpus[256];
    size_t k;
    put_list(m->cpu, m->ncpus, cpus, sizeof(cpus));
    k = (size_t)snprintf(m->summary, sizeof(m->summary), "cores %s (%d), memory %.1f GiB, GPUs: ",
                         cpus, m->ncpus, (double)m->memory_bytes / (1024.0 * 1024 * 1024));
    if (m->ndev == 0)
        snprintf(m->summary + k, sizeof(m->summary) - k, "none (%s)", m->dev_why);
    for (int i = 0; i < m->ndev && k < sizeof(m->summary); i++) {
        int w = snprintf(m->summary + k, sizeof(m->summary) - k, "%s%d %s %.1f GiB",
                         i ? ", " : "", m->dev[i].index, m->dev[i].name,
                         (double)m->dev[i].memory_total / (1024.0 * 1024 * 1024));
        k += w > 0 ? (size_t)w : 0;
    }
    if (m->share && k < sizeof(m->summary))
        snprintf(m->summary + k, sizeof(m->summary) - k, " (shared between jobs)");
}

int daemon_machine_new(const char *cpus, const char *devices, bool share, daemon_machine **out,
                       char *err, size_t errlen)
{
    daemon_machine *m = calloc(1, sizeof(*m));
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    m->share = share;
    m->memory_bytes = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    if (probe_cpus(m, cpus, err, errlen) != 0 || probe_devices(m, devices, err, errlen) != 0) {
        free(m);
        return -1;
    }
    make_summary(m);
    *out = m;
    return 0;
}

void daemon_machine_free(daemon_machine *m)
{
    free(m);
}

const char *daemon_machine_summary(const daemon_machine *m)
{
    return m->summary;
}

void daemon_machine_set_slurm(daemon_machine *m, bool slurm)
{
    m->slurm = slurm;
}

int daemon_machine_ncpus(const daemon_machine *m)
{
    return m->ncpus;
}

/* ---- requests and admission -------------------------------------------------------------- */

/* Whether job c trains on GPUs here: device "cuda" or "cuda:N", or "auto" on a machine with
 * GPUs (but a job of several micro-steps, which the CUDA backend does not run). */
static bool wants_cuda(const daemon_machine *m, const gpu_job_config *c)
{
    if (strncmp(c->device, "cuda", 4) == 0)
        return true;
    return strcmp(c->device, "auto") == 0 && m->ndev > 0 && c->grad_accum_steps == 1;
}

void daemon_machine_request(const daemon_machine *m, const gpu_job_config *c, int max_running,
                            daemon_request *r)
{
    int share = m->ncpus / (max_running > 0 ? max_running : 1), per;
    memset(r, 0, sizeof(*r));
    r->device_index = strncmp(c->device, "cuda:", 5) == 0 ? atoi(c->device + 5) : -1;
    r->cuda = wants_cuda(m, c);
    r->memory_mb = c->res.memory_mb;
    gpu_launcher l = c->dist.launcher;
    if (l == GPU_LAUNCH_DEFAULT && m->slurm && c->dist.world_size > 1)
        l = GPU_LAUNCH_SLURM;
    if (c->dist.nhosts > 0 || l == GPU_LAUNCH_SLURM) /* mpirun or Slurm places the ranks */
        return;
    r->ranks = c->dist.world_size;
    /* a CUDA job holds cores only when it says how many: its host work is one thread a rank,
     * and its GPUs are what it waits for */
    per = c->res.cpus > 0 ? c->res.cpus
          : r->cuda       ? 0
          : c->threads > 0 ? c->threads
                           : share / r->ranks;
    r->cpus = r->ranks * (per > 0 || r->cuda ? per : 1);
    if (c->dist.oversubscribe && r->cpus > m->ncpus)
        r->cpus = m->ncpus;
    r->devices = r->ranks * (c->res.devices >= 0 ? c->res.devices : r->cuda ? 1 : 0);
}

static int refuse(api_error *e, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int refuse(api_error *e, const char *field, const char *fmt, ...)
{
    va_list ap;
    snprintf(e->code, sizeof(e->code), "%s", API_E_DOES_NOT_FIT);
    snprintf(e->field, sizeof(e->field), "%s", field);
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    return GPU_EINVAL;
}

/* The field a request for too many cores comes from. */
static const char *cpus_field(const gpu_job_config *c)
{
    return c->dist.world_size > 1 ? "distributed.world_size"
           : c->res.cpus > 0      ? "resources.cpus"
                                  : "threads";
}

int daemon_machine_admit(const daemon_machine *m, const gpu_job_config *c,
                         const daemon_request *r, api_error *e)
{
    if (r->memory_mb > 0 && (uint64_t)r->memory_mb * 1024 * 1024 > m->memory_bytes)
        return refuse(e, "resources.memory_mb", "asks for %lld MiB, and this machine has %llu MiB",
                      (long long)r->memory_mb, (unsigned long long)(m->memory_bytes >> 20));
    if (r->ranks == 0) /* distributed.hosts: the user's to check, on machines ampd cannot see */
        return 0;
    if (r->cuda && m->ndev == 0)
        return refuse(e, "device", "is \"%s\", but ampd sees no GPU on this machine (%s)",
                      c->device, m->dev_why);
    if (r->cuda && r->device_index >= m->ndev)
        return refuse(e, "device", "is \"%s\", but ampd has %d GPU%s on this machine (cuda:0 to "
                      "cuda:%d)", c->device, m->ndev, m->ndev == 1 ? "" : "s", m->ndev - 1);
    if (r->devices > m->ndev)
        return refuse(e, c->dist.world_size > 1 ? "distributed.world_size" : "resources.devices",
                      "the job needs %d GPU%s (%d rank%s), and ampd has %d on this machine%s%s%s",
                      r->devices, r->devices == 1 ? "" : "s", r->ranks, r->ranks == 1 ? "" : "s",
                      m->ndev, m->ndev ? "" : " (", m->ndev ? "" : m->dev_why,
                      m->ndev ? "" : ")");
    if (r->cpus > m->ncpus)
        return refuse(e, cpus_field(c),
                      "the job needs %d cores (%d rank%s x %d), and ampd has %d on this machine "
                      "(distributed.oversubscribe: true runs more ranks than cores)",
                      r->cpus, r->ranks, r->ranks == 1 ? "" : "s", r->cpus / r->ranks, m->ncpus);
    return 0;
}

/* ---- placement ----------------------------------------------------------------------------- */

static holding *find(daemon_machine *m, int64_t job)
{
    for (int i = 0; i < m->nheld; i++)
        if (m->held[i].job == job)
            return &m->held[i];
    return NULL;
}

static int64_t memory_held_mb(const daemon_machine *m)
{
    int64_t sum = 0;
    for (int i = 0; i < m->nheld; i++)
        sum += m->held[i].memory_mb;
    return sum;
}

/* Whether device position i can take one more job (reserved ones aside). */
static bool device_open(const daemon_machine *m, int i)
{
    return !m->dev_resv[i] && (m->dev_users[i] == 0 || m->share);
}

/* The device positions for r into pos[] (fewest holders first when shared); how many. */
static int pick_devices(const daemon_machine *m, const daemon_request *r, int *pos)
{
    int k = 0;
    if (r->device_index >= 0 && r->device_index < m->ndev)
        return device_open(m, r->device_index) ? (pos[0] = r->device_index, 1) : 0;
    for (int users = 0; users <= (m->share ? MAX_HELD : 0) && k < r->devices; users++)
        for (int i = 0; i < m->ndev && k < r->devices; i++)
            if (device_open(m, i) && m->dev_users[i] == users)
                pos[k++] = i;
    return k;
}

/* "jobs 3, 4" holding what the test says is held, in why (appended). */
static void holders(const daemon_machine *m, bool devices, char *why, size_t len)
{
    size_t k = strlen(why);
    int n = 0;
    for (int i = 0; i < m->nheld && k < len; i++) {
        const daemon_placement *p = &m->held[i].p;
        if (devices ? p->ndevices == 0 : p->ncpus == 0)
            continue;
        int w = snprintf(why + k, len - k, "%s%lld", n++ ? ", " : " by job ",
                         (long long)m->held[i].job);
        k += w > 0 ? (size_t)w : 0;
    }
}

static int wait_for(const daemon_machine *m, bool devices, int need, char *why, size_t len)
{
    int busy = 0, total = devices ? m->ndev : m->ncpus;
    for (int i = 0; i < total; i++)
        busy += devices ? m->dev_users[i] > 0 || m->dev_resv[i] : m->cpu_job[i] || m->cpu_resv[i];
    snprintf(why, len, "waiting for %d %s%s (%d of %d held", need, devices ? "GPU" : "core",
             need == 1 ? "" : "s", busy, total);
    holders(m, devices, why, len);
    size_t k = strlen(why);
    snprintf(why + k, len - k, ")");
    return 1;
}

int daemon_machine_place(daemon_machine *m, int64_t job, const daemon_request *r,
                         daemon_placement *p, char *why, size_t whylen)
{
    int pos[MACHINE_MAX_DEVICES], nd;
    memset(p, 0, sizeof(*p));
    for (int i = 0; i < m->ncpus && p->ncpus < r->cpus; i++)
        if (!m->cpu_job[i] && !m->cpu_resv[i])
            p->cpus[p->ncpus++] = i;
    if (p->ncpus < r->cpus)
        return wait_for(m, false, r->cpus, why, whylen);
    if ((nd = pick_devices(m, r, pos)) < r->devices)
        return wait_for(m, true, r->devices, why, whylen);
    if (r->memory_mb > 0 &&
        (uint64_t)(memory_held_mb(m) + r->memory_mb) * 1024 * 1024 > m->memory_bytes) {
        snprintf(why, whylen, "waiting for %lld MiB of memory (%lld MiB held by running jobs)",
                 (long long)r->memory_mb, (long long)memory_held_mb(m));
        return 1;
    }
    if (m->nheld == MAX_HELD) {
        snprintf(why, whylen, "waiting for a running job to end (%d are placed)", MAX_HELD);
        return 1;
    }
    for (int i = 0; i < p->ncpus; i++) {
        m->cpu_job[p->cpus[i]] = job;
        p->cpus[i] = m->cpu[p->cpus[i]];
    }
    for (int i = 0; i < r->devices; i++) {
        m->dev_users[pos[i]]++;
        p->devices[p->ndevices++] = m->dev[pos[i]].index;
    }
    m->held[m->nheld++] = (holding){job, r->memory_mb, *p};
    return 0;
}

void daemon_machine_reserve(daemon_machine *m, const daemon_request *r)
{
    int k = 0;
    for (int pass = 0; pass < 2; pass++) /* the free ones first, then the held ones */
        for (int i = 0; i < m->ncpus && k < r->cpus; i++)
            if (!m->cpu_resv[i] && (pass == 1 || !m->cpu_job[i])) {
                m->cpu_resv[i] = true;
                k++;
            }
    if (r->device_index >= 0 && r->device_index < m->ndev) {
        m->dev_resv[r->device_index] = true;
        return;
    }
    k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < m->ndev && k < r->devices; i++)
            if (!m->dev_resv[i] && (pass == 1 || !m->dev_users[i])) {
                m->dev_resv[i] = true;
                k++;
            }
}

void daemon_machine_unreserve(daemon_machine *m)
{
    memset(m->cpu_resv, 0, sizeof(m->cpu_resv));
    memset(m->dev_resv, 0, sizeof(m->dev_resv));
}

void daemon_machine_release(daemon_machine *m, int64_t job)
{
    holding *h = find(m, job);
    if (!h)
        return;
    for (int i = 0; i < m->ncpus; i++)
        if (m->cpu_job[i] == job)
            m->cpu_job[i] = 0;
    for (int i = 0; i < h->p.ndevices; i++)
        for (int d = 0; d < m->ndev; d++)
            if (m->dev[d].index == h->p.devices[i] && m->dev_users[d] > 0)
                m->dev_users[d]--;
    *h = m->held[--m->nheld];
}

static bool listed(const int64_t *jobs, int n, int64_t job)
{
    for (int i = 0; i < n; i++)
        if (jobs[i] == job)
            return true;
    return false;
}

bool daemon_machine_fits_without(const daemon_machine *m, const daemon_request *r,
                                 const int64_t *jobs, int n)
{
    int users[MACHINE_MAX_DEVICES], cpus = 0, devs = 0, held = m->nheld;
    int64_t mem = memory_held_mb(m);
    memcpy(users, m->dev_users, sizeof(users));
    for (int i = 0; i < m->ncpus; i++)
        cpus += !m->cpu_job[i] || listed(jobs, n, m->cpu_job[i]);
    for (int k = 0; k < m->nheld; k++) {
        const holding *h = &m->held[k];
        if (!listed(jobs, n, h->job))
            continue;
        held--;
        mem -= h->memory_mb;
        for (int i = 0; i < h->p.ndevices; i++)
            for (int d = 0; d < m->ndev; d++)
                users[d] -= m->dev[d].index == h->p.devices[i] && users[d] > 0;
    }
    if (r->device_index >= 0 && r->device_index < m->ndev)
        devs = users[r->device_index] == 0 || m->share ? r->devices : 0;
    else
        for (int d = 0; d < m->ndev; d++)
            devs += users[d] == 0 || m->share;
    return cpus >= r->cpus && devs >= r->devices && held < MAX_HELD &&
           (r->memory_mb <= 0 || (uint64_t)(mem + r->memory_mb) * 1024 * 1024 <= m->memory_bytes);
}

bool daemon_machine_held(const daemon_machine *m, int64_t job, daemon_placement *p)
{
    for (int i = 0; i < m->nheld; i++)
        if (m->held[i].job == job) {
            *p = m->held[i].p;
            return true;
        }
    return false;
}

/* ---- GET /v1/resources -------------------------------------------------------------------- */

static json_t *job_or_null(int64_t job)
{
    return job ? json_integer(job) : json_null();
}

static json_t *cpus_json(const daemon_machine *m)
{
    json_t *a = json_array();
    for (int i = 0; a && i < m->ncpus; i++)
        json_array_append_new(a, json_pack("{s:i, s:o}", "id", m->cpu[i], "job",
                                           job_or_null(m->cpu_job[i])));
    return a;
}

/* The jobs that hold NVML device index d. */
static json_t *device_jobs(const daemon_machine *m, int d)
{
    json_t *a = json_array();
    for (int i = 0; a && i < m->nheld; i++)
        for (int k = 0; k < m->held[i].p.ndevices; k++)
            if (m->held[i].p.devices[k] == d)
                json_array_append_new(a, json_integer(m->held[i].job));
    return a;
}

static json_t *devices_json(const daemon_machine *m)
{
    gpu_nvml_device now[MACHINE_MAX_DEVICES];
    int n = 0;
    json_t *a = json_array();
    (void)gpu_nvml_devices(now, MACHINE_MAX_DEVICES, &n, NULL, 0);
    for (int i = 0; a && i < m->ndev; i++) {
        const gpu_nvml_device *d = &m->dev[i];
        for (int k = 0; k < n; k++) /* memory and health as NVML says now */
            if (now[k].index == d->index)
                d = &now[k];
        json_array_append_new(
            a, json_pack("{s:i, s:s, s:s, s:I, s:I, s:I, s:s, s:o}", "index", d->index, "name",
                         d->name, "uuid", d->uuid, "memory_total", (json_int_t)d->memory_total,
                         "memory_free", (json_int_t)d->memory_free, "memory_used",
                         (json_int_t)d->memory_used, "health", d->health, "jobs",
                         device_jobs(m, d->index)));
    }
    return a;
}

json_t *daemon_machine_json(const daemon_machine *m)
{
    int free_cpus = 0;
    for (int i = 0; i < m->ncpus; i++)
        free_cpus += m->cpu_job[i] == 0;
    return json_pack("{s:i, s:i, s:o, s:I, s:I, s:o, s:s, s:b}", "cpus_total", m->ncpus,
                     "cpus_free", free_cpus, "cpus", cpus_json(m), "memory_bytes",
                     (json_int_t)m->memory_bytes, "memory_held_mb",
                     (json_int_t)memory_held_mb(m), "devices", devices_json(m),
                     "devices_detail", m->dev_why, "share_devices", m->share);
}
