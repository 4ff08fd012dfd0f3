"""Transfer engine (CPU): round trips, layer readiness, acks, failure injection, close."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Sized

import numpy as np
import pytest
import torch

from mesh_hicache import native
from mesh_hicache.transfer import (
    CpuTransferEngine,
    TransferKind,
    make_transfer_engine,
)
from mesh_hicache.transfer import cpu as cpu_module
from mesh_hicache.transfer import segments as segments_module
from mesh_hicache.transfer.segments import IndexKind, index_runs
from tests.unit.transfer_support import (
    LAYERS,
    WINDOW_LAYERS,
    host_views,
    make,
    on_worker,
    randomize,
    same_bits,
    snapshot,
    tensors,
    window_spec,
)


def test_index_runs():
    def runs(src, dst):
        r = index_runs(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
        return list(zip(r.src.tolist(), r.dst.tolist(), r.length.tolist(), strict=True))

    assert runs([3, 4, 5, 9, 1, 2], [7, 8, 0, 1, 2, 3]) == [
        (3, 7, 2),
        (5, 0, 1),
        (9, 1, 1),
        (1, 2, 2),
    ]
    assert runs([], []) == []
    assert runs([4], [0]) == [(4, 0, 1)]


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
        first = eng.backup((src_pages, host_pages), (src_slots, host_slots))
        assert first.wait()
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
        acks = [first.ack, handle.ack]
        assert [(a.op_id, a.kind, a.ok, a.error) for a in acks if a is not None] == [
            (0, TransferKind.BACKUP, True, None),
            (1, TransferKind.LOAD, True, None),
        ]


def test_load_goes_layer_by_layer(monkeypatch, queued):
    monkeypatch.setattr(cpu_module, "SINGLE_PASS_BYTES", 0)  # this small load too
    gen = torch.Generator().manual_seed(1)
    dev, host, eng = make()
    randomize(dev, gen)
    pages, slots = [3, 7, 1], [2, 0]
    eng.backup((pages, [0, 1, 2]), (slots, [0, 1])).wait()
    before = snapshot(dev)
    for t in tensors(dev).values():
        t.zero_()
    seen: list[int] = []
    release, reached = threading.Event(), threading.Event()
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
        if position == 0 and on_worker():
            reached.set()
            release.wait(timeout=30)

    eng._layer_ready = observe  # type: ignore[method-assign]
    handle = eng.load((pages, [0, 1, 2]), (slots, [0, 1]))
    # The worker is held after layer 0: layer 0 is usable while later layers are not
    # (and a waiter cannot copy them while the worker holds the copy role).
    assert reached.wait(timeout=30)
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


def test_failure_mid_operation_acks_once_and_engine_recovers(finished):
    gen = torch.Generator().manual_seed(2)
    dev, host, eng = make()
    randomize(dev, gen)
    host_pages = host.page_allocator.allocate(2)
    eng.fail_next(at_layer=2)
    bad = eng.backup(([0, 1], host_pages), ([0], [0]))
    assert not bad.wait() and bad.done and not bad.ok
    assert bad.wait_layer(0) and bad.wait_layer(1)  # copied before the failure
    assert not bad.wait_layer(2) and not bad.wait_layer(5)  # never copied: no hang
    assert "injected" in (bad.error or "")
    # Layers after the failure point were not touched.
    assert host.local("mamba_ssm").eq(0).all()
    assert (
        host.local("kv")[host_pages, host.region("kv").layer_row(3)].view(torch.uint8).eq(0).all()
    )
    good = eng.backup(([0, 1], host_pages), ([0], [0]))
    assert good.wait()
    eng.close()
    acks = [bad.ack, good.ack]
    assert [(a.op_id, a.ok) for a in acks if a is not None] == [(0, False), (1, True)]
    assert bad.ack is not None and "InjectedFailure" in (bad.ack.error or "")
    # Exactly once each, in completion order, with the same records the handles carry.
    assert finished == [(a.op_id, a.ok, a.error) for a in acks if a is not None]
    # The engine never frees the caller's reservations.
    assert host.page_allocator.num_used == 2
    assert same_bits(host.row("kv", host_pages[1])[0, 0], dev.k(0)[1])


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
    assert h.ack is not None and not h.ack.ok and "InjectedFailure" in (h.ack.error or "")


def test_close_acks_pending_and_rejects_new_ops(finished, queued):
    dev, host, eng = make()
    gate = threading.Event()
    original = eng._layer_ready

    reached = threading.Event()

    def hold(op, position):
        original(op, position)
        if on_worker():
            reached.set()
            gate.wait(timeout=30)

    eng._layer_ready = hold  # type: ignore[method-assign]
    handles = [eng.backup(([i], [i])) for i in range(4)]
    assert reached.wait(timeout=30)  # op 0 is running (held after its first layer)
    closer = threading.Thread(target=eng.close)
    closer.start()
    while not eng.closed:
        time.sleep(0.001)
    gate.set()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert all(h.done for h in handles)
    acks = [h.ack for h in handles]
    assert [(a.op_id, a.ok) for a in acks if a] == [(0, True), (1, False), (2, False), (3, False)]
    assert {a.error for a in acks[1:]} == {"engine closed"}
    assert [(op, ok) for op, ok, _ in finished] == [(0, True), (1, False), (2, False), (3, False)]
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


def test_engine_keeps_nothing_of_finished_operations():
    # Nobody reads completions here (as in the library): nothing may pile up.
    dev, host, eng = make()
    refs = []
    for i in range(300):
        h = eng.backup(([i % 12], [i % 20]), ([i % 5], [i % 7]))
        refs.append(weakref.ref(h))
    assert h.wait()
    del h
    deadline = time.monotonic() + 30
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert all(r() is None for r in refs), "the engine still references finished operations"
    # No container on the engine grew with the operations (an unread ack queue did).
    sizes = {k: len(v) for k, v in vars(eng).items() if isinstance(v, Sized)}
    assert all(n < 300 for n in sizes.values()), sizes
    eng.close()


def test_every_operation_acks_exactly_once_under_failures_and_close(finished):
    gen = torch.Generator().manual_seed(5)
    dev, host, eng = make()
    boom = {3, 7, 8}
    original = eng._steps

    def flaky(op):
        if op.handle.op_id in boom:
            raise OSError(f"disk on fire in op {op.handle.op_id}")
        return original(op)

    eng._steps = flaky  # type: ignore[method-assign]
    handles = []
    for i in range(12):
        if i in (5, 10):
            eng.fail_next(at_layer=LAYERS[int(torch.randint(0, 6, (1,), generator=gen))])
        pages = torch.randperm(12, generator=gen)[: 1 + i % 5].tolist()
        hosts = torch.randperm(20, generator=gen)[: len(pages)].tolist()
        submit = eng.backup if i % 2 else eng.load
        handles.append(submit((pages, hosts), ([i % 5], [i % 7])))
    assert handles[-1].wait(timeout=30)
    eng.close()
    ids = [op for op, _, _ in finished]
    assert ids == list(range(12))  # exactly once each, in submission (= completion) order
    for h, (op, ok, error) in zip(handles, finished, strict=True):
        assert (
            h.done and h.ack is not None and (h.ack.op_id, h.ack.ok, h.ack.error) == (op, ok, error)
        )
        assert ok == (op not in boom | {5, 10})
        if op in boom:
            assert error == f"OSError: disk on fire in op {op}"
        if op in (5, 10):
            assert "InjectedFailure" in (error or "")


# -- windowed layers: a third index pair (device pages, host window ids) ------------------


def window_engine(path: str, monkeypatch):
    """Engine on :func:`window_spec` pools: 12 device pages, 20 host pages, 7 host window
    ids. ``path``: ``native`` (the C segment loop), ``numpy`` (its Python fallback: bulk
    addresses and numpy blocks) or ``memmove`` (fallback, every row by memmove, layer by
    layer)."""
    if path == "native" and native.segment_copier() is None:
        pytest.skip("native copy loops need a C compiler (cc) and libcrypto")
    if path == "memmove":
        monkeypatch.setattr(segments_module, "SMALL_ROW_BYTES", 0)
        monkeypatch.setattr(cpu_module, "SINGLE_PASS_BYTES", 0)
    dev, host, eng = make(host_windows=7, make_spec=window_spec)
    if path != "native":
        eng._copy_segments = None
    if path == "memmove":
        eng._copy_rows = None
    return dev, host, eng


def fill_host(host, gen) -> dict[tuple[str, int], torch.Tensor]:
    """Random bits in every host row; a copy of them."""
    for t in host_views(host).values():
        raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
        raw.copy_(torch.randint(-(2**15), 2**15, raw.shape, generator=gen).to(raw.dtype))
    return {k: v.clone() for k, v in host_views(host).items()}


@pytest.mark.parametrize("path", ["native", "numpy", "memmove"])
def test_window_pages_round_trip_by_their_own_ids(path, monkeypatch):
    gen = torch.Generator().manual_seed(21)
    dev, host, eng = window_engine(path, monkeypatch)
    assert host.num_window_pages == 7 and host.local("kv_window").shape[0] == 7
    kinds = {(eng.layer_ids[s.layer_pos], s.part): s.kind for s in eng.segments.segments}
    for layer in WINDOW_LAYERS:
        assert kinds[(layer, "k")] is kinds[(layer, "v")] is IndexKind.WINDOWS
    assert kinds[(1, "k")] is kinds[(1, "indexer")] is IndexKind.PAGES
    assert kinds[(2, "conv")] is IndexKind.SLOTS
    randomize(dev, gen)
    before = snapshot(dev)
    host_before = fill_host(host, gen)
    pages, host_pages = [3, 7, 1, 9, 0], [0, 1, 2, 3, 4]
    # Windows of three of the pages only, in ids unrelated to the host pages.
    windows, window_ids = [7, 9, 0], [6, 5, 1]
    slots, host_slots = [4, 0], [2, 6]
    with eng:
        assert eng.backup((pages, host_pages), (slots, host_slots), (windows, window_ids)).wait()
        for (name, layer), t in host_views(host).items():
            if name in ("conv", "ssm"):
                dst, src = host_slots, slots
            elif layer in WINDOW_LAYERS:
                dst, src = window_ids, windows
            else:
                dst, src = host_pages, pages
            assert same_bits(t[dst], before[(name, layer)][src]), (name, layer)
            # Only the given rows changed: other window ids (and pages, slots) untouched.
            rest = [i for i in range(t.shape[0]) if i not in dst]
            assert same_bits(t[rest], host_before[(name, layer)][rest]), (name, layer)
        # The host row of a window id holds that page of every windowed layer.
        row = host.row("kv_window", 5)
        for i, layer in enumerate(host.region("kv_window").local_layer_ids):
            assert same_bits(row[i, 0], before[("k", layer)][9])
        for t in tensors(dev).values():
            t.zero_()
        # Load into other device pages, the windows in reversed order.
        new_pages, new_windows = [11, 10, 8, 6, 5], [8, 10, 11]
        h = eng.load((new_pages, host_pages), (slots[::-1], host_slots), (new_windows, window_ids))
        assert all(h.wait_layer(layer) for layer in LAYERS) and h.wait()
    for (name, layer), t in tensors(dev).items():
        if name in ("conv", "ssm"):
            dst, src = slots[::-1], slots
        elif layer in WINDOW_LAYERS:
            dst, src = new_windows, windows
        else:
            dst, src = new_pages, pages
        assert same_bits(t[dst], before[(name, layer)][src]), (name, layer)
        # Pages loaded without their window keep the device's (zeroed) windowed K/V.
        assert t[[i for i in range(t.shape[0]) if i not in dst]].view(torch.uint8).eq(0).all()


@pytest.mark.parametrize("path", ["native", "memmove"])
def test_window_load_goes_layer_by_layer(path, monkeypatch, queued):
    monkeypatch.setattr(cpu_module, "SINGLE_PASS_BYTES", 0)  # this small load too
    gen = torch.Generator().manual_seed(22)
    dev, host, eng = window_engine(path, monkeypatch)
    randomize(dev, gen)
    pages, slots, windows = [3, 7, 1], [2, 0], [7, 1]
    pairs = ((pages, [0, 1, 2]), (slots, [0, 1]), (windows, [4, 2]))
    assert eng.backup(*pairs).wait()
    before = snapshot(dev)
    for t in tensors(dev).values():
        t.zero_()
    seen: list[int] = []
    original = eng._layer_ready

    def observe(op, position):
        layer = eng.layer_ids[position]
        seen.append(layer)
        # This layer and earlier ones are in place, later ones are not.
        for (name, lid), t in tensors(dev).items():
            if name in ("conv", "ssm"):
                idx = slots
            else:
                idx = windows if lid in WINDOW_LAYERS else pages
            loaded = same_bits(t[idx], before[(name, lid)][idx])
            assert loaded == (lid <= layer), (name, lid, layer)
        original(op, position)

    eng._layer_ready = observe  # type: ignore[method-assign]
    handle = eng.load(*pairs)
    assert handle.wait_layer(LAYERS[0]) and handle.wait()
    assert seen == list(LAYERS)
    eng.close()


def test_bad_window_pairs_are_value_errors():
    dev, host, eng = make(host_windows=7, make_spec=window_spec)
    with eng:
        with pytest.raises(ValueError, match="window_pages: 2 device vs 1 host"):
            eng.backup(window_pages=([0, 1], [0]))
        with pytest.raises(ValueError, match=r"window_pages: device index out of range \[0, 12\)"):
            eng.load(window_pages=([12], [0]))
        # A host page id (< 20) is no window id (< 7).
        with pytest.raises(ValueError, match=r"window_pages: host index out of range \[0, 7\)"):
            eng.backup(([0], [9]), window_pages=([0], [9]))
        with pytest.raises(ValueError, match="window_pages: host index out of range"):
            eng.load(window_pages=([0], [-1]))
        with pytest.raises(ValueError, match="window_pages must be a pair"):
            eng.load(window_pages=([0],))
        assert eng.backup(window_pages=([0], [6])).wait()  # the last window id is fine
    plain_dev, plain_host, plain = make()
    with plain:  # no kv_window: no window ids at all
        assert plain_host.num_window_pages == 0
        with pytest.raises(ValueError, match=r"window_pages: host index out of range \[0, 0\)"):
            plain.backup(window_pages=([0], [0]))


def test_window_bytes_count_towards_an_operation():
    dev, host, eng = make(host_windows=7, make_spec=window_spec)
    table = eng.segments
    page, slot, window = table.kind_bytes
    region = host.layout.region

    def rows(name: str) -> int:
        return region(name).row_bytes

    assert (page, slot, window) == (
        rows("kv") + rows("indexer"),
        rows("mamba_conv") + rows("mamba_ssm"),
        rows("kv_window"),
    )
    one = np.zeros(1, dtype=np.int64)
    none = one[:0]
    assert table.op_bytes([(one, one), (none, none), (one, one)]) == page + window
    eng.close()
