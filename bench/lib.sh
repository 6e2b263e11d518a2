# shellcheck shell=bash
# bench/lib.sh - sourced by bench/mlp.sh and bench/gpt.sh, the side-by-side benchmarks of
# ampd and PyTorch: every run under `timeout`, the machine's fp32 GEMM rates measured by
# bench/sgemm in every round, one JSON record per run, and the Markdown tables.
# (bench/common.sh is the API benchmarks' daemon fixture; nothing is shared with it.)
#
# The sourcing script sets BENCH (its name, for messages), HERE (the bench/ directory), AMPD,
# SGEMM, PY, STEPS and ROUNDS, then calls bench_init with its default time limit. Every
# run's outcome is one JSON line in $TMP/results.jsonl:
#   {"kind": "ampd"|"torch"|"sgemm", "key": dtype or GEMM setting, "round": r,
#    "status": "ok"|"timeout"|"failed", "limit": s, ...what the run measured,
#    "why"/"err" (failed: the reason and the last lines of its stderr)}
# and bench_report turns the file into the tables.

# bench_init DEFAULT_TIMEOUT: check the tools and arguments; set TMP (removed on exit),
# BENCH_TIMEOUT (the limit of every ampd and PyTorch run, seconds), BENCH_SGEMM_TIMEOUT (of
# every bench/sgemm run: default 120) and WARMUP (the steps dropped at the start of every
# run, both sides: BENCH_WARMUP, default min(10, STEPS / 5)).
bench_init() {
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-$1}
    [[ $STEPS =~ ^[0-9]+$ && $STEPS -ge 1 ]] || bench_die "STEPS must be a positive integer"
    [[ $ROUNDS =~ ^[0-9]+$ && $ROUNDS -ge 1 ]] || bench_die "ROUNDS must be a positive integer"
    if ! [[ $BENCH_TIMEOUT =~ ^[0-9]+([.][0-9]+)?$ ]] ||
        awk -v l="$BENCH_TIMEOUT" 'BEGIN { exit !(l <= 0) }'; then
        bench_die "BENCH_TIMEOUT must be a positive number of seconds"
    fi
    BENCH_SGEMM_TIMEOUT=${BENCH_SGEMM_TIMEOUT:-120}
    [[ $BENCH_SGEMM_TIMEOUT =~ ^[0-9]+$ && $BENCH_SGEMM_TIMEOUT -ge 1 ]] ||
        bench_die "BENCH_SGEMM_TIMEOUT must be a positive integer (seconds)"
    WARMUP=${BENCH_WARMUP:-$((STEPS / 5 < 10 ? STEPS / 5 : 10))}
    [[ $WARMUP =~ ^[0-9]+$ && $WARMUP -lt $STEPS ]] ||
        bench_die "BENCH_WARMUP must be an integer below STEPS ($STEPS)"
    local f
    for f in "$AMPD" "$SGEMM"; do
        [ -x "$f" ] || bench_die "$f not found: run make first (or set AMPD / SGEMM)"
    done
    command -v timeout >/dev/null || bench_die "timeout (coreutils) not found"
    "$PY" -c 'import torch' 2>/dev/null ||
        bench_die "PyTorch missing in $PY: apt-get install python3-torch (or set PYTHON)"
    TMP=$(mktemp -d)
    BENCH_CHILD=
    trap bench_cleanup EXIT
    trap bench_interrupted INT TERM
    : >"$TMP/results.jsonl"
}

bench_die() {
    echo "$BENCH: $*" >&2
    exit 1
}

bench_cleanup() {
    if [ -n "${BENCH_CHILD:-}" ]; then kill -TERM "$BENCH_CHILD" 2>/dev/null || true; fi
    rm -rf "$TMP"
}

# ^C or a TERM stops the run in progress too (timeout puts it in a process group of its own,
# out of the terminal's reach).
bench_interrupted() {
    echo "$BENCH: interrupted" >&2
    exit 130
}

bench_progress() {
    echo "$BENCH: $*" >&2
}

