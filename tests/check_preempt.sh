#!/bin/bash
# check_preempt.sh - priorities, preemption and pause on a shared GPU server
# (docs/scheduling.md), on the CUDA emulator with four GPUs (its NVML stand-in):
#   - a 2-rank job and two 1-GPU jobs share the machine: all three run at once and no GPU is
#     in two jobs' CUDA_VISIBLE_DEVICES;
#   - a 4-GPU job of priority 10 submitted while four fp16 jobs of priority 0 hold every
#     GPU preempts them: each gets a "preempting" event, checkpoints, becomes preempted
#     (with "preempted by job N"), waits in the queue with that reason while the 4-GPU job
#     runs, and resumes from its checkpoint on its own once it has ended; every one of them ends succeeded with
#     one metric row per step, no gap and no duplicate, and losses and loss scales equal to
#     an uninterrupted run's, step by step;
#   - POST /v1/jobs/ID/pause does the same by hand: paused, no process left, out of the
#     queue; /unpause queues it and it resumes from the checkpoint, again with the
#     uninterrupted run's losses; pausing a finished job is a 409 that names its state;
#   - with --preempt off the 4-GPU job waits and no running job is stopped;
#   - every answer recorded matches the OpenAPI description.
# Every wait is bounded; every daemon started here is killed on exit.
set -u
command -v jq >/dev/null || { echo "SKIP: check_preempt needs jq (Debian jq)"; exit 77; }
EMU=${AMPD_EMU:-tests/ampd_emu}
NVML=${AMPD_TEST_NVML:-tests/cudaemu/libnvidia-ml.so.1}
if [ ! -x "$EMU" ] || [ ! -f "$NVML" ]; then
    echo "SKIP: check_preempt: $EMU or $NVML is not built (make check builds them)"
    exit 77
fi
AMPD=$EMU
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp
# shellcheck source=tests/apilib.sh
. "$(dirname "$0")/apilib.sh"
# shellcheck source=tests/placelib.sh
. "$(dirname "$0")/placelib.sh"

STEPS=3000
# the jobs that are preempted, paused and run through: one spec, names aside
fin() { job "$1" "{\"device\": \"cuda\", \"threads\": 1, \"precision\": {\"dtype\": \"fp16\"}, \"steps\": $STEPS}"; }
rows() { # id: "step,loss,loss_scale" for every metric row
    acurl -s -m 30 "$URL/v1/jobs/$1/metrics?fields=loss,loss_scale&from=1&to=$STEPS&format=csv" |
        tail -n +2
}
gone() { [ -z "$(job_procs "$1")" ]; }
# same_as_ref NAME ID: ID ended succeeded, with a row per step equal to the reference's
same_as_ref() {
    local got
    check "$1 (job $2) ends succeeded" wait_for 120 is_status "$2" succeeded
    got=$(rows "$2")
    check "... with one row per step 1..$STEPS: no gap, no duplicate" \
        test "$(cut -d, -f1 <<<"$got" | tr '\n' ' ')" = "$(seq 1 "$STEPS" | tr '\n' ' ')"
    check "... and the uninterrupted run's loss and loss scale at every step ($(diff <(echo "$got") "$TMP/ref.csv" | head -3 | tr '\n' ' '))" \
        test "$got" = "$(cat "$TMP/ref.csv")"
}

AMPD_NVML=$NVML AMPD_CUDAEMU_DEVICES=4 start_daemon --max-running 8
check "the emulated daemon starts with four GPUs" test -n "$PORT"

# ---- a 2-rank job and two 1-GPU jobs --------------------------------------------------------
post_json /v1/jobs "$(job pair '{"device": "cuda", "threads": 1, "distributed": {"world_size": 2}}')"
if [ "$CODE" != 201 ] && grep -q 'built without MPI' <<<"$BODY"; then
    echo "SKIP: multi-rank jobs: this ampd was built without MPI"
    exit 77
fi
x=$(jget id)
post_json /v1/jobs "$(job solo1 '{"device": "cuda", "threads": 1}')"
y=$(jget id)
post_json /v1/jobs "$(job solo2 '{"device": "cuda", "threads": 1}')"
z=$(jget id)
three_up() { [ -n "$(visible_of "$x")" ] && [ -n "$(visible_of "$y")" ] && [ -n "$(visible_of "$z")" ]; }
check "a 2-rank job and two 1-GPU jobs run at once" wait_for 60 three_up
vis="$(visible_of "$x"),$(visible_of "$y"),$(visible_of "$z")"
check "no GPU is given twice (CUDA_VISIBLE_DEVICES $(visible_of "$x") / $(visible_of "$y") / $(visible_of "$z"))" \
    test "$(tr ',' '\n' <<<"$vis" | sort -u | tr '\n' ' ')" = "0 1 2 3 "
req GET /v1/resources
check "GET /v1/resources: GPUs $(visible_of "$x") held by job $x" \
    jqok --argjson x "$x" --arg v "$(visible_of "$x")" \
    '[.devices[] | select(.jobs == [$x]) | .index | tostring] | join(",") == $v' <<<"$BODY"
for id in "$x" "$y" "$z"; do cancel "$id"; done
for id in "$x" "$y" "$z"; do wait_for 60 is_status "$id" cancelled; done

# ---- preemption -------------------------------------------------------------------------------
low=()
for i in 1 2 3 4; do
    post_json /v1/jobs "$(fin "low$i")"
    low+=("$(jget id)")
