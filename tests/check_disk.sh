#!/bin/bash
# check_disk.sh - `ampd serve` when its database cannot be written, end to end, with a real
# daemon and real jobs (a few milliseconds a step):
#   full disk  the database on a size-limited tmpfs that a file fills mid-job: /healthz says
#              "degraded" (disk_full) while it is full, the worker waits blocked on its pipe
#              (not killed, although --worker-timeout is shorter than the wait), and once the
#              file is deleted /healthz says "ok", the job runs to succeeded and every step's
#              row is there exactly once (rows = steps), with its summary, and its recorded
#              checkpoints are exactly the files the retention kept;
#   lock       another process (the sqlite3 CLI) holds BEGIN EXCLUSIVE on the database for 20 s,
#              longer than the store's busy timeout (5 s) times the three attempts the writer
#              used to make before it dropped a batch: "degraded" (store_locked) meanwhile, no
#              row lost, the job succeeds;
#   stall      a daemon with --stall-timeout 2 on a full disk stops the waiting worker; its
#              job's end (failed, with the reason) and every row it printed, up to the
#              checkpoint it wrote when stopped, are recorded once space returns, and the
#              checkpoints the retention dropped meanwhile are gone from the record too.
# Every response is checked against the OpenAPI description (tests/openapi_check.mjs) as in
# check_daemon.sh. Needs root (to mount the tmpfs) and the sqlite3 CLI: skipped (77) with the
# reason otherwise. Every wait is bounded; the daemon, the lock holder and the mount are
# cleaned up on exit.
set -u
AMPD=${AMPD:-./ampd}
srcdir=${srcdir:-.}
if [ "$(id -u)" != 0 ]; then
    echo "SKIP: mounting a size-limited tmpfs needs root"
    exit 77
fi
if ! command -v sqlite3 >/dev/null; then
    echo "SKIP: the sqlite3 command-line shell is missing (Debian package sqlite3)"
    exit 77
fi
# shellcheck source=tests/testlib.sh
. "$srcdir/tests/testlib.sh"
TMP=$(mktemp -d)
DB=$TMP/db
DPID="" LPID=""
cleanup() {
    {
        stop_daemons
        [ -n "$LPID" ] && kill -9 "$LPID"
        wait
    } 2>/dev/null
    mountpoint -q "$DB" && umount "$DB"
    rm -rf "$TMP"
}
trap cleanup EXIT
mkdir -p "$DB" "$TMP/rec"
if ! mount -t tmpfs -o size=64m tmpfs "$DB" 2>"$TMP/mount.err"; then
    echo "SKIP: cannot mount a tmpfs here: $(cat "$TMP/mount.err")"
    exit 77
fi

start_daemon() { # extra serve arguments: sets DPID, URL
    serve "$TMP/port" "$TMP/daemon.log" --data-dir "$TMP/data" --db "$DB/ampd.db" \
        --worker-timeout 2 "$@"
    DPID=$SERVE_PID
    URL="http://127.0.0.1:${SERVE_PORT:-0}"
}
# req METHOD PATH [curl args]: sets CODE and BODY; the exchange is recorded for the OpenAPI
# check (tests/openapi_check.mjs reads <name>.req, .hdr and .body).
req() {
    local m=$1 p=$2 f
    shift 2
    f=$(mktemp "$TMP/rec/r.XXXXXX")
    printf '%s %s\n' "$m" "$p" >"$f.req"
    CODE=$(curl -sS -m 20 -X "$m" -o "$f.body" -D "$f.hdr" -w '%{http_code}' "$@" "$URL$p")
    BODY=$(cat "$f.body" 2>/dev/null)
}
jget() { printf '%s' "$BODY" | grep -o "\"$1\":[^,}]*" | head -1 | sed 's/^[^:]*://; s/"//g'; }
submit() { # spec: sets SID
    req POST /v1/jobs -H 'Content-Type: application/json' --data-binary "$1"
    SID=""
    [ "$CODE" = 201 ] && SID=$(jget id)
}
spec() { # name steps: a job of a few milliseconds a step, a checkpoint every 1000 steps
    printf '{"name": "%s", "model": {"layers": [64, 256, 256, 10]}, %s, %s, "steps": %s}' \
        "$1" '"data": {"type": "synthetic", "train_size": 512, "eval_size": 128}' \
        '"batch_size": 32, "threads": 1, "checkpoint_every": 1000' "$2"
}
step_of() { # id -> the job's recorded progress
    req GET "/v1/jobs/$1"
    printf '%s' "$BODY" | grep -o '"progress":{"step":[0-9]*' | grep -o '[0-9]*$'
}
past_step() { # id step: the job's progress has reached the step
    local s
    s=$(step_of "$1")
    [ "${s:-0}" -ge "$2" ]
}
wait_step() { wait_for "$3" past_step "$1" "$2"; } # id step seconds
wait_status() { # id status seconds
    local st=""
    for _ in $(seq 1 $(($3 * 10))); do
        req GET "/v1/jobs/$1"
        st=$(jget status)
        [ "$st" = "$2" ] && return 0
        sleep 0.1
    done
    echo "  job $1 is \"$st\", expected \"$2\"" >&2
    return 1
}
HEALTH=""
wait_health() { # ok | degraded REASON, then seconds
    local want=$1 reason=${2:-} n
    [ "$want" = ok ] && n=$2 || n=$3
    for _ in $(seq 1 $((n * 10))); do
        req GET /healthz
        HEALTH=$BODY
        if [ "$want" = ok ]; then
            [ "$CODE:$BODY" = '200:{"status":"ok"}' ] && return 0
        elif [ "$CODE" = 200 ] && [ "$(jget status)" = degraded ] &&
            [ "$(jget reason)" = "$reason" ]; then
            return 0
        fi
        sleep 0.1
    done
    echo "  /healthz: $CODE $HEALTH" >&2
    return 1
}
blocked_on_pipe() { # pid: waits within 10 s until it sleeps in a write to its full pipe
    for _ in $(seq 1 100); do
        grep -q pipe_write "/proc/$1/wchan" 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}
