#!/bin/bash
# check_run.sh - `ampd run` end to end, as a user drives it: a small synthetic job trains
# and prints start (naming its device), step, eval and summary lines; a bad spec is refused
# with the field named and exit status 2; a CUDA device that cannot be used (none on this
# machine, or no device 63) is accepted by the spec and fails the job when it starts, with
# the reason; SIGINT stops a run cleanly with status "interrupted" and exit status 130 (and
# SIGTERM while stdout's pipe is full loses no line); a
# job with diagnostics prints "layers" lines and recommendation events. The jobs whose
# checks are the CPU trainer's own (diagnosis of every overflowing step, bit-exact resume)
# ask for "device": "cpu", so that they test the same thing on a machine with a GPU.
# `--profile 2` prints step 2's phases, which add up to its time: forward, backward, unscale
# and optimizer on the CPU; on a GPU each layer's ops (attention, linears...) and the tail.
# Every `ampd run` here has its exit status checked (status_is: 0 succeeded, 1 failed,
# 2 refused, 130 interrupted), so that a run that prints all its lines, a "succeeded" summary
# included, and then dies of a signal (134: SIGABRT in its cleanup) fails a check.
set -u
AMPD=${AMPD:-./ampd}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"

job='{"name": "tiny", "model": {"layers": [20, 32, 4]},
      "data": {"type": "synthetic", "train_size": 512, "eval_size": 128},
      "precision": {"dtype": "fp16"}, "batch_size": 32, "steps": 40, "eval_every": 20,
      "threads": 1}'

echo "$job" | "$AMPD" run - >"$TMP/out" 2>"$TMP/err"
status_is "run" 0 $?
check "one start line" test "$(grep -c '"type":"start"' "$TMP/out")" -eq 1
check "one line per step" test "$(grep -c '"type":"step"' "$TMP/out")" -eq 40
check "eval at 20 and at the end" test "$(grep -c '"type":"eval"' "$TMP/out")" -eq 2
check "summary succeeded" grep -q '"type":"summary","name":"tiny","status":"succeeded"' "$TMP/out"
check "fp16 scale reported" grep -q '"loss_scale":65536' "$TMP/out"
check "memory by category" grep -q '"mem":{"weights":' "$TMP/out"
check "log says which backend" grep -Eq 'using the (CPU|CUDA) backend' "$TMP/err"
check "the start line names the device" \
    grep -Eq '"type":"start",.*"device":"(cpu|cuda:[0-9]+ \(.*\))"' "$TMP/out"

echo "$job" | "$AMPD" run --every 10 - >"$TMP/out"
status_is "--every 10" 0 $?
check "--every 10 prints 4 steps" test "$(grep -c '"type":"step"' "$TMP/out")" -eq 4

# per-layer diagnostics: a "layers" line every diagnostics_every steps that --every does not
# suppress, with the numbers of each layer
dj='{"name": "diag", "model": {"layers": [20, 32, 32, 4]},
     "data": {"type": "synthetic", "train_size": 512, "eval_size": 128},
     "precision": {"dtype": "fp16"}, "batch_size": 32, "steps": 40, "diagnostics_every": 10,
     "threads": 1, "device": "cpu"}'
echo "$dj" | "$AMPD" run --every 40 - >"$TMP/out" 2>/dev/null
status_is "diagnosed job" 0 $?
check "diagnosed job: one step line with --every 40" test "$(grep -c '"type":"step"' "$TMP/out")" -eq 1
check "diagnosed job: a layers line every 10 steps all the same" \
    test "$(grep -c '"type":"layers"' "$TMP/out")" -eq 4
check "layers line: step, scale, no inf/NaN, the layers by name" \
    grep -q '^{"type":"layers","step":10,"scale":65536.0,"first_nonfinite":null,"layers":\[{"name":"fc1","dtype":"fp16","act_amax":' "$TMP/out"
check "layers line: every field of a layer" \
    grep -q '{"name":"fc3","dtype":"fp16","act_amax":[0-9.e+-]*,"act_headroom":[0-9.e+-]*,"act_overflow":0,"grad_amax":[0-9.e+-]*,"grad_underflow":[0-9.e+-]*,"grad_underflow_unscaled":[0-9.e+-]*,"grad_nonfinite":0,"lost_updates":0.0}\]}$' "$TMP/out"

