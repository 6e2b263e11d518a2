/*
 * sse.c - GET /v1/jobs/{id}/stream: a job's metrics and events as Server-Sent Events.
 *
 * Each step is sent as `id: <step>\nevent: step\ndata: <json>\n\n`; eval, checkpoint and
 * event lines go out as their own event types with their step as id; the job's summary
 * is the last message (`event: end`), then the stream closes. A comment line `: ping`
 * is sent after heartbeat_ms without data.
 *
 * Phases of a stream:
 *   BACKLOG  the job's rows already in the store (after Last-Event-ID / ?last_event_id),
 *            read in chunks of CHUNK_STEPS steps, with its events and checkpoints merged in
 *            by step; up to the last step the store had when the stream opened.
 *   LIVE     lines from the scheduler's hub (the api_jobs lines callback), which blocks up to a
 *            slice. If the hub no longer holds the steps right after the last one sent
 *            (oldest > last + 1), the gap is read from the store (after store_flush)
 *            first, so no step is ever skipped.
 *   POLL     no scheduler (degraded server) or a job the hub has not seen: the store is
 *            read every slice until the job has finished.
 *   FINAL    a finished job: the rest of its rows, events and checkpoints from the store,
 *            then `end`.
 *
 * The hub returns every line after the step line `after` (api.h, api_jobs.lines), so the non-step
 * lines after the last step sent come back on each call: `skip` counts those already sent. When a
 * call brings nothing new the reader waits NOTHING_NEW_MS before asking again rather than spinning.
 *
 * Invariants: step ids sent are strictly increasing; a backlog row's eval and same-step
 * events are held back (`tail`) until the next row, so that when the stream switches to
 * the hub, which sends them itself, nothing is sent twice.
 *
 * Threads: MHD runs one thread per connection, and a stream's reader runs only on its
 * connection's thread; it blocks at most SLICE_MS at a time and ends as soon as the server
 * is stopping (api_stop broadcasts srv->cv).
 */
#include <math.h>
#include <microhttpd.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/api_int.h"

#define SLICE_MS 250      /* longest single wait, so api_stop ends streams promptly */
#define NOTHING_NEW_MS 50 /* pause when the hub only repeated lines already sent */
#define CHUNK_STEPS 4096  /* store rows read per chunk */
#define MAX_EXTRAS 20000  /* events + checkpoints merged into a backlog */

typedef enum { PH_BACKLOG, PH_LIVE, PH_POLL, PH_FINAL } phase;

typedef struct sse_stream sse_stream;

typedef struct {
    int64_t step;
    int64_t seq;
    char *json;
    const char *event; /* "event" or "checkpoint" */
} extra;

struct sse_stream {
    api_server *srv;
    int64_t job;
    phase ph;
    int64_t last;     /* step of the last step message sent (or the resume point) */
    int64_t cursor;   /* the store has been read through this step */
    int64_t end_hint; /* BACKLOG/FINAL: read the store at least this far */
    int skip;         /* hub lines after step line `last` already sent */
    bool ended, started;
    bool in_gap;   /* LIVE: reading a gap the hub no longer holds from the store */
    char *summary; /* the hub's summary line, held until the job is finished */
    api_buf out, tail;
    size_t off;
    int64_t next_ping;
    extra *ex;
    int nex, iex;
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

/* The fields of one line kind of a store row, as ,"name":value pairs. */
static void put_fields(api_buf *b, const store_point *p, store_line line)
{
    for (int f = 0; f < STORE_M_NFIELDS; f++) {
        if (store_metric_field(f)->line != line)
            continue;
        api_buf_printf(b, ",\"%s\":", store_metric_name(f));
        put_field(b, f, p->last[f]);
    }
}

/* A store row as a step message (the fields of the worker's step line, by store name). */
static void row_message(api_buf *b, const store_point *p)
{
    api_buf_printf(b, "id: %lld\nevent: step\ndata: {\"type\":\"step\",\"step\":%lld",
                   (long long)p->step_first, (long long)p->step_first);
    put_fields(b, p, STORE_LINE_STEP);
    api_buf_puts(b, "}\n\n");
}

/* The row's eval result, if it has one, as an eval message. */
static void eval_message(api_buf *b, const store_point *p)
{
    bool any = false;
    for (int f = 0; f < STORE_M_NFIELDS; f++)
        if (store_metric_field(f)->line == STORE_LINE_EVAL && !isnan(p->last[f]))
            any = true;
    if (!any)
        return;
    api_buf_printf(b, "id: %lld\nevent: eval\ndata: {\"type\":\"eval\",\"step\":%lld",
                   (long long)p->step_first, (long long)p->step_first);
    put_fields(b, p, STORE_LINE_EVAL);
    api_buf_puts(b, "}\n\n");
}

/* The end message built from the store when no summary line is at hand. */
static void end_from_store(sse_stream *st)
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
    message(&st->out, "end", st->last, d.data ? d.data : "{}");
    api_buf_free(&d);
    st->ended = true;
}

