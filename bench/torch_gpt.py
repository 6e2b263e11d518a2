#!/usr/bin/python3
"""torch_gpt.py - the PyTorch peer of ampd's GPT benchmark (bench/gpt.sh runs both).

Runs with Debian's python3-torch 1.13 (/usr/bin/python3, not a pyenv python3), on the CPU
with torch.set_num_threads(2). The model is ampd's GPT: a GPT-2-style pre-LN decoder with
n_layer 4, d_model 256, n_head 4, seq_len 128, vocab 256 by default —

  token embedding (vocab x d) + learned position embedding (seq_len x d);
  per block: x += proj(attention(ln_1(x))); x += fc_proj(gelu_tanh(fc(ln_2(x))))
    with one fused qkv Linear(d, 3d), proj Linear(d, d), fc Linear(d, 4d),
    fc_proj Linear(4d, d), all with biases, LayerNorm eps 1e-5 with weight and bias;
  attention written out (torch 1.13 has no F.scaled_dot_product_attention):
    scores = (q @ k^T) * 1/sqrt(head_dim), masked_fill(future, -1e9), softmax in fp32,
    @ v, heads concatenated;
  final LayerNorm; LM head = the token embedding's weight (tied, no bias); cross-entropy.

Initialisation ampd's (gpu_gpt_init_params, GPT-2's: bench/torch_common.py gpt2_init);
speed does not depend on it. build() is also bench/torch_convergence.py's model. AdamW lr 3e-4, betas (0.9, 0.999), eps 1e-8,
weight decay 0 (ampd's defaults), no gradient clipping. One training step is timed with
time.perf_counter: zero_grad(set_to_none=True), forward, backward, optimizer step (and for
fp16 the scaler's check, unscale and update). The median over --steps timed steps after
--warmup untimed ones is printed as one JSON line:
  {"impl": "pytorch", "model": "gpt", "mode": ..., "median_step_ms": ...,
   "tokens_per_s": ..., "steps": ..., "batch": ..., "seq_len": ..., "n_layer": ...,
   "d_model": ..., "n_head": ..., "vocab": ..., "gelu": ..., "params": ..., "torch": ...,
   "threads": 2,
   "openblas_coretype": ..., "omp_wait_policy": ...}
tokens_per_s = batch * seq_len / median step time.

Data: random tokens, 8 fixed batches of (batch, seq_len + 1) drawn once with a fixed seed
(inputs the first seq_len, targets the next seq_len) and cycled, so that no data loading or
random generation is timed. Speed does not depend on the values.

Modes:
  fp32  plain fp32 training.
  bf16  torch.autocast("cpu", dtype=torch.bfloat16) around forward and loss (the only
        dtype torch 1.13's CPU autocast supports): the linears and the attention matmuls
        run in bf16 through oneDNN; embeddings, layer norms (their input, the residual
        stream, is fp32), the attention softmax (asked for in fp32, as CUDA autocast does)
        and cross-entropy in fp32; GELU in bf16 (its input's dtype); fp32 parameters
        updated by AdamW; no loss scaling (as PyTorch and ampd do for bf16).
  fp16  AN EMULATION, as in bench/torch_mlp.py: torch 1.13 cannot autocast fp16 on the CPU,
        has no fp16 CPU matmul, and its GradScaler is CUDA-only. Every linear (the tied LM
        head included) and both attention matmuls round their inputs, weights and biases
        through fp16 (.half().float()), multiply in fp32 and round their output through
        fp16; GELU's output is rounded through fp16 (it runs in its input's dtype); the
        backward of those casts rounds the gradients through fp16 too (so a too-large
        scale overflows to inf). Embeddings, layer norms, the residual adds (fp32 + fp16
        promotes to fp32), softmax and cross-entropy stay in fp32. Dynamic loss scaling by
        hand (bench/torch_common.py: init 65536, growth 2 every 2000 clean steps, backoff
        0.5, skip on inf/NaN). The closest fair peer: the same work ampd does on this
        machine; not a native PyTorch fp16 path.

OpenBLAS and OpenMP: see bench/torch_common.py. The kernel set comes from CPUID as in ampd.
--omp-wait-policy auto picks, per mode, the policy measured fastest for this model on the
2-core machines (see OMP_AUTO below and the note there).

Usage: torch_gpt.py --mode fp32|bf16|fp16 [--steps N] [--warmup W] [--batch B]
                    [--seq-len T] [--n-layer L] [--d-model D] [--n-head H] [--vocab V]
                    [--gelu tanh|erf]
                    [--openblas-coretype auto|none|NAME]
                    [--omp-wait-policy auto|default|active|passive] [--verbose]
"""
import argparse
import math
import sys

import torch_common as tc

