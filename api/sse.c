/*
 * sse.c - GET /v1/jobs/{id}/stream: a job's messages as Server-Sent Events.
 *
 * The messages are the job's stream rows in the store (store.h, store_stream_read), in
 * their order; a message's id is its row's seq and its data is built, when it is sent, from
 * what the row names, with the encoders of the REST answers. So a message is the same
 * whether it goes out live or long after, and the same as the REST API says:
 *   step        {"type":"step","step",<the step fields of the metric table>}
 *   eval        {"type":"eval","step",<the eval fields>}
 *   layers      {"type":"layers",<GET /v1/jobs/{id}/layers?step=S>}
 *   checkpoint  {"type":"checkpoint",<an entry of GET /v1/jobs/{id}/checkpoints>}
 *   event       {"type":"event",<an entry of GET /v1/jobs/{id}/events>}
 *   end         the job's summary; the stream closes after it.
 * A comment line `: ping` goes out after heartbeat_ms without a message.
 *
 * Resume: Last-Event-ID (or ?last_event_id) N sends every message with an id above N, so a
 * client that reconnects with the last id it received gets exactly what followed it.
 * ?from_step=S starts after the message of step S instead, or after the job's latest end
 * when that is later (for a client that read the steps up to S from /metrics and the job's
 * state from /v1/jobs/{id}: the end of a run it was since resumed from is old news). A
 * finished job with nothing after the resume point (the
 * client has its `end`) answers 204 No Content, which stops an EventSource's reconnects.
 *
 * Live: when everything stored has been sent and no heartbeat is due, the reader parks the
 * stream: it suspends the connection (MHD_suspend_connection, so the connection holds no
 * thread and no poll slot) and returns 0. The server's watcher thread waits for the store's
 * commits (store_wait_commit) and resumes (MHD_resume_connection) every parked stream that
 * read the store before the latest commit, or whose heartbeat is due; libmicrohttpd then
 * calls the reader again, which reads what was committed. A message is sent once its data
 * is committed (the writer commits every few milliseconds while a job runs). No commit is
 * missed: a stream notes the store's commit count before it reads, and parks only if the
 * count is still that under park_mu, where the watcher looks.
 *
 * Invariants: ids sent are strictly increasing; a message whose data is gone (a resumed
 * job rewrote its step) is skipped, never sent empty. A stream is in the parked list iff its
 * connection is suspended by park(); only the watcher and api_stop take it out, resuming it.
 *
 * Threads: the reader runs on the pool thread that owns the connection and never waits; the
 * parked list is shared with the watcher thread and api_stop under park_mu. Lock order:
 * libmicrohttpd's response mutex (held around the reader), then park_mu, then
 * libmicrohttpd's connection mutex (inside suspend and resume). A client that goes away
 * while its stream is parked is noticed at the next commit or heartbeat. Once the server is
 * stopping no stream parks and every reader ends its stream.
 */
#include <malloc.h>
#include <math.h>
#include <microhttpd.h>
#include <stdlib.h>
#include <string.h>

#include "api/api_int.h"

/* Stream rows read and sent per fill: a stream's buffer holds at most this many messages
 * (tens of KiB), so a thousand subscribers catching up cost tens of MiB, not gigabytes. */
#define CHUNK_ROWS 32
#define SPAN_STEPS 65536 /* a chunk's steps read in one series query when they span this few */

typedef struct api_sse sse_stream;
struct api_sse {
    api_server *srv;
    struct MHD_Connection *conn;
    int64_t job;
    int64_t last; /* the id of the last message sent (or the resume point) */
    uint64_t seen; /* the store's commit count when the stream was last read */
    bool ended, started;
    api_buf out;
    size_t off;
    int64_t next_ping;
    sse_stream *park_prev, *park_next; /* in srv->parked (under park_mu) */
    bool parked;
};

/* ---- messages -------------------------------------------------------------------------- */