/* ---- backlog: rows, events and checkpoints from the store ------------------------------ */

static int cmp_extra(const void *a, const void *b)
{
    const extra *x = a, *y = b;
    if (x->step != y->step)
        return x->step < y->step ? -1 : 1;
    return (x->seq > y->seq) - (x->seq < y->seq);
}

static void extras_free(sse_stream *st)
{
    for (int i = 0; i < st->nex; i++)
        free(st->ex[i].json);
    free(st->ex);
    st->ex = NULL;
    st->nex = st->iex = 0;
}

static bool extras_push(sse_stream *st, int *cap, int64_t step, const char *event, api_buf *b)
{
    size_t len;
    if (st->nex == *cap) {
        int nc = *cap ? *cap * 2 : 64;
        extra *p = realloc(st->ex, sizeof(*p) * (size_t)nc);
        if (!p)
            return false;
        st->ex = p;
        *cap = nc;
    }
    char *json = api_buf_steal(b, &len);
    if (!json)
        return false;
    st->ex[st->nex] = (extra){.step = step, .seq = st->nex, .json = json, .event = event};
    st->nex++;
    return true;
}

/* The job's events and checkpoints after the resume point, sorted by step. */
static void extras_load(sse_stream *st)
{
    store_event *ev = NULL;
    store_checkpoint *ck = NULL;
    int n = 0, cap = 0;
    int64_t after = 0;
    api_buf b;

    api_buf_init(&b);
    while (st->nex < MAX_EXTRAS &&
           store_event_list(st->srv->st, st->job, after, 1000, &ev, &n) == 0 && n > 0) {
        for (int i = 0; i < n; i++) {
            if (ev[i].step <= st->last && st->last > 0)
                continue;
            api_buf_printf(&b,
                           "{\"type\":\"event\",\"step\":%lld,\"kind\":", (long long)ev[i].step);
            api_buf_json_str(&b, ev[i].kind);
            api_buf_puts(&b, ",\"message\":");
            api_buf_json_str(&b, ev[i].message);
            if (ev[i].data && (ev[i].data[0] == '{' || ev[i].data[0] == '[')) {
                api_buf_puts(&b, ",\"data\":");
                api_buf_puts(&b, ev[i].data);
            }
            api_buf_putc(&b, '}');
            if (!extras_push(st, &cap, ev[i].step, "event", &b))
                break;
        }
        after = ev[n - 1].id;
        bool more = n == 1000;
        store_events_free(ev, n);
        ev = NULL;
        if (!more)
            break;
    }
    if (store_checkpoint_list(st->srv->st, st->job, &ck, &n) == 0) {
        for (int i = 0; i < n && st->nex < MAX_EXTRAS; i++) {
            if (ck[i].step <= st->last && st->last > 0)
                continue;
            api_buf_printf(&b, "{\"type\":\"checkpoint\",\"step\":%lld,\"bytes\":%lld}",
                           (long long)ck[i].step, (long long)ck[i].bytes);
            if (!extras_push(st, &cap, ck[i].step, "checkpoint", &b))
                break;
        }
        free(ck);
    }
    api_buf_free(&b);
    if (st->nex > 1)
        qsort(st->ex, (size_t)st->nex, sizeof(extra), cmp_extra);
}

