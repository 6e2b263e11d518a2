/*
 * opts.c - a command's option table (opts.h) read two ways: into getopt_long's tables to
 * parse argv, and into the usage text. The usage line either says [OPTIONS] or lists every
 * option as [--name ARG] (wrapped at USAGE_WIDTH, under the first), then the command's own
 * lines, then a line per option: "  --name ARG" padded to the command's column, its help
 * with each further line indented to that column and its "%s" replaced by the default.
 *
 * Invariants: a table has at most MAX_OPTS options; an option's value goes only where its
 * off says (or through its set), and the defaults are in place before any option is read.
 *
 * Threads: the main thread at start-up (getopt's state is global).
 */
#include <errno.h>
#include <getopt.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "daemon/opts.h"

#define MAX_OPTS 32
#define USAGE_WIDTH 80

/* See opts.h. */
int daemon_opts_copy(const char *cmd, const char *opt, const char *v, char *out, size_t len)
{
    if (strlen(v) >= len || !v[0]) {
        fprintf(stderr, "ampd %s: %s: %s\n", cmd, opt, v[0] ? "too long" : "empty");
        return -1;
    }
    memcpy(out, v, strlen(v) + 1);
    return 0;
}

/* A whole number in [lo, hi], or -1 with a message. */
static int int_arg(const char *cmd, const char *opt, const char *v, int lo, int hi, int *out)
{
    char *end;
    long x;
    errno = 0;
    x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "ampd %s: %s must be an integer in [%d, %d]\n", cmd, opt, lo, hi);
        return -1;
    }
    *out = (int)x;
    return 0;
}

/* See opts.h. */
void daemon_opts_show_roots(char *out, size_t len)
{
    api_spec_opts d;
    size_t used = 0;
    api_spec_opts_default(&d);
    out[0] = '\0';
    for (int i = 0; i < d.nroots && used < len; i++)
        used += (size_t)snprintf(out + used, len - used, "%s%s", i ? " and " : "", d.roots[i]);
}

static void set_defaults(const daemon_opts_cmd *c, void *args)
{
    for (int i = 0; i < c->nopts; i++) {
        const daemon_opt *o = &c->opts[i];
        char *at = (char *)args + o->off;
        if (o->kind == DAEMON_OPT_INT)
            *(int *)at = o->def;
        else if ((o->kind == DAEMON_OPT_STR || o->kind == DAEMON_OPT_CHOICE) && o->def_str)
            snprintf(at, o->len, "%s", o->def_str);
    }
}

/* getopt_long's tables: an option with a short name returns it, the others 256 + index. */
static void getopt_tables(const daemon_opts_cmd *c, struct option *longopts, char *shorts)
{
    int k = 0;
    for (int i = 0; i < c->nopts; i++) {
        const daemon_opt *o = &c->opts[i];
        longopts[i] = (struct option){o->name, o->arg ? required_argument : no_argument, NULL,
                                      o->short_name ? o->short_name : 256 + i};
        if (o->short_name) {
            shorts[k++] = o->short_name;
            if (o->arg)
                shorts[k++] = ':';
        }
    }
    longopts[c->nopts] = (struct option){NULL, 0, NULL, 0};
    shorts[k] = '\0';
}

/* One option's value into args: DAEMON_OPTS_OK, _HELP, _VERSION or _BAD. */
static int apply(const daemon_opts_cmd *c, const daemon_opt *o, void *args, const char *v)
{
    char *at = (char *)args + o->off, opt[64];
    snprintf(opt, sizeof(opt), "--%s", o->name);
    switch (o->kind) {
    case DAEMON_OPT_FLAG:
        *(bool *)at = true;
        return DAEMON_OPTS_OK;
    case DAEMON_OPT_PTR:
        *(const char **)at = v;
        return DAEMON_OPTS_OK;
    case DAEMON_OPT_STR:
        return daemon_opts_copy(c->name, opt, v, at, o->len) ? DAEMON_OPTS_BAD : DAEMON_OPTS_OK;
    case DAEMON_OPT_INT:
        if (o->set)
            return o->set(args, v) ? DAEMON_OPTS_BAD : DAEMON_OPTS_OK;
        return int_arg(c->name, opt, v, o->lo, o->hi, (int *)at) ? DAEMON_OPTS_BAD : DAEMON_OPTS_OK;
    case DAEMON_OPT_CALL:
        return o->set(args, v) ? DAEMON_OPTS_BAD : DAEMON_OPTS_OK;
    case DAEMON_OPT_CHOICE:
        for (int i = 0; o->choices[i]; i++)
            if (strcmp(v, o->choices[i]) == 0)
                return daemon_opts_copy(c->name, opt, v, at, o->len) ? DAEMON_OPTS_BAD
                                                                     : DAEMON_OPTS_OK;
        fprintf(stderr, "ampd %s: %s takes %s, not '%s'\n", c->name, opt, o->arg, v);
        return DAEMON_OPTS_BAD;
    case DAEMON_OPT_HELP:
        return DAEMON_OPTS_HELP;
    case DAEMON_OPT_VERSION:
        return DAEMON_OPTS_VERSION;
    }
    return DAEMON_OPTS_BAD;
}

