#!/bin/bash
# check_cudaemu_run.sh - the CUDA backend end to end, on the CUDA emulator: tests/ampd_emu is
# ampd linked with tests/cudaemu, so its "auto" device is an emulated GPU.
#   - `ampd run` passes all of check_run.sh with the emulated GPU as the "auto" device (its
#     "device cuda trains on the GPU" branch included);
#   - a model that cannot fit in the device's memory is refused (exit 2, 400 from the daemon)
#     with what it needs by category and what the device has;
#   - bench/gemm8 runs (on the emulator: a few tokens);
#   - an emulated sm_80 (an A100) refuses the fp8 GEMM, naming the device;
#   - without a device, "auto" trains on the CPU and the log says why, "cuda" fails saying so;
#   - the same job run with the blocks and threads of every launch in two different orders
#     gives the same bits (AMPD_CUDAEMU_SHUFFLE);
#   - a GPT with flash attention (tensor-core kernels) ends its steps at the CPU's loss, and
#     gives the same bits under two block and thread orders;
#   - `ampd serve` lists the GPU and its memory in GET /v1/system, and a job submitted with
#     "device": "cuda" trains on it: its start event names the device, it succeeds with one
#     metric row per step, its memory metric counts the device's blocks.
set -u
AMPD=${AMPD:-tests/ampd_emu}
# shellcheck source=tests/testlib.sh
. "$(dirname "$0")/testlib.sh"
test_tmp

check "the emulated device is available" sh -c "'$AMPD' version | grep -q '^cuda: device available'"

AMPD=$AMPD "$(dirname "$0")/check_run.sh" >"$TMP/run.log" 2>&1
rc=$?
grep -E '^(FAIL|  )' "$TMP/run.log"
check "check_run.sh passes on the emulated GPU ($(tail -1 "$TMP/run.log"))" test "$rc" -eq 0

big='{"name":"big","model":{"layers":[784,4096,4096,10]},"data":{"type":"synthetic"},
      "steps":3,"device":"cuda","threads":1}'
echo "$big" | AMPD_CUDAEMU_MEMORY=50000000 "$AMPD" run - >"$TMP/out" 2>"$TMP/err"
status_is "a model larger than the device is refused" 2 $?
check "... saying what it needs and what the device has" \
    grep -Eq '"field":"model.layers","message":"the job needs 4[0-9]{2}\.[0-9] MiB \(weights 76\.4 MiB, master 0\.0 MiB, gradients 76\.4 MiB, optimizer 152\.9 MiB, activations [0-9.]+ MiB, workspace [0-9.]+ MiB\) but cuda:0 \(ampd CUDA emulator \(CPU\), the device \\"cuda\\" trains on\) has 47\.7 MiB"' "$TMP/err"
echo "$big" | sed 's/"cuda"/"cpu"/' | AMPD_CUDAEMU_MEMORY=50000000 "$AMPD" run - >"$TMP/out" 2>/dev/null
status_is "the same model on the CPU" 0 $?
check "... while on the CPU it trains" grep -q '"status":"succeeded"' "$TMP/out"

# bench/gemm8 (the fp8 GEMMs against bf16, for a GPU) runs: its four linears timed
"$(dirname "$0")/gemm8_emu" 16 1 >"$TMP/gemm8" 2>&1
check "bench/gemm8 times GPT-2's four linears in bf16 and fp8" \
    test "$(grep -cE '^\| (attn|mlp)\.[a-z]+ \| 16 x ' "$TMP/gemm8")" -eq 4

# an A100 (sm_80) has no fp8 tensor cores: the fp8 GEMM is refused naming the device
AMPD_CUDAEMU_SM=80 CK_RUN_CASE=fp8 "$(dirname "$0")/check_cudaemu_gemm" >"$TMP/sm80" 2>&1
check "sm_80: the fp8 GEMM is refused, naming the device and sm_80 ($(grep -o 'refused.*' "$TMP/sm80"))" \
    grep -q 'fp8 refused as it should be: ampd CUDA emulator (CPU) (device 0) is sm_80' "$TMP/sm80"

tiny='{"model":{"layers":[20,4]},"data":{"type":"synthetic"},"steps":3,"threads":1}'
echo "$tiny" | AMPD_CUDAEMU_DEVICES=0 "$AMPD" run - >"$TMP/out" 2>"$TMP/err"
status_is "no device: auto trains on the CPU" 0 $?
check "... and its start line says cpu" grep -q '"type":"start",.*"device":"cpu"' "$TMP/out"
check "... and the log says why" grep -q 'using the CPU backend (no CUDA device' "$TMP/err"
echo "${tiny%\}},\"device\":\"cuda\"}" | AMPD_CUDAEMU_DEVICES=0 "$AMPD" run - >"$TMP/out" 2>/dev/null
status_is "no device: cuda fails" 1 $?
check "... naming the missing device" \
    grep -q '"status":"failed",.*"error":"device \\"cuda\\": no CUDA device' "$TMP/out"

# a GPU runs blocks in no set order: the same job (fp16, dynamic scaling, clipping) under two
# orders of blocks and threads gives the same bits, step by step
det='{"name":"det","model":{"layers":[64,256,256,10]},"data":{"type":"synthetic","train_size":2048},
      "precision":{"dtype":"fp16"},"optimizer":{"type":"adamw","grad_clip":0.5},"batch_size":64,
      "steps":30,"device":"cuda","threads":1}'
for s in 11 12; do
    echo "$det" | AMPD_CUDAEMU_SHUFFLE=$s "$AMPD" run - >"$TMP/out" 2>/dev/null
    status_is "block order $s" 0 $?
    grep '"type":"step"' "$TMP/out" | sed 's/"step_ms".*//' >"$TMP/order$s"
