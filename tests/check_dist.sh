#!/bin/bash
# check_dist.sh - data-parallel `ampd run` end to end, on Open MPI with CPU ranks (and CUDA
# ranks on the emulator):
#   - world 2 and world 4 (oversubscribed) train on the same global batches as world 1: the
#     loss of every one of 50 steps within 1e-5 (relative) of world 1's, and every rank ends
#     with the same state (the hash each rank logs); a rank's activations are planned for its
#     share of the batch (world 1's / N);
#   - the fp16 and bf16 comm hooks hand exactly half of the none hook's bytes to the
#     all-reduce, and train a Fashion-MNIST MLP for 1000 steps to within 0.5 points of its
#     accuracy;
#   - an all-reduce that the fp16 hook overflows (a bf16 job at loss scale 2^24): the step is
#     skipped on every rank, the scalers stay equal, and the diagnostics say where = "comm"
#     with the tensors, and recommend a hook;
#   - kill -9 of rank 1: the job ends within 10 s with exit status 1 and the log names rank 1
#     and the signal;
#   - SIGINT stops every rank after the same step with a checkpoint; the resumed run's steps
#     equal an uninterrupted run's; a resume with another world size is refused;
#   - grad_accum_steps 4 with batch 64 equals batch 256 (world 1 and world 2);
#   - fp8 at world 2: both ranks end with the same state, the fp8 scaling state included
#     (its amaxes are reduced across the ranks);
#   - CUDA ranks on the emulator (tests/ampd_emu, NCCL's stand-in over MPI), world 2: an
#     fp16 job with the fp16 hook follows the CPU ranks (loss within 1e-3, the same bytes,
#     scales and skips), and so does a GPT in small buckets, and an fp8 GPT (its staged
#     amaxes MAX-reduced: both ranks end with one state); fp32 with hook none follows
#     world 1 on the CPU within 1e-5, the
#     compressed overflow is skipped alike and diagnosed as "comm"; two ranks and one
#     device fail naming the rank, and "auto" then puts both on the CPU;
#   - under `ampd serve`: kill -9 of rank 1 fails the job within 10 s naming the rank, the
#     next queued job runs, /healthz answers throughout; a job of 2 ranks cancelled and
#     resumed stores the steps of an uninterrupted run;
#   - the spec refuses a batch that does not split over the ranks, and a bad host name.
# The equality checks train with SGD: Adam's first updates are the sign of each gradient,
# so a gradient that is 0 up to rounding makes summation order (one GEMM over the batch, or
# two halves and a sum) visible in the loss after a few steps; SGD keeps such differences
# as small as they are. Exit 77 (SKIP) without MPI in the build or without Fashion-MNIST.
set -u
AMPD=${AMPD:-./ampd}
AMPD_EMU=${AMPD_EMU:-tests/ampd_emu} # ampd on the CUDA emulator
sup=""
cleanup_more() { # before test_tmp's cleanup
    [ -n "$sup" ] && kill -9 "$sup" 2>/dev/null
    return 0
}
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp
# Open MPI's allocations that live until exit are not ours (an --enable-asan build)
LSAN_OPTIONS="suppressions=$(cd "$(dirname "$0")" && pwd)/lsan.supp:fast_unwind_on_malloc=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export LSAN_OPTIONS

FM=/usr/share/datasets/fashion-mnist
if [ ! -d "$FM" ]; then
    echo "check_dist: SKIP: Fashion-MNIST is not installed (Debian dataset-fashion-mnist)"
    exit 77
fi
if ! command -v node >/dev/null; then
    echo "check_dist: SKIP: node is needed to read the JSON lines"
    exit 77
fi

# spec WORLD HOOK STEPS [extra top-level JSON members]
spec() {
    echo "{\"name\": \"dp\", \"model\": {\"type\": \"mlp\", \"layers\": [784, 256, 10]},
      \"data\": {\"type\": \"idx\", \"train\": \"fashion-mnist\", \"eval\": \"fashion-mnist:test\"},
      \"precision\": {\"dtype\": \"fp32\"}, \"batch_size\": 256, \"steps\": $3, \"seed\": 1,
      \"optimizer\": {\"type\": \"sgd\", \"lr\": 0.02, \"momentum\": 0.9},
      \"distributed\": {\"world_size\": $1, \"comm_hook\": \"$2\"}${4:+, $4}}"
}

