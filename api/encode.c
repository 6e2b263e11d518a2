/*
 * encode.c - the HTTP server's pure pieces: a growable output buffer and the encoders that
 * write JSON, CSV and Prometheus text into it, strict parsing of query parameters, and the
 * metric-series encoders (JSON and CSV, raw or bucketed).
 *
 * Invariants: everything written as JSON is valid JSON whatever the input bytes (invalid
 * UTF-8 becomes U+FFFD, non-finite numbers become strings); large responses grow the
 * buffer geometrically, never by repeated concatenation of whole strings.
 *
 * Threads: reentrant; no global state.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/api_int.h"

/* ---- buffer ---------------------------------------------------------------------------- */

void api_buf_init(api_buf *b)
{
    memset(b, 0, sizeof(*b));
}

void api_buf_free(api_buf *b)
{
    if (!b)
        return;
    free(b->data);
    memset(b, 0, sizeof(*b));
}

void api_buf_reset(api_buf *b)
{
    b->len = 0;
    if (b->data)
        b->data[0] = '\0';
}

/* Make room for n more bytes plus the NUL; false (and b->oom) on failure. */
static bool reserve(api_buf *b, size_t n)
{
    if (b->oom)
        return false;
    if (b->len + n + 1 <= b->cap)
        return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) {
        if (cap > SIZE_MAX / 2) {
            b->oom = true;
            return false;
        }
        cap *= 2;
    }
    char *p = realloc(b->data, cap);
    if (!p) {
        b->oom = true;
        return false;
    }
    b->data = p;
    b->cap = cap;
    return true;
}