static void flush_tail(sse_stream *st)
{
    if (st->tail.len > 0)
        api_buf_put(&st->out, st->tail.data, st->tail.len);
    api_buf_reset(&st->tail);
}

/* Rows with step in (cursor, hi], at most CHUNK_STEPS steps of them, as messages with the
 * extras merged in. Returns the number of rows read, or -1 on a store error. */
static int rows_chunk(sse_stream *st, int64_t hi)
{
    store_series se;
    int fields[STORE_M_NFIELDS];
    int64_t lo = st->cursor + 1;
    if (hi < lo)
        return 0;
    if (hi - lo >= CHUNK_STEPS)
        hi = lo + CHUNK_STEPS - 1;
    for (int f = 0; f < STORE_M_NFIELDS; f++)
        fields[f] = f;
    int rc = store_series_query(st->srv->st, st->job, fields, STORE_M_NFIELDS, lo, hi, 0, &se);
    if (rc) {
        log_warn("job %lld: stream: cannot read steps %lld..%lld (%d)", (long long)st->job,
                 (long long)lo, (long long)hi, rc);
        return -1;
    }
    for (int i = 0; i < se.npoints; i++) {
        const store_point *p = &se.points[i];
        int64_t step = p->step_first;
        if (step <= st->last)
            continue;
        while (st->iex < st->nex && st->ex[st->iex].step < step) {
            flush_tail(st);
            message(&st->out, st->ex[st->iex].event, st->ex[st->iex].step, st->ex[st->iex].json);
            st->iex++;
        }
        flush_tail(st);
        row_message(&st->out, p);
        st->last = step;
        st->skip = 0;
        eval_message(&st->tail, p);
        while (st->iex < st->nex && st->ex[st->iex].step == step) {
            message(&st->tail, st->ex[st->iex].event, step, st->ex[st->iex].json);
            st->iex++;
        }
    }
    int n = se.npoints;
    store_series_free(&se);
    st->cursor = hi;
    return n;
}

/* Everything left from the store (FINAL): one chunk per call, then the end message. */
static void final_step(sse_stream *st)
{
    int n = rows_chunk(st, st->cursor < INT64_MAX / 2 ? st->cursor + CHUNK_STEPS : st->cursor);
    if (n < 0) {
        st->ended = true;
        return;
    }
    if (n > 0 || st->cursor < st->end_hint)
        return;
    flush_tail(st);
    for (; st->iex < st->nex; st->iex++)
        message(&st->out, st->ex[st->iex].event, st->ex[st->iex].step, st->ex[st->iex].json);
    extras_free(st);
    end_from_store(st);
}

/* Enter FINAL: the job has finished, so everything is (after a flush) in the store. */
static void go_final(sse_stream *st, int64_t job_step)
{
    store_flush(st->srv->st);
    st->ph = PH_FINAL;
    st->end_hint = job_step;
}

/* ---- live and poll --------------------------------------------------------------------- */

/* Wait up to ms on the server's condition (api_stop wakes it). */
static void wait_ms(api_server *srv, int ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&srv->mu);
    if (!atomic_load(&srv->stopping))
        pthread_cond_timedwait(&srv->cv, &srv->mu, &ts);
    pthread_mutex_unlock(&srv->mu);
}

/* How long the next wait may last: up to the next heartbeat, at most one slice. */
static int slice_ms(const sse_stream *st)
{
    int64_t left = st->next_ping - api_now_ms();
    if (left > SLICE_MS)
        left = SLICE_MS;
    return left < 1 ? 1 : (int)left;
}

