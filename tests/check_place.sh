#!/bin/bash
# check_place.sh - the daemon places jobs on the machine's cores and GPUs (docs/scheduling.md):
#   - GET /v1/resources lists the cores ampd may use and the GPUs NVML reports (none here
#     without a driver, and it says why);
#   - a job that can never fit is refused at submit with 422 naming the field and what the
#     machine has: distributed.world_size 1000 on this machine's cores, device "cuda:5" on
#     four GPUs; with distributed.oversubscribe it is accepted;
#   - two CPU jobs with threads 1 run at once, each bound to a core of its own (read from
#     /proc/PID/status), and /v1/resources names them as the cores' holders;
#   - data that can never train is refused at submit (422 unusable_data), naming the dataset
#     as the spec did: a 0-byte text, one shorter than seq_len + 1, tokens past model.vocab,
#     IDX images and labels whose counts differ;
#   - a job that does not fit yet waits with the reason in an event, and starts when the
#     cores it waits for are freed; a job of higher priority goes ahead of it, and a new
#     priority (POST /v1/jobs/ID/priority) puts it back ahead;
#   - kill -9 of the daemon during a 2-rank job and a restart at once: no process of the old
#     run (worker, mpirun, ranks) is alive beside the new run's, watched every 10 ms;
#   - SIGSTOP of rank 1: the job fails within rank_timeout_s + 10 s, naming rank 1, and no
#     process of it is left, while /healthz answers; a healthy 16-rank oversubscribed job is
#     not ended as hung while its ranks start;
#   - on the CUDA emulator with four GPUs (its NVML stand-in, tests/cudaemu/nvml.c): four
#     1-GPU jobs run at once, each with a GPU of its own in its CUDA_VISIBLE_DEVICES (and
#     /metrics names each GPU's job and memory); a fifth
#     waits for a GPU, naming its holders, and starts on the one freed first.
# Every wait is bounded; every daemon started here is killed on exit.
set -u
command -v jq >/dev/null || { echo "SKIP: check_place needs jq (Debian jq)"; exit 77; }
AMPD=${AMPD:-./ampd}
EMU=${AMPD_EMU:-tests/ampd_emu}
NVML=${AMPD_TEST_NVML:-tests/cudaemu/libnvidia-ml.so.1}
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp
# shellcheck source=tests/apilib.sh
. "$(dirname "$0")/apilib.sh"

CORES=$(nproc)
# shellcheck source=tests/placelib.sh
. "$(dirname "$0")/placelib.sh"

# ---- the CPU: no driver, so no GPUs --------------------------------------------------------
AMPD_NVML=$TMP/no-such-libnvidia-ml.so start_daemon --max-running 4
check "the daemon starts" test -n "$PORT"
check "its log names the machine's cores and why it sees no GPU" \
    grep -q "machine: cores .* ($CORES), memory .* GiB, GPUs: none (no NVIDIA driver" \
    "$TMP/daemon.log"
req GET /v1/resources
check "GET /v1/resources: $CORES cores, all free, no GPU, and why" \
    jqok --argjson n "$CORES" '.cpus_total == $n and .cpus_free == $n and (.cpus | length) == $n
      and .devices == [] and (.devices_detail | test("no NVIDIA driver"))' <<<"$BODY"

post_json /v1/jobs "$(job huge '{"device": "cpu", "distributed": {"world_size": 1000}, "batch_size": 1000}')"
check "world_size 1000 is refused at submit (422)" test "$CODE" = 422
check "... naming distributed.world_size and the machine's $CORES cores" \
    jqok --argjson n "$CORES" '.error.field == "distributed.world_size" and
      (.error.message | test("needs 1000 cores .*ampd has \($n) on this machine"))' <<<"$BODY"
post_json /v1/jobs "$(job wide '{"device": "cpu", "threads": 1, "resources": {"cpus": 100000}}')"
check "resources.cpus beyond the range is a 400 naming it" \
    jqok '.error.field == "resources.cpus"' <<<"$BODY"
