#!/usr/bin/env python3
"""torch_gpu.py - the PyTorch peer of ampd's GPU GPT benchmark (bench/gpu.sh runs both).

The model is ampd's GPT (gpu/gpt.c), a GPT-2-style pre-LN decoder, by default GPT-2 124M:
n_layer 12, d_model 768, n_head 12, seq_len 1024, vocab 50304 (GPT-2's 50257 padded to a
multiple of 128, as nanoGPT and llm.c do; the padded rows are ordinary rows of the tied
embedding, and the softmax runs over all 50304 logits, in ampd as here) —

  token embedding (vocab x d) + learned position embedding (seq_len x d);
  per block: x += proj(attention(ln_1(x))); x += fc_proj(gelu_tanh(fc(ln_2(x))))
    with one fused qkv Linear(d, 3d), proj Linear(d, d), fc Linear(d, 4d),
    fc_proj Linear(4d, d), all with biases, LayerNorm eps 1e-5 with weight and bias;
  causal attention, one of
    --attn sdpa (the default): torch.nn.functional.scaled_dot_product_attention(
        is_causal=True). On a GPU in bf16/fp16 PyTorch picks a FUSED kernel (FlashAttention,
        or its cuDNN / memory-efficient attention), which never writes the (B, H, T, T)
        score and probability matrices to memory: the peer of ampd's "attention": "flash"
        (gpu/cuda/cuda_attn.cu, FlashAttention-2), which bench/gpu.sh's 16-bit ampd runs use.
    --attn naive: the attention written out as ampd's "materialized" attention computes it:
        scores = (q @ k^T) * 1/sqrt(head_dim), masked_fill(future, -inf), softmax in fp32
        (the (B, H, T, T) probabilities are kept for backward), @ v; the peer of
        bench/gpu.sh's ampd-materialized run.
  final LayerNorm; LM head = the token embedding's weight (tied, no bias); cross-entropy
  in fp32 on the logits.

Initialisation as GPT-2/nanoGPT and ampd (gpu_gpt_init_params): weights normal(0, 0.02), the
two residual projections of each block normal(0, 0.02/sqrt(2 n_layer)), biases 0, layer
norms 1 and 0. Optimizer AdamW (default lr 6e-4, betas (0.9, 0.95), eps 1e-8, weight decay
0.1) on ONE parameter group: the decay applies to every parameter, biases and norms too,
because that is what ampd's job spec can express (nanoGPT/llm.c exempt 1-D parameters).
Fused AdamW (fused=True) where this torch has it, on CUDA; no gradient clipping; constant lr.

Modes:
  fp32  plain fp32, TF32 off (PyTorch's default for matmuls; checked, and reported in
        matmul_flags), as ampd's cuBLASLt GEMMs (CUBLAS_COMPUTE_32F, never TF32).
  bf16  torch.autocast(device_type, dtype=torch.bfloat16) around forward and loss; fp32
        parameters, gradients and AdamW state; no loss scaling.
  fp16  torch.autocast(device_type, dtype=torch.float16) + torch.amp.GradScaler (or
        torch.cuda.amp.GradScaler on an older torch): dynamic loss scaling with init 65536,
        growth 2 every 2000 clean steps, backoff 0.5 — PyTorch's defaults and ampd's.
  Reduced-precision reductions inside 16-bit GEMMs are turned off
  (allow_{fp16,bf16}_reduced_precision_reduction = False): ampd's GEMMs accumulate and
  split-K-reduce in fp32 only. Eager mode: no torch.compile, no CUDA graphs.

Timing: on CUDA, one pair of CUDA events around each training step (zero_grad(set_to_none),
forward, backward, optimizer step, and for fp16 the scaler's step and update), read after
one synchronize at the end, so the host is never made to wait inside the loop; on the CPU,
time.perf_counter. The first --warmup steps are not timed; the median of the --steps timed
ones is reported. Memory: torch.cuda.max_memory_allocated (and _reserved) since before the
model was built (the CUDA context itself is not counted).

Data: --data PATH reads an llm.c token shard (bench/gpu_tokens.py writes one): windows of
seq_len + 1 tokens at random positions (seeded), one batch per step, all drawn and moved to
the device before the first step. Without --data, random tokens.

Prints one JSON line:
  {"impl": "pytorch", "mode", "attn", "device", "gpu", "median_step_ms", "mean_step_ms",
   "min_step_ms", "wall_ms_per_step", "tokens_per_s", "steps", "warmup", "batch", "seq_len",
   "n_layer", "d_model", "n_head", "vocab", "params", "flops_per_token", "optimizer",
   "fused_adamw", "loss_first", "loss_last", "loss_scale_final", "mem": {...},
   "step_ms_all": [...], "torch": ..., "status": "ok" | "nonfinite" | "interrupted"}
("interrupted": stopped by SIGTERM; "steps" then counts the timed steps done.)
With --profile (CUDA only), the last warm-up step runs under torch.profiler and "profile"
holds its kernels' device time by kind: {"phases": [{"name", "ms", "calls"}...],
"top": the 12 longest kernels}, kinds by kernel name: attention (flash / fmha / efficient
attention / softmax kernels; a naive attention's two batched products count as gemm), gemm,
layernorm, gelu, loss (cross-entropy, log-softmax, nll), unscale and scaler (GradScaler),
optimizer (AdamW), other (elementwise, casts, copies, reductions).
flops_per_token = 6 * params + 12 * n_layer * seq_len * d_model (PaLM's / nanoGPT's; params
counts the tied embedding once and includes the position embedding).

CPU smoke test (any torch >= 1.13; fp16 on the CPU needs torch >= 2.3, sdpa >= 2.0):
  torch_gpu.py --device cpu --mode fp32 --attn naive --n-layer 1 --d-model 64 --n-head 2 \\
               --seq-len 16 --vocab 300 --batch 2 --steps 3 --warmup 1
"""
import argparse
import contextlib
import inspect
import json
import math
import signal
import statistics
import sys
import time
import warnings

