#!/bin/bash
# bench/gpu_curve.sh - the convergence benchmark's GPT job on the GPU, to set beside the same
# job on the CPU: does the CUDA backend learn what the CPU backend learns?
#
# The job is bench/convergence.sh's (bench/conv_job.sh: 4 layers, d_model 256, seq_len 128,
# batch 16, AdamW lr 1e-3, Debian's `fortunes` as bytes with a 10% validation split), eval
# every 100 steps, the text the directory /usr/share/games/fortunes (all its files), with
# "device": "cuda" and every step's loss printed.
#
#   bench/gpu_curve.sh run [STEPS [SEEDS [DTYPES]]]   (on the GPU machine, after
#       tests/gpu/prepare.sh here: it packs ampd and the data; defaults 300, "1 2",
#       "fp32 fp16 bf16"); each run's stdout in $OUT/curve/ampd-DTYPE-seedS.jsonl
#   bench/gpu_curve.sh cpu STEPS SEEDS DTYPES DIR     (here: the same runs on the CPU, into DIR)
#   bench/gpu_curve.sh compare GPU_DIR CPU_DIR...
#       (the CPU runs may be spread over several folders, e.g. a short `cpu` run with every
#       step and bench/convergence.sh's CONV_OUT/runs with the evals; their lines are merged)
#       For every run found in both: the first CURVE_FIRST (default 10) steps' losses, GPU against
#       CPU, relative; step 1 must agree within the tolerance of the emulator's GPT test
#       (tests/check_cuda_gpt.c: 1e-5 in fp32, 2e-3 in fp16/bf16); later steps drift as the
#       GEMMs' summation orders differ. Then the eval losses at each eval step, GPU beside
#       the CPU's runs of the same dtype: the GPU run must lie within the CPU's seed spread
#       (min - sd, max + sd over the CPU seeds). Exit 1 when either fails.
#   Environment: AMPD (default .gpu/tools/ampd, then ./ampd), DATA (default
#   .gpu/data/fortunes, then /usr/share/games/fortunes), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
die() { echo "bench/gpu_curve.sh: $*" >&2; exit 2; }
PY=${PYTHON:-python3}

# shellcheck source=bench/conv_job.sh
. bench/conv_job.sh

runs() { # device steps seeds dtypes dir [env...]
    local device=$1 steps=$2 seeds=$3 dtypes=$4 dir=$5 data s d f t
    shift 5
    data=${DATA:-}
    [ -n "$data" ] || for c in "$PWD/.gpu/data/fortunes" /usr/share/games/fortunes; do
        [ -e "$c" ] && { data=$c; break; }
    done
    [ -e "$data" ] || die "no fortunes file (set DATA, or apt-get install fortunes)"
    mkdir -p "$dir"
    for s in $seeds; do
        for d in $dtypes; do
            f=$dir/ampd-$d-seed$s
            conv_spec "curve-$device-$d-seed$s" "$d" "$s" "$steps" "$LR" 100 "$data" "$device" \
                >"$f.spec.json"
            t=$SECONDS
            "$@" "$AMPD" run --every 1 --data-root "$(dirname "$data")" "$f.spec.json" >"$f.jsonl" 2>"$f.err"
            printf '%-8s seed %s on %s: exit %d in %d s; %s\n' "$d" "$s" "$device" $? \
                $((SECONDS - t)) "$(grep -o '"type":"summary".\{0,160\}' "$f.jsonl" | head -c 160)"
        done
    done
}

case ${1:-} in
run)
    [ -d .gpu ] || [ ! -f .gpu.tar.xz ] || tar -xJf .gpu.tar.xz
    AMPD=${AMPD:-$( [ -x .gpu/tools/ampd ] && echo .gpu/tools/ampd || echo ./ampd)}
    # shellcheck source=tests/gpu/libs.sh
    . tests/gpu/libs.sh
    runs cuda "${2:-300}" "${3:-1 2}" "${4:-fp32 fp16 bf16}" "${OUT:-/tmp}/curve" \
        env "LD_LIBRARY_PATH=$GPU_LIB_PATH"
    ;;
cpu)
    [ $# -eq 5 ] || die "usage: cpu STEPS SEEDS DTYPES DIR"
    AMPD=${AMPD:-./ampd}
    runs cpu "$2" "$3" "$4" "$5" env
    ;;
compare)
    [ $# -ge 3 ] || die "usage: compare GPU_DIR CPU_DIR..."
    shift
    "$PY" - "${CURVE_FIRST:-10}" "$@" <<'EOF'
import glob, json, os, statistics, sys
first, gpu_dir, cpu_dirs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 2e-3}

def load(path, steps, evals):
    for line in open(path):
        try:
            o = json.loads(line)
        except ValueError:
            continue
        if o.get("type") == "step":
            steps[o["step"]] = o["loss"]
        elif o.get("type") == "eval":
            evals[o["step"]] = o["loss"]

def runs(dirs):
    out = {}
    for d in dirs:
        for p in glob.glob(os.path.join(d, "ampd-*-seed*.jsonl")):
            dt, seed = os.path.basename(p)[5:-6].split("-seed")
            load(p, *out.setdefault((dt, int(seed)), ({}, {})))
    return out

cpu, gpu = runs(cpu_dirs), runs([gpu_dir])
bad = 0
print(f"first {first} steps' training loss, GPU against CPU (same spec and seed):")
for key in sorted(set(cpu) & set(gpu)):
    c, g = cpu[key][0], gpu[key][0]
    rel = [abs(g[s] - c[s]) / abs(c[s]) for s in range(1, first + 1) if s in c and s in g]
    if not rel:
        continue
    ok = rel[0] <= TOL[key[0]]
    bad += not ok
    print(f"  {key[0]} seed {key[1]}: step 1 rel {rel[0]:.1e} (tolerance {TOL[key[0]]:.0e}: "
          f"{'ok' if ok else 'FAIL'}); steps 1-{len(rel)} worst {max(rel):.1e}")
print("eval loss, the GPU run beside the CPU's seeds of the same dtype:")
for dt in ("fp32", "fp16", "bf16"):
    cs = [v[1] for k, v in cpu.items() if k[0] == dt]
    for (gdt, seed), (_, ge) in sorted(gpu.items()):
        if gdt != dt or not cs:
            continue
        for step in sorted(ge):
            vals = [e[step] for e in cs if step in e]
            if not vals:
                continue
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            lo, hi = min(vals) - sd, max(vals) + sd
            ok = lo <= ge[step] <= hi
            bad += not ok
            print(f"  {dt} seed {seed} step {step}: gpu {ge[step]:.4f}, cpu "
                  f"{' '.join(f'{v:.4f}' for v in vals)} (spread [{lo:.4f}, {hi:.4f}]: "
                  f"{'within' if ok else 'OUTSIDE'})")
sys.exit(1 if bad else 0)
EOF
    ;;
*) sed -n '2,/^set -uo/p' "$0" | sed '$d'; [ "${1:-}" = -h ] || [ "${1:-}" = --help ] ;;
esac