post_json /v1/jobs "$(job gpu '{"device": "cuda"}')"
check "device \"cuda\" without a GPU is refused (422, field device)" \
    jqok '.error.field == "device" and (.error.message | test("no NVIDIA driver"))' <<<"$BODY"

# ---- data that can never train, refused at submit -------------------------------------------
unusable() { # name spec field text: a 422 unusable_data naming the field and the text
    post_json /v1/jobs "$2"
    check "$1: 422 naming $3 and \"$4\" ($(jq -c .error <<<"$BODY"))" \
        jqok --arg f "$3" --arg t "$4" '.error.code == "unusable_data" and .error.field == $f
          and (.error.message | contains($t)) and (.error.message | contains($root) | not)' \
        --arg root "$ROOT" <<<"$BODY"
}
ROOT=$TMP/root
mkdir -p "$ROOT/idx"
: >"$ROOT/empty.txt"
printf 'short text' >"$ROOT/short.txt"
python3 - "$ROOT" <<'PY'
import struct, sys
root = sys.argv[1]
def shard(path, tokens):
    with open(path, "wb") as f:
        f.write(struct.pack("<3i", 20240520, 1, len(tokens)) + bytes(4 * 253))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))
shard(root + "/wide.bin", [i % 300 for i in range(4096)])
def idx(path, dims):
    n = 1
    for d in dims:
        n *= d
    with open(path, "wb") as f:
        f.write(bytes([0, 0, 8, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims))
        f.write(bytes(n))
idx(root + "/idx/train-images-idx3-ubyte", [100, 28, 28])
idx(root + "/idx/train-labels-idx1-ubyte", [99])
PY
stop_daemons
# preemption off: the job of priority 5 below shows the queue's order (check_preempt.sh
# shows preemption)
AMPD_NVML=$TMP/no-such-libnvidia-ml.so start_daemon --max-running 4 --data-root "$ROOT" --preempt off
GPT='"model": {"type": "gpt", "n_layer": 1, "n_head": 1, "d_model": 16, "seq_len": 32}'
unusable "a 0-byte text" "{$GPT, \"data\": {\"type\": \"text\", \"train\": \"empty.txt\"}}" \
    data.train "empty.txt: no text (empty)"
unusable "a text shorter than seq_len + 1" \
    "{$GPT, \"data\": {\"type\": \"text\", \"train\": \"short.txt\", \"eval\": \"short.txt\"}}" \
    data.train "short.txt has 10 tokens, fewer than seq_len + 1 = 33"
unusable "tokens past model.vocab" \
    "{$GPT, \"data\": {\"type\": \"tokens\", \"train\": \"wide.bin\"}}" \
    model.vocab "is 256 but the data has token 299"
unusable "IDX images and labels whose counts differ" \
    '{"model": {"layers": [784, 16, 10]}, "data": {"type": "idx", "train": "idx", "eval": null}}' \
    data.train "idx (train-labels-idx1-ubyte) has 99 labels but idx (train-images-idx3-ubyte) has 100 images"

if [ "$CORES" -ge 2 ]; then
    post_json /v1/jobs "$(job one '{"device": "cpu", "threads": 1}')"
    a=$(jget id)
    post_json /v1/jobs "$(job two '{"device": "cpu", "threads": 1}')"
    b=$(jget id)
    both_bound() { [ -n "$(affinity_of "$a")" ] && [ -n "$(affinity_of "$b")" ]; }
    check "two jobs with threads 1 run at once" wait_for 30 both_bound
    ca=$(affinity_of "$a")
    cb=$(affinity_of "$b")
    check "each is bound to one core of its own (/proc: '$ca' and '$cb')" \
        sh -c "[ -n '$ca' ] && [ -n '$cb' ] && [ '$ca' != '$cb' ] && [ '$ca' -ge 0 ] && [ '$cb' -ge 0 ]"
    check "their start events name the core" events_have "$a" "placed on core $ca"
    req GET /v1/resources
    check "GET /v1/resources names them as the cores' holders" \
        jqok --argjson a "$a" --argjson b "$b" --argjson ca "${ca:-0}" --argjson cb "${cb:-0}" \
        '(.cpus[] | select(.id == $ca) | .job) == $a and (.cpus[] | select(.id == $cb) | .job) == $b' \
        <<<"$BODY"
    # a job for every core, oversubscribed: it waits for the two jobs' cores
    post_json /v1/jobs "$(job many '{"device": "cpu", "threads": 1, "distributed": {"world_size": 64, "oversubscribe": true}, "batch_size": 64}')"
    c=$(jget id)
    check "world_size 64 with oversubscribe is accepted (201)" test "$CODE" = 201
    check "... and waits, saying for what" wait_for 20 events_have "$c" \
        "waiting for $CORES cores ($CORES of $CORES held by job" || show_events "$c"
    cancel "$c"
    check "cancelled while it waits, it never ran" wait_for 20 is_status "$c" cancelled
    post_json /v1/jobs "$(job three '{"device": "cpu", "threads": 1}')"
    d=$(jget id)
    check "a third threads-1 job waits for a core" wait_for 20 events_have "$d" \
        "waiting for 1 core" || show_events "$d"
    req GET "/v1/jobs/$d"
    check "GET /v1/jobs/ID says where it is in the queue and why it waits" \
        jqok '.queue.position == 1 and .queue.priority == 0 and
          (.queue.waiting_for | startswith("waiting for 1 core (2 of 2 held by job"))' <<<"$BODY"
    post_json /v1/jobs "$(job urgent '{"device": "cpu", "threads": 1, "priority": 5}')"
    u=$(jget id)
    queued_first() {
        req GET "/v1/jobs?status=queued"
        jq -e --argjson u "$u" --argjson d "$d" '(.jobs[] | select(.id == $u) | .queue.position) == 1 and
          (.jobs[] | select(.id == $d) | .queue.position) == 2' <<<"$BODY" >/dev/null
    }
    check "a job of priority 5 goes ahead of it in the queue" wait_for 10 queued_first
    post_json "/v1/jobs/$d/priority" '{"priority": 9}'
    check "POST /v1/jobs/ID/priority gives the waiting job 9 (200)" \
        jqok '.spec.priority == 9' <<<"$BODY"
    d_first() {
        req GET "/v1/jobs?status=queued"
        jq -e --argjson u "$u" --argjson d "$d" '(.jobs[] | select(.id == $d) | .queue | .position == 1 and
          .priority == 9) and (.jobs[] | select(.id == $u) | .queue.position) == 2' \
          <<<"$BODY" >/dev/null
    }
    check "... it goes back ahead of the job of priority 5" wait_for 10 d_first
    check "... with an event saying so" wait_for 10 events_have "$d" "priority changed from 0 to 9"
    post_json "/v1/jobs/$d/priority" '{"priority": 5000}'
    check "a priority out of range is a 400 naming it" \
        jqok '.error.code == "invalid_parameter" and .error.field == "priority"' <<<"$BODY"
    cancel "$u"
    wait_for 20 is_status "$u" cancelled
    post_json "/v1/jobs/$u/priority" '{"priority": 1}'
    check "re-prioritising a cancelled job is a 409 naming its state" \
        jqok '.error.code == "conflict" and (.error.message | test("is cancelled; only a job that has not finished can be re-prioritised"))' <<<"$BODY"
    cancel "$a"
    check "... and starts when the first job's core is freed" wait_for 30 is_status "$d" running
    on_freed() { [ "$(affinity_of "$d")" = "$ca" ]; }
    check "... on that core ($ca)" wait_for 10 on_freed
    cancel "$b"
    cancel "$d"
    wait_for 30 is_status "$d" cancelled