/* One SSE message; data may hold newlines (each line becomes a data: line). */
static void message(api_buf *b, const char *event, int64_t id, const char *data)
{
    api_buf_printf(b, "id: %lld\nevent: %s\n", (long long)id, event);
    for (;;) {
        const char *nl = strchr(data, '\n');
        api_buf_puts(b, "data: ");
        api_buf_put(b, data, nl ? (size_t)(nl - data) : strlen(data));
        api_buf_putc(b, '\n');
        if (!nl)
            break;
        data = nl + 1;
    }
    api_buf_putc(b, '\n');
}

/* An integer-valued field as an integer when it is one. */
static void put_count(api_buf *b, double v)
{
    if (isfinite(v) && v == floor(v) && fabs(v) < 9e15)
        api_buf_printf(b, "%lld", (long long)v);
    else
        api_buf_json_num(b, v);
}

/* A stored value in its field's JSON form (the metric table's type). */
static void put_field(api_buf *b, int f, double v)
{
    switch (store_metric_field(f)->type) {
    case STORE_TYPE_BOOL:
        if (store_is_missing(v))
            api_buf_puts(b, "null");
        else
            api_buf_puts(b, v != 0 && !isnan(v) ? "true" : "false");
        break;
    case STORE_TYPE_INT:
        put_count(b, v);
        break;
    default:
        api_buf_json_num(b, v);
        break;
    }
}

/* A step or eval message from the metric row p (every field, in store order); false when
 * it has none of the line's values (an eval message of a row without an eval). */
static bool row_message(api_buf *out, int64_t id, const store_point *p, store_line line)
{
    const char *type = line == STORE_LINE_STEP ? "step" : "eval";
    api_buf d;
    bool any = false;
    api_buf_init(&d);
    api_buf_printf(&d, "{\"type\":\"%s\",\"step\":%lld", type, (long long)p->step_first);
    for (int f = 0; f < STORE_M_NFIELDS; f++) {
        if (store_metric_field(f)->line != line)
            continue;
        any |= !store_is_missing(p->last[f]);
        api_buf_printf(&d, ",\"%s\":", store_metric_name(f));
        put_field(&d, f, p->last[f]);
    }
    api_buf_putc(&d, '}');
    if (any && d.data)
        message(out, type, id, d.data);
    api_buf_free(&d);
    return any;
}

/* The end message: the job's summary, or what the store knows when it has none. */
static void end_message(sse_stream *st, int64_t id)
{
    store_job j;
    api_buf d;
    api_buf_init(&d);
    if (store_job_get(st->srv->st, st->job, &j) == 0) {
        if (j.summary && j.summary[0] == '{') {
            api_buf_puts(&d, j.summary);
        } else {
            api_buf_puts(&d, "{\"type\":\"summary\",\"name\":");
            api_buf_json_str(&d, j.name);
            api_buf_puts(&d, ",\"status\":");
            api_buf_json_str(&d, store_status_name(j.status));
            api_buf_printf(&d, ",\"steps\":%lld,\"error\":", (long long)j.step);
            api_buf_json_str(&d, j.error);
            api_buf_putc(&d, '}');
        }
        store_job_clear(&j);
    } else {
        api_buf_printf(&d, "{\"type\":\"summary\",\"status\":\"deleted\",\"job\":%lld}",
                       (long long)st->job);
    }
    message(&st->out, "end", id, d.data ? d.data : "{}");
    api_buf_free(&d);
    st->ended = true;
}

/* A message built from a REST encoder's members: typed_open() starts its data with the
 * type, typed_send() closes and sends it. */
static void typed_open(api_buf *d, const char *type)
{
    api_buf_init(d);
    api_buf_printf(d, "{\"type\":\"%s\",", type);
}

static void typed_send(sse_stream *st, const char *type, int64_t id, api_buf *d)
{
    api_buf_putc(d, '}');
    if (d->data)
        message(&st->out, type, id, d->data);
    api_buf_free(d);
}

static void layers_message(sse_stream *st, const store_stream_row *row)
{
    store_layer_stat *rows = NULL;
    store_layer_info info;
    int64_t at = -1;
    int n = 0;
    api_buf d;
    if (store_layer_stats_get(st->srv->st, st->job, row->step, &rows, &n, &at, &info) != 0)
        return;
    typed_open(&d, "layers");
    api_put_layers_fields(&d, st->job, at, &info, rows, n);
    typed_send(st, "layers", row->seq, &d);
    free(rows);
}

