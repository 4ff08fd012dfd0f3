"""The scheduler on meshes: batched greedy output equals the sequential engine's.

Batching changes nothing in a request's math except how prefill is chunked (chunk
boundaries move the SSM scan's and attention's reduction blocks: float32 rounding only,
see ``tests/engine_cases.py``) and, once the model batches decode GEMMs, their reduction
order; greedy tokens must be identical. Every rank must agree on every token.
"""

from __future__ import annotations

import pytest

from mesh_hicache.topology import MeshTopology
from tests.distributed.harness import run_on_mesh
from tests.engine_cases import batched_vs_sequential


def _compare(mesh, mode, cp_kv, checkpoint=None):
    return batched_vs_sequential(MeshTopology.from_mesh(mesh), mode, cp_kv, checkpoint)


@pytest.mark.parametrize(
    ("shape", "cp_kv", "mode"),
    [
        ((1, 2, 2), "replicate", "l1+l2"),
        ((1, 2, 2), "shard", "l1"),
        ((2, 1, 1), "replicate", "l1+l2"),
        ((2, 1, 1), "replicate", "off"),
    ],
    ids=["1x2x2-replicate-l1l2", "1x2x2-shard-l1", "2x1x1-l1l2", "2x1x1-off"],
)
def test_batched_equals_sequential_on_mesh(shape, cp_kv, mode):
    out = run_on_mesh(shape, _compare, mode, cp_kv, timeout=400)
    for check in out:
        assert check == out[0], "ranks disagree on tokens or batching"
    c = out[0]
    assert c.batched == c.sequential, c.label
    assert c.max_batch > 1
    if mode != "off":
        assert c.batched_cached > 0


def test_batched_gdn_checkpoint_on_mesh(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    from tests.qwen_cases import build

    directory = str(build("qwen3_next", tmp_path))
    out = run_on_mesh((1, 2, 2), _compare, "l1+l2", "shard", directory, timeout=400)
    for check in out:
        assert check == out[0], "ranks disagree on tokens or batching"
    assert out[0].batched == out[0].sequential
    assert out[0].batched_cached > 0
