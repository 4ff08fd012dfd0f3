"""Test bodies that run inside the services' network namespace (in a ``NetnsWorker``).

Each function is module-level (pickled by name). State that lives across calls of one
worker (the open storage, the host pools) is kept in ``_STATE``. Bodies return plain
data; the tests assert on it in the pytest process.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage.guard import GuardedStorage
from mesh_hicache.storage.keys import (
    KeyNamespace,
    ObjectCodec,
    StorageKey,
    encode_object,
    tensor_bytes,
)
from mesh_hicache.storage.mooncake import MooncakeStorage

_STATE: dict[str, Any] = {}

NAMESPACE = KeyNamespace(model_id="test/hybrid", dtype="bfloat16", layout_version=1)
KV_SLICE = GlobalSlice(layers=(0, 2), heads=(0, 4), tokens=(0, 16))
MAMBA_SLICE = GlobalSlice(layers=(0, 2), heads=(0, 4), tokens=(0, 1))


def key(region: str, index: int, tag: str = "") -> StorageKey:
    """The key of page/slot ``index`` of ``region``; ``tag`` separates test runs."""
    page_hash = f"{tag}:{region}:{index}".encode()
    sl = KV_SLICE if region in ("kv", "indexer") else MAMBA_SLICE
    return StorageKey(NAMESPACE, region, page_hash, sl)


def make_pools(seed: int, pages: int = 6, slots: int = 3) -> dict[str, torch.Tensor]:
    """Host pools with random bits: KV bf16 [page, kv, layer, token, head, dim], Mamba
    conv fp32 [slot, layer, conv_dim, kernel-1] and SSM fp32 [slot, layer, head, dim,
    state]. Random bit patterns (NaNs and infs included) make any conversion visible.
    """
    g = torch.Generator().manual_seed(seed)

    def bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        raw = out.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
        return out

    return {
        "kv": bits((pages, 2, 2, 16, 4, 8), torch.bfloat16),
        "mamba_conv": bits((slots, 2, 32, 3), torch.float32),
        "mamba_ssm": bits((slots, 2, 4, 8, 16), torch.float32),
    }


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tensor_bytes(a.contiguous()) == tensor_bytes(b.contiguous())


def open_storage(master_address: str, **options: Any) -> None:
    """Open a MooncakeStorage in this worker (closing any previous one)."""
    close_storage()
    _STATE["storage"] = MooncakeStorage(master_address, **options)


def close_storage() -> None:
    storage = _STATE.pop("storage", None)
    if storage is not None:
        storage.close()


def storage() -> Any:
    return _STATE["storage"]


def stats() -> dict[str, Any]:
    s = storage().stats
    out = {name: getattr(s, name) for name in s.__slots__}
    if isinstance(storage(), MooncakeStorage):
        out["dropped_by_code"] = storage().dropped_by_code
    return out


def round_trip(seed: int, tag: str, register: bool) -> dict[str, Any]:
    """Put every row of fresh pools, read them into zeroed pools, compare bit for bit."""
    st: MooncakeStorage = storage()
    src = make_pools(seed)
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    if register:
        for pool in (*src.values(), *dst.values()):
            st.register_buffer(pool)
    zero_copy = all(
        st.is_registered(pool[i]) for pool in (*src.values(), *dst.values()) for i in range(2)
    )
    put_flags: list[bool] = []
    get_flags: list[bool] = []
    for region, pool in src.items():
        keys = [key(region, i, tag) for i in range(pool.shape[0])]
        put_flags += st.put(keys, [pool[i] for i in range(pool.shape[0])])
    for region, pool in dst.items():
        keys = [key(region, i, tag) for i in range(pool.shape[0])]
        get_flags += st.get(keys, [pool[i] for i in range(pool.shape[0])])
    return {
        "zero_copy": zero_copy,
        "staging_bytes": st._staging.tensor.numel(),
        "put": put_flags,
        "get": get_flags,
        "equal": {name: _bits_equal(src[name], dst[name]) for name in src},
    }


def exists_prefix(tag: str, present: list[int], total: int) -> dict[str, Any]:
    """Put pages ``present`` of ``total`` and report ``exists`` over several key lists."""
    st = storage()
    pool = make_pools(7)["kv"]
    st.put([key("kv", i, tag) for i in present], [pool[i % pool.shape[0]] for i in present])
    keys = [key("kv", i, tag) for i in range(total)]
    again = st.put([key("kv", present[0], tag)], [pool[present[0] % pool.shape[0]]])
    return {
        "all": st.exists(keys),
        "from_missing": st.exists(keys[total - 1 :]),
        "empty": st.exists([]),
        "single": [st.exists_one(k) for k in keys],
        "again": again,
    }


def put_pages(seed: int, tag: str) -> list[bool]:
    """Put the KV and Mamba rows of ``make_pools(seed)`` from registered pools."""
    st = storage()
    src = make_pools(seed)
    flags: list[bool] = []
    for region, pool in src.items():
        st.register_buffer(pool)
        _STATE.setdefault("keep", []).append(pool)
        flags += st.put(
            [key(region, i, tag) for i in range(pool.shape[0])],
            [pool[i] for i in range(pool.shape[0])],
        )
    return flags


def get_pages(seed: int, tag: str) -> dict[str, Any]:
    """Read the rows that ``put_pages(seed, tag)`` wrote; compare with a regenerated copy."""
    st = storage()
    want = make_pools(seed)
    flags: list[bool] = []
    equal = {}
    for region, ref in want.items():
        pool = torch.zeros_like(ref)
        st.register_buffer(pool)
        _STATE.setdefault("keep", []).append(pool)
        flags += st.get(
            [key(region, i, tag) for i in range(pool.shape[0])],
            [pool[i] for i in range(pool.shape[0])],
        )
        equal[region] = _bits_equal(pool, ref)
    return {"get": flags, "equal": equal}


def fill(tag: str, count: int, nbytes: int) -> dict[str, Any]:
    """Put ``count`` objects of ``nbytes`` each (more than the store holds)."""
    st: MooncakeStorage = storage()
    pool = torch.arange(count * nbytes, dtype=torch.int64).to(torch.uint8).view(count, nbytes)
    st.register_buffer(pool)
    _STATE.setdefault("keep", []).append(pool)
    keys = [key("kv", i, tag) for i in range(count)]
    flags = st.put(keys, [pool[i] for i in range(count)])
    stored = [i for i, ok in enumerate(flags) if ok]
    out = torch.zeros(len(stored), nbytes, dtype=torch.uint8)
    hits = st.get([keys[i] for i in stored], [out[j] for j in range(len(stored))])
    return {
        "flags": flags,
        "hits": hits,
        "equal": bool(torch.equal(out, pool[stored])),
    }


def corrupt_objects(tag: str) -> dict[str, Any]:
    """Write damaged objects under valid keys with Mooncake's raw ``put``; read them back."""
    st: MooncakeStorage = storage()
    raw = st._store
    row = make_pools(3)["kv"][0]
    payload = bytes(tensor_bytes(row))
    good = encode_object(key("kv", 0, tag).to_str(), payload)
    flipped = bytearray(encode_object(key("kv", 1, tag).to_str(), payload))
    flipped[-5] ^= 0x40
    foreign = encode_object(key("kv", 99, tag).to_str(), payload)
    codes = [
        raw.put(key("kv", 0, tag).to_str(), good),
        raw.put(key("kv", 1, tag).to_str(), bytes(flipped)),
        raw.put(key("kv", 2, tag).to_str(), foreign),
        raw.put(key("kv", 3, tag).to_str(), good[:-100]),
        raw.put(key("kv", 4, tag).to_str(), b"not an object at all, far too short"),
    ]
    dst = [torch.zeros_like(row) for _ in range(5)]
    hits = st.get([key("kv", i, tag) for i in range(5)], dst)
    return {"codes": codes, "hits": hits, "good_equal": _bits_equal(dst[0], row)}