# fp16 activations beyond 65504 in fc2: every step overflows and is diagnosed, the advice
# names fc2 and bf16 once, and the failure at the scale's floor carries the diagnosis
ov='{"name": "ovf", "model": {"layers": [32, 32, 32, 4], "init_scale": 300},
     "data": {"type": "synthetic", "features": 32, "classes": 4, "train_size": 1024,
              "eval_size": 128},
     "precision": {"dtype": "fp16"}, "batch_size": 64, "steps": 200, "threads": 1,
     "device": "cpu"}'
echo "$ov" | "$AMPD" run --every 1000 - >"$TMP/out" 2>/dev/null
status_is "overflowing job fails at the floor" 1 $?
check "every overflowing step has a layers line" test "$(grep -c '"type":"layers"' "$TMP/out")" -eq 66
check "the first inf/NaN: fc2's forward pass" \
    grep -q '"type":"layers","step":1,"scale":65536.0,"first_nonfinite":{"layer":"fc2","where":"forward"}' "$TMP/out"
check "one recommendation for fc2: use bf16" \
    test "$(grep -c '"type":"event","step":1,"kind":"recommendation","layer":"fc2","message":"activations of fc2 exceed fp16.s 65504 (max [0-9.e+]*): use bf16"' "$TMP/out")" -eq 1
check "the scale floor recommendation" \
    grep -q '"type":"event","step":66,"kind":"recommendation","layer":null,"message":"loss scale stuck at its floor 1 for 50 steps' "$TMP/out"
check "the failure carries the diagnosis" \
    grep -q '"status":"failed".*"error":"loss scale stuck at its floor 1 for 50 overflowing steps in a row: fc2.s forward activations reach' "$TMP/out"

echo '{"optimizer": {"lr": -1}}' | "$AMPD" run - >"$TMP/out" 2>"$TMP/err"
status_is "bad spec" 2 $?
check "bad spec names the field" grep -q '"field":"optimizer.lr"' "$TMP/err"
check "bad spec prints no steps" test ! -s "$TMP/out"

echo '{"model": {"layers": [20, 4]}, "dataa": {}}' | "$AMPD" run - 2>"$TMP/err" >/dev/null
status_is "unknown field" 2 $?
check "unknown field refused" grep -q '"field":"dataa"' "$TMP/err"

"$AMPD" run "$TMP/missing.json" 2>"$TMP/err" >/dev/null
status_is "missing file" 2 $?

# CUDA devices pass the spec and fail at start when unusable: no device 63 anywhere (no
# driver, no device or a build without CUDA says so first); "cuda" itself fails the same
# way on a machine without a usable GPU and trains on one that has it
nocuda='no CUDA|built without CUDA|CUDA unavailable'
echo '{"model": {"layers": [20, 4]}, "data": {"type": "synthetic"}, "device": "cuda:63"}' |
    "$AMPD" run - >"$TMP/out" 2>"$TMP/err"
status_is "device cuda:63 fails" 1 $?
check "the failure says why" \
    grep -Eq '"status":"failed","dtype":"fp32","steps":0,"error":"device \\"cuda:63\\": ('"$nocuda"')' "$TMP/out"
check "the log says why" grep -Eq "$nocuda" "$TMP/err"
echo '{"model": {"layers": [20, 4]}, "data": {"type": "synthetic"}, "device": "cuda",
       "steps": 5}' | "$AMPD" run - >"$TMP/out" 2>"$TMP/err"
rc=$?
if "$AMPD" version | grep -q '^cuda: device available'; then
    status_is "device cuda trains on the GPU" 0 "$rc"
    check "its start line names it" grep -q '"device":"cuda:0 (' "$TMP/out"
else
    status_is "device cuda without a usable GPU fails" 1 "$rc"
    check "the failure names the missing CUDA" \
        grep -Eq '"status":"failed","dtype":"fp32","steps":0,"error":"device \\"cuda\\": ('"$nocuda"')' "$TMP/out"
    check "an error line names it" grep -Eq "$nocuda" "$TMP/err"
fi

long='{"model": {"layers": [64, 256, 256, 10]}, "data": {"type": "synthetic"},
       "steps": 100000, "threads": 1}'
