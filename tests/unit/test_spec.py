"""StateSpec validation: bad specs name the offending field."""

from __future__ import annotations

import pytest
import torch

from mesh_hicache.spec import Family, IndexerSpec, KVSpec, MambaSpec, StateSpec


def kv(**kw):
    base = dict(layer_ids=(1, 3), num_kv_heads=2, head_dim=8)
    return KVSpec(**{**base, **kw})


def mamba(**kw):
    base = dict(layer_ids=(0, 2), conv_dim=32, conv_kernel=4, num_heads=4, head_dim=4, state_dim=8)
    return MambaSpec(**{**base, **kw})


def test_hybrid_spec():
    spec = StateSpec(
        model_id="test-model", page_size=16, kv=kv(), mamba=mamba(ssm_dtype=torch.bfloat16)
    )
    assert spec.num_layers == 4 and spec.families == (Family.KV, Family.MAMBA)
    assert spec.layer_family(2) is Family.MAMBA and spec.layer_family(3) is Family.KV
    assert spec.mamba.conv_shape == (32, 3) and spec.mamba.ssm_shape == (4, 4, 8)
    spec.check_tp(2)
    spec.check_tp(4)  # 2 kv heads replicated over 4 tp ranks


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (
            lambda: StateSpec(model_id="test-model", page_size=0, kv=kv(layer_ids=(0, 1))),
            "page_size",
        ),
        (lambda: kv(num_kv_heads=-1), "num_kv_heads"),
        (lambda: kv(head_dim=0), "head_dim"),
        (lambda: kv(layer_ids=()), "layer_ids"),
        (lambda: kv(layer_ids=(3, 1)), "layer_ids"),
        (lambda: mamba(conv_kernel=1), "conv_kernel"),
        (lambda: mamba(conv_dim=30), "conv_dim"),
        (lambda: mamba(state_dim=-2), "state_dim"),
        (lambda: mamba(ssm_dtype="float32"), "ssm_dtype"),
        (
            lambda: StateSpec(
                model_id="test-model",
                page_size=4,
                kv=kv(layer_ids=(0, 5)),
                mamba=mamba(layer_ids=(1,)),
            ),
            "cover",
        ),
        (lambda: StateSpec(model_id="test-model", page_size=4), "neither"),
        (
            lambda: StateSpec(
                model_id="test-model",
                page_size=4,
                kv=kv(layer_ids=(0,)),
                indexer=IndexerSpec(layer_ids=(1,), key_dim=4),
            ),
            "indexer",
        ),
    ],
)
def test_bad_specs(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize(
    ("heads", "tp", "ok"), [(8, 2, True), (2, 8, True), (6, 4, False), (3, 2, False)]
)
def test_check_tp_kv_heads(heads, tp, ok):
    spec = StateSpec(model_id="test-model", page_size=4, kv=kv(layer_ids=(0,), num_kv_heads=heads))
    if ok:
        spec.check_tp(tp)
    else:
        with pytest.raises(ValueError, match="num_kv_heads"):
            spec.check_tp(tp)


def test_check_tp_mamba_heads():
    spec = StateSpec(
        model_id="test-model", page_size=4, mamba=mamba(layer_ids=(0,), num_heads=4, conv_dim=8)
    )
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by tp=8"):
        spec.check_tp(8)
