"""A short convolution (LFM2) is the recurrent family with a conv state only: declared by
``MambaSpec.short_conv``, it has no ``mamba_ssm`` region, no recurrent bytes in a slot, and
tp shards its channels into contiguous blocks; nothing below the spec asks which model
produced it."""

from __future__ import annotations

import warnings

import pytest
import torch

from mesh_hicache.choices import RegionName
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.radix.eviction import CostModel
from mesh_hicache.spec import Family, KVSpec, MambaSpec, StateSpec
from mesh_hicache.tiers.reshard import row_maps

CHANNELS, K = 32, 3
CONV_LAYERS = (0, 2, 3)


def _spec(dtype: torch.dtype = torch.float32) -> StateSpec:
    conv = MambaSpec.short_conv(
        layer_ids=CONV_LAYERS, channels=CHANNELS, conv_kernel=K, conv_dtype=dtype
    )
    kv = KVSpec(layer_ids=(1, 4), num_kv_heads=2, head_dim=8, dtype=dtype)
    return StateSpec(model_id="test-shortconv", page_size=8, kv=kv, mamba=conv)


def _layouts(spec: StateSpec, tp: int) -> list[StateLayout]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [StateLayout.for_coords(spec, (1, 1, tp), (0, 0, t), "replicate") for t in range(tp)]


def test_short_conv_declares_a_conv_state_only() -> None:
    spec = _spec()
    conv = spec.mamba
    assert conv is not None and not conv.recurrent
    assert conv.conv_shape == (CHANNELS, K - 1)
    assert spec.layer_family(2) is Family.MAMBA and spec.layer_family(1) is Family.KV
    assert MambaSpec(  # the default keeps a recurrent state
        layer_ids=(0,), conv_dim=8, conv_kernel=4, num_heads=2, head_dim=4, state_dim=2
    ).recurrent
    with pytest.raises(ValueError, match="recurrent must be a bool"):
        MambaSpec(
            layer_ids=(0,), conv_dim=8, conv_kernel=4, num_heads=8, head_dim=1, state_dim=1,
            recurrent="no",  # type: ignore[arg-type]
        )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_shards_channels_without_a_recurrent_region(tp: int) -> None:
    spec = _spec(torch.bfloat16)
    spec.check_tp(tp)
    width = CHANNELS // tp
    for t, lay in enumerate(_layouts(spec, tp)):
        assert [r.name for r in lay.regions] == [RegionName.KV, RegionName.MAMBA_CONV]
        assert not lay.has_region(RegionName.MAMBA_SSM)
        assert lay.local_conv_dim == width
        # A slot is the conv windows of the conv layers, nothing else.
        assert lay.slot_bytes == len(CONV_LAYERS) * width * (K - 1) * 2
        conv = lay.region(RegionName.MAMBA_CONV)
        assert conv.local_shape == (len(CONV_LAYERS), width, K - 1)
        # Reshard sees the rank's channels as one contiguous block of the global ones.
        assert row_maps(lay, conv)[1] == ((t * width, (t + 1) * width, 0),)
    with pytest.raises(ValueError, match="divisible by tp=3"):
        conv = MambaSpec.short_conv(layer_ids=(0,), channels=CHANNELS, conv_kernel=K)
        StateSpec(model_id="m", page_size=8, mamba=conv).check_tp(3)


def test_device_pools_hold_no_recurrent_state() -> None:
    spec = _spec()
    lay = _layouts(spec, 1)[0]
    pools = DevicePools(lay, num_pages=4, num_slots=2)
    assert pools.conv(2).shape == (2, CHANNELS, K - 1)
    with pytest.raises(ValueError, match="conv state only"):
        pools.ssm(2)
    kv_bytes = 2 * 2 * 4 * 8 * 2 * 8 * 4  # layers, K and V, pages, tokens, heads, dim, fp32
    assert pools.nbytes == kv_bytes + len(CONV_LAYERS) * 2 * CHANNELS * (K - 1) * 4


def test_cost_model_counts_conv_bytes_only() -> None:
    cost = CostModel.from_spec(_spec())
    assert cost.state_bytes == len(CONV_LAYERS) * CHANNELS * (K - 1) * 4