import torch_common as tc


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("fp32", "fp16", "bf16"), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--attn", choices=("sdpa", "naive"), default="sdpa",
                   help="sdpa: fused (flash) attention; naive: the softmax materialised, "
                        "as ampd (default sdpa)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--n-layer", type=int, default=12, help="blocks (default 12)")
    p.add_argument("--d-model", type=int, default=768, help="width (default 768)")
    p.add_argument("--n-head", type=int, default=12, help="attention heads (default 12)")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary (default 50304)")
    p.add_argument("--data", help="an llm.c token shard (default: random tokens)")
    p.add_argument("--seed", type=int, default=1, help="init and batch positions (default 1)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--fused", choices=("auto", "on", "off"), default="auto",
                   help="fused AdamW: auto = on for CUDA when this torch has it")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--verbose", action="store_true", help="progress on stderr")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: the last warm-up step's kernel time by kind, under torch.profiler")
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if min(a.batch, a.seq_len, a.n_layer, a.d_model, a.n_head, a.vocab) < 1:
        p.error("every shape must be >= 1")
    if a.d_model % a.n_head:
        p.error("--d-model must be a multiple of --n-head")
    return a


def die(msg):
    """A run-time failure (not a usage error): one line on stderr, exit 1."""
    print(f"torch_gpu.py: {msg}", file=sys.stderr)
    sys.exit(1)


def set_matmul_flags(torch):
    """No TF32 in fp32 GEMMs and no reduced-precision reductions inside 16-bit GEMMs, as
    ampd's cuBLASLt GEMMs; returns the flags. TF32 is off by default for matmuls, and is
    turned off only when found on (torch >= 2.9 deprecates allow_tf32 for fp32_precision and
    may raise when the two APIs are mixed, so the flag is read, not written, by default)."""
    m = torch.backends.cuda.matmul
    flags = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if m.allow_tf32:
                m.allow_tf32 = False
            flags["allow_tf32"] = bool(m.allow_tf32)
    except RuntimeError as e:
        flags["allow_tf32"] = f"unknown: {e}"
    for k in ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        if hasattr(m, k):
            try:
                setattr(m, k, False)
                flags[k] = False
            except (RuntimeError, TypeError, ValueError) as e:
                flags[k] = f"not set: {e}"
    return flags


def flops_per_token(params, n_layer, seq_len, d_model):
    """PaLM's / nanoGPT's: 6 N for the weights' forward + backward, 12 L T d for attention."""
    return 6 * params + 12 * n_layer * seq_len * d_model


