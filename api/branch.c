/*
 * branch.c - branches: a new job that starts from one of a job's checkpoints with a changed
 * spec, its lineage on record (docs/api.md, "Branches"). api_branch_create does it for
 * POST /v1/jobs/{id}/branch (api_h_job_branch, here) and for the daemon's on_numerics
 * policy.
 *
 * The body is {"from_step": S, "patch": {...}, "reason": "..."}, or {"remedy": E} to take
 * the remedy of recommendation event E as it stands: its patch, its sentence as the reason,
 * and from the newest checkpoint before the step where the problem showed (a remedy with a
 * rewind: the newest at least that many steps before it, else the oldest before it), or
 * from the start when none precedes it (from_step may still name another). A branch's own
 * start counts as one of its checkpoints (the file is the ancestor's it began with, and
 * what it reset is reset again). The patch is a JSON merge patch
 * (RFC 7386: members replace, objects merge, null removes) over the parent's stored spec; the
 * result is checked like a submitted spec, and its errors name the field under "patch.". What a
 * checkpoint cannot carry is refused with 422 naming the field: another model (the checkpoint's
 * tensors are the parent's), another world size, fewer skipped batches (data.skip_batches)
 * than the checkpoint has skipped, or steps that end at or before S. A patch of
 * precision.dtype that leaves precision.loss_scale alone takes the new dtype's
 * loss-scaling defaults (the stored spec has the old one's written out). The branch's
 * record (jobs.branch) is {"parent", "step", "reason", "patch", "lineage", "resets",
 * "remedy"}: lineage its ancestors' ids, the root first and the parent last; resets what
 * starts anew instead of carrying over from the checkpoint ("loss_scale" when the scaler's
 * settings or the dtype changed: the parent's scale means nothing then); remedy the
 * recommendation event taken, or null.
 *
 * Threads: any (an HTTP thread, the scheduler's); the store and the queue are thread-safe.
 */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api/api_int.h"

#define BRANCH_REASON_MAX 200

/* Fill e and return status. */
__attribute__((format(printf, 4, 5))) static int refuse(api_error *e, int status, const char *field,
                                                        const char *fmt, ...)
{
    va_list ap;
    snprintf(e->code, sizeof(e->code), "%s",
             status == 422   ? API_E_INVALID_BRANCH
             : status == 404 ? "not_found"
                             : "unavailable");
    snprintf(e->field, sizeof(e->field), "%s", field ? field : "");
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    return status;
}

/* A store error as the status and e. */
static int store_refusal(api_error *e, int rc, const char *what, int64_t id)
{
    if (rc == STORE_ENOTFOUND)
        return refuse(e, 404, NULL, "no %s %lld", what, (long long)id);
    return refuse(e, 503, NULL, "the run history could not be read or written: %s",
                  store_strerror(rc));
}

/* Apply RFC 7386's merge patch p to the object t in place. */
static void merge_patch(json_t *t, json_t *p)
{
    const char *k;
    json_t *v;
    json_object_foreach(p, k, v)
    {
        json_t *cur = json_object_get(t, k);
        if (json_is_null(v))
            json_object_del(t, k);
        else if (json_is_object(v) && json_is_object(cur))
            merge_patch(cur, v);
        else if (json_is_object(v)) {
            json_t *fresh = json_object();
            merge_patch(fresh, v); /* a patch's nulls remove nothing from nothing */
            json_object_set_new(t, k, fresh);
        } else
            json_object_set(t, k, v);
    }
}

/* A patch of precision.dtype without precision.loss_scale: the new dtype's scaler
 * defaults, not the old one's that the stored spec spells out. */
static void dtype_defaults(json_t *merged, json_t *patch)
{
    json_t *pp = json_object_get(patch, "precision");
    if (json_object_get(pp, "dtype") && !json_object_get(pp, "loss_scale"))
        json_object_del(json_object_get(merged, "precision"), "loss_scale");
}

/* Whether checkpoint step a is a better start than b (-1: none yet) for a problem at sign,
 * rewind steps back: the newest at or before sign - rewind, else the oldest before sign. */
static bool better_start(int64_t a, int64_t b, int64_t sign, int64_t rewind)
{
    if (a >= sign)
        return false;
    if (b < 0)
        return true;
    bool a_back = a <= sign - rewind, b_back = b <= sign - rewind;
    if (a_back != b_back)
        return a_back;
    return a_back ? a > b : a < b;
}

