#!/bin/bash
# check_daemon.sh - `ampd serve` end to end over HTTP, as a user drives it with curl: a real
# daemon on a free loopback port (it writes the port it bound to --port-file) with a fresh
# database and data directory, small synthetic jobs, and:
#   submit -> running -> succeeded, one metric row per step; a downsampled series that keeps
#   every overflow step; CSV export; an SSE client that sees live steps and resumes with
#   Last-Event-ID without a gap or a duplicate; cancel (a checkpoint exists) and resume (one
#   row per step); the retention (a 1000-step job checkpointing every step keeps 3, its disk
#   use in the API and on disk); a resume past damaged checkpoints (truncated, a flipped
#   byte, a deleted file: events say why each was skipped, the steps after it equal an
#   uninterrupted run's); delete (404 afterwards); list filters and the keyset cursor; /metrics as
#   Prometheus text; the dashboard's static files at / (from --web-root: content types,
#   no escape from the root, 404 and 405 as JSON, the API beside them) and how the default
#   web root is found; more than 40 malformed or hostile requests answered with the right
#   4xx JSON error while the daemon keeps serving; start-up errors; kill -9 of the daemon
#   mid-job and a restart that resumes from the last checkpoint with exactly one row per
#   step; kill -9 of a worker fails its job with a reason and the next queued job runs; a
#   graceful stop, damaged checkpoints, and a restart that resumes from the newest one left
#   that verifies; what a page of another site could send (a change without Content-Type:
#   application/json, a foreign Origin, a DNS-rebinding Host, two Content-Length headers)
#   refused while the daemon's own origin, an --allow-origin and an --allow-host are served;
#   an Idempotency-Key reused with another body refused (422); a FIFO in the web root
#   answered 404 at once and the daemon still stopping on SIGTERM within its deadline.
# Every request goes through acurl, which records it (method, path, status, headers, body);
# at the end tests/openapi_check.mjs checks every recorded response against the OpenAPI
# description (api/openapi.json, from docs/openapi.yaml): the status documented for the
# operation, the Content-Type, the body valid against the schema. That part is skipped, with
# the reason, when Node.js or web/node_modules (ajv) is missing.
# Every wait is bounded; every daemon started here is killed on exit.
set -u
AMPD=${AMPD:-./ampd}
DPID=""
cleanup_more() { # before test_tmp's cleanup
    [ -n "${SSE_PID:-}" ] && kill -9 "$SSE_PID" 2>/dev/null
    return 0
}
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp

# shellcheck source=tests/apilib.sh
. "$(dirname "$0")/apilib.sh"

job_status() { # id -> status
    req GET "/v1/jobs/$1"
    jget status
}
wait_status() { # id status seconds: 0 once the job has the status
    local id=$1 want=$2 n=$(($3 * 20)) st=""
    for _ in $(seq 1 "$n"); do
        st=$(job_status "$id")
        [ "$st" = "$want" ] && return 0
        sleep 0.05
    done
    echo "  job $id is \"$st\", expected \"$want\"" >&2
    return 1
}
wait_step() { # id step seconds: 0 once the job's progress reached the step
    local id=$1 want=$2 n=$(($3 * 20)) s
    for _ in $(seq 1 "$n"); do
        req GET "/v1/jobs/$id"
        s=$(printf '%s' "$BODY" | grep -o '"progress":{"step":[0-9]*' | grep -o '[0-9]*$')
        [ "${s:-0}" -ge "$want" ] && return 0
        sleep 0.05
    done
    return 1
}
# The raw metric steps of a job, one per line (CSV export).
raw_steps() {
    acurl -sS -m 20 "$URL/v1/jobs/$1/metrics?fields=loss&format=csv" | tail -n +2 | cut -d, -f1
}
steps_are_1_to() { # id n: the raw steps are exactly 1..n
    raw_steps "$1" >"$TMP/steps"
    seq 1 "$2" | cmp -s - "$TMP/steps"
}
healthy() {
    req GET /healthz
    [ "$CODE" = 200 ] && [ "$BODY" = '{"status":"ok"}' ]
}
submit() { # spec: sets SID to the new job's id ("" when the submit failed)
    post_json /v1/jobs "$1"
    SID=""
    [ "$CODE" = 201 ] && SID=$(jget id)
}

spec() { # name steps [extra top-level fields] [layers] [dtype/precision object]
    local name=$1 steps=$2 extra=${3:-} layers=${4:-[32, 64, 4]}
    local prec=${5:-'{"dtype": "fp32"}'}
    printf '{"name": "%s", "model": {"layers": %s}, %s, "precision": %s, %s, "steps": %s%s}' \
        "$name" "$layers" '"data": {"type": "synthetic", "train_size": 512, "eval_size": 128}' \
        "$prec" '"batch_size": 32, "threads": 1' "$steps" "$extra"
}
BIG='[64, 256, 256, 10]' # a few hundred microseconds a step: jobs that live long enough

# The dashboard served by the first daemon: a small app of our own, not web/ (which may not
# hold an app yet; the default web root is checked further down).
mkdir -p "$TMP/web/js" "$TMP/web/css"
printf '<!doctype html><title>ampd test app</title>\n' >"$TMP/web/index.html"
printf 'export const answer = 42;\n' >"$TMP/web/js/x.js"
printf 'body { margin: 0; }\n' >"$TMP/web/css/x.css"
printf 'outside the web root\n' >"$TMP/secret.txt"
ln -s "$TMP/secret.txt" "$TMP/web/escape.txt"
WEB=$(realpath "$TMP/web")

# ---- start-up --------------------------------------------------------------------------------
ALLOWED_ORIGIN=http://allowed.example:9000
start_daemon --max-running 1 --web-root "$TMP/web" --allow-origin "$ALLOWED_ORIGIN" \
    --allow-host ampd.test
check "serve starts and writes its port" test -n "$PORT"
check "healthz" healthy
check "start-up log names URL, db, blas and device" \
    grep -q "serving http://127.0.0.1:$PORT (db $TMP/ampd.db.*blas .*device: " "$TMP/daemon.log"

check "start-up log names the dashboard's URL and files" \
    grep -qF "dashboard: http://127.0.0.1:$PORT/ (files from $WEB)" "$TMP/daemon.log"