rows_are_1_to() { # id n: the job's raw metric steps are exactly 1..n, once each
    req GET "/v1/jobs/$1/metrics?fields=loss&format=csv"
    printf '%s\n' "$BODY" | tail -n +2 | cut -d, -f1 >"$TMP/steps"
    echo "  job $1: $(wc -l <"$TMP/steps") rows, $(sort -un "$TMP/steps" | wc -l) distinct steps," \
        "steps $(head -1 "$TMP/steps")..$(tail -1 "$TMP/steps") (want 1..$2)" >&2
    seq 1 "$2" | cmp -s - "$TMP/steps"
}
ckpts_consistent() { # id: the recorded checkpoints are exactly the files in the job's directory
    req GET "/v1/jobs/$1/checkpoints"
    printf '%s' "$BODY" | grep -o '"step":[0-9]*' | grep -o '[0-9]*$' | sort -n >"$TMP/ck.rec"
    find "$TMP/data/jobs/$1" -name 'ckpt-*.safetensors' -printf '%f\n' |
        sed 's/^ckpt-//; s/\.safetensors$//' | sort -n >"$TMP/ck.files"
    echo "  job $1: checkpoints recorded: $(tr '\n' ' ' <"$TMP/ck.rec")files:" \
        "$(tr '\n' ' ' <"$TMP/ck.files")" >&2
    [ -s "$TMP/ck.rec" ] && cmp -s "$TMP/ck.rec" "$TMP/ck.files"
}
db_rows() { # id: metric rows in the database file, counted by the sqlite3 CLI
    sqlite3 "$DB/ampd.db" "SELECT COUNT(*) FROM metrics WHERE job_id=$1"
}
fill_disk() { dd if=/dev/zero of="$DB/fill" bs=1M >/dev/null 2>&1 || true; }

# ---- a full disk mid-job --------------------------------------------------------------------
start_daemon
check "serve starts on a database in a 64 MiB tmpfs" wait_health ok 10
submit "$(spec full 12000)"
id1=$SID
check "a 12000-step job is submitted" test -n "$id1"
check "... and runs" wait_step "$id1" 100 60
fill_disk
check "the disk is full" test "$(df -P "$DB" | awk 'NR == 2 {print $4}')" -lt 64
check "/healthz says degraded (disk_full) while it is full" wait_health degraded disk_full 30
echo "  /healthz: $HEALTH"
full_health=$HEALTH
wpid=$(worker_pids "$id1" | head -1)
check "the job's worker runs" test -n "$wpid"
check "... paused: blocked writing to its full pipe" blocked_on_pipe "${wpid:-none}"
# the time itself is what is tested: paused longer than --worker-timeout 2 and than the three
# attempts of old (0.6 s), the worker is still not killed as hung
sleep 4
check "... and not killed as hung after 4 s of it" kill -0 "${wpid:-none}"
req GET "/v1/jobs/$id1"
check "the job is still running" test "$(jget status)" = running
wait_health degraded disk_full 1 >/dev/null 2>&1
check "/healthz still says degraded, with what is held" \
    grep -q '"status":"degraded","reason":"disk_full","message":"the disk is full: .*"held":[0-9]' \
    <<<"$HEALTH"
rm -f "$DB/fill"
check "once the file is deleted /healthz says ok" wait_health ok 30
check "the job runs to its end and succeeds" wait_status "$id1" succeeded 120
check "every step's row is there exactly once (1..12000)" rows_are_1_to "$id1" 12000
check "... in the database file too (12000 rows)" test "$(db_rows "$id1")" = 12000
req GET "/v1/jobs/$id1"
check "the job's summary is recorded" grep -q '"summary":{"type":"summary"' <<<"$BODY"
check "... and its last checkpoint (12000)" grep -q '"checkpoint_step":12000,' <<<"$BODY"
check "... and the checkpoints kept are the files there, no more, no fewer" ckpts_consistent "$id1"
check "the daemon logged the full disk" grep -q 'the store cannot write (the disk is full' \
    "$TMP/daemon.log"
