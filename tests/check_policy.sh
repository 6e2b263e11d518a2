#!/bin/bash
# check_policy.sh - on_numerics, end to end through the daemon (docs/api.md "Branches",
# docs/diagnostics.md "Remedies"):
#   - lost updates: an fp16 MLP without master weights at a small rate loses most of its
#     updates; with on_numerics "branch" it ends "branched" at the step of the
#     recommendation, its branch (master weights on, from the newest checkpoint before that
#     step, the recommendation's event named as its remedy) succeeds, and its mean loss over
#     the last 20 steps is below the same job's with on_numerics "stop" (which goes on as it
#     is) over the same steps;
#   - activations that cross fp16's 65504 as the run goes (init_scale 52: fc3 starts just
#     under it), seeds 1-3: each job ends branched, its branch is bf16 from the last
#     checkpoint before the first overflow of fc3, and the branches' mean accuracy is within 1
#     point of the same jobs submitted in bf16;
#   - activations beyond fp16's 65504 from the first step (init_scale 100): the job branches
#     to bf16 from its start (no checkpoint precedes the problem; max_branches 1, so the
#     branch, at its limit, goes on as it is), and the branch's accuracy is within 1 point of
#     the same job submitted in bf16;
#   - a scale collapse (a loss-scale floor of 2^20 that fp16's gradients overflow at: every
#     step skipped until the run fails at the floor): the job ends branched, not failed; its
#     branch lowers the floor to 1 with the scaler started anew, and stops skipping within
#     20 steps of its start;
#   - a GPT of 2 ranks whose fp16-compressed all-reduce overflows as its loss scale grows
#     ends branched; its branch takes comm_hook "bf16" from a checkpoint before the overflow
#     and runs to its end without one (skipped, with the reason, without MPI);
#   - a loss spike with finite gradients (Fashion-MNIST in the file's order, the labels of 8
#     batches after step 150 wrong): the job ends branched; its branch starts from the
#     checkpoint at step 50 (at least 100 steps back) and skips 200 batches, runs without a
#     spike, and equals `ampd run --branch-from` of that checkpoint with its spec; with the
#     default retention (nothing kept 100 steps back) it starts from the oldest checkpoint
#     kept before the spike;
#   - max_branches 0: the job does not branch, and an event says why;
#   - "ask": the job pauses with an event naming the remedy and the request that applies it;
#     an unpause goes on as it is (and does not ask again: it succeeds); on another asked
#     job, POST /branch {"remedy": id} ends it "branched" and its branch succeeds;
#   - every answer recorded matches the OpenAPI description.
# Exit 77 (SKIP) without jq or Fashion-MNIST. The daemon is stopped by pid on exit.
set -u
AMPD=${AMPD:-./ampd}
command -v jq >/dev/null || { echo "SKIP: check_policy needs jq (Debian jq)"; exit 77; }
[ -d /usr/share/datasets/fashion-mnist ] ||
    { echo "SKIP: check_policy: Fashion-MNIST is not installed (dataset-fashion-mnist)"; exit 77; }
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp
# shellcheck source=tests/apilib.sh
. "$(dirname "$0")/apilib.sh"
# the GPT of 2 ranks runs under Open MPI, whose allocations that live until exit are not
# ours (an --enable-asan build; see tests/lsan.supp)
LSAN_OPTIONS="suppressions=$(cd "$(dirname "$0")" && pwd)/lsan.supp:fast_unwind_on_malloc=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export LSAN_OPTIONS

# the lost-updates job: fp16 without master weights at a rate whose updates mostly round away
LOST='{"name": "lost", "model": {"type": "mlp", "layers": [784, 64, 10]},
  "data": {"type": "idx", "train": "fashion-mnist"},
  "precision": {"dtype": "fp16", "master_weights": false}, "batch_size": 64, "steps": 100,
  "seed": 3, "threads": 1, "checkpoint_every": 5, "diagnostics_every": 10,
  "optimizer": {"type": "sgd", "lr": 0.001, "momentum": 0}}'
# activations beyond fp16's range from the first step
WIDE='{"name": "wide", "model": {"type": "mlp", "layers": [784, 256, 256, 10], "init_scale": 100},
  "data": {"type": "idx", "train": "fashion-mnist"}, "precision": {"dtype": "fp16"},
  "batch_size": 64, "steps": 100, "seed": 1, "threads": 1, "eval_every": 100,
  "checkpoint_every": 50, "diagnostics_every": 5, "max_branches": 1,
  "optimizer": {"type": "sgd", "lr": 0.001, "momentum": 0.9}}'
