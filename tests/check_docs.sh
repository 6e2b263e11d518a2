#!/bin/bash
# check_docs.sh - docs/architecture.md against the code: every file it names by path
# (`gpu/format.c`, `tests/check_api.c`) exists, and every function it names (`store_flush()`,
# `sched_main()`) is defined in the tree (a C definition or macro starting a line, a JS
# function, a Python def). So the reading order cannot keep a file or function that a
# refactor moved or removed. Functions of the C library the text names as such (exit) are
# listed below.
set -u
SRC=${srcdir:-.}
DOC=$SRC/docs/architecture.md
NOT_OURS=" exit "
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL: $*"; fail=$((fail + 1)); }

[ -f "$DOC" ] || { echo "check_docs.sh: no $DOC"; exit 1; }
spans=$(grep -o "\`[^\`]*\`" "$DOC" | tr -d "\`" | sort -u)

for p in $(printf '%s\n' "$spans" | grep -E '^[a-z_.-]+/[A-Za-z0-9_./-]+\.[a-z]+$'); do
    if [ -e "$SRC/$p" ]; then ok; else bad "architecture.md names $p, which is not in the tree"; fi
done

sources=$(cd "$SRC" && git ls-files 2>/dev/null | grep -E '\.(c|h|cu|cuh|js|mjs|py)$')
[ -n "$sources" ] || sources=$(cd "$SRC" && find daemon api store gpu web/js bench tests \
    -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh' -o -name '*.js' -o -name '*.mjs' -o -name '*.py')
for f in $(printf '%s\n' "$spans" | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)()$/\1/p'); do
    case $NOT_OURS in *" $f "*) continue ;; esac
    # shellcheck disable=SC2086 # a list of paths without spaces
    if (cd "$SRC" && grep -qE "^([A-Za-z].*[^A-Za-z0-9_])?$f\(|^#define $f\(|function $f\(|def $f\(" \
        $sources); then
        ok
    else
        bad "architecture.md names $f(), which no file defines"
    fi
done

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