# bench_timed LIMIT OUT ERR CMD...: run CMD with stdout in OUT, stderr in ERR, under
# `timeout -k 10 LIMIT`; sets BENCH_LIMIT = LIMIT and BENCH_STATUS = ok, timeout (the limit
# was reached: the command was sent TERM, and KILL 10 s later if still running) or failed
# (any other non-zero exit). Never fails itself.
bench_timed() {
    local out=$2 err=$3 rc=0 t0 t1
    BENCH_LIMIT=$1
    shift 3
    t0=$(date +%s.%N)
    timeout -k 10 "$BENCH_LIMIT" "$@" >"$out" 2>"$err" &
    BENCH_CHILD=$!
    wait "$BENCH_CHILD" || rc=$?
    BENCH_CHILD=
    t1=$(date +%s.%N)
    if [ "$rc" = 0 ]; then
        BENCH_STATUS=ok
    elif [ "$rc" = 124 ] || { [ "$rc" = 137 ] && awk -v a="$t0" -v b="$t1" -v l="$BENCH_LIMIT" \
        'BEGIN { exit !(b - a >= l) }'; }; then
        BENCH_STATUS=timeout
    else
        BENCH_STATUS=failed
        if [ "$rc" -gt 128 ]; then
            echo "exit status $rc (killed by signal $((rc - 128)))" >>"$err"
        else
            echo "exit status $rc" >>"$err"
        fi
    fi
}

# bench_record KIND KEY ROUND OUT ERR: parse the run's output (after bench_timed) into one
# JSON line of $TMP/results.jsonl, and say how it went on stderr. An ok run whose output
# lacks what it should hold (no summary, a summary that is not "succeeded", no step after the
# warm-up) becomes failed.
bench_record() {
    local line
    line=$("$PY" - "$1" "$2" "$3" "$BENCH_STATUS" "$BENCH_LIMIT" "$4" "$5" "$WARMUP" <<'EOF'
import json, statistics, sys
kind, key, rnd, status, limit, out, err, warm = sys.argv[1:]
rec = {"kind": kind, "key": key, "round": int(rnd), "status": status, "limit": limit}
with open(out, errors="replace") as f:
    lines = [l for l in f.read().splitlines() if l.strip()]
try:
    if status == "ok" and kind == "ampd":
        steps, summ = [], None
        for l in lines:
            o = json.loads(l)
            if o.get("type") == "step":
                steps.append(o)
            elif o.get("type") == "summary":
                summ = o
        if summ is None:
            raise ValueError("no summary line")
        if summ.get("status") != "succeeded":
            raise ValueError("run %s: %s" % (summ.get("status"), summ.get("error", "")))
        times = [s["step_ms"] for s in steps if s["step"] > int(warm)]
        if not times:
            raise ValueError("no step line after the warm-up")
        rec.update(ms=statistics.median(times), timed_steps=len(times), steps=summ["steps"],
                   summary_median_ms=summ["median_step_ms"], peak_mem=summ["peak_mem"])
    elif status == "ok" and kind == "torch":
        o = json.loads(lines[0])
        rec.update(ms=o["median_step_ms"], timed_steps=o["steps"], torch=o["torch"],
                   threads=o["threads"])
    elif status == "ok" and kind == "sgemm":
        vals = dict(l.split()[:2] for l in lines if not l.startswith(("#", " ")))
        rec.update(info=lines[0].lstrip("# "), best=float(vals["best_sgemm_gflops"]),
                   step=float(vals["step_sgemm_gflops"]), work=float(vals["step_gemm_gflop"]))
except (ValueError, KeyError, IndexError, TypeError) as e:
    rec["status"] = "failed"
    rec["why"] = str(e) if isinstance(e, ValueError) else "%s: %s" % (type(e).__name__, e)
if rec["status"] == "failed":
    with open(err, errors="replace") as f:
        rec["err"] = "\n".join([l for l in f.read().splitlines() if l.strip()][-6:])
print(json.dumps(rec))
EOF
    ) || line=$(printf '{"kind": "%s", "key": "%s", "round": %d, "status": "failed", %s}' \
        "$1" "$2" "$3" '"why": "bench/lib.sh: the record could not be written"')
    echo "$line" >>"$TMP/results.jsonl"
    bench_progress "round $3/$ROUNDS $1 $2: $("$PY" -c '
import json, sys
r = json.loads(sys.argv[1])
if r["status"] == "ok":
    print("%.2f ms" % r["ms"] if "ms" in r else
          "step shapes %.1f, best square %.1f GFLOP/s" % (r["step"], r["best"]))
elif r["status"] == "timeout":
    print("timeout (>%s s)" % r["limit"])
else:
    print("failed" + (": " + r["why"] if r.get("why") else ""))' "$line")"
}

