"""Decode-step and prefill timing of a checkpoint on one CPU thread (for A/B runs of two
checkouts of this repository, alternated by the caller).

    python scripts/bench_decode_step.py CHECKPOINT_DIR BATCH STEPS [--profile]

Prefills ``BATCH`` sequences of 300 random tokens, then times ``STEPS`` batched decode
steps five times (prints the min and median per step) and three 256-token prefills.
With ``--profile``: a cProfile of the decode steps instead (sorted by own time).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel


def main() -> None:
    torch.set_num_threads(1)
    ckpt = load_checkpoint(sys.argv[1])
    model = HybridModel(ckpt.config, weights=ckpt.weights, page_size=16)
    batch, steps = int(sys.argv[2]), int(sys.argv[3])
    gen = torch.Generator().manual_seed(0)
    vocab = ckpt.config.vocab_size
    states = [model.new_state() for _ in range(batch)]
    tokens = [int(model.prefill(torch.randint(0, vocab, (300,), generator=gen), s).argmax())
              for s in states]  # fmt: skip

    def run(n: int) -> None:
        nonlocal tokens
        for _ in range(n):
            tokens = model.decode_batch(tokens, states).argmax(-1).tolist()

    run(5)
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        profile.runcall(run, steps)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        run(steps)
        times.append((time.perf_counter() - t0) / steps)
    times.sort()
    print(f"B={batch} decode step {1e3 * times[0]:.2f} ms (min of 5), median {1e3 * times[2]:.2f}")
    t0 = time.perf_counter()
    for _ in range(3):
        model.prefill(torch.randint(0, vocab, (256,), generator=gen), model.new_state())
    print(f"prefill 256 {1e3 * (time.perf_counter() - t0) / 3:.1f} ms")


if __name__ == "__main__":
    main()
