#!/bin/bash
# dashboard.sh - benchmark of the dashboard on a long run (docs/benchmarks.md; "series of
# 100k+ points stay smooth"): a 1,000,000-step job written through the store
# (bench/store_ingest), served by `ampd serve`, opened in headless Chromium on the run
# page, side by side in the same run with the peer: the same run's raw series fetched and
# drawn with the same chart library. Prints bench/dashboard.mjs's table.
#
# Usage: bench/dashboard.sh [REPS]   (from the build directory, after make)
set -euo pipefail
REPS=${1:-3}
AMPD=${AMPD:-./ampd}
INGEST=${INGEST:-./bench/store_ingest}
export srcdir=${srcdir:-$(dirname "$0")/..}
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
bench_init

echo "== a 1,000,000-step run through the store"
bench_serve_1m --web-root "$srcdir/web"
grep -E 'rows_per_s|db_bytes' "$TMP/ingest.txt"
JOB=$(curl -sf "$URL/v1/jobs?limit=1" | grep -o '"id":[0-9]*' | head -n 1 | cut -d: -f2)
echo "== the run page in Chromium vs the raw series (best of $REPS)"
node "$srcdir/bench/dashboard.mjs" "$URL" "$JOB" "$REPS"