# ---- the dashboard's static files ------------------------------------------------------------
get_file() { # path [curl args]: sets CODE, BODY and HDRS (the response headers)
    local p=$1
    shift
    BODY=$(acurl -sS -m 20 -D "$TMP/hdrs" -w '\n%{http_code}' "$@" "$URL$p" 2>&1)
    CODE=${BODY##*$'\n'}
    BODY=${BODY%$'\n'*}
    HDRS=$(tr -d '\r' <"$TMP/hdrs")
}
ctype_is() { grep -qi "^Content-Type: $1" <<<"$HDRS"; }
body_is() { printf '%s' "$BODY" | cmp -s - "$1"; } # file: BODY is exactly its content
code_and_body() { test "$CODE" = "$1" && body_is "$2"; } # status, file
code_and_type() { test "$CODE" = "$1" && ctype_is "$2"; } # status, Content-Type prefix
get_file /
check "GET / is 200" test "$CODE" = 200
check "GET / is text/html" ctype_is 'text/html; charset=utf-8$'
check "GET / is index.html" body_is "$TMP/web/index.html"
get_file /index.html
check "GET /index.html is the same file" code_and_body 200 "$TMP/web/index.html"
get_file /js/x.js
check "GET /js/x.js is 200 text/javascript" code_and_type 200 text/javascript
check "... with the file's content" code_and_body 200 "$TMP/web/js/x.js"
get_file /css/x.css
check "GET /css/x.css is 200 text/css" code_and_type 200 text/css
get_file / -I -o /dev/null
check "HEAD / is 200 text/html" code_and_type 200 text/html
web_404() { # path [curl args]: a 404 with a JSON error, and nothing of the file
    get_file "$@"
    test "$CODE" = 404 && ctype_is 'application/json' &&
        grep -qF '{"error":{"code":"not_found"' <<<"$BODY" && ! grep -q 'root:' <<<"$BODY"
}
check "GET /../../etc/passwd is a 404 JSON error" web_404 /../../etc/passwd --path-as-is
check "GET /%2e%2e/etc/passwd is a 404 JSON error" web_404 /%2e%2e/etc/passwd --path-as-is
check "GET /js/%2e%2e/%2e%2e/secret.txt is a 404" web_404 /js/%2e%2e/%2e%2e/secret.txt --path-as-is
check "a symlink out of the web root is a 404" web_404 /escape.txt
check "a missing file is a 404 JSON error" web_404 /js/missing.js
check "a directory is a 404" web_404 /js
check "/v1/ paths never fall through to files" web_404 /v1/index.html
get_file /v1/jobs
check "GET /v1/jobs still answers JSON beside the files" code_and_type 200 application/json
get_file /healthz
check "GET /healthz still answers beside the files" test "$CODE:$BODY" = '200:{"status":"ok"}'
get_file / -X POST "${AUTH[@]}"
check "POST / is a 405 JSON error" code_and_type 405 application/json
check "... method_not_allowed" grep -qF '{"error":{"code":"method_not_allowed"' <<<"$BODY"
check "... with Allow: GET, HEAD" grep -qi '^Allow: GET, HEAD$' <<<"$HDRS"
get_file /js/x.js -X DELETE "${AUTH[@]}"
check "DELETE of a file is 405" test "$CODE" = 405

# ---- submit -> running -> succeeded ----------------------------------------------------------
submit "$(spec small 300 ', "eval_every": 100, "checkpoint_every": 100')"
id1=$SID
check "submit answers 201 with an id" test -n "$id1"
check "the new job is queued or running" grep -Eq '"status":"(queued|running)"' <<<"$BODY"
location_ok() {
    acurl -sS -m 20 -o /dev/null -D - -X POST "${AUTH[@]}" -H 'Content-Type: application/json' \
        --data-binary "$(spec loc 10)" "$URL/v1/jobs" | grep -qi '^Location: /v1/jobs/[0-9]'
}
check "Location header points at the job" location_ok
check "job 1 succeeds" wait_status "$id1" succeeded 30
req GET "/v1/jobs/$id1"
check "job 1 has started and finished times" \
    test "$(jget started_at)" != null -a "$(jget finished_at)" != null
check "job shows progress 300/300" grep -q '"progress":{"step":300,"steps":300' <<<"$BODY"
check "job has a summary with eval results" \
    grep -q '"summary":{"type":"summary".*"eval_acc"' <<<"$BODY"
check "job keeps its spec" grep -q '"spec":{"name":"small"' <<<"$BODY"
check "job has its model in words" \
    grep -qF '"dtype":"fp32","model":{"type":"mlp","text":"mlp 32-64-4"},' <<<"$BODY"
check "metric rows equal the steps run (1..300)" steps_are_1_to "$id1" 300
req GET "/v1/jobs/$id1/metrics?fields=loss,loss_scale&points=0"
check "raw JSON series has 300 points" test "$(grep -o '"count":1,' <<<"$BODY" | wc -l)" -eq 300
check "raw JSON series reports total_steps" grep -q '"total_steps":300}' <<<"$BODY"
req GET "/v1/jobs/$id1/checkpoints"
check "checkpoints at 100, 200, 300" \
    test "$(grep -o '"step":[0-9]*' <<<"$BODY" | tr -dc '0-9\n' | tr '\n' ' ')" = '100 200 300 '
acurl -sS -m 20 -o "$TMP/ck.bin" "$URL/v1/jobs/$id1/checkpoints/300"
hdr=$(head -c 8 "$TMP/ck.bin" | od -An -tu8 | tr -d ' ')
check "checkpoint download is a safetensors file (header of ${hdr:-?} bytes)" \
    sh -c "test '${hdr:-0}' -gt 0 && test '${hdr:-0}' -lt $(stat -c %s "$TMP/ck.bin")"
req GET "/v1/jobs/$id1/events"
check "events record the worker's start and the end" \
    grep -q '"kind":"lifecycle","message":"worker [0-9]* started.*"message":"succeeded"' <<<"$BODY"

# ---- retention: checkpoint_every 1 for 1000 steps keeps checkpoints.keep_last (3) ------------
submit "$(spec keep 1000 ', "checkpoint_every": 1')"
idk=$SID
check "a 1000-step job checkpointing every step succeeds" wait_status "$idk" succeeded 120
req GET "/v1/jobs/$idk/checkpoints"
check "it keeps exactly 3 checkpoints: 998, 999, 1000 (the best eval and the last healthy among them)" \
    test "$(grep -o '"step":[0-9]*' <<<"$BODY" | tr -dc '0-9\n' | tr '\n' ' ')" = '998 999 1000 '
kbytes=$(jget bytes)
sum=$(grep -o '"step":[0-9]*,"bytes":[0-9]*' <<<"$BODY" | awk -F: '{ s += $NF } END { print s }')
one=$(grep -o '"step":1000,"bytes":[0-9]*' <<<"$BODY" | sed 's/.*://')
check "the list reports their disk use: ${kbytes:-?} bytes, the sum of the three" \
    test "${kbytes:-0}" -gt 0 -a "${kbytes:-0}" = "$sum"
req GET "/v1/jobs/$idk"
check "... and so does the job" test "$(jget checkpoint_bytes)" = "$kbytes"
ondisk=$(cat "$TMP/data/jobs/$idk"/ckpt-*.safetensors 2>/dev/null | wc -c)
check "... which is what its directory holds (3 files, $ondisk bytes)" \
    test "$(ls "$TMP/data/jobs/$idk" | grep -c 'ckpt-')" -eq 3 -a "$ondisk" = "$kbytes"
echo "# a 1000-step job with checkpoint_every 1 keeps $kbytes bytes of checkpoints" \
    "(all 1000 would take $((1000 * ${one:-0})))"

# ---- CSV export ------------------------------------------------------------------------------
acurl -sS -m 20 -D "$TMP/csv.h" -o "$TMP/csv" \
    "$URL/v1/jobs/$id1/metrics?format=csv&fields=loss,lr,loss_scale,overflow"
check "CSV header" test "$(head -1 "$TMP/csv")" = "step,loss,lr,loss_scale,overflow"
check "CSV has one line per step" test "$(tail -n +2 "$TMP/csv" | wc -l)" -eq 300
check "CSV rows have 5 numeric columns" \
    awk -F, 'NR > 1 && (NF != 5 || $1 !~ /^[0-9]+$/) { bad = 1 } END { exit bad }' "$TMP/csv"
check "CSV content type" grep -qi '^Content-Type: text/csv' "$TMP/csv.h"

# ---- overflow steps survive downsampling -----------------------------------------------------
ovf_prec='{"dtype": "fp16",
           "loss_scale": {"mode": "dynamic", "init": 16777216, "max_scale": 16777216}}'