submit() { # spec: sets ID
    post_json /v1/jobs "$1"
    ID=$(jq -r .id <<<"$BODY")
}
child_of() { # id: its newest branch
    req GET "/v1/jobs/$1"
    jq -r '.branches[-1] // empty' <<<"$BODY"
}
# mean_loss ID FROM TO: the mean training loss over steps FROM..TO
mean_loss() {
    acurl -s -m 30 "$URL/v1/jobs/$1/metrics?fields=loss&from=$2&to=$3&format=csv" | tail -n +2 |
        awk -F, '{ s += $2; n++ } END { if (n) printf "%.6f", s / n }'
}
final_acc() {
    req GET "/v1/jobs/$1"
    jq -r '.summary.eval_acc // empty' <<<"$BODY"
}

mkdir -p "$TMP/text"
for i in $(seq 2000); do echo "line $i: the $((i % 7)) quick brown foxes jump over $((i * 13 % 97)) dogs"; done \
    >"$TMP/text/fox.txt"
# Fashion-MNIST with the labels of the 8 batches after the first 150 (in the file's order)
# moved by 5 classes: a loss spike where they come, with finite gradients
mkdir -p "$TMP/datasets/spiky"
python3 - "$TMP/datasets/spiky" <<'PY'
import gzip, os, sys
src, dst = "/usr/share/datasets/fashion-mnist", sys.argv[1]
labels = bytearray(gzip.open(src + "/train-labels-idx1-ubyte.gz").read())
for i in range(150 * 64, 158 * 64):
    labels[8 + i] = (labels[8 + i] + 5) % 10
with gzip.open(dst + "/train-labels-idx1-ubyte.gz", "wb") as f:
    f.write(bytes(labels))
for n in ("train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
    os.symlink(src + "/" + n, dst + "/" + n)
PY
start_daemon --max-running 2 --data-root /usr/share/datasets --data-root "$TMP/text" \
    --data-root "$TMP/datasets"
check "the daemon starts" test -n "$PORT" || { cat "$TMP/daemon.log"; exit 1; }

# ---- lost updates: branch to master weights ---------------------------------------------------
submit "$(jq -c '.on_numerics = "branch"' <<<"$LOST")"
L=$ID
submit "$(jq -c '.on_numerics = "stop" | .name = "lost-stop"' <<<"$LOST")"
LS=$ID
check "with on_numerics branch, the lost-updates job (job $L) ends branched" \
    wait_for 120 is_status "$L" branched
B=$(child_of "$L")
req GET "/v1/jobs/$B"
check "... its branch (job $B) turns master weights on from the newest checkpoint before the recommendation" \
    body_has '.branch.patch == {precision: {master_weights: true}} and (.branch.remedy | type) == "number"
        and .branch.step > 0 and .spec.precision.master_weights and .spec.on_numerics == "branch"'
at=$(jq -r .branch.step <<<"$BODY")
rid=$(jq -r .branch.remedy <<<"$BODY")
req GET "/v1/jobs/$L/events?limit=1000"
check "... the remedy it names is the job's recommendation, made after step $at" \
    body_has --argjson r "$rid" --argjson s "$at" '[.events[] | select(.id == $r and .kind == "recommendation"
        and .step > $s and .step <= $s + 10)] | length == 1'
check "... and an event says what the policy did" \
    grep -q 'on_numerics branch: stopping to branch with {"precision":{"master_weights":true}}' <(events "$L")
check "... and the job's end names its branch" grep -q "branched: job $B goes on" <(events "$L")
check "the branch succeeds" wait_for 180 is_status "$B" succeeded
check "the job with on_numerics stop goes on as it is and succeeds" wait_for 180 is_status "$LS" succeeded
mb=$(mean_loss "$B" 81 100)
ms=$(mean_loss "$LS" 81 100)
check "the branch's mean loss over steps 81-100 ($mb) is below the unbranched job's ($ms)" \
    awk -v a="$mb" -v b="$ms" 'BEGIN { exit !(a != "" && b != "" && a < b) }'

