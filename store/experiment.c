/*
 * experiment.c - experiments (named groups of jobs in arms, store.h) and the two reads the
 * comparison of an experiment is built from: a job's eval results and its newest event of
 * a kind.
 *
 * Invariants: an experiment is inserted with all its members in one transaction, so a
 * reader never sees a group half made; members are read with their jobs' status by a join,
 * so a member whose job was deleted is gone (ON DELETE CASCADE) rather than dangling.
 *
 * Threads: as the rest of the store (store.h): writes under wlock on the write connection,
 * reads on the calling thread's read connection.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/store_int.h"

static bool fits(const char *s, size_t size)
{
    return s && strlen(s) < size;
}

static bool members_ok(const store_member *m, int n)
{
    if (!m || n < 1 || n > STORE_EXP_MEMBERS_MAX)
        return false;
    for (int i = 0; i < n; i++)
        if (m[i].job_id <= 0 || !fits(m[i].arm, STORE_ARM_MAX) || !m[i].arm[0])
            return false;
    return true;
}

/* Insert member i of experiment id (wlock held, in the transaction). */
static int member_add(store *s, int64_t id, const store_member *m, int i)
{
    sqlite3_stmt *st = store_stmt(s->w, ST_EXP_MEMBER_ADD);
    int rc;
    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, m->job_id);
    sqlite3_bind_text(st, 3, m->arm, -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(st, 4, m->seed);
    sqlite3_bind_int(st, 5, i);
    rc = sqlite3_step(st);
    if (rc == SQLITE_DONE) {
        rc = 0;
    } else if ((rc & 0xff) == SQLITE_CONSTRAINT) {
        /* the primary key (a job given twice) or the foreign key (no such job) */
        rc = sqlite3_extended_errcode(s->w->db) == SQLITE_CONSTRAINT_PRIMARYKEY ? STORE_ECONFLICT
                                                                              : STORE_ENOTFOUND;
    } else {
        rc = store_sql_error(s->w->db, st, rc, __func__);
    }
    store_stmt_done(st);
    return rc;
}

int store_experiment_create(store *s, const char *name, const char *baseline,
                            const char *request_json, const store_member *m, int n, int64_t *id)
{
    sqlite3_stmt *st;
    int rc;

    if (!s || !id || !fits(name, sizeof(((store_experiment *)0)->name)) || !name[0] ||
        !fits(baseline, STORE_ARM_MAX) || !members_ok(m, n))
        return STORE_EINVAL;
    if ((rc = store_txn_begin(s)) != 0)
        return store_wend(s, rc);
    if (!(st = store_stmt(s->w, ST_EXP_INSERT))) {
        rc = STORE_EIO;
    } else {
        sqlite3_bind_text(st, 1, name, -1, SQLITE_TRANSIENT);
        sqlite3_bind_double(st, 2, store_now());
        sqlite3_bind_text(st, 3, baseline, -1, SQLITE_TRANSIENT);
        store_bind_text(st, 4, request_json);
        rc = store_step_change(s, st, __func__);
        *id = sqlite3_last_insert_rowid(s->w->db);
    }
    for (int i = 0; rc == 0 && i < n; i++)
        rc = member_add(s, *id, &m[i], i);
    return store_txn_end(s, rc);
}

/* The members of e (e->id set) into e->members; 0 or a STORE_E code. */
static int members_read(store_conn *c, store_experiment *e)
{
    sqlite3_stmt *st = store_stmt(c, ST_EXP_MEMBERS);
    int rc, cap = 0;
    if (!st)
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, e->id);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if ((rc = store_grow(&e->members, &cap, e->nmembers, sizeof(*e->members), 16)) != 0)
            goto out;
        store_member *m = &e->members[e->nmembers++];
        memset(m, 0, sizeof(*m));
        m->job_id = sqlite3_column_int64(st, 0);
        store_column_copy(st, 1, m->arm, sizeof(m->arm));
        m->seed = sqlite3_column_int64(st, 2);
        if (store_status_parse((const char *)sqlite3_column_text(st, 3), &m->status) != 0)
            m->status = STORE_FAILED;
    }
    rc = rc == SQLITE_DONE ? 0 : store_sql_error(c->db, st, rc, __func__);
out:
    store_stmt_done(st);
    return rc;
}

/* An experiment from the current row of ST_EXP_GET / ST_EXP_LIST. */
static int experiment_from_row(sqlite3_stmt *st, store_experiment *e)
{
    memset(e, 0, sizeof(*e));
    e->id = sqlite3_column_int64(st, 0);
    store_column_copy(st, 1, e->name, sizeof(e->name));
    e->created_at = sqlite3_column_double(st, 2);
    store_column_copy(st, 3, e->baseline, sizeof(e->baseline));
    e->request = store_column_dup(st, 4);
    return sqlite3_column_type(st, 4) != SQLITE_NULL && !e->request ? STORE_EIO : 0;
}

int store_experiment_get(store *s, int64_t id, store_experiment *out)
{
    store_conn *c;
    sqlite3_stmt *st;
    int rc;

    if (!s || !out)
        return STORE_EINVAL;
    memset(out, 0, sizeof(*out));
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_EXP_GET)))
        return STORE_EIO;
    /* one snapshot for the row and its members */
    if ((rc = store_exec_stmt(c, ST_BEGIN)) != 0) {
        store_stmt_done(st);
        return rc;
    }
    sqlite3_bind_int64(st, 1, id);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        rc = experiment_from_row(st, out);
    else if (rc == SQLITE_DONE)
        rc = STORE_ENOTFOUND;
    else
        rc = store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
    if (rc == 0)
        rc = members_read(c, out);
    store_exec_stmt(c, ST_COMMIT);
    if (rc)
        store_experiment_clear(out);
    return rc;
}

