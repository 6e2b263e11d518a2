#!/bin/bash
# all.sh - on the GPU machine, the whole device check in one call of the device tool, within
# a deadline: the CUDA suites (tests/gpu/run.sh, each cut at GPU_TEST_TIMEOUT, default 60 s),
# the daemon's NVML inventory and a job placed on a GPU (tests/gpu/place.sh), the convergence
# job on the GPU (bench/gpu_curve.sh run: 300 steps, seeds 1 and 2, fp32, fp16 and bf16),
# then GPT-2 124M against PyTorch (bench/gpu.sh --no-naive) with the time left. Everything
# lands under $OUT (default /tmp/ampd-gpu): suites.txt, place.txt and place.*, curve.txt and
# curve/, gpu-bench.txt, gpu-bench.json and gpu-bench-logs/, and the suites' logs.
#
# Usage, from the repo root, after tests/gpu/prepare.sh here:
#     tests/gpu/all.sh [DEADLINE_S]       (default 430; carry [".gpu.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
DEADLINE=${1:-430}
export OUT=${OUT:-/tmp/ampd-gpu} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
[ -d .gpu ] || tar -xJf .gpu.tar.xz || { echo "all.sh: no .gpu (run tests/gpu/prepare.sh)"; exit 1; }
left() { echo $((DEADLINE - SECONDS)); }
rc=0
GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-60} tests/gpu/run.sh 2>&1 | tee "$OUT/suites.txt" || rc=1
echo "== suites done at ${SECONDS}s"
timeout -k 5 90 tests/gpu/place.sh 2>&1 | tee "$OUT/place.txt" || rc=1
echo "== placement done at ${SECONDS}s"
timeout -k 5 $(($(left) / 3)) bench/gpu_curve.sh run 300 "1 2" 2>&1 | tee "$OUT/curve.txt" || rc=1
echo "== curve done at ${SECONDS}s"
budget=$(($(left) - 25))
if [ "$budget" -ge 60 ]; then
    bench/gpu.sh --no-naive --budget "$budget" 2>&1 | tee "$OUT/gpu-bench.txt" || rc=1
else
    echo "all.sh: bench/gpu.sh skipped: ${budget}s left of the ${DEADLINE}s deadline"
fi
echo "== all done at ${SECONDS}s"
exit $rc
