#!/bin/bash
# check_cluster.sh - jobs across machines on the cluster's own engines (docs/cluster.md),
# on a real two-node Slurm cluster built on this machine in network namespaces
# (tests/clusterlib.sh: slurmctld, a slurmd per node, munge; Open MPI over TCP between the
# nodes), every job submitted with curl to `ampd serve --launcher slurm --shared-dir`:
#   - a world-4 MLP (2 ranks on each node, hook none, fp32) follows world 1 with the same
#     global batch: every one of 50 steps' losses within 1e-5 (relative); the job's record
#     names its Slurm job id, its nodes and every rank's host, and its events say where the
#     ranks ran and how the job ended in Slurm;
#   - the fp16 hook hands exactly half of the none hook's bytes to the all-reduce;
#   - a node whose ranks compute at about half speed (their cores shared with a busy loop)
#     is named in a "straggler" event;
#   - a cancel reaches every rank through scancel: they stop after the same step with a
#     checkpoint; the resumed job's rows are continuous and equal the uninterrupted run's;
#   - the same job through mpirun across the two nodes (distributed.hosts, Open MPI's
#     plm_rsh_agent entering the nodes' namespaces in place of ssh): the same losses;
#   - more nodes than the partition has, and a partition that does not exist: the job fails
#     at once with Slurm's reason in its error and its events;
#   - every process of node n2 killed mid-job: the job is queued again within
#     rank_timeout_s + 30 s, naming n2, is retried from its last checkpoint once the node is
#     back, and succeeds with one row per step; /healthz answers throughout;
#   - every answer recorded matches the OpenAPI description.
# Exit 77 (SKIP) where the cluster cannot be built (not root, no network namespaces, the
# Slurm packages missing), without MPI, Fashion-MNIST or jq. Every daemon is stopped by pid
# and the namespaces removed on exit, also when a check fails.
set -u
AMPD=${AMPD:-./ampd}
command -v jq >/dev/null || { echo "SKIP: check_cluster needs jq (Debian jq)"; exit 77; }
[ -d /usr/share/datasets/fashion-mnist ] ||
    { echo "SKIP: check_cluster: Fashion-MNIST is not installed (dataset-fashion-mnist)"; exit 77; }
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
# shellcheck source=tests/clusterlib.sh
. "$(dirname "$0")/clusterlib.sh"
if why=$(cl_skip_reason); then
    echo "SKIP: check_cluster: $why"
    exit 77
fi
if ! command -v mpirun >/dev/null || ! grep -q '^#define HAVE_MPI 1' config.h 2>/dev/null; then
    echo "SKIP: check_cluster: this ampd was built without MPI"
    exit 77
fi
HEALTH_PID=""
HOG=""
cleanup_more() {
    [ -n "$HEALTH_PID" ] && kill "$HEALTH_PID" 2>/dev/null
    [ -n "$HOG" ] && kill "$HOG" 2>/dev/null
    stop_daemons
    { cl_down; } 2>/dev/null
}
test_tmp
chmod 711 "$TMP" # the munge user reaches its socket under it
# shellcheck source=tests/apilib.sh
. "$(dirname "$0")/apilib.sh"
LSAN_OPTIONS="suppressions=$(cd "$(dirname "$0")" && pwd)/lsan.supp:fast_unwind_on_malloc=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export LSAN_OPTIONS

if ! cl_up "$TMP/cl"; then
    bad "the two-node Slurm cluster comes up"
    echo "$pass passed, $fail failed"
    exit 1
fi
ok "the two-node Slurm cluster comes up: $(sinfo -h -o '%P %D %T %N' | tr '\n' ' ')"
cl_agent