/* The "type" of a hub line into type (a short identifier); "message" if there is none. */
static void line_type(const char *json, char *type, size_t len)
{
    static const char key[] = "{\"type\":\"";
    snprintf(type, len, "message");
    if (strncmp(json, key, sizeof(key) - 1) == 0) {
        const char *s = json + sizeof(key) - 1;
        size_t n = strspn(s, "abcdefghijklmnopqrstuvwxyz_");
        if (n > 0 && n < len && s[n] == '"') {
            memcpy(type, s, n);
            type[n] = '\0';
        }
        return;
    }
    json_t *o = json_loads(json, 0, NULL);
    const char *t = json_string_value(json_object_get(o, "type"));
    if (t && strlen(t) < len && strspn(t, "abcdefghijklmnopqrstuvwxyz_") == strlen(t) && *t)
        snprintf(type, len, "%s", t);
    json_decref(o);
}

static void poll_step(sse_stream *st)
{
    store_job j;
    int rc = store_job_get(st->srv->st, st->job, &j);
    if (rc == STORE_ENOTFOUND) {
        end_from_store(st);
        return;
    }
    if (rc) {
        st->ended = true;
        return;
    }
    int64_t job_step = j.step;
    bool fin = store_status_finished(j.status);
    store_job_clear(&j);
    if (fin) {
        go_final(st, job_step);
        return;
    }
    if (st->srv->jobs) {
        const api_jobs *q = st->srv->jobs;
        api_line *lines = NULL;
        int n = 0;
        int64_t oldest;
        bool finished;
        if (q->lines(q->ctx, st->job, st->last, 0, &lines, &n, &oldest, &finished) == 0) {
            api_lines_free(lines, n);
            api_buf_reset(&st->tail);
            st->ph = PH_LIVE;
            return;
        }
    }
    /* Rows that reached the store meanwhile (a job run by another process, or one the hub
     * does not follow). */
    if (rows_chunk(st, job_step) > 0)
        flush_tail(st);
    if (st->out.len == 0)
        wait_ms(st->srv, slice_ms(st));
}

static void live_step(sse_stream *st)
{
    api_line *lines = NULL;
    int n = 0, skip = st->skip;
    int64_t oldest = 1;
    bool finished = false, fresh = false;
    char type[32];

    const api_jobs *q = st->srv->jobs;
    int rc = q->lines(q->ctx, st->job, st->last, slice_ms(st), &lines, &n, &oldest, &finished);
    if (rc == STORE_ENOTFOUND) {
        st->ph = PH_POLL;
        return;
    }
    if (rc) {
        log_warn("job %lld: stream: the live hub failed (%d)", (long long)st->job, rc);
        st->ended = true;
        return;
    }
    if (oldest > st->last + 1) {
        /* The hub no longer holds the steps after the last one sent: read them from the
         * store first (one chunk per call), then go on with what the hub has. */
        if (!st->in_gap) {
            store_flush(st->srv->st);
            st->in_gap = true;
            st->cursor = st->last;
        }
        if (st->cursor < oldest - 1) {
            int got = rows_chunk(st, oldest - 1);
            flush_tail(st);
            if (got < 0)
                st->ended = true;
            if (got < 0 || st->cursor < oldest - 1) {
                api_lines_free(lines, n);
                return;
            }
        }
        st->in_gap = false;
        if (st->last < oldest - 1)
            st->last = oldest - 1;
        skip = 0;
        st->skip = 0;
        fresh = true;
    }
    for (int i = 0; i < n; i++) {
        line_type(lines[i].json, type, sizeof(type));
        if (strcmp(type, "step") == 0) {
            if (lines[i].step <= st->last)
                continue;
            message(&st->out, "step", lines[i].step, lines[i].json);
            st->last = lines[i].step;
            skip = 0;
            st->skip = 0;
            fresh = true;
            continue;
        }
        if (skip > 0) {
            skip--;
            continue;
        }
        st->skip++;
        fresh = true;
        if (strcmp(type, "summary") == 0) {
            free(st->summary);
            st->summary = strdup(lines[i].json);
        } else {
            message(&st->out, type, lines[i].step, lines[i].json);
        }
    }
    api_lines_free(lines, n);
    if (finished) {
        if (st->summary) {
            message(&st->out, "end", st->last, st->summary);
            st->ended = true;
        } else {
            end_from_store(st);
        }
        return;
    }
    if (!fresh && n > 0)
        wait_ms(st->srv, NOTHING_NEW_MS < slice_ms(st) ? NOTHING_NEW_MS : slice_ms(st));
}

