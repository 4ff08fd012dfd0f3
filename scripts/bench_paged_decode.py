"""Paged batched decode: the padded gather (``decode_slots``) against per-sequence
attention, on one thread.

    PYTHONPATH=$PWD python scripts/bench_paged_decode.py CHECKPOINT_DIR

Four paged sequences of about 620 tokens; min over 3 runs of 8 decode steps, each way,
twice (alternated).
"""

from __future__ import annotations

import sys
import time

import torch

from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel
from runtime.model import state as st
from tests.model_batch_cases import pools_for

torch.set_num_threads(1)
ck = load_checkpoint(sys.argv[1])
m = HybridModel(ck.config, weights=ck.weights, page_size=16)
pools = pools_for(m, num_pages=4 * 48)
g = torch.Generator().manual_seed(0)
states = []
for i in range(4):
    s = m.paged_state(pools, list(range(i * 48, (i + 1) * 48)))
    m.prefill(torch.randint(0, ck.config.vocab_size, (600 + 7 * i,), generator=g), s)
    states.append(s)


def run(limit, n=8):
    st.BATCH_ROWS_LIMIT = limit
    toks = [1, 2, 3, 4]
    best = 1e9
    for _ in range(3):
        clones = [s.clone() for s in states]
        t = time.perf_counter()
        for _ in range(n):
            toks = m.decode_batch(toks, clones).argmax(-1).tolist()
        best = min(best, (time.perf_counter() - t) / n)
    return best


for _ in range(2):
    print(f"batched {run(1 << 30) * 1e3:.2f} ms  per sequence {run(0) * 1e3:.2f} ms")
