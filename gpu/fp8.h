/*
 * fp8.h - the fp8 scaling state of a model's GEMMs (gpu/fp8_state.c), internal to the gpu/
 * module: one row per GEMM and operand role, which the models' fp8 linears cast with and
 * the trainer updates, reduces across ranks and saves in checkpoints.
 *
 * Invariants: the state's shape depends on the model alone (a row for every linear layer,
 * kept in bf16 or not), so a checkpoint's state fits a branch that keeps other layers; a
 * row is (scale, scale_inv, history[len]), scale_inv always the fp32 reciprocal of scale.
 * Threads: a run belongs to the trainer's thread; the casts use the OpenMP team.
 */
#ifndef AMPD_GPU_FP8_H
#define AMPD_GPU_FP8_H

#include "gpu/gpu_int.h"

/* The operand roles of an fp8 linear: its input, its weight, the gradient of its output. */
enum { GPU_FP8_X = 0, GPU_FP8_W = 1, GPU_FP8_G = 2, GPU_FP8_ROLES = 3 };
#define GPU_FP8_MAX_GEMMS 512

typedef struct gpu_fp8_run {
    gpu_fp8_config cfg;
    int ngemm;
    int len; /* history entries a row keeps: delayed amax_history_len, current 1 */
    bool on[GPU_FP8_MAX_GEMMS]; /* GEMM g runs in fp8 (it is not kept in bf16) */
    float *state;               /* ngemm x ROLES rows of 2 + len floats (gpu_fp8_state_floats) */
    float saved[GPU_FP8_MAX_GEMMS * GPU_FP8_ROLES][2]; /* the scales the step began with */
    bool record; /* delayed: casts add their amax to the staging slot */
    /* what the last collecting step cast, per row (NULL: not collecting) */
    gpu_fp8_cast_stats *stats;
    float *amax;       /* the step's amax per row, NaN when a NaN was cast (NaN-aware) */
    float *scale_used; /* the scale of the row's last cast */
} gpu_fp8_run;

/* Floats of the state of ngemm GEMMs under c. */
size_t gpu_fp8_state_floats(const gpu_fp8_config *c, int ngemm);
/* Set up run over state (borrowed, gpu_fp8_state_floats floats, filled with scales of 1 and
 * empty histories) for ngemm GEMMs, GEMM g in fp8 when on[g] (else it is kept in bf16). */
void gpu_fp8_run_init(gpu_fp8_run *run, const gpu_fp8_config *c, int ngemm, const bool *on,
                      float *state);
/* Which of n layers named names[] an fp8 job runs in fp8 (on[]): all but c->keep's. GPU_EINVAL
 * when c keeps a name none of them has, with the message in err. */
int gpu_fp8_plan_keep(const gpu_fp8_config *c, int n, const char *const *names, bool *on, char *err,
                      size_t errlen);
/* Cast n values of src (dtype sdt) into dst for GEMM g's role, with the recipe's scale: the
 * row's (delayed; its amax recorded when run->record) or this tensor's (current). Returns the
 * scale_inv the GEMM multiplies by. */
float gpu_fp8_cast_role(gpu_fp8_run *run, int g, int role, uint8_t *dst, const void *src,
                        gpu_dtype sdt, size_t n);
/* The scale_inv of GEMM g's role as the last cast left it (the forward's, for backward). */
float gpu_fp8_scale_inv(const gpu_fp8_run *run, int g, int role);
/* The staging amaxes of every row into out (ngemm x ROLES floats), and back: the trainer
 * reduces them across ranks (MAX) in between. */
void gpu_fp8_staging_get(const gpu_fp8_run *run, float *out);
void gpu_fp8_staging_set(gpu_fp8_run *run, const float *in);
/* Delayed scaling's update of every row (gpu_fp8_delayed_update); nothing for current. */
void gpu_fp8_update(gpu_fp8_run *run);
/* Remember the scales now (a step's start); swap them with the ones remembered (before and
 * after recomputing that step). */
void gpu_fp8_save_scales(gpu_fp8_run *run);
void gpu_fp8_swap_scales(gpu_fp8_run *run);

#endif /* AMPD_GPU_FP8_H */
