"""Shared helpers of the HiCache tests (a helper module, not collected): a small hybrid
spec, recognizable page/state contents, a request driver shaped like ``runtime/request_run.py``,
file counting. Internals are reached through ``mesh_hicache.testing.internals`` only.

Contents are a pure function of (page hash, layer, this rank's global slice), so any
rank can check bit-exactly what it reads back, whichever tier or rank wrote it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mesh_hicache.cache import CachedRequest, CacheFull, HiCache, PrefixHit, tenant_namespace
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.layout import RegionName, StateLayout
from mesh_hicache.pools.arena import ArenaPlan
from mesh_hicache.radix import RadixKey
from mesh_hicache.spec import Family, IndexerSpec, KVSpec, MambaSpec, StateSpec
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.storage.keys import KeyNamespace
from mesh_hicache.testing import internals
from mesh_hicache.tiers.discovery import MAX_LAYOUTS, entry_key

PS = 4
"""Tokens per page."""


def make_spec(model_id: str = "test/sasa", kv_dtype: torch.dtype = torch.float32) -> StateSpec:
    """4 layers "SASA": Mamba layers 0 and 2, KV layers 1 and 3 (pp=2: one of each per stage)."""
    return StateSpec(
        page_size=PS,
        kv=KVSpec(layer_ids=(1, 3), num_kv_heads=2, head_dim=2, dtype=kv_dtype),
        mamba=MambaSpec(
            layer_ids=(0, 2), conv_dim=4, conv_kernel=3, num_heads=2, head_dim=2, state_dim=2
        ),
        model_id=model_id,
    )


def make_mla_spec(*, recurrent: bool = False, model_id: str = "test/mla") -> StateSpec:
    """4 layers of MLA latent KV (keys only, replicated over tp) each with indexer keys;
    ``recurrent``: layers 0 and 2 are Mamba instead (tp-sharded), MLA + indexer on 1 and 3."""
    mla = (1, 3) if recurrent else (0, 1, 2, 3)
    mamba = None
    if recurrent:
        mamba = MambaSpec(
            layer_ids=(0, 2), conv_dim=4, conv_kernel=3, num_heads=2, head_dim=2, state_dim=2
        )
    return StateSpec(
        page_size=PS,
        kv=KVSpec(layer_ids=mla, num_kv_heads=1, head_dim=3, mla=True, values=False),
        indexer=IndexerSpec(layer_ids=mla, key_dim=2, dtype=torch.float16),
        mamba=mamba,
        model_id=model_id,
    )


def make_config(root: Path | str | None = None, **overrides: Any) -> HiCacheConfig:
    """Small pools (eviction happens within a few requests); file L3 under ``root``."""
    kw: dict[str, Any] = dict(
        device_pages=8,
        device_mamba_slots=4,
        host_pages=16,
        host_mamba_slots=8,
        transfer="cpu",
        prefetch_threshold=PS,
    )
    if root is not None:
        kw.update(storage="file", storage_options={"root": str(root)})
    kw.update(overrides)
    return HiCacheConfig(**kw)


def budget_overrides(spec: StateSpec | None = None, **counts: int) -> dict[str, int]:
    """``make_config`` overrides that replace the fixed pools by byte budgets of the same
    bytes (one arena per tier): ``device_pages``/``device_mamba_slots``/``host_pages``/
    ``host_mamba_slots`` as in ``make_config`` unless given."""
    n = dict(device_pages=8, device_mamba_slots=4, host_pages=16, host_mamba_slots=8)
    n.update(counts)
    layout = StateLayout.for_coords(spec or make_spec(), (1, 1, 1), (0, 0, 0))
    page, slot, _ = ArenaPlan.item_bytes(layout)
    return dict(
        device_pages=0,
        device_mamba_slots=0,
        host_pages=0,
        host_mamba_slots=0,
        device_bytes=n["device_pages"] * page + n["device_mamba_slots"] * slot,
        host_bytes=n["host_pages"] * page + n["host_mamba_slots"] * slot,
    )


# -- recognizable contents ---------------------------------------------------------------


def _gen(tag: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(tag, digest_size=8).digest(), "little") >> 1
    g = torch.Generator().manual_seed(seed)
    # Small integers: exact in every float dtype used here, so equality is bit-exactness.
    return torch.randint(-500, 500, shape, generator=g).to(dtype)


def expected_kv(
    cache: HiCache, page_hash: bytes, layer: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's K and V of one page: ``[T_local, H_local, D]`` each (V None: keys only)."""
    kv = cache.spec.kv
    assert kv is not None
    shape = (kv.num_parts, PS, kv.num_kv_heads, kv.head_dim)
    full = _gen(page_hash + b"kv%d" % layer, shape, kv.dtype)
    sl = internals(cache).layout.region(RegionName.KV).global_slice
    part = full[:, sl.tokens[0] : sl.tokens[1], sl.heads[0] : sl.heads[1]]
    return part[0], part[1] if kv.values else None


