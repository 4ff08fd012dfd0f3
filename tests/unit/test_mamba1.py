"""Mamba-1's selective scan and its cache family.

The blocked scan equals the token-by-token recurrence for any block length; cp chunks
scanned from zero and chained equal one scan (float32, ATOL 1e-5 on outputs of magnitude
~1: only the order of float sums differs). The family is the one recurrent spec: the
layout shards a Mamba-1 state by channels (conv rows and state rows alike), with no
branch on the recurrence.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mesh_hicache.layout import StateLayout
from mesh_hicache.spec import Family, KVSpec, RecurrentSpec, StateSpec
from runtime.model.mamba1 import (
    chain_states,
    entering_correction,
    naive_selective_scan,
    selective_scan,
)

C, N, INNER, K = 12, 5, 64, 4


def _inputs(t: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, C, generator=gen)
    dt = torch.rand(t, C, generator=gen) * 0.3 + 1e-3
    A = -torch.rand(C, N, generator=gen) * 8 - 0.5
    B = torch.randn(t, N, generator=gen)
    Cm = torch.randn(t, N, generator=gen)
    state = torch.randn(C, N, generator=gen)
    return x, dt, A, B, Cm, state


@pytest.mark.parametrize("block", [0, 1, 3, 8])
@pytest.mark.parametrize("t", [0, 1, 7, 20])
def test_blocked_scan_equals_recurrence(block: int, t: int) -> None:
    x, dt, A, B, Cm, state = _inputs(t)
    want = naive_selective_scan(x, dt, A, B, Cm, state)
    got = selective_scan(x, dt, A, B, Cm, state, block)
    torch.testing.assert_close(got.y, want.y, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.final_state, want.final_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cuts", [(0, 9, 20), (0, 20, 20, 20), (0, 3, 4, 11, 20)])
def test_cp_chunks_chained_equal_one_scan(cuts: tuple[int, ...]) -> None:
    x, dt, A, B, Cm, state = _inputs(20, seed=1)
    want = naive_selective_scan(x, dt, A, B, Cm, state)
    parts = [slice(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    locals_ = [selective_scan(x[p], dt[p], A, B[p], Cm[p], torch.zeros(C, N), 4) for p in parts]
    decays = torch.stack([dt[p].sum(0)[:, None] * A for p in parts])
    entering, final = chain_states(decays, torch.stack([r.final_state for r in locals_]), state)
    ys = [
        r.y + entering_correction(dt[p], A, Cm[p], entering[i])
        for i, (p, r) in enumerate(zip(parts, locals_, strict=True))
    ]
    torch.testing.assert_close(torch.cat(ys), want.y, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, want.final_state, atol=1e-5, rtol=0)


def _spec() -> StateSpec:
    rec = RecurrentSpec.mamba1(layer_ids=(0, 2, 3), inner=INNER, state_dim=N, conv_kernel=K)
    kv = KVSpec(layer_ids=(1,), num_kv_heads=2, head_dim=8)
    return StateSpec(page_size=8, kv=kv, mamba=rec, model_id="test-mamba1")


def test_mamba1_shapes() -> None:
    spec = _spec()
    rec = spec.mamba
    assert rec is not None
    assert rec.conv_shape == (INNER, K - 1)
    assert rec.ssm_shape == (INNER, 1, N)  # the bytes of [d_inner, d_state]
    assert rec.ssm_dtype == torch.float32
    assert spec.layer_family(2) is Family.MAMBA and spec.layer_family(1) is Family.KV


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_shards_channels(tp: int) -> None:
    spec = _spec()
    spec.check_tp(tp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layouts = [
            StateLayout.for_coords(spec, (1, 1, tp), (0, 0, t), "replicate") for t in range(tp)
        ]
    for lay in layouts:
        assert lay.local_ssm_heads == INNER // tp
        assert lay.local_conv_dim == INNER // tp
        conv, ssm = lay.region("mamba_conv"), lay.region("mamba_ssm")
        assert conv.local_shape[1:] == (INNER // tp, K - 1)
        assert ssm.local_shape[1:] == (INNER // tp, 1, N)
    assert layouts[0].slot_bytes == 3 * 4 * (INNER // tp) * (K - 1 + N)
