/*
 * conn.c - what the server keeps per connection, for the two limits libmicrohttpd does not
 * have in the form the daemon needs:
 *
 *   the request-head deadline: a connection must deliver a complete request head (request
 *   line and headers) within head_timeout_ms of opening, or of the end of its previous
 *   request (keep-alive). libmicrohttpd's own timeout restarts with every byte, so a client
 *   that trickles a byte now and then would hold its connection for ever; this deadline
 *   does not move. Connections awaiting a head sit in a list in the order they began to
 *   wait (every wait has the same length, so that is deadline order); the watcher thread
 *   (server.c) calls api_conn_sweep(), which shuts down the overdue ones from the front.
 *
 *   the per-address limit: connections from one address beyond loopback (an IPv6 /64
 *   counting as one address) are counted, and the accept policy refuses one more than
 *   max_per_addr. Loopback is exempt: local tools and the tests come from there, and a
 *   local user can do worse than open sockets.
 *
 * Closing safely: the sweeper never closes a descriptor libmicrohttpd owns. It calls
 * shutdown(2) on it, which ends the TCP connection at once (the client reads EOF) and
 * makes the socket readable at end of file; libmicrohttpd's thread then sees the end,
 * closes the connection and tells api_conn_close(). It does so before it closes the
 * descriptor, and api_conn_close() takes conn_mu, so a descriptor the sweeper shuts down
 * under conn_mu is still the connection's own (never a reused number).
 *
 * Counting: the policy only reads the count; api_conn_open() (libmicrohttpd's "connection
 * started" notice) adds and api_conn_close() removes, so a connection libmicrohttpd fails
 * to set up after the policy let it in is never counted and cannot leak. Pool threads that
 * accept at the same moment may each pass the check, so an address can exceed the limit by
 * at most the pool's size minus one.
 *
 * Threads: every function here may be called from any thread; those that take an
 * api_server take its conn_mu (and nothing else while holding it). The api_peers functions
 * themselves are not locked: the caller holds conn_mu.
 */
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "api/api_int.h"

struct api_peer {
    api_peer *next;
    api_addr addr;
    unsigned n;
};

/* ---- addresses ------------------------------------------------------------------------- */

bool api_addr_of(const struct sockaddr *sa, socklen_t len, api_addr *out)
{
    const unsigned char *v4 = NULL;
    memset(out, 0, sizeof(*out));
    if (!sa)
        return false;
    if (sa->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        v4 = (const unsigned char *)&((const struct sockaddr_in *)sa)->sin_addr;
    } else if (sa->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a))
            return false;
        if (IN6_IS_ADDR_V4MAPPED(a))
            v4 = a->s6_addr + 12;
        else
            memcpy(out->b, a->s6_addr, 8); /* the /64 */
    } else {
        return false;
    }
    if (v4) { /* ::ffff:a.b.c.d */
        if (v4[0] == 127)
            return false;
        out->b[10] = 0xff;
        out->b[11] = 0xff;
        memcpy(out->b + 12, v4, 4);
    }
    return true;
}

/* ---- counts per address ---------------------------------------------------------------- */

static unsigned bucket_of(const api_addr *a)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < sizeof(a->b); i++) {
        h ^= a->b[i];
        h *= 16777619u;
    }
    return h % API_PEER_BUCKETS;
}

static api_peer **find(api_peers *p, const api_addr *a)
{
    api_peer **at = &p->bucket[bucket_of(a)];
    while (*at && memcmp(&(*at)->addr, a, sizeof(*a)) != 0)
        at = &(*at)->next;
    return at;
}

unsigned api_peers_count(const api_peers *p, const api_addr *a)
{
    const api_peer *e = p->bucket[bucket_of(a)];
    while (e && memcmp(&e->addr, a, sizeof(*a)) != 0)
        e = e->next;
    return e ? e->n : 0;
}

int api_peers_add(api_peers *p, const api_addr *a)
{
    api_peer **at = find(p, a);
    if (!*at) {
        api_peer *e = calloc(1, sizeof(*e));
        if (!e)
            return GPU_ENOMEM;
        e->addr = *a;
        *at = e;
        p->naddrs++;
    }
    (*at)->n++;
    return 0;
}