def build(args, torch):
    import torch.nn.functional as F
    nn = torch.nn

    L, C, H, T, V = args.n_layer, args.d_model, args.n_head, args.seq_len, args.vocab
    hd = C // H
    scale = 1.0 / math.sqrt(hd)
    naive = args.attn == "naive"

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=1e-5)
            self.qkv = nn.Linear(C, 3 * C)
            self.proj = nn.Linear(C, C)
            self.ln_2 = nn.LayerNorm(C, eps=1e-5)
            self.fc = nn.Linear(C, 4 * C)
            self.fc_proj = nn.Linear(4 * C, C)

        def forward(self, x, mask):
            B = x.shape[0]
            h = self.qkv(self.ln_1(x))  # (B, T, 3C)
            q, k, v = h.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
            if naive:
                att = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
                att = att.masked_fill(mask, float("-inf"))
                att = F.softmax(att, dim=-1, dtype=torch.float32)
                y = att @ v  # autocast: both operands in the low dtype
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(B, T, C)
            x = x + self.proj(y)
            return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.blocks = nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = nn.LayerNorm(C, eps=1e-5)
            self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).triu(1))
            self.register_buffer("pos", torch.arange(T))
            tc.gpt2_init(self, L)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(self.pos)
            for blk in self.blocks:
                x = blk(x, self.mask)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head
            return F.cross_entropy(logits.view(-1, V).float(), targets.reshape(-1))

    return GPT()


def load_batches(args, torch, nbatches):
    """nbatches (x, y) pairs of (batch, seq_len) int64 tokens on the CPU."""
    B, T = args.batch, args.seq_len
    g = torch.Generator().manual_seed(args.seed)
    if args.data is None:
        seq = torch.randint(0, args.vocab, (nbatches, B, T + 1), generator=g)
    else:
        import numpy as np
        hdr = np.fromfile(args.data, dtype="<i4", count=256)
        if hdr.size != 256 or hdr[0] != 20240520 or hdr[1] != 1:
            die(f"{args.data}: not an llm.c token shard (magic 20240520, version 1)")
        n = int(hdr[2])
        tok = np.fromfile(args.data, dtype="<u2", offset=1024)
        if tok.size != n:
            die(f"{args.data}: the header says {n} tokens, the file has {tok.size}")
        if n < T + 1:
            die(f"{args.data}: {n} tokens, fewer than seq_len + 1 = {T + 1}")
        if int(tok.max()) >= args.vocab:
            die(f"{args.data}: token {int(tok.max())} >= --vocab {args.vocab}")
        tok = torch.from_numpy(tok.astype(np.int64))
        pos = torch.randint(0, n - T, (nbatches, B), generator=g)
        seq = tok[pos.unsqueeze(-1) + torch.arange(T + 1)]
    return [(s[:, :T].contiguous(), s[:, 1:].contiguous()) for s in seq]


# kernel kinds of --profile: the first whose words appear in a kernel's name (lowercase)
KINDS = (("unscale", ("non_finite_check_and_unscale",)), ("scaler", ("amp_update_scale",)),
         ("optimizer", ("adam", "multi_tensor_apply")),
         ("attention", ("flash", "fmha", "attention", "softmax")),
         ("loss", ("cross_entropy", "nll_loss", "log_softmax")),
         ("layernorm", ("layer_norm", "layernorm")), ("gelu", ("gelu",)),
         ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "wgmma")))


def kernel_kind(name):
    low = name.lower()
    return next((k for k, words in KINDS if any(w in low for w in words)), "other")


