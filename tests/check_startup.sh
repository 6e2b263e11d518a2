#!/bin/bash
# check_startup.sh - what `ampd serve` checks before it touches anything:
#   - one daemon per data directory and per database: with a daemon running a job, a second
#     daemon on the same --data-dir (another --db), and one on the same --db (another
#     --data-dir; or a symlink to it), each exits 1 naming the first one's pid and what it
#     holds; the first one's job keeps running and is never marked interrupted; once the
#     first daemon is gone (SIGKILL: the lock file stays, the lock does not) the next one
#     starts;
#   - the database's integrity (PRAGMA quick_check): a database with garbage written over
#     pages in its middle is refused with exit 1, naming the file and SQLite's finding; the
#     intact copy of it starts.
# Every daemon started here is killed on exit; every wait is bounded.
set -u
AMPD=${AMPD:-./ampd}
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp
TIMEOUT=(timeout -s KILL 30)

# start NAME ARGS...: a daemon on a free port (its log NAME.log); sets PID and URL (empty
# when it did not start)
start() {
    local name=$1
    shift
    serve "$TMP/$name.port" "$TMP/$name.log" --no-dashboard "$@"
    PID=$SERVE_PID
    URL=${SERVE_PORT:+http://127.0.0.1:$SERVE_PORT}
}
get() { curl -sS -m 10 "$URL$1"; } # path
# The job's field: its status, or its progress step
status_of() { get "/v1/jobs/$1" | grep -o '"status":"[a-z]*"' | head -1 | cut -d'"' -f4; }
step_of() { get "/v1/jobs/$1" | grep -o '"progress":{"step":[0-9]*' | grep -o '[0-9]*$'; }
past_step() { # id step: the job's progress has reached the step
    local s
    s=$(step_of "$1")
    [ "${s:-0}" -ge "$2" ]
}
wait_step() { wait_for "$3" past_step "$1" "$2"; } # id step seconds
# refused NAME ARGS...: a second daemon that must exit 1 by itself; its stderr in NAME.err
refused() {
    local name=$1
    shift
    "${TIMEOUT[@]}" "$AMPD" serve --listen 127.0.0.1:0 --no-dashboard "$@" \
        >/dev/null 2>"$TMP/$name.err"
    RC=$?
}

# ---- one daemon per data directory and per database ------------------------------------------
SPEC='{"name": "long", "model": {"layers": [64, 256, 256, 10]},
       "data": {"type": "synthetic", "train_size": 512, "eval_size": 128},
       "batch_size": 32, "threads": 1, "steps": 100000000, "checkpoint_every": 500}'
start first --data-dir "$TMP/data" --db "$TMP/run.db"
first=$PID
url1=$URL
check "the first daemon starts" test -n "$url1"
id=$(curl -sS -m 10 -H 'Content-Type: application/json' --data-binary "$SPEC" "$url1/v1/jobs" |
    grep -o '"id":[0-9]*' | head -1 | cut -d: -f2)
check "a long job is submitted" test -n "$id"
check "... and runs" wait_step "$id" 5 60

refused same-dir --data-dir "$TMP/data" --db "$TMP/other.db"
check "a second daemon on the same data directory exits 1 (got $RC)" test "$RC" -eq 1
check "... naming the first one's pid and the directory it holds" \
    grep -qF "ampd serve: another ampd (pid $first) holds the data directory $(realpath "$TMP/data")" \
    "$TMP/same-dir.err"
check "... in one line" test "$(grep -c '^ampd serve: ' "$TMP/same-dir.err")" -eq 1
check "... without creating its database" test ! -e "$TMP/other.db"

mkdir -p "$TMP/data2"
refused same-db --data-dir "$TMP/data2" --db "$TMP/run.db"
check "a second daemon on the same database exits 1 (got $RC)" test "$RC" -eq 1
check "... naming the first one's pid and the database it holds" \
    grep -qF "ampd serve: another ampd (pid $first) holds the database $TMP/run.db" \
    "$TMP/same-db.err"
check "... without making a job directory" test ! -e "$TMP/data2/jobs"
ln -s "$TMP/run.db" "$TMP/link.db"
refused link-db --data-dir "$TMP/data2" --db "$TMP/link.db"
check "... and one on a symlink to it too (got $RC)" \
    grep -qF "ampd serve: another ampd (pid $first) holds the database $TMP/link.db" \
    "$TMP/link-db.err"

