# testlib.sh - what the end-to-end test scripts share (sourced by the tests/check_*.sh
# scripts): the pass and fail counters and one line per check, "PASS: <name>" or
# "FAIL: <name>", status_is, the check of a command's exit status, and flip_byte, which
# damages a file. Each script ends with
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