void api_buf_put(api_buf *b, const char *s, size_t n)
{
    if (!reserve(b, n))
        return;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void api_buf_puts(api_buf *b, const char *s)
{
    api_buf_put(b, s, strlen(s));
}

void api_buf_putc(api_buf *b, char c)
{
    if (!reserve(b, 1))
        return;
    b->data[b->len++] = c;
    b->data[b->len] = '\0';
}

void api_buf_printf(api_buf *b, const char *fmt, ...)
{
    va_list ap;
    char small[256];
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n < sizeof(small)) {
        api_buf_put(b, small, (size_t)n);
        return;
    }
    if (!reserve(b, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* Caller frees the result with free(). */
char *api_buf_steal(api_buf *b, size_t *len)
{
    char *p;
    if (b->oom) {
        api_buf_free(b);
        *len = 0;
        return NULL;
    }
    if (!b->data && !reserve(b, 0)) {
        *len = 0;
        return NULL;
    }
    p = b->data;
    p[b->len] = '\0';
    *len = b->len;
    memset(b, 0, sizeof(*b));
    return p;
}

/* ---- JSON strings ---------------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s (n bytes available), or 0 if invalid. */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t len;
    unsigned cp;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

void api_buf_json_str(api_buf *b, const char *str)
{
    static const char hex[] = "0123456789abcdef";
    if (!str) {
        api_buf_put(b, "null", 4);
        return;
    }
    const unsigned char *s = (const unsigned char *)str;
    size_t n = strlen(str), i = 0, run = 0;
    api_buf_putc(b, '"');
    while (i < n) {
        unsigned c = s[i];
        size_t l = c >= 0x20 && c != '"' && c != '\\' ? utf8_len(s + i, n - i) : 0;
        if (l > 0) {
            i += l;
            run += l;
            continue;
        }
        api_buf_put(b, (const char *)s + i - run, run);
        run = 0;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            api_buf_put(b, e, 2);
        } else if (c == '\n') {
            api_buf_put(b, "\\n", 2);
        } else if (c == '\t') {
            api_buf_put(b, "\\t", 2);
        } else if (c == '\r') {
            api_buf_put(b, "\\r", 2);
        } else if (c < 0x20) {
            char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            api_buf_put(b, e, 6);
        } else {
            api_buf_put(b, "\\ufffd", 6); /* an invalid UTF-8 byte */
        }
        i++;
    }
    api_buf_put(b, (const char *)s + i - run, run);
    api_buf_putc(b, '"');
}

/* ---- numbers --------------------------------------------------------------------------- */

/* The shortest of %.9g and %.17g that reads back as v (v finite). integral_dot: write
 * integral values with a trailing ".0" (JSON reals, as jansson does). */
static void put_double(api_buf *b, double v, bool integral_dot)
{
    char s[40];
    int n;
    if (v == floor(v) && fabs(v) < 1e15) {
        n = snprintf(s, sizeof(s), integral_dot ? "%lld.0" : "%lld", (long long)v);
        if (v == 0 && signbit(v))
            n = snprintf(s, sizeof(s), integral_dot ? "-0.0" : "-0");
        api_buf_put(b, s, (size_t)n);
        return;
    }
    n = snprintf(s, sizeof(s), "%.9g", v);
    if (strtod(s, NULL) != v)
        n = snprintf(s, sizeof(s), "%.17g", v);
    api_buf_put(b, s, (size_t)n);
}

void api_buf_json_num(api_buf *b, double v)
{
    if (store_is_missing(v))
        api_buf_put(b, "null", 4);
    else if (isnan(v))
        api_buf_put(b, "\"NaN\"", 5);
    else if (isinf(v))
        api_buf_puts(b, v > 0 ? "\"Infinity\"" : "\"-Infinity\"");
    else
        put_double(b, v, true);
}

void api_buf_csv_num(api_buf *b, double v)
{
    if (store_is_missing(v))
        return;
    if (isnan(v))
        api_buf_put(b, "NaN", 3);
    else if (isinf(v))
        api_buf_puts(b, v > 0 ? "Inf" : "-Inf");
    else
        put_double(b, v, false);
}

void api_buf_prom_num(api_buf *b, double v)
{
    if (isnan(v))
        api_buf_put(b, "NaN", 3);
    else if (isinf(v))
        api_buf_puts(b, v > 0 ? "+Inf" : "-Inf");
    else
        put_double(b, v, false);
}

void api_buf_prom_label(api_buf *b, const char *str)
{
    const unsigned char *s = (const unsigned char *)(str ? str : "");
    size_t n = strlen((const char *)s);
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        if (c == '\\') {
            api_buf_put(b, "\\\\", 2);
        } else if (c == '"') {
            api_buf_put(b, "\\\"", 2);
        } else if (c == '\n') {
            api_buf_put(b, "\\n", 2);
        } else {
            size_t l = utf8_len(s + i, n - i);
            if (l == 0)
                api_buf_put(b, "\xef\xbf\xbd", 3); /* U+FFFD */
            else
                api_buf_put(b, (const char *)s + i, l);
            i += l ? l : 1;
            continue;
        }
        i++;
    }
}

void api_buf_json_time(api_buf *b, double t)
{
    char s[48];
    struct tm tm;
    if (!(t > 0) || !isfinite(t) || t > 253402300799.0) {
        api_buf_put(b, "null", 4);
        return;
    }
    time_t sec = (time_t)floor(t);
    int ms = (int)((t - (double)sec) * 1000.0);
    if (ms > 999)
        ms = 999;
    gmtime_r(&sec, &tm);
    size_t n = strftime(s, sizeof(s), "\"%Y-%m-%dT%H:%M:%S", &tm);
    n += (size_t)snprintf(s + n, sizeof(s) - n, ".%03dZ\"", ms);
    api_buf_put(b, s, n);
}

void api_buf_json_compact(api_buf *b, const char *text, size_t len)
{
    bool in_str = false, esc = false;
    size_t start = 0;
    if (!reserve(b, len))
        return;
    for (size_t i = 0; i < len; i++) {
        char c = text[i];
        if (in_str) {
            if (esc)
                esc = false;
            else if (c == '\\')
                esc = true;
            else if (c == '"')
                in_str = false;
            continue;
        }
        if (c == '"') {
            in_str = true;
        } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            api_buf_put(b, text + start, i - start);
            start = i + 1;
        }
    }
    api_buf_put(b, text + start, len - start);
}

/* ---- strict parsing -------------------------------------------------------------------- */