submit "$(spec overflow 400 '' '[32, 64, 4]' "$ovf_prec")"
id2=$SID
check "fp16 job at scale 2^24 succeeds" wait_status "$id2" succeeded 30
acurl -sS -m 20 "$URL/v1/jobs/$id2/metrics?fields=overflow&format=csv" |
    awk -F, '$2 == 1 { print $1 }' >"$TMP/ovf_raw"
check "the first steps overflowed" test "$(head -1 "$TMP/ovf_raw")" = 1
req GET "/v1/jobs/$id2/metrics?fields=loss,loss_scale&points=10"
grep -o '"step":[0-9]*,"step_last":[0-9]*,"count":1,"overflow":true' <<<"$BODY" |
    sed 's/"step":\([0-9]*\),.*/\1/' >"$TMP/ovf_ds"
check "points=10 keeps every overflow step ($(wc -l <"$TMP/ovf_raw") of them)" \
    cmp -s "$TMP/ovf_raw" "$TMP/ovf_ds"
check "points=10 is downsampled" \
    test "$(grep -o '"count":' <<<"$BODY" | wc -l)" -le $((10 + 2 + $(wc -l <"$TMP/ovf_raw")))
req GET "/v1/jobs/$id2/events"
msg='step 1: gradients overflowed; optimizer step skipped; loss scale 1.67772e+07 -> 8.38861e+06'
check "overflow events name the scale change" \
    grep -qF "\"kind\":\"overflow\",\"message\":\"$msg\"" <<<"$BODY"

# ---- SSE: live steps, then a reconnect with Last-Event-ID ------------------------------------
submit "$(spec sse 8000 '' "$BIG")"
id3=$SID
wait_step "$id3" 5 30
acurl -sSN -m 1 "$URL/v1/jobs/$id3/stream" >"$TMP/sse1" 2>/dev/null
# the messages that arrived whole (a blank line ends each; the cut one is not dispatched)
complete() { awk '/^$/ { if (m != "") print m; m = ""; next } { m = m (m == "" ? "" : "\n") $0 }' "$1"; }
complete "$TMP/sse1" >"$TMP/sse1c"
last=$(grep '^id:' "$TMP/sse1c" | tail -1 | tr -dc '0-9')
status_mid=$(job_status "$id3")
check "SSE client saw live step events" grep -q '^data: {"type":"step"' "$TMP/sse1"
check "the job was still running when the first client left" test "$status_mid" = running
acurl -sSN -m 40 -H "Last-Event-ID: ${last:-0}" "$URL/v1/jobs/$id3/stream" >"$TMP/sse2" 2>/dev/null
check "SSE job succeeded" wait_status "$id3" succeeded 30
sse_steps() { # the step numbers of a stream's step events
    grep '^data: {"type":"step"' "$1" | sed 's/^data: {"type":"step","step":\([0-9]*\),.*/\1/'
}
sse_steps "$TMP/sse1c" >"$TMP/s1"
sse_steps "$TMP/sse2" >"$TMP/s2"
check "the reconnect (Last-Event-ID ${last:-?}) starts at the step after the last one seen" \
    test "$(head -1 "$TMP/s2")" = "$(($(tail -1 "$TMP/s1") + 1))"
check "every message id of the two streams is new and increasing" \
    awk '/^id: / { if ($2 + 0 <= prev) exit 1; prev = $2 + 0 }' <(cat "$TMP/sse1c" "$TMP/sse2")
code=$(acurl -sS -m 10 -o /dev/null -w '%{http_code}' \
    -H "Last-Event-ID: $(grep '^id:' "$TMP/sse2" | tail -1 | tr -dc '0-9')" "$URL/v1/jobs/$id3/stream")
check "a reconnect after the end is answered 204 (EventSource stops)" test "$code" = 204
seq 1 8000 >"$TMP/seq8000"
check "both streams together: every step once, no gap, no duplicate" \
    cmp -s <(cat "$TMP/s1" "$TMP/s2") "$TMP/seq8000"