# ---- activations beyond fp16's range as the run goes: to bf16, from the checkpoint before ------
# fc3's activations start just under 65504 (init_scale 52) and cross it within the first 30
# steps; each seed's job branches from its last checkpoint before that, and over the seeds
# the branches reach the accuracy of the same jobs in bf16 from the start
GROW=$(jq -c '.name = "grow" | .model.init_scale = 52 | .steps = 300 | .eval_every = 300 |
    .checkpoint_every = 5 | .diagnostics_every = 0 | .max_branches = 2 | .optimizer.lr = 0.0003' <<<"$WIDE")
for seed in 1 2 3; do
    submit "$(jq -c --argjson s "$seed" '.seed = $s | .on_numerics = "branch"' <<<"$GROW")"
    GROWN[seed]=$ID
    submit "$(jq -c --argjson s "$seed" '.seed = $s | .precision.dtype = "bf16" | .name = "grow-bf16"' <<<"$GROW")"
    GROWB[seed]=$ID
done
accs=()
for seed in 1 2 3; do
    g=${GROWN[seed]}
    check "activations crossing 65504 (job $g, seed $seed): the job ends branched" \
        wait_for 120 is_status "$g" branched
    req GET "/v1/jobs/$g/events?limit=1000"
    first=$(jq -r '[.events[] | select(.kind == "recommendation" and (.message | test("^activations of fc3 exceed")))][0].step // empty' <<<"$BODY")
    gc=$(child_of "$g")
    req GET "/v1/jobs/$gc"
    check "... at step ${first:-?}; its branch (job $gc) is bf16 from the checkpoint before it, step $(( (${first:-1} - 1) / 5 * 5 ))" \
        body_has --argjson f "${first:-0}" '.branch.patch == {precision: {dtype: "bf16"}} and
            $f > 5 and .branch.step == (($f - 1) / 5 | floor) * 5 and .branch.resets == ["loss_scale"]'
    check "... and succeeds" wait_for 240 is_status "$gc" succeeded
    check "the same job in bf16 (job ${GROWB[seed]}) succeeds" wait_for 240 is_status "${GROWB[seed]}" succeeded
    accs+=("$(final_acc "$gc")" "$(final_acc "${GROWB[seed]}")")
done
check "over seeds 1-3 the branches' mean accuracy is within 1 point of bf16 from the start ($(printf '%s/%s ' "${accs[@]}"))" \
    awk -v v="${accs[*]}" 'BEGIN { n = split(v, a, " "); if (n != 6) exit 1
        for (i = 1; i <= 6; i += 2) { d += a[i] - a[i + 1] } d /= 3; exit !(d <= 0.01 && d >= -0.01) }'

# ---- activations beyond fp16's range from the first step: to bf16, from the start ------------
submit "$(jq -c '.on_numerics = "branch"' <<<"$WIDE")"
W=$ID
submit "$(jq -c '.precision.dtype = "bf16" | .name = "wide-bf16"' <<<"$WIDE")"
WB=$ID
check "activations beyond 65504 (job $W): the job ends branched" wait_for 120 is_status "$W" branched
C=$(child_of "$W")
req GET "/v1/jobs/$C"
check "... its branch (job $C) is bf16, from the start (no checkpoint precedes step 1)" \
    body_has '.branch.patch == {precision: {dtype: "bf16"}} and .branch.step == 0 and
        .branch.resets == ["loss_scale"] and .spec.precision.loss_scale.mode == "none"'
check "... and succeeds" wait_for 240 is_status "$C" succeeded
check "the same job in bf16 succeeds" wait_for 240 is_status "$WB" succeeded
ac=$(final_acc "$C")
ab=$(final_acc "$WB")
check "the branch's accuracy ($ac) is within 1 point of bf16 from the start ($ab)" \
    awk -v a="$ac" -v b="$ab" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 0.01) }'

# ---- a scale collapse: a loss-scale floor too high ---------------------------------------------
submit "$(jq -c '.name = "collapse" | .on_numerics = "branch" | .steps = 120 | .diagnostics_every = 10 |
    .precision = {dtype: "fp16", loss_scale: {init: 16777216, min_scale: 1048576}} |
    .optimizer = {type: "sgd", lr: 0.05, momentum: 0.9}' <<<"$LOST")"
S=$ID
check "a loss scale stuck at a floor of 2^20 (job $S): the job ends branched" \
    wait_for 120 is_status "$S" branched
