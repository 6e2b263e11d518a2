#!/usr/bin/python3
"""torch_convergence.py - the PyTorch peer of bench/convergence.sh: ampd's GPT job trained
in PyTorch on the same data, in the same order, and evaluated on the same windows.

Runs with Debian's python3-torch 1.13 (/usr/bin/python3), on the CPU with
torch.set_num_threads(2). What is the same as an `ampd run` of the job:

  model     bench/torch_gpt.py's build(): ampd's GPT (pre-LN, fused qkv, GELU tanh, tied
            LM head; see there), in fp32 or under bf16 autocast (torch_gpt.py's modes).
  init      ampd's scheme (gpu_gpt_init_params in gpu/gpt.c; torch_common.gpt2_init_rule):
            the same distributions from torch's generator seeded with --seed, not the same
            values. Checked after the init: every constant tensor is its constant, every
            normal one has a sample mean and sd that fit its distribution. --init-from CKPT
            takes the weights of an ampd checkpoint instead (its fp32 tensors, ampd's names:
            wte, wpe, blocks.L.{ln1,attn.qkv,attn.proj,ln2,mlp.fc,mlp.proj}.{weight,bias},
            ln_f.*), for bench/convergence.sh's model check: trained from the same values on
            the same batches, the two sides' losses must agree until chaos parts them.
  optimizer AdamW lr --lr, betas (0.9, 0.999), eps 1e-8, weight decay 0, no clipping, no
            warmup, constant rate (ampd's defaults, docs/job-spec.md).
  data      a port of gpu/data.c: the text of --data (a file, or a directory's regular files
            not named .* or *.dat, in byte-wise name order, concatenated); the last
            llround(float(val_fraction) x n) bytes validate, the rest train; step k (from 1)
            draws row b at start mix64(h + (b + 1) g) % (ntrain - T), h = mix64(mix64(seed +
            g) + k g), g the golden-ratio constant, mix64 splitmix64's finaliser; inputs the
            T bytes from start, targets the next T.
  eval      a port of gpu/train.c's eval_gpt: use = min(nwin, 32 x batch) of the nwin =
            nval / (T + 1) non-overlapping windows, window j at j * nwin / use, in batches
            of --batch; loss = summed cross-entropy / positions, accuracy = argmax hits /
            positions, positions = use x T (ampd's "count"); every --eval-every steps and
            after the last step.

Modes (the job's commands, each prints JSON lines on stdout):
  --stats            {"type": "stats", "train_tokens", "val_tokens", "entropy" (nats, of
                     the training split's bytes), "p_max" (the most frequent byte's
                     frequency there), "top_byte", "eval_windows", "eval_used", "eval_count"}
  --batches STEP...  bench/batches's lines (see bench/batches.c) from the port, each "batch"
                     line with the window's start appended; neither needs torch
  --mode fp32|bf16   train: a "start" line, an "eval" line per evaluation ({"type": "eval",
                     "step", "eval_loss", "eval_acc", "count"}, as ampd's), a "summary" line
                     ({"status": "succeeded", "steps", "final_loss", "median_step_ms",
                     "train_s", "eval_s", ...}); with --log-steps a {"type": "step", "step",
                     "loss"} line per step; --no-eval: no evaluation; progress on stderr
                     with --verbose

Usage: torch_convergence.py --data PATH [--val-fraction F] [--seq-len T] [--batch B]
           [--n-layer L] [--d-model D] [--n-head H] [--seed S]
           (--stats | --batches STEP... | --mode fp32|bf16 [--steps N] [--eval-every E]
            [--lr LR] [--init-from CKPT] [--log-steps] [--no-eval] [--verbose])
"""
import argparse
import json
import math
import os
import stat
import struct
import sys
import time