mkdir -p "$TMP/sig"
echo "$long" | "$AMPD" run --checkpoint-dir "$TMP/sig" - >"$TMP/out" 2>/dev/null &
pid=$!
check "the long run trains (a step line within 30 s)" \
    wait_for 30 grep -q '"type":"step"' "$TMP/out"
kill -INT "$pid"
wait "$pid"
status_is "SIGINT" 130 $?
check "SIGINT summary says interrupted" grep -q '"status":"interrupted"' "$TMP/out"
check "SIGINT writes a checkpoint first" grep -q '"type":"checkpoint"' "$TMP/out"

# SIGTERM while nobody reads stdout and its pipe is full (the daemon leaves a worker's pipe
# unread while its store cannot write): the write it interrupts is resumed, not dropped, so
# every step up to the one the summary names has its line
mkfifo "$TMP/fifo"
echo "$long" | "$AMPD" run --checkpoint-dir "$TMP/sig" - >"$TMP/fifo" 2>/dev/null &
pid=$!
exec 7<"$TMP/fifo"
# 64 KiB of step lines: ~7 s under AddressSanitizer on the emulated GPU, minutes on a loaded
# machine: a bound of 120 s on a poll that ends once the write blocks
check "run blocks writing to a full pipe" wait_for 120 grep -q pipe_write "/proc/$pid/wchan"
kill -TERM "$pid"
term_landed() { # pid: SIGTERM no longer pending (its handler ran), the write blocked again
    local name mask
    while read -r name mask _; do
        case $name in SigPnd: | ShdPnd:) [ $((0x$mask & 0x4000)) -eq 0 ] || return 1 ;; esac
    done 2>/dev/null <"/proc/$1/status"
    grep -q pipe_write "/proc/$1/wchan" 2>/dev/null
}
check "... SIGTERM lands while the pipe is still full" wait_for 10 term_landed "$pid"
timeout 30 cat <&7 >"$TMP/out"
exec 7<&-
wait "$pid"
status_is "SIGTERM then" 130 $?
last=$(grep -o '"type":"summary",.*"steps":[0-9]*' "$TMP/out" | grep -o '[0-9]*$')
grep -o '^{"type":"step","step":[0-9]*' "$TMP/out" | grep -o '[0-9]*$' >"$TMP/steps"
check "... with a line for every step up to the summary's (${last:-none})" \
    sh -c "seq 1 ${last:-0} | cmp -s - '$TMP/steps' && [ -n '$last' ]"

# checkpoint and resume: steps 21..40 of a resumed run equal the uninterrupted run's
ck='{"name": "ck", "model": {"layers": [20, 32, 4]},
     "data": {"type": "synthetic", "train_size": 300, "eval_size": 64},
     "precision": {"dtype": "fp16", "loss_scale": {"init": 1024, "growth_interval": 7}},
     "batch_size": 32, "steps": 40, "checkpoint_every": 20, "threads": 1, "device": "cpu"}'
echo "$ck" >"$TMP/ck.json"
mkdir -p "$TMP/ck"
steps_of() { grep '"type":"step"' "$1" | sed 's/,"step_ms".*//'; }
"$AMPD" run "$TMP/ck.json" >"$TMP/full" 2>/dev/null
status_is "uninterrupted run" 0 $?
"$AMPD" run --checkpoint-dir "$TMP/ck" "$TMP/ck.json" >"$TMP/first" 2>/dev/null
status_is "run with checkpoints" 0 $?
check "checkpoint lines at 20 and 40" test "$(grep -c '"type":"checkpoint"' "$TMP/first")" -eq 2
check "checkpoint is a safetensors file" test -s "$TMP/ck/ckpt-20.safetensors"
"$AMPD" run --checkpoint-dir "$TMP/ck" --resume "$TMP/ck/ckpt-20.safetensors" "$TMP/ck.json" \
    >"$TMP/resumed" 2>/dev/null
