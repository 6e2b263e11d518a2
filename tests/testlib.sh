# testlib.sh - what the end-to-end test scripts share (sourced by check_run.sh,
# check_daemon.sh and check_cudaemu_run.sh): the pass and fail counters and one line per
# check, "PASS: <name>" or "FAIL: <name>", and flip_byte, which damages a file. Each script
# ends with
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
flip_byte() { # file offset: invert the byte at offset (negative: counted from the end)
    local f=$1 off=$2 b
    [ "$off" -lt 0 ] && off=$(($(stat -c %s "$f") + off))
    b=$(od -An -tu1 -j "$off" -N1 "$f" | tr -d ' ')
    printf "\\$(printf %o $((255 - b)))" | dd of="$f" bs=1 seek="$off" conv=notrunc 2>/dev/null
}
