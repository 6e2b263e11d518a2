#!/bin/bash
# bench/diag.sh - the cost of per-layer diagnostics: MLP 784-1024-1024-10, batch 256, AdamW,
# trained with diagnostics_every 0 (off) and 50, alternating, ROUNDS times per precision.
#
# Usage: bench/diag.sh [STEPS] [ROUNDS] [DTYPES]   (run from the build directory after make)
#   STEPS   steps per run (default 300; the first 10 are left out as warm-up)
#   ROUNDS  alternating off/on runs per precision (default 3)
#   DTYPES  default "fp16 bf16 fp32"
#
# Two figures per precision:
#   - the mean step time over whole runs, off and on (best and median of the rounds), and
#     the overhead of "on" from the medians: what the target (within 2%) is about, but on a
#     shared machine the run-to-run noise is often larger than the overhead;
#   - the extra time of a collecting step over the other steps of the same runs, divided by
#     50 and by the plain step time: the overhead amortised over 50 steps, much less noisy.
set -euo pipefail

STEPS=${1:-300}
ROUNDS=${2:-3}
DTYPES=${3:-fp16 bf16 fp32}
AMPD=${AMPD:-./ampd}
PY=${PYTHON:-/usr/bin/python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

[ -x "$AMPD" ] || { echo "bench/diag.sh: $AMPD not found: run make first" >&2; exit 1; }

job() { # dtype every -> job file
    cat >"$TMP/job.json" <<EOF
{"name": "diag-$1-$2", "model": {"type": "mlp", "layers": [784, 1024, 1024, 10]},
 "data": {"type": "synthetic", "train_size": 4096, "eval_size": 256},
 "precision": {"dtype": "$1"}, "optimizer": {"type": "adamw", "lr": 0.001},
 "batch_size": 256, "steps": $STEPS, "diagnostics_every": $2, "threads": 2}
EOF
}

# run DTYPE EVERY -> "mean_ms diagnosed_mean_ms plain_mean_ms" (steps after the 10th); fails,
# saying why, when ampd run does not exit 0
run() {
    local rc=0
    job "$1" "$2"
    "$AMPD" run "$TMP/job.json" >"$TMP/ampd.out" 2>"$TMP/ampd.err" || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "bench/diag.sh: ampd run ($1, diagnostics_every $2) exited with status $rc, not 0:" >&2
        tail -n 5 "$TMP/ampd.err" >&2
        return 1
    fi
    "$PY" -c '
import json, sys
every = int(sys.argv[1])
ms, diag = [], []
for line in sys.stdin:
    o = json.loads(line)
    if o.get("type") == "step" and o["step"] > 10:
        ms.append(o["step_ms"])
        diag.append(every > 0 and o["step"] % every == 0)
d = [m for m, f in zip(ms, diag) if f]
p = [m for m, f in zip(ms, diag) if not f]
print(sum(ms) / len(ms), sum(d) / len(d) if d else 0.0, sum(p) / len(p))' "$2" <"$TMP/ampd.out"
}

echo "MLP 784-1024-1024-10, batch 256, AdamW, $STEPS steps, $ROUNDS rounds of off/on"
printf '%-6s %9s %9s %9s %9s %10s %12s %12s %10s\n' dtype "off best" "off med" "on best" \
    "on med" "overhead" "diag step" "other steps" "amortised"
for dt in $DTYPES; do
    off=(); on=(); dsum=(); psum=()
    for ((r = 0; r < ROUNDS; r++)); do
        res=$(run "$dt" 0) || exit 1
        read -r a _ _ <<<"$res"
        res=$(run "$dt" 50) || exit 1
        read -r b d p <<<"$res"
        off+=("$a"); on+=("$b"); dsum+=("$d"); psum+=("$p")
    done
    "$PY" -c '
import statistics as st, sys
n = int(sys.argv[2])
v = [float(x) for x in sys.argv[3:]]
off, on, d, p = v[:n], v[n:2*n], v[2*n:3*n], v[3*n:]
dm, pm = st.mean(d), st.mean(p)
print("%-6s %9.2f %9.2f %9.2f %9.2f %+9.2f%% %12.2f %12.2f %+9.2f%%" % (sys.argv[1],
      min(off), st.median(off), min(on), st.median(on), 100 * (st.median(on) / st.median(off) - 1),
      dm, pm, 100 * (dm - pm) / 50 / pm))' "$dt" "$ROUNDS" "${off[@]}" "${on[@]}" "${dsum[@]}" "${psum[@]}"
done
