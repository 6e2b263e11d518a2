# apilib.sh - what the end-to-end tests of the daemon's HTTP API share (sourced by
# tests/check_daemon.sh and tests/check_experiment.sh after testlib.sh, with TMP set to the
# test's temporary directory): a bearer token in $TMP/token, start_daemon (a daemon on a
# free loopback port over $TMP/ampd.db, its pid in DPID; stop_daemons kills it), acurl and req
# (every exchange recorded under $REC), post_json, jget, status_of, is_status, past,
# body_has and events (these five with jq), and openapi_check_recorded, which checks every recorded
# response against the OpenAPI description. check_default.sh, check_cluster.sh,
# check_branch.sh and check_policy.sh source it too.
TOKEN=e2e-secret-token-0123456789
printf '%s\n' "$TOKEN" >"$TMP/token"
chmod 600 "$TMP/token"
AUTH=(-H "Authorization: Bearer $TOKEN")
JSON=(-H 'Content-Type: application/json') # every POST and DELETE carries it

# Start a daemon on a free port (testlib.sh's serve); sets DPID, PORT, URL. Extra arguments
# go to serve.
start_daemon() {
    serve "$TMP/port" "$TMP/daemon.log" --data-dir "$TMP/data" --db "$TMP/ampd.db" \
        --token-file "$TMP/token" --worker-timeout 120 "$@"
    # shellcheck disable=SC2034 # the sourcing script's to stop and restart
    DPID=$SERVE_PID
    PORT=$SERVE_PORT
    URL="http://127.0.0.1:${PORT:-0}"
}

# acurl [curl args] URL: curl against a daemon, recorded for the OpenAPI check. Takes the
# curl options this script uses; -o FILE, -D FILE (- for stdout) and -w FORMAT (only
# %{http_code}) behave as curl's, the rest go to curl as they are. The exchange goes to
# $REC/r.XXXXXX.{req,hdr,body} (a unique name, so calls in subshells do not collide).
REC=$TMP/rec
mkdir -p "$REC"
acurl() {
    local args=() out="" hdr="" wfmt="" method="" url="" data=false a f rc code
    while [ $# -gt 0 ]; do
        a=$1
        shift
        case $a in
        -o) out=$1; shift ;;
        -D) hdr=$1; shift ;;
        -w) wfmt=$1; shift ;;
        -X) method=$1; args+=(-X "$1"); shift ;;
        -I) method=HEAD; args+=(-I) ;;
        --data-binary | -d) data=true; args+=("$a" "$1"); shift ;;
        -H | -m) args+=("$a" "$1"); shift ;;
        http://*) url=$a ;;
        *) args+=("$a") ;;
        esac
    done
    [ -n "$method" ] || { $data && method=POST || method=GET; }
    f=$(mktemp "$REC/r.XXXXXX")
    printf '%s %s\n' "$method" "/${url#http://*/}" >"$f.req"
    code=$(curl "${args[@]}" -o "$f.body" -D "$f.hdr" -w '%{http_code}' "$url")
    rc=$?
    if [ "$hdr" = - ]; then tr -d '\r' <"$f.hdr" | cat; fi
    if [ -n "$hdr" ] && [ "$hdr" != - ]; then cp "$f.hdr" "$hdr"; fi
    if [ -z "$out" ]; then
        cat "$f.body" 2>/dev/null
    elif [ "$out" != /dev/null ]; then
        cp "$f.body" "$out" 2>/dev/null || : >"$out"
    fi
    [ -n "$wfmt" ] && printf '%b' "${wfmt//%\{http_code\}/$code}"
    return $rc
}

# req METHOD PATH [curl args]: sets CODE and BODY.
req() {
    local m=$1 p=$2 out
    shift 2
    out=$(acurl -sS -m 20 -X "$m" -w '\n%{http_code}' "$@" "$URL$p" 2>&1)
    CODE=${out##*$'\n'}
    BODY=${out%$'\n'*}
}
post_json() { # path body [curl args]
    local p=$1 b=$2
    shift 2
    req POST "$p" "${AUTH[@]}" "${JSON[@]}" --data-binary "$b" "$@"
}
# A job's status; whether it is $2; a jq test of BODY (jq's arguments before the test);
# every event's message of a job, a line each (needs jq).
status_of() {
    req GET "/v1/jobs/$1"
    jq -r .status <<<"$BODY" 2>/dev/null
}
is_status() { [ "$(status_of "$1")" = "$2" ]; }
past() { # id step: the job has reported that step
    req GET "/v1/jobs/$1"
    [ "$(jq -r .progress.step <<<"$BODY")" -ge "$2" ] 2>/dev/null
}
body_has() { jq -e "$@" <<<"$BODY" >/dev/null; }
events() {
    req GET "/v1/jobs/$1/events?limit=1000"
    jq -r '.events[].message | gsub("\n"; " | ")' <<<"$BODY"
}
# The first value of "key" in BODY (string quotes stripped).
jget() { printf '%s' "$BODY" | grep -o "\"$1\":[^,}]*" | head -1 | sed 's/^[^:]*://; s/"//g'; }

# openapi_check_recorded: every response recorded by acurl against the OpenAPI description
# (tests/openapi_check.mjs: the status documented for the operation, the Content-Type, the
# body valid against the schema); skipped, with the reason, without Node.js or ajv.
openapi_check_recorded() {
    local node=${NODE:-$(command -v node || true)} src=${srcdir:-.} rc
    if [ -z "$node" ]; then
        echo "# SKIP the OpenAPI check of the responses: Node.js not found"
    elif [ ! -d "$src/web/node_modules/ajv" ] || [ ! -d "$src/web/node_modules/ajv-formats" ]; then
        echo "# SKIP the OpenAPI check of the responses: $src/web/node_modules has no ajv" \
            "(npm ci --prefix web installs it; a --disable-dashboard build may not have it)"
    else
        "$node" "$src/tests/openapi_check.mjs" api/openapi.json "$REC"
        rc=$?
        check "every response ($(find "$REC" -name '*.req' | wc -l) recorded) matches the OpenAPI description" \
            test "$rc" -eq 0
    fi
}
