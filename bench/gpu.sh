#!/bin/bash
# bench/gpu.sh - GPT-2 124M on one GPU: ampd's CUDA backend (`ampd run`, "device": "cuda")
# side by side with the same model in PyTorch (bench/torch_gpu.py: eager, autocast, fused
# AdamW), in bf16, fp16 (dynamic loss scaling) and fp32, in one invocation.
#
# Where: on the GPU machine, from the repo root, after tests/gpu/prepare.sh here (it packs
# ampd and its shared libraries into .gpu.tar.xz; the device tool carries [".gpu.tar.xz"]):
#     bench/gpu.sh [-b|--batch B] [--steps N] [--warmup W] [--fp32-steps N]
#                  [--budget S] [--no-naive] [--device cuda|cpu] [--tiny] [--torch-attn A]
#   -b, --batch B   sequences of 1024 tokens per step (default 8: 8192 tokens)
#   --steps N       steps of each 16-bit run (default 30); the first W (--warmup, default 10)
#                   are not counted: the step time is the median of the other N - W
#   --fp32-steps N  steps of each fp32 run (default 15, the first 5 not counted): fp32 is
#                   there for its memory, and is slow without TF32
#   --budget S      seconds for all the runs together (default 330): every run has its
#                   own timeout, cut to what is left; a run that would get less than 25 s
#                   is skipped and reported so. The whole script stays under ~6 minutes.
#   --no-naive      skip the extra bf16 runs with the softmax materialised (PyTorch, ampd)
#   --device cpu --tiny   a smoke test without a GPU (1 layer, d 64, T 16, vocab 320,
#                   batch 2, ampd's CPU backend and torch on the CPU; MFU is then
#                   meaningless). Set PYTHON to a python3 with torch (Debian's /usr/bin/python3).
#   --torch-attn naive    the PyTorch runs' default attention (sdpa) replaced, for the smoke
#                   test with a torch < 2.0 (which has no scaled_dot_product_attention)
#   Environment: AMPD (default .gpu/tools/ampd, then .gpu/bin/ampd, then ./ampd), PYTHON
#   (default python3: on the GPU machine the one that has torch), OUT (where the results go),
#   GPU_BENCH_T_AMPD, GPU_BENCH_T_AMPD_FP32, GPU_BENCH_T_TORCH (per-run timeouts, default
#   120, 100, 90 s), GPU_BENCH_MIN_RUN (default 25 s).
#
# Model: GPT-2 124M — n_layer 12, d_model 768, n_head 12, seq_len 1024, vocab 50304 (GPT-2's
# 50257 padded to a multiple of 128 via ampd's model.vocab, which may exceed the data's
# largest token + 1; the padded rows are ordinary vocabulary rows in both implementations:
# the softmax runs over all 50304 logits, as in nanoGPT), tied embeddings, pre-LN, GELU
# (tanh), 124,475,904 parameters. Data: a random llm.c token shard (bench/gpu_tokens.py, 5M
# tokens < 50257, seed 1337) and a one-batch eval shard (ampd always evaluates at the end;
# that is outside its step times). Optimizer in both: AdamW lr 6e-4, betas (0.9, 0.95),
# eps 1e-8, weight decay 0.1 on every parameter (ampd's spec has one decay for all), no
# gradient clipping, constant lr, seed 1.
#
# Runs, in this order (interleaved so that a budget cut or a hang costs both sides alike):
#   ampd bf16, pytorch bf16, ampd fp16, pytorch fp16, ampd fp8 (the blocks' linears in fp8,
#   Transformer Engine's defaults; compared with ampd bf16), pytorch fp32, ampd fp32, then
#   pytorch bf16 with --attn naive and ampd bf16 materialised. Attention, like for like:
#   "pytorch" is torch_gpu.py's default, F.scaled_dot_product_attention, a FUSED (flash)
#   attention that never stores the (B, H, T, T) softmax, and ampd's 16-bit runs use its
#   flash attention ("attention": "flash", gpu/cuda/cuda_attn.cu); "pytorch-naive" and
#   "ampd-materialized" both store the softmax. fp32 runs materialise it on both sides (no
#   tensor-core flash kernel in fp32 without TF32). A failing run prints its last log lines,
#   and the script goes on with the others.
#
# Measures: ampd — the median step_ms of its step lines after the warm-up (its summary's
# median_step_ms counts the warm-up steps too; it is kept in the JSON), and its summary's
# peak_mem (bytes by category; "total" in the table). PyTorch — the median of per-step CUDA
# event times after the warm-up, torch.cuda.max_memory_allocated. For both, "dev peak": the
# largest memory.used that nvidia-smi reports while the run lasts (sampled every 100 ms),
# less what was in use before it: what the process really took from the device (CUDA
# context, allocator caches and all).
#
# MFU = tokens/s * FLOP per token / PEAK_TFLOPS, with
#   FLOP per token = 6 * N + 12 * n_layer * seq_len * d_model
#   (PaLM's appendix B and nanoGPT's estimate_mfu: 6 N for the weight GEMMs' forward and
#   backward, 12 L T d for the attention's QK^T and PV; N = every parameter, the tied
#   embedding once, position embedding included) = 860,101,632 for GPT-2 124M at T 1024.
#   llm.c's gpt2_estimate_mfu counts the causal attention's half only, 6 N + 6 L T d
#   = 803,478,528 here, so its MFU reads 0.934 times these.
# fp32 runs (no TF32) are rated against the same bf16 peak; their own is ~67 TFLOP/s.
#
# Output: progress lines, then one table (a row per run; on each ampd row its ratio to the
# PyTorch run of the same precision), ampd's step by phase (each ampd run profiles its last
# warm-up step: `ampd run --profile`, CUDA events between op groups) and PyTorch's kernel
# time by kind (torch_gpu.py --profile: torch.profiler on its last warm-up step), then the
# path of the raw results: one JSON file,
# $OUT/gpu-bench.json when OUT is set (with every run's logs in $OUT/gpu-bench-logs/), else
# /tmp/ampd-gpu-bench-<time>.json (logs beside it).
set -uo pipefail

