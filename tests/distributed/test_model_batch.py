"""Paged states and batched decode on a mesh: the same checks as tests/unit/test_model_paged.py.

On every rank: paged logits equal contiguous ones (float32 ATOL 1e-5; same rows, same
collectives), the rank's pool rows equal its contiguous rows (all tokens under
``cp_kv="replicate"``, its in-page offsets under ``"shard"``), and ``decode_batch`` of five
sequences (lengths 1..31, paged and contiguous mixed) equals one ``decode`` per sequence
(ATOL 1e-4: batched GEMMs may reduce in another order) with identical greedy tokens. Every
rank returns the same logits. Models: attention + Mamba-2 (tiny), Qwen3-Next (gated
attention + Gated DeltaNet), DeepSeek-V3.2 (MLA + lightning indexer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesh_hicache.topology import MeshTopology
from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel, preset
from tests.distributed.harness import run_on_mesh
from tests.model_batch_cases import batch_vs_sequential, paged_vs_contiguous

PAGED_ATOL = 1e-5
BATCH_ATOL = 1e-4
PAGE = 8


def _body(mesh, kind: str, directory: str | None, cp_kv: str) -> dict:
    topo = MeshTopology.from_mesh(mesh)
    if directory is None:
        model = HybridModel(preset("tiny"), topo, cp_kv=cp_kv, page_size=PAGE)
    else:
        ckpt = load_checkpoint(directory)
        model = HybridModel(ckpt.config, topo, cp_kv=cp_kv, page_size=PAGE, weights=ckpt.weights)
    return {"paged": paged_vs_contiguous(model), "batch": batch_vs_sequential(model)}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batch_mesh")


def _directory(kind: str, root: Path) -> str | None:
    if kind == "tiny":
        return None
    from tests import deepseek_cases, qwen_cases

    return str(deepseek_cases.build(root) if kind == "mla" else qwen_cases.build(kind, root))


@pytest.mark.parametrize(
    ("kind", "shape", "cp_kv"),
    [
        ("tiny", (1, 2, 2), "replicate"),
        ("tiny", (1, 2, 2), "shard"),
        ("tiny", (2, 1, 1), "replicate"),
        ("tiny", (1, 1, 2), "replicate"),
        ("qwen3_next", (1, 2, 2), "shard"),
        ("qwen3_next", (2, 1, 1), "replicate"),
        ("mla", (1, 2, 2), "shard"),
        ("mla", (1, 2, 2), "replicate"),
        ("mla", (1, 1, 2), "replicate"),
    ],
)
def test_paged_and_batched_on_mesh(root: Path, kind: str, shape, cp_kv: str) -> None:
    results = run_on_mesh(shape, _body, kind, _directory(kind, root), cp_kv, timeout=400)
    for got in results:
        paged, batch = got["paged"], got["batch"]
        torch.testing.assert_close(paged["paged"], paged["contiguous"], atol=PAGED_ATOL, rtol=0)
        torch.testing.assert_close(paged["resumed"], paged["contiguous"], atol=PAGED_ATOL, rtol=0)
        assert paged["ids"][0] == paged["ids"][1] == paged["ids"][2]
        assert paged["row_diff"] == 0.0 and paged["row_diff_resumed"] == 0.0
        assert paged["paged_state_empty"]
        torch.testing.assert_close(batch["batched"], batch["sequential"], atol=BATCH_ATOL, rtol=0)
        assert batch["ids"][0] == batch["ids"][1]
        # Identical on every rank.
        assert torch.equal(batch["batched"], results[0]["batch"]["batched"])
        assert torch.equal(paged["paged"], results[0]["paged"]["paged"])