def expected_indexer(cache: HiCache, page_hash: bytes, layer: int) -> torch.Tensor:
    """This rank's indexer keys of one page: ``[T_local, E]``."""
    ix = cache.spec.indexer
    assert ix is not None
    full = _gen(page_hash + b"ix%d" % layer, (PS, ix.key_dim), ix.dtype)
    t0, t1 = internals(cache).layout.region(RegionName.INDEXER).global_slice.tokens
    return full[t0:t1]


def expected_state(
    cache: HiCache, last_hash: bytes, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's conv ``[C_local, K-1]`` and SSM ``[H_local, D, N]`` state at a boundary."""
    m = cache.spec.mamba
    assert m is not None
    conv = _gen(last_hash + b"conv%d" % layer, m.conv_shape, m.conv_dtype)
    ssm = _gen(last_hash + b"ssm%d" % layer, m.ssm_shape, m.ssm_dtype)
    h0, h1 = internals(cache).layout.region(RegionName.MAMBA_SSM).global_slice.heads
    per_head = m.conv_dim // m.num_heads
    return conv[h0 * per_head : h1 * per_head], ssm[h0:h1]


def hashes_of(tokens: list[int], namespace: str = "") -> list[bytes]:
    return RadixKey(tuple(tokens), namespace).page_hashes(PS)


def write_pages(cache: HiCache, hashes: list[bytes], pages: list[int]) -> None:
    """Write the expected K/V (and indexer keys) of each page ``hashes[i]`` into device
    page ``pages[i]``."""
    dev = cache.device
    for h, p in zip(hashes, pages, strict=True):
        for layer in dev.layers(Family.KV):
            k, v = expected_kv(cache, h, layer)
            dev.k(layer)[p] = k
            if v is not None:
                dev.v(layer)[p] = v
        for layer in dev.layers(Family.INDEXER):
            dev.indexer(layer)[p] = expected_indexer(cache, h, layer)


def write_state(cache: HiCache, last_hash: bytes, slot: int) -> None:
    dev = cache.device
    for layer in dev.layers(Family.MAMBA):
        conv, ssm = expected_state(cache, last_hash, layer)
        dev.conv(layer)[slot] = conv
        dev.ssm(layer)[slot] = ssm


def window_reads(spec: StateSpec, layer: int, boundary: int, page: int) -> bool:
    """Whether a resume at ``boundary`` tokens reads ``layer``'s K/V of ``page``: always
    for full attention; for a window group only tokens ``boundary - window < t`` and the
    sink tokens (the definition, written out here as the tests' oracle)."""
    group = spec.layer_window(layer)
    if group is None:
        return True
    tokens = range(page * PS, (page + 1) * PS)
    return any(boundary - group.window < t < boundary or t < group.sink_tokens for t in tokens)


def count_mismatches(cache: HiCache, req: CachedRequest, hashes: list[bytes]) -> int:
    """Tensors of ``req``'s loaded prefix on device that differ from the expected bits."""
    dev = cache.device
    n = req.prefix_len // PS
    bad = 0
    for i in range(n):
        page = req.prefix_pages[i]
        for layer in dev.layers(Family.KV):
            if not window_reads(cache.spec, layer, n * PS, i):
                # A windowed layer's page the resume does not read may be absent (zeroed),
                # never garbage that could reach attention.
                bad += not torch.isfinite(dev.k(layer)[page]).all()
                continue
            k, v = expected_kv(cache, hashes[i], layer)
            bad += not torch.equal(dev.k(layer)[page], k)
            bad += v is not None and not torch.equal(dev.v(layer)[page], v)
        for layer in dev.layers(Family.INDEXER):
            got = dev.indexer(layer)[page]
            bad += not torch.equal(got, expected_indexer(cache, hashes[i], layer))
    if n and cache.spec.has_mamba:
        if req.mamba_slot is None:
            return bad + 1
        for layer in dev.layers(Family.MAMBA):
            conv, ssm = expected_state(cache, hashes[n - 1], layer)
            bad += not torch.equal(dev.conv(layer)[req.mamba_slot], conv)
            bad += not torch.equal(dev.ssm(layer)[req.mamba_slot], ssm)
    return bad


def poison_free_device(cache: HiCache) -> None:
    """Fill every free device page and slot with NaN: a load must overwrite what it serves."""
    dev = cache.device
    pages = [i for i in range(dev.num_pages) if dev.page_allocator.is_free(i)]
    slots = [i for i in range(dev.num_slots) if dev.slot_allocator.is_free(i)]
    for layer in dev.layers(Family.KV):
        dev.k(layer)[pages] = float("nan")
        if cache.spec.kv is not None and cache.spec.kv.values:
            dev.v(layer)[pages] = float("nan")
    for layer in dev.layers(Family.INDEXER):
        dev.indexer(layer)[pages] = float("nan")
    for layer in dev.layers(Family.MAMBA):
        dev.conv(layer)[slots] = float("nan")
        dev.ssm(layer)[slots] = float("nan")


# -- a request, the way a serving engine drives the cache -------------------------------


@dataclass(frozen=True, slots=True)
class Served:
    """What one driven request saw: the match, the agreed prefix, and where it came from."""

    hit: PrefixHit
    prefix: int
    served: tuple[int, int, int]
    mismatches: int
    cache_full: bool = False


ABORTS = (None, "match", "load", "alloc")


def serve(
    cache: HiCache,
    tokens: list[int],
    *,
    namespace: str = "",
    tenant: str | None = None,
    checkpoints: tuple[int, ...] | None = None,
    abort: str | None = None,
) -> Served:
    """match -> load -> finish_load -> alloc -> write -> insert (per checkpoint) -> release.

    ``tokens``: whole pages. ``tenant``: the request's tenant (None: the cache's).
    ``checkpoints``: page counts at which a Mamba state is inserted (default: only the
    end; without Mamba: the page counts inserted). ``abort``: release right after
    ``match``, after ``load`` (no ``finish_load``) or after ``alloc_pages`` (nothing
    inserted).
    Never raises on a mismatch (that would hang peer ranks): it is counted instead.
    """
    assert len(tokens) % PS == 0 and abort in ABORTS
    effective = cache.config.tenant if tenant is None else tenant
    hashes = hashes_of(tokens, tenant_namespace(effective, namespace))
    n = len(hashes)
    req = cache.match(tokens, namespace, tenant=tenant)
    try:
        if abort == "match":
            return Served(req.hit, 0, (0, 0, 0), 0)
        cache.load(req)
        if abort == "load":
            return Served(req.hit, 0, (0, 0, 0), 0)
        prefix = cache.finish_load(req)
        bad = count_mismatches(cache, req, hashes)
        done = prefix // PS
        try:
            new = cache.alloc_pages(req, n - done)
            pages = req.prefix_pages[:done] + new
            write_pages(cache, hashes[done:], new)
            if abort == "alloc":
                return Served(req.hit, prefix, req.served, bad)
            for b in checkpoints or (n,):
                if b <= done:
                    continue
                if not cache.spec.has_mamba:  # no state: the pages alone are the hit
                    cache.insert(req, tokens[: b * PS], pages[:b])
                    continue
                slot = cache.alloc_slot(req)
                write_state(cache, hashes[b - 1], slot)
                cache.insert(req, tokens[: b * PS], pages[:b], mamba_slot=slot)
        except CacheFull:
            return Served(req.hit, prefix, req.served, bad, cache_full=True)
        return Served(req.hit, prefix, req.served, bad)
    finally:
        cache.release(req)


# -- whole-cache checks ------------------------------------------------------------------


def evict_everything(cache: HiCache) -> None:
    """Evict every tier until the tree is empty (no write-back: tests the accounting)."""
    inner = internals(cache)
    alloc, tree = inner.allocator, inner.tree
    for _ in range(100):
        before = tree.num_nodes
        alloc.reclaim(tree.evict_device(10**6))
        alloc.reclaim(tree.evict_mamba_device(10**6))
        alloc.reclaim(tree.evict_host(10**6))
        alloc.reclaim(tree.evict_mamba_host(10**6))
        if tree.num_nodes == 0 or tree.num_nodes == before:
            return


def pools_fully_free(cache: HiCache) -> bool:
    allocators = [cache.device.page_allocator, cache.device.slot_allocator]
    host = internals(cache).host
    if host is not None:
        allocators += [host.page_allocator, host.slot_allocator]
    return all(a.num_used == 0 for a in allocators)


def _registry_hashes() -> set[str]:
    any_ns = KeyNamespace(model_id="m", dtype="float32", layout_version=1)
    return {entry_key(any_ns, i).page_hash.hex() for i in range(MAX_LAYOUTS)}


def registry_entries(root: Path | str) -> int:
    """Writer-layout registry entries (``tiers/discovery.py``) stored under ``root``."""
    registry = _registry_hashes()
    count = 0
    for dirpath, _dirs, files in os.walk(root):
        if os.path.basename(dirpath) in registry:
            count += sum(not name.startswith(".tmp-") for name in files)
    return count


def stored_objects(root: Path | str) -> list[tuple[str, str, str]]:
    """(region, page hash hex, slice tag) of every page/state object file under ``root``
    (the writer-layout registry entries of ``tiers/discovery.py`` left out)."""
    registry = _registry_hashes()
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if name.startswith(".tmp-"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root).split(os.sep)
            assert len(rel) == 5 and rel[0] == "v1", rel
            if rel[3] not in registry:
                out.append((rel[2], rel[3], rel[4]))
    return out


class RaisingBackend(StorageBackend):
    """A backend whose every call raises (a lost store)."""

    def exists(self, keys):
        raise ConnectionError("store unreachable")

    def get(self, keys, dst):
        raise ConnectionError("store unreachable")

    def put(self, keys, src):
        raise ConnectionError("store unreachable")

    def close(self):
        raise ConnectionError("store unreachable")