else
    echo "SKIP: two jobs on cores of their own: this machine has $CORES core"
fi

# ---- kill -9 of the daemon during a 2-rank job: no old process beside the new ones --------------
post_json /v1/jobs "$(job ranks '{"device": "cpu", "threads": 1, "batch_size": 32,
  "checkpoint_every": 20, "distributed": {"world_size": 2, "oversubscribe": true,
  "rank_timeout_s": 5}}')"
r=$(jget id)
if [ "$CODE" != 201 ] && grep -q 'built without MPI' <<<"$BODY"; then
    echo "SKIP: kill -9 during a 2-rank job: this ampd was built without MPI"
else
    ranks_up() { [ "$(job_procs "$r" | wc -l)" -ge 4 ]; } # worker, mpirun, two ranks
    past_ckpt() {
        req GET "/v1/jobs/$r"
        [ "$(jq -r .checkpoint_step <<<"$BODY")" -ge 20 ] 2>/dev/null
    }
    check "the 2-rank job runs (worker, mpirun and ranks)" wait_for 60 ranks_up
    check "... past a checkpoint" wait_for 60 past_ckpt
    old=$(job_procs "$r" | sort | tr '\n' ' ')
    kill -9 "$DPID"
    wait "$DPID" 2>/dev/null
    AMPD_NVML=$TMP/no-such-libnvidia-ml.so start_daemon --max-running 4 --data-root "$ROOT" --preempt off
    # watch the job's processes until the new ranks run: never an old one beside a new one
    overlap="" seen_new=false
    for _ in $(seq 1 3000); do
        now=$(job_procs "$r" | sort | tr '\n' ' ')
        olds="" news=""
        for p in $now; do
            if [[ " $old " == *" $p "* ]]; then olds+="$p "; else news+="$p "; fi
        done
        [ -n "$olds" ] && [ -n "$news" ] && overlap="old $olds beside new $news"
        [ -n "$news" ] && [ -z "$olds" ] && [ "$(wc -w <<<"$news")" -ge 4 ] && seen_new=true
        $seen_new && break
        sleep 0.01
    done
    check "after a restart the job's new ranks run" $seen_new
    check "no process of the old run beside them (${overlap:-none}; old: $old)" test -z "$overlap"
    check "the log says the old run's processes were ended" \
        grep -q "job $r: ended [0-9]* process.* the previous daemon left running" "$TMP/daemon.log"
    # SIGSTOP of rank 1: the launcher sees its heartbeat stop and ends the job, naming it
    rank_pid() { # id rank: the pid of that rank of the job
        local p
        for p in $(job_procs "$1"); do
            tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" &&
                echo "$p" && return 0
        done
        return 1
    }
    beating() { test -s "$TMP/data/jobs/$r/rank-1.beat"; }
    check "rank 1 of the restarted job beats" wait_for 60 beating
    r1=$(rank_pid "$r" 1)
    check "rank 1 of the restarted job is found ($r1)" test -n "$r1"
    stopped_at=$SECONDS
    [ -n "$r1" ] && kill -STOP "$r1"
    check "/healthz answers while rank 1 is stopped" sh -c "curl -sf -m 5 '$URL/healthz' >/dev/null"
    check "the job fails within rank_timeout_s + 10 s" wait_for 15 is_status "$r" failed
    req GET "/v1/jobs/$r"
    check "... after $((SECONDS - stopped_at)) s, naming rank 1 ($(jq -r .error <<<"$BODY" | head -c 300))" \
        jqok '.error | test("rank 1 \\(host [^,]+, pid [0-9]+\\) has not answered for [0-9]+ s")' \
        <<<"$BODY"
    [ -n "$r1" ] && kill -CONT "$r1" 2>/dev/null
    gone() { [ -z "$(job_procs "$r")" ]; }
    check "no process of the job is left" wait_for 15 gone
    is_status "$r" failed || cancel "$r"
    # 16 ranks on this machine's cores start slowly: not hung while they start
    post_json /v1/jobs "$(job sixteen '{"device": "cpu", "threads": 1, "batch_size": 32,
      "steps": 20, "distributed": {"world_size": 16, "oversubscribe": true,
      "rank_timeout_s": 5}}')"
    s16=$(jget id)
    check "a healthy 16-rank oversubscribed job is not ended as hung while it starts" \
        wait_for 240 is_status "$s16" succeeded
    [ "$(status_of "$s16")" = succeeded ] || tail -5 "$TMP/data/jobs/$s16/worker.log"