/* See api.h. */
int64_t api_branch_step(const char *branch)
{
    json_t *r = branch ? json_loads(branch, 0, NULL) : NULL;
    int64_t step = json_integer_value(json_object_get(r, "step"));
    json_decref(r);
    return step;
}

/* See api.h. */
int api_branch_checkpoint(store *st, int64_t job, int64_t step, char *path, size_t len)
{
    path[0] = '\0';
    for (int depth = 0; job > 0 && depth <= API_BRANCH_MAX_DEPTH; depth++) {
        store_checkpoint *cks = NULL;
        store_job j;
        int n = 0, rc = store_checkpoint_list(st, job, &cks, &n);
        for (int i = 0; rc == 0 && i < n && !path[0]; i++)
            if (cks[i].step == step)
                snprintf(path, len, "%s", cks[i].path);
        free(cks);
        if (rc || path[0])
            return rc;
        if ((rc = store_job_get(st, job, &j)) != 0)
            return rc;
        /* not its own checkpoint: its start, when it began there, is an ancestor's file */
        job = api_branch_step(j.branch) == step ? j.parent_id : 0;
        store_job_clear(&j);
    }
    return STORE_ENOTFOUND;
}

/* The step of the parent's checkpoint at *step (0: the one before the problem, see
 * better_start; a branch's own start counts as one) and its file in path; else a 422 naming
 * the field the request gave it by. With no state before the problem but the
 * initialisation, *step 0 and path "": the branch starts from the beginning. */
static int find_checkpoint(store *st, const store_job *pj, int64_t *step, const api_branch_req *b,
                           const char *field, char *path, size_t len, api_error *e)
{
    store_checkpoint *cks = NULL;
    char have[400] = "";
    size_t used = 0;
    int n = 0, rc = store_checkpoint_list(st, pj->id, &cks, &n);
    int64_t begun = api_branch_step(pj->branch), k = -1;
    if (rc)
        return store_refusal(e, rc, "job", pj->id);
    for (int i = -1; i < n; i++) { /* -1: the state the branch began with */
        int64_t at = i < 0 ? begun : cks[i].step;
        if (at <= 0 || (i >= 0 && at == begun))
            continue;
        if (*step > 0 ? at == *step : better_start(at, k, b->sign_step, b->rewind))
            k = at;
        if (used < sizeof(have))
            used += (size_t)snprintf(have + used, sizeof(have) - used, "%s%lld%s", used ? ", " : "",
                                     (long long)at, i < 0 ? " (its start)" : "");
    }
    free(cks);
    if (k < 0 && *step > 0)
        return refuse(e, 422, field, "%s: job %lld has no checkpoint at step %lld (it has %s)",
                      field, (long long)pj->id, (long long)*step, used ? have : "none");
    if (k < 0) { /* no state before the problem but the initialisation: from the start */
        *step = 0;
        path[0] = '\0';
        return 0;
    }
    *step = k;
    rc = api_branch_checkpoint(st, pj->id, k, path, len);
    if (rc == STORE_ENOTFOUND)
        return refuse(e, 422, field, "%s: the state job %lld began with at step %lld is gone",
                      field, (long long)pj->id, (long long)k);
    if (rc)
        return store_refusal(e, rc, "job", pj->id);
    if (access(path, R_OK) != 0)
        return refuse(e, 422, field,
                      "%s: the file of job %lld's checkpoint at step %lld is gone (%s)", field,
                      (long long)pj->id, (long long)*step, path);
    return 0;
}

/* What a checkpoint cannot carry: a 422 naming the patched field. */
static int carries(json_t *parent, json_t *branch, int64_t from, api_error *e)
{
    json_t *pd = json_object_get(parent, "distributed"),
           *bd = json_object_get(branch, "distributed");
    json_int_t pw = json_integer_value(json_object_get(pd, "world_size"));
    json_int_t bw = json_integer_value(json_object_get(bd, "world_size"));
    json_int_t steps = json_integer_value(json_object_get(branch, "steps"));
    json_int_t pskip =
        json_integer_value(json_object_get(json_object_get(parent, "data"), "skip_batches"));
    json_int_t bskip =
        json_integer_value(json_object_get(json_object_get(branch, "data"), "skip_batches"));
    if (!json_equal(json_object_get(parent, "model"), json_object_get(branch, "model")))
        return refuse(e, 422, "patch.model",
                      "patch.model: a branch keeps its parent's model (the checkpoint holds "
                      "the parent's tensors); submit a new job for another model");
    if ((pw ? pw : 1) != (bw ? bw : 1))
        return refuse(e, 422, "patch.distributed.world_size",
                      "patch.distributed.world_size: a branch keeps its parent's world size "
                      "(%lld): the checkpoint's data order is split across that many ranks",
                      (long long)(pw ? pw : 1));
    if (from > 0 && bskip < pskip)
        return refuse(e, 422, "patch.data.skip_batches",
                      "patch.data.skip_batches: the parent's checkpoint has skipped %lld "
                      "batches already; a branch from it skips as many or more",
                      (long long)pskip);
    if (steps <= from)
        return refuse(e, 422, "patch.steps",
                      "patch.steps: the branch would end at step %lld, not after the step it "
                      "starts from (%lld)",
                      (long long)steps, (long long)from);
    return 0;
}