check "the stream ends with the summary" grep -q '"type":"summary"' "$TMP/sse2"

# ---- cancel, resume --------------------------------------------------------------------------
submit "$(spec cancel 6000 ', "checkpoint_every": 1000' "$BIG")"
id4=$SID
wait_step "$id4" 50 30
req DELETE "/v1/jobs/$id4" "${AUTH[@]}" "${JSON[@]}"
check "delete of a running job is 409" test "$CODE" = 409
req POST "/v1/jobs/$id4/cancel" "${AUTH[@]}" "${JSON[@]}"
check "cancel answers 202" test "$CODE" = 202
check "the job becomes cancelled" wait_status "$id4" cancelled 30
req GET "/v1/jobs/$id4"
ck4=$(jget checkpoint_step)
check "cancel left a checkpoint (step ${ck4:-none})" test "${ck4:-0}" -gt 0
code=$(acurl -sS -m 20 -o /dev/null -w '%{http_code}' "$URL/v1/jobs/$id4/checkpoints/$ck4")
check "the cancel checkpoint downloads" test "$code" = 200
req POST "/v1/jobs/$id4/cancel" "${AUTH[@]}" "${JSON[@]}"
check "cancel of a cancelled job is 409" test "$CODE" = 409
check "metrics stop at the checkpoint" test "$(raw_steps "$id4" | tail -1)" = "$ck4"
req POST "/v1/jobs/$id4/resume" "${AUTH[@]}" "${JSON[@]}"
check "resume answers 202" test "$CODE" = 202
check "the resumed job succeeds" wait_status "$id4" succeeded 60
check "after the resume: exactly one row per step (1..6000)" steps_are_1_to "$id4" 6000
req GET "/v1/jobs/$id4/events?limit=1000"
check "events say it resumed from the checkpoint" \
    grep -q "resumed from the checkpoint at step $ck4" <<<"$BODY"

