#!/bin/bash
# bench/replay.sh - fp32 against PyTorch from a checkpoint: ampd trains an fp32 MLP on
# Fashion-MNIST for K + N steps, writing a checkpoint every K; PyTorch 1.13 (Debian's
# python3-torch) loads ckpt-K (weights and optimizer state), replays steps K+1 .. K+N on the
# batches ampd drew, and the losses of every step and the final weights (ampd's
# ckpt-(K+N)) are compared. bench/torch_replay.py is the PyTorch side.
#
# Usage: bench/replay.sh [K] [N]   (run from the build directory after `make`)
#   K  the step the replay starts from (default 50)
#   N  steps replayed (default 50)
#
# Cases, each on batch 64, seed 1, one thread on both sides:
#   MLP 784-1024-1024-10, AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01
#   MLP 784-256-10, the same AdamW
#   MLP 784-1024-1024-10, SGD lr 0.01, momentum 0.9, weight decay 5e-4
# and three PyTorch runs of each:
#   plain     nn.Linear, F.cross_entropy, autograd, torch.optim (foreach=False) with the
#             spec's hyperparameters as Python floats: what a user gets
#   float32   the same with every hyperparameter rounded to float32 first: the drift that
#             ampd's double constants remove
#   ampd-ord  forward and backward written out in ampd's operation order (bias added after
#             the GEMM, cross-entropy in double, bias gradients summed row by row), the
#             same torch.optim: what is left when only PyTorch's operation order is taken away
# Prints the CPU, the versions, a summary table and the first case's per-step losses.
set -euo pipefail

K=${1:-50}
N=${2:-50}
HERE=$(cd "$(dirname "$0")" && pwd)
AMPD=${AMPD:-./ampd}
PY=${PYTHON:-/usr/bin/python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

[ -x "$AMPD" ] || { echo "bench/replay.sh: $AMPD not found: run make first" >&2; exit 1; }
"$PY" -c 'import torch, numpy' 2>/dev/null ||
    { echo "bench/replay.sh: PyTorch missing: apt-get install python3-torch" >&2; exit 1; }
case "$K$N" in *[!0-9]*) echo "usage: bench/replay.sh [K] [N]" >&2; exit 2 ;; esac
if [ "$K" -lt 1 ] || [ "$N" -lt 1 ]; then echo "bench/replay.sh: K and N must be >= 1" >&2; exit 2; fi

ADAMW='{"type": "adamw", "lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "grad_clip": 0}'
SGD='{"type": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4, "grad_clip": 0}'
CASES=("big-adamw|784, 1024, 1024, 10|$ADAMW" "small-adamw|784, 256, 10|$ADAMW"
       "big-sgd|784, 1024, 1024, 10|$SGD")

for c in "${CASES[@]}"; do
    IFS='|' read -r name layers opt <<<"$c"
    cat >"$TMP/$name.json" <<EOF
{"name": "replay-$name", "model": {"type": "mlp", "layers": [$layers]},
 "data": {"type": "idx", "train": "fashion-mnist", "eval": null},
 "precision": {"dtype": "fp32"}, "optimizer": $opt,
 "batch_size": 64, "steps": $((K + N)), "seed": 1, "checkpoint_every": $K,
 "checkpoints": {"keep_last": 0}, "threads": 1}
EOF
    mkdir "$TMP/$name"
    "$AMPD" run --checkpoint-dir "$TMP/$name" "$TMP/$name.json" >"$TMP/$name.jsonl" \
        2>"$TMP/$name.log" || { cat "$TMP/$name.log" >&2; exit 1; }
    for v in "plain|--order torch --constants double" "float32|--order torch --constants float32" \
             "ampd-ord|--order ampd --constants double"; do
        IFS='|' read -r vn args <<<"$v"
        # shellcheck disable=SC2086 # args is a list of options
        "$PY" "$HERE/torch_replay.py" --run "$TMP/$name.jsonl" \
            --ckpt "$TMP/$name/ckpt-$K.safetensors" \
            --final "$TMP/$name/ckpt-$((K + N)).safetensors" $args >"$TMP/$name.$vn.out"
    done