STEPS=300
# spec EXTRA: the MLP job of the checks, with the JSON members of EXTRA over its own
spec() {
    jq -cn --argjson extra "$1" --argjson steps "$STEPS" '{name: "dp", model: {type: "mlp",
      layers: [784, 256, 10]}, data: {type: "idx", train: "fashion-mnist"},
      precision: {dtype: "fp32"}, batch_size: 256, steps: $steps, seed: 1,
      checkpoint_every: 25, optimizer: {type: "sgd", lr: 0.02, momentum: 0.9}} * $extra'
}
W4='{"distributed": {"world_size": 4, "slurm": {"nodes": 2, "tasks_per_node": 2}}}'
submit() { # spec: sets ID
    post_json /v1/jobs "$1"
    ID=$(jq -r .id <<<"$BODY")
    [ "$CODE" = 201 ] || echo "# submit: $CODE $BODY"
}
ended() { case $(status_of "$1") in succeeded | failed | cancelled) return 0 ;; esac; return 1; }
rows() { # id: "step,loss" of every row
    acurl -s -m 30 "$URL/v1/jobs/$1/metrics?fields=loss&from=1&to=$STEPS&format=csv" | tail -n +2
}
has_event() { events "$1" | grep -q "$2"; } # id text
show() { # id: after a check that failed
    echo "#   status $(status_of "$1"); error: $(jq -r .error <<<"$BODY" | head -3)"
    events "$1" | tail -6 | sed 's/^/#   event: /'
    tail -40 "$TMP/shared/jobs/$1/worker.log" | sed 's/^/#   log: /'
}
# within A B TOL: the largest relative difference of the losses of two "step,loss" lists
# over the steps of A, printed; 0 when it is at most TOL
within() {
    awk -F, -v tol="$3" 'NR == FNR { ref[$1] = $2; next }
        ($1 in ref) { d = $2 - ref[$1]; if (d < 0) d = -d; r = d / (ref[$1] < 0 ? -ref[$1] : ref[$1])
                      if (r > m) m = r; n++ }
        END { printf "%.3g over %d steps\n", m, n; exit !(n > 0 && m <= tol) }' "$2" "$1"
}
within_q() { within "$@" >/dev/null; }

# the reference: world 1, the same global batch, in this process's machine
spec '{}' >"$TMP/w1.json"
"$AMPD" run "$TMP/w1.json" >"$TMP/w1.out" 2>"$TMP/w1.err"
status_is "world 1 reference run" 0 $?
jq -r 'select(.type == "step") | "\(.step),\(.loss)"' "$TMP/w1.out" >"$TMP/w1.csv"
head -50 "$TMP/w1.csv" >"$TMP/w1-50.csv"

start_daemon --launcher slurm --max-retries 2 --max-running 2 --shared-dir "$TMP/shared"
check "ampd serve --launcher slurm starts" test -n "$PORT" || { cat "$TMP/daemon.log"; exit 1; }

# ---- world 4 through Slurm, hook none -------------------------------------------------------
submit "$(spec "$W4")"
J4=$ID
check "world 4 through Slurm (job $J4) succeeds" wait_for 180 is_status "$J4" succeeded || show "$J4"
rows "$J4" >"$TMP/w4.csv"
m=$(within "$TMP/w1-50.csv" "$TMP/w4.csv" 1e-5)
check "world 4 on 2 nodes: every step's loss within 1e-5 of world 1's ($m)" \
    within_q "$TMP/w1-50.csv" "$TMP/w4.csv" 1e-5
req GET "/v1/jobs/$J4"
echo "# launch: $(jq -c .launch <<<"$BODY")"
check "its record names the Slurm job id" body_has '.launch.launcher == "slurm" and
    (.launch.job_id | test("^[0-9]+$"))'
check "... its nodes, n[1-2], and every rank's host" body_has '.launch.nodes == "n[1-2]" and
    .launch.hosts == ["n1", "n1", "n2", "n2"]'
check "... and Slurm's final state, COMPLETED" body_has '.launch.state == "COMPLETED"'
events "$J4" >"$TMP/ev4"
check "an event says where the ranks ran" grep -q 'Slurm job [0-9]* runs: ranks 0-1 on n1, ranks 2-3 on n2' "$TMP/ev4"
check "an event says how it ended in Slurm" grep -q 'ended in Slurm: COMPLETED on n\[1-2\]' "$TMP/ev4"
check "the ranks' log lines carry their host" grep -q 'rank 3 n2 ' "$TMP/shared/jobs/$J4/worker.log"