# OMP_WAIT_POLICY per mode for "auto". Measured on the shared 2-core machine (8 timed steps,
# default shapes, other jobs running, load ~4): passive vs default, in ms per step,
# fp32 1443/961 vs 2909/2203, bf16 1079/1663 vs 3079/4313, fp16 917/1759 vs 4262/3661.
# Spinning OpenMP workers cost far more than they save here, in every mode (unlike the
# MLP's bf16 on an idle machine), so passive throughout.
OMP_AUTO = {"fp32": "passive", "fp16": "passive", "bf16": "passive"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tc.add_common_args(p, steps=20, warmup=3, omp_auto=OMP_AUTO)
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--n-layer", type=int, default=4, help="blocks (default 4)")
    p.add_argument("--d-model", type=int, default=256, help="width (default 256)")
    p.add_argument("--n-head", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary (default 256)")
    p.add_argument("--gelu", choices=("tanh", "erf"), default="tanh",
                   help="GELU form: tanh (GPT-2's and ampd's, the default) or erf (exact)")
    a = p.parse_args()
    tc.check_common_args(p, a)
    if min(a.batch, a.seq_len, a.n_layer, a.d_model, a.n_head, a.vocab) < 1:
        p.error("every shape must be >= 1")
    if a.d_model % a.n_head:
        p.error("--d-model must be a multiple of --n-head")
    return a


def build(args):
    """The model, its parameters in ampd's order, and a forward(x, y) -> loss for the mode."""
    import torch
    import torch.nn.functional as F
    nn = torch.nn

    L, C, H, T, V = args.n_layer, args.d_model, args.n_head, args.seq_len, args.vocab
    hd = C // H
    scale = 1.0 / math.sqrt(hd)
    fp16 = args.mode == "fp16"
    gelu_form = "tanh" if args.gelu == "tanh" else "none"
    r16 = tc.r16

    def linear(x, w, b):
        if fp16:
            return r16(F.linear(r16(x), r16(w), None if b is None else r16(b)))
        return F.linear(x, w, b)

    def matmul(a, b, alpha=None):
        if fp16:  # alpha applied in fp32 before the one rounding (a GEMM's alpha)
            out = torch.matmul(r16(a), r16(b))
            return r16(out * alpha if alpha is not None else out)
        out = torch.matmul(a, b)
        return out * alpha if alpha is not None else out

    def gelu(x):
        y = F.gelu(x, approximate=gelu_form)
        return r16(y) if fp16 else y

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
            h = linear(self.ln_1(x), self.qkv.weight, self.qkv.bias)  # (B, T, 3C)
            q, k, v = h.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
            att = matmul(q, k.transpose(-2, -1), scale)  # (B, H, T, T)
            att = att.masked_fill(mask, -1e9)
            att = F.softmax(att, dim=-1, dtype=torch.float32)
            y = matmul(att, v)  # (B, H, T, hd)
            y = y.transpose(1, 2).reshape(B, T, C)
            x = x + linear(y, self.proj.weight, self.proj.bias)
            h = gelu(linear(self.ln_2(x), self.fc.weight, self.fc.bias))
            return x + linear(h, self.fc_proj.weight, self.fc_proj.bias)

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

        def logits(self, idx):
            """(B, T, V) logits of the B x T tokens idx (in the mode's dtype)."""
            x = self.wte(idx) + self.wpe(self.pos)
            for blk in self.blocks:
                x = blk(x, self.mask)
            return linear(self.ln_f(x), self.wte.weight, None)  # tied LM head

        def forward(self, idx, targets):
            logits = self.logits(idx)
            return F.cross_entropy(logits.view(-1, V).float(), targets.reshape(-1))

    return GPT()


def main():
    args = parse_args()
    coretype = tc.setup_openblas(args.openblas_coretype)
    wait_policy = tc.setup_omp(args.omp_wait_policy, args.mode, OMP_AUTO)

    import torch

    torch.set_num_threads(tc.THREADS)
    torch.manual_seed(1)
    model = build(args)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    B, T = args.batch, args.seq_len
    batches = []
    for _ in range(8):
        seq = torch.randint(0, args.vocab, (B, T + 1))
        batches.append((seq[:, :T].contiguous(), seq[:, 1:].contiguous()))
    scaler = tc.LossScaler()

    def step_fp32(x, y):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    def step_bf16(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    def step_fp16(x, y):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        scaler.backward_and_step(loss, params, opt)
        return loss

    step = {"fp32": step_fp32, "bf16": step_bf16, "fp16": step_fp16}[args.mode]
    times, loss = tc.time_steps(step, batches, args.warmup, args.steps)
    med = tc.median(times)
    if args.verbose:
        print(f"torch_gpt: mode {args.mode} final loss {float(loss):.4f} "
              f"(ln {args.vocab} = {math.log(args.vocab):.4f}) scale {scaler.scale:g} "
              f"skipped {scaler.skipped}", file=sys.stderr)
    tc.report({"impl": "pytorch", "model": "gpt", "mode": args.mode,
               "median_step_ms": round(med, 3),
               "tokens_per_s": round(B * T / (med / 1e3), 1),
               "steps": args.steps, "batch": B, "seq_len": T, "n_layer": args.n_layer,
               "d_model": args.d_model, "n_head": args.n_head, "vocab": args.vocab,
               "gelu": args.gelu,
               "params": sum(p.numel() for p in params), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "openblas_coretype": coretype,
               "omp_wait_policy": wait_policy.lower()})


if __name__ == "__main__":
    main()
