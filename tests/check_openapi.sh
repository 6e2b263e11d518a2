#!/bin/bash
# check_openapi.sh - the OpenAPI description (docs/openapi.yaml) against the linter and the
# code:
#   1. `redocly lint` (@redocly/cli from web/node_modules) with docs/redocly.yaml, which makes
#      the warnings that would mean a wrong or incomplete description errors;
#   2. tests/openapi_spec.mjs: the job-spec schema against the parser (the example jobs, the
#      canonical spec `ampd run` prints, every property path, the parser's key lists) and the
#      error codes against api/*.c;
#   3. the response checker of check_daemon.sh (tests/openapi_check.mjs) on made-up exchanges:
#      it passes a correct one and catches each kind of mismatch (so its PASS means something).
# The route, metric-field, layer-field and autocast-op lists are checked against the binary's
# tables in tests/check_api.c. Skipped (77) with the reason when Node.js or the npm packages
# (web/node_modules: a --disable-dashboard build without `npm ci --prefix web`) are missing.
set -u
srcdir=${srcdir:-.}
AMPD=${AMPD:-./ampd}
NODE=${NODE:-$(command -v node || true)}
NM=$srcdir/web/node_modules
if [ -z "$NODE" ]; then
    echo "SKIP: Node.js not found (build-aux/install-deps installs it)"
    exit 77
fi
for m in @redocly/cli ajv ajv-formats; do
    if [ ! -d "$NM/$m" ]; then
        echo "SKIP: $NM/$m is missing (npm ci --prefix web installs it)"
        exit 77
    fi
done
if [ ! -f api/openapi.json ]; then
    echo "FAIL: api/openapi.json was not built (make builds it from docs/openapi.yaml)"
    exit 1
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# shellcheck source=tests/testlib.sh
. "$srcdir/tests/testlib.sh"

# ---- 1. the linter ------------------------------------------------------------------------
"$NODE" "$NM/@redocly/cli/bin/cli.js" lint --config "$srcdir/docs/redocly.yaml" \
    --format=stylish "$srcdir/docs/openapi.yaml" >"$TMP/lint" 2>&1
rc=$?
sed 's/^/# /' "$TMP/lint"
check "redocly lint: docs/openapi.yaml is valid, no problem beyond the ignored ones" \
    test "$rc" -eq 0

# ---- 2. the job spec and the error codes against the code ---------------------------------
"$NODE" "$srcdir/tests/openapi_spec.mjs" api/openapi.json "$AMPD" "$srcdir" >"$TMP/spec" 2>&1
rc=$?
cat "$TMP/spec"
check "tests/openapi_spec.mjs: the job-spec schema and error codes agree with the code" \
    test "$rc" -eq 0

# ---- 3. the response checker catches mismatches ---------------------------------------------
# exchange DIR NAME METHOD PATH STATUS CONTENT-TYPE BODY [HEADER]: one recorded exchange
exchange() {
    local d=$1 n=$2
    mkdir -p "$d"
    printf '%s %s\n' "$3" "$4" >"$d/$n.req"
    printf 'HTTP/1.1 %s X\r\n' "$5" >"$d/$n.hdr"
    [ -n "$6" ] && printf 'Content-Type: %s\r\n' "$6" >>"$d/$n.hdr"
    [ -n "${8:-}" ] && printf '%s\r\n' "$8" >>"$d/$n.hdr"
    printf '\r\n' >>"$d/$n.hdr"
    printf '%s' "$7" >"$d/$n.body"
}
checker() { "$NODE" "$srcdir/tests/openapi_check.mjs" api/openapi.json "$1" >"$TMP/out" 2>&1; }
SSE_OK=$'retry: 2000\n\nid: 1\nevent: eval\ndata: {"type":"eval","step":1,"eval_loss":0.5,"eval_acc":"NaN"}\n\n'
exchange "$TMP/good" a GET /healthz 200 application/json '{"status":"ok"}'
exchange "$TMP/good" b GET /v1/jobs/7/stream 200 text/event-stream "$SSE_OK"
exchange "$TMP/good" c PUT /v1/jobs 405 application/json \
    '{"error":{"code":"method_not_allowed","field":null,"message":"no"}}' 'Allow: GET, HEAD, POST'
exchange "$TMP/good" d GET /v1/nope 404 application/json \
    '{"error":{"code":"not_found","field":null,"message":"no"}}'
exchange "$TMP/good" e DELETE /v1/jobs/3 204 '' ''
SINCE='"since":"2026-12-04T19:01:39.532Z","since_unix":1796410899.53'
exchange "$TMP/good" f GET /healthz 200 application/json \
    '{"status":"degraded","reason":"disk_full","message":"the disk is full","held":12,'"$SINCE}"
check "the response checker passes correct exchanges" checker "$TMP/good"
cat "$TMP/out"
caught() { # name, then exchange's arguments after DIR: the checker must fail it
    local name=$1
    shift
    rm -rf "$TMP/bad"
    exchange "$TMP/bad" x "$@"
    if checker "$TMP/bad"; then bad "the checker catches $name"; else ok "the checker catches $name: $(grep -m1 FAIL "$TMP/out")"; fi
}
caught "an undocumented status" GET /healthz 500 application/json '{"status":"ok"}'
caught "a wrong Content-Type" GET /healthz 200 text/plain '{"status":"ok"}'
caught "a body against the schema" GET /healthz 200 application/json '{"status":"sick"}'
caught "a degraded health without its reason" GET /healthz 200 application/json \
    '{"status":"degraded","message":"the disk is full","held":12,'"$SINCE}"
caught "a body that is not JSON" GET /v1/system 200 application/json '{"devices":'
caught "an error code of another status" GET /v1/jobs/3 404 application/json \
    '{"error":{"code":"conflict","field":null,"message":"no"}}'
caught "a bad SSE message" GET /v1/jobs/7/stream 200 text/event-stream \
    $'id: 1\nevent: eval\ndata: {"type":"eval","step":"one"}\n\n'
caught "an unknown SSE event" GET /v1/jobs/7/stream 200 text/event-stream \
    $'id: 1\nevent: gossip\ndata: {}\n\n'
caught "a 405 without Allow" PUT /v1/jobs 405 application/json \
    '{"error":{"code":"method_not_allowed","field":null,"message":"no"}}'
caught "a method answered other than 405" PUT /v1/jobs 200 application/json '{}'
caught "a body where none is described" DELETE /v1/jobs/3 204 application/json '{}'

echo "$pass passed, $fail failed"
test "$fail" -eq 0
