#!/usr/bin/python3
"""Writes tests/data/torch_optim.txt: what PyTorch's optimizers and loss-scale rule produce on
fixed inputs, for tests/check_optim.c and tests/check_scaler.c to compare ampd with.

Run once with Debian's python3-torch (1.13) on the CPU:
    /usr/bin/python3 tests/data/torch_optim.py > tests/data/torch_optim.txt
It needs only torch and numpy; the tests need only the text it writes.

Optimizer cases: torch.optim.AdamW / SGD (foreach=False, the single-tensor path) on one fp32
tensor of N elements for STEPS steps, the gradient of step t (1-based) and element i being
    h = (i * 2654435761 + t * 40503 + 12345) mod 2001
    g = float32(h - 1000) / 1000f * MAG[i % 4]        (float32 arithmetic)
and the start value p0[i] = float32(i) / 100f - 1.5f. Lines "p T ..." hold the parameter
after step T, "m"/"v"/"buf" the state after the last step, each value as the 8 hex digits of
its float32 bits.

Scaler case: PyTorch's _amp_update_scale_ rule (GradScaler's update; in torch 1.13 a CUDA
kernel, so it is written out here as that kernel computes it: a float32 scale times a double
factor, rounded to float32 once; growth only when the result is finite) with found_inf drawn
from a hash of the step (every EVERY-th step on average). Lines
"s STEP FOUND_INF SCALE_BITS TRACKER".
"""
import sys

import numpy as np
import torch

F32 = np.float32
MAG = [F32(1.0), F32(1e-3), F32(1e-6), F32(30.0)]
N = 67
STEPS = 200
REPORT = [1, 2, 3, 10, 50, 100, 200]


def grad(n, t):
    g = np.empty(n, F32)
    for i in range(n):
        h = (i * 2654435761 + t * 40503 + 12345) % 2001
        g[i] = F32(h - 1000) / F32(1000.0) * MAG[i % 4]
    return g


def hexs(a):
    return " ".join("%08x" % int(u) for u in np.asarray(a, F32).view(np.uint32))


def run_case(name, make_opt, hyper, state_keys):
    p0 = np.array([F32(i) / F32(100.0) - F32(1.5) for i in range(N)], F32)
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = make_opt([p])
    args = " ".join("%s %r" % kv for kv in hyper)
    print("case %s %s n %d steps %d" % (name, args, N, STEPS))
    for t in range(1, STEPS + 1):
        p.grad = torch.from_numpy(grad(N, t))
        opt.step()
        if t in REPORT:
            print("p %d %s" % (t, hexs(p.detach().numpy())))
    st = opt.state[p]
    for key, label in state_keys:
        print("%s %d %s" % (label, STEPS, hexs(st[key].numpy())))
    print("end")


def scaler_case(init, growth, backoff, interval, steps, every):
    print("scaler init %r growth %r backoff %r interval %d steps %d" %
          (init, growth, backoff, interval, steps))
    scale, tracker = F32(init), 0
    for t in range(1, steps + 1):
        found_inf = (t * 2654435761 + 99991) % every == 0
        if found_inf:
            scale = F32(float(scale) * backoff)
            tracker = 0
        else:
            tracker += 1
            if tracker == interval:
                with np.errstate(over="ignore"):
                    cand = F32(float(scale) * growth)
                if np.isfinite(cand):
                    scale = cand
                tracker = 0
        print("s %d %d %08x %d" % (t, found_inf, int(np.array(scale, F32).view(np.uint32)),
                                    tracker))
    print("end")


def main():
    torch.set_num_threads(1)
    print("# torch.optim and the GradScaler rule on fixed inputs, written by "
          "tests/data/torch_optim.py")
    print("# torch %s, numpy %s, CPU capability %s" %
          (torch.__version__, np.__version__,
           "".join(l.split(":")[1].strip() for l in torch.__config__.show().splitlines()
                   if "CPU capability" in l)))
    adam = [("lr", 1e-3, 0.9, 0.999, 1e-8, 0.01), ("lr", 3e-4, 0.8, 0.95, 1e-6, 0.1)]
    for k, (_, lr, b1, b2, eps, wd) in enumerate(adam):
        run_case("adamw%d" % k,
                 lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps,
                                              weight_decay=wd, foreach=False),
                 [("lr", lr), ("beta1", b1), ("beta2", b2), ("eps", eps), ("wd", wd),
                  ("momentum", 0.0)],
                 [("exp_avg", "m"), ("exp_avg_sq", "v")])
    sgd = [(0.05, 0.9, 1e-3), (0.1, 0.0, 0.0)]
    for k, (lr, mom, wd) in enumerate(sgd):
        run_case("sgd%d" % k,
                 lambda ps: torch.optim.SGD(ps, lr=lr, momentum=mom, weight_decay=wd,
                                            foreach=False),
                 [("lr", lr), ("beta1", 0.0), ("beta2", 0.0), ("eps", 0.0), ("wd", wd),
                  ("momentum", mom)],
                 [("momentum_buffer", "buf")] if mom else [])
    scaler_case(3e9, 3.0, 0.3, 3, 300, 5)
    scaler_case(1e38, 3.0, 0.3, 1, 300, 9)
    scaler_case(65536.0, 2.0, 0.5, 2, 300, 4)


if __name__ == "__main__":
    sys.exit(main())