# bench_sgemm_round ROUND SHAPES: bench/sgemm --shapes SHAPES twice, with AMPD_GEMM=openblas
# (OpenBLAS for every GEMM) and with AMPD_GEMM unset (the engine's automatic choice).
bench_sgemm_round() {
    local out=$TMP/sgemm.out err=$TMP/sgemm.err
    bench_timed "$BENCH_SGEMM_TIMEOUT" "$out" "$err" env AMPD_GEMM=openblas "$SGEMM" --shapes "$2"
    bench_record sgemm openblas "$1" "$out" "$err"
    bench_timed "$BENCH_SGEMM_TIMEOUT" "$out" "$err" env -u AMPD_GEMM "$SGEMM" --shapes "$2"
    bench_record sgemm auto "$1" "$out" "$err"
}

# bench_dtypes ROUND: fp32 fp16 bf16, rotated by the round, so that no dtype always runs
# first or last in its round (a machine that speeds up or slows down favours none of them).
bench_dtypes() {
    local all=(fp32 fp16 bf16) i
    for ((i = 0; i < 3; i++)); do echo "${all[(i + $1) % 3]}"; done
}

# bench_ampd ROUND DTYPE JOB [AMPD RUN ARGS...]: one `ampd run` of JOB, every step line kept.
bench_ampd() {
    local r=$1 dt=$2 job=$3
    shift 3
    bench_timed "$BENCH_TIMEOUT" "$TMP/ampd.out" "$TMP/ampd.err" "$AMPD" run "$@" "$job"
    bench_record ampd "$dt" "$r" "$TMP/ampd.out" "$TMP/ampd.err"
}

# bench_torch ROUND DTYPE SCRIPT [ARGS...]: one PyTorch run, the same STEPS, the first WARMUP
# of them untimed (torch_*.py's --warmup W --steps N runs W + N steps and times the N).
bench_torch() {
    local r=$1 dt=$2 script=$3
    shift 3
    bench_timed "$BENCH_TIMEOUT" "$TMP/torch.out" "$TMP/torch.err" "$PY" "$script" --mode "$dt" \
        --warmup "$WARMUP" --steps "$((STEPS - WARMUP))" "$@"
    bench_record torch "$dt" "$r" "$TMP/torch.out" "$TMP/torch.err"
}

# The CPU: model name, usable CPUs, and which of the features that 16-bit arithmetic uses
# it has.
bench_cpu() {
    local model flags f have=()
    model=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//') ||
        true
    if [ -z "$model" ]; then
        model=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n1) || true
    fi
    flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2- || true) "
    for f in avx2 fma f16c avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_fp16 amx_tile; do
        case $flags in *" $f "*) have+=("$f") ;; esac
    done
    echo "${model:-unknown CPU}, $(nproc) cores (${have[*]:-no avx2, fma, f16c, avx512, amx})"
}