# H200 SXM dense bf16/fp16 Tensor Core peak, TFLOP/s: NVIDIA's H200 datasheet gives 1,979
# "with sparsity", so 989 dense — the H100 SXM's figure (llm.c's llmc/mfu.h: 988.8).
PEAK_TFLOPS=989

cd "$(dirname "$0")/.." || exit 1

B=8
STEPS=30
WARMUP=10
FP32_STEPS=15
FP32_WARMUP=5
BUDGET=330
NAIVE=1
DEVICE=cuda
TINY=0
TORCH_ATTN=sdpa
MIN_RUN=${GPU_BENCH_MIN_RUN:-25}       # seconds: a run that would get less is skipped
T_AMPD=${GPU_BENCH_T_AMPD:-120}        # per-run timeouts, seconds (cut to the budget left)
T_AMPD_FP32=${GPU_BENCH_T_AMPD_FP32:-100}
T_TORCH=${GPU_BENCH_T_TORCH:-90}

die() { echo "bench/gpu.sh: $*" >&2; exit 2; }
need_int() { # option value minimum
    if ! [[ $2 =~ ^[0-9]+$ ]] || [ "$2" -lt "$3" ]; then die "$1 needs an integer >= $3, got '$2'"; fi
}
while [ $# -gt 0 ]; do
    case $1 in
    -b | --batch) need_int "$1" "${2:-}" 1; B=$2; shift 2 ;;
    --steps) need_int "$1" "${2:-}" 2; STEPS=$2; shift 2 ;;
    --warmup) need_int "$1" "${2:-}" 0; WARMUP=$2; shift 2 ;;
    --fp32-steps) need_int "$1" "${2:-}" 2; FP32_STEPS=$2; shift 2 ;;
    --budget) need_int "$1" "${2:-}" 1; BUDGET=$2; shift 2 ;;
    --no-naive) NAIVE=0; shift ;;
    --device)
        [ "${2:-}" = cuda ] || [ "${2:-}" = cpu ] || die "--device: cuda or cpu"
        DEVICE=$2; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --torch-attn)
        [ "${2:-}" = sdpa ] || [ "${2:-}" = naive ] || die "--torch-attn: sdpa or naive"
        TORCH_ATTN=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[ "$WARMUP" -lt "$STEPS" ] || die "--warmup must be less than --steps"
[ "$FP32_WARMUP" -lt "$FP32_STEPS" ] || FP32_WARMUP=$((FP32_STEPS / 2))

if [ "$TINY" = 1 ]; then
    L=1 C=64 H=2 T=16 V=320 VDATA=300 NTOK=20000
    [ "$B" = 8 ] && B=2
else
    L=12 C=768 H=12 T=1024 V=50304 VDATA=50257 NTOK=5000000
fi

PY=${PYTHON:-python3}
# tests/gpu/prepare.sh's pack, carried compressed
if [ ! -d .gpu ] && [ -f .gpu.tar.xz ]; then
    tar -xJf .gpu.tar.xz
fi
if [ -z "${AMPD:-}" ]; then
    for c in .gpu/tools/ampd .gpu/bin/ampd ./ampd; do
        [ -x "$c" ] && { AMPD=$c; break; }
    done
fi
AMPD=${AMPD:-.gpu/tools/ampd}

