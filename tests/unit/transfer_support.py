"""Shared helpers of the transfer-engine tests (a helper module, not collected): a small
hybrid spec with every region (and a variant with sliding-window layers), engines on it,
random bit patterns, and a naive per-row copy as the reference. Their fixtures
(``queued``, ``finished``) are in conftest.py."""

from __future__ import annotations

import dataclasses
import threading

import torch

from mesh_hicache.layout import StateLayout
from mesh_hicache.pools import DevicePools, HostPools
from mesh_hicache.spec import Family, IndexerSpec, KVSpec, MambaSpec, StateSpec, WindowSpec
from mesh_hicache.transfer import (
    CpuTransferEngine,
    TransferKind,
)

LAYERS = (0, 1, 2, 3, 4, 5)


def spec() -> StateSpec:
    return StateSpec(
        model_id="test-model",
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


#: The sliding-window layers of :func:`window_spec` (KV layers 1 and 5, with the indexer,
#: stay full).
WINDOW_LAYERS = (0, 3)


def window_spec() -> StateSpec:
    """:func:`spec` with KV layers 0 and 3 sliding-window: their K/V live in ``kv_window``,
    whose host rows are window ids (KV, windows, indexer and Mamba in one spec)."""
    group = WindowSpec(layer_ids=WINDOW_LAYERS, window=6, sink_tokens=1)
    return dataclasses.replace(spec(), windows=(group,))


def make(num_pages=12, num_slots=5, host_pages=20, host_slots=7, host_windows=None, make_spec=spec):
    layout = StateLayout.for_coords(make_spec(), (1, 1, 1), (0, 0, 0))
    dev = DevicePools(layout, num_pages=num_pages, num_slots=num_slots)
    host = HostPools(
        layout,
        num_pages=host_pages,
        num_slots=host_slots,
        num_window_pages=host_windows,
        pinned=False,
    )
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


def naive_apply(dev_t, host_t, kind, pages, slots, windows=((), ()), windowed=()):
    """Reference: one row at a time, on plain tensor views (dicts of clones). K/V of the
    ``windowed`` layers go by the ``windows`` pair (device pages, host window ids)."""
    for (name, layer), t in dev_t.items():
        if name in ("conv", "ssm"):
            idx_d, idx_h = slots
        elif name in ("k", "v") and layer in windowed:
            idx_d, idx_h = windows
        else:
            idx_d, idx_h = pages
        for d, h in zip(idx_d, idx_h, strict=True):
            if kind is TransferKind.BACKUP:
                host_t[(name, layer)][h].copy_(t[d])
            else:
                t[d].copy_(host_t[(name, layer)][h])


def host_views(host: HostPools) -> dict[tuple[str, int], torch.Tensor]:
    """The host rows of every (part, layer): ``[ids, *row]`` views (K/V of windowed
    layers from ``kv_window``, indexed by window ids)."""
    out = {}
    for region in ("kv", "kv_window"):
        if not host.layout.has_region(region):
            continue
        kv = host.region(region)
        for layer in kv.local_layer_ids:
            out[("k", layer)] = host.local(region)[:, kv.layer_row(layer), 0]
            out[("v", layer)] = host.local(region)[:, kv.layer_row(layer), 1]
    for name, region in (("indexer", "indexer"), ("conv", "mamba_conv"), ("ssm", "mamba_ssm")):
        r = host.region(region)
        for layer in r.local_layer_ids:
            out[(name, layer)] = host.local(region)[:, r.layer_row(layer)]
    return out


def one_layer_spec() -> StateSpec:
    # One layer per region: indexer and Mamba host rows are contiguous across pages, so
    # consecutive pairs are merged into one copy; kv rows (K and V interleaved) are not.
    return StateSpec(
        model_id="test-model",
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
