#!/bin/bash
# bench/gpt.sh - GPT (4 layers, d_model 256, 4 heads, T 128, batch 16, vocab 256), AdamW:
# training-step time of ampd in fp32, fp16 and bf16 side by side with the same model in
# PyTorch (Debian python3-torch, CPU, 2 threads), in one run.
#
# Usage: bench/gpt.sh [STEPS] [ROUNDS]   (from the build directory after `make`)
#   STEPS   training steps per run (default 60; PyTorch's first 10 are warm-up)
#   ROUNDS  alternating rounds per precision (default 2); the best round's median counts.
#
# Data: 1 MB of random bytes in a temporary data root (speed does not depend on the text).
# Work per step: 6 * params * tokens (the matmul FLOPs of forward and backward) plus the
# attention matmuls 12 * n_layer * B * T^2 * d_model; reported as GFLOP/s.
set -euo pipefail

STEPS=${1:-60}
ROUNDS=${2:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
AMPD=${AMPD:-./ampd}
PY=${PYTHON:-/usr/bin/python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

[ -x "$AMPD" ] || { echo "bench/gpt.sh: $AMPD not found: run make first" >&2; exit 1; }
"$PY" -c 'import torch' 2>/dev/null || { echo "bench/gpt.sh: PyTorch missing: apt-get install python3-torch" >&2; exit 1; }
mkdir -p "$TMP/data"
head -c 1000000 /dev/urandom >"$TMP/data/random.txt"

job() { # dtype -> job file
    cat >"$TMP/$1.json" <<EOF
{"name": "bench-gpt-$1",
 "model": {"type": "gpt", "n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 128, "vocab": 256},
 "data": {"type": "text", "train": "random.txt", "val_fraction": 0.01},
 "precision": {"dtype": "$1"}, "optimizer": {"type": "adamw", "lr": 0.0003},
 "batch_size": 16, "steps": $STEPS, "threads": 2}
EOF
}

ampd_ms() { # dtype -> median step ms
    "$AMPD" run --every 1000000 --data-root "$TMP/data" "$TMP/$1.json" 2>/dev/null |
        "$PY" -c 'import json,sys
for l in sys.stdin:
    o=json.loads(l)
    if o.get("type")=="summary": print(o["median_step_ms"])'
}

torch_ms() { # mode -> median step ms
    "$PY" "$HERE/torch_gpt.py" --mode "$1" --steps "$STEPS" --warmup 10 |
        "$PY" -c 'import json,sys; print(json.loads(sys.stdin.readline())["median_step_ms"])'
}

min() { "$PY" -c "import sys; print(min(float(x) for x in sys.argv[1:]))" "$@"; }

GFLOP=$("$PY" -c "
L,d,T,B,V=4,256,128,16,256
params=V*d+T*d+L*(12*d*d+13*d)+2*d
print((6*(params-T*d)*B*T + 12*L*B*T*T*d)/1e9)")
echo "GPT 4 layers, d 256, 4 heads, T 128, batch 16, vocab 256, AdamW, $STEPS steps, $ROUNDS rounds; $("$AMPD" version | sed -n 2p)"
echo "work per step: $GFLOP GFLOP (6 * params * tokens + attention)"
printf '%-6s %12s %14s %10s %14s %12s\n' dtype "ampd ms" "pytorch ms" "speedup" "ampd GFLOP/s" "tokens/s"
for dt in fp32 fp16 bf16; do
    job "$dt"
    a=()
    t=()
    for ((r = 0; r < ROUNDS; r++)); do
        a+=("$(ampd_ms "$dt")")
        t+=("$(torch_ms "$dt")")
    done
    am=$(min "${a[@]}")
    tm=$(min "${t[@]}")
    "$PY" -c "
am,tm,g=$am,$tm,$GFLOP
print('%-6s %12.2f %14.2f %9.2fx %14.1f %12.0f' % ('$dt', am, tm, tm/am, g/(am/1e3), 16*128/(am/1e3)))"
done
echo "pytorch fp16 is an emulation (torch 1.13 has no fp16 CPU autocast): see bench/torch_gpt.py"