def sealed_objects(tag: str) -> dict[str, Any]:
    """With a secret set (the open storage's), forgeries written with the raw ``put``: a
    CRC-valid object, one sealed under another tenant's secret, one whose payload was
    changed after sealing; then a real put. Read all back."""
    st: MooncakeStorage = storage()
    raw = st._store
    row = make_pools(4)["kv"][0]
    payload = bytes(tensor_bytes(row))
    # The forger has seen the (secret-derived) names in the store.
    names = [st.key_str(key("kv", i, tag)) for i in range(4)]
    tampered = bytearray(st.codec.encode_object(names[2], payload))
    tampered[-5] ^= 0x40
    codes = [
        raw.put(names[0], encode_object(names[0], payload)),
        raw.put(names[1], ObjectCodec(b"another tenant's secret").encode_object(names[1], payload)),
        raw.put(names[2], bytes(tampered)),
    ]
    put_ok = st.put_one(key("kv", 3, tag), row)
    dst = [torch.zeros_like(row) for _ in range(4)]
    hits = st.get([key("kv", i, tag) for i in range(4)], dst)
    return {"codes": codes, "put": put_ok, "hits": hits, "equal": _bits_equal(dst[3], row)}


# -- degraded mode ---------------------------------------------------------------------------


def open_guarded(master_address: str, retry_interval_s: float, **options: Any) -> None:
    """A GuardedStorage over a lazily built MooncakeStorage (what the cache uses)."""
    close_storage()
    _STATE["storage"] = GuardedStorage(
        connect=lambda: MooncakeStorage(master_address, **options),
        retry_interval_s=retry_interval_s,
    )


