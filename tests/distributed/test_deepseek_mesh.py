"""DeepSeek-V3.2 (MLA + lightning indexer + MoE) on a mesh equals one rank.

Logits of a prefill after a cached prefix and of greedy decode steps, all-position logits
of a whole-prompt prefill, greedy tokens, and every rank's latent / indexer-key rows
(replicated over tp; under ``cp_kv="shard"`` exactly the rank's tokens). Tolerance:
float32 ATOL = 1e-4 (tp sums partial head / expert outputs in another order; the
top-k selection itself is replicated and computed over the full prefix, so it is the
same set on every rank). The prompt (29) and decode (6) are far beyond ``index_topk``
(6): the selection drops keys, also keys of the cached prefix and of other cp ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesh_hicache.topology import MeshTopology
from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel, kv_shard_positions
from tests.deepseek_cases import build
from tests.distributed.harness import run_on_mesh

ATOL = 1e-4
PAGE = 8
PROMPT = 29
NUM_DECODE = 6


def _run(model: HybridModel, prefix: int) -> dict:
    ids = torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(11))
    state = model.new_state()
    if prefix:
        model.prefill(ids[:prefix], state)
    logits = [model.prefill(ids[prefix:], state)]
    out = []
    for _ in range(NUM_DECODE):
        out.append(int(logits[-1].argmax()))
        logits.append(model.decode(out[-1], state))
    full = model.prefill(ids, model.new_state(), all_logits=True)
    return {
        "logits": torch.stack(logits),
        "all": full,
        "ids": out,
        "latent": {i: t.clone() for i, t in state.latent.items()},
        "index_k": {i: t.clone() for i, t in state.index_k.items()},
    }


def _body(mesh, directory: str, cp_kv: str, prefix: int) -> dict:
    topo = MeshTopology.from_mesh(mesh)
    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, topo, cp_kv=cp_kv, page_size=PAGE, weights=ckpt.weights)
    got = _run(model, prefix)
    got.update(coords=topo.coords, layers=model.local_layers, bytes_read=ckpt.weights.bytes_read)
    return got


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("deepseek_mesh"))


@pytest.mark.parametrize(
    ("shape", "cp_kv", "prefix"),
    [
        ((1, 1, 2), "replicate", 0),
        ((1, 2, 1), "shard", 13),
        ((1, 2, 1), "replicate", 16),
        ((2, 1, 1), "replicate", 9),
        ((1, 2, 2), "shard", 28),  # a one-token suffix: an empty cp chunk
        ((2, 2, 1), "replicate", 13),
        ((2, 1, 2), "shard", 16),
        ((2, 2, 2), "shard", 13),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_mesh_equals_one_rank(directory: Path, shape, cp_kv: str, prefix: int) -> None:
    ckpt = load_checkpoint(directory)
    ref = _run(HybridModel(ckpt.config, page_size=PAGE, weights=ckpt.weights), prefix)
    total_bytes = ckpt.weights.bytes_read
    results = run_on_mesh(shape, _body, str(directory), cp_kv, prefix, timeout=300)
    pp, cp, tp = shape
    layers_seen: set[int] = set()
    for res in results:
        assert res["ids"] == ref["ids"]
        torch.testing.assert_close(res["logits"], ref["logits"], atol=ATOL, rtol=0)
        torch.testing.assert_close(res["all"], ref["all"], atol=ATOL, rtol=0)
        _, c, _ = res["coords"]
        assert set(res["latent"]) == set(res["index_k"]) == set(res["layers"])
        layers_seen |= set(res["layers"])
        rows = torch.arange(PROMPT + NUM_DECODE)
        if cp_kv == "shard":
            rows = kv_shard_positions(PROMPT + NUM_DECODE, PAGE, cp, c)
            assert 0 < len(rows) < PROMPT + NUM_DECODE or cp == 1
        for lid in res["layers"]:
            want_latent, want_index = ref["latent"][lid][rows], ref["index_k"][lid][rows]
            torch.testing.assert_close(res["latent"][lid], want_latent, atol=ATOL, rtol=0)
            torch.testing.assert_close(res["index_k"][lid], want_index, atol=ATOL, rtol=0)
        if tp * pp > 1:  # each rank reads its own heads / experts / layers, not the model
            assert res["bytes_read"] < 0.85 * total_bytes, (res["bytes_read"], total_bytes)
    assert layers_seen == set(range(ckpt.config.num_layers))
