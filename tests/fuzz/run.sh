#!/bin/bash
# run.sh - run every fuzzer for SECONDS (`make fuzz-run`; CI: 60 each), one after the other:
#   run.sh SECONDS CORPUS-DIR FUZZER...
# A fuzzer tests/fuzz/fuzz_NAME starts from the checked-in seeds and regression inputs of
# CORPUS-DIR/NAME/ and writes what it finds new to tests/fuzz/out/NAME/corpus/ (never to the
# checked-in corpus). A crash, a sanitizer report, a leak, an input slower than 10 s or a
# failed property (fuzz.h's fuzz_fail) stops that fuzzer: its log's last lines and the
# input (tests/fuzz/out/NAME/crash-*, as hex) are printed, then the lines that say why
# once more, and run.sh exits 1 after the others ran. One summary line per fuzzer:
# executions, exec/s, coverage, corpus size.
set -u
secs=$1
corpus=$2
shift 2
out=tests/fuzz/out
failed=0
for f in "$@"; do
    name=${f##*/fuzz_}
    dir=$out/$name
    rm -rf "$dir"
    mkdir -p "$dir/corpus" "$dir/tmp"
    TMPDIR=$PWD/$dir/tmp "$f" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$dir/" "$dir/corpus" "$corpus/$name" >"$dir/log" 2>&1
    rc=$?
    execs=$(grep -m1 '^stat::number_of_executed_units:' "$dir/log" | awk '{print $2}')
    rate=$(grep -m1 '^stat::average_exec_per_sec:' "$dir/log" | awk '{print $2}')
    cov=$(grep -E '^#[0-9]+' "$dir/log" | tail -1 | grep -o 'cov: [0-9]*' | awk '{print $2}')
    units=$(find "$dir/corpus" -type f | wc -l)
    printf 'fuzz %-7s %ss: %s executions, %s exec/s, coverage %s, %s new inputs, exit %s\n' \
        "$name" "$secs" "${execs:-?}" "${rate:-?}" "${cov:-?}" "$units" "$rc"
    if [ "$rc" -ne 0 ] || ls "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-* \
        >/dev/null 2>&1; then
        failed=1
        echo "---- fuzz $name FAILED; the end of its log ($dir/log):"
        tail -n 60 "$dir/log"
        for a in "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-*; do
            [ -f "$a" ] || continue
            echo "---- $a ($(wc -c <"$a") bytes; replay: $f $a):"
            od -A d -t x1z -v "$a" | head -n 64
        done
        # the cause again, last: a CI log is often read from its end
        echo "---- fuzz $name: why it failed:"
        grep -E -m 8 'property failed|ERROR: |runtime error|SUMMARY: |Timeout|out-of-memory' \
            "$dir/log" || echo "(no sanitizer or property line; see $dir/log)"
    fi
done
exit "$failed"
