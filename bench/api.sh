#!/bin/bash
# bench/api.sh - the store and the API under load (targets in docs/benchmarks.md), in one run:
#   1. store ingest: metric rows/s through the store's writer (bench/store_ingest), which
#      also leaves a job with a 1,000,000-step series in a database;
#   2. a daemon serves that database while a training job runs (1 BLAS thread);
#   3. wrk: GET /v1/jobs/{id} (target >= 10k req/s, p99 < 10 ms) and the 1M-step series
#      downsampled to 1000 points (target < 100 ms);
#   4. 100 concurrent SSE clients on the training job: how many received live steps.
#
# Usage: bench/api.sh [SECONDS]   (from the build directory after `make`; needs wrk and curl,
# Debian packages). Only loopback addresses are used; everything stops by itself.
set -euo pipefail

SECS=${1:-10}
AMPD=${AMPD:-./ampd}
INGEST=${INGEST:-./bench/store_ingest}
for tool in wrk curl; do
    command -v "$tool" >/dev/null || { echo "bench/api.sh: $tool missing: apt-get install $tool" >&2; exit 1; }
done
[ -x "$AMPD" ] && [ -x "$INGEST" ] || { echo "bench/api.sh: run make first" >&2; exit 1; }

# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
bench_init

echo "== store ingest (1,000,000 rows through the writer), a daemon on that database"
bench_serve_1m
cat "$TMP/ingest.txt"
BIG=$(curl -sf "$URL/v1/jobs?limit=1000" | grep -o '"id":[0-9]*' | tail -n 1 | cut -d: -f2)

curl -sf -H 'Content-Type: application/json' -X POST "$URL/v1/jobs" -d '{
  "name": "bench-train", "model": {"layers": [784, 1024, 1024, 10]},
  "data": {"type": "synthetic"}, "precision": {"dtype": "bf16"},
  "steps": 1000000, "threads": 1}' >"$TMP/job.json"
JOB=$(grep -o '"id":[0-9]*' "$TMP/job.json" | head -n 1 | cut -d: -f2)
running=no
for _ in $(seq 1 100); do
    curl -sf "$URL/v1/jobs/$JOB" | grep -q '"status":"running"' && running=yes && break
    sleep 0.2
done
[ "$running" = yes ] || { echo "bench/api.sh: job $JOB did not start" >&2; exit 1; }
echo "training job $JOB running; the 1M-step series is job $BIG"

wrk_line() { # url [threads connections] -> "req/s p99"
    wrk -t"${2:-2}" -c"${3:-32}" -d"${SECS}s" --latency "$1" >"$TMP/wrk.txt"
    rps=$(awk '/^Requests\/sec/ {print $2}' "$TMP/wrk.txt")
    p99=$(awk '$1 == "99%" {print $2}' "$TMP/wrk.txt")
    echo "$rps $p99"
}

echo "== wrk, ${SECS} s each, 2 threads, 32 connections, while job $JOB trains"
read -r rps p99 < <(wrk_line "$URL/v1/jobs/$JOB")
printf '%-46s %12s req/s   p99 %s\n' "GET /v1/jobs/{id}" "$rps" "$p99"
DS="$URL/v1/jobs/$BIG/metrics?fields=loss,loss_scale&points=1000"
read -r rps2 p992 < <(wrk_line "$DS")
printf '%-46s %12s req/s   p99 %s\n' "GET metrics, 1M steps -> 1000 points" "$rps2" "$p992"
read -r rps3 p993 < <(wrk_line "$DS" 1 1)
printf '%-46s %12s req/s   p99 %s\n' "  the same, one client at a time" "$rps3" "$p993"
one=$(curl -s -o /dev/null -w '%{time_total}' "$DS")
printf '%-46s %12s ms\n' "one downsample request (curl, end to end)" "$(awk -v t="$one" 'BEGIN {printf "%.1f", t * 1000}')"

echo "== 100 concurrent SSE clients on job $JOB for 5 s"
for i in $(seq 1 100); do
    curl -sN --max-time 5 "$URL/v1/jobs/$JOB/stream" >"$TMP/sse.$i" 2>/dev/null &
done
sleep 6
ok=0
for i in $(seq 1 100); do
    [ "$(grep -c '^event: step' "$TMP/sse.$i" || true)" -gt 0 ] && ok=$((ok + 1))
done
echo "SSE clients that received live steps: $ok / 100"
curl -sf -X POST -H 'Content-Type: application/json' "$URL/v1/jobs/$JOB/cancel" >/dev/null || true
