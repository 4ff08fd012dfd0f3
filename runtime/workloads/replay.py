"""Replay a trace through the real ``HiCache`` with the engine's cache calls, no model.

``Replayer.serve`` makes exactly the cache calls ``runtime.engine.Engine.serve`` makes for
a prompt and a reply of known length: match one token short, load, finish_load,
alloc_pages for prompt + reply, a Mamba checkpoint at the prompt's branch point (where it
left a cached KV path that had no state) and, only when decoding will not reach a page
boundary, at its last page boundary (admission: docs/DESIGN.md section 9), the inserts of
the prompt checkpoints, a checkpoint at the last page boundary reached while decoding,
its insert, release. Only the model's compute and the tensor copies are skipped, so the
tree, the allocators and eviction see the same sequence of decisions as in the engine
(``tests/unit/test_replay.py`` checks that request by request on the ``tiny`` model).

Tiers come from byte budgets and a ``ModelProfile`` (``budget_config``): by default one
arena per tier, over a small ``StateSpec`` (``arena_spec``) whose page and state bytes
keep the profile's ratio, the budgets scaled to match, so the arena holds the blocks
the model's would; or fixed pools over a *tiny* spec (``tiny_spec``: only the page and
slot counts matter then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mesh_hicache.cache import CachedRequest, CacheFull, HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.pools.arena import ArenaPlan
from mesh_hicache.radix.eviction import EvictionPolicy
from mesh_hicache.spec import KVSpec, MambaSpec, StateSpec
from mesh_hicache.topology import MeshTopology
from runtime.workloads.profiles import ModelProfile

TIERS = ("device", "host", "storage")


def tiny_spec(page_size: int, has_mamba: bool) -> StateSpec:
    """A ``StateSpec`` with the smallest shapes: layer 0 attention, layer 1 SSM."""
    kv = KVSpec(layer_ids=(0,), num_kv_heads=1, head_dim=1, dtype=torch.float16)
    mamba = None
    if has_mamba:
        mamba = MambaSpec(
            layer_ids=(1,),
            conv_dim=1,
            conv_kernel=2,
            num_heads=1,
            head_dim=1,
            state_dim=1,
            conv_dtype=torch.float16,
            ssm_dtype=torch.float16,
        )
    return StateSpec(page_size=page_size, kv=kv, mamba=mamba, model_id="replay")


def fixed_split(budget_bytes: int, page_bytes: int, state_bytes: int) -> tuple[int, int]:
    """(pages, slots) of the largest pool that fits ``budget_bytes`` under the current
    fixed split of ``HiCacheConfig`` (slots = ``mamba_device_slots()`` of the pages).

    ``state_bytes`` 0 means no SSM (slots 0). ``ValueError`` when not even one page fits.
    """

    def slots(pages: int) -> int:
        return HiCacheConfig(device_pages=pages).mamba_device_slots() if state_bytes else 0

    def cost(pages: int) -> int:
        return pages * page_bytes + slots(pages) * state_bytes

    if budget_bytes < cost(1):
        raise ValueError(
            f"a budget of {budget_bytes} bytes holds not even one page ({page_bytes} B) "
            f"and {slots(1)} states ({state_bytes} B each)"
        )
    lo, hi = 1, budget_bytes // page_bytes
    while lo < hi:  # the largest pages with cost(pages) <= budget (cost is monotonic)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget_bytes else (lo, mid - 1)
    return lo, slots(lo)


def share_split(
    budget_bytes: int, page_bytes: int, state_bytes: int, state_share: float
) -> tuple[int, int]:
    """(pages, slots) with ``state_share`` of ``budget_bytes`` for states, the rest for
    pages (an explicit fixed split, to compare with the rule of ``fixed_split``).

    ``ValueError`` for a share outside (0, 1) or when a pool would be empty.
    """
    if not 0.0 < state_share < 1.0:
        raise ValueError(f"state_share must be in (0, 1), got {state_share}")
    slots = int(budget_bytes * state_share) // state_bytes if state_bytes else 0
    pages = (budget_bytes - slots * state_bytes) // page_bytes
    if pages < 1 or (state_bytes and slots < 1):
        raise ValueError(
            f"a budget of {budget_bytes} bytes with state_share={state_share} gives "
            f"{pages} pages ({page_bytes} B) and {slots} states ({state_bytes} B)"
        )
    return pages, slots


#: Bytes of one KV page of ``arena_spec``: small tensors, yet fine enough that a state's
#: bytes keep the profile's state : page ratio to within 16 bytes.
ARENA_PAGE_BYTES = 1024
SPLITS = ("arena", "rule", "share")


def arena_spec(profile: ModelProfile, page_size: int) -> tuple[StateSpec, float]:
    """A small ``StateSpec`` whose page and state bytes are the profile's scaled by one
    factor (returned), so an arena of ``budget * factor`` bytes holds what the model's
    arena of ``budget`` holds: the same blocks per page and per state."""
    head_dim = max(1, ARENA_PAGE_BYTES // (4 * page_size))  # K and V, fp16
    kv = KVSpec(layer_ids=(0,), num_kv_heads=1, head_dim=head_dim, dtype=torch.float16)
    scale = page_size * 4 * head_dim / profile.page_bytes(page_size)
    mamba = None
    if profile.has_ssm:
        # conv row: 2 bytes aligned to 16; ssm row: 2 * state_dim bytes (a multiple of 16).
        state_dim = max(8, round((profile.state_bytes * scale - 16) / 16) * 8)
        mamba = MambaSpec(
            layer_ids=(1,),
            conv_dim=1,
            conv_kernel=2,
            num_heads=1,
            head_dim=1,
            state_dim=state_dim,
            conv_dtype=torch.float16,
            ssm_dtype=torch.float16,
        )
    return StateSpec(page_size=page_size, kv=kv, mamba=mamba, model_id="replay"), scale


def budget_config(
    profile: ModelProfile,
    page_size: int,
    device_bytes: int,
    host_bytes: int = 0,
    state_share: float | None = None,
    policy: str | EvictionPolicy = "cost",
    split: str = "arena",
    write_policy: str = "write_back",
) -> HiCacheConfig:
    """A ``HiCacheConfig`` whose L1 (and L2 when ``host_bytes`` > 0) fit the byte budgets.

    ``split``: ``arena`` (one arena per tier, the cache's byte budget; the spec is then
    ``arena_spec`` and the budgets are scaled by its factor), ``rule`` (fixed pools by
    ``HiCacheConfig``'s slot rule, ``fixed_split``) or ``share`` (fixed pools with
    ``state_share`` of each budget for states, ``share_split``; a given ``state_share``
    implies it). ``policy``: the eviction policy, ranking by the profile's bytes and FLOPs
    (``ModelProfile.cost_model``). ``write_policy`` (with L2): ``write_back`` (what L1
    evicts, pages and states, goes to L2, which evicts by the same policy) or
    ``write_through`` (every insert is copied to L2)."""
    if state_share is not None:
        split = "share"
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; choose from {SPLITS}")
    pb, sb = profile.page_bytes(page_size), profile.state_bytes
    common: dict[str, Any] = dict(transfer="cpu", eviction_policy=policy)
    common["cost_model"] = profile.cost_model()
    if host_bytes > 0:
        common["write_policy"] = write_policy
    else:
        common["enable_host"] = False
    if split == "arena":
        # ValueError naming the model's bytes when a budget holds no page or no state.
        for budget in (device_bytes, host_bytes) if host_bytes > 0 else (device_bytes,):
            ArenaPlan.for_budget(budget, pb, sb)
        _, scale = arena_spec(profile, page_size)
        if host_bytes > 0:
            common["host_bytes"] = int(host_bytes * scale)
        return HiCacheConfig(device_bytes=int(device_bytes * scale), **common)

    def pools(budget: int) -> tuple[int, int]:
        if split == "rule":
            return fixed_split(budget, pb, sb)
        assert state_share is not None, "split='share' needs state_share"
        return share_split(budget, pb, sb, state_share)

    pages, slots = pools(device_bytes)
    if host_bytes > 0:
        common["host_pages"], common["host_mamba_slots"] = pools(host_bytes)
    return HiCacheConfig(device_pages=pages, device_mamba_slots=slots, **common)


def budget_cache(
    topology: MeshTopology,
    profile: ModelProfile,
    page_size: int,
    device_bytes: int,
    host_bytes: int = 0,
    state_share: float | None = None,
    policy: str | EvictionPolicy = "cost",
    split: str = "arena",
    write_policy: str = "write_back",
) -> HiCache:
    """A ``HiCache`` on ``topology`` with small tensors and the tiers of ``budget_config``.
    Collective."""
    config = budget_config(profile, page_size, device_bytes, host_bytes, state_share, policy, split)
    if config.device_bytes:
        spec = arena_spec(profile, page_size)[0]
    else:
        spec = tiny_spec(page_size, profile.has_ssm)
    return HiCache(topology, spec, config)


def decode_writes_checkpoint(prompt_len: int, num_new: int, page_size: int) -> bool:
    """Whether decoding ``num_new`` tokens after a prompt of ``prompt_len`` reaches a page
    boundary (the engine feeds ``num_new - 1`` tokens back), i.e. writes the decode
    checkpoint that makes the prompt-end checkpoints redundant (``runtime.engine``)."""
    return (prompt_len + num_new - 1) // page_size > prompt_len // page_size


@dataclass(frozen=True, slots=True)
class Served:
    """What the cache did for one request."""

    input_tokens: int
    reused: tuple[int, int, int]
    """Prompt tokens reused from (device, host, storage): the engine's ``cached_*``."""
    paged: bool
    """False when the request did not fit in L1 and was served uncached."""
    checkpoints: int
    """Mamba states inserted (prompt and decode checkpoints)."""

    @property
    def reused_tokens(self) -> int:
        return sum(self.reused)