status_is "resumed run" 0 $?
check "resume line" grep -q '"type":"resume","step":20' "$TMP/resumed"
check "resumed run prints steps 21..40" test "$(grep -c '"type":"step"' "$TMP/resumed")" -eq 20
steps_of "$TMP/full" | tail -n 20 >"$TMP/a"
steps_of "$TMP/resumed" >"$TMP/b"
check "resumed steps equal the uninterrupted run bit for bit" cmp -s "$TMP/a" "$TMP/b"
echo "$ck" | sed 's/\[20, 32, 4\]/[20, 16, 4]/' >"$TMP/other.json"
"$AMPD" run --resume "$TMP/ck/ckpt-20.safetensors" "$TMP/other.json" >"$TMP/out" 2>/dev/null
status_is "another job's checkpoint is refused" 1 $?
check "the refusal names the tensor" grep -q 'fc1.weight does not match' "$TMP/out"
printf 'garbage, not a safetensors file at all' >"$TMP/ck/bad.safetensors"
"$AMPD" run --resume "$TMP/ck/bad.safetensors" "$TMP/ck.json" >"$TMP/out" 2>/dev/null
status_is "--resume of a file that is not a checkpoint" 0 $?
check "a file that is not a checkpoint is skipped, saying so" \
    grep -q '"type":"resume","step":0,"path":null,"verified":false,"skipped":\[{"step":null,"path":"[^"]*bad.safetensors","reason":"not an ampd checkpoint' "$TMP/out"
check "... and, nothing older being there, the run starts from step 0" \
    test "$(grep -c '"type":"step"' "$TMP/out")" -eq 40

# ---- checkpoints: checksums, resuming past damaged ones ------------------------------------
# every 5 steps, all kept (checkpoints.keep_last 0): ckpt-5 .. ckpt-40
sed 's/"checkpoint_every": 20/"checkpoint_every": 5, "checkpoints": {"keep_last": 0}/' \
    "$TMP/ck.json" >"$TMP/ck5.json"
mkdir -p "$TMP/ck5"
"$AMPD" run --checkpoint-dir "$TMP/ck5" "$TMP/ck5.json" >/dev/null 2>&1
status_is "run with a checkpoint every 5 steps" 0 $?
ckpts() { ls "$1" | grep '^ckpt-[0-9]*\.safetensors$' | sed 's/ckpt-//; s/\..*//' | sort -n | tr '\n' ' '; }
check "checkpoints.keep_last 0 keeps every checkpoint" \
    test "$(ckpts "$TMP/ck5")" = '5 10 15 20 25 30 35 40 '
check "a checkpoint's metadata carries its crc32 (format 2)" \
    grep -aq '"__metadata__":{"format":"ampd-checkpoint-2","crc32":"[0-9a-f]\{8\}","step":"40"' \
    "$TMP/ck5/ckpt-40.safetensors"
cp -r "$TMP/ck5" "$TMP/ck5.orig"
# the newest truncated, the next with a byte of a tensor flipped, the third deleted
truncate -s -100 "$TMP/ck5/ckpt-40.safetensors"
flip_byte "$TMP/ck5/ckpt-35.safetensors" -100
rm "$TMP/ck5/ckpt-30.safetensors"
"$AMPD" run --checkpoint-dir "$TMP/ck5" --resume "$TMP/ck5" "$TMP/ck5.json" >"$TMP/walk" \
    2>"$TMP/walk.err"
status_is "--resume DIR past damaged checkpoints" 0 $?
check "... continuing from the newest that verifies, step 25" \
    grep -q '"type":"resume","step":25,"path":"[^"]*/ck5/ckpt-25.safetensors","verified":true,' "$TMP/walk"
check "... the truncated one skipped as truncated" \
    grep -q '"skipped":\[{"step":40,"path":"[^"]*ckpt-40.safetensors","reason":"truncated: 12[0-9]* of its 12[0-9]* bytes"},' "$TMP/walk"
check "... the flipped byte as a checksum mismatch" \
    grep -q ',{"step":35,"path":"[^"]*ckpt-35.safetensors","reason":"checksum mismatch: crc32 [0-9a-f]\{8\} in its header, [0-9a-f]\{8\} of its bytes"}\]}' "$TMP/walk"
check "... neither called another job's" sh -c "! grep -q 'does not match' '$TMP/walk'"
check "... the log says which it skipped, why, and which it used" \
    sh -c "grep -q 'skipped the checkpoint .*ckpt-40.safetensors: truncated' '$TMP/walk.err' &&
           grep -q 'skipped the checkpoint .*ckpt-35.safetensors: checksum mismatch' '$TMP/walk.err' &&
           grep -q 'resuming from .*ckpt-25.safetensors (step 25), checksum verified' '$TMP/walk.err'"
