/*
 * opts.h - internal header of daemon/: a command's options as one table (opts.c), which
 * both the parser (getopt_long) and the help text read, so that an option, the name of its
 * argument, its default and its help are written once (`ampd serve` in serve.c, `ampd run`
 * in run.c).
 *
 * Errors: daemon_opts_parse returns DAEMON_OPTS_OK, DAEMON_OPTS_HELP or DAEMON_OPTS_VERSION
 * (the option was given), or a negative code after a message on stderr.
 *
 * Threads: the main thread at start-up (getopt's state is global).
 */
#ifndef AMPD_DAEMON_OPTS_H
#define AMPD_DAEMON_OPTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "gpu/gpu.h"

typedef enum {
    DAEMON_OPT_FLAG,    /* no argument: the bool at off becomes true */
    DAEMON_OPT_STR,     /* a non-empty string copied into the char[len] at off */
    DAEMON_OPT_PTR,     /* the argument itself in the const char * at off */
    DAEMON_OPT_INT,     /* a whole number in [lo, hi] in the int at off (default def) */
    DAEMON_OPT_CALL,    /* the argument handed to set */
    DAEMON_OPT_CHOICE,  /* one of choices, copied into the char[len] at off */
    DAEMON_OPT_HELP,    /* --help: the parse stops with DAEMON_OPTS_HELP */
    DAEMON_OPT_VERSION, /* --version: the parse stops with DAEMON_OPTS_VERSION */
} daemon_opt_kind;

typedef struct {
    const char *name; /* the long option, without "--" */
    char short_name;  /* also -X; 0: none */
    const char *arg;  /* the argument's name in the help; NULL: it takes none */
    daemon_opt_kind kind;
    size_t off, len;     /* where in the command's argument struct (offsetof), a string's size */
    int lo, hi, def;     /* DAEMON_OPT_INT: the range and the default */
    const char *def_str; /* DAEMON_OPT_STR: the default (NULL: empty) */
    bool repeat;         /* may be given again (shown as "[--name ARG]...") */
    const char *const *choices; /* DAEMON_OPT_CHOICE: the values taken, NULL-terminated */
    /* The argument's own parser (DAEMON_OPT_CALL, or DAEMON_OPT_INT to replace the range
     * check): 0, or -1 after a message on stderr. */
    int (*set)(void *args, const char *v);
    /* The help, lines separated by '\n'; a "%s" in it shows the default: def, def_str, or
     * what show writes. "": listed by name only, on the help's last line; NULL: not listed. */
    const char *help;
    void (*show)(char *out, size_t len);
} daemon_opt;

typedef struct {
    const char *name; /* "serve": the command, as messages name it */
    const daemon_opt *opts;
    int nopts;
    bool list_options;    /* the usage line lists the options, else "[OPTIONS]" */
    const char *operands; /* after the options on the usage line ("JOB.json|-"); NULL: none */
    const char *about;    /* the lines under the usage line */
    int col;              /* the column of the options' help */
} daemon_opts_cmd;

enum {
    DAEMON_OPTS_OK = 0,
    DAEMON_OPTS_HELP = 1,
    DAEMON_OPTS_VERSION = 2,
    DAEMON_OPTS_BAD = -1,     /* an option's value was refused */
    DAEMON_OPTS_UNKNOWN = -2, /* getopt refused an option (unknown, or its argument missing) */
};

/* The defaults into args, then argv's options (getopt_long, from argv[1]); stops at the
 * first that is refused or asks for help or the version. *first gets the index of the first
 * operand. */
int daemon_opts_parse(const daemon_opts_cmd *c, int argc, char **argv, void *args, int *first);
/* The usage line, c->about and every option's help. */
void daemon_opts_usage(FILE *f, const daemon_opts_cmd *c);
/* v copied into out (len bytes), or -1 with a message when it is empty or does not fit. */
int daemon_opts_copy(const char *cmd, const char *opt, const char *v, char *out, size_t len);
/* The default data roots (api_spec_opts_default) as "A and B", for a help's "%s". */
void daemon_opts_show_roots(char *out, size_t len);

/* Who launches a data-parallel job's ranks, and what srun asks Slurm for, where the job's
 * spec leaves it open: `ampd serve` and `ampd run` take the same options (DAEMON_LAUNCH_OPTS)
 * and the daemon hands its own to every worker (daemon_launch_argv). */
typedef struct {
    char launcher[8]; /* "mpirun" (the default) or "slurm" */
    char partition[64], account[64], time[32];
} daemon_launch_opts;

/* The option table's rows of a daemon_launch_opts member `field` of the argument struct
 * `type`: --launcher, --slurm-partition, --slurm-account, --slurm-time. */
#define DAEMON_LAUNCH_OPTS(type, field)                                                            \
    {"launcher", 0, "mpirun|slurm", .kind = DAEMON_OPT_CHOICE, .choices = daemon_launchers,       \
     .off = offsetof(type, field.launcher), .len = sizeof(((type *)0)->field.launcher),           \
     .def_str = "mpirun",                                                                          \
     .help = "who starts a data-parallel job's ranks when its spec\ndoes not say "                 \
             "(distributed.launcher; default mpirun)"},                                            \
        {"slurm-partition", 0, "NAME", .kind = DAEMON_OPT_STR,                                    \
         .off = offsetof(type, field.partition), .len = sizeof(((type *)0)->field.partition),     \
         .help = "srun's partition when the spec does not name one"},                              \
        {"slurm-account", 0, "NAME", .kind = DAEMON_OPT_STR,                                      \
         .off = offsetof(type, field.account), .len = sizeof(((type *)0)->field.account),         \
         .help = "srun's account when the spec does not name one"},                                \
        {"slurm-time", 0, "LIMIT", .kind = DAEMON_OPT_STR, .off = offsetof(type, field.time),     \
         .len = sizeof(((type *)0)->field.time),                                                  \
         .help = "srun's time limit (Slurm's format) when the spec\ndoes not give one"}

/* --launcher's values: "mpirun", "slurm". */
extern const char *const daemon_launchers[];
/* o applied to d where the spec left it open: the launcher (for several ranks; one rank
 * goes through Slurm only when its spec says "slurm"), partition, account and time. */
void daemon_launch_apply(const daemon_launch_opts *o, gpu_dist_config *d);
/* o as options for a worker's command line into argv (at most 8 entries); returns how many. */
int daemon_launch_argv(const daemon_launch_opts *o, char **argv);

#endif /* AMPD_DAEMON_OPTS_H */
