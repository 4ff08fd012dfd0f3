"""CUDA transfer engine and cupy pinned host pools (skipped without CUDA and cupy)."""

from __future__ import annotations

import pytest
import torch

from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools, cupy_cuda_available
from mesh_hicache.transfer import TransferKind, make_transfer_engine
from tests.unit.test_transfer import LAYERS, randomize, same_bits, snapshot, spec, tensors

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not cupy_cuda_available(), reason="needs CUDA with cupy"),
]


def make():
    layout = StateLayout.for_coords(spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(layout, num_pages=12, num_slots=5, device="cuda")
    host = HostPools(layout, num_pages=20, num_slots=7)
    return dev, host, make_transfer_engine(dev, host)


def test_host_pool_is_cupy_pinned():
    _, host, eng = make()
    assert host.pinned and eng.kind == "cuda"
    assert host.local("kv").is_pinned() and host.local("mamba_ssm").is_pinned()
    eng.close()


def test_cuda_round_trip_bit_exact():
    gen = torch.Generator().manual_seed(0)
    dev, host, eng = make()
    randomize(dev, gen)
    before = snapshot(dev)
    src = torch.randperm(12, generator=gen)[:9].tolist()
    hp = torch.randperm(20, generator=gen)[:9].tolist()
    first = eng.backup((src, hp), ([4, 0], [6, 2]))
    assert first.wait()
    for t in tensors(dev).values():
        t.zero_()
    h = eng.load((src[::-1], hp[::-1]), ([1, 3], [6, 2]))
    assert all(h.wait_layer(layer) for layer in LAYERS) and h.wait()
    for (name, layer), t in tensors(dev).items():
        if name in ("conv", "ssm"):
            assert same_bits(t[[1, 3]], before[(name, layer)][[4, 0]])
        else:
            assert same_bits(t[src], before[(name, layer)][src])
    acks = [first.ack, h.ack]
    assert [(a.kind, a.ok) for a in acks if a is not None] == [
        (TransferKind.BACKUP, True),
        (TransferKind.LOAD, True),
    ]
    eng.close()


def test_cuda_failure_injection_acks_once():
    dev, host, eng = make()
    eng.fail_next(at_layer=3)
    bad = eng.load(([0, 1], [0, 1]), ([0], [0]))
    assert not bad.wait() and bad.wait_layer(2) and not bad.wait_layer(3)
    good = eng.backup(([0], [0]))
    assert good.wait()
    assert [(h.ack.ok if h.ack else None) for h in (bad, good)] == [False, True]
    eng.close()
