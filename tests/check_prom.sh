#!/bin/bash
# check_prom.sh - /metrics as a real Prometheus sees it: Debian's prometheus scrapes a real
# `ampd serve` on loopback every second (temporary storage, its own free port), and the
# test asks Prometheus's HTTP API, not ampd, what it stored:
#   the target is up and the samples carry ampd's job_id label (no exported_job: ampd leaves
#   Prometheus's own job label alone); the job's loss scale and the step-time histogram
#   (ampd_step_duration_seconds_count equals the job's stored steps, its +Inf bucket the
#   count, its sum the stored step times', histogram_quantile works on it); after the job
#   has ended (it runs until the test cancels it) its last values are still scraped
#   (--metrics-keep), ampd_job_running 0.
# Exits 77 when prometheus or jq is not installed (Debian packages `prometheus`, `jq`).
set -u
AMPD=${AMPD:-./ampd}
PROM=$(command -v prometheus || true)
if [ -z "$PROM" ] || ! command -v jq >/dev/null; then
    echo "SKIP: prometheus or jq is not installed (apt install prometheus jq)"
    exit 77
fi
PPID_PROM=""
cleanup_more() { # before test_tmp's cleanup
    [ -n "$PPID_PROM" ] && kill -9 "$PPID_PROM" 2>/dev/null
    return 0
}
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp

serve "$TMP/port" "$TMP/daemon.log" --data-dir "$TMP/data" --db "$TMP/ampd.db" \
    --no-dashboard --metrics-keep 600
PORT=$SERVE_PORT
URL="http://127.0.0.1:${PORT:-0}"
if [ -z "$PORT" ]; then
    bad "ampd serve starts"
    cat "$TMP/daemon.log"
    exit 1
fi
ok "ampd serve starts"

cat >"$TMP/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: ampd
    static_configs:
      - targets: ["127.0.0.1:$PORT"]
EOF
# Prometheus on a random loopback port; another one when that port was taken
for _ in 1 2 3 4 5; do
    PPORT=$((20000 + RANDOM % 40000))
    PURL="http://127.0.0.1:$PPORT"
    "$PROM" --config.file="$TMP/prometheus.yml" --storage.tsdb.path="$TMP/tsdb" \
        --web.listen-address="127.0.0.1:$PPORT" >"$TMP/prometheus.log" 2>&1 &
    PPID_PROM=$!
    for _ in $(seq 1 120); do
        curl -sf -m 2 "$PURL/-/ready" >/dev/null 2>&1 && break 2
        kill -0 "$PPID_PROM" 2>/dev/null || break
        sleep 0.25
    done
    kill -9 "$PPID_PROM" 2>/dev/null
    wait "$PPID_PROM" 2>/dev/null
    PPID_PROM=""
done
if [ -z "$PPID_PROM" ]; then
    bad "Prometheus starts"
    cat "$TMP/prometheus.log"
    exit 1
fi
ok "Prometheus starts"

# query EXPR: the result vector of an instant query (JSON), "" on error
query() {
    curl -sS -m 10 -G --data-urlencode "query=$1" "$PURL/api/v1/query" 2>/dev/null |
        jq -c 'select(.status == "success") | .data.result'
}
# value EXPR: the value of the first sample of an instant query, "" when there is none
value() {
    query "$1" | jq -r '.[0].value[1] // empty' 2>/dev/null
}
until_value() { # EXPR WANT SECONDS: wait until EXPR's value is WANT
    local i
    for i in $(seq 1 $(($3 * 4))); do
        [ "$(value "$1")" = "$2" ] && return 0
        sleep 0.25
    done
    return 1
}

check "Prometheus scrapes ampd (up == 1)" until_value 'up{job="ampd"}' 1 30

# a job that runs until it is cancelled (however fast the machine), its scale held at 65536
spec='{"name": "prom-fp16", "model": {"layers": [64, 256, 256, 10]},
       "data": {"type": "synthetic", "train_size": 512, "eval_size": 128},
       "precision": {"dtype": "fp16", "loss_scale": {"growth_interval": 100000000}},
       "batch_size": 32, "threads": 1, "steps": 100000000}'
id=$(curl -sS -m 10 -H 'Content-Type: application/json' -d "$spec" "$URL/v1/jobs" | jq -r .id)
check "a job is submitted" test "$id" -gt 0 2>/dev/null

sel="job_id=\"$id\""
check "Prometheus stores the running job's loss scale under job_id" \
    until_value "ampd_loss_scale{$sel,name=\"prom-fp16\",dtype=\"fp16\"}" 65536 60
check "ampd_job_running is 1 while the job runs" until_value "ampd_job_running{$sel}" 1 10
check "no sample carries exported_job (ampd does not use Prometheus's job label)" \
    test "$(query 'count({exported_job!=""})')" = "[]"
check "the scrape target's own job label is kept" \
    test "$(value "count(ampd_loss_scale{$sel,job=\"ampd\"})")" = 1

# cancel it, wait for the end, then for a scrape after it
curl -sS -m 10 -X POST -H 'Content-Type: application/json' "$URL/v1/jobs/$id/cancel" >/dev/null
for _ in $(seq 1 600); do
    st=$(curl -sS -m 10 "$URL/v1/jobs/$id" | jq -r .status)
    [ "$st" = cancelled ] || [ "$st" = failed ] && break
    sleep 0.25
done
check "the job ended (cancelled)" test "$st" = cancelled
check "after the job ended its series are still scraped, ampd_job_running 0" \
    until_value "ampd_job_running{$sel}" 0 20
steps=$(curl -sS -m 10 "$URL/v1/jobs/$id/metrics?fields=step_ms&format=csv" | tail -n +2 | wc -l)
check "the histogram counts every stored step ($steps)" \
    until_value "ampd_step_duration_seconds_count{$sel}" "$steps" 20
check "its +Inf bucket is the count" \
    test "$(value "ampd_step_duration_seconds_bucket{$sel,le=\"+Inf\"}")" = "$steps"
sum=$(curl -sS -m 10 "$URL/v1/jobs/$id/metrics?fields=step_ms&format=csv" | tail -n +2 |
    awk -F, '{ s += $2 } END { printf "%.6f", s / 1000 }')
psum=$(value "ampd_step_duration_seconds_sum{$sel}")
check "its sum is the stored step times' sum ($sum s)" \
    awk -v a="$psum" -v b="$sum" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-4 * b + 1e-6) }'
med=$(value "histogram_quantile(0.5, ampd_step_duration_seconds_bucket{$sel})")
check "histogram_quantile gives a median step time ($med s)" \
    awk -v m="$med" 'BEGIN { exit !(m > 0 && m < 10) }'
final=$(curl -sS -m 10 "$URL/v1/jobs/$id/metrics?fields=loss_scale&format=csv" | tail -n 1 | cut -d, -f2)
check "the last step's loss scale reached Prometheus ($final)" \
    test "$(value "ampd_loss_scale{$sel}")" = "$final"

if [ "$fail" -ne 0 ]; then
    echo "--- prometheus.log"
    tail -n 20 "$TMP/prometheus.log"
    echo "--- daemon.log"
    tail -n 20 "$TMP/daemon.log"
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