spec 2 none 1 | "$AMPD" run - >/dev/null 2>"$TMP/mpi.err"
rc=$?
if grep -q 'built without MPI' "$TMP/mpi.err"; then
    status_is "a job of 2 ranks without MPI is refused" 2 "$rc"
    [ "$fail" -eq 0 ] || { echo "$pass passed, $fail failed"; exit 1; }
    echo "check_dist: SKIP: this ampd was built without MPI"
    exit 77
fi
status_is "world 2, 1 step (is MPI there)" 0 "$rc"

# js FILE EXPR: EXPR evaluated with `steps` (the step lines by step number), `lines` (all of
# them) and the helpers below; prints its value
js() {
    node -e '
const fs = require("fs");
const lines = fs.readFileSync(process.argv[1], "utf8").split("\n").filter(Boolean).map(JSON.parse);
const steps = {};
for (const l of lines) if (l.type === "step") steps[l.step] = l;
const rel = (a, b) => Math.abs(a - b) / Math.abs(b);
const maxrel = (o, k) => Math.max(...Object.keys(o).map(s => rel(steps[s][k], o[s][k])));
const load = f => { const o = {}; for (const l of fs.readFileSync(f, "utf8").split("\n").filter(Boolean).map(JSON.parse)) if (l.type === "step") o[l.step] = l; return o; };
const v = eval(process.argv[2]);
if (process.argv[3] === "test") process.exit(v ? 0 : 1);
console.log(v);' "$1" "$2" "${3:-print}"
}
# jsok FILE EXPR: whether EXPR is true (silent)
jsok() { js "$1" "$2" test; }

# ---- the same losses as world 1 ----------------------------------------------------------
for w in 1 2 4; do
    spec $w none 50 | "$AMPD" run - >"$TMP/w$w.out" 2>"$TMP/w$w.err"
    status_is "world $w" 0 $?
done
for w in 2 4; do
    check "world $w: 50 step lines" test "$(grep -c '"type":"step"' "$TMP/w$w.out")" -eq 50
    m=$(js "$TMP/w$w.out" "maxrel(load('$TMP/w1.out'), 'loss')")
    echo "world $w: largest relative loss difference from world 1 over 50 steps: $m"
    check "world $w: every step's loss within 1e-5 of world 1's" jsok "$TMP/w$w.out" "$m <= 1e-5"
    check "world $w: every rank logs the same final state" \
        test "$(grep -o 'stopped at step 50: .*' "$TMP/w$w.err" | sort -u | wc -l)" -eq 1
    check "world $w: all $w ranks logged it" \
        test "$(grep -c 'stopped at step 50' "$TMP/w$w.err")" -eq $w
    check "world $w: log lines carry the rank" grep -q "rank $((w - 1)) " "$TMP/w$w.err"
    a1=$(js "$TMP/w1.out" 'steps[1].mem.activations')
    check "world $w: each rank plans activations for its share of the batch ($a1 / $w bytes)" \
        jsok "$TMP/w$w.out" "$w * steps[1].mem.activations === $a1"
done
check "world 1: no communication" test "$(js "$TMP/w1.out" 'steps[10].comm_bytes')" -eq 0
check "world 2: fp32 bytes: 4 per parameter" \
    test "$(js "$TMP/w2.out" 'steps[10].comm_bytes')" -eq $((4 * (784 * 256 + 256 + 256 * 10 + 10)))
check "world 2: comm time, exposed part, slowest rank" \
    jsok "$TMP/w2.out" 'steps[10].comm_ms > 0 && steps[10].comm_exposed_ms >= 0 &&
        steps[10].comm_exposed_ms <= steps[10].comm_ms && steps[10].step_ms_max >= steps[10].step_ms &&
        [0, 1].includes(steps[10].slowest_rank)'

# ---- fp8: the amaxes reduced across the ranks ----------------------------------------------
# The state hash covers the fp8 scaling state, whose input and gradient amaxes come from each
# rank's half of the batch: equal on both ranks only when they are reduced (MAX) every step.
spec 2 none 8 | sed 's/"dtype": "fp32"/"dtype": "fp8"/' | "$AMPD" run - >"$TMP/f8.out" 2>"$TMP/f8.err"
status_is "fp8, world 2" 0 $?
check "fp8, world 2: both ranks end with the same state, fp8 scaling included" \
    test "$(grep -c 'stopped at step 8' "$TMP/f8.err")" -eq 2 -a \
    "$(grep -o 'stopped at step 8: .*' "$TMP/f8.err" | sort -u | wc -l)" -eq 1

