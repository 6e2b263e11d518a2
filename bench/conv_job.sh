# shellcheck shell=bash
# bench/conv_job.sh - the convergence benchmark's GPT job, sourced by bench/convergence.sh
# (on the CPU, beside PyTorch) and bench/gpu_curve.sh (on the GPU), so that both run the same
# job: 4 layers, 4 heads, d_model 256, seq_len 128, vocab 256 (bytes), batch 16, AdamW at
# LR, a text with VAL_FRACTION split off for validation. bench/torch_convergence.py's
# defaults are the same.
# shellcheck disable=SC2034 # read by the scripts that source this one
N_LAYER=4 N_HEAD=4 D_MODEL=256 SEQ_LEN=128 BATCH=16 LR=0.001 VAL_FRACTION=0.1

# conv_spec NAME DTYPE SEED STEPS LR EVAL_EVERY TRAIN [DEVICE]: the job spec on stdout (fp16
# with dynamic loss scaling; DEVICE unset: the spec's default, auto).
conv_spec() {
    local scale="" device=""
    [ "$2" = fp16 ] && scale=', "loss_scale": {"mode": "dynamic"}'
    [ -n "${8:-}" ] && device=", \"device\": \"$8\""
    cat <<SPEC
{"name": "$1",
 "model": {"type": "gpt", "n_layer": $N_LAYER, "n_head": $N_HEAD, "d_model": $D_MODEL, "seq_len": $SEQ_LEN, "vocab": 256},
 "data": {"type": "text", "train": "$7", "val_fraction": $VAL_FRACTION},
 "precision": {"dtype": "$2"$scale}, "optimizer": {"type": "adamw", "lr": $5},
 "batch_size": $BATCH, "steps": $4, "eval_every": $6, "seed": $3, "threads": 2$device}
SPEC
}
