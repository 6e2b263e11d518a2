#!/usr/bin/env python3
"""gpu_tokens.py - write a random llm.c token shard (the `tokens` data of a job spec) for the
GPU benchmark (bench/gpu.sh).

The format is llm.c's (dev/data/data_common.py): a header of 256 little-endian int32 —
magic 20240520, version 1, the token count, the rest 0 — then that many little-endian uint16
tokens. The tokens are uniform in [0, --vocab) from numpy's PCG64 with a fixed seed, so the
same command writes the same file byte for byte on any machine (speed does not depend on
the values; with GPT-2's 50257 every token fits in uint16).

Usage: gpu_tokens.py OUT.bin [--tokens N] [--vocab V] [--seed S]
  --tokens N  how many tokens (default 5000000, a 10 MB file)
  --vocab V   tokens are < V (default 50257, GPT-2's vocabulary; at most 65536)
  --seed S    numpy seed (default 1337)
Prints one line on stderr: the path, the count and the largest token.
"""
import argparse
import sys

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the shard to write")
    p.add_argument("--tokens", type=int, default=5_000_000, help="token count (default 5000000)")
    p.add_argument("--vocab", type=int, default=50257, help="tokens are < V (default 50257)")
    p.add_argument("--seed", type=int, default=1337, help="numpy seed (default 1337)")
    a = p.parse_args()
    if not 1 <= a.tokens < 2**31:
        p.error("--tokens must be in [1, 2^31)")
    if not 2 <= a.vocab <= 65536:
        p.error("--vocab must be in [2, 65536] (tokens are uint16)")
    return a


def main():
    a = parse_args()
    rng = np.random.default_rng(a.seed)
    tokens = rng.integers(0, a.vocab, size=a.tokens, dtype=np.uint32).astype("<u2")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, a.tokens
    with open(a.out, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
    print(f"gpu_tokens: {a.out}: {a.tokens} tokens, largest {int(tokens.max())} "
          f"(vocab {a.vocab}, seed {a.seed})", file=sys.stderr)


if __name__ == "__main__":
    main()