# bench_report TITLE SHAPES GFLOP [NOTE...]: the title lines, the timing table, the sgemm
# rates of every round, the notes, every failure's stderr tail once, and the memory table.
# GFLOP is the step's GEMM work the GFLOP/s column divides by ampd's time; SHAPES is what
# bench/sgemm was given.
bench_report() {
    local engine torch
    engine=$("$AMPD" version 2>/dev/null | sed 1d | paste -sd ';' | sed 's/;/; /g') || true
    # the version, and the threads torch_*.py ask for (the report prefers what the runs said)
    torch=$(cd "$HERE" && "$PY" -c 'import torch, torch_common
print(torch.__version__, torch_common.THREADS)' 2>/dev/null) || torch="unknown ?"
    "$PY" - "$TMP/results.jsonl" "$1" "$(bench_cpu)" "$engine" "$torch" "$STEPS" "$WARMUP" \
        "$ROUNDS" "$BENCH_TIMEOUT" "$2" "$3" "${AMPD_GEMM-}" "${@:4}" <<'EOF'
import json, sys

(path, title, cpu, engine, torch_ver, steps, warm, rounds, limit, shapes, gflop,
 ampd_gemm) = sys.argv[1:13]
notes = sys.argv[13:]
steps, warm, rounds, gflop = int(steps), int(warm), int(rounds), float(gflop)
recs = [json.loads(l) for l in open(path)]
DTYPES = [d for d in ("fp32", "fp16", "bf16") if any(r["key"] == d for r in recs)]


def runs(kind, key):
    return [r for r in recs if r["kind"] == kind and r["key"] == key]


def best(kind, key):
    """The lowest-ms ok run, or None."""
    ok = [r for r in runs(kind, key) if r["status"] == "ok"]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def missing(kind, key):
    """The cell of a side with no ok run: timeout if any round timed out, else failed."""
    rs = runs(kind, key)
    t = [r for r in rs if r["status"] == "timeout"]
    if t:
        return "timeout (>%s s)" % t[0]["limit"]
    return "failed" if rs else "-"


def sgemm(rnd):
    """{"step": (rate, setting, info), "best": ...} of a round, the better of each figure."""
    res = {}
    for fig in ("step", "best"):
        ok = [r for r in recs if r["kind"] == "sgemm" and r["round"] == rnd and r["status"] == "ok"]
        if ok:
            r = max(ok, key=lambda r: r[fig])
            res[fig] = (r[fig], r["key"], r["info"])
    return res


partial = []  # (kind, dtype, rounds that were not ok)


def cell(kind, key):
    b = best(kind, key)
    if b is None:
        return missing(kind, key), None
    bad = [r for r in runs(kind, key) if r["status"] != "ok"]
    mark = ""
    if bad:
        partial.append((kind, key, bad))
        mark = " *"
    return "%.2f%s" % (b["ms"], mark), b


torch_ver, torch_threads = torch_ver.split()
threads = sorted({r["threads"] for r in recs if r["kind"] == "torch" and "threads" in r})
threads = threads or [torch_threads]
print(title)
print()
print("CPU: %s; ampd's engine: %s; PyTorch %s, %s thread%s" % (
    cpu, engine, torch_ver, "/".join(map(str, threads)) or "?",
    "" if threads in ([1], ["1"]) else "s"))
print()
print("Method:")
print()
print("- each run: %d training steps; its time is the median step time of steps %d..%d (the "
      "first %d are warm-up, dropped on both sides). ampd: the step_ms of its step lines (the "
      "per-step times its summary's median_step_ms is taken over, there over all steps); "
      "PyTorch: torch_*.py --warmup %d --steps %d (time.perf_counter around each step). ampd "
      "runs with AMPD_GEMM %s." % (
          steps, warm + 1, steps, warm, warm, steps - warm,
          "=" + ampd_gemm if ampd_gemm else "unset (automatic)"))
print("- rounds: %d round%s of sgemm, then ampd's three dtypes, then PyTorch's (the dtypes' "
      "order rotated from round to round); the table has each side's best (lowest) round, "
      "taken separately. Every ampd and PyTorch run is limited to "
      "%s s (`timeout`): past it, its cell says timeout and the ratios with it are -." % (
          rounds, "" if rounds == 1 else "s", limit))
print("- ampd GFLOP/s = %.6g GFLOP of GEMM work per step / ampd's time; \"ampd vs its fp32\" "
      "= ampd's time / ampd's fp32 time, both best rounds; \"same round\" = the median over "
      "the rounds of the dtype's time / the fp32 time of the same round, with the lowest and "
      "highest (on a machine whose speed drifts, the paired figure is the steadier)." % gflop)
print("- sgemm: right before each round's ampd runs, bench/sgemm --shapes %s ran twice "
      "(AMPD_GEMM=openblas, and unset: the engine's automatic choice), and the better result "
      "of each figure counts. step-shape sgemm = the step's GEMM work / the time its GEMMs "
      "take at their measured fp32 rates; best sgemm = the best of the squares 512, 1024, "
      "2048. Both %% columns use the round that dtype's best ampd run came from." % shapes)
print()
print("| dtype | ampd ms | PyTorch ms | PyTorch/ampd | ampd GFLOP/s | % of step-shape sgemm "
      "| % of best sgemm | ampd vs its fp32 | same round |")
print("|---|---|---|---|---|---|---|---|---|")
fp32 = best("ampd", "fp32")


def paired(dt):
    """Median (lowest-highest) over rounds of dt's time / fp32's time in the same round."""
    ok = lambda key, rnd: [r["ms"] for r in runs("ampd", key)
                           if r["round"] == rnd and r["status"] == "ok"]
    q = sorted(ok(dt, n)[0] / ok("fp32", n)[0] for n in range(1, rounds + 1)
               if ok(dt, n) and ok("fp32", n))
    if not q:
        return "-"
    mid = (q[(len(q) - 1) // 2] + q[len(q) // 2]) / 2
    return "%.2f (%.2f-%.2f)" % (mid, q[0], q[-1]) if len(q) > 1 else "%.2f" % mid


for dt in DTYPES:
    acell, a = cell("ampd", dt)
    tcell, t = cell("torch", dt)
    ratio = "%.2fx" % (t["ms"] / a["ms"]) if a and t else "-"
    rate = gflop / (a["ms"] / 1e3) if a else None
    sg = sgemm(a["round"]) if a else {}
    pct = lambda fig: "%.0f%%" % (100 * rate / sg[fig][0]) if rate and fig in sg else "-"
    vs32 = "%.2f" % (a["ms"] / fp32["ms"]) if a and fp32 else "-"
    print("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        dt, acell, tcell, ratio, "%.1f" % rate if rate else "-", pct("step"), pct("best"), vs32,
        paired(dt)))
print()
SETTING = {"openblas": "AMPD_GEMM=openblas", "auto": "AMPD_GEMM unset"}
lines = []
for rnd in range(1, rounds + 1):
    sg = sgemm(rnd)
    st = {r["key"]: r for r in recs if r["kind"] == "sgemm" and r["round"] == rnd}
    if not sg:
        why = ", ".join("%s: %s" % (SETTING[k], "timeout (>%s s)" % r["limit"]
                                     if r["status"] == "timeout" else r["status"])
                        for k, r in st.items())
        lines.append("round %d: no sgemm (%s)" % (rnd, why or "not run"))
        continue
    lines.append("round %d: step shapes %.1f (%s), best square %.1f (%s)" % (
        rnd, sg["step"][0], SETTING[sg["step"][1]], sg["best"][0], SETTING[sg["best"][1]]))
infos = sorted({"%s: %s" % (SETTING[r["key"]], r["info"])
                for r in recs if r["kind"] == "sgemm" and r["status"] == "ok"})
print("sgemm GFLOP/s per round (the GEMM setting that gave it): " + "; ".join(lines) +
      ((". Libraries: " + "; ".join(infos) + ".") if infos else "."))
works = {r["work"] for r in recs if r["kind"] == "sgemm" and r["status"] == "ok"}
for w in works:
    if abs(w - gflop) > 1e-6 * gflop:
        print()
        print("WARNING: bench/sgemm's step shapes add up to %.6f GFLOP, the GFLOP/s column "
              "counts %.6f: the two disagree." % (w, gflop))
for n in notes:
    print()
    print(n)
if partial:
    print()
    print("\\* best of the rounds that completed; the others: " + "; ".join(
        "%s %s round %s" % (k, d, ", ".join(
            "%d %s" % (r["round"], "timeout (>%s s)" % r["limit"] if r["status"] == "timeout"
                       else "failed") for r in bad)) for k, d, bad in partial) + ".")
groups = {}  # message -> the runs that failed with it, in order
for r in recs:
    if r["status"] == "failed":
        msg = "\n".join(x for x in (r.get("why", ""), r.get("err", "")) if x) or "(no output)"
        groups.setdefault(msg, []).append(r)
if groups:
    print()
    print("Failures (each distinct error once, with the runs that ended with it):")
    for msg, rs in groups.items():
        print()
        print("; ".join("%s %s round %d" % ({"torch": "PyTorch"}.get(r["kind"], r["kind"]),
                                             r["key"], r["round"]) for r in rs) + ":")
        print("```")
        print(msg)
        print("```")

print()
print("Peak memory of the ampd runs by category (the summary line's peak_mem, in MB = 10^6 "
      "bytes). PyTorch's is not measured: torch 1.13 keeps no allocation statistics on the "
      "CPU, and the process's peak RSS (interpreter, libraries, thread pools, the allocator's "
      "cache) is no peer of ampd's accounting.")
print()
CATS = ("weights", "master", "grads", "optimizer", "activations", "workspace", "total")
print("| dtype | " + " | ".join(CATS) + " | total / fp32 |")
print("|---|" + "---|" * (len(CATS) + 1))
for dt in DTYPES:
    a = best("ampd", dt)
    if a is None:
        print("| %s | %s |" % (dt, " | ".join([missing("ampd", dt)] + ["-"] * len(CATS))))
        continue
    m = a["peak_mem"]
    rel = "%.2f" % (m["total"] / fp32["peak_mem"]["total"]) if fp32 else "-"
    print("| %s | %s | %s |" % (dt, " | ".join("%.2f" % (m[c] / 1e6) for c in CATS), rel))
EOF
}
