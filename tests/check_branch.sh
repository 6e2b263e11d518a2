#!/bin/bash
# check_branch.sh - branching a job from one of its checkpoints with a changed spec
# (POST /v1/jobs/ID/branch, docs/api.md "Branches"), end to end through the daemon:
#   - a parent (the MLP on Fashion-MNIST in fp16 with dynamic loss scaling, SGD with
#     momentum, a checkpoint every 40 steps) runs to its end;
#   - a branch from step 40 whose patch changes the learning-rate schedule (cosine decay):
#     its record names the parent, the step, the reason and the patch, the parent's
#     "branches" lists it, and both jobs' events say so;
#   - the branch succeeds with one row per step 41..STEPS and none before; every step's loss
#     and loss scale equal `ampd run --resume` of the parent's checkpoint with the branch's
#     spec (the weights, the optimizer, the scaler and the data order carried over whole);
#     its first step's loss is the parent's (the same weights), its later ones are not
#     (another rate);
#   - a branch of the branch keeps the whole lineage, [parent, branch], and its metrics with
#     lineage=true (CSV and JSON) are the parent's steps to 40, the branch's to 80, then its
#     own, each naming its job (downsampled: refused);
#   - a branch of a branch from the step it began at starts from the state it began with
#     (the first parent's checkpoint), resetting what it reset;
#   - a branch to bf16 takes bf16's loss-scaling defaults (none) and starts its scaler anew
#     (resets ["loss_scale"]; its start event says so); it equals `ampd run --branch-from
#     --branch-reset loss_scale`; a branch with master weights from a parent without them
#     converts the fp16 weights to an fp32 master exactly (its first step's loss is the
#     parent's) and keeps the scaler's state;
#   - a recommendation's remedy (a job losing updates without master weights: master
#     weights on) is in its event's data and in GET /layers (up to the step asked for), and
#     {"remedy": id} branches with it from the
#     newest checkpoint before the step where the problem showed;
#   - a running parent whose retention keeps one checkpoint keeps the one a waiting branch
#     starts from, and the branch runs from it once the parent has ended;
#   - refused, naming the field: a step without a checkpoint (422, listing the steps that
#     have one), another model, another world size, a patched value the spec refuses
#     (patch.optimizer.lr), steps that end before the branch step (422), an unknown member
#     and a missing patch (400); a job that does not exist is 404; the parent is unchanged;
#   - every answer recorded matches the OpenAPI description.
# Exit 77 (SKIP) without jq or Fashion-MNIST. The daemon is stopped by pid on exit.
set -u
AMPD=${AMPD:-./ampd}
command -v jq >/dev/null || { echo "SKIP: check_branch needs jq (Debian jq)"; exit 77; }
[ -d /usr/share/datasets/fashion-mnist ] ||
    { echo "SKIP: check_branch: Fashion-MNIST is not installed (dataset-fashion-mnist)"; exit 77; }
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp
# shellcheck source=tests/apilib.sh
. "$(dirname "$0")/apilib.sh"

STEPS=120
SPEC='{"name": "parent", "model": {"type": "mlp", "layers": [784, 64, 10]},
  "data": {"type": "idx", "train": "fashion-mnist"}, "precision": {"dtype": "fp16"},
  "batch_size": 64, "steps": 120, "seed": 3, "threads": 1, "checkpoint_every": 40,
  "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}}'
rows() { # id: "step,loss,loss_scale" of every row
    acurl -s -m 30 "$URL/v1/jobs/$1/metrics?fields=loss,loss_scale&from=1&to=$STEPS&format=csv" |
        tail -n +2
}
branch() { # id body: sets CODE, BODY, ID (the new job's, when created)
    post_json "/v1/jobs/$1/branch" "$2"
    ID=$(jq -r '.id // empty' <<<"$BODY" 2>/dev/null)
}
refused() { # name id body code field: the branch is refused with code, naming field
    branch "$2" "$3"
    check "$1: $4 naming $5 ($CODE $(jq -c .error.field <<<"$BODY" 2>/dev/null))" \
        test "$CODE" = "$4" -a "$(jq -r .error.field <<<"$BODY" 2>/dev/null)" = "$5"
}

start_daemon
check "the daemon starts" test -n "$PORT" || { cat "$TMP/daemon.log"; exit 1; }
post_json /v1/jobs "$SPEC"
P=$(jq -r .id <<<"$BODY")
check "the parent (job $P) succeeds" wait_for 120 is_status "$P" succeeded
rows "$P" >"$TMP/parent.csv"

