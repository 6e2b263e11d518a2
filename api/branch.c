/*
 * branch.c - POST /v1/jobs/{id}/branch: a new job that starts from one of a job's
 * checkpoints with a changed spec, its lineage on record (docs/api.md, "Branches").
 *
 * The body is {"from_step": S, "patch": {...}, "reason": "..."}, or {"remedy": E} to take
 * the remedy of recommendation event E as it stands: its patch, its sentence as the reason,
 * and from the newest checkpoint before the step where the problem showed (from_step may
 * still name another). The patch is a JSON merge
 * patch (RFC 7386: members replace, objects merge, null removes) over the parent's stored
 * spec; the result is checked like a submitted spec, and its errors name the field under
 * "patch.". What a checkpoint cannot carry is refused with 422 naming the field: another
 * model (the checkpoint's tensors are the parent's), another world size, or steps that
 * end at or before S. A patch of precision.dtype that leaves precision.loss_scale alone
 * takes the new dtype's loss-scaling defaults (the stored spec has the old one's written
 * out). The branch's record (jobs.branch) is {"parent", "step", "reason", "patch",
 * "lineage", "resets"}: lineage its ancestors' ids, the root first and the parent last;
 * resets what starts anew instead of carrying over from the checkpoint ("loss_scale" when
 * the scaler's settings or the dtype changed: the parent's scale means nothing then).
 *
 * Threads: the HTTP thread of the request; the store and the scheduler are thread-safe.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api/api_int.h"

#define BRANCH_REASON_MAX 200
#define LINEAGE_MAX 64 /* ancestors a branch may have */

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

typedef struct {
    int64_t from;       /* 0: the newest checkpoint before the remedy's step */
    json_t *patch;      /* borrowed from body, or the remedy's (owned by remedy_data) */
    const char *reason; /* borrowed likewise */
    int64_t remedy;     /* the recommendation event taken (0: none) */
    json_t *body, *remedy_data;
    store_event *ev;
} branch_req;

