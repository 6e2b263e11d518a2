# shellcheck shell=bash
# tests/gpu/libs.sh - sourced by tests/gpu/run.sh, bench/gpu.sh and bench/gpu_curve.sh on the
# GPU machine: finds the libraries the pack does not carry (cuBLASLt, which the CUDA backend
# opens at run time, and NCCL) in the machine's CUDA toolkit or its Python packages
# (nvidia-cublas / nvidia-nccl, whose folders moved between CUDA 12's wheels and 13's), and
# sets GPU_LIB_PATH to the pack's .gpu/lib followed by the folders found.
# gpu_lib_dir FILE: the first folder that holds FILE, or nothing.
gpu_lib_dir() {
    local d
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
             /opt/torch/.venv/lib/python3*/site-packages/nvidia/*/lib \
             /usr/local/lib/python3*/dist-packages/nvidia/*/lib; do
        [ -e "$d/$1" ] && { echo "$d"; return; }
    done
    d=$(find /usr/local /opt -name "$1" -print -quit 2>/dev/null)
    [ -n "$d" ] && dirname "$d"
}
GPU_CUBLAS_DIR=$(gpu_lib_dir libcublasLt.so.13)
GPU_NCCL_DIR=$(gpu_lib_dir libnccl.so.2)
GPU_LIB_PATH="$PWD/.gpu/lib${GPU_CUBLAS_DIR:+:$GPU_CUBLAS_DIR}${GPU_NCCL_DIR:+:$GPU_NCCL_DIR}"
GPU_LIB_PATH="$GPU_LIB_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
