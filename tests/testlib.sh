# testlib.sh - what the end-to-end test scripts share (sourced by check_run.sh,
# check_daemon.sh and check_cudaemu_run.sh): the pass and fail counters and one line per
# check, "PASS: <name>" or "FAIL: <name>". Each script ends with
#   echo "$pass passed, $fail failed"; [ "$fail" -eq 0 ]
pass=0
fail=0

ok() { pass=$((pass + 1)); echo "PASS: $1"; }
bad() { fail=$((fail + 1)); echo "FAIL: $1"; }
check() { # name, command...
    local name=$1
    shift
    if "$@"; then ok "$name"; else bad "$name"; fi
}