# ---- the fp16 hook ----------------------------------------------------------------------------
submit "$(spec '{"steps": 5, "distributed": {"world_size": 4, "comm_hook": "fp16", "slurm": {"nodes": 2}}}')"
J16=$ID
check "world 4, fp16 hook (job $J16) succeeds" wait_for 120 is_status "$J16" succeeded || show "$J16"
b16=$(acurl -s "$URL/v1/jobs/$J16/metrics?fields=comm_bytes&from=1&to=5&format=csv" | tail -n +2 | cut -d, -f2 | sort -u)
b32=$(acurl -s "$URL/v1/jobs/$J4/metrics?fields=comm_bytes&from=1&to=5&format=csv" | tail -n +2 | cut -d, -f2 | sort -u)
check "the fp16 hook's comm_bytes ($b16) are half of hook none's ($b32)" test "$((2 * ${b16:-0}))" = "${b32:--1}"

# ---- a straggling host ------------------------------------------------------------------------
# n1's ranks get core 0, n2's core 1, shared with a busy loop: n2 computes at about half speed
rank_pids() { # node: its ranks' pids (`ampd run` in its namespace)
    local p
    for p in $(cl_node_pids "$1"); do
        tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q ' run ' && echo "$p"
    done
}
submit "$(spec '{"steps": 100000, "distributed": {"world_size": 4,
    "slurm": {"nodes": 2, "tasks_per_node": 2}}}')"
JS=$ID
check "a world-4 job reaches step 20 (job $JS)" wait_for 120 past "$JS" 20 || show "$JS"
for p in $(rank_pids n1); do taskset -a -p -c 0 "$p" >/dev/null; done
for p in $(rank_pids n2); do taskset -a -p -c 1 "$p" >/dev/null; done
taskset -c 1 sh -c 'while :; do :; done' &
HOG=$!
check "the host whose ranks compute slower is named as a straggler" \
    wait_for 90 has_event "$JS" 'rank [23] on n2 straggles' || show "$JS"
echo "# $(events "$JS" | grep -m1 straggles)"
kill "$HOG"
wait "$HOG" 2>/dev/null
HOG=""
post_json "/v1/jobs/$JS/cancel" '{}'
check "... and the job cancelled ($CODE)" wait_for 60 is_status "$JS" cancelled || show "$JS"

# ---- cancel and resume through scancel --------------------------------------------------------
submit "$(spec "$W4")"
JC=$ID
check "a world-4 job reaches step 60 (job $JC)" wait_for 120 past "$JC" 60 || show "$JC"
post_json "/v1/jobs/$JC/cancel" '{}'
check "cancel is accepted ($CODE)" test "$CODE" = 202 -o "$CODE" = 200
check "... and the job ends cancelled" wait_for 60 is_status "$JC" cancelled || show "$JC"
check "... its ranks stopped after the same step, rank 0 with a checkpoint" \
    grep -q 'stopped at step' "$TMP/shared/jobs/$JC/worker.log"
req GET "/v1/jobs/$JC"
at=$(jq -r .checkpoint_step <<<"$BODY")
check "... which is on the record (step $at)" test "${at:-0}" -gt 0
events "$JC" >"$TMP/evc"
check "... and what Slurm made of it is in its events" grep -q 'ended in Slurm: ' "$TMP/evc"
post_json "/v1/jobs/$JC/resume" '{}'
check "the resumed job succeeds" wait_for 180 is_status "$JC" succeeded || show "$JC"
rows "$JC" >"$TMP/wc.csv"
check "its rows are continuous: one per step 1..$STEPS" \
    test "$(cut -d, -f1 "$TMP/wc.csv" | tr '\n' ' ')" = "$(seq 1 $STEPS | tr '\n' ' ')"
check "... with the uninterrupted run's losses ($(within "$TMP/w4.csv" "$TMP/wc.csv" 0))" \
    within_q "$TMP/w4.csv" "$TMP/wc.csv" 0

# ---- mpirun across the two nodes, the namespace agent in place of ssh -------------------------
stop_daemons
OMPI_MCA_plm_rsh_agent=$CL/agent start_daemon --max-retries 2 --shared-dir "$TMP/shared"
check "ampd serve (launcher mpirun) starts again" test -n "$PORT"
submit "$(spec '{"distributed": {"world_size": 4, "launcher": "mpirun", "hosts": ["n1:2", "n2:2"]}}')"
JM=$ID
check "world 4 through mpirun on n1 and n2 (job $JM) succeeds" wait_for 180 is_status "$JM" succeeded || show "$JM"
rows "$JM" >"$TMP/wm.csv"
check "... with the Slurm run's losses ($(within "$TMP/w4.csv" "$TMP/wm.csv" 1e-6))" \
    within_q "$TMP/w4.csv" "$TMP/wm.csv" 1e-6
