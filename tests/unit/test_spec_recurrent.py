"""The recurrent family is one spec for every producer (Mamba-2, Gated DeltaNet): the
layout shards a Gated DeltaNet state by value heads (state dim 0 and their v channels)
and its key heads like B/C groups, with no branch on the recurrence."""

from __future__ import annotations

import warnings

import pytest
import torch

from mesh_hicache.layout import StateLayout
from mesh_hicache.spec import Family, KVSpec, MambaSpec, RecurrentSpec, StateSpec

KEY_HEADS, VALUE_HEADS, DK, DV, K = 2, 8, 16, 12, 4


def _spec() -> StateSpec:
    rec = RecurrentSpec.gated_deltanet(
        layer_ids=(0, 1, 3), key_heads=KEY_HEADS, value_heads=VALUE_HEADS,
        key_dim=DK, value_dim=DV, conv_kernel=K,
    )  # fmt: skip
    kv = KVSpec(layer_ids=(2,), num_kv_heads=2, head_dim=8)
    return StateSpec(model_id="test-model", page_size=8, kv=kv, mamba=rec)


def test_gated_deltanet_shapes() -> None:
    spec = _spec()
    rec = spec.mamba
    assert RecurrentSpec is MambaSpec and rec is not None
    assert rec.conv_shape == (2 * KEY_HEADS * DK + VALUE_HEADS * DV, K - 1)
    assert rec.ssm_shape == (VALUE_HEADS, DV, DK)
    assert rec.ssm_dtype == torch.float32
    assert spec.layer_family(1) is Family.MAMBA and spec.layer_family(2) is Family.KV


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_shards_value_heads_and_key_groups(tp: int) -> None:
    spec = _spec()
    spec.check_tp(tp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layouts = [
            StateLayout.for_coords(spec, (1, 1, tp), (0, 0, t), "replicate") for t in range(tp)
        ]
    for lay in layouts:
        assert lay.local_ssm_heads == VALUE_HEADS // tp
        # Each rank: the v channels of its value heads, plus q and k of its key heads
        # (its share of them when key heads >= tp, else one replicated key head).
        key_local = max(KEY_HEADS // tp, 1)
        assert lay.local_conv_dim == VALUE_HEADS // tp * DV + 2 * key_local * DK