# ---- hooks: bytes and accuracy -----------------------------------------------------------
adam='"optimizer": {"type": "adamw", "lr": 0.001}'
for h in none fp16 bf16; do
    spec 2 $h 1000 | sed "s/\"optimizer\": {[^}]*}/$adam/" | "$AMPD" run --every 100 - \
        >"$TMP/h$h.out" 2>/dev/null
    status_is "hook $h" 0 $?
done
nb=$(js "$TMP/hnone.out" 'steps[100].comm_bytes')
for h in fp16 bf16; do
    check "hook $h: comm_bytes exactly half of none's ($nb)" \
        jsok "$TMP/h$h.out" "Object.values(steps).every(s => 2 * s.comm_bytes === $nb)"
    acc=$(js "$TMP/h$h.out" 'lines.find(l => l.type === "summary").eval_acc')
    ref=$(js "$TMP/hnone.out" 'lines.find(l => l.type === "summary").eval_acc')
    echo "hook $h: accuracy after 1000 steps $acc (none: $ref)"
    check "hook $h: accuracy within 0.5 points of none's" \
        jsok "$TMP/h$h.out" "Math.abs($acc - $ref) <= 0.005"
done

# ---- an overflow of the compressed all-reduce --------------------------------------------
spec 2 fp16 4 '"diagnostics_every": 0' |
    sed 's/"precision": {[^}]*}/"precision": {"dtype": "bf16", "loss_scale": {"mode": "dynamic", "init": 16777216}}/' |
    "$AMPD" run - >"$TMP/ov.out" 2>"$TMP/ov.err"
status_is "comm overflow" 0 $?
check "comm overflow: step 1 skipped" jsok "$TMP/ov.out" 'steps[1].skipped'
check "comm overflow: where is comm, with the tensors" \
    jsok "$TMP/ov.out" 'lines.some(l => l.type === "layers" && l.step === 1 &&
        l.first_nonfinite.where === "comm" && l.first_nonfinite.tensors.includes("fc2.bias"))'
check "comm overflow: a recommendation names the hook" \
    grep -q '"kind":"recommendation".*all-reduce overflowed.*use comm_hook' "$TMP/ov.out"
check "comm overflow: both ranks skipped the same steps with the same scale and state" \
    test "$(grep -o 'stopped at step 4: .*' "$TMP/ov.err" | sort -u | wc -l)" -eq 1
check "comm overflow: ... and they did skip" grep -q 'stopped at step 4: .* skipped [1-9]' "$TMP/ov.err"

# ---- kill -9 of rank 1 ---------------------------------------------------------------------
spec 2 none 100000 >"$TMP/long.json"
"$AMPD" run "$TMP/long.json" >"$TMP/k.out" 2>"$TMP/k.err" &
sup=$!
rank1=
for _ in $(seq 100); do
    for p in $(pgrep -f "run $TMP/long.json"); do
        tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1' && rank1=$p
    done
    [ -n "$rank1" ] && grep -q '"type":"step","step":3,' "$TMP/k.out" && break
    sleep 0.1
done
check "kill -9: found rank 1" test -n "$rank1"
kill -9 "$rank1" 2>/dev/null
t0=$(date +%s%N)
wait $sup
rc=$?
t1=$(date +%s%N)
sup=""
echo "kill -9 of rank 1: the job ended after $(((t1 - t0) / 1000000)) ms"
status_is "kill -9" 1 "$rc"
check "kill -9: ended within 10 s" test $(((t1 - t0) / 1000000)) -lt 10000
check "kill -9: the log names rank 1 and the signal" grep -q 'rank 1 .*signal 9' "$TMP/k.err"
check "kill -9: no rank is left" test -z "$(pgrep -f "run $TMP/long.json")"

# ---- stop, checkpoint, resume --------------------------------------------------------------
spec 2 none 120 >"$TMP/r.json"
"$AMPD" run "$TMP/r.json" >"$TMP/full.out" 2>/dev/null
status_is "uninterrupted run" 0 $?
mkdir "$TMP/ck"
"$AMPD" run --checkpoint-dir "$TMP/ck" "$TMP/r.json" >"$TMP/part.out" 2>"$TMP/part.err" &
sup=$!
for _ in $(seq 200); do
    grep -q '"type":"step","step":20,' "$TMP/part.out" && break
    sleep 0.05
