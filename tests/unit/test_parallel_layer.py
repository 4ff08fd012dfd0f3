"""The runtime's parallel layer (``P``: plain attention and Mamba-2 on the same normed
input, outputs summed, as Falcon-H1) with seeded weights: it keeps K/V and a recurrent
state, splitting a prompt into chunks equals one prefill (ATOL 1e-5, float32: only the
scan's chunking differs), and Mamba-2's output norm modes (``ssm_norm``) differ."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime.model import HybridModel, preset
from runtime.model.parallel_mixer import ParallelMixer

PATTERN = "PSAP"


def _model(**overrides) -> HybridModel:
    return HybridModel(preset("tiny", layer_pattern=PATTERN, **overrides), page_size=8)


def test_a_parallel_layer_keeps_both_states() -> None:
    model = _model()
    c = model.config
    assert c.attention_layers == (0, 2, 3) and c.ssm_layers == (0, 1, 3)
    spec = c.state_spec(8)
    assert spec.kv is not None and spec.mamba is not None
    assert spec.kv.layer_ids == (0, 2, 3) and spec.mamba.layer_ids == (0, 1, 3)
    assert [isinstance(b.mixer, ParallelMixer) for b in model.blocks] == [1, 0, 0, 1]
    state = model.new_state()
    model.prefill(torch.arange(11), state)
    assert sorted(state.k) == [0, 2, 3] and sorted(state.conv) == sorted(state.ssm) == [0, 1, 3]
    assert all(state.k[i].shape[0] == 11 for i in state.k)


def test_chunks_and_decode_equal_one_prefill() -> None:
    model = _model()
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0))
    want = model.prefill(ids, model.new_state(), all_logits=True)
    state = model.new_state()
    got = [model.prefill(ids[:9], state, all_logits=True)]
    got.append(model.prefill(ids[9:20], state, all_logits=True))
    got += [model.decode(int(t), state)[None] for t in ids[20:]]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=0)


def test_ssm_norm_modes() -> None:
    ids = torch.arange(12)
    out = {}
    for mode in ("after_gate", "before_gate", "none"):
        model = _model(ssm_norm=mode)
        out[mode] = model.prefill(ids, model.new_state())
        mixer = model.blocks[1].mixer
        assert mixer.norm_w.numel() == (0 if mode == "none" else 8 * 16)  # type: ignore[union-attr]
    assert (out["after_gate"] - out["before_gate"]).abs().max() > 1e-3
    assert (out["after_gate"] - out["none"]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="ssm_norm"):
        replace(preset("tiny"), ssm_norm="none", ssm_kind="mamba1", ssm_head_dim=1, ssm_dt_rank=4)
    with pytest.raises(ValueError, match="parallel"):
        preset("tiny", layer_pattern="PA", attn_kind="windowed")
