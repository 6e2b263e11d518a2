"""torch_common.py - what the PyTorch peers of ampd's benchmarks share (bench/torch_mlp.py,
bench/torch_gpt.py): the OpenBLAS kernel choice, the OpenMP wait policy, the fp16
emulation's rounding and loss scaler, the timing loop and the JSON report line.

Nothing here imports torch at module level: OPENBLAS_CORETYPE and OMP_WAIT_POLICY must be
set (setup_openblas, setup_omp) before the first `import torch`, which loads OpenBLAS and
libgomp and reads them once.

OpenBLAS: Debian's torch does its fp32 GEMMs through libblas.so.3, which is OpenBLAS
(DYNAMIC_ARCH), and OpenBLAS's own CPU detection picks the slow generic "Prescott" kernels
on some AVX-512 machines. ampd chooses the kernel set from CPUID (gpu/blas.c); for a fair
comparison setup_openblas("auto") does the same by setting OPENBLAS_CORETYPE, unless it is
already set. "none" leaves OpenBLAS's detection.

OpenMP: torch runs its elementwise ops (and oneDNN's bf16 GEMMs) on an OpenMP pool, but its
fp32 GEMMs in OpenBLAS's own pthreads. On 2 cores, OpenMP workers spinning after each
parallel region steal the cores from OpenBLAS, so the best OMP_WAIT_POLICY depends on the
mode; each script measures and passes its own per-mode choice for "auto".

fp16 emulation: torch 1.13 cannot autocast fp16 on the CPU, has no fp16 CPU matmul, and its
GradScaler is CUDA-only. r16() rounds a tensor through fp16 (its backward rounds the
gradient through fp16 too, so a too-large scale overflows to inf), and LossScaler does
GradScaler's dynamic loss scaling by hand: scaled backward, one inf/NaN check over every
gradient, unscale, skip or step, then the scale update (init 65536, x2 after 2000 clean
steps if finite, x0.5 on overflow).
"""
import json
import os
import statistics
import time

THREADS = 2


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose_coretype():
    """The OpenBLAS kernel set ampd's gpu/blas.c picks for this CPU (None: OpenBLAS's)."""
    f = cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f
    if avx512 and "avx512_bf16" in f:
        return "Cooperlake"
    if avx512:
        return "SkylakeX"
    if {"avx2", "fma"} <= f:
        return "Haswell"
    return None


def add_common_args(p, steps, warmup, omp_auto):
    """--mode, --steps, --warmup, --openblas-coretype, --omp-wait-policy, --verbose.
    omp_auto maps each mode to the policy "auto" means (for the help text)."""
    p.add_argument("--mode", choices=("fp32", "bf16", "fp16"), required=True)
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup,
                   help=f"untimed steps first (default {warmup})")
    p.add_argument("--openblas-coretype", default="auto",
                   help="auto (from CPUID, as ampd), none, or an OpenBLAS core name")
    auto = ", ".join(f"{v} for {k}" for k, v in omp_auto.items())
    p.add_argument("--omp-wait-policy", default="auto",
                   choices=("auto", "default", "active", "passive"),
                   help=f"OMP_WAIT_POLICY; auto: {auto}")
    p.add_argument("--verbose", action="store_true", help="loss and scale on stderr")


def check_common_args(p, a):
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")


def setup_openblas(choice):
    """Set OPENBLAS_CORETYPE before torch loads OpenBLAS; return what is in effect."""
    if "OPENBLAS_CORETYPE" in os.environ:
        return os.environ["OPENBLAS_CORETYPE"]
    core = choose_coretype() if choice == "auto" else None if choice == "none" else choice
    if core is not None:
        os.environ["OPENBLAS_CORETYPE"] = core
    return core or "default"


def setup_omp(choice, mode, omp_auto):
    """Set OMP_WAIT_POLICY before torch loads libgomp; return what is in effect.
    "auto" takes omp_auto[mode] ("default", "active" or "passive")."""
    if "OMP_WAIT_POLICY" in os.environ:
        return os.environ["OMP_WAIT_POLICY"]
    if choice == "auto":
        choice = omp_auto[mode]
    if choice != "default":
        os.environ["OMP_WAIT_POLICY"] = choice.upper()
    return choice


def r16(t):
    """Round through fp16; its backward rounds the gradient through fp16 as well."""
    return t.half().float()


class LossScaler:
    """PyTorch GradScaler's dynamic loss scaling, by hand (see the top of this file)."""

    def __init__(self, init=65536.0, growth=2.0, backoff=0.5, interval=2000):
        self.scale, self.growth, self.backoff, self.interval = init, growth, backoff, interval
        self.tracker = 0
        self.skipped = 0

    def backward_and_step(self, loss, params, opt):
        """Scaled backward, inf/NaN check, unscale, optimizer step unless skipped, update."""
        import torch
        (loss * self.scale).backward()
        grads = [p.grad for p in params if p.grad is not None]
        found_inf = not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        if found_inf:
            self.skipped += 1
            self.scale *= self.backoff
            self.tracker = 0
            return
        torch._foreach_mul_(grads, float(1.0 / self.scale))
        opt.step()
        self.tracker += 1
        if self.tracker == self.interval:
            grown = self.scale * self.growth
            if grown != float("inf"):
                self.scale = grown
            self.tracker = 0


def time_steps(step, batches, warmup, steps):
    """Run warmup + steps calls of step(*batch), cycling batches; return (the timed steps'
    milliseconds, the last step's return value)."""
    times = []
    out = None
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        out = step(*batches[i % len(batches)])
        t1 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0) * 1e3)
    return times, out


def median(times):
    return statistics.median(times)


def report(fields):
    """Print the one JSON result line."""
    print(json.dumps(fields), flush=True)


def gpt2_init_rule(name, n_layer):
    """How ampd's gpu_gpt_init_params (gpu/gpt.c) initialises the GPT parameter called name
    (PyTorch's names, as bench/torch_gpt.py's model has them): ("const", value) for biases (0)
    and layer norms' weights (1), else ("normal", std): the residual projections (names
    ending in proj.weight: attn.proj, mlp.proj) 0.02 / sqrt(2 n_layer), every other weight,
    the token and position embeddings included, 0.02. No truncation; the LM head is the
    token embedding (tied), so it has no init of its own."""
    import math

    if name.endswith("bias"):
        return ("const", 0.0)
    if ".ln_" in name or name.startswith("ln_"):
        return ("const", 1.0)
    if name.endswith("proj.weight"):
        return ("normal", 0.02 / math.sqrt(2 * n_layer))
    return ("normal", 0.02)


def gpt2_init(model, n_layer):
    """GPT-2's initialisation of a GPT module, as ampd's gpu_gpt_init_params does it (the same
    distributions from torch's generator, not the same values): gpt2_init_rule."""
    import torch.nn as nn

    for name, p in model.named_parameters():
        kind, v = gpt2_init_rule(name, n_layer)
        if kind == "const":
            nn.init.constant_(p, v)
        else:
            nn.init.normal_(p, 0.0, v)
