"""Gated DeltaNet checkpoints on a mesh equal one rank: logits, greedy decode, state shards.

Tolerance: float32 ATOL = 1e-4 (as ``test_checkpoints.py``). Cases: Qwen3-Next with two
key heads (sharded at tp=2), Qwen3.5 with ONE key head (replicated over tp: each rank
keeps it beside its share of the value heads), Qwen3.5 MoE; CP runs the delta rule's
chunk-transition combination (both KV modes, one case with an empty cp chunk); PP cuts
between layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesh_hicache.layout import tp_split
from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel, kv_shard_positions
from tests.distributed.harness import run_on_mesh
from tests.distributed.test_checkpoints import NUM_DECODE, PAGE, PROMPT, _body, _conv_rows, _run
from tests.qwen_cases import build

ATOL = 1e-4


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen_mesh")


@pytest.mark.parametrize(
    ("case", "shape", "cp_kv", "prefix"),
    [
        ("qwen3_next", (1, 1, 2), "replicate", 0),
        ("qwen35", (1, 1, 2), "replicate", 13),
        ("qwen3_next", (1, 2, 1), "shard", 13),
        ("qwen35_moe", (2, 1, 1), "replicate", 16),
        ("qwen3_next", (1, 2, 2), "replicate", 16),
        ("qwen35", (1, 2, 2), "shard", 28),  # a one-token suffix: an empty cp chunk
        ("qwen35_moe", (2, 2, 2), "shard", 13),
    ],
)
def test_mesh_equals_one_rank(root: Path, case: str, shape, cp_kv: str, prefix: int) -> None:
    directory = build(case, root)
    ckpt = load_checkpoint(directory)
    c = ckpt.config
    ref = _run(HybridModel(c, page_size=PAGE, weights=ckpt.weights), prefix)
    results = run_on_mesh(shape, _body, str(directory), cp_kv, prefix, timeout=240)
    pp, cp, tp = shape
    for res in results:
        assert res["ids"] == ref["ids"]
        torch.testing.assert_close(res["logits"], ref["logits"], atol=ATOL, rtol=0)
        torch.testing.assert_close(res["all"], ref["all"], atol=ATOL, rtol=0)
        _, cr, t = res["coords"]
        for lid, ssm in res["ssm"].items():
            h0, h1 = tp_split(c.ssm_heads, tp, t)
            torch.testing.assert_close(ssm, ref["ssm"][lid][h0:h1], atol=ATOL, rtol=0)
            want = ref["conv"][lid][_conv_rows(c, tp, t)]
            torch.testing.assert_close(res["conv"][lid], want, atol=ATOL, rtol=0)
        for lid, k in res["k"].items():
            heads = c.num_kv_heads // tp
            want = ref["k"][lid][:, t * heads : (t + 1) * heads]
            if cp_kv == "shard":
                want = want[kv_shard_positions(PROMPT + NUM_DECODE, PAGE, cp, cr)]
            torch.testing.assert_close(k, want, atol=ATOL, rtol=0)
    assert sum(len(r["ssm"]) for r in results) > 0


def _scenarios(mesh, cp_kv: str, root: str, directory: str):
    from mesh_hicache.topology import MeshTopology
    from tests.engine_cases import resume_scenarios

    topo = MeshTopology.from_mesh(mesh)
    return resume_scenarios(topo, cp_kv=cp_kv, root=root, checkpoint=directory)


def test_resume_on_cp_tp_mesh(root: Path, tmp_path: Path) -> None:
    # The delta-rule state sharded over tp, combined over cp, cached and reloaded from
    # L1 / L2 / L3 at aligned and unaligned boundaries equals recompute on the mesh.
    from tests.engine_cases import ATOL as RESUME_ATOL

    directory = str(build("qwen3_next", root))
    out = run_on_mesh((1, 2, 2), _scenarios, "shard", str(tmp_path), directory, timeout=400)
    for rank_checks in out:
        assert rank_checks == out[0], "ranks disagree on hits or tokens"
        for c in rank_checks:
            assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
            assert c.max_diff < RESUME_ATOL, f"{c.label}: logits differ by {c.max_diff}"
            assert c.tokens_equal, c.label
    assert {c.tier for c in out[0]} == {"device", "host", "storage"}
