#!/usr/bin/python3
"""torch_replay.py - continue an ampd fp32 MLP run in PyTorch from one of its checkpoints
and compare, step by step, with ampd's own continuation (bench/replay.sh runs both).

Runs with Debian's python3-torch 1.13 (/usr/bin/python3) and numpy. Input: the JSON lines
of `ampd run` (its start line carries the fully defaulted spec and the dataset paths, its
step lines the losses), the checkpoint of step K and the checkpoint of step K + N.

What it rebuilds from ampd's own definitions, not from the run's outputs:
  - the safetensors files, read directly (8-byte little-endian header length, the JSON
    header, the raw little-endian tensors): weights `fcL.weight` [out, in] and `fcL.bias`,
    the optimizer state `optim.exp_avg.*`, `optim.exp_avg_sq.*` (AdamW) or
    `optim.momentum_buffer.*` (SGD), `data.order` and the metadata (`applied`, `perm_pos`,
    `rng`);
  - the input normalisation of gpu/data.c: mean and variance of pixel / 255.0 summed in
    double in file order (measure_norm), mean and 1 / sqrt(var) rounded to float, and each
    input value (float)pixel * (inv_std / 255.0f) + (-mean * inv_std), every operation in
    float32 with its own rounding, as the C code does under -std=c11 (no contraction);
  - the batch order of gpu/train.c: the xoshiro256** generator of gpu/error.c seeded by
    splitmix64 with seed ^ 0xDA7A5EED, the Fisher-Yates shuffle with gpu_rng_below, and
    next_batch taking B consecutive entries of the permutation (reshuffling at its end).
    The port is checked against the checkpoint: the shuffle from the job's seed must give
    its `data.order` and its generator state `rng` (unless a reshuffle happened before K);
    the replay then continues from the checkpoint's permutation, position and generator.

The PyTorch side is plain PyTorch: nn.Sequential of nn.Linear (the checkpoint's weights,
no transposes) and ReLU, F.cross_entropy (mean), loss.backward(), and
torch.optim.AdamW / SGD(foreach=False) built with the spec's hyperparameters as Python
floats (the doubles ampd keeps), the optimizer state loaded from the checkpoint (`step`
= the checkpoint's `applied`). One thread; OpenBLAS's kernel set chosen as ampd chooses it
(bench/torch_common.py).

--constants float32 builds the optimizer instead with every hyperparameter first rounded
to float32 (lr, betas, eps, momentum, weight decay as Python floats holding float32
values): what an implementation that keeps them in float computes, the drift that ampd's
double constants remove.

--order ampd replaces nn.Linear's forward, F.cross_entropy and autograd by the operations
of gpu/mlp.c in its order (see ampd_order_step), with the same torch.optim: an ablation
that shows what is left when only PyTorch's operation order is taken away.

Output: one JSON object on stdout: the per-step losses of both (and, for the plain side,
the loss of its logits reduced in double as ampd reduces them), the step-(K+1) check, the
largest relative loss difference, and per tensor the final weights' differences with the
element that differs most and its exp_avg_sq.

Usage: torch_replay.py --run RUN.jsonl --ckpt CKPT_K --final CKPT_END
                       [--constants double|float32] [--order torch|ampd] [--threads 1]
"""
import argparse
import gzip
import json
import math
import os
import struct
import sys

import torch_common as tc

# numpy and torch are imported in main(), after OPENBLAS_CORETYPE and the thread counts are
# set: Debian's numpy loads the same OpenBLAS (libblas.so.3) as torch, and OpenBLAS reads
# them once, when it is loaded.
np = None

M64 = (1 << 64) - 1


# ---- safetensors ----------------------------------------------------------------------

DTYPES = {"F32": "<f4", "I32": "<i4", "F16": "<f2"}