check "... and the damaged ones are dropped (those steps are trained again)" \
    sh -c "grep -q '\"type\":\"checkpoint_drop\",\"step\":35,.*\"reason\":\"checksum mismatch' '$TMP/walk' &&
           grep -q '\"type\":\"checkpoint_drop\",\"step\":40,.*\"reason\":\"truncated' '$TMP/walk'"
steps_of "$TMP/full" | tail -n 15 >"$TMP/a"
steps_of "$TMP/walk" >"$TMP/b"
check "the steps after the resume (26..40) equal the uninterrupted run's bit for bit" \
    sh -c "test \$(wc -l <'$TMP/b') -eq 15 && cmp -s '$TMP/a' '$TMP/b'"
check "the rerun wrote 30, 35 and 40 again" test "$(ckpts "$TMP/ck5")" = '5 10 15 20 25 30 35 40 '
"$AMPD" run --resume "$TMP/ck5/ckpt-40.safetensors" "$TMP/ck5.json" >"$TMP/out" 2>/dev/null
status_is "--resume of the new ckpt-40" 0 $?
check "... whole: a resume from the new ckpt-40 verifies it" \
    grep -q '"type":"resume","step":40,"path":"[^"]*ckpt-40.safetensors","verified":true,"skipped":\[\]}' "$TMP/out"

# --resume FILE: that file (here missing), then the older ones; a header changed by one digit
# fails the checksum too
cp -r "$TMP/ck5.orig" "$TMP/ck6"
rm "$TMP/ck6/ckpt-30.safetensors"
perl -0777 -pi -e 's/"step":"25"/"step":"26"/' "$TMP/ck6/ckpt-25.safetensors"
"$AMPD" run --resume "$TMP/ck6/ckpt-30.safetensors" "$TMP/ck5.json" >"$TMP/out" 2>/dev/null
status_is "--resume FILE past a missing and a changed checkpoint" 0 $?
check "--resume FILE: a missing file is skipped as missing, a changed header as a checksum mismatch" \
    grep -q '"type":"resume","step":20,"path":"[^"]*ckpt-20.safetensors","verified":true,"skipped":\[{"step":30,"path":"[^"]*ckpt-30.safetensors","reason":"missing"},{"step":25,"path":"[^"]*ckpt-25.safetensors","reason":"checksum mismatch' "$TMP/out"
check "... without --checkpoint-dir nothing in that directory is dropped" \
    sh -c "! grep -q checkpoint_drop '$TMP/out' && test -f '$TMP/ck6/ckpt-35.safetensors'"

# none verifies: from step 0, as the uninterrupted run
mkdir -p "$TMP/ck7"
cp "$TMP/ck5.orig/ckpt-5.safetensors" "$TMP/ck7/"
flip_byte "$TMP/ck7/ckpt-5.safetensors" -1
"$AMPD" run --checkpoint-dir "$TMP/ck7" --resume "$TMP/ck7" "$TMP/ck5.json" >"$TMP/out" \
    2>"$TMP/err"
status_is "--resume DIR where no checkpoint verifies" 0 $?
check "no checkpoint verifies: the run starts from step 0" \
    grep -q '"type":"resume","step":0,"path":null,"verified":false,"skipped":\[{"step":5,' "$TMP/out"
check "... saying so in the log" grep -q 'no checkpoint verifies (1 skipped): training from step 0' "$TMP/err"
steps_of "$TMP/full" >"$TMP/a"
steps_of "$TMP/out" >"$TMP/b"
check "... and trains every step as the uninterrupted run" cmp -s "$TMP/a" "$TMP/b"

# a format 1 checkpoint (written before checksums: no crc32) still loads, unverified
cp "$TMP/ck5.orig/ckpt-20.safetensors" "$TMP/old.safetensors"
perl -0777 -pi -e 's/"format":"ampd-checkpoint-2","crc32":"[0-9a-f]{8}",/"format":"ampd-checkpoint-1",                   /' \
    "$TMP/old.safetensors"
