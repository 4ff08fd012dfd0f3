"""Transfer engine (CPU): round trips, layer readiness, acks, failure injection, close,
batching, bulk row addresses against a naive per-row copy."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import threading
import time
import types
import weakref
from collections.abc import Sized

import numpy as np
import pytest
import torch

from mesh_hicache import native
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools
from mesh_hicache.spec import Family, IndexerSpec, KVSpec, MambaSpec, StateSpec
from mesh_hicache.transfer import (
    CpuTransferEngine,
    TransferHandle,
    TransferKind,
    make_transfer_engine,
)
from mesh_hicache.transfer import cpu as cpu_module
from mesh_hicache.transfer import segments as segments_module
from mesh_hicache.transfer.cuda import CudaTransferEngine
from mesh_hicache.transfer.segments import index_runs

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


def on_worker() -> bool:
    """True on an engine's worker thread (not on a waiter that copies itself)."""
    return threading.current_thread().name.startswith("transfer-")


@pytest.fixture
def queued(monkeypatch) -> None:
    """Every operation goes through the queue (none is copied inline by its submitter):
    for tests about the worker, waiters and close with small operations."""
    monkeypatch.setattr(CpuTransferEngine, "inline_bytes", 0)


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


@pytest.fixture
def finished(monkeypatch) -> list[tuple[int, bool, str | None]]:
    """Every completion of every handle, in completion order: (op id, ok, error)."""
    log: list[tuple[int, bool, str | None]] = []
    original = TransferHandle._finish

    def record(self, ok, error):
        log.append((self.op_id, ok, error))
        return original(self, ok, error)

    monkeypatch.setattr(TransferHandle, "_finish", record)
    return log


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


def naive_apply(dev_t, host_t, kind, pages, slots):
    """Reference: one row at a time, on plain tensor views (dicts of clones)."""
    dp, hp = pages
    ds, hs = slots
    for (name, layer), t in dev_t.items():
        idx_d, idx_h = (ds, hs) if name in ("conv", "ssm") else (dp, hp)
        for d, h in zip(idx_d, idx_h, strict=True):
            if kind is TransferKind.BACKUP:
                host_t[(name, layer)][h].copy_(t[d])
            else:
                t[d].copy_(host_t[(name, layer)][h])


def host_views(host: HostPools) -> dict[tuple[str, int], torch.Tensor]:
    out = {}
    kv = host.region("kv")
    for layer in kv.local_layer_ids:
        out[("k", layer)] = host.local("kv")[:, kv.layer_row(layer), 0]
        out[("v", layer)] = host.local("kv")[:, kv.layer_row(layer), 1]
    for name, region in (("indexer", "indexer"), ("conv", "mamba_conv"), ("ssm", "mamba_ssm")):
        r = host.region(region)
        for layer in r.local_layer_ids:
            out[(name, layer)] = host.local(region)[:, r.layer_row(layer)]
    return out


def one_layer_spec() -> StateSpec:
    # One layer per region: indexer and Mamba host rows are contiguous across pages, so
    # consecutive pairs are merged into one copy; kv rows (K and V interleaved) are not.
    return StateSpec(
        page_size=2,
        kv=KVSpec(layer_ids=(0,), num_kv_heads=1, head_dim=4, dtype=torch.float16),
        mamba=MambaSpec(
            layer_ids=(1,),
            conv_dim=2,
            conv_kernel=2,
            num_heads=1,
            head_dim=2,
            state_dim=2,
            conv_dtype=torch.float16,
            ssm_dtype=torch.float32,
        ),
        indexer=IndexerSpec(layer_ids=(0,), key_dim=3, dtype=torch.float16),
    )


