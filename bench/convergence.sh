#!/bin/bash
# bench/convergence.sh - convergence of ampd beside PyTorch, over seeds: the same GPT job
# (4 layers, d_model 256, 4 heads, T 128, vocab 256, batch 16, AdamW lr 1e-3 with ampd's
# other defaults: no warmup, constant rate, no weight decay, no clipping) on the text of
# Debian's `fortunes`, trained by `ampd run` in fp32, fp16 (dynamic loss scaling) and bf16,
# and by PyTorch eager in fp32 and under bf16 autocast (bench/torch_convergence.py: the
# same model, init scheme, batches and validation windows; CPU, 2 threads), for each seed.
# Validation loss and accuracy every CONV_EVAL_EVERY steps; a run is on the unigram plateau
# at an eval when eval_loss >= 0.95 H and eval_acc <= p_max + 0.02 (H: the unigram entropy
# of the training split's bytes, nats; p_max: its most frequent byte's frequency). Markdown
# tables on stdout (mean +- sd over the seeds and how many left the plateau, every run, the
# claims checked), progress on stderr, every run's raw lines kept in CONV_OUT.
#
# Before training, for every seed, bench/batches (ampd's own loader and sampler) and the
# port in bench/torch_convergence.py list every training batch of the run (a hash of each
# row's inputs and targets) and the validation windows; the benchmark stops, naming the
# step and row, where they differ. Every ampd eval line's "count" must be the port's.
# Then the model check: PyTorch fp32, started from ampd's initial weights of the first seed
# (an ampd checkpoint written after one step at lr 1e-30), trains CONV_MODEL_CHECK steps on
# the same batches as ampd fp32 from its own init, and every step's loss must be ampd's
# within 1e-6 relative: the same model, loss and optimizer (measured: 3e-7 over 10 steps;
# GELU's erf form instead of tanh, the smallest difference tried, is 4e-6 by step 3; after
# ~15 steps chaos parts even equal models). The runs themselves start from each side's own
# init (the same scheme, not the same values).
#
# Usage: bench/convergence.sh [STEPS] [SEEDS]   (from the build directory after `make`)
#   STEPS  training steps of every run (default 600)
#   SEEDS  a count N (seeds 1..N; default 5) or a comma list ("1,2"; one seed: "7,")
#        bench/convergence.sh --report DIR...  the tables again from a run's CONV_OUT, or
#                     from several runs of the same job taken together (seeds 1,2 and 3,4)
# Environment:
#   CONV_VARIANTS  the runs per seed, in order (default "ampd:fp32 ampd:fp16 ampd:bf16
#                  torch:fp32 torch:bf16"; ampd:fp8 runs fp8 with its defaults, claim (c))
#   CONV_TORCH_BF16  auto (default): torch:bf16 is skipped, with the reason printed, on a
#                  CPU without AVX512_BF16, where PyTorch 1.13's bf16 autocast takes 17-30 s
#                  a step; run: run it anyway; skip: never
#   CONV_TIMEOUT   the limit of every run in seconds (default 600 + 10 x STEPS); a run past
#                  it is stopped and reported as timeout, with the evals it reached
#   CONV_MODEL_CHECK  the steps of the model check (default 10; 0: none)
#   CONV_EVAL_EVERY  (default 100), CONV_DATA_ROOT (/usr/share/games), CONV_DATA (fortunes)
#   CONV_OUT       where results.jsonl (one record per run), runs/ (each run's stdout and
#                  stderr), meta.json, stats.json and model_check.json are kept (default:
#                  a new /tmp/convergence.XXXXXX)
#   AMPD (./ampd), BATCHES (./bench/batches), PYTHON (/usr/bin/python3, with torch)
#
# Time (measured 2026-12-06 on the 2-core AMD EPYC, AVX2 and F16C, no AVX-512, shared with
# a build and test runs): STEPS 300, evals included, an ampd run took 316-865 s (median
# step 0.93-2.23 s, as the load came and went) and a PyTorch fp32 run 220-425 s (0.63-1.08
# s a step); the data and model checks about 1 min; `bench/convergence.sh 300 1,2` (8 runs,
# torch:bf16 skipped) 69 min. Runs scale with STEPS, so the default (600 steps, 5 seeds,
# 20 runs without torch:bf16) takes about 4-8 hours there (measured 2026-12-06/07: 5 h 30 min
# in three parts, beside builds); torch:bf16, where it runs (AVX512_BF16), about as long as
# torch:fp32.
set -euo pipefail

