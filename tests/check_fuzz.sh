#!/bin/bash
# check_fuzz.sh - the fuzz corpus as a regression test: every input of
# tests/fuzz/corpus/NAME/ (the seeds, and each input that once crashed a fuzzer) runs once
# through the harness tests/fuzz/fuzz_NAME.c built with the ordinary C compiler
# (tests/fuzz/replay_NAME), so the crashes that were fixed stay fixed in every build, the
# sanitizer build of CI included, with or without clang. A crash or a failed property
# aborts the replay, which fails this test.
set -u
srcdir=${srcdir:-.}
# shellcheck source=tests/testlib.sh
. "$srcdir/tests/testlib.sh"
for name in spec ckpt idx tokens http; do
    dir=$srcdir/tests/fuzz/corpus/$name
    n=$(find "$dir" -type f | wc -l)
    out=$(tests/fuzz/replay_"$name" "$dir" 2>&1)
    rc=$?
    [ "$rc" -eq 0 ] || printf '%s\n' "$out" | tail -n 30
    check "the $name harness replays its corpus ($n inputs)" test "$rc" -eq 0 -a "$n" -gt 0
done
echo "$pass passed, $fail failed"
test "$fail" -eq 0