/* See opts.h. */
int daemon_opts_parse(const daemon_opts_cmd *c, int argc, char **argv, void *args, int *first)
{
    struct option longopts[MAX_OPTS + 1];
    char shorts[2 * MAX_OPTS + 1];
    int ch, rc = DAEMON_OPTS_OK;

    *first = argc;
    if (c->nopts > MAX_OPTS)
        return DAEMON_OPTS_BAD;
    set_defaults(c, args);
    getopt_tables(c, longopts, shorts);
    optind = 1;
    while (rc == DAEMON_OPTS_OK && (ch = getopt_long(argc, argv, shorts, longopts, NULL)) != -1) {
        const daemon_opt *o = NULL;
        for (int i = 0; i < c->nopts && !o; i++)
            if (ch == (c->opts[i].short_name ? c->opts[i].short_name : 256 + i))
                o = &c->opts[i];
        rc = o ? apply(c, o, args, optarg) : DAEMON_OPTS_UNKNOWN;
    }
    *first = optind;
    return rc;
}

/* w on the usage line after used columns, or on a new one indented by indent; returns the
 * columns used. */
static int put_word(FILE *f, const char *w, int used, int indent)
{
    int n = (int)strlen(w);
    if (used + 1 + n > USAGE_WIDTH) {
        fprintf(f, "\n%*s%s", indent, "", w);
        return indent + n;
    }
    fprintf(f, " %s", w);
    return used + 1 + n;
}

static void usage_line(FILE *f, const daemon_opts_cmd *c)
{
    char word[160];
    int used = fprintf(f, "usage: ampd %s", c->name), indent = used + 1;
    if (!c->list_options)
        used = put_word(f, "[OPTIONS]", used, indent);
    for (int i = 0; c->list_options && i < c->nopts; i++) {
        const daemon_opt *o = &c->opts[i];
        if (!o->help || !o->help[0])
            continue;
        snprintf(word, sizeof(word), "[--%s%s%s]%s", o->name, o->arg ? " " : "",
                 o->arg ? o->arg : "", o->repeat ? "..." : "");
        used = put_word(f, word, used, indent);
    }
    if (c->operands)
        put_word(f, c->operands, used, indent);
    fputc('\n', f);
}

/* o's help: its "%s" replaced by the default shown, each further line indented to col. */
static void put_help(FILE *f, const daemon_opt *o, int col)
{
    char shown[256] = "";
    if (o->show)
        o->show(shown, sizeof(shown));
    else if (o->kind == DAEMON_OPT_INT)
        snprintf(shown, sizeof(shown), "%d", o->def);
    else if (o->def_str)
        snprintf(shown, sizeof(shown), "%s", o->def_str);
    for (const char *p = o->help; *p; p++) {
        if (p[0] == '%' && p[1] == 's') {
            fputs(shown, f);
            p++;
            continue;
        }
        fputc(*p, f);
        if (*p == '\n')
            fprintf(f, "%*s", col, "");
    }
    fputc('\n', f);
}

/* See opts.h. */
void daemon_opts_usage(FILE *f, const daemon_opts_cmd *c)
{
    char head[160];
    int named = 0;
    usage_line(f, c);
    fputs(c->about, f);
    for (int i = 0; i < c->nopts; i++) {
        const daemon_opt *o = &c->opts[i];
        if (!o->help || !o->help[0])
            continue;
        snprintf(head, sizeof(head), "--%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
        fprintf(f, "  %-*s  ", c->col - 4, head);
        put_help(f, o, c->col);
    }
    for (int i = 0; i < c->nopts; i++) /* the options listed by name only */
        if (c->opts[i].help && !c->opts[i].help[0])
            fprintf(f, "%s--%s", named++ ? ", " : "  ", c->opts[i].name);
    if (named)
        fputc('\n', f);
}

/* ---- the launcher's options ------------------------------------------------------------- */

const char *const daemon_launchers[] = {"mpirun", "slurm", NULL};

/* See opts.h. */
void daemon_launch_apply(const daemon_launch_opts *o, gpu_dist_config *d)
{
    gpu_slurm_config *sl = &d->slurm;
    if (d->launcher == GPU_LAUNCH_DEFAULT)
        d->launcher = d->world_size > 1 && d->nhosts == 0 && strcmp(o->launcher, "slurm") == 0
                          ? GPU_LAUNCH_SLURM
                          : GPU_LAUNCH_MPIRUN;
    if (!sl->partition[0])
        snprintf(sl->partition, sizeof(sl->partition), "%s", o->partition);
    if (!sl->account[0])
        snprintf(sl->account, sizeof(sl->account), "%s", o->account);
    if (!sl->time[0])
        snprintf(sl->time, sizeof(sl->time), "%s", o->time);
}

/* See opts.h. */
int daemon_launch_argv(const daemon_launch_opts *o, char **argv)
{
    const char *pairs[][2] = {{"--launcher", o->launcher},
                              {"--slurm-partition", o->partition},
                              {"--slurm-account", o->account},
                              {"--slurm-time", o->time}};
    int k = 0;
    for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++)
        if (pairs[i][1][0]) {
            argv[k++] = (char *)pairs[i][0];
            argv[k++] = (char *)pairs[i][1];
        }
    return k;
}
