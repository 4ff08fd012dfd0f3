"""CUDA transfer engine and cupy pinned host pools (skipped without CUDA and cupy)."""

from __future__ import annotations

import threading

import pytest
import torch

from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools, cupy_cuda_available
from mesh_hicache.transfer import TransferKind, make_transfer_engine
from mesh_hicache.transfer.cuda import CudaTransferEngine
from tests.unit.transfer_support import (
    LAYERS,
    WINDOW_LAYERS,
    host_views,
    naive_apply,
    one_layer_spec,
    randomize,
    same_bits,
    snapshot,
    spec,
    tensors,
    window_spec,
)

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


def make_cuda(make_spec=spec, staging_bytes=None):
    layout = StateLayout.for_coords(make_spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(layout, num_pages=16, num_slots=6, device="cuda")
    host = HostPools(layout, num_pages=24, num_slots=8)
    if staging_bytes is None:
        return dev, host, make_transfer_engine(dev, host, kind="cuda")
    return dev, host, CudaTransferEngine(dev, host, staging_bytes=staging_bytes)


def random_ops(gen, count=30):
    ops = []
    for i in range(count):
        n = int(torch.randint(0, 10, (1,), generator=gen))
        if i % 3 == 0:  # consecutive host pages: one 2-D DMA per run
            d0 = int(torch.randint(0, 16 - n + 1, (1,), generator=gen))
            h0 = int(torch.randint(0, 24 - n + 1, (1,), generator=gen))
            pages = (list(range(d0, d0 + n)), list(range(h0, h0 + n)))
        else:
            pages = (
                torch.randperm(16, generator=gen)[:n].tolist(),
                torch.randperm(24, generator=gen)[:n].tolist(),
            )
        k = int(torch.randint(0, 4, (1,), generator=gen))
        slots = (
            torch.randperm(6, generator=gen)[:k].tolist(),
            torch.randperm(8, generator=gen)[:k].tolist(),
        )
        kind = TransferKind.BACKUP if torch.rand(1, generator=gen) < 0.5 else TransferKind.LOAD
        ops.append((kind, pages, slots))
    return ops


@pytest.mark.parametrize("make_spec", [spec, one_layer_spec], ids=["multi-layer", "one-layer"])
@pytest.mark.parametrize("staging_bytes", [None, 256], ids=["staging-64MiB", "staging-tiny"])
def test_cuda_random_ops_equal_naive_sequential_copies(make_spec, staging_bytes):
    # A tiny staging buffer cuts every op into many chunks (one row or a few each).
    gen = torch.Generator().manual_seed(7)
    dev, host, eng = make_cuda(make_spec, staging_bytes)
    randomize(dev, gen)
    for t in host_views(host).values():
        raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
        raw.copy_(torch.randint(-(2**15), 2**15, raw.shape, generator=gen).to(raw.dtype))
    ref_dev = {k: v.cpu() for k, v in tensors(dev).items()}
    ref_host = {k: v.clone() for k, v in host_views(host).items()}
    ops = random_ops(gen)
    handles = [(eng.backup if k is TransferKind.BACKUP else eng.load)(p, s) for k, p, s in ops]
    assert all(h.wait(timeout=60) for h in handles)
    eng.close()
    for kind, pages, slots in ops:
        naive_apply(ref_dev, ref_host, kind, pages, slots)
    torch.cuda.synchronize()
    for key, t in tensors(dev).items():
        assert same_bits(t.cpu(), ref_dev[key]), key
    for key, t in host_views(host).items():
        assert same_bits(t, ref_host[key]), key


def test_cuda_load_layer_readiness_and_caller_stream_writes():
    torch.manual_seed(9)
    dev, host, eng = make_cuda()
    pages, hosts = [2, 3, 4, 9], [5, 6, 7, 0]
    # Written on the default stream and backed up at once, without a synchronize: the
    # engine's stream must wait for the caller's work.
    for t in tensors(dev).values():
        t.view(torch.uint8).random_(0, 256)
    expected = {
        k: v[pages if k[0] not in ("conv", "ssm") else [0, 1]].cpu()
        for k, v in tensors(dev).items()
    }
    assert eng.backup((pages, hosts), ([0, 1], [3, 4])).wait()
    for t in tensors(dev).values():
        t.zero_()
    h = eng.load(([10, 11, 12, 13], hosts), ([4, 5], [3, 4]))
    for layer in LAYERS:
        assert h.wait_layer(layer, timeout=60)
        for (name, lid), t in tensors(dev).items():
            if lid == layer:  # in place once wait_layer returned, readable on any stream
                idx = [4, 5] if name in ("conv", "ssm") else [10, 11, 12, 13]
                assert same_bits(t[idx].cpu(), expected[(name, lid)]), (name, lid)
    assert h.wait() and h.ack is not None and h.ack.ok
    eng.close()


def test_cuda_waiter_copies_when_worker_stalls():
    dev, host, eng = make_cuda()
    stalled = threading.Event()
    eng._worker = threading.Thread(target=stalled.wait, name="stalled", daemon=True)
    for t in tensors(dev).values():
        t.view(torch.uint8).fill_(7)
    b = eng.backup(([1, 2], [3, 4]), ([0], [1]))
    assert b.wait(timeout=60) and b.ack is not None and b.ack.ok
    assert host.local("kv")[[3, 4]].view(torch.uint8).eq(7).all()
    assert host.local("mamba_ssm")[1].view(torch.uint8).eq(7).all()
    stalled.set()
    eng.close()


def test_cuda_backup_sees_writes_on_the_submitters_stream():
    dev, host, eng = make_cuda()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the write lands late on this stream
        dev.k(0)[5].fill_(3.0)
        h = eng.backup(([5], [2]))  # submitted on the side stream
    assert h.wait(timeout=60)
    assert host.local("kv")[2, 0, 0].float().eq(3.0).all()
    eng.close()


@pytest.mark.parametrize("staging_bytes", [None, 256], ids=["staging-64MiB", "staging-tiny"])
def test_cuda_window_pages_go_by_their_own_ids(staging_bytes):
    # Windowed layers' K/V by (device page, host window id) pairs, mixed with pages and
    # slots; host window ids are fewer than host pages and unrelated to them.
    gen = torch.Generator().manual_seed(17)
    layout = StateLayout.for_coords(window_spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(layout, num_pages=16, num_slots=6, device="cuda")
    host = HostPools(layout, num_pages=24, num_slots=8, num_window_pages=10)
    if staging_bytes is None:
        eng = make_transfer_engine(dev, host, kind="cuda")
    else:
        eng = CudaTransferEngine(dev, host, staging_bytes=staging_bytes)
    randomize(dev, gen)
    for t in host_views(host).values():
        raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
        raw.copy_(torch.randint(-(2**15), 2**15, raw.shape, generator=gen).to(raw.dtype))
    ref_dev = {k: v.cpu() for k, v in tensors(dev).items()}
    ref_host = {k: v.clone() for k, v in host_views(host).items()}
    ops = []
    for kind, pages, slots in random_ops(gen, count=20):
        k = int(torch.randint(0, len(pages[0]) + 1, (1,), generator=gen))
        windows = (pages[0][:k], torch.randperm(10, generator=gen)[:k].tolist())
        ops.append((kind, pages, slots, windows))
    ops.append((TransferKind.BACKUP, ([3, 4, 5], [0, 1, 2]), ((), ()), ([3, 4, 5], [9, 8, 7])))
    handles = [
        (eng.backup if k is TransferKind.BACKUP else eng.load)(p, s, w) for k, p, s, w in ops
    ]
    h = eng.load(([0, 1, 2], [0, 1, 2]), window_pages=([10, 11, 12], [9, 8, 7]))
    assert all(h.wait_layer(layer, timeout=60) for layer in LAYERS)
    assert all(x.wait(timeout=60) for x in handles) and h.wait()
    with pytest.raises(ValueError, match="window_pages: host index out of range"):
        eng.backup(window_pages=([0], [10]))
    eng.close()
    ops.append((TransferKind.LOAD, ([0, 1, 2], [0, 1, 2]), ((), ()), ([10, 11, 12], [9, 8, 7])))
    for kind, pages, slots, windows in ops:
        naive_apply(ref_dev, ref_host, kind, pages, slots, windows, WINDOW_LAYERS)
    torch.cuda.synchronize()
    for key, t in tensors(dev).items():
        assert same_bits(t.cpu(), ref_dev[key]), key
    for key, t in host_views(host).items():
        assert same_bits(t, ref_host[key]), key
