"""The hybrid model on one device: resume from a state, decode, determinism, shapes, errors."""

from __future__ import annotations

import pytest
import torch

from runtime.model import (
    HybridModel,
    ModelConfig,
    cp_chunk_bounds,
    kv_shard_positions,
    preset,
    stage_layer_range,
)

# float32: resuming reorders sums (carried SSM state vs one scan), nothing else differs.
ATOL = RTOL = 1e-5


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(preset("tiny"))


def _tokens(n: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("prefix_len", [16, 32, 13, 1])
def test_resume_equals_full_prefill(model: HybridModel, prefix_len: int) -> None:
    tokens = _tokens(45)
    full_state = model.new_state()
    full = model.prefill(tokens, full_state)
    state = model.new_state()
    model.prefill(tokens[:prefix_len], state)
    resumed = model.prefill(tokens[prefix_len:], state)
    torch.testing.assert_close(resumed, full, atol=ATOL, rtol=RTOL)
    assert state.num_tokens == full_state.num_tokens == 45
    for table in ("k", "v", "conv", "ssm"):
        for lid, ref in getattr(full_state, table).items():
            torch.testing.assert_close(getattr(state, table)[lid], ref, atol=ATOL, rtol=RTOL)


def test_resume_from_a_copied_state(model: HybridModel) -> None:
    # The engine rebuilds the state from cached pages: a copy must resume like the original.
    tokens = _tokens(40, seed=1)
    state = model.new_state()
    model.prefill(tokens[:32], state)
    copy = state.clone()
    a = model.prefill(tokens[32:], state)
    b = model.prefill(tokens[32:], copy)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    full = model.prefill(tokens, model.new_state())
    torch.testing.assert_close(b, full, atol=ATOL, rtol=RTOL)


def test_decode_equals_prefill_and_all_logits(model: HybridModel) -> None:
    tokens = _tokens(20, seed=2)
    every = model.prefill(tokens, model.new_state(), all_logits=True)
    assert every.shape == (20, 256) and every.dtype == torch.float32
    state = model.new_state()
    last = model.prefill(tokens[:12], state)
    torch.testing.assert_close(last, every[11], atol=ATOL, rtol=RTOL)
    for i in range(12, 20):
        last = model.decode(int(tokens[i]), state)
        torch.testing.assert_close(last, every[i], atol=ATOL, rtol=RTOL)
    assert state.num_tokens == 20


def test_weights_follow_the_seed() -> None:
    tokens = _tokens(10)
    a = HybridModel(preset("tiny")).prefill(tokens, HybridModel(preset("tiny")).new_state())
    b = HybridModel(preset("tiny")).prefill(tokens, HybridModel(preset("tiny")).new_state())
    other = HybridModel(preset("tiny", seed=1))
    c = other.prefill(tokens, other.new_state())
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.allclose(a, c, atol=1e-2)


def test_scan_chunk_does_not_change_results() -> None:
    tokens = _tokens(40, seed=3)
    small = HybridModel(preset("tiny", scan_chunk=3))
    big = HybridModel(preset("tiny", scan_chunk=64))
    torch.testing.assert_close(
        small.prefill(tokens, small.new_state()),
        big.prefill(tokens, big.new_state()),
        atol=ATOL,
        rtol=RTOL,
    )


def test_state_shapes_match_state_spec(model: HybridModel) -> None:
    config = model.config
    spec = config.state_spec(page_size=16)
    assert spec.kv is not None and spec.mamba is not None
    assert spec.kv.layer_ids == (2, 6) and spec.mamba.layer_ids == (0, 1, 3, 4, 5, 7)
    assert spec.mamba.conv_dim == config.conv_dim == 8 * (16 + 2 * 8)
    assert spec.model_id == config.model_id
    state = model.new_state()
    model.prefill(_tokens(9), state)
    assert set(state.k) == set(spec.kv.layer_ids) and set(state.ssm) == set(spec.mamba.layer_ids)
    for lid in spec.kv.layer_ids:
        assert state.k[lid].shape == (9, spec.kv.num_kv_heads, spec.kv.head_dim)
        assert state.k[lid].dtype == spec.kv.dtype
    for lid in spec.mamba.layer_ids:
        assert state.conv[lid].shape == spec.mamba.conv_shape
        assert state.ssm[lid].shape == spec.mamba.ssm_shape
        assert state.ssm[lid].dtype == spec.mamba.ssm_dtype


def test_conv_state_holds_the_last_inputs(model: HybridModel) -> None:
    # The conv state is the in-projected xBC of the last K-1 tokens (head-major channels).
    tokens = _tokens(7)
    state = model.new_state()
    model.prefill(tokens, state)
    block = model.blocks[0]
    assert model.embed is not None
    h = model.embed[tokens]
    xbc = torch.nn.functional.linear(block.norm1(h), block.mixer.w_xbc)
    torch.testing.assert_close(state.conv[0], xbc[-3:].T, atol=ATOL, rtol=RTOL)


def test_bf16_and_gelu_variants_run() -> None:
    tokens = _tokens(24)
    ref_model = HybridModel(preset("tiny"))
    ref = ref_model.prefill(tokens, ref_model.new_state())
    bf16 = HybridModel(preset("tiny", dtype=torch.bfloat16))
    state = bf16.new_state()
    out = bf16.prefill(tokens, state)
    assert out.dtype == torch.float32 and state.k[2].dtype == torch.bfloat16
    assert state.ssm[0].dtype == torch.float32
    # Same model, bf16 rounding only: close in direction, not bit-equal.
    assert torch.nn.functional.cosine_similarity(out, ref, dim=0) > 0.99
    gelu = HybridModel(preset("tiny", mlp_kind="gelu"))
    assert torch.isfinite(gelu.prefill(tokens, gelu.new_state())).all()


def test_one_rank_mesh_equals_no_mesh(one_rank_topology, model: HybridModel) -> None:
    meshed = HybridModel(preset("tiny"), one_rank_topology, cp_kv="shard")
    assert meshed.local_layers == tuple(range(8))
    assert meshed.state_spec == preset("tiny").state_spec(16)
    tokens = _tokens(21)
    state = meshed.new_state()
    got = meshed.prefill(tokens, state)
    got = meshed.decode(int(got.argmax()), state)
    ref_state = model.new_state()
    ref = model.prefill(tokens, ref_state)
    ref = model.decode(int(ref.argmax()), ref_state)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_split_helpers() -> None:
    for n, pp in ((8, 1), (8, 3), (5, 5), (7, 2)):
        ranges = [stage_layer_range(n, pp, s) for s in range(pp)]
        assert [i for r in ranges for i in r] == list(range(n))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    assert stage_layer_range(8, 3, 0) == range(0, 3) and stage_layer_range(8, 3, 2) == range(6, 8)
    assert cp_chunk_bounds(7, 2) == [(0, 4), (4, 7)]
    assert cp_chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    owned = [kv_shard_positions(37, 16, 4, c) for c in range(4)]
    assert sorted(torch.cat(owned).tolist()) == list(range(37))
    assert owned[1][:4].tolist() == [4, 5, 6, 7] and owned[1][4:8].tolist() == [20, 21, 22, 23]


def test_bad_config_and_inputs(model: HybridModel) -> None:
    with pytest.raises(ValueError, match="layer_pattern"):
        ModelConfig(layer_pattern="SAX")
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="mlp_kind"):
        ModelConfig(mlp_kind="relu")
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("huge")
    with pytest.raises(ValueError, match="cp_kv"):
        HybridModel(preset("tiny"), cp_kv="stripe")
    with pytest.raises(ValueError, match="range"):
        model.prefill(torch.tensor([1, 256]), model.new_state())
    with pytest.raises(ValueError, match="empty"):
        model.prefill(torch.tensor([], dtype=torch.long), model.new_state())
    with pytest.raises(TypeError):
        model.prefill(torch.tensor([1.0]), model.new_state())
    with pytest.raises(ValueError, match="tp=3"):
        preset("tiny").check_mesh(tp=3, cp=1, pp=1, page_size=16, cp_kv="replicate")
    with pytest.raises(ValueError, match="page_size"):
        preset("tiny").check_mesh(tp=1, cp=3, pp=1, page_size=16, cp_kv="shard")
