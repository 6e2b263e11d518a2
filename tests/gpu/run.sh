#!/bin/bash
# run.sh - on the GPU machine: runs the CUDA test programs packed by tests/gpu/prepare.sh
# (unpacking .gpu.tar.xz first when .gpu is missing),
# each with its log in $OUT (or /tmp/ampd-gpu when OUT is unset), and prints each suite's
# summary. cuBLASLt and NCCL come from the machine: its CUDA toolkit (/usr/local/cuda/lib64)
# or the nvidia-cublas / nvidia-nccl Python packages, whichever is found first.
set -uo pipefail
[ -d .gpu ] || tar -xJf .gpu.tar.xz || { echo "run.sh: no .gpu (run tests/gpu/prepare.sh)"; exit 1; }
OUT=${OUT:-/tmp/ampd-gpu}
mkdir -p "$OUT"
cublas=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
             /opt/torch/.venv/lib/python3*/site-packages/nvidia/cublas/lib \
             /usr/local/lib/python3*/dist-packages/nvidia/cublas/lib 2>/dev/null |
         while read -r d; do [ -e "$d/libcublasLt.so.13" ] && echo "$d"; done | head -n 1)
# NCCL (check_cuda_train's one-rank all-reduce) the same way: the toolkit's or nvidia-nccl's
nccl=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
           /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib \
           /usr/local/lib/python3*/dist-packages/nvidia/nccl/lib 2>/dev/null |
       while read -r d; do [ -e "$d/libnccl.so.2" ] && echo "$d"; done | head -n 1)
export LD_LIBRARY_PATH=".gpu/lib${cublas:+:$cublas}${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export AMPD_OPENBLAS="$PWD/.gpu/lib/libopenblas.so.0"
export AMPD_TEST_DATA="$PWD/.gpu/data/fashion-mnist"
echo "cuBLASLt from: ${cublas:-not found}; NCCL from: ${nccl:-not found}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
rc=0
for t in .gpu/bin/*; do
    name=$(basename "$t")
    timeout 300 "$t" >"$OUT/$name.log" 2>&1
    r=$?
    [ $r -eq 0 ] || rc=1
    printf '%-20s exit %d  %s\n' "$name" "$r" "$(grep -E '^[0-9]+%: Checks:|SKIP' "$OUT/$name.log" | head -n 2 | tr '\n' ' ')"
    [ $r -eq 0 ] || tail -n 30 "$OUT/$name.log"
done
exit $rc
