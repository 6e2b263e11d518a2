#!/bin/sh
# build.sh - the libraries for the fuzzers (`make fuzz`, Makefile.am): every C source named
# compiled with $FUZZ_CC and $FUZZ_CFLAGS plus -fsanitize=fuzzer-no-link (the coverage
# libFuzzer is guided by) into tests/fuzz/obj/, in parallel, then archived into ARCHIVE.
# A source is compiled again when it is newer than its object, every one when a header
# named is newer than the archive.
#   FUZZ_CC=clang FUZZ_CFLAGS='...' build.sh ARCHIVE SRCDIR FILE...
# FILE: the sources and headers, relative to the build or the source directory.
set -eu
lib=$1
srcdir=$2
shift 2
objdir=tests/fuzz/obj
mkdir -p "$objdir"
all=false
for f in "$@"; do
    case $f in *.h)
        p=$f
        [ -f "$p" ] || p=$srcdir/$f
        if [ ! -f "$lib" ] || [ "$p" -nt "$lib" ]; then all=true; fi ;;
    esac
done
objs=""
jobs=""
for f in "$@"; do
    case $f in *.c) ;; *) continue ;; esac
    src=$f
    [ -f "$src" ] || src=$srcdir/$f
    obj=$objdir/$(printf '%s' "$f" | tr / _ | sed 's/\.c$/.o/')
    objs="$objs $obj"
    if $all || [ ! -f "$obj" ] || [ "$src" -nt "$obj" ]; then
        jobs="$jobs $src:$obj"
    fi
done
if [ -n "$jobs" ]; then
    # shellcheck disable=SC2016 # expanded by the inner shell
    printf '%s\n' $jobs | xargs -P "$(nproc 2>/dev/null || echo 2)" -n 1 sh -c '
        src=${1%%:*} obj=${1#*:}
        [ "${V:-0}" = 1 ] || echo "  FUZZCC   $src"
        # shellcheck disable=SC2086 # the flags are words
        $FUZZ_CC $FUZZ_CFLAGS -fsanitize=fuzzer-no-link -c -o "$obj" "$src"' sh
fi
rm -f "$lib"
# shellcheck disable=SC2086
ar cr "$lib" $objs