done
kill -INT $sup
wait $sup
status_is "SIGINT" 130 $?
sup=""
check "SIGINT: interrupted" grep -q '"status":"interrupted"' "$TMP/part.out"
ck=$(ls "$TMP"/ck/ckpt-*.safetensors 2>/dev/null | head -1)
check "SIGINT: rank 0 wrote a checkpoint" test -n "$ck"
check "SIGINT: both ranks stopped after the same step" \
    test "$(grep -o 'stopped at step [0-9]*' "$TMP/part.err" | sort -u | wc -l)" -eq 1
"$AMPD" run --resume "$ck" "$TMP/r.json" >"$TMP/res.out" 2>/dev/null
status_is "resume" 0 $?
check "resume: every step after the checkpoint equals the uninterrupted run's" \
    jsok "$TMP/res.out" "Object.keys(steps).length > 0 && Object.keys(steps).every(s =>
        steps[s].loss === load('$TMP/full.out')[s].loss &&
        steps[s].grad_norm === load('$TMP/full.out')[s].grad_norm)"
sed 's/"world_size": 2/"world_size": 4/' "$TMP/r.json" >"$TMP/r4.json"
"$AMPD" run --resume "$ck" "$TMP/r4.json" >/dev/null 2>"$TMP/r4.err"
status_is "resume with 4 ranks: refused" 1 $?
check "resume with 4 ranks: the message names the world size" \
    grep -q 'written by a job of 2 rank(s) and this one has 4 (distributed.world_size)' "$TMP/r4.err"

# ---- gradient accumulation -------------------------------------------------------------------
spec 1 none 30 >"$TMP/b256.json"
"$AMPD" run "$TMP/b256.json" >"$TMP/b256.out" 2>/dev/null
status_is "batch 256" 0 $?
for w in 1 2; do
    spec $w none 30 '"grad_accum_steps": 4' | sed 's/"batch_size": 256/"batch_size": 64/' |
        "$AMPD" run - >"$TMP/acc$w.out" 2>/dev/null
    status_is "accumulation, world $w" 0 $?
    m=$(js "$TMP/acc$w.out" "maxrel(load('$TMP/b256.out'), 'loss')")
    echo "grad_accum_steps 4 x batch 64, world $w: largest relative loss difference from batch 256: $m"
    check "accumulation, world $w: 4 x 64 equals 256 within 1e-5" jsok "$TMP/acc$w.out" "$m <= 1e-5"
done

# ---- CUDA ranks on the emulator: NCCL's stand-in over MPI ------------------------------------
# tests/ampd_emu's devices are emulated, two of them so that each rank has its own, and its
# NCCL is tests/cudaemu/nccl.cc: the bootstrap, the hooks' kernels, the buckets' order and
# the device step between backward and the unscale all run as on GPUs.
f16='s/"precision": {[^}]*}/"precision": {"dtype": "fp16"}/'
spec 2 fp16 20 '"device": "cpu"' | sed "$f16" | "$AMPD" run - >"$TMP/c16.out" 2>/dev/null
status_is "CPU ranks, fp16 hook" 0 $?
spec 2 fp16 20 '"device": "cuda"' | sed "$f16" |
    AMPD_CUDAEMU_DEVICES=2 "$AMPD_EMU" run - >"$TMP/g16.out" 2>"$TMP/g16.err"
status_is "CUDA ranks, fp16 hook" 0 $?
check "CUDA ranks: rank 0 trains on the emulated device" \
    grep -q '"type":"start",.*"device":"cuda:0 (ampd CUDA emulator' "$TMP/g16.out"
m=$(js "$TMP/g16.out" "maxrel(load('$TMP/c16.out'), 'loss')")
echo "CUDA ranks (emulated), world 2, fp16 job, fp16 hook: largest relative loss difference from the CPU ranks over 20 steps: $m"
check "CUDA ranks, fp16 hook: 20 steps, each loss within 1e-3 of the CPU ranks'" \
    jsok "$TMP/g16.out" "Object.keys(steps).length === 20 && $m <= 1e-3"
check "CUDA ranks, fp16 hook: the CPU's bytes, 2 per parameter, every step" \
    jsok "$TMP/g16.out" "Object.keys(steps).every(s => steps[s].comm_bytes ===
        load('$TMP/c16.out')[s].comm_bytes && steps[s].comm_bytes === $((2 * 203530)))"