int api_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    bool neg = false;
    uint64_t v = 0, limit;
    if (!s || !*s)
        return -1;
    if (*s == '-') {
        neg = true;
        s++;
        if (!*s)
            return -1;
    }
    limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return -1;
        unsigned d = (unsigned)(*s - '0');
        if (v > (limit - d) / 10)
            return -1;
        v = v * 10 + d;
    }
    int64_t r = neg ? (v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v) : (int64_t)v;
    if (r < lo || r > hi)
        return -1;
    *out = r;
    return 0;
}

/* Next comma-separated item of *p into item (at most cap-1 bytes); false at the end.
 * *toolong is set when the item did not fit. */
static bool next_item(const char **p, char *item, size_t cap, bool *toolong)
{
    const char *s = *p, *e;
    if (!s)
        return false;
    e = strchr(s, ',');
    size_t n = e ? (size_t)(e - s) : strlen(s);
    *toolong = n >= cap;
    if (n >= cap)
        n = cap - 1;
    memcpy(item, s, n);
    item[n] = '\0';
    *p = e ? e + 1 : NULL;
    return true;
}

int api_parse_fields(const char *s, int *fields, int *n, char *err, size_t errlen)
{
    char item[64];
    bool toolong;
    const char *p = s;
    *n = 0;
    if (!s || !*s) {
        snprintf(err, errlen, "must list at least one metric");
        return -1;
    }
    while (next_item(&p, item, sizeof(item), &toolong)) {
        int f = toolong ? -1 : store_metric_parse(item);
        if (!item[0]) {
            snprintf(err, errlen, "empty metric name in the list");
            return -1;
        }
        if (f < 0) {
            snprintf(err, errlen, "unknown metric \"%s%s\"", item, toolong ? "..." : "");
            return -1;
        }
        for (int i = 0; i < *n; i++) {
            if (fields[i] == f) {
                snprintf(err, errlen, "metric \"%s\" listed twice", item);
                return -1;
            }
        }
        if (*n >= STORE_M_NFIELDS) {
            snprintf(err, errlen, "too many metrics");
            return -1;
        }
        fields[(*n)++] = f;
    }
    return 0;
}

int api_parse_ids(const char *s, int64_t *ids, int max, int *n, char *err, size_t errlen)
{
    char item[32];
    bool toolong;
    const char *p = s;
    *n = 0;
    if (!s || !*s) {
        snprintf(err, errlen, "must list at least one job id");
        return -1;
    }
    while (next_item(&p, item, sizeof(item), &toolong)) {
        int64_t id;
        if (toolong || api_parse_i64(item, 1, INT64_MAX, &id) != 0) {
            snprintf(err, errlen, "\"%s%s\" is not a job id (a positive integer)", item,
                     toolong ? "..." : "");
            return -1;
        }
        for (int i = 0; i < *n; i++) {
            if (ids[i] == id) {
                snprintf(err, errlen, "job %lld listed twice", (long long)id);
                return -1;
            }
        }
        if (*n >= max) {
            snprintf(err, errlen, "at most %d job ids", max);
            return -1;
        }
        ids[(*n)++] = id;
    }
    return 0;
}

int api_json_depth(const char *text, size_t len)
{
    int depth = 0, max = 0;
    bool in_str = false, esc = false;
    for (size_t i = 0; i < len; i++) {
        char c = text[i];
        if (in_str) {
            if (esc)
                esc = false;
            else if (c == '\\')
                esc = true;
            else if (c == '"')
                in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            if (++depth > max)
                max = depth;
        } else if (c == '}' || c == ']') {
            depth--;
        }
    }
    return max;
}

bool api_token_equal(const char *given, size_t given_len, const char *want)
{
    size_t wl = strlen(want);
    volatile unsigned char d = given_len != wl;
    for (size_t i = 0; i < wl; i++)
        d |= (unsigned char)want[i] ^ (unsigned char)(i < given_len ? given[i] : 0);
    return wl > 0 && d == 0;
}

/* ---- series ---------------------------------------------------------------------------- */