static void checkpoint_message(sse_stream *st, const store_stream_row *row)
{
    store_checkpoint *ck = NULL;
    int n = 0;
    api_buf d;
    if (store_checkpoint_list(st->srv->st, st->job, &ck, &n) != 0)
        return;
    for (int i = 0; i < n; i++) {
        if (ck[i].step != row->step)
            continue;
        typed_open(&d, "checkpoint");
        api_put_ckpt_fields(&d, st->job, &ck[i]);
        typed_send(st, "checkpoint", row->seq, &d);
        break;
    }
    free(ck);
}

static void event_message(sse_stream *st, const store_stream_row *row)
{
    store_event *ev = NULL;
    int n = 0;
    api_buf d;
    if (row->ref < 1 || store_event_list(st->srv->st, st->job, row->ref - 1, 1, &ev, &n) != 0)
        return;
    if (n == 1 && ev[0].id == row->ref) {
        typed_open(&d, "event");
        api_put_event_fields(&d, &ev[0]);
        typed_send(st, "event", row->seq, &d);
    }
    store_events_free(ev, n);
}

/* ---- reading the stream ------------------------------------------------------------------- */

/* The metric rows of the step and eval rows of rows[0..n) as one raw series when their steps
 * span few enough (else each is read alone); false when there is none to read. */
static bool chunk_series(sse_stream *st, const store_stream_row *rows, int n, store_series *se)
{
    int all[STORE_M_NFIELDS];
    int64_t lo = INT64_MAX, hi = -1;
    for (int f = 0; f < STORE_M_NFIELDS; f++)
        all[f] = f;
    for (int i = 0; i < n; i++)
        if (rows[i].kind == STORE_SM_STEP || rows[i].kind == STORE_SM_EVAL) {
            lo = rows[i].step < lo ? rows[i].step : lo;
            hi = rows[i].step > hi ? rows[i].step : hi;
        }
    if (hi < 0 || hi - lo >= SPAN_STEPS)
        return false;
    return store_series_query(st->srv->st, st->job, all, STORE_M_NFIELDS, lo, hi, 0, se) == 0;
}

/* The point of step in se (raw, ordered by step), or NULL. */
static const store_point *find_step(const store_series *se, int64_t step)
{
    int a = 0, b = se->npoints - 1;
    while (a <= b) {
        int m = a + (b - a) / 2;
        int64_t s = se->points[m].step_first;
        if (s == step)
            return &se->points[m];
        if (s < step)
            a = m + 1;
        else
            b = m - 1;
    }
    return NULL;
}

static void metric_message(sse_stream *st, const store_stream_row *row, const store_series *se)
{
    int all[STORE_M_NFIELDS];
    store_line line = row->kind == STORE_SM_STEP ? STORE_LINE_STEP : STORE_LINE_EVAL;
    store_series one;
    const store_point *p;
    if (se) {
        if ((p = find_step(se, row->step)))
            row_message(&st->out, row->seq, p, line);
        return;
    }
    for (int f = 0; f < STORE_M_NFIELDS; f++)
        all[f] = f;
    if (store_series_query(st->srv->st, st->job, all, STORE_M_NFIELDS, row->step, row->step, 0,
                           &one) != 0)
        return;
    if ((p = find_step(&one, row->step)))
        row_message(&st->out, row->seq, p, line);
    store_series_free(&one);
}

/* Send rows[0..n) (up to and including an end). */
static void send_rows(sse_stream *st, const store_stream_row *rows, int n)
{
    store_series se;
    bool have = chunk_series(st, rows, n, &se);
    for (int i = 0; i < n && !st->ended; i++) {
        const store_stream_row *row = &rows[i];
        switch (row->kind) {
        case STORE_SM_STEP:
        case STORE_SM_EVAL:
            metric_message(st, row, have ? &se : NULL);
            break;
        case STORE_SM_LAYERS:
            layers_message(st, row);
            break;
        case STORE_SM_CHECKPOINT:
            checkpoint_message(st, row);
            break;
        case STORE_SM_EVENT:
            event_message(st, row);
            break;
        case STORE_SM_END:
            end_message(st, row->seq);
            break;
        }
        st->last = row->seq;
    }
    if (have)
        store_series_free(&se);
}