"$AMPD" run --resume "$TMP/old.safetensors" "$TMP/ck5.json" >"$TMP/out" 2>"$TMP/err"
status_is "--resume of a format 1 checkpoint" 0 $?
check "a format 1 checkpoint loads (no checksum to verify)" \
    grep -q '"type":"resume","step":20,"path":"[^"]*old.safetensors","verified":false,"skipped":\[\]}' "$TMP/out"
check "... the log says it was not verified" \
    grep -q 'resuming from .*old.safetensors (step 20): format 1, written before checksums, not verified' "$TMP/err"
steps_of "$TMP/full" | tail -n 20 >"$TMP/a"
steps_of "$TMP/out" >"$TMP/b"
check "... and continues bit for bit" cmp -s "$TMP/a" "$TMP/b"
truncate -s -4 "$TMP/old.safetensors"
"$AMPD" run --resume "$TMP/old.safetensors" "$TMP/ck5.json" >"$TMP/out" 2>/dev/null
status_is "--resume of a truncated format 1 checkpoint (from step 0)" 0 $?
check "... a truncated format 1 file is named truncated, not another job's" \
    grep -q '"reason":"truncated: [0-9]* of its [0-9]* bytes"' "$TMP/out"

# ---- retention ---------------------------------------------------------------------------
# fp32 SGD at lr 20 diverges: the eval loss is lowest at step 5, the loss goes NaN near step
# 30. checkpoint_every 1 keeps the last 3 (NaN weights), the best eval loss and the last
# healthy checkpoint (finite weights, optimizer state and loss); the rest are deleted.
nj='{"name": "nan", "model": {"layers": [20, 32, 4]},
     "data": {"type": "synthetic", "train_size": 256, "eval_size": 64},
     "optimizer": {"type": "sgd", "lr": 20}, "batch_size": 32, "steps": 60, "eval_every": 5,
     "checkpoint_every": 1, "threads": 1, "device": "cpu"}'
mkdir -p "$TMP/nan"
echo "$nj" | "$AMPD" run --checkpoint-dir "$TMP/nan" - >"$TMP/out" 2>/dev/null
status_is "the diverging job (fp32: a NaN loss does not fail it)" 0 $?
best=$(grep '"type":"eval"' "$TMP/out" | grep '"eval_loss":[0-9]' |
    sed 's/.*"step":\([0-9]*\),"eval_loss":\([0-9.e+-]*\).*/\2 \1/' | sort -g | head -1 | cut -d' ' -f2)
healthy=$(grep '"type":"checkpoint",.*"healthy":true' "$TMP/out" | tail -1 |
    sed 's/.*"step":\([0-9]*\),.*/\1/')
check "the job's loss went NaN" grep -q '"type":"step","step":60,"loss":"NaN"' "$TMP/out"
check "its last healthy checkpoint (step ${healthy:-none}) is before the last 3, the best eval (step ${best:-none}) before that" \
    test "${healthy:-99}" -lt 58 -a "${best:-99}" -lt "${healthy:-0}"
check "... every checkpoint after it is marked unhealthy" \
    test "$(grep -c '"type":"checkpoint",.*"healthy":true' "$TMP/out")" -eq "${healthy:-0}"
check "the last 3, the best and the last healthy are kept, nothing else" \
    test "$(ckpts "$TMP/nan")" = "$best $healthy 58 59 60 "
check "... each other one dropped by the retention" \
    test "$(grep -c '"type":"checkpoint_drop","step":[0-9]*,"path":"[^"]*","reason":"retention","deleted":true' "$TMP/out")" -eq 55
"$AMPD" run --resume "$TMP/nan/ckpt-$healthy.safetensors" - <<<"$nj" >"$TMP/out2" 2>/dev/null
status_is "the diverging job resumed from its last healthy checkpoint" 0 $?
check "the last healthy checkpoint resumes and its next step equals the original's" \
    test "$(grep "\"type\":\"step\",\"step\":$((healthy + 1))," "$TMP/out2" | sed 's/,"step_ms".*//')" = \
    "$(grep "\"type\":\"step\",\"step\":$((healthy + 1))," "$TMP/out" | sed 's/,"step_ms".*//')"