def timed_guarded_calls(seed: int, tag: str, calls: int) -> dict[str, Any]:
    """``guarded_get_after_outage`` plus the wall time of each call (exists + get)."""
    st: GuardedStorage = storage()
    src = make_pools(seed)["kv"]
    keys = [key("kv", i, tag) for i in range(src.shape[0])]
    seconds, results = [], []
    for _ in range(calls):
        start = time.monotonic()
        results.append({"exists": st.exists(keys), "get": st.get(keys, list(src.clone()))})
        seconds.append(time.monotonic() - start)
    return {"results": results, "seconds": seconds, "degraded": st.degraded}


def guarded_round_trip(seed: int, tag: str) -> dict[str, Any]:
    """One put + get through the guard; also reports whether it is degraded."""
    st: GuardedStorage = storage()
    src = make_pools(seed)["kv"]
    dst = torch.zeros_like(src)
    keys = [key("kv", i, tag) for i in range(src.shape[0])]
    put = st.put(keys, list(src))
    found = st.exists(keys)
    got = st.get(keys, list(dst))
    return {
        "put": put,
        "exists": found,
        "get": got,
        "equal": _bits_equal(src, dst),
        "degraded": st.degraded,
    }


def guarded_get_after_outage(seed: int, tag: str, calls: int) -> dict[str, Any]:
    """``calls`` gets of pages stored before the outage; all must answer (as misses)."""
    st: GuardedStorage = storage()
    src = make_pools(seed)["kv"]
    keys = [key("kv", i, tag) for i in range(src.shape[0])]
    results = []
    for _ in range(calls):
        dst = torch.zeros_like(src)
        results.append({"exists": st.exists(keys), "get": st.get(keys, list(dst))})
    return {"results": results, "degraded": st.degraded, "errors": st.stats.errors}


def guarded_wait_recovered(seed: int, tag: str, timeout_s: float) -> dict[str, Any]:
    """Retry a put through the guard until it is stored again (bounded by ``timeout_s``)."""
    st: GuardedStorage = storage()
    src = make_pools(seed)["kv"]
    keys = [key("kv", i, tag) for i in range(src.shape[0])]
    deadline = time.monotonic() + timeout_s
    attempts = 0
    while time.monotonic() < deadline:
        attempts += 1
        if all(st.put(keys, list(src))):
            break
        time.sleep(0.2)
    return {"attempts": attempts, **guarded_round_trip(seed, tag)}


def construct_against_dead_master(address: str) -> dict[str, Any]:
    """Build a guarded store whose master does not exist; report what the cache sees."""
    guard = GuardedStorage(connect=lambda: MooncakeStorage(address), retry_interval_s=60)
    k = key("kv", 0, "dead")
    out = {"exists": guard.exists([k]), "get": guard.get([k], [torch.zeros(4)])}
    out.update(degraded=guard.degraded, errors=guard.stats.errors)
    guard.close()
    return out


# -- ranged reads ----------------------------------------------------------------------------


def ranged_reads(tag: str) -> dict[str, Any]:
    """A ranged read of SSM heads 2..3 of a stored state row (format version 2), once into
    an unregistered buffer (staged) and once into a registered pool row; a format version 1
    object written with the raw ``put`` read through ``get_ranges`` (read whole)."""
    st: MooncakeStorage = storage()
    pools = make_pools(21)
    st.register_buffer(pools["mamba_ssm"])
    row = pools["mamba_ssm"][0]  # [2 (layer), 4 (head), 8 (dim), 16 (state)] fp32
    head = 8 * 16 * row.element_size()
    ranges = [((layer * 4 + 2) * head, 2 * head) for layer in range(2)]
    put = st.put_one(key("mamba_ssm", 0, tag), row)
    before = st.stats
    staged = torch.zeros_like(row)
    got = st.get_ranges([key("mamba_ssm", 0, tag)], [staged], [ranges])
    after = st.stats
    into_pool = pools["mamba_ssm"][1]
    into_pool.zero_()
    got_pool = st.get_ranges([key("mamba_ssm", 0, tag)], [into_pool], [ranges])
    legacy = key("mamba_ssm", 1, tag)
    st._store.put(legacy.to_str(), encode_object(legacy.to_str(), bytes(tensor_bytes(row))))
    old = torch.zeros_like(row)
    got_old = st.get_ranges([legacy], [old], [ranges])
    missing = st.get_ranges([key("mamba_ssm", 2, tag)], [torch.zeros_like(row)], [ranges])
    return {
        "put": put,
        "hits": got + got_pool + got_old + missing,
        "heads_equal": _bits_equal(staged[:, 2:4], row[:, 2:4])
        and _bits_equal(into_pool[:, 2:4], row[:, 2:4]),
        "others_untouched": bool((staged[:, :2].view(torch.int32) == 0).all()),
        "old_equal": _bits_equal(old, row),
        "bytes_read": after.get_bytes - before.get_bytes,
        "row_bytes": row.numel() * row.element_size(),
        "range_gets": after.range_gets - before.range_gets,
    }
