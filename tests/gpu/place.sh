#!/bin/bash
# place.sh - on the GPU machine (tests/gpu/all.sh runs it after the suites): the daemon's
# view of the real GPUs and a job placed on one. Starts the packed ampd's daemon, prints
# GET /v1/resources (NVML's inventory: names, memory, health), submits a small CUDA job with
# "device": "auto", and checks that it was placed on a GPU (its start event), that its
# worker trained on cuda:0 within that CUDA_VISIBLE_DEVICES, and that it succeeded; then
# prints the /metrics GPU gauges. Everything under $OUT/place.*; every wait bounded.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/ampd-gpu}
AMPD=.gpu/tools/ampd
command -v curl >/dev/null || { echo "place.sh: SKIP: no curl on this machine"; exit 77; }
# shellcheck source=tests/gpu/libs.sh
. tests/gpu/libs.sh
export LD_LIBRARY_PATH="$PWD/.gpu/lib:$GPU_LIB_PATH" AMPD_OPENBLAS="$PWD/.gpu/lib/libopenblas.so.0"
D=$(mktemp -d)
"$AMPD" serve --listen 127.0.0.1:0 --port-file "$D/port" --data-dir "$D/data" --no-dashboard \
    >"$OUT/place.log" 2>&1 &
pid=$!
trap 'kill -9 $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$D"' EXIT
for _ in $(seq 1 100); do [ -s "$D/port" ] && break; sleep 0.1; done
U="http://127.0.0.1:$(cat "$D/port" 2>/dev/null)"
grep 'machine:' "$OUT/place.log"
curl -sf -m 10 "$U/v1/resources" | tee "$OUT/place.resources.json"; echo
id=$(curl -sf -m 30 -X POST -H 'Content-Type: application/json' "$U/v1/jobs" -d '{
  "name": "placed", "model": {"layers": [784, 512, 10]}, "precision": {"dtype": "bf16"},
  "data": {"type": "synthetic"}, "batch_size": 256, "steps": 200, "device": "auto"}' |
    grep -o '"id":[0-9]*' | head -n 1 | cut -d: -f2)
st=""
for _ in $(seq 1 600); do
    st=$(curl -sf -m 5 "$U/v1/jobs/${id:-0}" | grep -o '"status":"[a-z]*"' | head -n 1)
    case $st in *succeeded* | *failed* | *cancelled*) break ;; esac
    sleep 0.1
done
curl -sf -m 10 "$U/v1/jobs/${id:-0}/events?limit=20" >"$OUT/place.events.json"
curl -sf -m 10 "$U/metrics" | grep -E '^ampd_(gpu|cpus)' | tee "$OUT/place.metrics.txt"
rc=0
for c in "placed on GPU [0-9]" "on cuda:0 "; do
    if grep -q "$c" "$OUT/place.events.json"; then echo "PASS: the job's events say: $c"; else
        echo "FAIL: no event says: $c"; rc=1; fi
done
if [ "$st" = '"status":"succeeded"' ]; then echo "PASS: the placed job succeeded"; else
    echo "FAIL: the placed job is $st"; rc=1; fi
exit $rc
