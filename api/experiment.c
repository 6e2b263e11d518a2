/*
 * experiment.c - the experiment endpoints of docs/api.md: create (a base spec run in arms,
 * one job per arm and seed, or existing jobs grouped by id), list, get with the comparison,
 * cancel and delete.
 *
 * The comparison is computed at each GET from what the store holds, so it follows the runs
 * live: per arm the moments over its seeds of every eval, of the final and best eval loss
 * and accuracy, of the median step time, samples/s and peak memory; per arm against the
 * baseline a Welch t-test (stats.c) with a verdict in words, for the eval loss and accuracy
 * at the last eval step every run of the pair has reached, for the step time and for the
 * peak memory; and which runs sit on the unigram plateau of their training data (the
 * "data" event the worker's start line gives).
 *
 * Invariants: a create validates every job spec before it queues any; the group is written
 * after its jobs, in one transaction, and when that fails the jobs it queued are cancelled.
 *
 * Threads: handlers run on their connection's thread and share only the thread-safe store
 * and job queue.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api_int.h"

#define EXP_BODY_DEPTH 40  /* a job spec nests 4 levels, inside arms[i].spec */
#define EXP_MAX_ARMS 8
#define EXP_MAX_SEEDS 32
#define EXP_MAX_JOBS 64
#define EXP_NAME_MAX 64
#define EXP_DEFAULT_REPEATS 3

/* ---- create: the plan ----------------------------------------------------------------- */

typedef struct {
    char name[STORE_ARM_MAX];
    json_t *spec; /* the arm's job spec without name and seed (owned) */
    int nseeds;
    int64_t seeds[EXP_MAX_SEEDS];
} arm_plan;

typedef struct {
    char name[EXP_NAME_MAX + 1];
    char baseline[STORE_ARM_MAX];
    int narms;
    arm_plan arms[EXP_MAX_ARMS];
    int n;                          /* members */
    store_member m[EXP_MAX_JOBS];   /* arm and seed; job_id once queued */
    json_t *specs[EXP_MAX_JOBS];    /* each member's spec (owned); NULL when grouping */
    const char *dtype[EXP_MAX_JOBS]; /* each spec's precision (gpu_job_dtype_name) and steps,
                                      * as its validation read them */
    int64_t steps[EXP_MAX_JOBS];
} plan;

static void plan_free(plan *p)
{
    for (int i = 0; i < p->narms; i++)
        json_decref(p->arms[i].spec);
    for (int i = 0; i < p->n; i++)
        json_decref(p->specs[i]);
}

