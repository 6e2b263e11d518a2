#!/bin/bash
# check_web.sh - runs the dashboard's browser test (tests/web/dashboard.mjs) with Node.js:
# a real daemon, Debian's Chromium driven by playwright-core from web/node_modules. The
# test itself skips (exit 77) only when Chromium cannot start; a missing Node.js or
# playwright-core is a set-up error (build-aux/install-deps installs both) and fails.
set -u
srcdir=${srcdir:-.}
NODE=${NODE:-$(command -v node || true)}
if [ -z "$NODE" ]; then
    echo "FAIL: Node.js not found (install it with build-aux/install-deps)"
    exit 1
fi
if [ ! -d "$srcdir/web/node_modules/playwright-core" ]; then
    echo "FAIL: $srcdir/web/node_modules/playwright-core is missing: run npm ci --prefix web"
    exit 1
fi
# a job of 2 ranks runs under Open MPI, whose allocations that live until exit are not ours
# (an --enable-asan build; see tests/lsan.supp)
LSAN_OPTIONS="suppressions=$(cd "$srcdir/tests" && pwd)/lsan.supp:fast_unwind_on_malloc=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export srcdir LSAN_OPTIONS
exec "$NODE" "$srcdir/tests/web/dashboard.mjs"