STEPS=${1:-600}
SEEDS_ARG=${2:-5}
BENCH=bench/convergence.sh
HERE=$(cd "$(dirname "$0")" && pwd)
AMPD=${AMPD:-./ampd}
BATCHES=${BATCHES:-./bench/batches}
PY=${PYTHON:-/usr/bin/python3}
VARIANTS=${CONV_VARIANTS:-ampd:fp32 ampd:fp16 ampd:bf16 torch:fp32 torch:bf16}
TORCH_BF16=${CONV_TORCH_BF16:-auto}
EVAL_EVERY=${CONV_EVAL_EVERY:-100}
MODEL_CHECK=${CONV_MODEL_CHECK:-10}
DATA_ROOT=${CONV_DATA_ROOT:-/usr/share/games}
DATA=${CONV_DATA:-fortunes}
# the job (N_LAYER ... VAL_FRACTION and conv_spec)
# shellcheck source=bench/conv_job.sh
. "$HERE/conv_job.sh"
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"

# ---- the report ---------------------------------------------------------------------------
# report DIR...: the tables of one results directory (meta.json, stats.json,
# results.jsonl, model_check.json), or of several runs of the same job taken together
report() {
    "$PY" - "$@" <<'EOF'
import json, math, statistics, sys

dirs = sys.argv[1:]
metas = [json.load(open(d + "/meta.json")) for d in dirs]
for k in ("steps", "eval_every", "data_path"):
    if len({json.dumps(m[k]) for m in metas}) > 1:
        sys.exit("bench/convergence.sh: --report: the runs differ in %s" % k)
meta = metas[0]
(cpu, engine, torch_ver, steps, data_path) = (
    meta[k] for k in ("cpu", "engine", "torch", "steps", "data_path"))
seeds = sorted({x for m in metas for x in m["seeds"]})
ORDER = ("ampd:fp32", "ampd:fp16", "ampd:bf16", "ampd:fp8", "torch:fp32", "torch:bf16")
variants = [v for v in ORDER if any(v in m["variants"] for m in metas)]
skipped = "; ".join(dict.fromkeys(m["skipped"] for m in metas if m["skipped"]))
command = "`, `".join(m["command"] for m in metas)
total_s = (sum(m["total_s"] for m in metas)
           if all(m.get("total_s") is not None for m in metas) else None)
for d, m in zip(dirs[1:], metas[1:]):
    if (m["cpu"], m["engine"], m["torch"]) != (cpu, engine, torch_ver):
        cpu += " (%s: %s; %s; PyTorch %s)" % (d, m["cpu"], m["engine"], m["torch"])
recs, seen = [], set()
for d in dirs:
    for l in open(d + "/results.jsonl"):
        r = json.loads(l)
        key = (r["impl"], r["dtype"], r["seed"])
        if key in seen:
            sys.exit("bench/convergence.sh: --report: %s:%s seed %d ran twice" % key)
        seen.add(key)
        recs.append(r)
stats = [json.load(open(d + "/stats.json")) for d in dirs]
if len({json.dumps(x, sort_keys=True) for x in stats}) > 1:
    sys.exit("bench/convergence.sh: --report: the runs' data differ (stats.json)")
st = stats[0]
out = ", ".join(dirs)
H, PMAX = st["entropy"], st["p_max"]
LOSS_MIN, ACC_MAX = 0.95 * H, PMAX + 0.02
NAME = {"ampd:fp32": "ampd fp32", "ampd:fp16": "ampd fp16 (dynamic scaling)",
        "ampd:bf16": "ampd bf16", "ampd:fp8": "ampd fp8 (delayed scaling, HYBRID)",
        "torch:fp32": "PyTorch fp32",
        "torch:bf16": "PyTorch bf16 autocast"}


def runs(v):
    impl, dt = v.split(":")
    return [r for r in recs if r["impl"] == impl and r["dtype"] == dt]


def plateau(e):
    return e["loss"] >= LOSS_MIN and e["acc"] <= ACC_MAX


eval_steps = sorted({e["step"] for r in recs for e in r["evals"]})


def at(v, step):
    """The evals of variant v at step, one per run that reached it (failed runs' too, if the
    count was right: a failure after the eval does not change it)."""
    return [e for r in runs(v) for e in r["evals"] if e["step"] == step]


def mean_sd(xs):
    m = statistics.mean(xs)
    return m, (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


S = len(seeds)
print("## Convergence over seeds: GPT 4 layers, d 256, 4 heads, T 128, vocab 256, batch 16, "
      "AdamW 1e-3; %s steps, seeds %s" % (steps, ", ".join(map(str, seeds))))
print()
print("CPU: %s. ampd's engine: %s. PyTorch %s, 2 threads. Command: `%s`; %s." % (
    cpu, engine, torch_ver, command, "%d min in all" % round(total_s / 60)
    if total_s is not None else "it did not finish"))
print()
print("Data: %s, %s training and %s validation bytes (val_fraction 0.1). Training split: "
      "unigram entropy H = %.4f nats, most frequent byte 0x%02x at p_max = %.4f. A run is on "
      "the unigram plateau at an eval when eval_loss >= 0.95 H = %.4f and eval_acc <= p_max + "
      "0.02 = %.4f." % (data_path, format(st["train_tokens"], ","), format(st["val_tokens"], ","),
                        H, st["top_byte"], PMAX, LOSS_MIN, ACC_MAX))
print()
print("Same job on both sides: the model of bench/torch_gpt.py, ampd's init scheme (the same "
      "distributions, not the same values), AdamW (0.9, 0.999), eps 1e-8, no weight decay, "
      "warmup or schedule. Data order: bench/batches (ampd's loader and sampler) and the port "
      "in bench/torch_convergence.py agree on every training batch of steps 1-%s of every seed "
      "(%d rows each, a hash of each row's inputs and targets) and on the validation windows "
      "(%d of the %d non-overlapping ones, %s positions: every ampd eval line's count is that)."
      % (steps, 16, st["eval_used"], st["eval_windows"], format(st["eval_count"], ",")))
for d in dirs:
    try:
        mc = json.load(open(d + "/model_check.json"))
    except OSError:
        continue
    print()
    print("Model check: PyTorch fp32 started from ampd's initial weights of seed %d (not from "
          "its own init) and trained on the same batches: its training loss at steps 1-%d is "
          "ampd fp32's within %.1e relative (largest at step %d; the check allows 1e-6)." % (
              mc["seed"], mc["steps"], mc["max_rel"], mc["at_step"]))
if skipped:
    print()
    print("Skipped: " + skipped + ".")
print()
print("Validation loss (nats per byte), mean ± sd over the seeds that reached the eval, and "
      "how many of them had left the plateau there:")
print()
print("| run | " + " | ".join("step %d" % s for s in eval_steps) + " |")
print("|---|" + "---|" * len(eval_steps))
for v in variants:
    cells = []
    for s in eval_steps:
        es = at(v, s)
        if not es:
            cells.append("-")
            continue
        m, sd = mean_sd([e["loss"] for e in es])
        left = sum(not plateau(e) for e in es)
        cells.append("%.3f%s, %d/%d left" % (m, " ± %.3f" % sd if len(es) > 1 else "", left,
                                             len(es)))
    print("| %s | %s |" % (NAME[v], " | ".join(cells)))
print()
print("Every run: validation loss at each eval (P: on the plateau), the last eval's accuracy, "
      "the run's wall time (evals included) and median step time:")
print()
print("| run | seed | status | " + " | ".join("%d" % s for s in eval_steps) +
      " | last acc | wall s | step ms | notes |")
print("|---|---|---|" + "---|" * len(eval_steps) + "---|---|---|---|")
for v in variants:
    for r in sorted(runs(v), key=lambda r: r["seed"]):
        by = {e["step"]: e for e in r["evals"]}
        cells = ["%.3f%s" % (by[s]["loss"], " P" if plateau(by[s]) else "") if s in by else "-"
                 for s in eval_steps]
        last = r["evals"][-1]["acc"] if r["evals"] else None
        notes = []
        if r["impl"] == "ampd" and r["dtype"] == "fp16" and "overflow_total" in r:
            notes.append("overflows %d, skipped %d, final scale %g" % (
                r["overflow_total"], r["skipped_total"], r["final_loss_scale"]))
        status = r["status"]
        if status == "timeout":
            status = "timeout (>%s s)" % r["limit"]
        elif status == "failed":
            notes.append(r.get("why", ""))
        ms = r.get("median_step_ms")
        print("| %s | %d | %s | %s | %s | %s | %s | %s |" % (
            NAME[v], r["seed"], status, " | ".join(cells),
            "%.4f" % last if last is not None else "-", "%.0f" % r["wall_s"],
            "%.0f" % ms if ms else "-", "; ".join(notes)))
fails = [r for r in recs if r["status"] == "failed" and r.get("err")]
if fails:
    print()
    print("Failures:")
    for r in fails:
        print()
        print("%s:%s seed %d: %s" % (r["impl"], r["dtype"], r["seed"], r.get("why", "")))
        print("```")
        print(r["err"])
        print("```")

# ---- the claims -------------------------------------------------------------------------
print()
print("Claims, checked at every eval step. Spread = the reference's mean ± 2 sd over its "
      "seeds (sample sd), not min..max: the min..max of S seeds holds a further draw from the "
      "same distribution only with probability (S-1)/(S+1) (1/3 for two seeds), while the "
      "mean of S seeds of the same distribution falls within mean ± 2 sd nearly always, so "
      "min..max would fail equal runs by chance. Needs two seeds of the reference at the step.")
print()


def within(v, ref):
    """(verdict, details) of variant v's mean within ref's mean ± 2 sd at every eval step."""
    if not runs(v):
        return "n.a.", "%s did not run" % NAME[v]
    if not runs(ref):
        return "n.a.", "%s did not run" % NAME[ref]
    outside, checked, missing = [], [], []
    for s in eval_steps:
        a, b = at(v, s), at(ref, s)
        if not a or len(b) < 2:
            missing.append(s)
            continue
        m = statistics.mean(e["loss"] for e in a)
        rm, rsd = mean_sd([e["loss"] for e in b])
        lo, hi = rm - 2 * rsd, rm + 2 * rsd
        checked.append(s)
        if not lo <= m <= hi:
            outside.append("step %d: %.3f outside %.3f..%.3f" % (s, m, lo, hi))
    if not checked:
        return "n.a.", "fewer than two seeds of %s at every step" % NAME[ref]
    verdict = "FAIL" if outside else "PASS"
    det = "; ".join(outside) if outside else "inside at steps %s" % ", ".join(map(str, checked))
    if missing:
        det += " (not checked at %s)" % ", ".join(map(str, missing))
    return verdict, det


print("(a) each ampd precision's mean within PyTorch's spread at the same precision:")
print()
for dt, ref, note in (
        ("fp32", "torch:fp32", ""),
        ("fp16", "torch:fp32", " (against PyTorch fp32: torch 1.13 has no fp16 autocast on the CPU)"),
        ("bf16", "torch:bf16", "")):
    v = "ampd:" + dt
    if v not in variants:
        continue
    verdict, det = within(v, ref)
    extra = ""
    if dt == "bf16" and ref not in variants and "torch:fp32" in variants:
        v32, d32 = within(v, "torch:fp32")
        extra = "; against PyTorch fp32's spread instead (not the claim): %s, %s" % (v32, d32)
    if ref not in variants:
        det = "%s was not run%s" % (NAME[ref], " (skipped)" if skipped.startswith(ref) else "")
    print("- %s vs %s%s: **%s**: %s%s" % (NAME[v], NAME[ref], note, verdict, det, extra))
print()
print("(b) ampd's fp16 and bf16 means within ampd fp32's seed spread:")
print()
for dt in ("fp16", "bf16"):
    v = "ampd:" + dt
    if v not in variants:
        continue
    verdict, det = within(v, "ampd:fp32")
    print("- %s vs ampd fp32: **%s**: %s" % (NAME[v], verdict, det))
print()
if "ampd:fp8" in variants:
    print("(c) ampd fp8's mean within ampd bf16's seed spread (docs/fp8.md):")
    print()
    verdict, det = within("ampd:fp8", "ampd:bf16")
    print("- %s vs ampd bf16: **%s**: %s" % (NAME["ampd:fp8"], verdict, det))
    print()
print("Raw results (one JSON record per run in results.jsonl, each run's stdout in runs/): "
      + out)
EOF
}

if [ "${1:-}" = --report ]; then
    shift
    [ $# -ge 1 ] || bench_die "usage: $BENCH --report DIR... (the CONV_OUT of runs)"
    for d in "$@"; do
        [ -f "$d/meta.json" ] || bench_die "$d: no meta.json (not the CONV_OUT of a run)"
    done
    report "$@"
    exit 0
fi

[[ $STEPS =~ ^[0-9]+$ && $STEPS -ge 1 ]] || bench_die "STEPS must be a positive integer"
if [[ $SEEDS_ARG =~ ^[0-9]+$ ]]; then
    [ "$SEEDS_ARG" -ge 1 ] || bench_die "SEEDS must be a count >= 1 or a comma list"
    SEEDS=$(seq 1 "$SEEDS_ARG" | paste -sd' ')
elif [[ $SEEDS_ARG =~ ^[0-9]+(,[0-9]+)*,?$ ]]; then
    SEEDS=$(tr ',' ' ' <<<"$SEEDS_ARG" | xargs)
else
    bench_die "SEEDS must be a count (5) or a comma list of seeds (1,2; one seed: 7,)"
fi
[[ $EVAL_EVERY =~ ^[0-9]+$ ]] || bench_die "CONV_EVAL_EVERY must be an integer >= 0"
[[ $MODEL_CHECK =~ ^[0-9]+$ ]] || bench_die "CONV_MODEL_CHECK must be an integer >= 0"
LIMIT=${CONV_TIMEOUT:-$((600 + 10 * STEPS))}
[[ $LIMIT =~ ^[0-9]+$ && $LIMIT -ge 1 ]] || bench_die "CONV_TIMEOUT must be a positive integer"
case $TORCH_BF16 in auto | run | skip) ;; *) bench_die "CONV_TORCH_BF16 must be auto, run or skip" ;; esac
for v in $VARIANTS; do
    case $v in ampd:fp32 | ampd:fp16 | ampd:bf16 | ampd:fp8 | torch:fp32 | torch:bf16) ;;
    *) bench_die "CONV_VARIANTS: $v is not one of ampd:fp32 ampd:fp16 ampd:bf16 ampd:fp8 torch:fp32 torch:bf16" ;;
    esac