check "... and that nothing held was lost" grep -q 'nothing held was lost' "$TMP/daemon.log"

# ---- another process holds the write lock ---------------------------------------------------
submit "$(spec locked 30000)"
id2=$SID
check "a 30000-step job runs" wait_step "${id2:-0}" 100 60
{
    echo '.timeout 20000'
    echo 'BEGIN EXCLUSIVE;'
    echo "SELECT 'locked';"
    sleep 20
    echo 'COMMIT;'
    echo "SELECT 'released';"
} | sqlite3 "$DB/ampd.db" >"$TMP/lock.out" 2>&1 &
LPID=$!
for _ in $(seq 1 200); do
    grep -q locked "$TMP/lock.out" && break
    sleep 0.1
done
t0=$(date +%s)
check "the sqlite3 shell holds BEGIN EXCLUSIVE" grep -q locked "$TMP/lock.out"
check "/healthz says degraded (store_locked) while it does" wait_health degraded store_locked 15
echo "  /healthz: $HEALTH"
lock_health=$HEALTH
wpid=$(worker_pids "$id2" | head -1)
check "the worker is paused" blocked_on_pipe "${wpid:-none}"
wait "$LPID"
LPID=""
held=$(($(date +%s) - t0))
check "the lock was held ${held} s: longer than 3 attempts of the 5 s busy timeout" \
    test "$held" -ge 17
check "... and released" grep -q released "$TMP/lock.out"
check "/healthz says ok again" wait_health ok 30
check "the worker was not killed" kill -0 "${wpid:-none}"
check "the job succeeds" wait_status "$id2" succeeded 120
check "every step's row is there exactly once (1..30000)" rows_are_1_to "$id2" 30000
check "... in the database file too (30000 rows)" test "$(db_rows "$id2")" = 30000
check "the daemon logged the lock" \
    grep -q 'the store cannot write (the database is locked by another process' "$TMP/daemon.log"
check "no row was lost, no worker killed" \
    sh -c "! grep -E 'LOST|printed nothing' '$TMP/daemon.log'"

# ---- the stall timeout: a job stopped while the disk is full ---------------------------------
kill -TERM "$DPID"
for _ in $(seq 1 400); do kill -0 "$DPID" 2>/dev/null || break; sleep 0.05; done
wait "$DPID" 2>/dev/null
DPID=""
start_daemon --stall-timeout 2
if ! wait_health ok 10; then
    bad "a daemon with --stall-timeout 2 starts (the rest is skipped)"
    echo "$pass passed, $fail failed"
    exit 1
fi
ok "a daemon with --stall-timeout 2 starts"
submit "$(spec stall 1000000)"
id3=$SID
check "a long job runs" wait_step "${id3:-0}" 100 60
wpid=$(worker_pids "$id3" | head -1)
fill_disk
check "/healthz says degraded (disk_full)" wait_health degraded disk_full 30
for _ in $(seq 1 300); do
    kill -0 "${wpid:-none}" 2>/dev/null || break
    sleep 0.1
done
check "the worker (${wpid:-not found}) is stopped after the stall timeout" \
    sh -c "[ -n '$wpid' ] && ! kill -0 '$wpid' 2>/dev/null"
req GET "/v1/jobs/$id3"
check "its job stays running while its end cannot be recorded" test "$(jget status)" = running
rm -f "$DB/fill"
check "once space returns the job fails" wait_status "$id3" failed 30
check "... with the reason" grep -qF \
    "\"error\":\"stopped: the store could not write the run's history for 2 s (the disk is full" \
    <<<"$BODY"
last=$(step_of "$id3")
req GET "/v1/jobs/$id3"
ck3=$(jget checkpoint_step)
check "the checkpoint it wrote when stopped is recorded (step ${ck3:-none} = its last step)" \
    test "${ck3:-0}" = "${last:-x}"
check "every step's row it printed is there exactly once (1..${last:-?})" \
    rows_are_1_to "$id3" "${last:-0}"
check "the checkpoints kept are the files there (the drops waited for the store)" \
    ckpts_consistent "$id3"
check "/healthz says ok" wait_health ok 10

# ---- every response above against the OpenAPI description -----------------------------------
NODE=${NODE:-$(command -v node || true)}
if [ -z "$NODE" ]; then
    echo "# SKIP the OpenAPI check of the responses: Node.js not found"
elif [ ! -d "$srcdir/web/node_modules/ajv" ] || [ ! -d "$srcdir/web/node_modules/ajv-formats" ]
then
    echo "# SKIP the OpenAPI check of the responses: $srcdir/web/node_modules has no ajv"
else
    "$NODE" "$srcdir/tests/openapi_check.mjs" api/openapi.json "$TMP/rec"
    rc=$?
    n=$(find "$TMP/rec" -name '*.req' | wc -l)
    check "every response ($n recorded) matches the OpenAPI description" test "$rc" -eq 0
fi
echo "# /healthz while the disk was full: $full_health"
echo "# /healthz while the database was locked: $lock_health"
echo "$pass passed, $fail failed"
test "$fail" -eq 0