/* Produce the next piece of output from what the store holds now (possibly nothing). */
static void fill(sse_stream *st)
{
    store_stream_row *rows = NULL;
    store_job j;
    bool finished;
    int n = 0, rc;

    if (!st->started) {
        st->started = true;
        api_buf_puts(&st->out, "retry: 2000\n\n");
        return;
    }
    store_wait_commit(st->srv->st, &st->seen, 0); /* what was committed before this read */
    /* The status first: a job seen finished has its end row (committed with the status) in
     * the read that follows. */
    rc = store_job_get(st->srv->st, st->job, &j);
    if (rc == STORE_ENOTFOUND) {
        end_message(st, st->last); /* deleted: its stream went with it */
        return;
    }
    finished = rc == 0 && store_status_finished(j.status);
    store_job_clear(&j);
    if (rc == 0)
        rc = store_stream_read(st->srv->st, st->job, st->last, CHUNK_ROWS, &rows, &n);
    if (rc) {
        log_warn("job %lld: stream: cannot read the store (%d)", (long long)st->job, rc);
        st->ended = true;
        return;
    }
    if (n > 0) {
        send_rows(st, rows, n);
        free(rows);
        return;
    }
    if (finished)
        st->ended = true; /* everything, its end included, was sent */
}

/* ---- parking ----------------------------------------------------------------------------- */

/* park_mu held */
static void park_unlink(api_server *s, sse_stream *st)
{
    if (st->park_prev)
        st->park_prev->park_next = st->park_next;
    else
        s->parked = st->park_next;
    if (st->park_next)
        st->park_next->park_prev = st->park_prev;
    st->park_prev = st->park_next = NULL;
    st->parked = false;
}

/* Suspend st's connection until the watcher resumes it (a commit after st's last read, or
 * its heartbeat); true when parked. False when the store committed since st's read or the
 * server is stopping: the caller reads again. */
static bool park(sse_stream *st)
{
    api_server *s = st->srv;
    uint64_t now = st->seen;
    bool parked = false;

    pthread_mutex_lock(&s->park_mu);
    if (!s->parking_closed && !store_wait_commit(s->st, &now, 0)) {
        st->park_prev = NULL;
        st->park_next = s->parked;
        if (s->parked)
            s->parked->park_prev = st;
        s->parked = st;
        st->parked = true;
        MHD_suspend_connection(st->conn);
        parked = true;
    }
    pthread_mutex_unlock(&s->park_mu);
    return parked;
}

void api_sse_wake(api_server *s, uint64_t commits, int64_t now_ms, int64_t *next_ms)
{
    pthread_mutex_lock(&s->park_mu);
    for (sse_stream *st = s->parked, *next; st; st = next) {
        next = st->park_next;
        if (st->seen < commits || st->next_ping <= now_ms) {
            park_unlink(s, st);
            MHD_resume_connection(st->conn);
        } else if (st->next_ping < *next_ms) {
            *next_ms = st->next_ping;
        }
    }
    pthread_mutex_unlock(&s->park_mu);
}

void api_sse_wake_all(api_server *s)
{
    pthread_mutex_lock(&s->park_mu);
    s->parking_closed = true;
    while (s->parked) {
        sse_stream *st = s->parked;
        park_unlink(s, st);
        MHD_resume_connection(st->conn);
    }
    pthread_mutex_unlock(&s->park_mu);
}

/* ---- MHD callbacks --------------------------------------------------------------------- */

