/*
 * ckpt.h - internal header of daemon/: a trainer's checkpoints as safetensors files
 * (ckpt.c describes the layout). Used by the worker (`ampd run`).
 *
 * Errors: 0 or a gpu/ code (GPU_EIO, GPU_EFORMAT, GPU_ENOMEM, ...; gpu_strerror), with a
 * message in err. Threads: the caller's; one trainer at a time.
 */
#ifndef AMPD_DAEMON_CKPT_H
#define AMPD_DAEMON_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu.h"

/* Write t's state to dir/ckpt-<step>.safetensors atomically (temp file, fsync, rename,
 * directory fsync). path receives the file's path and *bytes its size; err a message on
 * failure. Borrowed arguments. */
int daemon_ckpt_save(gpu_trainer *t, const char *dir, char *path, size_t pathlen,
                     int64_t *bytes, char *err, size_t errlen);
/* Load a checkpoint written by daemon_ckpt_save into a trainer built from the same spec.
 * GPU_EFORMAT (with err naming the problem) for another job's or a damaged file. */
int daemon_ckpt_load(gpu_trainer *t, const char *path, char *err, size_t errlen);

#endif /* AMPD_DAEMON_CKPT_H */