# ampd's environment (only ampd's: the bundled Debian libraries must not reach torch): the
# libraries tests/gpu/prepare.sh packed, and the machine's cuBLASLt, as tests/gpu/run.sh.
AMPD_ENV=(env)
cublas=
if [ -d .gpu/lib ]; then
    # shellcheck source=tests/gpu/libs.sh
    . tests/gpu/libs.sh
    cublas=$GPU_CUBLAS_DIR
    AMPD_ENV+=("LD_LIBRARY_PATH=$GPU_LIB_PATH")
    [ -e .gpu/lib/libopenblas.so.0 ] && AMPD_ENV+=("AMPD_OPENBLAS=$PWD/.gpu/lib/libopenblas.so.0")
fi

STAMP=$(date +%Y%m%d-%H%M%S)
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    RESULT="$OUT/gpu-bench.json"
    LOGS="$OUT/gpu-bench-logs"
else
    RESULT="/tmp/ampd-gpu-bench-$STAMP.json"
    LOGS="/tmp/ampd-gpu-bench-$STAMP-logs"
fi
rm -rf "$LOGS"
mkdir -p "$LOGS" || exit 1
WORK=$(mktemp -d) || exit 1
POLL_PID=
cleanup() {
    [ -n "$POLL_PID" ] && kill "$POLL_PID" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

T0=$SECONDS
HAVE_SMI=0
command -v nvidia-smi >/dev/null 2>&1 && [ "$DEVICE" = cuda ] && HAVE_SMI=1
dev_mem() { timeout 10 nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1 | tr -dc '0-9'; }

echo "== bench/gpu.sh: GPT n_layer $L, d_model $C, n_head $H, seq_len $T, vocab $V, batch $B" \
     "($((B * T)) tokens/step), device $DEVICE, $(date -u +%FT%TZ)"
if [ "$HAVE_SMI" = 1 ]; then
    echo "gpu: $(nvidia-smi -i 0 --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)"
fi
echo "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)' 2>&1 | tail -n 1))"
echo "ampd: $AMPD (cuBLASLt from ${cublas:-the default library path})" | tee "$LOGS/ampd-version.txt"
"${AMPD_ENV[@]}" "$AMPD" version >>"$LOGS/ampd-version.txt" 2>&1
echo "ampd version: exit $? — $(tail -n +2 "$LOGS/ampd-version.txt" | tr '\n' ';' | cut -c1-300)"

mkdir -p "$WORK/data"
if ! "$PY" bench/gpu_tokens.py "$WORK/data/train.bin" --tokens "$NTOK" --vocab "$VDATA" --seed 1337 ||
   ! "$PY" bench/gpu_tokens.py "$WORK/data/eval.bin" --tokens $((B * (T + 1))) --vocab "$VDATA" --seed 1338; then
    echo "bench/gpu.sh: could not write the token shards (needs numpy)" >&2
    exit 1
fi

job() { # name dtype steps attention -> the job file's path
    local ls=""
    [ "$2" = fp16 ] && ls=', "loss_scale": {"mode": "dynamic", "init": 65536, "growth_interval": 2000}'
    cat >"$WORK/job-$1.json" <<EOF
{"name": "gpu-bench-gpt2-$1",
 "model": {"type": "gpt", "n_layer": $L, "n_head": $H, "d_model": $C, "seq_len": $T, "vocab": $V,
           "attention": "$4"},
 "data": {"type": "tokens", "train": "train.bin", "eval": "eval.bin"},
 "precision": {"dtype": "$2"$ls},
 "optimizer": {"type": "adamw", "lr": 0.0006, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
 "batch_size": $B, "steps": $3, "seed": 1, "device": "$DEVICE"}
EOF
    cp "$WORK/job-$1.json" "$LOGS/"
    echo "$WORK/job-$1.json"
}

# Copies stdin to stdout line by line and writes each line's arrival (time.monotonic(), s)
# to the file argv[1]; it ignores SIGTERM so that it drains what ampd prints when stopped.
STAMPER='
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "w") as t:
    for line in sys.stdin:
        sys.stdout.write(line)
        sys.stdout.flush()
        t.write("%.6f\n" % time.monotonic())
        t.flush()
'
AMPD_HUNG=0
# run_one NAME TIMEOUT COMMAND...: stdout to $LOGS/NAME.out, stderr to $LOGS/NAME.err, and
# $LOGS/NAME.meta (exit status, seconds, device memory before and at peak, MiB).
run_one() {
    local name=$1 limit=$2 left rc t base peak
    shift 2
    left=$((BUDGET - (SECONDS - T0)))
    if [ "$left" -lt "$MIN_RUN" ]; then
        printf '%-20s skipped: %d s of the %d s budget left\n' "$name" "$left" "$BUDGET"
        echo '{"rc": null, "skipped": "budget"}' >"$LOGS/$name.meta"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    printf '%-20s ' "$name"
    base=
    if [ "$HAVE_SMI" = 1 ]; then
        base=$(dev_mem)
        nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 \
            >"$LOGS/$name.smi" 2>/dev/null &
        POLL_PID=$!
    fi
    t=$SECONDS
    timeout -k 10 "$limit" "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err"
    rc=$?
    t=$((SECONDS - t))
    peak=
    if [ -n "$POLL_PID" ]; then
        kill "$POLL_PID" 2>/dev/null
        wait "$POLL_PID" 2>/dev/null
        POLL_PID=
        peak=$(tr -dc '0-9\n' <"$LOGS/$name.smi" | sort -n | tail -n 1)
    fi
    printf '{"rc": %d, "seconds": %d, "limit": %d, "dev_base_mib": %s, "dev_peak_mib": %s}\n' \
        "$rc" "$t" "$limit" "${base:-null}" "${peak:-null}" >"$LOGS/$name.meta"
    case $rc in
    0) echo "ok in ${t}s" ;;
    124 | 137) echo "TIMEOUT after ${t}s (limit ${limit}s)" ;;
    *) echo "FAILED: exit $rc after ${t}s" ;;
    esac
    if [ "$rc" != 0 ]; then
        echo "  --- last lines of stderr ($LOGS/$name.err):"
        tail -n 12 "$LOGS/$name.err" | cut -c1-400 | sed 's/^/  | /'
        echo "  --- last lines of stdout:"
        tail -n 3 "$LOGS/$name.out" | cut -c1-400 | sed 's/^/  | /'
    fi
}