# ---- a branch with another learning-rate schedule ---------------------------------------------
branch "$P" '{"from_step": 40, "patch": {"optimizer": {"schedule": "cosine"}}, "reason": "try cosine decay"}'
B=$ID
check "POST /branch creates a job ($CODE, job $B)" test "$CODE" = 201 -a -n "$B"
check "... whose record names the parent, the step, the reason and the patch" \
    body_has --argjson p "$P" '.branch == {parent: $p, step: 40, reason: "try cosine decay",
        patch: {optimizer: {schedule: "cosine"}}, lineage: [$p], resets: [], remedy: null}'
check "... and whose spec is the parent's with the patch" \
    body_has '.spec.optimizer.schedule == "cosine" and .spec.optimizer.lr == 0.05 and
        .spec.checkpoint_every == 40'
check "the branch succeeds" wait_for 120 is_status "$B" succeeded
req GET "/v1/jobs/$P"
check "the parent's branches list it" body_has --argjson b "$B" '.branches == [$b]'
check "... and its event says so" grep -q "branch: job $B starts from this job's checkpoint at step 40" \
    <(events "$P")
check "the branch's event names its parent and the patch" \
    grep -q "branched from job $P at step 40: try cosine decay; patch {\"optimizer\":{\"schedule\":\"cosine\"}}" \
    <(events "$B")
rows "$B" >"$TMP/branch.csv"
check "its history is steps 41..$STEPS" \
    test "$(cut -d, -f1 "$TMP/branch.csv" | tr '\n' ' ')" = "$(seq 41 $STEPS | tr '\n' ' ')"
req GET "/v1/jobs/$B"
jq .spec <<<"$BODY" >"$TMP/branch.json"
"$AMPD" run --every 1 --resume "$TMP/data/jobs/$P/ckpt-40.safetensors" "$TMP/branch.json" \
    >"$TMP/ref.out" 2>"$TMP/ref.err"
status_is "ampd run --resume of the parent's checkpoint with the branch's spec" 0 $?
jq -r 'select(.type == "step") | "\(.step),\(.loss),\(.loss_scale)"' "$TMP/ref.out" >"$TMP/ref.csv"
check "... every step's loss and loss scale are the branch's ($(diff "$TMP/ref.csv" "$TMP/branch.csv" | head -2 | tr '\n' ' '))" \
    cmp -s "$TMP/ref.csv" "$TMP/branch.csv"
check "its first step's loss is the parent's (the same weights)" \
    test "$(grep '^41,' "$TMP/branch.csv" | cut -d, -f2)" = "$(grep '^41,' "$TMP/parent.csv" | cut -d, -f2)"
check "... its last is not (another rate)" \
    test "$(tail -1 "$TMP/branch.csv" | cut -d, -f2)" != "$(tail -1 "$TMP/parent.csv" | cut -d, -f2)"

# ---- a branch of the branch -------------------------------------------------------------------
branch "$B" '{"from_step": 80, "patch": {"optimizer": {"lr": 0.02}}}'
B2=$ID
check "a branch of the branch (job $B2) keeps the whole lineage" \
    body_has --argjson p "$P" --argjson b "$B" '.branch.lineage == [$p, $b] and .branch.parent == $b
        and .branch.reason == "by hand" and .spec.optimizer.schedule == "cosine"
        and .spec.optimizer.lr == 0.02'
check "... and succeeds" wait_for 120 is_status "$B2" succeeded
check "... from step 81" test "$(rows "$B2" | head -1 | cut -d, -f1)" = 81
acurl -s -m 30 "$URL/v1/jobs/$B2/metrics?fields=loss,loss_scale&format=csv&lineage=true" >"$TMP/lineage.csv"
check "its lineage CSV names the job of every step: $P for 1-40, $B for 41-80, $B2 for 81-$STEPS" \
    test "$(head -1 "$TMP/lineage.csv")" = job,step,loss,loss_scale -a \
    "$(tail -n +2 "$TMP/lineage.csv" | cut -d, -f1,2 | tr '\n' ' ')" = \
    "$( (seq 1 40 | sed "s/^/$P,/"; seq 41 80 | sed "s/^/$B,/"; seq 81 $STEPS | sed "s/^/$B2,/") | tr '\n' ' ')"
check "... with each job's own rows" cmp -s <(tail -n +2 "$TMP/lineage.csv" | cut -d, -f2-) \
    <(head -40 "$TMP/parent.csv"; sed -n 1,40p "$TMP/branch.csv"; rows "$B2")
req GET "/v1/jobs/$B2/metrics?fields=loss&from=39&to=42&lineage=true"
check "... and in JSON, the lineage root first and each point's job" \
    body_has --argjson p "$P" --argjson b "$B" --argjson b2 "$B2" '.lineage == [$p, $b, $b2] and
        [.points[] | [.job, .step]] == [[$p, 39], [$p, 40], [$b, 41], [$b, 42]]'
req GET "/v1/jobs/$B2/metrics?lineage=true&points=50"
check "a downsampled lineage is refused, naming lineage ($CODE)" \
    test "$CODE" = 400 -a "$(jq -r .error.field <<<"$BODY")" = lineage

