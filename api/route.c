/*
 * route.c - the route table (API_ROUTES in api_int.h) and what is generated from it: the
 * path matcher, the methods each route allows and the handler of each (route, method).
 *
 * A path matches a pattern when it has as many '/'-separated segments and every literal
 * segment is equal; a "{id}" segment takes a job id (a positive decimal without leading
 * zeros) and "{step}" a checkpoint step (the same, 0 allowed); a segment that is not one
 * still matches, with -1 as its value, so that the handler answers 404 for it rather than
 * the router.
 *
 * Threads: reentrant; the table is constant.
 */
#include <stdio.h>
#include <string.h>

#include "api/api_int.h"

#define GET_ONLY (API_M_GET | API_M_HEAD)
#define MAX_SEGMENTS 8

typedef struct {
    const char *pattern;
    api_handler get, post, del;
} route_row;

#define API_ROW_(id, pattern, get, post, del) [API_R_##id] = {pattern, get, post, del},
static const route_row routes[] = {API_ROUTES(API_ROW_)};
#undef API_ROW_
#define NROUTES ((int)(sizeof(routes) / sizeof(routes[0])))

/* A decimal id segment of length n, or -1. */
static int64_t segment_id(const char *s, size_t n, int64_t lo)
{
    char tmp[24];
    int64_t v;
    if (n == 0 || n >= sizeof(tmp))
        return -1;
    memcpy(tmp, s, n);
    tmp[n] = '\0';
    if (tmp[0] == '-' || (tmp[0] == '0' && n > 1))
        return -1;
    return api_parse_i64(tmp, lo, INT64_MAX, &v) == 0 ? v : -1;
}

typedef struct {
    const char *at[MAX_SEGMENTS];
    size_t len[MAX_SEGMENTS];
    int n;
} segments;

/* Split path[0..n) (starting with '/') into segments; false when there are too many. */
static bool split(const char *path, size_t n, segments *sg)
{
    const char *p = path + 1, *end = path + n;
    sg->n = 0;
    for (;;) {
        const char *slash = memchr(p, '/', (size_t)(end - p));
        const char *e = slash ? slash : end;
        if (sg->n == MAX_SEGMENTS)
            return false;
        sg->at[sg->n] = p;
        sg->len[sg->n++] = (size_t)(e - p);
        if (!slash)
            return true;
        p = slash + 1;
    }
}

/* Whether sg matches pattern; fills the {id} and {step} values of out. */
static bool match(const char *pattern, const segments *sg, api_route *out)
{
    segments pt;
    if (!split(pattern, strlen(pattern), &pt) || pt.n != sg->n)
        return false;
    for (int i = 0; i < pt.n; i++) {
        if (pt.len[i] == 4 && memcmp(pt.at[i], "{id}", 4) == 0)
            out->job = segment_id(sg->at[i], sg->len[i], 1);
        else if (pt.len[i] == 6 && memcmp(pt.at[i], "{step}", 6) == 0)
            out->step = segment_id(sg->at[i], sg->len[i], 0);
        else if (pt.len[i] != sg->len[i] || memcmp(pt.at[i], sg->at[i], pt.len[i]) != 0)
            return false;
    }
    return true;
}

static unsigned allowed(const route_row *r)
{
    return (r->get ? GET_ONLY : 0u) | (r->post ? API_M_POST : 0u) | (r->del ? API_M_DELETE : 0u);
}

int api_route_match(const char *path, bool static_files, api_route *out)
{
    size_t n = path ? strlen(path) : 0;
    segments sg;

    memset(out, 0, sizeof(*out));
    if (n == 0 || path[0] != '/')
        return -1;
    if (n > 1 && path[n - 1] == '/')
        n--; /* one trailing slash is tolerated */
    if (split(path, n, &sg)) {
        for (int id = 1; id < NROUTES; id++) {
            out->job = out->step = -1;
            if (match(routes[id].pattern, &sg, out)) {
                out->id = (api_route_id)id;
                out->allow = allowed(&routes[id]);
                return 0;
            }
        }
    }
    out->job = out->step = -1;
    if (static_files && strncmp(path, "/v1/", 4) != 0 && strcmp(path, "/v1") != 0) {
        out->id = API_R_STATIC;
        out->allow = GET_ONLY;
        return 0;
    }
    return -1;
}

api_handler api_route_handler(api_route_id id, unsigned method)
{
    if ((int)id <= API_R_NONE || (int)id >= NROUTES)
        return NULL;
    if (method & GET_ONLY)
        return routes[id].get;
    if (method == API_M_POST)
        return routes[id].post;
    if (method == API_M_DELETE)
        return routes[id].del;
    return NULL;
}

void api_allow_string(unsigned allow, char *buf, size_t len)
{
    static const struct {
        unsigned bit;
        const char *name;
    } m[] = {
        {API_M_GET, "GET"}, {API_M_HEAD, "HEAD"}, {API_M_POST, "POST"}, {API_M_DELETE, "DELETE"}};
    size_t off = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++) {
        if (!(allow & m[i].bit))
            continue;
        int w = snprintf(buf + off, len - off, "%s%s", off ? ", " : "", m[i].name);
        if (w < 0 || (size_t)w >= len - off)
            break;
        off += (size_t)w;
    }
}

unsigned api_method_bit(const char *method)
{
    if (strcmp(method, "GET") == 0)
        return API_M_GET;
    if (strcmp(method, "HEAD") == 0)
        return API_M_HEAD;
    if (strcmp(method, "POST") == 0)
        return API_M_POST;
    if (strcmp(method, "DELETE") == 0)
        return API_M_DELETE;
    return 0;
}