# ---- resume past damaged checkpoints ---------------------------------------------------------
# every checkpoint kept; cancelled after step 450; then the newest truncated, the next one
# with a byte of a tensor flipped, the third deleted: the resume continues from the fourth
walk=$(spec walk 6000 ', "checkpoint_every": 100, "checkpoints": {"keep_last": 0}' "$BIG")
submit "$walk"
idw=$SID
wait_step "$idw" 450 30
req POST "/v1/jobs/$idw/cancel" "${AUTH[@]}" "${JSON[@]}"
check "the walk job is cancelled" wait_status "$idw" cancelled 30
req GET "/v1/jobs/$idw/checkpoints"
mapfile -t cks < <(grep -o '"step":[0-9]*' <<<"$BODY" | tr -dc '0-9\n' | sort -n)
n=${#cks[@]}
check "it has more than 4 checkpoints ($n)" test "$n" -gt 4
c1=${cks[n - 1]:-0} c2=${cks[n - 2]:-0} c3=${cks[n - 3]:-0} c4=${cks[n - 4]:-0}
wdir=$TMP/data/jobs/$idw
if [ "$n" -gt 4 ]; then
    truncate -c -s -100 "$wdir/ckpt-$c1.safetensors"
    flip_byte "$wdir/ckpt-$c2.safetensors" -100
    rm -f "$wdir/ckpt-$c3.safetensors"
fi
req POST "/v1/jobs/$idw/resume" "${AUTH[@]}" "${JSON[@]}"
check "resume answers 202" test "$CODE" = 202
check "the job resumed past its damaged checkpoints succeeds" wait_status "$idw" succeeded 60
check "... with exactly one row per step (1..6000)" steps_are_1_to "$idw" 6000
req GET "/v1/jobs/$idw/events?limit=1000"
skipped_is() { # step reason: the job's events say why the checkpoint at step was skipped
    grep -q "\"step\":$1,[^}]*\"kind\":\"checkpoint\",\"message\":\"skipped the checkpoint at step $1 (ckpt-$1.safetensors): $2" <<<"$BODY"
}
check "an event says the newest ($c1) was skipped as truncated" skipped_is "$c1" 'truncated: '
check "... the next ($c2) for its checksum" skipped_is "$c2" 'checksum mismatch: crc32 '
check "... the third ($c3) as missing" skipped_is "$c3" 'missing'
check "... and that it resumed from the fourth ($c4)" \
    grep -q "resumed from the checkpoint at step $c4, the newest that verifies (3 newer skipped)" <<<"$BODY"
check "the daemon's log says so too" \
    grep -q "job $idw: skipped the checkpoint at step $c2 (ckpt-$c2.safetensors): checksum mismatch" "$TMP/daemon.log"
submit "$walk"
idr=$SID
check "the same job, uninterrupted, succeeds" wait_status "$idr" succeeded 60
acurl -sS -m 20 "$URL/v1/jobs/$idw/metrics?fields=loss,grad_norm,loss_scale&format=csv" >"$TMP/walk.csv"
acurl -sS -m 20 "$URL/v1/jobs/$idr/metrics?fields=loss,grad_norm,loss_scale&format=csv" >"$TMP/ref.csv"
check "every step of the resumed job equals the uninterrupted one's (after $c4 too)" \
    sh -c "test \$(wc -l <'$TMP/walk.csv') -eq 6001 && cmp -s '$TMP/walk.csv' '$TMP/ref.csv'"

# ---- delete ----------------------------------------------------------------------------------
req DELETE "/v1/jobs/$id1" "${AUTH[@]}" "${JSON[@]}"
check "delete answers 204" test "$CODE" = 204
req GET "/v1/jobs/$id1"
check "a deleted job is 404" test "$CODE" = 404
check "a deleted job's files are gone" test ! -e "$TMP/data/jobs/$id1"
req GET "/v1/jobs/$id1/metrics"
check "a deleted job's metrics are 404" test "$CODE" = 404

# ---- list: filters and cursor ----------------------------------------------------------------
ids() { grep -o '"id":[0-9]*' <<<"$BODY" | tr -dc '0-9\n' | tr '\n' ' '; } # ids in BODY
req GET "/v1/jobs?dtype=fp16"
check "list dtype=fp16 finds the overflow job only" test "$(ids)" = "$id2 "
req GET "/v1/jobs?status=cancelled"
check "list status=cancelled is empty" grep -q '^{"jobs":\[\],"next":null}$' <<<"$BODY"
req GET "/v1/jobs?name=sse&status=succeeded"
check "list name=sse&status=succeeded" test "$(ids)" = "$id3 "
req GET "/v1/jobs?limit=2"
page1=$(ids)
next=$(jget next)
check "list limit=2 gives 2 jobs and a cursor" \
    test "$(wc -w <<<"$page1")" -eq 2 -a -n "$next" -a "$next" != null
req GET "/v1/jobs?limit=2&after=$next"
page2=$(ids)
req GET "/v1/jobs?limit=1000"
all=$(ids)
check "the cursor pages continue the list, newest first, without overlap" \
    test "$page1$page2" = "$(echo "$all" | cut -d' ' -f1-4) "

# ---- /metrics --------------------------------------------------------------------------------
acurl -sS -m 20 "$URL/metrics" >"$TMP/prom"
prom_ok() {
    # name{label="value",...} value [timestamp]; every sample's family has a # TYPE line
    local name='[a-zA-Z_:][a-zA-Z0-9_:]*' label='[a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*"'
    local num='[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?|NaN|\+Inf|-Inf'
    SAMPLE="^$name(\\{($label(,$label)*,?)?\\})? ($num)( -?[0-9]+)?\$" awk '
    BEGIN { sample = ENVIRON["SAMPLE"] } # (not -v: awk would eat the backslashes)
    /^# TYPE / {
        if ($4 !~ /^(counter|gauge|histogram|summary|untyped)$/) { print "bad type: " $0; bad = 1 }
        if ($3 in typed) { print "duplicate TYPE: " $3; bad = 1 }
        typed[$3] = $4
        next
    }
    /^#/ || /^$/ { next }
    {
        if ($0 !~ sample) { print "bad sample: " $0; bad = 1; next }
        name = $0; sub(/[{ ].*/, "", name); base = name
        if (!(name in typed)) sub(/_(bucket|sum|count)$/, "", base)
        if (!(base in typed)) { print "no TYPE for " name; bad = 1 }
        n++
    }
    END { if (n < 5) { print "only " n " samples"; bad = 1 } exit bad }' "$TMP/prom"
}
check "/metrics parses as Prometheus text" prom_ok
check "/metrics has the loss-scale gauge" grep -q '^# TYPE ampd_loss_scale gauge' "$TMP/prom"
check "/metrics has the overflow counter" \
    grep -q '^# TYPE ampd_overflow_steps_total counter' "$TMP/prom"

# ---- malformed and hostile requests ----------------------------------------------------------
# expect STATUS CODE METHOD PATH [curl args]: the status and the JSON error's code (and, when
# FIELD is set, the field it names).
nbad=0
FIELD=""
expect() {
    local want=$1 code=$2 m=$3 p=$4 f=""
    shift 4
    req "$m" "$p" "$@"
    nbad=$((nbad + 1))
    [ -n "$FIELD" ] && f=",\"field\":\"$FIELD\""
    if [ "$CODE" = "$want" ] && grep -qF "{\"error\":{\"code\":\"$code\"$f" <<<"$BODY"; then
        ok "hostile #$nbad: $m $p -> $want $code${FIELD:+ $FIELD}"
    else
        bad "hostile #$nbad: $m $p -> $want $code${FIELD:+ $FIELD} (got $CODE: ${BODY:0:200})"
    fi
    FIELD=""
}
bad_spec() { # body status code [field]
    FIELD=${4:-}
    expect "$2" "$3" POST /v1/jobs "${AUTH[@]}" "${JSON[@]}" --data-binary "$1"
}
bad_spec '{' 400 invalid_json
bad_spec '' 400 invalid_json
bad_spec '[]' 400 invalid_spec
bad_spec '"a string"' 400 invalid_spec
bad_spec '{"steps": "100"}' 400 invalid_spec steps
bad_spec '{"steps": -1}' 400 invalid_spec steps
bad_spec '{"steps": 1.5}' 400 invalid_spec steps
bad_spec '{"steps": 1e30}' 400 invalid_spec steps
bad_spec '{"batch_size": 0}' 400 invalid_spec batch_size
bad_spec '{"batch_size": 1000000000000}' 400 invalid_spec batch_size
bad_spec '{"model": {"layers": [32, -4]}}' 400 invalid_spec 'model.layers[1]'
bad_spec '{"model": {"layers": []}}' 400 invalid_spec model.layers
bad_spec '{"model": {"layers": [100000, 100000, 100000]}}' 400 invalid_spec 'model.layers[0]'
bad_spec '{"optimizer": {"lr": "NaN"}}' 400 invalid_spec optimizer.lr
bad_spec '{"optimizer": {"lr": -0.1}}' 400 invalid_spec optimizer.lr
bad_spec '{"optimizer": {"lr": 1e999}}' 400 invalid_json
bad_spec '{"unknown_field": 1}' 400 invalid_spec unknown_field
bad_spec '{"model": {"typo": 1}}' 400 invalid_spec model.typo
bad_spec '{"precision": {"dtype": "fp64"}}' 400 invalid_spec precision.dtype
bad_spec '{"precision": {"loss_scale": {"init": -5}}}' 400 invalid_spec precision.loss_scale.init
bad_spec '{"data": {"type": "idx", "train": "/etc/passwd"}}' 400 invalid_spec data.train
bad_spec '{"data": {"type": "idx", "train": "../../../etc"}}' 400 invalid_spec data.train
bad_spec '{"name": 123}' 400 invalid_spec name
bad_spec '{"device": "tpu"}' 400 invalid_spec device
bad_spec '{"eval_every": -3}' 400 invalid_spec eval_every
bad_spec '{"model": {"layers": [65536, 65536, 65536, 65536]}}' 400 invalid_spec model.layers
check "a model that cannot fit says how much memory it needs" grep -q 'GiB' <<<"$BODY"
bad_spec "$(printf '{"name": "\xff\xfe"}')" 400 invalid_json
bad_spec "$(printf '%0.s[' $(seq 1 200))" 400 invalid_json
check "healthz after bad specs" healthy
head -c 2000000 /dev/zero | tr '\0' ' ' >"$TMP/big.json"
expect 413 body_too_large POST /v1/jobs "${AUTH[@]}" "${JSON[@]}" --data-binary @"$TMP/big.json"
expect 415 unsupported_media_type POST /v1/jobs "${AUTH[@]}" -H 'Content-Type: text/plain' \
    --data-binary '{}'
expect 415 unsupported_media_type POST /v1/jobs "${AUTH[@]}" --data-binary '{}'
expect 401 unauthorized POST /v1/jobs "${JSON[@]}" --data-binary '{}'
expect 401 unauthorized POST /v1/jobs -H 'Authorization: Bearer wrong' "${JSON[@]}" \
    --data-binary '{}'
expect 401 unauthorized POST "/v1/jobs/$id2/cancel" -H "Authorization: Basic $TOKEN"
expect 401 unauthorized DELETE "/v1/jobs/$id2"
expect 405 method_not_allowed PUT /v1/jobs "${AUTH[@]}"
expect 405 method_not_allowed DELETE /healthz "${AUTH[@]}"
expect 405 method_not_allowed PATCH "/v1/jobs/$id2" "${AUTH[@]}"
expect 405 method_not_allowed POST /metrics "${AUTH[@]}"
check "healthz after bad methods" healthy
expect 404 not_found GET /v1/nope
expect 404 not_found GET /v1/jobs/abc
expect 404 not_found GET /v1/jobs/999999
expect 404 not_found GET /v1/jobs/-1
expect 404 not_found GET "/v1/jobs/$id2/checkpoints/99999"
expect 404 not_found POST /v1/jobs/999999/cancel "${AUTH[@]}" "${JSON[@]}"
FIELD=limit
expect 400 invalid_parameter GET '/v1/jobs?limit=0'
expect 400 invalid_parameter GET '/v1/jobs?limit=abc'
FIELD=status
expect 400 invalid_parameter GET '/v1/jobs?status=bogus'
expect 400 invalid_parameter GET '/v1/jobs?dtype=fp64'
expect 400 invalid_parameter GET '/v1/jobs?after=-5'
expect 400 invalid_parameter GET "/v1/jobs/$id2/metrics?points=-1"
expect 400 invalid_parameter GET "/v1/jobs/$id2/metrics?points=99999999999999999999"
FIELD=fields
expect 400 invalid_parameter GET "/v1/jobs/$id2/metrics?fields=nope"
expect 400 invalid_parameter GET "/v1/jobs/$id2/metrics?format=xml"
expect 400 invalid_parameter GET "/v1/jobs/$id2/metrics?from=10&to=5"
expect 400 invalid_parameter GET /v1/compare
expect 400 invalid_parameter GET '/v1/compare?ids=a,b'
expect 409 conflict POST "/v1/jobs/$id2/cancel" "${AUTH[@]}" "${JSON[@]}"
expect 409 conflict POST "/v1/jobs/$id2/resume" "${AUTH[@]}" "${JSON[@]}"
FIELD=Idempotency-Key
expect 400 invalid_request POST /v1/jobs "${AUTH[@]}" "${JSON[@]}" \
    -H 'Idempotency-Key: has spaces' --data-binary "$(spec idem 10)"
# ---- Idempotency-Key: the same body again is the first job; another body is refused ---------
post_json /v1/jobs "$(spec idem 10)" -H 'Idempotency-Key: idem-1'
idi=$(jget id)
check "a submit with an Idempotency-Key answers 201" test "$CODE" = 201 -a -n "$idi"
post_json /v1/jobs "$(spec idem 10)" -H 'Idempotency-Key: idem-1'
check "the same key and body again answer 200 with the same job" \
    test "$CODE:$(jget id)" = "200:$idi"
FIELD=Idempotency-Key
expect 422 idempotency_key_reused POST /v1/jobs "${AUTH[@]}" "${JSON[@]}" \
    -H 'Idempotency-Key: idem-1' --data-binary "$(spec idem 11)"
check "... naming the key and its job" \
    grep -qF "Idempotency-Key \\\"idem-1\\\" was used for job $idi with another body" <<<"$BODY"
req GET "/v1/jobs?name=idem"
check "... and queueing nothing" test "$(ids)" = "$idi "

# ---- what a page of another site could send --------------------------------------------------
# A page of another origin can make the browser send a form's POST or a no-cors fetch (no
# custom header, Content-Type text/plain at most) with no token; a DNS-rebinding page reaches
# the daemon under its own name. Every change needs Content-Type: application/json, a foreign
# Origin is refused, and so is a Host that does not name the daemon.
submit "$(spec xsite 1000000 '' "$BIG")"
idx=$SID
wait_step "$idx" 5 30
FIELD=Content-Type
expect 415 unsupported_media_type POST "/v1/jobs/$idx/cancel" "${AUTH[@]}" # curl -X POST
check "... saying which header to add" \
    grep -qF "needs the header Content-Type: application/json" <<<"$BODY"
FIELD=Content-Type
expect 415 unsupported_media_type POST "/v1/jobs/$idx/cancel" "${AUTH[@]}" \
    -H 'Content-Type: text/plain' --data-binary '{}'
FIELD=Content-Type
expect 415 unsupported_media_type DELETE "/v1/jobs/$idx" "${AUTH[@]}"
EVIL=(-H 'Origin: http://evil.example:8000')
FIELD=Origin
expect 403 forbidden_origin POST "/v1/jobs/$idx/cancel" "${AUTH[@]}" "${JSON[@]}" "${EVIL[@]}"
FIELD=Origin
expect 403 forbidden_origin GET /v1/jobs "${EVIL[@]}"
FIELD=Origin
expect 403 forbidden_origin GET "/v1/jobs/$idx/stream" -H 'Origin: null'
FIELD=Origin
expect 403 forbidden_origin GET /v1/jobs -H "Origin: http://localhost:$PORT"
FIELD=Host
expect 421 misdirected_request GET /v1/jobs -H "Host: rebind.example:$PORT"
FIELD=Host
expect 421 misdirected_request POST /v1/jobs -H "Host: rebind.example:$PORT" "${AUTH[@]}" \
    "${JSON[@]}" --data-binary "$(spec rebind 10)"
FIELD=Host
expect 421 misdirected_request GET /healthz -H 'Host: 127.0.0.1'
FIELD=Content-Length
expect 400 invalid_request POST /v1/jobs "${AUTH[@]}" "${JSON[@]}" -H 'Content-Length: 2' \
    -H 'Content-Length: 2' --data-binary '{}'
FIELD=Content-Length
expect 400 invalid_request POST /v1/jobs "${AUTH[@]}" "${JSON[@]}" \
    -H 'Transfer-Encoding: chunked' -H 'Content-Length: 2' --data-binary '{}'
check "the job still runs after all of them" test "$(job_status "$idx")" = running
req GET "/v1/jobs?name=rebind"
check "... and the rebinding page queued nothing" test "$(ids)" = ""
req GET /v1/jobs -H "Origin: http://127.0.0.1:$PORT"
check "the daemon's own origin reads" test "$CODE" = 200
req GET /v1/jobs -H "Host: localhost:$PORT"
check "Host localhost with the port is served" test "$CODE" = 200
req GET /v1/jobs -H "Host: ampd.test"
check "an --allow-host name is served" test "$CODE" = 200
req POST "/v1/jobs/$idx/cancel" "${AUTH[@]}" "${JSON[@]}" -H "Origin: $ALLOWED_ORIGIN"
check "an --allow-origin may cancel (202)" test "$CODE" = 202
check "... and the job is cancelled" wait_status "$idx" cancelled 30
check "at least 40 hostile requests were tried ($nbad)" test "$nbad" -ge 40
check "healthz after every hostile request" healthy
req GET /v1/jobs
check "reads need no token" test "$CODE" = 200

# ---- start-up errors (each must refuse to start; `timeout` ends one that does not) -----------
TIMEOUT=(timeout -s KILL 20)
chmod 644 "$TMP/token"
"${TIMEOUT[@]}" "$AMPD" serve --listen 127.0.0.1:0 --data-dir "$TMP/d2" --token-file "$TMP/token" \
    >/dev/null 2>"$TMP/err"
rc=$?
check "a group-readable token file is refused (exit 1)" test "$rc" -eq 1
check "... with a clear message" grep -q 'token file .* is accessible by group or others' "$TMP/err"
chmod 600 "$TMP/token"
"${TIMEOUT[@]}" "$AMPD" serve --listen 0.0.0.0:0 --data-dir "$TMP/d2" >/dev/null 2>"$TMP/err"
check "non-loopback without a token is refused (exit 1)" test $? -eq 1
"${TIMEOUT[@]}" "$AMPD" serve --listen "127.0.0.1:$PORT" --data-dir "$TMP/d2" \
    >/dev/null 2>"$TMP/err"
check "a port in use is refused (exit 1)" test $? -eq 1
check "... with one line on stderr" test "$(grep -c '^ampd serve: ' "$TMP/err")" -eq 1
"${TIMEOUT[@]}" "$AMPD" serve --listen 127.0.0.1:0 --data-dir "$TMP/d2" \
    --db "$TMP/nodir/x/ampd.db" >/dev/null 2>"$TMP/err"
check "an unusable database is refused (exit 1)" test $? -eq 1
"${TIMEOUT[@]}" "$AMPD" serve --max-running 0 >/dev/null 2>&1
check "bad usage exits 2" test $? -eq 2
"${TIMEOUT[@]}" "$AMPD" serve --listen 127.0.0.1:0 --data-dir "$TMP/d2" \
    --web-root /nonexistent/ampd-web >/dev/null 2>"$TMP/err"
check "--web-root of a missing directory is refused (exit 1)" test $? -eq 1
check "... naming the path" grep -q '^ampd serve: --web-root /nonexistent/ampd-web: ' "$TMP/err"
"${TIMEOUT[@]}" "$AMPD" serve --listen 127.0.0.1:0 --data-dir "$TMP/d2" \
    --web-root "$TMP/data" >/dev/null 2>"$TMP/err"
check "--web-root without index.html is refused (exit 1)" test $? -eq 1
check "... naming the path" grep -qF "ampd serve: --web-root $TMP/data: no index.html" "$TMP/err"
"${TIMEOUT[@]}" "$AMPD" serve --web-root "$TMP/web" --no-dashboard >/dev/null 2>&1
check "--web-root with --no-dashboard is bad usage (exit 2)" test $? -eq 2
"${TIMEOUT[@]}" "$AMPD" serve --allow-origin http://a.example/ >/dev/null 2>"$TMP/err"
check "an --allow-origin with a path is bad usage (exit 2)" test $? -eq 2
check "... saying what an origin is" \
    grep -qF 'ampd serve: --allow-origin "http://a.example/" is not an origin' "$TMP/err"
"${TIMEOUT[@]}" "$AMPD" serve --allow-host 'a.example/x' >/dev/null 2>"$TMP/err"
check "a bad --allow-host is bad usage (exit 2)" test $? -eq 2
check "... naming it" \
    grep -qF 'ampd serve: --allow-host "a.example/x" is not NAME or NAME:PORT' "$TMP/err"

# ---- the default web root: web/ beside the binary when it holds index.html -------------------
# A second daemon for a moment (own data dir and port file); it is stopped before going on.
serve_briefly() { # log-file args...: start, wait for the port, GET / into CODE/BODY, stop
    local log=$1 out
    shift
    serve "$TMP/port2" "$log" --data-dir "$TMP/d3" "$@"
    out=$(acurl -sS -m 20 -w '\n%{http_code}' "http://127.0.0.1:${SERVE_PORT:-0}/" 2>&1)
    CODE=${out##*$'\n'}
    BODY=${out%$'\n'*}
    kill -TERM "$SERVE_PID" 2>/dev/null
    wait "$SERVE_PID" 2>/dev/null
    test -n "$SERVE_PORT"
}
beside=$(dirname "$(realpath "$AMPD")")/web
check "a daemon without --web-root starts" serve_briefly "$TMP/d3.log"
check "... and logs one dashboard line" test "$(grep -c 'dashboard: ' "$TMP/d3.log")" -eq 1
if [ -f "$beside/index.html" ]; then
    check "... serving web/ beside the binary ($beside)" \
        grep -qF "(files from $(realpath "$beside"))" "$TMP/d3.log"
    check "... whose index.html is GET /" code_and_body 200 "$beside/index.html"
else
    echo "# $beside/index.html does not exist (yet): the default is web/ beside the binary"
    check "... saying where no index.html was found, or serving the installed one" \
        grep -Eq "dashboard: (not served \(no index.html in $beside|http://.* \(files from )" \
        "$TMP/d3.log"
fi
check "--no-dashboard: GET / is a 404" serve_briefly "$TMP/d4.log" --no-dashboard
check "... with the reason in the log" test "$CODE" = 404 -a \
    "$(grep -c 'dashboard: not served (--no-dashboard)' "$TMP/d4.log")" -eq 1

# ---- a FIFO in the web root: a 404 at once, and SIGTERM still stops the daemon in time -------
# (opening a FIFO for reading waits for a writer; a handler stuck there held up the stop)
mkdir -p "$TMP/fifoweb"
printf '<!doctype html><title>fifo</title>\n' >"$TMP/fifoweb/index.html"
mkfifo "$TMP/fifoweb/pipe"
serve "$TMP/port2" "$TMP/d5.log" --data-dir "$TMP/d5" --web-root "$TMP/fifoweb"
FPID=$SERVE_PID
fport=$SERVE_PORT
t0=$(date +%s%N)
code=$(acurl -sS -m 5 -o /dev/null -w '%{http_code}' "http://127.0.0.1:${fport:-0}/pipe" \
    2>/dev/null)
ms=$((($(date +%s%N) - t0) / 1000000))
check "GET of a FIFO in the web root is a 404 at once (${code:-none} in $ms ms)" \
    test "$code" = 404 -a "$ms" -lt 2000
t0=$(date +%s%N)
kill -TERM "$FPID"
for _ in $(seq 1 300); do
    kill -0 "$FPID" 2>/dev/null || break
    sleep 0.05
done
ms=$((($(date +%s%N) - t0) / 1000000))
if kill -0 "$FPID" 2>/dev/null; then kill -9 "$FPID"; fi
wait "$FPID" 2>/dev/null
check "... and SIGTERM then stops the daemon within its deadline ($ms ms, at most 10 s)" \
    test "$ms" -lt 10000

# ---- kill -9 of the daemon mid-job, restart, resume ------------------------------------------
submit "$(spec crash 5000 ', "checkpoint_every": 200' "$BIG")"
id5=$SID
wait_step "$id5" 700 60
{
    kill -9 "$DPID"
    wait "$DPID"
} 2>/dev/null
ok_pid=$DPID
check "the daemon is gone" sh -c "! kill -0 $ok_pid 2>/dev/null"
no_worker() { test -z "$(worker_pids "$1")"; }
check "its worker died with it (within 10 s)" wait_for 10 no_worker "$id5"
start_daemon --max-running 1
check "the daemon restarts on the same db" healthy
check "the crashed job resumes and succeeds" wait_status "$id5" succeeded 60
check "exactly one metric row per step (1..5000)" steps_are_1_to "$id5" 5000
req GET "/v1/jobs/$id5"
check "the job counts one retry" grep -q '"retries":1,' <<<"$BODY"
req GET "/v1/jobs/$id5/events?limit=1000"
check "events say it was queued again" grep -q 'queued again after an interruption' <<<"$BODY"
check "events say it resumed from a checkpoint" \
    grep -q 'resumed from the checkpoint at step' <<<"$BODY"

# ---- kill -9 of a worker: its job fails, the next one runs -----------------------------------
submit "$(spec victim 1000000 '' "$BIG")"
id6=$SID
submit "$(spec next 100)"
id7=$SID
wait_step "$id6" 10 30
wpid=$(worker_pids "$id6" | head -1)
check "the worker process is found" test -n "$wpid"
[ -n "$wpid" ] && kill -9 "$wpid"
check "the killed worker's job fails" wait_status "$id6" failed 30
req GET "/v1/jobs/$id6"
check "the failure names the signal" \
    grep -q '"error":"worker killed by signal 9 (SIGKILL)' <<<"$BODY"
check "the next queued job runs and succeeds" wait_status "$id7" succeeded 30
check "the daemon keeps serving" healthy

# ---- graceful stop: running jobs checkpoint and become interrupted ---------------------------
submit "$(spec stop 1000000 ', "checkpoint_every": 100' "$BIG")"
id8=$SID
wait_step "$id8" 350 30
kill -TERM "$DPID"
for _ in $(seq 1 400); do kill -0 "$DPID" 2>/dev/null || break; sleep 0.05; done
wait "$DPID"
rc=$?
check "SIGTERM stops the daemon with status 0" test "$rc" -eq 0
DPID=""
check "the running job is interrupted" grep -q "job $id8: interrupted at step" "$TMP/daemon.log"
check "... after writing a checkpoint" \
    sh -c "ls '$TMP/data/jobs/$id8/' | grep -q '^ckpt-[0-9]*\.safetensors$'"

# ---- a restart past damaged checkpoints -----------------------------------------------------
# the stop checkpoint truncated and the one before it deleted: the restarted daemon resumes
# the job from the one before those
mapfile -t cks < <(ls "$TMP/data/jobs/$id8/" | grep '^ckpt-' | tr -dc '0-9\n' | sort -n)
n=${#cks[@]}
check "the stopped job keeps 3 checkpoints (${cks[*]})" test "$n" -eq 3
s1=${cks[n - 1]:-0} s2=${cks[n - 2]:-0} s3=${cks[n - 3]:-0}
if [ "$n" -ge 3 ]; then
    truncate -c -s -100 "$TMP/data/jobs/$id8/ckpt-$s1.safetensors"
    rm -f "$TMP/data/jobs/$id8/ckpt-$s2.safetensors"
fi
start_daemon --max-running 1
check "the daemon restarts" healthy
resumed_at() {
    req GET "/v1/jobs/$id8/events?limit=1000"
    grep -q "resumed from the checkpoint at step $s3, the newest that verifies (2 newer skipped)" <<<"$BODY"
}
check "the interrupted job resumes from the last checkpoint that verifies ($s3)" \
    wait_for 20 resumed_at
check "... an event says the stop checkpoint ($s1) was skipped as truncated" \
    grep -q "skipped the checkpoint at step $s1 (ckpt-$s1.safetensors): truncated: [0-9]* of its" <<<"$BODY"
check "... and the one before ($s2) as missing" \
    grep -q "skipped the checkpoint at step $s2 (ckpt-$s2.safetensors): missing" <<<"$BODY"
req POST "/v1/jobs/$id8/cancel" "${AUTH[@]}" "${JSON[@]}"
check "the resumed job can be cancelled" wait_status "$id8" cancelled 30

# ---- every response above against the OpenAPI description -----------------------------------
openapi_check_recorded

echo "$pass passed, $fail failed"
test "$fail" -eq 0