int store_experiment_list(store *s, int64_t after, int limit, store_experiment **out, int *n)
{
    store_conn *c;
    sqlite3_stmt *st;
    store_experiment *v = NULL;
    int rc, cnt = 0;

    if (!s || !out || !n || limit < 1 || limit > 1000 || after < 0)
        return STORE_EINVAL;
    *out = NULL;
    *n = 0;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_EXP_LIST)))
        return STORE_EIO;
    if (!(v = calloc((size_t)limit, sizeof(*v)))) {
        store_stmt_done(st);
        return STORE_EIO;
    }
    if ((rc = store_exec_stmt(c, ST_BEGIN)) != 0) {
        store_stmt_done(st);
        goto fail;
    }
    sqlite3_bind_int64(st, 1, after > 0 ? after : INT64_MAX);
    sqlite3_bind_int(st, 2, limit);
    while (cnt < limit && (rc = sqlite3_step(st)) == SQLITE_ROW)
        if ((rc = experiment_from_row(st, &v[cnt++])) != 0)
            break;
    if (rc == SQLITE_DONE || rc == SQLITE_ROW)
        rc = 0;
    else if (rc > 0)
        rc = store_sql_error(c->db, st, rc, __func__);
    store_stmt_done(st);
    for (int i = 0; rc == 0 && i < cnt; i++)
        rc = members_read(c, &v[i]);
    store_exec_stmt(c, ST_COMMIT);
    if (rc)
        goto fail;
    *out = v;
    *n = cnt;
    return 0;
fail:
    store_experiments_free(v, cnt);
    return rc;
}

void store_experiment_clear(store_experiment *e)
{
    if (!e)
        return;
    free(e->request);
    free(e->members);
    e->request = NULL;
    e->members = NULL;
    e->nmembers = 0;
}

void store_experiments_free(store_experiment *e, int n)
{
    for (int i = 0; e && i < n; i++)
        store_experiment_clear(&e[i]);
    free(e);
}

int store_experiment_delete(store *s, int64_t id)
{
    sqlite3_stmt *st;
    int rc;

    if (!s)
        return STORE_EINVAL;
    if ((rc = store_wstmt(s, ST_EXP_DELETE, &st)) == 0) {
        sqlite3_bind_int64(st, 1, id);
        rc = store_step_change(s, st, __func__); /* the members go by ON DELETE CASCADE */
    }
    store_wend(s, rc);
    store_committed(s);
    return rc;
}

/* Column i of an eval row: the value, NaN when its bit in nan_mask says the run reported
 * NaN, store_missing() when it was not reported. */
static double eval_column(sqlite3_stmt *st, int i, int64_t nan_mask, int field)
{
    if (sqlite3_column_type(st, i) != SQLITE_NULL)
        return sqlite3_column_double(st, i);
    return (nan_mask >> field) & 1 ? NAN : store_missing();
}

int store_eval_list(store *s, int64_t job, store_eval **out, int *n)
{
    store_conn *c;
    sqlite3_stmt *st;
    store_eval *v = NULL;
    int rc, cnt = 0, cap = 0;

    if (!s || !out || !n)
        return STORE_EINVAL;
    *out = NULL;
    *n = 0;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_EVAL_LIST)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, (sqlite3_int64)STORE_EVAL_BITS);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if ((rc = store_grow(&v, &cap, cnt, sizeof(*v), 64)) != 0)
            goto fail;
        int64_t mask = sqlite3_column_int64(st, 3);
        v[cnt].step = sqlite3_column_int64(st, 0);
        v[cnt].loss = eval_column(st, 1, mask, STORE_M_EVAL_LOSS);
        v[cnt].acc = eval_column(st, 2, mask, STORE_M_EVAL_ACC);
        cnt++;
    }
    if (rc != SQLITE_DONE) {
        rc = store_sql_error(c->db, st, rc, __func__);
        goto fail;
    }
    store_stmt_done(st);
    *out = v;
    *n = cnt;
    return 0;
fail:
    store_stmt_done(st);
    free(v);
    return rc;
}

int store_event_last(store *s, int64_t job, const char *kind, store_event **out)
{
    store_conn *c;
    sqlite3_stmt *st;
    store_event *e;
    int rc;

    if (!s || !kind || !out)
        return STORE_EINVAL;
    *out = NULL;
    if (!(c = store_reader(s)) || !(st = store_stmt(c, ST_EVENT_LAST)))
        return STORE_EIO;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_text(st, 2, kind, -1, SQLITE_TRANSIENT);
    rc = sqlite3_step(st);
    if (rc == SQLITE_DONE) {
        rc = STORE_ENOTFOUND;
    } else if (rc != SQLITE_ROW) {
        rc = store_sql_error(c->db, st, rc, __func__);
    } else if (!(e = calloc(1, sizeof(*e)))) {
        rc = STORE_EIO;
    } else {
        e->id = sqlite3_column_int64(st, 0);
        e->job_id = sqlite3_column_int64(st, 1);
        e->step = sqlite3_column_int64(st, 2);
        e->ts = sqlite3_column_double(st, 3);
        store_column_copy(st, 4, e->kind, sizeof(e->kind));
        e->message = store_column_dup(st, 5);
        e->data = store_column_dup(st, 6);
        *out = e;
        rc = e->message ? 0 : STORE_EIO;
        if (rc) {
            store_events_free(e, 1);
            *out = NULL;
        }
    }
    store_stmt_done(st);
    return rc;
}