done
check "30 steps under each of two block orders" test "$(wc -l <"$TMP/order11")" -eq 30
check "... the same bits in both (loss, scale, gradient norm)" cmp -s "$TMP/order11" "$TMP/order12"

# a GPT with flash attention on the device: its tensor-core kernels train as the CPU does
mkdir -p "$TMP/text"
for i in $(seq 1 200); do echo "the quick brown fox jumps over the lazy dog $((i % 7))"; done \
    >"$TMP/text/fox.txt"
flash='{"model":{"type":"gpt","n_layer":1,"n_head":2,"d_model":32,"seq_len":32,"vocab":256,
        "attention":"flash"},"data":{"type":"text","train":"fox.txt"},"precision":{"dtype":"bf16"},
        "batch_size":4,"steps":3,"eval_every":0,"threads":1,"device":"cuda"}'
for d in cuda cpu; do
    echo "${flash/\"cuda\"/\"$d\"}" | "$AMPD" run --data-root "$TMP/text" - >"$TMP/out" 2>/dev/null
    status_is "a flash-attention gpt on $d" 0 $?
    grep '"type":"step","step":3,' "$TMP/out" | sed 's/.*"loss":\([0-9.]*\).*/\1/' >"$TMP/flash-$d"
done
check "a flash-attention gpt trains on the device as on the CPU ($(cat "$TMP/flash-cuda") vs $(cat "$TMP/flash-cpu"))" \
    awk -v a="$(cat "$TMP/flash-cpu")" -v b="$(cat "$TMP/flash-cuda")" \
    'BEGIN {d = a - b; exit !(a > 0 && d * d < 1e-6 * a * a)}'
# ... and its kernels give the same bits under two orders of blocks and threads (two key tiles,
# the second partial: the shared tiles are written and read only across __syncthreads)
flash2=${flash/\"seq_len\":32/\"seq_len\":80}
for s in 11 12; do
    echo "${flash2/\"bf16\"/\"fp16\"}" | AMPD_CUDAEMU_SHUFFLE=$s "$AMPD" run --data-root "$TMP/text" - \
        >"$TMP/out" 2>/dev/null
    status_is "flash attention, block order $s" 0 $?
    grep '"type":"step"' "$TMP/out" | sed 's/"step_ms".*//' >"$TMP/forder$s"
done
check "flash attention: 3 steps under each of two block orders" test "$(wc -l <"$TMP/forder11")" -eq 3
check "... the same bits in both" cmp -s "$TMP/forder11" "$TMP/forder12"

# the daemon, which sees the emulated GPU through the emulator's NVML stand-in
AMPD_NVML=${AMPD_TEST_NVML:-tests/cudaemu/libnvidia-ml.so.1} AMPD_CUDAEMU_MEMORY=50000000 \
    serve "$TMP/port" "$TMP/daemon.log" --data-dir "$TMP/data" \
    --db "$TMP/ampd.db" --no-dashboard
DPID=$SERVE_PID
URL="http://127.0.0.1:${SERVE_PORT:-0}"
sys=$(curl -sS -m 20 "$URL/v1/system")
check "/v1/system: the emulated GPU with its memory" \
    grep -q '"gpus":\[{"index":0,"name":"ampd CUDA emulator (CPU)","memory_bytes":50000000,"compute_capability":"9.0"' <<<"$sys"
check "/v1/system: auto jobs get the CUDA backend" grep -q '"backend":"cuda"' <<<"$sys"

code=$(curl -sS -m 20 -o "$TMP/body" -w '%{http_code}' -X POST -H 'Content-Type: application/json' \
    --data-binary "$big" "$URL/v1/jobs")
check "a job larger than the GPU gets a 400 ($code)" test "$code" = 400
check "... that names the GPU" grep -q 'but cuda:0 (ampd CUDA emulator (CPU)' "$TMP/body"

job='{"name":"emu-fp16","model":{"layers":[20,64,4]},"data":{"type":"synthetic","train_size":512},
      "precision":{"dtype":"fp16"},"batch_size":32,"steps":50,"device":"cuda","threads":1}'
id=$(curl -sS -m 20 -X POST -H 'Content-Type: application/json' --data-binary "$job" \
    "$URL/v1/jobs" | grep -o '"id":[0-9]*' | head -1 | cut -d: -f2)
status=""
for _ in $(seq 1 600); do
    status=$(curl -sS -m 20 "$URL/v1/jobs/${id:-0}" | grep -o '"status":"[a-z]*"' | head -1)
    case "$status" in *succeeded* | *failed* | *cancelled*) break ;; esac
    sleep 0.1
done
check "a cuda job submitted to the daemon succeeds ($status)" test "$status" = '"status":"succeeded"'
check "its start event names the emulated device" sh -c \
    "curl -sS -m 20 '$URL/v1/jobs/${id:-0}/events' | grep -q 'cuda:0 (ampd CUDA emulator (CPU)'"
rows=$(curl -sS -m 20 "$URL/v1/jobs/${id:-0}/metrics?fields=loss&format=csv" | tail -n +2 | wc -l)
check "one metric row per step ($rows)" test "$rows" -eq 50
mem=$(curl -sS -m 20 "$URL/v1/jobs/${id:-0}/metrics?fields=mem_bytes&format=csv" | tail -1 | cut -d, -f2)
check "its memory is the device's, cuBLASLt's 32 MiB workspace included ($mem)" \
    test "${mem%.*}" -gt 33554432

kill -TERM "$DPID"
wait "$DPID"
rc=$?
DPID=""
check "the daemon exits 0 on SIGTERM" test "$rc" -eq 0

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
