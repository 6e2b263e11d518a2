/*
 * line.h - internal header of daemon/: the worker's JSON lines of metrics, both sides of
 * the pipe. The worker (`ampd run`) writes a "step" line per step and an "eval" line per
 * evaluation; the scheduler reads them into store rows. Both sides are generated from the
 * metric-field table (store.h's STORE_METRICS), so a field added there is printed, read
 * and stored without another line of code.
 *
 * Threads: reentrant.
 */
#ifndef AMPD_DAEMON_LINE_H
#define AMPD_DAEMON_LINE_H

#include <jansson.h>
#include <stdint.h>

#include "gpu/gpu.h"
#include "store/store.h"

/* {"type": "step", "step": N, <every STEP field under its name, in its JSON form>, "mem":
 * {<the memory by category>}}. Non-finite numbers are the strings "NaN", "Infinity",
 * "-Infinity". Caller owns the reference (NULL when out of memory). */
json_t *daemon_line_step(const gpu_step_metrics *m);
/* {"type": "eval", "step": N, <every EVAL field>, "count": <examples evaluated>}. */
json_t *daemon_line_eval(int64_t step, const gpu_eval_result *r);
/* The memory by category as an object {"weights", "master", ..., "total"}. */
json_t *daemon_line_mem(const gpu_mem *m);

/* A metric value of a line: a number, a boolean (1 or 0), or the strings "Infinity" and
 * "-Infinity"; NaN for anything else ("NaN", absent, malformed). */
double daemon_line_num(json_t *v);
/* The fields that a line of kind `line` carries, read from o into v (STORE_M_NFIELDS
 * values; the other fields are left as they are). A field the line does not have, or has
 * as null, is store_missing(). */
void daemon_line_fields(json_t *o, store_line line, double *v);

/* Print obj as one line on stdout and release it. The line goes out whole with write(2),
 * which a stop signal interrupts (EINTR: the handlers have no SA_RESTART) while the daemon
 * leaves the pipe full (it pauses a worker while its store cannot write): stdio would drop
 * the line then, so the write is resumed until every byte is out. */
void daemon_line_emit(json_t *obj);

#endif /* AMPD_DAEMON_LINE_H */