/* The content reader: what is buffered, else the next piece read from the store, else a
 * heartbeat when one is due; with nothing to send it parks the stream and returns 0. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    sse_stream *st = cls;
    (void)pos;
    for (;;) {
        if (st->off < st->out.len) {
            size_t n = st->out.len - st->off;
            if (n > max)
                n = max;
            memcpy(buf, st->out.data + st->off, n);
            st->off += n;
            return (ssize_t)n;
        }
        if (st->out.oom)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        api_buf_reset(&st->out);
        st->off = 0;
        if (st->ended || atomic_load(&st->srv->stopping))
            return MHD_CONTENT_READER_END_OF_STREAM;
        fill(st);
        if (st->out.len == 0 && api_now_ms() >= st->next_ping)
            api_buf_puts(&st->out, ": ping\n\n");
        if (st->out.len > 0) {
            st->next_ping = api_now_ms() + st->srv->heartbeat_ms;
        } else if (!st->ended) {
            api_buf_free(&st->out); /* a parked stream holds no buffer */
            if (park(st))
                return 0;
        }
    }
}

static void stream_free(void *cls)
{
    sse_stream *st = cls;
    api_server *srv;
    if (!st)
        return;
    srv = st->srv;
    pthread_mutex_lock(&srv->park_mu);
    if (st->parked) /* not reached: a parked connection is resumed before it closes */
        park_unlink(srv, st);
    pthread_mutex_unlock(&srv->park_mu);
    api_buf_free(&st->out);
    free(st);
    /* the last stream gone: give the memory of its buffers back to the system (glibc keeps
     * freed blocks in its arenas otherwise) */
    if (atomic_fetch_sub(&srv->streams, 1) == 1)
        malloc_trim(0);
}

/* ---- the handler ----------------------------------------------------------------------- */

/* The resume point from Last-Event-ID, ?last_event_id or ?from_step; false with r filled. */
static bool resume_point(api_req *q, api_resp *r, int64_t *after)
{
    const char *lei = MHD_lookup_connection_value(q->conn, MHD_HEADER_KIND, "Last-Event-ID");
    const char *field = "Last-Event-ID", *from = api_query(q, "from_step");
    int64_t step;

    *after = 0;
    if (!lei) {
        lei = api_query(q, "last_event_id");
        field = "last_event_id";
    }
    if (lei && api_parse_i64(lei, 0, INT64_MAX / 4, after) != 0) {
        api_error_resp(r, 400, "invalid_parameter", field,
                       "must be the id of a message (a non-negative integer)");
        return false;
    }
    if (!lei && from) {
        if (api_parse_i64(from, 0, INT64_MAX / 4, &step) != 0) {
            api_error_resp(r, 400, "invalid_parameter", "from_step",
                           "must be a step (a non-negative integer)");
            return false;
        }
        if (store_stream_at_step(q->srv->st, q->route.job, step, after) != 0) {
            api_error_resp(r, 503, "unavailable", NULL, "cannot read the job's stream");
            return false;
        }
    }
    return true;
}

void api_h_stream(api_req *q, api_resp *r)
{
    store_stream_row *next = NULL;
    int64_t resume;
    int n = 0;
    store_job j;
    sse_stream *st;

    memset(&j, 0, sizeof(j));
    if (q->route.job < 0 || store_job_get(q->srv->st, q->route.job, &j) != 0) {
        api_error_resp(r, 404, "not_found", NULL, "no job %.64s", q->path + 9);
        return;
    }
    bool finished = store_status_finished(j.status);
    store_job_clear(&j);
    if (!resume_point(q, r, &resume))
        return;
    if (finished && store_stream_read(q->srv->st, q->route.job, resume, 1, &next, &n) == 0 &&
        n == 0) {
        r->status = 204; /* the client has it all, its end included: stop reconnecting */
        return;
    }
    free(next);
    st = calloc(1, sizeof(*st));
    if (!st) {
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        return;
    }
    st->srv = q->srv;
    atomic_fetch_add(&q->srv->streams, 1);
    st->conn = q->conn;
    st->job = q->route.job;
    st->last = resume;
    api_buf_init(&st->out);
    st->next_ping = api_now_ms() + q->srv->heartbeat_ms;
    r->status = 200;
    r->ctype = "text/event-stream";
    r->reader = stream_read;
    r->reader_free = stream_free;
    r->reader_cls = st;
    r->reader_block = 8192; /* a stream's messages are small; a thousand streams, 8 MiB */
}