done

CPU=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' |
        grep -xE 'avx2|fma|f16c|avx512f|avx512_bf16|avx512_fp16' | tr '\n' ' ' | sed 's/ $//')
echo "fp32 MLP on Fashion-MNIST, batch 64, seed 1: ampd trains steps 1..$((K + N)) (checkpoint every $K);"
echo "PyTorch loads ckpt-$K and replays steps $((K + 1))..$((K + N)) on the batches ampd drew"
BLAS=$("$PY" -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline())["blas"])' \
    "$TMP/big-adamw.jsonl")
echo "CPU: $CPU, $(nproc) cores ($FLAGS); ampd's BLAS: $BLAS; $(date -u +%Y-%m-%d)"
echo "command: bench/replay.sh $K $N"
TMP="$TMP" K="$K" N="$N" "$PY" - <<'EOF'
import json, os
tmp, K, N = os.environ["TMP"], int(os.environ["K"]), int(os.environ["N"])
cases = [("big-adamw", "784-1024-1024-10", "AdamW"), ("small-adamw", "784-256-10", "AdamW"),
         ("big-sgd", "784-1024-1024-10", "SGD m 0.9")]
variants = [("plain", "nn.Linear + F.cross_entropy, double constants"),
            ("float32", "the same, float32-rounded constants"),
            ("ampd-ord", "ampd's operation order, double constants")]
res = {(c, v): json.load(open(f"{tmp}/{c}.{v}.out")) for c, _, _ in cases for v, _ in variants}
r0 = res[("big-adamw", "plain")]
print(f"torch {r0['torch']}, {r0['threads']} thread, OpenBLAS kernels {r0['openblas_coretype']}; "
      f"the ported shuffle gives ckpt-{K}'s data.order: "
      f"{all(r['order_matches'] and r['rng_matches'] for r in res.values())}")
print()
print(f"| model | optimizer | PyTorch side | step {K + 1} loss rel. diff | largest loss rel. diff "
      f"({N} steps) | losses equal to 9 digits | final weights: max abs diff | max diff / max |w| "
      "| L2 rel. diff | bit-equal |")
print("|---|---|---|---|---|---|---|---|---|---|")
for c, model, opt in cases:
    for v, vd in variants:
        r = res[(c, v)]
        wmax = max(w["max_abs_diff"] for w in r["weights"])
        eq = sum(w["equal_frac"] for w in r["weights"]) / len(r["weights"])
        print(f"| {model} | {opt} | {vd} | {r['first_rel']:.2e} | {r['max_rel']:.2e} "
              f"(step {r['max_rel_step']}) | {r['same_digits']}/{N} | {wmax:.2e} "
              f"| {r['weights_max_rel']:.2e} | {r['weights_l2_rel']:.2e} "
              f"| {'all' if r['weights_equal'] else f'{100 * eq:.0f}% (mean over tensors)'} |")
print()
w = max(r0["weights"], key=lambda w: w["max_abs_diff"])
print(f"784-1024-1024-10 AdamW, plain PyTorch: the largest weight difference is {w['tensor']}"
      f"{w['worst']['index']}: ampd {w['worst']['ampd']:.9g}, PyTorch {w['worst']['torch']:.9g}, "
      f"its exp_avg_sq {w['worst']['exp_avg_sq']:.3g}")
print()
print("Per step, 784-1024-1024-10 AdamW (relative differences to ampd; ampd prints 9 digits):")
print()
print("| step | ampd loss | PyTorch loss | rel. diff | PyTorch, float32 constants | rel. diff "
      "| PyTorch, ampd's order | rel. diff |")
print("|---|---|---|---|---|---|---|---|")
rows = [res[("big-adamw", v)]["steps"] for v, _ in variants]
for a, b, c in zip(*rows):
    print(f"| {a['step']} | {a['ampd']:.9g} | {a['torch']:.9g} | {a['rel']:.1e} | {b['torch']:.9g} "
          f"| {b['rel']:.1e} | {c['torch']:.9g} | {c['rel']:.1e} |")
EOF
