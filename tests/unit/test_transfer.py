"""Transfer engine (CPU): round trips, layer readiness, acks, failure injection, close."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools
from mesh_hicache.spec import Family, IndexerSpec, KVSpec, MambaSpec, StateSpec
from mesh_hicache.transfer import (
    CpuTransferEngine,
    TransferAck,
    TransferKind,
    make_transfer_engine,
)
from mesh_hicache.transfer.cpu import index_runs

LAYERS = (0, 1, 2, 3, 4, 5)


def spec() -> StateSpec:
    return StateSpec(
        page_size=4,
        kv=KVSpec(layer_ids=(0, 1, 3, 5), num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
        mamba=MambaSpec(
            layer_ids=(2, 4),
            conv_dim=4,
            conv_kernel=3,
            num_heads=2,
            head_dim=2,
            state_dim=4,
            conv_dtype=torch.bfloat16,
            ssm_dtype=torch.float32,
        ),
        indexer=IndexerSpec(layer_ids=(1, 5), key_dim=3, dtype=torch.float16),
    )


def make(num_pages=12, num_slots=5, host_pages=20, host_slots=7):
    layout = StateLayout.for_coords(spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(layout, num_pages=num_pages, num_slots=num_slots)
    host = HostPools(layout, num_pages=host_pages, num_slots=host_slots, pinned=False)
    return dev, host, CpuTransferEngine(dev, host)


def tensors(dev: DevicePools) -> dict[tuple[str, int], torch.Tensor]:
    out = {}
    for layer in dev.layers(Family.KV):
        out[("k", layer)] = dev.k(layer)
        out[("v", layer)] = dev.v(layer)
    for layer in dev.layers(Family.INDEXER):
        out[("indexer", layer)] = dev.indexer(layer)
    for layer in dev.layers(Family.MAMBA):
        out[("conv", layer)] = dev.conv(layer)
        out[("ssm", layer)] = dev.ssm(layer)
    return out


def randomize(dev: DevicePools, gen: torch.Generator) -> None:
    for t in tensors(dev).values():
        # Random bit patterns (NaNs included) make "bit-exact" a real check.
        raw = t.view(torch.int16)
        raw.copy_(torch.randint(-(2**15), 2**15, raw.shape, generator=gen, dtype=torch.int16))


def snapshot(dev: DevicePools) -> dict[tuple[str, int], torch.Tensor]:
    return {k: t.clone() for k, t in tensors(dev).items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_index_runs():
    assert index_runs([3, 4, 5, 9, 1, 2], [7, 8, 0, 1, 2, 3]) == [
        (3, 7, 2),
        (5, 0, 1),
        (9, 1, 1),
        (1, 2, 2),
    ]
    assert index_runs([], []) == []


@pytest.mark.parametrize("runs", [False, True])  # True: consecutive stretches, copied as blocks
def test_round_trip_is_bit_exact_in_random_orders(runs):
    gen = torch.Generator().manual_seed(0)
    dev, host, eng = make()
    with eng:
        randomize(dev, gen)
        before = snapshot(dev)
        src_pages = torch.randperm(12, generator=gen)[:9].tolist()
        host_pages = torch.randperm(20, generator=gen)[:9].tolist()
        if runs:
            src_pages, host_pages = [5, 6, 7, 8, 0, 1, 2, 10, 11], [3, 4, 5, 6, 0, 1, 9, 12, 13]
        src_slots = torch.randperm(5, generator=gen)[:4].tolist()
        host_slots = torch.randperm(7, generator=gen)[:4].tolist()
        assert eng.backup((src_pages, host_pages), (src_slots, host_slots)).wait()
        # The host row of a page holds that page of every layer, in layer-row order.
        kv_row = host.row("kv", host_pages[0])
        for i, layer in enumerate(host.region("kv").local_layer_ids):
            assert same_bits(kv_row[i, 0], before[("k", layer)][src_pages[0]])
            assert same_bits(kv_row[i, 1], before[("v", layer)][src_pages[0]])
        for t in tensors(dev).values():
            t.zero_()
        # Load into other device pages, in another order.
        perm = torch.randperm(9, generator=gen).tolist()
        dst_pages = torch.randperm(12, generator=gen)[:9].tolist()
        dst_slots = torch.randperm(5, generator=gen)[:4].tolist()
        handle = eng.load((dst_pages, [host_pages[i] for i in perm]), (dst_slots, host_slots[::-1]))
        assert handle.wait() and handle.ok and handle.done
        for (name, layer), t in tensors(dev).items():
            if name in ("conv", "ssm"):
                for d, s in zip(dst_slots, src_slots[::-1], strict=True):
                    assert same_bits(t[d], before[(name, layer)][s])
                untouched = [s for s in range(5) if s not in dst_slots]
            else:
                for d, i in zip(dst_pages, perm, strict=True):
                    assert same_bits(t[d], before[(name, layer)][src_pages[i]])
                untouched = [p for p in range(12) if p not in dst_pages]
            assert t[untouched].view(torch.uint8).eq(0).all()
        acks = eng.poll()
        assert [(a.op_id, a.kind, a.ok) for a in acks] == [
            (0, TransferKind.BACKUP, True),
            (1, TransferKind.LOAD, True),
        ]
        assert eng.poll() == []


def test_load_goes_layer_by_layer():
    gen = torch.Generator().manual_seed(1)
    dev, host, eng = make()
    randomize(dev, gen)
    pages, slots = [3, 7, 1], [2, 0]
    eng.backup((pages, [0, 1, 2]), (slots, [0, 1])).wait()
    before = snapshot(dev)
    for t in tensors(dev).values():
        t.zero_()
    seen: list[int] = []
    release = threading.Event()
    original = eng._layer_ready

    def observe(op, position):
        layer = eng.layer_ids[position]
        seen.append(layer)
        # At this moment, this layer and earlier ones are in place, later ones are not.
        for (name, lid), t in tensors(dev).items():
            idx = slots if name in ("conv", "ssm") else pages
            loaded = same_bits(t[idx], before[(name, lid)][idx])
            assert loaded == (lid <= layer), (name, lid, layer)
        original(op, position)
        if position == 0:
            release.wait(timeout=30)

    eng._layer_ready = observe  # type: ignore[method-assign]
    handle = eng.load((pages, [0, 1, 2]), (slots, [0, 1]))
    # The worker is held after layer 0: layer 0 is usable while later layers are not.
    assert handle.wait_layer(0)
    assert not handle.done
    assert not handle.wait_layer(1, timeout=0.01)
    release.set()
    assert handle.wait_layer(5) and handle.wait()
    assert seen == list(LAYERS)
    # A finished op answers at once, for every layer.
    assert all(handle.wait_layer(layer) for layer in LAYERS)
    with pytest.raises(ValueError, match="layer 9"):
        handle.wait_layer(9)
    eng.close()


def test_failure_mid_operation_acks_once_and_engine_recovers():
    gen = torch.Generator().manual_seed(2)
    dev, host, eng = make()
    randomize(dev, gen)
    got: list[TransferAck] = []
    host_pages = host.page_allocator.allocate(2)
    eng.fail_next(at_layer=2)
    bad = eng.backup(([0, 1], host_pages), ([0], [0]), on_done=got.append)
    assert not bad.wait() and bad.done and not bad.ok
    assert bad.wait_layer(0) and bad.wait_layer(1)  # copied before the failure
    assert not bad.wait_layer(2) and not bad.wait_layer(5)  # never copied: no hang
    assert "injected" in (bad.error or "")
    # Layers after the failure point were not touched.
    assert host.local("mamba_ssm").eq(0).all()
    assert (
        host.local("kv")[host_pages, host.region("kv").layer_row(3)].view(torch.uint8).eq(0).all()
    )
    good = eng.backup(([0, 1], host_pages), ([0], [0]), on_done=got.append)
    assert good.wait()
    acks = eng.poll()
    assert [(a.op_id, a.ok) for a in acks] == [(0, False), (1, True)]
    assert acks[0].error is not None and "InjectedFailure" in acks[0].error
    assert got == acks  # callbacks: exactly once each, same records
    assert eng.poll() == []
    # The engine never frees the caller's reservations.
    assert host.page_allocator.num_used == 2
    assert same_bits(host.row("kv", host_pages[1])[0, 0], dev.k(0)[1])
    eng.close()


def test_fail_at_first_layer_and_bad_input():
    dev, host, eng = make()
    eng.fail_next()
    h = eng.load(([0], [0]))
    assert not h.wait() and not h.wait_layer(0)
    with pytest.raises(ValueError, match="out of range"):
        eng.backup(([12], [0]))
    with pytest.raises(ValueError, match="2 device vs 1 host"):
        eng.backup(([0, 1], [0]))
    with pytest.raises(ValueError, match="at_layer"):
        eng.fail_next(at_layer=42)
    eng.close()
    assert [a.ok for a in eng.poll()] == [False]


def test_close_acks_pending_and_rejects_new_ops():
    dev, host, eng = make()
    gate = threading.Event()
    original = eng._layer_ready

    def hold(op, position):
        original(op, position)
        gate.wait(timeout=30)

    eng._layer_ready = hold  # type: ignore[method-assign]
    handles = [eng.backup(([i], [i])) for i in range(4)]
    assert handles[0].wait_layer(0)  # op 0 is running (held after its first layer)
    closer = threading.Thread(target=eng.close)
    closer.start()
    while not eng.closed:
        time.sleep(0.001)
    gate.set()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert all(h.done for h in handles)
    acks = eng.poll()
    assert [(a.op_id, a.ok) for a in acks] == [(0, True), (1, False), (2, False), (3, False)]
    assert {a.error for a in acks[1:]} == {"engine closed"}
    with pytest.raises(RuntimeError, match="closed"):
        eng.backup(([0], [0]))
    eng.close()  # idempotent


def test_empty_op_and_factory():
    dev, host, _ = make()
    eng = make_transfer_engine(dev, host)
    assert isinstance(eng, CpuTransferEngine)
    h = eng.load()
    assert h.wait() and all(h.wait_layer(layer) for layer in LAYERS)
    with pytest.raises(ValueError, match="kind"):
        make_transfer_engine(dev, host, kind="nvme")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            make_transfer_engine(dev, host, kind="cuda")
    eng.close()