# ---- another dtype: the loss scaler starts anew ---------------------------------------------------
branch "$P" '{"from_step": 40, "patch": {"precision": {"dtype": "bf16"}}, "reason": "fp16 overflows"}'
BB=$ID
check "a branch to bf16 (job $BB) starts its loss scaler anew, with bf16's defaults" \
    body_has '.branch.resets == ["loss_scale"] and .spec.precision.dtype == "bf16" and
        .spec.precision.loss_scale.mode == "none"'
check "... and succeeds" wait_for 120 is_status "$BB" succeeded
rows "$BB" >"$TMP/bf16.csv"
check "... from step 41, without loss scaling" \
    test "$(cut -d, -f1,3 "$TMP/bf16.csv" | head -1)" = "41,1" -a "$(cut -d, -f3 "$TMP/bf16.csv" | sort -u)" = 1
check "... its start event says what was reset" \
    grep -q "branch start: from .*ckpt-40.safetensors (step 40); the loss scaler starts anew at 1 (no loss scaling)" \
    <(events "$BB")
req GET "/v1/jobs/$BB"
jq .spec <<<"$BODY" >"$TMP/bf16.json"
"$AMPD" run --every 1 --branch-from "$TMP/data/jobs/$P/ckpt-40.safetensors" --branch-reset loss_scale \
    "$TMP/bf16.json" >"$TMP/bf16.out" 2>"$TMP/bf16.err"
jq -r 'select(.type == "step") | "\(.step),\(.loss),\(.loss_scale)"' "$TMP/bf16.out" >"$TMP/bf16-ref.csv"
check "... every step equals ampd run --branch-from --branch-reset loss_scale" \
    cmp -s "$TMP/bf16-ref.csv" "$TMP/bf16.csv"
branch "$BB" '{"from_step": 40, "patch": {"optimizer": {"lr": 0.02}}}'
BS=$ID
check "a branch of it from step 40, where it began (job $BS): its parent's start, the scaler reset as there" \
    body_has --argjson bb "$BB" '.branch.parent == $bb and .branch.step == 40 and
        .branch.resets == ["loss_scale"] and .spec.precision.dtype == "bf16"'
check "... and succeeds" wait_for 120 is_status "$BS" succeeded
req GET "/v1/jobs/$BS"
jq .spec <<<"$BODY" >"$TMP/bs.json"
"$AMPD" run --every 1 --branch-from "$TMP/data/jobs/$P/ckpt-40.safetensors" --branch-reset loss_scale \
    "$TMP/bs.json" 2>/dev/null | jq -r 'select(.type == "step") | "\(.step),\(.loss),\(.loss_scale)"' >"$TMP/bs-ref.csv"
check "... every step equals ampd run --branch-from the first parent's checkpoint at 40" \
    cmp -s "$TMP/bs-ref.csv" <(rows "$BS")

# ---- master weights on, from a parent without them: its 16-bit weights become the master -----
post_json /v1/jobs "$(jq -c '.name = "no-master" | .precision.master_weights = false' <<<"$SPEC")"
PN=$(jq -r .id <<<"$BODY")
check "a parent without master weights (job $PN) succeeds" wait_for 120 is_status "$PN" succeeded
branch "$PN" '{"from_step": 40, "patch": {"precision": {"master_weights": true}}}'
BM=$ID
check "its branch with master weights (job $BM) keeps the loss scaler's state" \
    body_has '.branch.resets == [] and .spec.precision.master_weights == true'
check "... and succeeds" wait_for 120 is_status "$BM" succeeded
check "... its first step's loss and scale are the parent's (the fp16 weights made fp32 exactly)" \
    test "$(rows "$BM" | head -1)" = "$(rows "$PN" | grep '^41,')"
check "... its start event says the weights were converted" \
    grep -q "weight tensor(s) converted to fp32 (master weights on)" <(events "$BM")

# ---- a recommendation's remedy, taken as it stands ----------------------------------------------
post_json /v1/jobs "$(jq -c '.name = "lost-updates" | .steps = 60 | .checkpoint_every = 5 |
    .checkpoints = {keep_last: 0} | .diagnostics_every = 10 | .precision.master_weights = false |
    .optimizer = {type: "sgd", lr: 0.001, momentum: 0}' <<<"$SPEC")"
PL=$(jq -r .id <<<"$BODY")
check "a job that loses updates without master weights (job $PL) succeeds" \
    wait_for 120 is_status "$PL" succeeded
req GET "/v1/jobs/$PL/events?limit=1000"
RECO=$(jq -c '[.events[] | select(.kind == "recommendation" and .data.remedy != null)][0]' <<<"$BODY")
echo "# recommendation: $(jq -c '{id, step, message, data}' <<<"$RECO")"
check "its recommendation carries a remedy: master weights on, a problem that stops the run" \
    jq -e '.data.remedy == {patch: {precision: {master_weights: true}}, acts: true}' <<<"$RECO" >/dev/null