@dataclass(slots=True)
class _Checkpoint:
    num_tokens: int
    slot: int


@dataclass(slots=True)
class Replayer:
    """Drives ``cache`` as ``runtime.engine.Engine`` would, without a model.

    ``flush_each``: wait for every device -> host backup after each request, so the
    result does not depend on the copy thread's timing (the engine test does the same
    between engine requests).
    """

    cache: HiCache
    flush_each: bool = True

    def serve(self, prompt: Sequence[int], output: Sequence[int], namespace: str = "") -> Served:
        """The cache calls of ``Engine.serve(prompt)`` when it generates ``output``
        (``max_new_tokens = len(output)``). Collective, like the engine."""
        if not prompt:
            raise ValueError("prompt must not be empty")
        if not output:
            raise ValueError("output must not be empty (the engine generates >= 1 token)")
        cache = self.cache
        req = cache.match(prompt[:-1], namespace)
        try:
            served = self._serve(req, list(prompt), list(output))
        finally:
            cache.release(req)
        if self.flush_each:
            cache.flush()
        return served

    def _serve(self, req: CachedRequest, prompt: list[int], output: list[int]) -> Served:
        cache = self.cache
        ps, has_mamba, n = cache.page_size, cache.spec.has_mamba, len(prompt)
        cache.load(req)
        prefix = cache.finish_load(req)
        hit, reused = req.hit, req.served
        total_pages = -(-(n + len(output)) // ps)
        pages: list[int] | None = None
        try:
            new = cache.alloc_pages(req, total_pages - prefix // ps)
            pages = req.prefix_pages[: prefix // ps] + new
        except CacheFull:
            pass  # Longer than L1 can hold: the engine serves it uncached.
        # Admission (as the engine): the prompt-end checkpoints only when decoding will
        # not reach a page boundary and write the one the next turn resumes from.
        decode_cp = decode_writes_checkpoint(n, len(output), ps)
        branch = hit.raw_kv_tokens if prefix < hit.raw_kv_tokens < n else None
        stops = set()
        if has_mamba:
            if branch is not None:
                stops.add(branch)
            if not decode_cp:
                stops.add((n - 1) // ps * ps)
        stops = {s for s in stops if prefix < s <= n} | {n}
        checkpoints: list[_Checkpoint] = []
        for stop in sorted(stops):
            if stop % ps == 0 and has_mamba and pages is not None:
                if decode_cp and stop == n:
                    continue
                cp = self._checkpoint(req, stop)
                if cp is not None:
                    checkpoints.append(cp)
        if pages is None:
            return Served(n, reused, False, 0)
        for cp in checkpoints:
            cache.insert(req, prompt[: cp.num_tokens], pages[: cp.num_tokens // ps], cp.slot)
        if not has_mamba and n >= ps:
            m = n // ps * ps
            cache.insert(req, prompt[:m], pages[: m // ps])
        # Decode: the engine feeds len(output) - 1 generated tokens back (the last one is
        # returned, not fed) and checkpoints at each page boundary it reaches, retrying
        # the slot allocation until one succeeds and then rewriting that slot.
        boundary: _Checkpoint | None = None
        num_tokens = n
        for _ in range(len(output) - 1):
            num_tokens += 1
            if num_tokens % ps == 0 and has_mamba:
                if boundary is None:
                    boundary = self._checkpoint(req, num_tokens)
                else:
                    boundary.num_tokens = num_tokens
        full = prompt + output
        inserted = len(checkpoints)
        if boundary is not None:
            m = boundary.num_tokens
            cache.insert(req, full[:m], pages[: m // ps], boundary.slot)
            inserted += 1
        elif not has_mamba and num_tokens >= ps:
            m = num_tokens // ps * ps
            cache.insert(req, full[:m], pages[: m // ps])
        return Served(n, reused, True, inserted)

    def _checkpoint(self, req: CachedRequest, num_tokens: int) -> _Checkpoint | None:
        """A device slot for the state after ``num_tokens``; None when none is free."""
        try:
            return _Checkpoint(num_tokens, self.cache.alloc_slot(req))
        except CacheFull:
            return None