@pytest.mark.parametrize("make_spec", [spec, one_layer_spec], ids=["multi-layer", "one-layer"])
@pytest.mark.parametrize(
    "path",
    [
        "native-one-pass",
        "native-layer-wise",
        "one-pass-numpy",
        "layer-wise-native-rows",
        "layer-wise-memmove",
    ],
)
def test_batched_random_ops_equal_naive_sequential_copies(make_spec, path, monkeypatch, queued):
    # These rows and ops are all small. With the native segment loop (native-*), one call
    # per op (one-pass) or per layer; without it, copied in one pass by numpy blocks
    # (one-pass-numpy), or, with both thresholds 0, every row through the native row loop
    # (one call per layer) or memmove per row, loads layer by layer.
    small_rows = path in ("native-one-pass", "one-pass-numpy")
    if path != "one-pass-numpy" and not small_rows:
        monkeypatch.setattr(segments_module, "SMALL_ROW_BYTES", 0)
        monkeypatch.setattr(cpu_module, "SINGLE_PASS_BYTES", 0)
    if path.startswith("native") or path.endswith("native-rows"):
        if native.segment_copier() is None:
            pytest.skip("native copy loops need a C compiler (cc) and libcrypto")
    gen = torch.Generator().manual_seed(7)
    layout = StateLayout.for_coords(make_spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(layout, num_pages=16, num_slots=6)
    host = HostPools(layout, num_pages=24, num_slots=8, pinned=False)
    eng = CpuTransferEngine(dev, host)
    if not path.startswith("native"):
        eng._copy_segments = None
    if path in ("layer-wise-memmove", "one-pass-numpy"):
        eng._copy_rows = None
    calls: list[int] = []  # rows per native row-loop call
    seg_calls: list[tuple[int, int]] = []  # (op's first device page, segments) per call
    if eng._copy_rows is not None:
        real = eng._copy_rows
        eng._copy_rows = lambda d, s, z, n: calls.append(n) or real(d, s, z, n)
    if eng._copy_segments is not None:
        real_seg = eng._copy_segments

        def count(table, s0, s1, *rest):
            seg_calls.append((s0, s1))
            return real_seg(table, s0, s1, *rest)

        eng._copy_segments = count
    # One block per pool buffer: kv (K and V of every layer), indexer, conv, ssm.
    assert len(eng.segments._blocks) == (4 if small_rows or path == "one-pass-numpy" else 0)
    randomize(dev, gen)
    for t in host_views(host).values():
        raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
        raw.copy_(torch.randint(-(2**15), 2**15, raw.shape, generator=gen).to(raw.dtype))
    ref_dev, ref_host = snapshot(dev), {k: v.clone() for k, v in host_views(host).items()}
    gate, reached, original = threading.Event(), threading.Event(), eng._layer_ready
    threads = set()

    def hold_first(op, position):
        original(op, position)
        threads.add(threading.current_thread().name)
        if op.handle.op_id == 0 and on_worker():
            reached.set()
            gate.wait(timeout=30)

    eng._layer_ready = hold_first  # type: ignore[method-assign]
    ops = []
    for i in range(40):
        n = int(torch.randint(0, 10, (1,), generator=gen))
        if i % 3 == 0:  # runs: consecutive on both sides
            d0, h0 = (
                int(torch.randint(0, 16 - n + 1, (1,), generator=gen)),
                int(torch.randint(0, 24 - n + 1, (1,), generator=gen)),
            )
            pages = (list(range(d0, d0 + n)), list(range(h0, h0 + n)))
        else:  # random, repeats across ops (later ops overwrite earlier ones' rows)
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
    handles = [
        (eng.backup if kind is TransferKind.BACKUP else eng.load)(p, s) for kind, p, s in ops[:1]
    ]
    assert reached.wait(timeout=30)  # op 0 holds the worker
    handles += [
        (eng.backup if kind is TransferKind.BACKUP else eng.load)(p, s) for kind, p, s in ops[1:]
    ]
    gate.set()
    assert all(h.wait(timeout=30) for h in handles)
    # The 39 ops queued while op 0 ran went in the same wake-up, all on the worker.
    assert eng.num_batches == 1 and threads == {eng._worker.name}
    # The native segment loop: one call per op in one pass (all segments), else one per
    # layer (that layer's segments). The native row loop: several rows per call.
    num_layers, num_segments = len(eng.layer_ids), len(eng.segments.segments)
    if path == "native-one-pass":
        assert seg_calls == [(0, num_segments)] * len(ops) and calls == []
    elif path == "native-layer-wise":
        bounds = eng.segments.layer_bounds
        per_layer = [(bounds[i], bounds[i + 1]) for i in range(num_layers)]
        one_pass = [(0, num_segments)]  # a backup, or a load of nothing (0 bytes)
        expected = [
            c
            for kind, pages, slots in ops
            for c in (
                one_pass
                if kind is TransferKind.BACKUP or not (len(pages[0]) or len(slots[0]))
                else per_layer
            )
        ]
        assert seg_calls == expected and calls == []
    elif path == "layer-wise-native-rows":
        assert seg_calls == [] and calls and max(calls) > 1
    else:
        assert seg_calls == [] and calls == []
    eng.close()
    for kind, pages, slots in ops:
        naive_apply(ref_dev, ref_host, kind, pages, slots)
    for key, t in tensors(dev).items():
        assert same_bits(t, ref_dev[key]), key
    for key, t in host_views(host).items():
        assert same_bits(t, ref_host[key]), key


@pytest.mark.parametrize("make_spec", [spec, one_layer_spec], ids=["multi-layer", "one-layer"])
@pytest.mark.parametrize("backup", [True, False])
def test_bulk_row_addresses_equal_naive_row_pointers(make_spec, backup):
    gen = torch.Generator().manual_seed(11)
    layout = StateLayout.for_coords(make_spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(layout, num_pages=16, num_slots=6)
    host = HostPools(layout, num_pages=24, num_slots=8, pinned=False)
    eng = CpuTransferEngine(dev, host)
    dp = [3, 4, 5, 9] + torch.randperm(16, generator=gen)[:5].tolist()
    hp = [7, 8, 9, 1] + torch.randperm(24, generator=gen)[:5].tolist()
    ds, hs = [0, 1, 2, 5], [3, 4, 5, 0]
    table = eng.segments
    rows = table.mem_rows(
        backup,
        (np.array(dp, dtype=np.int64), np.array(hp, dtype=np.int64)),
        (np.array(ds, dtype=np.int64), np.array(hs, dtype=np.int64)),
    )
    dev_t, host_t = tensors(dev), host_views(host)
    merged_any = False
    for pos, layer in enumerate(eng.layer_ids):
        expected = []  # naive: one (dst, src, bytes) per row, from tensor views, copy order
        for seg in (table.segments[i] for i in table.by_layer[pos]):
            d_t, h_t = dev_t[(seg.part, layer)], host_t[(seg.part, layer)]
            row = d_t[0].numel() * d_t.element_size()
            for d, h in zip(*((dp, hp) if seg.paged else (ds, hs)), strict=True):
                src, dst = (d_t[d], h_t[h]) if backup else (h_t[h], d_t[d])
                expected.append((dst.data_ptr(), src.data_ptr(), row))
        got = []  # this layer's copies, merged runs expanded back into rows
        a, b = rows.bounds[pos], rows.bounds[pos + 1]
        dst, src, size = (rows.block[k, a:b].tolist() for k in range(3))
        assert [dst, src, size] == [
            rows.dst[a:b].tolist(),
            rows.src[a:b].tolist(),
            rows.size[a:b].tolist(),
        ]
        for d, s, z in zip(dst, src, size, strict=True):
            row = next(r for dd, _, r in expected if dd == d)
            assert z % row == 0
            merged_any |= z > row
            got += [(d + i * row, s + i * row, row) for i in range(z // row)]
        assert got == expected, layer
    assert rows.bounds[0] == 0 and rows.bounds[-1] == len(rows.dst) == rows.block.shape[1]
    assert rows.block.flags.c_contiguous and rows.block.dtype == np.int64
    assert merged_any == (make_spec is one_layer_spec)
    eng.close()


def test_a_waiter_copies_itself_when_the_worker_is_not_scheduled(queued):
    gen = torch.Generator().manual_seed(3)
    dev, host, eng = make()
    randomize(dev, gen)
    before = snapshot(dev)
    stalled = threading.Event()
    # A worker that never gets a core: everything must still complete on the waiters.
    eng._worker = threading.Thread(target=stalled.wait, name="stalled", daemon=True)
    threads = set()
    original = eng._layer_ready

    def observe(op, position):
        threads.add(threading.current_thread().name)
        original(op, position)

    eng._layer_ready = observe  # type: ignore[method-assign]
    backup = eng.backup(([2, 5, 6], [9, 0, 1]), ([1], [4]))
    load = eng.load(([0, 1, 11], [9, 0, 1]), ([3], [4]))
    assert load.wait_layer(LAYERS[2], timeout=30)  # runs the backup, then load up to layer 2
    assert backup.done and backup.ok and not load.done
    assert load.wait(timeout=30) and load.ack is not None and load.ack.ok
    assert threads == {threading.current_thread().name}
    for (name, layer), t in tensors(dev).items():
        if name in ("conv", "ssm"):
            assert same_bits(t[3], before[(name, layer)][1])
        else:
            assert same_bits(t[[0, 1, 11]], before[(name, layer)][[2, 5, 6]])
    stalled.set()
    eng.close()


class _FakeStream:
    cuda_stream = 0

    def __init__(self, device=None):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class _FakeEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def cuda_engine_on_cpu(monkeypatch):
    """The CUDA engine's copy logic on CPU memory: torch.cuda streams/events and cupy's
    runtime replaced by synchronous fakes (2-D copies row by row with memmove). Records
    every 2-D copy as (kind, height)."""
    calls: list[tuple[int, int]] = []

    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        assert width <= dpitch and width <= spitch
        calls.append((kind, height))
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)

    runtime = types.SimpleNamespace(
        memcpy2DAsync=memcpy2d, memcpyHostToDevice=1, memcpyDeviceToHost=2
    )
    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime, Device=lambda i: contextlib.nullcontext())
    )
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    for name, value in {
        "Stream": _FakeStream,
        "Event": _FakeEvent,
        "stream": lambda s: contextlib.nullcontext(),
        "device": lambda d: contextlib.nullcontext(),
        "current_stream": lambda d=None: _FakeStream(),
        "current_device": lambda: 0,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)

    def build(make_spec, staging_bytes):
        layout = StateLayout.for_coords(make_spec(), (1, 1, 1), (0, 0, 0))
        dev = DevicePools(layout, num_pages=16, num_slots=6)
        host = HostPools(layout, num_pages=24, num_slots=8, pinned=False)
        dev.device = torch.device("cuda", 0)  # the engine checks it; tensors stay on CPU
        return dev, host, CudaTransferEngine(dev, host, staging_bytes=staging_bytes)

    return build, calls


@pytest.mark.parametrize("make_spec", [spec, one_layer_spec], ids=["multi-layer", "one-layer"])
@pytest.mark.parametrize("staging_bytes", [64 << 20, 1], ids=["staging-64MiB", "staging-1row"])
def test_cuda_engine_copy_plan_equals_naive_copies(cuda_engine_on_cpu, make_spec, staging_bytes):
    build, calls = cuda_engine_on_cpu
    gen = torch.Generator().manual_seed(13)
    dev, host, eng = build(make_spec, staging_bytes)
    randomize(dev, gen)
    for t in host_views(host).values():
        raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
        raw.copy_(torch.randint(-(2**15), 2**15, raw.shape, generator=gen).to(raw.dtype))
    ref_dev, ref_host = snapshot(dev), {k: v.clone() for k, v in host_views(host).items()}
    ops = [
        (TransferKind.BACKUP, ([3, 4, 5, 9], [7, 8, 9, 1]), ([0, 1], [2, 3])),
        (TransferKind.LOAD, ([0, 1, 2, 15], [7, 8, 9, 1]), ([4, 5], [2, 3])),
    ]
    for i in range(20):
        n = int(torch.randint(0, 9, (1,), generator=gen))
        pages = (
            torch.randperm(16, generator=gen)[:n].tolist(),
            torch.randperm(24, generator=gen)[:n].tolist(),
        )
        k = int(torch.randint(0, 4, (1,), generator=gen))
        slots = (
            torch.randperm(6, generator=gen)[:k].tolist(),
            torch.randperm(8, generator=gen)[:k].tolist(),
        )
        ops.append((TransferKind.BACKUP if i % 2 else TransferKind.LOAD, pages, slots))
    handles = [(eng.backup if k is TransferKind.BACKUP else eng.load)(p, s) for k, p, s in ops]
    assert all(h.wait(timeout=30) for h in handles)
    eng.close()
    for kind, pages, slots in ops:
        naive_apply(ref_dev, ref_host, kind, pages, slots)
    for key, t in tensors(dev).items():
        assert same_bits(t, ref_dev[key]), key
    for key, t in host_views(host).items():
        assert same_bits(t, ref_host[key]), key
    # Host pages 7, 8, 9 of the first two ops: one 2-D copy of 3 rows per segment when
    # they fit the staging buffer together; a one-row staging buffer cuts that run.
    tallest = max(h for _, h in calls)
    assert tallest >= 3 if staging_bytes > 1 else tallest < 3
    assert {kind for kind, _ in calls} == {1, 2}


@pytest.mark.parametrize("single_pass_bytes", [0, 1 << 30], ids=["layer-wise", "one-pass"])
def test_small_loads_are_published_at_once(monkeypatch, single_pass_bytes):
    monkeypatch.setattr(cpu_module, "SINGLE_PASS_BYTES", single_pass_bytes)
    gen = torch.Generator().manual_seed(4)
    dev, host, eng = make()
    randomize(dev, gen)
    before = snapshot(dev)
    assert eng.backup(([1, 2, 3], [4, 5, 6]), ([0], [1])).wait()
    published = []
    original = eng._layer_ready

    def observe(op, position):
        published.append(position)
        original(op, position)

    eng._layer_ready = observe  # type: ignore[method-assign]
    h = eng.load(([7, 8, 9], [4, 5, 6]), ([2], [1]))
    assert h.wait() and all(h.wait_layer(layer) for layer in LAYERS)
    assert published == ([len(LAYERS) - 1] if single_pass_bytes else list(range(len(LAYERS))))
    for (name, layer), t in tensors(dev).items():
        if name in ("conv", "ssm"):
            assert same_bits(t[2], before[(name, layer)][0])
        else:
            assert same_bits(t[[7, 8, 9]], before[(name, layer)][[1, 2, 3]])
    eng.close()


def test_small_load_on_an_idle_engine_is_copied_by_its_submitter(finished, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    dev, host, eng = make()
    randomize(dev, gen)
    before = snapshot(dev)
    threads: list[str] = []
    original = eng._layer_ready

    def observe(op, position):
        threads.append((op.handle.kind, threading.current_thread().name))
        original(op, position)

    eng._layer_ready = observe  # type: ignore[method-assign]
    # A backup, however small, goes to the worker (started by it): its caller goes on.
    assert not eng._worker_started
    assert eng.backup(([2, 5, 6], [9, 0, 1]), ([1], [4])).wait()
    assert eng._worker_started
    for t in tensors(dev).values():
        t.zero_()
    threads.clear()
    # An idle engine, a small load: copied before load() returns, on this thread.
    h = eng.load(([0, 1, 11], [9, 0, 1]), ([3], [4]))
    assert h.done and h.ok
    assert set(threads) == {(TransferKind.LOAD, threading.current_thread().name)}
    for (name, layer), t in tensors(dev).items():
        if name in ("conv", "ssm"):
            assert same_bits(t[3], before[(name, layer)][1])
        else:
            assert same_bits(t[[0, 1, 11]], before[(name, layer)][[2, 5, 6]])
    # An injected failure acks at once too, and the engine goes on.
    eng.fail_next()
    bad = eng.load(([0], [0]))
    assert bad.done and not bad.ok and "InjectedFailure" in (bad.error or "")
    # Larger than inline_bytes: through the queue, same results.
    monkeypatch.setattr(eng, "inline_bytes", 1)
    threads.clear()
    big = eng.load(([4, 7], [9, 0]))
    assert big.wait() and threads
    for (name, layer), t in tensors(dev).items():
        if name not in ("conv", "ssm"):
            assert same_bits(t[[4, 7]], before[(name, layer)][[2, 5]])
    eng.close()
    assert [op for op, _, _ in finished] == [0, 1, 2, 3]


def test_small_load_behind_queued_work_waits_its_turn(finished):
    dev, host, eng = make()
    gate, reached = threading.Event(), threading.Event()
    original = eng._layer_ready

    def hold(op, position):
        original(op, position)
        if op.handle.op_id == 0 and on_worker():
            reached.set()
            gate.wait(timeout=30)

    eng._layer_ready = hold  # type: ignore[method-assign]
    first = eng.backup(([0, 1], [0, 1]))  # to the worker, held there
    assert reached.wait(timeout=30)
    second = eng.load(([2], [2]))  # small, but the engine is busy: queued behind op 0
    assert not second.done and not first.done
    gate.set()
    assert second.wait(timeout=30) and first.done
    eng.close()
    assert [op for op, _, _ in finished] == [0, 1]  # submission order


@pytest.mark.parametrize("waker", ["timer", "condition"])
def test_deferred_wake_a_waiter_copies_and_an_unwaited_backup_still_runs(monkeypatch, waker):
    from mesh_hicache.transfer import engine as engine_module
    from mesh_hicache.transfer.waker import CondWaker, TimerWaker

    kind = CondWaker if waker == "condition" else TimerWaker
    if waker == "condition":
        monkeypatch.setattr(engine_module, "make_waker", CondWaker)
    elif TimerWaker.create() is None:
        pytest.skip("no timerfd/eventfd on this platform")
    wakes = []  # the worker's returns from sleep
    sleep = kind.sleep

    def counted(self) -> None:
        sleep(self)
        wakes.append(1)

    monkeypatch.setattr(kind, "sleep", counted)
    gen = torch.Generator().manual_seed(5)
    dev, host, eng = make()
    assert eng._waker is None  # no descriptors before the worker starts
    randomize(dev, gen)
    before = snapshot(dev)
    threads: list[str] = []
    original = eng._layer_ready

    def observe(op, position):
        threads.append(threading.current_thread().name)
        original(op, position)

    eng._layer_ready = observe  # type: ignore[method-assign]
    # A long grace: the waiter claims each backup long before the worker would wake.
    monkeypatch.setattr(eng, "wake_grace", 30.0)
    assert eng.backup(([0], [5])).wait(timeout=30)  # starts the worker (either may copy)
    assert isinstance(eng._waker, kind)
    time.sleep(0.05)
    threads.clear()
    wakes.clear()
    batches = eng.num_batches
    first = eng.backup(([2, 5], [9, 0]))
    assert first.wait(timeout=30)
    assert threads == [threading.current_thread().name] and eng.num_batches == batches
    if waker == "timer":
        time.sleep(0.05)
        assert not wakes  # the worker never woke for it
    # A short grace: a backup nobody waits for completes on the worker by itself.
    monkeypatch.setattr(eng, "wake_grace", 0.002)
    threads.clear()
    second = eng.backup(([6], [1]))
    deadline = time.monotonic() + 30
    while not second.done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert second.ok and threads and all(t.startswith("transfer-") for t in threads)
    for (name, layer), t in host_views(host).items():
        if name not in ("conv", "ssm"):
            assert same_bits(t[[9, 0, 1]], before[(name, layer)][[2, 5, 6]])
    eng.close()
    assert not eng._worker.is_alive()
