"""HF checkpoints on a mesh equal one rank: logits, greedy decode, state shards, slices read.

Tolerance: float32 ATOL = 1e-4 (as ``test_model.py``: only the order of float sums
differs; tp adds partial matmuls and, for a B/C group split over tp, partial sums of
squares of the gated norm). Cases: Granite MoE with ONE B/C group (replicated over tp,
the gated norm reduced over tp; experts split over tp) and Nemotron-H with two groups
(sharded at tp=2) and its block pattern (pp cuts between stateless blocks' layers), and
the dense attention decoders (K/V only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesh_hicache.layout import ssm_group_range, tp_split
from mesh_hicache.topology import MeshTopology
from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel, kv_shard_positions
from tests.checkpoint_cases import build
from tests.distributed.harness import run_on_mesh

ATOL = 1e-4
PAGE = 8
PROMPT = 29
NUM_DECODE = 6


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(11))


def _run(model: HybridModel, prefix: int) -> dict:
    ids = _ids()
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
        "k": {i: t.clone() for i, t in state.k.items()},
        "conv": {i: t.clone() for i, t in state.conv.items()},
        "ssm": {i: t.clone() for i, t in state.ssm.items()},
    }


def _body(mesh, directory: str, cp_kv: str, prefix: int) -> dict:
    topo = MeshTopology.from_mesh(mesh)
    ckpt = load_checkpoint(directory)
    model = HybridModel(ckpt.config, topo, cp_kv=cp_kv, page_size=PAGE, weights=ckpt.weights)
    got = _run(model, prefix)
    got.update(coords=topo.coords, bytes_read=ckpt.weights.bytes_read)
    return got


def _conv_rows(config, tp: int, rank: int) -> list[int]:
    """One-rank (group-major) conv channels that tp rank ``rank`` keeps, in its order."""
    c = config
    if c.ssm_kind in ("mamba1", "shortconv"):  # one channel per head, no groups
        return list(range(*tp_split(c.ssm_heads, tp, rank)))
    p, n, per = c.ssm_head_dim, c.ssm_state_dim, c.ssm_heads // c.num_groups
    width = per * p + 2 * n
    h0, h1 = tp_split(c.ssm_heads, tp, rank)
    rows: list[int] = []
    for g in range(*ssm_group_range(c.num_groups, tp, rank)):
        a, b = max(g * per, h0), min((g + 1) * per, h1)
        rows += [g * width + (h - g * per) * p + i for h in range(a, b) for i in range(p)]
        rows += [g * width + per * p + i for i in range(2 * n)]
    return rows


def _check(
    directory: Path, shape, cp_kv: str, prefix: int, timeout: float = 180, slices: bool = True
) -> list[dict]:
    """Every rank of ``shape`` equals one rank on checkpoint ``directory`` (tokens, logits,
    its SSM / conv / KV shards); with ``slices``, a tp or pp rank reads < 0.8 of the bytes.
    Returns the ranks' results."""
    ckpt = load_checkpoint(directory)
    c = ckpt.config
    ref = _run(HybridModel(c, page_size=PAGE, weights=ckpt.weights), prefix)
    total_bytes = ckpt.weights.bytes_read
    results = run_on_mesh(shape, _body, str(directory), cp_kv, prefix, timeout=timeout)
    pp, cp, tp = shape
    for res in results:
        assert res["ids"] == ref["ids"]
        torch.testing.assert_close(res["logits"], ref["logits"], atol=ATOL, rtol=0)
        torch.testing.assert_close(res["all"], ref["all"], atol=ATOL, rtol=0)
        _, cr, t = res["coords"]
        if slices and tp * pp > 1:  # each rank reads its own slices, not the model
            assert res["bytes_read"] < 0.8 * total_bytes, (res["bytes_read"], total_bytes)
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
    return results


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_mesh")


@pytest.mark.parametrize(
    ("case", "shape", "cp_kv", "prefix"),
    [
        ("granite_moe", (1, 1, 2), "replicate", 0),
        ("nemotron_h", (1, 1, 2), "replicate", 13),
        ("granite_moe", (1, 2, 1), "shard", 13),
        ("nemotron_h", (2, 1, 1), "replicate", 16),
        ("granite_moe", (1, 2, 2), "replicate", 16),
        ("nemotron_h", (1, 2, 2), "shard", 28),  # a one-token suffix: an empty cp chunk
        ("granite_moe", (2, 2, 2), "shard", 13),
        # Dense attention (K/V only): biases, q/k norm, experts, llama3 RoPE on meshes.
        ("qwen3_moe", (1, 2, 2), "shard", 13),
        ("qwen2", (1, 1, 2), "replicate", 0),
        ("llama", (2, 1, 1), "replicate", 16),
        ("qwen3", (1, 2, 2), "replicate", 28),
    ],
)
def test_checkpoint_on_mesh_equals_one_rank(root: Path, case: str, shape, cp_kv: str, prefix):
    _check(build(case, root), shape, cp_kv, prefix)


def _resume(mesh, directory: str, cp_kv: str, storage: str):
    from tests.engine_cases import resume_scenarios

    topo = MeshTopology.from_mesh(mesh)
    return resume_scenarios(topo, cp_kv=cp_kv, root=storage, checkpoint=directory)


def _check_resume(shape, directory: Path, cp_kv: str, storage: Path, timeout: float) -> None:
    """On every rank of ``shape``, resuming from L1 / L2 / L3 hits and equals recompute,
    and all ranks agree on hits and tokens."""
    from tests.engine_cases import ATOL as RESUME_ATOL

    out = run_on_mesh(shape, _resume, str(directory), cp_kv, str(storage), timeout=timeout)
    for rank_checks in out:
        assert rank_checks == out[0], "ranks disagree on hits or tokens"
        for c in rank_checks:
            assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
            assert c.max_diff < RESUME_ATOL, f"{c.label}: logits differ by {c.max_diff}"
            assert c.tokens_equal, c.label
    assert {c.tier for c in out[0]} == {"device", "host", "storage"}


def test_checkpoint_resume_on_pipeline_mesh(root: Path, tmp_path: Path) -> None:
    # Nemotron-H's stateless blocks ride with their layers across the 2 pp stages.
    _check_resume((2, 1, 2), build("nemotron_h", root), "replicate", tmp_path, timeout=300)
