#!/bin/sh
# cu2cc.sh FILE.cu - print FILE.cu as host C++ for the CUDA emulator (tests/cudaemu): each
# launch `kern<<<grid, block[, shared[, stream]]>>>(args)` (its <<<...>>> on one line)
# becomes `emu_launch(emu_config(grid, block, ...), "kern", kern, args)`, and dlopen, dlsym,
# dlclose and dlerror become the emulator's (lt.cc), which hand out its cuBLASLt and its NCCL
# (nccl.cc). A #line keeps compiler messages and debuggers pointing into FILE.cu.
set -e
printf '#line 1 "%s"\n' "$1"
sed -e 's/\([A-Za-z_][A-Za-z_0-9]*\(<[^<>]*>\)\{0,1\}\)<<<\(.*\)>>>()/emu_launch(emu_config(\3), "\1", \1)/g' \
    -e 's/\([A-Za-z_][A-Za-z_0-9]*\(<[^<>]*>\)\{0,1\}\)<<<\(.*\)>>>(/emu_launch(emu_config(\3), "\1", \1, /g' \
    -e 's/\<dl\(open\|sym\|close\|error\)(/emu_dl\1(/g' "$1"