check "CUDA ranks, fp16 hook: the CPU's scales and skips" \
    jsok "$TMP/g16.out" "Object.keys(steps).every(s => steps[s].loss_scale ===
        load('$TMP/c16.out')[s].loss_scale && steps[s].skipped === load('$TMP/c16.out')[s].skipped)"
check "CUDA ranks: both ranks end in the same state" \
    test "$(grep -o 'stopped at step 20: .*' "$TMP/g16.err" | sort -u | wc -l)" -eq 1
spec 2 none 20 '"device": "cuda"' | AMPD_CUDAEMU_DEVICES=2 "$AMPD_EMU" run - >"$TMP/g2.out" 2>/dev/null
status_is "CUDA ranks, hook none" 0 $?
m=$(js "$TMP/g2.out" "Math.max(...Object.keys(steps).map(s => rel(steps[s].loss, load('$TMP/w1.out')[s].loss)))")
echo "CUDA ranks (emulated), world 2, fp32, hook none: largest relative loss difference from world 1 on the CPU: $m"
check "CUDA ranks, hook none: each loss within 1e-5 of world 1 on the CPU" \
    jsok "$TMP/g2.out" "Object.keys(steps).length === 20 && $m <= 1e-5"
# the GPT's backward reports its gradients to the buckets (64 KiB: many) as the MLP's does;
# the emulator reduces a bucket the moment it is reported, so a gradient reported before its
# last kernel would differ from the CPU ranks'
mkdir -p "$TMP/text"
for i in $(seq 2000); do echo "line $i: the $((i % 7)) quick brown foxes jump over $((i * 13 % 97)) dogs"; done \
    >"$TMP/text/fox.txt"
gpt='{"name": "gpt", "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 64,
  "seq_len": 32, "vocab": 256}, "data": {"type": "text", "train": "fox.txt", "val_fraction": 0.1},
  "precision": {"dtype": "fp16"}, "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
  "batch_size": 8, "steps": 3, "seed": 1, "threads": 1, "device": "DEVICE",
  "distributed": {"world_size": 2, "comm_hook": "fp16", "bucket_mb": 0.0625}}'
echo "${gpt/DEVICE/cpu}" | "$AMPD" run --data-root "$TMP/text" - >"$TMP/gptc.out" 2>/dev/null
status_is "CPU ranks, a GPT" 0 $?
echo "${gpt/DEVICE/cuda}" | AMPD_CUDAEMU_DEVICES=2 "$AMPD_EMU" run --data-root "$TMP/text" - \
    >"$TMP/gptg.out" 2>"$TMP/gptg.err"
status_is "CUDA ranks, a GPT" 0 $?
check "CUDA ranks, a GPT in 64 KiB buckets: 3 steps within 1e-4 of the CPU ranks' losses" \
    jsok "$TMP/gptg.out" "Object.keys(steps).length === 3 && Object.keys(steps).every(s =>
        rel(steps[s].loss, load('$TMP/gptc.out')[s].loss) <= 1e-4)"
check "CUDA ranks, a GPT: both ranks end with the same weights" \
    test "$(grep -o 'stopped at step 3: .*' "$TMP/gptg.err" | sort -u | wc -l)" -eq 1
# fp8 on CUDA ranks: the GPT's block linears in fp8; each rank stages the amaxes of its half
# of the batch, which NCCL's stand-in reduces (MAX) after the gradients' buckets
g8=$(echo "$gpt" | sed 's/"dtype": "fp16"/"dtype": "fp8"/; s/"steps": 3/"steps": 6/')
echo "${g8/DEVICE/cpu}" | "$AMPD" run --data-root "$TMP/text" - >"$TMP/g8c.out" 2>"$TMP/g8c.err"
status_is "CPU ranks, an fp8 GPT" 0 $?
echo "${g8/DEVICE/cuda}" | AMPD_CUDAEMU_DEVICES=2 "$AMPD_EMU" run --data-root "$TMP/text" - \
    >"$TMP/g8g.out" 2>"$TMP/g8g.err"
status_is "CUDA ranks, an fp8 GPT" 0 $?
check "CUDA ranks, an fp8 GPT: rank 0 trains on the emulated device" \
    grep -q '"type":"start",.*"device":"cuda:0 (ampd CUDA emulator' "$TMP/g8g.out"
