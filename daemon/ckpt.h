/*
 * ckpt.h - internal header of daemon/: a trainer's checkpoints as safetensors files
 * (ckpt.c describes the layout and the checksum), resuming from the newest one that
 * verifies, and the retention policy. Used by the worker (`ampd run`).
 *
 * Errors: 0 or a gpu/ code with a message in err: GPU_EIO (a file that cannot be read or
 * written, a missing one), GPU_EFORMAT (a damaged file: truncated, checksum mismatch, not an
 * ampd checkpoint), GPU_EINVAL (a sound checkpoint of another job), GPU_ENOMEM.
 * Threads: the caller's; one trainer at a time.
 */
#ifndef AMPD_DAEMON_CKPT_H
#define AMPD_DAEMON_CKPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu.h"

/* What a checkpoint's header says about it. daemon_ckpt_save reads has_loss, loss,
 * has_eval and eval_loss and fills the rest. */
typedef struct {
    int64_t step;
    int64_t bytes;    /* the file's size */
    bool checksummed; /* format 2 (a crc32 over the file); format 1 files have none */
    bool finite;      /* every weight and optimizer value is finite (format 1: assumed) */
    bool has_loss;    /* loss is the training loss of its step (false: not recorded) */
    bool has_eval;    /* eval_loss is the eval loss at its step (false: no eval there) */
    double loss, eval_loss;
} daemon_ckpt_info;

/* A healthy checkpoint: finite weights and optimizer state, and a finite loss when one was
 * recorded. The retention never drops the newest healthy checkpoint. */
bool daemon_ckpt_healthy(const daemon_ckpt_info *info);

/* dir/ckpt-<step>.safetensors in buf. */
void daemon_ckpt_path(const char *dir, int64_t step, char *buf, size_t len);
/* 0 with *step when name (a file name, no directory) is ckpt-<step>.safetensors; else -1. */
int daemon_ckpt_step_of(const char *name, int64_t *step);
/* The steps of the ckpt-<step>.safetensors files in dir, ascending (heap array, free()).
 * GPU_EIO when dir cannot be read. */
int daemon_ckpt_scan(const char *dir, int64_t **steps, int *n);

/* Write t's state to dir/ckpt-<step>.safetensors atomically (temp file, fsync, rename,
 * directory fsync), with its checksum, loss, eval loss and finiteness in the metadata.
 * info: the losses in, the file's description out. path receives the file's path.
 * Borrowed arguments. */
int daemon_ckpt_save(gpu_trainer *t, const char *dir, daemon_ckpt_info *info, char *path,
                     size_t pathlen, char *err, size_t errlen);
/* Read path's header: *info, and GPU_EFORMAT when the header is damaged or the file is
 * shorter or longer than the header says. The tensors are not read or checksummed. */
int daemon_ckpt_read_info(const char *path, daemon_ckpt_info *info, char *err, size_t errlen);

/* A checkpoint a resume did not use, and why. */
typedef struct {
    int64_t step;
    char path[1024];
    char reason[512];
} daemon_ckpt_skip;

/* What a resume did (daemon_ckpt_resume). */
typedef struct {
    char dir[1024];            /* the directory it walked */
    int64_t step;              /* the step it continues from; 0: none verified */
    char path[1024];           /* the checkpoint loaded; "" when none */
    daemon_ckpt_info info;     /* its description */
    daemon_ckpt_skip *skipped; /* newest first (heap) */
    int nskipped;
    bool touched; /* a failed attempt may have written the trainer */
    int converted; /* a branch's start: tensors read from another float dtype */
} daemon_ckpt_resumed;

/* Resume t from `from`: a directory (its newest checkpoint that verifies) or a file (that
 * one, then, when it is named ckpt-<N>.safetensors, the older ones of its directory, newest
 * first). Each is verified (the header's checks, then the checksum over the whole file)
 * before it is loaded; the trainer is written only after the file has verified and every
 * tensor has matched the job's; a format 1 file (no checksum) loads after the structural
 * checks alone. A missing, unreadable or damaged file is skipped with its reason; 0 with
 * out->step 0 when none verifies (recreate the trainer when out->touched). A checkpoint
 * that verifies but belongs to another job (GPU_EINVAL) ends the walk with that error.
 * Clear out with daemon_ckpt_resumed_clear in every case. */
int daemon_ckpt_resume(gpu_trainer *t, const char *from, daemon_ckpt_resumed *out, char *err,
                       size_t errlen);
/* Load t from exactly the checkpoint at path (a branch's start: another job's checkpoint,
 * which no older one may stand in for), verified as daemon_ckpt_resume verifies; out as
 * there, without skips. A float tensor the checkpoint holds in another dtype than t (the
 * branch changed precision.dtype or master_weights) is converted through fp32 (exact from
 * 16 bits to fp32, rounded to nearest even the other way), counted in out->converted. An
 * error (with path and reason in err) when it does not verify or does not fit t. */
int daemon_ckpt_load_exact(gpu_trainer *t, const char *path, daemon_ckpt_resumed *out, char *err,
                           size_t errlen);
/* Release out's heap parts; NULL is fine. */
void daemon_ckpt_resumed_clear(daemon_ckpt_resumed *out);

/* The retention policy over a job's n checkpoints (any order): keep[i] tells whether v[i]
 * stays. keep_last 0 keeps every one; otherwise the keep_last newest stay, and the keep_best
 * with the lowest finite eval loss, and the newest healthy one, and (before > 0) the newest
 * before step `before`: the state before the first problem a remedy answers, where a branch
 * with it starts. GPU_ENOMEM (every keep[i] true) when out of memory. */
int daemon_ckpt_retain(const daemon_ckpt_info *v, int n, int keep_last, int keep_best,
                       int64_t before, bool *keep);

#endif /* AMPD_DAEMON_CKPT_H */
