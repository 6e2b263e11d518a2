# placelib.sh - what the tests of placement and preemption share (sourced by
# tests/check_place.sh and tests/check_preempt.sh after apilib.sh): job, a small MLP's
# spec; status_of and is_status; events_have and show_events; affinity_of and visible_of, the cores and
# CUDA_VISIBLE_DEVICES of a job's worker; cancel; jqok, a jq test of $BODY.

# Open MPI's allocations that live until exit are not ours (an --enable-asan build; the
# ranks inherit this through the daemon and mpirun)
LSAN_OPTIONS="suppressions=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lsan.supp:fast_unwind_on_malloc=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export LSAN_OPTIONS

# job NAME EXTRA: a small MLP that runs until cancelled, with the top-level fields of the
# JSON object EXTRA ("{...}") over its own
job() {
    jq -cn --arg name "$1" --argjson extra "$2" '{name: $name, model: {layers: [16, 32, 4]},
      data: {type: "synthetic", train_size: 256, eval_size: 64}, batch_size: 16,
      steps: 100000000} + $extra'
}
status_of() {
    req GET "/v1/jobs/$1"
    jget status
}
is_status() { [ "$(status_of "$1")" = "$2" ]; }
events_have() { # id text
    req GET "/v1/jobs/$1/events?limit=1000"
    grep -qF "$2" <<<"$BODY"
}
show_events() { # id: its last five events and its status, after a check that failed
    req GET "/v1/jobs/$1/events?limit=1000"
    jq -r '.events[-5:][] | "#   event at step \(.step): \(.message)"' <<<"$BODY"
    echo "#   status: $(status_of "$1")"
}
affinity_of() { # id: the Cpus_allowed_list of its worker
    local p
    p=$(worker_pids "$1" | head -1)
    [ -n "$p" ] && sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "/proc/$p/status"
}
visible_of() { # id: the CUDA_VISIBLE_DEVICES its worker was started with
    local p
    p=$(worker_pids "$1" | head -1)
    [ -n "$p" ] && tr '\0' '\n' <"/proc/$p/environ" | sed -n 's/^CUDA_VISIBLE_DEVICES=//p'
}
cancel() { post_json "/v1/jobs/$1/cancel" '{}'; }
jqok() { jq -e "$@" >/dev/null; } # filter [args]: BODY on stdin satisfies it
