# bench/common.sh - sourced by bench/api.sh and bench/dashboard.sh (needs AMPD and INGEST
# set): a temporary directory whose processes are stopped and files removed on exit, and a
# daemon serving a database that holds a 1,000,000-step run written through the store.

# Sets TMP and PIDS and the exit trap.
bench_init() {
    TMP=$(mktemp -d)
    PIDS=()
    trap bench_cleanup EXIT
}

bench_cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$TMP"
}

# bench_serve_1m [SERVE ARGS...]: write the run into $TMP/ampd.db with bench/store_ingest
# (its report in $TMP/ingest.txt), start `ampd serve` on it; sets URL.
bench_serve_1m() {
    "$INGEST" 1000000 "$TMP/ampd.db" >"$TMP/ingest.txt"
    "$AMPD" serve --listen 127.0.0.1:0 --port-file "$TMP/port" --db "$TMP/ampd.db" \
        --data-dir "$TMP/data" "$@" 2>"$TMP/serve.log" &
    PIDS+=($!)
    for _ in $(seq 1 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
    URL="http://127.0.0.1:$(cat "$TMP/port")"
}