done
all_past() {
    local id
    for id in "${low[@]}"; do past "$id" 50 || return 1; done
}
check "four fp16 jobs of priority 0 hold the four GPUs" wait_for 60 all_past
post_json /v1/jobs "$(job big '{"device": "cuda", "threads": 1, "priority": 10, "steps": 40,
  "distributed": {"world_size": 4}}')"
h=$(jget id)
check "a 4-GPU job of priority 10 is accepted" test "$CODE" = 201
all_preempted() {
    local id
    for id in "${low[@]}"; do is_status "$id" preempted || return 1; done
}
check "... the four are preempted" wait_for 60 all_preempted
check "... each told why (a \"preempting\" event naming job $h)" wait_for 10 \
    events_have "${low[0]}" "preempting: job $h (priority 10) needs what it holds"
check "... and stopped at a checkpoint, saying so" wait_for 10 \
    events_have "${low[1]}" "preempted by job $h; it resumes from its checkpoint at step"
req GET "/v1/jobs/${low[2]}"
check "GET /v1/jobs/ID: status preempted, the error and the queue's reason name job $h" \
    jqok --arg w "preempted by job $h" '.status == "preempted" and .error == $w and
      (.queue.waiting_for | startswith($w))' <<<"$BODY"
ran() { is_status "$1" running || is_status "$1" succeeded; } # (a short job may be done)
check "the 4-GPU job runs" wait_for 60 ran "$h"
check "... and its start names the four GPUs" wait_for 10 events_have "$h" "placed on GPUs 0,1,2,3"
check "... and ends succeeded" wait_for 120 is_status "$h" succeeded
back_again() { # id: it runs again, after its preemption
    events_have "$1" "preempted by job $h" && ! is_status "$1" preempted && ! is_status "$1" queued
}
check "the preempted jobs resume on their own" wait_for 60 back_again "${low[3]}"
preempted_steps=()
for id in "${low[@]}"; do
    req GET "/v1/jobs/$id/events?limit=1000"
    preempted_steps+=("$(jq -r '[.events[] | select(.message | startswith("preempted by")) | .step][0]' <<<"$BODY")")
done
resumed() { # id: its second worker started from a checkpoint, not from scratch
    grep -q "^---- worker for job $1 starting, resuming from $TMP/data/jobs/$1/ckpt-" \
        "$TMP/data/jobs/$1/worker.log"
}
check "... from their checkpoints (worker.log)" wait_for 30 resumed "${low[0]}"

# ---- pause and unpause by hand, and the uninterrupted reference ------------------------------
post_json /v1/jobs "$(fin ref)"
ref=$(jget id)
post_json /v1/jobs "$(fin paused)"
p=$(jget id)
check "a job runs" wait_for 60 past "$p" 100
post_json "/v1/jobs/$p/pause" '{}'
check "POST /v1/jobs/ID/pause: 202" test "$CODE" = 202
check "... it becomes paused" wait_for 60 is_status "$p" paused
check "... with no process left" wait_for 20 gone "$p"
req GET "/v1/jobs/$p"
paused_at=$(jq -r .checkpoint_step <<<"$BODY")
check "... at a checkpoint (step $paused_at), out of the queue" \
    jqok '.checkpoint_step > 0 and .queue == null' <<<"$BODY"
sleep 3
check "... and stays paused" is_status "$p" paused
post_json "/v1/jobs/$p/unpause" '{}'
check "POST /v1/jobs/ID/unpause: 202, queued again" \
    jqok '.status == "queued" or .status == "running"' <<<"$BODY"
check "... it resumes from step $paused_at" wait_for 10 \
    events_have "$p" "unpaused: queued to resume from its checkpoint at step $paused_at"
check "the uninterrupted reference ends succeeded" wait_for 120 is_status "$ref" succeeded
rows "$ref" >"$TMP/ref.csv"
check "the reference has $STEPS rows" test "$(wc -l <"$TMP/ref.csv")" = "$STEPS"
for k in 0 1 2 3; do
    same_as_ref "preempted at step ${preempted_steps[$k]}" "${low[$k]}"
done
same_as_ref "paused at step $paused_at" "$p"
post_json "/v1/jobs/$p/pause" '{}'
check "pausing a succeeded job: 409 naming its state" \
    jqok '.error.code == "conflict" and (.error.message | test("is succeeded; only a queued, preempted or running job can be paused"))' <<<"$BODY"
stop_daemons

# ---- --preempt off ----------------------------------------------------------------------------
AMPD_NVML=$NVML AMPD_CUDAEMU_DEVICES=4 start_daemon --max-running 8 --preempt off
low=()
for i in 1 2 3 4; do
    post_json /v1/jobs "$(job "keep$i" '{"device": "cuda", "threads": 1}')"
    low+=("$(jget id)")
done
check "with --preempt off, four jobs of priority 0 hold the GPUs" wait_for 60 all_past
post_json /v1/jobs "$(job big '{"device": "cuda", "threads": 1, "priority": 10, "steps": 40,
  "distributed": {"world_size": 4}}')"
h=$(jget id)
check "... a 4-GPU job of priority 10 waits for them" wait_for 20 events_have "$h" \
    "waiting for 4 GPUs (4 of 4 held by job"
sleep 5
none_stopped() {
    local id
    for id in "${low[@]}"; do
        is_status "$id" running || return 1
        ! events_have "$id" "preempting" || return 1
    done
}
check "... and none of them is stopped" none_stopped
for id in "$h" "${low[@]}"; do cancel "$id"; done

openapi_check_recorded
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