def read_safetensors(path):
    """(tensors as numpy arrays, the metadata dict) of one safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + hlen])
    meta = header.pop("__metadata__", {})
    base = 8 + hlen
    out = {}
    for name, e in header.items():
        if e["dtype"] not in DTYPES:
            raise SystemExit(f"torch_replay: {path}: {name} has dtype {e['dtype']}")
        a, b = e["data_offsets"]
        dt = np.dtype(DTYPES[e["dtype"]])
        out[name] = np.frombuffer(blob, dtype=dt, count=(b - a) // dt.itemsize,
                                  offset=base + a).reshape(e["shape"]).copy()
    return out, meta


# ---- gpu/error.c's generator and gpu/train.c's shuffle -----------------------------------

def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return x, z ^ (z >> 31)


def rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & M64


class Rng:
    """gpu_rng: xoshiro256**, seeded by splitmix64."""

    def __init__(self, seed=None, state=None):
        if state is not None:
            self.s = list(state)
            return
        self.s = []
        x = seed & M64
        for _ in range(4):
            x, z = splitmix64(x)
            self.s.append(z)

    def next(self):
        s = self.s
        result = (rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return result

    def below(self, n):
        return ((self.next() >> 32) * n) >> 32

    def hex(self):
        return "".join("%016x" % v for v in self.s)


def shuffle(rng, n):
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


class Batches:
    """next_batch of gpu/train.c from a (permutation, position, generator) state."""

    def __init__(self, perm, pos, rng):
        self.perm, self.pos, self.rng = list(perm), pos, rng

    def next(self, B):
        idx = []
        for _ in range(B):
            if self.pos >= len(self.perm):
                self.perm = shuffle(self.rng, len(self.perm))
                self.pos = 0
            idx.append(self.perm[self.pos])
            self.pos += 1
        return np.array(idx, dtype=np.int64)


# ---- gpu/data.c's IDX data and normalisation ---------------------------------------------

def read_idx(path, ndims):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    if data[:4] != bytes([0, 0, 8, ndims]):
        raise SystemExit(f"torch_replay: {path}: not an IDX uint8 file with {ndims} dims")
    dims = struct.unpack(">" + "I" * ndims, data[4:4 + 4 * ndims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndims).reshape(dims)


def measure_norm(pixels, chunk=1 << 22):
    """measure_norm of gpu/data.c: (mean, inv_std) as float32. The C loop adds pixel / 255.0
    and its square to two doubles one value at a time, in file order; np.cumsum accumulates
    the same way (np.sum's pairwise summation would round differently), chunk by chunk with
    the running sum in front."""
    flat = pixels.reshape(-1)
    s = ss = 0.0
    for i in range(0, flat.size, chunk):
        v = flat[i:i + chunk].astype(np.float64) / 255.0
        s = float(np.cumsum(np.concatenate(([s], v)))[-1])
        ss = float(np.cumsum(np.concatenate(([ss], v * v)))[-1])
    n = float(flat.size)
    mean = s / n
    var = ss / n - mean * mean
    inv = 1.0 / math.sqrt(var if var > 1e-12 else 1.0)
    return np.float32(mean), np.float32(inv)


def gather(pixels, labels, idx, mean, inv_std):
    """gpu_dataset_gather: x = (float)p * (inv_std / 255.0f) + (-mean * inv_std), float32."""
    scale = np.float32(inv_std / np.float32(255.0))
    shift = np.float32(np.float32(-mean) * inv_std)
    x = pixels[idx].reshape(len(idx), -1).astype(np.float32)
    x = x * scale                       # float32 multiply, rounded
    x = x + shift                       # float32 add, rounded
    assert x.dtype == np.float32
    return x, labels[idx].astype(np.int64)


# ---- the run ----------------------------------------------------------------------------

def read_run(path):
    start, steps = None, {}
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            o = json.loads(line)
            if o.get("type") == "start":
                start = o
            elif o.get("type") == "step":
                steps[o["step"]] = o
    if start is None:
        raise SystemExit(f"torch_replay: {path}: no start line")
    return start, steps


def rel(a, b):
    return abs(a - b) / abs(b) if b != 0 else abs(a - b)


def ampd_order_step(torch, linears, x, y):
    """--order ampd: forward and backward by hand with the operations of gpu/mlp.c in its
    order, so that only the operation order of plain PyTorch is taken away (an ablation,
    not how PyTorch trains): each linear as torch.mm (the same OpenBLAS sgemm call ampd
    makes) then the bias added in float32 (nn.Linear's addmm adds it inside the GEMM);
    softmax cross-entropy in double per row with C's exp and log, the probabilities rounded
    to float32; dz = (p - onehot) * (1.0f / B) in float32; weight gradients dz^T x and input
    gradients dz W by torch.mm; bias gradients summed over the rows one row at a time in
    float32 (PyTorch's sum reduces in another order); the ReLU mask from the layer's input.
    Sets every parameter's .grad; returns the loss as ampd computes it (double)."""
    B = x.shape[0]
    acts = [x]
    h = x
    for i, lin in enumerate(linears):
        h = torch.mm(h, lin.weight.detach().t()) + lin.bias.detach()
        if i + 1 < len(linears):
            h = torch.relu(h)
            acts.append(h)
    z = h.numpy().astype(np.float64)
    probs = np.empty(z.shape, dtype=np.float32)
    total = 0.0
    for i in range(B):
        row = [float(v) for v in z[i]]
        mx = row[0]
        for v in row[1:]:
            if v > mx:
                mx = v
        s = 0.0
        for v in row:
            s += math.exp(v - mx)
        for j, v in enumerate(row):
            probs[i, j] = np.float32(math.exp(v - mx) / s)
        total += -(row[y[i]] - mx - math.log(s))
    onehot = np.zeros(z.shape, dtype=np.float32)
    onehot[np.arange(B), y] = 1.0
    dz = torch.from_numpy((probs - onehot) * np.float32(np.float32(1.0) / np.float32(B)))
    for li in range(len(linears) - 1, -1, -1):
        lin = linears[li]
        lin.weight.grad = torch.mm(dz.t(), acts[li])
        db = np.zeros(dz.shape[1], dtype=np.float32)
        d = dz.numpy()
        for r in range(B):
            db += d[r]
        lin.bias.grad = torch.from_numpy(db)
        if li == 0:
            break
        dx = torch.mm(dz, lin.weight.detach())
        dz = torch.where(acts[li] > 0, dx, torch.zeros_like(dx))
    return total / B


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="ampd run's JSON lines")
    p.add_argument("--ckpt", required=True, help="the checkpoint the replay starts from")
    p.add_argument("--final", required=True, help="ampd's checkpoint after the last step")
    p.add_argument("--constants", choices=("double", "float32"), default="double")
    p.add_argument("--order", choices=("torch", "ampd"), default="torch")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()

    coretype = tc.setup_openblas("auto")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(a.threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    global np
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    start, lines = read_run(a.run)
    spec = start["spec"]
    model, opt_spec, B = spec["model"], spec["optimizer"], spec["batch_size"]
    if spec["precision"]["dtype"] != "fp32" or model["type"] != "mlp" or \
            model["activation"] != "relu" or spec["grad_accum_steps"] != 1 or \
            spec["distributed"]["world_size"] != 1:
        raise SystemExit("torch_replay: needs an fp32 ReLU MLP on one rank, no accumulation")
    if opt_spec["grad_clip"] != 0 or opt_spec["warmup_steps"] != 0 or \
            opt_spec["schedule"] != "constant":
        raise SystemExit("torch_replay: needs grad_clip 0, no warmup, a constant schedule")

    ck, meta = read_safetensors(a.ckpt)
    fin, fmeta = read_safetensors(a.final)
    K, K_end = int(meta["step"]), int(fmeta["step"])
    N = K_end - K
    if int(meta["applied"]) != K or int(fmeta["applied"]) != K_end:
        raise SystemExit("torch_replay: the run skipped steps; fp32 runs should not")

    # data and its normalisation
    d = spec["data"]
    pixels = read_idx(d["train_images"], 3)
    labels = read_idx(d["train_labels"], 1)
    mean, inv_std = measure_norm(pixels)

    # the batch order: the port from the seed must give the checkpoint's permutation
    seed = spec["seed"]
    rng0 = Rng(seed ^ 0xDA7A5EED)
    perm0 = shuffle(rng0, len(labels))
    order = ck["data.order"].astype(np.int64)
    order_matches = bool(np.array_equal(np.array(perm0), order))
    rng_matches = rng0.hex() == meta["rng"]
    if (K * B) <= len(labels) and not (order_matches and rng_matches):
        raise SystemExit("torch_replay: the ported shuffle does not give the checkpoint's "
                         f"data.order (match {order_matches}) / rng (match {rng_matches})")
    rs = meta["rng"]
    batches = Batches(order, int(meta["perm_pos"]),
                      Rng(state=[int(rs[i:i + 16], 16) for i in range(0, 64, 16)]))

    # the model, from the checkpoint
    widths = model["layers"]
    mods = []
    for i in range(len(widths) - 1):
        mods.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            mods.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*mods)
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    names = []
    with torch.no_grad():
        for i, lin in enumerate(linears):
            for kind, param in (("weight", lin.weight), ("bias", lin.bias)):
                name = f"fc{i + 1}.{kind}"
                if tuple(ck[name].shape) != tuple(param.shape):
                    raise SystemExit(f"torch_replay: {name} is {ck[name].shape}, "
                                     f"nn.Linear's is {tuple(param.shape)}")
                param.copy_(torch.from_numpy(ck[name]))
                names.append((name, param))

    def c(v):  # a hyperparameter as the optimizer gets it
        return float(np.float32(v)) if a.constants == "float32" else float(v)

    params = [prm for _, prm in names]
    if opt_spec["type"] == "adamw":
        opt = torch.optim.AdamW(params, lr=c(opt_spec["lr"]),
                                betas=(c(opt_spec["betas"][0]), c(opt_spec["betas"][1])),
                                eps=c(opt_spec["eps"]), weight_decay=c(opt_spec["weight_decay"]),
                                foreach=False)
        for name, prm in names:
            opt.state[prm] = {"step": torch.tensor(float(meta["applied"])),
                              "exp_avg": torch.from_numpy(ck["optim.exp_avg." + name]),
                              "exp_avg_sq": torch.from_numpy(ck["optim.exp_avg_sq." + name])}
    else:
        opt = torch.optim.SGD(params, lr=c(opt_spec["lr"]), momentum=c(opt_spec["momentum"]),
                              weight_decay=c(opt_spec["weight_decay"]), foreach=False)
        for name, prm in names:
            opt.state[prm] = {"momentum_buffer":
                              torch.from_numpy(ck["optim.momentum_buffer." + name])}

    rows = []
    for step in range(K + 1, K_end + 1):
        idx = batches.next(B)
        x, y = gather(pixels, labels, idx, mean, inv_std)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        opt.zero_grad(set_to_none=True)
        if a.order == "ampd":
            loss = loss64 = ampd_order_step(torch, linears, xt, y)
        else:
            logits = net(xt)
            loss = F.cross_entropy(logits, yt)
            # ampd's reduction of the same logits (softmax cross-entropy in double)
            z = logits.detach().double()
            loss64 = float((torch.logsumexp(z, 1) - z.gather(1, yt[:, None])[:, 0]).mean())
            loss.backward()
        opt.step()
        ampd_loss = lines[step]["loss"]
        rows.append({"step": step, "ampd": ampd_loss, "torch": float(loss),
                     "torch_f64": loss64, "rel": rel(float(loss), ampd_loss),
                     "same_digits": "%.9g" % float(loss) == "%.9g" % ampd_loss})

    weights = []
    with torch.no_grad():
        for name, prm in names:
            t, r = prm.numpy(), fin[name]
            diff = np.abs(t.astype(np.float64) - r.astype(np.float64))
            worst = np.unravel_index(int(diff.argmax()), diff.shape)
            sq = fin.get("optim.exp_avg_sq." + name)
            weights.append({"tensor": name,
                            "worst": {"index": [int(i) for i in worst],
                                      "ampd": float(r[worst]), "torch": float(t[worst]),
                                      "exp_avg_sq": None if sq is None else float(sq[worst])},
                            "max_abs_diff": float(diff.max()),
                            "max_rel": float(diff.max() / np.abs(r).max()),
                            "l2_rel": float(np.linalg.norm(diff) / np.linalg.norm(r)),
                            "equal_frac": float(np.mean(t == r))})
    print(json.dumps({
        "K": K, "N": N, "batch": B, "layers": widths, "optimizer": opt_spec,
        "constants": a.constants, "order": a.order, "torch": torch.__version__, "threads": a.threads,
        "openblas_coretype": coretype, "order_matches": order_matches,
        "rng_matches": rng_matches, "norm": [float(mean), float(inv_std)],
        "first_rel": rows[0]["rel"], "first_rel_f64": rel(rows[0]["torch_f64"], rows[0]["ampd"]),
        "max_rel": max(r["rel"] for r in rows),
        "max_rel_step": max(rows, key=lambda r: r["rel"])["step"],
        "max_rel_f64": max(rel(r["torch_f64"], r["ampd"]) for r in rows),
        "same_digits": sum(r["same_digits"] for r in rows),
        "weights_equal": all(w["equal_frac"] == 1.0 for w in weights),
        "weights_max_rel": max(w["max_rel"] for w in weights),
        "weights_l2_rel": max(w["l2_rel"] for w in weights),
        "weights": weights, "steps": rows}))


if __name__ == "__main__":
    sys.exit(main())