import torch_common as tc
import torch_gpt

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="the text: a file or a directory")
    p.add_argument("--val-fraction", type=float, default=0.1, help="default 0.1")
    p.add_argument("--seq-len", type=int, default=128, help="default 128")
    p.add_argument("--batch", type=int, default=16, help="default 16")
    p.add_argument("--n-layer", type=int, default=4, help="default 4")
    p.add_argument("--d-model", type=int, default=256, help="default 256")
    p.add_argument("--n-head", type=int, default=4, help="default 4")
    p.add_argument("--seed", type=int, default=1, help="default 1")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--stats", action="store_true")
    g.add_argument("--batches", nargs="+", metavar="STEP")
    g.add_argument("--mode", choices=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=600, help="default 600")
    p.add_argument("--eval-every", type=int, default=100, help="default 100 (0: at the end)")
    p.add_argument("--lr", type=float, default=1e-3, help="default 1e-3")
    p.add_argument("--init-from", metavar="CKPT", help="an ampd checkpoint's weights")
    p.add_argument("--log-steps", action="store_true", help="a step line per step")
    p.add_argument("--no-eval", action="store_true", help="no evaluation")
    p.add_argument("--verbose", action="store_true", help="progress on stderr")
    a = p.parse_args()
    if min(a.seq_len, a.batch, a.n_layer, a.d_model, a.n_head, a.steps) < 1:
        p.error("every shape and --steps must be >= 1")
    if a.d_model % a.n_head:
        p.error("--d-model must be a multiple of --n-head")
    if a.eval_every < 0 or a.seed < 0:
        p.error("--eval-every and --seed must be >= 0")
    return a


# ---- the data: a port of gpu/data.c ----------------------------------------------------

def read_text(path):
    """The bytes gpu/data.c's read_text reads: a file's, or a directory's text files'."""
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            return f.read()
    parts = []
    names = sorted(n for n in os.listdir(os.fsencode(path))
                   if not n.startswith(b".") and not n.endswith(b".dat"))  # strcmp order
    for n in names:
        full = os.path.join(os.fsencode(path), n)
        if stat.S_ISREG(os.lstat(full).st_mode):  # symlinks and directories skipped
            with open(full, "rb") as f:
                parts.append(f.read())
    if not parts:
        raise SystemExit("torch_convergence: %s: no text files in it" % path)
    return b"".join(parts)


def llround(x):
    """C's llround for x >= 0: halves away from zero (Python's round() goes to even)."""
    n = math.floor(x)
    return n + 1 if x - n >= 0.5 else n


def split(data, val_fraction):
    """(train, val) as gpu/data.c's load_seq: the job spec's val_fraction is a C float."""
    vf = struct.unpack("f", struct.pack("f", val_fraction))[0]
    nv = llround(vf * len(data))
    if nv < 1 or len(data) - nv < 1:
        raise SystemExit("torch_convergence: %d bytes are too few to split off %g"
                         % (len(data), val_fraction))
    return data[:len(data) - nv], data[len(data) - nv:]


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def batch_starts(ntrain, seed, step, B, T):
    """The window starts gpu_dataset_sample_seq draws for (seed, step)."""
    starts = ntrain - T
    h = mix64((mix64((seed + GOLDEN) & M64) + step * GOLDEN) & M64)
    return [mix64((h + (b + 1) * GOLDEN) & M64) % starts for b in range(B)]


