#!/bin/bash
# run.sh - on the GPU machine: runs the CUDA test programs packed by tests/gpu/prepare.sh
# (unpacking .gpu.tar.xz first when .gpu is missing),
# each with its log in $OUT (or /tmp/ampd-gpu when OUT is unset), and prints each suite's
# summary (GPU_TEST_TIMEOUT: seconds each may take, default 300). cuBLASLt and NCCL come
# from the machine (tests/gpu/libs.sh).
set -uo pipefail
[ -d .gpu ] || tar -xJf .gpu.tar.xz || { echo "run.sh: no .gpu (run tests/gpu/prepare.sh)"; exit 1; }
OUT=${OUT:-/tmp/ampd-gpu}
mkdir -p "$OUT"
# shellcheck source=tests/gpu/libs.sh
. "$(dirname "$0")/libs.sh"
export LD_LIBRARY_PATH=$GPU_LIB_PATH
export AMPD_OPENBLAS="$PWD/.gpu/lib/libopenblas.so.0"
export AMPD_TEST_DATA="$PWD/.gpu/data/fashion-mnist"
echo "cuBLASLt from: ${GPU_CUBLAS_DIR:-not found}; NCCL from: ${GPU_NCCL_DIR:-not found}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
rc=0
for t in .gpu/bin/*; do
    name=$(basename "$t")
    timeout "${GPU_TEST_TIMEOUT:-300}" "$t" >"$OUT/$name.log" 2>&1
    r=$?
    [ $r -eq 0 ] || rc=1
    printf '%-20s exit %d  %s\n' "$name" "$r" "$(grep -E '^[0-9]+%: Checks:|SKIP' "$OUT/$name.log" | head -n 2 | tr '\n' ' ')"
    [ $r -eq 0 ] || tail -n 30 "$OUT/$name.log"
done
exit $rc