/* The request body into b; false with a 400 in r naming the member at fault. */
static bool parse_body(const api_req *q, api_resp *r, branch_req *b)
{
    const char *k;
    json_t *v, *from;
    if (!q->body || q->body_len == 0 || api_json_depth(q->body, q->body_len) > 32 ||
        !(b->body = json_loadb(q->body, q->body_len, JSON_REJECT_DUPLICATES, NULL)) ||
        !json_is_object(b->body)) {
        api_error_resp(r, 400, "invalid_json", NULL,
                       "send a JSON object: {\"from_step\": S, \"patch\": {...}, \"reason\": "
                       "\"...\"}");
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
    b->patch = json_object_get(b->body, "patch");
    v = json_object_get(b->body, "remedy");
    if (v && (!json_is_integer(v) || json_integer_value(v) < 1 || b->patch)) {
        api_error_resp(r, 400, "invalid_parameter", "remedy",
                       "remedy: the id of a recommendation event (an integer >= 1), instead of "
                       "a patch");
        return false;
    }
    b->remedy = v ? json_integer_value(v) : 0;
    v = json_object_get(b->body, "reason");
    if ((from || !b->remedy) && (!json_is_integer(from) || json_integer_value(from) < 1)) {
        api_error_resp(r, 400, "invalid_parameter", "from_step",
                       "from_step: the step of one of the job's checkpoints (an integer >= 1)");
        return false;
    }
    if (!b->remedy && !json_is_object(b->patch)) {
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
    b->from = from ? json_integer_value(from) : 0;
    b->reason = v ? json_string_value(v) : "by hand";
    return true;
}

/* Recommendation event b->remedy of job: its patch and sentence into b, and b->from when
 * the request gave none: the newest checkpoint before the event's step. False with a 422
 * in r naming "remedy" when there is no such event, it has no remedy, or no checkpoint
 * precedes it. */
static bool take_remedy(api_server *s, api_resp *r, int64_t job, branch_req *b)
{
    store_checkpoint *cks = NULL;
    int n = 0, rc = store_event_list(s->st, job, b->remedy - 1, 1, &b->ev, &n);
    if (rc) {
        api_store_error(r, rc, "events of job", job, false);
        return false;
    }
    if (n == 1 && b->ev->id == b->remedy && b->ev->data)
        b->remedy_data = json_loads(b->ev->data, 0, NULL);
    b->patch = json_object_get(json_object_get(b->remedy_data, "remedy"), "patch");
    if (n != 1 || b->ev->id != b->remedy || strcmp(b->ev->kind, "recommendation") != 0 ||
        !json_is_object(b->patch)) {
        api_error_resp(r, 422, API_E_INVALID_BRANCH, "remedy",
                       "remedy: job %lld has no recommendation %lld with a remedy (GET "
                       "/v1/jobs/%lld/events lists them, the remedy in their data)",
                       (long long)job, (long long)b->remedy, (long long)job);
        return false;
    }
    if (!json_object_get(b->body, "reason"))
        b->reason = b->ev->message;
    if (b->from > 0)
        return true;
    if ((rc = store_checkpoint_list(s->st, job, &cks, &n)) != 0) {
        api_store_error(r, rc, "job", job, false);
        return false;
    }
    for (int i = 0; i < n; i++)
        if (cks[i].step < b->ev->step && cks[i].step > b->from)
            b->from = cks[i].step;
    free(cks);
    if (b->from == 0)
        api_error_resp(r, 422, API_E_INVALID_BRANCH, "remedy",
                       "remedy: job %lld has no checkpoint before step %lld, where the problem "
                       "showed; name one with from_step",
                       (long long)job, (long long)b->ev->step);
    return b->from > 0;
}

/* The parent's checkpoint at step into path; false with a 422 in r when it has none there
 * or its file is gone. */
static bool find_checkpoint(api_server *s, api_resp *r, int64_t job, int64_t step, char *path,
                            size_t len)
{
    store_checkpoint *cks = NULL;
    char have[400] = "";
    size_t used = 0;
    int n = 0, rc = store_checkpoint_list(s->st, job, &cks, &n);
    if (rc) {
        api_store_error(r, rc, "job", job, false);
        return false;
    }
    path[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (cks[i].step == step)
            snprintf(path, len, "%s", cks[i].path);
        if (used < sizeof(have))
            used += (size_t)snprintf(have + used, sizeof(have) - used, "%s%lld", i ? ", " : "",
                                     (long long)cks[i].step);
    }
    free(cks);
    if (!path[0]) {
        api_error_resp(r, 422, API_E_INVALID_BRANCH, "from_step",
                       "from_step: job %lld has no checkpoint at step %lld (it has %s)",
                       (long long)job, (long long)step, n ? have : "none");
        return false;
    }
    if (access(path, R_OK) != 0) {
        api_error_resp(r, 422, API_E_INVALID_BRANCH, "from_step",
                       "from_step: the file of job %lld's checkpoint at step %lld is gone (%s)",
                       (long long)job, (long long)step, path);
        return false;
    }
    return true;
}

/* What a checkpoint cannot carry: false with a 422 in r naming the patched field. */
static bool carries(json_t *parent, json_t *branch, int64_t from, api_resp *r)
{
    json_t *pd = json_object_get(parent, "distributed"),
           *bd = json_object_get(branch, "distributed");
    json_int_t pw = json_integer_value(json_object_get(pd, "world_size"));
    json_int_t bw = json_integer_value(json_object_get(bd, "world_size"));
    if (!json_equal(json_object_get(parent, "model"), json_object_get(branch, "model"))) {
        api_error_resp(r, 422, API_E_INVALID_BRANCH, "patch.model",
                       "patch.model: a branch keeps its parent's model (the checkpoint holds "
                       "the parent's tensors); submit a new job for another model");
        return false;
    }
    if ((pw ? pw : 1) != (bw ? bw : 1)) {
        api_error_resp(r, 422, API_E_INVALID_BRANCH, "patch.distributed.world_size",
                       "patch.distributed.world_size: a branch keeps its parent's world size "
                       "(%lld): the checkpoint's data order is split across that many ranks",
                       (long long)(pw ? pw : 1));
        return false;
    }
    if (json_integer_value(json_object_get(branch, "steps")) <= from) {
        api_error_resp(r, 422, API_E_INVALID_BRANCH, "patch.steps",
                       "patch.steps: the branch would end at step %lld, not after the step it "
                       "starts from (%lld)",
                       (long long)json_integer_value(json_object_get(branch, "steps")),
                       (long long)from);
        return false;
    }
    return true;
}

/* A patch of precision.dtype without precision.loss_scale: the new dtype's scaler
 * defaults, not the old one's that the stored spec spells out. */
static void dtype_defaults(json_t *merged, json_t *patch)
{
    json_t *pp = json_object_get(patch, "precision");
    if (json_object_get(pp, "dtype") && !json_object_get(pp, "loss_scale"))
        json_object_del(json_object_get(merged, "precision"), "loss_scale");
}

/* What starts anew in the branch (its effective spec eff) rather than carrying over from
 * the parent's checkpoint (pspec: the parent's): a JSON array. */
static json_t *resets(json_t *pspec, const char *eff)
{
    json_t *e = json_loads(eff, 0, NULL), *out = json_array();
    json_t *pp = json_object_get(pspec, "precision"), *bp = json_object_get(e, "precision");
    if (!json_equal(json_object_get(pp, "loss_scale"), json_object_get(bp, "loss_scale")) ||
        !json_equal(json_object_get(pp, "dtype"), json_object_get(bp, "dtype")))
        json_array_append_new(out, json_string("loss_scale"));
    json_decref(e);
    return out;
}

/* The branch's record (see the top of the file); NULL when out of memory. */
static char *branch_record(const store_job *parent, const branch_req *b, json_t *reset)
{
    json_t *pb = parent->branch ? json_loads(parent->branch, 0, NULL) : NULL;
    json_t *lineage = json_array(), *rec;
    json_t *up = json_object_get(pb, "lineage");
    size_t i;
    json_t *v;
    char *text;
    json_array_foreach(up, i, v) json_array_append(lineage, v);
    json_array_append_new(lineage, json_integer(parent->id));
    json_decref(pb);
    rec = json_pack("{s:I, s:I, s:s, s:O, s:o, s:o, s:o}", "parent", (json_int_t)parent->id, "step",
                    (json_int_t)b->from, "reason", b->reason, "patch", b->patch, "lineage", lineage,
                    "resets", reset, "remedy", b->remedy ? json_integer(b->remedy) : json_null());
    text = rec ? json_dumps(rec, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(rec);
    return text;
}

/* The merged spec checked as a submitted one: true with *cfg and the effective spec in *eff,
 * else false with a 422 in r naming the field under "patch.". */
static bool check_spec(api_server *s, api_resp *r, json_t *merged, gpu_job_config *cfg, char **eff)
{
    api_error e;
    char field[sizeof(e.field) + 8];
    char *text = json_dumps(merged, JSON_COMPACT);
    bool ok = false;
    memset(&e, 0, sizeof(e));
    if (!text) {
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        return false;
    }
    if (api_spec_parse(text, strlen(text), &s->cfg.spec, cfg, &e) == 0 &&
        api_job_can_run(s, cfg, merged, &e)) {
        if (!(*eff = api_spec_effective(cfg)))
            api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        ok = *eff != NULL;
    } else {
        snprintf(field, sizeof(field), "patch%s%s", e.field[0] ? "." : "", e.field);
        bool spec = !e.code[0] || strcmp(e.code, "invalid_spec") == 0;
        api_error_resp(r, 422, spec ? API_E_INVALID_BRANCH : e.code, field, "patch: %s", e.message);
    }
    free(text);
    return ok;
}

/* The reason and the patch in words, for the two jobs' events. */
static void describe(const branch_req *b, char *out, size_t len)
{
    char *p = json_dumps(b->patch, JSON_COMPACT | JSON_SORT_KEYS);
    snprintf(out, len, "%s; patch %.300s%s", b->reason, p ? p : "?",
             p && strlen(p) > 300 ? "..." : "");
    free(p);
}

/* Create the branch of parent: 201 with the new job, or an error in r. */
static void create(api_req *q, api_resp *r, const store_job *parent, branch_req *b)
{
    api_server *s = q->srv;
    gpu_job_config cfg;
    char ckpt[600], what[600], *eff = NULL, *rec = NULL;
    json_t *pspec = json_loads(parent->spec ? parent->spec : "", 0, NULL), *merged = NULL;
    store_job j;
    int64_t id = 0;
    int rc;

    if (!json_is_object(pspec) || !(merged = json_deep_copy(pspec))) {
        api_error_resp(r, 422, API_E_INVALID_BRANCH, NULL, "job %lld's stored spec cannot be read",
                       (long long)parent->id);
        goto fail;
    }
    merge_patch(merged, b->patch);
    dtype_defaults(merged, b->patch);
    if (!find_checkpoint(s, r, parent->id, b->from, ckpt, sizeof(ckpt)) ||
        !carries(pspec, merged, b->from, r) || !check_spec(s, r, merged, &cfg, &eff))
        goto fail;
    if (!(rec = branch_record(parent, b, resets(pspec, eff)))) {
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        goto fail;
    }
    describe(b, what, sizeof(what));
    rc = s->jobs->branch(s->jobs->ctx, cfg.name, gpu_dtype_name(cfg.dtype), cfg.steps, eff,
                         parent->id, b->from, rec, what, &id);
    if (rc == 0)
        rc = store_job_get(s->st, id, &j);
    if (rc) {
        api_store_error(r, rc, "job", id, true);
        goto fail;
    }
    r->status = 201;
    r->ctype = NULL;
    snprintf(r->location, sizeof(r->location), "/v1/jobs/%lld", (long long)id);
    api_job_json(&r->body, &j, true, NULL, s->jobs);
    store_job_clear(&j);
fail:
    free(rec);
    free(eff);
    json_decref(merged);
    json_decref(pspec);
}

void api_h_job_branch(api_req *q, api_resp *r)
{
    branch_req b;
    store_job parent;
    memset(&b, 0, sizeof(b));
    if (!api_load_job(q, r, &parent))
        return;
    if (!q->srv->jobs || !q->srv->jobs->branch) {
        api_error_resp(r, 503, "unavailable", NULL, "the scheduler is not running");
    } else if (parse_body(q, r, &b) && (!b.remedy || take_remedy(q->srv, r, parent.id, &b))) {
        json_t *pb = parent.branch ? json_loads(parent.branch, 0, NULL) : NULL;
        if (json_array_size(json_object_get(pb, "lineage")) + 1 >= LINEAGE_MAX)
            api_error_resp(r, 422, API_E_INVALID_BRANCH, NULL,
                           "job %lld already has %d ancestors: branch an earlier job",
                           (long long)parent.id, LINEAGE_MAX - 1);
        else
            create(q, r, &parent, &b);
        json_decref(pb);
    }
    json_decref(b.body);
    json_decref(b.remedy_data);
    store_events_free(b.ev, b.ev ? 1 : 0);
    store_job_clear(&parent);
}