URL=$url1
s1=$(step_of "$id")
check "the first daemon's job is still training after the refusals (from step ${s1:-?})" \
    wait_step "$id" $((${s1:-0} + 1)) 20
check "... and still running" test "$(status_of "$id")" = running
check "... and was never interrupted" sh -c "! curl -sS -m 10 '$URL/v1/jobs/$id/events' |
    grep -q interrupt"
check "... nor requeued" test "$(get "/v1/jobs/$id" | grep -o '"retries":[0-9]*')" = '"retries":0'
check "the first daemon logged nothing about a second one" \
    sh -c "! grep -Eq 'interrupted|ERROR' '$TMP/first.log'"

# SIGKILL leaves the lock files behind, with the dead daemon's pid in them, but no lock
kill -9 "$first"
wait "$first" 2>/dev/null
check "a dead daemon's lock files stay behind" test -s "$TMP/data/ampd.lock" -a -s "$TMP/run.db.lock"
start again --data-dir "$TMP/data" --db "$TMP/run.db"
check "the next daemon on the same directory and database starts" test -n "$URL"
check "... and writes its own pid in the lock files" \
    test "$(cat "$TMP/data/ampd.lock" "$TMP/run.db.lock" | sort -u)" = "$PID"
check "... and takes the dead one's job for interrupted (once)" \
    sh -c "grep -q 'job $id was running when the daemon stopped' '$TMP/again.log'"
kill -TERM "$PID"
wait "$PID" 2>/dev/null

# ---- the database's integrity --------------------------------------------------------------
# A database with some history: a few short jobs, then the daemon stops (WAL checkpointed).
start hist --data-dir "$TMP/hdata" --db "$TMP/hist.db"
hist=$PID
for n in 1 2 3; do
    curl -sS -m 10 -o /dev/null -H 'Content-Type: application/json' --data-binary \
        "{\"name\": \"h$n\", \"model\": {\"layers\": [16, 32, 4]}, \"data\": {\"type\":
        \"synthetic\", \"train_size\": 256, \"eval_size\": 64}, \"batch_size\": 16,
        \"threads\": 1, \"steps\": 400, \"eval_every\": 100}" "$URL/v1/jobs"
done
for _ in $(seq 1 600); do
    [ "$(get '/v1/jobs?status=succeeded' | grep -o '"id":' | wc -l)" -eq 3 ] && break
    sleep 0.05
done
check "three jobs of history succeed" \
    test "$(get '/v1/jobs?status=succeeded' | grep -o '"id":' | wc -l)" -eq 3
kill -TERM "$hist"
wait "$hist" 2>/dev/null
check "the database is whole once the daemon stopped (no WAL left)" test ! -s "$TMP/hist.db-wal"
cp "$TMP/hist.db" "$TMP/intact.db"
pages=$(($(stat -c %s "$TMP/hist.db") / 4096))
check "the database has pages to damage ($pages)" test "$pages" -ge 40
# garbage (0xA5 bytes) over a fifth of the pages, from the middle on
head -c $((pages / 5 * 4096)) /dev/zero | tr '\0' '\245' |
    dd of="$TMP/hist.db" bs=4096 seek=$((pages / 2)) conv=notrunc status=none
refused damaged --data-dir "$TMP/hdata" --db "$TMP/hist.db"
check "a damaged database is refused (exit 1, got $RC)" test "$RC" -eq 1
check "... naming the file and what PRAGMA quick_check found" \
    grep -qF "$TMP/hist.db is damaged: PRAGMA quick_check says: " "$TMP/damaged.err"
check "... in the start-up error" grep -qF "ampd serve: cannot open the database $TMP/hist.db" \
    "$TMP/damaged.err"
start intact --data-dir "$TMP/hdata" --db "$TMP/intact.db"
check "the intact copy starts" test -n "$URL"
check "... with its three jobs" \
    test "$(get '/v1/jobs?status=succeeded' | grep -o '"id":' | wc -l)" -eq 3
kill -TERM "$PID"
wait "$PID" 2>/dev/null

echo "$pass passed, $fail failed"
test "$fail" -eq 0