m=$(js "$TMP/g8g.out" "Math.max(...Object.keys(steps).map(s => rel(steps[s].loss, load('$TMP/g8c.out')[s].loss)))")
echo "CUDA ranks (emulated), world 2, an fp8 GPT: largest relative loss difference from the CPU ranks over 6 steps: $m"
check "CUDA ranks, an fp8 GPT: 6 steps within 1e-3 of the CPU ranks' losses" \
    jsok "$TMP/g8g.out" "Object.keys(steps).length === 6 && $m <= 1e-3"
check "CUDA ranks, an fp8 GPT: both ranks end with the same state, fp8 scaling included" \
    test "$(grep -c 'stopped at step 6' "$TMP/g8g.err")" -eq 2 -a \
    "$(grep -o 'stopped at step 6: .*' "$TMP/g8g.err" | sort -u | wc -l)" -eq 1
spec 2 fp16 3 '"diagnostics_every": 1, "device": "cuda"' |
    sed 's/"precision": {[^}]*}/"precision": {"dtype": "bf16", "loss_scale": {"mode": "dynamic", "init": 16777216}}/' |
    AMPD_CUDAEMU_DEVICES=2 "$AMPD_EMU" run - >"$TMP/gov.out" 2>"$TMP/gov.err"
status_is "CUDA ranks, comm overflow" 0 $?
check "CUDA ranks, comm overflow: step 1 skipped, where is comm" \
    jsok "$TMP/gov.out" 'steps[1].skipped && lines.some(l => l.type === "layers" &&
        l.step === 1 && l.first_nonfinite.where === "comm")'
check "CUDA ranks, comm overflow: the ranks skipped alike" \
    grep -q 'stopped at step 3: .* skipped 3' "$TMP/gov.err"
check "CUDA ranks, comm overflow: ... with equal states" \
    test "$(grep -o 'stopped at step 3: .*' "$TMP/gov.err" | sort -u | wc -l)" -eq 1
spec 2 none 2 '"device": "cuda"' | AMPD_CUDAEMU_DEVICES=1 timeout 60 "$AMPD_EMU" run - \
    >/dev/null 2>"$TMP/g1dev.err"
status_is "two CUDA ranks, one device: the job fails" 1 $?
check "... naming the rank and the device it lacks" \
    grep -q 'rank 1 of this host needs CUDA device 1, but the host has 1' "$TMP/g1dev.err"
spec 2 none 2 '"device": "auto"' | AMPD_CUDAEMU_DEVICES=1 "$AMPD_EMU" run - >"$TMP/gauto.out" 2>/dev/null
status_is "two ranks, one device, auto" 0 $?
check "two ranks, one device, auto: both on the CPU" \
    grep -q '"type":"start",.*"device":"cpu"' "$TMP/gauto.out"

# ---- under the daemon: a job of 2 ranks, kill -9 of rank 1 ---------------------------------
serve "$TMP/port" "$TMP/daemon.log" --data-dir "$TMP/data" --db "$TMP/ampd.db"
dpid=$SERVE_PID
URL="http://127.0.0.1:${SERVE_PORT:-0}"
post() { curl -sS -m 20 -X POST -H 'Content-Type: application/json' -d "$1" "$URL/v1/jobs"; }
field() { node -e 'const j = JSON.parse(require("fs").readFileSync(0, "utf8")); console.log(eval("j." + process.argv[1]))' "$1"; }
id1=$(spec 2 fp16 100000 | tr -d '\n' | { read -r b; post "$b"; } | field id)
id2=$(post '{"name": "next", "model": {"type": "mlp", "layers": [784, 32, 10]},
    "data": {"type": "idx", "train": "fashion-mnist"}, "steps": 20}' | field id)
check "daemon: both jobs queued" test -n "$id1" -a -n "$id2"
rank1=
for _ in $(seq 200); do
    for p in $(pgrep -f "ampd run"); do
        tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1' &&
            grep -q "jobs/$id1" "/proc/$p/cmdline" 2>/dev/null && rank1=$p
    done
    [ -n "$rank1" ] && [ "$(curl -sS -m 5 "$URL/v1/jobs/$id1" | field progress.step)" -ge 3 ] && break
    sleep 0.1
done
check "daemon: rank 1 of the job found" test -n "$rank1"
kill -9 "$rank1" 2>/dev/null
t0=$(date +%s%N)
healthy=0
sick=0
st=
while [ $(($(date +%s%N) - t0)) -lt 20000000000 ]; do
    if [ "$(curl -sS -m 2 -o /dev/null -w '%{http_code}' "$URL/healthz")" = 200 ]; then
        healthy=$((healthy + 1))
    else
        sick=$((sick + 1))
    fi
    st=$(curl -sS -m 5 "$URL/v1/jobs/$id1" | field status)
    [ "$st" = failed ] && break
    sleep 0.2
