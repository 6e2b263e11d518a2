#!/usr/bin/python3
"""torch_mlp.py - the PyTorch peer of ampd's MLP benchmark (bench/mlp.sh runs both).

Runs with Debian's python3-torch 1.13 (/usr/bin/python3, not a pyenv python3), on the CPU
with torch.set_num_threads(2). One training step of the MLP 784-1024-1024-10 (ReLU),
cross-entropy, AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0 as in ampd's
job spec; no gradient clipping), batch 256, is timed with time.perf_counter:
zero_grad(set_to_none=True), forward, backward, optimizer step (and for fp16 the scaler's
check, unscale and update). The median over --steps timed steps after --warmup untimed
ones is printed as one JSON line:
  {"impl": "pytorch", "mode": ..., "median_step_ms": ..., "steps": ..., "torch": ...,
   "threads": 2, "openblas_coretype": ..., "omp_wait_policy": ...}

Data: random inputs of the right shape (standard normal x[256, 784], uniform labels in
0..9), 8 fixed batches drawn once with a fixed seed and cycled, so that no data loading or
random generation is timed. Speed does not depend on the values.

Modes:
  fp32  plain fp32 training.
  bf16  torch.autocast("cpu", dtype=torch.bfloat16) around forward and loss (the only
        dtype torch 1.13's CPU autocast supports); linears run in bf16 through oneDNN,
        cross-entropy in fp32, fp32 parameters updated by AdamW; no loss scaling (as
        PyTorch and ampd do for bf16).
  fp16  AN EMULATION: torch 1.13 cannot autocast fp16 on the CPU and has no fp16 CPU
        matmul, and GradScaler is CUDA-only there. So the AMP numerics are reproduced the
        way ampd's CPU backend does them: before each linear its input, weight and bias are
        rounded through fp16 (.half().float()), the product runs in fp32, and its output is
        rounded through fp16; the backward of those casts rounds the gradients through
        fp16 too (so a too-large scale overflows to inf). Cross-entropy runs in fp32. The
        loss is multiplied by a dynamic scale (init 65536, growth 2 every 2000 clean steps,
        backoff 0.5); after backward every gradient is checked for inf/NaN and unscaled,
        and AdamW steps only when all were finite. This is the closest fair peer: it does
        the same work ampd does on this machine; it is not a native PyTorch fp16 path.

OpenBLAS: as ampd, the kernel set comes from CPUID (--openblas-coretype auto, the default;
see bench/torch_common.py, which this script shares with bench/torch_gpt.py).

Threads: torch runs its elementwise ops on an OpenMP pool of 2 threads, but its fp32 GEMMs
in OpenBLAS's own 2 pthreads; on 2 cores, OpenMP workers spinning after each parallel
region steal the cores from OpenBLAS (measured here: fp32 step ~50 ms with libgomp's
default, ~31 ms with OMP_WAIT_POLICY=PASSIVE). bf16's GEMMs run in oneDNN on the OpenMP
pool itself and are faster with the default (~32 vs ~40 ms). So --omp-wait-policy auto
(the default) sets OMP_WAIT_POLICY=PASSIVE for fp32 and fp16 and leaves it unset for bf16,
unless it is already set: each mode gets its best setting.

Usage: torch_mlp.py --mode fp32|bf16|fp16 [--steps N] [--warmup W]
                    [--openblas-coretype auto|none|NAME]
                    [--omp-wait-policy auto|default|active|passive] [--verbose]
"""
import argparse
import sys

import torch_common as tc

BATCH = 256
LAYERS = (784, 1024, 1024, 10)
OMP_AUTO = {"fp32": "passive", "fp16": "passive", "bf16": "default"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tc.add_common_args(p, steps=50, warmup=5, omp_auto=OMP_AUTO)
    a = p.parse_args()
    tc.check_common_args(p, a)
    return a


def main():
    args = parse_args()
    coretype = tc.setup_openblas(args.openblas_coretype)
    wait_policy = tc.setup_omp(args.omp_wait_policy, args.mode, OMP_AUTO)

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(tc.THREADS)
    torch.manual_seed(1)

    model = torch.nn.Sequential(
        torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.ReLU(),
        torch.nn.Linear(LAYERS[1], LAYERS[2]), torch.nn.ReLU(),
        torch.nn.Linear(LAYERS[2], LAYERS[3]))
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    batches = [(torch.randn(BATCH, LAYERS[0]), torch.randint(0, LAYERS[-1], (BATCH,)))
               for _ in range(8)]
    r16 = tc.r16

    def forward_fp16(x):
        h = x
        for i, lin in enumerate(linears):
            h = r16(F.linear(r16(h), r16(lin.weight), r16(lin.bias)))
            if i + 1 < len(linears):
                h = F.relu(h)
        return h

    scaler = tc.LossScaler()

    def step_fp32(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    def step_bf16(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    def step_fp16(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward_fp16(x), y)  # fp32 loss on fp16-rounded logits
        scaler.backward_and_step(loss, params, opt)
        return loss

    step = {"fp32": step_fp32, "bf16": step_bf16, "fp16": step_fp16}[args.mode]
    times, loss = tc.time_steps(step, batches, args.warmup, args.steps)
    if args.verbose:
        print(f"torch_mlp: mode {args.mode} final loss {float(loss):.4f} "
              f"scale {scaler.scale:g} skipped {scaler.skipped}", file=sys.stderr)
    tc.report({"impl": "pytorch", "mode": args.mode,
               "median_step_ms": round(tc.median(times), 3),
               "steps": args.steps, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "openblas_coretype": coretype,
               "omp_wait_policy": wait_policy.lower()})


if __name__ == "__main__":
    main()
