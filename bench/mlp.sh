#!/bin/bash
# bench/mlp.sh - MLP 784-1024-1024-10, batch 256, AdamW: training-step time of ampd in fp32,
# fp16 and bf16 side by side with the same model in PyTorch (Debian python3-torch, CPU,
# 2 threads), in one run, plus the best sgemm rate of this machine.
#
# Usage: bench/mlp.sh [STEPS] [ROUNDS]   (run from the build directory after `make`)
#   STEPS   training steps per run (default 100; the first 10 are warm-up for PyTorch)
#   ROUNDS  alternating rounds of ampd and PyTorch per precision (default 2); the table
#           reports the best round's median, so a noisy neighbour hurts both sides alike.
#
# FLOPs per step (GEMMs only): forward 2*B*sum(in*out), weight gradients the same, input
# gradients for every layer but the first; the fp32 step rate is compared with the best
# sgemm GFLOP/s measured by bench/sgemm in the same run.
set -euo pipefail

STEPS=${1:-100}
ROUNDS=${2:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
AMPD=${AMPD:-./ampd}
SGEMM=${SGEMM:-./bench/sgemm}
PY=${PYTHON:-/usr/bin/python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

for f in "$AMPD" "$SGEMM"; do
    [ -x "$f" ] || { echo "bench/mlp.sh: $f not found: run make first" >&2; exit 1; }
done
"$PY" -c 'import torch' 2>/dev/null || { echo "bench/mlp.sh: PyTorch missing: apt-get install python3-torch" >&2; exit 1; }

job() { # dtype -> job file
    cat > "$TMP/$1.json" <<EOF
{"name": "bench-$1", "model": {"type": "mlp", "layers": [784, 1024, 1024, 10]},
 "data": {"type": "synthetic", "train_size": 4096, "eval_size": 256},
 "precision": {"dtype": "$1"}, "optimizer": {"type": "adamw", "lr": 0.001},
 "batch_size": 256, "steps": $STEPS, "threads": 2}
EOF
}

ampd_ms() { # dtype -> median step ms
    "$AMPD" run --every 1000000 "$TMP/$1.json" 2>/dev/null |
        "$PY" -c 'import json,sys
for l in sys.stdin:
    o=json.loads(l)
    if o.get("type")=="summary": print(o["median_step_ms"])'
}

torch_ms() { # mode -> median step ms
    "$PY" "$HERE/torch_mlp.py" --mode "$1" --steps "$STEPS" --warmup 10 |
        "$PY" -c 'import json,sys; print(json.loads(sys.stdin.readline())["median_step_ms"])'
}

min() { "$PY" -c "import sys; print(min(float(x) for x in sys.argv[1:]))" "$@"; }

SG=$("$SGEMM" | awk '/^best_sgemm_gflops/ {print $2}')
B=256
GFLOP=$("$PY" -c "
w=[784,1024,1024,10]; B=$B
fwd=sum(2*B*a*b for a,b in zip(w,w[1:]))
dx=sum(2*B*a*b for a,b in zip(w[1:],w[2:]))
print((2*fwd+dx)/1e9)")

echo "MLP 784-1024-1024-10, batch $B, AdamW, $STEPS steps, $ROUNDS rounds; $("$AMPD" version | sed -n 2p)"
echo "best sgemm on this machine: $SG GFLOP/s; GEMM work per step: $GFLOP GFLOP"
printf '%-6s %12s %14s %10s %14s %12s\n' dtype "ampd ms" "pytorch ms" "speedup" "ampd GFLOP/s" "% of sgemm"
for dt in fp32 fp16 bf16; do
    job "$dt"
    a=(); t=()
    for ((r = 0; r < ROUNDS; r++)); do
        a+=("$(ampd_ms "$dt")")
        t+=("$(torch_ms "$dt")")
    done
    am=$(min "${a[@]}"); tm=$(min "${t[@]}")
    "$PY" -c "
am,tm,g,sg=$am,$tm,$GFLOP,$SG
rate=g/(am/1e3)
print('%-6s %12.2f %14.2f %9.2fx %14.1f %11.0f%%' % ('$dt', am, tm, tm/am, rate, 100*rate/sg))"
done
echo "pytorch fp16 is an emulation (torch 1.13 has no fp16 CPU autocast): see bench/torch_mlp.py"