RS=$(jq -r .step <<<"$RECO")
req GET "/v1/jobs/$PL/layers"
check "GET /layers lists the recommendations with their remedies" \
    body_has --argjson e "$(jq .id <<<"$RECO")" '[.recommendations[] | select(.id == $e and
        .data.remedy.patch == {precision: {master_weights: true}})] | length == 1'
req GET "/v1/jobs/$PL/layers?step=$RS"
check "... and at the step where it was given ($RS)" \
    body_has --argjson s "$RS" '(.recommendations | length) > 0 and all(.recommendations[]; .step <= $s)'

branch "$PL" "{\"remedy\": $(jq -r .id <<<"$RECO")}"
BR=$ID
check "POST /branch {remedy: id} creates the branch ($CODE, job $BR) from the newest checkpoint before step $RS" \
    body_has --argjson s "$((RS - 5))" --argjson e "$(jq .id <<<"$RECO")" --arg m "$(jq -r .message <<<"$RECO")" \
        '.branch.step == $s and .branch.remedy == $e and .branch.reason == $m and
        .branch.patch == {precision: {master_weights: true}} and .spec.precision.master_weights'
check "... which succeeds" wait_for 120 is_status "$BR" succeeded
refused "a remedy that is not a recommendation's" "$PL" '{"remedy": 1}' 422 remedy
refused "a remedy with a patch" "$PL" '{"remedy": 1, "patch": {}}' 400 remedy

# ---- a running parent's retention keeps the checkpoint a waiting branch starts from --------
post_json /v1/jobs "$(jq -c '.name = "long" | .steps = 400 | .checkpoint_every = 50 |
    .model.layers = [784, 1024, 1024, 10] | .batch_size = 256 |
    .checkpoints = {keep_last: 1, keep_best: 0}' <<<"$SPEC")"
PR=$(jq -r .id <<<"$BODY")
check "a long parent (job $PR) reaches step 100" wait_for 120 past "$PR" 100
BW=""
for _ in 1 2 3 4 5; do # its newest checkpoint may be dropped before the request: the next then
    at=$(acurl -s -m 10 "$URL/v1/jobs/$PR/checkpoints" | jq -r '.checkpoints[-1].step // 0')
    branch "$PR" "{\"from_step\": $at, \"patch\": {\"steps\": $((at + 20))}}"
    [ "$CODE" = 201 ] && { BW=$ID; break; }
    echo "# branch from $at: $CODE $(jq -c .error <<<"$BODY" 2>/dev/null)"
done
check "a branch from its newest checkpoint (step $at, job $BW) waits while it runs" test -n "$BW"
check "the parent goes on past it and succeeds" wait_for 240 is_status "$PR" succeeded
check "... its retention kept the checkpoint the branch starts from" \
    test -f "$TMP/data/jobs/$PR/ckpt-$at.safetensors"
check "the branch then runs from it and succeeds" wait_for 240 is_status "$BW" succeeded
check "... from step $((at + 1))" test "$(rows "$BW" | head -1 | cut -d, -f1)" = "$((at + 1))"

# ---- what is refused ----------------------------------------------------------------------------
refused "a step without a checkpoint" "$P" '{"from_step": 50, "patch": {}}' 422 from_step
check "... listing the steps that have one" grep -q 'it has 40, 80, 120' <<<"$BODY"
refused "another model" "$P" '{"from_step": 40, "patch": {"model": {"layers": [784, 32, 10]}}}' 422 patch.model
refused "another world size" "$P" '{"from_step": 40, "patch": {"distributed": {"world_size": 2}}}' \
    422 patch.distributed.world_size
refused "a learning rate the spec refuses" "$P" '{"from_step": 40, "patch": {"optimizer": {"lr": -1}}}' \
    422 patch.optimizer.lr
refused "steps that end before the branch step" "$P" '{"from_step": 80, "patch": {"steps": 60}}' 422 patch.steps
refused "an unknown member" "$P" '{"from_step": 40, "patch": {}, "remedy_of": 1}' 400 remedy_of
refused "no patch" "$P" '{"from_step": 40}' 400 patch
branch 99999 '{"from_step": 40, "patch": {}}'
check "a job that does not exist: 404 ($CODE)" test "$CODE" = 404
req GET "/v1/jobs/$P"
check "the parent is unchanged: succeeded, no branch record, its two branches" \
    body_has --argjson b "$B" --argjson bb "$BB" '.status == "succeeded" and .branch == null
        and .branches == [$b, $bb]'
check "... and its rows too" test "$(rows "$P")" = "$(cat "$TMP/parent.csv")"

openapi_check_recorded
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
