#!/bin/bash
# prepare.sh - builds the CUDA test programs and ampd here and packs them for a GPU machine
# that has only the NVIDIA driver and CUDA's own libraries (none of our Debian -dev
# packages): the test binaries into .gpu/bin, ampd into .gpu/tools (for bench/gpu.sh; not
# in .gpu/bin, whose every file tests/gpu/run.sh runs as a test suite), the shared
# libraries they need (jansson, SQLite, libmicrohttpd, Check, zlib...) and OpenBLAS (which
# the CPU reference opens at run time) with its own dependencies into .gpu/lib
# (../shared/tools/bundle-libs.sh). cuBLASLt is not carried: the backend opens the GPU
# machine's copy at run time (tests/gpu/run.sh and bench/gpu.sh find it).
#
# Usage, from the build directory (the source tree): tests/gpu/prepare.sh
# then on the GPU machine (device tool: carry [".gpu.tar.xz"]): tests/gpu/run.sh, bench/gpu.sh
set -euo pipefail
BUNDLE=${BUNDLE:-../shared/tools/bundle-libs.sh}
TESTS="tests/check_cuda tests/check_cuda_gemm tests/check_cuda_ops tests/check_cuda_step
       tests/check_cuda_gpt tests/check_cuda_train"
CARRY_LIMIT_KIB=$((64 * 1024)) # the device tool carries at most 64 MiB

# shellcheck disable=SC2086 # a list of targets
make -j2 $TESTS ampd bench/gemm8 >/dev/null
rm -rf .gpu
mkdir -p .gpu/bin .gpu/lib .gpu/tools
# shellcheck disable=SC2086
cp $TESTS .gpu/bin/
strip --strip-debug .gpu/bin/*
cp ampd .gpu/tools/ampd
strip --strip-debug .gpu/tools/ampd # keeps the symbols (backtraces); nobody debugs it there
cp bench/gemm8 .gpu/tools/gemm8 # the fp8 GEMMs against bf16 (bench/gpu.sh)
strip --strip-debug .gpu/tools/gemm8
# the Fashion-MNIST job of check_cuda_train (Debian's dataset-fashion-mnist, 30 MB)
mkdir -p .gpu/data
cp -r /usr/share/datasets/fashion-mnist .gpu/data/
# bench/gpu_curve.sh's text (Debian's fortunes directory, 2.7 MB), when this machine has it
if [ -d /usr/share/games/fortunes ]; then cp -a /usr/share/games/fortunes .gpu/data/; fi
openblas=$(sed -n 's/^#define AMPD_OPENBLAS_PATH "\(.*\)"$/\1/p' config.h)
cp -L "$openblas" .gpu/lib/libopenblas.so.0
# shellcheck disable=SC2086
"$BUNDLE" .gpu/lib .gpu/bin/* .gpu/tools/ampd .gpu/tools/gemm8 "$openblas" >/dev/null
# The libraries alone are close to the device tool's 64 MiB carry limit (OpenBLAS is 36 MiB):
# carry them compressed; run.sh and bench/gpu.sh unpack .gpu.tar.xz when .gpu is missing.
tar -cf - .gpu | xz -T2 -6 >.gpu.tar.xz
echo "packed $(du -sh .gpu | cut -f1) into .gpu.tar.xz ($(du -sh .gpu.tar.xz | cut -f1)):" \
     "carry [\".gpu.tar.xz\"]"
kib=$(du -sk .gpu.tar.xz | cut -f1)
if [ "$kib" -gt $((CARRY_LIMIT_KIB - 16384)) ]; then
    echo "prepare.sh: warning: .gpu.tar.xz is ${kib} KiB, within 16 MiB of the device tool's" \
         "64 MiB carry limit (with the working tree)" >&2
fi