mkdir -p "$TMP/nan2"
keep='"checkpoints": {"keep_last": 2, "keep_best": 0},'
echo "$nj" | sed "s/\"checkpoint_every\": 1,/\"checkpoint_every\": 1, $keep/" |
    "$AMPD" run --checkpoint-dir "$TMP/nan2" - >/dev/null 2>&1
status_is "the diverging job with keep_last 2, keep_best 0" 0 $?
check "checkpoints.keep_last 2, checkpoints.keep_best 0: the last 2 and the last healthy" \
    test "$(ckpts "$TMP/nan2")" = "$healthy 59 60 "

# a GPT on text: the loss falls, and a resumed run continues it bit for bit (the seed 1 run's
# output, $TMP/gfull, is the uninterrupted run below)
mkdir -p "$TMP/text" "$TMP/gck"
for i in $(seq 1 400); do echo "the quick brown fox jumps over the lazy dog $((i % 7))"; done \
    >"$TMP/text/fox.txt"
gpt='{"name": "gpt", "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32,
      "seq_len": 32, "vocab": 256}, "data": {"type": "text", "train": "fox.txt"},
      "precision": {"dtype": "fp16"}, "batch_size": 8, "steps": 80, "checkpoint_every": 40,
      "threads": 1, "device": "cpu"}'
echo "$gpt" >"$TMP/gpt.json"
# It learns beyond the unigram level (the start line's entropy of the text's bytes, 3.13
# nats), seed after seed: when a small GPT leaves that plateau depends on the seed, and on
# this repetitive text seeds 1-8 all reach 2.45-2.55 by step 80 (fp16), so one seed that
# stayed would be a fault, not bad luck.
for seed in 3 2 1; do
    sed "s/\"threads\": 1,/\"threads\": 1, \"seed\": $seed,/" "$TMP/gpt.json" |
        "$AMPD" run --data-root "$TMP/text" - >"$TMP/gfull" 2>/dev/null
    status_is "gpt run, seed $seed" 0 $?
    first=$(grep '"type":"step","step":1,' "$TMP/gfull" | sed 's/.*"loss":\([0-9.]*\).*/\1/')
    last=$(grep '"type":"step","step":80,' "$TMP/gfull" | sed 's/.*"loss":\([0-9.]*\).*/\1/')
    h=$(grep -o '"unigram_entropy":[0-9.]*' "$TMP/gfull" | cut -d: -f2)
    check "gpt loss falls below the unigram level, seed $seed ($first -> $last; unigram entropy $h)" \
        awk -v a="$first" -v b="$last" -v h="$h" 'BEGIN {exit !(b < a / 2 && b < 0.9 * h)}'
done
check "gpt step lines carry tokens/s" grep -q '"tokens_per_s":' "$TMP/gfull"
"$AMPD" run --data-root "$TMP/text" --checkpoint-dir "$TMP/gck" "$TMP/gpt.json" >/dev/null 2>&1
status_is "gpt run with checkpoints" 0 $?
"$AMPD" run --data-root "$TMP/text" --checkpoint-dir "$TMP/gck" \
    --resume "$TMP/gck/ckpt-40.safetensors" "$TMP/gpt.json" >"$TMP/gres" 2>/dev/null
status_is "gpt resumed run" 0 $?
steps_of "$TMP/gfull" | tail -n 40 >"$TMP/a"
steps_of "$TMP/gres" >"$TMP/b"
check "gpt resumed steps equal the uninterrupted run" cmp -s "$TMP/a" "$TMP/b"
# data.skip_batches on a GPT: with weights that do not move (lr 1e-30) a step's loss is its
# batch's, and a run that skips 13 batches has at step s the plain run's loss at s + 13
still='{"name": "still", "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32,
      "seq_len": 32, "vocab": 256}, "data": {"type": "text", "train": "fox.txt"SKIP},
      "batch_size": 8, "steps": 30, "optimizer": {"lr": 1e-30}, "threads": 1, "device": "cpu"}'