req GET "/v1/jobs/$S"
check "... after skipping every step from its first" body_has '.summary.skipped_total == .summary.steps'
SC=$(child_of "$S")
req GET "/v1/jobs/$SC"
check "... its branch (job $SC) lowers the floor to 1 and starts the scaler anew" \
    body_has '.branch.patch == {precision: {loss_scale: {min_scale: 1}}} and
        .branch.resets == ["loss_scale"] and .spec.precision.loss_scale.min_scale == 1'
check "... and succeeds" wait_for 120 is_status "$SC" succeeded
req GET "/v1/jobs/$SC"
sk=$(jq -r '.summary.skipped_total' <<<"$BODY")
first=$(jq -r .branch.step <<<"$BODY")
last=$(acurl -s -m 30 "$URL/v1/jobs/$SC/metrics?fields=skipped&from=1&to=120&format=csv" | tail -n +2 |
    awk -F, '$2 == 1 { s = $1 } END { print s + 0 }')
check "... it stops skipping: $sk skipped steps, the last at step $last, within 20 steps of its start ($first)" \
    test "$last" -le "$((first + 20))"

# ---- a loss spike with finite gradients: rewind and skip the batches (PaLM's recipe) ----------
submit '{"name": "spike", "model": {"type": "mlp", "layers": [784, 64, 10]},
  "data": {"type": "idx", "train": "spiky", "shuffle": false}, "precision": {"dtype": "fp32"},
  "batch_size": 64, "steps": 300, "seed": 3, "threads": 1, "checkpoint_every": 25,
  "checkpoints": {"keep_last": 0}, "on_numerics": "branch",
  "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}}'
K=$ID
check "a loss spike on mislabelled batches (job $K): the job ends branched" \
    wait_for 120 is_status "$K" branched
req GET "/v1/jobs/$K/events?limit=1000"
check "... its one recommendation is the spike at step 151, the first mislabelled batch" \
    body_has '[.events[] | select(.kind == "recommendation")] | map([.step, (.message | test("^loss spike: .* standard deviations above the mean"))]) == [[151, true]]'
check "... and the policy rewinds at least 100 steps and skips 200 batches" \
    grep -q 'on_numerics branch: stopping to branch with {"data":{"skip_batches":200}} from the newest checkpoint at least 100 steps before step 151' \
    <(events "$K")
KC=$(child_of "$K")
req GET "/v1/jobs/$KC"
check "... its branch (job $KC) starts at step 50 and skips 200 batches, the data still in order" \
    body_has '.branch.patch == {data: {skip_batches: 200}} and .branch.step == 50 and
        .spec.data.skip_batches == 200 and .spec.data.shuffle == false and .branch.resets == []'
jq .spec <<<"$BODY" >"$TMP/spike-branch.json"
check "... and succeeds" wait_for 120 is_status "$KC" succeeded
spike=$(acurl -s -m 30 "$URL/v1/jobs/$K/metrics?fields=loss&from=151&to=151&format=csv" | tail -1 | cut -d, -f2)
acurl -s -m 30 "$URL/v1/jobs/$KC/metrics?fields=loss&format=csv" | tail -n +2 >"$TMP/spike-branch.csv"
top=$(cut -d, -f2 "$TMP/spike-branch.csv" | sort -g | tail -1)
check "... without a spike: its highest loss over steps 51-300 ($top) is below a fifth of the parent's at step 151 ($spike)" \
    awk -v a="$top" -v b="$spike" 'BEGIN { exit !(a != "" && b != "" && a * 5 < b) }'
"$AMPD" run --every 1 --data-root /usr/share/datasets --data-root "$TMP/datasets" \
    --branch-from "$TMP/data/jobs/$K/ckpt-50.safetensors" "$TMP/spike-branch.json" 2>/dev/null |
    jq -r 'select(.type == "step") | "\(.step),\(.loss)"' >"$TMP/spike-ref.csv"
check "... and every step is ampd run --branch-from the parent's checkpoint at 50 with its spec" \
    cmp -s "$TMP/spike-ref.csv" <(cut -d, -f1,2 "$TMP/spike-branch.csv")
# with the default retention (the 3 newest checkpoints and the newest healthy one) nothing
# 100 steps back is left when the spike comes: the branch takes the oldest kept before it
req GET "/v1/jobs/$K"
submit "$(jq -c '.spec | .name = "spike-kept" | del(.checkpoints)' <<<"$BODY")"
KK=$ID
check "the same job with the default retention (job $KK) ends branched" \
    wait_for 120 is_status "$KK" branched
