/*
 * torchref.h - reads tests/data/torch_optim.txt, what torch.optim (AdamW, SGD) and PyTorch's
 * loss-scale rule produced on fixed inputs (tests/data/torch_optim.py says how it was made
 * and what each line holds), and rebuilds the inputs: the gradient of step t and the start
 * values. Header-only (static functions), included by check_optim.c and check_scaler.c.
 *
 * Invariants: values are float32 bit patterns, compared bit for bit by the suites.
 * Threads: none shared; each test process loads its own copy.
 */
#ifndef AMPD_TORCHREF_H
#define AMPD_TORCHREF_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TORCHREF_MAX 8
#define TORCHREF_REPORTS 16

typedef struct {
    char name[32];
    double lr, beta1, beta2, eps, wd, momentum;
    int n, steps, nreport;
    int report_step[TORCHREF_REPORTS];
    uint32_t *p[TORCHREF_REPORTS];  /* the parameter after report_step[k] */
    uint32_t *m, *v, *buf;          /* the state after the last step (NULL when absent) */
} torchref_optim;

typedef struct {
    double init, growth, backoff;
    int interval, steps;
    int *found_inf, *tracker;       /* per step, 0-based index = step - 1 */
    uint32_t *scale;
} torchref_scaler;

typedef struct {
    int noptim, nscaler;
    torchref_optim optim[TORCHREF_MAX];
    torchref_scaler scaler[TORCHREF_MAX];
} torchref;

/* The fixture's gradient of element i at step t (1-based), in float32 arithmetic. */
static inline float torchref_grad(int i, int t)
{
    static const float mag[4] = {1.0f, 1e-3f, 1e-6f, 30.0f};
    uint64_t h = ((uint64_t)i * 2654435761u + (uint64_t)t * 40503u + 12345u) % 2001u;
    return (float)((int)h - 1000) / 1000.0f * mag[i % 4];
}

static inline float torchref_p0(int i)
{
    return (float)i / 100.0f - 1.5f;
}

static inline float torchref_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* n hex words from the rest of a line into a new array; NULL on a short line. */
static inline uint32_t *torchref_words(char *s, int n)
{
    uint32_t *w = malloc((size_t)n * sizeof(*w));
    for (int i = 0; w && i < n; i++) {
        char *end;
        w[i] = (uint32_t)strtoul(s, &end, 16);
        if (end == s) {
            free(w);
            return NULL;
        }
        s = end;
    }
    return w;
}

static inline int torchref_optim_line(torchref_optim *o, char *line)
{
    char kind[8];
    int step, used;
    if (sscanf(line, "%7s %d %n", kind, &step, &used) != 2)
        return -1;
    uint32_t *w = torchref_words(line + used, o->n);
    if (!w)
        return -1;
    if (strcmp(kind, "p") == 0 && o->nreport < TORCHREF_REPORTS) {
        o->report_step[o->nreport] = step;
        o->p[o->nreport++] = w;
        return 0;
    }
    uint32_t **slot = strcmp(kind, "m") == 0 ? &o->m : strcmp(kind, "v") == 0 ? &o->v
                    : strcmp(kind, "buf") == 0 ? &o->buf : NULL;
    if (!slot || *slot) {
        free(w);
        return -1;
    }
    *slot = w;
    return 0;
}

static inline int torchref_scaler_line(torchref_scaler *s, const char *line)
{
    int step, inf, tracker;
    unsigned scale;
    if (sscanf(line, "s %d %d %x %d", &step, &inf, &scale, &tracker) != 4 || step < 1 ||
        step > s->steps)
        return -1;
    s->found_inf[step - 1] = inf;
    s->scale[step - 1] = scale;
    s->tracker[step - 1] = tracker;
    return 0;
}

static inline int torchref_header(torchref *r, const char *line, torchref_optim **o,
                                  torchref_scaler **s)
{
    if (strncmp(line, "case ", 5) == 0 && r->noptim < TORCHREF_MAX) {
        *o = &r->optim[r->noptim++];
        return sscanf(line,
                      "case %31s lr %lf beta1 %lf beta2 %lf eps %lf wd %lf momentum %lf n %d "
                      "steps %d",
                      (*o)->name, &(*o)->lr, &(*o)->beta1, &(*o)->beta2, &(*o)->eps, &(*o)->wd,
                      &(*o)->momentum, &(*o)->n, &(*o)->steps) == 9 ? 0 : -1;
    }
    if (strncmp(line, "scaler ", 7) == 0 && r->nscaler < TORCHREF_MAX) {
        *s = &r->scaler[r->nscaler++];
        if (sscanf(line, "scaler init %lf growth %lf backoff %lf interval %d steps %d",
                   &(*s)->init, &(*s)->growth, &(*s)->backoff, &(*s)->interval,
                   &(*s)->steps) != 5 || (*s)->steps < 1)
            return -1;
        (*s)->found_inf = calloc((size_t)(*s)->steps, sizeof(int));
        (*s)->tracker = calloc((size_t)(*s)->steps, sizeof(int));
        (*s)->scale = calloc((size_t)(*s)->steps, sizeof(uint32_t));
        return (*s)->found_inf && (*s)->tracker && (*s)->scale ? 0 : -1;
    }
    return -1;
}

static inline void torchref_free(torchref *r)
{
    for (int i = 0; i < r->noptim; i++) {
        for (int k = 0; k < r->optim[i].nreport; k++)
            free(r->optim[i].p[k]);
        free(r->optim[i].m);
        free(r->optim[i].v);
        free(r->optim[i].buf);
    }
    for (int i = 0; i < r->nscaler; i++) {
        free(r->scaler[i].found_inf);
        free(r->scaler[i].tracker);
        free(r->scaler[i].scale);
    }
    memset(r, 0, sizeof(*r));
}

/* Loads $srcdir/tests/data/torch_optim.txt into *r (zeroed first): 0, or -1 with the
 * offending line number in *bad_line (0: the file could not be opened). */
static inline int torchref_load(torchref *r, int *bad_line)
{
    const char *src = getenv("srcdir");
    char path[4096], *line = NULL;
    size_t cap = 0;
    int lineno = 0, rc = 0;
    torchref_optim *o = NULL;
    torchref_scaler *s = NULL;

    memset(r, 0, sizeof(*r));
    *bad_line = 0;
    snprintf(path, sizeof(path), "%s/tests/data/torch_optim.txt", src ? src : ".");
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    while (rc == 0 && getline(&line, &cap, f) > 0) {
        lineno++;
        if (line[0] == '#' || line[0] == '\n')
            continue;
        if (strncmp(line, "end", 3) == 0)
            o = NULL, s = NULL;
        else if (o)
            rc = torchref_optim_line(o, line);
        else if (s)
            rc = torchref_scaler_line(s, line);
        else
            rc = torchref_header(r, line, &o, &s);
    }
    free(line);
    fclose(f);
    if (rc == 0 && (r->noptim == 0 || r->nscaler == 0))
        rc = -1;
    if (rc) {
        *bad_line = lineno;
        torchref_free(r);
    }
    return rc;
}

#endif /* AMPD_TORCHREF_H */