run_ampd() { # name dtype steps limit attention
    local name=$1 limit=$4 f warm=$WARMUP prof=()
    [ "$2" = fp32 ] && warm=$FP32_WARMUP
    # the last warm-up step (not timed) is profiled phase by phase
    [ "$warm" -ge 1 ] && prof=(--profile "$warm")
    # A run that timed out before its first step means a hang: don't feed it the budget.
    [ "$AMPD_HUNG" = 1 ] && [ "$limit" -gt 45 ] && limit=45
    f=$(job "${name#ampd-}" "$2" "$3" "$5")
    # ampd's stdout goes through STAMPER, which notes when each line arrived (NAME.times): the
    # wall-clock cross-check of its step_ms. timeout signals the whole process group: ampd
    # then finishes its step and prints its summary, which STAMPER and this bash wait for
    # (`trap :` defers the signal until the pipeline ends; -k 10 kills a hung one).
    # shellcheck disable=SC2016 # expanded by that bash
    run_one "$name" "$limit" bash -c 'trap : TERM; set -o pipefail; "${@:4}" | "$1" -u -c "$2" "$3"' \
        _ "$PY" "$STAMPER" "$LOGS/$name.times" \
        "${AMPD_ENV[@]}" "$AMPD" run --every 1 "${prof[@]}" --data-root "$WORK/data" "$f"
    if grep -qE '"rc": (124|137),' "$LOGS/$name.meta" && ! grep -q '"type":"step"' "$LOGS/$name.out"; then
        AMPD_HUNG=1
    fi
}

run_torch() { # name mode steps warmup [extra args]
    local name=$1 mode=$2 steps=$3 warm=$4
    shift 4
    run_one "$name" "$T_TORCH" "$PY" bench/torch_gpu.py --device "$DEVICE" --mode "$mode" \
        --steps $((steps - warm)) --warmup "$warm" --batch "$B" --seq-len "$T" \
        --n-layer "$L" --d-model "$C" --n-head "$H" --vocab "$V" --data "$WORK/data/train.bin" \
        --seed 1 --lr 6e-4 --beta1 0.9 --beta2 0.95 --eps 1e-8 --weight-decay 0.1 \
        --attn "$TORCH_ATTN" --profile "$@"
}

# The card's real bf16 tensor-core rate beside the datasheet's: an 8192^3 bf16 GEMM through
# torch.matmul (cuBLAS), the median of 20 after 5 warm-up ones.
GEMM_TFLOPS=
if [ "$DEVICE" = cuda ]; then
    GEMM_TFLOPS=$(timeout 60 "$PY" - 2>"$LOGS/gemm.err" <<'PYEOF'
import torch
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
ms = []
for i in range(25):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); torch.matmul(a, b); e1.record(); torch.cuda.synchronize()
    if i >= 5:
        ms.append(e0.elapsed_time(e1))
