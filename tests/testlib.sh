# testlib.sh - what the end-to-end test scripts share (sourced by the tests/check_*.sh
# scripts): the pass and fail counters and one line per check, "PASS: <name>" or
# "FAIL: <name>", status_is, the check of a command's exit status, flip_byte, which
# damages a file, wait_for, a bounded poll, and serve, which starts `ampd serve` and waits
# for its port (stop_daemons, in a script's EXIT trap, kills every daemon it started),
# test_tmp, the temporary directory and that trap, and job_procs and worker_pids, a job's
# processes. Each script ends with
#   echo "$pass passed, $fail failed"; [ "$fail" -eq 0 ]
pass=0
fail=0

ok() { pass=$((pass + 1)); echo "PASS: $1"; }
bad() { fail=$((fail + 1)); echo "FAIL: $1"; }
check() { # name, command...: 1 when it failed, so that a test can say more
    local name=$1
    shift
    if "$@"; then ok "$name"; else bad "$name"; return 1; fi
}
# status_is NAME EXPECTED GOT: the check that a command (`ampd run`: 0 succeeded, 1 failed,
# 2 refused, 130 interrupted) exited with EXPECTED; its line names both, and a wrong status
# above 128 as the signal it would be, e.g. for a run that printed its summary and then
# aborted:
#   "$AMPD" run - <"$TMP/job.json" >"$TMP/out" 2>"$TMP/err"
#   status_is "the job" 0 $?
# prints "FAIL: the job: exit status 0 (got 134 = 128 + SIGABRT)". Output that a test also
# checks goes to a file first: in `ampd run - | grep ...` the status would be grep's.
status_is() {
    local got=$3 sig=""
    if [ "$got" != "$2" ] && [ "$got" -gt 128 ] 2>/dev/null &&
        sig=$(kill -l "$got" 2>/dev/null); then
        sig=" = 128 + SIG$sig"
    fi
    check "$1: exit status $2 (got $got$sig)" test "$got" = "$2"
}
flip_byte() { # file offset: invert the byte at offset (negative: counted from the end)
    local f=$1 off=$2 b
    [ "$off" -lt 0 ] && off=$(($(stat -c %s "$f") + off))
    b=$(od -An -tu1 -j "$off" -N1 "$f" | tr -d ' ')
    printf "\\$(printf %o $((255 - b)))" | dd of="$f" bs=1 seek="$off" conv=notrunc 2>/dev/null
}
wait_for() { # seconds command...: 0 once the command succeeds (tried every 0.1 s), else 1
    local n=$(($1 * 10))
    shift
    for _ in $(seq 1 "$n"); do
        "$@" && return 0
        sleep 0.1
    done
    return 1
}

# serve PORT-FILE LOG [serve arguments]: `$AMPD serve --listen 127.0.0.1:0 --port-file
# PORT-FILE [arguments]` in the background, its output appended to LOG; variables set before
# the call (VAR=value serve ...) reach it as they would a command. Waits until it has written
# its port, it has exited, or $SERVE_WAIT_S (10) seconds have passed. Sets SERVE_PID and
# SERVE_PORT (empty when it did not start); returns 0 when it started. Every pid goes to
# SERVED, for stop_daemons.
SERVED=()
serve() {
    local pf=$1 log=$2 end
    shift 2
    rm -f "$pf"
    "$AMPD" serve --listen 127.0.0.1:0 --port-file "$pf" "$@" >>"$log" 2>&1 &
    SERVE_PID=$!
    SERVED+=("$SERVE_PID")
    end=$((SECONDS + ${SERVE_WAIT_S:-10}))
    while [ ! -s "$pf" ] && [ "$SECONDS" -le "$end" ] && kill -0 "$SERVE_PID" 2>/dev/null; do
        sleep 0.05
    done
    SERVE_PORT=$(cat "$pf" 2>/dev/null)
    [ -n "$SERVE_PORT" ]
}
# A job's processes under a daemon whose data directory is $TMP/data: job_procs ID, every
# process whose last argument is the job's spec ($TMP/data/jobs/ID/spec.json: its worker,
# mpirun and the ranks), worker_pids ID those that are `ampd run` (the worker and the ranks),
# as pgrep -f would find them, without procps.
job_procs() {
    local f argv
    for f in /proc/[0-9]*/cmdline; do
        { mapfile -d '' -t argv <"$f"; } 2>/dev/null || continue
        if [ "${#argv[@]}" -ge 2 ] && [ "${argv[-1]}" = "$TMP/data/jobs/$1/spec.json" ] &&
            { [ "${2:-}" != run ] || [ "${argv[1]}" = run ]; }; then
            f=${f#/proc/}
            echo "${f%/cmdline}"
        fi
    done
}
worker_pids() { job_procs "$1" run; }
# test_tmp: TMP, a new temporary directory, and an EXIT trap (SIGTERM and SIGINT exit through
# it too) that runs the script's
# cleanup_more (when it has one: the other processes it started), kills every daemon serve
# started, waits for the script's background jobs and removes TMP.
test_tmp() {
    TMP=$(mktemp -d)
    trap test_cleanup EXIT
    trap 'exit 143' TERM # a test stopped from outside (make's, a timeout's) still cleans up
    trap 'exit 130' INT
}
test_cleanup() {
    if declare -F cleanup_more >/dev/null; then cleanup_more; fi
    stop_daemons
    wait 2>/dev/null
    rm -rf "$TMP"
}
stop_daemons() { # kill -9 every daemon serve started that is still running
    local p
    for p in "${SERVED[@]}"; do
        if kill -0 "$p" 2>/dev/null; then
            kill -9 "$p"
            wait "$p" # reaped here, so the shell does not report it "Killed"
        fi 2>/dev/null
    done
    return 0
}
