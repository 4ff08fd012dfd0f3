"""NCCL variants of the distributed tests, on as many ranks as there are GPUs.

Each case runs the same rank body as its gloo twin in ``tests/distributed`` but on an
NCCL process group with one CUDA device per rank; cases needing more GPUs than present
skip (``run_on_mesh`` names the count).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_on_mesh
from tests.distributed.test_consensus import _agree

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 2), (1, 2, 2), (2, 2, 2)])
def test_ranks_agree_over_nccl(shape):
    out = run_on_mesh(shape, _agree, backend="nccl", timeout=120)
    for o in out:
        stage = [r for r, p in enumerate(out) if p["coords"][0] == o["coords"][0]]
        pipe = [r for r, p in enumerate(out) if p["coords"][1:] == o["coords"][1:]]
        assert o["min"] == 10 + min(stage) and o["max"] == 10 + max(stage)
        assert o["all_true"] == (1 not in stage)
        assert o["any_true"] == (1 in stage)
        assert o["min_list"] == [min(stage), 100 - max(stage), 5]
        assert o["pp_max"] == max(pipe)