req GET "/v1/jobs/$KK/checkpoints"
oldest=$(jq '[.checkpoints[].step | select(. < 151)] | min // 0' <<<"$BODY")
req GET "/v1/jobs/$(child_of "$KK")"
check "... its branch starts from the oldest checkpoint kept before the spike, step $oldest" \
    body_has --argjson o "$oldest" '$o > 51 and .branch.step == $o and .branch.patch == {data: {skip_batches: 200}}'

# ---- a GPT of 2 ranks whose fp16-compressed all-reduce overflows: to comm_hook bf16 ---------
if grep -q '^#define HAVE_MPI 1' config.h 2>/dev/null && command -v mpirun >/dev/null; then
    submit '{"name": "gpt-comm", "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 64,
      "seq_len": 32, "vocab": 256}, "data": {"type": "text", "train": "fox.txt", "val_fraction": 0.1},
      "precision": {"dtype": "bf16", "loss_scale": {"mode": "dynamic", "init": 65536, "growth_interval": 4}},
      "optimizer": {"type": "adamw", "lr": 0.001}, "batch_size": 8, "steps": 60, "seed": 1,
      "threads": 1, "diagnostics_every": 1, "checkpoint_every": 5, "on_numerics": "branch",
      "distributed": {"world_size": 2, "comm_hook": "fp16"}}'
    G=$ID
    check "a 2-rank GPT whose fp16 all-reduce overflows as its scale grows (job $G) ends branched" \
        wait_for 180 is_status "$G" branched
    GB=$(child_of "$G")
    req GET "/v1/jobs/$GB"
    check "... its branch (job $GB) takes comm_hook bf16 from a checkpoint before the overflow" \
        body_has '.branch.patch == {distributed: {comm_hook: "bf16"}} and .branch.step >= 5 and
            .spec.distributed.comm_hook == "bf16" and .spec.distributed.world_size == 2'
    check "... and succeeds" wait_for 180 is_status "$GB" succeeded
    req GET "/v1/jobs/$GB"
    check "... without an overflow ($(jq -c .summary.overflow_total <<<"$BODY"))" \
        body_has '.summary.overflow_total == 0'
else
    echo "# SKIP the 2-rank GPT: this ampd was built without MPI"
fi

# ---- max_branches 0 ----------------------------------------------------------------------------
submit "$(jq -c '.on_numerics = "branch" | .max_branches = 0 | .steps = 40' <<<"$LOST")"
M=$ID
check "max_branches 0 (job $M): the job goes on and succeeds" wait_for 120 is_status "$M" succeeded
check "... an event says why it did not branch" \
    grep -q 'not branching with {"precision":{"master_weights":true}}: the lineage has 0 branch(es) and max_branches is 0' \
    <(events "$M")
check "... and it has no branch" test -z "$(child_of "$M")"

# ---- ask -----------------------------------------------------------------------------------------
submit "$(jq -c '.on_numerics = "ask" | .steps = 60' <<<"$LOST")"
K=$ID
check "on_numerics ask (job $K): the job pauses" wait_for 120 is_status "$K" paused
events "$K" >"$TMP/ask.ev"
check "... with an event naming the remedy and the request that applies it" \
    grep -q "on_numerics ask: paused: .*POST /v1/jobs/$K/branch {\"remedy\": [0-9]*} branches it with {\"precision\":{\"master_weights\":true}}" "$TMP/ask.ev"
post_json "/v1/jobs/$K/unpause" '{}'
check "an unpause ($CODE) goes on as it is, without asking again: it succeeds" \
    wait_for 120 is_status "$K" succeeded
submit "$(jq -c '.on_numerics = "ask" | .steps = 60 | .name = "ask-2"' <<<"$LOST")"
K2=$ID
check "another asked job (job $K2) pauses" wait_for 120 is_status "$K2" paused
rid=$(events "$K2" | grep -o 'branch {"remedy": [0-9]*}' | grep -o '[0-9]*' | head -1)
post_json "/v1/jobs/$K2/branch" "{\"remedy\": ${rid:-0}}"
KB=$(jq -r '.id // empty' <<<"$BODY")
check "POST /branch {remedy: $rid} answers it ($CODE, job $KB)" test "$CODE" = 201 -a -n "$KB"
check "... the asked job is branched" is_status "$K2" branched
check "... and its branch succeeds" wait_for 120 is_status "$KB" succeeded

openapi_check_recorded
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