def profile_step(torch, step, x, y):
    """One step under torch.profiler (CUDA activity): its kernels' device time by kind."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(x, y)
        torch.cuda.synchronize()
    kinds, kernels = {}, []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if not us:
            continue
        kind = kernel_kind(e.key)
        ms, calls = kinds.get(kind, (0.0, 0))
        kinds[kind] = (ms + us / 1e3, calls + e.count)
        kernels.append((us / 1e3, e.count, e.key[:160], kind))
    kernels.sort(reverse=True)
    return {"phases": [{"name": k, "ms": round(v[0], 4), "calls": v[1]}
                       for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])],
            "top": [{"ms": round(ms, 4), "calls": c, "kernel": n, "kind": k}
                    for ms, c, n, k in kernels[:12]]}


def make_scaler(torch, device):
    """PyTorch's GradScaler with its (and ampd's) defaults written out."""
    kw = dict(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device, **kw)
    if device == "cuda":
        return torch.cuda.amp.GradScaler(**kw)
    raise RuntimeError("fp16 on the CPU needs torch >= 2.3 (torch.amp.GradScaler('cpu'))")


def main():
    args = parse_args()
    import torch
    import torch.nn.functional as F

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        die("--device cuda: torch.cuda.is_available() is False")
    if args.attn == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
        die(f"--attn sdpa needs torch >= 2.0 (this is {torch.__version__}): use --attn naive")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    flags = {}
    if cuda:
        flags = set_matmul_flags(torch)
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()

    scaler = None
    if args.mode == "fp16":
        try:
            scaler = make_scaler(torch, args.device)
        except (RuntimeError, TypeError, AttributeError) as e:
            die(f"--mode fp16 --device {args.device}: {e}")
    total = args.warmup + args.steps
    batches = [(x.to(dev), y.to(dev)) for x, y in load_batches(args, torch, total)]
    torch.manual_seed(args.seed)
    model = build(args, torch).to(dev)
    params = list(model.parameters())
    nparams = sum(q.numel() for q in params)

    okw = dict(lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
               weight_decay=args.weight_decay)
    has_fused = "fused" in inspect.signature(torch.optim.AdamW.__init__).parameters
    fused = has_fused and (args.fused == "on" or (args.fused == "auto" and cuda))
    if args.fused == "on" and not has_fused:
        die(f"--fused on: torch {torch.__version__}'s AdamW has no fused implementation")
    opt = torch.optim.AdamW(params, **okw, **({"fused": True} if fused else {}))

    if args.mode == "fp32":
        autocast = contextlib.nullcontext
    else:
        low = torch.bfloat16 if args.mode == "bf16" else torch.float16

        def autocast():
            return torch.autocast(device_type=args.device, dtype=low)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = model(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss.detach()

    # SIGTERM (bench/gpu.sh's timeout) ends the loop after the current step; what was
    # timed by then is reported with status "interrupted".
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    losses, times = [], []
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(total)]
    wall0 = None
    done = 0
    profiled = None
    for i in range(total):
        if stop:
            break
        if i == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            wall0 = time.perf_counter()
        if cuda:
            ev[i][0].record()
            if args.profile and i == args.warmup - 1:  # an untimed step
                try:
                    profiled = profile_step(torch, lambda x, y: losses.append(step(x, y)),
                                            *batches[i])
                except Exception as e:  # optional: the timing goes on without it
                    profiled = {"error": f"{type(e).__name__}: {e}"}
            else:
                losses.append(step(*batches[i]))
            ev[i][1].record()
        else:
            t0 = time.perf_counter()
            losses.append(step(*batches[i]))
            times.append((time.perf_counter() - t0) * 1e3)
        done = i + 1
        if args.verbose and not cuda:
            print(f"torch_gpu: step {i + 1} loss {float(losses[-1]):.4f} {times[-1]:.1f} ms",
                  file=sys.stderr)
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in ev[:done]]
    timed = times[args.warmup:]
    if not timed:
        die(f"stopped by a signal after {done} of {total} steps, none of them timed")
    wall = (time.perf_counter() - wall0) * 1e3 / len(timed)
    med = statistics.median(timed)
    lossv = [float(v) for v in torch.stack(losses).float().cpu()]
    B, T = args.batch, args.seq_len
    P = nparams * 4
    mem = {"weights": P, "grads": P, "optimizer": 2 * P}
    if cuda:
        mem["peak_allocated"] = torch.cuda.max_memory_allocated()
        mem["peak_reserved"] = torch.cuda.max_memory_reserved()
    finite = all(math.isfinite(v) for v in lossv)
    if args.verbose:
        print(f"torch_gpu: {args.mode} {args.attn} on {args.device}: median {med:.3f} ms, "
              f"loss {lossv[0]:.4f} -> {lossv[-1]:.4f} (ln V = {math.log(args.vocab):.4f})",
              file=sys.stderr)
    print(json.dumps({
        "impl": "pytorch", "model": "gpt", "mode": args.mode, "attn": args.attn,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "status": "interrupted" if done < total else "ok" if finite else "nonfinite",
        "median_step_ms": round(med, 4),
        "mean_step_ms": round(statistics.mean(timed), 4),
        "min_step_ms": round(min(timed), 4),
        "wall_ms_per_step": round(wall, 4),
        "tokens_per_s": round(B * T / (med / 1e3), 1),
        "steps": len(timed), "warmup": args.warmup, "batch": B, "seq_len": T,
        "n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head,
        "vocab": args.vocab, "params": nparams,
        "flops_per_token": flops_per_token(nparams, args.n_layer, T, args.d_model),
        "optimizer": {"type": "adamw", "lr": args.lr, "betas": [args.beta1, args.beta2],
                      "eps": args.eps, "weight_decay": args.weight_decay},
        "fused_adamw": fused, "matmul_flags": flags,
        "loss_first": lossv[0], "loss_last": lossv[-1],
        "loss_scale_final": scaler.get_scale() if scaler is not None else None,
        "mem": mem,
        "step_ms_all": [round(t, 4) for t in times],
        "data": args.data or "random",
        "torch": torch.__version__,
        "profile": profiled,
    }), flush=True)


if __name__ == "__main__":
    main()