losses_of() { grep '"type":"step"' "$1" | sed 's/.*"step":\([0-9]*\),.*"loss":\([^,]*\),.*/\1 \2/'; }
echo "${still/SKIP/}" | "$AMPD" run --data-root "$TMP/text" - >"$TMP/gstill" 2>/dev/null
echo "${still/SKIP/, \"skip_batches\": 13}" | "$AMPD" run --data-root "$TMP/text" - >"$TMP/gskip" 2>/dev/null
losses_of "$TMP/gstill" | awk '$1 > 13 {print $2}' >"$TMP/a"
losses_of "$TMP/gskip" | awk '$1 <= 17 {print $2}' >"$TMP/b"
check "a gpt run with data.skip_batches 13 trains at step s on step s + 13's batch" \
    test "$(wc -l <"$TMP/a")" = 17 -a "$(md5sum <"$TMP/a")" = "$(md5sum <"$TMP/b")"

# the same GPT with flash attention: it trains as the materialised one does, in less memory
sed 's/"vocab": 256}/"vocab": 256, "attention": "flash"}/' "$TMP/gpt.json" >"$TMP/gflash.json"
"$AMPD" run --data-root "$TMP/text" "$TMP/gflash.json" >"$TMP/gfl" 2>/dev/null
status_is "a flash-attention gpt run" 0 $?
lastf=$(grep '"type":"step","step":80,' "$TMP/gfl" | sed 's/.*"loss":\([0-9.]*\).*/\1/')
check "its loss ends within 1% of the materialised run's ($lastf vs $last)" \
    awk -v a="$last" -v b="$lastf" 'BEGIN {d = a - b; exit !(b > 0 && d * d < 1e-4 * a * a)}'
acts() { grep '"type":"summary"' "$1" | sed 's/.*"activations":\([0-9]*\).*/\1/'; }
check "its activations take less memory ($(acts "$TMP/gfl") vs $(acts "$TMP/gfull") bytes)" \
    test "$(acts "$TMP/gfl")" -lt "$(acts "$TMP/gfull")"

# --profile: one step's time phase by phase, on whichever device "auto" picks
pj='{"name": "prof", "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32,
     "seq_len": 32, "vocab": 256, "attention": "flash"}, "data": {"type": "text", "train": "fox.txt"},
     "precision": {"dtype": "bf16"}, "batch_size": 4, "steps": 3, "eval_every": 0, "threads": 1}'
echo "$pj" | "$AMPD" run --profile 2 --data-root "$TMP/text" - >"$TMP/prof" 2>/dev/null
status_is "--profile 2" 0 $?
check "--profile 2 prints one profile line, after step 2" \
    test "$(grep -A1 '"type":"step","step":2,' "$TMP/prof" | grep -c '"type":"profile","step":2,')" -eq 1
line=$(grep '"type":"profile"' "$TMP/prof")
sms=$(sed 's/.*"step_ms":\([0-9.e+-]*\).*/\1/' <<<"$line")
pms=$(sed 's/.*"phases_ms":\([0-9.e+-]*\).*/\1/' <<<"$line")
check "its phases account for the step ($pms of $sms ms)" \
    awk -v s="$sms" -v p="$pms" 'BEGIN {exit !(p > 0 && p >= 0.5 * s && p <= 1.001 * s + 0.01)}'
phases() { # name calls [name calls]...: the profile line has each phase with that many calls
    while [ $# -gt 1 ]; do
        grep -Eq "\\{\"name\":\"$1\",\"ms\":[0-9.e+-]+,\"calls\":$2\\}" <<<"$line" || return 1
        shift 2
    done
}
if grep -q '"device":"cuda' <<<"$line"; then
    check "... on the GPU: each layer's attention, forward and backward" \
        phases attention.fwd 2 attention.bwd 2
    check "... the linears (4 per layer), the head and the optimizer" \
        phases linear.fwd 8 linear.bwd 8 head.fwd 1 optimizer 1
else
    check "... on the CPU: forward, backward, unscale, optimizer, in order" \
        grep -Eq '"phases":\[\{"name":"forward",.*"calls":1\},\{"name":"backward",.*\{"name":"unscale",.*\{"name":"optimizer",' <<<"$line"
fi
echo "$pj" | "$AMPD" run --profile 0 - >/dev/null 2>"$TMP/err"
status_is "--profile 0 is refused" 2 $?
check "... saying what it needs" grep -q -- "--profile needs a step number >= 1, not '0'" "$TMP/err"

echo "$pass passed, $fail failed"
test "$fail" -eq 0
