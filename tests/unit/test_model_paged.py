"""Paged model states (attention on the L1 pool pages) and batched decode, on one rank.

Paged vs contiguous: the same rows, the same ops, so float32 logits within 1e-5 (measured:
equal) and the pool rows equal the contiguous state's rows exactly. Batched vs sequential
decode: the B rows share every GEMM, which may change its reduction order, so logits
within BATCH_ATOL = 1e-4 (float32; measured below 1e-5) and identical greedy tokens.
Models: attention + Mamba-2 (tiny preset; ``parallel``: its layers ``PSAP``, two of them
attention and Mamba-2 in parallel), Qwen3-Next (gated attention + Gated DeltaNet +
MoE with a gated shared expert) and DeepSeek-V3.2 (MLA + lightning indexer + MoE), the
last two from tiny transformers checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.checkpoints import load_checkpoint
from runtime.model import HybridModel, preset
from tests import deepseek_cases, qwen_cases
from tests.model_batch_cases import (
    NUM_DECODE,
    batch_vs_sequential,
    paged_vs_contiguous,
    pools_for,
    tokens,
)

PAGED_ATOL = 1e-5
BATCH_ATOL = 1e-4


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("paged_ckpt")


def _model(kind: str, root: Path, page_size: int = 8) -> HybridModel:
    if kind == "tiny":
        return HybridModel(preset("tiny"), page_size=page_size)
    if kind == "parallel":
        return HybridModel(preset("tiny", layer_pattern="PSAP"), page_size=page_size)
    directory = deepseek_cases.build(root) if kind == "mla" else qwen_cases.build(kind, root)
    ckpt = load_checkpoint(directory)
    return HybridModel(ckpt.config, page_size=page_size, weights=ckpt.weights)


KINDS = ("tiny", "parallel", "qwen3_next", "mla")


@pytest.mark.parametrize(
    ("kind", "shuffle"), [(k, True) for k in KINDS] + [("tiny", False), ("mla", False)]
)
def test_paged_equals_contiguous(kind: str, shuffle: bool, root: Path) -> None:
    # shuffle=False: the pages are runs of ids, read as views of the pool (no gather).
    got = paged_vs_contiguous(_model(kind, root), shuffle=shuffle)
    torch.testing.assert_close(got["paged"], got["contiguous"], atol=PAGED_ATOL, rtol=0)
    torch.testing.assert_close(got["resumed"], got["contiguous"], atol=PAGED_ATOL, rtol=0)
    c_ids, p_ids, r_ids = got["ids"]
    assert p_ids == c_ids == r_ids
    assert got["row_diff"] == 0.0 and got["row_diff_resumed"] == 0.0
    assert got["paged_state_empty"]


@pytest.mark.parametrize("kind", KINDS)
def test_decode_batch_equals_sequential(kind: str, root: Path) -> None:
    got = batch_vs_sequential(_model(kind, root))
    torch.testing.assert_close(got["batched"], got["sequential"], atol=BATCH_ATOL, rtol=0)
    b_ids, s_ids = got["ids"]
    assert b_ids == s_ids
    assert len(set(got["lengths"])) == len(got["lengths"])  # every length differs
    batch_one, single = got["single"]
    assert torch.equal(batch_one, single)  # decode is decode_batch of one, exactly


@pytest.mark.parametrize("kind", ("tiny", "parallel", "qwen3_next"))
def test_decode_batch_all_paged_equals_sequential(kind: str, root: Path) -> None:
    # Every sequence paged: attention runs the batch at once (one K/V write per pool, one
    # padded gather of every sequence's keys, one masked matmul pair), the reference one
    # sequence at a time. Same bound as above; the padding adds exact zeros.
    from runtime.model import state as state_module

    state_module._slots_cache = (None, None)
    got = batch_vs_sequential(_model(kind, root), all_paged=True)
    assert state_module._slots_cache[0] is not None  # the batched path ran
    torch.testing.assert_close(got["batched"], got["sequential"], atol=BATCH_ATOL, rtol=0)
    b_ids, s_ids = got["ids"]
    assert b_ids == s_ids


def test_paged_state_checks() -> None:
    model = HybridModel(preset("tiny"), page_size=8)
    pools = pools_for(model, num_pages=8, num_slots=2)
    with pytest.raises(ValueError, match="slot"):
        model.paged_state(pools, [0, 1], 8)  # a recurrent model resumed without its slot
    with pytest.raises(ValueError, match="slot"):
        model.paged_state(pools, [0, 1], 0, slot=1)  # nothing to resume
    with pytest.raises(ValueError, match="num_tokens"):
        model.paged_state(pools, [0], 9, slot=0)  # more tokens than the pages hold
    with pytest.raises(ValueError, match="page ids"):
        model.paged_state(pools, [0, 8])
    with pytest.raises(TypeError, match="DevicePools"):
        model.paged_state(object(), [0])  # type: ignore[arg-type]
    other = HybridModel(preset("tiny"), page_size=16)
    with pytest.raises(ValueError, match="page"):
        other.paged_state(pools, [0])
    # Pages that do not cover a written token: a clear error, not a silent overwrite.
    state = model.paged_state(pools, [3])
    with pytest.raises(ValueError, match="do not cover position 8"):
        model.prefill(tokens(9, 0, 256), state)


def test_decode_batch_checks() -> None:
    model = HybridModel(preset("tiny"), page_size=8)
    state = model.new_state()
    model.prefill(tokens(4, 1, 256), state)
    with pytest.raises(ValueError, match="at least one"):
        model.decode_batch([], [])
    with pytest.raises(ValueError, match="2 tokens for 1 states"):
        model.decode_batch([1, 2], [state])
    with pytest.raises(ValueError, match="same state twice"):
        model.decode_batch([1, 2], [state, state])
    assert state.num_tokens == 4  # a refused call changes nothing
    assert model.decode_batch([1], [state]).shape == (1, model.config.vocab_size)
    assert state.num_tokens == 5


def test_paged_decode_writes_only_its_pages() -> None:
    # Two paged sequences in one pool decode as a batch; every page outside their tables
    # stays zero, and each sequence's rows land in its own pages.
    model = HybridModel(preset("tiny"), page_size=8)
    pools = pools_for(model, num_pages=16)
    a = model.paged_state(pools, [9, 2])
    b = model.paged_state(pools, [5, 14])
    model.prefill(tokens(6, 2, 256), a)
    model.prefill(tokens(3, 3, 256), b)
    for _ in range(NUM_DECODE):
        model.decode_batch([7, 8], [a, b])
    layer = model.config.attention_layers[0]
    k = pools.k(layer)
    assert (a.num_tokens, b.num_tokens) == (12, 9)
    touched = {p for p in range(16) if k[p].abs().sum() > 0}
    assert touched == {9, 2, 5, 14}  # a: tokens 0-7 in page 9, 8-11 in 2; b: 0-7 in 5, 8 in 14
    written = k.abs().sum((2, 3)) > 0  # [page, slot]
    assert written[2].tolist() == [True] * 4 + [False] * 4
    assert written[14].tolist() == [True] + [False] * 7


def test_bench_model_batch_smoke(tmp_path: Path) -> None:
    # scripts/bench_model.py --batch runs and reports both paths for every size (in its own
    # process: the script pins its threads and cores).
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_model.py"
    out = tmp_path / "batch.json"
    argv = ["--batch", "1", "2", "--preset", "tiny", "--decode", "2", "--repeats", "1"]
    argv += ["--lengths", "8", "--paged", "--json", str(out)]
    subprocess.run([sys.executable, str(script), *argv], check=True, timeout=600)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"batch_1", "batch_2"}
    assert all(r["batched_tok_s"] > 0 and r["sequential_tok_s"] > 0 for r in results.values())


@pytest.mark.parametrize(
    ("t", "length", "heads", "groups"), [(1, 300, 8, 2), (3, 40, 4, 4), (8, 9, 6, 3)]
)
def test_few_query_attention_equals_sdpa(t: int, length: int, heads: int, groups: int) -> None:
    # The matmul path for few queries (decode, a full hit's last token) against SDPA's
    # masked kernel on the same causal problem (queries at the last t positions).
    from runtime.model import layers

    gen = torch.Generator().manual_seed(t)
    q = torch.randn(t, heads, 16, generator=gen)
    k, v = torch.randn(2, length, groups, 16, generator=gen)
    offset = length - t
    got = layers._attend_few(q, k, v, offset, 0.25)
    pos = torch.arange(offset, length)
    mask = torch.arange(length)[None, :] <= pos[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=0.25,
        enable_gqa=heads != groups,
    ).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(layers.attend_causal(q, k, v, offset, 0.25), want, atol=1e-5, rtol=0)
