#!/bin/bash
# check_default.sh - a job keeps the defaults it was queued under. A daemon of this build
# (optimizer.lr defaults to 1e-3) queues a job that does not name its learning rate and runs
# it past a checkpoint; the daemon is killed (-9) and tests/ampd_lr3, the same ampd built with
# another default (3e-3), takes over the same database and data directory and resumes the
# job. Every step, before the kill and after the resume, must report lr 0.001: the daemon
# stored the spec as the worker resolves it (every default written out) when the job was
# submitted, so a later binary's defaults never reach a queued job.
# Every wait is bounded; every daemon started here is killed on exit.
set -u
AMPD=${AMPD:-./ampd}
OTHER=${AMPD_OTHER:-tests/ampd_lr3}
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp
# shellcheck source=tests/apilib.sh
. "$(dirname "$0")/apilib.sh"

if [ ! -x "$OTHER" ]; then
    echo "SKIP: $OTHER is not built (make check builds it)"
    exit 77
fi

# The job: a small MLP on synthetic data, a constant learning rate it does not name.
SPEC='{"name": "keeps-its-default", "model": {"layers": [784, 1024, 1024, 10]},
  "data": {"type": "synthetic", "train_size": 2048, "eval_size": 256},
  "precision": {"dtype": "bf16"}, "batch_size": 64, "threads": 1, "steps": 1000,
  "checkpoint_every": 100}'
printf '%s\n' "$SPEC" >"$TMP/job.json"

# The two binaries do differ: what each resolves for this spec.
lr_of() { # binary: the learning rate its `ampd run` resolves for the job (from the start line)
    jq '.steps = 1' "$TMP/job.json" | "$1" run - 2>/dev/null |
        jq -r 'select(.type == "start") | .spec.optimizer.lr'
}
check "this build defaults optimizer.lr to 0.001" test "$(lr_of "$AMPD")" = 0.001
check "$OTHER defaults it to 0.003" test "$(lr_of "$OTHER")" = 0.003

step_of() { # id: the job's progress (0 before its first step)
    req GET "/v1/jobs/$1"
    printf '%s' "$BODY" | jq -r '.progress.step // 0' 2>/dev/null || echo 0
}
past() { [ "$(step_of "$1")" -ge "$2" ]; }
status_of() {
    req GET "/v1/jobs/$1"
    printf '%s' "$BODY" | jq -r .status 2>/dev/null
}
is_status() { [ "$(status_of "$1")" = "$2" ]; }

start_daemon --max-running 1
check "a daemon of this build starts" test -n "$PORT"
post_json /v1/jobs "$SPEC"
id=$(jget id)
check "the job is queued (201)" test "$CODE" = 201
check "its stored spec names the default it was queued under (lr 0.001)" \
    sh -c "printf '%s' '$BODY' | jq -e '.spec.optimizer.lr == 0.001' >/dev/null"
check "it runs past its second checkpoint" wait_for 120 past "$id" 250
{
    kill -9 "$DPID"
    wait "$DPID"
} 2>/dev/null
no_worker() { test -z "$(worker_pids "$1")"; }
check "the daemon and its worker are gone" wait_for 10 no_worker "$id"

AMPD=$OTHER start_daemon --max-running 1
check "$OTHER starts on the same database" test -n "$PORT"
check "... resumes the job, which succeeds" wait_for 180 is_status "$id" succeeded
req GET "/v1/jobs/$id/events?limit=1000"
check "the job resumed from a checkpoint" grep -q 'resumed from the checkpoint at step' <<<"$BODY"

acurl -sS -m 20 "$URL/v1/jobs/$id/metrics?fields=lr&format=csv" | tail -n +2 >"$TMP/lr.csv"
check "one row per step, 1..1000" bash -c "seq 1 1000 | cmp -s - <(cut -d, -f1 '$TMP/lr.csv')"
lrs=$(cut -d, -f2 "$TMP/lr.csv" | sort -u | tr '\n' ' ')
check "every step ran at lr 0.001, after the resume too (lrs seen: $lrs)" test "$lrs" = "0.001 "

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