/* What starts anew in the branch (its effective spec eff) rather than carrying over from
 * the parent's checkpoint (pspec: the parent's spec): a JSON array. From the state the
 * parent began with (from: its branch step), also what the parent reset itself. */
static json_t *resets(const store_job *parent, int64_t from, json_t *pspec, const char *eff)
{
    json_t *e = json_loads(eff, 0, NULL), *out = json_array();
    json_t *r = from > 0 && from == api_branch_step(parent->branch)
                    ? json_loads(parent->branch, 0, NULL)
                    : NULL;
    json_t *pp = json_object_get(pspec, "precision"), *bp = json_object_get(e, "precision");
    if (!json_equal(json_object_get(pp, "loss_scale"), json_object_get(bp, "loss_scale")) ||
        !json_equal(json_object_get(pp, "dtype"), json_object_get(bp, "dtype")) ||
        json_array_size(json_object_get(r, "resets")) > 0) /* "loss_scale", the only one */
        json_array_append_new(out, json_string("loss_scale"));
    json_decref(r);
    json_decref(e);
    return out;
}

/* The branch's record (see the top of the file); NULL when out of memory. */
static char *branch_record(const store_job *parent, const api_branch_req *b, int64_t from,
                           json_t *reset)
{
    json_t *pb = parent->branch ? json_loads(parent->branch, 0, NULL) : NULL;
    json_t *lineage = json_array(), *rec;
    json_t *up = json_object_get(pb, "lineage");
    char *text;
    for (size_t i = 0; i < json_array_size(up); i++)
        json_array_append(lineage, json_array_get(up, i));
    json_array_append_new(lineage, json_integer(parent->id));
    json_decref(pb);
    rec = json_pack("{s:I, s:I, s:s, s:O, s:o, s:o, s:o}", "parent", (json_int_t)parent->id, "step",
                    (json_int_t)from, "reason", b->reason ? b->reason : "by hand", "patch",
                    b->patch, "lineage", lineage, "resets", reset, "remedy",
                    b->remedy ? json_integer(b->remedy) : json_null());
    text = rec ? json_dumps(rec, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(rec);
    return text;
}

/* The merged spec checked as a submitted one: 0 with *cfg and the effective spec in *eff,
 * else a 422 naming the field under "patch." (the machine's and the data's own codes
 * kept). */
static int check_spec(const api_spec_opts *o, const api_jobs *jobs, json_t *merged,
                      gpu_job_config *cfg, char **eff, api_error *e)
{
    char *text = json_dumps(merged, JSON_COMPACT);
    api_error pe;
    int status = 0;
    memset(&pe, 0, sizeof(pe));
    if (!text)
        return refuse(e, 503, NULL, "out of memory");
    if (api_spec_parse(text, strlen(text), o, cfg, &pe) == 0 &&
        api_job_can_run(jobs, cfg, merged, &pe)) {
        if (!(*eff = api_spec_effective(cfg)))
            status = refuse(e, 503, NULL, "out of memory");
    } else {
        bool spec = !pe.code[0] || strcmp(pe.code, "invalid_spec") == 0;
        status = refuse(e, 422, NULL, "patch: %s", pe.message);
        snprintf(e->code, sizeof(e->code), "%s", spec ? API_E_INVALID_BRANCH : pe.code);
        snprintf(e->field, sizeof(e->field), "patch%s%.*s", pe.field[0] ? "." : "",
                 (int)sizeof(e->field) - 7, pe.field);
    }
    free(text);
    return status;
}

/* The reason and the patch in words, for the two jobs' events. */
static void describe(const api_branch_req *b, char *out, size_t len)
{
    char *p = json_dumps(b->patch, JSON_COMPACT | JSON_SORT_KEYS);
    snprintf(out, len, "%s; patch %.300s%s", b->reason ? b->reason : "by hand", p ? p : "?",
             p && strlen(p) > 300 ? "..." : "");
    free(p);
}

/* See api.h. */
int api_branch_create(store *st, const api_spec_opts *o, const api_jobs *jobs, int64_t parent,
                      const api_branch_req *b, int64_t *id, api_error *e)
{
    gpu_job_config cfg;
    store_job pj;
    char ckpt[600], what[600], *eff = NULL, *rec = NULL;
    json_t *pspec = NULL, *merged = NULL;
    int64_t from = b->from_step;
    const char *field = b->from_step > 0 || !b->remedy ? "from_step" : "remedy";
    int status, rc = store_job_get(st, parent, &pj);

    memset(e, 0, sizeof(*e));
    if (rc)
        return store_refusal(e, rc, "job", parent);
    pspec = json_loads(pj.spec ? pj.spec : "", 0, NULL);
    json_t *pb = pj.branch ? json_loads(pj.branch, 0, NULL) : NULL;
    size_t depth = json_array_size(json_object_get(pb, "lineage"));
    json_decref(pb);
    if (!jobs || !jobs->branch)
        status = refuse(e, 503, NULL, "the scheduler is not running");
    else if (depth + 1 >= API_BRANCH_MAX_DEPTH)
        status = refuse(e, 422, NULL, "job %lld already has %zu ancestors: branch an earlier job",
                        (long long)parent, depth);
    else if (!json_is_object(pspec) || !(merged = json_deep_copy(pspec)))
        status = refuse(e, 422, NULL, "job %lld's stored spec cannot be read", (long long)parent);
    else if (!json_is_object(b->patch) || (b->reason && strlen(b->reason) > 1000))
        status = refuse(e, 422, "patch", "patch: a JSON object merged into the job's spec");
    else {
        merge_patch(merged, b->patch);
        dtype_defaults(merged, b->patch);
        status = find_checkpoint(st, &pj, &from, b, field, ckpt, sizeof(ckpt), e);
    }
    if (status == 0)
        status = carries(pspec, merged, from, e);
    if (status == 0)
        status = check_spec(o, jobs, merged, &cfg, &eff, e);
    if (status == 0 && !(rec = branch_record(&pj, b, from, resets(&pj, from, pspec, eff))))
        status = refuse(e, 503, NULL, "out of memory");
    if (status == 0) {
        describe(b, what, sizeof(what));
        rc = jobs->branch(jobs->ctx, cfg.name, gpu_job_dtype_name(&cfg), cfg.steps, eff, parent,
                          from, rec, what, id);
        if (rc == STORE_ENOTFOUND) /* the retention dropped it since find_checkpoint looked */
            status = refuse(e, 422, field,
                            "%s: job %lld's checkpoint at step %lld was just dropped by its "
                            "retention",
                            field, (long long)parent, (long long)from);
        else if (rc)
            status = store_refusal(e, rc, "job", parent);
    }
    free(rec);
    free(eff);
    json_decref(merged);
    json_decref(pspec);
    store_job_clear(&pj);
    return status;
}

/* ---- POST /v1/jobs/{id}/branch ------------------------------------------------------------ */

typedef struct {
    api_branch_req req;
    json_t *body, *remedy_data; /* what req borrows from */
    store_event *ev;
} branch_body;

/* The request body into b; false with a 400 in r naming the member at fault. */
static bool parse_body(const api_req *q, api_resp *r, branch_body *b)
{
    const char *k;
    json_t *v, *from, *remedy;
    if (!q->body || q->body_len == 0 || api_json_depth(q->body, q->body_len) > 32 ||
        !(b->body = json_loadb(q->body, q->body_len, JSON_REJECT_DUPLICATES, NULL)) ||
        !json_is_object(b->body)) {
        api_error_resp(r, 400, "invalid_json", NULL,
                       "send a JSON object: {\"from_step\": S, \"patch\": {...}, \"reason\": "
                       "\"...\"} or {\"remedy\": E}");
        return false;
    }
    json_object_foreach(b->body, k, v)
    {
        if (strcmp(k, "from_step") != 0 && strcmp(k, "patch") != 0 && strcmp(k, "reason") != 0 &&
            strcmp(k, "remedy") != 0) {
            api_error_resp(r, 400, "invalid_parameter", k,
                           "%s: not a member of a branch request (from_step, patch or remedy, "
                           "reason)",
                           k);
            return false;
        }
    }
    from = json_object_get(b->body, "from_step");
    remedy = json_object_get(b->body, "remedy");
    v = json_object_get(b->body, "reason");
    b->req.patch = json_object_get(b->body, "patch");
    if (remedy && (!json_is_integer(remedy) || json_integer_value(remedy) < 1 || b->req.patch)) {
        api_error_resp(r, 400, "invalid_parameter", "remedy",
                       "remedy: the id of a recommendation event (an integer >= 1), instead of "
                       "a patch");
        return false;
    }
    if ((from || !remedy) && (!json_is_integer(from) || json_integer_value(from) < 1)) {
        api_error_resp(r, 400, "invalid_parameter", "from_step",
                       "from_step: the step of one of the job's checkpoints (an integer >= 1)");
        return false;
    }
    if (!remedy && !json_is_object(b->req.patch)) {
        api_error_resp(r, 400, "invalid_parameter", "patch",
                       "patch: a JSON object merged into the job's spec ({} to change nothing), "
                       "or remedy: a recommendation's id");
        return false;
    }
    if (v && (!json_is_string(v) || strlen(json_string_value(v)) > BRANCH_REASON_MAX)) {
        api_error_resp(r, 400, "invalid_parameter", "reason",
                       "reason: a string of at most %d bytes", BRANCH_REASON_MAX);
        return false;
    }
    b->req.from_step = from ? json_integer_value(from) : 0;
    b->req.remedy = remedy ? json_integer_value(remedy) : 0;
    b->req.reason = v ? json_string_value(v) : "by hand";
    return true;
}

/* Recommendation event b->req.remedy of job: its patch, its sentence (unless the request
 * gave a reason) and its step, where the problem showed. False with a 422 in r naming
 * "remedy" when there is no such event or it has no remedy. */
static bool take_remedy(api_server *s, api_resp *r, int64_t job, branch_body *b)
{
    int n = 0, rc = store_event_list(s->st, job, b->req.remedy - 1, 1, &b->ev, &n);
    if (rc) {
        api_store_error(r, rc, "events of job", job, false);
        return false;
    }
    if (n == 1 && b->ev->id == b->req.remedy && b->ev->data)
        b->remedy_data = json_loads(b->ev->data, 0, NULL);
    b->req.patch = json_object_get(json_object_get(b->remedy_data, "remedy"), "patch");
    if (n != 1 || b->ev->id != b->req.remedy || strcmp(b->ev->kind, "recommendation") != 0 ||
        !json_is_object(b->req.patch)) {
        api_error_resp(r, 422, API_E_INVALID_BRANCH, "remedy",
                       "remedy: job %lld has no recommendation %lld with a remedy (GET "
                       "/v1/jobs/%lld/events lists them, the remedy in their data)",
                       (long long)job, (long long)b->req.remedy, (long long)job);
        return false;
    }
    if (!json_object_get(b->body, "reason"))
        b->req.reason = b->ev->message;
    b->req.sign_step = b->ev->step;
    b->req.rewind =
        json_integer_value(json_object_get(json_object_get(b->remedy_data, "remedy"), "rewind"));
    return true;
}

void api_h_job_branch(api_req *q, api_resp *r)
{
    api_server *s = q->srv;
    branch_body b;
    store_job j;
    api_error e;
    int64_t id = 0;
    memset(&b, 0, sizeof(b));
    if (!api_load_job(q, r, &j))
        return;
    store_job_clear(&j);
    if (parse_body(q, r, &b) && (!b.req.remedy || take_remedy(s, r, q->route.job, &b))) {
        int status = api_branch_create(s->st, &s->cfg.spec, s->jobs, q->route.job, &b.req, &id, &e);
        if (status != 0) {
            api_error_resp(r, (unsigned)status, e.code, e.field[0] ? e.field : NULL, "%s",
                           e.message);
        } else if ((status = store_job_get(s->st, id, &j)) != 0) {
            api_store_error(r, status, "job", id, false);
        } else {
            r->status = 201;
            r->ctype = NULL;
            snprintf(r->location, sizeof(r->location), "/v1/jobs/%lld", (long long)id);
            api_job_json(&r->body, &j, true, NULL, s->jobs);
            store_job_clear(&j);
        }
    }
    json_decref(b.body);
    json_decref(b.remedy_data);
    store_events_free(b.ev, b.ev ? 1 : 0);
}
