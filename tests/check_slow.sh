#!/bin/bash
# check_slow.sh - `ampd serve` under slow clients, on loopback: a daemon with a short
# request-head deadline (--head-timeout 8) and a per-address limit far below what the test
# opens (--max-per-address 16: loopback is exempt), a job that runs until the daemon stops,
# and tests/slow_clients.py, which holds 1500 connections that trickle a request head one
# byte a second and checks that the daemon's threads do not grow with them, that /healthz
# and /v1/jobs answer within 1 s, that 100 SSE clients of the job receive live steps, that
# the daemon closes the slow connections once the deadline has passed (and only those),
# and that SIGTERM then ends the streams and the daemon. This script checks the daemon's
# exit status and its last log line. Exits 77 when the open-file limit cannot hold the
# connections. Every wait is bounded; the daemon is killed on exit.
set -u
AMPD=${AMPD:-./ampd}
PY=/usr/bin/python3
srcdir=${srcdir:-.}
HEAD_TIMEOUT=8
# shellcheck source=tests/testlib.sh
. "$srcdir/tests/testlib.sh"
test_tmp

[ -x "$PY" ] || { echo "SKIP: $PY not found"; exit 77; }
# the daemon and the helper each raise their soft limit to this one, and need ~1700 each
hard=$(ulimit -Hn)
if [ "$hard" != unlimited ] && [ "$hard" -lt 4096 ]; then
    echo "SKIP: the open-file hard limit ($hard) is below the 4096 this test needs"
    exit 77
fi

serve "$TMP/port" "$TMP/daemon.log" --data-dir "$TMP/data" --db "$TMP/ampd.db" \
    --no-dashboard --head-timeout "$HEAD_TIMEOUT" --max-per-address 16
DPID=$SERVE_PID
PORT=$SERVE_PORT
URL="http://127.0.0.1:${PORT:-0}"
if [ -z "$PORT" ]; then
    bad "ampd serve starts with --head-timeout and --max-per-address"
    cat "$TMP/daemon.log"
    exit 1
fi
ok "ampd serve starts with --head-timeout and --max-per-address"

# clients that shut their sending side once the request is out (nc -N, scripts): each
# must get its answer and the connection closed at once (libmicrohttpd 0.9.75's epoll mode
# left some of them open until the request-head deadline)
half=$("$PY" - "$PORT" <<'PYEOF'
import socket, sys
port, hung = int(sys.argv[1]), 0
for _ in range(200):
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(2)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port)
    s.shutdown(socket.SHUT_WR)
    data, closed = b"", False
    try:
        while not closed:
            d = s.recv(4096)
            closed = not d
            data += d
    except socket.timeout:
        pass
    hung += not closed or b'"status":"ok"' not in data
    s.close()
    if hung >= 3:  # enough to tell, without waiting out every one
        break
print(hung)
PYEOF
)
check "200 half-closed requests are all answered and closed (${half:-?} left open)" \
    test "${half:-1}" = 0

# a job that runs until the daemon stops it, a few tens of steps a second
spec='{"name": "slow-clients", "model": {"layers": [256, 1024, 1024, 10]},
       "data": {"type": "synthetic", "train_size": 512, "eval_size": 128},
       "precision": {"dtype": "fp32"}, "batch_size": 256, "threads": 1,
       "steps": 100000000}'
body=$(curl -sS -m 10 -H 'Content-Type: application/json' -d "$spec" "$URL/v1/jobs")
id=$(printf '%s' "$body" | grep -o '"id":[0-9]*' | head -1 | cut -d: -f2)
check "a job is submitted" test "${id:-0}" -gt 0
running=false
for _ in $(seq 1 600); do
    body=$(curl -sS -m 5 "$URL/v1/jobs/$id")
    case $body in *'"status":"running","progress":{"step":'[1-9]*) running=true; break ;; esac
    sleep 0.05
done
check "the job runs" $running

"$PY" "$srcdir/tests/slow_clients.py" --port "$PORT" --pid "$DPID" --job "${id:-1}" \
    --slow 1500 --sse 100 --head-timeout "$HEAD_TIMEOUT" --stop --stop-within 15
rc=$?
if [ "$rc" -eq 77 ]; then
    exit 77
fi
check "the slow-client checks pass (above)" test "$rc" -eq 0
for _ in $(seq 1 300); do kill -0 "$DPID" 2>/dev/null || break; sleep 0.05; done
wait "$DPID"
rc=$?
DPID=""
check "the daemon stopped with status 0" test "$rc" -eq 0
check "... after its clean stop" \
    sh -c "tail -n 1 '$TMP/daemon.log' | grep -q 'INFO  daemon_serve_main: stopped\$'"
check "the log says how many connections the head deadline closed" \
    grep -q "closed [0-9]* connection(s) whose request head was not complete within" \
    "$TMP/daemon.log"

if [ "$fail" -ne 0 ]; then
    echo "--- daemon.log"
    tail -n 30 "$TMP/daemon.log"
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