req GET "/v1/jobs/$JM"
check "... its ranks' hosts on the record" body_has '.launch.launcher == "mpirun" and
    .launch.hosts == ["n1", "n1", "n2", "n2"]'
stop_daemons
start_daemon --launcher slurm --max-retries 2 --max-running 2 --shared-dir "$TMP/shared"

# ---- what Slurm cannot give -------------------------------------------------------------------
submit "$(spec '{"distributed": {"world_size": 4, "slurm": {"nodes": 3}}}')"
JX=$ID
check "a job asking for 3 nodes of 2 fails at once" wait_for 60 is_status "$JX" failed || show "$JX"
req GET "/v1/jobs/$JX"
echo "# error: $(jq -r .error <<<"$BODY" | grep -m1 'never start')"
check "... with Slurm's reason in its error" body_has '.error | test("never start job [0-9]+ as asked: PENDING \\(Partition(NodeLimit|Config)\\)")'
check "... and in its events" grep -q 'never start job [0-9]* as asked' <(events "$JX")
submit "$(spec '{"distributed": {"world_size": 4, "slurm": {"cpus_per_task": 3}}}')"
JR=$ID
check "a job asking for 3 cores a rank on nodes of 2 fails at once" wait_for 60 is_status "$JR" failed || show "$JR"
check "... with Slurm's reason in its events" \
    grep -Eq 'never start job [0-9]+ as asked: PENDING \(PartitionConfig\)|Requested node configuration is not available' <(events "$JR")
submit "$(spec '{"distributed": {"world_size": 4, "slurm": {"partition": "nosuch"}}}')"
JP=$ID
check "a job in a partition that does not exist fails at once" wait_for 60 is_status "$JP" failed || show "$JP"
check "... naming the partition as Slurm's reason" grep -q 'Invalid partition name' <(events "$JP")

# ---- a node dies ------------------------------------------------------------------------------
# /healthz, twice a second, from here on: a failure is counted
: >"$TMP/health.fail"
(while sleep 0.5; do
    curl -sf -m 5 "$URL/healthz" >/dev/null || echo "$(date +%T) no answer" >>"$TMP/health.fail"
done) &
HEALTH_PID=$!
STEPS=600
submit "$(spec '{"steps": 600, "distributed": {"world_size": 4, "rank_timeout_s": 10,
    "slurm": {"nodes": 2, "tasks_per_node": 2}}}')"
JK=$ID
check "a world-4 job reaches step 100 (job $JK)" wait_for 180 past "$JK" 100 || show "$JK"
cl_kill_node n2
t0=$SECONDS
check "after every process of n2 is killed, the job is queued again within rank_timeout_s + 30 s" \
    wait_for 40 has_event "$JK" 'retrying from its checkpoint' || show "$JK"
echo "# queued again after $((SECONDS - t0)) s"
events "$JK" >"$TMP/evk"
check "... naming the node (n2)" grep -q 'retrying from its checkpoint.*host n2' "$TMP/evk"
check "... in an event of its own" grep -Eq '^lost rank [23] \(host n2, pid [0-9]+, step [0-9]+\)' "$TMP/evk"
grep -m1 '^lost rank' "$TMP/evk" | sed 's/^/# /'
cl_start_slurmd n2
check "the job is retried from its checkpoint once n2 is back, and succeeds" \
    wait_for 240 is_status "$JK" succeeded || show "$JK"
req GET "/v1/jobs/$JK"
check "... after one retry" body_has '.retries == 1'
rows "$JK" >"$TMP/wk.csv"
check "... with one row per step 1..600" \
    test "$(cut -d, -f1 "$TMP/wk.csv" | tr '\n' ' ')" = "$(seq 1 600 | tr '\n' ' ')"
kill "$HEALTH_PID" 2>/dev/null
HEALTH_PID=""
check "/healthz answered throughout ($(wc -l <"$TMP/health.fail") misses)" test ! -s "$TMP/health.fail"

openapi_check_recorded
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
