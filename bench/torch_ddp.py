#!/usr/bin/python3
"""torch_ddp.py - the PyTorch DDP peer of ampd's data-parallel benchmark (bench/ddp.sh).

Runs with Debian's python3-torch 1.13 on the CPU: --world processes (torch.multiprocessing,
the gloo backend over loopback TCP), each with torch.set_num_threads(cores / world), train
the MLP 784-1024-1024-10 (ReLU) on Fashion-MNIST (/usr/share/datasets/fashion-mnist,
pixels / 255 standardised with the training set's mean and deviation, as ampd does) with
AdamW (lr 1e-3) on a global batch of 256 split evenly over the ranks, each rank taking its
slice of the same shuffled global batch. DistributedDataParallel with bucket_cap_mb
--bucket-mb and the comm hook --hook: "none" is DDP's default fp32 all-reduce, "fp16" is
register_comm_hook(None, default_hooks.fp16_compress_hook). gloo has no bf16 all-reduce
(gloo issue #454), so there is no bf16 hook here. With --world 1 the model is not wrapped
(no communication). OpenBLAS's kernels and OMP_WAIT_POLICY=PASSIVE as bench/torch_mlp.py
sets them for fp32 (bench/torch_common.py), so each side runs its fastest CPU setting.

Measured on rank 0, per timed step (--steps after --warmup untimed ones): the step
(zero_grad, forward, backward, AdamW step, time.perf_counter); the hook's bytes (each
bucket's elements times 4, or 2 for fp16); the communication time, from the first bucket's
start to the last one's completion (a wrapper around the hook times each future); and the
exposed part, from the end of the backward computation (a gradient hook on fc1.weight,
the last gradient backward produces) to the last completion. The same definitions as
ampd's comm_ms and comm_exposed_ms. After the steps rank 0 evaluates on the 10,000 test
images. One JSON line:
  {"impl": "pytorch-ddp", "world": ..., "hook": ..., "median_step_ms": ...,
   "comm_bytes": ..., "comm_ms": ..., "comm_exposed_ms": ..., "eval_acc": ..., "torch": ...}

Usage: torch_ddp.py --world N --hook none|fp16 [--steps S] [--warmup W] [--bucket-mb MB]
"""
import argparse
import gzip
import json
import os
import socket
import statistics
import struct
import sys
import time

DATA = "/usr/share/datasets/fashion-mnist"
BATCH = 256
LAYERS = (784, 1024, 1024, 10)


def idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    return dims, raw[4 + 4 * ndim:]


def load(torch, kind):
    dims, px = idx(f"{DATA}/{kind}-images-idx3-ubyte.gz")
    _, lb = idx(f"{DATA}/{kind}-labels-idx1-ubyte.gz")
    x = torch.frombuffer(bytearray(px), dtype=torch.uint8).float().div_(255.0)
    return x.view(dims[0], -1), torch.frombuffer(bytearray(lb), dtype=torch.uint8).long()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CommClock:
    """Times the buckets' all-reduces of one step: first start, last completion, bytes."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.first = None
        self.last = None
        self.bytes = 0
        self.grads_done = None

    def wrap(self, hook, esize):
        def timed(state, bucket):
            t0 = time.perf_counter()
            if self.first is None:
                self.first = t0
            self.bytes += bucket.buffer().numel() * esize
            fut = hook(state, bucket)

            def done(f):
                self.last = time.perf_counter()
                return f.value()
            return fut.then(done)
        return timed


def rank_main(rank, a, port, out):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // a.world))
    torch.manual_seed(1)
    if a.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=a.world)
    x, y = load(torch, "train")
    mean, std = x.mean(), x.std()
    x = (x - mean) / std
    model = torch.nn.Sequential(torch.nn.Linear(LAYERS[0], LAYERS[1]), torch.nn.ReLU(),
                                torch.nn.Linear(LAYERS[1], LAYERS[2]), torch.nn.ReLU(),
                                torch.nn.Linear(LAYERS[2], LAYERS[3]))
    clock = CommClock()
    net = model
    if a.world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
        if a.hook == "fp16":
            net.register_comm_hook(None, clock.wrap(default_hooks.fp16_compress_hook, 2))
        else:
            net.register_comm_hook(dist.group.WORLD, clock.wrap(default_hooks.allreduce_hook, 4))
    model[0].weight.register_hook(lambda g: setattr(clock, "grads_done", time.perf_counter()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    perm, pos, share = torch.randperm(len(x), generator=gen), 0, BATCH // a.world
    times, comm, exposed, nbytes = [], [], [], []
    for step in range(a.warmup + a.steps):
        if pos + BATCH > len(x):
            perm, pos = torch.randperm(len(x), generator=gen), 0
        idx_ = perm[pos + rank * share:pos + (rank + 1) * share]
        pos += BATCH
        clock.reset()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x[idx_]), y[idx_])
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if step >= a.warmup:
            times.append((t1 - t0) * 1e3)
            if clock.first is not None:
                comm.append((clock.last - clock.first) * 1e3)
                exposed.append(max(0.0, clock.last - clock.grads_done) * 1e3)
                nbytes.append(clock.bytes)
    if rank == 0:
        tx, ty = load(torch, "t10k")
        with torch.no_grad():
            acc = (model((tx - mean) / std).argmax(1) == ty).float().mean().item()
        med = statistics.median
        out.put({"impl": "pytorch-ddp", "world": a.world, "hook": a.hook if a.world > 1 else "-",
                 "median_step_ms": med(times),
                 "comm_bytes": int(med(nbytes)) if nbytes else 0,
                 "comm_ms": med(comm) if comm else 0.0,
                 "comm_exposed_ms": med(exposed) if exposed else 0.0,
                 "eval_acc": acc, "steps": a.steps, "torch": torch.__version__})
    if a.world > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hook", choices=("none", "fp16"), default="none")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    a = p.parse_args()
    if a.world < 1 or BATCH % a.world or a.steps < 1:
        p.error("--world must divide 256 and --steps be >= 1")
    # as bench/torch_mlp.py: OpenBLAS's kernels from CPUID, and OpenMP workers that sleep
    # rather than spin between regions (fp32 GEMMs run in OpenBLAS's own threads); set
    # before torch loads, inherited by the ranks
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_common as tc
    tc.setup_openblas("auto")
    tc.setup_omp("passive", "fp32", {"fp32": "passive"})
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, a, port, out)) for r in range(a.world)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    if any(pr.exitcode for pr in procs):
        sys.exit("torch_ddp.py: a rank failed")
    print(json.dumps(out.get()))


if __name__ == "__main__":
    main()