done
for f in "$AMPD" "$BATCHES"; do
    [ -x "$f" ] || bench_die "$f not found: run make first (or set AMPD / BATCHES)"
done
command -v timeout >/dev/null || bench_die "timeout (coreutils) not found"
DATA_PATH=$DATA_ROOT/$DATA
[ -e "$DATA_PATH" ] || bench_die "$DATA_PATH not found (apt-get install fortunes, or set CONV_DATA_ROOT / CONV_DATA)"
case " $VARIANTS " in
*" torch:"*)
    "$PY" -c 'import torch' 2>/dev/null ||
        bench_die "PyTorch missing in $PY: apt-get install python3-torch (or set PYTHON)"
    ;;
esac
"$PY" -c 'import numpy' 2>/dev/null || bench_die "numpy missing in $PY: apt-get install python3-numpy"

TMP=$(mktemp -d)
BENCH_CHILD=
trap bench_cleanup EXIT
trap bench_interrupted INT TERM
OUT=${CONV_OUT:-$(mktemp -d /tmp/convergence.XXXXXX)}
mkdir -p "$OUT/runs"
: >"$OUT/results.jsonl"
T_BEGIN=$(date +%s)

# torch:bf16 on a CPU without native bf16
SKIPPED=
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2- || true) "
run_variants=
for v in $VARIANTS; do
    if [ "$v" = torch:bf16 ]; then
        if [ "$TORCH_BF16" = skip ]; then
            SKIPPED="torch:bf16 (CONV_TORCH_BF16=skip)"
            continue
        fi
        if [ "$TORCH_BF16" = auto ] && [[ $cpu_flags != *" avx512_bf16 "* ]]; then
            SKIPPED="torch:bf16: this CPU has no AVX512_BF16 (its flags lack avx512_bf16), where PyTorch 1.13's bf16 autocast takes 17-30 s a step (bench/gpt.sh); CONV_TORCH_BF16=run runs it anyway"
            bench_progress "skipping $SKIPPED"
            continue
        fi
    fi
    run_variants="$run_variants $v"