void api_peers_del(api_peers *p, const api_addr *a)
{
    api_peer **at = find(p, a);
    api_peer *e = *at;
    if (!e)
        return;
    if (--e->n == 0) {
        *at = e->next;
        free(e);
        p->naddrs--;
    }
}

void api_peers_free(api_peers *p)
{
    if (!p)
        return;
    for (int i = 0; i < API_PEER_BUCKETS; i++) {
        while (p->bucket[i]) {
            api_peer *e = p->bucket[i];
            p->bucket[i] = e->next;
            free(e);
        }
    }
    p->naddrs = 0;
}

/* ---- the head list (conn_mu held) -------------------------------------------------------- */

static void unlink_head(api_server *s, api_conn *c)
{
    if (!c->waiting)
        return;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->heads = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        s->heads_last = c->prev;
    c->prev = c->next = NULL;
    c->waiting = false;
}

static void append_head(api_server *s, api_conn *c, int64_t now_ms)
{
    unlink_head(s, c);
    c->since_ms = now_ms;
    c->prev = s->heads_last;
    c->next = NULL;
    if (s->heads_last)
        s->heads_last->next = c;
    else
        s->heads = c;
    s->heads_last = c;
    c->waiting = true;
}

/* ---- the hooks --------------------------------------------------------------------------- */

bool api_conn_admit(api_server *s, const struct sockaddr *sa, socklen_t len)
{
    api_addr a;
    bool ok;
    if (!api_addr_of(sa, len, &a))
        return true;
    pthread_mutex_lock(&s->conn_mu);
    ok = api_peers_count(&s->peers, &a) < s->max_per_addr;
    pthread_mutex_unlock(&s->conn_mu);
    if (!ok)
        atomic_fetch_add(&s->refused, 1);
    return ok;
}

int api_conn_open(api_server *s, int fd, const struct sockaddr *sa, socklen_t len, api_conn **out)
{
    api_conn *c = calloc(1, sizeof(*c));
    int rc = 0;

    *out = NULL;
    if (!c)
        return GPU_ENOMEM;
    c->fd = fd;
    c->counted = api_addr_of(sa, len, &c->addr);
    pthread_mutex_lock(&s->conn_mu);
    if (c->counted && (rc = api_peers_add(&s->peers, &c->addr)) != 0)
        goto fail;
    append_head(s, c, api_now_ms());
    pthread_mutex_unlock(&s->conn_mu);
    *out = c;
    return 0;
fail:
    pthread_mutex_unlock(&s->conn_mu);
    free(c);
    return rc;
}

void api_conn_head_done(api_server *s, api_conn *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&s->conn_mu);
    unlink_head(s, c);
    pthread_mutex_unlock(&s->conn_mu);
}

void api_conn_head_wait(api_server *s, api_conn *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&s->conn_mu);
    append_head(s, c, api_now_ms());
    pthread_mutex_unlock(&s->conn_mu);
}

void api_conn_close(api_server *s, api_conn *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&s->conn_mu);
    unlink_head(s, c);
    if (c->counted)
        api_peers_del(&s->peers, &c->addr);
    pthread_mutex_unlock(&s->conn_mu);
    free(c);
}

void api_conn_sweep(api_server *s, int64_t now_ms, int *closed, int64_t *next_ms)
{
    int n = 0;
    pthread_mutex_lock(&s->conn_mu);
    while (s->heads && s->heads->since_ms + s->head_timeout_ms <= now_ms) {
        api_conn *c = s->heads;
        unlink_head(s, c); /* libmicrohttpd closes it now; api_conn_close frees it */
        if (c->fd >= 0 && shutdown(c->fd, SHUT_RDWR) != 0 && errno != ENOTCONN)
            log_warn("shutdown of connection %d: %s", c->fd, strerror(errno));
        n++;
    }
    if (s->heads && s->heads->since_ms + s->head_timeout_ms < *next_ms)
        *next_ms = s->heads->since_ms + s->head_timeout_ms;
    pthread_mutex_unlock(&s->conn_mu);
    *closed = n;
}
