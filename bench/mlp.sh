#!/bin/bash
# bench/mlp.sh - MLP 784-1024-1024-10, batch 256, AdamW: training-step time of ampd in fp32,
# fp16 and bf16 side by side with the same model in PyTorch (Debian python3-torch, CPU,
# 2 threads, bench/torch_mlp.py), with this machine's fp32 GEMM rates (bench/sgemm
# --shapes mlp) measured in every round; Markdown tables on stdout, progress on stderr.
#
# Usage: bench/mlp.sh [STEPS] [ROUNDS]   (run from the build directory after `make`)
#   STEPS   training steps of every run, both sides (default 100); the first
#           BENCH_WARMUP (default min(10, STEPS / 5)) are warm-up, dropped on both sides,
#           and a run's time is the median of the rest
#   ROUNDS  rounds (default 2). A round: bench/sgemm twice (AMPD_GEMM=openblas, and
#           unset), then ampd in fp32, fp16, bf16, then PyTorch in the same three (the
#           order rotated from round to round). The table has each side's best round, the
#           sgemm rates of the round ampd's best came from, and each dtype's time over fp32's
#           in the same round (median over the rounds).
# Environment: BENCH_TIMEOUT (the limit of every run, seconds; default 120: a run past it
#   is reported as timeout and the benchmark goes on), BENCH_WARMUP, AMPD (./ampd),
#   SGEMM (./bench/sgemm), PYTHON (/usr/bin/python3, which must have torch).
#
# FLOPs per step (GEMMs only): forward 2*B*sum(in*out), weight gradients the same, input
# gradients for every layer but the first (the engine computes none for the input);
# bench/sgemm's MLP step shapes add up to the same.
set -euo pipefail

STEPS=${1:-100}
ROUNDS=${2:-2}
BENCH=bench/mlp.sh
HERE=$(cd "$(dirname "$0")" && pwd)
AMPD=${AMPD:-./ampd}
SGEMM=${SGEMM:-./bench/sgemm}
PY=${PYTHON:-/usr/bin/python3}
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
bench_init 120

B=256
GFLOP=$("$PY" -c "
w=[784,1024,1024,10]; B=$B
fwd=sum(2*B*a*b for a,b in zip(w,w[1:]))
dx=sum(2*B*a*b for a,b in zip(w[1:],w[2:]))
print((2*fwd+dx)/1e9)")

for dt in fp32 fp16 bf16; do
    cat >"$TMP/$dt.json" <<EOF
{"name": "bench-$dt", "model": {"type": "mlp", "layers": [784, 1024, 1024, 10]},
 "data": {"type": "synthetic", "train_size": 4096, "eval_size": 256},
 "precision": {"dtype": "$dt"}, "optimizer": {"type": "adamw", "lr": 0.001},
 "batch_size": $B, "steps": $STEPS, "threads": 2}
EOF
done

for ((r = 1; r <= ROUNDS; r++)); do
    bench_sgemm_round "$r" mlp
    for dt in $(bench_dtypes "$r"); do bench_ampd "$r" "$dt" "$TMP/$dt.json"; done
    for dt in $(bench_dtypes "$r"); do bench_torch "$r" "$dt" "$HERE/torch_mlp.py"; done
done

plural=$([ "$ROUNDS" = 1 ] || echo s)
bench_report "MLP 784-1024-1024-10, batch $B, AdamW; $STEPS steps per run, $ROUNDS round$plural" \
    mlp "$GFLOP" \
    "PyTorch's fp16 is an emulation of the same numerics (torch 1.13 has no fp16 CPU autocast):
see bench/torch_mlp.py, which also chooses PyTorch's OMP_WAIT_POLICY per mode."