fi
stop_daemons

# ---- the CUDA emulator with four GPUs ------------------------------------------------------------
if [ ! -x "$EMU" ] || [ ! -f "$NVML" ]; then
    echo "SKIP: the GPU placement: $EMU or $NVML is not built (make check builds them)"
else
    AMPD=$EMU AMPD_NVML=$NVML AMPD_CUDAEMU_DEVICES=4 start_daemon --max-running 8
    check "the emulated daemon starts with four GPUs" \
        grep -q 'GPUs: 0 ampd CUDA emulator (CPU) 16.0 GiB, 1 .*, 3 ampd CUDA emulator' \
        "$TMP/daemon.log"
    post_json /v1/jobs "$(job far '{"device": "cuda:5"}')"
    check "device cuda:5 on four GPUs is refused (422, field device)" \
        jqok '.error.field == "device" and (.error.message | test("ampd has 4 GPUs"))' <<<"$BODY"
    ids=()
    for i in 1 2 3 4; do
        post_json /v1/jobs "$(job "g$i" '{"device": "cuda", "threads": 1}')"
        ids+=("$(jget id)")
    done
    all_running() {
        local id
        for id in "${ids[@]}"; do [ -n "$(visible_of "$id")" ] || return 1; done
    }
    check "four 1-GPU jobs run at once" wait_for 60 all_running
    vis=$(for id in "${ids[@]}"; do visible_of "$id"; done | sort | tr '\n' ' ')
    check "each has a GPU of its own in CUDA_VISIBLE_DEVICES ($vis)" test "$vis" = "0 1 2 3 "
    req GET /v1/resources
    check "GET /v1/resources: every GPU held by one job" \
        jqok '[.devices[] | .jobs | length] == [1, 1, 1, 1]' <<<"$BODY"
    curl -sf -m 20 "$URL/metrics" >"$TMP/metrics"
    g2=$(jq -r '.devices[] | select(.index == 2) | .jobs[0]' <<<"$BODY")
    check "/metrics: the job that holds GPU 2 ($g2) and its memory" sh -c \
        "grep -qx 'ampd_gpu_job{gpu=\"2\",name=\"ampd CUDA emulator (CPU)\"} $g2' '$TMP/metrics' &&
         grep -qx 'ampd_gpu_memory_total_bytes{gpu=\"2\",name=\"ampd CUDA emulator (CPU)\"} 17179869184' '$TMP/metrics'"
    post_json /v1/jobs "$(job g5 '{"device": "cuda", "threads": 1}')"
    e=$(jget id)
    check "a fifth waits for a GPU, naming the holders" wait_for 20 events_have "$e" \
        "waiting for 1 GPU (4 of 4 held by job ${ids[0]}, ${ids[1]}, ${ids[2]}, ${ids[3]})"
    freed=$(visible_of "${ids[2]}")
    cancel "${ids[2]}"
    ok_start() { [ "$(visible_of "$e")" = "$freed" ]; }
    check "... and starts on the GPU freed ($freed)" wait_for 60 ok_start
    check "its start event names it" events_have "$e" "placed on GPU $freed"
    for id in "${ids[@]}" "$e"; do cancel "$id"; done
fi

openapi_check_recorded
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
