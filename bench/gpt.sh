#!/bin/bash
# bench/gpt.sh - GPT (4 layers, d_model 256, 4 heads, T 128, batch 16, vocab 256), AdamW:
# training-step time of ampd in fp32, fp16 and bf16 side by side with the same model in
# PyTorch (Debian python3-torch, CPU, 2 threads, bench/torch_gpt.py), with this machine's
# fp32 GEMM rates (bench/sgemm --shapes gpt) measured in every round; Markdown tables on
# stdout, progress on stderr.
#
# Usage: bench/gpt.sh [STEPS] [ROUNDS]   (from the build directory after `make`)
#   STEPS   training steps of every run, both sides (default 60); the first BENCH_WARMUP
#           (default min(10, STEPS / 5)) are warm-up, dropped on both sides, and a run's
#           time is the median of the rest
#   ROUNDS  rounds (default 2). A round: bench/sgemm twice (AMPD_GEMM=openblas, and
#           unset), then ampd in fp32, fp16, bf16, then PyTorch in the same three (the
#           order rotated from round to round). The table has each side's best round, the
#           sgemm rates of the round ampd's best came from, and each dtype's time over fp32's
#           in the same round (median over the rounds).
# Environment: BENCH_TIMEOUT (the limit of every run, seconds; default 300: PyTorch's bf16
#   takes 17-30 s per step on CPUs without native bf16, and a run past the limit is reported
#   as timeout while the benchmark goes on), BENCH_WARMUP, AMPD (./ampd), SGEMM
#   (./bench/sgemm), PYTHON (/usr/bin/python3, which must have torch).
#
# Data: 1 MB of random bytes in a temporary data root (speed does not depend on the text).
# Work per step: the GEMMs' FLOPs, 6 * (V*d + L*12*d^2) * tokens (every linear's forward,
# dW and dX, the tied LM head's included) plus the attention matmuls 12 * L * B * T^2 * d;
# bench/sgemm's GPT step shapes add up to the same.
set -euo pipefail

STEPS=${1:-60}
ROUNDS=${2:-2}
BENCH=bench/gpt.sh
HERE=$(cd "$(dirname "$0")" && pwd)
AMPD=${AMPD:-./ampd}
SGEMM=${SGEMM:-./bench/sgemm}
PY=${PYTHON:-/usr/bin/python3}
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
bench_init 300

mkdir -p "$TMP/data"
head -c 1000000 /dev/urandom >"$TMP/data/random.txt"

GFLOP=$("$PY" -c "
L,d,T,B,V=4,256,128,16,256
print((6*(V*d+L*12*d*d)*B*T + 12*L*B*T*T*d)/1e9)")

for dt in fp32 fp16 bf16; do
    cat >"$TMP/$dt.json" <<EOF
{"name": "bench-gpt-$dt",
 "model": {"type": "gpt", "n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 128, "vocab": 256},
 "data": {"type": "text", "train": "random.txt", "val_fraction": 0.01},
 "precision": {"dtype": "$dt"}, "optimizer": {"type": "adamw", "lr": 0.0003},
 "batch_size": 16, "steps": $STEPS, "threads": 2}
EOF
done

for ((r = 1; r <= ROUNDS; r++)); do
    bench_sgemm_round "$r" gpt
    for dt in $(bench_dtypes "$r"); do
        bench_ampd "$r" "$dt" "$TMP/$dt.json" --data-root "$TMP/data"
    done
    for dt in $(bench_dtypes "$r"); do bench_torch "$r" "$dt" "$HERE/torch_gpt.py"; done
done

plural=$([ "$ROUNDS" = 1 ] || echo s)
bench_report "GPT 4 layers, d 256, 4 heads, T 128, batch 16 (2048 tokens), vocab 256, AdamW;\
 $STEPS steps per run, $ROUNDS round$plural" \
    gpt "$GFLOP" \
    "PyTorch's fp16 is an emulation of the same numerics (torch 1.13 has no fp16 CPU autocast):
see bench/torch_gpt.py. Both sides write the attention out (ampd's default \"materialized\";
torch 1.13 has no scaled_dot_product_attention)."