/* An arm label: 1..31 of [A-Za-z0-9._-]. */
static bool label_ok(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n >= STORE_ARM_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') ||
              (s[i] >= '0' && s[i] <= '9') || s[i] == '.' || s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

/* A list of distinct seeds (1..EXP_MAX_SEEDS integers in [0, 2^53]) into seeds. */
static bool seeds_parse(const json_t *v, int64_t *seeds, int *n, api_resp *r, const char *field)
{
    size_t k = json_array_size(v);
    if (!json_is_array(v) || k < 1 || k > EXP_MAX_SEEDS) {
        api_error_resp(r, 400, "invalid_request", field, "must be a list of 1 to %d seeds",
                       EXP_MAX_SEEDS);
        return false;
    }
    for (size_t i = 0; i < k; i++) {
        const json_t *s = json_array_get(v, i);
        json_int_t x = json_integer_value(s);
        if (!json_is_integer(s) || x < 0 || x > (1LL << 53)) {
            api_error_resp(r, 400, "invalid_request", field,
                           "seed %zu is not an integer in [0, 2^53]", i);
            return false;
        }
        for (size_t j = 0; j < i; j++)
            if (seeds[j] == x) {
                api_error_resp(r, 400, "invalid_request", field, "seed %lld is given twice",
                               (long long)x);
                return false;
            }
        seeds[i] = x;
    }
    *n = (int)k;
    return true;
}

/* The seeds every arm runs: "seeds", or "repeats" from the base spec's seed (default 1). */
static bool default_seeds(const json_t *body, const json_t *base, arm_plan *a, api_resp *r)
{
    const json_t *seeds = json_object_get(body, "seeds"), *rep = json_object_get(body, "repeats");
    json_int_t first = 1, n = EXP_DEFAULT_REPEATS;
    if (seeds && rep) {
        api_error_resp(r, 400, "invalid_request", "repeats", "give seeds or repeats, not both");
        return false;
    }
    if (seeds)
        return seeds_parse(seeds, a->seeds, &a->nseeds, r, "seeds");
    if (rep && (!json_is_integer(rep) || (n = json_integer_value(rep)) < 1 || n > EXP_MAX_SEEDS)) {
        api_error_resp(r, 400, "invalid_request", "repeats", "must be an integer in [1, %d]",
                       EXP_MAX_SEEDS);
        return false;
    }
    if (json_is_integer(json_object_get(base, "seed")))
        first = json_integer_value(json_object_get(base, "seed"));
    if (first < 0 || first > (1LL << 53) - EXP_MAX_SEEDS)
        first = 1; /* the spec's own check names it when the job is validated */
    for (int i = 0; i < n; i++)
        a->seeds[i] = first + i;
    a->nseeds = (int)n;
    return true;
}

/* An arm that is not fp8 drops from the base spec what only fp8 takes (the base may be an
 * fp8 job's): the recipe, and "fp8" as the linear layers' autocast policy ("lowp" there). */
static void drop_fp8(json_t *prec)
{
    json_t *ac = json_object_get(prec, "autocast");
    json_object_del(prec, "fp8");
    for (int i = 0; i < 2; i++) {
        json_t *t = json_object_get(ac, i ? "overrides" : "table");
        const char *lin = json_string_value(json_object_get(t, "linear"));
        if (lin && strcmp(lin, "fp8") == 0)
            json_object_set_new(t, "linear", json_string("lowp"));
    }
}

/* The arm's spec: base with patch merged in, precision.dtype set to dtype (NULL: as it
 * is), and loss scaling left to its default (none) outside fp16 unless the patch sets it:
 * PyTorch's recipe, a GradScaler for fp16 only. */
static json_t *arm_spec(const json_t *base, const json_t *patch, const char *dtype)
{
    json_t *s = json_deep_copy(base), *prec;
    if (!s)
        return NULL;
    if (dtype && strcmp(dtype, "fp8") != 0 && json_is_object(json_object_get(s, "precision")))
        drop_fp8(json_object_get(s, "precision")); /* the base's; a patch's stays and is checked */
    if (patch)
        json_object_update_recursive(s, (json_t *)patch);
    prec = json_object_get(s, "precision");
    if (dtype) {
        if (!json_is_object(prec)) {
            prec = json_object();
            json_object_set_new(s, "precision", prec);
        }
        json_object_set_new(prec, "dtype", json_string(dtype));
    }
    const char *dt = json_string_value(json_object_get(prec, "dtype"));
    const json_t *pp = json_object_get(patch, "precision");
    if (json_is_object(prec) && !(dt && strcmp(dt, "fp16") == 0) &&
        !json_object_get(pp, "loss_scale"))
        json_object_del(prec, "loss_scale");
    return s;
}

/* A precision an arm may name: a dtype, or fp8. */
static bool dtype_ok(const char *dt)
{
    gpu_dtype d;
    return dt && (gpu_dtype_parse(dt, &d) == 0 || strcmp(dt, "fp8") == 0);
}

/* The arms of "precisions" (default fp32, fp16, bf16; fp8 when named), each with the default
 * seeds. */
static bool arms_of_precisions(const json_t *body, const json_t *base, plan *p, api_resp *r)
{
    static const char *const all[] = {"fp32", "fp16", "bf16"};
    const json_t *v = json_object_get(body, "precisions");
    size_t n = v ? json_array_size(v) : 3;
    arm_plan seeds;
    if (v && (!json_is_array(v) || n < 1 || n > 4)) {
        api_error_resp(r, 400, "invalid_request", "precisions",
                       "must be a list of 1 to 4 of fp32, fp16, bf16 and fp8");
        return false;
    }
    if (!default_seeds(body, base, &seeds, r))
        return false;
    for (size_t i = 0; i < n; i++) {
        const char *dt = v ? json_string_value(json_array_get(v, i)) : all[i];
        arm_plan *a = &p->arms[p->narms];
        if (!dtype_ok(dt)) {
            api_error_resp(r, 400, "invalid_request", "precisions",
                           "entry %zu is not one of fp32, fp16, bf16 and fp8", i);
            return false;
        }
        for (int k = 0; k < p->narms; k++)
            if (strcmp(p->arms[k].name, dt) == 0) {
                api_error_resp(r, 400, "invalid_request", "precisions", "%s is given twice", dt);
                return false;
            }
        *a = seeds;
        snprintf(a->name, sizeof(a->name), "%s", dt);
        if (!(a->spec = arm_spec(base, NULL, dt)))
            return false;
        p->narms++;
    }
    return true;
}

/* One entry of "arms": {"name", "dtype"?, "spec"?, "seeds"?}. */
static bool arm_parse(const json_t *o, size_t i, const json_t *body, const json_t *base, plan *p,
                      api_resp *r)
{
    char field[48];
    arm_plan *a = &p->arms[p->narms];
    const char *name = json_string_value(json_object_get(o, "name"));
    const json_t *dt = json_object_get(o, "dtype"), *patch = json_object_get(o, "spec");
    const json_t *seeds = json_object_get(o, "seeds");
    const char *key;
    json_t *val;

    snprintf(field, sizeof(field), "arms[%zu]", i);
    if (!json_is_object(o)) {
        api_error_resp(r, 400, "invalid_request", field, "must be an object");
        return false;
    }
    json_object_foreach((json_t *)o, key, val)
    {
        if (strcmp(key, "name") && strcmp(key, "dtype") && strcmp(key, "spec") && strcmp(key, "seeds")) {
            api_error_resp(r, 400, "invalid_request", field,
                           "unknown field \"%.40s\" (name, dtype, spec, seeds)", key);
            return false;
        }
    }
    if (!label_ok(name)) {
        api_error_resp(r, 400, "invalid_request", field,
                       "name must be 1 to %d of letters, digits, '.', '_' and '-'",
                       STORE_ARM_MAX - 1);
        return false;
    }
    for (int k = 0; k < p->narms; k++)
        if (strcmp(p->arms[k].name, name) == 0) {
            api_error_resp(r, 400, "invalid_request", field, "the arm %s is given twice", name);
            return false;
        }
    if (dt && !dtype_ok(json_string_value(dt))) {
        api_error_resp(r, 400, "invalid_request", field, "dtype must be fp32, fp16, bf16 or fp8");
        return false;
    }
    if (patch && !json_is_object(patch)) {
        api_error_resp(r, 400, "invalid_request", field, "spec must be an object");
        return false;
    }
    snprintf(a->name, sizeof(a->name), "%s", name);
    if (seeds) {
        snprintf(field, sizeof(field), "arms[%zu].seeds", i);
        if (!seeds_parse(seeds, a->seeds, &a->nseeds, r, field))
            return false;
    } else if (!default_seeds(body, base, a, r)) {
        return false;
    }
    if (!(a->spec = arm_spec(base, patch, json_string_value(dt))))
        return false;
    p->narms++;
    return true;
}

/* The members of a plan of arms: seed by seed, arm by arm (so that every arm has runs
 * early), each spec validated with its name and seed. */
static bool members_of_arms(api_req *q, api_resp *r, plan *p)
{
    for (int pos = 0; pos < EXP_MAX_SEEDS; pos++) {
        for (int k = 0; k < p->narms; k++) {
            arm_plan *a = &p->arms[k];
            char jname[128];
            gpu_job_config cfg;
            api_error e;
            if (pos >= a->nseeds)
                continue;
            if (p->n == EXP_MAX_JOBS) {
                api_error_resp(r, 400, "invalid_request", NULL,
                               "an experiment runs at most %d jobs (arms times seeds)",
                               EXP_MAX_JOBS);
                return false;
            }
            json_t *s = json_deep_copy(a->spec);
            snprintf(jname, sizeof(jname), "%s-%s-s%lld", p->name, a->name, (long long)a->seeds[pos]);
            json_object_set_new(s, "name", json_string(jname));
            json_object_set_new(s, "seed", json_integer(a->seeds[pos]));
            p->specs[p->n] = s;
            memset(&e, 0, sizeof(e));
            if (api_spec_from_json(s, &q->srv->cfg.spec, &cfg, &e) != 0) {
                char field[192];
                snprintf(field, sizeof(field), "spec%s%.150s", e.field[0] ? "." : "", e.field);
                api_error_resp(r, 400, e.code[0] ? e.code : "invalid_spec", field,
                               "the %s arm's job: %s", a->name, e.message);
                p->n++;
                return false;
            }
            if ((q->srv->jobs && q->srv->jobs->admit &&
                 q->srv->jobs->admit(q->srv->jobs->ctx, &cfg, &e) != 0) ||
                (pos == 0 && api_spec_check_data(&cfg, s, &e) != 0)) {
                char field[192];
                snprintf(field, sizeof(field), "spec.%.150s", e.field);
                api_error_resp(r, 422, e.code, field, "the %s arm's job: %s", a->name, e.message);
                p->n++;
                return false;
            }
            /* queued as the worker resolves it (api_spec_effective's reason) */
            json_decref(p->specs[p->n]);
            if (!(p->specs[p->n] = api_spec_to_json(&cfg))) {
                api_error_resp(r, 503, "unavailable", NULL, "out of memory");
                return false;
            }
            snprintf(p->m[p->n].arm, STORE_ARM_MAX, "%s", a->name);
            p->m[p->n].seed = a->seeds[pos];
            p->dtype[p->n] = gpu_job_dtype_name(&cfg);
            p->steps[p->n] = cfg.steps;
            p->n++;
        }
    }
    return true;
}

/* "jobs": existing jobs, each an id or {"id", "arm"}; the arm defaults to the job's dtype,
 * the seed is its spec's (default 1). */
static bool members_of_jobs(api_req *q, api_resp *r, const json_t *v, plan *p)
{
    size_t n = json_array_size(v);
    if (!json_is_array(v) || n < 1 || n > EXP_MAX_JOBS) {
        api_error_resp(r, 400, "invalid_request", "jobs", "must be a list of 1 to %d job ids",
                       EXP_MAX_JOBS);
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_array_get(v, i);
        const json_t *idv = json_is_object(e) ? json_object_get(e, "id") : e;
        const char *arm = json_string_value(json_object_get(e, "arm"));
        char field[32];
        store_job j;
        snprintf(field, sizeof(field), "jobs[%zu]", i);
        if (!json_is_integer(idv) || json_integer_value(idv) < 1 ||
            (json_is_object(e) && json_object_get(e, "arm") && !label_ok(arm))) {
            api_error_resp(r, 400, "invalid_request", field,
                           "must be a job id or {\"id\": ID, \"arm\": LABEL} (a label of 1 to %d "
                           "letters, digits, '.', '_' and '-')", STORE_ARM_MAX - 1);
            return false;
        }
        int rc = store_job_get(q->srv->st, json_integer_value(idv), &j);
        if (rc) {
            if (rc == STORE_ENOTFOUND)
                api_error_resp(r, 404, "not_found", field, "no job %lld",
                               (long long)json_integer_value(idv));
            else
                api_store_error(r, rc, "job", json_integer_value(idv), false);
            return false;
        }
        json_t *spec = j.spec ? json_loads(j.spec, 0, NULL) : NULL;
        json_t *seed = json_object_get(spec, "seed");
        p->m[i].job_id = j.id;
        p->m[i].seed = json_is_integer(seed) ? json_integer_value(seed) : 1;
        snprintf(p->m[i].arm, STORE_ARM_MAX, "%s", arm ? arm : j.dtype);
        json_decref(spec);
        store_job_clear(&j);
        for (size_t k = 0; k < i; k++)
            if (p->m[k].job_id == p->m[i].job_id) {
                api_error_resp(r, 400, "invalid_request", field, "job %lld is given twice",
                               (long long)p->m[i].job_id);
                return false;
            }
        p->n++;
    }
    return true;
}

/* The baseline: the one asked for (an arm of the plan), else fp32's arm, else the first. */
static bool baseline_pick(const json_t *body, plan *p, api_resp *r)
{
    const json_t *v = json_object_get(body, "baseline");
    const char *want = v ? json_string_value(v) : "fp32";
    for (int i = 0; i < p->n; i++)
        if (want && strcmp(p->m[i].arm, want) == 0) {
            snprintf(p->baseline, sizeof(p->baseline), "%s", want);
            return true;
        }
    if (v) {
        api_error_resp(r, 400, "invalid_request", "baseline", "must name one of the arms");
        return false;
    }
    snprintf(p->baseline, sizeof(p->baseline), "%s", p->m[0].arm);
    return true;
}

/* The body's top level: name, then either spec (with precisions or arms, seeds or repeats)
 * or jobs, and baseline. */
static bool plan_parse(api_req *q, api_resp *r, json_t *body, plan *p)
{
    static const char *const keys[] = {"name", "spec", "precisions", "arms", "seeds",
                                       "repeats", "baseline", "jobs"};
    const char *key, *name = json_string_value(json_object_get(body, "name"));
    const json_t *spec = json_object_get(body, "spec"), *jobs = json_object_get(body, "jobs");
    json_t *val;

    json_object_foreach(body, key, val)
    {
        bool known = false;
        for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
            known = known || strcmp(key, keys[i]) == 0;
        if (!known) {
            api_error_resp(r, 400, "invalid_request", key, "unknown field \"%.60s\"", key);
            return false;
        }
    }
    if (json_object_get(body, "name") && (!name || !*name || strlen(name) > EXP_NAME_MAX)) {
        api_error_resp(r, 400, "invalid_request", "name", "must be 1 to %d bytes", EXP_NAME_MAX);
        return false;
    }
    snprintf(p->name, sizeof(p->name), "%s", name ? name : "experiment");
    if (!spec == !jobs || (spec && !json_is_object(spec))) {
        api_error_resp(r, 400, "invalid_request", spec ? "spec" : "jobs",
                       "give either spec (a job spec object, run in each arm and seed) or jobs "
                       "(ids of jobs to group)");
        return false;
    }
    if (jobs) {
        for (size_t i = 2; i < 6; i++)
            if (json_object_get(body, keys[i])) {
                api_error_resp(r, 400, "invalid_request", keys[i], "goes with spec, not jobs");
                return false;
            }
        return members_of_jobs(q, r, jobs, p) && baseline_pick(body, p, r);
    }
    if (json_object_get(body, "arms")) {
        const json_t *arms = json_object_get(body, "arms");
        size_t n = json_array_size(arms);
        if (json_object_get(body, "precisions") || !json_is_array(arms) || n < 1 ||
            n > EXP_MAX_ARMS) {
            api_error_resp(r, 400, "invalid_request", "arms",
                           "must be a list of 1 to %d arms (and not given with precisions)",
                           EXP_MAX_ARMS);
            return false;
        }
        for (size_t i = 0; i < n; i++)
            if (!arm_parse(json_array_get(arms, i), i, body, spec, p, r))
                return false;
    } else if (!arms_of_precisions(body, spec, p, r)) {
        return false;
    }
    return members_of_arms(q, r, p) && baseline_pick(body, p, r);
}

/* Queue the plan's jobs (validated by members_of_arms); on failure cancel those already
 * queued. */
static int plan_submit(api_server *s, plan *p)
{
    int rc = 0, i;
    for (i = 0; i < p->n && rc == 0; i++) {
        char *text = json_dumps(p->specs[i], JSON_COMPACT);
        const char *name = json_string_value(json_object_get(p->specs[i], "name"));
        bool existed;
        if (!text) {
            rc = STORE_EIO;
            break;
        }
        rc = s->jobs->submit(s->jobs->ctx, name, p->dtype[i], p->steps[i], text, NULL,
                             &p->m[i].job_id, &existed);
        free(text);
    }
    if (rc)
        for (int k = 0; k < i; k++)
            if (p->m[k].job_id > 0)
                s->jobs->cancel(s->jobs->ctx, p->m[k].job_id);
    return rc;
}

void api_h_experiments_create(api_req *q, api_resp *r)
{
    api_server *s = q->srv;
    json_error_t jerr;
    json_t *body = NULL;
    plan *p = NULL;
    int64_t id = 0;
    int rc;

    if (!q->body || q->body_len == 0 || api_json_depth(q->body, q->body_len) > EXP_BODY_DEPTH) {
        api_error_resp(r, 400, "invalid_json", NULL,
                       "send an experiment: {\"name\", \"spec\", \"precisions\", \"seeds\"} or "
                       "{\"name\", \"jobs\"} (nested at most %d levels)", EXP_BODY_DEPTH);
        return;
    }
    body = json_loadb(q->body, q->body_len, JSON_REJECT_DUPLICATES, &jerr);
    if (!json_is_object(body)) {
        api_error_resp(r, 400, "invalid_json", NULL, "the body is not a JSON object%s%s",
                       body ? "" : ": ", body ? "" : jerr.text);
        goto out;
    }
    if (!(p = calloc(1, sizeof(*p)))) {
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        goto out;
    }
    if (!plan_parse(q, r, body, p))
        goto out;
    if (!s->jobs) {
        api_error_resp(r, 503, "unavailable", NULL, "the scheduler is not running");
        goto out;
    }
    if (p->specs[0] && (rc = plan_submit(s, p)) != 0) {
        api_store_error(r, rc, "job", 0, true);
        goto out;
    }
    api_buf req;
    api_buf_init(&req);
    api_buf_json_compact(&req, q->body, q->body_len);
    rc = store_experiment_create(s->st, p->name, p->baseline, req.data, p->m, p->n, &id);
    api_buf_free(&req);
    if (rc) {
        for (int i = 0; p->specs[0] && i < p->n; i++)
            s->jobs->cancel(s->jobs->ctx, p->m[i].job_id);
        api_store_error(r, rc, "experiment", 0, true);
        goto out;
    }
    q->route.job = id;
    api_h_experiment_get(q, r);
    if (r->status == 200) {
        r->status = 201;
        snprintf(r->location, sizeof(r->location), "/v1/experiments/%lld", (long long)id);
    }
out:
    if (p)
        plan_free(p);
    free(p);
    json_decref(body);
}

/* ---- the comparison ------------------------------------------------------------------- */

typedef struct {
    const store_member *m;
    store_job job;
    store_eval *ev;
    int nev;
    double entropy, top;        /* the training data's unigram level; NaN when unknown */
    double step_ms, sps, peak;  /* from the summary; NaN until the run has one */
} run_info;

typedef struct {
    const char *arm;
    int n;          /* runs */
    int idx[EXP_MAX_JOBS];
} arm_info;

/* A summary's number, store_missing() when it has none. */
static double num_or_missing(const json_t *v)
{
    return json_is_number(v) ? json_number_value(v) : store_missing();
}

/* A value as JSON: null when missing, "NaN" and the infinities as strings. */
static json_t *num_json(double v)
{
    return store_is_missing(v) ? json_null() : api_json_num(v);
}

/* Load what the comparison reads of member m. */
static int run_load(store *st, const store_member *m, run_info *ri)
{
    store_event *ev = NULL;
    int rc;
    memset(ri, 0, sizeof(*ri));
    ri->m = m;
    ri->entropy = ri->top = ri->step_ms = ri->sps = ri->peak = store_missing();
    if ((rc = store_job_get(st, m->job_id, &ri->job)) != 0)
        return rc;
    if ((rc = store_eval_list(st, m->job_id, &ri->ev, &ri->nev)) != 0)
        return rc;
    if (store_event_last(st, m->job_id, "data", &ev) == 0) {
        json_t *d = ev->data ? json_loads(ev->data, 0, NULL) : NULL;
        ri->entropy = num_or_missing(json_object_get(d, "unigram_entropy"));
        ri->top = num_or_missing(json_object_get(d, "unigram_top_freq"));
        json_decref(d);
        store_events_free(ev, 1);
    }
    json_t *sum = ri->job.summary ? json_loads(ri->job.summary, 0, NULL) : NULL;
    ri->step_ms = num_or_missing(json_object_get(sum, "median_step_ms"));
    ri->sps = num_or_missing(json_object_get(sum, "samples_per_s"));
    ri->peak = num_or_missing(json_object_get(json_object_get(sum, "peak_mem"), "total"));
    json_decref(sum);
    return 0;
}

static void run_free(run_info *ri)
{
    store_job_clear(&ri->job);
    free(ri->ev);
}

/* The eval of ri at step (NULL when it has none there). */
static const store_eval *eval_at(const run_info *ri, int64_t step)
{
    for (int i = 0; i < ri->nev; i++)
        if (ri->ev[i].step == step)
            return &ri->ev[i];
    return NULL;
}

static const store_eval *eval_last(const run_info *ri)
{
    return ri->nev ? &ri->ev[ri->nev - 1] : NULL;
}

static bool run_plateau(const run_info *ri, const store_eval *e)
{
    return e && api_on_plateau(e->loss, store_is_missing(e->acc) ? NAN : e->acc, ri->entropy,
                               ri->top);
}

/* {n, mean, sd, min, max}: null where there is no value (sd: fewer than two). */
static json_t *moments_json(const api_moments *m)
{
    double none = store_missing();
    return json_pack("{s:i, s:o, s:o, s:o, s:o}", "n", m->n, "mean",
                     num_json(m->n ? m->mean : none), "sd", num_json(m->n > 1 ? m->sd : none),
                     "min", num_json(m->n ? m->min : none), "max",
                     num_json(m->n ? m->max : none));
}

/* What a metric of a run is, for the moments over an arm (the eval kinds first). */
typedef enum { X_FINAL_LOSS, X_BEST_LOSS, X_FINAL_ACC, X_BEST_ACC, X_STEP_MS, X_SPS, X_PEAK } x_kind;

/* A run's value of k: NaN when it has none. The final and best evals are those of a run
 * that succeeded (a running run's latest eval is no final one; the evals per step compare
 * the runs while they run). */
static double run_value(const run_info *ri, x_kind k)
{
    const store_eval *last = eval_last(ri);
    double best = NAN;
    if (k <= X_BEST_ACC && ri->job.status != STORE_SUCCEEDED)
        return NAN;
    switch (k) {
    case X_FINAL_LOSS:
        return last ? last->loss : NAN;
    case X_FINAL_ACC:
        return last && !store_is_missing(last->acc) ? last->acc : NAN;
    case X_BEST_LOSS:
    case X_BEST_ACC:
        for (int i = 0; i < ri->nev; i++) {
            double v = k == X_BEST_LOSS ? ri->ev[i].loss : ri->ev[i].acc;
            if (isfinite(v) && !(isfinite(best) && (k == X_BEST_LOSS ? v >= best : v <= best)))
                best = v;
        }
        return best;
    case X_STEP_MS:
        return ri->step_ms;
    case X_SPS:
        return ri->sps;
    case X_PEAK:
        return ri->peak;
    }
    return NAN;
}

static void arm_moments(const run_info *runs, const arm_info *a, x_kind k, api_moments *m)
{
    double v[EXP_MAX_JOBS];
    for (int i = 0; i < a->n; i++)
        v[i] = run_value(&runs[a->idx[i]], k);
    api_moments_of(v, a->n, m);
}

/* The moments over a's runs of the eval loss (acc: accuracy) at step, and how many of
 * them sit on the plateau there. */
static void arm_eval_at(const run_info *runs, const arm_info *a, int64_t step, bool acc,
                        api_moments *m, int *plateau)
{
    double v[EXP_MAX_JOBS];
    *plateau = 0;
    for (int i = 0; i < a->n; i++) {
        const run_info *ri = &runs[a->idx[i]];
        const store_eval *e = eval_at(ri, step);
        v[i] = !e ? NAN : acc ? (store_is_missing(e->acc) ? NAN : e->acc) : e->loss;
        *plateau += run_plateau(ri, e);
    }
    api_moments_of(v, a->n, m);
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The eval steps of a's runs, sorted and distinct, into steps (heap); their count. */
static int arm_steps(const run_info *runs, const arm_info *a, int64_t **steps)
{
    int n = 0, cap = 0, k = 0;
    int64_t *v = NULL;
    for (int i = 0; i < a->n; i++)
        cap += runs[a->idx[i]].nev;
    if (cap == 0 || !(v = malloc(sizeof(*v) * (size_t)cap))) {
        *steps = NULL;
        return 0;
    }
    for (int i = 0; i < a->n; i++)
        for (int e = 0; e < runs[a->idx[i]].nev; e++)
            v[n++] = runs[a->idx[i]].ev[e].step;
    qsort(v, (size_t)n, sizeof(*v), cmp_i64);
    for (int i = 0; i < n; i++)
        if (k == 0 || v[i] != v[k - 1])
            v[k++] = v[i];
    *steps = v;
    return k;
}

static json_t *arm_json(const run_info *runs, const arm_info *a)
{
    static const struct {
        const char *name;
        x_kind k;
    } xs[] = {{"final_eval_loss", X_FINAL_LOSS}, {"best_eval_loss", X_BEST_LOSS},
              {"final_eval_acc", X_FINAL_ACC},   {"best_eval_acc", X_BEST_ACC},
              {"median_step_ms", X_STEP_MS},     {"samples_per_s", X_SPS},
              {"peak_mem_bytes", X_PEAK}};
    json_t *o = json_object(), *evals = json_array(), *ids = json_array();
    int64_t *steps;
    int nsteps = arm_steps(runs, a, &steps), finished = 0, plateau = 0;

    for (int i = 0; i < a->n; i++) {
        const run_info *ri = &runs[a->idx[i]];
        json_array_append_new(ids, json_integer(ri->job.id));
        finished += store_status_finished(ri->job.status);
        plateau += run_plateau(ri, eval_last(ri));
    }
    json_object_set_new(o, "arm", json_string(a->arm));
    json_object_set_new(o, "jobs", ids);
    json_object_set_new(o, "finished", json_integer(finished));
    json_object_set_new(o, "on_plateau", json_integer(plateau));
    for (int s = 0; s < nsteps; s++) {
        api_moments lm, am;
        int pl;
        arm_eval_at(runs, a, steps[s], false, &lm, &pl);
        arm_eval_at(runs, a, steps[s], true, &am, &pl);
        json_array_append_new(evals, json_pack("{s:I, s:o, s:o, s:i}", "step", (json_int_t)steps[s],
                                               "eval_loss", moments_json(&lm), "eval_acc",
                                               moments_json(&am), "on_plateau", pl));
    }
    free(steps);
    json_object_set_new(o, "evals", evals);
    for (size_t i = 0; i < sizeof(xs) / sizeof(xs[0]); i++) {
        api_moments m;
        arm_moments(runs, a, xs[i].k, &m);
        json_object_set_new(o, xs[i].name, moments_json(&m));
    }
    return o;
}

/* The last eval step that every run of a and b with an eval has (0: none). */
static int64_t common_step(const run_info *runs, const arm_info *a, const arm_info *b)
{
    const arm_info *arms[2] = {a, b};
    int64_t *steps;
    int n = arm_steps(runs, a, &steps);
    int64_t best = 0;
    for (int s = 0; s < n; s++) {
        bool all = true;
        for (int k = 0; k < 2 && all; k++)
            for (int i = 0; i < arms[k]->n && all; i++) {
                const run_info *ri = &runs[arms[k]->idx[i]];
                all = ri->nev == 0 || eval_at(ri, steps[s]);
            }
        if (all)
            best = steps[s];
    }
    free(steps);
    return best;
}

static const char *verdict_name(api_verdict v)
{
    return v == API_V_WITHIN ? "within" : v == API_V_OUTSIDE ? "outside" : "too_few_seeds";
}

/* The verdict's closing words: "within seed variance (Welch's t, p = 0.41; 3 and 3 seeds)". */
static void verdict_words(char *buf, size_t len, const api_welch_result *w, const api_moments *a,
                          const api_moments *b, const char *spread, const char *units)
{
    if (w->verdict == API_V_FEW_SEEDS)
        snprintf(buf, len,
                 "too few %s to judge (%d and %d; the test needs %d per arm, and 3 or more to "
                 "tell apart a difference of about one %s's spread)",
                 units, a->n, b->n, API_MIN_SEEDS, units[0] == 's' ? "seed" : "run");
    else if (w->se == 0)
        snprintf(buf, len, "%s %s (none: each of the %d and %d %s gives the same value)",
                 w->verdict == API_V_WITHIN ? "within" : "outside", spread, a->n, b->n, units);
    else
        snprintf(buf, len, "%s %s (Welch's t, p = %.2g; %d and %d %s)",
                 w->verdict == API_V_WITHIN ? "within" : "outside", spread, w->p, a->n, b->n,
                 units);
}

static json_t *verdict_json(const char *arm, const char *base, const char *metric, int64_t step,
                            const api_welch_result *w, const api_moments *a,
                            const api_moments *b, const char *text)
{
    json_t *o = json_pack("{s:s, s:s, s:s, s:o, s:o, s:o, s:[i,i], s:s, s:s}", "arm", arm,
                          "baseline", base, "metric", metric, "diff", api_json_num(w->diff),
                          "half_width", api_json_num(w->half), "p", api_json_num(w->p), "n",
                          a->n, b->n, "verdict", verdict_name(w->verdict), "text", text);
    if (step > 0)
        json_object_set_new(o, "step", json_integer(step));
    return o;
}

/* The plateau's words for a pair at step ("" when no run of either sits on it). */
static void plateau_words(char *buf, size_t len, const run_info *runs, const arm_info *a,
                          const arm_info *b, int64_t step)
{
    api_moments m;
    int pa, pb;
    arm_eval_at(runs, a, step, false, &m, &pa);
    int na = m.n;
    arm_eval_at(runs, b, step, false, &m, &pb);
    buf[0] = '\0';
    if (pa || pb)
        snprintf(buf, len,
                 "; at step %lld, %d of %d %s and %d of %d %s runs are still on the unigram "
                 "plateau: runs leave it at seed-dependent steps",
                 (long long)step, pa, na, a->arm, pb, m.n, b->arm);
}

/* The eval loss and accuracy verdicts of a against b at their common step. */
static void eval_verdicts(json_t *out, const run_info *runs, const arm_info *a, const arm_info *b)
{
    int64_t step = common_step(runs, a, b);
    char words[256], pl[256], text[768];
    if (step <= 0)
        return;
    plateau_words(pl, sizeof(pl), runs, a, b, step);
    for (int acc = 0; acc < 2; acc++) {
        api_moments ma, mb;
        api_welch_result w;
        int p;
        arm_eval_at(runs, a, step, acc, &ma, &p);
        arm_eval_at(runs, b, step, acc, &mb, &p);
        if (ma.n == 0 || mb.n == 0)
            continue;
        api_welch(&ma, &mb, &w);
        verdict_words(words, sizeof(words), &w, &ma, &mb, "seed variance", "seeds");
        double k = acc ? 100 : 1;
        const char *unit = acc ? " points of eval accuracy" : " nats of eval loss";
        if (w.verdict == API_V_FEW_SEEDS)
            snprintf(text, sizeof(text), "%s − %s = %+.3g%s at step %lld: %s%s", a->arm, b->arm,
                     k * w.diff, unit, (long long)step, words, pl);
        else
            snprintf(text, sizeof(text), "%s − %s = %+.3g ± %.2g%s at step %lld: %s%s", a->arm,
                     b->arm, k * w.diff, k * w.half, unit, (long long)step, words, pl);
        json_array_append_new(out, verdict_json(a->arm, b->arm, acc ? "eval_acc" : "eval_loss",
                                                step, &w, &ma, &mb, text));
    }
}

/* The step time and peak memory verdicts of a against b (finished runs' summaries). */
static void cost_verdicts(json_t *out, const run_info *runs, const arm_info *a, const arm_info *b)
{
    char words[256], text[768];
    for (int mem = 0; mem < 2; mem++) {
        api_moments ma, mb;
        api_welch_result w;
        arm_moments(runs, a, mem ? X_PEAK : X_STEP_MS, &ma);
        arm_moments(runs, b, mem ? X_PEAK : X_STEP_MS, &mb);
        if (ma.n == 0 || mb.n == 0 || !(mb.mean > 0))
            continue;
        api_welch(&ma, &mb, &w);
        verdict_words(words, sizeof(words), &w, &ma, &mb, "the run-to-run spread", "runs");
        double ratio = ma.mean / mb.mean;
        if (mem)
            snprintf(text, sizeof(text), "%s uses %.2fx %s's peak memory (%.4g MB against %.4g "
                     "MB): %s", a->arm, ratio, b->arm, ma.mean / 1e6, mb.mean / 1e6, words);
        else if (w.verdict == API_V_OUTSIDE)
            snprintf(text, sizeof(text), "%s is %.2fx %s than %s (a step %.4g ± %.2g ms against "
                     "%.4g ± %.2g ms, mean ± sd): %s", a->arm, ratio >= 1 ? ratio : 1 / ratio,
                     ratio >= 1 ? "slower" : "faster", b->arm, ma.mean, ma.sd, mb.mean, mb.sd,
                     words);
        else
            snprintf(text, sizeof(text), "%s's step takes %.2fx %s's (%.4g ms against %.4g ms): "
                     "%s", a->arm, ratio, b->arm, ma.mean, mb.mean, words);
        json_array_append_new(out, verdict_json(a->arm, b->arm,
                                                mem ? "peak_mem_bytes" : "median_step_ms", 0, &w,
                                                &ma, &mb, text));
    }
}

/* The arms of the runs, in the order they first appear. */
static int arms_of(const run_info *runs, int n, arm_info *arms)
{
    int na = 0;
    for (int i = 0; i < n; i++) {
        int k = 0;
        while (k < na && strcmp(arms[k].arm, runs[i].m->arm) != 0)
            k++;
        if (k == na) {
            arms[na].arm = runs[i].m->arm;
            arms[na++].n = 0;
        }
        arms[k].idx[arms[k].n++] = i;
    }
    return na;
}

/* A note per arm with runs on the plateau at their latest eval, and per arm short of the
 * seeds a verdict needs. */
static json_t *notes_json(const run_info *runs, const arm_info *arms, int na)
{
    json_t *notes = json_array();
    char text[512];
    for (int k = 0; k < na; k++) {
        int pl = 0, with = 0;
        const run_info *ex = NULL;
        for (int i = 0; i < arms[k].n; i++) {
            const run_info *ri = &runs[arms[k].idx[i]];
            with += ri->nev > 0;
            if (run_plateau(ri, eval_last(ri))) {
                pl++;
                ex = ri;
            }
        }
        if (pl) {
            snprintf(text, sizeof(text),
                     "%d of %d %s runs are still on the unigram plateau at their latest eval "
                     "(eval loss at least %.0f%% of the training data's unigram entropy, %.3f "
                     "nats; accuracy near the most frequent token's %.1f%%): runs leave it at "
                     "seed-dependent steps",
                     pl, arms[k].n, arms[k].arm, 100 * API_PLATEAU_LOSS_FRAC, ex->entropy,
                     100 * ex->top);
            json_array_append_new(notes, json_string(text));
        }
        if (with < API_MIN_SEEDS) {
            snprintf(text, sizeof(text),
                     "%s has %d run%s with eval results: a verdict needs %d per arm", arms[k].arm,
                     with, with == 1 ? "" : "s", API_MIN_SEEDS);
            json_array_append_new(notes, json_string(text));
        }
    }
    return notes;
}

static json_t *comparison_json(const run_info *runs, int n, const char *baseline)
{
    arm_info *arms = calloc(EXP_MAX_ARMS + EXP_MAX_JOBS, sizeof(*arms));
    json_t *o = json_object(), *ja = json_array(), *verdicts = json_array();
    int na, base = 0;
    if (!arms || !o)
        goto out;
    na = arms_of(runs, n, arms);
    for (int k = 0; k < na; k++) {
        if (strcmp(arms[k].arm, baseline) == 0)
            base = k;
        json_array_append_new(ja, arm_json(runs, &arms[k]));
    }
    for (int k = 0; k < na; k++) {
        if (k == base)
            continue;
        eval_verdicts(verdicts, runs, &arms[k], &arms[base]);
        cost_verdicts(verdicts, runs, &arms[k], &arms[base]);
    }
    json_object_set_new(o, "baseline", json_string(baseline));
    json_object_set_new(o, "method",
                        json_string("Welch's t-test over the runs of each arm (one per seed) "
                                    "against the baseline's, two-sided at 5%; the interval is "
                                    "the difference's 95% confidence interval"));
    json_object_set_new(o, "arms", ja);
    json_object_set_new(o, "verdicts", verdicts);
    json_object_set_new(o, "notes", notes_json(runs, arms, na));
    ja = verdicts = NULL;
    for (int i = 0; i < n; i++)
        if (runs[i].entropy > 0) {
            json_object_set_new(o, "unigram", json_pack("{s:f, s:f}", "entropy", runs[i].entropy,
                                                         "top_freq", runs[i].top));
            break;
        }
out:
    json_decref(ja);
    json_decref(verdicts);
    free(arms);
    return o;
}

/* ---- the experiment object ------------------------------------------------------------- */

static json_t *run_json(const run_info *ri)
{
    const store_eval *last = eval_last(ri);
    json_t *o = json_pack("{s:I, s:s, s:I, s:s, s:s, s:s, s:I, s:I}", "id", (json_int_t)ri->job.id,
                          "arm", ri->m->arm, "seed", (json_int_t)ri->m->seed, "name", ri->job.name,
                          "dtype", ri->job.dtype, "status", store_status_name(ri->job.status),
                          "step", (json_int_t)ri->job.step, "steps", (json_int_t)ri->job.steps);
    json_object_set_new(o, "eval_step", last ? json_integer(last->step) : json_null());
    json_object_set_new(o, "eval_loss", num_json(last ? last->loss : store_missing()));
    json_object_set_new(o, "eval_acc", num_json(last ? last->acc : store_missing()));
    json_object_set_new(o, "on_plateau", json_boolean(run_plateau(ri, last)));
    json_object_set_new(o, "median_step_ms", num_json(ri->step_ms));
    json_object_set_new(o, "peak_mem_bytes", num_json(ri->peak));
    return o;
}

static void put_head(api_buf *b, const store_experiment *e)
{
    api_buf_printf(b, "{\"id\":%lld,\"name\":", (long long)e->id);
    api_buf_json_str(b, e->name);
    api_buf_puts(b, ",\"created_at\":");
    api_buf_json_time(b, e->created_at);
    api_buf_puts(b, ",\"baseline\":");
    api_buf_json_str(b, e->baseline);
}

void api_h_experiment_get(api_req *q, api_resp *r)
{
    store_experiment e;
    run_info *runs = NULL;
    int rc, loaded = 0;

    if (q->route.job < 0) {
        api_error_resp(r, 404, "not_found", NULL, "no experiment %.64s (ids are positive "
                       "integers)", q->path + strlen("/v1/experiments/"));
        return;
    }
    if ((rc = store_experiment_get(q->srv->st, q->route.job, &e)) != 0) {
        api_store_error(r, rc, "experiment", q->route.job, false);
        return;
    }
    if (e.nmembers && !(runs = calloc((size_t)e.nmembers, sizeof(*runs)))) {
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        goto out;
    }
    for (; loaded < e.nmembers; loaded++)
        if ((rc = run_load(q->srv->st, &e.members[loaded], &runs[loaded])) != 0) {
            api_store_error(r, rc, "job", e.members[loaded].job_id, false);
            loaded++;
            goto out;
        }
    json_t *jobs = json_array();
    for (int i = 0; i < e.nmembers; i++)
        json_array_append_new(jobs, run_json(&runs[i]));
    json_t *cmp = comparison_json(runs, e.nmembers, e.baseline);
    char *jt = json_dumps(jobs, JSON_COMPACT), *ct = json_dumps(cmp, JSON_COMPACT);
    json_decref(jobs);
    json_decref(cmp);
    if (!jt || !ct) {
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
    } else {
        r->status = 200;
        put_head(&r->body, &e);
        api_buf_puts(&r->body, ",\"request\":");
        api_buf_puts(&r->body, e.request && e.request[0] == '{' ? e.request : "null");
        api_buf_printf(&r->body, ",\"jobs\":%s,\"comparison\":%s}", jt, ct);
    }
    free(jt);
    free(ct);
out:
    for (int i = 0; i < loaded; i++)
        run_free(&runs[i]);
    free(runs);
    store_experiment_clear(&e);
}

void api_h_experiments_list(api_req *q, api_resp *r)
{
    store_experiment *v = NULL;
    int64_t limit, after;
    int n = 0, rc;

    if (!api_query_int(q, r, "limit", 1, 1000, 50, &limit) ||
        !api_query_int(q, r, "after", 1, INT64_MAX, 0, &after))
        return;
    if ((rc = store_experiment_list(q->srv->st, after, (int)limit, &v, &n)) != 0) {
        api_store_error(r, rc, "experiment", 0, false);
        return;
    }
    r->status = 200;
    api_buf_puts(&r->body, "{\"experiments\":[");
    for (int i = 0; i < n; i++) {
        int counts[STORE_NSTATUS] = {0};
        api_buf_puts(&r->body, i ? "," : "");
        put_head(&r->body, &v[i]);
        api_buf_puts(&r->body, ",\"arms\":[");
        for (int k = 0, shown = 0; k < v[i].nmembers; k++) {
            bool seen = false;
            counts[v[i].members[k].status]++;
            for (int j = 0; j < k && !seen; j++)
                seen = strcmp(v[i].members[j].arm, v[i].members[k].arm) == 0;
            if (seen)
                continue;
            api_buf_puts(&r->body, shown++ ? "," : "");
            api_buf_json_str(&r->body, v[i].members[k].arm);
        }
        api_buf_printf(&r->body, "],\"njobs\":%d,\"status\":{", v[i].nmembers);
        for (int s = 0; s < STORE_NSTATUS; s++)
            api_buf_printf(&r->body, "%s\"%s\":%d", s ? "," : "", store_status_name(s), counts[s]);
        api_buf_puts(&r->body, "}}");
    }
    if (n == (int)limit && n > 0)
        api_buf_printf(&r->body, "],\"next\":%lld}", (long long)v[n - 1].id);
    else
        api_buf_puts(&r->body, "],\"next\":null}");
    store_experiments_free(v, n);
}

/* Cancel the unfinished jobs of e; 0 or the first error other than a job already done. */
static int cancel_all(api_server *s, const store_experiment *e, int *cancelled)
{
    *cancelled = 0;
    for (int i = 0; i < e->nmembers; i++) {
        if (store_status_finished(e->members[i].status))
            continue;
        int rc = s->jobs->cancel(s->jobs->ctx, e->members[i].job_id);
        if (rc == 0)
            (*cancelled)++;
        else if (rc != STORE_ECONFLICT && rc != STORE_ENOTFOUND)
            return rc;
    }
    return 0;
}

/* Delete e's jobs (none may be queued, preempted or running), then the group. keep: the
 * group only. */
static void delete_experiment(api_req *q, api_resp *r, const store_experiment *e, bool keep)
{
    api_server *s = q->srv;
    int rc;
    for (int i = 0; !keep && i < e->nmembers; i++)
        if (store_status_active(e->members[i].status)) {
            api_error_resp(r, 409, "conflict", NULL,
                           "experiment %lld has a %s job (%lld); cancel the experiment first, or "
                           "delete only the group with ?jobs=keep",
                           (long long)e->id, store_status_name(e->members[i].status),
                           (long long)e->members[i].job_id);
            return;
        }
    for (int i = 0; !keep && i < e->nmembers; i++)
        if ((rc = s->jobs->remove(s->jobs->ctx, e->members[i].job_id)) != 0 &&
            rc != STORE_ENOTFOUND) {
            api_store_error(r, rc, "job", e->members[i].job_id, true);
            return;
        }
    if ((rc = store_experiment_delete(s->st, e->id)) != 0 && rc != STORE_ENOTFOUND) {
        api_store_error(r, rc, "experiment", e->id, true);
        return;
    }
    r->status = 204;
}

void api_h_experiment_action(api_req *q, api_resp *r)
{
    store_experiment e;
    const char *jobs = api_query(q, "jobs");
    int rc, cancelled;

    if (q->route.job < 0) {
        api_error_resp(r, 404, "not_found", NULL, "no experiment (ids are positive integers)");
        return;
    }
    if (q->route.id == API_R_EXPERIMENT && jobs && strcmp(jobs, "keep") != 0 &&
        strcmp(jobs, "delete") != 0) {
        api_error_resp(r, 400, "invalid_parameter", "jobs", "must be keep or delete");
        return;
    }
    if ((rc = store_experiment_get(q->srv->st, q->route.job, &e)) != 0) {
        api_store_error(r, rc, "experiment", q->route.job, false);
        return;
    }
    if (!q->srv->jobs) {
        api_error_resp(r, 503, "unavailable", NULL, "the scheduler is not running");
    } else if (q->route.id == API_R_EXPERIMENT) {
        delete_experiment(q, r, &e, jobs && strcmp(jobs, "keep") == 0);
    } else if ((rc = cancel_all(q->srv, &e, &cancelled)) != 0) {
        api_store_error(r, rc, "job", 0, true);
    } else {
        store_experiment_clear(&e);
        api_h_experiment_get(q, r);
        if (r->status == 200)
            r->status = 202;
        return;
    }
    store_experiment_clear(&e);
}

/* ---- a job's plateau (GET /v1/jobs/{id}) ------------------------------------------------- */

void api_put_plateau(api_buf *b, store *st, int64_t job)
{
    store_member m = {.job_id = job};
    run_info ri;
    char text[400];
    if (run_load(st, &m, &ri) != 0 || !(ri.entropy > 0)) {
        api_buf_puts(b, "null");
        run_free(&ri);
        return;
    }
    const store_eval *last = eval_last(&ri);
    bool on = run_plateau(&ri, last);
    text[0] = '\0';
    if (on)
        snprintf(text, sizeof(text),
                 "still on the unigram plateau at step %lld: eval loss %.3f, at least %.0f%% of "
                 "the training data's unigram entropy (%.3f nats), accuracy %.1f%% against the "
                 "most frequent token's %.1f%%; runs leave it at seed-dependent steps",
                 (long long)last->step, last->loss, 100 * API_PLATEAU_LOSS_FRAC, ri.entropy,
                 store_is_missing(last->acc) ? NAN : 100 * last->acc, 100 * ri.top);
    api_buf_puts(b, "{\"unigram_entropy\":");
    api_buf_json_num(b, ri.entropy);
    api_buf_puts(b, ",\"unigram_top_freq\":");
    api_buf_json_num(b, ri.top);
    api_buf_printf(b, ",\"step\":%lld,\"on_plateau\":%s,\"text\":", last ? (long long)last->step : 0LL,
                   on ? "true" : "false");
    api_buf_json_str(b, on ? text : NULL);
    api_buf_putc(b, '}');
    run_free(&ri);
}