/* Produce the next piece of output (possibly nothing, after waiting up to a slice). */
static void fill(sse_stream *st)
{
    if (!st->started) {
        st->started = true;
        api_buf_puts(&st->out, "retry: 2000\n\n");
        return;
    }
    switch (st->ph) {
    case PH_BACKLOG:
        if (st->cursor < st->end_hint) {
            if (rows_chunk(st, st->end_hint) < 0)
                st->ended = true;
            return;
        }
        /* Caught up: what is held back for the last row comes from the hub instead. */
        api_buf_reset(&st->tail);
        extras_free(st);
        st->ph = st->srv->jobs ? PH_LIVE : PH_POLL;
        return;
    case PH_LIVE:
        live_step(st);
        return;
    case PH_POLL:
        poll_step(st);
        return;
    case PH_FINAL:
        final_step(st);
        return;
    }
}

/* ---- MHD callbacks --------------------------------------------------------------------- */

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
        if (st->out.oom || st->tail.oom)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        api_buf_reset(&st->out);
        st->off = 0;
        if (st->ended || atomic_load(&st->srv->stopping))
            return MHD_CONTENT_READER_END_OF_STREAM;
        fill(st);
        if (st->out.len == 0 && api_now_ms() >= st->next_ping)
            api_buf_puts(&st->out, ": ping\n\n");
        if (st->out.len > 0)
            st->next_ping = api_now_ms() + st->srv->heartbeat_ms;
    }
}

static void stream_free(void *cls)
{
    sse_stream *st = cls;
    if (!st)
        return;
    extras_free(st);
    api_buf_free(&st->out);
    api_buf_free(&st->tail);
    free(st->summary);
    free(st);
}

/* ---- the handler ----------------------------------------------------------------------- */

void api_h_stream(api_req *q, api_resp *r)
{
    const char *lei = MHD_lookup_connection_value(q->conn, MHD_HEADER_KIND, "Last-Event-ID");
    const char *field = "Last-Event-ID";
    int64_t resume = 0;
    store_job j;
    sse_stream *st;

    if (!lei) {
        lei = api_query(q, "last_event_id");
        field = "last_event_id";
    }
    if (lei && api_parse_i64(lei, 0, INT64_MAX / 4, &resume) != 0) {
        api_error_resp(r, 400, "invalid_parameter", field,
                       "must be the id of an event (a step, a non-negative integer)");
        return;
    }
    memset(&j, 0, sizeof(j));
    if (q->route.job < 0 || store_job_get(q->srv->st, q->route.job, &j) != 0) {
        api_error_resp(r, 404, "not_found", NULL, "no job %.64s", q->path + 9);
        return;
    }
    st = calloc(1, sizeof(*st));
    if (!st) {
        store_job_clear(&j);
        api_error_resp(r, 503, "unavailable", NULL, "out of memory");
        return;
    }
    st->srv = q->srv;
    st->job = j.id;
    st->last = st->cursor = resume;
    api_buf_init(&st->out);
    api_buf_init(&st->tail);
    st->next_ping = api_now_ms() + q->srv->heartbeat_ms;
    extras_load(st);
    if (store_status_finished(j.status)) {
        go_final(st, j.step);
    } else {
        st->ph = PH_BACKLOG;
        st->end_hint = j.step;
    }
    store_job_clear(&j);
    r->status = 200;
    r->ctype = "text/event-stream";
    r->reader = stream_read;
    r->reader_free = stream_free;
    r->reader_cls = st;
}