def eval_windows(nval, T, B):
    """(nwin, the window indices eval_gpt uses, in order)."""
    nwin = nval // (T + 1)
    use = min(nwin, 32 * B)
    return nwin, [j * nwin // use for j in range(use)]


def fnv(h, toks):
    for t in toks:
        h = ((h ^ t) * FNV_PRIME) & M64
    return h


def window_hash(h, buf, pos, T):
    """FNV-1a of the window at pos's inputs, then its targets (bench/batches.c's hash)."""
    return fnv(fnv(h, buf[pos:pos + T]), buf[pos + 1:pos + T + 1])


def parse_steps(specs):
    out = []
    for s in specs:
        a, _, b = s.partition("-")
        first, last = int(a), int(b or a)
        if first < 1 or last < first:
            raise SystemExit("torch_convergence: %s: not a step (>= 1) or a range FIRST-LAST" % s)
        out.extend(range(first, last + 1))
    return out


def cmd_batches(a, train, val):
    T, B = a.seq_len, a.batch
    print("# torch_convergence: %s (text), val_fraction %g, seq_len %d, batch %d, seed %d"
          % (a.data, a.val_fraction, T, B, a.seed))
    print("train_tokens %d" % len(train))
    print("val_tokens %d" % len(val))
    nwin, idx = eval_windows(len(val), T, B)
    h = FNV_OFFSET
    for i in idx:
        h = window_hash(h, val, i * (T + 1), T)
    print("eval %d %d %d %016x" % (nwin, len(idx), len(idx) * T, h))
    for k in parse_steps(a.batches):
        for b, s in enumerate(batch_starts(len(train), a.seed, k, B, T)):
            print("batch %d %d %016x %d" % (k, b, window_hash(FNV_OFFSET, train, s, T), s))


def cmd_stats(a, train, val):
    counts = _byte_counts(train)
    n = len(train)
    ent = -sum(c / n * math.log(c / n) for c in counts if c)
    top = max(range(256), key=lambda i: counts[i])
    nwin, idx = eval_windows(len(val), a.seq_len, a.batch)
    print(json.dumps({"type": "stats", "train_tokens": n, "val_tokens": len(val),
                      "entropy": ent, "p_max": counts[top] / n, "top_byte": top,
                      "eval_windows": nwin, "eval_used": len(idx),
                      "eval_count": len(idx) * a.seq_len}))


def _byte_counts(buf):
    import numpy as np
    return np.bincount(np.frombuffer(buf, dtype=np.uint8), minlength=256).tolist()


# ---- training -----------------------------------------------------------------------------

def check_init(model, n_layer):
    """Every parameter as gpt2_init_rule says: constants exact, normals' sample mean within 5
    standard errors of 0 and sample sd within 5% of the rule's. Returns the tensors checked."""
    import torch
    n = 0
    for name, p in model.named_parameters():
        kind, v = tc.gpt2_init_rule(name, n_layer)
        x = p.detach().double()
        if kind == "const":
            ok = bool(torch.all(x == v))
        else:
            mean, sd = float(x.mean()), float(x.std())
            ok = abs(mean) < 5 * v / math.sqrt(x.numel()) and abs(sd / v - 1) < 0.05
        if not ok:
            raise SystemExit("torch_convergence: %s is not initialised as ampd's %s %g"
                             % (name, kind, v))
        n += 1
    return n


def ampd_name(name):
    """The ampd tensor name of one of bench/torch_gpt.py's parameters."""
    if name in ("wte.weight", "wpe.weight"):
        return name[:3]
    for t, a in ((".ln_1.", ".ln1."), (".ln_2.", ".ln2."), (".qkv.", ".attn.qkv."),
                 (".fc_proj.", ".mlp.proj."), (".proj.", ".attn.proj."), (".fc.", ".mlp.fc.")):
        if t in name:
            return name.replace(t, a)
    return name


def load_ampd_weights(model, path):
    """Copy an ampd checkpoint's fp32 weights (safetensors: an 8-byte little-endian header
    length, the JSON header, the little-endian tensors) into model; every parameter must
    be there with its shape."""
    import numpy as np
    import torch
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    hdr = json.loads(blob[8:8 + n])
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = hdr.get(ampd_name(name))
            if t is None or t["dtype"] != "F32" or list(t["shape"]) != list(p.shape):
                raise SystemExit("torch_convergence: %s: no F32 %s %s for %s" % (
                    path, ampd_name(name), list(p.shape), name))
            lo, hi = t["data_offsets"]
            a = np.frombuffer(blob, dtype="<f4", count=(hi - lo) // 4, offset=8 + n + lo)
            p.copy_(torch.from_numpy(a.copy()).view(p.shape))


def cmd_train(a, train, val):
    coretype = tc.setup_openblas("auto")
    wait_policy = tc.setup_omp("auto", a.mode, torch_gpt.OMP_AUTO)

    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(tc.THREADS)
    torch.manual_seed(a.seed)
    T, B, V = a.seq_len, a.batch, 256
    margs = argparse.Namespace(mode=a.mode, n_layer=a.n_layer, d_model=a.d_model,
                               n_head=a.n_head, seq_len=T, vocab=V, gelu="tanh")
    model = torch_gpt.build(margs)
    if a.init_from:
        load_ampd_weights(model, a.init_from)
        init = "the weights of " + a.init_from
    else:
        init = "ampd's scheme, %d tensors checked" % check_init(model, a.n_layer)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    tr = torch.from_numpy(np.frombuffer(train, dtype=np.uint8).astype(np.int64))
    va = torch.from_numpy(np.frombuffer(val, dtype=np.uint8).astype(np.int64))
    offs = torch.arange(T + 1)

    def windows(buf, starts):
        w = buf[torch.tensor(starts, dtype=torch.int64)[:, None] + offs]  # (b, T + 1)
        return w[:, :T].contiguous(), w[:, 1:].contiguous()

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.mode == "bf16")

    nwin, eidx = eval_windows(len(val), T, B)

    def evaluate(step):
        t0 = time.perf_counter()
        total, right = 0.0, 0
        model.eval()
        with torch.no_grad():
            for s in range(0, len(eidx), B):
                x, y = windows(va, [i * (T + 1) for i in eidx[s:s + B]])
                with autocast():
                    logits = model.logits(x)
                logits = logits.float()
                total += float(F.cross_entropy(logits.view(-1, V), y.reshape(-1),
                                               reduction="sum"))
                right += int((logits.argmax(-1) == y).sum())
        model.train()
        count = len(eidx) * T
        tc.report({"type": "eval", "step": step, "eval_loss": total / count,
                   "eval_acc": right / count, "count": count})
        return time.perf_counter() - t0

    tc.report({"type": "start", "impl": "pytorch", "mode": a.mode, "seed": a.seed,
               "steps": a.steps, "params": sum(p.numel() for p in params),
               "init": init, "train_tokens": len(train), "val_tokens": len(val),
               "eval_windows": nwin, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "openblas_coretype": coretype,
               "omp_wait_policy": wait_policy.lower()})
    times, eval_s, loss = [], 0.0, float("nan")
    t_start = time.perf_counter()
    for k in range(1, a.steps + 1):
        x, y = windows(tr, batch_starts(len(train), a.seed, k, B, T))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast():
            out = model(x, y)
        out.backward()
        opt.step()
        loss = float(out)
        times.append((time.perf_counter() - t0) * 1e3)
        if a.log_steps:
            tc.report({"type": "step", "step": k, "loss": loss})
        if not math.isfinite(loss):
            tc.report({"type": "summary", "status": "failed", "steps": k,
                       "error": "loss %r at step %d" % (loss, k)})
            sys.exit(1)
        if a.verbose and k % 10 == 0:
            print("torch_convergence: %s seed %d step %d loss %.4f %.0f ms"
                  % (a.mode, a.seed, k, loss, times[-1]), file=sys.stderr, flush=True)
        if not a.no_eval and ((a.eval_every and k % a.eval_every == 0) or k == a.steps):
            eval_s += evaluate(k)
    tc.report({"type": "summary", "status": "succeeded", "impl": "pytorch", "mode": a.mode,
               "seed": a.seed, "steps": a.steps, "final_loss": loss,
               "median_step_ms": tc.median(times),
               "train_s": time.perf_counter() - t_start - eval_s, "eval_s": eval_s})


def main():
    a = parse_args()
    train, val = split(read_text(a.data), a.val_fraction)
    if len(train) < a.seq_len + 1:
        raise SystemExit("torch_convergence: %d training tokens, fewer than seq_len + 1"
                         % len(train))
    if a.stats:
        cmd_stats(a, train, val)
    elif a.batches:
        cmd_batches(a, train, val)
    else:
        cmd_train(a, train, val)


if __name__ == "__main__":
    main()
