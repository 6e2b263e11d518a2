#!/bin/bash
# bench/fp8.sh - fp8 against bf16 on this CPU, in one run: the Fashion-MNIST MLP
# 784-1024-1024-10 (batch 128, AdamW lr 1e-3) trained in bf16 and in fp8 (delayed scaling,
# HYBRID: Transformer Engine's defaults) for the same steps over several seeds, the two
# precisions alternating seed by seed. It reports each run's test accuracy and loss, their
# mean and spread over the seeds, the difference (the claim: fp8 within 1 point of bf16),
# and the step time and memory by category side by side. fp8 is slower here: the CPU has no
# fp8 arithmetic, so every fp8 GEMM first casts its operands (a pass over the input and the
# weight, and backward over the output gradient) and decodes them to bf16, on top of bf16's
# own GEMM (docs/fp8.md says why); the table gives the ratio.
#
# Usage: bench/fp8.sh [STEPS] [SEEDS]   (run from the build directory after `make`)
#   STEPS  training steps of every run (default 1000); the test set is evaluated at the end
#   SEEDS  comma-separated seeds (default 1,2,3,4,5)
# Environment: AMPD (./ampd), BENCH_DATA_ROOT (where fashion-mnist is: default
#   /usr/share/datasets), BENCH_TIMEOUT (each run's limit in seconds, default 1800),
#   BENCH_THREADS (threads per run, default 0: every core).
set -euo pipefail

STEPS=${1:-1000}
SEEDS=${2:-1,2,3,4,5}
HERE=$(cd "$(dirname "$0")" && pwd)
AMPD=${AMPD:-./ampd}
DATA=${BENCH_DATA_ROOT:-/usr/share/datasets}
LIMIT=${BENCH_TIMEOUT:-1800}
THREADS=${BENCH_THREADS:-0}
PY=${PYTHON:-python3}
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh" # bench_cpu

die() {
    echo "bench/fp8.sh: $*" >&2
    exit 1
}
[[ $STEPS =~ ^[0-9]+$ && $STEPS -ge 1 ]] || die "STEPS must be a positive integer"
[[ $SEEDS =~ ^[0-9]+(,[0-9]+)*$ ]] || die "SEEDS must be comma-separated integers"
[ -x "$AMPD" ] || die "$AMPD not found: run make first (or set AMPD)"
[ -e "$DATA/fashion-mnist" ] || die "no fashion-mnist under $DATA (apt-get install dataset-fashion-mnist)"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

for seed in ${SEEDS//,/ }; do
    for dt in bf16 fp8; do
        cat >"$TMP/job.json" <<EOF
{"name": "fp8-bench-$dt-$seed", "model": {"type": "mlp", "layers": [784, 1024, 1024, 10]},
 "data": {"type": "idx", "train": "fashion-mnist"}, "precision": {"dtype": "$dt"},
 "optimizer": {"type": "adamw", "lr": 0.001}, "batch_size": 128, "steps": $STEPS,
 "eval_every": $STEPS, "seed": $seed, "device": "cpu", "threads": $THREADS}
EOF
        echo "bench/fp8.sh: seed $seed, $dt ..." >&2
        out="$TMP/$dt-$seed.jsonl"
        if ! timeout "$LIMIT" "$AMPD" run --every "$STEPS" --data-root "$DATA" "$TMP/job.json" \
            >"$out" 2>"$TMP/err"; then
            tail -n 5 "$TMP/err" >&2
            die "the $dt run of seed $seed failed (or ran past ${LIMIT} s)"
        fi
    done
done

echo "## fp8 against bf16: Fashion-MNIST MLP 784-1024-1024-10, $STEPS steps, seeds $SEEDS"
echo
echo "CPU: $(bench_cpu); $("$AMPD" version 2>/dev/null | head -n1)"
echo
"$PY" - "$TMP" "$SEEDS" <<'EOF'
import json, statistics as st, sys
tmp, seeds = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
runs = {}
for dt in ("bf16", "fp8"):
    for s in seeds:
        lines = [json.loads(l) for l in open(f"{tmp}/{dt}-{s}.jsonl") if l.startswith("{")]
        ev = [l for l in lines if l.get("type") == "eval"][-1]
        sm = [l for l in lines if l.get("type") == "summary"][-1]
        runs[dt, s] = (ev["eval_acc"] * 100, ev["eval_loss"], sm["median_step_ms"], sm["peak_mem"])
print("| seed | bf16 test acc (%) | fp8 test acc (%) | fp8 - bf16 (points) | bf16 test loss | fp8 test loss |")
print("|---|---|---|---|---|---|")
for s in seeds:
    b, f = runs["bf16", s], runs["fp8", s]
    print(f"| {s} | {b[0]:.2f} | {f[0]:.2f} | {f[0] - b[0]:+.2f} | {b[1]:.4f} | {f[1]:.4f} |")
def ms(dt, k):
    v = [runs[dt, s][k] for s in seeds]
    return st.mean(v), (st.stdev(v) if len(v) > 1 else 0.0)
ba, fa = ms("bf16", 0), ms("fp8", 0)
diff = fa[0] - ba[0]
print(f"| mean ± sd | {ba[0]:.2f} ± {ba[1]:.2f} | {fa[0]:.2f} ± {fa[1]:.2f} | {diff:+.2f} | "
      f"{ms('bf16', 1)[0]:.4f} | {ms('fp8', 1)[0]:.4f} |")
print()
verdict = "holds" if abs(diff) < 1.0 else "does NOT hold"
print(f"The claim (fp8's mean test accuracy within 1 point of bf16's): {verdict} ({diff:+.2f}).")
print()
bt = st.median(runs["bf16", s][2] for s in seeds)
ft = st.median(runs["fp8", s][2] for s in seeds)
print("| | bf16 | fp8 | fp8 / bf16 |")
print("|---|---|---|---|")
print(f"| step time (median of the runs' medians, ms) | {bt:.1f} | {ft:.1f} | {ft / bt:.2f} |")
mb, mf = runs["bf16", seeds[0]][3], runs["fp8", seeds[0]][3]
for k in ("master", "weights", "grads", "optimizer", "activations", "workspace", "fp8", "total"):
    b, f = mb.get(k, 0), mf.get(k, 0)
    ratio = f"{f / b:.2f}" if b else "-"
    print(f"| memory: {k} (MiB) | {b / 2**20:.2f} | {f / 2**20:.2f} | {ratio} |")
EOF
