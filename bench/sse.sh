#!/bin/bash
# bench/sse.sh - what SSE subscribers cost the daemon: N clients (1000 by default) stream
# one running job from its first message, as dashboards opened late do, and the daemon's
# resident memory is read before, while they stream (the peak) and after they leave.
# Targets (issue 34): under 100 MiB while they stream, and back within 20% of the start
# after. A warm-up round of 50 clients runs first, so that the daemon's caches (SQLite's
# pages, the allocator's arenas) are already there when "before" is read.
#
# Usage: bench/sse.sh [CLIENTS]   (from the build directory after `make`; Python 3's standard
# library; needs an open-file limit of CLIENTS + 100). Only loopback; everything stops.
set -euo pipefail

N=${1:-1000}
AMPD=${AMPD:-./ampd}
[ -x "$AMPD" ] || { echo "bench/sse.sh: run make first" >&2; exit 1; }
ulimit -Sn "$((N + 200))" 2>/dev/null || { echo "bench/sse.sh: the open-file limit is below $((N + 200))" >&2; exit 1; }
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh" # for bench_cpu; common.sh's bench_init (sourced after) is the one
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
bench_init

AMPD_NVML=/nonexistent "$AMPD" serve --listen 127.0.0.1:0 --port-file "$TMP/port" \
    --data-dir "$TMP/data" --no-dashboard 2>"$TMP/serve.log" &
PIDS+=($!)
DPID=$!
for _ in $(seq 1 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
PORT=$(cat "$TMP/port")
JOB=$(curl -sf -H 'Content-Type: application/json' -X POST "http://127.0.0.1:$PORT/v1/jobs" -d '{
  "name": "bench-sse", "model": {"layers": [784, 512, 512, 10]}, "device": "cpu",
  "data": {"type": "synthetic", "train_size": 4096, "eval_size": 64}, "batch_size": 128,
  "steps": 100000000, "threads": 1}' | grep -o '"id":[0-9]*' | head -n 1 | cut -d: -f2)
sleep 8 # a few hundred steps of history for every client to catch up on
run() { python3 "$(dirname "$0")/sse_clients.py" --port "$PORT" --pid "$DPID" --job "$JOB" "$@"; }
run --clients 50 --hold 1 --settle 2 >/dev/null
r=$(run --clients "$N" --hold 5 --settle 5)
curl -sf -X POST -H 'Content-Type: application/json' "http://127.0.0.1:$PORT/v1/jobs/$JOB/cancel" >/dev/null || true

echo "== $N SSE subscribers of one running job, each from its first message"
echo "CPU: $(bench_cpu)"
python3 - "$r" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
ok_peak = r["rss_mb_peak"] < 100
ok_after = r["rss_mb_after"] <= 1.2 * r["rss_mb_before"]
print(f"| clients | caught up | RSS before | RSS peak | RSS after | after / before |")
print(f"|---|---|---|---|---|---|")
print(f"| {r['clients']} | {r['caught_up']} | {r['rss_mb_before']} MiB | {r['rss_mb_peak']} MiB "
      f"| {r['rss_mb_after']} MiB | {r['rss_mb_after'] / r['rss_mb_before']:.2f} |")
print(f"peak under 100 MiB: {'yes' if ok_peak else 'NO'}; "
      f"back within 20% of the start: {'yes' if ok_after else 'NO'}")
PY