done

# what the report needs besides the runs
"$PY" - "$OUT/meta.json" "$(bench_cpu | sed 's/ ([^()]*)$//')" \
    "$("$AMPD" version 2>/dev/null | sed 1d | paste -sd ';' | sed 's/;/; /g' || true)" \
    "$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo unknown)" \
    "$STEPS" "$SEEDS" "$run_variants" "$SKIPPED" "$LIMIT" "$DATA_PATH" "$EVAL_EVERY" \
    "$BENCH${*:+ $*}" <<'EOF'
import json, sys
(path, cpu, engine, torch_ver, steps, seeds, variants, skipped, limit, data_path, every,
 command) = sys.argv[1:]
FLAGS = ("avx2", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
try:
    have = next(set(l.split(":", 1)[1].split()) for l in open("/proc/cpuinfo")
                if l.startswith("flags"))
except (OSError, StopIteration):
    have = set()
cpu += "; of the flags that matter here it has %s and lacks %s" % (
    ", ".join(f for f in FLAGS if f in have) or "none",
    ", ".join(f for f in FLAGS if f not in have) or "none")
with open(path, "w") as f:
    json.dump({"cpu": cpu, "engine": engine, "torch": torch_ver, "steps": int(steps),
               "seeds": [int(x) for x in seeds.split()], "variants": variants.split(),
               "skipped": skipped, "limit": int(limit), "data_path": data_path,
               "eval_every": int(every), "command": command}, f, indent=1)
EOF

# ---- the data order: ampd's loader and sampler vs the port, batch for batch ---------------
STATS=$OUT/stats.json
"$PY" "$HERE/torch_convergence.py" --data "$DATA_PATH" --val-fraction "$VAL_FRACTION" \
    --seq-len "$SEQ_LEN" --batch "$BATCH" --stats >"$STATS" ||
    bench_die "torch_convergence.py --stats failed"
for seed in $SEEDS; do
    "$BATCHES" --val-fraction "$VAL_FRACTION" "$DATA_PATH" "$SEQ_LEN" "$BATCH" "$seed" \
        "1-$STEPS" >"$TMP/batches.c.txt" || bench_die "$BATCHES failed"
    "$PY" "$HERE/torch_convergence.py" --data "$DATA_PATH" --val-fraction "$VAL_FRACTION" \
        --seq-len "$SEQ_LEN" --batch "$BATCH" --seed "$seed" --batches "1-$STEPS" \
        >"$TMP/batches.py.txt" || bench_die "torch_convergence.py --batches failed"
    "$PY" - "$TMP/batches.c.txt" "$TMP/batches.py.txt" "$seed" <<'EOF' || exit 1
import sys
c_path, py_path, seed = sys.argv[1:]
def lines(p):
    return [l.split() for l in open(p) if not l.startswith("#")]
c, py = lines(c_path), lines(py_path)
for i, (a, b) in enumerate(zip(c, py)):
    if a[0] == "batch" and b[0] == "batch" and a[1:3] == b[1:3]:
        if a[3] != b[3]:
            sys.exit("bench/convergence.sh: seed %s step %s batch row %s differs: ampd's window "
                     "hashes to %s, the port's (start %s) to %s" % (seed, a[1], a[2], a[3],
                                                                 b[4], b[3]))
    elif a != b:
        sys.exit("bench/convergence.sh: seed %s: ampd's %r, the port's %r" % (
            seed, " ".join(a), " ".join(b)))
if len(c) != len(py):
    sys.exit("bench/convergence.sh: seed %s: ampd listed %d lines, the port %d" % (
        seed, len(c), len(py)))
EOF
done
bench_progress "data order: bench/batches and the port agree on steps 1-$STEPS of seeds $SEEDS and on the validation windows"

# ---- the model: PyTorch from ampd's initial weights, on the same batches ------------------
# ampd_spec NAME DTYPE SEED STEPS LR EVAL_EVERY: a job spec in $TMP/NAME.json
ampd_spec() {
    conv_spec "conv-$1" "$2" "$3" "$4" "$5" "$6" "$DATA" >"$TMP/$1.json"
}

if [ "$MODEL_CHECK" -gt 0 ] && [[ " $run_variants " == *" torch:"* ]]; then
    seed=${SEEDS%% *}
    bench_progress "model check: PyTorch fp32 from ampd's initial weights (seed $seed), $MODEL_CHECK steps ..."
    # ampd's init in a checkpoint: one step at lr 1e-30 moves no weight by more than 1e-30
    mkdir -p "$TMP/ck"
    ampd_spec init fp32 "$seed" 1 1e-30 0
    bench_timed 600 "$TMP/init.out" "$TMP/init.err" "$AMPD" run --checkpoint-dir "$TMP/ck" \
        --data-root "$DATA_ROOT" "$TMP/init.json"
    if [ "$BENCH_STATUS" != ok ] || [ ! -f "$TMP/ck/ckpt-1.safetensors" ]; then
        bench_die "model check: ampd's init checkpoint: $BENCH_STATUS: $(tail -n 3 "$TMP/init.err")"
    fi
    ampd_spec check fp32 "$seed" "$MODEL_CHECK" "$LR" 0
    bench_timed 600 "$TMP/check.ampd" "$TMP/check.err" "$AMPD" run --every 1 \
        --data-root "$DATA_ROOT" "$TMP/check.json"
    [ "$BENCH_STATUS" = ok ] || bench_die "model check: ampd: $BENCH_STATUS: $(tail -n 3 "$TMP/check.err")"
    bench_timed 600 "$TMP/check.torch" "$TMP/check.err" "$PY" "$HERE/torch_convergence.py" \
        --data "$DATA_PATH" --val-fraction "$VAL_FRACTION" --seq-len "$SEQ_LEN" \
        --batch "$BATCH" --n-layer "$N_LAYER" --d-model "$D_MODEL" --n-head "$N_HEAD" \
        --seed "$seed" --mode fp32 --steps "$MODEL_CHECK" --lr "$LR" --no-eval --log-steps \
        --init-from "$TMP/ck/ckpt-1.safetensors"
    [ "$BENCH_STATUS" = ok ] || bench_die "model check: PyTorch: $BENCH_STATUS: $(tail -n 3 "$TMP/check.err")"
    "$PY" - "$TMP/check.ampd" "$TMP/check.torch" "$seed" "$MODEL_CHECK" "$OUT/model_check.json" <<'EOF' || exit 1
import json, sys
a_path, t_path, seed, steps, out = sys.argv[1:]
def losses(p):
    return {o["step"]: o["loss"] for o in map(json.loads, open(p)) if o.get("type") == "step"}
a, t = losses(a_path), losses(t_path)
worst = (0.0, 0)
for k in range(1, int(steps) + 1):
    if k not in a or k not in t:
        sys.exit("bench/convergence.sh: model check: no loss of step %d" % k)
    rel = abs(t[k] - a[k]) / abs(a[k])
    if rel > 1e-6:
        sys.exit("bench/convergence.sh: model check: from ampd's initial weights (seed %s) "
                 "PyTorch's loss at step %d is %.7f, ampd's %.7f (relative difference %.1e, "
                 "more than 1e-6): the two sides do not train the same model" % (
                     seed, k, t[k], a[k], rel))
    worst = max(worst, (rel, k))
with open(out, "w") as f:
    json.dump({"seed": int(seed), "steps": int(steps), "max_rel": worst[0],
               "at_step": worst[1], "ampd": [a[k] for k in sorted(a)],
               "torch": [t[k] for k in sorted(t)]}, f)
print("bench/convergence.sh: model check: PyTorch's losses are ampd's within %.1e (step %d)"
      % worst, file=sys.stderr)
EOF
fi

# ---- the runs -----------------------------------------------------------------------------
# run_record IMPL DTYPE SEED OUT ERR WALL: one record of results.jsonl from a finished run
run_record() {
    local line
    line=$("$PY" - "$@" "$BENCH_STATUS" "$BENCH_LIMIT" "$STATS" "$DATA_PATH" "$STEPS" <<'EOF'
import json, sys
impl, dt, seed, out, err, wall, status, limit, stats, data_path, steps = sys.argv[1:]
want = json.load(open(stats))["eval_count"]
rec = {"impl": impl, "dtype": dt, "seed": int(seed), "status": status, "limit": int(limit),
       "wall_s": round(float(wall), 1), "evals": []}
summ = start = None
with open(out, errors="replace") as f:
    for l in f:
        try:
            o = json.loads(l)
        except ValueError:
            continue
        if o.get("type") == "eval":
            rec["evals"].append({"step": o["step"], "loss": o["eval_loss"],
                                 "acc": o["eval_acc"], "count": o["count"]})
        elif o.get("type") == "summary":
            summ = o
        elif o.get("type") == "start":
            start = o
why = None
bad = [e for e in rec["evals"] if e["count"] != want]
if bad:
    why = "eval count %d at step %d, the port evaluates %d" % (bad[0]["count"], bad[0]["step"], want)
elif impl == "ampd" and start and start["spec"]["data"]["train"] != data_path:
    why = "ampd read %s, the port %s" % (start["spec"]["data"]["train"], data_path)
elif status == "ok":
    if summ is None:
        why = "no summary line"
    elif summ.get("status") != "succeeded":
        why = "run %s: %s" % (summ.get("status"), summ.get("error", ""))
    elif summ.get("steps") != int(steps):
        why = "%s steps, not %s" % (summ.get("steps"), steps)
if summ:
    rec["median_step_ms"] = summ.get("median_step_ms")
    for k in ("overflow_total", "skipped_total", "final_loss_scale", "final_loss"):
        if k in summ:
            rec[k] = summ[k]
if start and impl == "torch":
    rec["torch"] = start.get("torch")
    rec["threads"] = start.get("threads")
if why:
    rec["status"] = "failed"
    rec["why"] = why
if rec["status"] == "failed":
    with open(err, errors="replace") as f:
        rec["err"] = "\n".join([l for l in f.read().splitlines() if l.strip()][-6:])
print(json.dumps(rec))
EOF
    ) || line=$(printf '{"impl": "%s", "dtype": "%s", "seed": %d, "status": "failed", "evals": [], %s}' \
        "$1" "$2" "$3" '"why": "bench/convergence.sh: the record could not be written"')
    echo "$line" >>"$OUT/results.jsonl"
    bench_progress "$1:$2 seed $3: $("$PY" -c '
import json, sys
r = json.loads(sys.argv[1])
ev = " / ".join("%.3f" % e["loss"] for e in r["evals"])
s = {"timeout": "timeout (>%s s)" % r.get("limit"), "failed": "failed: %s" % r.get("why", "")}
print("%s in %s s; eval loss %s" % (s.get(r["status"], "ok"), r.get("wall_s"), ev or "-"))' "$line")"
}

# run_one IMPL DTYPE SEED
run_one() {
    local impl=$1 dt=$2 seed=$3 name=$1-$2-seed$3 t0 t1
    bench_progress "$impl:$dt seed $seed: $STEPS steps (limit $LIMIT s) ..."
    t0=$(date +%s.%N)
    if [ "$impl" = ampd ]; then
        ampd_spec "$name" "$dt" "$seed" "$STEPS" "$LR" "$EVAL_EVERY"
        bench_timed "$LIMIT" "$OUT/runs/$name.jsonl" "$OUT/runs/$name.err" \
            "$AMPD" run --every 10 --data-root "$DATA_ROOT" "$TMP/$name.json"
    else
        bench_timed "$LIMIT" "$OUT/runs/$name.jsonl" "$OUT/runs/$name.err" \
            "$PY" "$HERE/torch_convergence.py" --data "$DATA_PATH" \
            --val-fraction "$VAL_FRACTION" --seq-len "$SEQ_LEN" --batch "$BATCH" \
            --n-layer "$N_LAYER" --d-model "$D_MODEL" --n-head "$N_HEAD" --seed "$seed" \
            --mode "$dt" --steps "$STEPS" --eval-every "$EVAL_EVERY" --lr "$LR"
    fi
    t1=$(date +%s.%N)
    run_record "$impl" "$dt" "$seed" "$OUT/runs/$name.jsonl" "$OUT/runs/$name.err" \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')"
}


for seed in $SEEDS; do
    for v in $run_variants; do
        run_one "${v%%:*}" "${v#*:}" "$seed"
    done
done
"$PY" - "$OUT/meta.json" "$(($(date +%s) - T_BEGIN))" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
m["total_s"] = int(sys.argv[2])
with open(sys.argv[1], "w") as f:
    json.dump(m, f, indent=1)
EOF
report "$OUT"
bench_progress "results kept in $OUT (meta.json, stats.json, results.jsonl, runs/); $BENCH --report $OUT prints the tables again"
