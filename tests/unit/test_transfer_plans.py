"""Transfer engine copy plans: batched random operations and bulk row addresses against a
naive per-row copy, and the CUDA engine's 2-D copy plan run on CPU memory."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import types

import numpy as np
import pytest
import torch

from mesh_hicache import native
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools
from mesh_hicache.transfer import (
    CpuTransferEngine,
    TransferKind,
)
from mesh_hicache.transfer import cpu as cpu_module
from mesh_hicache.transfer import segments as segments_module
from mesh_hicache.transfer.cuda import CudaTransferEngine
from mesh_hicache.transfer.segments import IndexKind
from tests.unit.transfer_support import (
    WINDOW_LAYERS,
    host_views,
    naive_apply,
    on_worker,
    one_layer_spec,
    randomize,
    same_bits,
    snapshot,
    spec,
    tensors,
    window_spec,
)

SPECS = [spec, one_layer_spec, window_spec]
SPEC_IDS = ["multi-layer", "one-layer", "windowed"]
#: Host window ids of the pools below: fewer than host pages (L2 holds only some windows).
HOST_WINDOWS = 10


def windowed_layers(make_spec) -> tuple[int, ...]:
    return WINDOW_LAYERS if make_spec is window_spec else ()


def random_windows(make_spec, gen, pages):
    """A window pair for some of ``pages``' device pages (random window ids), or none."""
    if make_spec is not window_spec:
        return ((), ())
    k = int(torch.randint(0, len(pages[0]) + 1, (1,), generator=gen))
    return (pages[0][:k], torch.randperm(HOST_WINDOWS, generator=gen)[:k].tolist())


@pytest.mark.parametrize("make_spec", SPECS, ids=SPEC_IDS)
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
    host = HostPools(layout, num_pages=24, num_slots=8, num_window_pages=HOST_WINDOWS, pinned=False)
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
    # One block per pool buffer: kv (K and V of every layer), kv_window, indexer, conv, ssm.
    blocks = len(layout.regions)
    assert len(eng.segments._blocks) == (blocks if small_rows or path == "one-pass-numpy" else 0)
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
        ops.append((kind, pages, slots, random_windows(make_spec, gen, pages)))
    handles = [
        (eng.backup if kind is TransferKind.BACKUP else eng.load)(p, s, w)
        for kind, p, s, w in ops[:1]
    ]
    assert reached.wait(timeout=30)  # op 0 holds the worker
    handles += [
        (eng.backup if kind is TransferKind.BACKUP else eng.load)(p, s, w)
        for kind, p, s, w in ops[1:]
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
            for kind, pages, slots, windows in ops
            for c in (
                one_pass
                if kind is TransferKind.BACKUP
                or not (len(pages[0]) or len(slots[0]) or len(windows[0]))
                else per_layer
            )
        ]
        assert seg_calls == expected and calls == []
    elif path == "layer-wise-native-rows":
        assert seg_calls == [] and calls and max(calls) > 1
    else:
        assert seg_calls == [] and calls == []
    eng.close()
    for kind, pages, slots, windows in ops:
        naive_apply(ref_dev, ref_host, kind, pages, slots, windows, windowed_layers(make_spec))
    for key, t in tensors(dev).items():
        assert same_bits(t, ref_dev[key]), key
    for key, t in host_views(host).items():
        assert same_bits(t, ref_host[key]), key


@pytest.mark.parametrize("make_spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("backup", [True, False])
def test_bulk_row_addresses_equal_naive_row_pointers(make_spec, backup):
    gen = torch.Generator().manual_seed(11)
    layout = StateLayout.for_coords(make_spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(layout, num_pages=16, num_slots=6)
    host = HostPools(layout, num_pages=24, num_slots=8, num_window_pages=HOST_WINDOWS, pinned=False)
    eng = CpuTransferEngine(dev, host)
    dp = [3, 4, 5, 9] + torch.randperm(16, generator=gen)[:5].tolist()
    hp = [7, 8, 9, 1] + torch.randperm(24, generator=gen)[:5].tolist()
    ds, hs = [0, 1, 2, 5], [3, 4, 5, 0]
    dw, hw = [3, 4, 5, 12, 0], [6, 7, 8, 0, 9]  # window ids: their own space
    pairs = {IndexKind.PAGES: (dp, hp), IndexKind.SLOTS: (ds, hs), IndexKind.WINDOWS: (dw, hw)}
    table = eng.segments
    rows = table.mem_rows(
        backup,
        [
            (np.array(pairs[k][0], dtype=np.int64), np.array(pairs[k][1], dtype=np.int64))
            for k in IndexKind
        ],
    )
    dev_t, host_t = tensors(dev), host_views(host)
    merged_any = False
    for pos, layer in enumerate(eng.layer_ids):
        expected = []  # naive: one (dst, src, bytes) per row, from tensor views, copy order
        for seg in (table.segments[i] for i in table.by_layer[pos]):
            d_t, h_t = dev_t[(seg.part, layer)], host_t[(seg.part, layer)]
            row = d_t[0].numel() * d_t.element_size()
            for d, h in zip(*pairs[seg.kind], strict=True):
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
        host = HostPools(
            layout, num_pages=24, num_slots=8, num_window_pages=HOST_WINDOWS, pinned=False
        )
        dev.device = torch.device("cuda", 0)  # the engine checks it; tensors stay on CPU
        return dev, host, CudaTransferEngine(dev, host, staging_bytes=staging_bytes)

    return build, calls


@pytest.mark.parametrize("make_spec", SPECS, ids=SPEC_IDS)
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
    first: list[tuple[list[int], list[int]]] = [([], []), ([], [])]
    if make_spec is window_spec:
        first = [([3, 4, 5], [7, 8, 9]), ([0, 1, 2], [7, 8, 9])]  # host runs of 3 too
    ops = [
        (TransferKind.BACKUP, ([3, 4, 5, 9], [7, 8, 9, 1]), ([0, 1], [2, 3]), first[0]),
        (TransferKind.LOAD, ([0, 1, 2, 15], [7, 8, 9, 1]), ([4, 5], [2, 3]), first[1]),
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
        kind = TransferKind.BACKUP if i % 2 else TransferKind.LOAD
        ops.append((kind, pages, slots, random_windows(make_spec, gen, pages)))
    handles = [
        (eng.backup if k is TransferKind.BACKUP else eng.load)(p, s, w) for k, p, s, w in ops
    ]
    assert all(h.wait(timeout=30) for h in handles)
    eng.close()
    for kind, pages, slots, windows in ops:
        naive_apply(ref_dev, ref_host, kind, pages, slots, windows, windowed_layers(make_spec))
    for key, t in tensors(dev).items():
        assert same_bits(t, ref_dev[key]), key
    for key, t in host_views(host).items():
        assert same_bits(t, ref_host[key]), key
    # Host pages 7, 8, 9 of the first two ops: one 2-D copy of 3 rows per segment when
    # they fit the staging buffer together; a one-row staging buffer cuts that run.
    tallest = max(h for _, h in calls)
    assert tallest >= 3 if staging_bytes > 1 else tallest < 3
    assert {kind for kind, _ in calls} == {1, 2}