ms.sort()
print("%.1f" % (2 * n ** 3 / (ms[len(ms) // 2] / 1e3) / 1e12))
PYEOF
)
    echo "8192^3 bf16 GEMM (torch.matmul, cuBLAS): ${GEMM_TFLOPS:-failed (see $LOGS/gemm.err)} TFLOP/s" \
         "against the ${PEAK_TFLOPS} TFLOP/s datasheet peak"
    # the fp8 GEMMs of GPT-2's linears against bf16, through ampd's own cuBLASLt calls
    for g in .gpu/tools/gemm8 bench/gemm8; do
        if [ -x "$g" ]; then
            timeout 60 "$g" 8192 | tee "$LOGS/gemm8.md" || echo "bench/gemm8 failed (see above)"
            break
        fi
    done
fi

echo "== runs (budget ${BUDGET}s; logs in $LOGS)"
run_ampd ampd-bf16 bf16 "$STEPS" "$T_AMPD" flash
run_torch torch-bf16 bf16 "$STEPS" "$WARMUP"
run_ampd ampd-fp16 fp16 "$STEPS" "$T_AMPD" flash
run_torch torch-fp16 fp16 "$STEPS" "$WARMUP"
run_ampd ampd-fp8 fp8 "$STEPS" "$T_AMPD" flash
run_torch torch-fp32 fp32 "$FP32_STEPS" "$FP32_WARMUP"
run_ampd ampd-fp32 fp32 "$FP32_STEPS" "$T_AMPD_FP32" materialized
if [ "$NAIVE" = 1 ]; then
    run_torch torch-bf16-naive bf16 "$STEPS" "$WARMUP" --attn naive
    run_ampd ampd-bf16-materialized bf16 "$STEPS" "$T_AMPD" materialized
fi
echo "== runs done in $((SECONDS - T0))s"

export BENCH_B=$B BENCH_L=$L BENCH_C=$C BENCH_H=$H BENCH_T=$T BENCH_V=$V BENCH_VDATA=$VDATA \
    BENCH_NTOK=$NTOK BENCH_STEPS=$STEPS BENCH_WARMUP=$WARMUP BENCH_FP32_STEPS=$FP32_STEPS \
    BENCH_FP32_WARMUP=$FP32_WARMUP BENCH_PEAK_TFLOPS=$PEAK_TFLOPS BENCH_DEVICE=$DEVICE \
    BENCH_BUDGET=$BUDGET BENCH_AMPD=$AMPD BENCH_TORCH_ATTN=$TORCH_ATTN BENCH_GEMM_TFLOPS=$GEMM_TFLOPS
"$PY" - "$LOGS" "$RESULT" <<'PYEOF'
"""Read the runs' logs, print the table, write the raw results."""
import json
import math
import os
import statistics
import sys

logs, result = sys.argv[1], sys.argv[2]
E = os.environ
B, L, C, H, T, V = (int(E["BENCH_" + k]) for k in ("B", "L", "C", "H", "T", "V"))
PEAK = float(E["BENCH_PEAK_TFLOPS"]) * 1e12
N = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
FPT = 6 * N + 12 * L * T * C
FPT_LLMC = 6 * N + 6 * L * T * C
GIB = 1024.0 ** 3
WARM = {"fp32": int(E["BENCH_FP32_WARMUP"])}
WARM16 = int(E["BENCH_WARMUP"])


def read(name, ext):
    try:
        with open(os.path.join(logs, f"{name}.{ext}"), errors="replace") as f:
            return f.read()
    except OSError:
        return None


def jlines(text, times=None):
    """The JSON objects of text's lines; with times (one per line), (object, time) pairs."""
    out = []
    for i, line in enumerate((text or "").splitlines()):
        try:
            o = json.loads(line)
        except ValueError:
            continue
        if isinstance(o, dict):
            if times is None:
                out.append(o)
            elif i < len(times):
                out.append((o, times[i]))
    return out


def wall_ms_per_step(name, warm):
    """From the arrival times of ampd's step lines: ms per step after the warm-up."""
    try:
        times = [float(x) for x in (read(name, "times") or "").split()]
    except ValueError:
        return None
    at = {o.get("step"): t for o, t in jlines(read(name, "out"), times)
          if o.get("type") == "step"}
    timed = [k for k in at if isinstance(k, int) and k > warm]
    if not timed or warm not in at:
        return None
    last = max(timed)
    return (at[last] - at[warm]) * 1e3 / (last - warm)


def meta(name):
    m = read(name, "meta")
    try:
        return json.loads(m) if m else None
    except ValueError:
        return None


def status_of(m, ok):
    if m is None:
        return "not run"
    if m.get("skipped"):
        return "skipped"
    rc = m.get("rc")
    if rc in (124, 137):
        return "timeout"
    return "ok" if rc == 0 and ok else f"failed({rc})"


def dev_bytes(m):
    if not m or m.get("dev_peak_mib") is None:
        return None
    return max(0, m["dev_peak_mib"] - (m.get("dev_base_mib") or 0)) * 1024 * 1024


def ampd_run(dt, name=None):
    name = name or f"ampd-{dt}"
    m = meta(name)
    lines = jlines(read(name, "out"))
    steps = [o for o in lines if o.get("type") == "step"]
    summ = next((o for o in reversed(lines) if o.get("type") == "summary"), None)
    start = next((o for o in lines if o.get("type") == "start"), None)
    prof = next((o for o in lines if o.get("type") == "profile"), None)
    warm = WARM.get(dt, WARM16)
    timed = [o["step_ms"] for o in steps
             if o.get("step", 0) > warm and isinstance(o.get("step_ms"), (int, float))]
    med = statistics.median(timed) if timed else None
    ok = summ is not None and summ.get("status") == "succeeded"
    st = status_of(m, ok)
    if st == "timeout" and steps:
        st = f"timeout@{steps[-1].get('step')}"
    peak = (summ or {}).get("peak_mem") or (steps[-1].get("mem") if steps else None)
    r = {"impl": "ampd", "mode": dt, "status": st, "meta": m, "timed_steps": len(timed),
         "median_step_ms": med, "wall_ms_per_step": wall_ms_per_step(name, warm), "tokens_per_s": B * T / (med / 1e3) if med else None,
         "mem_total": (peak or {}).get("total"), "peak_mem": peak, "dev_peak": dev_bytes(m),
         "params": (start or {}).get("params") or (summ or {}).get("params"),
         "summary": summ, "step_ms_all": [o.get("step_ms") for o in steps],
         "loss_first": steps[0].get("loss") if steps else None,
         "loss_last": steps[-1].get("loss") if steps else None,
         "ampd_tokens_per_s_median": statistics.median(
             [o["tokens_per_s"] for o in steps if isinstance(o.get("tokens_per_s"), (int, float))]
             or [float("nan")]),
         "start": start, "profile": prof}
    if summ and summ.get("error"):
        r["error"] = summ["error"]
    return r


def torch_run(name, dt):
    m = meta(name)
    res = next((o for o in reversed(jlines(read(name, "out"))) if o.get("impl") == "pytorch"), None)
    st = status_of(m, res is not None and res.get("status") == "ok")
    if res and res.get("status") == "interrupted":
        st = f"timeout@{len(res.get('step_ms_all') or [])}"
    elif res and res.get("status") not in (None, "ok"):
        st = res["status"]
    r = {"impl": "pytorch", "mode": dt, "status": st, "meta": m, "result": res,
         "dev_peak": dev_bytes(m)}
    if res:
        r["median_step_ms"] = res.get("median_step_ms")
        r["wall_ms_per_step"] = res.get("wall_ms_per_step")
        r["tokens_per_s"] = res.get("tokens_per_s")
        r["mem_total"] = (res.get("mem") or {}).get("peak_allocated")
        r["params"] = res.get("params")
        r["timed_steps"] = res.get("steps")
    return r


runs = {
    "ampd-bf16": ampd_run("bf16"), "torch-bf16": torch_run("torch-bf16", "bf16"),
    "torch-bf16-naive": torch_run("torch-bf16-naive", "bf16"),
    "ampd-bf16-materialized": ampd_run("bf16", "ampd-bf16-materialized"),
    "ampd-fp16": ampd_run("fp16"), "torch-fp16": torch_run("torch-fp16", "fp16"),
    "ampd-fp32": ampd_run("fp32"), "torch-fp32": torch_run("torch-fp32", "fp32"),
    "ampd-fp8": ampd_run("fp8"),
}
for r in runs.values():
    tps = r.get("tokens_per_s")
    r["mfu"] = tps * FPT / PEAK if tps else None
    r["mfu_llmc_formula"] = tps * FPT_LLMC / PEAK if tps else None


def ratio(a, b):
    return a / b if a and b else None


def f(v, fmt, width, suffix=""):
    """v formatted and right-aligned in width (suffix included), or "-" when there is none."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-".rjust(width)
    return (format(v, fmt) + suffix).rjust(width)


print()
print(f"GPT-2 {N:,} params (n_layer {L}, d_model {C}, n_head {H}, seq_len {T}, vocab {V}), "
      f"batch {B} x {T} = {B * T} tokens/step, AdamW lr 6e-4 betas (0.9, 0.95) wd 0.1; "
      f"device {E['BENCH_DEVICE']}")
print(f"MFU = tokens/s x (6 N + 12 n_layer seq_len d_model) / {E['BENCH_PEAK_TFLOPS']} TFLOP/s "
      f"(H100 SXM and H200 dense bf16/fp16) = tokens/s x {FPT:,} FLOP / peak")
if E.get("BENCH_GEMM_TFLOPS"):
    g = float(E["BENCH_GEMM_TFLOPS"])
    print(f"measured: an 8192^3 bf16 GEMM (cuBLAS via torch.matmul) runs at {g:.0f} TFLOP/s, "
          f"{100 * g / float(E['BENCH_PEAK_TFLOPS']):.0f}% of the peak above")
print(f"step ms: median after {WARM16} warm-up steps ({WARM['fp32']} for fp32; ampd: its step_ms, "
      "pytorch: CUDA events); wall ms: wall clock per step over the same steps (ampd: the step "
      "lines' arrival)")
print("mem: ampd summary peak_mem.total / torch max_memory_allocated; dev: nvidia-smi peak less "
      f"the use before the run; a/pt: ampd / its PyTorch peer of the same precision (flash: "
      f"pytorch ({E['BENCH_TORCH_ATTN']}); materialized: pytorch-naive)")
hdr = (f"{'mode':5} {'impl':17} {'status':14} {'step ms':>9} {'wall ms':>8} {'tokens/s':>10} {'MFU':>6} "
       f"{'mem GiB':>8} {'dev GiB':>8} {'ms a/pt':>8} {'mem a/pt':>8} {'dev a/pt':>8}")
print(hdr)
print("-" * len(hdr))
order = [("bf16", "ampd-bf16", "torch-bf16"), ("bf16", "torch-bf16", None),
         ("bf16", "ampd-bf16-materialized", "torch-bf16-naive"),
         ("bf16", "torch-bf16-naive", None), ("fp16", "ampd-fp16", "torch-fp16"),
         ("fp16", "torch-fp16", None), ("fp32", "ampd-fp32", "torch-fp32"),
         ("fp32", "torch-fp32", None), ("fp8", "ampd-fp8", None)]
ratios = {}
for mode, name, peer in order:
    r = runs[name]
    impl = {"torch-bf16-naive": "pytorch-naive", "ampd-bf16-materialized": "ampd-materialized",
            "ampd-fp32": "ampd"}.get(name, "ampd (flash)" if name.startswith("ampd")
                                     else f"pytorch ({E['BENCH_TORCH_ATTN']})")
    rt = rm = rd = None
    if peer:
        p = runs[peer]
        rt = ratio(r.get("median_step_ms"), p.get("median_step_ms"))
        rm = ratio(r.get("mem_total"), p.get("mem_total"))
        rd = ratio(r.get("dev_peak"), p.get("dev_peak"))
        ratios[f"{name}/{peer}"] = {"step_ms": rt, "mem": rm, "dev_mem": rd}
    mem = r.get("mem_total")
    dev = r.get("dev_peak")
    mfu = r["mfu"] * 100 if r["mfu"] else None
    print(f"{mode:5} {impl:17} {r['status'][:14]:14} {f(r.get('median_step_ms'), '.2f', 9)} "
          f"{f(r.get('wall_ms_per_step'), '.1f', 8)} "
          f"{f(r.get('tokens_per_s'), ',.0f', 10)} {f(mfu, '.1f', 6, '%')} "
          f"{f(mem / GIB if mem else None, '.2f', 8)} {f(dev / GIB if dev else None, '.2f', 8)} "
          f"{f(rt, '.2f', 8, 'x')} {f(rm, '.2f', 8, 'x')} {f(rd, '.2f', 8, 'x')}")


def pair(name, peer, what):
    """One run against another outside the table: the ratios kept, one line printed."""
    a, b = runs[name], runs[peer]
    rt, rm = ratio(a.get("median_step_ms"), b.get("median_step_ms")), ratio(a.get("mem_total"),
                                                                             b.get("mem_total"))
    ratios[f"{name}/{peer}"] = {"step_ms": rt, "mem": rm,
                                "dev_mem": ratio(a.get("dev_peak"), b.get("dev_peak"))}
    print(f"{what}: step time {f(rt, '.2f', 0, 'x')}, memory {f(rm, '.2f', 0, 'x')}")


pair("ampd-bf16-materialized", "torch-bf16-naive",
     "bf16 ampd-materialized / pytorch-naive (softmax materialised in both)")
pair("ampd-fp8", "ampd-bf16",
     "fp8 / bf16, ampd (the blocks' linears in fp8, delayed scaling; no PyTorch peer here)")
for dt in ("bf16", "fp16", "fp32", "fp8"):
    r = runs[f"ampd-{dt}"]
    s = r.get("summary") or {}
    pm = r.get("peak_mem") or {}
    cats = ", ".join(f"{k} {v / GIB:.2f}" for k, v in pm.items()
                     if k != "total" and isinstance(v, (int, float)))
    extra = ""
    if dt == "fp16" and s:
        extra = (f"; loss scale {s.get('final_loss_scale')}, overflows {s.get('overflow_total')}, "
                 f"skipped {s.get('skipped_total')}")
    if cats:
        print(f"ampd {dt} peak_mem GiB: {cats}{extra}")
    if r.get("error"):
        print(f"ampd {dt} error: {r['error'][:300]}")
for name in ("torch-bf16", "torch-bf16-naive", "torch-fp16", "torch-fp32"):
    m = (runs[name].get("result") or {}).get("mem") or {}
    if "peak_allocated" in m:
        print(f"{name} mem GiB: weights {m['weights'] / GIB:.2f}, grads {m['grads'] / GIB:.2f}, "
              f"optimizer {m['optimizer'] / GIB:.2f} (fp32); peak allocated "
              f"{m['peak_allocated'] / GIB:.2f}, reserved {m['peak_reserved'] / GIB:.2f}")
profs = [(n, runs[n]["profile"]) for n in ("ampd-bf16", "ampd-fp16", "ampd-fp8",
                                          "ampd-bf16-materialized", "ampd-fp32")
         if runs[n].get("profile")]
if profs:
    print(f"ampd's step by phase (--profile: CUDA events between op groups on its last warm-up "
          f"step; ms summed over the layers, x calls):")
    ms = [{p["name"]: (p["ms"], p["calls"]) for p in pr["phases"]} for _, pr in profs]
    names = sorted({k for m in ms for k in m}, key=lambda k: -max(m.get(k, (0, 0))[0] for m in ms))
    print(f"  {'phase':15}" + "".join(f"{n[5:]:>24}" for n, _ in profs))
    for k in names:
        cells = []
        for (_, pr), m in zip(profs, ms):
            v, c = m.get(k, (None, 0))
            share = 100 * v / pr["step_ms"] if v is not None and pr.get("step_ms") else None
            cells.append(f"{f(v, '.3f', 9)} {f(share, '.1f', 6, '%')} {f(c, 'd', 6, 'x') if c else '':>6}")
        print(f"  {k:15}" + "".join(f"{c:>24}" for c in cells))
    print(f"  {'(sum) / step':15}" + "".join(
        f"{f(pr.get('phases_ms'), '.3f', 9)} / {f(pr.get('step_ms'), '.3f', 9)}".rjust(24)
        for _, pr in profs))
for name in ("torch-bf16", "torch-fp16", "torch-bf16-naive", "torch-fp32"):
    pr = (runs[name].get("result") or {}).get("profile") or {}
    if pr.get("phases"):
        print(f"{name} kernels by kind (torch.profiler, its last warm-up step): " + ", ".join(
            f"{p['name']} {p['ms']:.3f} ms x{p['calls']}" for p in pr["phases"]))
    elif pr.get("error"):
        print(f"{name}: torch.profiler failed: {pr['error'][:200]}")
tf = runs["torch-fp16"].get("result") or {}
if tf:
    print(f"pytorch fp16: final GradScaler scale {tf.get('loss_scale_final')}")
for name, r in runs.items():
    sm, wm = r.get("median_step_ms"), r.get("wall_ms_per_step")
    if sm and wm and wm > 1.25 * sm:
        print(f"WARNING: {name}: {wm:.1f} ms per step by the wall clock, {sm:.1f} ms by its "
              "own timer: the timer misses part of the step (host work, syncs, or not "
              "waiting for the GPU)")
pn = {r.get("params") for r in runs.values() if r.get("params")}
if pn and pn != {N}:
    print(f"WARNING: parameter counts differ: {sorted(pn)} (formula: {N})")
print("fp32 (no TF32 on either side) is rated against the bf16 peak too; its own is ~67 TFLOP/s.")
print(f"llm.c's MFU formula (6 N + 6 L T d = {FPT_LLMC:,} FLOP/token) would read "
      f"{FPT_LLMC / FPT:.3f}x these.")

out = {"config": {"batch": B, "n_layer": L, "d_model": C, "n_head": H, "seq_len": T,
                  "vocab": V, "data_vocab": int(E["BENCH_VDATA"]), "train_tokens": int(E["BENCH_NTOK"]),
                  "steps": int(E["BENCH_STEPS"]), "warmup": WARM16,
                  "fp32_steps": int(E["BENCH_FP32_STEPS"]), "fp32_warmup": WARM["fp32"],
                  "device": E["BENCH_DEVICE"], "budget_s": int(E["BENCH_BUDGET"]),
                  "ampd": E["BENCH_AMPD"], "torch_attn": E["BENCH_TORCH_ATTN"],
                  "optimizer": {"type": "adamw", "lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                "weight_decay": 0.1}},
       "params_formula": N, "flops_per_token": FPT, "flops_per_token_llmc": FPT_LLMC,
       "flops_formula": "6*N + 12*n_layer*seq_len*d_model (PaLM / nanoGPT)",
       "peak_tflops": float(E["BENCH_PEAK_TFLOPS"]),
       "gemm_8192_bf16_tflops": float(E["BENCH_GEMM_TFLOPS"]) if E.get("BENCH_GEMM_TFLOPS") else None,
       "peak_source": "NVIDIA H200 SXM datasheet: 1979 TFLOP/s bf16/fp16 with sparsity, 989 dense",
       "ampd_version": read("ampd-version", "txt"), "runs": runs, "ratios": ratios}
with open(result, "w") as fh:
    json.dump(out, fh, indent=1, default=str)
print(f"raw results: {result}")
PYEOF
echo "total ${SECONDS}s"