void api_series_begin(api_series_enc *e, api_buf *b, int64_t job)
{
    e->npoints = 0;
    if (e->csv) {
        if (e->raw) {
            api_buf_puts(b, e->lineage ? "job,step" : "step");
            for (int i = 0; i < e->nfields; i++)
                api_buf_printf(b, ",%s", store_metric_name(e->fields[i]));
        } else {
            api_buf_puts(b, "step,step_last,count,flags");
            for (int i = 0; i < e->nfields; i++) {
                const char *f = store_metric_name(e->fields[i]);
                api_buf_printf(b, ",%s_min,%s_max,%s_last", f, f, f);
            }
        }
        api_buf_putc(b, '\n');
        return;
    }
    api_buf_printf(b, "{\"job\":%lld,", (long long)job);
    if (e->lineage) {
        api_buf_puts(b, "\"lineage\":[");
        for (int i = 0; i < e->nlineage; i++)
            api_buf_printf(b, "%s%lld", i ? "," : "", (long long)e->ids[i]);
        api_buf_puts(b, "],");
    }
    api_buf_puts(b, "\"fields\":[");
    for (int i = 0; i < e->nfields; i++) {
        if (i)
            api_buf_putc(b, ',');
        api_buf_json_str(b, store_metric_name(e->fields[i]));
    }
    api_buf_puts(b, "],\"points\":[");
}

static void csv_point(api_series_enc *e, api_buf *b, const store_point *p)
{
    if (e->raw) {
        if (e->lineage)
            api_buf_printf(b, "%lld,", (long long)e->job);
        api_buf_printf(b, "%lld", (long long)p->step_first);
        for (int i = 0; i < e->nfields; i++) {
            api_buf_putc(b, ',');
            api_buf_csv_num(b, p->last[i]);
        }
    } else {
        api_buf_printf(b, "%lld,%lld,%lld,%u", (long long)p->step_first, (long long)p->step_last,
                       (long long)p->count, p->flags);
        for (int i = 0; i < e->nfields; i++) {
            api_buf_putc(b, ',');
            api_buf_csv_num(b, p->min[i]);
            api_buf_putc(b, ',');
            api_buf_csv_num(b, p->max[i]);
            api_buf_putc(b, ',');
            api_buf_csv_num(b, p->last[i]);
        }
    }
    api_buf_putc(b, '\n');
}

static void json_point(api_series_enc *e, api_buf *b, const store_point *p)
{
    if (e->npoints > 0)
        api_buf_putc(b, ',');
    api_buf_putc(b, '{');
    if (e->lineage)
        api_buf_printf(b, "\"job\":%lld,", (long long)e->job);
    api_buf_printf(b,
                   "\"step\":%lld,\"step_last\":%lld,\"count\":%lld,\"overflow\":%s,"
                   "\"skipped\":%s,\"nonfinite\":%s",
                   (long long)p->step_first, (long long)p->step_last, (long long)p->count,
                   p->flags & STORE_F_OVERFLOW ? "true" : "false",
                   p->flags & STORE_F_SKIPPED ? "true" : "false",
                   p->flags & STORE_F_NONFINITE ? "true" : "false");
    for (int i = 0; i < e->nfields; i++) {
        /* overflow and skipped are the point's flags of the same name (for a bucket: some
         * step in it overflowed / was skipped) */
        if (e->fields[i] == STORE_M_OVERFLOW || e->fields[i] == STORE_M_SKIPPED)
            continue;
        api_buf_putc(b, ',');
        api_buf_json_str(b, store_metric_name(e->fields[i]));
        api_buf_putc(b, ':');
        if (p->count == 1) {
            api_buf_json_num(b, p->last[i]);
        } else {
            api_buf_puts(b, "{\"min\":");
            api_buf_json_num(b, p->min[i]);
            api_buf_puts(b, ",\"max\":");
            api_buf_json_num(b, p->max[i]);
            api_buf_puts(b, ",\"last\":");
            api_buf_json_num(b, p->last[i]);
            api_buf_putc(b, '}');
        }
    }
    api_buf_putc(b, '}');
}

void api_series_points(api_series_enc *e, api_buf *b, const store_series *se, int from, int n)
{
    for (int i = from; i < from + n && i < se->npoints; i++) {
        if (e->csv)
            csv_point(e, b, &se->points[i]);
        else
            json_point(e, b, &se->points[i]);
        e->npoints++;
    }
}

void api_series_end(api_series_enc *e, api_buf *b, int64_t total_steps)
{
    if (!e->csv)
        api_buf_printf(b, "],\"total_steps\":%lld}", (long long)total_steps);
}