done
t1=$(date +%s%N)
echo "daemon: the job failed $(((t1 - t0) / 1000000)) ms after kill -9 of rank 1 ($healthy healthz answers)"
check "daemon: the job failed" test "$st" = failed
check "daemon: within 10 s" test $(((t1 - t0) / 1000000)) -lt 10000
check "daemon: /healthz answered throughout" test "$sick" -eq 0 -a "$healthy" -gt 0
check "daemon: the job's error names rank 1 and the signal" \
    sh -c "curl -sS -m 5 '$URL/v1/jobs/$id1' | grep -q 'rank 1 .*signal 9'"
for _ in $(seq 200); do
    [ "$(curl -sS -m 5 "$URL/v1/jobs/$id2" | field status)" = succeeded ] && break
    sleep 0.1
done
check "daemon: the next job ran" test "$(curl -sS -m 5 "$URL/v1/jobs/$id2" | field status)" = succeeded

# cancel and resume of a job of 2 ranks under the daemon: the steps after the checkpoint are
# those of an uninterrupted run
spec 2 none 300 >"$TMP/c.json"
"$AMPD" run "$TMP/c.json" >"$TMP/c.out" 2>/dev/null
status_is "uninterrupted run of 300 steps" 0 $?
id3=$(tr -d '\n' <"$TMP/c.json" | { read -r b; post "$b"; } | field id)
for _ in $(seq 300); do
    [ "$(curl -sS -m 5 "$URL/v1/jobs/$id3" | field progress.step)" -ge 20 ] && break
    sleep 0.05
done
curl -sS -m 20 -X POST -H 'Content-Type: application/json' "$URL/v1/jobs/$id3/cancel" >/dev/null
for _ in $(seq 300); do
    [ "$(curl -sS -m 5 "$URL/v1/jobs/$id3" | field status)" = cancelled ] && break
    sleep 0.1
done
ck3=$(curl -sS -m 5 "$URL/v1/jobs/$id3" | field checkpoint_step)
check "daemon cancel: cancelled with a checkpoint" test "$(curl -sS -m 5 "$URL/v1/jobs/$id3" | field status)" = cancelled -a "${ck3:-0}" -gt 0
curl -sS -m 20 -X POST -H 'Content-Type: application/json' "$URL/v1/jobs/$id3/resume" >/dev/null
for _ in $(seq 600); do
    [ "$(curl -sS -m 5 "$URL/v1/jobs/$id3" | field status)" = succeeded ] && break
    sleep 0.1
done
check "daemon resume: succeeded" test "$(curl -sS -m 5 "$URL/v1/jobs/$id3" | field status)" = succeeded
curl -sS -m 20 "$URL/v1/jobs/$id3/metrics?fields=loss&format=csv" | tail -n +2 >"$TMP/c.csv"
check "daemon resume: all 300 steps stored" test "$(wc -l <"$TMP/c.csv")" -eq 300
check "daemon resume: the steps after the checkpoint equal the uninterrupted run's" \
    jsok "$TMP/c.out" "((rows) => rows.length === 300 - $ck3 && rows.every(([s, v]) =>
        Math.abs(v - steps[s].loss) <= 1e-9 * Math.abs(steps[s].loss)))(
        require('fs').readFileSync('$TMP/c.csv', 'utf8').trim().split('\\n')
        .map((l) => l.split(',').map(Number)).filter(([s]) => s > $ck3))"
kill "$dpid"
wait "$dpid"

# ---- spec errors -------------------------------------------------------------------------------
spec 3 none 5 | "$AMPD" run - >"$TMP/e.out" 2>&1
status_is "batch 256 over 3 ranks: refused" 2 $?
check "... naming batch_size" grep -q '"field":"batch_size"' "$TMP/e.out"
spec 2 none 5 | sed 's/"comm_hook": "none"/"comm_hook": "none", "hosts": ["-bad"]/' |
    "$AMPD" run - >"$TMP/e.out" 2>&1
status_is "a bad host: refused" 2 $?
check "a bad host: refused, naming distributed.hosts[0]" \
    grep -q '"field":"distributed.hosts\[0\]"' "$TMP/e.out"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
