#!/bin/bash
# bench/ddp.sh - data-parallel training on this machine's CPU: the MLP 784-1024-1024-10 on
# Fashion-MNIST, global batch 256, AdamW 1e-3, fp32, world 1 and world 2 with the comm hooks
# none / fp16 / bf16, side by side in one run with PyTorch DDP (Debian python3-torch, gloo,
# two CPU processes, fp16_compress_hook; gloo has no bf16, so that row has no peer):
# median step time, the bytes each rank hands to the all-reduce per step, the
# communication time (first bucket's start to the last one's end) and its exposed part
# (after backward's computation ended), and the test accuracy after the same steps.
# Both sides use buckets of BUCKET_MB (DDP's bucket_cap_mb, ampd's distributed.bucket_mb)
# with a first bucket of 1 MiB, and split the machine's cores between the ranks.
#
# Usage: bench/ddp.sh [STEPS] [BUCKET_MB]   (run from the build directory after `make`)
#   STEPS      timed steps of each run (default 200; PyTorch runs 10 more untimed first)
#   BUCKET_MB  bucket size (default 4: with 25 the 7 MiB of fc1 and fc2 share one bucket
#              that can only start when backward has finished, on both sides)
set -euo pipefail

STEPS=${1:-200}
BUCKET=${2:-4}
HERE=$(cd "$(dirname "$0")" && pwd)
AMPD=${AMPD:-./ampd}
PY=${PYTHON:-/usr/bin/python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

[ -x "$AMPD" ] || { echo "bench/ddp.sh: $AMPD not found: run make first" >&2; exit 1; }
"$PY" -c 'import torch' 2>/dev/null ||
    { echo "bench/ddp.sh: PyTorch missing: apt-get install python3-torch" >&2; exit 1; }

# ampd WORLD HOOK -> one JSON line like torch_ddp.py's; a run that does not exit 0 ends the
# benchmark, with its status and its log's last lines
ampd_run() {
    local rc=0
    cat >"$TMP/job.json" <<EOF
{"name": "bench-ddp", "model": {"type": "mlp", "layers": [784, 1024, 1024, 10]},
 "data": {"type": "idx", "train": "fashion-mnist", "eval": "fashion-mnist:test"},
 "precision": {"dtype": "fp32"}, "optimizer": {"type": "adamw", "lr": 0.001},
 "batch_size": 256, "steps": $STEPS, "seed": 1,
 "distributed": {"world_size": $1, "comm_hook": "$2", "bucket_mb": $BUCKET}}
EOF
    "$AMPD" run "$TMP/job.json" >"$TMP/ampd.out" 2>"$TMP/ampd.err" || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "bench/ddp.sh: ampd run (world $1, hook $2) exited with status $rc, not 0:" >&2
        tail -n 5 "$TMP/ampd.err" >&2
        exit 1
    fi
    "$PY" -c '
import json, statistics, sys
steps, summary = [], None
for l in sys.stdin:
    o = json.loads(l)
    if o["type"] == "step" and o["step"] > 10:
        steps.append(o)
    elif o["type"] == "summary":
        summary = o
med = lambda k: statistics.median(s[k] for s in steps)
print(json.dumps({"impl": "ampd", "world": int(sys.argv[1]), "hook": sys.argv[2],
                  "median_step_ms": summary["median_step_ms"], "comm_bytes": int(med("comm_bytes")),
                  "comm_ms": med("comm_ms"), "comm_exposed_ms": med("comm_exposed_ms"),
                  "eval_acc": summary["eval_acc"]}))' "$1" "$2" <"$TMP/ampd.out"
}

torch_run() { # WORLD HOOK
    "$PY" "$HERE/torch_ddp.py" --world "$1" --hook "$2" --steps "$STEPS" --warmup 10 \
        --bucket-mb "$BUCKET"
}

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|f16c|avx512f|avx512_bf16|avx512_fp16' | tr '\n' ' ')
echo "MLP 784-1024-1024-10 on Fashion-MNIST, global batch 256, AdamW, fp32, $STEPS steps, buckets of $BUCKET MiB"
echo "CPU: $cpu, $(nproc) cores (${flags% }); $("$AMPD" version | sed -n 2p); torch $("$PY" -c 'import torch; print(torch.__version__)'), gloo"
for w in "1 none" "2 none" "2 fp16" "2 bf16"; do
    set -- $w
    ampd_run "$1" "$2" >>"$TMP/rows"
    if [ "$1" = 1 ] || [ "$2" != bf16 ]; then torch_run "$1" "$2" >>"$TMP/rows"; fi
done
"$PY" - "$TMP/rows" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
key = lambda r: (r["world"], r["hook"] if r["world"] > 1 else "-")
print("| world | hook | ampd step ms | DDP step ms | DDP / ampd | ampd bytes/step | DDP bytes/step "
      "| ampd comm ms (exposed) | DDP comm ms (exposed) | ampd exposed / comm | ampd acc | DDP acc |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
seen = []
for r in rows:
    if key(r) in seen:
        continue
    seen.append(key(r))
    a = next(x for x in rows if key(x) == key(r) and x["impl"] == "ampd")
    t = next((x for x in rows if key(x) == key(r) and x["impl"] != "ampd"), None)
    fmt = lambda x, k, f: f % x[k] if x else "n/a (gloo has no bf16)"
    ratio = "%.2fx" % (t["median_step_ms"] / a["median_step_ms"]) if t else "-"
    share = "%.0f%%" % (100 * a["comm_exposed_ms"] / a["comm_ms"]) if a["comm_ms"] else "-"
    comm = lambda x: "%.2f (%.2f)" % (x["comm_ms"], x["comm_exposed_ms"]) if x else "-"
    print("| %d | %s | %.2f | %s | %s | %d | %s | %s | %s | %s | %.4f | %s |" % (
        a["world"], key(a)[1], a["median_step_ms"], fmt(t, "median_step_ms", "%.2f"), ratio,
        a["comm_bytes"], fmt(t, "comm_bytes", "%d") if t else "-", comm(a), comm(t), share,
        a["eval_acc"], fmt(t, "eval_acc", "%.4f") if t else "-"))
EOF
